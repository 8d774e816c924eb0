//! A local pod's fragmented UDP datagrams to remote pods, on the fast path like the rest of
//! their flow (`tc_from_bridge`, host-gw, VXLAN, IPIP and udp).
//!
//! Left to the kernel, the fragments of a flow whose other packets the programs send would
//! cross netfilter, and the CNI bridge's masquerade (an agent without `--ip-masq`) would give
//! them the node's address and another port: a connected UDP socket on the remote pod never
//! sees such datagrams. So the first fragment, which carries the ports, takes the full checks
//! ([`crate::decide::from_bridge`]: kernel flows, the NAT guard, the route) and, when the
//! programs send it, its datagram is remembered in [`FLANNEL_FRAGS4`]; the later fragments of a
//! remembered datagram (no ports) are sent the same way by their destination's route. A later
//! fragment of a datagram not remembered (its first went to the kernel, or came after it) goes
//! to the kernel too, so a datagram's fragments do not split between the two paths where the
//! pod sends them in order, as Linux does. Fragments with IP options, of other protocols (TCP
//! does not fragment, ICMP keeps working through the masquerade) stay with the kernel.
//! Arriving fragments are the kernel's on the receiving node, as before (udp: the forwarder's
//! socket takes every inner fragment, so a datagram's fragments meet on `flannel0`). IPv6
//! does the same in `crate::v6` (`read_fragment`).

use flannel_common::{nat::FragKey, stats::Reason};

use crate::{
    ipv4::{self, Ipv4Info},
    maps::FLANNEL_FRAGS4,
    parse::{ETH_HDR_LEN, IPV4_MF, IPV4_OFFSET_MASK, PacketCtx, proto, ptr_at},
};

/// A fragment of a local pod's UDP datagram, as the fast path decides on it.
pub struct Fragment {
    /// Its header fields, with the datagram's ports for a first fragment (zero for later ones).
    pub info: Ipv4Info,
    /// Its datagram.
    pub key: FragKey,
    /// Whether it is the first fragment (offset 0, more to come).
    pub first: bool,
}

/// Reads the fragment in `ctx` (IPv4 right after Ethernet, a header the parser checked) if it
/// is one the fast path may send: UDP without IP options, a first fragment long enough to
/// carry the ports. [`Reason::PassFragment`] otherwise.
#[inline(always)]
pub fn read<C: PacketCtx>(ctx: &C) -> Result<Fragment, Reason> {
    let l3 = ETH_HDR_LEN;
    let mut info = ipv4::read_header(ctx, l3).ok_or(Reason::PassFragment)?;
    if info.proto != proto::UDP || info.l4 != l3 + 20 {
        return Err(Reason::PassFragment);
    }
    let p = ptr_at::<C, [u8; 4]>(ctx, l3 + 4).ok_or(Reason::PassFragment)?;
    // SAFETY: ptr_at checked the 4 bytes (identification, flags and offset) are readable.
    let field = unsafe { p.read_unaligned() };
    let id = u16::from_be_bytes([field[0], field[1]]);
    let frags = u16::from_be_bytes([field[2], field[3]]);
    let first = frags & IPV4_OFFSET_MASK == 0;
    if first && frags & IPV4_MF == 0 {
        // Not a fragment at all (the parser would not have said so).
        return Err(Reason::PassFragment);
    }
    if first {
        if info.l4 + 8 > info.end() {
            return Err(Reason::PassFragment);
        }
        let p = ptr_at::<C, [u8; 4]>(ctx, info.l4).ok_or(Reason::PassFragment)?;
        // SAFETY: ptr_at checked the 4 bytes (the ports) are readable.
        let ports = unsafe { p.read_unaligned() };
        info.sport = [ports[0], ports[1]];
        info.dport = [ports[2], ports[3]];
        info.l4_hdr_len = 8;
    }
    Ok(Fragment {
        key: FragKey {
            saddr: info.src,
            daddr: info.dst,
            id,
            proto: info.proto,
            _pad: 0,
        },
        info,
        first,
    })
}

/// Whether the first fragment of `key`'s datagram was sent by the fast path.
#[inline(always)]
pub fn followed(key: &FragKey) -> bool {
    FLANNEL_FRAGS4.get_ptr(key).is_some()
}

/// Remembers that the first fragment of `key`'s datagram was sent by the fast path.
#[inline(always)]
pub fn remember(key: &FragKey) {
    let _ = FLANNEL_FRAGS4.insert(key, 0, 0);
}
