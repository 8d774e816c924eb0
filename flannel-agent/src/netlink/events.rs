//! Link notifications (`RTNLGRP_LINK`): a [`Stream`] of [`LinkEvent`]s, so the agent notices
//! when `flannel.1` is deleted under it and recreates it (upstream 2.1, "Runtime watcher");
//! with the deletions of routes and neighbours for the reconciler, so that one of its routes,
//! neighbours or FDB entries deleted by hand (or flushed with an interface set down) comes back
//! at once rather than at the next resync.
//! Bridge FDB notifications (`RTNLGRP_NEIGH`): [`FdbEvent`]s, so the fast path learns which
//! bridge port each local pod sits behind.

use std::{
    net::IpAddr,
    pin::Pin,
    task::{Context, Poll},
};

use futures::{Stream, StreamExt};
use rtnetlink::{
    packet_core::{NetlinkMessage, NetlinkPayload},
    packet_route::{
        AddressFamily, RouteNetlinkMessage,
        link::LinkMessage,
        neighbour::{NeighbourAttribute, NeighbourMessage},
        route::RouteMessage,
    },
    proto::sys::SocketAddr,
    sys::AsyncSocket as _,
};

use ipnet::IpNet;

use super::{
    NeighbourState, NetlinkError, Unsolicited,
    addresses::address_from_message,
    links::link_from_message,
    neighbours::{fdb_from_message, neighbour_from_message},
    open_socket,
    routes::route_from_message,
};

/// `RTNLGRP_LINK`.
const RTNLGRP_LINK: u32 = 1;
/// `RTNLGRP_NEIGH`: ARP/NDP neighbours and bridge FDB entries.
const RTNLGRP_NEIGH: u32 = 3;
/// `RTNLGRP_IPV4_IFADDR`.
const RTNLGRP_IPV4_IFADDR: u32 = 5;
/// `RTNLGRP_IPV6_IFADDR`.
const RTNLGRP_IPV6_IFADDR: u32 = 9;
/// `RTNLGRP_IPV4_ROUTE`.
const RTNLGRP_IPV4_ROUTE: u32 = 7;
/// `RTNLGRP_IPV6_ROUTE`.
const RTNLGRP_IPV6_ROUTE: u32 = 11;

/// Opens a listening socket in the calling thread's network namespace joined to the multicast
/// `groups`, its connection running on the current tokio runtime.
fn join_groups(
    groups: &[u32],
    what: &'static str,
) -> Result<(Unsolicited, tokio::task::JoinHandle<()>), NetlinkError> {
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| NetlinkError::socket("netlink events need a tokio runtime", None))?;
    let mut opened = open_socket(false)?;
    opened
        .conn
        .socket_mut()
        .socket_mut()
        .bind(&SocketAddr::new(
            0,
            groups.iter().fold(0, |mask, group| mask | 1 << (group - 1)),
        ))
        .map_err(|e| NetlinkError::socket(what, Some(e)))?;
    // The request handle is dropped: this socket only listens. The connection keeps running
    // as long as the unsolicited messages' receiver is alive.
    let task = runtime.spawn(opened.conn);
    Ok((opened.unsolicited, task))
}

/// A change to the set of links; from
/// [`Netlink::dataplane_events`](super::Netlink::dataplane_events) also to addresses, and
/// removed routes and neighbours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkEvent {
    /// `RTM_NEWLINK`: a link was added or changed (up/down, MTU, MAC, ...).
    New {
        /// Interface index.
        index: u32,
        /// Interface name.
        name: String,
    },
    /// `RTM_DELLINK`: a link was removed.
    Removed {
        /// Interface index.
        index: u32,
        /// Interface name.
        name: String,
    },
    /// `RTM_DELROUTE` (only from [`Netlink::dataplane_events`](super::Netlink::dataplane_events)):
    /// a route with routing protocol `protocol` was removed, by hand or flushed with its
    /// interface.
    RouteRemoved {
        /// `rtm_protocol`.
        protocol: u8,
        /// Which route (`None` when the message names none the agent can read).
        entry: Option<Entry>,
    },
    /// `RTM_NEWROUTE` (only from [`Netlink::dataplane_events`](super::Netlink::dataplane_events)):
    /// a route with routing protocol `protocol` was added or replaced.
    RouteAdded {
        /// `rtm_protocol`.
        protocol: u8,
        /// Which route (`None` when the message names none the agent can read).
        entry: Option<Entry>,
    },
    /// `RTM_NEWADDR` or `RTM_DELADDR` (only from
    /// [`Netlink::dataplane_events`](super::Netlink::dataplane_events)): an address of
    /// interface `index` was added or removed.
    AddressChanged {
        /// Its interface.
        index: u32,
        /// The address (`None` when the message carries none the agent can read).
        address: Option<IpAddr>,
    },
    /// `RTM_DELNEIGH` (only from
    /// [`Netlink::dataplane_events`](super::Netlink::dataplane_events)): a neighbour or FDB
    /// entry on interface `index` was removed.
    NeighbourRemoved {
        /// Its interface.
        index: u32,
        /// Which entry (`None` when the message names none the agent can read).
        entry: Option<Entry>,
    },
    /// `RTM_NEWNEIGH` (only from
    /// [`Netlink::dataplane_events`](super::Netlink::dataplane_events)): a static neighbour or
    /// FDB entry on interface `index` was added or replaced. Entries the kernel resolves and
    /// ages itself (ARP and NDP, learnt FDB entries) are not reported: they come and go with
    /// traffic, and the dataplane writes none.
    NeighbourAdded {
        /// Its interface.
        index: u32,
        /// Which entry (`None` when the message names none the agent can read).
        entry: Option<Entry>,
    },
    /// Notifications were lost (the socket's buffer overflowed): re-list the links.
    Overrun,
}

/// What happened to a route, neighbour or FDB entry ([`LinkEvent::entry_change`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryChange {
    /// Added or replaced.
    Written,
    /// Removed.
    Removed,
}

impl LinkEvent {
    /// For the events that tell of a route, neighbour or FDB entry: whether it was written or
    /// removed, and which entry (`None` when the message names none the agent can read).
    pub fn entry_change(&self) -> Option<(EntryChange, Option<Entry>)> {
        match self {
            LinkEvent::RouteAdded { entry, .. } | LinkEvent::NeighbourAdded { entry, .. } => {
                Some((EntryChange::Written, *entry))
            }
            LinkEvent::RouteRemoved { entry, .. } | LinkEvent::NeighbourRemoved { entry, .. } => {
                Some((EntryChange::Removed, *entry))
            }
            _ => None,
        }
    }
}

/// Which route, neighbour or FDB entry was added, replaced or removed, as a notification names
/// it and as the agent names an entry it writes or deletes itself, so that the two can be
/// matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Entry {
    /// A route: its table and destination.
    Route {
        /// Routing table.
        table: u32,
        /// Destination.
        dst: IpNet,
    },
    /// A neighbour (ARP/NDP) entry.
    Neighbour {
        /// Its interface.
        index: u32,
        /// Its IP address.
        ip: IpAddr,
    },
    /// A bridge or vxlan FDB entry.
    Fdb {
        /// Its device.
        index: u32,
        /// Its MAC address.
        mac: [u8; 6],
    },
}

/// A stream of decoded notifications of one multicast group ([`LinkEvents`], [`FdbEvents`]).
/// It owns its own socket, opened in the calling thread's network namespace; dropping it
/// closes the socket.
pub struct Events<E> {
    messages: Unsolicited,
    task: tokio::task::JoinHandle<()>,
    decode: fn(NetlinkMessage<RouteNetlinkMessage>) -> Option<E>,
}

/// Link notifications ([`Netlink::link_events`](super::Netlink::link_events)).
pub type LinkEvents = Events<LinkEvent>;
/// Bridge FDB notifications ([`Netlink::fdb_events`](super::Netlink::fdb_events)).
pub type FdbEvents = Events<FdbEvent>;

impl<E> std::fmt::Debug for Events<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").finish_non_exhaustive()
    }
}

impl<E> Drop for Events<E> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl<E> Events<E> {
    /// Joins `groups` (`what` names them in errors); must run inside a tokio runtime.
    fn subscribe(
        groups: &[u32],
        what: &'static str,
        decode: fn(NetlinkMessage<RouteNetlinkMessage>) -> Option<E>,
    ) -> Result<Self, NetlinkError> {
        let (messages, task) = join_groups(groups, what)?;
        Ok(Self {
            messages,
            task,
            decode,
        })
    }

    /// The next event; `None` when the socket is gone.
    pub async fn next(&mut self) -> Option<E> {
        StreamExt::next(self).await
    }
}

impl<E> Stream for Events<E> {
    type Item = E;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<E>> {
        loop {
            match Pin::new(&mut self.messages).poll_next(cx) {
                Poll::Ready(Some((message, _))) => {
                    if let Some(e) = (self.decode)(message) {
                        return Poll::Ready(Some(e));
                    }
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

fn event(message: NetlinkMessage<RouteNetlinkMessage>) -> Option<LinkEvent> {
    let named = |m: &LinkMessage| {
        // AF_BRIDGE link messages describe bridge-port state, not links coming and going.
        if m.header.interface_family == AddressFamily::Bridge {
            return None;
        }
        link_from_message(m).map(|l| (l.index, l.name))
    };
    match message.payload {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(m)) => {
            named(&m).map(|(index, name)| LinkEvent::New { index, name })
        }
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(m)) => {
            named(&m).map(|(index, name)| LinkEvent::Removed { index, name })
        }
        NetlinkPayload::Overrun(_) => Some(LinkEvent::Overrun),
        _ => None,
    }
}

/// Which route a route message names.
fn route_entry(m: &RouteMessage) -> Option<Entry> {
    route_from_message(m).map(|r| Entry::Route {
        table: r.table,
        dst: r.dst,
    })
}

/// Which neighbour or FDB entry a neighbour message names.
fn neighbour_entry(m: &NeighbourMessage) -> Option<Entry> {
    let index = m.header.ifindex;
    neighbour_from_message(m)
        .map(|n| Entry::Neighbour { index, ip: n.ip })
        .or_else(|| fdb_from_message(m).map(|f| Entry::Fdb { index, mac: f.mac }))
}

/// Whether a neighbour message tells of a static entry: a permanent neighbour, or an FDB
/// entry that is permanent or static (`NUD_NOARP`), as written by the agent or by hand.
fn is_static(m: &NeighbourMessage) -> bool {
    let state = NeighbourState::from_u16(u16::from(m.header.state));
    state == NeighbourState::Permanent
        || (m.header.family == AddressFamily::Bridge && state == NeighbourState::Noarp)
}

/// [`event`], routes added, replaced and removed, and static neighbours added, replaced and
/// removed.
fn dataplane_event(message: NetlinkMessage<RouteNetlinkMessage>) -> Option<LinkEvent> {
    match &message.payload {
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelRoute(m)) => {
            Some(LinkEvent::RouteRemoved {
                protocol: u8::from(m.header.protocol),
                entry: route_entry(m),
            })
        }
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(m)) => {
            Some(LinkEvent::RouteAdded {
                protocol: u8::from(m.header.protocol),
                entry: route_entry(m),
            })
        }
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelNeighbour(m)) => {
            Some(LinkEvent::NeighbourRemoved {
                index: m.header.ifindex,
                entry: neighbour_entry(m),
            })
        }
        NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNeighbour(m)) => {
            is_static(m).then(|| LinkEvent::NeighbourAdded {
                index: m.header.ifindex,
                entry: neighbour_entry(m),
            })
        }
        NetlinkPayload::InnerMessage(
            RouteNetlinkMessage::NewAddress(m) | RouteNetlinkMessage::DelAddress(m),
        ) => Some(LinkEvent::AddressChanged {
            index: m.header.index,
            address: address_from_message(m).map(|a| a.ip()),
        }),
        _ => event(message),
    }
}

/// A change to a bridge's forwarding database (`RTNLGRP_NEIGH`, bridge family).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdbEvent {
    /// An entry was added, changed or removed on port `port` of bridge `master` (`None` for
    /// entries of a device itself, like a vxlan device's).
    Changed {
        /// The port (or device) the entry points to.
        port: u32,
        /// The bridge holding the entry.
        master: Option<u32>,
    },
    /// Notifications were lost: re-list the entries.
    Overrun,
}

fn fdb_event(message: NetlinkMessage<RouteNetlinkMessage>) -> Option<FdbEvent> {
    let changed = |m: &NeighbourMessage| {
        if m.header.family != AddressFamily::Bridge {
            return None;
        }
        let master = m.attributes.iter().find_map(|a| match a {
            NeighbourAttribute::Controller(master) => Some(*master),
            _ => None,
        });
        Some(FdbEvent::Changed {
            port: m.header.ifindex,
            master,
        })
    };
    match message.payload {
        NetlinkPayload::InnerMessage(
            RouteNetlinkMessage::NewNeighbour(m) | RouteNetlinkMessage::DelNeighbour(m),
        ) => changed(&m),
        NetlinkPayload::Overrun(_) => Some(FdbEvent::Overrun),
        _ => None,
    }
}

impl super::Netlink {
    /// Subscribes to link added/removed notifications.
    pub fn link_events(&self) -> Result<LinkEvents, NetlinkError> {
        Events::subscribe(&[RTNLGRP_LINK], "join RTNLGRP_LINK", event)
    }

    /// Subscribes to what the dataplane reconciler watches: links and addresses added and
    /// removed, routes added, replaced and removed, and static neighbours (FDB entries
    /// included) added, replaced and removed.
    pub fn dataplane_events(&self) -> Result<LinkEvents, NetlinkError> {
        Events::subscribe(
            &[
                RTNLGRP_LINK,
                RTNLGRP_NEIGH,
                RTNLGRP_IPV4_IFADDR,
                RTNLGRP_IPV6_IFADDR,
                RTNLGRP_IPV4_ROUTE,
                RTNLGRP_IPV6_ROUTE,
            ],
            "join the link, address, neighbour and route groups",
            dataplane_event,
        )
    }

    /// Subscribes to bridge FDB notifications (neighbour notifications of the bridge
    /// family).
    pub fn fdb_events(&self) -> Result<FdbEvents, NetlinkError> {
        Events::subscribe(&[RTNLGRP_NEIGH], "join RTNLGRP_NEIGH", fdb_event)
    }
}

#[cfg(test)]
mod tests {
    use rtnetlink::packet_route::{
        address::{AddressAttribute, AddressMessage},
        link::LinkAttribute,
        neighbour::NeighbourState as PacketState,
        route::RouteProtocol,
    };

    use super::*;

    fn link_message(family: AddressFamily) -> LinkMessage {
        let mut m = LinkMessage::default();
        m.header.index = 9;
        m.header.interface_family = family;
        m.attributes.push(LinkAttribute::IfName("flannel.1".into()));
        m
    }

    #[test]
    fn deletions_and_additions_are_reported() {
        let del = NetlinkMessage::from(RouteNetlinkMessage::DelLink(link_message(
            AddressFamily::Unspec,
        )));
        assert_eq!(
            event(del),
            Some(LinkEvent::Removed {
                index: 9,
                name: "flannel.1".into()
            })
        );
        let new = NetlinkMessage::from(RouteNetlinkMessage::NewLink(link_message(
            AddressFamily::Unspec,
        )));
        assert_eq!(
            event(new),
            Some(LinkEvent::New {
                index: 9,
                name: "flannel.1".into()
            })
        );
    }

    #[test]
    fn bridge_fdb_changes_are_reported_with_their_bridge() {
        let mut m = NeighbourMessage::default();
        m.header.family = AddressFamily::Bridge;
        m.header.ifindex = 12;
        m.attributes.push(NeighbourAttribute::Controller(7));
        let new = NetlinkMessage::from(RouteNetlinkMessage::NewNeighbour(m.clone()));
        assert_eq!(
            fdb_event(new),
            Some(FdbEvent::Changed {
                port: 12,
                master: Some(7)
            })
        );
        let del = NetlinkMessage::from(RouteNetlinkMessage::DelNeighbour(m.clone()));
        assert!(matches!(
            fdb_event(del),
            Some(FdbEvent::Changed { port: 12, .. })
        ));
        m.header.family = AddressFamily::Inet;
        let arp = NetlinkMessage::from(RouteNetlinkMessage::NewNeighbour(m));
        assert_eq!(fdb_event(arp), None, "ARP entries are not FDB changes");
    }

    #[test]
    fn the_reconcilers_stream_reports_route_and_static_neighbour_changes() {
        // A message naming no entry the agent can read.
        let mut route = RouteMessage::default();
        route.header.protocol = RouteProtocol::from(165);
        let del = NetlinkMessage::from(RouteNetlinkMessage::DelRoute(route.clone()));
        assert_eq!(
            dataplane_event(del),
            Some(LinkEvent::RouteRemoved {
                protocol: 165,
                entry: None
            })
        );
        let new = NetlinkMessage::from(RouteNetlinkMessage::NewRoute(route));
        assert_eq!(
            dataplane_event(new),
            Some(LinkEvent::RouteAdded {
                protocol: 165,
                entry: None
            })
        );
        // A route as the kernel tells of its removal: its table and destination.
        let dst: IpNet = "10.244.2.0/24".parse().unwrap_or_default();
        let ours = super::super::Route::new(dst)
            .via(IpAddr::from([10, 244, 2, 0]))
            .dev(3)
            .onlink()
            .protocol(165);
        let del = NetlinkMessage::from(RouteNetlinkMessage::DelRoute(ours.message()));
        assert_eq!(
            dataplane_event(del),
            Some(LinkEvent::RouteRemoved {
                protocol: 165,
                entry: Some(Entry::Route { table: 254, dst })
            })
        );
        let new = NetlinkMessage::from(RouteNetlinkMessage::NewRoute(ours.message()));
        assert_eq!(
            dataplane_event(new),
            Some(LinkEvent::RouteAdded {
                protocol: 165,
                entry: Some(Entry::Route { table: 254, dst })
            })
        );
        let mut neighbour = NeighbourMessage::default();
        neighbour.header.ifindex = 4;
        let del = NetlinkMessage::from(RouteNetlinkMessage::DelNeighbour(neighbour.clone()));
        assert_eq!(
            dataplane_event(del),
            Some(LinkEvent::NeighbourRemoved {
                index: 4,
                entry: None
            })
        );
        let new = NetlinkMessage::from(RouteNetlinkMessage::NewNeighbour(neighbour));
        assert_eq!(
            dataplane_event(new),
            None,
            "neighbours the kernel resolves are not watched"
        );
        // A neighbour and an FDB entry: the IP of the one, the MAC of the other.
        let ip = IpAddr::from([10, 244, 2, 0]);
        let mac = [0x0e, 0, 0, 0, 0, 2];
        let arp = super::super::neighbours::neighbour_message(3, ip, Some(mac));
        assert_eq!(
            dataplane_event(NetlinkMessage::from(RouteNetlinkMessage::DelNeighbour(
                arp.clone()
            ))),
            Some(LinkEvent::NeighbourRemoved {
                index: 3,
                entry: Some(Entry::Neighbour { index: 3, ip })
            })
        );
        assert_eq!(
            dataplane_event(NetlinkMessage::from(RouteNetlinkMessage::NewNeighbour(
                arp.clone()
            ))),
            Some(LinkEvent::NeighbourAdded {
                index: 3,
                entry: Some(Entry::Neighbour { index: 3, ip })
            })
        );
        // Resolved by the kernel (reachable), or without ARP (multicast): not static.
        for state in [PacketState::Reachable, PacketState::Noarp] {
            let mut resolved = arp.clone();
            resolved.header.state = state;
            assert_eq!(
                dataplane_event(NetlinkMessage::from(RouteNetlinkMessage::NewNeighbour(
                    resolved
                ))),
                None,
                "{state:?}"
            );
        }
        let fdb =
            super::super::neighbours::fdb_message(3, mac, IpAddr::from([192, 168, 1, 12]), false);
        assert_eq!(
            dataplane_event(NetlinkMessage::from(RouteNetlinkMessage::DelNeighbour(
                fdb.clone()
            ))),
            Some(LinkEvent::NeighbourRemoved {
                index: 3,
                entry: Some(Entry::Fdb { index: 3, mac })
            })
        );
        // An FDB entry written permanent or static (`bridge fdb replace ... static`); not
        // one the device learnt.
        for (state, reported) in [
            (PacketState::Permanent, true),
            (PacketState::Noarp, true),
            (PacketState::Reachable, false),
        ] {
            let mut written = fdb.clone();
            written.header.state = state;
            assert_eq!(
                dataplane_event(NetlinkMessage::from(RouteNetlinkMessage::NewNeighbour(
                    written
                ))),
                reported.then_some(LinkEvent::NeighbourAdded {
                    index: 3,
                    entry: Some(Entry::Fdb { index: 3, mac })
                }),
                "{state:?}"
            );
        }
        let mut address = AddressMessage::default();
        address.header.index = 2;
        address.header.family = AddressFamily::Inet;
        address.header.prefix_len = 24;
        let ip = IpAddr::from([192, 168, 1, 11]);
        address.attributes.push(AddressAttribute::Local(ip));
        for message in [
            RouteNetlinkMessage::NewAddress(address.clone()),
            RouteNetlinkMessage::DelAddress(address),
        ] {
            assert_eq!(
                dataplane_event(NetlinkMessage::from(message)),
                Some(LinkEvent::AddressChanged {
                    index: 2,
                    address: Some(ip)
                })
            );
        }
        let link = NetlinkMessage::from(RouteNetlinkMessage::DelLink(link_message(
            AddressFamily::Unspec,
        )));
        assert_eq!(
            dataplane_event(link),
            Some(LinkEvent::Removed {
                index: 9,
                name: "flannel.1".into()
            })
        );
    }

    #[test]
    fn bridge_port_messages_are_not_link_deletions() {
        let del = NetlinkMessage::from(RouteNetlinkMessage::DelLink(link_message(
            AddressFamily::Bridge,
        )));
        assert_eq!(event(del), None);
    }
}
