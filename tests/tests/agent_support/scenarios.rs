//! The checks the kernel-path tests and the eBPF fast-path tests share. Each takes the
//! dataplane of every node from the cluster (`Cluster::dataplane_of`), so the same scenario
//! runs on a kernel-path cluster, a fast-path cluster and a mixed one, and takes how node
//! *a* reaches node *b* as a [`PathFn`].
//!
//! On fast-path nodes every scenario also checks what only the fast path has: the exact
//! route map, `flannel_dataplane_info{path="ebpf"}`, and that the packet counters of the
//! programs grew by the traffic the scenario sent (bytes of bulk transfers included), so an
//! agent that silently fell back to the kernel path, or a program that hands everything to
//! the kernel, fails.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use flannel_common::stats::Reason;
use flannel_tests::{
    bench::variant::link_mac,
    lab::{
        agent::{DEFAULT_HEALTHZ_PORT, Dataplane},
        cluster::Cluster,
        fastpath::{self, Counters, PinIds},
        lease::LeaseRecord,
        probe::{self, FlowStats, StreamStats, TcpFlow, UdpEcho, UdpStream},
        status, wait,
    },
    topology::Underlay,
};
use serde_json::json;

use super::{
    CONVERGE, PROBE, Path, check_active_path, count_lines, counters, expected_routes,
    expected_state, leases_by_node, named, node_of, on_fast_path, routes_text, spec_on,
    wait_for_routes, wait_for_state, with_cluster,
};

/// How node `a` reaches node `b` (1-based node numbers).
pub type PathFn<'a> = &'a dyn Fn(usize, usize) -> Path;

/// Bytes sent across nodes by each checksummed transfer.
pub const TRANSFER_BYTES: u64 = 8 * 1024 * 1024;
/// Interval of the request streams that must lose nothing.
pub const STREAM_INTERVAL: Duration = Duration::from_millis(10);
/// Pace of the long TCP transfers across restarts and outages, bytes per second.
pub const FLOW_RATE: u64 = 2 * 1024 * 1024;
/// The longest a long TCP transfer may wait for data: a single lost segment costs at least
/// the 200 ms minimum retransmission timeout and shows as a retransmission anyway; this
/// bounds scheduling hiccups of a loaded machine.
pub const MAX_STALL: Duration = Duration::from_secs(1);

/// The nodes of the cluster, 1-based.
pub fn all_nodes(cluster: &Cluster) -> Vec<usize> {
    (1..=cluster.topology().nodes().len()).collect()
}

/// How node `n` reaches `lease`: through `path` for a lease of a lab node, the backend's
/// default path for a lease of no lab node (a fake one).
fn path_to_lease(cluster: &Cluster, path: PathFn<'_>, n: usize, lease: &LeaseRecord) -> Path {
    match node_of(cluster, lease) {
        Some(m) => path(n, m),
        None => Path::of_backend(&cluster.spec().backend),
    }
}

/// Every node in `nodes` holds exactly the kernel entries for `leases` that `path` asks for;
/// fast-path nodes also hold exactly the route map entries and report the eBPF path,
/// kernel-path nodes report the kernel path.
pub fn converged_on(
    cluster: &Cluster,
    nodes: &[usize],
    leases: &[LeaseRecord],
    path: PathFn<'_>,
) -> Result<()> {
    for &n in nodes {
        let path_to = |l: &LeaseRecord| path_to_lease(cluster, path, n, l);
        let want = expected_state(cluster, n, leases, path_to);
        wait_for_state(cluster, n, &want)?;
        check_active_path(cluster, n)?;
        if on_fast_path(cluster, n) {
            let routes = expected_routes(cluster, n, leases, path_to);
            wait_for_routes(cluster, n, &routes)?;
        }
    }
    Ok(())
}

/// [`converged_on`] for every node and the leases of every node.
pub fn converged(cluster: &Cluster, path: PathFn<'_>) -> Result<()> {
    let by_node = leases_by_node(cluster)?;
    let subnets: std::collections::BTreeSet<_> = by_node.values().map(|l| l.subnet).collect();
    ensure!(
        subnets.len() == by_node.len(),
        "leases overlap: {by_node:?}"
    );
    let leases: Vec<_> = by_node.into_values().collect();
    converged_on(cluster, &all_nodes(cluster), &leases, path)
}

/// The counters of every fast-path node, from its agent's `/metrics`.
pub fn fast_counters(cluster: &Cluster) -> Result<BTreeMap<usize, Counters>> {
    per_fast_node(cluster, |n| counters(cluster, n))
}

/// The counters of every fast-path node, read from its pinned counter maps (readable while
/// its agent is down).
pub fn pinned_fast_counters(cluster: &Cluster) -> Result<BTreeMap<usize, Counters>> {
    per_fast_node(cluster, |n| {
        fastpath::pinned_counters(cluster.topology().node(n).bpf_pin_path())
            .with_context(|| format!("node{n}'s pinned fast-path counters"))
    })
}

/// `read(n)` for every fast-path node `n`.
fn per_fast_node(
    cluster: &Cluster,
    read: impl Fn(usize) -> Result<Counters>,
) -> Result<BTreeMap<usize, Counters>> {
    all_nodes(cluster)
        .into_iter()
        .filter(|&n| on_fast_path(cluster, n))
        .map(|n| Ok((n, read(n)?)))
        .collect()
}

/// The fast paths' drops since `before` (read from the pinned counters), for a failure
/// message: each node's `drop_*` reasons that grew, by program.
fn drops_since(cluster: &Cluster, before: &BTreeMap<usize, Counters>) -> String {
    let now = match pinned_fast_counters(cluster) {
        Ok(now) => now,
        Err(e) => return format!("the fast paths' counters cannot be read: {e:#}"),
    };
    let drops = |c: &Counters| -> fastpath::Counts {
        c.packets
            .iter()
            .filter(|((_, reason), _)| reason.starts_with("drop_"))
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    };
    let per_node: Vec<String> = now
        .iter()
        .map(|(n, c)| {
            let was = before.get(n).map(drops).unwrap_or_default();
            format!("node{n} {}", fastpath::growth_text(&was, &drops(c)))
        })
        .collect();
    format!("the fast paths' drops meanwhile: {}", per_node.join("; "))
}

/// What a fast path must have counted between two scrapes.
#[derive(Debug, Default)]
pub struct Expect {
    /// (node, program, reason) → at least this many packets.
    packets: BTreeMap<(usize, &'static str, &'static str), u64>,
    /// (node, program, reason) → at least this many bytes.
    bytes: BTreeMap<(usize, &'static str, &'static str), u64>,
}

impl Expect {
    /// Node `a` sent at least `packets` packets and `bytes` bytes to node `b` (reached by
    /// `path`): `a`'s egress program must have counted both, `b`'s ingress program too (for
    /// those of the two on the fast path). A transfer (`bytes` > 0) between two fast-path
    /// nodes must moreover have gone straight into the pod's namespace on `b`
    /// (`deliver_peer`): by then the pods have talked, so the bridge has learnt their MACs and
    /// the agent mirrored them.
    ///
    /// From a kernel-path sender only the packets count on `b`: the lab runs with
    /// `FLANNEL_IPMASQ=false`, so the CNI bridge plugin masquerades that node's pod-to-pod
    /// traffic (upstream's behaviour), which then arrives from the node's address and is the
    /// stack's (`pass_foreign_source`); the small matrix probes all reach `b` one way or
    /// another.
    pub fn sent(
        &mut self,
        cluster: &Cluster,
        path: PathFn<'_>,
        (a, b): (usize, usize),
        packets: u64,
        bytes: u64,
    ) {
        let Some(kind) = path(a, b).kind() else {
            return;
        };
        let received = if on_fast_path(cluster, a) { bytes } else { 0 };
        let peer = fastpath::ingress_reason(kind)
            .filter(|_| received > 0)
            .map(|(program, _)| (program, Reason::DeliverPeer.name()));
        let ends = [
            (a, fastpath::egress_reason(kind), bytes),
            (b, fastpath::ingress_reason(kind), received),
            (b, peer, received),
        ];
        for (n, reason, bytes) in ends {
            if let (true, Some((program, reason))) = (on_fast_path(cluster, n), reason) {
                *self.packets.entry((n, program, reason)).or_default() += packets;
                *self.bytes.entry((n, program, reason)).or_default() += bytes;
            }
        }
    }

    /// Fails unless every expected counter grew by at least its amount.
    pub fn check(
        &self,
        before: &BTreeMap<usize, Counters>,
        after: &BTreeMap<usize, Counters>,
    ) -> Result<()> {
        let empty = Counters::default();
        let pick = |m: &BTreeMap<usize, Counters>, n: usize| m.get(&n).unwrap_or(&empty).clone();
        for (family, want) in [("packets", &self.packets), ("bytes", &self.bytes)] {
            for (&(n, program, reason), &min) in want {
                let (b, a) = (pick(before, n), pick(after, n));
                let (b, a) = if family == "packets" {
                    (b.packets, a.packets)
                } else {
                    (b.bytes, a.bytes)
                };
                let grew = fastpath::grown(&b, &a, program, reason);
                ensure!(
                    grew >= min,
                    "node{n}'s fast path counted {grew} {family} under {program}/{reason}, \
                     expected at least {min}; what moved: {}",
                    fastpath::growth_text(&b, &a)
                );
            }
        }
        Ok(())
    }
}

/// Every node holds exactly the entries `path` asks for, every pod reaches every other pod,
/// and [`TRANSFER_BYTES`] cross each pair in `transfers` (first pod to first pod) intact. On
/// fast-path nodes the programs counted it: matrix packets towards every peer with a path,
/// and at least the transferred bytes on both ends of every transfer.
pub fn reachable_everywhere(
    cluster: &Cluster,
    path: PathFn<'_>,
    transfers: &[(usize, usize)],
) -> Result<()> {
    converged(cluster, path)?;
    let before = fast_counters(cluster)?;
    let matrix = cluster.matrix(PROBE)?;
    eprintln!("{matrix}");
    if !matrix.all_ok() {
        bail!("pods cannot reach each other:\n{matrix}");
    }
    let mut expect = Expect::default();
    let nodes = all_nodes(cluster);
    for &a in &nodes {
        for &b in &nodes {
            if a != b && !cluster.topology().pods_on(a).is_empty() {
                // Each probe is at least SYN, data and FIN from a's pods towards b's.
                expect.sent(cluster, path, (a, b), 3, 0);
            }
        }
    }
    for &(a, b) in transfers {
        transfer_between(cluster, a, b)?;
        expect.sent(cluster, path, (a, b), 1, TRANSFER_BYTES);
    }
    let after = fast_counters(cluster)?;
    expect.check(&before, &after)
}

/// Sends [`TRANSFER_BYTES`] from the first pod of node `a` to the first pod of node `b`.
pub fn transfer_between(cluster: &Cluster, a: usize, b: usize) -> Result<()> {
    let topo = cluster.topology();
    let (from, to) = (topo.pods_on(a)[0], topo.pods_on(b)[0]);
    let t = probe::transfer(
        from.ns(),
        to.ns(),
        IpAddr::V4(to.ip()),
        TRANSFER_BYTES,
        Duration::from_secs(30),
    )
    .with_context(|| format!("transfer {} -> {}", from.name(), to.name()))?;
    eprintln!(
        "{} -> {}: {} bytes intact in {:?} ({:.0} Mbit/s)",
        from.name(),
        to.name(),
        t.bytes,
        t.elapsed,
        t.mbit_per_s()
    );
    Ok(())
}

/// The interface index of `dev` on node `n`.
pub fn ifindex(cluster: &Cluster, n: usize, dev: &str) -> Result<u64> {
    let out = cluster
        .topology()
        .node(n)
        .run(&["ip", "-j", "link", "show", dev])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    v[0]["ifindex"]
        .as_u64()
        .with_context(|| format!("no ifindex for {dev}: {out}"))
}

/// Traffic that must not notice what happens meanwhile: a UDP request every
/// [`STREAM_INTERVAL`] from node `client`'s first pod to an echo in node `server`'s first pod
/// (answers leave `server` through its dataplane), and a paced TCP transfer from `server`'s
/// pod to `client`'s.
pub struct Undisturbed {
    // The stream and flow end before the echo they talk to.
    stream: UdpStream,
    flow: TcpFlow,
    _echo: UdpEcho,
    /// (client, server)
    pub nodes: (usize, usize),
}

impl Undisturbed {
    /// Starts both.
    pub fn start(cluster: &Cluster, client: usize, server: usize) -> Result<Undisturbed> {
        let topo = cluster.topology();
        let (c, s) = (topo.pods_on(client)[0], topo.pods_on(server)[0]);
        let echo = UdpEcho::start(s.ns(), IpAddr::V4(s.ip()), 0)?;
        let stream = UdpStream::start(c.ns(), echo.addr(), STREAM_INTERVAL)?;
        let flow = TcpFlow::start(s.ns(), c.ns(), IpAddr::V4(c.ip()), FLOW_RATE)?;
        Ok(Undisturbed {
            stream,
            flow,
            _echo: echo,
            nodes: (client, server),
        })
    }

    /// Stops both and fails unless nothing was lost: every request answered, every byte
    /// delivered intact without a stall beyond [`MAX_STALL`], and no retransmission except
    /// needless ones (a tail loss probe or a reaction to reordering, which the receiver
    /// reports as a duplicate); at least `min_requests` requests were sent.
    pub fn finish(self, what: &str, min_requests: u64) -> Result<(StreamStats, FlowStats)> {
        let stats = self.stream.finish()?;
        let flow = self.flow.finish().with_context(|| format!("TCP {what}"))?;
        eprintln!("UDP stream {what}: {stats:?}\nTCP transfer {what}: {flow:?}");
        ensure!(
            stats.sent >= min_requests,
            "only {} requests sent {what}",
            stats.sent
        );
        ensure!(
            stats.lost_count == 0,
            "{} of {} requests lost {what} (first: {:?})",
            stats.lost_count,
            stats.sent,
            stats.lost
        );
        ensure!(
            flow.lost() == 0,
            "the TCP transfer {what} lost {} segments: {} retransmitted, {} of them shown \
             needless by D-SACKs; sender's counters {:?}, receiver's {:?}",
            flow.lost(),
            flow.retransmits,
            flow.spurious,
            flow.sender_netstat,
            flow.receiver_netstat
        );
        ensure!(
            flow.longest_stall < MAX_STALL,
            "the TCP transfer {what} stalled for {:?}",
            flow.longest_stall
        );
        Ok((stats, flow))
    }
}

/// What the fast path of node `n` adds to the expectations of [`Undisturbed`] traffic:
/// `server`'s pod sent the transfer and the answers to `client`'s.
fn expect_undisturbed(
    cluster: &Cluster,
    path: PathFn<'_>,
    (client, server): (usize, usize),
    stream: &StreamStats,
    flow: &FlowStats,
) -> Expect {
    let mut expect = Expect::default();
    expect.sent(cluster, path, (client, server), stream.answered, 0);
    expect.sent(cluster, path, (server, client), stream.answered, flow.bytes);
    expect
}

/// The fast-path pins of node `n` and its route map.
fn fast_path_state(
    cluster: &Cluster,
    n: usize,
) -> Result<(PinIds, BTreeMap<ipnet::Ipv4Net, fastpath::Route>)> {
    let pins = cluster.topology().node(n).bpf_pin_path();
    Ok((fastpath::pin_ids(pins)?, fastpath::routes(pins)?))
}

/// Packets each way [`restart_is_hitless`] wants the fast path to count while the agent is
/// down for 2 s (a request every [`STREAM_INTERVAL`] and its answer: 200 each way).
const DOWN_PACKETS: u64 = 100;

/// Node `n`'s agent is stopped (SIGTERM) and started again while [`Undisturbed`] traffic
/// runs between its pod and node `peer`'s: the agent exits 0; nothing is lost; the
/// restarted agent adopts the dataplane without a single write (same `flannel.1`, identical
/// kernel entries, no duplicates; "dataplane reconciled" never logged). On the fast path the
/// programs and maps stay attached while the agent is down (same map and link ids, same
/// route map, and the pinned counters count both directions of the traffic meanwhile), the
/// new agent swaps its programs in behind the pinned links, and the counters show every byte
/// of the transfer went through the programs.
pub fn restart_is_hitless(
    cluster: &mut Cluster,
    path: PathFn<'_>,
    n: usize,
    peer: usize,
) -> Result<()> {
    converged(cluster, path)?;
    let fast = on_fast_path(cluster, n);
    let before = cluster.kernel_state(n)?;
    let vxlan = cluster.spec().backend == "vxlan";
    let device = if vxlan {
        Some((
            ifindex(cluster, n, "flannel.1")?,
            link_mac(cluster.topology().node(n).ns(), "flannel.1")?,
        ))
    } else {
        None
    };
    let pins_before = if fast {
        Some(fast_path_state(cluster, n)?)
    } else {
        None
    };
    let lease_before = cluster.lease_key(n);
    let counters_before = fast_counters(cluster)?;
    let pinned_before = pinned_fast_counters(cluster)?;
    let traffic = Undisturbed::start(cluster, peer, n)?;
    thread::sleep(Duration::from_secs(1));

    let log_path = cluster.topology().node(n).agent_log();
    let status = cluster
        .agent_mut(n)
        .context("agent")?
        .stop(Duration::from_secs(10))?;
    ensure!(
        status.success(),
        "node{n}'s agent exited with {status} on SIGTERM"
    );
    let first_run_len = std::fs::read_to_string(&log_path)?.len();
    // Down for 2 s: 200 requests and 4 MiB cross the node meanwhile.
    let down = Instant::now();
    let pinned_at_stop = pinned_fast_counters(cluster)?;
    if let Some((ids, routes)) = &pins_before {
        let (ids_now, routes_now) =
            fast_path_state(cluster, n).context("the fast path's pins while the agent is down")?;
        ensure!(
            &ids_now == ids && &routes_now == routes,
            "the pins changed while the agent was down: {ids:?} -> {ids_now:?}"
        );
    }
    thread::sleep(Duration::from_secs(2).saturating_sub(down.elapsed()));
    // The programs went on forwarding without their agent: both directions of the traffic
    // were counted on the fast path while it was down (half of the 200 requests at least).
    let mut while_down = Expect::default();
    while_down.sent(cluster, path, (peer, n), DOWN_PACKETS, 0);
    while_down.sent(cluster, path, (n, peer), DOWN_PACKETS, 0);
    while_down
        .check(&pinned_at_stop, &pinned_fast_counters(cluster)?)
        .with_context(|| format!("while node{n}'s agent was down"))?;
    cluster.agent_mut(n).context("agent")?.restart()?;
    cluster.wait_ready(Duration::from_secs(30))?;
    // A few resyncs of the second run must not change anything either.
    thread::sleep(Duration::from_secs(2));
    let (stream, flow) = traffic
        .finish("across the restart", 400)
        .with_context(|| drops_since(cluster, &pinned_before))?;

    let after = cluster.kernel_state(n)?;
    ensure!(
        after == before,
        "kernel state changed:\nbefore\n{before}after\n{after}"
    );
    ensure!(
        after.duplicates().is_empty(),
        "duplicates: {:?}",
        after.duplicates()
    );
    if let Some((index, mac)) = &device {
        ensure!(
            ifindex(cluster, n, "flannel.1")? == *index
                && link_mac(cluster.topology().node(n).ns(), "flannel.1")? == *mac,
            "flannel.1 was recreated or its MAC changed"
        );
    }
    ensure!(cluster.lease_key(n) == lease_before, "the lease changed");
    let log = std::fs::read_to_string(&log_path)?;
    let second = &log[first_run_len.min(log.len())..];
    ensure!(
        second.contains("lease acquired") && second.contains("flannel is ready"),
        "the second run's log is incomplete:\n{second}"
    );
    let writes = count_lines(second, "dataplane reconciled");
    ensure!(
        writes == 0,
        "the restarted agent wrote to the dataplane {writes} times:\n{second}"
    );
    check_active_path(cluster, n)?;
    if let Some((ids, routes)) = &pins_before {
        let (ids_after, routes_after) = fast_path_state(cluster, n)?;
        ensure!(
            ids_after.maps == ids.maps,
            "maps were not adopted: {:?} -> {:?}",
            ids.maps,
            ids_after.maps
        );
        ensure!(
            ids_after.links == ids.links,
            "links were not adopted: {:?} -> {:?}",
            ids.links,
            ids_after.links
        );
        for (link, prog) in &ids.programs {
            ensure!(
                ids_after.programs.get(link).is_some_and(|p| p != prog),
                "the restarted agent did not swap its program in behind {link}: {:?} -> {:?}",
                ids.programs,
                ids_after.programs
            );
        }
        ensure!(
            &routes_after == routes,
            "route map changed:\n{}->\n{}",
            routes_text(routes),
            routes_text(&routes_after)
        );
        eprintln!(
            "node{n} adopted maps {:?} and links {:?}; programs {:?} -> {:?}",
            ids.maps, ids.links, ids.programs, ids_after.programs
        );
    }
    let counters_after = fast_counters(cluster)?;
    expect_undisturbed(cluster, path, (peer, n), &stream, &flow)
        .check(&counters_before, &counters_after)?;
    let leases = cluster.leases()?;
    let want_peer = expected_state(cluster, peer, &leases, |l| {
        path_to_lease(cluster, path, peer, l)
    });
    ensure!(
        cluster.kernel_state(peer)? == want_peer,
        "node{peer} lost entries"
    );
    Ok(())
}

/// A lease of a node that does not exist, in upstream's JSON for `backend`.
pub fn fake_lease(backend: &str, public_ip: Ipv4Addr, mac: &str) -> String {
    let data = match backend {
        "vxlan" => json!({"VNI": 1, "VtepMAC": mac}),
        _ => serde_json::Value::Null,
    };
    json!({
        "PublicIP": public_ip.to_string(),
        "PublicIPv6": null,
        "BackendType": backend,
        "BackendData": data,
    })
    .to_string()
}

/// etcd is killed for 30 s while [`Undisturbed`] traffic runs from node `a`'s pod to node
/// `b`'s: the agents stay up and healthy, nothing changes in the dataplane (kernel entries,
/// route maps), nothing is lost; on fast-path nodes the programs carried it all. After etcd is
/// back the agents see a new lease (the lease watch reconnected) and node `a` renews its own
/// (the keeper's watch reconnected: a short TTL put on the key is renewed to the full 24 h).
pub fn etcd_outage_is_ridden_out(
    cluster: &mut Cluster,
    path: PathFn<'_>,
    a: usize,
    b: usize,
) -> Result<()> {
    converged(cluster, path)?;
    let nodes = all_nodes(cluster);
    let before: Vec<_> = nodes
        .iter()
        .map(|&n| cluster.kernel_state(n))
        .collect::<Result<_>>()?;
    let maps_before: BTreeMap<usize, _> = nodes
        .iter()
        .filter(|&&n| on_fast_path(cluster, n))
        .map(|&n| {
            Ok((
                n,
                fastpath::routes(cluster.topology().node(n).bpf_pin_path())?,
            ))
        })
        .collect::<Result<_>>()?;
    let counters_before = fast_counters(cluster)?;
    let traffic = Undisturbed::start(cluster, a, b)?;

    cluster.stop_etcd();
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(30) {
        for &n in &nodes {
            cluster.agent_mut(n).context("agent")?.check_running()?;
            let ns = cluster.topology().node(n).ns();
            let code = status::http_status(ns, DEFAULT_HEALTHZ_PORT, "/healthz")?;
            ensure!(code == 200, "node{n} /healthz {code} during the outage");
        }
        thread::sleep(Duration::from_secs(1));
    }
    for (&n, state) in nodes.iter().zip(&before) {
        ensure!(
            &cluster.kernel_state(n)? == state,
            "node{n} changed its kernel entries during the outage"
        );
    }
    for (n, routes) in &maps_before {
        let now = fastpath::routes(cluster.topology().node(*n).bpf_pin_path())?;
        ensure!(
            &now == routes,
            "node{n} changed its route map during the outage"
        );
    }
    cluster.resume_etcd()?;
    eprintln!("etcd back after {:?}", outage.elapsed());

    // The lease watch reconnected: a lease added now is programmed everywhere.
    let backend = cluster.spec().backend.clone();
    let prefix = cluster.spec().etcd_prefix.clone();
    let fake_key = format!("{prefix}/subnets/10.244.250.0-24");
    let fake = fake_lease(
        &backend,
        Ipv4Addr::new(192, 168, 1, 250),
        "0e:00:00:00:fa:01",
    );
    cluster.kv().put_with_ttl(&fake_key, &fake, 600)?;
    let leases = cluster.leases()?;
    ensure!(leases.len() == nodes.len() + 1, "{leases:?}");
    converged_on(cluster, &nodes, &leases, path).context("after etcd came back")?;

    // The keeper's watch reconnected: it sees its key attached to a 70 s lease and renews it
    // (renew margin 1 min) with the full TTL.
    let key = cluster.lease_key(a).context("lease key")?;
    let value = cluster.kv().get(&key)?.context("the lease is gone")?;
    let short = cluster.kv().put_with_ttl(&key, &value, 70)?;
    let (id, ttl) = wait::until(
        Duration::from_secs(40),
        &format!("node{a} to renew its lease"),
        || match cluster.kv().lease_of(&key)? {
            Some((id, ttl)) if id != short && ttl > 3600 => Ok(Some((id, ttl))),
            other => bail!("lease of {key}: {other:?}"),
        },
    )?;
    eprintln!("node{a} renewed {key}: etcd lease {id:x}, TTL {ttl} s");
    let log = std::fs::read_to_string(cluster.topology().node(a).agent_log())?;
    ensure!(log.contains("renewed lease"), "no renewal in node{a}'s log");
    for &n in &nodes {
        let key = cluster.lease_key(n).context("lease key")?;
        ensure!(cluster.kv().get(&key)?.is_some(), "node{n}'s lease is gone");
        cluster.agent_mut(n).context("agent")?.check_running()?;
        let code = status::http_status(
            cluster.topology().node(n).ns(),
            DEFAULT_HEALTHZ_PORT,
            "/readyz",
        )?;
        ensure!(code == 200, "node{n} /readyz {code} after the outage");
    }
    // The stream ran through the outage: 30 s at 10 ms is 3000 requests, fewer when the
    // machine is busy (the sender paces by sleeping); what matters is that none was lost.
    let (stream, flow) = traffic.finish("across the outage", 2000)?;
    let counters_after = fast_counters(cluster)?;
    expect_undisturbed(cluster, path, (a, b), &stream, &flow)
        .check(&counters_before, &counters_after)?;
    // Leave the cluster as it was.
    cluster.kv().delete(&fake_key)?;
    let leases: Vec<_> = leases_by_node(cluster)?.into_values().collect();
    converged_on(cluster, &nodes, &leases, path)
}

/// Node `gone`'s lease is deleted: its agent exits 0 saying why, and every other node drops
/// everything it held for it (kernel entries; on the fast path its route map entry and its
/// tunnel peer entry).
pub fn node_leaves(cluster: &mut Cluster, path: PathFn<'_>, gone: usize) -> Result<()> {
    converged(cluster, path)?;
    let lease = leases_by_node(cluster)?
        .remove(&gone)
        .with_context(|| format!("node{gone} has a lease"))?;
    let public = lease.public_ip.context("public IP")?;
    let others: Vec<usize> = all_nodes(cluster)
        .into_iter()
        .filter(|&n| n != gone)
        .collect();
    let tunnel = matches!(path(others[0], gone), Path::Vxlan | Path::Ipip);
    for &n in &others {
        if on_fast_path(cluster, n) && tunnel {
            let peers = fastpath::tunnel_peers(cluster.topology().node(n).bpf_pin_path())?;
            ensure!(
                peers.contains_key(&public),
                "node{n}'s tunnel peers lack node{gone} ({public}) before it leaves: {peers:?}"
            );
        }
    }
    let key = cluster.lease_key(gone).context("lease key")?;
    ensure!(key == lease.key, "{key} vs {}", lease.key);
    ensure!(cluster.kv().delete(&key)?, "{key} existed");
    let agent = cluster.agent_mut(gone).context("agent")?;
    let status = wait::until(
        Duration::from_secs(20),
        &format!("node{gone}'s agent to exit"),
        || Ok(agent.exit_status()),
    )?;
    ensure!(status.success(), "node{gone}'s agent exited with {status}");
    let log = std::fs::read_to_string(agent.log_path())?;
    ensure!(
        log.contains("Lease has been revoked"),
        "node{gone}'s log does not say why it stopped"
    );
    let remaining = cluster.leases()?;
    ensure!(
        remaining.len() == others.len(),
        "leases left: {remaining:?}"
    );
    converged_on(cluster, &others, &remaining, path)?;
    for &n in &others {
        let got = cluster.kernel_state(n)?;
        ensure!(
            !got.mentions(&lease.subnet.to_string())
                && !got.mentions(&lease.subnet.network().to_string())
                && !got.mentions(lease.vtep_mac().unwrap_or("-")),
            "node{n} still holds entries of node{gone}:\n{got}"
        );
        if on_fast_path(cluster, n) {
            let pins = cluster.topology().node(n).bpf_pin_path();
            let routes = fastpath::routes(pins)?;
            ensure!(
                !routes.contains_key(&lease.subnet),
                "node{n}'s route map still holds {}",
                lease.subnet
            );
            let peers = fastpath::tunnel_peers(pins)?;
            ensure!(
                !peers.contains_key(&public),
                "node{n}'s tunnel peers still hold node{gone} ({public}): {peers:?}"
            );
        }
    }
    Ok(())
}

/// How long an agent gets to follow its external interface to a new index: well within the
/// 30 s `--resync-interval` the lab's agents run with, so that an agent that waits for the
/// periodic resync fails.
const FOLLOW: Duration = Duration::from_secs(10);

/// What node `n` holds once it has converged on the cluster's leases: its kernel entries
/// and, on the fast path, its route map.
struct Entries {
    n: usize,
    kernel: status::KernelState,
    routes: Option<BTreeMap<ipnet::Ipv4Net, fastpath::Route>>,
}

impl Entries {
    /// Waits until every node has [`converged`]; what node `n` then holds.
    fn converged(cluster: &Cluster, path: PathFn<'_>, n: usize) -> Result<Entries> {
        converged(cluster, path)?;
        let leases: Vec<_> = leases_by_node(cluster)?.into_values().collect();
        let path_to = |l: &LeaseRecord| path_to_lease(cluster, path, n, l);
        Ok(Entries {
            n,
            kernel: expected_state(cluster, n, &leases, path_to),
            routes: on_fast_path(cluster, n).then(|| expected_routes(cluster, n, &leases, path_to)),
        })
    }

    /// Node `n` holds them all again; an error saying what differs otherwise.
    fn held(&self, cluster: &Cluster) -> Result<()> {
        let (n, want) = (self.n, &self.kernel);
        let got = cluster.kernel_state(n)?;
        ensure!(&got == want, "node{n} holds\n{got}but should hold\n{want}");
        if let Some(routes) = &self.routes {
            let map = fastpath::routes(cluster.topology().node(n).bpf_pin_path())?;
            ensure!(
                &map == routes,
                "node{n}'s route map holds\n{}but should hold\n{}",
                routes_text(&map),
                routes_text(routes)
            );
        }
        Ok(())
    }

    /// Waits up to [`FOLLOW`] until node `n` holds them all again and `also` holds (`what`
    /// names the wait), then checks that every pod reaches every pod through `path`, with
    /// transfers both ways between node `n` and another node.
    fn back(
        &self,
        cluster: &Cluster,
        path: PathFn<'_>,
        what: &str,
        mut also: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        wait::until_ok(FOLLOW, &format!("node{}: {what}", self.n), || {
            self.held(cluster)?;
            also()
        })?;
        reachable_across(cluster, path, self.n)
    }
}

/// [`reachable_everywhere`] through `path`, with transfers both ways between node `n` and
/// another node.
fn reachable_across(cluster: &Cluster, path: PathFn<'_>, n: usize) -> Result<()> {
    let other = all_nodes(cluster)
        .into_iter()
        .find(|&m| m != n)
        .context("a second node")?;
    reachable_everywhere(cluster, path, &[(n, other), (other, n)])
}

/// A check that disturbs node `n` of a running cluster and that it recovers.
pub type Scenario = fn(&mut Cluster, PathFn<'_>, usize) -> Result<()>;

/// `scenario` on node1 of a two-node L2 cluster with a pod on each node, every agent on
/// `dataplane`: once with host-gw, once with VXLAN (`what` names the clusters).
pub fn on_host_gw_and_vxlan(dataplane: Dataplane, what: &str, scenario: Scenario) {
    for backend in ["host-gw", "vxlan"] {
        let path = Path::of_backend(backend);
        let spec = spec_on(dataplane, 2, Underlay::L2, backend, 1);
        let name = named(dataplane, &format!("{backend}/l2, {what}"));
        with_cluster(&name, spec, |c| scenario(c, &move |_, _| path, 1));
    }
}

/// Node `n`'s `eth0` loses the address the agent started with and gets another (a new DHCP
/// lease): within [`FOLLOW`] the agent says so once, naming the address, and counts it in
/// `flannel_external_addresses_missing`; once the address is back it says that too, the
/// gauge is 0 again, node `n` holds every entry again (host-gw routes through the interface
/// came back with the address) and every pod reaches every pod through `path`.
pub fn an_address_change_is_reported(
    cluster: &mut Cluster,
    path: PathFn<'_>,
    n: usize,
) -> Result<()> {
    let entries = Entries::converged(cluster, path, n)?;
    let node = cluster.topology().node(n);
    let old = node.addr_net();
    let other = format!(
        "{}/24",
        std::net::Ipv4Addr::from(u32::from(old.addr()) + 100)
    );
    let gateway = flannel_tests::topology::gateway_addr(node.segment()).to_string();
    let missing = |want: f64| -> Result<()> {
        let got = cluster.metric(n, "flannel_external_addresses_missing")?;
        ensure!(
            got == Some(want),
            "flannel_external_addresses_missing = {got:?}"
        );
        Ok(())
    };
    let said = |text: &str| -> Result<usize> {
        Ok(count_lines(
            &std::fs::read_to_string(node.agent_log())?,
            text,
        ))
    };
    let warning = format!("no longer has {}", old.addr());
    let again = format!("has {} again", old.addr());
    node.run(&["ip", "addr", "del", &old.to_string(), "dev", "eth0"])?;
    node.run(&["ip", "addr", "add", &other, "dev", "eth0"])?;
    wait::until_ok(FOLLOW, &format!("node{n} reporting {old} gone"), || {
        missing(1.0)
    })?;
    ensure!(
        said(&warning)? == 1,
        "node{n}'s agent did not say once that eth0 {warning}"
    );
    node.run(&["ip", "addr", "del", &other, "dev", "eth0"])?;
    node.run(&["ip", "addr", "add", &old.to_string(), "dev", "eth0"])?;
    node.run(&["ip", "route", "add", "default", "via", &gateway])?;
    entries.back(cluster, path, &format!("{old} again"), || missing(0.0))?;
    ensure!(
        said(&again)? == 1 && said(&warning)? == 1,
        "node{n}'s agent did not say once that eth0 {again}"
    );
    Ok(())
}

/// What is done by hand to every kernel entry of node `n`'s agent.
#[derive(Debug, Clone, Copy)]
enum HandEdit {
    /// `ip route flush proto 165`, `ip neigh del`, `bridge fdb del`.
    Delete,
    /// `ip route replace` with a blackhole, `ip neigh replace` and `bridge fdb replace`
    /// pointing elsewhere.
    PointElsewhere,
}

/// The commands that make `edit` to `want`'s entries.
fn hand_edits(want: &status::KernelState, edit: HandEdit) -> Result<Vec<Vec<String>>> {
    let cmd = |words: &[&str]| words.iter().map(|w| (*w).to_owned()).collect::<Vec<_>>();
    let mut out = Vec::new();
    match edit {
        HandEdit::Delete => out.push(cmd(&["ip", "route", "flush", "proto", "165"])),
        HandEdit::PointElsewhere => {
            for line in &want.routes {
                // `<dst> ...`
                let dst = line
                    .split_whitespace()
                    .next()
                    .context("an empty route line")?;
                out.push(cmd(&["ip", "route", "replace", "blackhole", dst]));
            }
        }
    }
    for line in &want.neighbours {
        // `<ip> lladdr <mac> dev <dev>`
        let w: Vec<&str> = line.split_whitespace().collect();
        out.push(match edit {
            HandEdit::Delete => cmd(&["ip", "neigh", "del", w[0], "dev", w[4]]),
            HandEdit::PointElsewhere => cmd(&[
                "ip",
                "neigh",
                "replace",
                w[0],
                "lladdr",
                "02:00:00:00:00:99",
                "dev",
                w[4],
            ]),
        });
    }
    for line in &want.fdb {
        // `<mac> dev <dev> dst <ip>`
        let w: Vec<&str> = line.split_whitespace().collect();
        let (verb, dst) = match edit {
            HandEdit::Delete => ("del", w[4]),
            HandEdit::PointElsewhere => ("replace", "192.0.2.99"),
        };
        out.push(cmd(&["bridge", "fdb", verb, w[0], "dev", w[2], "dst", dst]));
    }
    Ok(out)
}

/// Every kernel entry of node `n`'s agent edited by hand (`edit`): within [`FOLLOW`], well
/// before the next resync, node `n` holds them all as the agent wrote them, and every pod
/// reaches every pod through `path`.
fn edited_by_hand_come_back(
    cluster: &mut Cluster,
    path: PathFn<'_>,
    n: usize,
    edit: HandEdit,
) -> Result<()> {
    let entries = Entries::converged(cluster, path, n)?;
    ensure!(
        !entries.kernel.routes.is_empty(),
        "node{n} has no route to edit"
    );
    let node = cluster.topology().node(n);
    for command in hand_edits(&entries.kernel, edit)? {
        let words: Vec<&str> = command.iter().map(String::as_str).collect();
        node.run(&words)?;
    }
    entries.back(
        cluster,
        path,
        &format!("entries back after {edit:?}"),
        || Ok(()),
    )
}

/// Every route, neighbour and FDB entry of node `n`'s agent deleted by hand (`ip route flush
/// proto 165`, `ip neigh del`, `bridge fdb del`): within [`FOLLOW`], well before the next
/// resync, node `n` holds them all again, and every pod reaches every pod through `path`.
pub fn entries_deleted_by_hand_come_back(
    cluster: &mut Cluster,
    path: PathFn<'_>,
    n: usize,
) -> Result<()> {
    edited_by_hand_come_back(cluster, path, n, HandEdit::Delete)
}

/// Node `n`'s routes, neighbours and FDB entries changed by hand where they are (`ip route
/// replace` with a blackhole, `ip neigh replace` and `bridge fdb replace` pointing
/// elsewhere): the kernel tells of each change, and within [`FOLLOW`] every entry is as the
/// agent wrote it again, and every pod reaches every pod through `path`.
pub fn entries_changed_by_hand_come_back(
    cluster: &mut Cluster,
    path: PathFn<'_>,
    n: usize,
) -> Result<()> {
    edited_by_hand_come_back(cluster, path, n, HandEdit::PointElsewhere)
}

/// On the fast path, node `n`'s route map entries deleted, then changed, behind the agent's
/// back (as `bpftool map delete` and `update` would): no notification tells of either, yet
/// within [`FOLLOW`] each time the map holds what the agent wrote again (its map check), where
/// before it waited for the next resync (30 s here), and every pod reaches every pod.
pub fn map_entries_changed_by_hand_come_back(
    cluster: &mut Cluster,
    path: PathFn<'_>,
    n: usize,
) -> Result<()> {
    let entries = Entries::converged(cluster, path, n)?;
    let want = entries
        .routes
        .as_ref()
        .with_context(|| format!("node{n} is not on the fast path"))?;
    let (&subnet, _) = want.iter().next().context("no route map entry to change")?;
    let pins = cluster.topology().node(n).bpf_pin_path().to_owned();
    let mut map = fastpath::RouteMap::open(&pins)?;
    map.remove(subnet)?;
    entries.back(cluster, path, "the deleted entry back", || Ok(()))?;
    // A check that finds the maps as written ends the episode (one warning each).
    thread::sleep(flannel_agent::bpf::drift::CHECK_PERIOD + Duration::from_secs(1));
    map.repoint(subnet, Ipv4Addr::new(192, 0, 2, 99))?;
    entries.back(cluster, path, "the changed entry back", || Ok(()))?;
    let log = std::fs::read_to_string(cluster.topology().node(n).agent_log())?;
    let warned = count_lines(&log, "map entries were changed by something else");
    ensure!(
        warned == 2,
        "node{n}'s agent warned {warned} times, not once per change"
    );
    Ok(())
}

/// Node `n`'s backend device `device` (`flannel.1`) set down by hand: the kernel drops the
/// routes and neighbours through it. Within [`FOLLOW`] the agent has set it up again and
/// node `n` holds every entry again, and every pod reaches every pod through `path`.
pub fn device_set_down_comes_back(
    cluster: &mut Cluster,
    path: PathFn<'_>,
    n: usize,
    device: &str,
) -> Result<()> {
    let entries = Entries::converged(cluster, path, n)?;
    let node = cluster.topology().node(n);
    node.run(&["ip", "link", "set", device, "down"])?;
    entries.back(cluster, path, &format!("{device} up again"), || {
        let link: serde_json::Value =
            serde_json::from_str(&node.run(&["ip", "-j", "link", "show", device])?)?;
        let flags = &link[0]["flags"];
        ensure!(
            flags
                .as_array()
                .is_some_and(|f| f.iter().any(|x| x == "UP")),
            "{device} flags {flags}"
        );
        Ok(())
    })
}

/// Node `n`'s `eth0` set down and up again under its running agent (`ifdown`/`ifup`, a
/// network manager restarting it): the kernel flushes every route through it while it is
/// down, the agent's included, and puts back only its own prefix routes. Within [`FOLLOW`]
/// of it coming up node `n` holds every kernel entry again (a fast-path node its route map
/// entries too), and every pod reaches every pod through `path`, both ways across node `n`.
pub fn external_interface_down_and_up(
    cluster: &mut Cluster,
    path: PathFn<'_>,
    n: usize,
) -> Result<()> {
    let entries = Entries::converged(cluster, path, n)?;
    let node = cluster.topology().node(n);
    node.run(&["ip", "link", "set", "eth0", "down"])?;
    // Long enough for the agent to look while it is down.
    thread::sleep(Duration::from_millis(500));
    node.run(&["ip", "link", "set", "eth0", "up"])?;
    entries.back(cluster, path, "entries after eth0 came up", || Ok(()))
}

/// Node `n`'s `eth0` deleted and created again under its running agent (a network manager
/// re-creating a bond or VLAN): a new index, and its address a moment after the link (the
/// agent's first look finds the host-gw peers unreachable). Within [`FOLLOW`] node `n`
/// holds every entry again, through the new interface; a fast-path node also has its
/// programs attached to the new `eth0`, its configuration pointing at it, none of its links
/// left pinned for the old one, and logged the move once. Then every pod reaches every pod
/// through `path` (the fast path's counters growing), both ways across node `n`.
pub fn external_interface_recreated(
    cluster: &mut Cluster,
    path: PathFn<'_>,
    n: usize,
) -> Result<()> {
    let entries = Entries::converged(cluster, path, n)?;
    let old = ifindex(cluster, n, "eth0")?;
    cluster.topology().recreate_uplink(n)?;
    let new = ifindex(cluster, n, "eth0")?;
    ensure!(new != old, "the re-created eth0 kept index {old}");
    let node = cluster.topology().node(n);
    let pins = node.bpf_pin_path();
    let fast = entries.routes.is_some();
    entries.back(cluster, path, &format!("following eth0 to {new}"), || {
        if !fast {
            return Ok(());
        }
        let mut programs = fastpath::tcx_programs(node.ns(), "eth0")?;
        programs.sort();
        ensure!(
            programs == ["tc_from_netdev", "tc_to_netdev"],
            "the new eth0 ({new}) runs {programs:?}"
        );
        let (configured, _) = fastpath::config_ext_ifindex(pins)?;
        ensure!(
            u64::from(configured) == new,
            "the fast path is configured for interface {configured}, eth0 is {new}"
        );
        let stale: Vec<String> = fastpath::pin_ids(pins)?
            .links
            .into_keys()
            .filter(|l| l.ends_with(&format!("-{old}")))
            .collect();
        ensure!(
            stale.is_empty(),
            "links for the old eth0 still pinned: {stale:?}"
        );
        Ok(())
    })?;
    if fast {
        let agent = cluster.agent_mut(n).context("agent")?;
        let log = std::fs::read_to_string(agent.log_path())?;
        let moves = count_lines(&log, "fast path following it");
        ensure!(
            moves == 1,
            "node{n}'s agent logged {moves} moves of the fast path, not 1:\n{}",
            agent.log_tail(30)
        );
    }
    Ok(())
}

/// The connectivity test of `backend` over `underlay` on `dataplane`, three nodes with two
/// CNI pods each:
///
/// * host-gw over a routed (L3) underlay: [`host_gw_reports_unreachable_peers`];
/// * vxlan over the mixed underlay: with DirectRouting, [`direct_routing_on_mixed_underlay`];
/// * anything else: [`reachable_everywhere`] with the backend's path between all nodes and
///   transfers node1 → node3 and node3 → node2.
pub fn connectivity(dataplane: Dataplane, backend: &str, underlay: Underlay) {
    let mut spec = spec_on(dataplane, 3, underlay, backend, 2);
    let name = named(dataplane, &format!("{backend}/{underlay}"));
    match (backend, underlay) {
        ("host-gw", Underlay::L3) => {
            with_cluster(&name, spec, host_gw_reports_unreachable_peers);
        }
        ("vxlan", Underlay::Mixed) => {
            spec.backend_options = json!({"DirectRouting": true});
            with_cluster(&name, spec, direct_routing_on_mixed_underlay);
        }
        _ => {
            let path = Path::of_backend(backend);
            with_cluster(&name, spec, |c| {
                if underlay == Underlay::L3 {
                    ensure!(
                        !c.topology().l2_adjacent(1, 2)?,
                        "the L3 underlay is routed"
                    );
                }
                reachable_everywhere(c, &|_, _| path, &[(1, 3), (3, 2)])
            });
        }
    }
}

/// host-gw needs one L2 segment: over a routed underlay every peer is reported (metric and
/// one log line per peer) and nothing is programmed for it (no kernel route, no route map
/// entry), no black-hole either, so the node's default route still applies and pods on one
/// node still talk.
pub fn host_gw_reports_unreachable_peers(c: &mut Cluster) -> Result<()> {
    let by_node = leases_by_node(c)?;
    converged(c, &|_, _| Path::None)?;
    for n in all_nodes(c) {
        wait::until_ok(
            CONVERGE,
            &format!("node{n} to report 2 unreachable peers"),
            || match c.metric(n, "flannel_peers_unreachable")? {
                Some(2.0) => Ok(()),
                other => bail!("flannel_peers_unreachable = {other:?}"),
            },
        )?;
        let node = c.topology().node(n);
        for (m, lease) in &by_node {
            if *m == n {
                continue;
            }
            // No route of any type: the peer's pods go the default way (to the hub).
            let peer_pod = Ipv4Addr::from(u32::from(lease.subnet.network()) + 2);
            let route = node.route_get(IpAddr::V4(peer_pod))?;
            ensure!(
                route.gateway == Some(IpAddr::V4(node.gateway()))
                    && route.dev.as_deref() == Some("eth0"),
                "node{n} routes {peer_pod} {route:?}, not via its default gateway"
            );
            let log = std::fs::read_to_string(node.agent_log())?;
            let needle = format!("no route to {} of lease", lease.subnet);
            let times = count_lines(&log, &needle);
            ensure!(
                times == 1,
                "node{n} logged {needle:?} {times} times (want once)"
            );
        }
    }
    for n in all_nodes(c) {
        let pods = c.topology().pods_on(n);
        probe::tcp_reaches(pods[0].ns(), pods[1].ns(), IpAddr::V4(pods[1].ip()), PROBE)
            .with_context(|| format!("pods on node{n}"))?;
    }
    Ok(())
}

/// DirectRouting on a mixed underlay: nodes 1 and 2 share a segment and route to each
/// other directly; node 3 is behind the hub and reached through VXLAN (and reaches both
/// through VXLAN).
pub fn direct_routing_on_mixed_underlay(c: &mut Cluster) -> Result<()> {
    ensure!(
        c.topology().l2_adjacent(1, 2)?,
        "nodes 1 and 2 share a segment"
    );
    ensure!(!c.topology().l2_adjacent(1, 3)?, "node 3 is routed");
    reachable_everywhere(
        c,
        &|from, to| {
            if from <= 2 && to <= 2 {
                Path::Direct
            } else {
                Path::Vxlan
            }
        },
        &[(1, 3), (3, 2), (1, 2), (2, 1)],
    )
}

/// A Service the way kube-proxy implements it: a DNAT in nat PREROUTING from a ClusterIP to a
/// pod on another node. The pod's packets to the ClusterIP meet that rule on the pod bridge
/// (br_netfilter, on here as in every kubeadm cluster) and must come back un-DNATed, so the
/// flow has to stay with conntrack in both directions: every connection gets its echo.
pub fn service_dnat_to_a_remote_pod(dataplane: Dataplane, backend: &str) {
    let spec = spec_on(dataplane, 2, Underlay::L2, backend, 1);
    with_cluster(
        &named(dataplane, &format!("{backend} service DNAT")),
        spec,
        |c| {
            let topo = c.topology();
            let (client, server) = (topo.pods_on(1)[0], topo.pods_on(2)[0]);
            let responder = probe::Responder::start(server.ns(), IpAddr::V4(server.ip()), 0)?;
            let backend_addr = responder.addr();
            let target = std::net::SocketAddr::new("10.96.0.10".parse()?, 80);
            topo.node(1).dnat_tcp(target, backend_addr)?;
            for i in 0..5 {
                probe::tcp_probe(client.ns(), target, PROBE)
                    .with_context(|| format!("connection {i} to the Service {target}"))?;
            }
            Ok(())
        },
    );
}
