//! IPv6 on the fast path: the local configuration, the flow keys and the map names.
//!
//! The IPv6 side mirrors the IPv4 one with maps of its own, so that a dual-stack node runs
//! both families side by side and an IPv6-only node (kube mode, `EnableIPv4: false`) runs the
//! IPv6 side alone (its IPv4 [`crate::config::Config`] stays disabled):
//!
//! | map | type | key → value | written by |
//! |---|---|---|---|
//! | [`CONFIG6`] | array (1) | 0 → [`Config6`] | agent |
//! | [`ROUTES6`] | LPM trie | remote IPv6 pod subnet (`prefix_len` + 16 bytes) → [`crate::route::RemoteEntry6`] | agent (`sync6`) |
//! | [`NODES6`] | hash | a VXLAN peer's public IPv6 → [`crate::route::NodeEntry`] | agent (`sync6`) |
//! | [`NAT_GUARD6`] | LRU hash | [`PeerKey6`] → `u32` | `tc_from_netdev` |
//! | [`KERNEL_FLOWS6`] | LRU hash | [`FlowKey6`] → `u32` | `tc_to_netdev` |
//! | [`HELD_GUARD6`] | hash | [`PeerKey6`] → `u32` | agent (from conntrack) |
//! | [`HELD_FLOWS6`] | hash | [`FlowKey6`] → `u32` | agent (from conntrack) |
//!
//! What each does is what its IPv4 twin does (`flannel_ebpf::deliver` explains the flow
//! tables), and they are pinned as their twins are ([`crate::maps::PINNED`]), so a restarted
//! agent keeps the IPv6 flow tables too. Addresses are network-order bytes.

use crate::maps::MAX_OBJ_NAME_LEN;

/// Single-entry array holding [`Config6`].
pub const CONFIG6: &str = "FLANNEL_CONFIG6";
/// LPM trie of remote IPv6 pod subnets.
pub const ROUTES6: &str = "FLANNEL_ROUTES6";
/// Maximum remote IPv6 subnets.
pub const ROUTES6_MAX_ENTRIES: u32 = 65536;
/// Hash of VXLAN peers by public IPv6.
pub const NODES6: &str = "FLANNEL_NODES6";
/// Maximum IPv6 tunnel peers.
pub const NODES6_MAX_ENTRIES: u32 = 65536;
/// LRU of remote IPv6 pod endpoints that contacted a host address of this node.
pub const NAT_GUARD6: &str = "FLANNEL_NATGRD6";
/// Size of [`NAT_GUARD6`].
pub const NAT_GUARD6_MAX_ENTRIES: u32 = 16384;
/// LRU of local pod → remote pod IPv6 flows that left through the kernel.
pub const KERNEL_FLOWS6: &str = "FLANNEL_KFLOWS6";
/// Size of [`KERNEL_FLOWS6`].
pub const KERNEL_FLOWS6_MAX_ENTRIES: u32 = 65536;
/// Hash of the NAT-guard keys of open NATed IPv6 TCP connections and UDP streams (see
/// [`crate::maps::HELD_GUARD4`]).
pub const HELD_GUARD6: &str = "FLANNEL_HNATGD6";
/// Size of [`HELD_GUARD6`].
pub const HELD_GUARD6_MAX_ENTRIES: u32 = 16384;
/// Hash of the kernel-flow keys of open NATed IPv6 TCP connections and UDP streams (see
/// [`crate::maps::HELD_FLOWS4`]).
pub const HELD_FLOWS6: &str = "FLANNEL_HFLOWS6";
/// Size of [`HELD_FLOWS6`].
pub const HELD_FLOWS6_MAX_ENTRIES: u32 = 65536;

/// [`Config6::flags`]: the entry is complete; without it IPv6 packets are passed.
pub const CFG6_ENABLED: u32 = 1 << 0;
/// [`Config6::flags`]: VXLAN over IPv6 for pod-to-pod flows is received in eBPF.
pub const CFG6_VXLAN_RX: u32 = 1 << 1;
/// [`Config6::flags`]: plain (host-gw) IPv6 pod-to-pod packets are delivered in eBPF.
pub const CFG6_ROUTED_RX: u32 = 1 << 2;

/// Bytes VXLAN over IPv6 adds after the outer Ethernet header: IPv6 40 + UDP 8 + VXLAN 8 +
/// inner Ethernet 14.
pub const VXLAN6_OVERHEAD: usize = 70;

/// The local node's IPv6 configuration: the single entry of [`CONFIG6`]. 84 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Config6 {
    /// `CFG6_*` bits.
    pub flags: u32,
    /// The external interface.
    pub ext_ifindex: u32,
    /// Our public IPv6 (`ExtV6Addr`): outer source of VXLAN we send, outer destination we
    /// decapsulate.
    pub public_ip: [u8; 16],
    /// Our IPv6 lease, network address.
    pub local_subnet: [u8; 16],
    /// Its prefix length (0..=128).
    pub local_prefix_len: u32,
    /// `IPv6Network`.
    pub cluster_net: [u8; 16],
    /// Its prefix length (0..=128).
    pub cluster_prefix_len: u32,
    /// The VNI of `flannel-v6.<VNI>` (0 without VXLAN).
    pub vni: u32,
    /// Its UDP port.
    pub vxlan_port: u16,
    /// Lowest VXLAN UDP source port.
    pub src_port_min: u16,
    /// VXLAN UDP source ports are below this.
    pub src_port_max: u16,
    /// Hop limit of outer headers (the kernel's `hop_limit` of the external interface).
    pub hop_limit: u8,
    /// Explicit padding; always zero.
    pub _pad0: u8,
    /// The MAC of `flannel-v6.<VNI>`: inner source of VXLAN we send, inner destination of VXLAN
    /// we decapsulate.
    pub vtep_mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad1: [u8; 2],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for Config6 {}

/// The two big-endian 64-bit halves of an IPv6 address (no 128-bit arithmetic: the BPF
/// target has no 128-bit shifts).
#[inline(always)]
pub fn halves(addr: &[u8; 16]) -> (u64, u64) {
    let mut hi = [0u8; 8];
    let mut lo = [0u8; 8];
    hi.copy_from_slice(&addr[..8]);
    lo.copy_from_slice(&addr[8..]);
    (u64::from_be_bytes(hi), u64::from_be_bytes(lo))
}

/// Whether `addr` lies in `net`/`prefix_len` (a prefix length above 128 matches nothing).
#[inline(always)]
pub fn in_prefix6(addr: &[u8; 16], net: &[u8; 16], prefix_len: u32) -> bool {
    if prefix_len > 128 {
        return false;
    }
    let (mask_hi, mask_lo) = if prefix_len == 0 {
        (0, 0)
    } else if prefix_len <= 64 {
        (u64::MAX << (64 - prefix_len), 0)
    } else {
        (u64::MAX, u64::MAX << (128 - prefix_len))
    };
    let (ah, al) = halves(addr);
    let (nh, nl) = halves(net);
    ah & mask_hi == nh & mask_hi && al & mask_lo == nl & mask_lo
}

impl Config6 {
    /// Whether [`CFG6_ENABLED`] is set.
    #[inline(always)]
    pub fn enabled(&self) -> bool {
        self.flags & CFG6_ENABLED != 0
    }

    /// Whether `addr` is in `IPv6Network`.
    #[inline(always)]
    pub fn in_cluster(&self, addr: &[u8; 16]) -> bool {
        in_prefix6(addr, &self.cluster_net, self.cluster_prefix_len)
    }

    /// Whether `addr` is in our own IPv6 subnet.
    #[inline(always)]
    pub fn in_local_subnet(&self, addr: &[u8; 16]) -> bool {
        in_prefix6(addr, &self.local_subnet, self.local_prefix_len)
    }

    /// Whether `addr` is a pod of this node: in the local subnet but neither its network
    /// address (`flannel-v6.<VNI>`'s address) nor the first host address (the `cni0`
    /// gateway), which belong to the host.
    #[inline(always)]
    pub fn is_local_pod(&self, addr: &[u8; 16]) -> bool {
        if !self.in_local_subnet(addr) {
            return false;
        }
        let a = halves(addr);
        let (nh, nl) = halves(&self.local_subnet);
        let gateway = match nl.checked_add(1) {
            Some(lo) => (nh, lo),
            None => (nh.wrapping_add(1), 0),
        };
        a != (nh, nl) && a != gateway
    }
}

/// A remote IPv6 endpoint: [`NAT_GUARD6`]'s key. 20 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PeerKey6 {
    /// The remote pod's address.
    pub addr: [u8; 16],
    /// Its L4 port (network order).
    pub port: [u8; 2],
    /// IP protocol (6 or 17).
    pub proto: u8,
    /// Explicit padding; always zero.
    pub _pad: u8,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for PeerKey6 {}

/// An IPv6 flow seen from this node, local side first: [`KERNEL_FLOWS6`]'s key. 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey6 {
    /// The local pod's address.
    pub local_addr: [u8; 16],
    /// The remote pod's address.
    pub remote_addr: [u8; 16],
    /// The local port (network order; the echo identifier for ICMPv6 echo).
    pub local_port: [u8; 2],
    /// The remote port.
    pub remote_port: [u8; 2],
    /// IP protocol (58, 6 or 17).
    pub proto: u8,
    /// Explicit padding; always zero.
    pub _pad: [u8; 3],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for FlowKey6 {}

/// LRU of a local pod's fragmented IPv6 datagrams to remote pods whose first fragment the fast
/// path sent ([`FragKey6`] → `u32`, unused): their later fragments follow it. Not pinned.
pub const FRAGS6: &str = "FLANNEL_FRAGS6";
/// Size of [`FRAGS6`].
pub const FRAGS6_MAX_ENTRIES: u32 = 8192;

/// A fragmented IPv6 datagram: [`FRAGS6`]'s key. 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey6 {
    /// Source address.
    pub saddr: [u8; 16],
    /// Destination address.
    pub daddr: [u8; 16],
    /// The fragment header's identification (network order).
    pub id: [u8; 4],
    /// The protocol after the fragment header.
    pub proto: u8,
    /// Explicit padding; always zero.
    pub _pad: [u8; 3],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for FragKey6 {}

const _: () = {
    assert!(core::mem::size_of::<FragKey6>() == 40);
    assert!(FRAGS6.len() <= MAX_OBJ_NAME_LEN);
    assert!(core::mem::size_of::<Config6>() == 84);
    assert!(core::mem::size_of::<PeerKey6>() == 20);
    assert!(core::mem::size_of::<FlowKey6>() == 40);
    assert!(CONFIG6.len() <= MAX_OBJ_NAME_LEN);
    assert!(ROUTES6.len() <= MAX_OBJ_NAME_LEN);
    assert!(NODES6.len() <= MAX_OBJ_NAME_LEN);
    assert!(NAT_GUARD6.len() <= MAX_OBJ_NAME_LEN);
    assert!(KERNEL_FLOWS6.len() <= MAX_OBJ_NAME_LEN);
};

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> [u8; 16] {
        s.parse::<std::net::Ipv6Addr>()
            .unwrap_or_else(|e| panic!("{s}: {e}"))
            .octets()
    }

    #[test]
    fn prefixes() {
        let net = addr("fd00:10:244::");
        assert!(in_prefix6(&addr("fd00:10:244:3::7"), &net, 48));
        assert!(!in_prefix6(&addr("fd00:10:245::7"), &net, 48));
        assert!(in_prefix6(&addr("::1"), &net, 0));
        assert!(in_prefix6(&net, &net, 128));
        assert!(!in_prefix6(&addr("fd00:10:244::1"), &net, 128));
        assert!(!in_prefix6(&net, &net, 129));
    }

    #[test]
    fn local_pods_exclude_the_host_addresses() {
        let cfg = Config6 {
            local_subnet: addr("fd00:10:244:1::"),
            local_prefix_len: 64,
            ..Config6::default()
        };
        assert!(!cfg.is_local_pod(&addr("fd00:10:244:1::")));
        assert!(!cfg.is_local_pod(&addr("fd00:10:244:1::1")));
        assert!(cfg.is_local_pod(&addr("fd00:10:244:1::2")));
        assert!(cfg.is_local_pod(&addr("fd00:10:244:1:ffff::5")));
        assert!(!cfg.is_local_pod(&addr("fd00:10:244:2::2")));
    }
}
