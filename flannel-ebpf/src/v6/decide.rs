//! The IPv6 fast path's decisions as pure functions, the twins of [`crate::decide`] (same
//! checks, same order, same reasons), with map lookups passed in as closures.

use flannel_common::{
    route::{RemoteEntry6, RouteKind},
    stats::Reason,
    v6::{Config6, FlowKey6, PeerKey6},
};

use super::info::Ipv6Info;
use crate::parse::proto;

/// What `tc_from_bridge` does with a local pod's IPv6 packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BridgeAction6 {
    /// Hand it to the kernel unchanged, counted under this reason.
    Pass(Reason),
    /// Route it with `bpf_fib_lookup` and redirect (host-gw, DirectRouting).
    HostGw,
    /// Encapsulate it in VXLAN over IPv6 for this peer.
    Vxlan(RemoteEntry6),
}

/// The NAT-guard key for a packet *to* a remote endpoint.
#[inline(always)]
pub fn peer_key_to(info: &Ipv6Info) -> PeerKey6 {
    PeerKey6 {
        addr: info.dst,
        port: info.dport,
        proto: info.next_hdr,
        _pad: 0,
    }
}

/// The NAT-guard key for a packet *from* a remote endpoint.
#[inline(always)]
pub fn peer_key_from(info: &Ipv6Info) -> PeerKey6 {
    PeerKey6 {
        addr: info.src,
        port: info.sport,
        proto: info.next_hdr,
        _pad: 0,
    }
}

/// The kernel-flow key of a packet leaving a local pod.
#[inline(always)]
pub fn flow_key_outgoing(info: &Ipv6Info) -> FlowKey6 {
    FlowKey6 {
        local_addr: info.src,
        remote_addr: info.dst,
        local_port: info.sport,
        remote_port: info.dport,
        proto: info.next_hdr,
        _pad: crate::zeroed(),
    }
}

/// The kernel-flow key of a packet arriving for a local pod.
#[inline(always)]
pub fn flow_key_incoming(info: &Ipv6Info) -> FlowKey6 {
    FlowKey6 {
        local_addr: info.dst,
        remote_addr: info.src,
        local_port: info.dport,
        remote_port: info.sport,
        proto: info.next_hdr,
        _pad: crate::zeroed(),
    }
}

/// `tc_from_bridge`: a screened IPv6 TCP/UDP/ICMPv6 packet from the pod bridge. Checks, in
/// order: ICMPv6 is echo (neighbour discovery and errors stay with the kernel); the source is
/// a local pod; the destination is in `IPv6Network` and in a remote subnet; hop limit > 1;
/// no NAT-guard hit; not a kernel flow; the entry's kind.
#[inline(always)]
pub fn from_bridge(
    cfg: &Config6,
    info: &Ipv6Info,
    route: impl FnOnce(&[u8; 16]) -> Option<RemoteEntry6>,
    nat_guard: impl FnOnce(&PeerKey6) -> bool,
    kernel_flow: impl FnOnce(&FlowKey6) -> bool,
) -> BridgeAction6 {
    if info.next_hdr == proto::ICMPV6 && !info.is_icmp_echo() {
        return BridgeAction6::Pass(Reason::PassIcmpNotEcho);
    }
    if !cfg.is_local_pod(&info.src) {
        return BridgeAction6::Pass(Reason::PassForeignSource);
    }
    if !cfg.in_cluster(&info.dst) {
        return BridgeAction6::Pass(Reason::PassNoRoute);
    }
    let Some(entry) = route(&info.dst) else {
        return BridgeAction6::Pass(Reason::PassNoRoute);
    };
    if info.hop_limit <= 1 {
        return BridgeAction6::Pass(Reason::PassTtlExceeded);
    }
    if info.has_ports() && nat_guard(&peer_key_to(info)) {
        return BridgeAction6::Pass(Reason::PassNatReply);
    }
    if kernel_flow(&flow_key_outgoing(info)) {
        return BridgeAction6::Pass(Reason::PassKernelFlow);
    }
    match RouteKind::from_u32(entry.kind) {
        Some(RouteKind::HostGw) => BridgeAction6::HostGw,
        Some(RouteKind::Vxlan) => BridgeAction6::Vxlan(entry),
        _ => BridgeAction6::Pass(Reason::PassBadRoute),
    }
}

/// `tc_from_netdev`: whether a remote pod's IPv6 packet (plain, or inside VXLAN) may be
/// delivered to the local pod directly. `Err` names the pass reason.
#[inline(always)]
pub fn deliverable(
    cfg: &Config6,
    info: &Ipv6Info,
    route: impl FnOnce(&[u8; 16]) -> Option<RemoteEntry6>,
    kernel_flow: impl FnOnce(&FlowKey6) -> bool,
) -> Result<(), Reason> {
    if info.next_hdr == proto::ICMPV6 && !info.is_icmp_echo() {
        return Err(Reason::PassIcmpNotEcho);
    }
    if !cfg.is_local_pod(&info.dst) {
        return Err(Reason::PassNotForPod);
    }
    if !cfg.in_cluster(&info.src) || route(&info.src).is_none() {
        return Err(Reason::PassForeignSource);
    }
    if info.hop_limit <= 1 {
        return Err(Reason::PassTtlExceeded);
    }
    if kernel_flow(&flow_key_incoming(info)) {
        return Err(Reason::PassKernelFlow);
    }
    Ok(())
}

/// Whether a received packet goes in the NAT guard: a TCP SYN or a UDP datagram from a remote
/// pod to an address of this node that is not a local pod (as IPv4's,
/// [`crate::decide::nat_guard_candidate`]).
#[inline(always)]
pub fn nat_guard_candidate(cfg: &Config6, info: &Ipv6Info) -> bool {
    info.opens_a_flow()
        && cfg.in_cluster(&info.src)
        && !cfg.in_local_subnet(&info.src)
        && !cfg.is_local_pod(&info.dst)
}

/// Whether a packet leaving through the kernel belongs to a local pod → remote pod flow.
#[inline(always)]
pub fn kernel_flow_candidate(cfg: &Config6, info: &Ipv6Info) -> bool {
    (info.has_ports() || info.is_icmp_echo())
        && cfg.is_local_pod(&info.src)
        && cfg.in_cluster(&info.dst)
        && !cfg.in_local_subnet(&info.dst)
}

#[cfg(test)]
mod tests {
    use flannel_common::v6::CFG6_ENABLED;

    use super::*;

    fn addr(s: &str) -> [u8; 16] {
        s.parse::<std::net::Ipv6Addr>()
            .unwrap_or_else(|e| panic!("{s}: {e}"))
            .octets()
    }

    fn cfg() -> Config6 {
        Config6 {
            flags: CFG6_ENABLED,
            local_subnet: addr("fd00:10:244:1::"),
            local_prefix_len: 64,
            cluster_net: addr("fd00:10:244::"),
            cluster_prefix_len: 48,
            ..Config6::default()
        }
    }

    fn tcp(src: &str, dst: &str) -> Ipv6Info {
        Ipv6Info {
            src: addr(src),
            dst: addr(dst),
            next_hdr: proto::TCP,
            hop_limit: 64,
            sport: [0x9c, 0x40],
            dport: [0, 80],
            tcp_flags: crate::ipv4::TCP_SYN,
            ..Ipv6Info::default()
        }
    }

    fn entry(kind: RouteKind) -> RemoteEntry6 {
        RemoteEntry6 {
            kind: kind as u32,
            public_ip: addr("fd00:77::2"),
            ..RemoteEntry6::default()
        }
    }

    const POD: &str = "fd00:10:244:1::5";
    const REMOTE: &str = "fd00:10:244:2::7";

    #[test]
    fn a_flows_memo_and_its_flow_table_keys_share_a_learn_slot() {
        use flannel_common::memo::{DIR_IN, DIR_OUT, LearnSlot};

        use crate::v6::memo::learn_slot_of;
        let out = tcp("fd00:10:244:1::5", "fd00:10:244:2::7");
        let reply = Ipv6Info {
            src: out.dst,
            dst: out.src,
            sport: out.dport,
            dport: out.sport,
            ..out
        };
        let slot = learn_slot_of(&out, DIR_OUT);
        assert_eq!(
            flow_key_outgoing(&out).learn_slot(),
            slot,
            "kernel flow, sent"
        );
        assert_eq!(peer_key_to(&out).learn_slot(), slot, "NAT guard, sent");
        assert_eq!(learn_slot_of(&reply, DIR_IN), slot, "the reply's memo");
        assert_eq!(
            flow_key_incoming(&reply).learn_slot(),
            slot,
            "kernel flow, received"
        );
        assert_eq!(
            peer_key_from(&reply).learn_slot(),
            slot,
            "NAT guard, received"
        );
    }

    #[test]
    fn bridge_forwards_by_kind() {
        let info = tcp(POD, REMOTE);
        let run = |kind| from_bridge(&cfg(), &info, |_| Some(entry(kind)), |_| false, |_| false);
        assert_eq!(run(RouteKind::HostGw), BridgeAction6::HostGw);
        assert_eq!(
            run(RouteKind::Vxlan),
            BridgeAction6::Vxlan(entry(RouteKind::Vxlan))
        );
        // IPv4-only kinds have no meaning here.
        assert_eq!(
            run(RouteKind::Ipip),
            BridgeAction6::Pass(Reason::PassBadRoute)
        );
        assert_eq!(
            run(RouteKind::Udp),
            BridgeAction6::Pass(Reason::PassBadRoute)
        );
    }

    #[test]
    fn bridge_passes_with_the_first_failing_reason() {
        let route = |_: &[u8; 16]| Some(entry(RouteKind::Vxlan));
        let pass = |info: Ipv6Info| from_bridge(&cfg(), &info, route, |_| false, |_| false);
        let nd = Ipv6Info {
            next_hdr: proto::ICMPV6,
            icmp_type: 135,
            ..tcp(POD, REMOTE)
        };
        assert_eq!(pass(nd), BridgeAction6::Pass(Reason::PassIcmpNotEcho));
        assert_eq!(
            pass(tcp("fd00:10:244:1::1", REMOTE)),
            BridgeAction6::Pass(Reason::PassForeignSource)
        );
        assert_eq!(
            pass(tcp("fe80::5", REMOTE)),
            BridgeAction6::Pass(Reason::PassForeignSource)
        );
        assert_eq!(
            pass(tcp(POD, "2001:db8::1")),
            BridgeAction6::Pass(Reason::PassNoRoute)
        );
        let dying = Ipv6Info {
            hop_limit: 1,
            ..tcp(POD, REMOTE)
        };
        assert_eq!(pass(dying), BridgeAction6::Pass(Reason::PassTtlExceeded));
        assert_eq!(
            from_bridge(&cfg(), &tcp(POD, REMOTE), |_| None, |_| false, |_| false),
            BridgeAction6::Pass(Reason::PassNoRoute)
        );
        assert_eq!(
            from_bridge(
                &cfg(),
                &tcp(POD, REMOTE),
                route,
                |k| {
                    assert_eq!((k.addr, k.port), (addr(REMOTE), [0, 80]));
                    true
                },
                |_| false
            ),
            BridgeAction6::Pass(Reason::PassNatReply)
        );
        assert_eq!(
            from_bridge(
                &cfg(),
                &tcp(POD, REMOTE),
                route,
                |_| false,
                |k| {
                    assert_eq!((k.local_addr, k.remote_addr), (addr(POD), addr(REMOTE)));
                    true
                }
            ),
            BridgeAction6::Pass(Reason::PassKernelFlow)
        );
        let echo = Ipv6Info {
            next_hdr: proto::ICMPV6,
            icmp_type: 128,
            ..tcp(POD, REMOTE)
        };
        assert_eq!(
            from_bridge(&cfg(), &echo, route, |_| panic!("no ports"), |_| false),
            BridgeAction6::Vxlan(entry(RouteKind::Vxlan))
        );
    }

    #[test]
    fn delivery_and_flow_candidates() {
        let info = tcp(REMOTE, POD);
        let known = |s: &[u8; 16]| (*s == addr(REMOTE)).then(|| entry(RouteKind::HostGw));
        assert_eq!(deliverable(&cfg(), &info, known, |_| false), Ok(()));
        assert_eq!(
            deliverable(&cfg(), &info, known, |k| {
                assert_eq!(k.local_addr, addr(POD));
                true
            }),
            Err(Reason::PassKernelFlow)
        );
        assert_eq!(
            deliverable(&cfg(), &info, |_| None, |_| false),
            Err(Reason::PassForeignSource)
        );
        assert_eq!(
            deliverable(&cfg(), &tcp(REMOTE, "fd00:10:244:1::1"), known, |_| false),
            Err(Reason::PassNotForPod)
        );
        assert!(nat_guard_candidate(
            &cfg(),
            &tcp(REMOTE, "fd00:10:244:1::1")
        ));
        assert!(!nat_guard_candidate(&cfg(), &tcp(REMOTE, POD)));
        let mut syn_ack = tcp(REMOTE, "fd00:10:244:1::1");
        syn_ack.tcp_flags |= crate::ipv4::TCP_ACK;
        assert!(!nat_guard_candidate(&cfg(), &syn_ack));
        assert!(kernel_flow_candidate(&cfg(), &tcp(POD, REMOTE)));
        assert!(!kernel_flow_candidate(
            &cfg(),
            &tcp(POD, "fd00:10:244:1::9")
        ));
    }
}
