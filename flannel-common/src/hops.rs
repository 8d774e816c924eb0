//! Remembered route lookups: the programs keep `bpf_fib_lookup`'s answer for a destination for
//! a second ([`HOP_TTL_NS`]) and use it instead of looking the route up for every packet (the
//! lookup was ~40 % of `tc_from_netdev`'s time and as much of `tc_from_bridge`'s).
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

/// How long a remembered answer is used before the route is looked up again.
pub const HOP_TTL_NS: u64 = 1_000_000_000;

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
    /// When the lookup was made (`bpf_ktime_get_coarse_ns`).
    pub checked_ns: u64,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for Hop {}

const _: () = {
    assert!(core::mem::size_of::<HopKey>() == 8);
    assert!(core::mem::size_of::<Hop>() == 32);
};

impl Hop {
    /// Whether this answer may carry a packet of IP length `tot_len` (0 for a GSO packet,
    /// whose segments the route's MTU bounds anyway) at `now_ns`. A lookup stamped by another
    /// CPU a moment after `now_ns` counts as stale.
    #[inline(always)]
    pub fn usable(&self, now_ns: u64, tot_len: u16) -> bool {
        fresh_and_fits(self.checked_ns, self.mtu, now_ns, tot_len)
    }
}

/// Whether an answer checked at `checked_ns` for a route of MTU `mtu` may carry a packet of IP
/// length `tot_len` (0: not checked) at `now_ns`: at most [`HOP_TTL_NS`] old (a stamp later
/// than `now_ns`, from another CPU, counts as stale) and the packet fits. Shared by the
/// remembered hops and the remembered flows ([`crate::memo`]).
#[inline(always)]
pub fn fresh_and_fits(checked_ns: u64, mtu: u16, now_ns: u64, tot_len: u16) -> bool {
    now_ns.wrapping_sub(checked_ns) <= HOP_TTL_NS && tot_len <= mtu
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_used_while_fresh_and_for_packets_that_fit() {
        let hop = Hop {
            ifindex: 3,
            mtu: 1450,
            checked_ns: 5 * HOP_TTL_NS,
            ..Hop::default()
        };
        let now = 5 * HOP_TTL_NS;
        assert!(hop.usable(now, 1450));
        assert!(hop.usable(now + HOP_TTL_NS, 0));
        assert!(!hop.usable(now + HOP_TTL_NS + 1, 100), "stale");
        assert!(!hop.usable(now - 1, 100), "stamped later elsewhere");
        assert!(!hop.usable(now, 1451), "longer than the MTU");
    }
}
