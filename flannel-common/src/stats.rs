//! Per-CPU counters kept by the eBPF programs, indexed by [`Reason`].

/// Packets and bytes for one reason.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for Counter {}
