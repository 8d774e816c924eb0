//! The local node's fast-path configuration: the single entry of [`crate::maps::CONFIG`].
//!
//! It lives in a map rather than in load-time globals so that a restarted agent can adopt the
//! pinned maps and change the configuration (a new VTEP MAC, another external interface)
//! without reloading or re-attaching the programs. An all-zero entry (the state right after the
//! map is created) has [`CFG_ENABLED`] clear, and every program then hands every packet to the
//! kernel unchanged.

/// [`Config::flags`]: the configuration is complete; without it the programs pass everything.
pub const CFG_ENABLED: u32 = 1 << 0;
/// [`Config::flags`]: VXLAN packets for pod-to-pod flows are decapsulated by `tc_from_netdev`
/// and delivered to the pod bridge (instead of going through `flannel.<VNI>` and the stack).
/// Needed together with VXLAN transmit in eBPF so that both directions of a flow bypass
/// conntrack (see `flannel_ebpf::deliver`).
pub const CFG_VXLAN_RX: u32 = 1 << 1;
/// [`Config::flags`]: pod-to-pod packets arriving plain (host-gw) or by IPIP are delivered to
/// the pod bridge by `tc_from_netdev` instead of being handed to the stack.
pub const CFG_ROUTED_RX: u32 = 1 << 2;
/// [`Config::flags`]: a kernel IPIP device (`flannel.ipip`) receives IPIP on this node (the
/// kernel has the `ipip` module). GSO IPIP packets are then left to it, like GSO VXLAN to
/// `flannel.<VNI>`, instead of being decapsulated in eBPF (see `flannel_ebpf::deliver`).
pub const CFG_IPIP_KERNEL_RX: u32 = 1 << 3;
/// [`Config::flags`]: the agent takes IPIP packets the kernel reassembled from a raw socket
/// (`flannel_agent::ipip_rx`; no kernel IPIP device) and has seen one from a peer (a router
/// fragments IPIP on its way here; cleared once `--ebpf-ipip-reassembly-hold` passes without
/// another, and when the agent stops). `tc_from_netdev` then leaves
/// an IPIP packet carrying an inner fragment to the kernel whole, for the agent, instead of
/// decapsulating it: the other fragments of its datagram may reach the agent (in an outer
/// packet a router fragmented), and conntrack reassembles only fragments that meet the same
/// hook (the agent's leave through `OUTPUT`, the program's would enter at `PREROUTING`).
pub const CFG_IPIP_USER_RX: u32 = 1 << 4;

/// The `skb->mark` with which `tc_from_bridge` (and `tc_to_netdev`, when it must redirect)
/// tags the packets it sends to the external interface, so that `tc_to_netdev` recognises its
/// own packets (a fast-path VXLAN packet looks exactly like one of `flannel.<VNI>`), lets them
/// through untouched and clears the mark. Compared as a whole value; nothing routes by it
/// (tunnel next hops are resolved explicitly) and redirected packets meet no netfilter hook.
pub const FASTPATH_MARK: u32 = 0x0f1a_fa57;

/// The `skb->tc_index` with which `tc_from_bridge` tags the packets it hands to a tunnel
/// device (GSO packets to `flannel-v6.<VNI>`, and IPv4 ones too long for the fast path's own
/// VXLAN to `flannel.<VNI>`), so that `tc_to_netdev` recognises their outer
/// packets as the fast path's (not a kernel flow), lets them through and clears it. Not the
/// mark: the device's outer packets pass the OUTPUT and POSTROUTING hooks, where mark bits
/// mean something to others (kubelet's and kube-proxy's drop mark 0x8000 and masquerade mark
/// 0x4000, both set in [`FASTPATH_MARK`]); `tc_index` is only read by TC classifiers.
pub const FASTPATH_TC_INDEX: u32 = 0xfa57;

/// Local node configuration shared by every program.
///
/// Addresses are network-order bytes; numbers are host order. 48 bytes, no implicit padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Config {
    /// `CFG_*` bits.
    pub flags: u32,
    /// The external (underlay) interface: tunnels leave through it, `tc_from_netdev` and
    /// `tc_to_netdev` are attached to it.
    pub ext_ifindex: u32,
    /// Our public IP: outer source of VXLAN/IPIP packets, outer destination we decapsulate.
    pub public_ip: [u8; 4],
    /// Our lease (the local pod subnet), network address.
    pub local_subnet: [u8; 4],
    /// Prefix length of [`Config::local_subnet`] (0..=32).
    pub local_prefix_len: u32,
    /// The cluster network (`Network` in net-conf.json): a cheap pre-filter before the LPM
    /// lookup of remote subnets.
    pub cluster_net: [u8; 4],
    /// Prefix length of [`Config::cluster_net`] (0..=32).
    pub cluster_prefix_len: u32,
    /// Our VXLAN network identifier (the `flannel.<VNI>` device's id); received VXLAN must carry
    /// it to be decapsulated here.
    pub vni: u32,
    /// VXLAN UDP destination port (8472 unless configured).
    pub vxlan_port: u16,
    /// Lowest VXLAN UDP source port (the kernel's `ip_local_port_range` low end by default).
    pub src_port_min: u16,
    /// VXLAN UDP source ports are below this (the range's high end, as the kernel computes it).
    pub src_port_max: u16,
    /// TTL of outer VXLAN headers (the kernel uses `net.ipv4.ip_default_ttl`, 64).
    pub outer_ttl: u8,
    /// Explicit padding; always zero.
    pub _pad0: u8,
    /// Our VTEP MAC (the `flannel.<VNI>` MAC): inner Ethernet source of VXLAN we send, inner
    /// destination of VXLAN we decapsulate.
    pub vtep_mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad1: [u8; 2],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for Config {}

const _: () = assert!(core::mem::size_of::<Config>() == 48);

/// Whether `addr` (network-order bytes) lies in `net`/`prefix_len`. A prefix length above 32
/// matches nothing.
#[inline(always)]
pub fn in_prefix(addr: [u8; 4], net: [u8; 4], prefix_len: u32) -> bool {
    if prefix_len > 32 {
        return false;
    }
    let mask = ((u64::MAX << (32 - prefix_len)) & 0xffff_ffff) as u32;
    (u32::from_be_bytes(addr) & mask) == (u32::from_be_bytes(net) & mask)
}

impl Config {
    /// Whether [`CFG_ENABLED`] (and so the whole entry) is set.
    #[inline(always)]
    pub fn enabled(&self) -> bool {
        self.flags & CFG_ENABLED != 0
    }

    /// Whether `addr` is in the cluster network.
    #[inline(always)]
    pub fn in_cluster(&self, addr: [u8; 4]) -> bool {
        in_prefix(addr, self.cluster_net, self.cluster_prefix_len)
    }

    /// Whether `addr` is a pod of this node: in the local subnet but neither its network
    /// address (the `flannel.<VNI>` / tunnel address upstream gives the host) nor the first
    /// host address (the `cni0` gateway). Those two belong to the host, so traffic to them
    /// must meet the host's netfilter rules (hostPort DNAT matches them too).
    #[inline(always)]
    pub fn is_local_pod(&self, addr: [u8; 4]) -> bool {
        if !in_prefix(addr, self.local_subnet, self.local_prefix_len) {
            return false;
        }
        let a = u32::from_be_bytes(addr);
        let net = u32::from_be_bytes(self.local_subnet);
        a != net && a != net.wrapping_add(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        assert!(in_prefix([10, 244, 3, 7], [10, 244, 0, 0], 16));
        assert!(!in_prefix([10, 245, 3, 7], [10, 244, 0, 0], 16));
        assert!(in_prefix([1, 2, 3, 4], [0, 0, 0, 0], 0));
        assert!(in_prefix([1, 2, 3, 4], [1, 2, 3, 4], 32));
        assert!(!in_prefix([1, 2, 3, 5], [1, 2, 3, 4], 32));
        assert!(!in_prefix([1, 2, 3, 4], [1, 2, 3, 4], 33));
    }

    #[test]
    fn local_pods_exclude_the_host_addresses() {
        let cfg = Config {
            local_subnet: [10, 244, 1, 0],
            local_prefix_len: 24,
            ..Config::default()
        };
        assert!(!cfg.is_local_pod([10, 244, 1, 0]));
        assert!(!cfg.is_local_pod([10, 244, 1, 1]));
        assert!(cfg.is_local_pod([10, 244, 1, 2]));
        assert!(cfg.is_local_pod([10, 244, 1, 255]));
        assert!(!cfg.is_local_pod([10, 244, 2, 2]));
    }
}
