//! `flannel-lab bench masq`: pod → outside throughput and connection rate through eBPF SNAT,
//! iptables MASQUERADE and no NAT, in one interleaved run.
//!
//! Every variant is a one-node cluster run by the agent with `--dataplane=ebpf` (vxlan) and
//! one pod; the "outside" is the hub namespace (192.168.1.1), which routes the node's pod
//! subnet back to the node so that un-NATed traffic works too. The variants differ only in
//! who translates the pod's address:
//!
//! | variant | agent flags | path |
//! |---|---|---|
//! | `nat-none` | `--ip-masq --ip-masq-exclude-cidrs=192.168.0.0/16` | no translation: the destination is excluded (RETURN in netfilter, skipped in eBPF); conntrack is on, as on every node with kube-proxy (the baseline) |
//! | `masq-iptables` | `--ip-masq --ebpf-masq=false` | iptables `MASQUERADE --random-fully`, upstream's rules |
//! | `masq-iptables-norandom` | `--ip-masq --ebpf-masq=false --ip-masq-fully-random-disable` | iptables `MASQUERADE` keeping the source port when free |
//! | `masq-ebpf` | `--ip-masq` | eBPF SNAT in `tc_to_netdev` / `tc_from_netdev` |
//! | `masq-off` | (no `--ip-masq`) | no nat table at all, so no conntrack in the node (not a realistic node; for reference) |
//! | `masq-iptables-kernel` | `--dataplane=kernel --ip-masq` | iptables MASQUERADE on the kernel dataplane |
//!
//! Metrics: one iperf3 TCP stream from the pod to the hub (and machine CPU per Gbit), and the
//! connection rate ([`super::crr`]) with 1 client and with N concurrent clients.
//!
//! Why `--random-fully` collapses here: the clients reuse their ports at once (the server
//! closes first), each new connection gets a new random NAT port, and that port regularly
//! lands on a `TIME_WAIT` the server holds from an earlier connection of another client port.
//! Its TCP timestamps have another base (Linux derives the offset from the 4-tuple), so the
//! server rejects the SYN (PAWS, `TcpExtPAWSTimewait`) and the client retransmits after a
//! second (`TcpExtTCPSynRetrans`). A port-preserving NAT (eBPF, or MASQUERADE without
//! `--random-fully`) gives a reused client port its old NAT port back.
//!
//! Each measurement of a repetition (the throughput run, the 1-client rate, the N-client
//! rate) is taken for every variant back to back before the next measurement starts, and
//! every repetition starts with another variant, so that slow drifts of this shared machine
//! spread over all of them and the values a ratio compares were taken seconds apart; ratios
//! compare medians with the baseline of the same run. On a machine where other jobs run, the
//! connection rate of one variant still varies by ±30 % between repetitions: compare runs
//! of several repetitions, not single values.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde_json::json;

use super::{
    crr,
    measure::{self, CRR_PORT, IPERF_PORT},
    report::Report,
    rounds::{self, Bench, Metric, Plan},
};
use crate::{
    lab::{
        agent::Dataplane,
        cluster::{Cluster, ClusterSpec},
        process::{Output, Process, wait_tcp_listen},
    },
    topology::{TopologySpec, Underlay},
};

/// Threads of the connection-rate server.
const CRR_SERVER_THREADS: usize = 4;

/// A setup of the masquerade benchmark.
#[derive(Debug, Clone)]
pub struct MasqVariant {
    /// Name on the command line and in reports.
    pub name: &'static str,
    /// One line about the path measured.
    pub description: &'static str,
    /// `--dataplane`.
    pub dataplane: Dataplane,
    /// `--ip-masq`.
    pub ip_masq: bool,
    /// Further agent flags.
    pub agent_args: &'static [&'static str],
    /// Whether the hub sees the node's address (true) or the pod's (false).
    pub translated: bool,
}

/// Every variant, the default set first.
pub fn variants() -> Vec<MasqVariant> {
    vec![
        MasqVariant {
            name: "nat-none",
            description: "no translation: the outside is excluded from masquerade (conntrack on, as with kube-proxy)",
            dataplane: Dataplane::Ebpf,
            ip_masq: true,
            agent_args: &["--ip-masq-exclude-cidrs=192.168.0.0/16"],
            translated: false,
        },
        MasqVariant {
            name: "masq-iptables",
            description: "iptables MASQUERADE --random-fully (upstream's rules), eBPF dataplane",
            dataplane: Dataplane::Ebpf,
            ip_masq: true,
            agent_args: &["--ebpf-masq=false"],
            translated: true,
        },
        MasqVariant {
            name: "masq-iptables-norandom",
            description: "iptables MASQUERADE without --random-fully (--ip-masq-fully-random-disable: the kernel keeps the source port when it can), eBPF dataplane",
            dataplane: Dataplane::Ebpf,
            ip_masq: true,
            agent_args: &["--ebpf-masq=false", "--ip-masq-fully-random-disable"],
            translated: true,
        },
        MasqVariant {
            name: "masq-ebpf",
            description: "eBPF SNAT (tc_to_netdev / tc_from_netdev), eBPF dataplane",
            dataplane: Dataplane::Ebpf,
            ip_masq: true,
            agent_args: &[],
            translated: true,
        },
        MasqVariant {
            name: "masq-off",
            description: "no --ip-masq: no nat table, so no conntrack in the node (reference only)",
            dataplane: Dataplane::Ebpf,
            ip_masq: false,
            agent_args: &[],
            translated: false,
        },
        MasqVariant {
            name: "masq-iptables-kernel",
            description: "iptables MASQUERADE --random-fully, kernel dataplane",
            dataplane: Dataplane::Kernel,
            ip_masq: true,
            agent_args: &[],
            translated: true,
        },
    ]
}

/// The variants `bench masq` runs unless told otherwise.
pub const DEFAULT_VARIANTS: &[&str] = &[
    "nat-none",
    "masq-iptables",
    "masq-iptables-norandom",
    "masq-ebpf",
];

/// Looks a variant up by name.
pub fn find(name: &str) -> Option<MasqVariant> {
    variants().into_iter().find(|v| v.name == name)
}

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct MasqOptions {
    /// Variant names.
    pub variants: Vec<String>,
    /// The variant ratios are relative to.
    pub baseline: String,
    /// Repetitions of every measurement.
    pub reps: usize,
    /// Length of each throughput run.
    pub duration: Duration,
    /// Length of each connection-rate run.
    pub crr_duration: Duration,
    /// Concurrent clients of the "many clients" connection rate.
    pub clients: usize,
    /// The agent binary.
    pub agent: PathBuf,
    /// The CNI plugin.
    pub cni: PathBuf,
    /// Report name.
    pub name: String,
}

impl MasqOptions {
    /// Defaults with these binaries: the default variants, `nat-none` as the baseline, 5
    /// repetitions of 5 s, 8 clients.
    pub fn new(agent: PathBuf, cni: PathBuf) -> Self {
        MasqOptions {
            variants: DEFAULT_VARIANTS.iter().map(|s| (*s).to_owned()).collect(),
            baseline: "nat-none".to_owned(),
            reps: 5,
            duration: Duration::from_secs(5),
            crr_duration: Duration::from_secs(5),
            clients: 8,
            agent,
            cni,
            name: "masq".to_owned(),
        }
    }
}

/// The metrics, in report order: key, label, unit, higher is better.
pub const METRICS: [Metric; 4] = [
    ("tcp1_gbps", "TCP 1 stream, pod to outside", "Gbit/s", true),
    ("crr1_cps", "new connections, 1 client", "conn/s", true),
    ("crrn_cps", "new connections, N clients", "conn/s", true),
    (
        "cpu1_s_per_gbit",
        "CPU per Gbit, 1 stream",
        "CPU-s/Gbit",
        false,
    ),
];

/// A variant set up: its cluster, the servers in the hub and where the client runs.
pub struct MasqBed {
    // Servers go before the cluster whose namespaces they run in.
    _crr: Process,
    crr_addr: SocketAddr,
    _iperf: Process,
    cluster: Cluster,
    client_pod: String,
    server_ip: IpAddr,
}

impl std::fmt::Debug for MasqBed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MasqBed")
            .field("client_pod", &self.client_pod)
            .field("server_ip", &self.server_ip)
            .finish_non_exhaustive()
    }
}

impl MasqBed {
    /// The client pod's namespace.
    pub fn client(&self) -> Result<&crate::netns::NetNs> {
        self.cluster
            .topology()
            .pod(&self.client_pod)
            .map(|p| p.ns())
            .with_context(|| format!("no pod {}", self.client_pod))
    }

    /// The connection-rate server's address.
    pub fn crr_addr(&self) -> SocketAddr {
        self.crr_addr
    }

    /// The cluster.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }
}

/// Builds a variant: the cluster, the hub's routes back to the pod subnet, iperf3 and the
/// connection-rate server in the hub; then checks that the hub sees the address the variant
/// promises (the node's when translated, the pod's otherwise).
pub fn setup(v: &MasqVariant, opts: &MasqOptions, log: &dyn Fn(&str)) -> Result<MasqBed> {
    let topology = TopologySpec::new(1, Underlay::L2).cni_plugin(opts.cni.clone());
    let mut spec = ClusterSpec::new(topology, "vxlan", opts.agent.clone());
    spec.dataplane = v.dataplane;
    spec.ip_masq = v.ip_masq;
    spec.pods_per_node = 1;
    spec.agent_args = v.agent_args.iter().map(|s| (*s).to_owned()).collect();
    let cluster = Cluster::up(spec, &|msg| log(&format!("  {msg}")), &|| false)?;
    let hub = cluster.topology().hub();
    let node = cluster.topology().node(1);
    if let Some(lease) = cluster.subnet_envs().first().and_then(|e| e.lease()) {
        hub.run(&[
            "ip",
            "route",
            "replace",
            &lease.to_string(),
            "via",
            &node.addr().to_string(),
        ])?;
    }
    let server_ip = IpAddr::V4(cluster.topology().hub_addr());
    let mut iperf = Process::spawn(
        hub,
        &["iperf3", "-s", "-p", &IPERF_PORT.to_string()],
        Output::Null,
    )?;
    wait_tcp_listen(hub, IPERF_PORT, &mut iperf, Duration::from_secs(10))?;
    let crr_addr = SocketAddr::new(server_ip, CRR_PORT);
    let crr = crr::spawn_server(hub, crr_addr, CRR_SERVER_THREADS)?;
    let pod = cluster.topology().pods_on(1)[0];
    let (client_pod, pod_ip) = (pod.name().to_owned(), pod.ip());
    crr::run_clients_in(pod.ns(), crr_addr, 1, Duration::from_millis(200))
        .with_context(|| format!("the pod cannot reach {server_ip}"))?;
    let seen = source_seen(hub, pod.ns(), server_ip)?;
    let want = if v.translated { node.addr() } else { pod_ip };
    if seen != want {
        bail!(
            "variant {}: the outside sees {seen}, expected {want}",
            v.name
        );
    }
    Ok(MasqBed {
        _crr: crr,
        crr_addr,
        _iperf: iperf,
        cluster,
        client_pod,
        server_ip,
    })
}

/// The source address the hub sees for a UDP datagram from the pod.
fn source_seen(
    hub: &crate::netns::NetNs,
    pod: &crate::netns::NetNs,
    server_ip: IpAddr,
) -> Result<Ipv4Addr> {
    let rx = hub
        .enter(move || UdpSocket::bind(SocketAddr::new(server_ip, 0)))?
        .context("UDP socket in the hub")?;
    rx.set_read_timeout(Some(Duration::from_millis(500)))?;
    let target = rx.local_addr()?;
    let tx = pod
        .enter(|| UdpSocket::bind("0.0.0.0:0"))?
        .context("UDP socket in the pod")?;
    let mut buf = [0u8; 16];
    for _ in 0..10 {
        tx.send_to(b"seen?", target)?;
        if let Ok((_, from)) = rx.recv_from(&mut buf) {
            return match from.ip() {
                IpAddr::V4(ip) => Ok(ip),
                IpAddr::V6(ip) => bail!("unexpected IPv6 source {ip}"),
            };
        }
    }
    bail!("no datagram from the pod reached the hub")
}

/// The measurements of a repetition. Each is taken for every variant back to back before
/// the next starts, so that the values a ratio compares were measured seconds apart, not a
/// whole repetition apart (on a shared machine the background load changes within a minute).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// One iperf3 stream: [`METRICS`] 0 (throughput) and 3 (CPU per Gbit).
    Throughput,
    /// The connection rate with one client: [`METRICS`] 1.
    Crr1,
    /// The connection rate with N clients: [`METRICS`] 2.
    CrrN,
}

impl Step {
    /// Every step, in the order a repetition takes them.
    pub const ALL: [Step; 3] = [Step::Throughput, Step::Crr1, Step::CrrN];
}

/// One measurement for one testbed: (index into [`METRICS`], value) pairs.
pub fn measure_step(bed: &MasqBed, opts: &MasqOptions, step: Step) -> Result<Vec<(usize, f64)>> {
    let client = bed.client()?;
    let addr = bed.crr_addr();
    let d = opts.crr_duration;
    Ok(match step {
        Step::Throughput => {
            let t1 = measure::iperf3_tcp(
                client,
                bed.server_ip,
                1,
                opts.duration,
                &measure::TcpTuning::default(),
            )?;
            vec![(0, t1.gbps), (3, t1.cpu_per_gbit())]
        }
        Step::Crr1 => {
            let one = crr::run_clients_in(client, addr, 1, d)?;
            vec![(1, one.per_second())]
        }
        Step::CrrN => {
            let many = crr::run_clients_in(client, addr, opts.clients, d)?;
            vec![(2, many.per_second())]
        }
    })
}

/// [`rounds::Bench`] over the masquerade variants.
struct Masq<'a>(&'a MasqOptions);

impl Bench for Masq<'_> {
    type Variant = MasqVariant;
    type Bed = MasqBed;

    const METRICS: &'static [Metric] = &METRICS;
    const KIND: &'static str = "masq variant";

    fn all() -> Vec<MasqVariant> {
        variants()
    }

    fn label(v: &MasqVariant) -> (&'static str, &'static str) {
        (v.name, v.description)
    }

    fn set_up(&self, v: &MasqVariant, log: &dyn Fn(&str)) -> Result<MasqBed> {
        setup(v, self.0, log).with_context(|| format!("variant {}", v.name))
    }

    fn steps(&self) -> usize {
        Step::ALL.len()
    }

    fn measure(&self, bed: &MasqBed, step: usize) -> Result<Vec<(usize, f64)>> {
        measure_step(bed, self.0, Step::ALL[step % Step::ALL.len()])
    }
}

/// Sets up every variant, measures them round-robin and summarises against the baseline.
pub fn run(opts: &MasqOptions, log: &dyn Fn(&str), cancelled: &dyn Fn() -> bool) -> Result<Report> {
    let plan = Plan::new(&opts.name, &opts.variants, &opts.baseline, opts.reps);
    let settings = json!({
        "reps": opts.reps,
        "throughput_seconds": opts.duration.as_secs(),
        "crr_seconds": opts.crr_duration.as_secs(),
        "crr_clients": opts.clients,
        "topology": "1 node (vxlan, eBPF dataplane unless the variant says kernel), 1 pod; the outside is the hub namespace",
        "tools": "iperf3 -J (TCP, 1 stream) pod -> hub; connection rate: connect, 64-byte request, 128-byte response, server closes (flannel_tests::bench::crr)",
        "cpu": "machine-wide busy time from /proc/stat during each iperf3 run / Gbit received",
    });
    rounds::run(&Masq(opts), plan, settings, log, cancelled)
}

/// The targets of eBPF masquerade checked on a report, one sentence each: throughput at
/// least 1.0x iptables MASQUERADE, connection rate at least 1.2x it, both within 10 % of no
/// NAT (ratios of `masq-ebpf`'s medians; pairs missing from the report are skipped).
pub fn targets(report: &Report) -> Vec<String> {
    let median = |variant: &str, key: &str| report.median(variant, key);
    let mut out = Vec::new();
    for (key, against, want, what) in [
        (
            "tcp1_gbps",
            "masq-iptables",
            1.0,
            "throughput vs iptables MASQUERADE",
        ),
        (
            "crr1_cps",
            "masq-iptables",
            1.2,
            "connection rate (1 client) vs iptables",
        ),
        (
            "crrn_cps",
            "masq-iptables",
            1.2,
            "connection rate (N clients) vs iptables",
        ),
        (
            "tcp1_gbps",
            "masq-iptables-norandom",
            1.0,
            "throughput vs MASQUERADE without --random-fully",
        ),
        (
            "crr1_cps",
            "masq-iptables-norandom",
            1.2,
            "connection rate (1 client) vs MASQUERADE without --random-fully",
        ),
        (
            "crrn_cps",
            "masq-iptables-norandom",
            1.2,
            "connection rate (N clients) vs MASQUERADE without --random-fully",
        ),
        ("tcp1_gbps", "nat-none", 0.9, "throughput vs no NAT"),
        (
            "crr1_cps",
            "nat-none",
            0.9,
            "connection rate (1 client) vs no NAT",
        ),
        (
            "crrn_cps",
            "nat-none",
            0.9,
            "connection rate (N clients) vs no NAT",
        ),
    ] {
        if let (Some(ebpf), Some(other)) = (median("masq-ebpf", key), median(against, key))
            && other > 0.0
        {
            let r = ebpf / other;
            out.push(format!(
                "{what}: {r:.2}x (target >= {want:.1}x): {}",
                if r >= want { "met" } else { "NOT met" }
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{
        report::{Machine, MetricResult, VariantRecord},
        stats::Summary,
    };

    #[test]
    fn variants_are_known_and_distinct() {
        let all = variants();
        for name in DEFAULT_VARIANTS {
            assert!(find(name).is_some(), "{name}");
        }
        let mut names: Vec<&str> = all.iter().map(|v| v.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
        assert!(find("nope").is_none());
    }

    #[test]
    fn targets_compare_medians() {
        let metric = |key: &str, median: f64| MetricResult {
            key: key.into(),
            label: key.into(),
            unit: "x".into(),
            higher_is_better: true,
            summary: Summary::of(&[median]).expect("summary"),
            ratio: None,
            paired: None,
        };
        let record = |name: &str, gbps: f64, cps: f64| VariantRecord {
            variant: name.into(),
            description: String::new(),
            baseline: None,
            metrics: vec![
                metric("tcp1_gbps", gbps),
                metric("crr1_cps", cps),
                metric("crrn_cps", cps),
            ],
            errors: Vec::new(),
        };
        let report = Report {
            name: "masq".into(),
            machine: Machine::current(),
            baseline: "nat-none".into(),
            settings: json!({}),
            variants: vec![
                record("nat-none", 10.0, 1000.0),
                record("masq-iptables", 9.0, 900.0),
                record("masq-ebpf", 9.5, 950.0),
            ],
            targets: Vec::new(),
        };
        let lines = targets(&report);
        assert_eq!(lines.len(), 6);
        assert_eq!(
            lines[0],
            "throughput vs iptables MASQUERADE: 1.06x (target >= 1.0x): met"
        );
        assert_eq!(
            lines[1],
            "connection rate (1 client) vs iptables: 1.06x (target >= 1.2x): NOT met"
        );
        assert_eq!(
            lines[3],
            "throughput vs no NAT: 0.95x (target >= 0.9x): met"
        );
    }
}
