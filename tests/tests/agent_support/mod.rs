//! Shared by the `agent_*` integration tests: clusters of real `flannel-agent` processes on
//! network-namespace nodes with etcd in the hub (`flannel_tests::lab`), and the exact kernel
//! state a node should hold for the leases in etcd.
//!
//! Every test body runs through [`with_cluster`] (or [`report`]), which prints the cluster
//! status and each agent's log tail when the body fails, then panics with the whole error
//! chain; the cluster (agents, etcd, pods, namespaces) is removed by its guards in any case.

#![allow(dead_code)] // each test file uses a different part

use std::{collections::BTreeMap, net::Ipv4Addr, time::Duration};

use anyhow::{Context as _, Result};
use flannel_tests::{
    lab::{
        bins,
        cluster::{Cluster, ClusterSpec},
        lease::LeaseRecord,
        status::KernelState,
        wait,
    },
    topology::{TopologySpec, Underlay},
};

/// How long the agents get to converge after a change (they react within a second; the
/// rest is slack for a loaded CI machine).
pub const CONVERGE: Duration = Duration::from_secs(30);
/// Timeout of a single TCP probe.
pub const PROBE: Duration = Duration::from_secs(3);

/// A cluster of `nodes` nodes on `underlay` with `backend`, `pods_per_node` CNI pods each,
/// the test builds of the agent and CNI plugin, 60 s to start.
pub fn spec(nodes: usize, underlay: Underlay, backend: &str, pods_per_node: usize) -> ClusterSpec {
    let agent = bins::test_agent().unwrap_or_else(|e| panic!("{e:#}"));
    let mut topology = TopologySpec::new(nodes, underlay);
    if pods_per_node > 0 {
        topology = topology.cni_plugin(bins::test_cni_plugin().unwrap_or_else(|e| panic!("{e:#}")));
    }
    let mut spec = ClusterSpec::new(topology, backend, agent);
    spec.pods_per_node = pods_per_node;
    spec.subnet_env_timeout = Duration::from_secs(60);
    spec
}

/// Brings the cluster up and waits until every agent is ready, then runs `body`. On failure
/// prints the cluster's status and the agents' logs before panicking with the error chain.
pub fn with_cluster(name: &str, spec: ClusterSpec, body: impl FnOnce(&mut Cluster) -> Result<()>) {
    let progress = |msg: &str| eprintln!("[{name}] {msg}");
    let mut cluster = match Cluster::up(spec, &progress, &|| false) {
        Ok(c) => c,
        Err(e) => panic!("[{name}] bringing the cluster up: {e:#}"),
    };
    let result = cluster
        .wait_ready(Duration::from_secs(60))
        .and_then(|()| body(&mut cluster));
    if let Err(e) = result {
        eprintln!("[{name}] FAILED; cluster state:\n{}", dump(&mut cluster));
        panic!("[{name}] {e:#}");
    }
}

/// Status block plus every agent's last log lines.
pub fn dump(cluster: &mut Cluster) -> String {
    let mut out = cluster.status_text();
    for agent in cluster.agents_mut() {
        out += &format!(
            "--- {} ({}):\n{}\n",
            agent.node(),
            agent.log_path().display(),
            agent.log_tail(40)
        );
    }
    out
}

/// Panics with the error chain of a test body that needs no cluster of its own.
pub fn report(name: &str, result: Result<()>) {
    if let Err(e) = result {
        panic!("[{name}] {e:#}");
    }
}

/// How a node reaches each peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// A route via the peer's public IP out of `eth0` (host-gw, DirectRouting).
    Direct,
    /// Through `flannel.1`: route onlink via the peer's VTEP address, neighbour, FDB.
    Vxlan,
    /// Nothing at all (host-gw peer that is not on our segment).
    None,
}

/// The exact kernel state node `n` should hold when it reaches every other lease in
/// `leases` the way `path_to(lease)` says.
pub fn expected_state(
    cluster: &Cluster,
    n: usize,
    leases: &[LeaseRecord],
    path_to: impl Fn(&LeaseRecord) -> Path,
) -> KernelState {
    let own = cluster.subnet_of(n);
    let mut state = KernelState::default();
    for lease in leases {
        if Some(lease.subnet) == own {
            continue;
        }
        let public = lease.public_ip.unwrap_or(Ipv4Addr::UNSPECIFIED);
        let vtep = lease.subnet.network();
        match path_to(lease) {
            Path::Direct => state
                .routes
                .push(format!("{} via {public} dev eth0 proto 165", lease.subnet)),
            Path::Vxlan => {
                let mac = lease.vtep_mac().unwrap_or_default();
                state.routes.push(format!(
                    "{} via {vtep} dev flannel.1 proto 165 onlink",
                    lease.subnet
                ));
                state
                    .neighbours
                    .push(format!("{vtep} lladdr {mac} dev flannel.1"));
                state.fdb.push(format!("{mac} dev flannel.1 dst {public}"));
            }
            Path::None => {}
        }
    }
    state.routes.sort();
    state.neighbours.sort();
    state.fdb.sort();
    state
}

/// Waits until node `n`'s kernel holds exactly `want`; the error shows both sides.
pub fn wait_for_state(cluster: &Cluster, n: usize, want: &KernelState) -> Result<KernelState> {
    wait::until(CONVERGE, &format!("node{n}'s kernel state"), || {
        let got = cluster.kernel_state(n)?;
        if &got == want {
            Ok(Some(got))
        } else {
            anyhow::bail!("node{n} holds\n{got}but should hold\n{want}")
        }
    })
}

/// Every lease in etcd by node number (matched by public IP).
pub fn leases_by_node(cluster: &Cluster) -> Result<BTreeMap<usize, LeaseRecord>> {
    let leases = cluster.leases()?;
    let mut out = BTreeMap::new();
    for node in cluster.topology().nodes() {
        let lease = leases
            .iter()
            .find(|l| l.public_ip == Some(node.addr()))
            .with_context(|| format!("no lease with public IP {} in etcd", node.addr()))?;
        out.insert(node.index(), lease.clone());
    }
    Ok(out)
}

/// The node number whose lease this is.
pub fn node_of(cluster: &Cluster, lease: &LeaseRecord) -> Option<usize> {
    cluster
        .topology()
        .nodes()
        .iter()
        .find(|node| Some(node.addr()) == lease.public_ip)
        .map(|node| node.index())
}

/// How many lines of `log` contain `needle`.
pub fn count_lines(log: &str, needle: &str) -> usize {
    log.lines().filter(|l| l.contains(needle)).count()
}
