//! Per-CPU counters kept by the eBPF programs, indexed by [`Reason`].
//!
//! Every program run counts the packet exactly once under a *classification* reason (what the
//! parser saw: [`ReasonKind::Class`] or [`ReasonKind::Malformed`]). The fast-path programs also
//! count it exactly once under a *verdict* reason: [`ReasonKind::Fast`] (handled in eBPF),
//! [`ReasonKind::Pass`] (handed to the kernel unchanged, and why) or [`ReasonKind::Drop`].
//! [`ReasonKind::Event`] reasons count side effects (a flow learnt) on top of that.
//!
//! New reasons are only ever appended, so the index of an existing reason never changes. The
//! classifier maps are sized [`Reason::COUNT`]; the fast-path maps, which are pinned and
//! survive agent upgrades, have [`COUNTER_SLOTS`] entries so that appending reasons does not
//! change their layout.

/// Entries of the pinned fast-path counter maps: room for reasons appended later.
pub const COUNTER_SLOTS: usize = 128;

const _: () = assert!(Reason::COUNT <= COUNTER_SLOTS);

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
    /// Handled by the fast path (forwarded, encapsulated, decapsulated or delivered).
    Fast,
    /// Handed to the kernel unchanged; the reason says why the fast path did not take it.
    Pass,
    /// Dropped by the fast path.
    Drop,
    /// A side effect counted in addition to the verdict.
    Event,
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
    /// `tc_from_bridge`: a pod's packet to a host-gw (or DirectRouting) peer, routed by `bpf_fib_lookup` and redirected to the external interface.
    FastHostGw = 23,
    /// `tc_from_bridge`: a pod's packet encapsulated in VXLAN and sent out of the external interface.
    FastVxlan = 24,
    /// `tc_from_bridge`: a pod's packet encapsulated in IPIP and sent out of the external interface.
    FastIpip = 25,
    /// `tc_to_netdev`: a packet the kernel routed to an IPIP peer (host-originated, or passed by `tc_from_bridge`), encapsulated on its way out.
    FastIpipEgress = 26,
    /// `tc_from_netdev`: IPIP from a known node, decapsulated and handed to the stack.
    FastDecapIpip = 27,
    /// `tc_from_netdev`: IPIP from a known node, decapsulated and delivered to the pod bridge.
    FastDeliverIpip = 28,
    /// `tc_from_netdev`: VXLAN from a known node, decapsulated and delivered to the pod bridge.
    FastDeliverVxlan = 29,
    /// `tc_from_netdev`: a plain (host-gw) packet from a remote pod delivered to the pod bridge.
    FastDeliver = 30,
    /// The config entry is not enabled yet.
    PassNotConfigured = 31,
    /// Not IPv4 (IPv6, ARP, other EtherTypes).
    PassNotIpv4 = 32,
    /// The parser rejected the packet (its class counter says why).
    PassMalformed = 33,
    /// An IPv4 fragment (the kernel reassembles; ports are unknown).
    PassFragment = 34,
    /// IPv4 with options.
    PassIpOptions = 35,
    /// Neither TCP, UDP nor ICMP.
    PassOtherProto = 36,
    /// ICMP other than echo request/reply (errors quote headers conntrack may have to rewrite).
    PassIcmpNotEcho = 37,
    /// The destination is not in a remote pod subnet (a local pod, a service, the host, the outside).
    PassNoRoute = 38,
    /// `tc_from_netdev`: neither a tunnel packet for us nor a remote pod's packet to a local pod.
    PassNotForPod = 39,
    /// The source is not where it should be (`tc_from_bridge`: not a local pod; `tc_from_netdev`: not in a remote pod subnet).
    PassForeignSource = 40,
    /// TTL 1 or 0: the kernel sends the ICMP time-exceeded.
    PassTtlExceeded = 41,
    /// `tc_from_bridge`: the remote endpoint reached this node through a host address (NAT guard hit), so conntrack may have to undo a DNAT.
    PassNatReply = 42,
    /// `tc_from_netdev`: the flow's outgoing packets went through the kernel (conntrack knows it).
    PassKernelFlow = 43,
    /// Too big for the path after encapsulation: the kernel path fragments or sends ICMP.
    PassTooBig = 44,
    /// `bpf_fib_lookup` found no usable route (or needs fragmentation).
    PassFibFailed = 45,
    /// `bpf_skb_adjust_room` refused the packet (it is unchanged).
    PassAdjustFailed = 46,
    /// The remote subnet's map entry has an unknown kind.
    PassBadRoute = 47,
    /// `tc_to_netdev`: the remote subnet is not an IPIP one; the kernel's packet goes out as it is.
    PassNotIpipRoute = 48,
    /// `tc_from_netdev`: a tunnel packet from a node that is not a peer of that kind.
    PassUnknownPeer = 49,
    /// `tc_from_netdev`: VXLAN for us with another VNI, flags, inner MAC or inner protocol: left to `flannel.<VNI>`.
    PassVxlanMismatch = 50,
    /// `tc_from_netdev`: VXLAN receive in eBPF is disabled (`CFG_VXLAN_RX`).
    PassVxlanRxOff = 51,
    /// `tc_from_netdev`: delivery of plain/IPIP packets is disabled (`CFG_ROUTED_RX`).
    PassRoutedRxOff = 52,
    /// Writing headers failed after the packet was already resized: it cannot be handed on.
    DropRewriteFailed = 53,
    /// `tc_to_netdev`: an IPIP packet too big for the external interface (no kernel IPIP path exists to fall back to).
    DropTooBig = 54,
    /// `tc_from_netdev` recorded a remote pod endpoint that talks to a host address (counted in addition to the verdict).
    LearnNatGuard = 55,
    /// `tc_to_netdev` recorded a pod-to-pod flow leaving through the kernel (counted in addition to the verdict).
    LearnKernelFlow = 56,
    /// `tc_from_netdev`: a GSO (GRO-aggregated) VXLAN packet. `bpf_skb_adjust_room` cannot
    /// reset the tunnel offload state the way the kernel's VXLAN receive does, so the packet
    /// would be segmented again in software on the way through the pod bridge; unless it can
    /// go straight into the pod's namespace ([`Reason::DeliverPeer`]), it is left to
    /// `flannel.<VNI>` and its flow is handed to the kernel in both directions. Also
    /// `tc_from_bridge`: a GSO UDP packet (`UDP_SEGMENT`) for a udp-backend peer, left to
    /// `flannel0`.
    PassGso = 57,
    /// `xdp_from_netdev`: IPIP for a local pod from a known node, decapsulated before GRO
    /// (`tc_from_netdev` then delivers the inner packet).
    FastXdpDecapIpip = 58,
    /// `xdp_from_netdev`: VXLAN for a local pod from a known node, decapsulated before GRO.
    FastXdpDecapVxlan = 59,
    /// `tc_from_bridge`: a pod's packet encapsulated as the udp backend does (UDP to the
    /// peer's port, the inner packet as payload) and sent out of the external interface.
    FastUdp = 60,
    /// `tc_from_netdev`: a udp-backend datagram for a local pod, decapsulated and delivered to
    /// the pod bridge.
    FastDeliverUdp = 61,
    /// `tc_from_netdev`: a GSO udp-backend datagram (which the TUN path's socket cannot take
    /// whole) not deliverable to a pod, decapsulated and handed to the stack.
    FastDecapUdp = 62,
    /// `tc_from_netdev`: a datagram to the udp backend's port whose outer or inner headers the
    /// fast path does not take as they are (IP options, lengths that disagree, a bad inner
    /// header checksum, not IPv4 inside): left to the TUN path's socket.
    PassUdpMismatch = 63,
    /// `tc_from_bridge`: a pod's IPv6 packet to a host-gw (or DirectRouting) peer, routed by
    /// `bpf_fib_lookup` and redirected to the external interface.
    FastHostGw6 = 64,
    /// `tc_from_bridge`: a pod's IPv6 packet encapsulated in VXLAN over IPv6 (as
    /// `flannel-v6.<VNI>` sends it) and sent out of the external interface.
    FastVxlan6 = 65,
    /// `tc_from_netdev`: a plain (host-gw) IPv6 packet from a remote pod delivered to the pod
    /// bridge.
    FastDeliver6 = 66,
    /// `tc_from_netdev`: VXLAN over IPv6 from a known node, decapsulated and its IPv6 packet
    /// delivered to the pod bridge.
    FastDeliverVxlan6 = 67,
    /// An IPv6 packet with extension headers (the kernel handles them).
    PassIpv6ExtHeader = 68,
    /// `tc_to_netdev`: a packet from the pod network to the outside, source-NATed to the node's address (also a node flow whose port collided with an earlier flow, moved to another port).
    FastSnat = 69,
    /// `tc_from_netdev`: a reply to a masqueraded flow, translated back to the pod (or the node flow).
    FastSnatReply = 70,
    /// An ICMP error about a masqueraded flow, translated together with the header it quotes (`tc_to_netdev`: from a pod; `tc_from_netdev`: for a pod).
    FastSnatIcmpError = 71,
    /// A non-first fragment of a masqueraded flow, its address translated (`tc_to_netdev`: the source; `tc_from_netdev`: the destination learnt from the first fragment).
    FastSnatFragment = 72,
    /// A flow of the node itself from the masquerade address, tracked so that no pod flow takes its port; unchanged.
    PassSnatHost = 73,
    /// `tc_to_netdev`: from the pod network to the outside, but kube-proxy marked it (0x4000) or the destination is in a no-masquerade prefix: unchanged, as upstream's RETURN rules decide.
    PassSnatExcluded = 74,
    /// `tc_from_netdev`: for the masquerade address with a port (identifier) of the NAT range, or a later fragment, but no live NAT entry: handed to the stack unchanged (the node's own traffic, or a reply after the flow expired). `tc_to_netdev`, while handing masquerade back to the kernel: a pod packet of no live NAT flow, unchanged (the kernel's rules decide).
    PassSnatNoEntry = 75,
    /// From the pod network to the outside, or a node flow, that the NAT cannot translate (another protocol or ICMP type, an ICMP error about an unknown flow, a node reply whose port a pod flow holds): unchanged.
    PassSnatUnhandled = 76,
    /// `tc_to_netdev`: a new pod flow found no free port for its destination after probing: dropped, never sent with the pod's address.
    DropSnatExhausted = 77,
    /// `tc_to_netdev`: the NAT maps refused an update (out of memory): dropped.
    DropSnatMapError = 78,
    /// A new NAT mapping was made (counted in addition to the verdict).
    LearnSnatFlow = 79,
    /// The new mapping could not keep the flow's original port: another one was allocated (counted in addition to the verdict).
    LearnSnatRemap = 80,
    /// `tc_from_netdev`: a packet for a local pod went straight into the pod's network
    /// namespace (`bpf_redirect_peer` into its veth, see [`crate::pods`]) instead of through
    /// the pod bridge (counted in addition to the verdict).
    DeliverPeer = 81,
    /// `tc_from_bridge`: a pod's GSO IPv6 packet for a VXLAN peer, routed by `bpf_fib_lookup`
    /// to `flannel-v6.<VNI>` (MACs and hop limit set) and redirected straight to it, which
    /// encapsulates and segments it (the fast path cannot give every segment its outer
    /// checksum): no netfilter, as for the flow's other packets.
    FastVxlan6Device = 82,
    /// `tc_from_bridge`, `tc_from_netdev`: a packet of a remembered flow, sent or delivered
    /// by its memo (see [`crate::memo`]) without the full checks (counted in addition to the
    /// verdict).
    MemoHit = 83,
    /// `tc_from_bridge`, `tc_from_netdev`: a memo too old to be used was confirmed by the
    /// fresh remembered route lookup it came from and used (see [`crate::memo`]), without the
    /// full checks (counted in addition to `memo_hit`).
    MemoConfirmed = 84,
    /// `tc_from_bridge`: a pod's GSO IPv4 packet for a VXLAN peer too long to encapsulate in
    /// one IPv4 datagram (a pod with BIG TCP), routed by `bpf_fib_lookup` to `flannel.<VNI>`
    /// (MACs and TTL set) and redirected straight to it, which encapsulates and segments it: no
    /// netfilter, as for the flow's other packets.
    FastVxlanDevice = 85,
    /// `tc_from_netdev`: an ICMP "fragmentation needed" about an IPIP packet this node sent,
    /// rewritten into the error about the inner packet for its sender (see
    /// `flannel_common::pmtu`) and delivered into the pod, or handed to the stack.
    FastIpipFragNeeded = 86,
}

impl Reason {
    /// Number of reasons: the `max_entries` of the stats maps.
    pub const COUNT: usize = 87;

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
        Reason::FastHostGw,
        Reason::FastVxlan,
        Reason::FastIpip,
        Reason::FastIpipEgress,
        Reason::FastDecapIpip,
        Reason::FastDeliverIpip,
        Reason::FastDeliverVxlan,
        Reason::FastDeliver,
        Reason::PassNotConfigured,
        Reason::PassNotIpv4,
        Reason::PassMalformed,
        Reason::PassFragment,
        Reason::PassIpOptions,
        Reason::PassOtherProto,
        Reason::PassIcmpNotEcho,
        Reason::PassNoRoute,
        Reason::PassNotForPod,
        Reason::PassForeignSource,
        Reason::PassTtlExceeded,
        Reason::PassNatReply,
        Reason::PassKernelFlow,
        Reason::PassTooBig,
        Reason::PassFibFailed,
        Reason::PassAdjustFailed,
        Reason::PassBadRoute,
        Reason::PassNotIpipRoute,
        Reason::PassUnknownPeer,
        Reason::PassVxlanMismatch,
        Reason::PassVxlanRxOff,
        Reason::PassRoutedRxOff,
        Reason::DropRewriteFailed,
        Reason::DropTooBig,
        Reason::LearnNatGuard,
        Reason::LearnKernelFlow,
        Reason::PassGso,
        Reason::FastXdpDecapIpip,
        Reason::FastXdpDecapVxlan,
        Reason::FastUdp,
        Reason::FastDeliverUdp,
        Reason::FastDecapUdp,
        Reason::PassUdpMismatch,
        Reason::FastHostGw6,
        Reason::FastVxlan6,
        Reason::FastDeliver6,
        Reason::FastDeliverVxlan6,
        Reason::PassIpv6ExtHeader,
        Reason::FastSnat,
        Reason::FastSnatReply,
        Reason::FastSnatIcmpError,
        Reason::FastSnatFragment,
        Reason::PassSnatHost,
        Reason::PassSnatExcluded,
        Reason::PassSnatNoEntry,
        Reason::PassSnatUnhandled,
        Reason::DropSnatExhausted,
        Reason::DropSnatMapError,
        Reason::LearnSnatFlow,
        Reason::LearnSnatRemap,
        Reason::DeliverPeer,
        Reason::FastVxlan6Device,
        Reason::MemoHit,
        Reason::MemoConfirmed,
        Reason::FastVxlanDevice,
        Reason::FastIpipFragNeeded,
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
            Reason::FastHostGw => "fast_host_gw",
            Reason::FastVxlan => "fast_vxlan",
            Reason::FastIpip => "fast_ipip",
            Reason::FastIpipEgress => "fast_ipip_egress",
            Reason::FastDecapIpip => "fast_decap_ipip",
            Reason::FastDeliverIpip => "fast_deliver_ipip",
            Reason::FastDeliverVxlan => "fast_deliver_vxlan",
            Reason::FastDeliver => "fast_deliver",
            Reason::PassNotConfigured => "pass_not_configured",
            Reason::PassNotIpv4 => "pass_not_ipv4",
            Reason::PassMalformed => "pass_malformed",
            Reason::PassFragment => "pass_fragment",
            Reason::PassIpOptions => "pass_ip_options",
            Reason::PassOtherProto => "pass_other_proto",
            Reason::PassIcmpNotEcho => "pass_icmp_not_echo",
            Reason::PassNoRoute => "pass_no_route",
            Reason::PassNotForPod => "pass_not_for_pod",
            Reason::PassForeignSource => "pass_foreign_source",
            Reason::PassTtlExceeded => "pass_ttl_exceeded",
            Reason::PassNatReply => "pass_nat_reply",
            Reason::PassKernelFlow => "pass_kernel_flow",
            Reason::PassTooBig => "pass_too_big",
            Reason::PassFibFailed => "pass_fib_failed",
            Reason::PassAdjustFailed => "pass_adjust_room_failed",
            Reason::PassBadRoute => "pass_bad_route",
            Reason::PassNotIpipRoute => "pass_not_ipip_route",
            Reason::PassUnknownPeer => "pass_unknown_peer",
            Reason::PassVxlanMismatch => "pass_vxlan_mismatch",
            Reason::PassVxlanRxOff => "pass_vxlan_rx_off",
            Reason::PassRoutedRxOff => "pass_routed_rx_off",
            Reason::DropRewriteFailed => "drop_rewrite_failed",
            Reason::DropTooBig => "drop_too_big",
            Reason::LearnNatGuard => "learn_nat_guard",
            Reason::LearnKernelFlow => "learn_kernel_flow",
            Reason::PassGso => "pass_gso",
            Reason::FastXdpDecapIpip => "fast_xdp_decap_ipip",
            Reason::FastXdpDecapVxlan => "fast_xdp_decap_vxlan",
            Reason::FastUdp => "fast_udp",
            Reason::FastDeliverUdp => "fast_deliver_udp",
            Reason::FastDecapUdp => "fast_decap_udp",
            Reason::PassUdpMismatch => "pass_udp_mismatch",
            Reason::FastHostGw6 => "fast_host_gw6",
            Reason::FastVxlan6 => "fast_vxlan6",
            Reason::FastDeliver6 => "fast_deliver6",
            Reason::FastDeliverVxlan6 => "fast_deliver_vxlan6",
            Reason::FastVxlan6Device => "fast_vxlan6_device",
            Reason::FastVxlanDevice => "fast_vxlan_device",
            Reason::FastIpipFragNeeded => "fast_ipip_frag_needed",
            Reason::PassIpv6ExtHeader => "pass_ipv6_ext_header",
            Reason::FastSnat => "fast_snat",
            Reason::FastSnatReply => "fast_snat_reply",
            Reason::FastSnatIcmpError => "fast_snat_icmp_error",
            Reason::FastSnatFragment => "fast_snat_fragment",
            Reason::PassSnatHost => "pass_snat_host",
            Reason::PassSnatExcluded => "pass_snat_excluded",
            Reason::PassSnatNoEntry => "pass_snat_no_entry",
            Reason::PassSnatUnhandled => "pass_snat_unhandled",
            Reason::DropSnatExhausted => "drop_snat_exhausted",
            Reason::DropSnatMapError => "drop_snat_map_error",
            Reason::LearnSnatFlow => "learn_snat_flow",
            Reason::LearnSnatRemap => "learn_snat_remap",
            Reason::DeliverPeer => "deliver_peer",
            Reason::MemoHit => "memo_hit",
            Reason::MemoConfirmed => "memo_confirmed",
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
            Reason::FastHostGw
            | Reason::FastVxlan
            | Reason::FastIpip
            | Reason::FastIpipEgress
            | Reason::FastDecapIpip
            | Reason::FastDeliverIpip
            | Reason::FastDeliverVxlan
            | Reason::FastDeliver
            | Reason::FastXdpDecapIpip
            | Reason::FastXdpDecapVxlan
            | Reason::FastUdp
            | Reason::FastDeliverUdp
            | Reason::FastDecapUdp
            | Reason::FastHostGw6
            | Reason::FastVxlan6
            | Reason::FastDeliver6
            | Reason::FastDeliverVxlan6
            | Reason::FastVxlan6Device
            | Reason::FastVxlanDevice
            | Reason::FastIpipFragNeeded
            | Reason::FastSnat
            | Reason::FastSnatReply
            | Reason::FastSnatIcmpError
            | Reason::FastSnatFragment => ReasonKind::Fast,
            Reason::PassNotConfigured
            | Reason::PassNotIpv4
            | Reason::PassMalformed
            | Reason::PassFragment
            | Reason::PassIpOptions
            | Reason::PassOtherProto
            | Reason::PassIcmpNotEcho
            | Reason::PassNoRoute
            | Reason::PassNotForPod
            | Reason::PassForeignSource
            | Reason::PassTtlExceeded
            | Reason::PassNatReply
            | Reason::PassKernelFlow
            | Reason::PassTooBig
            | Reason::PassFibFailed
            | Reason::PassAdjustFailed
            | Reason::PassBadRoute
            | Reason::PassNotIpipRoute
            | Reason::PassUnknownPeer
            | Reason::PassVxlanMismatch
            | Reason::PassVxlanRxOff
            | Reason::PassRoutedRxOff
            | Reason::PassGso
            | Reason::PassUdpMismatch
            | Reason::PassIpv6ExtHeader
            | Reason::PassSnatHost
            | Reason::PassSnatExcluded
            | Reason::PassSnatNoEntry
            | Reason::PassSnatUnhandled => ReasonKind::Pass,
            Reason::DropRewriteFailed
            | Reason::DropTooBig
            | Reason::DropSnatExhausted
            | Reason::DropSnatMapError => ReasonKind::Drop,
            Reason::LearnNatGuard
            | Reason::LearnKernelFlow
            | Reason::LearnSnatFlow
            | Reason::LearnSnatRemap
            | Reason::DeliverPeer
            | Reason::MemoHit
            | Reason::MemoConfirmed => ReasonKind::Event,
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
    fn verdict_names_carry_their_kind() {
        for reason in Reason::ALL {
            let prefixes: &[&str] = match reason.kind() {
                ReasonKind::Fast => &["fast_"],
                ReasonKind::Pass => &["pass_"],
                ReasonKind::Drop => &["drop_"],
                // Something learnt, how a delivery was made, or that a memo decided.
                ReasonKind::Event => &["learn_", "deliver_", "memo_"],
                ReasonKind::Class | ReasonKind::Malformed => continue,
            };
            assert!(
                prefixes.iter().any(|p| reason.name().starts_with(p)),
                "{reason:?}"
            );
        }
    }

    #[test]
    fn classifier_reasons_keep_their_indices() {
        // Appending must never renumber what the classifier maps already use.
        assert_eq!(Reason::Ipv4Tcp.index(), 0);
        assert_eq!(Reason::Arp.index(), 11);
        assert_eq!(Reason::TcpBadOffset.index(), 22);
        assert_eq!(Reason::FastHostGw.index(), 23);
        assert_eq!(Reason::FastXdpDecapVxlan.index(), 59);
        assert_eq!(Reason::FastUdp.index(), 60);
        assert_eq!(Reason::PassIpv6ExtHeader.index(), 68);
        assert_eq!(Reason::FastSnat.index(), 69);
        assert_eq!(Reason::LearnSnatRemap.index(), 80);
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
