//! Header arithmetic shared by the programs and the host tests: Internet checksums (RFC 1071,
//! incremental updates per RFC 1624) and the VXLAN source port the kernel derives from a flow
//! hash. Pure functions without loops over unbounded data, so they pass the verifier as they
//! are and can be unit-tested on the host.

/// Folds a 32-bit one's-complement sum to 16 bits.
#[inline(always)]
pub fn fold(sum: u32) -> u16 {
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// The checksum of a 20-byte IPv4 header (no options) whose checksum field (bytes 10..12) is
/// ignored, as the value to store there (network order when written with `to_be_bytes`).
#[inline(always)]
pub fn ipv4_header(hdr: &[u8; 20]) -> u16 {
    let mut sum = 0u32;
    let mut i = 0;
    while i < 20 {
        if i != 10 {
            sum += u32::from(u16::from_be_bytes([hdr[i], hdr[i + 1]]));
        }
        i += 2;
    }
    !fold(sum)
}

/// The IPv4 header checksum after the TTL was decremented by one, from the checksum before
/// (both as big-endian field values). TTL is the high byte of the header's fifth 16-bit word,
/// so the word drops by 0x0100 and the one's-complement checksum rises by 0x0100 with an
/// end-around carry (RFC 1624; Linux `ip_decrease_ttl` does the same).
#[inline(always)]
pub fn ttl_decremented(check: u16) -> u16 {
    let sum = u32::from(check) + 0x0100;
    (sum + (sum >> 16)) as u16
}

/// The VXLAN UDP source port the kernel picks for a packet whose flow hash is `hash`
/// (`udp_flow_src_port` in include/net/udp.h): the hash is folded (`hash ^ hash << 16`) and
/// scaled into `[min, max)`. `max <= min` gives `min`.
#[inline(always)]
pub fn vxlan_source_port(hash: u32, min: u16, max: u16) -> u16 {
    if max <= min {
        return min;
    }
    let hash = hash ^ (hash << 16);
    let span = u64::from(max - min);
    ((u64::from(hash) * span) >> 32) as u16 + min
}

/// ECN bits an outer IPv4 header gets from the inner TOS when the tunnel's own TOS is 0
/// (`INET_ECN_encapsulate`): the inner ECN field, except that CE becomes ECT(0).
#[inline(always)]
pub fn ecn_encapsulate(inner_tos: u8) -> u8 {
    let ecn = inner_tos & 0b11;
    if ecn == 0b11 { 0b10 } else { ecn }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(hdr: &[u8]) -> u16 {
        let mut sum = 0u32;
        for w in hdr.chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        fold(sum)
    }

    #[test]
    fn header_checksum_matches_the_published_example() {
        let mut hdr = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xaa, 0xbb, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(ipv4_header(&hdr), 0xb861);
        hdr[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
        assert_eq!(full(&hdr), 0xffff);
    }

    #[test]
    fn ttl_decrement_keeps_the_header_valid() {
        // Every TTL and a spread of other header contents, including checksums that wrap.
        for ttl in 1..=255u8 {
            for id in [0u16, 1, 0x00ff, 0x7fff, 0xfeff, 0xffff] {
                let mut hdr = [
                    0x45,
                    0,
                    0,
                    84,
                    (id >> 8) as u8,
                    id as u8,
                    0x40,
                    0,
                    ttl,
                    1,
                    0,
                    0,
                    10,
                    244,
                    1,
                    2,
                    10,
                    244,
                    2,
                    3,
                ];
                let check = ipv4_header(&hdr);
                hdr[10..12].copy_from_slice(&check.to_be_bytes());
                hdr[8] = ttl - 1;
                let updated = ttl_decremented(check);
                let recomputed = ipv4_header(&hdr);
                // 0x0000 and 0xffff are the same one's-complement value; a receiver accepts
                // either, so compare by verifying the header.
                hdr[10..12].copy_from_slice(&updated.to_be_bytes());
                assert_eq!(full(&hdr), 0xffff, "ttl {ttl} id {id:#x}");
                assert!(updated == recomputed || (updated | recomputed) == 0xffff);
            }
        }
    }

    #[test]
    fn source_ports_stay_in_range_and_follow_the_kernel_formula() {
        // Kernel: htons((((u64) (hash ^ hash << 16)) * (max - min)) >> 32) + min).
        let (min, max) = (32768u16, 60999u16);
        for hash in [0u32, 1, 0x1234_5678, 0xdead_beef, u32::MAX] {
            let folded = hash ^ (hash << 16);
            let want = ((u64::from(folded) * 28231) >> 32) as u16 + 32768;
            let got = vxlan_source_port(hash, min, max);
            assert_eq!(got, want);
            assert!((min..max).contains(&got));
        }
        assert_eq!(vxlan_source_port(7, 5000, 5000), 5000);
    }

    #[test]
    fn ecn_is_copied_and_ce_becomes_ect0() {
        assert_eq!(ecn_encapsulate(0x00), 0);
        assert_eq!(ecn_encapsulate(0xb8 | 0b01), 0b01);
        assert_eq!(ecn_encapsulate(0b10), 0b10);
        assert_eq!(ecn_encapsulate(0b11), 0b10);
    }
}
