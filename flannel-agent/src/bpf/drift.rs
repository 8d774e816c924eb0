//! Route and node map entries that something other than the agent changed (`bpftool map
//! delete` or `update`, another tool): no notification tells of them, so the daemon compares
//! the maps with what the agent last wrote ([`FastPath::drift`]) and has the reconciler write
//! them again when they differ.
//!
//! What was last written is also what [`FastPath::sync`] diffs a new desired set against, so
//! that a lease event costs the entries it changes, not a read of every entry (0.7 µs each
//! for the route map's LPM trie, even in batches). The maps are read instead before the first
//! sync (entries adopted from the pins of an earlier run), after a sync that failed part way,
//! and after a comparison found them changed.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use super::fastpath::CurrentRoutes;
use super::remote::{DesiredEntries, FamilyRemote, diff};
use super::{BpfError, FastPath, Remote, Remote6};

/// How often the daemon compares the maps with what was written, at most: the next
/// comparison waits at least 50 times as long as the last one took (2 % of a core), which at
/// 5,000 remote nodes is a few milliseconds.
pub const CHECK_PERIOD: Duration = Duration::from_secs(2);

/// The route and node entries the last successful syncs wrote, per family.
#[derive(Default)]
pub(super) struct Synced {
    pub(super) v4: Written<Remote>,
    pub(super) v6: Written<Remote6>,
}

/// What the last successful sync of one family wrote.
pub(super) struct Written<R: FamilyRemote> {
    /// The entries (`None` before the first sync, and while one is under way: one that fails
    /// leaves `None`).
    pub(super) entries: Option<DesiredEntries<R>>,
    /// A comparison found the maps changed since: the next sync reads them.
    pub(super) changed: bool,
}

impl<R: FamilyRemote> Default for Written<R> {
    fn default() -> Self {
        Self {
            entries: None,
            changed: false,
        }
    }
}

impl<R: FamilyRemote> Written<R> {
    /// What the last sync wrote, for the next one to diff against, taken out (`None`: read the
    /// maps instead, as they may hold something else).
    pub(super) fn take(&mut self) -> Option<DesiredEntries<R>> {
        let written = self.entries.take();
        if std::mem::take(&mut self.changed) {
            None
        } else {
            written
        }
    }

    /// Route entries written (`-` before the first sync).
    fn routes(&self) -> String {
        self.entries
            .as_ref()
            .map_or("-".to_owned(), |w| w.routes.len().to_string())
    }
}

impl fmt::Debug for Synced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Synced {{ routes4: {}, routes6: {} }}",
            self.v4.routes(),
            self.v6.routes()
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
    /// maps, in batches of a few thousand entries a syscall. A family found changed has its
    /// maps read by its next sync, which writes them back.
    pub fn drift(&mut self) -> Result<Drift, BpfError> {
        let mut v4 = Drift::default();
        if let Some(written) = &self.synced.v4.entries {
            let CurrentRoutes { routes, invalid } = self.current_routes()?;
            v4.count(&routes, &written.routes);
            v4.unexpected += invalid.len();
            v4.count(&self.current_nodes()?, &written.nodes);
        }
        let mut v6 = Drift::default();
        if let Some(written) = &self.synced.v6.entries {
            let (routes, invalid) = self.current_routes6()?;
            v6.count(&routes, &written.routes);
            v6.unexpected += invalid.len();
            v6.count(&self.current_nodes6()?, &written.nodes);
        }
        self.synced.v4.changed |= !v4.is_empty();
        self.synced.v6.changed |= !v6.is_empty();
        Ok(Drift {
            missing: v4.missing + v6.missing,
            changed: v4.changed + v6.changed,
            unexpected: v4.unexpected + v6.unexpected,
        })
    }
}
