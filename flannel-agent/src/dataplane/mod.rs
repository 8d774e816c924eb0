//! The kernel dataplane: devices, routes, neighbours and FDB entries for the vxlan, host-gw
//! and ipip backends (and the udp backend's `flannel0`, whose per-peer table lives in
//! [`crate::udp`]), kept equal to the lease set by one level-triggered reconciler.
//!
//! One desired model, several appliers: [`desired()`] is a pure function of this node
//! ([`Local`]), the remote leases ([`LeaseSnapshot`](crate::subnet::LeaseSnapshot)) and a few
//! kernel [`Facts`]; it yields one [`Peer`] per remote lease. Every [`Applier`] makes its own
//! state match that model: the [`KernelApplier`] programs routes/neighbours/FDB through
//! rtnetlink, the eBPF applier (`crate::bpf`) fills its maps.
//!
//! Daemon wiring (upstream start-up order, DESIGN.md):
//! 1. before the lease: [`prepare_vtep_macs`] (vxlan) gives the MACs to publish;
//! 2. after the lease: [`Local::new`], then [`ensure_devices`] (errors are fatal here, e.g.
//!    [`DataplaneError::HostGwNat`], [`DataplaneError::IpipNeedsEbpf`]);
//! 3. [`Reconciler::new`] (+ `push_applier` for eBPF), keep [`Reconciler::status`], spawn
//!    [`Reconciler::run`] with the lease `watch::Receiver`,
//!    [`Netlink::link_events`](crate::netlink::Netlink::link_events) and `token.cancelled()`.
//!    On SIGTERM nothing is cleaned up.
//!
//! | file | job |
//! |---|---|
//! | [`model`] | `Local`, `Peer`/`PeerPath`/`Reach`, `Desired`, `Note` |
//! | [`facts`] | which public IPs are directly connected (routing-table index, `route get`) |
//! | [`desired`](mod@desired) | the pure desired-state computation |
//! | [`applier`] | the `Applier` seam, `SyncMode`, `ApplyStats`/`ApplyReport` |
//! | [`kernel`] | the rtnetlink applier: expand, list owned state, diff, apply in batches |
//! | [`devices`] | `flannel.<VNI>` / `flannel-v6.<VNI>` / `flannel.ipip` / `flannel0`, host-gw NAT check |
//! | [`macs`] | VTEP MAC persistence in `--state-dir` |
//! | [`reconciler`] | the reconcile loop (snapshots, link events, resync, back-off) |
//! | [`own_changes`] | the appliers' own writes and deletions, told apart from others' |
//! | [`status`] | what the reconciler reports for health and metrics |

pub mod applier;
pub mod desired;
pub mod devices;
pub mod facts;
pub mod kernel;
pub mod macs;
pub mod model;
pub mod own_changes;
pub mod reconciler;
pub mod status;

use std::path::PathBuf;

pub use applier::{Applier, ApplyError, ApplyReport, ApplyStats, SyncMode};
pub use desired::desired;
pub use devices::{DeviceReport, IPIP_DEVICE, check_host_gw, ensure_devices};
pub use facts::{Facts, Reachability, RouteIndex};
pub use kernel::{KernelApplier, KernelObjects, Observed, Plan, expand, plan};
pub use macs::{MacStore, prepare_vtep_macs, resolve_vtep_mac};
pub use model::{
    Desired, DeviceInfo, Devices, ExtensionPeer, IgnoreReason, Local, Note, Peer, PeerPath, Reach,
    VtepMacs, subnet_address,
};
pub use reconciler::{ReconcileOutcome, Reconciler, ReconcilerConfig, Trigger};
pub use status::DataplaneStatus;

use crate::{
    backend::MacAddr,
    netlink::{IpFamily, NetlinkError},
};

/// Errors of the dataplane (device set-up, state files).
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// A netlink operation failed.
    #[error("{what}: {source}")]
    Netlink {
        /// What was being done, e.g. `ensure flannel.1`.
        what: String,
        /// The netlink error.
        #[source]
        source: NetlinkError,
    },
    /// The device's MAC is not the VTEP MAC (upstream's text).
    #[error("{device}'s mac address wanted: {wanted}, but got: {got}")]
    MacMismatch {
        /// The device.
        device: String,
        /// The VTEP MAC.
        wanted: MacAddr,
        /// What the device has.
        got: String,
    },
    /// host-gw behind NAT (upstream's text).
    #[error(
        "your PublicIP differs from interface IP, meaning that probably you're on a NAT, which \
         is not supported by host-gw backend"
    )]
    HostGwNat,
    /// The kernel has no ipip link type.
    #[error(
        "ipip needs the eBPF fast path here: the kernel cannot create flannel.ipip ({source}); \
         run with --dataplane=auto or --dataplane=ebpf"
    )]
    IpipNeedsEbpf {
        /// The kernel's refusal.
        #[source]
        source: NetlinkError,
    },
    /// `flannel.ipip` exists but is something else (upstream's text).
    #[error("flannel.ipip isn't an ipip mode device, please remove device and try again")]
    IpipWrongKind,
    /// A family is enabled but the lease lacks it (upstream's text).
    #[error(
        "failed to configure interface {device}: {family} is enabled but the lease has no {family}"
    )]
    LeaseLacksFamily {
        /// The device.
        device: String,
        /// The family.
        family: IpFamily,
    },
    /// The external interface has no public address of a needed family.
    #[error("cannot configure {device}: the external interface {iface} has no {family} address")]
    NoPublicAddress {
        /// The device.
        device: String,
        /// The external interface.
        iface: String,
        /// The family.
        family: IpFamily,
    },
    /// No VTEP MAC was prepared for a vxlan device.
    #[error("no VTEP MAC prepared for {device} (call prepare_vtep_macs first)")]
    NoVtepMac {
        /// The device.
        device: String,
    },
    /// The external interface disappeared.
    #[error("the external interface {name} does not exist (any more)")]
    ExternalInterfaceGone {
        /// Its name.
        name: String,
    },
    /// A device kept changing while it was being set up.
    #[error("{device} appears and disappears while it is being set up")]
    DeviceUnstable {
        /// The device.
        device: String,
    },
    /// The udp backend's TUN device does not exist (its forwarder creates it).
    #[error("{device} does not exist: the udp backend's forwarder creates it (is it running?)")]
    TunMissing {
        /// The device.
        device: String,
    },
    /// A VTEP MAC state file could not be read or written.
    #[error("VTEP MAC state file {}: {source}", path.display())]
    StateFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A VTEP MAC state file holds no usable MAC.
    #[error("VTEP MAC state file {} does not hold a unicast MAC: {content:?}", path.display())]
    StateFileContent {
        /// The file.
        path: PathBuf,
        /// The start of its content.
        content: String,
    },
}

impl DataplaneError {
    /// A short, bounded label for metrics: `device:<errno or kind>`.
    pub fn kind(&self) -> String {
        let class = match self {
            Self::Netlink { source, .. } => return kernel::error_kind("device", source),
            Self::MacMismatch { .. } => "mac_mismatch",
            Self::HostGwNat => "host_gw_nat",
            Self::IpipNeedsEbpf { .. } => "ipip_unsupported",
            Self::IpipWrongKind => "ipip_wrong_kind",
            Self::LeaseLacksFamily { .. } => "lease_lacks_family",
            Self::NoPublicAddress { .. } => "no_public_address",
            Self::NoVtepMac { .. } => "no_vtep_mac",
            Self::ExternalInterfaceGone { .. } => "external_interface_gone",
            Self::DeviceUnstable { .. } => "device_unstable",
            Self::TunMissing { .. } => "tun_missing",
            Self::StateFile { .. } | Self::StateFileContent { .. } => "state_file",
        };
        format!("device:{class}")
    }

    /// Wraps a netlink error with what was being done.
    pub fn netlink(what: impl Into<String>) -> impl FnOnce(NetlinkError) -> Self {
        let what = what.into();
        move |source| Self::Netlink { what, source }
    }
}
