//! Map names, keys and values.

/// Directory (under the bpffs pin path) holding this layout version's pins.
pub const PIN_LAYOUT_VERSION: &str = "v1";
