//! `flannel-lab bench learn`: what learning kernel flows costs the fast path's forwarding.
//!
//! A node learns a kernel flow (`learn_kernel_flow`, in `tc_to_netdev`) for every flow its pods
//! send to a remote pod *through the kernel*: every Service connection that kube-proxy DNATs to
//! a pod on another node, and every DNS query to a kube-dns backend there, each from a fresh
//! source port. A learnt entry retires the memos (remembered decisions) of its remote
//! endpoint, so such a storm must not send the node's other flows back through the full
//! checks. This bench measures that, in one interleaved run:
//!
//! | variant | load |
//! |---|---|
//! | `quiet` | 100 paced TCP streams pod → remote pod (the baseline) |
//! | `storm` | the same streams, plus UDP queries from fresh sockets of a second pod to a "Service" address that an iptables DNAT rule in the node sends to the remote pod, `--rate` per second |
//!
//! Every variant is its own two-node host-gw cluster (eBPF dataplane, `--ip-masq`, two pods per
//! node); the queries' server (in the remote pod) answers each, as a DNS server would. Metrics:
//! the programs' time per run (`BPF_ENABLE_STATS`, so statistics are on during every
//! measurement of this bench: its point is the programs' time, not the throughput), the share
//! of forwarded packets a memo decided, the kernel flows learnt per second, the streams'
//! throughput (the same in both: they are paced) and the share of queries answered.

use std::{
    collections::VecDeque,
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use flannel_common::programs::{TC_FROM_BRIDGE, TC_FROM_NETDEV, TC_TO_NETDEV};
use serde_json::json;

use super::{
    measure::{self, IPERF_PORT},
    progtime,
    report::Report,
    rounds::{self, Bench, Metric, Plan},
};
use crate::{
    lab::{
        agent::{DEFAULT_HEALTHZ_PORT, Dataplane},
        cluster::{Cluster, ClusterSpec},
        fastpath::{self, Counts},
        process::{Output, Process, wait_tcp_listen},
    },
    netns::NetNs,
    topology::{TopologySpec, Underlay},
};

/// The "Service" address the queries go to (DNATed in the sending node).
pub const SERVICE_ADDR: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)), 53);
/// The port the remote pod answers queries on.
pub const ANSWER_PORT: u16 = 5353;
/// Paced streams of the background load, and each one's rate.
pub const STREAMS: u32 = 100;
/// Per-stream rate of the background load (iperf3 `-b`).
pub const STREAM_RATE: &str = "2M";

/// A setup of the learn benchmark.
#[derive(Debug, Clone)]
pub struct LearnVariant {
    /// Name on the command line and in reports.
    pub name: &'static str,
    /// One line about the load.
    pub description: &'static str,
    /// Whether the query storm runs next to the streams.
    pub storm: bool,
}

/// Every variant, the baseline first.
pub fn variants() -> Vec<LearnVariant> {
    vec![
        LearnVariant {
            name: "quiet",
            description: "100 paced TCP streams pod -> remote pod (host-gw, eBPF)",
            storm: false,
        },
        LearnVariant {
            name: "storm",
            description: "the same streams plus UDP queries from fresh sockets to a DNATed Service address whose backend is on the other node (a learnt kernel flow each)",
            storm: true,
        },
    ]
}

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct LearnOptions {
    /// Repetitions of every measurement.
    pub reps: usize,
    /// Length of each measurement.
    pub duration: Duration,
    /// Queries per second of the storm.
    pub rate: u32,
    /// The agent binary.
    pub agent: PathBuf,
    /// The CNI plugin.
    pub cni: PathBuf,
    /// Report name.
    pub name: String,
}

impl LearnOptions {
    /// Defaults with these binaries: 5 repetitions of 10 s, 500 queries per second.
    pub fn new(agent: PathBuf, cni: PathBuf) -> Self {
        LearnOptions {
            reps: 5,
            duration: Duration::from_secs(10),
            rate: 500,
            agent,
            cni,
            name: "learn".to_owned(),
        }
    }
}

/// The metrics, in report order: key, label, unit, higher is better.
pub const METRICS: [Metric; 6] = [
    ("bridge_ns", "tc_from_bridge, time per run", "ns", false),
    ("netdev_ns", "tc_from_netdev, time per run", "ns", false),
    ("memo_pct", "forwarded packets a memo decided", "%", true),
    ("learns_per_s", "kernel flows learnt", "1/s", true),
    ("streams_mbps", "paced streams, received", "Mbit/s", true),
    ("answered_pct", "queries answered", "%", true),
];

/// A variant set up: its cluster, the servers in the remote pod and who sends.
pub struct LearnBed {
    // Servers go before the cluster whose namespaces they run in.
    answers: Answerer,
    _iperf: Process,
    cluster: Cluster,
    storm: bool,
    ports: Ports,
    stream_pod: usize,
    query_pod: usize,
    server_ip: Ipv4Addr,
}

impl std::fmt::Debug for LearnBed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LearnBed")
            .field("storm", &self.storm)
            .field("server_ip", &self.server_ip)
            .finish_non_exhaustive()
    }
}

impl LearnBed {
    fn pod_ns(&self, index: usize) -> &NetNs {
        self.cluster.topology().pods()[index].ns()
    }

    /// The namespace the queries come from.
    pub fn query_ns(&self) -> &NetNs {
        self.pod_ns(self.query_pod)
    }

    /// Queries the remote pod answered so far.
    pub fn answered(&self) -> u64 {
        self.answers.count()
    }
}

/// A UDP server in a namespace that sends every datagram back to where it came from, until
/// dropped.
struct Answerer {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Answerer {
    fn spawn(ns: &NetNs, port: u16) -> Result<Answerer> {
        let socket = ns
            .enter(move || {
                UdpSocket::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port))
            })?
            .with_context(|| format!("UDP port {port} in {}", ns.name()))?;
        socket.set_read_timeout(Some(Duration::from_millis(100)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let (stop2, answered2) = (stop.clone(), answered.clone());
        let thread = thread::spawn(move || {
            let mut buf = [0u8; 512];
            while !stop2.load(Ordering::Relaxed) {
                if let Ok((n, from)) = socket.recv_from(&mut buf)
                    && socket.send_to(&buf[..n], from).is_ok()
                {
                    answered2.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Ok(Answerer {
            stop,
            answered,
            thread: Some(thread),
        })
    }

    fn count(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }
}

impl Drop for Answerer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Builds a variant: the cluster, the DNAT rule in node 1 (the Service address to the remote
/// pod's answer port), iperf3 and the answerer in the remote pod; then checks that a query
/// through the Service address is answered.
pub fn setup(v: &LearnVariant, opts: &LearnOptions, log: &dyn Fn(&str)) -> Result<LearnBed> {
    let topology = TopologySpec::new(2, Underlay::L2).cni_plugin(opts.cni.clone());
    let mut spec = ClusterSpec::new(topology, "host-gw", opts.agent.clone());
    spec.dataplane = Dataplane::Ebpf;
    spec.ip_masq = true;
    spec.pods_per_node = 2;
    let mut cluster = Cluster::up(spec, &|msg| log(&format!("  {msg}")), &|| false)?;
    cluster.wait_pod_ports(Duration::from_secs(30))?;
    let pods = cluster.topology().pods();
    let on = |node: usize| -> Vec<usize> {
        (0..pods.len())
            .filter(|&i| pods[i].node() == node)
            .collect()
    };
    let (local, remote) = (on(1), on(2));
    let (Some(&stream_pod), Some(&query_pod), Some(&server_pod)) =
        (local.first(), local.get(1), remote.first())
    else {
        bail!("the cluster has not two pods on node 1 and one on node 2");
    };
    let server = &pods[server_pod];
    let server_ip = server.ip();
    let dnat_to = format!("{server_ip}:{ANSWER_PORT}");
    let service = format!("{}/32", SERVICE_ADDR.ip());
    let service_port = SERVICE_ADDR.port().to_string();
    cluster.topology().node(1).run(&[
        "iptables",
        "-t",
        "nat",
        "-A",
        "PREROUTING",
        "-d",
        &service,
        "-p",
        "udp",
        "--dport",
        &service_port,
        "-j",
        "DNAT",
        "--to-destination",
        &dnat_to,
    ])?;
    let answers = Answerer::spawn(server.ns(), ANSWER_PORT)?;
    let ports = Ports::new();
    let mut iperf = Process::spawn(
        server.ns(),
        &["iperf3", "-s", "-p", &IPERF_PORT.to_string()],
        Output::Null,
    )?;
    wait_tcp_listen(server.ns(), IPERF_PORT, &mut iperf, Duration::from_secs(10))?;
    let probe = pods[query_pod]
        .ns()
        .enter(|| storm(SERVICE_ADDR, 20, Duration::from_secs(1), &ports))??;
    if probe.answered == 0 {
        bail!(
            "no query to {SERVICE_ADDR} (DNAT to {dnat_to}) was answered: {} sent",
            probe.sent
        );
    }
    Ok(LearnBed {
        answers,
        _iperf: iperf,
        cluster,
        storm: v.storm,
        ports,
        stream_pod,
        query_pod,
        server_ip,
    })
}

/// What a storm sent and got back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StormResult {
    /// Queries sent, each from a socket of its own.
    pub sent: u64,
    /// Answers received.
    pub answered: u64,
}

/// Source ports of the queries: each query takes the next port that is free, from 1024 up and
/// then around again, so that every query of a run is a flow the node has not seen (the
/// kernel's random ephemeral ports would repeat earlier queries' flows more and more often
/// over the repetitions of a run, and the learn rate would fall with every one).
#[derive(Debug)]
pub struct Ports(AtomicU32);

impl Ports {
    const FIRST: u32 = 1024;

    /// From the first port.
    pub fn new() -> Ports {
        Ports(AtomicU32::new(Self::FIRST))
    }

    fn next(&self) -> u16 {
        let n = self.0.fetch_add(1, Ordering::Relaxed);
        let span = u32::from(u16::MAX) + 1 - Self::FIRST;
        (Self::FIRST + (n - Self::FIRST) % span) as u16
    }

    /// A UDP socket on the next free port.
    fn socket(&self) -> Result<UdpSocket> {
        let mut last = None;
        for _ in 0..64 {
            match UdpSocket::bind((Ipv4Addr::UNSPECIFIED, self.next())) {
                Ok(socket) => return Ok(socket),
                Err(e) => last = Some(e),
            }
        }
        Err(last.map_or_else(|| anyhow::anyhow!("no port"), Into::into))
            .context("no free UDP port in 64 tries")
    }
}

impl Default for Ports {
    fn default() -> Self {
        Ports::new()
    }
}

/// Sends `rate` queries per second to `to` for `duration`, each from a fresh UDP socket on a
/// port of `ports` (a new flow each), as a resolver without a socket cache does. A socket is
/// kept for 200 ms to take its answer, then closed.
pub fn storm(to: SocketAddr, rate: u32, duration: Duration, ports: &Ports) -> Result<StormResult> {
    let rate = rate.max(1);
    let keep = Duration::from_millis(200);
    let mut open: VecDeque<(Instant, UdpSocket)> = VecDeque::new();
    let mut result = StormResult::default();
    let mut buf = [0u8; 64];
    let mut reap = |open: &mut VecDeque<(Instant, UdpSocket)>, all: bool| {
        let now = Instant::now();
        while let Some((sent, _)) = open.front() {
            if !all && now.duration_since(*sent) < keep {
                break;
            }
            if let Some((_, socket)) = open.pop_front() {
                loop {
                    match socket.recv(&mut buf) {
                        Ok(_) => result.answered += 1,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(_) => break,
                    }
                }
            }
        }
    };
    let start = Instant::now();
    let end = start + duration;
    while Instant::now() < end {
        let socket = ports.socket()?;
        socket.set_nonblocking(true)?;
        // A full socket buffer or an unreachable answer is the network's business here.
        let _ = socket.send_to(b"query", to);
        result.sent += 1;
        open.push_back((Instant::now(), socket));
        reap(&mut open, false);
        let next = start + Duration::from_secs_f64(result.sent as f64 / f64::from(rate));
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
    }
    thread::sleep(keep);
    reap(&mut open, true);
    Ok(result)
}

/// The fast-path counters of both nodes' agents.
fn counters(bed: &LearnBed) -> Result<[Counts; 2]> {
    let scrape = |n: usize| -> Result<Counts> {
        Ok(fastpath::counters(bed.cluster.topology().node(n).ns(), DEFAULT_HEALTHZ_PORT)?.packets)
    };
    Ok([scrape(1)?, scrape(2)?])
}

/// Share of the packets the two forwarding programs sent or delivered that a memo decided,
/// in % (`None` if they forwarded nothing, or counted no memo hit at all: an agent from
/// before the `memo_hit` counter).
pub fn memo_share(before: &[Counts], after: &[Counts]) -> Option<f64> {
    let (mut memo, mut forwarded) = (0u64, 0u64);
    for (b, a) in before.iter().zip(after) {
        for program in [TC_FROM_BRIDGE, TC_FROM_NETDEV] {
            memo += fastpath::grown(b, a, program, "memo_hit");
            forwarded += fastpath::grown(b, a, program, "fast_host_gw")
                + fastpath::grown(b, a, program, "fast_deliver");
        }
    }
    (forwarded > 0 && memo > 0).then(|| 100.0 * memo as f64 / forwarded as f64)
}

/// What one run of the load did.
#[derive(Debug, Clone, Default)]
pub struct Load {
    /// Its length, seconds.
    pub seconds: u64,
    /// The programs' time and runs (every program of the name on the machine).
    pub programs: progtime::Usage,
    /// Both nodes' fast-path packet counters before and after.
    pub before: [Counts; 2],
    /// See `before`.
    pub after: [Counts; 2],
    /// The paced streams' received rate, Mbit/s.
    pub streams_mbps: f64,
    /// The queries, if a storm ran.
    pub storm: Option<StormResult>,
}

impl Load {
    /// Kernel flows node 1 learnt.
    pub fn learnt(&self) -> u64 {
        fastpath::grown(
            &self.before[0],
            &self.after[0],
            TC_TO_NETDEV,
            "learn_kernel_flow",
        )
    }

    /// The values of [`METRICS`] this run gives.
    pub fn metrics(&self) -> Vec<(usize, f64)> {
        let mut out = vec![
            (3, self.learnt() as f64 / self.seconds.max(1) as f64),
            (4, self.streams_mbps),
        ];
        for (i, program) in [(0, TC_FROM_BRIDGE), (1, TC_FROM_NETDEV)] {
            if let Some(ns) = self.programs.ns_per_run(program) {
                out.push((i, ns));
            }
        }
        if let Some(share) = memo_share(&self.before, &self.after) {
            out.push((2, share));
        }
        if let Some(q) = self.storm.filter(|q| q.sent > 0) {
            out.push((5, 100.0 * q.answered as f64 / q.sent as f64));
        }
        out
    }
}

/// Runs the paced streams for `duration`, and next to them `rate` queries per second if
/// `rate` is given, with the programs' run-time statistics on.
pub fn run_load(bed: &LearnBed, duration: Duration, rate: Option<u32>) -> Result<Load> {
    let seconds = duration.as_secs().max(1);
    let _stats = progtime::Stats::enable()?;
    let programs = progtime::Snapshot::take();
    let before = counters(bed)?;
    let client = bed.pod_ns(bed.stream_pod);
    let server = bed.server_ip.to_string();
    let (secs_arg, streams_arg, port_arg) = (
        seconds.to_string(),
        STREAMS.to_string(),
        IPERF_PORT.to_string(),
    );
    let argv = [
        "iperf3",
        "-c",
        &server,
        "-p",
        &port_arg,
        "-t",
        &secs_arg,
        "-P",
        &streams_arg,
        "-b",
        STREAM_RATE,
        "-l",
        "1000",
        "-J",
    ];
    let (streams_mbps, storm_result) = thread::scope(|s| -> Result<_> {
        let streams = s.spawn(|| -> Result<f64> {
            let out = client.output(&argv)?;
            let (gbps, _, _) = measure::parse_iperf3(&String::from_utf8_lossy(&out.stdout))
                .with_context(|| String::from_utf8_lossy(&out.stderr).trim().to_owned())?;
            Ok(gbps * 1000.0)
        });
        let queries = match rate {
            Some(rate) => {
                let d = Duration::from_secs(seconds);
                Some(
                    bed.query_ns()
                        .enter(move || storm(SERVICE_ADDR, rate, d, &bed.ports))??,
                )
            }
            None => None,
        };
        let mbps = streams
            .join()
            .map_err(|_| anyhow::anyhow!("the iperf3 thread panicked"))??;
        Ok((mbps, queries))
    })?;
    let programs = programs.until(&progtime::Snapshot::take());
    let after = counters(bed)?;
    Ok(Load {
        seconds,
        programs,
        before,
        after,
        streams_mbps,
        storm: storm_result,
    })
}

/// [`rounds::Bench`] over the learn variants.
struct Learn<'a>(&'a LearnOptions);

impl Bench for Learn<'_> {
    type Variant = LearnVariant;
    type Bed = LearnBed;

    const METRICS: &'static [Metric] = &METRICS;
    const KIND: &'static str = "learn variant";

    fn all() -> Vec<LearnVariant> {
        variants()
    }

    fn label(v: &LearnVariant) -> (&'static str, &'static str) {
        (v.name, v.description)
    }

    fn set_up(&self, v: &LearnVariant, log: &dyn Fn(&str)) -> Result<LearnBed> {
        setup(v, self.0, log).with_context(|| format!("variant {}", v.name))
    }

    fn measure(&self, bed: &LearnBed, _step: usize) -> Result<Vec<(usize, f64)>> {
        let rate = bed.storm.then_some(self.0.rate);
        Ok(run_load(bed, self.0.duration, rate)?.metrics())
    }
}

/// Sets up both variants, measures them round-robin and compares the storm with the quiet
/// run.
pub fn run(
    opts: &LearnOptions,
    log: &dyn Fn(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<Report> {
    let names: Vec<String> = variants().iter().map(|v| v.name.to_owned()).collect();
    let plan = Plan::new(&opts.name, &names, &names[0], opts.reps);
    let settings = json!({
        "reps": opts.reps,
        "seconds": opts.duration.as_secs(),
        "queries_per_second": opts.rate,
        "topology": "2 nodes (host-gw, eBPF dataplane, --ip-masq), 2 pods per node; streams and queries from node 1's pods to a pod on node 2",
        "streams": format!("iperf3 -P {STREAMS} -b {STREAM_RATE} -l 1000"),
        "queries": format!("UDP from a fresh socket each to {SERVICE_ADDR}, DNATed by iptables in node 1 to the remote pod's port {ANSWER_PORT}, which answers"),
        "program_time": "BPF_ENABLE_STATS over each measurement, summed over both nodes",
    });
    rounds::run(&Learn(opts), plan, settings, log, cancelled)
}

/// The storm's cost against the quiet run, one sentence per program: its time per run may
/// grow by at most 10 %.
pub fn targets(report: &Report) -> Vec<String> {
    let median = |variant: &str, key: &str| report.median(variant, key);
    let mut out = Vec::new();
    for (key, what) in [
        ("bridge_ns", "tc_from_bridge time per run"),
        ("netdev_ns", "tc_from_netdev time per run"),
    ] {
        if let (Some(storm), Some(quiet)) = (median("storm", key), median("quiet", key))
            && quiet > 0.0
        {
            let r = storm / quiet;
            out.push(format!(
                "{what} under the storm: {r:.2}x the quiet run (target <= 1.1x): {}",
                if r <= 1.1 { "met" } else { "NOT met" }
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_ports_go_up_from_1024_and_wrap_around() {
        let ports = Ports::new();
        assert_eq!((ports.next(), ports.next()), (1024, 1025));
        ports.0.store(u32::from(u16::MAX), Ordering::Relaxed);
        assert_eq!((ports.next(), ports.next()), (u16::MAX, 1024));
    }

    fn counts(entries: &[(&str, &str, u64)]) -> Counts {
        entries
            .iter()
            .map(|&(p, r, n)| ((p.to_owned(), r.to_owned()), n))
            .collect()
    }

    #[test]
    fn the_memo_share_counts_both_programs_on_both_nodes() {
        let before = [
            counts(&[
                (TC_FROM_BRIDGE, "fast_host_gw", 100),
                (TC_FROM_BRIDGE, "memo_hit", 90),
            ]),
            counts(&[]),
        ];
        let after = [
            counts(&[
                (TC_FROM_BRIDGE, "fast_host_gw", 200),
                (TC_FROM_BRIDGE, "memo_hit", 180),
                (TC_TO_NETDEV, "memo_hit", 1_000),
            ]),
            counts(&[
                (TC_FROM_NETDEV, "fast_deliver", 100),
                (TC_FROM_NETDEV, "memo_hit", 100),
            ]),
        ];
        // (90 + 100) of (100 + 100); tc_to_netdev does not forward.
        assert_eq!(memo_share(&before, &after), Some(95.0));
        assert_eq!(memo_share(&after, &after), None);
        let no_memo_counter = [
            counts(&[(TC_FROM_BRIDGE, "fast_host_gw", 200)]),
            counts(&[]),
        ];
        assert_eq!(memo_share(&before, &no_memo_counter), None);
    }
}
