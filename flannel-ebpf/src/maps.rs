//! Every map of the eBPF object, in one place to audit names and sizes.
//!
//! All maps are BTF-defined (`#[btf_map]`) so that `bpftool map dump` prints their keys and
//! values as typed JSON. Names must match `flannel_common::maps` (checked by the agent when it
//! loads the object); the table there says who writes what.

use aya_ebpf::{
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, lpm_trie::Key},
    macros::btf_map,
};
use flannel_common::{
    config::Config,
    flow::{FlowKey, PeerKey},
    hops::{HOPS4_MAX_ENTRIES, Hop, HopKey},
    maps as names,
    nat::{FragEntry, FragKey, NatConfig, NatEntry, NatKey, NatRevEntry},
    pods::{PORTS_MAX_ENTRIES, PodPort, PortKey},
    route::{NodeEntry, RemoteEntry},
    stats::{COUNTER_SLOTS, Counter, Reason},
};

/// Per-CPU packet/byte counters of the TC classifier, indexed by [`Reason`]
/// (`flannel_common::maps::TC_STATS`).
#[btf_map]
pub static FLANNEL_TC_CNT: PerCpuArray<Counter, { Reason::COUNT }> = PerCpuArray::new();

/// Per-CPU packet/byte counters of the XDP programs, indexed by [`Reason`]
/// (`flannel_common::maps::XDP_STATS`).
#[btf_map]
pub static FLANNEL_XDP_CNT: PerCpuArray<Counter, { Reason::COUNT }> = PerCpuArray::new();

/// Remote IPv4 pod subnets → how to reach them (`flannel_common::maps::ROUTES4`).
#[btf_map]
pub static FLANNEL_ROUTES4: LpmTrie<[u8; 4], RemoteEntry, { names::ROUTES4_MAX_ENTRIES as usize }> =
    LpmTrie::new();

/// Tunnel peers: public IPv4 → accepted tunnel kinds (`flannel_common::maps::NODES4`).
#[btf_map]
pub static FLANNEL_NODES4: HashMap<[u8; 4], NodeEntry, { names::NODES4_MAX_ENTRIES as usize }> =
    HashMap::new();

/// The local node's configuration, one entry (`flannel_common::maps::CONFIG`).
#[btf_map]
pub static FLANNEL_CONFIG: Array<Config, 1> = Array::new();

/// Remote pod endpoints that talked to a host address of this node
/// (`flannel_common::maps::NAT_GUARD4`).
#[btf_map]
pub static FLANNEL_NATGRD4: LruHashMap<PeerKey, u32, { names::NAT_GUARD4_MAX_ENTRIES as usize }> =
    LruHashMap::new();

/// Local pod → remote pod flows that left through the kernel
/// (`flannel_common::maps::KERNEL_FLOWS4`).
#[btf_map]
pub static FLANNEL_KFLOWS4: LruHashMap<
    FlowKey,
    u32,
    { names::KERNEL_FLOWS4_MAX_ENTRIES as usize },
> = LruHashMap::new();

/// `BPF_F_NO_PREALLOC` as a map's flags: entries allocated as they are written.
pub const NO_PREALLOC: usize = aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize;

/// The NAT-guard keys of open NATed TCP connections and UDP streams, never evicted
/// (`flannel_common::maps::HELD_GUARD4`).
#[btf_map]
pub static FLANNEL_HNATGD4: HashMap<
    PeerKey,
    u32,
    { names::HELD_GUARD4_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

/// The kernel-flow keys of open NATed TCP connections and UDP streams, never evicted
/// (`flannel_common::maps::HELD_FLOWS4`).
#[btf_map]
pub static FLANNEL_HFLOWS4: HashMap<
    FlowKey,
    u32,
    { names::HELD_FLOWS4_MAX_ENTRIES as usize },
    NO_PREALLOC,
> = HashMap::new();

/// Keys held per family (`flannel_common::maps::HELD_COUNT`).
#[btf_map]
pub static FLANNEL_HELDCNT: Array<u32, 2> = Array::new();

/// Whether the held tables of the family in `slot` (`flannel_common::maps::HELD_V4`,
/// `HELD_V6`) may hold a key of protocol `proto`: they hold TCP and UDP keys only, and their
/// lookups are skipped while they hold none.
#[inline(always)]
pub fn holds(slot: u32, proto: u8) -> bool {
    (proto == crate::parse::proto::TCP || proto == crate::parse::proto::UDP)
        && FLANNEL_HELDCNT.get(slot).is_some_and(|n| *n != 0)
}

/// The masquerade configuration, one entry (`flannel_common::maps::NAT_CONFIG`).
#[btf_map]
pub static FLANNEL_NATCFG: Array<NatConfig, 1> = Array::new();

/// Masqueraded flows by outgoing 5-tuple (`flannel_common::maps::NAT4`). The agent sets the
/// size at load time.
#[btf_map]
pub static FLANNEL_NAT4: LruHashMap<
    NatKey,
    NatEntry,
    { names::NAT4_DEFAULT_MAX_ENTRIES as usize },
> = LruHashMap::new();

/// Masqueraded flows by reply 5-tuple (`flannel_common::maps::NAT_REV4`); same size as
/// [`FLANNEL_NAT4`].
#[btf_map]
pub static FLANNEL_NATREV4: LruHashMap<
    NatKey,
    NatRevEntry,
    { names::NAT4_DEFAULT_MAX_ENTRIES as usize },
> = LruHashMap::new();

/// Fragmented replies in translation (`flannel_common::maps::NAT_FRAG4`).
#[btf_map]
pub static FLANNEL_NATFRG4: LruHashMap<
    FragKey,
    FragEntry,
    { names::NAT_FRAG4_MAX_ENTRIES as usize },
> = LruHashMap::new();

/// Destinations never masqueraded (`flannel_common::maps::NO_MASQ4`).
#[btf_map]
pub static FLANNEL_NOMASQ4: LpmTrie<[u8; 4], u32, { names::NO_MASQ4_MAX_ENTRIES as usize }> =
    LpmTrie::new();

/// Local pods' MACs → their bridge port (`flannel_common::pods::PORTS`).
#[btf_map]
pub static FLANNEL_PORTS: HashMap<PortKey, PodPort, { PORTS_MAX_ENTRIES as usize }> =
    HashMap::new();

/// Destinations → the route lookup's answer for them (`flannel_common::hops::HOPS4`).
#[btf_map]
pub static FLANNEL_HOPS4: LruHashMap<HopKey, Hop, { HOPS4_MAX_ENTRIES as usize }> =
    LruHashMap::new();

/// A local pod's fragmented datagrams whose first fragment was sent
/// (`flannel_common::maps::FRAGS4`, see [`crate::frag`]).
#[btf_map]
pub static FLANNEL_FRAGS4: LruHashMap<FragKey, u32, { names::FRAGS4_MAX_ENTRIES as usize }> =
    LruHashMap::new();

/// Counters of `tc_from_bridge` (`flannel_common::maps::CNT_FROM_BRIDGE`).
#[btf_map]
pub static FLANNEL_CNT_FBR: PerCpuArray<Counter, COUNTER_SLOTS> = PerCpuArray::new();

/// Counters of `tc_from_netdev` (`flannel_common::maps::CNT_FROM_NETDEV`).
#[btf_map]
pub static FLANNEL_CNT_FND: PerCpuArray<Counter, COUNTER_SLOTS> = PerCpuArray::new();

/// Counters of `tc_to_netdev` (`flannel_common::maps::CNT_TO_NETDEV`).
#[btf_map]
pub static FLANNEL_CNT_TND: PerCpuArray<Counter, COUNTER_SLOTS> = PerCpuArray::new();

/// Counters of `xdp_from_netdev` (`flannel_common::maps::CNT_XDP_NETDEV`).
#[btf_map]
pub static FLANNEL_CNT_XND: PerCpuArray<Counter, COUNTER_SLOTS> = PerCpuArray::new();

/// The configuration, if the agent has enabled it.
#[inline(always)]
pub fn config() -> Option<&'static Config> {
    match FLANNEL_CONFIG.get(0) {
        Some(cfg) if cfg.enabled() => Some(cfg),
        _ => None,
    }
}

/// The masquerade configuration, if masquerade in eBPF is on.
#[inline(always)]
pub fn nat_config() -> Option<&'static NatConfig> {
    match FLANNEL_NATCFG.get(0) {
        Some(cfg) if cfg.enabled() => Some(cfg),
        _ => None,
    }
}

/// Whether `addr` lies in a no-masquerade prefix.
#[inline(always)]
pub fn no_masq(addr: [u8; 4]) -> bool {
    FLANNEL_NOMASQ4.get(&Key::new(32, addr)).is_some()
}

/// The remote subnet containing `addr`, if any (longest prefix).
#[inline(always)]
pub fn route(addr: [u8; 4]) -> Option<&'static RemoteEntry> {
    FLANNEL_ROUTES4.get(&Key::new(32, addr))
}

/// The tunnel kinds accepted from the node with public IP `addr` (`NODE_F_*`), 0 if unknown.
#[inline(always)]
pub fn node_flags(addr: [u8; 4]) -> u32 {
    match FLANNEL_NODES4.get_ptr(addr) {
        // SAFETY: the pointer comes from a successful lookup; NodeEntry is a plain u32 that is
        // read once (a concurrent update can only replace it with another valid value).
        Some(entry) => unsafe { (*entry).flags },
        None => 0,
    }
}
