//! One measurement each: iperf3 TCP throughput (with the machine's CPU busy time during the
//! run, from /proc/stat) and TCP ping-pong latency: sockperf for IPv4, `flannel-lab rr`
//! ([`super::rr`]) for IPv6, which the installed sockperf (3.7) rejects ([`rr`] picks).
//!
//! Everything runs on this one machine, so the whole machine's CPU time is the cost of moving
//! the bytes through both ends.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::{lab::bins, netns::NetNs};

/// Port of the iperf3 servers.
pub const IPERF_PORT: u16 = 5201;
/// Port of the sockperf servers.
pub const SOCKPERF_PORT: u16 = 11111;
/// Port of the `flannel-lab rr` servers.
pub const RR_PORT: u16 = 11112;
/// Port of the connection-rate servers ([`super::crr`]).
pub const CRR_PORT: u16 = 7201;

/// Aggregate CPU counters from the first line of /proc/stat, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// Ticks not idle (user, nice, system, irq, softirq, steal).
    pub busy: u64,
    /// All ticks (busy + idle + iowait).
    pub total: u64,
}

impl CpuTimes {
    /// Reads /proc/stat now.
    pub fn now() -> Result<CpuTimes> {
        CpuTimes::parse(&std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?)
    }

    /// Parses the `cpu ` line (guest time is already inside user and nice).
    pub fn parse(stat: &str) -> Result<CpuTimes> {
        let line = stat
            .lines()
            .find(|l| l.starts_with("cpu "))
            .context("/proc/stat has no cpu line")?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().context("/proc/stat field"))
            .collect::<Result<_>>()?;
        if v.len() < 8 {
            bail!("/proc/stat cpu line too short: {line}");
        }
        let (user, nice, system, idle, iowait, irq, softirq, steal) =
            (v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
        let busy = user + nice + system + irq + softirq + steal;
        Ok(CpuTimes {
            busy,
            total: busy + idle + iowait,
        })
    }

    /// CPU-seconds spent busy between `earlier` and `self`.
    pub fn busy_seconds_since(&self, earlier: &CpuTimes) -> f64 {
        self.busy.saturating_sub(earlier.busy) as f64 / clock_ticks_per_second()
    }
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// One iperf3 TCP run.
#[derive(Debug, Clone, PartialEq)]
pub struct Throughput {
    /// Received throughput, Gbit/s.
    pub gbps: f64,
    /// Received bytes.
    pub bytes: u64,
    /// Sender retransmits.
    pub retransmits: u64,
    /// Machine-wide busy CPU-seconds during the run.
    pub cpu_seconds: f64,
}

impl Throughput {
    /// Segments the sender retransmitted per GB received: the path's losses and reordering,
    /// which move the throughput of one stream. (On these veth testbeds nearly all are
    /// spurious, answered by D-SACKs: a stream's segments sent from both CPUs cross two
    /// per-CPU backlog queues and arrive out of order; none is dropped.)
    pub fn retransmits_per_gb(&self) -> f64 {
        let gb = self.bytes as f64 / 1e9;
        if gb > 0.0 {
            self.retransmits as f64 / gb
        } else {
            f64::NAN
        }
    }

    /// Busy CPU-seconds per Gbit transferred.
    pub fn cpu_per_gbit(&self) -> f64 {
        let gbit = self.bytes as f64 * 8.0 / 1e9;
        if gbit > 0.0 {
            self.cpu_seconds / gbit
        } else {
            f64::NAN
        }
    }
}

/// Parses iperf3's `-J` output: received bytes and bits/s, sender retransmits.
pub fn parse_iperf3(json: &str) -> Result<(f64, u64, u64)> {
    let v: Value = serde_json::from_str(json).context("iperf3 output is not JSON")?;
    if let Some(err) = v["error"].as_str() {
        bail!("iperf3: {err}");
    }
    let recv = &v["end"]["sum_received"];
    let bps = recv["bits_per_second"]
        .as_f64()
        .context("iperf3 JSON has no end.sum_received.bits_per_second")?;
    let bytes = recv["bytes"].as_u64().unwrap_or_default();
    let retransmits = v["end"]["sum_sent"]["retransmits"]
        .as_u64()
        .unwrap_or_default();
    Ok((bps / 1e9, bytes, retransmits))
}

/// The CPUs an iperf3 run pins its client and its server to (iperf3's `-A client,server`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpCpus {
    /// CPU of the sending client.
    pub client: usize,
    /// CPU of the receiving server.
    pub server: usize,
}

impl std::str::FromStr for TcpCpus {
    type Err = anyhow::Error;

    /// `client,server`, e.g. `0,1`.
    fn from_str(s: &str) -> Result<Self> {
        let (client, server) = s
            .split_once(',')
            .with_context(|| format!("{s:?}: want CLIENT,SERVER (CPU numbers)"))?;
        let cpu = |v: &str| {
            v.trim()
                .parse::<usize>()
                .with_context(|| format!("{v:?} in {s:?}: not a CPU number"))
        };
        Ok(TcpCpus {
            client: cpu(client)?,
            server: cpu(server)?,
        })
    }
}

/// A TCP window for iperf3's `-w`: a number of bytes with an optional `K`, `M` or `G` suffix
/// (e.g. `512K`). Fixing it keeps the receive queue short: with the autotuned window a
/// receiver that falls behind can queue megabytes and then copy them out of cache, which cost
/// single-stream runs 10-20 % at some MTUs (see the README's IPIP-against-VXLAN measurements).
/// It did not steady the two-stream runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpWindow(String);

impl std::str::FromStr for TcpWindow {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let digits = s.trim_end_matches(['K', 'M', 'G', 'k', 'm', 'g']);
        let suffix = s.len() - digits.len();
        if digits.is_empty() || suffix > 1 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            bail!("{s:?}: want a size such as 262144, 512K or 2M");
        }
        if digits.parse::<u64>().map_or(true, |n| n == 0) {
            bail!("{s:?}: the window must be more than 0");
        }
        Ok(TcpWindow(s.to_owned()))
    }
}

impl std::fmt::Display for TcpWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// How the throughput runs' TCP is set up beyond the defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TcpTuning {
    /// Pin the client and the server (the server through the client's request).
    pub cpus: Option<TcpCpus>,
    /// A fixed window instead of the autotuned one.
    pub window: Option<TcpWindow>,
}

/// Runs an iperf3 TCP client in `client` against a server at `server:IPERF_PORT` with
/// `streams` parallel streams for `duration`, measuring the machine's CPU meanwhile, set up
/// as `tuning` says.
pub fn iperf3_tcp(
    client: &NetNs,
    server: IpAddr,
    streams: u32,
    duration: Duration,
    tuning: &TcpTuning,
) -> Result<Throughput> {
    let secs = duration.as_secs().max(1).to_string();
    let streams_arg = streams.to_string();
    let server_arg = server.to_string();
    let port = IPERF_PORT.to_string();
    let affinity = tuning.cpus.map(|c| format!("{},{}", c.client, c.server));
    let window = tuning.window.as_ref().map(|w| w.to_string());
    let mut argv = vec![
        "iperf3",
        "-c",
        &server_arg,
        "-p",
        &port,
        "-t",
        &secs,
        "-P",
        &streams_arg,
        "-J",
    ];
    if let Some(affinity) = &affinity {
        argv.extend(["-A", affinity.as_str()]);
    }
    if let Some(window) = &window {
        argv.extend(["-w", window.as_str()]);
    }
    let before = CpuTimes::now()?;
    let out = client.output(&argv)?;
    let after = CpuTimes::now()?;
    let (gbps, bytes, retransmits) = parse_iperf3(&String::from_utf8_lossy(&out.stdout))
        .with_context(|| {
            format!(
                "iperf3 -c {server} from {} ({}): {}",
                client.name(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )
        })?;
    Ok(Throughput {
        gbps,
        bytes,
        retransmits,
        cpu_seconds: after.busy_seconds_since(&before),
    })
}

/// One sockperf ping-pong run (full round trips, µs).
#[derive(Debug, Clone, PartialEq)]
pub struct Latency {
    /// Median round trip.
    pub p50_us: f64,
    /// 99th percentile round trip.
    pub p99_us: f64,
    /// Mean round trip.
    pub avg_us: f64,
    /// Number of observations (round trips of the valid duration).
    pub observations: u64,
    /// Round trips of the whole run, warm-up included (the client's sent messages).
    pub round_trips: u64,
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Parses sockperf's ping-pong summary (run with `--full-rtt`).
pub fn parse_sockperf(text: &str) -> Result<Latency> {
    let text = strip_ansi(text);
    // The number after `marker` on the first line holding `line` (sockperf prints "Total"
    // on two lines: "[Total Run] ... SentMessages=N" and "Total N observations").
    let number = |line: &str, marker: &str| -> Option<f64> {
        let line = text.lines().find(|l| l.contains(line))?;
        let rest = &line[line.find(marker)? + marker.len()..];
        rest.trim_start()
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .next()?
            .parse()
            .ok()
    };
    let after = |marker: &str| number(marker, marker);
    let p50 = after("percentile 50.000 =").context("sockperf output has no median")?;
    let p99 = after("percentile 99.000 =").unwrap_or(f64::NAN);
    let avg = after("avg-rtt=").unwrap_or(f64::NAN);
    let observations = number(" observations", "Total ").map_or(0, |v| v as u64);
    let round_trips = number("[Total Run]", "SentMessages=").map_or(0, |v| v as u64);
    Ok(Latency {
        p50_us: p50,
        p99_us: p99,
        avg_us: avg,
        observations,
        round_trips,
    })
}

/// `taskset -c <cpu>` as an argv prefix, or nothing.
pub fn pin_prefix(cpu: &Option<String>) -> Vec<&str> {
    match cpu {
        Some(cpu) => vec!["taskset", "-c", cpu.as_str()],
        None => Vec::new(),
    }
}

/// Runs `sockperf ping-pong --tcp` (64-byte messages, full round trips) from `client` to a
/// server at `server:SOCKPERF_PORT` for `duration`, pinned to `cpu` if given.
///
/// Pinning client and server to the same CPU keeps the whole exchange (both ends and the
/// softirqs, which veth runs on the sending CPU) on one core: on a VM, a wake-up across CPUs
/// costs tens of µs and makes unpinned runs bimodal (17 vs 60 µs here), which would drown
/// the dataplane's own cost.
pub fn sockperf_rr(
    client: &NetNs,
    server: IpAddr,
    duration: Duration,
    cpu: Option<usize>,
) -> Result<Latency> {
    let secs = duration.as_secs().max(1).to_string();
    let server_arg = server.to_string();
    let port = SOCKPERF_PORT.to_string();
    let cpu = cpu.map(|c| c.to_string());
    let mut argv = pin_prefix(&cpu);
    argv.extend([
        "sockperf",
        "ping-pong",
        "--tcp",
        "-i",
        &server_arg,
        "-p",
        &port,
        "-t",
        &secs,
        "-m",
        "64",
        "--full-rtt",
    ]);
    let out = client.output(&argv)?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    parse_sockperf(&text).with_context(|| {
        format!(
            "sockperf to {server} from {} ({}): {}",
            client.name(),
            out.status,
            text.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
        )
    })
}

/// The request/response tool for a server address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RrTool {
    /// `sockperf ping-pong --tcp` ([`sockperf_rr`]), on [`SOCKPERF_PORT`].
    Sockperf,
    /// `flannel-lab rr` ([`lab_rr`], [`super::rr`]), on [`RR_PORT`].
    LabRr,
}

impl RrTool {
    /// sockperf for IPv4 (the method of every IPv4 number so far), `flannel-lab rr` for IPv6.
    pub fn for_server(server: IpAddr) -> RrTool {
        match server {
            IpAddr::V4(_) => RrTool::Sockperf,
            IpAddr::V6(_) => RrTool::LabRr,
        }
    }

    /// The port its server listens on.
    pub fn port(self) -> u16 {
        match self {
            RrTool::Sockperf => SOCKPERF_PORT,
            RrTool::LabRr => RR_PORT,
        }
    }

    /// The server's argv (after any [`pin_prefix`]) for listening on `server`; `lab` is the
    /// `flannel-lab` binary.
    pub fn server_argv(self, server: IpAddr, lab: &str) -> Vec<String> {
        let port = self.port();
        match self {
            RrTool::Sockperf => ["sockperf", "server", "--tcp", "-i"]
                .into_iter()
                .map(str::to_owned)
                .chain([server.to_string(), "-p".to_owned(), port.to_string()])
                .collect(),
            RrTool::LabRr => vec![
                lab.to_owned(),
                "rr".to_owned(),
                "server".to_owned(),
                "--listen".to_owned(),
                SocketAddr::new(server, port).to_string(),
            ],
        }
    }
}

/// A request/response run from `client` to `server` with the tool [`RrTool::for_server`]
/// picks: [`sockperf_rr`] or [`lab_rr`], same duration, same pinning.
pub fn rr(
    client: &NetNs,
    server: IpAddr,
    duration: Duration,
    cpu: Option<usize>,
) -> Result<Latency> {
    match RrTool::for_server(server) {
        RrTool::Sockperf => sockperf_rr(client, server, duration, cpu),
        RrTool::LabRr => lab_rr(client, server, duration, cpu),
    }
}

/// Runs `flannel-lab rr client` (one connection, 64-byte requests echoed, every round trip
/// timed; see [`super::rr`]) from `client` to a `flannel-lab rr server` at `server:RR_PORT`
/// for `duration`, pinned to `cpu` if given, as [`sockperf_rr`] runs sockperf.
pub fn lab_rr(
    client: &NetNs,
    server: IpAddr,
    duration: Duration,
    cpu: Option<usize>,
) -> Result<Latency> {
    let lab = bins::lab_tool()?;
    let lab = lab.to_str().context("flannel-lab path is not UTF-8")?;
    let secs = duration.as_secs_f64().max(0.1).to_string();
    let server_arg = SocketAddr::new(server, RR_PORT).to_string();
    let cpu = cpu.map(|c| c.to_string());
    let mut argv = pin_prefix(&cpu);
    argv.extend([
        lab,
        "rr",
        "client",
        "--server",
        &server_arg,
        "--seconds",
        &secs,
    ]);
    let out = client.output(&argv)?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!(
            "flannel-lab rr client to {server_arg} from {} ({}): {}",
            client.name(),
            out.status,
            text.trim()
        );
    }
    super::rr::parse_summary(&text).with_context(|| {
        format!(
            "flannel-lab rr client to {server_arg} from {}: {}",
            client.name(),
            text.trim()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_keeps_sockperf_ipv6_gets_the_lab_tool() {
        let v4: IpAddr = "10.244.2.2".parse().expect("v4");
        let v6: IpAddr = "fd00:244:0:2::2".parse().expect("v6");
        assert_eq!(RrTool::for_server(v4), RrTool::Sockperf);
        assert_eq!(RrTool::for_server(v6), RrTool::LabRr);
        assert_eq!(
            RrTool::Sockperf.server_argv(v4, "/x/flannel-lab"),
            [
                "sockperf",
                "server",
                "--tcp",
                "-i",
                "10.244.2.2",
                "-p",
                "11111"
            ]
        );
        // The listen address is bracketed, as a socket address.
        assert_eq!(
            RrTool::LabRr.server_argv(v6, "/x/flannel-lab"),
            [
                "/x/flannel-lab",
                "rr",
                "server",
                "--listen",
                "[fd00:244:0:2::2]:11112"
            ]
        );
    }

    #[test]
    fn tcp_cpus_parse_as_client_comma_server() {
        let cpus: TcpCpus = "0,1".parse().expect("0,1");
        assert_eq!(
            cpus,
            TcpCpus {
                client: 0,
                server: 1
            }
        );
        assert_eq!(
            " 1 , 0".parse::<TcpCpus>().expect("spaces"),
            TcpCpus {
                client: 1,
                server: 0
            }
        );
        for bad in ["0", "0;1", "a,1", "0,-1", ""] {
            assert!(bad.parse::<TcpCpus>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn tcp_windows_are_sizes() {
        for good in ["262144", "512K", "2M", "1g"] {
            let w: TcpWindow = good.parse().expect(good);
            assert_eq!(w.to_string(), good);
        }
        for bad in ["", "K", "0", "0K", "512KK", "-1M", "1.5M", "512 K", "2T"] {
            assert!(bad.parse::<TcpWindow>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn proc_stat() {
        let t = CpuTimes::parse("cpu  100 5 50 1000 20 3 2 1 0 0\ncpu0 50 2 25 500 10 1 1 0 0 0\n")
            .expect("parse");
        assert_eq!(
            t,
            CpuTimes {
                busy: 161,
                total: 1181
            }
        );
        assert!(CpuTimes::parse("intr 1 2\n").is_err());
        assert!(CpuTimes::now().expect("now").total > 0);
    }

    #[test]
    fn iperf3_json() {
        let json = r#"{"start":{},"intervals":[],"end":{"sum_sent":{"bytes":6250000000,
            "bits_per_second":10000000000.0,"retransmits":7},"sum_received":{"bytes":6000000000,
            "bits_per_second":9600000000.0}}}"#;
        assert_eq!(parse_iperf3(json).expect("parse"), (9.6, 6_000_000_000, 7));
        let err = parse_iperf3(r#"{"start":{},"end":{},"error":"unable to connect to server"}"#)
            .expect_err("error");
        assert!(err.to_string().contains("unable to connect"), "{err}");
        let t = Throughput {
            gbps: 9.6,
            bytes: 6_000_000_000,
            retransmits: 0,
            cpu_seconds: 9.6,
        };
        assert!((t.cpu_per_gbit() - 0.2).abs() < 1e-9);
        assert_eq!(t.retransmits_per_gb(), 0.0);
        let lossy = Throughput {
            retransmits: 18_000,
            ..t
        };
        assert!((lossy.retransmits_per_gb() - 3_000.0).abs() < 1e-9);
        let nothing = Throughput { bytes: 0, ..t };
        assert!(nothing.retransmits_per_gb().is_nan() && nothing.cpu_per_gbit().is_nan());
    }

    #[test]
    fn sockperf_summary() {
        let text = "sockperf: [Total Run] RunTime=1.000 sec; Warm up time=400 msec; SentMessages=40000; ReceivedMessages=39999\n\
            sockperf: [Valid Duration] RunTime=0.550 sec; SentMessages=32386; ReceivedMessages=32386\n\
            sockperf: \u{1b}[2;35m====> avg-rtt=16.968 (std-dev=80.540)\u{1b}[0m\n\
            sockperf: Summary: Round trip is 16.968 usec\n\
            sockperf: \u{1b}[2;35mTotal 32386 observations\u{1b}[0m; each percentile contains 323.86 observations\n\
            sockperf: ---> percentile 99.000 =   21.431\n\
            sockperf: ---> percentile 50.000 =   14.601\n";
        let l = parse_sockperf(text).expect("parse");
        assert_eq!(
            l,
            Latency {
                p50_us: 14.601,
                p99_us: 21.431,
                avg_us: 16.968,
                observations: 32386,
                round_trips: 40000,
            }
        );
        assert!(parse_sockperf("sockperf: error").is_err());
    }
}
