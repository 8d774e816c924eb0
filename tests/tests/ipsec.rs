//! The ipsec backend against a real strongSwan charon (Debian's strongswan-charon), in
//! network namespaces, each charon in a private mount namespace with its own `/run` and a
//! VICI socket in a temporary directory:
//!
//! * the ESP probe agrees with iproute2 about this kernel (here: XFRM policies work, ESP
//!   states are refused), and the agent refuses to run the ipsec backend without ESP, saying
//!   why;
//! * the applier's VICI exchange: `list-conns` shows exactly the connection set generated
//!   from the leases (names, addresses, proposals, child traffic selectors), the shared keys
//!   are loaded, the three XFRM policies per peer are installed; a second sync changes
//!   nothing; a removed lease (and a stale connection of an earlier run) is unloaded with its
//!   key and policies;
//! * two charons configured by the applier on two nodes authenticate each other with the
//!   PSK (IKE SA established); the child SA then needs ESP, which this kernel lacks.
//!
//! Needs root and charon; skips without them.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use flannel_agent::{
    backend::{BackendOptions, IpsecOptions, MtuPlan, Secret},
    dataplane::{self, Applier as _, Facts, Local, SyncMode, VtepMacs},
    iface::ExternalInterface,
    ip::IpStack,
    ipsec::{
        CharonOptions, ConnSpec, IpsecApplier, IpsecBackend, ViciClient, Xfrm, charon::find_charon,
        conns, vici::Message, xfrm,
    },
    lease::{Lease, LeaseAttrs, SubnetKey},
    subnet::LeaseSnapshot,
};
use flannel_tests::{
    lab::{
        bins,
        cluster::{Cluster, ClusterSpec},
    },
    netns::{NetNs, veth},
    require_root,
    topology::{TopologySpec, Underlay},
};
use serde_json::json;

const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const PEER_A: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);
const PEER_B: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 3);

fn psk() -> String {
    "flannel-ipsec-test-psk-".repeat(5)
}

fn options() -> IpsecOptions {
    IpsecOptions {
        psk: Secret::new(psk()),
        udp_encap: false,
        esp_proposal: flannel_agent::backend::options::DEFAULT_ESP_PROPOSAL.into(),
    }
}

fn charon_or_skip() -> Option<PathBuf> {
    let found = find_charon();
    if found.is_none() {
        eprintln!("skipped: charon is not installed");
    }
    found
}

/// A strongswan.conf with only the plugins the backend needs and the VICI socket in `dir`.
fn charon_options(dir: &Path) -> CharonOptions {
    let socket = dir.join("charon.vici");
    let conf = dir.join("strongswan.conf");
    let text = format!(
        "charon {{\n  load = random nonce openssl aes sha1 sha2 hmac gmp gcm kdf pem pkcs1 x509 \
         pubkey kernel-netlink socket-default vici\n  install_routes = no\n  \
         install_virtual_ip = no\n  retransmit_tries = 3\n  plugins {{\n    vici {{\n      \
         socket = unix://{}\n    }}\n  }}\n  filelog {{\n    test {{\n      path = {}\n      \
         flush_line = yes\n      default = 1\n      ike = 2\n    }}\n  }}\n}}\n",
        socket.display(),
        dir.join("charon.log").display()
    );
    std::fs::write(&conf, text).expect("strongswan.conf");
    CharonOptions {
        program: None,
        vici_socket: socket,
        strongswan_conf: Some(conf),
        private_run: true,
        log: Some(dir.join("charon.out")),
    }
}

fn ipsec_lease(key: &str, ip: Ipv4Addr) -> Lease {
    let attrs = LeaseAttrs {
        public_ip: ip,
        backend_type: "ipsec".into(),
        ..LeaseAttrs::default()
    };
    Lease::new(SubnetKey::parse(key).expect("key"), attrs, None)
}

fn local(subnet_key: &str, ip: Ipv4Addr) -> Local {
    let ext = ExternalInterface {
        name: "eth0".into(),
        index: 2,
        mtu: 1500,
        iface_addr: Some(ip),
        iface_v6_addr: None,
        ext_addr: Some(ip),
        ext_v6_addr: None,
    };
    Local::new(
        ipsec_lease(subnet_key, ip),
        IpStack::V4,
        Some("10.244.0.0/16".parse().expect("net")),
        None,
        BackendOptions::Ipsec(options()),
        ext,
        MtuPlan {
            device_v4: None,
            device_v6: None,
            flannel_mtu: 1423,
        },
        VtepMacs::default(),
    )
}

fn snapshot(leases: &[(&str, Ipv4Addr)]) -> LeaseSnapshot {
    LeaseSnapshot {
        generation: 1,
        synced: true,
        leases: Arc::new(
            leases
                .iter()
                .map(|(k, ip)| ((*k).to_owned(), ipsec_lease(k, *ip)))
                .collect::<BTreeMap<_, _>>(),
        ),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Whether the kernel of namespace `ns` takes an ESP state, asked through iproute2.
fn kernel_has_esp(ns: &NetNs) -> bool {
    let out = ns
        .output(&[
            "ip",
            "xfrm",
            "state",
            "add",
            "src",
            "192.0.2.1",
            "dst",
            "192.0.2.2",
            "proto",
            "esp",
            "spi",
            "0x100",
            "mode",
            "tunnel",
            "enc",
            "cbc(aes)",
            "0x0102030405060708090a0b0c0d0e0f10",
            "auth",
            "hmac(sha256)",
            "0x0102030405060708090a0b0c0d0e0f100102030405060708090a0b0c0d0e0f10",
        ])
        .expect("ip xfrm");
    let _ = ns.output(&["ip", "xfrm", "state", "flush"]);
    out.status.success()
}

/// Two namespaces joined by a veth: `node` (10.99.0.1) and `peers` (10.99.0.2 and .3).
fn underlay(tag: &str) -> (NetNs, NetNs) {
    let node = NetNs::new(&format!("{tag}n")).expect("node ns");
    let peers = NetNs::new(&format!("{tag}p")).expect("peer ns");
    veth(&node, "eth0", &peers, "eth0").expect("veth");
    node.run(&["ip", "addr", "add", "10.99.0.1/24", "dev", "eth0"])
        .expect("addr");
    peers
        .run(&["ip", "addr", "add", "10.99.0.2/24", "dev", "eth0"])
        .expect("addr");
    peers
        .run(&["ip", "addr", "add", "10.99.0.3/24", "dev", "eth0"])
        .expect("addr");
    (node, peers)
}

fn conn_names(conns: &[(String, Message)]) -> BTreeSet<String> {
    conns.iter().map(|(n, _)| n.clone()).collect()
}

fn spec(remote_subnet: &str, remote_ip: Ipv4Addr) -> ConnSpec {
    ConnSpec {
        local_ip: NODE_IP,
        local_subnet: "10.244.1.0/24".parse().expect("net"),
        remote_subnet: remote_subnet.parse().expect("net"),
        remote_ip,
    }
}

#[test]
fn esp_probe_agrees_with_iproute2() {
    require_root!();
    let ns = NetNs::new("ipsprobe").expect("ns");
    let has_esp = kernel_has_esp(&ns);
    let probe = ns
        .enter(|| {
            runtime().block_on(async {
                let x = Xfrm::open().expect("XFRM netlink");
                x.probe_esp().await
            })
        })
        .expect("enter");
    assert_eq!(probe.is_ok(), has_esp, "probe: {probe:?}");
    if let Err(e) = probe {
        let text = e.to_string();
        assert!(
            text.contains("cannot create ESP security associations"),
            "{text}"
        );
        assert!(text.contains("esp4"), "{text}");
    }
    // The probe leaves no state behind.
    let states = ns.run(&["ip", "xfrm", "state"]).expect("ip xfrm state");
    assert_eq!(states.trim(), "", "{states}");
}

#[test]
fn applier_drives_charon_over_vici() {
    require_root!();
    let Some(_) = charon_or_skip() else { return };
    let (node, _peers) = underlay("ipsv");
    let dir = tempfile::tempdir().expect("tempdir");
    let charon = charon_options(dir.path());
    let socket = charon.vici_socket.clone();
    let local = local("10.244.1.0-24", NODE_IP);
    let full = snapshot(&[("10.244.2.0-24", PEER_A), ("10.244.3.0-24", PEER_B)]);
    let want_a = spec("10.244.2.0/24", PEER_A);
    let want_b = spec("10.244.3.0/24", PEER_B);

    node.enter(|| {
        runtime().block_on(async {
            let xfrm = Xfrm::open().expect("XFRM netlink");
            let backend = IpsecBackend::unchecked(&options(), xfrm.clone(), NODE_IP, charon);
            let mut applier: IpsecApplier = backend.start(&local).await.expect("start charon");
            assert!(
                applier.charon().pid().is_some(),
                "the test's charon was started"
            );
            let mut vici = ViciClient::connect(&socket).await.expect("connect");
            let version = vici.version().await.expect("version");
            assert_eq!(version.get_str("daemon").as_deref(), Some("charon"));
            // The own key is loaded at start.
            let keys = vici.get_shared().await.expect("get-shared");
            assert_eq!(keys, vec![conns::shared_key_id(NODE_IP)]);

            // A connection of an earlier run for a node that is gone.
            let stale = spec("10.244.9.0/24", Ipv4Addr::new(10, 99, 0, 9));
            vici.load_conn(stale.message(&options()))
                .await
                .expect("stale conn");
            // Someone else's connection is never touched.
            let foreign = ConnSpec {
                local_ip: Ipv4Addr::new(10, 99, 0, 1),
                local_subnet: "10.200.0.0/24".parse().expect("net"),
                ..stale
            };
            vici.load_conn(foreign.message(&options()))
                .await
                .expect("foreign conn");
            // A stale policy of ours.
            for p in xfrm::policies_for(
                stale.local_subnet,
                stale.local_ip,
                stale.remote_subnet,
                stale.remote_ip,
            ) {
                xfrm.update(p).await.expect("stale policy");
            }

            let desired = dataplane::desired(&local, &full, &Facts::none());
            assert_eq!(desired.peers.len(), 2);
            let report = applier.sync(&local, &desired, SyncMode::Full).await;
            assert!(report.errors.is_empty(), "{:?}", report.errors);
            assert_eq!(report.stats.added, 2 + 6, "2 connections and 6 policies");
            assert_eq!(
                report.stats.deleted,
                1 + 3,
                "1 stale connection and 3 policies"
            );

            let listed = vici.list_conns().await.expect("list-conns");
            let names = conn_names(&listed);
            let expected: BTreeSet<String> = [want_a.name(), want_b.name(), foreign.name()]
                .into_iter()
                .collect();
            assert_eq!(names, expected);
            let (_, a) = listed
                .iter()
                .find(|(n, _)| *n == want_a.name())
                .expect("conn a");
            assert_eq!(
                a.get_list("local_addrs").expect("local_addrs"),
                ["10.99.0.1"]
            );
            assert_eq!(
                a.get_list("remote_addrs").expect("remote_addrs"),
                ["10.99.0.2"]
            );
            assert_eq!(a.get_str("version").as_deref(), Some("IKEv2"));
            let child = a
                .get_section("children")
                .and_then(|c| c.get_section(&want_a.child_name()))
                .unwrap_or_else(|| panic!("child {} in {a:?}", want_a.child_name()));
            assert_eq!(child.get_str("mode").as_deref(), Some("TUNNEL"));
            assert_eq!(
                child.get_list("local-ts").expect("local-ts"),
                ["10.244.1.0/24"]
            );
            assert_eq!(
                child.get_list("remote-ts").expect("remote-ts"),
                ["10.244.2.0/24"]
            );
            let keys: BTreeSet<String> = vici
                .get_shared()
                .await
                .expect("get-shared")
                .into_iter()
                .collect();
            let want_keys: BTreeSet<String> = [NODE_IP, PEER_A, PEER_B]
                .into_iter()
                .map(conns::shared_key_id)
                .collect();
            assert_eq!(keys, want_keys);

            let policies: BTreeSet<xfrm::Policy> = xfrm.list().await.expect("policies");
            let want_policies: BTreeSet<xfrm::Policy> = [want_a, want_b]
                .iter()
                .flat_map(|c| {
                    xfrm::policies_for(c.local_subnet, c.local_ip, c.remote_subnet, c.remote_ip)
                })
                .collect();
            assert_eq!(policies, want_policies);

            // In sync: nothing to do.
            let again = applier.sync(&local, &desired, SyncMode::Full).await;
            assert!(again.errors.is_empty(), "{:?}", again.errors);
            assert_eq!(
                (
                    again.stats.added,
                    again.stats.deleted,
                    again.stats.unchanged
                ),
                (0, 0, 2)
            );

            // Peer B's lease goes.
            let fewer = snapshot(&[("10.244.2.0-24", PEER_A)]);
            let desired = dataplane::desired(&local, &fewer, &Facts::none());
            // While the lease set is incomplete nothing is removed.
            let add_only = applier.sync(&local, &desired, SyncMode::AddOnly).await;
            assert_eq!(add_only.stats.deleted, 0);
            assert_eq!(conn_names(&vici.list_conns().await.expect("list")).len(), 3);
            let report = applier.sync(&local, &desired, SyncMode::Full).await;
            assert!(report.errors.is_empty(), "{:?}", report.errors);
            let names = conn_names(&vici.list_conns().await.expect("list-conns"));
            assert_eq!(
                names,
                [want_a.name(), foreign.name()]
                    .into_iter()
                    .collect::<BTreeSet<_>>()
            );
            let keys = vici.get_shared().await.expect("get-shared");
            assert!(!keys.contains(&conns::shared_key_id(PEER_B)), "{keys:?}");
            assert_eq!(xfrm.list().await.expect("policies").len(), 3);
            drop(applier);
        })
    })
    .expect("enter");
    // The kernel's own view of the policies (before the namespace goes).
    let text = node.run(&["ip", "xfrm", "policy"]).expect("ip xfrm policy");
    for want in [
        "src 10.244.1.0/24 dst 10.244.2.0/24",
        "dir out",
        "src 10.244.2.0/24 dst 10.244.1.0/24",
        "dir fwd",
        "dir in",
        "proto esp reqid 11 mode tunnel",
        "tmpl src 10.99.0.1 dst 10.99.0.2",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
    assert!(!text.contains("10.244.3.0"), "{text}");
}

/// Two nodes, each with its own charon configured by its applier: IKE authenticates with the
/// shared key; installing the child SA needs ESP.
#[test]
fn two_charons_authenticate_each_other() {
    require_root!();
    let Some(_) = charon_or_skip() else { return };
    let a = NetNs::new("ipsa").expect("ns");
    let b = NetNs::new("ipsb").expect("ns");
    veth(&a, "eth0", &b, "eth0").expect("veth");
    a.run(&["ip", "addr", "add", "10.99.0.1/24", "dev", "eth0"])
        .expect("addr");
    b.run(&["ip", "addr", "add", "10.99.0.2/24", "dev", "eth0"])
        .expect("addr");
    let has_esp = kernel_has_esp(&a);
    let dir_a = tempfile::tempdir().expect("tempdir");
    let dir_b = tempfile::tempdir().expect("tempdir");

    // Each side runs its applier on a thread in its namespace and keeps it (and charon)
    // alive until the check is done.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let run = |ns: &NetNs, me: Ipv4Addr, mine: &str, other: Ipv4Addr, theirs: &str, dir: &Path| {
        let local = local(mine, me);
        let snap = snapshot(&[(theirs, other)]);
        let charon = charon_options(dir);
        let ready = ready_tx.clone();
        let done = &done_rx;
        ns.enter(move || {
            runtime().block_on(async move {
                let xfrm = Xfrm::open().expect("XFRM");
                let backend = IpsecBackend::unchecked(&options(), xfrm, me, charon);
                let mut applier = backend.start(&local).await.expect("charon");
                let desired = dataplane::desired(&local, &snap, &Facts::none());
                let report = applier.sync(&local, &desired, SyncMode::Full).await;
                assert!(report.errors.is_empty(), "{:?}", report.errors);
                let _ = ready.send(());
                // Keep charon running until the observer is done.
                let _ = done
                    .lock()
                    .map(|rx| rx.recv_timeout(Duration::from_secs(60)));
                drop(applier);
            })
        })
        .expect("enter");
    };
    std::thread::scope(|scope| {
        let ha = scope.spawn(|| {
            run(
                &a,
                NODE_IP,
                "10.244.1.0-24",
                PEER_A,
                "10.244.2.0-24",
                dir_a.path(),
            )
        });
        let hb = scope.spawn(|| {
            run(
                &b,
                PEER_A,
                "10.244.2.0-24",
                NODE_IP,
                "10.244.1.0-24",
                dir_b.path(),
            )
        });
        for _ in 0..2 {
            ready_rx
                .recv_timeout(Duration::from_secs(60))
                .expect("both sides ready");
        }
        // Watch node A's IKE SAs until one is established.
        let socket = dir_a.path().join("charon.vici");
        let deadline = Instant::now() + Duration::from_secs(30);
        let established = loop {
            let sas = runtime()
                .block_on(async {
                    let mut c = ViciClient::connect(&socket).await?;
                    c.list_sas().await
                })
                .expect("list-sas");
            let found = sas
                .iter()
                .find(|(_, sa)| sa.get_str("state").as_deref() == Some("ESTABLISHED"));
            if let Some((name, sa)) = found {
                break Some((name.clone(), sa.clone()));
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(300));
        };
        // The outcome of the child SA follows the IKE SA; give charon a moment to log it.
        let logs = [
            dir_a.path().join("charon.log"),
            dir_b.path().join("charon.log"),
        ];
        // Without ESP the child SA fails either when its SAs are installed or already when
        // the responder asks the kernel for SPIs (it then answers NO_PROPOSAL_CHOSEN).
        let child_failed = |log: &str| {
            log.contains("unable to install")
                || log.contains("unable to allocate SPI")
                || log.contains("no CHILD_SA built")
                || log.contains("failed to establish CHILD_SA")
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let log = loop {
            let log: String = logs
                .iter()
                .map(|p| std::fs::read_to_string(p).unwrap_or_default())
                .collect::<Vec<_>>()
                .join("\n");
            if has_esp || child_failed(&log) || Instant::now() > deadline {
                break log;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        eprintln!(
            "charon on node A about the child SA:\n{}",
            log.lines()
                .filter(|l| l.contains("CHILD")
                    || l.contains("SAD")
                    || l.contains("install")
                    || l.contains("ESP")
                    || l.contains("error"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        for _ in 0..2 {
            let _ = done_tx.send(());
        }
        let (name, sa) = established
            .unwrap_or_else(|| panic!("no IKE SA established; charon log of node A:\n{log}"));
        assert_eq!(name, spec("10.244.2.0/24", PEER_A).name());
        assert_eq!(sa.get_str("remote-host").as_deref(), Some("10.99.0.2"));
        assert_eq!(sa.get_str("version").as_deref(), Some("2"));
        assert_eq!(sa.get_str("encr-alg").as_deref(), Some("AES_CBC"));
        assert_eq!(sa.get_str("encr-keysize").as_deref(), Some("256"));
        assert_eq!(sa.get_str("dh-group").as_deref(), Some("MODP_4096"));
        if !has_esp {
            // The child SA could not be installed: the kernel has no ESP.
            let installed = sa
                .get_section("child-sas")
                .map(|c| !c.entries().is_empty())
                .unwrap_or(false);
            assert!(!installed, "a child SA without kernel ESP? {sa:?}");
            assert!(
                child_failed(&log),
                "charon should report the failed child SA:\n{log}"
            );
        }
        ha.join().expect("node a");
        hb.join().expect("node b");
    });
}

/// The agent with the ipsec backend on a kernel without ESP stops with an error naming the
/// reason, before it takes a lease.
#[test]
fn agent_refuses_ipsec_without_esp() {
    require_root!();
    let ns = NetNs::new("ipsesp").expect("ns");
    if kernel_has_esp(&ns) {
        eprintln!("skipped: this kernel has ESP");
        return;
    }
    drop(ns);
    let agent = bins::cargo_build("flannel-agent", "flannel-agent", "FLANNEL_AGENT_BIN")
        .expect("agent binary");
    let mut spec = ClusterSpec::new(TopologySpec::new(1, Underlay::L2), "ipsec", agent);
    spec.backend_options = json!({"PSK": psk()});
    spec.pods_per_node = 0;
    spec.subnet_env_timeout = Duration::from_secs(30);
    let err = Cluster::up(spec, &|_| {}, &|| false).expect_err("the agent must refuse");
    let text = format!("{err:#}");
    assert!(text.contains("exit status: 1"), "{text}");
    assert!(
        text.contains("the ipsec backend cannot run on this node"),
        "{text}"
    );
    assert!(
        text.contains("cannot create ESP security associations"),
        "{text}"
    );
    assert!(
        !text.contains("Allocated lease"),
        "no lease before the check: {text}"
    );
}
