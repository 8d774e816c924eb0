//! The udp backend on the eBPF fast path between simulated nodes run by real agents
//! ([`Cluster::up`], etcd in the hub, pods created through CNI):
//!
//! * `udp_fast_path_carries_pods_across_three_nodes`: three nodes behind a router, all with
//!   `--dataplane=ebpf`: every pod reaches every pod, a TCP transfer arrives intact, pod
//!   traffic is counted by the programs (not by the forwarder), the underlay carries exactly
//!   what the TUN path would send for the pod's packet (compared byte for byte with the TUN
//!   path's own functions), the pod on the far side gets exactly what forwarder + kernel would
//!   deliver, and host-originated traffic still goes through `flannel0`.
//! * `udp_fast_path_keeps_to_a_narrower_path_mtu`: two nodes behind a router whose link to
//!   node2 has MTU 1,400: a pod's TCP transfer to node2's pod arrives, its segments too big
//!   for the path (the outer datagrams carry DF) going the TUN path, whose socket fragments
//!   them, once the router's error taught the kernel the path MTU.
//! * `udp_fast_path_hands_the_stack_merged_datagrams_for_the_host`: a pod's TCP transfer
//!   to the other node's `cni0` address arrives, its GSO datagrams handed to that node's stack
//!   decapsulated, the checksums of the others finished by that node's forwarder.
//! * `udp_fast_path_carries_udp_gso_between_pods`: `UDP_SEGMENT` sends between pods arrive
//!   as their segments, left to `flannel0` by the sender's programs.
//! * `udp_mixed_pair_fast_path_and_tun_path`: one node on the fast path, the other on the TUN
//!   path only (`--dataplane=kernel`), both directions (ICMP, TCP), and a datagram built by
//!   hand as an upstream udp node sends it, delivered by the fast path.
//!
//! Run: `cargo test -p flannel-tests --test bpf_udp_cluster -- --nocapture` (as root; skipped
//! otherwise and when the agent has no eBPF object).

use std::{
    net::{IpAddr, SocketAddr, SocketAddrV4, UdpSocket},
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};
use flannel_agent::udp::{
    UdpRoute, UdpRoutes,
    forwarder::{EgressVerdict, egress_verdict, ingress_verdict},
    packet as tun_packet,
};
use flannel_tests::{
    check,
    lab::{
        agent::{Agent, DEFAULT_HEALTHZ_PORT, Dataplane},
        bins,
        capture::Capture,
        cluster::{Cluster, ClusterSpec},
        fastpath, probe, status, wait,
    },
    netns::NetNs,
    packet::{self, Checksum, Ipv4, ParsedL3, ParsedL4, Udp},
    require_ebpf_object, require_root,
    topology::{TopologySpec, Underlay},
};

const PORT: u16 = 8285;

fn cluster(nodes: usize, underlay: Underlay, dataplane: Dataplane) -> Result<Cluster> {
    let topology = TopologySpec::new(nodes, underlay).cni_plugin(bins::test_cni_plugin()?);
    let mut spec = ClusterSpec::new(topology, "udp", bins::test_agent()?);
    spec.pods_per_node = 1;
    spec.ip_masq = true;
    spec.dataplane = dataplane;
    Cluster::up(spec, &|line| eprintln!("{line}"), &|| false)
}

/// Packets the fast path counted under `reason` (any program).
fn fast(ns: &NetNs, reason: &str) -> Result<f64> {
    fastpath::packets(ns, DEFAULT_HEALTHZ_PORT, reason)
}

/// Packets the TUN path's forwarder counted under `reason`.
fn forwarder(ns: &NetNs, reason: &str) -> Result<f64> {
    status::metric_sum(
        ns,
        DEFAULT_HEALTHZ_PORT,
        "flannel_udp_packets_total",
        &format!("reason=\"{reason}\""),
    )
}

fn all_pairs(cluster: &Cluster) -> Result<()> {
    let matrix = cluster.matrix(Duration::from_secs(5))?;
    eprintln!("{matrix}");
    matrix.check()
}

/// One UDP datagram from inside `ns`.
fn send_udp(ns: &NetNs, to: SocketAddr, payload: &[u8]) -> Result<()> {
    let payload = payload.to_vec();
    ns.enter(move || -> Result<()> {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.send_to(&payload, to)?;
        Ok(())
    })?
}

/// The IPv4 packet of a captured frame (Ethernet header stripped), if it is IPv4.
fn ip_bytes(frame: &[u8]) -> Option<Vec<u8>> {
    (frame.len() > 14 && frame[12..14] == packet::ETH_P_IP.to_be_bytes())
        .then(|| frame[14..].to_vec())
}

/// A captured frame's IPv4 packet if it carries a UDP payload ending with `marker`.
fn carrying(frame: &[u8], marker: &[u8]) -> Option<Vec<u8>> {
    let parsed = packet::parse(frame).ok()?;
    let ParsedL3::Ipv4(ip) = &parsed.l3 else {
        return None;
    };
    match &ip.l4 {
        ParsedL4::Udp { payload, .. } if payload.ends_with(marker) => {
            let bytes = ip_bytes(frame)?;
            Some(bytes[..usize::from(ip.total_length)].to_vec())
        }
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------

#[test]
fn udp_fast_path_carries_pods_across_three_nodes() {
    require_root!();
    require_ebpf_object!();
    check(three_nodes());
}

fn three_nodes() -> Result<()> {
    let cluster = cluster(3, Underlay::L3, Dataplane::Ebpf)?;
    let topo = cluster.topology();
    for node in topo.nodes() {
        fastpath::expect_path(node.ns(), DEFAULT_HEALTHZ_PORT, "ebpf")
            .with_context(|| format!("{} is not on the fast path", node.name()))?;
        // The TUN path stays configured underneath.
        let link = node.run(&["ip", "-o", "link", "show", "flannel0"])?;
        ensure!(link.contains("UP"), "flannel0 on {}: {link}", node.name());
    }
    all_pairs(&cluster)?;

    let (p1, p3) = (
        cluster.topology().first_pod_on(1)?,
        cluster.topology().first_pod_on(3)?,
    );
    let (n1, n3) = (topo.node(1), topo.node(3));
    let encap_before = forwarder(n1.ns(), "udp_encap")?;
    let fast_before = fast(n1.ns(), "fast_udp")?;
    let mbit = probe::transfer_mbit(p1.ns(), p3.ns(), IpAddr::V4(p3.ip()), 16 << 20)?;
    eprintln!("16 MiB TCP node1 → node3 over udp, fast path: {mbit:.0} Mbit/s");
    ensure!(
        fast(n1.ns(), "fast_udp")? - fast_before >= 100.0,
        "the transfer did not go through tc_from_bridge"
    );
    ensure!(
        fast(n3.ns(), "fast_deliver_udp")? >= 100.0,
        "node3 delivered nothing in eBPF"
    );

    // The wire, byte for byte: what the pod sent, what node1 put on the underlay, what the
    // pod on node3 got.
    let at_pod1 = Capture::start(p1.ns(), "eth0")?;
    let underlay = Capture::start(n1.ns(), "eth0")?;
    let at_pod3 = Capture::start(p3.ns(), "eth0")?;
    let marker = b"flannel udp fast path wire check".to_vec();
    let listener = probe::udp_listener(p3.ns(), SocketAddr::new(IpAddr::V4(p3.ip()), 7200))?;
    send_udp(p1.ns(), SocketAddr::new(IpAddr::V4(p3.ip()), 7200), &marker)?;
    let from = probe::recv_payload(&listener, &marker, Duration::from_secs(3))?;
    ensure!(from.ip() == IpAddr::V4(p1.ip()), "source {from}");
    let sent = at_pod1.find(Duration::from_secs(3), |f| carrying(f, &marker))?;
    let wire = underlay.find(Duration::from_secs(3), |f| {
        let ip = ip_bytes(f)?;
        (ip.len() > 28 && ip[9] == packet::IPPROTO_UDP && ip[28..].ends_with(&marker)).then_some(ip)
    })?;
    let arrived_frame = at_pod3.find(Duration::from_secs(3), |f| {
        carrying(f, &marker).map(|_| f.to_vec())
    })?;
    let arrived = carrying(&arrived_frame, &marker).context("the pod's frame")?;

    // The TUN path for the same packet: kernel forwarding (TTL − 1), the forwarder's
    // egress_verdict (TTL − 1, the peer's endpoint), its socket's outer headers.
    let mut payload = sent.clone();
    tun_packet::decrement_ttl(&mut payload).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let routes = UdpRoutes::new(
        cluster
            .leases()?
            .iter()
            .filter(|l| Some(l.subnet) != cluster.subnet_envs()[0].lease())
            .filter_map(|l| {
                Some(UdpRoute {
                    subnet: l.subnet,
                    endpoint: SocketAddrV4::new(l.public_ip?, PORT),
                })
            }),
    );
    let to = match egress_verdict(&mut payload, &routes) {
        EgressVerdict::Send { to, len } => {
            payload.truncate(len);
            to
        }
        other => bail!("the TUN path would not send it: {other:?}"),
    };
    ensure!(
        to == SocketAddrV4::new(n3.addr(), PORT),
        "peer endpoint {to}"
    );
    let want = Ipv4 {
        id: 0,
        tos: 0,
        dont_fragment: true,
        ttl: 64,
        ..Ipv4::new(
            n1.addr(),
            *to.ip(),
            Udp {
                checksum: Checksum::Value(0),
                ..Udp::new(PORT, PORT).payload(&payload)
            },
        )
    }
    .encode();
    ensure!(
        wire == want,
        "the underlay datagram differs from the TUN path's\n got:\n{}want:\n{}",
        packet::hexdump(&wire),
        packet::hexdump(&want)
    );
    ensure!(
        sent[8] == 64 && wire[28 + 8] == 62,
        "inner TTL 64 → 62 on the wire"
    );
    let mut delivered = wire[28..].to_vec();
    let len = ingress_verdict(
        &mut delivered,
        cluster.subnet_envs()[2].lease().context("lease")?,
    )
    .map_err(|e| anyhow::anyhow!("{e:?}"))?
    .len;
    delivered.truncate(len);
    tun_packet::decrement_ttl(&mut delivered).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    // The pod's UDP checksum left pod1 unfinished (a veth passes CHECKSUM_PARTIAL on, so the
    // wire shows the pseudo-header sum); node3's bridge completes it in software on the way to
    // the pod. Every other byte is what forwarder + kernel deliver, and the checksum is valid.
    packet::verify(&arrived_frame).context("checksums at the pod")?;
    let without_l4_checksum = |p: &[u8]| [&p[..26], &p[28..]].concat();
    ensure!(
        without_l4_checksum(&arrived) == without_l4_checksum(&delivered),
        "the pod got other bytes than forwarder + kernel would deliver\n got:\n{}want:\n{}",
        packet::hexdump(&arrived),
        packet::hexdump(&delivered)
    );
    ensure!(arrived[8] == 60, "TTL at the pod {}", arrived[8]);
    ensure!(
        forwarder(n1.ns(), "udp_encap")? - encap_before < 10.0,
        "pod traffic went through the forwarder"
    );

    // Host-originated traffic still takes flannel0 and the forwarder.
    let encap_before = forwarder(n1.ns(), "udp_encap")?;
    let responder = probe::Responder::start(p3.ns(), IpAddr::V4(p3.ip()), 0)?;
    probe::tcp_probe(n1.ns(), responder.addr(), Duration::from_secs(5))?;
    ensure!(
        forwarder(n1.ns(), "udp_encap")? > encap_before,
        "host → pod did not use the forwarder"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------

#[test]
fn udp_fast_path_keeps_to_a_narrower_path_mtu() {
    require_root!();
    require_ebpf_object!();
    check(narrower_path());
}

fn narrower_path() -> Result<()> {
    let cluster = cluster(2, Underlay::L3, Dataplane::Ebpf)?;
    let topo = cluster.topology();
    topo.hub()
        .run(&["ip", "link", "set", "br2", "mtu", "1400"])?;
    let (from, to) = (topo.first_pod_on(1)?, topo.first_pod_on(2)?);
    let node1 = topo.node(1).ns();
    let passed_before = fast(node1, "pass_fib_failed")?;
    probe::transfer(
        from.ns(),
        to.ns(),
        IpAddr::V4(to.ip()),
        4 << 20,
        Duration::from_secs(20),
    )
    .context("the pod's transfer across the narrower path")?;
    let passed = fast(node1, "pass_fib_failed")? - passed_before;
    ensure!(
        passed >= 10.0,
        "node1 left {passed} packets too big for the path to the TUN path"
    );
    Ok(())
}

/// A pod's TCP transfer to a host address inside another node's subnet (that node's `cni0`
/// address, where a host-network service listens), on a veth underlay with its offloads on (a
/// kind or k3d cluster): node1's programs put each of the pod's TSO segments into one
/// datagram, which the veth carries whole, as a GSO packet, to node2. The forwarder's socket
/// reads one datagram at a time, and the stack is where the packet goes, so node2's programs
/// hand the stack the inner packet (`fast_decap_udp`). The connection's packets that are not
/// GSO go to node2's forwarder with the inner checksum the veth left unfinished, which the
/// forwarder finishes: before, the handshake never completed (the SYN dropped by node2's
/// kernel as `TcpInCsumErrors`). The data arrives intact, and a transfer to node2's pod is
/// delivered in eBPF as before.
#[test]
fn udp_fast_path_hands_the_stack_merged_datagrams_for_the_host() {
    require_root!();
    require_ebpf_object!();
    check(merged_datagrams_for_the_host());
}

fn merged_datagrams_for_the_host() -> Result<()> {
    let cluster = cluster(2, Underlay::L2, Dataplane::Ebpf)?;
    let topo = cluster.topology();
    let (p1, p2, n2) = (topo.first_pod_on(1)?, topo.first_pod_on(2)?, topo.node(2));
    // Pods that have talked: node2 has its pod's neighbour entry, so the programs can deliver
    // to it (until then they hand a GSO datagram to the stack, which resolves it).
    all_pairs(&cluster)?;
    let gateway = p2.gateway();
    let decap_before = fast(n2.ns(), "fast_decap_udp")?;
    let finished_before = forwarder(n2.ns(), "udp_checksum_finished")?;
    let mbit = probe::transfer_mbit(p1.ns(), n2.ns(), IpAddr::V4(gateway), 16 << 20)?;
    eprintln!("16 MiB TCP pod1 → node2's {gateway}: {mbit:.0} Mbit/s");
    let decapped = fast(n2.ns(), "fast_decap_udp")? - decap_before;
    ensure!(
        decapped >= 10.0,
        "node2 handed the stack {decapped} merged datagrams of the transfer"
    );
    // The connection's other packets (handshake, the end) went to node2's socket, their
    // checksums as node1's veth left them: unfinished, finished by the forwarder.
    let finished = forwarder(n2.ns(), "udp_checksum_finished")? - finished_before;
    ensure!(
        finished >= 2.0,
        "node2's forwarder finished {finished} checksums"
    );
    // Within seconds (one full-suite run once saw a first transfer right after the one above
    // with none delivered in eBPF, not reproduced since; the counters say where it went).
    wait::until_ok(
        Duration::from_secs(10),
        "node2 delivers to its pod in eBPF",
        || {
            let counted_before = fastpath::counters(n2.ns(), DEFAULT_HEALTHZ_PORT)?.packets;
            let delivered_before = fast(n2.ns(), "fast_deliver_udp")?;
            probe::transfer_mbit(p1.ns(), p2.ns(), IpAddr::V4(p2.ip()), 4 << 20)?;
            let counted = fastpath::counters(n2.ns(), DEFAULT_HEALTHZ_PORT)?.packets;
            ensure!(
                fast(n2.ns(), "fast_deliver_udp")? - delivered_before >= 10.0,
                "none of a transfer to the pod delivered in eBPF; node2's counters grew by:\n{}",
                fastpath::growth_text(&counted_before, &counted)
            );
            Ok(())
        },
    )?;
    Ok(())
}

/// UDP with segmentation offload (`UDP_SEGMENT`, as QUIC senders use) between pods on two
/// udp-backend nodes on the fast path, over a veth underlay that carries a GSO packet whole:
/// three 60,000-byte sends in 1,000-byte segments arrive as 180 datagrams of 1,000 bytes.
/// node1's programs leave them to `flannel0` (`pass_gso`). Before, they were encapsulated
/// whole and delivered by node2's programs with a UDP-tunnel offload state that made the
/// pod's socket drop them: none arrived.
#[test]
fn udp_fast_path_carries_udp_gso_between_pods() {
    require_root!();
    require_ebpf_object!();
    check(udp_gso_between_pods());
}

fn udp_gso_between_pods() -> Result<()> {
    let cluster = cluster(2, Underlay::L2, Dataplane::Ebpf)?;
    let topo = cluster.topology();
    let (from, to, n1) = (topo.first_pod_on(1)?, topo.first_pod_on(2)?, topo.node(1));
    let gso_before = fast(n1.ns(), "pass_gso")?;
    let kernel_before = fast(n1.ns(), "pass_kernel_flow")?;
    probe::udp_gso_arrives_segmented(from, to)?;
    // The first GSO packet goes to flannel0 as such; once the forwarder's datagram has made
    // the flow a kernel flow, the later ones go there as that.
    let gso = fast(n1.ns(), "pass_gso")? - gso_before;
    let kernel = fast(n1.ns(), "pass_kernel_flow")? - kernel_before;
    ensure!(
        gso >= 1.0 && gso + kernel >= 3.0,
        "node1's programs did not leave the GSO packets to flannel0: {gso} as GSO, {kernel} \
         as a kernel flow"
    );
    Ok(())
}

#[test]
fn udp_mixed_pair_fast_path_and_tun_path() {
    require_root!();
    require_ebpf_object!();
    check(mixed_pair());
}

fn mixed_pair() -> Result<()> {
    let mut cluster = cluster(2, Underlay::L2, Dataplane::Kernel)?;
    // Node 1 moves to the fast path: its agent restarts with --dataplane=ebpf (same lease).
    let mut spec = cluster.agent_spec();
    spec.dataplane = Some(Dataplane::Ebpf);
    cluster
        .agent_mut(1)
        .context("agent 1")?
        .stop(Duration::from_secs(5))?;
    let node1 = cluster.topology().node(1);
    let fast_agent: Agent = Agent::start(node1, &spec)?;
    wait::until_ok(Duration::from_secs(30), "node1 on the fast path", || {
        fastpath::expect_path(node1.ns(), DEFAULT_HEALTHZ_PORT, "ebpf")?;
        fastpath::expect_pod_ports(node1.ns(), DEFAULT_HEALTHZ_PORT, 1)?;
        node1.run(&["ip", "link", "show", "flannel0"])?;
        Ok(())
    })?;
    let topo = cluster.topology();
    let (n1, n2) = (topo.node(1), topo.node(2));
    fastpath::expect_path(n2.ns(), DEFAULT_HEALTHZ_PORT, "kernel")?;
    let entries = |kind: &str| {
        status::metric_sum(
            n1.ns(),
            DEFAULT_HEALTHZ_PORT,
            "flannel_bpf_map_entries",
            &format!("kind=\"{kind}\""),
        )
    };
    // A veth hands a packet's GSO state to its peer, which a NIC would have segmented on
    // transmit; a user-space receiver (node2's forwarder) reads one datagram at a time. Make
    // node1's underlay segment like a NIC without tunnel offloads. Checksum offload stays on:
    // the veth hands on the segments' inner checksums unfinished, and node2's forwarder
    // finishes them.
    n1.run(&[
        "ethtool",
        "-K",
        "eth0",
        "tx-udp_tnl-segmentation",
        "off",
        "tx-udp_tnl-csum-segmentation",
        "off",
    ])?;
    let (p1, p2) = (
        cluster.topology().first_pod_on(1)?,
        cluster.topology().first_pod_on(2)?,
    );
    wait::until_ok(Duration::from_secs(20), "pods reach each other", || {
        all_pairs(&cluster)
    })?;
    // The pod has sent by now, so the bridge has learnt its MAC.
    wait::until_ok(Duration::from_secs(5), "node1's map entries", || {
        ensure!(
            entries("routes4")? == 1.0 && entries("ports")? == 1.0,
            "node1's maps: {} route(s) (one peer), {} pod(s) (one pod)",
            entries("routes4")?,
            entries("ports")?
        );
        Ok(())
    })?;

    let counted_before = fastpath::counters(n1.ns(), DEFAULT_HEALTHZ_PORT)?.packets;
    let decap_before = forwarder(n2.ns(), "udp_decap")?;
    let encap_before = forwarder(n2.ns(), "udp_encap")?;
    let finished_before = forwarder(n2.ns(), "udp_checksum_finished")?;
    let fast_to_tun = probe::transfer_mbit(p1.ns(), p2.ns(), IpAddr::V4(p2.ip()), 4 << 20)?;
    let tun_to_fast = probe::transfer_mbit(p2.ns(), p1.ns(), IpAddr::V4(p1.ip()), 4 << 20)?;
    eprintln!("4 MiB TCP fast → TUN {fast_to_tun:.0} Mbit/s, TUN → fast {tun_to_fast:.0} Mbit/s");
    let counted = fastpath::counters(n1.ns(), DEFAULT_HEALTHZ_PORT)?.packets;
    let grown = |reason: &str| -> u64 {
        counted
            .keys()
            .filter(|(_, r)| r == reason)
            .map(|(p, r)| fastpath::grown(&counted_before, &counted, p, r))
            .sum()
    };
    ensure!(
        grown("fast_udp") >= 100 && grown("fast_deliver_udp") >= 100,
        "node1's fast path did not carry the transfers: {}\npod port programs: {}\nagent log:\n{}",
        fastpath::growth_text(&counted_before, &counted),
        n1.run(&["bpftool", "net", "show"])
            .unwrap_or_else(|e| e.to_string()),
        fast_agent.log_tail(40)
    );
    ensure!(forwarder(n2.ns(), "udp_decap")? - decap_before >= 100.0);
    ensure!(forwarder(n2.ns(), "udp_encap")? - encap_before >= 100.0);
    let finished = forwarder(n2.ns(), "udp_checksum_finished")? - finished_before;
    ensure!(
        finished >= 100.0,
        "node2's forwarder finished {finished} checksums node1's veth left unfinished"
    );

    // An upstream udp node (a datagram built by hand, sent from the hub) whose pods live in
    // node2's subnet as far as node1 knows: delivered by the fast path, TTL − 2.
    let hub = topo.hub();
    let hub_addr = topo.hub_addr();
    let at_pod = Capture::start(p1.ns(), "eth0")?;
    let listener = probe::udp_listener(p1.ns(), SocketAddr::new(IpAddr::V4(p1.ip()), 7300))?;
    let hello = b"hello from an upstream udp node".to_vec();
    let mut inner = Ipv4::new(p2.ip(), p1.ip(), Udp::new(40000, 7300).payload(&hello));
    inner.ttl = 10;
    let datagram = inner.encode();
    let to = SocketAddr::new(IpAddr::V4(n1.addr()), PORT);
    let before = fast(n1.ns(), "fast_deliver_udp")?;
    hub.enter(move || -> Result<()> {
        let s = UdpSocket::bind(SocketAddr::new(IpAddr::V4(hub_addr), PORT))?;
        s.send_to(&datagram, to)?;
        Ok(())
    })??;
    let from = probe::recv_payload(&listener, &hello, Duration::from_secs(3))?;
    ensure!(
        from == SocketAddr::new(IpAddr::V4(p2.ip()), 40000),
        "{from}"
    );
    let ttl = at_pod.find(Duration::from_secs(2), |f| {
        carrying(f, &hello).map(|ip| ip[8])
    })?;
    ensure!(ttl == 8, "TTL 10 arrives as {ttl}");
    ensure!(
        fast(n1.ns(), "fast_deliver_udp")? > before,
        "not delivered by the fast path"
    );
    drop(fast_agent);
    Ok(())
}
