//! The `floor-ebpf-host-gw` and `floor-ebpf-vxlan` variants' programs: `tc_bench_floor` (see
//! `flannel_ebpf::bench`) on the pod's veth and on `eth0` of both nodes of a `ref-hostgw` or
//! `ref-vxlan` testbed, each with the two destinations it forwards (and, for VXLAN, the
//! node's VXLAN configuration). What this path costs above the underlay is what any eBPF
//! forwarder between veth pods costs here (the pod's own veth crossing, the redirects, a
//! program entry per hop, for VXLAN the encapsulation and decapsulation); what the agent's
//! fast path costs above it is its own.

use std::net::Ipv4Addr;

use anyhow::{Context as _, Result};
use aya::{
    Ebpf,
    maps::{Array, HashMap},
    programs::{SchedClassifier, TcAttachType},
};
use flannel_agent::bpf::{LocalConfig, VxlanLocal};
use flannel_common::{
    config::Config,
    maps::CONFIG,
    programs::{BENCH_FLOOR_MAP, FLOOR_EGRESS, FLOOR_PEER, FloorHop, TC_BENCH_FLOOR},
    route::{RemoteEntry, RouteKind},
};

use super::variant::{REF_VNI, REF_VXLAN_PORT, cluster_network, link_mac, node_subnet};
use crate::topology::Topology;

/// The pod's veth on its node (the one pod a `ref-*` node has).
const POD_VETH: &str = "vp1";

/// Loads and attaches the floor program on both nodes of `t` (two nodes, one pod each;
/// `vxlan`: encapsulating to the peer with the VTEP MACs of the nodes' `flannel.1`). The
/// programs stay attached as long as the returned objects live.
pub fn attach(t: &Topology, vxlan: bool) -> Result<Vec<Ebpf>> {
    (1..=2)
        .map(|n| {
            attach_node(t, n, 3 - n, vxlan).with_context(|| format!("floor program on node {n}"))
        })
        .collect()
}

fn attach_node(t: &Topology, n: usize, peer: usize, vxlan: bool) -> Result<Ebpf> {
    let node = t.node(n);
    let peer_node = t.node(peer);
    let local = t.first_pod_on(n)?;
    let remote = t.first_pod_on(peer)?;
    let into_pod = FloorHop {
        smac: mac(&link_mac(node.ns(), "cni0")?)?,
        dmac: mac(&link_mac(local.ns(), "eth0")?)?,
        into_peer: FLOOR_PEER,
        ..FloorHop::default()
    };
    let mut to_peer = FloorHop {
        smac: mac(&link_mac(node.ns(), "eth0")?)?,
        dmac: mac(&link_mac(peer_node.ns(), "eth0")?)?,
        into_peer: FLOOR_EGRESS,
        ..FloorHop::default()
    };
    let vtep = if vxlan {
        to_peer.vxlan_peer = RemoteEntry {
            kind: RouteKind::Vxlan as u32,
            public_ip: peer_node.addr().octets(),
            vni: REF_VNI,
            vtep_mac: mac(&link_mac(peer_node.ns(), "flannel.1")?)?,
            ..RemoteEntry::default()
        };
        Some(mac(&link_mac(node.ns(), "flannel.1")?)?)
    } else {
        None
    };
    let (public_ip, local_ip, remote_ip) = (node.addr(), local.ip(), remote.ip());
    node.ns().enter(move || -> Result<Ebpf> {
        let index = |name: &str| {
            nix::net::if_::if_nametoindex(name).with_context(|| format!("no interface {name}"))
        };
        let mut ebpf = Ebpf::load(flannel_agent::EBPF_OBJECT).context("loading the object")?;
        if let Some(vtep_mac) = vtep {
            let config = config(public_ip, index("eth0")?, n, vtep_mac)?;
            let mut map: Array<_, Config> =
                Array::try_from(ebpf.map_mut(CONFIG).context("no config map")?)?;
            map.set(0, config, 0)?;
        }
        let local_hop = FloorHop {
            ifindex: index(POD_VETH)?,
            ..into_pod
        };
        let remote_hop = FloorHop {
            ifindex: index("eth0")?,
            ..to_peer
        };
        let program = load_program(
            &mut ebpf,
            [
                (local_ip.octets(), local_hop),
                (remote_ip.octets(), remote_hop),
            ],
        )?;
        for dev in [POD_VETH, "eth0"] {
            program
                .attach(dev, TcAttachType::Ingress)
                .with_context(|| format!("attaching to {dev}"))?;
        }
        Ok(ebpf)
    })?
}

/// Writes `hops` (destination address → hop) into the floor program's map of `ebpf` and
/// loads the program (not attached).
pub(super) fn load_program(
    ebpf: &mut Ebpf,
    hops: [([u8; 4], FloorHop); 2],
) -> Result<&mut SchedClassifier> {
    let mut map: HashMap<_, [u8; 4], FloorHop> =
        HashMap::try_from(ebpf.map_mut(BENCH_FLOOR_MAP).context("no floor map")?)?;
    for (dst, hop) in hops {
        map.insert(dst, hop, 0)?;
    }
    let program: &mut SchedClassifier = ebpf
        .program_mut(TC_BENCH_FLOOR)
        .context("no floor program")?
        .try_into()?;
    program.load()?;
    Ok(program)
}

/// Node `n`'s VXLAN configuration (as the agent would write it for `ref-vxlan`'s devices).
fn config(public_ip: Ipv4Addr, ext_ifindex: u32, n: usize, vtep_mac: [u8; 6]) -> Result<Config> {
    let local = LocalConfig {
        vxlan: Some(VxlanLocal {
            vni: REF_VNI,
            port: REF_VXLAN_PORT,
            vtep_mac,
        }),
        ..LocalConfig::new(public_ip, ext_ifindex, node_subnet(n), cluster_network())
    };
    Ok(local.to_entry()?)
}

/// `aa:bb:…` as bytes.
fn mac(text: &str) -> Result<[u8; 6]> {
    let mac: flannel_agent::backend::data::MacAddr = text.parse()?;
    Ok(mac.octets())
}
