//! Map names, keys and values.
//!
//! Kernel object names are at most 15 characters (`BPF_OBJ_NAME_LEN` - 1); longer names would be
//! silently truncated in `bpftool map list`, so every name is checked at compile time.

/// Directory (under the bpffs pin path) holding this layout version's pins.
pub const PIN_LAYOUT_VERSION: &str = "v1";

/// Per-CPU array of [`crate::stats::Counter`] indexed by [`crate::stats::Reason`], filled by the
/// TC programs.
pub const TC_STATS: &str = "FLANNEL_TC_CNT";

/// Per-CPU array of [`crate::stats::Counter`] indexed by [`crate::stats::Reason`], filled by the
/// XDP programs (kept apart from [`TC_STATS`] so a packet seen by both hooks is not counted twice
/// in one place).
pub const XDP_STATS: &str = "FLANNEL_XDP_CNT";

/// Longest name the kernel keeps for a map or program.
pub const MAX_OBJ_NAME_LEN: usize = 15;

const _: () = {
    assert!(TC_STATS.len() <= MAX_OBJ_NAME_LEN);
    assert!(XDP_STATS.len() <= MAX_OBJ_NAME_LEN);
};
