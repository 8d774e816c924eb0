//! The WireGuard cross-platform configuration protocol ("UAPI") spoken by userspace
//! implementations (wireguard-go, boringtun) on `<socket dir>/<device>.sock`.
//!
//! A request is `get=1\n\n` or `set=1\n` followed by `key=value` lines and an empty line; the
//! answer to both ends with `errno=<n>\n\n` (the get answer has the device's lines before it).
//! Keys are lower-case hex, endpoints `ip:port` / `[ip6]:port`, allowed IPs `addr/len`.
//! The encoding and parsing are pure functions ([`encode_set`], [`parse_get`]); [`UapiClient`]
//! does the socket I/O, one connection per request, each bounded by a timeout.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use ipnet::IpNet;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::UnixStream,
};

use super::{
    config::{DeviceConfig, DeviceState, PeerState, ZERO_KEY},
    key::PrivateKey,
};
use crate::backend::WgKey;

/// How long one UAPI request may take.
pub const UAPI_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest answer accepted (about 25,000 peers with two allowed IPs each).
const MAX_RESPONSE: usize = 32 << 20;

/// Errors of the UAPI exchange.
#[derive(Debug, thiserror::Error)]
pub enum UapiError {
    /// The socket could not be reached or the exchange broke off.
    #[error("WireGuard UAPI socket {}: {source}", path.display())]
    Io {
        /// The socket.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The device did not answer in time.
    #[error("WireGuard UAPI socket {}: no answer within {timeout:?}", path.display())]
    Timeout {
        /// The socket.
        path: PathBuf,
        /// The limit.
        timeout: Duration,
    },
    /// The device refused the request (`errno=<n>`, n != 0).
    #[error("WireGuard UAPI socket {}: the device answered errno={errno} ({})", path.display(), std::io::Error::from_raw_os_error(i32::try_from(*errno).unwrap_or(i32::MAX)))]
    Errno {
        /// The socket.
        path: PathBuf,
        /// The (positive) error number.
        errno: i64,
    },
    /// The answer is not valid UAPI text.
    #[error("WireGuard UAPI: malformed answer: {0}")]
    Malformed(String),
}

fn hex(key: &[u8; 32]) -> String {
    let mut s = String::with_capacity(64);
    for b in key {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn parse_hex_key(value: &str) -> Result<[u8; 32], String> {
    if value.len() != 64 || !value.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("not a 64-digit hex key: {value:?}"));
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&value[2 * i..2 * i + 2], 16)
            .map_err(|_| format!("not a hex key: {value:?}"))?;
    }
    Ok(out)
}

/// The `set=1` request for `config`, including the terminating empty line.
pub fn encode_set(config: &DeviceConfig) -> String {
    let mut s = String::from("set=1\n");
    if let Some(key) = &config.private_key {
        let _ = writeln!(s, "private_key={}", hex(key.expose()));
    }
    if let Some(port) = config.listen_port {
        let _ = writeln!(s, "listen_port={port}");
    }
    if config.replace_peers {
        s.push_str("replace_peers=true\n");
    }
    for peer in &config.peers {
        let _ = writeln!(s, "public_key={}", hex(&peer.public_key.0));
        if peer.remove {
            s.push_str("remove=true\n");
            continue;
        }
        if let Some(psk) = &peer.preshared_key {
            let _ = writeln!(s, "preshared_key={}", hex(&psk.0));
        }
        if let Some(endpoint) = peer.endpoint {
            // SocketAddr's Display brackets IPv6 addresses, as the protocol wants.
            let _ = writeln!(s, "endpoint={endpoint}");
        }
        if let Some(keepalive) = peer.persistent_keepalive {
            let _ = writeln!(s, "persistent_keepalive_interval={keepalive}");
        }
        if peer.replace_allowed_ips {
            s.push_str("replace_allowed_ips=true\n");
        }
        for ip in &peer.allowed_ips {
            let _ = writeln!(s, "allowed_ip={ip}");
        }
    }
    s.push('\n');
    s
}

/// The `errno=` value of an answer (the last `errno=` line).
fn errno_of(text: &str) -> Result<i64, UapiError> {
    text.lines()
        .rev()
        .find_map(|l| l.strip_prefix("errno="))
        .ok_or_else(|| UapiError::Malformed("no errno line".into()))?
        .trim()
        .parse()
        .map_err(|_| UapiError::Malformed("errno is not a number".into()))
}

/// Parses the answer to `get=1` (without checking `errno`, see [`UapiClient::get`]).
pub fn parse_get(text: &str) -> Result<DeviceState, UapiError> {
    let bad = |line: &str, why: String| UapiError::Malformed(format!("{line:?}: {why}"));
    let mut state = DeviceState::default();
    let mut peer: Option<PeerState> = None;
    let mut handshake_sec = 0u64;
    let mut handshake_nsec = 0u32;
    let finish =
        |peer: &mut Option<PeerState>, state: &mut DeviceState, sec: &mut u64, nsec: &mut u32| {
            if let Some(mut p) = peer.take() {
                if *sec != 0 || *nsec != 0 {
                    p.last_handshake = Some(Duration::new(*sec, *nsec));
                }
                state.peers.push(p);
            }
            *sec = 0;
            *nsec = 0;
        };
    for line in text.lines() {
        if line.is_empty() {
            break;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| bad(line, "no '='".into()))?;
        let num = |v: &str| -> Result<u64, UapiError> {
            v.parse::<u64>().map_err(|e| bad(line, e.to_string()))
        };
        match (key, peer.as_mut()) {
            ("errno", _) => {}
            ("public_key", _) => {
                finish(
                    &mut peer,
                    &mut state,
                    &mut handshake_sec,
                    &mut handshake_nsec,
                );
                let k = parse_hex_key(value).map_err(|e| bad(line, e))?;
                peer = Some(PeerState::new(WgKey(k)));
            }
            ("private_key", None) => {
                let k = parse_hex_key(value).map_err(|e| bad(line, e))?;
                if k != [0; 32] {
                    state.private_key = Some(PrivateKey::from_bytes(k));
                }
            }
            ("listen_port", None) => {
                state.listen_port = value.parse().map_err(|_| bad(line, "port".into()))?;
            }
            ("fwmark", None) => {
                state.fwmark = value.parse().map_err(|_| bad(line, "fwmark".into()))?;
            }
            ("preshared_key", Some(p)) => {
                let k = WgKey(parse_hex_key(value).map_err(|e| bad(line, e))?);
                p.preshared_key = (k != ZERO_KEY).then_some(k);
            }
            ("endpoint", Some(p)) => {
                p.endpoint = Some(
                    value
                        .parse::<SocketAddr>()
                        .map_err(|e| bad(line, e.to_string()))?,
                );
            }
            ("persistent_keepalive_interval", Some(p)) => {
                p.persistent_keepalive =
                    value.parse().map_err(|_| bad(line, "keepalive".into()))?;
            }
            ("allowed_ip", Some(p)) => {
                let net: IpNet = value.parse().map_err(|_| bad(line, "prefix".into()))?;
                p.allowed_ips.insert(net);
            }
            ("last_handshake_time_sec", Some(_)) => handshake_sec = num(value)?,
            ("last_handshake_time_nsec", Some(_)) => {
                handshake_nsec = u32::try_from(num(value)?)
                    .map_err(|_| bad(line, "nanoseconds".into()))?
                    .min(999_999_999);
            }
            ("rx_bytes", Some(p)) => p.rx_bytes = num(value)?,
            ("tx_bytes", Some(p)) => p.tx_bytes = num(value)?,
            // protocol_version and anything newer implementations add.
            _ => {}
        }
    }
    finish(
        &mut peer,
        &mut state,
        &mut handshake_sec,
        &mut handshake_nsec,
    );
    Ok(state)
}

/// A client of one device's UAPI socket.
#[derive(Debug, Clone)]
pub struct UapiClient {
    path: PathBuf,
    timeout: Duration,
}

impl UapiClient {
    /// A client for the socket at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        UapiClient {
            path: path.into(),
            timeout: UAPI_TIMEOUT,
        }
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Connects (for a liveness check or to learn the peer process with `SO_PEERCRED`).
    pub async fn connect(&self) -> Result<UnixStream, UapiError> {
        UnixStream::connect(&self.path)
            .await
            .map_err(|source| UapiError::Io {
                path: self.path.clone(),
                source,
            })
    }

    async fn exchange(&self, request: &str) -> Result<String, UapiError> {
        let io = |source| UapiError::Io {
            path: self.path.clone(),
            source,
        };
        let work = async {
            let mut stream = self.connect().await?;
            stream.write_all(request.as_bytes()).await.map_err(io)?;
            let mut buf = Vec::with_capacity(4096);
            let mut chunk = vec![0u8; 64 * 1024];
            loop {
                let n = stream.read(&mut chunk).await.map_err(io)?;
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
                if buf.ends_with(b"\n\n") && complete(&buf) {
                    break;
                }
                if buf.len() > MAX_RESPONSE {
                    return Err(UapiError::Malformed(format!(
                        "answer larger than {MAX_RESPONSE} bytes"
                    )));
                }
            }
            String::from_utf8(buf).map_err(|_| UapiError::Malformed("not UTF-8".into()))
        };
        tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| UapiError::Timeout {
                path: self.path.clone(),
                timeout: self.timeout,
            })?
    }

    fn check(&self, text: &str) -> Result<(), UapiError> {
        match errno_of(text)? {
            0 => Ok(()),
            errno => Err(UapiError::Errno {
                path: self.path.clone(),
                errno: errno.abs(),
            }),
        }
    }

    /// Reads the device's configuration and peers.
    pub async fn get(&self) -> Result<DeviceState, UapiError> {
        let text = self.exchange("get=1\n\n").await?;
        self.check(&text)?;
        parse_get(&text)
    }

    /// Applies `config` (nothing is sent when it is empty).
    pub async fn set(&self, config: &DeviceConfig) -> Result<(), UapiError> {
        if config.is_empty() {
            return Ok(());
        }
        let text = self.exchange(&encode_set(config)).await?;
        self.check(&text)
    }
}

/// Whether `buf` (ending in an empty line) holds a whole answer: its last line is `errno=`.
fn complete(buf: &[u8]) -> bool {
    let body = &buf[..buf.len() - 2];
    let last = body.rsplit(|b| *b == b'\n').next().unwrap_or(body);
    last.starts_with(b"errno=")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;
    use crate::wireguard::config::PeerConfig;

    fn key(b: u8) -> WgKey {
        WgKey([b; 32])
    }

    #[test]
    fn set_request_text() {
        let config = DeviceConfig {
            private_key: Some(PrivateKey::from_bytes([0x11; 32])),
            listen_port: Some(51820),
            replace_peers: false,
            peers: vec![
                PeerConfig {
                    public_key: key(0xab),
                    remove: false,
                    preshared_key: Some(ZERO_KEY),
                    endpoint: Some("[fd00::2]:51821".parse().unwrap()),
                    persistent_keepalive: Some(25),
                    replace_allowed_ips: true,
                    allowed_ips: vec![
                        "10.244.2.0/24".parse().unwrap(),
                        "fd00:244:2::/64".parse().unwrap(),
                    ],
                },
                PeerConfig::remove(key(0x01)),
            ],
        };
        let text = encode_set(&config);
        let want = format!(
            "set=1\nprivate_key={}\nlisten_port=51820\npublic_key={}\npreshared_key={}\n\
             endpoint=[fd00::2]:51821\npersistent_keepalive_interval=25\nreplace_allowed_ips=true\n\
             allowed_ip=10.244.2.0/24\nallowed_ip=fd00:244:2::/64\npublic_key={}\nremove=true\n\n",
            "11".repeat(32),
            "ab".repeat(32),
            "00".repeat(32),
            "01".repeat(32)
        );
        assert_eq!(text, want);
        assert!(DeviceConfig::default().is_empty());
    }

    #[test]
    fn get_answer_parses() {
        let text = format!(
            "private_key={}\nlisten_port=51820\nfwmark=7\npublic_key={}\npreshared_key={}\n\
             protocol_version=1\nendpoint=192.168.10.2:51820\nlast_handshake_time_sec=1700000000\n\
             last_handshake_time_nsec=5\ntx_bytes=100\nrx_bytes=200\n\
             persistent_keepalive_interval=25\nallowed_ip=10.244.2.0/24\npublic_key={}\n\
             preshared_key={}\nprotocol_version=1\nlast_handshake_time_sec=0\n\
             last_handshake_time_nsec=0\ntx_bytes=0\nrx_bytes=0\npersistent_keepalive_interval=0\n\
             allowed_ip=10.244.3.0/24\nallowed_ip=fd00:244:3::/64\nerrno=0\n\n",
            "11".repeat(32),
            "ab".repeat(32),
            "cd".repeat(32),
            "01".repeat(32),
            "00".repeat(32)
        );
        assert!(complete(text.as_bytes()));
        let s = parse_get(&text).unwrap();
        assert_eq!(s.private_key, Some(PrivateKey::from_bytes([0x11; 32])));
        assert_eq!((s.listen_port, s.fwmark), (51820, 7));
        assert_eq!(s.peers.len(), 2);
        let a = &s.peers[0];
        assert_eq!(a.public_key, key(0xab));
        assert_eq!(a.preshared_key, Some(key(0xcd)));
        assert_eq!(a.endpoint, Some("192.168.10.2:51820".parse().unwrap()));
        assert_eq!(a.persistent_keepalive, 25);
        assert_eq!(a.last_handshake, Some(Duration::new(1_700_000_000, 5)));
        assert_eq!((a.rx_bytes, a.tx_bytes), (200, 100));
        assert_eq!(
            a.allowed_ips
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["10.244.2.0/24"]
        );
        let b = s.peer(&key(0x01)).unwrap();
        assert_eq!(b.preshared_key, None);
        assert_eq!(b.endpoint, None);
        assert_eq!(b.last_handshake, None);
        assert_eq!(b.allowed_ips.len(), 2);
    }

    #[test]
    fn empty_device_and_errors() {
        let s = parse_get("errno=0\n\n").unwrap();
        assert_eq!(s, DeviceState::default());
        assert_eq!(errno_of("errno=-22\n\n").unwrap(), -22);
        assert!(!complete(b"public_key=00\n\n"));
        assert!(parse_get("listen_port=x\nerrno=0\n\n").is_err());
        assert!(parse_get("public_key=zz\nerrno=0\n\n").is_err());
        assert!(parse_get("garbage\n\n").is_err());
        let e = UapiError::Errno {
            path: "/x.sock".into(),
            errno: 22,
        };
        assert!(e.to_string().contains("errno=22"), "{e}");
    }
}
