//! The kernel WireGuard device's control channel: the `wireguard` generic netlink family
//! (`WG_CMD_GET_DEVICE` as a dump, `WG_CMD_SET_DEVICE`), encoded by hand on
//! [`crate::netlink::raw`].
//!
//! Message shapes (linux `include/uapi/linux/wireguard.h`): device attributes
//! `IFNAME`, `PRIVATE_KEY`, `LISTEN_PORT`, `FLAGS` (`REPLACE_PEERS`), `PEERS` (a nest of
//! per-peer nests: `PUBLIC_KEY`, `FLAGS` (`REMOVE_ME`, `REPLACE_ALLOWEDIPS`), `PRESHARED_KEY`,
//! `ENDPOINT` (a `sockaddr_in`/`sockaddr_in6`), `PERSISTENT_KEEPALIVE_INTERVAL`,
//! `ALLOWEDIPS` (a nest of nests: `FAMILY`, `IPADDR`, `CIDR_MASK`)). Large peer sets are
//! split over several SET messages (each names the device again); a GET dump may split one
//! peer's allowed IPs over two messages, which [`decode_get`] merges.
//!
//! This kernel has no WireGuard, so the family lookup fails with `ENOENT` here and the
//! userspace device is used; the encoding is covered by unit tests at the message level.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    sync::{Arc, Mutex},
    time::Duration,
};

use ipnet::IpNet;

use super::{
    config::{DeviceConfig, DeviceState, PeerConfig, PeerState, ZERO_KEY},
    key::PrivateKey,
};
use crate::{
    backend::WgKey,
    netlink::raw::{
        self, MessageBuilder, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, RawError, RawSocket, attributes,
    },
};

/// `GENL_ID_CTRL`.
pub const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;

/// `NETLINK_GENERIC`.
pub const GENERIC_NETLINK: isize = 16;

/// `WG_GENL_NAME`.
pub const WG_GENL_NAME: &str = "wireguard";
const WG_GENL_VERSION: u8 = 1;
const WG_CMD_GET_DEVICE: u8 = 0;
const WG_CMD_SET_DEVICE: u8 = 1;

const WGDEVICE_A_IFNAME: u16 = 2;
const WGDEVICE_A_PRIVATE_KEY: u16 = 3;
const WGDEVICE_A_FLAGS: u16 = 5;
const WGDEVICE_A_LISTEN_PORT: u16 = 6;
const WGDEVICE_A_FWMARK: u16 = 7;
const WGDEVICE_A_PEERS: u16 = 8;
const WGDEVICE_F_REPLACE_PEERS: u32 = 1;

const WGPEER_A_PUBLIC_KEY: u16 = 1;
const WGPEER_A_PRESHARED_KEY: u16 = 2;
const WGPEER_A_FLAGS: u16 = 3;
const WGPEER_A_ENDPOINT: u16 = 4;
const WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL: u16 = 5;
const WGPEER_A_LAST_HANDSHAKE_TIME: u16 = 6;
const WGPEER_A_RX_BYTES: u16 = 7;
const WGPEER_A_TX_BYTES: u16 = 8;
const WGPEER_A_ALLOWEDIPS: u16 = 9;
const WGPEER_F_REMOVE_ME: u32 = 1;
const WGPEER_F_REPLACE_ALLOWEDIPS: u32 = 2;

const WGALLOWEDIP_A_FAMILY: u16 = 1;
const WGALLOWEDIP_A_IPADDR: u16 = 2;
const WGALLOWEDIP_A_CIDR_MASK: u16 = 3;

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// SET messages are cut before they grow past this (the kernel takes far larger ones; this
/// keeps every message well inside default socket buffers).
pub const MAX_SET_MESSAGE: usize = 32 * 1024;

/// Errors of the kernel control channel.
#[derive(Debug, thiserror::Error)]
pub enum GenlError {
    /// The kernel has no `wireguard` generic netlink family (module not loaded or absent).
    #[error("the kernel has no WireGuard generic netlink family ({0})")]
    NoFamily(RawError),
    /// A request failed.
    #[error("WireGuard netlink {op} on {device}: {source}")]
    Request {
        /// `get` or `set`.
        op: &'static str,
        /// The device.
        device: String,
        /// The failure.
        #[source]
        source: RawError,
    },
    /// The answer could not be decoded.
    #[error("WireGuard netlink answer: {0}")]
    Malformed(String),
}

fn genl_header(cmd: u8, version: u8) -> [u8; 4] {
    [cmd, version, 0, 0]
}

/// The `CTRL_CMD_GETFAMILY` request for `name`.
pub fn family_request(name: &str) -> MessageBuilder {
    let mut m = MessageBuilder::new(GENL_ID_CTRL, NLM_F_REQUEST | NLM_F_ACK);
    m.header(&genl_header(CTRL_CMD_GETFAMILY, 1));
    m.attr_str(CTRL_ATTR_FAMILY_NAME, name);
    m
}

/// Resolves a generic netlink family name to its id (blocking).
pub fn resolve_family(socket: &mut RawSocket, name: &str) -> Result<u16, RawError> {
    let answers = socket.request(family_request(name))?;
    for (_, payload) in answers {
        let attrs = attributes(payload.get(4..).unwrap_or_default())?;
        if let Some(id) = attrs
            .iter()
            .find(|(t, _)| *t == CTRL_ATTR_FAMILY_ID)
            .and_then(|(_, p)| raw::get_u16(p))
        {
            return Ok(id);
        }
    }
    Err(RawError::Malformed(raw::Malformed(format!(
        "no family id for {name}"
    ))))
}

fn sockaddr(endpoint: SocketAddr) -> Vec<u8> {
    match endpoint {
        SocketAddr::V4(a) => {
            let mut v = Vec::with_capacity(16);
            v.extend_from_slice(&AF_INET.to_ne_bytes());
            v.extend_from_slice(&a.port().to_be_bytes());
            v.extend_from_slice(&a.ip().octets());
            v.extend_from_slice(&[0; 8]);
            v
        }
        SocketAddr::V6(a) => {
            let mut v = Vec::with_capacity(28);
            v.extend_from_slice(&AF_INET6.to_ne_bytes());
            v.extend_from_slice(&a.port().to_be_bytes());
            v.extend_from_slice(&a.flowinfo().to_be_bytes());
            v.extend_from_slice(&a.ip().octets());
            v.extend_from_slice(&a.scope_id().to_ne_bytes());
            v
        }
    }
}

fn parse_sockaddr(p: &[u8]) -> Option<SocketAddr> {
    let family = raw::get_u16(p)?;
    let port = u16::from_be_bytes(p.get(2..4)?.try_into().ok()?);
    match family {
        AF_INET => {
            let ip: [u8; 4] = p.get(4..8)?.try_into().ok()?;
            Some(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(ip), port)))
        }
        AF_INET6 => {
            let flow = u32::from_be_bytes(p.get(4..8)?.try_into().ok()?);
            let ip: [u8; 16] = p.get(8..24)?.try_into().ok()?;
            let scope = raw::get_u32(p.get(24..28)?)?;
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(ip),
                port,
                flow,
                scope,
            )))
        }
        _ => None,
    }
}

fn put_peer(m: &mut MessageBuilder, peer: &PeerConfig, index: u16) {
    m.nest_start(index);
    m.attr(WGPEER_A_PUBLIC_KEY, &peer.public_key.0);
    let mut flags = 0;
    if peer.remove {
        flags |= WGPEER_F_REMOVE_ME;
    }
    if peer.replace_allowed_ips && !peer.remove {
        flags |= WGPEER_F_REPLACE_ALLOWEDIPS;
    }
    if flags != 0 {
        m.attr_u32(WGPEER_A_FLAGS, flags);
    }
    if !peer.remove {
        if let Some(psk) = &peer.preshared_key {
            m.attr(WGPEER_A_PRESHARED_KEY, &psk.0);
        }
        if let Some(endpoint) = peer.endpoint {
            m.attr(WGPEER_A_ENDPOINT, &sockaddr(endpoint));
        }
        if let Some(k) = peer.persistent_keepalive {
            m.attr_u16(WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL, k);
        }
        if peer.replace_allowed_ips || !peer.allowed_ips.is_empty() {
            m.nest_start(WGPEER_A_ALLOWEDIPS);
            for (i, net) in peer.allowed_ips.iter().enumerate() {
                m.nest_start(u16::try_from(i).unwrap_or(u16::MAX));
                match net.addr() {
                    IpAddr::V4(a) => {
                        m.attr_u16(WGALLOWEDIP_A_FAMILY, AF_INET);
                        m.attr(WGALLOWEDIP_A_IPADDR, &a.octets());
                    }
                    IpAddr::V6(a) => {
                        m.attr_u16(WGALLOWEDIP_A_FAMILY, AF_INET6);
                        m.attr(WGALLOWEDIP_A_IPADDR, &a.octets());
                    }
                }
                m.attr_u8(WGALLOWEDIP_A_CIDR_MASK, net.prefix_len());
                m.nest_end();
            }
            m.nest_end();
        }
    }
    m.nest_end();
}

/// The SET messages for `config` on device `name` of family `family_id`: the device
/// attributes in the first, peers spread so no message passes [`MAX_SET_MESSAGE`].
pub fn encode_set(family_id: u16, name: &str, config: &DeviceConfig) -> Vec<MessageBuilder> {
    let start = |first: bool| {
        let mut m = MessageBuilder::new(family_id, NLM_F_REQUEST | NLM_F_ACK);
        m.header(&genl_header(WG_CMD_SET_DEVICE, WG_GENL_VERSION));
        m.attr_str(WGDEVICE_A_IFNAME, name);
        if first {
            if let Some(key) = &config.private_key {
                m.attr(WGDEVICE_A_PRIVATE_KEY, key.expose());
            }
            if let Some(port) = config.listen_port {
                m.attr_u16(WGDEVICE_A_LISTEN_PORT, port);
            }
            if config.replace_peers {
                m.attr_u32(WGDEVICE_A_FLAGS, WGDEVICE_F_REPLACE_PEERS);
            }
        }
        m
    };
    let mut out = Vec::new();
    let mut current = start(true);
    let mut in_message = 0u16;
    for peer in &config.peers {
        let mut one = MessageBuilder::new(0, 0);
        put_peer(&mut one, peer, 0);
        let peer_len = one.len() - raw::NLMSG_HDRLEN;
        if in_message > 0 && current.len() + peer_len + 4 > MAX_SET_MESSAGE {
            current.nest_end();
            out.push(std::mem::replace(&mut current, start(false)));
            in_message = 0;
        }
        if in_message == 0 {
            current.nest_start(WGDEVICE_A_PEERS);
        }
        put_peer(&mut current, peer, in_message);
        in_message = in_message.saturating_add(1);
    }
    if in_message > 0 {
        current.nest_end();
    }
    out.push(current);
    out
}

/// The GET (dump) request for device `name`.
pub fn encode_get(family_id: u16, name: &str) -> MessageBuilder {
    let mut m = MessageBuilder::new(family_id, NLM_F_REQUEST | NLM_F_ACK | NLM_F_DUMP);
    m.header(&genl_header(WG_CMD_GET_DEVICE, WG_GENL_VERSION));
    m.attr_str(WGDEVICE_A_IFNAME, name);
    m
}

fn key32(p: &[u8]) -> Result<[u8; 32], GenlError> {
    p.try_into()
        .map_err(|_| GenlError::Malformed(format!("key of {} bytes", p.len())))
}

fn decode_peer(p: &[u8]) -> Result<PeerState, GenlError> {
    let bad = |e: raw::Malformed| GenlError::Malformed(e.0);
    let attrs = attributes(p).map_err(bad)?;
    let key = attrs
        .iter()
        .find(|(t, _)| *t == WGPEER_A_PUBLIC_KEY)
        .ok_or_else(|| GenlError::Malformed("peer without public key".into()))?;
    let mut peer = PeerState::new(WgKey(key32(key.1)?));
    for (ty, v) in attrs {
        match ty {
            WGPEER_A_PRESHARED_KEY => {
                let k = WgKey(key32(v)?);
                peer.preshared_key = (k != ZERO_KEY).then_some(k);
            }
            WGPEER_A_ENDPOINT => peer.endpoint = parse_sockaddr(v),
            WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL => {
                peer.persistent_keepalive = raw::get_u16(v).unwrap_or(0);
            }
            WGPEER_A_LAST_HANDSHAKE_TIME => {
                // struct __kernel_timespec { s64 tv_sec; s64 tv_nsec; }
                let sec = raw::get_u64(v).unwrap_or(0);
                let nsec = v.get(8..).and_then(raw::get_u64).unwrap_or(0);
                if sec != 0 || nsec != 0 {
                    peer.last_handshake = Some(Duration::new(
                        sec,
                        u32::try_from(nsec.min(999_999_999)).unwrap_or(0),
                    ));
                }
            }
            WGPEER_A_RX_BYTES => peer.rx_bytes = raw::get_u64(v).unwrap_or(0),
            WGPEER_A_TX_BYTES => peer.tx_bytes = raw::get_u64(v).unwrap_or(0),
            WGPEER_A_ALLOWEDIPS => {
                for (_, ip) in attributes(v).map_err(bad)? {
                    let fields = attributes(ip).map_err(bad)?;
                    let get = |t| fields.iter().find(|(x, _)| *x == t).map(|(_, p)| *p);
                    let addr = match get(WGALLOWEDIP_A_IPADDR) {
                        Some(a) if a.len() == 4 => {
                            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(a).unwrap_or_default()))
                        }
                        Some(a) if a.len() == 16 => {
                            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(a).unwrap_or_default()))
                        }
                        _ => return Err(GenlError::Malformed("allowed IP address".into())),
                    };
                    let len = get(WGALLOWEDIP_A_CIDR_MASK)
                        .and_then(|p| p.first().copied())
                        .ok_or_else(|| GenlError::Malformed("allowed IP mask".into()))?;
                    let net = IpNet::new(addr, len)
                        .map_err(|_| GenlError::Malformed(format!("allowed IP {addr}/{len}")))?;
                    peer.allowed_ips.insert(net);
                }
            }
            _ => {}
        }
    }
    Ok(peer)
}

/// Decodes the payloads (genl header included) of a GET dump into one device state.
pub fn decode_get(payloads: &[Vec<u8>]) -> Result<DeviceState, GenlError> {
    let mut state = DeviceState::default();
    for payload in payloads {
        let attrs = attributes(payload.get(4..).unwrap_or_default())
            .map_err(|e| GenlError::Malformed(e.0))?;
        for (ty, v) in attrs {
            match ty {
                WGDEVICE_A_PRIVATE_KEY => {
                    let k = key32(v)?;
                    if k != [0; 32] {
                        state.private_key = Some(PrivateKey::from_bytes(k));
                    }
                }
                WGDEVICE_A_LISTEN_PORT => state.listen_port = raw::get_u16(v).unwrap_or(0),
                WGDEVICE_A_FWMARK => state.fwmark = raw::get_u32(v).unwrap_or(0),
                WGDEVICE_A_PEERS => {
                    for (_, p) in attributes(v).map_err(|e| GenlError::Malformed(e.0))? {
                        let peer = decode_peer(p)?;
                        match state.peers.last_mut() {
                            // The dump continues a peer whose allowed IPs did not fit.
                            Some(last) if last.public_key == peer.public_key => {
                                last.allowed_ips.extend(peer.allowed_ips);
                            }
                            _ => state.peers.push(peer),
                        }
                    }
                }
                _ => {}
            }
        }
    }
    Ok(state)
}

/// A kernel WireGuard device's control channel. The socket is opened when the control is
/// made, in the network namespace of the calling thread, and reused.
#[derive(Debug, Clone)]
pub struct KernelControl {
    name: String,
    socket: Arc<Mutex<RawSocket>>,
}

impl KernelControl {
    /// The control channel of kernel device `name`.
    pub fn open(name: impl Into<String>) -> Result<Self, GenlError> {
        let name = name.into();
        let socket = RawSocket::open(GENERIC_NETLINK).map_err(|source| GenlError::Request {
            op: "open",
            device: name.clone(),
            source,
        })?;
        Ok(KernelControl {
            name,
            socket: Arc::new(Mutex::new(socket)),
        })
    }

    async fn run<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut RawSocket, u16, &str) -> Result<T, RawError> + Send + 'static,
    ) -> Result<T, GenlError> {
        let name = self.name.clone();
        let socket = self.socket.clone();
        let device = name.clone();
        tokio::task::spawn_blocking(move || {
            let req = |source| GenlError::Request {
                op,
                device: name.clone(),
                source,
            };
            let mut socket = socket
                .lock()
                .map_err(|_| req(RawError::Io(std::io::Error::other("socket lock poisoned"))))?;
            let family = resolve_family(&mut socket, WG_GENL_NAME).map_err(|e| {
                if e.errno() == Some(libc::ENOENT) {
                    GenlError::NoFamily(e)
                } else {
                    req(e)
                }
            })?;
            f(&mut socket, family, &name).map_err(req)
        })
        .await
        .map_err(|e| GenlError::Request {
            op,
            device,
            source: RawError::Io(std::io::Error::other(e.to_string())),
        })?
    }

    /// Reads the device.
    pub async fn get(&self) -> Result<DeviceState, GenlError> {
        let payloads = self
            .run("get", |socket, family, name| {
                let answers = socket.request(encode_get(family, name))?;
                Ok(answers.into_iter().map(|(_, p)| p).collect::<Vec<_>>())
            })
            .await?;
        decode_get(&payloads)
    }

    /// Applies `config`.
    pub async fn set(&self, config: &DeviceConfig) -> Result<(), GenlError> {
        if config.is_empty() {
            return Ok(());
        }
        let config = config.clone();
        self.run("set", move |socket, family, name| {
            for m in encode_set(family, name, &config) {
                socket.request(m)?;
            }
            Ok(())
        })
        .await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;
    use crate::netlink::raw::messages;

    fn key(b: u8) -> WgKey {
        WgKey([b; 32])
    }

    fn peer(b: u8, nets: &[&str]) -> PeerConfig {
        PeerConfig {
            public_key: key(b),
            remove: false,
            preshared_key: Some(key(0xee)),
            endpoint: Some("192.168.10.2:51820".parse().unwrap()),
            persistent_keepalive: Some(25),
            replace_allowed_ips: true,
            allowed_ips: nets.iter().map(|n| n.parse().unwrap()).collect(),
        }
    }

    /// Turns SET messages into the GET answer the kernel would give for them, by re-reading
    /// the attribute tree: proves the nesting and the field encodings are consistent.
    fn as_get_payloads(msgs: Vec<MessageBuilder>) -> Vec<Vec<u8>> {
        msgs.into_iter()
            .map(|m| {
                let bytes = m.finish(1);
                let parsed = messages(&bytes).unwrap();
                parsed[0].payload.to_vec()
            })
            .collect()
    }

    #[test]
    fn set_message_layout() {
        let config = DeviceConfig {
            private_key: Some(PrivateKey::from_bytes([0x11; 32])),
            listen_port: Some(51820),
            replace_peers: false,
            peers: vec![
                peer(0xab, &["10.244.2.0/24", "fd00:244:2::/64"]),
                PeerConfig::remove(key(1)),
            ],
        };
        let msgs = encode_set(0x1d, "flannel-wg", &config);
        assert_eq!(msgs.len(), 1);
        let bytes = msgs[0].clone().finish(3);
        let m = messages(&bytes).unwrap()[0];
        assert_eq!(m.msg_type, 0x1d);
        assert_eq!(m.flags, NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(&m.payload[..4], &[WG_CMD_SET_DEVICE, 1, 0, 0]);
        let attrs = attributes(&m.payload[4..]).unwrap();
        let types: Vec<u16> = attrs.iter().map(|a| a.0).collect();
        assert_eq!(
            types,
            [
                WGDEVICE_A_IFNAME,
                WGDEVICE_A_PRIVATE_KEY,
                WGDEVICE_A_LISTEN_PORT,
                WGDEVICE_A_PEERS
            ]
        );
        assert_eq!(attrs[0].1, b"flannel-wg\0");
        assert_eq!(raw::get_u16(attrs[2].1), Some(51820));
        let peers = attributes(attrs[3].1).unwrap();
        assert_eq!(peers.len(), 2);
        let first = attributes(peers[0].1).unwrap();
        let flags = first.iter().find(|a| a.0 == WGPEER_A_FLAGS).unwrap();
        assert_eq!(raw::get_u32(flags.1), Some(WGPEER_F_REPLACE_ALLOWEDIPS));
        let ep = first.iter().find(|a| a.0 == WGPEER_A_ENDPOINT).unwrap();
        assert_eq!(ep.1.len(), 16);
        assert_eq!(&ep.1[2..8], &[0xca, 0x6c, 192, 168, 10, 2]);
        let second = attributes(peers[1].1).unwrap();
        assert_eq!(second.len(), 2);
        assert_eq!(raw::get_u32(second[1].1), Some(WGPEER_F_REMOVE_ME));

        // Reading the message back as a device gives the configured values.
        let state = decode_get(&as_get_payloads(msgs)).unwrap();
        assert_eq!(state.listen_port, 51820);
        assert_eq!(state.private_key, Some(PrivateKey::from_bytes([0x11; 32])));
        assert_eq!(state.peers.len(), 2);
        let p = &state.peers[0];
        assert_eq!(p.public_key, key(0xab));
        assert_eq!(p.preshared_key, Some(key(0xee)));
        assert_eq!(p.persistent_keepalive, 25);
        assert_eq!(p.endpoint, Some("192.168.10.2:51820".parse().unwrap()));
        let ips: Vec<String> = p.allowed_ips.iter().map(ToString::to_string).collect();
        assert_eq!(ips, ["10.244.2.0/24", "fd00:244:2::/64"]);
    }

    #[test]
    fn ipv6_endpoint_round_trips() {
        let ep: SocketAddr = "[fd00:10::2]:51821".parse().unwrap();
        let bytes = sockaddr(ep);
        assert_eq!(bytes.len(), 28);
        assert_eq!(raw::get_u16(&bytes), Some(AF_INET6));
        assert_eq!(parse_sockaddr(&bytes), Some(ep));
        assert_eq!(parse_sockaddr(&[2, 0]), None);
    }

    #[test]
    fn many_peers_are_split_and_merge_back() {
        let peers: Vec<PeerConfig> = (0..600u16)
            .map(|i| {
                let mut p = peer(0, &[]);
                p.public_key.0[..2].copy_from_slice(&i.to_be_bytes());
                p.allowed_ips = vec![
                    IpNet::new(
                        IpAddr::V4(Ipv4Addr::new(10, (i >> 8) as u8, i as u8, 0)),
                        24,
                    )
                    .unwrap(),
                ];
                p
            })
            .collect();
        let config = DeviceConfig {
            private_key: Some(PrivateKey::from_bytes([0x22; 32])),
            listen_port: Some(1),
            replace_peers: true,
            peers,
        };
        let msgs = encode_set(0x1d, "flannel-wg", &config);
        assert!(msgs.len() > 1, "{} messages", msgs.len());
        for m in &msgs {
            assert!(m.len() <= MAX_SET_MESSAGE, "{}", m.len());
        }
        // Only the first message carries the device-level attributes.
        let later = msgs[1].clone().finish(1);
        let later = messages(&later).unwrap()[0].payload.to_vec();
        let types: Vec<u16> = attributes(&later[4..])
            .unwrap()
            .iter()
            .map(|a| a.0)
            .collect();
        assert_eq!(types, [WGDEVICE_A_IFNAME, WGDEVICE_A_PEERS]);
        let state = decode_get(&as_get_payloads(msgs)).unwrap();
        assert_eq!(state.peers.len(), 600);
        assert_eq!(state.private_key, Some(PrivateKey::from_bytes([0x22; 32])));
    }

    #[test]
    fn a_peer_split_over_two_dump_messages_is_merged() {
        let mut a = peer(5, &["10.244.2.0/24"]);
        let first = encode_set(
            1,
            "x",
            &DeviceConfig {
                peers: vec![a.clone()],
                ..DeviceConfig::default()
            },
        );
        a.allowed_ips = vec!["fd00::/64".parse().unwrap()];
        let second = encode_set(
            1,
            "x",
            &DeviceConfig {
                peers: vec![a],
                ..DeviceConfig::default()
            },
        );
        let mut payloads = as_get_payloads(first);
        payloads.extend(as_get_payloads(second));
        let state = decode_get(&payloads).unwrap();
        assert_eq!(state.peers.len(), 1);
        assert_eq!(state.peers[0].allowed_ips.len(), 2);
    }

    #[test]
    fn family_request_layout() {
        let bytes = family_request("wireguard").finish(1);
        let m = messages(&bytes).unwrap()[0];
        assert_eq!(m.msg_type, GENL_ID_CTRL);
        assert_eq!(&m.payload[..4], &[CTRL_CMD_GETFAMILY, 1, 0, 0]);
        let attrs = attributes(&m.payload[4..]).unwrap();
        assert_eq!(attrs, vec![(CTRL_ATTR_FAMILY_NAME, &b"wireguard\0"[..])]);
    }

    /// The request/answer plumbing against the real kernel: `nlctrl` resolves to its fixed
    /// id, an unknown family is `ENOENT`, and without the wireguard module the control
    /// channel says so.
    #[tokio::test]
    async fn family_lookup_against_the_kernel() {
        let mut socket = RawSocket::open(GENERIC_NETLINK).unwrap();
        assert_eq!(resolve_family(&mut socket, "nlctrl").unwrap(), GENL_ID_CTRL);
        let e = resolve_family(&mut socket, "flannel-no-such").unwrap_err();
        assert_eq!(e.errno(), Some(libc::ENOENT));
        let has_wireguard = resolve_family(&mut socket, WG_GENL_NAME).is_ok();
        let control = KernelControl::open("flannel-wg-t0").unwrap();
        match control.get().await {
            Err(GenlError::NoFamily(_)) => assert!(!has_wireguard),
            // With the module: the device does not exist.
            Err(GenlError::Request { source, .. }) => {
                assert!(has_wireguard);
                assert_eq!(source.errno(), Some(libc::ENODEV));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn garbage_does_not_panic() {
        assert!(decode_get(&[vec![0, 1, 0, 0, 8, 0, 8, 0, 4, 0]]).is_err());
        let _ = decode_get(&[vec![1, 2]]);
    }
}
