//! The seam between the one reconciler and its appliers: the kernel applier
//! ([`KernelApplier`](super::KernelApplier): routes, neighbours, FDB) and the eBPF map applier
//! (`crate::bpf`, which implements [`Applier`] for its maps). Both receive the same
//! [`Desired`] model and make their own state match it.

use std::{collections::BTreeMap, fmt};

use futures::future::BoxFuture;

use super::model::{Desired, Local};

/// Whether an applier may remove state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// The lease set is complete: add, replace and delete.
    Full,
    /// The lease set is not known yet (the subnet manager has not listed): add and replace
    /// only, never delete (the kernel may hold routes for peers not yet seen).
    AddOnly,
}

impl SyncMode {
    /// The mode a lease snapshot allows: deletions only once the lease set is complete.
    pub fn of(snapshot: &crate::subnet::LeaseSnapshot) -> Self {
        if snapshot.synced {
            SyncMode::Full
        } else {
            SyncMode::AddOnly
        }
    }
}

/// Counts of one sync (or sums over many).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Objects that were missing and were added.
    pub added: u64,
    /// Objects that existed with other attributes and were replaced.
    pub replaced: u64,
    /// Objects that were not desired and were removed.
    pub deleted: u64,
    /// Desired objects already in place.
    pub unchanged: u64,
    /// Operations that failed.
    pub errors: u64,
    /// Write operations issued (netlink requests, map updates).
    pub ops: u64,
    /// Desired peer paths this applier cannot carry (e.g. their device is missing).
    pub skipped: u64,
}

impl ApplyStats {
    /// Adds `other` to `self`.
    pub fn accumulate(&mut self, other: &ApplyStats) {
        self.added += other.added;
        self.replaced += other.replaced;
        self.deleted += other.deleted;
        self.unchanged += other.unchanged;
        self.errors += other.errors;
        self.ops += other.ops;
        self.skipped += other.skipped;
    }

    /// Whether anything was written.
    pub fn changed(&self) -> bool {
        self.added + self.replaced + self.deleted > 0
    }
}

impl fmt::Display for ApplyStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "added {}, replaced {}, deleted {}, unchanged {}, errors {}, ops {}, skipped {}",
            self.added,
            self.replaced,
            self.deleted,
            self.unchanged,
            self.errors,
            self.ops,
            self.skipped
        )
    }
}

/// One failure during a sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyError {
    /// A short, bounded label for metrics, e.g. `route:EINVAL`, `fdb:timeout`, `list:other`.
    pub kind: String,
    /// The full message (operation, object, kernel text).
    pub message: String,
}

impl fmt::Display for ApplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// What one sync did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// Counts.
    pub stats: ApplyStats,
    /// Failures (the first few carry full messages; all are counted in `stats.errors`).
    pub errors: Vec<ApplyError>,
    /// The kernel entries this sync added or replaced (the kernel tells of each with a
    /// notification, which the reconciler then knows for its own).
    pub written: Vec<crate::netlink::Entry>,
    /// The kernel entries this sync deleted, likewise.
    pub removed: Vec<crate::netlink::Entry>,
}

impl ApplyReport {
    /// Records one failure: counted in `stats.errors` and kept with its message.
    pub fn fail(&mut self, kind: impl Into<String>, message: impl Into<String>) {
        self.stats.errors += 1;
        self.errors.push(ApplyError {
            kind: kind.into(),
            message: message.into(),
        });
    }

    /// Error counts by kind.
    pub fn errors_by_kind(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for e in &self.errors {
            *out.entry(e.kind.clone()).or_insert(0) += 1;
        }
        out
    }
}

/// Something that makes part of the dataplane match a [`Desired`] state.
///
/// An applier must be idempotent and level-triggered: it compares what it owns with what is
/// desired and writes only the difference, so a restart or a periodic resync changes nothing
/// when nothing changed. Errors are reported, never fatal: the reconciler retries with
/// back-off.
pub trait Applier: Send {
    /// A short name for logs and status (`kernel`, `ebpf`).
    fn name(&self) -> &'static str;

    /// Whether a sync is cheap enough (milliseconds, like writing BPF maps) to be run again at
    /// once for a newer lease snapshot while slower appliers are still busy with the previous
    /// one (see `Reconciler::reconcile_once`).
    fn quick(&self) -> bool {
        false
    }

    /// Tells the applier that what it owns may have been changed by something else (a
    /// notification of the kernel's, a periodic resync): its next sync reads its state instead
    /// of taking it to be what its last sync left.
    fn invalidate(&mut self) {}

    /// Makes the applier's state match `desired` for node `local`. In
    /// [`SyncMode::AddOnly`] nothing may be removed.
    fn sync<'a>(
        &'a mut self,
        local: &'a Local,
        desired: &'a Desired,
        mode: SyncMode,
    ) -> BoxFuture<'a, ApplyReport>;
}
