//! The real `flannel-agent` through a cluster's life: a node leaving, an agent restart under
//! a continuous request stream, an etcd outage, ten agents starting at once on one etcd, and
//! stale dataplane state of a previous run.
//!
//! Run: `cargo test -p flannel-tests --test agent_lifecycle` (as root; skipped otherwise).

mod agent_support;

use std::{
    net::{IpAddr, Ipv4Addr},
    thread,
    time::{Duration, Instant},
};

use agent_support::{
    CONVERGE, Path, count_lines, expected_state, leases_by_node, spec, wait_for_state, with_cluster,
};
use anyhow::{Context as _, Result, bail, ensure};
use flannel_tests::{
    bench::variant::link_mac,
    lab::{
        agent::DEFAULT_HEALTHZ_PORT,
        cluster::{Cluster, ClusterSpec},
        probe::{UdpEcho, UdpStream},
        status, wait,
    },
    require_root,
    topology::{Topology, Underlay},
};
use serde_json::json;

/// Interval of the request streams that must lose nothing.
const STREAM_INTERVAL: Duration = Duration::from_millis(10);

/// Waits until every node holds exactly the vxlan entries for every other lease in etcd.
fn all_converged(cluster: &Cluster) -> Result<()> {
    let leases: Vec<_> = leases_by_node(cluster)?.into_values().collect();
    for n in 1..=cluster.topology().nodes().len() {
        let want = expected_state(cluster, n, &leases, |_| Path::Vxlan);
        wait_for_state(cluster, n, &want)?;
    }
    Ok(())
}

fn ifindex(cluster: &Cluster, n: usize, dev: &str) -> Result<u64> {
    let out = cluster
        .topology()
        .node(n)
        .run(&["ip", "-j", "link", "show", dev])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    v[0]["ifindex"]
        .as_u64()
        .with_context(|| format!("no ifindex for {dev}: {out}"))
}

/// A node leaves: its lease is deleted from etcd. Its own agent stops (exit 0, "revoked"),
/// and every other node removes its route, neighbour and FDB entry, keeping the rest.
#[test]
fn a_node_leaving_is_removed_everywhere() {
    require_root!();
    with_cluster("node leaves", spec(3, Underlay::L2, "vxlan", 0), |c| {
        all_converged(c)?;
        let gone = leases_by_node(c)?.remove(&3).context("node3 has a lease")?;
        let key = c.lease_key(3).context("node3's lease key")?;
        ensure!(key == gone.key, "{key} vs {}", gone.key);
        ensure!(c.kv().delete(&key)?, "{key} existed");
        let agent = c.agent_mut(3).context("agent 3")?;
        let status = wait::until(Duration::from_secs(20), "node3's agent to exit", || {
            Ok(agent.exit_status())
        })?;
        ensure!(status.success(), "node3's agent exited with {status}");
        let log = std::fs::read_to_string(agent.log_path())?;
        ensure!(
            log.contains("Lease has been revoked"),
            "node3's log does not say why it stopped"
        );
        let remaining = c.leases()?;
        ensure!(remaining.len() == 2, "leases left: {remaining:?}");
        for n in 1..=2 {
            let want = expected_state(c, n, &remaining, |_| Path::Vxlan);
            let got = wait_for_state(c, n, &want)?;
            ensure!(
                !got.mentions(&gone.subnet.to_string())
                    && !got.mentions(&gone.subnet.network().to_string())
                    && !got.mentions(gone.vtep_mac().unwrap_or("-")),
                "node{n} still holds entries of node3:\n{got}"
            );
        }
        Ok(())
    });
}

/// SIGTERM and start again: the agent exits 0, the restarted one adopts the dataplane
/// without a single kernel write (same device, identical entries, no duplicates), and a
/// UDP request every 10 ms through that node loses nothing.
#[test]
fn restart_is_hitless() {
    require_root!();
    with_cluster("restart", spec(2, Underlay::L2, "vxlan", 1), |c| {
        all_converged(c)?;
        let before = c.kernel_state(1)?;
        let (index, mac) = (
            ifindex(c, 1, "flannel.1")?,
            link_mac(c.topology().node(1).ns(), "flannel.1")?,
        );
        let lease_before = c.lease_key(1);
        let (server, client) = (c.topology().pods_on(1)[0], c.topology().pods_on(2)[0]);
        let echo = UdpEcho::start(server.ns(), IpAddr::V4(server.ip()), 0)?;
        let stream = UdpStream::start(client.ns(), echo.addr(), STREAM_INTERVAL)?;
        thread::sleep(Duration::from_secs(1));

        let log_path = c.topology().node(1).agent_log();
        let agent = c.agent_mut(1).context("agent 1")?;
        let status = agent.stop(Duration::from_secs(10))?;
        ensure!(
            status.success(),
            "the agent exited with {status} on SIGTERM"
        );
        let first_run_len = std::fs::read_to_string(&log_path)?.len();
        thread::sleep(Duration::from_millis(500));
        agent.restart()?;
        wait::until_ok(
            Duration::from_secs(30),
            "the restarted agent's /readyz",
            || {
                c.agent_mut(1).context("agent 1")?.check_running()?;
                match status::http_status(
                    c.topology().node(1).ns(),
                    DEFAULT_HEALTHZ_PORT,
                    "/readyz",
                )? {
                    200 => Ok(()),
                    code => bail!("/readyz {code}"),
                }
            },
        )?;
        // A resync interval's worth of the second run must not change anything either.
        thread::sleep(Duration::from_secs(2));
        let stats = stream.finish()?;
        eprintln!("stream across the restart: {stats:?}");
        ensure!(stats.sent > 200, "only {} requests sent", stats.sent);
        ensure!(
            stats.lost_count == 0,
            "{} of {} requests lost across the restart (first: {:?})",
            stats.lost_count,
            stats.sent,
            stats.lost
        );

        let after = c.kernel_state(1)?;
        ensure!(
            after == before,
            "kernel state changed:\nbefore\n{before}after\n{after}"
        );
        ensure!(
            after.duplicates().is_empty(),
            "duplicates: {:?}",
            after.duplicates()
        );
        ensure!(
            ifindex(c, 1, "flannel.1")? == index
                && link_mac(c.topology().node(1).ns(), "flannel.1")? == mac,
            "flannel.1 was recreated or its MAC changed"
        );
        ensure!(c.lease_key(1) == lease_before, "the lease changed");
        let log = std::fs::read_to_string(&log_path)?;
        let second = &log[first_run_len.min(log.len())..];
        ensure!(
            second.contains("lease acquired") && second.contains("flannel is ready"),
            "the second run's log is incomplete:\n{second}"
        );
        let writes = count_lines(second, "dataplane reconciled");
        ensure!(
            writes == 0,
            "the restarted agent wrote to the kernel {writes} times:\n{second}"
        );
        ensure!(
            c.kernel_state(2)? == expected_state(c, 2, &c.leases()?, |_| Path::Vxlan),
            "node2 lost entries"
        );
        Ok(())
    });
}

/// A vxlan lease of a node that does not exist, in upstream's JSON.
fn fake_lease(public_ip: Ipv4Addr, mac: &str) -> String {
    json!({
        "PublicIP": public_ip.to_string(),
        "PublicIPv6": null,
        "BackendType": "vxlan",
        "BackendData": {"VNI": 1, "VtepMAC": mac},
    })
    .to_string()
}

/// etcd is killed for 30 s: traffic keeps flowing, the agents stay up and healthy; after
/// etcd is back they see a new lease (the lease watch reconnected) and renew their own (the
/// keeper's watch reconnected: a short TTL put on the key is renewed to the full 24 h).
#[test]
fn etcd_outage_is_ridden_out() {
    require_root!();
    with_cluster("etcd outage", spec(2, Underlay::L2, "vxlan", 1), |c| {
        all_converged(c)?;
        let (server, client) = (c.topology().pods_on(2)[0], c.topology().pods_on(1)[0]);
        let echo = UdpEcho::start(server.ns(), IpAddr::V4(server.ip()), 0)?;
        let stream = UdpStream::start(client.ns(), echo.addr(), STREAM_INTERVAL)?;
        let before: Vec<_> = (1..=2).map(|n| c.kernel_state(n)).collect::<Result<_>>()?;

        c.stop_etcd();
        let outage = Instant::now();
        while outage.elapsed() < Duration::from_secs(30) {
            for n in 1..=2 {
                c.agent_mut(n).context("agent")?.check_running()?;
                let ns = c.topology().node(n).ns();
                let code = status::http_status(ns, DEFAULT_HEALTHZ_PORT, "/healthz")?;
                ensure!(code == 200, "node{n} /healthz {code} during the outage");
            }
            thread::sleep(Duration::from_secs(1));
        }
        for (n, state) in before.iter().enumerate() {
            ensure!(
                &c.kernel_state(n + 1)? == state,
                "node{} changed its dataplane during the outage",
                n + 1
            );
        }
        c.resume_etcd()?;
        eprintln!("etcd back after {:?}", outage.elapsed());

        // The lease watch reconnected: a lease added now is programmed everywhere.
        let prefix = c.spec().etcd_prefix.clone();
        let fake_key = format!("{prefix}/subnets/10.244.250.0-24");
        let fake_mac = "0e:00:00:00:fa:01";
        let fake_ip = Ipv4Addr::new(192, 168, 1, 250);
        c.kv()
            .put_with_ttl(&fake_key, &fake_lease(fake_ip, fake_mac), 600)?;
        let leases = c.leases()?;
        ensure!(leases.len() == 3, "{leases:?}");
        for n in 1..=2 {
            let want = expected_state(c, n, &leases, |_| Path::Vxlan);
            wait_for_state(c, n, &want).with_context(|| format!("node{n} after etcd came back"))?;
        }

        // The keeper's watch reconnected: it sees its key attached to a 70 s lease and
        // renews it (renew margin 1 min) with the full TTL.
        let key = c.lease_key(1).context("node1's lease key")?;
        let value = c.kv().get(&key)?.context("node1's lease is gone")?;
        let short = c.kv().put_with_ttl(&key, &value, 70)?;
        let (id, ttl) = wait::until(
            Duration::from_secs(40),
            "node1 to renew its lease",
            || match c.kv().lease_of(&key)? {
                Some((id, ttl)) if id != short && ttl > 3600 => Ok(Some((id, ttl))),
                other => bail!("lease of {key}: {other:?}"),
            },
        )?;
        eprintln!("node1 renewed {key}: etcd lease {id:x}, TTL {ttl} s");
        let log = std::fs::read_to_string(c.topology().node(1).agent_log())?;
        ensure!(log.contains("renewed lease"), "no renewal in node1's log");
        let key2 = c.lease_key(2).context("node2's lease key")?;
        ensure!(c.kv().get(&key2)?.is_some(), "node2's lease is gone");
        for n in 1..=2 {
            c.agent_mut(n).context("agent")?.check_running()?;
            let code =
                status::http_status(c.topology().node(n).ns(), DEFAULT_HEALTHZ_PORT, "/readyz")?;
            ensure!(code == 200, "node{n} /readyz {code} after the outage");
        }

        let stats = stream.finish()?;
        eprintln!("stream across the outage: {stats:?}");
        ensure!(stats.sent > 3000, "only {} requests sent", stats.sent);
        ensure!(
            stats.lost_count == 0,
            "{} of {} requests lost (first: {:?})",
            stats.lost_count,
            stats.sent,
            stats.lost
        );
        Ok(())
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
        all_converged(c)
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
    let local = node.addr().to_string();
    let stale_mac = "0e:5e:a1:e0:00:01";
    let setup: Result<()> = (|| {
        for argv in [
            vec![
                "ip",
                "link",
                "add",
                "flannel.1",
                "type",
                "vxlan",
                "id",
                "1",
                "local",
                &local,
                "dev",
                "eth0",
                "dstport",
                "8472",
                "nolearning",
            ],
            vec!["ip", "link", "set", "flannel.1", "mtu", "1450", "up"],
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
        eprintln!("[stale state] FAILED:\n{}", agent_support::dump(&mut c));
        panic!("[stale state] {e:#}");
    }
}
