//! Counting packets per [`Reason`] into a per-CPU stats map.

use aya_ebpf::btf_maps::PerCpuArray;
use flannel_common::stats::{Counter, Reason};

/// How a program's count reaches its slot: at the reason's index as the verifier sees it, or
/// at an index the verifier cannot tell from any other.
///
/// A counter's slot is the path's class or verdict, a constant on each path. A recent verifier
/// (6.18 here) marks a constant map key precise so that it can drop the lookup's NULL check,
/// and from then on two states that differ only in what they will count are never pruned: in
/// `tc_from_netdev` that multiplied its walk by five. [`Slots::opaque`] offsets every index by
/// a zero the verifier cannot see, so the key is unknown to it and nothing is marked; the price
/// is a NULL check per count. Which programs gain depends on their shape (two lose), so each
/// entry point chooses.
#[derive(Clone, Copy)]
pub struct Slots(u32);

impl Slots {
    /// The reason's index as it is.
    pub const PRECISE: Slots = Slots(0);

    /// The reason's index plus a zero derived from `seed` (any value read from the packet's
    /// context) through a volatile reload, which the verifier cannot prove to be zero.
    #[inline(always)]
    pub fn opaque(seed: u64) -> Slots {
        let copy = seed;
        // SAFETY: a read of a local that lives to the end of this function.
        let again = unsafe { core::ptr::read_volatile(&copy) };
        Slots(seed.wrapping_sub(again) as u32)
    }

    #[inline(always)]
    fn of(self, reason: Reason) -> u32 {
        reason.index().wrapping_add(self.0)
    }
}

/// Adds one packet of `bytes` bytes to `reason`'s counter on this CPU.
#[inline(always)]
pub fn count<const N: usize>(map: &PerCpuArray<Counter, N>, reason: Reason, bytes: u64) {
    count_at(map, Slots::PRECISE, reason, bytes);
}

/// [`count`], with the slot reached as `slots` says.
///
/// The slot belongs to this CPU alone, so plain increments are race-free.
#[inline(always)]
pub fn count_at<const N: usize>(
    map: &PerCpuArray<Counter, N>,
    slots: Slots,
    reason: Reason,
    bytes: u64,
) {
    if let Some(counter) = map.get_ptr_mut(slots.of(reason)) {
        // SAFETY: the map returned a valid pointer to this CPU's slot.
        unsafe {
            (*counter).packets += 1;
            (*counter).bytes += bytes;
        }
    }
}

/// Counts a fast-path program run: the packet's class, its verdict, and the events that
/// happened.
#[inline(always)]
pub fn count_run<const N: usize>(
    map: &PerCpuArray<Counter, N>,
    slots: Slots,
    class: Reason,
    verdict: Reason,
    events: [Option<Reason>; 2],
    bytes: u64,
) {
    count_at(map, slots, class, bytes);
    count_at(map, slots, verdict, bytes);
    for event in events.into_iter().flatten() {
        count_at(map, slots, event, bytes);
    }
}
