//! `flannel-lab bench control`: how long one node's agent takes to program N remote leases
//! into its kernel (and, with `--dataplane ebpf`, into the fast path's maps), how much memory
//! it needs for that, and how long one lease event then takes to reach the dataplane.
//!
//! For each N: a fresh one-node topology with etcd in its hub, the config
//! (`10.0.0.0/8`, `/24` subnets, vxlan), N fake remote leases in upstream's JSON (written in
//! 128-operation transactions, all on one 24 h etcd lease), then the agent is started and the
//! node's kernel is polled until it holds N routes, N neighbours and N FDB entries. At that
//! point the agent's peak RSS (`VmHWM`) is read, its `/metrics` (reconcile runs) scraped and
//! its log's `dataplane reconciled` lines summed (kernel writes, time spent applying, per
//! applier). On the eBPF path the pinned route map is polled too, until it holds N entries.
//!
//! With `--kube` the leases are Node objects instead, as a kubeadm, k3s or rke2 cluster holds
//! them: N realistic Nodes (about 14 KB of JSON each: the flannel annotations of a vxlan
//! lease, the kubelet's labels, status and images) in the test kit's fake API server in the
//! hub, and the agent in kube mode (`--kube-subnet-mgr`, the config as its `net-conf.json`).
//! A lease event is then a Node created or deleted.
//!
//! With `--baseline-agent` another build of the agent runs too, on its own fresh topology for
//! each N and dataplane, `--rounds` times each, the baseline first in even rounds and second
//! in odd ones; the report ends with each figure's ratio of the agent's median over the
//! rounds to the baseline's ([`ratios`]).
//!
//! Lease events: after convergence, `--events` times a new lease is put into etcd and the
//! time until its subnet is in the route map (eBPF) or the kernel's routing table (kernel
//! path) is measured, then the lease is deleted and the time until it is gone is measured;
//! the map is read with one lookup syscall per poll, the routing table with `ip route show`.
//!
//! With etcd, each run first measures its floor in the same topology ([`control_floor`]):
//! listing the leases with a bare client, writing their kernel entries with iproute2, and a
//! bare watcher's delivery of the same lease events; the report gives the agent's figures
//! over it.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use ipnet::Ipv4Net;
use serde::Serialize;
use serde_json::json;
use std::net::Ipv4Addr;

use super::{
    control_floor::{self, Floor},
    report::{Machine, utc_now},
};
use crate::{
    etcd::Etcd,
    kube_mock::{self, MockApiServer},
    lab::{
        agent::{Agent, AgentSpec, Dataplane},
        fastpath::RouteMap,
        kube,
        kv::Kv,
        lease,
        status::{self, KernelCounts},
    },
    topology::{Node, Topology, TopologySpec, Underlay},
};

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct ControlOptions {
    /// The lease counts to try, e.g. `[1000, 5000]`.
    pub nodes: Vec<usize>,
    /// The agent; `None` only writes and counts the leases.
    pub agent: Option<PathBuf>,
    /// How long the agent may take per N.
    pub timeout: Duration,
    /// The dataplanes to measure, each N once per dataplane.
    pub dataplanes: Vec<Dataplane>,
    /// Lease events (one add and one delete each) timed after convergence.
    pub events: usize,
    /// The leases are Node objects in a fake API server, the agent in kube mode.
    pub kube: bool,
    /// Another build of the agent to measure against in the same run: each N and dataplane
    /// then runs both, on fresh topologies, alternating which goes first.
    pub baseline: Option<PathBuf>,
    /// Runs of each agent per N and dataplane.
    pub rounds: usize,
}

/// The result for one N.
#[derive(Debug, Clone, Serialize)]
pub struct ControlResult {
    /// Which agent ran: `agent`, or `baseline` (`--baseline-agent`).
    pub agent: String,
    /// Number of fake remote leases.
    pub leases: usize,
    /// `--dataplane` of the agent (`kernel` or `ebpf`).
    pub dataplane: String,
    /// Where the leases are: `etcd`, or `kube` (Node objects).
    pub store: String,
    /// Seconds to write them to etcd (or create the Nodes).
    pub write_seconds: f64,
    /// Keys found under `<prefix>/subnets/` afterwards (kube: the remote Nodes the API server
    /// holds).
    pub keys_in_etcd: i64,
    /// Seconds from agent start until its subnet.env existed (config, lease listing and
    /// acquisition, devices, rules).
    pub lease_seconds: Option<f64>,
    /// Seconds from agent start until the kernel held everything.
    pub converge_seconds: Option<f64>,
    /// Reconcile runs the agent reports (`flannel_reconcile_runs_total`), no-op ones included.
    pub reconciles: Option<u64>,
    /// Reconciles that wrote to the kernel (`dataplane reconciled` log lines).
    pub writing_reconciles: u64,
    /// Kernel write operations (netlink requests) those reconciles issued, summed.
    pub kernel_writes: u64,
    /// Time those reconciles took, summed (listing, diffing and applying), seconds.
    pub reconcile_seconds: f64,
    /// Seconds from agent start until the fast path's route map held all N (eBPF only).
    pub map_seconds: Option<f64>,
    /// Time each applier spent in the reconciles that wrote something, summed, seconds
    /// (`kernel`, `ebpf`, ...; from the log's `appliers=` field).
    pub applier_seconds: Vec<(String, f64)>,
    /// Lease added in etcd → in the route map (eBPF) or routing table (kernel), ms.
    pub event_add_ms: Option<Latency>,
    /// Lease deleted in etcd → gone from the route map or routing table, ms.
    pub event_delete_ms: Option<Latency>,
    /// The agent's own time per lease event: the reconciles the events made, from the
    /// log's `dataplane reconciled` lines after convergence, ms.
    pub event_reconcile_ms: Option<Latency>,
    /// The eBPF applier's share of each of those reconciles (reading the maps, diffing,
    /// writing), ms.
    pub event_ebpf_ms: Option<Latency>,
    /// Agent's `VmHWM` at that point, KiB.
    pub peak_rss_kib: Option<u64>,
    /// The floor measured in the same topology before the agent started (etcd only).
    pub floor: Option<Floor>,
    /// Routes in the kernel at the end.
    pub routes: usize,
    /// Neighbours in the kernel at the end.
    pub neighbours: usize,
    /// FDB entries in the kernel at the end.
    pub fdb: usize,
    /// Why the agent part failed, if it did.
    pub error: Option<String>,
}

/// Median, 95th percentile and maximum of a set of latencies, ms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Latency {
    /// Samples.
    pub n: usize,
    /// Median.
    pub p50: f64,
    /// 95th percentile (nearest rank).
    pub p95: f64,
    /// Largest.
    pub max: f64,
}

impl Latency {
    /// `None` for no samples.
    pub fn of(samples: &[f64]) -> Option<Latency> {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(Latency {
            n: v.len(),
            p50: rank(0.5),
            p95: rank(0.95),
            max: v[v.len() - 1],
        })
    }
}

impl std::fmt::Display for Latency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.1} / {:.1} / {:.1}", self.p50, self.p95, self.max)
    }
}

/// The config the control benchmark stores.
pub fn control_netconf() -> serde_json::Value {
    json!({"Network": "10.0.0.0/8", "SubnetLen": 24, "Backend": {"Type": "vxlan"}})
}

/// Runs the benchmark for every N (with a baseline agent: both agents, alternating which
/// goes first, [`ControlOptions::rounds`] times each); `cancelled` is polled between steps
/// (Ctrl-C).
pub fn run(
    opts: &ControlOptions,
    log: &dyn Fn(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<Vec<ControlResult>> {
    let mut results = Vec::new();
    let runs: Vec<(usize, Dataplane)> = opts
        .nodes
        .iter()
        .flat_map(|&n| opts.dataplanes.iter().map(move |&d| (n, d)))
        .collect();
    for (n, dataplane) in runs {
        for round in 0..opts.rounds.max(1) {
            for (role, agent) in agents_in_order(opts, round) {
                if cancelled() {
                    bail!("cancelled");
                }
                results.push(one(opts, n, dataplane, role, agent, log, cancelled)?);
            }
        }
    }
    Ok(results)
}

/// The agents of round `round` (counted from 0), in the order they run: the baseline agent
/// first in even rounds and second in odd ones, so that neither always meets a fresher
/// machine.
fn agents_in_order(opts: &ControlOptions, round: usize) -> Vec<(&'static str, Option<&Path>)> {
    let mut order = vec![(AGENT, opts.agent.as_deref())];
    if let Some(baseline) = &opts.baseline {
        order.insert(0, (BASELINE, Some(baseline.as_path())));
        if round % 2 == 1 {
            order.reverse();
        }
    }
    order
}

/// [`ControlResult::agent`] of the agent measured.
pub const AGENT: &str = "agent";
/// [`ControlResult::agent`] of `--baseline-agent`.
pub const BASELINE: &str = "baseline";

/// One N on one dataplane with one agent (`role` names it), on a fresh topology.
fn one(
    opts: &ControlOptions,
    n: usize,
    dataplane: Dataplane,
    role: &str,
    agent: Option<&Path>,
    log: &dyn Fn(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<ControlResult> {
    let network: Ipv4Net = "10.0.0.0/8".parse().context("network")?;
    let what = if opts.kube { "fake API server" } else { "etcd" };
    log(&format!(
        "{n} leases, {dataplane}, {role}: building a one-node topology with {what}"
    ));
    // With etcd, a second node where the floor writes its kernel entries.
    let nodes = if opts.kube { 1 } else { 2 };
    let topo = Topology::new(TopologySpec::new(nodes, Underlay::L2))?;
    let store = if opts.kube {
        Store::kube(&topo)?
    } else {
        Store::etcd(&topo)?
    };
    let start = Instant::now();
    let keys_in_etcd = store.write(n)?;
    let write_seconds = start.elapsed().as_secs_f64();
    log(&format!(
        "{n} leases: written in {write_seconds:.2} s ({keys_in_etcd} {})",
        store.holding()
    ));
    let mut result = ControlResult {
        agent: role.to_owned(),
        leases: n,
        dataplane: dataplane.to_string(),
        store: store.name().to_owned(),
        write_seconds,
        keys_in_etcd,
        lease_seconds: None,
        converge_seconds: None,
        reconciles: None,
        writing_reconciles: 0,
        kernel_writes: 0,
        reconcile_seconds: 0.0,
        map_seconds: None,
        applier_seconds: Vec::new(),
        event_add_ms: None,
        event_delete_ms: None,
        event_reconcile_ms: None,
        event_ebpf_ms: None,
        peak_rss_kib: None,
        floor: None,
        routes: 0,
        neighbours: 0,
        fdb: 0,
        error: None,
    };
    let Some(agent) = agent else {
        return Ok(result);
    };
    if let Store::Etcd { endpoint, .. } = &store {
        let kv = Kv::new(topo.node(1).ns(), endpoint.clone());
        let event = |i| event_lease(i).map(|(key, value, _)| (key, value));
        let floor = control_floor::measure(&kv, n, topo.node(2), opts.events, &event)
            .context("the floor")?;
        log(&format!(
            "{n} leases, {dataplane}, {role}: floor: listed in {:.3} s, kernel written in {:.3} s, \
             lease event add {} / delete {} ms at a bare watcher",
            floor.list_seconds,
            floor.kernel_seconds,
            or_dash(floor.event_add_ms),
            or_dash(floor.event_delete_ms),
        ));
        result.floor = Some(floor);
    }
    let mut base = AgentSpec::new(agent, "");
    base.dataplane = Some(dataplane);
    let spec = store.agent_spec(topo.node(1), &base)?;
    let run = Run {
        topo: &topo,
        store: &store,
        spec: &spec,
        network,
        n,
        events: opts.events,
        timeout: opts.timeout,
        cancelled,
    };
    match run.converge(&mut result) {
        Ok(()) => log(&format!(
            "{n} leases, {dataplane}, {role}: subnet.env after {:.2} s, kernel complete after \
             {:.2} s, map complete after {}, agent peak RSS {} KiB, {} writes in {} \
             writing reconcile(s) taking {:.2} s ({}), lease event add {} / delete {} \
             ms (p50 / p95 / max), the agent's reconcile {} ms, of it eBPF {} ms",
            result.lease_seconds.unwrap_or(f64::NAN),
            result.converge_seconds.unwrap_or(f64::NAN),
            or_dash(result.map_seconds.map(|s| format!("{s:.2} s"))),
            result.peak_rss_kib.unwrap_or(0),
            result.kernel_writes,
            result.writing_reconciles,
            result.reconcile_seconds,
            applier_text(&result.applier_seconds),
            or_dash(result.event_add_ms),
            or_dash(result.event_delete_ms),
            or_dash(result.event_reconcile_ms),
            or_dash(result.event_ebpf_ms),
        )),
        Err(e) => {
            log(&format!("{n} leases, {role}: agent part failed: {e:#}"));
            result.error = Some(format!("{e:#}"));
        }
    }
    Ok(result)
}

/// The agent against the baseline agent for one N and dataplane: each figure's median over
/// the rounds of the one divided by the other's (below 1: the agent is faster or smaller).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ratio {
    /// Number of fake remote leases.
    pub leases: usize,
    /// `--dataplane`.
    pub dataplane: String,
    /// Rounds each agent completed without error.
    pub rounds: usize,
    /// Kernel complete after start.
    pub converge: Option<f64>,
    /// Route map complete after start (eBPF).
    pub map: Option<f64>,
    /// Lease event added, p50.
    pub event_add: Option<f64>,
    /// Lease event deleted, p50.
    pub event_delete: Option<f64>,
    /// The agent's reconcile per lease event, p50.
    pub event_reconcile: Option<f64>,
    /// Peak RSS.
    pub peak_rss: Option<f64>,
}

/// The ratios of the agent's results to the baseline agent's, per N and dataplane measured
/// with both (none without `--baseline-agent`). Runs that failed are left out.
pub fn ratios(results: &[ControlResult]) -> Vec<Ratio> {
    let mut out: Vec<Ratio> = Vec::new();
    for r in results {
        if out
            .iter()
            .any(|o| o.leases == r.leases && o.dataplane == r.dataplane)
        {
            continue;
        }
        let of = |role: &str| -> Vec<&ControlResult> {
            results
                .iter()
                .filter(|x| {
                    x.agent == role
                        && x.leases == r.leases
                        && x.dataplane == r.dataplane
                        && x.error.is_none()
                })
                .collect()
        };
        let (mine, theirs) = (of(AGENT), of(BASELINE));
        if mine.is_empty() || theirs.is_empty() {
            continue;
        }
        let ratio = |f: &dyn Fn(&ControlResult) -> Option<f64>| {
            let a = median(mine.iter().filter_map(|x| f(x)).collect())?;
            let b = median(theirs.iter().filter_map(|x| f(x)).collect())?;
            (b > 0.0).then(|| a / b)
        };
        out.push(Ratio {
            leases: r.leases,
            dataplane: r.dataplane.clone(),
            rounds: mine.len().min(theirs.len()),
            converge: ratio(&|x| x.converge_seconds),
            map: ratio(&|x| x.map_seconds),
            event_add: ratio(&|x| x.event_add_ms.map(|l| l.p50)),
            event_delete: ratio(&|x| x.event_delete_ms.map(|l| l.p50)),
            event_reconcile: ratio(&|x| x.event_reconcile_ms.map(|l| l.p50)),
            peak_rss: ratio(&|x| x.peak_rss_kib.map(|k| k as f64)),
        });
    }
    out
}

/// The median of `values` (the mean of the middle two for an even count); `None` for none.
fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    match values.len() {
        0 => None,
        len if len % 2 == 1 => Some(values[mid]),
        _ => Some((values[mid - 1] + values[mid]) / 2.0),
    }
}

/// Where the leases are kept.
enum Store {
    /// etcd in the hub.
    Etcd {
        kv: Kv,
        endpoint: String,
        _etcd: Etcd,
    },
    /// The fake API server in the hub, served by its own runtime.
    Kube {
        api: MockApiServer,
        _runtime: tokio::runtime::Runtime,
    },
}

impl Store {
    /// etcd in `topo`'s hub, holding the config.
    fn etcd(topo: &Topology) -> Result<Store> {
        let etcd = topo.start_etcd()?;
        let kv = Kv::new(topo.hub(), etcd.endpoint());
        lease::write_netconf(&kv, lease::DEFAULT_PREFIX, &control_netconf())?;
        Ok(Store::Etcd {
            kv,
            endpoint: etcd.endpoint().to_owned(),
            _etcd: etcd,
        })
    }

    /// The fake API server in `topo`'s hub, holding the node's own Node (pod CIDR
    /// `10.0.0.0/24`, below the remote leases).
    fn kube(topo: &Topology) -> Result<Store> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let api = kube::api_in_hub(&runtime, topo, &|_| vec!["10.0.0.0/24".to_owned()])?;
        Ok(Store::Kube {
            api,
            _runtime: runtime,
        })
    }

    fn name(&self) -> &'static str {
        match self {
            Store::Etcd { .. } => "etcd",
            Store::Kube { .. } => "kube",
        }
    }

    /// What [`Store::write`] counts.
    fn holding(&self) -> String {
        match self {
            Store::Etcd { .. } => format!("keys under {}/subnets/", lease::DEFAULT_PREFIX),
            Store::Kube { .. } => "remote Nodes in the API server".to_owned(),
        }
    }

    /// Writes `n` remote vxlan leases (the same subnets, public IPs and VTEP MACs either way)
    /// and returns how many the store then holds.
    fn write(&self, n: usize) -> Result<i64> {
        let leases = lease::fake_vxlan_leases(lease::DEFAULT_PREFIX, n)?;
        match self {
            Store::Etcd { kv, .. } => {
                kv.put_all_with_ttl(leases, 86_400)?;
                kv.count_prefix(&format!("{}/subnets/", lease::DEFAULT_PREFIX))
            }
            Store::Kube { api, .. } => {
                for (i, (key, value)) in leases.iter().enumerate() {
                    api.apply_node(lease_node(&format!("remote-{i}"), key, value)?);
                }
                let remote = api
                    .node_names()
                    .iter()
                    .filter(|name| name.starts_with("remote-"))
                    .count();
                Ok(i64::try_from(remote)?)
            }
        }
    }

    /// The agent of `node`: `base` against etcd, or in kube mode against the API server.
    fn agent_spec(&self, node: &Node, base: &AgentSpec) -> Result<AgentSpec> {
        match self {
            Store::Etcd { endpoint, .. } => {
                let mut spec = base.clone();
                endpoint.clone_into(&mut spec.etcd_endpoints);
                Ok(spec)
            }
            Store::Kube { api, .. } => kube::agent_spec(node, api, &control_netconf(), base),
        }
    }

    /// Puts the `i`-th event lease; its subnet.
    fn put_event(&self, i: usize) -> Result<Ipv4Net> {
        let (key, value, subnet) = event_lease(i)?;
        match self {
            Store::Etcd { kv, .. } => kv.put(&key, &value)?,
            Store::Kube { api, .. } => {
                api.apply_node(lease_node(&format!("event-{i}"), &key, &value)?);
            }
        }
        Ok(subnet)
    }

    /// Deletes the `i`-th event lease.
    fn delete_event(&self, i: usize) -> Result<()> {
        match self {
            Store::Etcd { kv, .. } => {
                kv.delete(&event_lease(i)?.0)?;
            }
            Store::Kube { api, .. } => {
                api.delete_node(&format!("event-{i}"))
                    .with_context(|| format!("Node event-{i} was not there"))?;
            }
        }
        Ok(())
    }
}

/// The realistic Node `name` (as a kubelet and flannel leave it) whose lease is the etcd lease
/// `key` = `value`: its subnet as the pod CIDR, its public IP and VTEP MAC.
fn lease_node(name: &str, key: &str, value: &str) -> Result<serde_json::Value> {
    let (subnet, _) = key
        .rsplit('/')
        .next()
        .and_then(lease::parse_subnet_key)
        .with_context(|| format!("no subnet in {key}"))?;
    let lease: serde_json::Value = serde_json::from_str(value)?;
    let public_ip = lease["PublicIP"].as_str().context("PublicIP")?;
    let mut node = kube_mock::realistic_node(name, 0, &subnet.to_string(), public_ip);
    node["metadata"]["annotations"]["flannel.alpha.coreos.com/backend-data"] =
        serde_json::Value::String(lease["BackendData"].to_string());
    Ok(node)
}

/// One N on one dataplane: the topology, the lease store and the agent to start.
struct Run<'a> {
    topo: &'a Topology,
    store: &'a Store,
    spec: &'a AgentSpec,
    network: Ipv4Net,
    n: usize,
    events: usize,
    timeout: Duration,
    cancelled: &'a dyn Fn() -> bool,
}

impl Run<'_> {
    fn ebpf(&self) -> bool {
        self.spec.dataplane == Some(Dataplane::Ebpf)
    }

    /// Starts the agent and polls the kernel (and on the eBPF path the route map) until it
    /// holds `n` routes, neighbours and FDB entries (map entries), then times lease events.
    fn converge(&self, result: &mut ControlResult) -> Result<()> {
        let node = self.topo.node(1);
        let start = Instant::now();
        let mut agent = Agent::start(node, self.spec)?;
        let deadline = start + self.timeout;
        let mut last = KernelCounts::default();
        let mut map: Option<RouteMap> = None;
        let n = self.n;
        loop {
            if (self.cancelled)() {
                bail!("cancelled");
            }
            agent.check_running()?;
            let env = node.read_subnet_env().ok().flatten();
            if result.lease_seconds.is_none() && env.as_ref().is_some_and(|e| e.subnet.is_some()) {
                result.lease_seconds = Some(start.elapsed().as_secs_f64());
            }
            if self.ebpf() && result.map_seconds.is_none() {
                if map.is_none() {
                    map = RouteMap::open(node.bpf_pin_path()).ok();
                }
                if let Some(m) = &map
                    && m.len().is_ok_and(|len| len >= n)
                {
                    result.map_seconds = Some(start.elapsed().as_secs_f64());
                }
            }
            let local = env.and_then(|e| e.lease());
            last = status::kernel_counts(node.ns(), self.network, local).unwrap_or(last);
            (result.routes, result.neighbours, result.fdb) =
                (last.routes, last.neighbours, last.fdb);
            let map_done = !self.ebpf() || result.map_seconds.is_some();
            if map_done && status::require_counts(&last, n, n, n).is_ok() {
                result.converge_seconds = Some(start.elapsed().as_secs_f64());
                result.peak_rss_kib = agent.peak_rss_kib();
                if let Some(port) = agent.healthz_port() {
                    result.reconciles =
                        status::metric(node.ns(), port, "flannel_reconcile_runs_total")
                            .ok()
                            .flatten()
                            .map(|v| v as u64);
                }
                let text = std::fs::read_to_string(agent.log_path()).unwrap_or_default();
                let applied = applied_reconciles(&text);
                result.writing_reconciles = applied.len() as u64;
                result.kernel_writes = applied.iter().map(|a| a.ops).sum();
                result.reconcile_seconds = applied.iter().map(|a| a.seconds).sum();
                result.applier_seconds = sum_appliers(&applied);
                let events = self.lease_events(map.as_ref(), &agent);
                let _ = agent.stop(Duration::from_secs(10));
                let (add, delete) = events?;
                result.event_add_ms = Latency::of(&add);
                result.event_delete_ms = Latency::of(&delete);
                let text = std::fs::read_to_string(agent.log_path()).unwrap_or_default();
                let by_events: Vec<Applied> = applied_reconciles(&text)
                    .into_iter()
                    .skip(applied.len())
                    .collect();
                let ms = |f: &dyn Fn(&Applied) -> Option<f64>| {
                    Latency::of(
                        &by_events
                            .iter()
                            .filter_map(f)
                            .map(|s| s * 1e3)
                            .collect::<Vec<_>>(),
                    )
                };
                result.event_reconcile_ms = ms(&|a| Some(a.seconds));
                result.event_ebpf_ms = ms(&|a| a.applier("ebpf"));
                return Ok(());
            }
            if Instant::now() >= deadline {
                result.peak_rss_kib = agent.peak_rss_kib();
                if !map_done {
                    bail!(
                        "the route map did not hold {n} entries after {:?}; agent log:\n{}",
                        self.timeout,
                        agent.log_tail(20)
                    );
                }
                status::require_counts(&last, n, n, n).with_context(|| {
                    format!(
                        "after {:?}; agent log:\n{}",
                        self.timeout,
                        agent.log_tail(20)
                    )
                })?;
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Puts [`Run::events`] new leases one at a time and deletes each again, timing how long
    /// each change takes to reach the route map (eBPF) or the routing table (kernel path).
    fn lease_events(&self, map: Option<&RouteMap>, agent: &Agent) -> Result<(Vec<f64>, Vec<f64>)> {
        let (mut add, mut delete) = (Vec::new(), Vec::new());
        for i in 0..self.events {
            if (self.cancelled)() {
                bail!("cancelled");
            }
            let t0 = Instant::now();
            let subnet = self.store.put_event(i)?;
            add.push(self.wait_for(map, subnet, true, t0, agent)?);
            let t0 = Instant::now();
            self.store.delete_event(i)?;
            delete.push(self.wait_for(map, subnet, false, t0, agent)?);
        }
        Ok((add, delete))
    }

    /// Polls until `subnet` is (or is no longer) programmed; ms since `t0`.
    fn wait_for(
        &self,
        map: Option<&RouteMap>,
        subnet: Ipv4Net,
        present: bool,
        t0: Instant,
        agent: &Agent,
    ) -> Result<f64> {
        let ns = self.topo.node(1).ns();
        let limit = Duration::from_secs(10);
        loop {
            let now = match map {
                Some(m) => m.get(subnet)?.is_some(),
                None => {
                    let out = ns
                        .command("ip")
                        .args(["-4", "route", "show", "exact", &subnet.to_string()])
                        .output()
                        .context("ip route show")?;
                    !out.stdout.is_empty()
                }
            };
            if now == present {
                return Ok(t0.elapsed().as_secs_f64() * 1e3);
            }
            if t0.elapsed() > limit {
                bail!(
                    "lease event for {subnet} ({}) not applied within {limit:?}; agent log:\n{}",
                    if present { "added" } else { "deleted" },
                    agent.log_tail(10)
                );
            }
            thread::sleep(Duration::from_micros(500));
        }
    }
}

/// The `i`-th event lease: a subnet under `10.250.0.0/16` (the fake leases stop far below),
/// upstream's vxlan lease JSON.
fn event_lease(i: usize) -> Result<(String, String, Ipv4Net)> {
    let i = u8::try_from(i).context("at most 256 lease events")?;
    let subnet = Ipv4Net::new(Ipv4Addr::new(10, 250, i, 0), 24)?;
    let value = json!({
        "PublicIP": Ipv4Addr::new(100, 127, 0, i).to_string(),
        "PublicIPv6": null,
        "BackendType": "vxlan",
        "BackendData": { "VNI": 1, "VtepMAC": format!("0e:ff:00:00:00:{i:02x}") },
    });
    Ok((
        format!(
            "{}/subnets/{}",
            lease::DEFAULT_PREFIX,
            lease::subnet_key(subnet)
        ),
        value.to_string(),
        subnet,
    ))
}

/// `value`, or `-` when there is none.
fn or_dash<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// Per-applier times summed over `applied`, in first-seen order.
fn sum_appliers(applied: &[Applied]) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = Vec::new();
    for a in applied {
        for (name, seconds) in &a.appliers {
            match out.iter_mut().find(|(n, _)| n == name) {
                Some((_, total)) => *total += seconds,
                None => out.push((name.clone(), *seconds)),
            }
        }
    }
    out
}

/// `kernel 0.81 s, ebpf 0.02 s`.
fn applier_text(appliers: &[(String, f64)]) -> String {
    if appliers.is_empty() {
        return "-".to_owned();
    }
    appliers
        .iter()
        .map(|(name, s)| format!("{name} {s:.3} s"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One `dataplane reconciled` line of the agent's log.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// `ops N`: write operations issued.
    pub ops: u64,
    /// `duration=...`, seconds.
    pub seconds: f64,
    /// `appliers=kernel:1.2s,ebpf:20ms`: each applier's time, seconds.
    pub appliers: Vec<(String, f64)>,
}

impl Applied {
    /// The time the applier `name` took, seconds, if it ran.
    pub fn applier(&self, name: &str) -> Option<f64> {
        self.appliers
            .iter()
            .find_map(|(n, s)| (n == name).then_some(*s))
    }
}

/// The reconciles that wrote something, from the agent's log (plain text, tracing's
/// `key=value` fields: `duration=12.3ms`, `stats=added 3, ..., ops 6, skipped 0`).
pub fn applied_reconciles(log: &str) -> Vec<Applied> {
    log.lines()
        .filter(|l| l.contains("dataplane reconciled"))
        .map(|l| Applied {
            ops: l
                .split(", ")
                .find_map(|part| part.trim().strip_prefix("ops ")?.parse().ok())
                .unwrap_or(0),
            seconds: l
                .split_whitespace()
                .find_map(|w| parse_duration(w.strip_prefix("duration=")?))
                .unwrap_or(0.0),
            appliers: l
                .split_whitespace()
                .find_map(|w| w.strip_prefix("appliers="))
                .map(|list| {
                    list.split(',')
                        .filter_map(|item| {
                            let (name, took) = item.split_once(':')?;
                            Some((name.to_owned(), parse_duration(took)?))
                        })
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect()
}

/// Rust's `Debug` of a `Duration` (`1.5s`, `12.3ms`, `800µs`, `120ns`) in seconds.
fn parse_duration(text: &str) -> Option<f64> {
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().ok()?;
    let scale = match unit {
        "s" => 1.0,
        "ms" => 1e-3,
        "µs" | "us" => 1e-6,
        "ns" => 1e-9,
        _ => return None,
    };
    Some(value * scale)
}

/// Markdown for the results.
pub fn markdown(results: &[ControlResult], machine: &Machine) -> String {
    let mut out = format!(
        "# flannel-lab bench control\n\n- machine: {} ({} cores), kernel {}\n- date: {}\n\n\
         Times from agent start. Writes: kernel netlink requests and map updates of the \
         reconciles that changed something, with each applier's share (from the agent's log); \
         reconciles: `flannel_reconcile_runs_total`. Lease events: etcd put/delete of one lease \
         (kube: a Node created/deleted) until the route map (eBPF) or routing table (kernel) reflects it, ms p50 / p95 / max; \
         the agent's part of it: the reconciles the events made, and the eBPF applier's \
         share of each (from the log).\n\n\
         | agent | leases | dataplane | store | write (s) | subnet.env (s) | kernel complete (s) | map complete (s) | agent peak RSS (MiB) | routes | neigh | fdb | writes | reconciles (writing) | reconcile time | event add (ms) | event delete (ms) | event reconcile (ms) | of it eBPF applier (ms) | error |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        machine.cpu_model, machine.cores, machine.kernel, machine.date
    );
    let secs = |v: Option<f64>| or_dash(v.map(|s| format!("{s:.2}")));
    let lat = or_dash::<Latency>;
    for r in results {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} ({}) | {:.2} s ({}) | {} | {} | {} | {} | {} |",
            r.agent,
            r.leases,
            r.dataplane,
            r.store,
            r.write_seconds,
            secs(r.lease_seconds),
            secs(r.converge_seconds),
            secs(r.map_seconds),
            or_dash(r.peak_rss_kib.map(|k| format!("{:.1}", k as f64 / 1024.0))),
            r.routes,
            r.neighbours,
            r.fdb,
            r.kernel_writes,
            or_dash(r.reconciles),
            r.writing_reconciles,
            r.reconcile_seconds,
            applier_text(&r.applier_seconds),
            lat(r.event_add_ms),
            lat(r.event_delete_ms),
            lat(r.event_reconcile_ms),
            lat(r.event_ebpf_ms),
            r.error
                .as_deref()
                .map(|e| e.lines().next().unwrap_or_default().replace('|', "/"))
                .unwrap_or_default()
        );
    }
    floor_section(&mut out, results);
    let ratios = ratios(results);
    if !ratios.is_empty() {
        out.push_str(
            "\n## The agent against the baseline agent\n\nEach figure's median over the rounds, \
             the agent's divided by the baseline agent's (below 1: faster or smaller).\n\n\
             | leases | dataplane | rounds | kernel complete | map complete | event add p50 | \
             event delete p50 | event reconcile p50 | peak RSS |\n\
             |---|---|---|---|---|---|---|---|---|\n",
        );
        let x = |v: Option<f64>| or_dash(v.map(|r| format!("{r:.2}×")));
        for r in ratios {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.leases,
                r.dataplane,
                r.rounds,
                x(r.converge),
                x(r.map),
                x(r.event_add),
                x(r.event_delete),
                x(r.event_reconcile),
                x(r.peak_rss),
            );
        }
    }
    out
}

/// The report's floor table: each run's floor and its figures over it.
fn floor_section(out: &mut String, results: &[ControlResult]) {
    if results.iter().all(|r| r.floor.is_none()) {
        return;
    }
    out.push_str(
        "\n## The agent against the floor\n\nThe floor, measured in the same topology before \
         each agent started: one etcd client lists the leases with one range and parses them \
         (list), iproute2 writes their routes, neighbours and FDB entries onto a VXLAN device \
         in a second namespace (`ip -batch`, `bridge -batch`: kernel), and a bare watcher \
         on the subnets prefix times each event lease from the start of its put (delete) \
         until it has the event. Ratios: the agent's kernel complete over list + kernel, its \
         lease event p50 over the watcher's.\n\n\
         | agent | leases | dataplane | list (s) | kernel (s) | watcher add (ms) | watcher delete (ms) | kernel complete | event add p50 | event delete p50 |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    let x = |v: Option<f64>| or_dash(v.map(|r| format!("{r:.1}×")));
    for r in results {
        let Some(floor) = &r.floor else { continue };
        let ratio = control_floor::ratio(r);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.3} | {:.3} | {} | {} | {} | {} | {} |",
            r.agent,
            r.leases,
            r.dataplane,
            floor.list_seconds,
            floor.kernel_seconds,
            or_dash(floor.event_add_ms),
            or_dash(floor.event_delete_ms),
            x(ratio.as_ref().and_then(|q| q.converge)),
            x(ratio.as_ref().and_then(|q| q.event_add)),
            x(ratio.as_ref().and_then(|q| q.event_delete)),
        );
    }
}

/// Writes `<dir>/<stamp>-control.{md,json}`.
pub fn write(results: &[ControlResult], dir: &Path) -> Result<Vec<PathBuf>> {
    let machine = Machine::current();
    std::fs::create_dir_all(dir)?;
    let (_, stamp) = utc_now();
    let base = dir.join(format!("{stamp}-control"));
    let md = base.with_extension("md");
    std::fs::write(&md, markdown(results, &machine))?;
    let js = base.with_extension("json");
    std::fs::write(
        &js,
        serde_json::to_string_pretty(&json!({
            "machine": machine,
            "results": results,
            "against_floor": results.iter().map(control_floor::ratio).collect::<Vec<_>>(),
            "ratios": ratios(results),
        }))?,
    )?;
    Ok(vec![md, js])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconcile_lines_are_summed() {
        let log = "2026-11-29T12:21:59.742004Z  INFO dataplane reconciled generation=1 peers=1 \
                   duration=5.982918ms stats=added 3, replaced 0, deleted 3, unchanged 0, errors 0, ops 6, skipped 0\n\
                   2026-11-29T12:22:00.1Z  INFO flannel is ready\n\
                   2026-11-29T12:22:01.1Z  INFO dataplane reconciled generation=2 peers=5000 \
                   duration=1.25s appliers=kernel:1.2s,ebpf:41.5ms stats=added 15000, replaced 0, deleted 0, unchanged 3, errors 0, ops 15000, skipped 0\n";
        let applied = applied_reconciles(log);
        assert_eq!(
            applied,
            vec![
                Applied {
                    ops: 6,
                    seconds: 0.005982918,
                    appliers: vec![],
                },
                Applied {
                    ops: 15000,
                    seconds: 1.25,
                    appliers: vec![("kernel".to_owned(), 1.2), ("ebpf".to_owned(), 0.0415)],
                }
            ]
        );
        let summed = sum_appliers(&applied);
        assert_eq!(summed.len(), 2);
        assert_eq!(applier_text(&summed), "kernel 1.200 s, ebpf 0.042 s");
        assert_eq!(parse_duration("800µs"), Some(800.0 * 1e-6));
        assert_eq!(parse_duration("7ns"), Some(7.0 * 1e-9));
        assert_eq!(parse_duration("ms"), None);
        assert_eq!(parse_duration("3h"), None);
    }

    fn result(agent: &str, converge: f64, add_p50: f64, error: bool) -> ControlResult {
        ControlResult {
            agent: agent.to_owned(),
            leases: 5000,
            dataplane: "kernel".to_owned(),
            store: "etcd".to_owned(),
            write_seconds: 1.0,
            keys_in_etcd: 5000,
            lease_seconds: Some(0.1),
            converge_seconds: Some(converge),
            reconciles: Some(2),
            writing_reconciles: 1,
            kernel_writes: 15_000,
            reconcile_seconds: 0.5,
            map_seconds: None,
            applier_seconds: Vec::new(),
            event_add_ms: Latency::of(&[add_p50]),
            event_delete_ms: None,
            event_reconcile_ms: None,
            event_ebpf_ms: None,
            peak_rss_kib: Some(40_000),
            floor: None,
            routes: 5000,
            neighbours: 5000,
            fdb: 5000,
            error: error.then(|| "timed out".to_owned()),
        }
    }

    #[test]
    fn ratios_divide_the_agents_medians_over_rounds_by_the_baselines() {
        let results = [
            result(BASELINE, 2.0, 60.0, false),
            result(AGENT, 1.0, 20.0, false),
            result(AGENT, 1.5, 18.0, false),
            result(BASELINE, 3.0, 62.0, false),
            result(AGENT, 1.1, 19.0, false),
            result(BASELINE, 2.2, 64.0, false),
            // A failed run counts for nothing.
            result(BASELINE, 100.0, 1.0, true),
        ];
        let got = ratios(&results);
        assert_eq!(got.len(), 1);
        let r = &got[0];
        assert_eq!(r.rounds, 3);
        let close = |got: Option<f64>, want: f64| got.is_some_and(|g| (g - want).abs() < 1e-9);
        assert!(close(r.converge, 1.1 / 2.2), "{r:?}");
        assert!(close(r.event_add, 19.0 / 62.0), "{r:?}");
        assert!(close(r.peak_rss, 1.0), "{r:?}");
        assert_eq!((r.map, r.event_delete), (None, None));
        // Without a baseline, or with one that never completed: no ratio.
        assert!(ratios(&results[1..3]).is_empty());
        assert!(
            ratios(&[
                result(AGENT, 1.0, 1.0, false),
                result(BASELINE, 1.0, 1.0, true)
            ])
            .is_empty()
        );
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(Vec::new()), None);
    }

    #[test]
    fn latency_percentiles_use_the_nearest_rank() {
        let l = Latency::of(&[5.0, 1.0, 3.0, 2.0, 4.0, f64::NAN]).expect("samples");
        assert_eq!((l.n, l.p50, l.p95, l.max), (5, 3.0, 5.0, 5.0));
        assert_eq!(Latency::of(&[]), None);
        assert_eq!(Latency::of(&[7.0]).map(|l| l.p95), Some(7.0));
    }

    #[test]
    fn event_leases_are_upstream_json_outside_the_fake_range() {
        let (key, value, subnet) = event_lease(3).expect("lease");
        assert_eq!(key, "/coreos.com/network/subnets/10.250.3.0-24");
        assert_eq!(subnet.to_string(), "10.250.3.0/24");
        let v: serde_json::Value = serde_json::from_str(&value).expect("json");
        assert_eq!(v["BackendData"]["VtepMAC"], "0e:ff:00:00:00:03");
        assert!(event_lease(256).is_err());
    }
}
