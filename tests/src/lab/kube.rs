//! Kube mode in the lab: the fake API server ([`MockApiServer`]) in the hub, where every node
//! reaches it, and one agent per node taking its lease from it (`--kube-subnet-mgr`).

use std::net::TcpListener;

use anyhow::{Context as _, Result};
use ipnet::{Ipv4Net, Ipv6Net};
use serde_json::Value;
use tokio::runtime::Runtime;

use super::{
    agent::{Agent, AgentSpec, Dataplane},
    bins,
    lease::LeaseRecord,
};
use crate::{
    kube_mock::{self, MockApiServer},
    topology::{Node, Topology, TopologySpec, Underlay},
};

/// The annotation prefix the agents use (upstream's default `--kube-annotation-prefix`).
const ANNOTATIONS: &str = "flannel.alpha.coreos.com";

/// The etcd endpoint of an agent in kube mode: nothing listens there.
pub const NO_ETCD: &str = "http://127.0.0.1:1";

/// Starts the fake API server in the hub on `rt` with one Node object per node, whose pod
/// CIDRs (`spec.podCIDRs`, the first also `spec.podCIDR`) are `pod_cidrs(node index)`.
pub fn api_in_hub(
    rt: &Runtime,
    topology: &Topology,
    pod_cidrs: &dyn Fn(usize) -> Vec<String>,
) -> Result<MockApiServer> {
    let hub = topology.hub_addr();
    let listener = topology
        .hub()
        .enter(move || TcpListener::bind((hub, 0)))??;
    let api = rt.block_on(MockApiServer::serve(listener))?;
    for node in topology.nodes() {
        let cidrs = pod_cidrs(node.index());
        let cidrs: Vec<&str> = cidrs.iter().map(String::as_str).collect();
        api.apply_node(kube_mock::node(&node.name(), &cidrs, &[]));
    }
    Ok(api)
}

/// The pod CIDRs a controller manager with `--node-cidr-mask-size` 24 (and 64 for IPv6)
/// gives node `n`: the `n`-th /24 of `network` and the `n`-th /64 of `network6`.
pub fn pod_cidrs(network: Ipv4Net, network6: Option<Ipv6Net>, n: usize) -> Result<Vec<String>> {
    let mut cidrs = vec![
        network
            .subnets(24)
            .ok()
            .and_then(|mut s| s.nth(n))
            .with_context(|| format!("{network} has no /24 for node {n}"))?
            .to_string(),
    ];
    if let Some(network6) = network6 {
        cidrs.push(
            network6
                .subnets(64)
                .ok()
                .and_then(|mut s| s.nth(n))
                .with_context(|| format!("{network6} has no /64 for node {n}"))?
                .to_string(),
        );
    }
    Ok(cidrs)
}

/// `base` for `node`'s agent in kube mode against `api`: its etcd endpoint [`NO_ETCD`],
/// `--kube-subnet-mgr`, the API URL, `netconf` written as the node's
/// `net-conf.json`, and `NODE_NAME`.
pub fn agent_spec(
    node: &Node,
    api: &MockApiServer,
    netconf: &Value,
    base: &AgentSpec,
) -> Result<AgentSpec> {
    let conf = node.dir().join("net-conf.json");
    std::fs::write(&conf, netconf.to_string())?;
    let mut spec = base.clone();
    spec.etcd_endpoints = NO_ETCD.to_owned();
    spec.extra_args.extend([
        "--kube-subnet-mgr".into(),
        format!("--kube-api-url={}", api.url()),
        format!("--net-config-path={}", conf.display()),
    ]);
    spec.env.push(("NODE_NAME".into(), node.name()));
    Ok(spec)
}

/// Starts one agent per node in kube mode against `api` ([`agent_spec`]).
pub fn start_agents(
    topology: &Topology,
    api: &MockApiServer,
    netconf: &Value,
    base: &AgentSpec,
) -> Result<Vec<Agent>> {
    topology
        .nodes()
        .iter()
        .map(|node| Agent::start(node, &agent_spec(node, api, netconf, base)?))
        .collect()
}

/// The leases the agents published on the nodes' Node objects, in node order: the pod CIDRs
/// and the flannel annotations (upstream's names), keyed `Node <name>`. A node whose Node
/// carries no `public-ip` yet (its agent has not written it) is left out.
pub fn leases(api: &MockApiServer, topology: &Topology) -> Result<Vec<LeaseRecord>> {
    let mut leases = Vec::new();
    for node in topology.nodes() {
        let name = node.name();
        let Some(object) = api.node(&name) else {
            continue;
        };
        if let Some(lease) = lease_of(&name, &object)? {
            leases.push(lease);
        }
    }
    Ok(leases)
}

/// The lease a Node object carries (`None` without a `public-ip` annotation).
fn lease_of(name: &str, node: &Value) -> Result<Option<LeaseRecord>> {
    let annotation =
        |key: &str| node["metadata"]["annotations"][format!("{ANNOTATIONS}/{key}")].as_str();
    let Some(public_ip) = annotation("public-ip") else {
        return Ok(None);
    };
    let cidrs: Vec<&str> = node["spec"]["podCIDRs"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let subnet = cidrs
        .iter()
        .find_map(|c| c.parse::<Ipv4Net>().ok())
        .with_context(|| format!("Node {name}: no IPv4 pod CIDR in {cidrs:?}"))?;
    let backend_data = annotation("backend-data")
        .map(|text| {
            serde_json::from_str(text)
                .with_context(|| format!("Node {name}: backend-data {text:?}"))
        })
        .transpose()?;
    Ok(Some(LeaseRecord {
        key: format!("Node {name}"),
        subnet,
        subnet6: cidrs.iter().find_map(|c| c.parse::<Ipv6Net>().ok()),
        public_ip: Some(
            public_ip
                .parse()
                .with_context(|| format!("Node {name}: public-ip {public_ip:?}"))?,
        ),
        public_ipv6: annotation("public-ipv6").map(str::to_owned),
        backend_type: annotation("backend-type").map(str::to_owned),
        backend_data,
    }))
}

/// Two nodes on one L2 segment in kube mode (the fake API server in the hub, pod CIDRs
/// `10.244.<n>.0/24` in their Node objects), network 10.244.0.0/16, vxlan, agents on
/// `dataplane`: runs `body` on them, and prints the agents' logs when it fails.
pub fn with_vxlan_pair(
    dataplane: Dataplane,
    body: impl FnOnce(&mut Topology, &MockApiServer, &mut [Agent]) -> Result<()>,
) -> Result<()> {
    let (agent_bin, cni) = (bins::test_agent()?, bins::test_cni_plugin()?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut topology = Topology::new(TopologySpec::new(2, Underlay::L2).cni_plugin(cni))?;
    let api = api_in_hub(&rt, &topology, &|n| vec![format!("10.244.{n}.0/24")])?;
    let netconf = serde_json::json!({"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}});
    let mut spec = AgentSpec::new(&agent_bin, NO_ETCD);
    spec.dataplane = Some(dataplane);
    let mut agents = start_agents(&topology, &api, &netconf, &spec)?;
    let result = body(&mut topology, &api, &mut agents);
    if result.is_err() {
        for a in &agents {
            eprintln!(
                "--- {} ({}):\n{}",
                a.node(),
                a.log_path().display(),
                a.log_tail(40)
            );
        }
    }
    drop(agents);
    result
}
