//! VXLAN over IPv6, as `flannel-v6.<VNI>` sends and receives it, built in the program.
//!
//! # What goes on the wire
//!
//! What the kernel's VXLAN device (`vxlan_xmit_one` → `udp_tunnel6_xmit_skb`) sends for a
//! forwarded IPv6 pod packet:
//! - outer IPv6: traffic class = the inner ECN bits (CE becomes ECT(0)), flow label 0 (no
//!   `flowlabel` option on the device), next header UDP, hop limit `Config6::hop_limit` (the
//!   external interface's `hop_limit`), source our public IPv6, destination the peer's;
//! - UDP: source port from the flow hash (`udp_flow_src_port`), destination `vxlan_port`,
//!   and a **valid checksum**: over IPv6 a zero UDP checksum is only accepted by tunnels
//!   created with `udp6zerocsumrx`, which neither upstream's nor our `flannel-v6.<VNI>` is;
//! - VXLAN flags `I` and the VNI; inner Ethernet our v6 VTEP MAC → the peer's, `86dd`;
//! - the inner IPv6 packet with its hop limit decremented.
//!
//! The UDP checksum is computed without reading the payload, as Linux's local checksum
//! offload does (`lco_csum`): the inner TCP/UDP/ICMPv6 segment, once its own checksum is
//! complete, sums to the complement of its pseudo-header sum, so the outer checksum needs only
//! the headers. This holds both for complete inner checksums and for `CHECKSUM_PARTIAL`
//! packets (the pod's stack left the pseudo-header sum in the field; a NIC completes it on
//! transmit, the same contract the kernel's own VXLAN relies on).
//!
//! GSO packets are not encapsulated here: `bpf_skb_adjust_room` marks them
//! `SKB_GSO_UDP_TUNNEL` without `_CSUM`, so segmentation would keep one outer checksum for
//! every segment. They are redirected to `flannel-v6.<VNI>` as the kernel's route says, with
//! the route's MACs and the hop limit set, and the kernel's VXLAN device encapsulates and
//! segments them (without the route they are passed to the stack).

use aya_ebpf::{
    bindings::{
        BPF_ADJ_ROOM_ENCAP_L2_SHIFT, BPF_F_ADJ_ROOM_DECAP_L3_IPV6, BPF_F_ADJ_ROOM_ENCAP_L2_ETH,
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV6, BPF_F_ADJ_ROOM_ENCAP_L4_UDP, BPF_F_ADJ_ROOM_FIXED_GSO,
        bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
    },
    helpers::{bpf_check_mtu, bpf_get_hash_recalc, bpf_skb_load_bytes},
    programs::TcContext,
};
use flannel_common::{
    csum,
    route::RemoteEntry6,
    stats::Reason,
    v6::{Config6, VXLAN6_OVERHEAD},
};

use super::{
    fib::{self, Fib6},
    info::Ipv6Info,
};
use crate::{
    encap::{self, VXLAN_FLAG_I},
    fib::{gso_size, skb_len},
    parse::{ETH_HDR_LEN, ETH_P_IPV6, IPV6_HDR_LEN, proto},
};

/// Offset of the inner Ethernet header of a VXLAN-over-IPv6 packet.
pub const INNER_ETH: usize = ETH_HDR_LEN + IPV6_HDR_LEN + 8 + 8;
/// Offset of the inner IPv6 header.
pub const INNER_L3: usize = INNER_ETH + ETH_HDR_LEN;

/// The `adjust_room` flags for VXLAN over IPv6.
const ENCAP_FLAGS: u64 = (BPF_F_ADJ_ROOM_FIXED_GSO
    | BPF_F_ADJ_ROOM_ENCAP_L3_IPV6
    | BPF_F_ADJ_ROOM_ENCAP_L4_UDP
    | BPF_F_ADJ_ROOM_ENCAP_L2_ETH) as u64
    | ((ETH_HDR_LEN as u64) << BPF_ADJ_ROOM_ENCAP_L2_SHIFT);

/// The `adjust_room` flags for removing the outer IPv6, UDP, VXLAN and inner Ethernet headers.
const DECAP_FLAGS: u64 = (BPF_F_ADJ_ROOM_FIXED_GSO | BPF_F_ADJ_ROOM_DECAP_L3_IPV6) as u64;

/// The one's-complement sum of `bytes` as big-endian 16-bit words (`N` even), unfolded.
#[inline(always)]
pub fn sum_words<const N: usize>(bytes: &[u8; N]) -> u32 {
    let mut sum = 0u32;
    let mut i = 0;
    while i + 1 < N {
        sum += u32::from(u16::from_be_bytes([bytes[i], bytes[i + 1]]));
        i += 2;
    }
    sum
}

/// The pseudo-header sum of an upper-layer packet of `len` bytes (RFC 8200 §8.1), unfolded.
#[inline(always)]
pub fn pseudo_header(src: &[u8; 16], dst: &[u8; 16], len: u32, next_hdr: u8) -> u32 {
    sum_words(src) + sum_words(dst) + (len >> 16) + (len & 0xffff) + u32::from(next_hdr)
}

/// The 70 bytes VXLAN over IPv6 inserts after the outer Ethernet header, for the inner IPv6
/// packet whose (hop-limit decremented) header is `inner` and whose payload carries a complete
/// (or to-be-completed) TCP, UDP or ICMPv6 checksum.
#[inline(always)]
pub fn headers(
    cfg: &Config6,
    peer: &RemoteEntry6,
    inner: &[u8; 40],
    src_port: u16,
) -> [u8; VXLAN6_OVERHEAD] {
    let mut h = [0u8; VXLAN6_OVERHEAD];
    write_headers(cfg, peer, inner, src_port, &mut h);
    h
}

/// [`headers`] written into `h` (a BPF subprogram of its own: the sums stay off the callers'
/// frames).
#[inline(never)]
pub fn write_headers(
    cfg: &Config6,
    peer: &RemoteEntry6,
    inner: &[u8; 40],
    src_port: u16,
    h: &mut [u8; VXLAN6_OVERHEAD],
) {
    let payload_len = u16::from_be_bytes([inner[4], inner[5]]);
    let udp_len = (VXLAN6_OVERHEAD - IPV6_HDR_LEN) as u32 + 40 + u32::from(payload_len);
    let tclass = csum::ecn_encapsulate((inner[0] << 4) | (inner[1] >> 4));

    h[0] = 0x60 | (tclass >> 4);
    h[1] = tclass << 4;
    h[2] = 0;
    h[3] = 0;
    h[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    h[6] = proto::UDP;
    h[7] = cfg.hop_limit;
    h[8..24].copy_from_slice(&cfg.public_ip);
    h[24..40].copy_from_slice(&peer.public_ip);
    h[40..42].copy_from_slice(&src_port.to_be_bytes());
    h[42..44].copy_from_slice(&cfg.vxlan_port.to_be_bytes());
    h[44..46].copy_from_slice(&(udp_len as u16).to_be_bytes());
    h[46] = 0;
    h[47] = 0;
    h[48..52].copy_from_slice(&[VXLAN_FLAG_I, 0, 0, 0]);
    h[52..56].copy_from_slice(&(peer.vni << 8).to_be_bytes());
    h[56..62].copy_from_slice(&peer.vtep_mac);
    h[62..68].copy_from_slice(&cfg.vtep_mac);
    h[68..70].copy_from_slice(&ETH_P_IPV6.to_be_bytes());

    // Outer pseudo-header (the addresses are h[8..40]) and the UDP, VXLAN and inner Ethernet
    // headers (h[40..70]).
    let mut sum = udp_len + u32::from(proto::UDP);
    let mut i = 8;
    while i < VXLAN6_OVERHEAD {
        sum += u32::from(u16::from_be_bytes([h[i], h[i + 1]]));
        i += 2;
    }
    // The inner IPv6 header, and the inner segment, which sums to the complement of its
    // pseudo-header sum (the addresses are inner[8..40]).
    let mut pseudo = u32::from(payload_len) + u32::from(inner[6]);
    let mut i = 0;
    while i < 40 {
        let word = u32::from(u16::from_be_bytes([inner[i], inner[i + 1]]));
        sum += word;
        if i >= 8 {
            pseudo += word;
        }
        i += 2;
    }
    sum += u32::from(!csum::fold(pseudo));
    let check = match !csum::fold(sum) {
        0 => 0xffff,
        c => c,
    };
    h[46..48].copy_from_slice(&check.to_be_bytes());
}

/// The room a (non-GSO) packet has in VXLAN over IPv6: the largest inner IPv6 packet the
/// external interface's MTU carries with the 70 outer bytes, if this packet fits it.
#[inline(always)]
pub fn room(ctx: &TcContext, cfg: &Config6) -> Option<u16> {
    let mut mtu: u32 = 0;
    // SAFETY: the helper writes one u32 to `mtu` (with mtu_len 0 it only reports the MTU).
    let rc = unsafe { bpf_check_mtu(ctx.skb.skb.cast(), cfg.ext_ifindex, &mut mtu, 0, 0) };
    if rc < 0 || mtu <= VXLAN6_OVERHEAD as u32 {
        return None;
    }
    let room = mtu - VXLAN6_OVERHEAD as u32;
    (skb_len(ctx) - ETH_HDR_LEN as u32 <= room).then(|| u16::try_from(room).unwrap_or(u16::MAX))
}

/// Whether a local pod's IPv6 packet may be encapsulated here at all: not a GSO packet (see
/// the module doc), and nothing after the datagram (it would end up in the UDP payload,
/// outside the checksum).
#[inline(always)]
pub fn encapsulable(ctx: &TcContext, info: &Ipv6Info) -> Result<(), Reason> {
    if gso_size(ctx) != 0 {
        return Err(Reason::PassGso);
    }
    if skb_len(ctx) != (ETH_HDR_LEN + IPV6_HDR_LEN) as u32 + u32::from(info.payload_len) {
        return Err(Reason::PassMalformed);
    }
    Ok(())
}

/// Encapsulates a local pod's IPv6 packet for `peer` and returns the underlay route, with
/// the room inner packets have on it (by the external interface's and the path's MTU) in
/// `room`; `inner` and `outer` are scratch space (in a per-CPU map, off the stack). On `Err`
/// the packet is unchanged, except for [`Reason::DropRewriteFailed`].
#[inline(always)]
pub fn encap(
    ctx: &TcContext,
    cfg: &Config6,
    peer: &RemoteEntry6,
    info: &Ipv6Info,
    inner: &mut [u8; 40],
    outer: &mut [u8; VXLAN6_OVERHEAD],
    room: &mut u16,
) -> Result<Fib6, Reason> {
    encapsulable(ctx, info)?;
    *room = self::room(ctx, cfg).ok_or(Reason::PassTooBig)?;
    // Checked against the path MTU to the peer too: too big for it (a router sent
    // `flannel-v6.<VNI>`'s socket a Packet Too Big), the packet takes the kernel path, whose
    // tunnel answers the pod with a Packet Too Big of its own.
    let mut path_mtu = (skb_len(ctx) - ETH_HDR_LEN as u32 + VXLAN6_OVERHEAD as u32) as u16;
    let route = fib::lookup_output(ctx, cfg, &peer.public_ip, &mut path_mtu);
    if route == Fib6::Failed {
        return Err(Reason::PassFibFailed);
    }
    if let Some(path_room) = path_mtu.checked_sub(VXLAN6_OVERHEAD as u16)
        && path_room > 0
    {
        *room = (*room).min(path_room);
    }
    push(ctx, cfg, peer, info.hop_limit, inner, outer)?;
    Ok(route)
}

/// Puts the VXLAN-over-IPv6 headers for `peer` in front of an [`encapsulable`] packet whose
/// hop limit is `hop_limit` (decremented in the inner header). On `Err` the packet is
/// unchanged, except for [`Reason::DropRewriteFailed`].
#[inline(always)]
pub fn push(
    ctx: &TcContext,
    cfg: &Config6,
    peer: &RemoteEntry6,
    hop_limit: u8,
    inner: &mut [u8; 40],
    outer: &mut [u8; VXLAN6_OVERHEAD],
) -> Result<(), Reason> {
    // SAFETY: the helper writes exactly 40 bytes to `inner`, which has 40.
    let loaded = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb.cast(),
            ETH_HDR_LEN as u32,
            inner.as_mut_ptr().cast(),
            IPV6_HDR_LEN as u32,
        )
    };
    if loaded != 0 {
        return Err(Reason::PassMalformed);
    }
    inner[7] = hop_limit.wrapping_sub(1);
    // SAFETY: plain helper call on the program's own skb.
    let hash = unsafe { bpf_get_hash_recalc(ctx.skb.skb.cast()) };
    let src_port = csum::vxlan_source_port(hash, cfg.src_port_min, cfg.src_port_max);
    write_headers(cfg, peer, inner, src_port, outer);
    ctx.adjust_room(VXLAN6_OVERHEAD as i32, BPF_ADJ_ROOM_MAC, ENCAP_FLAGS)
        .map_err(|_| Reason::PassAdjustFailed)?;
    ctx.store(ETH_HDR_LEN, outer, 0)
        .and_then(|()| ctx.store(INNER_L3 + 7, &[inner[7]], 0))
        .map_err(|_| Reason::DropRewriteFailed)
}

/// If a received packet, whose outer IPv6 header `outer` describes, has no extension headers
/// and its VXLAN header and inner Ethernet header are ours (flags `I`, our VNI, our
/// v6 VTEP MAC as inner destination, IPv6 inside) and its UDP length is sound
/// ([`payload_end`]), where the frame inside it ends.
#[inline(always)]
pub fn inner_end(ctx: &TcContext, cfg: &Config6, outer: &Ipv6Info) -> Option<usize> {
    if outer.l4 != INNER_ETH - 16
        || !encap::vxlan_header_is(ctx, INNER_ETH - 8, cfg.vni, cfg.vtep_mac, ETH_P_IPV6)
    {
        return None;
    }
    payload_end(ctx, outer)
}

/// The end of the UDP payload of a packet whose outer IPv6 header (without extension
/// headers, so the UDP header at its fixed place) `outer` describes, if its UDP length is
/// sound ([`encap::udp_payload_end`]).
#[inline(always)]
pub fn payload_end(ctx: &TcContext, outer: &Ipv6Info) -> Option<usize> {
    encap::udp_payload_end(ctx, INNER_ETH - 16, outer.end())
}

/// Removes the 70 outer bytes.
#[inline(always)]
pub fn decap(ctx: &TcContext) -> Result<(), Reason> {
    ctx.adjust_room(-(VXLAN6_OVERHEAD as i32), BPF_ADJ_ROOM_MAC, DECAP_FLAGS)
        .map_err(|_| Reason::PassAdjustFailed)
}

#[cfg(test)]
mod tests {
    use flannel_common::route::RouteKind;

    use super::*;

    fn addr(s: &str) -> [u8; 16] {
        s.parse::<std::net::Ipv6Addr>()
            .unwrap_or_else(|e| panic!("{s}: {e}"))
            .octets()
    }

    /// A whole VXLAN packet's UDP checksum, summed over every byte (the slow way).
    fn full_udp_checksum(outer: &[u8; 70], inner_packet: &[u8]) -> u16 {
        let mut udp = outer[40..].to_vec();
        udp[6] = 0;
        udp[7] = 0;
        udp.extend_from_slice(inner_packet);
        let mut sum = pseudo_header(
            &addr("fd00:77::1"),
            &addr("fd00:77::2"),
            udp.len() as u32,
            17,
        );
        if udp.len() % 2 == 1 {
            udp.push(0);
        }
        for w in udp.chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        !csum::fold(sum)
    }

    #[test]
    fn the_outer_checksum_needs_only_the_headers() {
        let cfg = Config6 {
            public_ip: addr("fd00:77::1"),
            vxlan_port: 8472,
            hop_limit: 64,
            vtep_mac: [0x0e, 0, 0, 0, 0, 1],
            ..Config6::default()
        };
        let peer = RemoteEntry6 {
            kind: RouteKind::Vxlan as u32,
            public_ip: addr("fd00:77::2"),
            vni: 1,
            vtep_mac: [0x0e, 0, 0, 0, 0, 2],
            ..RemoteEntry6::default()
        };
        // An inner ICMPv6 echo request with a correct checksum, 13 bytes of odd payload.
        let src = addr("fd00:10:244:1::5");
        let dst = addr("fd00:10:244:2::7");
        let mut l4 = vec![128, 0, 0, 0, 0x12, 0x34, 0, 1];
        l4.extend_from_slice(b"odd payload!!");
        let mut sum = pseudo_header(&src, &dst, l4.len() as u32, 58);
        let mut padded = l4.clone();
        padded.push(0);
        for w in padded.chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        let c = !csum::fold(sum);
        l4[2..4].copy_from_slice(&c.to_be_bytes());
        let mut inner = [0u8; 40];
        inner[0] = 0x6b; // traffic class 0xb3: ECN CE
        inner[1] = 0x30;
        inner[4..6].copy_from_slice(&(l4.len() as u16).to_be_bytes());
        inner[6] = 58;
        inner[7] = 63;
        inner[8..24].copy_from_slice(&src);
        inner[24..40].copy_from_slice(&dst);
        let h = headers(&cfg, &peer, &inner, 50000);
        let packet = [&inner[..], &l4[..]].concat();
        assert_eq!(
            u16::from_be_bytes([h[46], h[47]]),
            full_udp_checksum(&h, &packet)
        );
        assert_eq!(h[0], 0x60, "traffic class: CE becomes ECT(0) = 0x02");
        assert_eq!(h[1], 0x20);
        assert_eq!(&h[2..4], &[0, 0], "flow label 0");
        assert_eq!(
            usize::from(u16::from_be_bytes([h[4], h[5]])),
            30 + packet.len()
        );
        assert_eq!((h[6], h[7]), (17, 64));
        assert_eq!(&h[48..56], &[0x08, 0, 0, 0, 0, 0, 1, 0]);
        assert_eq!(&h[56..62], &peer.vtep_mac);
        assert_eq!(&h[62..68], &cfg.vtep_mac);
        assert_eq!(&h[68..70], &[0x86, 0xdd]);
    }
}
