//! `flannel-lab bench dataplane`: every variant set up side by side, then measured in
//! round-robin repetitions (rep 1: A B C, rep 2: B C A, …; see [`super::rounds`]) so slow
//! drifts of the machine spread over all variants; medians are compared with the baseline
//! variant of the same run.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::{Context as _, Result};
use serde_json::json;

use flannel_common::{
    programs::{TC_BENCH_FLOOR, TC_FROM_BRIDGE, TC_FROM_NETDEV},
    stats::{Reason, ReasonKind},
};

use super::{
    crr,
    measure::{self, CRR_PORT, IPERF_PORT},
    progtime,
    report::Report,
    rounds::{self, Bench, Metric, Plan},
    stats::Summary,
    variant::{self, SetupCtx, Testbed, Variant},
};
use crate::{
    lab::{
        agent::DEFAULT_HEALTHZ_PORT,
        bins,
        fastpath::{self, Counts},
        probe,
        process::{Output, Process, wait_tcp_listen},
    },
    netns::NetNs,
};

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct DataplaneOptions {
    /// Variant names; the first is the baseline unless `baseline` names another.
    pub variants: Vec<String>,
    /// The variant ratios are relative to.
    pub baseline: String,
    /// Repetitions of every measurement.
    pub reps: usize,
    /// Length of each throughput run.
    pub duration: Duration,
    /// Length of each request/response run.
    pub rr_duration: Duration,
    /// CPU both ends of the request/response test are pinned to (`None`: unpinned); see
    /// [`measure::sockperf_rr`].
    pub rr_cpu: Option<usize>,
    /// The throughput runs' pinned CPUs and fixed window (default: neither).
    pub tcp: measure::TcpTuning,
    /// Length of each connection-rate run (one with 1 client, one with [`CRR_CLIENTS`]).
    pub crr_duration: Duration,
    /// Report name (file names and title).
    pub name: String,
}

impl Default for DataplaneOptions {
    fn default() -> Self {
        DataplaneOptions {
            variants: variant::DEFAULT_VARIANTS
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            baseline: variant::UNDERLAY.to_owned(),
            reps: 5,
            duration: Duration::from_secs(5),
            rr_duration: Duration::from_secs(5),
            rr_cpu: Some(0),
            tcp: measure::TcpTuning::default(),
            crr_duration: Duration::from_secs(3),
            name: "dataplane".to_owned(),
        }
    }
}

/// How long the extra request/response run that reads the programs' run time lasts.
const PROG_TIME_RR: Duration = Duration::from_secs(2);

/// How long the extra connection-rate run ([`CRR_CLIENTS`] clients) that reads the programs'
/// run time per new connection lasts.
const PROG_TIME_CRR: Duration = Duration::from_secs(2);

/// Request/response connections per repetition. The pinned ping-pong settles, per TCP
/// connection and for its whole life, in one of two modes (on these machines ~9 or ~14 µs, on
/// the underlay and on the pod paths alike, with the same packets per round trip, also under
/// `SCHED_FIFO`), so a single connection per repetition measures that draw as much as the
/// dataplane. Each repetition runs this many connections, sharing the request/response time
/// (at least 1 s each), and reports their median and the fastest one's p50 (where both paths
/// had the same luck).
pub const RR_CONNECTIONS: u32 = 5;

/// Concurrent clients of the many-clients connection-rate run (and accepting threads of its
/// server): two per CPU of these machines.
pub const CRR_CLIENTS: usize = 4;

/// The metrics, in report order: key, label, unit, higher is better. Entries 6 to 8 are the
/// fast path's own time ([`progtime`]) in a request/response run of their own, for the
/// variants whose traffic runs the agent's programs (the kernel clock reads that statistics
/// add to every run are included). The last is the share of the packets the agents'
/// `tc_from_bridge` and `tc_from_netdev` saw during the one-stream transfer that the fast path
/// carried (the rest were handed to the kernel or dropped): a variant that says eBPF is only
/// measured as such when this is near 100 % ([`fast_share`]). Entries 10 and 11 are new TCP
/// connections per second ([`crr`]: connect, 64-byte request, 128-byte response, close), with
/// one client and with [`CRR_CLIENTS`]: every connection's first packets take the programs'
/// full checks and leave a flow memo behind, which the other metrics' long-lived connections
/// do not show. Entry 12 is the programs' time per new connection, in a connection-rate run
/// of its own with statistics on (like entry 6). The last, the one-stream transfer's
/// retransmitted segments per GB, tells a path that loses or reorders packets from one that
/// is slower.
pub const METRICS: [Metric; 14] = [
    ("tcp1_gbps", "TCP 1 stream", "Gbit/s", true),
    ("tcp2_gbps", "TCP 2 streams", "Gbit/s", true),
    ("rr_p50_us", "TCP RR latency p50", "µs", false),
    (
        "rr_best_us",
        "TCP RR latency p50, fastest connection",
        "µs",
        false,
    ),
    (
        "cpu1_s_per_gbit",
        "CPU per Gbit, 1 stream",
        "CPU-s/Gbit",
        false,
    ),
    (
        "cpu2_s_per_gbit",
        "CPU per Gbit, 2 streams",
        "CPU-s/Gbit",
        false,
    ),
    ("bpf_rr_us", "eBPF time per round trip", "µs", false),
    ("from_bridge_ns", "tc_from_bridge per run (RR)", "ns", false),
    ("from_netdev_ns", "tc_from_netdev per run (RR)", "ns", false),
    (
        "fast_share_pct",
        "fast-path share of pod packets, 1 stream",
        "%",
        true,
    ),
    ("crr1_cps", "new TCP connections, 1 client", "conn/s", true),
    // The label's count is CRR_CLIENTS.
    ("crrn_cps", "new TCP connections, 4 clients", "conn/s", true),
    (
        "bpf_crr_us",
        "eBPF time per new connection (4 clients)",
        "µs",
        false,
    ),
    (
        "tcp1_retrans_per_gb",
        "retransmitted segments per GB, 1 stream",
        "/GB",
        false,
    ),
];

/// Starts the iperf3 server, the request/response server and the connection-rate server
/// (`flannel-lab crr --listen`) in the testbed's server namespace and checks the client
/// reaches the server address. The request/response server is sockperf for an IPv4 server
/// address and `flannel-lab rr` for an IPv6 one ([`measure::RrTool`]), pinned to `rr_cpu`
/// either way.
pub fn start_servers(bed: &mut Testbed, rr_cpu: Option<usize>) -> Result<()> {
    let tool = measure::RrTool::for_server(bed.server_ip);
    let lab = match tool {
        measure::RrTool::LabRr => bins::lab_tool()?.to_string_lossy().into_owned(),
        measure::RrTool::Sockperf => String::new(),
    };
    let rr_server = tool.server_argv(bed.server_ip, &lab);
    let cpu = rr_cpu.map(|c| c.to_string());
    let mut rr_argv = measure::pin_prefix(&cpu);
    rr_argv.extend(rr_server.iter().map(String::as_str));
    let (iperf, rr, crr) = {
        let server = bed.server_ns()?;
        // iperf3 listens on every address of both families.
        let mut iperf = Process::spawn(
            server,
            &["iperf3", "-s", "-p", &IPERF_PORT.to_string()],
            Output::Null,
        )?;
        wait_tcp_listen(server, IPERF_PORT, &mut iperf, Duration::from_secs(10))?;
        let mut rr = Process::spawn(server, &rr_argv, Output::Null)?;
        wait_tcp_listen(server, tool.port(), &mut rr, Duration::from_secs(10))?;
        let crr = crr::spawn_server(
            server,
            SocketAddr::new(bed.server_ip, CRR_PORT),
            CRR_CLIENTS,
        )?;
        probe::tcp_reaches(
            bed.client_ns()?,
            server,
            bed.server_ip,
            Duration::from_secs(5),
        )
        .with_context(|| format!("the client cannot reach {}", bed.server_ip))?;
        (iperf, rr, crr)
    };
    bed.keep(iperf);
    bed.keep(rr);
    bed.keep(crr);
    Ok(())
}

/// [`rounds::Bench`] over the [`variant`] testbeds.
struct Dataplane<'a> {
    opts: &'a DataplaneOptions,
    ctx: &'a SetupCtx,
}

impl Bench for Dataplane<'_> {
    type Variant = Variant;
    type Bed = Testbed;

    const METRICS: &'static [Metric] = &METRICS;
    const KIND: &'static str = "variant";

    fn all() -> Vec<Variant> {
        variant::all()
    }

    fn label(v: &Variant) -> (&'static str, &'static str) {
        (v.name, v.description)
    }

    /// IPv6 variants are compared with `underlay-v6` when it runs: their request/response is
    /// measured by another tool than IPv4's (see [`ipv6_rr_note`]).
    fn own_baseline(v: &Variant) -> Option<&'static str> {
        v.topology.ipv6.then_some(variant::UNDERLAY_V6)
    }

    fn set_up(&self, v: &Variant, log: &dyn Fn(&str)) -> Result<Testbed> {
        let mut bed = v.prepare(self.ctx)?;
        start_servers(&mut bed, self.opts.rr_cpu).with_context(|| format!("variant {}", v.name))?;
        log(&format!(
            "  client {:?} -> server {:?} at {}",
            bed.client, bed.server, bed.server_ip
        ));
        Ok(bed)
    }

    fn steps(&self) -> usize {
        5
    }

    /// Step 0: one stream (throughput, CPU); 1: two streams; 2: request/response; 3:
    /// connection rate, 1 client then [`CRR_CLIENTS`]; 4: the programs' run time with BPF
    /// statistics on, per round trip of a request/response run and per connection of a
    /// connection-rate run. The per-connection time comes after the connection rate, so
    /// that both see the same steady state: the clients' ports coming back and finding
    /// their flows' memos, not each port's first use on a new testbed.
    fn measure(&self, bed: &Testbed, step: usize) -> Result<Vec<(usize, f64)>> {
        let client = bed.client_ns()?;
        let opts = self.opts;
        Ok(match step {
            0 | 1 => {
                let streams = if step == 0 { 1 } else { 2 };
                let nodes = if step == 0 {
                    bed.fast_path_nodes()
                } else {
                    Vec::new()
                };
                let before = verdict_counts(&nodes)?;
                let t =
                    measure::iperf3_tcp(client, bed.server_ip, streams, opts.duration, &opts.tcp)?;
                let mut values = vec![(step, t.gbps), (4 + step, t.cpu_per_gbit())];
                if step == 0 {
                    values.push((13, t.retransmits_per_gb()));
                }
                if !nodes.is_empty() {
                    values.extend(fast_share(&before, &verdict_counts(&nodes)?).map(|p| (9, p)));
                }
                values
            }
            2 => {
                let each = (opts.rr_duration / RR_CONNECTIONS).max(Duration::from_secs(1));
                let p50s = (0..RR_CONNECTIONS)
                    .map(|_| {
                        measure::rr(client, bed.server_ip, each, opts.rr_cpu).map(|rr| rr.p50_us)
                    })
                    .collect::<Result<Vec<_>>>()?;
                latency(&p50s)
            }
            3 => {
                let addr = SocketAddr::new(bed.server_ip, CRR_PORT);
                let d = opts.crr_duration;
                let one = crr::run_clients_in(client, addr, 1, d)?;
                let many = crr::run_clients_in(client, addr, CRR_CLIENTS, d)?;
                vec![(10, one.per_second()), (11, many.per_second())]
            }
            _ => {
                let _stats = progtime::Stats::enable()?;
                let before = progtime::Snapshot::take();
                let rr = measure::rr(client, bed.server_ip, PROG_TIME_RR, opts.rr_cpu)?;
                let between = progtime::Snapshot::take();
                let mut values = program_time(&before.until(&between), rr.round_trips);
                let addr = SocketAddr::new(bed.server_ip, CRR_PORT);
                let crr = crr::run_clients_in(client, addr, CRR_CLIENTS, PROG_TIME_CRR)?;
                let usage = between.until(&progtime::Snapshot::take());
                values.extend(
                    forwarding_ns(&usage, crr.connections)
                        .map(|(ns, _)| (12, ns as f64 / crr.connections as f64 / 1000.0)),
                );
                values
            }
        })
    }
}

/// The fast-path packet counters of the agents in `nodes`, summed by `(program, reason)`.
pub fn verdict_counts(nodes: &[&NetNs]) -> Result<Counts> {
    let mut sum = Counts::new();
    for ns in nodes {
        let counters = fastpath::counters(ns, DEFAULT_HEALTHZ_PORT)
            .with_context(|| format!("the fast-path counters of {}", ns.name()))?;
        for (key, n) in counters.packets {
            *sum.entry(key).or_default() += n;
        }
    }
    Ok(sum)
}

/// Of the verdicts `tc_from_bridge` and `tc_from_netdev` counted between `before` and `after`,
/// the percentage that were the fast path's ([`ReasonKind::Fast`]) rather than handed to the
/// kernel or dropped; `None` when they counted none.
pub fn fast_share(before: &Counts, after: &Counts) -> Option<f64> {
    let (mut fast, mut all) = (0u64, 0u64);
    for program in [TC_FROM_BRIDGE, TC_FROM_NETDEV] {
        for reason in Reason::ALL {
            let kind = reason.kind();
            if matches!(kind, ReasonKind::Fast | ReasonKind::Pass | ReasonKind::Drop) {
                let n = fastpath::grown(before, after, program, reason.name());
                all += n;
                if kind == ReasonKind::Fast {
                    fast += n;
                }
            }
        }
    }
    (all > 0).then(|| 100.0 * fast as f64 / all as f64)
}

/// The [`METRICS`] entries of [`RR_CONNECTIONS`] connections' p50 latencies: their median
/// and the fastest.
fn latency(p50s: &[f64]) -> Vec<(usize, f64)> {
    Summary::of(p50s)
        .map(|s| vec![(2, s.median), (3, s.min)])
        .unwrap_or_default()
}

/// The [`METRICS`] entries of the programs' time over `round_trips` round trips: the fast
/// path's when its transmit program ran for every round trip, the floor program's alone when
/// it did (the `floor-ebpf-*` variants), none otherwise (a kernel-path variant: what the other
/// testbeds' programs run meanwhile, for their agents' own traffic, is not this variant's).
fn program_time(usage: &progtime::Usage, round_trips: u64) -> Vec<(usize, f64)> {
    let Some((ns, forwarder)) = forwarding_ns(usage, round_trips) else {
        return Vec::new();
    };
    let mut values = vec![(6, ns as f64 / round_trips as f64 / 1000.0)];
    if forwarder == Forwarder::Agent {
        values.extend(usage.ns_per_run(TC_FROM_BRIDGE).map(|ns| (7, ns)));
        values.extend(usage.ns_per_run(TC_FROM_NETDEV).map(|ns| (8, ns)));
    }
    values
}

/// Whose programs forwarded a measurement's traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Forwarder {
    /// The agent's fast path.
    Agent,
    /// The `floor-ebpf-*` variants' program.
    Floor,
}

/// The time of the programs that forwarded `units` exchanges (round trips, connections), ns,
/// and whose they were: the fast path's programs together when its transmit program ran at
/// least once per unit, the floor program's alone when that one did, `None` otherwise (see
/// [`program_time`]).
fn forwarding_ns(usage: &progtime::Usage, units: u64) -> Option<(u64, Forwarder)> {
    let ran = |program| units > 0 && usage.runs(program) >= units;
    if ran(TC_FROM_BRIDGE) {
        Some((usage.total_ns(), Forwarder::Agent))
    } else if ran(TC_BENCH_FLOOR) {
        Some((usage.ns(TC_BENCH_FLOOR), Forwarder::Floor))
    } else {
        None
    }
}

/// Sets up every variant, measures them round-robin and summarises against the baseline.
/// `log` gets progress lines; `cancelled` is polled between steps (Ctrl-C).
pub fn run(
    opts: &DataplaneOptions,
    ctx: &SetupCtx,
    log: &dyn Fn(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<Report> {
    let plan = Plan::new(&opts.name, &opts.variants, &opts.baseline, opts.reps);
    let mut settings = json!({
        "reps": opts.reps,
        "throughput_seconds": opts.duration.as_secs(),
        "rr_seconds": opts.rr_duration.as_secs(),
        "rr_pinned_cpu": opts.rr_cpu,
        "tcp_pinned_cpus": opts.tcp.cpus.map(|c| format!("client {}, server {}", c.client, c.server)),
        "tcp_window": opts.tcp.window.as_ref().map(|w| w.to_string()),
        "tools": "iperf3 -J (TCP, 1 and 2 streams), sockperf ping-pong --tcp -m 64 --full-rtt, flannel-lab crr (connect, 64-byte request, 128-byte response, server closes)",
        "crr_seconds": opts.crr_duration.as_secs(),
        "rr_connections": RR_CONNECTIONS,
        "cpu": "machine-wide busy time from /proc/stat during each iperf3 run / Gbit received",
        "fast_share": "of the verdicts the agents' tc_from_bridge and tc_from_netdev counted during each 1-stream iperf3 run (every node on the eBPF path), the share that were the fast path's (not handed to the kernel or dropped)",
        "ebpf_time": "BPF_ENABLE_STATS run time of tc_from_bridge, tc_from_netdev, tc_to_netdev and xdp_from_netdev (every node; tc_bench_floor for the floor variant) during a separate 2 s sockperf run, per round trip and per run, and during a separate 2 s connection-rate run (4 clients), per connection",
    });
    if let (Some(note), Some(obj)) = (ipv6_rr_note(&opts.variants), settings.as_object_mut()) {
        obj.insert("tools_ipv6".to_owned(), note.into());
    }
    rounds::run(&Dataplane { opts, ctx }, plan, settings, log, cancelled)
}

/// The report's note on how the IPv6 variants among `names` measure request/response
/// latency, `None` without IPv6 variants.
fn ipv6_rr_note(names: &[String]) -> Option<String> {
    let v6: Vec<&str> = names
        .iter()
        .filter(|name| variant::find(name).is_some_and(|v| v.topology.ipv6))
        .map(String::as_str)
        .collect();
    (!v6.is_empty()).then(|| {
        format!(
            "TCP RR and eBPF time of the IPv6 variants ({}) by flannel-lab rr (one connection, \
             TCP_NODELAY, 64-byte request echoed, every round trip timed, {} ms warm-up, same \
             pinning and connections), not sockperf, which rejects IPv6 addresses; their \
             ratios are to underlay-v6 when it runs too (then it is their baseline)",
            v6.join(", "),
            super::rr::WARMUP.as_millis()
        )
    })
}

/// What [`smoke`] measured (1 s each, not a measurement to compare).
#[derive(Debug, Clone, Copy)]
pub struct Smoke {
    /// One-stream iperf3 throughput.
    pub gbps: f64,
    /// Request/response p50.
    pub p50_us: f64,
    /// New connections per second, one client.
    pub cps: f64,
}

/// A quick single-pair check used by tests: 1 s each of iperf3, of the request/response tool
/// ([`measure::rr`]: sockperf for IPv4, `flannel-lab rr` for IPv6) and of the connection-rate
/// client (one client, against the server [`start_servers`] started) against `ip` from `bed`'s
/// client.
pub fn smoke(bed: &Testbed, ip: IpAddr) -> Result<Smoke> {
    let client = bed.client_ns()?;
    let t = measure::iperf3_tcp(
        client,
        ip,
        1,
        Duration::from_secs(1),
        &measure::TcpTuning::default(),
    )?;
    let rr = measure::rr(client, ip, Duration::from_secs(1), None)?;
    let addr = SocketAddr::new(ip, CRR_PORT);
    let crr = crr::run_clients_in(client, addr, 1, Duration::from_secs(1))?;
    Ok(Smoke {
        gbps: t.gbps,
        p50_us: rr.p50_us,
        cps: crr.per_second(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_share_counts_verdicts_of_the_pod_programs_only() {
        let counts = |pairs: &[(&str, Reason, u64)]| -> Counts {
            pairs
                .iter()
                .map(|(p, r, n)| (((*p).to_owned(), r.name().to_owned()), *n))
                .collect()
        };
        let before = counts(&[(TC_FROM_BRIDGE, Reason::FastVxlan6, 10)]);
        let after = counts(&[
            (TC_FROM_BRIDGE, Reason::FastVxlan6, 100),
            (TC_FROM_BRIDGE, Reason::Ipv6Tcp, 1000),
            (TC_FROM_BRIDGE, Reason::PassGso, 10),
            (TC_FROM_NETDEV, Reason::FastDeliverVxlan6, 100),
            (TC_FROM_NETDEV, Reason::DeliverPeer, 100),
            (TC_FROM_NETDEV, Reason::PassKernelFlow, 80),
            ("tc_to_netdev", Reason::PassNoRoute, 5000),
        ]);
        // 90 + 100 fast of 90 + 10 + 100 + 80 verdicts; classes, events and other programs
        // aside.
        let share = fast_share(&before, &after).expect("verdicts");
        assert!((share - 100.0 * 190.0 / 280.0).abs() < 1e-9, "{share}");
        assert_eq!(fast_share(&after, &after), None, "nothing counted");
    }

    #[test]
    fn program_time_belongs_to_variants_whose_traffic_ran_the_programs() {
        let before = progtime::Snapshot::from_totals(&[]);
        let fast = progtime::Snapshot::from_totals(&[
            (TC_FROM_BRIDGE, 600_000, 2_000),
            (TC_FROM_NETDEV, 800_000, 2_000),
        ]);
        assert_eq!(
            program_time(&before.until(&fast), 1_000),
            vec![(6, 1.4), (7, 300.0), (8, 400.0)]
        );
        // Another testbed's agent traffic during a kernel-path variant's run.
        let background = progtime::Snapshot::from_totals(&[(TC_FROM_NETDEV, 11_000, 2)]);
        assert_eq!(program_time(&before.until(&background), 1_000), vec![]);
        assert_eq!(program_time(&before.until(&fast), 0), vec![]);
        // The floor variant: its one program, four runs per round trip; the agents of other
        // testbeds running meanwhile are not counted.
        let floor = progtime::Snapshot::from_totals(&[
            (TC_BENCH_FLOOR, 400_000, 4_000),
            (TC_FROM_NETDEV, 11_000, 2),
        ]);
        assert_eq!(program_time(&before.until(&floor), 1_000), vec![(6, 0.4)]);
        // Per connection (the same rule, another unit).
        assert_eq!(
            forwarding_ns(&before.until(&fast), 200),
            Some((1_400_000, Forwarder::Agent))
        );
        assert_eq!(
            forwarding_ns(&before.until(&floor), 4_000),
            Some((400_000, Forwarder::Floor))
        );
        assert_eq!(forwarding_ns(&before.until(&floor), 4_001), None);
        assert_eq!(forwarding_ns(&before.until(&background), 2), None);
        assert_eq!(METRICS[12].0, "bpf_crr_us");
        assert_eq!(METRICS[13].0, "tcp1_retrans_per_gb");
    }

    #[test]
    fn the_report_names_the_ipv6_rr_tool_when_ipv6_variants_run() {
        let names = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            ipv6_rr_note(&names(&["underlay", "agent-ebpf-host-gw"])),
            None
        );
        let note = ipv6_rr_note(&names(&[
            "underlay-v6",
            "underlay",
            "agent-ebpf-host-gw-v6",
        ]))
        .expect("a note");
        assert!(
            note.contains("(underlay-v6, agent-ebpf-host-gw-v6)"),
            "{note}"
        );
        assert!(note.contains("flannel-lab rr"), "{note}");
    }

    #[test]
    fn latency_is_the_connections_median_and_fastest() {
        assert_eq!(
            latency(&[14.1, 9.2, 14.8, 9.0, 13.9]),
            vec![(2, 13.9), (3, 9.0)]
        );
        assert_eq!(latency(&[]), vec![]);
        // The metric indices match METRICS.
        assert_eq!(METRICS[2].0, "rr_p50_us");
        assert_eq!(METRICS[3].0, "rr_best_us");
        assert_eq!(METRICS[4].0, "cpu1_s_per_gbit");
        assert_eq!(METRICS[6].0, "bpf_rr_us");
        assert_eq!(METRICS[8].0, "from_netdev_ns");
    }
}
