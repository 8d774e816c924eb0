//! The fast path's routing state: where each remote pod subnet lives and how to reach it.
//!
//! One map entry per remote lease, written by the agent (`flannel_agent::bpf::FastPath::sync`)
//! from the reconciler's desired set:
//!
//! | map | key | value |
//! |---|---|---|
//! | [`crate::maps::ROUTES4`] (LPM trie) | remote pod subnet (`prefix_len` + 4 address bytes) | [`RemoteEntry`] |
//! | [`crate::maps::NODES4`] (hash) | a tunnel peer's public IPv4 (4 bytes) | [`NodeEntry`] |
//!
//! IPv6 will use the same design with a second trie keyed by 16 address bytes and
//! [`RemoteEntry6`] (defined here so the layout is settled; no v6 map exists yet).
//!
//! All addresses are stored as bytes in network order, exactly as they appear in packets.

/// How packets for a remote subnet are sent: [`RemoteEntry::kind`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RouteKind {
    /// Plain routing to the peer (host-gw backend, or DirectRouting under vxlan/ipip): the
    /// program asks the kernel FIB for the next hop (`bpf_fib_lookup`) and redirects.
    HostGw = 1,
    /// VXLAN, built in the program exactly as a kernel `flannel.<VNI>` device would.
    Vxlan = 2,
    /// IPv4-in-IPv4 (protocol 4), built in the program.
    Ipip = 3,
    /// The udp backend's encapsulation (the inner IPv4 packet as the payload of a UDP
    /// datagram, no header of its own), built in the program exactly as the TUN path sends it;
    /// see [`crate::udp`].
    Udp = 4,
}

impl RouteKind {
    /// The kind stored as `kind`, if it is one.
    pub const fn from_u32(kind: u32) -> Option<RouteKind> {
        match kind {
            1 => Some(RouteKind::HostGw),
            2 => Some(RouteKind::Vxlan),
            3 => Some(RouteKind::Ipip),
            4 => Some(RouteKind::Udp),
            _ => None,
        }
    }

    /// A stable lower-case name for logs and status.
    pub const fn name(self) -> &'static str {
        match self {
            RouteKind::HostGw => "host-gw",
            RouteKind::Vxlan => "vxlan",
            RouteKind::Ipip => "ipip",
            RouteKind::Udp => "udp",
        }
    }
}

/// [`RemoteEntry::flags`]: the peer is reached by DirectRouting (a vxlan or ipip peer on our
/// L2 segment, sent host-gw style). Informational; the kind is already [`RouteKind::HostGw`].
pub const ROUTE_F_DIRECT: u32 = 1 << 0;

/// The value of [`crate::maps::ROUTES4`]: how to reach one remote pod subnet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RemoteEntry {
    /// A [`RouteKind`] as `u32` (0 is invalid; the program passes such packets to the kernel).
    pub kind: u32,
    /// `ROUTE_F_*` bits.
    pub flags: u32,
    /// The peer's public IP (outer destination of VXLAN and IPIP packets), network order.
    pub public_ip: [u8; 4],
    /// VXLAN network identifier written into the VXLAN header (host order, 24 bits used).
    pub vni: u32,
    /// The peer's VTEP MAC (its `flannel.<VNI>` MAC): inner Ethernet destination for VXLAN.
    pub vtep_mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for RemoteEntry {}

/// The IPv6 twin of [`RemoteEntry`] for the future v6 trie (key: `prefix_len` + 16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RemoteEntry6 {
    /// A [`RouteKind`] as `u32`.
    pub kind: u32,
    /// `ROUTE_F_*` bits.
    pub flags: u32,
    /// The peer's public IPv6, network order.
    pub public_ip: [u8; 16],
    /// VXLAN network identifier (host order).
    pub vni: u32,
    /// The peer's VTEP MAC (`flannel-v6.<VNI>`).
    pub vtep_mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for RemoteEntry6 {}

/// [`NodeEntry::flags`]: the node may send us IPIP; `tc_from_netdev` decapsulates it.
pub const NODE_F_IPIP: u32 = 1 << 0;
/// [`NodeEntry::flags`]: the node is a VXLAN peer; `tc_from_netdev` may decapsulate its VXLAN.
pub const NODE_F_VXLAN: u32 = 1 << 1;

/// The value of [`crate::maps::NODES4`] (keyed by the node's public IPv4): which tunnels we
/// accept from that node. Derived by the agent from the [`RemoteEntry`] set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NodeEntry {
    /// `NODE_F_*` bits.
    pub flags: u32,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for NodeEntry {}

const _: () = {
    assert!(core::mem::size_of::<RemoteEntry>() == 24);
    assert!(core::mem::size_of::<RemoteEntry6>() == 36);
    assert!(core::mem::size_of::<NodeEntry>() == 4);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip() {
        for kind in [
            RouteKind::HostGw,
            RouteKind::Vxlan,
            RouteKind::Ipip,
            RouteKind::Udp,
        ] {
            assert_eq!(RouteKind::from_u32(kind as u32), Some(kind));
        }
        assert_eq!(RouteKind::from_u32(0), None);
        assert_eq!(RouteKind::from_u32(5), None);
        assert_eq!(RouteKind::Udp.name(), "udp");
        assert_eq!(RouteKind::Vxlan.name(), "vxlan");
    }
}
