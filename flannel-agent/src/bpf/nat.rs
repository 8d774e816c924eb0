//! Masquerade in eBPF, agent side: the settings ([`NatSettings`]), the size of the NAT maps
//! ([`nat_map_size`], by default from node memory), writing the configuration and the
//! no-masquerade prefixes ([`FastPath::set_nat`]), reading the flows back
//! ([`FastPath::nat_flows`]) and sweeping expired entries ([`FastPath::nat_sweep`]).
//!
//! The datapath and its design are described in `flannel_ebpf::nat`; the map layouts in
//! `flannel_common::nat`. `bpftool map dump pinned <pin path>/v1/FLANNEL_NAT4` prints the
//! flows as typed JSON (addresses as byte lists, ports as numbers).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt, fs,
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
    time::Duration,
};

use aya::maps::{Array, HashMap as BpfHashMap, LpmTrie, MapData, lpm_trie::Key};
use flannel_common::{
    maps as names,
    nat::{
        NAT_CFG_ENABLED, NAT_CFG_HANDOVER, NAT_F_HOST, NAT_MAX_PROBES, NS_PER_S, NatConfig,
        NatEntry, NatKey, NatRevEntry, ST_FIN_IN, ST_FIN_OUT, ST_REPLIED, ST_RST, proto,
        tcp_closed,
    },
};
use ipnet::Ipv4Net;

use super::{
    BpfError, FastPath, PinLayout,
    batch::BPF_ANY,
    config::kernel_source_ports,
    pins::{MAP_SPECS, remove_pin},
};

/// Idle timeouts of masqueraded flows, per state (conntrack's defaults where it has one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NatTimeouts {
    /// TCP before the first reply (conntrack `tcp_timeout_syn_sent`: 120 s).
    pub tcp_syn: Duration,
    /// TCP established (conntrack `tcp_timeout_established`: 5 days).
    pub tcp_established: Duration,
    /// TCP after a FIN in one direction (conntrack `fin_wait`: 120 s).
    pub tcp_half_closed: Duration,
    /// TCP after FINs both ways or a RST: late retransmissions still translate (10 s, as
    /// Cilium; conntrack's 120 s `time_wait` would keep the port from new flows).
    pub tcp_closed: Duration,
    /// UDP before a reply (conntrack `udp_timeout`: 30 s).
    pub udp: Duration,
    /// UDP after a reply (conntrack `udp_timeout_stream`: 120 s).
    pub udp_stream: Duration,
    /// ICMP echo (conntrack `icmp_timeout`: 30 s).
    pub icmp: Duration,
}

impl Default for NatTimeouts {
    fn default() -> Self {
        NatTimeouts {
            tcp_syn: Duration::from_secs(120),
            tcp_established: Duration::from_secs(5 * 24 * 3600),
            tcp_half_closed: Duration::from_secs(120),
            tcp_closed: Duration::from_secs(10),
            udp: Duration::from_secs(30),
            udp_stream: Duration::from_secs(120),
            icmp: Duration::from_secs(30),
        }
    }
}

/// How the programs masquerade.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatSettings {
    /// The address pod traffic leaves with: the external interface's address.
    pub nat_addr: Ipv4Addr,
    /// The ports (inclusive) the allocator hands out; the node's `ip_local_port_range` by
    /// default (see `flannel_ebpf::nat` for why that range and how node flows are kept apart).
    pub ports: (u16, u16),
    /// Alternatives probed when a flow's original port is taken (at most 32).
    pub probes: u32,
    /// Idle timeouts.
    pub timeouts: NatTimeouts,
    /// Destinations never masqueraded (`--ip-masq-exclude-cidrs`).
    pub no_masq: Vec<Ipv4Net>,
}

impl NatSettings {
    /// Masquerade to `nat_addr` with the defaults: the calling thread's namespace's
    /// `ip_local_port_range` (32768-60999 if unreadable), 32 probes, conntrack-like timeouts,
    /// no exclusions.
    pub fn new(nat_addr: Ipv4Addr) -> Self {
        NatSettings {
            nat_addr,
            ports: default_port_range(),
            probes: NAT_MAX_PROBES,
            timeouts: NatTimeouts::default(),
            no_masq: Vec::new(),
        }
    }

    /// The map entry, after checking every value fits.
    pub fn to_entry(&self) -> Result<NatConfig, BpfError> {
        let (min, max) = self.ports;
        if min == 0 || max < min {
            return Err(BpfError::Invalid {
                field: "NAT port range",
                value: format!("{min}-{max}"),
                reason: "need 1 <= min <= max",
            });
        }
        if self.nat_addr.is_unspecified() {
            return Err(BpfError::Invalid {
                field: "masquerade address",
                value: self.nat_addr.to_string(),
                reason: "the external interface has no IPv4 address",
            });
        }
        if self.probes > NAT_MAX_PROBES {
            return Err(BpfError::Invalid {
                field: "NAT probes",
                value: self.probes.to_string(),
                reason: "at most 32 (the programs' loop bound)",
            });
        }
        let secs = |d: Duration| u32::try_from(d.as_secs().max(1)).unwrap_or(u32::MAX);
        let t = &self.timeouts;
        Ok(NatConfig {
            flags: NAT_CFG_ENABLED,
            nat_addr: self.nat_addr.octets(),
            port_min: min,
            port_max: max,
            probes: self.probes,
            no_masq_entries: u32::try_from(self.no_masq.len()).unwrap_or(u32::MAX),
            tcp_syn_s: secs(t.tcp_syn),
            tcp_established_s: secs(t.tcp_established),
            tcp_half_closed_s: secs(t.tcp_half_closed),
            tcp_closed_s: secs(t.tcp_closed),
            udp_s: secs(t.udp),
            udp_stream_s: secs(t.udp_stream),
            icmp_s: secs(t.icmp),
        })
    }
}

/// The default port range: the calling thread's namespace's `ip_local_port_range`, inclusive.
pub fn default_port_range() -> (u16, u16) {
    // kernel_source_ports gives [low, high] as the sysctl holds them.
    kernel_source_ports().unwrap_or((32768, 60999))
}

/// Parses `--ebpf-nat-port-range`: `MIN-MAX` (inclusive, 1..=65535, MIN <= MAX).
pub fn parse_port_range(s: &str) -> Result<(u16, u16), String> {
    let err = || format!("{s:?} is not a port range MIN-MAX (e.g. 32768-60999)");
    let (a, b) = s.trim().split_once('-').ok_or_else(err)?;
    let min: u16 = a.trim().parse().map_err(|_| err())?;
    let max: u16 = b.trim().parse().map_err(|_| err())?;
    if min == 0 || max < min {
        return Err(format!("{s:?}: need 1 <= MIN <= MAX"));
    }
    Ok((min, max))
}

/// Share of node memory the NAT maps take by default (Cilium's `bpf-map-dynamic-size-ratio`
/// default on managed offerings).
pub const NAT_MEMORY_RATIO: f64 = 0.0025;
/// Fewest flows the maps hold by default, whatever the node's memory.
pub const NAT_MIN_ENTRIES: u32 = 65_536;
/// Most flows the maps hold by default.
pub const NAT_MAX_DEFAULT_ENTRIES: u32 = 2 * 1024 * 1024;
/// Kernel memory one flow takes in the two preallocated LRU maps (element headers with their
/// LRU node, key and value rounded to 8 bytes, both directions, and the bucket pointers).
pub const NAT_BYTES_PER_FLOW: u64 = 192;

/// The default number of flows the NAT maps hold on a node with `total_memory` bytes:
/// [`NAT_MEMORY_RATIO`] of it at [`NAT_BYTES_PER_FLOW`], within
/// [`NAT_MIN_ENTRIES`]..=[`NAT_MAX_DEFAULT_ENTRIES`].
pub fn nat_map_size(total_memory: u64) -> u32 {
    let budget = (total_memory as f64 * NAT_MEMORY_RATIO) as u64;
    let flows = budget / NAT_BYTES_PER_FLOW;
    u32::try_from(flows)
        .unwrap_or(u32::MAX)
        .clamp(NAT_MIN_ENTRIES, NAT_MAX_DEFAULT_ENTRIES)
}

/// `MemTotal` from /proc/meminfo, in bytes.
pub fn node_memory() -> Option<u64> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo_total(&text)
}

fn parse_meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// How the NAT maps are sized and why, for the start-up log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NatSizing {
    /// Flows each NAT map holds.
    pub entries: u32,
    /// The node memory it was derived from, when not given explicitly.
    pub from_memory: Option<u64>,
}

impl NatSizing {
    /// `--ebpf-nat-max-entries`: `0` sizes from node memory.
    pub fn resolve(flag: u32) -> NatSizing {
        if flag > 0 {
            return NatSizing {
                entries: flag,
                from_memory: None,
            };
        }
        match node_memory() {
            Some(mem) => NatSizing {
                entries: nat_map_size(mem),
                from_memory: Some(mem),
            },
            None => NatSizing {
                entries: NAT_MIN_ENTRIES,
                from_memory: None,
            },
        }
    }

    /// Approximate kernel memory of the two maps.
    pub fn bytes(&self) -> u64 {
        u64::from(self.entries) * NAT_BYTES_PER_FLOW
    }
}

impl fmt::Display for NatSizing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} flows (~{} MiB of kernel memory)",
            self.entries,
            self.bytes() / (1024 * 1024)
        )?;
        match self.from_memory {
            Some(mem) => write!(
                f,
                ", {:.2} % of {} MiB node memory",
                NAT_MEMORY_RATIO * 100.0,
                mem / (1024 * 1024)
            ),
            None => write!(f, ", set by --ebpf-nat-max-entries"),
        }
    }
}

/// A masqueraded flow as the maps hold it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatFlow {
    /// IP protocol (1, 6, 17).
    pub proto: u8,
    /// The original source (a pod, or the node for its own flows); the port is the echo
    /// identifier for ICMP.
    pub orig: SocketAddrV4,
    /// The destination.
    pub remote: SocketAddrV4,
    /// The source on the wire.
    pub nat: SocketAddrV4,
    /// `ST_*` bits.
    pub state: u8,
    /// A node flow (registered, not a pod's).
    pub host: bool,
    /// Time since the mapping was made.
    pub age: Duration,
    /// Time since a packet of the flow was last seen.
    pub idle: Duration,
    /// Past its timeout (the programs treat it as gone; the next sweep deletes it).
    pub expired: bool,
    /// The reply entry points back at this flow.
    pub reverse_ok: bool,
}

impl NatFlow {
    /// The flow's key in the reply map (`FLANNEL_NATREV4`).
    pub fn reply_key(&self) -> NatKey {
        NatKey::new(
            self.remote.ip().octets(),
            self.nat.ip().octets(),
            self.remote.port(),
            self.nat.port(),
            self.proto,
        )
    }

    /// The flow's key in the outgoing map (`FLANNEL_NAT4`).
    pub fn key(&self) -> NatKey {
        self.reply_key()
            .original_of(self.orig.ip().octets(), self.orig.port())
    }
}

/// The name of a flow state, conntrack-style.
pub fn state_name(proto_: u8, state: u8) -> &'static str {
    match proto_ {
        proto::TCP if tcp_closed(state) => {
            if state & ST_RST != 0 {
                "reset"
            } else {
                "closed"
            }
        }
        proto::TCP if state & ST_FIN_OUT != 0 => "fin-out",
        proto::TCP if state & ST_FIN_IN != 0 => "fin-in",
        _ if state & ST_REPLIED != 0 => "established",
        proto::TCP => "syn-sent",
        _ => "unreplied",
    }
}

/// A protocol's name.
pub fn proto_name(proto_: u8) -> &'static str {
    match proto_ {
        proto::TCP => "tcp",
        proto::UDP => "udp",
        proto::ICMP => "icmp",
        _ => "?",
    }
}

impl fmt::Display for NatFlow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} -> {} as {} {}{} age {}s idle {}s{}",
            proto_name(self.proto),
            self.orig,
            self.remote,
            self.nat,
            state_name(self.proto, self.state),
            if self.host { " (node)" } else { "" },
            self.age.as_secs(),
            self.idle.as_secs(),
            if self.expired { " expired" } else { "" },
        )
    }
}

/// What a sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepStats {
    /// Live flows left.
    pub flows: usize,
    /// Expired flows deleted.
    pub expired: usize,
    /// Reply entries deleted because their flow was gone or points elsewhere.
    pub orphans: usize,
}

/// The live flows that need the programs' translation to go on: pod flows, and node flows
/// the programs moved to another port. While any is left, a switch to iptables/nftables
/// masquerade hands over (see [`FastPath::begin_nat_handover`]) instead of turning the NAT
/// off.
pub fn handover_pending(flows: &[NatFlow]) -> usize {
    flows
        .iter()
        .filter(|f| !f.expired && (!f.host || f.nat.port() != f.orig.port()))
        .count()
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_coarse_ns` (which lags it by
/// a timer tick at most).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to the pointer it is given.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * NS_PER_S + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// Every flow of the NAT maps `fwd` and `rev`, oldest first (then by address), decoded
/// (expired ones, by `cfg`'s timeouts, included and marked).
fn decode_flows<T: std::borrow::Borrow<MapData>>(
    cfg: &NatConfig,
    fwd: &BpfHashMap<T, NatKey, NatEntry>,
    rev: &BpfHashMap<T, NatKey, NatRevEntry>,
) -> Result<Vec<NatFlow>, BpfError> {
    let now = monotonic_ns();
    let mut flows = Vec::new();
    for item in fwd.iter() {
        let (key, e) = match item {
            Ok(kv) => kv,
            // The entry went away between the key walk and the lookup.
            Err(aya::maps::MapError::KeyNotFound) => continue,
            Err(e) => return Err(BpfError::map(names::NAT4, e)),
        };
        let reverse_ok = rev
            .get(&key.reply_of(e.nat_addr, e.nat_port), 0)
            .is_ok_and(|r| r.orig_addr == key.saddr && r.orig_port == key.sport);
        let (remote_port, orig_port) = if key.proto == proto::ICMP {
            (0, key.sport)
        } else {
            (key.dport, key.sport)
        };
        flows.push(NatFlow {
            proto: key.proto,
            orig: SocketAddrV4::new(key.saddr.into(), orig_port),
            remote: SocketAddrV4::new(key.daddr.into(), remote_port),
            nat: SocketAddrV4::new(e.nat_addr.into(), e.nat_port),
            state: e.state,
            host: e.flags & NAT_F_HOST != 0,
            age: Duration::from_nanos(now.saturating_sub(e.created_ns)),
            idle: Duration::from_nanos(now.saturating_sub(e.last_seen_ns)),
            expired: cfg.expired(key.proto, e.state, e.last_seen_ns, now),
            reverse_ok,
        });
    }
    sort_flows(&mut flows);
    Ok(flows)
}

/// Oldest first. The programs stamp flows with the coarse clock (one tick is several ms), so
/// flows made together tie on age: the addresses decide between them.
fn sort_flows(flows: &mut [NatFlow]) {
    flows.sort_by(|a, b| {
        b.age
            .cmp(&a.age)
            .then(a.orig.cmp(&b.orig))
            .then(a.remote.cmp(&b.remote))
            .then(a.proto.cmp(&b.proto))
    });
}

/// [`FastPath::nat_flows`] of the NAT maps pinned under `layout`, as a former run left them
/// (no loaded fast path needed); `None` when they are not there. With the old instances of
/// a resize still pinned aside (the new programs were not attached yet, and the old ones
/// still make and update flows in them; or the load failed after moving them aside), the
/// flows of both, the more recently seen copy of each.
pub fn pinned_nat_flows(layout: &PinLayout) -> Result<Option<Vec<NatFlow>>, BpfError> {
    let Some(cfg) = open_pinned(&layout.map(names::NAT_CONFIG), names::NAT_CONFIG)? else {
        return Ok(None);
    };
    let cfg = Array::<MapData, NatConfig>::try_from(aya::maps::Map::Array(cfg))
        .and_then(|a| a.get(&0, 0))
        .map_err(|e| BpfError::map(names::NAT_CONFIG, e))?;
    let current = flows_pinned(&cfg, &layout.map(names::NAT4), &layout.map(names::NAT_REV4))?;
    let aside = flows_pinned(
        &cfg,
        &layout.resizing(names::NAT4),
        &layout.resizing(names::NAT_REV4),
    )?;
    Ok(match (current, aside) {
        (Some(current), Some(aside)) => Some(merge_flows(current, aside)),
        (current, aside) => current.or(aside),
    })
}

/// The flows of the NAT maps pinned at `fwd` and `rev`; `None` when either is not there.
fn flows_pinned(cfg: &NatConfig, fwd: &Path, rev: &Path) -> Result<Option<Vec<NatFlow>>, BpfError> {
    let (Some(fwd), Some(rev)) = (
        open_pinned(fwd, names::NAT4)?,
        open_pinned(rev, names::NAT_REV4)?,
    ) else {
        return Ok(None);
    };
    let fwd = BpfHashMap::try_from(aya::maps::Map::LruHashMap(fwd))
        .map_err(|e| BpfError::map(names::NAT4, e))?;
    let rev = BpfHashMap::try_from(aya::maps::Map::LruHashMap(rev))
        .map_err(|e| BpfError::map(names::NAT_REV4, e))?;
    decode_flows(cfg, &fwd, &rev).map(Some)
}

/// The map pinned at `path`; `None` when nothing is pinned there.
fn open_pinned(path: &Path, name: &'static str) -> Result<Option<MapData>, BpfError> {
    match MapData::from_pin(path) {
        Ok(data) => Ok(Some(data)),
        Err(_) if !path.exists() => Ok(None),
        Err(e) => Err(BpfError::map(name, e)),
    }
}

/// The flows of `a` and `b`, a flow in both once, as the copy seen more recently; in the
/// order of [`decode_flows`].
fn merge_flows(a: Vec<NatFlow>, b: Vec<NatFlow>) -> Vec<NatFlow> {
    let mut by_flow: BTreeMap<(u8, SocketAddrV4, SocketAddrV4), NatFlow> = BTreeMap::new();
    for flow in a.into_iter().chain(b) {
        match by_flow.entry((flow.proto, flow.orig, flow.remote)) {
            std::collections::btree_map::Entry::Occupied(mut seen) => {
                if flow.idle < seen.get().idle {
                    seen.insert(flow);
                }
            }
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert(flow);
            }
        }
    }
    let mut flows: Vec<NatFlow> = by_flow.into_values().collect();
    sort_flows(&mut flows);
    flows
}

/// Reply entries made or found live more recently than this are never orphans: the program
/// writes the reply entry first and the flow's entry right after.
const ORPHAN_GRACE_NS: u64 = 5 * NS_PER_S;

/// The NAT maps (of `sizes`) whose flows must be carried into maps of a new size: an old
/// instance a resize left under [`PinLayout::resizing_dir`] (its agent died before the copy
/// was done), else a pinned map whose size differs from the one asked for but which is
/// otherwise compatible, moved there first (a rename within bpffs) so that the loader
/// creates a map of the new size in its place. Each stays pinned there until
/// [`end_resize`], after the new programs are attached: a crash before leaves it for the
/// next start.
pub(super) fn take_resized(
    layout: &PinLayout,
    sizes: &[(&'static str, u32)],
) -> Result<Vec<(&'static str, MapData)>, BpfError> {
    let mut out = Vec::new();
    for spec in MAP_SPECS.iter() {
        let Some((_, size)) = sizes.iter().find(|(name, _)| *name == spec.name) else {
            continue;
        };
        let aside = layout.resizing(spec.name);
        match aya::maps::MapInfo::from_pin(&aside) {
            Ok(info) if spec.matches_but_size(&info) => {
                let data = MapData::from_pin(&aside).map_err(|e| BpfError::map(spec.name, e))?;
                tracing::info!(
                    map = spec.name,
                    "finishing a NAT map resize an earlier run did not complete"
                );
                out.push((spec.name, data));
                continue;
            }
            Ok(_) => remove_pin(&aside)?,
            Err(_) => {}
        }
        let path = layout.map(spec.name);
        let Ok(info) = aya::maps::MapInfo::from_pin(&path) else {
            continue;
        };
        if !spec.matches_but_size(&info) || info.max_entries() == *size {
            continue;
        }
        let dir = layout.resizing_dir();
        fs::create_dir_all(&dir).map_err(|e| BpfError::io("creating", &dir, e))?;
        fs::rename(&path, &aside).map_err(|e| BpfError::io("moving aside", &path, e))?;
        let data = MapData::from_pin(&aside).map_err(|e| BpfError::map(spec.name, e))?;
        out.push((spec.name, data));
    }
    Ok(out)
}

/// Which entries of a resized NAT map's old instance [`carry_over`] writes into the new one.
/// While the new programs are not attached, the old ones are the only writers, so the old
/// instance holds the newest copy of every entry; an entry the programs make or change is
/// stamped with the time (`CLOCK_MONOTONIC`, ns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Carry {
    /// Every one (at load time).
    All,
    /// Those stamped at or after this time (right before the attach: what the old programs
    /// did since the last carry).
    Since(u64),
    /// Those stamped at or after this time, where the new instance lacks them or holds an
    /// older copy ([`Stamped::newer`]): right after the attach, when the new programs write
    /// too.
    SinceIfNewer(u64),
}

impl Carry {
    /// Whether `old`, an entry of the old instance, is to be written over `current`, the new
    /// instance's copy (if it has one).
    fn wants<V: Stamped>(self, old: &V, current: impl FnOnce() -> Option<V>) -> bool {
        match self {
            Carry::All => true,
            Carry::Since(since) => old.stamp() >= since,
            Carry::SinceIfNewer(since) => {
                old.stamp() >= since && current().is_none_or(|current| old.newer(&current))
            }
        }
    }
}

/// Carries the entries of a resized NAT map's old instance `old` into the new one, as `how`
/// says; returns how many were written (an LRU map of a smaller size keeps the last ones).
/// Run at load time, right before the new programs are attached and right after (see
/// [`Carry`]): the old programs, attached until then, make and update flows in the old
/// instance meanwhile. The old instance stays pinned ([`end_resize`]).
pub(super) fn carry_over(
    ebpf: &aya::Ebpf,
    name: &'static str,
    old: &aya::maps::Map,
    how: Carry,
) -> Result<usize, BpfError> {
    let new = ebpf.map(name).ok_or_else(|| missing(name))?;
    if name == names::NAT4 {
        carry::<NatEntry>(old, new, how)
    } else {
        carry::<NatRevEntry>(old, new, how)
    }
    .map_err(|e| BpfError::map(name, e))
}

/// Unpins the old instance of the resized NAT map `name`, once its entries are carried over.
pub(super) fn end_resize(layout: &PinLayout, name: &'static str) -> Result<(), BpfError> {
    remove_pin(&layout.resizing(name))
}

/// A NAT map value the programs stamp when they update it.
trait Stamped: aya::Pod {
    /// When the programs last updated it.
    fn stamp(&self) -> u64;
    /// Its `ST_*` bits.
    fn state(&self) -> u8;
    /// Whether this copy of an entry is more recent than `than`: stamped later, or at the
    /// same time (the programs stamp at most about once a second) with state bits `than`
    /// lacks (the bits only accumulate within a flow).
    fn newer(&self, than: &Self) -> bool {
        self.stamp() > than.stamp()
            || (self.stamp() == than.stamp() && self.state() & !than.state() != 0)
    }
}

impl Stamped for NatEntry {
    fn stamp(&self) -> u64 {
        self.last_seen_ns
    }
    fn state(&self) -> u8 {
        self.state
    }
}

impl Stamped for NatRevEntry {
    fn stamp(&self) -> u64 {
        self.checked_ns
    }
    fn state(&self) -> u8 {
        self.state
    }
}

/// [`carry_over`] of one map: batch reads of `old` and batch writes (`BPF_ANY`) into `new`,
/// one batch at a time (a few syscalls for thousands of flows: the carry right after the
/// attach is raced by replies the new programs see). Every kernel the fast path loads on
/// (>= 5.15) has batch operations for hash maps.
fn carry<V: Stamped>(
    old: &aya::maps::Map,
    new: &aya::maps::Map,
    how: Carry,
) -> Result<usize, aya::maps::MapError> {
    let (old_data, new_data) = (
        super::batch::batch_data(old)?,
        super::batch::batch_data(new)?,
    );
    let current: BpfHashMap<&MapData, NatKey, V> = BpfHashMap::try_from(new)?;
    let mut carried = 0;
    super::batch::for_each_batch::<NatKey, V>(old_data, |entries| {
        let (keys, values): (Vec<NatKey>, Vec<V>) = entries
            .into_iter()
            .filter(|(key, value)| how.wants(value, || current.get(key, 0).ok()))
            .unzip();
        if keys.is_empty() {
            return Ok(());
        }
        super::batch::update(new_data, &keys, &values, BPF_ANY)?;
        carried += keys.len();
        Ok(())
    })?;
    Ok(carried)
}

/// Both NAT maps, read-only: the flows and their reply entries.
type NatMaps<'a> = (
    BpfHashMap<&'a MapData, NatKey, NatEntry>,
    BpfHashMap<&'a MapData, NatKey, NatRevEntry>,
);

fn missing(name: &'static str) -> BpfError {
    BpfError::BadMap {
        name,
        reason: "not in the eBPF object".into(),
    }
}

fn lpm_key(net: &Ipv4Net) -> Key<[u8; 4]> {
    Key::new(u32::from(net.prefix_len()), net.network().octets())
}

impl FastPath {
    /// Turns masquerade in eBPF on with `settings`, or off with `None`, and makes the
    /// no-masquerade map hold exactly `settings.no_masq`. Validated first; the prefixes are
    /// written before the configuration, so the programs never see a count without entries.
    pub fn set_nat(&mut self, settings: Option<&NatSettings>) -> Result<(), BpfError> {
        let entry = match settings {
            Some(s) => s.to_entry()?,
            None => NatConfig::default(),
        };
        let want: BTreeSet<Ipv4Net> = settings
            .map(|s| s.no_masq.iter().map(Ipv4Net::trunc).collect())
            .unwrap_or_default();
        if want.len() > names::NO_MASQ4_MAX_ENTRIES as usize {
            return Err(BpfError::Invalid {
                field: "no-masquerade prefixes",
                value: want.len().to_string(),
                reason: "more than the map holds (1024)",
            });
        }
        {
            let map = self
                .ebpf_mut()
                .map_mut(names::NO_MASQ4)
                .ok_or_else(|| missing(names::NO_MASQ4))?;
            let mut trie: LpmTrie<&mut MapData, [u8; 4], u32> =
                LpmTrie::try_from(map).map_err(|e| BpfError::map(names::NO_MASQ4, e))?;
            let mut have = Vec::new();
            for key in trie.keys() {
                have.push(key.map_err(|e| BpfError::map(names::NO_MASQ4, e))?);
            }
            for key in &have {
                let net = u8::try_from(key.prefix_len())
                    .ok()
                    .and_then(|len| Ipv4Net::new(Ipv4Addr::from(key.data()), len).ok());
                if !net.is_some_and(|n| want.contains(&n)) {
                    let _ = trie.remove(key);
                }
            }
            for net in &want {
                trie.insert(&lpm_key(net), 1, 0)
                    .map_err(|e| BpfError::map(names::NO_MASQ4, e))?;
            }
        }
        let map = self
            .ebpf_mut()
            .map_mut(names::NAT_CONFIG)
            .ok_or_else(|| missing(names::NAT_CONFIG))?;
        let mut array: Array<&mut MapData, NatConfig> =
            Array::try_from(map).map_err(|e| BpfError::map(names::NAT_CONFIG, e))?;
        array
            .set(0, entry, 0)
            .map_err(|e| BpfError::map(names::NAT_CONFIG, e))
    }

    /// Hands masquerade over to the kernel: the programs keep translating the flows they
    /// hold but map no new pod flow ([`NAT_CFG_HANDOVER`]). Returns whether the NAT was on
    /// (nothing changes otherwise).
    pub fn begin_nat_handover(&mut self) -> Result<bool, BpfError> {
        let mut cfg = self.nat_config()?;
        if !cfg.enabled() {
            return Ok(false);
        }
        if cfg.handover() {
            return Ok(true);
        }
        cfg.flags |= NAT_CFG_HANDOVER;
        let map = self
            .ebpf_mut()
            .map_mut(names::NAT_CONFIG)
            .ok_or_else(|| missing(names::NAT_CONFIG))?;
        let mut array: Array<&mut MapData, NatConfig> =
            Array::try_from(map).map_err(|e| BpfError::map(names::NAT_CONFIG, e))?;
        array
            .set(0, cfg, 0)
            .map_err(|e| BpfError::map(names::NAT_CONFIG, e))?;
        Ok(true)
    }

    /// The masquerade configuration as the programs see it.
    pub fn nat_config(&self) -> Result<NatConfig, BpfError> {
        let map = self
            .ebpf()
            .map(names::NAT_CONFIG)
            .ok_or_else(|| missing(names::NAT_CONFIG))?;
        let array: Array<&MapData, NatConfig> =
            Array::try_from(map).map_err(|e| BpfError::map(names::NAT_CONFIG, e))?;
        array
            .get(&0, 0)
            .map_err(|e| BpfError::map(names::NAT_CONFIG, e))
    }

    /// The no-masquerade prefixes the map holds.
    pub fn no_masq(&self) -> Result<Vec<Ipv4Net>, BpfError> {
        let map = self
            .ebpf()
            .map(names::NO_MASQ4)
            .ok_or_else(|| missing(names::NO_MASQ4))?;
        let trie: LpmTrie<&MapData, [u8; 4], u32> =
            LpmTrie::try_from(map).map_err(|e| BpfError::map(names::NO_MASQ4, e))?;
        let mut out = Vec::new();
        for key in trie.keys() {
            let key = key.map_err(|e| BpfError::map(names::NO_MASQ4, e))?;
            if let Some(net) = u8::try_from(key.prefix_len())
                .ok()
                .and_then(|len| Ipv4Net::new(Ipv4Addr::from(key.data()), len).ok())
            {
                out.push(net);
            }
        }
        out.sort();
        Ok(out)
    }

    /// The number of flows the NAT maps hold at most (their `max_entries`).
    pub fn nat_capacity(&self) -> Result<u32, BpfError> {
        self.capacity(names::NAT4)
    }

    fn nat_maps(&self) -> Result<NatMaps<'_>, BpfError> {
        let fwd = self
            .ebpf()
            .map(names::NAT4)
            .ok_or_else(|| missing(names::NAT4))?;
        let rev = self
            .ebpf()
            .map(names::NAT_REV4)
            .ok_or_else(|| missing(names::NAT_REV4))?;
        Ok((
            BpfHashMap::try_from(fwd).map_err(|e| BpfError::map(names::NAT4, e))?,
            BpfHashMap::try_from(rev).map_err(|e| BpfError::map(names::NAT_REV4, e))?,
        ))
    }

    /// Every flow the maps hold, oldest first (then by address), decoded (expired ones
    /// included and marked).
    pub fn nat_flows(&self) -> Result<Vec<NatFlow>, BpfError> {
        let (fwd, rev) = self.nat_maps()?;
        decode_flows(&self.nat_config()?, &fwd, &rev)
    }

    /// Deletes expired flows (both entries) and reply entries whose flow is gone or points
    /// elsewhere. Racing packets are harmless: the programs treat expired entries as absent
    /// and re-create a missing reply entry of a live flow.
    pub fn nat_sweep(&mut self) -> Result<SweepStats, BpfError> {
        let cfg = self.nat_config()?;
        let now = monotonic_ns();
        let mut stats = SweepStats::default();
        let mut expired: Vec<(NatKey, NatKey)> = Vec::new();
        let mut live: BTreeMap<NatKey, NatEntry> = BTreeMap::new();
        let mut orphans: Vec<NatKey> = Vec::new();
        {
            let (fwd, rev) = self.nat_maps()?;
            for item in fwd.iter() {
                let (key, e) = match item {
                    Ok(kv) => kv,
                    Err(aya::maps::MapError::KeyNotFound) => continue,
                    Err(e) => return Err(BpfError::map(names::NAT4, e)),
                };
                if cfg.expired(key.proto, e.state, e.last_seen_ns, now) {
                    expired.push((key, key.reply_of(e.nat_addr, e.nat_port)));
                } else {
                    live.insert(key, e);
                }
            }
            for item in rev.iter() {
                let (rkey, r) = match item {
                    Ok(kv) => kv,
                    Err(aya::maps::MapError::KeyNotFound) => continue,
                    Err(e) => return Err(BpfError::map(names::NAT_REV4, e)),
                };
                if now.saturating_sub(r.checked_ns) < ORPHAN_GRACE_NS {
                    continue;
                }
                let owner = rkey.original_of(r.orig_addr, r.orig_port);
                let held = live
                    .get(&owner)
                    .is_some_and(|e| e.nat_addr == rkey.daddr && e.nat_port == rkey.dport);
                if !held {
                    orphans.push(rkey);
                }
            }
        }
        stats.flows = live.len();
        let (mut fwd, mut rev) = self.nat_maps_mut()?;
        for (key, rkey) in &expired {
            // Re-check: a packet may have revived the flow since the walk.
            if let Ok(e) = fwd.get(key, 0)
                && !cfg.expired(key.proto, e.state, e.last_seen_ns, monotonic_ns())
            {
                continue;
            }
            if remove_flow(&mut fwd, &mut rev, key, rkey) {
                stats.expired += 1;
            }
        }
        for rkey in &orphans {
            if rev.remove(rkey).is_ok() {
                stats.orphans += 1;
            }
        }
        Ok(stats)
    }

    /// Removes `flows` from the maps (both entries of each): the programs no longer translate
    /// them. Returns how many were there.
    pub fn nat_forget(&mut self, flows: &[NatFlow]) -> Result<usize, BpfError> {
        let (mut fwd, mut rev) = self.nat_maps_mut()?;
        Ok(flows
            .iter()
            .filter(|f| remove_flow(&mut fwd, &mut rev, &f.key(), &f.reply_key()))
            .count())
    }

    /// The outgoing and reply maps, writable.
    fn nat_maps_mut(&mut self) -> Result<NatMapsMut<'_>, BpfError> {
        let mut fwd_map = None;
        let mut rev_map = None;
        for (name, map) in self.ebpf_mut().maps_mut() {
            if name == names::NAT4 {
                fwd_map = Some(map);
            } else if name == names::NAT_REV4 {
                rev_map = Some(map);
            }
        }
        let fwd_map = fwd_map.ok_or_else(|| missing(names::NAT4))?;
        let rev_map = rev_map.ok_or_else(|| missing(names::NAT_REV4))?;
        Ok((
            BpfHashMap::try_from(fwd_map).map_err(|e| BpfError::map(names::NAT4, e))?,
            BpfHashMap::try_from(rev_map).map_err(|e| BpfError::map(names::NAT_REV4, e))?,
        ))
    }
}

type NatMapsMut<'a> = (
    BpfHashMap<&'a mut MapData, NatKey, NatEntry>,
    BpfHashMap<&'a mut MapData, NatKey, NatRevEntry>,
);

/// Removes the flow `key` and its reply entry `rkey` if that still points back at it (the
/// port may have been claimed by another flow since); whether the flow's entry was there.
fn remove_flow(
    fwd: &mut BpfHashMap<&mut MapData, NatKey, NatEntry>,
    rev: &mut BpfHashMap<&mut MapData, NatKey, NatRevEntry>,
    key: &NatKey,
    rkey: &NatKey,
) -> bool {
    let removed = fwd.remove(key).is_ok();
    if rev
        .get(rkey, 0)
        .is_ok_and(|r| r.orig_addr == key.saddr && r.orig_port == key.sport)
    {
        let _ = rev.remove(rkey);
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_convert_and_validate() {
        let mut s = NatSettings::new(Ipv4Addr::new(192, 168, 1, 11));
        s.ports = (32768, 60999);
        s.no_masq = vec!["100.64.0.0/10".parse().expect("net")];
        let e = s.to_entry().expect("valid");
        assert_eq!(e.flags, NAT_CFG_ENABLED);
        assert_eq!(e.nat_addr, [192, 168, 1, 11]);
        assert_eq!((e.port_min, e.port_max, e.probes), (32768, 60999, 32));
        assert_eq!(e.no_masq_entries, 1);
        assert_eq!(
            (e.tcp_syn_s, e.tcp_established_s, e.tcp_closed_s),
            (120, 432_000, 10)
        );
        assert_eq!((e.udp_s, e.udp_stream_s, e.icmp_s), (30, 120, 30));
        for bad in [
            NatSettings {
                ports: (0, 10),
                ..s.clone()
            },
            NatSettings {
                ports: (2000, 1000),
                ..s.clone()
            },
            NatSettings {
                probes: 33,
                ..s.clone()
            },
            NatSettings {
                nat_addr: Ipv4Addr::UNSPECIFIED,
                ..s.clone()
            },
        ] {
            assert!(matches!(bad.to_entry(), Err(BpfError::Invalid { .. })));
        }
    }

    #[test]
    fn port_ranges_parse() {
        assert_eq!(parse_port_range("32768-60999"), Ok((32768, 60999)));
        assert_eq!(parse_port_range(" 1024 - 2047 "), Ok((1024, 2047)));
        assert_eq!(parse_port_range("5000-5000"), Ok((5000, 5000)));
        for bad in ["", "5000", "0-10", "10-5", "1-70000", "a-b"] {
            let err = parse_port_range(bad).expect_err(bad);
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn sizing_follows_memory_within_bounds() {
        let gib = 1024 * 1024 * 1024u64;
        // 0.25 % of 24 GiB at 192 bytes per flow.
        assert_eq!(nat_map_size(24 * gib), 335_544);
        assert_eq!(nat_map_size(gib), NAT_MIN_ENTRIES);
        assert_eq!(nat_map_size(4096 * gib), NAT_MAX_DEFAULT_ENTRIES);
        assert_eq!(
            parse_meminfo_total("MemTotal:       24684636 kB\nMemFree: 1 kB\n"),
            Some(24_684_636 * 1024)
        );
        assert_eq!(parse_meminfo_total("nothing"), None);
        let explicit = NatSizing::resolve(1000);
        assert_eq!(explicit.entries, 1000);
        assert!(explicit.to_string().contains("--ebpf-nat-max-entries"));
        let sized = NatSizing {
            entries: 335_544,
            from_memory: Some(24 * gib),
        };
        assert_eq!(
            sized.to_string(),
            "335544 flows (~61 MiB of kernel memory), 0.25 % of 24576 MiB node memory"
        );
    }

    #[test]
    fn a_decoded_flow_gives_back_the_keys_of_its_entries() {
        // As the programs key a TCP flow and a pod's echo (identifier 77, source port 0 on
        // the reply side), and as the agent decodes them.
        let tcp = NatKey::new([10, 244, 1, 5], [1, 1, 1, 1], 40000, 443, proto::TCP);
        let echo = NatKey::new([10, 244, 1, 5], [1, 1, 1, 1], 77, 0, proto::ICMP);
        let nat = Ipv4Addr::new(192, 168, 1, 11);
        for (key, remote_port, nat_port) in [(tcp, 443, 40001), (echo, 0, 32801)] {
            let flow = NatFlow {
                proto: key.proto,
                orig: SocketAddrV4::new(key.saddr.into(), key.sport),
                remote: SocketAddrV4::new(key.daddr.into(), remote_port),
                nat: SocketAddrV4::new(nat, nat_port),
                state: ST_REPLIED,
                host: false,
                age: Duration::from_secs(1),
                idle: Duration::ZERO,
                expired: false,
                reverse_ok: true,
            };
            assert_eq!(flow.key(), key);
            assert_eq!(flow.reply_key(), key.reply_of(nat.octets(), nat_port));
        }
    }

    #[test]
    fn handover_waits_for_pod_flows_and_moved_node_flows() {
        let flow = |orig: &str, nat: &str, host: bool, expired: bool| NatFlow {
            proto: proto::TCP,
            orig: orig.parse().expect("addr"),
            remote: "1.1.1.1:443".parse().expect("addr"),
            nat: nat.parse().expect("addr"),
            state: ST_REPLIED,
            host,
            age: Duration::from_secs(1),
            idle: Duration::from_secs(1),
            expired,
            reverse_ok: true,
        };
        let node = flow("192.168.1.11:40000", "192.168.1.11:40000", true, false);
        let moved = flow("192.168.1.11:40001", "192.168.1.11:50001", true, false);
        let pod = flow("10.244.1.5:40000", "192.168.1.11:40000", false, false);
        let gone = flow("10.244.1.6:40000", "192.168.1.11:40002", false, true);
        assert_eq!(handover_pending(&[]), 0);
        assert_eq!(handover_pending(&[node.clone(), gone.clone()]), 0);
        assert_eq!(handover_pending(&[node.clone(), moved]), 1);
        assert_eq!(handover_pending(&[node, pod, gone]), 1);
    }

    #[test]
    fn a_copy_is_newer_when_stamped_later_or_with_more_state() {
        let entry = |last_seen_ns, state| NatEntry {
            state,
            last_seen_ns,
            ..NatEntry::default()
        };
        assert!(entry(2, 0).newer(&entry(1, ST_REPLIED)));
        assert!(!entry(1, ST_REPLIED).newer(&entry(2, 0)));
        assert!(entry(1, ST_REPLIED | ST_FIN_OUT).newer(&entry(1, ST_REPLIED)));
        assert!(!entry(1, ST_REPLIED).newer(&entry(1, ST_REPLIED | ST_FIN_OUT)));
        assert!(!entry(1, ST_REPLIED).newer(&entry(1, ST_REPLIED)));
        let rev = |checked_ns| NatRevEntry {
            checked_ns,
            ..NatRevEntry::default()
        };
        assert!(rev(5).newer(&rev(4)));
        assert!(!rev(4).newer(&rev(4)));
    }

    #[test]
    fn after_the_attach_only_entries_stamped_since_and_newer_are_carried() {
        let entry = |last_seen_ns, state| NatEntry {
            state,
            last_seen_ns,
            ..NatEntry::default()
        };
        // At load, everything; before the attach, what the old programs touched since.
        assert!(Carry::All.wants(&entry(1, 0), || Some(entry(500, ST_REPLIED))));
        assert!(Carry::Since(100).wants(&entry(100, 0), || Some(entry(500, ST_REPLIED))));
        assert!(!Carry::Since(100).wants(&entry(99, ST_REPLIED), || None));
        let since = Carry::SinceIfNewer(100);
        // After: not what the old programs left alone since (carried before the attach) ...
        assert!(!since.wants(&entry(99, ST_REPLIED), || None));
        // ... what they made or changed since, unless the new programs have a newer copy.
        assert!(since.wants(&entry(100, 0), || None));
        assert!(since.wants(&entry(150, ST_REPLIED), || Some(entry(120, ST_REPLIED))));
        assert!(!since.wants(&entry(150, ST_REPLIED), || Some(entry(160, ST_REPLIED))));
        assert!(since.wants(&entry(150, ST_REPLIED | ST_RST), || Some(entry(
            150, ST_REPLIED
        ))));
    }

    #[test]
    fn merged_flows_keep_the_copy_seen_last_once() {
        let flow = |orig: &str, age: u64, idle: u64, state| NatFlow {
            proto: proto::TCP,
            orig: orig.parse().expect("addr"),
            remote: "1.1.1.1:443".parse().expect("addr"),
            nat: "192.168.1.11:40000".parse().expect("addr"),
            state,
            host: false,
            age: Duration::from_secs(age),
            idle: Duration::from_secs(idle),
            expired: false,
            reverse_ok: true,
        };
        let copied = flow("10.244.1.5:40000", 9, 5, 0);
        let updated = flow("10.244.1.5:40000", 9, 1, ST_REPLIED);
        let only_new = flow("10.244.1.6:40000", 3, 3, 0);
        let only_old = flow("10.244.1.7:40000", 20, 2, ST_REPLIED);
        let merged = merge_flows(
            vec![copied, only_new.clone()],
            vec![updated.clone(), only_old.clone()],
        );
        assert_eq!(merged, vec![only_old, updated, only_new]);
    }

    #[test]
    fn state_names() {
        assert_eq!(state_name(proto::TCP, 0), "syn-sent");
        assert_eq!(state_name(proto::TCP, ST_REPLIED), "established");
        assert_eq!(state_name(proto::TCP, ST_REPLIED | ST_FIN_OUT), "fin-out");
        assert_eq!(
            state_name(proto::TCP, ST_REPLIED | ST_FIN_OUT | ST_FIN_IN),
            "closed"
        );
        assert_eq!(state_name(proto::TCP, ST_RST), "reset");
        assert_eq!(state_name(proto::UDP, 0), "unreplied");
        assert_eq!(state_name(proto::ICMP, ST_REPLIED), "established");
        let flow = NatFlow {
            proto: proto::TCP,
            orig: "10.244.1.5:40000".parse().expect("addr"),
            remote: "1.1.1.1:443".parse().expect("addr"),
            nat: "192.168.1.11:40000".parse().expect("addr"),
            state: ST_REPLIED,
            host: false,
            age: Duration::from_secs(12),
            idle: Duration::from_secs(1),
            expired: false,
            reverse_ok: true,
        };
        assert_eq!(
            flow.to_string(),
            "tcp 10.244.1.5:40000 -> 1.1.1.1:443 as 192.168.1.11:40000 established age 12s idle 1s"
        );
    }
}
