//! What the reconciler reports for health checks and metrics, published on a
//! `tokio::sync::watch` channel ([`Reconciler::status`](super::Reconciler::status)).

use std::{
    collections::BTreeMap,
    net::IpAddr,
    time::{Duration, SystemTime},
};

use super::applier::ApplyStats;

/// The reconciler's state after its latest attempt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataplaneStatus {
    /// Reconciles attempted.
    pub reconciles: u64,
    /// Reconciles that failed (device, fact or listing errors, or failed operations).
    pub failures: u64,
    /// Failures since the last success (0 when healthy).
    pub consecutive_failures: u32,
    /// When the latest reconcile started.
    pub last_attempt: Option<SystemTime>,
    /// When the latest successful reconcile finished.
    pub last_success: Option<SystemTime>,
    /// How long the latest reconcile took.
    pub last_duration: Duration,
    /// The lease snapshot generation the latest successful reconcile applied.
    pub applied_generation: Option<u64>,
    /// True once a reconcile against a complete (synced) lease set succeeded.
    pub synced: bool,
    /// Remote leases with at least one path programmed.
    pub peers: usize,
    /// Host-gw peer subnets without a route because their public IP is not directly
    /// reachable.
    pub unreachable: usize,
    /// Leases (or families of them) ignored: other backend, unusable data, no public IP.
    pub ignored: usize,
    /// Overlapping subnets and duplicate VTEP MACs.
    pub conflicts: usize,
    /// Peer paths not programmed because their device is missing.
    pub skipped: u64,
    /// Counts of the latest reconcile, summed over the appliers.
    pub last: ApplyStats,
    /// Counts since start.
    pub totals: ApplyStats,
    /// Errors since start by kind (`route:EINVAL`, `device:ENODEV`, `list:timeout`, ...).
    pub errors_by_kind: BTreeMap<String, u64>,
    /// The latest error message, cleared by a successful reconcile.
    pub last_error: Option<String>,
    /// How often a device had to be created again after start-up (deleted under the agent
    /// or found incompatible).
    pub device_recreations: u64,
    /// The external interface's addresses this node was started with that it no longer
    /// holds (the lease still advertises them).
    pub missing_addresses: Vec<IpAddr>,
}

impl DataplaneStatus {
    /// Healthy: the complete lease set has been applied and the latest attempt succeeded.
    pub fn healthy(&self) -> bool {
        self.synced && self.consecutive_failures == 0
    }
}
