//! `flannel-lab bench programs`: what one run of the fast path's programs costs, against the
//! floor program (`tc_bench_floor`, see [`super::floor`]) on the same packets, timed by the
//! kernel with `BPF_PROG_TEST_RUN`.
//!
//! The dataplane bench sees the programs' cost only through a network stack that costs 20-40
//! times more per round trip and through a machine whose speed drifts from minute to minute;
//! its BPF statistics add two clock reads to every run. Here each program runs 200 times in a
//! row on one packet inside the kernel (`repeat`), with warm caches and nothing around it, so
//! the figure is the program's own work per packet (instructions, map lookups, helper calls)
//! to a few nanoseconds; what it costs in a real round trip, with cold caches, is larger (see
//! `docs/performance.md`). The packets are the host-gw lab's: a pod's TCP segment to a pod on
//! another node and one arriving for a local pod, each of a flow the agent remembered
//! (`flannel_common::memo`, the short path every packet but a flow's first takes), and an ICMP
//! echo, which no memo covers: the full checks on every packet.
//!
//! | variant | programs |
//! |---|---|
//! | `floor` | `tc_bench_floor` for all three packets (TTL, MACs, redirect; a hash lookup) |
//! | `agent` | `tc_from_bridge` (sending), `tc_from_netdev` (delivering), loaded and synced through the agent's `flannel_agent::bpf` API |
//!
//! Each variant lives in a namespace of its own that looks like a node
//! ([`crate::bpfrig`], with a permanent neighbour for the peer and the pod, and the host-gw
//! route), which the full checks' `bpf_fib_lookup` needs. The eBPF object is the one built into `flannel-lab`.

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    path::PathBuf,
    sync::{Mutex, PoisonError},
};

use anyhow::{Context as _, Result, bail};
use aya::{Ebpf, TestRun as _, TestRunOptions, programs::SchedClassifier};
use flannel_agent::bpf::{FastPath, Hook, LocalConfig, Remote, Via};
use flannel_common::{
    pods::{PodPort, PortKey},
    programs::{FLOOR_EGRESS, FLOOR_PEER, FloorHop, TC_BENCH_FLOOR},
    stats::Reason,
};
use ipnet::Ipv4Net;
use serde_json::json;

use super::{
    report::Report,
    rounds::{self, Bench, Metric, Plan},
};
use crate::{
    bpfrig::{self, BR_MAC, EXT_MAC, Mac, POD_MAC, Skb, TC_ACT_REDIRECT, mac_str},
    netns::{NetNs, run_prefix},
    packet::{Ethernet, Icmp, Ipv4, Tcp, Transport},
};

/// Runs per `BPF_PROG_TEST_RUN` call: the packet's TTL (255) must outlast them, since each
/// run forwards the same buffer again.
const REPEAT: u32 = 200;
/// The veth the memo delivers into (test_run does not carry the redirect out).
const POD_PORT: u32 = 4242;

const PEER_MAC: Mac = [0x02, 0xee, 0, 0, 0, 0x02];
/// `ext0`'s address ([`bpfrig::build`]).
const PUBLIC: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 5);
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 7);

/// The metrics, in report order: key, label, unit, higher is better.
pub const METRICS: [Metric; 3] = [
    (
        "send_ns",
        "pod to remote pod, remembered TCP flow",
        "ns/run",
        false,
    ),
    (
        "deliver_ns",
        "remote pod to local pod, remembered TCP flow",
        "ns/run",
        false,
    ),
    (
        "send_icmp_ns",
        "pod to remote pod, ICMP echo (full checks)",
        "ns/run",
        false,
    ),
];

/// A set of programs to time.
#[derive(Debug, Clone)]
pub struct ProgramsVariant {
    /// Name on the command line and in reports.
    pub name: &'static str,
    /// One line about it.
    pub description: &'static str,
    /// The agent's programs (otherwise the floor).
    pub agent: bool,
}

/// Every variant, the baseline first.
pub fn variants() -> Vec<ProgramsVariant> {
    vec![
        ProgramsVariant {
            name: "floor",
            description: "tc_bench_floor: TTL, MACs and redirect from a hash lookup",
            agent: false,
        },
        ProgramsVariant {
            name: "agent",
            description: "tc_from_bridge / tc_from_netdev, configured by the agent's API",
            agent: true,
        },
    ]
}

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct ProgramsOptions {
    /// Report name (file names and title).
    pub name: String,
    /// Repetitions (round-robin across the variants).
    pub reps: usize,
    /// `BPF_PROG_TEST_RUN` calls per metric and repetition (each `REPEAT` runs); the
    /// metric is the time of the fastest tenth of them (`fastest_tenth`).
    pub calls: usize,
}

impl Default for ProgramsOptions {
    fn default() -> Self {
        ProgramsOptions {
            name: "programs".to_owned(),
            reps: 21,
            calls: 500,
        }
    }
}

/// The three packets, as the pod, the peer node and the pod again send them.
struct Frames {
    send: Vec<u8>,
    deliver: Vec<u8>,
    send_icmp: Vec<u8>,
}

impl Frames {
    fn new() -> Frames {
        let payload = [0x5a; 64];
        let ip = |src, dst, l4: Transport| Ipv4 {
            ttl: 255,
            ..Ipv4::new(src, dst, l4)
        };
        let tcp = |sport, dport| Tcp::new(sport, dport).payload(&payload).into();
        Frames {
            send: Ethernet::new(POD_MAC, BR_MAC, ip(POD, REMOTE_POD, tcp(40000, 8080))).encode(),
            deliver: Ethernet::new(PEER_MAC, EXT_MAC, ip(REMOTE_POD, POD, tcp(8080, 40000)))
                .encode(),
            send_icmp: Ethernet::new(
                POD_MAC,
                BR_MAC,
                ip(POD, REMOTE_POD, Icmp::echo_request(7, 1).into()),
            )
            .encode(),
        }
    }
}

/// The programs of a variant, loaded in its namespace.
enum Loaded {
    Floor(Ebpf),
    Agent(Box<FastPath>),
}

impl Loaded {
    /// The program that takes a packet sent by the pod (`deliver`: one arriving for it).
    fn program(&mut self, deliver: bool) -> Result<&SchedClassifier> {
        Ok(match self {
            Loaded::Floor(ebpf) => ebpf
                .program(TC_BENCH_FLOOR)
                .context("no floor program")?
                .try_into()?,
            Loaded::Agent(fp) => {
                let hook = if deliver {
                    Hook::FromNetdev
                } else {
                    Hook::FromBridge
                };
                fp.program_mut(hook)?
            }
        })
    }
}

/// A variant set up: its namespace, programs and interfaces.
pub struct ProgramsBed {
    ns: NetNs,
    pin: PathBuf,
    loaded: Mutex<Loaded>,
    ext: u32,
    bridge: u32,
}

impl Drop for ProgramsBed {
    fn drop(&mut self) {
        let _ = bpfrig::cleanup_in(&self.ns, &self.pin);
    }
}

struct Programs<'a>(&'a ProgramsOptions);

impl Bench for Programs<'_> {
    type Variant = ProgramsVariant;
    type Bed = ProgramsBed;

    const METRICS: &'static [Metric] = &METRICS;
    const KIND: &'static str = "programs variant";

    fn all() -> Vec<ProgramsVariant> {
        variants()
    }

    fn label(v: &ProgramsVariant) -> (&'static str, &'static str) {
        (v.name, v.description)
    }

    fn set_up(&self, v: &ProgramsVariant, _log: &dyn Fn(&str)) -> Result<ProgramsBed> {
        set_up(v).with_context(|| format!("variant {}", v.name))
    }

    fn measure(&self, bed: &ProgramsBed, _step: usize) -> Result<Vec<(usize, f64)>> {
        let calls = self.0.calls;
        bed.ns.enter(|| measure(bed, calls))?
    }
}

/// The node namespace and the variant's programs in it.
fn set_up(v: &ProgramsVariant) -> Result<ProgramsBed> {
    let ns = NetNs::new(&format!("pc{}", v.name))?;
    bpfrig::build(&ns, true)?;
    for cmd in [
        format!(
            "ip neigh replace {PEER} lladdr {} dev ext0 nud permanent",
            mac_str(&PEER_MAC)
        ),
        format!(
            "ip neigh replace {POD} lladdr {} dev br0 nud permanent",
            mac_str(&POD_MAC)
        ),
        format!("ip route add 10.244.2.0/24 via {PEER} dev ext0"),
    ] {
        bpfrig::sh(&ns, &cmd)?;
    }
    let pin = PathBuf::from(format!("/sys/fs/bpf/{}pc{}", run_prefix(), v.name));
    let agent = v.agent;
    let pin_in = pin.clone();
    let (loaded, ext, bridge) = ns.enter(move || -> Result<(Loaded, u32, u32)> {
        let index = |name: &str| {
            nix::net::if_::if_nametoindex(name).with_context(|| format!("no interface {name}"))
        };
        let (ext, bridge) = (index("ext0")?, index("br0")?);
        let loaded = if agent {
            Loaded::Agent(Box::new(load_agent(&pin_in, ext, bridge)?))
        } else {
            Loaded::Floor(load_floor(ext)?)
        };
        Ok((loaded, ext, bridge))
    })??;
    Ok(ProgramsBed {
        ns,
        pin,
        loaded: Mutex::new(loaded),
        ext,
        bridge,
    })
}

/// The agent's programs, configured as a host-gw node with one remote subnet and the pod's
/// bridge port known (for delivery into its namespace).
fn load_agent(pin: &std::path::Path, ext: u32, bridge: u32) -> Result<FastPath> {
    let net = |s: &str| s.parse::<Ipv4Net>().context("network");
    let mut fp = FastPath::load(pin)?;
    fp.set_config(&LocalConfig::new(
        PUBLIC,
        ext,
        net("10.244.1.0/24")?,
        net("10.244.0.0/16")?,
    ))?;
    let remote = Remote {
        public_ip: PEER,
        via: Via::HostGw,
    };
    fp.sync(&BTreeMap::from([(net("10.244.2.0/24")?, remote)]))?;
    let port = PodPort {
        ifindex: POD_PORT,
        bridge,
    };
    fp.sync_ports(&BTreeMap::from([(PortKey::new(POD_MAC), port)]))?;
    Ok(fp)
}

/// The floor program with the two destinations it forwards (loaded, not attached: it is
/// only test-run).
fn load_floor(ext: u32) -> Result<Ebpf> {
    let mut ebpf = Ebpf::load(flannel_agent::EBPF_OBJECT).context("loading the object")?;
    let to_peer = FloorHop {
        ifindex: ext,
        smac: EXT_MAC,
        dmac: PEER_MAC,
        into_peer: FLOOR_EGRESS,
        ..FloorHop::default()
    };
    let into_pod = FloorHop {
        ifindex: POD_PORT,
        smac: BR_MAC,
        dmac: POD_MAC,
        into_peer: FLOOR_PEER,
        ..FloorHop::default()
    };
    super::floor::load_program(
        &mut ebpf,
        [(REMOTE_POD.octets(), to_peer), (POD.octets(), into_pod)],
    )?;
    Ok(ebpf)
}

/// One repetition, run inside the variant's namespace: each packet's median time per run.
fn measure(bed: &ProgramsBed, calls: usize) -> Result<Vec<(usize, f64)>> {
    let frames = Frames::new();
    let mut loaded = bed.loaded.lock().unwrap_or_else(PoisonError::into_inner);
    let cases = [
        (&frames.send, false, bed.bridge),
        (&frames.deliver, true, bed.ext),
        (&frames.send_icmp, false, bed.bridge),
    ];
    let mut out = Vec::new();
    for (metric, (frame, deliver, ifindex)) in cases.into_iter().enumerate() {
        let before = memo_hits(&loaded, deliver)?;
        let program = loaded.program(deliver)?;
        // The flow's first packet takes the full checks (and is remembered); not timed.
        run(program, frame, ifindex, 1)?;
        let times = (0..calls)
            .map(|_| run(program, frame, ifindex, REPEAT))
            .collect::<Result<Vec<_>>>()?;
        let hits = memo_hits(&loaded, deliver)?.saturating_sub(before);
        // A memo must have taken the TCP packets' timed runs, and none the ICMP echoes. (A
        // memo goes stale after a fraction of a second, and the next run takes the full
        // checks again: a long measurement may have a few such runs.)
        let timed = calls as u64 * u64::from(REPEAT);
        if let Loaded::Agent(_) = *loaded {
            let remembered = metric < 2;
            if remembered && hits * 100 < timed * 99 || !remembered && hits != 0 {
                bail!("{}: {hits} memo hits in {timed} runs", METRICS[metric].0);
            }
        }
        out.push((metric, fastest_tenth(times)));
    }
    Ok(out)
}

/// The time below which a tenth of the calls' times lie. Interference (the host's other
/// guests, interrupts) only ever adds time, and on these machines it comes and goes in
/// stretches of seconds that a median of one measurement may or may not catch; the fastest
/// tenth is what the program costs when it has the CPU to itself.
fn fastest_tenth(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 10]
}

/// The agent's memo hits so far in the program taking `deliver`'s packets (0 for the floor).
fn memo_hits(loaded: &Loaded, deliver: bool) -> Result<u64> {
    let Loaded::Agent(fp) = loaded else {
        return Ok(0);
    };
    let counters = fp.counters()?;
    let program = if deliver {
        &counters.from_netdev
    } else {
        &counters.from_bridge
    };
    Ok(program.get(Reason::MemoHit).packets)
}

/// One `BPF_PROG_TEST_RUN` of `program` on `frame` received on `ifindex`, `repeat` times:
/// the kernel's time per run in ns. Every run must redirect the packet.
fn run(program: &SchedClassifier, frame: &[u8], ifindex: u32, repeat: u32) -> Result<f64> {
    let ctx_in = Skb::on(ifindex).bytes();
    let mut ctx_out = [0u8; 192];
    let mut data_out = vec![0u8; frame.len() + 256];
    let result = program
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut data_out),
            ctx_in: Some(&ctx_in),
            ctx_out: Some(&mut ctx_out),
            repeat,
            ..TestRunOptions::default()
        })
        .context("BPF_PROG_TEST_RUN")?;
    if result.return_value != TC_ACT_REDIRECT {
        bail!(
            "the program returned {}, not a redirect",
            result.return_value
        );
    }
    Ok(result.duration.as_nanos() as f64)
}

/// Sets up both variants, times them round-robin and summarises against the floor.
pub fn run_all(
    opts: &ProgramsOptions,
    log: &dyn Fn(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<Report> {
    if opts.calls == 0 {
        bail!("--calls must be at least 1");
    }
    let names: Vec<String> = variants().iter().map(|v| v.name.to_owned()).collect();
    let plan = Plan::new(&opts.name, &names, "floor", opts.reps);
    let settings = json!({
        "reps": opts.reps,
        "calls": opts.calls,
        "repeat": REPEAT,
        "packets": "Ethernet + IPv4 (TTL 255) + TCP with 64 bytes of payload, or an ICMP echo",
        "timing": "BPF_PROG_TEST_RUN duration per run (kernel clock), the fastest tenth of the calls",
    });
    rounds::run(&Programs(opts), plan, settings, log, cancelled)
}
