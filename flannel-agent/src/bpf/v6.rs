//! IPv6 on the fast path, agent side: [`LocalConfig6`] (the node's IPv6 settings), [`Remote6`]
//! (one remote IPv6 subnet) and the [`FastPath`] methods that write them into the IPv6 maps
//! (`flannel_ebpf::v6`, [`flannel_common::v6`]).
//!
//! The IPv6 maps are separate from the IPv4 ones, so a dual-stack node configures both and an
//! IPv6-only node only this side (its IPv4 configuration stays disabled). The kernel path the
//! programs rely on is upstream's: `<v6 subnet> via <peer's public IPv6> dev <ext>` for host-gw
//! (and DirectRouting) peers, `flannel-v6.<VNI>` with its neighbours and FDB entries for vxlan
//! peers, and `net.ipv6.conf.all.forwarding = 1`.

use std::{collections::BTreeMap, fs, net::Ipv6Addr};

use aya::maps::{Array, HashMap as BpfHashMap, LpmTrie, MapData, lpm_trie::Key};
use flannel_common::{
    route::{NodeEntry, RemoteEntry6},
    v6::{CFG6_ENABLED, CFG6_ROUTED_RX, CFG6_VXLAN_RX, CONFIG6, Config6, NODES6, ROUTES6},
};
use ipnet::Ipv6Net;

use super::{
    BpfError, FastPath, SyncStats, Via, VxlanLocal,
    config::{check_encap_values, check_interface, check_vni, kernel_source_ports},
    fastpath::{missing, remove_ignoring_missing},
    remote::{DesiredEntries, FamilyRemote, desired_entries, diff},
};

/// The local node's IPv6 fast-path settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalConfig6 {
    /// Our public IPv6 (`ExtV6Addr`).
    pub public_ip: Ipv6Addr,
    /// The external interface's index.
    pub ext_ifindex: u32,
    /// Our IPv6 lease.
    pub subnet: Ipv6Net,
    /// `IPv6Network`.
    pub network: Ipv6Net,
    /// `flannel-v6.<VNI>`, when the backend is vxlan (its MAC is the lease's v6 VtepMAC).
    pub vxlan: Option<VxlanLocal>,
    /// VXLAN UDP source ports (`[min, max)`, the kernel's `ip_local_port_range`).
    pub source_ports: (u16, u16),
    /// Hop limit of outer IPv6 headers (the external interface's `hop_limit`, 64 by default).
    pub hop_limit: u8,
    /// Receive VXLAN over IPv6 for pod-to-pod flows in eBPF.
    pub vxlan_rx: bool,
    /// Deliver plain (host-gw) IPv6 pod-to-pod packets in eBPF.
    pub routed_rx: bool,
}

impl LocalConfig6 {
    /// A configuration with the kernel's defaults for the rest (source ports from the calling
    /// thread's namespace, the default hop limit, both receive paths on, no VXLAN).
    pub fn new(public_ip: Ipv6Addr, ext_ifindex: u32, subnet: Ipv6Net, network: Ipv6Net) -> Self {
        LocalConfig6 {
            public_ip,
            ext_ifindex,
            subnet,
            network,
            vxlan: None,
            source_ports: kernel_source_ports().unwrap_or((32768, 60999)),
            hop_limit: kernel_hop_limit(None).unwrap_or(64),
            vxlan_rx: true,
            routed_rx: true,
        }
    }

    /// The map entry, after checking every value fits.
    pub fn to_entry(&self) -> Result<Config6, BpfError> {
        check_interface(self.ext_ifindex)?;
        if !self.network.contains(&self.subnet) {
            return Err(BpfError::Invalid {
                field: "ipv6 subnet",
                value: self.subnet.to_string(),
                reason: "it is not inside the IPv6 cluster network",
            });
        }
        check_encap_values(self.source_ports, "hop_limit", self.hop_limit)?;
        let mut flags = CFG6_ENABLED;
        if self.vxlan_rx && self.vxlan.is_some() {
            flags |= CFG6_VXLAN_RX;
        }
        if self.routed_rx {
            flags |= CFG6_ROUTED_RX;
        }
        let mut entry = Config6 {
            flags,
            ext_ifindex: self.ext_ifindex,
            public_ip: self.public_ip.octets(),
            local_subnet: self.subnet.trunc().network().octets(),
            local_prefix_len: u32::from(self.subnet.prefix_len()),
            cluster_net: self.network.trunc().network().octets(),
            cluster_prefix_len: u32::from(self.network.prefix_len()),
            src_port_min: self.source_ports.0,
            src_port_max: self.source_ports.1,
            hop_limit: self.hop_limit,
            ..Config6::default()
        };
        if let Some(vxlan) = self.vxlan {
            check_vni(vxlan.vni)?;
            if vxlan.vni == 0 || vxlan.port == 0 {
                return Err(BpfError::Invalid {
                    field: "vxlan",
                    value: format!("vni {} port {}", vxlan.vni, vxlan.port),
                    reason: "the IPv6 VXLAN fast path needs a non-zero VNI and port",
                });
            }
            entry.vni = vxlan.vni;
            entry.vxlan_port = vxlan.port;
            entry.vtep_mac = vxlan.vtep_mac;
        }
        Ok(entry)
    }
}

/// `net.ipv6.conf.<dev>.hop_limit` (or `default`) of the calling thread's network namespace:
/// the hop limit the kernel's VXLAN device puts in outer headers.
pub fn kernel_hop_limit(dev: Option<&str>) -> Option<u8> {
    let dev = dev.unwrap_or("default");
    fs::read_to_string(format!("/proc/sys/net/ipv6/conf/{dev}/hop_limit"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// One remote IPv6 subnet's way: the peer's public IPv6 and how to reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Remote6 {
    /// The peer's public IPv6 (the lease's `PublicIPv6`).
    pub public_ip: Ipv6Addr,
    /// The way: [`Via::HostGw`], [`Via::DirectRouting`] or [`Via::Vxlan`] (`flannel-v6.<VNI>`);
    /// IPIP and udp carry IPv4 only.
    pub via: Via,
}

impl Remote6 {
    /// The map value for this remote.
    pub fn to_entry(&self) -> Result<RemoteEntry6, BpfError> {
        if matches!(self.via, Via::Ipip | Via::Udp) {
            return Err(BpfError::Invalid {
                field: "via",
                value: format!("{:?}", self.via),
                reason: "IPIP and udp carry IPv4 only",
            });
        }
        let (kind, flags, vni, vtep_mac) = self.via.to_way()?;
        Ok(RemoteEntry6 {
            kind,
            flags,
            public_ip: self.public_ip.octets(),
            vni,
            vtep_mac,
            ..RemoteEntry6::default()
        })
    }

    /// The remote a map value describes, if the value is valid for IPv6.
    pub fn from_entry(entry: &RemoteEntry6) -> Option<Remote6> {
        let via = Via::from_way((entry.kind, entry.flags, entry.vni, entry.vtep_mac))?;
        if matches!(via, Via::Ipip | Via::Udp) {
            return None;
        }
        Some(Remote6 {
            public_ip: Ipv6Addr::from(entry.public_ip),
            via,
        })
    }
}

impl FamilyRemote for Remote6 {
    type Addr = Ipv6Addr;
    type Net = Ipv6Net;
    type Entry = RemoteEntry6;
    const SUBNET: &'static str = "ipv6 subnet";

    fn normalise(net: &Ipv6Net) -> Ipv6Net {
        net.trunc()
    }

    fn peer(&self) -> (Ipv6Addr, Via) {
        (self.public_ip, self.via)
    }

    fn entry(&self) -> Result<RemoteEntry6, BpfError> {
        self.to_entry()
    }
}

fn route_key6(net: &Ipv6Net) -> Key<[u8; 16]> {
    Key::new(u32::from(net.prefix_len()), net.network().octets())
}

/// What the IPv6 route map holds: valid entries, and keys to delete (not a subnet).
pub(super) type CurrentRoutes6 = (BTreeMap<Ipv6Net, RemoteEntry6>, Vec<Key<[u8; 16]>>);

impl FastPath {
    /// Disables the IPv4 side (an all-zero configuration entry: IPv4 frames are passed), for
    /// IPv6-only nodes.
    pub fn disable_ipv4(&mut self) -> Result<(), BpfError> {
        self.array_mut()?
            .set(0, flannel_common::config::Config::default(), 0)
            .map_err(|e| BpfError::map(flannel_common::maps::CONFIG, e))?;
        self.retire_memos()
    }

    /// Writes the IPv6 configuration (`Some`) or disables the IPv6 side (`None`: IPv6 frames
    /// are then passed to the kernel).
    pub fn set_config6(&mut self, config: Option<&LocalConfig6>) -> Result<(), BpfError> {
        let entry = match config {
            Some(config) => config.to_entry()?,
            None => Config6::default(),
        };
        self.write_config6(entry)?;
        self.retire_memos()
    }

    /// Writes `entry` as the IPv6 configuration (no checks; the memos stay).
    pub(super) fn write_config6(&mut self, entry: Config6) -> Result<(), BpfError> {
        let map = self
            .ebpf_mut()
            .map_mut(CONFIG6)
            .ok_or_else(|| missing(CONFIG6))?;
        let mut array: Array<&mut MapData, Config6> =
            Array::try_from(map).map_err(|e| BpfError::map(CONFIG6, e))?;
        array
            .set(0, entry, 0)
            .map_err(|e| BpfError::map(CONFIG6, e))
    }

    /// The IPv6 configuration entry as the programs see it.
    pub fn config6_entry(&self) -> Result<Config6, BpfError> {
        let map = self.ebpf().map(CONFIG6).ok_or_else(|| missing(CONFIG6))?;
        let array: Array<&MapData, Config6> =
            Array::try_from(map).map_err(|e| BpfError::map(CONFIG6, e))?;
        array.get(&0, 0).map_err(|e| BpfError::map(CONFIG6, e))
    }

    /// Makes the IPv6 route and node maps hold exactly `desired`, writing only what changed
    /// (the IPv6 twin of [`FastPath::sync`]).
    pub fn sync6(&mut self, desired: &BTreeMap<Ipv6Net, Remote6>) -> Result<SyncStats, BpfError> {
        let DesiredEntries { routes, nodes } = desired_entries(desired)?;
        let (current_nodes, current_routes, invalid) = match self.synced.v6.take() {
            Some(written) => (written.nodes, written.routes, Vec::new()),
            None => {
                let (routes, invalid) = self.current_routes6()?;
                (self.current_nodes6()?, routes, invalid)
            }
        };
        let (node_upserts, node_deletes, _, _) = diff(&current_nodes, &nodes);
        let (route_upserts, route_deletes, added, unchanged) = diff(&current_routes, &routes);
        let stats = SyncStats {
            added,
            updated: route_upserts.len() - added,
            removed: route_deletes.len() + invalid.len(),
            unchanged,
            nodes_written: node_upserts.len(),
            nodes_removed: node_deletes.len(),
        };
        {
            let map = self
                .ebpf_mut()
                .map_mut(NODES6)
                .ok_or_else(|| missing(NODES6))?;
            let mut hash: BpfHashMap<&mut MapData, [u8; 16], NodeEntry> =
                BpfHashMap::try_from(map).map_err(|e| BpfError::map(NODES6, e))?;
            for (addr, entry) in &node_upserts {
                hash.insert(addr.octets(), entry, 0)
                    .map_err(|e| BpfError::map(NODES6, e))?;
            }
        }
        {
            let map = self
                .ebpf_mut()
                .map_mut(ROUTES6)
                .ok_or_else(|| missing(ROUTES6))?;
            let mut trie: LpmTrie<&mut MapData, [u8; 16], RemoteEntry6> =
                LpmTrie::try_from(map).map_err(|e| BpfError::map(ROUTES6, e))?;
            for (net, entry) in &route_upserts {
                trie.insert(&route_key6(net), entry, 0)
                    .map_err(|e| BpfError::map(ROUTES6, e))?;
            }
            for net in &route_deletes {
                remove_ignoring_missing(trie.remove(&route_key6(net)), ROUTES6)?;
            }
            for key in &invalid {
                remove_ignoring_missing(trie.remove(key), ROUTES6)?;
            }
        }
        {
            let map = self
                .ebpf_mut()
                .map_mut(NODES6)
                .ok_or_else(|| missing(NODES6))?;
            let mut hash: BpfHashMap<&mut MapData, [u8; 16], NodeEntry> =
                BpfHashMap::try_from(map).map_err(|e| BpfError::map(NODES6, e))?;
            for addr in &node_deletes {
                remove_ignoring_missing(hash.remove(&addr.octets()), NODES6)?;
            }
        }
        let changed = !(node_upserts.is_empty()
            && node_deletes.is_empty()
            && route_upserts.is_empty()
            && route_deletes.is_empty()
            && invalid.is_empty());
        if changed {
            // The IPv6 memos rest on these maps as the IPv4 ones on theirs.
            self.retire_memos()?;
        }
        self.synced.v6.entries = Some(DesiredEntries { routes, nodes });
        Ok(stats)
    }

    /// The remote IPv6 subnets the route map holds (invalid entries left out).
    pub fn remotes6(&self) -> Result<BTreeMap<Ipv6Net, Remote6>, BpfError> {
        let (routes, _) = self.current_routes6()?;
        Ok(routes
            .iter()
            .filter_map(|(net, entry)| Some((*net, Remote6::from_entry(entry)?)))
            .collect())
    }

    pub(super) fn current_routes6(&self) -> Result<CurrentRoutes6, BpfError> {
        let mut routes = BTreeMap::new();
        let mut invalid = Vec::new();
        for (key, entry) in self.read_all::<Key<[u8; 16]>, RemoteEntry6>(ROUTES6)? {
            match u8::try_from(key.prefix_len())
                .ok()
                .and_then(|p| Ipv6Net::new(Ipv6Addr::from(key.data()), p).ok())
            {
                Some(net) if net.trunc() == net => {
                    routes.insert(net, entry);
                }
                _ => invalid.push(key),
            }
        }
        Ok((routes, invalid))
    }

    pub(super) fn current_nodes6(&self) -> Result<BTreeMap<Ipv6Addr, NodeEntry>, BpfError> {
        Ok(self
            .read_all::<[u8; 16], NodeEntry>(NODES6)?
            .into_iter()
            .map(|(addr, entry)| (Ipv6Addr::from(addr), entry))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use flannel_common::route::NODE_F_VXLAN;

    use super::*;

    fn net(s: &str) -> Ipv6Net {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn base() -> LocalConfig6 {
        LocalConfig6 {
            source_ports: (32768, 60999),
            hop_limit: 64,
            ..LocalConfig6::new(
                "fd00:77::1".parse().unwrap_or(Ipv6Addr::LOCALHOST),
                3,
                net("fd00:10:244:1::/64"),
                net("fd00:10:244::/48"),
            )
        }
    }

    #[test]
    fn converts_every_field() {
        let cfg = LocalConfig6 {
            vxlan: Some(VxlanLocal {
                vni: 7,
                port: 8472,
                vtep_mac: [0x0e, 1, 2, 3, 4, 5],
            }),
            ..base()
        };
        let e = cfg.to_entry().expect("valid");
        assert_eq!(e.flags, CFG6_ENABLED | CFG6_VXLAN_RX | CFG6_ROUTED_RX);
        assert_eq!(e.public_ip, cfg.public_ip.octets());
        assert_eq!(
            (e.local_subnet, e.local_prefix_len),
            (net("fd00:10:244:1::/64").network().octets(), 64)
        );
        assert_eq!(e.cluster_prefix_len, 48);
        assert_eq!((e.vni, e.vxlan_port, e.hop_limit), (7, 8472, 64));
        assert_eq!(e.vtep_mac, [0x0e, 1, 2, 3, 4, 5]);
        assert_eq!(
            base().to_entry().expect("valid").flags,
            CFG6_ENABLED | CFG6_ROUTED_RX
        );
        for bad in [
            LocalConfig6 {
                ext_ifindex: 0,
                ..base()
            },
            LocalConfig6 {
                subnet: net("fd00:99::/64"),
                ..base()
            },
            LocalConfig6 {
                hop_limit: 0,
                ..base()
            },
            LocalConfig6 {
                vxlan: Some(VxlanLocal {
                    vni: 0,
                    port: 8472,
                    vtep_mac: [2; 6],
                }),
                ..base()
            },
        ] {
            assert!(matches!(bad.to_entry(), Err(BpfError::Invalid { .. })));
        }
    }

    #[test]
    fn remotes_round_trip_and_refuse_ipv4_only_kinds() {
        for via in [
            Via::HostGw,
            Via::DirectRouting,
            Via::Vxlan {
                vtep_mac: [2, 3, 4, 5, 6, 7],
                vni: 1,
            },
        ] {
            let remote = Remote6 {
                public_ip: "fd00:77::2".parse().unwrap_or(Ipv6Addr::LOCALHOST),
                via,
            };
            let entry = remote.to_entry().expect("valid");
            assert_eq!(Remote6::from_entry(&entry), Some(remote));
        }
        for via in [Via::Ipip, Via::Udp] {
            let remote = Remote6 {
                public_ip: Ipv6Addr::LOCALHOST,
                via,
            };
            assert!(remote.to_entry().is_err(), "{via:?}");
        }
    }

    #[test]
    fn nodes_are_the_vxlan_peers() {
        let mut desired = BTreeMap::new();
        let peer: Ipv6Addr = "fd00:77::2".parse().unwrap_or(Ipv6Addr::LOCALHOST);
        desired.insert(
            net("fd00:10:244:2::/64"),
            Remote6 {
                public_ip: peer,
                via: Via::Vxlan {
                    vtep_mac: [2; 6],
                    vni: 1,
                },
            },
        );
        desired.insert(
            net("fd00:10:244:3::9/64"),
            Remote6 {
                public_ip: "fd00:77::3".parse().unwrap_or(Ipv6Addr::LOCALHOST),
                via: Via::HostGw,
            },
        );
        let DesiredEntries { routes, nodes } = desired_entries(&desired).expect("valid");
        assert!(
            routes.contains_key(&net("fd00:10:244:3::/64")),
            "normalised"
        );
        assert_eq!(nodes.len(), 1);
        assert_eq!(nodes[&peer].flags, NODE_F_VXLAN);
        desired.insert(
            net("fd00:10:244:3::/64"),
            Remote6 {
                public_ip: Ipv6Addr::LOCALHOST,
                via: Via::HostGw,
            },
        );
        assert!(desired_entries(&desired).is_err());
    }
}
