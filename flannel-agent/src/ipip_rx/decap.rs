//! The checks a reassembled IPIP packet passes before its inner packet is sent on, done in
//! place on the received buffer (nothing allocates).

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use crate::udp::packet::{self, PacketError};

/// IP protocol number of IPv4-in-IPv4.
pub const IPPROTO_IPIP: u8 = 4;

/// This node's side of the check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Local {
    /// The node's public IP: the outer destination peers send IPIP to.
    pub public_ip: Ipv4Addr,
    /// The node's pod subnet: the only inner destinations taken. Any inner source is, as a
    /// kernel IPIP device and the programs take it: a peer's pod traffic that the peer's CNI
    /// bridge masqueraded comes from the peer's address.
    pub subnet: Ipv4Net,
}

/// Why a packet was not sent on (each a `kind` of `flannel_ipip_reassembled_packets_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Drop {
    /// The outer or the inner packet is not well-formed IPv4 (lengths, header checksum of
    /// the inner packet), or the outer one is not IPIP.
    Malformed,
    /// The outer destination is another address of this node than its public IP.
    NotForUs,
    /// The outer source is not a node that may send us IPIP (not in `FLANNEL_NODES4` as an
    /// IPIP peer), as the programs refuse it.
    UnknownPeer,
    /// The inner destination is not in this node's pod subnet.
    NotLocal,
    /// The inner TTL would reach zero.
    Ttl,
    /// The inner packet does not fit the MTU of the route to the pod (its sender's pods have
    /// a larger MTU than ours).
    TooBig,
    /// Sending the inner packet failed.
    SendError,
}

impl Drop {
    /// The metric's `kind` label.
    pub fn name(self) -> &'static str {
        match self {
            Drop::Malformed => "drop_malformed",
            Drop::NotForUs => "drop_not_for_us",
            Drop::UnknownPeer => "drop_unknown_peer",
            Drop::NotLocal => "drop_not_local",
            Drop::Ttl => "drop_ttl",
            Drop::TooBig => "drop_too_big",
            Drop::SendError => "drop_send_error",
        }
    }
}

impl Drop {
    /// Whether a packet dropped for this reason came from an IPIP peer (the reasons found
    /// after [`decapsulate`]'s peer check).
    pub fn after_peer_check(self) -> bool {
        match self {
            Drop::Malformed | Drop::NotForUs | Drop::UnknownPeer => false,
            Drop::NotLocal | Drop::Ttl | Drop::TooBig | Drop::SendError => true,
        }
    }
}

/// The `kind` label of a packet sent on.
pub const DELIVERED: &str = "delivered";

/// Checks the reassembled IPIP packet `pkt` (outer IPv4 header first, as a raw socket reads
/// it) as a kernel IPIP tunnel with `local = public_ip` and the programs' peer check would, and
/// returns its inner packet, TTL decremented (the kernel decrements it forwarding the
/// decapsulated packet) with its header checksum updated, and the inner destination.
/// `is_peer` says whether an outer source may send us IPIP.
pub fn decapsulate<'a>(
    pkt: &'a mut [u8],
    local: &Local,
    is_peer: impl FnOnce(Ipv4Addr) -> bool,
) -> Result<(&'a mut [u8], Ipv4Addr), Drop> {
    let outer = packet::parse(pkt).map_err(|_| Drop::Malformed)?;
    if outer.protocol != IPPROTO_IPIP {
        return Err(Drop::Malformed);
    }
    if outer.dst != local.public_ip {
        return Err(Drop::NotForUs);
    }
    if !is_peer(outer.src) {
        return Err(Drop::UnknownPeer);
    }
    let inner_pkt = &mut pkt[outer.header_len..outer.total_len];
    let inner = packet::parse(inner_pkt).map_err(|_| Drop::Malformed)?;
    if !packet::header_checksum_ok(inner_pkt, &inner) {
        return Err(Drop::Malformed);
    }
    if !local.subnet.contains(&inner.dst) {
        return Err(Drop::NotLocal);
    }
    let inner_pkt = &mut inner_pkt[..inner.total_len];
    packet::decrement_ttl(inner_pkt).map_err(|e| match e {
        PacketError::TtlExpired => Drop::Ttl,
        _ => Drop::Malformed,
    })?;
    Ok((inner_pkt, inner.dst))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PUBLIC: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 1);
    const PEER: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
    const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 5);
    const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 7);

    fn local() -> Local {
        Local {
            public_ip: PUBLIC,
            subnet: "10.244.1.0/24".parse().unwrap(),
        }
    }

    fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, ttl: u8, payload: &[u8]) -> Vec<u8> {
        let total = 20 + payload.len();
        let mut p = vec![0u8; 20];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p[8] = ttl;
        p[9] = proto;
        p[12..16].copy_from_slice(&src.octets());
        p[16..20].copy_from_slice(&dst.octets());
        let check = packet::checksum(&p[..20]);
        p[10..12].copy_from_slice(&check.to_be_bytes());
        p.extend_from_slice(payload);
        p
    }

    fn ipip(outer_src: Ipv4Addr, outer_dst: Ipv4Addr, inner: &[u8]) -> Vec<u8> {
        ipv4(outer_src, outer_dst, IPPROTO_IPIP, 63, inner)
    }

    fn inner(ttl: u8) -> Vec<u8> {
        ipv4(REMOTE_POD, LOCAL_POD, 17, ttl, &[7u8; 3000])
    }

    #[test]
    fn a_peers_packet_for_a_local_pod_comes_out_with_one_hop_less() {
        let sent = inner(63);
        let mut pkt = ipip(PEER, PUBLIC, &sent);
        let (out, dst) = decapsulate(&mut pkt, &local(), |src| src == PEER).unwrap();
        assert_eq!(dst, LOCAL_POD);
        assert_eq!(out.len(), sent.len());
        assert_eq!(out[8], 62, "TTL");
        let h = packet::parse(out).unwrap();
        assert!(packet::header_checksum_ok(out, &h), "checksum updated");
        assert_eq!(&out[20..], &sent[20..], "payload untouched");
    }

    #[test]
    fn an_inner_source_outside_the_cluster_is_taken() {
        // A peer's pod datagram masqueraded by the peer's CNI bridge: from the peer itself.
        let sent = ipv4(PEER, LOCAL_POD, 17, 63, &[3u8; 2000]);
        let mut pkt = ipip(PEER, PUBLIC, &sent);
        let (out, dst) = decapsulate(&mut pkt, &local(), |src| src == PEER).unwrap();
        assert_eq!((dst, out.len()), (LOCAL_POD, sent.len()));
    }

    #[test]
    fn trailing_bytes_after_either_total_length_are_cut() {
        let sent = inner(63);
        let mut with_pad = sent.clone();
        with_pad.extend_from_slice(&[0xee; 6]);
        let mut pkt = ipip(PEER, PUBLIC, &with_pad);
        pkt.extend_from_slice(&[0xdd; 4]);
        let (out, _) = decapsulate(&mut pkt, &local(), |_| true).unwrap();
        assert_eq!(out.len(), sent.len());
    }

    #[test]
    fn every_refusal_has_its_reason() {
        let l = local();
        let cases: Vec<(&str, Vec<u8>, Drop)> = vec![
            ("empty", vec![], Drop::Malformed),
            (
                "short",
                ipip(PEER, PUBLIC, &inner(63))[..19].to_vec(),
                Drop::Malformed,
            ),
            (
                "not ipip",
                ipv4(PEER, PUBLIC, 17, 63, &inner(63)),
                Drop::Malformed,
            ),
            (
                "other address",
                ipip(PEER, Ipv4Addr::new(10, 244, 1, 1), &inner(63)),
                Drop::NotForUs,
            ),
            (
                "stranger",
                ipip(Ipv4Addr::new(192, 168, 0, 9), PUBLIC, &inner(63)),
                Drop::UnknownPeer,
            ),
            (
                "inner not ipv4",
                ipip(PEER, PUBLIC, &[0x60; 40]),
                Drop::Malformed,
            ),
            (
                "inner cut",
                ipip(PEER, PUBLIC, &inner(63)[..100]),
                Drop::Malformed,
            ),
            (
                "inner for another node",
                ipip(
                    PEER,
                    PUBLIC,
                    &ipv4(REMOTE_POD, Ipv4Addr::new(10, 244, 3, 1), 17, 63, &[1]),
                ),
                Drop::NotLocal,
            ),
            (
                "inner for the outside",
                ipip(
                    PEER,
                    PUBLIC,
                    &ipv4(REMOTE_POD, Ipv4Addr::new(1, 1, 1, 1), 17, 63, &[1]),
                ),
                Drop::NotLocal,
            ),
            ("ttl", ipip(PEER, PUBLIC, &inner(1)), Drop::Ttl),
        ];
        for (what, mut pkt, want) in cases {
            let got = decapsulate(&mut pkt, &l, |src| src == PEER).map(|(_, dst)| dst);
            assert_eq!(got, Err(want), "{what}");
        }
        let mut bad_sum = inner(63);
        bad_sum[10] ^= 0xff;
        let mut pkt = ipip(PEER, PUBLIC, &bad_sum);
        assert_eq!(
            decapsulate(&mut pkt, &l, |_| true).map(|(_, d)| d),
            Err(Drop::Malformed),
            "inner header checksum"
        );
    }

    #[test]
    fn the_peer_is_asked_about_the_outer_source() {
        let mut asked = None;
        let mut pkt = ipip(PEER, PUBLIC, &inner(63));
        let _ = decapsulate(&mut pkt, &local(), |src| {
            asked = Some(src);
            false
        });
        assert_eq!(asked, Some(PEER));
    }

    #[test]
    fn names_are_distinct() {
        let all = [
            Drop::Malformed,
            Drop::NotForUs,
            Drop::UnknownPeer,
            Drop::NotLocal,
            Drop::Ttl,
            Drop::TooBig,
            Drop::SendError,
        ];
        let names: std::collections::HashSet<_> = all.iter().map(|d| d.name()).collect();
        assert_eq!(names.len(), all.len());
        assert!(!names.contains(DELIVERED));
    }
}
