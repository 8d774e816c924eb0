//! The building blocks of flannel's TC/XDP programs, shared by every entry point in `main.rs`.
//!
//! | module | job |
//! |---|---|
//! | [`parse`] | bounds-checked packet access and the Ethernet → IP → L4 parser/classifier |
//! | [`ipv4`] | the IPv4 fields the fast path decides on; TTL decrement |
//! | [`decide`] | the fast path's decisions as pure functions (host-tested) |
//! | [`bridge`] | `tc_from_bridge`: pod → remote pod transmit |
//! | [`netdev`] | `tc_from_netdev` / `tc_to_netdev`: receive, delivery, IPIP egress |
//! | [`xdp`] | `xdp_from_netdev`: tunnel decapsulation before GRO |
//! | [`encap`] | VXLAN and IPIP headers and encapsulation (and why not collect_md) |
//! | [`deliver`] | decapsulation, delivery to the bridge, the conntrack-consistency flow tables |
//! | [`fib`] | `bpf_fib_lookup` + redirect |
//! | [`hops`] | remembered route lookups |
//! | [`memo`] | remembered per-flow decisions: the short path of both directions |
//! | [`pods`] | delivery into a local pod's namespace (`bpf_redirect_peer`) |
//! | [`nat`] | masquerade: source NAT out, reverse NAT in, port allocation, ICMP errors |
//! | [`maps`] | every map of the object |
//! | [`stats`] | counting packets per [`flannel_common::stats::Reason`] |
//! | [`mod@bench`] | measurement only: the collect_md alternative (`tc_bench_vxmd`) |
//! | [`udp`] | the udp backend's encapsulation, receive and its map |
//! | [`v6`] | IPv6: host-gw and VXLAN over IPv6, receive, flow tables and maps |
//!
//! On the bpf target this is `no_std`; on the host it compiles with std so that clippy and the
//! unit tests (`cargo test -p flannel-ebpf --lib`) cover the pure logic.
#![cfg_attr(target_arch = "bpf", no_std)]
// The atomic add of `memo::retire` (the bpf target has no atomic types).
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

pub mod bench;
pub mod bridge;
pub mod decide;
pub mod deliver;
pub mod encap;
pub mod fib;
pub mod frag;
pub mod hops;
pub mod ipv4;
pub mod maps;
pub mod memo;
pub mod nat;
pub mod netdev;
pub mod parse;
pub mod pmtu;
pub mod pods;
pub mod stats;
pub mod udp;
pub mod v6;
pub mod xdp;

/// `CLOCK_MONOTONIC` at the last timer tick (`bpf_ktime_get_coarse_ns`): a few milliseconds
/// behind at most and cheaper to read on every packet than the exact clock; the time of the
/// NAT's flows, which the agent compares with its own clock.
#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: plain helper call.
    unsafe { aya_ebpf::helpers::bpf_ktime_get_coarse_ns() }
}

/// The kernel's tick count (`jiffies_64`): the time of remembered route lookups and flows
/// (see `flannel_common::hops::HOP_TTL_TICKS`). The verifier replaces the helper call with a
/// load of the counter, so reading it costs no call on the short path of every packet.
#[inline(always)]
pub fn now_ticks() -> u64 {
    // SAFETY: plain helper call (inlined by the verifier on 64-bit JITs).
    unsafe { aya_ebpf::helpers::bpf_jiffies64() }
}

/// Plain data, all-zero bytes of which are a valid value: byte arrays (map keys' padding) and
/// the helpers' parameter blocks.
///
/// # Safety
/// All-zero bytes must be a valid value of the type, and its alignment at most 8.
pub unsafe trait Plain: Copy {}

// SAFETY: byte arrays.
unsafe impl<const N: usize> Plain for [u8; N] {}
// SAFETY: C structs and unions of integers.
unsafe impl Plain for aya_ebpf::bindings::bpf_redir_neigh {}
// SAFETY: as above.
unsafe impl Plain for aya_ebpf::bindings::bpf_tunnel_key {}

/// An all-zero `T`, built from a zero the compiler cannot see through.
///
/// `[0; N]`, `mem::zeroed()` and runs of constant zero stores become `llvm.memset`, which the
/// BPF backend of this toolchain never expands inline: each is a call to the object's
/// `memset`, a byte loop of its own (its calls showed in every full-check path). Zeros read
/// back from the stack with a volatile load are not constants to LLVM, so the stores stay
/// plain word stores. Map keys take their padding from here (`_pad: zeroed()`): the kernel
/// hashes and compares keys byte by byte, so every byte of a key must be written.
#[inline(always)]
pub fn zeroed<T: Plain>() -> T {
    /// `T` on an 8-byte boundary, its size rounded up to whole words.
    #[repr(C, align(8))]
    struct Words<T>(core::mem::MaybeUninit<T>);
    let zero = 0u64;
    // SAFETY: reading a local; volatile so that LLVM does not know the value.
    let zero = unsafe { (&raw const zero).read_volatile() };
    let mut slot = Words(core::mem::MaybeUninit::<T>::uninit());
    let words = size_of::<Words<T>>() / 8;
    let to = (&raw mut slot).cast::<u64>();
    let mut i = 0;
    while i < words {
        // SAFETY: `slot` is 8-byte aligned and covers `words` words.
        unsafe { to.add(i).write(zero) };
        i += 1;
    }
    // SAFETY: every byte was written, and all-zero is a valid `T` (`Plain`).
    unsafe { slot.0.assume_init() }
}

/// `*dst = src.read()` for plain data whose size is a multiple of 8, a word at a time: an
/// assignment of a large value through a pointer becomes a call to the object's `memmove`,
/// which copies byte by byte (eight instructions a byte, 500 for a 64-byte memo).
///
/// # Safety
/// `src` must point to a live, 8-byte aligned `T` (a map value), and `T` must be 8-byte
/// aligned.
#[inline(always)]
pub unsafe fn copy_words<T: Copy>(dst: &mut T, src: *const T) {
    const {
        assert!(core::mem::size_of::<T>().is_multiple_of(8));
        assert!(core::mem::align_of::<T>() >= 8);
    };
    let words = core::mem::size_of::<T>() / 8;
    let to = (dst as *mut T).cast::<u64>();
    let from = src.cast::<u64>();
    let mut i = 0;
    while i < words {
        // SAFETY: both cover `words` aligned words, as the caller promised; volatile so that
        // LLVM does not fold the loop back into a `memmove` call.
        unsafe { to.add(i).write_volatile(from.add(i).read_volatile()) };
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use aya_ebpf::bindings::bpf_redir_neigh;

    use super::*;

    #[test]
    fn zeroed_writes_every_byte() {
        assert_eq!(zeroed::<[u8; 3]>(), [0; 3]);
        assert_eq!(zeroed::<[u8; 6]>(), [0; 6]);
        assert_eq!(zeroed::<[u8; 16]>(), [0; 16]);
        let nh: bpf_redir_neigh = zeroed();
        // SAFETY: a C struct of integers, viewed as its bytes.
        let bytes: [u8; size_of::<bpf_redir_neigh>()] = unsafe { core::mem::transmute(nh) };
        assert_eq!(bytes, [0; size_of::<bpf_redir_neigh>()]);
    }
}
