//! The udp backend on the fast path, agent side: [`UdpLocal`] (the node's interface address
//! and `Port`) written into the programs' udp configuration map.
//!
//! With it set and the route map holding [`super::Via::Udp`] entries (the eBPF applier writes
//! them from the same desired model the udp applier turns into the forwarder's table), pod
//! traffic to udp peers is encapsulated in `tc_from_bridge` and received in `tc_from_netdev`;
//! `flannel0` and the forwarder stay in place for host traffic and everything the programs
//! pass (see `flannel_ebpf::udp` and [`flannel_common::udp`] for the wire format).

use std::net::Ipv4Addr;

use aya::maps::{Array, MapData};
use flannel_common::udp::{UDP_CFG_ENABLED, UDP_CONFIG, UdpConfig};

use super::{BpfError, FastPath};

/// The udp backend's local settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdpLocal {
    /// The interface address (`IfaceAddr`) the forwarder's socket is bound to: outer source of
    /// the datagrams, and the address they are received on.
    pub iface_addr: Ipv4Addr,
    /// The configured `Port` (8285 by default): source and destination port of every datagram.
    pub port: u16,
}

impl UdpLocal {
    /// The map entry, after checking the values.
    pub fn to_entry(&self) -> Result<UdpConfig, BpfError> {
        if self.port == 0 {
            return Err(BpfError::Invalid {
                field: "udp port",
                value: "0".into(),
                reason: "the udp backend needs a port (8285 by default)",
            });
        }
        if self.iface_addr.is_unspecified() {
            return Err(BpfError::Invalid {
                field: "udp interface address",
                value: self.iface_addr.to_string(),
                reason: "datagrams are sent from and received on a real address",
            });
        }
        Ok(UdpConfig {
            flags: UDP_CFG_ENABLED,
            iface_addr: self.iface_addr.octets(),
            port: self.port,
            _pad: 0,
        })
    }
}

impl FastPath {
    /// Enables the udp encapsulation with `udp` (`Some`) or disables it (`None`: udp routes are
    /// then passed to the kernel, and datagrams to the forwarder's socket).
    pub fn set_udp(&mut self, udp: Option<&UdpLocal>) -> Result<(), BpfError> {
        let entry = match udp {
            Some(udp) => udp.to_entry()?,
            None => UdpConfig::default(),
        };
        let map = self
            .ebpf_mut()
            .map_mut(UDP_CONFIG)
            .ok_or_else(|| missing(UDP_CONFIG))?;
        let mut array: Array<&mut MapData, UdpConfig> =
            Array::try_from(map).map_err(|e| BpfError::map(UDP_CONFIG, e))?;
        array
            .set(0, entry, 0)
            .map_err(|e| BpfError::map(UDP_CONFIG, e))
    }

    /// The udp configuration entry as the programs see it.
    pub fn udp_entry(&self) -> Result<UdpConfig, BpfError> {
        let map = self
            .ebpf()
            .map(UDP_CONFIG)
            .ok_or_else(|| missing(UDP_CONFIG))?;
        let array: Array<&MapData, UdpConfig> =
            Array::try_from(map).map_err(|e| BpfError::map(UDP_CONFIG, e))?;
        array.get(&0, 0).map_err(|e| BpfError::map(UDP_CONFIG, e))
    }
}

fn missing(name: &'static str) -> BpfError {
    BpfError::BadMap {
        name,
        reason: "not in the eBPF object".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_carry_address_and_port() {
        let udp = UdpLocal {
            iface_addr: Ipv4Addr::new(192, 168, 1, 11),
            port: 8285,
        };
        let e = udp.to_entry().expect("valid");
        assert_eq!(
            (e.flags, e.iface_addr, e.port),
            (UDP_CFG_ENABLED, [192, 168, 1, 11], 8285)
        );
        for bad in [
            UdpLocal { port: 0, ..udp },
            UdpLocal {
                iface_addr: Ipv4Addr::UNSPECIFIED,
                ..udp
            },
        ] {
            assert!(matches!(bad.to_entry(), Err(BpfError::Invalid { .. })));
        }
    }
}
