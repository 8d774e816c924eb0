//! Receive side: tunnel decapsulation, delivery of remote pods' packets to local pods, and
//! the two flow tables that keep the fast path consistent with the kernel's conntrack.
//!
//! # Why the receive side bypasses conntrack for pod-to-pod flows
//!
//! The transmit fast path (`tc_from_bridge`) skips netfilter, so conntrack never sees the
//! packets a pod sends to a remote pod. If the other direction went through the stack,
//! conntrack would see only half of each flow: the SYN-ACK answering a fast-pathed SYN is
//! `INVALID` to it (a SYN-ACK cannot open a connection), and kube-proxy drops INVALID packets in
//! `KUBE-FORWARD` (iptables and nftables modes, unless `conntrack.tcpBeLiberal`). A half-tracked
//! flow is also wrong after the fact: conntrack would time entries out or pick up the flow in
//! the middle with the wrong direction. So both directions of a pod-to-pod flow must take the
//! same path: fast path both ways, or the stack both ways.
//!
//! Conntrack is *needed* only for flows it has NAT state for. On this node that happens when
//! - a local pod connected to a Service and kube-proxy DNATed it to a remote pod: the outgoing
//!   packets had a ClusterIP destination, so `tc_from_bridge` passed them (no remote route) and
//!   they left through the kernel; `tc_to_netdev` records such local-pod → remote-pod flows in
//!   [`flannel_common::maps::KERNEL_FLOWS4`] and `tc_from_netdev` hands their replies to the
//!   stack ([`Reason::PassKernelFlow`]) so conntrack un-DNATs them;
//! - a remote pod opened a connection (a TCP SYN, any UDP datagram: not the answers to a local
//!   pod's masqueraded connection, see [`decide::nat_guard_candidate`]) to a host address (node
//!   IP, `cni0` gateway, tunnel address; a hostPort or NodePort) and a DNAT sent it to a local
//!   pod: `tc_from_netdev` records the remote endpoint in
//!   [`flannel_common::maps::NAT_GUARD4`] and `tc_from_bridge` sends the local pod's replies to
//!   it through the kernel ([`Reason::PassNatReply`]) so conntrack un-DNATs them.
//!
//! Every other flow between a local pod and a pod of a subnet in the route map is handled
//! entirely by the programs and conntrack holds no state for it, so delivering its packets
//! straight to the pod is what the stack would have done (route to `cni0`, decrement TTL,
//! resolve the pod's MAC, bridge to the pod's port) minus conntrack, which would only have had
//! half a flow. The receive side delivers with `bpf_fib_lookup` (route and the pod's MAC from
//! the bridge's neighbour table; the answer is remembered for up to a second, see
//! [`crate::hops`]), then:
//! - `bpf_redirect_peer` into the pod's namespace when the agent's mirror of the bridge's
//!   forwarding database ([`crate::pods`]) knows the veth port behind that MAC: no bridge, no
//!   veth transmit, no backlog queue;
//! - `bpf_redirect` to the bridge otherwise (a pod that has not sent anything yet, a MAC the
//!   mirror does not have yet), which keeps the bridge's FDB/ARP semantics.
//!
//! Connections conntrack NATed before the programs were attached (to the node, or to a new
//! pod's port) are written into these tables by the agent before it attaches, from a dump of
//! conntrack (`flannel_agent::bpf::seed`). Both tables are LRU maps: short flows (DNS lookups
//! through a Service) can fill them and evict a long-idle connection's entry, after which its
//! next packet from the far side would take the fast path. So the agent also writes the keys of
//! every open NATed TCP connection and UDP stream conntrack holds into a plain hash of each
//! ([`flannel_common::maps::HELD_FLOWS4`], [`flannel_common::maps::HELD_GUARD4`]), which only
//! it writes and prunes (on each read of conntrack), and a key in either map counts. Other
//! flows that change path midway (the fast path attached or detached under live connections)
//! are picked up by conntrack's loose TCP tracking as established flows.
//!
//! GSO packets (GRO aggregates of a real NIC; GSO packets a peer's fast path sent over a veth)
//! need care when they arrive in a tunnel. `bpf_skb_adjust_room` leaves `skb->encapsulation`
//! and the tunnel GSO type set when it removes the headers (the kernel's VXLAN receive clears
//! them in `iptunnel_pull_offloads`; BPF can only since `BPF_F_ADJ_ROOM_DECAP_L4_UDP`, not in
//! 6.18). Sent through the bridge, which has no `hw_enc_features`, every such packet would be
//! segmented in software before the pod gets it: measured here, 35 000 GSO packets became
//! 1.39 million on the pod's veth and a single TCP stream dropped from 12 to 4.6 Gbit/s.
//! `bpf_redirect_peer` has no transmit step, so nothing looks at those features: the packet
//! reaches the pod's TCP whole, as a GRO aggregate would. So a GSO VXLAN packet for a pod whose
//! port is known is decapsulated and delivered like any other; otherwise `tc_from_netdev`
//! leaves it to `flannel.<VNI>` (GRO cells, proper offload state) and records the flow in
//! [`flannel_common::maps::KERNEL_FLOWS4`]; from then on `tc_from_bridge` sends the local pod's
//! packets of that flow through the kernel too ([`Reason::PassKernelFlow`]), and conntrack
//! picks the flow up in the middle (an ACK-bearing segment is a valid start for loose
//! tracking). IPIP and the udp backend have no kernel receive to leave GSO packets to here (no
//! `ipip` module; the TUN path's socket takes no GSO datagrams): they are decapsulated and
//! delivered, into the pod when its port is known, else through the bridge at the price of the
//! software segmentation.
//!
//! Netfilter rules are therefore bypassed for pod-to-pod traffic in both directions; a
//! netfilter-based NetworkPolicy controller needs `--dataplane kernel`.

use aya_ebpf::{
    bindings::{
        BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_FIXED_GSO, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
    },
    btf_maps::LruHashMap,
    programs::TcContext,
};
use flannel_common::{
    config::{CFG_IPIP_KERNEL_RX, Config},
    hops::HopKey,
    maps::HELD_V4,
    memo::LearnSlot,
    stats::Reason,
};

use crate::{
    decide,
    fib::{self, Fib},
    hops,
    ipv4::{Ipv4Info, decremented_ttl_field},
    maps::{FLANNEL_HFLOWS4, FLANNEL_HNATGD4, FLANNEL_KFLOWS4, FLANNEL_NATGRD4, holds},
    parse::ETH_HDR_LEN,
};

/// The `adjust_room` flags for removing an IPv4 tunnel header (IPIP, or VXLAN with its UDP,
/// VXLAN and inner Ethernet headers): the inner packet is IPv4 as well, GSO packets keep their
/// segment size.
const DECAP_FLAGS: u64 = (BPF_F_ADJ_ROOM_FIXED_GSO | BPF_F_ADJ_ROOM_DECAP_L3_IPV4) as u64;

/// Whether an IPIP packet is the kernel's to receive rather than the programs': a kernel IPIP
/// device exists ([`CFG_IPIP_KERNEL_RX`]) and the packet is GSO, which that device receives
/// with the proper offload state (see the module documentation).
#[inline(always)]
pub fn ipip_is_the_kernels(ctx: &TcContext, cfg: &Config) -> bool {
    cfg.flags & CFG_IPIP_KERNEL_RX != 0 && fib::gso_size(ctx) != 0
}

/// Whether a GSO packet in VXLAN (either family) is the kernel's to receive rather than the
/// programs': `bpf_skb_adjust_room` cannot reset its UDP-tunnel offload state, so it may be
/// decapsulated only when it goes straight into the pod (`into_pod`; the bridge would
/// re-segment it in software) and is not UDP (`inner_proto`): a GSO UDP packet
/// (`UDP_SEGMENT`) must be segmented by the pod's socket, which that state makes fail. The
/// kernel's VXLAN receive handles both properly.
#[inline(always)]
pub fn vxlan_is_the_kernels(ctx: &TcContext, inner_proto: u8, into_pod: bool) -> bool {
    fib::gso_size(ctx) != 0 && (!into_pod || inner_proto == crate::parse::proto::UDP)
}

/// Removes `len` bytes after the Ethernet header (the outer tunnel headers).
#[inline(always)]
pub fn decap(ctx: &TcContext, len: usize) -> Result<(), Reason> {
    ctx.adjust_room(-(len as i32), BPF_ADJ_ROOM_MAC, DECAP_FLAGS)
        .map_err(|_| Reason::PassAdjustFailed)
}

/// The route to `inner`'s destination (a local pod) as if the packet arrived on the ingress
/// interface, checking `inner`'s length against the bridge's MTU (for GSO packets the kernel
/// checks the segments); remembered for up to a second ([`crate::hops`]). `mtu` gets the
/// route's MTU.
#[inline(always)]
pub fn route_to_pod(ctx: &TcContext, inner: &Ipv4Info, mtu: &mut u16) -> Fib {
    let tot_len = if fib::gso_size(ctx) == 0 {
        inner.tot_len
    } else {
        0
    };
    let key = HopKey {
        dst: inner.dst,
        via: [0; 4],
    };
    hops::route(key, tot_len, mtu, |mtu| {
        fib::lookup(ctx, fib::ingress_ifindex(ctx), inner, tot_len, mtu)
    })
}

/// Delivers a packet whose IPv4 header is now right after the Ethernet header (plain, or
/// decapsulated) to the local pod as `route` says: decrement its TTL, then redirect.
#[inline(always)]
pub fn deliver(ctx: &TcContext, inner: &Ipv4Info, route: Fib) -> Result<i32, Reason> {
    ctx.store(ETH_HDR_LEN + 8, &decremented_ttl_field(inner), 0)
        .map_err(|_| Reason::DropRewriteFailed)?;
    fib::deliver(ctx, route).ok_or(Reason::DropRewriteFailed)
}

/// Whether the kernel tracks the flow of a packet arriving for a local pod: learnt, or held
/// for an open NATed connection.
#[inline(always)]
pub fn is_kernel_flow(key: &flannel_common::flow::FlowKey) -> bool {
    FLANNEL_KFLOWS4.get_ptr(key).is_some()
        || (holds(HELD_V4, key.proto) && FLANNEL_HFLOWS4.get_ptr(key).is_some())
}

/// Whether a local pod's packet goes to a remote endpoint that reached us through a host
/// address (so conntrack may have to undo a DNAT on the reply): learnt, or held for an open
/// NATed connection.
#[inline(always)]
pub fn is_nat_guarded(key: &flannel_common::flow::PeerKey) -> bool {
    FLANNEL_NATGRD4.get_ptr(key).is_some()
        || (holds(HELD_V4, key.proto) && FLANNEL_HNATGD4.get_ptr(key).is_some())
}

/// Records the remote endpoint of `info` in the NAT guard if it is a candidate; true when a new
/// entry was added.
#[inline(always)]
pub fn learn_nat_guard(ctx: &TcContext, cfg: &Config, info: &Ipv4Info) -> bool {
    if !decide::nat_guard_candidate(cfg, info, || info.opens_a_flow(ctx)) {
        return false;
    }
    let key = decide::peer_key_from(info);
    if FLANNEL_NATGRD4.get_ptr(key).is_some() {
        return false;
    }
    learn(&FLANNEL_NATGRD4, key)
}

/// Adds `key` to the flow table `table` (a kernel-flow or NAT-guard map of either family);
/// true when it was added. A new entry retires the remembered decisions ([`crate::memo`]) of
/// the flows of its remote endpoint's learn slot, which skipped the flow tables. (The slot is
/// taken first: the key need not outlive the insert.)
#[inline(always)]
pub(crate) fn learn<K: LearnSlot, const N: usize, const F: usize>(
    table: &LruHashMap<K, u32, N, F>,
    key: K,
) -> bool {
    let slot = key.learn_slot();
    let added = table.insert(key, 1u32, 0).is_ok();
    if added {
        crate::memo::retire(slot);
    }
    added
}

/// Hands the flow of a packet arriving for a local pod to the kernel (both directions from now
/// on); true when a new entry was added.
#[inline(always)]
pub fn hand_to_kernel(info: &Ipv4Info) -> bool {
    let key = decide::flow_key_incoming(info);
    learn(&FLANNEL_KFLOWS4, key)
}

/// Records the flow of a local pod's packet that leaves through the kernel, if it is a
/// candidate; true when a new entry was added.
#[inline(always)]
pub fn learn_kernel_flow(cfg: &Config, info: &Ipv4Info) -> bool {
    if !decide::kernel_flow_candidate(cfg, info) {
        return false;
    }
    let key = decide::flow_key_outgoing(info);
    if FLANNEL_KFLOWS4.get_ptr(key).is_some() {
        return false;
    }
    learn(&FLANNEL_KFLOWS4, key)
}
