//! Remembered decisions per flow: after the full checks of a pod-to-pod packet ended in "deliver
//! it into the local pod" (`tc_from_netdev`: a plain host-gw / DirectRouting packet, or a VXLAN
//! or IPIP packet decapsulated) or "send it to the peer" (`tc_from_bridge`: host-gw, or
//! encapsulated in VXLAN or IPIP), the program keeps what it did for that flow ([`FlowMemo`]:
//! where to, with which MACs, through which tunnel peer) and the next packets of the flow take
//! it from [`MEMO4`] with one lookup instead of the route, NAT-guard, kernel-flow, node,
//! next-hop and port lookups. What the packet itself says is still checked on every packet
//! (IPv4 TCP/UDP, no fragment or options, a sane header, TTL > 1, the length against the MTU;
//! for a tunnel the outer header as the full checks want it, and that it comes from the peer
//! the memo was made for); ICMP, udp and NAT never use a memo.
//!
//! IPv6 has its own map, [`MEMO6`] ([`MemoKey6`] → [`FlowMemo6`]), for host-gw and VXLAN
//! over IPv6 (its only fast-path tunnel), under the same rules and the same generation: the
//! IPv6 learners move it on too, and so does the agent's IPv6 route, node and configuration
//! sync. There a memo replaces the route, NAT-guard, kernel-flow and node lookups and the
//! `bpf_fib_lookup` (IPv6 has no remembered next hops) of every packet.
//!
//! A memo is used only while everything the decision rested on is unchanged:
//! - at most [`crate::hops::HOP_TTL_TICKS`] kernel ticks (up to a second) old, as for a remembered
//!   next hop: a changed neighbour is seen within a second. A memo only older than that is not
//!   thrown away: if the remembered route lookup it came from ([`FlowMemo::hop_key`]) is fresh and
//!   says the same ([`FlowMemo::confirmed_by`]), the memo takes that lookup's time and is used
//!   (`memo_confirmed`). Nothing else a decision rests on can change without moving its generation
//!   on, so this is what the full checks would decide, without their lookups and without a new map
//!   element: a node whose pods open many short connections reuses their ports within seconds, and
//!   re-checking each reused flow in full was most of the programs' time per connection. IPv6 has
//!   no remembered route lookups: there the programs look the route up for an old memo
//!   ([`FlowMemo6::confirmed_by`]), which still spares the other lookups and the new element;
//! - taken at the current generation of its flow: the sum of the agent's counter (slot
//!   [`GEN_AGENT`] of [`MEMO_GEN`]), which any change of the route, node, port or configuration
//!   maps moves on and so retires every memo at once, and the counter of the flow's slot in
//!   [`LEARN_GEN`], which the programs move on when they learn a NAT-guard or kernel-flow
//!   entry. The slot is a hash of the remote endpoint ([`learn_slot`]): every entry a decision
//!   rests on (the flow's kernel-flow key, the NAT-guard key of its remote endpoint) names the
//!   same remote endpoint as the memo's key, so a learnt entry retires the memos of the flows
//!   it can change (and of the few others that share the slot), not every memo: a node whose
//!   pods open Service connections or send DNS queries through kube-proxy learns a kernel
//!   flow for each, and would otherwise send all of its flows through the full checks again
//!   after every one. The programs read the generation *before* their checks, so a change
//!   that lands while a packet is being checked leaves a memo that is already retired. (The
//!   learners count up with an atomic add after their map update; on x86 that is a locked
//!   instruction, which orders the two. arm64's JIT emits a non-fetching atomic add without
//!   that ordering: there a check racing a learner within the same instant may keep a
//!   decision for up to its second.)

use crate::{
    flow::FlowKey,
    hops::{Hop, HopKey, UNDERLAY_VIA},
    maps::MAX_OBJ_NAME_LEN,
    v6::FlowKey6,
};

/// LRU hash of flows → the decision taken for them ([`MemoKey`] → [`FlowMemo`]). Not adopted:
/// a cache the programs fill, which a restarted agent starts afresh (the agent pins the
/// attached programs' one in [`crate::maps::PIN_MEMOS_DIR`] for the way back to the kernel
/// path).
pub const MEMO4: &str = "FLANNEL_MEMO4";
/// Most flows [`MEMO4`] remembers.
pub const MEMO4_MAX_ENTRIES: u32 = 65536;
/// Array of `u64`: the agent's counter of the memos' generation (slot [`GEN_AGENT`]) and its
/// switch [`MEMO_ROUTES`]. Not pinned (it belongs with [`MEMO4`]).
pub const MEMO_GEN: &str = "FLANNEL_MEMOGEN";
/// The slot of [`MEMO_GEN`] the agent counts up: a change of the maps every decision rests on.
pub const GEN_AGENT: u32 = 0;
/// The slot of [`MEMO_GEN`] that is nonzero while some remote subnet is reached host-gw, by
/// VXLAN or by IPIP (only then does `tc_from_bridge` look for a memo: udp flows have none).
pub const MEMO_ROUTES: u32 = 1;
/// Slots of [`MEMO_GEN`].
pub const MEMO_GEN_SLOTS: u32 = 2;
/// Array of `u64`: per [`learn_slot`] of a remote endpoint, the programs' count of NAT-guard
/// and kernel-flow entries learnt for it. Not pinned (it belongs with [`MEMO4`]).
pub const LEARN_GEN: &str = "FLANNEL_LRNGEN";
/// Slots of [`LEARN_GEN`] (a power of two): a learnt entry retires about this fraction of the
/// memos besides its own flow's.
pub const LEARN_GEN_SLOTS: u32 = 4096;

/// The [`LEARN_GEN`] slot of the remote endpoint `addr`:`port` (network order) of protocol
/// `proto`: a multiplicative hash of the three, folded to [`LEARN_GEN_SLOTS`].
#[inline(always)]
pub fn learn_slot(addr: [u8; 4], port: [u8; 2], proto: u8) -> u32 {
    let endpoint = u32::from_ne_bytes(addr)
        ^ u32::from(u16::from_ne_bytes(port)).rotate_left(16)
        ^ u32::from(proto);
    endpoint.wrapping_mul(0x9E37_79B1) >> (32 - LEARN_GEN_SLOTS.trailing_zeros())
}

/// A flow-table key (kernel flow or NAT guard, either family) that names a remote endpoint:
/// learning it retires the memos of that endpoint's [`LEARN_GEN`] slot.
pub trait LearnSlot {
    /// The [`LEARN_GEN`] slot of the key's remote endpoint.
    fn learn_slot(&self) -> u32;
}

impl LearnSlot for crate::flow::PeerKey {
    #[inline(always)]
    fn learn_slot(&self) -> u32 {
        learn_slot(self.addr, self.port, self.proto)
    }
}

impl LearnSlot for FlowKey {
    #[inline(always)]
    fn learn_slot(&self) -> u32 {
        learn_slot(self.remote_addr, self.remote_port, self.proto)
    }
}

impl LearnSlot for crate::v6::PeerKey6 {
    #[inline(always)]
    fn learn_slot(&self) -> u32 {
        learn_slot6(&self.addr, self.port, self.proto)
    }
}

impl LearnSlot for FlowKey6 {
    #[inline(always)]
    fn learn_slot(&self) -> u32 {
        learn_slot6(&self.remote_addr, self.remote_port, self.proto)
    }
}

/// [`learn_slot`] of an IPv6 remote endpoint: the address folded to 32 bits first, from the
/// bytes where pod addresses differ (the node's subnet within a /48 or longer cluster
/// network, bytes 4 to 8, and the low 32 bits of the interface identifier). Eight bytes, not
/// sixteen: the fold runs in the programs' full checks, whose stack is at the limit.
#[inline(always)]
pub fn learn_slot6(addr: &[u8; 16], port: [u8; 2], proto: u8) -> u32 {
    let folded = [
        addr[4] ^ addr[12],
        addr[5] ^ addr[13],
        addr[6] ^ addr[14],
        addr[7] ^ addr[15],
    ];
    learn_slot(folded, port, proto)
}

/// [`MEMO4`]'s IPv6 twin: LRU hash of IPv6 flows → the decision taken for them
/// ([`MemoKey6`] → [`FlowMemo6`]). Not adopted, pinned as [`MEMO4`] is.
pub const MEMO6: &str = "FLANNEL_MEMO6";
/// Most IPv6 flows [`MEMO6`] remembers (about 5 MiB of kernel memory, allocated up front as
/// for every LRU map; a flow it no longer holds takes the full checks).
pub const MEMO6_MAX_ENTRIES: u32 = 32768;

const _: () = {
    assert!(LEARN_GEN_SLOTS.is_power_of_two());
    assert!(LEARN_GEN.len() <= MAX_OBJ_NAME_LEN);
    assert!(MEMO4.len() <= MAX_OBJ_NAME_LEN);
    assert!(MEMO6.len() <= MAX_OBJ_NAME_LEN);
    assert!(MEMO_GEN.len() <= MAX_OBJ_NAME_LEN);
};

/// [`MemoKey::dir`] of a packet arriving for a local pod (`tc_from_netdev`).
pub const DIR_IN: u8 = 1;
/// [`MemoKey::dir`] of a local pod's packet leaving for a peer (`tc_from_bridge`).
pub const DIR_OUT: u8 = 2;

/// [`MEMO4`]'s key: a flow seen from this node, local side first (as
/// [`crate::flow::FlowKey`]), and the direction. 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MemoKey {
    /// The local pod's address.
    pub local_addr: [u8; 4],
    /// The remote pod's address.
    pub remote_addr: [u8; 4],
    /// The local port (network order).
    pub local_port: [u8; 2],
    /// The remote port (network order).
    pub remote_port: [u8; 2],
    /// IP protocol (6 or 17).
    pub proto: u8,
    /// [`DIR_IN`] or [`DIR_OUT`].
    pub dir: u8,
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for MemoKey {}

impl MemoKey {
    /// The key of `flow` in direction `dir`.
    #[inline(always)]
    pub fn new(flow: &FlowKey, dir: u8) -> MemoKey {
        MemoKey {
            local_addr: flow.local_addr,
            remote_addr: flow.remote_addr,
            local_port: flow.local_port,
            remote_port: flow.remote_port,
            proto: flow.proto,
            dir,
            _pad: [0; 2],
        }
    }
}

/// [`FlowMemo::tunnel`]: the packet went as it came (host-gw, DirectRouting).
pub const TUNNEL_NONE: u8 = 0;
/// [`FlowMemo::tunnel`]: the packet was decapsulated from ([`DIR_IN`]) or encapsulated in
/// ([`DIR_OUT`]) VXLAN.
pub const TUNNEL_VXLAN: u8 = 1;
/// [`FlowMemo::tunnel`]: the same through IPIP.
pub const TUNNEL_IPIP: u8 = 2;

/// [`MEMO4`]'s value: what was done with the flow's packet. 56 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowMemo {
    /// Where the packet went: the pod's veth port (`bpf_redirect_peer`, [`DIR_IN`]) or the
    /// external interface (`bpf_redirect`, [`DIR_OUT`]).
    pub ifindex: u32,
    /// The largest IP packet (each segment, for GSO packets) the decision holds for: the
    /// route's MTU (the bridge's, or the external interface's route to the peer), less the
    /// tunnel's overhead for packets encapsulated.
    pub mtu: u16,
    /// [`TUNNEL_NONE`], [`TUNNEL_VXLAN`] or [`TUNNEL_IPIP`].
    pub tunnel: u8,
    /// Explicit padding; always zero.
    pub _pad: u8,
    /// Source MAC written into the packet (the outer one, for packets encapsulated).
    pub smac: [u8; 6],
    /// Destination MAC written into the packet (the outer one, for packets encapsulated).
    pub dmac: [u8; 6],
    /// Through a tunnel: the peer's public IP (network order), the outer destination of the
    /// packets encapsulated, the outer source the packets decapsulated must come from. Sent
    /// host-gw ([`DIR_OUT`]): the peer the packets are routed via (see
    /// [`FlowMemo::hop_key`]).
    pub peer: [u8; 4],
    /// VXLAN, [`DIR_OUT`]: the peer's VNI (host order).
    pub vni: u32,
    /// VXLAN, [`DIR_OUT`]: the peer's VTEP MAC (inner destination).
    pub vtep_mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad2: [u8; 6],
    /// The [generation](MEMO_GEN) the checks were made at.
    pub generation: u64,
    /// When the checks were made, in kernel ticks (`bpf_jiffies64`, see
    /// [`crate::hops::HOP_TTL_TICKS`]).
    pub checked_at: u64,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for FlowMemo {}

const _: () = {
    assert!(core::mem::size_of::<MemoKey>() == 16);
    assert!(core::mem::size_of::<FlowMemo>() == 56);
};

/// [`MEMO6`]'s key: an IPv6 flow seen from this node, local side first (as
/// [`crate::v6::FlowKey6`]), and the direction. 40 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MemoKey6 {
    /// The local pod's address.
    pub local_addr: [u8; 16],
    /// The remote pod's address.
    pub remote_addr: [u8; 16],
    /// The local port (network order).
    pub local_port: [u8; 2],
    /// The remote port (network order).
    pub remote_port: [u8; 2],
    /// IP protocol (6 or 17).
    pub proto: u8,
    /// [`DIR_IN`] or [`DIR_OUT`].
    pub dir: u8,
    /// Explicit padding; always zero.
    pub _pad: [u8; 2],
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for MemoKey6 {}

impl MemoKey6 {
    /// The key of `flow` in direction `dir`.
    #[inline(always)]
    pub fn new(flow: &FlowKey6, dir: u8) -> MemoKey6 {
        MemoKey6 {
            local_addr: flow.local_addr,
            remote_addr: flow.remote_addr,
            local_port: flow.local_port,
            remote_port: flow.remote_port,
            proto: flow.proto,
            dir,
            _pad: [0; 2],
        }
    }
}

/// [`MEMO6`]'s value: [`FlowMemo`] with an IPv6 peer. 64 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowMemo6 {
    /// Where the packet went: the pod's veth port (`bpf_redirect_peer`, [`DIR_IN`]) or the
    /// external interface (`bpf_redirect`, [`DIR_OUT`]).
    pub ifindex: u32,
    /// The largest IPv6 packet (header included; each segment, for GSO packets) the decision
    /// holds for: the route's MTU, less the tunnel's overhead for packets encapsulated.
    pub mtu: u16,
    /// [`TUNNEL_NONE`] or [`TUNNEL_VXLAN`].
    pub tunnel: u8,
    /// Explicit padding; always zero.
    pub _pad: u8,
    /// Source MAC written into the packet (the outer one, for packets encapsulated).
    pub smac: [u8; 6],
    /// Destination MAC written into the packet (the outer one, for packets encapsulated).
    pub dmac: [u8; 6],
    /// Through a tunnel: the peer's public IPv6, the outer destination of the packets
    /// encapsulated, the outer source the packets decapsulated must come from.
    pub peer: [u8; 16],
    /// VXLAN, [`DIR_OUT`]: the peer's VNI (host order).
    pub vni: u32,
    /// VXLAN, [`DIR_OUT`]: the peer's VTEP MAC (inner destination).
    pub vtep_mac: [u8; 6],
    /// Explicit padding; always zero.
    pub _pad2: [u8; 2],
    /// The [generation](MEMO_GEN) the checks were made at.
    pub generation: u64,
    /// When the checks were made, in kernel ticks (`bpf_jiffies64`, see
    /// [`crate::hops::HOP_TTL_TICKS`]).
    pub checked_at: u64,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for FlowMemo6 {}

const _: () = {
    assert!(core::mem::size_of::<MemoKey6>() == 40);
    assert!(core::mem::size_of::<FlowMemo6>() == 64);
};

impl FlowMemo6 {
    /// [`FlowMemo::standing`] for an IPv6 packet of `len` bytes, header included.
    #[inline(always)]
    pub fn standing(&self, now: u64, generation: u64, len: u16) -> Standing {
        standing(
            (self.generation, self.checked_at, self.mtu),
            now,
            generation,
            len,
        )
    }

    /// [`FlowMemo::confirmed_by`] for IPv6, where `hop` is the answer of a route lookup made
    /// now (IPv6 has no remembered ones): for [`DIR_IN`] the local pod's route, for
    /// [`DIR_OUT`] the remote pod's or (VXLAN) the peer's.
    #[inline(always)]
    pub fn confirmed_by(&self, dir: u8, hop: &Hop, tunnel_mtu: u16) -> bool {
        let said = (self.ifindex, self.smac, self.dmac, self.mtu);
        confirms(dir, self.tunnel, said, hop, tunnel_mtu)
    }

    /// [`FlowMemo::came_through`] for an IPv6 peer.
    #[inline(always)]
    pub fn came_through(&self, tunnel: u8, peer: &[u8; 16]) -> bool {
        self.tunnel == tunnel && (tunnel == TUNNEL_NONE || self.peer == *peer)
    }
}

/// What a memo may do for a packet ([`FlowMemo::standing`], [`FlowMemo6::standing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Decide: made at the flow's current generation, at most [`crate::hops::HOP_TTL_TICKS`]
    /// old, and the packet
    /// fits its MTU.
    Usable,
    /// Decide once the route it came from confirms it ([`FlowMemo::confirmed_by`]): only its
    /// time is up (or its stamp is a moment ahead of this CPU's clock).
    Old,
    /// Nothing: retired (another generation), or the packet does not fit.
    Unusable,
}

/// The [`Standing`] of a memo stamped `(generation, checked_at, mtu)` for a packet of `len`
/// bytes at `now` and the flow's current generation `generation`.
#[inline(always)]
fn standing(memo: (u64, u64, u16), now: u64, generation: u64, len: u16) -> Standing {
    let (made_at, checked_at, mtu) = memo;
    if made_at != generation || len > mtu {
        Standing::Unusable
    } else if crate::hops::fresh_and_fits(checked_at, mtu, now, len) {
        Standing::Usable
    } else {
        Standing::Old
    }
}

/// A flow's generation: the sum of its [`LEARN_GEN`] slot's counter and the agent's.
#[inline(always)]
pub fn generation(learnt: u64, agent: u64) -> u64 {
    learnt.wrapping_add(agent)
}

impl FlowMemo {
    /// What this memo may do for a packet of IP length `tot_len` (each segment's, for a GSO
    /// packet) at `now` and generation `generation`.
    #[inline(always)]
    pub fn standing(&self, now: u64, generation: u64, tot_len: u16) -> Standing {
        standing(
            (self.generation, self.checked_at, self.mtu),
            now,
            generation,
            tot_len,
        )
    }

    /// Whether this memo of a [`DIR_IN`] flow was made for packets that come through `tunnel`
    /// (from `peer`, compared for tunnels only).
    #[inline(always)]
    pub fn came_through(&self, tunnel: u8, peer: [u8; 4]) -> bool {
        self.tunnel == tunnel && (tunnel == TUNNEL_NONE || self.peer == peer)
    }

    /// The remembered route lookup ([`crate::hops::HOPS4`]) this memo's MACs, MTU and (for
    /// [`DIR_OUT`]) interface came from, for a flow in direction `dir` whose packets go to
    /// `dst`: the local pod via 0.0.0.0 ([`DIR_IN`]), the remote pod via its peer (host-gw,
    /// [`DIR_OUT`]), or the peer via [`UNDERLAY_VIA`] (a tunnel, [`DIR_OUT`]).
    #[inline(always)]
    pub fn hop_key(&self, dir: u8, dst: [u8; 4]) -> HopKey {
        if dir == DIR_IN {
            HopKey { dst, via: [0; 4] }
        } else if self.tunnel == TUNNEL_NONE {
            HopKey {
                dst,
                via: self.peer,
            }
        } else {
            HopKey {
                dst: self.peer,
                via: UNDERLAY_VIA,
            }
        }
    }

    /// Whether `hop`, the remembered answer of [`FlowMemo::hop_key`], says what this memo of
    /// a flow in direction `dir` says: the same MACs, for [`DIR_OUT`] the same interface
    /// ([`DIR_IN`] memos hold the pod's port instead, which the agent's generation covers),
    /// and the same MTU: the route's, or for a tunnel `tunnel_mtu`, the largest inner packet
    /// the external interface takes now. A memo only too old to be used ([`Standing::Old`])
    /// and confirmed so by a fresh answer is as good as a new one stamped with that answer's
    /// time: its generation says that nothing else it rests on changed.
    #[inline(always)]
    pub fn confirmed_by(&self, dir: u8, hop: &Hop, tunnel_mtu: u16) -> bool {
        let said = (self.ifindex, self.smac, self.dmac, self.mtu);
        confirms(dir, self.tunnel, said, hop, tunnel_mtu)
    }
}

/// What a memo says of its route: the interface it sends to (for [`DIR_IN`] the pod's port),
/// the source and destination MACs and the MTU.
type RouteSaid = (u32, [u8; 6], [u8; 6], u16);

/// [`FlowMemo::confirmed_by`] for either family's memo, of a flow in direction `dir` through
/// `tunnel`, which says `said`.
#[inline(always)]
fn confirms(dir: u8, tunnel: u8, said: RouteSaid, hop: &Hop, tunnel_mtu: u16) -> bool {
    let (ifindex, smac, dmac, mtu) = said;
    let (want_ifindex, want_mtu) = if dir == DIR_IN {
        (ifindex, hop.mtu)
    } else if tunnel == TUNNEL_NONE {
        (hop.ifindex, hop.mtu)
    } else {
        (hop.ifindex, tunnel_mtu)
    };
    smac == hop.smac && dmac == hop.dmac && ifindex == want_ifindex && mtu == want_mtu
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hops::HOP_TTL_TICKS;

    #[test]
    fn a_memo_decides_only_at_its_generation_while_fresh_and_for_packets_that_fit() {
        let memo = FlowMemo {
            ifindex: 7,
            mtu: 1500,
            generation: generation(3, 4),
            checked_at: 10 * HOP_TTL_TICKS,
            ..FlowMemo::default()
        };
        let now = 10 * HOP_TTL_TICKS;
        assert_eq!(memo.standing(now, 7, 1500), Standing::Usable);
        assert_eq!(
            memo.standing(now + HOP_TTL_TICKS, 7, 100),
            Standing::Usable,
            "within its ticks"
        );
        assert_eq!(
            memo.standing(now, generation(4, 4), 100),
            Standing::Unusable,
            "a program learnt something"
        );
        assert_eq!(
            memo.standing(now, generation(3, 5), 100),
            Standing::Unusable,
            "the agent changed a map"
        );
        assert_eq!(
            memo.standing(now + HOP_TTL_TICKS + 1, 7, 100),
            Standing::Old,
            "stale: to be confirmed"
        );
        assert_eq!(
            memo.standing(now - 1, 7, 100),
            Standing::Old,
            "stamped later elsewhere"
        );
        assert_eq!(
            memo.standing(now, 7, 1501),
            Standing::Unusable,
            "longer than the MTU"
        );
        assert_eq!(generation(u64::MAX, 2), 1, "wraps");
    }

    #[test]
    fn a_memo_names_the_remembered_route_it_came_from_and_is_confirmed_only_by_the_same_answer() {
        const POD: [u8; 4] = [10, 244, 2, 3];
        const PEER: [u8; 4] = [192, 168, 1, 2];
        let hop = Hop {
            ifindex: 4,
            smac: [2, 0, 0, 0, 0, 1],
            dmac: [2, 0, 0, 0, 0, 2],
            mtu: 1500,
            checked_at: 5,
            ..Hop::default()
        };
        let key = |dst, via| HopKey { dst, via };
        // Host-gw: the remote pod via its peer; interface, MACs and MTU all the hop's.
        let host_gw = FlowMemo {
            ifindex: 4,
            mtu: 1500,
            smac: hop.smac,
            dmac: hop.dmac,
            peer: PEER,
            ..FlowMemo::default()
        };
        assert_eq!(host_gw.hop_key(DIR_OUT, POD), key(POD, PEER));
        assert!(host_gw.confirmed_by(DIR_OUT, &hop, 0));
        let moved = Hop {
            dmac: [2, 0, 0, 0, 0, 9],
            ..hop
        };
        assert!(!host_gw.confirmed_by(DIR_OUT, &moved, 0), "a new neighbour");
        let other_if = Hop { ifindex: 5, ..hop };
        assert!(
            !host_gw.confirmed_by(DIR_OUT, &other_if, 0),
            "another interface"
        );
        let smaller = Hop { mtu: 1400, ..hop };
        assert!(!host_gw.confirmed_by(DIR_OUT, &smaller, 0), "another MTU");

        // A tunnel: the peer's own route; the MTU is the device's room for the inner packet.
        let vxlan = FlowMemo {
            mtu: 1450,
            tunnel: TUNNEL_VXLAN,
            ..host_gw
        };
        assert_eq!(vxlan.hop_key(DIR_OUT, POD), key(PEER, UNDERLAY_VIA));
        assert!(vxlan.confirmed_by(DIR_OUT, &hop, 1450));
        assert!(
            !vxlan.confirmed_by(DIR_OUT, &hop, 1400),
            "the device's MTU changed"
        );
        assert!(!vxlan.confirmed_by(DIR_OUT, &moved, 1450));

        // Delivery: the local pod via 0.0.0.0; the memo holds the pod's port, not the bridge.
        let deliver = FlowMemo {
            ifindex: 31,
            tunnel: TUNNEL_VXLAN,
            ..host_gw
        };
        assert_eq!(deliver.hop_key(DIR_IN, POD), key(POD, [0; 4]));
        assert!(deliver.confirmed_by(DIR_IN, &hop, 0));
        assert!(
            !deliver.confirmed_by(DIR_IN, &moved, 0),
            "the pod's MAC changed"
        );
        assert!(!deliver.confirmed_by(DIR_IN, &smaller, 0));
    }

    #[test]
    fn the_flow_table_keys_of_a_flow_name_the_slot_of_its_remote_endpoint() {
        use crate::{flow::PeerKey, v6::PeerKey6};
        let flow = FlowKey {
            local_addr: [10, 244, 1, 2],
            remote_addr: [10, 244, 2, 3],
            local_port: 40000u16.to_be_bytes(),
            remote_port: 80u16.to_be_bytes(),
            proto: 6,
            _pad: [0; 3],
        };
        // (The memos' slot, computed from the packet, is checked against these keys in
        // flannel-ebpf's `a_flows_memo_and_its_flow_table_keys_share_a_learn_slot`.)
        let slot = flow.learn_slot();
        assert!(slot < LEARN_GEN_SLOTS);
        let peer = PeerKey {
            addr: flow.remote_addr,
            port: flow.remote_port,
            proto: flow.proto,
            _pad: 0,
        };
        assert_eq!(
            peer.learn_slot(),
            slot,
            "the NAT guard of the remote endpoint"
        );
        let other_local = FlowKey {
            local_addr: [10, 244, 1, 9],
            local_port: 41000u16.to_be_bytes(),
            ..flow
        };
        assert_eq!(
            other_local.learn_slot(),
            slot,
            "only the remote side counts"
        );

        let mut addr6 = [0u8; 16];
        addr6[..4].copy_from_slice(&[0xfd, 0, 2, 0x44]);
        addr6[15] = 3;
        let flow6 = FlowKey6 {
            remote_addr: addr6,
            remote_port: 80u16.to_be_bytes(),
            proto: 6,
            ..FlowKey6::default()
        };
        let peer6 = PeerKey6 {
            addr: addr6,
            port: flow6.remote_port,
            proto: 6,
            _pad: 0,
        };
        assert_eq!(peer6.learn_slot(), flow6.learn_slot());
        assert!(flow6.learn_slot() < LEARN_GEN_SLOTS);
    }

    #[test]
    fn remote_endpoints_spread_over_the_slots() {
        // 4096 remote endpoints of one service (addresses of a /20, one port): a learnt entry
        // must retire a small share of the memos, so the endpoints must not pile up in a few
        // slots.
        let mut used = vec![0u32; LEARN_GEN_SLOTS as usize];
        for i in 0..4096u32 {
            let [_, _, hi, lo] = i.to_be_bytes();
            used[learn_slot([10, 244, hi, lo], 53u16.to_be_bytes(), 17) as usize] += 1;
        }
        let busiest = used.iter().copied().max().unwrap_or(0);
        let empty = used.iter().filter(|&&n| n == 0).count();
        assert!(busiest <= 8, "busiest slot holds {busiest} endpoints");
        assert!(empty < 2048, "{empty} of 4096 slots unused");
        // Ports of one address spread too (DNS queries from one pod to one server differ
        // only in the pod's port, which is the local side; the remote port varies for
        // clients talking to many servers' ephemeral ports).
        let mut used = vec![0u32; LEARN_GEN_SLOTS as usize];
        for port in 30000..34096u16 {
            used[learn_slot([10, 244, 2, 3], port.to_be_bytes(), 6) as usize] += 1;
        }
        assert!(used.iter().copied().max().unwrap_or(0) <= 8);
    }

    #[test]
    fn a_delivery_memo_holds_for_packets_that_came_the_same_way() {
        let peer = [192, 168, 1, 12];
        let plain = FlowMemo::default();
        assert!(plain.came_through(TUNNEL_NONE, [0; 4]));
        assert!(
            plain.came_through(TUNNEL_NONE, peer),
            "no tunnel: the peer is not compared"
        );
        assert!(
            !plain.came_through(TUNNEL_VXLAN, peer),
            "a plain flow's memo is not a VXLAN one"
        );
        let vxlan = FlowMemo {
            tunnel: TUNNEL_VXLAN,
            peer,
            ..FlowMemo::default()
        };
        assert!(vxlan.came_through(TUNNEL_VXLAN, peer));
        assert!(
            !vxlan.came_through(TUNNEL_VXLAN, [192, 168, 1, 13]),
            "from another node"
        );
        assert!(
            !vxlan.came_through(TUNNEL_NONE, peer),
            "the same flow, not tunnelled"
        );
    }

    #[test]
    fn an_ipv6_memo_follows_the_same_rules() {
        let peer = [0xfd, 0, 0, 0x77, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
        let memo = FlowMemo6 {
            mtu: 1500,
            tunnel: TUNNEL_VXLAN,
            peer,
            generation: 9,
            checked_at: 10 * HOP_TTL_TICKS,
            ..FlowMemo6::default()
        };
        let now = 10 * HOP_TTL_TICKS;
        assert_eq!(memo.standing(now, 9, 1500), Standing::Usable);
        assert_eq!(
            memo.standing(now, 10, 100),
            Standing::Unusable,
            "another generation"
        );
        assert_eq!(
            memo.standing(now + HOP_TTL_TICKS + 1, 9, 100),
            Standing::Old,
            "stale"
        );
        assert_eq!(
            memo.standing(now, 9, 1501),
            Standing::Unusable,
            "longer than the MTU"
        );
        assert!(memo.came_through(TUNNEL_VXLAN, &peer));
        let mut other = peer;
        other[15] = 3;
        assert!(
            !memo.came_through(TUNNEL_VXLAN, &other),
            "from another node"
        );
        assert!(!memo.came_through(TUNNEL_NONE, &peer), "not tunnelled");
        let flow = FlowKey6 {
            local_addr: [1; 16],
            remote_addr: [2; 16],
            local_port: [0, 80],
            remote_port: [0x9c, 0x40],
            proto: 17,
            _pad: [0; 3],
        };
        let (a, b) = (MemoKey6::new(&flow, DIR_IN), MemoKey6::new(&flow, DIR_OUT));
        assert_ne!(a, b);
        assert_eq!(
            (a.local_addr, a.remote_port, a.proto),
            ([1; 16], [0x9c, 0x40], 17)
        );
    }

    #[test]
    fn both_directions_of_a_flow_have_their_own_key() {
        let flow = FlowKey {
            local_addr: [10, 244, 1, 2],
            remote_addr: [10, 244, 2, 3],
            local_port: [0x9c, 0x40],
            remote_port: [0, 80],
            proto: 6,
            _pad: [0; 3],
        };
        let (a, b) = (MemoKey::new(&flow, DIR_IN), MemoKey::new(&flow, DIR_OUT));
        assert_ne!(a, b);
        assert_eq!(
            (a.local_addr, a.remote_port, a.proto),
            ([10, 244, 1, 2], [0, 80], 6)
        );
    }
}
