//! The udp backend on the fast path: the same encapsulation as the TUN path (`flannel0` and
//! the agent's forwarder), done in TC. The wire format is in [`flannel_common::udp`].
//!
//! # Transmit (`tc_from_bridge`)
//!
//! A local pod's packet to a subnet of kind `RouteKind::Udp` is encapsulated right at the pod
//! bridge, skipping `flannel0` and the user-space forwarder entirely: `bpf_skb_adjust_room`
//! makes room for the 28 outer bytes (`ENCAP_L3_IPV4 | ENCAP_L4_UDP`, no inner Ethernet), the
//! outer IPv4 and UDP headers are written as the forwarder's socket would send them, the inner
//! TTL drops by two (the kernel's forwarding into `flannel0` and the forwarder each take one),
//! and the packet is redirected out of the external interface by the underlay route. Packets
//! with a TTL of 2 or less, too big after encapsulation, ICMP errors, flows conntrack must see
//! and everything without a udp route take the kernel path into `flannel0` unchanged.
//!
//! GSO UDP packets (`UDP_SEGMENT`) take the kernel path: on a veth underlay they would arrive
//! whole, where neither the receiving programs (the UDP-tunnel offload state they cannot reset
//! makes the pod's socket drop the packet) nor a socket can take them.
//!
//! Other GSO packets keep their segment size; `adjust_room` marks them `SKB_GSO_UDP_TUNNEL`
//! with the inner protocol IPv4, so the kernel's UDP tunnel segmentation builds one datagram
//! per segment (outer lengths fixed, UDP checksum left 0). As for VXLAN, the inner L4 checksum may
//! still be partial (`CHECKSUM_PARTIAL`) when the packet leaves: a NIC (or the kernel's
//! software fallback for NICs that do not know this tunnel) completes it on transmit. Only a
//! veth underlay hands the skb on unfinished; an in-kernel receiver (our own receive below)
//! does not mind, a user-space receiver reads the unfinished checksum: the agent's forwarder
//! finishes it (`flannel_agent::udp::packet::finish_l4_checksum`), upstream's does not. A
//! user-space receiver also cannot take a GSO datagram whole: for kernel-path and upstream
//! receivers, a veth underlay needs `ethtool -K <underlay> tx-udp_tnl-segmentation off` (the
//! mixed-pair test does that), and `tx off` too for upstream's.
//!
//! # Receive (`tc_from_netdev`)
//!
//! A UDP datagram to our interface address and port is a udp-backend datagram. Its inner
//! packet is checked as the forwarder checks it (IPv4 whose total length is the payload's,
//! a valid header checksum) and then decided like every other received pod packet
//! ([`crate::decide::deliverable`]: ICMP echo, a local pod as destination, a known remote
//! subnet as source, no conntrack state) with a TTL above 2: such packets are decapsulated and
//! delivered to the pod bridge (TTL minus two, as forwarder + kernel would), bypassing the
//! stack for the same conntrack reasons as VXLAN receive (see [`crate::deliver`]: both
//! directions of a pod-to-pod flow take the same path). Everything else is left untouched to
//! the forwarder's socket, i.e. to the TUN path: node addresses, kernel flows, TTL 2, packets
//! for other subnets (which the forwarder refuses to relay). The outer source is not checked,
//! as the TUN path does not (NAT). A GSO datagram (possible only when a fast-path peer sends
//! over a veth) cannot be taken whole by the socket, so one that is not delivered is
//! decapsulated and handed to the stack instead.
//!
//! # Kernel flows (`tc_to_netdev`)
//!
//! The forwarder's own datagrams (from our interface address and port) carry pod packets that
//! went through the kernel (conntrack saw them); their flows are recorded in the kernel-flow
//! table so that the replies go to the socket as well.

use aya_ebpf::{
    bindings::{
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV4, BPF_F_ADJ_ROOM_ENCAP_L4_UDP, BPF_F_ADJ_ROOM_FIXED_GSO,
        TC_ACT_OK, TC_ACT_SHOT, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
    },
    btf_maps::Array,
    macros::btf_map,
    programs::TcContext,
};
use flannel_common::{
    config::Config,
    csum,
    route::RemoteEntry,
    stats::Reason,
    udp::{UDP_OVERHEAD, UDP_TTL_DECREMENT, UdpConfig},
};

use crate::{
    decide, deliver,
    encap::{self, Outer},
    fib::{self, Fib},
    ipv4::{self, Ipv4Info},
    maps,
    parse::{self, ETH_HDR_LEN, IPV4_HDR_LEN, UDP_HDR_LEN, proto, ptr_at},
};

/// The udp backend's configuration (`flannel_common::udp::UDP_CONFIG`).
#[btf_map]
pub static FLANNEL_UDPCFG: Array<UdpConfig, 1> = Array::new();

/// Offset of the inner IPv4 header of a udp-backend datagram (outer Ethernet, IPv4 without
/// options, UDP).
pub const INNER_L3: usize = ETH_HDR_LEN + UDP_OVERHEAD;

/// The `adjust_room` flags of the encapsulation: an outer IPv4 and UDP header, no inner
/// Ethernet header; GSO packets keep their segment size.
const ENCAP_FLAGS: u64 =
    (BPF_F_ADJ_ROOM_FIXED_GSO | BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 | BPF_F_ADJ_ROOM_ENCAP_L4_UDP) as u64;

/// IPv4 "don't fragment", as the outer header carries it.
const DONT_FRAGMENT: bool = true;

/// The udp configuration, if the agent enabled it.
#[inline(always)]
pub fn config() -> Option<&'static UdpConfig> {
    match FLANNEL_UDPCFG.get(0) {
        Some(cfg) if cfg.enabled() => Some(cfg),
        _ => None,
    }
}

/// The 28 bytes the encapsulation inserts after the Ethernet header for an inner packet of
/// `l3_len` bytes to `peer` (see [`flannel_common::udp`] for each field).
#[inline(always)]
pub fn headers(udp: &UdpConfig, outer_ttl: u8, peer: [u8; 4], l3_len: u32) -> [u8; UDP_OVERHEAD] {
    let mut h = [0u8; UDP_OVERHEAD];
    let ip = encap::ipv4_header(&Outer {
        src: udp.iface_addr,
        dst: peer,
        tos: 0,
        ttl: outer_ttl,
        id: 0,
        dont_fragment: DONT_FRAGMENT,
        proto: proto::UDP,
        tot_len: (l3_len + UDP_OVERHEAD as u32) as u16,
    });
    h[..IPV4_HDR_LEN].copy_from_slice(&ip);
    h[20..22].copy_from_slice(&udp.port.to_be_bytes());
    h[22..24].copy_from_slice(&udp.port.to_be_bytes());
    h[24..26].copy_from_slice(&((l3_len + UDP_HDR_LEN as u32) as u16).to_be_bytes());
    // h[26..28]: UDP checksum 0.
    h
}

/// The bytes `[ttl - 2, proto, checksum]` that replace bytes 8..12 of `info`'s header: the
/// TTL after the two hops of the TUN path, the header checksum updated incrementally.
#[inline(always)]
pub fn ttl_field(info: &Ipv4Info) -> [u8; 4] {
    let [hi, lo] = csum::ttl_decremented(csum::ttl_decremented(info.check)).to_be_bytes();
    [info.ttl.wrapping_sub(UDP_TTL_DECREMENT), info.proto, hi, lo]
}

/// Whether the 20-byte IPv4 header `hdr` carries a valid header checksum (its ten words,
/// checksum included, sum to 0xffff), as the forwarder requires on receive.
#[inline(always)]
pub fn header_checksum_ok(hdr: &[u8; 20]) -> bool {
    let mut sum = 0u32;
    let mut i = 0;
    while i < 20 {
        sum += u32::from(u16::from_be_bytes([hdr[i], hdr[i + 1]]));
        i += 2;
    }
    csum::fold(sum) == 0xffff
}

/// Encapsulates a local pod's packet for `peer` (a `RouteKind::Udp` entry) and returns the
/// underlay route to send it by. On `Err` the packet is unchanged, except for
/// [`Reason::DropRewriteFailed`].
#[inline(always)]
pub fn encap(
    ctx: &TcContext,
    cfg: &Config,
    peer: &RemoteEntry,
    info: &Ipv4Info,
) -> Result<Fib, Reason> {
    let Some(udp) = config() else {
        return Err(Reason::PassBadRoute);
    };
    if fib::gso_size(ctx) != 0 && info.proto == proto::UDP {
        // A GSO UDP packet (`UDP_SEGMENT`) stays whole in a datagram where the underlay does
        // not segment it (a veth): the receiving programs could deliver it only with a
        // UDP-tunnel offload state that makes the pod's socket drop it, and a socket cannot
        // take it. `flannel0` gets it segmented, and the forwarder's datagrams make its flow
        // a kernel flow on both ends.
        return Err(Reason::PassGso);
    }
    let Some(room) = encap::room(ctx, cfg, info, UDP_OVERHEAD) else {
        return Err(Reason::PassTooBig);
    };
    // The outer datagram (each one, for a GSO packet) against the path MTU to the peer too:
    // it carries DF, as the forwarder's socket sends it, so a router on a narrower path drops
    // it, and its "fragmentation needed" teaches the kernel that path MTU (for the
    // forwarder's socket). Too big for it, the packet takes the TUN path, whose socket
    // fragments it to fit.
    let mut len = encap::segment_len(ctx, info).min(u32::from(room)) as u16 + UDP_OVERHEAD as u16;
    let route = match fib::lookup_output(
        ctx,
        cfg.ext_ifindex,
        udp.iface_addr,
        peer.public_ip,
        &mut len,
    ) {
        Fib::Failed => return Err(Reason::PassFibFailed),
        route => route,
    };
    let l3_len = encap::inner_len(ctx, UDP_OVERHEAD)?;
    let outer = headers(udp, cfg.outer_ttl, peer.public_ip, l3_len);
    let ttl = ttl_field(info);
    ctx.adjust_room(UDP_OVERHEAD as i32, BPF_ADJ_ROOM_MAC, ENCAP_FLAGS)
        .map_err(|_| Reason::PassAdjustFailed)?;
    ctx.store(ETH_HDR_LEN, &outer, 0)
        .and_then(|()| ctx.store(INNER_L3 + 8, &ttl, 0))
        .map_err(|_| Reason::DropRewriteFailed)?;
    Ok(route)
}

/// Whether `outer` (a received IPv4 packet) is a datagram for the udp backend of this node:
/// UDP to our interface address and port.
#[inline(always)]
pub fn is_for_us(outer: &Ipv4Info) -> bool {
    match config() {
        Some(udp) => {
            outer.proto == proto::UDP
                && outer.dst == udp.iface_addr
                && u16::from_be_bytes(outer.dport) == udp.port
        }
        None => false,
    }
}

/// What [`receive`] did: the TC action and the verdict to count.
pub struct Received {
    /// The TC action.
    pub action: i32,
    /// The verdict.
    pub reason: Reason,
}

impl Received {
    #[inline(always)]
    fn pass(reason: Reason) -> Self {
        Received {
            action: TC_ACT_OK,
            reason,
        }
    }

    #[inline(always)]
    fn failed(reason: Reason) -> Self {
        if reason == Reason::DropRewriteFailed {
            Received {
                action: TC_ACT_SHOT,
                reason,
            }
        } else {
            Received::pass(reason)
        }
    }
}

/// The inner packet of a udp-backend datagram, if it is one the fast path takes as it is: IPv4
/// without options or fragmentation, its total length the UDP payload's, a valid header
/// checksum. `Err` names the pass reason.
#[inline(always)]
fn inner_packet(ctx: &TcContext, outer: &Ipv4Info) -> Result<Ipv4Info, Reason> {
    if outer.l4 != ETH_HDR_LEN + IPV4_HDR_LEN {
        return Err(Reason::PassUdpMismatch);
    }
    let Some(p) = ptr_at::<TcContext, [u8; UDP_HDR_LEN]>(ctx, outer.l4) else {
        return Err(Reason::PassUdpMismatch);
    };
    // SAFETY: ptr_at checked the 8 bytes are readable.
    let udp = unsafe { p.read_unaligned() };
    let udp_len = u16::from_be_bytes([udp[4], udp[5]]);
    if u32::from(udp_len) + IPV4_HDR_LEN as u32 != u32::from(outer.tot_len)
        || usize::from(udp_len) < UDP_HDR_LEN + IPV4_HDR_LEN
    {
        return Err(Reason::PassUdpMismatch);
    }
    let packet = match ipv4::screen(&parse::parse_ipv4_at(ctx, INNER_L3, outer.end())) {
        Ok(p) => p,
        Err(reason @ (Reason::PassFragment | Reason::PassIpOptions | Reason::PassOtherProto)) => {
            return Err(reason);
        }
        Err(_) => return Err(Reason::PassUdpMismatch),
    };
    let Some(hdr) = ptr_at::<TcContext, [u8; IPV4_HDR_LEN]>(ctx, INNER_L3) else {
        return Err(Reason::PassUdpMismatch);
    };
    // SAFETY: ptr_at checked the 20 bytes are readable.
    if !header_checksum_ok(unsafe { &*hdr }) {
        return Err(Reason::PassUdpMismatch);
    }
    let info = ipv4::read(ctx, &packet).ok_or(Reason::PassMalformed)?;
    if usize::from(info.tot_len) + UDP_HDR_LEN != usize::from(udp_len) {
        return Err(Reason::PassUdpMismatch);
    }
    Ok(info)
}

/// A udp-backend datagram for this node ([`is_for_us`]): decapsulated and delivered to the
/// pod bridge, or left to the TUN path's socket. Sets `nat_learnt` when the NAT guard learnt
/// the inner source.
#[inline(always)]
pub fn receive(ctx: &TcContext, cfg: &Config, outer: &Ipv4Info, nat_learnt: &mut bool) -> Received {
    let info = match inner_packet(ctx, outer) {
        Ok(info) => info,
        Err(reason) => return Received::pass(reason),
    };
    *nat_learnt = deliver::learn_nat_guard(ctx, cfg, &info);
    let mut deliverable = decide::deliverable(
        cfg,
        &info,
        |src| maps::route(src).copied(),
        deliver::is_kernel_flow,
    );
    if deliverable.is_ok() && info.ttl <= UDP_TTL_DECREMENT {
        deliverable = Err(Reason::PassTtlExceeded);
    }
    let gso = fib::gso_size(ctx) != 0;
    let route = match deliverable {
        Ok(()) => deliver::route_to_pod(ctx, &info, &mut 0),
        Err(reason) if !gso => return Received::pass(reason),
        Err(_) => Fib::Failed,
    };
    if route == Fib::Failed && !gso {
        return Received::pass(Reason::PassFibFailed);
    }
    if let Err(reason) = deliver::decap(ctx, UDP_OVERHEAD) {
        return Received::pass(reason);
    }
    if route == Fib::Failed {
        // A GSO datagram the socket could not take: the stack gets the inner packet.
        return Received::pass(Reason::FastDecapUdp);
    }
    if ctx.store(ETH_HDR_LEN + 8, &ttl_field(&info), 0).is_err() {
        return Received::failed(Reason::DropRewriteFailed);
    }
    match fib::deliver(ctx, route) {
        Some(action) => Received {
            action,
            reason: Reason::FastDeliverUdp,
        },
        None => Received::failed(Reason::DropRewriteFailed),
    }
}

/// `tc_to_netdev`: if `info` is one of the forwarder's datagrams (from our interface address
/// and port), records the flow of the pod packet inside as a kernel flow. `None` when it is
/// not such a datagram; otherwise whether a flow was learnt.
///
/// A BPF subprogram of its own (not inlined): inlined into `tc_to_netdev`, LLVM reused a
/// register holding the config map pointer for a shifted value, which the verifier refuses.
#[inline(never)]
pub fn learn_from_forwarder(ctx: &TcContext, cfg: &Config, info: &Ipv4Info) -> Option<bool> {
    let udp = config()?;
    if info.proto != proto::UDP
        || info.src != udp.iface_addr
        || u16::from_be_bytes(info.sport) != udp.port
        || info.l4 != ETH_HDR_LEN + IPV4_HDR_LEN
    {
        return None;
    }
    let learnt = match ipv4::screen(&parse::parse_ipv4_at(ctx, INNER_L3, info.end())) {
        Ok(inner) => match ipv4::read(ctx, &inner) {
            Some(inner) => deliver::learn_kernel_flow(cfg, &inner),
            None => false,
        },
        Err(_) => false,
    };
    Some(learnt)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn udp() -> UdpConfig {
        UdpConfig {
            flags: flannel_common::udp::UDP_CFG_ENABLED,
            iface_addr: [192, 168, 77, 1],
            port: 8285,
            _pad: 0,
        }
    }

    #[test]
    fn headers_are_what_the_forwarders_socket_sends() {
        let h = headers(&udp(), 64, [192, 168, 77, 2], 84);
        // Version/IHL, TOS 0, length, ID 0, DF, TTL 64, UDP.
        assert_eq!(&h[..10], &[0x45, 0, 0, 112, 0, 0, 0x40, 0, 64, 17]);
        assert!(header_checksum_ok(h[..20].try_into().expect("20 bytes")));
        assert_eq!(&h[12..20], &[192, 168, 77, 1, 192, 168, 77, 2]);
        assert_eq!(u16::from_be_bytes([h[20], h[21]]), 8285);
        assert_eq!(u16::from_be_bytes([h[22], h[23]]), 8285);
        assert_eq!(u16::from_be_bytes([h[24], h[25]]), 84 + 8);
        assert_eq!(&h[26..28], &[0, 0]);
    }

    #[test]
    fn the_inner_ttl_drops_by_two_with_a_valid_checksum() {
        let mut hdr = [
            0x45, 0, 0, 84, 0x12, 0x34, 0x40, 0, 64, 6, 0, 0, 10, 244, 1, 5, 10, 244, 2, 7,
        ];
        let check = csum::ipv4_header(&hdr);
        hdr[10..12].copy_from_slice(&check.to_be_bytes());
        assert!(header_checksum_ok(&hdr));
        let info = Ipv4Info {
            ttl: 64,
            proto: 6,
            check,
            ..Ipv4Info::default()
        };
        let field = ttl_field(&info);
        hdr[8..12].copy_from_slice(&field);
        assert_eq!(hdr[8], 62);
        assert!(header_checksum_ok(&hdr));
        hdr[15] ^= 1;
        assert!(!header_checksum_ok(&hdr));
    }
}
