//! What a WireGuard device is told ([`DeviceConfig`], [`PeerConfig`]) and what it reports
//! ([`DeviceState`], [`PeerState`]). Both control channels speak these types: the UAPI text
//! protocol of userspace implementations ([`uapi`](super::uapi)) and the kernel's generic
//! netlink family ([`genl`](super::genl)).

use std::{collections::BTreeSet, net::SocketAddr, time::Duration};

use ipnet::IpNet;

use super::key::PrivateKey;
use crate::backend::WgKey;

/// The all-zero key: as a preshared key it means "none".
pub const ZERO_KEY: WgKey = WgKey([0; 32]);

/// One peer's changes (the fields of a `public_key=` block in the UAPI).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerConfig {
    /// The peer's public key (identifies it).
    pub public_key: WgKey,
    /// Remove the peer (all other fields are ignored).
    pub remove: bool,
    /// The preshared key; `Some(ZERO_KEY)` clears it, `None` leaves it.
    pub preshared_key: Option<WgKey>,
    /// The endpoint; `None` leaves it.
    pub endpoint: Option<SocketAddr>,
    /// Persistent keepalive in seconds (0 = off); `None` leaves it.
    pub persistent_keepalive: Option<u16>,
    /// Replace the allowed IPs with [`allowed_ips`](Self::allowed_ips) instead of adding.
    pub replace_allowed_ips: bool,
    /// Allowed IPs (added, or the whole set with `replace_allowed_ips`).
    pub allowed_ips: Vec<IpNet>,
}

impl PeerConfig {
    /// A removal of peer `public_key`.
    pub fn remove(public_key: WgKey) -> Self {
        PeerConfig {
            public_key,
            remove: true,
            preshared_key: None,
            endpoint: None,
            persistent_keepalive: None,
            replace_allowed_ips: false,
            allowed_ips: Vec::new(),
        }
    }
}

/// A configuration change of a device (`set=1`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// New private key; `None` leaves it.
    pub private_key: Option<PrivateKey>,
    /// New listen port; `None` leaves it.
    pub listen_port: Option<u16>,
    /// Remove every peer not named in [`peers`](Self::peers) (never used by the applier:
    /// it would drop every session for a moment).
    pub replace_peers: bool,
    /// Peer changes, applied in order.
    pub peers: Vec<PeerConfig>,
}

impl DeviceConfig {
    /// Whether the change does nothing.
    pub fn is_empty(&self) -> bool {
        self.private_key.is_none()
            && self.listen_port.is_none()
            && !self.replace_peers
            && self.peers.is_empty()
    }
}

/// A peer as the device reports it (`get=1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerState {
    /// Its public key.
    pub public_key: WgKey,
    /// Its preshared key (`None` when unset, i.e. all zero).
    pub preshared_key: Option<WgKey>,
    /// Its current endpoint (set, or learned from its packets).
    pub endpoint: Option<SocketAddr>,
    /// Persistent keepalive in seconds (0 = off).
    pub persistent_keepalive: u16,
    /// Allowed IPs.
    pub allowed_ips: BTreeSet<IpNet>,
    /// Time since the Unix epoch of the last handshake (`None` = never).
    pub last_handshake: Option<Duration>,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
}

impl PeerState {
    /// A peer with only its key known.
    pub fn new(public_key: WgKey) -> Self {
        PeerState {
            public_key,
            preshared_key: None,
            endpoint: None,
            persistent_keepalive: 0,
            allowed_ips: BTreeSet::new(),
            last_handshake: None,
            rx_bytes: 0,
            tx_bytes: 0,
        }
    }
}

/// A device as it reports itself (`get=1`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceState {
    /// Its private key (`None` when unset).
    pub private_key: Option<PrivateKey>,
    /// The UDP port it listens on (0 = none yet).
    pub listen_port: u16,
    /// The firewall mark of its packets (0 = none).
    pub fwmark: u32,
    /// Its peers.
    pub peers: Vec<PeerState>,
}

impl DeviceState {
    /// The peer with `public_key`, if configured.
    pub fn peer(&self, public_key: &WgKey) -> Option<&PeerState> {
        self.peers.iter().find(|p| &p.public_key == public_key)
    }
}
