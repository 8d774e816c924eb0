//! Mutated packets. Each test file hands its well-formed frames ([`Seed`]s, one per path it
//! knows) to [`check`], which runs them and random variants of them through the programs:
//! bits flipped, bytes and length fields set to edge values, frames cut short or padded,
//! checksums made right again after a change (so that a changed field still gets past a
//! receiver's checks), GSO sizes set, kube-proxy's mark set on the way out. Every run is
//! held to the contract of the counters (`flannel_common::stats`) and of the verdicts:
//! - the packet is counted exactly once under its class (or malformed reason) and exactly once
//!   under a verdict, both with the length it arrived with;
//! - a pass hands the packet on unchanged, a drop drops it;
//! - a fast verdict carries the innermost IP packet through unchanged but for TTL and header
//!   checksum (masquerade aside), and leaves a frame that parses if the input did, and whose
//!   checksums verify if the input's did, inside a tunnel too (a router does not look at what
//!   it forwards beyond the headers it needs, and nor does this check: it asks only that
//!   nothing be broken);
//! - a variant a flow's memo decided is decided the same by the full checks (run again with
//!   every memo retired): the short path is only ever a shortcut.
//!
//! The variants are drawn from a fixed random seed, so a run is repeatable; the environment
//! variables `FLANNEL_MUTATION_SEED` and `FLANNEL_MUTATION_CASES` draw others or more. A
//! failure names the seed frame, the mutations, the random seed and both frames.

use std::collections::BTreeMap;

use flannel_agent::bpf::{FastPath, Hook};
use flannel_common::{
    nat::KUBE_PROXY_MASQ_MARK,
    stats::{Reason, ReasonKind},
};
use flannel_tests::packet::{
    self, ETH_P_IP, ETH_P_IPV6, IPPROTO_IPIP, ParsedL3, ParsedL4, checksum, fold, pseudo_header_v4,
    pseudo_header_v6, sum_words,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

use super::{
    Run, Skb, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, XDP_DROP, XDP_PASS, try_run, try_run_xdp,
};

/// The program a seed is run through.
#[derive(Clone, Copy, Debug)]
pub enum Program {
    /// A TC program.
    Tc(Hook),
    /// `xdp_from_netdev`.
    Xdp,
}

/// A well-formed frame of one path, and the program and context it is run with.
pub struct Seed {
    pub name: &'static str,
    pub program: Program,
    pub skb: Skb,
    pub frame: Vec<u8>,
}

/// What the runs were counted as: runs (and variants test_run refused), runs per reason (class
/// and verdict alike), and how many mutated frames the fast path still took.
#[derive(Debug, Default)]
pub struct Tally {
    pub runs: u64,
    /// Variants the kernel's test_run refused to run.
    pub refused: u64,
    pub by_reason: BTreeMap<Reason, u64>,
    pub fast_mutated: u64,
    /// Variants decided by a memo whose full checks decided the same.
    pub memo_compared: u64,
}

impl Seed {
    /// A seed for TC program `hook`.
    pub fn tc(name: &'static str, hook: Hook, skb: Skb, frame: Vec<u8>) -> Seed {
        Seed {
            name,
            program: Program::Tc(hook),
            skb,
            frame,
        }
    }
}

impl Tally {
    /// Prints the tally, then asserts the variants went far: every reason of `reasons` was
    /// counted, and at least `fast_mutated` mutated frames still took the fast path.
    pub fn assert_reached(&self, reasons: &[Reason], fast_mutated: u64) {
        eprintln!("{self:#?}");
        for reason in reasons {
            assert!(self.saw(*reason), "no run counted {reason:?}");
        }
        assert!(
            self.fast_mutated >= fast_mutated,
            "only {} mutated frames took the fast path",
            self.fast_mutated
        );
    }

    /// The distinct reasons of `kind` seen.
    pub fn kinds(&self, kind: ReasonKind) -> usize {
        self.by_reason.keys().filter(|r| r.kind() == kind).count()
    }

    pub fn saw(&self, reason: Reason) -> bool {
        self.by_reason.contains_key(&reason)
    }
}

/// The UDP datagrams that carry a packet the checks look into.
#[derive(Clone, Copy, Debug)]
pub enum Tunnel {
    /// VXLAN to this port: a VXLAN header, then an Ethernet frame.
    Vxlan(u16),
    /// The udp backend's datagrams to this port: an IPv4 packet.
    Udp(u16),
}

impl Tunnel {
    fn port(self) -> u16 {
        match self {
            Tunnel::Vxlan(port) | Tunnel::Udp(port) => port,
        }
    }

    /// The frame carried in UDP payload `payload` (an IPv4 packet gets an Ethernet header).
    fn frame_in(self, payload: &[u8]) -> Option<Vec<u8>> {
        match self {
            Tunnel::Vxlan(_) => packet::parse_vxlan(payload)
                .ok()
                .map(|(_, inner)| inner.to_vec()),
            Tunnel::Udp(_) => Some(with_ethernet(ETH_P_IP, payload)),
        }
    }

    /// [`Tunnel::frame_in`] for a whole UDP datagram `udp` (header first), if it goes to the
    /// tunnel's port and carries at least the headers of what is inside.
    fn frame_in_datagram(self, udp: &[u8]) -> Option<Vec<u8>> {
        let to_port = u16::from_be_bytes([*udp.get(2)?, *udp.get(3)?]) == self.port();
        let payload = udp.get(8..)?;
        let enough = match self {
            Tunnel::Vxlan(_) => payload.len() >= 8 + 14,
            Tunnel::Udp(_) => payload.len() >= 20,
        };
        if to_port && enough {
            self.frame_in(payload)
        } else {
            None
        }
    }
}

const DEFAULT_SEED: u64 = 0x5eed_f1a2_2026_1201;
/// Offsets of the 16-bit fields worth setting to edge values: EtherType, IPv4 total length,
/// fragment field and checksum, the L4 ports and UDP length, and the same fields of a frame
/// inside VXLAN (inner Ethernet at 50) or of an IPv4 packet inside IPIP (at 34); IPv6's
/// payload length and its L4 ports and UDP length.
const FIELDS16: [usize; 20] = [
    12, 16, 20, 24, 34, 36, 38, 40, 44, 48, 62, 66, 70, 74, 86, 88, 18, 54, 56, 58,
];
/// How far into a frame bits and bytes are changed: the headers of a tunnel and its inner frame.
const HEADERS: usize = 112;

/// Runs every seed once as it is, then `cases` mutated variants (`FLANNEL_MUTATION_CASES` if
/// set), every eighth case an unchanged seed again (so that flows stay remembered and the
/// variants meet the short paths as well), each held to the contract above. A variant that a
/// flow's memo decided is run once more with every memo retired, and the full checks must
/// decide the same (the same action, class, verdict and bytes, the outer IPv4 ID of an
/// encapsulation aside, which is random). `tunnel` says which UDP datagrams carry a packet to
/// look into. Panics on the first run that breaks a rule.
pub fn check(fp: &mut FastPath, seeds: &[Seed], cases: usize, tunnel: Tunnel) -> Tally {
    let rng_seed = env_u64("FLANNEL_MUTATION_SEED").unwrap_or(DEFAULT_SEED);
    let cases = env_u64("FLANNEL_MUTATION_CASES").map_or(cases, |n| n as usize);
    let mut rng = StdRng::seed_from_u64(rng_seed);
    let mut runner = Runner {
        rng_seed: Some(rng_seed),
        tunnel,
        tally: Tally::default(),
    };
    for seed in seeds {
        runner.one(fp, seed, &seed.frame, seed.skb, &[]);
    }
    for case in 0..cases {
        let seed = &seeds[rng.random_range(0..seeds.len())];
        if case % 8 == 0 {
            runner.one(fp, seed, &seed.frame, seed.skb, &[]);
            continue;
        }
        let mut frame = seed.frame.clone();
        let mut skb = seed.skb;
        let mut how = Vec::new();
        for _ in 0..rng.random_range(1..=3) {
            how.push(mutate(&mut rng, &mut frame));
        }
        if rng.random_bool(0.5) {
            reseal(&mut frame, tunnel);
            how.push("checksums made right".to_owned());
        }
        if matches!(seed.program, Program::Tc(_)) && rng.random_ratio(1, 6) {
            let size = *pick(&mut rng, &[1, 536, 1400, 1448, 8948, 65535]);
            skb = skb.gso(size, rng.random_range(1..=64));
            how.push(format!(
                "gso_size {} gso_segs {}",
                skb.gso_size, skb.gso_segs
            ));
        }
        if matches!(seed.program, Program::Tc(Hook::ToNetdev)) && rng.random_ratio(1, 8) {
            // kube-proxy's masquerade mark: no eBPF SNAT for such a packet.
            skb.mark = KUBE_PROXY_MASQ_MARK;
            how.push("kube-proxy's mark".to_owned());
        }
        if let Some(by_memo) = runner.one(fp, seed, &frame, skb, &how)
            && by_memo
                .counted
                .iter()
                .any(|(r, _, _)| *r == Reason::MemoHit)
        {
            fp.retire_memos().expect("retiring the memos");
            if let Some(full) = runner.one(fp, seed, &frame, skb, &how) {
                runner.same_decision(seed, &frame, &how, &by_memo, &full);
            }
            // The seed's flow remembered again.
            runner.one(fp, seed, &seed.frame, seed.skb, &[]);
        }
    }
    runner.tally
}

/// Runs the seed's packet as it is, then again with every memo retired, and panics unless
/// both runs keep the contract and, if a memo decided the first, the full checks decided the
/// same; whether a memo decided it.
pub fn memo_agrees(fp: &mut FastPath, seed: &Seed, tunnel: Tunnel) -> bool {
    let mut runner = Runner {
        rng_seed: None,
        tunnel,
        tally: Tally::default(),
    };
    let Some(first) = runner.one(fp, seed, &seed.frame, seed.skb, &[]) else {
        return false;
    };
    if !first.counted.iter().any(|(r, _, _)| *r == Reason::MemoHit) {
        return false;
    }
    fp.retire_memos().expect("retiring the memos");
    if let Some(full) = runner.one(fp, seed, &seed.frame, seed.skb, &[]) {
        runner.same_decision(seed, &seed.frame, &[], &first, &full);
    }
    true
}

/// What [`memos_follow_changes`] asks a test to change between two packets of every flow.
#[derive(Clone, Copy, Debug)]
pub enum Change {
    /// Remove, add or move remote subnets (another peer or kind).
    Routes,
    /// Forget the pod's bridge port.
    Ports,
    /// Set another configuration.
    Config,
    /// Have the programs learn a kernel flow (which retires its endpoint's memos only).
    Learn,
}

/// `rounds` rounds of: `prepare` (the state every round starts from), every seed's packet run
/// (its flow remembered), one [`Change`] drawn with `rng_seed` and made by `change`, then
/// [`memo_agrees`] for every seed. Returns how many packets a memo decided after a change: the
/// changes that leave a flow's decision alone must leave its memo too.
pub fn memos_follow_changes(
    fp: &mut FastPath,
    seeds: &[Seed],
    (rounds, rng_seed): (usize, u64),
    tunnel: Tunnel,
    mut prepare: impl FnMut(&mut FastPath),
    mut change: impl FnMut(&mut FastPath, Change, &mut StdRng),
) -> usize {
    let mut rng = StdRng::seed_from_u64(rng_seed);
    let mut decided_by_memo = 0;
    for _ in 0..rounds {
        prepare(fp);
        for seed in seeds {
            if let Program::Tc(hook) = seed.program {
                let _ = try_run(fp, hook, &seed.frame, seed.skb);
            }
        }
        let what = *pick(
            &mut rng,
            &[Change::Routes, Change::Ports, Change::Config, Change::Learn],
        );
        change(fp, what, &mut rng);
        decided_by_memo += seeds
            .iter()
            .filter(|seed| memo_agrees(fp, seed, tunnel))
            .count();
    }
    decided_by_memo
}

/// Runs variants and keeps the tally; knows what a failure must say.
struct Runner {
    /// The random seed of the variants, if they are [`check`]'s.
    rng_seed: Option<u64>,
    tunnel: Tunnel,
    tally: Tally,
}

impl Runner {
    /// Runs `frame` through the seed's program with `skb`, holds the run to the contract and
    /// counts it; the run, or `None` if test_run refused the frame (an IPv4 frame shorter
    /// than an IPv4 header, for one).
    fn one(
        &mut self,
        fp: &mut FastPath,
        seed: &Seed,
        frame: &[u8],
        skb: Skb,
        how: &[String],
    ) -> Option<Run> {
        let r = match seed.program {
            Program::Tc(hook) => try_run(fp, hook, frame, skb),
            Program::Xdp => try_run_xdp(fp, frame),
        };
        let Ok(r) = r else {
            self.tally.refused += 1;
            return None;
        };
        match judge(seed.program, frame, &r, self.tunnel) {
            Ok(verdict) => {
                self.tally.runs += 1;
                for (reason, _, _) in &r.counted {
                    *self.tally.by_reason.entry(*reason).or_default() += 1;
                }
                if !how.is_empty() && verdict.kind() == ReasonKind::Fast {
                    self.tally.fast_mutated += 1;
                }
                Some(r)
            }
            Err(why) => self.fail(&why, seed, frame, how, &r),
        }
    }

    /// Panics unless the full checks' run `full` decided what the memo's `by_memo` did.
    fn same_decision(
        &mut self,
        seed: &Seed,
        frame: &[u8],
        how: &[String],
        by_memo: &Run,
        full: &Run,
    ) {
        let decision = |r: &Run| -> Vec<Reason> {
            r.counted
                .iter()
                .map(|(reason, _, _)| *reason)
                .filter(|reason| reason.kind() != ReasonKind::Event)
                .collect()
        };
        let bytes = |r: &Run| -> Vec<u8> {
            let mut out = r.out.clone();
            let encapsulated = decision(r)
                .iter()
                .any(|reason| matches!(reason, Reason::FastVxlan | Reason::FastIpip));
            if encapsulated && out.len() >= 26 {
                // The outer IPv4 ID (random unless DF is inherited) and so the checksum.
                out[18..20].fill(0);
                out[24..26].fill(0);
            }
            out
        };
        if by_memo.verdict != full.verdict
            || decision(by_memo) != decision(full)
            || bytes(by_memo) != bytes(full)
        {
            self.fail(
                &format!(
                    "the memo decided otherwise than the full checks: {:?} (counted {:?}), \
                     output\n{}",
                    full.verdict,
                    full.counted,
                    packet::hexdump(&full.out)
                ),
                seed,
                frame,
                how,
                by_memo,
            );
        }
        self.tally.memo_compared += 1;
    }

    fn fail(&self, why: &str, seed: &Seed, frame: &[u8], how: &[String], r: &Run) -> ! {
        let drawn = self
            .rng_seed
            .map(|s| format!(" (FLANNEL_MUTATION_SEED={s:#x})"))
            .unwrap_or_default();
        panic!(
            "{why}\nseed {:?} through {:?}, mutated by {how:?}{drawn}; verdict {}, counted \
             {:?}\nin:\n{}out:\n{}",
            seed.name,
            seed.program,
            r.verdict,
            r.counted,
            packet::hexdump(frame),
            packet::hexdump(&r.out),
        )
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|e| panic!("{name}={v}: {e}")))
}

fn pick<'a, T>(rng: &mut StdRng, from: &'a [T]) -> &'a T {
    &from[rng.random_range(0..from.len())]
}

/// Changes `frame` in one random way (never below an Ethernet header, which test_run
/// requires); says how.
fn mutate(rng: &mut StdRng, frame: &mut Vec<u8>) -> String {
    let len = frame.len();
    let within = len.min(HEADERS);
    match rng.random_range(0..6) {
        0 => {
            let (at, bit) = (rng.random_range(0..within), rng.random_range(0..8));
            frame[at] ^= 1 << bit;
            format!("bit {bit} of byte {at} flipped")
        }
        1 => {
            let at = rng.random_range(0..within);
            let edge = [0, 1, 4, 5, 6, 17, 0x40, 0x45, 0x46, 0x4f, 0x60, 0x80, 0xff];
            let v = if rng.random_bool(0.5) {
                *pick(rng, &edge)
            } else {
                rng.random()
            };
            frame[at] = v;
            format!("byte {at} = {v:#04x}")
        }
        2 => {
            let at = *pick(rng, &FIELDS16);
            if at + 2 > len {
                return "nothing (field beyond the end)".to_owned();
            }
            let l = len as u16;
            let edge = [
                0, 1, 8, 20, 28, 0x0800, 0x86dd, 0x0806, 0x8100, 0x88a8, 0x2000, 0xffff,
            ];
            let v = match rng.random_range(0..3) {
                0 => *pick(rng, &edge),
                1 => (l - 14).wrapping_add(*pick(rng, &[0u16, 1, 0xffff, 20, 0xffec])),
                _ => rng.random(),
            };
            frame[at..at + 2].copy_from_slice(&v.to_be_bytes());
            format!("u16 at {at} = {v:#06x}")
        }
        3 if len > 14 => {
            let to = rng.random_range(14..len);
            frame.truncate(to);
            format!("cut to {to} bytes")
        }
        4 => {
            let n = rng.random_range(1..=48);
            frame.extend((0..n).map(|_| rng.random::<u8>()));
            format!("{n} bytes appended")
        }
        _ => {
            let n = 4.min(within);
            let (from, to) = (
                rng.random_range(0..=within - n),
                rng.random_range(0..=within - n),
            );
            frame.copy_within(from..from + n, to);
            format!("{n} bytes copied from {from} to {to}")
        }
    }
}

/// The run's verdict reason if it kept the contract (see the module's documentation).
fn judge(program: Program, input: &[u8], r: &Run, tunnel: Tunnel) -> Result<Reason, String> {
    let mut class = Vec::new();
    let mut verdict = Vec::new();
    for &(reason, packets, bytes) in &r.counted {
        if packets != 1 {
            return Err(format!("{reason:?} counted {packets} times for one run"));
        }
        let list = match reason.kind() {
            ReasonKind::Class | ReasonKind::Malformed => &mut class,
            ReasonKind::Fast | ReasonKind::Pass | ReasonKind::Drop => &mut verdict,
            ReasonKind::Event => continue,
        };
        if bytes != input.len() as u64 {
            return Err(format!(
                "{reason:?} counted {bytes} bytes for a {}-byte frame",
                input.len()
            ));
        }
        list.push(reason);
    }
    let ([class], [verdict]) = (class.as_slice(), verdict.as_slice()) else {
        return Err(format!(
            "not one class ({class:?}) and one verdict ({verdict:?})"
        ));
    };
    let (ok, shot) = match program {
        Program::Tc(_) => (TC_ACT_OK, TC_ACT_SHOT),
        Program::Xdp => (XDP_PASS, XDP_DROP),
    };
    match verdict.kind() {
        ReasonKind::Pass if r.verdict != ok => {
            Err(format!("{verdict:?} (class {class:?}) not passed"))
        }
        ReasonKind::Pass if r.out != input => {
            Err(format!("{verdict:?} (class {class:?}) changed the packet"))
        }
        ReasonKind::Drop if r.verdict != shot => {
            Err(format!("{verdict:?} (class {class:?}) not dropped"))
        }
        ReasonKind::Fast => {
            let sent = match program {
                Program::Tc(_) => [TC_ACT_OK, TC_ACT_REDIRECT].contains(&r.verdict),
                Program::Xdp => r.verdict == XDP_PASS,
            };
            if !sent {
                return Err(format!("{verdict:?}: unexpected action"));
            }
            // The NAT's and path MTU discovery's rewrites change the packet by design.
            let translated = matches!(
                verdict,
                Reason::FastSnat
                    | Reason::FastSnatReply
                    | Reason::FastSnatIcmpError
                    | Reason::FastSnatFragment
                    | Reason::FastIpipFragNeeded
            );
            if !translated
                && let Some(carried) = innermost(input, tunnel)
                && innermost(&r.out, tunnel).as_ref() != Some(&carried)
            {
                return Err(format!(
                    "{verdict:?}: the innermost IP packet did not come out as it went in"
                ));
            }
            for (sums, what) in [(false, "parses"), (true, "has every checksum right")] {
                if sound(input, tunnel, sums) && !sound(&r.out, tunnel, sums) {
                    return Err(format!("{verdict:?}: the input {what}, the output not"));
                }
            }
            Ok(*verdict)
        }
        _ => Ok(*verdict),
    }
}

/// Whether `frame` parses, the frame inside `tunnel` or the packet inside IPIP
/// too, and, with `sums`, every checksum in them verifies (IP headers and L4).
fn sound(frame: &[u8], tunnel: Tunnel, sums: bool) -> bool {
    let Ok(parsed) = packet::parse(frame) else {
        return false;
    };
    if sums && !parsed.checksums_ok() {
        return false;
    }
    let (l4, ipip) = match &parsed.l3 {
        ParsedL3::Ipv4(ip) => (
            &ip.l4,
            ip.proto == IPPROTO_IPIP && !ip.more_fragments && ip.fragment_offset == 0,
        ),
        ParsedL3::Ipv6(ip) => (&ip.l4, false),
        ParsedL3::Arp(_) | ParsedL3::Other(_) => return true,
    };
    match l4 {
        ParsedL4::Udp {
            dst_port, payload, ..
        } if tunnel.port() == *dst_port => tunnel
            .frame_in(payload)
            .is_some_and(|inner| sound(&inner, tunnel, sums)),
        ParsedL4::Raw(inner) if ipip => sound(&with_ethernet(ETH_P_IP, inner), tunnel, sums),
        _ => true,
    }
}

/// The innermost IP packet of `frame` (inside `tunnel` or IPIP, if the outer
/// headers are whole), up to the length its header gives, with the fields a forwarder changes
/// zeroed (TTL and header checksum, hop limit); `None` if there is none.
fn innermost(frame: &[u8], tunnel: Tunnel) -> Option<Vec<u8>> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let l3 = &frame[14..];
    match ethertype {
        ETH_P_IP => {
            let (ihl, total) = (
                usize::from(*l3.first()? & 0xf) * 4,
                usize::from(u16::from_be_bytes([*l3.get(2)?, *l3.get(3)?])),
            );
            if l3.len() < 20 || ihl < 20 || total < ihl || total > l3.len() {
                return None;
            }
            let unfragmented = u16::from_be_bytes([l3[6], l3[7]]) & 0x3fff == 0;
            let l4 = &l3[ihl..total];
            if unfragmented && l3[9] == IPPROTO_IPIP {
                return innermost(&with_ethernet(ETH_P_IP, l4), tunnel);
            }
            if unfragmented
                && l3[9] == 17
                && let Some(inner) = tunnel.frame_in_datagram(l4)
            {
                return innermost(&inner, tunnel);
            }
            let mut packet = l3[..total].to_vec();
            packet[8] = 0;
            packet[10..12].copy_from_slice(&[0, 0]);
            Some(packet)
        }
        ETH_P_IPV6 => {
            let payload = usize::from(u16::from_be_bytes([*l3.get(4)?, *l3.get(5)?]));
            if l3.len() < 40 || 40 + payload > l3.len() {
                return None;
            }
            if l3[6] == 17
                && let Some(inner) = tunnel.frame_in_datagram(&l3[40..40 + payload])
            {
                return innermost(&inner, tunnel);
            }
            let mut packet = l3[..40 + payload].to_vec();
            packet[7] = 0;
            Some(packet)
        }
        _ => None,
    }
}

fn with_ethernet(ethertype: u16, l3: &[u8]) -> Vec<u8> {
    let mut frame = vec![0u8; 12];
    frame.extend_from_slice(&ethertype.to_be_bytes());
    frame.extend_from_slice(l3);
    frame
}

/// Makes every checksum in `frame` right again where its header says enough to compute it
/// (the IPv4 header's, then TCP, UDP with a checksum, ICMP and ICMPv6 over the length the IP
/// header gives), inner packets of `tunnel` and of IPIP first.
fn reseal(frame: &mut [u8], tunnel: Tunnel) {
    if frame.len() < 14 {
        return;
    }
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let l3 = &mut frame[14..];
    match ethertype {
        ETH_P_IP => reseal_ipv4(l3, tunnel),
        ETH_P_IPV6 => reseal_ipv6(l3, tunnel),
        _ => {}
    }
}

fn reseal_ipv4(ip: &mut [u8], tunnel: Tunnel) {
    if ip.len() < 20 || ip[0] >> 4 != 4 {
        return;
    }
    let ihl = usize::from(ip[0] & 0xf) * 4;
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    if ihl < 20 || ihl > ip.len() {
        return;
    }
    let unfragmented = u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff == 0;
    if unfragmented && total >= ihl && total <= ip.len() {
        let (proto, src, dst) = (ip[9], addr4(&ip[12..16]), addr4(&ip[16..20]));
        let l4 = &mut ip[ihl..total];
        if proto == IPPROTO_IPIP {
            reseal_ipv4(l4, tunnel);
        } else {
            let pseudo = pseudo_header_v4(src, dst, proto, l4.len());
            reseal_l4(proto, l4, pseudo, tunnel, true);
        }
    }
    ip[10..12].copy_from_slice(&[0, 0]);
    let sum = checksum(&ip[..ihl]);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
}

fn reseal_ipv6(ip: &mut [u8], tunnel: Tunnel) {
    if ip.len() < 40 || ip[0] >> 4 != 6 {
        return;
    }
    let payload = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    if 40 + payload > ip.len() {
        return;
    }
    let (proto, src, dst) = (ip[6], addr6(&ip[8..24]), addr6(&ip[24..40]));
    let l4 = &mut ip[40..40 + payload];
    let pseudo = pseudo_header_v6(src, dst, proto, l4.len());
    reseal_l4(proto, l4, pseudo, tunnel, false);
}

/// The L4 checksum of `l4` (protocol `proto`, pseudo-header sum `pseudo`); ICMP over IPv4
/// has no pseudo-header, and UDP over IPv4 without a checksum (`v4`, 0) keeps none.
fn reseal_l4(proto: u8, l4: &mut [u8], pseudo: u64, tunnel: Tunnel, v4: bool) {
    let (at, initial) = match proto {
        6 => (16, pseudo),
        17 => {
            if l4.len() >= 8 && u16::from_be_bytes([l4[2], l4[3]]) == tunnel.port() {
                match tunnel {
                    Tunnel::Vxlan(_) if l4.len() >= 16 => reseal(&mut l4[16..], tunnel),
                    Tunnel::Udp(_) => reseal_ipv4(&mut l4[8..], tunnel),
                    Tunnel::Vxlan(_) => {}
                }
            }
            if v4 && l4.len() >= 8 && l4[6..8] == [0, 0] {
                return;
            }
            (6, pseudo)
        }
        1 if v4 => (2, 0),
        58 if !v4 => (2, pseudo),
        _ => return,
    };
    if l4.len() < at + 2 {
        return;
    }
    l4[at..at + 2].copy_from_slice(&[0, 0]);
    let mut sum = !fold(sum_words(l4, initial));
    if proto == 17 && sum == 0 {
        sum = 0xffff;
    }
    l4[at..at + 2].copy_from_slice(&sum.to_be_bytes());
}

fn addr4(b: &[u8]) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(b[0], b[1], b[2], b[3])
}

fn addr6(b: &[u8]) -> std::net::Ipv6Addr {
    let octets: [u8; 16] = b.try_into().expect("16 bytes");
    octets.into()
}
