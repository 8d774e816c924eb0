//! Packets for `BPF_PROG_TEST_RUN` tests: a builder and an independent parser.
//!
//! **Building.** Layers nest the way they do on the wire and [`Ethernet::encode`] turns them
//! into bytes, filling in lengths, protocol numbers and checksums:
//!
//! ```
//! use std::net::Ipv4Addr;
//! use flannel_tests::packet::{Ethernet, Ipv4, Tcp, MAC_A, MAC_B};
//!
//! let frame = Ethernet::new(
//!     MAC_A,
//!     MAC_B,
//!     Ipv4::new(Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(10, 244, 2, 3), Tcp::new(40000, 80).payload(b"hi")),
//! )
//! .encode();
//! assert_eq!(frame.len(), 14 + 20 + 20 + 2);
//! ```
//!
//! Every field is public, so malformed packets are made by overriding what the encoder would
//! compute (`ihl`, `total_length`, [`Checksum::Value`], ...) or by cutting the encoded bytes.
//!
//! **Parsing.** [`parse`] decodes a frame into [`Frame`] (Ethernet, optional 802.1Q tag, ARP,
//! IPv4, IPv6 with extension headers, TCP, UDP, ICMP, ICMPv6), and records for every checksum
//! whether it verifies; [`verify`] additionally fails on any bad checksum. The parser shares no
//! code with the builder except the RFC 1071 sum, and verifies by summing over the checksum field
//! (the result must be 0xffff) rather than recomputing it; the unit tests also check the builder
//! against published vectors and against tcpdump.

use std::{
    fmt::Write as _,
    io::Write as _,
    net::{Ipv4Addr, Ipv6Addr},
    path::Path,
};

use anyhow::{Context as _, Result, bail, ensure};

/// A MAC address.
pub type Mac = [u8; 6];

/// A locally administered unicast MAC for tests ("node A").
pub const MAC_A: Mac = [0x02, 0x00, 0x00, 0x00, 0x00, 0x0a];
/// A locally administered unicast MAC for tests ("node B").
pub const MAC_B: Mac = [0x02, 0x00, 0x00, 0x00, 0x00, 0x0b];
/// The broadcast MAC.
pub const MAC_BROADCAST: Mac = [0xff; 6];

/// EtherType IPv4.
pub const ETH_P_IP: u16 = 0x0800;
/// EtherType ARP.
pub const ETH_P_ARP: u16 = 0x0806;
/// EtherType IPv6.
pub const ETH_P_IPV6: u16 = 0x86dd;
/// EtherType of an 802.1Q VLAN tag.
pub const ETH_P_8021Q: u16 = 0x8100;

/// IP protocol: ICMP.
pub const IPPROTO_ICMP: u8 = 1;
/// IP protocol: IPv4 in IPv4 (IPIP).
pub const IPPROTO_IPIP: u8 = 4;
/// IP protocol: TCP.
pub const IPPROTO_TCP: u8 = 6;
/// IP protocol: UDP.
pub const IPPROTO_UDP: u8 = 17;
/// IP protocol: IPv6 in IP.
pub const IPPROTO_IPV6: u8 = 41;
/// IP protocol: GRE.
pub const IPPROTO_GRE: u8 = 47;
/// IP protocol: ESP.
pub const IPPROTO_ESP: u8 = 50;
/// IP protocol: ICMPv6.
pub const IPPROTO_ICMPV6: u8 = 58;
/// IPv6 next header: no next header.
pub const IPPROTO_NONE: u8 = 59;
/// IPv6 extension header: hop-by-hop options.
pub const IPV6_EXT_HOP_BY_HOP: u8 = 0;
/// IPv6 extension header: routing.
pub const IPV6_EXT_ROUTING: u8 = 43;
/// IPv6 extension header: fragment.
pub const IPV6_EXT_FRAGMENT: u8 = 44;
/// IPv6 extension header: destination options.
pub const IPV6_EXT_DEST_OPTS: u8 = 60;

/// flannel's VXLAN UDP port (the Linux default, not IANA's).
pub const VXLAN_PORT_FLANNEL: u16 = 8472;
/// IANA's VXLAN UDP port.
pub const VXLAN_PORT_IANA: u16 = 4789;

/// TCP flag bits.
pub mod tcp_flags {
    /// FIN.
    pub const FIN: u8 = 0x01;
    /// SYN.
    pub const SYN: u8 = 0x02;
    /// RST.
    pub const RST: u8 = 0x04;
    /// PSH.
    pub const PSH: u8 = 0x08;
    /// ACK.
    pub const ACK: u8 = 0x10;
}

// ---------------------------------------------------------------------------------------------
// Checksums (RFC 1071)

/// Adds `data` as big-endian 16-bit words (odd length padded with a zero byte) to `sum`,
/// without folding.
pub fn sum_words(data: &[u8], mut sum: u64) -> u64 {
    let mut chunks = data.chunks_exact(2);
    for word in &mut chunks {
        sum += u64::from(u16::from_be_bytes([word[0], word[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u64::from(u16::from_be_bytes([*last, 0]));
    }
    sum
}

/// Folds a sum to 16 bits (end-around carry).
pub fn fold(mut sum: u64) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The Internet checksum of `data` (checksum field zeroed by the caller).
pub fn checksum(data: &[u8]) -> u16 {
    !fold(sum_words(data, 0))
}

/// Sum of the IPv4 pseudo-header for an upper-layer packet of `len` bytes.
pub fn pseudo_header_v4(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> u64 {
    let sum = sum_words(&src.octets(), 0);
    let sum = sum_words(&dst.octets(), sum);
    sum + u64::from(proto) + len as u64
}

/// Sum of the IPv6 pseudo-header for an upper-layer packet of `len` bytes.
pub fn pseudo_header_v6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, len: usize) -> u64 {
    let sum = sum_words(&src.octets(), 0);
    let sum = sum_words(&dst.octets(), sum);
    sum + u64::from(proto) + len as u64
}

/// What to put in a checksum field.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Checksum {
    /// The correct checksum (UDP over IPv4: 0xffff when it computes to zero).
    #[default]
    Correct,
    /// Exactly this value (0 for "no checksum" in UDP over IPv4, or a wrong one on purpose).
    Value(u16),
}

impl Checksum {
    fn resolve(self, correct: u16) -> u16 {
        match self {
            Checksum::Correct => correct,
            Checksum::Value(v) => v,
        }
    }
}

/// Where an upper-layer checksum gets its pseudo-header from.
#[derive(Clone, Copy, Debug)]
enum Pseudo {
    V4(Ipv4Addr, Ipv4Addr),
    V6(Ipv6Addr, Ipv6Addr),
}

impl Pseudo {
    fn sum(self, proto: u8, len: usize) -> u64 {
        match self {
            Pseudo::V4(s, d) => pseudo_header_v4(s, d, proto, len),
            Pseudo::V6(s, d) => pseudo_header_v6(s, d, proto, len),
        }
    }
}

/// Writes the checksum of `bytes` (with the pseudo-header sum) at `at`.
fn fill_checksum(
    bytes: &mut [u8],
    at: usize,
    initial: u64,
    choice: Checksum,
    zero_means_none: bool,
) {
    bytes[at..at + 2].copy_from_slice(&[0, 0]);
    let mut correct = !fold(sum_words(bytes, initial));
    if zero_means_none && correct == 0 {
        correct = 0xffff;
    }
    bytes[at..at + 2].copy_from_slice(&choice.resolve(correct).to_be_bytes());
}

// ---------------------------------------------------------------------------------------------
// L4

/// A TCP segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tcp {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Sequence number.
    pub seq: u32,
    /// Acknowledgement number.
    pub ack: u32,
    /// Flags ([`tcp_flags`]).
    pub flags: u8,
    /// Receive window.
    pub window: u16,
    /// Urgent pointer.
    pub urgent: u16,
    /// Options, padded with zeros to a multiple of 4 bytes.
    pub options: Vec<u8>,
    /// Data offset in 32-bit words; `None` = computed from the options.
    pub data_offset: Option<u8>,
    /// Checksum field.
    pub checksum: Checksum,
    /// Payload.
    pub payload: Vec<u8>,
}

impl Tcp {
    /// A SYN from `src_port` to `dst_port`, sequence 1, window 65535.
    pub fn new(src_port: u16, dst_port: u16) -> Self {
        Tcp {
            src_port,
            dst_port,
            seq: 1,
            ack: 0,
            flags: tcp_flags::SYN,
            window: 65535,
            urgent: 0,
            options: Vec::new(),
            data_offset: None,
            checksum: Checksum::Correct,
            payload: Vec::new(),
        }
    }

    /// Sets the flags.
    pub fn flags(mut self, flags: u8) -> Self {
        self.flags = flags;
        self
    }

    /// Sets the payload.
    pub fn payload(mut self, payload: &[u8]) -> Self {
        self.payload = payload.to_vec();
        self
    }

    fn encode(&self, pseudo: Pseudo) -> Vec<u8> {
        let mut options = self.options.clone();
        options.resize(options.len().div_ceil(4) * 4, 0);
        let offset = self.data_offset.unwrap_or((5 + options.len() / 4) as u8);
        let mut seg = Vec::with_capacity(20 + options.len() + self.payload.len());
        seg.extend_from_slice(&self.src_port.to_be_bytes());
        seg.extend_from_slice(&self.dst_port.to_be_bytes());
        seg.extend_from_slice(&self.seq.to_be_bytes());
        seg.extend_from_slice(&self.ack.to_be_bytes());
        seg.push(offset << 4);
        seg.push(self.flags);
        seg.extend_from_slice(&self.window.to_be_bytes());
        seg.extend_from_slice(&[0, 0]);
        seg.extend_from_slice(&self.urgent.to_be_bytes());
        seg.extend_from_slice(&options);
        seg.extend_from_slice(&self.payload);
        let initial = pseudo.sum(IPPROTO_TCP, seg.len());
        fill_checksum(&mut seg, 16, initial, self.checksum, false);
        seg
    }
}

/// A UDP datagram.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Udp {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Length field; `None` = 8 + payload length.
    pub length: Option<u16>,
    /// Checksum field (`Checksum::Value(0)` = none, allowed over IPv4 only).
    pub checksum: Checksum,
    /// Payload.
    pub payload: Vec<u8>,
}

impl Udp {
    /// An empty datagram from `src_port` to `dst_port`.
    pub fn new(src_port: u16, dst_port: u16) -> Self {
        Udp {
            src_port,
            dst_port,
            length: None,
            checksum: Checksum::Correct,
            payload: Vec::new(),
        }
    }

    /// Sets the payload.
    pub fn payload(mut self, payload: &[u8]) -> Self {
        self.payload = payload.to_vec();
        self
    }

    /// A VXLAN datagram (flannel's port 8472 as destination) carrying `inner` (an Ethernet
    /// frame) in VNI `vni`.
    pub fn vxlan(src_port: u16, vni: u32, inner: &[u8]) -> Self {
        Udp::new(src_port, VXLAN_PORT_FLANNEL).payload(&Vxlan::new(vni, inner).encode())
    }

    fn encode(&self, pseudo: Pseudo) -> Vec<u8> {
        let len = 8 + self.payload.len();
        let mut dgram = Vec::with_capacity(len);
        dgram.extend_from_slice(&self.src_port.to_be_bytes());
        dgram.extend_from_slice(&self.dst_port.to_be_bytes());
        dgram.extend_from_slice(&self.length.unwrap_or(len as u16).to_be_bytes());
        dgram.extend_from_slice(&[0, 0]);
        dgram.extend_from_slice(&self.payload);
        let initial = pseudo.sum(IPPROTO_UDP, dgram.len());
        fill_checksum(&mut dgram, 6, initial, self.checksum, true);
        dgram
    }
}

/// An ICMP (IPv4) or ICMPv6 message: type, code, checksum, 4 bytes of rest-of-header, data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Icmp {
    /// Type.
    pub ty: u8,
    /// Code.
    pub code: u8,
    /// The 4 bytes after the checksum (identifier and sequence for echo).
    pub rest: [u8; 4],
    /// Checksum field.
    pub checksum: Checksum,
    /// Data after the 8-byte header.
    pub payload: Vec<u8>,
}

impl Icmp {
    /// ICMP echo request (type 8) with `id` and `seq` and 32 bytes of data.
    pub fn echo_request(id: u16, seq: u16) -> Self {
        Icmp::echo(8, id, seq)
    }

    /// ICMP echo reply (type 0).
    pub fn echo_reply(id: u16, seq: u16) -> Self {
        Icmp::echo(0, id, seq)
    }

    /// ICMPv6 echo request (type 128); wrap it in [`Transport::Icmpv6`].
    pub fn echo6_request(id: u16, seq: u16) -> Self {
        Icmp::echo(128, id, seq)
    }

    /// ICMPv6 echo reply (type 129).
    pub fn echo6_reply(id: u16, seq: u16) -> Self {
        Icmp::echo(129, id, seq)
    }

    fn echo(ty: u8, id: u16, seq: u16) -> Self {
        let mut rest = [0; 4];
        rest[..2].copy_from_slice(&id.to_be_bytes());
        rest[2..].copy_from_slice(&seq.to_be_bytes());
        Icmp {
            ty,
            code: 0,
            rest,
            checksum: Checksum::Correct,
            payload: (0..32).collect(),
        }
    }

    fn encode(&self, pseudo: Option<Pseudo>) -> Vec<u8> {
        let mut msg = vec![self.ty, self.code, 0, 0];
        msg.extend_from_slice(&self.rest);
        msg.extend_from_slice(&self.payload);
        let initial = pseudo.map_or(0, |p| p.sum(IPPROTO_ICMPV6, msg.len()));
        fill_checksum(&mut msg, 2, initial, self.checksum, false);
        msg
    }
}

/// A VXLAN header (RFC 7348) and the inner frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vxlan {
    /// VXLAN network identifier (24 bits).
    pub vni: u32,
    /// Flags byte; 0x08 (the I flag: VNI valid) normally.
    pub flags: u8,
    /// The encapsulated Ethernet frame.
    pub inner: Vec<u8>,
}

impl Vxlan {
    /// VXLAN with the I flag and `vni`.
    pub fn new(vni: u32, inner: &[u8]) -> Self {
        Vxlan {
            vni,
            flags: 0x08,
            inner: inner.to_vec(),
        }
    }

    /// Header + inner frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![self.flags, 0, 0, 0];
        out.extend_from_slice(&(self.vni << 8).to_be_bytes());
        out.extend_from_slice(&self.inner);
        out
    }
}

/// The payload of an IP packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// TCP.
    Tcp(Tcp),
    /// UDP.
    Udp(Udp),
    /// ICMP (only inside IPv4).
    Icmp(Icmp),
    /// ICMPv6 (only inside IPv6; its checksum covers the pseudo-header).
    Icmpv6(Icmp),
    /// Anything else, as bytes (IPIP, ESP, a fragment's piece, ...).
    Raw {
        /// IP protocol / next header.
        proto: u8,
        /// The bytes after the IP header.
        bytes: Vec<u8>,
    },
}

impl Transport {
    /// The IP protocol number.
    pub fn proto(&self) -> u8 {
        match self {
            Transport::Tcp(_) => IPPROTO_TCP,
            Transport::Udp(_) => IPPROTO_UDP,
            Transport::Icmp(_) => IPPROTO_ICMP,
            Transport::Icmpv6(_) => IPPROTO_ICMPV6,
            Transport::Raw { proto, .. } => *proto,
        }
    }

    fn encode(&self, pseudo: Pseudo) -> Vec<u8> {
        match self {
            Transport::Tcp(t) => t.encode(pseudo),
            Transport::Udp(u) => u.encode(pseudo),
            Transport::Icmp(i) => i.encode(None),
            Transport::Icmpv6(i) => i.encode(Some(pseudo)),
            Transport::Raw { bytes, .. } => bytes.clone(),
        }
    }
}

impl From<Tcp> for Transport {
    fn from(t: Tcp) -> Self {
        Transport::Tcp(t)
    }
}

impl From<Udp> for Transport {
    fn from(u: Udp) -> Self {
        Transport::Udp(u)
    }
}

/// ICMP inside IPv4; for ICMPv6 build [`Transport::Icmpv6`] explicitly.
impl From<Icmp> for Transport {
    fn from(i: Icmp) -> Self {
        Transport::Icmp(i)
    }
}

// ---------------------------------------------------------------------------------------------
// L3

/// An IPv4 packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv4 {
    /// Source address.
    pub src: Ipv4Addr,
    /// Destination address.
    pub dst: Ipv4Addr,
    /// Type of service (DSCP + ECN).
    pub tos: u8,
    /// Identification.
    pub id: u16,
    /// Don't-fragment flag.
    pub dont_fragment: bool,
    /// More-fragments flag.
    pub more_fragments: bool,
    /// Fragment offset in 8-byte units.
    pub fragment_offset: u16,
    /// Time to live.
    pub ttl: u8,
    /// Options, padded with zeros (end of option list) to a multiple of 4 bytes.
    pub options: Vec<u8>,
    /// Version field; `None` = 4.
    pub version: Option<u8>,
    /// IHL field in 32-bit words; `None` = computed from the options.
    pub ihl: Option<u8>,
    /// Total length field; `None` = header + payload.
    pub total_length: Option<u16>,
    /// Protocol field; `None` = the payload's.
    pub proto: Option<u8>,
    /// Header checksum field.
    pub checksum: Checksum,
    /// The payload.
    pub payload: Transport,
}

impl Ipv4 {
    /// A packet from `src` to `dst` carrying `payload`: TTL 64, DF set, id 1, no options.
    pub fn new(src: Ipv4Addr, dst: Ipv4Addr, payload: impl Into<Transport>) -> Self {
        Ipv4 {
            src,
            dst,
            tos: 0,
            id: 1,
            dont_fragment: true,
            more_fragments: false,
            fragment_offset: 0,
            ttl: 64,
            options: Vec::new(),
            version: None,
            ihl: None,
            total_length: None,
            proto: None,
            checksum: Checksum::Correct,
            payload: payload.into(),
        }
    }

    /// The header and payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        let payload = self.payload.encode(Pseudo::V4(self.src, self.dst));
        self.encode_with_payload(&payload)
    }

    fn encode_with_payload(&self, payload: &[u8]) -> Vec<u8> {
        let mut options = self.options.clone();
        options.resize(options.len().div_ceil(4) * 4, 0);
        let hdr_len = 20 + options.len();
        let ihl = self.ihl.unwrap_or((hdr_len / 4) as u8);
        let total = self
            .total_length
            .unwrap_or((hdr_len + payload.len()) as u16);
        let flags_offset = (u16::from(self.dont_fragment) << 14)
            | (u16::from(self.more_fragments) << 13)
            | (self.fragment_offset & 0x1fff);
        let mut out = Vec::with_capacity(hdr_len + payload.len());
        out.push((self.version.unwrap_or(4) << 4) | (ihl & 0x0f));
        out.push(self.tos);
        out.extend_from_slice(&total.to_be_bytes());
        out.extend_from_slice(&self.id.to_be_bytes());
        out.extend_from_slice(&flags_offset.to_be_bytes());
        out.push(self.ttl);
        out.push(self.proto.unwrap_or(self.payload.proto()));
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&self.src.octets());
        out.extend_from_slice(&self.dst.octets());
        out.extend_from_slice(&options);
        let correct = checksum(&out);
        out[10..12].copy_from_slice(&self.checksum.resolve(correct).to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// Splits the packet into fragments carrying at most `max_payload` bytes each (rounded down
    /// to a multiple of 8), as a router would: the L4 header and its checksum are computed over
    /// the whole datagram; options are copied into every fragment.
    pub fn fragments(&self, max_payload: usize) -> Vec<Vec<u8>> {
        let payload = self.payload.encode(Pseudo::V4(self.src, self.dst));
        let proto = self.payload.proto();
        pieces(&payload, max_payload)
            .map(|(offset, more, chunk)| {
                let fragment = Ipv4 {
                    dont_fragment: false,
                    more_fragments: more || self.more_fragments,
                    fragment_offset: self.fragment_offset + offset,
                    proto: Some(proto),
                    ..self.clone()
                };
                fragment.encode_with_payload(chunk)
            })
            .collect()
    }
}

/// `payload` in pieces of at most `max_payload` bytes (rounded down to a multiple of 8, at
/// least 8), each with its offset in 8-byte units and whether more pieces follow: a
/// fragmenter's split, IPv4's and IPv6's alike.
fn pieces(payload: &[u8], max_payload: usize) -> impl Iterator<Item = (u16, bool, &[u8])> {
    let step = (max_payload / 8).max(1) * 8;
    let count = payload.len().div_ceil(step);
    payload
        .chunks(step)
        .enumerate()
        .map(move |(i, chunk)| ((i * step / 8) as u16, i + 1 < count, chunk))
}

/// An IPv6 extension header in the common format: next header, length in 8-byte units minus
/// one, then `data` (hop-by-hop, routing, destination options; also the fragment header, whose
/// second byte is reserved and zero). Not for AH, which counts in 4-byte units.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv6Ext {
    /// The header's own type ([`IPV6_EXT_HOP_BY_HOP`], ...).
    pub kind: u8,
    /// The bytes after the first two, padded with zeros to make the header a multiple of 8.
    pub data: Vec<u8>,
}

impl Ipv6Ext {
    /// A fragment header with `offset` (8-byte units), M flag and `id`.
    pub fn fragment(offset: u16, more: bool, id: u32) -> Self {
        let mut data = ((offset << 3) | u16::from(more)).to_be_bytes().to_vec();
        data.extend_from_slice(&id.to_be_bytes());
        Ipv6Ext {
            kind: IPV6_EXT_FRAGMENT,
            data,
        }
    }

    /// Hop-by-hop options holding only padding (PadN).
    pub fn hop_by_hop_padding() -> Self {
        Ipv6Ext {
            kind: IPV6_EXT_HOP_BY_HOP,
            data: vec![1, 4, 0, 0, 0, 0],
        }
    }
}

/// An IPv6 packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv6 {
    /// Source address.
    pub src: Ipv6Addr,
    /// Destination address.
    pub dst: Ipv6Addr,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Hop limit.
    pub hop_limit: u8,
    /// Version field; `None` = 6.
    pub version: Option<u8>,
    /// Payload length field; `None` = extension headers + payload.
    pub payload_length: Option<u16>,
    /// Extension headers, in order, between the fixed header and the payload.
    pub extensions: Vec<Ipv6Ext>,
    /// The upper-layer payload.
    pub payload: Transport,
}

impl Ipv6 {
    /// A packet from `src` to `dst` carrying `payload`: hop limit 64, no extension headers.
    pub fn new(src: Ipv6Addr, dst: Ipv6Addr, payload: impl Into<Transport>) -> Self {
        Ipv6 {
            src,
            dst,
            traffic_class: 0,
            flow_label: 0,
            hop_limit: 64,
            version: None,
            payload_length: None,
            extensions: Vec::new(),
            payload: payload.into(),
        }
    }

    /// Splits the packet into fragments with identification `id` carrying at most
    /// `max_payload` bytes of the upper-layer payload each (rounded down to a multiple of 8),
    /// as its sender would: the L4 header and its checksum are computed over the whole
    /// datagram; the extension headers are kept in every fragment, the fragment header after
    /// them.
    pub fn fragments(&self, max_payload: usize, id: u32) -> Vec<Vec<u8>> {
        let upper = self.payload.encode(Pseudo::V6(self.src, self.dst));
        let proto = self.payload.proto();
        pieces(&upper, max_payload)
            .map(|(offset, more, chunk)| {
                let mut extensions = self.extensions.clone();
                extensions.push(Ipv6Ext::fragment(offset, more, id));
                Ipv6 {
                    extensions,
                    payload: Transport::Raw {
                        proto,
                        bytes: chunk.to_vec(),
                    },
                    ..self.clone()
                }
                .encode()
            })
            .collect()
    }

    /// The fixed header, extension headers and payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        let upper = self.payload.encode(Pseudo::V6(self.src, self.dst));
        let mut exts = Vec::new();
        for (i, ext) in self.extensions.iter().enumerate() {
            let next = self
                .extensions
                .get(i + 1)
                .map_or(self.payload.proto(), |e| e.kind);
            let mut data = ext.data.clone();
            data.resize((data.len() + 2).div_ceil(8) * 8 - 2, 0);
            exts.push(next);
            exts.push(((data.len() + 2) / 8 - 1) as u8);
            exts.extend_from_slice(&data);
        }
        let first = self
            .extensions
            .first()
            .map_or(self.payload.proto(), |e| e.kind);
        let len = self
            .payload_length
            .unwrap_or((exts.len() + upper.len()) as u16);
        let vcf = (u32::from(self.version.unwrap_or(6)) << 28)
            | (u32::from(self.traffic_class) << 20)
            | (self.flow_label & 0xfffff);
        let mut out = Vec::with_capacity(40 + exts.len() + upper.len());
        out.extend_from_slice(&vcf.to_be_bytes());
        out.extend_from_slice(&len.to_be_bytes());
        out.push(first);
        out.push(self.hop_limit);
        out.extend_from_slice(&self.src.octets());
        out.extend_from_slice(&self.dst.octets());
        out.extend_from_slice(&exts);
        out.extend_from_slice(&upper);
        out
    }
}

/// An ARP packet for Ethernet/IPv4.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arp {
    /// Operation: 1 request, 2 reply.
    pub op: u16,
    /// Sender hardware address.
    pub sender_mac: Mac,
    /// Sender protocol address.
    pub sender_ip: Ipv4Addr,
    /// Target hardware address.
    pub target_mac: Mac,
    /// Target protocol address.
    pub target_ip: Ipv4Addr,
}

impl Arp {
    /// "Who has `target_ip`? Tell `sender_ip`".
    pub fn request(sender_mac: Mac, sender_ip: Ipv4Addr, target_ip: Ipv4Addr) -> Self {
        Arp {
            op: 1,
            sender_mac,
            sender_ip,
            target_mac: [0; 6],
            target_ip,
        }
    }

    /// "`sender_ip` is at `sender_mac`", to `target`.
    pub fn reply(
        sender_mac: Mac,
        sender_ip: Ipv4Addr,
        target_mac: Mac,
        target_ip: Ipv4Addr,
    ) -> Self {
        Arp {
            op: 2,
            sender_mac,
            sender_ip,
            target_mac,
            target_ip,
        }
    }

    /// The 28 bytes of the ARP packet.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0, 1, 0x08, 0x00, 6, 4];
        out.extend_from_slice(&self.op.to_be_bytes());
        out.extend_from_slice(&self.sender_mac);
        out.extend_from_slice(&self.sender_ip.octets());
        out.extend_from_slice(&self.target_mac);
        out.extend_from_slice(&self.target_ip.octets());
        out
    }
}

/// What an Ethernet frame carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum L3 {
    /// IPv4.
    Ipv4(Ipv4),
    /// IPv6.
    Ipv6(Ipv6),
    /// ARP.
    Arp(Arp),
    /// Any other EtherType, as bytes.
    Raw {
        /// EtherType.
        ethertype: u16,
        /// Payload.
        bytes: Vec<u8>,
    },
}

impl L3 {
    /// The EtherType.
    pub fn ethertype(&self) -> u16 {
        match self {
            L3::Ipv4(_) => ETH_P_IP,
            L3::Ipv6(_) => ETH_P_IPV6,
            L3::Arp(_) => ETH_P_ARP,
            L3::Raw { ethertype, .. } => *ethertype,
        }
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            L3::Ipv4(p) => p.encode(),
            L3::Ipv6(p) => p.encode(),
            L3::Arp(a) => a.encode(),
            L3::Raw { bytes, .. } => bytes.clone(),
        }
    }
}

impl From<Ipv4> for L3 {
    fn from(p: Ipv4) -> Self {
        L3::Ipv4(p)
    }
}

impl From<Ipv6> for L3 {
    fn from(p: Ipv6) -> Self {
        L3::Ipv6(p)
    }
}

impl From<Arp> for L3 {
    fn from(a: Arp) -> Self {
        L3::Arp(a)
    }
}

/// An Ethernet frame (no FCS; test_run and AF_PACKET work without it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ethernet {
    /// Destination MAC.
    pub dst: Mac,
    /// Source MAC.
    pub src: Mac,
    /// An 802.1Q tag (TCI) before the EtherType.
    pub vlan: Option<u16>,
    /// EtherType field; `None` = the payload's.
    pub ethertype: Option<u16>,
    /// The payload.
    pub payload: L3,
    /// Bytes appended after the payload (link-layer padding).
    pub trailer: Vec<u8>,
}

impl Ethernet {
    /// A frame from `src` to `dst` carrying `payload`.
    pub fn new(src: Mac, dst: Mac, payload: impl Into<L3>) -> Self {
        Ethernet {
            dst,
            src,
            vlan: None,
            ethertype: None,
            payload: payload.into(),
            trailer: Vec::new(),
        }
    }

    /// A frame from `src` to `dst` carrying the encoded packet `l3` of `ethertype` (an IP
    /// fragment, a packet built by hand).
    pub fn carrying(src: Mac, dst: Mac, ethertype: u16, l3: &[u8]) -> Self {
        let payload = L3::Raw {
            ethertype,
            bytes: l3.to_vec(),
        };
        Ethernet::new(src, dst, payload)
    }

    /// The frame's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.dst);
        out.extend_from_slice(&self.src);
        if let Some(tci) = self.vlan {
            out.extend_from_slice(&ETH_P_8021Q.to_be_bytes());
            out.extend_from_slice(&tci.to_be_bytes());
        }
        let ethertype = self.ethertype.unwrap_or(self.payload.ethertype());
        out.extend_from_slice(&ethertype.to_be_bytes());
        out.extend_from_slice(&self.payload.encode());
        out.extend_from_slice(&self.trailer);
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Parsing

/// A decoded Ethernet frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Destination MAC.
    pub dst: Mac,
    /// Source MAC.
    pub src: Mac,
    /// 802.1Q TCI, if tagged.
    pub vlan: Option<u16>,
    /// EtherType of the payload.
    pub ethertype: u16,
    /// The payload.
    pub l3: ParsedL3,
    /// Bytes after the IP datagram (link-layer padding); empty for other payloads.
    pub trailer: Vec<u8>,
}

/// A decoded L3 payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParsedL3 {
    /// IPv4.
    Ipv4(ParsedIpv4),
    /// IPv6.
    Ipv6(ParsedIpv6),
    /// ARP.
    Arp(Arp),
    /// Any other EtherType.
    Other(Vec<u8>),
}

/// A decoded IPv4 packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedIpv4 {
    /// Source address.
    pub src: Ipv4Addr,
    /// Destination address.
    pub dst: Ipv4Addr,
    /// Type of service.
    pub tos: u8,
    /// Total length field.
    pub total_length: u16,
    /// Identification.
    pub id: u16,
    /// DF flag.
    pub dont_fragment: bool,
    /// MF flag.
    pub more_fragments: bool,
    /// Fragment offset in 8-byte units.
    pub fragment_offset: u16,
    /// TTL.
    pub ttl: u8,
    /// Protocol.
    pub proto: u8,
    /// Header checksum field.
    pub checksum: u16,
    /// Whether the header checksum verifies.
    pub checksum_ok: bool,
    /// Options bytes.
    pub options: Vec<u8>,
    /// The payload (an L4 header only for unfragmented packets).
    pub l4: ParsedL4,
}

/// A decoded IPv6 packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedIpv6 {
    /// Source address.
    pub src: Ipv6Addr,
    /// Destination address.
    pub dst: Ipv6Addr,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label.
    pub flow_label: u32,
    /// Payload length field.
    pub payload_length: u16,
    /// Hop limit.
    pub hop_limit: u8,
    /// Extension headers: (type, bytes after the first two).
    pub extensions: Vec<(u8, Vec<u8>)>,
    /// The upper-layer protocol after the extension headers.
    pub proto: u8,
    /// The upper-layer payload (raw when the packet is a fragment).
    pub l4: ParsedL4,
}

/// A decoded upper-layer payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParsedL4 {
    /// TCP.
    Tcp {
        /// Source port.
        src_port: u16,
        /// Destination port.
        dst_port: u16,
        /// Sequence number.
        seq: u32,
        /// Acknowledgement number.
        ack: u32,
        /// Flags.
        flags: u8,
        /// Window.
        window: u16,
        /// Options bytes.
        options: Vec<u8>,
        /// Whether the checksum verifies.
        checksum_ok: bool,
        /// Payload.
        payload: Vec<u8>,
    },
    /// UDP.
    Udp {
        /// Source port.
        src_port: u16,
        /// Destination port.
        dst_port: u16,
        /// Checksum field (0 = none over IPv4).
        checksum: u16,
        /// Whether the checksum verifies (true for "none" over IPv4).
        checksum_ok: bool,
        /// Payload.
        payload: Vec<u8>,
    },
    /// ICMP or ICMPv6.
    Icmp {
        /// Type.
        ty: u8,
        /// Code.
        code: u8,
        /// Rest of header.
        rest: [u8; 4],
        /// Whether the checksum verifies.
        checksum_ok: bool,
        /// Data after the 8-byte header.
        payload: Vec<u8>,
    },
    /// A fragment's piece, or a protocol the parser does not decode.
    Raw(Vec<u8>),
}

impl ParsedL4 {
    /// Whether the checksum verifies (true for payloads without one).
    pub fn checksum_ok(&self) -> bool {
        match self {
            ParsedL4::Tcp { checksum_ok, .. }
            | ParsedL4::Udp { checksum_ok, .. }
            | ParsedL4::Icmp { checksum_ok, .. } => *checksum_ok,
            ParsedL4::Raw(_) => true,
        }
    }

    /// The UDP payload, if this is UDP.
    pub fn udp_payload(&self) -> Option<&[u8]> {
        match self {
            ParsedL4::Udp { payload, .. } => Some(payload),
            _ => None,
        }
    }
}

impl Frame {
    /// Every checksum in the frame verifies (IPv4 header and L4; not inside VXLAN).
    pub fn checksums_ok(&self) -> bool {
        match &self.l3 {
            ParsedL3::Ipv4(p) => p.checksum_ok && p.l4.checksum_ok(),
            ParsedL3::Ipv6(p) => p.l4.checksum_ok(),
            ParsedL3::Arp(_) | ParsedL3::Other(_) => true,
        }
    }

    /// The L4 payload, if the frame is IP.
    pub fn l4(&self) -> Option<&ParsedL4> {
        match &self.l3 {
            ParsedL3::Ipv4(p) => Some(&p.l4),
            ParsedL3::Ipv6(p) => Some(&p.l4),
            ParsedL3::Arp(_) | ParsedL3::Other(_) => None,
        }
    }
}

/// Reads exactly `n` bytes at `at`, naming `what` when the frame is too short.
fn take<'a>(bytes: &'a [u8], at: usize, n: usize, what: &str) -> Result<&'a [u8]> {
    bytes.get(at..at + n).with_context(|| {
        format!(
            "{what}: need {n} bytes at offset {at}, frame has {}",
            bytes.len()
        )
    })
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn mac(b: &[u8]) -> Mac {
    let mut m = [0; 6];
    m.copy_from_slice(&b[..6]);
    m
}

/// Decodes `frame`. Fails (naming the field) on anything inconsistent: short headers, bad
/// version or header length, lengths beyond the frame. Bad checksums are only recorded.
pub fn parse(frame: &[u8]) -> Result<Frame> {
    let eth = take(frame, 0, 14, "Ethernet header")?;
    let mut ethertype = be16(eth, 12);
    let mut at = 14;
    let mut vlan = None;
    if ethertype == ETH_P_8021Q {
        let tag = take(frame, 14, 4, "802.1Q tag")?;
        vlan = Some(be16(tag, 0));
        ethertype = be16(tag, 2);
        at = 18;
    }
    let rest = &frame[at..];
    let (l3, used) = match ethertype {
        ETH_P_IP => {
            let (p, used) = parse_ipv4(rest)?;
            (ParsedL3::Ipv4(p), used)
        }
        ETH_P_IPV6 => {
            let (p, used) = parse_ipv6(rest)?;
            (ParsedL3::Ipv6(p), used)
        }
        ETH_P_ARP => (ParsedL3::Arp(parse_arp(rest)?), rest.len()),
        _ => (ParsedL3::Other(rest.to_vec()), rest.len()),
    };
    Ok(Frame {
        dst: mac(&eth[0..6]),
        src: mac(&eth[6..12]),
        vlan,
        ethertype,
        l3,
        trailer: rest[used..].to_vec(),
    })
}

/// [`parse`], then fail unless every checksum verifies.
pub fn verify(frame: &[u8]) -> Result<Frame> {
    let parsed = parse(frame)?;
    ensure!(parsed.checksums_ok(), "bad checksum in {parsed:#?}");
    Ok(parsed)
}

fn parse_arp(b: &[u8]) -> Result<Arp> {
    let a = take(b, 0, 28, "ARP packet")?;
    ensure!(
        be16(a, 0) == 1 && be16(a, 2) == ETH_P_IP && a[4] == 6 && a[5] == 4,
        "ARP: not Ethernet/IPv4 (htype {}, ptype {:#06x}, hlen {}, plen {})",
        be16(a, 0),
        be16(a, 2),
        a[4],
        a[5]
    );
    Ok(Arp {
        op: be16(a, 6),
        sender_mac: mac(&a[8..14]),
        sender_ip: Ipv4Addr::new(a[14], a[15], a[16], a[17]),
        target_mac: mac(&a[18..24]),
        target_ip: Ipv4Addr::new(a[24], a[25], a[26], a[27]),
    })
}

/// Returns the packet and the number of bytes it covers (its total length).
fn parse_ipv4(b: &[u8]) -> Result<(ParsedIpv4, usize)> {
    let fixed = take(b, 0, 20, "IPv4 header")?;
    ensure!(fixed[0] >> 4 == 4, "IPv4 version is {}", fixed[0] >> 4);
    let hdr_len = usize::from(fixed[0] & 0x0f) * 4;
    ensure!(hdr_len >= 20, "IPv4 IHL is {} (< 5)", hdr_len / 4);
    let hdr = take(b, 0, hdr_len, "IPv4 header with options")?;
    let total = usize::from(be16(hdr, 2));
    ensure!(
        total >= hdr_len && total <= b.len(),
        "IPv4 total length {total} outside {hdr_len}..={}",
        b.len()
    );
    let src = Ipv4Addr::new(hdr[12], hdr[13], hdr[14], hdr[15]);
    let dst = Ipv4Addr::new(hdr[16], hdr[17], hdr[18], hdr[19]);
    let flags = be16(hdr, 6);
    let proto = hdr[9];
    let more_fragments = flags & 0x2000 != 0;
    let fragment_offset = flags & 0x1fff;
    let payload = &b[hdr_len..total];
    let l4 = if more_fragments || fragment_offset != 0 {
        ParsedL4::Raw(payload.to_vec())
    } else {
        parse_l4(proto, payload, Pseudo::V4(src, dst))?
    };
    Ok((
        ParsedIpv4 {
            src,
            dst,
            tos: hdr[1],
            total_length: total as u16,
            id: be16(hdr, 4),
            dont_fragment: flags & 0x4000 != 0,
            more_fragments,
            fragment_offset,
            ttl: hdr[8],
            proto,
            checksum: be16(hdr, 10),
            checksum_ok: fold(sum_words(hdr, 0)) == 0xffff,
            options: hdr[20..].to_vec(),
            l4,
        },
        total,
    ))
}

fn parse_ipv6(b: &[u8]) -> Result<(ParsedIpv6, usize)> {
    let hdr = take(b, 0, 40, "IPv6 header")?;
    ensure!(hdr[0] >> 4 == 6, "IPv6 version is {}", hdr[0] >> 4);
    let payload_length = be16(hdr, 4);
    let end = 40 + usize::from(payload_length);
    ensure!(
        end <= b.len(),
        "IPv6 payload length {payload_length} beyond the {} bytes present",
        b.len() - 40
    );
    let vcf = be32(hdr, 0);
    let mut src = [0; 16];
    src.copy_from_slice(&hdr[8..24]);
    let mut dst = [0; 16];
    dst.copy_from_slice(&hdr[24..40]);
    let (src, dst) = (Ipv6Addr::from(src), Ipv6Addr::from(dst));

    let mut next = hdr[6];
    let mut at = 40;
    let mut extensions = Vec::new();
    let mut fragmented = false;
    while matches!(
        next,
        IPV6_EXT_HOP_BY_HOP | IPV6_EXT_ROUTING | IPV6_EXT_FRAGMENT | IPV6_EXT_DEST_OPTS
    ) {
        let head = take(&b[..end], at, 2, "IPv6 extension header")?;
        let len = (usize::from(head[1]) + 1) * 8;
        let ext = take(&b[..end], at, len, "IPv6 extension header body")?;
        if next == IPV6_EXT_FRAGMENT {
            let field = be16(ext, 2);
            fragmented = field & 1 != 0 || field >> 3 != 0;
        }
        extensions.push((next, ext[2..].to_vec()));
        next = ext[0];
        at += len;
    }
    let payload = &b[at..end];
    let l4 = if fragmented {
        ParsedL4::Raw(payload.to_vec())
    } else {
        parse_l4(next, payload, Pseudo::V6(src, dst))?
    };
    Ok((
        ParsedIpv6 {
            src,
            dst,
            traffic_class: (vcf >> 20) as u8,
            flow_label: vcf & 0xfffff,
            payload_length,
            hop_limit: hdr[7],
            extensions,
            proto: next,
            l4,
        },
        end,
    ))
}

fn parse_l4(proto: u8, b: &[u8], pseudo: Pseudo) -> Result<ParsedL4> {
    let verifies = |initial: u64| fold(sum_words(b, initial)) == 0xffff;
    Ok(match proto {
        IPPROTO_TCP => {
            let fixed = take(b, 0, 20, "TCP header")?;
            let hdr_len = usize::from(fixed[12] >> 4) * 4;
            ensure!(hdr_len >= 20, "TCP data offset is {} (< 5)", hdr_len / 4);
            let hdr = take(b, 0, hdr_len, "TCP header with options")?;
            ParsedL4::Tcp {
                src_port: be16(hdr, 0),
                dst_port: be16(hdr, 2),
                seq: be32(hdr, 4),
                ack: be32(hdr, 8),
                flags: hdr[13],
                window: be16(hdr, 14),
                options: hdr[20..].to_vec(),
                checksum_ok: verifies(pseudo.sum(IPPROTO_TCP, b.len())),
                payload: b[hdr_len..].to_vec(),
            }
        }
        IPPROTO_UDP => {
            let hdr = take(b, 0, 8, "UDP header")?;
            let len = usize::from(be16(hdr, 4));
            ensure!(
                len >= 8 && len <= b.len(),
                "UDP length {len} outside 8..={}",
                b.len()
            );
            let checksum = be16(hdr, 6);
            let none_allowed = matches!(pseudo, Pseudo::V4(..)) && checksum == 0;
            ParsedL4::Udp {
                src_port: be16(hdr, 0),
                dst_port: be16(hdr, 2),
                checksum,
                checksum_ok: none_allowed
                    || fold(sum_words(&b[..len], pseudo.sum(IPPROTO_UDP, len))) == 0xffff,
                payload: b[8..len].to_vec(),
            }
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            let hdr = take(b, 0, 8, "ICMP header")?;
            let initial = match pseudo {
                Pseudo::V6(..) => pseudo.sum(IPPROTO_ICMPV6, b.len()),
                Pseudo::V4(..) => 0,
            };
            let mut rest = [0; 4];
            rest.copy_from_slice(&hdr[4..8]);
            ParsedL4::Icmp {
                ty: hdr[0],
                code: hdr[1],
                rest,
                checksum_ok: verifies(initial),
                payload: b[8..].to_vec(),
            }
        }
        _ => ParsedL4::Raw(b.to_vec()),
    })
}

/// Decodes a VXLAN payload (the UDP payload): `(vni, inner frame)`.
pub fn parse_vxlan(payload: &[u8]) -> Result<(u32, &[u8])> {
    let hdr = take(payload, 0, 8, "VXLAN header")?;
    if hdr[0] & 0x08 == 0 {
        bail!("VXLAN I flag not set (flags {:#04x})", hdr[0]);
    }
    Ok((be32(hdr, 4) >> 8, &payload[8..]))
}

/// Writes `frames` to a pcap file (Ethernet link type) for tcpdump or Wireshark.
pub fn write_pcap(path: &Path, frames: &[Vec<u8>]) -> Result<()> {
    let mut out = Vec::new();
    out.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&4u16.to_le_bytes());
    out.extend_from_slice(&0i32.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&65535u32.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes());
    for (i, frame) in frames.iter().enumerate() {
        out.extend_from_slice(&(i as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        out.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        out.extend_from_slice(frame);
    }
    let mut file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    file.write_all(&out)
        .with_context(|| format!("writing {}", path.display()))
}

/// Reads the frames of a pcap file (as `tcpdump -w` writes it: microsecond or nanosecond
/// timestamps, either byte order, Ethernet or Linux "cooked" (SLL) link type; SLL frames are
/// returned with a synthetic Ethernet header built from the SLL address and protocol).
pub fn read_pcap(path: &Path) -> Result<Vec<Vec<u8>>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    parse_pcap(&bytes).with_context(|| format!("parsing {}", path.display()))
}

/// [`read_pcap`] on bytes.
pub fn parse_pcap(bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    const LINKTYPE_ETHERNET: u32 = 1;
    const LINKTYPE_LINUX_SLL: u32 = 113;
    let header = take(bytes, 0, 24, "pcap header")?;
    let magic = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let little = match magic {
        0xa1b2_c3d4 | 0xa1b2_3c4d => true,
        0xd4c3_b2a1 | 0x4d3c_b2a1 => false,
        other => bail!("not a pcap file (magic {other:#010x})"),
    };
    let u32_at = |b: &[u8], at: usize| {
        let w = [b[at], b[at + 1], b[at + 2], b[at + 3]];
        if little {
            u32::from_le_bytes(w)
        } else {
            u32::from_be_bytes(w)
        }
    };
    let link_type = u32_at(header, 20);
    ensure!(
        link_type == LINKTYPE_ETHERNET || link_type == LINKTYPE_LINUX_SLL,
        "unsupported pcap link type {link_type}"
    );
    let mut frames = Vec::new();
    let mut at = 24;
    while at < bytes.len() {
        let record = take(bytes, at, 16, "pcap record header")?;
        let captured = u32_at(record, 8) as usize;
        let original = u32_at(record, 12) as usize;
        ensure!(
            captured == original,
            "frame {} was truncated by the capture ({captured} of {original} bytes); use -s 0",
            frames.len()
        );
        let data = take(bytes, at + 16, captured, "pcap frame")?;
        frames.push(if link_type == LINKTYPE_LINUX_SLL {
            let sll = take(data, 0, 16, "SLL header")?;
            let mut eth = vec![0u8; 6];
            eth.extend_from_slice(&sll[6..12]);
            eth.extend_from_slice(&sll[14..16]);
            eth.extend_from_slice(&data[16..]);
            eth
        } else {
            data.to_vec()
        });
        at += 16 + captured;
    }
    Ok(frames)
}

/// A hex dump of `bytes`, 16 per line with offsets, for assertion messages.
pub fn hexdump(bytes: &[u8]) -> String {
    let mut out = String::new();
    for (i, line) in bytes.chunks(16).enumerate() {
        let _ = write!(out, "{:04x}:", i * 16);
        for b in line {
            let _ = write!(out, " {b:02x}");
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    const A4: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
    const B4: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 3);

    fn a6() -> Ipv6Addr {
        "fd00:10:244:1::2".parse().unwrap_or(Ipv6Addr::LOCALHOST)
    }

    fn b6() -> Ipv6Addr {
        "fd00:10:244:2::3".parse().unwrap_or(Ipv6Addr::LOCALHOST)
    }

    #[test]
    fn pcap_round_trips() {
        let frames = vec![
            Ethernet::new(
                MAC_A,
                MAC_B,
                Ipv4::new(A4, B4, Udp::new(1, 2).payload(b"x")),
            )
            .encode(),
            Ethernet::new(MAC_B, MAC_A, Arp::request(MAC_B, B4, A4)).encode(),
        ];
        let path = std::env::temp_dir().join(format!("flannel-pcap-{}.pcap", std::process::id()));
        write_pcap(&path, &frames).expect("write");
        let back = read_pcap(&path).expect("read");
        let _ = std::fs::remove_file(&path);
        assert_eq!(back, frames);
        assert!(parse_pcap(&[0u8; 24]).is_err());
    }

    #[test]
    fn ipv4_header_checksum_matches_the_published_example() {
        // The worked example from Wikipedia's "IPv4 header checksum": checksum 0xb861.
        let hdr = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&hdr), 0xb861);
        let built = Ipv4 {
            id: 0,
            total_length: Some(0x73),
            ..Ipv4::new(
                Ipv4Addr::new(192, 168, 0, 1),
                Ipv4Addr::new(192, 168, 0, 199),
                Transport::Raw {
                    proto: IPPROTO_UDP,
                    bytes: Vec::new(),
                },
            )
        }
        .encode();
        assert_eq!(&built[..10], &hdr[..10]);
        assert_eq!(&built[10..12], &[0xb8, 0x61]);
    }

    #[test]
    fn rfc1071_sum_handles_odd_lengths_and_carries() {
        // RFC 1071 §3 example: words 0001 f203 f4f5 f6f7 sum to 0x2ddf0, folded 0xddf2.
        assert_eq!(
            fold(sum_words(
                &[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7],
                0
            )),
            0xddf2
        );
        assert_eq!(sum_words(&[0x12], 0), 0x1200);
        assert_eq!(checksum(&[0xff, 0xff, 0xff, 0xff]), 0);
    }

    #[test]
    fn tcp_over_ipv4_round_trips() {
        let tcp = Tcp {
            options: vec![2, 4, 0x05, 0xb4, 1], // MSS 1460 + NOP, padded to 8
            ..Tcp::new(40000, 80)
                .flags(tcp_flags::SYN | tcp_flags::ACK)
                .payload(b"hello")
        };
        let frame = Ethernet::new(MAC_A, MAC_B, Ipv4::new(A4, B4, tcp)).encode();
        assert_eq!(frame.len(), 14 + 20 + 28 + 5);
        let parsed = verify(&frame).expect("valid frame");
        assert_eq!(
            (parsed.src, parsed.dst, parsed.ethertype),
            (MAC_A, MAC_B, ETH_P_IP)
        );
        let ParsedL3::Ipv4(ip) = &parsed.l3 else {
            panic!("not IPv4: {parsed:?}")
        };
        assert_eq!(
            (ip.src, ip.dst, ip.ttl, ip.proto),
            (A4, B4, 64, IPPROTO_TCP)
        );
        assert!(ip.dont_fragment && !ip.more_fragments);
        match &ip.l4 {
            ParsedL4::Tcp {
                src_port,
                dst_port,
                flags,
                options,
                payload,
                ..
            } => {
                assert_eq!((*src_port, *dst_port), (40000, 80));
                assert_eq!(*flags, tcp_flags::SYN | tcp_flags::ACK);
                assert_eq!(options, &[2, 4, 0x05, 0xb4, 1, 0, 0, 0]);
                assert_eq!(payload, b"hello");
            }
            other => panic!("not TCP: {other:?}"),
        }
    }

    #[test]
    fn every_checksum_is_checked() {
        let bad_ip = Ipv4 {
            checksum: Checksum::Value(0x1234),
            ..Ipv4::new(A4, B4, Udp::new(1, 2))
        };
        let frame = Ethernet::new(MAC_A, MAC_B, bad_ip).encode();
        assert!(!parse(&frame).expect("parses").checksums_ok());
        assert!(verify(&frame).is_err());

        let bad_tcp = Tcp {
            checksum: Checksum::Value(1),
            ..Tcp::new(1, 2)
        };
        let frame = Ethernet::new(MAC_A, MAC_B, Ipv6::new(a6(), b6(), bad_tcp)).encode();
        assert!(verify(&frame).is_err());

        // A flipped payload bit breaks the ICMPv6 checksum (it covers the pseudo-header too).
        let mut frame = Ethernet::new(
            MAC_A,
            MAC_B,
            Ipv6::new(a6(), b6(), Transport::Icmpv6(Icmp::echo6_request(7, 1))),
        )
        .encode();
        assert!(verify(&frame).is_ok());
        let last = frame.len() - 1;
        frame[last] ^= 1;
        assert!(verify(&frame).is_err());

        // Changing the IPv6 source changes the ICMPv6 pseudo-header.
        let mut frame = Ethernet::new(
            MAC_A,
            MAC_B,
            Ipv6::new(a6(), b6(), Transport::Icmpv6(Icmp::echo6_request(7, 1))),
        )
        .encode();
        frame[14 + 8 + 15] ^= 1;
        assert!(verify(&frame).is_err());
    }

    #[test]
    fn udp_checksum_zero_means_none_over_ipv4_only() {
        let none = Udp {
            checksum: Checksum::Value(0),
            ..Udp::new(53, 53).payload(b"q")
        };
        let v4 = Ethernet::new(MAC_A, MAC_B, Ipv4::new(A4, B4, none.clone())).encode();
        assert!(verify(&v4).is_ok());
        let v6 = Ethernet::new(MAC_A, MAC_B, Ipv6::new(a6(), b6(), none)).encode();
        assert!(verify(&v6).is_err());
    }

    #[test]
    fn fragments_reassemble_to_the_original_payload() {
        let packet = Ipv4::new(A4, B4, Udp::new(5000, 6000).payload(&[7; 100]));
        let whole = packet.encode();
        let fragments = packet.fragments(50);
        assert_eq!(fragments.len(), 3); // 108 bytes of UDP in 48 + 48 + 12
        let mut reassembled = Vec::new();
        for (i, f) in fragments.iter().enumerate() {
            let parsed = verify(
                &Ethernet::new(
                    MAC_A,
                    MAC_B,
                    L3::Raw {
                        ethertype: ETH_P_IP,
                        bytes: f.clone(),
                    },
                )
                .encode(),
            )
            .expect("fragment parses");
            let ParsedL3::Ipv4(ip) = parsed.l3 else {
                panic!("not IPv4")
            };
            assert_eq!(ip.fragment_offset, (i * 48 / 8) as u16);
            assert_eq!(ip.more_fragments, i < 2);
            assert!(!ip.dont_fragment);
            let ParsedL4::Raw(piece) = ip.l4 else {
                panic!("fragment decoded as L4")
            };
            reassembled.extend_from_slice(&piece);
        }
        assert_eq!(reassembled, whole[20..]);
    }

    #[test]
    fn ipv6_extension_headers_are_walked() {
        let packet = Ipv6 {
            extensions: vec![
                Ipv6Ext::hop_by_hop_padding(),
                Ipv6Ext::fragment(0, false, 9),
            ],
            ..Ipv6::new(a6(), b6(), Udp::new(1, 2).payload(b"x"))
        };
        let frame = Ethernet::new(MAC_A, MAC_B, packet).encode();
        assert_eq!(frame[14 + 6], IPV6_EXT_HOP_BY_HOP);
        let parsed = verify(&frame).expect("valid");
        let ParsedL3::Ipv6(ip) = parsed.l3 else {
            panic!("not IPv6")
        };
        assert_eq!(ip.payload_length, 8 + 8 + 9);
        assert_eq!(
            ip.extensions.iter().map(|e| e.0).collect::<Vec<_>>(),
            [IPV6_EXT_HOP_BY_HOP, IPV6_EXT_FRAGMENT]
        );
        assert_eq!(ip.proto, IPPROTO_UDP);
        assert_eq!(ip.l4.udp_payload(), Some(&b"x"[..]));
    }

    #[test]
    fn vxlan_wraps_and_unwraps_an_inner_frame() {
        let inner =
            Ethernet::new(MAC_A, MAC_B, Ipv4::new(A4, B4, Icmp::echo_request(1, 2))).encode();
        let outer = Ethernet::new(
            MAC_B,
            MAC_A,
            Ipv4::new(
                Ipv4Addr::new(192, 168, 77, 1),
                Ipv4Addr::new(192, 168, 77, 2),
                Udp::vxlan(44813, 1, &inner),
            ),
        )
        .encode();
        assert_eq!(outer.len(), 14 + 20 + 8 + 8 + inner.len());
        let parsed = verify(&outer).expect("valid outer");
        let payload = parsed.l4().and_then(ParsedL4::udp_payload).expect("UDP");
        let (vni, got) = parse_vxlan(payload).expect("VXLAN");
        assert_eq!(vni, 1);
        assert_eq!(got, &inner[..]);
        assert!(verify(got).is_ok());
    }

    #[test]
    fn arp_and_vlan_and_padding() {
        let mut eth = Ethernet::new(MAC_A, MAC_BROADCAST, Arp::request(MAC_A, A4, B4));
        eth.vlan = Some(100);
        let frame = eth.encode();
        assert_eq!(frame.len(), 18 + 28);
        let parsed = verify(&frame).expect("valid");
        assert_eq!(parsed.vlan, Some(100));
        assert_eq!(parsed.l3, ParsedL3::Arp(Arp::request(MAC_A, A4, B4)));

        let mut eth = Ethernet::new(MAC_A, MAC_B, Ipv4::new(A4, B4, Udp::new(1, 2)));
        eth.trailer = vec![0; 18]; // pad to the 60-byte minimum
        let parsed = verify(&eth.encode()).expect("valid");
        assert_eq!(parsed.trailer.len(), 18);
    }

    #[test]
    fn parse_names_what_is_wrong() {
        let frame = Ethernet::new(MAC_A, MAC_B, Ipv4::new(A4, B4, Tcp::new(1, 2))).encode();
        let err = parse(&frame[..14 + 20 + 10])
            .expect_err("short TCP")
            .to_string();
        assert!(err.contains("IPv4 total length"), "{err}");
        let short = Ipv4 {
            total_length: Some(30),
            ..Ipv4::new(A4, B4, Tcp::new(1, 2))
        };
        let err = parse(&Ethernet::new(MAC_A, MAC_B, short).encode())
            .expect_err("short TCP")
            .to_string();
        assert!(err.contains("TCP header"), "{err}");
        let bad_ihl = Ipv4 {
            ihl: Some(4),
            ..Ipv4::new(A4, B4, Tcp::new(1, 2))
        };
        let err = parse(&Ethernet::new(MAC_A, MAC_B, bad_ihl).encode())
            .expect_err("IHL 4")
            .to_string();
        assert!(err.contains("IHL is 4"), "{err}");
        assert!(parse(&frame[..13]).is_err());
    }

    /// tcpdump, an independent implementation, agrees that every checksum is correct.
    #[test]
    fn tcpdump_accepts_the_checksums() {
        let Ok(probe) = Command::new("tcpdump").arg("--version").output() else {
            eprintln!("skipped: tcpdump not installed");
            return;
        };
        assert!(probe.status.success());
        let frames = vec![
            Ethernet::new(
                MAC_A,
                MAC_B,
                Ipv4::new(A4, B4, Tcp::new(40000, 80).payload(b"abc")),
            )
            .encode(),
            Ethernet::new(
                MAC_A,
                MAC_B,
                Ipv4::new(A4, B4, Udp::new(5353, 53).payload(b"odd")),
            )
            .encode(),
            Ethernet::new(MAC_A, MAC_B, Ipv4::new(A4, B4, Icmp::echo_request(1, 1))).encode(),
            Ethernet::new(MAC_A, MAC_B, Ipv6::new(a6(), b6(), Tcp::new(40000, 443))).encode(),
            Ethernet::new(
                MAC_A,
                MAC_B,
                Ipv6::new(a6(), b6(), Udp::new(1, 2).payload(b"x")),
            )
            .encode(),
            Ethernet::new(
                MAC_A,
                MAC_B,
                Ipv6::new(a6(), b6(), Transport::Icmpv6(Icmp::echo6_request(1, 1))),
            )
            .encode(),
        ];
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("frames.pcap");
        write_pcap(&path, &frames).expect("pcap");
        let out = Command::new("tcpdump")
            .args(["-nn", "-vv", "-r"])
            .arg(&path)
            .output()
            .expect("tcpdump runs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(text.matches("(correct)").count(), 2, "TCP sums:\n{text}");
        assert_eq!(text.matches("[udp sum ok]").count(), 2, "UDP sums:\n{text}");
        assert_eq!(
            text.matches("[icmp6 sum ok]").count(),
            1,
            "ICMPv6 sum:\n{text}"
        );
        for bad in ["incorrect", "bad cksum", "wrong"] {
            assert!(!text.contains(bad), "tcpdump says {bad}:\n{text}");
        }
        assert!(text.contains("ICMP echo request, id 1, seq 1"), "{text}");
    }
}
