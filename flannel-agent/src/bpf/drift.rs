//! Route and node map entries that something other than the agent changed (`bpftool map
//! delete` or `update`, another tool): no notification tells of them, so the daemon compares
//! the maps with what the agent last wrote ([`FastPath::drift`]) and has the reconciler write
//! them again when they differ.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use super::fastpath::CurrentRoutes;
use super::remote::{DesiredEntries, diff};
use super::{BpfError, FastPath, Remote, Remote6};

/// How often the daemon compares the maps with what was written, at most: the next
/// comparison waits at least 50 times as long as the last one took (2 % of a core), which at
/// 5,000 remote nodes is a few milliseconds.
pub const CHECK_PERIOD: Duration = Duration::from_secs(2);

/// The route and node entries the last successful syncs wrote, per family (`None` before
/// the first).
#[derive(Default)]
pub(super) struct Synced {
    pub(super) v4: Option<DesiredEntries<Remote>>,
    pub(super) v6: Option<DesiredEntries<Remote6>>,
}

impl fmt::Debug for Synced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let routes = |w: Option<usize>| w.map_or("-".to_owned(), |n| n.to_string());
        write!(
            f,
            "Synced {{ routes4: {}, routes6: {} }}",
            routes(self.v4.as_ref().map(|w| w.routes.len())),
            routes(self.v6.as_ref().map(|w| w.routes.len()))
        )
    }
}

/// How the route and node maps of both families differ from what the agent last wrote.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Drift {
    /// Entries written and now gone.
    pub missing: usize,
    /// Entries written and now holding something else.
    pub changed: usize,
    /// Entries the agent did not write.
    pub unexpected: usize,
}

impl Drift {
    /// Nothing differs.
    pub fn is_empty(&self) -> bool {
        *self == Drift::default()
    }

    fn count<K: Ord + Copy, V: PartialEq + Copy>(
        &mut self,
        current: &BTreeMap<K, V>,
        written: &BTreeMap<K, V>,
    ) {
        let (upserts, deletes, added, _) = diff(current, written);
        self.missing += added;
        self.changed += upserts.len() - added;
        self.unexpected += deletes.len();
    }
}

impl fmt::Display for Drift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} missing, {} changed, {} not written by the agent",
            self.missing, self.changed, self.unexpected
        )
    }
}

impl FastPath {
    /// How the route and node maps differ from what the last successful [`FastPath::sync`]
    /// and [`FastPath::sync6`] wrote (nothing before the first). Reads every entry of those
    /// maps: one syscall or two per entry.
    pub fn drift(&self) -> Result<Drift, BpfError> {
        let mut drift = Drift::default();
        if let Some(written) = &self.synced.v4 {
            let CurrentRoutes { routes, invalid } = self.current_routes()?;
            drift.count(&routes, &written.routes);
            drift.unexpected += invalid.len();
            drift.count(&self.current_nodes()?, &written.nodes);
        }
        if let Some(written) = &self.synced.v6 {
            let (routes, invalid) = self.current_routes6()?;
            drift.count(&routes, &written.routes);
            drift.unexpected += invalid.len();
            drift.count(&self.current_nodes6()?, &written.nodes);
        }
        Ok(drift)
    }
}
