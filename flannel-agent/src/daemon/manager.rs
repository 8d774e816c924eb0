//! The two subnet managers behind one type, so the start-up sequence reads the same in etcd and
//! kube mode.

use std::{sync::Arc, time::Duration};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::{
    alloc::PreviousSubnets,
    backend::MacAddr,
    cli::Cli,
    lease::{Lease, LeaseAttrs},
    netconf::NetConfig,
    subnet::{
        LeasePublisher,
        etcd::{EtcdOptions, EtcdSubnetManager},
        kube::{
            self as kube_sm, AddressFamily, KubeSubnetManager, NodeNameSource, StoredPublicIps,
        },
    },
};

use super::DaemonError;

/// Where leases live.
#[derive(Clone)]
pub enum SubnetManager {
    Etcd(Arc<EtcdSubnetManager>),
    Kube(Arc<KubeSubnetManager>),
}

impl SubnetManager {
    /// Connects to etcd, or builds the Kubernetes client and resolves the node name.
    pub async fn from_cli(cli: &Cli) -> Result<Self, DaemonError> {
        if cli.kube_subnet_mgr {
            let client =
                kube_sm::build_client(cli.kube_api_url.as_deref(), cli.kubeconfig_file.as_deref())
                    .await?;
            let node = kube_sm::resolve_node_name(&client, &NodeNameSource::from_env()).await?;
            let manager = KubeSubnetManager::new(
                client,
                node,
                &cli.kube_annotation_prefix,
                cli.net_config_path.clone(),
            )?
            .with_set_node_network_unavailable(cli.set_node_network_unavailable);
            Ok(Self::Kube(Arc::new(manager)))
        } else {
            Ok(Self::Etcd(Arc::new(
                EtcdSubnetManager::connect(&EtcdOptions::from_cli(cli)).await?,
            )))
        }
    }

    /// The network configuration. In etcd mode it is retried every second until it exists
    /// and is valid (upstream's start-up loop); in kube mode the file is read once.
    pub async fn network_config(
        &self,
        cancel: &CancellationToken,
    ) -> Result<NetConfig, DaemonError> {
        match self {
            Self::Kube(m) => Ok(m.network_config().await?),
            Self::Etcd(m) => loop {
                match m.network_config().await {
                    Ok(checked) => return Ok(checked.config),
                    Err(err) => warn!("Couldn't fetch network config: {err}"),
                }
                tokio::select! {
                    () = cancel.cancelled() => return Err(DaemonError::Cancelled),
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            },
        }
    }

    /// Kube mode: waits for the node cache (upstream: 10 minutes, fatal unless
    /// `CONT_WHEN_CACHE_NOT_READY=true`).
    pub async fn wait_ready(&self) -> Result<(), DaemonError> {
        let Self::Kube(m) = self else { return Ok(()) };
        let timeout = kube_sm::NODE_CACHE_SYNC_TIMEOUT;
        match m.wait_for_cache(timeout).await {
            Ok(()) => Ok(()),
            Err(err) if std::env::var("CONT_WHEN_CACHE_NOT_READY").as_deref() == Ok("true") => {
                warn!("node cache not ready, continuing as CONT_WHEN_CACHE_NOT_READY asks: {err}");
                Ok(())
            }
            Err(err) => Err(err.into()),
        }
    }

    /// Public IPs stored in our Node's annotations (kube mode; they override the flags).
    pub async fn stored_public_ips(&self) -> Result<StoredPublicIps, DaemonError> {
        match self {
            Self::Kube(m) => Ok(m.stored_public_ips().await?),
            Self::Etcd(_) => Ok(StoredPublicIps::default()),
        }
    }

    /// Whether our own Node is labelled to be handed to upstream flanneld (kube mode; never
    /// with etcd, which has no such label).
    pub async fn labelled_for_upstream(&self) -> bool {
        match self {
            Self::Kube(m) => m.labelled_for_upstream().await,
            Self::Etcd(_) => false,
        }
    }

    /// The VTEP MACs published in our own Node's annotations (kube mode), so a re-created
    /// pod keeps the MAC other nodes know.
    pub async fn stored_vtep_macs(&self) -> (Option<MacAddr>, Option<MacAddr>) {
        match self {
            Self::Kube(m) => (
                m.stored_vtep_mac(AddressFamily::V4).await,
                m.stored_vtep_mac(AddressFamily::V6).await,
            ),
            Self::Etcd(_) => (None, None),
        }
    }

    pub async fn acquire_lease(
        &self,
        attrs: &LeaseAttrs,
        previous: &PreviousSubnets,
    ) -> Result<Lease, DaemonError> {
        match self {
            Self::Etcd(m) => Ok(m.acquire_lease(attrs, previous).await?),
            Self::Kube(m) => Ok(m.acquire_lease(attrs).await?),
        }
    }

    /// Publishes every remote lease until `cancel`.
    pub async fn watch_leases(
        &self,
        own: Lease,
        publisher: LeasePublisher,
        cancel: CancellationToken,
    ) -> Result<(), DaemonError> {
        match self {
            Self::Etcd(m) => {
                m.watch_leases(&own, publisher, cancel).await;
                Ok(())
            }
            Self::Kube(m) => Ok(m.watch_leases(publisher, cancel).await?),
        }
    }

    /// After the dataplane runs: etcd keeps (renews and watches) the lease until `cancel`, or
    /// returns [`EtcdError::LeaseRevoked`](crate::subnet::etcd::EtcdError::LeaseRevoked); kube marks the node's network available
    /// and keeps the Node's annotations until `cancel`, or returns
    /// [`KubeError::PodCidrChanged`](crate::subnet::kube::KubeError::PodCidrChanged).
    pub async fn complete_lease(
        &self,
        lease: Lease,
        cancel: CancellationToken,
    ) -> Result<(), DaemonError> {
        match self {
            Self::Etcd(m) => Ok(m.keep_lease(lease, cancel).await?),
            Self::Kube(m) => {
                m.complete_lease().await?;
                Ok(m.keep_own_node(&lease, cancel).await?)
            }
        }
    }

    pub fn is_kube(&self) -> bool {
        matches!(self, Self::Kube(_))
    }
}
