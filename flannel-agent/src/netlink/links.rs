//! Links: list and look up, create vxlan / ipip / wireguard devices, delete, up/down, MTU, MAC.
//!
//! vxlan devices follow upstream flannel (flannel-upstream.md 2.1): [`Netlink::ensure_vxlan`]
//! reuses an existing device unchanged when it is compatible with the wanted
//! [`VxlanSpec`], and otherwise reports every [`Incompatibility`] so the caller can delete and
//! recreate it.

use std::{fmt, net::IpAddr};

use rtnetlink::{
    packet_core::{NLM_F_CREATE, NLM_F_EXCL},
    packet_route::{
        RouteNetlinkMessage,
        link::{
            InfoData, InfoIpTunnel, InfoKind, InfoVxlan, LinkAttribute, LinkFlags, LinkInfo,
            LinkMessage,
        },
    },
};

use super::{Netlink, NetlinkError, errors::Ctx, format_mac, mac_from_bytes};

/// Maximum length of a Linux interface name (`IFNAMSIZ - 1`).
pub const MAX_LINK_NAME: usize = 15;

/// The kernel's default vxlan UDP port, used when [`VxlanSpec::port`] is `None`.
pub const VXLAN_DEFAULT_PORT: u16 = 8472;

/// A network interface as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Interface name.
    pub name: String,
    /// `IFLA_INFO_KIND`, e.g. `"vxlan"`, `"veth"`, `"bridge"`; `None` for devices without a
    /// kind (loopback, physical NICs).
    pub kind: Option<String>,
    /// MTU in bytes.
    pub mtu: u32,
    /// The hardware address when it is a 6-byte MAC (`None` for e.g. ipip or wireguard).
    pub mac: Option<[u8; 6]>,
    /// Administratively up (`IFF_UP`).
    pub up: bool,
    /// Carrier present (`IFF_LOWER_UP`).
    pub lower_up: bool,
    /// RFC 2863 operational state.
    pub oper_state: OperState,
    /// Index of the master device (bridge, bond, VRF), if enslaved.
    pub master: Option<u32>,
    /// vxlan parameters, for `kind == Some("vxlan")`.
    pub vxlan: Option<VxlanInfo>,
    /// IP-in-IP tunnel parameters, for `kind == Some("ipip")`.
    pub ip_tunnel: Option<IpTunnelInfo>,
}

impl Link {
    /// True when the link's kind is `kind` (e.g. `"vxlan"`).
    pub fn is_kind(&self, kind: &str) -> bool {
        self.kind.as_deref() == Some(kind)
    }
}

/// RFC 2863 operational state (`IFLA_OPERSTATE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperState {
    /// Unknown (also what virtual devices without carrier logic report).
    Unknown,
    /// Some component is missing.
    NotPresent,
    /// Down.
    Down,
    /// Down because the lower layer is down.
    LowerLayerDown,
    /// In a test mode.
    Testing,
    /// Waiting for an external event.
    Dormant,
    /// Up, ready to pass packets.
    Up,
    /// A value this code does not know.
    Other(u8),
}

impl From<u8> for OperState {
    fn from(v: u8) -> Self {
        match v {
            0 => Self::Unknown,
            1 => Self::NotPresent,
            2 => Self::Down,
            3 => Self::LowerLayerDown,
            4 => Self::Testing,
            5 => Self::Dormant,
            6 => Self::Up,
            other => Self::Other(other),
        }
    }
}

/// The parameters of an existing vxlan device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanInfo {
    /// VXLAN network identifier (0 for `external` devices).
    pub vni: u32,
    /// UDP destination port.
    pub port: u16,
    /// Local (source) address, v4 or v6.
    pub local: Option<IpAddr>,
    /// Index of the underlying device (`dev`).
    pub underlay_index: Option<u32>,
    /// Kernel MAC learning.
    pub learning: bool,
    /// Group Based Policy extension.
    pub gbp: bool,
    /// `external` / `collect_md`: metadata-based device (VNI and remote per packet, e.g. set by
    /// eBPF).
    pub external: bool,
    /// `udpcsum`: UDP checksums on transmit over IPv4.
    pub udp_csum: bool,
    /// `udp6zerocsumtx`: zero UDP checksum on transmit over IPv6.
    pub udp6_zero_csum_tx: bool,
    /// `udp6zerocsumrx`: accept zero UDP checksums over IPv6.
    pub udp6_zero_csum_rx: bool,
}

/// The parameters of an ipip tunnel device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpTunnelInfo {
    /// Local address (`None` or unspecified = any).
    pub local: Option<IpAddr>,
    /// Remote address (`None` or unspecified = any).
    pub remote: Option<IpAddr>,
    /// Index of the underlying device.
    pub underlay_index: Option<u32>,
}

/// How to create a vxlan device. Build with [`VxlanSpec::new`] and set the public fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanSpec {
    /// Device name, e.g. `flannel.1` (at most 15 bytes).
    pub name: String,
    /// VXLAN network identifier (24 bits). May be 0 for `external` devices.
    pub vni: u32,
    /// UDP destination port; `None` leaves the kernel default ([`VXLAN_DEFAULT_PORT`]), like
    /// upstream's `Port: 0`.
    pub port: Option<u16>,
    /// Local (source) address; its family selects an IPv4 or IPv6 underlay.
    pub local: Option<IpAddr>,
    /// Underlying device index (`dev`), upstream's `VtepDevIndex`.
    pub underlay_index: Option<u32>,
    /// Kernel MAC learning (upstream default: off, `nolearning`).
    pub learning: bool,
    /// Group Based Policy extension.
    pub gbp: bool,
    /// Device MTU; `None` lets the kernel derive it from the underlay.
    pub mtu: Option<u32>,
    /// Device MAC; `None` lets the kernel pick a random one.
    pub mac: Option<[u8; 6]>,
    /// `external` (collect_md) device.
    pub external: bool,
    /// `udp6zerocsumtx`; only allowed with an IPv6 `local`.
    pub udp6_zero_csum_tx: bool,
    /// `udp6zerocsumrx`; only allowed with an IPv6 `local`.
    pub udp6_zero_csum_rx: bool,
}

impl VxlanSpec {
    /// A spec with upstream's defaults: kernel port, no local address, no underlay, learning
    /// off, no GBP, kernel MTU and MAC, not external.
    pub fn new(name: impl Into<String>, vni: u32) -> Self {
        Self {
            name: name.into(),
            vni,
            port: None,
            local: None,
            underlay_index: None,
            learning: false,
            gbp: false,
            mtu: None,
            mac: None,
            external: false,
            udp6_zero_csum_tx: false,
            udp6_zero_csum_rx: false,
        }
    }

    /// Checks the spec before anything is sent to the kernel.
    pub fn validate(&self) -> Result<(), NetlinkError> {
        const OP: &str = "create vxlan link";
        validate_name(OP, &self.name)?;
        if self.vni > 0x00ff_ffff {
            return Err(Ctx::invalid(
                OP,
                "vni",
                self.vni,
                "a VNI has 24 bits (max 16777215)",
            ));
        }
        if self.vni == 0 && !self.external {
            return Err(Ctx::invalid(
                OP,
                "vni",
                0,
                "VNI 0 is only allowed for external devices",
            ));
        }
        if self.port == Some(0) {
            return Err(Ctx::invalid(
                OP,
                "port",
                0,
                "use None for the kernel default port",
            ));
        }
        let v6 = matches!(self.local, Some(IpAddr::V6(_)));
        if (self.udp6_zero_csum_tx || self.udp6_zero_csum_rx) && !v6 {
            return Err(Ctx::invalid(
                OP,
                "udp6_zero_csum",
                format!("{:?}", self.local),
                "zero UDP checksums need an IPv6 local address",
            ));
        }
        if let Some(mac) = self.mac
            && (mac[0] & 1 == 1 || mac == [0; 6])
        {
            return Err(Ctx::invalid(
                OP,
                "mac",
                format_mac(&mac),
                "a device MAC must be unicast and non-zero",
            ));
        }
        Ok(())
    }

    /// Everything that makes `existing` unusable for this spec, following upstream's
    /// `isIncompatible`: a different kind, VNI, underlay (when both are set), local address
    /// (when both are set), port (when the spec sets one), GBP, or external flag. MAC, MTU,
    /// learning and checksum options are not compared: a compatible device is reused as is.
    pub fn incompatibilities(&self, existing: &Link) -> Vec<Incompatibility> {
        let Some(info) = existing
            .vxlan
            .as_ref()
            .filter(|_| existing.is_kind("vxlan"))
        else {
            return vec![Incompatibility::Kind {
                found: existing.kind.clone(),
            }];
        };
        let mut out = Vec::new();
        if info.vni != self.vni {
            out.push(Incompatibility::Vni {
                want: self.vni,
                found: info.vni,
            });
        }
        if let (Some(want), Some(found)) = (self.underlay_index, info.underlay_index)
            && want != found
        {
            out.push(Incompatibility::UnderlayIndex { want, found });
        }
        if let (Some(want), Some(found)) = (self.local, info.local)
            && want != found
        {
            out.push(Incompatibility::Local { want, found });
        }
        if let Some(want) = self.port
            && want != info.port
        {
            out.push(Incompatibility::Port {
                want,
                found: info.port,
            });
        }
        if self.gbp != info.gbp {
            out.push(Incompatibility::Gbp {
                want: self.gbp,
                found: info.gbp,
            });
        }
        if self.external != info.external {
            out.push(Incompatibility::External {
                want: self.external,
                found: info.external,
            });
        }
        out
    }

    fn message(&self) -> LinkMessage {
        let mut data = Vec::new();
        if self.vni != 0 {
            data.push(InfoVxlan::Id(self.vni));
        }
        if let Some(index) = self.underlay_index {
            data.push(InfoVxlan::Link(index));
        }
        match self.local {
            Some(IpAddr::V4(ip)) => data.push(InfoVxlan::Local(ip)),
            Some(IpAddr::V6(ip)) => data.push(InfoVxlan::Local6(ip)),
            None => {}
        }
        if let Some(port) = self.port {
            data.push(InfoVxlan::Port(port));
        }
        data.push(InfoVxlan::Learning(self.learning));
        if self.gbp {
            data.push(InfoVxlan::Gbp);
        }
        if self.external {
            data.push(InfoVxlan::CollectMetadata(true));
        }
        // IPv4 outer checksums stay at the kernel default; IPv6 zero checksums are opt-in.
        if self.udp6_zero_csum_tx {
            data.push(InfoVxlan::UDPZeroCsumTX(true));
        }
        if self.udp6_zero_csum_rx {
            data.push(InfoVxlan::UDPZeroCsumRX(true));
        }
        new_link_message(
            &self.name,
            InfoKind::Vxlan,
            Some(InfoData::Vxlan(data)),
            self.mtu,
            self.mac,
        )
    }
}

/// One reason an existing device cannot be reused for a [`VxlanSpec`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incompatibility {
    /// The device is not a vxlan device.
    Kind {
        /// Its kind.
        found: Option<String>,
    },
    /// Different VNI.
    Vni {
        /// Wanted.
        want: u32,
        /// Found.
        found: u32,
    },
    /// Different underlying device.
    UnderlayIndex {
        /// Wanted.
        want: u32,
        /// Found.
        found: u32,
    },
    /// Different local address.
    Local {
        /// Wanted.
        want: IpAddr,
        /// Found.
        found: IpAddr,
    },
    /// Different UDP port.
    Port {
        /// Wanted.
        want: u16,
        /// Found.
        found: u16,
    },
    /// GBP differs.
    Gbp {
        /// Wanted.
        want: bool,
        /// Found.
        found: bool,
    },
    /// The external (collect_md) flag differs.
    External {
        /// Wanted.
        want: bool,
        /// Found.
        found: bool,
    },
}

impl fmt::Display for Incompatibility {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Kind { found } => write!(
                f,
                "link type is {} instead of vxlan",
                found.as_deref().unwrap_or("(none)")
            ),
            Self::Vni { want, found } => write!(f, "VNI {found} instead of {want}"),
            Self::UnderlayIndex { want, found } => {
                write!(f, "underlying device index {found} instead of {want}")
            }
            Self::Local { want, found } => write!(f, "local address {found} instead of {want}"),
            Self::Port { want, found } => write!(f, "port {found} instead of {want}"),
            Self::Gbp { want, found } => write!(f, "gbp {found} instead of {want}"),
            Self::External { want, found } => write!(f, "external {found} instead of {want}"),
        }
    }
}

/// The outcome of [`Netlink::ensure_vxlan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VxlanEnsure {
    /// The device did not exist and was created.
    Created(Link),
    /// A compatible device existed and is reused unchanged (its MAC, MTU and learning flag may
    /// differ from the spec: check them if they matter).
    Reused(Link),
    /// A device with that name exists but cannot be reused; delete it and call again
    /// (upstream logs `"<name>" already exists with incompatible configuration` and recreates).
    Incompatible {
        /// The existing device.
        existing: Link,
        /// Every difference found (never empty).
        problems: Vec<Incompatibility>,
    },
}

/// Checks a link name the way the kernel's `dev_valid_name` does.
pub fn validate_name(op: &'static str, name: &str) -> Result<(), NetlinkError> {
    let reason = if name.is_empty() {
        Some("empty")
    } else if name.len() > MAX_LINK_NAME {
        Some("longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("reserved")
    } else if name.contains(['/', ':']) || name.chars().any(char::is_whitespace) {
        Some("contains '/', ':' or whitespace")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(Ctx::invalid(op, "link name", name, reason)),
        None => Ok(()),
    }
}

fn new_link_message(
    name: &str,
    kind: InfoKind,
    data: Option<InfoData>,
    mtu: Option<u32>,
    mac: Option<[u8; 6]>,
) -> LinkMessage {
    let mut message = LinkMessage::default();
    message
        .attributes
        .push(LinkAttribute::IfName(name.to_owned()));
    if let Some(mtu) = mtu {
        message.attributes.push(LinkAttribute::Mtu(mtu));
    }
    if let Some(mac) = mac {
        message
            .attributes
            .push(LinkAttribute::Address(mac.to_vec()));
    }
    let mut info = vec![LinkInfo::Kind(kind)];
    if let Some(data) = data {
        info.push(LinkInfo::Data(data));
    }
    message.attributes.push(LinkAttribute::LinkInfo(info));
    message
}

/// Converts a kernel link message; `None` when it has no name (never seen in practice).
pub(crate) fn link_from_message(message: &LinkMessage) -> Option<Link> {
    let mut name = None;
    let mut kind = None;
    let mut mtu = 0;
    let mut mac = None;
    let mut oper_state = OperState::Unknown;
    let mut master = None;
    let mut vxlan = None;
    let mut ip_tunnel = None;
    for attr in &message.attributes {
        match attr {
            LinkAttribute::IfName(n) => name = Some(n.clone()),
            LinkAttribute::Mtu(m) => mtu = *m,
            LinkAttribute::Address(a) => mac = mac_from_bytes(a),
            LinkAttribute::OperState(s) => oper_state = OperState::from(u8::from(*s)),
            LinkAttribute::Controller(m) if *m != 0 => master = Some(*m),
            LinkAttribute::LinkInfo(infos) => {
                for info in infos {
                    match info {
                        LinkInfo::Kind(k) => kind = Some(k.to_string()),
                        LinkInfo::Data(InfoData::Vxlan(data)) => vxlan = Some(vxlan_info(data)),
                        LinkInfo::Data(InfoData::IpTunnel(data)) => {
                            ip_tunnel = Some(ip_tunnel_info(data))
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    let flags = message.header.flags;
    Some(Link {
        index: message.header.index,
        name: name?,
        kind,
        mtu,
        mac,
        up: flags.contains(LinkFlags::Up),
        lower_up: flags.contains(LinkFlags::LowerUp),
        oper_state,
        master,
        vxlan,
        ip_tunnel,
    })
}

fn vxlan_info(data: &[InfoVxlan]) -> VxlanInfo {
    let mut info = VxlanInfo {
        vni: 0,
        port: VXLAN_DEFAULT_PORT,
        local: None,
        underlay_index: None,
        learning: false,
        gbp: false,
        external: false,
        udp_csum: false,
        udp6_zero_csum_tx: false,
        udp6_zero_csum_rx: false,
    };
    for item in data {
        match item {
            InfoVxlan::Id(v) => info.vni = *v,
            InfoVxlan::Port(p) => info.port = *p,
            InfoVxlan::Local(ip) if !ip.is_unspecified() => info.local = Some((*ip).into()),
            InfoVxlan::Local6(ip) if !ip.is_unspecified() => info.local = Some((*ip).into()),
            InfoVxlan::Link(i) if *i != 0 => info.underlay_index = Some(*i),
            InfoVxlan::Learning(v) => info.learning = *v,
            InfoVxlan::Gbp => info.gbp = true,
            InfoVxlan::CollectMetadata(v) => info.external = *v,
            InfoVxlan::UDPCsum(v) => info.udp_csum = *v,
            InfoVxlan::UDPZeroCsumTX(v) => info.udp6_zero_csum_tx = *v,
            InfoVxlan::UDPZeroCsumRX(v) => info.udp6_zero_csum_rx = *v,
            _ => {}
        }
    }
    info
}

fn ip_tunnel_info(data: &[InfoIpTunnel]) -> IpTunnelInfo {
    let mut info = IpTunnelInfo {
        local: None,
        remote: None,
        underlay_index: None,
    };
    for item in data {
        match item {
            InfoIpTunnel::Local(ip) if !ip.is_unspecified() => info.local = Some(*ip),
            InfoIpTunnel::Remote(ip) if !ip.is_unspecified() => info.remote = Some(*ip),
            InfoIpTunnel::Link(i) if *i != 0 => info.underlay_index = Some(*i),
            _ => {}
        }
    }
    info
}

impl Netlink {
    /// All links of the namespace (`ip link show`).
    pub async fn list_links(&self) -> Result<Vec<Link>, NetlinkError> {
        let ctx = Ctx::new("list", "links");
        let answers = self
            .dump(RouteNetlinkMessage::GetLink(LinkMessage::default()), &ctx)
            .await?;
        Ok(answers
            .iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => link_from_message(l),
                _ => None,
            })
            .collect())
    }

    /// The link called `name`, or `None`.
    pub async fn link_by_name(&self, name: &str) -> Result<Option<Link>, NetlinkError> {
        validate_name("get link", name)?;
        let mut message = LinkMessage::default();
        message
            .attributes
            .push(LinkAttribute::IfName(name.to_owned()));
        self.get_link(message, &Ctx::new("get link", name)).await
    }

    /// The link with index `index`, or `None`.
    pub async fn link_by_index(&self, index: u32) -> Result<Option<Link>, NetlinkError> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        self.get_link(message, &Ctx::new("get link", format!("index {index}")))
            .await
    }

    async fn get_link(
        &self,
        message: LinkMessage,
        ctx: &Ctx,
    ) -> Result<Option<Link>, NetlinkError> {
        match self
            .get_one(RouteNetlinkMessage::GetLink(message), ctx)
            .await
        {
            Ok(RouteNetlinkMessage::NewLink(l)) => link_from_message(&l)
                .map(Some)
                .ok_or_else(|| ctx.other("link without a name")),
            Ok(other) => Err(ctx.other(format!("unexpected answer {other:?}"))),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Creates a vxlan device (fails with [`NetlinkError::AlreadyExists`] when the name is
    /// taken) and returns it as the kernel reports it. The device is left down.
    pub async fn create_vxlan(&self, spec: &VxlanSpec) -> Result<Link, NetlinkError> {
        spec.validate()?;
        self.create_link(spec.message(), "vxlan", &spec.name).await
    }

    /// Upstream's vxlan device logic: reuse a compatible device named `spec.name` unchanged,
    /// report an incompatible one, or create it.
    pub async fn ensure_vxlan(&self, spec: &VxlanSpec) -> Result<VxlanEnsure, NetlinkError> {
        spec.validate()?;
        // Two rounds: a device may appear between the lookup and the create.
        for _ in 0..2 {
            if let Some(existing) = self.link_by_name(&spec.name).await? {
                let problems = spec.incompatibilities(&existing);
                return Ok(if problems.is_empty() {
                    VxlanEnsure::Reused(existing)
                } else {
                    VxlanEnsure::Incompatible { existing, problems }
                });
            }
            match self.create_vxlan(spec).await {
                Ok(link) => return Ok(VxlanEnsure::Created(link)),
                Err(e) if e.is_already_exists() => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Ctx::new("ensure vxlan link", &spec.name)
            .other("the device appears and disappears concurrently"))
    }

    /// Creates an IP-in-IP device (`ip link add NAME type ipip local LOCAL [dev UNDERLAY]`,
    /// remote any), as upstream's ipip backend does for `flannel.ipip`. Kernels without the
    /// ipip module fail with [`NetlinkError::Unsupported`].
    pub async fn create_ipip(
        &self,
        name: &str,
        local: std::net::Ipv4Addr,
        underlay_index: Option<u32>,
        mtu: Option<u32>,
    ) -> Result<Link, NetlinkError> {
        validate_name("create ipip link", name)?;
        let mut data = vec![
            InfoIpTunnel::Local(local.into()),
            InfoIpTunnel::Remote(std::net::Ipv4Addr::UNSPECIFIED.into()),
        ];
        if let Some(index) = underlay_index {
            data.push(InfoIpTunnel::Link(index));
        }
        let message = new_link_message(
            name,
            InfoKind::IpIp,
            Some(InfoData::IpTunnel(data)),
            mtu,
            None,
        );
        self.create_link(message, "ipip", name).await
    }

    /// Creates a wireguard device (`ip link add NAME type wireguard`); keys and peers are
    /// configured elsewhere (generic netlink). Kernels without wireguard fail with
    /// [`NetlinkError::Unsupported`].
    pub async fn create_wireguard(
        &self,
        name: &str,
        mtu: Option<u32>,
    ) -> Result<Link, NetlinkError> {
        validate_name("create wireguard link", name)?;
        let message = new_link_message(name, InfoKind::Wireguard, None, mtu, None);
        self.create_link(message, "wireguard", name).await
    }

    async fn create_link(
        &self,
        message: LinkMessage,
        kind: &str,
        name: &str,
    ) -> Result<Link, NetlinkError> {
        let ctx = Ctx::new("create link", format!("{name} type {kind}")).creating(kind, name);
        self.ack(
            RouteNetlinkMessage::NewLink(message),
            NLM_F_CREATE | NLM_F_EXCL,
            &ctx,
        )
        .await?;
        self.link_by_name(name)
            .await?
            .ok_or_else(|| ctx.other("created, but gone when read back"))
    }

    /// Deletes the link with index `index` (a veth takes its peer along).
    pub async fn delete_link(&self, index: u32) -> Result<(), NetlinkError> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        let ctx = Ctx::new("delete link", format!("index {index}"));
        self.ack(RouteNetlinkMessage::DelLink(message), 0, &ctx)
            .await
    }

    /// Sets the link administratively up (`ip link set DEV up`).
    pub async fn set_link_up(&self, index: u32) -> Result<(), NetlinkError> {
        self.set_up_flag(index, true).await
    }

    /// Sets the link administratively down (`ip link set DEV down`).
    pub async fn set_link_down(&self, index: u32) -> Result<(), NetlinkError> {
        self.set_up_flag(index, false).await
    }

    async fn set_up_flag(&self, index: u32, up: bool) -> Result<(), NetlinkError> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        if up {
            message.header.flags |= LinkFlags::Up;
        }
        message.header.change_mask |= LinkFlags::Up;
        let what = if up { "set link up" } else { "set link down" };
        self.change_link(message, &Ctx::new(what, format!("index {index}")))
            .await
    }

    /// Sets the MTU (`ip link set DEV mtu MTU`).
    pub async fn set_mtu(&self, index: u32, mtu: u32) -> Result<(), NetlinkError> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        message.attributes.push(LinkAttribute::Mtu(mtu));
        let ctx = Ctx::new("set mtu", format!("{mtu} on index {index}"));
        self.change_link(message, &ctx).await
    }

    /// Sets the largest GSO packet the stack builds for the link, for IPv6 and IPv4 alike
    /// (`ip link set DEV gso_max_size SIZE gso_ipv4_max_size SIZE`; above 65,536 bytes that is
    /// BIG TCP). The agent leaves these alone; tests give pods BIG TCP with it.
    pub async fn set_gso_max_size(&self, index: u32, size: u32) -> Result<(), NetlinkError> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        message.attributes.push(LinkAttribute::GsoMaxSize(size));
        message.attributes.push(LinkAttribute::GsoIpv4MaxSize(size));
        let ctx = Ctx::new("set gso max size", format!("{size} on index {index}"));
        self.change_link(message, &ctx).await
    }

    /// Sets the MAC (`ip link set DEV address MAC`).
    pub async fn set_mac(&self, index: u32, mac: [u8; 6]) -> Result<(), NetlinkError> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        message
            .attributes
            .push(LinkAttribute::Address(mac.to_vec()));
        let ctx = Ctx::new("set mac", format!("{} on index {index}", format_mac(&mac)));
        self.change_link(message, &ctx).await
    }

    /// `RTM_NEWLINK` without `NLM_F_CREATE` on an existing index (what `ip link set` sends).
    async fn change_link(&self, message: LinkMessage, ctx: &Ctx) -> Result<(), NetlinkError> {
        self.ack(RouteNetlinkMessage::NewLink(message), 0, ctx)
            .await
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn vxlan_link(info: VxlanInfo) -> Link {
        Link {
            index: 7,
            name: "flannel.1".into(),
            kind: Some("vxlan".into()),
            mtu: 1450,
            mac: Some([0x0e, 1, 2, 3, 4, 5]),
            up: true,
            lower_up: true,
            oper_state: OperState::Unknown,
            master: None,
            vxlan: Some(info),
            ip_tunnel: None,
        }
    }

    fn info() -> VxlanInfo {
        VxlanInfo {
            vni: 1,
            port: 8472,
            local: Some(Ipv4Addr::new(192, 168, 1, 10).into()),
            underlay_index: Some(2),
            learning: false,
            gbp: false,
            external: false,
            udp_csum: false,
            udp6_zero_csum_tx: false,
            udp6_zero_csum_rx: false,
        }
    }

    fn spec() -> VxlanSpec {
        let mut spec = VxlanSpec::new("flannel.1", 1);
        spec.local = Some(Ipv4Addr::new(192, 168, 1, 10).into());
        spec.underlay_index = Some(2);
        spec
    }

    #[test]
    fn compatible_device_ignores_mac_mtu_learning_and_unset_fields() {
        let mut existing = info();
        existing.learning = true;
        assert!(spec().incompatibilities(&vxlan_link(existing)).is_empty());
        // Upstream compares the underlay and local address only when both are set, and the port
        // only when one is asked for.
        let mut loose = spec();
        loose.underlay_index = None;
        loose.local = None;
        let mut other = info();
        other.port = 4789;
        assert!(
            loose
                .incompatibilities(&vxlan_link(other.clone()))
                .is_empty()
        );
        loose.port = Some(8472);
        assert_eq!(
            loose.incompatibilities(&vxlan_link(other)),
            vec![Incompatibility::Port {
                want: 8472,
                found: 4789
            }]
        );
    }

    #[test]
    fn every_difference_is_reported() {
        let found = VxlanInfo {
            vni: 2,
            port: 4789,
            local: Some(Ipv4Addr::new(10, 0, 0, 1).into()),
            underlay_index: Some(3),
            gbp: true,
            external: true,
            ..info()
        };
        let mut want = spec();
        want.port = Some(8472);
        let problems = want.incompatibilities(&vxlan_link(found));
        assert_eq!(
            problems,
            vec![
                Incompatibility::Vni { want: 1, found: 2 },
                Incompatibility::UnderlayIndex { want: 2, found: 3 },
                Incompatibility::Local {
                    want: Ipv4Addr::new(192, 168, 1, 10).into(),
                    found: Ipv4Addr::new(10, 0, 0, 1).into()
                },
                Incompatibility::Port {
                    want: 8472,
                    found: 4789
                },
                Incompatibility::Gbp {
                    want: false,
                    found: true
                },
                Incompatibility::External {
                    want: false,
                    found: true
                },
            ]
        );
        assert_eq!(problems[0].to_string(), "VNI 2 instead of 1");
    }

    #[test]
    fn other_kind_is_incompatible() {
        let mut veth = vxlan_link(info());
        veth.kind = Some("veth".into());
        veth.vxlan = None;
        assert_eq!(
            spec().incompatibilities(&veth),
            vec![Incompatibility::Kind {
                found: Some("veth".into())
            }]
        );
        assert_eq!(
            spec().incompatibilities(&veth)[0].to_string(),
            "link type is veth instead of vxlan"
        );
    }

    #[test]
    fn specs_are_validated() {
        assert!(spec().validate().is_ok());
        let mut s = spec();
        s.name = "a-name-that-is-too-long".into();
        assert!(matches!(
            s.validate(),
            Err(NetlinkError::Invalid {
                field: "link name",
                ..
            })
        ));
        let mut s = spec();
        s.vni = 1 << 24;
        assert!(matches!(
            s.validate(),
            Err(NetlinkError::Invalid { field: "vni", .. })
        ));
        let mut s = spec();
        s.vni = 0;
        assert!(s.validate().is_err());
        s.external = true;
        assert!(s.validate().is_ok());
        let mut s = spec();
        s.udp6_zero_csum_tx = true;
        assert!(matches!(
            s.validate(),
            Err(NetlinkError::Invalid {
                field: "udp6_zero_csum",
                ..
            })
        ));
        s.local = Some(
            "fd00::1"
                .parse()
                .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
        );
        assert!(s.validate().is_ok());
        let mut s = spec();
        s.mac = Some([1, 2, 3, 4, 5, 6]);
        assert!(matches!(
            s.validate(),
            Err(NetlinkError::Invalid { field: "mac", .. })
        ));
        for bad in ["", "a/b", "a b", "x:y", ".."] {
            assert!(validate_name("t", bad).is_err(), "{bad:?}");
        }
        assert!(validate_name("flannel-v6.4096", "t").is_ok());
    }

    #[test]
    fn vxlan_message_carries_the_spec() {
        let mut s = spec();
        s.port = Some(4789);
        s.gbp = true;
        s.mtu = Some(1450);
        s.mac = Some([0x0e, 0, 0, 0, 0, 1]);
        let message = s.message();
        let link = link_from_message(&message);
        let link = link.as_ref();
        assert_eq!(link.map(|l| l.name.as_str()), Some("flannel.1"));
        assert_eq!(link.map(|l| l.mtu), Some(1450));
        assert_eq!(link.and_then(|l| l.mac), Some([0x0e, 0, 0, 0, 0, 1]));
        assert_eq!(link.and_then(|l| l.kind.clone()), Some("vxlan".into()));
        let vx = link.and_then(|l| l.vxlan.clone());
        assert_eq!(
            vx,
            Some(VxlanInfo {
                vni: 1,
                port: 4789,
                local: Some(Ipv4Addr::new(192, 168, 1, 10).into()),
                underlay_index: Some(2),
                learning: false,
                gbp: true,
                external: false,
                udp_csum: false,
                udp6_zero_csum_tx: false,
                udp6_zero_csum_rx: false,
            })
        );
    }

    #[test]
    fn ipip_info_is_read() {
        let message = new_link_message(
            "flannel.ipip",
            InfoKind::IpIp,
            Some(InfoData::IpTunnel(vec![
                InfoIpTunnel::Local(Ipv4Addr::new(10, 0, 0, 1).into()),
                InfoIpTunnel::Remote(Ipv4Addr::UNSPECIFIED.into()),
                InfoIpTunnel::Link(0),
            ])),
            None,
            None,
        );
        let link = link_from_message(&message);
        assert_eq!(
            link.and_then(|l| l.ip_tunnel),
            Some(IpTunnelInfo {
                local: Some(Ipv4Addr::new(10, 0, 0, 1).into()),
                remote: None,
                underlay_index: None,
            })
        );
    }
}
