//! Names of the programs in the eBPF object (the loader looks them up by these names).
//!
//! Fast-path programs are named `<hook>_<from|to>_<device>` from the device's point of view, as
//! Cilium does:
//!
//! | program | attach point | job |
//! |---|---|---|
//! | [`TC_FROM_BRIDGE`] | TC ingress of the pod bridge's veth ports (the agent's choice; the bridge itself in test rigs) | pod → remote pod: host-gw redirect, VXLAN or IPIP encapsulation |
//! | [`TC_FROM_NETDEV`] | TC ingress of the external interface | IPIP decapsulation, VXLAN receive, delivery to the bridge, NAT-guard learning |
//! | [`TC_TO_NETDEV`] | TC egress of the external interface | IPIP encapsulation of kernel-routed packets, kernel-flow learning |
//! | [`XDP_FROM_NETDEV`] | XDP (native mode only) of the external interface | decapsulation of deliverable IPIP/VXLAN before GRO |

use crate::maps::MAX_OBJ_NAME_LEN;

/// TC classifier: parses and classifies every packet, counts it in
/// [`crate::maps::TC_STATS`], and lets it through (`TC_ACT_OK`).
pub const TC_CLASSIFY: &str = "tc_classify";

/// XDP twin of [`TC_CLASSIFY`]: same parser, counts in [`crate::maps::XDP_STATS`],
/// returns `XDP_PASS`.
pub const XDP_CLASSIFY: &str = "xdp_classify";

/// Pod egress: TC ingress of the pod bridge's veth ports.
pub const TC_FROM_BRIDGE: &str = "tc_from_bridge";

/// Node ingress: TC ingress of the external interface.
pub const TC_FROM_NETDEV: &str = "tc_from_netdev";

/// Node egress: TC egress of the external interface.
pub const TC_TO_NETDEV: &str = "tc_to_netdev";

/// Node ingress before GRO: XDP (native mode) of the external interface.
pub const XDP_FROM_NETDEV: &str = "xdp_from_netdev";

/// Measurement only, never attached by the agent: VXLAN transmit through a collect_md device
/// (`bpf_skb_set_tunnel_key` + redirect), the alternative the fast path was measured against.
pub const TC_BENCH_VXMD: &str = "tc_bench_vxmd";

/// The bench program's map: index 0 holds the collect_md device's ifindex.
pub const BENCH_MD_MAP: &str = "FLANNEL_BENCHMD";

/// Measurement only, never attached by the agent: the least an eBPF forwarder does (an IPv4
/// destination looked up in [`BENCH_FLOOR_MAP`], MACs rewritten, TTL decremented, redirected;
/// for a VXLAN hop encapsulated first, and VXLAN to our port decapsulated), the lower bound
/// the fast path's programs are measured against.
pub const TC_BENCH_FLOOR: &str = "tc_bench_floor";

/// The floor program's map: destination IPv4 address → [`FloorHop`].
pub const BENCH_FLOOR_MAP: &str = "FLANNEL_BENCHFL";

/// Most destinations [`BENCH_FLOOR_MAP`] holds.
pub const BENCH_FLOOR_MAX_ENTRIES: u32 = 16;

/// [`FloorHop::into_peer`]: redirect to the interface's egress (`bpf_redirect`).
pub const FLOOR_EGRESS: u32 = 0;
/// [`FloorHop::into_peer`]: redirect into the namespace of the veth's peer
/// (`bpf_redirect_peer`).
pub const FLOOR_PEER: u32 = 1;

/// Where [`TC_BENCH_FLOOR`] sends a packet for one destination. 44 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FloorHop {
    /// The interface to redirect to.
    pub ifindex: u32,
    /// Source MAC written into the packet (the outer one, for VXLAN).
    pub smac: [u8; 6],
    /// Destination MAC written into the packet (the outer one, for VXLAN).
    pub dmac: [u8; 6],
    /// [`FLOOR_EGRESS`] or [`FLOOR_PEER`].
    pub into_peer: u32,
    /// With `kind` [`crate::route::RouteKind::Vxlan`]: encapsulated for this peer (with the
    /// configuration in [`crate::maps::CONFIG`]) before it is sent; otherwise unused (zero).
    pub vxlan_peer: crate::route::RemoteEntry,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for FloorHop {}

const _: () = {
    assert!(core::mem::size_of::<FloorHop>() == 44);
    assert!(TC_BENCH_FLOOR.len() <= MAX_OBJ_NAME_LEN);
    assert!(BENCH_FLOOR_MAP.len() <= MAX_OBJ_NAME_LEN);
    assert!(TC_BENCH_VXMD.len() <= MAX_OBJ_NAME_LEN);
    assert!(BENCH_MD_MAP.len() <= MAX_OBJ_NAME_LEN);
    assert!(TC_CLASSIFY.len() <= MAX_OBJ_NAME_LEN);
    assert!(XDP_CLASSIFY.len() <= MAX_OBJ_NAME_LEN);
    assert!(TC_FROM_BRIDGE.len() <= MAX_OBJ_NAME_LEN);
    assert!(TC_FROM_NETDEV.len() <= MAX_OBJ_NAME_LEN);
    assert!(TC_TO_NETDEV.len() <= MAX_OBJ_NAME_LEN);
    assert!(XDP_FROM_NETDEV.len() <= MAX_OBJ_NAME_LEN);
};
