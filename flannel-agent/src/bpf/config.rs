//! [`LocalConfig`]: the local node's settings the programs need, and its conversion to the
//! map entry ([`flannel_common::config::Config`]).

use std::{fs, net::Ipv4Addr};

use flannel_common::config::{
    CFG_ENABLED, CFG_IPIP_KERNEL_RX, CFG_IPIP_USER_RX, CFG_ROUTED_RX, CFG_VXLAN_RX, Config,
};
use ipnet::Ipv4Net;

use super::BpfError;

/// The kernel's VXLAN port (`flannel.<VNI>` without a `Port` option).
pub const DEFAULT_VXLAN_PORT: u16 = 8472;

/// The local VXLAN device's identity, for nodes of the vxlan backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VxlanLocal {
    /// The VNI of `flannel.<VNI>` (24 bits).
    pub vni: u32,
    /// Its UDP port (8472 by default).
    pub port: u16,
    /// Its MAC (the lease's `VtepMAC`).
    pub vtep_mac: [u8; 6],
}

/// The local node's fast-path settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalConfig {
    /// Our public IP (outer source of tunnels, outer destination we decapsulate).
    pub public_ip: Ipv4Addr,
    /// The external interface's index.
    pub ext_ifindex: u32,
    /// Our lease's subnet.
    pub subnet: Ipv4Net,
    /// The cluster network (`Network`).
    pub network: Ipv4Net,
    /// The VXLAN device, when the backend is vxlan.
    pub vxlan: Option<VxlanLocal>,
    /// VXLAN source ports are picked in `[min, max)` from the flow hash; the kernel uses
    /// `net.ipv4.ip_local_port_range` ([`kernel_source_ports`]).
    pub source_ports: (u16, u16),
    /// TTL of outer VXLAN headers; the kernel uses `net.ipv4.ip_default_ttl` (64).
    pub outer_ttl: u8,
    /// Receive VXLAN for pod-to-pod flows in eBPF (decapsulate and deliver to the bridge).
    /// Needed with VXLAN transmit in eBPF for conntrack consistency; off only for measurements.
    pub vxlan_rx: bool,
    /// Deliver plain (host-gw) and IPIP pod-to-pod packets to the bridge in eBPF. Same remark.
    pub routed_rx: bool,
    /// A kernel IPIP device (`flannel.ipip`) exists on this node (kernels with the `ipip`
    /// module): GSO IPIP packets are left to it instead of being decapsulated in eBPF, which
    /// cannot reset their offload state (they would be segmented in software on the way to
    /// the pod).
    pub ipip_kernel_device: bool,
    /// The agent takes reassembled IPIP packets from a raw socket ([`crate::ipip_rx`]):
    /// `tc_from_netdev` leaves IPIP packets carrying an inner fragment to it, whole.
    pub ipip_user_rx: bool,
}

impl LocalConfig {
    /// A configuration with the kernel's defaults for the rest: source ports and TTL read from
    /// the calling thread's network namespace (falling back to 32768..60999 and 64), both
    /// receive paths on, no VXLAN.
    pub fn new(public_ip: Ipv4Addr, ext_ifindex: u32, subnet: Ipv4Net, network: Ipv4Net) -> Self {
        LocalConfig {
            public_ip,
            ext_ifindex,
            subnet,
            network,
            vxlan: None,
            source_ports: kernel_source_ports().unwrap_or((32768, 60999)),
            outer_ttl: kernel_default_ttl().unwrap_or(64),
            vxlan_rx: true,
            routed_rx: true,
            ipip_kernel_device: false,
            ipip_user_rx: false,
        }
    }

    /// The map entry, after checking every value fits.
    pub fn to_entry(&self) -> Result<Config, BpfError> {
        check_interface(self.ext_ifindex)?;
        if !self.network.contains(&self.subnet) {
            return Err(BpfError::Invalid {
                field: "subnet",
                value: self.subnet.to_string(),
                reason: "it is not inside the cluster network",
            });
        }
        check_encap_values(self.source_ports, "outer_ttl", self.outer_ttl)?;
        let mut flags = CFG_ENABLED;
        if self.vxlan_rx && self.vxlan.is_some() {
            flags |= CFG_VXLAN_RX;
        }
        if self.routed_rx {
            flags |= CFG_ROUTED_RX;
        }
        if self.ipip_kernel_device {
            flags |= CFG_IPIP_KERNEL_RX;
        }
        if self.ipip_user_rx {
            flags |= CFG_IPIP_USER_RX;
        }
        let mut entry = Config {
            flags,
            ext_ifindex: self.ext_ifindex,
            public_ip: self.public_ip.octets(),
            local_subnet: self.subnet.trunc().network().octets(),
            local_prefix_len: u32::from(self.subnet.prefix_len()),
            cluster_net: self.network.trunc().network().octets(),
            cluster_prefix_len: u32::from(self.network.prefix_len()),
            src_port_min: self.source_ports.0,
            src_port_max: self.source_ports.1,
            outer_ttl: self.outer_ttl,
            ..Config::default()
        };
        if let Some(vxlan) = self.vxlan {
            check_vni(vxlan.vni)?;
            if vxlan.port == 0 {
                return Err(BpfError::Invalid {
                    field: "vxlan port",
                    value: "0".into(),
                    reason: "use 8472 (the kernel default) when none is configured",
                });
            }
            entry.vni = vxlan.vni;
            entry.vxlan_port = vxlan.port;
            entry.vtep_mac = vxlan.vtep_mac;
        }
        Ok(entry)
    }
}

/// Fails for interface index 0 (no interface has it).
pub(crate) fn check_interface(ext_ifindex: u32) -> Result<(), BpfError> {
    if ext_ifindex == 0 {
        return Err(BpfError::Invalid {
            field: "ext_ifindex",
            value: "0".into(),
            reason: "an interface index is never 0",
        });
    }
    Ok(())
}

/// Fails unless the source-port range is `0 < min <= max` and the outer TTL (hop limit,
/// named `ttl_field`) is at least 1: the values every encapsulation of either family uses.
pub(crate) fn check_encap_values(
    source_ports: (u16, u16),
    ttl_field: &'static str,
    ttl: u8,
) -> Result<(), BpfError> {
    if source_ports.0 == 0 || source_ports.1 < source_ports.0 {
        return Err(BpfError::Invalid {
            field: "source_ports",
            value: format!("{}..{}", source_ports.0, source_ports.1),
            reason: "need 0 < min <= max",
        });
    }
    if ttl == 0 {
        return Err(BpfError::Invalid {
            field: ttl_field,
            value: "0".into(),
            reason: "must be at least 1",
        });
    }
    Ok(())
}

/// Fails unless `vni` fits VXLAN's 24 bits.
pub(crate) fn check_vni(vni: u32) -> Result<(), BpfError> {
    if vni > 0x00ff_ffff {
        return Err(BpfError::Invalid {
            field: "vni",
            value: vni.to_string(),
            reason: "VXLAN network identifiers have 24 bits",
        });
    }
    Ok(())
}

/// `net.ipv4.ip_local_port_range` of the calling thread's network namespace: the range the
/// kernel's VXLAN source ports come from (as `[low, high)`, like `udp_flow_src_port`).
pub fn kernel_source_ports() -> Option<(u16, u16)> {
    let text = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut parts = text.split_whitespace().map(str::parse::<u16>);
    match (parts.next(), parts.next()) {
        (Some(Ok(low)), Some(Ok(high))) if low > 0 && low <= high => Some((low, high)),
        _ => None,
    }
}

/// `net.ipv4.ip_default_ttl` of the calling thread's network namespace.
pub fn kernel_default_ttl() -> Option<u8> {
    fs::read_to_string("/proc/sys/net/ipv4/ip_default_ttl")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn base() -> LocalConfig {
        LocalConfig {
            source_ports: (32768, 60999),
            outer_ttl: 64,
            ..LocalConfig::new(
                Ipv4Addr::new(192, 168, 1, 10),
                3,
                net("10.244.1.0/24"),
                net("10.244.0.0/16"),
            )
        }
    }

    #[test]
    fn converts_every_field() {
        let cfg = LocalConfig {
            vxlan: Some(VxlanLocal {
                vni: 7,
                port: 4789,
                vtep_mac: [0x0e, 1, 2, 3, 4, 5],
            }),
            ..base()
        };
        let e = cfg.to_entry().expect("valid");
        assert_eq!(e.flags, CFG_ENABLED | CFG_VXLAN_RX | CFG_ROUTED_RX);
        assert_eq!(e.ext_ifindex, 3);
        assert_eq!(e.public_ip, [192, 168, 1, 10]);
        assert_eq!((e.local_subnet, e.local_prefix_len), ([10, 244, 1, 0], 24));
        assert_eq!((e.cluster_net, e.cluster_prefix_len), ([10, 244, 0, 0], 16));
        assert_eq!(
            (e.vni, e.vxlan_port, e.vtep_mac),
            (7, 4789, [0x0e, 1, 2, 3, 4, 5])
        );
        assert_eq!(
            (e.src_port_min, e.src_port_max, e.outer_ttl),
            (32768, 60999, 64)
        );
        // Without VXLAN there is no VXLAN receive.
        let plain = LocalConfig {
            routed_rx: false,
            ..base()
        };
        assert_eq!(plain.to_entry().expect("valid").flags, CFG_ENABLED);
    }

    #[test]
    fn rejects_what_the_programs_cannot_use() {
        let bad = [
            LocalConfig {
                ext_ifindex: 0,
                ..base()
            },
            LocalConfig {
                subnet: net("10.9.1.0/24"),
                ..base()
            },
            LocalConfig {
                source_ports: (5000, 10),
                ..base()
            },
            LocalConfig {
                vxlan: Some(VxlanLocal {
                    vni: 1 << 24,
                    port: 8472,
                    vtep_mac: [2; 6],
                }),
                ..base()
            },
        ];
        for cfg in bad {
            let err = cfg.to_entry().expect_err("invalid");
            assert!(matches!(err, BpfError::Invalid { .. }), "{err}");
        }
    }
}
