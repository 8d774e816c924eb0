//! Remembered per-flow decisions (see [`flannel_common::memo`]): the short path at the top of
//! `tc_from_netdev` and `tc_from_bridge` that carries a packet of a remembered flow out as its
//! flow's first packet was, and the calls the full checks make to remember a flow.
//!
//! The short path parses the packet with the same parser and screens it the same way, so
//! a malformed, fragmented or option-carrying packet never takes it; a miss (no memo, a stale or
//! retired one, TTL 1, a packet longer than the MTU, headers not in the linear part) falls
//! through to the full checks, which pull the headers in and decide as if there were no memo.
//! A tunnel packet takes it only with the outer header the full checks want (IPv4 without
//! options or fragments to our address; for VXLAN our port, VNI and VTEP MAC and an IPv4
//! inner frame; for IPIP not a GSO packet while a kernel IPIP device receives those) and
//! from the peer its flow's memo was made for; it is then decapsulated (or, on transmit,
//! encapsulated) by the same code as on the full path. An encapsulation or decapsulation the
//! kernel refuses (`bpf_skb_adjust_room`) leaves the packet unchanged and falls through too;
//! a header write that fails after it drops the packet, as on the full path.
//! It runs before the programs' `pull_headers`: the packets it takes (the stack's own TCP and
//! UDP) carry their headers in the linear part, and their linearity need not be checked twice.

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    btf_maps::{Array, LruHashMap},
    helpers::bpf_redirect,
    macros::btf_map,
    programs::TcContext,
};
use flannel_common::{
    config::{CFG_VXLAN_RX, Config, FASTPATH_MARK},
    memo::{
        DIR_IN, DIR_OUT, FlowMemo, GEN_AGENT, LEARN_GEN_SLOTS, MEMO_GEN_SLOTS, MEMO_ROUTES,
        MEMO4_MAX_ENTRIES, MemoKey, Standing, TUNNEL_IPIP, TUNNEL_NONE, TUNNEL_VXLAN, generation,
        learn_slot,
    },
    route::RemoteEntry,
    stats::Reason,
};

use crate::{
    bridge::Outcome,
    decide, deliver,
    encap::{self, IPIP_INNER_L3, IPIP_OVERHEAD, IPPROTO_IPIP, VXLAN_INNER_L3, VXLAN_OVERHEAD},
    fib,
    ipv4::{self, Ipv4Info},
    maps,
    parse::{self, ETH_HDR_LEN, PacketCtx as _, proto},
};

/// Flows → the decision taken for them (`flannel_common::memo::MEMO4`).
#[btf_map]
pub static FLANNEL_MEMO4: LruHashMap<MemoKey, FlowMemo, { MEMO4_MAX_ENTRIES as usize }> =
    LruHashMap::new();

/// The agent's generation counter and host-gw switch (`flannel_common::memo::MEMO_GEN`).
#[btf_map]
pub static FLANNEL_MEMOGEN: Array<u64, { MEMO_GEN_SLOTS as usize }> = Array::new();

/// Per remote-endpoint slot, the learners' generation counters
/// (`flannel_common::memo::LEARN_GEN`).
#[btf_map]
pub static FLANNEL_LRNGEN: Array<u64, { LEARN_GEN_SLOTS as usize }> = Array::new();

/// The agent's generation counter: read before the checks of a decision that will be
/// remembered, at least before the first read of a map the agent writes.
#[inline(always)]
pub fn agent_generation() -> u64 {
    FLANNEL_MEMOGEN.get(GEN_AGENT).copied().unwrap_or(0)
}

/// The generation of the flows whose remote endpoint falls in `slot` (a `learn_slot` of
/// `flannel_common`), with the agent's counter `agent`: read before the NAT-guard and
/// kernel-flow lookups of a decision that will be remembered.
#[inline(always)]
pub fn generation_of(slot: u32, agent: u64) -> u64 {
    let learnt = FLANNEL_LRNGEN.get(slot).copied().unwrap_or(0);
    generation(learnt, agent)
}

/// The current generation of `info`'s flow in direction `dir`, with the agent's counter
/// `agent` (see [`agent_generation`]).
#[inline(always)]
pub fn generation_for(info: &Ipv4Info, dir: u8, agent: u64) -> u64 {
    generation_of(learn_slot_of(info, dir), agent)
}

/// The learn slot of `info`'s remote endpoint in direction `dir` (the remote side of its
/// memo key), for the generation a memo is stamped with and checked against alike. Computed
/// from the packet's fields, not from a key on the stack: the full checks' call chains are
/// near the stack limit. It is the slot of the flow's kernel-flow and NAT-guard keys too
/// (test `decide::tests::a_flows_memo_and_its_flow_table_keys_share_a_learn_slot`).
#[inline(always)]
pub(crate) fn learn_slot_of(info: &Ipv4Info, dir: u8) -> u32 {
    if dir == DIR_IN {
        learn_slot(info.src, info.sport, info.proto)
    } else {
        learn_slot(info.dst, info.dport, info.proto)
    }
}

/// The current generation of `info`'s flow in direction `dir`: read before the checks whose
/// decision is remembered.
#[inline(always)]
pub fn current_for(info: &Ipv4Info, dir: u8) -> u64 {
    generation_for(info, dir, agent_generation())
}

/// Retires the memos of the flows whose remote endpoint falls in `slot`: called by the
/// learners after they added a NAT-guard or kernel-flow entry for such an endpoint (an atomic
/// add after the map update; on x86 a locked instruction, a full barrier).
#[inline(always)]
pub fn retire(slot: u32) {
    if let Some(counter) = FLANNEL_LRNGEN.get_ptr_mut(slot) {
        // SAFETY: the pointer comes from a successful lookup of an 8-byte aligned u64 slot.
        unsafe { atomic_add(counter) };
    }
}

/// `*slot += 1` as one atomic instruction (BPF `lock xadd`; the bpf target has no atomic
/// types, so the intrinsic; on the host, for the unit tests and clippy, `AtomicU64`).
///
/// # Safety
/// `slot` must point to a live, 8-byte aligned `u64`.
#[inline(always)]
unsafe fn atomic_add(slot: *mut u64) {
    #[cfg(target_arch = "bpf")]
    // SAFETY: as the caller promised.
    unsafe {
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::SeqCst }>(
            slot, 1,
        );
    }
    #[cfg(not(target_arch = "bpf"))]
    // SAFETY: as the caller promised.
    unsafe {
        core::sync::atomic::AtomicU64::from_ptr(slot)
            .fetch_add(1, core::sync::atomic::Ordering::SeqCst);
    }
}

/// Remembers `memo` (see [`memo`]) for the flow of `info` in direction `dir` (TCP and UDP
/// flows only).
#[inline(always)]
pub fn remember(info: &Ipv4Info, dir: u8, memo: FlowMemo) {
    if info.proto != proto::TCP && info.proto != proto::UDP {
        return;
    }
    let _ = FLANNEL_MEMO4.insert(key(info, dir), memo, 0);
}

/// A memo: packets go to `ifindex` with these MACs while they fit `mtu`; `generation` is the
/// one read before the checks that decided so.
#[inline(always)]
pub fn memo(ifindex: u32, smac: [u8; 6], dmac: [u8; 6], mtu: u16, generation: u64) -> FlowMemo {
    FlowMemo {
        ifindex,
        mtu,
        tunnel: TUNNEL_NONE,
        _pad: 0,
        smac,
        dmac,
        peer: [0; 4],
        vni: 0,
        vtep_mac: crate::zeroed(),
        _pad2: crate::zeroed(),
        generation,
        checked_at: crate::now_ticks(),
    }
}

/// `memo` for packets that came through `tunnel` from the node `peer`.
#[inline(always)]
pub fn from_peer(memo: FlowMemo, tunnel: u8, peer: [u8; 4]) -> FlowMemo {
    FlowMemo {
        tunnel,
        peer,
        ..memo
    }
}

/// `memo` for packets sent to `peer`: encapsulated in `tunnel`, or plain ([`TUNNEL_NONE`],
/// host-gw: the peer names the remembered route the memo came from).
#[inline(always)]
pub fn to_peer(memo: FlowMemo, tunnel: u8, peer: &RemoteEntry) -> FlowMemo {
    FlowMemo {
        vni: peer.vni,
        vtep_mac: peer.vtep_mac,
        ..from_peer(memo, tunnel, peer.public_ip)
    }
}

#[inline(always)]
fn key(info: &Ipv4Info, dir: u8) -> MemoKey {
    let flow = if dir == DIR_IN {
        decide::flow_key_incoming(info)
    } else {
        decide::flow_key_outgoing(info)
    };
    MemoKey::new(&flow, dir)
}

/// A screened IPv4 TCP/UDP packet with TTL > 1 and its class, or `None`.
#[inline(always)]
fn candidate(ctx: &TcContext) -> Option<(Ipv4Info, Reason)> {
    let (info, class) = screened(ctx, &parse::parse(ctx))?;
    (info.ttl > 1).then_some((info, class))
}

/// `parsed` if it is a screened IPv4 TCP/UDP packet: what it says and its class.
#[inline(always)]
fn screened(ctx: &TcContext, parsed: &Result<parse::Packet, Reason>) -> Option<(Ipv4Info, Reason)> {
    let packet = ipv4::screen(parsed).ok()?;
    if packet.class != Reason::Ipv4Tcp && packet.class != Reason::Ipv4Udp {
        return None;
    }
    Some((ipv4::read(ctx, &packet)?, packet.class))
}

/// The memo of `info`'s flow in direction `dir` if it may decide for this packet now: a
/// usable one, or one only too old that its remembered route confirms ([`confirmed`]), whose
/// stamp then becomes that route's ([`restamp`]).
#[inline(always)]
fn usable(ctx: &TcContext, cfg: &Config, info: &Ipv4Info, dir: u8) -> Option<FlowMemo> {
    let generation = generation_for(info, dir, agent_generation());
    let entry = FLANNEL_MEMO4.get_ptr_mut(key(info, dir))?;
    // SAFETY: the pointer comes from a successful lookup; the entry is read once.
    let memo = unsafe { entry.read() };
    let gso = fib::gso_size(ctx);
    let len = if gso == 0 {
        u32::from(info.tot_len)
    } else {
        info.segment_len(gso)
    };
    let len = u16::try_from(len).ok()?;
    let now = crate::now_ticks();
    match memo.standing(now, generation, len) {
        Standing::Usable => Some(memo),
        Standing::Old => {
            let checked_at = confirmed(ctx, cfg, info.dst, dir, &memo, now)?;
            // SAFETY: the pointer comes from the successful lookup above.
            unsafe {
                restamp(
                    ctx,
                    dir,
                    core::ptr::addr_of_mut!((*entry).checked_at),
                    checked_at,
                )
            };
            Some(memo)
        }
        Standing::Unusable => None,
    }
}

/// Writes `checked_at` into a confirmed memo's stamp `stamp` (an element of either family's
/// memo map) in place, and counts the memo, of direction `dir`, as confirmed
/// ([`Reason::MemoConfirmed`]) in the counters of the program that used it.
///
/// One aligned 8-byte store. An LRU map reuses a deleted element at once, so the element may
/// by then hold another flow's memo, made a moment ago: that memo's stamp can move by at most
/// the tick or so since, and its generation, which alone says whether its checks still
/// hold, is not touched.
///
/// # Safety
/// `stamp` must point into a map element returned by a lookup during this program run.
#[inline(always)]
pub(crate) unsafe fn restamp(ctx: &TcContext, dir: u8, stamp: *mut u64, checked_at: u64) {
    // SAFETY: as the caller promised (map elements stay allocated during the run).
    unsafe { stamp.write_volatile(checked_at) };
    let counters = if dir == DIR_IN {
        &maps::FLANNEL_CNT_FND
    } else {
        &maps::FLANNEL_CNT_FBR
    };
    crate::stats::count(counters, Reason::MemoConfirmed, ctx.len() as u64);
}

/// The time of the remembered route lookup ([`crate::hops`]) a memo of a flow to `dst` in
/// direction `dir`, at its flow's current generation, was made from, if that lookup is fresh
/// at `now` and still says what the memo says ([`FlowMemo::confirmed_by`]; for a tunnel, with
/// the external interface's MTU as it is now). No lookup of its own: a stale or missing
/// answer leaves the packet to the full checks, which look the route up again.
#[inline(always)]
fn confirmed(
    ctx: &TcContext,
    cfg: &Config,
    dst: [u8; 4],
    dir: u8,
    memo: &FlowMemo,
    now: u64,
) -> Option<u64> {
    let hop = maps::FLANNEL_HOPS4.get_ptr(memo.hop_key(dir, dst))?;
    // SAFETY: the pointer comes from a successful lookup; the entry is read once.
    let hop = unsafe { hop.read() };
    if !hop.usable(now, 0) {
        return None;
    }
    let tunnel_mtu = match (dir, memo.tunnel) {
        (DIR_OUT, TUNNEL_VXLAN) => encap::device_room(ctx, cfg, VXLAN_OVERHEAD)?,
        (DIR_OUT, TUNNEL_IPIP) => encap::device_room(ctx, cfg, IPIP_OVERHEAD)?,
        _ => 0,
    };
    memo.confirmed_by(dir, &hop, tunnel_mtu)
        .then_some(hop.checked_at)
}

/// Writes the memo's MACs and decrements the TTL; `None` (nothing written) if the headers are
/// not writable. (Both lie within the IPv4 header the parser read: if the MACs can be written,
/// so can the TTL.)
#[inline(always)]
fn rewrite(ctx: &TcContext, info: &Ipv4Info, memo: &FlowMemo) -> Option<()> {
    parse::write_macs(ctx, memo.dmac, memo.smac)?;
    ipv4::decrement_ttl(ctx, info.l3).then_some(())
}

/// The source and destination of an IPv4 frame, read without parsing (the addresses sit at
/// fixed offsets whatever the options): a cheap first filter before [`candidate`].
#[inline(always)]
fn addrs(ctx: &TcContext) -> Option<([u8; 4], [u8; 4])> {
    let hdr = parse::ptr_at::<TcContext, [u8; 22]>(ctx, 12)?;
    // SAFETY: ptr_at checked the 22 bytes (EtherType and the IPv4 header up to the
    // destination) are readable.
    let hdr = unsafe { hdr.read_unaligned() };
    if u16::from_be_bytes([hdr[0], hdr[1]]) != parse::ETH_P_IP {
        return None;
    }
    Some((
        [hdr[14], hdr[15], hdr[16], hdr[17]],
        [hdr[18], hdr[19], hdr[20], hdr[21]],
    ))
}

/// `tc_from_netdev`: a packet of a remembered flow to a local pod, plain or in VXLAN,
/// delivered into the pod's namespace. `None`: not such a packet (the full checks decide). A
/// BPF subprogram of its own, so that its stack does not add to the full checks'.
#[inline(never)]
pub fn deliver(ctx: &TcContext) -> Option<Outcome> {
    let cfg = maps::config()?;
    let (src, dst) = addrs(ctx)?;
    if dst == cfg.public_ip {
        return deliver_tunnelled(ctx, cfg, src);
    }
    if !cfg.is_local_pod(dst) {
        return None;
    }
    let (info, class) = candidate(ctx)?;
    let memo = usable(ctx, cfg, &info, DIR_IN)?;
    if !memo.came_through(TUNNEL_NONE, src) {
        return None;
    }
    rewrite(ctx, &info, &memo)?;
    Some(Outcome {
        action: crate::pods::into_pod(memo.ifindex, ctx.packet_len() as u64),
        class,
        verdict: Reason::FastDeliver,
    })
}

/// [`deliver`] for a tunnel packet from `from` to our address (VXLAN or IPIP): the outer
/// headers checked as the full checks do, the inner packet screened, then decapsulated by the
/// memo of its flow.
#[inline(always)]
fn deliver_tunnelled(ctx: &TcContext, cfg: &Config, from: [u8; 4]) -> Option<Outcome> {
    let outer = parse::parse(ctx).ok()?;
    let (tunnel, inner_l3, end, overhead, verdict) = if outer.ip_proto == proto::UDP {
        if cfg.flags & CFG_VXLAN_RX == 0 {
            return None;
        }
        let (outer, _) = screened(ctx, &Ok(outer))?;
        if u16::from_be_bytes(outer.dport) != cfg.vxlan_port {
            return None;
        }
        (
            TUNNEL_VXLAN,
            VXLAN_INNER_L3,
            encap::vxlan_inner_end(ctx, cfg, &outer)?,
            VXLAN_OVERHEAD,
            Reason::FastDeliverVxlan,
        )
    } else if outer.ip_proto == IPPROTO_IPIP {
        // Without options or fragments (their own classes).
        if outer.class != Reason::Ipv4OtherProto
            || outer.l4_offset != IPIP_INNER_L3
            || deliver::ipip_is_the_kernels(ctx, cfg)
        {
            return None;
        }
        (
            TUNNEL_IPIP,
            IPIP_INNER_L3,
            outer.ip_end,
            IPIP_OVERHEAD,
            Reason::FastDeliverIpip,
        )
    } else {
        return None;
    };
    let (info, _) = screened(ctx, &parse::parse_ipv4_at(ctx, inner_l3, end))?;
    if info.ttl <= 1 || !cfg.is_local_pod(info.dst) {
        return None;
    }
    // A memo delivers into the pod.
    if tunnel == TUNNEL_VXLAN && deliver::vxlan_is_the_kernels(ctx, info.proto, true) {
        return None;
    }
    let memo = usable(ctx, cfg, &info, DIR_IN)?;
    if !memo.came_through(tunnel, from) {
        return None;
    }
    deliver::decap(ctx, overhead).ok()?;
    // The packet changed: from here on it goes into the pod or is dropped.
    let inner = Ipv4Info {
        l3: ETH_HDR_LEN,
        ..info
    };
    Some(match rewrite(ctx, &inner, &memo) {
        Some(()) => Outcome {
            action: crate::pods::into_pod(memo.ifindex, ctx.packet_len() as u64),
            class: outer.class,
            verdict,
        },
        None => dropped(outer.class),
    })
}

/// `tc_from_bridge`: a local pod's packet of a remembered host-gw, VXLAN or IPIP flow, sent to
/// the peer. `None`: not such a packet (the full checks decide). A BPF subprogram of its own.
#[inline(never)]
pub fn transmit(ctx: &TcContext) -> Option<Outcome> {
    if FLANNEL_MEMOGEN.get(MEMO_ROUTES).copied().unwrap_or(0) == 0 {
        return None;
    }
    let cfg = maps::config()?;
    let (src, dst) = addrs(ctx)?;
    if !cfg.is_local_pod(src) || !cfg.in_cluster(dst) {
        return None;
    }
    let (info, class) = candidate(ctx)?;
    let memo = usable(ctx, cfg, &info, DIR_OUT)?;
    let peer = RemoteEntry {
        kind: 0,
        flags: 0,
        public_ip: memo.peer,
        vni: memo.vni,
        vtep_mac: memo.vtep_mac,
        _pad: [0; 2],
    };
    let (encapsulated, verdict) = match memo.tunnel {
        TUNNEL_VXLAN => (
            encap::vxlan_encapsulate(ctx, cfg, &peer, &info),
            Reason::FastVxlan,
        ),
        TUNNEL_IPIP => (
            encap::ipip_encapsulate(ctx, cfg, &peer, &info, true),
            Reason::FastIpip,
        ),
        _ => {
            rewrite(ctx, &info, &memo)?;
            (Ok(()), Reason::FastHostGw)
        }
    };
    match encapsulated {
        Ok(()) => {}
        Err(Reason::DropRewriteFailed) => return Some(dropped(class)),
        // Unchanged: the full checks try again.
        Err(_) => return None,
    }
    if memo.tunnel != TUNNEL_NONE && parse::write_macs(ctx, memo.dmac, memo.smac).is_none() {
        return Some(dropped(class));
    }
    ctx.set_mark(FASTPATH_MARK);
    Some(Outcome {
        // SAFETY: plain helper call.
        action: unsafe { bpf_redirect(memo.ifindex, 0) } as i32,
        class,
        verdict,
    })
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
