//! Shared by the `BPF_PROG_TEST_RUN` tests (`bpf_fastpath`, `bpf_udp`, `bpf_v6`, `bpf_nat`):
//! the node namespace the programs run in, the `__sk_buff` context of a run, and running a
//! hook with the difference of its per-reason counters.
//!
//! The node is `flannel_tests::bpfrig`'s: an external veth `ext0` (192.168.77.1/24,
//! [`EXT_MAC`]) and, for the tests that need one, a pod bridge `br0` (10.244.1.1/24,
//! [`BR_MAC`]) with one veth port `pod0`, IPv4 forwarding on. Each test file adds its own
//! neighbours, routes and addresses with [`Rig::sh`], and loads and configures the fast path
//! itself.

#![allow(dead_code)] // each test file uses a different part

pub mod mutate;

use std::{path::PathBuf, time::Duration};

use aya::{TestRun as _, TestRunOptions, programs::ProgramError};
use flannel_agent::bpf::{FastPath, Hook, ReasonCounters};
use flannel_common::{hops::HOP_TTL_TICKS, stats::Reason};
#[allow(unused_imports)] // each test file uses a different part
pub use flannel_tests::bpfrig::{
    BR_MAC, EXT_MAC, Mac, POD_MAC, Skb, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, mac_str,
};
use flannel_tests::{bpfrig, netns::NetNs, packet::hexdump};
use ipnet::Ipv4Net;

/// How long a remembered route lookup or flow is used on this kernel: `HOP_TTL_TICKS` timer
/// ticks at its HZ (0.4 s at HZ=250, at most a second anywhere).
pub fn hop_ttl() -> Duration {
    Duration::from_secs(HOP_TTL_TICKS) / kernel_hz()
}

/// Well inside [`hop_ttl`]: how long a test may take between a lookup and the check that
/// its answer is still remembered (a slower step is tried again).
pub fn within_hop_ttl() -> Duration {
    hop_ttl() * 4 / 5
}

/// Longer than [`hop_ttl`] by a margin: what a test sleeps for everything remembered to age.
pub fn past_hop_ttl() -> Duration {
    hop_ttl() + Duration::from_millis(100)
}

/// The kernel's timer frequency (`CONFIG_HZ`, one of the four Linux offers), measured once:
/// two readings of `/proc/timer_list` 250 ms apart, each giving `CLOCK_MONOTONIC` and the tick
/// count, and the offered rate nearest to the ticks per second between them.
pub fn kernel_hz() -> u32 {
    static HZ: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *HZ.get_or_init(|| {
        let reading = || -> (u64, u64) {
            let text = std::fs::read_to_string("/proc/timer_list").expect("read /proc/timer_list");
            let field = |prefix: &str, suffix: &str| -> u64 {
                text.lines()
                    .find_map(|l| {
                        l.strip_prefix(prefix)?
                            .strip_suffix(suffix)?
                            .trim()
                            .parse()
                            .ok()
                    })
                    .unwrap_or_else(|| panic!("/proc/timer_list has no {prefix:?} line"))
            };
            (field("now at ", " nsecs"), field("jiffies: ", ""))
        };
        let (ns0, j0) = reading();
        std::thread::sleep(Duration::from_millis(250));
        let (ns1, j1) = reading();
        let rate = (j1 - j0) as f64 * 1e9 / (ns1 - ns0) as f64;
        [100u32, 250, 300, 1000]
            .into_iter()
            .min_by(|a, b| {
                (f64::from(*a) - rate)
                    .abs()
                    .total_cmp(&(f64::from(*b) - rate).abs())
            })
            .expect("candidates")
    })
}

pub fn net(s: &str) -> Ipv4Net {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// A node namespace and the fast path's pin directory `/sys/fs/bpf/<run prefix><name>`,
/// removed on drop.
pub struct Rig {
    pub ns: NetNs,
    pub pin: PathBuf,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = bpfrig::cleanup_in(&self.ns, &self.pin);
    }
}

impl Rig {
    /// The namespace with `ext0` only, forwarding on. `None` (test skipped) when not root or
    /// without the eBPF object.
    pub fn ext_only(name: &str) -> Option<Rig> {
        let rig = Rig::empty(name)?;
        bpfrig::build(&rig.ns, false).expect("the node's links");
        Some(rig)
    }

    /// The namespace with `ext0` and the pod bridge `br0` with its port `pod0`, forwarding on.
    /// `None` (test skipped) when not root or without the eBPF object.
    pub fn node(name: &str) -> Option<Rig> {
        let rig = Rig::empty(name)?;
        bpfrig::build(&rig.ns, true).expect("the node's links");
        Some(rig)
    }

    fn empty(name: &str) -> Option<Rig> {
        if !flannel_tests::is_root() {
            eprintln!("skipped: needs root (BPF_PROG_TEST_RUN, namespaces)");
            return None;
        }
        if flannel_agent::EBPF_OBJECT.is_empty() {
            eprintln!("skipped: flannel-agent was built with AYA_BUILD_SKIP=1");
            return None;
        }
        let ns = NetNs::new(name).expect("namespace");
        let pin = PathBuf::from(format!(
            "/sys/fs/bpf/{}{name}",
            flannel_tests::netns::run_prefix()
        ));
        Some(Rig { ns, pin })
    }

    /// Runs `cmd` (split at whitespace) in the namespace; panics when it fails.
    pub fn sh(&self, cmd: &str) {
        bpfrig::sh(&self.ns, cmd).unwrap_or_else(|e| panic!("{cmd}: {e:#}"));
    }
}

/// The interfaces of the rig, resolved inside the namespace.
pub struct Ifaces {
    pub ext: u32,
    pub br: u32,
}

impl Ifaces {
    pub fn current() -> Ifaces {
        let index = |name: &str| {
            nix::net::if_::if_nametoindex(name).unwrap_or_else(|e| panic!("{name}: {e}"))
        };
        Ifaces {
            ext: index("ext0"),
            br: index("br0"),
        }
    }
}

/// The result of one run: the verdict, the output frame, the mark on the way out and the
/// counters that moved (reason, packets, bytes).
pub struct Run {
    pub verdict: u32,
    pub out: Vec<u8>,
    pub mark_after: u32,
    pub counted: Vec<(Reason, u64, u64)>,
}

pub fn counters_of(fp: &FastPath, hook: Hook) -> ReasonCounters {
    let all = fp.counters().expect("counters");
    match hook {
        Hook::FromBridge => all.from_bridge,
        Hook::FromNetdev => all.from_netdev,
        Hook::ToNetdev => all.to_netdev,
    }
}

/// The counters that moved from `before` to `after`: (reason, packets, bytes).
pub fn counted_between(before: &ReasonCounters, after: &ReasonCounters) -> Vec<(Reason, u64, u64)> {
    Reason::ALL
        .iter()
        .filter_map(|r| {
            let (a, b) = (after.get(*r), before.get(*r));
            (a.packets != b.packets).then(|| (*r, a.packets - b.packets, a.bytes - b.bytes))
        })
        .collect()
}

/// Runs `hook` on `frame` with the context `skb`.
pub fn run(fp: &mut FastPath, hook: Hook, frame: &[u8], skb: Skb) -> Run {
    try_run(fp, hook, frame, skb)
        .unwrap_or_else(|e| panic!("test_run of {hook:?}: {e:?}\n{}", hexdump(frame)))
}

/// [`run`], or the error of a test run the kernel refused (it takes no IPv4 frame shorter
/// than an IPv4 header, for one).
pub fn try_run(fp: &mut FastPath, hook: Hook, frame: &[u8], skb: Skb) -> Result<Run, ProgramError> {
    let before = counters_of(fp, hook);
    let ctx_in = skb.bytes();
    let mut ctx_out = [0u8; 192];
    let mut out = vec![0u8; frame.len() + 256];
    let result = fp
        .program_mut(hook)
        .expect("program")
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx_in),
            ctx_out: Some(&mut ctx_out),
            ..TestRunOptions::default()
        })?;
    out.truncate(result.data_size_out as usize);
    let after = counters_of(fp, hook);
    let counted = counted_between(&before, &after);
    Ok(Run {
        verdict: result.return_value,
        out,
        mark_after: u32::from_ne_bytes([ctx_out[8], ctx_out[9], ctx_out[10], ctx_out[11]]),
        counted,
    })
}

/// XDP verdicts a test run returns.
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;

/// Runs `xdp_from_netdev` on `frame`: the verdict, the output and what was counted (no mark).
pub fn run_xdp(fp: &mut FastPath, frame: &[u8]) -> Run {
    try_run_xdp(fp, frame).unwrap_or_else(|e| panic!("XDP test_run: {e:?}\n{}", hexdump(frame)))
}

/// [`run_xdp`], or the error of a test run the kernel refused.
pub fn try_run_xdp(fp: &mut FastPath, frame: &[u8]) -> Result<Run, ProgramError> {
    let before = fp.counters().expect("counters").xdp_from_netdev;
    let mut out = vec![0u8; frame.len() + 256];
    let result = fp
        .xdp_program_mut()
        .expect("xdp program")
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ..TestRunOptions::default()
        })?;
    out.truncate(result.data_size_out as usize);
    let after = fp.counters().expect("counters").xdp_from_netdev;
    Ok(Run {
        verdict: result.return_value,
        out,
        mark_after: 0,
        counted: counted_between(&before, &after),
    })
}

/// Tells the fast path the local pod's bridge port (veth 4242 on the rig's bridge): delivery
/// then goes into the pod's namespace, the delivery a memo remembers.
pub fn know_pod_port(fp: &mut FastPath, ifs: &Ifaces) {
    let port = flannel_common::pods::PodPort {
        ifindex: 4242,
        bridge: ifs.br,
    };
    let key = flannel_common::pods::PortKey::new(POD_MAC);
    fp.sync_ports(&std::collections::BTreeMap::from([(key, port)]))
        .expect("sync ports");
}

/// Asserts the run counted exactly `reasons`, one packet each.
pub fn assert_counted(run: &Run, reasons: &[Reason], what: &str) {
    let mut want: Vec<(Reason, u64)> = reasons.iter().map(|r| (*r, 1)).collect();
    want.sort_by_key(|(r, _)| r.index());
    let got: Vec<(Reason, u64)> = run.counted.iter().map(|(r, p, _)| (*r, *p)).collect();
    assert_eq!(got, want, "{what}: counters");
}

pub fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    assert!(
        got == want,
        "{what}: output differs\n got:\n{}want:\n{}",
        hexdump(got),
        hexdump(want)
    );
}
