//! Measurement only, never attached by the agent: the collect_md alternative to
//! [`crate::encap`], so that the throughput comparison can put numbers on the choice
//! (`bpf_dataplane::throughput_comparison`).
//!
//! `tc_bench_vxmd` (TC ingress of the pod bridge) sends a pod's packet to a VXLAN peer the
//! Cilium/Calico way: inner MACs rewritten (our VTEP MAC → the peer's), TTL decremented,
//! `bpf_skb_set_tunnel_key` (VNI, peer, TTL, zero UDP checksum) and `bpf_redirect` to a
//! metadata-mode (`external`) VXLAN device whose index is in [`FLANNEL_BENCHMD`]; the vxlan
//! driver builds the outer headers and sends them through the routing and netfilter output
//! path. Everything else is passed.

use core::mem::{size_of, zeroed};

use aya_ebpf::{
    bindings::{BPF_F_ZERO_CSUM_TX, TC_ACT_OK, bpf_tunnel_key},
    btf_maps::Array,
    helpers::{bpf_redirect, bpf_skb_set_tunnel_key},
    macros::btf_map,
    programs::TcContext,
};
use flannel_common::route::RouteKind;

use crate::{
    ipv4, maps,
    parse::{self, write_macs},
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
    // SAFETY: a plain C struct; all-zero is valid.
    let mut key: bpf_tunnel_key = unsafe { zeroed() };
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
