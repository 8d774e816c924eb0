//! The charon configuration the backend loads, as VICI messages (upstream 2.6): one IKEv2
//! connection per remote lease, named `<localPubIP>-<localSubnet>-<remoteSubnet>-<remotePubIP>`
//! with one child `<localSubnet>-<remoteSubnet>`, and pre-shared IKE keys owned by the public
//! IPs.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use super::{vici::Message, xfrm::REQID};
use crate::backend::IpsecOptions;

/// The IKE proposal upstream uses.
pub const IKE_PROPOSAL: &str = "aes256-sha256-modp4096";
/// Child SA rekeying, as upstream (1 h).
pub const REKEY_TIME: &str = "3600s";

/// One connection: this node and one remote lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnSpec {
    /// This node's public IP.
    pub local_ip: Ipv4Addr,
    /// This node's subnet.
    pub local_subnet: Ipv4Net,
    /// The remote subnet.
    pub remote_subnet: Ipv4Net,
    /// The remote public IP.
    pub remote_ip: Ipv4Addr,
}

/// The prefix of the names of this node's connections (`<localPubIP>-<localSubnet>-`), which
/// tells them from connections other nodes or other software loaded.
pub fn name_prefix(local_ip: Ipv4Addr, local_subnet: Ipv4Net) -> String {
    format!("{local_ip}-{local_subnet}-")
}

/// The id under which the pre-shared key owned by `ip` is loaded.
pub fn shared_key_id(ip: Ipv4Addr) -> String {
    format!("flannel-psk-{ip}")
}

impl ConnSpec {
    /// `<localPubIP>-<localSubnet>-<remoteSubnet>-<remotePubIP>`.
    pub fn name(&self) -> String {
        format!(
            "{}{}-{}",
            name_prefix(self.local_ip, self.local_subnet),
            self.remote_subnet,
            self.remote_ip
        )
    }

    /// `<localSubnet>-<remoteSubnet>`.
    pub fn child_name(&self) -> String {
        format!("{}-{}", self.local_subnet, self.remote_subnet)
    }

    /// The `load-conn` message.
    pub fn message(&self, options: &IpsecOptions) -> Message {
        let child = Message::new()
            .list("local_ts", [self.local_subnet.to_string()])
            .list("remote_ts", [self.remote_subnet.to_string()])
            .list("esp_proposals", [options.esp_proposal.as_str()])
            .kv("mode", "tunnel")
            .kv("start_action", "start")
            .kv("close_action", "trap")
            .kv("dpd_action", "restart")
            .kv("rekey_time", REKEY_TIME)
            .kv("reqid", REQID.to_string())
            .kv("policies", "no");
        let conn = Message::new()
            .kv("version", "2")
            .list("local_addrs", [self.local_ip.to_string()])
            .list("remote_addrs", [self.remote_ip.to_string()])
            .list("proposals", [IKE_PROPOSAL])
            .kv("keyingtries", "0")
            .kv("encap", if options.udp_encap { "yes" } else { "no" })
            .section(
                "local",
                Message::new()
                    .kv("auth", "psk")
                    .kv("id", self.local_ip.to_string()),
            )
            .section(
                "remote",
                Message::new()
                    .kv("auth", "psk")
                    .kv("id", self.remote_ip.to_string()),
            )
            .section(
                "children",
                Message::new().section(&self.child_name(), child),
            );
        Message::new().section(&self.name(), conn)
    }
}

/// The `load-shared` message: the PSK as an IKE secret owned by `owner`.
pub fn shared_key(psk: &str, owner: Ipv4Addr) -> Message {
    Message::new()
        .kv("id", shared_key_id(owner))
        .kv("type", "IKE")
        .kv("data", psk)
        .list("owners", [owner.to_string()])
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;
    use crate::backend::Secret;

    #[test]
    fn names_and_message_like_upstream() {
        let spec = ConnSpec {
            local_ip: Ipv4Addr::new(192, 168, 10, 1),
            local_subnet: "10.244.1.0/24".parse().unwrap(),
            remote_subnet: "10.244.2.0/24".parse().unwrap(),
            remote_ip: Ipv4Addr::new(192, 168, 10, 2),
        };
        assert_eq!(
            spec.name(),
            "192.168.10.1-10.244.1.0/24-10.244.2.0/24-192.168.10.2"
        );
        assert!(
            spec.name()
                .starts_with(&name_prefix(spec.local_ip, spec.local_subnet))
        );
        assert_eq!(spec.child_name(), "10.244.1.0/24-10.244.2.0/24");
        let options = IpsecOptions {
            psk: Secret::new("p".repeat(96)),
            udp_encap: true,
            esp_proposal: "aes128gcm16-sha256-prfsha256-ecp256".into(),
        };
        let m = spec.message(&options);
        let conn = m.get_section(&spec.name()).unwrap();
        assert_eq!(conn.get_str("version").as_deref(), Some("2"));
        assert_eq!(conn.get_list("proposals").unwrap(), [IKE_PROPOSAL]);
        assert_eq!(conn.get_str("keyingtries").as_deref(), Some("0"));
        assert_eq!(conn.get_str("encap").as_deref(), Some("yes"));
        assert_eq!(
            conn.get_section("local")
                .unwrap()
                .get_str("auth")
                .as_deref(),
            Some("psk")
        );
        let child = conn
            .get_section("children")
            .unwrap()
            .get_section(&spec.child_name())
            .unwrap();
        assert_eq!(child.get_list("local_ts").unwrap(), ["10.244.1.0/24"]);
        assert_eq!(child.get_list("remote_ts").unwrap(), ["10.244.2.0/24"]);
        assert_eq!(
            child.get_list("esp_proposals").unwrap(),
            ["aes128gcm16-sha256-prfsha256-ecp256"]
        );
        for (k, v) in [
            ("mode", "tunnel"),
            ("start_action", "start"),
            ("close_action", "trap"),
            ("dpd_action", "restart"),
            ("rekey_time", "3600s"),
            ("reqid", "11"),
            ("policies", "no"),
        ] {
            assert_eq!(child.get_str(k).as_deref(), Some(v), "{k}");
        }
        let s = shared_key("secret", spec.remote_ip);
        assert_eq!(s.get_str("type").as_deref(), Some("IKE"));
        assert_eq!(s.get_list("owners").unwrap(), ["192.168.10.2"]);
        assert_eq!(s.get_str("id").as_deref(), Some("flannel-psk-192.168.10.2"));
    }
}
