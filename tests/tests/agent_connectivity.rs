//! Three-node clusters run by the real `flannel-agent` (etcd in the hub, pods made by the
//! flannel CNI plugin): vxlan and host-gw over an L2 and over a routed (L3) underlay, and
//! vxlan with DirectRouting over a mixed one. Each test checks the exact routes, neighbours
//! and FDB entries every node holds for the leases in etcd, the pod-to-pod TCP matrix, and
//! a checksummed multi-megabyte TCP transfer across nodes.
//!
//! Run: `cargo test -p flannel-tests --test agent_connectivity` (as root; skipped otherwise).

mod agent_support;

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use agent_support::{
    Path, expected_state, leases_by_node, node_of, spec, wait_for_state, with_cluster,
};
use anyhow::{Context as _, Result, bail, ensure};
use flannel_tests::{
    lab::{cluster::Cluster, probe, wait},
    require_root,
    topology::Underlay,
};
use serde_json::json;

/// Bytes sent across nodes by each transfer.
const TRANSFER_BYTES: u64 = 8 * 1024 * 1024;

/// Every node holds exactly the entries `path(from, to)` asks for, every pod reaches every
/// other pod, and bulk data crosses nodes intact.
fn reachable_everywhere(cluster: &mut Cluster, path: impl Fn(usize, usize) -> Path) -> Result<()> {
    let by_node = leases_by_node(cluster)?;
    let subnets: std::collections::BTreeSet<_> = by_node.values().map(|l| l.subnet).collect();
    ensure!(subnets.len() == 3, "leases overlap: {by_node:?}");
    let leases: Vec<_> = by_node.values().cloned().collect();
    for n in 1..=3 {
        let want = expected_state(cluster, n, &leases, |l| {
            path(n, node_of(cluster, l).unwrap_or_default())
        });
        wait_for_state(cluster, n, &want)?;
        eprintln!("node{n}:\n{want}");
    }
    let matrix = cluster.matrix(agent_support::PROBE)?;
    eprintln!("{matrix}");
    if !matrix.all_ok() {
        bail!("pods cannot reach each other:\n{matrix}");
    }
    transfer_between(cluster, 1, 3)?;
    transfer_between(cluster, 3, 2)?;
    Ok(())
}

/// Sends [`TRANSFER_BYTES`] from the first pod of node `a` to the first pod of node `b`.
fn transfer_between(cluster: &Cluster, a: usize, b: usize) -> Result<()> {
    let topo = cluster.topology();
    let (from, to) = (topo.pods_on(a)[0], topo.pods_on(b)[0]);
    let t = probe::transfer(
        from.ns(),
        to.ns(),
        IpAddr::V4(to.ip()),
        TRANSFER_BYTES,
        Duration::from_secs(30),
    )
    .with_context(|| format!("transfer {} -> {}", from.name(), to.name()))?;
    eprintln!(
        "{} -> {}: {} bytes intact in {:?} ({:.0} Mbit/s)",
        from.name(),
        to.name(),
        t.bytes,
        t.elapsed,
        t.mbit_per_s()
    );
    Ok(())
}

#[test]
fn vxlan_over_l2() {
    require_root!();
    with_cluster("vxlan/l2", spec(3, Underlay::L2, "vxlan", 2), |c| {
        reachable_everywhere(c, |_, _| Path::Vxlan)
    });
}

#[test]
fn vxlan_over_l3() {
    require_root!();
    with_cluster("vxlan/l3", spec(3, Underlay::L3, "vxlan", 2), |c| {
        ensure!(
            !c.topology().l2_adjacent(1, 2)?,
            "the L3 underlay is routed"
        );
        reachable_everywhere(c, |_, _| Path::Vxlan)
    });
}

#[test]
fn host_gw_over_l2() {
    require_root!();
    with_cluster("host-gw/l2", spec(3, Underlay::L2, "host-gw", 2), |c| {
        reachable_everywhere(c, |_, _| Path::Direct)?;
        for n in 1..=3 {
            ensure!(
                c.metric(n, "flannel_peers_unreachable")? == Some(0.0),
                "node{n} reports unreachable peers"
            );
        }
        Ok(())
    });
}

/// host-gw needs one L2 segment: over a routed underlay every peer is reported (metric and
/// one log line per peer) and nothing is programmed for it, no black-hole either, so the
/// node's default route still applies and pods on one node still talk.
#[test]
fn host_gw_over_l3_reports_unreachable_peers() {
    require_root!();
    with_cluster("host-gw/l3", spec(3, Underlay::L3, "host-gw", 2), |c| {
        let by_node = leases_by_node(c)?;
        let leases: Vec<_> = by_node.values().cloned().collect();
        for n in 1..=3 {
            let want = expected_state(c, n, &leases, |_| Path::None);
            wait_for_state(c, n, &want)?;
            wait::until_ok(
                agent_support::CONVERGE,
                &format!("node{n} to report 2 unreachable peers"),
                || match c.metric(n, "flannel_peers_unreachable")? {
                    Some(2.0) => Ok(()),
                    other => bail!("flannel_peers_unreachable = {other:?}"),
                },
            )?;
            let node = c.topology().node(n);
            for (m, lease) in &by_node {
                if *m == n {
                    continue;
                }
                // No route of any type: the peer's pods go the default way (to the hub).
                let peer_pod = Ipv4Addr::from(u32::from(lease.subnet.network()) + 2);
                let route = node.route_get(IpAddr::V4(peer_pod))?;
                ensure!(
                    route.gateway == Some(IpAddr::V4(node.gateway()))
                        && route.dev.as_deref() == Some("eth0"),
                    "node{n} routes {peer_pod} {route:?}, not via its default gateway"
                );
                let log = std::fs::read_to_string(node.agent_log())?;
                let needle = format!("no route to {} of lease", lease.subnet);
                let times = agent_support::count_lines(&log, &needle);
                ensure!(
                    times == 1,
                    "node{n} logged {needle:?} {times} times (want once)"
                );
            }
        }
        for n in 1..=3 {
            let pods = c.topology().pods_on(n);
            probe::tcp_reaches(
                pods[0].ns(),
                pods[1].ns(),
                IpAddr::V4(pods[1].ip()),
                agent_support::PROBE,
            )
            .with_context(|| format!("pods on node{n}"))?;
        }
        Ok(())
    });
}

/// DirectRouting on a mixed underlay: nodes 1 and 2 share a segment and route to each
/// other directly; node 3 is behind the hub and reached through VXLAN (and reaches both
/// through VXLAN).
#[test]
fn direct_routing_over_mixed_underlay() {
    require_root!();
    let mut s = spec(3, Underlay::Mixed, "vxlan", 2);
    s.backend_options = json!({"DirectRouting": true});
    with_cluster("vxlan+DirectRouting/mixed", s, |c| {
        ensure!(
            c.topology().l2_adjacent(1, 2)?,
            "nodes 1 and 2 share a segment"
        );
        ensure!(!c.topology().l2_adjacent(1, 3)?, "node 3 is routed");
        reachable_everywhere(c, |from, to| {
            if from <= 2 && to <= 2 {
                Path::Direct
            } else {
                Path::Vxlan
            }
        })?;
        transfer_between(c, 1, 2)?;
        transfer_between(c, 2, 1)
    });
}
