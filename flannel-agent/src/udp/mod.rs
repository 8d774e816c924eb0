//! The udp backend's TUN path: upstream's `udp` backend (flannel-upstream.md 2.5) with the
//! encapsulation done by the agent in tokio — the fallback path; an eBPF path doing the same
//! encapsulation in TC can take over later with the identical wire format.
//!
//! **Wire format** (upstream's, unchanged): the UDP payload is the raw inner IPv4 packet, no
//! header of our own. Outer: IPv4 from the node's interface address (`IfaceAddr`, where the
//! socket is bound) to the peer's `PublicIP`, UDP from our port to *our* configured port
//! (upstream assumes every node uses the same `Port`, default 8285). The inner TTL is
//! decremented once on each side (drop at zero), the header checksum updated incrementally.
//!
//! **Devices and routes**: `flannel0` (TUN, `IFF_NO_PI`) with `<subnet IP>/32`, MTU
//! external − 28, up, and `<Network> dev flannel0`. Per-peer state lives only in the
//! forwarder's [`UdpRoutes`] (remote subnet → remote `PublicIP`:port), filled by
//! [`UdpApplier`] from the reconciler's desired state ([`Reach::Udp`](crate::dataplane::Reach)).
//! Leases of every `BackendType` are used (upstream's udp backend does not filter, and its
//! own leases have an empty type).
//!
//! **Checks on receive** (a decision, upstream checks nothing): the inner packet must be
//! IPv4 with consistent lengths and a valid header checksum, and its destination must lie in
//! this node's subnet — otherwise anyone who can reach UDP port 8285 could use the node as a
//! relay into any network it routes to. The outer source address is not checked, as upstream
//! (NAT and `--public-ip` make it differ from the lease's `PublicIP`). A TCP or UDP checksum
//! that a fast-path sender on a veth underlay left unfinished is finished
//! ([`packet::finish_l4_checksum`]), as the sender's NIC would have done.
//!
//! **Lifetime**: the TUN device exists while the agent runs (not persistent, as upstream). If
//! it is deleted under the agent, the forwarder creates it again and the reconciler
//! reconfigures it.
//!
//! | file | job |
//! |---|---|
//! | [`packet`] | IPv4 checks, TTL decrement, ICMP net unreachable |
//! | [`routes`] | the longest-prefix-match table |
//! | [`tun`] | opening `/dev/net/tun` |
//! | [`mmsg`] | `sendmmsg` / `recvmmsg` batches |
//! | [`forwarder`] | the egress and ingress loops |
//! | [`counters`] | packets and bytes by reason, for `/metrics` |
//! | [`applier`] | desired state → routing table |
//! | [`device`] | address, MTU, up and the network route of `flannel0` |

pub mod applier;
pub mod counters;
pub mod device;
pub mod forwarder;
pub mod mmsg;
pub mod packet;
pub mod routes;
pub mod tun;

use std::{
    io,
    net::{Ipv4Addr, SocketAddrV4},
    sync::Arc,
};

use ipnet::{IpNet, Ipv4Net};
use tokio::{net::UdpSocket, sync::watch};
use tokio_util::{sync::CancellationToken, task::AbortOnDropHandle};

pub use applier::UdpApplier;
pub use counters::{Reason, UdpCounters};
pub use device::{TUN_DEVICE, ensure_tun_device};
pub use routes::{UdpRoute, UdpRoutes};

use crate::{backend::UdpOptions, dataplane::Local, netlink::IpFamily};

/// Socket buffer size asked for (the kernel caps it at `net.core.{r,w}mem_max`).
const SOCKET_BUFFER: usize = 4 << 20;

/// Errors starting the udp backend.
#[derive(Debug, thiserror::Error)]
pub enum UdpError {
    /// The TUN device could not be created or attached.
    #[error("cannot open the TUN device {name}: {source}")]
    Tun {
        /// The device name.
        name: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The UDP socket could not be bound.
    #[error("cannot bind the udp backend's socket to {addr}: {source}")]
    Bind {
        /// `IfaceAddr:Port`.
        addr: SocketAddrV4,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The external interface has no IPv4 address to bind to.
    #[error(
        "the udp backend carries IPv4 only, but the external interface {iface} has no IPv4 address"
    )]
    NoIpv4Address {
        /// The interface.
        iface: String,
    },
    /// The lease has no IPv4 subnet (IPv6-only network).
    #[error(
        "the udp backend carries IPv4 only, but this node has no IPv4 subnet (EnableIPv4 is false)"
    )]
    NoIpv4Subnet,
    /// Registering a descriptor with the tokio reactor failed.
    #[error("registering {what} with the event loop: {source}")]
    Reactor {
        /// TUN device or socket.
        what: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// What the forwarder needs to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpConfig {
    /// The TUN device name ([`TUN_DEVICE`]).
    pub tun_name: String,
    /// Where the socket is bound: `IfaceAddr:Port`.
    pub bind: SocketAddrV4,
    /// The destination port of every peer (our `Port`, as upstream).
    pub port: u16,
    /// This node's subnet: the inner destinations accepted from the network.
    pub own_subnet: Ipv4Net,
}

impl UdpConfig {
    /// The configuration for node `local` with `options`.
    pub fn for_node(local: &Local, options: &UdpOptions) -> Result<Self, UdpError> {
        let iface_addr = local
            .ext
            .iface_addr
            .ok_or_else(|| UdpError::NoIpv4Address {
                iface: local.ext.name.clone(),
            })?;
        let own_subnet = match local.own_subnet(IpFamily::V4) {
            Some(IpNet::V4(s)) => s.trunc(),
            _ => return Err(UdpError::NoIpv4Subnet),
        };
        Ok(Self {
            tun_name: TUN_DEVICE.to_owned(),
            bind: SocketAddrV4::new(iface_addr, options.port),
            port: options.port,
            own_subnet,
        })
    }
}

/// The running forwarder: the TUN device, the socket and the two loops. Dropping it stops
/// the loops and closes the device (which then disappears).
pub struct UdpForwarder {
    shared: Arc<forwarder::Shared>,
    local_addr: SocketAddrV4,
    _tasks: [AbortOnDropHandle<()>; 2],
}

impl std::fmt::Debug for UdpForwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpForwarder")
            .field("local_addr", &self.local_addr)
            .field("own_subnet", &self.shared.own_subnet)
            .field("routes", &self.shared.routes.borrow().len())
            .finish_non_exhaustive()
    }
}

impl UdpForwarder {
    /// Creates the TUN device, binds the socket and starts forwarding (with an empty routing
    /// table) until `cancel` fires or the forwarder is dropped. Must run inside a tokio
    /// runtime, in the network namespace of the node.
    pub fn start(config: &UdpConfig, cancel: CancellationToken) -> Result<Self, UdpError> {
        let tun = tun::Tun::open(&config.tun_name)?;
        let tun = tun.register().map_err(|source| UdpError::Reactor {
            what: "the TUN device",
            source,
        })?;
        let bind_err = |source| UdpError::Bind {
            addr: config.bind,
            source,
        };
        let std_socket = std::net::UdpSocket::bind(config.bind).map_err(bind_err)?;
        std_socket.set_nonblocking(true).map_err(bind_err)?;
        grow_buffers(&std_socket);
        let local_addr = match std_socket.local_addr().map_err(bind_err)? {
            std::net::SocketAddr::V4(a) => a,
            std::net::SocketAddr::V6(_) => SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0),
        };
        let socket = UdpSocket::from_std(std_socket).map_err(|source| UdpError::Reactor {
            what: "the UDP socket",
            source,
        })?;
        let shared = Arc::new(forwarder::Shared {
            tun: watch::channel(Arc::new(tun)).0,
            routes: watch::channel(Arc::new(UdpRoutes::default())).0,
            socket: Arc::new(socket),
            counters: Arc::new(UdpCounters::default()),
            own_subnet: config.own_subnet,
        });
        let egress = tokio::spawn(forwarder::egress(shared.clone(), cancel.clone()));
        let ingress = tokio::spawn(forwarder::ingress(shared.clone(), cancel));
        tracing::info!(
            device = %config.tun_name,
            socket = %local_addr,
            subnet = %config.own_subnet,
            "udp backend forwarding (TUN path)"
        );
        Ok(Self {
            shared,
            local_addr,
            _tasks: [
                AbortOnDropHandle::new(egress),
                AbortOnDropHandle::new(ingress),
            ],
        })
    }

    /// The applier that keeps the routing table equal to the desired peers (push it onto the
    /// reconciler).
    pub fn applier(&self) -> UdpApplier {
        UdpApplier::new(self.shared.routes.clone())
    }

    /// The counters (a [`CounterSource`](crate::metrics::CounterSource) for `/metrics`).
    pub fn counters(&self) -> Arc<UdpCounters> {
        self.shared.counters.clone()
    }

    /// The routing table in use now.
    pub fn routes(&self) -> Arc<UdpRoutes> {
        self.shared.routes.borrow().clone()
    }

    /// Replaces the routing table (what the applier does; for tests and tools).
    pub fn set_routes(&self, routes: UdpRoutes) {
        self.shared.routes.send_replace(Arc::new(routes));
    }

    /// Where the socket is bound.
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.local_addr
    }
}

/// Asks for larger socket buffers so bursts are not dropped (best effort).
fn grow_buffers(socket: &std::net::UdpSocket) {
    use std::os::fd::AsRawFd as _;
    let size = libc::c_int::try_from(SOCKET_BUFFER).unwrap_or(libc::c_int::MAX);
    for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: setsockopt reads one c_int from a live stack value; the fd is an open
        // socket owned by `socket`.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&raw const size).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(
                option = opt,
                error = %io::Error::last_os_error(),
                "could not grow the udp backend's socket buffer"
            );
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn config_follows_the_node() {
        let local = device::tests::local();
        let c = UdpConfig::for_node(&local, &UdpOptions { port: 9000 }).unwrap();
        assert_eq!(c.bind, "192.168.1.11:9000".parse().unwrap());
        assert_eq!(c.port, 9000);
        assert_eq!(c.own_subnet, "10.244.1.0/24".parse().unwrap());
        assert_eq!(c.tun_name, "flannel0");

        let mut no_v4 = local.clone();
        no_v4.ext.iface_addr = None;
        assert!(matches!(
            UdpConfig::for_node(&no_v4, &UdpOptions::default()),
            Err(UdpError::NoIpv4Address { .. })
        ));
        let mut v6_only = local;
        v6_only.stack = crate::ip::IpStack::V6;
        assert_eq!(
            UdpConfig::for_node(&v6_only, &UdpOptions::default())
                .unwrap_err()
                .to_string(),
            "the udp backend carries IPv4 only, but this node has no IPv4 subnet (EnableIPv4 is false)"
        );
    }
}
