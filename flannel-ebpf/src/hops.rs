//! Remembered route lookups (see [`flannel_common::hops`]): [`route`] answers from
//! [`FLANNEL_HOPS4`] while the remembered answer is good, and looks the route up (and
//! remembers the answer) otherwise.

use aya_ebpf::programs::TcContext;
use flannel_common::hops::{Hop, HopKey};

use crate::{
    fib::{self, Fib},
    ipv4::Ipv4Info,
    maps::FLANNEL_HOPS4,
};

/// The route for `info` as `bpf_fib_lookup` would give it when the packet arrives on
/// `ifindex()` (called only for a lookup), checking `tot_len` (0: let the kernel check the
/// skb) against the route's MTU: a remembered answer for `key` if it is fresh and the packet
/// fits, otherwise a lookup, remembered when it resolved the next hop.
#[inline(always)]
pub fn route(
    ctx: &TcContext,
    key: HopKey,
    ifindex: impl FnOnce() -> u32,
    info: &Ipv4Info,
    tot_len: u16,
) -> Fib {
    let now = crate::now_ns();
    if let Some(hop) = FLANNEL_HOPS4.get_ptr(key) {
        // SAFETY: the pointer comes from a successful lookup; the entry is read once.
        let hop = unsafe { hop.read() };
        let len = if tot_len == 0 && fib::gso_size(ctx) == 0 {
            info.tot_len
        } else {
            tot_len
        };
        if hop.usable(now, len) {
            return Fib::Resolved {
                ifindex: hop.ifindex,
                smac: hop.smac,
                dmac: hop.dmac,
            };
        }
    }
    let mut mtu = 0;
    let route = fib::lookup_mtu(ctx, ifindex(), info, tot_len, &mut mtu);
    if let Fib::Resolved {
        ifindex,
        smac,
        dmac,
    } = route
        && mtu != 0
    {
        let hop = Hop {
            ifindex,
            smac,
            dmac,
            mtu,
            _pad: [0; 6],
            checked_ns: now,
        };
        let _ = FLANNEL_HOPS4.insert(key, hop, 0);
    }
    route
}
