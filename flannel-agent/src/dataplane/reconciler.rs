//! The reconciler task: one loop that makes the dataplane match the lease set.
//!
//! It reconciles
//! * at start (with an unsynced lease set only adding, never deleting),
//! * whenever the lease snapshot changes (bursts coalesce in the `watch` channel),
//! * on link events that concern its devices or the external interface (a deleted
//!   `flannel.<VNI>` is recreated with its persisted MAC and all peers are programmed again in
//!   the same pass), and on the removal of one of its routes, neighbours or FDB entries by
//!   something else, or a change to them (a route where a peer's may be, a static neighbour
//!   or FDB entry on one of its devices: its own writes and deletions are told apart,
//!   [`super::own_changes`]),
//! * every `--resync-interval` seconds, which heals drift (a route deleted by hand comes back,
//!   a stray route with the flannel protocol goes away).
//!
//! A reconcile is: ensure devices → read facts → compute [`desired`] → every applier syncs.
//! An applier reads what it owns unless the reconcile is for a new lease snapshot alone: then
//! it diffs against what its last complete sync left (the kernel applier skips listing its
//! 15,000 entries at 5,000 peers). Kernel notifications that concern the dataplane, the
//! periodic resync and failures make the next reconcile read again.
//! Failures are logged and retried with exponential back-off; nothing is fatal. On
//! cancellation the loop ends and leaves every device, route, neighbour and FDB entry in place
//! (a restarted agent adopts them without a single change).

use std::{
    collections::HashSet,
    net::IpAddr,
    time::{Duration, SystemTime},
};

use futures::{Stream, StreamExt as _};
use tokio::{
    sync::watch,
    time::{Instant, sleep_until},
};

use crate::{
    backend::BackendOptions,
    cli::Cli,
    netlink::{Entry, IpFamily, LinkEvent, Netlink, RT_TABLE_MAIN, RTPROT_FLANNEL},
    subnet::LeaseSnapshot,
};

use super::{
    applier::{Applier, ApplyStats, SyncMode},
    desired::desired,
    devices::{IPIP_DEVICE, ensure_devices},
    facts::Facts,
    kernel::{KernelApplier, RTPROT_KERNEL, error_kind},
    model::{Local, Note},
    own_changes::OwnChanges,
    status::DataplaneStatus,
};
use crate::pace::RewritePace;

/// What makes the reconciler look at the dataplane again, besides the lease set and its
/// periodic resync ([`Reconciler::run`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// A notification of the kernel's (links, addresses, routes, neighbours), acted on when it
    /// concerns the dataplane.
    Kernel(LinkEvent),
    /// The fast path's route or node maps no longer hold what the agent wrote
    /// (`daemon::fastpath::check_maps`); no notification tells of BPF map changes.
    MapsDrifted,
}

impl From<LinkEvent> for Trigger {
    fn from(event: LinkEvent) -> Self {
        Trigger::Kernel(event)
    }
}

/// Timing of the reconciler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconcilerConfig {
    /// Full reconcile at least this often (`--resync-interval`).
    pub resync_interval: Duration,
    /// First retry delay after a failure.
    pub backoff_initial: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// Whether the reconciler creates and repairs the backend's devices before every
    /// reconcile ([`ensure_devices`]). `false` when another component (the eBPF dataplane)
    /// owns the devices; [`Local::devices`] is then used as given.
    pub manage_devices: bool,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            resync_interval: Duration::from_secs(30),
            backoff_initial: Duration::from_millis(200),
            backoff_max: Duration::from_secs(30),
            manage_devices: true,
        }
    }
}

impl ReconcilerConfig {
    /// The configuration for the command line (`--resync-interval`); retries back off from
    /// 200 ms up to the resync interval (at most 30 s).
    pub fn from_cli(cli: &Cli) -> Self {
        Self::with_resync(Duration::from_secs(cli.resync_interval))
    }

    /// Defaults with another resync interval.
    pub fn with_resync(resync_interval: Duration) -> Self {
        let resync_interval = resync_interval.max(Duration::from_millis(100));
        Self {
            resync_interval,
            backoff_max: resync_interval.min(Duration::from_secs(30)),
            ..Self::default()
        }
    }
}

/// What one reconcile did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconcileOutcome {
    /// Nothing failed.
    pub ok: bool,
    /// Counts summed over the appliers.
    pub stats: ApplyStats,
    /// Time taken.
    pub duration: Duration,
    /// Peers left out because their public IP is not on a directly connected network
    /// ([`Note::Unreachable`]).
    pub unreachable: usize,
}

/// `kernel:812ms,ebpf:23ms`: how long each applier took in one reconcile, in order.
fn applier_timings(timings: &[(&str, Duration)]) -> String {
    timings
        .iter()
        .map(|(name, took)| format!("{name}:{took:?}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Logs each note once while it persists.
#[derive(Debug, Default)]
struct NoteLog {
    seen: HashSet<Note>,
}

impl NoteLog {
    fn update(&mut self, notes: &[Note]) {
        let current: HashSet<Note> = notes.iter().cloned().collect();
        for note in notes {
            if !self.seen.contains(note) {
                if note.is_warning() {
                    tracing::warn!("{note}");
                } else {
                    tracing::info!("{note}");
                }
            }
        }
        for gone in self.seen.difference(&current) {
            if matches!(gone, Note::Unreachable { .. }) {
                tracing::info!("no longer the case: {gone}");
            }
        }
        self.seen = current;
    }
}

/// The quick appliers of a reconcile (those before a slow one), kept busy with newer lease
/// snapshots while the slow applier runs.
struct QuickPass<'a> {
    appliers: &'a mut [Box<dyn Applier>],
    local: &'a Local,
    facts: &'a Facts,
    newer: &'a mut watch::Receiver<LeaseSnapshot>,
}

impl QuickPass<'_> {
    /// Drives `slow` to completion; every snapshot published meanwhile is synced into the
    /// quick appliers at once (`seen` set). Their failures are only logged: the reconcile the
    /// caller runs next retries everything.
    async fn alongside(
        self,
        mut slow: futures::future::BoxFuture<'_, super::applier::ApplyReport>,
        seen: &mut bool,
    ) -> super::applier::ApplyReport {
        loop {
            tokio::select! {
                report = &mut slow => return report,
                changed = self.newer.changed() => {
                    if changed.is_err() {
                        // The publisher is gone: nothing newer will come.
                        return slow.await;
                    }
                    *seen = true;
                    let snapshot = self.newer.borrow_and_update().clone();
                    let want = desired(self.local, &snapshot, self.facts);
                    let mode = SyncMode::of(&snapshot);
                    for applier in self.appliers.iter_mut().filter(|a| a.quick()) {
                        let report = applier.sync(self.local, &want, mode).await;
                        tracing::debug!(
                            applier = applier.name(),
                            generation = snapshot.generation,
                            errors = report.errors.len(),
                            stats = %report.stats,
                            "quick pass for a newer lease snapshot"
                        );
                    }
                }
            }
        }
    }
}

/// Sleeps until `at`; never returns when it is `None`.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(t) => sleep_until(t).await,
        None => std::future::pending::<()>().await,
    }
}

/// The reconciler: owns this node's [`Local`] description and the appliers.
pub struct Reconciler {
    nl: Netlink,
    local: Local,
    appliers: Vec<Box<dyn Applier>>,
    config: ReconcilerConfig,
    status: watch::Sender<DataplaneStatus>,
    notes: NoteLog,
    /// What the appliers wrote or deleted, whose notifications are not a reason to reconcile.
    own_changes: OwnChanges,
    first: bool,
}

impl std::fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler")
            .field("local", &self.local)
            .field(
                "appliers",
                &self.appliers.iter().map(|a| a.name()).collect::<Vec<_>>(),
            )
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Reconciler {
    /// A reconciler with the kernel applier.
    pub fn new(nl: Netlink, local: Local, config: ReconcilerConfig) -> Self {
        let kernel: Box<dyn Applier> = Box::new(KernelApplier::new(nl.clone()));
        Self::with_appliers(nl, local, config, vec![kernel])
    }

    /// A reconciler with exactly `appliers`, synced in order (e.g. the kernel applier, then
    /// the eBPF map applier; or only the eBPF applier).
    pub fn with_appliers(
        nl: Netlink,
        local: Local,
        config: ReconcilerConfig,
        appliers: Vec<Box<dyn Applier>>,
    ) -> Self {
        Self {
            nl,
            local,
            appliers,
            config,
            status: watch::channel(DataplaneStatus::default()).0,
            notes: NoteLog::default(),
            own_changes: OwnChanges::default(),
            first: true,
        }
    }

    /// Adds an applier, synced after the ones already there.
    pub fn push_applier(&mut self, applier: Box<dyn Applier>) {
        self.appliers.push(applier);
    }

    /// The status channel (health, metrics).
    pub fn status(&self) -> watch::Receiver<DataplaneStatus> {
        self.status.subscribe()
    }

    /// This node as the reconciler sees it now (device indexes included).
    pub fn local(&self) -> &Local {
        &self.local
    }

    fn needs_facts(&self) -> bool {
        match &self.local.backend {
            BackendOptions::Vxlan(o) => o.direct_routing,
            BackendOptions::HostGw => true,
            BackendOptions::Ipip(o) => o.direct_routing || self.local.ipip_via_ebpf,
            _ => false,
        }
    }

    /// The names of the devices this backend should have.
    fn device_names(&self) -> Vec<String> {
        match &self.local.backend {
            BackendOptions::Vxlan(o) => {
                let mut names = Vec::new();
                if self.local.stack.has_v4() {
                    names.push(o.device_name());
                }
                if self.local.stack.has_v6() {
                    names.push(o.v6_device_name());
                }
                names
            }
            BackendOptions::Ipip(_) => vec![IPIP_DEVICE.to_owned()],
            BackendOptions::Wireguard(o) => {
                crate::wireguard::device_names(o.mode, self.local.stack)
                    .into_iter()
                    .map(|(name, _)| name.to_owned())
                    .collect()
            }
            BackendOptions::Udp(_) => vec![crate::udp::TUN_DEVICE.to_owned()],
            _ => Vec::new(),
        }
    }

    /// Whether an event calls for a reconcile: one of our devices went away or appeared under
    /// a new index, the external interface changed at all (re-created; set down, which
    /// flushes every route through it, or up again; the address it was started with removed
    /// or added: not others, like IPv6 temporary addresses coming and going), one of our
    /// routes (protocol [`RTPROT_FLANNEL`]) or a neighbour or FDB entry on one of our devices
    /// was removed (by hand; our own deletions bring one reconcile more, which finds nothing
    /// to do), a route to what may be a peer's subnet or a static neighbour or FDB entry on
    /// one of our devices was added or replaced (likewise), or events were lost.
    fn concerns(&self, event: &LinkEvent) -> bool {
        let ours = |name: &str| self.device_names().iter().any(|n| n == name);
        match event {
            LinkEvent::Removed { name, .. } => ours(name) || *name == self.local.ext.name,
            LinkEvent::New { index, name } => {
                if ours(name) {
                    self.local.devices.by_name(name).map(|d| d.index) != Some(*index)
                } else {
                    *name == self.local.ext.name
                }
            }
            LinkEvent::AddressChanged { index, address } => {
                let ext = &self.local.ext;
                *index == ext.index && address.is_none_or(|a| ext.iface_addrs().any(|s| s == a))
            }
            LinkEvent::RouteRemoved { protocol, .. } => *protocol == RTPROT_FLANNEL,
            LinkEvent::RouteAdded { protocol, entry } => {
                *protocol != RTPROT_KERNEL
                    && entry.is_some_and(|e| match e {
                        Entry::Route { table, dst } => {
                            table == RT_TABLE_MAIN && self.local.may_be_peer_subnet(&dst)
                        }
                        _ => false,
                    })
            }
            LinkEvent::NeighbourRemoved { index, .. } | LinkEvent::NeighbourAdded { index, .. } => {
                self.local.devices.all().any(|d| d.index == *index)
            }
            LinkEvent::Overrun => true,
        }
    }

    /// Says, once each time it changes, which of the external interface's addresses this node
    /// was started with it no longer holds, and publishes them in the status.
    fn report_missing_addresses(&mut self, missing: &[IpAddr]) {
        let before = self.status.borrow().missing_addresses.clone();
        if before == missing {
            return;
        }
        let iface = &self.local.ext.name;
        let list = |addrs: &[IpAddr]| {
            addrs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let back: Vec<IpAddr> = before
            .iter()
            .filter(|a| !missing.contains(a))
            .copied()
            .collect();
        if !back.is_empty() {
            tracing::info!("external interface {iface} has {} again", list(&back));
        }
        let gone: Vec<IpAddr> = missing
            .iter()
            .filter(|a| !before.contains(a))
            .copied()
            .collect();
        if !gone.is_empty() {
            tracing::warn!(
                "external interface {iface} no longer has {}, the address this node was \
                 started with (the public IP its lease advertises unless --public-ip is set, \
                 and its tunnels' source): other nodes' traffic for this node's pods cannot \
                 arrive. If the interface has another address now, restart the agent to \
                 lease with it (upstream flannel needs the same)",
                list(&gone)
            );
        }
        let missing = missing.to_vec();
        self.status.send_modify(|s| s.missing_addresses = missing);
    }

    fn fail(&mut self, kind: String, message: String, started: Instant) -> ReconcileOutcome {
        let duration = started.elapsed();
        tracing::warn!(%kind, "dataplane reconcile failed: {message}");
        self.status.send_modify(|s| {
            s.failures += 1;
            s.consecutive_failures += 1;
            s.last_duration = duration;
            *s.errors_by_kind.entry(kind).or_insert(0) += 1;
            s.last_error = Some(message);
        });
        ReconcileOutcome {
            ok: false,
            stats: ApplyStats::default(),
            duration,
            unreachable: 0,
        }
    }

    /// One reconcile against `snapshot` that reads what every applier owns (the loop in
    /// [`run`](Self::run) reconciles so too, but for a new lease snapshot alone diffs against
    /// what the last reconcile left; tests and the daemon may call it directly).
    pub async fn reconcile_once(&mut self, snapshot: &LeaseSnapshot) -> ReconcileOutcome {
        self.invalidate_appliers();
        self.reconcile(snapshot, None).await.0
    }

    /// Has every applier read its state at its next sync ([`Applier::invalidate`]).
    fn invalidate_appliers(&mut self) {
        for applier in &mut self.appliers {
            applier.invalidate();
        }
    }

    /// [`Reconciler::reconcile_once`]; with `newer`, a lease snapshot published while a slow
    /// applier (the kernel's) is busy is handed at once to the quick appliers before it
    /// ([`Applier::quick`], the eBPF maps), so a lease event reaches the maps without waiting
    /// for the kernel tables of the previous one. True in the second value when that happened:
    /// the caller reconciles again, which brings the slow appliers up to date too.
    async fn reconcile(
        &mut self,
        snapshot: &LeaseSnapshot,
        newer: Option<&mut watch::Receiver<LeaseSnapshot>>,
    ) -> (ReconcileOutcome, bool) {
        let mut newer_seen = false;
        let outcome = self.reconcile_inner(snapshot, newer, &mut newer_seen).await;
        (outcome, newer_seen)
    }

    async fn reconcile_inner(
        &mut self,
        snapshot: &LeaseSnapshot,
        mut newer: Option<&mut watch::Receiver<LeaseSnapshot>>,
        newer_seen: &mut bool,
    ) -> ReconcileOutcome {
        let started = Instant::now();
        self.status.send_modify(|s| {
            s.reconciles += 1;
            s.last_attempt = Some(SystemTime::now());
        });

        let devices = if self.config.manage_devices {
            ensure_devices(&self.nl, &mut self.local).await
        } else {
            Ok(Default::default())
        };
        match devices {
            Ok(report) => {
                self.report_missing_addresses(&report.missing_addresses);
                if !report.repaired.is_empty() {
                    tracing::info!(devices = ?report.repaired, "repaired dataplane devices");
                }
                if report.device_changed() && !self.first {
                    tracing::warn!(
                        created = ?report.created,
                        recreated = ?report.recreated,
                        "dataplane devices were missing or wrong; recreated them, \
                         programming all peers again"
                    );
                    self.status.send_modify(|s| s.device_recreations += 1);
                }
            }
            Err(e) => return self.fail(e.kind(), e.to_string(), started),
        }
        self.first = false;

        let facts = if self.needs_facts() {
            let mut families = Vec::new();
            if self.local.stack.has_v4() {
                families.push(IpFamily::V4);
            }
            if self.local.stack.has_v6() {
                families.push(IpFamily::V6);
            }
            let own: Vec<u32> = self.local.devices.all().map(|d| d.index).collect();
            match Facts::read(&self.nl, &families, &own).await {
                Ok(f) => f,
                Err(e) => {
                    return self.fail(
                        error_kind("facts", &e),
                        format!("reading the routing table: {e}"),
                        started,
                    );
                }
            }
        } else {
            Facts::none()
        };

        let want = desired(&self.local, snapshot, &facts);
        self.notes.update(&want.notes);
        let mode = SyncMode::of(snapshot);

        let mut stats = ApplyStats::default();
        let mut errors = Vec::new();
        let mut timings = Vec::with_capacity(self.appliers.len());
        for idx in 0..self.appliers.len() {
            let (before, rest) = self.appliers.split_at_mut(idx);
            let applier = &mut rest[0];
            let applier_started = std::time::Instant::now();
            let report = match newer.as_deref_mut() {
                Some(rx) if !applier.quick() && before.iter().any(|a| a.quick()) => {
                    let quick = QuickPass {
                        appliers: before,
                        local: &self.local,
                        facts: &facts,
                        newer: rx,
                    };
                    quick
                        .alongside(applier.sync(&self.local, &want, mode), newer_seen)
                        .await
                }
                _ => applier.sync(&self.local, &want, mode).await,
            };
            timings.push((applier.name(), applier_started.elapsed()));
            stats.accumulate(&report.stats);
            self.own_changes.wrote(report.written);
            self.own_changes.deleted(report.removed);
            for e in report.errors {
                errors.push((applier.name(), e));
            }
        }
        let duration = started.elapsed();
        let ok = errors.is_empty();

        if !ok {
            let shown: Vec<String> = errors
                .iter()
                .take(5)
                .map(|(a, e)| format!("{a}: {e}"))
                .collect();
            tracing::warn!(
                generation = snapshot.generation,
                %stats,
                "dataplane reconcile had {} failed operations (will retry): {}",
                errors.len(),
                shown.join("; ")
            );
        } else if stats.changed() {
            tracing::info!(
                generation = snapshot.generation,
                peers = want.peers.len(),
                ?duration,
                appliers = %applier_timings(&timings),
                %stats,
                "dataplane reconciled"
            );
        } else {
            tracing::debug!(
                generation = snapshot.generation,
                peers = want.peers.len(),
                ?duration,
                "dataplane in sync"
            );
        }

        let last_error = errors.first().map(|(a, e)| format!("{a}: {e}"));
        self.status.send_modify(|s| {
            s.last_duration = duration;
            s.last = stats;
            s.totals.accumulate(&stats);
            s.peers = want.peers.len();
            s.unreachable = want.unreachable();
            s.ignored = want.ignored();
            s.conflicts = want.conflicts();
            s.skipped = stats.skipped;
            for (_, e) in &errors {
                *s.errors_by_kind.entry(e.kind.clone()).or_insert(0) += 1;
            }
            if ok {
                s.consecutive_failures = 0;
                s.last_success = Some(SystemTime::now());
                s.last_error = None;
                if snapshot.synced {
                    s.synced = true;
                    s.applied_generation = Some(snapshot.generation);
                }
            } else {
                s.failures += 1;
                s.consecutive_failures += 1;
                s.last_error = last_error;
            }
        });
        ReconcileOutcome {
            ok,
            stats,
            duration,
            unreachable: want.unreachable(),
        }
    }

    /// Runs until `shutdown` completes (the daemon passes `cancel_token.cancelled()`).
    /// `triggers` are what makes it look again besides the leases: the kernel's notifications
    /// of this namespace ([`Netlink::dataplane_events`], as [`LinkEvent`]s or
    /// [`Trigger::Kernel`]) and the fast path's map check ([`Trigger::MapsDrifted`]); the
    /// stream ending only disables those triggers. Nothing is cleaned up on the way out.
    pub async fn run<S, T, F>(
        mut self,
        mut snapshots: watch::Receiver<LeaseSnapshot>,
        mut triggers: S,
        shutdown: F,
    ) where
        S: Stream<Item = T> + Unpin,
        T: Into<Trigger>,
        F: Future<Output = ()>,
    {
        let mut shutdown = std::pin::pin!(shutdown);
        let config = self.config;
        let mut pending = true;
        let mut retry_at: Option<Instant> = None;
        let mut backoff = config.backoff_initial;
        let mut next_resync = Instant::now() + config.resync_interval;
        let mut snapshots_open = true;
        let mut links_open = true;
        // Peers left out as unreachable are looked at again before the next resync, soon at
        // first: what makes them reachable may be on its way (the external interface was
        // created again and is being given its address, a DHCP lease is pending). The delay
        // starts over whenever their number changes.
        let mut recheck_at: Option<Instant> = None;
        let mut recheck_backoff = config.backoff_initial;
        let mut unreachable = 0;
        // Whether the next reconcile must read what the appliers own: something else may
        // have changed it (a kernel notification, or the periodic resync that catches what no
        // notification tells of). A reconcile for a new lease snapshot alone diffs against
        // what the last one left.
        let mut full = true;
        // Repairs of entries something else changed or removed: the first at once, then
        // spaced (a second, doubling up to a minute while the changes keep coming), so that
        // another controller undoing them is not fought at full speed.
        let mut repairs = RewritePace::default();
        let mut repair_at: Option<Instant> = None;
        loop {
            if pending && retry_at.is_none_or(|t| t <= Instant::now()) {
                pending = false;
                if std::mem::take(&mut full) {
                    self.invalidate_appliers();
                }
                let snapshot = snapshots.borrow_and_update().clone();
                let (outcome, newer_seen) = self.reconcile(&snapshot, Some(&mut snapshots)).await;
                next_resync = Instant::now() + config.resync_interval;
                if newer_seen {
                    pending = true;
                }
                if outcome.unreachable != unreachable {
                    unreachable = outcome.unreachable;
                    recheck_backoff = config.backoff_initial;
                }
                recheck_at = None;
                if outcome.ok && unreachable > 0 {
                    tracing::debug!(
                        unreachable,
                        backoff = ?recheck_backoff,
                        "unreachable peers: looking again"
                    );
                    recheck_at = Some(Instant::now() + recheck_backoff);
                    recheck_backoff = (recheck_backoff * 2).min(config.backoff_max);
                }
                if outcome.ok {
                    retry_at = None;
                    backoff = config.backoff_initial;
                } else {
                    tracing::debug!(?backoff, "dataplane reconcile retry scheduled");
                    retry_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(config.backoff_max);
                    pending = true;
                }
                continue;
            }
            let (retry, recheck) = (sleep_until_some(retry_at), sleep_until_some(recheck_at));
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                changed = snapshots.changed(), if snapshots_open => match changed {
                    Ok(()) => pending = true,
                    Err(_) => {
                        tracing::debug!("lease publisher gone; only periodic resyncs remain");
                        snapshots_open = false;
                    }
                },
                trigger = triggers.next(), if links_open => match trigger.map(Into::into) {
                    Some(Trigger::Kernel(event)) => {
                        // The notification of one of the appliers' own changes is not.
                        if self.concerns(&event) && !self.own_changes.is_own(&event) {
                            if event.entry_change().is_some() {
                                // Within the back-off (a failing reconcile's own changes
                                // must not make it retry at once), and paced.
                                tracing::debug!(
                                    ?event,
                                    "an entry of the dataplane was changed or removed"
                                );
                                if repair_at.is_none() {
                                    match repairs.wait_for() {
                                        None => {
                                            pending = true;
                                            full = true;
                                        }
                                        Some(at) => repair_at = Some(at),
                                    }
                                }
                            } else {
                                pending = true;
                                full = true;
                                tracing::info!(?event, "link change concerns the dataplane");
                                // A device change is worth an immediate attempt, back-off or
                                // not.
                                retry_at = None;
                            }
                        }
                    }
                    Some(Trigger::MapsDrifted) => {
                        // Within the back-off, like an entry removed from the kernel.
                        pending = true;
                        tracing::debug!("fast-path map entries differ from what was written");
                    }
                    None => {
                        tracing::warn!("link notifications ended; relying on periodic resyncs");
                        links_open = false;
                    }
                },
                _ = sleep_until(next_resync) => {
                    pending = true;
                    full = true;
                    // Re-armed here too: while a retry waits, the deadline must move on.
                    next_resync = Instant::now() + config.resync_interval;
                }
                _ = retry, if pending => {}
                () = recheck => {
                    recheck_at = None;
                    pending = true;
                    full = true;
                }
                () = sleep_until_some(repair_at) => {
                    repair_at = repairs.wait_for();
                    if repair_at.is_none() {
                        // Said once the changes have come back twice within their gaps.
                        if repairs.gap() > 2 * RewritePace::FIRST {
                            tracing::warn!(
                                gap = ?repairs.gap(),
                                "routes, neighbours or FDB entries of the dataplane keep being \
                                 changed or removed by something else: putting them back \
                                 again, spaced (up to a minute apart)"
                            );
                        }
                        pending = true;
                        full = true;
                    }
                }
            }
        }
        tracing::info!(
            "dataplane reconciler stopped; devices, routes, neighbours and FDB entries stay in place"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    };

    use futures::future::BoxFuture;
    use tokio::sync::Notify;

    use super::*;
    use crate::{
        dataplane::{
            Desired,
            applier::ApplyReport,
            desired::tests::{facts, local, mac, snapshot, vx_lease, vxlan},
        },
        ip::IpStack,
    };

    /// Records the number of peers of every sync; a slow one waits for `gate` first.
    struct Recorder {
        quick: bool,
        seen: Arc<Mutex<Vec<usize>>>,
        gate: Option<Arc<Notify>>,
    }

    impl Applier for Recorder {
        fn name(&self) -> &'static str {
            if self.quick { "quick" } else { "slow" }
        }

        fn quick(&self) -> bool {
            self.quick
        }

        fn sync<'a>(
            &'a mut self,
            _local: &'a Local,
            desired: &'a Desired,
            _mode: SyncMode,
        ) -> BoxFuture<'a, ApplyReport> {
            let peers = desired.peers.len();
            Box::pin(async move {
                if let Some(gate) = &self.gate {
                    gate.notified().await;
                }
                self.seen.lock().unwrap().push(peers);
                ApplyReport::default()
            })
        }
    }

    #[tokio::test]
    async fn which_events_call_for_a_reconcile() {
        let mut local = local(vxlan(false), IpStack::Dual);
        local.devices.vxlan_v4 = Some(crate::dataplane::model::DeviceInfo {
            name: "flannel.1".into(),
            index: 7,
            mac: None,
        });
        let ext = local.ext.index;
        let r = Reconciler::with_appliers(
            Netlink::new().unwrap(),
            local,
            ReconcilerConfig::default(),
            Vec::new(),
        );
        let address = |index: u32, ip: Option<&str>| LinkEvent::AddressChanged {
            index,
            address: ip.map(|ip| ip.parse().unwrap()),
        };
        let link = |index: u32, name: &str| LinkEvent::New {
            index,
            name: name.into(),
        };
        let route_added = |protocol: u8, table: u32, dst: &str| LinkEvent::RouteAdded {
            protocol,
            entry: Some(Entry::Route {
                table,
                dst: dst.parse().unwrap(),
            }),
        };
        for (event, wanted) in [
            // The addresses the node was started with, on the external interface.
            (address(ext, Some("192.168.10.1")), true),
            (address(ext, Some("fd00:10::1")), true),
            (address(ext, None), true),
            // Another address there (an IPv6 temporary one), or the address elsewhere.
            (address(ext, Some("fd00:10::abcd")), false),
            (address(ext + 1, Some("192.168.10.1")), false),
            // Any change of the external interface; our device under a new index only.
            (link(ext, "eth0"), true),
            (link(ext + 5, "eth0"), true),
            (link(7, "flannel.1"), false),
            (link(8, "flannel.1"), true),
            (link(9, "eth1"), false),
            (
                LinkEvent::Removed {
                    index: ext,
                    name: "eth0".into(),
                },
                true,
            ),
            // Our routes, and neighbours on our devices.
            (
                LinkEvent::RouteRemoved {
                    protocol: 165,
                    entry: None,
                },
                true,
            ),
            (
                LinkEvent::RouteRemoved {
                    protocol: 3,
                    entry: None,
                },
                false,
            ),
            (
                LinkEvent::NeighbourRemoved {
                    index: 7,
                    entry: None,
                },
                true,
            ),
            (
                LinkEvent::NeighbourRemoved {
                    index: ext,
                    entry: None,
                },
                false,
            ),
            // A route added or replaced where a peer's route may be (by hand, with any
            // protocol but the kernel's), not the node's own subnet, the cluster network's
            // route, a route outside it or in another table.
            (route_added(3, 254, "10.244.2.0/24"), true),
            (route_added(165, 254, "10.244.2.0/24"), true),
            (route_added(3, 254, "fd00:244:0:2::/64"), true),
            (route_added(2, 254, "10.244.2.0/24"), false),
            (route_added(165, 254, "10.244.1.0/24"), false),
            (route_added(165, 254, "10.244.0.0/16"), false),
            (route_added(165, 254, "10.244.0.0/15"), false),
            (route_added(3, 254, "10.96.0.0/12"), false),
            (route_added(3, 100, "10.244.2.0/24"), false),
            (
                LinkEvent::RouteAdded {
                    protocol: 3,
                    entry: None,
                },
                false,
            ),
            // A static neighbour or FDB entry written on one of our devices.
            (
                LinkEvent::NeighbourAdded {
                    index: 7,
                    entry: None,
                },
                true,
            ),
            (
                LinkEvent::NeighbourAdded {
                    index: ext,
                    entry: None,
                },
                false,
            ),
            (LinkEvent::Overrun, true),
        ] {
            assert_eq!(r.concerns(&event), wanted, "{event:?}");
        }
    }

    /// An applier that reports having deleted `removed` on every sync, and counts its syncs
    /// and the invalidations before them.
    #[derive(Default)]
    struct Counting {
        removed: Vec<crate::netlink::Entry>,
        syncs: Arc<AtomicUsize>,
        invalidations: Arc<AtomicUsize>,
    }

    impl Applier for Counting {
        fn name(&self) -> &'static str {
            "counting"
        }

        fn invalidate(&mut self) {
            self.invalidations.fetch_add(1, Ordering::SeqCst);
        }

        fn sync<'a>(
            &'a mut self,
            _local: &'a Local,
            _desired: &'a Desired,
            _mode: SyncMode,
        ) -> BoxFuture<'a, ApplyReport> {
            self.syncs.fetch_add(1, Ordering::SeqCst);
            let removed = self.removed.clone();
            Box::pin(async move {
                ApplyReport {
                    removed,
                    ..ApplyReport::default()
                }
            })
        }
    }

    /// [`Reconciler::run`] with a [`Counting`] applier (no devices, no resync within a test),
    /// fed lease snapshots and kernel events by the test.
    struct Running {
        snapshots: watch::Sender<LeaseSnapshot>,
        events: tokio::sync::mpsc::Sender<LinkEvent>,
        stop: tokio::sync::oneshot::Sender<()>,
        task: tokio::task::JoinHandle<()>,
        syncs: Arc<AtomicUsize>,
        invalidations: Arc<AtomicUsize>,
    }

    impl Running {
        fn start(applier: Counting) -> Running {
            let (syncs, invalidations) = (applier.syncs.clone(), applier.invalidations.clone());
            let config = ReconcilerConfig {
                manage_devices: false,
                resync_interval: Duration::from_secs(3600),
                ..ReconcilerConfig::default()
            };
            let reconciler = Reconciler::with_appliers(
                Netlink::new().unwrap(),
                local(vxlan(false), IpStack::V4),
                config,
                vec![Box::new(applier)],
            );
            let (snapshots, rx) = watch::channel(snapshot(vec![]));
            let (events, events_rx) = tokio::sync::mpsc::channel::<LinkEvent>(8);
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(reconciler.run(
                rx,
                tokio_stream::wrappers::ReceiverStream::new(events_rx),
                async {
                    let _ = stopped.await;
                },
            ));
            Running {
                snapshots,
                events,
                stop,
                task,
                syncs,
                invalidations,
            }
        }

        /// Syncs and invalidations once at least `n` syncs ran and the loop had time for one
        /// more, if one were coming.
        async fn settled(&self, n: usize) -> (usize, usize) {
            for _ in 0..200 {
                if self.syncs.load(Ordering::SeqCst) >= n {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            (
                self.syncs.load(Ordering::SeqCst),
                self.invalidations.load(Ordering::SeqCst),
            )
        }

        async fn stop(self) {
            self.stop.send(()).unwrap();
            self.task.await.unwrap();
        }
    }

    fn removed(entry: crate::netlink::Entry) -> LinkEvent {
        LinkEvent::RouteRemoved {
            protocol: RTPROT_FLANNEL,
            entry: Some(entry),
        }
    }

    fn route_removal(dst: &str) -> crate::netlink::Entry {
        crate::netlink::Entry::Route {
            table: 254,
            dst: dst.parse().unwrap(),
        }
    }

    /// The notification of a route the reconciler deleted itself brings no reconcile; the
    /// same notification once more (someone else deleting it again), and another entry's,
    /// each bring one.
    #[tokio::test]
    async fn the_reconcilers_own_deletions_bring_no_reconcile() {
        let ours = route_removal("10.244.9.0/24");
        let r = Running::start(Counting {
            removed: vec![ours],
            ..Counting::default()
        });
        assert_eq!(r.settled(1).await.0, 1, "the first reconcile");
        // Ours, then another entry's: one reconcile, for the other.
        r.events.send(removed(ours)).await.unwrap();
        let other = route_removal("10.244.8.0/24");
        r.events.send(removed(other)).await.unwrap();
        assert_eq!(r.settled(2).await.0, 2, "only the other entry's removal");
        // That reconcile deleted ours again: its notification is ours too, a second one is
        // not (something else removed what the reconciler had not deleted again).
        r.events.send(removed(ours)).await.unwrap();
        r.events.send(removed(ours)).await.unwrap();
        assert_eq!(r.settled(3).await.0, 3, "the second notification only");
        r.stop().await;
    }

    /// The first reconcile and one for a kernel notification read what the appliers own
    /// (they are invalidated before it); one for a new lease snapshot alone does not.
    #[tokio::test]
    async fn only_a_new_lease_snapshot_alone_trusts_what_the_last_sync_left() {
        let r = Running::start(Counting::default());
        assert_eq!(r.settled(1).await, (1, 1), "the first reconcile reads");
        let mut next = snapshot(vec![(
            "10.244.2.0-24",
            vx_lease("10.244.2.0-24", [192, 168, 10, 2], mac(2)),
        )]);
        next.generation = 2;
        r.snapshots.send(next).unwrap();
        assert_eq!(r.settled(2).await, (2, 1), "a lease event alone does not");
        r.events
            .send(LinkEvent::RouteRemoved {
                protocol: RTPROT_FLANNEL,
                entry: None,
            })
            .await
            .unwrap();
        assert_eq!(
            r.settled(3).await,
            (3, 2),
            "a route removed by someone else does"
        );
        r.stop().await;
    }

    #[tokio::test]
    async fn a_newer_snapshot_reaches_the_quick_appliers_while_a_slow_one_runs() {
        let local = local(vxlan(false), IpStack::V4);
        let facts = facts();
        let (tx, mut rx) = watch::channel(snapshot(vec![]));
        let quick_seen = Arc::new(Mutex::new(Vec::new()));
        let slow_seen = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(Notify::new());
        let mut quick: Vec<Box<dyn Applier>> = vec![Box::new(Recorder {
            quick: true,
            seen: quick_seen.clone(),
            gate: None,
        })];
        let mut slow = Recorder {
            quick: false,
            seen: slow_seen.clone(),
            gate: Some(gate.clone()),
        };
        let first = desired(&local, &rx.borrow_and_update().clone(), &facts);
        let mut seen = false;
        let pass = QuickPass {
            appliers: &mut quick,
            local: &local,
            facts: &facts,
            newer: &mut rx,
        };
        let run = pass.alongside(slow.sync(&local, &first, SyncMode::Full), &mut seen);
        let driver = async {
            let mut next = snapshot(vec![(
                "10.244.2.0-24",
                vx_lease("10.244.2.0-24", [192, 168, 10, 2], mac(2)),
            )]);
            next.generation = 2;
            tx.send(next).unwrap();
            // The quick applier gets the new lease while the slow one still waits.
            for _ in 0..1000 {
                if !quick_seen.lock().unwrap().is_empty() {
                    break;
                }
                tokio::task::yield_now().await;
            }
            assert_eq!(*quick_seen.lock().unwrap(), vec![1]);
            assert!(
                slow_seen.lock().unwrap().is_empty(),
                "the slow one is still busy"
            );
            gate.notify_one();
        };
        let (report, ()) = tokio::join!(run, driver);
        assert!(report.errors.is_empty());
        assert!(seen, "the caller must reconcile again");
        assert_eq!(
            *slow_seen.lock().unwrap(),
            vec![0],
            "the slow one finished its own sync"
        );
    }
}
