//! The netlink layer against a real kernel, each test in its own network namespace.
//!
//! The socket is opened inside the namespace: `NetNs::enter` runs a closure on a thread that
//! joined the namespace, and the closure builds a current-thread tokio runtime there.
//! Results are cross-checked with `ip` and `bridge` output where that adds confidence.
//!
//! Run: `cargo test -p flannel-tests --test netlink` (as root; skipped otherwise).

use std::{
    collections::BTreeSet,
    future::Future,
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use flannel_agent::netlink::{
    Incompatibility, IpFamily, LinkEvent, LinkEvents, NeighbourFlags, NeighbourState, Netlink,
    NetlinkError, Op, RECEIVE_BUFFER_BYTES, RTPROT_FLANNEL, Route, RouteFilter, RouteKind,
    RouteScope, VxlanEnsure, VxlanSpec,
};
use flannel_tests::{netns::NetNs, require_root};
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

const MAC_A: [u8; 6] = [0x0e, 0x2a, 0, 0, 0, 0x0a];
const MAC_B: [u8; 6] = [0x0e, 0x2a, 0, 0, 0, 0x0b];
const ZERO_MAC: [u8; 6] = [0; 6];
const LOCAL: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 2);

/// Fails the test with the whole error chain.
fn check(result: Result<()>) {
    if let Err(e) = result {
        panic!("{e:#}");
    }
}

/// Runs `f` on a current-thread runtime inside `ns`.
fn in_ns<F, Fut, R>(ns: &NetNs, f: F) -> Result<R>
where
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = Result<R>>,
    R: Send,
{
    ns.enter(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("tokio runtime")?;
        rt.block_on(f())
    })?
}

/// A namespace with a veth pair `ul0` (192.168.50.1/24, fd00:50::1/64) / `ul1`, both up:
/// the fake underlay.
fn underlay_ns(suffix: &str) -> Result<NetNs> {
    let ns = NetNs::new(suffix)?;
    ns.run(&[
        "ip", "link", "add", "ul0", "type", "veth", "peer", "name", "ul1",
    ])?;
    ns.run(&["ip", "addr", "add", "192.168.50.1/24", "dev", "ul0"])?;
    ns.run(&["ip", "addr", "add", "fd00:50::1/64", "dev", "ul0", "nodad"])?;
    ns.run(&["ip", "link", "set", "ul0", "up"])?;
    ns.run(&["ip", "link", "set", "ul1", "up"])?;
    Ok(ns)
}

async fn index_of(nl: &Netlink, name: &str) -> Result<u32> {
    Ok(nl
        .link_by_name(name)
        .await?
        .with_context(|| format!("link {name} not found"))?
        .index)
}

fn net(s: &str) -> IpNet {
    s.parse()
        .unwrap_or_else(|e| panic!("bad test prefix {s}: {e}"))
}

fn ip(s: &str) -> IpAddr {
    s.parse()
        .unwrap_or_else(|e| panic!("bad test address {s}: {e}"))
}

fn flannel1_spec(underlay: u32) -> VxlanSpec {
    let mut spec = VxlanSpec::new("flannel.1", 1);
    spec.local = Some(LOCAL.into());
    spec.underlay_index = Some(underlay);
    spec.mtu = Some(1450);
    spec.mac = Some(MAC_A);
    spec
}

#[test]
fn netlink_needs_a_runtime() {
    let err = Netlink::new().err();
    assert!(matches!(err, Some(NetlinkError::Socket { .. })), "{err:?}");
}

#[test]
fn vxlan_devices_are_created_read_back_and_reused() {
    require_root!();
    check(vxlan_devices_are_created_read_back_and_reused_in_ns());
}

fn vxlan_devices_are_created_read_back_and_reused_in_ns() -> Result<()> {
    let ns = underlay_ns("nlvx")?;
    in_ns(&ns, || async {
        let nl = Netlink::new()?;
        ensure!(
            nl.receive_buffer_size() >= RECEIVE_BUFFER_BYTES,
            "receive buffer {} < {RECEIVE_BUFFER_BYTES}",
            nl.receive_buffer_size()
        );
        let ul0 = index_of(&nl, "ul0").await?;
        let spec = flannel1_spec(ul0);

        let VxlanEnsure::Created(link) = nl.ensure_vxlan(&spec).await? else {
            bail!("flannel.1 should have been created");
        };
        assert_eq!(link.name, "flannel.1");
        assert_eq!(link.kind.as_deref(), Some("vxlan"));
        assert_eq!(link.mtu, 1450);
        assert_eq!(link.mac, Some(MAC_A));
        assert!(!link.up);
        let vx = link.vxlan.clone().context("vxlan info")?;
        assert_eq!(vx.vni, 1);
        assert_eq!(vx.port, 8472, "kernel default port");
        assert_eq!(vx.local, Some(LOCAL.into()));
        assert_eq!(vx.underlay_index, Some(ul0));
        assert!(!vx.learning && !vx.gbp && !vx.external);
        let details = ns.run(&["ip", "-d", "link", "show", "flannel.1"])?;
        for needle in [
            "vxlan id 1 ",
            "local 192.168.50.1",
            "dev ul0",
            "dstport 8472",
            "nolearning",
            "mtu 1450",
            "0e:2a:00:00:00:0a",
        ] {
            assert!(details.contains(needle), "{needle:?} missing in {details}");
        }

        // Same spec again, and a spec differing only in MAC/MTU/learning: reused unchanged.
        let VxlanEnsure::Reused(again) = nl.ensure_vxlan(&spec).await? else {
            bail!("compatible flannel.1 should be reused");
        };
        assert_eq!(again.index, link.index);
        let mut loose = spec.clone();
        loose.mac = Some(MAC_B);
        loose.mtu = Some(1400);
        loose.learning = true;
        let VxlanEnsure::Reused(again) = nl.ensure_vxlan(&loose).await? else {
            bail!("MAC/MTU/learning differences must not force a recreate");
        };
        assert_eq!((again.mac, again.mtu), (Some(MAC_A), 1450));

        // Incompatible specs are reported, never acted upon.
        let cases: Vec<(VxlanSpec, Incompatibility)> = vec![
            (
                VxlanSpec {
                    vni: 2,
                    ..spec.clone()
                },
                Incompatibility::Vni { want: 2, found: 1 },
            ),
            (
                VxlanSpec {
                    port: Some(4789),
                    ..spec.clone()
                },
                Incompatibility::Port {
                    want: 4789,
                    found: 8472,
                },
            ),
            (
                VxlanSpec {
                    gbp: true,
                    ..spec.clone()
                },
                Incompatibility::Gbp {
                    want: true,
                    found: false,
                },
            ),
            (
                VxlanSpec {
                    external: true,
                    ..spec.clone()
                },
                Incompatibility::External {
                    want: true,
                    found: false,
                },
            ),
            (
                VxlanSpec {
                    local: Some(PEER.into()),
                    ..spec.clone()
                },
                Incompatibility::Local {
                    want: PEER.into(),
                    found: LOCAL.into(),
                },
            ),
            (
                VxlanSpec {
                    underlay_index: Some(1),
                    ..spec.clone()
                },
                Incompatibility::UnderlayIndex {
                    want: 1,
                    found: ul0,
                },
            ),
        ];
        for (bad, expected) in cases {
            match nl.ensure_vxlan(&bad).await? {
                VxlanEnsure::Incompatible { existing, problems } => {
                    assert_eq!(existing.index, link.index);
                    assert_eq!(problems, vec![expected]);
                }
                other => bail!("expected an incompatibility for {bad:?}, got {other:?}"),
            }
        }
        match nl.ensure_vxlan(&VxlanSpec::new("ul1", 1)).await? {
            VxlanEnsure::Incompatible { problems, .. } => assert_eq!(
                problems,
                vec![Incompatibility::Kind {
                    found: Some("veth".into())
                }]
            ),
            other => bail!("a veth is not a vxlan device: {other:?}"),
        }
        assert_eq!(
            index_of(&nl, "flannel.1").await?,
            link.index,
            "nothing was recreated"
        );

        // Creating over an existing name fails distinctly.
        let err = nl.create_vxlan(&spec).await.err();
        assert!(
            matches!(err, Some(NetlinkError::AlreadyExists { .. })),
            "{err:?}"
        );

        // Up, MTU, MAC.
        nl.set_link_up(link.index).await?;
        nl.set_mtu(link.index, 1400).await?;
        nl.set_mac(link.index, MAC_B).await?;
        let now = nl
            .link_by_index(link.index)
            .await?
            .context("flannel.1 by index")?;
        assert!(now.up);
        assert_eq!((now.mtu, now.mac), (1400, Some(MAC_B)));
        nl.set_link_down(link.index).await?;
        assert!(!nl.link_by_index(link.index).await?.context("flannel.1")?.up);

        // Delete and recreate with another VNI (what the caller does after Incompatible).
        nl.delete_link(link.index).await?;
        assert_eq!(nl.link_by_name("flannel.1").await?, None);
        assert_eq!(nl.link_by_index(link.index).await?, None);
        let err = nl.delete_link(link.index).await.err();
        assert!(
            matches!(err, Some(NetlinkError::NotFound { .. })),
            "{err:?}"
        );
        let VxlanEnsure::Created(v2) = nl
            .ensure_vxlan(&VxlanSpec {
                vni: 2,
                ..spec.clone()
            })
            .await?
        else {
            bail!("recreate");
        };
        assert_eq!(v2.vxlan.map(|v| v.vni), Some(2));

        // An external (collect_md) device with GBP and its own port.
        let mut ext = VxlanSpec::new("vxext", 0);
        ext.external = true;
        ext.port = Some(4789);
        ext.gbp = true;
        let ext_link = nl.create_vxlan(&ext).await?;
        let vx = ext_link.vxlan.context("vxlan info")?;
        assert!(vx.external && vx.gbp);
        assert_eq!((vx.vni, vx.port), (0, 4789));
        let details = ns.run(&["ip", "-d", "link", "show", "vxext"])?;
        assert!(details.contains("external"), "{details}");
        assert!(details.contains("gbp"), "{details}");

        // IPv6 outer with zero UDP checksums.
        let mut v6 = VxlanSpec::new("flannel-v6.1", 1);
        v6.local = Some(ip("fd00:50::1"));
        v6.underlay_index = Some(ul0);
        v6.udp6_zero_csum_tx = true;
        v6.udp6_zero_csum_rx = true;
        let v6_link = nl.create_vxlan(&v6).await?;
        let vx = v6_link.vxlan.context("vxlan info")?;
        assert_eq!(vx.local, Some(ip("fd00:50::1")));
        assert!(vx.udp6_zero_csum_tx && vx.udp6_zero_csum_rx);
        let details = ns.run(&["ip", "-d", "link", "show", "flannel-v6.1"])?;
        assert!(
            details.contains("udp6zerocsumtx udp6zerocsumrx"),
            "{details}"
        );

        let links = nl.list_links().await?;
        let names: BTreeSet<_> = links.iter().map(|l| l.name.as_str()).collect();
        for name in ["lo", "ul0", "ul1", "flannel.1", "vxext", "flannel-v6.1"] {
            assert!(names.contains(name), "{name} missing from {names:?}");
        }
        let ul1 = links.iter().find(|l| l.name == "ul1").context("ul1")?;
        assert_eq!(ul1.kind.as_deref(), Some("veth"));
        assert!(ul1.up);
        assert!(links.iter().any(|l| l.name == "lo" && l.kind.is_none()));
        Ok(())
    })
}

#[test]
fn ipip_and_wireguard_are_unsupported_on_this_kernel() {
    require_root!();
    check(ipip_and_wireguard_are_unsupported_on_this_kernel_in_ns());
}

fn ipip_and_wireguard_are_unsupported_on_this_kernel_in_ns() -> Result<()> {
    let ns = underlay_ns("nlun")?;
    in_ns(&ns, || async {
        let nl = Netlink::new()?;
        let ul0 = index_of(&nl, "ul0").await?;
        match nl.create_ipip("flannel.ipip", LOCAL, Some(ul0), None).await {
            Err(NetlinkError::Unsupported {
                kind, name, errno, ..
            }) => {
                assert_eq!((kind.as_str(), name.as_str()), ("ipip", "flannel.ipip"));
                assert_eq!(errno, libc::EOPNOTSUPP);
            }
            Ok(link) => eprintln!("this kernel has ipip after all ({link:?}); nothing to check"),
            Err(e) => bail!("expected Unsupported for ipip, got {e}"),
        }
        match nl.create_wireguard("flannel-wg", Some(1420)).await {
            Err(e @ NetlinkError::Unsupported { .. }) => {
                let text = e.to_string();
                assert!(text.contains("lacks the `wireguard` link type"), "{text}");
                // The kernel's extended-ack text is carried into the error.
                assert!(text.contains("Unknown device type"), "{text}");
            }
            Ok(link) => eprintln!("this kernel has wireguard after all ({link:?})"),
            Err(e) => bail!("expected Unsupported for wireguard, got {e}"),
        }
        assert_eq!(nl.link_by_name("flannel-wg").await?, None);
        // A bad name never reaches the kernel.
        let err = nl.create_wireguard("name-longer-than-15", None).await.err();
        assert!(matches!(err, Some(NetlinkError::Invalid { .. })), "{err:?}");
        Ok(())
    })
}

fn v4_addrs_on(ns: &NetNs, dev: &str) -> Result<BTreeSet<String>> {
    let out = ns.run(&["ip", "-4", "-o", "addr", "show", "dev", dev])?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().skip_while(|w| *w != "inet").nth(1))
        .map(str::to_owned)
        .collect())
}

#[test]
fn addresses_follow_upstream_ensure_semantics() {
    require_root!();
    check(addresses_follow_upstream_ensure_semantics_in_ns());
}

fn addresses_follow_upstream_ensure_semantics_in_ns() -> Result<()> {
    let ns = underlay_ns("nladdr")?;
    in_ns(&ns, || async {
        let nl = Netlink::new()?;
        let lo = index_of(&nl, "lo").await?;
        let ul0 = index_of(&nl, "ul0").await?;
        let v4 = |s: &str| -> Ipv4Net { s.parse().unwrap_or_default() };
        let v6 = |s: &str| -> Ipv6Net { s.parse().unwrap_or_default() };

        // Upstream iface_test, EnsureV4AddressOnLink on lo.
        let before = nl.list_addresses(lo, Some(IpFamily::V4)).await?;
        assert_eq!(
            before.iter().map(|a| a.addr).collect::<Vec<_>>(),
            vec![net("127.0.0.1/8")]
        );
        assert!(before[0].flags.permanent);
        let changes = nl
            .ensure_v4_address(lo, v4("127.0.0.2/24"), v4("127.0.0.0/24"))
            .await?;
        assert_eq!(changes.removed, vec![net("127.0.0.1/8")]);
        assert_eq!(changes.added, Some(net("127.0.0.2/24")));
        let after = nl.list_addresses(lo, Some(IpFamily::V4)).await?;
        assert_eq!(
            after.iter().map(|a| a.addr).collect::<Vec<_>>(),
            vec![net("127.0.0.2/24")]
        );
        assert_eq!(
            v4_addrs_on(&ns, "lo")?,
            BTreeSet::from(["127.0.0.2/24".to_owned()])
        );

        nl.add_address(lo, net("127.0.1.1/24")).await?;
        let changes = nl
            .ensure_v4_address(lo, v4("127.0.0.2/24"), v4("127.0.0.0/24"))
            .await?;
        assert_eq!(
            changes,
            Default::default(),
            "nothing to change the second time"
        );
        let after: BTreeSet<_> = nl
            .list_addresses(lo, Some(IpFamily::V4))
            .await?
            .iter()
            .map(|a| a.addr)
            .collect();
        assert_eq!(
            after,
            BTreeSet::from([net("127.0.0.2/24"), net("127.0.1.1/24")])
        );
        assert_eq!(
            v4_addrs_on(&ns, "lo")?,
            BTreeSet::from(["127.0.0.2/24".to_owned(), "127.0.1.1/24".to_owned()])
        );

        // Errors for duplicates and missing addresses.
        let err = nl.add_address(lo, net("127.0.1.1/24")).await.err();
        assert!(
            matches!(err, Some(NetlinkError::AlreadyExists { .. })),
            "{err:?}"
        );
        let err = nl.delete_address(lo, net("127.0.9.9/24")).await.err();
        assert!(
            matches!(err, Some(NetlinkError::NotFound { .. })),
            "{err:?}"
        );

        // ::1 on lo is host scoped.
        let lo6 = nl.list_addresses(lo, Some(IpFamily::V6)).await?;
        let one = lo6
            .iter()
            .find(|a| a.addr == net("::1/128"))
            .context("::1 on lo")?;
        assert_eq!(one.scope, flannel_agent::netlink::AddressScope::Host);

        // EnsureV6AddressOnLink on a veth (lo's ::1 would count as a foreign address):
        // wanted ::2/64; a later 2001::4/64 is removed by the second call, link-local stays.
        let changes = nl.ensure_v6_address(ul0, v6("::2/64")).await?;
        assert_eq!(changes.removed, vec![net("fd00:50::1/64")]);
        assert_eq!(changes.added, Some(net("::2/64")));
        nl.add_address(ul0, net("2001::4/64")).await?;
        let changes = nl.ensure_v6_address(ul0, v6("::2/64")).await?;
        assert_eq!(changes.removed, vec![net("2001::4/64")]);
        assert_eq!(changes.added, None);
        let global: Vec<_> = nl
            .list_addresses(ul0, Some(IpFamily::V6))
            .await?
            .into_iter()
            .filter(|a| !net("fe80::/10").contains(&a.ip()))
            .map(|a| a.addr)
            .collect();
        assert_eq!(global, vec![net("::2/64")]);
        let all6 = nl.list_addresses(ul0, Some(IpFamily::V6)).await?;
        let link_local = all6.iter().find(|a| net("fe80::/10").contains(&a.ip()));
        assert!(
            link_local.is_some_and(|a| a.scope == flannel_agent::netlink::AddressScope::Link),
            "{all6:?}"
        );
        // Both families together, and the v4 address of ul0 was never touched.
        let both = nl.list_addresses(ul0, None).await?;
        assert!(both.iter().any(|a| a.addr == net("192.168.50.1/24")));
        assert!(both.iter().any(|a| a.addr == net("::2/64")));
        Ok(())
    })
}

/// (dst, gateway, oif, onlink, scope, kind, table, metric) of a route, for set comparisons.
type RouteKey = (
    IpNet,
    Option<IpAddr>,
    Option<u32>,
    bool,
    RouteScope,
    RouteKind,
    u32,
    u32,
);

fn key(r: &Route) -> RouteKey {
    (
        r.dst, r.gateway, r.oif, r.onlink, r.scope, r.kind, r.table, r.metric,
    )
}

#[test]
fn routes_with_our_protocol_are_listed_replaced_and_deleted() {
    require_root!();
    check(routes_with_our_protocol_are_listed_replaced_and_deleted_in_ns());
}

fn routes_with_our_protocol_are_listed_replaced_and_deleted_in_ns() -> Result<()> {
    let ns = underlay_ns("nlrt")?;
    in_ns(&ns, || async {
        let nl = Netlink::new()?;
        let ul0 = index_of(&nl, "ul0").await?;
        let vx = match nl.ensure_vxlan(&flannel1_spec(ul0)).await? {
            VxlanEnsure::Created(l) => l.index,
            other => bail!("{other:?}"),
        };
        nl.set_link_up(vx).await?;

        // Routes owned by somebody else.
        ns.run(&[
            "ip",
            "route",
            "add",
            "10.77.0.0/16",
            "via",
            "192.168.50.2",
            "proto",
            "80",
        ])?;
        ns.run(&["ip", "route", "add", "10.78.0.0/16", "via", "192.168.50.2"])?;

        let ours = vec![
            Route::new(net("10.244.2.0/24")).via(PEER.into()).dev(ul0),
            Route::new(net("10.244.3.0/24"))
                .dev(ul0)
                .scope(RouteScope::Link),
            Route::new(net("10.244.4.0/24"))
                .via(ip("10.244.4.0"))
                .dev(vx)
                .onlink(),
            Route::new(net("10.250.0.0/16")).blackhole(),
            Route::new(net("10.244.5.0/24"))
                .via(PEER.into())
                .dev(ul0)
                .metric(50),
            Route::new(net("10.244.5.0/24"))
                .via(PEER.into())
                .dev(ul0)
                .metric(60),
            Route::new(net("10.244.6.0/24"))
                .via(PEER.into())
                .dev(ul0)
                .table(1000),
            Route::new(net("fd00:244:2::/64"))
                .via(ip("fd00:50::2"))
                .dev(ul0),
        ];
        for r in &ours {
            nl.replace_route(r)
                .await
                .with_context(|| format!("replace {r}"))?;
        }
        // IPv6 routes get the kernel's default metric.
        let expected: BTreeSet<RouteKey> = ours
            .iter()
            .map(|r| {
                let mut r = r.clone();
                if r.family() == IpFamily::V6 && r.metric == 0 {
                    r.metric = 1024;
                }
                key(&r)
            })
            .collect();
        let listed = nl.list_routes(RouteFilter::ours()).await?;
        assert!(listed.iter().all(|r| r.protocol == RTPROT_FLANNEL));
        assert_eq!(listed.iter().map(key).collect::<BTreeSet<_>>(), expected);

        // Foreign routes are visible without the protocol filter, never with it.
        let main = nl
            .list_routes(RouteFilter::default().table(254).family(IpFamily::V4))
            .await?;
        let calico = main
            .iter()
            .find(|r| r.dst == net("10.77.0.0/16"))
            .context("proto 80 route")?;
        assert_eq!(calico.protocol, 80);
        assert!(
            main.iter()
                .any(|r| r.dst == net("10.78.0.0/16") && r.protocol == 3)
        );
        assert!(
            main.iter()
                .any(|r| r.dst == net("192.168.50.0/24") && r.protocol == 2)
        );
        assert!(!main.iter().any(|r| r.table != 254));

        // Filters.
        let on_vx = nl.list_routes(RouteFilter::ours().oif(vx)).await?;
        assert_eq!(
            on_vx.iter().map(|r| r.dst).collect::<Vec<_>>(),
            vec![net("10.244.4.0/24")]
        );
        let v6 = nl
            .list_routes(RouteFilter::ours().family(IpFamily::V6))
            .await?;
        assert_eq!(
            v6.iter().map(|r| r.dst).collect::<Vec<_>>(),
            vec![net("fd00:244:2::/64")]
        );
        let t1000 = nl.list_routes(RouteFilter::ours().table(1000)).await?;
        assert_eq!(
            t1000.iter().map(|r| r.dst).collect::<Vec<_>>(),
            vec![net("10.244.6.0/24")]
        );
        assert!(
            nl.list_routes(RouteFilter::ours().table(999))
                .await?
                .is_empty()
        );

        let text = ns.run(&["ip", "route", "show", "proto", "165"])?;
        assert!(
            text.contains("10.244.4.0/24 via 10.244.4.0 dev flannel.1 onlink"),
            "{text}"
        );
        assert!(text.contains("blackhole 10.250.0.0/16"), "{text}");

        // Replace changes the route in place.
        nl.replace_route(
            &Route::new(net("10.244.2.0/24"))
                .via(ip("192.168.50.3"))
                .dev(ul0),
        )
        .await?;
        let two: Vec<_> = nl
            .list_routes(RouteFilter::ours())
            .await?
            .into_iter()
            .filter(|r| r.dst == net("10.244.2.0/24"))
            .collect();
        assert_eq!(two.len(), 1, "{two:?}");
        assert_eq!(two[0].gateway, Some(ip("192.168.50.3")));
        let text = ns.run(&["ip", "route", "show", "10.244.2.0/24"])?;
        assert!(
            text.contains("via 192.168.50.3 dev ul0 proto 165"),
            "{text}"
        );

        // Deleting a listed route removes exactly that one (metric 60 goes, 50 stays).
        let listed = nl.list_routes(RouteFilter::ours()).await?;
        let m60 = listed
            .iter()
            .find(|r| r.metric == 60)
            .context("metric 60 route")?;
        nl.delete_route(m60).await?;
        let left = nl.list_routes(RouteFilter::ours()).await?;
        assert!(
            left.iter()
                .any(|r| r.dst == net("10.244.5.0/24") && r.metric == 50)
        );
        assert!(!left.iter().any(|r| r.metric == 60));
        let err = nl.delete_route(m60).await.err();
        assert!(
            matches!(err, Some(NetlinkError::NotFound { .. })),
            "{err:?}"
        );

        for r in &left {
            nl.delete_route(r)
                .await
                .with_context(|| format!("delete {r}"))?;
        }
        assert!(nl.list_routes(RouteFilter::ours()).await?.is_empty());
        for foreign in ["10.77.0.0/16", "10.78.0.0/16"] {
            let text = ns.run(&["ip", "route", "show", foreign])?;
            assert!(
                text.contains("via 192.168.50.2"),
                "{foreign} is gone: {text}"
            );
        }
        Ok(())
    })
}

#[test]
fn route_get_tells_direct_from_gatewayed() {
    require_root!();
    check(route_get_tells_direct_from_gatewayed_in_ns());
}

fn route_get_tells_direct_from_gatewayed_in_ns() -> Result<()> {
    let ns = underlay_ns("nlget")?;
    in_ns(&ns, || async {
        let nl = Netlink::new()?;
        let ul0 = index_of(&nl, "ul0").await?;
        nl.replace_route(&Route::new(net("10.99.0.0/16")).via(PEER.into()))
            .await?;

        let direct = nl.route_get(PEER.into()).await?;
        assert!(direct.is_direct(), "{direct:?}");
        assert_eq!(direct.oif, Some(ul0));
        assert_eq!(direct.prefsrc, Some(LOCAL.into()));

        let via = nl.route_get(ip("10.99.1.1")).await?;
        assert!(!via.is_direct());
        assert_eq!((via.gateway, via.oif), (Some(PEER.into()), Some(ul0)));

        let local = nl.route_get(LOCAL.into()).await?;
        assert_eq!(local.kind, RouteKind::Local);
        assert!(!local.is_direct());

        let v6 = nl.route_get(ip("fd00:50::2")).await?;
        assert!(v6.is_direct(), "{v6:?}");

        let err = nl.route_get(ip("172.31.9.9")).await.err();
        assert!(
            matches!(err, Some(NetlinkError::NotFound { .. })),
            "{err:?}"
        );
        Ok(())
    })
}

#[test]
fn neighbours_and_fdb_entries_on_flannel_1() {
    require_root!();
    check(neighbours_and_fdb_entries_on_flannel_1_in_ns());
}

fn neighbours_and_fdb_entries_on_flannel_1_in_ns() -> Result<()> {
    let ns = underlay_ns("nlnb")?;
    in_ns(&ns, || async {
        let nl = Netlink::new()?;
        let ul0 = index_of(&nl, "ul0").await?;
        let vx = nl.create_vxlan(&flannel1_spec(ul0)).await?.index;
        nl.set_link_up(vx).await?;

        // ARP: replace, replace with another MAC, delete.
        let remote = ip("10.244.2.0");
        nl.replace_neighbour(vx, remote, MAC_A).await?;
        let n = nl.list_neighbours(vx).await?;
        let entry = n.iter().find(|e| e.ip == remote).context("neighbour")?;
        assert_eq!(entry.mac, Some(MAC_A));
        assert_eq!(entry.state, NeighbourState::Permanent);
        assert_eq!(entry.protocol, Some(RTPROT_FLANNEL));
        let text = ns.run(&["ip", "neigh", "show", "dev", "flannel.1"])?;
        assert!(
            text.contains("10.244.2.0 lladdr 0e:2a:00:00:00:0a PERMANENT proto 165"),
            "{text}"
        );
        nl.replace_neighbour(vx, remote, MAC_B).await?;
        let n: Vec<_> = nl
            .list_neighbours(vx)
            .await?
            .into_iter()
            .filter(|e| e.ip == remote)
            .collect();
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].mac, Some(MAC_B));
        // An IPv6 neighbour on the same device.
        nl.replace_neighbour(vx, ip("fd00:244:2::"), MAC_A).await?;
        let text = ns.run(&["ip", "-6", "neigh", "show", "dev", "flannel.1"])?;
        assert!(
            text.contains("fd00:244:2:: lladdr 0e:2a:00:00:00:0a"),
            "{text}"
        );
        nl.delete_neighbour(vx, remote).await?;
        nl.delete_neighbour(vx, ip("fd00:244:2::")).await?;
        assert!(
            nl.list_neighbours(vx)
                .await?
                .iter()
                .all(|e| e.state != NeighbourState::Permanent)
        );
        let err = nl.delete_neighbour(vx, remote).await.err();
        assert!(
            matches!(err, Some(NetlinkError::NotFound { .. })),
            "{err:?}"
        );

        // FDB: replace moves the destination of a MAC.
        nl.replace_fdb(vx, MAC_A, PEER.into()).await?;
        let fdb = nl.list_fdb(vx).await?;
        let a: Vec<_> = fdb.iter().filter(|e| e.mac == MAC_A).collect();
        assert_eq!(a.len(), 1, "{fdb:?}");
        assert_eq!(a[0].dst, Some(PEER.into()));
        assert_eq!(a[0].state, NeighbourState::Permanent);
        assert!(a[0].flags.contains(NeighbourFlags::SELF));
        let text = ns.run(&["bridge", "fdb", "show", "dev", "flannel.1"])?;
        assert!(
            text.contains("0e:2a:00:00:00:0a dst 192.168.50.2 self permanent"),
            "{text}"
        );
        nl.replace_fdb(vx, MAC_A, ip("192.168.50.3")).await?;
        let a: Vec<_> = nl
            .list_fdb(vx)
            .await?
            .into_iter()
            .filter(|e| e.mac == MAC_A)
            .collect();
        assert_eq!(
            a.iter().map(|e| e.dst).collect::<Vec<_>>(),
            vec![Some(ip("192.168.50.3"))]
        );

        // Append keeps several destinations; delete removes exactly one.
        nl.append_fdb(vx, ZERO_MAC, PEER.into()).await?;
        nl.append_fdb(vx, ZERO_MAC, ip("192.168.50.3")).await?;
        let zero = |fdb: Vec<flannel_agent::netlink::FdbEntry>| -> BTreeSet<Option<IpAddr>> {
            fdb.into_iter()
                .filter(|e| e.mac == ZERO_MAC)
                .map(|e| e.dst)
                .collect()
        };
        assert_eq!(
            zero(nl.list_fdb(vx).await?),
            BTreeSet::from([Some(PEER.into()), Some(ip("192.168.50.3"))])
        );
        nl.delete_fdb(vx, ZERO_MAC, PEER.into()).await?;
        assert_eq!(
            zero(nl.list_fdb(vx).await?),
            BTreeSet::from([Some(ip("192.168.50.3"))])
        );
        let text = ns.run(&["bridge", "fdb", "show", "dev", "flannel.1"])?;
        assert!(
            text.contains("00:00:00:00:00:00 dst 192.168.50.3 self permanent"),
            "{text}"
        );
        assert!(!text.contains("dst 192.168.50.2"), "{text}");

        nl.delete_fdb(vx, MAC_A, ip("192.168.50.3")).await?;
        assert!(!nl.list_fdb(vx).await?.iter().any(|e| e.mac == MAC_A));
        let err = nl.delete_fdb(vx, MAC_A, ip("192.168.50.3")).await.err();
        assert!(
            matches!(err, Some(NetlinkError::NotFound { .. })),
            "{err:?}"
        );
        // Entries of other devices are not listed.
        let ul0_fdb = nl.list_fdb(ul0).await?;
        assert!(ul0_fdb.iter().all(|e| e.ifindex == ul0));
        Ok(())
    })
}

/// Waits up to 5 s for `wanted`, skipping other events.
async fn wait_for(events: &mut LinkEvents, wanted: LinkEvent) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, events.next()).await {
            Ok(Some(e)) if e == wanted => return Ok(()),
            Ok(Some(_)) => continue,
            Ok(None) => bail!("event stream ended"),
            Err(_) => bail!("no {wanted:?} within 5 s"),
        }
    }
}

#[test]
fn a_deleted_link_shows_up_on_the_event_stream() {
    require_root!();
    check(a_deleted_link_shows_up_on_the_event_stream_in_ns());
}

fn a_deleted_link_shows_up_on_the_event_stream_in_ns() -> Result<()> {
    let ns = underlay_ns("nlev")?;
    in_ns(&ns, || async {
        let nl = Netlink::new()?;
        let mut events = nl.link_events()?;
        let ul0 = index_of(&nl, "ul0").await?;
        let index = nl.create_vxlan(&flannel1_spec(ul0)).await?.index;
        wait_for(
            &mut events,
            LinkEvent::New {
                index,
                name: "flannel.1".into(),
            },
        )
        .await?;
        // Deleted under the agent, as in upstream's device watcher scenario.
        ns.run(&["ip", "link", "del", "flannel.1"])?;
        wait_for(
            &mut events,
            LinkEvent::Removed {
                index,
                name: "flannel.1".into(),
            },
        )
        .await?;
        Ok(())
    })
}

/// The kernel runs one dump at a time per netlink socket and answers a second one started
/// meanwhile with EBUSY; the agent's tasks share one socket and dump concurrently (the
/// reconciler's routes, the address check, the bridge's ports). Eight concurrent dumps of
/// 2,000 routes (several answers each), twenty times over, all succeed and all see every
/// route.
#[test]
fn concurrent_dumps_on_one_socket_all_succeed() {
    require_root!();
    check(concurrent_dumps_on_one_socket_all_succeed_in_ns());
}

fn concurrent_dumps_on_one_socket_all_succeed_in_ns() -> Result<()> {
    let ns = underlay_ns("nldumps")?;
    in_ns(&ns, || async {
        let nl = Netlink::new()?;
        let ul0 = index_of(&nl, "ul0").await?;
        let routes = (0..2000u32).map(|i| {
            let dst = Ipv4Addr::new(10, 100 + (i / 256) as u8, (i % 256) as u8, 0);
            Op::ReplaceRoute(
                Route::new(IpNet::V4(Ipv4Net::new(dst, 24).unwrap_or_default()))
                    .via(PEER.into())
                    .dev(ul0),
            )
        });
        ensure!(nl.apply_all(routes, 64).await.iter().all(Result::is_ok));
        for round in 0..20 {
            let dumps = (0..8).map(|_| nl.list_routes(RouteFilter::ours()));
            for (i, dump) in futures::future::join_all(dumps)
                .await
                .into_iter()
                .enumerate()
            {
                let got = dump.with_context(|| format!("round {round}, dump {i}"))?;
                ensure!(
                    got.len() == 2000,
                    "round {round}, dump {i}: {} routes",
                    got.len()
                );
            }
        }
        Ok(())
    })
}

#[test]
fn five_thousand_route_replaces_are_timed() {
    require_root!();
    check(five_thousand_route_replaces_are_timed_in_ns());
}

fn five_thousand_route_replaces_are_timed_in_ns() -> Result<()> {
    let ns = underlay_ns("nlbulk")?;
    in_ns(&ns, || async {
        let nl = Netlink::new()?;
        let ul0 = index_of(&nl, "ul0").await?;
        let routes: Vec<Route> = (0..5000u32)
            .map(|i| {
                let dst = Ipv4Addr::new(10, 100 + (i / 256) as u8, (i % 256) as u8, 0);
                Route::new(IpNet::V4(Ipv4Net::new(dst, 24).unwrap_or_default()))
                    .via(PEER.into())
                    .dev(ul0)
            })
            .collect();

        let started = Instant::now();
        let results = nl
            .apply_all(routes.iter().cloned().map(Op::ReplaceRoute), 64)
            .await;
        let replace_64 = started.elapsed();
        let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        ensure!(
            failed.is_empty(),
            "{} failures, first: {:?}",
            failed.len(),
            failed.first()
        );
        assert_eq!(nl.list_routes(RouteFilter::ours()).await?.len(), 5000);
        let text = ns.run(&["ip", "route", "show", "proto", "165"])?;
        assert_eq!(text.lines().count(), 5000);

        // The same again replaces in place (still 5000), one request at a time for comparison.
        let started = Instant::now();
        let results = nl
            .apply_all(routes.iter().cloned().map(Op::ReplaceRoute), 1)
            .await;
        let replace_1 = started.elapsed();
        ensure!(results.iter().all(Result::is_ok));
        assert_eq!(nl.list_routes(RouteFilter::ours()).await?.len(), 5000);

        let started = Instant::now();
        let results = nl
            .apply_all(routes.iter().cloned().map(Op::DeleteRoute), 64)
            .await;
        let delete_64 = started.elapsed();
        ensure!(results.iter().all(Result::is_ok));
        assert!(nl.list_routes(RouteFilter::ours()).await?.is_empty());
        // One datagram mixing successes and failures: results line up with the operations.
        let a = Route::new(net("10.244.20.0/24")).via(PEER.into()).dev(ul0);
        let c = Route::new(net("10.244.22.0/24")).via(PEER.into()).dev(ul0);
        let results = nl
            .apply_all(
                [
                    Op::ReplaceRoute(a.clone()),
                    Op::DeleteRoute(Route::new(net("10.244.21.0/24")).via(PEER.into()).dev(ul0)),
                    Op::ReplaceRoute(c.clone()),
                    Op::ReplaceRoute(Route::new(net("10.244.23.1/24"))),
                    Op::DeleteRoute(a.clone()),
                    Op::ReplaceNeighbour {
                        ifindex: ul0,
                        ip: PEER.into(),
                        mac: MAC_A,
                    },
                ],
                64,
            )
            .await;
        let kinds: Vec<&str> = results
            .iter()
            .map(|r| match r {
                Ok(()) => "ok",
                Err(NetlinkError::NotFound { .. }) => "not found",
                Err(NetlinkError::Invalid { .. }) => "invalid",
                Err(_) => "other",
            })
            .collect();
        assert_eq!(
            kinds,
            ["ok", "not found", "ok", "invalid", "ok", "ok"],
            "{results:?}"
        );
        let left: Vec<_> = nl
            .list_routes(RouteFilter::ours())
            .await?
            .into_iter()
            .map(|r| r.dst)
            .collect();
        assert_eq!(left, vec![c.dst]);
        assert!(
            nl.list_neighbours(ul0)
                .await?
                .iter()
                .any(|n| n.ip == IpAddr::from(PEER) && n.mac == Some(MAC_A))
        );

        eprintln!(
            "5000 route replaces: {replace_64:?} with 64 in flight, {replace_1:?} with 1; \
             5000 deletes: {delete_64:?} with 64 in flight"
        );
        Ok(())
    })
}

/// `conntrack::insert_masqueraded` against the kernel's table: a flow's unbound entry is
/// replaced by one bound to exactly the address and port given; a binding whose reply tuple
/// another entry answers on (the node's own connection from that port, not yet moved) is
/// refused with `EEXIST` and counted as refused; the same flows with that entry replaced first
/// (the node's connection bound to the port it was moved to) all go in. An ICMP echo flow is
/// bound by its identifier the same way.
#[test]
fn masqueraded_flows_replace_their_entries_and_a_clashing_binding_is_refused() {
    require_root!();
    check(masqueraded_flows_replace_their_entries_in_ns());
}

fn masqueraded_flows_replace_their_entries_in_ns() -> Result<()> {
    use std::net::SocketAddrV4;

    use flannel_agent::netlink::conntrack::{self, CtTuple, Family};

    let ns = NetNs::new("ctnat")?;
    ns.enter(|| -> Result<()> {
        let node = Ipv4Addr::new(192, 0, 2, 1);
        let tuple = |src: Ipv4Addr| CtTuple {
            src: IpAddr::V4(src),
            dst: ip("198.51.100.9"),
            proto: 6,
            sport: 45678,
            dport: 7100,
        };
        let node_flow = tuple(node);
        let pod_flow = tuple(Ipv4Addr::new(10, 244, 1, 5));
        let echo = CtTuple {
            proto: 1,
            sport: 77,
            dport: 77,
            ..pod_flow
        };
        let node_port = SocketAddrV4::new(node, 45678);
        let moved = SocketAddrV4::new(node, 51234);
        // As conntrack tracks them under the fast path: unbound.
        let unbound = conntrack::insert_established(&[node_flow, pod_flow, echo])?;
        ensure!(unbound.created == 3, "{unbound:?}");

        let clash = conntrack::insert_masqueraded(&[(pod_flow, node_port)])?;
        ensure!(
            (clash.created, clash.existed, clash.refused) == (0, 0, 1)
                && clash.first_refusal == Some(libc::EEXIST),
            "the pod's binding to the port the node's entry answers on: {clash:?}"
        );

        conntrack::insert_established(&[pod_flow])?;
        let all = conntrack::insert_masqueraded(&[
            (node_flow, moved),
            (pod_flow, node_port),
            (echo, SocketAddrV4::new(node, 32801)),
        ])?;
        ensure!(
            (all.created, all.existed, all.refused) == (0, 3, 0),
            "all replaced: {all:?}"
        );
        let mut replies = Vec::new();
        conntrack::dump(Family::V4, |e| {
            replies.push((e.orig, e.reply.dst, e.reply.dport))
        })?;
        replies.sort_by_key(|(orig, ..)| (orig.src, orig.proto));
        let want = vec![
            (echo, IpAddr::V4(node), 32801),
            (pod_flow, IpAddr::V4(node), 45678),
            (node_flow, IpAddr::V4(node), 51234),
        ];
        ensure!(replies == want, "conntrack holds {replies:?}, not {want:?}");
        // Entered as established: the kernel reports them assured.
        let mut unassured = Vec::new();
        conntrack::dump(Family::V4, |e| {
            if !e.assured {
                unassured.push(e.orig)
            }
        })?;
        ensure!(unassured.is_empty(), "not assured: {unassured:?}");
        Ok(())
    })?
}
