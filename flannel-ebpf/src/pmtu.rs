//! `tc_from_netdev`: path MTU discovery through the programs' IPIP (see
//! [`flannel_common::pmtu`] for why). A router's "fragmentation needed" about an IPIP packet
//! this node sent to one of its IPIP peers is rewritten into the error about the inner packet
//! (quoted outer header removed, MTU lowered by 20, addressed to the inner packet's source),
//! then:
//! - for a local pod whose flow the programs carry (no kernel flow): delivered into the pod
//!   like any packet for it ([`crate::deliver`]), since conntrack, which never saw the flow,
//!   would call the error `INVALID` (and kube-proxy drops those);
//! - otherwise (the node's own packet, a flow the kernel carries): handed to the stack, whose
//!   conntrack relates it to the flow (and undoes a NAT of the quoted packet).
//!
//! The sender learns the path MTU from the first error, as it would behind a kernel `ipip`
//! device, and sends smaller packets from then on. An error that quotes less than the inner
//! packet's header and its first 8 bytes cannot be matched to a socket and is left to the
//! kernel as it is (RFC 792 asks a router for only 8 bytes after the header it quotes, RFC
//! 1812 for as much as fits in 576 bytes, which Linux routers send).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC},
    programs::TcContext,
};
use flannel_common::{
    config::Config,
    flow::FlowKey,
    pmtu::{self, IPIP_HEADER_LEN},
    route::NODE_F_IPIP,
    stats::Reason,
};

use crate::{
    bridge::Outcome,
    deliver,
    fib::Fib,
    ipv4::{self, ICMP_ECHO_REQUEST},
    maps,
    netdev::Learnt,
    parse::{ETH_HDR_LEN, ETH_P_IP, PacketCtx as _, proto, ptr_at},
};

/// Where the ICMP header of an error without IP options starts.
const ICMP_AT: usize = ETH_HDR_LEN + 20;
/// Where the quoted (outer IPIP) header starts.
const QUOTED_AT: usize = ICMP_AT + 8;
/// Where the quoted inner packet starts.
const INNER_AT: usize = QUOTED_AT + IPIP_HEADER_LEN as usize;
/// Where it starts once the error is rewritten (the outer header gone).
const INNER_NOW_AT: usize = QUOTED_AT;

/// Reads `N` bytes at `at`.
#[inline(always)]
fn read<const N: usize>(ctx: &TcContext, at: usize) -> Option<[u8; N]> {
    let p = ptr_at::<TcContext, [u8; N]>(ctx, at)?;
    // SAFETY: ptr_at checked the N bytes are readable.
    Some(unsafe { p.read_unaligned() })
}

/// `tc_from_netdev`'s first look at an IPv4 frame (after the masquerade's): an ICMP
/// "fragmentation needed" for our public IP about an IPIP packet we sent to an IPIP peer is
/// rewritten and sent on as the module documentation says; `None` for anything else, which
/// the program's other steps take as it is. A BPF subprogram of its own called from the
/// program, so that its stack does not add to theirs.
#[inline(never)]
pub fn from_netdev(ctx: &TcContext) -> Option<(Outcome, Learnt)> {
    let cfg = maps::config()?;
    let ip = read::<20>(ctx, ETH_HDR_LEN)?;
    let icmp_type = read::<1>(ctx, ICMP_AT)?;
    let ethertype = read::<2>(ctx, 12)?;
    let whole = u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff == 0;
    if u16::from_be_bytes(ethertype) != ETH_P_IP
        || ip[0] != 0x45
        || !whole
        || ip[9] != proto::ICMP
        || icmp_type[0] != pmtu::ICMP_DEST_UNREACH
        || ip[16..20] != cfg.public_ip
    {
        return None;
    }
    let end = ETH_HDR_LEN + usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    if end > ctx.packet_len() {
        return None;
    }
    let (action, verdict) = if !rewrite(ctx, cfg, end)? {
        (TC_ACT_SHOT, Reason::DropRewriteFailed)
    } else {
        match into_pod(ctx, cfg) {
            TC_ACT_UNSPEC => (TC_ACT_OK, Reason::FastIpipFragNeeded),
            TC_ACT_SHOT => (TC_ACT_SHOT, Reason::DropRewriteFailed),
            action => (action, Reason::FastIpipFragNeeded),
        }
    };
    let outcome = Outcome {
        action,
        class: Reason::Ipv4Icmp,
        verdict,
    };
    Some((outcome, Learnt::default()))
}

/// Rewrites the error whose IP datagram ends at `end` (see [`from_netdev`]), if it is one
/// about our IPIP: `Some(true)` when it was rewritten, `Some(false)` when it was resized but
/// could not be written (it must not go on). A BPF subprogram of its own, so that its stack
/// and [`into_pod`]'s do not add up.
#[inline(never)]
fn rewrite(ctx: &TcContext, cfg: &Config, end: usize) -> Option<bool> {
    ctx.pull_headers(INNER_AT + 64);
    let ip = read::<20>(ctx, ETH_HDR_LEN)?;
    let icmp = read::<8>(ctx, ICMP_AT)?;
    let quoted = read::<20>(ctx, QUOTED_AT)?;
    let mtu = pmtu::ipip_frag_needed(&icmp, &quoted)?;
    let peer = [quoted[16], quoted[17], quoted[18], quoted[19]];
    if quoted[12..16] != cfg.public_ip || maps::node_flags(peer) & NODE_F_IPIP == 0 {
        return None;
    }
    // The inner header and the 8 bytes after it (ports, TCP sequence number) must be there.
    let [version_ihl] = read::<1>(ctx, INNER_AT)?;
    let inner_hdr = usize::from(version_ihl & 0x0f) * 4;
    if version_ihl >> 4 != 4 || inner_hdr < 20 || INNER_AT + inner_hdr + 8 > end {
        return None;
    }
    let to = read::<4>(ctx, INNER_AT + 12)?;
    let (new_ip, new_icmp) = pmtu::inner_frag_needed(&ip, &icmp, &quoted, to, mtu);

    // The outer IPv4 header goes; the new one and the ICMP header take the place of the old
    // ICMP header and the quoted outer header, in front of the quoted inner packet.
    deliver::decap(ctx, IPIP_HEADER_LEN as usize).ok()?;
    Some(ctx.store(ETH_HDR_LEN, &new_ip, 0).is_ok() && ctx.store(ICMP_AT, &new_icmp, 0).is_ok())
}

/// Whether the rewritten error is about a flow of a local pod that the programs carry (not
/// the kernel): ports, or an echo request's identifier, as `tc_from_bridge` keys flows.
#[inline(always)]
fn for_a_pod(ctx: &TcContext, cfg: &Config) -> Option<bool> {
    let inner = read::<20>(ctx, INNER_NOW_AT)?;
    let l4 = read::<8>(ctx, INNER_NOW_AT + usize::from(inner[0] & 0x0f) * 4)?;
    let to = [inner[12], inner[13], inner[14], inner[15]];
    let (local_port, remote_port) = match inner[9] {
        proto::TCP | proto::UDP => ([l4[0], l4[1]], [l4[2], l4[3]]),
        proto::ICMP if l4[0] == ICMP_ECHO_REQUEST => ([l4[4], l4[5]], [l4[4], l4[5]]),
        _ => return Some(false),
    };
    let later_fragment = u16::from_be_bytes([inner[6], inner[7]]) & 0x1fff != 0;
    let flow = FlowKey {
        local_addr: to,
        remote_addr: [inner[16], inner[17], inner[18], inner[19]],
        local_port,
        remote_port,
        proto: inner[9],
        _pad: crate::zeroed(),
    };
    Some(cfg.is_local_pod(to) && !later_fragment && !deliver::is_kernel_flow(&flow))
}

/// Delivers the rewritten error into its pod if it is for one ([`for_a_pod`]): the TC
/// action, `TC_ACT_SHOT` if the packet could not be written, or `TC_ACT_UNSPEC` to leave it
/// to the stack (not for a pod, a TTL that runs out, no resolved route). (A plain action: an
/// `Option` of a tuple returned from a BPF subprogram gets a BTF description the kernel
/// refuses.)
#[inline(never)]
fn into_pod(ctx: &TcContext, cfg: &Config) -> i32 {
    if for_a_pod(ctx, cfg) != Some(true) {
        return TC_ACT_UNSPEC;
    }
    let Some(error) = ipv4::read_header(ctx, ETH_HDR_LEN) else {
        return TC_ACT_UNSPEC;
    };
    if error.ttl <= 1 {
        return TC_ACT_UNSPEC;
    }
    // Only a resolved route: the other variants leave bytes of the enum undefined, which the
    // verifier refuses to see copied (a pod's unresolved neighbour is the stack's to resolve).
    match deliver::route_to_pod(ctx, &error, &mut 0) {
        route @ Fib::Resolved { .. } => deliver::deliver(ctx, &error, route).unwrap_or(TC_ACT_SHOT),
        Fib::NoNeigh { .. } | Fib::Failed => TC_ACT_UNSPEC,
    }
}
