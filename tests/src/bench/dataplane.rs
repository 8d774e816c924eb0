//! `flannel-lab bench dataplane`: every variant set up side by side, then measured in
//! round-robin repetitions (rep 1: A B C, rep 2: B C A, …) so slow drifts of the machine
//! spread over all variants; medians are compared with the baseline variant of the same run.

use std::{net::IpAddr, time::Duration};

use anyhow::{Context as _, Result, bail};
use serde_json::json;

use super::{
    measure::{self, IPERF_PORT, SOCKPERF_PORT},
    report::{Machine, MetricResult, Report, VariantRecord},
    stats::{Summary, ratio},
    variant::{self, SetupCtx, Testbed, Variant},
};
use crate::lab::{
    probe,
    process::{Output, Process, wait_tcp_listen},
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
            baseline: "underlay".to_owned(),
            reps: 5,
            duration: Duration::from_secs(5),
            rr_duration: Duration::from_secs(5),
            rr_cpu: Some(0),
            name: "dataplane".to_owned(),
        }
    }
}

/// The metrics, in report order: key, label, unit, higher is better.
pub const METRICS: [(&str, &str, &str, bool); 5] = [
    ("tcp1_gbps", "TCP 1 stream", "Gbit/s", true),
    ("tcp2_gbps", "TCP 2 streams", "Gbit/s", true),
    ("rr_p50_us", "TCP RR latency p50", "µs", false),
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
];

/// One repetition of every metric for one testbed, in [`METRICS`] order.
pub fn measure_once(bed: &Testbed, opts: &DataplaneOptions) -> Result<[f64; 5]> {
    let client = bed.client_ns()?;
    let t1 = measure::iperf3_tcp(client, bed.server_ip, 1, opts.duration)?;
    let t2 = measure::iperf3_tcp(client, bed.server_ip, 2, opts.duration)?;
    let rr = measure::sockperf_rr(client, bed.server_ip, opts.rr_duration, opts.rr_cpu)?;
    Ok([
        t1.gbps,
        t2.gbps,
        rr.p50_us,
        t1.cpu_per_gbit(),
        t2.cpu_per_gbit(),
    ])
}

/// Starts the iperf3 and sockperf servers (the latter pinned to `rr_cpu`) in the testbed's
/// server namespace and checks the client reaches the server address.
pub fn start_servers(bed: &mut Testbed, rr_cpu: Option<usize>) -> Result<()> {
    let ip = bed.server_ip.to_string();
    let cpu = rr_cpu.map(|c| c.to_string());
    let mut sockperf_argv = measure::pin_prefix(&cpu);
    let port = SOCKPERF_PORT.to_string();
    sockperf_argv.extend(["sockperf", "server", "--tcp", "-i", &ip, "-p", &port]);
    let (iperf, sockperf) = {
        let server = bed.server_ns()?;
        let mut iperf = Process::spawn(
            server,
            &["iperf3", "-s", "-p", &IPERF_PORT.to_string()],
            Output::Null,
        )?;
        wait_tcp_listen(server, IPERF_PORT, &mut iperf, Duration::from_secs(10))?;
        let mut sockperf = Process::spawn(server, &sockperf_argv, Output::Null)?;
        wait_tcp_listen(
            server,
            SOCKPERF_PORT,
            &mut sockperf,
            Duration::from_secs(10),
        )?;
        probe::tcp_reaches(
            bed.client_ns()?,
            server,
            bed.server_ip,
            Duration::from_secs(5),
        )
        .with_context(|| format!("the client cannot reach {}", bed.server_ip))?;
        (iperf, sockperf)
    };
    bed.keep(iperf);
    bed.keep(sockperf);
    Ok(())
}

/// Sets up every variant, measures them round-robin and summarises against the baseline.
/// `log` gets progress lines; `cancelled` is polled between steps (Ctrl-C).
pub fn run(
    opts: &DataplaneOptions,
    ctx: &SetupCtx,
    log: &dyn Fn(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<Report> {
    if opts.reps == 0 {
        bail!("--reps must be at least 1");
    }
    let variants: Vec<Variant> = opts
        .variants
        .iter()
        .map(|name| {
            variant::find(name).with_context(|| {
                format!(
                    "unknown variant {name:?}; known: {}",
                    variant::all()
                        .iter()
                        .map(|v| v.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
        })
        .collect::<Result<_>>()?;
    if !variants.iter().any(|v| v.name == opts.baseline) {
        bail!("the baseline {:?} is not among the variants", opts.baseline);
    }
    let mut beds = Vec::new();
    for v in &variants {
        if cancelled() {
            bail!("cancelled");
        }
        log(&format!("setting up {}: {}", v.name, v.description));
        let mut bed = v.prepare(ctx)?;
        start_servers(&mut bed, opts.rr_cpu).with_context(|| format!("variant {}", v.name))?;
        log(&format!(
            "  client {:?} -> server {:?} at {}",
            bed.client, bed.server, bed.server_ip
        ));
        beds.push(bed);
    }
    let n = beds.len();
    let mut samples = vec![vec![Vec::<f64>::new(); METRICS.len()]; n];
    let mut errors = vec![Vec::<String>::new(); n];
    for rep in 0..opts.reps {
        for k in 0..n {
            if cancelled() {
                bail!("cancelled");
            }
            let i = (k + rep) % n;
            let name = variants[i].name;
            match measure_once(&beds[i], opts) {
                Ok(values) => {
                    log(&format!(
                        "rep {}/{} {name}: {:.2} / {:.2} Gbit/s, RR p50 {:.1} µs, {:.3} / {:.3} CPU-s/Gbit",
                        rep + 1,
                        opts.reps,
                        values[0],
                        values[1],
                        values[2],
                        values[3],
                        values[4]
                    ));
                    for (m, v) in values.iter().enumerate() {
                        samples[i][m].push(*v);
                    }
                }
                Err(e) => {
                    log(&format!(
                        "rep {}/{} {name}: FAILED {e:#}",
                        rep + 1,
                        opts.reps
                    ));
                    errors[i].push(format!("rep {}: {e:#}", rep + 1));
                }
            }
        }
    }
    let summaries: Vec<Vec<Option<Summary>>> = samples
        .iter()
        .map(|per| per.iter().map(|s| Summary::of(s)).collect())
        .collect();
    let base = variants
        .iter()
        .position(|v| v.name == opts.baseline)
        .unwrap_or(0);
    let mut records = Vec::new();
    for (i, v) in variants.iter().enumerate() {
        let metrics = METRICS
            .iter()
            .enumerate()
            .filter_map(|(m, (key, label, unit, higher))| {
                let summary = summaries[i][m].clone()?;
                let baseline = summaries[base][m].as_ref().map_or(f64::NAN, |s| s.median);
                Some(MetricResult {
                    key: (*key).to_owned(),
                    label: (*label).to_owned(),
                    unit: (*unit).to_owned(),
                    higher_is_better: *higher,
                    ratio: ratio(summary.median, baseline),
                    summary,
                })
            })
            .collect();
        records.push(VariantRecord {
            variant: v.name.to_owned(),
            description: v.description.to_owned(),
            metrics,
            errors: std::mem::take(&mut errors[i]),
        });
    }
    drop(beds);
    Ok(Report {
        name: opts.name.clone(),
        machine: Machine::current(),
        baseline: opts.baseline.clone(),
        settings: json!({
            "reps": opts.reps,
            "throughput_seconds": opts.duration.as_secs(),
            "rr_seconds": opts.rr_duration.as_secs(),
            "rr_pinned_cpu": opts.rr_cpu,
            "tools": "iperf3 -J (TCP, 1 and 2 streams), sockperf ping-pong --tcp -m 64 --full-rtt",
            "cpu": "machine-wide busy time from /proc/stat during each iperf3 run / Gbit received",
        }),
        variants: records,
    })
}

/// A quick single-pair check used by tests: 1 s of iperf3 and sockperf against `ip` from
/// `bed`'s client; returns (Gbit/s, RR p50 µs).
pub fn smoke(bed: &Testbed, ip: IpAddr) -> Result<(f64, f64)> {
    let client = bed.client_ns()?;
    let t = measure::iperf3_tcp(client, ip, 1, Duration::from_secs(1))?;
    let rr = measure::sockperf_rr(client, ip, Duration::from_secs(1), None)?;
    Ok((t.gbps, rr.p50_us))
}
