//! `flannel-lab bench kube-cache`: the memory the agent holds in kube mode for a cluster of N
//! nodes (its node cache and lease set), against an informer that keeps whole Node objects,
//! as upstream flanneld's does.
//!
//! | variant | the process |
//! |---|---|
//! | `whole-nodes` (baseline) | a kube-runtime reflector of every Node as the API server sends it |
//! | `agent` | the agent's `KubeSubnetManager::watch_leases`, until its first complete lease set |
//!
//! Each measurement is a fresh process (`flannel-lab kube-cache-probe`) against a fake API
//! server holding N realistic Nodes ([`kube_mock::realistic_node`], about 14 KB of JSON
//! each): its resident memory right before it sends its first request and once it holds every
//! node, after `malloc_trim` in both cases so that each counts what it keeps rather than what
//! the allocator has not handed back yet, and the time between the two.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use flannel_agent::subnet::{
    kube::{DEFAULT_PREFIX, KubeSubnetManager},
    lease_channel,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api,
    runtime::{WatchStreamExt, reflector, watcher},
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{
    report::Report,
    rounds::{self, Bench, Metric, Plan},
};
use crate::kube_mock::{self, MockApiServer};

/// The metrics, in report order: key, label, unit, higher is better.
pub const METRICS: [Metric; 4] = [
    (
        "held_mib",
        "resident memory held for the nodes",
        "MiB",
        false,
    ),
    ("per_node_kib", "the same per node", "KiB", false),
    ("sync_ms", "time until every node is held", "ms", false),
    (
        "churn_cpu_ms",
        "CPU to take one status update of every node",
        "ms",
        false,
    ),
];

/// The probe's own node (left out of the agent's lease set).
const OWN: &str = "node-0";

/// A variant: what the probe process keeps.
#[derive(Debug, Clone)]
pub struct KubeCacheVariant {
    /// Name on the command line and in reports (and the probe's `--keep`).
    pub name: &'static str,
    /// One line about it.
    pub description: &'static str,
}

/// Every variant, the baseline first.
pub fn variants() -> Vec<KubeCacheVariant> {
    vec![
        KubeCacheVariant {
            name: "whole-nodes",
            description: "a reflector of whole Node objects, as upstream's informer keeps them",
        },
        KubeCacheVariant {
            name: "agent",
            description: "the agent's node cache and lease set (KubeSubnetManager::watch_leases)",
        },
    ]
}

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct KubeCacheOptions {
    /// Report name (file names and title).
    pub name: String,
    /// Repetitions (round-robin across the variants).
    pub reps: usize,
    /// Nodes in the cluster.
    pub nodes: u32,
}

impl Default for KubeCacheOptions {
    fn default() -> Self {
        KubeCacheOptions {
            name: "kube-cache".to_owned(),
            reps: 3,
            nodes: 5_000,
        }
    }
}

/// A variant set up: a fake API server with every node, and the network config.
pub struct KubeCacheBed {
    name: &'static str,
    nodes: u32,
    server: MockApiServer,
    dir: tempfile::TempDir,
    _rt: tokio::runtime::Runtime,
}

impl KubeCacheBed {
    fn net_conf(&self) -> PathBuf {
        self.dir.path().join("net-conf.json")
    }
}

/// Node `i`: pod CIDR 10.<i / 256>.<i % 256>.0/24, public IP 172.16-31.x.y.
fn cluster_node(i: u32) -> serde_json::Value {
    let [_, _, hi, lo] = i.to_be_bytes();
    kube_mock::realistic_node(
        &format!("node-{i}"),
        i,
        &format!("10.{hi}.{lo}.0/24"),
        &format!("172.{}.{hi}.{lo}", 16 + (i >> 16)),
    )
}

struct KubeCache<'a>(&'a KubeCacheOptions);

impl Bench for KubeCache<'_> {
    type Variant = KubeCacheVariant;
    type Bed = KubeCacheBed;

    const METRICS: &'static [Metric] = &METRICS;
    const KIND: &'static str = "kube-cache variant";

    fn all() -> Vec<KubeCacheVariant> {
        variants()
    }

    fn label(v: &KubeCacheVariant) -> (&'static str, &'static str) {
        (v.name, v.description)
    }

    fn set_up(&self, v: &KubeCacheVariant, _log: &dyn Fn(&str)) -> Result<KubeCacheBed> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let server = rt.block_on(MockApiServer::start())?;
        for i in 0..self.0.nodes {
            server.apply_node(cluster_node(i));
        }
        let dir = tempfile::tempdir()?;
        let conf = json!({"Network": "10.0.0.0/8", "Backend": {"Type": "vxlan"}});
        std::fs::write(dir.path().join("net-conf.json"), conf.to_string())?;
        Ok(KubeCacheBed {
            name: v.name,
            nodes: self.0.nodes,
            server,
            dir,
            _rt: rt,
        })
    }

    fn measure(&self, bed: &KubeCacheBed, _step: usize) -> Result<Vec<(usize, f64)>> {
        let exe = std::env::current_exe().context("current_exe")?;
        let out = Command::new(exe)
            .args([
                "kube-cache-probe",
                "--url",
                &bed.server.url(),
                "--keep",
                bed.name,
            ])
            .arg("--nodes")
            .arg(bed.nodes.to_string())
            .arg("--net-conf")
            .arg(bed.net_conf())
            .output()
            .context("running the probe")?;
        let text = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "the probe failed ({}): {}{}",
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        );
        let held = field(&text, "held_kib")?;
        Ok(vec![
            (0, held / 1024.0),
            (1, held / f64::from(bed.nodes.max(1))),
            (2, field(&text, "sync_ms")?),
            (3, field(&text, "churn_cpu_ms")?),
        ])
    }
}

/// `key=<number>` in the probe's output line.
fn field(text: &str, key: &str) -> Result<f64> {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .with_context(|| format!("no {key} in the probe's output {text:?}"))?
        .parse()
        .with_context(|| format!("{key} in {text:?}"))
}

/// Sets up every variant, measures them round-robin and summarises against `whole-nodes`.
pub fn run_all(
    opts: &KubeCacheOptions,
    log: &dyn Fn(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<Report> {
    if opts.nodes < 2 {
        bail!("--nodes must be at least 2");
    }
    let names: Vec<String> = variants().iter().map(|v| v.name.to_owned()).collect();
    let plan = Plan::new(&opts.name, &names, "whole-nodes", opts.reps);
    let settings = json!({
        "reps": opts.reps,
        "nodes": opts.nodes,
        "node": "kube_mock::realistic_node: flannel annotations, 40 images, managedFields",
        "memory": "VmRSS after malloc_trim(0), once every node is held, less the same right before the first request",
        "churn": "the probe's CPU time (getrusage) from its first of N status patches (one per node, a kubelet's heartbeat: the Ready condition's lastHeartbeatTime, sent as raw requests) until 1 s after the last",
    });
    rounds::run(&KubeCache(opts), plan, settings, log, cancelled)
}

/// This process's CPU time (user and system, every thread) in ms.
fn cpu_ms() -> f64 {
    // SAFETY: getrusage writes the struct it is given.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(usage.ru_utime) + ms(usage.ru_stime)
}

/// The CPU this process spends from its first of `nodes` status patches (each node's
/// `Ready` heartbeat, as a kubelet sends it; the answers are not parsed) until a second after
/// the last, while what it holds takes the watch events they cause.
async fn churn_cpu_ms(client: &kube::Client, nodes: u32) -> Result<f64> {
    // A heartbeat this process has not sent before (an unchanged one makes no event).
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let began = cpu_ms();
    for i in 0..nodes {
        let at = k8s_openapi::jiff::Timestamp::from_second(i64::try_from(now)? + i64::from(i))?;
        let body = json!({"status": {"conditions": [{"type": "Ready", "status": "True",
            "lastHeartbeatTime": at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()}]}});
        let request = axum::http::Request::patch(format!("/api/v1/nodes/node-{i}/status"))
            .header("content-type", "application/strategic-merge-patch+json")
            .body(serde_json::to_vec(&body)?)?;
        client.request_text(request).await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(cpu_ms() - began)
}

/// The resident memory of this process in KiB, after handing freed memory back.
fn rss_kib() -> Result<f64> {
    // SAFETY: malloc_trim only walks glibc's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .context("no VmRSS")?
        .parse()
        .context("VmRSS")
}

/// The probe process (`flannel-lab kube-cache-probe`): holds every node of the fake API
/// server at `url` the way `keep` says (a variant's name), then prints
/// `held_kib=<KiB> sync_ms=<ms>`.
pub fn probe(url: &str, keep: &str, nodes: u32, net_conf: &Path) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client = kube::Client::try_from(kube::Config::new(url.parse()?))?;
        let patcher = client.clone();
        let before = rss_kib()?;
        let began = Instant::now();
        // What the process holds stays alive until it is measured.
        let held: Box<dyn std::any::Any> = match keep {
            "agent" => {
                let mgr = Arc::new(KubeSubnetManager::new(
                    client,
                    OWN,
                    DEFAULT_PREFIX,
                    net_conf,
                )?);
                let (publisher, mut rx) = lease_channel();
                let cancel = CancellationToken::new();
                let task = tokio::spawn({
                    let mgr = mgr.clone();
                    let cancel = cancel.clone();
                    async move { mgr.watch_leases(publisher, cancel).await }
                });
                let want = (nodes - 1) as usize;
                tokio::time::timeout(Duration::from_secs(300), async {
                    loop {
                        if rx.borrow_and_update().synced && rx.borrow().leases.len() == want {
                            return Ok(());
                        }
                        rx.changed().await?;
                    }
                })
                .await
                .context("the agent's lease set did not fill")?
                .map_err(|e: tokio::sync::watch::error::RecvError| anyhow::anyhow!(e))?;
                Box::new((mgr, rx, cancel.drop_guard(), task))
            }
            "whole-nodes" => {
                let (store, writer) = reflector::store::<Node>();
                let stream = reflector(
                    writer,
                    watcher(Api::<Node>::all(client), watcher::Config::default()),
                )
                .default_backoff();
                let task = tokio::spawn(stream.for_each(|_| std::future::ready(())));
                tokio::time::timeout(Duration::from_secs(300), store.wait_until_ready())
                    .await
                    .context("the reflector did not fill")??;
                ensure!(
                    store.state().len() == nodes as usize,
                    "{} nodes held",
                    store.state().len()
                );
                Box::new((store, task))
            }
            other => bail!("unknown --keep {other:?}"),
        };
        let took = began.elapsed();
        let after = rss_kib()?;
        let churn = churn_cpu_ms(&patcher, nodes).await?;
        println!(
            "held_kib={:.0} sync_ms={:.1} churn_cpu_ms={churn:.1}",
            after - before,
            took.as_secs_f64() * 1e3
        );
        drop(held);
        Ok(())
    })
}
