//! Every map of the eBPF object, in one place to audit names and sizes.
//!
//! All maps are BTF-defined (`#[btf_map]`) so that `bpftool map dump` prints their keys and
//! values as typed JSON. Names must match `flannel_common::maps`.

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map};
use flannel_common::stats::{Counter, Reason};

/// Per-CPU packet/byte counters of the TC programs, indexed by [`Reason`]
/// (`flannel_common::maps::TC_STATS`).
#[btf_map]
pub static FLANNEL_TC_CNT: PerCpuArray<Counter, { Reason::COUNT }> = PerCpuArray::new();

/// Per-CPU packet/byte counters of the XDP programs, indexed by [`Reason`]
/// (`flannel_common::maps::XDP_STATS`).
#[btf_map]
pub static FLANNEL_XDP_CNT: PerCpuArray<Counter, { Reason::COUNT }> = PerCpuArray::new();
