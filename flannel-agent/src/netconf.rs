//! The network configuration: `net-conf.json` (kube mode) or the etcd `<prefix>/config` value.
//!
//! [`NetConfig::parse`] decodes it with Go's semantics (keys case-insensitive, unknown keys
//! ignored, a later duplicate key overrides, `Network` masked, `EnableIPv4` defaulting to true,
//! `Backend` kept as raw JSON with its `Type` extracted). Kube mode uses the parsed config as is;
//! etcd mode runs [`NetConfig::check`] (upstream `CheckNetworkConfig`), which fills in
//! `SubnetLen`/`SubnetMin`/`SubnetMax` and returns a [`CheckedConfig`].

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};
use serde_json::value::RawValue;

use crate::gojson::{self, GoJsonError, GoObject, RawJson};
use crate::ip::{self, IpStack, Subnet};

/// `Backend.Type` when the config has no `Backend` key at all (upstream quirk: not vxlan).
pub const DEFAULT_BACKEND_TYPE: &str = "udp";

/// A parsed (not yet validated) network configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// `EnableIPv4` (default true).
    pub enable_ipv4: bool,
    /// `EnableIPv6` (default false).
    pub enable_ipv6: bool,
    /// `EnableNFTables` (default false): use the nftables traffic manager.
    pub enable_nftables: bool,
    /// `Network`, masked. `None` when absent. An explicit `0.0.0.0/0` is kept and counts as
    /// undefined in [`NetConfig::check`].
    pub network: Option<Ipv4Net>,
    /// `IPv6Network`, masked. `None` when absent.
    pub ipv6_network: Option<Ipv6Net>,
    /// `SubnetLen`; 0 means "compute".
    pub subnet_len: u64,
    /// `SubnetMin`; `None` when absent or `0.0.0.0`.
    pub subnet_min: Option<Ipv4Addr>,
    /// `SubnetMax`; `None` when absent or `0.0.0.0`.
    pub subnet_max: Option<Ipv4Addr>,
    /// `IPv6SubnetLen`; 0 means "compute".
    pub ipv6_subnet_len: u64,
    /// `IPv6SubnetMin`; `None` when absent, `null` or `::`.
    pub ipv6_subnet_min: Option<Ipv6Addr>,
    /// `IPv6SubnetMax`; `None` when absent, `null` or `::`.
    pub ipv6_subnet_max: Option<Ipv6Addr>,
    /// `Backend.Type` as written (not lower-cased): [`DEFAULT_BACKEND_TYPE`] when `Backend` is
    /// absent, `""` when `Backend` has no `Type` (an unknown backend later).
    pub backend_type: String,
    /// The `Backend` object verbatim (compacted); `None` when absent.
    pub backend: Option<RawJson>,
}

/// Errors from parsing or checking a network configuration. Check errors carry upstream's
/// exact texts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Malformed JSON or a field of the wrong JSON type.
    #[error("{0}")]
    Json(#[from] GoJsonError),
    /// A field whose value cannot be parsed (address, CIDR).
    #[error("invalid {field} {value}: {reason}")]
    Field {
        /// Field name as upstream spells it.
        field: &'static str,
        /// The JSON text of the value.
        value: String,
        /// Why it was rejected.
        reason: String,
    },
    /// `Backend` is not an object (or `Type` is not a string).
    #[error("error decoding Backend property of config: {0}")]
    Backend(GoJsonError),
    /// Neither IPv4 nor IPv6 is enabled.
    #[error("none defined stack")]
    NoStack,
    /// IPv4 enabled without a usable `Network`.
    #[error("please define a correct Network parameter in the flannel config")]
    NetworkUndefined,
    /// IPv6 enabled without a usable `IPv6Network`.
    #[error("please define a correct IPv6Network parameter in the flannel config")]
    Ipv6NetworkUndefined,
    /// `SubnetLen > 30`.
    #[error("SubnetLen must be less than /31")]
    SubnetLenTooLong,
    /// `IPv6SubnetLen > 126`.
    #[error("SubnetLen must be less than /127")]
    Ipv6SubnetLenTooLong,
    /// The subnet length leaves fewer than four subnets (either family).
    #[error("network must be able to accommodate at least four subnets")]
    TooFewSubnets,
    /// `Network` longer than /28 with `SubnetLen` unset.
    #[error("network is too small. Minimum useful network prefix is /28")]
    NetworkTooSmall,
    /// `IPv6Network` longer than /124 with `IPv6SubnetLen` unset.
    #[error("IPv6Network is too small. Minimum useful network prefix is /124")]
    Ipv6NetworkTooSmall,
    /// `SubnetMin` outside `Network`.
    #[error("SubnetMin is not in the range of the Network")]
    SubnetMinOutOfRange,
    /// `SubnetMax` outside `Network`.
    #[error("SubnetMax is not in the range of the Network")]
    SubnetMaxOutOfRange,
    /// `SubnetMin` not aligned to `SubnetLen`.
    #[error("SubnetMin is not on a SubnetLen boundary: {0}")]
    SubnetMinUnaligned(Ipv4Addr),
    /// `SubnetMax` not aligned to `SubnetLen`.
    #[error("SubnetMax is not on a SubnetLen boundary: {0}")]
    SubnetMaxUnaligned(Ipv4Addr),
    /// `IPv6SubnetMin` outside `IPv6Network`.
    #[error("IPv6SubnetMin is not in the range of the IPv6Network")]
    Ipv6SubnetMinOutOfRange,
    /// `IPv6SubnetMax` outside `IPv6Network`.
    #[error("IPv6SubnetMax is not in the range of the IPv6Network")]
    Ipv6SubnetMaxOutOfRange,
    /// `IPv6SubnetMin` not aligned to `IPv6SubnetLen`.
    #[error("IPv6SubnetMin is not on a SubnetLen boundary: {0}")]
    Ipv6SubnetMinUnaligned(Ipv6Addr),
    /// `IPv6SubnetMax` not aligned to `IPv6SubnetLen`.
    #[error("IPv6SubnetMax is not on a SubnetLen boundary: {0}")]
    Ipv6SubnetMaxUnaligned(Ipv6Addr),
}

/// The subnet pool of one family after validation: where leases are carved from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool<N: Subnet> {
    /// The cluster network (`Network` / `IPv6Network`), masked.
    pub network: N,
    /// Length of each node's subnet.
    pub subnet_len: u8,
    /// Address of the lowest subnet handed out.
    pub subnet_min: N::Addr,
    /// Address of the highest subnet handed out.
    pub subnet_max: N::Addr,
}

impl<N: Subnet> Pool<N> {
    /// Upstream `isSubnetConfigCompat`: `sn` starts within `[subnet_min, subnet_max]` and has
    /// the configured length.
    pub fn is_compatible(&self, sn: N) -> bool {
        sn.addr() >= self.subnet_min
            && sn.addr() <= self.subnet_max
            && sn.prefix_len() == self.subnet_len
    }

    /// The candidate subnets in allocation order: from `subnet_min` upward in `subnet_len`
    /// steps while the address is `<= subnet_max`.
    pub fn candidates(&self) -> impl Iterator<Item = N> + '_ {
        let first = N::from_parts(self.subnet_min, self.subnet_len);
        std::iter::successors(first, |sn| ip::next_subnet(*sn))
            .take_while(move |sn| sn.addr() <= self.subnet_max)
    }
}

/// A configuration that passed [`NetConfig::check`] (etcd mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedConfig {
    /// The IPv4 pool when IPv4 is enabled.
    pub ipv4: Option<Pool<Ipv4Net>>,
    /// The IPv6 pool when IPv6 is enabled.
    pub ipv6: Option<Pool<Ipv6Net>>,
    /// The parsed configuration with `SubnetLen`/`SubnetMin`/`SubnetMax` (and the IPv6
    /// counterparts) filled in, as upstream leaves it after `CheckNetworkConfig`.
    pub config: NetConfig,
}

impl CheckedConfig {
    /// The enabled families (never empty after a successful check).
    pub fn stack(&self) -> IpStack {
        match (self.ipv4.is_some(), self.ipv6.is_some()) {
            (_, false) => IpStack::V4,
            (false, true) => IpStack::V6,
            (true, true) => IpStack::Dual,
        }
    }
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            enable_ipv4: true,
            enable_ipv6: false,
            enable_nftables: false,
            network: None,
            ipv6_network: None,
            subnet_len: 0,
            subnet_min: None,
            subnet_max: None,
            ipv6_subnet_len: 0,
            ipv6_subnet_min: None,
            ipv6_subnet_max: None,
            backend_type: DEFAULT_BACKEND_TYPE.to_owned(),
            backend: None,
        }
    }
}

impl NetConfig {
    /// Parses the JSON text (upstream `ParseConfig`). A top-level `null` gives the defaults.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let mut cfg = NetConfig::default();
        let Some(obj) = GoObject::parse(json)? else {
            return Ok(cfg);
        };
        if let Some(v) = obj.last("EnableIPv4", gojson::boolean)? {
            cfg.enable_ipv4 = v;
        }
        if let Some(v) = obj.last("EnableIPv6", gojson::boolean)? {
            cfg.enable_ipv6 = v;
        }
        if let Some(v) = obj.last("EnableNFTables", gojson::boolean)? {
            cfg.enable_nftables = v;
        }
        cfg.network = last_parsed(&obj, "Network", ip::parse_cidr_v4)?.or(cfg.network);
        cfg.ipv6_network = last_parsed(&obj, "IPv6Network", ip::parse_cidr_v6)?;
        cfg.subnet_len = obj.last("SubnetLen", gojson::uint)?.unwrap_or(0);
        cfg.ipv6_subnet_len = obj.last("IPv6SubnetLen", gojson::uint)?.unwrap_or(0);
        cfg.subnet_min =
            last_parsed(&obj, "SubnetMin", parse_ipv4)?.filter(|a| !a.is_unspecified());
        cfg.subnet_max =
            last_parsed(&obj, "SubnetMax", parse_ipv4)?.filter(|a| !a.is_unspecified());
        cfg.ipv6_subnet_min = last_ipv6_ptr(&obj, "IPv6SubnetMin")?;
        cfg.ipv6_subnet_max = last_ipv6_ptr(&obj, "IPv6SubnetMax")?;
        if let Some(raw) = obj.values("Backend").last() {
            cfg.backend_type = backend_type(raw)?;
            cfg.backend = Some(RawJson::from_raw(raw));
        }
        Ok(cfg)
    }

    /// The enabled families; [`ConfigError::NoStack`] when neither is enabled.
    pub fn stack(&self) -> Result<IpStack, ConfigError> {
        IpStack::from_flags(self.enable_ipv4, self.enable_ipv6).ok_or(ConfigError::NoStack)
    }

    /// Validates and completes the configuration for etcd mode (upstream `CheckNetworkConfig`,
    /// plus the `none defined stack` check upstream does right after).
    pub fn check(&self) -> Result<CheckedConfig, ConfigError> {
        self.stack()?;
        let mut config = self.clone();
        let ipv4 = if self.enable_ipv4 {
            let network = self
                .network
                .filter(|n| !ip::is_unset(*n))
                .ok_or(ConfigError::NetworkUndefined)?;
            let pool = check_pool(
                &V4_RULES,
                network,
                self.subnet_len,
                self.subnet_min,
                self.subnet_max,
            )
            .map_err(|e| e.into_config_error(&V4_ERRORS))?;
            config.subnet_len = u64::from(pool.subnet_len);
            config.subnet_min = Some(pool.subnet_min);
            config.subnet_max = Some(pool.subnet_max);
            Some(pool)
        } else {
            None
        };
        let ipv6 = if self.enable_ipv6 {
            let network = self
                .ipv6_network
                .filter(|n| !ip::is_unset(*n))
                .ok_or(ConfigError::Ipv6NetworkUndefined)?;
            let pool = check_pool(
                &V6_RULES,
                network,
                self.ipv6_subnet_len,
                self.ipv6_subnet_min,
                self.ipv6_subnet_max,
            )
            .map_err(|e| e.into_config_error(&V6_ERRORS))?;
            config.ipv6_subnet_len = u64::from(pool.subnet_len);
            config.ipv6_subnet_min = Some(pool.subnet_min);
            config.ipv6_subnet_max = Some(pool.subnet_max);
            Some(pool)
        } else {
            None
        };
        Ok(CheckedConfig { ipv4, ipv6, config })
    }
}

/// Decodes every occurrence of a string field with `parse`; the last one wins.
fn last_parsed<T, E: std::fmt::Display>(
    obj: &GoObject<'_>,
    field: &'static str,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<Option<T>, ConfigError> {
    let mut out = None;
    for raw in obj.values(field) {
        // Upstream's unmarshallers for these fields reject `null` too.
        let text = string_value(field, raw)?;
        out = Some(parse(&text).map_err(|e| field_error(field, raw, e))?);
    }
    Ok(out)
}

/// An `*ip.IP6` field: `null` resets it, `::` means unset.
fn last_ipv6_ptr(obj: &GoObject<'_>, field: &'static str) -> Result<Option<Ipv6Addr>, ConfigError> {
    let mut out = None;
    for raw in obj.values(field) {
        out = match gojson::string(field, raw)? {
            None => None,
            Some(text) => {
                let addr: Ipv6Addr = text
                    .parse()
                    .map_err(|_| field_error(field, raw, "invalid IPv6 address format"))?;
                Some(addr).filter(|a| !a.is_unspecified())
            }
        };
    }
    Ok(out)
}

fn string_value(field: &'static str, raw: &RawValue) -> Result<String, ConfigError> {
    match gojson::string(field, raw)? {
        Some(s) => Ok(s),
        None => Err(field_error(field, raw, "null is not allowed")),
    }
}

fn field_error(field: &'static str, raw: &RawValue, reason: impl std::fmt::Display) -> ConfigError {
    ConfigError::Field {
        field,
        value: raw.get().to_owned(),
        reason: reason.to_string(),
    }
}

/// Upstream `ParseIP4` texts.
fn parse_ipv4(s: &str) -> Result<Ipv4Addr, &'static str> {
    if let Ok(a) = s.parse::<Ipv4Addr>() {
        return Ok(a);
    }
    if s.parse::<Ipv6Addr>().is_ok() {
        return Err("invalid IPv4 address format");
    }
    Err("invalid IP address format")
}

/// `Type` of the raw `Backend` value: `null` → `""`, object → its `Type` (or `""`).
fn backend_type(raw: &RawValue) -> Result<String, ConfigError> {
    let obj = GoObject::from_raw(raw).map_err(ConfigError::Backend)?;
    match obj {
        None => Ok(String::new()),
        Some(obj) => Ok(obj
            .last("Type", gojson::string)
            .map_err(ConfigError::Backend)?
            .unwrap_or_default()),
    }
}

/// Per-family numbers of `CheckNetworkConfig`.
struct PoolRules {
    /// Longest allowed explicit subnet length (30 / 126).
    max_subnet_len: u64,
    /// Longest network prefix when the length is computed (28 / 124).
    max_network_prefix: u8,
    /// Network prefixes up to this get the default length (22 / 62).
    default_up_to: u8,
    /// The default subnet length (24 / 64).
    default_len: u8,
}

const V4_RULES: PoolRules = PoolRules {
    max_subnet_len: 30,
    max_network_prefix: 28,
    default_up_to: 22,
    default_len: 24,
};

const V6_RULES: PoolRules = PoolRules {
    max_subnet_len: 126,
    max_network_prefix: 124,
    default_up_to: 62,
    default_len: 64,
};

/// A family-independent check failure, mapped to the family's error texts.
#[derive(Debug)]
enum PoolError<A> {
    LenTooLong,
    TooFew,
    TooSmall,
    MinOutOfRange,
    MaxOutOfRange,
    MinUnaligned(A),
    MaxUnaligned(A),
}

struct PoolErrors<A> {
    len_too_long: ConfigError,
    too_small: ConfigError,
    min_out_of_range: ConfigError,
    max_out_of_range: ConfigError,
    min_unaligned: fn(A) -> ConfigError,
    max_unaligned: fn(A) -> ConfigError,
}

const V4_ERRORS: PoolErrors<Ipv4Addr> = PoolErrors {
    len_too_long: ConfigError::SubnetLenTooLong,
    too_small: ConfigError::NetworkTooSmall,
    min_out_of_range: ConfigError::SubnetMinOutOfRange,
    max_out_of_range: ConfigError::SubnetMaxOutOfRange,
    min_unaligned: ConfigError::SubnetMinUnaligned,
    max_unaligned: ConfigError::SubnetMaxUnaligned,
};

const V6_ERRORS: PoolErrors<Ipv6Addr> = PoolErrors {
    len_too_long: ConfigError::Ipv6SubnetLenTooLong,
    too_small: ConfigError::Ipv6NetworkTooSmall,
    min_out_of_range: ConfigError::Ipv6SubnetMinOutOfRange,
    max_out_of_range: ConfigError::Ipv6SubnetMaxOutOfRange,
    min_unaligned: ConfigError::Ipv6SubnetMinUnaligned,
    max_unaligned: ConfigError::Ipv6SubnetMaxUnaligned,
};

impl<A> PoolError<A> {
    fn into_config_error(self, errors: &PoolErrors<A>) -> ConfigError {
        match self {
            PoolError::LenTooLong => errors.len_too_long.clone(),
            PoolError::TooFew => ConfigError::TooFewSubnets,
            PoolError::TooSmall => errors.too_small.clone(),
            PoolError::MinOutOfRange => errors.min_out_of_range.clone(),
            PoolError::MaxOutOfRange => errors.max_out_of_range.clone(),
            PoolError::MinUnaligned(a) => (errors.min_unaligned)(a),
            PoolError::MaxUnaligned(a) => (errors.max_unaligned)(a),
        }
    }
}

/// The body of `CheckNetworkConfig` for one family.
fn check_pool<N: Subnet>(
    rules: &PoolRules,
    network: N,
    subnet_len: u64,
    subnet_min: Option<N::Addr>,
    subnet_max: Option<N::Addr>,
) -> Result<Pool<N>, PoolError<N::Addr>> {
    let network = ip::network(network);
    let prefix = network.prefix_len();
    let subnet_len = subnet_length(rules, prefix, subnet_len)?;
    let size = ip::size_bits::<N>(subnet_len).ok_or(PoolError::TooFew)?;
    let net_size = ip::size_bits::<N>(prefix).ok_or(PoolError::TooFew)?;
    let base = N::addr_to_bits(network.addr());

    let subnet_min = match subnet_min {
        None => N::addr_from_bits(base + size),
        Some(a) if ip::contains_addr(network, a) => a,
        Some(_) => return Err(PoolError::MinOutOfRange),
    };
    let subnet_max = match subnet_max {
        None => N::addr_from_bits(base + (net_size - size)),
        Some(a) if ip::contains_addr(network, a) => a,
        Some(_) => return Err(PoolError::MaxOutOfRange),
    };
    let mask = ip::mask_bits::<N>(subnet_len);
    if N::addr_to_bits(subnet_min) & mask != N::addr_to_bits(subnet_min) {
        return Err(PoolError::MinUnaligned(subnet_min));
    }
    if N::addr_to_bits(subnet_max) & mask != N::addr_to_bits(subnet_max) {
        return Err(PoolError::MaxUnaligned(subnet_max));
    }
    Ok(Pool {
        network,
        subnet_len,
        subnet_min,
        subnet_max,
    })
}

/// The explicit subnet length checked, or the computed default.
fn subnet_length<A>(rules: &PoolRules, prefix: u8, subnet_len: u64) -> Result<u8, PoolError<A>> {
    if subnet_len > 0 {
        if subnet_len > rules.max_subnet_len {
            return Err(PoolError::LenTooLong);
        }
        if subnet_len < u64::from(prefix) + 2 {
            return Err(PoolError::TooFew);
        }
        // Bounded by max_subnet_len (<= 126) above.
        return u8::try_from(subnet_len).map_err(|_| PoolError::LenTooLong);
    }
    if prefix > rules.max_network_prefix {
        Err(PoolError::TooSmall)
    } else if prefix <= rules.default_up_to {
        Ok(rules.default_len)
    } else {
        Ok(prefix + 2)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn check(json: &str) -> Result<CheckedConfig, ConfigError> {
        NetConfig::parse(json).and_then(|c| c.check())
    }

    fn v4pool(json: &str) -> Pool<Ipv4Net> {
        check(json).unwrap().ipv4.unwrap()
    }

    fn err(json: &str) -> String {
        check(json).unwrap_err().to_string()
    }

    #[test]
    fn v4_defaults() {
        let p = v4pool(r#"{ "network": "10.3.0.0/16" }"#);
        assert_eq!(p.network.to_string(), "10.3.0.0/16");
        assert_eq!(p.subnet_len, 24);
        assert_eq!(p.subnet_min.to_string(), "10.3.1.0");
        assert_eq!(p.subnet_max.to_string(), "10.3.255.0");
        let c = check(r#"{ "network": "10.3.0.0/16" }"#).unwrap();
        assert_eq!(c.config.subnet_len, 24);
        assert_eq!(c.config.subnet_min, Some("10.3.1.0".parse().unwrap()));
        assert_eq!(c.stack(), IpStack::V4);
        assert!(c.ipv6.is_none());
    }

    #[test]
    fn v6_defaults() {
        let c = check(r#"{ "enableIPv6": true, "ipv6Network": "fc00::/48", "enableIPv4": false }"#)
            .unwrap();
        assert!(c.ipv4.is_none());
        let p = c.ipv6.unwrap();
        assert_eq!(p.subnet_len, 64);
        assert_eq!(p.subnet_min.to_string(), "fc00:0:0:1::");
        assert_eq!(p.subnet_max.to_string(), "fc00:0:0:ffff::");
        assert_eq!(c.stack(), IpStack::V6);
    }

    #[test]
    fn explicit_values_are_kept() {
        let c = NetConfig::parse(
            r#"{ "Network": "10.3.0.0/16", "SubnetMin": "10.3.5.0", "SubnetMax": "10.3.8.0", "SubnetLen": 28 }"#,
        )
        .unwrap();
        assert_eq!(c.subnet_len, 28);
        assert_eq!(c.subnet_min, Some("10.3.5.0".parse().unwrap()));
        assert_eq!(c.subnet_max, Some("10.3.8.0".parse().unwrap()));
        let p = c.check().unwrap().ipv4.unwrap();
        assert_eq!(
            (
                p.subnet_len,
                p.subnet_min.to_string(),
                p.subnet_max.to_string()
            ),
            (28, "10.3.5.0".into(), "10.3.8.0".into())
        );

        let c = NetConfig::parse(
            r#"{ "EnableIPv6": true, "IPv6Network": "fc00::/48", "IPv6SubnetMin": "fc00:0:0:1::", "IPv6SubnetMax": "fc00:0:0:f::", "IPv6SubnetLen": 124, "enableIPv4": false }"#,
        )
        .unwrap();
        assert_eq!(c.ipv6_subnet_len, 124);
        assert_eq!(c.ipv6_subnet_min, Some("fc00:0:0:1::".parse().unwrap()));
        assert_eq!(c.ipv6_subnet_max, Some("fc00:0:0:f::".parse().unwrap()));
        let p = c.check().unwrap().ipv6.unwrap();
        assert_eq!(p.subnet_len, 124);
        assert_eq!(p.subnet_max.to_string(), "fc00:0:0:f::");
    }

    #[test]
    fn computed_vectors() {
        let p = v4pool(r#"{"Network":"10.0.0.0/23"}"#);
        assert_eq!(
            (
                p.subnet_len,
                p.subnet_min.to_string(),
                p.subnet_max.to_string()
            ),
            (25, "10.0.0.128".into(), "10.0.1.128".into())
        );
        let p = v4pool(r#"{"Network":"10.0.0.0/28"}"#);
        assert_eq!(
            (
                p.subnet_len,
                p.subnet_min.to_string(),
                p.subnet_max.to_string()
            ),
            (30, "10.0.0.4".into(), "10.0.0.12".into())
        );
        assert_eq!(p.candidates().count(), 3);
        let p = v4pool(r#"{"Network":"10.0.0.0/22"}"#);
        assert_eq!(p.subnet_len, 24);
        assert_eq!(
            err(r#"{"Network":"10.0.0.0/29"}"#),
            "network is too small. Minimum useful network prefix is /28"
        );
        assert_eq!(
            err(r#"{"Network":"10.0.0.0/16","SubnetLen":17}"#),
            "network must be able to accommodate at least four subnets"
        );
        for len in [8, 16] {
            assert_eq!(
                err(&format!(r#"{{"Network":"10.0.0.0/16","SubnetLen":{len}}}"#)),
                "network must be able to accommodate at least four subnets"
            );
        }
        assert_eq!(
            v4pool(r#"{"Network":"10.0.0.0/16","SubnetLen":18}"#).subnet_len,
            18
        );
        assert_eq!(
            err(r#"{"Network":"10.0.0.0/16","SubnetLen":31}"#),
            "SubnetLen must be less than /31"
        );
        assert_eq!(
            err(r#"{"Network":"10.0.0.0/16","SubnetLen":4294967297}"#),
            "SubnetLen must be less than /31"
        );
    }

    #[test]
    fn v4_check_errors() {
        assert_eq!(
            err("{}"),
            "please define a correct Network parameter in the flannel config"
        );
        assert_eq!(
            err(r#"{"Network":"0.0.0.0/0"}"#),
            "please define a correct Network parameter in the flannel config"
        );
        assert_eq!(
            err(r#"{"Network":"10.3.0.0/16","SubnetMin":"10.4.0.0"}"#),
            "SubnetMin is not in the range of the Network"
        );
        assert_eq!(
            err(r#"{"Network":"10.3.0.0/16","SubnetMax":"10.4.0.0"}"#),
            "SubnetMax is not in the range of the Network"
        );
        assert_eq!(
            err(r#"{"Network":"10.3.0.0/16","SubnetMin":"10.3.0.5"}"#),
            "SubnetMin is not on a SubnetLen boundary: 10.3.0.5"
        );
        assert_eq!(
            err(r#"{"Network":"10.3.0.0/16","SubnetMax":"10.3.9.1"}"#),
            "SubnetMax is not on a SubnetLen boundary: 10.3.9.1"
        );
        // 0.0.0.0 counts as unset.
        assert_eq!(
            v4pool(r#"{"Network":"10.3.0.0/16","SubnetMin":"0.0.0.0"}"#)
                .subnet_min
                .to_string(),
            "10.3.1.0"
        );
        assert_eq!(err(r#"{"EnableIPv4":false}"#), "none defined stack");
    }

    #[test]
    fn v6_check_errors() {
        let base = r#""EnableIPv4":false,"EnableIPv6":true"#;
        assert_eq!(
            err(&format!("{{{base}}}")),
            "please define a correct IPv6Network parameter in the flannel config"
        );
        assert_eq!(
            err(&format!(
                r#"{{{base},"IPv6Network":"fc00::/48","IPv6SubnetLen":127}}"#
            )),
            "SubnetLen must be less than /127"
        );
        assert_eq!(
            err(&format!(
                r#"{{{base},"IPv6Network":"fc00::/48","IPv6SubnetLen":49}}"#
            )),
            "network must be able to accommodate at least four subnets"
        );
        assert_eq!(
            err(&format!(r#"{{{base},"IPv6Network":"fc00::/125"}}"#)),
            "IPv6Network is too small. Minimum useful network prefix is /124"
        );
        assert_eq!(
            check(&format!(r#"{{{base},"IPv6Network":"fc00::/63"}}"#))
                .unwrap()
                .ipv6
                .unwrap()
                .subnet_len,
            65
        );
        assert_eq!(
            err(&format!(
                r#"{{{base},"IPv6Network":"fc00::/48","IPv6SubnetMin":"fd00::"}}"#
            )),
            "IPv6SubnetMin is not in the range of the IPv6Network"
        );
        assert_eq!(
            err(&format!(
                r#"{{{base},"IPv6Network":"fc00::/48","IPv6SubnetMax":"fd00::"}}"#
            )),
            "IPv6SubnetMax is not in the range of the IPv6Network"
        );
        assert_eq!(
            err(&format!(
                r#"{{{base},"IPv6Network":"fc00::/48","IPv6SubnetMin":"fc00::1"}}"#
            )),
            "IPv6SubnetMin is not on a SubnetLen boundary: fc00::1"
        );
        assert_eq!(
            err(&format!(
                r#"{{{base},"IPv6Network":"fc00::/48","IPv6SubnetMax":"fc00::1"}}"#
            )),
            "IPv6SubnetMax is not on a SubnetLen boundary: fc00::1"
        );
        // `::` and null count as unset.
        let p = check(&format!(
            r#"{{{base},"IPv6Network":"fc00::/48","IPv6SubnetMin":"::","IPv6SubnetMax":null}}"#
        ))
        .unwrap()
        .ipv6
        .unwrap();
        assert_eq!(p.subnet_min.to_string(), "fc00:0:0:1::");
        // A whole-space network still computes (no overflow).
        let p = check(&format!(r#"{{{base},"IPv6Network":"8000::/1"}}"#))
            .unwrap()
            .ipv6
            .unwrap();
        assert_eq!(p.subnet_max.to_string(), "ffff:ffff:ffff:ffff::");
    }

    #[test]
    fn dual_stack() {
        let c = check(
            r#"{"Network":"10.42.0.0/16","IPv6Network":"2001:cafe:42::/56","EnableIPv6":true}"#,
        )
        .unwrap();
        assert_eq!(c.stack(), IpStack::Dual);
        assert_eq!(c.ipv6.unwrap().subnet_len, 64);
        assert_eq!(c.ipv4.unwrap().subnet_len, 24);
    }

    #[test]
    fn go_decoding_semantics() {
        let c = NetConfig::parse(r#"{"NETWORK":"10.3.1.5/16","network":"10.9.1.5/16","Unknown":[1,2],"enablenftables":true}"#).unwrap();
        assert_eq!(c.network, Some("10.9.0.0/16".parse().unwrap()));
        assert!(c.enable_ipv4 && !c.enable_ipv6 && c.enable_nftables);
        assert_eq!(c.backend_type, "udp");
        assert_eq!(c.backend, None);
        let c = NetConfig::parse("null").unwrap();
        assert_eq!(c, NetConfig::default());
    }

    #[test]
    fn backend_type_rules() {
        let c = NetConfig::parse(r#"{"Backend":{"type":"VXLAN","VNI":4, "Port" : 8472}}"#).unwrap();
        assert_eq!(c.backend_type, "VXLAN");
        assert_eq!(
            c.backend.unwrap().as_str(),
            r#"{"type":"VXLAN","VNI":4,"Port":8472}"#
        );
        let c = NetConfig::parse(r#"{"Backend":{"VNI":4}}"#).unwrap();
        assert_eq!(c.backend_type, "");
        let c = NetConfig::parse(r#"{"Backend":null}"#).unwrap();
        assert_eq!(c.backend_type, "");
        assert!(c.backend.unwrap().is_null());
        let e = NetConfig::parse(r#"{"Backend":"vxlan"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("error decoding Backend property of config: "),
            "{e}"
        );
        let e = NetConfig::parse(r#"{"Backend":{"Type":1}}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("error decoding Backend property of config: "),
            "{e}"
        );
    }

    #[test]
    fn parse_errors_name_field_and_value() {
        let cases = [
            (
                r#"{"Network":"fc00::/64"}"#,
                "invalid Network \"fc00::/64\": invalid IPv4 CIDR format",
            ),
            (
                r#"{"Network":"10.0.0.0/33"}"#,
                "invalid Network \"10.0.0.0/33\": invalid CIDR address: 10.0.0.0/33",
            ),
            (
                r#"{"Network":null}"#,
                "invalid Network null: null is not allowed",
            ),
            (
                r#"{"IPv6Network":"10.0.0.0/8"}"#,
                "invalid IPv6Network \"10.0.0.0/8\": invalid IPv6 CIDR format",
            ),
            (
                r#"{"SubnetMin":"fc00::"}"#,
                "invalid SubnetMin \"fc00::\": invalid IPv4 address format",
            ),
            (
                r#"{"SubnetMax":"x"}"#,
                "invalid SubnetMax \"x\": invalid IP address format",
            ),
            (
                r#"{"IPv6SubnetMin":"x"}"#,
                "invalid IPv6SubnetMin \"x\": invalid IPv6 address format",
            ),
            (
                r#"{"SubnetLen":-1}"#,
                "field \"SubnetLen\": cannot use -1 as uint",
            ),
            (
                r#"{"EnableIPv6":"true"}"#,
                "field \"EnableIPv6\": cannot use \"true\" as bool",
            ),
            (
                r#"{"Network":5}"#,
                "field \"Network\": cannot use 5 as string",
            ),
            ("[]", "cannot unmarshal array into an object"),
        ];
        for (json, want) in cases {
            assert_eq!(
                NetConfig::parse(json).unwrap_err().to_string(),
                want,
                "{json}"
            );
        }
        assert!(matches!(
            NetConfig::parse("{").unwrap_err(),
            ConfigError::Json(GoJsonError::Syntax(_))
        ));
    }

    #[test]
    fn pool_compatibility_and_candidates() {
        let p = v4pool(
            r#"{ "Network": "10.3.0.0/16", "SubnetMin": "10.3.1.0", "SubnetMax": "10.3.25.0" }"#,
        );
        assert!(p.is_compatible("10.3.1.0/24".parse().unwrap()));
        assert!(p.is_compatible("10.3.25.0/24".parse().unwrap()));
        assert!(!p.is_compatible("10.3.26.0/24".parse().unwrap()));
        assert!(!p.is_compatible("10.3.0.0/24".parse().unwrap()));
        assert!(!p.is_compatible("10.3.2.0/25".parse().unwrap()));
        let c: Vec<String> = p.candidates().map(|n| n.to_string()).collect();
        assert_eq!(c.len(), 25);
        assert_eq!(c[0], "10.3.1.0/24");
        assert_eq!(c[24], "10.3.25.0/24");
        // The last subnet of the address space does not wrap.
        let p = v4pool(r#"{ "Network": "255.255.0.0/16" }"#);
        assert_eq!(
            p.candidates().last().unwrap().to_string(),
            "255.255.255.0/24"
        );
    }

    #[test]
    fn never_panics_on_random_input() {
        let mut accepted = 0u32;
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let seeds = [
            r#"{ "Network": "10.3.0.0/16", "SubnetMin": "10.3.5.0", "SubnetMax": "10.3.8.0", "SubnetLen": 28, "Backend": {"Type": "vxlan"} }"#,
            r#"{ "EnableIPv6": true, "IPv6Network": "fc00::/48", "IPv6SubnetMin": "fc00:0:0:1::", "IPv6SubnetLen": 124, "enableIPv4": false }"#,
            "{}",
            "",
            "null",
        ];
        let alphabet: Vec<char> =
            "{}[]\":,0123456789abcdef./-:xnulltrue \\\u{e9}NetworkSubnetLenMinMaxIPv6Backend"
                .chars()
                .collect();
        let mut rng = StdRng::seed_from_u64(0x5eed_c0f1);
        for i in 0..4000 {
            let input = if i % 2 == 0 {
                let mut s: Vec<char> = seeds[i % seeds.len()].chars().collect();
                for _ in 0..rng.random_range(1..6) {
                    let pos = rng.random_range(0..=s.len());
                    match rng.random_range(0..3) {
                        0 if pos < s.len() => {
                            s.remove(pos);
                        }
                        1 if pos < s.len() => {
                            s[pos] = alphabet[rng.random_range(0..alphabet.len())]
                        }
                        _ => s.insert(pos, alphabet[rng.random_range(0..alphabet.len())]),
                    }
                }
                s.into_iter().collect::<String>()
            } else {
                let n = rng.random_range(0..40);
                (0..n)
                    .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                    .collect()
            };
            if let Ok(checked) = NetConfig::parse(&input).and_then(|cfg| cfg.check()) {
                accepted += 1;
                if let Some(p) = checked.ipv4 {
                    assert!(ip::contains_addr(p.network, p.subnet_min), "{input}");
                    assert!(p.subnet_len <= 30);
                }
                if let Some(p) = checked.ipv6 {
                    assert!(ip::contains_addr(p.network, p.subnet_max), "{input}");
                    assert!(p.subnet_len <= 126);
                }
            }
        }
        // The mutations must exercise the accepting paths too, not only the errors.
        assert!(accepted >= 30, "only {accepted} inputs accepted");
    }
}
