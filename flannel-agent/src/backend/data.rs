//! BackendData: what a node publishes about its tunnel endpoint in its lease (§2.0 table).
//!
//! Encoding produces upstream's exact JSON (`{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff"}`,
//! `{"PublicKey":"…","Port":51820}`); decoding accepts what any upstream node may publish
//! (keys in any case, unknown keys ignored, a missing `VNI` or `Port` read as 0 — real nodes
//! publish `{"VtepMAC":"…"}` alone).

use std::fmt;
use std::str::FromStr;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use rand::Rng;

use crate::gojson::{self, GoJsonError, GoObject, RawJson};

/// Errors decoding BackendData or its parts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataError {
    /// Malformed JSON or a field of the wrong type.
    #[error("invalid backend data: {0}")]
    Json(#[from] GoJsonError),
    /// A field the backend needs is absent (or the data is `null`).
    #[error("invalid backend data: missing {0}")]
    Missing(&'static str),
    /// Not a 6-byte MAC address.
    #[error("invalid MAC address {0:?}")]
    InvalidMac(String),
    /// Not base64 of a 32-byte key.
    #[error("invalid WireGuard key: {0}")]
    InvalidKey(String),
    /// A number out of range for its field.
    #[error("invalid backend data: {field} {value} out of range")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value.
        value: u64,
    },
}

/// An Ethernet MAC address; displays lower-case and colon-separated like Go.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// A random locally administered unicast address (first octet `(x & 0xfe) | 0x02`), as
    /// upstream generates for VXLAN devices.
    pub fn random_local<R: Rng + ?Sized>(rng: &mut R) -> Self {
        let mut b = [0u8; 6];
        rng.fill(&mut b);
        b[0] = (b[0] & 0xfe) | 0x02;
        MacAddr(b)
    }

    /// The six octets.
    pub fn octets(&self) -> [u8; 6] {
        self.0
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for MacAddr {
    type Err = DataError;

    /// Go `net.ParseMAC` forms of a 6-byte address: `aa:bb:cc:dd:ee:ff`, `aa-bb-cc-dd-ee-ff`,
    /// `aabb.ccdd.eeff` (hex digits in any case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || DataError::InvalidMac(s.to_owned());
        let groups: Vec<&str> = if s.contains(':') {
            s.split(':').collect()
        } else if s.contains('-') {
            s.split('-').collect()
        } else {
            s.split('.')
                .flat_map(|g| [g.get(..2).unwrap_or("!"), g.get(2..).unwrap_or("!")])
                .collect()
        };
        if s.contains('.') && s.split('.').any(|g| g.len() != 4) {
            return Err(bad());
        }
        if groups.len() != 6 {
            return Err(bad());
        }
        let mut out = [0u8; 6];
        for (o, g) in out.iter_mut().zip(groups) {
            if g.len() != 2 || !g.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            *o = u8::from_str_radix(g, 16).map_err(|_| bad())?;
        }
        Ok(MacAddr(out))
    }
}

/// A WireGuard key (public key or PSK): 32 bytes, standard base64 (44 characters) as text.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WgKey(pub [u8; 32]);

impl fmt::Display for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&BASE64.encode(self.0))
    }
}

impl fmt::Debug for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WgKey({self})")
    }
}

impl FromStr for WgKey {
    type Err = DataError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bytes = BASE64.decode(s.trim()).map_err(|e| {
            DataError::InvalidKey(format!("failed to parse base64-encoded key: {e}"))
        })?;
        let key: [u8; 32] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| DataError::InvalidKey(format!("incorrect key size: {}", bytes.len())))?;
        Ok(WgKey(key))
    }
}

/// VXLAN BackendData: `{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VxlanLeaseData {
    /// The publisher's VNI (0 when it did not publish one; receivers use their own VNI).
    pub vni: u32,
    /// The MAC address of the publisher's VXLAN device.
    pub vtep_mac: MacAddr,
}

impl VxlanLeaseData {
    /// Upstream's exact JSON.
    pub fn to_json(&self) -> RawJson {
        let text = format!(r#"{{"VNI":{},"VtepMAC":"{}"}}"#, self.vni, self.vtep_mac);
        RawJson::from_json(&text).unwrap_or_else(|_| RawJson::null())
    }

    /// Decodes a peer's data. `VtepMAC` is required; `VNI` defaults to 0.
    pub fn from_json(raw: &RawJson) -> Result<Self, DataError> {
        if let Some(data) = Self::canonical(raw.as_str()) {
            return Ok(data);
        }
        let obj = GoObject::from_raw(raw.as_raw())?.ok_or(DataError::Missing("VtepMAC"))?;
        let vni = match obj.last("VNI", gojson::uint)? {
            None => 0,
            Some(v) => u32::try_from(v).map_err(|_| DataError::OutOfRange {
                field: "VNI",
                value: v,
            })?,
        };
        let mac = obj
            .last("VtepMAC", gojson::string)?
            .ok_or(DataError::Missing("VtepMAC"))?;
        Ok(VxlanLeaseData {
            vni,
            vtep_mac: mac.parse()?,
        })
    }

    /// The data in exactly the form upstream and [`VxlanLeaseData::to_json`] write it,
    /// `{"VNI":<n>,"VtepMAC":"xx:xx:xx:xx:xx:xx"}`, read without the general decoder (the
    /// dataplane reads every vxlan lease's data at every lease event); `None` for any other
    /// form, which the general decoder then reads, with the same result where both apply.
    fn canonical(text: &str) -> Option<Self> {
        let rest = text.strip_prefix(r#"{"VNI":"#)?;
        let (digits, rest) = rest.split_at(rest.find(|c: char| !c.is_ascii_digit())?);
        let mac = rest
            .strip_prefix(r#","VtepMAC":""#)?
            .strip_suffix(r#""}"#)?
            .as_bytes();
        let leading_zero = digits.len() > 1 && digits.starts_with('0');
        if digits.is_empty() || digits.len() > 10 || leading_zero {
            return None;
        }
        let vni = u32::try_from(digits.parse::<u64>().ok()?).ok()?;
        if mac.len() != 17 {
            return None;
        }
        let hex = |c: u8| char::from(c).to_digit(16);
        let mut vtep_mac = [0u8; 6];
        for (i, byte) in vtep_mac.iter_mut().enumerate() {
            let at = i * 3;
            if i > 0 && mac[at - 1] != b':' {
                return None;
            }
            *byte = u8::try_from(hex(mac[at])? * 16 + hex(mac[at + 1])?).ok()?;
        }
        Some(VxlanLeaseData {
            vni,
            vtep_mac: MacAddr(vtep_mac),
        })
    }
}

/// WireGuard BackendData: `{"PublicKey":"<base64>","Port":51820}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireguardLeaseData {
    /// The publisher's public key.
    pub public_key: WgKey,
    /// The publisher's listen port for this family (0 when unpublished: use the local port).
    pub port: u16,
}

impl WireguardLeaseData {
    /// Upstream's exact JSON.
    pub fn to_json(&self) -> RawJson {
        let text = format!(
            r#"{{"PublicKey":"{}","Port":{}}}"#,
            self.public_key, self.port
        );
        RawJson::from_json(&text).unwrap_or_else(|_| RawJson::null())
    }

    /// Decodes a peer's data. `PublicKey` is required; `Port` defaults to 0.
    pub fn from_json(raw: &RawJson) -> Result<Self, DataError> {
        let obj = GoObject::from_raw(raw.as_raw())?.ok_or(DataError::Missing("PublicKey"))?;
        let port = match obj.last("Port", gojson::uint)? {
            None => 0,
            Some(v) => u16::try_from(v).map_err(|_| DataError::OutOfRange {
                field: "Port",
                value: v,
            })?,
        };
        let key = obj
            .last("PublicKey", gojson::string)?
            .ok_or(DataError::Missing("PublicKey"))?;
        Ok(WireguardLeaseData {
            public_key: key.parse()?,
            port,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn raw(s: &str) -> RawJson {
        RawJson::from_json(s).unwrap()
    }

    #[test]
    fn vxlan_data_encodes_like_upstream() {
        let d = VxlanLeaseData {
            vni: 1,
            vtep_mac: "AA:BB:CC:DD:EE:FF".parse().unwrap(),
        };
        assert_eq!(
            d.to_json().as_str(),
            r#"{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff"}"#
        );
        assert_eq!(VxlanLeaseData::from_json(&d.to_json()).unwrap(), d);
    }

    #[test]
    fn vxlan_data_decodes_what_nodes_publish() {
        // dist/fake-node.yaml: only VtepMAC.
        let d = VxlanLeaseData::from_json(&raw(r#"{"VtepMAC":"96:59:b2:3f:04:ee"}"#)).unwrap();
        assert_eq!(d.vni, 0);
        assert_eq!(d.vtep_mac.to_string(), "96:59:b2:3f:04:ee");
        let d =
            VxlanLeaseData::from_json(&raw(r#"{"vni":4096,"vtepmac":"96-59-B2-3F-04-EE","x":1}"#))
                .unwrap();
        assert_eq!(
            (d.vni, d.vtep_mac.to_string()),
            (4096, "96:59:b2:3f:04:ee".into())
        );
        let e = |s: &str| VxlanLeaseData::from_json(&raw(s)).unwrap_err().to_string();
        assert_eq!(e("null"), "invalid backend data: missing VtepMAC");
        assert_eq!(e(r#"{"VNI":1}"#), "invalid backend data: missing VtepMAC");
        assert_eq!(
            e(r#"{"VtepMAC":"zz:bb:cc:dd:ee:ff"}"#),
            "invalid MAC address \"zz:bb:cc:dd:ee:ff\""
        );
        assert_eq!(
            e(r#"{"VNI":-1,"VtepMAC":"aa:bb:cc:dd:ee:ff"}"#),
            "invalid backend data: field \"VNI\": cannot use -1 as uint"
        );
        assert_eq!(
            e(r#"{"VNI":4294967296,"VtepMAC":"aa:bb:cc:dd:ee:ff"}"#),
            "invalid backend data: VNI 4294967296 out of range"
        );
        assert_eq!(
            e("[]"),
            "invalid backend data: cannot unmarshal array into an object"
        );
    }

    /// The general decoder, as `from_json` was before its shortcut.
    fn decoded(text: &str) -> Option<VxlanLeaseData> {
        let raw = RawJson::from_json(text).ok()?;
        let obj = GoObject::from_raw(raw.as_raw()).ok()??;
        let vni = match obj.last("VNI", gojson::uint).ok()? {
            None => 0,
            Some(v) => u32::try_from(v).ok()?,
        };
        let mac = obj.last("VtepMAC", gojson::string).ok()??;
        Some(VxlanLeaseData {
            vni,
            vtep_mac: mac.parse().ok()?,
        })
    }

    /// Upstream's form is read by the shortcut, and wherever the shortcut reads something
    /// the general decoder reads the same: for what nodes write, and for random edits of it
    /// (a character replaced, inserted or cut, picked from JSON's and MACs' own).
    #[test]
    fn the_canonical_shortcut_agrees_with_the_decoder() {
        let mut rng = StdRng::seed_from_u64(3);
        let alphabet: Vec<char> = r#"{}":,0123456789abcdefABCDEF-.\u VNIVtepMAC"#.chars().collect();
        let (mut read, mut edited) = (0, 0);
        for _ in 0..20_000 {
            let data = VxlanLeaseData {
                vni: [0, 1, 4096, u32::MAX][rng.random_range(0..4)],
                vtep_mac: MacAddr::random_local(&mut rng),
            };
            let text = data.to_json().as_str().to_owned();
            assert_eq!(VxlanLeaseData::canonical(&text), Some(data), "{text}");
            let mut chars: Vec<char> = text.chars().collect();
            let at = rng.random_range(0..chars.len());
            match rng.random_range(0..3) {
                0 => chars[at] = alphabet[rng.random_range(0..alphabet.len())],
                1 => chars.insert(at, alphabet[rng.random_range(0..alphabet.len())]),
                _ => {
                    chars.remove(at);
                }
            }
            let text: String = chars.into_iter().collect();
            if let Some(quick) = VxlanLeaseData::canonical(&text) {
                edited += 1;
                assert_eq!(Some(quick), decoded(&text), "{text}");
            }
            read += 1;
        }
        assert!(read == 20_000 && edited > 1_000, "{edited} edits read");
        for text in [
            r#"{"VNI":01,"VtepMAC":"aa:bb:cc:dd:ee:ff"}"#,
            r#"{"VNI":4294967296,"VtepMAC":"aa:bb:cc:dd:ee:ff"}"#,
            r#"{"VNI":1,"VtepMAC":"aa-bb-cc-dd-ee-ff"}"#,
            r#"{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:f\u0066"}"#,
            r#"{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff","VNI":2}"#,
            r#"{"VNI":,"VtepMAC":"aa:bb:cc:dd:ee:ff"}"#,
        ] {
            assert_eq!(VxlanLeaseData::canonical(text), None, "{text}");
        }
    }

    #[test]
    fn mac_forms() {
        let want = MacAddr([0x0a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f]);
        for s in ["0a:1b:2c:3d:4e:5f", "0A-1B-2C-3D-4E-5F", "0a1b.2c3d.4e5f"] {
            assert_eq!(s.parse::<MacAddr>().unwrap(), want, "{s}");
        }
        for s in [
            "",
            "0a:1b:2c:3d:4e",
            "0a:1b:2c:3d:4e:5f:60",
            "0a:1b:2c:3d:4e:5",
            "0a1b.2c3d.4e5",
            "0a:1b-2c:3d:4e:5f",
            "+a:1b:2c:3d:4e:5f",
            "0a1b2c3d4e5f",
        ] {
            assert!(s.parse::<MacAddr>().is_err(), "{s}");
        }
        assert_eq!(format!("{want:?}"), "0a:1b:2c:3d:4e:5f");
    }

    #[test]
    fn random_macs_are_local_unicast() {
        let mut rng = StdRng::seed_from_u64(5);
        let mut distinct = std::collections::HashSet::new();
        for _ in 0..100 {
            let m = MacAddr::random_local(&mut rng);
            assert_eq!(m.0[0] & 0x03, 0x02, "{m}");
            distinct.insert(m);
        }
        assert_eq!(distinct.len(), 100);
    }

    #[test]
    fn wireguard_data() {
        let key: WgKey = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
            .parse()
            .unwrap();
        let d = WireguardLeaseData {
            public_key: key,
            port: 51820,
        };
        assert_eq!(
            d.to_json().as_str(),
            r#"{"PublicKey":"MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=","Port":51820}"#
        );
        assert_eq!(WireguardLeaseData::from_json(&d.to_json()).unwrap(), d);
        let d = WireguardLeaseData::from_json(&raw(
            r#"{"publickey":"MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="}"#,
        ))
        .unwrap();
        assert_eq!(d.port, 0);
        let e = |s: &str| {
            WireguardLeaseData::from_json(&raw(s))
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            e(r#"{"Port":1}"#),
            "invalid backend data: missing PublicKey"
        );
        assert_eq!(
            e(r#"{"PublicKey":"YWJj"}"#),
            "invalid WireGuard key: incorrect key size: 3"
        );
        assert!(
            e(r#"{"PublicKey":"!!"}"#)
                .starts_with("invalid WireGuard key: failed to parse base64-encoded key")
        );
        assert_eq!(
            e(r#"{"PublicKey":"MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=","Port":70000}"#),
            "invalid backend data: Port 70000 out of range"
        );
    }

    #[test]
    fn never_panics_on_random_input() {
        let (mut accepted_vxlan, mut accepted_wireguard) = (0u32, 0u32);
        let seeds = [
            r#"{"VNI":1,"VtepMAC":"aa:bb:cc:dd:ee:ff"}"#,
            r#"{"PublicKey":"MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=","Port":51820}"#,
            "0a1b.2c3d.4e5f",
        ];
        let alphabet: Vec<char> = "{}\":,.-0123456789abcdefABCDEF=+/VNIPortKey né"
            .chars()
            .collect();
        let mut rng = StdRng::seed_from_u64(0xda7a);
        for i in 0..3000 {
            let text = crate::test_fuzz::mutate(&mut rng, seeds[i % seeds.len()], &alphabet, 4);
            if let Ok(m) = text.parse::<MacAddr>() {
                assert_eq!(m.to_string().parse::<MacAddr>().unwrap(), m);
            }
            let _ = text.parse::<WgKey>();
            if let Ok(r) = RawJson::from_json(&text) {
                if let Ok(d) = VxlanLeaseData::from_json(&r) {
                    accepted_vxlan += 1;
                    assert_eq!(VxlanLeaseData::from_json(&d.to_json()).unwrap(), d);
                }
                if let Ok(d) = WireguardLeaseData::from_json(&r) {
                    accepted_wireguard += 1;
                    assert_eq!(WireguardLeaseData::from_json(&d.to_json()).unwrap(), d);
                }
            }
        }
        // The mutations must exercise the accepting paths too, not only the errors.
        assert!(
            accepted_vxlan >= 50 && accepted_wireguard >= 50,
            "{accepted_vxlan} / {accepted_wireguard} accepted"
        );
    }
}
