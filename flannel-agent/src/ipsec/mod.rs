//! The ipsec backend (flannel-upstream.md 2.6): strongSwan's charon negotiates ESP tunnels
//! between the nodes' public IPs, driven over its VICI socket by a small Rust client; the
//! agent installs the XFRM policies that send pod traffic into them.
//!
//! Start-up ([`IpsecBackend::prepare`], before the lease): the kernel must do ESP. The probe
//! creates and deletes an ESP state; a kernel without XFRM or ESP (this machine: policies
//! work, ESP states are refused with "Requested type not found") stops the agent with an
//! error that says so, instead of announcing a node whose traffic would be dropped.
//! Then ([`IpsecBackend::start`]) charon is used or started, and the shared IKE key owned by
//! this node's public IP is loaded.
//!
//! Every reconcile ([`IpsecApplier`]): one connection per remote lease (the desired model's
//! [`Reach::Ipsec`] paths), its peer's key, and three XFRM policies; missing ones are loaded,
//! stale ones (names with this node's prefix, policies with reqid 11 facing the local
//! subnet) unloaded in [`SyncMode::Full`].
//!
//! | file | job |
//! |---|---|
//! | [`vici`] | the VICI wire format: packets, messages, sections, lists |
//! | [`client`] | the VICI client: commands, streamed commands, the ones used here |
//! | [`conns`] | connection names and `load-conn` / `load-shared` messages |
//! | [`charon`] | finding, starting or attaching to charon |
//! | [`xfrm`] | XFRM policies and the ESP probe over netlink |

pub mod charon;
pub mod client;
pub mod conns;
pub mod vici;
pub mod xfrm;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use futures::future::BoxFuture;
use ipnet::{IpNet, Ipv4Net};

pub use charon::{Charon, CharonError, CharonOptions};
pub use client::{ViciClient, ViciError};
pub use conns::ConnSpec;
pub use xfrm::{EspUnavailable, Policy, Xfrm, XfrmError};

use crate::{
    backend::IpsecOptions,
    dataplane::{Applier, ApplyReport, Desired, Local, Reach, SyncMode},
    iface::ExternalInterface,
};

/// Errors of the ipsec backend.
#[derive(Debug, thiserror::Error)]
pub enum IpsecError {
    /// The kernel cannot run IPsec.
    #[error("the ipsec backend cannot run on this node: {0}")]
    Unavailable(#[from] EspUnavailable),
    /// No public IPv4 address.
    #[error("the ipsec backend needs an IPv4 public address on {0}")]
    NoPublicIp(String),
    /// charon could not be started or reached.
    #[error(transparent)]
    Charon(#[from] CharonError),
    /// A VICI exchange failed.
    #[error(transparent)]
    Vici(#[from] ViciError),
    /// An XFRM operation failed.
    #[error(transparent)]
    Xfrm(#[from] XfrmError),
    /// The lease has no IPv4 subnet.
    #[error("the ipsec backend needs an IPv4 subnet in the lease")]
    NoSubnet,
}

/// The checked kernel, before charon is involved.
#[derive(Debug)]
pub struct IpsecBackend {
    options: IpsecOptions,
    xfrm: Xfrm,
    public_ip: Ipv4Addr,
    charon: CharonOptions,
}

impl IpsecBackend {
    /// Checks that XFRM and ESP work here (see the module documentation).
    pub async fn prepare(
        options: &IpsecOptions,
        ext: &ExternalInterface,
    ) -> Result<Self, IpsecError> {
        let public_ip = ext
            .ext_addr
            .ok_or_else(|| IpsecError::NoPublicIp(ext.name.clone()))?;
        let xfrm = Xfrm::open().map_err(|e| EspUnavailable::NoXfrm(e.to_string()))?;
        xfrm.probe_esp().await?;
        Ok(IpsecBackend {
            options: options.clone(),
            xfrm,
            public_ip,
            charon: CharonOptions::default(),
        })
    }

    /// A backend for an XFRM handle already open, without the ESP probe (tests drive the
    /// VICI side on kernels without ESP this way).
    pub fn unchecked(
        options: &IpsecOptions,
        xfrm: Xfrm,
        public_ip: Ipv4Addr,
        charon: CharonOptions,
    ) -> Self {
        IpsecBackend {
            options: options.clone(),
            xfrm,
            public_ip,
            charon,
        }
    }

    /// Uses or starts charon, loads this node's shared key (retried every second for a
    /// minute: charon may still be loading its plugins) and returns the applier.
    pub async fn start(self, local: &Local) -> Result<IpsecApplier, IpsecError> {
        let local_subnet = local.lease.subnet.ok_or(IpsecError::NoSubnet)?;
        let charon = Charon::start_or_attach(&self.charon).await?;
        let mut attempts = 0;
        let client = loop {
            attempts += 1;
            let result = async {
                let mut c = ViciClient::connect(charon.socket()).await?;
                c.load_shared(conns::shared_key(self.options.psk.expose(), self.public_ip))
                    .await?;
                Ok::<_, ViciError>(c)
            }
            .await;
            match result {
                Ok(c) => break c,
                Err(e) if attempts < 60 => {
                    tracing::warn!("loading the IKE key into charon (will retry): {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        Ok(IpsecApplier {
            options: self.options,
            xfrm: self.xfrm,
            public_ip: self.public_ip,
            local_subnet: local_subnet.trunc(),
            charon,
            client: Some(client),
            first: true,
        })
    }
}

/// The ipsec applier (see the module documentation).
#[derive(Debug)]
pub struct IpsecApplier {
    options: IpsecOptions,
    xfrm: Xfrm,
    public_ip: Ipv4Addr,
    local_subnet: Ipv4Net,
    charon: Charon,
    client: Option<ViciClient>,
    first: bool,
}

impl IpsecApplier {
    /// The connections `desired` asks for.
    pub fn desired_conns(&self, desired: &Desired) -> BTreeMap<String, ConnSpec> {
        desired
            .paths()
            .filter_map(|(_, path)| match (path.reach, path.subnet) {
                (Reach::Ipsec { public_ip }, IpNet::V4(subnet)) => Some(ConnSpec {
                    local_ip: self.public_ip,
                    local_subnet: self.local_subnet,
                    remote_subnet: subnet,
                    remote_ip: public_ip,
                }),
                _ => None,
            })
            .map(|c| (c.name(), c))
            .collect()
    }

    /// The charon in use.
    pub fn charon(&self) -> &Charon {
        &self.charon
    }

    async fn client(&mut self) -> Result<&mut ViciClient, ViciError> {
        if self.client.is_none() {
            self.client = Some(ViciClient::connect(self.charon.socket()).await?);
        }
        // Just set when it was missing.
        self.client
            .as_mut()
            .ok_or_else(|| ViciError::Unknown("client".into()))
    }

    async fn sync_vici(
        &mut self,
        want: &BTreeMap<String, ConnSpec>,
        mode: SyncMode,
        report: &mut ApplyReport,
    ) -> Result<(), ViciError> {
        let prefix = conns::name_prefix(self.public_ip, self.local_subnet);
        let psk = self.options.psk.expose().clone();
        let options = self.options.clone();
        let first = self.first;
        let own_ip = self.public_ip;
        let client = self.client().await?;
        let loaded: BTreeSet<String> = client
            .get_conns()
            .await?
            .into_iter()
            .filter(|n| n.starts_with(&prefix))
            .collect();
        let keys: BTreeSet<String> = client
            .get_shared()
            .await
            .unwrap_or_default()
            .into_iter()
            .collect();
        for (name, spec) in want {
            let present = loaded.contains(name);
            // The first sync reloads every connection: options may have changed since they
            // were loaded (charon keeps a connection whose configuration is unchanged).
            if present && !first {
                report.stats.unchanged += 1;
                continue;
            }
            if !keys.contains(&conns::shared_key_id(spec.remote_ip)) || first {
                client
                    .load_shared(conns::shared_key(&psk, spec.remote_ip))
                    .await?;
            }
            client.load_conn(spec.message(&options)).await?;
            report.stats.ops += 1;
            if present {
                report.stats.unchanged += 1;
            } else {
                report.stats.added += 1;
                tracing::info!(conn = %name, "loaded IPsec connection");
            }
        }
        if mode == SyncMode::Full {
            let wanted_ips: BTreeSet<Ipv4Addr> = want.values().map(|c| c.remote_ip).collect();
            for name in loaded.difference(&want.keys().cloned().collect()) {
                client.unload_conn(name).await?;
                report.stats.deleted += 1;
                report.stats.ops += 1;
                tracing::info!(conn = %name, "unloaded IPsec connection");
                if let Some(ip) = name
                    .rsplit('-')
                    .next()
                    .and_then(|s| s.parse::<Ipv4Addr>().ok())
                    && !wanted_ips.contains(&ip)
                    && ip != own_ip
                    && keys.contains(&conns::shared_key_id(ip))
                {
                    client.unload_shared(&conns::shared_key_id(ip)).await?;
                }
            }
        }
        Ok(())
    }

    async fn sync_policies(
        &mut self,
        want: &BTreeMap<String, ConnSpec>,
        mode: SyncMode,
        report: &mut ApplyReport,
    ) -> Result<(), XfrmError> {
        let desired: BTreeSet<Policy> = want
            .values()
            .flat_map(|c| {
                xfrm::policies_for(c.local_subnet, c.local_ip, c.remote_subnet, c.remote_ip)
            })
            .collect();
        let local_ip = IpAddr::V4(self.public_ip);
        let have: BTreeSet<Policy> = self
            .xfrm
            .list()
            .await?
            .into_iter()
            .filter(|p| xfrm::is_ours(p, self.local_subnet, local_ip))
            .collect();
        for p in desired.difference(&have) {
            self.xfrm.update(*p).await?;
            report.stats.added += 1;
            report.stats.ops += 1;
        }
        if mode == SyncMode::Full {
            for p in have.difference(&desired) {
                self.xfrm.delete(*p).await?;
                report.stats.deleted += 1;
                report.stats.ops += 1;
            }
        }
        Ok(())
    }

    async fn sync_inner(&mut self, desired: &Desired, mode: SyncMode) -> ApplyReport {
        let mut report = ApplyReport::default();
        let want = self.desired_conns(desired);
        if let Err(e) = self.sync_policies(&want, mode, &mut report).await {
            report.fail("ipsec:xfrm", e.to_string());
        }
        match self.sync_vici(&want, mode, &mut report).await {
            Ok(()) => self.first = false,
            Err(e) => {
                // Reconnect next time (charon may have restarted).
                self.client = None;
                report.fail("ipsec:vici", e.to_string());
            }
        }
        report
    }
}

impl Applier for IpsecApplier {
    fn name(&self) -> &'static str {
        "ipsec"
    }

    fn sync<'a>(
        &'a mut self,
        _local: &'a Local,
        desired: &'a Desired,
        mode: SyncMode,
    ) -> BoxFuture<'a, ApplyReport> {
        Box::pin(self.sync_inner(desired, mode))
    }
}
