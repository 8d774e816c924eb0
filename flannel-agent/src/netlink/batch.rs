//! Many operations with several requests in flight.
//!
//! A reconciler computes a diff (routes, neighbours, FDB entries, addresses to replace or
//! delete) and hands it to [`Netlink::apply_all`]. That packs up to `in_flight` requests into
//! one datagram (one `sendmsg`), lets the kernel work through them in order, and matches the
//! acknowledgements back to the operations, so thousands of routes cost a few dozen system
//! calls instead of thousands of round trips. It returns one result per operation, in input
//! order; a failed operation does not stop the others.

use std::{fmt, net::IpAddr};

use ipnet::IpNet;

use super::{
    Netlink, NetlinkError, Request, Route,
    addresses::{add_address_request, delete_address_request},
    format_mac,
    neighbours::{
        add_fdb_request, delete_fdb_request, delete_neighbour_request, replace_neighbour_request,
    },
    routes::{delete_route_request, replace_route_request},
};

/// A good `in_flight` for [`Netlink::apply_all`]: the acknowledgements of this many requests
/// (about 1 KiB of receive buffer each) fit comfortably even in the default
/// `net.core.rmem_default` buffer of an unprivileged socket.
pub const DEFAULT_IN_FLIGHT: usize = 64;

/// One write operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// [`Netlink::replace_route`].
    ReplaceRoute(Route),
    /// [`Netlink::delete_route`].
    DeleteRoute(Route),
    /// [`Netlink::replace_neighbour`].
    ReplaceNeighbour {
        /// Interface index.
        ifindex: u32,
        /// Neighbour IP.
        ip: IpAddr,
        /// Its MAC.
        mac: [u8; 6],
    },
    /// [`Netlink::delete_neighbour`].
    DeleteNeighbour {
        /// Interface index.
        ifindex: u32,
        /// Neighbour IP.
        ip: IpAddr,
    },
    /// [`Netlink::replace_fdb`].
    ReplaceFdb {
        /// vxlan device index.
        ifindex: u32,
        /// MAC.
        mac: [u8; 6],
        /// Remote VTEP.
        dst: IpAddr,
    },
    /// [`Netlink::append_fdb`].
    AppendFdb {
        /// vxlan device index.
        ifindex: u32,
        /// MAC.
        mac: [u8; 6],
        /// Remote VTEP.
        dst: IpAddr,
    },
    /// [`Netlink::delete_fdb`].
    DeleteFdb {
        /// vxlan device index.
        ifindex: u32,
        /// MAC.
        mac: [u8; 6],
        /// Remote VTEP.
        dst: IpAddr,
    },
    /// [`Netlink::add_address`].
    AddAddress {
        /// Interface index.
        ifindex: u32,
        /// Address with prefix.
        addr: IpNet,
    },
    /// [`Netlink::delete_address`].
    DeleteAddress {
        /// Interface index.
        ifindex: u32,
        /// Address with prefix.
        addr: IpNet,
    },
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ReplaceRoute(r) => write!(f, "replace route {r}"),
            Self::DeleteRoute(r) => write!(f, "delete route {r}"),
            Self::ReplaceNeighbour { ifindex, ip, mac } => {
                write!(
                    f,
                    "replace neighbour {ip} lladdr {} dev #{ifindex}",
                    format_mac(mac)
                )
            }
            Self::DeleteNeighbour { ifindex, ip } => {
                write!(f, "delete neighbour {ip} dev #{ifindex}")
            }
            Self::ReplaceFdb { ifindex, mac, dst } => {
                write!(
                    f,
                    "replace fdb {} dst {dst} dev #{ifindex}",
                    format_mac(mac)
                )
            }
            Self::AppendFdb { ifindex, mac, dst } => {
                write!(f, "append fdb {} dst {dst} dev #{ifindex}", format_mac(mac))
            }
            Self::DeleteFdb { ifindex, mac, dst } => {
                write!(f, "delete fdb {} dst {dst} dev #{ifindex}", format_mac(mac))
            }
            Self::AddAddress { ifindex, addr } => write!(f, "add address {addr} dev #{ifindex}"),
            Self::DeleteAddress { ifindex, addr } => {
                write!(f, "delete address {addr} dev #{ifindex}")
            }
        }
    }
}

impl Op {
    /// The request for this operation, or why it cannot be sent.
    fn request(&self) -> Result<Request, NetlinkError> {
        Ok(match self {
            Self::ReplaceRoute(r) => replace_route_request(r)?,
            Self::DeleteRoute(r) => delete_route_request(r)?,
            Self::ReplaceNeighbour { ifindex, ip, mac } => {
                replace_neighbour_request(*ifindex, *ip, *mac)
            }
            Self::DeleteNeighbour { ifindex, ip } => delete_neighbour_request(*ifindex, *ip),
            Self::ReplaceFdb { ifindex, mac, dst } => add_fdb_request(*ifindex, *mac, *dst, false),
            Self::AppendFdb { ifindex, mac, dst } => add_fdb_request(*ifindex, *mac, *dst, true),
            Self::DeleteFdb { ifindex, mac, dst } => delete_fdb_request(*ifindex, *mac, *dst),
            Self::AddAddress { ifindex, addr } => add_address_request(*ifindex, *addr),
            Self::DeleteAddress { ifindex, addr } => delete_address_request(*ifindex, *addr),
        })
    }
}

impl Netlink {
    /// Runs one operation.
    pub async fn apply(&self, op: &Op) -> Result<(), NetlinkError> {
        self.send(op.request()?).await
    }

    /// Runs `ops` in order, sending up to `in_flight` of them (at least 1) per datagram and
    /// waiting for their acknowledgements before sending the next datagram. Returns one result
    /// per operation, in input order. Operations are independent: a failure (including an
    /// invalid operation, which is never sent) does not stop the others. The kernel applies
    /// them in the order given, so a delete followed by a replace of the same object works.
    pub async fn apply_all<I>(&self, ops: I, in_flight: usize) -> Vec<Result<(), NetlinkError>>
    where
        I: IntoIterator<Item = Op>,
    {
        let ops: Vec<Op> = ops.into_iter().collect();
        let mut results = Vec::with_capacity(ops.len());
        for chunk in ops.chunks(in_flight.max(1)) {
            let mut prepared = Vec::with_capacity(chunk.len());
            let mut slots: Vec<Option<Result<(), NetlinkError>>> = Vec::with_capacity(chunk.len());
            for op in chunk {
                match op.request() {
                    Ok(request) => {
                        prepared.push(request);
                        slots.push(None);
                    }
                    Err(e) => slots.push(Some(Err(e))),
                }
            }
            let mut sent = self.send_batch(prepared).await.into_iter();
            for slot in slots {
                results.push(match slot {
                    Some(invalid) => invalid,
                    // send_batch returns exactly one result per request.
                    None => sent.next().unwrap_or_else(|| {
                        Err(NetlinkError::socket(
                            "batch answered fewer requests than sent",
                            None,
                        ))
                    }),
                });
            }
        }
        results
    }
}
