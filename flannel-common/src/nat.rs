//! Masquerade (source NAT of pod traffic leaving the cluster network) in eBPF: the map
//! layouts, the configuration entry, the connection states and their timeouts, and the pure
//! decisions the programs and the agent share.
//!
//! # Maps
//!
//! | map | type | key → value | written by |
//! |---|---|---|---|
//! | [`crate::maps::NAT_CONFIG`] | array (1) | 0 → [`NatConfig`] | agent |
//! | [`crate::maps::NAT4`] | LRU hash | [`NatKey`] of the packet *leaving* (original source) → [`NatEntry`] (translated source, state, timestamps) | `tc_to_netdev` |
//! | [`crate::maps::NAT_REV4`] | LRU hash | [`NatKey`] of the reply *arriving* (translated destination) → [`NatRevEntry`] (original source, last check) | `tc_to_netdev`, `tc_from_netdev` |
//! | [`crate::maps::NAT_FRAG4`] | LRU hash | [`FragKey`] of an arriving fragmented reply → [`FragEntry`] (original destination) | `tc_from_netdev` |
//! | [`crate::maps::NO_MASQ4`] | LPM trie | destination prefix → `u32` (1) | agent |
//!
//! Every flow has two entries, one per direction (as Cilium's SNAT map): the outgoing one is
//! the connection-tracking record (state and last-seen time live there), the incoming one is
//! the reverse pointer and, being keyed by the translated tuple, the port allocator's "in use"
//! set. A reply looks up the reverse entry; if the flow was checked in the last half second and
//! the reply changes nothing, that is all, otherwise it checks the outgoing entry the reverse
//! one names (it must be live and point back) and stamps the reverse entry with the result. A
//! packet going out looks up its outgoing entry, and checks that the reverse entry still points
//! back at it (re-making it if the LRU evicted it, stamping it otherwise) when the outgoing
//! entry is refreshed: at every state change and at least every half second. A reverse entry
//! whose outgoing entry is gone, expired or points elsewhere is stale.
//!
//! Ports are host order in the maps (so `bpftool map dump` prints them as numbers) and
//! addresses are network-order bytes (printed as `[10,244,1,5]`). ICMP echo uses the
//! identifier as the source port of a request and as the destination port of a reply; the
//! other port is 0.
//!
//! # Time
//!
//! Timestamps are `bpf_ktime_get_coarse_ns()` (`CLOCK_MONOTONIC_COARSE`: `CLOCK_MONOTONIC` at
//! the last timer tick, a few milliseconds behind at most and much cheaper to read on every
//! packet; timeouts are whole seconds). Entries are never trusted past
//! their timeout: a lookup that finds an expired entry treats it as absent, and the agent's
//! periodic sweep deletes expired entries. The LRU evicts the least recently used flows when a
//! map is full.

use crate::config::{Config, in_prefix};

/// [`NatConfig::flags`]: masquerade in eBPF is on.
pub const NAT_CFG_ENABLED: u32 = 1 << 0;
/// [`NatConfig::flags`]: the agent is handing masquerade back to iptables/nftables (eBPF SNAT
/// was switched off while pod flows it translates were still live). Those flows go on being
/// translated here (their conntrack entries carry no NAT binding, so the kernel leaves them
/// alone); no new pod flow is mapped (the kernel masquerades new flows, which then reach
/// `tc_to_netdev` with the masquerade address and the port conntrack chose: they are
/// registered as node flows, and never moved to another port). The agent turns the NAT off
/// when no pod flow is left.
pub const NAT_CFG_HANDOVER: u32 = 1 << 1;

/// kube-proxy's masquerade mark (`0x4000`): upstream's first rule returns such packets, which
/// kube-proxy's own chain masquerades.
pub const KUBE_PROXY_MASQ_MARK: u32 = 0x4000;

/// Most alternatives the allocator probes after the original port (the programs' loop bound).
pub const NAT_MAX_PROBES: u32 = 32;

/// [`NatEntry::state`]: a packet came back from the outside (the flow is "replied").
pub const ST_REPLIED: u8 = 1 << 0;
/// [`NatEntry::state`]: TCP FIN sent from the inside.
pub const ST_FIN_OUT: u8 = 1 << 1;
/// [`NatEntry::state`]: TCP FIN sent from the outside.
pub const ST_FIN_IN: u8 = 1 << 2;
/// [`NatEntry::state`]: TCP RST seen in either direction.
pub const ST_RST: u8 = 1 << 3;

/// [`NatEntry::flags`] / [`NatRevEntry::flags`]: a flow of the node itself (source = the
/// masquerade address), registered so that pod flows never take its port. Its packets are
/// only rewritten when its port collided with an earlier flow's.
pub const NAT_F_HOST: u8 = 1 << 0;

/// IP protocol numbers the NAT handles.
pub mod proto {
    /// ICMP.
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
}

/// TCP flag bits (byte 13 of the header).
pub mod tcp_flags {
    /// FIN.
    pub const FIN: u8 = 0x01;
    /// SYN.
    pub const SYN: u8 = 0x02;
    /// RST.
    pub const RST: u8 = 0x04;
    /// ACK.
    pub const ACK: u8 = 0x10;
}

/// The masquerade configuration, the single entry of [`crate::maps::NAT_CONFIG`]. All-zero
/// (the state of a fresh map) means off. Timeouts are idle times in seconds. 48 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NatConfig {
    /// `NAT_CFG_*` bits.
    pub flags: u32,
    /// The address pod traffic is masqueraded to (the external interface's address).
    pub nat_addr: [u8; 4],
    /// Lowest port (TCP/UDP) the allocator hands out.
    pub port_min: u16,
    /// Highest port (inclusive).
    pub port_max: u16,
    /// Alternatives probed when the original port is taken (at most [`NAT_MAX_PROBES`]).
    pub probes: u32,
    /// Entries in [`crate::maps::NO_MASQ4`]; 0 skips the lookup.
    pub no_masq_entries: u32,
    /// TCP before the first reply (conntrack's `syn_sent`).
    pub tcp_syn_s: u32,
    /// TCP after a reply, no FIN or RST yet.
    pub tcp_established_s: u32,
    /// TCP with a FIN in one direction only.
    pub tcp_half_closed_s: u32,
    /// TCP after FINs in both directions or a RST (late retransmissions still translate).
    pub tcp_closed_s: u32,
    /// UDP before the first reply.
    pub udp_s: u32,
    /// UDP after a reply (conntrack's `udp_stream`).
    pub udp_stream_s: u32,
    /// ICMP echo.
    pub icmp_s: u32,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for NatConfig {}

/// A packet's 5-tuple as seen at the hook that looks it up: the key of both NAT maps. 16
/// bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NatKey {
    /// Source address.
    pub saddr: [u8; 4],
    /// Destination address.
    pub daddr: [u8; 4],
    /// Source port (host order); the echo identifier of an ICMP echo request, else 0.
    pub sport: u16,
    /// Destination port (host order); the echo identifier of an ICMP echo reply, else 0.
    pub dport: u16,
    /// IP protocol (1, 6 or 17).
    pub proto: u8,
    /// Explicit padding; always zero.
    pub _pad: [u8; 3],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for NatKey {}

/// [`crate::maps::NAT4`]'s value: how an outgoing flow is translated, and its state. 24
/// bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NatEntry {
    /// The source address on the wire.
    pub nat_addr: [u8; 4],
    /// The source port (echo identifier) on the wire, host order.
    pub nat_port: u16,
    /// `ST_*` bits.
    pub state: u8,
    /// `NAT_F_*` bits.
    pub flags: u8,
    /// When the mapping was made (`bpf_ktime_get_coarse_ns`).
    pub created_ns: u64,
    /// When a packet of the flow was last seen (updated at most about once a second).
    pub last_seen_ns: u64,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for NatEntry {}

/// [`crate::maps::NAT_REV4`]'s value: the original source of the flow a reply belongs to,
/// and what the last check of that flow found. 16 bytes.
///
/// `state` and `checked_ns` let most replies skip the outgoing entry: a reply arriving within
/// [`REV_CHECK_NS`] of the last check that would not change the flow's state is translated on
/// the strength of this entry alone ([`NatRevEntry::vouches_for`]). Every other reply, and
/// every refresh of the flow on the way out, checks the outgoing entry and stamps the result
/// here.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NatRevEntry {
    /// The original source address (a pod, or the node for its own flows).
    pub orig_addr: [u8; 4],
    /// The original source port (echo identifier), host order.
    pub orig_port: u16,
    /// `NAT_F_*` bits.
    pub flags: u8,
    /// The flow's `ST_*` bits at the last check (0 for a claim just made).
    pub state: u8,
    /// When the claim was made or its flow last found live (`bpf_ktime_get_coarse_ns`).
    pub checked_ns: u64,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for NatRevEntry {}

/// A fragmented IPv4 datagram: [`crate::maps::NAT_FRAG4`]'s key (one arriving for the
/// masquerade address) and [`crate::maps::FRAGS4`]'s (one a local pod sends). 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    /// Source address.
    pub saddr: [u8; 4],
    /// Destination address (for `NAT_FRAG4`, the masquerade address).
    pub daddr: [u8; 4],
    /// IP identification (host order).
    pub id: u16,
    /// IP protocol.
    pub proto: u8,
    /// Explicit padding; always zero.
    pub _pad: u8,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for FragKey {}

/// [`crate::maps::NAT_FRAG4`]'s value: the destination the later fragments are rewritten to
/// (learnt from the first fragment, which carries the ports). 4 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragEntry {
    /// The original (pod) address.
    pub orig_addr: [u8; 4],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for FragEntry {}

const _: () = {
    assert!(core::mem::size_of::<NatConfig>() == 48);
    assert!(core::mem::size_of::<NatKey>() == 16);
    assert!(core::mem::size_of::<NatEntry>() == 24);
    assert!(core::mem::size_of::<NatRevEntry>() == 16);
    assert!(core::mem::size_of::<FragKey>() == 12);
    assert!(core::mem::size_of::<FragEntry>() == 4);
};

/// Nanoseconds per second.
pub const NS_PER_S: u64 = 1_000_000_000;

/// How long after a check of a flow its reverse entry alone vouches for replies that do not
/// change the flow's state. Every timeout is at least a second and a check refreshes a
/// last-seen time older than half a second, so a flow cannot expire in this window.
pub const REV_CHECK_NS: u64 = NS_PER_S / 2;

impl NatRevEntry {
    /// Whether a reply that leaves the flow in `next_state` (computed from this entry's
    /// `state`) may be translated without reading the outgoing entry at `now_ns`: the state
    /// does not change and the last check is at most [`REV_CHECK_NS`] old (a check stamped
    /// by another CPU a moment later counts as old, so it is made again).
    #[inline(always)]
    pub fn vouches_for(&self, next_state: u8, now_ns: u64) -> bool {
        next_state == self.state && now_ns.wrapping_sub(self.checked_ns) <= REV_CHECK_NS
    }
}

/// The state of a flow after a packet of `proto` with TCP `flags` came back from the outside.
#[inline(always)]
pub fn reply_state(proto_: u8, state: u8, flags: u8) -> u8 {
    if proto_ == proto::TCP {
        tcp_next(state, flags, false)
    } else {
        state | ST_REPLIED
    }
}

impl NatConfig {
    /// Whether [`NAT_CFG_ENABLED`] is set.
    #[inline(always)]
    pub fn enabled(&self) -> bool {
        self.flags & NAT_CFG_ENABLED != 0
    }

    /// Whether [`NAT_CFG_HANDOVER`] is set.
    #[inline(always)]
    pub fn handover(&self) -> bool {
        self.flags & NAT_CFG_HANDOVER != 0
    }

    /// Whether `port` lies in the allocator's range.
    #[inline(always)]
    pub fn port_in_range(&self, port: u16) -> bool {
        port >= self.port_min && port <= self.port_max
    }

    /// The range the allocator picks from for `proto`: the configured ports for TCP and UDP,
    /// every non-zero identifier for ICMP echo.
    #[inline(always)]
    pub fn range_of(&self, proto: u8) -> (u16, u16) {
        if proto == proto::ICMP {
            (1, u16::MAX)
        } else {
            (self.port_min, self.port_max)
        }
    }

    /// The idle timeout (seconds) of a flow of `proto` in `state`.
    #[inline(always)]
    pub fn timeout_s(&self, proto: u8, state: u8) -> u32 {
        match proto {
            proto::TCP => {
                if tcp_closed(state) {
                    self.tcp_closed_s
                } else if state & (ST_FIN_OUT | ST_FIN_IN) != 0 {
                    self.tcp_half_closed_s
                } else if state & ST_REPLIED != 0 {
                    self.tcp_established_s
                } else {
                    self.tcp_syn_s
                }
            }
            proto::UDP => {
                if state & ST_REPLIED != 0 {
                    self.udp_stream_s
                } else {
                    self.udp_s
                }
            }
            _ => self.icmp_s,
        }
    }

    /// Whether a flow of `proto` in `state`, last seen at `last_seen_ns`, has expired at
    /// `now_ns`.
    #[inline(always)]
    pub fn expired(&self, proto: u8, state: u8, last_seen_ns: u64, now_ns: u64) -> bool {
        let timeout = u64::from(self.timeout_s(proto, state)) * NS_PER_S;
        now_ns.saturating_sub(last_seen_ns) > timeout
    }

    /// The `attempt`-th candidate port for a flow whose original port is `original`:
    /// attempt 0 is the original port when it is in range, every other attempt walks the
    /// range linearly from the random start `random`.
    #[inline(always)]
    pub fn candidate(&self, proto: u8, original: u16, random: u32, attempt: u32) -> u16 {
        let (min, max) = self.range_of(proto);
        if attempt == 0 && original >= min && original <= max {
            return original;
        }
        let span = u32::from(max.saturating_sub(min)) + 1;
        let offset = random.wrapping_add(attempt) % span;
        (u32::from(min) + offset) as u16
    }
}

/// Whether a TCP state is closed: FINs both ways, or a RST.
#[inline(always)]
pub fn tcp_closed(state: u8) -> bool {
    state & ST_RST != 0 || state & (ST_FIN_OUT | ST_FIN_IN) == (ST_FIN_OUT | ST_FIN_IN)
}

/// The TCP state after a segment with `flags` went `outbound` (from the inside) or came back.
/// A SYN from the inside on a closed flow starts it afresh (the client reused its port).
#[inline(always)]
pub fn tcp_next(state: u8, flags: u8, outbound: bool) -> u8 {
    let mut s = state;
    if outbound && flags & tcp_flags::SYN != 0 && flags & tcp_flags::ACK == 0 && tcp_closed(s) {
        s = 0;
    }
    if !outbound {
        s |= ST_REPLIED;
    }
    if flags & tcp_flags::RST != 0 {
        s |= ST_RST;
    }
    if flags & tcp_flags::FIN != 0 {
        s |= if outbound { ST_FIN_OUT } else { ST_FIN_IN };
    }
    s
}

/// What `tc_to_netdev` does with an IPv4 packet leaving the external interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Egress {
    /// Not a NAT matter (NAT off, cluster destination, multicast, another source address).
    Skip,
    /// From the pod network to the outside but excluded (kube-proxy's mark or a no-masquerade
    /// prefix): leaves unchanged, as upstream's RETURN rules decide.
    Excluded,
    /// From the pod network to the outside: source NAT to the masquerade address.
    Masquerade,
    /// The node's own flow from the masquerade address: tracked so no pod flow takes its port.
    Host,
}

/// Upstream's masquerade decision (flannel-upstream.md 7.1, rules 1 and 5) for a packet from
/// `src` to `dst` leaving the external interface with `mark`: the pod network to anywhere
/// outside the cluster network except multicast, unless kube-proxy marked it or `no_masq`
/// (the LPM map, consulted last) holds the destination. Traffic *into* the cluster network
/// (rules 2 to 4, and rule 6, which masquerades outside → cluster traffic leaving through the
/// overlay) is left to netfilter.
#[inline(always)]
pub fn egress_kind(
    cfg: &Config,
    nat: &NatConfig,
    src: [u8; 4],
    dst: [u8; 4],
    mark: u32,
    no_masq: impl FnOnce([u8; 4]) -> bool,
) -> Egress {
    if !nat.enabled() || cfg.in_cluster(dst) || is_multicast(dst) || dst == [255; 4] {
        return Egress::Skip;
    }
    if cfg.in_cluster(src) {
        if mark & KUBE_PROXY_MASQ_MARK != 0 || (nat.no_masq_entries != 0 && no_masq(dst)) {
            return Egress::Excluded;
        }
        return Egress::Masquerade;
    }
    if src == nat.nat_addr {
        return Egress::Host;
    }
    Egress::Skip
}

/// Whether `addr` is IPv4 multicast (224.0.0.0/4).
#[inline(always)]
pub fn is_multicast(addr: [u8; 4]) -> bool {
    in_prefix(addr, [224, 0, 0, 0], 4)
}

impl NatKey {
    /// A key from its parts.
    #[inline(always)]
    pub fn new(saddr: [u8; 4], daddr: [u8; 4], sport: u16, dport: u16, proto: u8) -> Self {
        NatKey {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            // Three zero bytes, not `[0; 3]`: in the eBPF object that becomes a call to a
            // byte-loop `memset` (see `flannel_ebpf::zeroed`) on every NAT lookup.
            _pad: [0, 0, 0],
        }
    }

    /// The key of the reply to the outgoing flow `self` once translated to
    /// `nat_addr:nat_port`.
    #[inline(always)]
    pub fn reply_of(&self, nat_addr: [u8; 4], nat_port: u16) -> NatKey {
        if self.proto == proto::ICMP {
            NatKey::new(self.daddr, nat_addr, 0, nat_port, self.proto)
        } else {
            NatKey::new(self.daddr, nat_addr, self.dport, nat_port, self.proto)
        }
    }

    /// The outgoing key of the flow whose reply is `self`, given the original source.
    #[inline(always)]
    pub fn original_of(&self, orig_addr: [u8; 4], orig_port: u16) -> NatKey {
        if self.proto == proto::ICMP {
            NatKey::new(orig_addr, self.saddr, orig_port, 0, self.proto)
        } else {
            NatKey::new(orig_addr, self.saddr, orig_port, self.sport, self.proto)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CFG_ENABLED;

    fn cfg() -> Config {
        Config {
            flags: CFG_ENABLED,
            local_subnet: [10, 244, 1, 0],
            local_prefix_len: 24,
            cluster_net: [10, 244, 0, 0],
            cluster_prefix_len: 16,
            public_ip: [192, 168, 1, 11],
            ..Config::default()
        }
    }

    fn nat() -> NatConfig {
        NatConfig {
            flags: NAT_CFG_ENABLED,
            nat_addr: [192, 168, 1, 11],
            port_min: 32768,
            port_max: 60999,
            probes: 32,
            no_masq_entries: 1,
            tcp_syn_s: 120,
            tcp_established_s: 432_000,
            tcp_half_closed_s: 120,
            tcp_closed_s: 10,
            udp_s: 30,
            udp_stream_s: 120,
            icmp_s: 30,
        }
    }

    const POD: [u8; 4] = [10, 244, 1, 5];
    const REMOTE_POD: [u8; 4] = [10, 244, 2, 5];
    const OUTSIDE: [u8; 4] = [1, 1, 1, 1];

    #[test]
    fn upstream_decision() {
        let kind = |src, dst, mark| egress_kind(&cfg(), &nat(), src, dst, mark, |_| false);
        assert_eq!(kind(POD, OUTSIDE, 0), Egress::Masquerade);
        // Any source in the cluster network (upstream matches -s N, not -s P).
        assert_eq!(kind(REMOTE_POD, OUTSIDE, 0), Egress::Masquerade);
        assert_eq!(kind(POD, REMOTE_POD, 0), Egress::Skip);
        assert_eq!(kind(POD, [10, 244, 1, 9], 0), Egress::Skip);
        assert_eq!(kind(POD, [224, 0, 0, 251], 0), Egress::Skip);
        assert_eq!(kind(POD, [239, 255, 255, 250], 0), Egress::Skip);
        assert_eq!(kind(POD, [255, 255, 255, 255], 0), Egress::Skip);
        assert_eq!(kind(POD, OUTSIDE, 0x4000), Egress::Excluded);
        assert_eq!(kind(POD, OUTSIDE, 0xc000), Egress::Excluded);
        assert_eq!(kind([192, 168, 1, 11], OUTSIDE, 0), Egress::Host);
        assert_eq!(kind([192, 168, 1, 11], REMOTE_POD, 0), Egress::Skip);
        assert_eq!(kind([172, 17, 0, 2], OUTSIDE, 0), Egress::Skip);
        let excluded = egress_kind(&cfg(), &nat(), POD, OUTSIDE, 0, |d| d == OUTSIDE);
        assert_eq!(excluded, Egress::Excluded);
        // Without entries the LPM map is not consulted at all.
        let none = NatConfig {
            no_masq_entries: 0,
            ..nat()
        };
        let kind = egress_kind(&cfg(), &none, POD, OUTSIDE, 0, |_| panic!("looked up"));
        assert_eq!(kind, Egress::Masquerade);
        let off = NatConfig::default();
        assert_eq!(
            egress_kind(&cfg(), &off, POD, OUTSIDE, 0, |_| false),
            Egress::Skip
        );
    }

    #[test]
    fn tcp_states_and_timeouts() {
        let n = nat();
        let syn = tcp_flags::SYN;
        let synack = tcp_flags::SYN | tcp_flags::ACK;
        let ack = tcp_flags::ACK;
        let fin = tcp_flags::FIN | tcp_flags::ACK;
        let s = tcp_next(0, syn, true);
        assert_eq!(s, 0);
        assert_eq!(n.timeout_s(proto::TCP, s), 120);
        let s = tcp_next(s, synack, false);
        assert_eq!(s, ST_REPLIED);
        assert_eq!(n.timeout_s(proto::TCP, s), 432_000);
        let s = tcp_next(s, ack, true);
        let s = tcp_next(s, fin, true);
        assert_eq!(s, ST_REPLIED | ST_FIN_OUT);
        assert_eq!(n.timeout_s(proto::TCP, s), 120);
        assert!(!tcp_closed(s));
        let s = tcp_next(s, fin, false);
        assert!(tcp_closed(s));
        assert_eq!(n.timeout_s(proto::TCP, s), 10);
        // The client reuses the tuple: a new SYN starts afresh.
        assert_eq!(tcp_next(s, syn, true), 0);
        // A SYN on a live flow (a retransmission) changes nothing.
        assert_eq!(tcp_next(ST_REPLIED, syn, true), ST_REPLIED);
        // RST from either side closes.
        assert!(tcp_closed(tcp_next(ST_REPLIED, tcp_flags::RST, false)));
        assert!(tcp_closed(tcp_next(0, tcp_flags::RST, true)));
        assert_eq!(n.timeout_s(proto::UDP, 0), 30);
        assert_eq!(n.timeout_s(proto::UDP, ST_REPLIED), 120);
        assert_eq!(n.timeout_s(proto::ICMP, ST_REPLIED), 30);
        assert!(!n.expired(proto::UDP, 0, 5 * NS_PER_S, 35 * NS_PER_S));
        assert!(n.expired(proto::UDP, 0, 5 * NS_PER_S, 35 * NS_PER_S + 1));
        // A clock before the entry (it was written by another CPU a moment later) is fresh.
        assert!(!n.expired(proto::UDP, 0, 10 * NS_PER_S, 9 * NS_PER_S));
    }

    #[test]
    fn a_reverse_entry_vouches_only_for_unchanged_state_within_half_a_second() {
        let rev = NatRevEntry {
            state: ST_REPLIED,
            checked_ns: 10 * NS_PER_S,
            ..NatRevEntry::default()
        };
        let ack = reply_state(proto::TCP, rev.state, tcp_flags::ACK);
        assert_eq!(ack, ST_REPLIED);
        assert!(rev.vouches_for(ack, 10 * NS_PER_S));
        assert!(rev.vouches_for(ack, 10 * NS_PER_S + REV_CHECK_NS));
        assert!(!rev.vouches_for(ack, 10 * NS_PER_S + REV_CHECK_NS + 1));
        // Stamped by another CPU a moment after this one read the clock: checked again.
        assert!(!rev.vouches_for(ack, 10 * NS_PER_S - 1));
        // A FIN or RST from the outside changes the state: the outgoing entry must learn it.
        let fin = reply_state(proto::TCP, rev.state, tcp_flags::FIN | tcp_flags::ACK);
        assert_eq!(fin, ST_REPLIED | ST_FIN_IN);
        assert!(!rev.vouches_for(fin, 10 * NS_PER_S));
        let rst = reply_state(proto::TCP, rev.state, tcp_flags::RST);
        assert!(!rev.vouches_for(rst, 10 * NS_PER_S));
        // A claim just made (state 0): its first reply marks the flow replied, through a check.
        let fresh = NatRevEntry {
            checked_ns: 10 * NS_PER_S,
            ..NatRevEntry::default()
        };
        assert!(!fresh.vouches_for(reply_state(proto::UDP, 0, 0), 10 * NS_PER_S));
        assert_eq!(reply_state(proto::ICMP, 0, 0), ST_REPLIED);
    }

    #[test]
    fn candidates_keep_the_original_port_then_walk_the_range() {
        let n = nat();
        assert_eq!(n.candidate(proto::TCP, 40000, 7, 0), 40000);
        assert_eq!(n.candidate(proto::TCP, 40000, 7, 1), 32768 + 8);
        assert_eq!(n.candidate(proto::TCP, 40000, 7, 2), 32768 + 9);
        // Out of range: even attempt 0 picks from the range.
        assert_eq!(n.candidate(proto::UDP, 53, 7, 0), 32768 + 7);
        // The walk wraps at the end of the range.
        let span = 60999 - 32768 + 1;
        assert_eq!(n.candidate(proto::TCP, 1, span - 1, 1), 32768);
        for attempt in 0..40 {
            for random in [0, 1, 28231, u32::MAX] {
                assert!(n.port_in_range(n.candidate(proto::UDP, 80, random, attempt)));
            }
        }
        // ICMP identifiers use the whole non-zero space.
        assert_eq!(n.candidate(proto::ICMP, 7, 0, 0), 7);
        assert_ne!(n.candidate(proto::ICMP, 0, 0, 0), 0);
        let one = NatConfig {
            port_min: 5000,
            port_max: 5000,
            ..n
        };
        assert_eq!(one.candidate(proto::TCP, 80, 12345, 3), 5000);
    }

    #[test]
    fn keys_of_both_directions() {
        let out = NatKey::new(POD, OUTSIDE, 40000, 443, proto::TCP);
        let reply = out.reply_of([192, 168, 1, 11], 41000);
        assert_eq!(
            reply,
            NatKey::new(OUTSIDE, [192, 168, 1, 11], 443, 41000, proto::TCP)
        );
        assert_eq!(reply.original_of(POD, 40000), out);
        let echo = NatKey::new(POD, OUTSIDE, 7, 0, proto::ICMP);
        let reply = echo.reply_of([192, 168, 1, 11], 9);
        assert_eq!(
            reply,
            NatKey::new(OUTSIDE, [192, 168, 1, 11], 0, 9, proto::ICMP)
        );
        assert_eq!(reply.original_of(POD, 7), echo);
    }
}
