//! The udp backend (TUN path) end to end: simulated clusters ([`Cluster::up`]) with real
//! agents, etcd in the hub and pods created through the CNI plugin.
//!
//! * `udp_carries_pods_across_nodes`: three nodes behind a router: `flannel0` as upstream
//!   configures it, no per-peer kernel routes, every pod reaches every pod, a TCP transfer
//!   arrives intact, the underlay carries UDP 8285 → 8285 whose payload is exactly the inner
//!   IPv4 packet, and the inner TTL is decremented once by each agent.
//! * `udp_follows_leases_answers_unknown_destinations_and_accepts_upstream_datagrams`: two
//!   nodes on one segment: ICMP net unreachable for a destination no lease covers, a lease
//!   added and removed in etcd is followed, a hand-built datagram sent from the underlay (what
//!   an upstream udp node sends) reaches the pod, datagrams for other subnets and with an
//!   expiring TTL are dropped and counted, and a deleted `flannel0` comes back.
//!
//! Run: `cargo test -p flannel-tests --test udp -- --nocapture` (as root; skipped otherwise).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use flannel_tests::{
    check,
    lab::{
        agent::DEFAULT_HEALTHZ_PORT,
        bins,
        capture::Capture,
        cluster::{Cluster, ClusterSpec},
        probe, status, wait,
    },
    netns::NetNs,
    packet::{self, Ipv4, ParsedL3, ParsedL4, Udp},
    require_root,
    topology::{TopologySpec, Underlay},
};
use serde_json::Value;

const PORT: u16 = 8285;
/// A subnet no node holds (nodes get 10.244.1.0/24 … 10.244.100.0/24).
const NOWHERE: Ipv4Addr = Ipv4Addr::new(10, 244, 250, 9);

fn udp_cluster(nodes: usize, underlay: Underlay) -> Result<Cluster> {
    let topology = TopologySpec::new(nodes, underlay).cni_plugin(bins::test_cni_plugin()?);
    let mut spec = ClusterSpec::new(topology, "udp", bins::test_agent()?);
    spec.pods_per_node = 1;
    // As upstream's manifest: the agent masquerades (pod-to-pod traffic keeps its source),
    // so the CNI bridge does not.
    spec.ip_masq = true;
    Cluster::up(spec, &|line| eprintln!("{line}"), &|| false)
}

fn json(ns: &NetNs, argv: &[&str]) -> Result<Value> {
    let out = ns.run(argv)?;
    serde_json::from_str(&out).with_context(|| format!("{argv:?} printed {out:?}"))
}

/// `flannel_udp_packets_total{reason="<reason>"}` of the agent in `ns`.
fn udp_counter(ns: &NetNs, reason: &str) -> Result<f64> {
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), DEFAULT_HEALTHZ_PORT);
    let (code, body) = status::http_get(ns, addr, "/metrics")?;
    ensure!(code == 200, "/metrics answered {code}");
    let labels = format!("{{program=\"udp-forwarder\",reason=\"{reason}\"}}");
    Ok(status::parse_metrics(&body)
        .into_iter()
        .find(|s| s.name == "flannel_udp_packets_total" && s.labels == labels)
        .map_or(0.0, |s| s.value))
}

/// Sends one UDP datagram from inside `ns` (with IP TTL `ttl`).
fn send_udp(ns: &NetNs, to: SocketAddr, payload: &[u8], ttl: u32) -> Result<()> {
    let payload = payload.to_vec();
    ns.enter(move || -> Result<()> {
        let s = UdpSocket::bind("0.0.0.0:0")?;
        s.set_ttl(ttl)?;
        s.send_to(&payload, to)?;
        Ok(())
    })?
}

/// TCP connect from inside `ns`: `Ok(())`, or the OS error.
fn tcp_connect(ns: &NetNs, to: SocketAddr, timeout: Duration) -> Result<std::io::Result<()>> {
    ns.enter(move || TcpStream::connect_timeout(&to, timeout).map(|_| ()))
}

/// The inner IPv4 packet of an underlay frame that is a udp-backend datagram, with the outer
/// header: `(outer src, outer dst, src port, dst port, payload)`.
fn udp_datagram(frame: &[u8]) -> Option<(Ipv4Addr, Ipv4Addr, u16, u16, Vec<u8>)> {
    let f = packet::parse(frame).ok()?;
    let ParsedL3::Ipv4(ip) = f.l3 else {
        return None;
    };
    let ParsedL4::Udp {
        src_port,
        dst_port,
        payload,
        ..
    } = ip.l4
    else {
        return None;
    };
    Some((ip.src, ip.dst, src_port, dst_port, payload))
}

/// Parses a raw IPv4 packet (no link header).
fn parse_ip(raw: &[u8]) -> Option<packet::ParsedIpv4> {
    let mut frame = vec![0u8; 12];
    frame.extend_from_slice(&packet::ETH_P_IP.to_be_bytes());
    frame.extend_from_slice(raw);
    match packet::parse(&frame).ok()?.l3 {
        ParsedL3::Ipv4(ip) => Some(ip),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------

#[test]
fn udp_carries_pods_across_nodes() {
    require_root!();
    check(carries_pods_across_nodes());
}

fn carries_pods_across_nodes() -> Result<()> {
    let cluster = udp_cluster(3, Underlay::L3)?;
    let topo = cluster.topology();
    let network = cluster.spec().network;
    let leases = cluster.leases()?;
    ensure!(leases.len() == 3, "leases: {leases:?}");
    for l in &leases {
        ensure!(
            l.backend_type.is_none() && l.backend_data.is_none(),
            "udp leases carry no BackendType/BackendData (upstream): {l:?}"
        );
    }

    for (i, node) in topo.nodes().iter().enumerate() {
        let env = &cluster.subnet_envs()[i];
        ensure!(env.mtu == Some(1472), "FLANNEL_MTU: {env:?}");
        let subnet = env.lease().context("no subnet")?;
        let lease = leases
            .iter()
            .find(|l| l.subnet == subnet)
            .context("lease of the node")?;
        ensure!(lease.public_ip == Some(node.addr()), "{lease:?}");

        let link = json(node.ns(), &["ip", "-j", "-d", "link", "show", "flannel0"])?;
        let link = &link[0];
        ensure!(link["mtu"] == 1472, "flannel0 MTU: {link}");
        ensure!(
            link["linkinfo"]["info_kind"] == "tun",
            "flannel0 kind: {link}"
        );
        let data = &link["linkinfo"]["info_data"];
        ensure!(
            data["type"] == "tun" && data["pi"] == false && data["persist"] == false,
            "flannel0 is a non-persistent TUN without packet info: {data}"
        );
        ensure!(
            link["flags"]
                .as_array()
                .is_some_and(|f| f.iter().any(|x| x == "UP")),
            "flannel0 up: {link}"
        );
        let addrs = json(
            node.ns(),
            &["ip", "-j", "-4", "addr", "show", "dev", "flannel0"],
        )?;
        let addrs: Vec<String> = addrs[0]["addr_info"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or("?"), a["prefixlen"]))
            .collect();
        ensure!(
            addrs == [format!("{}/32", subnet.network())],
            "{}: flannel0 addresses {addrs:?}",
            node.name()
        );
        // The one kernel route of the backend; peers live in the agent's table only.
        let routes = json(
            node.ns(),
            &["ip", "-j", "-4", "route", "show", "proto", "165"],
        )?;
        let dsts: Vec<String> = routes
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                format!(
                    "{} dev {}",
                    r["dst"].as_str().unwrap_or("?"),
                    r["dev"].as_str().unwrap_or("?")
                )
            })
            .collect();
        ensure!(
            dsts == [format!("{network} dev flannel0")],
            "{}: flannel routes {dsts:?}",
            node.name()
        );
    }

    let matrix = cluster.matrix(Duration::from_secs(5))?;
    eprintln!("{matrix}");
    if !matrix.all_ok() {
        let errors: Vec<String> = matrix
            .failed_pairs()
            .into_iter()
            .map(|(i, j)| {
                let e = matrix.cells[i][j].clone().and_then(Result::err);
                format!(
                    "{} → {}: {}",
                    matrix.labels[i],
                    matrix.labels[j],
                    e.unwrap_or_default()
                )
            })
            .collect();
        bail!("pod matrix:\n{matrix}\n{}", errors.join("\n"));
    }

    let (p1, p3) = (
        cluster.topology().first_pod_on(1)?,
        cluster.topology().first_pod_on(3)?,
    );
    let mbit = probe::transfer_mbit(p1.ns(), p3.ns(), IpAddr::V4(p3.ip()), 16 << 20)?;
    eprintln!("16 MiB TCP node1 → node3 over udp: {mbit:.0} Mbit/s");

    // The wire: what node1 sends for a pod datagram, and what the pod on node3 receives.
    let (n1, n3) = (topo.node(1), topo.node(3));
    let underlay = Capture::start(n1.ns(), "eth0")?;
    let at_pod = Capture::start(p3.ns(), "eth0")?;
    let marker = b"flannel udp wire check".to_vec();
    let listener = probe::udp_listener(p3.ns(), SocketAddr::new(IpAddr::V4(p3.ip()), 7200))?;
    send_udp(
        p1.ns(),
        SocketAddr::new(IpAddr::V4(p3.ip()), 7200),
        &marker,
        64,
    )?;
    let from = probe::recv_payload(&listener, &marker, Duration::from_secs(3))?;
    ensure!(from.ip() == IpAddr::V4(p1.ip()), "source {from}");

    let (src, dst, sport, dport, payload) = underlay.find(Duration::from_secs(3), |f| {
        udp_datagram(f).filter(|d| d.3 == PORT && d.4.ends_with(&marker))
    })?;
    ensure!(
        (src, dst, sport, dport) == (n1.addr(), n3.addr(), PORT, PORT),
        "outer {src}:{sport} → {dst}:{dport}"
    );
    let inner = parse_ip(&payload).context("the UDP payload is a raw IPv4 packet")?;
    ensure!(
        usize::from(inner.total_length) == payload.len(),
        "nothing but the inner packet in the payload ({} bytes, inner {})",
        payload.len(),
        inner.total_length
    );
    ensure!(inner.checksum_ok, "inner header checksum");
    ensure!(
        (inner.src, inner.dst) == (p1.ip(), p3.ip()),
        "inner {} → {}",
        inner.src,
        inner.dst
    );
    // 64, −1 by node1's kernel (cni0 → flannel0), −1 by node1's agent.
    ensure!(inner.ttl == 62, "inner TTL on the wire {}", inner.ttl);
    let arrived = at_pod.find(Duration::from_secs(3), |f| {
        let p = packet::parse(f).ok()?;
        match p.l3 {
            ParsedL3::Ipv4(ip) if ip.l4.udp_payload() == Some(&marker[..]) => Some(ip),
            _ => None,
        }
    })?;
    // … −1 by node3's agent, −1 by node3's kernel (flannel0 → cni0).
    ensure!(arrived.ttl == 60, "TTL at the pod {}", arrived.ttl);
    ensure!(arrived.checksum_ok, "header checksum at the pod");

    ensure!(
        udp_counter(n1.ns(), "udp_encap")? > 0.0,
        "node1 counted no encap"
    );
    ensure!(
        udp_counter(n3.ns(), "udp_decap")? > 0.0,
        "node3 counted no decap"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------

#[test]
fn udp_follows_leases_answers_unknown_destinations_and_accepts_upstream_datagrams() {
    require_root!();
    check(follows_leases_and_interoperates());
}

fn follows_leases_and_interoperates() -> Result<()> {
    let cluster = udp_cluster(2, Underlay::L2)?;
    let topo = cluster.topology();
    let (n1, n2) = (topo.node(1), topo.node(2));
    let (p1, p2) = (
        cluster.topology().first_pod_on(1)?,
        cluster.topology().first_pod_on(2)?,
    );
    let prefix = &cluster.spec().etcd_prefix;

    // 1. No lease covers the destination: ICMP net unreachable, so connect fails at once.
    let nowhere = SocketAddr::new(IpAddr::V4(NOWHERE), 80);
    let started = Instant::now();
    match tcp_connect(p1.ns(), nowhere, Duration::from_secs(5))? {
        Err(e) if e.raw_os_error() == Some(libc::ENETUNREACH) => {}
        other => bail!("connect to {nowhere}: want ENETUNREACH, got {other:?}"),
    }
    ensure!(
        started.elapsed() < Duration::from_secs(2),
        "the ICMP error took {:?}",
        started.elapsed()
    );
    ensure!(udp_counter(n1.ns(), "udp_drop_no_route")? >= 1.0);
    ensure!(udp_counter(n1.ns(), "udp_icmp_unreachable")? >= 1.0);

    // 2. A lease for that subnet (a node at the hub's address) is followed: node1 now
    //    encapsulates towards it.
    let key = format!("{prefix}/subnets/10.244.250.0-24");
    let hub = topo.hub_addr();
    cluster.kv().put(
        &key,
        &format!(r#"{{"PublicIP":"{hub}","PublicIPv6":null}}"#),
    )?;
    let underlay = Capture::start(n1.ns(), "eth0")?;
    let marker = b"to the node at the hub".to_vec();
    wait::until(
        Duration::from_secs(10),
        "node1 encapsulating towards the new lease",
        || {
            send_udp(
                p1.ns(),
                SocketAddr::new(IpAddr::V4(NOWHERE), 9),
                &marker,
                64,
            )?;
            underlay
                .find(Duration::from_millis(500), |f| {
                    udp_datagram(f).filter(|d| d.1 == hub && d.3 == PORT && d.4.ends_with(&marker))
                })
                .map(Some)
        },
    )?;

    // 3. The lease goes away: back to ICMP net unreachable.
    cluster.kv().delete_prefix(&key)?;
    wait::until_ok(
        Duration::from_secs(10),
        "node1 forgetting the removed lease",
        || match tcp_connect(p1.ns(), nowhere, Duration::from_secs(1))? {
            Err(e) if e.raw_os_error() == Some(libc::ENETUNREACH) => Ok(()),
            other => bail!("connect: {other:?}"),
        },
    )?;

    // 4. Wire compatibility: a datagram built by hand, as an upstream udp node sends it
    //    (UDP 8285 → 8285, payload = the raw inner IPv4 packet), from the underlay.
    let hub_ns = topo.hub();
    let at_pod = Capture::start(p2.ns(), "eth0")?;
    let listener = probe::udp_listener(p2.ns(), SocketAddr::new(IpAddr::V4(p2.ip()), 7300))?;
    let upstream_pod = Ipv4Addr::new(10, 244, 251, 7);
    let hello = b"hello from an upstream udp node".to_vec();
    let mut inner = Ipv4::new(upstream_pod, p2.ip(), Udp::new(40000, 7300).payload(&hello));
    inner.ttl = 10;
    let datagram = inner.encode();
    let to_n2 = SocketAddr::new(IpAddr::V4(n2.addr()), PORT);
    let send_from_hub = |payload: Vec<u8>| -> Result<()> {
        hub_ns.enter(move || -> Result<()> {
            let s = UdpSocket::bind(SocketAddr::new(IpAddr::V4(hub), PORT))?;
            s.send_to(&payload, to_n2)?;
            Ok(())
        })?
    };
    send_from_hub(datagram)?;
    let from = probe::recv_payload(&listener, &hello, Duration::from_secs(3))?;
    ensure!(
        from == SocketAddr::new(IpAddr::V4(upstream_pod), 40000),
        "the pod saw {from}"
    );
    let arrived = at_pod.find(Duration::from_secs(2), |f| {
        match packet::parse(f).ok()?.l3 {
            ParsedL3::Ipv4(ip) if ip.l4.udp_payload() == Some(&hello[..]) => Some(ip.ttl),
            _ => None,
        }
    })?;
    ensure!(
        arrived == 8,
        "TTL 10 arrives as {arrived} (agent −1, kernel −1)"
    );

    // 5. A datagram for a subnet that is not node2's (the pod on node1) is not relayed, and
    //    one whose TTL would expire is dropped.
    let relay_listener = probe::udp_listener(p1.ns(), SocketAddr::new(IpAddr::V4(p1.ip()), 7301))?;
    let not_local_before = udp_counter(n2.ns(), "udp_drop_not_local")?;
    let relay = b"please relay".to_vec();
    send_from_hub(
        Ipv4::new(upstream_pod, p1.ip(), Udp::new(40000, 7301).payload(&relay)).encode(),
    )?;
    ensure!(
        probe::recv_payload(&relay_listener, &relay, Duration::from_secs(1)).is_err(),
        "node2 relayed a datagram for node1's pod"
    );
    wait::until_ok(
        Duration::from_secs(3),
        "node2 counting the relay attempt",
        || {
            let now = udp_counter(n2.ns(), "udp_drop_not_local")?;
            ensure!(now > not_local_before, "udp_drop_not_local {now}");
            Ok(())
        },
    )?;
    let ttl_before = udp_counter(n2.ns(), "udp_drop_ttl")?;
    let mut dying = Ipv4::new(
        upstream_pod,
        p2.ip(),
        Udp::new(40000, 7300).payload(b"ttl 1"),
    );
    dying.ttl = 1;
    send_from_hub(dying.encode())?;
    ensure!(probe::recv_payload(&listener, b"ttl 1", Duration::from_secs(1)).is_err());
    wait::until_ok(
        Duration::from_secs(3),
        "node2 counting the expired TTL",
        || {
            let now = udp_counter(n2.ns(), "udp_drop_ttl")?;
            ensure!(now > ttl_before, "udp_drop_ttl {now}");
            Ok(())
        },
    )?;

    // 6. flannel0 deleted under the agent: it is created and configured again, traffic flows.
    let old_index = json(n1.ns(), &["ip", "-j", "link", "show", "flannel0"])?[0]["ifindex"].clone();
    n1.run(&["ip", "link", "del", "flannel0"])?;
    let p2_addr = SocketAddr::new(IpAddr::V4(p2.ip()), 7400);
    let echo = p2.ns().enter(move || TcpListener::bind(p2_addr))??;
    wait::until_ok(
        Duration::from_secs(20),
        "pod1 → pod2 after flannel0 was deleted",
        || tcp_connect(p1.ns(), p2_addr, Duration::from_secs(1))?.context("connect"),
    )?;
    drop(echo);
    let link = json(n1.ns(), &["ip", "-j", "-d", "link", "show", "flannel0"])?;
    ensure!(
        link[0]["ifindex"] != old_index && link[0]["mtu"] == 1472,
        "flannel0 after re-creation: {link}"
    );
    let route = n1.run(&["ip", "-4", "route", "show", "dev", "flannel0"])?;
    ensure!(
        route.contains(&cluster.spec().network.to_string()),
        "network route after re-creation: {route}"
    );
    Ok(())
}
