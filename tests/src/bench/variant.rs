//! Benchmark variants: a named setup that yields a client namespace and a server address.
//!
//! A [`Variant`] is a topology spec plus a setup function that turns the built topology into
//! a [`Testbed`]. Adding one (e.g. an agent-driven eBPF path) is a new entry in [`all`].
//!
//! | name | path measured |
//! |---|---|
//! | `underlay` | node1 eth0 → hub bridge → node2 eth0 (the baseline) |
//! | `pod-same-node` | pod → cni0 → pod on one node, pods made by the flannel CNI plugin |
//! | `ref-hostgw` | pod → cni0 → node1 → static route via node2 → cni0 → pod (by hand) |
//! | `ref-vxlan` | the same through hand-made `flannel.1` VXLAN devices with static FDB/neighbour/routes |
//! | `floor-ebpf-host-gw`, `floor-ebpf-vxlan` | `ref-hostgw`'s / `ref-vxlan`'s pods forwarded by a minimal TC program ([`super::floor`]), the nodes forwarding nothing: the least any eBPF host-gw / VXLAN costs on this path |
//! | `agent-host-gw`, `agent-vxlan` | pods on two nodes of a cluster run by flannel-agent, kernel dataplane |
//! | `agent-udp` | the same with the udp backend's TUN path (`flannel0`, user-space forwarder) |
//! | `agent-host-gw-bare`, `agent-vxlan-bare` | the same without netfilter rules (`--iptables-forward-rules=false`, CNI `ipMasq: false`): only what the agent programs, comparable with `ref-*` |
//! | `agent-ebpf-host-gw`, `agent-ebpf-vxlan` | the same with `--dataplane=ebpf` |
//! | `agent-ebpf-udp` | the udp backend with `--dataplane=ebpf`: encapsulation in TC, `flannel0` for the rest |
//! | `underlay-v6` | `underlay` between the nodes' IPv6 addresses (the IPv6 baseline) |
//! | `agent-host-gw-v6`, `agent-vxlan-v6` | `agent-host-gw`, `agent-vxlan` in a dual-stack cluster ([`cluster_network_v6`]), pod IPv6 to pod IPv6 |
//! | `agent-ebpf-host-gw-v6`, `agent-ebpf-vxlan-v6` | the same with `--dataplane=ebpf` |
//!
//! Request/response latency to an IPv6 server address is measured by `flannel-lab rr`
//! ([`super::rr`]) instead of sockperf ([`super::measure::RrTool`]).

use std::{net::IpAddr, path::PathBuf};

use anyhow::{Context as _, Result, bail};
use ipnet::{Ipv4Net, Ipv6Net};
use std::net::{Ipv4Addr, Ipv6Addr};

use crate::{
    lab::{
        agent::Dataplane,
        cluster::{Cluster, ClusterSpec},
        process::Process,
    },
    netns::NetNs,
    topology::{SubnetEnv, Topology, TopologySpec, Underlay},
};

/// Inputs some setups need.
#[derive(Debug, Clone, Default)]
pub struct SetupCtx {
    /// The `flannel` CNI plugin (for variants with CNI pods).
    pub cni_plugin: Option<PathBuf>,
    /// `flannel-agent` (for agent-driven variants).
    pub agent: Option<PathBuf>,
}

/// A namespace of a testbed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// Node `n` (1-based).
    Node(usize),
    /// The pod with this name.
    Pod(String),
}

/// What keeps a testbed's namespaces alive.
#[derive(Debug)]
pub enum Owner {
    /// A bare topology.
    Topology(Topology),
    /// A cluster with etcd and agents.
    Cluster(Box<Cluster>),
}

/// A prepared variant: where the client runs and what it talks to.
#[derive(Debug)]
pub struct Testbed {
    // Servers go before the namespaces they run in, and so do programs attached in them.
    guards: Vec<Process>,
    programs: Vec<aya::Ebpf>,
    owner: Owner,
    /// Where clients run.
    pub client: Place,
    /// Where servers run.
    pub server: Place,
    /// The address clients connect to.
    pub server_ip: IpAddr,
}

impl Testbed {
    /// A testbed owning `owner`.
    pub fn new(owner: Owner, client: Place, server: Place, server_ip: IpAddr) -> Self {
        Testbed {
            guards: Vec::new(),
            programs: Vec::new(),
            owner,
            client,
            server,
            server_ip,
        }
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        match &self.owner {
            Owner::Topology(t) => t,
            Owner::Cluster(c) => c.topology(),
        }
    }

    /// The namespace of `place`.
    pub fn ns(&self, place: &Place) -> Result<&NetNs> {
        let topo = self.topology();
        match place {
            Place::Node(n) => topo
                .nodes()
                .get(n.wrapping_sub(1))
                .map(|node| node.ns())
                .with_context(|| format!("no node {n}")),
            Place::Pod(name) => topo
                .pod(name)
                .map(|p| p.ns())
                .with_context(|| format!("no pod {name}")),
        }
    }

    /// The namespaces of the nodes whose agents run the eBPF fast path (none for the
    /// variants without agents or on the kernel path).
    pub fn fast_path_nodes(&self) -> Vec<&NetNs> {
        let Owner::Cluster(cluster) = &self.owner else {
            return Vec::new();
        };
        let spec = cluster.spec();
        cluster
            .topology()
            .nodes()
            .iter()
            .enumerate()
            .filter(|(i, _)| {
                spec.node_dataplanes
                    .get(*i)
                    .copied()
                    .unwrap_or(spec.dataplane)
                    == Dataplane::Ebpf
            })
            .map(|(_, node)| node.ns())
            .collect()
    }

    /// The client's namespace.
    pub fn client_ns(&self) -> Result<&NetNs> {
        self.ns(&self.client)
    }

    /// The server's namespace.
    pub fn server_ns(&self) -> Result<&NetNs> {
        self.ns(&self.server)
    }

    /// Keeps a process (a server) alive as long as the testbed.
    pub fn keep(&mut self, process: Process) {
        self.guards.push(process);
    }

    /// Mutable access to the guarded processes (to check they still run).
    pub fn guards_mut(&mut self) -> &mut [Process] {
        &mut self.guards
    }
}

/// Turns a built topology into a testbed.
pub type SetupFn = Box<dyn Fn(Topology, &SetupCtx) -> Result<Testbed> + Send + Sync>;

/// A named benchmark setup.
pub struct Variant {
    /// Name used on the command line and in reports.
    pub name: &'static str,
    /// One line about the path measured.
    pub description: &'static str,
    /// The topology it needs.
    pub topology: TopologySpec,
    /// Whether it needs [`SetupCtx::cni_plugin`].
    pub needs_cni: bool,
    /// Whether it needs [`SetupCtx::agent`].
    pub needs_agent: bool,
    /// Builds the testbed.
    pub setup: SetupFn,
}

impl std::fmt::Debug for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Variant").field("name", &self.name).finish()
    }
}

impl Variant {
    /// Builds the topology and runs the setup.
    pub fn prepare(&self, ctx: &SetupCtx) -> Result<Testbed> {
        let mut spec = self.topology.clone();
        if self.needs_cni {
            let cni = ctx
                .cni_plugin
                .clone()
                .with_context(|| format!("variant {} needs the flannel CNI plugin", self.name))?;
            spec = spec.cni_plugin(cni);
        }
        if self.needs_agent && ctx.agent.is_none() {
            bail!("variant {} needs flannel-agent (--agent)", self.name);
        }
        let topology = Topology::new(spec)?;
        (self.setup)(topology, ctx).with_context(|| format!("setting up variant {}", self.name))
    }
}

/// The cluster network all variants use.
pub fn cluster_network() -> Ipv4Net {
    Ipv4Net::new(Ipv4Addr::new(10, 244, 0, 0), 16).unwrap_or_default()
}

/// The IPv6 cluster network of the dual-stack variants: fd00:244::/48 (as the dual-stack
/// fast-path tests use).
pub fn cluster_network_v6() -> Ipv6Net {
    Ipv6Net::new(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0), 48).unwrap_or_default()
}

/// Node `n`'s pod subnet in the hand-made variants: 10.244.n.0/24.
pub fn node_subnet(n: usize) -> Ipv4Net {
    Ipv4Net::new(Ipv4Addr::new(10, 244, n as u8, 0), 24).unwrap_or_default()
}

/// Variants that run without the agent (the default set of `bench dataplane`).
pub const DEFAULT_VARIANTS: &[&str] = &[UNDERLAY, "pod-same-node", "ref-hostgw", "ref-vxlan"];

/// Every known variant.
pub fn all() -> Vec<Variant> {
    let two_nodes = TopologySpec::new(2, Underlay::L2);
    let mut out = vec![
        Variant {
            name: UNDERLAY,
            description: "node1 eth0 to node2 eth0 over the underlay bridge (baseline)",
            topology: two_nodes.clone(),
            needs_cni: false,
            needs_agent: false,
            setup: Box::new(|t, _| {
                let ip = IpAddr::V4(t.node(2).addr());
                Ok(Testbed::new(
                    Owner::Topology(t),
                    Place::Node(1),
                    Place::Node(2),
                    ip,
                ))
            }),
        },
        Variant {
            name: UNDERLAY_V6,
            description: "node1 eth0 to node2 eth0 over the underlay bridge, IPv6 (the IPv6 baseline)",
            topology: two_nodes.clone().ipv6(true),
            needs_cni: false,
            needs_agent: false,
            setup: Box::new(|t, _| {
                let ip = IpAddr::V6(t.node(2).addr6().context("node2 has no IPv6 address")?);
                Ok(Testbed::new(
                    Owner::Topology(t),
                    Place::Node(1),
                    Place::Node(2),
                    ip,
                ))
            }),
        },
        Variant {
            name: "pod-same-node",
            description: "pod to pod on one node through cni0 (pods made by the flannel CNI plugin)",
            topology: TopologySpec::new(1, Underlay::L2),
            needs_cni: true,
            needs_agent: false,
            setup: Box::new(|mut t, _| {
                let mtu = t.spec().mtu;
                t.node(1).write_subnet_env(&SubnetEnv::v4(
                    cluster_network(),
                    node_subnet(1),
                    mtu,
                    false,
                ))?;
                let client = t.add_pod(1)?.name().to_owned();
                let server = t.add_pod(1)?;
                let (server, ip) = (server.name().to_owned(), IpAddr::V4(server.ip()));
                Ok(Testbed::new(
                    Owner::Topology(t),
                    Place::Pod(client),
                    Place::Pod(server),
                    ip,
                ))
            }),
        },
        Variant {
            name: "ref-hostgw",
            description: "pod to pod across nodes, static routes to the peer's pod subnet (hand-made host-gw)",
            topology: two_nodes.clone(),
            needs_cni: false,
            needs_agent: false,
            setup: Box::new(|t, _| ref_setup(t, false)),
        },
        floor_variant(
            "floor-ebpf-host-gw",
            "ref-hostgw's pods forwarded by a minimal TC program (destination lookup, MACs, TTL, redirect): the least any eBPF host-gw costs here",
            false,
        ),
        floor_variant(
            "floor-ebpf-vxlan",
            "ref-vxlan's pods forwarded by a minimal TC program (destination lookup, the fast path's VXLAN encapsulation, decapsulation, redirect): the least any eBPF VXLAN costs here",
            true,
        ),
        Variant {
            name: "ref-vxlan",
            description: "pod to pod across nodes through hand-made flannel.1 VXLAN devices (static FDB, neighbour, routes)",
            topology: two_nodes.clone(),
            needs_cni: false,
            needs_agent: false,
            setup: Box::new(|t, _| ref_setup(t, true)),
        },
    ];
    for (name, description, backend, dataplane, bare, ipv6) in [
        (
            "agent-host-gw",
            "pod to pod across nodes, flannel-agent host-gw, kernel dataplane",
            "host-gw",
            Dataplane::Kernel,
            false,
            false,
        ),
        (
            "agent-vxlan",
            "pod to pod across nodes, flannel-agent vxlan, kernel dataplane",
            "vxlan",
            Dataplane::Kernel,
            false,
            false,
        ),
        (
            "agent-host-gw-bare",
            "agent-host-gw without netfilter rules (no forward rules, CNI ipMasq off): the routes alone",
            "host-gw",
            Dataplane::Kernel,
            true,
            false,
        ),
        (
            "agent-vxlan-bare",
            "agent-vxlan without netfilter rules (no forward rules, CNI ipMasq off): the VXLAN path alone",
            "vxlan",
            Dataplane::Kernel,
            true,
            false,
        ),
        (
            "agent-udp",
            "pod to pod across nodes, flannel-agent udp (flannel0 TUN + user-space forwarder)",
            "udp",
            Dataplane::Kernel,
            false,
            false,
        ),
        (
            "agent-ebpf-host-gw",
            "pod to pod across nodes, flannel-agent host-gw, eBPF dataplane",
            "host-gw",
            Dataplane::Ebpf,
            false,
            false,
        ),
        (
            "agent-ebpf-vxlan",
            "pod to pod across nodes, flannel-agent vxlan, eBPF dataplane",
            "vxlan",
            Dataplane::Ebpf,
            false,
            false,
        ),
        (
            "agent-ebpf-udp",
            "pod to pod across nodes, flannel-agent udp, eBPF dataplane (UDP encapsulation in TC)",
            "udp",
            Dataplane::Ebpf,
            false,
            false,
        ),
        (
            "agent-ebpf-ipip",
            "pod to pod across nodes, flannel-agent ipip, eBPF dataplane (IPIP encapsulation in TC; this kernel has no ipip module)",
            "ipip",
            Dataplane::Ebpf,
            false,
            false,
        ),
        (
            "agent-host-gw-v6",
            "pod IPv6 to pod IPv6 across nodes, dual-stack cluster, flannel-agent host-gw, kernel dataplane",
            "host-gw",
            Dataplane::Kernel,
            false,
            true,
        ),
        (
            "agent-vxlan-v6",
            "pod IPv6 to pod IPv6 across nodes, dual-stack cluster, flannel-agent vxlan (flannel-v6.1), kernel dataplane",
            "vxlan",
            Dataplane::Kernel,
            false,
            true,
        ),
        (
            "agent-ebpf-host-gw-v6",
            "pod IPv6 to pod IPv6 across nodes, dual-stack cluster, flannel-agent host-gw, eBPF dataplane",
            "host-gw",
            Dataplane::Ebpf,
            false,
            true,
        ),
        (
            "agent-ebpf-vxlan-v6",
            "pod IPv6 to pod IPv6 across nodes, dual-stack cluster, flannel-agent vxlan (VXLAN over IPv6), eBPF dataplane",
            "vxlan",
            Dataplane::Ebpf,
            false,
            true,
        ),
    ] {
        let mut topology = two_nodes.clone().ipv6(ipv6);
        if bare {
            topology = topology.cni_ip_masq(false);
        }
        let family = if ipv6 { Family::V6 } else { Family::V4 };
        out.push(Variant {
            name,
            description,
            topology,
            needs_cni: true,
            needs_agent: true,
            setup: Box::new(move |t, ctx| agent_setup(t, ctx, backend, dataplane, bare, family)),
        });
    }
    out
}

/// A `ref-hostgw` (`ref-vxlan` with `vxlan`) testbed whose nodes forward nothing: a minimal
/// TC program ([`super::floor`]) carries every pod packet.
fn floor_variant(name: &'static str, description: &'static str, vxlan: bool) -> Variant {
    Variant {
        name,
        description,
        topology: TopologySpec::new(2, Underlay::L2),
        needs_cni: false,
        needs_agent: false,
        setup: Box::new(move |t, _| {
            let mut bed = ref_setup(t, vxlan)?;
            bed.programs = super::floor::attach(bed.topology(), vxlan)?;
            for n in 1..=2 {
                bed.topology()
                    .node(n)
                    .run(&["sysctl", "-qw", "net.ipv4.ip_forward=0"])?;
            }
            Ok(bed)
        }),
    }
}

/// Looks a variant up by name.
pub fn find(name: &str) -> Option<Variant> {
    all().into_iter().find(|v| v.name == name)
}

/// The underlay variant: node to node, the default baseline.
pub const UNDERLAY: &str = "underlay";

/// The IPv6 underlay variant: the baseline of the IPv6 variants when it runs.
pub const UNDERLAY_V6: &str = "underlay-v6";

/// The VNI of `ref-vxlan`'s `flannel.1` devices.
pub const REF_VNI: u32 = 1;
/// The UDP port of `ref-vxlan`'s `flannel.1` devices.
pub const REF_VXLAN_PORT: u16 = 8472;

/// Two nodes with one hand-made pod each (10.244.n.2 behind cni0 10.244.n.1), connected by
/// static routes over the underlay (`vxlan = false`) or through `flannel.1` VXLAN devices
/// configured the way upstream's kernel path does (`vxlan = true`).
fn ref_setup(mut t: Topology, vxlan: bool) -> Result<Testbed> {
    let underlay_mtu = t.spec().mtu;
    let pod_mtu = if vxlan {
        underlay_mtu - 50
    } else {
        underlay_mtu
    };
    for n in 1..=2 {
        let subnet = node_subnet(n);
        let gw = Ipv4Addr::from(u32::from(subnet.network()) + 1);
        let pod = Ipv4Net::new(Ipv4Addr::from(u32::from(subnet.network()) + 2), 24)?;
        t.add_plain_pod(n, pod, gw, pod_mtu)?;
    }
    if vxlan {
        let mut macs = Vec::new();
        for n in 1..=2 {
            let node = t.node(n);
            node.add_vxlan("flannel.1", REF_VNI, REF_VXLAN_PORT, pod_mtu)?;
            let addr = format!("{}/32", node_subnet(n).network());
            node.run(&["ip", "addr", "add", &addr, "dev", "flannel.1"])?;
            macs.push(link_mac(node.ns(), "flannel.1")?);
        }
        for (n, peer) in [(1, 2), (2, 1)] {
            let node = t.node(n);
            let peer_net = node_subnet(peer);
            let peer_vtep = peer_net.network().to_string();
            let mac = &macs[peer - 1];
            node.run(&[
                "ip",
                "neigh",
                "replace",
                &peer_vtep,
                "dev",
                "flannel.1",
                "lladdr",
                mac,
                "nud",
                "permanent",
            ])?;
            node.run(&[
                "bridge",
                "fdb",
                "replace",
                mac,
                "dev",
                "flannel.1",
                "self",
                "dst",
                &t.node(peer).addr().to_string(),
                "permanent",
            ])?;
            node.run(&[
                "ip",
                "route",
                "replace",
                &peer_net.to_string(),
                "via",
                &peer_vtep,
                "dev",
                "flannel.1",
                "onlink",
            ])?;
        }
    } else {
        for (n, peer) in [(1, 2), (2, 1)] {
            t.node(n).run(&[
                "ip",
                "route",
                "add",
                &node_subnet(peer).to_string(),
                "via",
                &t.node(peer).addr().to_string(),
                "dev",
                "eth0",
            ])?;
        }
    }
    let client = t.pods_on(1)[0].name().to_owned();
    let server = t.pods_on(2)[0];
    let (server, ip) = (server.name().to_owned(), IpAddr::V4(server.ip()));
    Ok(Testbed::new(
        Owner::Topology(t),
        Place::Pod(client),
        Place::Pod(server),
        ip,
    ))
}

/// The MAC address of `link` in `ns`.
pub fn link_mac(ns: &NetNs, link: &str) -> Result<String> {
    let out = ns.run(&["ip", "-j", "link", "show", link])?;
    let v: serde_json::Value = serde_json::from_str(&out).context("ip -j link output")?;
    v[0]["address"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("{link} has no address: {out}"))
}

/// The address family a variant measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// IPv4 (an IPv4-only cluster).
    V4,
    /// IPv6 between the pods of a dual-stack cluster ([`cluster_network_v6`]).
    V6,
}

/// A two-node cluster run by the agent with one CNI pod per node; `bare`: without the
/// agent's forward rules (the topology's CNI delegate is set not to masquerade). With
/// [`Family::V6`] the cluster is dual-stack (the topology must have IPv6) and the server
/// address is the server pod's IPv6 address.
fn agent_setup(
    t: Topology,
    ctx: &SetupCtx,
    backend: &str,
    dataplane: Dataplane,
    bare: bool,
    family: Family,
) -> Result<Testbed> {
    let agent = ctx.agent.clone().context("no flannel-agent")?;
    let mut spec = ClusterSpec::new(t.spec().clone(), backend, agent);
    spec.dataplane = dataplane;
    spec.pods_per_node = 1;
    if family == Family::V6 {
        spec.ipv6_network = Some(cluster_network_v6());
    }
    if bare {
        spec.agent_args = vec!["--iptables-forward-rules=false".to_owned()];
    }
    let mut cluster = Cluster::start(t, spec, &|msg| eprintln!("  {msg}"), &|| false)?;
    // Measure a converged cluster: both agents have programmed the complete lease set.
    cluster.wait_ready(std::time::Duration::from_secs(60))?;
    let client = cluster.topology().pods_on(1)[0].name().to_owned();
    let server = cluster.topology().pods_on(2)[0];
    let ip = match family {
        Family::V4 => IpAddr::V4(server.ip()),
        Family::V6 => IpAddr::V6(
            server
                .ip6()
                .with_context(|| format!("pod {} has no IPv6 address", server.name()))?,
        ),
    };
    let server = server.name().to_owned();
    Ok(Testbed::new(
        Owner::Cluster(Box::new(cluster)),
        Place::Pod(client),
        Place::Pod(server),
        ip,
    ))
}
