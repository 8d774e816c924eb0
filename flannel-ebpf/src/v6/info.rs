//! The IPv6 fields the fast path decides on, read once from a parsed packet.

use flannel_common::stats::Reason;

use crate::parse::{IPV6_HDR_LEN, Packet, PacketCtx, proto, ptr_at};

/// ICMPv6 echo request.
pub const ICMPV6_ECHO_REQUEST: u8 = 128;
/// ICMPv6 echo reply.
pub const ICMPV6_ECHO_REPLY: u8 = 129;

/// An IPv6 packet as the fast path sees it (no extension headers but a BIG TCP packet's jumbo
/// option, see [`crate::parse`]). Addresses and ports are network-order bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ipv6Info {
    /// Offset of the IPv6 header in the packet.
    pub l3: usize,
    /// Offset of the L4 header.
    pub l4: usize,
    /// Source address.
    pub src: [u8; 16],
    /// Destination address.
    pub dst: [u8; 16],
    /// The L4 protocol (TCP, UDP or ICMPv6).
    pub next_hdr: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class (DSCP + ECN).
    pub tclass: u8,
    /// Payload length field (0 in a BIG TCP packet).
    pub payload_len: u16,
    /// TCP/UDP source port; the identifier for ICMPv6 echo; zero otherwise.
    pub sport: [u8; 2],
    /// TCP/UDP destination port; the identifier for ICMPv6 echo; zero otherwise.
    pub dport: [u8; 2],
    /// ICMPv6 type (0 for other protocols).
    pub icmp_type: u8,
    /// Length of the L4 header: TCP data offset × 4, 8 for UDP and ICMPv6.
    pub l4_hdr_len: u16,
    /// TCP flags (0 for other protocols).
    pub tcp_flags: u8,
}

impl Ipv6Info {
    /// The offset just past the packet (by its payload length).
    #[inline(always)]
    pub fn end(&self) -> usize {
        self.l3 + IPV6_HDR_LEN + usize::from(self.payload_len)
    }

    /// Whether this is ICMPv6 echo request or reply.
    #[inline(always)]
    pub fn is_icmp_echo(&self) -> bool {
        self.next_hdr == proto::ICMPV6
            && (self.icmp_type == ICMPV6_ECHO_REQUEST || self.icmp_type == ICMPV6_ECHO_REPLY)
    }

    /// Whether the packet has ports (TCP or UDP).
    #[inline(always)]
    pub fn has_ports(&self) -> bool {
        self.next_hdr == proto::TCP || self.next_hdr == proto::UDP
    }

    /// Whether the packet could open a connection ([`crate::ipv4::Ipv4Info::opens_a_flow`]).
    #[inline(always)]
    pub fn opens_a_flow(&self) -> bool {
        crate::ipv4::opens_a_flow(self.next_hdr, self.tcp_flags)
    }
}

/// Why a parsed IPv6 packet is not one the fast path forwards: malformed, with extension
/// headers, or neither TCP, UDP nor ICMPv6.
#[inline(always)]
pub fn screen(parsed: &Result<Packet, Reason>) -> Result<Packet, Reason> {
    match parsed {
        Err(_) => Err(Reason::PassMalformed),
        Ok(p) => match p.class {
            Reason::Ipv6Tcp | Reason::Ipv6Udp | Reason::Ipv6Icmp => Ok(*p),
            Reason::Ipv6ExtHeader => Err(Reason::PassIpv6ExtHeader),
            Reason::Ipv6OtherProto => Err(Reason::PassOtherProto),
            _ => Err(Reason::PassMalformed),
        },
    }
}

/// Writes the fields of the IPv6 header `hdr` found at `l3`, with L4 protocol `next_hdr` at
/// `l4`, into `info`, its L4 fields cleared (ports, ICMPv6 type, header length).
#[inline(always)]
pub fn header_into(hdr: &[u8; 40], l3: usize, l4: usize, next_hdr: u8, info: &mut Ipv6Info) {
    info.l3 = l3;
    info.l4 = l4;
    info.next_hdr = next_hdr;
    info.hop_limit = hdr[7];
    info.tclass = (hdr[0] << 4) | (hdr[1] >> 4);
    info.payload_len = u16::from_be_bytes([hdr[4], hdr[5]]);
    info.src.copy_from_slice(&hdr[8..24]);
    info.dst.copy_from_slice(&hdr[24..40]);
    info.sport = [0; 2];
    info.dport = [0; 2];
    info.icmp_type = 0;
    info.l4_hdr_len = 0;
    info.tcp_flags = 0;
}

/// Reads the fields of an IPv6 packet [`screen`] accepted into `info` (in place: the programs
/// keep it in a per-CPU scratch map, off their stack). False if the bytes are not readable.
#[inline(always)]
pub fn read_into<C: PacketCtx>(ctx: &C, packet: &Packet, info: &mut Ipv6Info) -> bool {
    let l3 = packet.l3_offset;
    let Some(hdr) = ptr_at::<C, [u8; 40]>(ctx, l3) else {
        return false;
    };
    let Some(l4) = ptr_at::<C, [u8; 8]>(ctx, packet.l4_offset) else {
        return false;
    };
    // SAFETY: ptr_at checked the 40 (and 8) bytes are readable; the parser checked the L4
    // header is at least 8 bytes.
    let (hdr, l4) = unsafe { (&*hdr, &*l4) };
    header_into(hdr, l3, packet.l4_offset, packet.ip_proto, info);
    match info.next_hdr {
        proto::TCP => {
            info.sport = [l4[0], l4[1]];
            info.dport = [l4[2], l4[3]];
            let Some(p) = ptr_at::<C, [u8; 14]>(ctx, packet.l4_offset) else {
                return false;
            };
            // SAFETY: as above (the parser checked the 20-byte TCP header).
            let [offset_byte, flags] = unsafe { [(*p)[12], (*p)[13]] };
            info.tcp_flags = flags;
            info.l4_hdr_len = u16::from(offset_byte >> 4) * 4;
        }
        proto::UDP => {
            info.sport = [l4[0], l4[1]];
            info.dport = [l4[2], l4[3]];
            info.l4_hdr_len = 8;
        }
        proto::ICMPV6 => {
            info.icmp_type = l4[0];
            if info.is_icmp_echo() {
                info.sport = [l4[4], l4[5]];
                info.dport = [l4[4], l4[5]];
            }
            info.l4_hdr_len = 8;
        }
        _ => {}
    }
    true
}
