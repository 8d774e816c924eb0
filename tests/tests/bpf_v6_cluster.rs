//! IPv6 on the eBPF fast path between simulated nodes run by real agents (pods through CNI):
//!
//! * `vxlan_dual_stack_three_nodes_on_the_fast_path` (etcd, nodes behind a router): IPv4 and
//!   IPv6 pod traffic across nodes, both families counted by the programs; an ICMPv6 echo's
//!   VXLAN-over-IPv6 frame on the underlay verifies (outer UDP checksum included); a bulk IPv6
//!   transfer arrives intact.
//! * `host_gw_dual_stack_on_the_fast_path` (one L2 segment): the same for host-gw.
//! * `vxlan_v6_mixed_pair_fast_path_and_kernel`: node 1 on the kernel path sends an ICMPv6 echo
//!   through `flannel-v6.1`, then moves to the fast path and sends the same again: both frames
//!   are compared field by field; then traffic in both directions between the fast path and
//!   node 2's kernel path (whose `flannel-v6.1` accepts only valid UDP checksums).
//! * `ipv6_only_kube_mode_on_the_fast_path`: an IPv6-only network (kube mode, fake API server)
//!   on the fast path.
//! * `vxlan_v6_bulk_transfer_keeps_one_path_under_cni_masquerade`: with the CNI bridge plugin
//!   masquerading, bulk IPv6 transfers over VXLAN arrive (their GSO packets go to
//!   `flannel-v6.1` past netfilter, not masqueraded unlike the flow's first packets), also
//!   with a kubelet-style rule dropping locally sent packets marked 0x8000.
//! * `ipv6_nated_connection_crosses_the_move_to_the_fast_path`: a pod's IPv6 connection the
//!   CNI bridge masqueraded on the kernel path goes on when its node moves to the fast path;
//!   `ipv6_connection_crosses_the_move_back_to_the_kernel_path`: and one the fast path
//!   carried when its node moves back.
//! * `ipv6_traffic_crosses_an_agent_restart`: ICMPv6 echoes and a TCP ping-pong over IPv6
//!   lose nothing while node 1's agent is down and restarts.
//! * `ipv6_lost_kernel_flows_come_back_from_conntrack`: an idle IPv6 Service connection whose
//!   kernel-flow entry was removed gets it back from conntrack within a resync, and goes on.
//! * `ipv6_fragments_and_extension_headers_arrive` (vxlan over a routed underlay, host-gw):
//!   IPv6 fragments and packets with extension headers reach the remote pod intact, a pod's
//!   fragments sent like the rest of its flow, from its own address.
//!
//! Run: `cargo test -p flannel-tests --test bpf_v6_cluster -- --nocapture` (as root; skipped
//! otherwise and without the eBPF object).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use flannel_common::{programs, stats::Reason};
use flannel_tests::{
    check,
    lab::{
        agent::{Agent, AgentSpec, DEFAULT_HEALTHZ_PORT, Dataplane},
        bins,
        capture::Capture,
        cluster::{Cluster, ClusterSpec},
        fastpath, kube, probe, wait,
    },
    netns::NetNs,
    packet::{self, ParsedL3, ParsedL4},
    require_ebpf_object, require_root,
    topology::{Pod, Topology, TopologySpec, Underlay},
};
use serde_json::json;

const NETWORK_V6: &str = "fd00:244::/48";

fn dual_stack_cluster(
    nodes: usize,
    backend: &str,
    underlay: Underlay,
    dataplane: Dataplane,
) -> Result<Cluster> {
    dual_stack_cluster_masq(nodes, backend, underlay, dataplane, true)
}

/// [`dual_stack_cluster`] with the agent's `--ip-masq` as given: off, the CNI bridge plugin
/// masquerades pod traffic leaving the pod's subnet instead (`ipMasq`, as upstream's CNI
/// configuration does), pod-to-pod across nodes included, on the kernel path.
fn dual_stack_cluster_masq(
    nodes: usize,
    backend: &str,
    underlay: Underlay,
    dataplane: Dataplane,
    ip_masq: bool,
) -> Result<Cluster> {
    let spec = dual_stack_spec(nodes, backend, underlay, dataplane, ip_masq)?;
    Cluster::up(spec, &|line| eprintln!("{line}"), &|| false)
}

/// The specification [`dual_stack_cluster_masq`] brings up.
fn dual_stack_spec(
    nodes: usize,
    backend: &str,
    underlay: Underlay,
    dataplane: Dataplane,
    ip_masq: bool,
) -> Result<ClusterSpec> {
    let topology = TopologySpec::new(nodes, underlay)
        .ipv6(true)
        .cni_plugin(bins::test_cni_plugin()?);
    let mut spec = ClusterSpec::new(topology, backend, bins::test_agent()?);
    spec.ipv6_network = Some(NETWORK_V6.parse()?);
    spec.pods_per_node = 1;
    spec.ip_masq = ip_masq;
    spec.dataplane = dataplane;
    Ok(spec)
}

/// Packets the fast path of the agent in `ns` counted under `reason` (any program).
fn fast(ns: &NetNs, reason: &str) -> Result<f64> {
    fastpath::packets(ns, DEFAULT_HEALTHZ_PORT, reason)
}

/// Fails unless the agent in `ns` runs the fast path.
fn on_fast_path(ns: &NetNs) -> Result<()> {
    fastpath::expect_path(ns, DEFAULT_HEALTHZ_PORT, "ebpf")
}

/// `count` ICMPv6 echo requests from `ns` to `dst` with identifier `id` (the kernel computes
/// the ICMPv6 checksum of a raw socket's messages in software); how many were answered.
fn ping6(ns: &NetNs, dst: Ipv6Addr, id: u16, count: u16) -> Result<u16> {
    Ok(echoes(&icmp6_socket(ns)?, dst, id, count, Duration::ZERO))
}

/// A raw ICMPv6 socket in `ns` (usable from any thread).
fn icmp6_socket(ns: &NetNs) -> Result<OwnedFd> {
    ns.enter(|| -> Result<OwnedFd> {
        // SAFETY: plain socket(2); the descriptor is owned right away.
        let raw = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_RAW, libc::IPPROTO_ICMPV6) };
        ensure!(raw >= 0, "socket: {}", std::io::Error::last_os_error());
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    })?
}

/// `count` ICMPv6 echo requests through `fd` to `dst` with identifier `id`, `interval` apart,
/// each waited for up to 500 ms; how many were answered.
fn echoes(fd: &OwnedFd, dst: Ipv6Addr, id: u16, count: u16, interval: Duration) -> u16 {
    let timeout = libc::timeval {
        tv_sec: 0,
        tv_usec: 300_000,
    };
    // SAFETY: setsockopt reads a timeval of the size given.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const timeout).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        );
    }
    // SAFETY: sockaddr_in6 is plain old data; all-zero is valid.
    let mut addr: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    addr.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    addr.sin6_addr.s6_addr = dst.octets();
    let mut answered = BTreeSet::new();
    for seq in 0..count {
        let mut msg = vec![128, 0, 0, 0];
        msg.extend_from_slice(&id.to_be_bytes());
        msg.extend_from_slice(&seq.to_be_bytes());
        msg.extend_from_slice(b"flannel fast path ipv6 echo");
        // SAFETY: sendto reads msg and a sockaddr_in6 of the size given.
        unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            );
        }
        let deadline = Instant::now() + Duration::from_millis(500);
        while Instant::now() < deadline {
            let mut buf = [0u8; 512];
            // SAFETY: recv writes at most buf.len() bytes into buf.
            let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 8 {
                continue;
            }
            let got_id = u16::from_be_bytes([buf[4], buf[5]]);
            let got_seq = u16::from_be_bytes([buf[6], buf[7]]);
            if buf[0] == 129 && got_id == id && got_seq == seq {
                answered.insert(seq);
                break;
            }
        }
        std::thread::sleep(interval);
    }
    answered.len() as u16
}

/// The VXLAN-over-IPv6 frame on a captured underlay whose inner packet is an ICMPv6 echo
/// request with identifier `id`, verified (checksums of every layer).
fn vxlan6_echo(frame: &[u8], id: u16) -> Option<packet::Frame> {
    let parsed = packet::parse(frame).ok()?;
    let ParsedL3::Ipv6(outer) = &parsed.l3 else {
        return None;
    };
    let ParsedL4::Udp {
        dst_port, payload, ..
    } = &outer.l4
    else {
        return None;
    };
    if *dst_port != 8472 {
        return None;
    }
    let (_, inner) = packet::parse_vxlan(payload).ok()?;
    let inner = packet::parse(inner).ok()?;
    let ParsedL3::Ipv6(ip) = &inner.l3 else {
        return None;
    };
    match &ip.l4 {
        ParsedL4::Icmp { ty: 128, rest, .. } if rest[..2] == id.to_be_bytes() => Some(parsed),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------

#[test]
fn vxlan_dual_stack_three_nodes_on_the_fast_path() {
    require_root!();
    require_ebpf_object!();
    check(vxlan_dual_stack());
}

fn vxlan_dual_stack() -> Result<()> {
    let cluster = dual_stack_cluster(3, "vxlan", Underlay::L3, Dataplane::Ebpf)?;
    let topo = cluster.topology();
    for node in topo.nodes() {
        on_fast_path(node.ns()).context(node.name())?;
    }
    let pods: Vec<&Pod> = topo.pods().iter().collect();
    probe::pods_talk(&pods, true)?;
    for node in topo.nodes() {
        for reason in [
            "fast_vxlan",
            "fast_deliver_vxlan",
            "fast_vxlan6",
            "fast_deliver_vxlan6",
        ] {
            ensure!(
                fast(node.ns(), reason)? >= 4.0,
                "{}: {reason} did not move",
                node.name()
            );
        }
    }
    // The underlay carries VXLAN over IPv6 whose every checksum verifies.
    let (p1, p3) = (&pods[0], &pods[2]);
    let underlay = Capture::start(topo.node(1).ns(), "eth0")?;
    let answered = ping6(p1.ns(), p3.ip6_required()?, 0x6a01, 3)?;
    ensure!(answered == 3, "{answered} of 3 ICMPv6 echoes answered");
    let frame = underlay.find(Duration::from_secs(2), |f| {
        vxlan6_echo(f, 0x6a01).map(|_| f.to_vec())
    })?;
    packet::verify(&frame).context("the fast path's VXLAN-over-IPv6 frame")?;
    // A bulk transfer (its GSO packets take flannel-v6.1, its flow follows) arrives intact.
    let mbit = probe::transfer_mbit(p1.ns(), p3.ns(), IpAddr::V6(p3.ip6_required()?), 8 << 20)?;
    eprintln!("8 MiB TCP over IPv6 node1 → node3: {mbit:.0} Mbit/s");
    Ok(())
}

/// IPv6 fragments and packets with extension headers arrive, on VXLAN over a routed underlay
/// (where a packet that left unencapsulated would be lost) and on host-gw, a pod's fragments
/// with its own source: see [`fragments_and_options_arrive`].
#[test]
fn ipv6_fragments_and_extension_headers_arrive() {
    require_root!();
    require_ebpf_object!();
    check(fragments_and_options_arrive("vxlan", Underlay::L3));
    check(fragments_and_options_arrive("host-gw", Underlay::L2));
}

/// Two dual-stack nodes of `backend` on the fast path, agents without `--ip-masq` (so the CNI
/// bridge masquerades what crosses netfilter): UDP datagrams over IPv6 reach the remote pod
/// intact: a pod's 3,000-byte datagram (fragments, the pod MTU being 1,430 or 1,500), which
/// node1's `tc_from_bridge` sends like the rest of the flow, from the pod's own address and
/// port (`fast_host_gw6`, or `fast_vxlan6_device` through `flannel-v6.1`); the node's own
/// 5,000-byte one; and a pod's 300-byte datagrams with destination options and with
/// hop-by-hop options, which the programs leave to the kernel (`pass_ipv6_ext_header`).
fn fragments_and_options_arrive(backend: &str, underlay: Underlay) -> Result<()> {
    let cluster = dual_stack_cluster_masq(2, backend, underlay, Dataplane::Ebpf, false)?;
    let topo = cluster.topology();
    let (from, to) = (topo.first_pod_on(1)?, topo.first_pod_on(2)?);
    // Routes, neighbours and the flows' paths in place first (a fragment waiting for a
    // neighbour can be dropped from its queue).
    probe::pods_talk(&[from, to], false)?;
    let node1 = topo.node(1);
    let dst = to.ip6_required()?;
    let node1_addr = node1.addr6().context("node1 has no IPv6 address")?;
    let sent_as = match backend {
        "vxlan" => "fast_vxlan6_device",
        _ => "fast_host_gw6",
    };
    let (passed_before, sent_before) = (
        fast(node1.ns(), "pass_ipv6_ext_header")?,
        fast(node1.ns(), sent_as)?,
    );
    let rx = probe::udp_listener(to.ns(), SocketAddr::new(IpAddr::V6(dst), 6000))?;
    // Hop-by-hop and destination options headers holding only padding (PadN, 4 bytes).
    let padding = [0u8, 0, 1, 4, 0, 0, 0, 0];
    let cases = [
        (
            "a pod's fragments",
            from.ns(),
            from.ip6_required()?,
            3000,
            None,
        ),
        ("the node's fragments", node1.ns(), node1_addr, 5000, None),
        (
            "destination options",
            from.ns(),
            from.ip6_required()?,
            300,
            Some(libc::IPV6_DSTOPTS),
        ),
        (
            "hop-by-hop options",
            from.ns(),
            from.ip6_required()?,
            300,
            Some(libc::IPV6_HOPOPTS),
        ),
    ];
    for (what, ns, src, size, option) in cases {
        let tx = probe::udp_listener(ns, SocketAddr::new(IpAddr::V6(src), 0))?;
        if let Some(name) = option {
            set_ipv6_option(&tx, name, &padding).context(what)?;
        }
        let payload: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let seen = probe::send_and_receive(&tx, &rx, &payload, Duration::from_secs(2))
            .with_context(|| format!("{backend}: {what}: the {size}-byte datagram"))?;
        let source = tx.local_addr()?;
        ensure!(
            what != "a pod's fragments" || seen == source,
            "{backend}: {what} arrived from {seen}, not from {source}"
        );
    }
    let passed = fast(node1.ns(), "pass_ipv6_ext_header")? - passed_before;
    let sent = fast(node1.ns(), sent_as)? - sent_before;
    ensure!(
        passed >= 2.0 && sent >= 3.0,
        "{backend}: node1 passed {passed} packets with extension headers (want at least 2) and \
         counted {sent} under {sent_as} (want the pod's 3 fragments)"
    );
    Ok(())
}

#[test]
fn vxlan_v6_learns_a_narrower_path_mtu() {
    require_root!();
    require_ebpf_object!();
    check(narrower_path_v6());
}

/// Two dual-stack VXLAN nodes behind a router whose link to node2 has MTU 1,400 (the nodes'
/// 1,500): a pod's UDP datagrams over IPv6 of 1,400 bytes (1,470 with VXLAN over IPv6, too
/// big for that link) to a pod on node2 arrive once the first ones taught the path MTU: the
/// pod learnt it less the tunnel's 70 bytes (1,330) and fragments its datagrams.
fn narrower_path_v6() -> Result<()> {
    let cluster = dual_stack_cluster(2, "vxlan", Underlay::L3, Dataplane::Ebpf)?;
    let topo = cluster.topology();
    let (from, to) = (topo.first_pod_on(1)?, topo.first_pod_on(2)?);
    probe::pods_talk(&[from, to], false)?;
    topo.hub()
        .run(&["ip", "link", "set", "br2", "mtu", "1400"])?;
    let dst = to.ip6_required()?;
    let rx = probe::udp_listener(to.ns(), SocketAddr::new(IpAddr::V6(dst), 6000))?;
    let src = from.ip6_required()?;
    let tx = probe::udp_listener(from.ns(), SocketAddr::new(IpAddr::V6(src), 0))?;
    let payload = vec![0x5a; 1400 - 48];
    // A send may fail while the pod's stack takes in a Packet Too Big: not arrived.
    let arrived = (0..20)
        .filter(|_| probe::send_and_receive(&tx, &rx, &payload, Duration::from_millis(300)).is_ok())
        .count();
    let route = from.run(&["ip", "-6", "route", "get", &dst.to_string()])?;
    ensure!(
        arrived >= 15 && route.contains("mtu 1330"),
        "{arrived} of 20 datagrams of 1,400 bytes arrived; the pod's route: {route}"
    );
    Ok(())
}

/// `setsockopt(IPPROTO_IPV6, name, value)` for an option whose value is bytes.
fn set_ipv6_option(socket: &std::net::UdpSocket, name: libc::c_int, value: &[u8]) -> Result<()> {
    // SAFETY: the option value is a valid buffer of the length given.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IPV6,
            name,
            value.as_ptr().cast(),
            value.len() as libc::socklen_t,
        )
    };
    ensure!(
        rc == 0,
        "setsockopt(IPPROTO_IPV6, {name}): {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// With the CNI bridge plugin masquerading (the agent's `--ip-masq` off), every packet of an
/// IPv6 VXLAN flow still takes one path: a bulk transfer's GSO packets go from the fast path
/// straight to `flannel-v6.1` (which segments them), not through the stack, whose masquerade
/// would rewrite them and not the flow's first packets (the receiver would reset the
/// connection, and the flow would be left to the kernel for good).
#[test]
fn vxlan_v6_bulk_transfer_keeps_one_path_under_cni_masquerade() {
    require_root!();
    require_ebpf_object!();
    check(vxlan_v6_bulk_under_cni_masquerade());
}

fn vxlan_v6_bulk_under_cni_masquerade() -> Result<()> {
    let cluster = dual_stack_cluster_masq(2, "vxlan", Underlay::L2, Dataplane::Ebpf, false)?;
    let topo = cluster.topology();
    let (p1, p2) = (topo.first_pod_on(1)?, topo.first_pod_on(2)?);
    let node1 = topo.node(1).ns();
    // Older kubelets drop locally sent packets with mark bit 0x8000 (KUBE-FIREWALL): the
    // outer packets flannel-v6.1 sends for the fast path must not carry it.
    node1.run(&[
        "ip6tables",
        "-A",
        "OUTPUT",
        "-m",
        "mark",
        "--mark",
        "0x8000/0x8000",
        "-j",
        "DROP",
    ])?;
    let nat_before = fast(node1, "pass_nat_reply")?;
    let learnt_before = fast(node1, "learn_kernel_flow")?;
    for round in 1..=3 {
        let mbit = probe::transfer_mbit(p1.ns(), p2.ns(), IpAddr::V6(p2.ip6_required()?), 16 << 20)
            .with_context(|| format!("transfer {round}"))?;
        eprintln!("16 MiB TCP over IPv6 VXLAN, CNI masquerade, round {round}: {mbit:.0} Mbit/s");
    }
    ensure!(
        fast(node1, "fast_vxlan6_device")? >= 1.0,
        "node 1 sent no GSO packet through flannel-v6.1"
    );
    ensure!(
        fast(node1, "fast_vxlan6")? >= 3.0,
        "node 1 encapsulated no packet of the transfers itself"
    );
    ensure!(
        fast(node1, "pass_nat_reply")? == nat_before,
        "pod 2 answered a masqueraded source: node 1 sent part of the flow through the stack"
    );
    ensure!(
        fast(node1, "learn_kernel_flow")? == learnt_before,
        "node 1 took the outer packets of flannel-v6.1 for a kernel flow's"
    );
    Ok(())
}

/// An agent restart on the fast path leaves IPv6 pod traffic alone: the programs stay attached
/// while the agent is down and the restarted agent adopts the pinned IPv6 maps, so ICMPv6
/// echoes 10 ms apart and a TCP ping-pong over IPv6, both running across the 2 s the agent is
/// down and its restart, lose nothing; node 1's pinned counters show its programs carrying
/// them on the fast path while no agent ran.
#[test]
fn ipv6_traffic_crosses_an_agent_restart() {
    require_root!();
    require_ebpf_object!();
    check(ipv6_restart());
}

fn ipv6_restart() -> Result<()> {
    let mut cluster = dual_stack_cluster(2, "host-gw", Underlay::L2, Dataplane::Ebpf)?;
    let (p1, p2_path, dst) = {
        let topo = cluster.topology();
        let (p1, p2) = (topo.first_pod_on(1)?, topo.first_pod_on(2)?);
        (p1.name().to_owned(), p2.ns().path(), p2.ip6_required()?)
    };
    let lab = bins::lab_tool()?;
    let server = std::net::SocketAddr::new(IpAddr::V6(dst), 11113).to_string();
    let mut rr_server = rr_server(&p2_path, &lab, &server)?;
    let outcome = restart_under_ipv6_traffic(&mut cluster, &p1, &lab, &server, dst);
    let _ = rr_server.kill();
    let _ = rr_server.wait();
    outcome
}

/// `flannel-lab rr server` listening on `server` in the network namespace at `ns_path`.
fn rr_server(
    ns_path: &std::path::Path,
    lab: &std::path::Path,
    server: &str,
) -> Result<std::process::Child> {
    std::process::Command::new("nsenter")
        .arg(format!("--net={}", ns_path.display()))
        .arg("--")
        .arg(lab)
        .args(["rr", "server", "--listen", server])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("flannel-lab rr server")
}

fn restart_under_ipv6_traffic(
    cluster: &mut Cluster,
    p1: &str,
    lab: &std::path::Path,
    server: &str,
    dst: Ipv6Addr,
) -> Result<()> {
    let lab = lab.to_str().context("flannel-lab path")?;
    let (fd, p1_path, fast_before) = {
        let topo = cluster.topology();
        let pod = topo.pod(p1).context("pod 1")?;
        wait::until_ok(Duration::from_secs(10), "the rr server", || {
            pod.ns()
                .run(&[lab, "rr", "client", "--server", server, "--seconds", "0.2"])
                .map(drop)
        })?;
        (
            icmp6_socket(pod.ns())?,
            pod.ns().path(),
            fast(topo.node(1).ns(), "fast_host_gw6")?,
        )
    };
    const ECHOES: u16 = 500;
    let pinger =
        std::thread::spawn(move || echoes(&fd, dst, 0x6b01, ECHOES, Duration::from_millis(10)));
    let pingpong = std::process::Command::new("nsenter")
        .arg(format!("--net={}", p1_path.display()))
        .arg("--")
        .args([lab, "rr", "client", "--server", server, "--seconds", "6"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("flannel-lab rr client")?;
    std::thread::sleep(Duration::from_secs(1));
    let agent = cluster.agent_mut(1).context("node 1's agent")?;
    let status = agent.stop(Duration::from_secs(10))?;
    ensure!(
        status.success(),
        "node 1's agent exited with {status} on SIGTERM"
    );
    let pins = cluster.topology().node(1).bpf_pin_path().to_owned();
    let at_stop = fastpath::pinned_counters(&pins)?;
    std::thread::sleep(Duration::from_secs(2));
    // No agent ran for 2 s: 200 echoes and their answers, plus the ping-pong, crossed node 1,
    // and its programs (still attached) counted them on the fast path.
    let while_down = fastpath::pinned_counters(&pins)?;
    for (program, reason) in [
        (programs::TC_FROM_BRIDGE, Reason::FastHostGw6),
        (programs::TC_FROM_NETDEV, Reason::FastDeliver6),
    ] {
        let grew = fastpath::grown(
            &at_stop.packets,
            &while_down.packets,
            program,
            reason.name(),
        );
        ensure!(
            grew >= u64::from(ECHOES) / 5,
            "node 1's {program} counted {grew} {} packets while the agent was down: {}",
            reason.name(),
            fastpath::growth_text(&at_stop.packets, &while_down.packets)
        );
    }
    cluster.agent_mut(1).context("node 1's agent")?.restart()?;
    let node1 = cluster.topology().node(1).ns();
    wait::until_ok(
        Duration::from_secs(30),
        "node 1's agent on the fast path",
        || on_fast_path(node1),
    )?;
    let answered = pinger
        .join()
        .map_err(|_| anyhow::anyhow!("the pinger panicked"))?;
    ensure!(
        answered == ECHOES,
        "{answered} of {ECHOES} ICMPv6 echoes answered across the restart"
    );
    let out = pingpong
        .wait_with_output()
        .context("flannel-lab rr client")?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "the TCP ping-pong across the restart: {}",
        text.trim()
    );
    let carried = fast(node1, "fast_host_gw6")? - fast_before;
    ensure!(
        carried >= f64::from(ECHOES),
        "node 1's programs carried {carried} IPv6 packets for {ECHOES} echoes and the ping-pong"
    );
    eprintln!(
        "across the restart: {answered} echoes answered, {}",
        text.trim()
    );
    Ok(())
}

/// A pod's IPv6 connection to a remote pod, opened on the kernel path and masqueraded there
/// by the CNI bridge (agents without `--ip-masq`), goes on when node 1's agent restarts on the
/// fast path: the agent finds it in conntrack before attaching (`flannel_agent::bpf::seed`)
/// and its programs keep it on the kernel path (`pass_kernel_flow`). A TCP ping-pong running
/// across the move must not fail; without the seed the next packets leave unmasqueraded and
/// pod 2 resets them.
#[test]
fn ipv6_nated_connection_crosses_the_move_to_the_fast_path() {
    require_root!();
    require_ebpf_object!();
    check(connection_crosses_a_move(
        Dataplane::Kernel,
        Dataplane::Ebpf,
    ));
}

/// The way back: a pod's IPv6 connection to a remote pod that the fast path carried goes on
/// when node 1's agent restarts on the kernel path without `--ip-masq`: the agent enters it
/// into conntrack before detaching (`flannel_agent::bpf::handover`), so the CNI bridge's
/// masquerade leaves it alone. Without that, pod 2 resets the ping-pong.
#[test]
fn ipv6_connection_crosses_the_move_back_to_the_kernel_path() {
    require_root!();
    require_ebpf_object!();
    check(connection_crosses_a_move(
        Dataplane::Ebpf,
        Dataplane::Kernel,
    ));
}

/// A TCP ping-pong over IPv6 from pod 1 to pod 2 (agents without `--ip-masq`) running while
/// node 1's agent restarts from dataplane `from` to `to` must not fail.
fn connection_crosses_a_move(from: Dataplane, to: Dataplane) -> Result<()> {
    let mut cluster = dual_stack_cluster_masq(2, "vxlan", Underlay::L2, from, false)?;
    let (p1_path, p2_path, dst) = {
        let topo = cluster.topology();
        let (p1, p2) = (topo.first_pod_on(1)?, topo.first_pod_on(2)?);
        (p1.ns().path(), p2.ns().path(), p2.ip6_required()?)
    };
    let lab = bins::lab_tool()?;
    let lab_str = lab.to_str().context("flannel-lab path")?.to_owned();
    let server = SocketAddr::new(IpAddr::V6(dst), 11114).to_string();
    let mut rr_server = rr_server(&p2_path, &lab, &server)?;
    let outcome = (|| -> Result<()> {
        let rr = |seconds: &str| {
            std::process::Command::new("nsenter")
                .arg(format!("--net={}", p1_path.display()))
                .arg("--")
                .args([
                    &lab_str,
                    "rr",
                    "client",
                    "--server",
                    &server,
                    "--seconds",
                    seconds,
                ])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .context("flannel-lab rr client")
        };
        wait::until_ok(Duration::from_secs(20), "the rr server over IPv6", || {
            let out = rr("0.2")?.wait_with_output()?;
            ensure!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(())
        })?;
        let pingpong = rr("8")?;
        std::thread::sleep(Duration::from_secs(1));
        cluster
            .agent_mut(1)
            .context("node 1's agent")?
            .restart_with(|args| {
                args.retain(|a| !a.starts_with("--dataplane"));
                args.push(format!("--dataplane={to}"));
            })?;
        let node1 = cluster.topology().node(1).ns();
        wait::until_ok(Duration::from_secs(30), "node 1 on its new path", || {
            if to == Dataplane::Kernel {
                return fastpath::expect_path(node1, DEFAULT_HEALTHZ_PORT, "kernel");
            }
            on_fast_path(node1)?;
            fastpath::expect_pod_ports(node1, DEFAULT_HEALTHZ_PORT, 1)
        })?;
        let out = pingpong
            .wait_with_output()
            .context("flannel-lab rr client")?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        ensure!(
            out.status.success(),
            "the TCP ping-pong across the move from {from} to {to}: {}",
            text.trim()
        );
        if to == Dataplane::Kernel {
            eprintln!("across the move back: {}", text.trim());
            return Ok(());
        }
        let kept = fast(node1, "pass_kernel_flow")?;
        ensure!(
            kept >= 10.0,
            "node 1's programs passed {kept} packets of the connection to the kernel"
        );
        eprintln!(
            "across the move: {}; {kept} packets kept on the kernel path",
            text.trim()
        );
        Ok(())
    })();
    let _ = rr_server.kill();
    let _ = rr_server.wait();
    outcome
}

/// An IPv6 DNS-like UDP flow through a Service whose kernel-flow entry is lost from
/// `FLANNEL_KFLOWS6` (as the LRU evicts one) comes back from conntrack within a resync
/// (`--ebpf-conntrack-resync=1`), with no packet of the flow to learn it from: else an answer
/// the backend sends before the client's next query (which would teach the programs the flow
/// again) would be delivered past the stack, from the pod's own address instead of the
/// Service's, and the client's connected socket would not take it. Such a flow (one query
/// answered, not yet a stream) is not held, so the resync's rewrite of the LRU table is what
/// keeps it. Without the resync the entry never comes back. A pod on node 1 sends to an
/// ip6tables DNAT (a kube-proxy ClusterIP) to a UDP echo on node 2's pod over VXLAN, with
/// `--ip-masq`; the flow is idle while its entry is removed and comes back; node 1 counts it
/// as kept, and the next queries are answered from the Service's address. The IPv4 twin is
/// `agent_ebpf::ebpf_lost_kernel_flows_come_back_from_conntrack`.
#[test]
fn ipv6_lost_kernel_flows_come_back_from_conntrack() {
    require_root!();
    require_ebpf_object!();
    check(lost_kernel_flows_come_back());
}

fn lost_kernel_flows_come_back() -> Result<()> {
    let mut spec = dual_stack_spec(2, "vxlan", Underlay::L2, Dataplane::Ebpf, true)?;
    spec.agent_args.push("--ebpf-conntrack-resync=1".into());
    let cluster = Cluster::up(spec, &|line| eprintln!("{line}"), &|| false)?;
    let t = cluster.topology();
    let (client, server) = (t.first_pod_on(1)?, t.first_pod_on(2)?);
    let (client_ip, server_ip) = (client.ip6_required()?, server.ip6_required()?);
    let echo = probe::UdpEcho::start(server.ns(), IpAddr::V6(server_ip), 7100)?;
    let service = SocketAddr::new("fd00:96::10".parse()?, 53);
    t.node(1).dnat_udp(service, echo.addr())?;
    let client_udp = probe::UdpClient::connect(client.ns(), service)?;
    let local_port = client_udp.port()?.to_be_bytes();
    client_udp.echo("q1").context("through the Service")?;
    let pins = t.node(1).bpf_pin_path();
    let ours = |k: &flannel_common::v6::FlowKey6| {
        k.local_addr == client_ip.octets()
            && k.remote_addr == server_ip.octets()
            && k.local_port == local_port
            && k.remote_port == 7100u16.to_be_bytes()
            && k.proto == 17
    };
    fastpath::kernel_flow_comes_back(
        t.node(1).ns(),
        DEFAULT_HEALTHZ_PORT,
        pins,
        ours,
        Duration::from_secs(20),
    )
    .context("node 1")?;
    for i in 2..5 {
        client_udp
            .echo(&format!("q{i}"))
            .context("through the Service")?;
    }
    Ok(())
}

#[test]
fn host_gw_dual_stack_on_the_fast_path() {
    require_root!();
    require_ebpf_object!();
    check(host_gw_dual_stack());
}

fn host_gw_dual_stack() -> Result<()> {
    let cluster = dual_stack_cluster(3, "host-gw", Underlay::L2, Dataplane::Ebpf)?;
    let topo = cluster.topology();
    let pods: Vec<&Pod> = topo.pods().iter().collect();
    probe::pods_talk(&pods, true)?;
    for node in topo.nodes() {
        for reason in [
            "fast_host_gw",
            "fast_deliver",
            "fast_host_gw6",
            "fast_deliver6",
        ] {
            ensure!(
                fast(node.ns(), reason)? >= 4.0,
                "{}: {reason} did not move",
                node.name()
            );
        }
    }
    let (p1, p2) = (&pods[0], &pods[1]);
    let mbit = probe::transfer_mbit(p1.ns(), p2.ns(), IpAddr::V6(p2.ip6_required()?), 16 << 20)?;
    eprintln!("16 MiB TCP over IPv6 node1 → node2, host-gw: {mbit:.0} Mbit/s");
    ensure!(fast(topo.node(1).ns(), "fast_host_gw6")? >= 100.0);
    Ok(())
}

#[test]
fn vxlan_v6_mixed_pair_fast_path_and_kernel() {
    require_root!();
    require_ebpf_object!();
    check(mixed_pair());
}

fn mixed_pair() -> Result<()> {
    let mut cluster = dual_stack_cluster(2, "vxlan", Underlay::L2, Dataplane::Kernel)?;
    // Node 1 on the kernel path: flannel-v6.1's frame for an ICMPv6 echo.
    let kernel = {
        let topo = cluster.topology();
        let pods = topo.pods();
        let at_n2 = Capture::start(topo.node(2).ns(), "eth0")?;
        // (The first echoes may go unanswered while neighbour discovery and DAD settle.)
        wait::until_ok(Duration::from_secs(20), "the kernel path's echo", || {
            ensure!(
                ping6(pods[0].ns(), pods[1].ip6_required()?, 0x6b01, 1)? == 1,
                "no answer"
            );
            Ok(())
        })?;
        at_n2.find(Duration::from_secs(2), |f| vxlan6_echo(f, 0x6b01))?
    };

    // Node 1 moves to the fast path (same lease, same flannel-v6.1).
    let mut spec: AgentSpec = cluster.agent_spec();
    spec.dataplane = Some(Dataplane::Ebpf);
    cluster
        .agent_mut(1)
        .context("agent 1")?
        .stop(Duration::from_secs(5))?;
    let topo = cluster.topology();
    let (n1, n2) = (topo.node(1), topo.node(2));
    let fast_agent = Agent::start(n1, &spec)?;
    let pods = topo.pods();
    let (p1, p2) = (&pods[0], &pods[1]);
    let dst = p2.ip6_required()?;
    wait::until_ok(Duration::from_secs(30), "node1 on the fast path", || {
        on_fast_path(n1.ns())?;
        fastpath::expect_pod_ports(n1.ns(), DEFAULT_HEALTHZ_PORT, 1)
    })?;
    wait::until_ok(Duration::from_secs(20), "pods reach each other", || {
        probe::pods_talk(&[p1, p2], true)
    })?;
    let before = fast(n1.ns(), "fast_vxlan6")?;
    let at_n2 = Capture::start(n2.ns(), "eth0")?;
    ensure!(ping6(p1.ns(), dst, 0x6b01, 1)? == 1, "fast path echo");
    let fast_frame = at_n2.find(Duration::from_secs(2), |f| vxlan6_echo(f, 0x6b01))?;
    ensure!(
        fast(n1.ns(), "fast_vxlan6")? > before,
        "not sent by the fast path"
    );
    ensure!(
        fast_frame.checksums_ok(),
        "the fast path's frame does not verify"
    );
    // (flannel-v6.1's own frame carries the partial sum of checksum offload on a veth, so only
    // the fast path's frame can be verified on this capture: its checksum is complete.)

    // Field by field: everything but the UDP source port and checksum (the flow hash may
    // differ between the two transmit paths, and flannel-v6.1's checksum is offloaded); the
    // VXLAN header and the whole inner frame are identical (same echo, same sequence number).
    let outer = |f: &packet::Frame| match &f.l3 {
        ParsedL3::Ipv6(ip) => ip.clone(),
        _ => unreachable!("checked by vxlan6_echo"),
    };
    let (k, f) = (outer(&kernel), outer(&fast_frame));
    ensure!((k.src, k.dst) == (f.src, f.dst), "outer addresses");
    ensure!(
        (k.traffic_class, k.flow_label, k.hop_limit, k.payload_length)
            == (f.traffic_class, f.flow_label, f.hop_limit, f.payload_length),
        "outer IPv6 header: kernel {k:?}\nfast {f:?}"
    );
    ensure!(
        (kernel.src, kernel.dst) == (fast_frame.src, fast_frame.dst),
        "outer MACs"
    );
    let udp = |ip: &packet::ParsedIpv6| match &ip.l4 {
        ParsedL4::Udp {
            dst_port, payload, ..
        } => (*dst_port, payload.clone()),
        _ => unreachable!("checked by vxlan6_echo"),
    };
    let ((kport, kvx), (fport, fvx)) = (udp(&k), udp(&f));
    ensure!(kport == 8472 && fport == 8472);
    ensure!(
        kvx == fvx,
        "VXLAN header and inner frame differ\n kernel:\n{}fast:\n{}",
        packet::hexdump(&kvx),
        packet::hexdump(&fvx)
    );

    // Both directions between the fast path and the kernel path, small and bulk.
    probe::pods_talk(&[p1, p2], true)?;
    let out = probe::transfer_mbit(p1.ns(), p2.ns(), IpAddr::V6(dst), 4 << 20)?;
    let back = probe::transfer_mbit(p2.ns(), p1.ns(), IpAddr::V6(p1.ip6_required()?), 4 << 20)?;
    eprintln!("4 MiB TCP over IPv6, fast → kernel {out:.0} Mbit/s, kernel → fast {back:.0}");
    ensure!(ping6(p2.ns(), p1.ip6_required()?, 0x6b02, 3)? == 3);
    ensure!(fast(n1.ns(), "fast_deliver_vxlan6")? >= 3.0);
    drop(fast_agent);
    Ok(())
}

#[test]
fn ipv6_only_kube_mode_on_the_fast_path() {
    require_root!();
    require_ebpf_object!();
    check(ipv6_only_kube());
}

fn ipv6_only_kube() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut topology = Topology::new(
        TopologySpec::new(2, Underlay::L2)
            .ipv6(true)
            .cni_plugin(bins::test_cni_plugin()?),
    )?;
    let api = kube::api_in_hub(&rt, &topology, &|i| vec![format!("fd00:244:0:{i}::/64")])?;
    let netconf = json!({
        "EnableIPv4": false,
        "EnableIPv6": true,
        "IPv6Network": NETWORK_V6,
        "Backend": {"Type": "vxlan"},
    });
    let mut spec = AgentSpec::new(bins::test_agent()?, kube::NO_ETCD);
    spec.ip_masq = true;
    spec.dataplane = Some(Dataplane::Ebpf);
    let mut agents = kube::start_agents(&topology, &api, &netconf, &spec)?;
    for (node, agent) in topology.nodes().iter().zip(agents.iter_mut()) {
        agent.wait_subnet_env(node, Duration::from_secs(60))?;
        on_fast_path(node.ns()).context(node.name())?;
    }
    for n in 1..=2 {
        topology.add_pod(n)?;
    }
    for node in topology.nodes() {
        wait::until_ok(
            Duration::from_secs(20),
            "the fast path on the pod's port",
            || fastpath::expect_pod_ports(node.ns(), DEFAULT_HEALTHZ_PORT, 1),
        )?;
    }
    let pods: Vec<&Pod> = topology.pods().iter().collect();
    probe::pods_talk(&pods, false)?;
    for node in topology.nodes() {
        ensure!(
            fast(node.ns(), "fast_vxlan6")? >= 2.0
                && fast(node.ns(), "fast_deliver_vxlan6")? >= 2.0,
            "{}: the IPv6-only node did not use the fast path",
            node.name()
        );
    }
    drop(agents);
    Ok(())
}
