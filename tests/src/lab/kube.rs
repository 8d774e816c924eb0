//! Kube mode in the lab: the fake API server ([`MockApiServer`]) in the hub, where every node
//! reaches it, and one agent per node taking its lease from it (`--kube-subnet-mgr`).

use std::net::TcpListener;

use anyhow::Result;
use serde_json::Value;
use tokio::runtime::Runtime;

use super::{
    agent::{Agent, AgentSpec, Dataplane},
    bins,
};
use crate::{
    kube_mock::{self, MockApiServer},
    topology::{Topology, TopologySpec, Underlay},
};

/// The etcd endpoint of an agent in kube mode: nothing listens there.
pub const NO_ETCD: &str = "http://127.0.0.1:1";

/// Starts the fake API server in the hub on `rt` with one Node object per node, whose pod
/// CIDR is `pod_cidr(node index)`.
pub fn api_in_hub(
    rt: &Runtime,
    topology: &Topology,
    pod_cidr: &dyn Fn(usize) -> String,
) -> Result<MockApiServer> {
    let hub = topology.hub_addr();
    let listener = topology
        .hub()
        .enter(move || TcpListener::bind((hub, 0)))??;
    let api = rt.block_on(MockApiServer::serve(listener))?;
    for node in topology.nodes() {
        let cidr = pod_cidr(node.index());
        api.apply_node(kube_mock::node(&node.name(), &[cidr.as_str()], &[]));
    }
    Ok(api)
}

/// Starts one agent per node in kube mode against `api`: `base` (built with [`NO_ETCD`] as
/// its etcd endpoint) with `--kube-subnet-mgr`, the API URL, `netconf` written as the node's
/// `net-conf.json`, and `NODE_NAME`.
pub fn start_agents(
    topology: &Topology,
    api: &MockApiServer,
    netconf: &Value,
    base: &AgentSpec,
) -> Result<Vec<Agent>> {
    let mut agents = Vec::new();
    for node in topology.nodes() {
        let conf = node.dir().join("net-conf.json");
        std::fs::write(&conf, netconf.to_string())?;
        let mut spec = base.clone();
        spec.extra_args.extend([
            "--kube-subnet-mgr".into(),
            format!("--kube-api-url={}", api.url()),
            format!("--net-config-path={}", conf.display()),
        ]);
        spec.env.push(("NODE_NAME".into(), node.name()));
        agents.push(Agent::start(node, &spec)?);
    }
    Ok(agents)
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
    let api = api_in_hub(&rt, &topology, &|n| format!("10.244.{n}.0/24"))?;
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
