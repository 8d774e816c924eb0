//! [`Remote`]: how to reach one remote pod subnet, as the reconciler computes it, and the pure
//! diff that [`super::FastPath::sync`] applies to the maps. The conversion to map entries is
//! shared with IPv6 ([`super::Remote6`]): [`Via`] ↔ `Way`, and `desired_entries` over
//! a `FamilyRemote`.

use std::{collections::BTreeMap, fmt, net::Ipv4Addr};

use flannel_common::route::{
    NODE_F_IPIP, NODE_F_VXLAN, NodeEntry, ROUTE_F_DIRECT, RemoteEntry, RouteKind,
};
use ipnet::Ipv4Net;

use super::{BpfError, config::check_vni};
use crate::sorted::{Joined, join};

/// How packets for a remote subnet travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Via {
    /// host-gw backend: a plain route through the peer's public IP (the kernel applier
    /// installs `<subnet> via <public ip> dev <ext>`; the program follows the kernel FIB).
    HostGw,
    /// A vxlan or ipip peer reached by DirectRouting (same L2 segment): treated as host-gw.
    DirectRouting,
    /// VXLAN to the peer's `flannel.<VNI>`.
    Vxlan {
        /// The peer's VtepMAC (inner Ethernet destination).
        vtep_mac: [u8; 6],
        /// The VNI to put on the wire. A kernel `flannel.<VNI>` sends its own VNI to every peer,
        /// so for parity with the kernel path this is the local device's VNI (which equals the
        /// peer's in any working cluster).
        vni: u32,
    },
    /// IPIP to the peer. The kernel applier installs `<subnet> via <next hop towards the
    /// peer's public IP> dev <ext> onlink` (with `mtu <ext MTU - 20>`), so that
    /// host-originated packets reach `tc_to_netdev`, which encapsulates them.
    Ipip,
    /// The udp backend: the inner packet as the payload of a UDP datagram to the peer's public
    /// IP and the port of [`super::UdpLocal`], exactly as the TUN path (`flannel0` and the
    /// forwarder) sends it. The TUN path stays in place for everything the programs pass.
    Udp,
}

/// The fields a route map value of either family spends on the way, in its order: `kind` (a
/// [`RouteKind`]), `flags` (`ROUTE_F_*`), `vni` and `vtep_mac` (vxlan only). The rest of the
/// value is the peer's public address.
pub(crate) type Way = (u32, u32, u32, [u8; 6]);

impl Via {
    /// The map value's fields for this way (the VNI checked).
    pub(crate) fn to_way(self) -> Result<Way, BpfError> {
        Ok(match self {
            Via::HostGw => (RouteKind::HostGw as u32, 0, 0, [0; 6]),
            Via::DirectRouting => (RouteKind::HostGw as u32, ROUTE_F_DIRECT, 0, [0; 6]),
            Via::Vxlan { vtep_mac, vni } => {
                check_vni(vni)?;
                (RouteKind::Vxlan as u32, 0, vni, vtep_mac)
            }
            Via::Ipip => (RouteKind::Ipip as u32, 0, 0, [0; 6]),
            Via::Udp => (RouteKind::Udp as u32, 0, 0, [0; 6]),
        })
    }

    /// The way a map value's fields describe, if its kind is valid.
    pub(crate) fn from_way((kind, flags, vni, vtep_mac): Way) -> Option<Via> {
        Some(match RouteKind::from_u32(kind)? {
            RouteKind::HostGw if flags & ROUTE_F_DIRECT != 0 => Via::DirectRouting,
            RouteKind::HostGw => Via::HostGw,
            RouteKind::Vxlan => Via::Vxlan { vtep_mac, vni },
            RouteKind::Ipip => Via::Ipip,
            RouteKind::Udp => Via::Udp,
        })
    }

    /// The tunnel kinds a node reached this way may send us (`NODE_F_*`).
    fn node_flags(self) -> u32 {
        match self {
            Via::Vxlan { .. } => NODE_F_VXLAN,
            Via::Ipip => NODE_F_IPIP,
            // The TUN path accepts datagrams from any source (NAT), and so does the receive.
            Via::HostGw | Via::DirectRouting | Via::Udp => 0,
        }
    }
}

/// One remote subnet's way: the peer's public IP and how to reach it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Remote {
    /// The peer's public IP (the lease's `PublicIP`).
    pub public_ip: Ipv4Addr,
    /// The way.
    pub via: Via,
}

impl Remote {
    /// The map value for this remote.
    pub fn to_entry(&self) -> Result<RemoteEntry, BpfError> {
        let (kind, flags, vni, vtep_mac) = self.via.to_way()?;
        Ok(RemoteEntry {
            kind,
            flags,
            public_ip: self.public_ip.octets(),
            vni,
            vtep_mac,
            ..RemoteEntry::default()
        })
    }

    /// The remote a map value describes, if the value is valid.
    pub fn from_entry(entry: &RemoteEntry) -> Option<Remote> {
        let via = Via::from_way((entry.kind, entry.flags, entry.vni, entry.vtep_mac))?;
        Some(Remote {
            public_ip: Ipv4Addr::from(entry.public_ip),
            via,
        })
    }
}

/// A remote of one address family ([`Remote`], [`super::Remote6`]), as [`desired_entries`]
/// turns it into map entries.
pub(crate) trait FamilyRemote {
    /// The peer's public address (the node map's key).
    type Addr: Copy + Ord;
    /// A remote pod subnet (the route map's key, normalised).
    type Net: Copy + Ord + fmt::Display;
    /// The route map's value.
    type Entry;
    /// The subnet's name in errors.
    const SUBNET: &'static str;

    /// The subnet with its host bits cleared.
    fn normalise(net: &Self::Net) -> Self::Net;
    /// The peer's public address and the way to it.
    fn peer(&self) -> (Self::Addr, Via);
    /// The route map value.
    fn entry(&self) -> Result<Self::Entry, BpfError>;
}

impl FamilyRemote for Remote {
    type Addr = Ipv4Addr;
    type Net = Ipv4Net;
    type Entry = RemoteEntry;
    const SUBNET: &'static str = "subnet";

    fn normalise(net: &Ipv4Net) -> Ipv4Net {
        net.trunc()
    }

    fn peer(&self) -> (Ipv4Addr, Via) {
        (self.public_ip, self.via)
    }

    fn entry(&self) -> Result<RemoteEntry, BpfError> {
        self.to_entry()
    }
}

/// What [`super::FastPath::sync`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Route entries written for subnets that were not in the map.
    pub added: usize,
    /// Route entries rewritten because their value changed.
    pub updated: usize,
    /// Route entries deleted (subnets no longer desired, or invalid values).
    pub removed: usize,
    /// Route entries that already matched.
    pub unchanged: usize,
    /// Node entries written (new or changed).
    pub nodes_written: usize,
    /// Node entries deleted.
    pub nodes_removed: usize,
}

impl SyncStats {
    /// Whether the maps changed at all.
    pub fn changed(&self) -> bool {
        self.added + self.updated + self.removed + self.nodes_written + self.nodes_removed > 0
    }
}

/// The writes that turn `current` into `desired`: `(upserts, deletes)`, and the counts
/// `(added, unchanged)`. Upserts come in `desired`'s key order, deletes in `current`'s. One
/// pass over both maps side by side ([`join`]): a lease event diffs every entry of the maps.
pub(crate) fn diff<K: Ord + Copy, V: PartialEq + Copy>(
    current: &BTreeMap<K, V>,
    desired: &BTreeMap<K, V>,
) -> (Vec<(K, V)>, Vec<K>, usize, usize) {
    let (mut upserts, mut deletes) = (Vec::new(), Vec::new());
    let (mut added, mut unchanged) = (0, 0);
    for joined in join(desired, current) {
        match joined {
            Joined::First(key, value) => {
                added += 1;
                upserts.push((*key, *value));
            }
            Joined::Both(_, want, have) if want == have => unchanged += 1,
            Joined::Both(key, value, _) => upserts.push((*key, *value)),
            Joined::Second(key, _) => deletes.push(*key),
        }
    }
    (upserts, deletes, added, unchanged)
}

/// The map contents a desired set of one family stands for.
pub(crate) struct DesiredEntries<R: FamilyRemote> {
    /// Route map: normalised subnet → entry.
    pub routes: BTreeMap<R::Net, R::Entry>,
    /// Node map: public address → accepted tunnels.
    pub nodes: BTreeMap<R::Addr, NodeEntry>,
}

/// The route and node entries for a desired set, with subnets normalised to their network
/// address. Two desired subnets that normalise to the same key are an error.
pub(crate) fn desired_entries<R: FamilyRemote>(
    desired: &BTreeMap<R::Net, R>,
) -> Result<DesiredEntries<R>, BpfError> {
    let mut routes = BTreeMap::new();
    let mut nodes: BTreeMap<R::Addr, NodeEntry> = BTreeMap::new();
    for (subnet, remote) in desired {
        match routes.entry(R::normalise(subnet)) {
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert(remote.entry()?);
            }
            std::collections::btree_map::Entry::Occupied(_) => {
                return Err(BpfError::Invalid {
                    field: R::SUBNET,
                    value: subnet.to_string(),
                    reason: "another desired subnet has the same network address and length",
                });
            }
        }
        let (public_ip, via) = remote.peer();
        let flags = via.node_flags();
        if flags != 0 {
            nodes.entry(public_ip).or_default().flags |= flags;
        }
    }
    Ok(DesiredEntries { routes, nodes })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn vxlan(ip: [u8; 4], mac: u8) -> Remote {
        Remote {
            public_ip: Ipv4Addr::from(ip),
            via: Via::Vxlan {
                vtep_mac: [0x0e, 0, 0, 0, 0, mac],
                vni: 1,
            },
        }
    }

    #[test]
    fn entries_round_trip() {
        for via in [
            Via::HostGw,
            Via::DirectRouting,
            Via::Ipip,
            Via::Udp,
            Via::Vxlan {
                vtep_mac: [2, 3, 4, 5, 6, 7],
                vni: 0xabcdef,
            },
        ] {
            let remote = Remote {
                public_ip: Ipv4Addr::new(192, 168, 0, 7),
                via,
            };
            let entry = remote.to_entry().expect("valid");
            assert_eq!(Remote::from_entry(&entry), Some(remote));
        }
        assert_eq!(Remote::from_entry(&RemoteEntry::default()), None);
        let too_big = Remote {
            public_ip: Ipv4Addr::LOCALHOST,
            via: Via::Vxlan {
                vtep_mac: [0; 6],
                vni: 1 << 24,
            },
        };
        assert!(too_big.to_entry().is_err());
    }

    #[test]
    fn diff_writes_only_changes() {
        let current: BTreeMap<u8, u8> = [(1, 1), (2, 2), (3, 3)].into();
        let desired: BTreeMap<u8, u8> = [(1, 1), (2, 20), (4, 4)].into();
        let (upserts, deletes, added, unchanged) = diff(&current, &desired);
        assert_eq!(upserts, vec![(2, 20), (4, 4)]);
        assert_eq!(deletes, vec![3]);
        assert_eq!((added, unchanged), (1, 1));
        let (upserts, deletes, added, unchanged) = diff(&desired, &desired);
        assert!(upserts.is_empty() && deletes.is_empty());
        assert_eq!((added, unchanged), (0, 3));
    }

    /// The diff by lookups, as it was before the single pass.
    fn diff_by_lookups(
        current: &BTreeMap<u8, u8>,
        desired: &BTreeMap<u8, u8>,
    ) -> (Vec<(u8, u8)>, Vec<u8>, usize, usize) {
        let mut upserts = Vec::new();
        let (mut added, mut unchanged) = (0, 0);
        for (key, value) in desired {
            match current.get(key) {
                Some(have) if have == value => unchanged += 1,
                Some(_) => upserts.push((*key, *value)),
                None => {
                    added += 1;
                    upserts.push((*key, *value));
                }
            }
        }
        let deletes = current
            .keys()
            .filter(|k| !desired.contains_key(k))
            .copied()
            .collect();
        (upserts, deletes, added, unchanged)
    }

    /// The single pass gives what looking each key up gives, on random pairs of small maps
    /// (keys and values from small ranges, so that they share keys, with equal values or not).
    #[test]
    fn diff_in_one_pass_equals_diff_by_lookups() {
        use rand::{SeedableRng as _, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(17);
        for _ in 0..5_000 {
            let (current, desired) = (
                crate::sorted::random_map(&mut rng),
                crate::sorted::random_map(&mut rng),
            );
            assert_eq!(
                diff(&current, &desired),
                diff_by_lookups(&current, &desired),
                "current {current:?}, desired {desired:?}"
            );
        }
    }

    #[test]
    fn nodes_merge_kinds_and_skip_plain_routes() {
        let mut desired = BTreeMap::new();
        desired.insert(net("10.244.2.0/24"), vxlan([192, 168, 0, 2], 2));
        desired.insert(
            net("10.244.3.0/24"),
            Remote {
                public_ip: Ipv4Addr::new(192, 168, 0, 2),
                via: Via::Ipip,
            },
        );
        desired.insert(
            net("10.244.4.0/24"),
            Remote {
                public_ip: Ipv4Addr::new(192, 168, 0, 4),
                via: Via::HostGw,
            },
        );
        let DesiredEntries { routes, nodes } = desired_entries(&desired).expect("valid");
        assert_eq!(routes.len(), 3);
        assert_eq!(nodes.len(), 1);
        assert_eq!(
            nodes[&Ipv4Addr::new(192, 168, 0, 2)].flags,
            NODE_F_VXLAN | NODE_F_IPIP
        );
    }

    #[test]
    fn subnets_are_normalised_and_duplicates_refused() {
        let mut desired = BTreeMap::new();
        desired.insert(net("10.244.2.9/24"), vxlan([192, 168, 0, 2], 2));
        let entries = desired_entries(&desired).expect("valid");
        assert!(entries.routes.contains_key(&net("10.244.2.0/24")));
        desired.insert(net("10.244.2.0/24"), vxlan([192, 168, 0, 3], 3));
        assert!(desired_entries(&desired).is_err());
    }
}
