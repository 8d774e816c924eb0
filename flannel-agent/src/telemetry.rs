//! Logging: `tracing` to stderr. `RUST_LOG` wins when set; otherwise upstream's `-v` level maps
//! to a filter (0 → info, 1–3 → debug, 4+ → trace; upstream logs datapath details at V(1)/V(2),
//! netlink operations at V(4)). aya's `log` records reach the same subscriber. Colours only
//! when stderr is a terminal: a pod log, journald or a file gets plain text.

use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// The filter for upstream's `-v` level.
pub fn filter_for_verbosity(v: i32) -> &'static str {
    match v {
        i32::MIN..=0 => "info",
        1..=3 => "debug",
        _ => "trace",
    }
}

/// Installs the global subscriber (once; later calls are ignored).
pub fn init(verbosity: i32) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(filter_for_verbosity(verbosity)));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbosity_levels_map_like_klog() {
        assert_eq!(filter_for_verbosity(0), "info");
        assert_eq!(filter_for_verbosity(-3), "info");
        assert_eq!(filter_for_verbosity(2), "debug");
        assert_eq!(filter_for_verbosity(4), "trace");
    }
}
