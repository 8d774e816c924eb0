//! Upstream's etcd layout as the lab reads and writes it: the network config at
//! `<prefix>/config`, leases at `<prefix>/subnets/<a.b.c.d-len>` with upstream's JSON
//! (flannel-upstream.md §5.1), and fake leases for the control-plane benchmark.

use std::net::Ipv4Addr;

use anyhow::{Context as _, Result, bail};
use ipnet::{Ipv4Net, Ipv6Net};
use serde_json::{Value, json};

use super::kv::Kv;

/// Upstream's default `--etcd-prefix`.
pub const DEFAULT_PREFIX: &str = "/coreos.com/network";

/// The network config for `backend` on `network` (`{"Network":..,"Backend":{"Type":..}}`),
/// plus any extra `Backend` options (e.g. `{"DirectRouting": true}`).
pub fn netconf(network: Ipv4Net, backend: &str, backend_options: Value) -> Value {
    let mut backend_obj = json!({ "Type": backend });
    if let (Some(obj), Value::Object(extra)) = (backend_obj.as_object_mut(), backend_options) {
        obj.extend(extra);
    }
    json!({ "Network": network.to_string(), "Backend": backend_obj })
}

/// Writes the network config to `<prefix>/config`.
pub fn write_netconf(kv: &Kv, prefix: &str, config: &Value) -> Result<()> {
    kv.put(&format!("{prefix}/config"), &config.to_string())
}

/// `10.5.52.0-24`: the key suffix of an IPv4 lease.
pub fn subnet_key(subnet: Ipv4Net) -> String {
    format!("{}-{}", subnet.network(), subnet.prefix_len())
}

/// Parses `a.b.c.d-len` or `a.b.c.d-len&v6-len` (the last path element of a lease key).
pub fn parse_subnet_key(key: &str) -> Option<(Ipv4Net, Option<Ipv6Net>)> {
    let (v4, v6) = match key.split_once('&') {
        Some((a, b)) => (a, Some(b)),
        None => (key, None),
    };
    let parse4 = |s: &str| -> Option<Ipv4Net> {
        let (ip, len) = s.rsplit_once('-')?;
        Ipv4Net::new(ip.parse().ok()?, len.parse().ok()?).ok()
    };
    let parse6 = |s: &str| -> Option<Ipv6Net> {
        let (ip, len) = s.rsplit_once('-')?;
        Ipv6Net::new(ip.parse().ok()?, len.parse().ok()?).ok()
    };
    let v4 = parse4(v4)?;
    match v6 {
        Some(v6) => Some((v4, Some(parse6(v6)?))),
        None => Some((v4, None)),
    }
}

/// One lease as stored in etcd (or as a Node object carries it in kube mode).
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseRecord {
    /// The full etcd key (`Node <name>` for a lease read from a Node in kube mode).
    pub key: String,
    /// IPv4 subnet from the key.
    pub subnet: Ipv4Net,
    /// IPv6 subnet from the key (dual stack).
    pub subnet6: Option<Ipv6Net>,
    /// `PublicIP`
    pub public_ip: Option<Ipv4Addr>,
    /// `PublicIPv6`
    pub public_ipv6: Option<String>,
    /// `BackendType`
    pub backend_type: Option<String>,
    /// `BackendData`
    pub backend_data: Option<Value>,
}

impl LeaseRecord {
    /// Parses a key and its JSON value.
    pub fn parse(key: &str, value: &str) -> Result<LeaseRecord> {
        let last = key.rsplit('/').next().unwrap_or_default();
        let Some((subnet, subnet6)) = parse_subnet_key(last) else {
            bail!("lease key {key:?} is not a subnet key");
        };
        let attrs: Value =
            serde_json::from_str(value).with_context(|| format!("lease {key}: {value:?}"))?;
        let text = |field: &str| attrs[field].as_str().map(str::to_owned);
        Ok(LeaseRecord {
            key: key.to_owned(),
            subnet,
            subnet6,
            public_ip: text("PublicIP").and_then(|s| s.parse().ok()),
            public_ipv6: text("PublicIPv6"),
            backend_type: text("BackendType"),
            backend_data: attrs.get("BackendData").cloned(),
        })
    }

    /// `VtepMAC` of a vxlan lease.
    pub fn vtep_mac(&self) -> Option<&str> {
        self.backend_data.as_ref()?.get("VtepMAC")?.as_str()
    }
}

/// Every lease under `<prefix>/subnets/`, sorted by key. Unparsable entries are errors (the
/// lab only ever sees what agents wrote, which must parse).
pub fn read_leases(kv: &Kv, prefix: &str) -> Result<Vec<LeaseRecord>> {
    kv.get_prefix(&format!("{prefix}/subnets/"))?
        .iter()
        .map(|(k, v)| LeaseRecord::parse(k, v))
        .collect()
}

/// `n` fake remote vxlan leases as (key, JSON) pairs, in upstream's exact JSON: subnets
/// 10.<1 + i/256>.<i%256>.0/24 (so 10.0.0.0/16 stays free for real nodes), public IPs
/// 100.64.0.0 + i + 1, locally administered VtepMACs `0e:..` numbered from 1.
pub fn fake_vxlan_leases(prefix: &str, n: usize) -> Result<Vec<(String, String)>> {
    if n > 255 * 256 {
        bail!(
            "at most {} fake leases fit in 10.0.0.0/8, asked for {n}",
            255 * 256
        );
    }
    (0..n)
        .map(|i| {
            let i = u32::try_from(i)?;
            let subnet = Ipv4Net::new(
                Ipv4Addr::new(10, (1 + i / 256) as u8, (i % 256) as u8, 0),
                24,
            )?;
            let public_ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(100, 64, 0, 0)) + i + 1);
            let m = (i + 1).to_be_bytes();
            let mac = format!("0e:00:{:02x}:{:02x}:{:02x}:{:02x}", m[0], m[1], m[2], m[3]);
            let value = json!({
                "PublicIP": public_ip.to_string(),
                "PublicIPv6": null,
                "BackendType": "vxlan",
                "BackendData": { "VNI": 1, "VtepMAC": mac },
            });
            Ok((
                format!("{prefix}/subnets/{}", subnet_key(subnet)),
                value.to_string(),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        let net: Ipv4Net = "10.5.52.0/24".parse().expect("cidr");
        assert_eq!(subnet_key(net), "10.5.52.0-24");
        assert_eq!(parse_subnet_key("10.5.52.0-24"), Some((net, None)));
        let (v4, v6) = parse_subnet_key("10.12.13.0-24&fd00:12:13::-56").expect("dual");
        assert_eq!(v4.to_string(), "10.12.13.0/24");
        assert_eq!(
            v6.map(|n| n.to_string()).as_deref(),
            Some("fd00:12:13::/56")
        );
        for bad in [
            "10",
            "10.12.13.0",
            "10.12.13-24",
            "10.12.13.300-24",
            "10.12.13.0-24hi",
        ] {
            assert_eq!(parse_subnet_key(bad), None, "{bad}");
        }
    }

    #[test]
    fn fake_leases_are_upstream_json() {
        let leases = fake_vxlan_leases(DEFAULT_PREFIX, 300).expect("leases");
        assert_eq!(leases.len(), 300);
        assert_eq!(leases[0].0, "/coreos.com/network/subnets/10.1.0.0-24");
        assert_eq!(
            leases[0].1,
            r#"{"PublicIP":"100.64.0.1","PublicIPv6":null,"BackendType":"vxlan","BackendData":{"VNI":1,"VtepMAC":"0e:00:00:00:00:01"}}"#
        );
        assert_eq!(leases[299].0, "/coreos.com/network/subnets/10.2.43.0-24");
        let rec = LeaseRecord::parse(&leases[299].0, &leases[299].1).expect("parse");
        assert_eq!(rec.public_ip, Some(Ipv4Addr::new(100, 64, 1, 44)));
        assert_eq!(rec.vtep_mac(), Some("0e:00:00:00:01:2c"));
        assert_eq!(rec.backend_type.as_deref(), Some("vxlan"));
        let mut keys: Vec<_> = leases.iter().map(|(k, _)| k).collect();
        keys.dedup();
        assert_eq!(keys.len(), 300, "keys are unique");
        assert!(fake_vxlan_leases(DEFAULT_PREFIX, 70_000).is_err());
    }

    #[test]
    fn netconf_shape() {
        let conf = netconf(
            "10.244.0.0/16".parse().expect("cidr"),
            "vxlan",
            json!({"DirectRouting": true}),
        );
        assert_eq!(
            conf.to_string(),
            r#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan","DirectRouting":true}}"#
        );
    }
}
