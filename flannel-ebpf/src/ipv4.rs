//! The IPv4 fields the fast path decides on, read once from a parsed packet, and the in-place
//! TTL decrement every forwarding path applies.

use flannel_common::{csum, stats::Reason};

use crate::parse::{Packet, PacketCtx, proto, ptr_at, ptr_at_mut};

/// ICMP echo reply.
pub const ICMP_ECHO_REPLY: u8 = 0;
/// ICMP echo request.
pub const ICMP_ECHO_REQUEST: u8 = 8;

/// TCP flag bits.
pub const TCP_SYN: u8 = 0x02;
/// TCP RST.
pub const TCP_RST: u8 = 0x04;
/// TCP ACK.
pub const TCP_ACK: u8 = 0x10;

/// IPv4 "don't fragment" flag in the first byte of the flags/offset field.
const IPV4_DF_BYTE: u8 = 0x40;

/// An IPv4 packet as the fast path sees it. Addresses and ports are network-order bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ipv4Info {
    /// Offset of the IPv4 header in the packet.
    pub l3: usize,
    /// Offset of the L4 header.
    pub l4: usize,
    /// Source address.
    pub src: [u8; 4],
    /// Destination address.
    pub dst: [u8; 4],
    /// Protocol.
    pub proto: u8,
    /// Time to live.
    pub ttl: u8,
    /// Type of service (DSCP + ECN).
    pub tos: u8,
    /// Whether DF is set.
    pub dont_fragment: bool,
    /// Total length field.
    pub tot_len: u16,
    /// Header checksum field (as a big-endian value).
    pub check: u16,
    /// TCP/UDP source port; the identifier for ICMP echo; zero otherwise.
    pub sport: [u8; 2],
    /// TCP/UDP destination port; the identifier for ICMP echo; zero otherwise.
    pub dport: [u8; 2],
    /// ICMP type (0 for other protocols).
    pub icmp_type: u8,
    /// Length of the L4 header: TCP data offset × 4, 8 for UDP and ICMP, 0 otherwise.
    pub l4_hdr_len: u16,
}

impl Ipv4Info {
    /// The offset just past the datagram (by its total length).
    #[inline(always)]
    pub fn end(&self) -> usize {
        self.l3 + usize::from(self.tot_len)
    }

    /// The IP length of each of its segments, for a GSO packet whose segments carry
    /// `gso_size` bytes of payload after these headers.
    #[inline(always)]
    pub fn segment_len(&self, gso_size: u32) -> u32 {
        (self.l4 - self.l3) as u32 + u32::from(self.l4_hdr_len) + gso_size
    }

    /// Whether this is ICMP echo request or reply.
    #[inline(always)]
    pub fn is_icmp_echo(&self) -> bool {
        self.proto == proto::ICMP
            && (self.icmp_type == ICMP_ECHO_REQUEST || self.icmp_type == ICMP_ECHO_REPLY)
    }

    /// Whether the packet, read by `ctx`, could open a connection ([`opens_a_flow`]; the TCP
    /// flags are read from the packet: kept out of this struct, which the programs' deepest
    /// call chains carry on their stack).
    #[inline(always)]
    pub fn opens_a_flow<C: PacketCtx>(&self, ctx: &C) -> bool {
        let flags = if self.proto == proto::TCP {
            match ptr_at::<C, u8>(ctx, self.l4 + 13) {
                // SAFETY: ptr_at checked the byte is readable.
                Some(p) => unsafe { *p },
                None => return false,
            }
        } else {
            0
        };
        opens_a_flow(self.proto, flags)
    }

    /// Whether the packet has ports (TCP or UDP).
    #[inline(always)]
    pub fn has_ports(&self) -> bool {
        self.proto == proto::TCP || self.proto == proto::UDP
    }
}

/// Whether a packet of protocol `proto` with TCP flags `tcp_flags` could open a connection: a
/// TCP SYN without ACK (nor RST), or any UDP datagram (UDP does not say).
#[inline(always)]
pub fn opens_a_flow(proto: u8, tcp_flags: u8) -> bool {
    match proto {
        proto::TCP => tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN,
        proto::UDP => true,
        _ => false,
    }
}

/// Why a parsed packet is not one the fast path forwards: not IPv4, malformed, a fragment, IP
/// options, or a protocol other than TCP, UDP and ICMP.
#[inline(always)]
pub fn screen(parsed: &Result<Packet, Reason>) -> Result<Packet, Reason> {
    match parsed {
        Err(_) => Err(Reason::PassMalformed),
        Ok(p) => match p.class {
            Reason::Ipv4Tcp | Reason::Ipv4Udp | Reason::Ipv4Icmp => Ok(*p),
            Reason::Ipv4Fragment => Err(Reason::PassFragment),
            Reason::Ipv4Options => Err(Reason::PassIpOptions),
            Reason::Ipv4OtherProto => Err(Reason::PassOtherProto),
            _ => Err(Reason::PassNotIpv4),
        },
    }
}

/// Reads the fields of a well-formed, unfragmented IPv4 packet without options (a packet
/// [`screen`] accepted), or `None` if the bytes are not readable.
#[inline(always)]
pub fn read<C: PacketCtx>(ctx: &C, packet: &Packet) -> Option<Ipv4Info> {
    let hdr = ptr_at::<C, [u8; 20]>(ctx, packet.l3_offset)?;
    // SAFETY: ptr_at checked that the 20 bytes are readable.
    let hdr = unsafe { hdr.read_unaligned() };
    let mut info = header_fields(&hdr, packet.l3_offset);
    info.l4 = packet.l4_offset;
    let l4: [u8; 8] = {
        let p = ptr_at::<C, [u8; 8]>(ctx, packet.l4_offset)?;
        // SAFETY: as above; the parser checked TCP/UDP/ICMP headers are at least 8 bytes.
        unsafe { p.read_unaligned() }
    };
    match info.proto {
        proto::TCP => {
            info.sport = [l4[0], l4[1]];
            info.dport = [l4[2], l4[3]];
            let p = ptr_at::<C, [u8; 13]>(ctx, packet.l4_offset)?;
            // SAFETY: as above (the parser checked the 20-byte TCP header).
            let offset_byte = unsafe { (*p)[12] };
            info.l4_hdr_len = u16::from(offset_byte >> 4) * 4;
        }
        proto::UDP => {
            info.sport = [l4[0], l4[1]];
            info.dport = [l4[2], l4[3]];
            info.l4_hdr_len = 8;
        }
        proto::ICMP => {
            info.icmp_type = l4[0];
            if info.is_icmp_echo() {
                info.sport = [l4[4], l4[5]];
                info.dport = [l4[4], l4[5]];
            }
            info.l4_hdr_len = 8;
        }
        _ => {}
    }
    Some(info)
}

/// Reads the IPv4 header at `l3` of a packet whatever follows it (a fragment, options,
/// another protocol, a short or odd L4 header): its header fields, with `l4` where its header
/// says the payload starts and no L4 fields. `None` unless it is an IPv4 header (version 4, a
/// header length of at least 20 bytes) whose first 20 bytes are readable; the options are not
/// read.
#[inline(always)]
pub fn read_header<C: PacketCtx>(ctx: &C, l3: usize) -> Option<Ipv4Info> {
    let hdr = ptr_at::<C, [u8; 20]>(ctx, l3)?;
    // SAFETY: ptr_at checked that the 20 bytes are readable.
    let hdr = unsafe { hdr.read_unaligned() };
    let ihl = usize::from(hdr[0] & 0x0f) * 4;
    if hdr[0] >> 4 != 4 || ihl < 20 {
        return None;
    }
    let mut info = header_fields(&hdr, l3);
    info.l4 = l3 + ihl;
    Some(info)
}

/// The header fields of the 20-byte IPv4 header `hdr` found at `l3`.
#[inline(always)]
fn header_fields(hdr: &[u8; 20], l3: usize) -> Ipv4Info {
    Ipv4Info {
        l3,
        src: [hdr[12], hdr[13], hdr[14], hdr[15]],
        dst: [hdr[16], hdr[17], hdr[18], hdr[19]],
        proto: hdr[9],
        ttl: hdr[8],
        tos: hdr[1],
        dont_fragment: hdr[6] & IPV4_DF_BYTE != 0,
        tot_len: u16::from_be_bytes([hdr[2], hdr[3]]),
        check: u16::from_be_bytes([hdr[10], hdr[11]]),
        ..Ipv4Info::default()
    }
}

/// Decrements the TTL of the IPv4 header at `l3` in place and updates its checksum
/// incrementally, as kernel forwarding does. Returns false if the header is not writable.
#[inline(always)]
pub fn decrement_ttl<C: PacketCtx>(ctx: &C, l3: usize) -> bool {
    let Some(p) = ptr_at_mut::<C, [u8; 4]>(ctx, l3 + 8) else {
        return false;
    };
    // SAFETY: ptr_at_mut checked the 4 bytes (TTL, protocol, checksum) lie in the packet.
    unsafe {
        let mut field = p.read_unaligned();
        let check = csum::ttl_decremented(u16::from_be_bytes([field[2], field[3]]));
        field[0] = field[0].wrapping_sub(1);
        let [hi, lo] = check.to_be_bytes();
        field[2] = hi;
        field[3] = lo;
        p.write_unaligned(field);
    }
    true
}

/// The bytes `[ttl - 1, proto, checksum]` that replace bytes 8..12 of `info`'s header when the
/// TTL is decremented (for writes with `bpf_skb_store_bytes` after the packet moved).
#[inline(always)]
pub fn decremented_ttl_field(info: &Ipv4Info) -> [u8; 4] {
    let [hi, lo] = csum::ttl_decremented(info.check).to_be_bytes();
    [info.ttl.wrapping_sub(1), info.proto, hi, lo]
}
