//! `flannel-lab bench control`: how long one node's agent takes to program N remote leases
//! into its kernel, and how much memory it needs for that.
//!
//! For each N: a fresh one-node topology with etcd in its hub, the config
//! (`10.0.0.0/8`, `/24` subnets, vxlan), N fake remote leases in upstream's JSON (written in
//! 128-operation transactions, all on one 24 h etcd lease), then the agent is started and the
//! node's kernel is polled until it holds N routes, N neighbours and N FDB entries. At that
//! point the agent's peak RSS (`VmHWM`) is read, its `/metrics` (reconcile runs) scraped and
//! its log's `dataplane reconciled` lines summed (kernel writes, time spent applying).

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use ipnet::Ipv4Net;
use serde::Serialize;
use serde_json::json;

use super::report::{Machine, utc_now};
use crate::{
    lab::{
        agent::{Agent, AgentSpec},
        kv::Kv,
        lease,
        status::{self, KernelCounts},
    },
    topology::{Topology, TopologySpec, Underlay},
};

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct ControlOptions {
    /// The lease counts to try, e.g. `[1000, 5000]`.
    pub nodes: Vec<usize>,
    /// The agent; `None` only writes and counts the leases.
    pub agent: Option<PathBuf>,
    /// How long the agent may take per N.
    pub timeout: Duration,
}

/// The result for one N.
#[derive(Debug, Clone, Serialize)]
pub struct ControlResult {
    /// Number of fake remote leases.
    pub leases: usize,
    /// Seconds to write them to etcd.
    pub write_seconds: f64,
    /// Keys found under `<prefix>/subnets/` afterwards.
    pub keys_in_etcd: i64,
    /// Seconds from agent start until its subnet.env existed (config, lease listing and
    /// acquisition, devices, rules).
    pub lease_seconds: Option<f64>,
    /// Seconds from agent start until the kernel held everything.
    pub converge_seconds: Option<f64>,
    /// Reconcile runs the agent reports (`flannel_reconcile_runs_total`), no-op ones included.
    pub reconciles: Option<u64>,
    /// Reconciles that wrote to the kernel (`dataplane reconciled` log lines).
    pub writing_reconciles: u64,
    /// Kernel write operations (netlink requests) those reconciles issued, summed.
    pub kernel_writes: u64,
    /// Time those reconciles took, summed (listing, diffing and applying), seconds.
    pub reconcile_seconds: f64,
    /// Agent's `VmHWM` at that point, KiB.
    pub peak_rss_kib: Option<u64>,
    /// Routes in the kernel at the end.
    pub routes: usize,
    /// Neighbours in the kernel at the end.
    pub neighbours: usize,
    /// FDB entries in the kernel at the end.
    pub fdb: usize,
    /// Why the agent part failed, if it did.
    pub error: Option<String>,
}

/// The config the control benchmark stores.
pub fn control_netconf() -> serde_json::Value {
    json!({"Network": "10.0.0.0/8", "SubnetLen": 24, "Backend": {"Type": "vxlan"}})
}

/// Runs the benchmark for every N; `cancelled` is polled between steps (Ctrl-C).
pub fn run(
    opts: &ControlOptions,
    log: &dyn Fn(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<Vec<ControlResult>> {
    let network: Ipv4Net = "10.0.0.0/8".parse().context("network")?;
    let mut results = Vec::new();
    for &n in &opts.nodes {
        if cancelled() {
            bail!("cancelled");
        }
        log(&format!(
            "{n} leases: building a one-node topology with etcd"
        ));
        let topo = Topology::new(TopologySpec::new(1, Underlay::L2))?;
        let etcd = topo.start_etcd()?;
        let kv = Kv::new(topo.hub(), etcd.endpoint());
        let prefix = lease::DEFAULT_PREFIX;
        lease::write_netconf(&kv, prefix, &control_netconf())?;
        let leases = lease::fake_vxlan_leases(prefix, n)?;
        let start = Instant::now();
        kv.put_all_with_ttl(leases, 86_400)?;
        let write_seconds = start.elapsed().as_secs_f64();
        let keys_in_etcd = kv.count_prefix(&format!("{prefix}/subnets/"))?;
        log(&format!(
            "{n} leases: written in {write_seconds:.2} s ({keys_in_etcd} keys under {prefix}/subnets/)"
        ));
        let mut result = ControlResult {
            leases: n,
            write_seconds,
            keys_in_etcd,
            lease_seconds: None,
            converge_seconds: None,
            reconciles: None,
            writing_reconciles: 0,
            kernel_writes: 0,
            reconcile_seconds: 0.0,
            peak_rss_kib: None,
            routes: 0,
            neighbours: 0,
            fdb: 0,
            error: None,
        };
        if let Some(agent) = &opts.agent {
            let spec = AgentSpec::new(agent, etcd.endpoint());
            match converge(
                &topo,
                &spec,
                network,
                n,
                opts.timeout,
                cancelled,
                &mut result,
            ) {
                Ok(()) => log(&format!(
                    "{n} leases: subnet.env after {:.2} s, kernel complete after {:.2} s, \
                     agent peak RSS {} KiB, {} kernel writes in {} writing reconcile(s) \
                     taking {:.2} s",
                    result.lease_seconds.unwrap_or(f64::NAN),
                    result.converge_seconds.unwrap_or(f64::NAN),
                    result.peak_rss_kib.unwrap_or(0),
                    result.kernel_writes,
                    result.writing_reconciles,
                    result.reconcile_seconds
                )),
                Err(e) => {
                    log(&format!("{n} leases: agent part failed: {e:#}"));
                    result.error = Some(format!("{e:#}"));
                }
            }
        }
        results.push(result);
    }
    Ok(results)
}

/// Starts the agent and polls the kernel until it holds `n` routes, neighbours and FDB
/// entries.
fn converge(
    topo: &Topology,
    spec: &AgentSpec,
    network: Ipv4Net,
    n: usize,
    timeout: Duration,
    cancelled: &dyn Fn() -> bool,
    result: &mut ControlResult,
) -> Result<()> {
    let node = topo.node(1);
    let start = Instant::now();
    let mut agent = Agent::start(node, spec)?;
    let deadline = start + timeout;
    let mut last = KernelCounts::default();
    loop {
        if cancelled() {
            bail!("cancelled");
        }
        agent.check_running()?;
        let env = node.read_subnet_env().ok().flatten();
        if result.lease_seconds.is_none() && env.as_ref().is_some_and(|e| e.subnet.is_some()) {
            result.lease_seconds = Some(start.elapsed().as_secs_f64());
        }
        let local = env.and_then(|e| e.lease());
        last = status::kernel_counts(node.ns(), network, local).unwrap_or(last);
        (result.routes, result.neighbours, result.fdb) = (last.routes, last.neighbours, last.fdb);
        if status::require_counts(&last, n, n, n).is_ok() {
            result.converge_seconds = Some(start.elapsed().as_secs_f64());
            result.peak_rss_kib = agent.peak_rss_kib();
            if let Some(port) = agent.healthz_port() {
                result.reconciles = status::metric(node.ns(), port, "flannel_reconcile_runs_total")
                    .ok()
                    .flatten()
                    .map(|v| v as u64);
            }
            let text = std::fs::read_to_string(agent.log_path()).unwrap_or_default();
            let applied = applied_reconciles(&text);
            result.writing_reconciles = applied.len() as u64;
            result.kernel_writes = applied.iter().map(|a| a.ops).sum();
            result.reconcile_seconds = applied.iter().map(|a| a.seconds).sum();
            let _ = agent.stop(Duration::from_secs(10));
            return Ok(());
        }
        if Instant::now() >= deadline {
            result.peak_rss_kib = agent.peak_rss_kib();
            status::require_counts(&last, n, n, n).with_context(|| {
                format!("after {timeout:?}; agent log:\n{}", agent.log_tail(20))
            })?;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// One `dataplane reconciled` line of the agent's log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Applied {
    /// `ops N`: write operations issued.
    pub ops: u64,
    /// `duration=...`, seconds.
    pub seconds: f64,
}

/// The reconciles that wrote something, from the agent's log (plain text, tracing's
/// `key=value` fields: `duration=12.3ms`, `stats=added 3, ..., ops 6, skipped 0`).
pub fn applied_reconciles(log: &str) -> Vec<Applied> {
    log.lines()
        .filter(|l| l.contains("dataplane reconciled"))
        .map(|l| Applied {
            ops: l
                .split(", ")
                .find_map(|part| part.trim().strip_prefix("ops ")?.parse().ok())
                .unwrap_or(0),
            seconds: l
                .split_whitespace()
                .find_map(|w| parse_duration(w.strip_prefix("duration=")?))
                .unwrap_or(0.0),
        })
        .collect()
}

/// Rust's `Debug` of a `Duration` (`1.5s`, `12.3ms`, `800µs`, `120ns`) in seconds.
fn parse_duration(text: &str) -> Option<f64> {
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().ok()?;
    let scale = match unit {
        "s" => 1.0,
        "ms" => 1e-3,
        "µs" | "us" => 1e-6,
        "ns" => 1e-9,
        _ => return None,
    };
    Some(value * scale)
}

/// Markdown for the results.
pub fn markdown(results: &[ControlResult], machine: &Machine) -> String {
    let mut out = format!(
        "# flannel-lab bench control\n\n- machine: {} ({} cores), kernel {}\n- date: {}\n\n\
         Times from agent start. Kernel writes: netlink requests of the reconciles that \
         changed something (from the agent's log); reconciles: `flannel_reconcile_runs_total`.\n\n\
         | leases | etcd write (s) | keys | subnet.env (s) | kernel complete (s) | agent peak RSS (MiB) | routes | neigh | fdb | kernel writes | reconciles (writing) | reconcile time (s) | error |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        machine.cpu_model, machine.cores, machine.kernel, machine.date
    );
    for r in results {
        let _ = writeln!(
            out,
            "| {} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} ({}) | {:.2} | {} |",
            r.leases,
            r.write_seconds,
            r.keys_in_etcd,
            r.lease_seconds
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.2}")),
            r.converge_seconds
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.2}")),
            r.peak_rss_kib
                .map_or_else(|| "-".to_owned(), |k| format!("{:.1}", k as f64 / 1024.0)),
            r.routes,
            r.neighbours,
            r.fdb,
            r.kernel_writes,
            r.reconciles
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            r.writing_reconciles,
            r.reconcile_seconds,
            r.error
                .as_deref()
                .map(|e| e.lines().next().unwrap_or_default().replace('|', "/"))
                .unwrap_or_default()
        );
    }
    out
}

/// Writes `<dir>/<stamp>-control.{md,json}`.
pub fn write(results: &[ControlResult], dir: &Path) -> Result<Vec<PathBuf>> {
    let machine = Machine::current();
    std::fs::create_dir_all(dir)?;
    let (_, stamp) = utc_now();
    let base = dir.join(format!("{stamp}-control"));
    let md = base.with_extension("md");
    std::fs::write(&md, markdown(results, &machine))?;
    let js = base.with_extension("json");
    std::fs::write(
        &js,
        serde_json::to_string_pretty(&json!({"machine": machine, "results": results}))?,
    )?;
    Ok(vec![md, js])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconcile_lines_are_summed() {
        let log = "2026-11-29T12:21:59.742004Z  INFO dataplane reconciled generation=1 peers=1 \
                   duration=5.982918ms stats=added 3, replaced 0, deleted 3, unchanged 0, errors 0, ops 6, skipped 0\n\
                   2026-11-29T12:22:00.1Z  INFO flannel is ready\n\
                   2026-11-29T12:22:01.1Z  INFO dataplane reconciled generation=2 peers=5000 \
                   duration=1.25s stats=added 15000, replaced 0, deleted 0, unchanged 3, errors 0, ops 15000, skipped 0\n";
        let applied = applied_reconciles(log);
        assert_eq!(
            applied,
            vec![
                Applied {
                    ops: 6,
                    seconds: 0.005982918
                },
                Applied {
                    ops: 15000,
                    seconds: 1.25
                }
            ]
        );
        assert_eq!(parse_duration("800µs"), Some(800.0 * 1e-6));
        assert_eq!(parse_duration("7ns"), Some(7.0 * 1e-9));
        assert_eq!(parse_duration("ms"), None);
        assert_eq!(parse_duration("3h"), None);
    }
}
