//! Packet and byte counters of the udp forwarder, by reason. The forwarder counts into a
//! per-batch [`Tally`] and adds it to the shared [`UdpCounters`] once per batch, so the
//! per-packet cost is a local add. `/metrics` reads them at scrape time
//! ([`crate::metrics::CounterSource`]).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::{CounterSource, FastPathCount};

/// What happened to a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Read from `flannel0` and sent to a peer over UDP.
    Encap,
    /// Received over UDP and written to `flannel0`.
    Decap,
    /// ICMP "net unreachable" written back to `flannel0` for a packet without a route.
    IcmpUnreachable,
    /// Dropped: no remote subnet contains the destination (answered with ICMP when allowed).
    DropNoRoute,
    /// Dropped: the TTL reached zero.
    DropTtl,
    /// Dropped: not a well-formed IPv4 packet (short, bad lengths, bad header checksum).
    DropMalformed,
    /// Dropped: not IPv4 (IPv6 written to `flannel0`, or such a datagram).
    DropNotIpv4,
    /// Dropped: a datagram whose inner destination is not in this node's subnet (the node
    /// does not relay for others, see the module documentation of [`super`]).
    DropNotLocal,
    /// Dropped: the UDP send failed.
    DropSendError,
    /// Dropped: writing to `flannel0` failed.
    DropTunError,
    /// Received with its TCP or UDP checksum left unfinished by the sender's offload (a
    /// fast-path peer on a veth underlay) and finished before the write to `flannel0`
    /// ([`super::packet::finish_l4_checksum`]); also counted under [`Reason::Decap`].
    ChecksumFinished,
}

impl Reason {
    /// Every reason, in a fixed order.
    pub const ALL: [Reason; 11] = [
        Reason::Encap,
        Reason::Decap,
        Reason::IcmpUnreachable,
        Reason::DropNoRoute,
        Reason::DropTtl,
        Reason::DropMalformed,
        Reason::DropNotIpv4,
        Reason::DropNotLocal,
        Reason::DropSendError,
        Reason::DropTunError,
        Reason::ChecksumFinished,
    ];

    /// The metric label (`udp_encap`, `udp_drop_ttl`, …).
    pub fn name(self) -> &'static str {
        match self {
            Reason::Encap => "udp_encap",
            Reason::Decap => "udp_decap",
            Reason::IcmpUnreachable => "udp_icmp_unreachable",
            Reason::DropNoRoute => "udp_drop_no_route",
            Reason::DropTtl => "udp_drop_ttl",
            Reason::DropMalformed => "udp_drop_malformed",
            Reason::DropNotIpv4 => "udp_drop_not_ipv4",
            Reason::DropNotLocal => "udp_drop_not_local",
            Reason::DropSendError => "udp_drop_send_error",
            Reason::DropTunError => "udp_drop_tun_error",
            Reason::ChecksumFinished => "udp_checksum_finished",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

const N: usize = Reason::ALL.len();

/// Counts of one batch, kept by one task (no atomics).
#[derive(Debug, Clone, Copy, Default)]
pub struct Tally {
    packets: [u64; N],
    bytes: [u64; N],
    any: bool,
}

impl Tally {
    /// Counts one packet of `bytes` bytes.
    pub fn add(&mut self, reason: Reason, bytes: usize) {
        let i = reason.index();
        self.packets[i] += 1;
        self.bytes[i] += bytes as u64;
        self.any = true;
    }
}

/// The forwarder's shared counters.
#[derive(Debug, Default)]
pub struct UdpCounters {
    packets: [AtomicU64; N],
    bytes: [AtomicU64; N],
}

impl UdpCounters {
    /// Adds a batch's tally and resets it.
    pub fn flush(&self, tally: &mut Tally) {
        if !tally.any {
            return;
        }
        for i in 0..N {
            if tally.packets[i] != 0 {
                self.packets[i].fetch_add(tally.packets[i], Ordering::Relaxed);
                self.bytes[i].fetch_add(tally.bytes[i], Ordering::Relaxed);
            }
        }
        *tally = Tally::default();
    }

    /// Packets counted for `reason`.
    pub fn packets(&self, reason: Reason) -> u64 {
        self.packets[reason.index()].load(Ordering::Relaxed)
    }

    /// Bytes counted for `reason` (inner packets, without the outer IPv4/UDP headers).
    pub fn bytes(&self, reason: Reason) -> u64 {
        self.bytes[reason.index()].load(Ordering::Relaxed)
    }
}

impl CounterSource for UdpCounters {
    fn read(&self) -> Result<Vec<FastPathCount>, String> {
        Ok(Reason::ALL
            .iter()
            .map(|r| FastPathCount {
                program: "udp-forwarder",
                reason: r.name(),
                packets: self.packets(*r),
                bytes: self.bytes(*r),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_add_up() {
        let c = UdpCounters::default();
        let mut t = Tally::default();
        t.add(Reason::Encap, 100);
        t.add(Reason::Encap, 50);
        t.add(Reason::DropTtl, 60);
        c.flush(&mut t);
        t.add(Reason::Encap, 1);
        c.flush(&mut t);
        c.flush(&mut t);
        assert_eq!((c.packets(Reason::Encap), c.bytes(Reason::Encap)), (3, 151));
        assert_eq!(
            (c.packets(Reason::DropTtl), c.bytes(Reason::DropTtl)),
            (1, 60)
        );
        assert_eq!(c.packets(Reason::Decap), 0);
        let read = c.read().expect("in-memory counters");
        assert_eq!(read.len(), Reason::ALL.len());
        assert_eq!(read[0].reason, "udp_encap");
        assert_eq!((read[0].packets, read[0].bytes), (3, 151));
        let names: std::collections::HashSet<_> = Reason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), Reason::ALL.len());
    }
}
