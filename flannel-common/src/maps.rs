//! Map names, sizes and the pin layout.
//!
//! Kernel object names are at most 15 characters (`BPF_OBJ_NAME_LEN` - 1); longer names would be
//! silently truncated in `bpftool map list`, so every name is checked at compile time.
//!
//! The fast-path maps are pinned under `<--bpf-pin-path>/<PIN_LAYOUT_VERSION>/<NAME>` so that a
//! restarted agent finds them (entries and counters intact); the classifier maps are not pinned.
//!
//! | name | type | key → value | written by |
//! |---|---|---|---|
//! | [`ROUTES4`] | LPM trie | remote pod subnet → [`crate::route::RemoteEntry`] | agent (`sync`) |
//! | [`NODES4`] | hash | peer public IPv4 → [`crate::route::NodeEntry`] | agent (`sync`) |
//! | [`CONFIG`] | array (1) | 0 → [`crate::config::Config`] | agent |
//! | [`NAT_GUARD4`] | LRU hash | [`crate::flow::PeerKey`] → `u32` | `tc_from_netdev` |
//! | [`KERNEL_FLOWS4`] | LRU hash | [`crate::flow::FlowKey`] → `u32` | `tc_to_netdev` |
//! | [`HELD_GUARD4`] | hash | [`crate::flow::PeerKey`] → `u32` | agent (from conntrack) |
//! | [`HELD_FLOWS4`] | hash | [`crate::flow::FlowKey`] → `u32` | agent (from conntrack) |
//! | [`HELD_COUNT`] | array (2) | family → keys held | agent (from conntrack) |
//! | [`NAT_CONFIG`] | array (1) | 0 → [`crate::nat::NatConfig`] | agent |
//! | [`NAT4`] | LRU hash | [`crate::nat::NatKey`] (outgoing) → [`crate::nat::NatEntry`] | `tc_to_netdev` |
//! | [`NAT_REV4`] | LRU hash | [`crate::nat::NatKey`] (reply) → [`crate::nat::NatRevEntry`] | `tc_to_netdev` |
//! | [`NAT_FRAG4`] | LRU hash | [`crate::nat::FragKey`] → [`crate::nat::FragEntry`] | `tc_from_netdev` |
//! | [`NO_MASQ4`] | LPM trie | destination prefix → `u32` | agent |
//! | the IPv6 maps of [`crate::v6`] but the memos | | | pinned like their IPv4 twins |
//! | [`crate::pods::PORTS`] (not pinned) | hash | [`crate::pods::PortKey`] (pod MAC) → [`crate::pods::PodPort`] | agent (bridge FDB mirror) |
//! | [`FRAGS4`], [`crate::v6::FRAGS6`] (not pinned) | LRU hash | [`crate::nat::FragKey`], [`crate::v6::FragKey6`] → `u32` | `tc_from_bridge` (fragments following their first) |
//! | [`crate::hops::HOPS4`] (not pinned) | LRU hash | [`crate::hops::HopKey`] → [`crate::hops::Hop`] | `tc_from_netdev`, `tc_from_bridge` (remembered route lookups) |
//! | [`crate::memo::MEMO4`] (not adopted; pinned in [`PIN_MEMOS_DIR`]) | LRU hash | [`crate::memo::MemoKey`] → [`crate::memo::FlowMemo`] | `tc_from_netdev`, `tc_from_bridge` (remembered per-flow decisions) |
//! | [`crate::memo::MEMO6`] (not adopted; pinned in [`PIN_MEMOS_DIR`]) | LRU hash | [`crate::memo::MemoKey6`] → [`crate::memo::FlowMemo6`] | `tc_from_netdev`, `tc_from_bridge` (IPv6 per-flow decisions) |
//! | [`crate::memo::MEMO_GEN`] (not pinned) | array (2) | slot → `u64` | the agent (generation, host-gw switch) |
//! | [`crate::memo::LEARN_GEN`] (not pinned) | array (4096) | remote endpoint's learn slot → `u64` | the programs' learners |
//! | [`CNT_FROM_BRIDGE`], [`CNT_FROM_NETDEV`], [`CNT_TO_NETDEV`], [`CNT_XDP_NETDEV`] | per-CPU array | [`crate::stats::Reason`] → [`crate::stats::Counter`] | the program of that name |
//! | [`TC_STATS`], [`XDP_STATS`] | per-CPU array | [`crate::stats::Reason`] → [`crate::stats::Counter`] | the classifiers |

/// Directory (under the bpffs pin path) holding this layout version's pinned maps. Bump it when
/// a pinned map's key, value or size changes; the agent then loads fresh maps and removes the
/// old version's directory once its programs are replaced.
pub const PIN_LAYOUT_VERSION: &str = "v1";

/// Directory (under the bpffs pin path, next to the layout versions) holding the pinned TCX
/// links, named `<program>-<ifindex>` (bpffs refuses dots in link names). Links outlive layout versions: a new agent replaces the
/// program behind an existing link atomically.
pub const PIN_LINKS_DIR: &str = "links";

/// Directory (under the bpffs pin path, next to the layout versions) where the agent pins the
/// flow memo maps ([`crate::memo::MEMO4`], [`crate::memo::MEMO6`]) of the programs it attached
/// last, replacing the previous ones. A restarted agent does not adopt them (its programs
/// start with memos of their own); they are there so that the way back to the kernel path
/// (`--dataplane kernel`, `--detach-fastpath`) finds the programs' flows by path, which needs
/// no more than `CAP_BPF`, instead of by program and map ID, which needs `CAP_SYS_ADMIN`.
pub const PIN_MEMOS_DIR: &str = "memos";

/// Directory (under the bpffs pin path, next to the layout versions) where an agent that
/// resizes the NAT maps ([`NAT4`], [`NAT_REV4`]) moves their old instances while it creates
/// the new ones and copies the flows over; it removes them once the copy is done. A start
/// that finds one there (its predecessor died in between) finishes that copy first, so a
/// crash during a resize loses no masqueraded connection.
pub const PIN_RESIZING_DIR: &str = "resizing";

/// LPM trie of remote IPv4 pod subnets.
pub const ROUTES4: &str = "FLANNEL_ROUTES4";
/// Maximum remote IPv4 subnets (nodes) the trie holds.
pub const ROUTES4_MAX_ENTRIES: u32 = 65536;

/// Hash of tunnel peers (public IPv4 → accepted tunnel kinds).
pub const NODES4: &str = "FLANNEL_NODES4";
/// Maximum tunnel peers.
pub const NODES4_MAX_ENTRIES: u32 = 65536;

/// Single-entry array holding the local node's configuration.
pub const CONFIG: &str = "FLANNEL_CONFIG";

/// LRU of remote pod endpoints that contacted a host address of this node.
pub const NAT_GUARD4: &str = "FLANNEL_NATGRD4";
/// Size of [`NAT_GUARD4`].
pub const NAT_GUARD4_MAX_ENTRIES: u32 = 16384;

/// LRU of local pod → remote pod flows that left through the kernel.
pub const KERNEL_FLOWS4: &str = "FLANNEL_KFLOWS4";
/// Size of [`KERNEL_FLOWS4`].
pub const KERNEL_FLOWS4_MAX_ENTRIES: u32 = 65536;

/// Hash of the NAT-guard keys of open NATed TCP connections and UDP streams, as conntrack
/// holds them: the [`NAT_GUARD4`] entries that no eviction may take (written and removed by the
/// agent only).
pub const HELD_GUARD4: &str = "FLANNEL_HNATGD4";
/// Size of [`HELD_GUARD4`] (allocated as entries are written).
pub const HELD_GUARD4_MAX_ENTRIES: u32 = 16384;

/// Hash of the kernel-flow keys of open NATed TCP connections and UDP streams, as conntrack
/// holds them: the [`KERNEL_FLOWS4`] entries that no eviction may take (written and removed by the
/// agent only).
pub const HELD_FLOWS4: &str = "FLANNEL_HFLOWS4";
/// Size of [`HELD_FLOWS4`] (allocated as entries are written).
pub const HELD_FLOWS4_MAX_ENTRIES: u32 = 65536;

/// Array of two `u32`: how many keys the held tables of each family hold (slot
/// [`HELD_V4`]: [`HELD_FLOWS4`] and [`HELD_GUARD4`]; slot [`HELD_V6`]: their IPv6 twins),
/// written by the agent after each update of them. The programs look a family's held tables
/// up only while its count is not 0, so that a node without held connections pays nothing
/// for them.
pub const HELD_COUNT: &str = "FLANNEL_HELDCNT";
/// [`HELD_COUNT`]'s IPv4 slot.
pub const HELD_V4: u32 = 0;
/// [`HELD_COUNT`]'s IPv6 slot.
pub const HELD_V6: u32 = 1;

/// Single-entry array holding the masquerade configuration ([`crate::nat::NatConfig`]).
pub const NAT_CONFIG: &str = "FLANNEL_NATCFG";

/// LRU of masqueraded flows by their outgoing 5-tuple: translation and state.
pub const NAT4: &str = "FLANNEL_NAT4";
/// LRU of masqueraded flows by the 5-tuple of their replies: the original source.
pub const NAT_REV4: &str = "FLANNEL_NATREV4";
/// Default size of [`NAT4`] and [`NAT_REV4`] (one entry per flow in each) in the object; the
/// agent sets the size at load time (`--ebpf-nat-max-entries`, by default from node memory).
pub const NAT4_DEFAULT_MAX_ENTRIES: u32 = 131_072;

/// LRU of fragmented replies being translated (first fragment seen, later ones pending).
pub const NAT_FRAG4: &str = "FLANNEL_NATFRG4";
/// Size of [`NAT_FRAG4`].
pub const NAT_FRAG4_MAX_ENTRIES: u32 = 8192;

/// LRU of a local pod's fragmented IPv4 datagrams to remote pods whose first fragment the fast
/// path sent ([`crate::nat::FragKey`] → `u32`, unused): their later fragments follow it. Not
/// pinned (a datagram's fragments are microseconds apart).
pub const FRAGS4: &str = "FLANNEL_FRAGS4";
/// Size of [`FRAGS4`].
pub const FRAGS4_MAX_ENTRIES: u32 = 8192;

const _: () = assert!(FRAGS4.len() <= MAX_OBJ_NAME_LEN);

/// LPM trie of destinations pod traffic is never masqueraded to (`--ip-masq-exclude-cidrs`).
pub const NO_MASQ4: &str = "FLANNEL_NOMASQ4";
/// Most no-masquerade prefixes.
pub const NO_MASQ4_MAX_ENTRIES: u32 = 1024;

/// Counters of `tc_from_bridge` ([`crate::stats::COUNTER_SLOTS`] entries).
pub const CNT_FROM_BRIDGE: &str = "FLANNEL_CNT_FBR";
/// Counters of `tc_from_netdev`.
pub const CNT_FROM_NETDEV: &str = "FLANNEL_CNT_FND";
/// Counters of `tc_to_netdev`.
pub const CNT_TO_NETDEV: &str = "FLANNEL_CNT_TND";
/// Counters of `xdp_from_netdev`.
pub const CNT_XDP_NETDEV: &str = "FLANNEL_CNT_XND";

/// Per-CPU array of [`crate::stats::Counter`] indexed by [`crate::stats::Reason`], filled by the
/// TC classifier.
pub const TC_STATS: &str = "FLANNEL_TC_CNT";

/// Per-CPU array of [`crate::stats::Counter`] indexed by [`crate::stats::Reason`], filled by the
/// XDP classifier (kept apart from [`TC_STATS`] so a packet seen by both hooks is not counted
/// twice in one place).
pub const XDP_STATS: &str = "FLANNEL_XDP_CNT";

/// The maps the agent pins (and adopts after a restart).
pub const PINNED: [&str; 24] = [
    ROUTES4,
    NODES4,
    CONFIG,
    NAT_GUARD4,
    KERNEL_FLOWS4,
    CNT_FROM_BRIDGE,
    CNT_FROM_NETDEV,
    CNT_TO_NETDEV,
    CNT_XDP_NETDEV,
    NAT_CONFIG,
    NAT4,
    NAT_REV4,
    NAT_FRAG4,
    NO_MASQ4,
    crate::v6::CONFIG6,
    crate::v6::ROUTES6,
    crate::v6::NODES6,
    crate::v6::NAT_GUARD6,
    crate::v6::KERNEL_FLOWS6,
    HELD_GUARD4,
    HELD_FLOWS4,
    crate::v6::HELD_GUARD6,
    crate::v6::HELD_FLOWS6,
    HELD_COUNT,
];

/// Longest name the kernel keeps for a map or program.
pub const MAX_OBJ_NAME_LEN: usize = 15;

const _: () = {
    let mut i = 0;
    while i < PINNED.len() {
        assert!(PINNED[i].len() <= MAX_OBJ_NAME_LEN);
        i += 1;
    }
    assert!(TC_STATS.len() <= MAX_OBJ_NAME_LEN);
    assert!(XDP_STATS.len() <= MAX_OBJ_NAME_LEN);
};
