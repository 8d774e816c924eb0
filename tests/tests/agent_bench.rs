//! The agent-driven benchmark setups work: each `agent-*` kernel variant of `flannel-lab bench
//! dataplane` carries iperf3 and sockperf traffic through the path it names, and `bench
//! control` converges on a few hundred fake leases with its counters filled in; the eBPF
//! variants' program run time is read. The IPv6 variants (`underlay-v6`,
//! `agent-ebpf-host-gw-v6`) carry iperf3 and `flannel-lab rr` traffic to the server's IPv6
//! address, received by the server's IPv6 stack (and, on the fast path, forwarded by its IPv6
//! side). No timing is asserted (the numbers are the benchmarks' job); the paths and counts
//! are.
//!
//! Run: `cargo test -p flannel-tests --test agent_bench` (as root; skipped otherwise).

use std::{net::IpAddr, time::Duration};

use flannel_common::programs::{TC_FROM_BRIDGE, TC_FROM_NETDEV};
use flannel_tests::{
    bench::{
        control::{self, ControlOptions},
        control_floor, crr, dataplane,
        learn::{self, LearnOptions},
        measure::{self, Latency, RrTool},
        programs::{self, ProgramsOptions},
        progtime,
        variant::{self, SetupCtx, Testbed},
    },
    lab::{
        agent::{DEFAULT_HEALTHZ_PORT, Dataplane},
        bins, fastpath,
    },
    netns::NetNs,
    require_root,
};

fn ctx() -> SetupCtx {
    SetupCtx {
        cni_plugin: Some(bins::test_cni_plugin().unwrap_or_else(|e| panic!("{e:#}"))),
        agent: Some(bins::test_agent().unwrap_or_else(|e| panic!("{e:#}"))),
    }
}

/// Bytes `dev` on node `n` has sent.
fn tx_bytes(bed: &Testbed, n: usize, dev: &str) -> u64 {
    bed.topology()
        .node(n)
        .ns()
        .link_counter(dev, "tx", "bytes")
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// Prepares `name`, runs one second of each measurement and checks the path: `via` is the
/// device node 1 sends the pod traffic out of, `rules` whether the agent's forward rules are
/// in place.
fn carries_traffic(name: &str, via: &str, rules: bool) {
    let v = variant::find(name).expect("variant");
    let mut bed = v
        .prepare(&ctx())
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    dataplane::start_servers(&mut bed, Some(0)).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let route = bed
        .topology()
        .node(1)
        .route_get(bed.server_ip)
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(route.dev.as_deref(), Some(via), "{name}: {route:?}");
    if via == "eth0" {
        assert_eq!(
            route.gateway,
            Some(IpAddr::V4(bed.topology().node(2).addr())),
            "{name}: host-gw goes straight to the peer node"
        );
    }
    let before = tx_bytes(&bed, 1, via);
    let smoke = dataplane::smoke(&bed, bed.server_ip).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("{name}: {smoke:?} (1 s each, not a measurement)");
    assert!(
        smoke.gbps > 0.0 && smoke.p50_us > 0.0 && smoke.cps > 0.0,
        "{name}: {smoke:?}"
    );
    let sent = tx_bytes(&bed, 1, via) - before;
    assert!(sent > 10_000_000, "{name}: {via} sent only {sent} bytes");
    let filter = bed
        .topology()
        .node(1)
        .run(&["iptables-save", "-t", "filter"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        filter.contains("FLANNEL-FWD"),
        rules,
        "{name}: forward rules\n{filter}"
    );
    let nat = bed
        .topology()
        .node(1)
        .run(&["iptables-save", "-t", "nat"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        nat.contains("MASQUERADE"),
        rules,
        "{name}: the CNI bridge's masquerade rules\n{nat}"
    );
}

#[test]
fn agent_host_gw_variant_carries_traffic() {
    require_root!();
    carries_traffic("agent-host-gw", "eth0", true);
}

#[test]
fn agent_vxlan_variant_carries_traffic() {
    require_root!();
    carries_traffic("agent-vxlan", "flannel.1", true);
}

#[test]
fn bare_agent_variants_carry_traffic_without_rules() {
    require_root!();
    carries_traffic("agent-host-gw-bare", "eth0", false);
    carries_traffic("agent-vxlan-bare", "flannel.1", false);
}

/// The programs' time the dataplane bench reports for eBPF variants: with statistics on, a
/// request/response run between the pods of `agent-ebpf-host-gw` is seen running both the
/// transmit and the receive program, about as often as round trips were made, and a
/// connection-rate run the transmit program at least twice per connection.
#[test]
fn ebpf_variant_reports_its_programs_run_time() {
    require_root!();
    let name = "agent-ebpf-host-gw";
    let v = variant::find(name).expect("variant");
    let mut bed = v
        .prepare(&ctx())
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    dataplane::start_servers(&mut bed, Some(0)).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let client = bed.client_ns().unwrap_or_else(|e| panic!("{e:#}"));
    let _stats = progtime::Stats::enable().unwrap_or_else(|e| panic!("{e:#}"));
    let before = progtime::Snapshot::take();
    let rr = measure::sockperf_rr(client, bed.server_ip, Duration::from_secs(1), Some(0))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let usage = before.until(&progtime::Snapshot::take());
    eprintln!("{name}: {usage:?} over {} round trips", rr.round_trips);
    for program in [TC_FROM_BRIDGE, TC_FROM_NETDEV] {
        let ns = usage.ns_per_run(program);
        assert!(ns.is_some_and(|ns| ns > 0.0), "{program}: {usage:?}");
    }
    // Each round trip runs both programs once per direction (other tests' traffic through
    // programs of the same name can only add to it).
    assert!(rr.round_trips > 100, "{rr:?}");
    assert!(
        usage.runs(TC_FROM_BRIDGE) >= 2 * rr.round_trips,
        "{usage:?} for {} round trips",
        rr.round_trips
    );
    // The per-connection figure's run: every new connection runs the transmit program on
    // both nodes (its SYN and the SYN-ACK at least).
    let before = progtime::Snapshot::take();
    let addr = std::net::SocketAddr::new(bed.server_ip, measure::CRR_PORT);
    let crr = crr::run_clients_in(client, addr, dataplane::CRR_CLIENTS, Duration::from_secs(1))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let usage = before.until(&progtime::Snapshot::take());
    eprintln!("{name}: {usage:?} over {} connections", crr.connections);
    assert!(crr.connections > 50, "{crr:?}");
    assert!(
        usage.runs(TC_FROM_BRIDGE) >= 2 * crr.connections,
        "{usage:?} for {crr:?}"
    );
}

/// `Ip6InReceives` of `ns` (/proc/net/snmp6 as seen from inside it).
fn ip6_in_receives(ns: &NetNs) -> u64 {
    let snmp6 = ns
        .run(&["cat", "/proc/net/snmp6"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    snmp6
        .lines()
        .find_map(|l| l.strip_prefix("Ip6InReceives"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no Ip6InReceives in {snmp6}"))
}

/// Prepares the IPv6 variant `name` with its servers and checks the bench's view of it: the
/// server address is IPv6, measured by `flannel-lab rr`; node 1 sends to it out of `eth0`
/// (through `gateway`, `None` on the link); a second of iperf3 and of `flannel-lab rr` moves
/// more than 10 MB out of node 1's `eth0`. Returns the testbed.
fn v6_bed(name: &str, gateway: impl Fn(&Testbed) -> Option<IpAddr>) -> Testbed {
    let v = variant::find(name).expect("variant");
    assert!(v.topology.ipv6, "{name}: an IPv6 topology");
    let mut bed = v
        .prepare(&ctx())
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    assert!(bed.server_ip.is_ipv6(), "{name}: {}", bed.server_ip);
    assert_eq!(RrTool::for_server(bed.server_ip), RrTool::LabRr);
    dataplane::start_servers(&mut bed, Some(0)).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let route = bed
        .topology()
        .node(1)
        .route_get(bed.server_ip)
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(route.dev.as_deref(), Some("eth0"), "{name}: {route:?}");
    assert_eq!(route.gateway, gateway(&bed), "{name}: {route:?}");
    let before = tx_bytes(&bed, 1, "eth0");
    let smoke = dataplane::smoke(&bed, bed.server_ip).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("{name}: {smoke:?} (1 s each, not a measurement)");
    assert!(
        smoke.gbps > 0.0 && smoke.p50_us > 0.0 && smoke.cps > 0.0,
        "{name}: {smoke:?}"
    );
    let sent = tx_bytes(&bed, 1, "eth0") - before;
    assert!(sent > 10_000_000, "{name}: eth0 sent only {sent} bytes");
    bed
}

/// A pinned request/response run of the bench's own kind (`measure::rr`) against the
/// testbed: positive latencies, hundreds of round trips, each one's request received by the
/// server namespace's IPv6 stack.
fn v6_rr(bed: &Testbed, name: &str, duration: Duration) -> Latency {
    let server_rx = ip6_in_receives(bed.server_ns().unwrap_or_else(|e| panic!("{e:#}")));
    let client = bed.client_ns().unwrap_or_else(|e| panic!("{e:#}"));
    let rr = measure::rr(client, bed.server_ip, duration, Some(0))
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    eprintln!("{name}: {rr:?}");
    assert!(rr.p50_us > 0.0 && rr.p50_us <= rr.p99_us, "{name}: {rr:?}");
    assert!(rr.avg_us > 0.0, "{name}: {rr:?}");
    assert!(rr.round_trips > 100, "{name}: {rr:?}");
    assert!(
        rr.observations > 0 && rr.observations < rr.round_trips,
        "{name}: the warm-up is left out: {rr:?}"
    );
    let received = ip6_in_receives(bed.server_ns().unwrap_or_else(|e| panic!("{e:#}"))) - server_rx;
    assert!(
        received >= rr.round_trips,
        "{name}: the server received {received} IPv6 packets for {} round trips",
        rr.round_trips
    );
    rr
}

/// The IPv6 baseline: node 1 to node 2's underlay IPv6 address, on the link.
#[test]
fn underlay_v6_variant_carries_ipv6_traffic() {
    require_root!();
    let bed = v6_bed("underlay-v6", |_| None);
    assert_eq!(
        bed.server_ip,
        IpAddr::V6(bed.topology().node(2).addr6().expect("node2 IPv6"))
    );
    v6_rr(&bed, "underlay-v6", Duration::from_secs(1));
}

/// `agent-ebpf-host-gw-v6`: pod IPv6 to pod IPv6 through node 2's IPv6 address; a
/// request/response run with statistics on is forwarded by the fast path's IPv6 host-gw
/// (node 1's `fast_host_gw6` counts every request), and both programs' run time is read.
#[test]
fn ebpf_v6_variant_carries_ipv6_traffic_and_reports_its_programs_run_time() {
    require_root!();
    let name = "agent-ebpf-host-gw-v6";
    let bed = v6_bed(name, |bed| bed.topology().node(2).addr6().map(IpAddr::V6));
    let server = bed.topology().pods_on(2)[0];
    assert_eq!(bed.server_ip, IpAddr::V6(server.ip6().expect("pod IPv6")));
    let node1 = bed.topology().node(1).ns();
    fastpath::expect_path(node1, DEFAULT_HEALTHZ_PORT, "ebpf").unwrap_or_else(|e| panic!("{e:#}"));
    let forwarded = || {
        fastpath::packets(node1, DEFAULT_HEALTHZ_PORT, "fast_host_gw6")
            .unwrap_or_else(|e| panic!("{e:#}"))
    };
    let forwarded_before = forwarded();
    let _stats = progtime::Stats::enable().unwrap_or_else(|e| panic!("{e:#}"));
    let before = progtime::Snapshot::take();
    let rr = v6_rr(&bed, name, Duration::from_secs(2));
    let usage = before.until(&progtime::Snapshot::take());
    eprintln!("{name}: {usage:?} over {} round trips", rr.round_trips);
    for program in [TC_FROM_BRIDGE, TC_FROM_NETDEV] {
        let ns = usage.ns_per_run(program);
        assert!(ns.is_some_and(|ns| ns > 0.0), "{program}: {usage:?}");
    }
    // Both directions run the transmit program once per round trip.
    assert!(
        usage.runs(TC_FROM_BRIDGE) >= 2 * rr.round_trips,
        "{usage:?} for {} round trips",
        rr.round_trips
    );
    let forwarded = forwarded() - forwarded_before;
    assert!(
        forwarded >= rr.round_trips as f64,
        "{name}: node 1's fast path forwarded {forwarded} IPv6 packets for {} round trips",
        rr.round_trips
    );
}

/// `bench learn`'s storm is what it says: each query to the Service address is a new flow
/// that node 1 learns as a kernel flow (the DNAT happens in its netfilter) and that the remote
/// pod answers, while the paced streams stay decided by memos; without the storm nothing is
/// learnt.
#[test]
fn learn_bench_storm_learns_a_kernel_flow_per_query_and_the_streams_keep_their_memos() {
    require_root!();
    let opts = LearnOptions::new(
        bins::test_agent().unwrap_or_else(|e| panic!("{e:#}")),
        bins::test_cni_plugin().unwrap_or_else(|e| panic!("{e:#}")),
    );
    let storm = learn::variants()
        .into_iter()
        .find(|v| v.storm)
        .expect("a storm variant");
    let bed =
        learn::setup(&storm, &opts, &|m| eprintln!("{m}")).unwrap_or_else(|e| panic!("{e:#}"));
    let secs = Duration::from_secs(2);

    let quiet = learn::run_load(&bed, secs, None).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("quiet: {:?}", quiet.metrics());
    assert_eq!(quiet.learnt(), 0, "{quiet:?}");
    assert!(quiet.storm.is_none());
    assert!(quiet.streams_mbps > 0.0, "{quiet:?}");
    let share = learn::memo_share(&quiet.before, &quiet.after);
    assert!(share.is_some_and(|s| s > 90.0), "memo share {share:?}");
    assert!(quiet.programs.ns_per_run(TC_FROM_BRIDGE).is_some());
    assert!(quiet.programs.ns_per_run(TC_FROM_NETDEV).is_some());

    let answered_before = bed.answered();
    let load = learn::run_load(&bed, secs, Some(200)).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("storm: {:?}", load.metrics());
    let q = load.storm.expect("the storm ran");
    assert!(q.sent >= 300, "{q:?}");
    assert!(q.answered * 10 >= q.sent * 9, "{q:?}");
    assert!(bed.answered() - answered_before >= q.answered, "{q:?}");
    assert!(
        load.learnt() * 10 >= q.sent * 9 && load.learnt() <= q.sent,
        "{} kernel flows learnt for {q:?}",
        load.learnt()
    );
    let share = learn::memo_share(&load.before, &load.after);
    assert!(share.is_some_and(|s| s > 90.0), "memo share {share:?}");
}

/// `bench programs` times the floor and the agent on each of its packets: the run fails
/// unless every timed run redirected its packet and, for the agent, a memo took each run of
/// the remembered TCP flows and none of the ICMP echoes (checked by the bench itself).
#[test]
fn programs_bench_times_both_variants_on_their_paths() {
    require_root!();
    if flannel_agent::EBPF_OBJECT.is_empty() {
        eprintln!("skipped: flannel-agent was built with AYA_BUILD_SKIP=1");
        return;
    }
    let opts = ProgramsOptions {
        reps: 2,
        calls: 20,
        ..ProgramsOptions::default()
    };
    let report = programs::run_all(&opts, &|m| eprintln!("{m}"), &|| false)
        .unwrap_or_else(|e| panic!("{e:#}"));
    for variant in ["floor", "agent"] {
        for (key, ..) in programs::METRICS {
            let ns = report.median(variant, key);
            assert!(ns.is_some_and(|ns| ns > 0.0), "{variant} {key}: {ns:?}");
        }
    }
    // Torn down: the variants' namespaces and the agent's pins.
    let prefix = flannel_tests::netns::run_prefix();
    for variant in ["floor", "agent"] {
        let name = format!("{prefix}pc{variant}");
        assert!(!flannel_tests::netns::list().contains(&name), "{name} left");
        let pin = std::path::Path::new("/sys/fs/bpf").join(&name);
        assert!(!pin.exists(), "{} left", pin.display());
    }
}

#[test]
fn control_bench_converges_and_counts() {
    require_root!();
    control_bench_runs(false, vec![Dataplane::Kernel, Dataplane::Ebpf]);
}

/// The control bench with its leases as Node objects (`--kube`): the agent in kube mode takes
/// all 300 from the fake API server, and sees Nodes created and deleted.
#[test]
fn control_bench_in_kube_mode_converges_and_counts() {
    require_root!();
    control_bench_runs(true, vec![Dataplane::Ebpf]);
}

/// The control bench against a baseline agent (`--baseline-agent`, here a copy of the same
/// build) over two rounds: each round runs both agents on fresh topologies, the baseline
/// first in the first round and second in the next; every run converges on all 100 leases,
/// and the report holds their ratios, each the agent's median over the rounds divided by the
/// baseline's.
#[test]
fn control_bench_against_a_baseline_agent_alternates_and_reports_ratios() {
    require_root!();
    let agent = bins::test_agent().unwrap_or_else(|e| panic!("{e:#}"));
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let baseline = dir.path().join("flannel-agent-baseline");
    std::fs::copy(&agent, &baseline).unwrap_or_else(|e| panic!("{e}"));
    let opts = ControlOptions {
        nodes: vec![100],
        agent: Some(agent),
        timeout: Duration::from_secs(60),
        dataplanes: vec![Dataplane::Kernel],
        events: 2,
        kube: false,
        baseline: Some(baseline),
        rounds: 2,
    };
    let results =
        control::run(&opts, &|m| eprintln!("{m}"), &|| false).unwrap_or_else(|e| panic!("{e:#}"));
    let report = control::markdown(&results, &flannel_tests::bench::report::Machine::current());
    eprintln!("{report}");
    let roles: Vec<&str> = results.iter().map(|r| r.agent.as_str()).collect();
    assert_eq!(
        roles,
        [
            control::BASELINE,
            control::AGENT,
            control::AGENT,
            control::BASELINE
        ]
    );
    for r in &results {
        assert_eq!(r.error, None);
        assert_eq!((r.routes, r.neighbours, r.fdb), (100, 100, 100));
        assert_eq!(r.event_add_ms.map(|l| l.n), Some(2), "{r:?}");
    }
    let ratios = control::ratios(&results);
    assert_eq!(ratios.len(), 1, "{ratios:?}");
    let ratio = &ratios[0];
    assert_eq!((ratio.leases, ratio.rounds), (100, 2));
    let median = |role: &str, f: &dyn Fn(&control::ControlResult) -> Option<f64>| {
        let v: Vec<f64> = results
            .iter()
            .filter(|r| r.agent == role)
            .filter_map(f)
            .collect();
        assert_eq!(v.len(), 2, "{role}");
        (v[0] + v[1]) / 2.0
    };
    let want = |f: &dyn Fn(&control::ControlResult) -> Option<f64>| {
        median(control::AGENT, f) / median(control::BASELINE, f)
    };
    let close = |got: Option<f64>, want: f64| got.is_some_and(|g| (g - want).abs() < 1e-9);
    assert!(
        close(ratio.converge, want(&|r| r.converge_seconds)),
        "{ratio:?}"
    );
    assert!(
        close(ratio.event_add, want(&|r| r.event_add_ms.map(|l| l.p50))),
        "{ratio:?}"
    );
    assert!(
        close(ratio.peak_rss, want(&|r| r.peak_rss_kib.map(|k| k as f64))),
        "{ratio:?}"
    );
    assert_eq!(ratio.map, None, "no route map on the kernel path");
    assert!(
        report.contains("The agent against the baseline agent"),
        "{report}"
    );
}

/// Runs the control bench with 300 leases (in etcd, or as Nodes with `kube`) on `dataplanes`
/// and checks every count it reports.
fn control_bench_runs(kube: bool, dataplanes: Vec<Dataplane>) {
    let opts = ControlOptions {
        nodes: vec![300],
        agent: Some(bins::test_agent().unwrap_or_else(|e| panic!("{e:#}"))),
        timeout: Duration::from_secs(60),
        dataplanes: dataplanes.clone(),
        events: 3,
        kube,
        baseline: None,
        rounds: 1,
    };
    let results =
        control::run(&opts, &|m| eprintln!("{m}"), &|| false).unwrap_or_else(|e| panic!("{e:#}"));
    let report = control::markdown(&results, &flannel_tests::bench::report::Machine::current());
    eprintln!("{report}");
    assert_eq!(report.contains("The agent against the floor"), !kube);
    assert_eq!(results.len(), dataplanes.len());
    for r in &results {
        assert_eq!(r.error, None);
        assert_eq!(r.store, if kube { "kube" } else { "etcd" });
        assert_eq!(r.keys_in_etcd, 300);
        assert_eq!((r.routes, r.neighbours, r.fdb), (300, 300, 300));
        assert!(r.converge_seconds.is_some() && r.lease_seconds <= r.converge_seconds);
        assert!(r.peak_rss_kib.is_some_and(|k| k > 0));
        assert!(r.writing_reconciles >= 1, "{r:?}");
        assert!(
            r.reconciles.is_some_and(|n| n >= r.writing_reconciles),
            "{r:?}"
        );
        // Every lease event was seen arriving and leaving, and made at least one reconcile
        // (bursts coalesce).
        assert_eq!(r.event_add_ms.map(|l| l.n), Some(3), "{r:?}");
        assert_eq!(r.event_delete_ms.map(|l| l.n), Some(3), "{r:?}");
        assert!(
            r.event_reconcile_ms.is_some_and(|l| (1..=6).contains(&l.n)),
            "{r:?}"
        );
        check_floor(r, kube);
        let appliers: Vec<&str> = r.applier_seconds.iter().map(|(n, _)| n.as_str()).collect();
        match r.dataplane.as_str() {
            "kernel" => {
                // Every entry written once: 300 routes, neighbours and FDB entries.
                assert_eq!(r.kernel_writes, 900, "{r:?}");
                assert_eq!(r.map_seconds, None);
                assert_eq!(appliers, ["kernel"]);
                assert_eq!(r.event_ebpf_ms, None, "{r:?}");
            }
            "ebpf" => {
                // The kernel's 900 plus 300 route-map and 300 node-map entries. In kube mode
                // the Nodes can arrive in two lease snapshots, and the second one's map
                // entries be written by a quick pass while the kernel applier works on the
                // first, which logs no `dataplane reconciled` line.
                if kube {
                    assert!((900..=1500).contains(&r.kernel_writes), "{r:?}");
                } else {
                    assert_eq!(r.kernel_writes, 1500, "{r:?}");
                }
                assert!(r.map_seconds.is_some(), "{r:?}");
                assert!(
                    appliers.contains(&"ebpf") && appliers.contains(&"kernel"),
                    "{r:?}"
                );
                assert_eq!(
                    r.event_ebpf_ms.map(|l| l.n),
                    r.event_reconcile_ms.map(|l| l.n),
                    "{r:?}"
                );
            }
            other => panic!("dataplane {other}"),
        }
    }
}

/// With etcd, the run's floor was measured (300 leases listed and their kernel entries
/// written, or it fails; the 3 event leases seen by the bare watcher) and the report's ratios
/// are the run's figures over it. Kube mode has none.
fn check_floor(r: &control::ControlResult, kube: bool) {
    let Some(floor) = &r.floor else {
        assert!(kube, "no floor with etcd: {r:?}");
        return;
    };
    assert!(!kube, "a floor in kube mode: {r:?}");
    assert!(
        floor.list_seconds > 0.0 && floor.kernel_seconds > 0.0,
        "{floor:?}"
    );
    assert_eq!(floor.event_add_ms.map(|l| l.n), Some(3), "{floor:?}");
    assert_eq!(floor.event_delete_ms.map(|l| l.n), Some(3), "{floor:?}");
    let ratio = control_floor::ratio(r).unwrap_or_else(|| panic!("no ratio: {r:?}"));
    let close = |got: Option<f64>, want: f64| got.is_some_and(|g| (g - want).abs() < 1e-9);
    let converge = r.converge_seconds.unwrap_or(f64::NAN);
    assert!(
        close(
            ratio.converge,
            converge / (floor.list_seconds + floor.kernel_seconds)
        ),
        "{ratio:?}"
    );
    let p50 = |l: Option<control::Latency>| l.map_or(f64::NAN, |l| l.p50);
    assert!(
        close(
            ratio.event_add,
            p50(r.event_add_ms) / p50(floor.event_add_ms)
        ),
        "{ratio:?}"
    );
    assert!(
        close(
            ratio.event_delete,
            p50(r.event_delete_ms) / p50(floor.event_delete_ms)
        ),
        "{ratio:?}"
    );
}

/// The bench's fast-path share, measured as `bench dataplane` measures it, on the variant where
/// a silent fallback to the kernel once went unnoticed: a bulk IPv6 transfer over VXLAN between
/// the eBPF nodes is carried by the fast path (GSO packets included, through `flannel-v6.1`).
#[test]
fn ebpf_vxlan_v6_variant_keeps_its_bulk_traffic_on_the_fast_path() {
    require_root!();
    let name = "agent-ebpf-vxlan-v6";
    let v = variant::find(name).expect("variant");
    let mut bed = v
        .prepare(&ctx())
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    dataplane::start_servers(&mut bed, Some(0)).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let nodes = bed.fast_path_nodes();
    assert_eq!(nodes.len(), 2, "{name}: both nodes on the eBPF path");
    let client = bed.client_ns().unwrap_or_else(|e| panic!("{e:#}"));
    let counts = || dataplane::verdict_counts(&nodes).unwrap_or_else(|e| panic!("{e:#}"));
    let before = counts();
    let t = measure::iperf3_tcp(
        client,
        bed.server_ip,
        1,
        Duration::from_secs(3),
        &measure::TcpTuning::default(),
    )
    .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let after = counts();
    let device = fastpath::grown(&before, &after, TC_FROM_BRIDGE, "fast_vxlan6_device");
    let share = dataplane::fast_share(&before, &after).expect("the programs counted verdicts");
    eprintln!(
        "{name}: {:.2} Gbit/s, fast-path share {share:.3} %, {device} GSO packets to flannel-v6.1",
        t.gbps
    );
    assert!(t.gbps > 0.1, "{name}: {} Gbit/s", t.gbps);
    assert!(share > 99.0, "{name}: fast-path share {share} %");
    assert!(device > 0, "{name}: no GSO packet went to flannel-v6.1");
}
