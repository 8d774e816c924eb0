//! Delivery to local pods: straight into the pod's network namespace when its bridge port is
//! known (see [`flannel_common::pods`]), through the pod bridge otherwise.
//!
//! `bpf_redirect_peer` hands the packet to the ingress of the veth's other end, in the pod's
//! namespace, within the same softirq: no bridge forwarding, no veth transmit, no trip
//! through the backlog queue. It also keeps GSO packets whole: there is no transmit on the way
//! in, so nothing checks the device's offload features and segments the packet in software
//! (see [`crate::deliver`] for why that matters to decapsulated tunnel packets).

use aya_ebpf::{
    helpers::{bpf_redirect, bpf_redirect_peer},
    programs::TcContext,
};
use flannel_common::{pods::PortKey, stats::Reason};

use crate::{
    fib,
    maps::{FLANNEL_CNT_FND, FLANNEL_PORTS},
    parse::ptr_at,
    stats,
};

/// The host side of the veth of the pod with MAC `mac`, if that pod sits behind `bridge`.
#[inline(always)]
pub fn port(bridge: u32, mac: [u8; 6]) -> Option<u32> {
    let entry = FLANNEL_PORTS.get_ptr(PortKey::new(mac))?;
    // SAFETY: the pointer comes from a successful lookup; the entry is read once.
    let entry = unsafe { entry.read() };
    (entry.bridge == bridge && entry.ifindex != 0).then_some(entry.ifindex)
}

/// Sends a packet whose MACs are already rewritten to the pod with MAC `dmac` behind
/// `bridge` (the output interface `bpf_fib_lookup` chose): into the pod's namespace when its
/// port is known (counted as [`Reason::DeliverPeer`] of `tc_from_netdev`, `bytes` long),
/// otherwise to the bridge. Returns the TC action.
#[inline(always)]
pub fn redirect(bridge: u32, dmac: [u8; 6], bytes: u64) -> i32 {
    if let Some(port) = port(bridge, dmac) {
        return into_pod(port, bytes);
    }
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(bridge, 0) as i32 }
}

/// Sends a `bytes` long packet whose MACs are rewritten into the pod behind the veth `port`
/// (counted as [`Reason::DeliverPeer`] of `tc_from_netdev`). Returns the TC action.
#[inline(always)]
pub fn into_pod(port: u32, bytes: u64) -> i32 {
    stats::count(&FLANNEL_CNT_FND, Reason::DeliverPeer, bytes);
    // SAFETY: plain helper call.
    unsafe { bpf_redirect_peer(port, 0) as i32 }
}

/// The interface a pod's packet counts as arriving on for `bpf_fib_lookup`: the bridge, as
/// for the kernel, which routes what the bridge passes up. `tc_from_bridge` runs on the
/// bridge's ports (the pods' veths, before the bridge and its netfilter hooks), so the bridge
/// is the one of the port the frame's source MAC is known on; failing that (a pod the mirror
/// does not know yet, or the program attached to the bridge itself) the ingress interface.
#[inline(always)]
pub fn routing_iif(ctx: &TcContext) -> u32 {
    let here = fib::ingress_ifindex(ctx);
    let Some(smac) = ptr_at::<TcContext, [u8; 6]>(ctx, 6) else {
        return here;
    };
    // SAFETY: ptr_at checked the 6 bytes are readable.
    let smac = unsafe { smac.read_unaligned() };
    let Some(entry) = FLANNEL_PORTS.get_ptr(PortKey::new(smac)) else {
        return here;
    };
    // SAFETY: the pointer comes from a successful lookup; the entry is read once.
    let entry = unsafe { entry.read() };
    if entry.ifindex == here && entry.bridge != 0 {
        entry.bridge
    } else {
        here
    }
}
