//! Names of the programs in the eBPF object (the loader looks them up by these names).

use crate::maps::MAX_OBJ_NAME_LEN;

/// TC classifier: parses and classifies every packet, counts it in
/// [`crate::maps::TC_STATS`], and lets it through (`TC_ACT_OK`).
pub const TC_CLASSIFY: &str = "tc_classify";

/// XDP twin of [`TC_CLASSIFY`]: same parser, counts in [`crate::maps::XDP_STATS`],
/// returns `XDP_PASS`.
pub const XDP_CLASSIFY: &str = "xdp_classify";

const _: () = {
    assert!(TC_CLASSIFY.len() <= MAX_OBJ_NAME_LEN);
    assert!(XDP_CLASSIFY.len() <= MAX_OBJ_NAME_LEN);
};
