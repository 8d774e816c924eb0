//! The packet parser shared by every TC and XDP program.
//!
//! [`parse`] walks Ethernet → IPv4 / IPv6 / ARP → TCP / UDP / ICMP and returns where the headers
//! are and which [`Reason`] class the packet belongs to, or the malformed-packet reason that
//! stopped it. Every read goes through [`ptr_at`], which checks the access against the end of the
//! packet data, so the verifier accepts it and a short packet can never be read past its end.
//!
//! The parser only sees the context through [`PacketCtx`], implemented for `TcContext`,
//! `XdpContext` and (in the unit tests) a plain byte slice.

use core::mem::size_of;

use aya_ebpf::programs::{TcContext, XdpContext};
use flannel_common::stats::Reason;
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};

use crate::encap::{VXLAN_FLAG_I, VXLAN_HDR_AT, VXLAN_INNER_L3};

/// EtherType IPv4.
pub const ETH_P_IP: u16 = 0x0800;
/// EtherType ARP.
pub const ETH_P_ARP: u16 = 0x0806;
/// EtherType IPv6.
pub const ETH_P_IPV6: u16 = 0x86dd;

/// IP protocol numbers the parser knows.
pub mod proto {
    /// ICMP (IPv4).
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// ICMPv6.
    pub const ICMPV6: u8 = 58;
}

/// Ethernet header length (no VLAN tag).
pub const ETH_HDR_LEN: usize = EthHdr::LEN;
/// IPv4 header length without options.
pub const IPV4_HDR_LEN: usize = Ipv4Hdr::LEN;
/// IPv6 fixed header length.
pub const IPV6_HDR_LEN: usize = Ipv6Hdr::LEN;
/// TCP header length without options.
pub const TCP_HDR_LEN: usize = TcpHdr::LEN;
/// UDP header length.
pub const UDP_HDR_LEN: usize = UdpHdr::LEN;
/// ICMP and ICMPv6 header length the parser requires (type, code, checksum and the 4-byte
/// rest-of-header every message type has).
pub const ICMP_HDR_LEN: usize = 8;

/// How many leading bytes the TC programs make linear before parsing: the largest header chain
/// the parser reads (Ethernet, IPv4 with 40 bytes of options, TCP) rounded up.
pub const PULL_LEN: usize = 128;

/// IPv4 "more fragments" flag, in the flags/fragment-offset field (host order).
pub const IPV4_MF: u16 = 0x2000;
/// IPv4 fragment offset mask, in the flags/fragment-offset field (host order).
pub const IPV4_OFFSET_MASK: u16 = 0x1fff;

/// What a program needs from its context to parse a packet.
pub trait PacketCtx {
    /// Address of the first byte of the packet (the Ethernet header).
    fn data(&self) -> usize;
    /// Address one past the last byte that can be read directly.
    fn data_end(&self) -> usize;
    /// Length of the whole packet in bytes, from the Ethernet header on. For an skb this also
    /// counts paged data beyond [`PacketCtx::data_end`].
    fn packet_len(&self) -> usize;
    /// Makes the first `len` bytes (or the whole packet, if shorter) directly readable. Only
    /// skbs can be non-linear; the default does nothing.
    #[inline(always)]
    fn pull_headers(&self, _len: usize) {}
    /// Whether the packet is a GSO packet (only skbs can be).
    #[inline(always)]
    fn is_gso(&self) -> bool {
        false
    }
}

// The context's `data`/`data_end` are read with volatile loads. Otherwise LLVM proves a later
// bounds check redundant from an earlier one (or, for XDP, from `packet_len`, which is
// `data_end - data`) and drops it; the verifier, which tracks bounds per packet pointer, then
// rejects the access. A fresh load per check keeps every check next to the pointer it covers.

impl PacketCtx for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        // SAFETY: the kernel passes a valid __sk_buff; `data` is readable by TC programs.
        unsafe { core::ptr::read_volatile(&raw const (*self.skb.skb).data) as usize }
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        // SAFETY: as above, for `data_end`.
        unsafe { core::ptr::read_volatile(&raw const (*self.skb.skb).data_end) as usize }
    }

    #[inline(always)]
    fn packet_len(&self) -> usize {
        self.len() as usize
    }

    #[inline(always)]
    fn pull_headers(&self, len: usize) {
        let want = if self.packet_len() < len {
            self.packet_len()
        } else {
            len
        };
        if PacketCtx::data(self) + want > PacketCtx::data_end(self)
            && linear_tcp_headers(self).is_none()
        {
            // On failure the packet stays as it was and the parser reports it truncated.
            let _ = self.pull_data(want as u32);
        }
    }

    #[inline(always)]
    fn is_gso(&self) -> bool {
        crate::fib::gso_size(self) != 0
    }
}

impl PacketCtx for XdpContext {
    #[inline(always)]
    fn data(&self) -> usize {
        // SAFETY: the kernel passes a valid xdp_md; `data` is readable by XDP programs.
        unsafe { core::ptr::read_volatile(&raw const (*self.ctx).data) as usize }
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        // SAFETY: as above, for `data_end`.
        unsafe { core::ptr::read_volatile(&raw const (*self.ctx).data_end) as usize }
    }

    #[inline(always)]
    fn packet_len(&self) -> usize {
        PacketCtx::data_end(self) - PacketCtx::data(self)
    }
}

/// A pointer to a `T` at `offset` bytes into the packet, if all of it lies before
/// [`PacketCtx::data_end`].
///
/// `T` must have alignment 1 (byte arrays and the `network_types` header structs): packet data
/// carries no alignment guarantee.
#[inline(always)]
pub fn ptr_at<C: PacketCtx, T>(ctx: &C, offset: usize) -> Option<*const T> {
    let start = ctx.data();
    if start + offset + size_of::<T>() > ctx.data_end() {
        return None;
    }
    Some((start + offset) as *const T)
}

/// Mutable variant of [`ptr_at`], for programs that rewrite headers.
#[inline(always)]
pub fn ptr_at_mut<C: PacketCtx, T>(ctx: &C, offset: usize) -> Option<*mut T> {
    ptr_at::<C, T>(ctx, offset).map(|p| p.cast_mut())
}

/// Writes the Ethernet header's destination and source MACs; `None` (nothing written) if the
/// header is not in the packet data.
#[inline(always)]
pub fn write_macs<C: PacketCtx>(ctx: &C, dmac: [u8; 6], smac: [u8; 6]) -> Option<()> {
    let eth = ptr_at_mut::<C, [u8; 12]>(ctx, 0)?;
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(&dmac);
    macs[6..].copy_from_slice(&smac);
    // SAFETY: ptr_at_mut checked the 12 bytes lie within the packet.
    unsafe { eth.write_unaligned(macs) };
    Some(())
}

/// The length of an IPv4 TCP packet's header chain (Ethernet, IPv4 with its options, TCP with
/// its options), bare or inside VXLAN (outer IPv4 without options, UDP, VXLAN, then the inner
/// chain), when all of it is directly readable; `None` otherwise (other protocols and tunnels,
/// IPv6, VLAN tags, a short linear part).
///
/// The programs read nothing of a TCP packet beyond its headers, and the stack's own TCP
/// packets carry exactly their headers in the linear part with the payload in pages (so do
/// VXLAN packets the fast path built from them: the tunnel headers are inserted in the head):
/// such a packet needs no [`PacketCtx::pull_headers`], whose `bpf_skb_pull_data` would move
/// payload into the head and, for the clones TCP transmits, reallocate the head of every
/// packet.
#[inline(always)]
pub fn linear_tcp_headers<C: PacketCtx>(ctx: &C) -> Option<usize> {
    if let Some(end) = tcp_chain_end(ctx) {
        return Some(end);
    }
    // VXLAN: outer IPv4 without options carrying UDP, the VXLAN "I" flag, an inner IPv4
    // header without options (as the fast path and the kernel send them; fixed offsets keep
    // the bounds checks simple for the verifier) carrying TCP.
    if read::<C, [u8; 2]>(ctx, 12)? != ETH_P_IP.to_be_bytes()
        || read::<C, u8>(ctx, ETH_HDR_LEN)? != 0x45
        || read::<C, u8>(ctx, ETH_HDR_LEN + 9)? != proto::UDP
        || read::<C, u8>(ctx, VXLAN_HDR_AT)? != VXLAN_FLAG_I
        || read::<C, [u8; 2]>(ctx, VXLAN_INNER_L3 - 2)? != ETH_P_IP.to_be_bytes()
        || read::<C, u8>(ctx, VXLAN_INNER_L3)? != 0x45
        || read::<C, u8>(ctx, VXLAN_INNER_L3 + 9)? != proto::TCP
    {
        return None;
    }
    tcp_header_end(ctx, VXLAN_INNER_L3 + IPV4_HDR_LEN)
}

/// The end of the packet's IPv4 TCP header chain, if all of it is readable.
#[inline(always)]
fn tcp_chain_end<C: PacketCtx>(ctx: &C) -> Option<usize> {
    if read::<C, [u8; 2]>(ctx, 12)? != ETH_P_IP.to_be_bytes() {
        return None;
    }
    let l3 = ETH_HDR_LEN;
    let version_ihl: u8 = read(ctx, l3)?;
    let ihl = usize::from(version_ihl & 0x0f) * 4;
    if version_ihl >> 4 != 4 || ihl < IPV4_HDR_LEN || read::<C, u8>(ctx, l3 + 9)? != proto::TCP {
        return None;
    }
    tcp_header_end(ctx, l3 + ihl)
}

/// The end of the TCP header (options included) at `l4`, if all of it is readable and its
/// data offset is sane.
#[inline(always)]
fn tcp_header_end<C: PacketCtx>(ctx: &C, l4: usize) -> Option<usize> {
    let doff = usize::from(read::<C, u8>(ctx, l4 + 12)? >> 4) * 4;
    if doff < TCP_HDR_LEN {
        return None;
    }
    let end = l4 + doff;
    read::<C, u8>(ctx, end - 1)?;
    Some(end)
}

/// Reads a `T` (alignment 1) at `offset`, if it lies within the packet data.
#[inline(always)]
fn read<C: PacketCtx, T: Copy>(ctx: &C, offset: usize) -> Option<T> {
    // SAFETY: ptr_at checked that the whole `T` lies within the packet data.
    ptr_at::<C, T>(ctx, offset).map(|p| unsafe { p.read_unaligned() })
}

/// Where the headers of a parsed packet are, and its class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet {
    /// The classification (always of kind [`flannel_common::stats::ReasonKind::Class`]).
    pub class: Reason,
    /// EtherType (host order).
    pub ethertype: u16,
    /// Offset of the L3 header (after Ethernet).
    pub l3_offset: usize,
    /// Offset of the L4 header; 0 when the packet is not IP. For IPv4 fragments and IPv6
    /// extension headers it is where the next header starts, not a checked L4 header.
    pub l4_offset: usize,
    /// IPv4 protocol or IPv6 next header; 0 when not IP.
    pub ip_proto: u8,
    /// Offset one past the IP datagram (total length / payload length), excluding any link-layer
    /// padding after it; 0 when not IP.
    pub ip_end: usize,
}

impl Packet {
    #[inline(always)]
    fn non_ip(class: Reason, ethertype: u16) -> Self {
        Packet {
            class,
            ethertype,
            l3_offset: ETH_HDR_LEN,
            l4_offset: 0,
            ip_proto: 0,
            ip_end: 0,
        }
    }
}

/// Parses the packet in `ctx`: its layout and class, or the reason it is malformed.
#[inline(always)]
pub fn parse<C: PacketCtx>(ctx: &C) -> Result<Packet, Reason> {
    let ethertype: [u8; 2] = read(ctx, 12).ok_or(Reason::EthTruncated)?;
    let ethertype = u16::from_be_bytes(ethertype);
    match ethertype {
        ETH_P_IP => parse_ipv4(ctx, ETH_HDR_LEN, ctx.packet_len()),
        ETH_P_IPV6 => parse_ipv6(ctx, ETH_HDR_LEN, ctx.packet_len()),
        ETH_P_ARP => Ok(Packet::non_ip(Reason::Arp, ethertype)),
        _ => Ok(Packet::non_ip(Reason::OtherEthertype, ethertype)),
    }
}

/// The reason to count the packet in `ctx` under: its class, or why it is malformed.
#[inline(always)]
pub fn classify<C: PacketCtx>(ctx: &C) -> Reason {
    match parse(ctx) {
        Ok(packet) => packet.class,
        Err(reason) => reason,
    }
}

/// Parses the IPv4 packet inside a tunnel: its header starts at `l3` and the tunnel's payload
/// ends at `end` (the outer datagram's end, or its UDP payload's; see
/// [`crate::encap::udp_payload_end`]). Its layout and class, or the reason it is malformed: a
/// total length beyond `end` is [`Reason::Ipv4BadLength`], for the bytes after the outer
/// datagram (link-layer padding) are not part of it; the kernel trims them off before its
/// tunnel sees the packet.
#[inline(always)]
pub fn parse_ipv4_at<C: PacketCtx>(ctx: &C, l3: usize, end: usize) -> Result<Packet, Reason> {
    parse_ipv4(ctx, l3, end)
}

/// Parses the IPv6 packet inside a tunnel whose header starts at `l3` and whose payload ends at
/// `end`, as [`parse_ipv4_at`] does (a payload length beyond `end` is
/// [`Reason::Ipv6BadLength`]).
#[inline(always)]
pub fn parse_ipv6_at<C: PacketCtx>(ctx: &C, l3: usize, end: usize) -> Result<Packet, Reason> {
    parse_ipv6(ctx, l3, end)
}

/// The IPv4 packet at `l3`, which must end by `limit`.
#[inline(always)]
fn parse_ipv4<C: PacketCtx>(ctx: &C, l3: usize, limit: usize) -> Result<Packet, Reason> {
    let hdr: Ipv4Hdr = read(ctx, l3).ok_or(Reason::Ipv4Truncated)?;
    if hdr.vihl >> 4 != 4 {
        return Err(Reason::Ipv4BadVersion);
    }
    let hdr_len = ((hdr.vihl & 0x0f) as usize) * 4;
    if hdr_len < IPV4_HDR_LEN {
        return Err(Reason::Ipv4BadIhl);
    }
    if ctx.data() + l3 + hdr_len > ctx.data_end() {
        return Err(Reason::Ipv4Truncated);
    }
    let total_len = u16::from_be_bytes(hdr.tot_len) as usize;
    let total_len = if total_len == 0 && hdr.proto == proto::TCP {
        big_tcp_len(ctx, l3, limit)
    } else {
        total_len
    };
    if total_len < hdr_len || l3 + total_len > limit {
        return Err(Reason::Ipv4BadLength);
    }

    let l4 = l3 + hdr_len;
    let end = l3 + total_len;
    let packet = |class| Packet {
        class,
        ethertype: ETH_P_IP,
        l3_offset: l3,
        l4_offset: l4,
        ip_proto: hdr.proto,
        ip_end: end,
    };

    // A fragment's L4 header is either absent (offset != 0) or only partly meaningful; the
    // kernel reassembles, so fragments are classified before any L4 check.
    if u16::from_be_bytes(hdr.frags) & (IPV4_MF | IPV4_OFFSET_MASK) != 0 {
        return Ok(packet(Reason::Ipv4Fragment));
    }
    let class = match hdr.proto {
        proto::TCP => {
            check_tcp(ctx, l4, end)?;
            Reason::Ipv4Tcp
        }
        proto::UDP => {
            check_l4::<C, UDP_HDR_LEN>(ctx, l4, end)?;
            Reason::Ipv4Udp
        }
        proto::ICMP => {
            check_l4::<C, ICMP_HDR_LEN>(ctx, l4, end)?;
            Reason::Ipv4Icmp
        }
        _ => Reason::Ipv4OtherProto,
    };
    if hdr_len > IPV4_HDR_LEN {
        return Ok(packet(Reason::Ipv4Options));
    }
    Ok(packet(class))
}

/// The length of the IPv4 TCP packet at `l3` whose total length is 0: for a GSO packet (BIG
/// TCP, longer than 64 KB) the packet's own up to `limit`, as the kernel's `iph_totlen` says;
/// 0 (malformed) otherwise. A BPF subprogram of its own: inlined, its registers pushed the
/// NAT's call chain past the 512-byte stack.
#[inline(never)]
fn big_tcp_len<C: PacketCtx>(ctx: &C, l3: usize, limit: usize) -> usize {
    if ctx.is_gso() {
        limit.saturating_sub(l3)
    } else {
        0
    }
}

/// The IPv6 packet at `l3`, which must end by `limit`.
#[inline(always)]
fn parse_ipv6<C: PacketCtx>(ctx: &C, l3: usize, limit: usize) -> Result<Packet, Reason> {
    let hdr: Ipv6Hdr = read(ctx, l3).ok_or(Reason::Ipv6Truncated)?;
    if hdr.vcf[0] >> 4 != 6 {
        return Err(Reason::Ipv6BadVersion);
    }
    let payload_len = u16::from_be_bytes(hdr.payload_len) as usize;
    let big_l4 = if payload_len == 0 && (hdr.next_hdr == proto::TCP || hdr.next_hdr == HOP_BY_HOP) {
        big_tcp6_l4(ctx, l3, limit, hdr.next_hdr)
    } else {
        0
    };
    let (next_hdr, l4, end) = if big_l4 == 0 {
        let l4 = l3 + IPV6_HDR_LEN;
        (hdr.next_hdr, l4, l4 + payload_len)
    } else {
        (proto::TCP, big_l4, limit)
    };
    if end > limit {
        return Err(Reason::Ipv6BadLength);
    }
    let class = match next_hdr {
        proto::TCP => {
            check_tcp(ctx, l4, end)?;
            Reason::Ipv6Tcp
        }
        proto::UDP => {
            check_l4::<C, UDP_HDR_LEN>(ctx, l4, end)?;
            Reason::Ipv6Udp
        }
        proto::ICMPV6 => {
            check_l4::<C, ICMP_HDR_LEN>(ctx, l4, end)?;
            Reason::Ipv6Icmp
        }
        next if is_ipv6_extension_header(next) => Reason::Ipv6ExtHeader,
        _ => Reason::Ipv6OtherProto,
    };
    Ok(Packet {
        class,
        ethertype: ETH_P_IPV6,
        l3_offset: l3,
        l4_offset: l4,
        ip_proto: next_hdr,
        ip_end: end,
    })
}

/// IPv6 hop-by-hop options header (next header value).
const HOP_BY_HOP: u8 = 0;
/// The jumbo payload option (RFC 2675).
const JUMBO_OPTION: u8 = 0xc2;

/// The offset of the TCP header of the IPv6 packet at `l3` whose payload length is 0 and
/// whose next header is `next_hdr`, if it is a GSO packet whose payload up to `limit` is longer
/// than 65,535 bytes (BIG TCP), as the kernel builds them: TCP right after the IPv6 header, or
/// after a hop-by-hop header holding just the jumbo payload option, whose length (hop-by-hop
/// header included) must be that payload's (`ipv6_has_hopopt_jumbo`; RFC 2675). 0 (malformed,
/// or an extension header) otherwise. A BPF subprogram of its own, like [`big_tcp_len`].
#[inline(never)]
fn big_tcp6_l4<C: PacketCtx>(ctx: &C, l3: usize, limit: usize, next_hdr: u8) -> usize {
    let l4 = l3 + IPV6_HDR_LEN;
    if !ctx.is_gso() || limit <= l4 + 0xffff {
        return 0;
    }
    if next_hdr == proto::TCP {
        return l4;
    }
    let Some(hbh) = read::<C, [u8; 8]>(ctx, l4) else {
        return 0;
    };
    let jumbo = u32::from_be_bytes([hbh[4], hbh[5], hbh[6], hbh[7]]) as usize;
    let head = u32::from_be_bytes([hbh[0], hbh[1], hbh[2], hbh[3]]);
    if head == u32::from_be_bytes([proto::TCP, 0, JUMBO_OPTION, 4]) && jumbo == limit - l4 {
        l4 + 8
    } else {
        0
    }
}

/// Whether `next_header` is one of the IPv6 extension headers in IANA's registry (RFC 8200 §4,
/// RFC 7045): hop-by-hop, routing, fragment, ESP, AH, destination options, mobility, HIP,
/// shim6 and the two experimental values.
#[inline(always)]
pub fn is_ipv6_extension_header(next_header: u8) -> bool {
    matches!(
        next_header,
        0 | 43 | 44 | 50 | 51 | 60 | 135 | 139 | 140 | 253 | 254
    )
}

/// A pointer to an L4 header of type `T` at `l4`, if it lies within the datagram ending at
/// `end` and within the readable data.
///
/// Callers read the header through the returned pointer: the verifier tracks the bounds check
/// per pointer, so re-deriving the address from `data + offset` would be rejected.
#[inline(always)]
fn l4_header<C: PacketCtx, T>(ctx: &C, l4: usize, end: usize) -> Result<*const T, Reason> {
    if l4 + size_of::<T>() > end {
        return Err(Reason::L4Truncated);
    }
    ptr_at::<C, T>(ctx, l4).ok_or(Reason::L4Truncated)
}

/// Checks an L4 header of `LEN` bytes (UDP, ICMP, ICMPv6).
#[inline(always)]
fn check_l4<C: PacketCtx, const LEN: usize>(ctx: &C, l4: usize, end: usize) -> Result<(), Reason> {
    l4_header::<C, [u8; LEN]>(ctx, l4, end).map(|_| ())
}

/// Checks a TCP header: fixed part present, data offset at least 5 and within the datagram.
#[inline(always)]
fn check_tcp<C: PacketCtx>(ctx: &C, l4: usize, end: usize) -> Result<(), Reason> {
    let hdr = l4_header::<C, [u8; TCP_HDR_LEN]>(ctx, l4, end)?;
    // SAFETY: l4_header checked that all TCP_HDR_LEN bytes are readable.
    let offset_byte = unsafe { (*hdr)[12] };
    let hdr_len = ((offset_byte >> 4) as usize) * 4;
    if hdr_len < TCP_HDR_LEN || l4 + hdr_len > end {
        return Err(Reason::TcpBadOffset);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use flannel_common::stats::ReasonKind;

    use super::*;

    /// A packet in a byte slice, as the parser sees it in the kernel.
    struct Slice<'a>(&'a [u8]);

    impl PacketCtx for Slice<'_> {
        fn data(&self) -> usize {
            self.0.as_ptr() as usize
        }
        fn data_end(&self) -> usize {
            self.0.as_ptr() as usize + self.0.len()
        }
        fn packet_len(&self) -> usize {
            self.0.len()
        }
    }

    /// A [`Slice`] that is a GSO packet.
    struct GsoSlice<'a>(Slice<'a>);

    impl PacketCtx for GsoSlice<'_> {
        fn data(&self) -> usize {
            self.0.data()
        }
        fn data_end(&self) -> usize {
            self.0.data_end()
        }
        fn packet_len(&self) -> usize {
            self.0.packet_len()
        }
        fn is_gso(&self) -> bool {
            true
        }
    }

    fn eth(ethertype: u16) -> Vec<u8> {
        let mut frame = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2];
        frame.extend_from_slice(&ethertype.to_be_bytes());
        frame
    }

    /// IPv4 header (checksum left zero: the parser does not check it) + `l4` bytes.
    fn ipv4(proto: u8, options: &[u8], frags: u16, l4: &[u8]) -> Vec<u8> {
        let hdr_len = 20 + options.len();
        let total = (hdr_len + l4.len()) as u16;
        let mut frame = eth(ETH_P_IP);
        frame.push(0x40 | (hdr_len / 4) as u8);
        frame.push(0);
        frame.extend_from_slice(&total.to_be_bytes());
        frame.extend_from_slice(&[0, 1]);
        frame.extend_from_slice(&frags.to_be_bytes());
        frame.extend_from_slice(&[64, proto, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2]);
        frame.extend_from_slice(options);
        frame.extend_from_slice(l4);
        frame
    }

    fn ipv6(next: u8, l4: &[u8]) -> Vec<u8> {
        let mut frame = eth(ETH_P_IPV6);
        frame.extend_from_slice(&[0x60, 0, 0, 0]);
        frame.extend_from_slice(&(l4.len() as u16).to_be_bytes());
        frame.extend_from_slice(&[next, 64]);
        frame.extend_from_slice(&[0xfd; 32]);
        frame.extend_from_slice(l4);
        frame
    }

    fn tcp() -> Vec<u8> {
        let mut seg = vec![0u8; 20];
        seg[12] = 5 << 4;
        seg
    }

    fn reason(frame: &[u8]) -> Reason {
        classify(&Slice(frame))
    }

    #[test]
    fn tcp_headers_in_the_linear_part_need_no_pull() {
        // Ethernet + IPv4 with 4 bytes of options + TCP with 12 bytes of options, then payload
        // (the linear part ends where the slice ends).
        let mut seg = vec![0u8; 32];
        seg[12] = 8 << 4;
        let frame = ipv4(proto::TCP, &[1, 1, 1, 0], 0, &seg);
        assert_eq!(linear_tcp_headers(&Slice(&frame)), Some(14 + 24 + 32));
        let with_payload = [frame.clone(), vec![0xab; 100]].concat();
        assert_eq!(linear_tcp_headers(&Slice(&with_payload)), Some(70));
        // The TCP options reach past the linear part: pull.
        assert_eq!(linear_tcp_headers(&Slice(&frame[..69])), None);
        // Only part of the fixed TCP header is linear: pull.
        assert_eq!(linear_tcp_headers(&Slice(&frame[..14 + 24 + 12])), None);
        // A data offset below 5 words is not a header chain to trust.
        let mut bad = frame.clone();
        bad[14 + 24 + 12] = 4 << 4;
        assert_eq!(linear_tcp_headers(&Slice(&bad)), None);
        // Everything else is pulled as before: UDP (tunnels), ICMP (errors quote headers),
        // IPv6, a non-IPv4 version nibble.
        for other in [
            ipv4(proto::UDP, &[], 0, &[0; 8]),
            ipv4(proto::ICMP, &[], 0, &[8, 0, 0, 0, 0, 1, 0, 1]),
            ipv6(proto::TCP, &tcp()),
        ] {
            assert_eq!(linear_tcp_headers(&Slice(&other)), None);
        }
        let mut v5 = ipv4(proto::TCP, &[], 0, &tcp());
        v5[14] = 0x55;
        assert_eq!(linear_tcp_headers(&Slice(&v5)), None);

        // VXLAN around a TCP segment: the inner chain decides.
        let inner = ipv4(proto::TCP, &[], 0, &seg);
        let vxlan = |flags: u8| {
            let mut payload = vec![0u8; 8 + 8];
            payload[8] = flags;
            payload.extend_from_slice(&inner);
            ipv4(proto::UDP, &[], 0, &payload)
        };
        let tunnelled = vxlan(0x08);
        let end = 14 + 20 + 8 + 8 + 14 + 20 + 32;
        assert_eq!(linear_tcp_headers(&Slice(&tunnelled)), Some(end));
        assert_eq!(linear_tcp_headers(&Slice(&tunnelled[..end - 1])), None);
        // Not VXLAN (no "I" flag), or UDP around something else: pulled.
        assert_eq!(linear_tcp_headers(&Slice(&vxlan(0))), None);
        let mut udp_in_vxlan = vxlan(0x08);
        udp_in_vxlan[14 + 20 + 16 + 14 + 9] = proto::UDP;
        assert_eq!(linear_tcp_headers(&Slice(&udp_in_vxlan)), None);
        // An outer header with options is not the fast path's own VXLAN: pulled.
        let mut payload = vec![0u8; 16];
        payload[8] = 0x08;
        payload.extend_from_slice(&inner);
        let with_options = ipv4(proto::UDP, &[1, 1, 1, 0], 0, &payload);
        assert_eq!(linear_tcp_headers(&Slice(&with_options)), None);
    }

    #[test]
    fn classifies_well_formed_packets() {
        assert_eq!(reason(&ipv4(proto::TCP, &[], 0, &tcp())), Reason::Ipv4Tcp);
        assert_eq!(reason(&ipv4(proto::UDP, &[], 0, &[0; 8])), Reason::Ipv4Udp);
        assert_eq!(
            reason(&ipv4(proto::ICMP, &[], 0, &[8, 0, 0, 0, 0, 1, 0, 1])),
            Reason::Ipv4Icmp
        );
        assert_eq!(reason(&ipv4(4, &[], 0, &[])), Reason::Ipv4OtherProto);
        assert_eq!(reason(&ipv6(proto::TCP, &tcp())), Reason::Ipv6Tcp);
        assert_eq!(reason(&ipv6(proto::UDP, &[0; 8])), Reason::Ipv6Udp);
        assert_eq!(
            reason(&ipv6(proto::ICMPV6, &[128, 0, 0, 0, 0, 1, 0, 1])),
            Reason::Ipv6Icmp
        );
        assert_eq!(
            reason(&ipv6(0, &[17, 0, 1, 4, 0, 0, 0, 0])),
            Reason::Ipv6ExtHeader
        );
        assert_eq!(reason(&ipv6(59, &[])), Reason::Ipv6OtherProto);
        assert_eq!(reason(&eth(ETH_P_ARP)), Reason::Arp);
        assert_eq!(reason(&eth(0x8100)), Reason::OtherEthertype);
    }

    #[test]
    fn a_big_tcp_packet_takes_its_length_from_the_packet() {
        let mut big = ipv4(proto::TCP, &[], 0, &[tcp(), vec![7; 100]].concat());
        big[16..18].copy_from_slice(&[0, 0]);
        let parsed = parse(&GsoSlice(Slice(&big))).expect("a GSO TCP packet with total length 0");
        assert_eq!((parsed.class, parsed.ip_end), (Reason::Ipv4Tcp, big.len()));
        // Not GSO, not TCP: total length 0 is malformed, as before.
        assert_eq!(reason(&big), Reason::Ipv4BadLength);
        let mut udp = ipv4(proto::UDP, &[], 0, &[0; 8]);
        udp[16..18].copy_from_slice(&[0, 0]);
        assert_eq!(classify(&GsoSlice(Slice(&udp))), Reason::Ipv4BadLength);
    }

    #[test]
    fn an_ipv6_big_tcp_packet_takes_its_length_from_the_packet() {
        let segment = [tcp(), vec![7; 70_000]].concat();
        // Payload length 0 and a hop-by-hop header with only the jumbo option (its length
        // counts the hop-by-hop header), as this kernel builds them.
        let jumbo = (8 + segment.len() as u32).to_be_bytes();
        let hbh = [&[proto::TCP, 0, 0xc2, 4][..], &jumbo].concat();
        let mut big = ipv6(0, &[hbh, segment.clone()].concat());
        big[18..20].copy_from_slice(&[0, 0]);
        let parsed = parse(&GsoSlice(Slice(&big))).expect("a GSO TCP packet with a jumbo option");
        assert_eq!(
            (
                parsed.class,
                parsed.ip_proto,
                parsed.l4_offset,
                parsed.ip_end
            ),
            (Reason::Ipv6Tcp, proto::TCP, 14 + 48, big.len())
        );
        // Kernels that leave the hop-by-hop header out: TCP right after the IPv6 header.
        let mut bare = ipv6(proto::TCP, &segment);
        bare[18..20].copy_from_slice(&[0, 0]);
        let parsed = parse(&GsoSlice(Slice(&bare))).expect("a GSO TCP packet, payload length 0");
        assert_eq!(
            (parsed.class, parsed.l4_offset, parsed.ip_end),
            (Reason::Ipv6Tcp, 14 + 40, bare.len())
        );
        // Not GSO: what it was before (an extension header, a truncated TCP header).
        assert_eq!(reason(&big), Reason::Ipv6ExtHeader);
        assert_eq!(reason(&bare), Reason::L4Truncated);
        // A jumbo length that is not the packet's, another option, or not TCP after it.
        let gso = |f: &[u8]| classify(&GsoSlice(Slice(f)));
        // (The hop-by-hop header is bytes 54..62: next header, length, option type and
        // length, the jumbo length.)
        for (at, byte) in [(61, 0x11), (56, 0xc3), (54, proto::UDP), (55, 1)] {
            let mut odd = big.clone();
            odd[at] = byte;
            assert_eq!(gso(&odd), Reason::Ipv6ExtHeader, "byte {at} = {byte:#x}");
        }
        // Payload length 0 on a payload that fits 65,535 bytes is not a jumbogram.
        let small = [tcp(), vec![7; 65_535 - 20 - 8]].concat();
        let jumbo = (8 + small.len() as u32).to_be_bytes();
        let mut fits = ipv6(0, &[&[proto::TCP, 0, 0xc2, 4][..], &jumbo, &small].concat());
        fits[18..20].copy_from_slice(&[0, 0]);
        assert_eq!(gso(&fits), Reason::Ipv6ExtHeader);
        // A payload length that is not 0 keeps its meaning.
        let mut short = big.clone();
        short[18..20].copy_from_slice(&[0, 8]);
        assert_eq!(gso(&short), Reason::Ipv6ExtHeader);
        let mut udp = ipv6(proto::UDP, &[0; 8]);
        udp[18..20].copy_from_slice(&[0, 0]);
        assert_eq!(gso(&udp), Reason::L4Truncated);
    }

    #[test]
    fn fragments_and_options() {
        // MF set, offset 0: first fragment.
        assert_eq!(
            reason(&ipv4(proto::UDP, &[], 0x2000, &[0; 8])),
            Reason::Ipv4Fragment
        );
        // Offset != 0: no L4 header at all, still a fragment and not malformed.
        assert_eq!(
            reason(&ipv4(proto::TCP, &[], 0x0001, &[1, 2, 3])),
            Reason::Ipv4Fragment
        );
        // DF alone is not a fragment.
        assert_eq!(
            reason(&ipv4(proto::TCP, &[], 0x4000, &tcp())),
            Reason::Ipv4Tcp
        );
        // Router alert option (4 bytes).
        assert_eq!(
            reason(&ipv4(proto::TCP, &[0x94, 4, 0, 0], 0, &tcp())),
            Reason::Ipv4Options
        );
        // Options do not excuse a truncated L4 header.
        assert_eq!(
            reason(&ipv4(proto::TCP, &[0x94, 4, 0, 0], 0, &[0; 10])),
            Reason::L4Truncated
        );
    }

    #[test]
    fn malformed_packets() {
        assert_eq!(reason(&eth(ETH_P_IP)[..13]), Reason::EthTruncated);
        assert_eq!(reason(&[]), Reason::EthTruncated);
        assert_eq!(reason(&eth(ETH_P_IP)), Reason::Ipv4Truncated);
        assert_eq!(reason(&eth(ETH_P_IPV6)), Reason::Ipv6Truncated);

        let good = ipv4(proto::TCP, &[], 0, &tcp());
        assert_eq!(reason(&good[..14 + 19]), Reason::Ipv4Truncated);

        let mut bad = good.clone();
        bad[14] = 0x45 ^ 0x10; // version 5
        assert_eq!(reason(&bad), Reason::Ipv4BadVersion);

        let mut bad = good.clone();
        bad[14] = 0x44; // IHL 4
        assert_eq!(reason(&bad), Reason::Ipv4BadIhl);

        // IHL 15 (60 bytes) in a packet holding 40 bytes of IP.
        let mut bad = good.clone();
        bad[14] = 0x4f;
        assert_eq!(reason(&bad), Reason::Ipv4Truncated);

        // Total length beyond the packet, and below the header length.
        let mut bad = good.clone();
        bad[16..18].copy_from_slice(&41u16.to_be_bytes());
        assert_eq!(reason(&bad), Reason::Ipv4BadLength);
        bad[16..18].copy_from_slice(&19u16.to_be_bytes());
        assert_eq!(reason(&bad), Reason::Ipv4BadLength);

        // Total length cuts the TCP header although the bytes are there (link padding).
        let mut bad = good.clone();
        bad[16..18].copy_from_slice(&30u16.to_be_bytes());
        assert_eq!(reason(&bad), Reason::L4Truncated);

        assert_eq!(
            reason(&ipv4(proto::UDP, &[], 0, &[0; 7])),
            Reason::L4Truncated
        );
        assert_eq!(
            reason(&ipv4(proto::ICMP, &[], 0, &[8, 0, 0, 0])),
            Reason::L4Truncated
        );

        let mut bad_doff = tcp();
        bad_doff[12] = 4 << 4;
        assert_eq!(
            reason(&ipv4(proto::TCP, &[], 0, &bad_doff)),
            Reason::TcpBadOffset
        );
        bad_doff[12] = 6 << 4; // 24-byte header in a 20-byte segment
        assert_eq!(
            reason(&ipv4(proto::TCP, &[], 0, &bad_doff)),
            Reason::TcpBadOffset
        );

        let good6 = ipv6(proto::UDP, &[0; 8]);
        assert_eq!(reason(&good6[..14 + 39]), Reason::Ipv6Truncated);
        let mut bad = good6.clone();
        bad[14] = 0x40;
        assert_eq!(reason(&bad), Reason::Ipv6BadVersion);
        let mut bad = good6.clone();
        bad[18..20].copy_from_slice(&9u16.to_be_bytes());
        assert_eq!(reason(&bad), Reason::Ipv6BadLength);
        assert_eq!(reason(&ipv6(proto::TCP, &[0; 19])), Reason::L4Truncated);
        assert_eq!(
            reason(&ipv6(proto::ICMPV6, &[128, 0, 0, 0])),
            Reason::L4Truncated
        );
    }

    #[test]
    fn layout_of_a_parsed_packet() {
        let frame = ipv4(proto::UDP, &[1, 1, 1, 0], 0, &[0; 12]);
        let mut padded = frame.clone();
        padded.extend_from_slice(&[0; 6]); // Ethernet padding after the datagram
        let packet = parse(&Slice(&padded)).expect("parses");
        assert_eq!(
            packet,
            Packet {
                class: Reason::Ipv4Options,
                ethertype: ETH_P_IP,
                l3_offset: 14,
                l4_offset: 14 + 24,
                ip_proto: proto::UDP,
                ip_end: frame.len(),
            }
        );
    }

    #[test]
    fn classes_and_malformed_reasons_have_the_right_kind() {
        assert_eq!(
            reason(&ipv4(proto::TCP, &[], 0, &tcp())).kind(),
            ReasonKind::Class
        );
        assert_eq!(reason(&eth(ETH_P_IP)).kind(), ReasonKind::Malformed);
    }

    #[test]
    fn ptr_at_stops_at_data_end() {
        let frame = [0u8; 20];
        let ctx = Slice(&frame);
        assert!(ptr_at::<_, [u8; 20]>(&ctx, 0).is_some());
        assert!(ptr_at::<_, [u8; 21]>(&ctx, 0).is_none());
        assert!(ptr_at::<_, [u8; 4]>(&ctx, 16).is_some());
        assert!(ptr_at::<_, [u8; 4]>(&ctx, 17).is_none());
    }
}
