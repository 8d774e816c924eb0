//! Backends as configuration: which backend a network uses ([`BackendType`]), its options
//! parsed from the raw `Backend` JSON ([`BackendOptions`], [`options`]), the BackendData nodes
//! publish ([`data`]) and the MTU arithmetic ([`mtu`]). The data paths live elsewhere.

pub mod data;
pub mod mtu;
pub mod options;

use std::fmt;

pub use data::{DataError, MacAddr, VxlanLeaseData, WgKey, WireguardLeaseData};
pub use mtu::{MtuError, MtuPlan};
pub use options::{
    BackendOptions, ExtensionOptions, IpipOptions, IpsecOptions, OptionsError, Secret, UdpOptions,
    VxlanOptions, WireguardMode, WireguardOptions,
};

/// The backends this implementation runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendType {
    /// VXLAN overlay (`flannel.<VNI>`).
    Vxlan,
    /// Plain routes via the peers' public IPs.
    HostGw,
    /// The legacy UDP encapsulation (`flannel0`).
    Udp,
    /// IP-in-IP tunnel (`flannel.ipip`), IPv4 only.
    Ipip,
    /// IPsec via strongSwan.
    Ipsec,
    /// WireGuard (`flannel-wg`, `flannel-wg-v6`).
    Wireguard,
    /// Subnet allocation only, no data path.
    Alloc,
    /// Operator commands run per remote lease (upstream's prototype backend).
    Extension,
}

/// Errors selecting a backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// Not a backend name upstream knows (after lower-casing).
    #[error("unknown backend type: {0}")]
    Unknown(String),
    /// A backend upstream has that this implementation deliberately does not provide.
    #[error("backend type {0} is not supported by this implementation")]
    Unsupported(String),
}

impl BackendType {
    /// All supported backends.
    pub const ALL: [BackendType; 8] = [
        BackendType::Vxlan,
        BackendType::HostGw,
        BackendType::Udp,
        BackendType::Ipip,
        BackendType::Ipsec,
        BackendType::Wireguard,
        BackendType::Alloc,
        BackendType::Extension,
    ];

    /// Looks up `Backend.Type`, lower-cased first like upstream (`"VXLAN"` works).
    /// `tencent-vpc` (a cloud provider's route table) is the one upstream backend this
    /// implementation does not provide.
    pub fn parse(name: &str) -> Result<Self, BackendError> {
        let lower = name.to_lowercase();
        match lower.as_str() {
            "vxlan" => Ok(BackendType::Vxlan),
            "host-gw" => Ok(BackendType::HostGw),
            "udp" => Ok(BackendType::Udp),
            "ipip" => Ok(BackendType::Ipip),
            "ipsec" => Ok(BackendType::Ipsec),
            "wireguard" => Ok(BackendType::Wireguard),
            "alloc" => Ok(BackendType::Alloc),
            "extension" => Ok(BackendType::Extension),
            "tencent-vpc" => Err(BackendError::Unsupported(lower)),
            _ => Err(BackendError::Unknown(lower)),
        }
    }

    /// The canonical name (`vxlan`, `host-gw`, …).
    pub fn name(self) -> &'static str {
        match self {
            BackendType::Vxlan => "vxlan",
            BackendType::HostGw => "host-gw",
            BackendType::Udp => "udp",
            BackendType::Ipip => "ipip",
            BackendType::Ipsec => "ipsec",
            BackendType::Wireguard => "wireguard",
            BackendType::Alloc => "alloc",
            BackendType::Extension => "extension",
        }
    }

    /// The `BackendType` this backend writes into its lease: empty for udp and alloc, as
    /// upstream does (so udp/alloc leases are recognised by mixed clusters).
    pub fn lease_type(self) -> &'static str {
        match self {
            BackendType::Udp | BackendType::Alloc => "",
            other => other.name(),
        }
    }

    /// Whether the backend can carry IPv6 (upstream forces the lease to IPv4 only for the
    /// others in kube mode).
    pub fn supports_ipv6(self) -> bool {
        matches!(
            self,
            BackendType::Vxlan | BackendType::HostGw | BackendType::Wireguard
        )
    }
}

impl fmt::Display for BackendType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BackendType {
    type Err = BackendError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BackendType::parse(s)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn names_are_lower_cased_and_checked() {
        assert_eq!(BackendType::parse("VXLAN"), Ok(BackendType::Vxlan));
        assert_eq!(BackendType::parse("Host-GW"), Ok(BackendType::HostGw));
        for t in BackendType::ALL {
            assert_eq!(BackendType::parse(t.name()), Ok(t));
            assert_eq!(t.to_string().parse::<BackendType>(), Ok(t));
        }
        assert_eq!(
            BackendType::parse("").unwrap_err().to_string(),
            "unknown backend type: "
        );
        assert_eq!(
            BackendType::parse("GRE").unwrap_err().to_string(),
            "unknown backend type: gre"
        );
        assert_eq!(BackendType::parse("Extension"), Ok(BackendType::Extension));
        assert_eq!(
            BackendType::parse("tencent-vpc").unwrap_err().to_string(),
            "backend type tencent-vpc is not supported by this implementation"
        );
        assert_eq!(
            BackendType::parse("tencent-vpc"),
            Err(BackendError::Unsupported("tencent-vpc".into()))
        );
    }

    #[test]
    fn lease_types_match_upstream() {
        assert_eq!(BackendType::Vxlan.lease_type(), "vxlan");
        assert_eq!(BackendType::HostGw.lease_type(), "host-gw");
        assert_eq!(BackendType::Wireguard.lease_type(), "wireguard");
        assert_eq!(BackendType::Ipip.lease_type(), "ipip");
        assert_eq!(BackendType::Ipsec.lease_type(), "ipsec");
        assert_eq!(BackendType::Udp.lease_type(), "");
        assert_eq!(BackendType::Alloc.lease_type(), "");
        assert_eq!(BackendType::Extension.lease_type(), "extension");
        assert!(BackendType::Wireguard.supports_ipv6());
        assert!(!BackendType::Ipip.supports_ipv6());
    }
}
