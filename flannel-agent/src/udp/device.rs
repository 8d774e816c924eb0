//! Configuring `flannel0` (created by the forwarder, which holds its file descriptor) the way
//! upstream does (flannel-upstream.md 2.5): address `<subnet IP>/32`, MTU = external MTU −
//! 28, up, and the one kernel route of the backend, `<Network> dev flannel0`. Called by
//! [`ensure_devices`](crate::dataplane::ensure_devices) at start-up and before every
//! reconcile, so a device recreated by the forwarder is configured again.
//!
//! IPv6 is switched off on the device (`disable_ipv6`): the backend carries IPv4 only, and a
//! link-local address would only make the kernel send router solicitations into the tunnel.

use ipnet::{IpNet, Ipv4Net};

use crate::{
    dataplane::{DataplaneError, DeviceInfo, DeviceReport, Local},
    netlink::{IpFamily, Netlink, RT_TABLE_MAIN, Route, RouteFilter},
};

/// The TUN device's name (upstream's template `flannel%d` gives the same on a fresh node).
pub const TUN_DEVICE: &str = "flannel0";

/// The route to the cluster network through `flannel0`.
pub fn network_route(network: Ipv4Net, index: u32) -> Route {
    Route::new(IpNet::V4(network.trunc())).dev(index)
}

/// Checks and repairs `flannel0` for `local`; see the module documentation.
pub async fn ensure_tun_device(
    nl: &Netlink,
    local: &Local,
    report: &mut DeviceReport,
) -> Result<DeviceInfo, DataplaneError> {
    let name = TUN_DEVICE;
    let ctx = |what: &str| DataplaneError::netlink(format!("{what} {name}"));
    let subnet = match local.own_subnet(IpFamily::V4) {
        Some(IpNet::V4(s)) => s,
        _ => {
            return Err(DataplaneError::LeaseLacksFamily {
                device: name.to_owned(),
                family: IpFamily::V4,
            });
        }
    };
    let network = local.network.unwrap_or(subnet);
    let link = nl
        .link_by_name(name)
        .await
        .map_err(ctx("look up"))?
        .ok_or_else(|| DataplaneError::TunMissing {
            device: name.to_owned(),
        })?;
    let previous = local.devices.tun.as_ref().map(|d| d.index);
    let fresh = previous != Some(link.index);
    if fresh {
        disable_ipv6(name);
        if previous.is_some() {
            report.recreated.push(name.to_owned());
        } else {
            report.created.push(name.to_owned());
        }
    }
    let mut repaired = false;
    if let Some(mtu) = local.mtu.device_v4
        && link.mtu != mtu
    {
        nl.set_mtu(link.index, mtu)
            .await
            .map_err(ctx("set MTU of"))?;
        repaired = true;
    }
    let want = Ipv4Net::new(subnet.network(), 32).unwrap_or(subnet);
    let changes = nl
        .ensure_v4_address(link.index, want, network)
        .await
        .map_err(ctx("set the address of"))?;
    repaired |= changes.added.is_some() || !changes.removed.is_empty();
    if !link.up {
        nl.set_link_up(link.index).await.map_err(ctx("set up"))?;
        repaired = true;
    }
    let route = network_route(network, link.index);
    let present = nl
        .list_routes(
            RouteFilter::default()
                .family(IpFamily::V4)
                .table(RT_TABLE_MAIN)
                .oif(link.index),
        )
        .await
        .map_err(ctx("list the routes of"))?
        .iter()
        .any(|r| r.dst == route.dst && r.gateway.is_none() && r.metric == 0);
    if !present {
        nl.replace_route(&route)
            .await
            .map_err(ctx("route the cluster network to"))?;
        repaired = true;
    }
    if repaired && !fresh {
        report.repaired.push(name.to_owned());
    }
    Ok(DeviceInfo {
        name: name.to_owned(),
        index: link.index,
        mac: None,
    })
}

/// `net.ipv6.conf.<dev>.disable_ipv6 = 1`, errors ignored (IPv6 may be off altogether).
fn disable_ipv6(device: &str) {
    let path = format!("/proc/sys/net/ipv6/conf/{device}/disable_ipv6");
    if let Err(e) = std::fs::write(&path, "1") {
        tracing::debug!(%path, error = %e, "could not disable IPv6 on the TUN device");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
pub(crate) mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::{
        backend::{BackendOptions, MtuPlan, UdpOptions},
        dataplane::VtepMacs,
        iface::ExternalInterface,
        ip::IpStack,
        lease::{Lease, LeaseAttrs, SubnetKey},
    };

    /// A udp node: 10.244.1.0/24 in 10.244.0.0/16, eth0 192.168.1.11.
    pub(crate) fn local() -> Local {
        let lease = Lease::new(
            SubnetKey::parse("10.244.1.0-24").unwrap(),
            LeaseAttrs::default(),
            None,
        );
        Local::new(
            lease,
            IpStack::V4,
            Some("10.244.0.0/16".parse().unwrap()),
            None,
            BackendOptions::Udp(UdpOptions::default()),
            ExternalInterface {
                name: "eth0".into(),
                index: 2,
                mtu: 1500,
                iface_addr: Some(Ipv4Addr::new(192, 168, 1, 11)),
                iface_v6_addr: None,
                ext_addr: Some(Ipv4Addr::new(192, 168, 1, 11)),
                ext_v6_addr: None,
            },
            MtuPlan {
                device_v4: Some(1472),
                device_v6: None,
                flannel_mtu: 1472,
            },
            VtepMacs::default(),
        )
    }

    #[test]
    fn the_network_route_is_a_device_route() {
        let r = network_route("10.244.7.9/16".parse().unwrap(), 5);
        assert_eq!(r.dst, "10.244.0.0/16".parse::<IpNet>().unwrap());
        assert_eq!((r.oif, r.gateway), (Some(5), None));
    }
}
