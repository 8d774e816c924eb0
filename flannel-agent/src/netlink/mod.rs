//! The agent's only access to rtnetlink: links, addresses, routes, neighbours, FDB entries and
//! link events, as plain types (`std::net` addresses, [`ipnet::IpNet`] prefixes, `[u8; 6]`
//! MACs, `u32` interface indexes).
//!
//! rtnetlink and netlink-packet-route change their APIs with most releases; all use of them
//! stays inside this module (the transport is `rtnetlink::proto`, the messages
//! `rtnetlink::packet_route`), so a crate upgrade touches nothing else.
//!
//! | file | job |
//! |---|---|
//! | `mod.rs` | [`Netlink`] handle, the socket, request/dump plumbing, shared small types |
//! | [`links`] | list/get/create/delete links, vxlan/ipip/wireguard creation, up/MTU/MAC |
//! | [`addresses`] | list/add/delete addresses, upstream's "ensure address" helpers |
//! | [`routes`] | list/replace/delete routes, `route get`, [`RTPROT_FLANNEL`] |
//! | [`neighbours`] | ARP/NDP neighbours and vxlan FDB entries |
//! | [`batch`] | many operations per datagram, results matched back per operation |
//! | [`events`] | a stream of link added/removed notifications |
//! | [`raw`] | hand-built messages for generic netlink (WireGuard) and XFRM |
//! | [`conntrack`] | a dump of the connection tracking table (ctnetlink), built on [`raw`] |
//! | [`errors`] | [`NetlinkError`] |
//!
//! The socket is opened in the network namespace of the calling thread when [`Netlink::new`]
//! runs (tests create it on a thread that entered a namespace), with strict dump checking so
//! the kernel filters dumps (by link, table, protocol), a large receive buffer and extended
//! acknowledgements (kernel error messages such as `Unknown device type` end up in errors).
//!
//! All requests wait at most [`REQUEST_TIMEOUT`] for the kernel's answer.

pub mod addresses;
pub mod batch;
pub mod conntrack;
pub mod errors;
pub mod events;
pub mod links;
pub mod neighbours;
pub mod raw;
pub mod routes;

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsRawFd,
    time::Duration,
};

use futures::StreamExt as _;
use rtnetlink::{
    packet_core::{
        NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
    },
    packet_route::{AddressFamily, RouteNetlinkMessage},
    proto::{Connection, ConnectionHandle, sys::SocketAddr},
    sys::{AsyncSocket as _, protocols::NETLINK_ROUTE},
};

pub use addresses::{Address, AddressChanges, AddressFlags, AddressScope};
pub use batch::{DEFAULT_IN_FLIGHT, Op};
pub use errors::NetlinkError;
pub use events::{Entry, EntryChange, Events, FdbEvent, FdbEvents, LinkEvent, LinkEvents};
pub use links::{
    Incompatibility, IpTunnelInfo, Link, OperState, VXLAN_DEFAULT_PORT, VxlanEnsure, VxlanInfo,
    VxlanSpec,
};
pub use neighbours::{FdbEntry, Neighbour, NeighbourFlags, NeighbourState};
pub use routes::{
    RT_TABLE_MAIN, RTPROT_FLANNEL, Route, RouteFilter, RouteKind, RouteLookup, RouteScope,
};

use errors::{Ctx, extack_from_error, extack_from_tlvs};

/// Receive buffer asked for on every netlink socket (8 MiB). Upstream flannel lost routes when
/// many nodes joined at once because its socket overflowed (`ENOBUFS`, flannel#958); with
/// CAP_NET_ADMIN the size is forced past `net.core.rmem_max` (`SO_RCVBUFFORCE`).
pub const RECEIVE_BUFFER_BYTES: usize = 8 << 20;

/// How long one request waits for the kernel's answer before failing with
/// [`NetlinkError::Timeout`].
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// How often a dump is repeated when the kernel reports it was interrupted by a concurrent
/// change (`NLM_F_DUMP_INTR`).
const DUMP_ATTEMPTS: usize = 5;

/// How often a dump is asked for again when the socket is still busy with another one
/// (EBUSY), 5 ms more apart each time (about a second in all).
const DUMP_BUSY_RETRIES: u32 = 20;

/// An IP address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpFamily {
    /// IPv4 (`AF_INET`).
    V4,
    /// IPv6 (`AF_INET6`).
    V6,
}

impl IpFamily {
    /// The family of an address.
    pub fn of(ip: &IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }

    pub(crate) fn af(self) -> AddressFamily {
        match self {
            Self::V4 => AddressFamily::Inet,
            Self::V6 => AddressFamily::Inet6,
        }
    }

    pub(crate) fn full_prefix(self) -> u8 {
        match self {
            Self::V4 => 32,
            Self::V6 => 128,
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        })
    }
}

/// Formats a MAC the way flannel's `VtepMAC` is written: lower case, colon separated.
pub fn format_mac(mac: &[u8; 6]) -> String {
    let [a, b, c, d, e, f] = mac;
    format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{f:02x}")
}

pub(crate) fn mac_from_bytes(bytes: &[u8]) -> Option<[u8; 6]> {
    bytes.try_into().ok()
}

/// An IP address from raw bytes (4 or 16 of them), as found in bridge-family attributes.
pub(crate) fn ip_from_bytes(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => <[u8; 4]>::try_from(bytes)
            .ok()
            .map(|b| Ipv4Addr::from(b).into()),
        16 => <[u8; 16]>::try_from(bytes)
            .ok()
            .map(|b| Ipv6Addr::from(b).into()),
        _ => None,
    }
}

/// A handle on one rtnetlink socket in one network namespace. Cheap to clone; clones share the
/// socket, whose background task ends when the last clone is dropped.
#[derive(Clone)]
pub struct Netlink {
    handle: ConnectionHandle<RouteNetlinkMessage>,
    receive_buffer: usize,
}

impl fmt::Debug for Netlink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Netlink")
            .field("receive_buffer", &self.receive_buffer)
            .finish_non_exhaustive()
    }
}

/// Messages the kernel sent without being asked (multicast notifications, overruns).
pub(crate) type Unsolicited =
    futures::channel::mpsc::UnboundedReceiver<(NetlinkMessage<RouteNetlinkMessage>, SocketAddr)>;

/// A freshly opened socket: its connection (to be spawned), a handle for requests, the
/// unsolicited messages and the receive buffer size the kernel reports.
pub(crate) struct Opened {
    pub conn: Connection<RouteNetlinkMessage>,
    pub handle: ConnectionHandle<RouteNetlinkMessage>,
    pub unsolicited: Unsolicited,
    pub receive_buffer: usize,
}

/// Opens a NETLINK_ROUTE socket (tokio) in the calling thread's network namespace, with a large
/// receive buffer and extended acks; `strict` turns on kernel-side dump filtering.
pub(crate) fn open_socket(strict: bool) -> Result<Opened, NetlinkError> {
    let (mut conn, handle, messages) =
        rtnetlink::proto::new_connection::<RouteNetlinkMessage>(NETLINK_ROUTE)
            .map_err(|e| NetlinkError::socket("open NETLINK_ROUTE socket", Some(e)))?;
    // Dumps that fail report their errno in NLMSG_DONE; we need to see it. Acks are needed
    // to match the answers of a batch to its requests.
    conn.set_forward_done(true);
    conn.set_forward_ack(true);
    let socket = conn.socket_mut().socket_mut();
    set_receive_buffer(socket.as_raw_fd(), RECEIVE_BUFFER_BYTES);
    let receive_buffer = socket.get_rx_buf_sz().unwrap_or(0);
    // Best effort: extended acks carry the kernel's error text, capped acks echo only the
    // request header instead of the whole request.
    let _ = socket.set_ext_ack(true);
    let _ = socket.set_cap_ack(true);
    if strict {
        socket
            .set_netlink_get_strict_chk(true)
            .map_err(|e| NetlinkError::socket("enable NETLINK_GET_STRICT_CHK", Some(e)))?;
    }
    Ok(Opened {
        conn,
        handle,
        unsolicited: messages,
        receive_buffer,
    })
}

/// `SO_RCVBUFFORCE` (allowed with CAP_NET_ADMIN, ignores `rmem_max`), else `SO_RCVBUF`.
fn set_receive_buffer(fd: std::os::fd::RawFd, bytes: usize) {
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    for option in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
        // SAFETY: setsockopt reads `len` bytes from a valid c_int; fd is an open socket owned
        // by the connection we hold.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                option,
                (&value as *const libc::c_int).cast(),
                len,
            )
        };
        if rc == 0 {
            return;
        }
    }
}

/// A write request, built (and validated) but not sent: [`Netlink::send`] sends one,
/// [`Netlink::send_batch`] many in one datagram.
pub(crate) struct Request {
    message: RouteNetlinkMessage,
    flags: u16,
    ctx: Ctx,
}

impl Request {
    /// `flags` are added to `NLM_F_REQUEST | NLM_F_ACK`.
    pub(crate) fn new(message: RouteNetlinkMessage, flags: u16, ctx: Ctx) -> Self {
        Self {
            message,
            flags,
            ctx,
        }
    }
}

/// What a request expects back.
enum Expect {
    /// An acknowledgement only.
    Ack,
    /// One answer message (a `get` of one object).
    One,
    /// A multipart dump.
    Dump,
}

impl Netlink {
    /// Opens a rtnetlink socket in the current thread's network namespace and spawns its
    /// background task on the current tokio runtime (so this must run inside one).
    pub fn new() -> Result<Self, NetlinkError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            NetlinkError::socket("Netlink::new must be called inside a tokio runtime", None)
        })?;
        let opened = open_socket(true)?;
        // No multicast groups are joined, so there are no unsolicited messages to read.
        drop(opened.unsolicited);
        runtime.spawn(opened.conn);
        Ok(Self {
            handle: opened.handle,
            receive_buffer: opened.receive_buffer,
        })
    }

    /// The socket's receive buffer in bytes as the kernel reports it (twice what was set, see
    /// socket(7)); at least [`RECEIVE_BUFFER_BYTES`] when CAP_NET_ADMIN allowed forcing it.
    pub fn receive_buffer_size(&self) -> usize {
        self.receive_buffer
    }

    /// Sends one write request and waits for its acknowledgement.
    pub(crate) async fn send(&self, request: Request) -> Result<(), NetlinkError> {
        self.ack(request.message, request.flags, &request.ctx).await
    }

    /// Sends `requests` as one datagram (one `sendmsg`). The kernel handles the messages in
    /// order and acknowledges each one (we ask for `NLM_F_ACK` and the connection forwards
    /// acks), so the n-th acknowledgement answers the n-th request. Requests without an
    /// answer in time fail with [`NetlinkError::Timeout`].
    pub(crate) async fn send_batch(&self, requests: Vec<Request>) -> Vec<Result<(), NetlinkError>> {
        let mut ctxs = Vec::with_capacity(requests.len());
        let mut messages = Vec::with_capacity(requests.len());
        for r in requests {
            let mut m = NetlinkMessage::from(r.message);
            m.header.flags = NLM_F_REQUEST | NLM_F_ACK | r.flags;
            messages.push(m);
            ctxs.push(r.ctx);
        }
        let mut results: Vec<Option<Result<(), NetlinkError>>> =
            ctxs.iter().map(|_| None).collect();
        match self.handle.request_batch(messages, SocketAddr::new(0, 0)) {
            Err(e) => {
                return ctxs
                    .iter()
                    .map(|c| {
                        Err(NetlinkError::socket(
                            format!("{} {}: netlink task is gone: {e}", c.op, c.object),
                            None,
                        ))
                    })
                    .collect();
            }
            Ok(mut answers) => {
                let mut next = 0;
                let collect = async {
                    while let Some(answer) = answers.next().await {
                        let flags = answer.header.flags;
                        let NetlinkPayload::Error(err) = answer.payload else {
                            continue;
                        };
                        let (Some(slot), Some(ctx)) = (results.get_mut(next), ctxs.get(next))
                        else {
                            break;
                        };
                        *slot = Some(match err.code {
                            None => Ok(()),
                            Some(code) => {
                                Err(ctx.errno(-code.get(), extack_from_error(&err.header, flags)))
                            }
                        });
                        next += 1;
                    }
                };
                // Whatever is still unanswered after the timeout is reported below.
                let _ = tokio::time::timeout(REQUEST_TIMEOUT, collect).await;
            }
        }
        results
            .into_iter()
            .zip(&ctxs)
            .map(|(result, ctx)| {
                result.unwrap_or_else(|| {
                    Err(NetlinkError::Timeout {
                        op: ctx.op,
                        object: ctx.object.clone(),
                        seconds: REQUEST_TIMEOUT.as_secs(),
                    })
                })
            })
            .collect()
    }

    /// Sends a request that is answered by an acknowledgement.
    pub(crate) async fn ack(
        &self,
        message: RouteNetlinkMessage,
        flags: u16,
        ctx: &Ctx,
    ) -> Result<(), NetlinkError> {
        self.exchange(message, NLM_F_REQUEST | NLM_F_ACK | flags, Expect::Ack, ctx)
            .await
            .map(|_| ())
    }

    /// Sends a `get` for one object and returns the kernel's answer.
    pub(crate) async fn get_one(
        &self,
        message: RouteNetlinkMessage,
        ctx: &Ctx,
    ) -> Result<RouteNetlinkMessage, NetlinkError> {
        let (mut answers, _) = self
            .exchange(message, NLM_F_REQUEST, Expect::One, ctx)
            .await?;
        answers
            .pop()
            .ok_or_else(|| ctx.other("the kernel sent no answer"))
    }

    /// Dumps a table, repeating the dump when the kernel says it was interrupted by a
    /// concurrent change (`NLM_F_DUMP_INTR`).
    pub(crate) async fn dump(
        &self,
        message: RouteNetlinkMessage,
        ctx: &Ctx,
    ) -> Result<Vec<RouteNetlinkMessage>, NetlinkError> {
        let mut attempt = 1;
        let mut busy = 0;
        loop {
            let answer = self
                .exchange(
                    message.clone(),
                    NLM_F_REQUEST | NLM_F_DUMP,
                    Expect::Dump,
                    ctx,
                )
                .await;
            let (messages, interrupted) = match answer {
                // The kernel runs one dump at a time per socket and refuses another while one
                // is still being read (EBUSY); the tasks sharing this socket take turns.
                Err(e) if e.errno() == Some(libc::EBUSY) && busy < DUMP_BUSY_RETRIES => {
                    busy += 1;
                    tracing::debug!(op = ctx.op, busy, "netlink socket busy with another dump");
                    tokio::time::sleep(Duration::from_millis(5) * busy).await;
                    continue;
                }
                answer => answer?,
            };
            if !interrupted {
                return Ok(messages);
            }
            if attempt == DUMP_ATTEMPTS {
                // Still changing under us: the last view is the best we have; callers
                // reconcile again later anyway.
                tracing::debug!(op = ctx.op, "netlink dump kept being interrupted");
                return Ok(messages);
            }
            attempt += 1;
        }
    }

    /// Sends one request and collects its answers; the flag says whether a dump was
    /// interrupted.
    async fn exchange(
        &self,
        message: RouteNetlinkMessage,
        flags: u16,
        expect: Expect,
        ctx: &Ctx,
    ) -> Result<(Vec<RouteNetlinkMessage>, bool), NetlinkError> {
        let mut request = NetlinkMessage::from(message);
        request.header.flags = flags;
        let mut answers = self
            .handle
            .request(request, SocketAddr::new(0, 0))
            .map_err(|e| {
                NetlinkError::socket(
                    format!("{} {}: netlink task is gone: {e}", ctx.op, ctx.object),
                    None,
                )
            })?;
        let collect = async {
            let mut out = Vec::new();
            let mut interrupted = false;
            while let Some(answer) = answers.next().await {
                let answer_flags = answer.header.flags;
                if answer_flags & NLM_F_DUMP_INTR != 0 {
                    interrupted = true;
                }
                match answer.payload {
                    NetlinkPayload::InnerMessage(inner) => {
                        out.push(inner);
                        if matches!(expect, Expect::One) {
                            break;
                        }
                    }
                    NetlinkPayload::Error(err) if err.code.is_some() => {
                        let code = err.code.map_or(0, |c| c.get());
                        let message = extack_from_error(&err.header, answer_flags);
                        return Err(ctx.errno(-code, message));
                    }
                    NetlinkPayload::Done(done) if done.code != 0 => {
                        let message = extack_from_tlvs(&done.extended_ack);
                        return Err(ctx.errno(-done.code, message));
                    }
                    NetlinkPayload::Overrun(_) => {
                        return Err(ctx
                            .other("netlink receive buffer overrun (ENOBUFS); answers were lost"));
                    }
                    _ => {}
                }
            }
            Ok((out, interrupted))
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, collect).await {
            Ok(result) => result,
            Err(_) => Err(NetlinkError::Timeout {
                op: ctx.op,
                object: ctx.object.clone(),
                seconds: REQUEST_TIMEOUT.as_secs(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_format_like_vtep_mac() {
        assert_eq!(
            format_mac(&[0x0e, 0x2a, 0, 0xab, 0xcd, 0xef]),
            "0e:2a:00:ab:cd:ef"
        );
        assert_eq!(
            mac_from_bytes(&[1, 2, 3, 4, 5, 6]),
            Some([1, 2, 3, 4, 5, 6])
        );
        assert_eq!(mac_from_bytes(&[1, 2, 3, 4]), None);
    }

    #[test]
    fn raw_ips_by_length() {
        assert_eq!(
            ip_from_bytes(&[10, 0, 0, 1]),
            Some(
                "10.0.0.1"
                    .parse()
                    .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
            )
        );
        assert_eq!(
            ip_from_bytes(&[0; 16]),
            Some(IpAddr::V6(Ipv6Addr::UNSPECIFIED))
        );
        assert_eq!(ip_from_bytes(&[1, 2, 3]), None);
    }
}
