//! `tc_from_bridge`: pod → remote pod transmit, on TC ingress of the pod bridge's ports (the
//! host side of every pod's veth; the agent attaches it as ports come and go).
//!
//! Pods route everything off their subnet through their gateway, the bridge's own address.
//! The program takes such packets at the port, before the bridge: that skips the bridging,
//! and, above all, the bridge's netfilter hooks. With `br_netfilter` (on in every kubeadm
//! cluster) a frame going up to the bridge device meets iptables PREROUTING first: kube-proxy
//! DNATs a Service's ClusterIP to a backend there, and a hook on the bridge device itself would
//! see the backend's address, fast-path the packet and bypass the conntrack confirmation, so
//! the reply would come back un-translated (test `agent_ebpf::*_service_dnat_*`). At the port
//! the packet still carries the ClusterIP: not a remote pod, it is passed to the kernel, and
//! the flow is learnt as a kernel flow on its way out. The program also works on the bridge
//! device itself where bridged traffic skips netfilter (the BPF test rigs attach it there).
//! Pod-to-pod traffic on the same node carries a local destination and is left to the bridge.
//!
//! A packet whose destination lies in a remote subnet of `FLANNEL_ROUTES4` is sent according
//! to the entry's kind (see [`crate::decide::from_bridge`] for every condition):
//! - host-gw: `bpf_fib_lookup` (the kernel route `<subnet> via <peer>`; the answer remembered
//!   for up to a second, [`crate::hops`]), TTL decremented, `bpf_redirect` with the neighbour's
//!   MACs or `bpf_redirect_neigh`;
//! - VXLAN / IPIP: encapsulated ([`crate::encap`]) and redirected to the external interface
//!   (a VXLAN GSO packet too long for that, to `flannel.<VNI>` itself: `vxlan_device`);
//! - udp: encapsulated as the udp backend's TUN path would ([`crate::udp`]) and redirected.
//!
//! A host-gw, VXLAN or IPIP decision with a resolved next hop is remembered for the flow
//! ([`crate::memo`]): the flow's next packets are sent from that memo before this body runs.
//! The fragments of a UDP datagram to a remote pod follow their first fragment ([`crate::frag`]).
//!
//! IPv6 frames are handled by [`crate::v6`]. Everything else is handed to the kernel path
//! unchanged (`TC_ACT_OK`), counted with a reason.

use aya_ebpf::{bindings::TC_ACT_OK, programs::TcContext};
use flannel_common::{
    config::{FASTPATH_MARK, FASTPATH_TC_INDEX},
    hops::HopKey,
    memo::{DIR_OUT, TUNNEL_IPIP, TUNNEL_NONE, TUNNEL_VXLAN},
    route::RemoteEntry,
    stats::Reason,
};

use crate::{
    decide::{self, BridgeAction},
    deliver,
    encap::{self, VXLAN_OVERHEAD},
    fib::{self, Fib},
    frag, hops, ipv4, maps, memo, parse, udp,
};

/// What one run did: the TC action, the packet's class and the verdict to count.
pub struct Outcome {
    /// The TC action to return.
    pub action: i32,
    /// The classification (or malformed reason).
    pub class: Reason,
    /// The verdict.
    pub verdict: Reason,
}

impl Outcome {
    #[inline(always)]
    fn pass(class: Reason, verdict: Reason) -> Self {
        Outcome {
            action: TC_ACT_OK,
            class,
            verdict,
        }
    }
}

/// The body of `tc_from_bridge` for everything but IPv6 frames (see [`crate::v6`]). A BPF
/// subprogram of its own, so that its stack does not add to the IPv6 side's.
#[inline(never)]
pub fn run(ctx: &TcContext) -> Outcome {
    let parsed = parse::parse(ctx);
    let class = match &parsed {
        Ok(p) => p.class,
        Err(reason) => *reason,
    };
    let Some(cfg) = maps::config() else {
        return Outcome::pass(class, Reason::PassNotConfigured);
    };
    // A fragment ([`crate::frag`]): a first one takes the checks with its datagram's ports, a
    // later one of a remembered datagram those of its destination; neither is a flow's memo.
    let (info, fragment) = match ipv4::screen(&parsed) {
        Ok(packet) => match ipv4::read(ctx, &packet) {
            Some(info) => (info, None),
            None => return Outcome::pass(class, Reason::PassMalformed),
        },
        Err(Reason::PassFragment) => match frag::read(ctx) {
            Ok(f) if f.first || frag::followed(&f.key) => (f.info, Some((f.key, f.first))),
            Ok(_) => return Outcome::pass(class, Reason::PassFragment),
            Err(reason) => return Outcome::pass(class, reason),
        },
        Err(reason) => return Outcome::pass(class, reason),
    };
    // Read before the checks: a change while they run retires what they decide.
    let generation = fragment
        .is_none()
        .then(|| memo::current_for(&info, DIR_OUT));
    let action = decide::from_bridge(
        cfg,
        &info,
        |dst| maps::route(dst).copied(),
        deliver::is_nat_guarded,
        deliver::is_kernel_flow,
    );
    let sent = match action {
        BridgeAction::Pass(reason) => Err(reason),
        BridgeAction::HostGw(peer) => host_gw(ctx, &peer, &info, generation),
        BridgeAction::Vxlan(_)
            if fib::gso_size(ctx) != 0 && encap::inner_len(ctx, VXLAN_OVERHEAD).is_err() =>
        {
            vxlan_device(ctx, &info)
        }
        BridgeAction::Vxlan(peer) => encap::vxlan(ctx, cfg, &peer, &info)
            .and_then(|(route, mtu)| {
                if let Some(generation) = generation {
                    remember(&info, route, mtu, generation, (TUNNEL_VXLAN, &peer));
                }
                send(ctx, route)
            })
            .map(|action| (action, Reason::FastVxlan)),
        BridgeAction::Ipip(peer) => encap::ipip(ctx, cfg, &peer, &info, true)
            .and_then(|(route, mtu)| {
                if let Some(generation) = generation {
                    remember(&info, route, mtu, generation, (TUNNEL_IPIP, &peer));
                }
                send(ctx, route)
            })
            .map(|action| (action, Reason::FastIpip)),
        BridgeAction::Udp(peer) => udp::encap(ctx, cfg, &peer, &info)
            .and_then(|route| send(ctx, route))
            .map(|action| (action, Reason::FastUdp)),
    };
    if let (Ok(_), Some((key, true))) = (&sent, fragment) {
        frag::remember(&key);
    }
    match sent {
        Ok((action, verdict)) => Outcome {
            action,
            class,
            verdict,
        },
        Err(Reason::DropRewriteFailed) => Outcome {
            action: aya_ebpf::bindings::TC_ACT_SHOT,
            class,
            verdict: Reason::DropRewriteFailed,
        },
        Err(reason) => Outcome::pass(class, reason),
    }
}

/// Host-gw: route by the kernel FIB (the answer remembered for up to a second per destination
/// and peer, see [`crate::hops`]), decrement the TTL and redirect; the decision remembered for
/// the flow when a `generation` is given (not for fragments).
#[inline(always)]
fn host_gw(
    ctx: &TcContext,
    peer: &RemoteEntry,
    info: &ipv4::Ipv4Info,
    generation: Option<u64>,
) -> Result<(i32, Reason), Reason> {
    let key = HopKey {
        dst: info.dst,
        via: peer.public_ip,
    };
    // The lookup lets the kernel check the packet against the MTU (GSO packets included);
    // a remembered answer checks the IP length of a packet that is not GSO.
    let len = if fib::gso_size(ctx) == 0 {
        info.tot_len
    } else {
        0
    };
    let mut mtu = 0;
    let route = hops::route(key, len, &mut mtu, |mtu| {
        fib::lookup(ctx, crate::pods::routing_iif(ctx), info, 0, mtu)
    });
    if route == Fib::Failed {
        return Err(Reason::PassFibFailed);
    }
    if !ipv4::decrement_ttl(ctx, info.l3) {
        return Err(Reason::PassMalformed);
    }
    if let Some(generation) = generation {
        remember(info, route, mtu, generation, (TUNNEL_NONE, peer));
    }
    send(ctx, route).map(|action| (action, Reason::FastHostGw))
}

/// A GSO packet for a VXLAN peer too long to encapsulate here (a pod with BIG TCP, see
/// [`encap::inner_len`]), sent where the kernel's route for its destination says
/// (`<subnet> via <VTEP address> dev flannel.<VNI> onlink`, the VTEP's MAC in the neighbour
/// entry): its MACs set and its TTL decremented as the kernel would, redirected straight to
/// `flannel.<VNI>`, which encapsulates and segments it. Not through the stack: the flow's other
/// packets skip routing and netfilter too, so a masquerade rule for pod traffic (the CNI
/// bridge's `ipMasq`) cannot rewrite some of its packets and not others. Tagged by `tc_index`
/// (see [`FASTPATH_TC_INDEX`]) for `tc_to_netdev`. Without such a route it is passed to the
/// stack.
#[inline(always)]
fn vxlan_device(ctx: &TcContext, info: &ipv4::Ipv4Info) -> Result<(i32, Reason), Reason> {
    let route = fib::lookup(ctx, crate::pods::routing_iif(ctx), info, 0, &mut 0);
    if !matches!(route, Fib::Resolved { .. }) {
        return Err(Reason::PassTooBig);
    }
    if !ipv4::decrement_ttl(ctx, info.l3) {
        return Err(Reason::PassMalformed);
    }
    // SAFETY: writing a field of the __sk_buff the kernel passed (writable for classifiers).
    unsafe { (*ctx.skb.skb).tc_index = FASTPATH_TC_INDEX };
    fib::redirect(ctx, route)
        .map(|action| (action, Reason::FastVxlanDevice))
        .ok_or(Reason::DropRewriteFailed)
}

/// Remembers the decision, taken at `generation`, to send `info`'s flow by `route` (when it
/// resolved the next hop and gave an MTU) to the peer, plain or encapsulated (`tunnel`).
#[inline(always)]
fn remember(
    info: &ipv4::Ipv4Info,
    route: Fib,
    mtu: u16,
    generation: u64,
    (tunnel, peer): (u8, &RemoteEntry),
) {
    if let Fib::Resolved {
        ifindex,
        smac,
        dmac,
    } = route
        && mtu != 0
    {
        let memo = memo::memo(ifindex, smac, dmac, mtu, generation);
        memo::remember(info, DIR_OUT, memo::to_peer(memo, tunnel, peer));
    }
}

/// Tags the packet as the fast path's own (for `tc_to_netdev`) and redirects it.
#[inline(always)]
fn send(ctx: &TcContext, route: Fib) -> Result<i32, Reason> {
    ctx.set_mark(FASTPATH_MARK);
    fib::redirect(ctx, route).ok_or(Reason::DropRewriteFailed)
}
