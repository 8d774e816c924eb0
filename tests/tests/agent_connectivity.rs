//! Three-node clusters run by the real `flannel-agent` on the kernel path (etcd in the hub,
//! pods made by the flannel CNI plugin): vxlan and host-gw over an L2 and over a routed (L3)
//! underlay, and vxlan with DirectRouting over a mixed one. Each test checks the exact
//! routes, neighbours and FDB entries every node holds for the leases in etcd, the
//! pod-to-pod TCP matrix, and checksummed multi-megabyte TCP transfers across nodes. The
//! same scenarios run on the eBPF fast path in `agent_ebpf.rs`.
//!
//! Run: `cargo test -p flannel-tests --test agent_connectivity` (as root; skipped otherwise).

mod agent_support;

use agent_support::scenarios::connectivity;
use flannel_tests::{lab::agent::Dataplane, require_root, topology::Underlay};

#[test]
fn vxlan_over_l2() {
    require_root!();
    connectivity(Dataplane::Kernel, "vxlan", Underlay::L2);
}

#[test]
fn vxlan_over_l3() {
    require_root!();
    connectivity(Dataplane::Kernel, "vxlan", Underlay::L3);
}

#[test]
fn host_gw_over_l2() {
    require_root!();
    connectivity(Dataplane::Kernel, "host-gw", Underlay::L2);
}

/// Nothing is programmed for peers on other segments; they are reported instead.
#[test]
fn host_gw_over_l3_reports_unreachable_peers() {
    require_root!();
    connectivity(Dataplane::Kernel, "host-gw", Underlay::L3);
}

/// Direct routes to the neighbour on the same segment, VXLAN to the routed node.
#[test]
fn direct_routing_over_mixed_underlay() {
    require_root!();
    connectivity(Dataplane::Kernel, "vxlan", Underlay::Mixed);
}

/// A kube-proxy style Service DNAT (nat PREROUTING, ClusterIP → a pod on another node).
#[test]
fn service_dnat_to_a_remote_pod() {
    require_root!();
    agent_support::scenarios::service_dnat_to_a_remote_pod(Dataplane::Kernel, "vxlan");
}
