//! The real `flannel-agent` against bad input and its traffic rules: malformed leases written
//! into etcd by hand, malformed network configs, readiness before and after the lease, and
//! masquerading with `--ip-masq`.
//!
//! Run: `cargo test -p flannel-tests --test agent_config` (as root; skipped otherwise).

mod agent_support;

use std::{net::IpAddr, time::Duration};

use agent_support::{
    CONVERGE, PROBE, Path, count_lines, expected_state, report, spec, wait_for_state, with_cluster,
};
use anyhow::{Context as _, Result, ensure};
use flannel_tests::{
    lab::{
        agent::{Agent, AgentSpec, DEFAULT_HEALTHZ_PORT},
        bins,
        kv::Kv,
        lease::{self, LeaseRecord},
        probe, status, wait,
    },
    require_root,
    topology::{Node, Topology, TopologySpec, Underlay},
};
use serde_json::json;

/// The leases in etcd that parse and name a public IP (what an agent programs).
fn valid_leases(kv: &Kv, prefix: &str) -> Result<Vec<LeaseRecord>> {
    Ok(kv
        .get_prefix(&format!("{prefix}/subnets/"))?
        .iter()
        .filter_map(|(k, v)| LeaseRecord::parse(k, v).ok())
        .filter(|l| l.public_ip.is_some() && l.vtep_mac().is_some_and(is_mac))
        .collect())
}

fn is_mac(text: &str) -> bool {
    let parts: Vec<&str> = text.split(':').collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Leases that cannot be used, written next to the real ones (after start-up, so through
/// the watch), and one good lease after them: each bad one is logged once by every agent and
/// ignored, everything else is programmed; an agent restarted with them already in etcd
/// (the listing path) does the same.
#[test]
fn malformed_leases_are_logged_once_and_ignored() {
    require_root!();
    let mut s = spec(2, Underlay::L2, "vxlan", 0);
    // Frequent resyncs: none of them may log the bad leases again.
    s.agent_args = vec!["--resync-interval=1".to_owned()];
    with_cluster("malformed leases", s, |c| {
        let prefix = c.spec().etcd_prefix.clone();
        // (key, value, what the log line names: the subnet manager rejects undecodable
        // values, the dataplane leases whose backend data it cannot use).
        let bad = [
            (
                format!("{prefix}/subnets/10.244.240.0-24"),
                r#"{"PublicIP": 12"#.to_owned(),
                format!("ignoring lease {prefix}/subnets/10.244.240.0-24 "),
            ),
            (
                format!("{prefix}/subnets/10.244.241.0-24"),
                json!({"PublicIP": "999.1.1.1", "BackendType": "vxlan",
                       "BackendData": {"VNI": 1, "VtepMAC": "0e:00:00:00:f1:01"}})
                .to_string(),
                format!("ignoring lease {prefix}/subnets/10.244.241.0-24 "),
            ),
            (
                format!("{prefix}/subnets/10.244.242.0-24"),
                json!({"PublicIP": "192.168.1.242", "BackendType": "vxlan",
                       "BackendData": {"VNI": 1, "VtepMAC": "not-a-mac"}})
                .to_string(),
                "ignoring lease 10.244.242.0-24: unusable IPv4 backend data: invalid MAC \
                 address \"not-a-mac\""
                    .to_owned(),
            ),
        ];
        for (k, v, _) in &bad {
            c.kv().put(k, v)?;
        }
        let good_key = format!("{prefix}/subnets/10.244.250.0-24");
        c.kv().put(
            &good_key,
            &json!({"PublicIP": "192.168.1.250", "PublicIPv6": null, "BackendType": "vxlan",
                    "BackendData": {"VNI": 1, "VtepMAC": "0e:00:00:00:fa:01"}})
            .to_string(),
        )?;
        let leases = valid_leases(c.kv(), &prefix)?;
        ensure!(leases.len() == 3, "valid leases: {leases:?}");
        for n in 1..=2 {
            let want = expected_state(c, n, &leases, |_| Path::Vxlan);
            wait_for_state(c, n, &want)?;
        }
        // A few resyncs later the bad leases are still logged exactly once.
        std::thread::sleep(Duration::from_secs(3));
        let check_logged_once = |log: &str, who: &str| -> Result<()> {
            for (key, _, needle) in &bad {
                let times = count_lines(log, needle);
                ensure!(times == 1, "{who} logged {key} {times} times:\n{log}");
            }
            Ok(())
        };
        for n in 1..=2 {
            let log = std::fs::read_to_string(c.topology().node(n).agent_log())?;
            check_logged_once(&log, &format!("node{n}"))?;
            ensure!(
                status::http_status(c.topology().node(n).ns(), DEFAULT_HEALTHZ_PORT, "/readyz")?
                    == 200,
                "node{n} is not ready"
            );
        }

        // A fresh start finds them in the listing.
        let log_path = c.topology().node(2).agent_log();
        let first_len = std::fs::read_to_string(&log_path)?.len();
        c.agent_mut(2).context("agent 2")?.restart()?;
        c.wait_ready(Duration::from_secs(30))?;
        let want = expected_state(c, 2, &leases, |_| Path::Vxlan);
        wait_for_state(c, 2, &want)?;
        std::thread::sleep(Duration::from_secs(2));
        let log = std::fs::read_to_string(&log_path)?;
        check_logged_once(&log[first_len.min(log.len())..], "node2 after a restart")
    });
}

/// A node with etcd in the hub and nothing else.
struct Bare {
    // Agent before etcd before the topology.
    agent: Option<Agent>,
    kv: Kv,
    _etcd: flannel_tests::etcd::Etcd,
    topo: Topology,
}

impl Bare {
    fn new() -> Result<Bare> {
        let topo = Topology::new(TopologySpec::new(1, Underlay::L2))?;
        let etcd = topo.start_etcd()?;
        let kv = Kv::new(topo.hub(), etcd.endpoint());
        Ok(Bare {
            agent: None,
            kv,
            _etcd: etcd,
            topo,
        })
    }

    fn node(&self) -> &Node {
        self.topo.node(1)
    }

    fn start_agent(&mut self, endpoint: String) -> Result<()> {
        let spec = AgentSpec::new(bins::test_agent()?, endpoint);
        self.agent = Some(Agent::start(self.topo.node(1), &spec)?);
        Ok(())
    }

    fn agent(&mut self) -> Result<&mut Agent> {
        self.agent.as_mut().context("no agent")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.node().agent_log()).unwrap_or_default()
    }

    fn readyz(&self) -> Result<u16> {
        status::http_status(self.node().ns(), DEFAULT_HEALTHZ_PORT, "/readyz")
    }

    /// Nothing of the dataplane exists: no vxlan device, no subnet.env, no flannel rules.
    fn nothing_applied(&self) -> Result<()> {
        let node = self.node();
        let links = node.run(&["ip", "-o", "link", "show"])?;
        ensure!(
            !links.contains("flannel"),
            "a flannel device exists:\n{links}"
        );
        ensure!(
            !node.subnet_file().exists(),
            "subnet.env was written: {:?}",
            node.read_subnet_env()?
        );
        let rules = node.run(&["iptables-save"])?;
        ensure!(
            !rules.to_ascii_uppercase().contains("FLANNEL"),
            "flannel iptables rules exist:\n{rules}"
        );
        let nft = node.run(&["nft", "list", "ruleset"])?;
        ensure!(
            !nft.contains("flannel"),
            "flannel nftables rules exist:\n{nft}"
        );
        Ok(())
    }
}

/// Waits until the agent's log has `times` lines containing `needle` (it retries every
/// second), failing early if the agent exits.
fn wait_logged(bare: &mut Bare, needle: &str, times: usize) -> Result<()> {
    wait::until_ok(
        Duration::from_secs(20),
        &format!("{times} log lines with {needle:?}"),
        || {
            bare.agent()?.check_running()?;
            let got = count_lines(&bare.log(), needle);
            ensure!(got >= times, "{got} so far");
            Ok(())
        },
    )
}

/// Malformed network configs: the agent names the field and value, keeps retrying every
/// second, stays alive and not ready, and applies nothing. Once the config is fixed it
/// starts normally.
#[test]
fn malformed_network_config_is_named_retried_and_not_applied() {
    require_root!();
    report(
        "malformed config",
        (|| {
            let mut bare = Bare::new()?;
            let endpoint = bare.kv.endpoint().to_owned();
            let key = format!("{}/config", lease::DEFAULT_PREFIX);
            let configs = [
                (
                    r#"{"Network": "10.244.0.0/33", "Backend": {"Type": "vxlan"}}"#,
                    "invalid Network \"10.244.0.0/33\"",
                ),
                (
                    r#"{"Network": "10.244.0.0/16", "SubnetLen": "24", "Backend": {"Type": "vxlan"}}"#,
                    "SubnetLen",
                ),
                (
                    r#"{"Network": "10.244.0.0/16", "Backend": "vxlan"}"#,
                    "Backend",
                ),
            ];
            bare.kv.put(&key, configs[0].0)?;
            bare.start_agent(endpoint)?;
            for (config, needle) in configs {
                bare.kv.put(&key, config)?;
                // Retried: seen at least three times.
                wait_logged(&mut bare, needle, 3)
                    .with_context(|| format!("config {config}\nlog:\n{}", bare.log()))?;
                ensure!(bare.readyz()? == 503, "ready with config {config}");
                let health =
                    status::http_status(bare.node().ns(), DEFAULT_HEALTHZ_PORT, "/healthz")?;
                ensure!(health == 200, "/healthz {health}");
                bare.nothing_applied()
                    .with_context(|| format!("config {config}"))?;
            }
            let log = bare.log();
            eprintln!(
                "{}",
                log.lines()
                    .filter(|l| l.contains("network config"))
                    .take(12)
                    .collect::<Vec<_>>()
                    .join("\n")
            );

            bare.kv.put(
                &key,
                r#"{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}"#,
            )?;
            let node_ns = bare.node().ns().path();
            wait::until_ok(Duration::from_secs(30), "ready after the fix", || {
                bare.agent()?.check_running()?;
                ensure!(bare.readyz()? == 200, "not ready yet");
                Ok(())
            })?;
            let env = bare.node().read_subnet_env()?.context("no subnet.env")?;
            ensure!(
                env.lease().is_some_and(|l| "10.244.0.0/16"
                    .parse::<ipnet::Ipv4Net>()
                    .is_ok_and(|n| n.contains(&l))),
                "{env:?}"
            );
            let links = bare
                .node()
                .run(&["ip", "-o", "link", "show", "flannel.1"])?;
            ensure!(
                links.contains("flannel.1"),
                "{links} in {}",
                node_ns.display()
            );
            Ok(())
        })(),
    );
}

/// `/readyz` answers 503 while the agent has no lease (here: no network config yet) and 200
/// once it holds one and has programmed the (empty) lease set; `/healthz` is 200 all along.
#[test]
fn readiness_follows_the_lease() {
    require_root!();
    report(
        "readiness",
        (|| {
            let mut bare = Bare::new()?;
            let endpoint = bare.kv.endpoint().to_owned();
            bare.start_agent(endpoint)?;
            let ns = bare.node().ns();
            wait::until_ok(Duration::from_secs(20), "the health server", || {
                ensure!(status::http_status(ns, DEFAULT_HEALTHZ_PORT, "/healthz")? == 200);
                Ok(())
            })?;
            for _ in 0..10 {
                let code = bare.readyz()?;
                ensure!(code == 503, "/readyz {code} without a lease");
                std::thread::sleep(Duration::from_millis(100));
            }
            ensure!(
                bare.kv
                    .count_prefix(&format!("{}/subnets/", lease::DEFAULT_PREFIX))?
                    == 0
            );
            lease::write_netconf(
                &bare.kv,
                lease::DEFAULT_PREFIX,
                &lease::netconf("10.244.0.0/16".parse()?, "host-gw", json!({})),
            )?;
            wait::until_ok(Duration::from_secs(30), "/readyz 200", || {
                bare.agent()?.check_running()?;
                ensure!(bare.readyz()? == 200, "not ready");
                Ok(())
            })?;
            let leases = lease::read_leases(&bare.kv, lease::DEFAULT_PREFIX)?;
            ensure!(leases.len() == 1, "{leases:?}");
            ensure!(
                bare.node().read_subnet_env()?.and_then(|e| e.lease()) == Some(leases[0].subnet),
                "subnet.env does not name the lease"
            );
            let ns = bare.node().ns();
            ensure!(
                status::metric(ns, DEFAULT_HEALTHZ_PORT, "flannel_leases")? == Some(0.0),
                "flannel_leases"
            );
            Ok(())
        })(),
    );
}

/// With `--ip-masq`, a pod reaching something outside the cluster network (a server in the
/// hub) is masqueraded to its node's address; pod-to-pod traffic across nodes keeps the
/// pod's address.
#[test]
fn ip_masq_hides_pods_only_outside_the_cluster() {
    require_root!();
    let mut s = spec(2, Underlay::L2, "vxlan", 1);
    s.ip_masq = true;
    with_cluster("ip-masq", s, |c| {
        let leases = c.leases()?;
        for n in 1..=2 {
            wait_for_state(c, n, &expected_state(c, n, &leases, |_| Path::Vxlan))?;
            let env = c
                .topology()
                .node(n)
                .read_subnet_env()?
                .context("subnet.env")?;
            ensure!(env.ipmasq == Some(true), "node{n}: {env:?}");
        }
        let topo = c.topology();
        let (pod1, pod2) = (topo.pods_on(1)[0], topo.pods_on(2)[0]);
        let hub_ip = IpAddr::V4(topo.hub_addr());
        let outside = wait::until(CONVERGE, "pod -> hub", || {
            probe::source_seen(pod1.ns(), topo.hub(), hub_ip, PROBE).map(Some)
        })?;
        ensure!(
            outside == IpAddr::V4(topo.node(1).addr()),
            "the hub saw {outside}, not node1's {}",
            topo.node(1).addr()
        );
        let inside = probe::source_seen(pod1.ns(), pod2.ns(), IpAddr::V4(pod2.ip()), PROBE)?;
        ensure!(
            inside == IpAddr::V4(pod1.ip()),
            "pod2 saw {inside}, not pod1's {}",
            pod1.ip()
        );
        let back = probe::source_seen(pod2.ns(), pod1.ns(), IpAddr::V4(pod1.ip()), PROBE)?;
        ensure!(back == IpAddr::V4(pod2.ip()), "pod1 saw {back}");
        let nat = topo.node(1).run(&["iptables-save", "-t", "nat"])?;
        ensure!(
            nat.contains("FLANNEL-POSTRTG") && nat.contains("MASQUERADE"),
            "no masquerade rules:\n{nat}"
        );
        // The hub has no route to the pods: without masquerading it could not answer.
        let route = topo
            .hub()
            .output(&["ip", "route", "get", &pod1.ip().to_string()])?;
        ensure!(
            !route.status.success(),
            "the hub routes to pods, the test proves nothing: {}",
            String::from_utf8_lossy(&route.stdout)
        );
        Ok(())
    });
}
