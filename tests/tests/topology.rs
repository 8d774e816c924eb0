//! The simulated cluster without the agent: underlays (L2, routed L3, mixed, IPv6), pods made
//! by the real CNI plugin from a hand-written subnet.env, hand-configured host-gw and VXLAN
//! paths, etcd in the hub, the agent harness driven by a stand-in shell "agent", and cleanup
//! (also after a panic). Everything needs root and skips without it.

use std::{
    collections::BTreeMap,
    fs,
    net::{IpAddr, Ipv4Addr},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    sync::OnceLock,
    time::Duration,
};

use flannel_tests::{
    bench::{
        dataplane,
        variant::{self, SetupCtx},
    },
    lab::{
        agent::{Agent, AgentSpec},
        bins,
        cluster::{Cluster, ClusterSpec},
        kv::Kv,
        lease,
        probe::{self, tcp_reaches},
        process::Output,
        status,
    },
    netns, require_root,
    topology::{SubnetEnv, Topology, TopologySpec, Underlay},
};
use ipnet::Ipv4Net;

const T: Duration = Duration::from_secs(3);

/// The workspace's CNI plugin, built once through cargo (or `FLANNEL_CNI_BIN`).
fn cni_plugin() -> PathBuf {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BIN.get_or_init(|| {
        bins::cargo_build("flannel-cni", bins::CNI_PLUGIN, "FLANNEL_CNI_BIN")
            .map_err(|e| format!("{e:#}"))
    }) {
        Ok(path) => path.clone(),
        Err(e) => panic!("cannot build the flannel CNI plugin: {e}"),
    }
}

fn net(s: &str) -> Ipv4Net {
    s.parse().expect("cidr")
}

fn v4(ip: Ipv4Addr) -> IpAddr {
    IpAddr::V4(ip)
}

/// Every node reaches every other node's underlay address over TCP.
fn assert_full_underlay(topo: &Topology) {
    for a in topo.nodes() {
        for b in topo.nodes() {
            if a.index() != b.index() {
                tcp_reaches(a.ns(), b.ns(), v4(b.addr()), T).unwrap_or_else(|e| {
                    panic!("{} -> {} ({}): {e:#}", a.name(), b.name(), b.addr())
                });
            }
        }
    }
}

#[test]
fn l2_underlay_nodes_are_adjacent() {
    require_root!();
    let topo = Topology::new(TopologySpec::new(3, Underlay::L2)).expect("topology");
    assert_eq!(topo.node(3).addr(), Ipv4Addr::new(192, 168, 1, 13));
    assert_eq!(topo.node(1).gateway(), Ipv4Addr::new(192, 168, 1, 1));
    let addrs = topo
        .node(2)
        .run(&["ip", "-o", "-4", "addr", "show", "dev", "eth0"])
        .expect("ip addr");
    assert!(addrs.contains("inet 192.168.1.12/24 "), "{addrs}");
    let routes = topo.node(2).run(&["ip", "route"]).expect("ip route");
    assert!(
        routes.contains("default via 192.168.1.1 dev eth0"),
        "{routes}"
    );
    assert_eq!(
        topo.node(2)
            .run(&["sysctl", "-n", "net.ipv4.ip_forward"])
            .expect("sysctl")
            .trim(),
        "1"
    );
    assert_full_underlay(&topo);
    let route = topo
        .node(1)
        .route_get(v4(topo.node(3).addr()))
        .expect("route get");
    assert_eq!(route.gateway, None, "{route:?}");
    assert_eq!(route.dev.as_deref(), Some("eth0"));
    assert_eq!(route.prefsrc, Some(v4(topo.node(1).addr())));
    assert!(topo.l2_adjacent(1, 3).expect("adjacent"));
    assert!(topo.l2_adjacent(3, 2).expect("adjacent"));
}

#[test]
fn l3_underlay_routes_through_the_hub() {
    require_root!();
    let topo = Topology::new(TopologySpec::new(3, Underlay::L3)).expect("topology");
    assert_eq!(topo.node(2).addr(), Ipv4Addr::new(192, 168, 2, 12));
    assert_eq!(topo.node(3).addr(), Ipv4Addr::new(192, 168, 3, 13));
    assert_full_underlay(&topo);
    let route = topo
        .node(1)
        .route_get(v4(topo.node(3).addr()))
        .expect("route get");
    assert_eq!(
        route.gateway,
        Some(v4(Ipv4Addr::new(192, 168, 1, 1))),
        "{route:?}"
    );
    assert!(!topo.l2_adjacent(1, 3).expect("adjacent"));
    assert!(!topo.l2_adjacent(2, 1).expect("adjacent"));
    // The hub really routes: its forwarding is what connects the segments.
    topo.hub()
        .run(&["sysctl", "-qw", "net.ipv4.ip_forward=0"])
        .expect("sysctl");
    assert!(
        tcp_reaches(
            topo.node(1).ns(),
            topo.node(3).ns(),
            v4(topo.node(3).addr()),
            T
        )
        .is_err()
    );
}

#[test]
fn mixed_underlay_has_one_shared_segment() {
    require_root!();
    let topo = Topology::new(TopologySpec::new(3, Underlay::Mixed)).expect("topology");
    assert_eq!(topo.node(2).addr(), Ipv4Addr::new(192, 168, 1, 12));
    assert_eq!(topo.node(3).addr(), Ipv4Addr::new(192, 168, 3, 13));
    assert_full_underlay(&topo);
    assert!(topo.l2_adjacent(1, 2).expect("adjacent"));
    assert!(topo.l2_adjacent(2, 1).expect("adjacent"));
    assert!(!topo.l2_adjacent(1, 3).expect("adjacent"));
    assert!(!topo.l2_adjacent(3, 2).expect("adjacent"));
}

#[test]
fn ipv6_underlay_with_jumbo_mtu() {
    require_root!();
    let topo =
        Topology::new(TopologySpec::new(2, Underlay::L3).ipv6(true).mtu(9000)).expect("topology");
    let a6 = topo.node(2).addr6().expect("v6 address");
    assert_eq!(a6.to_string(), "fd00:2::c");
    let link = topo
        .node(1)
        .run(&["ip", "-o", "link", "show", "eth0"])
        .expect("ip link");
    assert!(link.contains("mtu 9000 "), "{link}");
    tcp_reaches(topo.node(1).ns(), topo.node(2).ns(), IpAddr::V6(a6), T).expect("v6 reach");
    let route = topo.node(1).route_get(IpAddr::V6(a6)).expect("route get");
    assert_eq!(
        route.gateway.map(|g| g.to_string()).as_deref(),
        Some("fd00:1::1")
    );
    // An 8000-byte datagram with DF set crosses the underlay (every hop has MTU 9000).
    let to = topo.node(2).addr();
    let receiver = topo
        .node(2)
        .ns()
        .enter(move || std::net::UdpSocket::bind((to, 0)))
        .expect("enter")
        .expect("bind");
    receiver
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    let target = receiver.local_addr().expect("addr");
    topo.node(1)
        .ns()
        .enter(move || send_df(target))
        .expect("enter")
        .expect("send 8000 bytes with DF");
    let mut buf = [0u8; 9000];
    let (n, _) = receiver
        .recv_from(&mut buf)
        .expect("jumbo datagram arrives");
    assert_eq!(n, 8000);
}

/// Sends one 8000-byte UDP datagram with the don't-fragment bit (IP_PMTUDISC_DO).
fn send_df(to: std::net::SocketAddr) -> std::io::Result<()> {
    let sock = std::net::UdpSocket::bind("0.0.0.0:0")?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&sock);
    let val: libc::c_int = libc::IP_PMTUDISC_DO;
    // SAFETY: setsockopt on a socket we own, with a pointer to a live c_int of the given size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            (&raw const val).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    sock.send_to(&[0x5a; 8000], to).map(|_| ())
}

#[test]
fn cni_pods_and_hand_made_host_gw_routes() {
    require_root!();
    let mut topo = Topology::new(TopologySpec::new(3, Underlay::L2).cni_plugin(cni_plugin()))
        .expect("topology");
    let network = net("10.244.0.0/16");
    for n in 1..=3 {
        let lease = net(&format!("10.244.{n}.0/24"));
        topo.node(n)
            .write_subnet_env(&SubnetEnv::v4(network, lease, 1500, false))
            .expect("subnet.env");
    }
    for n in 1..=3 {
        for _ in 0..2 {
            topo.add_pod(n).expect("CNI ADD");
        }
    }
    assert_eq!(topo.pods().len(), 6);
    for pod in topo.pods() {
        let lease = net(&format!("10.244.{}.0/24", pod.node()));
        assert!(
            lease.contains(&pod.ip()),
            "{} {} not in {lease}",
            pod.name(),
            pod.ip()
        );
        assert_ne!(pod.ip(), pod.gateway());
        assert_eq!(pod.gateway(), Ipv4Addr::new(10, 244, pod.node() as u8, 1));
        let node = topo.node(pod.node());
        let addrs = pod
            .run(&["ip", "-o", "-4", "addr", "show", "dev", "eth0"])
            .expect("pod addr");
        assert!(
            addrs.contains(&format!("inet {} ", pod.ip_net())),
            "{addrs}"
        );
        // The pod reaches its gateway, the node's cni0.
        tcp_reaches(pod.ns(), node.ns(), v4(pod.gateway()), T)
            .unwrap_or_else(|e| panic!("{} -> gateway: {e:#}", pod.name()));
        assert!(
            pod.container_id()
                .is_some_and(|id| id.starts_with(netns::run_prefix())),
            "{:?}",
            pod.container_id()
        );
    }

    // Without routes between the nodes only same-node pairs connect.
    let pods: Vec<_> = topo.pods().iter().collect();
    let before = probe::matrix(&pods, T).expect("matrix");
    assert_eq!(before.pairs(), 30);
    for (i, j) in before.failed_pairs() {
        assert_ne!(pods[i].node(), pods[j].node(), "{before}");
    }
    assert_eq!(before.failures(), 24, "{before}");

    // host-gw by hand: each node routes the others' pod subnets via their underlay address.
    for a in 1..=3 {
        for b in (1..=3).filter(|b| *b != a) {
            topo.node(a)
                .run(&[
                    "ip",
                    "route",
                    "add",
                    &format!("10.244.{b}.0/24"),
                    "via",
                    &topo.node(b).addr().to_string(),
                    "dev",
                    "eth0",
                ])
                .expect("route");
        }
    }
    let after = probe::matrix(&pods, T).expect("matrix");
    assert!(after.all_ok(), "{after}");
    let text = after.to_string();
    assert!(text.contains("30 of 30 pairs reachable"), "{text}");
    drop(pods);

    // CNI DEL releases the address and removes the pod's namespace.
    let gone = topo.pods_on(2)[0];
    let (gone_name, gone_ip, gone_ns) = (
        gone.name().to_owned(),
        gone.ip(),
        gone.ns().name().to_owned(),
    );
    let alloc = topo
        .node(2)
        .ipam_data_dir()
        .join("cbr0")
        .join(gone_ip.to_string());
    assert!(alloc.exists(), "{}", alloc.display());
    topo.remove_pod(&gone_name).expect("remove pod");
    assert!(!alloc.exists(), "host-local allocation not released");
    assert!(!netns::list().contains(&gone_ns));
    assert!(topo.pod(&gone_name).is_none());
    let replacement = topo.add_pod(2).expect("CNI ADD again");
    assert!(net("10.244.2.0/24").contains(&replacement.ip()));
}

#[test]
fn everything_is_removed_on_drop_and_on_panic() {
    require_root!();
    let cni = cni_plugin();
    let build = || {
        let mut topo = Topology::new(TopologySpec::new(2, Underlay::L3).cni_plugin(cni.clone()))
            .expect("topology");
        topo.node(1)
            .write_subnet_env(&SubnetEnv::v4(
                net("10.244.0.0/16"),
                net("10.244.1.0/24"),
                1500,
                false,
            ))
            .expect("subnet.env");
        topo.add_pod(1).expect("pod");
        topo
    };
    let gone = |names: &[String], pids: &[u32], dirs: &[PathBuf]| {
        let left: Vec<_> = netns::list()
            .into_iter()
            .filter(|n| names.contains(n))
            .collect();
        assert!(left.is_empty(), "namespaces left: {left:?}");
        for pid in pids {
            let state = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            assert!(
                state.is_empty() || state.contains("State:\tZ"),
                "process {pid} still runs: {state}"
            );
        }
        for dir in dirs {
            assert!(!dir.exists(), "{} left", dir.display());
        }
    };

    // Plain drop, with a guarded process, an unguarded one and etcd running.
    let (names, pids, dirs, mut unguarded) = {
        let topo = build();
        let etcd = topo.start_etcd().expect("etcd");
        let guarded = topo
            .node(2)
            .spawn(&["sleep", "600"], Output::Null)
            .expect("spawn");
        let unguarded = topo.pods()[0]
            .ns()
            .command("sleep")
            .arg("600")
            .spawn()
            .expect("spawn");
        let bpf_dir = topo.node(1).bpf_pin_path().to_path_buf();
        if Path::new("/sys/fs/bpf").read_dir().is_ok() && fs::create_dir(&bpf_dir).is_ok() {
            assert!(bpf_dir.exists());
        }
        let names = topo.namespace_names();
        assert_eq!(names.len(), 4, "{names:?}");
        assert!(names.iter().all(|n| n.starts_with(netns::run_prefix())));
        let pids = vec![guarded.pid(), unguarded.id()];
        let dirs = vec![
            topo.node(1).dir().to_path_buf(),
            topo.node(2).dir().to_path_buf(),
            bpf_dir,
            etcd.data_dir(),
        ];
        drop(guarded);
        drop(etcd);
        (names, pids, dirs, unguarded)
    };
    gone(&names, &pids, &dirs);
    // The namespace's deletion killed the unguarded one; reap it.
    assert!(!unguarded.wait().expect("wait").success());

    // A panic while the topology is alive still removes it (unwinding runs the drops).
    let captured = std::sync::Mutex::new(Vec::new());
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let topo = build();
        if let Ok(mut c) = captured.lock() {
            *c = topo.namespace_names();
        }
        panic!("test panic with a live topology");
    }));
    assert!(result.is_err());
    let names = captured.lock().map(|c| c.clone()).unwrap_or_default();
    assert_eq!(names.len(), 4);
    gone(&names, &[], &[]);
}

#[test]
fn etcd_in_the_hub_leases_and_kernel_counts() {
    require_root!();
    let topo = Topology::new(TopologySpec::new(2, Underlay::L3)).expect("topology");
    let etcd = topo.start_etcd().expect("etcd");
    assert!(
        etcd.endpoint().starts_with("http://192.168.1.1:"),
        "{}",
        etcd.endpoint()
    );
    let kv = Kv::new(topo.hub(), etcd.endpoint());
    let prefix = lease::DEFAULT_PREFIX;
    let conf = lease::netconf(net("10.244.0.0/16"), "vxlan", serde_json::json!({}));
    lease::write_netconf(&kv, prefix, &conf).expect("config");
    // A node (where agents run) reaches etcd across the routed underlay.
    let from_node = Kv::new(topo.node(2).ns(), etcd.endpoint());
    assert_eq!(
        from_node.get(&format!("{prefix}/config")).expect("get"),
        Some(r#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#.to_owned())
    );

    let fake = lease::fake_vxlan_leases(prefix, 300).expect("fake leases");
    kv.put_all_with_ttl(fake.clone(), 86_400)
        .expect("put leases");
    assert_eq!(
        kv.count_prefix(&format!("{prefix}/subnets/"))
            .expect("count"),
        300
    );
    let leases = lease::read_leases(&kv, prefix).expect("read leases");
    assert_eq!(leases.len(), 300);
    let first = leases
        .iter()
        .find(|l| l.subnet == net("10.1.0.0/24"))
        .expect("10.1.0.0/24");
    assert_eq!(first.public_ip, Some(Ipv4Addr::new(100, 64, 0, 1)));
    assert_eq!(first.vtep_mac(), Some("0e:00:00:00:00:01"));
    let raw = kv
        .get(&format!("{prefix}/subnets/10.1.0.0-24"))
        .expect("get")
        .expect("present");
    assert_eq!(raw, fake[0].1);

    // Kernel counting, against entries made the way the VXLAN kernel path makes them.
    let node = topo.node(1);
    node.add_vxlan("flannel.1", 1, 8472, 1450).expect("vxlan");
    let cluster = net("10.0.0.0/8");
    let empty = status::kernel_counts(node.ns(), cluster, None).expect("counts");
    assert_eq!(
        (empty.routes, empty.neighbours, empty.fdb),
        (0, 0, 0),
        "{empty:?}"
    );
    for l in leases.iter().take(50) {
        let gw = l.subnet.network().to_string();
        let mac = l.vtep_mac().expect("mac");
        let public = l.public_ip.expect("public ip").to_string();
        node.run(&[
            "ip",
            "neigh",
            "replace",
            &gw,
            "dev",
            "flannel.1",
            "lladdr",
            mac,
            "nud",
            "permanent",
        ])
        .expect("neigh");
        node.run(&[
            "bridge",
            "fdb",
            "replace",
            mac,
            "dev",
            "flannel.1",
            "self",
            "dst",
            &public,
            "permanent",
        ])
        .expect("fdb");
        node.run(&[
            "ip",
            "route",
            "replace",
            &l.subnet.to_string(),
            "via",
            &gw,
            "dev",
            "flannel.1",
            "onlink",
            "proto",
            "static",
        ])
        .expect("route");
    }
    let counts = status::kernel_counts(node.ns(), cluster, None).expect("counts");
    assert_eq!(
        (counts.routes, counts.neighbours, counts.fdb),
        (50, 50, 50),
        "{counts:?}"
    );
    assert_eq!(
        counts.route_protocols,
        BTreeMap::from([("static".to_owned(), 50)])
    );
    assert!(status::require_counts(&counts, 50, 50, 50).is_ok());
    assert!(status::require_counts(&counts, 51, 50, 50).is_err());
    // The local subnet's route is not counted.
    let local = net("10.1.0.0/24");
    let counts = status::kernel_counts(node.ns(), cluster, Some(local)).expect("counts");
    assert_eq!(counts.routes, 49);
}

/// A stand-in agent (shell): logs its flags, plays host-gw for an L2 topology of `--fake-nodes`
/// nodes (routes to 10.244.<octet>.0/24 via 192.168.1.<octet>), writes subnet.env for its own
/// 10.244.<own octet>.0/24 and runs until SIGTERM (exit 0).
const FAKE_AGENT: &str = r#"#!/bin/sh
trap 'echo "fake agent: SIGTERM"; exit 0' TERM
echo "fake agent: $*"
for a in "$@"; do
  case "$a" in
    --subnet-file=*) f="${a#--subnet-file=}" ;;
    --fake-nodes=*) n="${a#--fake-nodes=}" ;;
    --fake-exit=*) echo "fatal: told to exit" >&2; exit "${a#--fake-exit=}" ;;
  esac
done
me=$(ip -4 -o addr show dev eth0 | sed -n 's/.* 192\.168\.1\.\([0-9]*\)\/.*/\1/p')
i=11
while [ "$i" -le $((10 + n)) ]; do
  [ "$i" -ne "$me" ] && ip route replace "10.244.$i.0/24" via "192.168.1.$i" dev eth0
  i=$((i + 1))
done
printf 'FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.%s.1/24\nFLANNEL_MTU=1500\nFLANNEL_IPMASQ=false\n' "$me" > "$f.tmp"
mv "$f.tmp" "$f"
while :; do sleep 0.1; done
"#;

fn fake_agent(dir: &Path) -> PathBuf {
    let path = dir.join("fake-agent.sh");
    fs::write(&path, FAKE_AGENT).expect("write fake agent");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

#[test]
fn cluster_up_with_a_stand_in_agent() {
    require_root!();
    let tmp = tempfile::tempdir().expect("tempdir");
    let agent = fake_agent(tmp.path());
    let topology = TopologySpec::new(3, Underlay::L2).cni_plugin(cni_plugin());
    let mut spec = ClusterSpec::new(topology, "host-gw", &agent);
    spec.agent_args = vec!["--fake-nodes=3".to_owned()];
    spec.subnet_env_timeout = Duration::from_secs(20);
    let log = std::sync::Mutex::new(Vec::<String>::new());
    let mut cluster = Cluster::up(
        spec,
        &|m| {
            if let Ok(mut l) = log.lock() {
                l.push(m.to_owned());
            }
        },
        &|| false,
    )
    .expect("cluster up");
    let log = log.into_inner().unwrap_or_default();
    assert!(
        log.iter().any(|l| l.contains(
            "/config = {\"Network\":\"10.244.0.0/16\",\"Backend\":{\"Type\":\"host-gw\"}}"
        )),
        "{log:#?}"
    );

    // etcd holds the config; every node got its subnet.env and two CNI pods in it.
    let conf = cluster
        .kv()
        .get("/coreos.com/network/config")
        .expect("get")
        .expect("config");
    assert!(conf.contains("host-gw"), "{conf}");
    assert_eq!(cluster.subnet_envs().len(), 3);
    for (i, env) in cluster.subnet_envs().iter().enumerate() {
        let lease = net(&format!("10.244.{}.0/24", 11 + i));
        assert_eq!(env.lease(), Some(lease));
        let pods = cluster.topology().pods_on(i + 1);
        assert_eq!(pods.len(), 2);
        assert!(pods.iter().all(|p| lease.contains(&p.ip())), "{pods:?}");
    }
    // The stand-in's routes make every pod reach every pod.
    let matrix = cluster.matrix(T).expect("matrix");
    assert!(matrix.all_ok(), "{matrix}");

    // The agent got the per-node flags.
    let node1 = cluster.topology().node(1);
    let (subnet_file, pin) = (node1.subnet_file(), node1.bpf_pin_path().to_path_buf());
    let agent1 = cluster.agent_mut(1).expect("agent 1");
    let args = agent1.args().join(" ");
    for flag in [
        format!("--subnet-file={}", subnet_file.display()),
        format!("--bpf-pin-path={}", pin.display()),
        "--iface=eth0".to_owned(),
        "--dataplane=kernel".to_owned(),
        "--etcd-prefix=/coreos.com/network".to_owned(),
        "--healthz-port=9473".to_owned(),
        "--fake-nodes=3".to_owned(),
    ] {
        assert!(args.contains(&flag), "{flag} missing in {args}");
    }
    assert!(
        args.contains("--etcd-endpoints=http://192.168.1.1:"),
        "{args}"
    );
    assert!(agent1.log_tail(5).contains("fake agent: --etcd-endpoints="));

    // Restart appends to the log; SIGTERM ends it with the trap's exit 0.
    agent1.restart().expect("restart");
    // Signal it only once the script runs (before that, SIGTERM would hit nsenter or the
    // shell before its trap is set).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while fs::read_to_string(agent1.log_path())
        .unwrap_or_default()
        .matches("fake agent: --etcd")
        .count()
        < 2
    {
        assert!(
            std::time::Instant::now() < deadline,
            "restarted agent never logged"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = agent1.stop(Duration::from_secs(5)).expect("stop");
    assert!(status.success(), "{status}");
    let log = fs::read_to_string(agent1.log_path()).expect("log");
    assert_eq!(log.matches("fake agent: --etcd").count(), 2, "{log}");
    assert_eq!(log.matches("fake agent: SIGTERM").count(), 2, "{log}");
    assert!(!agent1.is_running());
    assert!(agent1.check_running().is_err());

    // The status block: agents, routes by protocol, no leases (the stand-in writes none).
    let text = cluster.status_text();
    assert!(
        text.contains("leases in etcd (0 under /coreos.com/network/subnets/)"),
        "{text}"
    );
    assert!(
        text.contains("node1 192.168.1.11 subnet 10.244.11.0/24: agent EXITED"),
        "{text}"
    );
    assert!(
        text.contains("routes 2 {\"boot\": 2} neigh 0 fdb 0"),
        "{text}"
    );
    assert!(text.contains("/healthz n/a"), "{text}");
}

#[test]
fn agent_that_exits_fails_with_its_log() {
    require_root!();
    let tmp = tempfile::tempdir().expect("tempdir");
    let agent = fake_agent(tmp.path());
    let topo = Topology::new(TopologySpec::new(1, Underlay::L2)).expect("topology");
    let mut spec = AgentSpec::new(&agent, "http://192.168.1.1:1");
    spec.extra_args = vec!["--fake-exit=3".to_owned()];
    let mut running = Agent::start(topo.node(1), &spec).expect("start");
    let err = running
        .wait_subnet_env(topo.node(1), Duration::from_secs(10))
        .expect_err("agent exits");
    let msg = format!("{err:#}");
    assert!(msg.contains("exited (exit status: 3)"), "{msg}");
    assert!(msg.contains("fatal: told to exit"), "{msg}");

    // A live agent that never writes subnet.env: the timeout names the file and the log.
    let silent = tmp.path().join("silent.sh");
    fs::write(&silent, "#!/bin/sh\necho still starting\nexec sleep 60\n").expect("write");
    fs::set_permissions(&silent, fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut running =
        Agent::start(topo.node(1), &AgentSpec::new(&silent, "http://x:1")).expect("start");
    let err = running
        .wait_subnet_env(topo.node(1), Duration::from_millis(500))
        .expect_err("timeout");
    let msg = format!("{err:#}");
    assert!(msg.contains("has no subnet.env"), "{msg}");
    assert!(msg.contains("still starting"), "{msg}");
    assert!(running.peak_rss_kib().is_some());

    // A missing binary is a clear error.
    let err = Agent::start(
        topo.node(1),
        &AgentSpec::new("/nonexistent/flannel-agent", "x"),
    )
    .expect_err("missing");
    assert!(
        err.to_string().contains("/nonexistent/flannel-agent"),
        "{err}"
    );
}

#[test]
fn bench_reference_variants_carry_traffic() {
    require_root!();
    let ctx = SetupCtx {
        cni_plugin: Some(cni_plugin()),
        agent: None,
    };
    // floor-ebpf-*: their nodes do not forward, so the minimal program carries it all.
    for name in [
        "ref-hostgw",
        "ref-vxlan",
        "pod-same-node",
        "floor-ebpf-host-gw",
        "floor-ebpf-vxlan",
    ] {
        let v = variant::find(name).expect("variant");
        let mut bed = v.prepare(&ctx).expect("prepare");
        dataplane::start_servers(&mut bed, Some(0)).expect("servers");
        let smoke = dataplane::smoke(&bed, bed.server_ip).expect("smoke");
        assert!(
            smoke.gbps > 0.0 && smoke.p50_us > 0.0 && smoke.cps > 0.0,
            "{name}: {smoke:?}"
        );
        if name == "ref-vxlan" {
            // The bytes really went through the VXLAN device.
            let tx = bed
                .topology()
                .node(1)
                .ns()
                .link_counter("flannel.1", "tx", "bytes")
                .expect("stats");
            assert!(tx > 10_000_000, "flannel.1 sent only {tx} bytes");
            let pod_link = bed
                .client_ns()
                .expect("client")
                .run(&["ip", "-o", "link", "show", "eth0"])
                .expect("link");
            assert!(pod_link.contains("mtu 1450 "), "{pod_link}");
        }
        if name == "ref-hostgw" {
            let route = bed
                .topology()
                .node(1)
                .route_get(bed.server_ip)
                .expect("route get");
            assert_eq!(route.gateway, Some(v4(bed.topology().node(2).addr())));
        }
    }
    assert!(variant::find("nope").is_none());
    let err = variant::find("agent-vxlan")
        .expect("variant")
        .prepare(&ctx)
        .expect_err("needs agent");
    assert!(err.to_string().contains("needs flannel-agent"), "{err}");
}

/// The transfer the hitless tests run across restarts and outages tells a segment lost on the
/// way from a needless retransmission: across a veth whose far end drops one data packet in
/// 40 at its input (nftables), the transfer still arrives whole (TCP repairs it), and the
/// drops show as retransmissions no duplicate accounts for ([`probe::FlowStats::lost`]), with
/// the receiver queueing the data after each hole out of order. Without the drops nothing is
/// lost.
#[test]
fn the_tcp_transfer_probe_counts_segments_lost_on_the_way() {
    require_root!();
    let transfer = |drop_every: Option<u32>| -> anyhow::Result<probe::FlowStats> {
        let sender = netns::NetNs::new("losssnd")?;
        let receiver = netns::NetNs::new("lossrcv")?;
        netns::veth(&sender, "eth0", &receiver, "eth0")?;
        sender.run(&["ip", "addr", "add", "10.99.0.1/24", "dev", "eth0"])?;
        receiver.run(&["ip", "addr", "add", "10.99.0.2/24", "dev", "eth0"])?;
        if let Some(n) = drop_every {
            let every = n.to_string();
            receiver.run(&["nft", "add", "table", "inet", "loss"])?;
            receiver.run(&[
                "nft",
                "add chain inet loss input { type filter hook input priority 0; }",
            ])?;
            receiver.run(&[
                "nft",
                "add",
                "rule",
                "inet",
                "loss",
                "input",
                "ip",
                "saddr",
                "10.99.0.1",
                "meta",
                "l4proto",
                "tcp",
                "meta",
                "length",
                ">",
                "1000",
                "numgen",
                "inc",
                "mod",
                &every,
                "==",
                "0",
                "counter",
                "drop",
            ])?;
        }
        let flow = probe::TcpFlow::start(&sender, &receiver, v4([10, 99, 0, 2].into()), 4 << 20)?;
        std::thread::sleep(Duration::from_secs(3));
        let stats = flow.finish()?;
        if drop_every.is_some() {
            let listed = receiver.run(&["nft", "list", "table", "inet", "loss"])?;
            anyhow::ensure!(
                !listed.contains("counter packets 0 "),
                "the rule dropped nothing: {listed}"
            );
        }
        Ok(stats)
    };
    let lossy = transfer(Some(40)).expect("transfer with drops");
    eprintln!("with drops: {lossy:?}");
    assert!(
        lossy.lost() > 0,
        "the drops were not counted as lost: {lossy:?}"
    );
    assert!(
        lossy
            .receiver_netstat
            .get("TCPOFOQueue")
            .copied()
            .unwrap_or(0)
            > 0,
        "the receiver queued nothing out of order: {lossy:?}"
    );
    let clean = transfer(None).expect("transfer without drops");
    eprintln!("without: {clean:?}");
    assert_eq!(clean.lost(), 0, "{clean:?}");
}
