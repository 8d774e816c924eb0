//! The fast path's own cost inside a benchmark: the kernel's per-program run time and run
//! count (`BPF_ENABLE_STATS`), read before and after a measurement, give the time each of the
//! agent's programs took per run and in total. The counters only move while statistics are
//! on ([`Stats`]), which adds two clock reads to every program run on the machine, so
//! benchmarks take these numbers in a measurement of their own, never in the ones they report
//! as throughput or latency.

use std::{collections::BTreeMap, os::fd::OwnedFd};

use anyhow::{Context as _, Result};
use flannel_common::programs::{
    TC_BENCH_FLOOR, TC_FROM_BRIDGE, TC_FROM_NETDEV, TC_TO_NETDEV, XDP_FROM_NETDEV,
};

/// The programs whose time is counted (every node's copy of each, summed by name): the
/// agent's, and the floor the `floor-ebpf-*` variants run instead.
pub const PROGRAMS: [&str; 5] = [
    TC_FROM_BRIDGE,
    TC_FROM_NETDEV,
    TC_TO_NETDEV,
    XDP_FROM_NETDEV,
    TC_BENCH_FLOOR,
];

/// Run-time statistics switched on for as long as this lives.
pub struct Stats(#[allow(dead_code)] OwnedFd);

impl Stats {
    /// Switches the kernel's BPF run-time statistics on (off again on drop).
    pub fn enable() -> Result<Stats> {
        aya::sys::enable_stats(aya::sys::Stats::RunTime)
            .map(Stats)
            .context("BPF_ENABLE_STATS (run time)")
    }
}

/// Accumulated run time (ns) and run count per loaded program: its name and kernel id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot(BTreeMap<(String, u32), (u64, u64)>);

impl Snapshot {
    /// The current totals of the [`PROGRAMS`] loaded on the machine, each copy (every node's,
    /// every testbed's) apart. Programs that go away while they are listed are skipped.
    pub fn take() -> Snapshot {
        let mut totals = BTreeMap::new();
        for info in aya::programs::loaded_programs().flatten() {
            let Some(name) = info.name_as_str().filter(|n| PROGRAMS.contains(n)) else {
                continue;
            };
            totals.insert(
                (name.to_owned(), info.id()),
                (info.run_time().as_nanos() as u64, info.run_count()),
            );
        }
        Snapshot(totals)
    }

    /// From (name, run time ns, run count) triples, one program of each name (tests).
    pub fn from_totals(totals: &[(&str, u64, u64)]) -> Snapshot {
        Self::from_programs(
            &totals
                .iter()
                .map(|&(name, ns, runs)| (name, 0, ns, runs))
                .collect::<Vec<_>>(),
        )
    }

    /// From (name, id, run time ns, run count) quadruples (tests).
    pub fn from_programs(programs: &[(&str, u32, u64, u64)]) -> Snapshot {
        Snapshot(
            programs
                .iter()
                .map(|&(name, id, ns, runs)| ((name.to_owned(), id), (ns, runs)))
                .collect(),
        )
    }

    /// What ran between `self` and `later`, summed by name over the programs loaded at
    /// `later`: a program loaded in between counts from zero, one unloaded in between (another
    /// testbed torn down) not at all, so neither can hide what the others ran.
    pub fn until(&self, later: &Snapshot) -> Usage {
        let mut usage: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        for (key, &(ns, runs)) in &later.0 {
            let (ns0, runs0) = self.0.get(key).copied().unwrap_or_default();
            let Some(runs) = runs.checked_sub(runs0).filter(|&r| r > 0) else {
                continue;
            };
            let entry = usage.entry(key.0.clone()).or_default();
            entry.0 += ns.saturating_sub(ns0);
            entry.1 += runs;
        }
        Usage(usage)
    }
}

/// Program time and runs over a measurement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage(BTreeMap<String, (u64, u64)>);

impl Usage {
    /// Whether none of the programs ran (a kernel-path variant).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Mean time per run of `program`, ns; `None` if it did not run.
    pub fn ns_per_run(&self, program: &str) -> Option<f64> {
        let &(ns, runs) = self.0.get(program)?;
        Some(ns as f64 / runs as f64)
    }

    /// Time of `program`, ns (0 if it did not run).
    pub fn ns(&self, program: &str) -> u64 {
        self.0.get(program).map_or(0, |&(ns, _)| ns)
    }

    /// How often `program` ran.
    pub fn runs(&self, program: &str) -> u64 {
        self.0.get(program).map_or(0, |&(_, runs)| runs)
    }

    /// Time of all the programs together, ns.
    pub fn total_ns(&self) -> u64 {
        self.0.values().map(|(ns, _)| ns).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_the_difference_of_programs_that_ran() {
        let before = Snapshot::from_totals(&[(TC_FROM_BRIDGE, 1_000, 10), (TC_TO_NETDEV, 50, 1)]);
        let after = Snapshot::from_totals(&[
            (TC_FROM_BRIDGE, 5_000, 20),
            (TC_TO_NETDEV, 50, 1),
            (TC_FROM_NETDEV, 3_000, 10),
        ]);
        let usage = before.until(&after);
        assert_eq!(usage.ns_per_run(TC_FROM_BRIDGE), Some(400.0));
        assert_eq!(usage.ns_per_run(TC_FROM_NETDEV), Some(300.0));
        assert_eq!(usage.ns_per_run(TC_TO_NETDEV), None, "did not run");
        assert_eq!(
            (usage.ns(TC_FROM_NETDEV), usage.ns(TC_TO_NETDEV)),
            (3_000, 0)
        );
        assert_eq!(usage.total_ns(), 7_000);
        assert!(!usage.is_empty());
        assert!(after.until(&after).is_empty());
    }

    #[test]
    fn a_program_reloaded_in_between_is_not_counted_negative() {
        let before = Snapshot::from_totals(&[(TC_FROM_BRIDGE, 9_000, 90)]);
        let after = Snapshot::from_totals(&[(TC_FROM_BRIDGE, 100, 2)]);
        assert!(before.until(&after).is_empty());
    }

    #[test]
    fn programs_that_come_and_go_do_not_hide_the_others() {
        // Two copies (two nodes) ran; a third, another testbed's, was unloaded in between
        // (its totals would have made the sum by name shrink); a fourth was loaded.
        let before = Snapshot::from_programs(&[
            (TC_FROM_BRIDGE, 1, 1_000, 10),
            (TC_FROM_BRIDGE, 2, 2_000, 20),
            (TC_FROM_BRIDGE, 3, 90_000, 900),
        ]);
        let after = Snapshot::from_programs(&[
            (TC_FROM_BRIDGE, 1, 1_600, 12),
            (TC_FROM_BRIDGE, 2, 2_400, 22),
            (TC_FROM_BRIDGE, 4, 300, 1),
        ]);
        let usage = before.until(&after);
        assert_eq!(usage.runs(TC_FROM_BRIDGE), 5);
        assert_eq!(usage.ns(TC_FROM_BRIDGE), 1_300);
    }
}
