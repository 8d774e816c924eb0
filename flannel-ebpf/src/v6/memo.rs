//! Remembered per-flow decisions for IPv6 ([`flannel_common::memo`], [`FLANNEL_MEMO6`]): the
//! IPv6 twin of [`crate::memo`], for host-gw and VXLAN over IPv6.
//!
//! The full checks ([`super::from_bridge`], [`super::from_netdev`]) remember what they did with
//! a TCP or UDP flow's packet when the kernel's FIB resolved the next hop (and, on delivery,
//! the pod's bridge port is known); the short paths here take the next packets of that flow
//! with one lookup instead of the route, NAT-guard, kernel-flow and node lookups and the
//! `bpf_fib_lookup`. What the packet says is still checked on every packet as the full checks
//! check it (the same parser and screen: no extension headers, hop limit > 1, the length
//! against the MTU; for VXLAN the outer header to our address and port, our VNI and VTEP
//! MAC, an IPv6 inner frame, and the peer the memo was made for), and the memo must be of
//! the current generation and at most `HOP_TTL_TICKS` (up to a second) old. Anything else
//! falls through to the full checks, which decide as if there were no memo. GSO packets are
//! not encapsulated here, as on the full path ([`super::vxlan`]).

use aya_ebpf::{
    bindings::TC_ACT_SHOT, btf_maps::LruHashMap, helpers::bpf_redirect, macros::btf_map,
    programs::TcContext,
};
use flannel_common::{
    config::FASTPATH_MARK,
    hops::Hop,
    memo::{
        DIR_IN, DIR_OUT, FlowMemo6, MEMO6_MAX_ENTRIES, MemoKey6, Standing, TUNNEL_NONE,
        TUNNEL_VXLAN, learn_slot6,
    },
    route::{RemoteEntry6, RouteKind},
    stats::Reason,
    v6::{CFG6_VXLAN_RX, Config6, VXLAN6_OVERHEAD},
};

use super::{
    decide,
    fib::{self, Fib6},
    info::{self, Ipv6Info},
    scratch, vxlan,
};
use crate::{
    bridge::Outcome,
    fib::{gso_size, ingress_ifindex},
    memo::restamp,
    parse::{self, ETH_HDR_LEN, ETH_P_IPV6, IPV6_HDR_LEN, PacketCtx as _, ptr_at, ptr_at_mut},
};

/// IPv6 flows → the decision taken for them (`flannel_common::memo::MEMO6`).
#[btf_map]
pub static FLANNEL_MEMO6: LruHashMap<MemoKey6, FlowMemo6, { MEMO6_MAX_ENTRIES as usize }> =
    LruHashMap::new();

#[inline(always)]
fn key(info: &Ipv6Info, dir: u8) -> MemoKey6 {
    let flow = if dir == DIR_IN {
        decide::flow_key_incoming(info)
    } else {
        decide::flow_key_outgoing(info)
    };
    MemoKey6::new(&flow, dir)
}

/// The current generation of `info`'s flow in direction `dir`, with the agent's counter
/// `agent` ([`crate::memo::agent_generation`], read before the checks).
#[inline(always)]
pub fn generation_for(info: &Ipv6Info, dir: u8, agent: u64) -> u64 {
    crate::memo::generation_of(learn_slot_of(info, dir), agent)
}

/// [`crate::memo::learn_slot_of`] for IPv6: the learn slot of the remote side of `info`'s
/// memo key, without the 40-byte key on the stack (test
/// `v6::decide::tests::a_flows_memo_and_its_flow_table_keys_share_a_learn_slot`).
#[inline(always)]
pub(crate) fn learn_slot_of(info: &Ipv6Info, dir: u8) -> u32 {
    if dir == DIR_IN {
        learn_slot6(&info.src, info.sport, info.next_hdr)
    } else {
        learn_slot6(&info.dst, info.dport, info.next_hdr)
    }
}

/// The memo of a decision taken at `generation` to send `info`'s flow by `route` out of the
/// interface `out` gives for the route's output interface and next-hop MAC, while packets fit
/// `mtu`; `None` unless the flow is TCP or UDP, the route resolved the next hop and gave an
/// MTU, and `out` knows the interface.
#[inline(always)]
fn resolved(
    info: &Ipv6Info,
    route: &Fib6,
    mtu: u16,
    generation: u64,
    out: impl FnOnce(u32, [u8; 6]) -> Option<u32>,
) -> Option<FlowMemo6> {
    let Fib6::Resolved {
        ifindex,
        smac,
        dmac,
    } = *route
    else {
        return None;
    };
    if !info.has_ports() || mtu == 0 {
        return None;
    }
    Some(FlowMemo6 {
        ifindex: out(ifindex, dmac)?,
        mtu,
        tunnel: TUNNEL_NONE,
        _pad: 0,
        smac,
        dmac,
        peer: crate::zeroed(),
        vni: 0,
        vtep_mac: crate::zeroed(),
        _pad2: [0; 2],
        generation,
        checked_at: crate::now_ticks(),
    })
}

/// Remembers that `tc_from_bridge` sent `info`'s flow by `route` (when it resolved the next
/// hop and gave an MTU, `mtu`: for VXLAN the room inner packets have), plain or in VXLAN to
/// `vxlan` (TCP and UDP flows only). A BPF subprogram of its own: the memo and its key stay
/// off the frame of its caller, which goes on to build the VXLAN headers.
#[inline(never)]
pub fn remember_transmit(
    info: &Ipv6Info,
    route: &Fib6,
    mtu: u16,
    generation: u64,
    vxlan: Option<&RemoteEntry6>,
) {
    if let Some(mut memo) = resolved(info, route, mtu, generation, |ifindex, _| Some(ifindex)) {
        if let Some(peer) = vxlan {
            memo.tunnel = TUNNEL_VXLAN;
            memo.peer = peer.public_ip;
            memo.vni = peer.vni;
            memo.vtep_mac = peer.vtep_mac;
        }
        let _ = FLANNEL_MEMO6.insert(key(info, DIR_OUT), memo, 0);
    }
}

/// Remembers that `tc_from_netdev` delivered `info`'s flow into a local pod's namespace (only
/// those: the route resolved the pod's MAC and its port is known), plain or decapsulated from
/// VXLAN sent by `vxlan_from` (TCP and UDP flows only). A BPF subprogram of its own, as
/// [`remember_transmit`].
#[inline(never)]
pub fn remember_delivery(
    info: &Ipv6Info,
    route: &Fib6,
    mtu: u16,
    generation: u64,
    vxlan_from: Option<&[u8; 16]>,
) {
    if let Some(mut memo) = resolved(info, route, mtu, generation, crate::pods::port) {
        if let Some(peer) = vxlan_from {
            memo.tunnel = TUNNEL_VXLAN;
            memo.peer = *peer;
        }
        let _ = FLANNEL_MEMO6.insert(key(info, DIR_IN), memo, 0);
    }
}

/// The source and destination of an IPv6 frame, read in place without parsing: a cheap
/// first filter. The references point into the packet: they are used before anything
/// changes it.
#[inline(always)]
fn addrs(ctx: &TcContext) -> Option<(&[u8; 16], &[u8; 16])> {
    let hdr = ptr_at::<TcContext, [u8; 42]>(ctx, 12)?;
    // SAFETY: ptr_at checked the 42 bytes (EtherType and the IPv6 header up to the end of the
    // destination) are readable; nothing changes them while the references are used.
    let hdr = unsafe { &*hdr };
    if u16::from_be_bytes([hdr[0], hdr[1]]) != ETH_P_IPV6 {
        return None;
    }
    Some((hdr[10..26].try_into().ok()?, hdr[26..42].try_into().ok()?))
}

/// Parses the packet (or, given the end of a VXLAN packet's inner frame, its inner IPv6
/// packet) into `info` if it is a screened IPv6 TCP or UDP packet with hop limit > 1; its
/// class.
#[inline(always)]
fn candidate(ctx: &TcContext, inner_end: Option<usize>, info: &mut Ipv6Info) -> Option<Reason> {
    let parsed = match inner_end {
        None => parse::parse(ctx),
        Some(end) => parse::parse_ipv6_at(ctx, vxlan::INNER_L3, end),
    };
    let packet = info::screen(&parsed).ok()?;
    if (packet.class != Reason::Ipv6Tcp && packet.class != Reason::Ipv6Udp)
        || !info::read_into(ctx, &packet, info)
        || info.hop_limit <= 1
    {
        return None;
    }
    Some(packet.class)
}

/// Copies the memo of `info`'s flow in direction `dir` to `memo` if it may decide for this
/// packet now: a usable one, or one only too old that a route lookup made now confirms
/// ([`confirmed`]), whose stamp then becomes now ([`restamp`]).
#[inline(always)]
fn usable(ctx: &TcContext, cfg: &Config6, info: &Ipv6Info, dir: u8, memo: &mut FlowMemo6) -> bool {
    let generation = generation_for(info, dir, crate::memo::agent_generation());
    let Some(found) = FLANNEL_MEMO6.get_ptr_mut(key(info, dir)) else {
        return false;
    };
    // SAFETY: the pointer comes from a successful lookup of an 8-byte aligned map value; the
    // entry is read once.
    unsafe { crate::copy_words(memo, found) };
    let gso = gso_size(ctx);
    let len = if gso == 0 {
        IPV6_HDR_LEN as u32 + u32::from(info.payload_len)
    } else {
        IPV6_HDR_LEN as u32 + u32::from(info.l4_hdr_len) + gso
    };
    let Ok(len) = u16::try_from(len) else {
        return false;
    };
    let now = crate::now_ticks();
    match memo.standing(now, generation, len) {
        Standing::Usable => true,
        Standing::Old if confirmed(ctx, cfg, info, dir, memo) => {
            // SAFETY: the pointer comes from the successful lookup above.
            unsafe { restamp(ctx, dir, core::ptr::addr_of_mut!((*found).checked_at), now) };
            true
        }
        Standing::Old | Standing::Unusable => false,
    }
}

/// Whether the route `memo` (of `info`'s flow in direction `dir`) came from, looked up now,
/// still says what the memo says ([`FlowMemo6::confirmed_by`]): the local pod's route for a
/// delivery, the remote pod's for host-gw, the peer's (with the room VXLAN leaves now) for
/// VXLAN. A BPF subprogram of its own.
#[inline(never)]
fn confirmed(ctx: &TcContext, cfg: &Config6, info: &Ipv6Info, dir: u8, memo: &FlowMemo6) -> bool {
    let mut mtu = 0;
    let mut tunnel_mtu = 0;
    let route = if dir == DIR_IN {
        fib::lookup(ctx, ingress_ifindex(ctx), info, &mut mtu)
    } else if memo.tunnel == TUNNEL_NONE {
        fib::lookup(ctx, crate::pods::routing_iif(ctx), info, &mut mtu)
    } else {
        let Some(room) = vxlan::room(ctx, cfg) else {
            return false;
        };
        // And the room on the path to the peer (see `vxlan::encap`), checked for the memo's.
        let mut path_mtu = memo.mtu.saturating_add(VXLAN6_OVERHEAD as u16);
        let route = fib::lookup_output(ctx, cfg, &memo.peer, &mut path_mtu);
        tunnel_mtu = room.min(path_mtu.saturating_sub(VXLAN6_OVERHEAD as u16));
        route
    };
    let Fib6::Resolved {
        ifindex,
        smac,
        dmac,
    } = route
    else {
        return false;
    };
    let hop = Hop {
        ifindex,
        smac,
        dmac,
        mtu,
        _pad: crate::zeroed(),
        checked_at: 0,
    };
    memo.confirmed_by(dir, &hop, tunnel_mtu)
}

/// Writes the memo's MACs and the decremented hop limit of the IPv6 header right after the
/// Ethernet header; `None` (nothing written) if the headers are not writable.
#[inline(always)]
fn rewrite(ctx: &TcContext, hop_limit: u8, memo: &FlowMemo6) -> Option<()> {
    let hop = ptr_at_mut::<TcContext, [u8; 1]>(ctx, ETH_HDR_LEN + 7)?;
    parse::write_macs(ctx, memo.dmac, memo.smac)?;
    // SAFETY: ptr_at_mut checked the byte lies in the packet.
    unsafe { hop.write_unaligned([hop_limit.wrapping_sub(1)]) };
    Some(())
}

/// A packet the short path changed but could not finish: dropped, as the full checks drop it.
#[inline(always)]
fn dropped(class: Reason) -> Outcome {
    Outcome {
        action: TC_ACT_SHOT,
        class,
        verdict: Reason::DropRewriteFailed,
    }
}

/// `tc_from_bridge`: a local pod's IPv6 packet of a remembered host-gw or VXLAN flow, sent to
/// the peer. `None`: not such a packet (the full checks decide). A BPF subprogram of its own;
/// what it keeps lives in the per-CPU scratch entry (the programs' stack is small).
#[inline(never)]
pub fn transmit(ctx: &TcContext) -> Option<Outcome> {
    let cfg = super::config()?;
    let (src, dst) = addrs(ctx)?;
    if !cfg.is_local_pod(src) || !cfg.in_cluster(dst) {
        return None;
    }
    let s = scratch()?;
    let class = candidate(ctx, None, &mut s.outer)?;
    if !usable(ctx, cfg, &s.outer, DIR_OUT, &mut s.memo) {
        return None;
    }
    let verdict = if s.memo.tunnel == TUNNEL_VXLAN {
        vxlan::encapsulable(ctx, &s.outer).ok()?;
        s.peer = RemoteEntry6 {
            kind: RouteKind::Vxlan as u32,
            public_ip: s.memo.peer,
            vni: s.memo.vni,
            vtep_mac: s.memo.vtep_mac,
            ..RemoteEntry6::default()
        };
        match vxlan::push(
            ctx,
            cfg,
            &s.peer,
            s.outer.hop_limit,
            &mut s.inner_hdr,
            &mut s.headers,
        ) {
            Ok(()) => {}
            Err(Reason::DropRewriteFailed) => return Some(dropped(class)),
            // Unchanged: the full checks try again.
            Err(_) => return None,
        }
        if parse::write_macs(ctx, s.memo.dmac, s.memo.smac).is_none() {
            return Some(dropped(class));
        }
        Reason::FastVxlan6
    } else {
        rewrite(ctx, s.outer.hop_limit, &s.memo)?;
        Reason::FastHostGw6
    };
    ctx.set_mark(FASTPATH_MARK);
    Some(Outcome {
        // SAFETY: plain helper call.
        action: unsafe { bpf_redirect(s.memo.ifindex, 0) } as i32,
        class,
        verdict,
    })
}

/// `tc_from_netdev`: an IPv6 packet of a remembered flow to a local pod, plain or in VXLAN
/// over IPv6, delivered into the pod's namespace. `None`: not such a packet (the full checks
/// decide). A BPF subprogram of its own, keeping what it needs in the scratch entry.
#[inline(never)]
pub fn deliver(ctx: &TcContext) -> Option<Outcome> {
    let cfg = super::config()?;
    let (src, dst) = addrs(ctx)?;
    if *dst == cfg.public_ip {
        return deliver_vxlan(ctx, cfg, src);
    }
    if !cfg.is_local_pod(dst) {
        return None;
    }
    let s = scratch()?;
    let class = candidate(ctx, None, &mut s.outer)?;
    if !usable(ctx, cfg, &s.outer, DIR_IN, &mut s.memo) || !s.memo.came_through(TUNNEL_NONE, src) {
        return None;
    }
    rewrite(ctx, s.outer.hop_limit, &s.memo)?;
    Some(Outcome {
        action: crate::pods::into_pod(s.memo.ifindex, ctx.packet_len() as u64),
        class,
        verdict: Reason::FastDeliver6,
    })
}

/// [`deliver`] for a packet to our public IPv6 from `from`: VXLAN to our port with our VNI
/// and VTEP MAC, checked as the full checks do, its inner packet screened, then decapsulated
/// by the memo of its flow (`from` points into the packet: compared before decapsulation).
#[inline(always)]
fn deliver_vxlan(ctx: &TcContext, cfg: &Config6, from: &[u8; 16]) -> Option<Outcome> {
    if cfg.flags & CFG6_VXLAN_RX == 0 || cfg.vni == 0 {
        return None;
    }
    let s = scratch()?;
    let class = candidate(ctx, None, &mut s.outer)?;
    if class != Reason::Ipv6Udp || u16::from_be_bytes(s.outer.dport) != cfg.vxlan_port {
        return None;
    }
    let end = vxlan::inner_end(ctx, cfg, &s.outer)?;
    candidate(ctx, Some(end), &mut s.inner)?;
    // A memo delivers into the pod.
    if crate::deliver::vxlan_is_the_kernels(ctx, s.inner.next_hdr, true) {
        return None;
    }
    if !cfg.is_local_pod(&s.inner.dst)
        || !usable(ctx, cfg, &s.inner, DIR_IN, &mut s.memo)
        || !s.memo.came_through(TUNNEL_VXLAN, from)
    {
        return None;
    }
    vxlan::decap(ctx).ok()?;
    // The packet changed: from here on it goes into the pod or is dropped.
    Some(match rewrite(ctx, s.inner.hop_limit, &s.memo) {
        Some(()) => Outcome {
            action: crate::pods::into_pod(s.memo.ifindex, ctx.packet_len() as u64),
            class,
            verdict: Reason::FastDeliverVxlan6,
        },
        None => dropped(class),
    })
}
