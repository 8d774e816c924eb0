//! Facts read from the kernel before the desired state is computed: which remote public IPs
//! are on a directly connected network (DirectRouting, host-gw).
//!
//! Upstream asks `ip route get <public IP>` once per peer and event. Here one dump of the main
//! routing table per family is indexed ([`RouteIndex`]) and every public IP is answered by a
//! longest-prefix match in memory, so 5,000 peers cost two dumps instead of 5,000 round trips
//! ([`Facts::read`]). [`Facts::probe`] does it upstream's way (one `route get` per address);
//! `tests/dataplane.rs` measures both. The index ignores policy routing rules and other
//! tables; flannel's underlay is reached through the main table in every setup upstream
//! supports.
//!
//! A route decides "direct" when it is unicast, has no gateway and names an output interface
//! (a connected route). Routes the dataplane installs itself (protocol
//! [`RTPROT_FLANNEL`]) and routes out of its own devices are left out of the index, so pod
//! routes never decide how the underlay is reached.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::IpAddr,
};

use crate::netlink::{
    IpFamily, Netlink, NetlinkError, RT_TABLE_MAIN, RTPROT_FLANNEL, Route, RouteFilter, RouteKind,
};

/// What the routing table says about one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reachability {
    /// On a directly connected network out of `oif` (no gateway).
    Direct {
        /// Output interface.
        oif: u32,
    },
    /// Reached through a router.
    Gateway {
        /// The next hop.
        gateway: IpAddr,
    },
    /// No route, or a reject/blackhole route, or a route this index cannot judge (multipath,
    /// nexthop objects).
    Unreachable,
    /// The address is this node's own.
    Local,
    /// Not looked up.
    Unknown,
}

impl Reachability {
    /// The output interface when directly reachable.
    pub fn direct_oif(self) -> Option<u32> {
        match self {
            Self::Direct { oif } => Some(oif),
            _ => None,
        }
    }
}

impl fmt::Display for Reachability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Direct { oif } => write!(f, "directly connected on dev #{oif}"),
            Self::Gateway { gateway } => write!(f, "reached via gateway {gateway}"),
            Self::Unreachable => f.write_str("no usable route"),
            Self::Local => f.write_str("it is this node's own address"),
            Self::Unknown => f.write_str("not looked up"),
        }
    }
}

/// A longest-prefix-match index over the routes of one table.
#[derive(Debug, Clone, Default)]
pub struct RouteIndex {
    /// Per family, per prefix length (longest first): masked destination → best route.
    v4: BTreeMap<std::cmp::Reverse<u8>, HashMap<u128, (u32, Reachability)>>,
    v6: BTreeMap<std::cmp::Reverse<u8>, HashMap<u128, (u32, Reachability)>>,
    routes: usize,
}

fn bits(ip: IpAddr) -> (IpFamily, u128, u8) {
    match ip {
        IpAddr::V4(v4) => (IpFamily::V4, u128::from(u32::from(v4)), 32),
        IpAddr::V6(v6) => (IpFamily::V6, u128::from(v6), 128),
    }
}

fn masked(value: u128, width: u8, prefix_len: u8) -> u128 {
    if prefix_len == 0 {
        return 0;
    }
    let shift = u32::from(width.saturating_sub(prefix_len));
    (value >> shift) << shift
}

impl RouteIndex {
    /// Indexes `routes`, skipping routes that `exclude` says belong to the dataplane itself.
    /// Among routes with the same destination the lowest metric wins, as in the kernel.
    pub fn new<'a>(
        routes: impl IntoIterator<Item = &'a Route>,
        exclude: impl Fn(&Route) -> bool,
    ) -> Self {
        let mut index = Self::default();
        for route in routes {
            if exclude(route) {
                continue;
            }
            let reach = match route.kind {
                RouteKind::Unicast => match (route.gateway, route.oif) {
                    (Some(gateway), _) => Reachability::Gateway { gateway },
                    (None, Some(oif)) => Reachability::Direct { oif },
                    // Multipath or nexthop-object routes: not judged here.
                    (None, None) => Reachability::Unreachable,
                },
                RouteKind::Local => Reachability::Local,
                RouteKind::Blackhole
                | RouteKind::Unreachable
                | RouteKind::Prohibit
                | RouteKind::Throw => Reachability::Unreachable,
                _ => continue,
            };
            let (family, value, width) = bits(route.dst.addr());
            let len = route.dst.prefix_len();
            let table = match family {
                IpFamily::V4 => &mut index.v4,
                IpFamily::V6 => &mut index.v6,
            };
            let metric = route.metric;
            table
                .entry(std::cmp::Reverse(len))
                .or_default()
                .entry(masked(value, width, len))
                .and_modify(|best| {
                    if metric < best.0 {
                        *best = (metric, reach);
                    }
                })
                .or_insert((metric, reach));
            index.routes += 1;
        }
        index
    }

    /// Longest-prefix match for `ip`.
    pub fn lookup(&self, ip: IpAddr) -> Reachability {
        let (family, value, width) = bits(ip);
        let table = match family {
            IpFamily::V4 => &self.v4,
            IpFamily::V6 => &self.v6,
        };
        for (std::cmp::Reverse(len), entries) in table {
            if let Some((_, reach)) = entries.get(&masked(value, width, *len)) {
                return *reach;
            }
        }
        Reachability::Unreachable
    }

    /// Number of routes indexed.
    pub fn len(&self) -> usize {
        self.routes
    }

    /// Whether nothing was indexed.
    pub fn is_empty(&self) -> bool {
        self.routes == 0
    }
}

/// What [`desired()`](super::desired()) may ask about the kernel.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    source: Source,
}

#[derive(Debug, Clone, Default)]
enum Source {
    /// Nothing read (backends that need no facts); every address is [`Reachability::Unknown`].
    #[default]
    None,
    /// A routing table index.
    Index(RouteIndex),
    /// Answers per address.
    Lookups(HashMap<IpAddr, Reachability>),
}

impl Facts {
    /// No facts: every address is [`Reachability::Unknown`] (so nothing is direct).
    pub fn none() -> Self {
        Self::default()
    }

    /// Facts from an index of the main table.
    pub fn from_index(index: RouteIndex) -> Self {
        Self {
            source: Source::Index(index),
        }
    }

    /// Facts from per-address answers (addresses not in the map are unknown).
    pub fn from_lookups(lookups: HashMap<IpAddr, Reachability>) -> Self {
        Self {
            source: Source::Lookups(lookups),
        }
    }

    /// How `ip` is reached.
    pub fn reach(&self, ip: IpAddr) -> Reachability {
        match &self.source {
            Source::None => Reachability::Unknown,
            Source::Index(index) => index.lookup(ip),
            Source::Lookups(map) => map.get(&ip).copied().unwrap_or(Reachability::Unknown),
        }
    }

    /// One dump of the main table per family in `families`, indexed. Routes with protocol
    /// [`RTPROT_FLANNEL`] and routes out of `own_devices` are left out.
    pub async fn read(
        nl: &Netlink,
        families: &[IpFamily],
        own_devices: &[u32],
    ) -> Result<Self, NetlinkError> {
        let mut routes = Vec::new();
        for family in families {
            routes.extend(
                nl.list_routes(RouteFilter::default().table(RT_TABLE_MAIN).family(*family))
                    .await?,
            );
        }
        let index = RouteIndex::new(&routes, |r| {
            r.protocol == RTPROT_FLANNEL || r.oif.is_some_and(|o| own_devices.contains(&o))
        });
        Ok(Self::from_index(index))
    }

    /// Upstream's way: `ip route get` for every address in `ips`, up to 64 requests in
    /// flight. Policy routing is honoured; an address answered through one of `own_devices`
    /// counts as unreachable.
    pub async fn probe(
        nl: &Netlink,
        ips: &[IpAddr],
        own_devices: &[u32],
    ) -> Result<Self, NetlinkError> {
        use futures::StreamExt as _;
        let answers: Vec<(IpAddr, Result<_, NetlinkError>)> =
            futures::stream::iter(ips.iter().copied())
                .map(|ip| async move { (ip, nl.route_get(ip).await) })
                .buffer_unordered(64)
                .collect()
                .await;
        let mut map = HashMap::with_capacity(answers.len());
        for (ip, answer) in answers {
            let reach = match answer {
                Ok(l) if l.kind == RouteKind::Local => Reachability::Local,
                Ok(l) if l.oif.is_some_and(|o| own_devices.contains(&o)) => {
                    Reachability::Unreachable
                }
                Ok(l) => match (l.kind, l.gateway, l.oif) {
                    (RouteKind::Unicast, Some(gateway), _) => Reachability::Gateway { gateway },
                    (RouteKind::Unicast, None, Some(oif)) => Reachability::Direct { oif },
                    _ => Reachability::Unreachable,
                },
                Err(e) if e.is_not_found() => Reachability::Unreachable,
                Err(e) => return Err(e),
            };
            map.insert(ip, reach);
        }
        Ok(Self::from_lookups(map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::RouteScope;

    fn route(dst: &str) -> Route {
        Route::new(dst.parse().unwrap()).protocol(2)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn table() -> Vec<Route> {
        vec![
            route("0.0.0.0/0").via(ip("192.168.10.254")).dev(2),
            route("192.168.10.0/24").dev(2).scope(RouteScope::Link),
            route("192.168.30.0/24").dev(3).scope(RouteScope::Link),
            // A more specific route through a router wins over the connected /24.
            route("192.168.10.128/25").via(ip("192.168.10.1")).dev(2),
            route("10.9.0.0/16").blackhole(),
            // Two routes for one prefix: the lower metric wins.
            route("172.16.0.0/12")
                .via(ip("192.168.10.7"))
                .metric(200)
                .dev(2),
            route("172.16.0.0/12").dev(3).metric(100),
            // Pod routes of the dataplane itself never decide underlay reachability.
            route("192.168.20.0/24").dev(2).protocol(RTPROT_FLANNEL),
            route("192.168.21.0/24")
                .via(ip("10.244.2.0"))
                .dev(9)
                .onlink(),
            route("fd00:10::/64").dev(2),
            route("::/0").via(ip("fd00:10::fe")).dev(2),
        ]
    }

    #[test]
    fn longest_prefix_decides_direct() {
        let routes = table();
        let index = RouteIndex::new(&routes, |r| {
            r.protocol == RTPROT_FLANNEL || r.oif == Some(9)
        });
        assert_eq!(index.len(), routes.len() - 2);
        let cases = [
            ("192.168.10.5", Reachability::Direct { oif: 2 }),
            (
                "192.168.10.200",
                Reachability::Gateway {
                    gateway: ip("192.168.10.1"),
                },
            ),
            ("192.168.30.9", Reachability::Direct { oif: 3 }),
            (
                "192.168.20.3",
                Reachability::Gateway {
                    gateway: ip("192.168.10.254"),
                },
            ),
            (
                "192.168.21.3",
                Reachability::Gateway {
                    gateway: ip("192.168.10.254"),
                },
            ),
            ("10.9.1.1", Reachability::Unreachable),
            ("172.20.0.1", Reachability::Direct { oif: 3 }),
            (
                "8.8.8.8",
                Reachability::Gateway {
                    gateway: ip("192.168.10.254"),
                },
            ),
            ("fd00:10::3", Reachability::Direct { oif: 2 }),
            (
                "fd00:11::3",
                Reachability::Gateway {
                    gateway: ip("fd00:10::fe"),
                },
            ),
        ];
        for (addr, want) in cases {
            assert_eq!(index.lookup(ip(addr)), want, "{addr}");
        }
    }

    #[test]
    fn no_default_route_means_unreachable() {
        let routes = vec![route("192.168.10.0/24").dev(2)];
        let facts = Facts::from_index(RouteIndex::new(&routes, |_| false));
        assert_eq!(facts.reach(ip("192.168.11.1")), Reachability::Unreachable);
        assert_eq!(facts.reach(ip("fd00::1")), Reachability::Unreachable);
        assert_eq!(
            Facts::none().reach(ip("192.168.10.1")),
            Reachability::Unknown
        );
        let lookups = Facts::from_lookups(HashMap::from([(
            ip("192.168.10.1"),
            Reachability::Direct { oif: 4 },
        )]));
        assert_eq!(
            lookups.reach(ip("192.168.10.1")),
            Reachability::Direct { oif: 4 }
        );
        assert_eq!(lookups.reach(ip("192.168.10.2")), Reachability::Unknown);
    }

    #[test]
    fn masking_handles_edges() {
        assert_eq!(masked(0xffff_ffff, 32, 0), 0);
        assert_eq!(masked(0xffff_ffff, 32, 32), 0xffff_ffff);
        assert_eq!(masked(0xc0a8_0a05, 32, 24), 0xc0a8_0a00);
        assert_eq!(masked(u128::MAX, 128, 128), u128::MAX);
        assert_eq!(masked(u128::MAX, 128, 64), u128::MAX << 64);
    }
}
