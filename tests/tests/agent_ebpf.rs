//! The kernel-path test matrix of `agent_connectivity.rs` and `agent_lifecycle.rs` on the
//! eBPF fast path (`--dataplane ebpf`), plus ipip, which only exists here through the fast
//! path (this kernel has no ipip module), and mixed clusters of kernel-path and fast-path
//! nodes.
//!
//! Besides everything the kernel-path tests check (exact routes, neighbours and FDB entries,
//! the pod matrix, intact transfers), every fast-path node must report
//! `flannel_dataplane_info{path="ebpf"}`, hold exactly the expected route map, and count the
//! test's traffic in its programs' counters (bytes of the bulk transfers included), so an
//! agent that silently falls back to the kernel path fails.
//!
//! * connectivity: host-gw, vxlan, ipip over an L2 and a routed (L3) underlay; vxlan with
//!   DirectRouting over a mixed underlay;
//! * lifecycle (one cluster per backend, checks in order): connectivity, an agent restart
//!   under a UDP request stream and a long TCP transfer (pins adopted, programs swapped,
//!   nothing lost), a 30 s etcd outage (traffic keeps flowing through the programs), a node
//!   leaving (its route map, tunnel peer and kernel entries gone);
//! * mixed: four nodes alternating `--dataplane kernel` and `--dataplane ebpf`, vxlan and
//!   host-gw, pod matrix and transfers in both directions between the two kinds;
//! * kube mode: two nodes taking their leases from a fake Kubernetes API server, vxlan on
//!   the fast path;
//! * `clsact` filters instead of TCX links (kernels before 6.6): connectivity, a restart
//!   without a gap, and switching a node between the two and to the kernel path;
//! * programs detached by something else (`bpftool link detach`, `tc qdisc del`), on TCX
//!   links and on filters: attached again within `--resync-interval`, once each.
//!
//! Run: `cargo test -p flannel-tests --test agent_ebpf` (as root; skipped otherwise).

mod agent_support;

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use agent_support::{
    CONVERGE, PROBE, Path, named, routes_text,
    scenarios::{self, connectivity, reachable_everywhere},
    spec_on, with_cluster,
};
use anyhow::{Context as _, Result, bail, ensure};
use flannel_agent::{bpf::tcfilter, netlink::Netlink};
use flannel_tests::{
    bench::variant::link_mac,
    kube_mock::MockApiServer,
    lab::{
        agent::{Agent, AgentSpec, DEFAULT_HEALTHZ_PORT, Dataplane},
        bins,
        cluster::{Cluster, ClusterSpec},
        fastpath::{self, Route},
        kube, probe,
        process::{Output, Process},
        status, wait,
    },
    netns::NetNs,
    packet::{Ipv4, Udp},
    require_root,
    topology::{SubnetEnv, Topology, TopologySpec, Underlay},
};
use ipnet::Ipv4Net;
use serde_json::json;

const EBPF: Dataplane = Dataplane::Ebpf;

/// A UDP payload of `size` bytes that no shift or cut of it repeats.
fn pattern(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i % 251) as u8).collect()
}

#[test]
fn ebpf_host_gw_over_l2() {
    require_root!();
    connectivity(EBPF, "host-gw", Underlay::L2);
}

/// Nothing is programmed for peers on other segments (no kernel route, no map entry).
#[test]
fn ebpf_host_gw_over_l3_reports_unreachable_peers() {
    require_root!();
    connectivity(EBPF, "host-gw", Underlay::L3);
}

#[test]
fn ebpf_vxlan_over_l3() {
    require_root!();
    connectivity(EBPF, "vxlan", Underlay::L3);
}

/// The routed underlay: IPIP routes go onlink via the node's gateway.
#[test]
fn ebpf_ipip_over_l3() {
    require_root!();
    connectivity(EBPF, "ipip", Underlay::L3);
}

/// On the routed underlay, where a pod packet that left unencapsulated would meet a router
/// that knows no pod subnet: UDP datagrams larger than the MTU, sent as IPv4 fragments, reach
/// the remote pod, from a pod (3,000 bytes: node1's `tc_from_bridge` encapsulates its
/// fragments like the rest of its flow, `flannel_ebpf::frag`) and from the node itself (5,000
/// bytes: the kernel routes them out of the external interface, where node1's `tc_to_netdev`
/// encapsulates them).
#[test]
fn ebpf_ipip_carries_fragments_over_l3() {
    require_root!();
    with_cluster(
        &named(EBPF, "ipip/l3 fragments"),
        spec_on(EBPF, 2, Underlay::L3, "ipip", 1),
        |c| {
            let t = c.topology();
            let (from, to) = (t.first_pod_on(1)?, t.first_pod_on(2)?);
            let before = fastpath::counters(t.node(1).ns(), DEFAULT_HEALTHZ_PORT)?;
            let rx = probe::udp_listener(to.ns(), SocketAddr::new(IpAddr::V4(to.ip()), 6000))?;
            for (who, ns, src, size) in [
                ("pod", from.ns(), IpAddr::V4(from.ip()), 3000),
                ("node", t.node(1).ns(), IpAddr::V4(t.node(1).addr()), 5000),
            ] {
                let tx = probe::udp_listener(ns, SocketAddr::new(src, 0))?;
                probe::send_and_receive(&tx, &rx, &pattern(size), Duration::from_secs(2))
                    .with_context(|| format!("the {who}'s {size}-byte datagram"))?;
            }
            let after = fastpath::counters(t.node(1).ns(), DEFAULT_HEALTHZ_PORT)?;
            let (b, a) = (&before.packets, &after.packets);
            let pods = fastpath::grown(b, a, "tc_from_bridge", "fast_ipip");
            let fragments = fastpath::grown(b, a, "tc_to_netdev", "ipv4_fragment");
            let encapsulated = fastpath::grown(b, a, "tc_to_netdev", "fast_ipip_egress");
            ensure!(
                pods >= 3 && fragments >= 4 && encapsulated >= fragments,
                "node1's tc_from_bridge encapsulated {pods} packets, its tc_to_netdev saw \
                 {fragments} fragments and encapsulated {encapsulated} packets; what moved: {}",
                fastpath::growth_text(b, a)
            );
            Ok(())
        },
    );
}

/// On the routed underlay with a path narrower than the interfaces (the router's route to
/// node2's segment says MTU 1,400, every interface 1,500), where nothing here (no `ipip`
/// module) takes a router's "fragmentation needed" about an IPIP packet (and only the agent's
/// socket a reassembled IPIP packet):
/// - a pod's 3,000-byte UDP datagrams to a pod on node2 arrive after the first: their
///   fragments' IPIP packets carry DF (`flannel_ebpf::encap`), so the router sends an error
///   instead of fragmenting them, which node1 rewrites for the pod (`flannel_ebpf::pmtu`);
///   the pod then fragments to fit. Before, the router fragmented every one and node2's
///   kernel dropped them reassembled (its agent now takes those,
///   `ebpf_ipip_takes_packets_fragmented_on_the_way`);
/// - TCP transfers from the pod and from node1 itself complete, each sender having learnt
///   the path MTU less the IPIP header (1,380). Before, the DF packets vanished at the router
///   and the transfers stalled.
#[test]
fn ebpf_ipip_crosses_a_narrower_path() {
    require_root!();
    with_cluster(
        &named(EBPF, "ipip/l3 narrower path"),
        spec_on(EBPF, 2, Underlay::L3, "ipip", 1),
        |c| {
            let t = c.topology();
            let segment2 = t.node(2).addr_net().trunc().to_string();
            let gateway2 = t.node(2).gateway().to_string();
            t.hub().run(&[
                "ip", "route", "replace", &segment2, "dev", "br2", "proto", "kernel", "scope",
                "link", "src", &gateway2, "mtu", "1400",
            ])?;
            let to = t.first_pod_on(2)?;
            let before = fastpath::counters(t.node(1).ns(), DEFAULT_HEALTHZ_PORT)?;
            let rx = probe::udp_listener(to.ns(), SocketAddr::new(IpAddr::V4(to.ip()), 6000))?;
            let from = t.first_pod_on(1)?;
            let tx = probe::udp_listener(from.ns(), SocketAddr::new(IpAddr::V4(from.ip()), 0))?;
            let arrived: Vec<bool> = (0..5u8)
                .map(|n| {
                    let payload = vec![n; 3000];
                    probe::send_and_receive(&tx, &rx, &payload, Duration::from_millis(500)).is_ok()
                })
                .collect();
            ensure!(
                arrived.iter().filter(|ok| **ok).count() >= 3,
                "of five 3,000-byte datagrams across the narrower path, these arrived: {arrived:?}"
            );
            for (who, ns) in [("pod", t.first_pod_on(1)?.ns()), ("node", t.node(1).ns())] {
                probe::transfer(
                    ns,
                    to.ns(),
                    IpAddr::V4(to.ip()),
                    4 << 20,
                    Duration::from_secs(20),
                )
                .with_context(|| format!("the {who}'s transfer across the narrower path"))?;
                let route = ns.run(&["ip", "route", "get", &to.ip().to_string()])?;
                ensure!(
                    route.contains("mtu 1380"),
                    "the {who} has not learnt the path MTU: {route}"
                );
            }
            let after = fastpath::counters(t.node(1).ns(), DEFAULT_HEALTHZ_PORT)?;
            let (b, a) = (&before.packets, &after.packets);
            let rewritten = fastpath::grown(b, a, "tc_from_netdev", "fast_ipip_frag_needed");
            ensure!(
                rewritten >= 2,
                "node1 rewrote {rewritten} errors; what moved: {}",
                fastpath::growth_text(b, a)
            );
            Ok(())
        },
    );
}

/// IPIP packets that arrive in fragments: on the routed underlay with a path narrower than the
/// interfaces (the router's route to node1's segment says MTU 1,400), a router fragments the
/// packets of upstream's `flannel.ipip`, which copies the inner DF bit. node1's
/// `tc_from_netdev` leaves the fragments to the kernel, which reassembles them and, with no
/// `ipip` module, has no receiver for them; the agent's raw IPIP socket
/// (`flannel_agent::ipip_rx`) takes them.
/// - from node2, a datagram in fragments whose IPIP packets arrive whole: decapsulated by
///   the program (`fast_decap_ipip`), the agent not involved;
/// - from node2, a whole IPIP packet with IP options: the program leaves it to the kernel,
///   the agent delivers it, and inner fragments stay with the program (it was not
///   fragmented on the way: `IP_RECVFRAGSIZE`);
/// - from node2 (an IPIP peer), a full-size (1,480-byte) UDP packet from node2's pod to
///   node1's pod, sent in IPIP without DF: the router fragments it, it arrives with the inner
///   source and is counted `delivered`. Before, it was lost;
/// - from node2, a 3,000-byte datagram its sender fragmented, each fragment in its own IPIP
///   packet: two fragmented again on the way, the last whole. Having seen a router fragment
///   IPIP, the agent has the program leave the whole one to it as well, so all three
///   fragments reach conntrack at the same hook, and the datagram arrives. Before, the last one, decapsulated by the program, waited in
///   `PREROUTING`'s reassembly for fragments that went through `OUTPUT`, and it was lost;
/// - the same from the router itself, which is no node: it does not arrive and is counted
///   `drop_unknown_peer` (as the programs refuse its whole packets);
/// - with node1's agent stopped (its programs stay attached), a datagram in fragments whose
///   IPIP packets arrive whole still reaches the pod: the agent told the programs, on its
///   way out, to decapsulate inner fragments themselves again;
/// - node1's agent back with `--ebpf-ipip-reassembly-hold=2`: a packet fragmented on the way
///   sends inner fragments to the agent again (`flannel_ipip_inner_fragments_to_agent` 1);
///   2 s without another, they go back to the program (gauge 0), and a datagram in fragments
///   whose IPIP packets arrive whole is decapsulated by it, not by the agent.
#[test]
fn ebpf_ipip_takes_packets_fragmented_on_the_way() {
    require_root!();
    with_cluster(
        &named(EBPF, "ipip reassembled"),
        spec_on(EBPF, 2, Underlay::L3, "ipip", 1),
        |c| {
            let t = c.topology();
            let node1 = t.node(1);
            let segment1 = node1.addr_net().trunc().to_string();
            let gateway1 = node1.gateway().to_string();
            let bridge1 = format!("br{}", node1.segment());
            t.hub().run(&[
                "ip", "route", "replace", &segment1, "dev", &bridge1, "proto", "kernel", "scope",
                "link", "src", &gateway1, "mtu", "1400",
            ])?;
            let (to, from) = (t.first_pod_on(1)?, t.first_pod_on(2)?);
            let rx = probe::udp_listener(to.ns(), SocketAddr::new(IpAddr::V4(to.ip()), 6000))?;
            let (to_ip, from_ip) = (to.ip(), from.ip());
            let metric = "flannel_ipip_reassembled_packets_total";
            let node1_metric = |c: &Cluster, name: &str, label: &str| {
                status::metric_sum(c.topology().node(1).ns(), DEFAULT_HEALTHZ_PORT, name, label)
            };
            let count =
                |c: &Cluster, kind: &str| node1_metric(c, metric, &format!("kind=\"{kind}\""));
            let to_agent =
                |c: &Cluster| node1_metric(c, "flannel_ipip_inner_fragments_to_agent", "");
            let delivered = |want: f64| -> Result<()> {
                let got = count(c, "delivered")?;
                ensure!(got == want, "delivered: {got}, not {want}");
                Ok(())
            };
            // A datagram from node2's pod (source port `sport`), in IP fragments of at most
            // `size` bytes of payload, or whole (`None`).
            let datagram = |payload: &[u8], sport: u16, size: Option<usize>| {
                let ip = Ipv4 {
                    id: sport,
                    dont_fragment: false,
                    ..Ipv4::new(from_ip, to_ip, Udp::new(sport, 6000).payload(payload))
                };
                Datagram {
                    packets: size.map_or_else(|| vec![ip.encode()], |size| ip.fragments(size)),
                    payload: payload.to_vec(),
                    source: SocketAddr::new(IpAddr::V4(from_ip), sport),
                }
            };

            // Until a router is seen fragmenting IPIP, the program decapsulates inner
            // fragments itself: a datagram in fragments whose IPIP packets arrive whole never
            // goes through the agent.
            // (The program's count of the fragments it decapsulated, the agent's of the
            // packets it delivered.)
            let decapsulated_by_program = |c: &Cluster, sport: u16| -> Result<()> {
                let before = fastpath::counters(c.topology().node(1).ns(), DEFAULT_HEALTHZ_PORT)?;
                let delivered = count(c, "delivered")?;
                datagram(&pattern(2000), sport, Some(800)).send_from_node2(
                    c.topology(),
                    &rx,
                    "a datagram in fragments, each IPIP packet whole",
                )?;
                let after = fastpath::counters(c.topology().node(1).ns(), DEFAULT_HEALTHZ_PORT)?;
                let (b, a) = (&before.packets, &after.packets);
                let decapsulated = fastpath::grown(b, a, "tc_from_netdev", "fast_decap_ipip");
                let by_agent = count(c, "delivered")? - delivered;
                ensure!(
                    decapsulated == 3 && by_agent == 0.0,
                    "the program decapsulated {decapsulated} of the 3 fragments, the agent \
                     delivered {by_agent}; what moved: {}",
                    fastpath::growth_text(b, a)
                );
                Ok(())
            };
            decapsulated_by_program(c, 40999)?;

            // A whole IPIP packet with IP options (left to the kernel by the program) from
            // node2: the agent delivers it, but it was not fragmented on the way, so inner
            // fragments stay with the program.
            let with_options = datagram(&pattern(100), 40998, None);
            for packet in &with_options.packets {
                probe::send_ipip_with_options(
                    t.node(2).ns(),
                    Some(t.node(2).addr()),
                    node1.addr(),
                    packet,
                    &[1, 1, 1, 0],
                )?;
            }
            probe::recv_payload(&rx, &with_options.payload, Duration::from_secs(3))
                .context("the IPIP packet with IP options")?;
            delivered(1.0)?;
            ensure!(
                to_agent(c)? == 0.0,
                "inner fragments go to the agent after a whole IPIP packet"
            );

            // The pods' MTU (1,500 less the IPIP header), all of it: the router fragments it.
            let before = fastpath::counters(node1.ns(), DEFAULT_HEALTHZ_PORT)?;
            let full = datagram(&pattern(1480 - 28), 41000, None);
            full.send_from_node2(
                t,
                &rx,
                "the datagram in an IPIP packet fragmented on the way",
            )?;
            delivered(2.0)?;
            let after = fastpath::counters(node1.ns(), DEFAULT_HEALTHZ_PORT)?;
            let (b, a) = (&before.packets, &after.packets);
            let fragments = fastpath::grown(b, a, "tc_from_netdev", "pass_fragment");
            ensure!(
                fragments >= 2,
                "node1's tc_from_netdev left {fragments} fragments to the kernel; what moved: {}",
                fastpath::growth_text(b, a)
            );

            // A datagram that its sender fragmented: the first two fragments fill the pods'
            // MTU (1,476 bytes; the router fragments their IPIP packets), the last is small
            // (its IPIP packet arrives whole, and the program leaves it to the agent too).
            let split = datagram(&pattern(3000), 41001, Some(1456));
            ensure!(
                split.packets.len() == 3,
                "{} fragments",
                split.packets.len()
            );
            split.send_from_node2(
                t,
                &rx,
                "a fragmented datagram whose IPIP packets were fragmented on the way",
            )?;
            delivered(5.0)?;

            // The same from the router, which is no node.
            for packet in &full.packets {
                probe::send_ipip(t.hub(), None, node1.addr(), packet)?;
            }
            wait::until_ok(
                CONVERGE,
                "the router's packet counted as from an unknown peer",
                || {
                    let dropped = count(c, "drop_unknown_peer")?;
                    ensure!(dropped == 1.0, "drop_unknown_peer: {dropped}");
                    Ok(())
                },
            )?;
            ensure!(
                probe::recv_payload(&rx, &full.payload, Duration::from_millis(500)).is_err(),
                "the router's IPIP packet was delivered"
            );
            delivered(5.0)?;

            ensure!(
                to_agent(c)? == 1.0,
                "inner fragments do not go to the agent"
            );

            // node1's agent stops (its programs stay attached): they decapsulate inner
            // fragments themselves again, and a datagram in fragments whose IPIP packets
            // arrive whole still reaches the pod.
            let later = datagram(&pattern(2000), 41002, Some(800));
            c.agent_mut(1)
                .context("node1's agent")?
                .stop(Duration::from_secs(10))?;
            later.send_from_node2(
                c.topology(),
                &rx,
                "a datagram in fragments while node1's agent is down",
            )?;

            // Back with a hold of 2 s: a packet fragmented on the way sends inner fragments
            // to the agent; 2 s without another, they go back to the program.
            restart_with(c, 1, |args| {
                args.push("--ebpf-ipip-reassembly-hold=2".into());
            })?;
            datagram(&pattern(1480 - 28), 41003, None).send_from_node2(
                c.topology(),
                &rx,
                "after the restart, a packet fragmented on the way",
            )?;
            wait::until_ok(CONVERGE, "inner fragments to the agent", || {
                ensure!(to_agent(c)? == 1.0, "not yet");
                Ok(())
            })?;
            wait::until_ok(CONVERGE, "inner fragments back to the program", || {
                ensure!(to_agent(c)? == 0.0, "still to the agent");
                Ok(())
            })?;
            decapsulated_by_program(c, 41004)
        },
    );
}

/// A UDP datagram from node2's pod to node1's pod, as the IP packets that carry it.
struct Datagram {
    packets: Vec<Vec<u8>>,
    payload: Vec<u8>,
    source: SocketAddr,
}

impl Datagram {
    /// node2 sends each packet to node1 in IPIP without DF (a router on a narrower path
    /// fragments the larger ones); the datagram must reach `rx` from node2's pod.
    fn send_from_node2(&self, t: &Topology, rx: &std::net::UdpSocket, what: &str) -> Result<()> {
        for packet in &self.packets {
            probe::send_ipip(
                t.node(2).ns(),
                Some(t.node(2).addr()),
                t.node(1).addr(),
                packet,
            )?;
        }
        let seen = probe::recv_payload(rx, &self.payload, Duration::from_secs(3))
            .context(what.to_owned())?;
        ensure!(
            seen == self.source,
            "{what}: it came from {seen}, not {}",
            self.source
        );
        Ok(())
    }
}

/// A pod's UDP datagrams larger than its MTU (IPv4 fragments) to a remote pod keep the flow's
/// source, as its small ones do, on VXLAN, IPIP and udp (routed underlay) and host-gw: the agents run
/// without `--ip-masq`, so the CNI bridge masquerades what crosses netfilter, and the
/// fragments, sent by node1's `tc_from_bridge` like the rest of the flow
/// (`flannel_ebpf::frag`), do not cross it. Before, they arrived from an address and port of
/// node1, which a connected socket on the remote pod never receives.
#[test]
fn ebpf_pod_fragments_keep_their_flows_source() {
    require_root!();
    for (backend, underlay) in [
        ("vxlan", Underlay::L3),
        ("host-gw", Underlay::L2),
        ("ipip", Underlay::L3),
        ("udp", Underlay::L3),
    ] {
        with_cluster(
            &named(EBPF, &format!("{backend} pod fragments")),
            spec_on(EBPF, 2, underlay, backend, 1),
            |c| {
                let t = c.topology();
                let (from, to) = (t.first_pod_on(1)?, t.first_pod_on(2)?);
                let before = fastpath::counters(t.node(1).ns(), DEFAULT_HEALTHZ_PORT)?;
                let rx = probe::udp_listener(to.ns(), SocketAddr::new(IpAddr::V4(to.ip()), 6000))?;
                let tx = probe::udp_listener(from.ns(), SocketAddr::new(IpAddr::V4(from.ip()), 0))?;
                let source = tx.local_addr()?;
                for size in [100, 3000, 100, 8000] {
                    let seen =
                        probe::send_and_receive(&tx, &rx, &pattern(size), Duration::from_secs(2))
                            .with_context(|| format!("{backend}: the {size}-byte datagram"))?;
                    ensure!(
                        seen == source,
                        "{backend}: the {size}-byte datagram came from {seen}, not {source}"
                    );
                }
                let after = fastpath::counters(t.node(1).ns(), DEFAULT_HEALTHZ_PORT)?;
                let (b, a) = (&before.packets, &after.packets);
                let fragments = fastpath::grown(b, a, "tc_from_bridge", "ipv4_fragment");
                let passed = fastpath::grown(b, a, "tc_from_bridge", "pass_fragment");
                ensure!(
                    fragments >= 8 && passed == 0,
                    "{backend}: node1's tc_from_bridge saw {fragments} fragments and passed \
                     {passed}; what moved: {}",
                    fastpath::growth_text(b, a)
                );
                Ok(())
            },
        );
    }
}

/// A pod's connection that leaves through the kernel path (here: its packets carry IP options,
/// which the programs leave to the kernel) is masqueraded by the CNI bridge (the agents run
/// without `--ip-masq`), so its server answers to a host address of the node. That answer must
/// not put the server's endpoint in the NAT guard: another pod's connection to the same server,
/// begun on the fast path, would be sent through the kernel midway, picked up by conntrack,
/// masqueraded and reset by the server (seen at pod start-up, when a new pod's first
/// connection took the kernel path before its port had the program). Pod A's connection must
/// carry on after pod B's, and node1 must learn nothing.
#[test]
fn ebpf_masqueraded_kernel_flow_leaves_other_pods_alone() {
    require_root!();
    with_cluster(
        &named(EBPF, "masqueraded kernel flow"),
        spec_on(EBPF, 2, Underlay::L2, "vxlan", 2),
        |c| {
            let t = c.topology();
            let (a, b) = (t.pods_on(1)[0], t.pods_on(1)[1]);
            let server = t.first_pod_on(2)?;
            let addr = SocketAddr::new(IpAddr::V4(server.ip()), 7100);
            let peers = probe::line_echo_server(server.ns(), addr, 2)?;
            let before = fastpath::counters(t.node(1).ns(), DEFAULT_HEALTHZ_PORT)?;
            let mut first = a.ns().enter(move || std::net::TcpStream::connect(addr))??;
            first.set_read_timeout(Some(Duration::from_secs(3)))?;
            probe::line_round_trip(&mut first, "a1").context("pod A's first message")?;
            let mut second = b.ns().enter(move || connect_with_ip_options(addr))??;
            second.set_read_timeout(Some(Duration::from_secs(3)))?;
            probe::line_round_trip(&mut second, "b1").context("pod B's message (kernel path)")?;
            for i in 2..5 {
                probe::line_round_trip(&mut first, &format!("a{i}"))
                    .with_context(|| format!("pod A's message {i} after pod B's connection"))?;
            }
            let seen = peers.seen();
            let node1_masq = c.subnet_of(1).context("node1's subnet")?.network();
            ensure!(
                seen.len() == 2
                    && seen[0] == IpAddr::V4(a.ip())
                    && seen[1] == IpAddr::V4(node1_masq),
                "the server saw {seen:?}: pod A ({}) and then node1's flannel.1 address \
                 ({node1_masq}, pod B masqueraded) expected",
                a.ip()
            );
            let after = fastpath::counters(t.node(1).ns(), DEFAULT_HEALTHZ_PORT)?;
            let (b, a) = (&before.packets, &after.packets);
            let learnt = fastpath::grown(b, a, "tc_from_netdev", "learn_nat_guard");
            let passed = fastpath::grown(b, a, "tc_from_bridge", "pass_nat_reply");
            ensure!(
                learnt == 0 && passed == 0,
                "node1 learnt {learnt} NAT guards and passed {passed} packets as NAT replies; \
                 what moved: {}",
                fastpath::growth_text(b, a)
            );
            Ok(())
        },
    );
}

/// Connections a node's kernel path NATed must survive the fast path taking the node over
/// (a node moving from upstream flannel or from `--dataplane kernel`): the agent reads
/// conntrack before attaching and keeps them on the kernel path (`bpf::seed`). Both nodes run
/// the kernel path while a pod on node1 opens two connections to a pod on node2, both
/// masqueraded by node1's CNI bridge: one straight to the pod, one to a hostPort-style DNAT on
/// node2's `cni0` gateway. Then both agents restart with the fast path, and both connections
/// must go on: node1 must keep sending them through the kernel (masqueraded, else the server
/// resets what it does not know) and node2 the server's answers on the DNATed one (un-DNATed,
/// else the client resets an answer from the pod's own address).
#[test]
fn ebpf_taking_over_keeps_open_nated_connections() {
    require_root!();
    with_cluster(
        &named(EBPF, "take over NATed connections"),
        spec_on(EBPF, 2, Underlay::L2, "vxlan", 1),
        |c| {
            let server = c.topology().first_pod_on(2)?;
            let direct = SocketAddr::new(IpAddr::V4(server.ip()), 7100);
            let peers = probe::line_echo_server(server.ns(), direct, 2)?;
            let node1_masq = c.subnet_of(1).context("node1's subnet")?.network();
            let gateway = {
                let net = c.subnet_of(2).context("node2's subnet")?.network();
                std::net::Ipv4Addr::from(u32::from(net) + 1)
            };
            let host_port = SocketAddr::new(IpAddr::V4(gateway), 30080);
            c.topology().node(2).dnat_tcp(host_port, direct)?;
            for n in [1, 2] {
                restart_with(c, n, set_dataplane(Dataplane::Kernel))?;
            }
            let client = c.topology().first_pod_on(1)?;
            let connect = |to: SocketAddr| -> Result<std::net::TcpStream> {
                let stream = client
                    .ns()
                    .enter(move || std::net::TcpStream::connect(to))??;
                stream.set_read_timeout(Some(Duration::from_secs(3)))?;
                Ok(stream)
            };
            let mut to_pod = connect(direct)?;
            probe::line_round_trip(&mut to_pod, "p1").context("to the pod on the kernel path")?;
            let mut to_host_port = connect(host_port)?;
            probe::line_round_trip(&mut to_host_port, "h1")
                .context("to the hostPort on the kernel path")?;
            let seen = peers.seen();
            ensure!(
                seen == [IpAddr::V4(node1_masq); 2],
                "the server saw {seen:?}: node1's flannel.1 address ({node1_masq}) twice \
                 expected (both connections masqueraded by node1's CNI bridge)"
            );
            for n in [1, 2] {
                restart_with(c, n, set_dataplane(Dataplane::Ebpf))?;
            }
            c.wait_pod_ports(CONVERGE)?;
            let t = c.topology();
            let before = [1, 2].map(|n| fastpath::counters(t.node(n).ns(), DEFAULT_HEALTHZ_PORT));
            for i in 2..5 {
                probe::line_round_trip(&mut to_pod, &format!("p{i}")).with_context(|| {
                    format!("message {i} to the pod after the fast path took over")
                })?;
                probe::line_round_trip(&mut to_host_port, &format!("h{i}")).with_context(|| {
                    format!("message {i} to the hostPort after the fast path took over")
                })?;
            }
            let after = [1, 2].map(|n| fastpath::counters(t.node(n).ns(), DEFAULT_HEALTHZ_PORT));
            let [Ok(b1), Ok(b2)] = before else {
                bail!("reading the counters before: {before:?}")
            };
            let [Ok(a1), Ok(a2)] = after else {
                bail!("reading the counters after: {after:?}")
            };
            let kept = fastpath::grown(
                &b1.packets,
                &a1.packets,
                "tc_from_bridge",
                "pass_kernel_flow",
            );
            let guarded =
                fastpath::grown(&b2.packets, &a2.packets, "tc_from_bridge", "pass_nat_reply");
            ensure!(
                kept >= 6 && guarded >= 3,
                "node1 passed {kept} of the client's packets as kernel flows (6 or more \
                 expected) and node2 {guarded} of the server's as NAT replies (3 or more); \
                 node1: {}; node2: {}",
                fastpath::growth_text(&b1.packets, &a1.packets),
                fastpath::growth_text(&b2.packets, &a2.packets)
            );
            // What each agent says it kept: node1 both connections' outgoing keys, node2 the
            // hostPort client's endpoint.
            let kept_metric = |n: usize, kind: &str| {
                status::metric_sum(
                    t.node(n).ns(),
                    DEFAULT_HEALTHZ_PORT,
                    "flannel_fastpath_conntrack_kept_total",
                    &format!("kind=\"{kind}\""),
                )
            };
            let (flows1, guards2) = (kept_metric(1, "kernel_flow")?, kept_metric(2, "nat_guard")?);
            ensure!(
                flows1 >= 2.0 && guards2 >= 1.0,
                "node1 reports {flows1} kernel flows kept (2 expected), node2 {guards2} NAT \
                 guards (1 expected)"
            );
            Ok(())
        },
    );
}

/// The way back: node1 moves from the fast path to the kernel path (`--dataplane kernel`)
/// while a pod's TCP connection to a pod on node2 is open, without `--ip-masq` (the CNI bridge
/// masquerades what crosses netfilter). Before detaching, the agent enters the programs'
/// flows into conntrack as established connections without NAT (`bpf::handover`), so the
/// masquerade does not apply to the connection when the kernel path takes it over: its next
/// three messages come back, and node1's conntrack holds it unmasqueraded. Without the
/// handover the first of them is reset.
#[test]
fn ebpf_moving_back_to_the_kernel_path_keeps_pod_connections() {
    require_root!();
    moving_back("", |_| {});
}

/// The same with the programs attached as `clsact` filters (kernels before 6.6), which the
/// agent finds through its filters instead of pinned links.
#[test]
fn ebpf_moving_back_from_clsact_filters_keeps_pod_connections() {
    require_root!();
    moving_back("--tc-attach=clsact", |spec| {
        spec.agent_args.push("--tc-attach=clsact".into());
    });
}

/// What `deploy/kube-flannel.yml` promises: with only the capabilities its DaemonSet adds
/// (NET_ADMIN, NET_RAW, BPF, PERFMON: no SYS_ADMIN), read from the manifest, the agents load,
/// attach and pin the fast path (`--dataplane=ebpf` exits otherwise), a restarted agent adopts
/// it without a gap, and the way back to the kernel path hands a pod's connection over, all
/// without a warning in the agents' logs. The handover used to find the programs' flow memos
/// by program and map ID, which only SYS_ADMIN may open: it entered none into conntrack, and
/// the connection was reset after the move.
#[test]
fn ebpf_the_daemonsets_capabilities_run_the_fast_path_and_its_way_back() {
    require_root!();
    let caps = agent_support::daemonset_capabilities().unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        !caps.iter().any(|c| c == "SYS_ADMIN"),
        "the manifest adds SYS_ADMIN: {caps:?}"
    );
    moving_back("with the DaemonSet's capabilities", |spec| {
        spec.agent_capabilities = Some(caps);
    });
}

/// The DaemonSet's capabilities (as above) on the other fast-path backends, with the
/// masquerade in eBPF as `kube-flannel.yml` runs it (`--ip-masq`): host-gw, and IPIP (whose
/// agent also opens a raw socket for IPIP packets a router fragmented, and has no kernel
/// device to fall back on). Every pod reaches every pod, a pod's connection to the outside
/// (the hub) leaves with its node's address through the programs' SNAT, and no agent logs a
/// warning or an error.
#[test]
fn ebpf_the_daemonsets_capabilities_run_host_gw_and_ipip_with_masquerade() {
    require_root!();
    let caps = agent_support::daemonset_capabilities().unwrap_or_else(|e| panic!("{e:#}"));
    for backend in ["host-gw", "ipip"] {
        let path = Path::of_backend(backend);
        let p = move |_: usize, _: usize| path;
        let mut spec = spec_on(EBPF, 2, Underlay::L2, backend, 1);
        spec.ip_masq = true;
        spec.agent_capabilities = Some(caps.clone());
        let name = format!("{backend}/l2 with the DaemonSet's capabilities");
        with_cluster(&named(EBPF, &name), spec, |c| {
            reachable_everywhere(c, &p, &[(1, 2)])?;
            let before = agent_support::counters(c, 1)?;
            let outside = SocketAddr::new(IpAddr::V4(c.topology().hub_addr()), 7200);
            let peers = probe::line_echo_server(c.topology().hub(), outside, 1)?;
            let mut stream = c
                .topology()
                .first_pod_on(1)?
                .ns()
                .enter(move || std::net::TcpStream::connect(outside))??;
            stream.set_read_timeout(Some(Duration::from_secs(3)))?;
            probe::line_round_trip(&mut stream, "to the outside")?;
            let node1 = IpAddr::V4(c.topology().node(1).addr());
            let seen = peers.seen();
            ensure!(
                seen == [node1],
                "the outside saw {seen:?}, not node1 ({node1})"
            );
            let after = agent_support::counters(c, 1)?;
            let snat =
                fastpath::grown(&before.packets, &after.packets, "tc_to_netdev", "fast_snat");
            ensure!(
                snat > 0,
                "node1's programs translated none of the connection's packets"
            );
            no_complaints(c)
        });
    }
}

/// No agent of the cluster logged a warning or an error: nothing it did was refused for want
/// of a capability, also in passing.
fn no_complaints(c: &Cluster) -> Result<()> {
    for n in 1..=c.topology().nodes().len() {
        let log = std::fs::read_to_string(c.topology().node(n).agent_log())?;
        let complaints: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        ensure!(
            complaints.is_empty(),
            "node{n}'s agent complained:\n{}",
            complaints.join("\n")
        );
    }
    Ok(())
}

/// [`ebpf_moving_back_to_the_kernel_path_keeps_pod_connections`] on a cluster that `change`
/// makes differ; with [`ClusterSpec::agent_capabilities`], an agent restart under traffic
/// first (it must lose nothing), and no warning or error in the agents' logs at the end.
fn moving_back(what: &str, change: impl FnOnce(&mut ClusterSpec)) {
    let mut spec = spec_on(EBPF, 2, Underlay::L2, "vxlan", 1);
    change(&mut spec);
    let restricted = spec.agent_capabilities.is_some();
    with_cluster(
        &named(EBPF, &format!("back to the kernel path {what}")),
        spec,
        |c| {
            if restricted {
                let path = Path::of_backend("vxlan");
                scenarios::restart_is_hitless(c, &move |_: usize, _: usize| path, 1, 2)?;
            }
            let (server_ip, client_ip) = {
                let t = c.topology();
                (t.first_pod_on(2)?.ip(), t.first_pod_on(1)?.ip())
            };
            let addr = SocketAddr::new(IpAddr::V4(server_ip), 7100);
            let peers = probe::line_echo_server(c.topology().first_pod_on(2)?.ns(), addr, 1)?;
            let mut stream = c
                .topology()
                .first_pod_on(1)?
                .ns()
                .enter(move || std::net::TcpStream::connect(addr))??;
            stream.set_read_timeout(Some(Duration::from_secs(3)))?;
            probe::line_round_trip(&mut stream, "m1").context("on the fast path")?;
            restart_with(c, 1, set_dataplane(Dataplane::Kernel))?;
            fastpath::expect_path(c.topology().node(1).ns(), DEFAULT_HEALTHZ_PORT, "kernel")?;
            for i in 2..5 {
                probe::line_round_trip(&mut stream, &format!("m{i}"))
                    .with_context(|| format!("message {i} after the move to the kernel path"))?;
            }
            let seen = peers.seen();
            ensure!(seen == [IpAddr::V4(client_ip)], "the server saw {seen:?}");
            let table = c
                .topology()
                .node(1)
                .run(&["cat", "/proc/net/nf_conntrack"])?;
            let local = format!("src={client_ip} dst={server_ip} ");
            let entry = table
                .lines()
                .find(|l| l.contains(&local) && l.contains("dport=7100"))
                .with_context(|| {
                    format!("no conntrack entry for the connection on node1: {table}")
                })?;
            ensure!(
                entry.contains(&format!("src={server_ip} dst={client_ip} "))
                    && entry.contains("ESTABLISHED"),
                "node1's conntrack entry is not the connection unmasqueraded and established: \
                 {entry}"
            );
            if restricted {
                no_complaints(c)?;
            }
            Ok(())
        },
    );
}

/// A DNS-like UDP flow through a Service whose kernel-flow entry is lost from the table (as the
/// LRU evicts one on a node whose short flows fill it) comes back from conntrack within a
/// resync (`--ebpf-conntrack-resync`), without a packet of the flow to learn it from:
/// otherwise the backend's next answer would reach the pod with its own address instead of
/// the Service's. Such a flow (one query answered, not yet a stream) is not held, so the
/// resync's rewrite of the LRU table is what keeps it. The flow (a pod on node1, a connected
/// UDP socket, to a ClusterIP-style DNAT to a UDP echo on a pod on node2, with `--ip-masq`) is
/// idle while its entry is removed and while it comes back; the agent counts it as kept, and
/// the next queries are answered from the Service's address (the connected socket takes
/// nothing else).
#[test]
fn ebpf_lost_kernel_flows_come_back_from_conntrack() {
    require_root!();
    let mut spec = spec_on(EBPF, 2, Underlay::L2, "host-gw", 1);
    // As kube-flannel.yml runs it: pod-to-pod traffic keeps its addresses (the CNI bridge
    // does not masquerade), so the Service's answers need conntrack on the way back.
    spec.ip_masq = true;
    spec.agent_args.push("--ebpf-conntrack-resync=1".into());
    with_cluster(
        &named(EBPF, "kernel flows resynced from conntrack"),
        spec,
        |c| {
            let t = c.topology();
            let (client, server) = (t.first_pod_on(1)?, t.first_pod_on(2)?);
            let echo = probe::UdpEcho::start(server.ns(), IpAddr::V4(server.ip()), 7100)?;
            let service = SocketAddr::new("10.96.0.10".parse()?, 53);
            t.node(1).dnat_udp(service, echo.addr())?;
            let client_udp = probe::UdpClient::connect(client.ns(), service)?;
            let local_port = client_udp.port()?.to_be_bytes();
            client_udp.echo("q1").context("through the Service")?;
            let pins = t.node(1).bpf_pin_path();
            let ours = |k: &flannel_common::flow::FlowKey| {
                k.local_addr == client.ip().octets()
                    && k.remote_addr == server.ip().octets()
                    && k.local_port == local_port
                    && k.remote_port == 7100u16.to_be_bytes()
                    && k.proto == 17
            };
            let node1 = t.node(1).ns();
            let after =
                fastpath::kernel_flow_comes_back(node1, DEFAULT_HEALTHZ_PORT, pins, ours, CONVERGE)
                    .context("node1")?;
            for i in 2..5 {
                client_udp
                    .echo(&format!("q{i}"))
                    .context("through the Service")?;
            }
            // Later resyncs find the entry there: refreshed, not counted again.
            std::thread::sleep(Duration::from_millis(2500));
            let later = status::metric_sum(
                node1,
                DEFAULT_HEALTHZ_PORT,
                "flannel_fastpath_conntrack_kept_total",
                "kind=\"kernel_flow\"",
            )?;
            ensure!(
                later == after,
                "node1 counted {after} then {later} kernel flows kept: the resyncs re-added an \
                 entry that was there"
            );
            ensure!(
                fastpath::kernel_flows(pins)?.iter().any(ours),
                "the flow's entry is gone again"
            );
            Ok(())
        },
    );
}

/// A Service connection whose kernel-flow entry the LRU evicts stays on the kernel path with
/// no resync to put it back: node1's agent read conntrack when it started (a restart here,
/// as an upgrade from a build without the held tables: their pins removed while it was down;
/// the programs stay) and held the connection's key in `FLANNEL_HFLOWS4`, which no eviction
/// touches. With `--ebpf-conntrack-resync` at an hour, the backend pushes a line to the idle
/// client after the LRU entry is gone: the client gets it through the Service (conntrack
/// un-DNATs it). (Without the held table the push reached the pod with the backend's address
/// and the connection was lost.) The `held` entries gauge counts the key. The agent that
/// starts asks for held tables of 1,000 connections (`--ebpf-held-max-entries`): they are
/// created at that size, the guards a quarter, and its log says so.
#[test]
fn ebpf_held_service_connection_survives_an_eviction_without_a_resync() {
    use std::io::Write as _;
    require_root!();
    with_cluster(
        &named(EBPF, "held kernel flows"),
        hourly_resync_spec(),
        |c| {
            let t = c.topology();
            let server = t.first_pod_on(2)?;
            let backend = SocketAddr::new(IpAddr::V4(server.ip()), 7100);
            let listener = server
                .ns()
                .enter(move || std::net::TcpListener::bind(backend))??;
            let (stream, key) = connect_through_service(t, backend)?;
            let (mut pusher, _) = listener.accept()?;
            let mut lines = std::io::BufReader::new(stream);
            let mut push = |text: &str| -> Result<()> {
                pusher.write_all(format!("{text}\n").as_bytes())?;
                let mut line = String::new();
                std::io::BufRead::read_line(&mut lines, &mut line)
                    .with_context(|| format!("{text:?} pushed through the Service"))?;
                ensure!(line == format!("{text}\n"), "read {line:?}");
                Ok(())
            };
            push("before")?;
            let pins = t.node(1).bpf_pin_path().to_path_buf();
            let ours = |k: &flannel_common::flow::FlowKey| *k == key;
            // As after an upgrade from a build without the held tables: node1's agent stops and
            // their pins go (the programs keep theirs); the agent that starts creates them.
            c.agent_mut(1)
                .context("agent")?
                .stop(Duration::from_secs(10))?;
            let layout = pins.join(flannel_common::maps::PIN_LAYOUT_VERSION);
            for name in [
                flannel_common::maps::HELD_FLOWS4,
                flannel_common::maps::HELD_GUARD4,
                flannel_common::v6::HELD_FLOWS6,
                flannel_common::v6::HELD_GUARD6,
                flannel_common::maps::HELD_COUNT,
            ] {
                std::fs::remove_file(layout.join(name))
                    .with_context(|| format!("unpinning {name}"))?;
            }
            // It starts with held tables of the size asked for.
            restart_with(c, 1, |args| {
                args.push("--ebpf-held-max-entries=1000".into())
            })?;
            let log_path = c.agent_mut(1).context("agent")?.log_path().to_owned();
            let node1 = c.topology().node(1).ns();
            wait::until_ok(CONVERGE, "node1 holding the connection", || {
                let held = fastpath::held_kernel_flows(&pins)?;
                ensure!(held.iter().any(ours), "held: {held:?}");
                Ok(())
            })?;
            for (name, size) in [
                (flannel_common::maps::HELD_FLOWS4, 1000),
                (flannel_common::maps::HELD_GUARD4, 250),
                (flannel_common::v6::HELD_FLOWS6, 1000),
            ] {
                let info = aya::maps::MapInfo::from_pin(layout.join(name))?;
                ensure!(
                    info.max_entries() == size,
                    "{name} holds {}",
                    info.max_entries()
                );
            }
            let log = std::fs::read_to_string(&log_path)?;
            let sized = "held flow tables: 1000 connections and 250 hostPort guards per family, set \
                     by --ebpf-held-max-entries";
            ensure!(
                log.contains(sized),
                "node1's log does not say how the held tables are sized"
            );
            let gauge = status::metric_sum(
                node1,
                DEFAULT_HEALTHZ_PORT,
                "flannel_bpf_map_entries",
                "kind=\"held\"",
            )?;
            ensure!(gauge >= 1.0, "node1's held entries gauge says {gauge}");
            // Idle, then evicted.
            std::thread::sleep(Duration::from_millis(300));
            let evicted = fastpath::clear_kernel_flows::<flannel_common::flow::FlowKey>(&pins)?;
            ensure!(evicted >= 1, "node1's kernel-flow table was empty");
            for i in 0..3 {
                push(&format!("after the eviction {i}"))?;
            }
            Ok(())
        },
    );
}

/// A Service connection opened after node1's agent started, on a node whose programs then
/// learn a burst of short flows (40,000 DNS-like UDP flows through a Service, more than half
/// the kernel-flow LRU table), is held long before the resync's period (an hour here) comes:
/// the learning calls for an early read of conntrack
/// (`flannel_fastpath_conntrack_resyncs_total{kind="learning"}`), which holds the connection,
/// so the burst's entries cannot evict it from the kernel path. (Without the early read it
/// stayed unheld for the hour, open to eviction by the next burst.)
#[test]
fn ebpf_a_burst_of_learnt_flows_brings_the_next_conntrack_read_forward() {
    require_root!();
    with_cluster(
        &named(EBPF, "early conntrack read"),
        hourly_resync_spec(),
        |c| {
            let t = c.topology();
            let (client, server) = (t.first_pod_on(1)?, t.first_pod_on(2)?);
            let server_ip = server.ip();
            let backend = SocketAddr::new(IpAddr::V4(server_ip), 7100);
            probe::line_echo_server(server.ns(), backend, 1)?;
            let (mut stream, key) = connect_through_service(t, backend)?;
            probe::line_round_trip(&mut stream, "before").context("through the Service")?;
            let pins = t.node(1).bpf_pin_path();
            let node1 = t.node(1).ns();
            let ours = |k: &flannel_common::flow::FlowKey| *k == key;
            let held =
                || -> Result<bool> { Ok(fastpath::held_kernel_flows(pins)?.iter().any(ours)) };
            std::thread::sleep(Duration::from_secs(2));
            ensure!(
                !held()?,
                "the connection is held before any read could have seen it"
            );
            // The burst: one datagram from each of 40,000 ports to a DNS Service on node2's pod.
            let dns = SocketAddr::new("10.96.0.11".parse()?, 53);
            t.node(1)
                .dnat_udp(dns, SocketAddr::new(IpAddr::V4(server_ip), 5353))?;
            client.ns().enter(move || -> std::io::Result<()> {
                for port in 20_000..60_000u16 {
                    let s = std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, port))?;
                    s.send_to(b"q", dns)?;
                }
                Ok(())
            })??;
            wait::until_ok(
                Duration::from_secs(20),
                "node1 holding the connection",
                || {
                    ensure!(held()?, "not held");
                    Ok(())
                },
            )?;
            let early = status::metric_sum(
                node1,
                DEFAULT_HEALTHZ_PORT,
                "flannel_fastpath_conntrack_resyncs_total",
                "kind=\"learning\"",
            )?;
            ensure!(early >= 1.0, "node1 reports {early} early reads");
            probe::line_round_trip(&mut stream, "after").context("through the Service")?;
            Ok(())
        },
    );
}

/// Two host-gw nodes on the fast path with `--ip-masq` (pod-to-pod traffic keeps its
/// addresses, so a Service's answers need conntrack on the way back) and a resync of the flow
/// tables from conntrack only every hour, so that nothing but the start-up read, the held
/// tables and an early read keeps a connection on the kernel path.
fn hourly_resync_spec() -> ClusterSpec {
    let mut spec = spec_on(EBPF, 2, Underlay::L2, "host-gw", 1);
    spec.ip_masq = true;
    spec.agent_args.push("--ebpf-conntrack-resync=3600".into());
    spec
}

/// Connects node1's first pod to `backend` (a pod on another node) through a ClusterIP-style
/// DNAT on node1 (10.96.0.10:80, as kube-proxy's): the stream (3 s read timeout) and the
/// connection's kernel-flow key as node1's programs learn it and its agent holds it.
fn connect_through_service(
    t: &Topology,
    backend: SocketAddr,
) -> Result<(std::net::TcpStream, flannel_common::flow::FlowKey)> {
    let client = t.first_pod_on(1)?;
    let IpAddr::V4(backend_ip) = backend.ip() else {
        bail!("IPv4 only")
    };
    let service = SocketAddr::new("10.96.0.10".parse()?, 80);
    t.node(1).dnat_tcp(service, backend)?;
    let stream = client
        .ns()
        .enter(move || std::net::TcpStream::connect(service))??;
    stream.set_read_timeout(Some(Duration::from_secs(3)))?;
    let key = flannel_common::flow::FlowKey {
        local_addr: client.ip().octets(),
        remote_addr: backend_ip.octets(),
        local_port: stream.local_addr()?.port().to_be_bytes(),
        remote_port: backend.port().to_be_bytes(),
        proto: 6,
        _pad: [0; 3],
    };
    Ok((stream, key))
}

/// A TCP connection to `addr` whose every packet carries IP options (three NOPs and an end of
/// list), which the fast path leaves to the kernel.
fn connect_with_ip_options(addr: SocketAddr) -> Result<std::net::TcpStream> {
    use std::os::fd::FromRawFd as _;
    let SocketAddr::V4(v4) = addr else {
        bail!("IPv4 only")
    };
    // SAFETY: plain socket calls on a descriptor this function owns until it is wrapped.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let stream = std::net::TcpStream::from_raw_fd(fd);
        let options: [u8; 4] = [1, 1, 1, 0];
        let rc = libc::setsockopt(
            fd,
            libc::IPPROTO_IP,
            libc::IP_OPTIONS,
            options.as_ptr().cast(),
            options.len() as libc::socklen_t,
        );
        ensure!(rc == 0, "IP_OPTIONS: {}", std::io::Error::last_os_error());
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: v4.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*v4.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let rc = libc::connect(
            fd,
            (&raw const sin).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        ensure!(
            rc == 0,
            "connect {addr}: {}",
            std::io::Error::last_os_error()
        );
        Ok(stream)
    }
}

#[test]
fn ebpf_direct_routing_over_mixed_underlay() {
    require_root!();
    connectivity(EBPF, "vxlan", Underlay::Mixed);
}

/// Connectivity over L2, then restart, etcd outage and a node leaving on the same cluster.
fn lifecycle(backend: &str) {
    let path = Path::of_backend(backend);
    let p = move |_: usize, _: usize| path;
    with_cluster(
        &named(EBPF, &format!("{backend}/l2 lifecycle")),
        spec_on(EBPF, 3, Underlay::L2, backend, 2),
        |c| {
            eprintln!("--- connectivity");
            reachable_everywhere(c, &p, &[(1, 3), (3, 2)])?;
            eprintln!("--- restart of node1's agent");
            scenarios::restart_is_hitless(c, &p, 1, 2)?;
            eprintln!("--- etcd outage");
            scenarios::etcd_outage_is_ridden_out(c, &p, 2, 1)?;
            eprintln!("--- node3 leaves");
            scenarios::node_leaves(c, &p, 3)
        },
    );
}

/// An agent that crashes (SIGKILL), also at any point of its start, leaves a dataplane that
/// forwards, and the next agent adopts it: under traffic between node1's pod and node2's,
/// node1's agent is killed, then started and killed again at each step of its start (50 ms
/// in, while it takes its lease; as soon as it logs that its programs are loaded, before it
/// swaps them in; that the held tables are sized; that the fast path is active; that it
/// wrote subnet.env; that it is ready; that it follows the pod bridge's ports, whose programs
/// it swaps next), then started for good. Nothing is lost, the pinned maps and links are the ones from before (same ids),
/// and the last agent becomes ready with the kernel state as it was.
#[test]
fn ebpf_an_agent_killed_while_it_starts_leaves_forwarding_alone() {
    require_root!();
    let path = Path::of_backend("vxlan");
    let p = move |_: usize, _: usize| path;
    with_cluster(
        &named(EBPF, "vxlan/l2 agent killed while it starts"),
        spec_on(EBPF, 2, Underlay::L2, "vxlan", 1),
        |c| {
            scenarios::converged(c, &p)?;
            let pins = c.topology().node(1).bpf_pin_path().to_owned();
            let log_path = c.topology().node(1).agent_log();
            let ids_before = fastpath::pin_ids(&pins)?;
            let state_before = c.kernel_state(1)?;
            let traffic = scenarios::Undisturbed::start(c, 2, 1)?;
            std::thread::sleep(Duration::from_secs(1));
            c.agent_mut(1).context("agent")?.kill()?;
            let steps = [
                None,
                Some("eBPF programs loaded"),
                Some("held flow tables:"),
                Some("eBPF fast path active"),
                Some("Wrote subnet file"),
                Some("flannel is ready"),
                Some("fast path following the pod bridge's ports"),
            ];
            for step in steps {
                let logged = || -> Result<usize> {
                    let log = std::fs::read_to_string(&log_path)?;
                    Ok(step.map_or(0, |s| agent_support::count_lines(&log, s)))
                };
                let before = logged()?;
                let agent = c.agent_mut(1).context("agent")?;
                agent.restart()?;
                match step {
                    None => std::thread::sleep(Duration::from_millis(50)),
                    Some(line) => {
                        let started = std::time::Instant::now();
                        while logged()? == before {
                            ensure!(
                                started.elapsed() < Duration::from_secs(20),
                                "the agent never logged {line:?}"
                            );
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                }
                agent.kill()?;
                eprintln!("killed at {}", step.unwrap_or("50 ms"));
            }
            c.agent_mut(1).context("agent")?.restart()?;
            c.wait_ready(Duration::from_secs(30))?;
            std::thread::sleep(Duration::from_secs(2));
            traffic.finish("across the crashes", 300)?;
            let ids_after = fastpath::pin_ids(&pins)?;
            ensure!(
                ids_after.maps == ids_before.maps && ids_after.links == ids_before.links,
                "the pins were not adopted: {ids_before:?} -> {ids_after:?}"
            );
            let state_after = c.kernel_state(1)?;
            ensure!(
                state_after == state_before,
                "kernel state changed:\nbefore\n{state_before}after\n{state_after}"
            );
            scenarios::converged(c, &p)
        },
    );
}

#[test]
fn ebpf_host_gw_lifecycle() {
    require_root!();
    lifecycle("host-gw");
}

#[test]
fn ebpf_vxlan_lifecycle() {
    require_root!();
    lifecycle("vxlan");
}

#[test]
fn ebpf_ipip_lifecycle() {
    require_root!();
    lifecycle("ipip");
}

/// Node `n`'s filters at the agent's priority and handle on `dev`'s `dir` hook (`ingress` or
/// `egress`), as (program name, program id), from `tc filter show`.
fn our_filters(c: &Cluster, n: usize, dev: &str, dir: &str) -> Result<Vec<(String, u32)>> {
    let text = c
        .topology()
        .node(n)
        .ns()
        .run(&["tc", "filter", "show", "dev", dev, dir])?;
    let pref = format!("pref {} ", tcfilter::PRIORITY);
    Ok(text
        .lines()
        .filter(|l| l.contains(&pref) && l.contains(" handle 0x1 "))
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let name = words.clone().skip_while(|w| *w != "name").nth(1)?;
            let id = words.by_ref().skip_while(|w| *w != "id").nth(1)?;
            Some((name.to_owned(), id.parse().ok()?))
        })
        .collect())
}

/// Node `n`'s pod bridge ports.
fn bridge_ports(c: &Cluster, n: usize) -> Result<Vec<String>> {
    let text = c
        .topology()
        .node(n)
        .ns()
        .run(&["ip", "-o", "link", "show", "master", "cni0"])?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let name = l.split(": ").nth(1)?;
            Some(name.split('@').next()?.to_owned())
        })
        .collect())
}

/// Every hook of node `n` carries exactly one filter of ours, running its program: (hook,
/// program id) by interface and direction. Errors name the hook that does not.
fn filters_in_place(c: &Cluster, n: usize) -> Result<BTreeMap<String, u32>> {
    let mut hooks = vec![
        ("eth0".to_owned(), "ingress", "tc_from_netdev"),
        ("eth0".to_owned(), "egress", "tc_to_netdev"),
    ];
    let ports = bridge_ports(c, n)?;
    ensure!(!ports.is_empty(), "node{n} has no bridge ports");
    hooks.extend(ports.into_iter().map(|p| (p, "ingress", "tc_from_bridge")));
    let mut ids = BTreeMap::new();
    for (dev, dir, program) in hooks {
        let found = our_filters(c, n, &dev, dir)?;
        ensure!(
            found.len() == 1 && found[0].0 == program,
            "node{n} {dev} {dir}: want one filter running {program}, found {found:?}"
        );
        ids.insert(format!("{dev} {dir}"), found[0].1);
    }
    Ok(ids)
}

/// No filter of ours on any hook of node `n`.
fn no_filters(c: &Cluster, n: usize) -> Result<()> {
    let mut devs = bridge_ports(c, n)?;
    devs.push("eth0".into());
    for dev in devs {
        for dir in ["ingress", "egress"] {
            let found = our_filters(c, n, &dev, dir)?;
            ensure!(
                found.is_empty(),
                "node{n} {dev} {dir}: filters left {found:?}"
            );
        }
    }
    Ok(())
}

/// A flag change for [`restart_with`]: `--dataplane=<dataplane>` in place of the current one.
fn set_dataplane(dataplane: Dataplane) -> impl FnOnce(&mut Vec<String>) {
    move |args| {
        args.retain(|a| !a.starts_with("--dataplane"));
        args.push(format!("--dataplane={dataplane}"));
    }
}

/// Restarts node `n`'s agent with its flags changed by `change`, and waits for `/readyz`.
fn restart_with(c: &mut Cluster, n: usize, change: impl FnOnce(&mut Vec<String>)) -> Result<()> {
    c.agent_mut(n).context("agent")?.restart_with(change)?;
    c.wait_ready(Duration::from_secs(30))
}

/// The fast path attached as `clsact` filters (`--tc-attach=clsact`, what kernels without TCX
/// links get): host-gw connectivity with every packet counted by the programs, one filter per
/// hook at the agent's priority and no TCX link pinned; an agent restart under traffic that
/// loses nothing (the filters stay while the agent is down and the new agent swaps its
/// programs in behind them); then switching node1 to TCX links (its filters removed), back to
/// filters (its links removed), and to `--dataplane=kernel` (its filters removed), with the
/// pods reachable after each switch.
#[test]
fn ebpf_host_gw_on_clsact_filters() {
    require_root!();
    let path = Path::of_backend("host-gw");
    let p = move |_: usize, _: usize| path;
    let mut spec = spec_on(EBPF, 3, Underlay::L2, "host-gw", 2);
    spec.agent_args.push("--tc-attach=clsact".into());
    with_cluster(&named(EBPF, "host-gw/l2 clsact"), spec, |c| {
        eprintln!("--- connectivity on filters");
        reachable_everywhere(c, &p, &[(1, 3)])?;
        let mut before = BTreeMap::new();
        for n in 1..=3 {
            before.insert(n, filters_in_place(c, n)?);
            let pins = fastpath::pin_ids(c.topology().node(n).bpf_pin_path())?;
            ensure!(
                pins.links.is_empty(),
                "node{n} pinned links: {:?}",
                pins.links
            );
        }
        eprintln!("--- restart of node1's agent");
        scenarios::restart_is_hitless(c, &p, 1, 2)?;
        // The pod bridge's ports are attached by the agent's port follower, which may finish
        // after `/readyz`: each switch below is awaited, not sampled once.
        let settle = Duration::from_secs(10);
        wait::until_ok(
            settle,
            "node1's programs swapped in behind its filters",
            || {
                let after = filters_in_place(c, 1)?;
                for (hook, id) in &before[&1] {
                    ensure!(
                        after.get(hook).is_some_and(|new| new != id),
                        "the restarted agent did not swap its program in at {hook}: {:?} -> {after:?}",
                        before[&1]
                    );
                }
                Ok(())
            },
        )?;
        eprintln!("--- node1 to TCX links");
        restart_with(c, 1, |args| args.retain(|a| a != "--tc-attach=clsact"))?;
        wait::until_ok(settle, "node1 on TCX links, its filters gone", || {
            no_filters(c, 1)?;
            let links = fastpath::pin_ids(c.topology().node(1).bpf_pin_path())?.links;
            ensure!(
                links.len() == 2 + bridge_ports(c, 1)?.len(),
                "node1's TCX links: {links:?}"
            );
            Ok(())
        })?;
        reachable_everywhere(c, &p, &[])?;
        eprintln!("--- node1 back to filters");
        restart_with(c, 1, |args| args.push("--tc-attach=clsact".into()))?;
        wait::until_ok(settle, "node1 on filters, its TCX links gone", || {
            filters_in_place(c, 1)?;
            let links = fastpath::pin_ids(c.topology().node(1).bpf_pin_path())?.links;
            ensure!(links.is_empty(), "node1's TCX links left: {links:?}");
            Ok(())
        })?;
        reachable_everywhere(c, &p, &[])?;
        eprintln!("--- node1 to the kernel path");
        restart_with(c, 1, |args| {
            for a in args.iter_mut().filter(|a| a.starts_with("--dataplane=")) {
                *a = "--dataplane=kernel".into();
            }
        })?;
        wait::until_ok(settle, "node1's filters gone on the kernel path", || {
            no_filters(c, 1)
        })?;
        let matrix = c.matrix(PROBE)?;
        ensure!(matrix.all_ok(), "pods cannot reach each other:\n{matrix}");
        Ok(())
    });
}

/// Programs removed from their interfaces by something else while the agent runs come back
/// within `--resync-interval` (1 s here), as a route deleted by hand does: on TCX links
/// (`bpftool link detach` of each of node1's pinned links: eth0 both ways and the pod's port)
/// and on `clsact` filters (`tc qdisc del ... clsact` on eth0 and the pod's port, which takes
/// the filters with it). Each program runs again, once, on its hook and carries the pods'
/// traffic, and the agent logs each one it attached again. (They used to stay detached until
/// the agent's next start: traffic the programs masquerade then left untranslated.)
#[test]
fn ebpf_programs_detached_by_something_else_are_attached_again() {
    require_root!();
    for clsact in [false, true] {
        let path = Path::of_backend("host-gw");
        let p = move |_: usize, _: usize| path;
        let mut spec = spec_on(EBPF, 2, Underlay::L2, "host-gw", 1);
        spec.agent_args.push("--resync-interval=1".into());
        let mut name = "host-gw/l2, programs detached by hand".to_owned();
        if clsact {
            spec.agent_args.push("--tc-attach=clsact".into());
            name += " (clsact)";
        }
        with_cluster(&named(EBPF, &name), spec, |c| {
            reachable_everywhere(c, &p, &[])?;
            let node = c.topology().node(1);
            let ports = bridge_ports(c, 1)?;
            let devs: Vec<&str> = ports.iter().map(String::as_str).chain(["eth0"]).collect();
            if clsact {
                for dev in &devs {
                    node.ns()
                        .run(&["tc", "qdisc", "del", "dev", dev, "clsact"])?;
                }
            } else {
                // By id, all read first: the agent may pin new links at the same paths
                // before the last is detached.
                let links = fastpath::pin_ids(node.bpf_pin_path())?.links;
                ensure!(links.len() == devs.len() + 1, "node1's links: {links:?}");
                for id in links.values() {
                    node.ns()
                        .run(&["bpftool", "link", "detach", "id", &id.to_string()])?;
                }
            }
            wait::until_ok(
                Duration::from_secs(10),
                "node1's programs attached again",
                || {
                    if clsact {
                        return filters_in_place(c, 1).map(drop);
                    }
                    for dev in &devs {
                        let mut found = fastpath::tcx_programs(node.ns(), dev)?;
                        found.sort();
                        let want: &[&str] = if *dev == "eth0" {
                            &["tc_from_netdev", "tc_to_netdev"]
                        } else {
                            &["tc_from_bridge"]
                        };
                        ensure!(found == want, "node1 {dev}: TCX runs {found:?}");
                    }
                    Ok(())
                },
            )?;
            reachable_everywhere(c, &p, &[])?;
            let metrics = SocketAddr::new(
                IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
                DEFAULT_HEALTHZ_PORT,
            );
            let (_, body) = status::http_get(node.ns(), metrics, "/metrics")?;
            let counted: BTreeMap<String, f64> = status::parse_metrics(&body)
                .into_iter()
                .filter(|s| s.name == "flannel_fastpath_reattached_total")
                .map(|s| (s.labels, s.value))
                .collect();
            let want: BTreeMap<String, f64> = ["tc_from_bridge", "tc_from_netdev", "tc_to_netdev"]
                .into_iter()
                .map(|p| (format!("{{kind=\"{p}\"}}"), 1.0))
                .collect();
            ensure!(
                counted == want,
                "flannel_fastpath_reattached_total: {counted:?}"
            );
            let agent = c.agent_mut(1).context("agent")?;
            let log = std::fs::read_to_string(agent.log_path())?;
            let healed =
                agent_support::count_lines(&log, "detached by something else; attached again");
            let failed = agent_support::count_lines(&log, "attaching it again failed");
            ensure!(
                (healed, failed) == (3, 0),
                "node1's agent logged {healed} programs attached again, not 3, and {failed} \
                 failures:\n{}",
                agent.log_tail(30)
            );
            Ok(())
        });
    }
}

/// `eth0` deleted and created again under a running agent: the fast path follows it to its
/// new index as the kernel path does ([`scenarios::external_interface_recreated`]; host-gw
/// and VXLAN).
#[test]
fn ebpf_a_recreated_external_interface_is_followed() {
    require_root!();
    scenarios::on_host_gw_and_vxlan(
        EBPF,
        "eth0 re-created",
        scenarios::external_interface_recreated,
    );
}

/// `eth0` set down and up again under a running agent: the kernel entries and route map
/// entries of host-gw peers, gone while it was down, are back within seconds of it coming up
/// ([`scenarios::external_interface_down_and_up`]; host-gw and VXLAN).
#[test]
fn ebpf_an_external_interface_going_down_and_up_is_ridden_out() {
    require_root!();
    scenarios::on_host_gw_and_vxlan(
        EBPF,
        "eth0 down and up",
        scenarios::external_interface_down_and_up,
    );
}

/// Four nodes, kernel path on 1 and 3, fast path on 2 and 4: every pod reaches every pod,
/// and bulk transfers cross between the two kinds in both directions (and between two of
/// each kind). ipip is left out: it has no kernel path here.
fn mixed(backend: &str) {
    let mut spec = spec_on(Dataplane::Kernel, 4, Underlay::L2, backend, 2);
    spec.node_dataplanes = vec![
        Dataplane::Kernel,
        Dataplane::Ebpf,
        Dataplane::Kernel,
        Dataplane::Ebpf,
    ];
    let path = Path::of_backend(backend);
    with_cluster(&format!("mixed kernel/ebpf {backend}"), spec, |c| {
        reachable_everywhere(
            c,
            &|_, _| path,
            &[(1, 2), (2, 1), (3, 4), (4, 3), (2, 4), (1, 3)],
        )
    });
}

#[test]
fn mixed_dataplanes_vxlan() {
    require_root!();
    mixed("vxlan");
}

#[test]
fn mixed_dataplanes_host_gw() {
    require_root!();
    mixed("host-gw");
}

#[test]
fn ebpf_host_gw_service_dnat_to_a_remote_pod() {
    require_root!();
    scenarios::service_dnat_to_a_remote_pod(EBPF, "host-gw");
}

#[test]
fn ebpf_vxlan_service_dnat_to_a_remote_pod() {
    require_root!();
    scenarios::service_dnat_to_a_remote_pod(EBPF, "vxlan");
}

#[test]
fn ebpf_ipip_service_dnat_to_a_remote_pod() {
    require_root!();
    scenarios::service_dnat_to_a_remote_pod(EBPF, "ipip");
}

/// On the udp backend the Service flow is a kernel flow on node1, so the server pod's replies
/// reach node1's forwarder, their checksums unfinished by node2's veth underlay (finished by
/// the forwarder; before, every reply was dropped and no connection opened).
#[test]
fn ebpf_udp_service_dnat_to_a_remote_pod() {
    require_root!();
    scenarios::service_dnat_to_a_remote_pod(EBPF, "udp");
}

/// Route map entries deleted, then changed, by hand on node1 (no notification tells of
/// either) are written back within seconds, not at the next resync
/// ([`scenarios::map_entries_changed_by_hand_come_back`]; host-gw and VXLAN).
#[test]
fn ebpf_map_entries_changed_by_hand_come_back() {
    require_root!();
    scenarios::on_host_gw_and_vxlan(
        EBPF,
        "map entries changed by hand",
        scenarios::map_entries_changed_by_hand_come_back,
    );
}

/// The fast path loads while the lease is being taken, not after: with its Node's pod CIDR
/// not assigned yet (the agent waits for it, where upstream exits), the agent has loaded its
/// programs, and attached none, before it holds a lease; once the CIDR is assigned it writes
/// subnet.env and runs on the fast path, attached to eth0.
#[test]
fn ebpf_programs_load_while_the_lease_is_awaited() {
    require_root!();
    if let Err(e) = programs_load_while_the_lease_is_awaited() {
        panic!("{e:#}");
    }
}

fn programs_load_while_the_lease_is_awaited() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let topology =
        Topology::new(TopologySpec::new(1, Underlay::L2).cni_plugin(bins::test_cni_plugin()?))?;
    let api = kube::api_in_hub(&rt, &topology, &|_| Vec::new())?;
    let network: Ipv4Net = "10.244.0.0/16".parse()?;
    let netconf = json!({"Network": network.to_string(), "Backend": {"Type": "vxlan"}});
    let mut spec = AgentSpec::new(bins::test_agent()?, kube::NO_ETCD);
    spec.dataplane = Some(EBPF);
    let node = topology.node(1);
    let mut agent = Agent::start(node, &kube::agent_spec(node, &api, &netconf, &spec)?)?;
    let log_path = agent.log_path().to_owned();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let on_eth0 = || fastpath::tcx_programs(node.ns(), "eth0");
    let waiting = (|| -> Result<()> {
        wait::until(Duration::from_secs(30), "the programs loaded", || {
            agent.check_running()?;
            Ok(log().contains("eBPF programs loaded").then_some(()))
        })?;
        // Still without a pod CIDR: no lease, no subnet.env, nothing attached.
        std::thread::sleep(Duration::from_millis(500));
        ensure!(
            !log().contains("lease acquired"),
            "a lease without a pod CIDR"
        );
        ensure!(
            node.read_subnet_env()?.is_none(),
            "subnet.env without a lease"
        );
        let attached = on_eth0()?;
        ensure!(
            attached.is_empty(),
            "attached before the lease: {attached:?}"
        );
        Ok(())
    })();
    let result = waiting.and_then(|()| {
        api.modify_node(&node.name(), |n| {
            n["spec"] = json!({"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]});
        })
        .context("the Node is gone")?;
        let env = agent.wait_subnet_env(node, Duration::from_secs(30))?;
        let want = SubnetEnv::v4(network, "10.244.1.0/24".parse()?, 1450, false);
        ensure!(env == want, "subnet.env {env:?}, want {want:?}");
        let port = agent.healthz_port().unwrap_or(DEFAULT_HEALTHZ_PORT);
        wait::until_ok(CONVERGE, "the fast path active and attached", || {
            let path = fastpath::active_path(node.ns(), port)?;
            ensure!(path.as_deref() == Some("ebpf"), "dataplane path {path:?}");
            let attached = on_eth0()?;
            ensure!(
                attached.iter().any(|p| p == "tc_from_netdev"),
                "eth0: {attached:?}"
            );
            Ok(())
        })
    });
    if result.is_err() {
        eprintln!("--- agent log:\n{}", agent.log_tail(40));
    }
    result
}

/// The agents take their leases from a (fake) Kubernetes API server instead of etcd
/// (`--kube-subnet-mgr`): two nodes with pod CIDRs 10.244.1.0/24 and 10.244.2.0/24 in their
/// Node objects, vxlan, `--dataplane ebpf`. Each agent writes its pod CIDR to subnet.env,
/// publishes its public IP and VTEP MAC in its Node's annotations, programs exactly the
/// other node in its route map from those annotations, and the pods on the two nodes reach
/// each other through the programs (a bulk transfer each way, counted by both ends).
#[test]
fn ebpf_kube_mode_vxlan() {
    require_root!();
    if let Err(e) = kube_mode() {
        panic!("[ebpf kube mode] {e:#}");
    }
}

fn kube_mode() -> Result<()> {
    let cidr = |n: usize| -> Ipv4Net { format!("10.244.{n}.0/24").parse().expect("CIDR") };
    let network: Ipv4Net = "10.244.0.0/16".parse()?;
    kube::with_vxlan_pair(EBPF, |topology, api, agents| {
        kube_mode_checks(topology, api, agents, network, &cidr)
    })
}

fn kube_mode_checks(
    topology: &mut Topology,
    api: &MockApiServer,
    agents: &mut [Agent],
    network: Ipv4Net,
    cidr: &dyn Fn(usize) -> Ipv4Net,
) -> Result<()> {
    let start = std::time::Instant::now();
    let progress = |what: &str| eprintln!("[ebpf kube mode] {what} after {:?}", start.elapsed());
    for (node, agent) in topology.nodes().iter().zip(agents.iter_mut()) {
        let env = agent.wait_subnet_env(node, Duration::from_secs(60))?;
        let want = SubnetEnv::v4(network, cidr(node.index()), 1450, false);
        ensure!(
            env == want,
            "{}: subnet.env {env:?}, want {want:?}",
            node.name()
        );
    }
    progress("subnet.env written");
    // What each node published: its public IP and its VTEP MAC.
    let prefix = "flannel.alpha.coreos.com";
    let mut published = Vec::new();
    for node in topology.nodes() {
        let mac = wait::until(CONVERGE, &format!("{}'s annotations", node.name()), || {
            let obj = api.node(&node.name()).context("node gone")?;
            let ann = &obj["metadata"]["annotations"];
            ensure!(
                ann[format!("{prefix}/public-ip")] == node.addr().to_string().as_str()
                    && ann[format!("{prefix}/backend-type")] == "vxlan",
                "annotations {ann}"
            );
            let data: serde_json::Value = serde_json::from_str(
                ann[format!("{prefix}/backend-data")]
                    .as_str()
                    .context("no backend-data")?,
            )?;
            ensure!(data["VNI"] == 1, "backend-data {data}");
            let mac = data["VtepMAC"].as_str().context("no VtepMAC")?.to_owned();
            ensure!(
                mac.eq_ignore_ascii_case(&link_mac(node.ns(), "flannel.1")?),
                "VtepMAC {mac} is not flannel.1's"
            );
            Ok(Some(mac))
        })?;
        published.push((node.index(), node.addr(), mac));
    }
    progress("annotations published");
    // Each node's route map holds exactly the other node, and it runs the eBPF path.
    for node in topology.nodes() {
        let want: BTreeMap<Ipv4Net, Route> = published
            .iter()
            .filter(|(m, ..)| *m != node.index())
            .map(|(m, ip, mac)| (cidr(*m), Route::vxlan(*ip, 1, mac)))
            .collect();
        wait::until(CONVERGE, &format!("{}'s route map", node.name()), || {
            let got = fastpath::routes(node.bpf_pin_path())?;
            ensure!(
                got == want,
                "holds\n{}want\n{}",
                routes_text(&got),
                routes_text(&want)
            );
            Ok(Some(()))
        })?;
        let path = fastpath::active_path(node.ns(), DEFAULT_HEALTHZ_PORT)?;
        ensure!(
            path.as_deref() == Some("ebpf"),
            "{} reports dataplane path {path:?}",
            node.name()
        );
    }
    progress("route maps programmed");
    // One pod per node through CNI; they talk, through the programs.
    for n in 1..=2 {
        let pod = topology.add_pod(n)?;
        ensure!(
            cidr(n).contains(&pod.ip()),
            "pod {} got {} outside {}",
            pod.name(),
            pod.ip(),
            cidr(n)
        );
    }
    let scrape = |n: usize| fastpath::counters(topology.node(n).ns(), DEFAULT_HEALTHZ_PORT);
    let before = [scrape(1)?, scrape(2)?];
    let pods = topology.pods();
    for (a, b) in [(0, 1), (1, 0)] {
        let (from, to) = (&pods[a], &pods[b]);
        probe::tcp_reaches(from.ns(), to.ns(), IpAddr::V4(to.ip()), PROBE)
            .with_context(|| format!("{} -> {}", from.name(), to.name()))?;
        let t = probe::transfer(
            from.ns(),
            to.ns(),
            IpAddr::V4(to.ip()),
            scenarios::TRANSFER_BYTES,
            Duration::from_secs(30),
        )
        .with_context(|| format!("transfer {} -> {}", from.name(), to.name()))?;
        eprintln!(
            "{} -> {}: {} bytes intact in {:?}",
            from.name(),
            to.name(),
            t.bytes,
            t.elapsed
        );
    }
    progress("pods talked");
    let after = [scrape(1)?, scrape(2)?];
    let (eg_prog, eg_reason) = fastpath::egress_reason("vxlan").context("egress reason")?;
    let (in_prog, in_reason) = fastpath::ingress_reason("vxlan").context("ingress reason")?;
    for i in 0..2 {
        let sent = fastpath::grown(&before[i].bytes, &after[i].bytes, eg_prog, eg_reason);
        let got = fastpath::grown(&before[i].packets, &after[i].packets, in_prog, in_reason);
        ensure!(
            sent >= scenarios::TRANSFER_BYTES && got > 0,
            "node{}'s fast path counted {sent} bytes under {eg_prog}/{eg_reason} and {got} \
             packets under {in_prog}/{in_reason}; what moved: {}",
            i + 1,
            fastpath::growth_text(&before[i].packets, &after[i].packets)
        );
    }
    Ok(())
}

/// Rolling a node back to upstream flannel (deploy/README.md): once its Node is labelled
/// `flannel-rs/agent=upstream`, its agent, when it stops (the DaemonSet then deletes its pod),
/// enters the fast path's pod connections into conntrack and detaches the programs, pins
/// removed, so that upstream flanneld finds the kernel path alone. Kube mode, vxlan, agents
/// without `--ip-masq`: pod 1's connection to pod 2 goes on across the stop of node1's agent
/// (on the kernel path the CNI bridge's masquerade would rewrite it and pod 2 reset it), pod
/// 2 sees pod 1's own address, node1's pins are gone and no program of ours is attached
/// there. node2's agent, stopped without the label, leaves its programs attached (a restart
/// without a gap).
#[test]
fn ebpf_node_labelled_for_upstream_is_handed_over_when_its_agent_stops() {
    require_root!();
    if let Err(e) = kube::with_vxlan_pair(EBPF, handed_over_checks) {
        panic!("[ebpf labelled for upstream] {e:#}");
    }
}

fn handed_over_checks(
    topology: &mut Topology,
    api: &MockApiServer,
    agents: &mut [Agent],
) -> Result<()> {
    let on_fast_path = |topology: &Topology| -> Result<()> {
        for node in topology.nodes() {
            wait::until_ok(CONVERGE, "the fast path on the pod's port", || {
                fastpath::expect_path(node.ns(), DEFAULT_HEALTHZ_PORT, "ebpf")?;
                fastpath::expect_pod_ports(node.ns(), DEFAULT_HEALTHZ_PORT, 1)
            })
            .context(node.name())?;
        }
        Ok(())
    };
    for (node, agent) in topology.nodes().iter().zip(agents.iter_mut()) {
        agent.wait_subnet_env(node, Duration::from_secs(60))?;
    }
    for n in 1..=2 {
        topology.add_pod(n)?;
    }
    on_fast_path(topology)?;
    let mut conn = EchoConnection::open(topology)?;

    // node2's agent stops without the label: its programs stay attached.
    agents[1].stop(Duration::from_secs(10))?;
    let links = fastpath::pin_ids(topology.node(2).bpf_pin_path())?.links;
    ensure!(
        !links.is_empty(),
        "node2's links went with its agent (not labelled)"
    );
    agents[1].restart()?;
    on_fast_path(topology)?;
    conn.goes_on("after node2's agent restarted")?;

    // node1 labelled for upstream; its agent stops.
    api.modify_node(&topology.node(1).name(), |n| {
        n["metadata"]["labels"]["flannel-rs/agent"] = json!("upstream");
    })
    .context("node1 in the API")?;
    agents[0].stop(Duration::from_secs(10))?;
    fast_path_removed(topology, 1)?;
    let on_node2 = fastpath::tcx_programs(topology.node(2).ns(), "eth0")?;
    ensure!(
        on_node2.iter().any(|p| p == "tc_from_netdev"),
        "node2, still on the fast path, shows {on_node2:?} on its eth0"
    );
    conn.goes_on("on node1's kernel path")
}

/// A TCP connection from the first pod of node1 to a line echo server on the first pod of
/// node2 (port 7100), across the nodes.
struct EchoConnection {
    stream: std::net::TcpStream,
    peers: probe::Peers,
    client: IpAddr,
    sent: usize,
}

impl EchoConnection {
    /// [`EchoConnection::open`], then node1's agent stopped (its programs stay attached).
    fn open_and_stop_node1(c: &mut Cluster) -> Result<EchoConnection> {
        let conn = EchoConnection::open(c.topology())?;
        c.agent_mut(1)
            .context("node1's agent")?
            .stop(Duration::from_secs(10))?;
        Ok(conn)
    }

    /// Connects and makes a first round trip.
    fn open(t: &Topology) -> Result<EchoConnection> {
        let (client, server) = (t.first_pod_on(1)?, t.first_pod_on(2)?);
        let addr = SocketAddr::new(IpAddr::V4(server.ip()), 7100);
        let peers = probe::line_echo_server(server.ns(), addr, 1)?;
        let stream = client
            .ns()
            .enter(move || std::net::TcpStream::connect(addr))??;
        stream.set_read_timeout(Some(Duration::from_secs(3)))?;
        let mut conn = EchoConnection {
            stream,
            peers,
            client: IpAddr::V4(client.ip()),
            sent: 0,
        };
        conn.round_trip("on the fast path")?;
        Ok(conn)
    }

    fn round_trip(&mut self, when: &str) -> Result<()> {
        self.sent += 1;
        probe::line_round_trip(&mut self.stream, &format!("m{}", self.sent))
            .with_context(|| format!("message {} {when}", self.sent))
    }

    /// Three more round trips (`when` says at what point), and the server has seen the
    /// client's own address only.
    fn goes_on(&mut self, when: &str) -> Result<()> {
        for _ in 0..3 {
            self.round_trip(when)?;
        }
        let seen = self.peers.seen();
        ensure!(
            seen == [self.client],
            "the server saw {seen:?}, not {} alone",
            self.client
        );
        Ok(())
    }
}

/// Node `n`'s fast path is gone: its pin directory, and every TCX program on its eth0.
fn fast_path_removed(t: &Topology, n: usize) -> Result<()> {
    let pins = t.node(n).bpf_pin_path();
    ensure!(!pins.exists(), "{} is still there", pins.display());
    let attached = fastpath::tcx_programs(t.node(n).ns(), "eth0")?;
    ensure!(
        attached.is_empty(),
        "programs still on node{n}'s eth0: {attached:?}"
    );
    Ok(())
}

/// `flannel-agent --detach-fastpath` for node `n`'s pins and state directory.
fn detach_command(t: &Topology, n: usize) -> Result<Vec<String>> {
    let agent = bins::test_agent()?;
    Ok(vec![
        agent.to_str().context("agent path")?.to_owned(),
        "--detach-fastpath".to_owned(),
        format!("--bpf-pin-path={}", t.node(n).bpf_pin_path().display()),
        format!("--state-dir={}", t.node(n).state_dir().display()),
    ])
}

/// `flannel-agent --detach-fastpath`: where the agent could not detach its fast path on its
/// way out (etcd mode, which has no Node label; an agent that was killed), the same handover
/// and removal alone. node1's agent stops (its programs stay attached), the command runs in
/// node1: it exits 0, node1's pins are gone and no program of ours is attached to its eth0,
/// and a pod connection across the nodes (agents without `--ip-masq`) goes on, from the pod's
/// own address.
#[test]
fn ebpf_detach_fastpath_hands_over_and_removes_the_programs() {
    require_root!();
    with_cluster(
        &named(EBPF, "detach-fastpath"),
        spec_on(EBPF, 2, Underlay::L2, "vxlan", 1),
        |c| {
            let mut conn = EchoConnection::open_and_stop_node1(c)?;
            let t = c.topology();
            let pins = t.node(1).bpf_pin_path();
            ensure!(pins.exists(), "the stopped agent left no pins to detach");
            let detach = detach_command(t, 1)?;
            t.node(1)
                .run(&detach.iter().map(String::as_str).collect::<Vec<_>>())?;
            fast_path_removed(t, 1)?;
            conn.goes_on("on node1's kernel path")
        },
    );
}

/// The way back does not let go of the fast path before conntrack holds its flows: a
/// `flannel-agent --detach-fastpath` killed (SIGKILL) while it enters node1's remembered
/// flows into conntrack (30,000 made up besides the pod connection's, so that the entering
/// takes a while) leaves node1's links pinned and its programs attached, and the pods'
/// connection goes on; the command run again hands the connection over and detaches. (It
/// used to unpin the links first: killed there, it left the programs detached with the flows
/// half entered, and no links for the next run to hand over from.)
#[test]
fn ebpf_a_detach_killed_while_it_hands_over_leaves_the_fast_path_attached() {
    require_root!();
    with_cluster(
        &named(EBPF, "detach killed while it hands over"),
        spec_on(EBPF, 2, Underlay::L2, "vxlan", 1),
        |c| {
            const MADE_UP: u16 = 30_000;
            let mut conn = EchoConnection::open_and_stop_node1(c)?;
            let t = c.topology();
            let pins = t.node(1).bpf_pin_path();
            add_memos(pins, MADE_UP)?;
            let ns_path = t.node(1).ns().path();
            let tracked = || -> Result<u64> {
                flannel_tests::lab::kv::in_netns(&ns_path, || {
                    let text =
                        std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_count")?;
                    Ok(text.trim().parse()?)
                })
            };
            let before = tracked()?;
            let detach = detach_command(t, 1)?;
            let argv: Vec<&str> = detach.iter().map(String::as_str).collect();
            let log = t.node(1).dir().join("detach.log");
            let mut run = Process::spawn(t.node(1).ns(), &argv, Output::File(log))?;
            // Killed as soon as conntrack holds a first share of the flows.
            let started = std::time::Instant::now();
            while tracked()? < before + 1000 {
                ensure!(run.is_running(), "the command ended before it was killed");
                ensure!(
                    started.elapsed() < Duration::from_secs(30),
                    "conntrack never took the flows"
                );
                std::thread::sleep(Duration::from_micros(200));
            }
            run.kill()?;
            let entered = tracked()? - before;
            eprintln!("killed after {entered} of {MADE_UP} flows were in conntrack");
            ensure!(
                entered < u64::from(MADE_UP),
                "all {entered} flows were entered before the kill: too late to tell"
            );
            let links = fastpath::pin_ids(pins)?.links;
            ensure!(
                !links.is_empty(),
                "killed after {entered} flows, the command left no link pinned"
            );
            let attached = fastpath::tcx_programs(t.node(1).ns(), "eth0")?;
            ensure!(
                attached.iter().any(|p| p == "tc_from_netdev"),
                "killed after {entered} flows, node1's eth0 shows {attached:?}"
            );
            conn.goes_on("after the killed detach")?;
            t.node(1).run(&argv)?;
            fast_path_removed(t, 1)?;
            conn.goes_on("on node1's kernel path")
        },
    );
}

/// Adds `count` made-up TCP flows to the flow memos pinned under `pins`, copies of the most
/// recent one with other local ports (as recent, so the way back hands them over too).
fn add_memos(pins: &std::path::Path, count: u16) -> Result<()> {
    use flannel_common::memo::{FlowMemo, MEMO4, MemoKey};
    let path = pins.join(flannel_common::maps::PIN_MEMOS_DIR).join(MEMO4);
    let data = aya::maps::MapData::from_pin(&path).context("the pinned memos")?;
    let mut memos: aya::maps::HashMap<_, MemoKey, FlowMemo> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data))?;
    let (key, memo) = memos
        .iter()
        .flatten()
        .max_by_key(|(_, m)| m.checked_at)
        .context("no memo to copy")?;
    for i in 0..count {
        let fake = MemoKey {
            local_port: (20_000 + i).to_be_bytes(),
            remote_port: 9u16.to_be_bytes(),
            ..key
        };
        memos.insert(fake, memo, 0)?;
    }
    Ok(())
}

/// One agent per node: while node1's agent runs, a second agent with its flags and
/// `flannel-agent --detach-fastpath` for its pins and state directory both exit 1 at once,
/// naming the running agent's pid, and change nothing: node1's pins and programs stay, its
/// agent runs on and a pod connection across the nodes goes on. (Before the lock, the
/// command removed the running agent's pins and programs.) Once the agent has stopped, the
/// same command detaches.
#[test]
fn ebpf_a_second_agent_or_detach_is_refused_while_the_agent_runs() {
    require_root!();
    with_cluster(
        &named(EBPF, "one agent per node"),
        spec_on(EBPF, 2, Underlay::L2, "vxlan", 1),
        |c| {
            let mut conn = EchoConnection::open(c.topology())?;
            let agent = bins::test_agent()?;
            let agent = agent.to_str().context("agent path")?;
            let detach = detach_command(c.topology(), 1)?;
            let running = c.agent_mut(1).context("node1's agent")?;
            let (pid, args) = (running.pid(), running.args().to_vec());
            let t = c.topology();
            let node = t.node(1);
            let refused = |what: &str, argv: &[String]| -> Result<()> {
                let log = node.dir().join(format!("{what}.log"));
                let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
                let mut second = Process::spawn(node.ns(), &argv, Output::File(log.clone()))?;
                let status = second
                    .wait_timeout(Duration::from_secs(30))
                    .with_context(|| format!("{what} still runs next to node1's agent"))?;
                let text = std::fs::read_to_string(&log)?;
                ensure!(
                    status.code() == Some(1),
                    "{what} exited with {status}:\n{text}"
                );
                ensure!(
                    text.contains("another flannel-agent runs on this node")
                        && text.contains(&format!("pid {pid}")),
                    "{what} does not name the running agent (pid {pid}):\n{text}"
                );
                Ok(())
            };
            let mut second = vec![agent.to_owned()];
            second.extend(args);
            refused("second-agent", &second)?;
            refused("detach", &detach)?;
            ensure!(node.bpf_pin_path().exists(), "node1's pins were removed");
            let attached = fastpath::tcx_programs(node.ns(), "eth0")?;
            ensure!(!attached.is_empty(), "node1's programs were detached");
            conn.goes_on("after the refusals")?;
            c.agent_mut(1).context("node1's agent")?.check_running()?;
            c.agent_mut(1)
                .context("node1's agent")?
                .stop(Duration::from_secs(10))?;
            let t = c.topology();
            let detach: Vec<&str> = detach.iter().map(String::as_str).collect();
            t.node(1).run(&detach)?;
            fast_path_removed(t, 1)
        },
    );
}

/// UDP with segmentation offload (`UDP_SEGMENT`, as QUIC senders use) between pods on two
/// VXLAN nodes on the fast path: three 60,000-byte sends in 1,000-byte segments arrive as 180
/// datagrams of 1,000 bytes. (Decapsulated in eBPF and delivered into the pod, such a packet
/// kept its tunnel offload state and was lost in the receiving socket; it is now left to
/// `flannel.1`.)
#[test]
fn ebpf_vxlan_carries_udp_gso_between_pods() {
    require_root!();
    with_cluster(
        &named(EBPF, "vxlan/l2 UDP GSO"),
        spec_on(EBPF, 2, Underlay::L2, "vxlan", 1),
        |c| {
            let t = c.topology();
            let (from, to) = (t.first_pod_on(1)?, t.first_pod_on(2)?);
            probe::udp_gso_arrives_segmented(from, to)
        },
    );
}

/// Pods with BIG TCP on two VXLAN nodes on the fast path, whose agents run without
/// `--ip-masq`, so the CNI bridge masquerades pod traffic that goes through netfilter: see
/// [`big_tcp_pods`]. With 66,000-byte GSO and a pod MTU of 1,361 the senders' 50-segment
/// packets are 65,502 bytes of IP, too long for the 50 bytes of VXLAN within IPv4's 65,535;
/// with 150,000-byte GSO they are longer than 64 KB (total length 0). Both go to `flannel.1`
/// itself (`fast_vxlan_device`), which segments them; the flows' other packets are
/// encapsulated by the programs.
#[test]
fn ebpf_vxlan_carries_big_tcp_pods() {
    require_root!();
    big_tcp_pods("vxlan", BigTcp::V4, &["fast_vxlan", "fast_vxlan_device"]);
}

/// [`big_tcp_pods`] on host-gw: packets longer than 64 KB (total length 0) are forwarded by the
/// programs like any other.
#[test]
fn ebpf_host_gw_carries_big_tcp_pods() {
    require_root!();
    big_tcp_pods("host-gw", BigTcp::V4, &["fast_host_gw"]);
}

/// [`big_tcp_pods`] over IPv6 (dual stack) on VXLAN: GSO packets go to `flannel-v6.1` itself,
/// those longer than 64 KB too (payload length 0 and a hop-by-hop jumbo option, as this
/// kernel builds them).
#[test]
fn ebpf_vxlan_carries_ipv6_big_tcp_pods() {
    require_root!();
    big_tcp_pods("vxlan", BigTcp::V6, &["fast_vxlan6", "fast_vxlan6_device"]);
}

/// [`big_tcp_pods`] over IPv6 (dual stack) on host-gw: packets longer than 64 KB (payload
/// length 0, hop-by-hop jumbo option) are forwarded by the programs like any other.
#[test]
fn ebpf_host_gw_carries_ipv6_big_tcp_pods() {
    require_root!();
    big_tcp_pods("host-gw", BigTcp::V6, &["fast_host_gw6"]);
}

/// The family a BIG TCP test sends in, with the counters of packets the programs would leave
/// to the kernel for their length if they did not know BIG TCP.
#[derive(Clone, Copy, PartialEq, Eq)]
enum BigTcp {
    V4,
    V6,
}

impl BigTcp {
    fn refused(self) -> &'static [&'static str] {
        match self {
            BigTcp::V4 => &["malformed_ipv4_bad_length"],
            BigTcp::V6 => &["malformed_ipv6_bad_length", "pass_ipv6_ext_header"],
        }
    }
}

/// Two nodes of `backend` on the fast path whose pods have BIG TCP (pod MTU 1,361, GSO of
/// 66,000 and then 150,000 bytes on both ends of their veths), sending in `family` (dual stack
/// for IPv6): for each size a 64 MB transfer each way arrives intact, both nodes'
/// `tc_from_bridge` counted each of `verdicts`, no program left a packet longer than 64 KB to
/// the kernel for its length and no flow was learnt as the kernel's (either sends it through netfilter, where the
/// CNI bridge's masquerade would translate it, resetting the connection).
fn big_tcp_pods(backend: &str, family: BigTcp, verdicts: &[&str]) {
    let mut spec = spec_on(EBPF, 2, Underlay::L2, backend, 1);
    let name = match family {
        BigTcp::V4 => format!("{backend}/l2 BIG TCP"),
        BigTcp::V6 => {
            spec.topology = spec.topology.ipv6(true);
            spec.ipv6_network = Some("fd00:244::/48".parse().expect("an IPv6 network"));
            format!("{backend}/l2 IPv6 BIG TCP")
        }
    };
    with_cluster(&named(EBPF, &name), spec, |c| {
        let t = c.topology();
        for gso in [66_000, 150_000] {
            for n in 1..=2 {
                big_tcp(t.first_pod_on(n)?.ns(), t.node(n).ns(), gso)?;
            }
            let scrape = |n: usize| fastpath::counters(t.node(n).ns(), DEFAULT_HEALTHZ_PORT);
            let before = [scrape(1)?, scrape(2)?];
            for (a, b) in [(1, 2), (2, 1)] {
                let (from, to) = (t.first_pod_on(a)?, t.first_pod_on(b)?);
                let ip = match family {
                    BigTcp::V4 => IpAddr::V4(to.ip()),
                    BigTcp::V6 => IpAddr::V6(to.ip6_required()?),
                };
                let sent =
                    probe::transfer(from.ns(), to.ns(), ip, 64 << 20, Duration::from_secs(30))
                        .with_context(|| {
                            format!("GSO {gso}: transfer {} -> {}", from.name(), to.name())
                        })?;
                eprintln!("GSO {gso}: {} -> {}: {sent:?}", from.name(), to.name());
            }
            let after = [scrape(1)?, scrape(2)?];
            for i in 0..2 {
                let (b, a) = (&before[i].packets, &after[i].packets);
                // In bytes: neighbour discovery's multicast listener reports have a hop-by-hop
                // header too, but no packet of the transfers is shorter than 64 KB.
                let refused: u64 = ["tc_from_bridge", "tc_from_netdev"]
                    .iter()
                    .flat_map(|p| family.refused().iter().map(move |r| (p, r)))
                    .map(|(p, r)| fastpath::grown(&before[i].bytes, &after[i].bytes, p, r))
                    .sum();
                let counted: Vec<u64> = verdicts
                    .iter()
                    .map(|v| fastpath::grown(b, a, "tc_from_bridge", v))
                    .collect();
                // The tunnel device's outer packets of the redirected ones are not taken for a
                // kernel flow's (`tc_index` tag), which would move the flow to netfilter.
                let learnt = fastpath::grown(b, a, "tc_to_netdev", "learn_kernel_flow");
                ensure!(
                    refused < 1 << 16 && learnt == 0 && counted.iter().all(|&n| n > 0),
                    "GSO {gso}, node{}: {counted:?} packets under {verdicts:?}, {refused} bytes \
                     left to the kernel for their length, {learnt} kernel flows learnt; what \
                     moved: {}",
                    i + 1,
                    fastpath::growth_text(b, a)
                );
            }
        }
        Ok(())
    });
}

/// Gives the pod in `pod` BIG TCP: MTU 1,361 and GSO packets of up to `gso` bytes on its
/// `eth0`, and the same GSO size on the host end of its veth (the only port of `cni0` in
/// `node`).
fn big_tcp(pod: &NetNs, node: &NetNs, gso: u32) -> Result<()> {
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("tokio runtime")
    };
    pod.enter(|| {
        runtime()?.block_on(async {
            let nl = Netlink::new()?;
            let eth0 = nl.link_by_name("eth0").await?.context("the pod's eth0")?;
            nl.set_mtu(eth0.index, 1361).await?;
            nl.set_gso_max_size(eth0.index, gso).await?;
            anyhow::Ok(())
        })
    })??;
    node.enter(|| {
        runtime()?.block_on(async {
            let nl = Netlink::new()?;
            let bridge = nl.link_by_name("cni0").await?.context("cni0")?;
            let links = nl.list_links().await?;
            let ports: Vec<_> = links
                .iter()
                .filter(|l| l.master == Some(bridge.index))
                .collect();
            let [port] = ports[..] else {
                bail!("cni0 has {} ports, want the pod's one", ports.len());
            };
            nl.set_gso_max_size(port.index, gso).await?;
            anyhow::Ok(())
        })
    })?
}
