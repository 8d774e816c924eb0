//! `xdp_from_netdev` (native XDP on the external interface, opt-in): decapsulation of IPIP and
//! VXLAN packets for local pods *before* GRO.
//!
//! The idea: a tunnel packet decapsulated by TC (`bpf_skb_adjust_room`) keeps the tunnel's
//! offload state, so a GSO packet is segmented again in software on its way through the pod
//! bridge (see `deliver`), and packets that arrive one by one are delivered one by one, since
//! there is no GRO after TC. Decapsulated in the driver's XDP hook, the inner packets could go
//! through GRO like any plain TCP stream and reach `tc_from_netdev` as clean GSO packets.
//!
//! Measured on veth here, it does not pay: attaching XDP takes GSO away from the peer veth
//! (so the sender segments in software) and the veth's NAPI did not aggregate the decapsulated
//! packets (1 460–1 490 bytes per delivered packet); single-stream TCP dropped to 1–2 Gbit/s
//! against 8–11 Gbit/s with TC alone. It is therefore off unless the agent asks for it
//! (`FastPath::attach_netdev(.., xdp: true)`), for NICs whose drivers run native XDP with GRO
//! behind it; it is kept, tested and counted so that it can be measured there.
//!
//! Only packets `tc_from_netdev` would deliver are decapsulated here (same
//! [`crate::decide::deliverable`] check; the outer Ethernet addresses are kept so the packet is
//! still addressed to this host); everything else is left untouched for TC, `flannel.<VNI>` and
//! the stack. Native (driver) mode only: generic XDP runs after GRO and would gain nothing.

use aya_ebpf::{
    bindings::xdp_action::XDP_PASS, helpers::bpf_xdp_adjust_head, programs::XdpContext,
};
use flannel_common::{
    config::{CFG_ROUTED_RX, CFG_VXLAN_RX, Config},
    route::{NODE_F_IPIP, NODE_F_VXLAN},
    stats::Reason,
};

use crate::{
    decide, deliver,
    encap::{self, IPIP_OVERHEAD, IPPROTO_IPIP, VXLAN_OVERHEAD},
    ipv4::{self, Ipv4Info},
    maps,
    parse::{self, ETH_HDR_LEN, ETH_P_IP, proto, ptr_at, ptr_at_mut},
};

/// What one run did: the XDP action, the class and the verdict.
pub struct XdpOutcome {
    /// Always `XDP_PASS`: this program never drops or redirects.
    pub action: u32,
    /// The outer packet's class.
    pub class: Reason,
    /// What happened.
    pub verdict: Reason,
}

/// The body of `xdp_from_netdev`.
#[inline(always)]
pub fn from_netdev(ctx: &XdpContext) -> XdpOutcome {
    let parsed = parse::parse(ctx);
    let class = match &parsed {
        Ok(p) => p.class,
        Err(reason) => *reason,
    };
    let verdict = match maps::config() {
        None => Reason::PassNotConfigured,
        Some(cfg) => match decap_if_deliverable(ctx, cfg, &parsed) {
            Ok(reason) | Err(reason) => reason,
        },
    };
    XdpOutcome {
        action: XDP_PASS,
        class,
        verdict,
    }
}

#[inline(always)]
fn decap_if_deliverable(
    ctx: &XdpContext,
    cfg: &Config,
    parsed: &Result<parse::Packet, Reason>,
) -> Result<Reason, Reason> {
    let outer = match parsed {
        Ok(p) if p.ethertype == ETH_P_IP => *p,
        Ok(_) => return Err(Reason::PassNotIpv4),
        Err(_) => return Err(Reason::PassMalformed),
    };
    if outer.class == Reason::Ipv4Fragment || outer.class == Reason::Ipv4Options {
        return Err(Reason::PassNotForPod);
    }
    let info = ipv4::read(ctx, &outer).ok_or(Reason::PassMalformed)?;
    if info.dst != cfg.public_ip {
        return Err(Reason::PassNotForPod);
    }
    if info.proto == IPPROTO_IPIP {
        if cfg.flags & CFG_ROUTED_RX == 0 || maps::node_flags(info.src) & NODE_F_IPIP == 0 {
            return Err(Reason::PassUnknownPeer);
        }
        check_inner(ctx, cfg, ETH_HDR_LEN + IPIP_OVERHEAD, info.end())?;
        decap(ctx, IPIP_OVERHEAD)?;
        return Ok(Reason::FastXdpDecapIpip);
    }
    if info.proto == proto::UDP && u16::from_be_bytes(info.dport) == cfg.vxlan_port {
        if cfg.flags & CFG_VXLAN_RX == 0 || maps::node_flags(info.src) & NODE_F_VXLAN == 0 {
            return Err(Reason::PassUnknownPeer);
        }
        let end = check_vxlan(ctx, cfg, &info)?;
        check_inner(ctx, cfg, ETH_HDR_LEN + VXLAN_OVERHEAD, end)?;
        decap(ctx, VXLAN_OVERHEAD)?;
        return Ok(Reason::FastXdpDecapVxlan);
    }
    Err(Reason::PassNotForPod)
}

/// VXLAN header and inner Ethernet: our VNI and VTEP MAC, IPv4 inside, a sound UDP length;
/// where the inner frame ends.
#[inline(always)]
fn check_vxlan(ctx: &XdpContext, cfg: &Config, outer: &Ipv4Info) -> Result<usize, Reason> {
    encap::vxlan_inner_end(ctx, cfg, outer).ok_or(Reason::PassVxlanMismatch)
}

/// The inner packet at `l3`, in a tunnel payload ending at `end`, must be one
/// `tc_from_netdev` delivers.
#[inline(always)]
fn check_inner(ctx: &XdpContext, cfg: &Config, l3: usize, end: usize) -> Result<(), Reason> {
    let packet = ipv4::screen(&parse::parse_ipv4_at(ctx, l3, end))?;
    let inner = ipv4::read(ctx, &packet).ok_or(Reason::PassMalformed)?;
    decide::deliverable(
        cfg,
        &inner,
        |src| maps::route(src).copied(),
        deliver::is_kernel_flow,
    )
}

/// Removes `len` bytes after the Ethernet header, keeping the Ethernet addresses.
#[inline(always)]
fn decap(ctx: &XdpContext, len: usize) -> Result<(), Reason> {
    let macs: [u8; 12] = {
        let p = ptr_at::<XdpContext, [u8; 12]>(ctx, 0).ok_or(Reason::PassMalformed)?;
        // SAFETY: ptr_at checked the 12 bytes are readable.
        unsafe { p.read_unaligned() }
    };
    // SAFETY: plain helper call on the program's own context.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, len as i32) } != 0 {
        return Err(Reason::PassAdjustFailed);
    }
    let eth =
        ptr_at_mut::<XdpContext, [u8; ETH_HDR_LEN]>(ctx, 0).ok_or(Reason::DropRewriteFailed)?;
    let mut header = [0u8; ETH_HDR_LEN];
    header[..12].copy_from_slice(&macs);
    header[12..].copy_from_slice(&ETH_P_IP.to_be_bytes());
    // SAFETY: ptr_at_mut checked the 14 bytes lie within the packet.
    unsafe { eth.write_unaligned(header) };
    Ok(())
}
