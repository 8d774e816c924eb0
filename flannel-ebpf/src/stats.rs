//! Counting packets per [`Reason`] into a per-CPU stats map.

use aya_ebpf::btf_maps::PerCpuArray;
use flannel_common::stats::{Counter, Reason};

/// Adds one packet of `bytes` bytes to `reason`'s counter on this CPU.
///
/// The slot belongs to this CPU alone, so plain increments are race-free.
#[inline(always)]
pub fn count<const N: usize>(map: &PerCpuArray<Counter, N>, reason: Reason, bytes: u64) {
    if let Some(counter) = map.get_ptr_mut(reason.index()) {
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
    class: Reason,
    verdict: Reason,
    events: [Option<Reason>; 2],
    bytes: u64,
) {
    count(map, class, bytes);
    count(map, verdict, bytes);
    for event in events.into_iter().flatten() {
        count(map, event, bytes);
    }
}
