//! IPv4 packet handling of the udp backend, shared by both directions of the forwarder: header
//! checks, the TTL decrement with an incremental checksum update (RFC 1624) and the ICMP
//! "destination net unreachable" reply for packets without a route.
//!
//! Everything works in place on caller-owned buffers; nothing allocates.

use std::net::Ipv4Addr;

/// Length of an IPv4 header without options.
pub const IPV4_HEADER_LEN: usize = 20;
/// Length of an ICMP header.
pub const ICMP_HEADER_LEN: usize = 8;
/// IP protocol number of ICMP.
pub const IPPROTO_ICMP: u8 = 1;
/// ICMP type "destination unreachable".
pub const ICMP_DEST_UNREACH: u8 = 3;
/// ICMP code "net unreachable".
pub const ICMP_NET_UNREACH: u8 = 0;
/// The largest ICMP error built (RFC 1812 4.3.2.3: as much of the offending packet as fits
/// in 576 bytes, which is what Linux quotes too).
pub const ICMP_ERROR_MAX: usize = 576;
/// TTL of the ICMP errors we originate.
pub const ICMP_TTL: u8 = 64;

/// Why a packet cannot be forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PacketError {
    /// Not IPv4 (the version nibble is not 4; e.g. IPv6 written to `flannel0`).
    NotIpv4,
    /// Shorter than its headers or its `total length` says, or the header length is
    /// below 20 bytes.
    Malformed,
    /// The header checksum does not verify.
    BadChecksum,
    /// The TTL would reach zero.
    TtlExpired,
}

/// The fields of an IPv4 header the forwarder needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Header {
    /// Header length in bytes (IHL × 4).
    pub header_len: usize,
    /// The `total length` field: header plus payload.
    pub total_len: usize,
    /// TTL.
    pub ttl: u8,
    /// Protocol number.
    pub protocol: u8,
    /// Fragment offset in 8-byte units (0 for unfragmented packets and first fragments).
    pub fragment_offset: u16,
    /// Source address.
    pub src: Ipv4Addr,
    /// Destination address.
    pub dst: Ipv4Addr,
}

/// Parses and checks the IPv4 header at the start of `pkt`: version 4, a header length of at
/// least 20 bytes that fits, and a total length between the header length and `pkt.len()`
/// (trailing bytes beyond the total length are allowed and ignored). The checksum is not
/// verified here (see [`header_checksum_ok`]).
pub fn parse(pkt: &[u8]) -> Result<Ipv4Header, PacketError> {
    let first = *pkt.first().ok_or(PacketError::Malformed)?;
    if first >> 4 != 4 {
        return Err(PacketError::NotIpv4);
    }
    if pkt.len() < IPV4_HEADER_LEN {
        return Err(PacketError::Malformed);
    }
    let header_len = usize::from(first & 0x0f) * 4;
    let total_len = usize::from(u16::from_be_bytes([pkt[2], pkt[3]]));
    if header_len < IPV4_HEADER_LEN || total_len < header_len || total_len > pkt.len() {
        return Err(PacketError::Malformed);
    }
    Ok(Ipv4Header {
        header_len,
        total_len,
        ttl: pkt[8],
        protocol: pkt[9],
        fragment_offset: u16::from_be_bytes([pkt[6], pkt[7]]) & 0x1fff,
        src: Ipv4Addr::new(pkt[12], pkt[13], pkt[14], pkt[15]),
        dst: Ipv4Addr::new(pkt[16], pkt[17], pkt[18], pkt[19]),
    })
}

/// The one's complement sum of `data` as 16-bit big-endian words (an odd last byte is padded
/// with zero), not yet folded.
fn sum_words(data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    let mut sum: u32 = 0;
    for w in &mut chunks {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    sum
}

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    // The loop leaves at most 16 bits.
    sum as u16
}

/// The Internet checksum (RFC 1071) of `data`.
pub fn checksum(data: &[u8]) -> u16 {
    !fold(sum_words(data))
}

/// Whether the header checksum of a packet [`parse`]d as `h` verifies.
pub fn header_checksum_ok(pkt: &[u8], h: &Ipv4Header) -> bool {
    pkt.get(..h.header_len)
        .is_some_and(|hdr| fold(sum_words(hdr)) == 0xffff)
}

/// RFC 1624 equation 3: the checksum after one 16-bit word of the covered data changed from
/// `old` to `new`.
pub fn checksum_update(check: u16, old: u16, new: u16) -> u16 {
    let sum = u32::from(!check) + u32::from(!old) + u32::from(new);
    !fold(sum)
}

/// Decrements the TTL of the IPv4 packet `pkt` in place and updates its header checksum
/// incrementally. A TTL of 1 or 0 is not decremented: the packet must be dropped
/// ([`PacketError::TtlExpired`], upstream drops at zero). Returns the new TTL.
pub fn decrement_ttl(pkt: &mut [u8]) -> Result<u8, PacketError> {
    if pkt.len() < IPV4_HEADER_LEN {
        return Err(PacketError::Malformed);
    }
    let ttl = pkt[8];
    if ttl <= 1 {
        return Err(PacketError::TtlExpired);
    }
    let old = u16::from_be_bytes([ttl, pkt[9]]);
    let new = u16::from_be_bytes([ttl - 1, pkt[9]]);
    let check = u16::from_be_bytes([pkt[10], pkt[11]]);
    pkt[8] = ttl - 1;
    pkt[10..12].copy_from_slice(&checksum_update(check, old, new).to_be_bytes());
    Ok(ttl - 1)
}

/// IP protocol number of TCP.
pub const IPPROTO_TCP: u8 = 6;
/// IP protocol number of UDP.
pub const IPPROTO_UDP: u8 = 17;

/// Completes the TCP or UDP checksum of the whole (unfragmented) IPv4 packet `pkt` parsed as
/// `h` if its sender left it for a NIC to finish: the checksum field holds only the sum of
/// the pseudo-header (what Linux writes for `CHECKSUM_PARTIAL`) and the checksum does not
/// verify. Returns whether it did.
///
/// A NIC completes such a checksum on transmit. A veth does not: it hands the packet on
/// unfinished, and a kernel receiving it trusts it, but the bytes a socket reads still carry
/// the partial sum. A fast-path peer on a veth underlay (a kind or k3d cluster) sends pod
/// packets in that state, so this node's socket would write them to `flannel0` unfinished and
/// the kernel would drop them for their checksum. A checksum that happens to be valid as it
/// is, is left alone.
pub fn finish_l4_checksum(pkt: &mut [u8], h: &Ipv4Header) -> bool {
    let more_fragments = pkt.get(6).is_some_and(|b| b & 0x20 != 0);
    if h.fragment_offset != 0 || more_fragments {
        return false;
    }
    let (field, min_len) = match h.protocol {
        IPPROTO_TCP => (16, 20),
        IPPROTO_UDP => (6, 8),
        _ => return false,
    };
    let Some(l4) = pkt.get_mut(h.header_len..h.total_len) else {
        return false;
    };
    let Ok(len) = u16::try_from(l4.len()) else {
        return false;
    };
    if l4.len() < min_len {
        return false;
    }
    let pseudo = sum_words(&h.src.octets())
        + sum_words(&h.dst.octets())
        + u32::from(h.protocol)
        + u32::from(len);
    let check = u16::from_be_bytes([l4[field], l4[field + 1]]);
    if check != fold(pseudo) || fold(pseudo + sum_words(l4)) == 0xffff {
        return false;
    }
    l4[field..field + 2].copy_from_slice(&[0, 0]);
    let mut finished = !fold(pseudo + sum_words(l4));
    if h.protocol == IPPROTO_UDP && finished == 0 {
        // RFC 768: a computed zero is sent as all ones (zero means "no checksum").
        finished = 0xffff;
    }
    l4[field..field + 2].copy_from_slice(&finished.to_be_bytes());
    true
}

/// ICMP types that are error messages (RFC 1122 3.2.2: never answer those with an error).
fn is_icmp_error(kind: u8) -> bool {
    matches!(kind, 3 | 4 | 5 | 11 | 12)
}

/// Whether an ICMP error may be sent about the packet `pkt` parsed as `h` (RFC 1122 3.2.2,
/// RFC 1812 4.3.2.7): not about ICMP errors, non-first fragments, or packets from or to
/// addresses that do not identify a single host.
pub fn may_answer_with_error(pkt: &[u8], h: &Ipv4Header) -> bool {
    let single_host =
        |ip: Ipv4Addr| !(ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast());
    if h.fragment_offset != 0 || !single_host(h.src) || !single_host(h.dst) {
        return false;
    }
    if h.protocol == IPPROTO_ICMP {
        return match pkt.get(h.header_len) {
            Some(kind) => !is_icmp_error(*kind),
            None => false,
        };
    }
    true
}

/// Builds into `out` an ICMP "destination net unreachable" for the offending packet `pkt`
/// (parsed as `h`), addressed back to its source and written, like upstream, as if the
/// destination itself answered: the source of the error is the offender's destination (our
/// own `flannel0` address would be dropped by the kernel as a martian: a packet arriving with
/// a local source). The error quotes as much of the offender as fits in
/// [`ICMP_ERROR_MAX`] bytes. Returns the length written, `None` when
/// [`may_answer_with_error`] says no or `out` is too small for even the minimal quote.
pub fn net_unreachable(pkt: &[u8], h: &Ipv4Header, out: &mut [u8]) -> Option<usize> {
    if !may_answer_with_error(pkt, h) {
        return None;
    }
    let offender = pkt.get(..h.total_len)?;
    let room = out.len().min(ICMP_ERROR_MAX);
    let quote_len = offender
        .len()
        .min(room.checked_sub(IPV4_HEADER_LEN + ICMP_HEADER_LEN)?);
    // RFC 792: at least the offender's header and the first 8 bytes of its payload.
    if quote_len < offender.len().min(h.header_len + 8) {
        return None;
    }
    let total = IPV4_HEADER_LEN + ICMP_HEADER_LEN + quote_len;
    let out = &mut out[..total];

    let (ip, rest) = out.split_at_mut(IPV4_HEADER_LEN);
    ip.copy_from_slice(&[0; IPV4_HEADER_LEN]);
    ip[0] = 0x45;
    ip[1] = 0xc0; // precedence "internetwork control", as Linux sends its ICMP errors
    ip[2..4].copy_from_slice(&u16::try_from(total).ok()?.to_be_bytes());
    ip[8] = ICMP_TTL;
    ip[9] = IPPROTO_ICMP;
    ip[12..16].copy_from_slice(&h.dst.octets());
    ip[16..20].copy_from_slice(&h.src.octets());
    let ip_check = checksum(ip);
    ip[10..12].copy_from_slice(&ip_check.to_be_bytes());

    let (icmp, quote) = rest.split_at_mut(ICMP_HEADER_LEN);
    icmp.copy_from_slice(&[0; ICMP_HEADER_LEN]);
    icmp[0] = ICMP_DEST_UNREACH;
    icmp[1] = ICMP_NET_UNREACH;
    quote.copy_from_slice(&offender[..quote_len]);
    let icmp_check = !fold(sum_words(icmp) + sum_words(quote));
    icmp[2..4].copy_from_slice(&icmp_check.to_be_bytes());
    Some(total)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    /// A valid IPv4 header plus `payload` (header checksum computed from scratch).
    fn packet(src: [u8; 4], dst: [u8; 4], ttl: u8, protocol: u8, payload: &[u8]) -> Vec<u8> {
        let total = IPV4_HEADER_LEN + payload.len();
        let mut p = vec![0u8; total];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p[4..6].copy_from_slice(&0x1c46u16.to_be_bytes());
        p[6] = 0x40; // DF
        p[8] = ttl;
        p[9] = protocol;
        p[12..16].copy_from_slice(&src);
        p[16..20].copy_from_slice(&dst);
        let c = checksum(&p[..IPV4_HEADER_LEN]);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        p[IPV4_HEADER_LEN..].copy_from_slice(payload);
        p
    }

    /// The TCP or UDP checksum of `pkt` (a [`packet`]) verifies over its pseudo-header.
    fn l4_checksum_ok(pkt: &[u8]) -> bool {
        let h = parse(pkt).unwrap();
        let l4 = &pkt[h.header_len..h.total_len];
        let pseudo = sum_words(&h.src.octets())
            + sum_words(&h.dst.octets())
            + u32::from(h.protocol)
            + l4.len() as u32;
        fold(pseudo + sum_words(l4)) == 0xffff
    }

    /// `pkt` with the L4 checksum at `field` as Linux leaves it for offload: the folded
    /// pseudo-header sum.
    fn partial(mut pkt: Vec<u8>, field: usize) -> Vec<u8> {
        let h = parse(&pkt).unwrap();
        let len = (h.total_len - h.header_len) as u32;
        let pseudo =
            sum_words(&h.src.octets()) + sum_words(&h.dst.octets()) + u32::from(h.protocol) + len;
        let at = h.header_len + field;
        pkt[at..at + 2].copy_from_slice(&fold(pseudo).to_be_bytes());
        pkt
    }

    #[test]
    fn unfinished_l4_checksums_are_finished_and_valid_ones_left_alone() {
        let (src, dst) = ([10, 244, 1, 2], [10, 244, 2, 1]);
        // A TCP SYN-like segment (20-byte header, 7 bytes of data: an odd length) and a UDP
        // datagram.
        let mut tcp = vec![0u8; 27];
        tcp[..4].copy_from_slice(&[0x9c, 0x40, 0x1e, 0x61]);
        tcp[12] = 0x50;
        tcp[13] = 0x02;
        tcp[20..].copy_from_slice(b"payload");
        let mut udp = vec![0u8; 8 + 5];
        udp[..4].copy_from_slice(&[0x13, 0x88, 0x00, 0x35]);
        udp[4..6].copy_from_slice(&13u16.to_be_bytes());
        udp[8..].copy_from_slice(b"hello");
        for (proto, l4, field) in [(IPPROTO_TCP, tcp, 16), (IPPROTO_UDP, udp, 6)] {
            let mut p = partial(packet(src, dst, 62, proto, &l4), field);
            assert!(!l4_checksum_ok(&p), "partial sums do not verify");
            let h = parse(&p).unwrap();
            assert!(finish_l4_checksum(&mut p, &h), "protocol {proto}");
            assert!(l4_checksum_ok(&p), "protocol {proto}: finished");
            // Finished (valid) now: left as it is.
            let before = p.clone();
            assert!(!finish_l4_checksum(&mut p, &h));
            assert_eq!(p, before);
            // Corrupted otherwise (not the partial sum): left for the kernel to drop.
            let at = IPV4_HEADER_LEN + field;
            p[at] ^= 0x40;
            let corrupted = p.clone();
            assert!(!finish_l4_checksum(&mut p, &h));
            assert_eq!(p, corrupted);
            // A fragment's checksum covers more than the packet: never touched.
            let mut frag = partial(packet(src, dst, 62, proto, &l4), field);
            frag[6] = 0x20; // MF
            let h = parse(&frag).unwrap();
            assert!(!finish_l4_checksum(&mut frag, &h));
        }
        // Other protocols, and L4 headers cut short, are not touched.
        let mut icmp = packet(src, dst, 62, IPPROTO_ICMP, &[8, 0, 0, 0, 0, 1, 0, 1]);
        let h = parse(&icmp).unwrap();
        assert!(!finish_l4_checksum(&mut icmp, &h));
        let mut short = packet(src, dst, 62, IPPROTO_TCP, &[0; 12]);
        let h = parse(&short).unwrap();
        assert!(!finish_l4_checksum(&mut short, &h));
    }

    /// Random headers and lengths (mostly IPv4, TCP or UDP, some with the partial sum planted):
    /// never a panic, and a checksum reported finished verifies.
    #[test]
    fn finishing_arbitrary_packets_never_panics_and_only_ever_makes_them_valid() {
        use rand::{Rng as _, SeedableRng as _, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(0x5eed);
        let mut finished = 0;
        for _ in 0..20_000 {
            let proto = [IPPROTO_TCP, IPPROTO_UDP, IPPROTO_ICMP][rng.random_range(0..3)];
            let payload: Vec<u8> = (0..rng.random_range(0..64)).map(|_| rng.random()).collect();
            let mut p = packet([10, 244, 1, 2], [10, 244, 2, 1], 62, proto, &payload);
            let field = if proto == IPPROTO_TCP { 16 } else { 6 };
            if rng.random_bool(0.5) && payload.len() >= field + 2 {
                p = partial(p, field);
            }
            for _ in 0..rng.random_range(0..3) {
                let at = rng.random_range(0..p.len());
                p[at] = rng.random();
            }
            if let Ok(h) = parse(&p)
                && finish_l4_checksum(&mut p, &h)
            {
                finished += 1;
                assert!(l4_checksum_ok(&p), "{p:02x?}");
            }
        }
        assert!(finished > 1_000, "only {finished} packets needed finishing");
    }

    #[test]
    fn rfc1071_vector() {
        // The example header of RFC 1071 / Wikipedia: checksum 0xb861.
        let mut h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&h), 0xb861);
        h[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
        let parsed = parse(&[&h[..], &[0u8; 0x73 - 20][..]].concat()).unwrap();
        assert!(header_checksum_ok(&h, &parsed));
        assert_eq!(parsed.ttl, 64);
        assert_eq!(parsed.protocol, 17);
        assert_eq!(parsed.dst, Ipv4Addr::new(192, 168, 0, 199));
    }

    #[test]
    fn parse_rejects_what_cannot_be_forwarded() {
        let good = packet([10, 244, 1, 2], [10, 244, 2, 3], 64, 6, &[1, 2, 3, 4]);
        assert_eq!(parse(&good).unwrap().total_len, 24);
        assert_eq!(parse(&[]), Err(PacketError::Malformed));
        let mut v6 = good.clone();
        v6[0] = 0x60;
        assert_eq!(parse(&v6), Err(PacketError::NotIpv4));
        assert_eq!(parse(&good[..19]), Err(PacketError::Malformed));
        assert_eq!(parse(&good[..23]), Err(PacketError::Malformed), "truncated");
        let mut short_ihl = good.clone();
        short_ihl[0] = 0x44;
        assert_eq!(parse(&short_ihl), Err(PacketError::Malformed));
        let mut long_ihl = good.clone();
        long_ihl[0] = 0x4f; // 60-byte header in a 24-byte packet
        assert_eq!(parse(&long_ihl), Err(PacketError::Malformed));
        let mut small_total = good.clone();
        small_total[2..4].copy_from_slice(&16u16.to_be_bytes());
        assert_eq!(parse(&small_total), Err(PacketError::Malformed));
        // Trailing bytes (Ethernet padding) are fine.
        let padded = [&good[..], &[0u8; 10][..]].concat();
        assert_eq!(parse(&padded).unwrap().total_len, 24);
        let mut bad_sum = good.clone();
        bad_sum[15] ^= 1;
        let h = parse(&bad_sum).unwrap();
        assert!(!header_checksum_ok(&bad_sum, &h));
    }

    #[test]
    fn ttl_decrement_keeps_the_checksum_valid() {
        // Every TTL and a spread of headers: the incremental update must agree with a full
        // recomputation.
        for ttl in 2..=255u8 {
            for (i, proto) in [1u8, 6, 17, 0, 255].into_iter().enumerate() {
                let src = [10, 244, ttl, i as u8];
                let dst = [192, 168, 255 - ttl, 0xff];
                let mut p = packet(src, dst, ttl, proto, b"payload");
                assert_eq!(decrement_ttl(&mut p), Ok(ttl - 1));
                assert_eq!(p[8], ttl - 1);
                let h = parse(&p).unwrap();
                assert!(header_checksum_ok(&p, &h), "ttl {ttl} proto {proto}");
                let mut recomputed = p[..20].to_vec();
                recomputed[10..12].fill(0);
                assert_eq!(
                    u16::from_be_bytes([p[10], p[11]]),
                    checksum(&recomputed),
                    "ttl {ttl} proto {proto}"
                );
            }
        }
    }

    #[test]
    fn ttl_one_and_zero_are_dropped_untouched() {
        for ttl in [0u8, 1] {
            let mut p = packet([10, 0, 0, 1], [10, 0, 0, 2], ttl, 6, b"");
            let before = p.clone();
            assert_eq!(decrement_ttl(&mut p), Err(PacketError::TtlExpired));
            assert_eq!(p, before);
        }
        assert_eq!(decrement_ttl(&mut [0x45; 10]), Err(PacketError::Malformed));
    }

    #[test]
    fn net_unreachable_answers_the_source() {
        let payload: Vec<u8> = (0..100u8).collect();
        let offender = packet([10, 244, 1, 2], [10, 244, 9, 5], 63, 6, &payload);
        let h = parse(&offender).unwrap();
        let mut out = [0u8; 2048];
        let n = net_unreachable(&offender, &h, &mut out).unwrap();
        assert_eq!(n, 20 + 8 + offender.len());
        let reply = &out[..n];
        let rh = parse(reply).unwrap();
        assert!(header_checksum_ok(reply, &rh));
        assert_eq!(rh.src, Ipv4Addr::new(10, 244, 9, 5));
        assert_eq!(rh.dst, Ipv4Addr::new(10, 244, 1, 2));
        assert_eq!((rh.protocol, rh.ttl, rh.total_len), (1, ICMP_TTL, n));
        assert_eq!(&reply[20..22], &[3, 0], "type 3 code 0");
        assert_eq!(checksum(&reply[20..]), 0, "ICMP checksum verifies");
        assert_eq!(&reply[28..], &offender[..]);
    }

    #[test]
    fn net_unreachable_quotes_at_most_576_bytes() {
        let big = packet([10, 244, 1, 2], [10, 244, 9, 5], 63, 17, &[7u8; 1400]);
        let h = parse(&big).unwrap();
        let mut out = [0u8; 2048];
        let n = net_unreachable(&big, &h, &mut out).unwrap();
        assert_eq!(n, ICMP_ERROR_MAX);
        assert_eq!(&out[28..n], &big[..n - 28]);
        assert_eq!(checksum(&out[20..n]), 0);
        // Too little room for header + 8 bytes of the offender: no reply.
        assert_eq!(net_unreachable(&big, &h, &mut out[..50]), None);
    }

    #[test]
    fn no_error_about_errors_fragments_or_broadcasts() {
        let mut out = [0u8; 1024];
        let check = |p: &[u8]| {
            let h = parse(p).unwrap();
            net_unreachable(p, &h, &mut [0u8; 1024]).is_some()
        };
        // An ICMP echo request is answered, an ICMP error is not.
        assert!(check(&packet(
            [10, 0, 0, 1],
            [10, 9, 0, 1],
            9,
            1,
            &[8, 0, 0, 0, 0, 0, 0, 0]
        )));
        for kind in [3u8, 4, 5, 11, 12] {
            assert!(!check(&packet(
                [10, 0, 0, 1],
                [10, 9, 0, 1],
                9,
                1,
                &[kind, 0, 0, 0, 0, 0, 0, 0]
            )));
        }
        // ICMP without a type byte: no.
        assert!(!check(&packet([10, 0, 0, 1], [10, 9, 0, 1], 9, 1, &[])));
        let mut frag = packet([10, 0, 0, 1], [10, 9, 0, 1], 9, 17, &[0; 16]);
        frag[6..8].copy_from_slice(&0x0002u16.to_be_bytes());
        let h = parse(&frag).unwrap();
        assert_eq!(net_unreachable(&frag, &h, &mut out), None);
        for (src, dst) in [
            ([0, 0, 0, 0], [10, 9, 0, 1]),
            ([10, 0, 0, 1], [255, 255, 255, 255]),
            ([10, 0, 0, 1], [224, 0, 0, 5]),
            ([239, 1, 1, 1], [10, 9, 0, 1]),
        ] {
            assert!(
                !check(&packet(src, dst, 9, 17, &[0; 8])),
                "{src:?} -> {dst:?}"
            );
        }
    }
}
