//! The WireGuard applier: keeps `flannel-wg` / `flannel-wg-v6` and their peers equal to the
//! desired model, in every reconcile.
//!
//! Per device (layout by `Mode`, [`device_names`]):
//! 1. [`ensure_device`] (adopt, or create: kernel, else userspace), MTU from the MTU plan,
//!    address `<subnet address>/32` (`/128`), up, route `<Network> dev <device> scope link`
//!    (IPv6: `IPv6Network`), all idempotent;
//! 2. read the device back, [`plan`] the difference against the peers of the desired model
//!    (paths with [`Reach::Wireguard`] of the device's families, grouped by public key), apply
//!    it. Stale peers go only in [`SyncMode::Full`].
//!
//! Nothing is deleted on shutdown: the device (kernel, or detached userspace process) keeps
//! forwarding while the agent restarts, and the restarted agent adopts it.

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::{
    WireguardError,
    device::{Ensured, Implementation, WgDevice, ensure_device},
    device_names,
    key::PrivateKey,
    plan::{DesiredDevice, DesiredPeer, plan},
    userspace::Userspace,
};
use crate::{
    backend::{BackendOptions, WgKey, WireguardMode, WireguardOptions},
    dataplane::{Applier, ApplyReport, Desired, Local, Reach, SyncMode},
    netlink::{IpFamily, Netlink, Route, RouteScope},
};

/// What [`WireguardApplier::ensure_devices`] found or did, per device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSetup {
    /// The device.
    pub name: String,
    /// Its interface index.
    pub index: u32,
    /// Adopted or created.
    pub ensured: Ensured,
    /// Kernel or userspace.
    pub implementation: Implementation,
}

/// The WireGuard applier (see the module documentation).
#[derive(Debug)]
pub struct WireguardApplier {
    nl: Netlink,
    options: WireguardOptions,
    key: PrivateKey,
    userspace: Userspace,
    devices: BTreeMap<String, WgDevice>,
}

impl WireguardApplier {
    /// An applier for `options` with the node's `key`; userspace devices use `userspace`.
    pub fn new(
        nl: Netlink,
        options: WireguardOptions,
        key: PrivateKey,
        userspace: Userspace,
    ) -> Self {
        WireguardApplier {
            nl,
            options,
            key,
            userspace,
            devices: BTreeMap::new(),
        }
    }

    /// The node's public key.
    pub fn public_key(&self) -> WgKey {
        self.key.public_key()
    }

    /// The devices in place after the last [`ensure_devices`](Self::ensure_devices).
    pub fn devices(&self) -> impl Iterator<Item = &WgDevice> {
        self.devices.values()
    }

    fn options_of(local: &Local) -> Option<&WireguardOptions> {
        match &local.backend {
            BackendOptions::Wireguard(o) => Some(o),
            _ => None,
        }
    }

    fn listen_port(&self, name: &str) -> u16 {
        if name == super::DEVICE_V6 && self.options.mode == WireguardMode::Separate {
            self.options.listen_port_v6
        } else {
            self.options.listen_port
        }
    }

    /// Creates or adopts every device of `local`'s layout and sets its MTU, addresses, up
    /// state, network route, private key and listen port. The daemon calls it once at
    /// start-up (errors are fatal there); every sync calls it again (errors are retried).
    pub async fn ensure_devices(
        &mut self,
        local: &Local,
    ) -> Result<Vec<DeviceSetup>, WireguardError> {
        if let Some(o) = Self::options_of(local) {
            self.options = o.clone();
        }
        let mut out = Vec::new();
        for (name, families) in device_names(self.options.mode, local.stack) {
            let mtu = match (self.options.mode, families.as_slice()) {
                (WireguardMode::Separate, [IpFamily::V6]) => local.mtu.device_v6,
                _ => local.mtu.device_v4.or(local.mtu.device_v6),
            };
            // Steady state: the device we know is still there under its index. Only a
            // missing or replaced device goes through adoption or creation (and its logs).
            let known = match self.devices.get(name) {
                Some(d) => self
                    .nl
                    .link_by_name(name)
                    .await
                    .map_err(|source| WireguardError::Link {
                        what: "look up",
                        device: name.to_owned(),
                        source,
                    })?
                    .filter(|l| l.index == d.index)
                    .map(|_| d.clone()),
                None => None,
            };
            let (device, ensured) = match known {
                Some(d) => (d, Ensured::Adopted),
                None => ensure_device(&self.nl, &self.userspace, name, mtu).await?,
            };
            self.configure_link(local, &device, &families, mtu).await?;
            let listen_port = self.listen_port(name);
            let state = device.get().await?;
            if state.private_key.as_ref() != Some(&self.key) || state.listen_port != listen_port {
                let config = super::config::DeviceConfig {
                    private_key: Some(self.key.clone()),
                    listen_port: Some(listen_port),
                    ..Default::default()
                };
                device.set(&config).await?;
                tracing::info!(
                    device = name,
                    listen_port,
                    "set the WireGuard key and listen port"
                );
            }
            out.push(DeviceSetup {
                name: name.to_owned(),
                index: device.index,
                ensured,
                implementation: device.implementation(),
            });
            self.devices.insert(name.to_owned(), device);
        }
        Ok(out)
    }

    async fn configure_link(
        &self,
        local: &Local,
        device: &WgDevice,
        families: &[IpFamily],
        mtu: Option<u32>,
    ) -> Result<(), WireguardError> {
        let name = device.name.as_str();
        let ctx = |what: &'static str| {
            let device = name.to_owned();
            move |source| WireguardError::Link {
                what,
                device,
                source,
            }
        };
        let link = self
            .nl
            .link_by_index(device.index)
            .await
            .map_err(ctx("read back"))?
            .ok_or_else(|| WireguardError::Gone(name.to_owned()))?;
        if let Some(mtu) = mtu
            && link.mtu != mtu
        {
            self.nl
                .set_mtu(device.index, mtu)
                .await
                .map_err(ctx("set MTU of"))?;
        }
        for family in families {
            let Some(subnet) = local.own_subnet(*family) else {
                return Err(WireguardError::LeaseLacksFamily {
                    device: name.to_owned(),
                    family: *family,
                });
            };
            match subnet {
                IpNet::V4(s) => {
                    let want = Ipv4Net::new(s.network(), 32).unwrap_or(s);
                    self.nl
                        .ensure_v4_address(device.index, want, local.network.unwrap_or(s))
                        .await
                        .map_err(ctx("set the address of"))?;
                }
                IpNet::V6(s) => {
                    let want = Ipv6Net::new(s.network(), 128).unwrap_or(s);
                    self.nl
                        .ensure_v6_address(device.index, want)
                        .await
                        .map_err(ctx("set the address of"))?;
                }
            }
        }
        if !link.up {
            self.nl
                .set_link_up(device.index)
                .await
                .map_err(ctx("set up"))?;
        }
        for family in families {
            if let Some(network) = local.network_of(*family) {
                let route = Route::new(network)
                    .dev(device.index)
                    .scope(RouteScope::Link);
                self.nl
                    .replace_route(&route)
                    .await
                    .map_err(ctx("route the network to"))?;
            }
        }
        Ok(())
    }

    /// The desired configuration of device `name` carrying `families`.
    fn desired_device(
        &self,
        desired: &Desired,
        name: &str,
        families: &[IpFamily],
    ) -> DesiredDevice {
        let mut peers: BTreeMap<WgKey, DesiredPeer> = BTreeMap::new();
        for (_, path) in desired.paths() {
            let Reach::Wireguard {
                public_key,
                endpoint,
            } = path.reach
            else {
                continue;
            };
            if !families.contains(&path.family()) {
                continue;
            }
            peers
                .entry(public_key)
                .or_insert_with(|| DesiredPeer {
                    endpoint,
                    allowed_ips: Default::default(),
                    preshared_key: self.options.psk.as_ref().map(|p| *p.expose()),
                    keepalive: self.options.persistent_keepalive_interval,
                })
                .allowed_ips
                .insert(path.subnet);
        }
        DesiredDevice {
            private_key: self.key.clone(),
            listen_port: self.listen_port(name),
            peers,
        }
    }

    async fn sync_inner(
        &mut self,
        local: &Local,
        desired: &Desired,
        mode: SyncMode,
    ) -> ApplyReport {
        let mut report = ApplyReport::default();
        if let Err(e) = self.ensure_devices(local).await {
            report.fail("wireguard:device", e.to_string());
            return report;
        }
        for (name, families) in device_names(self.options.mode, local.stack) {
            let Some(device) = self.devices.get(name) else {
                continue;
            };
            let want = self.desired_device(desired, name, &families);
            let have = match device.get().await {
                Ok(h) => h,
                Err(e) => {
                    report.fail("wireguard:get", e.to_string());
                    continue;
                }
            };
            let p = plan(&have, &want, mode);
            report.stats.unchanged += p.unchanged;
            if p.config.is_empty() {
                continue;
            }
            report.stats.ops += 1;
            match device.set(&p.config).await {
                Ok(()) => {
                    report.stats.added += p.added;
                    report.stats.replaced += p.replaced;
                    report.stats.deleted += p.deleted;
                    tracing::info!(
                        device = name,
                        added = p.added,
                        replaced = p.replaced,
                        removed = p.deleted,
                        "WireGuard peers updated"
                    );
                }
                Err(e) => report.fail("wireguard:set", e.to_string()),
            }
        }
        report
    }
}

impl Applier for WireguardApplier {
    fn name(&self) -> &'static str {
        "wireguard"
    }

    fn sync<'a>(
        &'a mut self,
        local: &'a Local,
        desired: &'a Desired,
        mode: SyncMode,
    ) -> BoxFuture<'a, ApplyReport> {
        Box::pin(self.sync_inner(local, desired, mode))
    }
}
