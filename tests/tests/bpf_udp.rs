//! The udp backend on the fast path, program by program with `BPF_PROG_TEST_RUN`: the bytes
//! `tc_from_bridge` puts on the wire and `tc_from_netdev` delivers to a pod are compared with
//! what the TUN path's own functions (`flannel_agent::udp::forwarder::{egress_verdict,
//! ingress_verdict}` plus the kernel's TTL decrement between the pod bridge and `flannel0`)
//! make of the same packets; everything the fast path does not take is shown to reach the
//! forwarder's socket unchanged, with the reason counted.
//!
//! The node namespace: external veth `ext0` (192.168.77.1/24, the interface address the
//! forwarder binds to) while the lease's public IP is 198.51.100.1 (a NAT in front of the
//! node), a bridge `br0` (10.244.1.1/24) with a pod port, permanent neighbours for the peer at
//! .2 and none for the peer at .3, forwarding on.
//!
//! Needs root; skips otherwise, and when the agent was built without the eBPF object.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
};

use flannel_agent::{
    bpf::{FastPath, Hook, LocalConfig, Remote, UdpLocal, Via},
    udp::{
        UdpRoute, UdpRoutes,
        forwarder::{EgressVerdict, egress_verdict, ingress_verdict},
        packet as tun_packet,
    },
};
use flannel_common::{config::FASTPATH_MARK, stats::Reason};
use flannel_tests::packet::{
    self, Checksum, ETH_P_IP, Ethernet, Icmp, Ipv4, ParsedL3, Tcp, Transport, Udp, hexdump,
};
use ipnet::Ipv4Net;

mod bpf_support;

use bpf_support::{
    BR_MAC, EXT_MAC, Ifaces, Mac, POD_MAC, Rig, Skb, TC_ACT_OK, TC_ACT_REDIRECT, assert_bytes,
    assert_counted, mac_str, mutate, net, run,
};

const PORT: u16 = 8285;

const PEER2_MAC: Mac = [0x02, 0xee, 0, 0, 0, 0x02];

/// The interface address (where the forwarder's socket is bound).
const IFACE: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
/// The lease's public IP: a NAT address, not on any interface.
const PUBLIC: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const PEER2: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
/// A peer without a neighbour entry.
const PEER3: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 3);

const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 5);
const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);
const REMOTE2: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 7);
const REMOTE3: Ipv4Addr = Ipv4Addr::new(10, 244, 3, 7);

impl Rig {
    /// The node namespace with permanent neighbours for the peer at .2 (none for .3) and the
    /// local pod. `None` (test skipped) when not root or without the eBPF object.
    fn new(name: &str) -> Option<Rig> {
        let rig = Rig::node(name)?;
        rig.sh(&format!(
            "ip neigh replace {PEER2} lladdr {} dev ext0 nud permanent",
            mac_str(&PEER2_MAC)
        ));
        rig.sh(&format!(
            "ip neigh replace {POD} lladdr {} dev br0 nud permanent",
            mac_str(&POD_MAC)
        ));
        Some(rig)
    }

    /// Runs `f` in the namespace with a fast path loaded, configured for udp and synced.
    fn with_fast_path<R: Send>(&self, f: impl FnOnce(&mut FastPath, &Ifaces) -> R + Send) -> R {
        let pin = self.pin.clone();
        self.ns
            .enter(move || {
                let ifaces = Ifaces::current();
                let mut fp = FastPath::load(&pin).expect("loading the fast path");
                let config = LocalConfig {
                    source_ports: (32768, 60999),
                    outer_ttl: 64,
                    ..LocalConfig::new(
                        PUBLIC,
                        ifaces.ext,
                        net("10.244.1.0/24"),
                        net("10.244.0.0/16"),
                    )
                };
                fp.set_config(&config).expect("config");
                fp.set_udp(Some(&UdpLocal {
                    iface_addr: IFACE,
                    port: PORT,
                }))
                .expect("udp config");
                let stats = fp.sync(&remotes()).expect("sync");
                assert_eq!(stats.added, 2);
                assert_eq!(
                    fp.remotes().expect("remotes"),
                    remotes(),
                    "the route map reads back as written"
                );
                f(&mut fp, &ifaces)
            })
            .expect("entering the namespace")
    }
}

fn remotes() -> BTreeMap<Ipv4Net, Remote> {
    [
        (
            net("10.244.2.0/24"),
            Remote {
                public_ip: PEER2,
                via: Via::Udp,
            },
        ),
        (
            net("10.244.3.0/24"),
            Remote {
                public_ip: PEER3,
                via: Via::Udp,
            },
        ),
    ]
    .into()
}

/// The forwarder's routing table for the same peers.
fn tun_routes() -> UdpRoutes {
    UdpRoutes::new(remotes().into_iter().map(|(subnet, r)| UdpRoute {
        subnet,
        endpoint: SocketAddrV4::new(r.public_ip, PORT),
    }))
}

fn pod_frame(ip: &Ipv4) -> Vec<u8> {
    Ethernet::new(POD_MAC, BR_MAC, ip.clone()).encode()
}

/// What the TUN path sends for a pod packet `ip`: the kernel forwards it from the bridge into
/// `flannel0` (TTL − 1), the forwarder reads it and decides (`egress_verdict`: TTL − 1 and the
/// peer's endpoint). Returns the datagram's payload and destination.
fn tun_path_send(ip: &Ipv4) -> (Vec<u8>, SocketAddrV4) {
    tun_path_send_bytes(ip.encode())
}

/// [`tun_path_send`] for a packet as bytes (a fragment).
fn tun_path_send_bytes(mut pkt: Vec<u8>) -> (Vec<u8>, SocketAddrV4) {
    tun_packet::decrement_ttl(&mut pkt).expect("kernel forwarding");
    match egress_verdict(&mut pkt, &tun_routes()) {
        EgressVerdict::Send { to, len } => (pkt[..len].to_vec(), to),
        other => panic!("the TUN path would not send it: {other:?}"),
    }
}

/// What the forwarder's socket puts on the wire for `payload` to `to`, framed with the MACs
/// `(source, destination)`: IfaceAddr → peer, TOS 0, DF, ID 0, TTL 64, UDP port → port,
/// checksum 0.
fn forwarder_datagram(macs: (Mac, Mac), to: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
    Ethernet::new(
        macs.0,
        macs.1,
        Ipv4 {
            id: 0,
            tos: 0,
            dont_fragment: true,
            ttl: 64,
            ..Ipv4::new(
                IFACE,
                *to.ip(),
                Udp {
                    checksum: Checksum::Value(0),
                    ..Udp::new(PORT, to.port()).payload(payload)
                },
            )
        },
    )
    .encode()
}

/// What the TUN path delivers to the pod for a datagram payload: the forwarder checks it
/// (`ingress_verdict`: TTL − 1) and writes it to `flannel0`, the kernel forwards it to the
/// bridge (TTL − 1).
fn tun_path_receive(payload: &[u8]) -> Vec<u8> {
    let mut pkt = payload.to_vec();
    let len = ingress_verdict(&mut pkt, net("10.244.1.0/24"))
        .expect("the forwarder accepts it")
        .len;
    pkt.truncate(len);
    tun_packet::decrement_ttl(&mut pkt).expect("kernel forwarding");
    pkt
}

/// The datagram the TUN path (or an upstream udp node) at `from` sends us.
fn datagram(from: Ipv4Addr, payload: Vec<u8>) -> Vec<u8> {
    Ethernet::new(
        PEER2_MAC,
        EXT_MAC,
        Ipv4 {
            id: 0,
            ..Ipv4::new(
                from,
                IFACE,
                Udp {
                    checksum: Checksum::Value(0),
                    ..Udp::new(PORT, PORT).payload(&payload)
                },
            )
        },
    )
    .encode()
}

/// `ip` with its TTL lowered by `n`.
fn hops(ip: &Ipv4, n: u8) -> Ipv4 {
    Ipv4 {
        ttl: ip.ttl - n,
        ..ip.clone()
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn bridge_encapsulates_exactly_like_the_tun_path() {
    let Some(rig) = Rig::new("fuenc") else { return };
    rig.with_fast_path(|fp, ifs| {
        for l4 in [
            Transport::from(Tcp::new(40000, 80).payload(b"udp fast path")),
            Udp::new(1234, 5678).payload(&[9; 300]).into(),
            Icmp::echo_request(3, 9).into(),
        ] {
            let ip = Ipv4 {
                tos: 0x2b,
                ..Ipv4::new(POD, REMOTE2, l4)
            };
            let frame = pod_frame(&ip);
            let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
            assert_eq!(r.verdict, TC_ACT_REDIRECT, "{}", hexdump(&r.out));
            assert_eq!(r.mark_after, FASTPATH_MARK, "tagged for tc_to_netdev");
            // The TUN path's decision for the same packet gives the payload and the peer.
            let (payload, to) = tun_path_send(&ip);
            assert_eq!(to, SocketAddrV4::new(PEER2, PORT));
            assert_eq!(payload, hops(&ip, 2).encode(), "two hops off the inner TTL");
            let want = forwarder_datagram((EXT_MAC, PEER2_MAC), to, &payload);
            assert_bytes(&r.out, &want, "udp encapsulation");
            let parsed = packet::verify(&r.out).expect("outer checksums");
            let ParsedL3::Ipv4(outer) = &parsed.l3 else {
                panic!("outer not IPv4")
            };
            assert_eq!(
                (outer.src, outer.dst),
                (IFACE, PEER2),
                "IfaceAddr, not {PUBLIC}"
            );
            let class = match ip.payload {
                Transport::Tcp(_) => Reason::Ipv4Tcp,
                Transport::Udp(_) => Reason::Ipv4Udp,
                _ => Reason::Ipv4Icmp,
            };
            assert_counted(&r, &[class, Reason::FastUdp], "encapsulated");
        }

        // A GSO UDP packet (UDP_SEGMENT) is left to flannel0 whole, which segments it.
        let ip = Ipv4::new(POD, REMOTE2, Udp::new(1234, 5678).payload(&[9; 3000]));
        let frame = pod_frame(&ip);
        let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br).gso(1000, 3));
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_bytes(&r.out, &frame, "a GSO UDP packet");
        assert_counted(&r, &[Reason::Ipv4Udp, Reason::PassGso], "GSO UDP");

        // A peer whose underlay neighbour is unknown: bpf_redirect_neigh resolves it, the
        // outer Ethernet addresses are left as they were.
        let ip = Ipv4::new(POD, REMOTE3, Tcp::new(40001, 80));
        let r = run(fp, Hook::FromBridge, &pod_frame(&ip), Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_REDIRECT);
        let (payload, to) = tun_path_send(&ip);
        let want = forwarder_datagram((POD_MAC, BR_MAC), to, &payload);
        assert_bytes(&r.out, &want, "udp encapsulation, neighbour unresolved");

        // Our own packet on its way out: untouched and not counted by tc_to_netdev.
        let own = r.out.clone();
        let e = run(
            fp,
            Hook::ToNetdev,
            &own,
            Skb {
                mark: FASTPATH_MARK,
                ..Skb::egress(ifs.ext)
            },
        );
        assert_eq!(e.verdict, TC_ACT_OK);
        assert_bytes(&e.out, &own, "own datagram");
        assert!(e.counted.is_empty(), "{:?}", e.counted);
    });
}

/// The fragments of a pod's UDP datagram to a udp peer are sent like the rest of its flow, the
/// later ones (no ports) because their first was: each encapsulated exactly as the TUN path
/// would send that fragment. Before, they went to `flannel0` through netfilter, where the CNI
/// bridge's masquerade gave them the node's address. A later fragment whose first was not sent
/// is left to `flannel0`.
#[test]
fn bridge_sends_a_pods_fragments_like_the_rest_of_its_flow() {
    let Some(rig) = Rig::new("fufrag") else {
        return;
    };
    rig.with_fast_path(|fp, ifs| {
        let datagram = |id| Ipv4 {
            id,
            dont_fragment: false,
            ..Ipv4::new(POD, REMOTE2, Udp::new(5353, 6000).payload(&[7; 100]))
        };
        let fragments = datagram(0x1111).fragments(32);
        assert!(fragments.len() >= 3, "{} fragments", fragments.len());
        for (i, fragment) in fragments.iter().enumerate() {
            let what = format!("fragment {i}");
            let frame = Ethernet::carrying(POD_MAC, BR_MAC, ETH_P_IP, fragment).encode();
            let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
            assert_eq!(r.verdict, TC_ACT_REDIRECT, "{what}");
            let (payload, to) = tun_path_send_bytes(fragment.clone());
            let want = forwarder_datagram((EXT_MAC, PEER2_MAC), to, &payload);
            assert_bytes(&r.out, &want, &what);
            assert_counted(&r, &[Reason::Ipv4Fragment, Reason::FastUdp], &what);
        }
        let unseen = &datagram(0x2222).fragments(32)[1];
        let frame = Ethernet::carrying(POD_MAC, BR_MAC, ETH_P_IP, unseen).encode();
        let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
        assert_eq!(
            r.verdict, TC_ACT_OK,
            "a later fragment whose first was not seen"
        );
        assert_bytes(&r.out, &frame, "a later fragment whose first was not seen");
        assert_counted(
            &r,
            &[Reason::Ipv4Fragment, Reason::PassFragment],
            "a later fragment whose first was not seen",
        );
    });
}

#[test]
fn bridge_leaves_to_flannel0_what_the_fast_path_must_not_take() {
    let Some(rig) = Rig::new("fupass") else {
        return;
    };
    rig.with_fast_path(|fp, ifs| {
        let cases: Vec<(&str, Ipv4, Reason, Reason)> = vec![
            (
                "TTL 2 (expires in the TUN path)",
                Ipv4 {
                    ttl: 2,
                    ..Ipv4::new(POD, REMOTE2, Tcp::new(1, 2))
                },
                Reason::Ipv4Tcp,
                Reason::PassTtlExceeded,
            ),
            (
                "too big after 28 bytes of encapsulation",
                Ipv4::new(POD, REMOTE2, Udp::new(1, 2).payload(&[0; 1500 - 28 - 27])),
                Reason::Ipv4Udp,
                Reason::PassTooBig,
            ),
            (
                "ICMP error",
                Ipv4::new(
                    POD,
                    REMOTE2,
                    Icmp {
                        ty: 3,
                        code: 1,
                        ..Icmp::echo_request(0, 0)
                    },
                ),
                Reason::Ipv4Icmp,
                Reason::PassIcmpNotEcho,
            ),
            (
                "no lease covers the destination",
                Ipv4::new(POD, Ipv4Addr::new(10, 244, 9, 9), Tcp::new(1, 2)),
                Reason::Ipv4Tcp,
                Reason::PassNoRoute,
            ),
        ];
        for (name, ip, class, verdict) in cases {
            let frame = pod_frame(&ip);
            let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
            assert_eq!(r.verdict, TC_ACT_OK, "{name}");
            assert_bytes(&r.out, &frame, name);
            assert_counted(&r, &[class, verdict], name);
        }
        // The largest packet that fits: 1472 bytes (the pod MTU, ext MTU − 28).
        let ip = Ipv4::new(POD, REMOTE2, Udp::new(1, 2).payload(&[0; 1472 - 28]));
        let r = run(fp, Hook::FromBridge, &pod_frame(&ip), Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_REDIRECT);
        assert_eq!(r.out.len(), 14 + 1500);

        // Without the udp configuration the entries are not used.
        fp.set_udp(None).expect("disable udp");
        let frame = pod_frame(&Ipv4::new(POD, REMOTE2, Tcp::new(1, 2)));
        let r = run(fp, Hook::FromBridge, &frame, Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_bytes(&r.out, &frame, "udp disabled");
        assert_counted(&r, &[Reason::Ipv4Tcp, Reason::PassBadRoute], "udp disabled");
        assert_eq!(fp.udp_entry().expect("entry").flags, 0);
    });
}

/// The outer datagram (DF, as the forwarder's socket sends it) keeps to the path MTU to the
/// peer, not just the external interface's: with a route to the peer of locked MTU 1,400
/// (which the lookup reads as it reads the kernel's exception after a router's
/// "fragmentation needed"), a pod's packet whose datagram would be longer is left to
/// `flannel0`, whose socket fragments it; one that fits is sent; without the route the longer
/// one is sent again.
#[test]
fn bridge_keeps_to_the_path_mtu_to_the_peer() {
    let Some(rig) = Rig::new("fupmtu") else {
        return;
    };
    rig.sh(&format!(
        "ip route replace {PEER2}/32 dev ext0 mtu lock 1400"
    ));
    rig.with_fast_path(|fp, ifs| {
        // 1,373 and 1,372 bytes: 1,401 and 1,400 with the 28 of the udp backend.
        let packet =
            |len: usize| Ipv4::new(POD, REMOTE2, Udp::new(1, 2).payload(&vec![0; len - 28]));
        let (big, fits) = (pod_frame(&packet(1373)), pod_frame(&packet(1372)));
        let r = run(fp, Hook::FromBridge, &big, Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_OK, "too big for the path");
        assert_bytes(&r.out, &big, "too big for the path");
        assert_counted(
            &r,
            &[Reason::Ipv4Udp, Reason::PassFibFailed],
            "too big for the path",
        );
        let r = run(fp, Hook::FromBridge, &fits, Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_REDIRECT, "fits the path: {:?}", r.counted);
        assert_eq!(r.out.len(), fits.len() + 28);
        rig.sh(&format!("ip route del {PEER2}/32 dev ext0"));
        let r = run(fp, Hook::FromBridge, &big, Skb::on(ifs.br));
        assert_eq!(
            r.verdict, TC_ACT_REDIRECT,
            "without the route: {:?}",
            r.counted
        );
        assert_eq!(r.out.len(), big.len() + 28);
    });
}

#[test]
fn netdev_delivers_exactly_what_forwarder_and_kernel_would() {
    let Some(rig) = Rig::new("furx") else { return };
    rig.with_fast_path(|fp, ifs| {
        for (from, l4) in [
            (
                PEER2,
                Transport::from(Tcp::new(80, 40000).payload(b"reply")),
            ),
            // The outer source is not checked (NAT), as the TUN path does not check it.
            (
                Ipv4Addr::new(203, 0, 113, 9),
                Udp::new(53, 5353).payload(&[1; 200]).into(),
            ),
            (PEER2, Icmp::echo_reply(3, 9).into()),
        ] {
            // What a TUN-path (or upstream) peer puts in the datagram: two hops already taken.
            let inner = Ipv4 {
                ttl: 62,
                ..Ipv4::new(REMOTE2, POD, l4)
            };
            let frame = datagram(from, inner.encode());
            let r = run(fp, Hook::FromNetdev, &frame, Skb::on(ifs.ext));
            assert_eq!(r.verdict, TC_ACT_REDIRECT, "{}", hexdump(&r.out));
            let delivered = tun_path_receive(&inner.encode());
            assert_eq!(delivered, hops(&inner, 2).encode());
            let want = [&POD_MAC[..], &BR_MAC[..], &[0x08, 0x00][..], &delivered[..]].concat();
            assert_bytes(&r.out, &want, "delivered to the pod");
            packet::verify(&r.out).expect("checksums after the TTL decrement");
            assert_counted(&r, &[Reason::Ipv4Udp, Reason::FastDeliverUdp], "delivered");
        }
    });
}

#[test]
fn netdev_leaves_everything_else_to_the_forwarders_socket() {
    let Some(rig) = Rig::new("fusock") else {
        return;
    };
    rig.with_fast_path(|fp, ifs| {
        let inner = |dst: Ipv4Addr| Ipv4 {
            ttl: 62,
            ..Ipv4::new(REMOTE2, dst, Tcp::new(80, 40000))
        };
        let bad_checksum = Ipv4 {
            checksum: Checksum::Value(0x1234),
            ..inner(POD)
        };
        let mut trailing = inner(POD).encode();
        trailing.extend_from_slice(&[0; 4]);
        let upstream_pod = Ipv4Addr::new(10, 244, 251, 7);
        // (name, payload, verdict, whether the TUN path's forwarder accepts it). The first case also
        // teaches the NAT guard the remote endpoint (10.244.2.7:80/TCP): a remote pod talked
        // to a host address; the later cases use the same endpoint and learn nothing new.
        let cases: Vec<(&str, Vec<u8>, Reason, bool)> = vec![
            (
                "to the gateway (a host address)",
                inner(GATEWAY).encode(),
                Reason::PassNotForPod,
                true,
            ),
            (
                "to the tunnel address",
                inner(Ipv4Addr::new(10, 244, 1, 0)).encode(),
                Reason::PassNotForPod,
                true,
            ),
            (
                "for another node's subnet (the forwarder refuses to relay)",
                inner(REMOTE3).encode(),
                Reason::PassNotForPod,
                false,
            ),
            (
                "from a subnet no lease covers",
                Ipv4 {
                    src: upstream_pod,
                    ..inner(POD)
                }
                .encode(),
                Reason::PassForeignSource,
                true,
            ),
            (
                "TTL 2: expires on the way",
                Ipv4 {
                    ttl: 2,
                    ..inner(POD)
                }
                .encode(),
                Reason::PassTtlExceeded,
                true,
            ),
            (
                "bad inner header checksum",
                bad_checksum.encode(),
                Reason::PassUdpMismatch,
                false,
            ),
            (
                "bytes after the inner packet",
                trailing,
                Reason::PassUdpMismatch,
                true,
            ),
            (
                "not IPv4 inside",
                vec![0x60; 48],
                Reason::PassUdpMismatch,
                false,
            ),
            (
                "an inner fragment",
                Ipv4 {
                    more_fragments: true,
                    dont_fragment: false,
                    ..inner(POD)
                }
                .encode(),
                Reason::PassFragment,
                true,
            ),
        ];
        for (i, (name, payload, verdict, tun)) in cases.into_iter().enumerate() {
            let frame = datagram(PEER2, payload.clone());
            let r = run(fp, Hook::FromNetdev, &frame, Skb::on(ifs.ext));
            assert_eq!(r.verdict, TC_ACT_OK, "{name}");
            assert_bytes(&r.out, &frame, name);
            if i == 0 {
                assert_counted(&r, &[Reason::Ipv4Udp, verdict, Reason::LearnNatGuard], name);
            } else {
                assert_counted(&r, &[Reason::Ipv4Udp, verdict], name);
            }
            let mut copy = payload;
            assert_eq!(
                ingress_verdict(&mut copy, net("10.244.1.0/24")).is_ok(),
                tun,
                "{name}: what the socket's forwarder does"
            );
        }
        // Another port, or another address: not ours at all.
        for (name, frame) in [
            (
                "port 8286",
                Ethernet::new(
                    PEER2_MAC,
                    EXT_MAC,
                    Ipv4::new(
                        PEER2,
                        IFACE,
                        Udp::new(PORT, PORT + 1).payload(&inner(POD).encode()),
                    ),
                )
                .encode(),
            ),
            (
                "to the public (NAT) address",
                Ethernet::new(
                    PEER2_MAC,
                    EXT_MAC,
                    Ipv4::new(
                        PEER2,
                        PUBLIC,
                        Udp::new(PORT, PORT).payload(&inner(POD).encode()),
                    ),
                )
                .encode(),
            ),
        ] {
            let r = run(fp, Hook::FromNetdev, &frame, Skb::on(ifs.ext));
            assert_eq!(r.verdict, TC_ACT_OK, "{name}");
            assert_bytes(&r.out, &frame, name);
            assert_counted(&r, &[Reason::Ipv4Udp, Reason::PassNotForPod], name);
        }
    });
}

#[test]
fn forwarder_flows_keep_their_replies_on_the_tun_path() {
    let Some(rig) = Rig::new("fukf") else { return };
    rig.with_fast_path(|fp, ifs| {
        // A pod packet the kernel sent through flannel0 (e.g. DNATed from a ClusterIP), as the
        // forwarder's socket sends it.
        let inner = Ipv4 {
            ttl: 62,
            ..Ipv4::new(POD, REMOTE2, Tcp::new(41000, 80))
        };
        let out = Ethernet::new(
            EXT_MAC,
            PEER2_MAC,
            Ipv4 {
                id: 0,
                ..Ipv4::new(IFACE, PEER2, Udp::new(PORT, PORT).payload(&inner.encode()))
            },
        )
        .encode();
        let r = run(fp, Hook::ToNetdev, &out, Skb::egress(ifs.ext));
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_bytes(&r.out, &out, "the forwarder's datagram");
        assert_counted(
            &r,
            &[
                Reason::Ipv4Udp,
                Reason::PassNoRoute,
                Reason::LearnKernelFlow,
            ],
            "forwarder datagram",
        );
        // Its reply goes to the socket; another flow is delivered.
        let reply = datagram(
            PEER2,
            Ipv4 {
                ttl: 62,
                ..Ipv4::new(REMOTE2, POD, Tcp::new(80, 41000))
            }
            .encode(),
        );
        let r = run(fp, Hook::FromNetdev, &reply, Skb::on(ifs.ext));
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_bytes(&r.out, &reply, "reply of a kernel flow");
        assert_counted(&r, &[Reason::Ipv4Udp, Reason::PassKernelFlow], "reply");
        // ... and the local pod's next packets of that flow go through flannel0 too.
        let next = pod_frame(&Ipv4::new(POD, REMOTE2, Tcp::new(41000, 80)));
        let r = run(fp, Hook::FromBridge, &next, Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_counted(&r, &[Reason::Ipv4Tcp, Reason::PassKernelFlow], "same flow");
        let other = datagram(
            PEER2,
            Ipv4 {
                ttl: 62,
                ..Ipv4::new(REMOTE2, POD, Tcp::new(80, 41001))
            }
            .encode(),
        );
        let r = run(fp, Hook::FromNetdev, &other, Skb::on(ifs.ext));
        assert_eq!(r.verdict, TC_ACT_REDIRECT);

        // A remote pod that talked to a host address (the gateway) through the tunnel: the
        // local pod's packets to it go through the kernel (conntrack may have a DNAT).
        let to_gateway = datagram(
            PEER2,
            Ipv4 {
                ttl: 62,
                ..Ipv4::new(REMOTE2, GATEWAY, Udp::new(5000, 53))
            }
            .encode(),
        );
        let r = run(fp, Hook::FromNetdev, &to_gateway, Skb::on(ifs.ext));
        assert_counted(
            &r,
            &[
                Reason::Ipv4Udp,
                Reason::PassNotForPod,
                Reason::LearnNatGuard,
            ],
            "to the gateway",
        );
        let answer = pod_frame(&Ipv4::new(POD, REMOTE2, Udp::new(53, 5000)));
        let r = run(fp, Hook::FromBridge, &answer, Skb::on(ifs.br));
        assert_eq!(r.verdict, TC_ACT_OK);
        assert_counted(&r, &[Reason::Ipv4Udp, Reason::PassNatReply], "NAT reply");
    });
}

/// Variants of the udp backend's packets (a pod's packet to send, a peer's datagram to deliver,
/// the forwarder's own datagram on its way out) keep the programs' contract
/// (`bpf_support::mutate`): counted once under a class and once under a verdict, a pass
/// unchanged (to `flannel0` or the forwarder's socket, which then decide), a fast verdict
/// carrying the inner packet through with every checksum that verified still right.
#[test]
fn mutated_udp_backend_packets_keep_the_verdicts_and_counters_contract() {
    let Some(rig) = Rig::new("fumut") else { return };
    rig.with_fast_path(|fp, ifs| {
        let seed = mutate::Seed::tc;
        let from_pod = |name, dst, l4: Transport| {
            seed(
                name,
                Hook::FromBridge,
                Skb::on(ifs.br),
                pod_frame(&Ipv4::new(POD, dst, l4)),
            )
        };
        let arriving = |l4: Transport| Ipv4 {
            ttl: 62,
            ..Ipv4::new(REMOTE2, POD, l4)
        };
        let forwarded = Ethernet::new(
            EXT_MAC,
            PEER2_MAC,
            Ipv4::new(
                IFACE,
                PEER2,
                Udp {
                    checksum: Checksum::Value(0),
                    ..Udp::new(PORT, PORT)
                        .payload(&Ipv4::new(POD, REMOTE2, Tcp::new(40000, 80)).encode())
                },
            ),
        )
        .encode();
        let seeds = vec![
            from_pod("TCP", REMOTE2, Tcp::new(40000, 80).payload(b"to").into()),
            from_pod("UDP", REMOTE2, Udp::new(5353, 53).payload(b"q").into()),
            from_pod(
                "ICMP echo, no neighbour",
                REMOTE3,
                Icmp::echo_request(1, 1).into(),
            ),
            seed(
                "TCP arrival",
                Hook::FromNetdev,
                Skb::on(ifs.ext),
                datagram(
                    PEER2,
                    arriving(Tcp::new(80, 40000).payload(b"reply").into()).encode(),
                ),
            ),
            seed(
                "UDP arrival",
                Hook::FromNetdev,
                Skb::on(ifs.ext),
                datagram(
                    PEER2,
                    arriving(Udp::new(53, 5353).payload(&[1; 40]).into()).encode(),
                ),
            ),
            seed(
                "the forwarder's datagram",
                Hook::ToNetdev,
                Skb::egress(ifs.ext),
                forwarded,
            ),
        ];
        let tally = mutate::check(fp, &seeds, 3000, mutate::Tunnel::Udp(PORT));
        tally.assert_reached(
            &[
                Reason::FastUdp,
                Reason::FastDeliverUdp,
                Reason::PassUdpMismatch,
                Reason::LearnKernelFlow,
            ],
            100,
        );
    });
}
