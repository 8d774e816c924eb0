//! The real `flannel-agent` through a cluster's life on the kernel path: a node leaving, an
//! agent restart under a continuous request stream and a long TCP transfer, an etcd outage,
//! ten agents starting at once on one etcd, and stale dataplane state of a previous run. The
//! shared scenarios also run on the eBPF fast path in `agent_ebpf.rs`.
//!
//! Run: `cargo test -p flannel-tests --test agent_lifecycle` (as root; skipped otherwise).

mod agent_support;

use std::{collections::BTreeMap, thread, time::Duration};

use agent_support::{
    CONVERGE, Path, count_lines, expected_state, leases_by_node,
    scenarios::{self, converged},
    spec, wait_for_state, with_cluster,
};
use anyhow::{Context as _, Result, ensure};
use flannel_tests::{
    kube_mock::{self, MockApiServer},
    lab::{
        agent::{Agent, Dataplane},
        cluster::{Cluster, ClusterSpec},
        kube, probe, status, wait,
    },
    require_root,
    topology::{Pod, Topology, Underlay},
};
use ipnet::Ipv4Net;

fn vxlan(_: usize, _: usize) -> Path {
    Path::Vxlan
}

/// A node's lease is deleted: its agent exits 0 and the others drop its entries.
#[test]
fn node_leaves() {
    require_root!();
    with_cluster("node leaves", spec(3, Underlay::L2, "vxlan", 0), |c| {
        scenarios::node_leaves(c, &vxlan, 3)
    });
}

/// SIGTERM and start again: the agent exits 0, the restarted one adopts the dataplane
/// without a single kernel write, and neither a UDP request every 10 ms through that node
/// nor a TCP transfer from its pod loses anything.
#[test]
fn restart_is_hitless() {
    require_root!();
    with_cluster("restart", spec(2, Underlay::L2, "vxlan", 1), |c| {
        scenarios::restart_is_hitless(c, &vxlan, 1, 2)
    });
}

/// `eth0` deleted and created again under a running agent: it follows the interface to its
/// new index, and the host-gw routes through it, which the first look after the new link
/// finds unreachable (no address yet), are back within seconds, not at the next resync
/// ([`scenarios::external_interface_recreated`]; host-gw and VXLAN).
#[test]
fn a_recreated_external_interface_is_followed() {
    require_root!();
    scenarios::on_host_gw_and_vxlan(
        Dataplane::Kernel,
        "eth0 re-created",
        scenarios::external_interface_recreated,
    );
}

/// The agent's routes, neighbours and FDB entries deleted by hand: back within seconds, not
/// at the next resync ([`scenarios::entries_deleted_by_hand_come_back`]; host-gw and VXLAN).
#[test]
fn entries_deleted_by_hand_come_back() {
    require_root!();
    scenarios::on_host_gw_and_vxlan(
        Dataplane::Kernel,
        "entries deleted by hand",
        scenarios::entries_deleted_by_hand_come_back,
    );
}

/// The agent's routes, neighbours and FDB entries changed by hand (not deleted): put back
/// within seconds, told by the kernel's notifications of the change, with the periodic
/// resync out of the way ([`scenarios::entries_changed_by_hand_come_back`]; host-gw and
/// VXLAN).
#[test]
fn entries_changed_by_hand_come_back() {
    require_root!();
    for backend in ["host-gw", "vxlan"] {
        let path = Path::of_backend(backend);
        let mut s = spec(2, Underlay::L2, backend, 1);
        s.agent_args = vec!["--resync-interval=3600".into()];
        with_cluster(&format!("{backend}/l2, entries changed by hand"), s, |c| {
            scenarios::entries_changed_by_hand_come_back(c, &move |_, _| path, 1)
        });
    }
}

/// The reconciles node1's agent has made (`flannel_reconcile_runs_total`).
fn node1_reconciles(c: &Cluster) -> Result<f64> {
    c.metric(1, "flannel_reconcile_runs_total")?
        .context("node1 exports no reconcile count")
}

/// Something that keeps undoing the agent's route (another controller: here a loop writing
/// a blackhole over it every 20 ms for 5 s) is not fought at full speed: the first change
/// is put back at once, the next ones a second, then 2 s, 4 s... apart, with a warning, so
/// node1 reconciles a handful of times, not once per change; once the loop stops, the route
/// is back at the next spaced repair.
#[test]
fn a_controller_undoing_the_dataplane_is_not_fought_at_full_speed() {
    require_root!();
    let mut s = spec(2, Underlay::L2, "host-gw", 1);
    s.agent_args = vec!["--resync-interval=3600".into()];
    with_cluster("host-gw/l2, a route undone again and again", s, |c| {
        let node2 = c.subnet_of(2).context("node2's subnet")?.to_string();
        let ours = |c: &Cluster| -> Result<bool> {
            let k = c.kernel_state(1)?;
            Ok(k.routes.iter().any(|r| r.starts_with(&node2)))
        };
        ensure!(ours(c)?, "node1 has no route to {node2}");
        let before = node1_reconciles(c)?;
        let node = c.topology().node(1);
        let started = std::time::Instant::now();
        let mut changes = 0;
        while started.elapsed() < Duration::from_secs(5) {
            node.run(&["ip", "route", "replace", "blackhole", &node2])?;
            changes += 1;
            thread::sleep(Duration::from_millis(20));
        }
        let during = node1_reconciles(c)? - before;
        eprintln!("node1: {during} reconciles for {changes} changes in 5 s");
        ensure!(changes >= 50, "only {changes} changes in 5 s");
        ensure!(
            (1.0..=5.0).contains(&during),
            "node1 reconciled {during} times for {changes} changes in 5 s"
        );
        wait::until_ok(Duration::from_secs(15), "node2's route back", || {
            ensure!(ours(c)?, "node1's route to {node2} is still undone");
            Ok(())
        })?;
        let log = std::fs::read_to_string(c.topology().node(1).agent_log())?;
        ensure!(
            count_lines(&log, "keep being changed or removed by something else") >= 1,
            "node1's agent did not say that something keeps undoing its entries"
        );
        Ok(())
    });
}

/// A lease that goes away, and one that comes back, each cost node1's agent one reconcile.
/// The kernel tells of every route, neighbour and FDB entry removed, added or replaced, and
/// such a notification brings a reconcile, so that an entry deleted or changed by hand comes
/// back at once; the agent's own deletions and writes are told apart and bring none (each
/// brought one before: at 5,000 peers about 30 ms of listing the kernel's tables, which the
/// next lease event waited for). An entry deleted by hand still brings one, and is back.
#[test]
fn a_lease_gone_or_back_costs_one_reconcile() {
    require_root!();
    let mut s = spec(3, Underlay::L2, "vxlan", 0);
    // No periodic resync in the windows counted.
    s.agent_args = vec!["--resync-interval=3600".into()];
    with_cluster("vxlan/l2, a lease gone", s, |c| {
        let node3 = c.subnet_of(3).context("node3's subnet")?;
        let key = c.lease_key(3).context("node3's lease key")?;
        c.agent_mut(3)
            .context("node3's agent")?
            .stop(Duration::from_secs(10))?;
        let lease = c
            .kv()
            .get(&key)?
            .with_context(|| format!("node3's lease {key}"))?;
        let before = node1_reconciles(c)?;
        ensure!(c.kv().delete(&key)?, "node3's lease {key} was not there");
        let prefix = format!("{} ", node3.addr());
        let gone = |c: &Cluster| -> Result<()> {
            let k = c.kernel_state(1)?;
            let left = k
                .routes
                .iter()
                .filter(|r| r.starts_with(&node3.to_string()))
                .count()
                + k.neighbours
                    .iter()
                    .filter(|n| n.starts_with(&prefix))
                    .count();
            ensure!(
                left == 0 && k.fdb.len() == 1,
                "node1 still has node3's entries: {k:?}"
            );
            Ok(())
        };
        wait::until_ok(Duration::from_secs(10), "node3's entries gone", || gone(c))?;
        // Long enough for the notifications and any reconcile they would bring.
        thread::sleep(Duration::from_secs(2));
        let after = node1_reconciles(c)?;
        ensure!(
            after - before == 1.0,
            "node1 reconciled {} times for one lease gone ({before} → {after})",
            after - before
        );
        // The lease written back (with no TTL: its agent is stopped).
        c.kv().put(&key, &lease)?;
        wait::until_ok(Duration::from_secs(10), "node3's entries back", || {
            ensure!(gone(c).is_err(), "node1 has none of node3's entries");
            let k = c.kernel_state(1)?;
            ensure!(k.fdb.len() == 2, "node1's FDB: {:?}", k.fdb);
            Ok(())
        })?;
        thread::sleep(Duration::from_secs(2));
        let back = node1_reconciles(c)?;
        ensure!(
            back - after == 1.0,
            "node1 reconciled {} times for one lease back ({after} → {back})",
            back - after
        );
        let after = back;
        // A route deleted by hand: one reconcile more, and it is back.
        let node2 = c.subnet_of(2).context("node2's subnet")?;
        c.topology()
            .node(1)
            .run(&["ip", "route", "del", &node2.to_string()])?;
        wait::until_ok(Duration::from_secs(10), "node2's route back", || {
            let k = c.kernel_state(1)?;
            ensure!(
                k.routes.iter().any(|r| r.starts_with(&node2.to_string())),
                "node1's routes: {:?}",
                k.routes
            );
            Ok(())
        })?;
        let again = node1_reconciles(c)?;
        ensure!(again > after, "no reconcile for the route deleted by hand");
        Ok(())
    });
}

/// `eth0` set down and up again under a running agent: the host-gw routes the kernel flushed
/// with it are back within seconds of it coming up, not at the next resync
/// ([`scenarios::external_interface_down_and_up`]; host-gw and VXLAN).
#[test]
fn an_external_interface_going_down_and_up_is_ridden_out() {
    require_root!();
    scenarios::on_host_gw_and_vxlan(
        Dataplane::Kernel,
        "eth0 down and up",
        scenarios::external_interface_down_and_up,
    );
}

/// `eth0` loses the address the agent started with: the agent says so and counts it, and
/// says when it is back, with every entry in place again
/// ([`scenarios::an_address_change_is_reported`]; host-gw).
#[test]
fn an_address_change_is_reported() {
    require_root!();
    let path = Path::of_backend("host-gw");
    let p = move |_: usize, _: usize| path;
    with_cluster(
        "host-gw/l2, eth0's address changes",
        spec(2, Underlay::L2, "host-gw", 1),
        |c| scenarios::an_address_change_is_reported(c, &p, 1),
    );
}

/// node1's `subnet.env` removed, then changed, under its running agent: each time it is
/// written again as it was within a few seconds, with one warning each (the CNI plugin
/// would otherwise fail every new pod on the node until the agent's next start).
#[test]
fn a_removed_or_changed_subnet_env_is_written_again() {
    require_root!();
    with_cluster("subnet.env kept", spec(1, Underlay::L2, "vxlan", 0), |c| {
        let node = c.topology().node(1);
        let file = node.subnet_file();
        let written = std::fs::read_to_string(&file)?;
        ensure!(
            written.contains("FLANNEL_SUBNET="),
            "subnet.env: {written:?}"
        );
        let back = |what: &str| {
            wait::until_ok(
                Duration::from_secs(10),
                &format!("subnet.env {what}"),
                || {
                    let now = std::fs::read_to_string(&file).unwrap_or_default();
                    ensure!(now == written, "subnet.env holds {now:?}");
                    Ok(())
                },
            )
        };
        std::fs::remove_file(&file)?;
        back("written again after its removal")?;
        std::fs::write(
            &file,
            "FLANNEL_NETWORK=10.9.0.0/16\nFLANNEL_SUBNET=10.9.9.1/24\n",
        )?;
        back("written again after a change")?;
        let log = std::fs::read_to_string(node.agent_log())?;
        let warnings = count_lines(&log, "under the agent; written again");
        ensure!(warnings == 2, "{warnings} warnings, not 2");
        Ok(())
    });
}

/// `flannel.1` set down by hand under a running agent: up again with every route and
/// neighbour through it within seconds ([`scenarios::device_set_down_comes_back`]).
#[test]
fn a_device_set_down_comes_back() {
    require_root!();
    with_cluster(
        "vxlan/l2, flannel.1 down",
        spec(2, Underlay::L2, "vxlan", 1),
        |c| scenarios::device_set_down_comes_back(c, &vxlan, 1, "flannel.1"),
    );
}

/// etcd is killed for 30 s: traffic keeps flowing, the agents stay up and healthy, and
/// recover their watches afterwards.
#[test]
fn etcd_outage_is_ridden_out() {
    require_root!();
    with_cluster("etcd outage", spec(2, Underlay::L2, "vxlan", 1), |c| {
        scenarios::etcd_outage_is_ridden_out(c, &vxlan, 1, 2)
    });
}

/// Ten agents start at the same moment against one etcd: ten distinct subnets, each node's
/// subnet.env names its own lease, and every node programs the nine others.
#[test]
fn ten_agents_start_at_once() {
    require_root!();
    with_cluster("ten at once", spec(10, Underlay::L2, "vxlan", 0), |c| {
        let by_node = leases_by_node(c)?;
        ensure!(by_node.len() == 10, "{} leases", by_node.len());
        let subnets: std::collections::BTreeSet<_> = by_node.values().map(|l| l.subnet).collect();
        ensure!(subnets.len() == 10, "subnets collide: {subnets:?}");
        let network = c.spec().network;
        for (n, lease) in &by_node {
            ensure!(
                network.contains(&lease.subnet) && lease.subnet.prefix_len() == 24,
                "node{n}: {}",
                lease.subnet
            );
            ensure!(
                c.subnet_of(*n) == Some(lease.subnet),
                "node{n}'s subnet.env says {:?}, etcd {}",
                c.subnet_of(*n),
                lease.subnet
            );
        }
        converged(c, &vxlan)
    });
}

/// Leftovers of a previous run on a node whose `flannel.1` still exists: a route with
/// flannel's protocol for a lease that no longer exists (onlink via flannel.1, and a
/// host-gw style one via eth0), a neighbour and an FDB entry on flannel.1. The agent removes
/// all of them once it has the complete lease set, and leaves a foreign route alone.
#[test]
fn stale_state_is_removed_at_start() {
    require_root!();
    let s: ClusterSpec = spec(2, Underlay::L2, "vxlan", 0);
    let topo = Topology::new(s.topology.clone()).expect("topology");
    let node = topo.node(1);
    let stale_mac = "0e:5e:a1:e0:00:01";
    let setup: Result<()> = (|| {
        node.add_vxlan("flannel.1", 1, 8472, 1450)?;
        for argv in [
            vec![
                "ip",
                "neigh",
                "add",
                "10.244.200.0",
                "lladdr",
                stale_mac,
                "dev",
                "flannel.1",
                "nud",
                "permanent",
            ],
            vec![
                "bridge",
                "fdb",
                "add",
                stale_mac,
                "dev",
                "flannel.1",
                "self",
                "dst",
                "192.168.1.200",
                "permanent",
            ],
            vec![
                "ip",
                "route",
                "add",
                "10.244.200.0/24",
                "via",
                "10.244.200.0",
                "dev",
                "flannel.1",
                "onlink",
                "proto",
                "165",
            ],
            vec![
                "ip",
                "route",
                "add",
                "10.244.201.0/24",
                "via",
                "192.168.1.201",
                "dev",
                "eth0",
                "proto",
                "165",
            ],
            // Not flannel's: another protocol, not on a flannel device.
            vec![
                "ip",
                "route",
                "add",
                "10.244.202.0/24",
                "via",
                "192.168.1.202",
                "dev",
                "eth0",
                "proto",
                "static",
            ],
        ] {
            node.run(&argv)?;
        }
        Ok(())
    })();
    if let Err(e) = setup {
        panic!("stale state setup: {e:#}");
    }
    let stale = status::kernel_state(node.ns(), s.network, None).expect("kernel state");
    assert_eq!(stale.routes.len(), 3, "{stale}");
    assert_eq!((stale.neighbours.len(), stale.fdb.len()), (1, 1), "{stale}");
    let progress = |msg: &str| eprintln!("[stale state] {msg}");
    let mut c = match Cluster::start(topo, s, &progress, &|| false) {
        Ok(c) => c,
        Err(e) => panic!("[stale state] bringing the cluster up: {e:#}"),
    };
    let result = c.wait_ready(Duration::from_secs(60)).and_then(|()| {
        let leases = c.leases()?;
        let mut want = expected_state(&c, 1, &leases, |_| Path::Vxlan);
        want.routes
            .push("10.244.202.0/24 via 192.168.1.202 dev eth0 proto static".to_owned());
        want.routes.sort();
        let got = wait_for_state(&c, 1, &want)?;
        ensure!(
            !got.mentions(stale_mac) && !got.mentions("10.244.200.0/24"),
            "stale entries left:\n{got}"
        );
        let log = std::fs::read_to_string(c.topology().node(1).agent_log())?;
        eprintln!(
            "[stale state] node1 reconciles: {:?}",
            log.lines()
                .filter(|l| l.contains("dataplane reconciled"))
                .collect::<Vec<_>>()
        );
        wait::until_ok(CONVERGE, "node2", || {
            let want = expected_state(&c, 2, &leases, |_| Path::Vxlan);
            ensure!(c.kernel_state(2)? == want, "node2 differs");
            Ok(())
        })
    });
    if let Err(e) = result {
        agent_support::fail("stale state", &mut c, &e);
    }
}

/// Kube mode (the fake API server), vxlan, kernel path. Upstream writes a Node's flannel
/// annotations once; the agent keeps them. node2's annotations removed by hand are back
/// within seconds as node2 published them (one warning in its log), node1 routes to node2
/// again and the pods reach each other. node2's Node deleted and registered again with
/// another pod CIDR ends node2's agent with exit code 1 and an error that names both.
#[test]
fn kube_the_own_node_keeps_its_annotations() {
    require_root!();
    if let Err(e) = kube::with_vxlan_pair(Dataplane::Kernel, own_node_kept) {
        panic!("[kube own node] {e:#}");
    }
}

fn own_node_kept(topology: &mut Topology, api: &MockApiServer, agents: &mut [Agent]) -> Result<()> {
    const PREFIX: &str = "flannel.alpha.coreos.com/";
    for (node, agent) in topology.nodes().iter().zip(agents.iter_mut()) {
        agent.wait_subnet_env(node, Duration::from_secs(60))?;
    }
    let node2 = topology.node(2).name();
    let flannel_annotations = || -> Result<BTreeMap<String, String>> {
        let obj = api.node(&node2).context("node2 is gone")?;
        let ann = obj["metadata"]["annotations"]
            .as_object()
            .context("no annotations")?;
        Ok(ann
            .iter()
            .filter(|(k, _)| k.starts_with(PREFIX))
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
            .collect())
    };
    // kube-subnet-manager, backend-type, backend-data, public-ip.
    let published = wait::until(CONVERGE, "node2's annotations", || {
        let ann = flannel_annotations()?;
        Ok((ann.len() == 4).then_some(ann))
    })?;
    topology.add_pod(1)?;
    topology.add_pod(2)?;
    let network: Ipv4Net = "10.244.0.0/16".parse()?;
    let connected = || -> Result<()> {
        let state = status::kernel_state(topology.node(1).ns(), network, None)?;
        ensure!(
            state.route_to("10.244.2.0/24").is_some(),
            "node1 has no route to node2's pods:\n{state}"
        );
        let pods: Vec<&Pod> = topology.pods().iter().collect();
        probe::matrix(&pods, Duration::from_secs(2))?.check()
    };
    wait::until_ok(CONVERGE, "node1 routes to node2", connected)?;

    api.modify_node(&node2, |n| {
        if let Some(ann) = n["metadata"]["annotations"].as_object_mut() {
            ann.retain(|k, _| !k.starts_with(PREFIX));
        }
    })
    .context("node2")?;
    wait::until_ok(Duration::from_secs(10), "node2's annotations back", || {
        let ann = flannel_annotations()?;
        ensure!(ann == published, "{ann:?}, not {published:?}");
        Ok(())
    })?;
    wait::until_ok(
        Duration::from_secs(10),
        "node1 routes to node2 again",
        connected,
    )?;
    let log = std::fs::read_to_string(agents[1].log_path())?;
    let warned = count_lines(&log, "lost or changed its flannel annotations");
    ensure!(warned == 1, "node2's agent warned {warned} times");

    api.delete_node(&node2).context("node2")?;
    api.apply_node(kube_mock::node(&node2, &["10.244.9.0/24"], &[]));
    let agent2 = &mut agents[1];
    let status = wait::until(Duration::from_secs(10), "node2's agent to exit", || {
        Ok(agent2.exit_status())
    })?;
    ensure!(
        status.code() == Some(1),
        "node2's agent exited with {status}"
    );
    let log = std::fs::read_to_string(agent2.log_path())?;
    ensure!(
        log.contains("now has pod CIDR 10.244.9.0/24, not 10.244.2.0/24 as leased"),
        "node2's log does not say why it stopped"
    );
    Ok(())
}
