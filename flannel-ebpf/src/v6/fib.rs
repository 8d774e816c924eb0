//! `bpf_fib_lookup` for IPv6 (family `AF_INET6`) and the redirects that follow, the twins of
//! [`crate::fib`]. Forwarding must be enabled (`net.ipv6.conf.all.forwarding=1`, which a
//! node with IPv6 pods has anyway) or the lookup fails with `FWD_DISABLED` and the packet is
//! passed.

use core::mem::size_of;

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_OUTPUT,
        bpf_fib_lookup as FibParams, bpf_redir_neigh,
    },
    helpers::{bpf_fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use flannel_common::v6::Config6;

use super::info::Ipv6Info;
use crate::parse::{PacketCtx as _, write_macs};

/// `AF_INET6`.
const AF_INET6: u8 = 10;

/// The outcome of an IPv6 FIB lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fib6 {
    /// Route and neighbour known.
    Resolved {
        /// Output interface.
        ifindex: u32,
        /// Source MAC.
        smac: [u8; 6],
        /// Destination MAC.
        dmac: [u8; 6],
    },
    /// Route known, neighbour not resolved: the kernel resolves `nexthop` on `ifindex`.
    NoNeigh {
        /// Output interface.
        ifindex: u32,
        /// Next hop, as the lookup returned it (network order in memory).
        nexthop: [u32; 4],
    },
    /// No usable route (or too big, or forwarding disabled).
    Failed,
}

/// The address as the `[u32; 4]` the lookup structure holds (network order in memory).
#[inline(always)]
fn words(addr: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([addr[0], addr[1], addr[2], addr[3]]),
        u32::from_ne_bytes([addr[4], addr[5], addr[6], addr[7]]),
        u32::from_ne_bytes([addr[8], addr[9], addr[10], addr[11]]),
        u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]]),
    ]
}

impl Fib6 {
    /// Whether a delivery along this route goes straight into the pod's namespace: the pod's
    /// MAC is resolved and its bridge port known ([`crate::pods`]).
    #[inline(always)]
    pub fn reaches_pod_port(&self) -> bool {
        matches!(*self, Fib6::Resolved { ifindex, dmac, .. } if crate::pods::port(ifindex, dmac).is_some())
    }
}

/// Looks up the route for `info`'s destination as if the packet arrived on `ifindex`. `len`
/// holds on entry the length of the whole IPv6 packet to check against the output MTU (0
/// leaves the check to the kernel: GSO packets), and on return the route's MTU when it
/// resolved (as [`crate::fib::lookup`] stores it; one argument for both, as a BPF function
/// takes five at most and the returned enum is one). A BPF subprogram of its own (the lookup
/// structure stays off the callers' frames).
#[inline(never)]
pub fn lookup(ctx: &TcContext, ifindex: u32, info: &Ipv6Info, len: &mut u16) -> Fib6 {
    let mut slot = core::mem::MaybeUninit::uninit();
    let params = crate::fib::zeroed_params(&mut slot);
    params.family = AF_INET6;
    params.l4_protocol = info.next_hdr;
    params.sport = u16::from_ne_bytes(info.sport);
    params.dport = u16::from_ne_bytes(info.dport);
    params.__bindgen_anon_1.tot_len = *len;
    *len = 0;
    params.ifindex = ifindex;
    params.__bindgen_anon_2.flowinfo = (u32::from(info.tclass) << 20).to_be();
    params.__bindgen_anon_3.ipv6_src = words(&info.src);
    params.__bindgen_anon_4.ipv6_dst = words(&info.dst);
    run(ctx, params, 0, len)
}

/// Looks up the route of an outer (tunnel) packet from our public IP to `dst`, leaving
/// through the external interface (`cfg`'s). `len` holds on entry the outer packet's length,
/// checked against the path MTU (the route's, or a smaller one the kernel learnt from an
/// ICMPv6 Packet Too Big): a packet too big for it gets [`Fib6::Failed`]. On return it holds
/// that path MTU when the route resolved (0 otherwise).
#[inline(never)]
pub fn lookup_output(ctx: &TcContext, cfg: &Config6, dst: &[u8; 16], len: &mut u16) -> Fib6 {
    let mut slot = core::mem::MaybeUninit::uninit();
    let params = crate::fib::zeroed_params(&mut slot);
    params.family = AF_INET6;
    params.ifindex = cfg.ext_ifindex;
    params.__bindgen_anon_1.tot_len = *len;
    *len = 0;
    params.__bindgen_anon_3.ipv6_src = words(&cfg.public_ip);
    params.__bindgen_anon_4.ipv6_dst = words(dst);
    run(ctx, params, BPF_FIB_LOOKUP_OUTPUT, len)
}

#[inline(always)]
fn run(ctx: &TcContext, params: &mut FibParams, flags: u32, mtu: &mut u16) -> Fib6 {
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
        Fib6::Resolved {
            ifindex: params.ifindex,
            smac: params.smac,
            dmac: params.dmac,
        }
    } else if rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64 {
        Fib6::NoNeigh {
            ifindex: params.ifindex,
            // SAFETY: for IPv6 lookups the kernel leaves the next hop in the IPv6 member.
            nexthop: unsafe { params.__bindgen_anon_4.ipv6_dst },
        }
    } else {
        Fib6::Failed
    }
}

/// Sends the packet the way `fib` says (see [`crate::fib::redirect`]).
#[inline(always)]
pub fn redirect(ctx: &TcContext, fib: Fib6) -> Option<i32> {
    send(ctx, fib, false)
}

/// [`redirect`] for a packet to a local pod: into the pod's namespace when `fib` resolved the
/// pod's MAC and its bridge port is known ([`crate::pods`]).
#[inline(always)]
pub fn deliver(ctx: &TcContext, fib: Fib6) -> Option<i32> {
    send(ctx, fib, true)
}

#[inline(always)]
fn send(ctx: &TcContext, fib: Fib6, to_pod: bool) -> Option<i32> {
    match fib {
        Fib6::Resolved {
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
        Fib6::NoNeigh { ifindex, nexthop } => {
            let mut nh: bpf_redir_neigh = crate::zeroed();
            nh.nh_family = u32::from(AF_INET6);
            nh.__bindgen_anon_1.ipv6_nh = nexthop;
            // SAFETY: the helper reads `nh` of the size given.
            Some(unsafe {
                bpf_redirect_neigh(ifindex, &mut nh, size_of::<bpf_redir_neigh>() as i32, 0)
            } as i32)
        }
        Fib6::Failed => None,
    }
}
