//! The plugin's network configuration (stdin), as upstream's `NetConf`.
//!
//! ```json
//! {"cniVersion":"0.3.1","name":"cbr0","type":"flannel",
//!  "subnetFile":"/run/flannel/subnet.env","dataDir":"/var/lib/cni/flannel",
//!  "delegate":{"hairpinMode":true,"isDefaultGateway":true},
//!  "ipam":{...},"runtimeConfig":{...},"prevResult":{...}}
//! ```

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::cni::{CniError, code, is_valid_name};

/// `subnetFile` when the config does not name one.
pub const DEFAULT_SUBNET_FILE: &str = "/run/flannel/subnet.env";
/// `dataDir` when the config does not name one.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/cni/flannel";

/// A JSON object (keys in input order).
pub type Object = Map<String, Value>;

/// Errors in the network configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON, or a field of the wrong JSON type.
    #[error("failed to load netconf: {0}")]
    Decode(#[source] serde_json::Error),
    /// `delegate.type` present but not a string.
    #[error("'delegate' dictionary, if present, must have (string) 'type' field")]
    DelegateType,
    /// `delegate.name` present.
    #[error("'delegate' dictionary must not have 'name' field, it'll be set by flannel")]
    DelegateName,
    /// `delegate.ipam` present.
    #[error("'delegate' dictionary must not have 'ipam' field, it'll be set by flannel")]
    DelegateIpam,
    /// `ipam.routes` is not a list of routes.
    #[error(
        "failed to assemble Delegate IPAM: failed to read IPAM routes: failed to parse ipam.routes: {0}"
    )]
    IpamRoutes(String),
}

impl ConfigError {
    /// The CNI error code: 6 for JSON that cannot be decoded, 7 for a rejected config.
    pub fn code(&self) -> u32 {
        match self {
            ConfigError::Decode(_) => code::DECODING_FAILURE,
            _ => code::INVALID_NETWORK_CONFIG,
        }
    }
}

impl From<ConfigError> for CniError {
    fn from(err: ConfigError) -> Self {
        CniError::new(err.code(), err.to_string())
    }
}

/// What every command checks first (as the reference skeleton does): the config is a JSON
/// object with a valid `name`; returns the `cniVersion`, `0.1.0` when absent.
pub fn check_header(data: &[u8]) -> Result<String, CniError> {
    #[derive(Deserialize)]
    struct Header {
        #[serde(default)]
        name: Option<String>,
    }
    #[derive(Deserialize)]
    struct Version {
        #[serde(default, rename = "cniVersion")]
        cni_version: Option<String>,
    }
    let header: Header = serde_json::from_slice(data).map_err(|e| {
        CniError::new(
            code::DECODING_FAILURE,
            format!("error unmarshall network config: {e}"),
        )
    })?;
    let name = header.name.unwrap_or_default();
    if name.is_empty() {
        return Err(CniError::new(
            code::INVALID_NETWORK_CONFIG,
            "missing network name",
        ));
    }
    if !is_valid_name(&name) {
        return Err(CniError::new(
            code::INVALID_NETWORK_CONFIG,
            "invalid characters found in network name",
        )
        .with_details(name));
    }
    let version: Version = serde_json::from_slice(data).map_err(|e| {
        CniError::new(
            code::DECODING_FAILURE,
            format!("decoding version from network config: {e}"),
        )
    })?;
    Ok(match version.cni_version {
        Some(v) if !v.is_empty() => v,
        _ => "0.1.0".to_owned(),
    })
}

#[derive(Deserialize)]
struct RawNetConf {
    #[serde(default, rename = "cniVersion")]
    cni_version: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default, rename = "subnetFile")]
    subnet_file: Option<String>,
    #[serde(default, rename = "dataDir")]
    data_dir: Option<String>,
    #[serde(default)]
    delegate: Option<Object>,
    #[serde(default)]
    ipam: Option<Object>,
    #[serde(default, rename = "runtimeConfig")]
    runtime_config: Option<Object>,
    #[serde(default, rename = "prevResult")]
    prev_result: Option<Object>,
}

/// The parsed network configuration. Unknown keys are ignored; `null` counts as absent.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    /// `cniVersion` as given (may be empty).
    pub cni_version: String,
    /// `name`, copied into the delegate.
    pub name: String,
    /// `subnetFile` (default [`DEFAULT_SUBNET_FILE`]; an empty string also means the default).
    pub subnet_file: PathBuf,
    /// `dataDir` (default [`DEFAULT_DATA_DIR`]; an empty string also means the default).
    pub data_dir: PathBuf,
    /// `delegate`: the base of the delegate plugin's config.
    pub delegate: Option<Object>,
    /// `ipam`: the base of the delegate's ipam section.
    pub ipam: Option<Object>,
    /// `runtimeConfig`, copied into the delegate.
    pub runtime_config: Option<Object>,
    /// `prevResult` (a chained plugin's input), passed to the delegate's CHECK.
    pub prev_result: Option<Object>,
}

impl NetConf {
    /// Decodes the configuration.
    pub fn parse(data: &[u8]) -> Result<Self, ConfigError> {
        let raw: RawNetConf = serde_json::from_slice(data).map_err(ConfigError::Decode)?;
        let path_or = |value: Option<String>, default: &str| {
            PathBuf::from(match value {
                Some(v) if !v.is_empty() => v,
                _ => default.to_owned(),
            })
        };
        Ok(NetConf {
            cni_version: raw.cni_version.unwrap_or_default(),
            name: raw.name.unwrap_or_default(),
            subnet_file: path_or(raw.subnet_file, DEFAULT_SUBNET_FILE),
            data_dir: path_or(raw.data_dir, DEFAULT_DATA_DIR),
            delegate: raw.delegate,
            ipam: raw.ipam,
            runtime_config: raw.runtime_config,
            prev_result: raw.prev_result,
        })
    }

    /// Upstream's checks on `delegate`: `type`, if present, is a string; no `name`; no `ipam`.
    pub fn validate_delegate(&self) -> Result<(), ConfigError> {
        let Some(delegate) = &self.delegate else {
            return Ok(());
        };
        if delegate.get("type").is_some_and(|t| !t.is_string()) {
            return Err(ConfigError::DelegateType);
        }
        if delegate.contains_key("name") {
            return Err(ConfigError::DelegateName);
        }
        if delegate.contains_key("ipam") {
            return Err(ConfigError::DelegateIpam);
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn conf(json: &str) -> NetConf {
        NetConf::parse(json.as_bytes()).unwrap()
    }

    #[test]
    fn defaults() {
        let c = conf(r#"{"name":"cbr0","type":"flannel"}"#);
        assert_eq!(c.subnet_file, PathBuf::from("/run/flannel/subnet.env"));
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/cni/flannel"));
        assert_eq!(c.cni_version, "");
        assert!(c.delegate.is_none() && c.ipam.is_none() && c.runtime_config.is_none());
        let c = conf(r#"{"name":"n","subnetFile":"","dataDir":null,"delegate":null}"#);
        assert_eq!(c.subnet_file, PathBuf::from(DEFAULT_SUBNET_FILE));
        assert_eq!(c.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert!(c.delegate.is_none());
    }

    #[test]
    fn fields_are_read() {
        let c = conf(
            r#"{"cniVersion":"0.3.1","name":"cbr0","type":"flannel","subnetFile":"/tmp/s.env",
                "dataDir":"/tmp/d","delegate":{"hairpinMode":true},"ipam":{"type":"x"},
                "runtimeConfig":{"a":1},"prevResult":{"cniVersion":"0.3.1"},"unknown":[1]}"#,
        );
        assert_eq!(c.cni_version, "0.3.1");
        assert_eq!(c.subnet_file, PathBuf::from("/tmp/s.env"));
        assert_eq!(c.data_dir, PathBuf::from("/tmp/d"));
        assert_eq!(c.delegate.unwrap()["hairpinMode"], Value::Bool(true));
        assert_eq!(c.ipam.unwrap()["type"], "x");
        assert_eq!(c.runtime_config.unwrap()["a"], 1);
        assert!(c.prev_result.is_some());
    }

    #[test]
    fn wrong_types_are_decoding_failures() {
        for bad in [
            r#"{"name":"n","subnetFile":5}"#,
            r#"{"name":"n","delegate":"bridge"}"#,
            r#"{"name":"n","ipam":[]}"#,
            r#"{"name":"n""#,
        ] {
            let err = NetConf::parse(bad.as_bytes()).unwrap_err();
            assert_eq!(err.code(), 6, "{bad}");
            assert!(
                err.to_string().starts_with("failed to load netconf: "),
                "{err}"
            );
        }
    }

    #[test]
    fn delegate_validation_messages() {
        let check = |json: &str| {
            conf(json)
                .validate_delegate()
                .map_err(|e| (e.code(), e.to_string()))
        };
        assert!(check(r#"{"name":"n"}"#).is_ok());
        assert!(check(r#"{"name":"n","delegate":{"type":"ipvlan","mtu":1}}"#).is_ok());
        assert_eq!(
            check(r#"{"name":"n","delegate":{"type":5}}"#),
            Err((
                7,
                "'delegate' dictionary, if present, must have (string) 'type' field".to_owned()
            ))
        );
        assert_eq!(
            check(r#"{"name":"n","delegate":{"type":null}}"#)
                .unwrap_err()
                .0,
            7
        );
        assert_eq!(
            check(r#"{"name":"n","delegate":{"name":"x"}}"#),
            Err((
                7,
                "'delegate' dictionary must not have 'name' field, it'll be set by flannel"
                    .to_owned()
            ))
        );
        assert_eq!(
            check(r#"{"name":"n","delegate":{"ipam":{}}}"#),
            Err((
                7,
                "'delegate' dictionary must not have 'ipam' field, it'll be set by flannel"
                    .to_owned()
            ))
        );
    }

    #[test]
    fn header_checks() {
        assert_eq!(check_header(br#"{"name":"cbr0"}"#).unwrap(), "0.1.0");
        assert_eq!(
            check_header(br#"{"name":"cbr0","cniVersion":"1.0.0"}"#).unwrap(),
            "1.0.0"
        );
        let e = check_header(b"not json").unwrap_err();
        assert_eq!(e.code, 6);
        assert!(
            e.msg.starts_with("error unmarshall network config: "),
            "{}",
            e.msg
        );
        assert_eq!(check_header(b"[1]").unwrap_err().code, 6);
        assert_eq!(check_header(br#"{"name":7}"#).unwrap_err().code, 6);
        let e = check_header(br#"{"type":"flannel"}"#).unwrap_err();
        assert_eq!((e.code, e.msg.as_str()), (7, "missing network name"));
        let e = check_header(br#"{"name":"a b"}"#).unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str(), e.details.as_str()),
            (7, "invalid characters found in network name", "a b")
        );
        let e = check_header(br#"{"name":"n","cniVersion":1}"#).unwrap_err();
        assert_eq!(e.code, 6);
        assert!(e.msg.starts_with("decoding version from network config: "));
    }
}
