//! Path MTU discovery through IPIP: a router's ICMP "fragmentation needed" about an IPIP
//! packet this node sent, rewritten into the error about the inner packet that the inner
//! packet's sender expects. Pure functions on header bytes, shared by `tc_from_netdev` and the
//! host tests.
//!
//! IPIP copies the inner packet's DF into the outer header (as flannel's kernel `ipip`
//! device, without `pmtudisc`, does; on a node without a kernel IPIP device the fast path
//! sets it always), so a router on a path narrower than the interfaces drops a pod's packet
//! and sends the error to the node, quoting the outer header. The kernel's
//! `ipip` module takes such an error (`ipip_err`) to lower its tunnel's path MTU and answers
//! the next too-big inner packet with an error of its own; the fast path's IPIP has no tunnel
//! device in the way, and a kernel without the module drops the error. Rewritten, the error
//! reaches the sender's stack the way an error from a router on a plain path would: about its
//! own packet (the quoted outer header removed), with the MTU that packet may have (the
//! reported one less the 20-byte IPIP header).

/// ICMP type "destination unreachable".
pub const ICMP_DEST_UNREACH: u8 = 3;
/// ICMP code "fragmentation needed and DF set" of [`ICMP_DEST_UNREACH`].
pub const ICMP_FRAG_NEEDED: u8 = 4;
/// The IPIP (outer IPv4) header, without options.
pub const IPIP_HEADER_LEN: u16 = 20;
/// The smallest MTU IPv4 allows (RFC 791): a reported path MTU that leaves the inner packet
/// less is not passed on.
pub const IPV4_MIN_MTU: u16 = 68;

/// IP protocol number of IPIP.
const IPPROTO_IPIP: u8 = 4;

/// The path MTU a "fragmentation needed" reports about an IPIP packet: `icmp` is the error's
/// 8-byte ICMP header, `quoted` the first 20 bytes it quotes, which must be an IPv4 header
/// without options, of protocol IPIP, not a later fragment (only a first fragment or a whole
/// packet quotes the inner header). `None` for anything else, and when the MTU would leave the
/// inner packet less than [`IPV4_MIN_MTU`] (an old router's 0 included).
#[inline(always)]
pub fn ipip_frag_needed(icmp: &[u8; 8], quoted: &[u8; 20]) -> Option<u16> {
    let mtu = u16::from_be_bytes([icmp[6], icmp[7]]);
    let later_fragment = u16::from_be_bytes([quoted[6], quoted[7]]) & 0x1fff != 0;
    (icmp[0] == ICMP_DEST_UNREACH
        && icmp[1] == ICMP_FRAG_NEEDED
        && quoted[0] == 0x45
        && quoted[9] == IPPROTO_IPIP
        && !later_fragment
        && mtu >= IPV4_MIN_MTU + IPIP_HEADER_LEN)
        .then_some(mtu)
}

/// The headers of the error [`ipip_frag_needed`] accepted, rewritten for the inner packet's
/// sender `to`: the IPv4 header `ip` (no options) with destination `to`, a total length
/// [`IPIP_HEADER_LEN`] shorter and its checksum recomputed; the ICMP header `icmp` with the MTU
/// `mtu - 20`, the unused word (RFC 4884's length) zero, and its checksum without the words of
/// `quoted` (the outer header, which the caller removes from the packet right after the ICMP
/// header: the checksum covers the rest of the packet, which keeps its word alignment).
#[inline(always)]
pub fn inner_frag_needed(
    ip: &[u8; 20],
    icmp: &[u8; 8],
    quoted: &[u8; 20],
    to: [u8; 4],
    mtu: u16,
) -> ([u8; 20], [u8; 8]) {
    let mut new_ip = *ip;
    let tot_len = u16::from_be_bytes([ip[2], ip[3]]).saturating_sub(IPIP_HEADER_LEN);
    new_ip[2..4].copy_from_slice(&tot_len.to_be_bytes());
    new_ip[16..20].copy_from_slice(&to);
    let ip_check = crate::csum::ipv4_header(&new_ip);
    new_ip[10..12].copy_from_slice(&ip_check.to_be_bytes());

    let inner_mtu = mtu - IPIP_HEADER_LEN;
    let old_check = u16::from_be_bytes([icmp[2], icmp[3]]);
    // RFC 1624: add the complement of every word that goes, and every word that comes.
    let mut sum = u32::from(!old_check);
    let mut i = 0;
    while i < 20 {
        sum += u32::from(!u16::from_be_bytes([quoted[i], quoted[i + 1]]));
        i += 2;
    }
    sum += u32::from(!u16::from_be_bytes([icmp[4], icmp[5]]));
    sum += u32::from(!u16::from_be_bytes([icmp[6], icmp[7]])) + u32::from(inner_mtu);
    let check = !crate::csum::fold(sum);
    let mut new_icmp = [0u8; 8];
    new_icmp[0] = icmp[0];
    new_icmp[1] = icmp[1];
    new_icmp[2..4].copy_from_slice(&check.to_be_bytes());
    new_icmp[6..8].copy_from_slice(&inner_mtu.to_be_bytes());
    (new_ip, new_icmp)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Internet checksum of `bytes` as the value to store (0 when `bytes` holds a valid
    /// checksum already).
    fn checksum(bytes: &[u8]) -> u16 {
        let mut sum = 0u32;
        for pair in bytes.chunks(2) {
            let hi = u32::from(pair[0]) << 8;
            sum += hi | pair.get(1).map_or(0, |b| u32::from(*b));
        }
        !crate::csum::fold(sum)
    }

    fn ipv4(src: [u8; 4], dst: [u8; 4], proto: u8, df: bool, payload: &[u8]) -> Vec<u8> {
        let mut h = vec![
            0x45,
            0,
            0,
            0,
            0x12,
            0x34,
            if df { 0x40 } else { 0 },
            0,
            63,
            proto,
        ];
        h.extend_from_slice(&[0, 0]);
        h.extend_from_slice(&src);
        h.extend_from_slice(&dst);
        let len = (20 + payload.len()) as u16;
        h[2..4].copy_from_slice(&len.to_be_bytes());
        let c = checksum(&h);
        h[10..12].copy_from_slice(&c.to_be_bytes());
        h.extend_from_slice(payload);
        h
    }

    const NODE: [u8; 4] = [192, 168, 1, 11];
    const PEER: [u8; 4] = [192, 168, 2, 12];
    const ROUTER: [u8; 4] = [192, 168, 1, 1];
    const POD: [u8; 4] = [10, 244, 1, 2];
    const REMOTE_POD: [u8; 4] = [10, 244, 2, 2];

    /// A router's error about node → peer IPIP carrying a pod's TCP segment, quoting
    /// `quote_len` bytes of it, with `unused` in the ICMP header's second word.
    fn router_error(mtu: u16, quote_len: usize, unused: u16) -> Vec<u8> {
        let tcp: Vec<u8> = (0..1440u32).map(|i| (i * 7 + 3) as u8).collect();
        let inner = ipv4(POD, REMOTE_POD, 6, true, &tcp);
        let outer = ipv4(NODE, PEER, 4, true, &inner);
        let mut icmp = vec![ICMP_DEST_UNREACH, ICMP_FRAG_NEEDED, 0, 0];
        icmp.extend_from_slice(&unused.to_be_bytes());
        icmp.extend_from_slice(&mtu.to_be_bytes());
        icmp.extend_from_slice(&outer[..quote_len]);
        let c = checksum(&icmp);
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
        ipv4(ROUTER, NODE, 1, false, &icmp)
    }

    fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
        bytes[..N].try_into().unwrap()
    }

    /// Applies the rewrite as `tc_from_netdev` does: the outer header goes, the new headers
    /// are written in front of the quoted inner packet.
    fn rewrite(packet: &[u8]) -> Option<Vec<u8>> {
        let (ip, icmp, quoted) = (
            array::<20>(packet),
            array::<8>(&packet[20..]),
            array::<20>(&packet[28..]),
        );
        let mtu = ipip_frag_needed(&icmp, &quoted)?;
        let to = array::<4>(&packet[48 + 12..]);
        let (ip, icmp) = inner_frag_needed(&ip, &icmp, &quoted, to, mtu);
        let mut out = ip.to_vec();
        out.extend_from_slice(&icmp);
        out.extend_from_slice(&packet[48..]);
        Some(out)
    }

    #[test]
    fn the_error_is_rewritten_for_the_inner_packets_sender() {
        for (quote_len, unused) in [
            (20 + 28, 0),
            (20 + 548, 0),
            (20 + 41, 0),
            (20 + 548, 0x0011),
        ] {
            let packet = router_error(1400, quote_len, unused);
            let out = rewrite(&packet).expect("an error about IPIP");
            assert_eq!(out.len(), packet.len() - 20, "quote {quote_len}");
            assert_eq!(
                checksum(&out[..20]),
                0,
                "IPv4 header checksum, quote {quote_len}"
            );
            assert_eq!(checksum(&out[20..]), 0, "ICMP checksum, quote {quote_len}");
            assert_eq!(u16::from_be_bytes([out[2], out[3]]) as usize, out.len());
            assert_eq!(out[12..16], ROUTER, "the router stays the source");
            assert_eq!(out[16..20], POD, "to the pod");
            assert_eq!(out[20..24], [3, 4, out[22], out[23]]);
            assert_eq!(
                out[24..26],
                [0, 0],
                "no RFC 4884 length for a quote that changed"
            );
            assert_eq!(u16::from_be_bytes([out[26], out[27]]), 1380);
            assert_eq!(
                out[28..],
                packet[48..],
                "the inner packet's quote, unchanged"
            );
            assert_eq!(out[28 + 12..28 + 20], [POD, REMOTE_POD].concat());
        }
    }

    #[test]
    fn other_errors_are_not_rewritten() {
        let packet = router_error(1400, 68, 0);
        let (icmp, quoted) = (array::<8>(&packet[20..]), array::<20>(&packet[28..]));
        assert_eq!(ipip_frag_needed(&icmp, &quoted), Some(1400));
        let with = |at: usize, v: u8, of_quote: bool| {
            let (mut i, mut q) = (icmp, quoted);
            if of_quote {
                q[at] = v
            } else {
                i[at] = v
            }
            ipip_frag_needed(&i, &q)
        };
        assert_eq!(with(0, 11, false), None, "time exceeded");
        assert_eq!(with(1, 1, false), None, "host unreachable");
        assert_eq!(with(9, 6, true), None, "quotes TCP, not IPIP");
        assert_eq!(with(0, 0x46, true), None, "quoted header with options");
        assert_eq!(with(7, 0xb9, true), None, "quotes a later fragment");
        assert_eq!(
            with(6, 0x20, true),
            Some(1400),
            "a first fragment (MF) quotes the inner"
        );
        for (mtu, want) in [(0, None), (87, None), (88, Some(88)), (65535, Some(65535))] {
            let mut i = icmp;
            i[6..8].copy_from_slice(&u16::to_be_bytes(mtu));
            assert_eq!(ipip_frag_needed(&i, &quoted), want, "MTU {mtu}");
        }
    }
}
