//! The kernel-path test matrix of `agent_connectivity.rs` and `agent_lifecycle.rs` on the
//! eBPF fast path (`--dataplane ebpf`), plus ipip, which only exists here through the fast
//! path (this kernel has no ipip module), and mixed clusters of kernel-path and fast-path
//! nodes.
//!
//! Besides everything the kernel-path tests check (exact routes, neighbours and FDB entries,
//! the pod matrix, intact transfers), every fast-path node must report
//! `flannel_dataplane_info{path="ebpf"}`, hold exactly the expected route map, and count the
//! test's traffic in its programs' counters (bytes of the bulk transfers included), so an
//! agent that silently falls back to the kernel path fails.
//!
//! * connectivity: host-gw, vxlan, ipip over an L2 and a routed (L3) underlay; vxlan with
//!   DirectRouting over a mixed underlay;
//! * lifecycle (one cluster per backend, checks in order): connectivity, an agent restart
//!   under a UDP request stream and a long TCP transfer (pins adopted, programs swapped,
//!   nothing lost), a 30 s etcd outage (traffic keeps flowing through the programs), a node
//!   leaving (its route map, tunnel peer and kernel entries gone);
//! * mixed: four nodes alternating `--dataplane kernel` and `--dataplane ebpf`, vxlan and
//!   host-gw, pod matrix and transfers in both directions between the two kinds.
//!
//! Run: `cargo test -p flannel-tests --test agent_ebpf` (as root; skipped otherwise).

mod agent_support;

use agent_support::{
    Path, named,
    scenarios::{self, connectivity, reachable_everywhere},
    spec_on, with_cluster,
};
use flannel_tests::{lab::agent::Dataplane, require_root, topology::Underlay};

const EBPF: Dataplane = Dataplane::Ebpf;

#[test]
fn ebpf_host_gw_over_l2() {
    require_root!();
    connectivity(EBPF, "host-gw", Underlay::L2);
}

/// Nothing is programmed for peers on other segments (no kernel route, no map entry).
#[test]
fn ebpf_host_gw_over_l3_reports_unreachable_peers() {
    require_root!();
    connectivity(EBPF, "host-gw", Underlay::L3);
}

#[test]
fn ebpf_vxlan_over_l3() {
    require_root!();
    connectivity(EBPF, "vxlan", Underlay::L3);
}

/// The routed underlay: IPIP routes go onlink via the node's gateway.
#[test]
fn ebpf_ipip_over_l3() {
    require_root!();
    connectivity(EBPF, "ipip", Underlay::L3);
}

#[test]
fn ebpf_direct_routing_over_mixed_underlay() {
    require_root!();
    connectivity(EBPF, "vxlan", Underlay::Mixed);
}

/// Connectivity over L2, then restart, etcd outage and a node leaving on the same cluster.
fn lifecycle(backend: &str) {
    let path = Path::of_backend(backend);
    let p = move |_: usize, _: usize| path;
    with_cluster(
        &named(EBPF, &format!("{backend}/l2 lifecycle")),
        spec_on(EBPF, 3, Underlay::L2, backend, 2),
        |c| {
            eprintln!("--- connectivity");
            reachable_everywhere(c, &p, &[(1, 3), (3, 2)])?;
            eprintln!("--- restart of node1's agent");
            scenarios::restart_is_hitless(c, &p, 1, 2)?;
            eprintln!("--- etcd outage");
            scenarios::etcd_outage_is_ridden_out(c, &p, 2, 1)?;
            eprintln!("--- node3 leaves");
            scenarios::node_leaves(c, &p, 3)
        },
    );
}

#[test]
fn ebpf_host_gw_lifecycle() {
    require_root!();
    lifecycle("host-gw");
}

#[test]
fn ebpf_vxlan_lifecycle() {
    require_root!();
    lifecycle("vxlan");
}

#[test]
fn ebpf_ipip_lifecycle() {
    require_root!();
    lifecycle("ipip");
}

/// Four nodes, kernel path on 1 and 3, fast path on 2 and 4: every pod reaches every pod,
/// and bulk transfers cross between the two kinds in both directions (and between two of
/// each kind). ipip is left out: it has no kernel path here.
fn mixed(backend: &str) {
    let mut spec = spec_on(Dataplane::Kernel, 4, Underlay::L2, backend, 2);
    spec.node_dataplanes = vec![
        Dataplane::Kernel,
        Dataplane::Ebpf,
        Dataplane::Kernel,
        Dataplane::Ebpf,
    ];
    let path = Path::of_backend(backend);
    with_cluster(&format!("mixed kernel/ebpf {backend}"), spec, |c| {
        reachable_everywhere(
            c,
            &|_, _| path,
            &[(1, 2), (2, 1), (3, 4), (4, 3), (2, 4), (1, 3)],
        )
    });
}

#[test]
fn mixed_dataplanes_vxlan() {
    require_root!();
    mixed("vxlan");
}

#[test]
fn mixed_dataplanes_host_gw() {
    require_root!();
    mixed("host-gw");
}
