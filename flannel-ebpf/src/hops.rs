//! Remembered route lookups (see [`flannel_common::hops`]): [`route`] answers from
//! [`FLANNEL_HOPS4`] while the remembered answer is good, and looks the route up (and
//! remembers the answer) otherwise.

use flannel_common::hops::{Hop, HopKey};

use crate::{fib::Fib, maps::FLANNEL_HOPS4};

/// The route for `key`: a remembered answer if it is fresh and a packet of IP length `len`
/// (0: not checked here) fits its MTU, otherwise `lookup`'s (which stores the route's MTU in
/// its argument), remembered when it resolved the next hop. `mtu` gets the route's MTU (0 if
/// the lookup gave none).
#[inline(always)]
pub fn route(key: HopKey, len: u16, mtu: &mut u16, lookup: impl FnOnce(&mut u16) -> Fib) -> Fib {
    let now = crate::now_ticks();
    if let Some(hop) = FLANNEL_HOPS4.get_ptr(key) {
        // SAFETY: the pointer comes from a successful lookup; the entry is read once.
        let hop = unsafe { hop.read() };
        if hop.usable(now, len) {
            *mtu = hop.mtu;
            return Fib::Resolved {
                ifindex: hop.ifindex,
                smac: hop.smac,
                dmac: hop.dmac,
            };
        }
    }
    *mtu = 0;
    let route = lookup(mtu);
    if let Fib::Resolved {
        ifindex,
        smac,
        dmac,
    } = route
        && *mtu != 0
    {
        let hop = Hop {
            ifindex,
            smac,
            dmac,
            mtu: *mtu,
            _pad: crate::zeroed(),
            checked_at: now,
        };
        let _ = FLANNEL_HOPS4.insert(key, hop, 0);
    }
    route
}
