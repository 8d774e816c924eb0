//! The udp backend on the fast path: its configuration entry and its wire format.
//!
//! The udp backend (upstream's, flannel-upstream.md 2.5) carries a pod's IPv4 packet as the
//! whole payload of a UDP datagram, with no header of its own:
//!
//! ```text
//! outer IPv4  IHL 5, TOS 0, DF, ID 0, TTL 64 (ip_default_ttl), protocol 17,
//!             source = the node's interface address (IfaceAddr, where the TUN path's socket
//!             is bound), destination = the peer's PublicIP
//! UDP         source port = destination port = the configured Port (8285), checksum 0
//! payload     the inner IPv4 packet, byte for byte, TTL already decremented twice (once by
//!             the kernel's forwarding into flannel0, once by the forwarder)
//! ```
//!
//! That is what the TUN path's unconnected socket sends (DF with no connected peer gives ID 0;
//! its UDP checksum is offloaded or computed, 0 is equally valid over IPv4 and every receiver,
//! upstream's C proxy included, accepts it).
//!
//! The configuration lives in its own single-entry map, [`UDP_CONFIG`], next to
//! [`crate::maps::CONFIG`]: the programs only use the udp encapsulation when its entry is
//! enabled, and the TUN path (`flannel0` + the agent's forwarder) keeps everything else.

use crate::maps::MAX_OBJ_NAME_LEN;

/// Single-entry array holding [`UdpConfig`].
pub const UDP_CONFIG: &str = "FLANNEL_UDPCFG";

/// [`UdpConfig::flags`]: the entry is complete; without it `RouteKind::Udp` entries are passed
/// to the kernel (and so to `flannel0`) and received datagrams are left to the socket.
pub const UDP_CFG_ENABLED: u32 = 1 << 0;

/// Outer header bytes the encapsulation adds: IPv4 20 + UDP 8.
pub const UDP_OVERHEAD: usize = 28;

/// How much the inner TTL drops on each side: once for the kernel's forwarding between the pod
/// bridge and `flannel0`, once for the forwarder (the TUN path does both; the fast path, which
/// skips both hops, does the same arithmetic so that both paths put the same bytes on the wire
/// and into the pod).
pub const UDP_TTL_DECREMENT: u8 = 2;

/// The udp backend's settings on this node: the single entry of [`UDP_CONFIG`]. 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UdpConfig {
    /// `UDP_CFG_*` bits.
    pub flags: u32,
    /// The interface address (`IfaceAddr`) the TUN path's socket is bound to: outer source of
    /// what we send, outer destination of what we decapsulate. Network order.
    pub iface_addr: [u8; 4],
    /// The configured `Port` (host order): source and destination port of every datagram.
    pub port: u16,
    /// Explicit padding; always zero.
    pub _pad: u16,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for UdpConfig {}

impl UdpConfig {
    /// Whether [`UDP_CFG_ENABLED`] is set.
    #[inline(always)]
    pub fn enabled(&self) -> bool {
        self.flags & UDP_CFG_ENABLED != 0
    }
}

const _: () = {
    assert!(core::mem::size_of::<UdpConfig>() == 12);
    assert!(UDP_CONFIG.len() <= MAX_OBJ_NAME_LEN);
};
