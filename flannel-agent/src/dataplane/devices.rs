//! The dataplane's devices: `flannel.<VNI>` / `flannel-v6.<VNI>` for vxlan, `flannel.ipip`
//! for ipip, `flannel0` for udp (created by the forwarder, configured by
//! [`crate::udp::ensure_tun_device`]), none for host-gw (which only checks that it is not
//! behind NAT).
//!
//! [`ensure_devices`] is idempotent and cheap when nothing changed (a link lookup and an
//! address listing per device): the daemon calls it once at start-up (errors are fatal there)
//! and the reconciler before every reconcile, which is how a device deleted under the agent
//! comes back with the same MAC and, unlike upstream, with all its peers.
//!
//! vxlan devices follow upstream (flannel-upstream.md 2.1): VNI, port (0 = kernel default),
//! GBP, learning, `local` = the public IP, `dev` = the external interface, MTU from the MTU
//! plan and the persisted VTEP MAC; an incompatible existing device is deleted and recreated;
//! address `<subnet network>/32` (`/128`), `accept_ra = 0`, link up, then the MAC is read
//! back and a different one is an error (systemd `MACAddressPolicy=random`, flannel#1795).

use std::net::{IpAddr, Ipv4Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::{
    backend::{BackendOptions, MacAddr, VxlanOptions, mtu::IPIP_OVERHEAD},
    iface::ExternalInterface,
    netlink::{IpFamily, Link, Netlink, VxlanEnsure, VxlanSpec},
};

use super::{
    DataplaneError,
    model::{DeviceInfo, Local},
};

/// Name of the ipip device, as upstream.
pub const IPIP_DEVICE: &str = "flannel.ipip";

/// What [`ensure_devices`] had to do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceReport {
    /// Devices that did not exist and were created.
    pub created: Vec<String>,
    /// Devices that existed with an incompatible configuration and were recreated.
    pub recreated: Vec<String>,
    /// Devices whose MAC, address or up state had to be corrected.
    pub repaired: Vec<String>,
    /// The external interface's addresses this node was started with (`IfaceAddr`,
    /// `IfaceV6Addr`) that it no longer holds: removed, or replaced by another.
    pub missing_addresses: Vec<IpAddr>,
}

impl DeviceReport {
    /// Whether anything was created or recreated.
    pub fn device_changed(&self) -> bool {
        !self.created.is_empty() || !self.recreated.is_empty()
    }
}

/// Upstream's host-gw refusal: the public IP must be the interface's own address.
pub fn check_host_gw(ext: &ExternalInterface) -> Result<(), DataplaneError> {
    let v4_nat = ext.ext_addr.is_some() && ext.ext_addr != ext.iface_addr;
    let v6_nat = ext.ext_v6_addr.is_some() && ext.ext_v6_addr != ext.iface_v6_addr;
    if v4_nat || v6_nat {
        return Err(DataplaneError::HostGwNat);
    }
    Ok(())
}

/// Creates, repairs or checks the devices of `local`'s backend and records them in
/// `local.devices`. The external interface's index is refreshed by name first (it changes
/// when the interface is recreated).
pub async fn ensure_devices(
    nl: &Netlink,
    local: &mut Local,
) -> Result<DeviceReport, DataplaneError> {
    let mut report = DeviceReport::default();
    refresh_external(nl, &mut local.ext).await?;
    report.missing_addresses = missing_addresses(nl, &local.ext).await?;
    match local.backend.clone() {
        BackendOptions::Vxlan(options) => {
            for family in [IpFamily::V4, IpFamily::V6] {
                let enabled = match family {
                    IpFamily::V4 => local.stack.has_v4(),
                    IpFamily::V6 => local.stack.has_v6(),
                };
                let device = if enabled {
                    Some(ensure_vxlan_device(nl, local, &options, family, &mut report).await?)
                } else {
                    None
                };
                match family {
                    IpFamily::V4 => local.devices.vxlan_v4 = device,
                    IpFamily::V6 => local.devices.vxlan_v6 = device,
                }
            }
        }
        BackendOptions::HostGw => check_host_gw(&local.ext)?,
        BackendOptions::Ipip(_) if local.ipip_via_ebpf => local.devices.ipip = None,
        BackendOptions::Ipip(_) => {
            let device = ensure_ipip_device(nl, local, &mut report).await?;
            local.devices.ipip = Some(device);
        }
        BackendOptions::Udp(_) => {
            let device = crate::udp::ensure_tun_device(nl, local, &mut report).await?;
            local.devices.tun = Some(device);
        }
        // extension: whatever its commands set up is theirs (`crate::extension`).
        BackendOptions::Alloc | BackendOptions::Extension(_) => {}
        // Their devices (flannel-wg, none for ipsec) belong to their own appliers
        // (`crate::wireguard`, `crate::ipsec`), which set them up in every sync.
        BackendOptions::Wireguard(_) | BackendOptions::Ipsec(_) => {}
    }
    Ok(report)
}

async fn refresh_external(nl: &Netlink, ext: &mut ExternalInterface) -> Result<(), DataplaneError> {
    let link = nl
        .link_by_name(&ext.name)
        .await
        .map_err(DataplaneError::netlink(format!(
            "look up external interface {}",
            ext.name
        )))?
        .ok_or_else(|| DataplaneError::ExternalInterfaceGone {
            name: ext.name.clone(),
        })?;
    if link.index != ext.index {
        tracing::warn!(
            iface = %ext.name,
            old = ext.index,
            new = link.index,
            "the external interface was recreated; following its new index"
        );
        ext.index = link.index;
    }
    Ok(())
}

/// The addresses of the external interface this node was started with (`IfaceAddr`,
/// `IfaceV6Addr`: the public IPs its lease advertises, unless `--public-ip` says otherwise,
/// and the tunnels' source) that the interface no longer holds: removed, or replaced by
/// another (a new DHCP lease, the interface re-created with another address).
async fn missing_addresses(
    nl: &Netlink,
    ext: &ExternalInterface,
) -> Result<Vec<IpAddr>, DataplaneError> {
    let started: Vec<IpAddr> = ext.iface_addrs().collect();
    if started.is_empty() {
        return Ok(started);
    }
    let held = nl
        .list_addresses(ext.index, None)
        .await
        .map_err(DataplaneError::netlink(format!(
            "list the addresses of external interface {}",
            ext.name
        )))?;
    Ok(started
        .into_iter()
        .filter(|a| !held.iter().any(|h| h.ip() == *a))
        .collect())
}

fn vxlan_spec(
    local: &Local,
    options: &VxlanOptions,
    family: IpFamily,
    name: &str,
) -> Result<(VxlanSpec, MacAddr), DataplaneError> {
    let public_ip = local
        .public_ip(family)
        .ok_or_else(|| DataplaneError::NoPublicAddress {
            device: name.to_owned(),
            iface: local.ext.name.clone(),
            family,
        })?;
    let mac = local
        .vtep_macs
        .get(family)
        .ok_or_else(|| DataplaneError::NoVtepMac {
            device: name.to_owned(),
        })?;
    let mut spec = VxlanSpec::new(name, options.vni);
    spec.port = (options.port != 0).then_some(options.port);
    spec.local = Some(public_ip);
    spec.underlay_index = Some(local.ext.index);
    spec.learning = options.learning;
    spec.gbp = options.gbp;
    spec.mtu = match family {
        IpFamily::V4 => local.mtu.device_v4,
        IpFamily::V6 => local.mtu.device_v6,
    };
    spec.mac = Some(mac.octets());
    Ok((spec, mac))
}

async fn ensure_vxlan_device(
    nl: &Netlink,
    local: &Local,
    options: &VxlanOptions,
    family: IpFamily,
    report: &mut DeviceReport,
) -> Result<DeviceInfo, DataplaneError> {
    let name = match family {
        IpFamily::V4 => options.device_name(),
        IpFamily::V6 => options.v6_device_name(),
    };
    let subnet = local
        .own_subnet(family)
        .ok_or_else(|| DataplaneError::LeaseLacksFamily {
            device: name.clone(),
            family,
        })?;
    let (spec, mac) = vxlan_spec(local, options, family, &name)?;
    let ctx = |what: &str| DataplaneError::netlink(format!("{what} {name}"));

    let mut link = None;
    for _ in 0..2 {
        match nl.ensure_vxlan(&spec).await.map_err(ctx("ensure"))? {
            VxlanEnsure::Created(l) => {
                tracing::info!(device = %name, index = l.index, %mac, "created vxlan device");
                report.created.push(name.clone());
                link = Some((l, true));
                break;
            }
            VxlanEnsure::Reused(l) => {
                link = Some((l, false));
                break;
            }
            VxlanEnsure::Incompatible { existing, problems } => {
                let problems: Vec<String> = problems.iter().map(ToString::to_string).collect();
                tracing::warn!(
                    "{name:?} already exists with incompatible configuration: {}; recreating device",
                    problems.join(", ")
                );
                nl.delete_link(existing.index)
                    .await
                    .or_else(|e| if e.is_not_found() { Ok(()) } else { Err(e) })
                    .map_err(ctx("delete incompatible"))?;
                report.recreated.push(name.clone());
            }
        }
    }
    let (mut link, created) = link.ok_or_else(|| DataplaneError::DeviceUnstable {
        device: name.clone(),
    })?;

    if link.mac != Some(mac.octets()) {
        tracing::warn!(
            device = %name,
            found = ?link.mac.map(MacAddr),
            want = %mac,
            "vxlan device has another MAC; restoring the persisted VTEP MAC"
        );
        nl.set_mac(link.index, mac.octets())
            .await
            .map_err(ctx("set MAC of"))?;
        report.repaired.push(name.clone());
    }
    if created {
        disable_accept_ra(&name);
    }
    let changes = match subnet {
        IpNet::V4(s) => {
            let want = Ipv4Net::new(s.network(), 32).unwrap_or(s);
            nl.ensure_v4_address(link.index, want, local.network.unwrap_or(s))
                .await
        }
        IpNet::V6(s) => {
            let want = Ipv6Net::new(s.network(), 128).unwrap_or(s);
            nl.ensure_v6_address(link.index, want).await
        }
    }
    .map_err(ctx("set the address of"))?;
    if !created && (changes.added.is_some() || !changes.removed.is_empty()) {
        tracing::info!(device = %name, ?changes, "corrected the device address");
        report.repaired.push(name.clone());
    }
    if !link.up {
        nl.set_link_up(link.index).await.map_err(ctx("set up"))?;
        if !created {
            report.repaired.push(name.clone());
        }
    }
    // Read back: something (systemd-udevd with MACAddressPolicy=random) may have changed the
    // MAC after creation; peers would then send to a MAC nobody has.
    link = reread(nl, &name, link.index).await?;
    if link.mac != Some(mac.octets()) {
        return Err(DataplaneError::MacMismatch {
            device: name,
            wanted: mac,
            got: link
                .mac
                .map(|m| MacAddr(m).to_string())
                .unwrap_or_else(|| "(none)".into()),
        });
    }
    Ok(DeviceInfo {
        name,
        index: link.index,
        mac: Some(mac),
    })
}

async fn reread(nl: &Netlink, name: &str, index: u32) -> Result<Link, DataplaneError> {
    nl.link_by_index(index)
        .await
        .map_err(DataplaneError::netlink(format!("read back {name}")))?
        .ok_or_else(|| DataplaneError::DeviceUnstable {
            device: name.to_owned(),
        })
}

/// `net.ipv6.conf.<dev>.accept_ra = 0`, errors ignored (as upstream).
fn disable_accept_ra(device: &str) {
    let path = format!("/proc/sys/net/ipv6/conf/{device}/accept_ra");
    if let Err(e) = std::fs::write(&path, "0") {
        tracing::debug!(%path, error = %e, "could not disable accept_ra");
    }
}

async fn ensure_ipip_device(
    nl: &Netlink,
    local: &Local,
    report: &mut DeviceReport,
) -> Result<DeviceInfo, DataplaneError> {
    let name = IPIP_DEVICE;
    let subnet = local
        .lease
        .subnet
        .ok_or_else(|| DataplaneError::LeaseLacksFamily {
            device: name.to_owned(),
            family: IpFamily::V4,
        })?;
    let iface_addr = local
        .ext
        .iface_addr
        .ok_or_else(|| DataplaneError::NoPublicAddress {
            device: name.to_owned(),
            iface: local.ext.name.clone(),
            family: IpFamily::V4,
        })?;
    let ctx = |what: &str| DataplaneError::netlink(format!("{what} {name}"));
    let expected_mtu = local.ext.mtu.checked_sub(IPIP_OVERHEAD).filter(|m| *m > 0);

    let mut link = match nl.link_by_name(name).await.map_err(ctx("look up"))? {
        Some(l) if !l.is_kind("ipip") => return Err(DataplaneError::IpipWrongKind),
        Some(l) => {
            let info = l.ip_tunnel.clone().unwrap_or(crate::netlink::IpTunnelInfo {
                local: None,
                remote: None,
                underlay_index: None,
            });
            let remote_any = info
                .remote
                .is_none_or(|r| r == IpAddr::V4(Ipv4Addr::UNSPECIFIED));
            if info.local == Some(IpAddr::V4(iface_addr)) && remote_any {
                Some(l)
            } else {
                tracing::warn!(
                    "{name} exists with local {:?} remote {:?}; recreating it",
                    info.local,
                    info.remote
                );
                nl.delete_link(l.index)
                    .await
                    .map_err(ctx("delete incompatible"))?;
                report.recreated.push(name.to_owned());
                None
            }
        }
        None => None,
    };
    if link.is_none() {
        let created = nl
            .create_ipip(name, iface_addr, None, None)
            .await
            .map_err(|e| {
                if e.is_unsupported() {
                    DataplaneError::IpipNeedsEbpf { source: e }
                } else {
                    DataplaneError::netlink(format!("create {name}"))(e)
                }
            })?;
        report.created.push(name.to_owned());
        link = Some(created);
    }
    let link = link.ok_or_else(|| DataplaneError::DeviceUnstable {
        device: name.to_owned(),
    })?;
    // Upstream only ever lowers the MTU.
    if let Some(mtu) = expected_mtu
        && (link.mtu == 0 || link.mtu > mtu)
    {
        nl.set_mtu(link.index, mtu)
            .await
            .map_err(ctx("set MTU of"))?;
    }
    let want = Ipv4Net::new(subnet.network(), 32).unwrap_or(subnet);
    nl.ensure_v4_address(link.index, want, local.network.unwrap_or(subnet))
        .await
        .map_err(ctx("set the address of"))?;
    if !link.up {
        nl.set_link_up(link.index).await.map_err(ctx("set up"))?;
    }
    Ok(DeviceInfo {
        name: name.to_owned(),
        index: link.index,
        mac: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(iface: [u8; 4], public: [u8; 4]) -> ExternalInterface {
        ExternalInterface {
            name: "eth0".into(),
            index: 2,
            mtu: 1500,
            iface_addr: Some(Ipv4Addr::from(iface)),
            iface_v6_addr: None,
            ext_addr: Some(Ipv4Addr::from(public)),
            ext_v6_addr: None,
        }
    }

    #[test]
    fn host_gw_refuses_nat_with_upstreams_words() {
        assert!(check_host_gw(&ext([192, 168, 1, 2], [192, 168, 1, 2])).is_ok());
        let e = check_host_gw(&ext([192, 168, 1, 2], [203, 0, 113, 9])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "your PublicIP differs from interface IP, meaning that probably you're on a NAT, \
             which is not supported by host-gw backend"
        );
        let mut v6 = ext([192, 168, 1, 2], [192, 168, 1, 2]);
        v6.iface_v6_addr = Some("fd00::1".parse().unwrap());
        v6.ext_v6_addr = Some("2001:db8::1".parse().unwrap());
        assert!(check_host_gw(&v6).is_err());
    }
}
