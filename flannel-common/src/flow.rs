//! Keys of the two flow-tracking LRU maps that keep the fast path consistent with the kernel's
//! conntrack (why they exist: `flannel_ebpf::deliver`).
//!
//! | map | key | learnt by | consulted by |
//! |---|---|---|---|
//! | [`crate::maps::NAT_GUARD4`] | [`PeerKey`]: a remote pod's address, port, protocol | `tc_from_netdev`, for packets from a remote pod to a *host* address of this node (node IP, `cni0` gateway, tunnel address), which a hostPort or NodePort DNAT may send on to a local pod | `tc_from_bridge`: a local pod's packet to that remote pod+port goes through the kernel so conntrack can undo the DNAT |
//! | [`crate::maps::KERNEL_FLOWS4`] | [`FlowKey`]: the 5-tuple of a local pod → remote pod flow | `tc_to_netdev`, for such packets that left through the kernel (so conntrack tracked them, maybe NATed them) | `tc_from_netdev`: the replies go through the stack too, not to the pod directly |
//!
//! Ports are network-order bytes as in the packet; ICMP echo uses the identifier as both ports.
//! Values are a `u32` that is always 1 (the maps are sets).

/// A remote endpoint: [`crate::maps::NAT_GUARD4`]'s key. 8 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PeerKey {
    /// The remote pod's IPv4 address.
    pub addr: [u8; 4],
    /// Its L4 port (network order).
    pub port: [u8; 2],
    /// IP protocol (6 or 17).
    pub proto: u8,
    /// Explicit padding; always zero.
    pub _pad: u8,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for PeerKey {}

/// A flow seen from this node, local side first: [`crate::maps::KERNEL_FLOWS4`]'s key. 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// The local pod's address.
    pub local_addr: [u8; 4],
    /// The remote pod's address.
    pub remote_addr: [u8; 4],
    /// The local port (network order).
    pub local_port: [u8; 2],
    /// The remote port (network order).
    pub remote_port: [u8; 2],
    /// IP protocol (1, 6 or 17).
    pub proto: u8,
    /// Explicit padding; always zero.
    pub _pad: [u8; 3],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for FlowKey {}

const _: () = {
    assert!(core::mem::size_of::<PeerKey>() == 8);
    assert!(core::mem::size_of::<FlowKey>() == 16);
};
