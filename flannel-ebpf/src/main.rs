// Built for bpfel-unknown-none by aya-build; on the host it compiles too (empty `main`) so that
// `cargo clippy --workspace --all-targets` covers it.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

use aya_ebpf::{bindings::TC_ACT_OK, macros::classifier, programs::TcContext};

/// Placeholder until the fast path lands: lets every packet through.
#[classifier]
pub fn tc_pass(_ctx: TcContext) -> i32 {
    TC_ACT_OK
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
