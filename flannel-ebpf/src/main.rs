//! flannel's eBPF object: the program entry points. Each is a thin wrapper over the library
//! (`flannel_ebpf::{parse, stats, maps}`) so that TC and XDP share the same logic.
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
use flannel_ebpf::{
    maps::{FLANNEL_TC_CNT, FLANNEL_XDP_CNT},
    parse::{self, PULL_LEN, PacketCtx as _},
    stats,
};

/// TC classifier for any device and direction: parses the packet, counts it under its class
/// (or malformed reason) in `FLANNEL_TC_CNT`, and always lets it through. The forwarding
/// decisions of the fast path will be made on top of this classification.
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
