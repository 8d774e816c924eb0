//! The wireguard backend end to end: real agents in a simulated three-node cluster (etcd
//! mode, L2 underlay). This kernel has no WireGuard, so every node runs the userspace
//! device (wireguard-go) the agent starts; the checks read it back through its UAPI socket.
//!
//! * pod-to-pod traffic across nodes works, and a capture on the underlay shows only UDP to
//!   and from the listen port between the nodes: no pod address, no plaintext payload;
//! * every node has one peer per other node: the public key of its lease, its subnet as
//!   allowed IP, `<public IP>:51820`, the configured PSK and keepalive;
//! * an agent restart keeps the key, the device and the wireguard-go process, and traffic
//!   does not stop while it restarts;
//! * a deleted device is recreated with its peers;
//! * a removed lease removes its peer everywhere.
//!
//! Needs root; skips without it.

use std::{
    collections::BTreeSet,
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpStream},
    path::PathBuf,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use flannel_agent::{
    backend::WgKey,
    wireguard::{DeviceState, PrivateKey, UapiClient},
};
use flannel_tests::{
    lab::{
        agent, bins,
        cluster::{Cluster, ClusterSpec},
        kv::in_netns,
        lease::LeaseRecord,
        probe::{Responder, tcp_probe},
        process::Output,
    },
    packet::{self, ParsedL3, ParsedL4},
    require_root,
    topology::{Node, TopologySpec, Underlay},
};
use serde_json::json;

mod agent_support;

/// Base64 of 32 bytes.
const PSK: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
const KEEPALIVE: u16 = 25;
const PORT: u16 = 51820;
const T: Duration = Duration::from_secs(3);

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

fn spec(nodes: usize) -> ClusterSpec {
    let topo = TopologySpec::new(nodes, Underlay::L2).cni_plugin(cni_plugin());
    let mut spec = ClusterSpec::new(topo, "wireguard", agent_bin());
    spec.backend_options = json!({"PSK": PSK, "PersistentKeepaliveInterval": KEEPALIVE});
    spec.pods_per_node = 1;
    spec.agent_args = vec!["--resync-interval=2".into()];
    // Each node has a socket directory of its own (several userspace devices on one host),
    // which the agent bind-mounts for wireguard-go: that takes CAP_SYS_ADMIN, also when the
    // agents run with restricted capabilities (FLANNEL_TEST_AGENT_CAPS).
    if let Some(caps) = agent::capabilities_from_env() {
        spec.agent_capabilities = Some(caps.into_iter().chain(["SYS_ADMIN".into()]).collect());
    }
    spec
}

fn up(nodes: usize) -> Cluster {
    Cluster::up(spec(nodes), &|line| eprintln!("lab: {line}"), &|| false).expect("cluster up")
}

fn socket(node: &Node) -> PathBuf {
    node.dir().join("wireguard").join("flannel-wg.sock")
}

fn device_state(node: &Node) -> Result<DeviceState> {
    let client = UapiClient::new(socket(node));
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(client.get())
        .with_context(|| format!("UAPI get on {}", node.name()))
}

/// The processes named `comm` running in `node`'s namespace.
fn pids_named(node: &Node, comm: &str) -> Vec<i32> {
    let out = std::process::Command::new("ip")
        .args(["netns", "pids", node.ns().name()])
        .output()
        .expect("ip netns pids");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .map(|c| c.trim() == comm)
                .unwrap_or(false)
        })
        .collect()
}

fn ifindex(node: &Node, dev: &str) -> Result<u32> {
    let link = node.run(&["ip", "-o", "link", "show", "dev", dev])?;
    link.split(':')
        .next()
        .and_then(|i| i.trim().parse().ok())
        .with_context(|| format!("ifindex of {dev} in {link:?}"))
}

/// Probes `target` from the namespace at `ns_path` every 50 ms until `stop`, counting
/// successes and failures (each probe: connect, send, read the echo; 2 s limit).
fn start_prober(
    ns_path: PathBuf,
    target: SocketAddr,
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let _ = in_netns(&ns_path, || {
            while !stop.load(Ordering::Relaxed) {
                let once = || -> std::io::Result<()> {
                    let limit = Duration::from_secs(2);
                    let mut s = TcpStream::connect_timeout(&target, limit)?;
                    s.set_read_timeout(Some(limit))?;
                    s.write_all(b"restart-probe")?;
                    let mut got = [0u8; 13];
                    s.read_exact(&mut got)?;
                    Ok(())
                };
                match once() {
                    Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
                thread::sleep(Duration::from_millis(50));
            }
            Ok(())
        });
    })
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<Option<T>>) -> T {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return v,
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what} (last error: {last})"
        );
        thread::sleep(Duration::from_millis(200));
    }
}

fn lease_key(l: &LeaseRecord) -> WgKey {
    let text = l
        .backend_data
        .as_ref()
        .and_then(|d| d.get("PublicKey"))
        .and_then(|k| k.as_str())
        .unwrap_or_else(|| panic!("lease {} has no PublicKey: {:?}", l.key, l.backend_data));
    text.parse().expect("lease PublicKey is base64 of 32 bytes")
}

/// Each node's peers match the other nodes' leases exactly.
fn assert_peers_match_leases(cluster: &Cluster, nodes: &[usize]) {
    let leases = cluster.leases().expect("leases");
    let psk: WgKey = PSK.parse().expect("psk");
    for &n in nodes {
        let node = &cluster.topology().nodes()[n - 1];
        let state = device_state(node).expect("device state");
        let own = leases
            .iter()
            .find(|l| l.public_ip == Some(node.addr()))
            .expect("own lease");
        let key = state.private_key.as_ref().expect("private key set");
        assert_eq!(
            key.public_key(),
            lease_key(own),
            "{}: lease key",
            node.name()
        );
        assert_eq!(state.listen_port, PORT);
        let want: BTreeSet<WgKey> = leases
            .iter()
            .filter(|l| l.key != own.key)
            .filter(|l| {
                nodes
                    .iter()
                    .any(|m| Some(cluster.topology().nodes()[m - 1].addr()) == l.public_ip)
            })
            .map(lease_key)
            .collect();
        let have: BTreeSet<WgKey> = state.peers.iter().map(|p| p.public_key).collect();
        assert_eq!(have, want, "{}: peers", node.name());
        for peer in &state.peers {
            let lease = leases
                .iter()
                .find(|l| lease_key(l) == peer.public_key)
                .expect("lease of peer");
            let ip = lease.public_ip.expect("public ip");
            assert_eq!(peer.endpoint, Some(SocketAddr::new(IpAddr::V4(ip), PORT)));
            let allowed: Vec<String> = peer.allowed_ips.iter().map(ToString::to_string).collect();
            assert_eq!(allowed, vec![lease.subnet.to_string()], "{}", node.name());
            assert_eq!(peer.preshared_key, Some(psk), "{}: PSK", node.name());
            assert_eq!(peer.persistent_keepalive, KEEPALIVE);
        }
    }
}

/// Probes node1's pod → node2's pod with a TCP echo while capturing node1's underlay, and
/// checks the capture: between the nodes only UDP from/to the listen port, never a pod
/// address on the wire, never the probe's plaintext.
fn assert_encrypted_on_the_wire(cluster: &Cluster) {
    let topo = cluster.topology();
    let node1 = &topo.nodes()[0];
    let pods1 = topo.pods_on(1);
    let pods2 = topo.pods_on(2);
    let (from, to) = (pods1[0], pods2[0]);
    let pcap = node1.dir().join("underlay.pcap");
    let log = node1.dir().join("tcpdump.log");
    let mut tcpdump = node1
        .spawn(
            &[
                "tcpdump",
                "-i",
                "eth0",
                "-n",
                "-U",
                "--immediate-mode",
                "-w",
                pcap.to_str().expect("utf-8 path"),
            ],
            Output::File(log.clone()),
        )
        .expect("tcpdump");
    wait_for("tcpdump to listen", Duration::from_secs(15), || {
        Ok(std::fs::read_to_string(&log)?
            .contains("listening on")
            .then_some(()))
    });
    let responder = Responder::start(to.ns(), IpAddr::V4(to.ip()), 0).expect("responder");
    for _ in 0..5 {
        tcp_probe(from.ns(), responder.addr(), T).expect("pod to pod over wireguard");
    }
    thread::sleep(Duration::from_millis(1500));
    let _ = tcpdump.terminate(Duration::from_secs(5));
    let frames = packet::read_pcap(&pcap).expect("capture");
    let tcpdump_said = std::fs::read_to_string(&log).unwrap_or_default();
    let node_ips: Vec<IpAddr> = topo.nodes().iter().map(|n| IpAddr::V4(n.addr())).collect();
    let pod_ips: Vec<IpAddr> = topo.pods().iter().map(|p| IpAddr::V4(p.ip())).collect();
    let mut wireguard_data = 0;
    for raw in &frames {
        assert!(
            !raw.windows(11).any(|w| w == b"flannel-lab"),
            "plaintext probe on the underlay:\n{}",
            packet::hexdump(raw)
        );
        let Ok(frame) = packet::parse(raw) else {
            continue;
        };
        let ParsedL3::Ipv4(ip) = &frame.l3 else {
            continue;
        };
        let (src, dst) = (IpAddr::V4(ip.src), IpAddr::V4(ip.dst));
        assert!(
            !pod_ips.contains(&src) && !pod_ips.contains(&dst),
            "a pod address on the underlay: {src} -> {dst}"
        );
        if node_ips.contains(&src) && node_ips.contains(&dst) {
            match &ip.l4 {
                ParsedL4::Udp {
                    src_port,
                    dst_port,
                    payload,
                    ..
                } if *src_port == PORT && *dst_port == PORT => {
                    // WireGuard message type 4: transport data.
                    if payload.first() == Some(&4) {
                        wireguard_data += 1;
                    }
                }
                other => {
                    panic!("node-to-node packet that is not WireGuard: {src} -> {dst} {other:?}")
                }
            }
        }
    }
    eprintln!(
        "capture: {} frames, {wireguard_data} WireGuard data packets between the nodes",
        frames.len()
    );
    assert!(
        wireguard_data >= 10,
        "expected the probes as WireGuard data packets, saw {wireguard_data} in {} frames; \
         tcpdump: {tcpdump_said}",
        frames.len()
    );
}

/// An agent without CAP_SYS_ADMIN (the DaemonSet's capabilities) cannot give wireguard-go a
/// socket directory other than the standard one, which it bind-mounts in a mount namespace
/// of wireguard-go's own: it exits with an error that says so and what to do, instead of the
/// bare "Operation not permitted" and a hint to install wireguard-go.
#[test]
fn a_private_socket_dir_without_sys_admin_is_a_clear_error() {
    require_root!();
    let mut spec = spec(1);
    spec.agent_capabilities =
        Some(agent_support::daemonset_capabilities().unwrap_or_else(|e| panic!("{e:#}")));
    let err = match Cluster::up(spec, &|line| eprintln!("lab: {line}"), &|| false) {
        Ok(_) => panic!("the agent ran"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("which takes CAP_SYS_ADMIN")
            && err.contains("leave --wireguard-socket-dir at /var/run/wireguard"),
        "{err}"
    );
}

#[test]
fn wireguard_cluster_end_to_end() {
    require_root!();
    let mut cluster = up(3);
    let all = [1, 2, 3];

    // Pods reach each other across nodes, once every agent has programmed every peer (a
    // handshake initiation that reaches a node before it knows the sender is dropped, and
    // WireGuard retries only after 5 s).
    cluster.wait_ready(Duration::from_secs(60)).expect("ready");
    wait_for("pods to reach each other", Duration::from_secs(20), || {
        let matrix = cluster.matrix(T)?;
        anyhow::ensure!(matrix.all_ok(), "{matrix}");
        Ok(Some(()))
    });

    // Userspace devices, one wireguard-go per node, with peers from the leases.
    for node in cluster.topology().nodes() {
        assert_eq!(pids_named(node, "wireguard-go").len(), 1, "{}", node.name());
        let log = std::fs::read_to_string(node.agent_log()).expect("agent log");
        assert!(
            log.contains("with userspace wireguard-go (this kernel has no WireGuard"),
            "the agent should say it runs the userspace device:\n{log}"
        );
        let routes = node
            .run(&["ip", "route", "show", "dev", "flannel-wg"])
            .expect("routes");
        assert!(routes.contains("10.244.0.0/16"), "{routes}");
        let mtu = node
            .run(&["ip", "-o", "link", "show", "flannel-wg"])
            .expect("link");
        assert!(mtu.contains("mtu 1420"), "{mtu}");
    }
    wait_for("peers on every node", Duration::from_secs(15), || {
        Ok(cluster
            .topology()
            .nodes()
            .iter()
            .all(|n| device_state(n).map(|s| s.peers.len() == 2).unwrap_or(false))
            .then_some(()))
    });
    assert_peers_match_leases(&cluster, &all);

    // Only encrypted UDP on the underlay.
    assert_encrypted_on_the_wire(&cluster);

    // Restart node1's agent while node1's pod keeps talking to node2's pod.
    let node1 = &cluster.topology().nodes()[0];
    let key_file = node1.dir().join("wgkey");
    let key_before = std::fs::read_to_string(&key_file).expect("key file");
    let pid_before = pids_named(node1, "wireguard-go");
    let index_before = ifindex(node1, "flannel-wg").expect("ifindex");
    let from_ns = cluster.topology().pods_on(1)[0].ns().path();
    let to = cluster.topology().pods_on(2)[0];
    let responder = Responder::start(to.ns(), IpAddr::V4(to.ip()), 0).expect("responder");
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let prober = start_prober(
        from_ns,
        responder.addr(),
        stop.clone(),
        ok.clone(),
        failed.clone(),
    );
    thread::sleep(Duration::from_millis(500));
    cluster
        .agent_mut(1)
        .expect("agent 1")
        .restart()
        .expect("restart");
    {
        let node1 = &cluster.topology().nodes()[0];
        wait_for(
            "node1's agent adopts its device",
            Duration::from_secs(30),
            || {
                let log = std::fs::read_to_string(node1.agent_log())?;
                Ok(log
                    .contains("adopted the running userspace WireGuard device")
                    .then_some(()))
            },
        );
    }
    thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    prober.join().expect("prober");
    drop(responder);
    let node1 = &cluster.topology().nodes()[0];
    eprintln!(
        "probes during the restart: {} ok, {} failed",
        ok.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    assert!(
        ok.load(Ordering::Relaxed) > 10,
        "probes during restart: {ok:?}"
    );
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "traffic stopped during the agent restart"
    );
    assert_eq!(
        std::fs::read_to_string(&key_file).expect("key file"),
        key_before
    );
    assert_eq!(
        pids_named(node1, "wireguard-go"),
        pid_before,
        "wireguard-go was replaced"
    );
    assert_eq!(ifindex(node1, "flannel-wg").expect("ifindex"), index_before);
    assert_peers_match_leases(&cluster, &all);

    // A deleted device comes back with its peers (a new wireguard-go process).
    let node2 = &cluster.topology().nodes()[1];
    let old_pid = pids_named(node2, "wireguard-go");
    node2
        .run(&["ip", "link", "del", "flannel-wg"])
        .expect("delete device");
    wait_for(
        "node2's device is recreated with peers",
        Duration::from_secs(30),
        || {
            let pids = pids_named(node2, "wireguard-go");
            if pids.is_empty() || pids == old_pid {
                return Ok(None);
            }
            Ok(device_state(node2)
                .map(|s| s.peers.len() == 2)
                .unwrap_or(false)
                .then_some(()))
        },
    );
    assert_peers_match_leases(&cluster, &all);
    wait_for(
        "pods reach each other again",
        Duration::from_secs(20),
        || Ok(cluster.matrix(T)?.all_ok().then_some(())),
    );

    // node3 goes away: stop its agent, delete its lease; the others drop its peer.
    let leases = cluster.leases().expect("leases");
    let node3_addr = cluster.topology().nodes()[2].addr();
    let gone = leases
        .iter()
        .find(|l| l.public_ip == Some(node3_addr))
        .expect("node3 lease")
        .clone();
    cluster
        .agent_mut(3)
        .expect("agent 3")
        .stop(Duration::from_secs(10))
        .expect("stop node3");
    let deleted = cluster.kv().delete_prefix(&gone.key).expect("delete lease");
    assert_eq!(deleted, 1);
    let gone_key = lease_key(&gone);
    for n in [1, 2] {
        let node = &cluster.topology().nodes()[n - 1];
        wait_for(
            "the removed lease's peer goes",
            Duration::from_secs(20),
            || {
                let state = device_state(node)?;
                Ok((state.peers.len() == 1 && state.peer(&gone_key).is_none()).then_some(()))
            },
        );
    }
    assert_peers_match_leases(&cluster, &[1, 2]);
}

/// Keys survive restarts at the file level too: the key file written by one agent run is
/// the one the next run publishes (checked without a cluster through the library).
#[test]
fn key_file_is_reused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("run/flannel/wgkey");
    let first = flannel_agent::wireguard::load_key(&path).expect("generate");
    let second = flannel_agent::wireguard::load_key(&path).expect("load");
    assert_eq!(first, second);
    let text = std::fs::read_to_string(&path).expect("read");
    assert_eq!(PrivateKey::from_base64(&text).expect("base64"), first);
    // `wg pubkey` (an independent X25519) agrees on the public key, when installed.
    if let Ok(mut child) = std::process::Command::new("wg")
        .arg("pubkey")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
    {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("write");
        let out = child.wait_with_output().expect("wg pubkey");
        assert!(out.status.success());
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            first.public_key().to_string()
        );
    }
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode, 0o400, "key file mode {mode:o}");
}
