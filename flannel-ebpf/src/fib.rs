//! Routing through the kernel's FIB from TC: `bpf_fib_lookup`, then `bpf_redirect` with the
//! neighbour's MACs, or `bpf_redirect_neigh` when the neighbour is not resolved yet (the kernel
//! resolves it and queues the packet). Used for host-gw transmit, for delivery to local pods
//! on receive and for the tunnels' own route to a peer (whose answers [`crate::hops`]
//! remembers for up to a second).
//!
//! The lookup needs forwarding enabled on the ingress device (`net.ipv4.ip_forward=1`, which
//! flannel requires anyway); otherwise it fails with `FWD_DISABLED` and the packet is passed.

use core::mem::{MaybeUninit, size_of};

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_OUTPUT,
        bpf_fib_lookup as FibParams, bpf_redir_neigh,
    },
    helpers::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};

use crate::{
    ipv4::Ipv4Info,
    parse::{PacketCtx as _, write_macs},
};

/// `AF_INET`.
const AF_INET: u8 = 2;

/// The outcome of a FIB lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fib {
    /// Route and neighbour known: send out of `ifindex` with these MACs.
    Resolved {
        /// Output interface.
        ifindex: u32,
        /// Source MAC (the output interface's).
        smac: [u8; 6],
        /// Destination MAC (the next hop's).
        dmac: [u8; 6],
    },
    /// Route known, neighbour not resolved: let the kernel resolve `nexthop` on `ifindex`.
    NoNeigh {
        /// Output interface.
        ifindex: u32,
        /// Next hop (gateway or the destination itself), network order as stored in memory.
        nexthop: u32,
    },
    /// No usable route, fragmentation needed, or forwarding disabled: leave it to the kernel.
    Failed,
}

impl Fib {
    /// Whether a delivery along this route goes straight into the pod's namespace: the pod's
    /// MAC is resolved and its bridge port known ([`crate::pods`]).
    #[inline(always)]
    pub fn reaches_pod_port(&self) -> bool {
        matches!(*self, Fib::Resolved { ifindex, dmac, .. } if crate::pods::port(ifindex, dmac).is_some())
    }
}

/// Zeroes the `bpf_fib_lookup` parameter block in `slot` with eight word stores and returns
/// it: a plain `zeroed()` becomes a call to the object's `memset` subprogram, which showed up
/// on its own in profiles of every forwarded packet. Zeroed in place, so that the block is
/// never copied (the programs' stacks are close to the verifier's limit).
#[inline(always)]
pub fn zeroed_params(slot: &mut MaybeUninit<FibParams>) -> &mut FibParams {
    const WORDS: usize = size_of::<FibParams>() / 8;
    const _: () = assert!(size_of::<FibParams>().is_multiple_of(8));
    let words = slot.as_mut_ptr().cast::<u64>();
    let mut i = 0;
    while i < WORDS {
        // SAFETY: `words` covers the `WORDS` words of `slot`; the stores are volatile so that
        // LLVM does not fold them back into a `memset` call.
        unsafe { words.add(i).write_volatile(0) };
        i += 1;
    }
    // SAFETY: every byte was written; all-zero is a valid `bpf_fib_lookup`.
    unsafe { slot.assume_init_mut() }
}

/// Looks up the route for `info`'s destination as if the packet arrived on `ifindex`,
/// storing the route's MTU in `mtu` when it resolved.
///
/// `tot_len` is the IP length to check against the output MTU; 0 lets the kernel check the
/// skb itself (which understands GSO packets). The MTU is not returned with the [`Fib`]: LLVM
/// copies a returned enum whole, bytes its variant leaves undefined included, and the
/// verifier refuses reads of undefined registers.
#[inline(always)]
pub fn lookup(ctx: &TcContext, ifindex: u32, info: &Ipv4Info, tot_len: u16, mtu: &mut u16) -> Fib {
    let mut slot = MaybeUninit::uninit();
    let params = zeroed_params(&mut slot);
    params.family = AF_INET;
    params.l4_protocol = info.proto;
    params.sport = u16::from_ne_bytes(info.sport);
    params.dport = u16::from_ne_bytes(info.dport);
    params.__bindgen_anon_1.tot_len = tot_len;
    params.ifindex = ifindex;
    params.__bindgen_anon_2.tos = info.tos;
    params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(info.src);
    params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(info.dst);
    run(ctx, params, 0, mtu)
}

/// Looks up the route of an outer (tunnel) packet from `src` to `dst` leaving through `oif`,
/// as the kernel would for a locally generated packet. `mtu` holds on entry the outer
/// packet's length to check against the path MTU (the route's, or a smaller one the kernel
/// learnt from an ICMP "fragmentation needed"; too big: [`Fib::Failed`]), or 0 to leave the
/// check to the kernel's device MTU; on success it gets the MTU the lookup found (the path's
/// when checked, the device's otherwise). The skb's mark plays no part, so policy routing by
/// fwmark cannot divert tunnel packets.
#[inline(always)]
pub fn lookup_output(ctx: &TcContext, oif: u32, src: [u8; 4], dst: [u8; 4], mtu: &mut u16) -> Fib {
    let mut slot = MaybeUninit::uninit();
    let params = zeroed_params(&mut slot);
    params.family = AF_INET;
    params.__bindgen_anon_1.tot_len = *mtu;
    params.ifindex = oif;
    params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(src);
    params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(dst);
    run(ctx, params, BPF_FIB_LOOKUP_OUTPUT, mtu)
}

/// Runs the lookup; on success also stores the route's MTU (which the kernel leaves in the
/// parameter block) in `mtu`.
#[inline(always)]
fn run(ctx: &TcContext, params: &mut FibParams, flags: u32, mtu: &mut u16) -> Fib {
    // SAFETY: the helper reads and writes `params` (of the size given) only.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb.cast(),
            params,
            size_of::<FibParams>() as i32,
            flags,
        )
    };
    if rc == BPF_FIB_LKUP_RET_SUCCESS as i64 {
        // SAFETY: on success the kernel leaves the route's MTU in this member.
        *mtu = unsafe { params.__bindgen_anon_1.mtu_result };
        Fib::Resolved {
            ifindex: params.ifindex,
            smac: params.smac,
            dmac: params.dmac,
        }
    } else if rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64 {
        Fib::NoNeigh {
            ifindex: params.ifindex,
            // SAFETY: for IPv4 lookups the kernel fills the IPv4 member with the next hop.
            nexthop: unsafe { params.__bindgen_anon_4.ipv4_dst },
        }
    } else {
        Fib::Failed
    }
}

/// Sends the packet (whose Ethernet header is at offset 0) the way `fib` says: writes the MACs
/// and `bpf_redirect`s, or `bpf_redirect_neigh`s. Returns the TC action, or `None` if `fib`
/// failed or the header is not writable.
#[inline(always)]
pub fn redirect(ctx: &TcContext, fib: Fib) -> Option<i32> {
    send(ctx, fib, false)
}

/// [`redirect`] for a packet to a local pod: into the pod's namespace when `fib` resolved the
/// pod's MAC and its bridge port is known ([`crate::pods`]).
#[inline(always)]
pub fn deliver(ctx: &TcContext, fib: Fib) -> Option<i32> {
    send(ctx, fib, true)
}

#[inline(always)]
fn send(ctx: &TcContext, fib: Fib, to_pod: bool) -> Option<i32> {
    match fib {
        Fib::Resolved {
            ifindex,
            smac,
            dmac,
        } => {
            write_macs(ctx, dmac, smac)?;
            if to_pod {
                return Some(crate::pods::redirect(
                    ifindex,
                    dmac,
                    ctx.packet_len() as u64,
                ));
            }
            // SAFETY: plain helper call.
            Some(unsafe { bpf_redirect(ifindex, 0) } as i32)
        }
        Fib::NoNeigh { ifindex, nexthop } => {
            let mut nh: bpf_redir_neigh = crate::zeroed();
            nh.nh_family = u32::from(AF_INET);
            nh.__bindgen_anon_1.ipv4_nh = nexthop;
            // SAFETY: the helper reads `nh` of the size given.
            Some(unsafe {
                bpf_redirect_neigh(ifindex, &mut nh, size_of::<bpf_redir_neigh>() as i32, 0)
            } as i32)
        }
        Fib::Failed => None,
    }
}

/// The ingress interface of the packet in `ctx`.
#[inline(always)]
pub fn ingress_ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: reading a field of the __sk_buff the kernel passed.
    unsafe { (*ctx.skb.skb).ingress_ifindex }
}

/// The GSO segment size of the packet (0 when it is not a GSO packet).
#[inline(always)]
pub fn gso_size(ctx: &TcContext) -> u32 {
    // SAFETY: reading a field of the __sk_buff the kernel passed.
    unsafe { (*ctx.skb.skb).gso_size }
}

/// The packet's `skb->len`.
#[inline(always)]
pub fn skb_len(ctx: &TcContext) -> u32 {
    ctx.packet_len() as u32
}
