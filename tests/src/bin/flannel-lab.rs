//! `flannel-lab`: simulated flannel clusters in network namespaces, and benchmarks.
//!
//! * `up`: etcd + N nodes + one agent per node + pods through CNI; prints the leases and a
//!   pod-to-pod matrix, then a live status until Ctrl-C, then removes everything. With
//!   `--once` it prints one status block instead and exits, non-zero unless every pod pair
//!   connected (the CI smoke test of `cargo xtask run`).
//! * `host -- <flags>`: runs one agent on the real host with the given flags (exec).
//! * `bench dataplane` / `bench control` / `bench masq` / `bench learn`: see
//!   `flannel_tests::bench`.
//! * `crr`: the connection-rate tool of `bench masq`, by hand (server or client).
//! * `rr`: the TCP ping-pong latency tool `bench dataplane` uses for IPv6 (server or client).
//! * `variants`: lists the benchmark variants.

use std::{
    io::IsTerminal as _,
    os::unix::process::CommandExt as _,
    path::PathBuf,
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use clap::{Args, Parser, Subcommand};
use flannel_tests::{
    bench::{
        control::{self, ControlOptions},
        crr,
        dataplane::{self, DataplaneOptions},
        kubecache::{self, KubeCacheOptions},
        learn::{self, LearnOptions},
        masq::{self, MasqOptions},
        measure::TcpTuning,
        programs::{self, ProgramsOptions},
        report,
        resync::{self, ResyncOptions},
        rr, targets,
        variant::{self, SetupCtx},
    },
    lab::{
        agent::Dataplane,
        bins,
        cluster::{Cluster, ClusterSpec},
        probe,
    },
    topology::{TopologySpec, Underlay},
};
use ipnet::{Ipv4Net, Ipv6Net};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

#[derive(Parser)]
#[command(
    name = "flannel-lab",
    about = "Simulated flannel clusters and benchmarks (needs root)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a simulated cluster and keep it up with a live status until Ctrl-C.
    Up(UpArgs),
    /// Run one agent on the real host with your own flags (everything after `--`).
    Host {
        /// The agent binary (default: flannel-agent next to flannel-lab).
        #[arg(long)]
        agent: Option<PathBuf>,
        /// Flags for the agent.
        #[arg(last = true)]
        flags: Vec<String>,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// List the benchmark variants.
    Variants,
    /// Re-render the .md and .svg of a saved benchmark report (.json) next to it.
    Render {
        /// The report's JSON file.
        json: PathBuf,
    },
    /// The TCP connection-rate tool of `bench masq`: a server (`--listen`) or clients
    /// (`--server`); run it in a namespace with nsenter.
    Crr(CrrArgs),
    /// The TCP ping-pong latency tool `bench dataplane` uses for IPv6 (sockperf 3.7 rejects
    /// IPv6 addresses); run it in a namespace with nsenter.
    #[command(subcommand)]
    Rr(RrCommand),
    /// The process `bench kube-cache` measures: holds every Node of a (fake) API server as
    /// `--keep` says, then prints `held_kib=<KiB> sync_ms=<ms>`.
    #[command(hide = true)]
    KubeCacheProbe {
        /// The API server.
        #[arg(long)]
        url: String,
        /// `agent` or `whole-nodes`.
        #[arg(long)]
        keep: String,
        /// Nodes the server holds.
        #[arg(long)]
        nodes: u32,
        /// The network config (`agent`).
        #[arg(long)]
        net_conf: PathBuf,
    },
}

#[derive(Subcommand)]
enum RrCommand {
    /// Echo every 64-byte request on every connection until killed.
    Server {
        /// Address to listen on, e.g. `[fd00:244:0:2::2]:11112`.
        #[arg(long)]
        listen: std::net::SocketAddr,
    },
    /// One connection with TCP_NODELAY: 64-byte requests echoed back to back, each round
    /// trip timed; prints `rr: round_trips=N observations=N p50_us=X p99_us=X avg_us=X`.
    Client {
        /// The server.
        #[arg(long)]
        server: std::net::SocketAddr,
        /// Seconds to run, warm-up included.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Milliseconds of warm-up left out of the statistics (at most half the run).
        #[arg(long, default_value_t = rr::WARMUP.as_millis() as u64)]
        warmup_ms: u64,
    },
}

#[derive(Args)]
struct CrrArgs {
    /// Serve on this address until Ctrl-C.
    #[arg(long, conflicts_with = "server")]
    listen: Option<std::net::SocketAddr>,
    /// Connect to this server.
    #[arg(long)]
    server: Option<std::net::SocketAddr>,
    /// Concurrent clients (client mode) or accepting threads (server mode).
    #[arg(long, default_value_t = 1)]
    clients: usize,
    /// Seconds to run (client mode).
    #[arg(long, default_value_t = 5)]
    seconds: u64,
}

#[derive(Args)]
struct UpArgs {
    /// Backend type.
    #[arg(long, default_value = "vxlan",
          value_parser = ["vxlan", "host-gw", "ipip", "wireguard", "udp", "ipsec"])]
    backend: String,
    /// Number of nodes.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Underlay: l2 (one segment), l3 (routed, one /24 per node) or mixed.
    #[arg(long, default_value = "l2")]
    underlay: Underlay,
    /// Dataplane of the agents: auto (the eBPF fast path where the kernel supports it, as the
    /// agent's own default), ebpf or kernel.
    #[arg(long, default_value = "auto")]
    dataplane: Dataplane,
    /// Pods created through CNI on every node.
    #[arg(long, default_value_t = 2)]
    pods_per_node: usize,
    /// The agent binary (default: flannel-agent next to flannel-lab).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// The CNI plugin (default: flannel next to flannel-lab).
    #[arg(long)]
    cni: Option<PathBuf>,
    /// Pass --ip-masq to the agents.
    #[arg(long)]
    ip_masq: bool,
    /// Set Backend.DirectRouting in the config (vxlan).
    #[arg(long)]
    direct_routing: bool,
    /// Kube mode: the agents take their leases from Node objects (`--kube-subnet-mgr`) in a
    /// fake API server in the hub, instead of from etcd; each Node's pod CIDR is the node's
    /// /24 of the network (and /64 of the IPv6 network), and the config is each node's
    /// net-conf.json.
    #[arg(long)]
    kube: bool,
    /// The cluster network.
    #[arg(long, default_value = "10.244.0.0/16")]
    network: Ipv4Net,
    /// An IPv6 cluster network too (dual stack: `EnableIPv6`, `IPv6Network`; the underlay and
    /// the pods get IPv6 addresses), e.g. fd00:244::/48.
    #[arg(long)]
    ipv6_network: Option<Ipv6Net>,
    /// Underlay MTU.
    #[arg(long, default_value_t = 1500)]
    mtu: u32,
    /// Seconds each node may take to write subnet.env.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Seconds between status refreshes.
    #[arg(long, default_value_t = 3)]
    interval: u64,
    /// Print the leases, the pod-to-pod matrix and one status block, then remove
    /// everything and exit (non-zero unless every pair connected): a smoke test of `up`.
    #[arg(long)]
    once: bool,
    /// Extra flags for every agent (after `--`).
    #[arg(last = true)]
    agent_args: Vec<String>,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Throughput, latency and CPU per Gbit of dataplane variants against the underlay.
    Dataplane(DataplaneArgs),
    /// Time and memory for one agent to program N remote leases.
    Control(ControlArgs),
    /// Pod-to-outside throughput and connection rate: eBPF SNAT, iptables MASQUERADE, no NAT.
    Masq(MasqArgs),
    /// The fast path's program time while kernel flows are learnt at a high rate (a storm of
    /// DNATed UDP queries next to 100 paced TCP streams), against the same streams alone.
    Learn(LearnArgs),
    /// One run of the fast path's programs on a remembered flow's packet (and on an ICMP
    /// echo), timed in the kernel with BPF_PROG_TEST_RUN against the floor program (the eBPF
    /// object built into flannel-lab).
    Programs(ProgramsArgs),
    /// One read of conntrack's N open NATed connections written into the fast path's flow
    /// tables (held TCP connections, steady or churning), against N DNS lookups.
    Resync(ResyncArgs),
    /// The memory kube mode holds for a cluster of N realistic Nodes (node cache and lease
    /// set), against a reflector of whole Node objects as upstream's informer keeps them.
    KubeCache(KubeCacheArgs),
}

#[derive(Args)]
struct KubeCacheArgs {
    /// Repetitions (round-robin across the variants; a fresh process each).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Nodes in the cluster.
    #[arg(long, default_value_t = 5_000)]
    nodes: u32,
    /// Output directory (default: target/bench of this workspace).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Where a lab benchmark writes its report and which binaries its clusters run.
#[derive(Args)]
struct BenchBins {
    /// Output directory (default: target/bench of this workspace).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The agent binary (default: flannel-agent next to flannel-lab).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// The CNI plugin (default: flannel next to flannel-lab).
    #[arg(long)]
    cni: Option<PathBuf>,
}

impl BenchBins {
    /// The agent and the CNI plugin, resolved.
    fn resolve(&self) -> Result<(PathBuf, PathBuf)> {
        Ok((
            bins::resolve(self.agent.as_deref(), bins::AGENT, "flannel-agent")?,
            bins::resolve(self.cni.as_deref(), bins::CNI_PLUGIN, "flannel-cni")?,
        ))
    }
}

#[derive(Args)]
struct ResyncArgs {
    /// Repetitions (round-robin across the variants).
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// Flows each read finds.
    #[arg(long, default_value_t = 32_768)]
    connections: u32,
    /// Output directory (default: target/bench of this workspace).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct ProgramsArgs {
    /// Repetitions (round-robin across the two variants; many short ones, so that each pair
    /// of measurements is a fraction of a second apart).
    #[arg(long, default_value_t = 21)]
    reps: usize,
    /// BPF_PROG_TEST_RUN calls per packet and repetition (200 runs each; the time of the
    /// fastest tenth is reported).
    #[arg(long, default_value_t = 500)]
    calls: usize,
    /// Output directory (default: target/bench of this workspace).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct LearnArgs {
    /// Repetitions (round-robin across the two variants).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Queries per second of the storm (each a new flow, so a learnt kernel flow).
    #[arg(long, default_value_t = 500)]
    rate: u32,
    #[command(flatten)]
    bins: BenchBins,
}

#[derive(Args)]
struct MasqArgs {
    /// Repetitions (round-robin across variants).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Seconds per throughput run.
    #[arg(long, default_value_t = 5)]
    duration: u64,
    /// Seconds per connection-rate run.
    #[arg(long, default_value_t = 5)]
    crr_duration: u64,
    /// Concurrent clients of the "many clients" connection rate.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Comma-separated variants (`all` for every one): nat-none, masq-iptables, masq-ebpf,
    /// masq-off, masq-iptables-kernel.
    #[arg(long, value_delimiter = ',')]
    variants: Option<Vec<String>>,
    /// The variant ratios are relative to.
    #[arg(long, default_value = "nat-none")]
    baseline: String,
    #[command(flatten)]
    bins: BenchBins,
}

#[derive(Args)]
struct DataplaneArgs {
    /// Repetitions (round-robin across variants).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Seconds per throughput run.
    #[arg(long, default_value_t = 5)]
    duration: u64,
    /// Seconds per request/response run.
    #[arg(long, default_value_t = 5)]
    rr_duration: u64,
    /// Seconds per connection-rate run (two per repetition: 1 client, then 4).
    #[arg(long, default_value_t = 3)]
    crr_seconds: u64,
    /// CPU to pin both ends of the request/response test to (`none` to leave unpinned).
    #[arg(long, default_value = "0")]
    rr_cpu: String,
    /// CPUs to pin the throughput runs' iperf3 client and server to, as CLIENT,SERVER (e.g.
    /// `0,1`; `none` leaves them to the scheduler, whose placement moves single-stream
    /// results by ±15 % from run to run here).
    #[arg(long, default_value = "none")]
    tcp_cpus: String,
    /// A fixed TCP window for the throughput runs (iperf3 `-w`, e.g. `512K`; `auto`, the
    /// default, leaves it to autotuning).
    #[arg(long, default_value = "auto")]
    tcp_window: String,
    /// Comma-separated variants (`all` for every one; see `flannel-lab variants`).
    #[arg(long, value_delimiter = ',')]
    variants: Option<Vec<String>>,
    /// The variant ratios are relative to.
    #[arg(long, default_value = "underlay")]
    baseline: String,
    /// Report directory and binaries (the agent for agent-* variants, the CNI plugin for
    /// variants with CNI pods).
    #[command(flatten)]
    bins: BenchBins,
}

#[derive(Args)]
struct ControlArgs {
    /// Comma-separated lease counts.
    #[arg(long, value_delimiter = ',', default_value = "1000,5000")]
    nodes: Vec<usize>,
    /// The agent binary (default: flannel-agent next to flannel-lab, if present).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Only write and count the leases; do not start an agent.
    #[arg(long)]
    no_agent: bool,
    /// Seconds the agent may take per lease count.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Comma-separated dataplanes to measure each lease count on (`kernel`, `ebpf`).
    #[arg(long, value_delimiter = ',', default_value = "kernel,ebpf")]
    dataplane: Vec<Dataplane>,
    /// Lease events (an add and a delete each) timed once the agent has converged.
    #[arg(long, default_value_t = 20)]
    events: usize,
    /// The leases are Node objects (realistic ones, about 14 KB each) in the test kit's fake
    /// API server, the agent in kube mode; lease events create and delete Nodes.
    #[arg(long)]
    kube: bool,
    /// Another build of the agent to measure against in the same run (the one before a
    /// change): each lease count and dataplane runs both, and the report gives the ratios.
    #[arg(long)]
    baseline_agent: Option<PathBuf>,
    /// Runs of each agent per lease count and dataplane, alternating which goes first.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=100))]
    rounds: u16,
    /// Output directory (default: target/bench of this workspace).
    #[arg(long)]
    out: Option<PathBuf>,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// SIGINT/SIGTERM only set a flag: every loop polls it and returns, so the guards' drops
/// remove what was created.
fn install_signal_handlers() -> Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { sigaction(sig, &action) }.with_context(|| format!("installing {sig} handler"))?;
    }
    Ok(())
}

fn stopped() -> bool {
    STOP.load(Ordering::SeqCst)
}

fn progress(msg: &str) {
    eprintln!("==> {msg}");
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Command::Host { agent, flags } = &cli.command {
        return host(agent.as_deref(), flags);
    }
    if let Command::Variants = cli.command {
        for v in variant::all() {
            println!("{:<22} {}", v.name, v.description);
        }
        return Ok(());
    }
    if let Command::Render { json } = &cli.command {
        return render(json);
    }
    if let Command::Crr(args) = &cli.command {
        return crr_tool(args);
    }
    if let Command::Rr(cmd) = &cli.command {
        return rr_tool(cmd);
    }
    if let Command::KubeCacheProbe {
        url,
        keep,
        nodes,
        net_conf,
    } = &cli.command
    {
        return kubecache::probe(url, keep, *nodes, net_conf);
    }
    if !flannel_tests::is_root() {
        bail!("flannel-lab needs root (network namespaces, netlink, BPF)");
    }
    install_signal_handlers()?;
    match cli.command {
        Command::Up(args) => up(args),
        Command::Bench(BenchCommand::Dataplane(args)) => bench_dataplane(args),
        Command::Bench(BenchCommand::Control(args)) => bench_control(args),
        Command::Bench(BenchCommand::Masq(args)) => bench_masq(args),
        Command::Bench(BenchCommand::Learn(args)) => bench_learn(args),
        Command::Bench(BenchCommand::Programs(args)) => bench_programs(args),
        Command::Bench(BenchCommand::Resync(args)) => bench_resync(args),
        Command::Bench(BenchCommand::KubeCache(args)) => bench_kube_cache(args),
        Command::Host { .. }
        | Command::Variants
        | Command::Render { .. }
        | Command::Crr(_)
        | Command::Rr(_)
        | Command::KubeCacheProbe { .. } => Ok(()),
    }
}

fn render(json: &std::path::Path) -> Result<()> {
    let text =
        std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    let mut report = report::Report::from_json(&text)?;
    // Reports written before targets were kept in them.
    if report.name == "dataplane" && report.targets.is_empty() {
        report.targets = targets::check(&report);
    }
    for (ext, body) in [("md", report.markdown()), ("svg", report.svg())] {
        let path = json.with_extension(ext);
        std::fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn host(agent: Option<&std::path::Path>, flags: &[String]) -> Result<()> {
    let agent = bins::resolve(agent, bins::AGENT, "flannel-agent")?;
    eprintln!("==> exec {} {}", agent.display(), flags.join(" "));
    // exec: the agent replaces this process, so it gets the terminal's signals directly.
    let err = std::process::Command::new(&agent).args(flags).exec();
    Err(err).with_context(|| format!("exec {}", agent.display()))
}

fn up(args: UpArgs) -> Result<()> {
    let agent = bins::resolve(args.agent.as_deref(), bins::AGENT, "flannel-agent")?;
    let cni = bins::resolve(args.cni.as_deref(), bins::CNI_PLUGIN, "flannel-cni")?;
    let topology = TopologySpec::new(args.nodes, args.underlay)
        .mtu(args.mtu)
        .ipv6(args.ipv6_network.is_some())
        .cni_plugin(cni);
    let mut spec = ClusterSpec::new(topology, &args.backend, agent);
    spec.network = args.network;
    spec.ipv6_network = args.ipv6_network;
    spec.dataplane = args.dataplane;
    spec.ip_masq = args.ip_masq;
    spec.pods_per_node = args.pods_per_node;
    spec.subnet_env_timeout = Duration::from_secs(args.timeout);
    spec.agent_args = args.agent_args;
    spec.kube = args.kube;
    if args.direct_routing {
        spec.backend_options = serde_json::json!({"DirectRouting": true});
    }
    let ready_timeout = spec.subnet_env_timeout;
    let mut cluster = Cluster::up(spec, &progress, &stopped)?;
    cluster.wait_ready(ready_timeout)?;
    progress("every agent reports /readyz 200");
    println!("\n{}", cluster.leases_text()?);
    let matrix = cluster.matrix(Duration::from_secs(2))?;
    println!("pod-to-pod connectivity (TCP):\n{matrix}\n");
    for (i, j) in matrix.failed_pairs() {
        if let Some(Some(Err(reason))) = matrix.cells.get(i).and_then(|r| r.get(j)) {
            println!("  {} -> {}: {reason}", matrix.labels[i], matrix.labels[j]);
        }
    }
    let ipv6 = match args.ipv6_network {
        Some(_) => {
            let pods: Vec<_> = cluster.topology().pods().iter().collect();
            let talk = probe::pods_talk(&pods, false);
            match &talk {
                Ok(()) => println!("pod-to-pod over IPv6 (TCP, across nodes): every pair\n"),
                Err(e) => println!("pod-to-pod over IPv6 (TCP, across nodes): {e:#}\n"),
            }
            talk
        }
        None => Ok(()),
    };
    if args.once {
        println!("{}", cluster.status_text());
        eprintln!("==> removing the cluster");
        drop(cluster);
        if !matrix.all_ok() {
            bail!(
                "{} of {} pod pairs could not connect",
                matrix.failures(),
                matrix.pairs()
            );
        }
        return ipv6;
    }
    eprintln!(
        "==> up; status every {} s, Ctrl-C to remove everything",
        args.interval
    );
    let tty = std::io::stdout().is_terminal();
    let interval = Duration::from_secs(args.interval.max(1));
    while !stopped() {
        let status = cluster.status_text();
        if tty {
            print!("\x1b[2J\x1b[H");
        }
        let (date, _) = report::utc_now();
        println!("flannel-lab up ({date}), Ctrl-C to stop\n{status}");
        let until = Instant::now() + interval;
        while Instant::now() < until && !stopped() {
            thread::sleep(Duration::from_millis(100));
        }
    }
    eprintln!("==> removing the cluster");
    drop(cluster);
    Ok(())
}

fn bench_dataplane(args: DataplaneArgs) -> Result<()> {
    let variants = match args.variants {
        Some(v) if v.iter().any(|s| s == "all") => {
            variant::all().iter().map(|v| v.name.to_owned()).collect()
        }
        Some(v) => v,
        None => DataplaneOptions::default().variants,
    };
    let needs_agent = variants
        .iter()
        .any(|name| variant::find(name).is_some_and(|v| v.needs_agent));
    let needs_cni = variants
        .iter()
        .any(|name| variant::find(name).is_some_and(|v| v.needs_cni));
    let ctx = SetupCtx {
        cni_plugin: if needs_cni {
            Some(bins::resolve(
                args.bins.cni.as_deref(),
                bins::CNI_PLUGIN,
                "flannel-cni",
            )?)
        } else {
            None
        },
        agent: if needs_agent {
            Some(bins::resolve(
                args.bins.agent.as_deref(),
                bins::AGENT,
                "flannel-agent",
            )?)
        } else {
            None
        },
    };
    let opts = DataplaneOptions {
        variants,
        baseline: args.baseline,
        reps: args.reps,
        duration: Duration::from_secs(args.duration),
        rr_duration: Duration::from_secs(args.rr_duration),
        rr_cpu: match args.rr_cpu.as_str() {
            "none" => None,
            cpu => Some(
                cpu.parse()
                    .with_context(|| format!("--rr-cpu {cpu:?}: a CPU number or none"))?,
            ),
        },
        tcp: TcpTuning {
            cpus: match args.tcp_cpus.as_str() {
                "none" => None,
                cpus => Some(cpus.parse().context("--tcp-cpus")?),
            },
            window: match args.tcp_window.as_str() {
                "auto" => None,
                window => Some(window.parse().context("--tcp-window")?),
            },
        },
        crr_duration: Duration::from_secs(args.crr_seconds),
        name: "dataplane".to_owned(),
    };
    let report = dataplane::run(&opts, &ctx, &bench_progress, &stopped)?;
    let targets = targets::check(&report);
    publish(report, targets, args.bins.out)
}

fn crr_tool(args: &CrrArgs) -> Result<()> {
    match (args.listen, args.server) {
        (Some(addr), _) => {
            install_signal_handlers()?;
            let listener =
                std::net::TcpListener::bind(addr).with_context(|| format!("binding {addr}"))?;
            let server = crr::CrrServer::start(listener, args.clients)?;
            eprintln!("==> serving on {}, Ctrl-C to stop", server.addr());
            while !stopped() {
                thread::sleep(Duration::from_millis(100));
            }
            Ok(())
        }
        (None, Some(addr)) => {
            let r = crr::run_clients(addr, args.clients, Duration::from_secs(args.seconds))?;
            println!(
                "{:.0} connections/s ({} in {:.2} s, {} clients, {} errors)",
                r.per_second(),
                r.connections,
                r.seconds,
                args.clients,
                r.errors
            );
            Ok(())
        }
        (None, None) => bail!("give --listen ADDR (server) or --server ADDR (clients)"),
    }
}

fn rr_tool(cmd: &RrCommand) -> Result<()> {
    match cmd {
        RrCommand::Server { listen } => {
            install_signal_handlers()?;
            let listener =
                std::net::TcpListener::bind(listen).with_context(|| format!("binding {listen}"))?;
            let server = rr::RrServer::start(listener)?;
            eprintln!("==> serving on {}, Ctrl-C to stop", server.addr());
            while !stopped() {
                thread::sleep(Duration::from_millis(100));
            }
            Ok(())
        }
        RrCommand::Client {
            server,
            seconds,
            warmup_ms,
        } => {
            if !(seconds.is_finite() && *seconds > 0.0 && *seconds <= 86_400.0) {
                bail!("--seconds {seconds}: want a positive number of seconds");
            }
            let line = rr::client(
                *server,
                Duration::from_secs_f64(*seconds),
                Duration::from_millis(*warmup_ms),
            )?;
            println!("{line}");
            Ok(())
        }
    }
}

fn bench_masq(args: MasqArgs) -> Result<()> {
    let (agent, cni) = args.bins.resolve()?;
    let mut opts = MasqOptions::new(agent, cni);
    opts.variants = match args.variants {
        Some(v) if v.iter().any(|s| s == "all") => {
            masq::variants().iter().map(|v| v.name.to_owned()).collect()
        }
        Some(v) => v,
        None => opts.variants,
    };
    opts.baseline = args.baseline;
    opts.reps = args.reps;
    opts.duration = Duration::from_secs(args.duration);
    opts.crr_duration = Duration::from_secs(args.crr_duration);
    opts.clients = args.clients;
    let report = masq::run(&opts, &bench_progress, &stopped)?;
    let targets = masq::targets(&report);
    publish(report, targets, args.bins.out)
}

fn bench_learn(args: LearnArgs) -> Result<()> {
    let (agent, cni) = args.bins.resolve()?;
    let mut opts = LearnOptions::new(agent, cni);
    opts.reps = args.reps;
    opts.duration = Duration::from_secs(args.duration);
    opts.rate = args.rate;
    let report = learn::run(&opts, &bench_progress, &stopped)?;
    let targets = learn::targets(&report);
    publish(report, targets, args.bins.out)
}

fn bench_programs(args: ProgramsArgs) -> Result<()> {
    let opts = ProgramsOptions {
        reps: args.reps,
        calls: args.calls,
        ..ProgramsOptions::default()
    };
    let report = programs::run_all(&opts, &bench_progress, &stopped)?;
    publish(report, Vec::new(), args.out)
}

fn bench_resync(args: ResyncArgs) -> Result<()> {
    let opts = ResyncOptions {
        reps: args.reps,
        connections: args.connections,
        ..ResyncOptions::default()
    };
    let report = resync::run_all(&opts, &bench_progress, &stopped)?;
    publish(report, Vec::new(), args.out)
}

fn bench_kube_cache(args: KubeCacheArgs) -> Result<()> {
    let opts = KubeCacheOptions {
        reps: args.reps,
        nodes: args.nodes,
        ..KubeCacheOptions::default()
    };
    let report = kubecache::run_all(&opts, &bench_progress, &stopped)?;
    publish(report, Vec::new(), args.out)
}

/// A benchmark's progress line (quiet once Ctrl-C stopped it).
fn bench_progress(msg: &str) {
    if !stopped() {
        eprintln!("==> {msg}");
    }
}

/// Prints `report` with the bench's `targets` checked on it (in the files too) and writes its
/// files to `out` (default: `target/bench`).
fn publish(mut report: report::Report, targets: Vec<String>, out: Option<PathBuf>) -> Result<()> {
    report.targets = targets;
    print!("\n{}", report.markdown());
    let dir = out.unwrap_or_else(report::default_dir);
    for path in report.write(&dir)? {
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn bench_control(args: ControlArgs) -> Result<()> {
    let agent = if args.no_agent {
        None
    } else {
        match bins::resolve(args.agent.as_deref(), bins::AGENT, "flannel-agent") {
            Ok(path) => Some(path),
            Err(e) if args.agent.is_none() => {
                eprintln!("==> {e:#}; measuring lease writing only");
                None
            }
            Err(e) => return Err(e),
        }
    };
    let opts = ControlOptions {
        nodes: args.nodes,
        agent,
        timeout: Duration::from_secs(args.timeout),
        dataplanes: args.dataplane,
        events: args.events,
        kube: args.kube,
        baseline: args
            .baseline_agent
            .map(|path| bins::resolve(Some(&path), bins::AGENT, "flannel-agent"))
            .transpose()?,
        rounds: usize::from(args.rounds),
    };
    if opts.baseline.is_some() && opts.agent.is_none() {
        bail!("--baseline-agent needs an agent to compare with it (no --no-agent)");
    }
    let results = control::run(&opts, &progress, &stopped)?;
    print!(
        "\n{}",
        control::markdown(&results, &report::Machine::current())
    );
    let dir = args.out.unwrap_or_else(report::default_dir);
    for path in control::write(&results, &dir)? {
        println!("wrote {}", path.display());
    }
    Ok(())
}
