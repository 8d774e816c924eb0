//! Masquerade in eBPF: source NAT of pod traffic leaving the cluster network, in
//! `tc_to_netdev` (TC egress of the external interface), and the translation of the replies
//! back, in `tc_from_netdev` (TC ingress).
//!
//! # Where it runs, and what netfilter still does
//!
//! A pod's packet to the outside is routed by the kernel (`tc_from_bridge` passes it: there
//! is no remote subnet for it), so it crosses netfilter (PREROUTING, FORWARD, POSTROUTING)
//! before it meets `tc_to_netdev` on the external interface. With eBPF masquerade on, the
//! traffic manager installs upstream's `FLANNEL-POSTRTG` chain with extra `RETURN` rules for
//! what this module translates (TCP, UDP, ICMP echo from the pod network to outside the
//! cluster network through the external interface), so the kernel does not NAT it too.
//! Kernel conntrack still tracks the flow, un-NATed: the replies are translated back here,
//! on ingress, *before* conntrack sees them, so conntrack sees both directions of the pod's
//! own tuple and stays consistent (and kube-proxy's DNAT of a Service address, done in
//! PREROUTING, is undone on the reply as usual). Everything else stays with netfilter: other
//! protocols and ICMP types (MASQUERADE still matches them), kube-proxy's marked traffic
//! (upstream's rule 1; kube-proxy masquerades it, so it arrives here with the node's source),
//! traffic *into* the cluster network (rules 2 to 4 and 6), and pod traffic leaving through
//! another interface.
//!
//! The decision itself is [`flannel_common::nat::egress_kind`]: source in the cluster
//! network, destination outside it, not multicast, not kube-proxy-marked, not in a
//! no-masquerade prefix ([`crate::maps::FLANNEL_NOMASQ4`]). hostNetwork pods and the node
//! itself have the node's address as source and are not masqueraded; traffic to the node's own
//! addresses never leaves through the external interface; the fast path's own VXLAN/IPIP
//! packets carry `FASTPATH_MARK` and are skipped before this module runs; the kernel's
//! `flannel.<VNI>` packets have the node's address as source.
//!
//! # Ports, and the node's own connections
//!
//! The allocator keeps the flow's original source port when it lies in the configured range
//! and is free for (masquerade address, protocol, destination address, destination port),
//! otherwise it walks the range from a random start for a bounded number of probes
//! ([`flannel_common::nat::NatConfig::probes`]). A port is claimed by inserting the reply
//! entry with `BPF_NOEXIST`, so two CPUs can never both take it (the kernel's
//! non-`--random-fully` MASQUERADE has exactly that race, the conntrack insert clash behind
//! the "5-second DNS delay"). A claim is reclaimed only from a flow that is gone, expired, or
//! points elsewhere, and never within a second of being made (a claim in progress on
//! another CPU has no outgoing entry yet). No free port: the packet is dropped and counted
//! (`drop_snat_exhausted`), never sent with the pod's address.
//!
//! The default range is the node's `ip_local_port_range`, the range pods pick their own
//! ports from, so the original port is usually kept. The node's own sockets pick from the same
//! range and cannot see this module's allocations, so the node's own flows from the
//! masquerade address with a port in the range are *registered* here as well (the same entries
//! with `NAT_F_HOST`, translated to themselves): a pod flow never takes a port a node flow
//! uses, and a node flow whose port a pod flow already holds (it was chosen by the kernel
//! without knowing) is itself moved to another port, as conntrack's NAT would do. Only a
//! node's *reply* (a TCP segment that is not a SYN: an inbound connection to a listening port
//! inside the range) cannot be moved; it is passed and counted (`pass_snat_unhandled`).
//! Flows the kernel masqueraded before eBPF took over arrive with the node's address and are
//! registered the same way, so they keep working.
//!
//! # Handing back to the kernel
//!
//! When eBPF masquerade is switched off while pod flows it translates are live, the agent
//! sets [`flannel_common::nat::NAT_CFG_HANDOVER`] instead of turning the NAT off: live
//! entries go on being translated both ways (their conntrack entries were made while the
//! RETURN rules were in place and carry no NAT binding, so the kernel does not NAT them now),
//! a pod packet without a live entry is passed unchanged (`pass_snat_no_entry`: the kernel's
//! MASQUERADE handles new flows, so this is only a flow netfilter chose not to masquerade),
//! and the kernel's masqueraded flows are registered as node flows but never moved. The agent
//! turns the NAT off once no pod flow (and no moved node flow) is left.
//!
//! # Connection tracking
//!
//! Each flow's outgoing entry keeps TCP flags seen (SYN restarts a closed flow, FIN each way,
//! RST) and UDP/ICMP "replied", plus the last-seen time; [`flannel_common::nat::NatConfig`]
//! holds conntrack-like idle timeouts per state. A lookup that finds an expired entry treats
//! it as absent; a TCP flow with FINs both ways or a RST expires after the short closing
//! timeout, so closed connections free their ports; the agent sweeps expired entries; the
//! LRU evicts the least recently used flows when the maps are full. A pure SYN from the
//! outside is never a reply and is never translated.
//!
//! A reply costs one map lookup, not two, when it changes nothing (an ACK of an established
//! upload, a response on a replied UDP flow) and the flow was checked in the last half second:
//! the reverse entry keeps the state and time of the flow's last check
//! ([`flannel_common::nat::NatRevEntry::vouches_for`]); every other reply reads and updates the
//! outgoing entry and stamps the reverse one again.
//!
//! # What is translated
//!
//! TCP and UDP ports, ICMP echo identifiers, with the L4 checksum kept right by
//! `bpf_l4_csum_replace` (which understands `CHECKSUM_PARTIAL` packets: GSO, offloaded
//! transmit) and the IPv4 header checksum updated in place (RFC 1624; it is never
//! offloaded); UDP without checksum stays without.
//! ICMP errors about a masqueraded flow (fragmentation needed, unreachable, time exceeded)
//! are translated in both directions together with the header they quote (and its checksums)
//! so path MTU discovery and error reporting work. Fragments: the first carries the ports and
//! is translated as a whole packet; later ones only need the address, which on the way out is
//! the masquerade address and on the way in is learnt from the first fragment
//! ([`crate::maps::FLANNEL_NATFRG4`]); a later fragment that arrives before the first is
//! passed unchanged (the kernel then fails to reassemble it).

use aya_ebpf::{
    bindings::{
        BPF_ANY, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT,
    },
    helpers::bpf_get_prandom_u32,
    programs::TcContext,
};
use flannel_common::{
    config::Config,
    csum,
    nat::{
        self, Egress, FragEntry, FragKey, NAT_F_HOST, NAT_MAX_PROBES, NS_PER_S, NatConfig,
        NatEntry, NatKey, NatRevEntry, proto, tcp_flags,
    },
    stats::Reason,
};

use crate::{
    maps::{self, FLANNEL_NAT4, FLANNEL_NATFRG4, FLANNEL_NATREV4},
    now_ns,
    parse::{ETH_HDR_LEN, ETH_P_IP, PacketCtx as _, ptr_at, ptr_at_mut},
};

/// `EEXIST`, as `bpf_map_update_elem` returns it (negated).
const EEXIST: i64 = 17;

/// IPv4 header offsets.
const IP_ID: usize = 4;
const IP_FRAG: usize = 6;
const IP_CHECK: usize = 10;
const IP_SRC: usize = 12;
const IP_DST: usize = 16;

/// "More fragments" and the offset mask of the IPv4 flags/offset field.
const IP_MF: u16 = 0x2000;
const IP_OFFSET: u16 = 0x1fff;

/// ICMP types.
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;

/// What a NAT step decided: the TC action, the verdict and up to two events to count.
#[derive(Clone, Copy)]
pub struct NatOutcome {
    /// TC action.
    pub action: i32,
    /// Verdict reason.
    pub verdict: Reason,
    /// Events counted on top of the verdict.
    pub events: [Option<Reason>; 2],
}

impl NatOutcome {
    #[inline(always)]
    fn pass(verdict: Reason) -> Self {
        NatOutcome {
            action: TC_ACT_OK,
            verdict,
            events: [None, None],
        }
    }

    #[inline(always)]
    fn drop(verdict: Reason) -> Self {
        NatOutcome {
            action: TC_ACT_SHOT,
            verdict,
            events: [None, None],
        }
    }
}

/// A NAT step's outcome and the packet's class (classified afresh at the end: the NAT runs
/// before the programs' own parser, see [`egress`]).
#[derive(Clone, Copy)]
pub struct Counted {
    /// The packet's class for the counters.
    pub class: Reason,
    /// The outcome.
    pub outcome: NatOutcome,
}

#[inline(always)]
fn counted(ctx: &TcContext, outcome: NatOutcome) -> Counted {
    Counted {
        class: crate::parse::classify(ctx),
        outcome,
    }
}

/// Where a packet sits in its datagram.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Frag {
    /// Not fragmented.
    Whole,
    /// The first fragment (offset 0, more to come): carries the L4 header.
    First,
    /// A later fragment: no L4 header.
    Later,
}

/// The IPv4 fields the NAT needs.
#[derive(Clone, Copy)]
struct Ip {
    l3: usize,
    l4: usize,
    end: usize,
    src: [u8; 4],
    dst: [u8; 4],
    proto: u8,
    id: u16,
    frag: Frag,
}

/// What the L4 header is, for the NAT.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Tcp,
    Udp,
    EchoRequest,
    EchoReply,
    IcmpError,
    Other,
}

/// The L4 fields the NAT needs: ports (ICMP echo: the identifier in `sport` for a request,
/// in `dport` for a reply), TCP flags.
#[derive(Clone, Copy)]
struct L4 {
    kind: Kind,
    sport: u16,
    dport: u16,
    flags: u8,
}

/// Reads the IPv4 header of the packet (Ethernet + IPv4, options allowed), or `None` for
/// anything else or anything malformed (the programs' parser then counts it).
///
/// The NAT has its own small reader, run before the programs' parser: the programs' many
/// parser paths would otherwise each carry their packet offsets into the port allocator's
/// loop, and the verifier would walk the loop once per path (it does not fit the
/// one-million-instruction budget that way).
#[inline(always)]
fn read_ip(ctx: &TcContext) -> Option<Ip> {
    let eth = ptr_at::<TcContext, [u8; 2]>(ctx, 12)?;
    // SAFETY: ptr_at checked that the 2 bytes are readable.
    if u16::from_be_bytes(unsafe { eth.read_unaligned() }) != ETH_P_IP {
        return None;
    }
    let l3 = ETH_HDR_LEN;
    let ptr = ptr_at::<TcContext, [u8; 20]>(ctx, l3)?;
    // SAFETY: ptr_at checked that the 20 bytes are readable.
    let hdr = unsafe { ptr.read_unaligned() };
    if hdr[0] >> 4 != 4 {
        return None;
    }
    let hdr_len = usize::from(hdr[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([hdr[2], hdr[3]]));
    if hdr_len < 20 || total < hdr_len || l3 + total > ctx.packet_len() {
        return None;
    }
    let frags = u16::from_be_bytes([hdr[IP_FRAG], hdr[IP_FRAG + 1]]);
    let frag = if frags & IP_OFFSET != 0 {
        Frag::Later
    } else if frags & IP_MF != 0 {
        Frag::First
    } else {
        Frag::Whole
    };
    Some(Ip {
        l3,
        l4: l3 + hdr_len,
        end: l3 + total,
        src: [hdr[IP_SRC], hdr[13], hdr[14], hdr[15]],
        dst: [hdr[IP_DST], hdr[17], hdr[18], hdr[19]],
        proto: hdr[9],
        id: u16::from_be_bytes([hdr[IP_ID], hdr[IP_ID + 1]]),
        frag,
    })
}

/// Reads the L4 header of a whole packet or first fragment (checked against the datagram's
/// end: the parser does not look into fragments).
#[inline(always)]
fn read_l4(ctx: &TcContext, ip: &Ip) -> L4 {
    let other = L4 {
        kind: Kind::Other,
        sport: 0,
        dport: 0,
        flags: 0,
    };
    match ip.proto {
        proto::TCP => {
            if ip.l4 + 20 > ip.end {
                return other;
            }
            let Some(p) = ptr_at::<TcContext, [u8; 20]>(ctx, ip.l4) else {
                return other;
            };
            // SAFETY: ptr_at checked the bytes are readable.
            let h = unsafe { p.read_unaligned() };
            L4 {
                kind: Kind::Tcp,
                sport: u16::from_be_bytes([h[0], h[1]]),
                dport: u16::from_be_bytes([h[2], h[3]]),
                flags: h[13],
            }
        }
        proto::UDP | proto::ICMP => {
            if ip.l4 + 8 > ip.end {
                return other;
            }
            let Some(p) = ptr_at::<TcContext, [u8; 8]>(ctx, ip.l4) else {
                return other;
            };
            // SAFETY: as above.
            let h = unsafe { p.read_unaligned() };
            if ip.proto == proto::UDP {
                return L4 {
                    kind: Kind::Udp,
                    sport: u16::from_be_bytes([h[0], h[1]]),
                    dport: u16::from_be_bytes([h[2], h[3]]),
                    flags: 0,
                };
            }
            let id = u16::from_be_bytes([h[4], h[5]]);
            match h[0] {
                ICMP_ECHO_REQUEST => L4 {
                    kind: Kind::EchoRequest,
                    sport: id,
                    dport: 0,
                    flags: 0,
                },
                ICMP_ECHO_REPLY => L4 {
                    kind: Kind::EchoReply,
                    sport: 0,
                    dport: id,
                    flags: 0,
                },
                // Destination unreachable, source quench, redirect, time exceeded, parameter
                // problem: the messages that quote a packet (the kernel's icmp_is_err).
                3 | 4 | 5 | 11 | 12 if ip.frag == Frag::Whole => L4 {
                    kind: Kind::IcmpError,
                    sport: 0,
                    dport: 0,
                    flags: 0,
                },
                _ => other,
            }
        }
        _ => other,
    }
}

/// The network-order value of a port as the checksum helpers take it.
#[inline(always)]
fn be16(v: u16) -> u64 {
    u64::from(u16::from_ne_bytes(v.to_be_bytes()))
}

/// The network-order value of an address as the checksum helpers take it.
#[inline(always)]
fn be32(a: [u8; 4]) -> u64 {
    u64::from(u32::from_ne_bytes(a))
}

// ---------------------------------------------------------------------------------------------
// Egress

/// `tc_to_netdev`, right after the configuration check and before the program's own parser:
/// masquerades the packet if it is a NAT matter; `None` lets the program go on (the packet is
/// none of the NAT's business).
#[inline(always)]
pub fn egress(ctx: &TcContext, cfg: &Config) -> Option<Counted> {
    let nat = maps::nat_config()?;
    let ip = read_ip(ctx)?;
    // SAFETY: reading a field of the __sk_buff the kernel passed.
    let mark = unsafe { (*ctx.skb.skb).mark };
    let outcome = match nat::egress_kind(cfg, nat, ip.src, ip.dst, mark, maps::no_masq) {
        Egress::Skip => return None,
        Egress::Excluded => NatOutcome::pass(Reason::PassSnatExcluded),
        Egress::Masquerade => masquerade(ctx, nat, &ip),
        Egress::Host => host(ctx, cfg, nat, &ip)?,
    };
    Some(counted(ctx, outcome))
}

/// A pod's packet to the outside.
#[inline(always)]
fn masquerade(ctx: &TcContext, nat: &NatConfig, ip: &Ip) -> NatOutcome {
    if ip.frag == Frag::Later {
        // No ports in here; the address is the masquerade address for every flow.
        return match rewrite_addr(ctx, ip.l3 + IP_SRC, ip.l3, ip.src, nat.nat_addr) {
            Some(()) => NatOutcome::pass(Reason::FastSnatFragment),
            None => NatOutcome::drop(Reason::DropRewriteFailed),
        };
    }
    let l4 = read_l4(ctx, ip);
    match l4.kind {
        Kind::Tcp | Kind::Udp | Kind::EchoRequest => {
            translate_out(ctx, nat, &Want::new(ip, &l4, 0, true))
        }
        Kind::IcmpError => icmp_error_out(ctx, nat, ip),
        Kind::EchoReply | Kind::Other => NatOutcome::pass(Reason::PassSnatUnhandled),
    }
}

/// A packet of the node itself from the masquerade address: registered so that pod flows
/// never take its port (moved only if an earlier flow holds it and it is a new flow; never
/// during a handover, where these are the flows the kernel masquerades).
#[inline(always)]
fn host(ctx: &TcContext, cfg: &Config, nat: &NatConfig, ip: &Ip) -> Option<NatOutcome> {
    if ip.frag == Frag::Later {
        return None;
    }
    let l4 = read_l4(ctx, ip);
    let may_move = match l4.kind {
        Kind::Tcp => l4.flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN,
        Kind::Udp | Kind::EchoRequest => true,
        _ => return None,
    } && !nat.handover();
    let ranged = matches!(l4.kind, Kind::Tcp | Kind::Udp);
    if ranged && !nat.port_in_range(l4.sport) {
        return None;
    }
    if l4.kind == Kind::Udp && l4.dport == cfg.vxlan_port {
        // flannel.<VNI>'s own VXLAN: the peer answers on the VXLAN port, never on this one.
        return None;
    }
    Some(translate_out(
        ctx,
        nat,
        &Want::new(ip, &l4, NAT_F_HOST, may_move),
    ))
}

/// What the allocator needs to know about a flow: nothing of the packet's layout.
#[derive(Clone, Copy)]
struct Want {
    key: NatKey,
    flags: u8,
    may_move: bool,
    tcp_flags: u8,
}

impl Want {
    #[inline(always)]
    fn new(ip: &Ip, l4: &L4, flags: u8, may_move: bool) -> Self {
        Want {
            key: NatKey::new(ip.src, ip.dst, l4.sport, l4.dport, ip.proto),
            flags,
            may_move,
            tcp_flags: l4.flags,
        }
    }

    /// The flow's state after this packet went out (`state` before).
    #[inline(always)]
    fn state_after(&self, state: u8) -> u8 {
        if self.key.proto == proto::TCP {
            nat::tcp_next(state, self.tcp_flags, true)
        } else {
            state
        }
    }
}

/// Why no port could be had.
enum AllocError {
    /// Every probed port is taken.
    Exhausted,
    /// A map update failed.
    Map,
}

/// Looks the flow up (or maps it), then re-reads the packet and rewrites the source.
#[inline(always)]
fn translate_out(ctx: &TcContext, nat: &NatConfig, want: &Want) -> NatOutcome {
    let (port, events) = match resolve(nat, want) {
        Ok(found) => found,
        Err(outcome) => return outcome,
    };
    if nat.nat_addr == want.key.saddr && port == want.key.sport {
        return NatOutcome {
            action: TC_ACT_OK,
            verdict: Reason::PassSnatHost,
            events,
        };
    }
    // Nothing about the packet's layout is kept across the allocation (see `read_ip`).
    let Some(ip) = read_ip(ctx) else {
        return NatOutcome::drop(Reason::DropRewriteFailed);
    };
    let l4 = read_l4(ctx, &ip);
    match rewrite_source(ctx, &ip, &l4, nat.nat_addr, port) {
        Some(()) => NatOutcome {
            action: TC_ACT_OK,
            verdict: Reason::FastSnat,
            events,
        },
        None => NatOutcome::drop(Reason::DropRewriteFailed),
    }
}

/// The flow's translated port: its live mapping (state and last-seen time updated), or a new
/// one. On failure, the outcome to return.
#[inline(always)]
fn resolve(nat: &NatConfig, want: &Want) -> Result<(u16, [Option<Reason>; 2]), NatOutcome> {
    let now = now_ns();
    let key = &want.key;
    let host = want.flags & NAT_F_HOST != 0;
    let mut first = key.sport;
    if let Some(entry) = FLANNEL_NAT4.get_ptr_mut(key) {
        // SAFETY: the pointer comes from a successful lookup; the value is plain data.
        let e = unsafe { entry.read() };
        let state = want.state_after(e.state);
        let restarted = key.proto == proto::TCP && state == 0 && nat::tcp_closed(e.state);
        if e.nat_addr == nat.nat_addr {
            first = e.nat_port;
            let live = restarted || !nat.expired(key.proto, e.state, e.last_seen_ns, now);
            // A live entry is refreshed when its state changes and at least every half second;
            // the reply entry is checked (and re-made if the LRU evicted it) at those times
            // only, not for every packet of a busy flow.
            let refresh = state != e.state || now.wrapping_sub(e.last_seen_ns) > NS_PER_S / 2;
            if live && !refresh {
                return Ok((e.nat_port, [None, None]));
            }
            if live && reverse_holds(key, &e, state, now) {
                // SAFETY: as above; a racing writer can only store another valid value.
                unsafe {
                    (*entry).state = state;
                    (*entry).last_seen_ns = now;
                }
                return Ok((e.nat_port, [None, None]));
            }
        }
    }
    if !host && nat.handover() {
        // Handing over to the kernel: new pod flows are its business.
        return Err(NatOutcome::pass(Reason::PassSnatNoEntry));
    }
    let rev = NatRevEntry {
        orig_addr: key.saddr,
        orig_port: key.sport,
        flags: want.flags,
        state: want.state_after(0),
        checked_ns: now,
    };
    let port = match allocate(nat, key, &rev, first, now, want.may_move) {
        Ok(port) => port,
        Err(_) if host => return Err(NatOutcome::pass(Reason::PassSnatUnhandled)),
        Err(AllocError::Exhausted) => return Err(NatOutcome::drop(Reason::DropSnatExhausted)),
        Err(AllocError::Map) => return Err(NatOutcome::drop(Reason::DropSnatMapError)),
    };
    let entry = NatEntry {
        nat_addr: nat.nat_addr,
        nat_port: port,
        state: want.state_after(0),
        flags: want.flags,
        created_ns: now,
        last_seen_ns: now,
    };
    if FLANNEL_NAT4.insert(key, entry, u64::from(BPF_ANY)).is_err() {
        let _ = FLANNEL_NATREV4.remove(key.reply_of(nat.nat_addr, port));
        return Err(if host {
            NatOutcome::pass(Reason::PassSnatUnhandled)
        } else {
            NatOutcome::drop(Reason::DropSnatMapError)
        });
    }
    let remap = (port != key.sport).then_some(Reason::LearnSnatRemap);
    Ok((port, [Some(Reason::LearnSnatFlow), remap]))
}

/// Whether the reply entry of a live outgoing entry still points back at it, stamping it with
/// the flow's new `state` (re-creating it if the LRU evicted it and the port is still free).
#[inline(always)]
fn reverse_holds(key: &NatKey, e: &NatEntry, state: u8, now: u64) -> bool {
    let rkey = key.reply_of(e.nat_addr, e.nat_port);
    match FLANNEL_NATREV4.get_ptr_mut(rkey) {
        Some(ptr) => {
            // SAFETY: the pointer comes from a successful lookup.
            let r = unsafe { ptr.read() };
            let ours = r.orig_addr == key.saddr && r.orig_port == key.sport;
            if ours {
                // SAFETY: as above; a racing writer can only store another valid value.
                unsafe {
                    (*ptr).state = state;
                    (*ptr).checked_ns = now;
                }
            }
            ours
        }
        None => {
            let rev = NatRevEntry {
                orig_addr: key.saddr,
                orig_port: key.sport,
                flags: e.flags,
                state,
                checked_ns: now,
            };
            FLANNEL_NATREV4
                .insert(rkey, rev, u64::from(BPF_NOEXIST))
                .is_ok()
        }
    }
}

/// Claims a port for the flow `key`: `first` (the original port, or the port the flow had)
/// if it is in range and free, then up to `probes` others from a random start.
#[inline(always)]
fn allocate(
    nat: &NatConfig,
    key: &NatKey,
    rev: &NatRevEntry,
    first: u16,
    now: u64,
    may_move: bool,
) -> Result<u16, AllocError> {
    // SAFETY: plain helper call.
    let random = unsafe { bpf_get_prandom_u32() };
    let probes = if !may_move {
        0
    } else if nat.probes < NAT_MAX_PROBES {
        nat.probes
    } else {
        NAT_MAX_PROBES
    };
    let mut attempt = 0u32;
    while attempt <= NAT_MAX_PROBES {
        if attempt > probes {
            break;
        }
        let port = nat.candidate(key.proto, first, random, attempt);
        let rkey = key.reply_of(nat.nat_addr, port);
        match claim(nat, &rkey, rev, now) {
            Claim::Ours => return Ok(port),
            Claim::Taken => {}
            Claim::Error => return Err(AllocError::Map),
        }
        attempt += 1;
    }
    Err(AllocError::Exhausted)
}

/// The outcome of trying to claim one reply tuple.
enum Claim {
    Ours,
    Taken,
    Error,
}

/// Claims the reply tuple `rkey` for the flow `rev` describes.
///
/// A BPF subprogram of its own, called once per probe: its paths (taken, stale, reclaimed)
/// leave their values in its own frame, which ends with the call, so the states that reach
/// the next probe differ in the outcome only and the verifier prunes them. Inlined into the
/// loop, `tc_to_netdev` took 586k verifier instructions (0.5 s to load here); this way 228k
/// (test `programs_load_with_room_under_the_verifier_limit`).
#[inline(never)]
fn claim(nat: &NatConfig, rkey: &NatKey, rev: &NatRevEntry, now: u64) -> Claim {
    match FLANNEL_NATREV4.insert(rkey, rev, u64::from(BPF_NOEXIST)) {
        Ok(()) => return Claim::Ours,
        Err(e) if i64::from(e) != -EEXIST => return Claim::Error,
        Err(_) => {}
    }
    let Some(ptr) = FLANNEL_NATREV4.get_ptr_mut(rkey) else {
        return Claim::Taken;
    };
    // SAFETY: the pointer comes from a successful lookup.
    let cur = unsafe { ptr.read() };
    if cur.orig_addr == rev.orig_addr && cur.orig_port == rev.orig_port {
        // Ours already (our outgoing entry expired or was evicted): what it says about the
        // flow is the old flow's.
        // SAFETY: as above; a racing writer can only store another valid value.
        unsafe {
            (*ptr).state = rev.state;
            (*ptr).checked_ns = now;
        }
        return Claim::Ours;
    }
    if !stale(nat, rkey, &cur, now) {
        return Claim::Taken;
    }
    let _ = FLANNEL_NATREV4.remove(rkey);
    match FLANNEL_NATREV4.insert(rkey, rev, u64::from(BPF_NOEXIST)) {
        Ok(()) => Claim::Ours,
        Err(_) => Claim::Taken,
    }
}

/// Whether the claim `cur` on `rkey` belongs to no live flow: its outgoing entry is gone
/// (and the claim was made or last found live more than a second ago: younger ones may be in
/// progress on another CPU), points elsewhere, or expired.
#[inline(always)]
fn stale(nat: &NatConfig, rkey: &NatKey, cur: &NatRevEntry, now: u64) -> bool {
    let owner = rkey.original_of(cur.orig_addr, cur.orig_port);
    match FLANNEL_NAT4.get_ptr(owner) {
        None => now.saturating_sub(cur.checked_ns) > NS_PER_S,
        Some(e) => {
            // SAFETY: the pointer comes from a successful lookup.
            let e = unsafe { e.read() };
            e.nat_addr != rkey.daddr
                || e.nat_port != rkey.dport
                || nat.expired(rkey.proto, e.state, e.last_seen_ns, now)
        }
    }
}

/// Rewrites the source address and port (ICMP: identifier) with their checksums.
#[inline(always)]
fn rewrite_source(ctx: &TcContext, ip: &Ip, l4: &L4, addr: [u8; 4], port: u16) -> Option<()> {
    rewrite_l4(
        ctx,
        ip,
        l4.kind,
        ip.src,
        addr,
        l4.sport,
        port,
        L4Side::Source,
    )?;
    rewrite_addr(ctx, ip.l3 + IP_SRC, ip.l3, ip.src, addr)
}

/// Rewrites the destination address and port (ICMP: identifier) with their checksums.
#[inline(always)]
fn rewrite_destination(ctx: &TcContext, ip: &Ip, l4: &L4, addr: [u8; 4], port: u16) -> Option<()> {
    rewrite_l4(
        ctx,
        ip,
        l4.kind,
        ip.dst,
        addr,
        l4.dport,
        port,
        L4Side::Destination,
    )?;
    rewrite_addr(ctx, ip.l3 + IP_DST, ip.l3, ip.dst, addr)
}

/// Which end of the L4 header changes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum L4Side {
    Source,
    Destination,
}

/// The L4 part of a rewrite: the checksum (pseudo-header address change for TCP and UDP, the
/// port or identifier change) and the new port or identifier.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn rewrite_l4(
    ctx: &TcContext,
    ip: &Ip,
    kind: Kind,
    old_addr: [u8; 4],
    new_addr: [u8; 4],
    old_port: u16,
    new_port: u16,
    side: L4Side,
) -> Option<()> {
    let (check, port_at, extra) = match kind {
        Kind::Tcp => (ip.l4 + 16, if side == L4Side::Source { 0 } else { 2 }, 0),
        Kind::Udp => (
            ip.l4 + 6,
            if side == L4Side::Source { 0 } else { 2 },
            BPF_F_MARK_MANGLED_0,
        ),
        // The identifier is at 4 either way; ICMP has no pseudo-header.
        _ => (ip.l4 + 2, 4, 0),
    };
    if matches!(kind, Kind::Tcp | Kind::Udp) {
        ctx.l4_csum_replace(
            check,
            be32(old_addr),
            be32(new_addr),
            u64::from(BPF_F_PSEUDO_HDR | extra | 4),
        )
        .ok()?;
    }
    if old_port != new_port {
        ctx.l4_csum_replace(check, be16(old_port), be16(new_port), u64::from(extra | 2))
            .ok()?;
        ctx.store(ip.l4 + port_at, &new_port.to_be_bytes(), 0)
            .ok()?;
    }
    Some(())
}

/// Rewrites one IPv4 address (at `at`, in the header at `l3`) and the header checksum, in
/// place and by hand: the IPv4 header checksum is never offloaded, and two direct writes cost
/// less than the `bpf_l3_csum_replace` and `bpf_skb_store_bytes` calls. Alone, for later
/// fragments, which carry no L4 header; after [`rewrite_l4`] otherwise.
#[inline(always)]
fn rewrite_addr(ctx: &TcContext, at: usize, l3: usize, old: [u8; 4], new: [u8; 4]) -> Option<()> {
    let check = load16(ctx, l3 + IP_CHECK)?;
    store16(ctx, l3 + IP_CHECK, csum::update32(check, old, new))?;
    store32(ctx, at, new)
}

// ---------------------------------------------------------------------------------------------
// Ingress

/// `tc_from_netdev`, right after the configuration check and before the program's own
/// parser: translates a reply to a masqueraded flow back; `None` lets the program go on (not
/// for the masquerade address, from the cluster network, a tunnel packet, a SYN, a port
/// outside the range, a later fragment of no known datagram).
#[inline(always)]
pub fn ingress(ctx: &TcContext, cfg: &Config) -> Option<Counted> {
    let nat = maps::nat_config()?;
    let ip = read_ip(ctx)?;
    // Nothing from the cluster network answers a masqueraded flow (those go outside it);
    // such packets keep the program's NAT-guard learning.
    if ip.dst != nat.nat_addr || cfg.in_cluster(ip.src) {
        return None;
    }
    let outcome = if ip.frag == Frag::Later {
        fragment_in(ctx, &ip)?
    } else {
        reply_in(ctx, cfg, nat, &ip)?
    };
    Some(counted(ctx, outcome))
}

/// A whole packet or first fragment for the masquerade address.
#[inline(always)]
fn reply_in(ctx: &TcContext, cfg: &Config, nat: &NatConfig, ip: &Ip) -> Option<NatOutcome> {
    let l4 = read_l4(ctx, ip);
    let rkey = match l4.kind {
        Kind::Tcp if l4.flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN => {
            return None;
        }
        Kind::Tcp | Kind::Udp => {
            if !nat.port_in_range(l4.dport)
                || (l4.kind == Kind::Udp && ip.dst == cfg.public_ip && l4.dport == cfg.vxlan_port)
            {
                return None;
            }
            NatKey::new(ip.src, ip.dst, l4.sport, l4.dport, ip.proto)
        }
        Kind::EchoReply => NatKey::new(ip.src, ip.dst, 0, l4.dport, ip.proto),
        Kind::IcmpError => return icmp_error_in(ctx, nat, ip),
        Kind::EchoRequest | Kind::Other => return None,
    };
    let now = now_ns();
    let Some(rev) = live_reverse(nat, &rkey, now, Some(&l4)) else {
        return Some(NatOutcome::pass(Reason::PassSnatNoEntry));
    };
    if rev.orig_addr == ip.dst && rev.orig_port == rkey.dport {
        return Some(NatOutcome::pass(Reason::PassSnatHost));
    }
    if ip.frag == Frag::First {
        let fkey = FragKey {
            saddr: ip.src,
            daddr: ip.dst,
            id: ip.id,
            proto: ip.proto,
            _pad: 0,
        };
        let entry = FragEntry {
            orig_addr: rev.orig_addr,
        };
        let _ = FLANNEL_NATFRG4.insert(fkey, entry, u64::from(BPF_ANY));
    }
    Some(
        match rewrite_destination(ctx, ip, &l4, rev.orig_addr, rev.orig_port) {
            Some(()) => NatOutcome::pass(Reason::FastSnatReply),
            None => NatOutcome::drop(Reason::DropRewriteFailed),
        },
    )
}

/// The reverse entry of the reply tuple `rkey` if its flow is live, updating the flow's state
/// with the packet's `l4` (none for ICMP errors, which do not count as replies).
///
/// A reply that changes nothing within half a second of the flow's last check is vouched for
/// by the reverse entry alone ([`NatRevEntry::vouches_for`]); otherwise the outgoing entry is
/// checked, updated, and the result stamped on the reverse entry. Two CPUs stamping at once
/// can only leave an older state or time there, which makes the next reply check again.
#[inline(always)]
fn live_reverse(nat: &NatConfig, rkey: &NatKey, now: u64, l4: Option<&L4>) -> Option<NatRevEntry> {
    let rev_ptr = FLANNEL_NATREV4.get_ptr_mut(rkey)?;
    // SAFETY: the pointer comes from a successful lookup.
    let rev = unsafe { rev_ptr.read() };
    let after = |state: u8| match l4 {
        Some(l4) => nat::reply_state(rkey.proto, state, l4.flags),
        None => state,
    };
    if rev.vouches_for(after(rev.state), now) {
        return Some(rev);
    }
    let fkey = rkey.original_of(rev.orig_addr, rev.orig_port);
    let entry = FLANNEL_NAT4.get_ptr_mut(fkey)?;
    // SAFETY: as above.
    let e = unsafe { entry.read() };
    if e.nat_addr != rkey.daddr
        || e.nat_port != rkey.dport
        || nat.expired(rkey.proto, e.state, e.last_seen_ns, now)
    {
        return None;
    }
    let state = after(e.state);
    if state != e.state || now.wrapping_sub(e.last_seen_ns) > NS_PER_S / 2 {
        // SAFETY: as above; a racing writer can only store another valid value.
        unsafe {
            (*entry).state = state;
            (*entry).last_seen_ns = now;
        }
    }
    // SAFETY: as above.
    unsafe {
        (*rev_ptr).state = state;
        (*rev_ptr).checked_ns = now;
    }
    Some(rev)
}

/// A later fragment for the masquerade address: rewritten to the destination its first
/// fragment was translated to, if that one was seen.
#[inline(always)]
fn fragment_in(ctx: &TcContext, ip: &Ip) -> Option<NatOutcome> {
    let key = FragKey {
        saddr: ip.src,
        daddr: ip.dst,
        id: ip.id,
        proto: ip.proto,
        _pad: 0,
    };
    let entry = FLANNEL_NATFRG4.get_ptr(key)?;
    // SAFETY: the pointer comes from a successful lookup.
    let orig = unsafe { (*entry).orig_addr };
    Some(
        match rewrite_addr(ctx, ip.l3 + IP_DST, ip.l3, ip.dst, orig) {
            Some(()) => NatOutcome::pass(Reason::FastSnatFragment),
            None => NatOutcome::drop(Reason::DropRewriteFailed),
        },
    )
}

// ---------------------------------------------------------------------------------------------
// ICMP errors

/// The packet an ICMP error quotes: its IPv4 header (no options) at `l3`, the first 8 bytes
/// of its L4 header at `l4`.
#[derive(Clone, Copy)]
struct Quote {
    l3: usize,
    l4: usize,
    src: [u8; 4],
    dst: [u8; 4],
    proto: u8,
    check: u16,
    /// Source port (ICMP echo: the identifier).
    sport: u16,
    /// Destination port (ICMP echo: the identifier).
    dport: u16,
    /// For quoted ICMP: its type.
    icmp_type: u8,
}

#[inline(always)]
fn read_quote(ctx: &TcContext, ip: &Ip) -> Option<Quote> {
    let l3 = ip.l4 + 8;
    let l4 = l3 + 20;
    if l4 + 8 > ip.end {
        return None;
    }
    let p = ptr_at::<TcContext, [u8; 28]>(ctx, l3)?;
    // SAFETY: ptr_at checked the 28 bytes are readable.
    let h = unsafe { p.read_unaligned() };
    if h[0] != 0x45 || u16::from_be_bytes([h[IP_FRAG], h[IP_FRAG + 1]]) & IP_OFFSET != 0 {
        return None;
    }
    let proto_ = h[9];
    let (sport, dport) = match proto_ {
        proto::TCP | proto::UDP => (
            u16::from_be_bytes([h[20], h[21]]),
            u16::from_be_bytes([h[22], h[23]]),
        ),
        proto::ICMP => {
            let id = u16::from_be_bytes([h[24], h[25]]);
            (id, id)
        }
        _ => return None,
    };
    Some(Quote {
        l3,
        l4,
        src: [h[IP_SRC], h[13], h[14], h[15]],
        dst: [h[IP_DST], h[17], h[18], h[19]],
        proto: proto_,
        check: u16::from_be_bytes([h[IP_CHECK], h[IP_CHECK + 1]]),
        sport,
        dport,
        icmp_type: h[20],
    })
}

/// An ICMP error from a pod about a reply it received (the quoted packet goes from the outside
/// to the pod): the pod's address becomes the masquerade address outside and inside.
#[inline(always)]
fn icmp_error_out(ctx: &TcContext, nat: &NatConfig, ip: &Ip) -> NatOutcome {
    let Some(q) = read_quote(ctx, ip) else {
        return NatOutcome::pass(Reason::PassSnatUnhandled);
    };
    let key = match q.proto {
        proto::TCP | proto::UDP => NatKey::new(q.dst, q.src, q.dport, q.sport, q.proto),
        proto::ICMP if q.icmp_type == ICMP_ECHO_REPLY => {
            NatKey::new(q.dst, q.src, q.dport, 0, q.proto)
        }
        _ => return NatOutcome::pass(Reason::PassSnatUnhandled),
    };
    if q.dst != ip.src {
        return NatOutcome::pass(Reason::PassSnatUnhandled);
    }
    let Some(e) = FLANNEL_NAT4.get_ptr(key) else {
        return NatOutcome::pass(Reason::PassSnatUnhandled);
    };
    // SAFETY: the pointer comes from a successful lookup.
    let e = unsafe { e.read() };
    if e.nat_addr != nat.nat_addr || nat.expired(q.proto, e.state, e.last_seen_ns, now_ns()) {
        return NatOutcome::pass(Reason::PassSnatUnhandled);
    }
    match rewrite_icmp_error(ctx, ip, &q, L4Side::Source, e.nat_addr, e.nat_port) {
        Some(()) => NatOutcome::pass(Reason::FastSnatIcmpError),
        None => NatOutcome::drop(Reason::DropRewriteFailed),
    }
}

/// An ICMP error for the masquerade address about a packet a masqueraded flow sent: back to
/// the pod's address outside and inside.
#[inline(always)]
fn icmp_error_in(ctx: &TcContext, nat: &NatConfig, ip: &Ip) -> Option<NatOutcome> {
    let q = read_quote(ctx, ip)?;
    if q.src != ip.dst {
        return None;
    }
    let rkey = match q.proto {
        proto::TCP | proto::UDP => {
            if !nat.port_in_range(q.sport) {
                return None;
            }
            NatKey::new(q.dst, q.src, q.dport, q.sport, q.proto)
        }
        proto::ICMP if q.icmp_type == ICMP_ECHO_REQUEST => {
            NatKey::new(q.dst, q.src, 0, q.sport, q.proto)
        }
        _ => return None,
    };
    let Some(rev) = live_reverse(nat, &rkey, now_ns(), None) else {
        return Some(NatOutcome::pass(Reason::PassSnatNoEntry));
    };
    if rev.orig_addr == q.src && rev.orig_port == q.sport {
        return Some(NatOutcome::pass(Reason::PassSnatHost));
    }
    Some(
        match rewrite_icmp_error(
            ctx,
            ip,
            &q,
            L4Side::Destination,
            rev.orig_addr,
            rev.orig_port,
        ) {
            Some(()) => NatOutcome::pass(Reason::FastSnatIcmpError),
            None => NatOutcome::drop(Reason::DropRewriteFailed),
        },
    )
}

/// Reads a 16-bit big-endian field.
#[inline(always)]
fn load16(ctx: &TcContext, at: usize) -> Option<u16> {
    let p = ptr_at::<TcContext, [u8; 2]>(ctx, at)?;
    // SAFETY: ptr_at checked the 2 bytes are readable.
    Some(u16::from_be_bytes(unsafe { p.read_unaligned() }))
}

/// Writes a 16-bit big-endian field.
#[inline(always)]
fn store16(ctx: &TcContext, at: usize, v: u16) -> Option<()> {
    let p = ptr_at_mut::<TcContext, [u8; 2]>(ctx, at)?;
    // SAFETY: ptr_at_mut checked the 2 bytes lie within the packet.
    unsafe { p.write_unaligned(v.to_be_bytes()) };
    Some(())
}

/// Writes an IPv4 address.
#[inline(always)]
fn store32(ctx: &TcContext, at: usize, v: [u8; 4]) -> Option<()> {
    let p = ptr_at_mut::<TcContext, [u8; 4]>(ctx, at)?;
    // SAFETY: ptr_at_mut checked the 4 bytes lie within the packet.
    unsafe { p.write_unaligned(v) };
    Some(())
}

/// Translates an ICMP error and the packet it quotes. `side` is the end of the *outer*
/// packet that changes: `Source` (a pod's error going out: outer source, quoted destination)
/// or `Destination` (an error coming in: outer destination, quoted source). Every checksum is
/// updated incrementally and by hand (ICMP is never offloaded): the outer header's, the quoted
/// header's, the quoted L4 checksum if the quote holds it, and the ICMP checksum over all the
/// quoted changes.
#[inline(always)]
fn rewrite_icmp_error(
    ctx: &TcContext,
    ip: &Ip,
    q: &Quote,
    side: L4Side,
    addr: [u8; 4],
    port: u16,
) -> Option<()> {
    let (outer_at, outer_old, inner_at, inner_old, old_port) = match side {
        L4Side::Source => (ip.l3 + IP_SRC, ip.src, q.l3 + IP_DST, q.dst, q.dport),
        L4Side::Destination => (ip.l3 + IP_DST, ip.dst, q.l3 + IP_SRC, q.src, q.sport),
    };
    // Where the quoted port (identifier) is, and the quoted L4 checksum if the quote has it.
    let port_at = match (q.proto, side) {
        (proto::ICMP, _) => q.l4 + 4,
        (_, L4Side::Source) => q.l4 + 2,
        (_, L4Side::Destination) => q.l4,
    };
    let l4_check_at = match q.proto {
        proto::UDP => Some(q.l4 + 6),
        proto::ICMP => Some(q.l4 + 2),
        _ if q.l4 + 18 <= ip.end => Some(q.l4 + 16),
        _ => None,
    };

    let mut icmp = load16(ctx, ip.l4 + 2)?;
    // The quoted L4 checksum: pseudo-header (not for ICMP) and port.
    if let Some(at) = l4_check_at
        && let Some(old) = load16(ctx, at)
        && !(q.proto == proto::UDP && old == 0)
    {
        let mut new = old;
        if q.proto != proto::ICMP {
            new = csum::update32(new, inner_old, addr);
        }
        new = csum::update16(new, old_port, port);
        store16(ctx, at, new)?;
        icmp = csum::update16(icmp, old, new);
    }
    // The quoted port and address, and the quoted header checksum.
    store16(ctx, port_at, port)?;
    icmp = csum::update16(icmp, old_port, port);
    let inner_check = csum::update32(q.check, inner_old, addr);
    store16(ctx, q.l3 + IP_CHECK, inner_check)?;
    icmp = csum::update16(icmp, q.check, inner_check);
    store32(ctx, inner_at, addr)?;
    icmp = csum::update32(icmp, inner_old, addr);
    store16(ctx, ip.l4 + 2, icmp)?;
    // The outer address and header checksum.
    let outer_check = load16(ctx, ip.l3 + IP_CHECK)?;
    store16(
        ctx,
        ip.l3 + IP_CHECK,
        csum::update32(outer_check, outer_old, addr),
    )?;
    store32(ctx, outer_at, addr)
}
