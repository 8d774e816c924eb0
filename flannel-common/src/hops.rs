//! Remembered route lookups: the programs keep `bpf_fib_lookup`'s answer for a destination for
//! up to a second ([`HOP_TTL_TICKS`]) and use it instead of looking the route up for every
//! packet (the lookup was ~40 % of `tc_from_netdev`'s time and as much of `tc_from_bridge`'s).
//!
//! | who | key ([`HopKey`]) | answer ([`Hop`]) |
//! |---|---|---|
//! | `tc_from_netdev`, delivery to a local pod (IPv4) | pod address, via 0.0.0.0 | the pod bridge, its MAC and the pod's |
//! | `tc_from_bridge`, host-gw / DirectRouting to a remote pod | pod address, via the peer's public IP | the external interface, its MAC and the next hop's |
//! | `tc_from_bridge`, `tc_to_netdev`: the VXLAN/IPIP packet's own route to the peer | the peer's public IP, via [`UNDERLAY_VIA`] | the external interface, its MAC and the next hop's |
//!
//! What a remembered answer can miss, for up to a second: a change of the route or of the
//! neighbour entry behind it that the lease set does not show (the peer's public IP is part of
//! the key, so a subnet that moves to another node is looked up afresh at once). The kernel's
//! own path is slower still to notice a changed neighbour: a stale entry is used until its probe
//! fails. The bridge port a delivery goes into is found by the pod's MAC in
//! [`crate::pods::PORTS`] for every packet the full checks handle; a remembered flow
//! ([`crate::memo`]) keeps the port, but any change of the port map retires it, so a pod that
//! goes away stops being reached through its port at once either way. Only resolved answers
//! are remembered (a missing neighbour is resolved by `bpf_redirect_neigh` and the next lookup
//! finds it), and only packets that fit the route's MTU use them (longer ones take the lookup,
//! which refuses them).

use crate::maps::MAX_OBJ_NAME_LEN;

/// LRU hash of destinations → the route lookup's answer ([`HopKey`] → [`Hop`]). Not pinned:
/// a cache the programs fill, which a restarted agent starts afresh.
pub const HOPS4: &str = "FLANNEL_HOPS4";
/// Most destinations [`HOPS4`] remembers (the least recently used are looked up again).
pub const HOPS4_MAX_ENTRIES: u32 = 16384;

const _: () = assert!(HOPS4.len() <= MAX_OBJ_NAME_LEN);

/// [`HopKey::via`] of a tunnel packet's own route to a peer (whose public IP is the key's
/// `dst`): no pod or node has this address.
pub const UNDERLAY_VIA: [u8; 4] = [255; 4];

/// How long a remembered answer is used before the route is looked up again, in kernel timer
/// ticks (jiffies): at most a second whatever the kernel's `CONFIG_HZ` (1 s at HZ=100, 0.4 s at
/// the common 250, 0.1 s at 1000).
///
/// Ticks, not nanoseconds, because `bpf_jiffies64` is one memory load (the verifier inlines it),
/// where `bpf_ktime_get_coarse_ns` is a helper call: on a remembered flow's short path that call
/// was 25-35 ns of each program run on a machine with retpolines and a return thunk. A program
/// cannot know HZ, hence a count of ticks that keeps the old one-second bound for the slowest tick
/// rate Linux offers; a faster tick only looks routes up again sooner (one lookup per destination
/// per window).
pub const HOP_TTL_TICKS: u64 = 100;

/// [`HOPS4`]'s key. 8 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HopKey {
    /// The packet's destination.
    pub dst: [u8; 4],
    /// The peer the lease set sends it to (its public IP), 0.0.0.0 for a local pod,
    /// [`UNDERLAY_VIA`] for a tunnel's route to the peer in `dst`.
    pub via: [u8; 4],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for HopKey {}

/// [`HOPS4`]'s value: a route lookup's answer. 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Hop {
    /// The output interface.
    pub ifindex: u32,
    /// Source MAC (the output interface's).
    pub smac: [u8; 6],
    /// Destination MAC (the next hop's, or the pod's).
    pub dmac: [u8; 6],
    /// The route's MTU.
    pub mtu: u16,
    /// Explicit padding; always zero.
    pub _pad: [u8; 6],
    /// When the lookup was made, in kernel ticks (`bpf_jiffies64`, see [`HOP_TTL_TICKS`]).
    pub checked_at: u64,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for Hop {}

const _: () = {
    assert!(core::mem::size_of::<HopKey>() == 8);
    assert!(core::mem::size_of::<Hop>() == 32);
};

impl Hop {
    /// Whether this answer may carry a packet of IP length `tot_len` (0 for a GSO packet,
    /// whose segments the route's MTU bounds anyway) at `now`. A lookup stamped by another
    /// CPU a moment after `now` counts as stale.
    #[inline(always)]
    pub fn usable(&self, now: u64, tot_len: u16) -> bool {
        fresh_and_fits(self.checked_at, self.mtu, now, tot_len)
    }
}

/// Whether an answer checked at `checked_at` for a route of MTU `mtu` may carry a packet of IP
/// length `tot_len` (0: not checked) at `now`: at most [`HOP_TTL_TICKS`] old (a stamp later
/// than `now`, from another CPU, counts as stale) and the packet fits. Shared by the
/// remembered hops and the remembered flows ([`crate::memo`]).
#[inline(always)]
pub fn fresh_and_fits(checked_at: u64, mtu: u16, now: u64, tot_len: u16) -> bool {
    now.wrapping_sub(checked_at) <= HOP_TTL_TICKS && tot_len <= mtu
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_used_while_fresh_and_for_packets_that_fit() {
        let hop = Hop {
            ifindex: 3,
            mtu: 1450,
            checked_at: 5 * HOP_TTL_TICKS,
            ..Hop::default()
        };
        let now = 5 * HOP_TTL_TICKS;
        assert!(hop.usable(now, 1450));
        assert!(hop.usable(now + HOP_TTL_TICKS, 0));
        assert!(!hop.usable(now + HOP_TTL_TICKS + 1, 100), "stale");
        assert!(!hop.usable(now - 1, 100), "stamped later elsewhere");
        assert!(!hop.usable(now, 1451), "longer than the MTU");
    }
}
