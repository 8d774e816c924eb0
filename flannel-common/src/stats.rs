//! Per-CPU counters kept by the eBPF programs, indexed by [`Reason`].
//!
//! Every program run counts the packet exactly once under a *classification* reason (what the
//! parser saw: [`ReasonKind::Class`] or [`ReasonKind::Malformed`]). The fast path will add
//! *verdict* reasons (forwarded in eBPF, passed to the kernel because of X, dropped because of
//! Y), each counted once more per packet. New reasons are only ever appended, so the index of an
//! existing reason never changes; the map's size is [`Reason::COUNT`], so growing the enum grows
//! the map (bump [`crate::maps::PIN_LAYOUT_VERSION`] when pinned maps change size).

/// Packets and bytes for one reason.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    /// Number of packets.
    pub packets: u64,
    /// Sum of their lengths in bytes, link-layer header included.
    pub bytes: u64,
}

#[cfg(feature = "user")]
unsafe impl aya::Pod for Counter {}

impl Counter {
    /// Adds `other` to `self` (wrapping, as the kernel's per-CPU counters do).
    pub fn add(&mut self, other: &Counter) {
        self.packets = self.packets.wrapping_add(other.packets);
        self.bytes = self.bytes.wrapping_add(other.bytes);
    }
}

/// The group a [`Reason`] belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasonKind {
    /// A well-formed packet of this class (one per packet and program run).
    Class,
    /// A packet the parser rejected (one per packet and program run, instead of a class).
    /// Such packets are still handed to the kernel, which drops or answers them itself.
    Malformed,
}

/// Why a packet was counted: the index into the stats maps.
///
/// The discriminants are the map indices and are stable: append new variants at the end and
/// extend [`Reason::ALL`] and [`Reason::name`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// IPv4, TCP, no options, not a fragment.
    Ipv4Tcp = 0,
    /// IPv4, UDP, no options, not a fragment.
    Ipv4Udp = 1,
    /// IPv4, ICMP, no options, not a fragment.
    Ipv4Icmp = 2,
    /// IPv4 with another protocol (IPIP, ESP, GRE, ...), no options, not a fragment.
    Ipv4OtherProto = 3,
    /// An IPv4 fragment (MF set or a non-zero offset); its L4 header is not inspected.
    Ipv4Fragment = 4,
    /// IPv4 carrying IP options (IHL > 5), not a fragment.
    Ipv4Options = 5,
    /// IPv6, TCP directly after the fixed header.
    Ipv6Tcp = 6,
    /// IPv6, UDP directly after the fixed header.
    Ipv6Udp = 7,
    /// IPv6, ICMPv6 directly after the fixed header.
    Ipv6Icmp = 8,
    /// IPv6 with another next header that is not an extension header.
    Ipv6OtherProto = 9,
    /// IPv6 whose next header is an extension header (hop-by-hop, routing, fragment, ...).
    Ipv6ExtHeader = 10,
    /// ARP.
    Arp = 11,
    /// Any other EtherType (VLAN tags, LLDP, ...).
    OtherEthertype = 12,
    /// Shorter than an Ethernet header.
    EthTruncated = 13,
    /// IPv4 header (fixed part or options) cut off by the end of the packet.
    Ipv4Truncated = 14,
    /// EtherType IPv4 but version field is not 4.
    Ipv4BadVersion = 15,
    /// IHL below 5 (header shorter than 20 bytes).
    Ipv4BadIhl = 16,
    /// Total length below the header length, or beyond the end of the packet.
    Ipv4BadLength = 17,
    /// IPv6 fixed header cut off by the end of the packet.
    Ipv6Truncated = 18,
    /// EtherType IPv6 but version field is not 6.
    Ipv6BadVersion = 19,
    /// Payload length beyond the end of the packet.
    Ipv6BadLength = 20,
    /// TCP, UDP, ICMP or ICMPv6 header cut off by the end of the IP datagram.
    L4Truncated = 21,
    /// TCP data offset below 5, or TCP options beyond the end of the IP datagram.
    TcpBadOffset = 22,
}

impl Reason {
    /// Number of reasons: the `max_entries` of the stats maps.
    pub const COUNT: usize = 23;

    /// Every reason, in index order.
    pub const ALL: [Reason; Reason::COUNT] = [
        Reason::Ipv4Tcp,
        Reason::Ipv4Udp,
        Reason::Ipv4Icmp,
        Reason::Ipv4OtherProto,
        Reason::Ipv4Fragment,
        Reason::Ipv4Options,
        Reason::Ipv6Tcp,
        Reason::Ipv6Udp,
        Reason::Ipv6Icmp,
        Reason::Ipv6OtherProto,
        Reason::Ipv6ExtHeader,
        Reason::Arp,
        Reason::OtherEthertype,
        Reason::EthTruncated,
        Reason::Ipv4Truncated,
        Reason::Ipv4BadVersion,
        Reason::Ipv4BadIhl,
        Reason::Ipv4BadLength,
        Reason::Ipv6Truncated,
        Reason::Ipv6BadVersion,
        Reason::Ipv6BadLength,
        Reason::L4Truncated,
        Reason::TcpBadOffset,
    ];

    /// The map index of this reason.
    #[inline(always)]
    pub const fn index(self) -> u32 {
        self as u32
    }

    /// The reason stored at map index `index`, if any.
    pub const fn from_index(index: u32) -> Option<Reason> {
        if (index as usize) < Reason::COUNT {
            Some(Reason::ALL[index as usize])
        } else {
            None
        }
    }

    /// A stable snake_case name, used as a metrics label and in logs.
    pub const fn name(self) -> &'static str {
        match self {
            Reason::Ipv4Tcp => "ipv4_tcp",
            Reason::Ipv4Udp => "ipv4_udp",
            Reason::Ipv4Icmp => "ipv4_icmp",
            Reason::Ipv4OtherProto => "ipv4_other_proto",
            Reason::Ipv4Fragment => "ipv4_fragment",
            Reason::Ipv4Options => "ipv4_options",
            Reason::Ipv6Tcp => "ipv6_tcp",
            Reason::Ipv6Udp => "ipv6_udp",
            Reason::Ipv6Icmp => "ipv6_icmp",
            Reason::Ipv6OtherProto => "ipv6_other_proto",
            Reason::Ipv6ExtHeader => "ipv6_ext_header",
            Reason::Arp => "arp",
            Reason::OtherEthertype => "other_ethertype",
            Reason::EthTruncated => "malformed_eth_truncated",
            Reason::Ipv4Truncated => "malformed_ipv4_truncated",
            Reason::Ipv4BadVersion => "malformed_ipv4_bad_version",
            Reason::Ipv4BadIhl => "malformed_ipv4_bad_ihl",
            Reason::Ipv4BadLength => "malformed_ipv4_bad_length",
            Reason::Ipv6Truncated => "malformed_ipv6_truncated",
            Reason::Ipv6BadVersion => "malformed_ipv6_bad_version",
            Reason::Ipv6BadLength => "malformed_ipv6_bad_length",
            Reason::L4Truncated => "malformed_l4_truncated",
            Reason::TcpBadOffset => "malformed_tcp_bad_offset",
        }
    }

    /// The group this reason belongs to.
    pub const fn kind(self) -> ReasonKind {
        match self {
            Reason::Ipv4Tcp
            | Reason::Ipv4Udp
            | Reason::Ipv4Icmp
            | Reason::Ipv4OtherProto
            | Reason::Ipv4Fragment
            | Reason::Ipv4Options
            | Reason::Ipv6Tcp
            | Reason::Ipv6Udp
            | Reason::Ipv6Icmp
            | Reason::Ipv6OtherProto
            | Reason::Ipv6ExtHeader
            | Reason::Arp
            | Reason::OtherEthertype => ReasonKind::Class,
            Reason::EthTruncated
            | Reason::Ipv4Truncated
            | Reason::Ipv4BadVersion
            | Reason::Ipv4BadIhl
            | Reason::Ipv4BadLength
            | Reason::Ipv6Truncated
            | Reason::Ipv6BadVersion
            | Reason::Ipv6BadLength
            | Reason::L4Truncated
            | Reason::TcpBadOffset => ReasonKind::Malformed,
        }
    }
}

// `ALL` must list every reason at its own index; checked at compile time.
const _: () = {
    let mut i = 0;
    while i < Reason::COUNT {
        assert!(Reason::ALL[i] as usize == i);
        i += 1;
    }
};

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn indices_round_trip() {
        for (i, reason) in Reason::ALL.iter().enumerate() {
            assert_eq!(reason.index() as usize, i);
            assert_eq!(Reason::from_index(i as u32), Some(*reason));
        }
        assert_eq!(Reason::from_index(Reason::COUNT as u32), None);
        assert_eq!(Reason::from_index(u32::MAX), None);
    }

    #[test]
    fn names_are_unique_snake_case() {
        let mut seen = HashSet::new();
        for reason in Reason::ALL {
            let name = reason.name();
            assert!(seen.insert(name), "duplicate name {name}");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{name} is not snake_case"
            );
        }
    }

    #[test]
    fn malformed_names_say_so() {
        for reason in Reason::ALL {
            assert_eq!(
                reason.kind() == ReasonKind::Malformed,
                reason.name().starts_with("malformed_"),
                "{reason:?}"
            );
        }
    }

    #[test]
    fn counter_add_sums_both_fields() {
        let mut total = Counter {
            packets: 1,
            bytes: 60,
        };
        total.add(&Counter {
            packets: 2,
            bytes: 1500,
        });
        assert_eq!(
            total,
            Counter {
                packets: 3,
                bytes: 1560
            }
        );
    }
}
