//! `flannel-lab bench resync`: what one read of conntrack costs the flow tables
//! (`FastPath::seed`, run at start-up and every `--ebpf-conntrack-resync`) on a node with N open
//! NATed connections, against the same number of DNS lookups.
//!
//! The read itself (the netlink dump of conntrack's table) is the same for both and is left
//! out: each variant hands the agent's `seed` the keys such a read yields, and the time is that
//! of writing them into the programs' tables.
//!
//! | variant | what the read finds |
//! |---|---|
//! | `lookups` (baseline) | N UDP lookups through a Service, answered once and never a stream: rewritten into the kernel-flow LRU table |
//! | `held` | N open TCP connections through a Service, held since the read before (the steady state): the held table walked and compared, nothing written |
//! | `held-churn` | the same, with a tenth of the connections closed since the read before and as many new ones opened |
//!
//! The kernel-flow LRU table holds 65,536 flows; the held tables are sized to hold N (as
//! `--ebpf-held-max-entries` or a large enough `nf_conntrack_max` makes them). Each variant has
//! its own fast path, loaded but attached nowhere, pinned under a per-run path.

use std::{
    net::Ipv4Addr,
    path::PathBuf,
    sync::{Mutex, PoisonError},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use flannel_agent::bpf::{
    FastPath, LoadOptions,
    held::HELD_MIN_ENTRIES,
    seed::{Keys, Seeds},
};
use flannel_common::flow::FlowKey;
use serde_json::json;

use super::{
    report::Report,
    rounds::{self, Bench, Metric, Plan},
};
use crate::netns::run_prefix;

/// The metrics, in report order: key, label, unit, higher is better.
pub const METRICS: [Metric; 2] = [
    (
        "read_ms",
        "one read's keys written into the flow tables",
        "ms",
        false,
    ),
    ("per_flow_us", "the same per flow", "µs", false),
];

/// The remote pod the connections go to (a Service's backend).
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 7);

/// What a variant's reads find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flows {
    Lookups,
    Held,
    HeldChurn,
}

/// A variant.
#[derive(Debug, Clone)]
pub struct ResyncVariant {
    /// Name on the command line and in reports.
    pub name: &'static str,
    /// One line about it.
    pub description: &'static str,
    flows: Flows,
}

/// Every variant, the baseline first.
pub fn variants() -> Vec<ResyncVariant> {
    vec![
        ResyncVariant {
            name: "lookups",
            description: "N answered UDP lookups, rewritten into the kernel-flow LRU table",
            flows: Flows::Lookups,
        },
        ResyncVariant {
            name: "held",
            description: "N open TCP connections, held since the read before",
            flows: Flows::Held,
        },
        ResyncVariant {
            name: "held-churn",
            description: "N open TCP connections, a tenth of them new since the read before",
            flows: Flows::HeldChurn,
        },
    ]
}

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct ResyncOptions {
    /// Report name (file names and title).
    pub name: String,
    /// Repetitions (round-robin across the variants).
    pub reps: usize,
    /// Flows each read finds.
    pub connections: u32,
}

impl Default for ResyncOptions {
    fn default() -> Self {
        ResyncOptions {
            name: "resync".to_owned(),
            reps: 7,
            connections: 32_768,
        }
    }
}

/// The kernel-flow key of flow number `i`: a local pod (one of 256 addresses) to the backend,
/// TCP or UDP.
fn flow(i: u32, proto: u8) -> FlowKey {
    FlowKey {
        local_addr: [10, 244, 1, (i >> 16) as u8],
        remote_addr: BACKEND.octets(),
        local_port: (i as u16).to_be_bytes(),
        remote_port: if proto == 17 { 53u16 } else { 80 }.to_be_bytes(),
        proto,
        _pad: [0; 3],
    }
}

/// A variant set up: its fast path and where the next read's window of flows starts.
pub struct ResyncBed {
    pin: PathBuf,
    flows: Flows,
    n: u32,
    state: Mutex<(FastPath, u32)>,
}

impl Drop for ResyncBed {
    fn drop(&mut self) {
        let _ = flannel_agent::bpf::cleanup(&self.pin);
    }
}

/// What a read of `flows` finds: flows `start..start + n`.
fn seeds(flows: Flows, n: u32, start: u32) -> Seeds {
    let proto = if flows == Flows::Lookups { 17 } else { 6 };
    let keys = Keys {
        flows4: (start..start + n).map(|i| flow(i, proto)).collect(),
        ..Keys::default()
    };
    Seeds {
        held: if flows == Flows::Lookups {
            Keys::default()
        } else {
            keys.clone()
        },
        keys,
        ..Seeds::default()
    }
}

struct Resync<'a>(&'a ResyncOptions);

impl Bench for Resync<'_> {
    type Variant = ResyncVariant;
    type Bed = ResyncBed;

    const METRICS: &'static [Metric] = &METRICS;
    const KIND: &'static str = "resync variant";

    fn all() -> Vec<ResyncVariant> {
        variants()
    }

    fn label(v: &ResyncVariant) -> (&'static str, &'static str) {
        (v.name, v.description)
    }

    fn set_up(&self, v: &ResyncVariant, _log: &dyn Fn(&str)) -> Result<ResyncBed> {
        let pin = PathBuf::from(format!("/sys/fs/bpf/{}rs{}", run_prefix(), v.name));
        let options = LoadOptions {
            held_max_entries: self.0.connections.max(HELD_MIN_ENTRIES),
            ..LoadOptions::default()
        };
        let fp = FastPath::load_with(&pin, &options)
            .with_context(|| format!("loading the fast path for {}", v.name))?;
        let bed = ResyncBed {
            pin,
            flows: v.flows,
            n: self.0.connections,
            state: Mutex::new((fp, 0)),
        };
        // The read before: the steady state each measurement starts from.
        let first = seeds(bed.flows, bed.n, 0);
        let mut state = bed.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.0.seed(&first).context("the first read")?;
        drop(state);
        Ok(bed)
    }

    fn measure(&self, bed: &ResyncBed, _step: usize) -> Result<Vec<(usize, f64)>> {
        let mut state = bed.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (fp, start) = &mut *state;
        if bed.flows == Flows::HeldChurn {
            *start += (bed.n / 10).max(1);
        }
        let read = seeds(bed.flows, bed.n, *start);
        let began = Instant::now();
        let seeded = fp.seed(&read).context("a read")?;
        let took = began.elapsed().as_secs_f64();
        if seeded.held.full != 0 {
            bail!("{} flows did not fit the held tables", seeded.held.full);
        }
        Ok(vec![
            (0, took * 1e3),
            (1, took * 1e6 / f64::from(bed.n.max(1))),
        ])
    }
}

/// Sets up every variant, times their reads round-robin and summarises against `lookups`.
pub fn run_all(
    opts: &ResyncOptions,
    log: &dyn Fn(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<Report> {
    if opts.connections == 0 {
        bail!("--connections must be at least 1");
    }
    let names: Vec<String> = variants().iter().map(|v| v.name.to_owned()).collect();
    let plan = Plan::new(&opts.name, &names, "lookups", opts.reps);
    let settings = json!({
        "reps": opts.reps,
        "connections": opts.connections,
        "timing": "FastPath::seed of one read's keys (the conntrack dump itself left out), wall clock",
    });
    rounds::run(&Resync(opts), plan, settings, log, cancelled)
}
