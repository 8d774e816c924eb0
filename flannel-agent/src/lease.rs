//! The lease model shared by both subnet managers: [`LeaseAttrs`] (the etcd value / node
//! annotations), [`SubnetKey`] (the etcd key name), [`Lease`], [`LeaseEvent`] and the
//! backend-side cache of remote leases ([`LeaseWatcher`]).
//!
//! The JSON of [`LeaseAttrs`] is byte-compatible with upstream's etcd values: field order
//! `PublicIP`, `PublicIPv6`, `BackendType`, `BackendData`, `BackendV6Data`; `PublicIPv6` always
//! present (`null` when unset); the other three omitted when empty; BackendData kept verbatim
//! and re-emitted compacted as Go does. Decoding is as tolerant as Go's (case-insensitive keys,
//! unknown keys ignored).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::sync::LazyLock;
use std::time::SystemTime;

use ipnet::{Ipv4Net, Ipv6Net};
use regex::Regex;
use serde_json::value::RawValue;

use crate::gojson::{self, GoJsonError, GoObject, RawJson};
use crate::ip;

/// Errors decoding a lease key or value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The key does not end in a valid subnet key (`10.5.52.0-24[&fd00::-64]`).
    #[error("invalid subnet key: {0:?}")]
    InvalidKey(String),
    /// The value is not UTF-8 text.
    #[error("lease value is not UTF-8")]
    NotUtf8,
    /// The value is not a valid lease attributes object.
    #[error("invalid lease attributes: {0}")]
    Json(#[from] GoJsonError),
    /// `PublicIP` / `PublicIPv6` could not be parsed.
    #[error("invalid lease attributes: invalid {field} {value}: {reason}")]
    Address {
        /// `PublicIP` or `PublicIPv6`.
        field: &'static str,
        /// The JSON text of the value.
        value: String,
        /// Upstream's parse error text.
        reason: &'static str,
    },
}

/// The attributes a node publishes with its lease (upstream `lease.LeaseAttrs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseAttrs {
    /// The node's IPv4 public address; `0.0.0.0` for an IPv6-only node.
    pub public_ip: Ipv4Addr,
    /// The node's IPv6 public address.
    pub public_ipv6: Option<Ipv6Addr>,
    /// The backend type as published (`vxlan`, `host-gw`, …; empty for udp and alloc).
    pub backend_type: String,
    /// Backend data for IPv4 (e.g. `{"VNI":1,"VtepMAC":"…"}`); `None` is omitted from the JSON.
    pub backend_data: Option<RawJson>,
    /// Backend data for IPv6.
    pub backend_v6_data: Option<RawJson>,
}

impl Default for LeaseAttrs {
    fn default() -> Self {
        LeaseAttrs {
            public_ip: Ipv4Addr::UNSPECIFIED,
            public_ipv6: None,
            backend_type: String::new(),
            backend_data: None,
            backend_v6_data: None,
        }
    }
}

impl LeaseAttrs {
    /// The etcd value, byte-identical to what upstream writes, e.g.
    /// `{"PublicIP":"1.2.3.4","PublicIPv6":null}`.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(128);
        out.push_str("{\"PublicIP\":");
        gojson::write_string(&mut out, &self.public_ip.to_string());
        out.push_str(",\"PublicIPv6\":");
        match self.public_ipv6 {
            Some(a) => gojson::write_string(&mut out, &a.to_string()),
            None => out.push_str("null"),
        }
        if !self.backend_type.is_empty() {
            out.push_str(",\"BackendType\":");
            gojson::write_string(&mut out, &self.backend_type);
        }
        if let Some(d) = &self.backend_data {
            out.push_str(",\"BackendData\":");
            out.push_str(d.as_str());
        }
        if let Some(d) = &self.backend_v6_data {
            out.push_str(",\"BackendV6Data\":");
            out.push_str(d.as_str());
        }
        out.push('}');
        out
    }

    /// Decodes an etcd value with Go's rules. A top-level `null` gives the defaults.
    pub fn from_json(json: &str) -> Result<Self, LeaseError> {
        let mut attrs = LeaseAttrs::default();
        let Some(obj) = GoObject::parse(json)? else {
            return Ok(attrs);
        };
        for raw in obj.values("PublicIP") {
            attrs.public_ip = parse_public_ip(raw)?;
        }
        for raw in obj.values("PublicIPv6") {
            attrs.public_ipv6 = parse_public_ipv6(raw)?;
        }
        if let Some(t) = obj.last("BackendType", gojson::string)? {
            attrs.backend_type = t;
        }
        if let Some(d) = obj.values("BackendData").last() {
            attrs.backend_data = Some(RawJson::from_raw(d));
        }
        if let Some(d) = obj.values("BackendV6Data").last() {
            attrs.backend_v6_data = Some(RawJson::from_raw(d));
        }
        Ok(attrs)
    }
}

/// Upstream `IP4.UnmarshalJSON`: a string holding an IPv4 address (an IPv4-mapped IPv6
/// address is accepted, like Go's `To4`); `null` and other types are errors.
fn parse_public_ip(raw: &RawValue) -> Result<Ipv4Addr, LeaseError> {
    let err = |reason| LeaseError::Address {
        field: "PublicIP",
        value: raw.get().to_owned(),
        reason,
    };
    let text = match gojson::string("PublicIP", raw) {
        Ok(Some(s)) => s,
        _ => return Err(err("invalid IP address format")),
    };
    match text.parse::<IpAddr>() {
        Ok(IpAddr::V4(a)) => Ok(a),
        Ok(IpAddr::V6(a)) => a
            .to_ipv4_mapped()
            .ok_or_else(|| err("invalid IPv4 address format")),
        Err(_) => Err(err("invalid IP address format")),
    }
}

/// Upstream `*IP6`: `null` → none; an IPv4 string becomes its IPv4-mapped form (Go `To16`).
fn parse_public_ipv6(raw: &RawValue) -> Result<Option<Ipv6Addr>, LeaseError> {
    let err = || LeaseError::Address {
        field: "PublicIPv6",
        value: raw.get().to_owned(),
        reason: "invalid IP address format",
    };
    match gojson::string("PublicIPv6", raw).map_err(|_| err())? {
        None => Ok(None),
        Some(text) => match text.parse::<IpAddr>() {
            Ok(IpAddr::V6(a)) => Ok(Some(a)),
            Ok(IpAddr::V4(a)) => Ok(Some(a.to_ipv6_mapped())),
            Err(_) => Err(err()),
        },
    }
}

/// The subnet part of an etcd key: `10.5.52.0-24` or `10.12.13.0-24&fd00:12:13::-56`.
///
/// Parsing follows upstream's regular expression, anchored at the end only, so a full etcd key
/// (`/coreos.com/network/subnets/10.5.52.0-24`) parses too. The IPv4 prefix length is limited
/// to 5 bits (`-32` is rejected) and the IPv6 one to 7 bits, as upstream does. Unlike
/// upstream, a subnet with host bits set (`10.5.52.1-24`) is rejected: such a key can only be
/// garbage, and accepting it would program invalid routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubnetKey {
    /// The IPv4 subnet (always present in etcd keys).
    pub ipv4: Ipv4Net,
    /// The IPv6 subnet of a dual-stack lease.
    pub ipv6: Option<Ipv6Net>,
}

static SUBNET_KEY_RE: LazyLock<Option<Regex>> = LazyLock::new(|| {
    // Upstream's pattern with ASCII digit classes (Go's `\d` is ASCII-only). The unescaped
    // dots are upstream's; the address parse below rejects whatever they let through.
    Regex::new(r"([0-9]+\.[0-9]+.[0-9]+.[0-9]+)-([0-9]+)(?:&([a-f0-9:]+)-([0-9]+))?$").ok()
});

impl SubnetKey {
    /// Parses a key (or a full etcd key ending in one); `None` if it does not parse.
    pub fn parse(s: &str) -> Option<Self> {
        let caps = SUBNET_KEY_RE.as_ref()?.captures(s)?;
        let v4_addr: Ipv4Addr = caps.get(1)?.as_str().parse().ok()?;
        let v4_len = parse_prefix(caps.get(2)?.as_str(), 5)?;
        let ipv4 = Ipv4Net::new(v4_addr, v4_len)
            .ok()
            .filter(|n| ip::is_canonical(*n))?;
        let ipv6 = match (caps.get(3), caps.get(4)) {
            (Some(a), Some(l)) => {
                let v6_addr: Ipv6Addr = a.as_str().parse().ok()?;
                let v6_len = parse_prefix(l.as_str(), 7)?;
                Some(
                    Ipv6Net::new(v6_addr, v6_len)
                        .ok()
                        .filter(|n| ip::is_canonical(*n))?,
                )
            }
            _ => None,
        };
        Some(SubnetKey { ipv4, ipv6 })
    }
}

/// `strconv.ParseUint(s, 10, bits)`.
fn parse_prefix(s: &str, bits: u32) -> Option<u8> {
    let v: u64 = s.parse().ok()?;
    if v >> bits != 0 {
        return None;
    }
    u8::try_from(v).ok()
}

impl fmt::Display for SubnetKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ipv4.addr(), self.ipv4.prefix_len())?;
        if let Some(v6) = self.ipv6 {
            write!(f, "&{}-{}", v6.addr(), v6.prefix_len())?;
        }
        Ok(())
    }
}

impl FromStr for SubnetKey {
    type Err = LeaseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SubnetKey::parse(s).ok_or_else(|| LeaseError::InvalidKey(s.to_owned()))
    }
}

/// A node's lease: its subnet(s), attributes and expiry (upstream `lease.Lease`).
///
/// A family is enabled for the lease exactly when its subnet is present (upstream's
/// `EnableIPv4`/`EnableIPv6` flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The IPv4 subnet.
    pub subnet: Option<Ipv4Net>,
    /// The IPv6 subnet.
    pub ipv6_subnet: Option<Ipv6Net>,
    /// Published attributes.
    pub attrs: LeaseAttrs,
    /// When it expires; `None` when it never does (a TTL-less etcd key, or unknown).
    pub expiration: Option<SystemTime>,
}

impl Lease {
    /// A lease for the subnets of `key`.
    pub fn new(key: SubnetKey, attrs: LeaseAttrs, expiration: Option<SystemTime>) -> Self {
        Lease {
            subnet: Some(key.ipv4),
            ipv6_subnet: key.ipv6,
            attrs,
            expiration,
        }
    }

    /// Builds a lease from an etcd key (full or bare) and value.
    pub fn from_etcd(
        key: &str,
        value: &[u8],
        expiration: Option<SystemTime>,
    ) -> Result<Self, LeaseError> {
        let sk: SubnetKey = key.parse()?;
        let text = std::str::from_utf8(value).map_err(|_| LeaseError::NotUtf8)?;
        Ok(Lease::new(sk, LeaseAttrs::from_json(text)?, expiration))
    }

    /// The etcd key of this lease; `None` without an IPv4 subnet (etcd keys always have one).
    pub fn key(&self) -> Option<SubnetKey> {
        self.subnet.map(|ipv4| SubnetKey {
            ipv4,
            ipv6: self.ipv6_subnet,
        })
    }

    /// Upstream's "same subnet" identity, judged by the families of `self`: IPv4 only → equal
    /// IPv4 subnets; IPv6 only → equal IPv6 subnets; dual → both equal. A lease with neither
    /// subnet matches nothing.
    pub fn same_subnet(&self, other: &Lease) -> bool {
        match (self.subnet, self.ipv6_subnet) {
            (Some(v4), None) => other.subnet == Some(v4),
            (None, Some(v6)) => other.ipv6_subnet == Some(v6),
            (Some(v4), Some(v6)) => other.subnet == Some(v4) && other.ipv6_subnet == Some(v6),
            (None, None) => false,
        }
    }
}

/// A change to the set of remote leases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseEvent {
    /// A lease appeared or its attributes changed.
    Added(Lease),
    /// A lease disappeared. From [`LeaseWatcher`] it carries the last known attributes.
    Removed(Lease),
}

impl LeaseEvent {
    /// The lease the event is about.
    pub fn lease(&self) -> &Lease {
        match self {
            LeaseEvent::Added(l) | LeaseEvent::Removed(l) => l,
        }
    }
}

/// The backend-side cache of remote leases (upstream `LeaseWatcher`, §5.6): filters out the
/// node's own lease and turns snapshots and raw events into added/removed batches.
///
/// Unlike upstream, the cache never holds the own lease: upstream copies it in on a snapshot
/// and then reports it as removed on the next snapshot.
#[derive(Debug, Clone)]
pub struct LeaseWatcher {
    own: Lease,
    leases: Vec<Lease>,
}

impl LeaseWatcher {
    /// A watcher for a node whose own lease is `own`.
    pub fn new(own: Lease) -> Self {
        LeaseWatcher {
            own,
            leases: Vec::new(),
        }
    }

    /// The cached remote leases.
    pub fn leases(&self) -> &[Lease] {
        &self.leases
    }

    fn is_own(&self, lease: &Lease) -> bool {
        lease.same_subnet(&self.own)
    }

    /// Replaces the cache with a full snapshot: `Added` for new leases, `Removed` (with cached
    /// attributes) for vanished ones, nothing for leases present in both.
    pub fn reset(&mut self, snapshot: Vec<Lease>) -> Vec<LeaseEvent> {
        let mut old = std::mem::take(&mut self.leases);
        let mut batch = Vec::new();
        for lease in snapshot {
            if self.is_own(&lease) {
                continue;
            }
            match old.iter().position(|cached| cached.same_subnet(&lease)) {
                Some(i) => {
                    old.remove(i);
                }
                None => batch.push(LeaseEvent::Added(lease.clone())),
            }
            self.leases.push(lease);
        }
        batch.extend(old.into_iter().map(LeaseEvent::Removed));
        batch
    }

    /// Applies incremental events: `Added` replaces or appends the cached entry; `Removed`
    /// drops it and reports the cached lease (or the bare one when it was not cached).
    pub fn update(&mut self, events: Vec<LeaseEvent>) -> Vec<LeaseEvent> {
        let mut batch = Vec::new();
        for event in events {
            if self.is_own(event.lease()) {
                continue;
            }
            match event {
                LeaseEvent::Added(lease) => {
                    match self.leases.iter().position(|c| c.same_subnet(&lease)) {
                        Some(i) => self.leases[i] = lease.clone(),
                        None => self.leases.push(lease.clone()),
                    }
                    batch.push(LeaseEvent::Added(lease));
                }
                LeaseEvent::Removed(lease) => {
                    match self.leases.iter().position(|c| c.same_subnet(&lease)) {
                        Some(i) => batch.push(LeaseEvent::Removed(self.leases.remove(i))),
                        None => batch.push(LeaseEvent::Removed(lease)),
                    }
                }
            }
        }
        batch
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    const VXLAN_VALUE: &str = r#"{"PublicIP":"192.168.64.3","PublicIPv6":null,"BackendType":"vxlan","BackendData":{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"}}"#;

    #[test]
    fn upstream_values_round_trip_byte_for_byte() {
        for value in [
            VXLAN_VALUE,
            r#"{"PublicIP":"1.2.3.4","PublicIPv6":null}"#,
            r#"{"PublicIP":"0.0.0.0","PublicIPv6":"fd00::1","BackendType":"wireguard","BackendV6Data":{"PublicKey":"abc=","Port":51821}}"#,
            r#"{"PublicIP":"10.0.0.1","PublicIPv6":"2001:db8::1","BackendType":"vxlan","BackendData":{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff"},"BackendV6Data":{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:00"}}"#,
            r#"{"PublicIP":"1.2.3.4","PublicIPv6":null,"BackendType":"vxlan","BackendData":{"Dummy":"test string"}}"#,
            r#"{"PublicIP":"1.2.3.4","PublicIPv6":null,"BackendType":"extension","BackendData":"a \u003cb\u003e \u0026"}"#,
            r#"{"PublicIP":"1.2.3.4","PublicIPv6":null,"BackendData":null}"#,
        ] {
            let attrs = LeaseAttrs::from_json(value).unwrap();
            assert_eq!(attrs.to_json(), value);
        }
    }

    #[test]
    fn decoded_fields() {
        let a = LeaseAttrs::from_json(VXLAN_VALUE).unwrap();
        assert_eq!(a.public_ip, Ipv4Addr::new(192, 168, 64, 3));
        assert_eq!(a.public_ipv6, None);
        assert_eq!(a.backend_type, "vxlan");
        assert_eq!(
            a.backend_data.unwrap().as_str(),
            r#"{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"}"#
        );
        assert_eq!(a.backend_v6_data, None);
    }

    #[test]
    fn minimal_value_matches_upstream_registry_test() {
        let attrs = LeaseAttrs {
            public_ip: Ipv4Addr::new(1, 2, 3, 4),
            ..Default::default()
        };
        assert_eq!(
            attrs.to_json(),
            r#"{"PublicIP":"1.2.3.4","PublicIPv6":null}"#
        );
        assert_eq!(
            LeaseAttrs::default().to_json(),
            r#"{"PublicIP":"0.0.0.0","PublicIPv6":null}"#
        );
    }

    #[test]
    fn decoding_is_tolerant_like_go() {
        let a = LeaseAttrs::from_json(
            r#"{ "publicip" : "1.2.3.4", "backendtype":"host-gw", "extra": {"x":[1]},
                 "backenddata" : { "a" : "<x>" }, "PUBLICIPV6": "::ffff:1.2.3.4" }"#,
        )
        .unwrap();
        assert_eq!(a.public_ip, Ipv4Addr::new(1, 2, 3, 4));
        assert_eq!(a.backend_type, "host-gw");
        assert_eq!(
            a.backend_data.as_ref().unwrap().as_str(),
            r#"{"a":"\u003cx\u003e"}"#
        );
        assert_eq!(a.public_ipv6, Some("::ffff:1.2.3.4".parse().unwrap()));
        // Missing PublicIP is 0.0.0.0; PublicIP as a mapped IPv6 is accepted.
        assert_eq!(
            LeaseAttrs::from_json("{}").unwrap().public_ip,
            Ipv4Addr::UNSPECIFIED
        );
        assert_eq!(
            LeaseAttrs::from_json("null").unwrap(),
            LeaseAttrs::default()
        );
        let a = LeaseAttrs::from_json(r#"{"PublicIP":"::ffff:10.0.0.1"}"#).unwrap();
        assert_eq!(a.public_ip, Ipv4Addr::new(10, 0, 0, 1));
    }

    #[test]
    fn bad_values_give_clear_errors() {
        let cases = [
            (
                r#"{"PublicIP":null}"#,
                "invalid lease attributes: invalid PublicIP null: invalid IP address format",
            ),
            (
                r#"{"PublicIP":"fd00::1"}"#,
                "invalid lease attributes: invalid PublicIP \"fd00::1\": invalid IPv4 address format",
            ),
            (
                r#"{"PublicIP":5}"#,
                "invalid lease attributes: invalid PublicIP 5: invalid IP address format",
            ),
            (
                r#"{"PublicIPv6":"x"}"#,
                "invalid lease attributes: invalid PublicIPv6 \"x\": invalid IP address format",
            ),
            (
                r#"{"BackendType":1}"#,
                "invalid lease attributes: field \"BackendType\": cannot use 1 as string",
            ),
            (
                "[]",
                "invalid lease attributes: cannot unmarshal array into an object",
            ),
        ];
        for (json, want) in cases {
            assert_eq!(
                LeaseAttrs::from_json(json).unwrap_err().to_string(),
                want,
                "{json}"
            );
        }
        assert!(LeaseAttrs::from_json("{").is_err());
        assert!(LeaseAttrs::from_json("").is_err());
    }

    #[test]
    fn subnet_key_vectors() {
        for valid in [
            "10.12.13.0-24",
            "10.12.13.0-24&fd00:12:13::-56",
            "0.0.0.0-0",
            "10.5.52.0-24",
        ] {
            let k = SubnetKey::parse(valid).unwrap_or_else(|| panic!("{valid}"));
            assert_eq!(k.to_string(), valid);
        }
        let k = SubnetKey::parse("10.12.13.0-24&fd00:12:13::-56").unwrap();
        assert_eq!(k.ipv4, "10.12.13.0/24".parse::<Ipv4Net>().unwrap());
        assert_eq!(k.ipv6, Some("fd00:12:13::/56".parse().unwrap()));
        for invalid in [
            "10",
            "10.12.13.0",
            "10.12.13-24",
            "10.12.13.300-24",
            "10.12.13.0-24hi",
            "&2001::-56",
            "10.12.13.0-24&:12:13:-56",
            "10.12.13.0-24&20011::-56",
            "10.12.13.0-24&2001-56",
            "10.12.13.0-24&2001::",
            "10.12.13.0-24&2001::-56hi",
            "255.255.255.255-32",
            "10.12.13.0-24&fd00::-128",
            "10.12.13.1-24",
            "10.12.13.0-024000000000000000000000",
            "",
        ] {
            assert_eq!(SubnetKey::parse(invalid), None, "{invalid}");
            assert!(invalid.parse::<SubnetKey>().is_err());
        }
    }

    #[test]
    fn full_etcd_keys_parse_like_upstream() {
        let k = SubnetKey::parse("/coreos.com/network/subnets/10.5.52.0-24").unwrap();
        assert_eq!(k.to_string(), "10.5.52.0-24");
        let l = Lease::from_etcd(
            "/coreos.com/network/subnets/10.1.5.0-24",
            br#"{"PublicIP":"1.2.3.4","PublicIPv6":null}"#,
            None,
        )
        .unwrap();
        assert_eq!(l.subnet, Some("10.1.5.0/24".parse().unwrap()));
        assert_eq!(l.ipv6_subnet, None);
        assert_eq!(l.key().unwrap().to_string(), "10.1.5.0-24");
        assert_eq!(l.attrs.public_ip, Ipv4Addr::new(1, 2, 3, 4));
        assert!(matches!(
            Lease::from_etcd("x", b"{}", None),
            Err(LeaseError::InvalidKey(_))
        ));
        assert_eq!(
            Lease::from_etcd("10.1.5.0-24", b"\xff", None),
            Err(LeaseError::NotUtf8)
        );
    }

    fn lease(v4: Option<&str>, v6: Option<&str>, ip: [u8; 4]) -> Lease {
        Lease {
            subnet: v4.map(|s| s.parse().unwrap()),
            ipv6_subnet: v6.map(|s| s.parse().unwrap()),
            attrs: LeaseAttrs {
                public_ip: Ipv4Addr::from(ip),
                ..Default::default()
            },
            expiration: None,
        }
    }

    #[test]
    fn same_subnet_rules() {
        let a = lease(Some("10.0.1.0/24"), None, [1, 1, 1, 1]);
        let b = lease(Some("10.0.1.0/24"), Some("fd00:1::/64"), [2, 2, 2, 2]);
        let c = lease(None, Some("fd00:1::/64"), [3, 3, 3, 3]);
        assert!(a.same_subnet(&b)); // judged by a's families: v4 only
        assert!(!b.same_subnet(&a)); // dual needs both
        assert!(c.same_subnet(&b));
        assert!(!a.same_subnet(&c));
        assert!(b.same_subnet(&b.clone()));
        assert!(!lease(None, None, [0; 4]).same_subnet(&a));
    }

    #[test]
    fn watcher_snapshots_and_events() {
        let own = lease(Some("10.0.0.0/24"), None, [9, 9, 9, 9]);
        let a = lease(Some("10.0.1.0/24"), None, [1, 1, 1, 1]);
        let b = lease(Some("10.0.2.0/24"), None, [2, 2, 2, 2]);
        let mut w = LeaseWatcher::new(own.clone());
        assert_eq!(
            w.reset(vec![own.clone(), a.clone(), b.clone()]),
            vec![LeaseEvent::Added(a.clone()), LeaseEvent::Added(b.clone())]
        );
        assert_eq!(w.leases(), &[a.clone(), b.clone()]);
        // Same snapshot again: nothing, and in particular no "removed" for the own lease.
        assert_eq!(w.reset(vec![own.clone(), a.clone(), b.clone()]), vec![]);
        // b vanished, attribute change of a hidden by the snapshot.
        let mut a2 = a.clone();
        a2.attrs.public_ip = Ipv4Addr::new(7, 7, 7, 7);
        assert_eq!(
            w.reset(vec![a2.clone()]),
            vec![LeaseEvent::Removed(b.clone())]
        );
        assert_eq!(w.leases(), &[a2.clone()]);
        // Incremental: own lease filtered, added replaces, removed reports cached attrs.
        let bare_a = lease(Some("10.0.1.0/24"), None, [0; 4]);
        let events = w.update(vec![
            LeaseEvent::Added(own.clone()),
            LeaseEvent::Added(a.clone()),
            LeaseEvent::Added(b.clone()),
            LeaseEvent::Removed(bare_a.clone()),
            LeaseEvent::Removed(bare_a.clone()),
        ]);
        assert_eq!(
            events,
            vec![
                LeaseEvent::Added(a.clone()),
                LeaseEvent::Added(b.clone()),
                LeaseEvent::Removed(a.clone()),
                LeaseEvent::Removed(bare_a.clone()),
            ]
        );
        assert_eq!(w.leases(), &[b]);
    }

    #[test]
    fn never_panics_on_random_input() {
        let (mut accepted_keys, mut accepted_values) = (0u32, 0u32);
        use rand::{SeedableRng, rngs::StdRng};
        let key_seeds = [
            "255.255.255.255-32",
            "10.5.1.0-24&fc00::-64",
            "",
            "{}",
            "10.12.13.0-24&fd00:12:13::-56",
        ];
        let value_seeds = [
            VXLAN_VALUE,
            r#"{"PublicIP":"1.2.3.4","PublicIPv6":"fd00::1"}"#,
            "{}",
            "",
        ];
        let alphabet: Vec<char> =
            "0123456789abcdef.:-&/{}\"[],nul PublicIPv6BackendDataType\\\u{2028}<é"
                .chars()
                .collect();
        let mut rng = StdRng::seed_from_u64(0x1ea5e);
        let mutate = |seed: &str, rng: &mut StdRng| -> String {
            crate::test_fuzz::mutate(rng, seed, &alphabet, 5)
        };
        for i in 0..4000 {
            let key = mutate(key_seeds[i % key_seeds.len()], &mut rng);
            if let Some(k) = SubnetKey::parse(&key) {
                accepted_keys += 1;
                // Whatever parses formats to a key that parses back to the same subnets.
                assert_eq!(SubnetKey::parse(&k.to_string()), Some(k), "{key}");
            }
            let value = mutate(value_seeds[i % value_seeds.len()], &mut rng);
            if let Ok(attrs) = LeaseAttrs::from_json(&value) {
                accepted_values += 1;
                let again = LeaseAttrs::from_json(&attrs.to_json()).unwrap();
                assert_eq!(again, attrs, "{value}");
            }
            let _ = Lease::from_etcd(&key, value.as_bytes(), None);
        }
        // The mutations must exercise the accepting paths too, not only the errors.
        assert!(
            accepted_keys >= 50 && accepted_values >= 50,
            "{accepted_keys} / {accepted_values} accepted"
        );
    }
}
