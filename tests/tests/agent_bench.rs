//! The agent-driven benchmark setups work: each `agent-*` kernel variant of `flannel-lab bench
//! dataplane` carries iperf3 and sockperf traffic through the path it names, and `bench
//! control` converges on a few hundred fake leases with its counters filled in; the eBPF
//! variants' program run time is read. No timing is asserted (the numbers are the benchmarks'
//! job); the paths and counts are.
//!
//! Run: `cargo test -p flannel-tests --test agent_bench` (as root; skipped otherwise).

use std::{net::IpAddr, time::Duration};

use flannel_common::programs::{TC_FROM_BRIDGE, TC_FROM_NETDEV};
use flannel_tests::{
    bench::{
        control::{self, ControlOptions},
        dataplane, measure, progtime,
        variant::{self, SetupCtx, Testbed},
    },
    lab::{agent::Dataplane, bins},
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
    let (gbps, p50) = dataplane::smoke(&bed, bed.server_ip).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("{name}: {gbps:.2} Gbit/s, RR p50 {p50:.1} µs (1 s each, not a measurement)");
    assert!(gbps > 0.0 && p50 > 0.0, "{name}: {gbps} Gbit/s, {p50} µs");
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
/// transmit and the receive program, about as often as round trips were made.
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
}

#[test]
fn control_bench_converges_and_counts() {
    require_root!();
    let opts = ControlOptions {
        nodes: vec![300],
        agent: Some(bins::test_agent().unwrap_or_else(|e| panic!("{e:#}"))),
        timeout: Duration::from_secs(60),
        dataplanes: vec![Dataplane::Kernel, Dataplane::Ebpf],
        events: 3,
    };
    let results =
        control::run(&opts, &|m| eprintln!("{m}"), &|| false).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!(
        "{}",
        control::markdown(&results, &flannel_tests::bench::report::Machine::current())
    );
    assert_eq!(results.len(), 2);
    for r in &results {
        assert_eq!(r.error, None);
        assert_eq!(r.keys_in_etcd, 300);
        assert_eq!((r.routes, r.neighbours, r.fdb), (300, 300, 300));
        assert!(r.converge_seconds.is_some() && r.lease_seconds <= r.converge_seconds);
        assert!(r.peak_rss_kib.is_some_and(|k| k > 0));
        assert!(r.writing_reconciles >= 1, "{r:?}");
        assert!(
            r.reconciles.is_some_and(|n| n >= r.writing_reconciles),
            "{r:?}"
        );
        // Every lease event was seen arriving and leaving.
        assert_eq!(r.event_add_ms.map(|l| l.n), Some(3), "{r:?}");
        assert_eq!(r.event_delete_ms.map(|l| l.n), Some(3), "{r:?}");
        let appliers: Vec<&str> = r.applier_seconds.iter().map(|(n, _)| n.as_str()).collect();
        match r.dataplane.as_str() {
            "kernel" => {
                // Every entry written once: 300 routes, neighbours and FDB entries.
                assert_eq!(r.kernel_writes, 900, "{r:?}");
                assert_eq!(r.map_seconds, None);
                assert_eq!(appliers, ["kernel"]);
            }
            "ebpf" => {
                // The kernel's 900 plus 300 route-map and 300 node-map entries.
                assert_eq!(r.kernel_writes, 1500, "{r:?}");
                assert!(r.map_seconds.is_some(), "{r:?}");
                assert!(
                    appliers.contains(&"ebpf") && appliers.contains(&"kernel"),
                    "{r:?}"
                );
            }
            other => panic!("dataplane {other}"),
        }
    }
}
