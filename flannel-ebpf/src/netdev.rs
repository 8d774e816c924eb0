//! The programs on the external (underlay) interface.
//!
//! `tc_from_netdev` (TC ingress), for packets addressed to this node or its pods:
//! - IPIP (protocol 4) to our public IP from a node in `FLANNEL_NODES4` with `NODE_F_IPIP`:
//!   decapsulated (no kernel IPIP device exists to do it), then delivered to the pod or
//!   handed to the stack;
//! - VXLAN to our public IP and port, with our VNI and VTEP MAC, from a VXLAN peer: a
//!   pod-to-pod packet is decapsulated and delivered to the pod; anything else is left to
//!   `flannel.<VNI>` untouched;
//! - a plain (host-gw) packet from a remote pod to a local pod: delivered to the pod;
//! - a udp-backend datagram to our interface address and port: see [`crate::udp`];
//! - an ICMP "fragmentation needed" about an IPIP packet we sent: see [`crate::pmtu`] (run
//!   before the rest, as the masquerade's reverse NAT is);
//! - and on the way it records remote pods that address a host address in the NAT guard.
//!
//! IPv6 frames go to [`crate::v6`] instead (the entry points choose).
//!
//! See [`crate::deliver`] for why delivery bypasses the stack and when it must not, and
//! [`crate::pods`] for delivery into the pod's namespace (or through the bridge).
//!
//! Both also run the masquerade ([`crate::nat`]) when it is on: `tc_from_netdev` translates
//! replies for the masquerade address back (before anything else, tunnels excepted),
//! `tc_to_netdev` source-NATs pod traffic to the outside and registers the node's own flows.
//!
//! `tc_to_netdev` (TC egress), for packets the kernel sends out:
//! - the fast path's own packets ([`own_packet`]) go out untouched, mark or tag cleared;
//! - a local pod → remote pod packet (plain, or inside `flannel.<VNI>`'s VXLAN) is recorded in
//!   `FLANNEL_KFLOWS4`, since conntrack saw it;
//! - a packet routed to a remote subnet of kind IPIP (host-originated traffic, or a pod's
//!   packet `tc_from_bridge` passed) is encapsulated: the kernel routes such subnets through the
//!   external interface (`<subnet> via <next hop to the peer> dev <ext> onlink`), and this is the
//!   only IPIP implementation on kernels without the `ipip` module.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use flannel_common::{
    config::{
        CFG_IPIP_USER_RX, CFG_ROUTED_RX, CFG_VXLAN_RX, Config, FASTPATH_MARK, FASTPATH_TC_INDEX,
    },
    memo::{DIR_IN, TUNNEL_IPIP, TUNNEL_VXLAN},
    route::{NODE_F_IPIP, NODE_F_VXLAN, RemoteEntry, RouteKind},
    stats::Reason,
};

use crate::{
    bridge::Outcome,
    decide, deliver,
    encap::{
        self, IPIP_INNER_L3, IPIP_OVERHEAD, IPPROTO_IPIP, VXLAN_HDR_AT, VXLAN_INNER_L3,
        VXLAN_OVERHEAD,
    },
    fib::{self, Fib},
    ipv4::{self, Ipv4Info},
    maps, memo, nat,
    parse::{self, ETH_HDR_LEN, ETH_P_IP, Packet, PacketCtx as _, proto},
    pods,
};

/// A TC action and the verdict reason to count.
struct Verdict {
    action: i32,
    reason: Reason,
}

impl Verdict {
    #[inline(always)]
    fn pass(reason: Reason) -> Self {
        Verdict {
            action: TC_ACT_OK,
            reason,
        }
    }
}

impl From<Reason> for Verdict {
    #[inline(always)]
    fn from(reason: Reason) -> Self {
        if reason == Reason::DropRewriteFailed {
            Verdict {
                action: TC_ACT_SHOT,
                reason,
            }
        } else {
            Verdict::pass(reason)
        }
    }
}

/// Side effects of a `tc_from_netdev` run, counted in addition to the verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Learnt {
    /// The NAT guard learnt a remote endpoint.
    pub nat_guard: bool,
    /// A flow was handed to the kernel.
    pub kernel_flow: bool,
}

/// The body of `tc_from_netdev` for everything but IPv6 frames (see [`crate::v6`]); a BPF
/// subprogram of its own (its stack does not add to the IPv6 side's).
#[inline(never)]
pub fn from_netdev(ctx: &TcContext) -> (Outcome, Learnt) {
    let parsed = parse::parse(ctx);
    let class = match &parsed {
        Ok(p) => p.class,
        Err(reason) => *reason,
    };
    let outcome = |v: Verdict| Outcome {
        action: v.action,
        class,
        verdict: v.reason,
    };
    let Some(cfg) = maps::config() else {
        return (
            outcome(Verdict::pass(Reason::PassNotConfigured)),
            Learnt::default(),
        );
    };
    let outer: Packet = match &parsed {
        Ok(p) if p.ethertype == ETH_P_IP => *p,
        Ok(_) => {
            return (
                outcome(Verdict::pass(Reason::PassNotIpv4)),
                Learnt::default(),
            );
        }
        Err(_) => {
            return (
                outcome(Verdict::pass(Reason::PassMalformed)),
                Learnt::default(),
            );
        }
    };
    let mut learnt = Learnt::default();
    let verdict = if outer.class == Reason::Ipv4Fragment {
        Verdict::pass(Reason::PassFragment)
    } else if outer.class == Reason::Ipv4Options {
        Verdict::pass(Reason::PassIpOptions)
    } else {
        match ipv4::read(ctx, &outer) {
            None => Verdict::pass(Reason::PassMalformed),
            Some(info) if info.dst == cfg.public_ip && info.proto == IPPROTO_IPIP => ipip_in(
                ctx,
                cfg,
                &info,
                &mut learnt.nat_guard,
                &mut learnt.kernel_flow,
            ),
            Some(info)
                if info.dst == cfg.public_ip
                    && info.proto == proto::UDP
                    && u16::from_be_bytes(info.dport) == cfg.vxlan_port =>
            {
                vxlan_in(
                    ctx,
                    cfg,
                    &info,
                    &mut learnt.nat_guard,
                    &mut learnt.kernel_flow,
                )
            }
            Some(info) if crate::udp::is_for_us(&info) => {
                let r = crate::udp::receive(ctx, cfg, &info, &mut learnt.nat_guard);
                Verdict {
                    action: r.action,
                    reason: r.reason,
                }
            }
            Some(info) => plain_in(ctx, cfg, &outer, &info, &mut learnt.nat_guard),
        }
    };
    (outcome(verdict), learnt)
}

/// A packet that is not a tunnel packet for us: maybe a host-gw packet for a local pod.
#[inline(always)]
fn plain_in(
    ctx: &TcContext,
    cfg: &Config,
    packet: &Packet,
    info: &Ipv4Info,
    learnt: &mut bool,
) -> Verdict {
    if let Err(reason) = ipv4::screen(&Ok(*packet)) {
        return Verdict::pass(reason);
    }
    // Read before the checks: a change while they run retires what they decide.
    let generation = memo::current_for(info, DIR_IN);
    *learnt = deliver::learn_nat_guard(ctx, cfg, info);
    if let Err(reason) = decide::deliverable(
        cfg,
        info,
        |src| maps::route(src).copied(),
        deliver::is_kernel_flow,
    ) {
        return Verdict::pass(reason);
    }
    if cfg.flags & CFG_ROUTED_RX == 0 {
        return Verdict::pass(Reason::PassRoutedRxOff);
    }
    let mut mtu = 0;
    let route = deliver::route_to_pod(ctx, info, &mut mtu);
    if route == Fib::Failed {
        return Verdict::pass(Reason::PassFibFailed);
    }
    remember_delivery(info, route, mtu, generation, None);
    match deliver::deliver(ctx, info, route) {
        Ok(action) => Verdict {
            action,
            reason: Reason::FastDeliver,
        },
        Err(reason) => reason.into(),
    }
}

/// Remembers a delivery into a local pod's namespace (only those: the pod's port is known)
/// decided at `generation`, of a packet that came plain or (`tunnel`) through a tunnel from
/// that peer.
#[inline(always)]
fn remember_delivery(
    info: &Ipv4Info,
    route: Fib,
    mtu: u16,
    generation: u64,
    tunnel: Option<(u8, [u8; 4])>,
) {
    if let Fib::Resolved {
        ifindex,
        smac,
        dmac,
    } = route
        && let Some(port) = pods::port(ifindex, dmac)
    {
        let memo = memo::memo(port, smac, dmac, mtu, generation);
        let memo = match tunnel {
            Some((tunnel, peer)) => memo::from_peer(memo, tunnel, peer),
            None => memo,
        };
        memo::remember(info, DIR_IN, memo);
    }
}

/// IPIP for our public IP.
#[inline(always)]
fn ipip_in(
    ctx: &TcContext,
    cfg: &Config,
    outer: &Ipv4Info,
    learnt: &mut bool,
    kernel_flow: &mut bool,
) -> Verdict {
    // Read before the checks: a change while they run retires what they decide.
    let agent = memo::agent_generation();
    if maps::node_flags(outer.src) & NODE_F_IPIP == 0 {
        return Verdict::pass(Reason::PassUnknownPeer);
    }
    if deliver::ipip_is_the_kernels(ctx, cfg) {
        if let Ok(inner) = ipv4::screen(&parse::parse_ipv4_at(ctx, IPIP_INNER_L3, outer.end()))
            && let Some(inner) = ipv4::read(ctx, &inner)
        {
            *learnt = deliver::learn_nat_guard(ctx, cfg, &inner);
            if cfg.is_local_pod(inner.dst) {
                *kernel_flow = deliver::hand_to_kernel(&inner);
            }
        }
        return Verdict::pass(Reason::PassGso);
    }
    let inner = parse::parse_ipv4_at(ctx, IPIP_INNER_L3, outer.end());
    let inner_packet = match ipv4::screen(&inner) {
        Ok(p) => Some(p),
        // For the agent's IPIP socket, whole: the rest of its datagram may come that way
        // ([`CFG_IPIP_USER_RX`]).
        Err(Reason::PassFragment) if cfg.flags & CFG_IPIP_USER_RX != 0 => {
            return Verdict::pass(Reason::PassFragment);
        }
        // Otherwise fragments, options and other protocols are still ours to decapsulate: no
        // one else will. The stack gets them.
        Err(Reason::PassFragment | Reason::PassIpOptions | Reason::PassOtherProto) => None,
        Err(reason) => return Verdict::pass(reason),
    };
    let info = match inner_packet {
        Some(p) => match ipv4::read(ctx, &p) {
            Some(info) => Some(info),
            None => return Verdict::pass(Reason::PassMalformed),
        },
        None => None,
    };
    // Read before the NAT-guard and kernel-flow checks (the agent's part above).
    let generation = info
        .as_ref()
        .map_or(0, |info| memo::generation_for(info, DIR_IN, agent));
    let mut mtu = 0;
    let route = match &info {
        Some(info) => {
            *learnt = deliver::learn_nat_guard(ctx, cfg, info);
            let deliverable = decide::deliverable(
                cfg,
                info,
                |src| maps::route(src).copied(),
                deliver::is_kernel_flow,
            )
            .is_ok()
                && cfg.flags & CFG_ROUTED_RX != 0;
            if deliverable {
                deliver::route_to_pod(ctx, info, &mut mtu)
            } else {
                Fib::Failed
            }
        }
        None => Fib::Failed,
    };
    if let Err(reason) = deliver::decap(ctx, IPIP_OVERHEAD) {
        return Verdict::pass(reason);
    }
    match (info, route) {
        (Some(info), Fib::Resolved { .. } | Fib::NoNeigh { .. }) => {
            remember_delivery(
                &info,
                route,
                mtu,
                generation,
                Some((TUNNEL_IPIP, outer.src)),
            );
            match deliver::deliver(ctx, &info, route) {
                Ok(action) => Verdict {
                    action,
                    reason: Reason::FastDeliverIpip,
                },
                Err(reason) => reason.into(),
            }
        }
        _ => Verdict::pass(Reason::FastDecapIpip),
    }
}

/// VXLAN for our public IP and port.
#[inline(always)]
fn vxlan_in(
    ctx: &TcContext,
    cfg: &Config,
    outer: &Ipv4Info,
    learnt: &mut bool,
    kernel_flow: &mut bool,
) -> Verdict {
    // Read before the checks: a change while they run retires what they decide.
    let agent = memo::agent_generation();
    let Some(end) = encap::vxlan_inner_end(ctx, cfg, outer) else {
        return Verdict::pass(Reason::PassVxlanMismatch);
    };
    let inner = parse::parse_ipv4_at(ctx, VXLAN_INNER_L3, end);
    let packet = match ipv4::screen(&inner) {
        Ok(p) => p,
        Err(reason) => return Verdict::pass(reason),
    };
    let Some(info) = ipv4::read(ctx, &packet) else {
        return Verdict::pass(Reason::PassMalformed);
    };
    // Read before the NAT-guard and kernel-flow checks (the agent's part above).
    let generation = memo::generation_for(&info, DIR_IN, agent);
    *learnt = deliver::learn_nat_guard(ctx, cfg, &info);
    if cfg.flags & CFG_VXLAN_RX == 0 {
        return Verdict::pass(Reason::PassVxlanRxOff);
    }
    if maps::node_flags(outer.src) & NODE_F_VXLAN == 0 {
        return Verdict::pass(Reason::PassUnknownPeer);
    }
    if let Err(reason) = decide::deliverable(
        cfg,
        &info,
        |src| maps::route(src).copied(),
        deliver::is_kernel_flow,
    ) {
        return Verdict::pass(reason);
    }
    let mut mtu = 0;
    let route = deliver::route_to_pod(ctx, &info, &mut mtu);
    if deliver::vxlan_is_the_kernels(ctx, info.proto, route.reaches_pod_port()) {
        // Left to the kernel's VXLAN receive; the flow moves to the kernel in both directions.
        *kernel_flow = deliver::hand_to_kernel(&info);
        return Verdict::pass(Reason::PassGso);
    }
    if route == Fib::Failed {
        return Verdict::pass(Reason::PassFibFailed);
    }
    if let Err(reason) = deliver::decap(ctx, VXLAN_OVERHEAD) {
        return Verdict::pass(reason);
    }
    remember_delivery(
        &info,
        route,
        mtu,
        generation,
        Some((TUNNEL_VXLAN, outer.src)),
    );
    match deliver::deliver(ctx, &info, route) {
        Ok(action) => Verdict {
            action,
            reason: Reason::FastDeliverVxlan,
        },
        Err(reason) => reason.into(),
    }
}

/// Whether the packet leaving by the external interface is the fast path's own, for
/// `tc_to_netdev` to let through uncounted (either family): marked [`FASTPATH_MARK`] by a
/// program that redirected it here, or tagged [`FASTPATH_TC_INDEX`] when a program handed it
/// to a tunnel device (`bridge::vxlan_device`, `v6::vxlan_device`) whose outer packet this
/// is. The mark or tag is cleared.
#[inline(always)]
pub fn own_packet(ctx: &TcContext) -> bool {
    // SAFETY: reading a field of the __sk_buff the kernel passed.
    if unsafe { (*ctx.skb.skb).mark } == FASTPATH_MARK {
        ctx.set_mark(0);
        return true;
    }
    // SAFETY: reading and writing a field of the __sk_buff the kernel passed.
    unsafe {
        if (*ctx.skb.skb).tc_index == FASTPATH_TC_INDEX {
            (*ctx.skb.skb).tc_index = 0;
            return true;
        }
    }
    false
}

/// The start of `tc_to_netdev` for everything but IPv6 frames that are not the fast path's
/// own ([`own_packet`]): the headers pulled in for [`nat_egress`] and [`to_netdev`].
#[inline(always)]
pub fn prepare_out(ctx: &TcContext) {
    ctx.pull_headers(parse::PULL_LEN);
}

/// Masquerade ([`nat::egress`]), run after [`prepare_out`] and before [`to_netdev`] as a BPF
/// subprogram of its own called from the program itself, so that its stack (the port
/// allocator's keys and entries) does not add to [`to_netdev`]'s; `None` when the packet is
/// none of the NAT's business. The second value holds the events to count (a NAT mapping
/// made or moved).
#[inline(never)]
pub fn nat_egress(ctx: &TcContext) -> Option<(Outcome, [Option<Reason>; 2])> {
    let cfg = maps::config()?;
    let nat = nat::egress(ctx, cfg)?;
    Some((
        Outcome {
            action: nat.outcome.action,
            class: nat.class,
            verdict: nat.outcome.verdict,
        },
        nat.outcome.events,
    ))
}

/// The reverse NAT of `tc_from_netdev` ([`nat::ingress`]), run before [`from_netdev`] as a
/// BPF subprogram of its own called from the program itself (see [`nat_egress`]); `None` when
/// the packet is none of the NAT's business.
#[inline(never)]
pub fn nat_ingress(ctx: &TcContext) -> Option<(Outcome, Learnt)> {
    let cfg = maps::config()?;
    let nat = nat::ingress(ctx, cfg)?;
    Some((
        Outcome {
            action: nat.outcome.action,
            class: nat.class,
            verdict: nat.outcome.verdict,
        },
        Learnt::default(),
    ))
}

/// The body of `tc_to_netdev` for everything but IPv6 frames (see [`crate::v6`]) once
/// [`prepare_out`] and [`nat_egress`] passed on the packet: IPIP for host-originated traffic,
/// learning of the flows the kernel path carries. The second value holds the events to count
/// (a kernel flow learnt). A BPF subprogram of its own.
#[inline(never)]
pub fn to_netdev(ctx: &TcContext) -> Option<(Outcome, [Option<Reason>; 2])> {
    let parsed = parse::parse(ctx);
    let class = match &parsed {
        Ok(p) => p.class,
        Err(reason) => *reason,
    };
    let outcome = |v: Verdict| Outcome {
        action: v.action,
        class,
        verdict: v.reason,
    };
    let Some(cfg) = maps::config() else {
        return Some((
            outcome(Verdict::pass(Reason::PassNotConfigured)),
            [None, None],
        ));
    };
    // What the screen refuses (a fragment, IP options, another protocol, an odd L4 header) is
    // still IPIP's to carry when the stack routed it to an IPIP peer: see `ipip_peer`.
    let (info, refused) = match ipv4::screen(&parsed) {
        Ok(packet) => match ipv4::read(ctx, &packet) {
            Some(info) => (info, None),
            None => return Some((outcome(Verdict::pass(Reason::PassMalformed)), [None, None])),
        },
        Err(reason) => match refused_header(ctx, &parsed) {
            Some(info) => (info, Some(reason)),
            None => return Some((outcome(Verdict::pass(reason)), [None, None])),
        },
    };
    let mut learnt = false;
    let verdict = match ipip_peer(ctx, cfg, &info, refused, &mut learnt) {
        Ok(peer) => ipip_out(ctx, cfg, &peer, &info),
        Err(reason) => Verdict::pass(reason),
    };
    Some((
        outcome(verdict),
        [learnt.then_some(Reason::LearnKernelFlow), None],
    ))
}

/// The IPv4 header of a packet [`ipv4::screen`] refused, for [`ipip_peer`]: with its L4 fields
/// where the parser checked them (IP options; a GSO packet's segment length needs its TCP
/// header's), from the header alone otherwise (`None` if it is not an IPv4 header at all).
#[inline(always)]
fn refused_header(ctx: &TcContext, parsed: &Result<Packet, Reason>) -> Option<Ipv4Info> {
    match parsed {
        Ok(p) if p.class == Reason::Ipv4Options => {
            ipv4::read(ctx, p).or_else(|| ipv4::read_header(ctx, p.l3_offset))
        }
        Ok(p) if p.ethertype == ETH_P_IP => ipv4::read_header(ctx, p.l3_offset),
        Ok(_) => None,
        Err(_) => {
            let ethertype = parse::ptr_at::<TcContext, [u8; 2]>(ctx, 12)?;
            // SAFETY: ptr_at checked the 2 bytes are readable.
            if unsafe { ethertype.read_unaligned() } != ETH_P_IP.to_be_bytes() {
                return None;
            }
            ipv4::read_header(ctx, ETH_HDR_LEN)
        }
    }
}

/// The IPIP peer a kernel-routed packet leaving by the external interface is for, or the
/// reason to leave it alone. Such a packet was routed to an IPIP peer's pod subnet only where
/// no kernel IPIP device exists: nothing but this program will encapsulate it, so every IPv4
/// packet the stack sends there is, whatever the screen said of it (`refused`: a fragment,
/// options, another protocol, a malformed L4 header), as a kernel IPIP device would; a raw pod
/// packet must not leak onto the underlay. Screened packets also teach the programs the flows
/// the kernel carries (`learnt`), and the kernel's own tunnel packets (udp backend, VXLAN) the
/// flows inside them.
#[inline(always)]
fn ipip_peer(
    ctx: &TcContext,
    cfg: &Config,
    info: &Ipv4Info,
    refused: Option<Reason>,
    learnt: &mut bool,
) -> Result<RemoteEntry, Reason> {
    if refused.is_none() {
        if let Some(l) = crate::udp::learn_from_forwarder(ctx, cfg, info) {
            // The udp backend's forwarder: the inner packet went through the kernel.
            *learnt = l;
            return Err(Reason::PassNoRoute);
        }
        if info.src == cfg.public_ip
            && info.proto == proto::UDP
            && u16::from_be_bytes(info.dport) == cfg.vxlan_port
        {
            // flannel.<VNI>'s VXLAN: the inner packet went through the kernel.
            if info.l4 == VXLAN_HDR_AT - 8
                && let Some(end) = encap::udp_payload_end(ctx, VXLAN_HDR_AT - 8, info.end())
                && let Ok(inner) = ipv4::screen(&parse::parse_ipv4_at(ctx, VXLAN_INNER_L3, end))
                && let Some(inner) = ipv4::read(ctx, &inner)
            {
                *learnt = deliver::learn_kernel_flow(cfg, &inner);
            }
            return Err(Reason::PassNoRoute);
        }
    }
    if !cfg.in_cluster(info.dst) {
        return Err(refused.unwrap_or(Reason::PassNoRoute));
    }
    if refused.is_none() {
        *learnt = deliver::learn_kernel_flow(cfg, info);
    }
    match maps::route(info.dst).copied() {
        Some(peer) if peer.kind == RouteKind::Ipip as u32 => Ok(peer),
        Some(_) => Err(refused.unwrap_or(Reason::PassNotIpipRoute)),
        None => Err(refused.unwrap_or(Reason::PassNoRoute)),
    }
}

/// IPIP for a kernel-routed packet on its way out.
#[inline(always)]
fn ipip_out(ctx: &TcContext, cfg: &Config, peer: &RemoteEntry, info: &Ipv4Info) -> Verdict {
    let route = match encap::ipip(ctx, cfg, peer, info, false) {
        Ok((route, _)) => route,
        // No kernel IPIP exists to fall back to: a raw pod packet must not leak out.
        Err(Reason::PassTooBig) => {
            return Verdict {
                action: TC_ACT_SHOT,
                reason: Reason::DropTooBig,
            };
        }
        Err(reason) => return reason.into(),
    };
    let ext = cfg.ext_ifindex;
    let action = match route {
        // Already on the right device: fix the MACs and let the packet continue.
        Fib::Resolved {
            ifindex,
            smac,
            dmac,
        } if ifindex == ext && ctx.ifindex_is(ext) => {
            if parse::write_macs(ctx, dmac, smac).is_none() {
                return Reason::DropRewriteFailed.into();
            }
            TC_ACT_OK
        }
        route => {
            ctx.set_mark(FASTPATH_MARK);
            match fib::redirect(ctx, route) {
                Some(action) => action,
                None => return Reason::DropRewriteFailed.into(),
            }
        }
    };
    Verdict {
        action,
        reason: Reason::FastIpipEgress,
    }
}

/// `skb->ifindex` comparisons for the program's own device.
trait IfindexIs {
    fn ifindex_is(&self, ifindex: u32) -> bool;
}

impl IfindexIs for TcContext {
    #[inline(always)]
    fn ifindex_is(&self, ifindex: u32) -> bool {
        // SAFETY: reading a field of the __sk_buff the kernel passed.
        unsafe { (*self.skb.skb).ifindex == ifindex }
    }
}
