//! The `floor-ebpf-host-gw` variant's programs: `tc_bench_floor` (see `flannel_ebpf::bench`)
//! on the pod's veth and on `eth0` of both nodes of a `ref-hostgw` testbed, each with the two
//! destinations it forwards. What this path costs above the underlay is what any eBPF host-gw
//! forwarder between veth pods costs here (the pod's own veth crossing, the redirects, a
//! program entry per hop); what the agent's fast path costs above it is its own.

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::HashMap,
    programs::{SchedClassifier, TcAttachType},
};
use flannel_common::programs::{
    BENCH_FLOOR_MAP, FLOOR_EGRESS, FLOOR_PEER, FloorHop, TC_BENCH_FLOOR,
};

use super::variant::link_mac;
use crate::topology::Topology;

/// The pod's veth on its node (the one pod a `ref-hostgw` node has).
const POD_VETH: &str = "vp1";

/// Loads and attaches the floor program on both nodes of `t` (two nodes, one pod each). The
/// programs stay attached as long as the returned objects live.
pub fn attach(t: &Topology) -> Result<Vec<Ebpf>> {
    (1..=2)
        .map(|n| attach_node(t, n, 3 - n).with_context(|| format!("floor program on node {n}")))
        .collect()
}

fn attach_node(t: &Topology, n: usize, peer: usize) -> Result<Ebpf> {
    let node = t.node(n);
    let local = t.first_pod_on(n)?;
    let remote = t.first_pod_on(peer)?;
    let into_pod = FloorHop {
        smac: mac(&link_mac(node.ns(), "cni0")?)?,
        dmac: mac(&link_mac(local.ns(), "eth0")?)?,
        into_peer: FLOOR_PEER,
        ifindex: 0,
    };
    let to_peer = FloorHop {
        smac: mac(&link_mac(node.ns(), "eth0")?)?,
        dmac: mac(&link_mac(t.node(peer).ns(), "eth0")?)?,
        into_peer: FLOOR_EGRESS,
        ifindex: 0,
    };
    let (local_ip, remote_ip) = (local.ip().octets(), remote.ip().octets());
    node.ns().enter(move || -> Result<Ebpf> {
        let index = |name: &str| {
            nix::net::if_::if_nametoindex(name).with_context(|| format!("no interface {name}"))
        };
        let mut ebpf = Ebpf::load(flannel_agent::EBPF_OBJECT).context("loading the object")?;
        let mut hops: HashMap<_, [u8; 4], FloorHop> =
            HashMap::try_from(ebpf.map_mut(BENCH_FLOOR_MAP).context("no floor map")?)?;
        hops.insert(
            local_ip,
            FloorHop {
                ifindex: index(POD_VETH)?,
                ..into_pod
            },
            0,
        )?;
        hops.insert(
            remote_ip,
            FloorHop {
                ifindex: index("eth0")?,
                ..to_peer
            },
            0,
        )?;
        let program: &mut SchedClassifier = ebpf
            .program_mut(TC_BENCH_FLOOR)
            .context("no floor program")?
            .try_into()?;
        program.load()?;
        for dev in [POD_VETH, "eth0"] {
            program
                .attach(dev, TcAttachType::Ingress)
                .with_context(|| format!("attaching to {dev}"))?;
        }
        Ok(ebpf)
    })?
}

/// `aa:bb:…` as bytes.
fn mac(text: &str) -> Result<[u8; 6]> {
    let mac: flannel_agent::backend::data::MacAddr = text.parse()?;
    Ok(mac.octets())
}
