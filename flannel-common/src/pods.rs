//! Local pods behind the pod bridge, for delivering packets straight into a pod's network
//! namespace (`bpf_redirect_peer`) instead of through the bridge.
//!
//! The agent mirrors the bridge's forwarding database into [`PORTS`]: for every MAC address
//! the bridge learnt on one of its veth ports, the host-side veth and the bridge. When the
//! programs deliver a packet to a local pod, `bpf_fib_lookup` gives the pod's MAC (from the
//! bridge's neighbour table); if [`PORTS`] knows that MAC on the same bridge, the packet goes
//! into the veth's peer (the pod's `eth0`) directly, skipping the bridge, the veth transmit and
//! the backlog queue on the way in. Otherwise it goes to the bridge as before.
//!
//! Only veth ports are listed: `bpf_redirect_peer` drops packets for devices without a peer.

use crate::maps::MAX_OBJ_NAME_LEN;

/// Hash of pod MACs → their bridge port ([`PortKey`] → [`PodPort`]). Not pinned: a
/// restarted agent fills it again from the bridge's forwarding database.
pub const PORTS: &str = "FLANNEL_PORTS";
/// Most pods (MACs) [`PORTS`] holds.
pub const PORTS_MAX_ENTRIES: u32 = 4096;

const _: () = assert!(PORTS.len() <= MAX_OBJ_NAME_LEN);

/// [`PORTS`]'s key: a pod's MAC address. 8 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortKey {
    /// The pod's MAC address (its `eth0`).
    pub mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
}

impl PortKey {
    /// The key of `mac`.
    pub const fn new(mac: [u8; 6]) -> Self {
        PortKey { mac, _pad: [0; 2] }
    }
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for PortKey {}

/// [`PORTS`]'s value: where the pod with that MAC sits. 8 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PodPort {
    /// Interface index of the host side of the pod's veth (the bridge port).
    pub ifindex: u32,
    /// Interface index of the bridge it is a port of; the programs use the entry only when
    /// the route to the pod leaves through this bridge.
    pub bridge: u32,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for PodPort {}
