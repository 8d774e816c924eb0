//! The desired-state model shared by every applier: what this node is ([`Local`]), how each
//! remote node is reached ([`Peer`], [`PeerPath`], [`Reach`]) and what the computation noticed
//! on the way ([`Note`]).

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::{
    backend::{BackendOptions, MacAddr, MtuPlan, WgKey},
    iface::ExternalInterface,
    ip::IpStack,
    lease::Lease,
    netlink::IpFamily,
    subnet::LeaseId,
};

use super::facts::Reachability;

/// Everything about this node that the dataplane needs: its lease and network, the backend
/// options, the external interface, the MTUs, the VTEP MACs and the devices currently in place.
///
/// Built once by the daemon ([`Local::new`]); [`devices`](Self::devices) is filled by
/// [`ensure_devices`](super::ensure_devices) and kept current by the reconciler when a
/// device is recreated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Local {
    /// The node's own lease (its subnets exclude matching remote leases and routes).
    pub lease: Lease,
    /// The enabled families (`EnableIPv4` / `EnableIPv6`).
    pub stack: IpStack,
    /// The cluster's IPv4 `Network` (address clean-up on the vxlan device stays inside it).
    pub network: Option<Ipv4Net>,
    /// The cluster's IPv6 `IPv6Network`.
    pub network_v6: Option<Ipv6Net>,
    /// The backend and its options.
    pub backend: BackendOptions,
    /// The external interface (its index is refreshed by name on every device check).
    pub ext: ExternalInterface,
    /// Device MTUs.
    pub mtu: MtuPlan,
    /// The VTEP MACs of `flannel.<VNI>` / `flannel-v6.<VNI>` (vxlan only).
    pub vtep_macs: VtepMacs,
    /// The devices in place now.
    pub devices: Devices,
    /// ipip is carried by the eBPF fast path (no kernel `flannel.ipip`): routes to ipip peers
    /// then point out of the external interface, where `tc_to_netdev` encapsulates.
    pub ipip_via_ebpf: bool,
}

impl Local {
    /// A node description without devices yet.
    #[allow(clippy::too_many_arguments)] // one value per upstream concept; a builder adds nothing
    pub fn new(
        lease: Lease,
        stack: IpStack,
        network: Option<Ipv4Net>,
        network_v6: Option<Ipv6Net>,
        backend: BackendOptions,
        ext: ExternalInterface,
        mtu: MtuPlan,
        vtep_macs: VtepMacs,
    ) -> Self {
        Self {
            lease,
            stack,
            network,
            network_v6,
            backend,
            ext,
            mtu,
            vtep_macs,
            devices: Devices::default(),
            ipip_via_ebpf: false,
        }
    }

    /// The own subnet of `family`, when that family is enabled and leased.
    pub fn own_subnet(&self, family: IpFamily) -> Option<IpNet> {
        match family {
            IpFamily::V4 => self
                .lease
                .subnet
                .filter(|_| self.stack.has_v4())
                .map(IpNet::V4),
            IpFamily::V6 => self
                .lease
                .ipv6_subnet
                .filter(|_| self.stack.has_v6())
                .map(IpNet::V6),
        }
    }

    /// This node's public address of `family` (`ExtAddr` / `ExtV6Addr`).
    pub fn public_ip(&self, family: IpFamily) -> Option<IpAddr> {
        match family {
            IpFamily::V4 => self.ext.ext_addr.map(IpAddr::V4),
            IpFamily::V6 => self.ext.ext_v6_addr.map(IpAddr::V6),
        }
    }

    /// The cluster network of `family`.
    pub fn network_of(&self, family: IpFamily) -> Option<IpNet> {
        match family {
            IpFamily::V4 => self.network.map(IpNet::V4),
            IpFamily::V6 => self.network_v6.map(IpNet::V6),
        }
    }

    /// Whether a route to `dst` may be one to a remote node's subnet: inside the cluster
    /// network, narrower than it, and apart from this node's own subnet (not its blackhole
    /// route, its bridge's route, or the network's route through a wireguard or TUN device).
    pub fn may_be_peer_subnet(&self, dst: &IpNet) -> bool {
        let family = IpFamily::of(&dst.addr());
        self.network_of(family)
            .is_some_and(|n| n.contains(dst) && n.prefix_len() < dst.prefix_len())
            && self
                .own_subnet(family)
                .is_none_or(|own| !own.contains(dst) && !dst.contains(&own.addr()))
    }
}

/// The VTEP MACs of the vxlan devices, per family.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VtepMacs {
    /// MAC of `flannel.<VNI>`.
    pub v4: Option<MacAddr>,
    /// MAC of `flannel-v6.<VNI>`.
    pub v6: Option<MacAddr>,
}

impl VtepMacs {
    /// The MAC of `family`.
    pub fn get(&self, family: IpFamily) -> Option<MacAddr> {
        match family {
            IpFamily::V4 => self.v4,
            IpFamily::V6 => self.v6,
        }
    }
}

/// A device the dataplane created or adopted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Name (`flannel.1`, `flannel-v6.1`, `flannel.ipip`, `flannel0`).
    pub name: String,
    /// Interface index now.
    pub index: u32,
    /// Its MAC (vxlan devices).
    pub mac: Option<MacAddr>,
}

/// The dataplane's own devices as they are now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Devices {
    /// `flannel.<VNI>`.
    pub vxlan_v4: Option<DeviceInfo>,
    /// `flannel-v6.<VNI>`.
    pub vxlan_v6: Option<DeviceInfo>,
    /// `flannel.ipip`.
    pub ipip: Option<DeviceInfo>,
    /// `flannel0`, the udp backend's TUN device.
    pub tun: Option<DeviceInfo>,
}

impl Devices {
    /// The vxlan device of `family`.
    pub fn vxlan(&self, family: IpFamily) -> Option<&DeviceInfo> {
        match family {
            IpFamily::V4 => self.vxlan_v4.as_ref(),
            IpFamily::V6 => self.vxlan_v6.as_ref(),
        }
    }

    /// All devices.
    pub fn all(&self) -> impl Iterator<Item = &DeviceInfo> {
        [&self.vxlan_v4, &self.vxlan_v6, &self.ipip, &self.tun]
            .into_iter()
            .flatten()
    }

    /// Whether `index` is one of ours.
    pub fn contains_index(&self, index: u32) -> bool {
        self.all().any(|d| d.index == index)
    }

    /// The device named `name`, if it is one of ours.
    pub fn by_name(&self, name: &str) -> Option<&DeviceInfo> {
        self.all().find(|d| d.name == name)
    }
}

/// How packets for one remote subnet leave this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reach {
    /// A plain route via the peer's public IP, which is on a directly connected network out
    /// of `oif` (host-gw, and DirectRouting for vxlan and ipip).
    Direct {
        /// The peer's public IP, used as next hop.
        gateway: IpAddr,
        /// The interface of the connected network the gateway lies in.
        oif: u32,
    },
    /// VXLAN to the peer's VTEP.
    Vxlan {
        /// The peer's VTEP MAC (`VtepMAC` of its BackendData for this family).
        vtep_mac: MacAddr,
        /// The VNI the peer published (this node's VNI when it published none).
        vni: u32,
        /// The peer's public IP (outer destination).
        public_ip: IpAddr,
    },
    /// IP-in-IP to the peer's public IP (IPv4 only).
    Ipip {
        /// The peer's public IP (outer destination).
        public_ip: Ipv4Addr,
        /// The underlay next hop towards `public_ip` (the peer itself when directly connected,
        /// else the gateway), when the routing table says; used when the eBPF fast path
        /// carries ipip without a kernel device.
        next_hop: Option<IpAddr>,
    },
    /// A WireGuard peer: the subnet is one of its allowed IPs. The WireGuard applier
    /// (`crate::wireguard`) programs it; the kernel applier has nothing to add (one
    /// `<Network> dev flannel-wg` route covers every peer).
    Wireguard {
        /// The peer's public key (its BackendData of this family; in single-device modes the
        /// same key for both families).
        public_key: WgKey,
        /// Where its packets go: `<public IP>:<Port>` of this family, or in single-device
        /// modes the endpoint chosen by `Mode` (the same for both families).
        endpoint: SocketAddr,
    },
    /// An IPsec tunnel (strongSwan) to the peer's public IP, IPv4 only. The IPsec applier
    /// (`crate::ipsec`) programs it; there are no routes (XFRM policies select the traffic).
    Ipsec {
        /// The peer's public IP (outer destination, IKE peer).
        public_ip: Ipv4Addr,
    },
    /// The udp backend (IPv4 only): the inner packet as the payload of a UDP datagram to the
    /// peer's public IP and `port` (this node's configured `Port`, as upstream).
    Udp {
        /// The peer's public IP (outer destination).
        public_ip: Ipv4Addr,
        /// The UDP destination port.
        port: u16,
    },
}

impl Reach {
    /// The peer's public IP this path uses.
    pub fn public_ip(&self) -> IpAddr {
        match self {
            Self::Direct { gateway, .. } => *gateway,
            Self::Vxlan { public_ip, .. } => *public_ip,
            Self::Ipip { public_ip, .. }
            | Self::Ipsec { public_ip }
            | Self::Udp { public_ip, .. } => IpAddr::V4(*public_ip),
            Self::Wireguard { endpoint, .. } => endpoint.ip(),
        }
    }
}

impl fmt::Display for Reach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Direct { gateway, oif } => write!(f, "direct via {gateway} dev #{oif}"),
            Self::Vxlan {
                vtep_mac,
                vni,
                public_ip,
            } => write!(f, "vxlan {public_ip} vni {vni} vtep {vtep_mac}"),
            Self::Ipip { public_ip, .. } => write!(f, "ipip {public_ip}"),
            Self::Wireguard {
                public_key,
                endpoint,
            } => write!(f, "wireguard {endpoint} key {public_key}"),
            Self::Ipsec { public_ip } => write!(f, "ipsec {public_ip}"),
            Self::Udp { public_ip, port } => write!(f, "udp {public_ip}:{port}"),
        }
    }
}

/// One remote subnet and how to reach it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerPath {
    /// The remote node's subnet (host bits zero).
    pub subnet: IpNet,
    /// How to get there.
    pub reach: Reach,
}

impl PeerPath {
    /// The family of the subnet.
    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.subnet.addr())
    }
}

/// A remote lease as the extension backend's commands see it (upstream 2.8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtensionPeer {
    /// The lease id.
    pub id: LeaseId,
    /// Its IPv4 subnet (`SUBNET`).
    pub subnet: Option<Ipv4Net>,
    /// Its IPv6 subnet (`IPV6SUBNET`).
    pub ipv6_subnet: Option<Ipv6Net>,
    /// Its public IP (`PUBLIC_IP`).
    pub public_ip: Ipv4Addr,
    /// Its public IPv6 address (`PUBLIC_IPV6`).
    pub public_ipv6: Option<Ipv6Addr>,
    /// Its BackendData, a JSON string, decoded (the commands' input); empty when absent.
    pub data: String,
}

/// A remote node: its lease id and one path per family it can be reached on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// The lease id (etcd subnet key or `node/<name>`).
    pub id: LeaseId,
    /// The IPv4 path, if any.
    pub v4: Option<PeerPath>,
    /// The IPv6 path, if any.
    pub v6: Option<PeerPath>,
}

impl Peer {
    /// The paths of this peer (IPv4 first).
    pub fn paths(&self) -> impl Iterator<Item = &PeerPath> {
        self.v4.iter().chain(self.v6.iter())
    }
}

/// Why a lease (or one family of it) is not programmed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum IgnoreReason {
    /// The lease belongs to another backend (upstream: `Ignoring non-<type> subnet`).
    OtherBackend {
        /// The lease's `BackendType`.
        found: String,
    },
    /// The BackendData of that family cannot be used (missing or malformed).
    BadBackendData {
        /// The family.
        family: IpFamily,
        /// Why.
        error: String,
    },
    /// The lease has a subnet of that family but no public IP of it.
    NoPublicIp {
        /// The family.
        family: IpFamily,
    },
}

impl fmt::Display for IgnoreReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OtherBackend { found } => {
                let shown = if found.is_empty() { "(none)" } else { found };
                write!(f, "its backend type is {shown}")
            }
            Self::BadBackendData { family, error } => {
                write!(f, "unusable {family} backend data: {error}")
            }
            Self::NoPublicIp { family } => write!(f, "it has no {family} public IP"),
        }
    }
}

/// Something [`desired()`](super::desired()) noticed. The reconciler logs each note once (while
/// it persists) and counts them in its status.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Note {
    /// A lease or one family of it is not used.
    Ignored {
        /// The lease.
        id: LeaseId,
        /// Why.
        reason: IgnoreReason,
    },
    /// A lease claims a subnet overlapping one already taken (by a lease with a smaller id, or
    /// by this node); the first claim wins.
    Overlap {
        /// The losing lease.
        id: LeaseId,
        /// Its subnet.
        subnet: IpNet,
        /// Who has it: a lease id, or `None` for this node's own subnet.
        winner: Option<LeaseId>,
        /// The winner's subnet.
        winner_subnet: IpNet,
    },
    /// Two leases publish the same VTEP MAC for different public IPs; the first one wins
    /// (one MAC can only have one FDB destination).
    DuplicateVtepMac {
        /// The losing lease.
        id: LeaseId,
        /// The MAC.
        vtep_mac: MacAddr,
        /// The lease that has it.
        winner: LeaseId,
    },
    /// A host-gw peer whose public IP is not on a directly connected network: there is no
    /// route to give it (upstream would install one the kernel rejects).
    Unreachable {
        /// The lease.
        id: LeaseId,
        /// Its subnet.
        subnet: IpNet,
        /// Its public IP.
        public_ip: IpAddr,
        /// What the routing table says about the public IP.
        why: Reachability,
    },
}

impl Note {
    /// Whether the note is a warning (everything but other-backend leases, which are normal
    /// in mixed clusters and logged at info like upstream).
    pub fn is_warning(&self) -> bool {
        !matches!(
            self,
            Self::Ignored {
                reason: IgnoreReason::OtherBackend { .. },
                ..
            }
        )
    }
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ignored { id, reason } => write!(f, "ignoring lease {id}: {reason}"),
            Self::Overlap {
                id,
                subnet,
                winner,
                winner_subnet,
            } => match winner {
                Some(w) => write!(
                    f,
                    "ignoring subnet {subnet} of lease {id}: it overlaps {winner_subnet} of lease {w}"
                ),
                None => write!(
                    f,
                    "ignoring subnet {subnet} of lease {id}: it overlaps this node's subnet {winner_subnet}"
                ),
            },
            Self::DuplicateVtepMac {
                id,
                vtep_mac,
                winner,
            } => write!(
                f,
                "ignoring the vxlan path of lease {id}: VTEP MAC {vtep_mac} is already used by lease {winner}"
            ),
            Self::Unreachable {
                id,
                subnet,
                public_ip,
                why,
            } => write!(
                f,
                "no route to {subnet} of lease {id}: its public IP {public_ip} is not on a directly \
                 connected network ({why}); host-gw needs all nodes on one L2 segment"
            ),
        }
    }
}

/// The desired dataplane: one entry per reachable remote lease, plus what was noticed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    /// Peers, ordered by lease id.
    pub peers: Vec<Peer>,
    /// The extension backend's remote leases, ordered by lease id (its commands program
    /// them; `peers` stays empty).
    pub extension: Vec<ExtensionPeer>,
    /// Notes, in the order they were found.
    pub notes: Vec<Note>,
}

impl Desired {
    /// Number of host-gw peer subnets without a route.
    pub fn unreachable(&self) -> usize {
        self.count(|n| matches!(n, Note::Unreachable { .. }))
    }

    /// Number of leases (or families of them) ignored.
    pub fn ignored(&self) -> usize {
        self.count(|n| matches!(n, Note::Ignored { .. }))
    }

    /// Number of overlap / duplicate-MAC conflicts.
    pub fn conflicts(&self) -> usize {
        self.count(|n| matches!(n, Note::Overlap { .. } | Note::DuplicateVtepMac { .. }))
    }

    /// Every path of every peer.
    pub fn paths(&self) -> impl Iterator<Item = (&Peer, &PeerPath)> {
        self.peers
            .iter()
            .flat_map(|p| p.paths().map(move |x| (p, x)))
    }

    fn count(&self, f: impl Fn(&Note) -> bool) -> usize {
        self.notes.iter().filter(|n| f(n)).count()
    }
}

/// The network address of a subnet (`10.244.2.0` for `10.244.2.0/24`): upstream's vxlan
/// next hop and neighbour address for a remote subnet.
pub fn subnet_address(n: IpNet) -> IpAddr {
    match n {
        IpNet::V4(v4) => IpAddr::V4(v4.network()),
        IpNet::V6(v6) => IpAddr::V6(v6.network()),
    }
}

/// `0.0.0.0` / `::`.
pub(crate) fn is_unspecified(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4 == Ipv4Addr::UNSPECIFIED,
        IpAddr::V6(v6) => v6 == Ipv6Addr::UNSPECIFIED,
    }
}
