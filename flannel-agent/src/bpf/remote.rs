//! [`Remote`]: how to reach one remote pod subnet, as the reconciler computes it, and the pure
//! diff that [`super::FastPath::sync`] applies to the maps.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use flannel_common::route::{
    NODE_F_IPIP, NODE_F_VXLAN, NodeEntry, ROUTE_F_DIRECT, RemoteEntry, RouteKind,
};
use ipnet::Ipv4Net;

use super::{BpfError, config::check_vni};

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
        let mut entry = RemoteEntry {
            public_ip: self.public_ip.octets(),
            ..RemoteEntry::default()
        };
        match self.via {
            Via::HostGw => entry.kind = RouteKind::HostGw as u32,
            Via::DirectRouting => {
                entry.kind = RouteKind::HostGw as u32;
                entry.flags = ROUTE_F_DIRECT;
            }
            Via::Vxlan { vtep_mac, vni } => {
                check_vni(vni)?;
                entry.kind = RouteKind::Vxlan as u32;
                entry.vni = vni;
                entry.vtep_mac = vtep_mac;
            }
            Via::Ipip => entry.kind = RouteKind::Ipip as u32,
            Via::Udp => entry.kind = RouteKind::Udp as u32,
        }
        Ok(entry)
    }

    /// The remote a map value describes, if the value is valid.
    pub fn from_entry(entry: &RemoteEntry) -> Option<Remote> {
        let via = match RouteKind::from_u32(entry.kind)? {
            RouteKind::HostGw if entry.flags & ROUTE_F_DIRECT != 0 => Via::DirectRouting,
            RouteKind::HostGw => Via::HostGw,
            RouteKind::Vxlan => Via::Vxlan {
                vtep_mac: entry.vtep_mac,
                vni: entry.vni,
            },
            RouteKind::Ipip => Via::Ipip,
            RouteKind::Udp => Via::Udp,
        };
        Some(Remote {
            public_ip: Ipv4Addr::from(entry.public_ip),
            via,
        })
    }

    /// The tunnel kinds this remote's node may send us (`NODE_F_*`).
    fn node_flags(&self) -> u32 {
        match self.via {
            Via::Vxlan { .. } => NODE_F_VXLAN,
            Via::Ipip => NODE_F_IPIP,
            // The TUN path accepts datagrams from any source (NAT), and so does the receive.
            Via::HostGw | Via::DirectRouting | Via::Udp => 0,
        }
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

/// The writes that turn `current` into `desired`: `(upserts, deletes)`, and the counts.
pub(crate) fn diff<K: Ord + Copy, V: PartialEq + Copy>(
    current: &BTreeMap<K, V>,
    desired: &BTreeMap<K, V>,
) -> (Vec<(K, V)>, Vec<K>, usize, usize) {
    let mut upserts = Vec::new();
    let mut added = 0;
    let mut unchanged = 0;
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

/// The map contents a desired set stands for.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct DesiredEntries {
    /// Route map: normalised subnet → entry.
    pub routes: BTreeMap<Ipv4Net, RemoteEntry>,
    /// Node map: public IP → accepted tunnels.
    pub nodes: BTreeMap<Ipv4Addr, NodeEntry>,
}

/// The route and node entries for a desired set, with subnets normalised to their network
/// address. Two desired subnets that normalise to the same key are an error.
pub(crate) fn desired_entries(
    desired: &BTreeMap<Ipv4Net, Remote>,
) -> Result<DesiredEntries, BpfError> {
    let mut routes = BTreeMap::new();
    let mut nodes: BTreeMap<Ipv4Addr, NodeEntry> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for (subnet, remote) in desired {
        let key = subnet.trunc();
        if !seen.insert(key) {
            return Err(BpfError::Invalid {
                field: "subnet",
                value: subnet.to_string(),
                reason: "another desired subnet has the same network address and length",
            });
        }
        routes.insert(key, remote.to_entry()?);
        let flags = remote.node_flags();
        if flags != 0 {
            nodes.entry(remote.public_ip).or_default().flags |= flags;
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
