//! flannel's eBPF object: the program entry points. Each is a thin wrapper over the library
//! (`flannel_ebpf::*`) so that the programs share the parser, the decisions and the counters.
//!
//! | program | attach point |
//! |---|---|
//! | `tc_from_bridge` | TC ingress of the pod bridge's (`cni0`) veth ports |
//! | `tc_from_netdev` | TC ingress of the external interface |
//! | `tc_to_netdev` | TC egress of the external interface |
//! | `xdp_from_netdev` | XDP (native mode) of the external interface |
//! | `tc_classify`, `xdp_classify` | anywhere: classification counters only |
//! | `tc_bench_vxmd` | measurement only (never attached by the agent): collect_md transmit |
//! | `tc_bench_floor` | measurement only (never attached by the agent): the least a host-gw or VXLAN forwarder does |
//!
//! IPv6 frames go to `flannel_ebpf::v6` (its own subprograms), everything else to the IPv4
//! bodies.
//!
//! Built for bpfel-unknown-none by aya-build; on the host it compiles too (empty `main`) so that
//! `cargo clippy --workspace --all-targets` covers it.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

use aya_ebpf::{
    bindings::{TC_ACT_OK, xdp_action::XDP_PASS},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use flannel_common::stats::Reason;
use flannel_ebpf::{
    bench, bridge,
    maps::{
        FLANNEL_CNT_FBR, FLANNEL_CNT_FND, FLANNEL_CNT_TND, FLANNEL_CNT_XND, FLANNEL_TC_CNT,
        FLANNEL_XDP_CNT,
    },
    memo, netdev,
    parse::{self, PULL_LEN, PacketCtx as _},
    pmtu,
    stats::{self, Slots},
    v6, xdp,
};

/// TC classifier for any device and direction: parses the packet, counts it under its class
/// (or malformed reason) in `FLANNEL_TC_CNT`, and always lets it through.
#[classifier]
pub fn tc_classify(ctx: TcContext) -> i32 {
    ctx.pull_headers(PULL_LEN);
    let reason = parse::classify(&ctx);
    stats::count(&FLANNEL_TC_CNT, reason, ctx.packet_len() as u64);
    TC_ACT_OK
}

/// XDP twin of `tc_classify`: same parser, counts in `FLANNEL_XDP_CNT`, returns `XDP_PASS`.
#[xdp]
pub fn xdp_classify(ctx: XdpContext) -> u32 {
    let reason = parse::classify(&ctx);
    stats::count(&FLANNEL_XDP_CNT, reason, ctx.packet_len() as u64);
    XDP_PASS
}

/// Pod egress, on TC ingress of the pod bridge's veth ports: see `flannel_ebpf::bridge`.
#[classifier]
pub fn tc_from_bridge(ctx: TcContext) -> i32 {
    let bytes = ctx.packet_len() as u64;
    // A remembered flow first: its headers are already linear (or it is not taken).
    let out = if let Some(out) = memo::transmit(&ctx).or_else(|| v6::memo::transmit(&ctx)) {
        stats::count(&FLANNEL_CNT_FBR, Reason::MemoHit, bytes);
        out
    } else {
        ctx.pull_headers(PULL_LEN);
        if v6::is_ipv6(&ctx) {
            v6::from_bridge(&ctx)
        } else {
            bridge::run(&ctx)
        }
    };
    stats::count_run(
        &FLANNEL_CNT_FBR,
        Slots::PRECISE,
        out.class,
        out.verdict,
        [None, None],
        bytes,
    );
    out.action
}

/// Node ingress, on TC ingress of the external interface: see `flannel_ebpf::netdev`.
#[classifier]
pub fn tc_from_netdev(ctx: TcContext) -> i32 {
    let bytes = ctx.packet_len() as u64;
    // Opaque counter slots: a fifth of the verifier's walk (see `stats::Slots`).
    let slots = Slots::opaque(bytes);
    // A remembered flow first: its headers are already linear (or it is not taken).
    let (out, learnt) = if let Some(out) = memo::deliver(&ctx).or_else(|| v6::memo::deliver(&ctx)) {
        stats::count_at(&FLANNEL_CNT_FND, slots, Reason::MemoHit, bytes);
        (out, netdev::Learnt::default())
    } else {
        ctx.pull_headers(PULL_LEN);
        if v6::is_ipv6(&ctx) {
            v6::from_netdev(&ctx)
        } else if let Some(run) = netdev::nat_ingress(&ctx) {
            run
        } else if let Some(run) = pmtu::from_netdev(&ctx) {
            run
        } else {
            netdev::from_netdev(&ctx)
        }
    };
    let events = [
        learnt.nat_guard.then_some(Reason::LearnNatGuard),
        learnt.kernel_flow.then_some(Reason::LearnKernelFlow),
    ];
    stats::count_run(
        &FLANNEL_CNT_FND,
        slots,
        out.class,
        out.verdict,
        events,
        bytes,
    );
    out.action
}

/// Node egress, on TC egress of the external interface: see `flannel_ebpf::netdev`.
#[classifier]
pub fn tc_to_netdev(ctx: TcContext) -> i32 {
    let bytes = ctx.packet_len() as u64;
    let run = if netdev::own_packet(&ctx) {
        None
    } else if v6::is_ipv6(&ctx) {
        v6::to_netdev(&ctx)
            .map(|(out, learnt)| (out, [learnt.then_some(Reason::LearnKernelFlow), None]))
    } else {
        netdev::prepare_out(&ctx);
        netdev::nat_egress(&ctx).or_else(|| netdev::to_netdev(&ctx))
    };
    match run {
        Some((out, events)) => {
            stats::count_run(
                &FLANNEL_CNT_TND,
                Slots::PRECISE,
                out.class,
                out.verdict,
                events,
                bytes,
            );
            out.action
        }
        None => TC_ACT_OK,
    }
}

/// Node ingress before GRO, native XDP on the external interface: see `flannel_ebpf::xdp`.
#[xdp]
pub fn xdp_from_netdev(ctx: XdpContext) -> u32 {
    let bytes = ctx.packet_len() as u64;
    let out = xdp::from_netdev(&ctx);
    stats::count_run(
        &FLANNEL_CNT_XND,
        // A fifth of the verifier's walk, as in `tc_from_netdev`.
        Slots::opaque(bytes),
        out.class,
        out.verdict,
        [None, None],
        bytes,
    );
    out.action
}

/// Measurement only: the collect_md transmit alternative, see `flannel_ebpf::bench`.
#[classifier]
pub fn tc_bench_vxmd(ctx: TcContext) -> i32 {
    ctx.pull_headers(PULL_LEN);
    bench::vxlan_md(&ctx)
}

/// Measurement only: the floor of an eBPF host-gw or VXLAN forwarder, see `flannel_ebpf::bench`.
#[classifier]
pub fn tc_bench_floor(ctx: TcContext) -> i32 {
    bench::floor(&ctx)
}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[cfg(not(target_arch = "bpf"))]
fn main() {}
