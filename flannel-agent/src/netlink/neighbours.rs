//! ARP/NDP neighbours and vxlan FDB entries (bridge family, `self` flag).
//!
//! Per remote node upstream's vxlan backend installs, on `flannel.<VNI>`:
//! `ip neigh replace <remote subnet addr> dev flannel.1 lladdr <VtepMAC> nud permanent` and
//! `bridge fdb replace <VtepMAC> dev flannel.1 self dst <remote PublicIP> permanent`.
//! These are [`Netlink::replace_neighbour`] and [`Netlink::replace_fdb`].

use std::{fmt, net::IpAddr};

use rtnetlink::{
    packet_core::{NLM_F_APPEND, NLM_F_CREATE, NLM_F_REPLACE},
    packet_route::{
        AddressFamily, RouteNetlinkMessage,
        neighbour::{
            NeighbourAddress, NeighbourAttribute, NeighbourFlags as PacketFlags, NeighbourMessage,
            NeighbourState as PacketState,
        },
        route::{RouteProtocol, RouteType},
    },
};

use super::{
    IpFamily, Netlink, NetlinkError, RTPROT_FLANNEL, Request, errors::Ctx, format_mac,
    ip_from_bytes, mac_from_bytes,
};

/// Neighbour state (`NUD_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeighbourState {
    /// Resolution in progress.
    Incomplete,
    /// Confirmed reachable.
    Reachable,
    /// Valid but unconfirmed.
    Stale,
    /// Waiting before probing.
    Delay,
    /// Probing.
    Probe,
    /// Resolution failed.
    Failed,
    /// No ARP needed (e.g. point-to-point).
    Noarp,
    /// Static entry, never expires.
    Permanent,
    /// No state.
    None,
    /// A value (or combination) this code does not know.
    Other(u16),
}

impl NeighbourState {
    /// `NUD_PERMANENT`.
    const NUD_PERMANENT: u16 = 0x80;

    /// Decodes `ndm_state`. Any value with `NUD_PERMANENT` set is [`Self::Permanent`], as
    /// iproute2 reads it: `bridge fdb add ... permanent` stores `NUD_PERMANENT | NUD_NOARP`
    /// (0xc0), and such an entry (left by upstream flanneld or an operator) is as static as
    /// one the agent wrote.
    pub(crate) fn from_u16(v: u16) -> Self {
        if v & Self::NUD_PERMANENT != 0 {
            return Self::Permanent;
        }
        match v {
            0x01 => Self::Incomplete,
            0x02 => Self::Reachable,
            0x04 => Self::Stale,
            0x08 => Self::Delay,
            0x10 => Self::Probe,
            0x20 => Self::Failed,
            0x40 => Self::Noarp,
            0x80 => Self::Permanent,
            0x00 => Self::None,
            other => Self::Other(other),
        }
    }
}

/// Neighbour flags (`NTF_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct NeighbourFlags(pub u8);

impl NeighbourFlags {
    /// `NTF_USE`.
    pub const USE: u8 = 0x01;
    /// `NTF_SELF`: the entry belongs to the device itself (vxlan FDB), not to a bridge master.
    pub const SELF: u8 = 0x02;
    /// `NTF_MASTER`: the entry belongs to the master bridge.
    pub const MASTER: u8 = 0x04;
    /// `NTF_PROXY`.
    pub const PROXY: u8 = 0x08;
    /// `NTF_EXT_LEARNED`.
    pub const EXT_LEARNED: u8 = 0x10;
    /// `NTF_OFFLOADED`.
    pub const OFFLOADED: u8 = 0x20;
    /// `NTF_STICKY`.
    pub const STICKY: u8 = 0x40;
    /// `NTF_ROUTER`.
    pub const ROUTER: u8 = 0x80;

    /// Whether all bits of `flag` are set.
    pub fn contains(self, flag: u8) -> bool {
        self.0 & flag == flag
    }
}

/// An ARP (IPv4) or NDP (IPv6) neighbour entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Neighbour {
    /// Interface index.
    pub ifindex: u32,
    /// The neighbour's IP.
    pub ip: IpAddr,
    /// Its link-layer address, when known and 6 bytes long.
    pub mac: Option<[u8; 6]>,
    /// State.
    pub state: NeighbourState,
    /// Flags.
    pub flags: NeighbourFlags,
    /// Who installed it (`NDA_PROTOCOL`); [`RTPROT_FLANNEL`] for ours, `None` when unset.
    pub protocol: Option<u8>,
}

/// A forwarding-database entry of a vxlan device: frames for `mac` go to the VTEP `dst`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FdbEntry {
    /// Interface index of the vxlan device.
    pub ifindex: u32,
    /// Destination MAC (all zeros for the default/flood entry).
    pub mac: [u8; 6],
    /// Remote VTEP address, if the entry has one.
    pub dst: Option<IpAddr>,
    /// Remote VNI if it differs from the device's.
    pub vni: Option<u32>,
    /// Remote UDP port if it differs from the device's.
    pub port: Option<u16>,
    /// State (`Permanent` for static entries).
    pub state: NeighbourState,
    /// Flags (`SELF` for entries of the vxlan device itself).
    pub flags: NeighbourFlags,
    /// The bridge this port belongs to, for `MASTER` entries.
    pub master: Option<u32>,
}

impl fmt::Display for FdbEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", format_mac(&self.mac))?;
        if let Some(dst) = self.dst {
            write!(f, " dst {dst}")?;
        }
        write!(f, " dev #{}", self.ifindex)
    }
}

pub(crate) fn neighbour_from_message(message: &NeighbourMessage) -> Option<Neighbour> {
    let h = &message.header;
    if !matches!(h.family, AddressFamily::Inet | AddressFamily::Inet6) {
        return None;
    }
    let mut ip = None;
    let mut mac = None;
    let mut protocol = None;
    for attr in &message.attributes {
        match attr {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => ip = Some((*v4).into()),
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => ip = Some((*v6).into()),
            NeighbourAttribute::LinkLayerAddress(l) => mac = mac_from_bytes(l),
            NeighbourAttribute::Protocol(p) => protocol = Some(u8::from(*p)),
            _ => {}
        }
    }
    Some(Neighbour {
        ifindex: h.ifindex,
        ip: ip?,
        mac,
        state: NeighbourState::from_u16(u16::from(h.state)),
        flags: NeighbourFlags(h.flags.bits()),
        protocol,
    })
}

pub(crate) fn fdb_from_message(message: &NeighbourMessage) -> Option<FdbEntry> {
    let h = &message.header;
    if h.family != AddressFamily::Bridge {
        return None;
    }
    let mut entry = FdbEntry {
        ifindex: h.ifindex,
        mac: [0; 6],
        dst: None,
        vni: None,
        port: None,
        state: NeighbourState::from_u16(u16::from(h.state)),
        flags: NeighbourFlags(h.flags.bits()),
        master: None,
    };
    let mut mac = None;
    for attr in &message.attributes {
        match attr {
            NeighbourAttribute::LinkLayerAddress(l) => mac = mac_from_bytes(l),
            NeighbourAttribute::Destination(d) => {
                entry.dst = match d {
                    NeighbourAddress::Inet(v4) => Some((*v4).into()),
                    NeighbourAddress::Inet6(v6) => Some((*v6).into()),
                    NeighbourAddress::Other(bytes) => ip_from_bytes(bytes),
                    _ => None,
                }
            }
            NeighbourAttribute::Vni(v) => entry.vni = Some(*v),
            NeighbourAttribute::Port(p) => entry.port = Some(*p),
            NeighbourAttribute::Controller(m) => entry.master = Some(*m),
            _ => {}
        }
    }
    entry.mac = mac?;
    Some(entry)
}

fn neighbour_address(ip: IpAddr) -> NeighbourAddress {
    match ip {
        IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
        IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
    }
}

pub(crate) fn neighbour_message(
    ifindex: u32,
    ip: IpAddr,
    mac: Option<[u8; 6]>,
) -> NeighbourMessage {
    let mut message = NeighbourMessage::default();
    message.header.family = IpFamily::of(&ip).af();
    message.header.ifindex = ifindex;
    message
        .attributes
        .push(NeighbourAttribute::Destination(neighbour_address(ip)));
    if let Some(mac) = mac {
        message.header.state = PacketState::Permanent;
        message.header.kind = RouteType::Unicast;
        message
            .attributes
            .push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
        message
            .attributes
            .push(NeighbourAttribute::Protocol(RouteProtocol::from(
                RTPROT_FLANNEL,
            )));
    }
    message
}

pub(crate) fn fdb_message(ifindex: u32, mac: [u8; 6], dst: IpAddr, add: bool) -> NeighbourMessage {
    let mut message = NeighbourMessage::default();
    message.header.family = AddressFamily::Bridge;
    message.header.ifindex = ifindex;
    message.header.flags = PacketFlags::Own; // NTF_SELF
    if add {
        message.header.state = PacketState::Permanent;
    }
    message
        .attributes
        .push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
    message
        .attributes
        .push(NeighbourAttribute::Destination(neighbour_address(dst)));
    message
}

impl Netlink {
    /// The IPv4 and IPv6 neighbours of link `ifindex` (`ip neigh show dev DEV`).
    pub async fn list_neighbours(&self, ifindex: u32) -> Result<Vec<Neighbour>, NetlinkError> {
        let mut message = NeighbourMessage::default();
        message
            .attributes
            .push(NeighbourAttribute::IfIndex(ifindex));
        let ctx = Ctx::new("list neighbours", format!("of index {ifindex}"));
        let answers = self
            .dump(RouteNetlinkMessage::GetNeighbour(message), &ctx)
            .await?;
        Ok(answers
            .iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewNeighbour(n) => neighbour_from_message(n),
                _ => None,
            })
            .filter(|n| n.ifindex == ifindex)
            .collect())
    }

    /// Installs a permanent neighbour `ip` → `mac` on link `ifindex`, replacing any entry for
    /// `ip` (`ip neigh replace IP dev DEV lladdr MAC nud permanent proto 165`).
    pub async fn replace_neighbour(
        &self,
        ifindex: u32,
        ip: IpAddr,
        mac: [u8; 6],
    ) -> Result<(), NetlinkError> {
        self.send(replace_neighbour_request(ifindex, ip, mac)).await
    }

    /// Deletes the neighbour entry for `ip` on link `ifindex` (`ip neigh del IP dev DEV`).
    pub async fn delete_neighbour(&self, ifindex: u32, ip: IpAddr) -> Result<(), NetlinkError> {
        self.send(delete_neighbour_request(ifindex, ip)).await
    }

    /// The FDB entries of device `ifindex` (`bridge fdb show dev DEV`), including entries a
    /// bridge master holds for it.
    pub async fn list_fdb(&self, ifindex: u32) -> Result<Vec<FdbEntry>, NetlinkError> {
        let ctx = Ctx::new("list fdb", format!("of index {ifindex}"));
        let mut entries = self.dump_fdb(ifindex, None, &ctx).await?;
        entries.retain(|e| e.ifindex == ifindex);
        Ok(entries)
    }

    /// The FDB entries bridge `bridge` holds for its ports (`bridge fdb show br BR`): learnt,
    /// static and local (permanent) entries, each with the port it points to in `ifindex`.
    pub async fn list_bridge_fdb(&self, bridge: u32) -> Result<Vec<FdbEntry>, NetlinkError> {
        let ctx = Ctx::new("list fdb", format!("of bridge index {bridge}"));
        let mut entries = self.dump_fdb(0, Some(bridge), &ctx).await?;
        entries.retain(|e| e.master == Some(bridge) && !e.flags.contains(NeighbourFlags::SELF));
        Ok(entries)
    }

    /// Dumps the bridge-family neighbour table of device `ifindex` (0 for all), limited by the
    /// kernel to the ports of bridge `master` when given (a strict-checking dump filter: the
    /// vxlan device's entries, one per remote node, are not sent at all).
    async fn dump_fdb(
        &self,
        ifindex: u32,
        master: Option<u32>,
        ctx: &Ctx,
    ) -> Result<Vec<FdbEntry>, NetlinkError> {
        let mut message = NeighbourMessage::default();
        message.header.family = AddressFamily::Bridge;
        message.header.ifindex = ifindex;
        if let Some(master) = master {
            message
                .attributes
                .push(NeighbourAttribute::Controller(master));
        }
        let answers = self
            .dump(RouteNetlinkMessage::GetNeighbour(message), ctx)
            .await?;
        Ok(answers
            .iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewNeighbour(n) => fdb_from_message(n),
                _ => None,
            })
            .collect())
    }

    /// Installs `mac dst DST self permanent` on vxlan device `ifindex`, replacing the
    /// destination of an existing entry for `mac`
    /// (`bridge fdb replace MAC dev DEV self dst DST permanent`).
    pub async fn replace_fdb(
        &self,
        ifindex: u32,
        mac: [u8; 6],
        dst: IpAddr,
    ) -> Result<(), NetlinkError> {
        self.send(add_fdb_request(ifindex, mac, dst, false)).await
    }

    /// Adds another destination for `mac` (`bridge fdb append ...`), e.g. several VTEPs for
    /// the all-zeros flood entry.
    pub async fn append_fdb(
        &self,
        ifindex: u32,
        mac: [u8; 6],
        dst: IpAddr,
    ) -> Result<(), NetlinkError> {
        self.send(add_fdb_request(ifindex, mac, dst, true)).await
    }

    /// Deletes exactly the FDB entry `mac` → `dst` of vxlan device `ifindex` (other
    /// destinations of the same MAC stay).
    pub async fn delete_fdb(
        &self,
        ifindex: u32,
        mac: [u8; 6],
        dst: IpAddr,
    ) -> Result<(), NetlinkError> {
        self.send(delete_fdb_request(ifindex, mac, dst)).await
    }
}

pub(crate) fn replace_neighbour_request(ifindex: u32, ip: IpAddr, mac: [u8; 6]) -> Request {
    Request::new(
        RouteNetlinkMessage::NewNeighbour(neighbour_message(ifindex, ip, Some(mac))),
        NLM_F_CREATE | NLM_F_REPLACE,
        Ctx::new(
            "replace neighbour",
            format!("{ip} lladdr {} dev #{ifindex}", format_mac(&mac)),
        ),
    )
}

pub(crate) fn delete_neighbour_request(ifindex: u32, ip: IpAddr) -> Request {
    Request::new(
        RouteNetlinkMessage::DelNeighbour(neighbour_message(ifindex, ip, None)),
        0,
        Ctx::new("delete neighbour", format!("{ip} dev #{ifindex}")),
    )
}

/// `bridge fdb replace` (or `append`) `MAC dev DEV self dst DST permanent`.
pub(crate) fn add_fdb_request(ifindex: u32, mac: [u8; 6], dst: IpAddr, append: bool) -> Request {
    let (op, flags) = if append {
        ("append fdb", NLM_F_CREATE | NLM_F_APPEND)
    } else {
        ("replace fdb", NLM_F_CREATE | NLM_F_REPLACE)
    };
    Request::new(
        RouteNetlinkMessage::NewNeighbour(fdb_message(ifindex, mac, dst, true)),
        flags,
        Ctx::new(op, format!("{} dst {dst} dev #{ifindex}", format_mac(&mac))),
    )
}

pub(crate) fn delete_fdb_request(ifindex: u32, mac: [u8; 6], dst: IpAddr) -> Request {
    Request::new(
        RouteNetlinkMessage::DelNeighbour(fdb_message(ifindex, mac, dst, false)),
        0,
        Ctx::new(
            "delete fdb",
            format!("{} dst {dst} dev #{ifindex}", format_mac(&mac)),
        ),
    )
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    const MAC: [u8; 6] = [0x0e, 0x2a, 1, 2, 3, 4];

    #[test]
    fn neighbour_messages_round_trip() {
        let m = neighbour_message(4, Ipv4Addr::new(10, 244, 2, 0).into(), Some(MAC));
        assert_eq!(
            neighbour_from_message(&m),
            Some(Neighbour {
                ifindex: 4,
                ip: Ipv4Addr::new(10, 244, 2, 0).into(),
                mac: Some(MAC),
                state: NeighbourState::Permanent,
                flags: NeighbourFlags(0),
                protocol: Some(RTPROT_FLANNEL),
            })
        );
        let del = neighbour_message(4, Ipv6Addr::LOCALHOST.into(), None);
        assert_eq!(del.header.family, AddressFamily::Inet6);
        assert!(
            !del.attributes
                .iter()
                .any(|a| matches!(a, NeighbourAttribute::LinkLayerAddress(_)))
        );
    }

    #[test]
    fn fdb_messages_round_trip() {
        let m = fdb_message(4, MAC, Ipv4Addr::new(192, 168, 1, 2).into(), true);
        let e = fdb_from_message(&m);
        assert_eq!(
            e.as_ref().map(|e| (
                e.mac,
                e.dst,
                e.state,
                e.flags.contains(NeighbourFlags::SELF)
            )),
            Some((
                MAC,
                Some(Ipv4Addr::new(192, 168, 1, 2).into()),
                NeighbourState::Permanent,
                true
            ))
        );
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some("0e:2a:01:02:03:04 dst 192.168.1.2 dev #4")
        );
        // Bridge-family destinations are parsed as raw bytes by netlink-packet-route.
        let mut raw = NeighbourMessage::default();
        raw.header.family = AddressFamily::Bridge;
        raw.attributes
            .push(NeighbourAttribute::LinkLayerAddress(MAC.to_vec()));
        raw.attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Other(
                Ipv6Addr::LOCALHOST.octets().to_vec(),
            )));
        assert_eq!(
            fdb_from_message(&raw).and_then(|e| e.dst),
            Some(Ipv6Addr::LOCALHOST.into())
        );
    }

    #[test]
    fn states_decode() {
        assert_eq!(NeighbourState::from_u16(0x80), NeighbourState::Permanent);
        assert_eq!(NeighbourState::from_u16(0x02), NeighbourState::Reachable);
        // NUD_PERMANENT wins over other bits, as in iproute2: `bridge fdb add ... permanent`
        // stores NUD_PERMANENT | NUD_NOARP.
        assert_eq!(NeighbourState::from_u16(0xc0), NeighbourState::Permanent);
        assert_eq!(NeighbourState::from_u16(0x82), NeighbourState::Permanent);
        assert_eq!(NeighbourState::from_u16(0x40), NeighbourState::Noarp);
        assert_eq!(NeighbourState::from_u16(0x42), NeighbourState::Other(0x42));
    }
}
