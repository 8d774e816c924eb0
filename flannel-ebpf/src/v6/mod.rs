//! IPv6 on the fast path: the IPv6 halves of `tc_from_bridge`, `tc_from_netdev` and
//! `tc_to_netdev`, with maps of their own ([`flannel_common::v6`]).
//!
//! The entry points hand every IPv6 frame here before they look at the IPv4 configuration, so
//! an IPv6-only node (whose IPv4 configuration stays disabled) runs this side alone and a
//! dual-stack node runs both. The behaviour is the IPv4 one, family for family:
//!
//! - `tc_from_bridge`: a local pod's packet to a remote IPv6 subnet is routed with
//!   `bpf_fib_lookup` (`AF_INET6`, the kernel's `<subnet> via <peer> dev <ext>` route) and
//!   redirected with the hop limit decremented (host-gw, DirectRouting), or encapsulated in
//!   VXLAN over IPv6 exactly as `flannel-v6.<VNI>` would ([`vxlan`]) — GSO packets excepted,
//!   they are redirected to `flannel-v6.<VNI>` itself (past the stack, see `vxlan_device`);
//! - `tc_from_netdev`: VXLAN over IPv6 from a known peer and plain packets from remote pods are
//!   delivered into the pod's namespace when its MAC and bridge port are known
//!   ([`crate::pods`]), to the pod bridge otherwise (bypassing conntrack both ways, see
//!   [`crate::deliver`]); the NAT guard learns remote pods that talk to host addresses;
//! - `tc_to_netdev`: local pod → remote pod flows the kernel sends (plain, or inside
//!   `flannel-v6.<VNI>`'s VXLAN) are recorded so their replies take the stack too.
//!
//! A TCP or UDP flow's decision to send or deliver is remembered ([`memo`]), as for IPv4.
//!
//! Neighbour discovery, ICMPv6 errors, extension headers (but the jumbo option of a BIG TCP
//! packet, see [`crate::parse`], and the fragment header of a pod's UDP datagram, see
//! `read_fragment`), hop limit 1 and everything else goes to the kernel unchanged with its
//! reason counted. Without an enabled IPv6 configuration, IPv6 frames are passed as
//! [`Reason::PassNotIpv4`] (as before IPv6 support).
//!
//! | module | job |
//! |---|---|
//! | [`info`] | the IPv6 fields decided on |
//! | [`decide`] | the decisions, as pure functions |
//! | [`fib`] | `bpf_fib_lookup` for IPv6, redirects |
//! | [`memo`] | remembered per-flow decisions: the short paths the entry points try first |
//! | [`vxlan`] | VXLAN over IPv6: headers, checksum, encapsulation, decapsulation |

pub mod decide;
pub mod fib;
pub mod info;
pub mod memo;
pub mod vxlan;

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, lpm_trie::Key},
    macros::btf_map,
    programs::TcContext,
};
use flannel_common::{
    config::{FASTPATH_MARK, FASTPATH_TC_INDEX},
    maps::HELD_V6,
    memo::{DIR_IN, DIR_OUT, FlowMemo6},
    route::{NODE_F_VXLAN, NodeEntry, RemoteEntry6},
    stats::{Reason, ReasonKind},
    v6::{
        CFG6_ROUTED_RX, CFG6_VXLAN_RX, Config6, FRAGS6_MAX_ENTRIES, FlowKey6, FragKey6,
        HELD_FLOWS6_MAX_ENTRIES, HELD_GUARD6_MAX_ENTRIES, KERNEL_FLOWS6_MAX_ENTRIES,
        NAT_GUARD6_MAX_ENTRIES, NODES6_MAX_ENTRIES, PeerKey6, ROUTES6_MAX_ENTRIES, VXLAN6_OVERHEAD,
    },
};

use self::{decide::BridgeAction6, fib::Fib6, info::Ipv6Info};
use crate::{
    bridge::Outcome,
    deliver::learn,
    fib::{gso_size, ingress_ifindex},
    maps::{NO_PREALLOC, holds},
    netdev::Learnt,
    parse::{
        self, ETH_HDR_LEN, ETH_P_IPV6, IPV6_HDR_LEN, PULL_LEN, PacketCtx as _, proto, ptr_at,
        ptr_at_mut,
    },
};

/// The local IPv6 configuration (`flannel_common::v6::CONFIG6`).
#[btf_map]
pub static FLANNEL_CONFIG6: Array<Config6, 1> = Array::new();

/// Remote IPv6 pod subnets → how to reach them (`flannel_common::v6::ROUTES6`).
#[btf_map]
pub static FLANNEL_ROUTES6: LpmTrie<[u8; 16], RemoteEntry6, { ROUTES6_MAX_ENTRIES as usize }> =
    LpmTrie::new();

/// VXLAN peers by public IPv6 (`flannel_common::v6::NODES6`).
#[btf_map]
pub static FLANNEL_NODES6: HashMap<[u8; 16], NodeEntry, { NODES6_MAX_ENTRIES as usize }> =
    HashMap::new();

/// Remote IPv6 pod endpoints that talked to a host address (`flannel_common::v6::NAT_GUARD6`).
#[btf_map]
pub static FLANNEL_NATGRD6: LruHashMap<PeerKey6, u32, { NAT_GUARD6_MAX_ENTRIES as usize }> =
    LruHashMap::new();

/// Local pod → remote pod IPv6 flows that left through the kernel
/// (`flannel_common::v6::KERNEL_FLOWS6`).
#[btf_map]
pub static FLANNEL_KFLOWS6: LruHashMap<FlowKey6, u32, { KERNEL_FLOWS6_MAX_ENTRIES as usize }> =
    LruHashMap::new();

/// The NAT-guard keys of open NATed IPv6 TCP connections and UDP streams, never evicted
/// (`flannel_common::v6::HELD_GUARD6`).
#[btf_map]
pub static FLANNEL_HNATGD6: HashMap<
    PeerKey6,
    u32,
    { HELD_GUARD6_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

/// The kernel-flow keys of open NATed IPv6 TCP connections and UDP streams, never evicted
/// (`flannel_common::v6::HELD_FLOWS6`).
#[btf_map]
pub static FLANNEL_HFLOWS6: HashMap<
    FlowKey6,
    u32,
    { HELD_FLOWS6_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

/// Working memory of one program run, per CPU: what does not fit the 512-byte stack next to
/// the IPv4 side's frames (a program runs to completion on its CPU before the next one starts
/// there, so one entry per CPU is enough).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Scratch6 {
    /// The packet (outer packet of a tunnel).
    pub outer: Ipv6Info,
    /// The inner packet of a tunnel.
    pub inner: Ipv6Info,
    /// The remote subnet's entry.
    pub peer: RemoteEntry6,
    /// The inner IPv6 header being encapsulated.
    pub inner_hdr: [u8; 40],
    /// The outer headers being written.
    pub headers: [u8; VXLAN6_OVERHEAD],
    /// The room inner packets have in VXLAN over IPv6 ([`vxlan::room`]).
    pub room: u16,
    /// The memos' generation read before the checks ([`memo`]).
    pub generation: u64,
    /// The remembered decision being used ([`memo`]).
    pub memo: FlowMemo6,
    /// The datagram of a fragment being sent (`read_fragment`).
    pub frag: FragKey6,
    /// [`FRAG_NONE`], [`FRAG_FIRST`] or [`FRAG_LATER`]: what the packet being sent is.
    pub frag_state: u8,
}

/// [`Scratch6::frag_state`]: not a fragment.
pub const FRAG_NONE: u8 = 0;
/// [`Scratch6::frag_state`]: the first fragment of a datagram (it carries the ports).
pub const FRAG_FIRST: u8 = 1;
/// [`Scratch6::frag_state`]: a later fragment of a datagram whose first was sent.
pub const FRAG_LATER: u8 = 2;

/// A local pod's fragmented IPv6 datagrams whose first fragment was sent
/// (`flannel_common::v6::FRAGS6`, see `read_fragment`).
#[btf_map]
pub static FLANNEL_FRAGS6: LruHashMap<FragKey6, u32, { FRAGS6_MAX_ENTRIES as usize }> =
    LruHashMap::new();

/// [`Scratch6`], one per CPU.
#[btf_map]
pub static FLANNEL_SCR6: PerCpuArray<Scratch6, 1> = PerCpuArray::new();

/// This CPU's scratch space.
#[inline(always)]
fn scratch() -> Option<&'static mut Scratch6> {
    // SAFETY: the pointer is this CPU's map entry; the program using it runs to completion on
    // this CPU before another one does, so no other reference exists meanwhile.
    FLANNEL_SCR6.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}

/// The IPv6 configuration, if the agent enabled it.
#[inline(always)]
pub fn config() -> Option<&'static Config6> {
    match FLANNEL_CONFIG6.get(0) {
        Some(cfg) if cfg.enabled() => Some(cfg),
        _ => None,
    }
}

/// The remote IPv6 subnet containing `addr`, if any.
#[inline(always)]
pub fn route(addr: &[u8; 16]) -> Option<RemoteEntry6> {
    FLANNEL_ROUTES6.get(&Key::new(128, *addr)).copied()
}

/// The tunnel kinds accepted from the node with public IPv6 `addr`.
#[inline(always)]
pub fn node_flags(addr: &[u8; 16]) -> u32 {
    match FLANNEL_NODES6.get_ptr(addr) {
        // SAFETY: a pointer from a successful lookup to a plain u32, read once.
        Some(entry) => unsafe { (*entry).flags },
        None => 0,
    }
}

#[inline(always)]
fn is_kernel_flow(key: &FlowKey6) -> bool {
    FLANNEL_KFLOWS6.get_ptr(key).is_some()
        || (holds(HELD_V6, key.proto) && FLANNEL_HFLOWS6.get_ptr(key).is_some())
}

#[inline(always)]
fn is_nat_guarded(key: &PeerKey6) -> bool {
    FLANNEL_NATGRD6.get_ptr(key).is_some()
        || (holds(HELD_V6, key.proto) && FLANNEL_HNATGD6.get_ptr(key).is_some())
}

/// Records the remote endpoint of `info` in the NAT guard if it is a candidate.
#[inline(always)]
fn learn_nat_guard(cfg: &Config6, info: &Ipv6Info) -> bool {
    if !decide::nat_guard_candidate(cfg, info) {
        return false;
    }
    let key = decide::peer_key_from(info);
    if FLANNEL_NATGRD6.get_ptr(key).is_some() {
        return false;
    }
    learn(&FLANNEL_NATGRD6, key)
}

/// Hands the flow of a packet arriving for a local pod to the kernel.
#[inline(always)]
fn hand_to_kernel(info: &Ipv6Info) -> bool {
    let key = decide::flow_key_incoming(info);
    learn(&FLANNEL_KFLOWS6, key)
}

/// Records the flow of a local pod's packet that leaves through the kernel.
#[inline(always)]
fn learn_kernel_flow(cfg: &Config6, info: &Ipv6Info) -> bool {
    if !decide::kernel_flow_candidate(cfg, info) {
        return false;
    }
    let key = decide::flow_key_outgoing(info);
    if FLANNEL_KFLOWS6.get_ptr(key).is_some() {
        return false;
    }
    learn(&FLANNEL_KFLOWS6, key)
}

/// A TC action with the verdict to count.
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

    #[inline(always)]
    fn failed(reason: Reason) -> Self {
        if reason == Reason::DropRewriteFailed {
            Verdict {
                action: TC_ACT_SHOT,
                reason,
            }
        } else {
            Verdict::pass(reason)
        }
    }

    #[inline(always)]
    fn outcome(self, class: Reason) -> Outcome {
        Outcome {
            action: self.action,
            class,
            verdict: self.reason,
        }
    }
}

/// Whether the frame in `ctx` is IPv6 (by its EtherType): the entry points hand it to this
/// module instead of the IPv4 bodies.
#[inline(always)]
pub fn is_ipv6(ctx: &TcContext) -> bool {
    match ptr_at::<TcContext, [u8; 2]>(ctx, 12) {
        // SAFETY: ptr_at checked the two bytes are readable.
        Some(p) => u16::from_be_bytes(unsafe { p.read_unaligned() }) == ETH_P_IPV6,
        None => false,
    }
}

/// Parses the frame into `info` if the fast path may take it: returns its class and, when it
/// may not, the pass reason. (A BPF subprogram: the parser's state stays off the callers'
/// frames.)
#[inline(never)]
fn read_frame(ctx: &TcContext, info: &mut Ipv6Info) -> (Reason, Option<Reason>) {
    let parsed = parse::parse(ctx);
    let class = match &parsed {
        Ok(p) => p.class,
        Err(reason) => *reason,
    };
    let screened = match info::screen(&parsed) {
        Ok(p) if info::read_into(ctx, &p, info) => None,
        Ok(_) => Some(Reason::PassMalformed),
        Err(reason) => Some(reason),
    };
    (class, screened)
}

/// Parses the inner IPv6 packet of a VXLAN packet whose inner frame ends at `end` into `info`;
/// the pass reason if the fast path may not take it.
#[inline(never)]
fn read_inner(ctx: &TcContext, end: usize, info: &mut Ipv6Info) -> Option<Reason> {
    match info::screen(&parse::parse_ipv6_at(ctx, vxlan::INNER_L3, end)) {
        Ok(p) if info::read_into(ctx, &p, info) => None,
        Ok(_) => Some(Reason::PassMalformed),
        Err(reason) => Some(reason),
    }
}

/// What `tc_from_bridge` does, with a VXLAN peer's entry written to `peer`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum BridgeStep {
    Pass(Reason),
    HostGw,
    Vxlan,
}

#[inline(never)]
fn decide_bridge(cfg: &Config6, info: &Ipv6Info, peer: &mut RemoteEntry6) -> BridgeStep {
    match decide::from_bridge(cfg, info, route, is_nat_guarded, is_kernel_flow) {
        BridgeAction6::Pass(reason) => BridgeStep::Pass(reason),
        BridgeAction6::HostGw => BridgeStep::HostGw,
        BridgeAction6::Vxlan(entry) => {
            *peer = entry;
            BridgeStep::Vxlan
        }
    }
}

/// Whether a received packet may go to a local pod (the pass reason if not), recording its
/// remote source in the NAT guard on the way.
#[inline(never)]
fn decide_receive(cfg: &Config6, info: &Ipv6Info, nat_learnt: &mut bool) -> Option<Reason> {
    *nat_learnt = learn_nat_guard(cfg, info);
    decide::deliverable(cfg, info, route, is_kernel_flow).err()
}

/// Tags the packet as the fast path's own and redirects it.
#[inline(always)]
fn send(ctx: &TcContext, route: Fib6) -> Result<i32, Reason> {
    ctx.set_mark(FASTPATH_MARK);
    fib::redirect(ctx, route).ok_or(Reason::DropRewriteFailed)
}

/// `tc_from_bridge` for an IPv6 frame. Like each step below, a BPF subprogram of its own:
/// the frames of a call chain add up, and the programs have 512 bytes of stack in all.
#[inline(never)]
pub fn from_bridge(ctx: &TcContext) -> Outcome {
    let Some(s) = scratch() else {
        return Verdict::pass(Reason::PassNotConfigured).outcome(parse::classify(ctx));
    };
    let (class, refused) = read_frame(ctx, &mut s.outer);
    let Some(cfg) = config() else {
        return Verdict::pass(Reason::PassNotIpv4).outcome(class);
    };
    s.frag_state = FRAG_NONE;
    let refused = match refused {
        Some(Reason::PassIpv6ExtHeader) => read_fragment(ctx, s).err(),
        refused => refused,
    };
    if let Some(reason) = refused {
        return Verdict::pass(reason).outcome(class);
    }
    // Read before the checks: a change while they run retires what they decide.
    s.generation = memo::generation_for(&s.outer, DIR_OUT, crate::memo::agent_generation());
    let verdict = match decide_bridge(cfg, &s.outer, &mut s.peer) {
        BridgeStep::Pass(reason) => Verdict::pass(reason),
        BridgeStep::HostGw => host_gw(ctx, &s.outer, s.generation, s.frag_state == FRAG_NONE),
        BridgeStep::Vxlan => vxlan_out(ctx, cfg, s),
    };
    if s.frag_state == FRAG_FIRST && verdict.reason.kind() == ReasonKind::Fast {
        // By reference: the key stays in the scratch entry, off the stack.
        let key: &FragKey6 = &s.frag;
        let _ = FLANNEL_FRAGS6.insert(key, 0, 0);
    }
    verdict.outcome(class)
}

/// IPv6 fragment header (next header value).
const FRAGMENT: u8 = 44;

/// If the frame is a fragment of a local pod's UDP datagram the fast path may send, as IPv4's
/// are ([`crate::frag`]): a fragment header right after the IPv6 header and UDP after it; a
/// first fragment (offset 0, more to come) long enough to carry the ports, or a later one of a
/// datagram whose first was sent ([`FLANNEL_FRAGS6`]). Reads it into `s.outer` (L4 after the
/// fragment header; the ports of a first fragment, none for a later one) and `s.frag`; the
/// pass reason otherwise. A BPF subprogram of its own.
#[inline(never)]
fn read_fragment(ctx: &TcContext, s: &mut Scratch6) -> Result<(), Reason> {
    let l3 = ETH_HDR_LEN;
    let Some(hdr) = ptr_at::<TcContext, [u8; 48]>(ctx, l3) else {
        return Err(Reason::PassIpv6ExtHeader);
    };
    // SAFETY: ptr_at checked the 48 bytes (IPv6 and fragment headers) are readable; nothing
    // changes them while the reference is used.
    let hdr = unsafe { &*hdr };
    if hdr[6] != FRAGMENT || hdr[40] != proto::UDP {
        return Err(Reason::PassIpv6ExtHeader);
    }
    let offset_m = u16::from_be_bytes([hdr[42], hdr[43]]);
    let first = offset_m & 0xfff8 == 0;
    if first && offset_m & 1 == 0 {
        // An atomic fragment (RFC 6946): not part of a datagram in pieces.
        return Err(Reason::PassIpv6ExtHeader);
    }
    let l4 = l3 + IPV6_HDR_LEN + 8;
    let info = &mut s.outer;
    let Some(fixed) = hdr.first_chunk::<40>() else {
        return Err(Reason::PassIpv6ExtHeader);
    };
    info::header_into(fixed, l3, l4, proto::UDP, info);
    // Field by field, the padding left alone (see below).
    let key = &mut s.frag;
    key.saddr = info.src;
    key.daddr = info.dst;
    key.id = [hdr[44], hdr[45], hdr[46], hdr[47]];
    key.proto = proto::UDP;
    // (`_pad` stays zero: the scratch entry starts zeroed and nothing else writes the key; a
    // write of the three bytes would be a `memset` call.)
    if first {
        // The parser checked the payload length against the packet.
        if l4 + 8 > info.end() {
            return Err(Reason::PassIpv6ExtHeader);
        }
        let Some(ports) = ptr_at::<TcContext, [u8; 4]>(ctx, l4) else {
            return Err(Reason::PassIpv6ExtHeader);
        };
        // SAFETY: ptr_at checked the 4 bytes are readable.
        let ports = unsafe { ports.read_unaligned() };
        info.sport = [ports[0], ports[1]];
        info.dport = [ports[2], ports[3]];
        info.l4_hdr_len = 8;
        s.frag_state = FRAG_FIRST;
    } else if FLANNEL_FRAGS6.get_ptr(&s.frag as &FragKey6).is_some() {
        s.frag_state = FRAG_LATER;
    } else {
        return Err(Reason::PassFragment);
    }
    Ok(())
}

/// Host-gw: route by the kernel FIB, decrement the hop limit, redirect; the decision
/// remembered for the flow ([`memo`]) if `remember` (not for fragments).
#[inline(never)]
fn host_gw(ctx: &TcContext, info: &Ipv6Info, generation: u64, remember: bool) -> Verdict {
    let mut mtu = 0;
    let route = fib::lookup(ctx, crate::pods::routing_iif(ctx), info, &mut mtu);
    if route == Fib6::Failed {
        return Verdict::pass(Reason::PassFibFailed);
    }
    // The packet from the bridge starts with its IPv6 header right after Ethernet (a constant
    // offset: the verifier does not bound one read back from the scratch map).
    if let Err(reason) = decrement_hop_limit(ctx, ETH_HDR_LEN, info.hop_limit) {
        return Verdict::pass(reason);
    }
    if remember {
        memo::remember_transmit(info, &route, mtu, generation, None);
    }
    match send(ctx, route) {
        Ok(action) => Verdict {
            action,
            reason: Reason::FastHostGw6,
        },
        Err(reason) => Verdict::failed(reason),
    }
}

/// VXLAN over IPv6 to the peer in `s` (with the generation read before the checks); the
/// decision remembered for the flow ([`memo`]).
#[inline(never)]
fn vxlan_out(ctx: &TcContext, cfg: &Config6, s: &mut Scratch6) -> Verdict {
    // A fragment too: the outer UDP checksum is built from the inner one, which covers the
    // whole datagram, not the fragment.
    if gso_size(ctx) != 0 || s.frag_state != FRAG_NONE {
        return vxlan_device(ctx, &s.outer);
    }
    match vxlan::encap(
        ctx,
        cfg,
        &s.peer,
        &s.outer,
        &mut s.inner_hdr,
        &mut s.headers,
        &mut s.room,
    ) {
        Ok(route) => vxlan_send(ctx, s, &route),
        Err(reason) => Verdict::failed(reason),
    }
}

/// A GSO packet (or a fragment) for a VXLAN peer, sent where the kernel's route for its destination says
/// (`<subnet> via <peer's VTEP address> dev flannel-v6.<VNI> onlink`, the VTEP's MAC in the
/// neighbour entry): its MACs set as the kernel would set them and its hop limit decremented,
/// redirected to `flannel-v6.<VNI>`, which encapsulates it (its FDB has the peer) and segments
/// it with an outer checksum per segment. Straight to the device, not through the stack: the
/// flow's other packets skip routing and netfilter too, so a masquerade rule for pod traffic
/// (the CNI bridge's `ipMasq`) cannot rewrite some of its packets and not others. Tagged, so
/// `tc_to_netdev` does not take its outer packet for a kernel flow's. Without such a route (or
/// its neighbour) it is passed to the stack.
#[inline(never)]
fn vxlan_device(ctx: &TcContext, info: &Ipv6Info) -> Verdict {
    let route = fib::lookup(ctx, crate::pods::routing_iif(ctx), info, &mut 0);
    if !matches!(route, Fib6::Resolved { .. }) {
        return Verdict::pass(Reason::PassGso);
    }
    if decrement_hop_limit(ctx, ETH_HDR_LEN, info.hop_limit).is_err() {
        return Verdict::pass(Reason::PassMalformed);
    }
    // Tagged by `tc_index`, not the mark (see FASTPATH_TC_INDEX): its outer packet meets
    // netfilter. The lookup's MACs lie before the hop limit, so they are writable too.
    // SAFETY: writing a field of the __sk_buff the kernel passed (writable for classifiers).
    unsafe { (*ctx.skb.skb).tc_index = FASTPATH_TC_INDEX };
    match fib::redirect(ctx, route) {
        Some(action) => Verdict {
            action,
            reason: Reason::FastVxlan6Device,
        },
        None => Verdict::failed(Reason::DropRewriteFailed),
    }
}

/// Remembers and sends a packet [`vxlan_out`] encapsulated. A BPF subprogram of its own:
/// its frame is not on the stack while the headers are built (the deepest call chain).
#[inline(never)]
fn vxlan_send(ctx: &TcContext, s: &Scratch6, route: &Fib6) -> Verdict {
    if s.frag_state == FRAG_NONE {
        memo::remember_transmit(&s.outer, route, s.room, s.generation, Some(&s.peer));
    }
    match send(ctx, *route) {
        Ok(action) => Verdict {
            action,
            reason: Reason::FastVxlan6,
        },
        Err(reason) => Verdict::failed(reason),
    }
}

/// Decrements the hop limit of the IPv6 header at `l3` in place (IPv6 has no header
/// checksum, and the L4 checksums do not cover the hop limit).
#[inline(always)]
fn decrement_hop_limit(ctx: &TcContext, l3: usize, hop_limit: u8) -> Result<(), Reason> {
    let Some(p) = ptr_at_mut::<TcContext, [u8; 1]>(ctx, l3 + 7) else {
        return Err(Reason::PassMalformed);
    };
    // SAFETY: ptr_at_mut checked the byte lies in the packet.
    unsafe { p.write_unaligned([hop_limit.wrapping_sub(1)]) };
    Ok(())
}

/// The route to a local pod for a received packet (the IPv6 length checked against the
/// bridge's MTU, except for GSO packets whose segments the kernel checks), with the route's
/// MTU in `mtu`.
#[inline(always)]
fn route_to_pod(ctx: &TcContext, info: &Ipv6Info, mtu: &mut u16) -> Fib6 {
    *mtu = if gso_size(ctx) == 0 {
        (IPV6_HDR_LEN as u16).wrapping_add(info.payload_len)
    } else {
        0
    };
    fib::lookup(ctx, ingress_ifindex(ctx), info, mtu)
}

/// Delivers a packet whose IPv6 header is right after the Ethernet header.
#[inline(always)]
fn deliver(ctx: &TcContext, info: &Ipv6Info, route: Fib6, fast: Reason) -> Verdict {
    if ctx
        .store(ETH_HDR_LEN + 7, &[info.hop_limit.wrapping_sub(1)], 0)
        .is_err()
    {
        return Verdict::failed(Reason::DropRewriteFailed);
    }
    match fib::deliver(ctx, route) {
        Some(action) => Verdict {
            action,
            reason: fast,
        },
        None => Verdict::failed(Reason::DropRewriteFailed),
    }
}

/// `tc_from_netdev` for an IPv6 frame.
#[inline(never)]
pub fn from_netdev(ctx: &TcContext) -> (Outcome, Learnt) {
    let mut learnt = Learnt::default();
    let Some(s) = scratch() else {
        return (
            Verdict::pass(Reason::PassNotConfigured).outcome(parse::classify(ctx)),
            learnt,
        );
    };
    let (class, refused) = read_frame(ctx, &mut s.outer);
    let Some(cfg) = config() else {
        return (Verdict::pass(Reason::PassNotIpv4).outcome(class), learnt);
    };
    if let Some(reason) = refused {
        return (Verdict::pass(reason).outcome(class), learnt);
    }
    let outer = &s.outer;
    let verdict = if outer.dst == cfg.public_ip
        && outer.next_hdr == proto::UDP
        && u16::from_be_bytes(outer.dport) == cfg.vxlan_port
        && cfg.vni != 0
    {
        vxlan_in(ctx, cfg, s, &mut learnt)
    } else {
        plain_in(ctx, cfg, &s.outer, &mut learnt)
    };
    (verdict.outcome(class), learnt)
}

/// A plain packet: maybe a host-gw packet from a remote pod for a local pod.
#[inline(never)]
fn plain_in(ctx: &TcContext, cfg: &Config6, info: &Ipv6Info, learnt: &mut Learnt) -> Verdict {
    // Read before the checks: a change while they run retires what they decide.
    let generation = memo::generation_for(info, DIR_IN, crate::memo::agent_generation());
    if let Some(reason) = decide_receive(cfg, info, &mut learnt.nat_guard) {
        return Verdict::pass(reason);
    }
    if cfg.flags & CFG6_ROUTED_RX == 0 {
        return Verdict::pass(Reason::PassRoutedRxOff);
    }
    let mut mtu = 0;
    let route = route_to_pod(ctx, info, &mut mtu);
    if route == Fib6::Failed {
        return Verdict::pass(Reason::PassFibFailed);
    }
    memo::remember_delivery(info, &route, mtu, generation, None);
    deliver(ctx, info, route, Reason::FastDeliver6)
}

/// VXLAN over IPv6 to our public IPv6 and port (the outer packet in `s.outer`).
#[inline(never)]
fn vxlan_in(ctx: &TcContext, cfg: &Config6, s: &mut Scratch6, learnt: &mut Learnt) -> Verdict {
    // Read before the checks: a change while they run retires what they decide (the learnt
    // part once the inner packet is known, before its NAT-guard and kernel-flow checks).
    let agent = crate::memo::agent_generation();
    let Some(end) = vxlan::inner_end(ctx, cfg, &s.outer) else {
        return Verdict::pass(Reason::PassVxlanMismatch);
    };
    if let Some(reason) = read_inner(ctx, end, &mut s.inner) {
        return Verdict::pass(reason);
    }
    let info = &s.inner;
    let generation = memo::generation_for(info, DIR_IN, agent);
    let refused = decide_receive(cfg, info, &mut learnt.nat_guard);
    if cfg.flags & CFG6_VXLAN_RX == 0 {
        return Verdict::pass(Reason::PassVxlanRxOff);
    }
    if node_flags(&s.outer.src) & NODE_F_VXLAN == 0 {
        return Verdict::pass(Reason::PassUnknownPeer);
    }
    if let Some(reason) = refused {
        return Verdict::pass(reason);
    }
    let mut mtu = 0;
    let route = route_to_pod(ctx, info, &mut mtu);
    if crate::deliver::vxlan_is_the_kernels(ctx, info.next_hdr, route.reaches_pod_port()) {
        // Left to the kernel's VXLAN receive, as for IPv4.
        learnt.kernel_flow = hand_to_kernel(info);
        return Verdict::pass(Reason::PassGso);
    }
    if route == Fib6::Failed {
        return Verdict::pass(Reason::PassFibFailed);
    }
    if let Err(reason) = vxlan::decap(ctx) {
        return Verdict::pass(reason);
    }
    memo::remember_delivery(info, &route, mtu, generation, Some(&s.outer.src));
    deliver(ctx, info, route, Reason::FastDeliverVxlan6)
}

/// `tc_to_netdev` for an IPv6 frame that is not the fast path's own
/// (`netdev::own_packet`): records kernel flows (plain, or inside `flannel-v6.<VNI>`'s VXLAN)
/// and says whether one was learnt.
#[inline(never)]
pub fn to_netdev(ctx: &TcContext) -> Option<(Outcome, bool)> {
    ctx.pull_headers(PULL_LEN);
    let Some(s) = scratch() else {
        return Some((
            Verdict::pass(Reason::PassNotConfigured).outcome(parse::classify(ctx)),
            false,
        ));
    };
    let (class, refused) = read_frame(ctx, &mut s.outer);
    let Some(cfg) = config() else {
        return Some((Verdict::pass(Reason::PassNotIpv4).outcome(class), false));
    };
    if let Some(reason) = refused {
        return Some((Verdict::pass(reason).outcome(class), false));
    }
    let info = &s.outer;
    let learnt = if info.src == cfg.public_ip
        && info.next_hdr == proto::UDP
        && u16::from_be_bytes(info.dport) == cfg.vxlan_port
        && info.l4 == ETH_HDR_LEN + IPV6_HDR_LEN
    {
        // flannel-v6.<VNI>'s VXLAN: the inner packet went through the kernel.
        vxlan::payload_end(ctx, info)
            .is_some_and(|end| read_inner(ctx, end, &mut s.inner).is_none())
            && learn_kernel_flow(cfg, &s.inner)
    } else {
        learn_kernel_flow(cfg, info)
    };
    Some((Verdict::pass(Reason::PassNoRoute).outcome(class), learnt))
}
