//! Reads the facts [`iface::select`](crate::iface::select) needs from the kernel: interfaces
//! with their addresses, the default-route interfaces and the `--iface-can-reach` lookup.
//! Kept apart from [`crate::iface`] so that the selection logic stays pure.

use std::net::IpAddr;

use crate::{
    iface::{AddrInfo, InterfaceInfo, NetSnapshot, RouteAnswer},
    netlink::{IpFamily, Netlink, NetlinkError, RT_TABLE_MAIN, RouteFilter, RouteKind},
};

/// Lists interfaces, addresses and default routes, and looks up `can_reach` if given.
pub async fn snapshot(
    nl: &Netlink,
    can_reach: Option<IpAddr>,
) -> Result<NetSnapshot, NetlinkError> {
    let mut links = nl.list_links().await?;
    links.sort_by_key(|l| l.index);
    let mut interfaces = Vec::with_capacity(links.len());
    for link in links {
        let addrs = nl
            .list_addresses(link.index, None)
            .await?
            .into_iter()
            .map(|a| AddrInfo {
                addr: a.addr.addr(),
                prefix_len: a.addr.prefix_len(),
                permanent: a.flags.permanent,
                deprecated: a.flags.deprecated,
                temporary: a.flags.temporary,
            })
            .collect();
        interfaces.push(InterfaceInfo {
            index: link.index,
            name: link.name,
            mtu: link.mtu,
            addrs,
        });
    }
    let default_route_v4 = default_route_oif(nl, IpFamily::V4).await?;
    let default_route_v6 = default_route_oif(nl, IpFamily::V6).await?;
    let can_reach = match can_reach {
        None => None,
        Some(ip) => match nl.route_get(ip).await {
            Ok(lookup) => lookup.oif.map(|ifindex| RouteAnswer {
                ifindex,
                src: lookup.prefsrc,
            }),
            Err(err) if err.is_not_found() => None,
            Err(err) => return Err(err),
        },
    };
    Ok(NetSnapshot {
        interfaces,
        default_route_v4,
        default_route_v6,
        can_reach,
    })
}

/// The output interface of the first main-table default route of `family` (`Some(0)` for a
/// default route without an interface), as upstream picks it.
async fn default_route_oif(nl: &Netlink, family: IpFamily) -> Result<Option<u32>, NetlinkError> {
    let filter = RouteFilter {
        family: Some(family),
        table: Some(RT_TABLE_MAIN),
        ..RouteFilter::default()
    };
    Ok(nl
        .list_routes(filter)
        .await?
        .into_iter()
        .find(|r| r.dst.prefix_len() == 0 && r.kind == RouteKind::Unicast)
        .map(|r| r.oif.unwrap_or(0)))
}
