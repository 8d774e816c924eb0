//! Connections that were open before the fast path took over: kept on the kernel path.
//!
//! The programs learn the flows conntrack must keep seeing from packets
//! (`flannel_ebpf::deliver`): a local pod's flow that left through the kernel goes into the
//! kernel-flow table, a remote pod's connection to a host address (hostPort, NodePort) into
//! the NAT guard. A connection that was already open when the programs were attached (a node
//! moving from upstream flannel or from `--dataplane kernel`, pods running while the agent was
//! down, a pod's first connection begun before its port had the program) was never seen by
//! them; if conntrack NATed it, changing path midway breaks it:
//! - a local pod's connection to a remote pod that the CNI bridge masqueraded (`ipMasq`, on
//!   when the agent runs without `--ip-masq`): its next packets would leave unmasqueraded and
//!   the remote end, which knows the node's address, resets them;
//! - a local pod's connection DNATed to a remote pod (a Service): the answers would reach the
//!   pod with the remote pod's address, not the Service's;
//! - a remote pod's connection DNATed to a local pod (hostPort, NodePort): the local pod's
//!   answers would leave with its own address instead of the one the client connected to.
//!
//! So before the programs take a node's interfaces or a pod's port, the agent reads
//! conntrack's table ([`crate::netlink::conntrack`]) and writes the same keys the programs
//! would have learnt for every NATed connection between a local pod and a remote pod
//! ([`Seeds::add`], a pure function of each entry and the configuration); the programs then keep
//! them on the kernel path for their whole life (LRU entries, like the learnt ones). The agent
//! repeats the read every `--ebpf-conntrack-resync` while the fast path is on, rewriting the
//! keys that are there (so that eviction takes closed flows first) and putting back the ones
//! an eviction took.
//! Connections conntrack holds no NAT state for change path harmlessly and are left alone.
//!
//! The keys of open NATed TCP connections (and UDP streams) are written into the held tables
//! instead ([`Seeds::held`]: plain hashes the programs read when the LRU ones miss, which no
//! eviction touches), and each read of conntrack removes from them the keys it no longer calls
//! for: a long-idle Service connection stays on the kernel path however fast short flows (UDP
//! DNS lookups, which are left to the LRU tables alone) churn the LRU ones, instead of being
//! lost until the next resync puts it back. A UDP flow is held once conntrack marks it assured
//! (it was answered and still sends after its first two seconds), which a lookup never is.
//! The reads do not write held keys into the LRU tables (the programs still learn the active
//! ones there from their packets): on a node with more open connections than an LRU table
//! holds, rewriting them all would evict what the programs learnt meanwhile, and it took most
//! of a read's time.

use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use aya::maps::{HashMap, MapData};
use flannel_common::{
    config::{Config, in_prefix},
    flow::{FlowKey, PeerKey},
    maps as names,
    v6::{self, Config6, FlowKey6, PeerKey6},
};

use super::{
    BpfError, FastPath,
    batch::{BPF_ANY, BPF_NOEXIST},
    fastpath::missing,
};
use crate::netlink::{
    conntrack::{self, CtEntry, CtTuple, Family},
    raw::RawError,
};

/// The families the programs handle on this node: the configuration of each that is enabled.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scope {
    /// IPv4, when enabled.
    pub v4: Option<Config>,
    /// IPv6, when enabled.
    pub v6: Option<Config6>,
}

/// The flow-table keys that keep open NATed connections on the kernel path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Seeds {
    /// The keys for the flow tables (the LRU ones).
    pub keys: Keys,
    /// Those of them that belong to TCP connections and UDP streams: held as well
    /// ([`names::HELD_FLOWS4`], [`names::HELD_GUARD4`] and their IPv6 twins).
    pub held: Keys,
    /// Conntrack entries that could not be read.
    pub unreadable: usize,
}

/// Keys of the four flow tables.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Keys {
    /// Kernel-flow keys (IPv4).
    pub flows4: HashSet<FlowKey>,
    /// NAT-guard keys (IPv4).
    pub guards4: HashSet<PeerKey>,
    /// Kernel-flow keys (IPv6).
    pub flows6: HashSet<FlowKey6>,
    /// NAT-guard keys (IPv6).
    pub guards6: HashSet<PeerKey6>,
}

impl Keys {
    /// How many keys in all.
    pub fn len(&self) -> usize {
        self.flows4.len() + self.guards4.len() + self.flows6.len() + self.guards6.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds every key of `other`.
    fn extend(&mut self, other: Keys) {
        self.flows4.extend(other.flows4);
        self.guards4.extend(other.guards4);
        self.flows6.extend(other.flows6);
        self.guards6.extend(other.guards6);
    }
}

impl Seeds {
    /// How many keys in all.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The key sets an entry's keys go into: [`Seeds::keys`], and [`Seeds::held`] when `held`.
    fn sets(&mut self, held: bool) -> impl Iterator<Item = &mut Keys> {
        [Some(&mut self.keys), held.then_some(&mut self.held)]
            .into_iter()
            .flatten()
    }

    /// Adds the keys `entry` calls for under `scope` (see the module documentation):
    /// - the connection was NATed and is not over (a TCP entry lingering in `TIME_WAIT` would
    ///   send a new connection that reuses its ports to the kernel midway), else nothing;
    /// - it left a local pod for a remote pod (its original destination, a masqueraded
    ///   connection): the kernel-flow key the pod's next packets have;
    /// - its answers come from a remote pod to a local pod (DNATed to the remote pod): the
    ///   kernel-flow key the answers have, as `tc_to_netdev` learns it;
    /// - a remote pod's TCP or UDP connection whose answers come from a local pod (DNATed to
    ///   it): the NAT-guard key of the remote end the answers go to.
    ///
    /// The keys of a TCP connection, and of a UDP flow conntrack calls assured (answered, and
    /// still sending past its first two seconds: a stream, not a DNS lookup), go into
    /// [`Seeds::held`] too.
    pub fn add(&mut self, scope: &Scope, entry: &CtEntry) {
        if !entry.is_nated() || entry.is_closed() {
            return;
        }
        let has_ports = matches!(entry.orig.proto, PROTO_TCP | PROTO_UDP);
        let echo = matches!(entry.orig.proto, PROTO_ICMP | PROTO_ICMPV6);
        if !has_ports && !echo {
            return;
        }
        let held =
            entry.orig.proto == PROTO_TCP || (entry.orig.proto == PROTO_UDP && entry.assured);
        if let Some(cfg) = &scope.v4 {
            let (flows, guard) = wanted(entry, has_ports, |a| v4_side(cfg, a));
            let flows = flows.iter().flatten().map(flow_key);
            let guard = guard.as_ref().map(peer_key);
            for keys in self.sets(held) {
                keys.flows4.extend(flows.clone());
                keys.guards4.extend(guard);
            }
        }
        if let Some(cfg) = &scope.v6 {
            let (flows, guard) = wanted(entry, has_ports, |a| v6_side(cfg, a));
            let flows = flows.iter().flatten().map(flow_key6);
            let guard = guard.as_ref().map(peer_key6);
            for keys in self.sets(held) {
                keys.flows6.extend(flows.clone());
                keys.guards6.extend(guard);
            }
        }
    }
}

/// The rules of [`Seeds::add`] for one family (`side` places an address): the tuples of the
/// kernel flows, as a local pod's packets have them (local side first), and the tuple of the
/// local pod's answers whose destination the NAT guard must hold.
fn wanted(
    entry: &CtEntry,
    has_ports: bool,
    side: impl Fn(IpAddr) -> Side,
) -> ([Option<CtTuple>; 2], Option<CtTuple>) {
    let CtEntry { orig, reply, .. } = entry;
    let pair =
        |from: IpAddr, to: IpAddr| (side(from), side(to)) == (Side::LocalPod, Side::RemotePod);
    let masqueraded = pair(orig.src, orig.dst).then_some(*orig);
    let dnated_to_remote = pair(reply.dst, reply.src).then(|| reply.inverse());
    let dnated_to_local = (has_ports && pair(reply.src, reply.dst)).then_some(*reply);
    ([masqueraded, dnated_to_remote], dnated_to_local)
}

/// The errno of a failed map call, if it was one.
fn errno(e: &aya::maps::MapError) -> Option<i32> {
    match e {
        aya::maps::MapError::SyscallError(e) => e.io_error.raw_os_error(),
        _ => None,
    }
}

const PROTO_ICMP: u8 = 1;
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;
const PROTO_ICMPV6: u8 = 58;

/// Where an address stands, as the programs' learning rules see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    /// A pod of this node (not the subnet's host addresses).
    LocalPod,
    /// In the cluster network, outside this node's subnet.
    RemotePod,
    /// Anything else: this node's host addresses, outside the cluster, the other family.
    Other,
}

fn v4_side(cfg: &Config, addr: IpAddr) -> Side {
    let IpAddr::V4(a) = addr else {
        return Side::Other;
    };
    let a = a.octets();
    if cfg.is_local_pod(a) {
        Side::LocalPod
    } else if cfg.in_cluster(a) && !in_prefix(a, cfg.local_subnet, cfg.local_prefix_len) {
        Side::RemotePod
    } else {
        Side::Other
    }
}

fn v6_side(cfg: &Config6, addr: IpAddr) -> Side {
    let IpAddr::V6(a) = addr else {
        return Side::Other;
    };
    let a = a.octets();
    if cfg.is_local_pod(&a) {
        Side::LocalPod
    } else if cfg.in_cluster(&a) && !cfg.in_local_subnet(&a) {
        Side::RemotePod
    } else {
        Side::Other
    }
}

fn v4(addr: IpAddr) -> [u8; 4] {
    match addr {
        IpAddr::V4(a) => a.octets(),
        IpAddr::V6(_) => Ipv4Addr::UNSPECIFIED.octets(),
    }
}

fn v6(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V6(a) => a.octets(),
        IpAddr::V4(_) => Ipv6Addr::UNSPECIFIED.octets(),
    }
}

/// The kernel-flow key of a packet with tuple `t` leaving a local pod (source = local side).
fn flow_key(t: &CtTuple) -> FlowKey {
    FlowKey {
        local_addr: v4(t.src),
        remote_addr: v4(t.dst),
        local_port: t.sport.to_be_bytes(),
        remote_port: t.dport.to_be_bytes(),
        proto: t.proto,
        _pad: [0; 3],
    }
}

fn flow_key6(t: &CtTuple) -> FlowKey6 {
    FlowKey6 {
        local_addr: v6(t.src),
        remote_addr: v6(t.dst),
        local_port: t.sport.to_be_bytes(),
        remote_port: t.dport.to_be_bytes(),
        proto: t.proto,
        _pad: [0; 3],
    }
}

/// The NAT-guard key of the destination of a packet with tuple `t` (a local pod's answer).
fn peer_key(t: &CtTuple) -> PeerKey {
    PeerKey {
        addr: v4(t.dst),
        port: t.dport.to_be_bytes(),
        proto: t.proto,
        _pad: 0,
    }
}

fn peer_key6(t: &CtTuple) -> PeerKey6 {
    PeerKey6 {
        addr: v6(t.dst),
        port: t.dport.to_be_bytes(),
        proto: t.proto,
        _pad: 0,
    }
}

/// What [`FastPath::seed`] wrote (both families).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seeded {
    /// New kernel-flow entries.
    pub kernel_flows: usize,
    /// New NAT-guard entries.
    pub nat_guards: usize,
    /// Entries of either table that were there already (refreshed).
    pub refreshed: usize,
    /// What the held tables hold now, and what changed.
    pub held: HeldSync,
}

/// The held tables after a [`FastPath::seed`] (all four).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeldSync {
    /// Keys held now.
    pub held: usize,
    /// Keys written.
    pub added: usize,
    /// Keys removed (no longer called for).
    pub removed: usize,
    /// Keys not held because their table was full (left to the LRU tables alone).
    pub full: usize,
}

impl std::ops::AddAssign for HeldSync {
    fn add_assign(&mut self, o: HeldSync) {
        self.held += o.held;
        self.added += o.added;
        self.removed += o.removed;
        self.full += o.full;
    }
}

/// What [`FastPath::hold`] did to one held table, and what the LRU table next to it held.
struct Hold<K> {
    sync: HeldSync,
    /// Keys not written: the table was full.
    full: HashSet<K>,
    /// Keys written that the LRU table next to it lacked.
    lacking: usize,
    /// The keys the LRU table next to it held when read.
    lru: HashSet<K>,
}

/// The keys of `keys` that the held table does not hold after `hold` made it hold `held`: the
/// ones not called for there, and the ones that did not fit.
fn not_held<K: std::hash::Hash + Eq + Copy>(
    keys: &HashSet<K>,
    held: &HashSet<K>,
    hold: &Hold<K>,
) -> Vec<K> {
    keys.iter()
        .filter(|k| !held.contains(k) || hold.full.contains(k))
        .copied()
        .collect()
}

/// Reads conntrack's table (the families `scope` enables) in the calling thread's network
/// namespace and returns the keys it calls for. Blocking: run it on
/// `tokio::task::spawn_blocking`.
pub fn collect(scope: &Scope) -> Result<Seeds, RawError> {
    let mut seeds = Seeds::default();
    for (family, enabled) in [
        (Family::V4, scope.v4.is_some()),
        (Family::V6, scope.v6.is_some()),
    ] {
        if enabled {
            let mut found = Seeds::default();
            found.unreadable = conntrack::dump(family, |entry| found.add(scope, &entry))?;
            seeds.keys.extend(found.keys);
            seeds.held.extend(found.held);
            seeds.unreadable += found.unreadable;
        }
    }
    Ok(seeds)
}

impl FastPath {
    /// The families the programs handle now, from the configuration they read.
    pub fn seed_scope(&self) -> Result<Scope, BpfError> {
        Ok(Scope {
            v4: Some(self.config_entry()?).filter(Config::enabled),
            v6: Some(self.config6_entry()?).filter(Config6::enabled),
        })
    }

    /// Makes the held tables hold [`Seeds::held`] (removing nothing when the read missed
    /// entries) and tells the programs how much each family holds; then writes the other keys
    /// of [`Seeds::keys`] into the kernel-flow and NAT-guard LRU tables: a key already there is
    /// refreshed (rewritten, so that it becomes one of the LRU's most recent entries, among
    /// the last its eviction picks), a missing one added. A held key is not written there:
    /// the programs find it in the held table when the LRU table misses, and a node with more
    /// open connections than an LRU table holds would otherwise have each read evict the
    /// entries the programs learnt meanwhile (a DNS lookup's, its answer then delivered past
    /// conntrack). Returns how many keys the tables lacked (added to an LRU table, or newly
    /// held and not in the LRU table) and how many were refreshed; retires the programs'
    /// remembered decisions when any was lacking, as a learnt entry does.
    pub fn seed(&mut self, seeds: &Seeds) -> Result<Seeded, BpfError> {
        // A read that missed entries may have missed live connections: nothing is removed.
        let prune = seeds.unreadable == 0;
        let (held, keys) = (&seeds.held, &seeds.keys);
        let flows4 = self.hold(
            names::HELD_FLOWS4,
            names::KERNEL_FLOWS4,
            &held.flows4,
            prune,
        )?;
        let guards4 = self.hold(names::HELD_GUARD4, names::NAT_GUARD4, &held.guards4, prune)?;
        let flows6 = self.hold(v6::HELD_FLOWS6, v6::KERNEL_FLOWS6, &held.flows6, prune)?;
        let guards6 = self.hold(v6::HELD_GUARD6, v6::NAT_GUARD6, &held.guards6, prune)?;
        let mut ipv4 = flows4.sync;
        ipv4 += guards4.sync;
        let mut ipv6 = flows6.sync;
        ipv6 += guards6.sync;
        self.set_held_counts(ipv4.held, ipv6.held)?;
        let (lru_flows4, kept_flows4) = self.seed_table(
            names::KERNEL_FLOWS4,
            &not_held(&keys.flows4, &held.flows4, &flows4),
            &flows4.lru,
        )?;
        let (lru_flows6, kept_flows6) = self.seed_table(
            v6::KERNEL_FLOWS6,
            &not_held(&keys.flows6, &held.flows6, &flows6),
            &flows6.lru,
        )?;
        let (lru_guards4, kept_guards4) = self.seed_table(
            names::NAT_GUARD4,
            &not_held(&keys.guards4, &held.guards4, &guards4),
            &guards4.lru,
        )?;
        let (lru_guards6, kept_guards6) = self.seed_table(
            v6::NAT_GUARD6,
            &not_held(&keys.guards6, &held.guards6, &guards6),
            &guards6.lru,
        )?;
        let kernel_flows = lru_flows4 + lru_flows6 + flows4.lacking + flows6.lacking;
        let nat_guards = lru_guards4 + lru_guards6 + guards4.lacking + guards6.lacking;
        let refreshed = kept_flows4 + kept_flows6 + kept_guards4 + kept_guards6;
        if kernel_flows + nat_guards > 0 {
            self.retire_memos()?;
        }
        ipv4 += ipv6;
        Ok(Seeded {
            kernel_flows,
            nat_guards,
            refreshed,
            held: ipv4,
        })
    }

    /// Tells the programs how many keys each family's held tables hold
    /// ([`names::HELD_COUNT`]): they skip the lookups of a family that holds none.
    fn set_held_counts(&mut self, v4: usize, v6: usize) -> Result<(), BpfError> {
        let name = names::HELD_COUNT;
        let map = self.ebpf_mut().map_mut(name).ok_or_else(|| missing(name))?;
        let mut counts: aya::maps::Array<&mut MapData, u32> =
            aya::maps::Array::try_from(map).map_err(|e| BpfError::map(name, e))?;
        for (slot, n) in [(names::HELD_V4, v4), (names::HELD_V6, v6)] {
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            counts.set(slot, n, 0).map_err(|e| BpfError::map(name, e))?;
        }
        Ok(())
    }

    /// Makes the held table `name` hold `keys`: writes the missing ones, and with `prune`
    /// removes the ones not among them. Reads the LRU table `lru` next to it first, and counts
    /// the keys it writes that the LRU table lacks (the programs did not know them as the
    /// kernel's).
    fn hold<K: aya::Pod + std::hash::Hash + Eq>(
        &mut self,
        name: &'static str,
        lru: &'static str,
        keys: &HashSet<K>,
        prune: bool,
    ) -> Result<Hold<K>, BpfError> {
        let lru = self.table_keys::<K>(lru)?;
        let present = self.table_keys::<K>(name)?;
        let map = self.ebpf_mut().map_mut(name).ok_or_else(|| missing(name))?;
        let mut table: HashMap<&mut MapData, K, u32> =
            HashMap::try_from(map).map_err(|e| BpfError::map(name, e))?;
        let mut out = Hold {
            sync: HeldSync {
                held: present.len(),
                ..HeldSync::default()
            },
            full: HashSet::new(),
            lacking: 0,
            lru: HashSet::new(),
        };
        if prune {
            for key in present.difference(keys) {
                match table.remove(key) {
                    Ok(()) => out.sync.removed += 1,
                    Err(e) if errno(&e) == Some(libc::ENOENT) => {}
                    Err(e) => return Err(BpfError::map(name, e)),
                }
            }
        }
        for key in keys.difference(&present) {
            match table.insert(key, 1u32, BPF_NOEXIST) {
                Ok(()) => {
                    out.sync.added += 1;
                    out.lacking += usize::from(!lru.contains(key));
                }
                Err(e) if errno(&e) == Some(libc::EEXIST) => {}
                Err(e) if errno(&e) == Some(libc::E2BIG) => {
                    out.full.insert(*key);
                }
                Err(e) => return Err(BpfError::map(name, e)),
            }
        }
        out.sync.full = out.full.len();
        out.sync.held = out.sync.held + out.sync.added - out.sync.removed;
        out.lru = lru;
        Ok(out)
    }

    /// Writes `keys` into the LRU table `name`, which held `present` when read; returns
    /// (added, refreshed): the keys it lacked then, and the others. (A key the programs learn,
    /// or the LRU evicts, between the read and the write is counted by what the read found; a
    /// memo the miscount leaves in place is used for at most its 100 ticks.)
    fn seed_table<K: aya::Pod + std::hash::Hash + Eq>(
        &mut self,
        name: &'static str,
        keys: &[K],
        present: &HashSet<K>,
    ) -> Result<(usize, usize), BpfError> {
        if keys.is_empty() {
            return Ok((0, 0));
        }
        self.write_all(name, keys)?;
        let added = keys.iter().filter(|k| !present.contains(k)).count();
        Ok((added, keys.len() - added))
    }

    /// Every key of the flow table `name` (a hash or LRU hash of `K` to `u32`), read in
    /// batches ([`super::batch::keys`]).
    fn table_keys<K: aya::Pod + std::hash::Hash + Eq>(
        &self,
        name: &'static str,
    ) -> Result<HashSet<K>, BpfError> {
        let map = self.ebpf().map(name).ok_or_else(|| missing(name))?;
        super::batch::batch_data(map)
            .and_then(|data| super::batch::keys::<K>(data, size_of::<u32>()))
            .map(|keys| keys.into_iter().collect())
            .map_err(|e| BpfError::map(name, aya::maps::MapError::from(e)))
    }

    /// Writes every key of `keys` into the flow table `name` (`BPF_ANY`, value 1), in batches
    /// ([`super::batch::update`]).
    fn write_all<K: aya::Pod>(&mut self, name: &'static str, keys: &[K]) -> Result<(), BpfError> {
        let map = self.ebpf().map(name).ok_or_else(|| missing(name))?;
        super::batch::batch_data(map)
            .and_then(|data| super::batch::update(data, keys, &vec![1u32; keys.len()], BPF_ANY))
            .map_err(|e| BpfError::map(name, aya::maps::MapError::from(e)))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use flannel_common::config::CFG_ENABLED;

    use super::*;

    fn scope() -> Scope {
        Scope {
            v4: Some(Config {
                flags: CFG_ENABLED,
                local_subnet: [10, 244, 1, 0],
                local_prefix_len: 24,
                cluster_net: [10, 244, 0, 0],
                cluster_prefix_len: 16,
                ..Config::default()
            }),
            v6: Some(Config6 {
                flags: v6::CFG6_ENABLED,
                local_subnet: "fd00:0:0:1::".parse::<Ipv6Addr>().unwrap().octets(),
                local_prefix_len: 64,
                cluster_net: "fd00::".parse::<Ipv6Addr>().unwrap().octets(),
                cluster_prefix_len: 48,
                ..Config6::default()
            }),
        }
    }

    use CtTuple as T;

    fn entry(orig: CtTuple, reply: CtTuple) -> CtEntry {
        CtEntry {
            orig,
            reply,
            tcp_state: None,
            assured: false,
        }
    }

    fn tcp_flow(local: [u8; 4], remote: [u8; 4], local_port: u16, remote_port: u16) -> FlowKey {
        FlowKey {
            local_addr: local,
            remote_addr: remote,
            local_port: local_port.to_be_bytes(),
            remote_port: remote_port.to_be_bytes(),
            proto: PROTO_TCP,
            _pad: [0; 3],
        }
    }

    fn seeds_of(entries: &[CtEntry]) -> Seeds {
        let mut seeds = Seeds::default();
        for e in entries {
            seeds.add(&scope(), e);
        }
        seeds
    }

    #[test]
    fn a_masqueraded_pod_connection_keeps_its_outgoing_key() {
        // Pod 10.244.1.5 -> remote pod 10.244.2.7:7100, masqueraded to flannel.1's 10.244.1.0.
        let orig = T::of("10.244.1.5", "10.244.2.7", PROTO_TCP, 40000, 7100);
        let reply = T::of("10.244.2.7", "10.244.1.0", PROTO_TCP, 7100, 40001);
        let seeds = seeds_of(&[entry(orig, reply)]);
        assert_eq!(
            seeds.keys.flows4,
            HashSet::from([tcp_flow([10, 244, 1, 5], [10, 244, 2, 7], 40000, 7100)])
        );
        assert!(seeds.keys.guards4.is_empty());
    }

    #[test]
    fn a_service_dnat_to_a_remote_pod_keeps_the_answers_key() {
        // Pod -> ClusterIP 10.96.0.10:80, DNATed to 10.244.2.7:8080, not masqueraded.
        let orig = T::of("10.244.1.5", "10.96.0.10", PROTO_TCP, 40000, 80);
        let reply = T::of("10.244.2.7", "10.244.1.5", PROTO_TCP, 8080, 40000);
        let seeds = seeds_of(&[entry(orig, reply)]);
        assert_eq!(
            seeds.keys.flows4,
            HashSet::from([tcp_flow([10, 244, 1, 5], [10, 244, 2, 7], 40000, 8080)])
        );
        assert!(seeds.keys.guards4.is_empty());
    }

    #[test]
    fn a_remote_pods_hostport_connection_guards_its_endpoint() {
        // Remote pod 10.244.2.7 -> cni0 gateway 10.244.1.1:8080, DNATed to pod 10.244.1.5:80.
        let orig = T::of("10.244.2.7", "10.244.1.1", PROTO_UDP, 5353, 8080);
        let reply = T::of("10.244.1.5", "10.244.2.7", PROTO_UDP, 80, 5353);
        let seeds = seeds_of(&[entry(orig, reply)]);
        assert_eq!(
            seeds.keys.guards4,
            HashSet::from([PeerKey {
                addr: [10, 244, 2, 7],
                port: 5353u16.to_be_bytes(),
                proto: PROTO_UDP,
                _pad: 0,
            }])
        );
        assert!(seeds.keys.flows4.is_empty());
    }

    #[test]
    fn tcp_connections_are_held_and_udp_ones_left_to_the_lru_tables() {
        // A Service connection (TCP) and a DNS lookup through a Service (UDP), both DNATed to
        // remote pods; a remote pod's TCP connection to a hostPort, and an IPv6 Service
        // connection.
        let service = entry(
            T::of("10.244.1.5", "10.96.0.10", PROTO_TCP, 40000, 80),
            T::of("10.244.2.7", "10.244.1.5", PROTO_TCP, 8080, 40000),
        );
        let dns = entry(
            T::of("10.244.1.5", "10.96.0.53", PROTO_UDP, 5353, 53),
            T::of("10.244.2.9", "10.244.1.5", PROTO_UDP, 53, 5353),
        );
        let hostport = entry(
            T::of("10.244.2.7", "10.244.1.1", PROTO_TCP, 41000, 8080),
            T::of("10.244.1.5", "10.244.2.7", PROTO_TCP, 80, 41000),
        );
        let service6 = entry(
            T::of("fd00:0:0:1::5", "fd00:96::10", PROTO_TCP, 40000, 80),
            T::of("fd00:0:0:2::7", "fd00:0:0:1::5", PROTO_TCP, 8080, 40000),
        );
        let seeds = seeds_of(&[service, dns, hostport, service6]);
        let held = &seeds.held;
        assert_eq!(
            held.flows4,
            HashSet::from([tcp_flow([10, 244, 1, 5], [10, 244, 2, 7], 40000, 8080)])
        );
        assert_eq!(
            seeds.keys.flows4.len(),
            2,
            "the DNS lookup's key in the LRU table"
        );
        assert_eq!(
            held.guards4,
            HashSet::from([PeerKey {
                addr: [10, 244, 2, 7],
                port: 41000u16.to_be_bytes(),
                proto: PROTO_TCP,
                _pad: 0,
            }])
        );
        assert_eq!(held.flows6, seeds.keys.flows6);
        assert_eq!(held.flows6.len(), 1);
        assert!(held.guards6.is_empty());
    }

    #[test]
    fn udp_streams_are_held_and_lookups_not() {
        let flow = |sport| {
            entry(
                T::of("10.244.1.5", "10.96.0.20", PROTO_UDP, sport, 514),
                T::of("10.244.2.7", "10.244.1.5", PROTO_UDP, 5514, sport),
            )
        };
        let stream = CtEntry {
            assured: true,
            ..flow(40000)
        };
        let seeds = seeds_of(&[stream, flow(40001)]);
        assert_eq!(seeds.keys.flows4.len(), 2);
        assert_eq!(
            seeds.held.flows4,
            HashSet::from([FlowKey {
                proto: PROTO_UDP,
                ..tcp_flow([10, 244, 1, 5], [10, 244, 2, 7], 40000, 5514)
            }])
        );
    }

    #[test]
    fn unnated_host_and_outside_connections_are_left_alone() {
        let entries = [
            // Pod to remote pod, no NAT (--ip-masq): changing path is harmless.
            {
                let orig = T::of("10.244.1.5", "10.244.2.7", PROTO_TCP, 40000, 7100);
                CtEntry {
                    orig,
                    reply: orig.inverse(),
                    tcp_state: None,
                    assured: false,
                }
            },
            // Pod to the internet, masqueraded: the programs never take it.
            CtEntry {
                orig: T::of("10.244.1.5", "1.1.1.1", PROTO_TCP, 40000, 443),
                reply: T::of("1.1.1.1", "192.168.0.2", PROTO_TCP, 443, 40000),
                tcp_state: Some(3),
                assured: false,
            },
            // The cni0 gateway (a host address) to a remote pod, masqueraded.
            CtEntry {
                orig: T::of("10.244.1.1", "10.244.2.7", PROTO_TCP, 40000, 80),
                reply: T::of("10.244.2.7", "192.168.0.2", PROTO_TCP, 80, 40000),
                tcp_state: Some(3),
                assured: false,
            },
            // GRE between pods, DNATed: no ports, no key.
            CtEntry {
                orig: T::of("10.244.1.5", "10.96.0.1", 47, 0, 0),
                reply: T::of("10.244.2.7", "10.244.1.5", 47, 0, 0),
                tcp_state: Some(3),
                assured: false,
            },
            // Two local pods.
            CtEntry {
                orig: T::of("10.244.1.5", "10.96.0.10", PROTO_TCP, 40000, 80),
                reply: T::of("10.244.1.6", "10.244.1.5", PROTO_TCP, 80, 40000),
                tcp_state: Some(3),
                assured: false,
            },
        ];
        assert_eq!(seeds_of(&entries), Seeds::default());
    }

    #[test]
    fn icmp_echo_and_ipv6_get_their_keys() {
        let echo = CtEntry {
            orig: T::of("10.244.1.5", "10.244.2.7", PROTO_ICMP, 77, 77),
            reply: T::of("10.244.2.7", "10.244.1.0", PROTO_ICMP, 78, 78),
            tcp_state: Some(3),
            assured: false,
        };
        let seeds = seeds_of(&[echo]);
        assert_eq!(seeds.keys.flows4.len(), 1);
        // No NAT guard for ICMP (it has no ports).
        let echo_dnat = CtEntry {
            orig: T::of("10.244.2.7", "10.244.1.1", PROTO_ICMP, 9, 9),
            reply: T::of("10.244.1.5", "10.244.2.7", PROTO_ICMP, 9, 9),
            tcp_state: Some(3),
            assured: false,
        };
        assert!(seeds_of(&[echo_dnat]).keys.guards4.is_empty());

        let masq6 = CtEntry {
            orig: T::of("fd00:0:0:1::5", "fd00:0:0:2::7", PROTO_TCP, 40000, 7100),
            reply: T::of("fd00:0:0:2::7", "fd00:0:0:1::", PROTO_TCP, 7100, 40000),
            tcp_state: Some(3),
            assured: false,
        };
        let hostport6 = CtEntry {
            orig: T::of("fd00:0:0:2::7", "fd00:0:0:1::1", PROTO_TCP, 40000, 8080),
            reply: T::of("fd00:0:0:1::5", "fd00:0:0:2::7", PROTO_TCP, 80, 40000),
            tcp_state: Some(3),
            assured: false,
        };
        let seeds = seeds_of(&[masq6, hostport6]);
        assert_eq!(
            seeds.keys.flows6,
            HashSet::from([FlowKey6 {
                local_addr: "fd00:0:0:1::5".parse::<Ipv6Addr>().unwrap().octets(),
                remote_addr: "fd00:0:0:2::7".parse::<Ipv6Addr>().unwrap().octets(),
                local_port: 40000u16.to_be_bytes(),
                remote_port: 7100u16.to_be_bytes(),
                proto: PROTO_TCP,
                _pad: [0; 3],
            }])
        );
        assert_eq!(
            seeds.keys.guards6,
            HashSet::from([PeerKey6 {
                addr: "fd00:0:0:2::7".parse::<Ipv6Addr>().unwrap().octets(),
                port: 40000u16.to_be_bytes(),
                proto: PROTO_TCP,
                _pad: 0,
            }])
        );
        assert!(seeds.keys.flows4.is_empty() && seeds.keys.guards4.is_empty());
    }

    #[test]
    fn a_closed_connection_lingering_in_conntrack_gets_nothing() {
        let orig = T::of("10.244.1.5", "10.244.2.7", PROTO_TCP, 40000, 7100);
        let reply = T::of("10.244.2.7", "10.244.1.0", PROTO_TCP, 7100, 40000);
        for (state, keys) in [(3, 1), (7, 0), (8, 0)] {
            let seeds = seeds_of(&[CtEntry {
                orig,
                reply,
                tcp_state: Some(state),
                assured: false,
            }]);
            assert_eq!(seeds.len(), keys, "TCP state {state}");
        }
    }

    #[test]
    fn a_disabled_family_gets_nothing() {
        let scope = Scope { v4: None, v6: None };
        let mut seeds = Seeds::default();
        let orig = T::of("10.244.1.5", "10.244.2.7", PROTO_TCP, 40000, 7100);
        let reply = T::of("10.244.2.7", "10.244.1.0", PROTO_TCP, 7100, 40000);
        seeds.add(
            &scope,
            &CtEntry {
                orig,
                reply,
                tcp_state: None,
                assured: false,
            },
        );
        assert!(seeds.is_empty());
    }
}
