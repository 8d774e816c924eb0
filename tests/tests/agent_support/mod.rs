//! Shared by the `agent_*` integration tests: clusters of real `flannel-agent` processes on
//! network-namespace nodes with etcd in the hub (`flannel_tests::lab`), and the exact kernel
//! state a node should hold for the leases in etcd.
//!
//! Every test body runs through [`with_cluster`] (or [`report`]), which prints the cluster
//! status and each agent's log tail when the body fails, then panics with the whole error
//! chain; the cluster (agents, etcd, pods, namespaces) is removed by its guards in any case.
//!
//! [`scenarios`] holds the checks the kernel-path tests and the eBPF fast-path tests share,
//! each taking the dataplane from the cluster (per node, so mixed clusters work too).

#![allow(dead_code)] // each test file uses a different part

pub mod scenarios;

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use anyhow::{Context as _, Result};
use flannel_common::route::ROUTE_F_DIRECT;
use flannel_tests::{
    lab::{
        agent::{DEFAULT_HEALTHZ_PORT, Dataplane},
        bins,
        cluster::{Cluster, ClusterSpec},
        fastpath::{self, Route},
        lease::LeaseRecord,
        status::KernelState,
        wait,
    },
    topology::{TopologySpec, Underlay},
};
use ipnet::Ipv4Net;

pub use flannel_tests::lab::status::CONVERGE;
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

/// [`spec`] with every agent on `dataplane`.
pub fn spec_on(
    dataplane: Dataplane,
    nodes: usize,
    underlay: Underlay,
    backend: &str,
    pods_per_node: usize,
) -> ClusterSpec {
    let mut s = spec(nodes, underlay, backend, pods_per_node);
    s.dataplane = dataplane;
    s
}

/// A test name with the dataplane in it (`vxlan/l2` → `ebpf vxlan/l2`).
pub fn named(dataplane: Dataplane, name: &str) -> String {
    format!("{dataplane} {name}")
}

/// Brings the cluster up and waits until every agent is ready, then runs `body`. On failure
/// [`fail`]s with the cluster's status and the agents' logs.
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
        fail(name, &mut cluster, &e);
    }
}

/// Prints the error chain, the cluster's state ([`dump`]) and panics with the error chain
/// again: first as well as last, so that an output cut in the middle still shows it.
pub fn fail(name: &str, cluster: &mut Cluster, e: &anyhow::Error) -> ! {
    eprintln!("[{name}] FAILED: {e:#}\ncluster state:\n{}", dump(cluster));
    panic!("[{name}] {e:#}");
}

/// Status block, the route maps of fast-path nodes, plus every agent's last log lines.
pub fn dump(cluster: &mut Cluster) -> String {
    let mut out = cluster.status_text();
    for n in 1..=cluster.topology().nodes().len() {
        if on_fast_path(cluster, n) {
            out += &match fastpath::routes(cluster.topology().node(n).bpf_pin_path()) {
                Ok(routes) => format!("node{n} route map:\n{}", routes_text(&routes)),
                Err(e) => format!("node{n} route map: {e:#}\n"),
            };
        }
    }
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
    /// IPIP encapsulated by the eBPF fast path: a route onlink via the next hop towards the
    /// peer's public IP out of `eth0` (the peer itself on our segment, else our gateway).
    Ipip,
    /// Nothing at all (host-gw peer that is not on our segment).
    None,
}

impl Path {
    /// The default path of `backend` (`host-gw`: direct, `vxlan`, `ipip`).
    pub fn of_backend(backend: &str) -> Path {
        match backend {
            "host-gw" => Path::Direct,
            "ipip" => Path::Ipip,
            _ => Path::Vxlan,
        }
    }

    /// The fast path's route kind for this path (`None`: not in the route map).
    pub fn kind(self) -> Option<&'static str> {
        match self {
            Path::Direct => Some("host-gw"),
            Path::Vxlan => Some("vxlan"),
            Path::Ipip => Some("ipip"),
            Path::None => None,
        }
    }
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
            Path::Ipip => {
                let node = cluster.topology().node(n);
                let next_hop = if node.addr_net().contains(&public) {
                    public
                } else {
                    node.gateway()
                };
                state.routes.push(format!(
                    "{} via {next_hop} dev eth0 proto 165 onlink",
                    lease.subnet
                ));
            }
            Path::None => {}
        }
    }
    state.routes.sort();
    state.neighbours.sort();
    state.fdb.sort();
    state
}

/// The exact route map of node `n`'s fast path for `leases` reached the way `path_to` says
/// (`direct_flags`: the flags of a [`Path::Direct`] entry, `ROUTE_F_DIRECT` unless the
/// backend is host-gw).
pub fn expected_routes(
    cluster: &Cluster,
    n: usize,
    leases: &[LeaseRecord],
    path_to: impl Fn(&LeaseRecord) -> Path,
) -> BTreeMap<Ipv4Net, Route> {
    let own = cluster.subnet_of(n);
    let direct_flags = if cluster.spec().backend == "host-gw" {
        0
    } else {
        ROUTE_F_DIRECT
    };
    let mut out = BTreeMap::new();
    for lease in leases {
        if Some(lease.subnet) == own {
            continue;
        }
        let public = lease.public_ip.unwrap_or(Ipv4Addr::UNSPECIFIED);
        let route = match path_to(lease) {
            Path::Direct => Route::host_gw(public, direct_flags),
            Path::Vxlan => Route::vxlan(public, 1, lease.vtep_mac().unwrap_or_default()),
            Path::Ipip => Route::ipip(public),
            Path::None => continue,
        };
        out.insert(lease.subnet, route);
    }
    out
}

/// Shows a route map one entry per line.
pub fn routes_text(routes: &BTreeMap<Ipv4Net, Route>) -> String {
    routes
        .iter()
        .map(|(net, r)| format!("  {net} {r}\n"))
        .collect()
}

/// Waits until node `n`'s fast-path route map holds exactly `want`.
pub fn wait_for_routes(
    cluster: &Cluster,
    n: usize,
    want: &BTreeMap<Ipv4Net, Route>,
) -> Result<BTreeMap<Ipv4Net, Route>> {
    let pins = cluster.topology().node(n).bpf_pin_path().to_path_buf();
    wait::until(CONVERGE, &format!("node{n}'s route map"), || {
        let got = fastpath::routes(&pins)?;
        if &got == want {
            Ok(Some(got))
        } else {
            anyhow::bail!(
                "node{n}'s route map holds\n{}but should hold\n{}",
                routes_text(&got),
                routes_text(want)
            )
        }
    })
}

/// Whether node `n` is expected to forward through the eBPF fast path.
pub fn on_fast_path(cluster: &Cluster, n: usize) -> bool {
    cluster.dataplane_of(n) != Dataplane::Kernel
}

/// The fast-path counters of node `n`'s agent.
pub fn counters(cluster: &Cluster, n: usize) -> Result<fastpath::Counters> {
    fastpath::counters(cluster.topology().node(n).ns(), DEFAULT_HEALTHZ_PORT)
        .with_context(|| format!("node{n}'s fast-path counters"))
}

/// Node `n`'s agent reports the path its `--dataplane` asks for (`ebpf` for ebpf and auto,
/// `kernel` for kernel) in `flannel_dataplane_info`.
pub fn check_active_path(cluster: &Cluster, n: usize) -> Result<()> {
    let want = if on_fast_path(cluster, n) {
        "ebpf"
    } else {
        "kernel"
    };
    let ns = cluster.topology().node(n).ns();
    let got = fastpath::active_path(ns, DEFAULT_HEALTHZ_PORT)?;
    anyhow::ensure!(
        got.as_deref() == Some(want),
        "node{n} ({}) reports dataplane path {got:?}, want {want}",
        cluster.dataplane_of(n)
    );
    // The fast path's programs are shown with what the verifier processed, only on it.
    let verified = flannel_tests::lab::status::metric_sum(
        ns,
        DEFAULT_HEALTHZ_PORT,
        "flannel_fastpath_program_verified_instructions",
        "tc_to_netdev",
    )?;
    anyhow::ensure!(
        (verified > 0.0) == (want == "ebpf"),
        "node{n} ({want}) reports {verified} verified instructions for tc_to_netdev"
    );
    Ok(())
}

/// The IP of node `n`'s first pod.
pub fn first_pod_ip(cluster: &Cluster, n: usize) -> IpAddr {
    IpAddr::V4(cluster.topology().pods_on(n)[0].ip())
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

/// The capabilities `deploy/kube-flannel.yml` adds for the agent's container
/// (`securityContext.capabilities.add` of the DaemonSet's `kube-flannel` container); fails
/// unless the manifest has that container, unprivileged. A container runtime grants them on
/// top of its default set (`CHOWN`, `DAC_OVERRIDE`, `KILL`, ...: no `SYS_ADMIN`); an agent
/// given only these is held to less, so what it does here it does in the container too.
pub fn daemonset_capabilities() -> Result<Vec<String>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kube-flannel.yml");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let doc = <serde_yaml::Value as serde::Deserialize>::deserialize(doc)?;
        if doc["kind"].as_str() != Some("DaemonSet") {
            continue;
        }
        let containers = doc["spec"]["template"]["spec"]["containers"]
            .as_sequence()
            .context("the DaemonSet has no containers")?;
        let agent = containers
            .iter()
            .find(|c| c["name"].as_str() == Some("kube-flannel"))
            .context("no kube-flannel container")?;
        let security = &agent["securityContext"];
        anyhow::ensure!(
            security["privileged"].as_bool() != Some(true),
            "the agent's container is privileged"
        );
        return security["capabilities"]["add"]
            .as_sequence()
            .context("no capabilities added")?
            .iter()
            .map(|c| {
                c.as_str()
                    .map(str::to_owned)
                    .context("a capability is not a string")
            })
            .collect();
    }
    anyhow::bail!("no DaemonSet in {}", path.display())
}
