//! A whole simulated cluster: topology, etcd in the hub (or, in kube mode, the fake API server
//! with one Node per node), the network config, one agent per node, pods created through CNI
//! once each node's subnet.env exists. `flannel-lab up` and the agent-driven benchmark
//! variants are built on it.

use std::{
    fmt::Write as _,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use ipnet::{Ipv4Net, Ipv6Net};
use serde_json::Value;

use super::{
    agent::{Agent, AgentSpec, Dataplane},
    fastpath, kube,
    kv::Kv,
    lease::{self, LeaseRecord},
    probe::{self, Matrix},
    status,
};
use crate::{
    etcd::Etcd,
    kube_mock::MockApiServer,
    topology::{SubnetEnv, Topology, TopologySpec},
};

/// What to bring up.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Nodes, underlay, MTU, CNI plugin (required when `pods_per_node > 0`).
    pub topology: TopologySpec,
    /// `Network` of the config.
    pub network: Ipv4Net,
    /// `IPv6Network` of the config; `Some` also sets `EnableIPv6` (dual stack, or IPv6 only
    /// with [`enable_ipv4`](Self::enable_ipv4) false). Needs an IPv6 underlay
    /// ([`TopologySpec::ipv6`](crate::topology::TopologySpec::ipv6)).
    pub ipv6_network: Option<Ipv6Net>,
    /// `EnableIPv4` (default true; `false` writes `"EnableIPv4": false` and no `Network`).
    pub enable_ipv4: bool,
    /// `Backend.Type`: vxlan, host-gw, ipip, wireguard, udp.
    pub backend: String,
    /// Further `Backend` options (a JSON object), e.g. `{"DirectRouting": true}`.
    pub backend_options: Value,
    /// The agent binary.
    pub agent: PathBuf,
    /// `--dataplane`
    pub dataplane: Dataplane,
    /// Per-node `--dataplane` overriding [`dataplane`](Self::dataplane): node *i* uses entry
    /// *i*-1 when there is one (a mixed cluster of kernel-path and fast-path nodes).
    pub node_dataplanes: Vec<Dataplane>,
    /// `--ip-masq`
    pub ip_masq: bool,
    /// Extra agent flags.
    pub agent_args: Vec<String>,
    /// The only capabilities the agents get ([`AgentSpec::capabilities`]); `None`: root's
    /// (or [`super::agent::CAPS_ENV`]'s).
    pub agent_capabilities: Option<Vec<String>>,
    /// Pods created through CNI on every node.
    pub pods_per_node: usize,
    /// How long each node may take to write subnet.env.
    pub subnet_env_timeout: Duration,
    /// `--etcd-prefix`
    pub etcd_prefix: String,
    /// Kube mode: the agents take their leases from Node objects in the fake API server
    /// (`--kube-subnet-mgr`, the config as `net-conf.json`), each Node's pod CIDRs the
    /// node's /24 of [`network`](Self::network) (and /64 of
    /// [`ipv6_network`](Self::ipv6_network)) as a controller manager assigns them; no etcd.
    pub kube: bool,
}

impl ClusterSpec {
    /// 10.244.0.0/16 with `backend`, kernel dataplane, 2 pods per node, 60 s to become ready.
    pub fn new(topology: TopologySpec, backend: &str, agent: impl Into<PathBuf>) -> Self {
        ClusterSpec {
            topology,
            network: Ipv4Net::new(std::net::Ipv4Addr::new(10, 244, 0, 0), 16).unwrap_or_default(),
            ipv6_network: None,
            enable_ipv4: true,
            backend: backend.to_owned(),
            backend_options: Value::Object(Default::default()),
            agent: agent.into(),
            dataplane: Dataplane::Kernel,
            node_dataplanes: Vec::new(),
            ip_masq: false,
            agent_args: Vec::new(),
            agent_capabilities: None,
            pods_per_node: 2,
            subnet_env_timeout: Duration::from_secs(60),
            etcd_prefix: lease::DEFAULT_PREFIX.to_owned(),
            kube: false,
        }
    }

    /// The JSON stored at `<prefix>/config` (or written to `net-conf.json` in kube mode).
    pub fn netconf(&self) -> Value {
        let mut conf = lease::netconf(self.network, &self.backend, self.backend_options.clone());
        if let Some(obj) = conf.as_object_mut() {
            if !self.enable_ipv4 {
                obj.remove("Network");
                obj.insert("EnableIPv4".into(), Value::Bool(false));
            }
            if let Some(v6) = self.ipv6_network {
                obj.insert("EnableIPv6".into(), Value::Bool(true));
                obj.insert("IPv6Network".into(), Value::String(v6.to_string()));
            }
        }
        conf
    }
}

/// Where the agents of a cluster take their leases from.
enum Store {
    /// etcd in the hub, and access to it from there.
    Etcd { etcd: Etcd, kv: Kv },
    /// The fake API server in the hub (kube mode), served by its own runtime.
    Kube {
        api: MockApiServer,
        _runtime: tokio::runtime::Runtime,
    },
}

impl Store {
    fn describe(&self) -> String {
        match self {
            Store::Etcd { etcd, .. } => format!("etcd at {}", etcd.endpoint()),
            Store::Kube { api, .. } => format!("fake API server at {}", api.url()),
        }
    }
}

/// A running simulated cluster; dropping it stops the agents and etcd (or the API server) and
/// removes the topology.
pub struct Cluster {
    // Drop order: agents, the store, then the namespaces.
    agents: Vec<Agent>,
    store: Store,
    topology: Topology,
    spec: ClusterSpec,
    subnet_envs: Vec<SubnetEnv>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("store", &self.store.describe())
            .field("topology", &self.topology)
            .field("agents", &self.agents)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Brings the cluster up, reporting each step to `progress`. `cancelled` is polled while
    /// waiting (Ctrl-C). Fails clearly when an agent exits or a subnet.env does not appear in
    /// time (with the agent's log tail); everything built so far is removed on failure.
    pub fn up(
        spec: ClusterSpec,
        progress: &dyn Fn(&str),
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Cluster> {
        progress(&format!(
            "building {} node(s) on an {} underlay (MTU {})",
            spec.topology.nodes, spec.topology.underlay, spec.topology.mtu
        ));
        let topology = Topology::new(spec.topology.clone())?;
        Cluster::start(topology, spec, progress, cancelled)
    }

    /// Like [`Cluster::up`] on a topology built by the caller (`spec.topology` is ignored).
    pub fn start(
        topology: Topology,
        spec: ClusterSpec,
        progress: &dyn Fn(&str),
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Cluster> {
        let netconf = spec.netconf();
        let hub = topology.hub().name();
        let store = if spec.kube {
            let cidrs = topology
                .nodes()
                .iter()
                .map(|n| {
                    let cidrs = kube::pod_cidrs(spec.network, spec.ipv6_network, n.index())?;
                    Ok((n.index(), cidrs))
                })
                .collect::<Result<std::collections::BTreeMap<_, _>>>()?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()?;
            let api = kube::api_in_hub(&runtime, &topology, &|n| {
                cidrs.get(&n).cloned().unwrap_or_default()
            })?;
            progress(&format!("fake API server at {} (in {hub})", api.url()));
            for node in topology.nodes() {
                let cidrs = cidrs.get(&node.index()).cloned().unwrap_or_default();
                progress(&format!("Node {}: podCIDRs {cidrs:?}", node.name()));
            }
            progress(&format!("net-conf.json = {netconf}"));
            Store::Kube {
                api,
                _runtime: runtime,
            }
        } else {
            let etcd = topology.start_etcd()?;
            progress(&format!("etcd at {} (in {hub})", etcd.endpoint()));
            let kv = Kv::new(topology.hub(), etcd.endpoint());
            lease::write_netconf(&kv, &spec.etcd_prefix, &netconf)?;
            progress(&format!("{}/config = {netconf}", spec.etcd_prefix));
            Store::Etcd { etcd, kv }
        };
        let mut cluster = Cluster {
            agents: Vec::new(),
            store,
            topology,
            spec,
            subnet_envs: Vec::new(),
        };
        for node in cluster.topology.nodes() {
            let mut agent_spec = cluster.agent_spec_for(node.index());
            if let Store::Kube { api, .. } = &cluster.store {
                agent_spec = kube::agent_spec(node, api, &netconf, &agent_spec)?;
            }
            let agent = Agent::start(node, &agent_spec)?;
            progress(&format!(
                "{}: flannel-agent pid {} {}",
                node.name(),
                agent.pid(),
                agent.args().join(" ")
            ));
            cluster.agents.push(agent);
        }
        let deadline = Instant::now() + cluster.spec.subnet_env_timeout;
        for i in 0..cluster.agents.len() {
            let node = &cluster.topology.nodes()[i];
            let agent = &mut cluster.agents[i];
            let remaining = deadline.saturating_duration_since(Instant::now());
            let env = node
                .wait_subnet_env(remaining, || {
                    if cancelled() {
                        bail!("cancelled");
                    }
                    agent.check_running()
                })
                .or_else(|e| {
                    if cancelled() {
                        bail!("cancelled");
                    }
                    agent.check_running()?;
                    bail!(
                        "{e:#}\nthe agent still runs; last lines of {}:\n{}",
                        agent.log_path().display(),
                        agent.log_tail(30)
                    )
                })?;
            progress(&format!("{}: subnet.env {}", node.name(), oneline(&env)));
            cluster.subnet_envs.push(env);
        }
        for n in 1..=cluster.topology.nodes().len() {
            for _ in 0..cluster.spec.pods_per_node {
                let pod = cluster.topology.add_pod(n)?;
                let ip6 = pod.ip6().map(|ip| format!(" {ip}")).unwrap_or_default();
                progress(&format!(
                    "node{n}: pod {} {}{ip6}",
                    pod.name(),
                    pod.ip_net()
                ));
            }
        }
        cluster.wait_pod_ports(Duration::from_secs(20))?;
        Ok(cluster)
    }

    /// Waits until the fast path of every node on it (`--dataplane=ebpf`, or `auto` where the
    /// agent says `path="ebpf"`) takes the packets of all its pods: the agent attaches to new
    /// bridge ports a moment after the pod appears, and a pod connection begun before would
    /// change paths midway (without `--ip-masq` the CNI bridge masquerades the kernel path's
    /// packets and not the fast path's, and the server resets it; `cargo xtask run` saw that).
    pub fn wait_pod_ports(&mut self, timeout: Duration) -> Result<()> {
        let pods_on = |n: usize| {
            self.topology
                .pods()
                .iter()
                .filter(|p| p.node() == n)
                .count()
        };
        // Per node: the pods to wait for, and whether the agent chooses its path (`auto`).
        let wanted: Vec<(usize, bool)> = self
            .topology
            .nodes()
            .iter()
            .map(|node| match self.dataplane_of(node.index()) {
                Dataplane::Kernel => (0, false),
                Dataplane::Ebpf => (pods_on(node.index()), false),
                Dataplane::Auto => (pods_on(node.index()), true),
            })
            .collect();
        let nodes = self.topology.nodes();
        poll_agents(
            &mut self.agents,
            nodes,
            timeout,
            |node, port| match wanted[node.index() - 1] {
                (0, _) => Ok(()),
                (_, true)
                    if status::metric_sum(
                        node.ns(),
                        port,
                        "flannel_dataplane_info",
                        "path=\"ebpf\"",
                    )? == 0.0 =>
                {
                    Ok(())
                }
                (pods, _) => fastpath::expect_pod_ports(node.ns(), port, pods),
            },
        )
    }

    /// Waits until every agent answers `/readyz` with 200 (its first reconcile against the
    /// complete lease set succeeded), failing early if one exits.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let nodes = self.topology.nodes();
        poll_agents(
            &mut self.agents,
            nodes,
            timeout,
            |node, port| match status::http_status(node.ns(), port, "/readyz") {
                Ok(200) => Ok(()),
                other => bail!("not ready (/readyz: {other:?})"),
            },
        )
    }

    /// The agent flags shared by all nodes (in kube mode without those
    /// [`kube::agent_spec`] adds).
    pub fn agent_spec(&self) -> AgentSpec {
        let endpoint = match &self.store {
            Store::Etcd { etcd, .. } => etcd.endpoint(),
            Store::Kube { .. } => kube::NO_ETCD.to_owned(),
        };
        let mut spec = AgentSpec::new(&self.spec.agent, endpoint);
        spec.etcd_prefix = self.spec.etcd_prefix.clone();
        spec.dataplane = Some(self.spec.dataplane);
        spec.ip_masq = self.spec.ip_masq;
        spec.extra_args = self.spec.agent_args.clone();
        if let Some(caps) = &self.spec.agent_capabilities {
            spec.capabilities = Some(caps.clone());
        }
        spec
    }

    /// The agent flags of node `n` (1-based): [`Cluster::agent_spec`] with the node's own
    /// dataplane from [`ClusterSpec::node_dataplanes`].
    pub fn agent_spec_for(&self, n: usize) -> AgentSpec {
        let mut spec = self.agent_spec();
        spec.dataplane = Some(self.dataplane_of(n));
        spec
    }

    /// The `--dataplane` node `n` (1-based) runs with.
    pub fn dataplane_of(&self, n: usize) -> Dataplane {
        n.checked_sub(1)
            .and_then(|i| self.spec.node_dataplanes.get(i))
            .copied()
            .unwrap_or(self.spec.dataplane)
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The topology, mutable (add or remove pods).
    pub fn topology_mut(&mut self) -> &mut Topology {
        &mut self.topology
    }

    /// etcd (lives in the hub).
    ///
    /// # Panics
    /// In kube mode ([`ClusterSpec::kube`]), which has no etcd.
    pub fn etcd(&self) -> &Etcd {
        self.etcd_store().0
    }

    /// etcd, mutable (stop and resume it: see [`Cluster::stop_etcd`]).
    ///
    /// # Panics
    /// In kube mode.
    pub fn etcd_mut(&mut self) -> &mut Etcd {
        match &mut self.store {
            Store::Etcd { etcd, .. } => etcd,
            Store::Kube { .. } => panic!("{NO_ETCD_HERE}"),
        }
    }

    /// Kills etcd (SIGKILL: to the agents it looks like a crash or a network outage).
    ///
    /// # Panics
    /// In kube mode.
    pub fn stop_etcd(&mut self) {
        self.etcd_mut().stop();
    }

    /// Starts etcd again on the same address and data (inside the hub, where it listens)
    /// and waits until it is healthy.
    ///
    /// # Panics
    /// In kube mode.
    pub fn resume_etcd(&mut self) -> Result<()> {
        let Store::Etcd { etcd, .. } = &mut self.store else {
            panic!("{NO_ETCD_HERE}");
        };
        self.topology.hub().enter(move || etcd.resume())?
    }

    /// etcd access from the hub.
    ///
    /// # Panics
    /// In kube mode.
    pub fn kv(&self) -> &Kv {
        self.etcd_store().1
    }

    fn etcd_store(&self) -> (&Etcd, &Kv) {
        match &self.store {
            Store::Etcd { etcd, kv } => (etcd, kv),
            Store::Kube { .. } => panic!("{NO_ETCD_HERE}"),
        }
    }

    /// The fake API server of a kube-mode cluster (`None` with etcd).
    pub fn api(&self) -> Option<&MockApiServer> {
        match &self.store {
            Store::Kube { api, .. } => Some(api),
            Store::Etcd { .. } => None,
        }
    }

    /// The spec it was built from.
    pub fn spec(&self) -> &ClusterSpec {
        &self.spec
    }

    /// Agent of node `n` (1-based).
    pub fn agent_mut(&mut self, n: usize) -> Option<&mut Agent> {
        self.agents.get_mut(n.checked_sub(1)?)
    }

    /// All agents, in node order.
    pub fn agents_mut(&mut self) -> &mut [Agent] {
        &mut self.agents
    }

    /// subnet.env of each node as read at start-up, in node order.
    pub fn subnet_envs(&self) -> &[SubnetEnv] {
        &self.subnet_envs
    }

    /// Node `n`'s (1-based) pod subnet, from its subnet.env read at start-up.
    pub fn subnet_of(&self, n: usize) -> Option<Ipv4Net> {
        self.subnet_envs.get(n.checked_sub(1)?)?.lease()
    }

    /// The etcd key of node `n`'s lease (`None` in kube mode).
    pub fn lease_key(&self, n: usize) -> Option<String> {
        if self.api().is_some() {
            return None;
        }
        Some(format!(
            "{}/subnets/{}",
            self.spec.etcd_prefix,
            lease::subnet_key(self.subnet_of(n)?)
        ))
    }

    /// The cluster entries in node `n`'s kernel (its own subnet left out).
    pub fn kernel_state(&self, n: usize) -> Result<status::KernelState> {
        let node = self
            .topology
            .nodes()
            .get(n.wrapping_sub(1))
            .with_context(|| format!("no node {n}"))?;
        status::kernel_state(node.ns(), self.spec.network, self.subnet_of(n))
    }

    /// Value of metric `name` on node `n`'s agent (`None` if it does not export it).
    pub fn metric(&self, n: usize, name: &str) -> Result<Option<f64>> {
        let node = self
            .topology
            .nodes()
            .get(n.wrapping_sub(1))
            .with_context(|| format!("no node {n}"))?;
        let port = self
            .agents
            .get(n - 1)
            .and_then(Agent::healthz_port)
            .context("the agent has no health port")?;
        status::metric(node.ns(), port, name)
    }

    /// The leases in etcd, or on the Node objects in kube mode.
    pub fn leases(&self) -> Result<Vec<LeaseRecord>> {
        match &self.store {
            Store::Etcd { kv, .. } => lease::read_leases(kv, &self.spec.etcd_prefix),
            Store::Kube { api, .. } => kube::leases(api, &self.topology),
        }
    }

    /// Every pod to every pod.
    pub fn matrix(&self, timeout: Duration) -> Result<Matrix> {
        let pods: Vec<_> = self.topology.pods().iter().collect();
        probe::matrix(&pods, timeout)
    }

    /// The leases as a table.
    pub fn leases_text(&self) -> Result<String> {
        let leases = self.leases()?;
        let mut out = match self.store {
            Store::Etcd { .. } => format!(
                "leases in etcd ({} under {}/subnets/):\n",
                leases.len(),
                self.spec.etcd_prefix
            ),
            Store::Kube { .. } => format!(
                "leases on the Node objects ({} with flannel's annotations):\n",
                leases.len()
            ),
        };
        for l in &leases {
            let node = self
                .topology
                .nodes()
                .iter()
                .find(|n| Some(n.addr()) == l.public_ip)
                .map(|n| n.name())
                .unwrap_or_else(|| "?".to_owned());
            let _ = writeln!(
                out,
                "  {:<18} {:<7} public {:<15} {:<10} {}",
                l.subnet.to_string(),
                node,
                l.public_ip.map(|ip| ip.to_string()).unwrap_or_default(),
                l.backend_type.as_deref().unwrap_or("-"),
                l.backend_data
                    .as_ref()
                    .map(Value::to_string)
                    .unwrap_or_default()
            );
            if let Some(subnet6) = l.subnet6 {
                let public6 = l.public_ipv6.as_deref().unwrap_or("-");
                let _ = writeln!(out, "  {:<26} public {public6}", subnet6.to_string());
            }
        }
        Ok(out)
    }

    /// The live status block: leases, then per node the agent, the cluster routes by
    /// protocol, neighbour and FDB counts, health and metrics.
    pub fn status_text(&mut self) -> String {
        let mut out = match self.leases_text() {
            Ok(text) => text,
            Err(e) => format!("leases: {e:#}\n"),
        };
        out += "nodes:\n";
        let network = self.spec.network;
        for (i, agent) in self.agents.iter_mut().enumerate() {
            let node = &self.topology.nodes()[i];
            let local = self.subnet_envs.get(i).and_then(SubnetEnv::lease);
            let agent_text = match agent.exit_status() {
                Some(status) => format!("agent EXITED ({status})"),
                None => format!(
                    "agent pid {} rss {} MiB",
                    agent.pid(),
                    agent.rss_kib().unwrap_or(0) / 1024
                ),
            };
            let kernel = match status::kernel_counts(node.ns(), network, local) {
                Ok(c) => format!(
                    "routes {} {:?} neigh {} fdb {}",
                    c.routes, c.route_protocols, c.neighbours, c.fdb
                ),
                Err(e) => format!("kernel: {e:#}"),
            };
            let (health, metrics) = match agent.healthz_port() {
                Some(port) => (
                    status::health_line(node.ns(), port),
                    status::metrics_line(node.ns(), port),
                ),
                None => ("no healthz port".to_owned(), "n/a".to_owned()),
            };
            let _ = writeln!(
                out,
                "  {} {} subnet {}: {agent_text}\n    {kernel}\n    {health}; metrics: {metrics}",
                node.name(),
                node.addr(),
                local.map(|l| l.to_string()).unwrap_or_else(|| "?".into()),
            );
        }
        out
    }
}

const NO_ETCD_HERE: &str = "this cluster runs in kube mode: it has no etcd";

fn oneline(env: &SubnetEnv) -> String {
    env.render().trim_end().replace('\n', " ")
}

/// Polls `check(node, healthz port)` for every agent that serves one, in turn, until it holds;
/// fails at once if the agent exits, and with the last check's error and the agent's log
/// when `timeout` (for all of them together) runs out.
fn poll_agents(
    agents: &mut [Agent],
    nodes: &[crate::topology::Node],
    timeout: Duration,
    mut check: impl FnMut(&crate::topology::Node, u16) -> Result<()>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    for (agent, node) in agents.iter_mut().zip(nodes) {
        let Some(port) = agent.healthz_port() else {
            continue;
        };
        loop {
            agent.check_running()?;
            let Err(err) = check(node, port) else {
                break;
            };
            if Instant::now() >= deadline {
                bail!(
                    "{}: {err:#} after {timeout:?}; last lines of {}:\n{}",
                    node.name(),
                    agent.log_path().display(),
                    agent.log_tail(30)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}
