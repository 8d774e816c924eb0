//! Simulated clusters built from network namespaces: nodes on an underlay, pods on the nodes.
//!
//! ```text
//!                         hub namespace ("switch" / "router")
//!        ┌──────────────────────────────────────────────────────────────┐
//!        │ br1 192.168.1.1/24        br3 192.168.3.1/24     ip_forward=1  │
//!        │  │ n1   │ n2                │ n3                               │
//!        └──┼──────┼───────────────────┼──────────────────────────────────┘
//!      eth0 │ eth0 │              eth0 │       (veth pairs, configurable MTU)
//!        node1   node2              node3     each: cni0 + pod namespaces
//! ```
//!
//! * [`Underlay::L2`]: every node on one segment (`br1`, 192.168.1.0/24), so nodes are
//!   L2-adjacent (what host-gw needs).
//! * [`Underlay::L3`]: node *i* alone on segment *i* (192.168.*i*.0/24); the hub routes, so
//!   every node-to-node path has a gateway.
//! * [`Underlay::Mixed`]: nodes 1 and 2 share segment 1, node *i* ≥ 3 is alone on segment *i*
//!   (DirectRouting: direct to the neighbour, overlay to the rest).
//!
//! Node *i* has `eth0` with 192.168.*s*.(10+*i*)/24 (and fd00:*s*::(10+*i*)/64 with IPv6),
//! a default route via the segment's hub address (.1), and forwarding on. The hub's first
//! address, 192.168.1.1, is where [`Topology::start_etcd`] puts etcd, reachable from every
//! node.
//!
//! Everything carries the run prefix and a per-topology tag (`<prefix>t<n>…`), so several
//! topologies coexist in one process. Dropping the [`Topology`] removes the pods (CNI DEL),
//! kills every process left in its namespaces, deletes the namespaces and the nodes' files
//! and bpffs pin directories. Nothing outside these namespaces is touched.

use std::{
    fmt, fs,
    io::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    process::Stdio,
    str::FromStr,
    sync::atomic::{AtomicUsize, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use ipnet::{Ipv4Net, Ipv6Net};
use serde_json::{Value, json};

use crate::{
    etcd::Etcd,
    lab::{
        bins::CNI_BIN_DIR,
        process::{Output, Process, ns_command},
    },
    netns::{self, NetNs},
};

/// Most nodes a topology can have (node addresses are 192.168.s.(10+i)).
pub const MAX_NODES: usize = 200;
/// Name of the CNI network (upstream's manifest uses `cbr0`).
pub const CNI_NETWORK: &str = "cbr0";

/// How the nodes' underlay is wired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Underlay {
    /// One L2 segment for all nodes.
    #[default]
    L2,
    /// One segment per node, routed by the hub.
    L3,
    /// Nodes 1 and 2 on one segment, every further node on its own.
    Mixed,
}

impl Underlay {
    /// The segment (1-based, also the third octet of its subnet) node `node` (1-based) is on.
    pub fn segment_of(self, node: usize) -> usize {
        match self {
            Underlay::L2 => 1,
            Underlay::L3 => node,
            Underlay::Mixed if node <= 2 => 1,
            Underlay::Mixed => node,
        }
    }
}

impl fmt::Display for Underlay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Underlay::L2 => "l2",
            Underlay::L3 => "l3",
            Underlay::Mixed => "mixed",
        })
    }
}

impl FromStr for Underlay {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "l2" => Ok(Underlay::L2),
            "l3" | "routed" => Ok(Underlay::L3),
            "mixed" => Ok(Underlay::Mixed),
            other => Err(format!(
                "unknown underlay {other:?} (expected l2, l3 or mixed)"
            )),
        }
    }
}

/// The underlay IPv4 address of node `node` on segment `segment`: 192.168.segment.(10+node).
pub fn node_addr(segment: usize, node: usize) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, octet(segment), octet(10 + node))
}

/// The hub's IPv4 address on `segment` (the nodes' default gateway): 192.168.segment.1.
pub fn gateway_addr(segment: usize) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, octet(segment), 1)
}

/// The underlay IPv6 address of node `node`: fd00:segment::(10+node).
pub fn node_addr6(segment: usize, node: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, hextet(segment), 0, 0, 0, 0, 0, hextet(10 + node))
}

/// The hub's IPv6 address on `segment`: fd00:segment::1.
pub fn gateway_addr6(segment: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, hextet(segment), 0, 0, 0, 0, 0, 1)
}

fn octet(n: usize) -> u8 {
    u8::try_from(n).unwrap_or(u8::MAX)
}

fn hextet(n: usize) -> u16 {
    u16::try_from(n).unwrap_or(u16::MAX)
}

/// What to build.
#[derive(Debug, Clone)]
pub struct TopologySpec {
    /// Number of nodes (1..=[`MAX_NODES`]).
    pub nodes: usize,
    /// Wiring of the underlay.
    pub underlay: Underlay,
    /// MTU of the underlay links (bridges, veths, the nodes' eth0).
    pub mtu: u32,
    /// Also give the underlay IPv6 addresses and routes.
    pub ipv6: bool,
    /// The `flannel` CNI plugin binary; needed by [`Topology::add_pod`].
    pub cni_plugin: Option<PathBuf>,
    /// `ipMasq` of the CNI `bridge` delegate; `None` leaves it to the flannel plugin, which
    /// (as upstream) masquerades in the bridge plugin unless subnet.env says the agent does.
    pub cni_ip_masq: Option<bool>,
}

impl TopologySpec {
    /// `nodes` nodes on `underlay`, MTU 1500, IPv4 only, no CNI plugin.
    pub fn new(nodes: usize, underlay: Underlay) -> Self {
        TopologySpec {
            nodes,
            underlay,
            mtu: 1500,
            ipv6: false,
            cni_plugin: None,
            cni_ip_masq: None,
        }
    }

    /// Sets the underlay MTU.
    pub fn mtu(mut self, mtu: u32) -> Self {
        self.mtu = mtu;
        self
    }

    /// Adds IPv6 underlay addresses.
    pub fn ipv6(mut self, on: bool) -> Self {
        self.ipv6 = on;
        self
    }

    /// Sets `ipMasq` of the CNI `bridge` delegate (see [`TopologySpec::cni_ip_masq`]).
    pub fn cni_ip_masq(mut self, on: bool) -> Self {
        self.cni_ip_masq = Some(on);
        self
    }

    /// Sets the CNI plugin used by [`Topology::add_pod`].
    pub fn cni_plugin(mut self, path: impl Into<PathBuf>) -> Self {
        self.cni_plugin = Some(path.into());
        self
    }
}

/// The contents of a `subnet.env` (upstream's format, see flannel-upstream.md §4).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubnetEnv {
    /// `FLANNEL_NETWORK`
    pub network: Option<Ipv4Net>,
    /// `FLANNEL_SUBNET`: the gateway address (subnet + 1) with the lease's prefix length.
    pub subnet: Option<Ipv4Net>,
    /// `FLANNEL_IPV6_NETWORK`
    pub ipv6_network: Option<Ipv6Net>,
    /// `FLANNEL_IPV6_SUBNET`
    pub ipv6_subnet: Option<Ipv6Net>,
    /// `FLANNEL_MTU`
    pub mtu: Option<u32>,
    /// `FLANNEL_IPMASQ`
    pub ipmasq: Option<bool>,
}

impl SubnetEnv {
    /// An IPv4 subnet.env for lease `lease` (a network address, e.g. 10.244.3.0/24).
    pub fn v4(network: Ipv4Net, lease: Ipv4Net, mtu: u32, ipmasq: bool) -> Self {
        let gateway = Ipv4Addr::from(u32::from(lease.network()).wrapping_add(1));
        SubnetEnv {
            network: Some(network),
            subnet: Ipv4Net::new(gateway, lease.prefix_len()).ok(),
            mtu: Some(mtu),
            ipmasq: Some(ipmasq),
            ..Default::default()
        }
    }

    /// Parses `KEY=value` lines; unknown keys are ignored, bad values are errors naming the
    /// key.
    pub fn parse(text: &str) -> Result<Self> {
        let mut env = SubnetEnv::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            let value = value.trim();
            let bad = || format!("{key}={value:?} in subnet.env");
            match key.trim() {
                "FLANNEL_NETWORK" => env.network = Some(value.parse().with_context(bad)?),
                "FLANNEL_SUBNET" => env.subnet = Some(value.parse().with_context(bad)?),
                "FLANNEL_IPV6_NETWORK" => {
                    env.ipv6_network = Some(value.parse().with_context(bad)?);
                }
                "FLANNEL_IPV6_SUBNET" => env.ipv6_subnet = Some(value.parse().with_context(bad)?),
                "FLANNEL_MTU" => env.mtu = Some(value.parse().with_context(bad)?),
                "FLANNEL_IPMASQ" => env.ipmasq = Some(value.parse().with_context(bad)?),
                _ => {}
            }
        }
        Ok(env)
    }

    /// The file's text, in upstream's key order.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Some(v) = self.network {
            out += &format!("FLANNEL_NETWORK={v}\n");
        }
        if let Some(v) = self.subnet {
            out += &format!("FLANNEL_SUBNET={v}\n");
        }
        if let Some(v) = self.ipv6_network {
            out += &format!("FLANNEL_IPV6_NETWORK={v}\n");
        }
        if let Some(v) = self.ipv6_subnet {
            out += &format!("FLANNEL_IPV6_SUBNET={v}\n");
        }
        if let Some(v) = self.mtu {
            out += &format!("FLANNEL_MTU={v}\n");
        }
        if let Some(v) = self.ipmasq {
            out += &format!("FLANNEL_IPMASQ={v}\n");
        }
        out
    }

    /// The node's pod subnet (`FLANNEL_SUBNET` masked to its network).
    pub fn lease(&self) -> Option<Ipv4Net> {
        self.subnet.map(|s| s.trunc())
    }
}

/// What `ip route get` answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteGet {
    /// The next hop, `None` when the destination is directly connected.
    pub gateway: Option<IpAddr>,
    /// The output device.
    pub dev: Option<String>,
    /// The preferred source address.
    pub prefsrc: Option<IpAddr>,
}

/// One simulated node: a namespace with `eth0` on the underlay, a directory for the agent's
/// files, and a bpffs pin path of its own.
#[derive(Debug)]
pub struct Node {
    index: usize,
    segment: usize,
    ns: NetNs,
    addr: Ipv4Addr,
    addr6: Option<Ipv6Addr>,
    dir: tempfile::TempDir,
    bpf_pin_path: PathBuf,
    pods_created: usize,
}

impl Node {
    /// 1-based node number.
    pub fn index(&self) -> usize {
        self.index
    }

    /// `node<index>`.
    pub fn name(&self) -> String {
        format!("node{}", self.index)
    }

    /// The underlay segment (1-based) this node is on.
    pub fn segment(&self) -> usize {
        self.segment
    }

    /// The node's network namespace.
    pub fn ns(&self) -> &NetNs {
        &self.ns
    }

    /// Underlay IPv4 address of `eth0` (the node's public IP).
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// Underlay IPv4 address with its /24.
    pub fn addr_net(&self) -> Ipv4Net {
        Ipv4Net::new(self.addr, 24).unwrap_or_default()
    }

    /// Underlay IPv6 address of `eth0`, if the topology has IPv6.
    pub fn addr6(&self) -> Option<Ipv6Addr> {
        self.addr6
    }

    /// The hub's address on this node's segment (its default gateway).
    pub fn gateway(&self) -> Ipv4Addr {
        gateway_addr(self.segment)
    }

    /// The node's private directory (deleted with the topology).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `--subnet-file` for this node's agent (and `subnetFile` for its CNI plugin).
    pub fn subnet_file(&self) -> PathBuf {
        self.dir().join("subnet.env")
    }

    /// `--state-dir` for this node's agent.
    pub fn state_dir(&self) -> PathBuf {
        self.dir().join("state")
    }

    /// The CNI plugin's `dataDir` (stored delegate configs).
    pub fn cni_data_dir(&self) -> PathBuf {
        self.dir().join("cni")
    }

    /// host-local's `dataDir` (address allocations).
    pub fn ipam_data_dir(&self) -> PathBuf {
        self.dir().join("ipam")
    }

    /// Where this node's agent logs.
    pub fn agent_log(&self) -> PathBuf {
        self.dir().join("agent.log")
    }

    /// `--bpf-pin-path` for this node's agent: `/sys/fs/bpf/<run prefix>-t<n>n<i>`. Not
    /// created here (the agent does); removed when the topology is dropped.
    pub fn bpf_pin_path(&self) -> &Path {
        &self.bpf_pin_path
    }

    /// Runs `argv` in the node; fails with stderr on a non-zero exit.
    pub fn run(&self, argv: &[&str]) -> Result<String> {
        self.ns.run(argv)
    }

    /// Adds a DNAT of TCP to `from` on to `to` in the node's nat PREROUTING (`iptables` or
    /// `ip6tables` by family), as kube-proxy does for a Service's ClusterIP or a hostPort for
    /// the node's addresses.
    pub fn dnat_tcp(&self, from: std::net::SocketAddr, to: std::net::SocketAddr) -> Result<()> {
        self.dnat("tcp", from, to)
    }

    /// [`Node::dnat_tcp`] for UDP (a DNS Service).
    pub fn dnat_udp(&self, from: std::net::SocketAddr, to: std::net::SocketAddr) -> Result<()> {
        self.dnat("udp", from, to)
    }

    fn dnat(
        &self,
        proto: &str,
        from: std::net::SocketAddr,
        to: std::net::SocketAddr,
    ) -> Result<()> {
        let tool = if from.is_ipv4() {
            "iptables"
        } else {
            "ip6tables"
        };
        self.run(&[
            tool,
            "-w",
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-d",
            &from.ip().to_string(),
            "-p",
            proto,
            "--dport",
            &from.port().to_string(),
            "-j",
            "DNAT",
            "--to-destination",
            &to.to_string(),
        ])?;
        Ok(())
    }

    /// Creates the VXLAN device `name` as upstream flanneld creates `flannel.<VNI>`: VNI
    /// `vni`, local address the node's `eth0` address, on `eth0`, UDP port `port`, no
    /// learning; MTU `mtu`, up.
    pub fn add_vxlan(&self, name: &str, vni: u32, port: u16, mtu: u32) -> Result<()> {
        let (vni, port, mtu, local) = (
            vni.to_string(),
            port.to_string(),
            mtu.to_string(),
            self.addr().to_string(),
        );
        self.run(&[
            "ip",
            "link",
            "add",
            name,
            "type",
            "vxlan",
            "id",
            &vni,
            "local",
            &local,
            "dev",
            "eth0",
            "dstport",
            &port,
            "nolearning",
        ])?;
        self.run(&["ip", "link", "set", name, "mtu", &mtu, "up"])?;
        Ok(())
    }

    /// Starts `argv` in the node as a guarded process.
    pub fn spawn(&self, argv: &[&str], output: Output) -> Result<Process> {
        Process::spawn(&self.ns, argv, output)
    }

    /// Sets a sysctl inside the node (`net.*` keys are per namespace).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        sysctl(&self.ns, key, value)
    }

    /// Reads the node's subnet.env, `None` if it does not exist yet.
    pub fn read_subnet_env(&self) -> Result<Option<SubnetEnv>> {
        match fs::read_to_string(self.subnet_file()) {
            Ok(text) => SubnetEnv::parse(&text).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).context("reading subnet.env"),
        }
    }

    /// Writes the node's subnet.env by hand (what the agent would do).
    pub fn write_subnet_env(&self, env: &SubnetEnv) -> Result<()> {
        fs::write(self.subnet_file(), env.render()).context("writing subnet.env")
    }

    /// Waits until the node's subnet.env exists and has a `FLANNEL_SUBNET` (or, on an
    /// IPv6-only node, a `FLANNEL_IPV6_SUBNET`). `check` runs on each poll and aborts the
    /// wait with its error (e.g. "the agent exited").
    pub fn wait_subnet_env(
        &self,
        timeout: Duration,
        mut check: impl FnMut() -> Result<()>,
    ) -> Result<SubnetEnv> {
        let deadline = Instant::now() + timeout;
        loop {
            // A half-written file (no atomic rename) parses as incomplete or fails: retry.
            if let Ok(Some(env)) = self.read_subnet_env()
                && (env.subnet.is_some() || env.ipv6_subnet.is_some())
                && env.mtu.is_some()
            {
                return Ok(env);
            }
            check()?;
            if Instant::now() >= deadline {
                bail!(
                    "{} has no subnet.env ({}) after {timeout:?}",
                    self.name(),
                    self.subnet_file().display()
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// `ip route get <dst>` in the node.
    pub fn route_get(&self, dst: IpAddr) -> Result<RouteGet> {
        let out = self.run(&["ip", "-j", "route", "get", &dst.to_string()])?;
        let routes: Value = serde_json::from_str(&out).context("ip -j route get output")?;
        let route = routes
            .get(0)
            .with_context(|| format!("no route to {dst}: {out}"))?;
        let ip = |key: &str| route[key].as_str().and_then(|s| s.parse().ok());
        Ok(RouteGet {
            gateway: ip("gateway"),
            dev: route["dev"].as_str().map(str::to_owned),
            prefsrc: ip("prefsrc"),
        })
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.bpf_pin_path.exists() {
            let _ = fs::remove_dir_all(&self.bpf_pin_path);
        }
    }
}

/// How a pod's networking is removed.
#[derive(Debug)]
enum Teardown {
    /// CNI DEL through the plugin, run in the node.
    Cni {
        plugin: PathBuf,
        node_ns: PathBuf,
        container_id: String,
        config: Value,
    },
    /// A hand-made veth: goes away with the pod's namespace.
    Plain,
}

/// A pod: a namespace with `eth0` on its node's `cni0` bridge.
#[derive(Debug)]
pub struct Pod {
    name: String,
    node: usize,
    ip: Ipv4Addr,
    prefix_len: u8,
    gateway: Ipv4Addr,
    ip6: Option<Ipv6Addr>,
    teardown: Teardown,
    // Last: the namespace is deleted after the CNI DEL in `drop`.
    ns: NetNs,
}

impl Pod {
    /// `n<node>p<k>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node (1-based) the pod runs on.
    pub fn node(&self) -> usize {
        self.node
    }

    /// The pod's namespace.
    pub fn ns(&self) -> &NetNs {
        &self.ns
    }

    /// The pod's IPv4 address (`0.0.0.0` for a pod of an IPv6-only network).
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The pod's IPv4 address with its prefix length.
    pub fn ip_net(&self) -> Ipv4Net {
        Ipv4Net::new(self.ip, self.prefix_len).unwrap_or_default()
    }

    /// The pod's gateway (its node's `cni0` address).
    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }

    /// The pod's IPv6 address, if it has one.
    pub fn ip6(&self) -> Option<Ipv6Addr> {
        self.ip6
    }

    /// The pod's IPv6 address, or an error naming the pod.
    pub fn ip6_required(&self) -> Result<Ipv6Addr> {
        self.ip6
            .with_context(|| format!("pod {} has no IPv6 address", self.name))
    }

    /// The CNI container id, `None` for hand-made pods.
    pub fn container_id(&self) -> Option<&str> {
        match &self.teardown {
            Teardown::Cni { container_id, .. } => Some(container_id),
            Teardown::Plain => None,
        }
    }

    /// Runs `argv` in the pod; fails with stderr on a non-zero exit.
    pub fn run(&self, argv: &[&str]) -> Result<String> {
        self.ns.run(argv)
    }

    /// Starts `argv` in the pod as a guarded process.
    pub fn spawn(&self, argv: &[&str], output: Output) -> Result<Process> {
        Process::spawn(&self.ns, argv, output)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if let Teardown::Cni {
            plugin,
            node_ns,
            container_id,
            config,
        } = &self.teardown
        {
            let _ = cni_call(
                plugin,
                node_ns,
                "DEL",
                container_id,
                Some(&self.ns.path()),
                config,
            );
        }
    }
}

static NEXT_TAG: AtomicUsize = AtomicUsize::new(1);

/// A simulated cluster's network: hub, nodes and pods. Dropping it removes everything.
#[derive(Debug)]
pub struct Topology {
    // Drop order matters: pods (CNI DEL in their node), then nodes, then the hub.
    pods: Vec<Pod>,
    nodes: Vec<Node>,
    hub: NetNs,
    spec: TopologySpec,
    tag: String,
}

impl Topology {
    /// Builds the hub, the segments and the nodes. On error everything built so far is
    /// removed again.
    pub fn new(spec: TopologySpec) -> Result<Topology> {
        if spec.nodes == 0 || spec.nodes > MAX_NODES {
            bail!("nodes must be 1..={MAX_NODES}, got {}", spec.nodes);
        }
        if !(576..=65535).contains(&spec.mtu) {
            bail!("underlay MTU must be 576..=65535, got {}", spec.mtu);
        }
        sweep_stale_pin_paths();
        let tag = format!("t{}", NEXT_TAG.fetch_add(1, Ordering::Relaxed));
        let hub = NetNs::new(&format!("{tag}hub"))?;
        let mut topo = Topology {
            pods: Vec::new(),
            nodes: Vec::new(),
            hub,
            spec,
            tag,
        };
        topo.build_hub()?;
        for index in 1..=topo.spec.nodes {
            let node = topo.build_node(index)?;
            topo.nodes.push(node);
        }
        Ok(topo)
    }

    fn segments(&self) -> Vec<usize> {
        let mut segs: Vec<usize> = (1..=self.spec.nodes)
            .map(|n| self.spec.underlay.segment_of(n))
            .collect();
        segs.dedup();
        segs
    }

    fn build_hub(&self) -> Result<()> {
        let hub = &self.hub;
        sysctl(hub, "net.ipv4.ip_forward", "1")?;
        if self.spec.ipv6 {
            sysctl(hub, "net.ipv6.conf.all.forwarding", "1")?;
        }
        let mtu = self.spec.mtu.to_string();
        for seg in self.segments() {
            let br = format!("br{seg}");
            hub.run(&["ip", "link", "add", &br, "mtu", &mtu, "type", "bridge"])?;
            hub.run(&["ip", "link", "set", &br, "up"])?;
            let gw = format!("{}/24", gateway_addr(seg));
            hub.run(&["ip", "addr", "add", &gw, "dev", &br])?;
            if self.spec.ipv6 {
                let gw6 = format!("{}/64", gateway_addr6(seg));
                hub.run(&["ip", "-6", "addr", "add", &gw6, "dev", &br, "nodad"])?;
            }
        }
        Ok(())
    }

    fn build_node(&self, index: usize) -> Result<Node> {
        let segment = self.spec.underlay.segment_of(index);
        let suffix = format!("{}n{index}", self.tag);
        let ns = NetNs::new(&suffix)?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("flannel-lab-{}", ns.name()))
            .tempdir()
            .context("node directory")?;
        let node = Node {
            index,
            segment,
            addr: node_addr(segment, index),
            addr6: self.spec.ipv6.then(|| node_addr6(segment, index)),
            bpf_pin_path: PathBuf::from("/sys/fs/bpf").join(format!(
                "{}-{}",
                netns::run_prefix(),
                &suffix
            )),
            dir,
            ns,
            pods_created: 0,
        };
        // Before the uplink: a re-created one inherits them (the `default` settings).
        node.sysctl("net.ipv4.ip_forward", "1")?;
        if node.addr6.is_some() {
            node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        }
        self.wire_uplink(&node)?;
        fs::create_dir_all(node.state_dir())?;
        Ok(node)
    }

    /// Connects `node` to its segment: a veth pair, `n<index>` on the hub's bridge and `eth0`
    /// in the node, with the node's addresses and default routes.
    fn wire_uplink(&self, node: &Node) -> Result<()> {
        let port = format!("n{}", node.index);
        let mtu = self.spec.mtu.to_string();
        netns::veth(&self.hub, &port, &node.ns, "eth0")?;
        self.hub.run(&["ip", "link", "set", &port, "mtu", &mtu])?;
        self.hub.run(&[
            "ip",
            "link",
            "set",
            &port,
            "master",
            &format!("br{}", node.segment),
        ])?;
        node.run(&["ip", "link", "set", "eth0", "mtu", &mtu])?;
        node.run(&[
            "ip",
            "addr",
            "add",
            &node.addr_net().to_string(),
            "dev",
            "eth0",
        ])?;
        node.run(&[
            "ip",
            "route",
            "add",
            "default",
            "via",
            &gateway_addr(node.segment).to_string(),
        ])?;
        if let Some(addr6) = node.addr6 {
            node.run(&[
                "ip",
                "-6",
                "addr",
                "add",
                &format!("{addr6}/64"),
                "dev",
                "eth0",
                "nodad",
            ])?;
            node.run(&[
                "ip",
                "-6",
                "route",
                "add",
                "default",
                "via",
                &gateway_addr6(node.segment).to_string(),
            ])?;
        }
        Ok(())
    }

    /// Deletes node `n`'s `eth0` and wires a new one in its place (same name, addresses and
    /// routes, a new interface index), as a network manager re-creating an interface does.
    pub fn recreate_uplink(&self, n: usize) -> Result<()> {
        let node = self.node(n);
        node.run(&["ip", "link", "del", "eth0"])?;
        self.wire_uplink(node)
    }

    /// The spec it was built from.
    pub fn spec(&self) -> &TopologySpec {
        &self.spec
    }

    /// `t<n>`: distinguishes this topology's names from other topologies of the process.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The hub namespace (switch and router; etcd runs here).
    pub fn hub(&self) -> &NetNs {
        &self.hub
    }

    /// The hub's address on segment 1 (192.168.1.1), reachable from every node.
    pub fn hub_addr(&self) -> Ipv4Addr {
        gateway_addr(1)
    }

    /// All nodes, in order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Node number `n` (1-based). Panics if there is no such node.
    pub fn node(&self, n: usize) -> &Node {
        match n.checked_sub(1).and_then(|i| self.nodes.get(i)) {
            Some(node) => node,
            None => panic!("no node {n} (topology has {})", self.nodes.len()),
        }
    }

    /// All pods, in creation order.
    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    /// The pods on node `n`.
    pub fn pods_on(&self, n: usize) -> Vec<&Pod> {
        self.pods.iter().filter(|p| p.node == n).collect()
    }

    /// The first pod on node `n`, or an error naming the node.
    pub fn first_pod_on(&self, n: usize) -> Result<&Pod> {
        self.pods
            .iter()
            .find(|p| p.node == n)
            .with_context(|| format!("no pod on node{n}"))
    }

    /// The pod named `name` (`n<node>p<k>`).
    pub fn pod(&self, name: &str) -> Option<&Pod> {
        self.pods.iter().find(|p| p.name == name)
    }

    /// Names of every namespace of this topology (hub, nodes, pods).
    pub fn namespace_names(&self) -> Vec<String> {
        std::iter::once(self.hub.name().to_owned())
            .chain(self.nodes.iter().map(|n| n.ns.name().to_owned()))
            .chain(self.pods.iter().map(|p| p.ns.name().to_owned()))
            .collect()
    }

    /// Starts etcd in the hub, listening on [`Topology::hub_addr`], so agents in every node
    /// reach it. Its endpoint is `etcd.endpoint()`; to stop/resume it for outage tests, call
    /// `resume` inside `topology.hub().enter(..)` (the health check runs in the hub).
    pub fn start_etcd(&self) -> Result<Etcd> {
        let bind = self.hub_addr().to_string();
        self.hub.enter(move || Etcd::start_on(&bind))?
    }

    /// Whether node `b`'s underlay address is directly connected from node `a` (no gateway
    /// in `ip route get`), i.e. whether host-gw / DirectRouting could use it.
    pub fn l2_adjacent(&self, a: usize, b: usize) -> Result<bool> {
        let route = self.node(a).route_get(IpAddr::V4(self.node(b).addr))?;
        Ok(route.gateway.is_none())
    }

    /// Creates a pod on node `n` the way kubelet does: CNI ADD of the `flannel` plugin
    /// (delegating to `bridge` with `isDefaultGateway` and `hairpinMode`, as in upstream's
    /// manifest) in the node, with the pod's namespace as `CNI_NETNS`. Needs the node's
    /// subnet.env (written by the agent or by hand) and [`TopologySpec::cni_plugin`].
    pub fn add_pod(&mut self, n: usize) -> Result<&Pod> {
        let plugin = self
            .spec
            .cni_plugin
            .clone()
            .context("no CNI plugin configured (TopologySpec::cni_plugin)")?;
        let cni_ip_masq = self.spec.cni_ip_masq;
        let (name, node_ns, config) = {
            let node = self.node_mut(n)?;
            node.pods_created += 1;
            let name = format!("n{n}p{}", node.pods_created);
            let mut config = json!({
                "cniVersion": "1.0.0",
                "name": CNI_NETWORK,
                "type": "flannel",
                "subnetFile": node.subnet_file(),
                "dataDir": node.cni_data_dir(),
                "delegate": {"hairpinMode": true, "isDefaultGateway": true},
                "ipam": {"dataDir": node.ipam_data_dir()},
            });
            if let Some(masq) = cni_ip_masq {
                config["delegate"]["ipMasq"] = json!(masq);
            }
            (name, node.ns.path(), config)
        };
        let pod_ns = NetNs::new(&format!("{}{name}", self.tag))?;
        let container_id = pod_ns.name().to_owned();
        let result = cni_call(
            &plugin,
            &node_ns,
            "ADD",
            &container_id,
            Some(&pod_ns.path()),
            &config,
        )
        .with_context(|| format!("CNI ADD of pod {name} on node{n}"))?;
        let mut pod = Pod {
            name,
            node: n,
            ip: Ipv4Addr::UNSPECIFIED,
            prefix_len: 0,
            gateway: Ipv4Addr::UNSPECIFIED,
            ip6: None,
            // From here on a failure still runs CNI DEL (Pod's drop).
            teardown: Teardown::Cni {
                plugin,
                node_ns,
                container_id,
                config,
            },
            ns: pod_ns,
        };
        for ip in result["ips"].as_array().into_iter().flatten() {
            let address = ip["address"].as_str().unwrap_or_default();
            if let Ok(net) = address.parse::<Ipv4Net>() {
                pod.ip = net.addr();
                pod.prefix_len = net.prefix_len();
                pod.gateway = ip["gateway"]
                    .as_str()
                    .and_then(|g| g.parse().ok())
                    .unwrap_or(Ipv4Addr::UNSPECIFIED);
            } else if let Ok(net) = address.parse::<Ipv6Net>() {
                pod.ip6 = Some(net.addr());
            }
        }
        if pod.ip.is_unspecified() && pod.ip6.is_none() {
            bail!(
                "CNI ADD of pod {} returned no IP address: {result}",
                pod.name
            );
        }
        self.pods.push(pod);
        self.pods.last().context("pod just added")
    }

    /// Creates a pod on node `n` by hand, without CNI: a `cni0` bridge in the node (created
    /// with `gateway`/prefix if missing), a veth to the pod, `addr` on the pod's `eth0` and a
    /// default route via `gateway`. For kernel reference setups that need no agent.
    pub fn add_plain_pod(
        &mut self,
        n: usize,
        addr: Ipv4Net,
        gateway: Ipv4Addr,
        mtu: u32,
    ) -> Result<&Pod> {
        let (name, host_veth) = {
            let node = self.node_mut(n)?;
            node.pods_created += 1;
            (
                format!("n{n}p{}", node.pods_created),
                format!("vp{}", node.pods_created),
            )
        };
        let node = self.node(n);
        let mtu = mtu.to_string();
        if node.run(&["ip", "link", "show", "cni0"]).is_err() {
            node.run(&["ip", "link", "add", "cni0", "mtu", &mtu, "type", "bridge"])?;
            let gw = Ipv4Net::new(gateway, addr.prefix_len())?;
            node.run(&["ip", "addr", "add", &gw.to_string(), "dev", "cni0"])?;
            node.run(&["ip", "link", "set", "cni0", "up"])?;
        }
        let pod_ns = NetNs::new(&format!("{}{name}", self.tag))?;
        netns::veth(&node.ns, &host_veth, &pod_ns, "eth0")?;
        node.run(&[
            "ip", "link", "set", &host_veth, "mtu", &mtu, "master", "cni0",
        ])?;
        pod_ns.run(&["ip", "link", "set", "eth0", "mtu", &mtu])?;
        pod_ns.run(&["ip", "addr", "add", &addr.to_string(), "dev", "eth0"])?;
        pod_ns.run(&["ip", "route", "add", "default", "via", &gateway.to_string()])?;
        self.pods.push(Pod {
            name,
            node: n,
            ip: addr.addr(),
            prefix_len: addr.prefix_len(),
            gateway,
            ip6: None,
            teardown: Teardown::Plain,
            ns: pod_ns,
        });
        self.pods.last().context("pod just added")
    }

    /// Removes a pod (CNI DEL for CNI pods, then its namespace).
    pub fn remove_pod(&mut self, name: &str) -> Result<()> {
        let pos = self
            .pods
            .iter()
            .position(|p| p.name == name)
            .with_context(|| format!("no pod {name}"))?;
        let pod = self.pods.remove(pos);
        if let Teardown::Cni {
            plugin,
            node_ns,
            container_id,
            config,
        } = &pod.teardown
        {
            cni_call(
                plugin,
                node_ns,
                "DEL",
                container_id,
                Some(&pod.ns.path()),
                config,
            )
            .with_context(|| format!("CNI DEL of pod {name}"))?;
        }
        Ok(())
    }

    fn node_mut(&mut self, n: usize) -> Result<&mut Node> {
        let count = self.nodes.len();
        n.checked_sub(1)
            .and_then(|i| self.nodes.get_mut(i))
            .with_context(|| format!("no node {n} (topology has {count})"))
    }
}

/// Sets a sysctl inside `ns`.
pub fn sysctl(ns: &NetNs, key: &str, value: &str) -> Result<()> {
    ns.run(&["sysctl", "-qw", &format!("{key}={value}")])
        .map(|_| ())
}

/// Runs the CNI plugin `plugin` in the node namespace `node_ns` (where `cni0` lives) and
/// returns its JSON result (`Null` when it prints nothing, as DEL does).
pub fn cni_call(
    plugin: &Path,
    node_ns: &Path,
    command: &str,
    container_id: &str,
    pod_ns: Option<&Path>,
    config: &Value,
) -> Result<Value> {
    let mut cmd = ns_command(node_ns, plugin);
    cmd.env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", CNI_BIN_DIR)
        .env(
            "CNI_ARGS",
            format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={container_id}"),
        )
        .env(
            "CNI_NETNS",
            pod_ns.map_or_else(|| PathBuf::from("/nonexistent"), Path::to_path_buf),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("running {}", plugin.display()))?;
    child
        .stdin
        .take()
        .context("plugin stdin")?
        .write_all(config.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{} {command} failed ({}): {} {}",
            plugin.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    if out.stdout.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&out.stdout).context("CNI result is not JSON")
}

/// Removes bpffs pin directories of this kit's runs whose process is gone
/// (`/sys/fs/bpf/fl<pid base36>x-…`).
fn sweep_stale_pin_paths() {
    let Ok(dir) = fs::read_dir("/sys/fs/bpf") else {
        return;
    };
    for entry in dir.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(pid) = prefix_pid(&name)
            && pid != std::process::id()
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// The pid encoded in a `fl<pid base36>x-…` name.
fn prefix_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("fl")?;
    let (digits, tail) = rest.split_once("x-")?;
    if digits.is_empty()
        || tail.is_empty()
        || !digits
            .bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
    {
        return None;
    }
    u32::from_str_radix(digits, 36).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_and_addresses() {
        assert_eq!(
            (1..=4)
                .map(|n| Underlay::Mixed.segment_of(n))
                .collect::<Vec<_>>(),
            [1, 1, 3, 4]
        );
        assert_eq!(Underlay::L2.segment_of(7), 1);
        assert_eq!(Underlay::L3.segment_of(7), 7);
        assert_eq!(node_addr(3, 3), Ipv4Addr::new(192, 168, 3, 13));
        assert_eq!(gateway_addr(2), Ipv4Addr::new(192, 168, 2, 1));
        assert_eq!(node_addr6(1, 2).to_string(), "fd00:1::c");
        assert_eq!("routed".parse::<Underlay>(), Ok(Underlay::L3));
        assert!("l4".parse::<Underlay>().is_err());
    }

    #[test]
    fn subnet_env_round_trips_upstream_format() {
        let text = "FLANNEL_NETWORK=10.42.0.0/16\nFLANNEL_SUBNET=10.42.0.1/24\n\
                    FLANNEL_IPV6_NETWORK=2001:cafe:42::/56\nFLANNEL_IPV6_SUBNET=2001:cafe:42::1/64\n\
                    FLANNEL_MTU=1450\nFLANNEL_IPMASQ=true\n";
        let env = SubnetEnv::parse(text).expect("parse");
        assert_eq!(env.render(), text);
        assert_eq!(env.lease(), Some("10.42.0.0/24".parse().expect("cidr")));
        let built = SubnetEnv::v4(
            "10.244.0.0/16".parse().expect("cidr"),
            "10.244.7.0/24".parse().expect("cidr"),
            1500,
            false,
        );
        assert_eq!(
            built.render(),
            "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.7.1/24\nFLANNEL_MTU=1500\nFLANNEL_IPMASQ=false\n"
        );
        let err = SubnetEnv::parse("FLANNEL_MTU=big\n").expect_err("bad mtu");
        assert!(
            format!("{err:#}").contains("FLANNEL_MTU=\"big\""),
            "{err:#}"
        );
    }

    #[test]
    fn stale_pin_path_names() {
        assert_eq!(prefix_pid("flzx-t1n1"), Some(35));
        assert_eq!(prefix_pid("flannel"), None);
        assert_eq!(prefix_pid("fl1x-"), None);
        assert_eq!(prefix_pid("cilium"), None);
    }
}
