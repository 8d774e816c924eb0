//! Masquerade and forward rules in real network namespaces, for iptables-legacy, iptables-nft
//! and nftables: upstream's golden output, idempotence (no write when exact), repair of
//! deleted / duplicated / reordered rules, foreign rules left alone, switching modes, IPv6,
//! and actual traffic (masqueraded to the outside, not within the cluster network, and no
//! unmasqueraded packet while the rules are being replaced).
//!
//! Each test uses its own namespace, so each has its own iptables and nftables state. Needs
//! root; skipped otherwise.

use std::{
    collections::BTreeMap,
    io,
    net::{IpAddr, SocketAddr, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use flannel_agent::traffic::{
    CommandOutput, CommandRunner, Desired, Family, FamilyRules, IptablesVariant, Previous,
    PreviousLease, SystemRunner, TrafficManager, TrafficMode,
};
use flannel_tests::{
    netns::{NetNs, veth},
    require_root,
};
use ipnet::IpNet;

// ---------------------------------------------------------------------------------------------
// Golden texts: upstream's e2e output (flannel-upstream.md section 7) for
// N = 10.244.0.0/16, P = 10.244.1.0/24.

const MASQ_V4: &str = r#"-A POSTROUTING -m comment --comment "flanneld masq" -j FLANNEL-POSTRTG
-N FLANNEL-POSTRTG
-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s 10.244.1.0/24 -d 10.244.0.0/16 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.244.1.0/24 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.1.0/24 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 224.0.0.0/4 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully
-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.0.0/16 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully"#;

const FORWARD_V4: &str = r#"-P FORWARD ACCEPT
-A FORWARD -m comment --comment "flanneld forward" -j FLANNEL-FWD
-N FLANNEL-FWD
-A FLANNEL-FWD -s 10.244.0.0/16 -m comment --comment "flanneld forward" -j ACCEPT
-A FLANNEL-FWD -d 10.244.0.0/16 -m comment --comment "flanneld forward" -j ACCEPT"#;

const NFT_POSTRTG_V4: &str = "table ip flannel-ipv4 {
\tchain postrtg {
\t\tcomment \"chain to manage traffic masquerading by flannel\"
\t\ttype nat hook postrouting priority srcnat; policy accept;
\t\tmeta mark 0x00004000 return
\t\tip saddr 10.244.1.0/24 ip daddr 10.244.0.0/16 return
\t\tip saddr 10.244.0.0/16 ip daddr 10.244.1.0/24 return
\t\tip saddr != 10.244.1.0/24 ip daddr 10.244.0.0/16 return
\t\tip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade fully-random
\t\tip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade fully-random
\t}
}";

const NFT_FORWARD_V4: &str = "table ip flannel-ipv4 {
\tchain forward {
\t\tcomment \"chain to accept flannel traffic\"
\t\ttype filter hook forward priority filter; policy accept;
\t\tip saddr 10.244.0.0/16 accept
\t\tip daddr 10.244.0.0/16 accept
\t}
}";

// IPv6: the same shapes with N = fd00:10:244::/56, P = fd00:10:244:100::/64, ff00::/8.
const MASQ_V6: &str = r#"-A POSTROUTING -m comment --comment "flanneld masq" -j FLANNEL-POSTRTG
-N FLANNEL-POSTRTG
-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s fd00:10:244:100::/64 -d fd00:10:244::/56 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s fd00:10:244::/56 -d fd00:10:244:100::/64 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG ! -s fd00:10:244::/56 -d fd00:10:244:100::/64 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s fd00:10:244::/56 ! -d ff00::/8 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully
-A FLANNEL-POSTRTG ! -s fd00:10:244::/56 -d fd00:10:244::/56 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully"#;

const FORWARD_V6: &str = r#"-P FORWARD ACCEPT
-A FORWARD -m comment --comment "flanneld forward" -j FLANNEL-FWD
-N FLANNEL-FWD
-A FLANNEL-FWD -s fd00:10:244::/56 -m comment --comment "flanneld forward" -j ACCEPT
-A FLANNEL-FWD -d fd00:10:244::/56 -m comment --comment "flanneld forward" -j ACCEPT"#;

const NFT_POSTRTG_V6: &str = "table ip6 flannel-ipv6 {
\tchain postrtg {
\t\tcomment \"chain to manage traffic masquerading by flannel\"
\t\ttype nat hook postrouting priority srcnat; policy accept;
\t\tmeta mark 0x00004000 return
\t\tip6 saddr fd00:10:244:100::/64 ip6 daddr fd00:10:244::/56 return
\t\tip6 saddr fd00:10:244::/56 ip6 daddr fd00:10:244:100::/64 return
\t\tip6 saddr != fd00:10:244:100::/64 ip6 daddr fd00:10:244::/56 return
\t\tip6 saddr fd00:10:244::/56 ip6 daddr != ff00::/8 masquerade fully-random
\t\tip6 saddr != fd00:10:244::/56 ip6 daddr fd00:10:244::/56 masquerade fully-random
\t}
}";

const NFT_FORWARD_V6: &str = "table ip6 flannel-ipv6 {
\tchain forward {
\t\tcomment \"chain to accept flannel traffic\"
\t\ttype filter hook forward priority filter; policy accept;
\t\tip6 saddr fd00:10:244::/56 accept
\t\tip6 daddr fd00:10:244::/56 accept
\t}
}";

// ---------------------------------------------------------------------------------------------
// Helpers

fn net(s: &str) -> IpNet {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn lines(s: &str) -> Vec<String> {
    s.lines().map(str::to_owned).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Legacy,
    Nft,
    Nftables,
}

impl Engine {
    fn mode(self) -> TrafficMode {
        match self {
            Engine::Legacy => TrafficMode::Iptables(IptablesVariant::Legacy),
            Engine::Nft => TrafficMode::Iptables(IptablesVariant::Nft),
            Engine::Nftables => TrafficMode::Nftables,
        }
    }

    /// The iptables binary of this engine (the nftables engine is checked with iptables-nft
    /// when looking for leftovers).
    fn ipt(self, family: Family) -> &'static str {
        match (self, family) {
            (Engine::Legacy, Family::Ipv4) => "iptables-legacy",
            (Engine::Legacy, Family::Ipv6) => "ip6tables-legacy",
            (_, Family::Ipv4) => "iptables-nft",
            (_, Family::Ipv6) => "ip6tables-nft",
        }
    }
}

/// A [`SystemRunner`] into a namespace that records every command line.
#[derive(Debug)]
struct Recorder {
    inner: SystemRunner,
    calls: Mutex<Vec<String>>,
}

impl Recorder {
    fn new(ns: &NetNs) -> Arc<Self> {
        Arc::new(Recorder {
            inner: SystemRunner::in_netns(&ns.path()),
            calls: Mutex::new(Vec::new()),
        })
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.calls.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Commands that change state: `*-restore` and `nft -f` (not `nft --check`).
    fn writes(calls: &[String]) -> Vec<String> {
        calls
            .iter()
            .filter(|c| {
                c.split_whitespace()
                    .next()
                    .is_some_and(|p| p.ends_with("-restore"))
                    || (c.starts_with("nft ") && c.contains(" -f ") && !c.contains("--check"))
            })
            .cloned()
            .collect()
    }
}

impl CommandRunner for Recorder {
    fn run(&self, program: &str, args: &[&str], stdin: Option<&[u8]>) -> io::Result<CommandOutput> {
        let mut line = program.to_owned();
        for a in args {
            line.push(' ');
            line.push_str(a);
        }
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(line);
        self.inner.run(program, args, stdin)
    }

    fn read_file(&self, path: &str) -> io::Result<Option<String>> {
        self.inner.read_file(path)
    }
}

fn v4(masquerade: bool, forward: bool) -> FamilyRules {
    FamilyRules {
        network: net("10.244.0.0/16"),
        subnet: net("10.244.1.0/24"),
        masquerade,
        forward,
    }
}

fn v6() -> FamilyRules {
    FamilyRules {
        network: net("fd00:10:244::/56"),
        subnet: net("fd00:10:244:100::/64"),
        masquerade: true,
        forward: true,
    }
}

fn desired_v4() -> Desired {
    Desired {
        ipv4: Some(v4(true, true)),
        ipv6: None,
        random_fully: true,
    }
}

fn manager(engine: Engine, runner: Arc<Recorder>) -> TrafficManager {
    TrafficManager::new(engine.mode(), runner)
}

/// Runs a command in `ns`; `None` if it fails (e.g. a chain that does not exist).
fn try_run(ns: &NetNs, argv: &[&str]) -> Option<String> {
    let out = ns.output(argv).expect("spawn");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn run(ns: &NetNs, argv: &[&str]) -> String {
    ns.run(argv)
        .unwrap_or_else(|e| panic!("{argv:?} in {}: {e:#}", ns.name()))
}

/// `POSTROUTING` lines mentioning FLANNEL, then `-S FLANNEL-POSTRTG` (how upstream's e2e
/// builds its golden).
fn masq_view(ns: &NetNs, bin: &str) -> Vec<String> {
    let mut out: Vec<String> = run(ns, &[bin, "-t", "nat", "-S", "POSTROUTING"])
        .lines()
        .filter(|l| l.contains("FLANNEL"))
        .map(str::to_owned)
        .collect();
    if let Some(chain) = try_run(ns, &[bin, "-t", "nat", "-S", "FLANNEL-POSTRTG"]) {
        out.extend(lines(&chain));
    }
    out
}

/// `-S FORWARD` then `-S FLANNEL-FWD`.
fn forward_view(ns: &NetNs, bin: &str) -> Vec<String> {
    let mut out = lines(&run(ns, &[bin, "-t", "filter", "-S", "FORWARD"]));
    if let Some(chain) = try_run(ns, &[bin, "-t", "filter", "-S", "FLANNEL-FWD"]) {
        out.extend(lines(&chain));
    }
    out
}

fn nft_chain(ns: &NetNs, family: Family, chain: &str) -> String {
    try_run(
        ns,
        &[
            "nft",
            "list",
            "chain",
            family.nft_family(),
            family.nft_table(),
            chain,
        ],
    )
    .unwrap_or_default()
    .trim_end()
    .to_owned()
}

/// Asserts the exact upstream golden state for IPv4 with or without random-fully.
fn assert_golden_v4(ns: &NetNs, engine: Engine, random_fully: bool) {
    match engine {
        Engine::Nftables => {
            let (masq, fwd) = (
                nft_chain(ns, Family::Ipv4, "postrtg"),
                nft_chain(ns, Family::Ipv4, "forward"),
            );
            let want = if random_fully {
                NFT_POSTRTG_V4.to_owned()
            } else {
                NFT_POSTRTG_V4.replace(" fully-random", "")
            };
            assert_eq!(masq, want);
            assert_eq!(fwd, NFT_FORWARD_V4);
        }
        _ => {
            let bin = engine.ipt(Family::Ipv4);
            let want = if random_fully {
                MASQ_V4.to_owned()
            } else {
                MASQ_V4.replace(" --random-fully", "")
            };
            assert_eq!(masq_view(ns, bin), lines(&want));
            assert_eq!(forward_view(ns, bin), lines(FORWARD_V4));
        }
    }
}

/// A handle of the `index`-th rule (0-based) of an nft chain, from `nft -a list chain`.
fn nft_handle(ns: &NetNs, family: Family, chain: &str, index: usize) -> String {
    let listing = run(
        ns,
        &[
            "nft",
            "-a",
            "list",
            "chain",
            family.nft_family(),
            family.nft_table(),
            chain,
        ],
    );
    let rules: Vec<&str> = listing
        .lines()
        .filter(|l| l.contains("# handle") && !l.contains("chain "))
        .collect();
    rules[index]
        .rsplit("# handle ")
        .next()
        .map(|h| h.trim().to_owned())
        .expect("handle")
}

// ---------------------------------------------------------------------------------------------
// Golden, idempotence, repair

fn golden_and_repair(engine: Engine) {
    let ns = NetNs::new(&format!("tg{engine:?}")).expect("netns");
    let runner = Recorder::new(&ns);
    let mut m = manager(engine, runner.clone());
    let report = m.init(&desired_v4(), &Previous::default()).expect("init");
    assert!(report.changed, "{report:?}");
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    assert_golden_v4(&ns, engine, true);

    // Again: nothing differs, so only reads happen.
    runner.take();
    assert!(!m.ensure(&desired_v4()).expect("ensure"));
    let calls = runner.take();
    assert!(Recorder::writes(&calls).is_empty(), "{calls:?}");
    assert!(!calls.is_empty());

    // Delete one rule by hand.
    match engine {
        Engine::Nftables => {
            let h = nft_handle(&ns, Family::Ipv4, "postrtg", 2);
            run(
                &ns,
                &[
                    "nft",
                    "delete",
                    "rule",
                    "ip",
                    "flannel-ipv4",
                    "postrtg",
                    "handle",
                    &h,
                ],
            );
            assert_ne!(nft_chain(&ns, Family::Ipv4, "postrtg"), NFT_POSTRTG_V4);
        }
        _ => {
            let bin = engine.ipt(Family::Ipv4);
            run(&ns, &[bin, "-t", "nat", "-D", "FLANNEL-POSTRTG", "3"]);
            run(&ns, &[bin, "-t", "filter", "-D", "FLANNEL-FWD", "1"]);
        }
    }
    assert!(m.ensure(&desired_v4()).expect("repair"));
    assert_golden_v4(&ns, engine, true);
    let calls = runner.take();
    let writes = Recorder::writes(&calls);
    let expected_writes = if engine == Engine::Nftables { 1 } else { 2 };
    assert_eq!(
        writes.len(),
        expected_writes,
        "one transaction per table: {writes:?}"
    );

    // Insert a duplicate at the top and move a rule to the end.
    match engine {
        Engine::Nftables => {
            run(
                &ns,
                &[
                    "nft",
                    "insert",
                    "rule",
                    "ip",
                    "flannel-ipv4",
                    "postrtg",
                    "ip",
                    "saddr",
                    "10.244.0.0/16",
                    "ip",
                    "daddr",
                    "10.244.1.0/24",
                    "return",
                ],
            );
            let h = nft_handle(&ns, Family::Ipv4, "forward", 0);
            run(
                &ns,
                &[
                    "nft",
                    "delete",
                    "rule",
                    "ip",
                    "flannel-ipv4",
                    "forward",
                    "handle",
                    &h,
                ],
            );
            run(
                &ns,
                &[
                    "nft",
                    "add",
                    "rule",
                    "ip",
                    "flannel-ipv4",
                    "forward",
                    "ip",
                    "saddr",
                    "10.244.0.0/16",
                    "accept",
                ],
            );
            run(
                &ns,
                &[
                    "nft",
                    "add",
                    "rule",
                    "ip",
                    "flannel-ipv4",
                    "forward",
                    "ip",
                    "daddr",
                    "10.244.0.0/16",
                    "accept",
                ],
            );
        }
        _ => {
            let bin = engine.ipt(Family::Ipv4);
            run(
                &ns,
                &[
                    bin,
                    "-t",
                    "nat",
                    "-I",
                    "FLANNEL-POSTRTG",
                    "1",
                    "-s",
                    "10.244.0.0/16",
                    "-d",
                    "10.244.1.0/24",
                    "-m",
                    "comment",
                    "--comment",
                    "flanneld masq",
                    "-j",
                    "RETURN",
                ],
            );
            run(&ns, &[bin, "-t", "filter", "-D", "FLANNEL-FWD", "1"]);
            run(
                &ns,
                &[
                    bin,
                    "-t",
                    "filter",
                    "-A",
                    "FLANNEL-FWD",
                    "-s",
                    "10.244.0.0/16",
                    "-m",
                    "comment",
                    "--comment",
                    "flanneld forward",
                    "-j",
                    "ACCEPT",
                ],
            );
            // A second jump, too.
            run(
                &ns,
                &[
                    bin,
                    "-t",
                    "nat",
                    "-I",
                    "POSTROUTING",
                    "1",
                    "-m",
                    "comment",
                    "--comment",
                    "flanneld masq",
                    "-j",
                    "FLANNEL-POSTRTG",
                ],
            );
            let view = masq_view(&ns, bin);
            assert_eq!(
                view.iter()
                    .filter(|l| l.starts_with("-A POSTROUTING"))
                    .count(),
                2
            );
        }
    }
    assert!(m.ensure(&desired_v4()).expect("repair"));
    assert_golden_v4(&ns, engine, true);
    runner.take();
    assert!(!m.ensure(&desired_v4()).expect("stable"));
    assert!(Recorder::writes(&runner.take()).is_empty());

    // A fresh manager (a restarted daemon) finds nothing to do either.
    let mut restarted = manager(engine, runner.clone());
    let report = restarted
        .init(&desired_v4(), &Previous::default())
        .expect("init");
    assert!(!report.changed && report.cleaned.is_empty(), "{report:?}");
}

#[test]
fn golden_idempotent_repair_iptables_legacy() {
    require_root!();
    golden_and_repair(Engine::Legacy);
}

#[test]
fn golden_idempotent_repair_iptables_nft() {
    require_root!();
    golden_and_repair(Engine::Nft);
}

#[test]
fn golden_idempotent_repair_nftables() {
    require_root!();
    golden_and_repair(Engine::Nftables);
}

// ---------------------------------------------------------------------------------------------
// Random-fully off, IPv6

fn random_fully_option(engine: Engine) {
    let ns = NetNs::new(&format!("rf{engine:?}")).expect("netns");
    let runner = Recorder::new(&ns);
    let mut m = manager(engine, runner);
    let mut d = desired_v4();
    d.random_fully = false;
    m.init(&d, &Previous::default()).expect("init");
    assert_golden_v4(&ns, engine, false);
    d.random_fully = true;
    assert!(m.ensure(&d).expect("ensure"));
    assert_golden_v4(&ns, engine, true);
}

#[test]
fn random_fully_off_by_option_iptables_legacy() {
    require_root!();
    random_fully_option(Engine::Legacy);
}

#[test]
fn random_fully_off_by_option_iptables_nft() {
    require_root!();
    random_fully_option(Engine::Nft);
}

#[test]
fn random_fully_off_by_option_nftables() {
    require_root!();
    random_fully_option(Engine::Nftables);
}

fn ipv6_dual_stack(engine: Engine) {
    let ns = NetNs::new(&format!("v6{engine:?}")).expect("netns");
    let runner = Recorder::new(&ns);
    let mut m = manager(engine, runner.clone());
    let d = Desired {
        ipv4: Some(v4(true, true)),
        ipv6: Some(v6()),
        random_fully: true,
    };
    m.init(&d, &Previous::default()).expect("init");
    assert_golden_v4(&ns, engine, true);
    match engine {
        Engine::Nftables => {
            assert_eq!(nft_chain(&ns, Family::Ipv6, "postrtg"), NFT_POSTRTG_V6);
            assert_eq!(nft_chain(&ns, Family::Ipv6, "forward"), NFT_FORWARD_V6);
        }
        _ => {
            let bin = engine.ipt(Family::Ipv6);
            assert_eq!(masq_view(&ns, bin), lines(MASQ_V6));
            assert_eq!(forward_view(&ns, bin), lines(FORWARD_V6));
            run(&ns, &[bin, "-t", "nat", "-D", "FLANNEL-POSTRTG", "6"]);
        }
    }
    runner.take();
    let changed = m.ensure(&d).expect("ensure");
    assert_eq!(changed, engine != Engine::Nftables);
    if engine != Engine::Nftables {
        assert_eq!(masq_view(&ns, engine.ipt(Family::Ipv6)), lines(MASQ_V6));
        let writes = Recorder::writes(&runner.take());
        assert_eq!(writes.len(), 1, "only the IPv6 nat table: {writes:?}");
        assert!(writes[0].starts_with("ip6tables-"), "{writes:?}");
    }
}

#[test]
fn ipv6_iptables_legacy() {
    require_root!();
    ipv6_dual_stack(Engine::Legacy);
}

#[test]
fn ipv6_iptables_nft() {
    require_root!();
    ipv6_dual_stack(Engine::Nft);
}

#[test]
fn ipv6_nftables() {
    require_root!();
    ipv6_dual_stack(Engine::Nftables);
}

// ---------------------------------------------------------------------------------------------
// Foreign rules, switching modes, recycling

/// iptables-save output without comments and counters, for before/after comparisons.
fn save(ns: &NetNs, bin: &str) -> Vec<String> {
    run(ns, &[&format!("{bin}-save")])
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match l.split_once(" [") {
            Some((head, _)) if l.starts_with(':') => head.to_owned(),
            _ => l.to_owned(),
        })
        .collect()
}

fn without_flannel(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| !l.contains("FLANNEL"))
        .cloned()
        .collect()
}

/// kube-proxy-like rules and a custom chain, present before flannel starts.
fn add_foreign_iptables(ns: &NetNs, bin: &str) {
    for argv in [
        &[bin, "-t", "filter", "-N", "KUBE-FORWARD"][..],
        &[
            bin,
            "-t",
            "filter",
            "-A",
            "KUBE-FORWARD",
            "-m",
            "conntrack",
            "--ctstate",
            "INVALID",
            "-j",
            "DROP",
        ],
        &[
            bin,
            "-t",
            "filter",
            "-A",
            "FORWARD",
            "-m",
            "comment",
            "--comment",
            "kubernetes forwarding rules",
            "-j",
            "KUBE-FORWARD",
        ],
        &[bin, "-t", "nat", "-N", "CUSTOM"],
        &[
            bin,
            "-t",
            "nat",
            "-A",
            "CUSTOM",
            "-s",
            "10.9.0.0/16",
            "-j",
            "MASQUERADE",
        ],
        &[bin, "-t", "nat", "-A", "POSTROUTING", "-j", "CUSTOM"],
    ] {
        run(ns, argv);
    }
}

const FOREIGN_NFT: &str = "table inet foreign {
\tchain passthru {
\t\ttype filter hook forward priority filter; policy accept;
\t\tip saddr 10.9.0.0/16 accept
\t}
}";

fn foreign_and_switch(engine: Engine) {
    let ns = NetNs::new(&format!("fs{engine:?}")).expect("netns");
    let bin = engine.ipt(Family::Ipv4);
    add_foreign_iptables(&ns, bin);
    run(&ns, &["nft", "add", "table", "inet", "foreign"]);
    run(
        &ns,
        &[
            "nft",
            "add",
            "chain",
            "inet",
            "foreign",
            "passthru",
            "{ type filter hook forward priority 0 ; policy accept ; }",
        ],
    );
    run(
        &ns,
        &[
            "nft",
            "add",
            "rule",
            "inet",
            "foreign",
            "passthru",
            "ip",
            "saddr",
            "10.9.0.0/16",
            "accept",
        ],
    );
    let before = save(&ns, bin);

    // iptables mode: our jump comes after KUBE-FORWARD; foreign rules untouched.
    let runner = Recorder::new(&ns);
    let mut ipt = manager(engine, runner.clone());
    ipt.init(&desired_v4(), &Previous::default())
        .expect("init iptables");
    let fwd = lines(&run(&ns, &[bin, "-t", "filter", "-S", "FORWARD"]));
    assert_eq!(
        fwd,
        [
            "-P FORWARD ACCEPT",
            r#"-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD"#,
            r#"-A FORWARD -m comment --comment "flanneld forward" -j FLANNEL-FWD"#,
        ]
    );
    let post = lines(&run(&ns, &[bin, "-t", "nat", "-S", "POSTROUTING"]));
    assert_eq!(
        post,
        [
            "-P POSTROUTING ACCEPT",
            "-A POSTROUTING -j CUSTOM",
            r#"-A POSTROUTING -m comment --comment "flanneld masq" -j FLANNEL-POSTRTG"#,
        ]
    );
    assert_eq!(without_flannel(&save(&ns, bin)), before);
    assert_eq!(masq_view(&ns, bin), lines(MASQ_V4));

    // Someone appends behind our jump later: we do not fight over the position.
    run(
        &ns,
        &[bin, "-t", "filter", "-A", "FORWARD", "-j", "KUBE-FORWARD"],
    );
    assert!(!ipt.ensure(&desired_v4()).expect("ensure"));
    run(&ns, &[bin, "-t", "filter", "-D", "FORWARD", "3"]);

    // Switch to nftables: our iptables chains and jumps go (both tables), foreign stays.
    let mut nft = manager(Engine::Nftables, runner.clone());
    let report = nft
        .init(&desired_v4(), &Previous::default())
        .expect("init nftables");
    assert!(!report.cleaned.is_empty(), "{report:?}");
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    assert_eq!(
        save(&ns, bin),
        before,
        "iptables back to the foreign rules only"
    );
    assert_golden_v4(&ns, Engine::Nftables, true);
    assert_eq!(
        run(&ns, &["nft", "list", "table", "inet", "foreign"]).trim_end(),
        FOREIGN_NFT
    );

    // And back to iptables: our nftables tables go, foreign and iptables-nft tables stay.
    let mut ipt = manager(engine, runner);
    let report = ipt
        .init(&desired_v4(), &Previous::default())
        .expect("init iptables again");
    assert!(
        report.cleaned.iter().any(|c| c.contains("nftables")),
        "{report:?}"
    );
    let tables = run(&ns, &["nft", "list", "tables"]);
    assert!(!tables.contains("flannel"), "{tables}");
    assert!(tables.contains("table inet foreign"), "{tables}");
    assert_eq!(
        run(&ns, &["nft", "list", "table", "inet", "foreign"]).trim_end(),
        FOREIGN_NFT
    );
    assert_eq!(without_flannel(&save(&ns, bin)), before);
    assert_golden_v4_with_foreign(&ns, bin);
}

/// Golden with the foreign KUBE-FORWARD jump in front of ours.
fn assert_golden_v4_with_foreign(ns: &NetNs, bin: &str) {
    assert_eq!(masq_view(ns, bin), lines(MASQ_V4));
    let mut want = lines(FORWARD_V4);
    want.insert(
        1,
        r#"-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD"#
            .to_owned(),
    );
    assert_eq!(forward_view(ns, bin), want);
}

#[test]
fn foreign_rules_kept_and_mode_switch_iptables_legacy() {
    require_root!();
    foreign_and_switch(Engine::Legacy);
}

#[test]
fn foreign_rules_kept_and_mode_switch_iptables_nft() {
    require_root!();
    foreign_and_switch(Engine::Nft);
}

/// Rules left by an earlier run with the other iptables backend are removed at init.
#[test]
fn other_iptables_backend_is_cleaned() {
    require_root!();
    let ns = NetNs::new("bk").expect("netns");
    let runner = Recorder::new(&ns);
    let mut legacy = manager(Engine::Legacy, runner.clone());
    legacy
        .init(&desired_v4(), &Previous::default())
        .expect("legacy");
    assert_golden_v4(&ns, Engine::Legacy, true);
    let mut nft = manager(Engine::Nft, runner);
    let report = nft.init(&desired_v4(), &Previous::default()).expect("nft");
    assert_eq!(
        report.cleaned,
        ["IPv4 iptables chains in the Legacy backend"],
        "{report:?}"
    );
    assert_golden_v4(&ns, Engine::Nft, true);
    assert!(masq_view(&ns, "iptables-legacy").is_empty());
    assert_eq!(forward_view(&ns, "iptables-legacy"), ["-P FORWARD ACCEPT"]);
}

/// A changed lease: the old rules are replaced (not merely added to); a family that is no
/// longer enabled loses its chains; a rule older flannel put straight into POSTROUTING goes.
#[test]
fn previous_lease_is_recycled() {
    require_root!();
    let ns = NetNs::new("rc").expect("netns");
    let runner = Recorder::new(&ns);
    let old = Desired {
        ipv4: Some(FamilyRules {
            network: net("10.245.0.0/16"),
            subnet: net("10.245.3.0/24"),
            masquerade: true,
            forward: true,
        }),
        ipv6: Some(v6()),
        random_fully: true,
    };
    manager(Engine::Nft, runner.clone())
        .init(&old, &Previous::default())
        .expect("old");
    run(
        &ns,
        &[
            "iptables-nft",
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-s",
            "10.245.0.0/16",
            "-d",
            "10.245.0.0/16",
            "-m",
            "comment",
            "--comment",
            "flanneld masq",
            "-j",
            "RETURN",
        ],
    );
    let previous = Previous {
        ipv4: Some(PreviousLease {
            network: net("10.245.0.0/16"),
            subnet: net("10.245.3.0/24"),
        }),
        ipv6: Some(PreviousLease {
            network: net("fd00:10:244::/56"),
            subnet: net("fd00:10:244:100::/64"),
        }),
    };
    let report = manager(Engine::Nft, runner)
        .init(&desired_v4(), &previous)
        .expect("new");
    assert_eq!(report.recycled, [Family::Ipv4, Family::Ipv6]);
    assert_golden_v4(&ns, Engine::Nft, true);
    assert_eq!(
        lines(&run(
            &ns,
            &["iptables-nft", "-t", "nat", "-S", "POSTROUTING"]
        )),
        [
            "-P POSTROUTING ACCEPT",
            r#"-A POSTROUTING -m comment --comment "flanneld masq" -j FLANNEL-POSTRTG"#,
        ],
        "the stale flanneld rule in POSTROUTING is gone"
    );
    assert!(masq_view(&ns, "ip6tables-nft").is_empty());
    assert_eq!(forward_view(&ns, "ip6tables-nft"), ["-P FORWARD ACCEPT"]);
}

/// Switching a part off removes its chain and jump; the other part stays exact.
#[test]
fn disabled_part_is_removed() {
    require_root!();
    for engine in [Engine::Nft, Engine::Nftables] {
        let ns = NetNs::new(&format!("off{engine:?}")).expect("netns");
        let mut m = manager(engine, Recorder::new(&ns));
        m.init(&desired_v4(), &Previous::default()).expect("init");
        let masq_only = Desired {
            ipv4: Some(v4(true, false)),
            ipv6: None,
            random_fully: true,
        };
        assert!(m.ensure(&masq_only).expect("ensure"));
        match engine {
            Engine::Nftables => {
                assert_eq!(nft_chain(&ns, Family::Ipv4, "postrtg"), NFT_POSTRTG_V4);
                assert_eq!(nft_chain(&ns, Family::Ipv4, "forward"), "");
            }
            _ => {
                assert_eq!(masq_view(&ns, "iptables-nft"), lines(MASQ_V4));
                assert_eq!(forward_view(&ns, "iptables-nft"), ["-P FORWARD ACCEPT"]);
            }
        }
        assert!(!m.ensure(&masq_only).expect("stable"));
    }
}

/// The periodic loop repairs drift without being asked.
#[test]
fn run_loop_repairs_drift() {
    require_root!();
    let ns = NetNs::new("loop").expect("netns");
    let m = manager(Engine::Nft, Recorder::new(&ns));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let (tx, rx) = tokio::sync::watch::channel(desired_v4());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = rt.spawn(m.run(rx, Duration::from_millis(200), async move {
        let _ = stop_rx.await;
    }));
    let wait_golden = |what: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while masq_view(&ns, "iptables-nft") != lines(MASQ_V4) {
            assert!(Instant::now() < deadline, "{what}: not repaired in time");
            thread::sleep(Duration::from_millis(50));
        }
    };
    wait_golden("first ensure");
    run(
        &ns,
        &["iptables-nft", "-t", "nat", "-D", "FLANNEL-POSTRTG", "1"],
    );
    wait_golden("drift");
    // A new desired state is applied promptly too.
    let mut no_rf = desired_v4();
    no_rf.random_fully = false;
    tx.send(no_rf).expect("send");
    let deadline = Instant::now() + Duration::from_secs(10);
    while masq_view(&ns, "iptables-nft") != lines(&MASQ_V4.replace(" --random-fully", "")) {
        assert!(Instant::now() < deadline, "new desired state not applied");
        thread::sleep(Duration::from_millis(50));
    }
    let _ = stop_tx.send(());
    let back = rt.block_on(task).expect("join");
    assert!(back.is_some(), "the manager is handed back");
}

// ---------------------------------------------------------------------------------------------
// Traffic: pod -- node -- outside

const POD: &str = "10.244.1.2";
const NODE_POD_SIDE: &str = "10.244.1.1";
const NODE_OUT: &str = "192.168.100.1";
const OUTSIDE: &str = "192.168.100.2";
/// An address of the cluster network that is not on this node (another node's pod).
const PEER_POD: &str = "10.244.2.2";
const PORT: u16 = 9000;

struct Topology {
    pod: NetNs,
    node: NetNs,
    outside: NetNs,
}

fn topology(tag: &str) -> Topology {
    let t = Topology {
        pod: NetNs::new(&format!("{tag}p")).expect("pod netns"),
        node: NetNs::new(&format!("{tag}n")).expect("node netns"),
        outside: NetNs::new(&format!("{tag}o")).expect("outside netns"),
    };
    veth(&t.pod, "p0", &t.node, "n0").expect("veth pod-node");
    veth(&t.node, "n1", &t.outside, "o0").expect("veth node-outside");
    for (ns, argv) in [
        (
            &t.pod,
            &["ip", "addr", "add", "10.244.1.2/24", "dev", "p0"][..],
        ),
        (
            &t.pod,
            &["ip", "route", "add", "default", "via", NODE_POD_SIDE],
        ),
        (
            &t.node,
            &["ip", "addr", "add", "10.244.1.1/24", "dev", "n0"],
        ),
        (
            &t.node,
            &["ip", "addr", "add", "192.168.100.1/24", "dev", "n1"],
        ),
        (
            &t.node,
            &["ip", "route", "add", "10.244.2.0/24", "via", OUTSIDE],
        ),
        (&t.node, &["sysctl", "-qw", "net.ipv4.ip_forward=1"]),
        (
            &t.outside,
            &["ip", "addr", "add", "192.168.100.2/24", "dev", "o0"],
        ),
        (
            &t.outside,
            &["ip", "addr", "add", "10.244.2.2/24", "dev", "o0"],
        ),
        (
            &t.outside,
            &["ip", "route", "add", "10.244.1.0/24", "via", NODE_OUT],
        ),
    ] {
        run(ns, argv);
    }
    t
}

/// A UDP socket bound to 0.0.0.0:PORT in `ns`.
fn listener(ns: &NetNs) -> UdpSocket {
    let sock = ns
        .enter(|| UdpSocket::bind(("0.0.0.0", PORT)))
        .expect("enter")
        .expect("bind");
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    sock
}

/// Sends one datagram with a unique token from a fresh socket (a new flow) in the pod and
/// returns the source address the receiver saw for that token.
fn source_seen(pod: &NetNs, rx: &UdpSocket, dst: &str) -> IpAddr {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let token = format!("probe-{}", NEXT.fetch_add(1, Ordering::Relaxed));
    let tx = pod
        .enter(|| UdpSocket::bind("0.0.0.0:0"))
        .expect("enter")
        .expect("bind");
    let dst: SocketAddr = format!("{dst}:{PORT}").parse().expect("addr");
    let mut buf = [0u8; 64];
    tx.send_to(token.as_bytes(), dst).expect("send");
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        // Datagrams of earlier probes or floods are skipped.
        if let Ok((n, from)) = rx.recv_from(&mut buf)
            && &buf[..n] == token.as_bytes()
        {
            return from.ip();
        }
    }
    panic!("probe {token} from the pod did not arrive at {dst}");
}

fn masquerade_traffic(engine: Engine) {
    let t = topology(&format!("tr{}", engine as u8));
    let rx = listener(&t.outside);
    let ip = |s: &str| s.parse::<IpAddr>().expect("ip");

    // Control: without rules the pod's address leaves the node unchanged.
    assert_eq!(source_seen(&t.pod, &rx, OUTSIDE), ip(POD));

    let mut m = manager(engine, Recorder::new(&t.node));
    m.init(&desired_v4(), &Previous::default()).expect("init");
    assert_eq!(
        source_seen(&t.pod, &rx, OUTSIDE),
        ip(NODE_OUT),
        "masqueraded"
    );
    assert_eq!(
        source_seen(&t.pod, &rx, PEER_POD),
        ip(POD),
        "cluster traffic is not masqueraded"
    );

    // Control for the detector: an emptied chain lets a new flow out unmasqueraded, and
    // ensure puts it right.
    match engine {
        Engine::Nftables => run(
            &t.node,
            &["nft", "flush", "chain", "ip", "flannel-ipv4", "postrtg"],
        ),
        _ => run(
            &t.node,
            &[
                engine.ipt(Family::Ipv4),
                "-t",
                "nat",
                "-F",
                "FLANNEL-POSTRTG",
            ],
        ),
    };
    assert_eq!(source_seen(&t.pod, &rx, OUTSIDE), ip(POD));
    assert!(m.ensure(&desired_v4()).expect("repair"));
    assert_eq!(source_seen(&t.pod, &rx, OUTSIDE), ip(NODE_OUT));
}

#[test]
fn masquerade_traffic_iptables_legacy() {
    require_root!();
    masquerade_traffic(Engine::Legacy);
}

#[test]
fn masquerade_traffic_iptables_nft() {
    require_root!();
    masquerade_traffic(Engine::Nft);
}

#[test]
fn masquerade_traffic_nftables() {
    require_root!();
    masquerade_traffic(Engine::Nftables);
}

/// Sets the flag when dropped (also while unwinding).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// While the masquerade chain is replaced over and over, a flood of new UDP flows (a fresh
/// source port each, so every packet is a new conntrack entry that goes through the nat
/// chain) leaves the node: every packet that arrives outside must carry the node's address.
/// A flush-then-refill update would let some through with the pod's address.
fn no_window_during_updates(engine: Engine) {
    let t = topology(&format!("wn{}", engine as u8));
    let rx = listener(&t.outside);
    let mut m = manager(engine, Recorder::new(&t.node));
    m.init(&desired_v4(), &Previous::default()).expect("init");
    let dst: SocketAddr = format!("{OUTSIDE}:{PORT}").parse().expect("addr");
    // Warm up neighbour entries.
    source_seen(&t.pod, &rx, OUTSIDE);

    let stop = AtomicBool::new(false);
    let sent = AtomicUsize::new(0);
    let seen: Mutex<BTreeMap<IpAddr, usize>> = Mutex::new(BTreeMap::new());
    let updates = thread::scope(|s| {
        s.spawn(|| {
            let mut buf = [0u8; 64];
            let deadline_after_stop = Duration::from_millis(500);
            let mut stopped_at: Option<Instant> = None;
            loop {
                if stop.load(Ordering::Relaxed) {
                    let at = *stopped_at.get_or_insert_with(Instant::now);
                    if at.elapsed() > deadline_after_stop {
                        break;
                    }
                }
                if let Ok((_, from)) = rx.recv_from(&mut buf) {
                    *seen
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(from.ip())
                        .or_default() += 1;
                }
            }
        });
        s.spawn(|| {
            t.pod
                .enter(|| {
                    // About 10k new flows per second, at most 25k (the ephemeral port range;
                    // a reused port may hit a live conntrack entry and skip the nat chain).
                    while !stop.load(Ordering::Relaxed) && sent.load(Ordering::Relaxed) < 25_000 {
                        if let Ok(sock) = UdpSocket::bind("0.0.0.0:0") {
                            let _ = sock.send_to(b"flood", dst);
                            let n = sent.fetch_add(1, Ordering::Relaxed);
                            if n % 10 == 9 {
                                thread::sleep(Duration::from_millis(1));
                            }
                        }
                    }
                })
                .expect("enter pod");
        });
        // If anything below panics, stop the other threads so the scope can end.
        let _stop = StopOnDrop(&stop);
        // Let the flood start, then replace the chain repeatedly.
        let start = Instant::now();
        while sent.load(Ordering::Relaxed) < 200 && start.elapsed() < Duration::from_secs(5) {
            thread::sleep(Duration::from_millis(5));
        }
        let mut updates = Vec::new();
        for i in 0..30 {
            let mut d = desired_v4();
            d.random_fully = i % 2 == 1;
            let before = sent.load(Ordering::Relaxed);
            assert!(
                m.ensure(&d).expect("ensure"),
                "every update rewrites the chain"
            );
            updates.push(sent.load(Ordering::Relaxed) - before);
        }
        stop.store(true, Ordering::Relaxed);
        updates
    });
    let seen = seen.into_inner().unwrap_or_else(|p| p.into_inner());
    let node: IpAddr = NODE_OUT.parse().expect("ip");
    let total: usize = seen.values().sum();
    assert!(total > 500, "the flood must overlap the updates: {seen:?}");
    assert!(
        updates.iter().filter(|n| **n > 0).count() > 10,
        "packets were sent while updates ran: {updates:?}"
    );
    assert_eq!(
        seen.keys().copied().collect::<Vec<_>>(),
        [node],
        "some packets left unmasqueraded during updates: {seen:?}"
    );
}

#[test]
fn no_unmasqueraded_packet_during_updates_iptables_legacy() {
    require_root!();
    no_window_during_updates(Engine::Legacy);
}

#[test]
fn no_unmasqueraded_packet_during_updates_iptables_nft() {
    require_root!();
    no_window_during_updates(Engine::Nft);
}

#[test]
fn no_unmasqueraded_packet_during_updates_nftables() {
    require_root!();
    no_window_during_updates(Engine::Nftables);
}
