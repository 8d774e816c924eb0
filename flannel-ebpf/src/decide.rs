//! The fast path's decisions as pure functions of the packet, the configuration and map
//! lookups (passed in as closures, so that lookups only happen when an earlier check passed,
//! and so that the host unit tests can feed them). The program modules (`bridge`, `netdev`)
//! carry the decisions out.

use flannel_common::{
    config::Config,
    flow::{FlowKey, PeerKey},
    route::{RemoteEntry, RouteKind},
    stats::Reason,
};

use crate::ipv4::Ipv4Info;

/// What `tc_from_bridge` does with a local pod's packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BridgeAction {
    /// Hand it to the kernel unchanged, counted under this reason.
    Pass(Reason),
    /// Route it with `bpf_fib_lookup` and redirect (host-gw, DirectRouting); the entry names
    /// the peer the lease set sends it to.
    HostGw(RemoteEntry),
    /// Encapsulate it in VXLAN for this peer.
    Vxlan(RemoteEntry),
    /// Encapsulate it in IPIP for this peer.
    Ipip(RemoteEntry),
    /// Encapsulate it as the udp backend does, for this peer.
    Udp(RemoteEntry),
}

/// The NAT-guard key for a packet *to* a remote endpoint (its destination side).
#[inline(always)]
pub fn peer_key_to(info: &Ipv4Info) -> PeerKey {
    PeerKey {
        addr: info.dst,
        port: info.dport,
        proto: info.proto,
        _pad: 0,
    }
}

/// The NAT-guard key for a packet *from* a remote endpoint (its source side).
#[inline(always)]
pub fn peer_key_from(info: &Ipv4Info) -> PeerKey {
    PeerKey {
        addr: info.src,
        port: info.sport,
        proto: info.proto,
        _pad: 0,
    }
}

/// The kernel-flow key of a packet leaving a local pod (source = local side).
#[inline(always)]
pub fn flow_key_outgoing(info: &Ipv4Info) -> FlowKey {
    FlowKey {
        local_addr: info.src,
        remote_addr: info.dst,
        local_port: info.sport,
        remote_port: info.dport,
        proto: info.proto,
        _pad: crate::zeroed(),
    }
}

/// The kernel-flow key of a packet arriving for a local pod (destination = local side).
#[inline(always)]
pub fn flow_key_incoming(info: &Ipv4Info) -> FlowKey {
    FlowKey {
        local_addr: info.dst,
        remote_addr: info.src,
        local_port: info.dport,
        remote_port: info.sport,
        proto: info.proto,
        _pad: crate::zeroed(),
    }
}

/// `tc_from_bridge`: a screened IPv4 TCP/UDP/ICMP packet from the pod bridge.
///
/// Checks, in order (the first that fails names the pass reason): ICMP is echo; the source is
/// a local pod; the destination is in the cluster network and in a remote subnet; TTL > 1; the
/// remote endpoint did not reach us through a host address (`nat_guard`); the flow is not one
/// the kernel tracks (`kernel_flow`); the entry's kind.
#[inline(always)]
pub fn from_bridge(
    cfg: &Config,
    info: &Ipv4Info,
    route: impl FnOnce([u8; 4]) -> Option<RemoteEntry>,
    nat_guard: impl FnOnce(&PeerKey) -> bool,
    kernel_flow: impl FnOnce(&FlowKey) -> bool,
) -> BridgeAction {
    if info.proto == crate::parse::proto::ICMP && !info.is_icmp_echo() {
        return BridgeAction::Pass(Reason::PassIcmpNotEcho);
    }
    if !cfg.is_local_pod(info.src) {
        return BridgeAction::Pass(Reason::PassForeignSource);
    }
    if !cfg.in_cluster(info.dst) {
        return BridgeAction::Pass(Reason::PassNoRoute);
    }
    let Some(entry) = route(info.dst) else {
        return BridgeAction::Pass(Reason::PassNoRoute);
    };
    if info.ttl <= 1 {
        return BridgeAction::Pass(Reason::PassTtlExceeded);
    }
    if info.has_ports() && nat_guard(&peer_key_to(info)) {
        return BridgeAction::Pass(Reason::PassNatReply);
    }
    if kernel_flow(&flow_key_outgoing(info)) {
        return BridgeAction::Pass(Reason::PassKernelFlow);
    }
    match RouteKind::from_u32(entry.kind) {
        Some(RouteKind::HostGw) => BridgeAction::HostGw(entry),
        Some(RouteKind::Vxlan) => BridgeAction::Vxlan(entry),
        Some(RouteKind::Ipip) => BridgeAction::Ipip(entry),
        // The TUN path takes two hops off the TTL; a packet that would expire on the way
        // goes there, so that the kernel answers it as it would without the fast path.
        Some(RouteKind::Udp) if info.ttl <= flannel_common::udp::UDP_TTL_DECREMENT => {
            BridgeAction::Pass(Reason::PassTtlExceeded)
        }
        Some(RouteKind::Udp) => BridgeAction::Udp(entry),
        None => BridgeAction::Pass(Reason::PassBadRoute),
    }
}

/// `tc_from_netdev`: whether a remote pod's packet (plain, or the inner packet of a tunnel) may
/// be delivered to the local pod directly, bypassing the stack. `Err` names the pass reason.
///
/// It may when: ICMP is echo; the destination is a local pod; the source lies in a remote
/// subnet of the map (so our replies take the fast path too); TTL > 1; and the flow's outgoing
/// packets did not go through the kernel (`kernel_flow`), so conntrack holds no state for it.
#[inline(always)]
pub fn deliverable(
    cfg: &Config,
    info: &Ipv4Info,
    route: impl FnOnce([u8; 4]) -> Option<RemoteEntry>,
    kernel_flow: impl FnOnce(&FlowKey) -> bool,
) -> Result<(), Reason> {
    if info.proto == crate::parse::proto::ICMP && !info.is_icmp_echo() {
        return Err(Reason::PassIcmpNotEcho);
    }
    if !cfg.is_local_pod(info.dst) {
        return Err(Reason::PassNotForPod);
    }
    if !cfg.in_cluster(info.src) || route(info.src).is_none() {
        return Err(Reason::PassForeignSource);
    }
    if info.ttl <= 1 {
        return Err(Reason::PassTtlExceeded);
    }
    if kernel_flow(&flow_key_incoming(info)) {
        return Err(Reason::PassKernelFlow);
    }
    Ok(())
}

/// `tc_from_netdev`: whether a packet (plain, or the inner packet of a tunnel) should be
/// recorded in the NAT guard: a TCP SYN (without ACK) or a UDP datagram from a remote pod
/// (cluster network, not our subnet) to an address of this node that is not a local pod (node
/// IP, gateway, tunnel address), where a hostPort/NodePort DNAT may forward it to a local pod.
///
/// Not any TCP packet: the replies to a local pod's connection that left through the kernel
/// and was masqueraded (the CNI bridge's `ipMasq`, on when flannel's `--ip-masq` is off) come
/// to a host address too, from the *server's* endpoint. Learnt, that endpoint would send every
/// other local pod's packets to it through the kernel, including those of connections that
/// began on the fast path: conntrack would pick such a connection up in the middle, the
/// masquerade rule would rewrite its source and the server would reset it (seen at pod
/// start-up, when a new pod's first connection took the kernel path). A connection a remote
/// pod opens to a hostPort or NodePort starts with a SYN.
/// `opens_a_flow` says whether the packet could open one ([`crate::ipv4::opens_a_flow`]),
/// asked last.
#[inline(always)]
pub fn nat_guard_candidate(
    cfg: &Config,
    info: &Ipv4Info,
    opens_a_flow: impl FnOnce() -> bool,
) -> bool {
    info.has_ports()
        && cfg.in_cluster(info.src)
        && !flannel_common::config::in_prefix(info.src, cfg.local_subnet, cfg.local_prefix_len)
        && !cfg.is_local_pod(info.dst)
        && opens_a_flow()
}

/// `tc_to_netdev`: whether a packet leaving through the kernel belongs to a local pod →
/// remote pod flow whose replies must then go through the stack (TCP, UDP or ICMP echo).
#[inline(always)]
pub fn kernel_flow_candidate(cfg: &Config, info: &Ipv4Info) -> bool {
    (info.has_ports() || info.is_icmp_echo())
        && cfg.is_local_pod(info.src)
        && cfg.in_cluster(info.dst)
        && !flannel_common::config::in_prefix(info.dst, cfg.local_subnet, cfg.local_prefix_len)
}

#[cfg(test)]
mod tests {
    use flannel_common::{config::CFG_ENABLED, route::RouteKind};

    use super::*;
    use crate::parse::proto;

    fn cfg() -> Config {
        Config {
            flags: CFG_ENABLED,
            local_subnet: [10, 244, 1, 0],
            local_prefix_len: 24,
            cluster_net: [10, 244, 0, 0],
            cluster_prefix_len: 16,
            ..Config::default()
        }
    }

    fn tcp(src: [u8; 4], dst: [u8; 4]) -> Ipv4Info {
        Ipv4Info {
            src,
            dst,
            proto: proto::TCP,
            ttl: 64,
            sport: [0x9c, 0x40],
            dport: [0, 80],
            ..Ipv4Info::default()
        }
    }

    fn entry(kind: RouteKind) -> RemoteEntry {
        RemoteEntry {
            kind: kind as u32,
            public_ip: [192, 168, 0, 2],
            ..RemoteEntry::default()
        }
    }

    const POD: [u8; 4] = [10, 244, 1, 5];
    const REMOTE: [u8; 4] = [10, 244, 2, 7];

    #[test]
    fn a_flows_memo_and_its_flow_table_keys_share_a_learn_slot() {
        use flannel_common::memo::{DIR_IN, DIR_OUT, LearnSlot};

        use crate::memo::learn_slot_of;
        // A local pod's packet to a remote pod, and the reply.
        let out = tcp(POD, REMOTE);
        let reply = Ipv4Info {
            src: out.dst,
            dst: out.src,
            sport: out.dport,
            dport: out.sport,
            ..out
        };
        let slot = learn_slot_of(&out, DIR_OUT);
        // What the learners retire when they add an entry the memo's decision rests on.
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
        for (kind, want) in [
            (
                RouteKind::HostGw,
                BridgeAction::HostGw(entry(RouteKind::HostGw)),
            ),
            (
                RouteKind::Vxlan,
                BridgeAction::Vxlan(entry(RouteKind::Vxlan)),
            ),
            (RouteKind::Ipip, BridgeAction::Ipip(entry(RouteKind::Ipip))),
            (RouteKind::Udp, BridgeAction::Udp(entry(RouteKind::Udp))),
        ] {
            let got = from_bridge(
                &cfg(),
                &info,
                |d| (d == REMOTE).then(|| entry(kind)),
                |_| false,
                |_| false,
            );
            assert_eq!(got, want);
        }
        let bad = RemoteEntry::default();
        assert_eq!(
            from_bridge(&cfg(), &info, |_| Some(bad), |_| false, |_| false),
            BridgeAction::Pass(Reason::PassBadRoute)
        );
    }

    #[test]
    fn bridge_passes_with_the_first_failing_reason() {
        let route = |_| Some(entry(RouteKind::Vxlan));
        let pass =
            |info: Ipv4Info, guard: bool| from_bridge(&cfg(), &info, route, |_| guard, |_| false);
        assert_eq!(
            pass(tcp([10, 244, 1, 1], REMOTE), false),
            BridgeAction::Pass(Reason::PassForeignSource)
        );
        assert_eq!(
            pass(tcp([10, 244, 3, 3], REMOTE), false),
            BridgeAction::Pass(Reason::PassForeignSource)
        );
        assert_eq!(
            pass(tcp(POD, [8, 8, 8, 8]), false),
            BridgeAction::Pass(Reason::PassNoRoute)
        );
        assert_eq!(
            from_bridge(&cfg(), &tcp(POD, REMOTE), |_| None, |_| false, |_| false),
            BridgeAction::Pass(Reason::PassNoRoute)
        );
        let mut low_ttl = tcp(POD, REMOTE);
        low_ttl.ttl = 1;
        assert_eq!(
            pass(low_ttl, false),
            BridgeAction::Pass(Reason::PassTtlExceeded)
        );
        assert_eq!(
            pass(tcp(POD, REMOTE), true),
            BridgeAction::Pass(Reason::PassNatReply)
        );
        let icmp_error = Ipv4Info {
            proto: proto::ICMP,
            icmp_type: 3,
            ..tcp(POD, REMOTE)
        };
        assert_eq!(
            pass(icmp_error, false),
            BridgeAction::Pass(Reason::PassIcmpNotEcho)
        );
    }

    #[test]
    fn udp_needs_a_ttl_that_survives_both_hops() {
        let route = |_| Some(entry(RouteKind::Udp));
        for (ttl, want) in [
            (1, BridgeAction::Pass(Reason::PassTtlExceeded)),
            (2, BridgeAction::Pass(Reason::PassTtlExceeded)),
            (3, BridgeAction::Udp(entry(RouteKind::Udp))),
        ] {
            let info = Ipv4Info {
                ttl,
                ..tcp(POD, REMOTE)
            };
            assert_eq!(
                from_bridge(&cfg(), &info, route, |_| false, |_| false),
                want,
                "ttl {ttl}"
            );
        }
    }

    #[test]
    fn nat_guard_is_consulted_with_the_destination_endpoint_only_for_ports() {
        let info = tcp(POD, REMOTE);
        let mut seen = None;
        let _ = from_bridge(
            &cfg(),
            &info,
            |_| Some(entry(RouteKind::Vxlan)),
            |k| {
                seen = Some(*k);
                false
            },
            |_| false,
        );
        assert_eq!(
            seen,
            Some(PeerKey {
                addr: REMOTE,
                port: [0, 80],
                proto: proto::TCP,
                _pad: 0
            })
        );
        let echo = Ipv4Info {
            proto: proto::ICMP,
            icmp_type: 8,
            ..tcp(POD, REMOTE)
        };
        let got = from_bridge(
            &cfg(),
            &echo,
            |_| Some(entry(RouteKind::Ipip)),
            |_| panic!("ICMP has no ports to guard"),
            |_| false,
        );
        assert_eq!(got, BridgeAction::Ipip(entry(RouteKind::Ipip)));
    }

    #[test]
    fn kernel_flows_stay_in_the_kernel_on_transmit() {
        let info = tcp(POD, REMOTE);
        let got = from_bridge(
            &cfg(),
            &info,
            |_| Some(entry(RouteKind::Vxlan)),
            |_| false,
            |k| {
                assert_eq!((k.local_addr, k.remote_addr), (POD, REMOTE));
                assert_eq!((k.local_port, k.remote_port), ([0x9c, 0x40], [0, 80]));
                true
            },
        );
        assert_eq!(got, BridgeAction::Pass(Reason::PassKernelFlow));
    }

    #[test]
    fn delivery_needs_a_known_remote_source_and_no_kernel_state() {
        let info = tcp(REMOTE, POD);
        let known = |s| (s == REMOTE).then(|| entry(RouteKind::HostGw));
        assert_eq!(deliverable(&cfg(), &info, known, |_| false), Ok(()));
        assert_eq!(
            deliverable(&cfg(), &info, known, |k| {
                assert_eq!(k.local_addr, POD);
                assert_eq!(k.remote_port, [0x9c, 0x40]);
                true
            }),
            Err(Reason::PassKernelFlow)
        );
        assert_eq!(
            deliverable(&cfg(), &info, |_| None, |_| false),
            Err(Reason::PassForeignSource)
        );
        assert_eq!(
            deliverable(&cfg(), &tcp(REMOTE, [10, 244, 1, 1]), known, |_| false),
            Err(Reason::PassNotForPod)
        );
        let mut dying = info;
        dying.ttl = 0;
        assert_eq!(
            deliverable(&cfg(), &dying, known, |_| false),
            Err(Reason::PassTtlExceeded)
        );
    }

    #[test]
    fn guard_and_flow_candidates() {
        // Remote pod → gateway / node IP: guarded. Remote pod → pod: not.
        let syn = || true;
        assert!(nat_guard_candidate(
            &cfg(),
            &tcp(REMOTE, [10, 244, 1, 1]),
            syn
        ));
        assert!(nat_guard_candidate(
            &cfg(),
            &tcp(REMOTE, [192, 168, 0, 1]),
            syn
        ));
        assert!(!nat_guard_candidate(&cfg(), &tcp(REMOTE, POD), syn));
        assert!(!nat_guard_candidate(
            &cfg(),
            &tcp([192, 168, 0, 9], [192, 168, 0, 1]),
            syn
        ));
        assert!(!nat_guard_candidate(
            &cfg(),
            &tcp(POD, [10, 244, 1, 1]),
            syn
        ));
        // Only what could open a connection.
        assert!(!nat_guard_candidate(
            &cfg(),
            &tcp(REMOTE, [192, 168, 0, 1]),
            || false
        ));
        // A SYN, any UDP datagram; not the SYN-ACK, ACK or RST of a connection a local pod
        // opened through the kernel and that was masqueraded.
        use crate::ipv4::{TCP_ACK, TCP_RST, TCP_SYN, opens_a_flow};
        for (flags, opens) in [
            (TCP_SYN, true),
            (TCP_SYN | 0x08 | 0x01, true),
            (TCP_SYN | TCP_ACK, false),
            (TCP_ACK, false),
            (TCP_ACK | 0x08, false),
            (TCP_RST, false),
            (TCP_SYN | TCP_RST, false),
            (0, false),
        ] {
            assert_eq!(opens_a_flow(proto::TCP, flags), opens, "flags {flags:#x}");
        }
        assert!(opens_a_flow(proto::UDP, 0));
        assert!(!opens_a_flow(proto::ICMP, 0));
        // Local pod → remote pod through the kernel: tracked.
        assert!(kernel_flow_candidate(&cfg(), &tcp(POD, REMOTE)));
        assert!(!kernel_flow_candidate(&cfg(), &tcp(POD, [10, 244, 1, 9])));
        assert!(!kernel_flow_candidate(
            &cfg(),
            &tcp([10, 244, 1, 0], REMOTE)
        ));
        assert!(!kernel_flow_candidate(&cfg(), &tcp(POD, [1, 1, 1, 1])));
    }
}
