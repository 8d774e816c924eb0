//! Measurement only, never attached by the agent: the collect_md alternative to
//! [`crate::encap`], so that the throughput comparison can put numbers on the choice
//! (`bpf_dataplane::throughput_comparison`), and the floor of an eBPF host-gw or VXLAN
//! forwarder, so that the dataplane bench can tell the fast path's own cost from what any
//! program on this path costs (`floor-ebpf-host-gw`, `floor-ebpf-vxlan`).
//!
//! `tc_bench_vxmd` (TC ingress of the pod bridge) sends a pod's packet to a VXLAN peer the
//! Cilium/Calico way: inner MACs rewritten (our VTEP MAC → the peer's), TTL decremented,
//! `bpf_skb_set_tunnel_key` (VNI, peer, TTL, zero UDP checksum) and `bpf_redirect` to a
//! metadata-mode (`external`) VXLAN device whose index is in [`FLANNEL_BENCHMD`]; the vxlan
//! driver builds the outer headers and sends them through the routing and netfilter output
//! path. Everything else is passed.

use core::mem::size_of;

use aya_ebpf::{
    bindings::{BPF_F_ZERO_CSUM_TX, TC_ACT_OK, TC_ACT_SHOT, bpf_tunnel_key},
    btf_maps::{Array, HashMap},
    helpers::{bpf_redirect, bpf_redirect_peer, bpf_skb_set_tunnel_key},
    macros::btf_map,
    programs::TcContext,
};
use flannel_common::{
    config::Config,
    programs::{BENCH_FLOOR_MAX_ENTRIES, FLOOR_PEER, FloorHop},
    route::RouteKind,
    stats::Reason,
};

use crate::{
    deliver,
    encap::{self, VXLAN_INNER_L3, VXLAN_OVERHEAD},
    ipv4::{self, Ipv4Info},
    maps,
    parse::{self, ETH_HDR_LEN, ETH_P_IP, proto, ptr_at, write_macs},
};

/// Index 0: the ifindex of the collect_md VXLAN device to redirect to.
#[btf_map]
pub static FLANNEL_BENCHMD: Array<u32, 1> = Array::new();

/// The body of `tc_bench_vxmd`.
#[inline(always)]
pub fn vxlan_md(ctx: &TcContext) -> i32 {
    let Some(cfg) = maps::config() else {
        return TC_ACT_OK;
    };
    let Some(&md_ifindex) = FLANNEL_BENCHMD.get(0) else {
        return TC_ACT_OK;
    };
    let Ok(packet) = ipv4::screen(&parse::parse(ctx)) else {
        return TC_ACT_OK;
    };
    let Some(info) = ipv4::read(ctx, &packet) else {
        return TC_ACT_OK;
    };
    if md_ifindex == 0 || info.ttl <= 1 || !cfg.is_local_pod(info.src) {
        return TC_ACT_OK;
    }
    let Some(peer) = maps::route(info.dst).copied() else {
        return TC_ACT_OK;
    };
    if peer.kind != RouteKind::Vxlan as u32 {
        return TC_ACT_OK;
    }
    if write_macs(ctx, peer.vtep_mac, cfg.vtep_mac).is_none() {
        return TC_ACT_OK;
    }
    if !ipv4::decrement_ttl(ctx, info.l3) {
        return TC_ACT_OK;
    }
    let mut key: bpf_tunnel_key = crate::zeroed();
    key.tunnel_id = peer.vni;
    key.__bindgen_anon_1.remote_ipv4 = u32::from_be_bytes(peer.public_ip);
    key.tunnel_ttl = cfg.outer_ttl;
    // SAFETY: the helper reads `key` of the size given.
    let rc = unsafe {
        bpf_skb_set_tunnel_key(
            ctx.skb.skb.cast(),
            &mut key,
            size_of::<bpf_tunnel_key>() as u32,
            BPF_F_ZERO_CSUM_TX as u64,
        )
    };
    if rc != 0 {
        return TC_ACT_OK;
    }
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(md_ifindex, 0) as i32 }
}

/// Destination IPv4 address → where `tc_bench_floor` sends it
/// (`flannel_common::programs::BENCH_FLOOR_MAP`).
#[btf_map]
pub static FLANNEL_BENCHFL: HashMap<[u8; 4], FloorHop, { BENCH_FLOOR_MAX_ENTRIES as usize }> =
    HashMap::new();

/// The body of `tc_bench_floor`: the least an eBPF forwarder does with a packet. An IPv4 frame
/// without options and with TTL > 1 whose destination is in [`FLANNEL_BENCHFL`] gets its TTL
/// decremented, is encapsulated in VXLAN when its hop says so (with the full path's own
/// encapsulation and the configuration in `FLANNEL_CONFIG`), gets the hop's MACs and is
/// redirected (out of the hop's interface, or into its veth peer's namespace). A UDP packet to
/// our address and VXLAN port is decapsulated first (no VNI or VTEP check) and its inner
/// packet forwarded so. Everything else is passed. No parsing beyond that, no counters, no
/// flow state: what the fast path does on top of this is its own cost.
#[inline(always)]
pub fn floor(ctx: &TcContext) -> i32 {
    let Some(ip) = floor_header(ctx, ETH_HDR_LEN) else {
        return TC_ACT_OK;
    };
    if let Some(cfg) = maps::config()
        && ip.dst == cfg.public_ip
        && ip.proto == proto::UDP
    {
        return floor_vxlan_in(ctx, cfg);
    }
    match floor_hop(ip.dst) {
        Some(hop) => floor_forward(ctx, &ip, &hop),
        None => TC_ACT_OK,
    }
}

/// The hop of destination `dst`, if it has one.
#[inline(always)]
fn floor_hop(dst: [u8; 4]) -> Option<FloorHop> {
    // SAFETY: the pointer comes from a successful lookup; the entry is read once.
    FLANNEL_BENCHFL
        .get_ptr(dst)
        .map(|hop| unsafe { hop.read() })
}

/// The fields of an IPv4 header without options and with TTL > 1 at `l3` that the floor
/// needs, or `None`.
#[inline(always)]
fn floor_header(ctx: &TcContext, l3: usize) -> Option<Ipv4Info> {
    // EtherType (just before `l3`), then the IPv4 header up to the destination.
    let hdr = ptr_at::<TcContext, [u8; 22]>(ctx, l3 - 2)?;
    // SAFETY: ptr_at checked the 22 bytes are readable.
    let hdr = unsafe { hdr.read_unaligned() };
    let ttl = hdr[10];
    if u16::from_be_bytes([hdr[0], hdr[1]]) != ETH_P_IP || hdr[2] != 0x45 || ttl <= 1 {
        return None;
    }
    Some(Ipv4Info {
        l3,
        l4: l3 + 20,
        tos: hdr[3],
        ttl,
        proto: hdr[11],
        check: u16::from_be_bytes([hdr[12], hdr[13]]),
        src: [hdr[14], hdr[15], hdr[16], hdr[17]],
        dst: [hdr[18], hdr[19], hdr[20], hdr[21]],
        ..Ipv4Info::default()
    })
}

/// Forwards the packet `ip` describes (at the Ethernet header's end) by `hop`.
#[inline(always)]
fn floor_forward(ctx: &TcContext, ip: &Ipv4Info, hop: &FloorHop) -> i32 {
    if hop.vxlan_peer.kind == RouteKind::Vxlan as u32 {
        let Some(cfg) = maps::config() else {
            return TC_ACT_OK;
        };
        match encap::vxlan_encapsulate(ctx, cfg, &hop.vxlan_peer, ip) {
            Ok(()) => {}
            Err(Reason::DropRewriteFailed) => return TC_ACT_SHOT,
            Err(_) => return TC_ACT_OK,
        }
        if write_macs(ctx, hop.dmac, hop.smac).is_none() {
            return TC_ACT_SHOT;
        }
    } else if write_macs(ctx, hop.dmac, hop.smac).is_none()
        || !ipv4::decrement_ttl(ctx, ETH_HDR_LEN)
    {
        return TC_ACT_OK;
    }
    // SAFETY: plain helper calls.
    unsafe {
        if hop.into_peer == FLOOR_PEER {
            bpf_redirect_peer(hop.ifindex, 0) as i32
        } else {
            bpf_redirect(hop.ifindex, 0) as i32
        }
    }
}

/// A UDP packet to our address: VXLAN to our port is decapsulated and its inner packet
/// forwarded by its hop; anything else passes.
#[inline(always)]
fn floor_vxlan_in(ctx: &TcContext, cfg: &Config) -> i32 {
    let Some(dport) = ptr_at::<TcContext, [u8; 2]>(ctx, ETH_HDR_LEN + 22) else {
        return TC_ACT_OK;
    };
    // SAFETY: ptr_at checked the 2 bytes are readable.
    if u16::from_be_bytes(unsafe { dport.read_unaligned() }) != cfg.vxlan_port {
        return TC_ACT_OK;
    }
    let Some(inner) = floor_header(ctx, VXLAN_INNER_L3) else {
        return TC_ACT_OK;
    };
    let Some(hop) = floor_hop(inner.dst) else {
        return TC_ACT_OK;
    };
    if deliver::decap(ctx, VXLAN_OVERHEAD).is_err() {
        return TC_ACT_OK;
    }
    let inner = Ipv4Info {
        l3: ETH_HDR_LEN,
        l4: ETH_HDR_LEN + 20,
        ..inner
    };
    match floor_forward(ctx, &inner, &hop) {
        // Decapsulated: it cannot go back unchanged.
        TC_ACT_OK => TC_ACT_SHOT,
        action => action,
    }
}
