//! The Kubernetes subnet manager (`--kube-subnet-mgr`): leases live in Node objects.
//!
//! * The own subnet is the node's `spec.podCIDR(s)`, assigned by the controller manager; the
//!   agent only checks that it lies in `Network` and publishes its lease attributes as Node
//!   annotations ([`annotations`], [`patch`]), through the `nodes/<name>/status` subresource
//!   as upstream does (RBAC: `nodes/status: patch`).
//! * Every other node's lease is read from its annotations ([`node`]). A kube-runtime
//!   watcher with a reflector keeps a cache of all Nodes (each cut down to what the leases
//!   read, [`lean`]); on every change the nodes whose resourceVersion moved are converted
//!   again and the leases that changed are published in one snapshot
//!   ([`LeasePublisher::apply`]; the first time every lease; nothing when no lease
//!   changed). A watch
//!   that expires (410 Gone) relists; the reflector swaps the fresh listing in atomically,
//!   so nothing is lost or duplicated. Unlike upstream, a changed `podCIDR` is picked up,
//!   since the whole derived lease is compared.
//! * A malformed node (bad `public-ip`, invalid BackendData JSON, more than two pod CIDRs)
//!   is logged once per resourceVersion and left out; it never affects other nodes.
//! * The own Node is kept as a restart would write it ([`own`],
//!   [`KubeSubnetManager::keep_own_node`]): annotations that go missing are written again;
//!   upstream writes them once.

pub mod annotations;
pub mod client;
pub mod lean;
pub mod node;
pub mod own;
pub mod patch;

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{GetParams, Patch, PatchParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use serde_json::value::RawValue;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

pub use annotations::{AnnotationKeys, DEFAULT_PREFIX};
pub use client::{NodeNameSource, build_client, resolve_node_name};

use super::{LeaseId, LeasePublisher};
use crate::backend::{MacAddr, VxlanLeaseData};
use crate::gojson::RawJson;
use crate::iface::{self, PublicIpError};
use crate::lease::{Lease, LeaseAttrs};
use crate::netconf::{ConfigError, NetConfig};
use own::Upkeep;

/// How long upstream waits for the node cache to fill at startup before giving up (unless
/// `CONT_WHEN_CACHE_NOT_READY=true`); see [`KubeSubnetManager::wait_for_cache`].
pub const NODE_CACHE_SYNC_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// How often the agent repeats that its node has no pod CIDR yet.
pub const CIDR_WAIT_WARNING: Duration = Duration::from_secs(30);

/// How long the own lease is declared valid (kube-mode leases are never renewed).
pub const LEASE_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// Errors of the Kubernetes subnet manager. Texts are upstream's where it has one.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// `--kube-annotation-prefix` has more than one `/`.
    #[error("subnet/kube: prefix can contain at most single slash")]
    PrefixSlashes,
    /// `--kube-annotation-prefix` is not `fqdn[/name]`.
    #[error("subnet/kube: prefix must be in a format: fqdn/[0-9a-z-_]*")]
    PrefixFormat,
    /// No usable client configuration (kubeconfig, URL, in-cluster).
    #[error("fail to create kubernetes config: {0}")]
    Config(String),
    /// The client could not be built from the configuration.
    #[error("unable to initialize client: {0}")]
    Client(#[source] kube::Error),
    /// Neither `NODE_NAME` nor both `POD_NAME` and `POD_NAMESPACE` are set.
    #[error("env variables POD_NAME and POD_NAMESPACE must be set")]
    PodEnvMissing,
    /// The agent's own pod could not be read.
    #[error("error retrieving pod spec for '{namespace}/{pod}': {source}")]
    PodLookup {
        /// `POD_NAMESPACE`.
        namespace: String,
        /// `POD_NAME`.
        pod: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The agent's own pod has no `spec.nodeName`.
    #[error("node name not present in pod spec '{namespace}/{pod}'")]
    PodWithoutNode {
        /// `POD_NAMESPACE`.
        namespace: String,
        /// `POD_NAME`.
        pod: String,
    },
    /// `--net-config-path` could not be read.
    #[error("failed to read net conf: {path}: {source}")]
    ReadNetConf {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `--net-config-path` does not parse.
    #[error("error parsing subnet config: {0}")]
    ParseNetConf(#[source] ConfigError),
    /// The node cache did not fill in time.
    #[error("error waiting for nodeController to sync state: {0}")]
    CacheSync(String),
    /// The own node did not show up, or patching it kept failing, until the deadline.
    #[error("timeout contacting kube-api, failed to patch node {node:?}. Error: {reason}")]
    Timeout {
        /// The own node.
        node: String,
        /// Why (upstream: `context deadline exceeded`; here with the last API error).
        reason: String,
    },
    /// The own node has no `spec.podCIDR`.
    #[error("node {0:?} pod cidr not assigned")]
    PodCidrNotAssigned(String),
    /// The node has more than two pod CIDRs.
    #[error("node {0:?} pod cidrs should be IPv4/IPv6 only or dualstack")]
    TooManyPodCidrs(String),
    /// A pod CIDR does not parse (Go `net.ParseCIDR`'s text).
    #[error("invalid CIDR address: {0}")]
    InvalidCidr(String),
    /// IPv4 is enabled but a remote node has no IPv4 pod CIDR.
    #[error("missing IPv4 address on n.Spec.PodCIDRs")]
    MissingV4PodCidr,
    /// IPv6 is enabled but a remote node has no IPv6 pod CIDR.
    #[error("missing IPv6 address on n.Spec.PodCIDRs")]
    MissingV6PodCidr,
    /// The own IPv4 pod CIDR is not inside `Network`.
    #[error(
        "subnet {network:?} specified in the flannel net config doesn't contain {cidr:?} PodCIDR of the {node:?} node"
    )]
    PodCidrOutsideNetwork {
        /// `Network`.
        network: String,
        /// The pod CIDR.
        cidr: String,
        /// The own node.
        node: String,
    },
    /// The own IPv6 pod CIDR is not inside `IPv6Network`.
    #[error(
        "subnet {network:?} specified in the flannel net config doesn't contain {cidr:?} IPv6 PodCIDR of the {node:?} node"
    )]
    PodCidrOutsideIpv6Network {
        /// `IPv6Network`.
        network: String,
        /// The pod CIDR.
        cidr: String,
        /// The own node.
        node: String,
    },
    /// A remote node's annotation cannot be used (bad address, invalid JSON).
    #[error("invalid {key} annotation {value:?}: {reason}")]
    InvalidAnnotation {
        /// The annotation key.
        key: String,
        /// Its value.
        value: String,
        /// Why it was rejected.
        reason: String,
    },
    /// `node-public-ip` / `node-public-ipv6` on the own node is not an address.
    #[error("invalid {key} annotation: {source}")]
    NodePublicIp {
        /// The annotation key.
        key: String,
        /// The parse error.
        #[source]
        source: PublicIpError,
    },
    /// The patch body could not be built.
    #[error("failed to create patch for node {node:?}: {source}")]
    PatchBody {
        /// The own node.
        node: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// An API call on the own node failed.
    #[error("failed to {action} node {node:?}: {source}")]
    Api {
        /// What was attempted.
        action: &'static str,
        /// The own node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The background node watch ended (the manager is being dropped).
    #[error("the node watch stopped")]
    WatchStopped,
    /// The own Node's pod CIDRs are not the leased ones any more ([`own::upkeep`]).
    #[error(
        "node {node:?} now has pod CIDR {now}, not {leased} as leased (was the Node deleted and registered again?); exiting so that the restart takes the new one: pods with addresses in {leased} must be re-created"
    )]
    PodCidrChanged {
        /// The own node.
        node: String,
        /// The leased CIDRs (`v4[,v6]`).
        leased: String,
        /// The Node's CIDRs now.
        now: String,
    },
}

/// Poll and retry periods (upstream's values by default; tests shorten them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KubeTimings {
    /// How often `acquire_lease` looks for the own node in the cache (3 s).
    pub node_poll_interval: Duration,
    /// How long it looks before giving up (30 s).
    pub node_wait_timeout: Duration,
    /// How often a failed annotation patch is retried (3 s).
    pub patch_retry_interval: Duration,
    /// How long it is retried (30 s).
    pub patch_retry_timeout: Duration,
}

impl Default for KubeTimings {
    fn default() -> Self {
        KubeTimings {
            node_poll_interval: Duration::from_secs(3),
            node_wait_timeout: Duration::from_secs(30),
            patch_retry_interval: Duration::from_secs(3),
            patch_retry_timeout: Duration::from_secs(30),
        }
    }
}

/// An address family, to pick IPv4 or IPv6 annotations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddressFamily {
    /// IPv4 (`backend-data`, `public-ip`, …).
    V4,
    /// IPv6 (`backend-v6-data`, `public-ipv6`, …).
    V6,
}

/// The user-set `node-public-ip` / `node-public-ipv6` annotations of the own node, which
/// override `--public-ip` / `--public-ipv6` (and so also pick the interface).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoredPublicIps {
    /// `node-public-ip`.
    pub ipv4: Option<Ipv4Addr>,
    /// `node-public-ipv6`.
    pub ipv6: Option<Ipv6Addr>,
}

/// The id of a node's lease in the snapshot: `node/<name>`.
pub fn lease_id(node_name: &str) -> LeaseId {
    format!("node/{node_name}")
}

/// The running node cache: a kube-runtime watcher over all Nodes feeding a reflector store.
struct NodeCache {
    store: Store<Node>,
    /// Bumped after every change the store has taken.
    changes: watch::Receiver<u64>,
    _task: AbortOnDropHandle<()>,
}

/// The Kubernetes subnet manager. The node cache starts on first use (see
/// [`KubeSubnetManager::wait_for_cache`]; it is a task on the current tokio runtime) and
/// stops when the manager is dropped. Share it with `Arc` to run
/// [`KubeSubnetManager::watch_leases`] in a task of its own.
pub struct KubeSubnetManager {
    api: Api<Node>,
    node_name: String,
    keys: AnnotationKeys,
    net_config_path: PathBuf,
    set_node_network_unavailable: bool,
    timings: KubeTimings,
    config: OnceLock<NetConfig>,
    cache: OnceLock<NodeCache>,
}

impl std::fmt::Debug for KubeSubnetManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeSubnetManager")
            .field("node_name", &self.node_name)
            .field("prefix", &self.keys.prefix)
            .field("net_config_path", &self.net_config_path)
            .finish_non_exhaustive()
    }
}

impl KubeSubnetManager {
    /// A manager for `node_name` with annotation keys from `annotation_prefix`
    /// (`--kube-annotation-prefix`, validated here) and the network configuration at
    /// `net_config_path` (`--net-config-path`, read by [`KubeSubnetManager::network_config`]).
    pub fn new(
        client: Client,
        node_name: impl Into<String>,
        annotation_prefix: &str,
        net_config_path: impl Into<PathBuf>,
    ) -> Result<Self, KubeError> {
        Ok(KubeSubnetManager {
            api: Api::all(client),
            node_name: node_name.into(),
            keys: AnnotationKeys::new(annotation_prefix)?,
            net_config_path: net_config_path.into(),
            set_node_network_unavailable: true,
            timings: KubeTimings::default(),
            config: OnceLock::new(),
            cache: OnceLock::new(),
        })
    }

    /// `--set-node-network-unavailable` (default true): whether
    /// [`KubeSubnetManager::complete_lease`] sets the `NetworkUnavailable` condition.
    pub fn with_set_node_network_unavailable(mut self, enabled: bool) -> Self {
        self.set_node_network_unavailable = enabled;
        self
    }

    /// Replaces the poll/retry periods.
    pub fn with_timings(mut self, timings: KubeTimings) -> Self {
        self.timings = timings;
        self
    }

    /// The own node's name.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The annotation keys in use.
    pub fn keys(&self) -> &AnnotationKeys {
        &self.keys
    }

    /// Reads and parses `--net-config-path` (parse only: kube mode runs no
    /// `CheckNetworkConfig`). The file is read once; later calls return the same value.
    pub async fn network_config(&self) -> Result<NetConfig, KubeError> {
        if let Some(c) = self.config.get() {
            return Ok(c.clone());
        }
        let text = tokio::fs::read_to_string(&self.net_config_path)
            .await
            .map_err(|source| KubeError::ReadNetConf {
                path: self.net_config_path.display().to_string(),
                source,
            })?;
        let parsed = NetConfig::parse(&text).map_err(KubeError::ParseNetConf)?;
        Ok(self.config.get_or_init(|| parsed).clone())
    }

    fn cache(&self) -> &NodeCache {
        self.cache.get_or_init(|| {
            let (store, writer) = reflector::store::<Node>();
            let (tx, rx) = watch::channel(0u64);
            let task = tokio::spawn(run_node_watch(
                Api::all(self.api.clone().into_client()),
                writer,
                tx,
                self.keys.prefix.clone(),
            ));
            tracing::info!("Starting kube subnet manager");
            NodeCache {
                store,
                changes: rx,
                _task: AbortOnDropHandle::new(task),
            }
        })
    }

    /// Starts the node cache if needed and waits until the first listing is in it (upstream
    /// waits [`NODE_CACHE_SYNC_TIMEOUT`] at startup).
    pub async fn wait_for_cache(&self, timeout: Duration) -> Result<(), KubeError> {
        let cache = self.cache();
        tracing::info!("Waiting {timeout:?} for node controller to sync");
        match tokio::time::timeout(timeout, cache.store.wait_until_ready()).await {
            Ok(Ok(())) => {
                tracing::info!("Node controller sync successful");
                Ok(())
            }
            Ok(Err(_)) => Err(KubeError::WatchStopped),
            Err(_) => Err(KubeError::CacheSync("context deadline exceeded".into())),
        }
    }

    async fn get_node(&self, params: &GetParams) -> Result<Node, KubeError> {
        self.api
            .get_with(&self.node_name, params)
            .await
            .map_err(|source| KubeError::Api {
                action: "get",
                node: self.node_name.clone(),
                source,
            })
    }

    /// The own node: from the cache (polled until it appears), or with a direct GET for the
    /// `alloc` backend, which runs no cache.
    async fn own_node(&self, config: &NetConfig) -> Result<Node, KubeError> {
        let alloc = config.backend_type == "alloc";
        let deadline = Instant::now() + self.timings.node_wait_timeout;
        let mut last_error = None;
        loop {
            let found = if alloc {
                match self.get_node(&GetParams::any()).await {
                    Ok(n) => Some(n),
                    Err(e) => {
                        tracing::debug!("Failed to get node {:?}: {e}", self.node_name);
                        last_error = Some(e.to_string());
                        None
                    }
                }
            } else {
                let cache = self.cache();
                let found = cache.store.get(&ObjectRef::new(&self.node_name));
                if found.is_none() {
                    tracing::debug!("node {:?} does not exist", self.node_name);
                }
                found.map(|n| Node::clone(&n))
            };
            if let Some(n) = found {
                return Ok(n);
            }
            if !sleep_before(deadline, self.timings.node_poll_interval).await {
                return Err(self.timeout(last_error));
            }
        }
    }

    /// The own node once it has a pod CIDR, and its pod CIDRs. Upstream exits with
    /// `pod cidr not assigned` instead, and its pod goes into CrashLoopBackOff, whose delay
    /// (up to 5 minutes) keeps the node without a network for that long after the controller
    /// manager assigns the CIDR; here the agent waits, with a warning every
    /// [`CIDR_WAIT_WARNING`].
    async fn own_node_with_cidrs(
        &self,
        config: &NetConfig,
    ) -> Result<(Node, node::PodCidrs), KubeError> {
        let mut warned: Option<Instant> = None;
        loop {
            let own = self.own_node(config).await?;
            match node::own_pod_cidrs(&own) {
                Err(KubeError::PodCidrNotAssigned(_)) => {
                    if warned.is_none_or(|at| at.elapsed() >= CIDR_WAIT_WARNING) {
                        tracing::warn!(
                            "node {:?} pod cidr not assigned yet; waiting for it (assigned by \
                             kube-controller-manager --allocate-node-cidrs, or spec.podCIDR \
                             set when the node is registered)",
                            self.node_name
                        );
                        warned = Some(Instant::now());
                    }
                    tokio::time::sleep(self.timings.node_poll_interval).await;
                }
                found => return found.map(|cidrs| (own, cidrs)),
            }
        }
    }

    fn timeout(&self, last_error: Option<String>) -> KubeError {
        KubeError::Timeout {
            node: self.node_name.clone(),
            reason: match last_error {
                None => "context deadline exceeded".into(),
                Some(e) => format!("context deadline exceeded (last error: {e})"),
            },
        }
    }

    async fn patch_status(&self, body: String) -> Result<(), kube::Error> {
        let raw = RawValue::from_string(body).map_err(kube::Error::SerdeError)?;
        self.api
            .patch_status(
                &self.node_name,
                &PatchParams::default(),
                &Patch::Strategic(raw),
            )
            .await
            .map(drop)
    }

    /// Acquires the own lease (upstream `AcquireLease`): waits for the own node in the cache,
    /// takes its pod CIDR(s) (waiting until it has one, where upstream exits), checks them
    /// against the network, and patches the lease annotations onto the node
    /// (`nodes/<name>/status`, strategic merge, only the annotations that change, nothing
    /// when nothing changes; retried every 3 s for 30 s).
    ///
    /// The returned lease carries `attrs` as given (not a `public-ip-overwrite`), expires in
    /// 24 h and is IPv4-only for backends other than vxlan, host-gw and wireguard.
    pub async fn acquire_lease(&self, attrs: &LeaseAttrs) -> Result<Lease, KubeError> {
        let config = self.network_config().await?;
        let (own, cidrs) = self.own_node_with_cidrs(&config).await?;
        let name = self.node_name.as_str();

        // Unlike upstream, the containment checks come before the patch: a node whose pod
        // CIDR is outside the network is not advertised to the others.
        let mut subnet = None;
        let mut ipv6_subnet = None;
        if config.enable_ipv4
            && let Some(c) = cidrs.v4
        {
            subnet = Some(node::check_v4_in_network(config.network, c, name)?);
        }
        if config.enable_ipv6
            && let Some(c) = cidrs.v6
        {
            ipv6_subnet = Some(node::check_v6_in_network(config.ipv6_network, c, name)?);
        }
        if !matches!(
            attrs.backend_type.as_str(),
            "vxlan" | "host-gw" | "wireguard"
        ) {
            ipv6_subnet = None;
        }

        let changes = patch::annotation_changes(&self.keys, node::annotations(&own), attrs);
        if changes.is_empty() {
            tracing::debug!("node {name:?} annotations are up to date");
        } else {
            let body = patch::annotations_patch(&changes);
            self.patch_with_retry(body).await?;
        }
        Ok(Lease {
            subnet,
            ipv6_subnet,
            attrs: attrs.clone(),
            expiration: Some(SystemTime::now() + LEASE_DURATION),
        })
    }

    async fn patch_with_retry(&self, body: String) -> Result<(), KubeError> {
        let deadline = Instant::now() + self.timings.patch_retry_timeout;
        loop {
            match self.patch_status(body.clone()).await {
                Ok(()) => return Ok(()),
                Err(kube::Error::SerdeError(source)) => {
                    return Err(KubeError::PatchBody {
                        node: self.node_name.clone(),
                        source,
                    });
                }
                Err(e) => {
                    tracing::warn!("Failed to patch node {:?}: {e}", self.node_name);
                    if !sleep_before(deadline, self.timings.patch_retry_interval).await {
                        return Err(self.timeout(Some(e.to_string())));
                    }
                }
            }
        }
    }

    /// Upstream `CompleteLease`: when `--set-node-network-unavailable` is on, sets the node's
    /// `NetworkUnavailable` condition to `False` (reason `FlannelIsUp`) with one
    /// `nodes/<name>/status` strategic-merge patch. Never set back to `True`.
    pub async fn complete_lease(&self) -> Result<(), KubeError> {
        if !self.set_node_network_unavailable {
            return Ok(());
        }
        let body = patch::network_unavailable_patch(SystemTime::now());
        self.patch_status(body)
            .await
            .map_err(|source| KubeError::Api {
                action: "set NetworkUnavailable on",
                node: self.node_name.clone(),
                source,
            })
    }

    /// Keeps the own Node carrying `lease` (what `acquire_lease` returned) until `cancel`:
    /// after every change of it in the node cache, annotations that were removed or changed
    /// are written again as a restart would write them (with a warning; at most once a
    /// second, backing off to once a minute while something keeps undoing them), and a Node
    /// registered again (a new uid) is marked network-available again. Ends with
    /// [`KubeError::PodCidrChanged`] when the Node's pod CIDRs are no longer the leased
    /// ones. The `alloc` backend runs no node cache and keeps nothing.
    pub async fn keep_own_node(
        &self,
        lease: &Lease,
        cancel: CancellationToken,
    ) -> Result<(), KubeError> {
        if self.network_config().await?.backend_type == "alloc" {
            return Ok(());
        }
        let cache = self.cache();
        let mut changes = cache.changes.clone();
        // The Node `complete_lease` marked network-available just before.
        let mut known_uid = cache
            .store
            .get(&ObjectRef::new(&self.node_name))
            .and_then(|own| own.metadata.uid.clone());
        let mut gone = false;
        let mut pace = crate::pace::RewritePace::default();
        loop {
            changes.borrow_and_update();
            let cached = cache.store.get(&ObjectRef::new(&self.node_name));
            let retry = match self
                .confirmed_upkeep(cached.as_deref(), lease, &known_uid)
                .await
            {
                Ok(Upkeep::Gone) => {
                    if !gone {
                        tracing::warn!(
                            "node {:?} is gone from the API; its flannel annotations are \
                             written again when it is registered again",
                            self.node_name
                        );
                    }
                    gone = true;
                    None
                }
                Ok(Upkeep::Present { uid, rewrite }) => {
                    gone = false;
                    self.rewrite_own_node(rewrite, uid, &mut known_uid, &mut pace)
                        .await
                }
                Ok(Upkeep::PodCidrChanged { leased, now }) => {
                    return Err(KubeError::PodCidrChanged {
                        node: self.node_name.clone(),
                        leased,
                        now,
                    });
                }
                Err(e) => {
                    tracing::warn!("{e}");
                    Some(Instant::now() + self.timings.patch_retry_interval)
                }
            };
            let again = async {
                match retry {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                () = again => {}
                changed = changes.changed() => {
                    if changed.is_err() {
                        return Err(KubeError::WatchStopped);
                    }
                }
            }
        }
    }

    /// [`own::upkeep`] of the cached own Node; when that calls for work, of a fresh read
    /// instead, since the cache can lag behind the agent's own writes.
    async fn confirmed_upkeep(
        &self,
        cached: Option<&Node>,
        lease: &Lease,
        known_uid: &Option<String>,
    ) -> Result<Upkeep, KubeError> {
        let upkeep = own::upkeep(&self.keys, cached, lease);
        let calls_for_work = match &upkeep {
            Upkeep::Gone => false,
            Upkeep::Present { uid, rewrite } => !rewrite.is_empty() || uid != known_uid,
            Upkeep::PodCidrChanged { .. } => true,
        };
        if !calls_for_work {
            return Ok(upkeep);
        }
        match self.get_node(&GetParams::default()).await {
            Ok(fresh) => Ok(own::upkeep(&self.keys, Some(&fresh), lease)),
            Err(KubeError::Api {
                source: kube::Error::Api(status),
                ..
            }) if status.code == 404 => Ok(Upkeep::Gone),
            Err(e) => Err(e),
        }
    }

    /// Writes `rewrite` to the own Node (paced by `pace`), and marks its network available
    /// again when `uid` is not `known_uid` (a Node registered again). When to look again
    /// (`None`: at the next change).
    async fn rewrite_own_node(
        &self,
        rewrite: BTreeMap<String, String>,
        uid: Option<String>,
        known_uid: &mut Option<String>,
        pace: &mut crate::pace::RewritePace,
    ) -> Option<Instant> {
        if !rewrite.is_empty() {
            if let Some(at) = pace.wait_for() {
                return Some(at);
            }
            let keys: Vec<&str> = rewrite.keys().map(String::as_str).collect();
            tracing::warn!(
                "node {:?} lost or changed its flannel annotations ({}); writing them again",
                self.node_name,
                keys.join(", ")
            );
            if let Err(e) = self
                .patch_with_retry(patch::annotations_patch(&rewrite))
                .await
            {
                tracing::warn!("{e}");
                return Some(Instant::now() + self.timings.patch_retry_interval);
            }
        }
        if uid.is_some() && uid != *known_uid {
            tracing::info!(
                "node {:?} was registered again (uid {}); marking its network available again",
                self.node_name,
                uid.as_deref().unwrap_or_default()
            );
            if let Err(e) = self.complete_lease().await {
                tracing::warn!("{e}");
                return Some(Instant::now() + self.timings.patch_retry_interval);
            }
            *known_uid = uid;
        }
        None
    }

    /// The own node's `node-public-ip` / `node-public-ipv6` annotations (one GET), for the
    /// daemon to use as `--public-ip` / `--public-ipv6` before interface selection. As
    /// upstream, a failed GET is logged and gives nothing; an annotation that is not an
    /// address is an error.
    pub async fn stored_public_ips(&self) -> Result<StoredPublicIps, KubeError> {
        let own = match self.get_node(&GetParams::default()).await {
            Ok(n) => n,
            Err(e) => {
                tracing::error!("Failed to get node for backend data: {e}");
                return Ok(StoredPublicIps::default());
            }
        };
        let ann = node::annotations(&own);
        let value = |key: &str| ann.get(key).map(|v| v.as_str()).filter(|v| !v.is_empty());
        let bad = |key: &str| {
            let key = key.to_owned();
            move |source| KubeError::NodePublicIp { key, source }
        };
        Ok(StoredPublicIps {
            ipv4: value(&self.keys.node_public_ip)
                .map(iface::parse_public_ip)
                .transpose()
                .map_err(bad(&self.keys.node_public_ip))?,
            ipv6: value(&self.keys.node_public_ipv6)
                .map(iface::parse_public_ipv6)
                .transpose()
                .map_err(bad(&self.keys.node_public_ipv6))?,
        })
    }

    /// Whether this node is labelled to be handed to upstream flanneld
    /// ([`node::labelled_for_upstream`]; one GET). `false` when the GET fails (logged).
    pub async fn labelled_for_upstream(&self) -> bool {
        match self.get_node(&GetParams::default()).await {
            Ok(own) => node::labelled_for_upstream(&own),
            Err(e) => {
                tracing::warn!("reading the node's labels: {e}");
                false
            }
        }
    }

    /// The VXLAN VtepMAC this node published before (its own `backend-data` /
    /// `backend-v6-data` annotation, one GET), so a restarted agent keeps its MAC. `None`
    /// when absent, unreadable or not VXLAN data (logged).
    pub async fn stored_vtep_mac(&self, family: AddressFamily) -> Option<MacAddr> {
        let own = match self.get_node(&GetParams::default()).await {
            Ok(n) => n,
            Err(e) => {
                tracing::error!("Failed to get node for backend data: {e}");
                return None;
            }
        };
        let key = match family {
            AddressFamily::V4 => &self.keys.backend_data,
            AddressFamily::V6 => &self.keys.backend_v6_data,
        };
        let text = node::annotations(&own).get(key)?;
        let parsed = RawJson::from_json(text)
            .map_err(|e| e.to_string())
            .and_then(|raw| VxlanLeaseData::from_json(&raw).map_err(|e| e.to_string()));
        match parsed {
            Ok(d) => Some(d.vtep_mac),
            Err(e) => {
                tracing::info!("no stored VtepMAC in {key} ({text:?}): {e}");
                None
            }
        }
    }

    /// Publishes the complete set of remote leases until `cancel`: first once the node cache
    /// holds its initial listing (the snapshot is `synced` from then on), then after every
    /// change. The own node, nodes without `kube-subnet-manager: "true"` and malformed nodes
    /// are left out.
    pub async fn watch_leases(
        &self,
        publisher: LeasePublisher,
        cancel: CancellationToken,
    ) -> Result<(), KubeError> {
        let config = self.network_config().await?;
        let cache = self.cache();
        let mut changes = cache.changes.clone();
        tokio::select! {
            () = cancel.cancelled() => return Ok(()),
            ready = cache.store.wait_until_ready() => {
                ready.map_err(|_| KubeError::WatchStopped)?;
            }
        }
        let mut leases = LeaseBuilder::new(
            self.keys.clone(),
            config.enable_ipv4,
            config.enable_ipv6,
            self.node_name.clone(),
        );
        loop {
            changes.borrow_and_update();
            leases.publish(&cache.store.state(), &publisher);
            tokio::select! {
                () = cancel.cancelled() => return Ok(()),
                changed = changes.changed() => {
                    if changed.is_err() {
                        return Err(KubeError::WatchStopped);
                    }
                }
            }
        }
    }
}

/// Sleeps `interval` (or less, up to `deadline`); false when the deadline has passed.
async fn sleep_before(deadline: Instant, interval: Duration) -> bool {
    let now = Instant::now();
    if now >= deadline {
        return false;
    }
    tokio::time::sleep(interval.min(deadline - now)).await;
    true
}

/// Keeps the reflector store in sync with the API server. kube-runtime's watcher lists,
/// watches from the listed resourceVersion, follows bookmarks, resumes closed watches from
/// the last seen version and relists after a `410 Gone` ERROR event; a watch *request*
/// answered with HTTP 410 is treated the same way here (the watcher alone would retry the
/// expired version forever). The store swaps a relisting in at its end. It keeps each Node
/// cut down to what the leases read ([`lean`]).
///
/// The list is a streaming one where the API server serves them (`sendInitialEvents`, the
/// `WatchList` feature, on by default in Kubernetes 1.34): every Node comes from the API
/// server's cache as a watch event, one at a time, so neither etcd nor the agent's memory
/// sees the whole list at once. An API server that refuses it (422 Invalid: the feature off,
/// as in 1.33 by default) is listed in pages of 500 instead (consistent reads), for
/// as long as the agent runs.
async fn run_node_watch(
    api: Api<lean::LeanNode>,
    mut writer: reflector::store::Writer<Node>,
    changes: watch::Sender<u64>,
    prefix: String,
) {
    let reader = writer.as_reader();
    let mut streaming = true;
    loop {
        let config = if streaming {
            watcher::Config::default().streaming_lists()
        } else {
            watcher::Config::default()
        };
        let stream = watcher(api.clone(), config).default_backoff();
        let mut stream = std::pin::pin!(stream);
        let mut listed = false;
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => {
                    listed |= matches!(event, watcher::Event::InitDone);
                    let event = lean::event(event, &prefix);
                    // Announced: deletions, relists, and updates of what the cache holds
                    // (not status updates, which would rebuild the lease set of every node
                    // for each one).
                    let news = match &event {
                        watcher::Event::Apply(node) => reader
                            .get(&ObjectRef::from_obj(node))
                            .is_none_or(|old| !lean::same_content(&old, node)),
                        watcher::Event::Delete(_) | watcher::Event::InitDone => true,
                        watcher::Event::Init | watcher::Event::InitApply(_) => false,
                    };
                    writer.apply_watcher_event(&event);
                    if news {
                        changes.send_modify(|g| *g = g.wrapping_add(1));
                    }
                }
                Err(watcher::Error::WatchStartFailed(kube::Error::Api(status)))
                    if status.code == 410 =>
                {
                    tracing::info!("node watch expired ({}), listing again", status.message);
                    break;
                }
                Err(watcher::Error::WatchStartFailed(kube::Error::Api(status)))
                    if streaming && !listed && matches!(status.code, 400 | 422) =>
                {
                    tracing::info!(
                        "the API server does not stream lists (HTTP {}: {}); listing Nodes in \
                         pages instead",
                        status.code,
                        status.message
                    );
                    streaming = false;
                    break;
                }
                Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                    tracing::info!("node watch expired ({}), listing again", status.message);
                }
                Err(e) => tracing::warn!("node watch: {e}"),
            }
        }
    }
}

/// Turns the cached nodes into the lease set, converting each node only when its
/// resourceVersion changed (so a malformed node is logged once per version), and publishes
/// what changed: a lease event costs the nodes that changed, not a new lease set of every
/// node (12 ms at 5,000 nodes, on every event).
struct LeaseBuilder {
    keys: AnnotationKeys,
    enable_ipv4: bool,
    enable_ipv6: bool,
    own: String,
    converted: HashMap<String, Converted>,
    /// Counts the passes over the cache, to find the nodes a pass no longer saw.
    pass: u64,
}

/// A node as last converted.
struct Converted {
    /// Its resourceVersion then.
    rv: Option<String>,
    /// Its lease (`None`: not managed by flannel, or malformed).
    lease: Option<Lease>,
    /// The last pass that saw it.
    seen: u64,
}

impl LeaseBuilder {
    fn new(keys: AnnotationKeys, enable_ipv4: bool, enable_ipv6: bool, own: String) -> Self {
        LeaseBuilder {
            keys,
            enable_ipv4,
            enable_ipv6,
            own,
            converted: HashMap::new(),
            pass: 0,
        }
    }

    fn convert(&self, n: &Node) -> Option<Lease> {
        if !node::is_managed(&self.keys, n) {
            return None;
        }
        match node::node_to_lease(&self.keys, self.enable_ipv4, self.enable_ipv6, n) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!("Error turning node {:?} to lease: {e}", node::node_name(n));
                None
            }
        }
    }

    /// Publishes the lease set of `nodes` (the whole cache): the leases that changed since
    /// the last call, all of them the first time.
    fn publish(&mut self, nodes: &[Arc<Node>], publisher: &LeasePublisher) {
        publisher.apply(self.changes(nodes));
    }

    /// The leases of `nodes` that differ from the last call's: each node's lease now, or
    /// `None` for a node that no longer has one (gone, no longer managed, malformed).
    fn changes(&mut self, nodes: &[Arc<Node>]) -> Vec<(LeaseId, Option<Lease>)> {
        self.pass = self.pass.wrapping_add(1);
        let pass = self.pass;
        let mut changes = Vec::new();
        for n in nodes {
            let name = node::node_name(n);
            if name.is_empty() || name == self.own {
                continue;
            }
            let rv = n.metadata.resource_version.as_deref();
            if let Some(c) = self.converted.get_mut(name)
                && rv.is_some()
                && c.rv.as_deref() == rv
            {
                c.seen = pass;
                continue;
            }
            let lease = self.convert(n);
            let converted = Converted {
                rv: rv.map(str::to_owned),
                lease: lease.clone(),
                seen: pass,
            };
            let before = self.converted.insert(name.to_owned(), converted);
            if before.and_then(|c| c.lease) != lease {
                changes.push((lease_id(name), lease));
            }
        }
        self.converted.retain(|name, c| {
            if c.seen != pass && c.lease.is_some() {
                changes.push((lease_id(name), None));
            }
            c.seen == pass
        });
        changes
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use k8s_openapi::api::core::v1::NodeSpec;
    use kube::api::ObjectMeta;

    use super::*;

    fn node(name: &str, rv: &str, cidr: &str, ann: &[(&str, &str)]) -> Arc<Node> {
        Arc::new(Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(rv.into()),
                annotations: Some(
                    ann.iter()
                        .map(|(k, v)| (format!("flannel.alpha.coreos.com/{k}"), v.to_string()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(NodeSpec {
                pod_cidr: Some(cidr.into()),
                ..NodeSpec::default()
            }),
            status: None,
        })
    }

    const MANAGED: (&str, &str) = ("kube-subnet-manager", "true");

    #[test]
    fn builder_excludes_own_unmanaged_and_malformed() {
        let keys = AnnotationKeys::new(DEFAULT_PREFIX).unwrap();
        let mut b = LeaseBuilder::new(keys, true, false, "own".into());
        let (publisher, rx) = crate::subnet::lease_channel();
        let a = |rv: &str, cidr: &str| node("a", rv, cidr, &[MANAGED, ("public-ip", "10.0.0.2")]);
        let nodes = vec![
            node(
                "own",
                "1",
                "10.244.0.0/24",
                &[MANAGED, ("public-ip", "10.0.0.1")],
            ),
            a("2", "10.244.1.0/24"),
            node("b", "3", "10.244.2.0/24", &[("public-ip", "10.0.0.3")]),
            node("c", "4", "10.244.3.0/24", &[MANAGED, ("public-ip", "bad")]),
        ];
        b.publish(&nodes, &publisher);
        let set = rx.borrow().clone();
        assert!(set.synced);
        assert_eq!(set.leases.keys().collect::<Vec<_>>(), ["node/a"]);
        assert_eq!(
            set.leases["node/a"].subnet,
            Some("10.244.1.0/24".parse().unwrap())
        );

        // Nothing changed: nothing published.
        b.publish(&nodes, &publisher);
        assert_eq!(rx.borrow().generation, set.generation);

        // A podCIDR change with a new resourceVersion is picked up; c fixed appears; a
        // vanished node is forgotten. One snapshot for all of it.
        let nodes = vec![
            a("5", "10.244.9.0/24"),
            node(
                "c",
                "6",
                "10.244.3.0/24",
                &[MANAGED, ("public-ip", "10.0.0.4")],
            ),
        ];
        b.publish(&nodes, &publisher);
        let next = rx.borrow().clone();
        assert_eq!(next.generation, set.generation + 1);
        assert_eq!(next.leases.keys().collect::<Vec<_>>(), ["node/a", "node/c"]);
        assert_eq!(
            next.leases["node/a"].subnet,
            Some("10.244.9.0/24".parse().unwrap())
        );
        assert_eq!(b.converted.len(), 2);

        // A new resourceVersion with the same lease (a status update that got through):
        // nothing published.
        let c = node(
            "c",
            "6",
            "10.244.3.0/24",
            &[MANAGED, ("public-ip", "10.0.0.4")],
        );
        b.publish(&[a("7", "10.244.9.0/24"), c], &publisher);
        assert_eq!(rx.borrow().generation, next.generation);
        // c no longer managed, and a gone: both leases removed, in one snapshot.
        let c = node("c", "8", "10.244.3.0/24", &[("public-ip", "10.0.0.4")]);
        b.publish(&[c], &publisher);
        let last = rx.borrow().clone();
        assert_eq!(last.generation, next.generation + 1);
        assert!(last.leases.is_empty(), "{:?}", last.leases);
        assert_eq!(b.converted.len(), 1, "c is still there, without a lease");
    }

    /// A cluster of this node alone: the first pass publishes the empty set as complete, so
    /// the reconciler may delete what an earlier run left; the next pass publishes nothing.
    #[test]
    fn the_first_pass_publishes_a_complete_set_even_when_empty() {
        let keys = AnnotationKeys::new(DEFAULT_PREFIX).unwrap();
        let mut b = LeaseBuilder::new(keys, true, false, "own".into());
        let (publisher, rx) = crate::subnet::lease_channel();
        let own = node(
            "own",
            "1",
            "10.244.0.0/24",
            &[MANAGED, ("public-ip", "10.0.0.1")],
        );
        b.publish(std::slice::from_ref(&own), &publisher);
        let first = rx.borrow().clone();
        assert!(first.synced && first.leases.is_empty(), "{first:?}");
        assert_eq!(first.generation, 1);
        b.publish(&[own], &publisher);
        assert_eq!(rx.borrow().generation, 1);
    }

    /// Whatever the sequence of node sets, what is published equals converting every node
    /// of the last set from scratch.
    #[test]
    fn published_changes_add_up_to_the_whole_set() {
        let keys = AnnotationKeys::new(DEFAULT_PREFIX).unwrap();
        let mut b = LeaseBuilder::new(keys.clone(), true, false, "own".into());
        let (publisher, rx) = crate::subnet::lease_channel();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        // The cluster: each node's object changes only with a new resourceVersion.
        let mut world: BTreeMap<String, Arc<Node>> = BTreeMap::new();
        let mut rv = 0;
        for round in 0..300 {
            for _ in 0..next(6) {
                let name = format!("n{}", next(16));
                if next(4) == 0 {
                    world.remove(&name);
                    continue;
                }
                rv += 1;
                let ip = ["10.0.0.2", "10.0.0.3", "bad"][next(3) as usize];
                let cidr = format!("10.244.{}.0/24", next(4));
                let mut ann = vec![("public-ip", ip)];
                if next(5) > 0 {
                    ann.push(MANAGED);
                }
                world.insert(name.clone(), node(&name, &rv.to_string(), &cidr, &ann));
            }
            let unique: Vec<Arc<Node>> = world.values().cloned().collect();
            b.publish(&unique, &publisher);
            let mut fresh = LeaseBuilder::new(keys.clone(), true, false, "own".into());
            let (whole, whole_rx) = crate::subnet::lease_channel();
            fresh.publish(&unique, &whole);
            assert_eq!(
                *rx.borrow().leases,
                *whole_rx.borrow().leases,
                "round {round}"
            );
        }
    }
}
