//! IPv6 and dual stack at the agent level, on the kernel path: simulated clusters with an
//! IPv6 underlay, real agents, pods created through the CNI plugin (the delegate gets both
//! ranges).
//!
//! * `vxlan_dual_stack_across_nodes` (etcd, nodes behind a router): subnet.env's IPv6 keys,
//!   `&v6` lease keys with `PublicIPv6` and `BackendV6Data`, `flannel-v6.1` (MTU − 70,
//!   `/128` address, local = the node's IPv6), IPv6 routes/neighbours/FDB as upstream, pods
//!   with both families, IPv4 and IPv6 pod-to-pod across nodes (the IPv6 pod traffic rides
//!   VXLAN over the IPv6 underlay), and ip6tables masquerade/forward rules in upstream's
//!   golden shape.
//! * `host_gw_dual_stack_across_nodes` (etcd, one L2 segment): IPv6 routes via the peers'
//!   IPv6 addresses, traffic in both families.
//! * `ipv6_only_is_refused_in_etcd_mode`: `EnableIPv4: false` with etcd exits with a clear
//!   error (upstream degenerates to one `0.0.0.0/0` lease; see `flannel_agent::alloc`).
//! * `ipv6_only_in_kube_mode`: the same network through a (fake) Kubernetes API server:
//!   IPv6-only node annotations, subnet.env without IPv4 keys, IPv6-only pods, vxlan and
//!   host-gw traffic across nodes.
//!
//! Run: `cargo test -p flannel-tests --test dualstack -- --nocapture` (as root; skipped
//! otherwise).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv6Addr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use flannel_agent::{
    alloc::PreviousSubnets,
    lease::{LeaseAttrs, SubnetKey},
    subnet::etcd::{EtcdOptions, EtcdSubnetManager},
};
use flannel_tests::{
    check,
    etcd::Etcd,
    lab::{
        agent::{Agent, AgentSpec, Dataplane},
        bins,
        capture::Capture,
        cluster::{Cluster, ClusterSpec},
        kube,
        kv::Kv,
        lease, probe, status, wait,
    },
    netns::NetNs,
    packet::{self, ParsedL3, ParsedL4},
    require_root,
    topology::{Node, Pod, SubnetEnv, Topology, TopologySpec, Underlay},
};
use ipnet::{Ipv4Net, Ipv6Net};
use serde_json::{Value, json};

const NETWORK_V6: &str = "fd00:244::/48";

fn json(ns: &NetNs, argv: &[&str]) -> Result<Value> {
    let out = ns.run(argv)?;
    serde_json::from_str(&out).with_context(|| format!("{argv:?} printed {out:?}"))
}

/// Three dual-stack nodes with one pod each, `--ip-masq`.
fn dual_stack_spec(backend: &str, underlay: Underlay) -> Result<ClusterSpec> {
    let topology = TopologySpec::new(3, underlay)
        .ipv6(true)
        .cni_plugin(bins::test_cni_plugin()?);
    let mut spec = ClusterSpec::new(topology, backend, bins::test_agent()?);
    spec.ipv6_network = Some(NETWORK_V6.parse()?);
    spec.pods_per_node = 1;
    spec.ip_masq = true;
    Ok(spec)
}

fn dual_stack_cluster(backend: &str, underlay: Underlay) -> Result<Cluster> {
    Cluster::up(
        dual_stack_spec(backend, underlay)?,
        &|line| eprintln!("{line}"),
        &|| false,
    )
}

/// The IPv4 pod matrix, then every pod to every pod of another node in both families.
fn pods_talk_both_families(cluster: &Cluster) -> Result<()> {
    cluster.matrix(Duration::from_secs(5))?.check()?;
    let pods: Vec<&Pod> = cluster.topology().pods().iter().collect();
    probe::pods_talk(&pods, true)
}

/// Upstream's masquerade rule lines for network `n` and lease `p`, with `multicast`.
fn masq_golden(n: &str, p: &str, multicast: &str, random_fully: bool) -> BTreeSet<String> {
    let rf = if random_fully { " --random-fully" } else { "" };
    let c = r#"-m comment --comment "flanneld masq""#;
    [
        format!("-A POSTROUTING {c} -j FLANNEL-POSTRTG"),
        "-N FLANNEL-POSTRTG".to_owned(),
        format!("-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 {c} -j RETURN"),
        format!("-A FLANNEL-POSTRTG -s {p} -d {n} {c} -j RETURN"),
        format!("-A FLANNEL-POSTRTG -s {n} -d {p} {c} -j RETURN"),
        format!("-A FLANNEL-POSTRTG ! -s {n} -d {p} {c} -j RETURN"),
        format!("-A FLANNEL-POSTRTG -s {n} ! -d {multicast} {c} -j MASQUERADE{rf}"),
        format!("-A FLANNEL-POSTRTG ! -s {n} -d {n} {c} -j MASQUERADE{rf}"),
    ]
    .into_iter()
    .collect()
}

/// The nat lines mentioning FLANNEL, as upstream's e2e reads them.
fn flannel_nat_lines(ns: &NetNs, bin: &str) -> Result<BTreeSet<String>> {
    Ok(status::line_set(ns, &[bin, "-t", "nat", "-S"])?
        .into_iter()
        .filter(|l| l.contains("FLANNEL"))
        .collect())
}

/// Checks the IPv6 masquerade and forward rules of `node` against upstream's golden shape
/// (random-fully as in the node's IPv4 rules, when it has any).
fn check_ip6_rules(node: &Node, lease6: Ipv6Net, v4_reference: bool) -> Result<()> {
    let random_fully = if v4_reference {
        flannel_nat_lines(node.ns(), "iptables")?
            .iter()
            .any(|l| l.contains("--random-fully"))
    } else {
        true
    };
    let masq = flannel_nat_lines(node.ns(), "ip6tables")?;
    let want = masq_golden(NETWORK_V6, &lease6.to_string(), "ff00::/8", random_fully);
    ensure!(
        masq == want,
        "{}: ip6tables nat rules\n got {masq:#?}\nwant {want:#?}",
        node.name()
    );
    let fwd: BTreeSet<String> = status::line_set(node.ns(), &["ip6tables", "-S"])?
        .into_iter()
        .filter(|l| l.contains("FLANNEL"))
        .collect();
    let c = r#"-m comment --comment "flanneld forward""#;
    let want_fwd: BTreeSet<String> = [
        format!("-A FORWARD {c} -j FLANNEL-FWD"),
        "-N FLANNEL-FWD".to_owned(),
        format!("-A FLANNEL-FWD -s {NETWORK_V6} {c} -j ACCEPT"),
        format!("-A FLANNEL-FWD -d {NETWORK_V6} {c} -j ACCEPT"),
    ]
    .into_iter()
    .collect();
    ensure!(
        fwd == want_fwd,
        "{}: ip6tables forward rules {fwd:#?}",
        node.name()
    );
    Ok(())
}

/// The `(address, prefix)` pairs of a link's global addresses of one family.
fn addresses(ns: &NetNs, family: &str, dev: &str) -> Result<Vec<String>> {
    let v = json(ns, &["ip", "-j", family, "addr", "show", "dev", dev])?;
    Ok(v[0]["addr_info"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| a["scope"] != "link")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or("?"), a["prefixlen"]))
        .collect())
}

fn v6_network_addr(n: Ipv6Net) -> String {
    n.network().to_string()
}

// ---------------------------------------------------------------------------------------

#[test]
fn vxlan_dual_stack_across_nodes() {
    require_root!();
    check(vxlan_dual_stack());
}

fn vxlan_dual_stack() -> Result<()> {
    let cluster = dual_stack_cluster("vxlan", Underlay::L3)?;
    let topo = cluster.topology();
    let leases = cluster.leases()?;
    ensure!(leases.len() == 3, "{leases:?}");
    let network6: Ipv6Net = NETWORK_V6.parse()?;

    // Per node: subnet.env, its lease in etcd, the devices.
    let mut v6_leases = Vec::new();
    for (i, node) in topo.nodes().iter().enumerate() {
        let env = &cluster.subnet_envs()[i];
        let subnet6 = env.ipv6_subnet.context("no FLANNEL_IPV6_SUBNET")?.trunc();
        ensure!(
            env.ipv6_network == Some(network6)
                && network6.contains(&subnet6)
                && subnet6.prefix_len() == 64
                && env.ipv6_subnet.map(|s| s.addr()) == Some(first_host(subnet6)),
            "{}: subnet.env {env:?}",
            node.name()
        );
        // Both tunnels fit the pods' MTU: vxlan over IPv6 costs 70 bytes.
        ensure!(env.mtu == Some(1430), "FLANNEL_MTU {:?}", env.mtu);
        let v4 = env.lease().context("no FLANNEL_SUBNET")?;
        let lease = leases
            .iter()
            .find(|l| l.subnet == v4)
            .context("the node's lease")?;
        ensure!(
            lease.key.ends_with(&format!(
                "/subnets/{}-24&{}-64",
                v4.network(),
                v6_network_addr(subnet6)
            )),
            "lease key {}",
            lease.key
        );
        ensure!(
            lease.subnet6 == Some(subnet6)
                && lease.public_ipv6.as_deref() == node.addr6().map(|a| a.to_string()).as_deref(),
            "{lease:?}"
        );
        v6_leases.push((subnet6, node.addr6().context("node without IPv6")?));
        let raw = cluster.kv().get(&lease.key)?.context("lease value")?;
        let value: Value = serde_json::from_str(&raw)?;
        let v6_mac =
            json(node.ns(), &["ip", "-j", "link", "show", "flannel-v6.1"])?[0]["address"].clone();
        ensure!(
            value["BackendType"] == "vxlan"
                && value["BackendV6Data"]["VtepMAC"] == v6_mac
                && value["BackendV6Data"]["VNI"] == 1,
            "lease value {raw}"
        );

        let link = json(
            node.ns(),
            &["ip", "-j", "-d", "link", "show", "flannel-v6.1"],
        )?;
        let link = &link[0];
        let data = &link["linkinfo"]["info_data"];
        ensure!(
            link["mtu"] == 1430
                && data["id"] == 1
                && data["local6"].as_str() == node.addr6().map(|a| a.to_string()).as_deref(),
            "{}: flannel-v6.1 {link}",
            node.name()
        );
        ensure!(
            addresses(node.ns(), "-6", "flannel-v6.1")?
                == [format!("{}/128", v6_network_addr(subnet6))],
            "{}: flannel-v6.1 addresses",
            node.name()
        );
        let v4_link = json(node.ns(), &["ip", "-j", "link", "show", "flannel.1"])?;
        ensure!(v4_link[0]["mtu"] == 1450, "flannel.1 {v4_link}");
        check_ip6_rules(node, subnet6, true)?;
    }

    // Node 1's IPv6 routes, neighbours and FDB entries: upstream's, one per peer.
    let n1 = topo.node(1);
    let mac_of = |node: &Node| -> Result<String> {
        let link = json(node.ns(), &["ip", "-j", "link", "show", "flannel-v6.1"])?;
        link[0]["address"]
            .as_str()
            .map(str::to_owned)
            .context("flannel-v6.1 has no MAC")
    };
    let mut want_routes = BTreeSet::new();
    let mut want_neigh = BTreeSet::new();
    let mut want_fdb = BTreeSet::new();
    for (i, node) in topo.nodes().iter().enumerate().skip(1) {
        let (subnet6, addr6) = v6_leases[i];
        let gw = v6_network_addr(subnet6);
        let mac = mac_of(node)?;
        want_routes.insert(format!("{subnet6} via {gw} dev flannel-v6.1 onlink"));
        want_neigh.insert(format!("{gw} lladdr {mac} PERMANENT proto 165"));
        want_fdb.insert(format!("{mac} dst {addr6} self permanent"));
    }
    status::expect_agent_routes(n1.ns(), "-6", &want_routes)?;
    wait::until_ok(status::CONVERGE, "node1's neighbours and FDB", || {
        let neigh = status::line_set(
            n1.ns(),
            &[
                "ip",
                "-6",
                "neigh",
                "show",
                "dev",
                "flannel-v6.1",
                "nud",
                "permanent",
            ],
        )?;
        ensure!(
            neigh == want_neigh,
            "node1 IPv6 neighbours {neigh:#?}, want {want_neigh:#?}"
        );
        let fdb: BTreeSet<String> =
            status::line_set(n1.ns(), &["bridge", "fdb", "show", "dev", "flannel-v6.1"])?
                .into_iter()
                .filter(|l| l.contains(" dst "))
                .collect();
        ensure!(fdb == want_fdb, "node1 FDB {fdb:#?}, want {want_fdb:#?}");
        Ok(())
    })?;

    // Pods got both families from the CNI plugin, and talk across nodes in both.
    let pods: Vec<&Pod> = topo.pods().iter().collect();
    for p in &pods {
        let env = &cluster.subnet_envs()[p.node() - 1];
        let addr = p.ip6_required()?;
        ensure!(
            env.ipv6_subnet.is_some_and(|s| s.trunc().contains(&addr)),
            "pod {} IPv6 {:?} outside its node's subnet",
            p.name(),
            p.ip6()
        );
    }
    // The CNI plugin handed the bridge delegate both ranges and both networks.
    let p = pods[0];
    let node = topo.node(p.node());
    let id = p.container_id().context("CNI pod")?;
    let delegate: Value =
        serde_json::from_str(&std::fs::read_to_string(node.cni_data_dir().join(id))?)?;
    let env = &cluster.subnet_envs()[p.node() - 1];
    let (v4, v6) = (
        env.lease().context("v4")?,
        env.ipv6_subnet.context("v6")?.trunc(),
    );
    ensure!(
        delegate["ipam"]["ranges"]
            == json!([[{"subnet": v4.to_string()}], [{"subnet": v6.to_string()}]])
            && delegate["ipam"]["routes"]
                == json!([{"dst": cluster.spec().network.to_string()}, {"dst": NETWORK_V6}]),
        "delegate {delegate}"
    );

    pods_talk_both_families(&cluster)?;

    // IPv6 pod traffic to node3 rides VXLAN over the IPv6 underlay.
    let p1 = topo.pods_on(1)[0];
    let p3 = topo.pods_on(3)[0];
    let n3_addr6 = topo.node(3).addr6().context("node3 IPv6")?;
    let capture = Capture::start(n1.ns(), "eth0")?;
    probe::tcp_reaches(
        p1.ns(),
        p3.ns(),
        IpAddr::V6(p3.ip6_required()?),
        Duration::from_secs(5),
    )?;
    let (outer_dst, inner_dst) = capture.find(Duration::from_secs(3), |frame| {
        let f = packet::parse(frame).ok()?;
        let ParsedL3::Ipv6(outer) = f.l3 else {
            return None;
        };
        let ParsedL4::Udp {
            dst_port: 8472,
            payload,
            ..
        } = outer.l4
        else {
            return None;
        };
        let (_, inner) = packet::parse_vxlan(&payload).ok()?;
        match packet::parse(inner).ok()?.l3 {
            ParsedL3::Ipv6(ip) => Some((outer.dst, ip.dst)),
            _ => None,
        }
    })?;
    ensure!(
        outer_dst == n3_addr6 && inner_dst == p3.ip6_required()?,
        "VXLAN to {outer_dst} carrying {inner_dst}"
    );
    Ok(())
}

fn first_host(n: Ipv6Net) -> Ipv6Addr {
    Ipv6Addr::from(u128::from(n.network()) + 1)
}

// ---------------------------------------------------------------------------------------

/// vxlan with `DirectRouting` in dual stack: nodes 1 and 2 share a segment, node 3 sits
/// behind the router. Node 1 routes node 2's subnets of both families directly via its
/// addresses, node 3's through the tunnels.
#[test]
fn vxlan_direct_routing_dual_stack() {
    require_root!();
    check(direct_routing_dual_stack());
}

fn direct_routing_dual_stack() -> Result<()> {
    let mut spec = dual_stack_spec("vxlan", Underlay::Mixed)?;
    spec.backend_options = json!({"DirectRouting": true});
    let cluster = Cluster::up(spec, &|line| eprintln!("{line}"), &|| false)?;
    let topo = cluster.topology();
    let envs = cluster.subnet_envs();
    let n2 = topo.node(2);
    let v4 = |i: usize| envs[i].lease().context("no FLANNEL_SUBNET");
    let v6 = |i: usize| {
        envs[i]
            .ipv6_subnet
            .map(|s| s.trunc())
            .context("no FLANNEL_IPV6_SUBNET")
    };
    let want4: BTreeSet<String> = [
        format!("{} via {} dev eth0", v4(1)?, n2.addr()),
        format!("{} via {} dev flannel.1 onlink", v4(2)?, v4(2)?.network()),
    ]
    .into_iter()
    .collect();
    let want6: BTreeSet<String> = [
        format!("{} via {} dev eth0", v6(1)?, n2.addr6().context("IPv6")?),
        format!(
            "{} via {} dev flannel-v6.1 onlink",
            v6(2)?,
            v6_network_addr(v6(2)?)
        ),
    ]
    .into_iter()
    .collect();
    let n1 = topo.node(1);
    status::expect_agent_routes(n1.ns(), "-4", &want4)?;
    status::expect_agent_routes(n1.ns(), "-6", &want6)?;
    ensure!(
        !topo.l2_adjacent(1, 3)? && topo.l2_adjacent(1, 2)?,
        "the topology is not what the test assumes"
    );
    pods_talk_both_families(&cluster)
}

// ---------------------------------------------------------------------------------------

#[test]
fn host_gw_dual_stack_across_nodes() {
    require_root!();
    check(host_gw_dual_stack());
}

fn host_gw_dual_stack() -> Result<()> {
    let cluster = dual_stack_cluster("host-gw", Underlay::L2)?;
    let topo = cluster.topology();
    let n1 = topo.node(1);
    let mut want4 = BTreeSet::new();
    let mut want6 = BTreeSet::new();
    for (i, node) in topo.nodes().iter().enumerate() {
        let env = &cluster.subnet_envs()[i];
        ensure!(env.mtu == Some(1500), "FLANNEL_MTU {:?}", env.mtu);
        let subnet6 = env.ipv6_subnet.context("no FLANNEL_IPV6_SUBNET")?.trunc();
        check_ip6_rules(node, subnet6, true)?;
        if i == 0 {
            continue;
        }
        let v4: Ipv4Net = env.lease().context("no FLANNEL_SUBNET")?;
        want4.insert(format!("{v4} via {} dev eth0", node.addr()));
        want6.insert(format!(
            "{subnet6} via {} dev eth0",
            node.addr6().context("node IPv6")?
        ));
    }
    status::expect_agent_routes(n1.ns(), "-4", &want4)?;
    status::expect_agent_routes(n1.ns(), "-6", &want6)?;

    pods_talk_both_families(&cluster)
}

/// host-gw in dual stack, on the kernel path and on the fast path: node1's `eth0` deleted
/// and created again (a new index; its IPv6 address goes through duplicate address
/// detection again) under the running agents. Within 10 s (well before the 30 s resync)
/// node1 routes both families of the other nodes through the new interface again, and the
/// pods talk in both families.
#[test]
fn host_gw_dual_stack_follows_a_recreated_eth0() {
    require_root!();
    for dataplane in [Dataplane::Kernel, Dataplane::Ebpf] {
        check(host_gw_dual_stack_recreated(dataplane));
    }
}

fn host_gw_dual_stack_recreated(dataplane: Dataplane) -> Result<()> {
    let mut spec = dual_stack_spec("host-gw", Underlay::L2)?;
    spec.dataplane = dataplane;
    let cluster = Cluster::up(spec, &|line| eprintln!("{line}"), &|| false)?;
    let n1 = cluster.topology().node(1).ns();
    let routes = |family: &str| status::agent_routes(n1, family);
    let (want4, want6) = wait::until(status::CONVERGE, "node1's routes", || {
        let (v4, v6) = (routes("-4")?, routes("-6")?);
        ensure!(
            v4.len() == 2 && v6.len() == 2,
            "node1's routes: {v4:?} {v6:?}"
        );
        Ok(Some((v4, v6)))
    })?;
    cluster.topology().recreate_uplink(1)?;
    wait::until_ok(
        Duration::from_secs(10),
        "node1's routes of both families",
        || {
            let (got4, got6) = (routes("-4")?, routes("-6")?);
            ensure!(
                got4 == want4 && got6 == want6,
                "node1 routes {got4:?} {got6:?}, want {want4:?} {want6:?}"
            );
            Ok(())
        },
    )?;
    pods_talk_both_families(&cluster)
}

// ---------------------------------------------------------------------------------------
// etcd allocation in dual stack: the compare-and-swap guards one key, which names both
// subnets, so two nodes could end up with the same IPv6 subnet (upstream's race).

fn have_etcd() -> bool {
    std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .is_ok()
}

fn dual_attrs(i: u8) -> LeaseAttrs {
    LeaseAttrs {
        public_ip: std::net::Ipv4Addr::new(192, 168, 50, i),
        public_ipv6: Some(
            format!("fd00:50::{i}")
                .parse()
                .unwrap_or(Ipv6Addr::LOCALHOST),
        ),
        ..LeaseAttrs::default()
    }
}

async fn etcd_put(endpoint: &str, key: &str, value: &str) -> Result<()> {
    let mut c = etcd_client::Client::connect([endpoint], None).await?;
    c.put(key, value, None).await?;
    Ok(())
}

/// Another node creates a key with another IPv4 but the same IPv6 subnet between our listing
/// and our write: ours succeeds (different key), then yields and picks another IPv6 subnet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dual_stack_join_yields_an_ipv6_subnet_taken_at_the_same_moment() {
    if !have_etcd() {
        eprintln!("skipped: etcd not installed");
        return;
    }
    check(yields_shared_ipv6().await);
}

async fn yields_shared_ipv6() -> Result<()> {
    let etcd = tokio::task::block_in_place(Etcd::start)?;
    let endpoint = etcd.endpoint();
    etcd_put(
        &endpoint,
        "/coreos.com/network/config",
        r#"{"Network":"10.3.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:3::/48"}"#,
    )
    .await?;
    let mut m = EtcdSubnetManager::connect(&EtcdOptions {
        endpoints: vec![endpoint.clone()],
        ..EtcdOptions::default()
    })
    .await?;
    let calls = Arc::new(AtomicUsize::new(0));
    let taken = Arc::new(Mutex::new(None::<String>));
    let (hcalls, htaken, hendpoint) = (calls.clone(), taken.clone(), endpoint.clone());
    m.set_before_write_hook(Arc::new(move |key: String| {
        let first = hcalls.fetch_add(1, Ordering::SeqCst) == 0;
        let (htaken, hendpoint) = (htaken.clone(), hendpoint.clone());
        Box::pin(async move {
            if !first {
                return;
            }
            // Same IPv6 subnet, another IPv4 one: a different key.
            let v6 = key
                .split_once('&')
                .map(|(_, v6)| v6.to_owned())
                .unwrap_or_default();
            let other = format!("/coreos.com/network/subnets/10.3.250.0-24&{v6}");
            let _ = etcd_put(&hendpoint, &other, &dual_attrs(9).to_json()).await;
            if let Ok(mut t) = htaken.lock() {
                *t = Some(other);
            }
        })
    }));
    let lease = m
        .acquire_lease(&dual_attrs(1), &PreviousSubnets::default())
        .await?;
    ensure!(
        calls.load(Ordering::SeqCst) == 2,
        "one yield, then a second write"
    );
    let other = taken
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone()
        .context("the hook ran")?;
    let other_key = SubnetKey::parse(&other).context("the other key parses")?;
    let mine = lease.ipv6_subnet.context("dual-stack lease without IPv6")?;
    ensure!(
        Some(mine) != other_key.ipv6,
        "both nodes hold {mine} after the yield"
    );
    let mut c = etcd_client::Client::connect([endpoint.as_str()], None).await?;
    let keys: Vec<String> = c
        .get(
            "/coreos.com/network/subnets/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await?
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect();
    ensure!(keys.len() == 2, "the yielded key is gone: {keys:?}");
    ensure!(
        c.leases().await?.leases().len() == 1,
        "the yielded attempt's etcd lease is revoked"
    );
    Ok(())
}

/// Many nodes joining at once with a small IPv6 pool (31 subnets for 16 nodes): every node
/// ends up with its own subnets in both families.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_dual_stack_joins_never_share_a_subnet() {
    if !have_etcd() {
        eprintln!("skipped: etcd not installed");
        return;
    }
    check(concurrent_joins().await);
}

async fn concurrent_joins() -> Result<()> {
    let etcd = tokio::task::block_in_place(Etcd::start)?;
    let endpoint = etcd.endpoint();
    etcd_put(
        &endpoint,
        "/coreos.com/network/config",
        r#"{"Network":"10.3.0.0/16","EnableIPv6":true,"IPv6Network":"fd00:3::/59","IPv6SubnetLen":64}"#,
    )
    .await?;
    let mut managers = Vec::new();
    for _ in 0..16 {
        managers.push(Arc::new(
            EtcdSubnetManager::connect(&EtcdOptions {
                endpoints: vec![endpoint.clone()],
                ..EtcdOptions::default()
            })
            .await?,
        ));
    }
    let joins = managers.iter().enumerate().map(|(i, m)| {
        let m = m.clone();
        async move {
            m.acquire_lease(&dual_attrs(i as u8 + 1), &PreviousSubnets::default())
                .await
        }
    });
    let leases = futures::future::join_all(joins).await;
    let mut v4 = BTreeSet::new();
    let mut v6 = BTreeSet::new();
    for l in leases {
        let l = l?;
        v4.insert(l.subnet.context("no IPv4")?);
        v6.insert(l.ipv6_subnet.context("no IPv6")?);
    }
    ensure!(v4.len() == 16, "IPv4 subnets shared: {v4:?}");
    ensure!(v6.len() == 16, "IPv6 subnets shared: {v6:?}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// IPv6 only

/// `EnableIPv4: false` in etcd mode: the agent stops with a clear error instead of
/// allocating upstream's degenerate `0.0.0.0/0` lease.
#[test]
fn ipv6_only_is_refused_in_etcd_mode() {
    require_root!();
    check(ipv6_only_etcd());
}

fn ipv6_only_etcd() -> Result<()> {
    let agent = bins::test_agent()?;
    let topology = Topology::new(TopologySpec::new(1, Underlay::L2).ipv6(true))?;
    let etcd = topology.start_etcd()?;
    let mut spec = ClusterSpec::new(topology.spec().clone(), "vxlan", &agent);
    spec.ipv6_network = Some(NETWORK_V6.parse()?);
    spec.enable_ipv4 = false;
    let kv = Kv::new(topology.hub(), etcd.endpoint());
    lease::write_netconf(&kv, &spec.etcd_prefix, &spec.netconf())?;
    let node = topology.node(1);
    let mut a = Agent::start(node, &AgentSpec::new(&agent, etcd.endpoint()))?;
    let status = wait::until(Duration::from_secs(30), "the agent to exit", || {
        Ok(a.exit_status())
    })?;
    ensure!(!status.success(), "exit status {status}");
    let log = a.log_tail(20);
    ensure!(
        log.contains("IPv6-only networks are not supported in etcd mode")
            && log.contains("--kube-subnet-mgr"),
        "log:\n{log}"
    );
    ensure!(
        kv.get_prefix(&format!("{}/subnets/", spec.etcd_prefix))?
            .is_empty(),
        "no lease may be written"
    );
    ensure!(
        node.read_subnet_env()?.is_none(),
        "no subnet.env may be written"
    );
    Ok(())
}

#[test]
fn ipv6_only_in_kube_mode() {
    require_root!();
    check(ipv6_only_kube("vxlan"));
    check(ipv6_only_kube("host-gw"));
}

fn ipv6_only_kube(backend: &str) -> Result<()> {
    eprintln!("--- IPv6 only, kube mode, {backend}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut topology = Topology::new(
        TopologySpec::new(3, Underlay::L2)
            .ipv6(true)
            .cni_plugin(bins::test_cni_plugin()?),
    )?;
    let api = kube::api_in_hub(&rt, &topology, &|i| vec![format!("fd00:244:0:{i}::/64")])?;
    let netconf = json!({
        "EnableIPv4": false,
        "EnableIPv6": true,
        "IPv6Network": NETWORK_V6,
        "Backend": {"Type": backend},
    });
    let mut spec = AgentSpec::new(bins::test_agent()?, kube::NO_ETCD);
    spec.ip_masq = true;
    let mut agents = kube::start_agents(&topology, &api, &netconf, &spec)?;
    let vxlan = backend == "vxlan";
    let mtu = if vxlan { 1430 } else { 1500 };

    let mut envs = Vec::new();
    for (node, agent) in topology.nodes().iter().zip(agents.iter_mut()) {
        let env = agent.wait_subnet_env(node, Duration::from_secs(60))?;
        let cidr: Ipv6Net = format!("fd00:244:0:{}::/64", node.index()).parse()?;
        let want = SubnetEnv {
            ipv6_network: Some(NETWORK_V6.parse()?),
            ipv6_subnet: Some(Ipv6Net::new(first_host(cidr), 64)?),
            mtu: Some(mtu),
            ipmasq: Some(true),
            ..SubnetEnv::default()
        };
        ensure!(env == want, "{}: subnet.env {env:?}", node.name());
        envs.push(env);
    }

    // The node objects carry IPv6 annotations only.
    let prefix = "flannel.alpha.coreos.com";
    for node in topology.nodes() {
        // The annotations and the NetworkUnavailable condition are two patches of the agent
        // (metadata, then status): wait for both.
        let obj = wait::until(
            Duration::from_secs(10),
            "the node annotations and condition",
            || {
                let obj = api.node(&node.name()).context("node gone")?;
                let ann = &obj["metadata"]["annotations"];
                ensure!(
                    ann[format!("{prefix}/kube-subnet-manager")] == "true",
                    "{ann}"
                );
                let conditions = &obj["status"]["conditions"];
                ensure!(
                    conditions
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| c["type"] == "NetworkUnavailable" && c["status"] == "False"),
                    "{}: conditions {conditions}",
                    node.name()
                );
                Ok(Some(obj))
            },
        )?;
        let ann = &obj["metadata"]["annotations"];
        let addr6 = node.addr6().context("IPv6 underlay")?.to_string();
        ensure!(
            ann[format!("{prefix}/public-ipv6")] == addr6.as_str()
                && ann[format!("{prefix}/backend-type")] == backend,
            "{}: annotations {ann}",
            node.name()
        );
        if vxlan {
            let data: Value = serde_json::from_str(
                ann[format!("{prefix}/backend-v6-data")]
                    .as_str()
                    .context("no backend-v6-data")?,
            )?;
            let link = json(node.ns(), &["ip", "-j", "link", "show", "flannel-v6.1"])?;
            ensure!(
                data["VtepMAC"] == link[0]["address"] && data["VNI"] == 1,
                "{}: backend-v6-data {data} vs flannel-v6.1 {link}",
                node.name()
            );
            ensure!(
                node.run(&["ip", "link", "show", "flannel.1"]).is_err(),
                "no IPv4 vxlan device in an IPv6-only network"
            );
        }
    }

    // Routes: IPv6 only, one per peer. A peer's annotations being in the API server does not
    // mean node 1 has seen them yet (its watch delivers them a moment later): wait for them.
    let n1 = topology.node(1);
    let mut vias = Vec::new();
    for node in topology.nodes().iter().skip(1) {
        let subnet = format!("fd00:244:0:{}::/64", node.index());
        let via = if vxlan {
            format!("via fd00:244:0:{}:: dev flannel-v6.1", node.index())
        } else {
            format!("via {} dev eth0", node.addr6().context("IPv6")?)
        };
        vias.push(format!("{subnet} {via}"));
    }
    wait::until_ok(status::CONVERGE, "node1's IPv6 routes", || {
        let routes6 = status::agent_routes(n1.ns(), "-6")?;
        for via in &vias {
            ensure!(
                routes6.iter().any(|r| r.starts_with(via)),
                "node1 has no route {via}: {routes6:#?}"
            );
        }
        ensure!(routes6.len() == 2, "node1 IPv6 routes {routes6:#?}");
        Ok(())
    })?;
    let routes4 = status::agent_routes(n1.ns(), "-4")?;
    ensure!(routes4.is_empty(), "IPv4 routes {routes4:?}");

    // Rules: IPv6 masquerade/forward as upstream, nothing for IPv4.
    for (node, env) in topology.nodes().iter().zip(&envs) {
        let lease6 = env.ipv6_subnet.context("IPv6 subnet")?.trunc();
        check_ip6_rules(node, lease6, false)?;
        ensure!(
            flannel_nat_lines(node.ns(), "iptables")?.is_empty(),
            "IPv4 masquerade rules in an IPv6-only network"
        );
    }

    // IPv6-only pods through CNI, talking across nodes.
    for n in 1..=3 {
        let pod = topology.add_pod(n)?;
        ensure!(
            pod.ip().is_unspecified() && pod.ip6().is_some(),
            "pod {} addresses {} / {:?}",
            pod.name(),
            pod.ip(),
            pod.ip6()
        );
    }
    let pods: Vec<&Pod> = topology.pods().iter().collect();
    probe::pods_talk(&pods, false)?;
    drop(agents);
    Ok(())
}
