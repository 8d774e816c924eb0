//! IPv6 on the fast path, program by program with `BPF_PROG_TEST_RUN`: host-gw routing by the
//! IPv6 FIB with the hop limit decremented, VXLAN over IPv6 built byte for byte as
//! `flannel-v6.<VNI>` sends it (the UDP checksum, computed by the program from the headers
//! alone, equal to the packet builder's full computation and checked by the packet verifier),
//! decapsulation and delivery, what is left to the kernel, the IPv6 flow tables, and IPv6-only
//! and dual-stack configurations.
//!
//! The node namespace: `ext0` (192.168.77.1/24, fd00:77::1/64) with permanent neighbours for
//! some peers, `br0` (10.244.1.1/24, fd00:10:244:1::1/64) with a pod port, host-gw routes for
//! both families, forwarding on.
//!
//! Needs root; skips otherwise, and when the agent was built without the eBPF object.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr},
    thread,
};

use flannel_agent::bpf::{
    FastPath, Hook, LocalConfig, LocalConfig6, Remote, Remote6, SyncStats, Via, VxlanLocal,
};
use flannel_common::{
    config::FASTPATH_MARK,
    memo::learn_slot6,
    stats::{Reason, ReasonKind},
};
use flannel_tests::packet::{
    self, ETH_P_IPV6, Ethernet, Icmp, Ipv4, Ipv6, Ipv6Ext, ParsedL3, Tcp, Transport, Udp, hexdump,
};
use ipnet::{Ipv4Net, Ipv6Net};

mod bpf_support;

use bpf_support::{
    BR_MAC, EXT_MAC, Ifaces, Mac, POD_MAC, Rig, Skb, TC_ACT_OK, TC_ACT_REDIRECT, assert_bytes,
    assert_counted, know_pod_port, mac_str,
    mutate::{self, Change, Tunnel},
    net, past_hop_ttl, run,
};

const PEER2_MAC: Mac = [0x02, 0xee, 0, 0, 0, 0x02];
const PEER3_MAC: Mac = [0x02, 0xee, 0, 0, 0, 0x03];
const LOCAL_VTEP6: Mac = [0x0e, 0x06, 0, 0, 0, 0x01];
const VTEP3: Mac = [0x0e, 0x06, 0, 0, 0, 0x03];
const VTEP6: Mac = [0x0e, 0x06, 0, 0, 0, 0x06];

fn v6(s: &str) -> Ipv6Addr {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn net6(s: &str) -> Ipv6Net {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn pub1() -> Ipv6Addr {
    v6("fd00:77::1")
}
fn pod() -> Ipv6Addr {
    v6("fd00:10:244:1::5")
}
/// Remote pods: host-gw (via fd00:77::2, neighbour known), host-gw without neighbour (via ::4),
/// VXLAN at ::3 (neighbour known), VXLAN at ::6 (no neighbour).
fn hostgw_pod() -> Ipv6Addr {
    v6("fd00:10:244:2::7")
}
fn hostgw_no_neigh_pod() -> Ipv6Addr {
    v6("fd00:10:244:4::7")
}
fn vxlan_pod() -> Ipv6Addr {
    v6("fd00:10:244:3::7")
}
fn vxlan_no_neigh_pod() -> Ipv6Addr {
    v6("fd00:10:244:6::7")
}

impl Rig {
    /// The node namespace with IPv6 addresses and forwarding, permanent neighbours for the
    /// peers at ::2, ::3 (and 192.168.77.2) and the local pod, and host-gw routes for both
    /// families. `None` (test skipped) when not root or without the eBPF object.
    fn new(name: &str) -> Option<Rig> {
        let rig = Rig::node(name)?;
        rig.sh("ip addr add fd00:77::1/64 dev ext0 nodad");
        rig.sh("ip addr add fd00:10:244:1::1/64 dev br0 nodad");
        rig.sh("sysctl -qw net.ipv6.conf.all.forwarding=1");
        for (ip, mac) in [("fd00:77::2", PEER2_MAC), ("fd00:77::3", PEER3_MAC)] {
            rig.sh(&format!(
                "ip -6 neigh replace {ip} lladdr {} dev ext0 nud permanent",
                mac_str(&mac)
            ));
        }
        rig.sh("ip neigh replace 192.168.77.2 lladdr 02:ee:00:00:00:02 dev ext0 nud permanent");
        rig.sh(&format!(
            "ip -6 neigh replace {} lladdr {} dev br0 nud permanent",
            pod(),
            mac_str(&POD_MAC)
        ));
        rig.sh("ip -6 route add fd00:10:244:2::/64 via fd00:77::2 dev ext0");
        rig.sh("ip -6 route add fd00:10:244:4::/64 via fd00:77::4 dev ext0");
        rig.sh("ip route add 10.244.2.0/24 via 192.168.77.2 dev ext0");
        Some(rig)
    }

    /// Runs `f` in the namespace with a fast path loaded and configured for IPv6 (and IPv4
    /// when `dual`), its IPv6 routes synced.
    fn with_fast_path<R: Send>(
        &self,
        dual: bool,
        f: impl FnOnce(&mut FastPath, &Ifaces) -> R + Send,
    ) -> R {
        let pin = self.pin.clone();
        self.ns
            .enter(move || {
                let ifaces = Ifaces::current();
                let mut fp = FastPath::load(&pin).expect("loading the fast path");
                if dual {
                    let v4 = LocalConfig {
                        source_ports: (32768, 60999),
                        outer_ttl: 64,
                        ..LocalConfig::new(
                            Ipv4Addr::new(192, 168, 77, 1),
                            ifaces.ext,
                            net("10.244.1.0/24"),
                            net("10.244.0.0/16"),
                        )
                    };
                    fp.set_config(&v4).expect("IPv4 config");
                    let routes: BTreeMap<Ipv4Net, Remote> = [(
                        net("10.244.2.0/24"),
                        Remote {
                            public_ip: Ipv4Addr::new(192, 168, 77, 2),
                            via: Via::HostGw,
                        },
                    )]
                    .into();
                    fp.sync(&routes).expect("IPv4 sync");
                } else {
                    fp.disable_ipv4().expect("IPv6 only");
                }
                fp.set_config6(Some(&config6(ifaces.ext))).expect("config6");
                let stats = fp.sync6(&remotes6()).expect("sync6");
                if stats.unchanged == 0 {
                    assert_eq!(stats.added, 4);
                    assert_eq!(stats.nodes_written, 2, "the two VXLAN peers");
                } else {
                    // Loaded again on this rig: the pinned maps were adopted as they were.
                    assert_eq!((stats.unchanged, stats.added), (4, 0), "{stats:?}");
                    assert_eq!(stats.nodes_written, 0);
                }
                assert_eq!(fp.remotes6().expect("read back"), remotes6());
                let again = fp.sync6(&remotes6()).expect("sync6 again");
                assert!(!again.changed(), "{again:?}");
                f(&mut fp, &ifaces)
            })
            .expect("entering the namespace")
    }
}

fn config6(ext: u32) -> LocalConfig6 {
    LocalConfig6 {
        vxlan: Some(VxlanLocal {
            vni: 1,
            port: 8472,
            vtep_mac: LOCAL_VTEP6,
        }),
        source_ports: (32768, 60999),
        hop_limit: 64,
        ..LocalConfig6::new(
            pub1(),
            ext,
            net6("fd00:10:244:1::/64"),
            net6("fd00:10:244::/48"),
        )
    }
}

fn remotes6() -> BTreeMap<Ipv6Net, Remote6> {
    let vxlan = |ip: &str, vtep_mac| Remote6 {
        public_ip: v6(ip),
        via: Via::Vxlan { vtep_mac, vni: 1 },
    };
    [
        (
            net6("fd00:10:244:2::/64"),
            Remote6 {
                public_ip: v6("fd00:77::2"),
                via: Via::HostGw,
            },
        ),
        (
            net6("fd00:10:244:4::/64"),
            Remote6 {
                public_ip: v6("fd00:77::4"),
                via: Via::HostGw,
            },
        ),
        (net6("fd00:10:244:3::/64"), vxlan("fd00:77::3", VTEP3)),
        (net6("fd00:10:244:6::/64"), vxlan("fd00:77::6", VTEP6)),
    ]
    .into()
}

fn pod_frame(ip: &Ipv6) -> Vec<u8> {
    Ethernet::new(POD_MAC, BR_MAC, ip.clone()).encode()
}

fn hop(ip: &Ipv6) -> Ipv6 {
    Ipv6 {
        hop_limit: ip.hop_limit - 1,
        ..ip.clone()
    }
}

fn class_of(l4: &Transport) -> Reason {
    match l4 {
        Transport::Tcp(_) => Reason::Ipv6Tcp,
        Transport::Udp(_) => Reason::Ipv6Udp,
        _ => Reason::Ipv6Icmp,
    }
}

fn l4s() -> Vec<Transport> {
    vec![
        Tcp::new(40000, 80).payload(b"ipv6 fast path").into(),
        Udp::new(1234, 5678).payload(&[9; 101]).into(),
        Transport::Icmpv6(Icmp::echo6_request(3, 9)),
    ]
}

// ---------------------------------------------------------------------------------------------

#[test]
fn host_gw_routes_ipv6_by_the_fib() {
    let Some(rig) = Rig::new("f6hgw") else { return };
    rig.with_fast_path(false, |fp, ifs| {
        for l4 in l4s() {
            let class = class_of(&l4);
            let ip = Ipv6::new(pod(), hostgw_pod(), l4);
            let frame = pod_frame(&ip);
            let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
            assert_eq!(r.verdict, TC_ACT_REDIRECT, "{}", hexdump(&r.out));
            assert_eq!(r.mark_after, FASTPATH_MARK);
            let want = Ethernet::new(EXT_MAC, PEER2_MAC, hop(&ip)).encode();
            assert_bytes(&r.out, &want, "host-gw v6");
            packet::verify(&r.out).expect("checksums");
            assert_counted(&r, &[class, Reason::FastHostGw6], "host-gw v6");
        }
        // Next hop without a neighbour: bpf_redirect_neigh, MACs left as they were.
        let ip = Ipv6::new(pod(), hostgw_no_neigh_pod(), Tcp::new(1, 2));
        let r = run(fp, Hook::FromBridge, &pod_frame(&ip), Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_REDIRECT);
        assert_bytes(&r.out, &pod_frame(&hop(&ip)), "no neighbour");
        assert_counted(&r, &[Reason::Ipv6Tcp, Reason::FastHostGw6], "no neighbour");
    });
}

#[test]
fn vxlan_over_ipv6_is_built_like_flannel_v6() {
    let Some(rig) = Rig::new("f6vx") else { return };
    rig.with_fast_path(false, |fp, ifs| {
        for l4 in l4s() {
            let class = class_of(&l4);
            let ip = Ipv6 {
                traffic_class: 0xb3, // DSCP 44, ECN CE: the outer gets ECT(0)
                flow_label: 0x12345,
                ..Ipv6::new(pod(), vxlan_pod(), l4)
            };
            let frame = pod_frame(&ip);
            let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
            assert_eq!(r.verdict, TC_ACT_REDIRECT, "{}", hexdump(&r.out));
            assert_eq!(r.out.len(), frame.len() + 70);
            let sport = u16::from_be_bytes([r.out[14 + 40], r.out[14 + 41]]);
            assert!((32768..60999).contains(&sport), "source port {sport}");
            let inner = Ethernet::new(LOCAL_VTEP6, VTEP3, hop(&ip)).encode();
            // The packet builder sums every byte for the UDP checksum; the program summed the
            // headers only. Equal bytes mean equal checksums.
            let want = Ethernet::new(
                EXT_MAC,
                PEER3_MAC,
                Ipv6 {
                    traffic_class: 0x02,
                    ..Ipv6::new(pub1(), v6("fd00:77::3"), Udp::vxlan(sport, 1, &inner))
                },
            )
            .encode();
            assert_bytes(&r.out, &want, "VXLAN over IPv6");
            let parsed = packet::verify(&r.out).expect("outer UDP checksum valid");
            let udp = parsed.l4().and_then(|l4| l4.udp_payload()).expect("UDP");
            let (vni, inner_frame) = packet::parse_vxlan(udp).expect("VXLAN");
            assert_eq!(vni, 1);
            let inner = packet::verify(inner_frame).expect("inner checksums");
            let ParsedL3::Ipv6(inner_ip) = inner.l3 else {
                panic!("inner not IPv6")
            };
            assert_eq!(inner_ip.hop_limit, 63);
            assert_counted(&r, &[class, Reason::FastVxlan6], "vxlan6");
        }
        // The source port follows the flow.
        let port_of = |fp: &mut FastPath, sport: u16| {
            let frame = pod_frame(&Ipv6::new(pod(), vxlan_pod(), Tcp::new(sport, 80)));
            let out = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br)).out;
            u16::from_be_bytes([out[54], out[55]])
        };
        assert_eq!(port_of(fp, 41000), port_of(fp, 41000));
        let ports: std::collections::BTreeSet<u16> =
            (0..8).map(|i| port_of(fp, 42000 + i)).collect();
        assert!(ports.len() > 1, "8 flows all hashed to {ports:?}");
        // Underlay neighbour unknown: bpf_redirect_neigh.
        let r = run(
            fp,
            Hook::FromBridge,
            &pod_frame(&Ipv6::new(pod(), vxlan_no_neigh_pod(), Tcp::new(1, 2))),
            Skb::on(ifs.br),
        );
        assert_eq!(r.verdict, TC_ACT_REDIRECT);
        let parsed = packet::verify(&r.out).expect("outer headers");
        let ParsedL3::Ipv6(outer) = &parsed.l3 else {
            panic!("not IPv6")
        };
        assert_eq!((outer.src, outer.dst), (pub1(), v6("fd00:77::6")));
    });
}

/// VXLAN over IPv6 keeps to the path MTU to the peer, not just the external interface's: with
/// a route to the peer of locked MTU 1,400 (which the lookup reads as it reads the kernel's
/// exception after a router's Packet Too Big), a pod's packet whose outer packet would be
/// longer is left to the kernel (whose `flannel-v6.1` answers the pod with a Packet Too Big),
/// before and after a smaller packet of its flow was sent (and remembered); without the route
/// it is encapsulated again.
#[test]
fn ipv6_vxlan_keeps_to_the_path_mtu() {
    let Some(rig) = Rig::new("f6pmtu") else {
        return;
    };
    rig.sh("ip -6 route replace fd00:77::3/128 dev ext0 mtu lock 1400");
    rig.with_fast_path(false, |fp, ifs| {
        let packet = |payload: usize| {
            let ip = Ipv6::new(
                pod(),
                vxlan_pod(),
                Tcp::new(41000, 80).payload(&vec![7; payload]),
            );
            pod_frame(&ip)
        };
        // 40 + 20 + 1,271 bytes: 1,401 with the 70 of VXLAN over IPv6.
        let (big, fits) = (packet(1271), packet(1270));
        for (what, frame) in [
            ("too big, first", &big),
            ("fits", &fits),
            ("too big, after", &big),
        ] {
            let r = run(fp, Hook::FromBridge, frame, Skb::on(ifs.br));
            if frame.len() == fits.len() {
                assert_eq!(r.verdict, TC_ACT_REDIRECT, "{what}: {:?}", r.counted);
                assert_eq!(r.out.len(), fits.len() + 70, "{what}");
                assert!(
                    r.counted.iter().any(|c| c.0 == Reason::FastVxlan6),
                    "{what}"
                );
            } else {
                assert_passed(&r, frame, Reason::Ipv6Tcp, Reason::PassFibFailed, what);
            }
        }
        rig.sh("ip -6 route del fd00:77::3/128 dev ext0");
        let r = run(fp, Hook::FromBridge, &big, Skb::on(ifs.br));
        assert_eq!(
            r.verdict, TC_ACT_REDIRECT,
            "without the route: {:?}",
            r.counted
        );
        assert_eq!(r.out.len(), big.len() + 70);
    });
}

/// The fragments of a pod's UDP datagram over IPv6 to a host-gw or VXLAN peer are sent like
/// the rest of its flow, the later ones (no ports) because their first was (`FLANNEL_FRAGS6`),
/// as for IPv4: each comes out as the kernel would forward it (hop limit decremented; VXLAN:
/// to `flannel-v6.1` by the kernel's route, without one to the kernel). A later fragment whose
/// first was not sent and TCP fragments are passed unchanged.
#[test]
fn a_pods_ipv6_fragments_follow_their_first_fragment() {
    let Some(rig) = Rig::new("f6frag") else {
        return;
    };
    rig.with_fast_path(false, |fp, ifs| {
        let framed =
            |src, dst, ip_bytes: &[u8]| Ethernet::carrying(src, dst, ETH_P_IPV6, ip_bytes).encode();
        let datagram = |dst| Ipv6::new(pod(), dst, Udp::new(5353, 6000).payload(&[7; 100]));
        // Host-gw.
        let ip = datagram(hostgw_pod());
        let want = hop(&ip).fragments(32, 0x1111);
        for (i, fragment) in ip.fragments(32, 0x1111).iter().enumerate() {
            let frame = framed(POD_MAC, BR_MAC, fragment);
            let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
            assert_eq!(r.verdict, TC_ACT_REDIRECT, "host-gw fragment {i}");
            let expected = framed(EXT_MAC, PEER2_MAC, &want[i]);
            assert_bytes(&r.out, &expected, &format!("host-gw fragment {i}"));
            assert_counted(
                &r,
                &[Reason::Ipv6ExtHeader, Reason::FastHostGw6],
                &format!("host-gw fragment {i}"),
            );
        }
        // VXLAN over IPv6: without the kernel's route through flannel-v6.1 the first fragment
        // goes to the kernel, and so do the later ones.
        let ip = datagram(vxlan_pod());
        for (i, fragment) in ip.fragments(32, 0x2222).iter().enumerate() {
            let frame = framed(POD_MAC, BR_MAC, fragment);
            let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
            assert_eq!(r.verdict, TC_ACT_OK, "VXLAN fragment {i}, no device route");
            assert_bytes(&r.out, &frame, "no device route");
            let verdict = if i == 0 {
                Reason::PassGso
            } else {
                Reason::PassFragment
            };
            assert_counted(&r, &[Reason::Ipv6ExtHeader, verdict], "no device route");
        }
        // With it, every fragment goes to flannel-v6.1 itself (the outer UDP checksum the
        // programs build rests on the inner one, which covers the datagram, not a fragment),
        // past the stack, as the route says.
        add_flannel_v6_route();
        let want = hop(&ip).fragments(32, 0x2323);
        for (i, fragment) in ip.fragments(32, 0x2323).iter().enumerate() {
            let frame = framed(POD_MAC, BR_MAC, fragment);
            let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
            assert_eq!(r.verdict, TC_ACT_REDIRECT, "VXLAN fragment {i}");
            let expected = framed(LOCAL_VTEP6, VTEP3, &want[i]);
            assert_bytes(&r.out, &expected, &format!("VXLAN fragment {i}"));
            assert_counted(
                &r,
                &[Reason::Ipv6ExtHeader, Reason::FastVxlan6Device],
                &format!("VXLAN fragment {i}"),
            );
        }
        // Passed unchanged.
        let tcp = Ipv6::new(pod(), hostgw_pod(), Tcp::new(40000, 80).payload(&[7; 100]));
        for (what, fragment, verdict) in [
            (
                "a later fragment whose first was not sent",
                datagram(hostgw_pod()).fragments(32, 0x3333)[1].clone(),
                Reason::PassFragment,
            ),
            (
                "TCP",
                tcp.fragments(32, 0x4444)[0].clone(),
                Reason::PassIpv6ExtHeader,
            ),
        ] {
            let frame = framed(POD_MAC, BR_MAC, &fragment);
            let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
            assert_eq!(r.verdict, TC_ACT_OK, "{what}");
            assert_bytes(&r.out, &frame, what);
            assert_counted(&r, &[Reason::Ipv6ExtHeader, verdict], what);
        }
    });
}

/// The IPv6 route and node maps are read in batches too (the LPM trie's batch token is a
/// 20-byte key): 10,000 VXLAN peers read back as written, and back to four every one of them
/// is removed.
#[test]
fn ipv6_maps_of_ten_thousand_peers_read_back_whole() {
    let Some(rig) = Rig::new("f6batch") else {
        return;
    };
    rig.with_fast_path(false, |fp, _| {
        let mut many = remotes6();
        for i in 0..10_000u16 {
            let subnet = Ipv6Net::new(Ipv6Addr::new(0xfd00, 0x10, 0x245, i, 0, 0, 0, 0), 64)
                .expect("subnet");
            let b = i.to_be_bytes();
            let peer = Remote6 {
                public_ip: Ipv6Addr::new(0xfd00, 0x78, 0, 0, 0, 0, 1, i),
                via: Via::Vxlan {
                    vtep_mac: [0x0e, 0x06, 0x01, 0, b[0], b[1]],
                    vni: 1,
                },
            };
            many.insert(subnet, peer);
        }
        let s = fp.sync6(&many).expect("sync6");
        assert_eq!(
            (s.added, s.unchanged, s.nodes_written),
            (10_000, 4, 10_000),
            "{s:?}"
        );
        assert_eq!(fp.remotes6().expect("read back"), many);
        assert!(fp.drift().expect("drift").is_empty());
        let s = fp.sync6(&remotes6()).expect("back to four");
        assert_eq!((s.removed, s.nodes_removed), (10_000, 10_000), "{s:?}");
        assert_eq!(fp.remotes6().expect("read back"), remotes6());
    });
}

#[test]
fn ipv6_the_fast_path_does_not_take_goes_to_the_kernel() {
    let Some(rig) = Rig::new("f6pass") else {
        return;
    };
    rig.with_fast_path(false, |fp, ifs| {
        let neighbour_solicitation = Transport::Icmpv6(Icmp {
            ty: 135,
            code: 0,
            rest: [0; 4],
            checksum: packet::Checksum::Correct,
            payload: vxlan_pod().octets().to_vec(),
        });
        let cases: Vec<(&str, Ipv6, Reason, Reason)> = vec![
            (
                "neighbour solicitation",
                Ipv6::new(pod(), vxlan_pod(), neighbour_solicitation),
                Reason::Ipv6Icmp,
                Reason::PassIcmpNotEcho,
            ),
            (
                "hop limit 1",
                Ipv6 {
                    hop_limit: 1,
                    ..Ipv6::new(pod(), vxlan_pod(), Tcp::new(1, 2))
                },
                Reason::Ipv6Tcp,
                Reason::PassTtlExceeded,
            ),
            (
                "extension header",
                Ipv6 {
                    extensions: vec![Ipv6Ext::hop_by_hop_padding()],
                    ..Ipv6::new(pod(), vxlan_pod(), Tcp::new(1, 2))
                },
                Reason::Ipv6ExtHeader,
                Reason::PassIpv6ExtHeader,
            ),
            (
                "link-local source",
                Ipv6::new(v6("fe80::5"), vxlan_pod(), Tcp::new(1, 2)),
                Reason::Ipv6Tcp,
                Reason::PassForeignSource,
            ),
            (
                "to a local pod",
                Ipv6::new(pod(), v6("fd00:10:244:1::9"), Tcp::new(1, 2)),
                Reason::Ipv6Tcp,
                Reason::PassNoRoute,
            ),
            (
                "outside the cluster",
                Ipv6::new(pod(), v6("2001:db8::1"), Tcp::new(1, 2)),
                Reason::Ipv6Tcp,
                Reason::PassNoRoute,
            ),
            (
                "too big after 70 bytes of VXLAN",
                Ipv6::new(
                    pod(),
                    vxlan_pod(),
                    Udp::new(1, 2).payload(&[0; 1500 - 40 - 8 - 69]),
                ),
                Reason::Ipv6Udp,
                Reason::PassTooBig,
            ),
        ];
        for (name, ip, class, verdict) in cases {
            let frame = pod_frame(&ip);
            let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
            assert_eq!(r.verdict, TC_ACT_OK, "{name}");
            assert_bytes(&r.out, &frame, name);
            assert_counted(&r, &[class, verdict], name);
        }
        // The largest packet that fits VXLAN: 1430 bytes.
        let ip = Ipv6::new(pod(), vxlan_pod(), Udp::new(1, 2).payload(&[0; 1430 - 48]));
        let r = run(fp, Hook::FromBridge, &pod_frame(&ip), Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_REDIRECT);
        assert_eq!(r.out.len(), 14 + 1500);
        packet::verify(&r.out).expect("checksum of a full-size packet");
        // GSO packets cannot get per-segment outer checksums: flannel-v6 sends them.
        let big_ip = Ipv6::new(pod(), vxlan_pod(), Tcp::new(1, 2).payload(&[1; 3000]));
        let big = pod_frame(&big_ip);
        let gso = Skb::on(ifs.br).gso(1000, 3);
        let r = run(fp, Hook::FromBridge, &big, gso);
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_bytes(&r.out, &big, "GSO");
        assert_counted(&r, &[Reason::Ipv6Tcp, Reason::PassGso], "GSO");
        // With the kernel's route to the peer's subnet through flannel-v6.1, a GSO packet goes
        // to that device as the route says (its MACs, hop limit), not through the stack.
        // (The flow's next small packets still take the fast path's own encapsulation.)
        add_flannel_v6_route();
        let r = run(fp, Hook::FromBridge, &big, gso);
        assert_eq!(r.verdict, TC_ACT_REDIRECT, "{:?}", r.counted);
        // Not marked: its outer packet meets netfilter, where mark bits mean something to
        // others; it carries FASTPATH_TC_INDEX instead (which test_run does not report).
        assert_eq!(r.mark_after, 0);
        assert_bytes(
            &r.out,
            &Ethernet::new(LOCAL_VTEP6, VTEP3, hop(&big_ip)).encode(),
            "GSO to the device",
        );
        // (Only flannel-v6.1's route and neighbour give these MACs: its own and the VTEP's.)
        assert_counted(
            &r,
            &[Reason::Ipv6Tcp, Reason::FastVxlan6Device],
            "GSO to the device",
        );
        // Host-gw takes GSO packets (no encapsulation).
        let big = pod_frame(&Ipv6::new(
            pod(),
            hostgw_pod(),
            Tcp::new(1, 2).payload(&[1; 3000]),
        ));
        let r = run(fp, Hook::FromBridge, &big, gso);
        assert_eq!(r.verdict, TC_ACT_REDIRECT);
    });
}

/// In the rig's namespace: `flannel-v6.1` (VNI 1, our VTEP MAC) with the kernel's route to the
/// VXLAN pod subnet through it and the peer VTEP's neighbour entry, as the agent sets them up.
fn add_flannel_v6_route() {
    for cmd in [
        "ip link add flannel-v6.1 type vxlan id 1 local fd00:77::1 dstport 8472 nolearning dev ext0",
        "ip link set flannel-v6.1 address 0e:06:00:00:00:01",
        "ip link set flannel-v6.1 up",
        "ip -6 route add fd00:10:244:3::/64 via fd00:10:244:3:: dev flannel-v6.1 onlink",
        "ip -6 neigh replace fd00:10:244:3:: lladdr 0e:06:00:00:00:03 dev flannel-v6.1 nud permanent",
    ] {
        let argv: Vec<&str> = cmd.split_whitespace().collect();
        let status = std::process::Command::new(argv[0])
            .args(&argv[1..])
            .status()
            .expect(cmd);
        assert!(status.success(), "{cmd}");
    }
}

/// A frame from the underlay to us.
fn underlay(src_mac: Mac, ip: Ipv6) -> Vec<u8> {
    Ethernet::new(src_mac, EXT_MAC, ip).encode()
}

fn vxlan6_frame(from: &str, vni: u32, inner_dst: Mac, inner: &Ipv6) -> Vec<u8> {
    let inner = Ethernet::new(VTEP3, inner_dst, inner.clone()).encode();
    underlay(
        PEER3_MAC,
        Ipv6::new(v6(from), pub1(), Udp::vxlan(45678, vni, &inner)),
    )
}

#[test]
fn remote_ipv6_pods_are_delivered_to_the_bridge() {
    let Some(rig) = Rig::new("f6rx") else { return };
    rig.with_fast_path(false, |fp, ifs| {
        let skb = Skb::on(ifs.ext);
        for l4 in l4s() {
            let class = class_of(&l4);
            // Plain (host-gw).
            let ip = Ipv6 {
                hop_limit: 63,
                ..Ipv6::new(hostgw_pod(), pod(), l4.clone())
            };
            let frame = underlay(PEER2_MAC, ip.clone());
            let r = run(fp, Hook::FromNetdev, &frame, skb);
            assert_eq!(r.verdict, TC_ACT_REDIRECT, "{}", hexdump(&r.out));
            assert_bytes(
                &r.out,
                &Ethernet::new(BR_MAC, POD_MAC, hop(&ip)).encode(),
                "plain delivery",
            );
            assert_counted(&r, &[class, Reason::FastDeliver6], "plain");
            // VXLAN over IPv6 from a known peer.
            let inner = Ipv6::new(vxlan_pod(), pod(), l4);
            let frame = vxlan6_frame("fd00:77::3", 1, LOCAL_VTEP6, &inner);
            let r = run(fp, Hook::FromNetdev, &frame, skb);
            assert_eq!(r.verdict, TC_ACT_REDIRECT, "{}", hexdump(&r.out));
            assert_bytes(
                &r.out,
                &Ethernet::new(BR_MAC, POD_MAC, hop(&inner)).encode(),
                "VXLAN delivery",
            );
            assert_counted(&r, &[Reason::Ipv6Udp, Reason::FastDeliverVxlan6], "vxlan");
        }
        // What is left to flannel-v6 and the stack, unchanged.
        let inner = Ipv6::new(vxlan_pod(), pod(), Tcp::new(80, 1));
        for (name, frame, verdict) in [
            (
                "from a node that is no VXLAN peer",
                vxlan6_frame("fd00:77::9", 1, LOCAL_VTEP6, &inner),
                Reason::PassUnknownPeer,
            ),
            (
                "another VNI",
                vxlan6_frame("fd00:77::3", 2, LOCAL_VTEP6, &inner),
                Reason::PassVxlanMismatch,
            ),
            (
                "another inner MAC",
                vxlan6_frame("fd00:77::3", 1, VTEP6, &inner),
                Reason::PassVxlanMismatch,
            ),
            (
                "to the gateway",
                vxlan6_frame(
                    "fd00:77::3",
                    1,
                    LOCAL_VTEP6,
                    &Ipv6::new(
                        vxlan_pod(),
                        v6("fd00:10:244:1::1"),
                        Transport::Icmpv6(Icmp::echo6_request(1, 1)),
                    ),
                ),
                Reason::PassNotForPod,
            ),
        ] {
            let r = run(fp, Hook::FromNetdev, &frame, skb);
            assert_eq!(r.verdict, TC_ACT_OK, "{name}");
            assert_bytes(&r.out, &frame, name);
            assert_counted(&r, &[Reason::Ipv6Udp, verdict], name);
        }
        // A GSO VXLAN packet: left to flannel-v6, its flow handed to the kernel both ways.
        let gso_inner = Ipv6::new(vxlan_pod(), pod(), Tcp::new(80, 43000).payload(&[3; 1200]));
        let frame = vxlan6_frame("fd00:77::3", 1, LOCAL_VTEP6, &gso_inner);
        let r = run(fp, Hook::FromNetdev, &frame, skb.gso(600, 2));
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_counted(
            &r,
            &[Reason::Ipv6Udp, Reason::PassGso, Reason::LearnKernelFlow],
            "GSO",
        );
        let reply = pod_frame(&Ipv6::new(pod(), vxlan_pod(), Tcp::new(43000, 80)));
        let r = run(fp, Hook::FromBridge, &reply, Skb::on(ifs.br));
        assert_counted(&r, &[Reason::Ipv6Tcp, Reason::PassKernelFlow], "its reply");

        // VXLAN receive in eBPF off (`CFG6_VXLAN_RX`): a packet it would deliver is left to
        // flannel-v6 unchanged.
        fp.set_config6(Some(&LocalConfig6 {
            vxlan_rx: false,
            ..config6(ifs.ext)
        }))
        .expect("VXLAN receive off");
        let frame = vxlan6_frame("fd00:77::3", 1, LOCAL_VTEP6, &inner);
        let r = run(fp, Hook::FromNetdev, &frame, skb);
        assert_eq!(r.verdict, TC_ACT_OK, "VXLAN receive off");
        assert_bytes(&r.out, &frame, "VXLAN receive off");
        assert_counted(
            &r,
            &[Reason::Ipv6Udp, Reason::PassVxlanRxOff],
            "VXLAN receive off",
        );
    });
}

#[test]
fn ipv6_flow_tables_keep_conntrack_consistent() {
    let Some(rig) = Rig::new("f6kf") else { return };
    rig.with_fast_path(false, |fp, ifs| {
        let egress = Skb {
            ifindex: ifs.ext,
            ..Skb::default()
        };
        // A pod's packet the kernel sent (DNATed from a ClusterIP, say), plain ...
        let out = Ethernet::new(
            EXT_MAC,
            PEER2_MAC,
            Ipv6::new(pod(), hostgw_pod(), Tcp::new(40000, 80)),
        )
        .encode();
        let r = run(fp, Hook::ToNetdev, &out, egress);
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_counted(
            &r,
            &[
                Reason::Ipv6Tcp,
                Reason::PassNoRoute,
                Reason::LearnKernelFlow,
            ],
            "kernel packet",
        );
        // ... and inside flannel-v6's VXLAN.
        let inner = Ethernet::new(
            LOCAL_VTEP6,
            VTEP3,
            Ipv6::new(pod(), vxlan_pod(), Tcp::new(41000, 80)),
        )
        .encode();
        let vx = Ethernet::new(
            EXT_MAC,
            PEER3_MAC,
            Ipv6::new(pub1(), v6("fd00:77::3"), Udp::vxlan(50000, 1, &inner)),
        )
        .encode();
        let r = run(fp, Hook::ToNetdev, &vx, egress);
        assert_counted(
            &r,
            &[
                Reason::Ipv6Udp,
                Reason::PassNoRoute,
                Reason::LearnKernelFlow,
            ],
            "flannel-v6 VXLAN",
        );
        // Their replies go to the stack; another flow is delivered.
        let ingress = Skb::on(ifs.ext);
        let reply = underlay(
            PEER2_MAC,
            Ipv6::new(hostgw_pod(), pod(), Tcp::new(80, 40000)),
        );
        let r = run(fp, Hook::FromNetdev, &reply, ingress);
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_counted(&r, &[Reason::Ipv6Tcp, Reason::PassKernelFlow], "reply");
        let vreply = vxlan6_frame(
            "fd00:77::3",
            1,
            LOCAL_VTEP6,
            &Ipv6::new(vxlan_pod(), pod(), Tcp::new(80, 41000)),
        );
        let r = run(fp, Hook::FromNetdev, &vreply, ingress);
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_counted(
            &r,
            &[Reason::Ipv6Udp, Reason::PassKernelFlow],
            "VXLAN reply",
        );
        let other = underlay(
            PEER2_MAC,
            Ipv6::new(hostgw_pod(), pod(), Tcp::new(80, 40001)),
        );
        assert_eq!(
            run(fp, Hook::FromNetdev, &other, ingress).verdict,
            TC_ACT_REDIRECT
        );
        // NAT guard: a remote pod talked to the gateway; the pod's answers take the kernel.
        let to_gw = underlay(
            PEER2_MAC,
            Ipv6::new(hostgw_pod(), v6("fd00:10:244:1::1"), Udp::new(5000, 53)),
        );
        let r = run(fp, Hook::FromNetdev, &to_gw, ingress);
        assert_counted(
            &r,
            &[
                Reason::Ipv6Udp,
                Reason::PassNotForPod,
                Reason::LearnNatGuard,
            ],
            "to the gateway",
        );
        let answer = pod_frame(&Ipv6::new(pod(), hostgw_pod(), Udp::new(53, 5000)));
        let r = run(fp, Hook::FromBridge, &answer, Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_counted(&r, &[Reason::Ipv6Udp, Reason::PassNatReply], "NAT reply");
    });
}

/// The held IPv6 tables the agent writes from conntrack (`bpf::seed::Held`): a Service
/// connection's kernel-flow key held in `FLANNEL_HFLOWS6` alone (not in the LRU table, as after
/// an eviction) keeps its replies in the stack, and a remote client's NAT-guard key held in
/// `FLANNEL_HNATGD6` alone keeps the local pod's answers there; once a read of conntrack no
/// longer finds them, both take the fast path.
#[test]
fn ipv6_held_keys_keep_flows_in_the_stack_until_conntrack_lets_them_go() {
    use flannel_agent::bpf::seed::{Keys, Seeds};
    use flannel_common::v6::{FlowKey6, PeerKey6};

    let Some(rig) = Rig::new("f6held") else {
        return;
    };
    rig.with_fast_path(false, |fp, ifs| {
        let flow = FlowKey6 {
            local_addr: pod().octets(),
            remote_addr: hostgw_pod().octets(),
            local_port: 40000u16.to_be_bytes(),
            remote_port: 80u16.to_be_bytes(),
            proto: 6,
            _pad: [0; 3],
        };
        let guard = PeerKey6 {
            addr: hostgw_pod().octets(),
            port: 41000u16.to_be_bytes(),
            proto: 6,
            _pad: 0,
        };
        let held = Seeds {
            held: Keys {
                flows6: [flow].into(),
                guards6: [guard].into(),
                ..Keys::default()
            },
            ..Seeds::default()
        };
        assert_eq!(fp.seed(&held).expect("seed").held.held, 2);
        let reply = underlay(
            PEER2_MAC,
            Ipv6::new(hostgw_pod(), pod(), Tcp::new(80, 40000)),
        );
        let answer = pod_frame(&Ipv6::new(pod(), hostgw_pod(), Tcp::new(8080, 41000)));
        let ingress = Skb::on(ifs.ext);
        let r = run(fp, Hook::FromNetdev, &reply, ingress);
        assert_passed(
            &r,
            &reply,
            Reason::Ipv6Tcp,
            Reason::PassKernelFlow,
            "held reply",
        );
        let r = run(fp, Hook::FromBridge, &answer, Skb::on(ifs.br));
        assert_passed(
            &r,
            &answer,
            Reason::Ipv6Tcp,
            Reason::PassNatReply,
            "held answer",
        );

        assert_eq!(fp.seed(&Seeds::default()).expect("seed").held.removed, 2);
        assert_eq!(
            run(fp, Hook::FromNetdev, &reply, ingress).verdict,
            TC_ACT_REDIRECT,
            "the reply once let go"
        );
        let r = run(fp, Hook::FromBridge, &answer, Skb::on(ifs.br));
        assert_counted(
            &r,
            &[Reason::Ipv6Tcp, Reason::FastHostGw6],
            "the answer once let go",
        );
    });
}

#[test]
fn ipv6_only_and_dual_stack_configurations() {
    let Some(rig) = Rig::new("f6fam") else { return };
    let v4_frame = Ethernet::new(
        POD_MAC,
        BR_MAC,
        Ipv4::new(
            Ipv4Addr::new(10, 244, 1, 5),
            Ipv4Addr::new(10, 244, 2, 7),
            Tcp::new(1, 2),
        ),
    )
    .encode();
    let v6_frame = pod_frame(&Ipv6::new(pod(), hostgw_pod(), Tcp::new(1, 2)));
    // IPv6 only: IPv6 forwarded, IPv4 passed as unconfigured.
    rig.with_fast_path(false, |fp, ifs| {
        let r = run(fp, Hook::FromBridge, &v6_frame, Skb::on(ifs.br));
        assert_counted(
            &r,
            &[Reason::Ipv6Tcp, Reason::FastHostGw6],
            "v6 on a v6-only node",
        );
        let r = run(fp, Hook::FromBridge, &v4_frame, Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_counted(
            &r,
            &[Reason::Ipv4Tcp, Reason::PassNotConfigured],
            "v4 on a v6-only node",
        );
        assert_eq!(fp.config_entry().expect("v4 entry").flags, 0);
        // IPv6 disabled again: IPv6 frames are passed as before IPv6 support.
        fp.set_config6(None).expect("disable v6");
        let r = run(fp, Hook::FromBridge, &v6_frame, Skb::on(ifs.br));
        assert_counted(&r, &[Reason::Ipv6Tcp, Reason::PassNotIpv4], "v6 disabled");
    });
    // Dual stack: both families forwarded side by side.
    rig.with_fast_path(true, |fp, ifs| {
        let r = run(fp, Hook::FromBridge, &v6_frame, Skb::on(ifs.br));
        assert_counted(
            &r,
            &[Reason::Ipv6Tcp, Reason::FastHostGw6],
            "v6 on a dual node",
        );
        let r = run(fp, Hook::FromBridge, &v4_frame, Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_REDIRECT);
        assert_counted(
            &r,
            &[Reason::Ipv4Tcp, Reason::FastHostGw],
            "v4 on a dual node",
        );
    });
}

// ---------------------------------------------------------------------------------------------
// Remembered decisions (`flannel_common::memo::MEMO6`).

/// What the daemon does once its comparison of the maps with what it wrote ([`FastPath::drift`],
/// every 2 s or so) finds them changed behind its back: the next sync reads them and writes
/// back what is missing.
fn check_and_sync6(fp: &mut FastPath, desired: &BTreeMap<Ipv6Net, Remote6>) -> SyncStats {
    fp.drift()
        .expect("comparing the maps with what was written");
    fp.sync6(desired).expect("sync6")
}

/// Removes the remote IPv6 subnet `subnet` from the route map behind the agent's back (no
/// generation change), so that only a remembered decision can still carry its flows. The
/// IPv6 maps are not pinned: the map is the one `tc_from_bridge` of this fast path uses.
fn remove_route6_behind_the_agents_back(fp: &mut FastPath, subnet: Ipv6Net) {
    let name = flannel_common::v6::ROUTES6;
    let ids = fp
        .program_mut(Hook::FromBridge)
        .expect("program")
        .info()
        .expect("program info")
        .map_ids()
        .expect("map ids")
        .expect("the kernel lists the maps");
    let id = ids
        .into_iter()
        .find(|id| {
            aya::maps::MapInfo::from_id(*id).is_ok_and(|info| info.name_as_str() == Some(name))
        })
        .unwrap_or_else(|| panic!("tc_from_bridge uses no {name}"));
    let data = aya::maps::MapData::from_id(id).unwrap_or_else(|e| panic!("{name}: {e}"));
    let map = aya::maps::Map::from_map_data(data).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut trie: aya::maps::LpmTrie<_, [u8; 16], flannel_common::route::RemoteEntry6> =
        aya::maps::LpmTrie::try_from(map).unwrap_or_else(|e| panic!("{name}: {e}"));
    let key = aya::maps::lpm_trie::Key::new(u32::from(subnet.prefix_len()), subnet.addr().octets());
    trie.remove(&key)
        .unwrap_or_else(|e| panic!("removing {subnet} from {name}: {e}"));
}

/// Whether `r` is the full checks' or a memo's fast verdict `fast`: redirected, exactly the
/// class and `fast` counted (and for deliveries the peer delivery), `want` out.
fn assert_fast(r: &bpf_support::Run, class: Reason, fast: &[Reason], want: &[u8], what: &str) {
    assert_eq!(r.verdict, TC_ACT_REDIRECT, "{what}: {:?}", r.counted);
    assert_bytes(&r.out, want, what);
    let mut reasons = vec![class];
    reasons.extend_from_slice(fast);
    assert_counted(r, &reasons, what);
}

/// Whether `r` left `frame` to the kernel unchanged, with `class` and `pass` counted.
fn assert_passed(r: &bpf_support::Run, frame: &[u8], class: Reason, pass: Reason, what: &str) {
    assert_eq!(r.verdict, TC_ACT_OK, "{what}: {:?}", r.counted);
    assert_bytes(&r.out, frame, what);
    assert_counted(r, &[class, pass], what);
}

/// The IPv6 twin of `an_old_memo_is_confirmed_by_a_fresh_lookup_of_its_route`: IPv6 has no
/// remembered route lookups, so a memo past its second is confirmed by a route lookup made
/// for its packet. On transmit (host-gw and VXLAN) and delivery, with the routes removed
/// behind the agent's back, the flows are still forwarded as the full checks did (counted
/// `memo_confirmed`), and the next packet is a plain memo hit. A changed neighbour confirms
/// nothing: the full checks send the flow to the new MAC.
#[test]
fn an_old_ipv6_memo_is_confirmed_by_a_route_lookup() {
    let Some(rig) = Rig::new("f6memoconf") else {
        return;
    };
    const MOVED_MAC: Mac = [0x02, 0xcc, 0, 0, 0, 0x97];
    let (hostgw, vxlan) = (net6("fd00:10:244:2::/64"), net6("fd00:10:244:3::/64"));
    rig.with_fast_path(false, |fp, ifs| {
        know_pod_port(fp, ifs);
        let out = |dst: Ipv6Addr, sport: u16| {
            Ipv6::new(pod(), dst, Tcp::new(sport, 8080).payload(b"memo6"))
        };
        let send = |fp: &mut FastPath, ip: &Ipv6| {
            run(fp, Hook::FromBridge, &pod_frame(ip), Skb::on(ifs.br))
        };
        let a = Ipv6 {
            hop_limit: 63,
            ..Ipv6::new(hostgw_pod(), pod(), Tcp::new(81, 40000).payload(b"memo6"))
        };
        let a_frame = underlay(PEER2_MAC, a.clone());
        let receive = |fp: &mut FastPath| run(fp, Hook::FromNetdev, &a_frame, Skb::on(ifs.ext));
        let (c, v) = (out(hostgw_pod(), 40001), out(vxlan_pod(), 40002));
        let sent = |ip: &Ipv6, mac: Mac| Ethernet::new(EXT_MAC, mac, hop(ip)).encode();
        let delivered = Ethernet::new(BR_MAC, POD_MAC, hop(&a)).encode();
        let host_gw = [Reason::FastHostGw6];
        let deliver = [Reason::FastDeliver6, Reason::DeliverPeer];
        let confirmed = |fast: &[Reason]| {
            let mut reasons = fast.to_vec();
            reasons.extend([Reason::MemoHit, Reason::MemoConfirmed]);
            reasons
        };

        let c_sent = sent(&c, PEER2_MAC);
        assert_fast(
            &send(fp, &c),
            Reason::Ipv6Tcp,
            &host_gw,
            &c_sent,
            "C, full checks",
        );
        let v_full = send(fp, &v);
        assert_eq!(v_full.verdict, TC_ACT_REDIRECT, "{:?}", v_full.counted);
        assert_counted(
            &v_full,
            &[Reason::Ipv6Tcp, Reason::FastVxlan6],
            "V, full checks",
        );
        assert_fast(
            &receive(fp),
            Reason::Ipv6Tcp,
            &deliver,
            &delivered,
            "A, full checks",
        );
        remove_route6_behind_the_agents_back(fp, hostgw);
        remove_route6_behind_the_agents_back(fp, vxlan);
        thread::sleep(past_hop_ttl());
        let r = send(fp, &c);
        assert_fast(
            &r,
            Reason::Ipv6Tcp,
            &confirmed(&host_gw),
            &c_sent,
            "C, confirmed",
        );
        let r = send(fp, &v);
        let vxlan6 = [Reason::FastVxlan6];
        assert_fast(
            &r,
            Reason::Ipv6Tcp,
            &confirmed(&vxlan6),
            &v_full.out,
            "V, confirmed",
        );
        let r = receive(fp);
        assert_fast(
            &r,
            Reason::Ipv6Tcp,
            &confirmed(&deliver),
            &delivered,
            "A, confirmed",
        );
        // Stamped afresh: the next packet is a plain memo hit.
        let memo_out = [Reason::FastHostGw6, Reason::MemoHit];
        assert_fast(
            &send(fp, &c),
            Reason::Ipv6Tcp,
            &memo_out,
            &c_sent,
            "C, then fresh",
        );

        // The peer's MAC changes while flow C is remembered: its memo is not confirmed.
        check_and_sync6(fp, &remotes6());
        assert_fast(
            &send(fp, &c),
            Reason::Ipv6Tcp,
            &host_gw,
            &c_sent,
            "C, full checks again",
        );
        rig.sh(&format!(
            "ip -6 neigh replace fd00:77::2 lladdr {} dev ext0 nud permanent",
            mac_str(&MOVED_MAC)
        ));
        thread::sleep(past_hop_ttl());
        let moved = sent(&c, MOVED_MAC);
        assert_fast(
            &send(fp, &c),
            Reason::Ipv6Tcp,
            &host_gw,
            &moved,
            "C, a moved neighbour",
        );
    });
}

/// An IPv6 host-gw flow's decision is remembered as an IPv4 one is: with the route removed
/// behind the agent's back the flow's next packets are still sent / delivered exactly as the
/// full checks did (counted as `memo_hit`), and only that flow's; hop limit 1 never takes a
/// memo. Every change the decision rests on retires it: an IPv6 NAT-guard or kernel-flow entry
/// the programs learn for its remote endpoint (not the memos of other endpoints), the agent's
/// IPv6 route sync and configuration writes.
#[test]
fn ipv6_flows_are_remembered_until_what_decided_them_changes() {
    let Some(rig) = Rig::new("f6memo") else {
        return;
    };
    let hostgw = net6("fd00:10:244:2::/64");
    rig.with_fast_path(false, move |fp, ifs| {
        know_pod_port(fp, ifs);
        let skb = Skb::on(ifs.ext);

        // Transmit: flow C.
        let out = |sport: u16, hop_limit: u8| Ipv6 {
            hop_limit,
            ..Ipv6::new(pod(), hostgw_pod(), Tcp::new(sport, 8080).payload(b"memo6"))
        };
        let send = |fp: &mut FastPath, ip: &Ipv6| {
            let frame = pod_frame(ip);
            (run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br)), frame)
        };
        let c = out(40001, 64);
        let sent = Ethernet::new(EXT_MAC, PEER2_MAC, hop(&c)).encode();
        let fast_out = [Reason::FastHostGw6];
        let memo_out = [Reason::FastHostGw6, Reason::MemoHit];
        let generation = |fp: &FastPath, port: u16| {
            let slot = learn_slot6(&hostgw_pod().octets(), port.to_be_bytes(), 6);
            fp.memo_generation(slot).expect("generation")
        };
        let (r, _) = send(fp, &c);
        assert_fast(&r, Reason::Ipv6Tcp, &fast_out, &sent, "C, full checks");
        assert_eq!(r.mark_after, FASTPATH_MARK);
        remove_route6_behind_the_agents_back(fp, hostgw);
        let (r, _) = send(fp, &c);
        assert_fast(&r, Reason::Ipv6Tcp, &memo_out, &sent, "C, remembered");
        assert_eq!(r.mark_after, FASTPATH_MARK, "C, remembered: marked");
        let (r, frame) = send(fp, &out(40009, 64));
        assert_passed(
            &r,
            &frame,
            Reason::Ipv6Tcp,
            Reason::PassNoRoute,
            "another flow",
        );
        let (r, frame) = send(fp, &out(40001, 1));
        assert_passed(
            &r,
            &frame,
            Reason::Ipv6Tcp,
            Reason::PassNoRoute,
            "hop limit 1",
        );
        // A UDP flow is remembered too.
        let u = Ipv6::new(pod(), hostgw_pod(), Udp::new(5353, 53).payload(b"q"));
        let u_sent = Ethernet::new(EXT_MAC, PEER2_MAC, hop(&u)).encode();
        assert_eq!(check_and_sync6(fp, &remotes6()).added, 1);
        let (r, _) = send(fp, &u);
        assert_fast(&r, Reason::Ipv6Udp, &fast_out, &u_sent, "UDP, full checks");
        remove_route6_behind_the_agents_back(fp, hostgw);
        let (r, _) = send(fp, &u);
        let u_memo = [Reason::FastHostGw6, Reason::MemoHit];
        assert_fast(&r, Reason::Ipv6Udp, &u_memo, &u_sent, "UDP, remembered");
        // The agent's sync puts the route back and retires; C is decided afresh.
        let before = generation(fp, 8080);
        assert_eq!(check_and_sync6(fp, &remotes6()).added, 1);
        assert_eq!(generation(fp, 8080), before + 1);
        let (r, _) = send(fp, &c);
        assert_fast(&r, Reason::Ipv6Tcp, &fast_out, &sent, "C after the sync");
        // Flow E, to an endpoint of the remote pod in another learn slot, remembered.
        let slot_of = |port: u16| learn_slot6(&hostgw_pod().octets(), port.to_be_bytes(), 6);
        let e_port = (9000..9200)
            .find(|&p| slot_of(p) != slot_of(8080))
            .expect("a port of another slot");
        let e = Ipv6::new(
            pod(),
            hostgw_pod(),
            Tcp::new(40002, e_port).payload(b"memo6"),
        );
        let e_sent = Ethernet::new(EXT_MAC, PEER2_MAC, hop(&e)).encode();
        let (r, _) = send(fp, &e);
        assert_fast(&r, Reason::Ipv6Tcp, &fast_out, &e_sent, "E, full checks");
        remove_route6_behind_the_agents_back(fp, hostgw);
        // The remote pod reaches a host address from C's endpoint: the IPv6 NAT guard learns
        // it, which retires C's memo and leaves E's.
        let to_host = underlay(
            PEER2_MAC,
            Ipv6::new(hostgw_pod(), pub1(), Tcp::new(8080, 30080)),
        );
        let (before_c, before_e) = (generation(fp, 8080), generation(fp, e_port));
        let r = run(fp, Hook::FromNetdev, &to_host, skb);
        assert!(
            r.counted
                .iter()
                .any(|(reason, _, _)| *reason == Reason::LearnNatGuard),
            "{:?}",
            r.counted
        );
        assert_eq!(generation(fp, 8080), before_c + 1, "C's endpoint retired");
        assert_eq!(generation(fp, e_port), before_e, "E's endpoint not");
        let (r, _) = send(fp, &e);
        assert_fast(
            &r,
            Reason::Ipv6Tcp,
            &memo_out,
            &e_sent,
            "E, still remembered",
        );
        assert_eq!(check_and_sync6(fp, &remotes6()).added, 1);
        let (r, frame) = send(fp, &c);
        assert_passed(
            &r,
            &frame,
            Reason::Ipv6Tcp,
            Reason::PassNatReply,
            "C, NAT-guarded",
        );

        // Delivery: flow A, into the pod's namespace.
        let incoming = |sport: u16, hop_limit: u8| Ipv6 {
            hop_limit,
            ..Ipv6::new(
                hostgw_pod(),
                pod(),
                Tcp::new(sport, 40000).payload(b"memo6"),
            )
        };
        let receive = |fp: &mut FastPath, ip: &Ipv6| {
            let frame = underlay(PEER2_MAC, ip.clone());
            (run(fp, Hook::FromNetdev, &frame, skb), frame)
        };
        let fast_in = [Reason::FastDeliver6, Reason::DeliverPeer];
        let memo_in = [Reason::FastDeliver6, Reason::DeliverPeer, Reason::MemoHit];
        let a = incoming(81, 63);
        let delivered = Ethernet::new(BR_MAC, POD_MAC, hop(&a)).encode();
        let (r, _) = receive(fp, &a);
        assert_fast(&r, Reason::Ipv6Tcp, &fast_in, &delivered, "A, full checks");
        remove_route6_behind_the_agents_back(fp, hostgw);
        let (r, _) = receive(fp, &a);
        assert_fast(&r, Reason::Ipv6Tcp, &memo_in, &delivered, "A, remembered");
        let (r, frame) = receive(fp, &incoming(82, 63));
        assert_passed(
            &r,
            &frame,
            Reason::Ipv6Tcp,
            Reason::PassForeignSource,
            "another flow",
        );
        let (r, frame) = receive(fp, &incoming(81, 1));
        assert_passed(
            &r,
            &frame,
            Reason::Ipv6Tcp,
            Reason::PassForeignSource,
            "hop limit 1",
        );
        // The kernel carried a packet of flow A out: the learner retires the memo.
        let kernel_out = Ethernet::new(
            EXT_MAC,
            PEER2_MAC,
            Ipv6::new(pod(), hostgw_pod(), Tcp::new(40000, 81)),
        )
        .encode();
        let before = generation(fp, 81);
        let r = run(fp, Hook::ToNetdev, &kernel_out, Skb::egress(ifs.ext));
        assert!(
            r.counted
                .iter()
                .any(|(reason, _, _)| *reason == Reason::LearnKernelFlow),
            "{:?}",
            r.counted
        );
        assert_eq!(generation(fp, 81), before + 1);
        let (r, frame) = receive(fp, &a);
        assert_passed(
            &r,
            &frame,
            Reason::Ipv6Tcp,
            Reason::PassForeignSource,
            "A, retired",
        );

        // Flow B, remembered; the agent's IPv6 configuration write retires it.
        assert_eq!(check_and_sync6(fp, &remotes6()).added, 1);
        let b = incoming(83, 63);
        let b_delivered = Ethernet::new(BR_MAC, POD_MAC, hop(&b)).encode();
        let (r, _) = receive(fp, &b);
        assert_fast(
            &r,
            Reason::Ipv6Tcp,
            &fast_in,
            &b_delivered,
            "B, full checks",
        );
        remove_route6_behind_the_agents_back(fp, hostgw);
        let (r, _) = receive(fp, &b);
        assert_fast(&r, Reason::Ipv6Tcp, &memo_in, &b_delivered, "B, remembered");
        fp.set_config6(Some(&config6(ifs.ext))).expect("config6");
        let (r, frame) = receive(fp, &b);
        assert_passed(
            &r,
            &frame,
            Reason::Ipv6Tcp,
            Reason::PassForeignSource,
            "B, retired",
        );
    });
}

/// A remembered IPv6 flow's packets that the memo must not decide: a hop-by-hop header, a
/// fragment header (a first fragment, same ports), a payload length beyond the frame and a TCP
/// header cut by the end of the frame go to the full checks in both directions and come out
/// unchanged with the full checks' class and pass reason, while the flow's plain packets before
/// and after each are still sent / delivered from the memo (the route is gone behind the
/// agent's back, so only the memo can take them).
#[test]
fn a_remembered_ipv6_flows_odd_packets_take_the_full_checks() {
    let Some(rig) = Rig::new("f6memoodd") else {
        return;
    };
    let hostgw = net6("fd00:10:244:2::/64");
    rig.with_fast_path(false, move |fp, ifs| {
        know_pod_port(fp, ifs);
        // How a packet of one direction is framed.
        type FrameOf<'a> = &'a dyn Fn(&Ipv6) -> Vec<u8>;
        // The odd variants of a flow's packet `ip` inside `frame_of(ip)`.
        let odd = |ip: &Ipv6, frame_of: FrameOf| {
            let (plen_at, l4_at) = (14 + 4, 14 + 40);
            let cut_tcp = {
                let mut f = frame_of(ip);
                f.truncate(l4_at + 10);
                f[plen_at..plen_at + 2].copy_from_slice(&10u16.to_be_bytes());
                f
            };
            vec![
                (
                    "hop-by-hop header",
                    frame_of(&Ipv6 {
                        extensions: vec![Ipv6Ext::hop_by_hop_padding()],
                        ..ip.clone()
                    }),
                    Reason::Ipv6ExtHeader,
                    Reason::PassIpv6ExtHeader,
                ),
                (
                    "first fragment",
                    frame_of(&Ipv6 {
                        extensions: vec![Ipv6Ext::fragment(0, true, 7)],
                        ..ip.clone()
                    }),
                    Reason::Ipv6ExtHeader,
                    Reason::PassIpv6ExtHeader,
                ),
                (
                    "payload length beyond the frame",
                    frame_of(&Ipv6 {
                        payload_length: Some(2000),
                        ..ip.clone()
                    }),
                    Reason::Ipv6BadLength,
                    Reason::PassMalformed,
                ),
                (
                    "TCP header cut by the end of the frame",
                    cut_tcp,
                    Reason::L4Truncated,
                    Reason::PassMalformed,
                ),
            ]
        };

        let outgoing = Ipv6::new(pod(), hostgw_pod(), Tcp::new(40001, 8080).payload(b"memo6"));
        let sent = Ethernet::new(EXT_MAC, PEER2_MAC, hop(&outgoing)).encode();
        // `memo`: decided by the flow's memo, not the full checks.
        let send_fast = |fp: &mut FastPath, memo: bool, what: &str| {
            let r = run(fp, Hook::FromBridge, &pod_frame(&outgoing), Skb::on(ifs.br));
            let mut fast = vec![Reason::FastHostGw6];
            fast.extend(memo.then_some(Reason::MemoHit));
            assert_fast(&r, Reason::Ipv6Tcp, &fast, &sent, what);
        };
        let incoming = Ipv6 {
            hop_limit: 63,
            ..Ipv6::new(hostgw_pod(), pod(), Tcp::new(81, 40000).payload(b"memo6"))
        };
        let in_frame = |ip: &Ipv6| underlay(PEER2_MAC, ip.clone());
        let delivered = Ethernet::new(BR_MAC, POD_MAC, hop(&incoming)).encode();
        let deliver_fast = |fp: &mut FastPath, memo: bool, what: &str| {
            let r = run(fp, Hook::FromNetdev, &in_frame(&incoming), Skb::on(ifs.ext));
            let mut fast = vec![Reason::FastDeliver6, Reason::DeliverPeer];
            fast.extend(memo.then_some(Reason::MemoHit));
            assert_fast(&r, Reason::Ipv6Tcp, &fast, &delivered, what);
        };
        send_fast(fp, false, "transmit, full checks");
        deliver_fast(fp, false, "delivery, full checks");
        remove_route6_behind_the_agents_back(fp, hostgw);
        send_fast(fp, true, "transmit, remembered");
        deliver_fast(fp, true, "delivery, remembered");

        let directions: [(Hook, Skb, &Ipv6, FrameOf); 2] = [
            (Hook::FromBridge, Skb::on(ifs.br), &outgoing, &pod_frame),
            (Hook::FromNetdev, Skb::on(ifs.ext), &incoming, &in_frame),
        ];
        for (hook, skb, ip, frame_of) in directions {
            for (name, frame, class, pass) in odd(ip, frame_of) {
                let what = format!("{hook:?}: {name}");
                let r = run(fp, hook, &frame, skb);
                assert_passed(&r, &frame, class, pass, &what);
                send_fast(fp, true, &format!("transmit still remembered after {what}"));
                deliver_fast(fp, true, &format!("delivery still remembered after {what}"));
            }
        }
    });
}

/// VXLAN over IPv6 flows are remembered for their peer only. Sent: with the route gone behind
/// the agent's back the flow is still encapsulated byte for byte as the full checks did, a
/// packet longer than the tunnel's room or with hop limit 1 is not, nor a GSO packet. Delivered:
/// decapsulated into the pod the same way, but only from the node it was remembered for, not
/// from another VXLAN peer, not plain.
#[test]
fn ipv6_vxlan_flows_are_remembered_for_their_peer_only() {
    let Some(rig) = Rig::new("f6memovx") else {
        return;
    };
    let subnet = net6("fd00:10:244:3::/64");
    rig.with_fast_path(false, move |fp, ifs| {
        know_pod_port(fp, ifs);

        // Transmit.
        let to_remote = |payload: &[u8], hop_limit: u8| Ipv6 {
            hop_limit,
            ..Ipv6::new(pod(), vxlan_pod(), Tcp::new(40002, 8080).payload(payload))
        };
        let send = |fp: &mut FastPath, ip: &Ipv6, skb: Skb| {
            let frame = pod_frame(ip);
            (run(fp, Hook::FromBridge, &frame, skb), frame)
        };
        let br = Skb::on(ifs.br);
        let ip = to_remote(b"memo6", 64);
        let (full, _) = send(fp, &ip, br);
        assert_eq!(full.verdict, TC_ACT_REDIRECT, "{:?}", full.counted);
        assert_counted(&full, &[Reason::Ipv6Tcp, Reason::FastVxlan6], "full checks");
        packet::verify(&full.out).expect("outer checksums");
        remove_route6_behind_the_agents_back(fp, subnet);
        let (r, _) = send(fp, &ip, br);
        assert_fast(
            &r,
            Reason::Ipv6Tcp,
            &[Reason::FastVxlan6, Reason::MemoHit],
            &full.out,
            "remembered",
        );
        assert_eq!(r.mark_after, FASTPATH_MARK);
        // The room: the external MTU (1500) less 70 outer bytes, for the inner IPv6 packet.
        let fits = 1430 - 40 - 20;
        let (r, _) = send(fp, &to_remote(&vec![7; fits], 64), br);
        assert_eq!(
            r.verdict, TC_ACT_REDIRECT,
            "as long as the room: {:?}",
            r.counted
        );
        assert_counted(
            &r,
            &[Reason::Ipv6Tcp, Reason::FastVxlan6, Reason::MemoHit],
            "as long as the room",
        );
        packet::verify(&r.out).expect("outer checksums");
        for (what, ip, skb) in [
            ("a byte longer", to_remote(&vec![7; fits + 1], 64), br),
            ("hop limit 1", to_remote(b"memo6", 1), br),
            ("GSO", to_remote(&[7; 1200], 64), br.gso(600, 2)),
        ] {
            let (r, frame) = send(fp, &ip, skb);
            assert_passed(&r, &frame, Reason::Ipv6Tcp, Reason::PassNoRoute, what);
        }
        assert_eq!(check_and_sync6(fp, &remotes6()).added, 1);

        // Delivery.
        let inner = Ipv6 {
            hop_limit: 63,
            ..Ipv6::new(vxlan_pod(), pod(), Tcp::new(8080, 40002).payload(b"memo6"))
        };
        let delivered = Ethernet::new(BR_MAC, POD_MAC, hop(&inner)).encode();
        let ext = Skb::on(ifs.ext);
        let from_peer = vxlan6_frame("fd00:77::3", 1, LOCAL_VTEP6, &inner);
        let fast_in = [Reason::FastDeliverVxlan6, Reason::DeliverPeer];
        let r = run(fp, Hook::FromNetdev, &from_peer, ext);
        assert_fast(&r, Reason::Ipv6Udp, &fast_in, &delivered, "full checks");
        remove_route6_behind_the_agents_back(fp, subnet);
        let r = run(fp, Hook::FromNetdev, &from_peer, ext);
        let memo_in = [
            Reason::FastDeliverVxlan6,
            Reason::DeliverPeer,
            Reason::MemoHit,
        ];
        assert_fast(&r, Reason::Ipv6Udp, &memo_in, &delivered, "remembered");
        let not_fast = |r: &bpf_support::Run, frame: &[u8], what: &str| {
            assert_eq!(r.verdict, TC_ACT_OK, "{what}: {:?}", r.counted);
            assert_bytes(&r.out, frame, what);
            assert!(
                r.counted
                    .iter()
                    .all(|(reason, _, _)| !fast_in.contains(reason)),
                "{what}: {:?}",
                r.counted
            );
        };
        let from_other = vxlan6_frame("fd00:77::6", 1, LOCAL_VTEP6, &inner);
        let r = run(fp, Hook::FromNetdev, &from_other, ext);
        not_fast(&r, &from_other, "the same flow from another VXLAN peer");
        let plain = underlay(PEER3_MAC, inner.clone());
        let r = run(fp, Hook::FromNetdev, &plain, ext);
        not_fast(&r, &plain, "the same flow, plain");
        let hop1 = vxlan6_frame(
            "fd00:77::3",
            1,
            LOCAL_VTEP6,
            &Ipv6 {
                hop_limit: 1,
                ..inner.clone()
            },
        );
        let r = run(fp, Hook::FromNetdev, &hop1, ext);
        not_fast(&r, &hop1, "hop limit 1");
        let r = run(fp, Hook::FromNetdev, &from_peer, ext);
        assert_fast(
            &r,
            Reason::Ipv6Udp,
            &memo_in,
            &delivered,
            "remembered, still",
        );
        assert_eq!(check_and_sync6(fp, &remotes6()).added, 1);
    });
}

/// The IPv6 maps are pinned as the IPv4 ones are: a restarted agent's fast path finds the
/// IPv6 configuration, routes and nodes it left, and the IPv6 flow tables (a kernel flow's
/// reply still goes through the kernel, so conntrack keeps seeing both directions).
#[test]
fn ipv6_maps_survive_a_restart() {
    let Some(rig) = Rig::new("f6pin") else { return };
    let pin = rig.pin.clone();
    let kernel_reply = pod_frame(&Ipv6::new(pod(), hostgw_pod(), Tcp::new(40000, 81)));
    let config = rig.with_fast_path(false, |fp, ifs| {
        // The kernel carried a remote pod's packet in for a local pod: the flow is the kernel's.
        let sent = Ethernet::new(
            EXT_MAC,
            PEER2_MAC,
            Ipv6::new(pod(), hostgw_pod(), Tcp::new(40000, 81)),
        )
        .encode();
        let r = run(fp, Hook::ToNetdev, &sent, Skb::egress(ifs.ext));
        assert!(
            r.counted
                .iter()
                .any(|(reason, _, _)| *reason == Reason::LearnKernelFlow),
            "{:?}",
            r.counted
        );
        let r = run(fp, Hook::FromBridge, &kernel_reply, Skb::on(ifs.br));
        assert_counted(&r, &[Reason::Ipv6Tcp, Reason::PassKernelFlow], "before");
        fp.config6_entry().expect("config6")
    });
    rig.ns
        .enter(move || {
            let ifs = Ifaces::current();
            let mut fp = FastPath::load(&pin).expect("loading the fast path again");
            assert_eq!(fp.config6_entry().expect("config6"), config);
            assert!(config.enabled());
            assert_eq!(fp.remotes6().expect("routes"), remotes6());
            let r = run(&mut fp, Hook::FromBridge, &kernel_reply, Skb::on(ifs.br));
            assert_counted(&r, &[Reason::Ipv6Tcp, Reason::PassKernelFlow], "after");
            assert_eq!(
                fp.sync6(&remotes6()).expect("sync6").added,
                0,
                "nothing to add"
            );
        })
        .expect("entering the namespace");
}

/// Each IPv6 path of the TC programs (and a dual-stack node's IPv4 host-gw one) as one
/// well-formed frame: pod egress (host-gw with and without a neighbour, VXLAN), arrivals
/// (plain, VXLAN) and node egress (a kernel-routed pod flow, flannel-v6's VXLAN).
fn seeds_of_every_ipv6_path(ifs: &Ifaces) -> Vec<mutate::Seed> {
    let seed = mutate::Seed::tc;
    let from_pod = |name, dst, l4: Transport| {
        seed(
            name,
            Hook::FromBridge,
            Skb::on(ifs.br),
            pod_frame(&Ipv6::new(pod(), dst, l4)),
        )
    };
    let [tcp, udp, icmp]: [Transport; 3] = l4s().try_into().expect("three");
    let arriving = |src| Ipv6 {
        hop_limit: 63,
        ..Ipv6::new(src, pod(), Tcp::new(80, 40000).payload(b"reply"))
    };
    let flannel_v6 = Ethernet::new(
        EXT_MAC,
        PEER3_MAC,
        Ipv6::new(
            pub1(),
            v6("fd00:77::3"),
            Udp::vxlan(
                50000,
                1,
                &Ethernet::new(
                    LOCAL_VTEP6,
                    VTEP3,
                    Ipv6::new(pod(), vxlan_pod(), Tcp::new(41000, 80)),
                )
                .encode(),
            ),
        ),
    )
    .encode();
    // Fragment `n` of a pod's datagram to `dst` (the first is sent first, so the datagram is
    // remembered when the later one's variants run).
    let fragment = |name, dst, n: usize| {
        let datagram = Ipv6::new(pod(), dst, Udp::new(5353, 53).payload(&[1; 64]));
        let fragment = &datagram.fragments(32, 0x7777)[n];
        let frame = Ethernet::carrying(POD_MAC, BR_MAC, ETH_P_IPV6, fragment).encode();
        seed(name, Hook::FromBridge, Skb::on(ifs.br), frame)
    };
    vec![
        fragment(
            "a pod's first fragment to a host-gw subnet",
            hostgw_pod(),
            0,
        ),
        fragment(
            "a pod's later fragment to a host-gw subnet",
            hostgw_pod(),
            1,
        ),
        fragment("a pod's first fragment to a VXLAN subnet", vxlan_pod(), 0),
        fragment("a pod's later fragment to a VXLAN subnet", vxlan_pod(), 1),
        from_pod("host-gw", hostgw_pod(), tcp.clone()),
        from_pod("host-gw, no neighbour", hostgw_no_neigh_pod(), icmp),
        from_pod("VXLAN", vxlan_pod(), tcp),
        from_pod("VXLAN, UDP", vxlan_pod(), udp),
        seed(
            "IPv4 host-gw",
            Hook::FromBridge,
            Skb::on(ifs.br),
            Ethernet::new(
                POD_MAC,
                BR_MAC,
                Ipv4::new(
                    Ipv4Addr::new(10, 244, 1, 5),
                    Ipv4Addr::new(10, 244, 2, 7),
                    Tcp::new(40000, 80),
                ),
            )
            .encode(),
        ),
        seed(
            "plain arrival",
            Hook::FromNetdev,
            Skb::on(ifs.ext),
            underlay(PEER2_MAC, arriving(hostgw_pod())),
        ),
        seed(
            "VXLAN arrival",
            Hook::FromNetdev,
            Skb::on(ifs.ext),
            vxlan6_frame("fd00:77::3", 1, LOCAL_VTEP6, &arriving(vxlan_pod())),
        ),
        seed(
            "kernel-routed pod flow",
            Hook::ToNetdev,
            Skb::egress(ifs.ext),
            Ethernet::new(
                EXT_MAC,
                PEER2_MAC,
                Ipv6::new(pod(), hostgw_pod(), Tcp::new(40000, 80)),
            )
            .encode(),
        ),
        seed(
            "flannel-v6's VXLAN",
            Hook::ToNetdev,
            Skb::egress(ifs.ext),
            flannel_v6,
        ),
    ]
}

/// Variants of each IPv6 path's packet (and a dual-stack node's IPv4 host-gw one) keep the
/// programs' contract (`bpf_support::mutate`): counted once under a class and once under a
/// verdict, a pass unchanged, a fast verdict carrying the inner packet through with every
/// checksum that verified still right (VXLAN over IPv6's outer UDP checksum among them).
#[test]
fn mutated_ipv6_packets_keep_the_verdicts_and_counters_contract() {
    let Some(rig) = Rig::new("f6mut") else { return };
    rig.with_fast_path(true, |fp, ifs| {
        know_pod_port(fp, ifs);
        let seeds = seeds_of_every_ipv6_path(ifs);
        let tally = mutate::check(fp, &seeds, 3000, Tunnel::Vxlan(8472));
        tally.assert_reached(
            &[
                Reason::FastHostGw6,
                Reason::FastVxlan6,
                Reason::FastDeliver6,
                Reason::FastDeliverVxlan6,
                Reason::FastHostGw,
                Reason::MemoHit,
                Reason::LearnKernelFlow,
            ],
            150,
        );
        assert!(
            tally.memo_compared >= 50,
            "only {} variants were decided by a memo",
            tally.memo_compared
        );
        assert!(tally.kinds(ReasonKind::Malformed) >= 4, "parser rejections");
        assert!(tally.kinds(ReasonKind::Pass) >= 8, "pass reasons");
    });
}

/// VXLAN over IPv6 whose inner frame lies beyond the outer packet (by its payload length, as
/// with link-layer padding after it) is not decapsulated, remembered flow or not: passed
/// unchanged, as flannel-v6 would drop it. (Found by the mutated-packets test.)
#[test]
fn ipv6_vxlan_payload_beyond_the_outer_packet_is_not_decapsulated() {
    let Some(rig) = Rig::new("f6pad") else { return };
    rig.with_fast_path(false, |fp, ifs| {
        let skb = Skb::on(ifs.ext);
        let inner = Ipv6 {
            hop_limit: 63,
            ..Ipv6::new(vxlan_pod(), pod(), Tcp::new(80, 40000))
        };
        let whole = vxlan6_frame("fd00:77::3", 1, LOCAL_VTEP6, &inner);
        let r = run(fp, Hook::FromNetdev, &whole, skb);
        assert_eq!(r.verdict, TC_ACT_REDIRECT, "the whole packet, remembered");
        // The outer payload: the UDP and VXLAN headers only.
        let mut cut = whole.clone();
        cut[18..20].copy_from_slice(&16u16.to_be_bytes());
        let r = run(fp, Hook::FromNetdev, &cut, skb);
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_bytes(&r.out, &cut, "passed unchanged");
        assert_counted(&r, &[Reason::Ipv6Udp, Reason::PassVxlanMismatch], "cut");
    });
}

/// `no_memo_outlives_a_change_of_what_it_rested_on` of `bpf_fastpath` for IPv6 (and a
/// dual-stack node's IPv4): 80 random changes of the IPv6 routes (removed, added, moved to
/// another peer or kind), the pod's port and the IPv6 configuration, or a kernel flow learnt;
/// after each, every path's packet run as it comes and again with every memo retired must be
/// decided alike.
#[test]
fn no_ipv6_memo_outlives_a_change_of_what_it_rested_on() {
    use rand::Rng;
    let Some(rig) = Rig::new("f6chg") else { return };
    rig.with_fast_path(true, |fp, ifs| {
        let seeds = seeds_of_every_ipv6_path(ifs);
        let peers: Vec<Remote6> = remotes6().into_values().collect();
        let kernel_sent = Ethernet::new(
            EXT_MAC,
            PEER2_MAC,
            Ipv6::new(pod(), hostgw_pod(), Tcp::new(40000, 80)),
        )
        .encode();
        let decided_by_memo = mutate::memos_follow_changes(
            fp,
            &seeds,
            (80, 0x0006_c4a9),
            Tunnel::Vxlan(8472),
            |fp| know_pod_port(fp, ifs),
            |fp, what, rng| match what {
                Change::Routes => {
                    let mut desired = BTreeMap::new();
                    for subnet in remotes6().into_keys() {
                        if rng.random_ratio(4, 5) {
                            desired.insert(subnet, peers[rng.random_range(0..peers.len())]);
                        }
                    }
                    fp.sync6(&desired).expect("sync6");
                }
                Change::Ports => {
                    fp.sync_ports(&BTreeMap::new()).expect("no pod ports");
                }
                Change::Config => {
                    let cfg = LocalConfig6 {
                        vxlan_rx: rng.random_bool(0.8),
                        routed_rx: rng.random_bool(0.8),
                        ..config6(ifs.ext)
                    };
                    fp.set_config6(Some(&cfg)).expect("config6");
                }
                Change::Learn => {
                    let _ = run(fp, Hook::ToNetdev, &kernel_sent, Skb::egress(ifs.ext));
                }
            },
        );
        assert!(
            decided_by_memo >= 20,
            "only {decided_by_memo} packets decided by a memo"
        );
    });
}

/// As for IPv4 (`bpf_fastpath::gso_udp_in_vxlan_is_left_to_the_kernel_even_into_a_known_pod`):
/// a GSO UDP packet in VXLAN over IPv6 is left to flannel-v6, its flow handed to the kernel,
/// though the pod's port is known and a memo of the flow exists.
#[test]
fn gso_udp_in_ipv6_vxlan_is_left_to_the_kernel() {
    let Some(rig) = Rig::new("f6gsou") else {
        return;
    };
    rig.with_fast_path(false, |fp, ifs| {
        know_pod_port(fp, ifs);
        let frame = |payload: &[u8]| {
            let inner = Ipv6 {
                hop_limit: 63,
                ..Ipv6::new(vxlan_pod(), pod(), Udp::new(443, 43001).payload(payload))
            };
            vxlan6_frame("fd00:77::3", 1, LOCAL_VTEP6, &inner)
        };
        let small = frame(b"initial");
        let r = run(fp, Hook::FromNetdev, &small, Skb::on(ifs.ext));
        assert_eq!(r.verdict, TC_ACT_REDIRECT, "small UDP into the pod");
        let big = frame(&[4; 1200]);
        let gso = Skb::on(ifs.ext).gso(600, 2);
        let r = run(fp, Hook::FromNetdev, &big, gso);
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_bytes(&r.out, &big, "GSO UDP left to flannel-v6");
        assert_counted(
            &r,
            &[Reason::Ipv6Udp, Reason::LearnKernelFlow, Reason::PassGso],
            "GSO UDP",
        );
    });
}
