//! The difference between a device's desired configuration and what it reports, as one
//! [`DeviceConfig`]: a pure function, so restart, resync and lease changes are the same
//! code and a device already in the desired state receives nothing.
//!
//! * private key or listen port differ → set them;
//! * a desired peer missing, or with another endpoint, preshared key, keepalive or allowed
//!   IPs → set it whole (`replace_allowed_ips`); peers already right are not touched, so
//!   their sessions go on;
//! * a peer not desired → removed, only in [`SyncMode::Full`] (never while the lease set is
//!   incomplete). Unlike upstream's `ReplacePeers` at start, nothing is flushed.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
};

use ipnet::IpNet;

use super::{
    config::{DeviceConfig, DeviceState, PeerConfig, PeerState, ZERO_KEY},
    key::PrivateKey,
};
use crate::{backend::WgKey, dataplane::SyncMode};

/// One desired peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredPeer {
    /// Where to send its packets.
    pub endpoint: SocketAddr,
    /// Its subnets.
    pub allowed_ips: BTreeSet<IpNet>,
    /// The network's preshared key (`PSK` option).
    pub preshared_key: Option<WgKey>,
    /// `PersistentKeepaliveInterval` in seconds (0 = off).
    pub keepalive: u16,
}

/// One device's desired configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredDevice {
    /// The node's private key.
    pub private_key: PrivateKey,
    /// The port to listen on.
    pub listen_port: u16,
    /// Peers by public key.
    pub peers: BTreeMap<WgKey, DesiredPeer>,
}

/// The change to make and what it amounts to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerPlan {
    /// The change (empty when in sync).
    pub config: DeviceConfig,
    /// Peers added.
    pub added: u64,
    /// Peers changed.
    pub replaced: u64,
    /// Peers removed.
    pub deleted: u64,
    /// Peers already right.
    pub unchanged: u64,
    /// Whether the private key or listen port is set.
    pub device_changed: bool,
}

fn matches(have: &PeerState, want: &DesiredPeer) -> bool {
    have.endpoint == Some(want.endpoint)
        && have.preshared_key == want.preshared_key
        && have.persistent_keepalive == want.keepalive
        && have.allowed_ips == want.allowed_ips
}

/// Computes the change that makes `have` equal `want` (see the module documentation).
pub fn plan(have: &DeviceState, want: &DesiredDevice, mode: SyncMode) -> PeerPlan {
    let mut out = PeerPlan::default();
    if have.private_key.as_ref() != Some(&want.private_key) {
        out.config.private_key = Some(want.private_key.clone());
        out.device_changed = true;
    }
    if have.listen_port != want.listen_port {
        out.config.listen_port = Some(want.listen_port);
        out.device_changed = true;
    }
    for (key, peer) in &want.peers {
        match have.peer(key) {
            Some(h) if matches(h, peer) => {
                out.unchanged += 1;
                continue;
            }
            Some(_) => out.replaced += 1,
            None => out.added += 1,
        }
        out.config.peers.push(PeerConfig {
            public_key: *key,
            remove: false,
            preshared_key: Some(peer.preshared_key.unwrap_or(ZERO_KEY)),
            endpoint: Some(peer.endpoint),
            persistent_keepalive: Some(peer.keepalive),
            replace_allowed_ips: true,
            allowed_ips: peer.allowed_ips.iter().copied().collect(),
        });
    }
    if mode == SyncMode::Full {
        for h in &have.peers {
            if !want.peers.contains_key(&h.public_key) {
                out.deleted += 1;
                out.config.peers.push(PeerConfig::remove(h.public_key));
            }
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn key(b: u8) -> WgKey {
        WgKey([b; 32])
    }

    fn want_peer(ep: &str, nets: &[&str]) -> DesiredPeer {
        DesiredPeer {
            endpoint: ep.parse().unwrap(),
            allowed_ips: nets.iter().map(|n| n.parse().unwrap()).collect(),
            preshared_key: Some(key(0xee)),
            keepalive: 25,
        }
    }

    fn have_peer(k: WgKey, w: &DesiredPeer) -> PeerState {
        PeerState {
            endpoint: Some(w.endpoint),
            allowed_ips: w.allowed_ips.clone(),
            preshared_key: w.preshared_key,
            persistent_keepalive: w.keepalive,
            ..PeerState::new(k)
        }
    }

    fn desired() -> DesiredDevice {
        DesiredDevice {
            private_key: PrivateKey::from_bytes([1; 32]),
            listen_port: 51820,
            peers: [
                (key(2), want_peer("192.168.10.2:51820", &["10.244.2.0/24"])),
                (key(3), want_peer("192.168.10.3:51820", &["10.244.3.0/24"])),
            ]
            .into_iter()
            .collect(),
        }
    }

    #[test]
    fn fresh_device_gets_everything() {
        let p = plan(&DeviceState::default(), &desired(), SyncMode::Full);
        assert!(p.device_changed);
        assert_eq!(p.config.listen_port, Some(51820));
        assert_eq!(p.config.private_key, Some(PrivateKey::from_bytes([1; 32])));
        assert!(!p.config.replace_peers);
        assert_eq!((p.added, p.replaced, p.deleted, p.unchanged), (2, 0, 0, 0));
        let first = &p.config.peers[0];
        assert_eq!(first.public_key, key(2));
        assert!(first.replace_allowed_ips && !first.remove);
        assert_eq!(first.preshared_key, Some(key(0xee)));
        assert_eq!(first.persistent_keepalive, Some(25));
    }

    #[test]
    fn in_sync_device_gets_nothing() {
        let want = desired();
        let have = DeviceState {
            private_key: Some(want.private_key.clone()),
            listen_port: 51820,
            fwmark: 0,
            peers: want.peers.iter().map(|(k, w)| have_peer(*k, w)).collect(),
        };
        let p = plan(&have, &want, SyncMode::Full);
        assert!(p.config.is_empty(), "{:?}", p.config);
        assert_eq!(p.unchanged, 2);
    }

    #[test]
    fn changed_stale_and_add_only() {
        let want = desired();
        let mut moved = have_peer(key(3), &want.peers[&key(3)]);
        moved.endpoint = Some("192.168.10.9:51820".parse().unwrap());
        let stale = have_peer(key(9), &want_peer("192.168.10.9:1", &["10.244.9.0/24"]));
        let have = DeviceState {
            private_key: Some(want.private_key.clone()),
            listen_port: 51820,
            fwmark: 0,
            peers: vec![have_peer(key(2), &want.peers[&key(2)]), moved, stale],
        };
        let p = plan(&have, &want, SyncMode::Full);
        assert!(!p.device_changed);
        assert_eq!((p.added, p.replaced, p.deleted, p.unchanged), (0, 1, 1, 1));
        assert_eq!(p.config.peers.len(), 2);
        assert_eq!(p.config.peers[0].public_key, key(3));
        assert_eq!(p.config.peers[1], PeerConfig::remove(key(9)));
        // Without a complete lease set nothing is removed.
        let p = plan(&have, &want, SyncMode::AddOnly);
        assert_eq!((p.replaced, p.deleted), (1, 0));
        assert!(p.config.peers.iter().all(|c| !c.remove));
    }

    #[test]
    fn psk_removal_is_explicit() {
        let mut want = desired();
        for p in want.peers.values_mut() {
            p.preshared_key = None;
        }
        let have = DeviceState {
            private_key: Some(want.private_key.clone()),
            listen_port: 51820,
            fwmark: 0,
            peers: desired()
                .peers
                .iter()
                .map(|(k, w)| have_peer(*k, w))
                .collect(),
        };
        let p = plan(&have, &want, SyncMode::Full);
        assert_eq!(p.replaced, 2);
        assert!(
            p.config
                .peers
                .iter()
                .all(|c| c.preshared_key == Some(ZERO_KEY))
        );
    }
}
