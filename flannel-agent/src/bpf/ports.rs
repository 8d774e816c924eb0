//! Local pods' bridge ports on the fast path: the bridge's forwarding database mirrored into
//! `FLANNEL_PORTS` (pod MAC → host-side veth), so that `tc_from_netdev` delivers packets for
//! local pods straight into their network namespace (see [`flannel_common::pods`]); and the
//! veth ports themselves, where `tc_from_bridge` is attached ([`veth_ports`]).
//!
//! The desired set is a function of what the kernel holds ([`desired_ports`] of the bridge's
//! links and FDB), applied by diff ([`FastPath::sync_ports`]): the daemon re-reads it whenever
//! the bridge's FDB or its ports change, and a restarted agent fills the (unpinned) map the
//! same way.

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::{HashMap, MapData};
use flannel_common::pods::{PORTS, PodPort, PortKey};

use super::{BpfError, FastPath, remote::diff};
use crate::netlink::{FdbEntry, Link, NeighbourState};

/// The map entries for bridge `bridge` given the host's links and the bridge's FDB: every MAC
/// the bridge holds for one of its veth ports, except the ports' own (local, permanent)
/// addresses. A MAC seen on two ports (a pod moved) is left out: the bridge is the safe way
/// until the stale entry ages out.
pub fn desired_ports(bridge: u32, links: &[Link], fdb: &[FdbEntry]) -> BTreeMap<PortKey, PodPort> {
    let veth_ports = veth_ports(bridge, links);
    let mut out = BTreeMap::new();
    let mut ambiguous = BTreeSet::new();
    for entry in fdb {
        if entry.master != Some(bridge)
            || entry.state == NeighbourState::Permanent
            || !veth_ports.contains(&entry.ifindex)
            || entry.mac == [0; 6]
            || entry.mac[0] & 1 != 0
        {
            continue;
        }
        let key = PortKey::new(entry.mac);
        let port = PodPort {
            ifindex: entry.ifindex,
            bridge,
        };
        if let Some(previous) = out.insert(key, port)
            && previous != port
        {
            ambiguous.insert(key);
        }
    }
    for key in ambiguous {
        out.remove(&key);
    }
    out
}

/// The veth ports of bridge `bridge`: where `tc_from_bridge` is attached
/// ([`FastPath::attach_ports`]).
pub fn veth_ports(bridge: u32, links: &[Link]) -> BTreeSet<u32> {
    links
        .iter()
        .filter(|l| l.master == Some(bridge) && l.is_kind("veth"))
        .map(|l| l.index)
        .collect()
}

/// What [`FastPath::sync_ports`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortSync {
    /// Entries written (new or changed).
    pub written: usize,
    /// Entries removed.
    pub removed: usize,
    /// Entries the map holds now.
    pub total: usize,
}

impl FastPath {
    /// Makes `FLANNEL_PORTS` hold exactly `desired`: writes new and changed entries, deletes
    /// the rest. Idempotent.
    pub fn sync_ports(
        &mut self,
        desired: &BTreeMap<PortKey, PodPort>,
    ) -> Result<PortSync, BpfError> {
        let current = self.ports()?;
        let (upserts, deletes, _, _) = diff(&current, desired);
        let mut map = self.ports_mut()?;
        for (key, port) in &upserts {
            map.insert(key, port, 0)
                .map_err(|e| BpfError::map(PORTS, e))?;
        }
        for key in &deletes {
            match map.remove(key) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                Err(e) => return Err(BpfError::map(PORTS, e)),
            }
        }
        if !upserts.is_empty() || !deletes.is_empty() {
            // A pod's port moved or went away: delivery memos must look again.
            self.retire_memos()?;
        }
        Ok(PortSync {
            written: upserts.len(),
            removed: deletes.len(),
            total: desired.len(),
        })
    }

    /// What `FLANNEL_PORTS` holds.
    pub fn ports(&self) -> Result<BTreeMap<PortKey, PodPort>, BpfError> {
        let map = self
            .ebpf()
            .map(PORTS)
            .ok_or_else(|| super::fastpath::missing(PORTS))?;
        let map: HashMap<&MapData, PortKey, PodPort> =
            HashMap::try_from(map).map_err(|e| BpfError::map(PORTS, e))?;
        map.iter()
            .map(|r| r.map_err(|e| BpfError::map(PORTS, e)))
            .collect()
    }

    fn ports_mut(&mut self) -> Result<HashMap<&mut MapData, PortKey, PodPort>, BpfError> {
        let map = self
            .ebpf_mut()
            .map_mut(PORTS)
            .ok_or_else(|| super::fastpath::missing(PORTS))?;
        HashMap::try_from(map).map_err(|e| BpfError::map(PORTS, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::{NeighbourFlags, links::OperState};

    fn link(index: u32, kind: &str, master: Option<u32>) -> Link {
        Link {
            index,
            name: format!("if{index}"),
            kind: Some(kind.into()),
            mtu: 1500,
            mac: None,
            up: true,
            lower_up: true,
            oper_state: OperState::Up,
            master,
            vxlan: None,
            ip_tunnel: None,
        }
    }

    fn fdb(port: u32, mac: [u8; 6], state: NeighbourState, master: u32) -> FdbEntry {
        FdbEntry {
            ifindex: port,
            mac,
            dst: None,
            vni: None,
            port: None,
            state,
            flags: NeighbourFlags(NeighbourFlags::MASTER),
            master: Some(master),
        }
    }

    const POD_A: [u8; 6] = [0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x02];
    const POD_B: [u8; 6] = [0x0a, 0x58, 0x0a, 0xf4, 0x01, 0x03];

    #[test]
    fn learnt_macs_on_veth_ports_of_the_bridge_become_entries() {
        let links = [
            link(10, "bridge", None),
            link(11, "veth", Some(10)),
            link(12, "veth", Some(10)),
            link(13, "vxlan", Some(10)),
            link(14, "veth", Some(99)),
        ];
        let entries = [
            fdb(11, POD_A, NeighbourState::Reachable, 10),
            fdb(12, POD_B, NeighbourState::Stale, 10),
            // The port's own address.
            fdb(11, [0x02, 0, 0, 0, 0, 0x11], NeighbourState::Permanent, 10),
            // Not a veth port, another bridge, multicast.
            fdb(13, [0x02, 0, 0, 0, 0, 0x13], NeighbourState::Reachable, 10),
            fdb(14, [0x02, 0, 0, 0, 0, 0x14], NeighbourState::Reachable, 99),
            fdb(12, [0x01, 0, 0x5e, 0, 0, 1], NeighbourState::Reachable, 10),
        ];
        assert_eq!(veth_ports(10, &links), BTreeSet::from([11, 12]));
        let ports = desired_ports(10, &links, &entries);
        assert_eq!(
            ports,
            BTreeMap::from([
                (
                    PortKey::new(POD_A),
                    PodPort {
                        ifindex: 11,
                        bridge: 10
                    }
                ),
                (
                    PortKey::new(POD_B),
                    PodPort {
                        ifindex: 12,
                        bridge: 10
                    }
                ),
            ])
        );
    }

    #[test]
    fn a_mac_on_two_ports_stays_with_the_bridge() {
        let links = [link(11, "veth", Some(10)), link(12, "veth", Some(10))];
        let entries = [
            fdb(11, POD_A, NeighbourState::Reachable, 10),
            fdb(12, POD_A, NeighbourState::Reachable, 10),
        ];
        assert!(desired_ports(10, &links, &entries).is_empty());
    }
}
