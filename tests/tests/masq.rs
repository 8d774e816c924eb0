//! Masquerade in eBPF with real agents (`--dataplane=ebpf --ip-masq`) in a simulated cluster:
//! pods reach a server in the hub namespace ("the outside", which has no route to the pod
//! network) and the server sees their node's address; many concurrent flows from several
//! pods keep distinct tuples; a long-lived TCP connection survives an agent restart, and
//! connections opened while a restart resizes the NAT maps go on, and so do connections
//! across a restart after the node's pins were removed (and pinned again); replies
//! to unknown tuples reach the node's stack and are counted; a node switched from iptables
//! MASQUERADE to eBPF keeps its kernel-masqueraded connections, and one switched back hands
//! its eBPF-masqueraded connections over without breaking them; so does a node moved to the
//! kernel dataplane, for its pods' connections and for its own that the programs moved.
//!
//! Needs root; skipped otherwise, and when the agent was built without the eBPF object.

use std::{
    collections::BTreeSet,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    path::PathBuf,
    process::Command,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, AtomicU16, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use flannel_common::nat::{NAT_CFG_ENABLED, NAT_CFG_HANDOVER};
use flannel_tests::{
    lab::{
        agent::{Agent, AgentSpec, Dataplane},
        bins,
        cluster::{Cluster, ClusterSpec},
        status::{http_get, parse_metrics},
    },
    netns::NetNs,
    packet,
    topology::{Node, TopologySpec, Underlay},
};

const T: Duration = Duration::from_secs(5);
const SERVER_PORT: u16 = 7100;

fn built(package: &str, bin: &str, env: &str) -> PathBuf {
    bins::cargo_build(package, bin, env).unwrap_or_else(|e| panic!("cannot build {bin}: {e:#}"))
}

fn agent_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| built("flannel-agent", "flannel-agent", "FLANNEL_AGENT_BIN"))
        .clone()
}

fn cni_plugin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| built("flannel-cni", bins::CNI_PLUGIN, "FLANNEL_CNI_BIN"))
        .clone()
}

fn runnable() -> bool {
    if !flannel_tests::is_root() {
        eprintln!("skipped: needs root (network namespaces, BPF)");
        return false;
    }
    if flannel_agent::EBPF_OBJECT.is_empty() {
        eprintln!("skipped: flannel-agent was built with AYA_BUILD_SKIP=1");
        return false;
    }
    true
}

fn up(nodes: usize, pods: usize, dataplane: Dataplane) -> Cluster {
    up_with(nodes, pods, dataplane, &[])
}

fn up_with(nodes: usize, pods: usize, dataplane: Dataplane, extra: &[&str]) -> Cluster {
    let topo = TopologySpec::new(nodes, Underlay::L2).cni_plugin(cni_plugin());
    let mut spec = ClusterSpec::new(topo, "vxlan", agent_bin());
    spec.dataplane = dataplane;
    spec.ip_masq = true;
    spec.pods_per_node = pods;
    spec.agent_args = vec![
        "--ebpf-nat-max-entries=16384".into(),
        "--ip-masq-exclude-cidrs=100.64.0.0/10".into(),
    ];
    spec.agent_args
        .extend(extra.iter().map(|a| (*a).to_owned()));
    Cluster::up(spec, &|line| eprintln!("lab: {line}"), &|| false).expect("cluster up")
}

/// A TCP server in a namespace: on every connection it writes the peer address it sees
/// (`ip:port\n`), then echoes. Stops when dropped.
struct WhoAmI {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl WhoAmI {
    fn start(ns: &NetNs, ip: IpAddr, port: u16) -> WhoAmI {
        let addr = SocketAddr::new(ip, port);
        let listener = ns
            .enter(move || TcpListener::bind(addr))
            .expect("enter")
            .expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut conn, peer)) => {
                        thread::spawn(move || {
                            let _ = conn.set_nonblocking(false);
                            if conn.write_all(format!("{peer}\n").as_bytes()).is_err() {
                                return;
                            }
                            let mut buf = [0u8; 4096];
                            while let Ok(n) = conn.read(&mut buf) {
                                if n == 0 || conn.write_all(&buf[..n]).is_err() {
                                    return;
                                }
                            }
                        });
                    }
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        WhoAmI { addr, stop }
    }
}

impl Drop for WhoAmI {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A UDP server in a namespace answering every datagram with the peer address it sees.
fn udp_whoami(ns: &NetNs, addr: SocketAddr) -> Arc<AtomicBool> {
    let sock = ns
        .enter(move || UdpSocket::bind(addr))
        .expect("enter")
        .expect("bind");
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while !flag.load(Ordering::Relaxed) {
            if let Ok((_, peer)) = sock.recv_from(&mut buf) {
                let _ = sock.send_to(peer.to_string().as_bytes(), peer);
            }
        }
    });
    stop
}

/// A connection from a pod to a [`WhoAmI`], and the address the server saw.
struct Conn {
    stream: BufReader<TcpStream>,
    local: SocketAddr,
    seen: SocketAddr,
}

impl Conn {
    fn open(from: &NetNs, server: SocketAddr) -> Conn {
        let stream = from
            .enter(move || TcpStream::connect_timeout(&server, T))
            .expect("enter")
            .unwrap_or_else(|e| panic!("connect to {server}: {e}"));
        Conn::greeted(stream)
    }

    /// [`Conn::open`] from the address and port `local`.
    fn open_from(from: &NetNs, local: SocketAddrV4, server: SocketAddrV4) -> Conn {
        let stream = from
            .enter(move || connect_from(local, server))
            .expect("enter")
            .unwrap_or_else(|e| panic!("connect from {local} to {server}: {e}"));
        Conn::greeted(stream)
    }

    /// A connection to a [`WhoAmI`] after its greeting.
    fn greeted(stream: TcpStream) -> Conn {
        stream.set_read_timeout(Some(T)).expect("timeout");
        let local = stream.local_addr().expect("local address");
        let mut stream = BufReader::new(stream);
        let mut line = String::new();
        stream.read_line(&mut line).expect("the server's greeting");
        let seen = line
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{line:?}: {e}"));
        Conn {
            stream,
            local,
            seen,
        }
    }

    /// Sends `data` and checks it comes back.
    fn echo(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.stream.get_mut().write_all(data)?;
        let mut back = vec![0u8; data.len()];
        self.stream.read_exact(&mut back)?;
        if back != data {
            return Err(std::io::Error::other("echo differs"));
        }
        Ok(())
    }
}

/// A TCP connection from the address and port `local` to `server`, from the calling thread's
/// network namespace.
fn connect_from(local: SocketAddrV4, server: SocketAddrV4) -> nix::Result<TcpStream> {
    use nix::sys::{
        socket::{
            AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, setsockopt, socket,
            sockopt::SendTimeout,
        },
        time::TimeVal,
    };
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    // Bounds the connect too.
    setsockopt(&fd, SendTimeout, &TimeVal::new(T.as_secs() as _, 0))?;
    bind(fd.as_raw_fd(), &SockaddrIn::from(local))?;
    connect(fd.as_raw_fd(), &SockaddrIn::from(server))?;
    Ok(TcpStream::from(fd))
}

/// Sends one datagram from `from` to `server` and returns the address the server saw.
fn udp_seen(from: &NetNs, server: SocketAddr) -> SocketAddr {
    udp_seen_on(&udp_socket(from), server)
}

/// A UDP socket in `from` on any port.
fn udp_socket(from: &NetNs) -> UdpSocket {
    let sock = from
        .enter(|| UdpSocket::bind("0.0.0.0:0"))
        .expect("enter")
        .expect("bind");
    sock.set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    sock
}

/// [`udp_seen`] from `sock` (the same flow each time).
fn udp_seen_on(sock: &UdpSocket, server: SocketAddr) -> SocketAddr {
    let mut buf = [0u8; 128];
    for _ in 0..10 {
        sock.send_to(b"who", server).expect("send");
        if let Ok((n, _)) = sock.recv_from(&mut buf) {
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            return text.parse().unwrap_or_else(|e| panic!("{text:?}: {e}"));
        }
    }
    panic!("no UDP answer from {server}");
}

/// `bpftool -j map dump` of one of a node's pinned maps, the BTF-formatted entries.
fn dump(node: &Node, map: &str) -> Vec<serde_json::Value> {
    let path: PathBuf = node
        .bpf_pin_path()
        .join(flannel_common::maps::PIN_LAYOUT_VERSION)
        .join(map);
    let out = Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&path)
        .output()
        .expect("bpftool");
    assert!(
        out.status.success(),
        "bpftool on {}: {out:?}",
        path.display()
    );
    let raw: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    raw.as_array()
        .expect("entries")
        .iter()
        .map(|e| e["formatted"].clone())
        .collect()
}

/// The NAT flows of pods (`saddr` in the cluster network) a node holds, as
/// (pod address, pod port, NAT port).
fn pod_flows(node: &Node) -> Vec<(Ipv4Addr, u16, u16)> {
    dump(node, flannel_common::maps::NAT4)
        .iter()
        .filter_map(|e| {
            let saddr: Vec<u8> = serde_json::from_value(e["key"]["saddr"].clone()).ok()?;
            let addr = Ipv4Addr::new(saddr[0], saddr[1], saddr[2], saddr[3]);
            (saddr[0] == 10).then(|| {
                (
                    addr,
                    e["key"]["sport"].as_u64().unwrap_or(0) as u16,
                    e["value"]["nat_port"].as_u64().unwrap_or(0) as u16,
                )
            })
        })
        .collect()
}

/// The agent's fast-path counter of `program` and `reason`.
fn counter(node: &Node, program: &str, reason: &str) -> f64 {
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9473);
    let (code, body) = http_get(node.ns(), addr, "/metrics").expect("/metrics");
    assert_eq!(code, 200);
    let labels = format!("{{program=\"{program}\",reason=\"{reason}\"}}");
    parse_metrics(&body)
        .iter()
        .find(|s| s.name == "flannel_fastpath_packets_total" && s.labels == labels)
        .map_or(0.0, |s| s.value)
}

fn wait_ready(c: &mut Cluster, n: usize) {
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9473);
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        agent(c, n).check_running().expect("agent runs");
        if matches!(
            http_get(c.topology().node(n).ns(), addr, "/readyz"),
            Ok((200, _))
        ) {
            return;
        }
        thread::sleep(Duration::from_millis(200));
    }
    panic!("agent on node{n} not ready:\n{}", agent(c, n).log_tail(30));
}

fn agent(c: &mut Cluster, n: usize) -> &mut Agent {
    c.agent_mut(n).expect("agent")
}

/// Restarts node1's agent with `--ebpf-masq=false` (and `env`) and waits until the kernel's
/// masquerade rules are back and the programs hand the eBPF-masqueraded flows over.
fn switch_to_iptables(c: &mut Cluster, env: &[(&str, &str)]) {
    let mut spec = c.agent_spec();
    spec.extra_args.push("--ebpf-masq=false".into());
    spec.env
        .extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    restart_as(c, &spec);
    eventually("the kernel's masquerade rules", || {
        !masq_chain(c.topology().node(1)).contains("eBPF SNAT")
    });
    eventually("the handover flag", || {
        nat_flags(c.topology().node(1)) == u64::from(NAT_CFG_ENABLED | NAT_CFG_HANDOVER)
    });
}

/// Stops node1's agent, starts it again as `spec` says and waits until it is ready.
fn restart_as(c: &mut Cluster, spec: &AgentSpec) {
    agent(c, 1).stop(Duration::from_secs(10)).expect("stop");
    let restarted = Agent::start(c.topology().node(1), spec).expect("restart");
    *agent(c, 1) = restarted;
    wait_ready(c, 1);
}

fn masq_chain(node: &Node) -> String {
    node.run(&["iptables", "-t", "nat", "-S", "FLANNEL-POSTRTG"])
        .expect("iptables")
}

#[test]
fn pods_reach_the_outside_with_their_node_address() {
    if !runnable() {
        return;
    }
    let mut c = up(2, 2, Dataplane::Ebpf);
    let hub = c.topology().hub();
    let outside = SocketAddr::new(IpAddr::V4(c.topology().hub_addr()), SERVER_PORT);
    let _tcp = WhoAmI::start(hub, outside.ip(), SERVER_PORT);
    let _udp = udp_whoami(hub, outside);

    for pod in c.topology().pods() {
        let node = c.topology().node(pod.node());
        let mut conn = Conn::open(pod.ns(), outside);
        assert_eq!(
            conn.seen.ip(),
            IpAddr::V4(node.addr()),
            "{} seen as",
            pod.name()
        );
        conn.echo(b"hello from a pod").expect("echo");
        // The mapping the server saw is the one in the node's NAT map.
        let flows = pod_flows(node);
        assert!(
            flows.contains(&(pod.ip(), conn.local.port(), conn.seen.port())),
            "{} {} -> {}: {flows:?}",
            pod.name(),
            conn.local,
            conn.seen
        );
        let seen = udp_seen(pod.ns(), outside);
        assert_eq!(
            seen.ip(),
            IpAddr::V4(node.addr()),
            "UDP from {}",
            pod.name()
        );
    }

    // Pod to pod is not masqueraded.
    let target = c.topology().pods_on(2)[0];
    let pod_server = WhoAmI::start(target.ns(), IpAddr::V4(target.ip()), SERVER_PORT);
    let from = c.topology().pods_on(1)[0];
    let conn = Conn::open(from.ns(), pod_server.addr);
    assert_eq!(conn.seen.ip(), IpAddr::V4(from.ip()));

    // The kernel leaves TCP/UDP/ICMP echo through eth0 to eBPF; the rest stays upstream's.
    let node1 = c.topology().node(1);
    let chain = masq_chain(node1);
    for line in [
        "-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 100.64.0.0/10 -m comment --comment \"flanneld masq\" -j RETURN",
        "-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 10.244.0.0/16 -o eth0 -p tcp -m comment --comment \"flanneld masq: eBPF SNAT\" -j RETURN",
        "-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 10.244.0.0/16 -o eth0 -p udp -m comment --comment \"flanneld masq: eBPF SNAT\" -j RETURN",
        "-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 224.0.0.0/4 -m comment --comment \"flanneld masq\" -j MASQUERADE --random-fully",
    ] {
        assert!(chain.contains(line), "missing {line:?} in\n{chain}");
    }
    assert!(counter(node1, "tc_to_netdev", "fast_snat") > 0.0);
    assert!(counter(node1, "tc_from_netdev", "fast_snat_reply") > 0.0);
    let agent = c.agent_mut(1).expect("agent");
    let log = std::fs::read_to_string(agent.log_path()).expect("log");
    assert!(
        log.contains("masquerade: eBPF SNAT of TCP, UDP and ICMP echo leaving eth0"),
        "{}",
        agent.log_tail(40)
    );
    assert!(log.contains("16384 flows"), "{}", agent.log_tail(40));
}

#[test]
fn many_concurrent_flows_from_several_pods() {
    if !runnable() {
        return;
    }
    let c = up(2, 3, Dataplane::Ebpf);
    let hub = c.topology().hub();
    let outside = SocketAddr::new(IpAddr::V4(c.topology().hub_addr()), SERVER_PORT);
    let _tcp = WhoAmI::start(hub, outside.ip(), SERVER_PORT);
    const PER_POD: usize = 40;
    let conns: Vec<(usize, Conn)> = thread::scope(|s| {
        let handles: Vec<_> = c
            .topology()
            .pods()
            .iter()
            .map(|pod| {
                s.spawn(move || {
                    (0..PER_POD)
                        .map(|_| (pod.node(), Conn::open(pod.ns(), outside)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("pod thread"))
            .collect()
    });
    assert_eq!(conns.len(), 6 * PER_POD);
    let mut tuples = BTreeSet::new();
    for (node, conn) in &conns {
        assert_eq!(conn.seen.ip(), IpAddr::V4(c.topology().node(*node).addr()));
        assert!(tuples.insert(conn.seen), "two flows share {}", conn.seen);
    }
    // Every flow still carries its own data, all at once.
    thread::scope(|s| {
        for (i, (_, mut conn)) in conns.into_iter().enumerate() {
            s.spawn(move || {
                let data = format!("flow {i} payload").repeat(20);
                for _ in 0..3 {
                    conn.echo(data.as_bytes())
                        .unwrap_or_else(|e| panic!("flow {i}: {e}"));
                }
            });
        }
    });
    for n in 1..=2 {
        let flows = pod_flows(c.topology().node(n));
        assert!(flows.len() >= 3 * PER_POD, "node{n}: {} flows", flows.len());
    }
}

#[test]
fn a_long_lived_connection_survives_an_agent_restart() {
    if !runnable() {
        return;
    }
    let mut c = up(1, 1, Dataplane::Ebpf);
    let outside = SocketAddr::new(IpAddr::V4(c.topology().hub_addr()), SERVER_PORT);
    let _tcp = WhoAmI::start(c.topology().hub(), outside.ip(), SERVER_PORT);
    let node_addr = IpAddr::V4(c.topology().node(1).addr());
    let pod_ip = c.topology().pods()[0].ip();
    let mut conn = Conn::open(c.topology().pods()[0].ns(), outside);
    conn.echo(b"before").expect("echo before");

    agent(&mut c, 1)
        .stop(Duration::from_secs(10))
        .expect("stop");
    // The programs and maps stay in place while no agent runs.
    conn.echo(b"while the agent is down")
        .expect("echo while down");
    let fresh = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(fresh.seen.ip(), node_addr);

    agent(&mut c, 1).restart().expect("restart");
    wait_ready(&mut c, 1);
    for i in 0..20 {
        conn.echo(format!("after restart {i}").as_bytes())
            .expect("echo after restart");
    }
    let again = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(again.seen.ip(), node_addr);
    let flows = pod_flows(c.topology().node(1));
    assert!(
        flows.contains(&(pod_ip, conn.local.port(), conn.seen.port())),
        "{flows:?}"
    );
}

/// Connections opened while node1's agent restarts with another `--ebpf-nat-max-entries` go
/// on after it. Every 20 ms, from before the agent stops until after the new one is ready,
/// both pods open a connection from the same port to the same server, so that the programs
/// move the second of each pair to another port. The new agent copies the NAT maps into maps
/// of the new size when it loads, but the old programs stay attached until it attaches its
/// own, and the connections they open meanwhile must be carried over too: without them, the
/// new programs map such a flow afresh, a moved one to a port the server does not know.
#[test]
fn connections_opened_while_the_nat_maps_are_resized_go_on() {
    if !runnable() {
        return;
    }
    let mut c = up(1, 2, Dataplane::Ebpf);
    let server = SocketAddrV4::new(c.topology().hub_addr(), SERVER_PORT);
    let _tcp = WhoAmI::start(c.topology().hub(), IpAddr::V4(*server.ip()), SERVER_PORT);
    let pods: Vec<(PathBuf, Ipv4Addr)> = c
        .topology()
        .pods_on(1)
        .iter()
        .map(|p| (p.ns().path(), p.ip()))
        .collect();
    assert_eq!(pods.len(), 2);
    let stop = Arc::new(AtomicBool::new(false));
    let opener = {
        let stop = stop.clone();
        thread::spawn(move || {
            let mut conns = Vec::new();
            for port in 41000u16.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                for (ns, ip) in &pods {
                    let ns = std::fs::File::open(ns).expect("the pod's namespace");
                    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
                    let local = SocketAddrV4::new(*ip, port);
                    let stream = connect_from(local, server)
                        .unwrap_or_else(|e| panic!("connect from {local}: {e}"));
                    conns.push(Conn::greeted(stream));
                }
                thread::sleep(Duration::from_millis(20));
            }
            conns
        })
    };
    thread::sleep(Duration::from_millis(200));
    let mut spec = c.agent_spec();
    for arg in &mut spec.extra_args {
        if arg.starts_with("--ebpf-nat-max-entries=") {
            *arg = "--ebpf-nat-max-entries=32768".into();
        }
    }
    restart_as(&mut c, &spec);
    thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let mut conns = opener
        .join()
        .expect("a connection opened while the agent restarts (its panic is above)");
    let node = c.topology().node(1);
    let nat4 = node
        .bpf_pin_path()
        .join(flannel_common::maps::PIN_LAYOUT_VERSION)
        .join(flannel_common::maps::NAT4);
    let shown = Command::new("bpftool")
        .args(["-j", "map", "show", "pinned"])
        .arg(&nat4)
        .output()
        .expect("bpftool");
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).expect("JSON");
    assert_eq!(shown["max_entries"], 32768, "{shown}");
    let moved = conns
        .iter()
        .filter(|conn| conn.seen.port() != conn.local.port())
        .count();
    assert!(
        moved * 2 >= conns.len() - 2,
        "{moved} of {} moved",
        conns.len()
    );
    eprintln!(
        "{} connections opened across the restart, {moved} of them moved to another port",
        conns.len()
    );
    let flows = pod_flows(node);
    let mut lost = Vec::new();
    for conn in &mut conns {
        let IpAddr::V4(ip) = conn.local.ip() else {
            unreachable!("IPv4 pods")
        };
        let known = flows.contains(&(ip, conn.local.port(), conn.seen.port()));
        if !known || conn.echo(b"after the resize").is_err() {
            lost.push((conn.local, conn.seen, known));
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} connections lost (local, seen by the server, in the new maps): {lost:?}",
        lost.len(),
        conns.len()
    );
}

/// Pins removed while the agent runs (`rm -r` of node1's pin directory) are pinned again
/// within `--resync-interval` (1 s here), so that the restarted agent still adopts the NAT
/// maps: two pods hold connections from the same port to the same server, the second moved
/// to another port by the programs, and both go on across the restart. (Without the pins the
/// restarted agent started with empty maps and mapped the moved one afresh, to a port the
/// server did not know.)
#[test]
fn pins_removed_while_the_agent_runs_come_back_for_the_restart() {
    if !runnable() {
        return;
    }
    let mut c = up_with(1, 2, Dataplane::Ebpf, &["--resync-interval=1"]);
    let server = SocketAddrV4::new(c.topology().hub_addr(), SERVER_PORT);
    let _tcp = WhoAmI::start(c.topology().hub(), IpAddr::V4(*server.ip()), SERVER_PORT);
    let pods = c.topology().pods_on(1);
    let mut conns: Vec<Conn> = pods
        .iter()
        .map(|pod| Conn::open_from(pod.ns(), SocketAddrV4::new(pod.ip(), 41000), server))
        .collect();
    assert!(
        conns.iter().any(|conn| conn.seen.port() != 41000),
        "no connection was moved to another port"
    );
    let pins = c.topology().node(1).bpf_pin_path().to_owned();
    std::fs::remove_dir_all(&pins).expect("removing node1's pins");
    let nat4 = pins
        .join(flannel_common::maps::PIN_LAYOUT_VERSION)
        .join(flannel_common::maps::NAT4);
    eventually("node1's pins back", || {
        nat4.exists()
            && std::fs::read_dir(pins.join(flannel_common::maps::PIN_LINKS_DIR))
                .is_ok_and(|links| links.count() >= 3)
    });
    let spec = c.agent_spec();
    restart_as(&mut c, &spec);
    let flows = pod_flows(c.topology().node(1));
    for conn in &mut conns {
        conn.echo(b"after the restart")
            .unwrap_or_else(|e| panic!("{} seen as {}: {e}", conn.local, conn.seen));
        let IpAddr::V4(ip) = conn.local.ip() else {
            unreachable!("IPv4 pods")
        };
        assert!(
            flows.contains(&(ip, conn.local.port(), conn.seen.port())),
            "{} as {} not in the adopted maps: {flows:?}",
            conn.local,
            conn.seen
        );
    }
}

#[test]
fn replies_to_unknown_tuples_reach_the_node_and_are_counted() {
    if !runnable() {
        return;
    }
    let c = up(1, 1, Dataplane::Ebpf);
    let node = c.topology().node(1);
    let before = counter(node, "tc_from_netdev", "pass_snat_no_entry");
    // A datagram to the node's address on a port of the NAT range that no flow uses: the
    // program passes it, the node's stack answers "port unreachable".
    let target = SocketAddr::new(IpAddr::V4(node.addr()), 45678);
    let refused = c
        .topology()
        .hub()
        .enter(move || {
            let sock = UdpSocket::bind("0.0.0.0:0")?;
            sock.connect(target)?;
            sock.set_read_timeout(Some(T))?;
            sock.send(b"stray")?;
            let mut buf = [0u8; 16];
            Ok::<_, std::io::Error>(sock.recv(&mut buf))
        })
        .expect("enter")
        .expect("socket");
    assert_eq!(
        refused.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionRefused),
        "the node's stack answered"
    );
    let after = counter(node, "tc_from_netdev", "pass_snat_no_entry");
    assert_eq!(after - before, 1.0);
}

/// Waits until `f` holds, polling.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if f() {
            return;
        }
        thread::sleep(Duration::from_millis(200));
    }
    panic!("timed out waiting for {what}");
}

#[test]
fn switching_from_iptables_to_ebpf_keeps_established_connections() {
    if !runnable() {
        return;
    }
    let mut c = up(1, 1, Dataplane::Kernel);
    let outside = SocketAddr::new(IpAddr::V4(c.topology().hub_addr()), SERVER_PORT);
    let _tcp = WhoAmI::start(c.topology().hub(), outside.ip(), SERVER_PORT);
    let node_addr = IpAddr::V4(c.topology().node(1).addr());
    // Masqueraded by the kernel (iptables MASQUERADE --random-fully).
    let mut old = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(old.seen.ip(), node_addr);
    old.echo(b"kernel NAT").expect("echo");
    assert!(!masq_chain(c.topology().node(1)).contains("eBPF SNAT"));

    // The node's agent comes back with the eBPF fast path.
    let mut spec = c.agent_spec();
    spec.dataplane = Some(Dataplane::Ebpf);
    restart_as(&mut c, &spec);
    eventually("the eBPF RETURN rules", || {
        masq_chain(c.topology().node(1)).contains("eBPF SNAT")
    });

    // The kernel's connection goes on (conntrack keeps its NAT binding) ...
    for i in 0..20 {
        old.echo(format!("still here {i}").as_bytes())
            .expect("kernel-masqueraded connection after the switch");
    }
    // ... and new ones are masqueraded by eBPF.
    let new = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(new.seen.ip(), node_addr);
    let pod_ip = c.topology().pods()[0].ip();
    let flows = pod_flows(c.topology().node(1));
    assert!(
        flows.contains(&(pod_ip, new.local.port(), new.seen.port())),
        "{flows:?}"
    );
    assert!(
        !flows.iter().any(|(_, port, _)| *port == old.local.port()),
        "the kernel's flow is not a pod flow of the NAT: {flows:?}"
    );
}

/// The node's NAT flows with the node's own address as source (`NAT_F_HOST`), as (source
/// port, NAT port).
fn node_flows(node: &Node) -> Vec<(u16, u16)> {
    let addr = node.addr().octets().to_vec();
    dump(node, flannel_common::maps::NAT4)
        .iter()
        .filter_map(|e| {
            let saddr: Vec<u8> = serde_json::from_value(e["key"]["saddr"].clone()).ok()?;
            let host = e["value"]["flags"].as_u64()? & u64::from(flannel_common::nat::NAT_F_HOST);
            (saddr == addr && host != 0).then(|| {
                (
                    e["key"]["sport"].as_u64().unwrap_or(0) as u16,
                    e["value"]["nat_port"].as_u64().unwrap_or(0) as u16,
                )
            })
        })
        .collect()
}

/// The `flags` of the node's NAT configuration.
fn nat_flags(node: &Node) -> u64 {
    let cfg = dump(node, flannel_common::maps::NAT_CONFIG);
    cfg[0]["value"]["flags"].as_u64().expect("flags")
}

#[test]
fn switching_from_ebpf_to_iptables_hands_established_connections_over() {
    if !runnable() {
        return;
    }
    let mut c = up(1, 1, Dataplane::Ebpf);
    let outside = SocketAddr::new(IpAddr::V4(c.topology().hub_addr()), SERVER_PORT);
    let _tcp = WhoAmI::start(c.topology().hub(), outside.ip(), SERVER_PORT);
    let node_addr = IpAddr::V4(c.topology().node(1).addr());
    let pod_ip = c.topology().pods()[0].ip();
    // Masqueraded by eBPF.
    let mut old = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(old.seen.ip(), node_addr);
    old.echo(b"eBPF NAT").expect("echo");
    assert!(masq_chain(c.topology().node(1)).contains("eBPF SNAT"));
    assert!(pod_flows(c.topology().node(1)).contains(&(pod_ip, old.local.port(), old.seen.port())));
    assert_eq!(nat_flags(c.topology().node(1)), u64::from(NAT_CFG_ENABLED));

    // The node's agent comes back with masquerade in iptables.
    switch_to_iptables(&mut c, &[]);

    // The eBPF-masqueraded connection goes on (its conntrack entry has no NAT binding, the
    // programs keep translating it) ...
    for i in 0..20 {
        old.echo(format!("still here {i}").as_bytes())
            .expect("eBPF-masqueraded connection after the switch");
    }
    // ... and new ones are masqueraded by the kernel: they reach the programs with the node's
    // address and are only registered, as node flows.
    let mut new = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(new.seen.ip(), node_addr);
    for i in 0..5 {
        new.echo(format!("kernel NAT {i}").as_bytes())
            .expect("kernel-masqueraded connection");
    }
    let flows = pod_flows(c.topology().node(1));
    assert!(
        flows.contains(&(pod_ip, old.local.port(), old.seen.port())),
        "{flows:?}"
    );
    assert_eq!(flows.len(), 1, "no new pod flow in the NAT: {flows:?}");
    // MASQUERADE --random-fully may pick a port outside the NAT's range; in it, the flow is
    // registered, unmoved.
    let cfg = &dump(c.topology().node(1), flannel_common::maps::NAT_CONFIG)[0]["value"];
    let range = cfg["port_min"].as_u64().expect("min")..=cfg["port_max"].as_u64().expect("max");
    let port = new.seen.port();
    if range.contains(&u64::from(port)) {
        let nodes = node_flows(c.topology().node(1));
        assert!(
            nodes.contains(&(port, port)),
            "the kernel's flow registered unmoved: {nodes:?}"
        );
    }
    old.echo(b"last").expect("echo at the end");
}

/// The move from the fast path to the kernel dataplane (`--dataplane=kernel`; the same for a
/// fallback of `auto` and a node handed to upstream flanneld) keeps the pods' connections to
/// the outside that the programs masqueraded: before it detaches them, the agent enters each
/// into conntrack bound to the address and port the programs gave it (`bpf::handover`), so
/// the kernel goes on translating it. A TCP connection and a UDP flow reach the server from
/// the same address and port after the move, node1's conntrack entry for the TCP one replies
/// to that port, and a new connection is masqueraded by the kernel. (Without the handover
/// their packets left with the pod's address and got no answer.)
#[test]
fn moving_to_the_kernel_dataplane_keeps_ebpf_masqueraded_connections() {
    if !runnable() {
        return;
    }
    let mut c = up(1, 1, Dataplane::Ebpf);
    let outside = SocketAddr::new(IpAddr::V4(c.topology().hub_addr()), SERVER_PORT);
    let _tcp = WhoAmI::start(c.topology().hub(), outside.ip(), SERVER_PORT);
    let udp_server = SocketAddr::new(outside.ip(), SERVER_PORT + 1);
    let udp_stop = udp_whoami(c.topology().hub(), udp_server);
    let node_addr = IpAddr::V4(c.topology().node(1).addr());
    let pod_ip = c.topology().pods()[0].ip();
    let mut conn = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(conn.seen.ip(), node_addr);
    conn.echo(b"eBPF NAT").expect("echo");
    let udp = udp_socket(c.topology().pods()[0].ns());
    let udp_seen_before = udp_seen_on(&udp, udp_server);
    assert_eq!(udp_seen_before.ip(), node_addr);
    let flows = pod_flows(c.topology().node(1));
    assert!(
        flows.contains(&(pod_ip, conn.local.port(), conn.seen.port())),
        "masqueraded by the programs: {flows:?}"
    );

    move_to_the_kernel_dataplane(&mut c);
    let node1 = c.topology().node(1);
    for i in 0..10 {
        conn.echo(format!("on the kernel dataplane {i}").as_bytes())
            .expect("the eBPF-masqueraded connection on the kernel dataplane");
    }
    assert_eq!(
        conntrack_reply(node1, conn.local, outside),
        Some((node_addr, conn.seen.port())),
        "node1's conntrack binds the connection to the programs' port"
    );
    assert_eq!(
        udp_seen_on(&udp, udp_server),
        udp_seen_before,
        "the UDP flow's address and port on the kernel dataplane"
    );
    let mut new = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(new.seen.ip(), node_addr);
    new.echo(b"kernel NAT").expect("a new connection");
    conn.echo(b"last").expect("echo at the end");
    udp_stop.store(true, Ordering::Relaxed);
}

/// Restarts node1's agent with `--dataplane=kernel` and checks that its fast path is gone.
fn move_to_the_kernel_dataplane(c: &mut Cluster) {
    agent(c, 1)
        .restart_with(|args| {
            args.retain(|a| !a.starts_with("--dataplane"));
            args.push("--dataplane=kernel".into());
        })
        .expect("restart on the kernel dataplane");
    wait_ready(c, 1);
    assert!(
        !c.topology().node(1).bpf_pin_path().exists(),
        "the fast path is still pinned"
    );
}

/// The node's own connection that the programs moved to another port (a pod connection to
/// the same server already held its port) is handed to conntrack too when the node moves to
/// the kernel dataplane, bound to the port the programs gave it, and before the pod's, whose
/// binding the node's old entry would clash with. Both connections go on and node1's
/// conntrack replies to each one's port. (Without it the node's connection left from its
/// own port, and conntrack refused the pod's binding: both got no answer.)
#[test]
fn moving_to_the_kernel_dataplane_keeps_the_nodes_moved_connections() {
    if !runnable() {
        return;
    }
    let mut c = up(1, 1, Dataplane::Ebpf);
    let hub = c.topology().hub_addr();
    let outside = SocketAddrV4::new(hub, SERVER_PORT);
    let _tcp = WhoAmI::start(c.topology().hub(), IpAddr::V4(hub), SERVER_PORT);
    let node_addr = c.topology().node(1).addr();
    // In the NAT's port range (node1's ip_local_port_range).
    let port = 45_678;
    let mut pod = Conn::open_from(
        c.topology().pods()[0].ns(),
        SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port),
        outside,
    );
    assert_eq!(pod.seen, SocketAddr::new(IpAddr::V4(node_addr), port));
    let node1 = c.topology().node(1);
    let mut own = Conn::open_from(node1.ns(), SocketAddrV4::new(node_addr, port), outside);
    assert_eq!(own.seen.ip(), IpAddr::V4(node_addr));
    assert_ne!(own.seen.port(), port, "the node's connection was not moved");
    let moved = own.seen.port();
    assert!(
        node_flows(node1).contains(&(port, moved)),
        "{:?}",
        node_flows(node1)
    );
    own.echo(b"moved").expect("the moved connection");
    pod.echo(b"pod").expect("the pod's connection");

    move_to_the_kernel_dataplane(&mut c);
    let node1 = c.topology().node(1);
    for i in 0..10 {
        own.echo(format!("node on the kernel dataplane {i}").as_bytes())
            .expect("the node's moved connection on the kernel dataplane");
        pod.echo(format!("pod on the kernel dataplane {i}").as_bytes())
            .expect("the pod's connection on the kernel dataplane");
    }
    let server = SocketAddr::V4(outside);
    assert_eq!(
        conntrack_reply(node1, own.local, server),
        Some((IpAddr::V4(node_addr), moved)),
        "node1's conntrack binds the node's connection to the port the programs moved it to"
    );
    assert_eq!(
        conntrack_reply(node1, pod.local, server),
        Some((IpAddr::V4(node_addr), port)),
        "node1's conntrack binds the pod's connection to its port"
    );
}

/// A ping that goes on: from a raw ICMP socket in a namespace, an echo request with one
/// identifier every 100 ms until dropped, and the sequence numbers answered.
struct Pinger {
    sent: Arc<AtomicU16>,
    answered: Arc<Mutex<BTreeSet<u16>>>,
    stop: Arc<AtomicBool>,
}

impl Pinger {
    fn start(ns: &NetNs, dst: Ipv4Addr, id: u16) -> Pinger {
        use std::os::fd::{FromRawFd as _, OwnedFd};
        let fd = ns
            .enter(|| {
                // SAFETY: plain socket(2); the descriptor is owned right away.
                let raw =
                    unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP) };
                assert!(raw >= 0, "socket: {}", std::io::Error::last_os_error());
                // SAFETY: `raw` is a fresh descriptor nobody else owns.
                unsafe { OwnedFd::from_raw_fd(raw) }
            })
            .expect("enter");
        // std's UdpSocket only as the owner of a datagram socket's sendto and recv.
        let socket = Arc::new(std::net::UdpSocket::from(fd));
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        let (sent, answered, stop) = (
            Arc::new(AtomicU16::new(0)),
            Arc::new(Mutex::new(BTreeSet::new())),
            Arc::new(AtomicBool::new(false)),
        );
        let (rx, seen, done) = (socket.clone(), answered.clone(), stop.clone());
        thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !done.load(Ordering::Relaxed) {
                let Ok(n) = rx.recv(&mut buf) else { continue };
                let ip = &buf[..n];
                if ip.is_empty() {
                    continue;
                }
                let ihl = usize::from(ip[0] & 0x0f) * 4;
                if ip.len() < ihl + 8 || ip[12..16] != dst.octets() {
                    continue;
                }
                let icmp = &ip[ihl..];
                if icmp[0] == 0 && icmp[4..6] == id.to_be_bytes() {
                    let seq = u16::from_be_bytes([icmp[6], icmp[7]]);
                    seen.lock().expect("answered").insert(seq);
                }
            }
        });
        let (count, done) = (sent.clone(), stop.clone());
        thread::spawn(move || {
            let to = SocketAddr::new(IpAddr::V4(dst), 0);
            while !done.load(Ordering::Relaxed) {
                let seq = count.load(Ordering::Relaxed);
                let mut msg = vec![8, 0, 0, 0];
                msg.extend_from_slice(&id.to_be_bytes());
                msg.extend_from_slice(&seq.to_be_bytes());
                msg.extend_from_slice(b"flannel-rs ping across the move");
                let sum = packet::checksum(&msg);
                msg[2..4].copy_from_slice(&sum.to_be_bytes());
                let _ = socket.send_to(&msg, to);
                count.store(seq + 1, Ordering::Relaxed);
                thread::sleep(Duration::from_millis(100));
            }
        });
        Pinger {
            sent,
            answered,
            stop,
        }
    }

    /// How many requests were sent.
    fn sent(&self) -> u16 {
        self.sent.load(Ordering::Relaxed)
    }

    /// How many of the requests from sequence number `first` on were answered.
    fn answered_from(&self, first: u16) -> usize {
        self.answered
            .lock()
            .expect("answered")
            .range(first..)
            .count()
    }

    /// Checks that the requests sent during the next `period` (at least 10) are answered,
    /// but for the last one, which may still be on its way.
    fn all_answered_for(&self, period: Duration, what: &str) {
        let first = self.sent();
        thread::sleep(period);
        let sent = self.sent() - first;
        let answered = self.answered_from(first);
        assert!(
            sent >= 10 && answered + 1 >= usize::from(sent),
            "{answered} of {sent} echoes answered {what}"
        );
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A pod's ping to the outside that goes on (an echo every 100 ms, one identifier) while its
/// node moves to the kernel dataplane is answered again once the agent is ready: the
/// programs' echo flow was handed to conntrack bound to the identifier they gave it. (Without
/// it, conntrack's entry for the flow, made without a binding while the programs translated it
/// and kept alive by the echoes, sent them on with the pod's address: none was answered.)
#[test]
fn moving_to_the_kernel_dataplane_keeps_a_pods_ping_going() {
    if !runnable() {
        return;
    }
    let mut c = up(1, 1, Dataplane::Ebpf);
    let hub = c.topology().hub_addr();
    let pod_ip = c.topology().pods()[0].ip();
    let id = 0x4a17;
    let ping = Pinger::start(c.topology().pods()[0].ns(), hub, id);
    eventually("answered echoes", || ping.answered_from(0) >= 5);
    let flows = pod_flows(c.topology().node(1));
    assert!(
        flows
            .iter()
            .any(|(ip, sport, _)| (*ip, *sport) == (pod_ip, id)),
        "the echo flow masqueraded by the programs: {flows:?}"
    );

    move_to_the_kernel_dataplane(&mut c);
    ping.all_answered_for(Duration::from_secs(2), "on the kernel dataplane");
}

/// A pod's ping to the outside that goes on across the switch from eBPF SNAT to iptables (the
/// programs still attached) does not hold the handover up: its echo flow is handed to
/// conntrack, bound to the identifier the programs gave it, so the handover ends at a sweep
/// while the ping goes on being answered. (Before, the programs translated the flow for as
/// long as it lived, and the ping kept it alive: the eBPF NAT stayed in its handover.)
#[test]
fn a_ping_that_goes_on_does_not_hold_up_the_handover_to_iptables() {
    if !runnable() {
        return;
    }
    let mut c = up_with(1, 1, Dataplane::Ebpf, &["--ebpf-nat-sweep-interval=1"]);
    let hub = c.topology().hub_addr();
    let pod_ip = c.topology().pods()[0].ip();
    let id = 0x5b2e;
    let ping = Pinger::start(c.topology().pods()[0].ns(), hub, id);
    eventually("answered echoes", || ping.answered_from(0) >= 5);
    assert!(
        pod_flows(c.topology().node(1))
            .iter()
            .any(|(ip, sport, _)| (*ip, *sport) == (pod_ip, id)),
        "the echo flow masqueraded by the programs"
    );

    let mut spec = c.agent_spec();
    spec.extra_args.push("--ebpf-masq=false".into());
    restart_as(&mut c, &spec);
    eventually("the end of the handover while the ping goes on", || {
        nat_flags(c.topology().node(1)) == 0
    });
    let log = std::fs::read_to_string(agent(&mut c, 1).log_path()).expect("log");
    assert!(
        log.contains("pods' ICMP echo flows handed from eBPF SNAT to conntrack"),
        "{}",
        agent(&mut c, 1).log_tail(30)
    );
    ping.all_answered_for(Duration::from_secs(2), "after the handover");
}

/// The reply direction (destination address and port) of the node's conntrack entry for the
/// TCP flow `local` → `server`: the pod's own tuple when the kernel does not NAT the flow, the
/// node's address and the port MASQUERADE chose when it does.
fn conntrack_reply(node: &Node, local: SocketAddr, server: SocketAddr) -> Option<(IpAddr, u16)> {
    let table = node
        .run(&["cat", "/proc/net/nf_conntrack"])
        .expect("/proc/net/nf_conntrack");
    let original = format!(
        "src={} dst={} sport={} dport={} ",
        local.ip(),
        server.ip(),
        local.port(),
        server.port()
    );
    let line = table
        .lines()
        .find(|l| l.contains(" tcp ") && l.contains(&original))?;
    let reply = &line[line.find(&original)? + original.len()..];
    let field = |name: &str| {
        reply
            .split_whitespace()
            .find_map(|t| t.strip_prefix(name))
            .map(str::to_owned)
    };
    Some((field("dst=")?.parse().ok()?, field("dport=")?.parse().ok()?))
}

/// The handover from eBPF SNAT to iptables, to its end: the eBPF-masqueraded connection goes
/// on after the switch (its conntrack entry has no NAT binding: the programs translate it),
/// new connections are masqueraded by the kernel (conntrack holds their NAT binding), the
/// handover stays while the old connection lives, and once it has closed (and its closed
/// timeout passed) the agent's sweep removes it and turns the eBPF NAT off.
#[test]
fn an_ebpf_to_iptables_handover_ends_when_the_last_ebpf_flow_has_closed() {
    if !runnable() {
        return;
    }
    let mut c = up_with(1, 1, Dataplane::Ebpf, &["--ebpf-nat-sweep-interval=1"]);
    let outside = SocketAddr::new(IpAddr::V4(c.topology().hub_addr()), SERVER_PORT);
    let _tcp = WhoAmI::start(c.topology().hub(), outside.ip(), SERVER_PORT);
    let node_addr = IpAddr::V4(c.topology().node(1).addr());
    let pod_ip = IpAddr::V4(c.topology().pods()[0].ip());

    let mut old = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(old.seen.ip(), node_addr);
    old.echo(b"eBPF NAT").expect("echo");
    // eBPF translated it after conntrack: conntrack holds the pod's own tuple.
    assert_eq!(
        conntrack_reply(c.topology().node(1), old.local, outside),
        Some((pod_ip, old.local.port())),
        "conntrack entry of the eBPF-masqueraded flow"
    );

    // Back to iptables, with the handover's progress logged.
    switch_to_iptables(
        &mut c,
        &[("RUST_LOG", "info,flannel_agent::daemon::masq=debug")],
    );

    // The old connection goes on, translated by the programs.
    for i in 0..10 {
        old.echo(format!("still here {i}").as_bytes())
            .expect("eBPF-masqueraded connection after the switch");
    }
    // A new one goes through MASQUERADE: conntrack holds the node's address and the port the
    // outside saw; the programs only registered it.
    let mut new = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(new.seen.ip(), node_addr);
    new.echo(b"kernel NAT").expect("echo");
    assert_eq!(
        conntrack_reply(c.topology().node(1), new.local, outside),
        Some((node_addr, new.seen.port())),
        "conntrack entry of the kernel-masqueraded flow"
    );
    let pod = c.topology().pods()[0].ip();
    assert_eq!(
        pod_flows(c.topology().node(1)),
        vec![(pod, old.local.port(), old.seen.port())],
        "the NAT holds the old pod flow only"
    );

    // While it lives, the sweeps keep the handover going: two sweeps that counted it.
    let log_path = agent(&mut c, 1).log_path().to_owned();
    let sweeps_with_the_flow = || {
        std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("masquerade handover") && l.contains("flows=1"))
            .count()
    };
    eventually("two handover sweeps", || sweeps_with_the_flow() >= 2);
    assert_eq!(
        nat_flags(c.topology().node(1)),
        u64::from(NAT_CFG_ENABLED | NAT_CFG_HANDOVER),
        "the handover goes on while the eBPF flow lives"
    );
    old.echo(b"last").expect("echo before closing");

    // The old connection closes (FIN both ways): once its closed timeout has passed, a sweep
    // removes it and the eBPF NAT is turned off.
    let old_local = old.local;
    drop(old);
    let closed_s =
        dump(c.topology().node(1), flannel_common::maps::NAT_CONFIG)[0]["value"]["tcp_closed_s"]
            .as_u64()
            .expect("tcp_closed_s");
    let deadline = Instant::now() + Duration::from_secs(closed_s + 30);
    while nat_flags(c.topology().node(1)) != 0 {
        assert!(
            Instant::now() < deadline,
            "the handover did not end:\n{}",
            agent(&mut c, 1).log_tail(30)
        );
        thread::sleep(Duration::from_millis(200));
    }
    let log = std::fs::read_to_string(&log_path).expect("log");
    assert!(
        log.contains("masquerade handover finished: eBPF SNAT is off"),
        "{}",
        agent(&mut c, 1).log_tail(30)
    );
    // Cleaned up: the whole NAT configuration is zero (off) and the old flow's entry is gone.
    let cfg = &dump(c.topology().node(1), flannel_common::maps::NAT_CONFIG)[0]["value"];
    assert_eq!(cfg["nat_addr"], serde_json::json!([0, 0, 0, 0]), "{cfg}");
    assert_eq!(cfg["port_min"], 0, "{cfg}");
    assert!(
        !pod_flows(c.topology().node(1))
            .iter()
            .any(|(_, port, _)| *port == old_local.port()),
        "the old flow's entry is swept"
    );

    // Masquerade is the kernel's alone now: the kernel's flow goes on, and another new one is
    // masqueraded by MASQUERADE, not seen by the programs' NAT at all.
    new.echo(b"after the handover")
        .expect("kernel-masqueraded connection");
    let before = counter(c.topology().node(1), "tc_to_netdev", "fast_snat");
    let mut third = Conn::open(c.topology().pods()[0].ns(), outside);
    assert_eq!(third.seen.ip(), node_addr);
    third.echo(b"kernel NAT only").expect("echo");
    assert_eq!(
        conntrack_reply(c.topology().node(1), third.local, outside),
        Some((node_addr, third.seen.port()))
    );
    assert_eq!(
        counter(c.topology().node(1), "tc_to_netdev", "fast_snat"),
        before
    );
    assert!(pod_flows(c.topology().node(1)).is_empty());
}
