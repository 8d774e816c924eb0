//! Per-backend options parsed from the raw `Backend` JSON of the network config, with
//! upstream's defaults and key matching (case-insensitive, unknown keys ignored, `null` or an
//! absent `Backend` meaning "all defaults").
//!
//! Validation is stricter than upstream where upstream accepts values that can only break
//! (documented per field): out-of-range ports and VNIs, negative MTUs, `"MTU": 0`.

use std::fmt;

use serde_json::value::RawValue;

use super::data::WgKey;
use super::{BackendError, BackendType};
use crate::gojson::{self, GoJsonError, GoObject, RawJson};
use crate::netconf::NetConfig;

/// A value that must not appear in logs (`Debug` prints `<redacted>`).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret<T>(T);

impl<T> Secret<T> {
    /// Wraps a secret value.
    pub fn new(value: T) -> Self {
        Secret(value)
    }

    /// The secret value.
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl<T> fmt::Debug for Secret<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The default VXLAN network identifier.
pub const DEFAULT_VNI: u32 = 1;
/// The UDP port the kernel uses for VXLAN when none is configured (`Port` 0).
pub const VXLAN_KERNEL_DEFAULT_PORT: u16 = 8472;
/// The default UDP backend port.
pub const DEFAULT_UDP_PORT: u16 = 8285;
/// The default WireGuard port of the IPv4 (or single) device.
pub const DEFAULT_WG_PORT: u16 = 51820;
/// The default WireGuard port of the IPv6 device in `separate` mode.
pub const DEFAULT_WG_PORT_V6: u16 = 51821;
/// The default IPsec ESP proposal.
pub const DEFAULT_ESP_PROPOSAL: &str = "aes128gcm16-sha256-prfsha256-ecp256";
/// The shortest accepted IPsec pre-shared key, in bytes.
pub const MIN_IPSEC_PSK_LEN: usize = 96;

/// VXLAN options (§2.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanOptions {
    /// `VNI` (default 1), also the device name suffix; 0..=16777215.
    pub vni: u32,
    /// `Port`; 0 leaves the kernel default ([`VXLAN_KERNEL_DEFAULT_PORT`]).
    pub port: u16,
    /// `GBP`: VXLAN Group Based Policy.
    pub gbp: bool,
    /// `Learning`: kernel MAC learning.
    pub learning: bool,
    /// `DirectRouting`: plain routes to peers on the same L2 segment.
    pub direct_routing: bool,
    /// `MTU`: the underlay MTU to assume (default: the external interface's). `0` counts as
    /// unset (upstream would configure a negative device MTU).
    pub mtu: Option<u32>,
    /// `MacPrefix`: Windows only, kept for completeness and ignored on Linux.
    pub mac_prefix: Option<String>,
}

impl Default for VxlanOptions {
    fn default() -> Self {
        VxlanOptions {
            vni: DEFAULT_VNI,
            port: 0,
            gbp: false,
            learning: false,
            direct_routing: false,
            mtu: None,
            mac_prefix: None,
        }
    }
}

impl VxlanOptions {
    /// The IPv4 device name, `flannel.<VNI>`.
    pub fn device_name(&self) -> String {
        format!("flannel.{}", self.vni)
    }

    /// The IPv6 device name, `flannel-v6.<VNI>`.
    pub fn v6_device_name(&self) -> String {
        format!("flannel-v6.{}", self.vni)
    }

    /// The UDP port actually used on the wire.
    pub fn effective_port(&self) -> u16 {
        if self.port == 0 {
            VXLAN_KERNEL_DEFAULT_PORT
        } else {
            self.port
        }
    }
}

/// IPIP options (§2.3).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpipOptions {
    /// `DirectRouting`: route same-subnet peers directly instead of through the tunnel.
    pub direct_routing: bool,
}

/// UDP backend options (§2.5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpOptions {
    /// `Port` (default 8285); 1..=65535 (upstream accepts 0, which cannot work).
    pub port: u16,
}

impl Default for UdpOptions {
    fn default() -> Self {
        UdpOptions {
            port: DEFAULT_UDP_PORT,
        }
    }
}

/// IPsec options (§2.6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpsecOptions {
    /// `PSK`: the IKE pre-shared key, at least [`MIN_IPSEC_PSK_LEN`] bytes.
    pub psk: Secret<String>,
    /// `UDPEncap`: force UDP encapsulation of ESP.
    pub udp_encap: bool,
    /// `ESPProposal` (an empty string counts as unset).
    pub esp_proposal: String,
}

/// WireGuard device layout (`Mode`, §2.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WireguardMode {
    /// `separate`: `flannel-wg` for IPv4 and `flannel-wg-v6` for IPv6.
    #[default]
    Separate,
    /// `auto`: one device; endpoint family chosen per peer.
    Auto,
    /// `ipv4`: one device, IPv4 endpoints.
    Ipv4,
    /// `ipv6`: one device, IPv6 endpoints.
    Ipv6,
}

impl WireguardMode {
    /// Upstream's exact (case-sensitive) mode names.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "separate" => Some(WireguardMode::Separate),
            "auto" => Some(WireguardMode::Auto),
            "ipv4" => Some(WireguardMode::Ipv4),
            "ipv6" => Some(WireguardMode::Ipv6),
            _ => None,
        }
    }
}

/// WireGuard options (§2.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireguardOptions {
    /// `ListenPort` (default 51820); 1..=65535.
    pub listen_port: u16,
    /// `ListenPortV6` (default 51821); 1..=65535.
    pub listen_port_v6: u16,
    /// `MTU`: the underlay MTU to assume (default: the external interface's); 0 = unset.
    pub mtu: Option<u32>,
    /// `PSK`: base64 of 32 bytes.
    pub psk: Option<Secret<WgKey>>,
    /// `PersistentKeepaliveInterval` in seconds (a JSON number, as upstream reads it);
    /// 0 disables it. 0..=65535.
    pub persistent_keepalive_interval: u16,
    /// `Mode`.
    pub mode: WireguardMode,
}

impl Default for WireguardOptions {
    fn default() -> Self {
        WireguardOptions {
            listen_port: DEFAULT_WG_PORT,
            listen_port_v6: DEFAULT_WG_PORT_V6,
            mtu: None,
            psk: None,
            persistent_keepalive_interval: 0,
            mode: WireguardMode::Separate,
        }
    }
}

/// extension options (§2.8): commands, each split on whitespace and run without a shell
/// (`crate::extension`). `None`: not configured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtensionOptions {
    /// `PreStartupCommand`: run before the lease; its output becomes the lease's BackendData.
    pub pre_startup_command: Option<String>,
    /// `PostStartupCommand`: run once the lease is held.
    pub post_startup_command: Option<String>,
    /// `SubnetAddCommand`: run for every remote lease that appears or changes.
    pub subnet_add_command: Option<String>,
    /// `SubnetRemoveCommand`: run for every remote lease that goes away or changes.
    pub subnet_remove_command: Option<String>,
}

/// A backend with its options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendOptions {
    /// vxlan
    Vxlan(VxlanOptions),
    /// host-gw (no options)
    HostGw,
    /// udp
    Udp(UdpOptions),
    /// ipip
    Ipip(IpipOptions),
    /// ipsec
    Ipsec(IpsecOptions),
    /// wireguard
    Wireguard(WireguardOptions),
    /// alloc (no options)
    Alloc,
    /// extension
    Extension(ExtensionOptions),
}

/// Errors parsing backend options.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    /// The backend type itself is unknown or unsupported.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The options object is malformed or a field has the wrong JSON type.
    #[error("{}: {source}", decode_prefix(*backend))]
    Decode {
        /// The backend whose options were decoded.
        backend: BackendType,
        /// What was wrong.
        source: GoJsonError,
    },
    /// A field has a value outside its range.
    #[error("invalid {backend} option {field}={value}: {reason}")]
    Invalid {
        /// The backend.
        backend: BackendType,
        /// The option name.
        field: &'static str,
        /// The JSON text of the value.
        value: String,
        /// The accepted range or form.
        reason: String,
    },
    /// IPsec `PSK` shorter than [`MIN_IPSEC_PSK_LEN`].
    #[error("config error, password is too short")]
    PskTooShort,
    /// WireGuard `PSK` is not base64 of 32 bytes.
    #[error("could not parse psk: {0}")]
    InvalidPsk(String),
    /// WireGuard `Mode` is not one of the four names.
    #[error("no valid Mode configured")]
    InvalidMode,
}

/// Upstream's per-backend prefix of option decoding errors.
fn decode_prefix(backend: BackendType) -> &'static str {
    match backend {
        BackendType::Vxlan => "error decoding VXLAN backend config",
        BackendType::Wireguard => "error decoding backend config",
        BackendType::Ipsec => "error decoding IPSEC backend config",
        BackendType::Udp => "error decoding UDP backend config",
        BackendType::Ipip => "error decoding IPIP backend config",
        BackendType::HostGw | BackendType::Alloc | BackendType::Extension => {
            "error decoding backend config"
        }
    }
}

impl BackendOptions {
    /// The backend and options of a parsed network config.
    pub fn from_config(config: &NetConfig) -> Result<Self, OptionsError> {
        Self::parse(&config.backend_type, config.backend.as_ref())
    }

    /// Parses the options of backend `backend_type` (any case) from the raw `Backend` JSON.
    pub fn parse(backend_type: &str, raw: Option<&RawJson>) -> Result<Self, OptionsError> {
        let backend = BackendType::parse(backend_type)?;
        let obj = match raw {
            Some(r) => GoObject::from_raw(r.as_raw())
                .map_err(|source| OptionsError::Decode { backend, source })?,
            None => None,
        };
        let fields = Fields { backend, obj };
        Ok(match backend {
            BackendType::Vxlan => BackendOptions::Vxlan(fields.vxlan()?),
            BackendType::HostGw => BackendOptions::HostGw,
            BackendType::Udp => BackendOptions::Udp(fields.udp()?),
            BackendType::Ipip => BackendOptions::Ipip(fields.ipip()?),
            BackendType::Ipsec => BackendOptions::Ipsec(fields.ipsec()?),
            BackendType::Wireguard => BackendOptions::Wireguard(fields.wireguard()?),
            BackendType::Alloc => BackendOptions::Alloc,
            BackendType::Extension => BackendOptions::Extension(fields.extension()?),
        })
    }

    /// The backend these options belong to.
    pub fn backend_type(&self) -> BackendType {
        match self {
            BackendOptions::Vxlan(_) => BackendType::Vxlan,
            BackendOptions::HostGw => BackendType::HostGw,
            BackendOptions::Udp(_) => BackendType::Udp,
            BackendOptions::Ipip(_) => BackendType::Ipip,
            BackendOptions::Ipsec(_) => BackendType::Ipsec,
            BackendOptions::Wireguard(_) => BackendType::Wireguard,
            BackendOptions::Alloc => BackendType::Alloc,
            BackendOptions::Extension(_) => BackendType::Extension,
        }
    }
}

/// The options object of one backend, with typed accessors that map errors.
struct Fields<'a> {
    backend: BackendType,
    obj: Option<GoObject<'a>>,
}

impl Fields<'_> {
    fn get<T>(
        &self,
        field: &'static str,
        decode: impl Fn(&str, &RawValue) -> Result<Option<T>, GoJsonError>,
    ) -> Result<Option<(T, String)>, OptionsError> {
        let Some(obj) = &self.obj else {
            return Ok(None);
        };
        let mut out = None;
        for raw in obj.values(field) {
            let value = decode(field, raw).map_err(|source| OptionsError::Decode {
                backend: self.backend,
                source,
            })?;
            if let Some(v) = value {
                out = Some((v, raw.get().to_owned()));
            }
        }
        Ok(out)
    }

    fn boolean(&self, field: &'static str) -> Result<Option<bool>, OptionsError> {
        Ok(self.get(field, gojson::boolean)?.map(|(v, _)| v))
    }

    fn string(&self, field: &'static str) -> Result<Option<String>, OptionsError> {
        Ok(self.get(field, gojson::string)?.map(|(v, _)| v))
    }

    /// A Go `int` field checked against `lo..=hi`.
    fn int_in(&self, field: &'static str, lo: i64, hi: i64) -> Result<Option<i64>, OptionsError> {
        match self.get(field, gojson::int)? {
            None => Ok(None),
            Some((v, _)) if (lo..=hi).contains(&v) => Ok(Some(v)),
            Some((_, text)) => Err(OptionsError::Invalid {
                backend: self.backend,
                field,
                value: text,
                reason: format!("must be between {lo} and {hi}"),
            }),
        }
    }

    fn port(&self, field: &'static str, lo: i64) -> Result<Option<u16>, OptionsError> {
        Ok(self
            .int_in(field, lo, i64::from(u16::MAX))?
            .and_then(|v| u16::try_from(v).ok()))
    }

    /// `MTU`: 0 = unset; otherwise 68..=65535 would be checked by the MTU arithmetic, here only
    /// non-negative and fitting.
    fn mtu(&self) -> Result<Option<u32>, OptionsError> {
        Ok(self
            .int_in("MTU", 0, i64::from(u16::MAX))?
            .and_then(|v| u32::try_from(v).ok())
            .filter(|v| *v != 0))
    }

    fn vxlan(&self) -> Result<VxlanOptions, OptionsError> {
        let d = VxlanOptions::default();
        Ok(VxlanOptions {
            vni: self
                .int_in("VNI", 0, (1 << 24) - 1)?
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(d.vni),
            port: self.port("Port", 0)?.unwrap_or(d.port),
            gbp: self.boolean("GBP")?.unwrap_or(d.gbp),
            learning: self.boolean("Learning")?.unwrap_or(d.learning),
            direct_routing: self.boolean("DirectRouting")?.unwrap_or(d.direct_routing),
            mtu: self.mtu()?,
            mac_prefix: self.string("MacPrefix")?,
        })
    }

    fn ipip(&self) -> Result<IpipOptions, OptionsError> {
        Ok(IpipOptions {
            direct_routing: self.boolean("DirectRouting")?.unwrap_or(false),
        })
    }

    fn udp(&self) -> Result<UdpOptions, OptionsError> {
        Ok(UdpOptions {
            port: self.port("Port", 1)?.unwrap_or(DEFAULT_UDP_PORT),
        })
    }

    fn ipsec(&self) -> Result<IpsecOptions, OptionsError> {
        let psk = self.string("PSK")?.unwrap_or_default();
        if psk.len() < MIN_IPSEC_PSK_LEN {
            return Err(OptionsError::PskTooShort);
        }
        Ok(IpsecOptions {
            psk: Secret::new(psk),
            udp_encap: self.boolean("UDPEncap")?.unwrap_or(false),
            esp_proposal: self
                .string("ESPProposal")?
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| DEFAULT_ESP_PROPOSAL.to_owned()),
        })
    }

    /// An empty command is no command, as upstream (`len(cmd) > 0`); one of only spaces
    /// would make upstream index an empty argument list and panic: refused here.
    fn command(&self, field: &'static str) -> Result<Option<String>, OptionsError> {
        match self.get(field, gojson::string)? {
            None => Ok(None),
            Some((s, _)) if s.is_empty() => Ok(None),
            Some((s, text)) if s.split_whitespace().next().is_none() => {
                Err(OptionsError::Invalid {
                    backend: self.backend,
                    field,
                    value: text,
                    reason: "a command needs a program name".into(),
                })
            }
            Some((s, _)) => Ok(Some(s)),
        }
    }

    fn extension(&self) -> Result<ExtensionOptions, OptionsError> {
        Ok(ExtensionOptions {
            pre_startup_command: self.command("PreStartupCommand")?,
            post_startup_command: self.command("PostStartupCommand")?,
            subnet_add_command: self.command("SubnetAddCommand")?,
            subnet_remove_command: self.command("SubnetRemoveCommand")?,
        })
    }

    fn wireguard(&self) -> Result<WireguardOptions, OptionsError> {
        let d = WireguardOptions::default();
        let psk = match self.string("PSK")?.filter(|s| !s.is_empty()) {
            None => None,
            Some(s) => Some(Secret::new(
                s.parse::<WgKey>()
                    .map_err(|e| OptionsError::InvalidPsk(e.to_string()))?,
            )),
        };
        let mode = match self.string("Mode")? {
            None => d.mode,
            Some(m) => WireguardMode::parse(&m).ok_or(OptionsError::InvalidMode)?,
        };
        Ok(WireguardOptions {
            listen_port: self.port("ListenPort", 1)?.unwrap_or(d.listen_port),
            listen_port_v6: self.port("ListenPortV6", 1)?.unwrap_or(d.listen_port_v6),
            mtu: self.mtu()?,
            psk,
            persistent_keepalive_interval: self
                .int_in("PersistentKeepaliveInterval", 0, i64::from(u16::MAX))?
                .and_then(|v| u16::try_from(v).ok())
                .unwrap_or(0),
            mode,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn parse(t: &str, json: &str) -> Result<BackendOptions, OptionsError> {
        let raw = RawJson::from_json(json).unwrap();
        BackendOptions::parse(t, Some(&raw))
    }

    fn vxlan(json: &str) -> VxlanOptions {
        match parse("vxlan", json).unwrap() {
            BackendOptions::Vxlan(o) => o,
            other => panic!("{other:?}"),
        }
    }

    fn wg(json: &str) -> WireguardOptions {
        match parse("wireguard", json).unwrap() {
            BackendOptions::Wireguard(o) => o,
            other => panic!("{other:?}"),
        }
    }

    const PSK32: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";

    #[test]
    fn vxlan_defaults_and_fields() {
        let d = vxlan(r#"{"Type":"vxlan"}"#);
        assert_eq!(d, VxlanOptions::default());
        assert_eq!((d.vni, d.port, d.effective_port()), (1, 0, 8472));
        assert_eq!(d.device_name(), "flannel.1");
        assert_eq!(d.v6_device_name(), "flannel-v6.1");
        let o = vxlan(
            r#"{"Type":"vxlan","vni":4096,"PORT":4789,"gbp":true,"Learning":true,"directrouting":true,"MTU":9000,"MacPrefix":"0E-2A","Name":"x"}"#,
        );
        assert_eq!(
            o,
            VxlanOptions {
                vni: 4096,
                port: 4789,
                gbp: true,
                learning: true,
                direct_routing: true,
                mtu: Some(9000),
                mac_prefix: Some("0E-2A".into()),
            }
        );
        assert_eq!(o.device_name(), "flannel.4096");
        assert_eq!(vxlan(r#"{"MTU":0}"#).mtu, None);
        // No Backend at all, or null: defaults.
        assert_eq!(
            BackendOptions::parse("VXLAN", None).unwrap(),
            BackendOptions::Vxlan(VxlanOptions::default())
        );
        assert_eq!(vxlan("null"), VxlanOptions::default());
        // Upstream fuzz seeds.
        assert_eq!(vxlan(r#"{"VNI":1,"Port":8472}"#).port, 8472);
        let o = vxlan(r#"{"MTU":1400,"GBP":true,"DirectRouting":true}"#);
        assert!(o.gbp && o.direct_routing && o.mtu == Some(1400));
    }

    #[test]
    fn vxlan_errors() {
        let e = |json: &str| parse("vxlan", json).unwrap_err().to_string();
        assert_eq!(
            e(r#"{"VNI":"1"}"#),
            "error decoding VXLAN backend config: field \"VNI\": cannot use \"1\" as int"
        );
        assert_eq!(
            e(r#"{"VNI":16777216}"#),
            "invalid vxlan option VNI=16777216: must be between 0 and 16777215"
        );
        assert_eq!(
            e(r#"{"Port":-1}"#),
            "invalid vxlan option Port=-1: must be between 0 and 65535"
        );
        assert_eq!(
            e(r#"{"MTU":-5}"#),
            "invalid vxlan option MTU=-5: must be between 0 and 65535"
        );
        assert_eq!(
            e(r#"{"GBP":1}"#),
            "error decoding VXLAN backend config: field \"GBP\": cannot use 1 as bool"
        );
        assert_eq!(
            e("[1]"),
            "error decoding VXLAN backend config: cannot unmarshal array into an object"
        );
    }

    #[test]
    fn wireguard_defaults_and_fields() {
        let d = wg("{}");
        assert_eq!(d, WireguardOptions::default());
        assert_eq!(
            (d.listen_port, d.listen_port_v6, d.mode),
            (51820, 51821, WireguardMode::Separate)
        );
        let o = wg(&format!(
            r#"{{"Type":"wireguard","ListenPort":51830,"listenportv6":51831,"MTU":1420,"PSK":"{PSK32}","PersistentKeepaliveInterval":25,"Mode":"auto"}}"#
        ));
        assert_eq!(o.listen_port, 51830);
        assert_eq!(o.listen_port_v6, 51831);
        assert_eq!(o.mtu, Some(1420));
        assert_eq!(o.psk.as_ref().unwrap().expose().to_string(), PSK32);
        assert_eq!(o.persistent_keepalive_interval, 25);
        assert_eq!(o.mode, WireguardMode::Auto);
        assert!(!format!("{o:?}").contains(PSK32));
        for (m, want) in [
            ("ipv4", WireguardMode::Ipv4),
            ("ipv6", WireguardMode::Ipv6),
            ("separate", WireguardMode::Separate),
        ] {
            assert_eq!(wg(&format!(r#"{{"Mode":"{m}"}}"#)).mode, want);
        }
    }

    #[test]
    fn wireguard_errors() {
        let e = |json: &str| parse("wireguard", json).unwrap_err().to_string();
        assert_eq!(e(r#"{"Mode":"Separate"}"#), "no valid Mode configured");
        assert_eq!(
            e(r#"{"PSK":"notbase64!"}"#).split(':').next(),
            Some("could not parse psk")
        );
        assert!(e(r#"{"PSK":"YWJj"}"#).starts_with("could not parse psk: "));
        assert_eq!(
            e(r#"{"ListenPort":0}"#),
            "invalid wireguard option ListenPort=0: must be between 1 and 65535"
        );
        assert_eq!(
            e(r#"{"PersistentKeepaliveInterval":"25s"}"#),
            "error decoding backend config: field \"PersistentKeepaliveInterval\": cannot use \"25s\" as int"
        );
    }

    #[test]
    fn other_backends() {
        assert_eq!(
            parse("udp", "{}").unwrap(),
            BackendOptions::Udp(UdpOptions { port: 8285 })
        );
        assert_eq!(
            parse("udp", r#"{"port":9000}"#).unwrap(),
            BackendOptions::Udp(UdpOptions { port: 9000 })
        );
        assert_eq!(
            parse("udp", r#"{"Port":true}"#).unwrap_err().to_string(),
            "error decoding UDP backend config: field \"Port\": cannot use true as int"
        );
        assert_eq!(
            parse("ipip", r#"{"DirectRouting":true}"#).unwrap(),
            BackendOptions::Ipip(IpipOptions {
                direct_routing: true
            })
        );
        assert_eq!(
            parse("ipip", r#"{"DirectRouting":"yes"}"#)
                .unwrap_err()
                .to_string(),
            "error decoding IPIP backend config: field \"DirectRouting\": cannot use \"yes\" as bool"
        );
        assert_eq!(
            parse("host-gw", r#"{"anything":1}"#).unwrap(),
            BackendOptions::HostGw
        );
        assert_eq!(parse("alloc", "{}").unwrap(), BackendOptions::Alloc);
        assert_eq!(
            parse("host-gw", "{}").unwrap().backend_type(),
            BackendType::HostGw
        );
        assert_eq!(
            parse("gre", "{}").unwrap_err().to_string(),
            "unknown backend type: gre"
        );
    }

    #[test]
    fn extension_commands() {
        let ext = |json: &str| match parse("extension", json) {
            Ok(BackendOptions::Extension(o)) => Ok(o),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(ext("{}"), Ok(ExtensionOptions::default()));
        assert_eq!(
            ext(
                r#"{"subnetaddcommand":"ip route replace $SUBNET via $PUBLIC_IP","PreStartupCommand":"","SubnetRemoveCommand":null}"#
            ),
            Ok(ExtensionOptions {
                subnet_add_command: Some("ip route replace $SUBNET via $PUBLIC_IP".into()),
                ..ExtensionOptions::default()
            })
        );
        assert_eq!(
            ext(r#"{"PostStartupCommand":"  "}"#),
            Err(r#"invalid extension option PostStartupCommand="  ": a command needs a program name"#.into())
        );
        assert_eq!(
            ext(r#"{"SubnetAddCommand":7}"#),
            Err(r#"error decoding backend config: field "SubnetAddCommand": cannot use 7 as string"#.into())
        );
    }

    #[test]
    fn ipsec_options() {
        let long = "a".repeat(96);
        let o = parse("ipsec", &format!(r#"{{"PSK":"{long}","UDPEncap":true}}"#)).unwrap();
        let BackendOptions::Ipsec(o) = o else {
            panic!()
        };
        assert_eq!(o.psk.expose(), &long);
        assert!(o.udp_encap);
        assert_eq!(o.esp_proposal, DEFAULT_ESP_PROPOSAL);
        assert!(!format!("{o:?}").contains(&long));
        let o = parse(
            "ipsec",
            &format!(r#"{{"psk":"{long}","ESPProposal":"aes256gcm16"}}"#),
        )
        .unwrap();
        let BackendOptions::Ipsec(o) = o else {
            panic!()
        };
        assert_eq!(o.esp_proposal, "aes256gcm16");
        let short = "a".repeat(95);
        assert_eq!(
            parse("ipsec", &format!(r#"{{"PSK":"{short}"}}"#))
                .unwrap_err()
                .to_string(),
            "config error, password is too short"
        );
        assert_eq!(
            BackendOptions::parse("ipsec", None).unwrap_err(),
            OptionsError::PskTooShort
        );
    }

    #[test]
    fn from_parsed_config() {
        let cfg =
            NetConfig::parse(r#"{"Network":"10.0.0.0/16","Backend":{"Type":"VXLAN","VNI":2}}"#)
                .unwrap();
        let o = BackendOptions::from_config(&cfg).unwrap();
        assert_eq!(o.backend_type(), BackendType::Vxlan);
        let BackendOptions::Vxlan(v) = o else {
            panic!()
        };
        assert_eq!(v.vni, 2);
        // No Backend key: udp (upstream quirk).
        let cfg = NetConfig::parse(r#"{"Network":"10.0.0.0/16"}"#).unwrap();
        assert_eq!(
            BackendOptions::from_config(&cfg).unwrap(),
            BackendOptions::Udp(UdpOptions::default())
        );
        // Backend without Type: unknown backend type "".
        let cfg = NetConfig::parse(r#"{"Network":"10.0.0.0/16","Backend":{}}"#).unwrap();
        assert_eq!(
            BackendOptions::from_config(&cfg).unwrap_err().to_string(),
            "unknown backend type: "
        );
    }

    #[test]
    fn never_panics_on_random_input() {
        let mut accepted = 0u32;
        use rand::{SeedableRng, rngs::StdRng};
        let seeds = [
            r#"{"VNI":1,"Port":8472}"#,
            r#"{"MTU":1400,"GBP":true,"DirectRouting":true}"#,
            r#"{"ListenPort":51820,"PSK":"MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=","Mode":"auto","PersistentKeepaliveInterval":300}"#,
            r#"{"PSK":"x","UDPEncap":true,"ESPProposal":"y"}"#,
        ];
        let alphabet: Vec<char> = "{}[]\":,-0123456789.eE+truefalsnl VNIPortMTUModePSK=/"
            .chars()
            .collect();
        let mut rng = StdRng::seed_from_u64(0xbac);
        for i in 0..4000 {
            let text = crate::test_fuzz::mutate(&mut rng, seeds[i % seeds.len()], &alphabet, 5);
            let Ok(raw) = RawJson::from_json(&text) else {
                continue;
            };
            for t in [
                "vxlan",
                "wireguard",
                "udp",
                "ipip",
                "ipsec",
                "host-gw",
                "alloc",
                "extension",
            ] {
                if let Ok(BackendOptions::Vxlan(o)) = BackendOptions::parse(t, Some(&raw)) {
                    accepted += 1;
                    assert!(o.vni < 1 << 24);
                    assert_ne!(o.mtu, Some(0));
                }
            }
        }
        // The mutations must exercise the accepting paths too, not only the errors.
        assert!(accepted >= 300, "only {accepted} inputs accepted");
    }
}
