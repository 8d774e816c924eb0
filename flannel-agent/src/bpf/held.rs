//! How many open NATed connections the held flow tables take (`--ebpf-held-max-entries`).
//!
//! The held tables (`FLANNEL_HFLOWS4`/`6`, `FLANNEL_HNATGD4`/`6`, see [`super::seed`]) keep the
//! kernel-flow and NAT-guard keys of open connections that conntrack reports, out of reach of
//! LRU eviction. A connection past their size relies on the LRU tables and the resync alone.
//! By default they are sized to hold as many connections as conntrack itself tracks
//! (`nf_conntrack_max`, within [`HELD_MIN_ENTRIES`]..=[`HELD_MAX_DEFAULT_ENTRIES`]), so that
//! they fill up only when conntrack does. They are allocated as written (`BPF_F_NO_PREALLOC`):
//! a larger size costs the kernel only its bucket array (16 bytes per slot) until connections
//! fill it.
//!
//! The tables are rebuilt from conntrack at every read, so a restart with another size creates
//! them afresh (they are filled before the programs attach), with nothing to carry over.

use std::{fmt, fs};

use flannel_common::{maps as names, v6};

use super::{BpfError, FastPath};

/// The object's own size of the held flow tables, and the fewest flows they hold by default.
pub const HELD_MIN_ENTRIES: u32 = names::HELD_FLOWS4_MAX_ENTRIES;
/// Most flows they hold by default, whatever conntrack's maximum.
pub const HELD_MAX_DEFAULT_ENTRIES: u32 = 1 << 20;
/// Most flows `--ebpf-held-max-entries` may ask for (each table's bucket array alone is
/// 16 bytes a slot: 256 MiB at this size).
pub const HELD_MAX_ENTRIES: u32 = 1 << 24;
/// Where conntrack's maximum is read.
const CONNTRACK_MAX: &str = "/proc/sys/net/netfilter/nf_conntrack_max";

/// The NAT-guard tables' size for held flow tables of `flows`: a quarter (guards are the
/// hostPort connections to local pods, fewer than the Service connections of the pods).
pub fn guards_for(flows: u32) -> u32 {
    flows.div_ceil(4)
}

/// How the held tables are sized and why, for the start-up log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldSizing {
    /// Connections each held flow table holds (per family).
    pub flows: u32,
    /// Where the size came from.
    pub source: HeldSource,
}

/// Where [`HeldSizing::flows`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeldSource {
    /// `--ebpf-held-max-entries`.
    Flag,
    /// `nf_conntrack_max` (the value read), clamped to the default range.
    Conntrack(u32),
    /// Conntrack's maximum could not be read: the object's size.
    Default,
}

impl HeldSizing {
    /// `--ebpf-held-max-entries`: `0` sizes from conntrack's maximum.
    pub fn resolve(flag: u32) -> HeldSizing {
        if flag > 0 {
            return HeldSizing {
                flows: flag,
                source: HeldSource::Flag,
            };
        }
        HeldSizing::from_conntrack_max(
            fs::read_to_string(CONNTRACK_MAX)
                .ok()
                .and_then(|text| text.trim().parse().ok()),
        )
    }

    /// The default size for conntrack's maximum `max` (`None`: unknown).
    pub fn from_conntrack_max(max: Option<u32>) -> HeldSizing {
        match max {
            Some(max) => HeldSizing {
                flows: max.clamp(HELD_MIN_ENTRIES, HELD_MAX_DEFAULT_ENTRIES),
                source: HeldSource::Conntrack(max),
            },
            None => HeldSizing {
                flows: HELD_MIN_ENTRIES,
                source: HeldSource::Default,
            },
        }
    }

    /// NAT guards each held guard table holds.
    pub fn guards(&self) -> u32 {
        guards_for(self.flows)
    }
}

/// The held tables' sizes at load time for flow tables of `flows`: `(map, max_entries)`.
pub fn held_sizes(flows: u32) -> [(&'static str, u32); 4] {
    let guards = guards_for(flows);
    [
        (names::HELD_FLOWS4, flows),
        (names::HELD_GUARD4, guards),
        (v6::HELD_FLOWS6, flows),
        (v6::HELD_GUARD6, guards),
    ]
}

impl FastPath {
    /// Connections the loaded IPv4 held flow table holds (its size as created or adopted).
    pub fn held_capacity(&self) -> Result<u32, BpfError> {
        self.capacity(names::HELD_FLOWS4)
    }
}

impl fmt::Display for HeldSizing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} connections and {} hostPort guards per family",
            self.flows,
            self.guards()
        )?;
        match self.source {
            HeldSource::Flag => write!(f, ", set by --ebpf-held-max-entries"),
            HeldSource::Conntrack(max) if max == self.flows => {
                write!(f, ", as many as conntrack tracks (nf_conntrack_max)")
            }
            HeldSource::Conntrack(max) => write!(
                f,
                " (nf_conntrack_max is {max}; the default stays within {HELD_MIN_ENTRIES}-\
                 {HELD_MAX_DEFAULT_ENTRIES}, --ebpf-held-max-entries sets it)"
            ),
            HeldSource::Default => write!(f, " (nf_conntrack_max unreadable: the default)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sized_to_conntrack_within_the_default_range() {
        let s = HeldSizing::from_conntrack_max(Some(262_144));
        assert_eq!((s.flows, s.guards()), (262_144, 65_536));
        assert!(s.to_string().contains("as many as conntrack tracks"), "{s}");
        // A small node's conntrack: the object's size, no less.
        let s = HeldSizing::from_conntrack_max(Some(16_384));
        assert_eq!((s.flows, s.guards()), (HELD_MIN_ENTRIES, 16_384));
        assert!(s.to_string().contains("nf_conntrack_max is 16384"), "{s}");
        // A raised one: at most the default's ceiling.
        let s = HeldSizing::from_conntrack_max(Some(4_000_000));
        assert_eq!(s.flows, HELD_MAX_DEFAULT_ENTRIES);
        assert!(
            s.to_string().contains("--ebpf-held-max-entries sets it"),
            "{s}"
        );
        let s = HeldSizing::from_conntrack_max(None);
        assert_eq!((s.flows, s.source), (HELD_MIN_ENTRIES, HeldSource::Default));
    }

    #[test]
    fn the_flag_wins_and_guards_are_a_quarter() {
        let s = HeldSizing::resolve(10);
        assert_eq!((s.flows, s.guards(), s.source), (10, 3, HeldSource::Flag));
        assert!(s.to_string().contains("--ebpf-held-max-entries"), "{s}");
        assert_eq!(guards_for(1), 1);
        assert_eq!(guards_for(HELD_MIN_ENTRIES), names::HELD_GUARD4_MAX_ENTRIES);
        let sizes = held_sizes(8);
        assert_eq!(
            sizes,
            [
                (names::HELD_FLOWS4, 8),
                (names::HELD_GUARD4, 2),
                (v6::HELD_FLOWS6, 8),
                (v6::HELD_GUARD6, 2)
            ]
        );
    }
}
