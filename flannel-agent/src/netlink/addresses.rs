//! Interface addresses: list, add, delete, and upstream's "ensure this address" helpers.
//!
//! [`Netlink::ensure_v4_address`] follows upstream's `EnsureV4AddressOnLink`: addresses of the
//! link that lie inside the flannel network but are not the wanted one are removed, addresses
//! outside it are kept, and the wanted one is added if missing. [`Netlink::ensure_v6_address`]
//! removes every non-link-local IPv6 address except the wanted one.

use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use rtnetlink::{
    packet_core::{NLM_F_CREATE, NLM_F_EXCL},
    packet_route::{
        AddressFamily, RouteNetlinkMessage,
        address::{AddressAttribute, AddressMessage},
    },
};

use super::{IpFamily, Netlink, NetlinkError, Request, errors::Ctx};

const IFA_F_SECONDARY: u32 = 0x01; // IFA_F_TEMPORARY for IPv6
const IFA_F_DADFAILED: u32 = 0x08;
const IFA_F_DEPRECATED: u32 = 0x20;
const IFA_F_TENTATIVE: u32 = 0x40;
const IFA_F_PERMANENT: u32 = 0x80;
const IFA_F_NOPREFIXROUTE: u32 = 0x200;

/// An address on an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Address {
    /// Interface index.
    pub ifindex: u32,
    /// The address with its prefix length, host bits kept (e.g. `10.244.1.0/32`,
    /// `192.168.1.5/24`).
    pub addr: IpNet,
    /// Address family.
    pub family: IpFamily,
    /// Address scope.
    pub scope: AddressScope,
    /// Address flags.
    pub flags: AddressFlags,
}

impl Address {
    /// The bare address.
    pub fn ip(&self) -> IpAddr {
        self.addr.addr()
    }
}

/// Address scope (`ifa_scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressScope {
    /// Global.
    Universe,
    /// Site-local (IPv6, deprecated).
    Site,
    /// Link-local.
    Link,
    /// Host-local (loopback).
    Host,
    /// Nowhere.
    Nowhere,
    /// A value this code does not know.
    Other(u8),
}

impl From<u8> for AddressScope {
    fn from(v: u8) -> Self {
        match v {
            0 => Self::Universe,
            200 => Self::Site,
            253 => Self::Link,
            254 => Self::Host,
            255 => Self::Nowhere,
            other => Self::Other(other),
        }
    }
}

/// Address flags (`IFA_F_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AddressFlags {
    /// Configured statically (not from autoconfiguration), `IFA_F_PERMANENT`.
    pub permanent: bool,
    /// Preferred lifetime expired, `IFA_F_DEPRECATED`.
    pub deprecated: bool,
    /// IPv6 privacy (temporary) address, `IFA_F_TEMPORARY`.
    pub temporary: bool,
    /// IPv4 secondary address (same bit as `temporary`), `IFA_F_SECONDARY`.
    pub secondary: bool,
    /// Duplicate address detection failed, `IFA_F_DADFAILED`.
    pub dadfailed: bool,
    /// Duplicate address detection still running, `IFA_F_TENTATIVE`.
    pub tentative: bool,
    /// No prefix route was created, `IFA_F_NOPREFIXROUTE`.
    pub noprefixroute: bool,
}

impl AddressFlags {
    fn from_bits(bits: u32, family: IpFamily) -> Self {
        let has = |bit: u32| bits & bit != 0;
        Self {
            permanent: has(IFA_F_PERMANENT),
            deprecated: has(IFA_F_DEPRECATED),
            temporary: family == IpFamily::V6 && has(IFA_F_SECONDARY),
            secondary: family == IpFamily::V4 && has(IFA_F_SECONDARY),
            dadfailed: has(IFA_F_DADFAILED),
            tentative: has(IFA_F_TENTATIVE),
            noprefixroute: has(IFA_F_NOPREFIXROUTE),
        }
    }
}

/// What an ensure helper changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressChanges {
    /// The wanted address, if it had to be added.
    pub added: Option<IpNet>,
    /// Addresses that were removed.
    pub removed: Vec<IpNet>,
}

pub(crate) fn address_from_message(message: &AddressMessage) -> Option<Address> {
    let family = match message.header.family {
        AddressFamily::Inet => IpFamily::V4,
        AddressFamily::Inet6 => IpFamily::V6,
        _ => return None,
    };
    let mut local = None;
    let mut address = None;
    let mut flags = u32::from(message.header.flags.bits());
    for attr in &message.attributes {
        match attr {
            AddressAttribute::Local(ip) => local = Some(*ip),
            AddressAttribute::Address(ip) => address = Some(*ip),
            AddressAttribute::Flags(f) => flags = f.bits(),
            _ => {}
        }
    }
    // IFA_LOCAL is the interface's own address; IFA_ADDRESS is the peer on point-to-point
    // links and equal to IFA_LOCAL otherwise (IPv6 usually sends only IFA_ADDRESS).
    let ip = local.or(address)?;
    Some(Address {
        ifindex: message.header.index,
        addr: IpNet::new(ip, message.header.prefix_len).ok()?,
        family,
        scope: AddressScope::from(u8::from(message.header.scope)),
        flags: AddressFlags::from_bits(flags, family),
    })
}

fn address_message(ifindex: u32, addr: IpNet, with_broadcast: bool) -> AddressMessage {
    let mut message = AddressMessage::default();
    message.header.family = IpFamily::of(&addr.addr()).af();
    message.header.prefix_len = addr.prefix_len();
    message.header.index = ifindex;
    message
        .attributes
        .push(AddressAttribute::Local(addr.addr()));
    message
        .attributes
        .push(AddressAttribute::Address(addr.addr()));
    if with_broadcast
        && let IpNet::V4(v4) = addr
        && v4.prefix_len() < 31
    {
        message
            .attributes
            .push(AddressAttribute::Broadcast(v4.broadcast()));
    }
    message
}

/// Upstream's v4 plan: remove every address inside `network` that is not exactly `want`
/// (address and prefix), keep the others, add `want` when missing.
fn plan_v4(existing: &[Address], want: Ipv4Net, network: Ipv4Net) -> (bool, Vec<IpNet>) {
    let want = IpNet::V4(want);
    let mut has = false;
    let mut remove = Vec::new();
    for a in existing {
        let IpNet::V4(v4) = a.addr else { continue };
        if a.addr == want {
            has = true;
        } else if network.contains(&v4.addr()) {
            remove.push(a.addr);
        }
    }
    (!has, remove)
}

/// The v6 plan: remove every non-link-local (outside fe80::/10) address that is not `want`.
fn plan_v6(existing: &[Address], want: Ipv6Net) -> (bool, Vec<IpNet>) {
    let want = IpNet::V6(want);
    let mut has = false;
    let mut remove = Vec::new();
    for a in existing {
        let IpNet::V6(v6) = a.addr else { continue };
        if a.addr == want {
            has = true;
        } else if !v6.addr().is_unicast_link_local() {
            remove.push(a.addr);
        }
    }
    (!has, remove)
}

pub(crate) fn add_address_request(ifindex: u32, addr: IpNet) -> Request {
    Request::new(
        RouteNetlinkMessage::NewAddress(address_message(ifindex, addr, true)),
        NLM_F_CREATE | NLM_F_EXCL,
        Ctx::new("add address", format!("{addr} to index {ifindex}")),
    )
}

pub(crate) fn delete_address_request(ifindex: u32, addr: IpNet) -> Request {
    Request::new(
        RouteNetlinkMessage::DelAddress(address_message(ifindex, addr, false)),
        0,
        Ctx::new("delete address", format!("{addr} from index {ifindex}")),
    )
}

impl Netlink {
    /// The addresses of link `ifindex`, of one family or both (`ip addr show dev DEV`).
    pub async fn list_addresses(
        &self,
        ifindex: u32,
        family: Option<IpFamily>,
    ) -> Result<Vec<Address>, NetlinkError> {
        let mut message = AddressMessage::default();
        message.header.index = ifindex;
        if let Some(f) = family {
            message.header.family = f.af();
        }
        let ctx = Ctx::new("list addresses", format!("of index {ifindex}"));
        let answers = self
            .dump(RouteNetlinkMessage::GetAddress(message), &ctx)
            .await?;
        Ok(answers
            .iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewAddress(a) => address_from_message(a),
                _ => None,
            })
            .filter(|a| a.ifindex == ifindex && family.is_none_or(|f| a.family == f))
            .collect())
    }

    /// Adds `addr` (e.g. `10.244.1.0/32`) to link `ifindex`; IPv4 prefixes shorter than /31
    /// get the usual broadcast address. Fails with [`NetlinkError::AlreadyExists`] when
    /// present.
    pub async fn add_address(&self, ifindex: u32, addr: IpNet) -> Result<(), NetlinkError> {
        self.send(add_address_request(ifindex, addr)).await
    }

    /// Deletes exactly `addr` (address and prefix length) from link `ifindex`.
    pub async fn delete_address(&self, ifindex: u32, addr: IpNet) -> Result<(), NetlinkError> {
        self.send(delete_address_request(ifindex, addr)).await
    }

    /// Upstream's `EnsureV4AddressOnLink`: on link `ifindex`, remove every IPv4 address inside
    /// `network` other than `want` (same address and prefix), keep addresses outside
    /// `network`, then add `want` if it is missing.
    pub async fn ensure_v4_address(
        &self,
        ifindex: u32,
        want: Ipv4Net,
        network: Ipv4Net,
    ) -> Result<AddressChanges, NetlinkError> {
        let existing = self.list_addresses(ifindex, Some(IpFamily::V4)).await?;
        let (add, remove) = plan_v4(&existing, want, network);
        self.apply_plan(ifindex, IpNet::V4(want), add, remove).await
    }

    /// The IPv6 variant: remove every IPv6 address of link `ifindex` that is neither
    /// link-local (fe80::/10) nor `want`, then add `want` if it is missing.
    pub async fn ensure_v6_address(
        &self,
        ifindex: u32,
        want: Ipv6Net,
    ) -> Result<AddressChanges, NetlinkError> {
        let existing = self.list_addresses(ifindex, Some(IpFamily::V6)).await?;
        let (add, remove) = plan_v6(&existing, want);
        self.apply_plan(ifindex, IpNet::V6(want), add, remove).await
    }

    async fn apply_plan(
        &self,
        ifindex: u32,
        want: IpNet,
        add: bool,
        remove: Vec<IpNet>,
    ) -> Result<AddressChanges, NetlinkError> {
        let mut changes = AddressChanges::default();
        for addr in remove {
            match self.delete_address(ifindex, addr).await {
                // Removing a primary address can take its secondaries along.
                Ok(()) => changes.removed.push(addr),
                Err(e) if e.is_not_found() => changes.removed.push(addr),
                Err(e) => return Err(e),
            }
        }
        if add {
            match self.add_address(ifindex, want).await {
                Ok(()) => changes.added = Some(want),
                Err(e) if e.is_already_exists() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(changes)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn addr(s: &str) -> Address {
        let net: IpNet = s.parse().unwrap_or_else(|_| IpNet::V4(Ipv4Net::default()));
        Address {
            ifindex: 1,
            addr: net,
            family: IpFamily::of(&net.addr()),
            scope: AddressScope::Universe,
            flags: AddressFlags::default(),
        }
    }

    fn v4(s: &str) -> Ipv4Net {
        s.parse().unwrap_or_default()
    }

    fn v6(s: &str) -> Ipv6Net {
        s.parse().unwrap_or_default()
    }

    #[test]
    fn v4_plan_matches_upstream_vectors() {
        // iface_test: 127.0.0.1/8 is inside 127.0.0.0/24 and goes, 127.0.0.2/24 is added.
        let (add, remove) = plan_v4(
            &[addr("127.0.0.1/8")],
            v4("127.0.0.2/24"),
            v4("127.0.0.0/24"),
        );
        assert!(add);
        assert_eq!(remove, vec![addr("127.0.0.1/8").addr]);
        // A foreign address outside the network survives a second call; nothing to do.
        let (add, remove) = plan_v4(
            &[addr("127.0.0.2/24"), addr("127.0.1.1/24")],
            v4("127.0.0.2/24"),
            v4("127.0.0.0/24"),
        );
        assert!(!add);
        assert!(remove.is_empty());
        // Same address, other prefix: not equal, inside the network, replaced.
        let (add, remove) = plan_v4(
            &[addr("10.244.1.0/24")],
            v4("10.244.1.0/32"),
            v4("10.244.0.0/16"),
        );
        assert!(add);
        assert_eq!(remove, vec![addr("10.244.1.0/24").addr]);
    }

    #[test]
    fn v6_plan_keeps_only_link_local_and_wanted() {
        let existing = [addr("fe80::1/64"), addr("::2/64"), addr("2001::4/64")];
        let (add, remove) = plan_v6(&existing, v6("::2/64"));
        assert!(!add);
        assert_eq!(remove, vec![addr("2001::4/64").addr]);
        let (add, remove) = plan_v6(&[addr("fe80::1/64")], v6("fd00::1/128"));
        assert!(add);
        assert!(remove.is_empty());
    }

    #[test]
    fn flags_depend_on_family() {
        let f = AddressFlags::from_bits(IFA_F_SECONDARY | IFA_F_PERMANENT, IpFamily::V4);
        assert!(f.secondary && f.permanent && !f.temporary);
        let f = AddressFlags::from_bits(IFA_F_SECONDARY | IFA_F_DADFAILED, IpFamily::V6);
        assert!(f.temporary && f.dadfailed && !f.secondary && !f.permanent);
    }

    #[test]
    fn messages_round_trip() {
        let m = address_message(3, "192.168.1.5/24".parse().unwrap_or_default(), true);
        assert!(
            m.attributes
                .contains(&AddressAttribute::Broadcast(Ipv4Addr::new(
                    192, 168, 1, 255
                )))
        );
        let a = address_from_message(&m);
        assert_eq!(
            a.map(|a| (a.ifindex, a.addr.to_string())),
            Some((3, "192.168.1.5/24".into()))
        );
        let m = address_message(3, "10.244.1.0/32".parse().unwrap_or_default(), true);
        assert!(
            !m.attributes
                .iter()
                .any(|a| matches!(a, AddressAttribute::Broadcast(_)))
        );
    }
}
