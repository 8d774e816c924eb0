//! The kernel dataplane end to end: "nodes" are network namespaces on a fake underlay, each
//! with a `cni0` bridge and one pod namespace behind it, each running the real reconciler fed
//! with hand-made lease snapshots (what the etcd or kube subnet manager would publish).
//!
//! Underlay: a switch namespace with bridge `br0` (192.168.10.0/24, fd00:10::/64). Nodes on
//! it are L2 neighbours; "routed" nodes sit on 192.168.20.0/24 (fd00:20::/64) behind a router
//! namespace. Node N: `eth0` 192.168.S.N, subnet 10.244.N.0/24 (fd00:244:N::/64), `cni0`
//! holding .1, pod at .2 with a default route via `cni0`.
//!
//! Kernel state is checked with `ip route`/`ip neigh`/`bridge fdb`, traffic with TCP echo
//! and a UDP request/response flow between pod namespaces (no `ping` on this machine).
//!
//! Run: `cargo test -p flannel-tests --test dataplane -- --nocapture` (as root; skipped
//! otherwise). Timings are printed, never asserted except the device-recreation bound.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    process::{Child, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use flannel_agent::{
    backend::{BackendOptions, IpipOptions, MacAddr, VxlanLeaseData, VxlanOptions},
    dataplane::{
        self, DataplaneError, DataplaneStatus, Facts, Local, MacStore, Reachability, Reconciler,
        ReconcilerConfig, VtepMacs,
    },
    iface::ExternalInterface,
    ip::IpStack,
    lease::{Lease, LeaseAttrs},
    netlink::{IpFamily, Netlink},
    subnet::{LeaseId, LeasePublisher, lease_channel},
};
use flannel_tests::{
    netns::{NetNs, veth},
    require_root,
};
use ipnet::{Ipv4Net, Ipv6Net};
use tokio::sync::{oneshot, watch};

/// The cluster network (wide enough for the 5,000 fabricated leases).
const NETWORK: &str = "10.0.0.0/8";
const NETWORK_V6: &str = "fd00:244::/48";
const ECHO_PORT: u16 = 7000;
const FLOW_PORT: u16 = 7100;

/// Fails the test with the whole error chain.
fn check(result: Result<()>) {
    if let Err(e) = result {
        panic!("{e:#}");
    }
}

// ---------------------------------------------------------------------------------------
// Topology

/// What an agent needs to know about its node (plain data, sent to the agent thread).
#[derive(Debug, Clone)]
struct NodeParams {
    n: u8,
    segment: u8,
    state_dir: std::path::PathBuf,
}

impl NodeParams {
    fn underlay(&self) -> Ipv4Addr {
        Ipv4Addr::new(192, 168, self.segment, self.n)
    }
    fn underlay_v6(&self) -> Ipv6Addr {
        format!("fd00:{}::{}", self.segment, self.n)
            .parse()
            .unwrap_or(Ipv6Addr::UNSPECIFIED)
    }
    fn subnet(&self) -> Ipv4Net {
        Ipv4Net::new(Ipv4Addr::new(10, 244, self.n, 0), 24).unwrap_or_default()
    }
    fn subnet_v6(&self) -> Ipv6Net {
        format!("fd00:244:{}::/64", self.n)
            .parse()
            .unwrap_or_default()
    }
}

struct Node {
    params: NodeParams,
    ns: Arc<NetNs>,
    pod: Arc<NetNs>,
    _state: tempfile::TempDir,
}

impl Node {
    fn pod_ip(&self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 244, self.params.n, 2))
    }
    fn pod_v6(&self) -> IpAddr {
        format!("fd00:244:{}::2", self.params.n)
            .parse()
            .unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED))
    }
    fn run(&self, argv: &[&str]) -> Result<String> {
        self.ns.run(argv)
    }
}

struct Lab {
    nodes: Vec<Node>,
    _router: Option<NetNs>,
    _switch: NetNs,
}

/// `count` nodes; the ones listed in `routed` sit behind a router, the others share the
/// switch's L2 segment.
fn lab(tag: &str, count: u8, routed: &[u8]) -> Result<Lab> {
    let switch = NetNs::new(&format!("{tag}sw"))?;
    switch.run(&["ip", "link", "add", "br0", "type", "bridge"])?;
    switch.run(&["ip", "link", "set", "br0", "up"])?;
    let router = if routed.is_empty() {
        None
    } else {
        let rt = NetNs::new(&format!("{tag}rt"))?;
        veth(&switch, "prt", &rt, "eth0")?;
        switch.run(&["ip", "link", "set", "prt", "master", "br0"])?;
        rt.run(&["ip", "addr", "add", "192.168.10.254/24", "dev", "eth0"])?;
        rt.run(&[
            "ip",
            "addr",
            "add",
            "fd00:10::fe/64",
            "dev",
            "eth0",
            "nodad",
        ])?;
        rt.run(&["ip", "link", "add", "br1", "type", "bridge"])?;
        rt.run(&["ip", "addr", "add", "192.168.20.254/24", "dev", "br1"])?;
        rt.run(&["ip", "addr", "add", "fd00:20::fe/64", "dev", "br1", "nodad"])?;
        rt.run(&["ip", "link", "set", "br1", "up"])?;
        forwarding(&rt)?;
        Some(rt)
    };
    let mut nodes = Vec::new();
    for n in 1..=count {
        let ns = Arc::new(NetNs::new(&format!("{tag}n{n}"))?);
        let pod = Arc::new(NetNs::new(&format!("{tag}p{n}"))?);
        let behind_router = routed.contains(&n);
        let segment = if behind_router { 20 } else { 10 };
        let port = format!("p{n}");
        match (&router, behind_router) {
            (Some(rt), true) => {
                veth(rt, &port, &ns, "eth0")?;
                rt.run(&["ip", "link", "set", &port, "master", "br1"])?;
            }
            _ => {
                veth(&switch, &port, &ns, "eth0")?;
                switch.run(&["ip", "link", "set", &port, "master", "br0"])?;
            }
        }
        let state = tempfile::tempdir()?;
        let params = NodeParams {
            n,
            segment,
            state_dir: state.path().to_owned(),
        };
        let v4 = format!("{}/24", params.underlay());
        let v6 = format!("{}/64", params.underlay_v6());
        ns.run(&["ip", "addr", "add", &v4, "dev", "eth0"])?;
        ns.run(&["ip", "addr", "add", &v6, "dev", "eth0", "nodad"])?;
        if router.is_some() {
            let gw4 = format!("192.168.{segment}.254");
            let gw6 = format!("fd00:{segment}::fe");
            ns.run(&["ip", "route", "add", "default", "via", &gw4])?;
            ns.run(&["ip", "-6", "route", "add", "default", "via", &gw6])?;
        }
        forwarding(&ns)?;
        // The cni0-like bridge with the first address of the pod subnet, one pod behind it.
        let gw4 = format!("10.244.{n}.1");
        let gw6 = format!("fd00:244:{n}::1");
        ns.run(&["ip", "link", "add", "cni0", "type", "bridge"])?;
        ns.run(&["ip", "addr", "add", &format!("{gw4}/24"), "dev", "cni0"])?;
        ns.run(&[
            "ip",
            "addr",
            "add",
            &format!("{gw6}/64"),
            "dev",
            "cni0",
            "nodad",
        ])?;
        ns.run(&["ip", "link", "set", "cni0", "up"])?;
        veth(&ns, "vp0", &pod, "eth0")?;
        ns.run(&["ip", "link", "set", "vp0", "master", "cni0"])?;
        pod.run(&[
            "ip",
            "addr",
            "add",
            &format!("10.244.{n}.2/24"),
            "dev",
            "eth0",
        ])?;
        pod.run(&[
            "ip",
            "addr",
            "add",
            &format!("fd00:244:{n}::2/64"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        pod.run(&["ip", "route", "add", "default", "via", &gw4])?;
        pod.run(&["ip", "-6", "route", "add", "default", "via", &gw6])?;
        nodes.push(Node {
            params,
            ns,
            pod,
            _state: state,
        });
    }
    Ok(Lab {
        nodes,
        _router: router,
        _switch: switch,
    })
}

fn forwarding(ns: &NetNs) -> Result<()> {
    for setting in [
        "net.ipv4.ip_forward=1",
        "net.ipv6.conf.all.forwarding=1",
        "net.ipv4.conf.all.rp_filter=0",
        "net.ipv4.conf.default.rp_filter=0",
    ] {
        ns.run(&["sysctl", "-qw", setting])?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Agents

#[derive(Debug, Clone)]
struct Spec {
    backend: BackendOptions,
    stack: IpStack,
    resync: Duration,
}

fn vxlan(direct_routing: bool) -> BackendOptions {
    BackendOptions::Vxlan(VxlanOptions {
        direct_routing,
        ..VxlanOptions::default()
    })
}

/// One node's reconciler, running on its own thread inside the node's namespace.
struct Agent {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<Result<()>>>,
    status: watch::Receiver<DataplaneStatus>,
    publisher: LeasePublisher,
    lease: Lease,
    macs: VtepMacs,
}

impl Agent {
    fn id(&self) -> LeaseId {
        lease_id(&self.lease)
    }

    fn status(&self) -> DataplaneStatus {
        self.status.borrow().clone()
    }

    /// Waits until the latest published snapshot has been applied without errors.
    fn wait_applied(&self, timeout: Duration) -> Result<DataplaneStatus> {
        let want = self.publisher.current().generation;
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.status();
            if s.applied_generation.is_some_and(|g| g >= want) && s.consecutive_failures == 0 {
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!("generation {want} not applied within {timeout:?}; status: {s:#?}",);
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| anyhow!("agent thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn lease_id(lease: &Lease) -> LeaseId {
    lease.key().map(|k| k.to_string()).unwrap_or_default()
}

fn node_lease(p: &NodeParams, spec: &Spec, macs: VtepMacs) -> Lease {
    let dual = spec.stack.has_v6();
    let mut attrs = LeaseAttrs {
        public_ip: p.underlay(),
        public_ipv6: dual.then(|| p.underlay_v6()),
        backend_type: spec.backend.backend_type().lease_type().to_owned(),
        ..LeaseAttrs::default()
    };
    if let BackendOptions::Vxlan(o) = &spec.backend {
        let data = |m: MacAddr| {
            VxlanLeaseData {
                vni: o.vni,
                vtep_mac: m,
            }
            .to_json()
        };
        attrs.backend_data = macs.v4.map(data);
        attrs.backend_v6_data = macs.v6.map(data);
    }
    Lease {
        subnet: Some(p.subnet()),
        ipv6_subnet: dual.then(|| p.subnet_v6()),
        attrs,
        expiration: None,
    }
}

/// What the daemon does before the reconciler runs: VTEP MACs, lease, `Local`, devices.
async fn init_node(nl: &Netlink, p: &NodeParams, spec: &Spec) -> Result<(Lease, Local)> {
    let eth0 = nl.link_by_name("eth0").await?.context("eth0 missing")?;
    let dual = spec.stack.has_v6();
    let ext = ExternalInterface {
        name: "eth0".into(),
        index: eth0.index,
        mtu: eth0.mtu,
        iface_addr: Some(p.underlay()),
        iface_v6_addr: dual.then(|| p.underlay_v6()),
        ext_addr: Some(p.underlay()),
        ext_v6_addr: dual.then(|| p.underlay_v6()),
    };
    let macs = match &spec.backend {
        BackendOptions::Vxlan(o) => {
            dataplane::prepare_vtep_macs(
                nl,
                &MacStore::new(&p.state_dir),
                o,
                spec.stack,
                VtepMacs::default(),
            )
            .await?
        }
        _ => VtepMacs::default(),
    };
    let lease = node_lease(p, spec, macs);
    let mut local = Local::new(
        lease.clone(),
        spec.stack,
        Some(NETWORK.parse()?),
        dual.then(|| NETWORK_V6.parse()).transpose()?,
        spec.backend.clone(),
        ext,
        spec.backend.mtu(eth0.mtu, spec.stack)?,
        macs,
    );
    dataplane::ensure_devices(nl, &mut local).await?;
    Ok((lease, local))
}

type InitResult = Result<(Lease, VtepMacs, watch::Receiver<DataplaneStatus>)>;

fn start_agent(node: &Node, spec: &Spec) -> Result<Agent> {
    let (publisher, rx) = lease_channel();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let (init_tx, init_rx) = mpsc::channel::<InitResult>();
    let ns = node.ns.clone();
    let params = node.params.clone();
    let spec = spec.clone();
    let thread = thread::spawn(move || -> Result<()> {
        ns.enter(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let init = async {
                    let nl = Netlink::new()?;
                    let (lease, local) = init_node(&nl, &params, &spec).await?;
                    let macs = local.vtep_macs;
                    let events = nl.link_events()?;
                    let reconciler =
                        Reconciler::new(nl, local, ReconcilerConfig::with_resync(spec.resync));
                    anyhow::Ok((lease, macs, reconciler, events))
                }
                .await;
                match init {
                    Err(e) => {
                        let _ = init_tx.send(Err(anyhow!("agent init: {e:#}")));
                    }
                    Ok((lease, macs, reconciler, events)) => {
                        let _ = init_tx.send(Ok((lease, macs, reconciler.status())));
                        let stop = async {
                            let _ = stop_rx.await;
                        };
                        reconciler.run(rx, events, stop).await;
                    }
                }
                Ok(())
            })
        })?
    });
    let (lease, macs, status) = init_rx
        .recv_timeout(Duration::from_secs(20))
        .context("agent did not start")??;
    Ok(Agent {
        stop: Some(stop_tx),
        thread: Some(thread),
        status,
        publisher,
        lease,
        macs,
    })
}

fn start_all(lab: &Lab, spec: &Spec) -> Result<Vec<Agent>> {
    lab.nodes.iter().map(|n| start_agent(n, spec)).collect()
}

/// Every agent gets the leases of all the others (as a subnet manager would publish them)
/// and applies them.
fn publish_all(agents: &[Agent]) -> Result<()> {
    for a in agents {
        let others: BTreeMap<LeaseId, Lease> = agents
            .iter()
            .filter(|o| o.id() != a.id())
            .map(|o| (o.id(), o.lease.clone()))
            .collect();
        a.publisher.replace_all(others);
    }
    for a in agents {
        a.wait_applied(Duration::from_secs(10))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Observation helpers

fn wait_for(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<bool>,
) -> Result<Duration> {
    let start = Instant::now();
    loop {
        if f()? {
            return Ok(start.elapsed());
        }
        if start.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

fn lines(text: &str) -> BTreeSet<String> {
    text.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| !l.is_empty())
        .collect()
}

/// `ip [-6] route show proto 165` (the output then omits the protocol).
fn flannel_routes(node: &Node, v6: bool) -> Result<BTreeSet<String>> {
    let family = if v6 { "-6" } else { "-4" };
    Ok(lines(
        &node.run(&["ip", family, "route", "show", "proto", "165"])?,
    ))
}

fn neighbours(node: &Node, dev: &str) -> Result<BTreeSet<String>> {
    Ok(lines(&node.run(&["ip", "neigh", "show", "dev", dev])?))
}

fn fdb(node: &Node, dev: &str) -> Result<BTreeSet<String>> {
    Ok(lines(&node.run(&["bridge", "fdb", "show", "dev", dev])?))
}

fn link_mac(node: &Node, dev: &str) -> Result<Option<String>> {
    let out = node.ns.output(&["ip", "-o", "link", "show", dev])?;
    if !out.status.success() {
        return Ok(None);
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mac = text
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .map(str::to_owned);
    Ok(mac)
}

/// The interface index of `dev` (`/sys/class/net` shows the host's namespace under nsenter).
fn ifindex(node: &Node, dev: &str) -> Result<u32> {
    let text = node.run(&["ip", "-o", "link", "show", dev])?;
    let index = text.split(':').next().context("empty ip link output")?;
    Ok(index.trim().parse()?)
}

/// Packets received by `dev`, from `/proc/net/dev` (which follows the network namespace).
fn rx_packets(node: &Node, dev: &str) -> Result<u64> {
    let text = node.run(&["cat", "/proc/net/dev"])?;
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{dev}:")))
        .with_context(|| format!("{dev} not in /proc/net/dev"))?;
    let fields: Vec<&str> = line
        .split_once(':')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // receive: bytes packets errs drop fifo frame compressed multicast; transmit: ...
    Ok(fields.get(1).context("short /proc/net/dev line")?.parse()?)
}

fn set(items: &[String]) -> BTreeSet<String> {
    items.iter().cloned().collect()
}

// ---------------------------------------------------------------------------------------
// Traffic

/// One TCP connection from `from` to `to_ip` in namespace `to`, echoing a payload.
fn tcp_echo(from: &Arc<NetNs>, to: &Arc<NetNs>, to_ip: IpAddr) -> Result<()> {
    let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
    let server_ns = to.clone();
    let server = thread::spawn(move || -> Result<()> {
        server_ns.enter(move || -> Result<()> {
            // The previous echo's sockets on this port may not be gone yet (a busy machine).
            let bind_deadline = Instant::now() + Duration::from_secs(3);
            let listener = loop {
                match TcpListener::bind(SocketAddr::new(to_ip, ECHO_PORT)) {
                    Ok(l) => break l,
                    Err(e)
                        if e.kind() == std::io::ErrorKind::AddrInUse
                            && Instant::now() < bind_deadline =>
                    {
                        thread::sleep(Duration::from_millis(50));
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(anyhow!("bind {to_ip}: {e}")));
                        return Ok(());
                    }
                }
            };
            listener.set_nonblocking(true)?;
            let _ = ready_tx.send(Ok(()));
            let deadline = Instant::now() + Duration::from_secs(8);
            loop {
                match listener.accept() {
                    Ok((mut conn, _)) => {
                        conn.set_nonblocking(false)?;
                        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
                        let mut buf = [0u8; 5];
                        conn.read_exact(&mut buf)?;
                        conn.write_all(&buf)?;
                        return Ok(());
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            bail!("no connection to {to_ip} arrived");
                        }
                        thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        })?
    });
    ready_rx.recv_timeout(Duration::from_secs(5))??;
    let client = from.enter(move || -> Result<()> {
        let addr = SocketAddr::new(to_ip, ECHO_PORT);
        let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .with_context(|| format!("connect to {addr}"))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        conn.write_all(b"hello")?;
        let mut buf = [0u8; 5];
        conn.read_exact(&mut buf)?;
        ensure!(&buf == b"hello", "echo mismatch: {buf:?}");
        Ok(())
    })?;
    let served = server.join().map_err(|_| anyhow!("echo server panicked"))?;
    client.and(served)
}

fn pods_talk(lab: &Lab, pairs: &[(usize, usize)], v6: bool) -> Result<()> {
    for &(a, b) in pairs {
        let (from, to) = (&lab.nodes[a], &lab.nodes[b]);
        let ip = if v6 { to.pod_v6() } else { to.pod_ip() };
        tcp_echo(&from.pod, &to.pod, ip)
            .with_context(|| format!("pod {} -> pod {} ({ip})", a + 1, b + 1))?;
    }
    Ok(())
}

const ALL_PAIRS: [(usize, usize); 6] = [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)];

/// A UDP request/response flow (one request every 2 ms, 300 ms to answer) between two pods.
struct UdpFlow {
    stop: Arc<AtomicBool>,
    server: thread::JoinHandle<Result<()>>,
    client: thread::JoinHandle<Result<(u64, u64)>>,
}

impl UdpFlow {
    fn start(from: &Arc<NetNs>, to: &Arc<NetNs>, to_ip: IpAddr) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel::<()>();
        let server_ns = to.clone();
        let server_stop = stop.clone();
        let server = thread::spawn(move || -> Result<()> {
            server_ns.enter(move || -> Result<()> {
                let socket = UdpSocket::bind(SocketAddr::new(to_ip, FLOW_PORT))?;
                socket.set_read_timeout(Some(Duration::from_millis(50)))?;
                let _ = ready_tx.send(());
                let mut buf = [0u8; 64];
                while !server_stop.load(Ordering::Relaxed) {
                    if let Ok((n, peer)) = socket.recv_from(&mut buf) {
                        socket.send_to(&buf[..n], peer)?;
                    }
                }
                Ok(())
            })?
        });
        ready_rx.recv_timeout(Duration::from_secs(5))?;
        let client_ns = from.clone();
        let client_stop = stop.clone();
        let client = thread::spawn(move || -> Result<(u64, u64)> {
            client_ns.enter(move || -> Result<(u64, u64)> {
                let any: IpAddr = if to_ip.is_ipv4() {
                    Ipv4Addr::UNSPECIFIED.into()
                } else {
                    Ipv6Addr::UNSPECIFIED.into()
                };
                let socket = UdpSocket::bind(SocketAddr::new(any, 0))?;
                socket.connect(SocketAddr::new(to_ip, FLOW_PORT))?;
                socket.set_read_timeout(Some(Duration::from_millis(300)))?;
                let (mut sent, mut lost) = (0u64, 0u64);
                let mut buf = [0u8; 64];
                while !client_stop.load(Ordering::Relaxed) {
                    sent += 1;
                    socket.send(&sent.to_be_bytes())?;
                    let deadline = Instant::now() + Duration::from_millis(300);
                    let answered = loop {
                        match socket.recv(&mut buf) {
                            Ok(8) if buf[..8] == sent.to_be_bytes() => break true,
                            Ok(_) => {} // a late answer to an earlier request
                            Err(_) => break false,
                        }
                        if Instant::now() > deadline {
                            break false;
                        }
                    };
                    if !answered {
                        lost += 1;
                    }
                    thread::sleep(Duration::from_millis(2));
                }
                Ok((sent, lost))
            })?
        });
        Ok(Self {
            stop,
            server,
            client,
        })
    }

    /// Stops and returns (sent, lost).
    fn finish(self) -> Result<(u64, u64)> {
        self.stop.store(true, Ordering::Relaxed);
        let counts = self
            .client
            .join()
            .map_err(|_| anyhow!("flow client panicked"))??;
        self.server
            .join()
            .map_err(|_| anyhow!("flow server panicked"))??;
        Ok(counts)
    }
}

/// `ip monitor` / `bridge monitor` in a namespace; lines are collected when stopped.
struct Monitor {
    child: Child,
}

impl Monitor {
    fn start(ns: &NetNs, argv: &[&str]) -> Result<Self> {
        let (program, args) = argv.split_first().context("empty command")?;
        let child = ns
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(Self { child })
    }

    fn finish(mut self) -> Result<Vec<String>> {
        let _ = self.child.kill();
        let out = self.child.wait_with_output()?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect())
    }
}

// ---------------------------------------------------------------------------------------
// Tests

/// vxlan, dual stack, node 3 behind a router: what upstream programs, traffic between all
/// pods, then drift, strays, a VTEP MAC change and a lease removal.
#[test]
fn vxlan_programs_peers_and_heals_drift() {
    require_root!();
    check((|| {
        let lab = lab("vx", 3, &[3])?;
        let spec = Spec {
            backend: vxlan(false),
            stack: IpStack::Dual,
            resync: Duration::from_millis(700),
        };
        let agents = start_all(&lab, &spec)?;
        publish_all(&agents)?;
        let n1 = &lab.nodes[0];
        let mac = |i: usize, v6: bool| -> Result<String> {
            let m = if v6 {
                agents[i].macs.v6
            } else {
                agents[i].macs.v4
            };
            Ok(m.context("no VTEP MAC")?.to_string())
        };

        // Exactly upstream's objects on node 1.
        assert_eq!(
            flannel_routes(n1, false)?,
            set(&[
                "10.244.2.0/24 via 10.244.2.0 dev flannel.1 onlink".into(),
                "10.244.3.0/24 via 10.244.3.0 dev flannel.1 onlink".into(),
            ])
        );
        let v6_routes = flannel_routes(n1, true)?;
        for want in [
            "fd00:244:2::/64 via fd00:244:2:: dev flannel-v6.1 metric 1024 onlink pref medium",
            "fd00:244:3::/64 via fd00:244:3:: dev flannel-v6.1 metric 1024 onlink pref medium",
        ] {
            assert!(v6_routes.contains(want), "{want} not in {v6_routes:#?}");
        }
        assert_eq!(v6_routes.len(), 2, "{v6_routes:#?}");
        assert_eq!(
            neighbours(n1, "flannel.1")?,
            set(&[
                format!("10.244.2.0 lladdr {} PERMANENT proto 165", mac(1, false)?),
                format!("10.244.3.0 lladdr {} PERMANENT proto 165", mac(2, false)?),
            ])
        );
        assert_eq!(
            fdb(n1, "flannel.1")?,
            set(&[
                format!("{} dst 192.168.10.2 self permanent", mac(1, false)?),
                format!("{} dst 192.168.20.3 self permanent", mac(2, false)?),
            ])
        );
        assert_eq!(
            fdb(n1, "flannel-v6.1")?,
            set(&[
                format!("{} dst fd00:10::2 self permanent", mac(1, true)?),
                format!("{} dst fd00:20::3 self permanent", mac(2, true)?),
            ])
        );
        // The device: address, MAC, up, the vxlan options.
        let dev = n1.run(&["ip", "-d", "addr", "show", "dev", "flannel.1"])?;
        for want in [
            "10.244.1.0/32",
            &format!("link/ether {}", mac(0, false)?),
            "vxlan id 1",
            "local 192.168.10.1",
            "dev eth0",
            "nolearning",
            "mtu 1450",
            "state UNKNOWN",
        ] {
            assert!(dev.contains(want), "{want:?} not in {dev}");
        }
        let dev6 = n1.run(&["ip", "-d", "addr", "show", "dev", "flannel-v6.1"])?;
        for want in ["fd00:244:1::/128", "local fd00:10::1", "mtu 1430"] {
            assert!(dev6.contains(want), "{want:?} not in {dev6}");
        }
        let accept_ra = n1.run(&["sysctl", "-n", "net.ipv6.conf.flannel-v6/1.accept_ra"])?;
        assert_eq!(accept_ra.trim(), "0");

        pods_talk(&lab, &ALL_PAIRS, false)?;
        pods_talk(&lab, &[(0, 2), (2, 1)], true)?;

        // Steady state: periodic resyncs find everything in place (both families), no churn.
        let seen = agents[0].status().reconciles;
        wait_for("two more resyncs", Duration::from_secs(5), || {
            Ok(agents[0].status().reconciles >= seen + 2)
        })?;
        let s = agents[0].status();
        assert_eq!((s.last.ops, s.last.unchanged), (0, 12), "{s:#?}");

        // Drift: a route deleted by hand comes back; a stray route with our protocol and a
        // route upstream flanneld left on flannel.1 (proto boot) go; a foreign route inside
        // the network stays.
        n1.run(&["ip", "route", "del", "10.244.2.0/24"])?;
        // What upstream flanneld leaves for a live peer (proto boot): taken over.
        n1.run(&[
            "ip",
            "route",
            "replace",
            "10.244.3.0/24",
            "via",
            "10.244.3.0",
            "dev",
            "flannel.1",
            "onlink",
            "proto",
            "boot",
        ])?;
        n1.run(&[
            "ip",
            "route",
            "add",
            "10.244.99.0/24",
            "via",
            "10.244.99.0",
            "dev",
            "flannel.1",
            "onlink",
            "proto",
            "165",
        ])?;
        n1.run(&[
            "ip",
            "route",
            "add",
            "10.244.97.0/24",
            "via",
            "10.244.97.0",
            "dev",
            "flannel.1",
            "onlink",
            "proto",
            "boot",
        ])?;
        n1.run(&[
            "ip",
            "route",
            "add",
            "10.244.98.0/24",
            "via",
            "192.168.10.2",
            "dev",
            "eth0",
            "proto",
            "static",
        ])?;
        let healed = wait_for(
            "the periodic resync to heal node 1",
            Duration::from_secs(5),
            || {
                let all = lines(&n1.run(&["ip", "-4", "route", "show"])?);
                Ok(all
                    .iter()
                    .any(|l| l.starts_with("10.244.2.0/24 via 10.244.2.0"))
                    && all.contains("10.244.3.0/24 via 10.244.3.0 dev flannel.1 proto 165 onlink")
                    && !all.iter().any(|l| l.starts_with("10.244.99.0/24"))
                    && !all.iter().any(|l| l.starts_with("10.244.97.0/24")))
            },
        )?;
        println!("resync (interval 700 ms) healed drift after {healed:?}");
        let all = n1.run(&["ip", "-4", "route", "show"])?;
        assert!(
            all.contains("10.244.98.0/24 via 192.168.10.2 dev eth0 proto static"),
            "{all}"
        );
        pods_talk(&lab, &[(0, 1)], false)?;

        // A VTEP MAC change of node 2 (as node 1 sees it in node 2's lease): the neighbour
        // follows and the old FDB entry goes (upstream leaves it).
        let new_mac = MacAddr([0x0e, 0x2a, 0xaa, 0xbb, 0xcc, 0x02]);
        let mut changed = agents[1].lease.clone();
        changed.attrs.backend_data = Some(
            VxlanLeaseData {
                vni: 1,
                vtep_mac: new_mac,
            }
            .to_json(),
        );
        agents[0].publisher.upsert(agents[1].id(), changed);
        agents[0].wait_applied(Duration::from_secs(5))?;
        let neigh = neighbours(n1, "flannel.1")?;
        assert!(
            neigh.contains(&format!("10.244.2.0 lladdr {new_mac} PERMANENT proto 165")),
            "{neigh:#?}"
        );
        let entries = fdb(n1, "flannel.1")?;
        assert!(
            entries.contains(&format!("{new_mac} dst 192.168.10.2 self permanent")),
            "{entries:#?}"
        );
        let old_mac = mac(1, false)?;
        assert!(
            !entries.iter().any(|e| e.starts_with(&old_mac)),
            "old FDB entry still there: {entries:#?}"
        );
        assert_eq!(agents[0].status().last.replaced, 1);
        agents[0]
            .publisher
            .upsert(agents[1].id(), agents[1].lease.clone());
        agents[0].wait_applied(Duration::from_secs(5))?;
        pods_talk(&lab, &[(0, 1)], false)?;

        // Node 3's lease goes away: its route, neighbour and FDB entry go on node 1 (both
        // families), nothing else changes.
        agents[0].publisher.remove(&agents[2].id());
        let s = agents[0].wait_applied(Duration::from_secs(5))?;
        assert_eq!(s.last.deleted, 6, "{s:#?}");
        assert_eq!(s.last.added + s.last.replaced, 0, "{s:#?}");
        assert_eq!(
            flannel_routes(n1, false)?,
            set(&["10.244.2.0/24 via 10.244.2.0 dev flannel.1 onlink".into()])
        );
        assert!(
            !flannel_routes(n1, true)?
                .iter()
                .any(|r| r.contains("fd00:244:3"))
        );
        assert!(
            !neighbours(n1, "flannel.1")?
                .iter()
                .any(|n| n.starts_with("10.244.3.0"))
        );
        assert!(
            !neighbours(n1, "flannel-v6.1")?
                .iter()
                .any(|n| n.starts_with("fd00:244:3"))
        );
        assert!(
            !fdb(n1, "flannel.1")?
                .iter()
                .any(|e| e.contains("192.168.20.3"))
        );
        assert!(
            !fdb(n1, "flannel-v6.1")?
                .iter()
                .any(|e| e.contains("fd00:20::3"))
        );
        for a in &agents {
            let s = a.status();
            assert!(s.errors_by_kind.is_empty(), "{s:#?}");
            assert_eq!((s.ignored, s.conflicts, s.unreachable), (0, 0, 0));
        }
        for a in agents {
            a.stop()?;
        }
        Ok(())
    })());
}

/// DirectRouting: a plain route to the L2 neighbour, vxlan to the node behind the router.
#[test]
fn direct_routing_only_to_the_l2_neighbour() {
    require_root!();
    check((|| {
        let lab = lab("dr", 3, &[3])?;
        let spec = Spec {
            backend: vxlan(true),
            stack: IpStack::V4,
            resync: Duration::from_secs(30),
        };
        let agents = start_all(&lab, &spec)?;
        publish_all(&agents)?;
        let n1 = &lab.nodes[0];
        assert_eq!(
            flannel_routes(n1, false)?,
            set(&[
                "10.244.2.0/24 via 192.168.10.2 dev eth0".into(),
                "10.244.3.0/24 via 10.244.3.0 dev flannel.1 onlink".into(),
            ])
        );
        let n3_mac = agents[2].macs.v4.context("mac")?;
        assert_eq!(
            neighbours(n1, "flannel.1")?,
            set(&[format!("10.244.3.0 lladdr {n3_mac} PERMANENT proto 165")])
        );
        assert_eq!(
            fdb(n1, "flannel.1")?,
            set(&[format!("{n3_mac} dst 192.168.20.3 self permanent")])
        );
        // Node 3 has no L2 neighbour: everything goes through vxlan there.
        let n3 = flannel_routes(&lab.nodes[2], false)?;
        assert!(
            n3.iter().all(|r| r.contains("dev flannel.1 onlink")),
            "{n3:#?}"
        );
        pods_talk(&lab, &ALL_PAIRS, false)?;
        // The direct path really skips vxlan: node 2's flannel.1 receives nothing while pods
        // 1 and 2 talk (only encapsulated frames from a peer can arrive there), node 3's does
        // when pod 1 talks to pod 3.
        let rx = |n: &Node| rx_packets(n, "flannel.1");
        let (n2, n3) = (&lab.nodes[1], &lab.nodes[2]);
        let before = (rx(n2)?, rx(n3)?);
        pods_talk(&lab, &[(0, 1), (0, 1), (0, 1)], false)?;
        assert_eq!(rx(n2)?, before.0, "node 1 -> node 2 went through vxlan");
        pods_talk(&lab, &[(0, 2)], false)?;
        assert!(rx(n3)? > before.1, "node 1 -> node 3 did not use vxlan");
        assert_eq!(rx(n2)?, before.0);
        for a in agents {
            assert!(a.status().errors_by_kind.is_empty());
            a.stop()?;
        }
        Ok(())
    })());
}

/// host-gw on one L2 segment, dual stack: a route via each peer's public IP; all pods talk.
#[test]
fn host_gw_on_one_segment() {
    require_root!();
    check((|| {
        let lab = lab("hg", 3, &[])?;
        let spec = Spec {
            backend: BackendOptions::HostGw,
            stack: IpStack::Dual,
            resync: Duration::from_secs(30),
        };
        let agents = start_all(&lab, &spec)?;
        publish_all(&agents)?;
        let n1 = &lab.nodes[0];
        assert_eq!(
            flannel_routes(n1, false)?,
            set(&[
                "10.244.2.0/24 via 192.168.10.2 dev eth0".into(),
                "10.244.3.0/24 via 192.168.10.3 dev eth0".into(),
            ])
        );
        let v6 = flannel_routes(n1, true)?;
        assert!(
            v6.contains("fd00:244:2::/64 via fd00:10::2 dev eth0 metric 1024 pref medium"),
            "{v6:#?}"
        );
        assert!(
            n1.ns
                .output(&["ip", "link", "show", "flannel.1"])?
                .status
                .code()
                != Some(0)
        );
        pods_talk(&lab, &ALL_PAIRS, false)?;
        pods_talk(&lab, &[(0, 2), (2, 1)], true)?;
        for a in agents {
            let s = a.status();
            assert_eq!(s.unreachable, 0);
            assert!(s.errors_by_kind.is_empty(), "{s:#?}");
            a.stop()?;
        }
        Ok(())
    })());
}

/// host-gw with node 3 behind a router: no route to it (reported and counted), no kernel
/// errors, the two L2 neighbours still talk.
#[test]
fn host_gw_peer_behind_a_router_is_reported_not_black_holed() {
    require_root!();
    check((|| {
        let lab = lab("hr", 3, &[3])?;
        let spec = Spec {
            backend: BackendOptions::HostGw,
            stack: IpStack::V4,
            resync: Duration::from_millis(300),
        };
        let agents = start_all(&lab, &spec)?;
        publish_all(&agents)?;
        assert_eq!(
            flannel_routes(&lab.nodes[0], false)?,
            set(&["10.244.2.0/24 via 192.168.10.2 dev eth0".into()])
        );
        assert_eq!(flannel_routes(&lab.nodes[2], false)?, BTreeSet::new());
        // Several resyncs later: still no failed operation, nothing retried in a loop.
        thread::sleep(Duration::from_millis(1000));
        let expected_unreachable = [1, 1, 2];
        for (a, want) in agents.iter().zip(expected_unreachable) {
            let s = a.status();
            assert_eq!(s.unreachable, want, "{s:#?}");
            assert_eq!(s.failures, 0, "{s:#?}");
            assert!(s.reconciles >= 3, "{s:#?}");
            assert_eq!(s.totals.errors, 0, "{s:#?}");
            assert!(s.healthy());
        }
        pods_talk(&lab, &[(0, 1), (1, 0)], false)?;
        for a in agents {
            a.stop()?;
        }
        Ok(())
    })());
}

/// An agent restart adopts the kernel state: no kernel change at all, continuous traffic
/// loses nothing, the VTEP MAC stays.
#[test]
fn restart_is_hitless() {
    require_root!();
    check((|| {
        let lab = lab("rs", 3, &[3])?;
        let spec = Spec {
            backend: vxlan(false),
            stack: IpStack::V4,
            resync: Duration::from_secs(30),
        };
        let mut agents = start_all(&lab, &spec)?;
        publish_all(&agents)?;
        let n1 = &lab.nodes[0];
        pods_talk(&lab, &[(0, 2), (2, 0)], false)?;
        // The kernel's own IPv6 link-local address on flannel.1 finishes duplicate address
        // detection about a second after the device comes up; let that settle first so the
        // monitors below only see what the agents do.
        wait_for("DAD on flannel.1", Duration::from_secs(10), || {
            Ok(!n1
                .run(&["ip", "-6", "addr", "show", "dev", "flannel.1"])?
                .contains("tentative"))
        })?;
        let snapshot = |n: &Node| -> Result<Vec<BTreeSet<String>>> {
            Ok(vec![
                flannel_routes(n, false)?,
                lines(&n.run(&["ip", "-4", "route", "show", "table", "all"])?),
                neighbours(n, "flannel.1")?,
                fdb(n, "flannel.1")?,
                lines(&n.run(&["ip", "-o", "addr", "show", "dev", "flannel.1"])?),
            ])
        };
        let before = snapshot(n1)?;
        let flow = UdpFlow::start(&lab.nodes[0].pod, &lab.nodes[2].pod, lab.nodes[2].pod_ip())?;
        let routes_mon = Monitor::start(
            &n1.ns,
            &["ip", "monitor", "route", "neigh", "link", "address"],
        )?;
        let fdb_mon = Monitor::start(&n1.ns, &["bridge", "monitor", "fdb"])?;
        thread::sleep(Duration::from_millis(300));

        let old = agents.remove(0);
        let old_macs = old.macs;
        let old_status = old.status();
        old.stop()?;
        thread::sleep(Duration::from_millis(200));
        // The new agent first sees what a subnet manager publishes before its first listing
        // (nothing, unsynced), then the full set.
        let new = start_agent(n1, &spec)?;
        assert_eq!(new.macs, old_macs, "VTEP MAC changed across the restart");
        wait_for(
            "the first (add-only) reconcile",
            Duration::from_secs(5),
            || Ok(new.status().reconciles >= 1),
        )?;
        thread::sleep(Duration::from_millis(200));
        let others: BTreeMap<LeaseId, Lease> =
            agents.iter().map(|o| (o.id(), o.lease.clone())).collect();
        new.publisher.replace_all(others);
        let s = new.wait_applied(Duration::from_secs(5))?;
        thread::sleep(Duration::from_millis(300));

        let (sent, lost) = flow.finish()?;
        let events: Vec<String> = routes_mon
            .finish()?
            .into_iter()
            .chain(fdb_mon.finish()?)
            .filter(|l| l.contains("flannel") || l.contains("proto 165"))
            .collect();
        let after = snapshot(n1)?;
        println!(
            "restart: {sent} requests, {lost} lost; old agent totals {}; new agent totals {}",
            old_status.totals, s.totals
        );
        assert_eq!(
            events,
            Vec::<String>::new(),
            "the restart changed the kernel"
        );
        assert_eq!(before, after);
        assert_eq!(
            (
                s.totals.added,
                s.totals.replaced,
                s.totals.deleted,
                s.totals.ops
            ),
            (0, 0, 0, 0),
            "{s:#?}"
        );
        assert_eq!(s.last.unchanged, 6, "{s:#?}"); // 2 peers × (route, neighbour, FDB)
        assert!(sent > 100, "the flow hardly ran: {sent}");
        assert_eq!(lost, 0, "{lost} of {sent} requests lost across the restart");
        new.stop()?;
        for a in agents {
            a.stop()?;
        }
        Ok(())
    })());
}

/// `ip link del flannel.1` under a running agent: recreated with the same MAC and all peers
/// within a second or two. After a stop, a deleted device comes back on the next start with
/// the persisted MAC.
#[test]
fn deleted_device_comes_back_with_its_mac_and_peers() {
    require_root!();
    check((|| {
        let lab = lab("dd", 3, &[])?;
        let spec = Spec {
            backend: vxlan(false),
            stack: IpStack::V4,
            resync: Duration::from_secs(30),
        };
        let mut agents = start_all(&lab, &spec)?;
        publish_all(&agents)?;
        let n1 = &lab.nodes[0];
        pods_talk(&lab, &[(0, 1)], false)?;
        let mac = agents[0].macs.v4.context("mac")?.to_string();
        let routes = flannel_routes(n1, false)?;
        let neigh = neighbours(n1, "flannel.1")?;
        let entries = fdb(n1, "flannel.1")?;
        assert_eq!((routes.len(), neigh.len(), entries.len()), (2, 2, 2));

        n1.run(&["ip", "link", "del", "flannel.1"])?;
        let took = wait_for(
            "flannel.1 and its peers to come back",
            Duration::from_secs(5),
            || {
                Ok(link_mac(n1, "flannel.1")?.as_deref() == Some(mac.as_str())
                    && flannel_routes(n1, false)? == routes
                    && neighbours(n1, "flannel.1")? == neigh
                    && fdb(n1, "flannel.1")? == entries)
            },
        )?;
        println!("flannel.1 deleted by hand: device and 2 peers back after {took:?}");
        assert!(took < Duration::from_secs(2), "took {took:?}");
        let s = agents[0].status();
        assert_eq!(s.device_recreations, 1, "{s:#?}");
        let addr = n1.run(&["ip", "-o", "addr", "show", "dev", "flannel.1"])?;
        assert!(addr.contains("10.244.1.0/32"), "{addr}");
        pods_talk(&lab, &[(0, 1), (1, 0), (0, 2)], false)?;

        // Stopped agent, device gone (a reboot): the next start recreates it with the
        // persisted MAC, so peers' FDB entries stay valid.
        let old = agents.remove(0);
        old.stop()?;
        n1.run(&["ip", "link", "del", "flannel.1"])?;
        let again = start_agent(n1, &spec)?;
        assert_eq!(again.macs.v4.map(|m| m.to_string()), Some(mac.clone()));
        assert_eq!(link_mac(n1, "flannel.1")?, Some(mac.clone()));
        again.stop()?;

        // Something else changed the device's MAC while the agent was down: restored.
        n1.run(&[
            "ip",
            "link",
            "set",
            "flannel.1",
            "address",
            "0e:2a:00:00:99:99",
        ])?;
        let again = start_agent(n1, &spec)?;
        assert_eq!(link_mac(n1, "flannel.1")?, Some(mac.clone()));
        again.stop()?;

        // An incompatible device of that name (another VNI and port): recreated as wanted.
        n1.run(&["ip", "link", "del", "flannel.1"])?;
        n1.run(&[
            "ip",
            "link",
            "add",
            "flannel.1",
            "type",
            "vxlan",
            "id",
            "5",
            "dstport",
            "4789",
            "dev",
            "eth0",
        ])?;
        let again = start_agent(n1, &spec)?;
        let dev = n1.run(&["ip", "-d", "link", "show", "flannel.1"])?;
        assert!(
            dev.contains("vxlan id 1 ") && dev.contains("dstport 8472"),
            "{dev}"
        );
        assert_eq!(link_mac(n1, "flannel.1")?, Some(mac));
        again.stop()?;
        for a in agents {
            a.stop()?;
        }
        Ok(())
    })());
}

/// A failing reconcile (the external interface is gone) leaves the dataplane alone, is
/// reported in the status, retried with back-off and recovers by itself.
#[test]
fn failures_are_reported_retried_and_recovered() {
    require_root!();
    check((|| {
        let lab = lab("fr", 2, &[])?;
        let spec = Spec {
            backend: vxlan(false),
            stack: IpStack::V4,
            resync: Duration::from_millis(300),
        };
        let agents = start_all(&lab, &spec)?;
        publish_all(&agents)?;
        let n1 = &lab.nodes[0];
        let routes = flannel_routes(n1, false)?;
        assert_eq!(routes.len(), 1);

        n1.run(&["ip", "link", "set", "eth0", "down"])?;
        n1.run(&["ip", "link", "set", "eth0", "name", "ethx"])?;
        let started = agents[0].status().reconciles;
        wait_for("failures to be reported", Duration::from_secs(5), || {
            Ok(agents[0].status().consecutive_failures >= 3)
        })?;
        thread::sleep(Duration::from_millis(1500));
        let s = agents[0].status();
        println!(
            "external interface gone: {} attempts in ~2 s, last error: {:?}",
            s.reconciles - started,
            s.last_error
        );
        assert!(!s.healthy());
        assert!(
            s.errors_by_kind
                .get("device:external_interface_gone")
                .copied()
                >= Some(3),
            "{s:#?}"
        );
        assert!(
            s.last_error
                .as_deref()
                .is_some_and(|e| e.contains("external interface eth0")),
            "{s:#?}"
        );
        // Back-off, not a hot loop: the retry delay grows to the resync interval.
        assert!(s.reconciles - started < 15, "{s:#?}");
        // Nothing was torn down meanwhile.
        assert_eq!(flannel_routes(n1, false)?, routes);

        n1.run(&["ip", "link", "set", "ethx", "name", "eth0"])?;
        n1.run(&["ip", "link", "set", "eth0", "up"])?;
        wait_for("recovery", Duration::from_secs(5), || {
            Ok(agents[0].status().healthy())
        })?;
        let s = agents[0].status();
        assert_eq!(s.last_error, None);
        assert_eq!(flannel_routes(n1, false)?, routes);
        // The vxlan device kept its underlay (same index after the rename): no recreation.
        assert_eq!(s.device_recreations, 0, "{s:#?}");
        wait_for(
            "the underlay to carry traffic again",
            Duration::from_secs(10),
            || Ok(pods_talk(&lab, &[(0, 1)], false).is_ok()),
        )?;
        for a in agents {
            a.stop()?;
        }
        Ok(())
    })());
}

/// 5,000 remote leases: time until every route, neighbour and FDB entry is in the kernel,
/// operations used, a no-op resync, and the two ways to read DirectRouting facts.
#[test]
fn five_thousand_peers() {
    require_root!();
    check((|| {
        const PEERS: u32 = 5000;
        let lab = lab("sc", 1, &[])?;
        let node = &lab.nodes[0];
        let spec = Spec {
            backend: vxlan(false),
            stack: IpStack::V4,
            resync: Duration::from_secs(600),
        };
        let agent = start_agent(node, &spec)?;
        let public = |i: u32| Ipv4Addr::new(172, 16, (i / 250) as u8, (i % 250) as u8 + 1);
        let leases: BTreeMap<LeaseId, Lease> = (0..PEERS)
            .map(|i| {
                let subnet = Ipv4Net::new(
                    Ipv4Addr::new(10, 100 + (i / 256) as u8, (i % 256) as u8, 0),
                    24,
                )
                .unwrap_or_default();
                let mac = MacAddr([0x0e, 0x2b, 0, 0, (i >> 8) as u8, i as u8]);
                let lease = Lease {
                    subnet: Some(subnet),
                    ipv6_subnet: None,
                    attrs: LeaseAttrs {
                        public_ip: public(i),
                        backend_type: "vxlan".into(),
                        backend_data: Some(
                            VxlanLeaseData {
                                vni: 1,
                                vtep_mac: mac,
                            }
                            .to_json(),
                        ),
                        ..LeaseAttrs::default()
                    },
                    expiration: None,
                };
                (lease_id(&lease), lease)
            })
            .collect();

        let start = Instant::now();
        agent.publisher.replace_all(leases.clone());
        let s = agent.wait_applied(Duration::from_secs(60))?;
        let took = start.elapsed();
        let count = |argv: &[&str]| -> Result<usize> { Ok(lines(&node.run(argv)?).len()) };
        let routes = count(&["ip", "-4", "route", "show", "proto", "165"])?;
        let neigh = count(&["ip", "neigh", "show", "dev", "flannel.1"])?;
        let fdb_entries = count(&["bridge", "fdb", "show", "dev", "flannel.1"])?;
        println!(
            "{PEERS} peers: all in the kernel after {took:?} (reconcile {:?}); {} netlink \
             operations ({})",
            s.last_duration, s.last.ops, s.last
        );
        assert_eq!((routes, neigh, fdb_entries), (5000, 5000, 5000));
        assert_eq!(s.last.added, 15000, "{s:#?}");
        assert_eq!(s.last.ops, 15000, "{s:#?}");

        // A reconcile with nothing to do (an ignored lease of another backend arrives).
        let mut other = leases.values().next().cloned().context("a lease")?;
        other.subnet = Some("10.99.0.0/24".parse()?);
        other.attrs.backend_type = "host-gw".into();
        agent.publisher.upsert(lease_id(&other), other);
        let s = agent.wait_applied(Duration::from_secs(30))?;
        println!(
            "no-op reconcile over {PEERS} peers: {:?} ({})",
            s.last_duration, s.last
        );
        assert_eq!(s.last.ops, 0, "{s:#?}");
        assert_eq!(s.last.unchanged, 15000, "{s:#?}");

        // DirectRouting facts for 5,000 public IPs: one table dump + index, or upstream's
        // `route get` per address. Both must agree.
        let ips: Vec<IpAddr> = (0..PEERS)
            .map(|i| IpAddr::V4(public(i)))
            .chain([IpAddr::V4(Ipv4Addr::new(192, 168, 10, 7))])
            .collect();
        let own_index = ifindex(node, "flannel.1")?;
        let (dump_time, probe_time, agree) =
            node.ns.enter(|| -> Result<(Duration, Duration, usize)> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async {
                    let nl = Netlink::new()?;
                    let t = Instant::now();
                    let dumped = Facts::read(&nl, &[IpFamily::V4], &[own_index]).await?;
                    let answers: Vec<Reachability> =
                        ips.iter().map(|ip| dumped.reach(*ip)).collect();
                    let dump_time = t.elapsed();
                    let t = Instant::now();
                    let probed = Facts::probe(&nl, &ips, &[own_index]).await?;
                    let probe_time = t.elapsed();
                    let mut agree = 0;
                    for (ip, a) in ips.iter().zip(&answers) {
                        let b = probed.reach(*ip);
                        ensure!(*a == b, "{ip}: table index says {a}, route get says {b}");
                        agree += 1;
                    }
                    ensure!(
                        matches!(
                            dumped.reach(IpAddr::V4(Ipv4Addr::new(192, 168, 10, 7))),
                            Reachability::Direct { .. }
                        ),
                        "the connected underlay address is not direct"
                    );
                    Ok((dump_time, probe_time, agree))
                })
            })??;
        println!(
            "facts for {} addresses with {PEERS} flannel routes in the table: dump+index {dump_time:?}, \
             route get each {probe_time:?} (answers agree for {agree})",
            ips.len()
        );

        // All leases gone.
        let start = Instant::now();
        agent.publisher.replace_all(BTreeMap::new());
        let s = agent.wait_applied(Duration::from_secs(60))?;
        println!(
            "{PEERS} peers removed after {:?} ({})",
            start.elapsed(),
            s.last
        );
        assert_eq!(s.last.deleted, 15000, "{s:#?}");
        assert_eq!(count(&["ip", "-4", "route", "show", "proto", "165"])?, 0);
        assert_eq!(count(&["ip", "neigh", "show", "dev", "flannel.1"])?, 0);
        assert_eq!(count(&["bridge", "fdb", "show", "dev", "flannel.1"])?, 0);
        agent.stop()
    })());
}

/// The kernel has no ipip link type here: the ipip backend says what to do instead.
#[test]
fn ipip_without_kernel_support_asks_for_the_ebpf_path() {
    require_root!();
    check((|| {
        let lab = lab("ip", 1, &[])?;
        let node = &lab.nodes[0];
        let spec = Spec {
            backend: BackendOptions::Ipip(IpipOptions::default()),
            stack: IpStack::V4,
            resync: Duration::from_secs(30),
        };
        let params = node.params.clone();
        let result = node
            .ns
            .enter(|| -> Result<std::result::Result<(), String>> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async {
                    let nl = Netlink::new()?;
                    match init_node(&nl, &params, &spec).await {
                        Ok(_) => Ok(Ok(())),
                        Err(e) => match e.downcast_ref::<DataplaneError>() {
                            Some(d @ DataplaneError::IpipNeedsEbpf { .. }) => {
                                Ok(Err(d.to_string()))
                            }
                            _ => Err(e),
                        },
                    }
                })
            })??;
        match result {
            Err(message) => {
                assert!(
                    message.starts_with("ipip needs the eBPF fast path here"),
                    "{message}"
                );
                assert!(message.contains("flannel.ipip"), "{message}");
            }
            Ok(()) => {
                // A kernel with ipip: the device is there, with the address.
                let addr = node.run(&["ip", "-d", "addr", "show", "dev", "flannel.ipip"])?;
                assert!(addr.contains("10.244.1.0/32"), "{addr}");
            }
        }
        Ok(())
    })());
}
