//! Routes: list (filtered by family, table, protocol, output interface), replace, delete, and
//! `ip route get`.
//!
//! Every route the agent installs carries [`RTPROT_FLANNEL`] as its routing protocol, so a
//! reconciler can list exactly its own routes ([`RouteFilter::ours`]) and never touch routes
//! of the kernel, DHCP, kube-proxy or another CNI.

use std::{fmt, net::IpAddr};

use ipnet::IpNet;
use rtnetlink::{
    packet_core::{NLM_F_CREATE, NLM_F_REPLACE},
    packet_route::{
        AddressFamily, RouteNetlinkMessage,
        route::{
            RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteMetric,
            RouteProtocol, RouteScope as PacketScope, RouteType,
        },
    },
};

use super::{IpFamily, Netlink, NetlinkError, Request, errors::Ctx};

/// The routing protocol number (`rtm_protocol`, `ip route ... proto 165`) on every route the
/// agent owns.
///
/// Protocol numbers above `RTPROT_STATIC` (4) mean nothing to the kernel; they only label a
/// route's owner. 165 is not defined in `linux/rtnetlink.h`, not listed in iproute2's
/// `/etc/iproute2/rt_protos` (0-4, 8-18, 42 babel, 99 openr, 186-192 bgp/isis/ospf/rip/eigrp),
/// not among FRR's additions (186-198), and not used by the CNIs a cluster may also run
/// (Calico/felix 80, BIRD 12). Upstream flannel installs its routes with protocol `boot` (3)
/// and therefore cannot tell them apart from an administrator's.
pub const RTPROT_FLANNEL: u8 = 165;

/// The main routing table.
pub const RT_TABLE_MAIN: u32 = 254;

/// IPv6 routes without an explicit metric get this one from the kernel.
pub const IP6_DEFAULT_METRIC: u32 = 1024;

/// Route scope (`rtm_scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RouteScope {
    /// Global (gateway routes and most others).
    Universe,
    /// Site.
    Site,
    /// Directly attached (`scope link`).
    Link,
    /// Host-local.
    Host,
    /// Nowhere.
    Nowhere,
    /// A value this code does not know.
    Other(u8),
}

impl RouteScope {
    fn to_u8(self) -> u8 {
        match self {
            Self::Universe => 0,
            Self::Site => 200,
            Self::Link => 253,
            Self::Host => 254,
            Self::Nowhere => 255,
            Self::Other(v) => v,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Universe,
            200 => Self::Site,
            253 => Self::Link,
            254 => Self::Host,
            255 => Self::Nowhere,
            other => Self::Other(other),
        }
    }
}

/// Route type (`rtm_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RouteKind {
    /// A normal route (gateway or direct).
    Unicast,
    /// A local address (local table).
    Local,
    /// Broadcast (local table).
    Broadcast,
    /// Anycast.
    Anycast,
    /// Multicast.
    Multicast,
    /// Silently drop.
    Blackhole,
    /// Reject with "network unreachable".
    Unreachable,
    /// Reject with "prohibited".
    Prohibit,
    /// Continue the lookup in another table.
    Throw,
    /// A value this code does not know.
    Other(u8),
}

impl RouteKind {
    fn to_u8(self) -> u8 {
        match self {
            Self::Unicast => 1,
            Self::Local => 2,
            Self::Broadcast => 3,
            Self::Anycast => 4,
            Self::Multicast => 5,
            Self::Blackhole => 6,
            Self::Unreachable => 7,
            Self::Prohibit => 8,
            Self::Throw => 9,
            Self::Other(v) => v,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Unicast,
            2 => Self::Local,
            3 => Self::Broadcast,
            4 => Self::Anycast,
            5 => Self::Multicast,
            6 => Self::Blackhole,
            7 => Self::Unreachable,
            8 => Self::Prohibit,
            9 => Self::Throw,
            other => Self::Other(other),
        }
    }
}

/// A route, as listed and as given to [`Netlink::replace_route`] / [`Netlink::delete_route`].
/// Build one with [`Route::new`] and the chaining setters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Route {
    /// Destination prefix (host bits zero); `0.0.0.0/0` / `::/0` for default routes.
    pub dst: IpNet,
    /// Next hop (`via`).
    pub gateway: Option<IpAddr>,
    /// Output interface index (`dev`).
    pub oif: Option<u32>,
    /// Treat the gateway as directly attached even without a matching prefix (`onlink`).
    pub onlink: bool,
    /// Route scope.
    pub scope: RouteScope,
    /// Routing table ([`RT_TABLE_MAIN`] by default).
    pub table: u32,
    /// Routing protocol ([`RTPROT_FLANNEL`] by default).
    pub protocol: u8,
    /// Metric / priority; 0 = unset (IPv6 routes then get [`IP6_DEFAULT_METRIC`]).
    pub metric: u32,
    /// Route type.
    pub kind: RouteKind,
    /// Preferred source address (`src`).
    pub prefsrc: Option<IpAddr>,
    /// Path MTU of the route (`mtu`, RTAX_MTU); `None` = the device's.
    pub mtu: Option<u32>,
}

impl Route {
    /// A unicast route to `dst` in the main table with protocol [`RTPROT_FLANNEL`], scope
    /// universe, no gateway, no device, metric unset.
    pub fn new(dst: IpNet) -> Self {
        Self {
            dst,
            gateway: None,
            oif: None,
            onlink: false,
            scope: RouteScope::Universe,
            table: RT_TABLE_MAIN,
            protocol: RTPROT_FLANNEL,
            metric: 0,
            kind: RouteKind::Unicast,
            prefsrc: None,
            mtu: None,
        }
    }

    /// Sets the gateway (`via`).
    pub fn via(mut self, gateway: IpAddr) -> Self {
        self.gateway = Some(gateway);
        self
    }

    /// Sets the output interface (`dev`).
    pub fn dev(mut self, oif: u32) -> Self {
        self.oif = Some(oif);
        self
    }

    /// Sets the `onlink` flag.
    pub fn onlink(mut self) -> Self {
        self.onlink = true;
        self
    }

    /// Sets the scope (e.g. [`RouteScope::Link`] for `dev X scope link` routes).
    pub fn scope(mut self, scope: RouteScope) -> Self {
        self.scope = scope;
        self
    }

    /// Sets the table.
    pub fn table(mut self, table: u32) -> Self {
        self.table = table;
        self
    }

    /// Sets the routing protocol.
    pub fn protocol(mut self, protocol: u8) -> Self {
        self.protocol = protocol;
        self
    }

    /// Sets the metric.
    pub fn metric(mut self, metric: u32) -> Self {
        self.metric = metric;
        self
    }

    /// Makes it a blackhole route (no gateway, no device).
    pub fn blackhole(mut self) -> Self {
        self.kind = RouteKind::Blackhole;
        self
    }

    /// Sets the route's path MTU.
    pub fn mtu(mut self, mtu: u32) -> Self {
        self.mtu = Some(mtu);
        self
    }

    /// Sets the preferred source address.
    pub fn prefsrc(mut self, src: IpAddr) -> Self {
        self.prefsrc = Some(src);
        self
    }

    /// The route's address family.
    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.dst.addr())
    }

    /// Checks what the kernel would reject with a less helpful message.
    pub fn validate(&self, op: &'static str) -> Result<(), NetlinkError> {
        if self.dst.trunc() != self.dst {
            return Err(Ctx::invalid(
                op,
                "destination",
                self.dst,
                "host bits are set",
            ));
        }
        let family = self.family();
        for (field, ip) in [("gateway", self.gateway), ("prefsrc", self.prefsrc)] {
            if let Some(ip) = ip
                && IpFamily::of(&ip) != family
            {
                return Err(Ctx::invalid(
                    op,
                    field,
                    ip,
                    "family differs from the destination",
                ));
            }
        }
        if self.kind == RouteKind::Blackhole && (self.gateway.is_some() || self.oif.is_some()) {
            return Err(Ctx::invalid(
                op,
                "gateway/oif",
                self,
                "a blackhole route has neither",
            ));
        }
        Ok(())
    }

    pub(crate) fn message(&self) -> RouteMessage {
        let family = self.family();
        let mut message = RouteMessage::default();
        let h = &mut message.header;
        h.address_family = family.af();
        h.destination_prefix_length = self.dst.prefix_len();
        h.table = table_byte(self.table);
        h.protocol = RouteProtocol::from(self.protocol);
        h.scope = PacketScope::from(self.scope.to_u8());
        h.kind = RouteType::from(self.kind.to_u8());
        if self.onlink {
            h.flags |= RouteFlags::Onlink;
        }
        let attrs = &mut message.attributes;
        attrs.push(RouteAttribute::Table(self.table));
        if self.dst.prefix_len() > 0 {
            attrs.push(RouteAttribute::Destination(route_address(self.dst.addr())));
        }
        if let Some(gw) = self.gateway {
            attrs.push(RouteAttribute::Gateway(route_address(gw)));
        }
        if let Some(oif) = self.oif {
            attrs.push(RouteAttribute::Oif(oif));
        }
        if self.metric != 0 {
            attrs.push(RouteAttribute::Priority(self.metric));
        }
        if let Some(src) = self.prefsrc {
            attrs.push(RouteAttribute::PrefSource(route_address(src)));
        }
        if let Some(mtu) = self.mtu {
            attrs.push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(mtu)]));
        }
        message
    }
}

impl fmt::Display for Route {
    /// `ip route` style: `10.244.2.0/24 via 10.244.2.0 dev #5 onlink table 254 proto 165`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            RouteKind::Unicast => {}
            RouteKind::Blackhole => f.write_str("blackhole ")?,
            other => write!(f, "{other:?} ")?,
        }
        write!(f, "{}", self.dst)?;
        if let Some(gw) = self.gateway {
            write!(f, " via {gw}")?;
        }
        if let Some(oif) = self.oif {
            write!(f, " dev #{oif}")?;
        }
        if self.onlink {
            f.write_str(" onlink")?;
        }
        if self.scope != RouteScope::Universe {
            write!(f, " scope {:?}", self.scope)?;
        }
        if self.metric != 0 {
            write!(f, " metric {}", self.metric)?;
        }
        if let Some(mtu) = self.mtu {
            write!(f, " mtu {mtu}")?;
        }
        write!(f, " table {} proto {}", self.table, self.protocol)
    }
}

/// Which routes [`Netlink::list_routes`] returns; `None` fields match everything.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteFilter {
    /// Only this family (both when `None`).
    pub family: Option<IpFamily>,
    /// Only this table (all tables, including `local`, when `None`).
    pub table: Option<u32>,
    /// Only this routing protocol.
    pub protocol: Option<u8>,
    /// Only routes out of this interface.
    pub oif: Option<u32>,
}

impl RouteFilter {
    /// The agent's own routes: protocol [`RTPROT_FLANNEL`], any table, both families.
    pub fn ours() -> Self {
        Self {
            protocol: Some(RTPROT_FLANNEL),
            ..Self::default()
        }
    }

    /// Restricts to one family.
    pub fn family(mut self, family: IpFamily) -> Self {
        self.family = Some(family);
        self
    }

    /// Restricts to one table.
    pub fn table(mut self, table: u32) -> Self {
        self.table = Some(table);
        self
    }

    /// Restricts to one output interface.
    pub fn oif(mut self, oif: u32) -> Self {
        self.oif = Some(oif);
        self
    }

    /// Whether `route` passes.
    pub fn matches(&self, route: &Route) -> bool {
        self.family.is_none_or(|f| route.family() == f)
            && self.table.is_none_or(|t| route.table == t)
            && self.protocol.is_none_or(|p| route.protocol == p)
            && self.oif.is_none_or(|o| route.oif == Some(o))
    }

    /// The dump request for one family; with strict checking the kernel filters by table,
    /// protocol and device itself.
    fn message(&self, family: IpFamily) -> RouteMessage {
        let mut message = RouteMessage::default();
        message.header.address_family = family.af();
        if let Some(p) = self.protocol {
            message.header.protocol = RouteProtocol::from(p);
        }
        if let Some(t) = self.table {
            message.header.table = table_byte(t);
            message.attributes.push(RouteAttribute::Table(t));
        }
        if let Some(oif) = self.oif {
            message.attributes.push(RouteAttribute::Oif(oif));
        }
        message
    }
}

/// The kernel's answer to `ip route get DST`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteLookup {
    /// The address looked up.
    pub dst: IpAddr,
    /// The next hop, `None` when `dst` is directly reachable.
    pub gateway: Option<IpAddr>,
    /// The output interface.
    pub oif: Option<u32>,
    /// The source address the kernel would use.
    pub prefsrc: Option<IpAddr>,
    /// The route type (`Local` for the host's own addresses).
    pub kind: RouteKind,
    /// The table the route was found in.
    pub table: u32,
}

impl RouteLookup {
    /// Upstream's DirectRouting test: the peer is reachable without a gateway (one unicast
    /// route, no `via`).
    pub fn is_direct(&self) -> bool {
        self.kind == RouteKind::Unicast && self.gateway.is_none()
    }
}

fn table_byte(table: u32) -> u8 {
    u8::try_from(table).unwrap_or(RouteHeader::RT_TABLE_UNSPEC)
}

fn route_address(ip: IpAddr) -> RouteAddress {
    match ip {
        IpAddr::V4(v4) => RouteAddress::Inet(v4),
        IpAddr::V6(v6) => RouteAddress::Inet6(v6),
    }
}

fn ip_of(addr: &RouteAddress) -> Option<IpAddr> {
    match addr {
        RouteAddress::Inet(v4) => Some((*v4).into()),
        RouteAddress::Inet6(v6) => Some((*v6).into()),
        _ => None,
    }
}

pub(crate) fn route_from_message(message: &RouteMessage) -> Option<Route> {
    let h = &message.header;
    let family = match h.address_family {
        AddressFamily::Inet => IpFamily::V4,
        AddressFamily::Inet6 => IpFamily::V6,
        _ => return None,
    };
    if h.flags.contains(RouteFlags::Cloned) {
        return None;
    }
    let mut dst = None;
    let mut route = Route::new(IpNet::default());
    route.table = u32::from(h.table);
    route.protocol = u8::from(h.protocol);
    route.scope = RouteScope::from_u8(u8::from(h.scope));
    route.kind = RouteKind::from_u8(u8::from(h.kind));
    route.onlink = h.flags.contains(RouteFlags::Onlink);
    for attr in &message.attributes {
        match attr {
            RouteAttribute::Destination(a) => dst = ip_of(a),
            RouteAttribute::Gateway(a) => route.gateway = ip_of(a),
            RouteAttribute::Oif(i) => route.oif = Some(*i),
            RouteAttribute::Priority(p) => route.metric = *p,
            RouteAttribute::Table(t) => route.table = *t,
            RouteAttribute::PrefSource(a) => route.prefsrc = ip_of(a),
            RouteAttribute::Metrics(metrics) => {
                route.mtu = metrics.iter().find_map(|m| match m {
                    RouteMetric::Mtu(mtu) => Some(*mtu),
                    _ => None,
                });
            }
            _ => {}
        }
    }
    let dst = dst.unwrap_or(match family {
        IpFamily::V4 => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpFamily::V6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    });
    route.dst = IpNet::new(dst, h.destination_prefix_length).ok()?;
    Some(route)
}

pub(crate) fn replace_route_request(route: &Route) -> Result<Request, NetlinkError> {
    route.validate("replace route")?;
    Ok(Request::new(
        RouteNetlinkMessage::NewRoute(route.message()),
        NLM_F_CREATE | NLM_F_REPLACE,
        Ctx::new("replace route", route),
    ))
}

pub(crate) fn delete_route_request(route: &Route) -> Result<Request, NetlinkError> {
    route.validate("delete route")?;
    Ok(Request::new(
        RouteNetlinkMessage::DelRoute(route.message()),
        0,
        Ctx::new("delete route", route),
    ))
}

impl Netlink {
    /// Routes matching `filter` (`ip route show table all ...`). Cached/cloned entries are
    /// skipped; a table that does not exist yields an empty list.
    pub async fn list_routes(&self, filter: RouteFilter) -> Result<Vec<Route>, NetlinkError> {
        let families = match filter.family {
            Some(f) => vec![f],
            None => vec![IpFamily::V4, IpFamily::V6],
        };
        let mut out = Vec::new();
        for family in families {
            let ctx = Ctx::new("list routes", format!("{family} {filter:?}"));
            let answers = match self
                .dump(RouteNetlinkMessage::GetRoute(filter.message(family)), &ctx)
                .await
            {
                Ok(answers) => answers,
                // "FIB table does not exist".
                Err(e) if e.is_not_found() && filter.table.is_some() => continue,
                Err(e) => return Err(e),
            };
            out.extend(
                answers
                    .iter()
                    .filter_map(|m| match m {
                        RouteNetlinkMessage::NewRoute(r) => route_from_message(r),
                        _ => None,
                    })
                    .filter(|r| filter.matches(r)),
            );
        }
        Ok(out)
    }

    /// Installs `route`, replacing a route with the same destination, table and metric
    /// (`ip route replace`).
    pub async fn replace_route(&self, route: &Route) -> Result<(), NetlinkError> {
        self.send(replace_route_request(route)?).await
    }

    /// Deletes `route` as listed: destination, table, protocol, type, scope, gateway,
    /// device and (when non-zero) metric must all match, so only that route goes.
    pub async fn delete_route(&self, route: &Route) -> Result<(), NetlinkError> {
        self.send(delete_route_request(route)?).await
    }

    /// Asks the kernel how it would route a packet to `dst` (`ip route get DST`). No route
    /// (`ENETUNREACH`) is [`NetlinkError::NotFound`].
    pub async fn route_get(&self, dst: IpAddr) -> Result<RouteLookup, NetlinkError> {
        let family = IpFamily::of(&dst);
        let mut message = RouteMessage::default();
        message.header.address_family = family.af();
        message.header.destination_prefix_length = family.full_prefix();
        message
            .attributes
            .push(RouteAttribute::Destination(route_address(dst)));
        let ctx = Ctx::new("route get", dst).unreachable_is_not_found();
        match self
            .get_one(RouteNetlinkMessage::GetRoute(message), &ctx)
            .await?
        {
            RouteNetlinkMessage::NewRoute(r) => {
                let route = route_from_message_any(&r)
                    .ok_or_else(|| ctx.other("answer without an address family"))?;
                Ok(RouteLookup {
                    dst,
                    gateway: route.gateway,
                    oif: route.oif,
                    prefsrc: route.prefsrc,
                    kind: route.kind,
                    table: route.table,
                })
            }
            other => Err(ctx.other(format!("unexpected answer {other:?}"))),
        }
    }
}

/// Like [`route_from_message`] but keeps cloned entries (`route get` answers carry
/// `RTM_F_CLONED`).
fn route_from_message_any(message: &RouteMessage) -> Option<Route> {
    let mut m = message.clone();
    m.header.flags.remove(RouteFlags::Cloned);
    route_from_message(&m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap_or_default()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse()
            .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED))
    }

    #[test]
    fn routes_round_trip_through_messages() {
        let routes = [
            Route::new(net("10.244.2.0/24"))
                .via(ip("10.244.2.0"))
                .dev(5)
                .onlink(),
            Route::new(net("10.244.0.0/16"))
                .dev(7)
                .scope(RouteScope::Link)
                .table(1000)
                .metric(9),
            Route::new(net("fd00:1::/64"))
                .via(ip("fd00::2"))
                .protocol(4),
            Route::new(net("10.9.0.0/16")).blackhole(),
            Route::new(net("0.0.0.0/0"))
                .via(ip("192.168.1.1"))
                .prefsrc(ip("192.168.1.5")),
        ];
        for route in routes {
            assert_eq!(
                route_from_message(&route.message()).as_ref(),
                Some(&route),
                "{route}"
            );
        }
    }

    #[test]
    fn big_tables_use_the_attribute() {
        let m = Route::new(net("10.0.0.0/8")).table(1000).message();
        assert_eq!(m.header.table, 0);
        assert!(m.attributes.contains(&RouteAttribute::Table(1000)));
        let m = Route::new(net("10.0.0.0/8")).message();
        assert_eq!(m.header.table, 254);
    }

    #[test]
    fn filter_matches_fields() {
        let r = Route::new(net("10.244.2.0/24")).dev(5);
        assert!(RouteFilter::ours().matches(&r));
        assert!(
            RouteFilter::ours()
                .oif(5)
                .table(254)
                .family(IpFamily::V4)
                .matches(&r)
        );
        assert!(!RouteFilter::ours().oif(6).matches(&r));
        assert!(!RouteFilter::ours().family(IpFamily::V6).matches(&r));
        assert!(!RouteFilter::ours().matches(&r.clone().protocol(80)));
        assert!(RouteFilter::default().matches(&r.protocol(80)));
    }

    #[test]
    fn invalid_routes_are_refused_before_sending() {
        let bad = Route::new(net("10.244.2.1/24"));
        assert!(matches!(
            bad.validate("replace route"),
            Err(NetlinkError::Invalid {
                field: "destination",
                ..
            })
        ));
        let mixed = Route::new(net("10.244.2.0/24")).via(ip("fd00::1"));
        assert!(matches!(
            mixed.validate("replace route"),
            Err(NetlinkError::Invalid {
                field: "gateway",
                ..
            })
        ));
        let bh = Route::new(net("10.0.0.0/8")).blackhole().dev(3);
        assert!(bh.validate("replace route").is_err());
    }

    #[test]
    fn display_reads_like_ip_route() {
        let r = Route::new(net("10.244.2.0/24"))
            .via(ip("10.244.2.0"))
            .dev(5)
            .onlink();
        assert_eq!(
            r.to_string(),
            "10.244.2.0/24 via 10.244.2.0 dev #5 onlink table 254 proto 165"
        );
    }

    #[test]
    fn direct_means_unicast_without_gateway() {
        let mut l = RouteLookup {
            dst: ip("192.168.1.2"),
            gateway: None,
            oif: Some(2),
            prefsrc: None,
            kind: RouteKind::Unicast,
            table: 254,
        };
        assert!(l.is_direct());
        l.gateway = Some(ip("192.168.1.1"));
        assert!(!l.is_direct());
        l.gateway = None;
        l.kind = RouteKind::Local;
        assert!(!l.is_direct());
    }
}
