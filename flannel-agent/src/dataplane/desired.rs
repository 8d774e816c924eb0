//! The desired dataplane as a pure function of this node ([`Local`]), the remote leases
//! ([`LeaseSnapshot`]) and what the routing table says ([`Facts`]). No I/O, no logging: what
//! the computation notices comes back as [`Note`]s.
//!
//! Per remote lease and enabled family (upstream 2.0–2.3):
//! * a lease of another `BackendType` is ignored (one note per lease);
//! * vxlan: the peer's VTEP MAC from its BackendData of that family; with `DirectRouting` and
//!   a public IP on a directly connected network, a plain route instead;
//! * host-gw: a plain route when the public IP is directly connected, otherwise no route and
//!   an [`Note::Unreachable`] (upstream installs a route the kernel rejects, and retries);
//! * ipip (IPv4): the tunnel, or with `DirectRouting` a plain route to connected peers;
//! * wireguard (2.4): the peer's public key and `<public IP>:<Port>` from its BackendData of
//!   that family (`Port` 0: the local listen port of that family). In the single-device
//!   modes (`auto`, `ipv4`, `ipv6`) both families of a peer get one key (the IPv6 data's
//!   when present, as upstream) and one endpoint chosen by the mode ([`wireguard_endpoint`]);
//! * ipsec (2.6, IPv4): the peer's public IP.
//! * udp (IPv4): the peer's public IP and this node's `Port`; leases of every `BackendType`
//!   are used, as upstream's udp backend does not filter (its own leases have none).
//! * extension (2.8): no paths; each `extension` lease with its subnets, public IPs and
//!   BackendData (which must be a JSON string) for the backend's commands
//!   ([`Desired::extension`]).
//!
//! Leases are taken in id order. A subnet that overlaps this node's subnet or one taken by an
//! earlier lease is dropped with a [`Note::Overlap`]; a VTEP MAC already used by an earlier
//! lease for another public IP is dropped with a [`Note::DuplicateVtepMac`]. Every node
//! running this code therefore makes the same choice.

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use ipnet::IpNet;

use crate::{
    backend::{BackendOptions, MacAddr, VxlanLeaseData, WireguardLeaseData, WireguardMode},
    lease::Lease,
    netlink::IpFamily,
    subnet::{LeaseId, LeaseSnapshot},
};

use super::{
    facts::{Facts, Reachability},
    model::{
        Desired, ExtensionPeer, IgnoreReason, Local, Note, Peer, PeerPath, Reach, is_unspecified,
    },
};

/// Computes the desired dataplane. See the module documentation for the rules.
pub fn desired(local: &Local, snapshot: &LeaseSnapshot, facts: &Facts) -> Desired {
    if let BackendOptions::Extension(_) = local.backend {
        return extension(local, snapshot);
    }
    let Some(backend) = Backend::of(&local.backend) else {
        // alloc: nothing for this module to program.
        return Desired::default();
    };
    let lease_type = local.backend.backend_type().lease_type();
    let mut out = Desired::default();
    let mut claims = Claims::with_own(local);
    // Ids are borrowed from the snapshot: one is copied only into a note.
    let mut macs: HashMap<(IpFamily, MacAddr), (&LeaseId, IpAddr)> =
        HashMap::with_capacity(snapshot.leases.len());

    for (id, lease) in snapshot.leases.iter() {
        if backend.filters_type() && lease.attrs.backend_type != lease_type {
            out.notes.push(Note::Ignored {
                id: id.clone(),
                reason: IgnoreReason::OtherBackend {
                    found: lease.attrs.backend_type.clone(),
                },
            });
            continue;
        }
        let mut peer = Peer {
            id: id.clone(),
            v4: None,
            v6: None,
        };
        for family in [IpFamily::V4, IpFamily::V6] {
            let Some(own_subnet) = local.own_subnet(family) else {
                continue;
            };
            let Some(subnet) = lease_subnet(lease, family) else {
                continue;
            };
            if family == IpFamily::V6 && backend.ipv4_only() {
                continue;
            }
            let Some(public_ip) = lease_public_ip(lease, family) else {
                out.notes.push(Note::Ignored {
                    id: id.clone(),
                    reason: IgnoreReason::NoPublicIp { family },
                });
                continue;
            };
            // The node's own lease, if a manager ever lets it through: nothing to do.
            if subnet == own_subnet && Some(public_ip) == local.public_ip(family) {
                continue;
            }
            if !claims.take(subnet, id, &mut out.notes) {
                continue;
            }
            let own_ip = local.public_ip(family);
            let reach = match reach_of(backend, lease, family, public_ip, own_ip, facts) {
                Ok(reach) => reach,
                Err(note) => {
                    out.notes.push(note.into_note(id, subnet, public_ip));
                    continue;
                }
            };
            if let Reach::Vxlan {
                vtep_mac,
                public_ip,
                ..
            } = reach
            {
                match macs.get(&(family, vtep_mac)) {
                    Some((winner, ip)) if *ip != public_ip => {
                        out.notes.push(Note::DuplicateVtepMac {
                            id: id.clone(),
                            vtep_mac,
                            winner: (*winner).clone(),
                        });
                        continue;
                    }
                    Some(_) => {}
                    None => {
                        macs.insert((family, vtep_mac), (id, public_ip));
                    }
                }
            }
            let path = Some(PeerPath { subnet, reach });
            match family {
                IpFamily::V4 => peer.v4 = path,
                IpFamily::V6 => peer.v6 = path,
            }
        }
        if let Backend::Wireguard { mode, .. } = backend
            && mode != WireguardMode::Separate
        {
            unify_wireguard(&mut peer, mode, local);
        }
        if peer.v4.is_some() || peer.v6.is_some() {
            out.peers.push(peer);
        }
    }
    out
}

/// The extension backend's leases: those of its type, the own one and overlapping ones left
/// out as for the other backends.
fn extension(local: &Local, snapshot: &LeaseSnapshot) -> Desired {
    let mut out = Desired::default();
    let mut claims = Claims::with_own(local);
    let lease_type = local.backend.backend_type().lease_type();
    'leases: for (id, lease) in snapshot.leases.iter() {
        let ignore = |reason| Note::Ignored {
            id: id.clone(),
            reason,
        };
        if lease.attrs.backend_type != lease_type {
            out.notes.push(ignore(IgnoreReason::OtherBackend {
                found: lease.attrs.backend_type.clone(),
            }));
            continue;
        }
        let data = match lease.attrs.backend_data.as_ref().filter(|d| !d.is_null()) {
            None => String::new(),
            Some(raw) => match serde_json::from_str::<String>(raw.as_str()) {
                Ok(s) => s,
                Err(e) => {
                    out.notes.push(ignore(IgnoreReason::BadBackendData {
                        family: IpFamily::V4,
                        error: format!("not a JSON string: {e}"),
                    }));
                    continue;
                }
            },
        };
        if lease_subnet(lease, IpFamily::V4) == local.own_subnet(IpFamily::V4)
            && Some(IpAddr::V4(lease.attrs.public_ip)) == local.public_ip(IpFamily::V4)
        {
            continue;
        }
        let subnets = [IpFamily::V4, IpFamily::V6].map(|f| lease_subnet(lease, f));
        for subnet in subnets.into_iter().flatten() {
            if !claims.take(subnet, id, &mut out.notes) {
                continue 'leases;
            }
        }
        out.extension.push(ExtensionPeer {
            id: id.clone(),
            subnet: lease.subnet.map(|n| n.trunc()),
            ipv6_subnet: lease.ipv6_subnet.map(|n| n.trunc()),
            public_ip: lease.attrs.public_ip,
            public_ipv6: lease.attrs.public_ipv6,
            data,
        });
    }
    out
}

/// The backends this module programs, with the options that matter here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Vxlan {
        vni: u32,
        direct_routing: bool,
    },
    HostGw,
    Ipip {
        direct_routing: bool,
    },
    Wireguard {
        mode: WireguardMode,
        /// The local listen port used when a peer publishes none, per family.
        port_v4: u16,
        port_v6: u16,
    },
    Ipsec,
    Udp {
        port: u16,
    },
}

impl Backend {
    fn of(options: &BackendOptions) -> Option<Self> {
        match options {
            BackendOptions::Vxlan(o) => Some(Self::Vxlan {
                vni: o.vni,
                direct_routing: o.direct_routing,
            }),
            BackendOptions::HostGw => Some(Self::HostGw),
            BackendOptions::Ipip(o) => Some(Self::Ipip {
                direct_routing: o.direct_routing,
            }),
            BackendOptions::Wireguard(o) => Some(Self::Wireguard {
                mode: o.mode,
                port_v4: o.listen_port,
                port_v6: if o.mode == WireguardMode::Separate {
                    o.listen_port_v6
                } else {
                    o.listen_port
                },
            }),
            BackendOptions::Ipsec(_) => Some(Self::Ipsec),
            BackendOptions::Udp(o) => Some(Self::Udp { port: o.port }),
            _ => None,
        }
    }

    /// Whether leases of other backend types are ignored (all but udp, as upstream).
    fn filters_type(self) -> bool {
        !matches!(self, Self::Udp { .. })
    }

    /// Whether the backend carries IPv4 only.
    fn ipv4_only(self) -> bool {
        matches!(self, Self::Ipip { .. } | Self::Udp { .. } | Self::Ipsec)
    }
}

/// Why a path could not be built (turned into a [`Note`] by the caller).
enum NoPath {
    Data(String),
    Unreachable(Reachability),
}

impl NoPath {
    fn into_note(self, id: &LeaseId, subnet: IpNet, public_ip: IpAddr) -> Note {
        match self {
            Self::Data(error) => Note::Ignored {
                id: id.clone(),
                reason: IgnoreReason::BadBackendData {
                    family: IpFamily::of(&subnet.addr()),
                    error,
                },
            },
            Self::Unreachable(why) => Note::Unreachable {
                id: id.clone(),
                subnet,
                public_ip,
                why,
            },
        }
    }
}

/// How the public IP of a peer is reached, with this node's own address never "direct".
fn direct_oif(facts: &Facts, public_ip: IpAddr, own_ip: Option<IpAddr>) -> Reachability {
    if Some(public_ip) == own_ip {
        return Reachability::Local;
    }
    facts.reach(public_ip)
}

fn reach_of(
    backend: Backend,
    lease: &Lease,
    family: IpFamily,
    public_ip: IpAddr,
    own_ip: Option<IpAddr>,
    facts: &Facts,
) -> Result<Reach, NoPath> {
    match backend {
        Backend::Vxlan {
            vni,
            direct_routing,
        } => {
            let raw = match family {
                IpFamily::V4 => lease.attrs.backend_data.as_ref(),
                IpFamily::V6 => lease.attrs.backend_v6_data.as_ref(),
            };
            let data = raw
                .ok_or_else(|| NoPath::Data("no BackendData".into()))
                .and_then(|raw| {
                    VxlanLeaseData::from_json(raw).map_err(|e| NoPath::Data(e.to_string()))
                })?;
            if direct_routing && let Some(oif) = direct_oif(facts, public_ip, own_ip).direct_oif() {
                return Ok(Reach::Direct {
                    gateway: public_ip,
                    oif,
                });
            }
            Ok(Reach::Vxlan {
                vtep_mac: data.vtep_mac,
                vni: if data.vni == 0 { vni } else { data.vni },
                public_ip,
            })
        }
        Backend::HostGw => match direct_oif(facts, public_ip, own_ip) {
            Reachability::Direct { oif } => Ok(Reach::Direct {
                gateway: public_ip,
                oif,
            }),
            other => Err(NoPath::Unreachable(other)),
        },
        Backend::Ipip { direct_routing } => {
            let IpAddr::V4(v4) = public_ip else {
                return Err(NoPath::Data("ipip carries IPv4 only".into()));
            };
            if direct_routing && let Some(oif) = direct_oif(facts, public_ip, own_ip).direct_oif() {
                return Ok(Reach::Direct {
                    gateway: public_ip,
                    oif,
                });
            }
            let next_hop = match direct_oif(facts, public_ip, own_ip) {
                Reachability::Direct { .. } => Some(public_ip),
                Reachability::Gateway { gateway } => Some(gateway),
                _ => None,
            };
            Ok(Reach::Ipip {
                public_ip: v4,
                next_hop,
            })
        }
        Backend::Wireguard {
            port_v4, port_v6, ..
        } => {
            let raw = match family {
                IpFamily::V4 => lease.attrs.backend_data.as_ref(),
                IpFamily::V6 => lease.attrs.backend_v6_data.as_ref(),
            };
            let data = raw
                .ok_or_else(|| NoPath::Data("no BackendData".into()))
                .and_then(|raw| {
                    WireguardLeaseData::from_json(raw).map_err(|e| NoPath::Data(e.to_string()))
                })?;
            let port = match (data.port, family) {
                (0, IpFamily::V4) => port_v4,
                (0, IpFamily::V6) => port_v6,
                (p, _) => p,
            };
            Ok(Reach::Wireguard {
                public_key: data.public_key,
                endpoint: SocketAddr::new(public_ip, port),
            })
        }
        Backend::Ipsec => {
            let IpAddr::V4(v4) = public_ip else {
                return Err(NoPath::Data("ipsec carries IPv4 only".into()));
            };
            Ok(Reach::Ipsec { public_ip: v4 })
        }
        Backend::Udp { port } => match public_ip {
            IpAddr::V4(public_ip) => Ok(Reach::Udp { public_ip, port }),
            IpAddr::V6(_) => Err(NoPath::Data("udp carries IPv4 only".into())),
        },
    }
}

/// Single-device WireGuard modes: one peer carries both families, so both paths get one key
/// (the IPv6 data's when there is one, as upstream) and one endpoint.
fn unify_wireguard(peer: &mut Peer, mode: WireguardMode, local: &Local) {
    let parts = |p: &Option<PeerPath>| match p.as_ref().map(|p| p.reach) {
        Some(Reach::Wireguard {
            public_key,
            endpoint,
        }) => Some((public_key, endpoint)),
        _ => None,
    };
    let (v4, v6) = (parts(&peer.v4), parts(&peer.v6));
    let Some(public_key) = v6.or(v4).map(|(k, _)| k) else {
        return;
    };
    let Some(endpoint) = wireguard_endpoint(
        mode,
        v4.map(|(_, e)| e),
        v6.map(|(_, e)| e),
        local.ext.ext_addr,
        local.ext.ext_v6_addr,
    ) else {
        return;
    };
    for path in [&mut peer.v4, &mut peer.v6].into_iter().flatten() {
        path.reach = Reach::Wireguard {
            public_key,
            endpoint,
        };
    }
}

/// The endpoint of a peer in the single-device modes (upstream 2.4): `ipv4` / `ipv6` take
/// that family (the other one when the peer has only that); `auto` takes IPv4 when the peer
/// has no IPv6 endpoint, or when its IPv4 address is public (not RFC 1918) and this node has
/// an IPv4 public address; else IPv6 when the peer's IPv6 address is not a ULA (fc00::/7) and
/// this node has a non-ULA IPv6 public address; else IPv4.
pub fn wireguard_endpoint(
    mode: WireguardMode,
    v4: Option<SocketAddr>,
    v6: Option<SocketAddr>,
    own_v4: Option<Ipv4Addr>,
    own_v6: Option<Ipv6Addr>,
) -> Option<SocketAddr> {
    match mode {
        WireguardMode::Ipv4 | WireguardMode::Separate => v4.or(v6),
        WireguardMode::Ipv6 => v6.or(v4),
        WireguardMode::Auto => {
            let (Some(e4), Some(e6)) = (v4, v6) else {
                return v4.or(v6);
            };
            let public_v4 = match e4.ip() {
                IpAddr::V4(a) => !a.is_private(),
                IpAddr::V6(_) => false,
            };
            if public_v4 && own_v4.is_some() {
                return Some(e4);
            }
            let ula = |a: &Ipv6Addr| (a.segments()[0] & 0xfe00) == 0xfc00;
            let global_v6 = match e6.ip() {
                IpAddr::V6(a) => !ula(&a),
                IpAddr::V4(_) => false,
            };
            if global_v6 && own_v6.is_some_and(|a| !ula(&a)) {
                Some(e6)
            } else {
                Some(e4)
            }
        }
    }
}

fn lease_subnet(lease: &Lease, family: IpFamily) -> Option<IpNet> {
    match family {
        IpFamily::V4 => lease.subnet.map(|n| IpNet::V4(n.trunc())),
        IpFamily::V6 => lease.ipv6_subnet.map(|n| IpNet::V6(n.trunc())),
    }
}

fn lease_public_ip(lease: &Lease, family: IpFamily) -> Option<IpAddr> {
    let ip = match family {
        IpFamily::V4 => Some(IpAddr::V4(lease.attrs.public_ip)),
        IpFamily::V6 => lease.attrs.public_ipv6.map(IpAddr::V6),
    }?;
    (!is_unspecified(ip)).then_some(ip)
}

/// Subnets already taken, per family, as non-overlapping `[start, end]` ranges, with the id
/// of the lease that took each (borrowed from the snapshot; `None` for the node's own).
#[derive(Default)]
struct Claims<'a> {
    v4: ClaimTable<'a>,
    v6: ClaimTable<'a>,
}

type ClaimTable<'a> = BTreeMap<u128, (u128, Option<&'a LeaseId>, IpNet)>;

type Winner = (Option<LeaseId>, IpNet);

fn span(net: IpNet) -> (u128, u128) {
    match net {
        IpNet::V4(n) => (
            u128::from(u32::from(n.network())),
            u128::from(u32::from(n.broadcast())),
        ),
        IpNet::V6(n) => (u128::from(n.network()), u128::from(n.broadcast())),
    }
}

impl<'a> Claims<'a> {
    fn table(&mut self, net: IpNet) -> &mut ClaimTable<'a> {
        match net {
            IpNet::V4(_) => &mut self.v4,
            IpNet::V6(_) => &mut self.v6,
        }
    }

    /// The claims of a node: its own subnets taken.
    fn with_own(local: &Local) -> Self {
        let mut claims = Claims::default();
        for family in [IpFamily::V4, IpFamily::V6] {
            if let Some(own) = local.own_subnet(family) {
                claims.own(own);
            }
        }
        claims
    }

    /// [`claim`](Self::claim), an overlap noted in `notes`: whether `id` got `net`.
    fn take(&mut self, net: IpNet, id: &'a LeaseId, notes: &mut Vec<Note>) -> bool {
        match self.claim(net, id) {
            Ok(()) => true,
            Err(winner) => {
                notes.push(Note::Overlap {
                    id: id.clone(),
                    subnet: net,
                    winner: winner.0,
                    winner_subnet: winner.1,
                });
                false
            }
        }
    }

    fn own(&mut self, net: IpNet) {
        let (start, end) = span(net);
        self.table(net).insert(start, (end, None, net));
    }

    /// Takes `net` for `id`, or names who already holds an overlapping subnet: the claim
    /// that holds its first address, else the first claim after that address.
    fn claim(&mut self, net: IpNet, id: &'a LeaseId) -> Result<(), Winner> {
        let (start, end) = span(net);
        let table = self.table(net);
        // The claims are disjoint, so the one starting last at or before `end` also ends
        // last: `net` is free if that one ends before `start` (one search, the common case).
        let Some(last) = table
            .range(..=end)
            .next_back()
            .filter(|(_, (e, _, _))| *e >= start)
        else {
            table.insert(start, (end, Some(id), net));
            return Ok(());
        };
        let (_, (_, who, n)) = table
            .range(..=start)
            .next_back()
            .filter(|(_, (e, _, _))| *e >= start)
            .or_else(|| table.range(start..=end).next())
            .unwrap_or(last);
        Err((who.cloned(), *n))
    }
}

#[cfg(test)]
mod claim_tests {
    use rand::{Rng as _, SeedableRng as _, rngs::StdRng};

    use super::*;

    /// The claim as it was before its one-search shortcut: the claim holding the first
    /// address, else the first one starting within the subnet, else taken.
    fn claim_by_two_searches<'a>(
        table: &mut ClaimTable<'a>,
        net: IpNet,
        id: &'a LeaseId,
    ) -> Result<(), Winner> {
        let (start, end) = span(net);
        if let Some((_, (e, who, n))) = table.range(..=start).next_back()
            && *e >= start
        {
            return Err((who.cloned(), *n));
        }
        if let Some((s, (_, who, n))) = table.range(start..).next()
            && *s <= end
        {
            return Err((who.cloned(), *n));
        }
        table.insert(start, (end, Some(id), net));
        Ok(())
    }

    /// On random runs of overlapping and disjoint subnets, the same subnets are taken and the
    /// same claims named.
    #[test]
    fn one_search_claims_as_two_did() {
        let mut rng = StdRng::seed_from_u64(29);
        let ids: Vec<LeaseId> = (0..40).map(|i| format!("lease-{i}")).collect();
        let mut refused = 0;
        for _ in 0..500 {
            let (mut claims, mut reference) = (Claims::default(), ClaimTable::default());
            for id in &ids {
                let len = rng.random_range(18..=26);
                let addr = std::net::Ipv4Addr::from(0x0a00_0000 | rng.random_range(0..0x4000u32));
                let net = IpNet::V4(ipnet::Ipv4Net::new(addr, len).expect("prefix").trunc());
                let got = claims.claim(net, id);
                refused += usize::from(got.is_err());
                assert_eq!(got, claim_by_two_searches(&mut reference, net, id), "{net}");
            }
            assert_eq!(claims.v4, reference);
        }
        assert!(refused > 1_000, "the runs seldom overlap: {refused}");
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::{
        collections::BTreeMap,
        net::{Ipv4Addr, Ipv6Addr},
        sync::Arc,
    };

    use super::*;
    use crate::{
        backend::{IpipOptions, MtuPlan, VxlanOptions},
        gojson::RawJson,
        iface::ExternalInterface,
        ip::IpStack,
        lease::{LeaseAttrs, SubnetKey},
        netlink::{Route, RouteScope},
    };

    use super::super::{facts::RouteIndex, model::VtepMacs};

    const EXT_INDEX: u32 = 2;

    pub(crate) fn mac(last: u8) -> MacAddr {
        MacAddr([0x0e, 0x2a, 0, 0, 0, last])
    }

    fn vxlan_data(m: MacAddr) -> RawJson {
        VxlanLeaseData {
            vni: 1,
            vtep_mac: m,
        }
        .to_json()
    }

    pub(crate) fn local(backend: BackendOptions, stack: IpStack) -> Local {
        let lease = Lease::new(
            SubnetKey::parse("10.244.1.0-24&fd00:244:1::-64").unwrap(),
            LeaseAttrs::default(),
            None,
        );
        let ext = ExternalInterface {
            name: "eth0".into(),
            index: EXT_INDEX,
            mtu: 1500,
            iface_addr: Some(Ipv4Addr::new(192, 168, 10, 1)),
            iface_v6_addr: Some("fd00:10::1".parse().unwrap()),
            ext_addr: Some(Ipv4Addr::new(192, 168, 10, 1)),
            ext_v6_addr: Some("fd00:10::1".parse().unwrap()),
        };
        Local::new(
            lease,
            stack,
            Some("10.244.0.0/16".parse().unwrap()),
            Some("fd00:244::/48".parse().unwrap()),
            backend,
            ext,
            MtuPlan {
                device_v4: Some(1450),
                device_v6: Some(1430),
                flannel_mtu: 1430,
            },
            VtepMacs {
                v4: Some(mac(1)),
                v6: Some(mac(0x61)),
            },
        )
    }

    pub(crate) fn vxlan(direct_routing: bool) -> BackendOptions {
        BackendOptions::Vxlan(VxlanOptions {
            direct_routing,
            ..VxlanOptions::default()
        })
    }

    fn lease(key: &str, backend: &str, ip: [u8; 4]) -> Lease {
        let attrs = LeaseAttrs {
            public_ip: Ipv4Addr::from(ip),
            backend_type: backend.into(),
            ..LeaseAttrs::default()
        };
        Lease::new(SubnetKey::parse(key).unwrap(), attrs, None)
    }

    pub(crate) fn vx_lease(key: &str, ip: [u8; 4], m: MacAddr) -> Lease {
        let mut l = lease(key, "vxlan", ip);
        l.attrs.backend_data = Some(vxlan_data(m));
        l
    }

    pub(crate) fn snapshot(leases: Vec<(&str, Lease)>) -> LeaseSnapshot {
        LeaseSnapshot {
            generation: 1,
            synced: true,
            leases: Arc::new(
                leases
                    .into_iter()
                    .map(|(id, l)| (id.to_owned(), l))
                    .collect::<BTreeMap<_, _>>(),
            ),
        }
    }

    /// The underlay: 192.168.10.0/24 and fd00:10::/64 connected on eth0, everything else via
    /// a router.
    pub(crate) fn facts() -> Facts {
        let routes = vec![
            Route::new("192.168.10.0/24".parse().unwrap())
                .dev(EXT_INDEX)
                .scope(RouteScope::Link)
                .protocol(2),
            Route::new("0.0.0.0/0".parse().unwrap())
                .via("192.168.10.254".parse().unwrap())
                .dev(EXT_INDEX)
                .protocol(3),
            Route::new("fd00:10::/64".parse().unwrap())
                .dev(EXT_INDEX)
                .protocol(2),
        ];
        Facts::from_index(RouteIndex::new(&routes, |_| false))
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn vxlan_peers_use_their_vtep_mac() {
        let local = local(vxlan(false), IpStack::V4);
        let snap = snapshot(vec![
            (
                "10.244.2.0-24",
                vx_lease("10.244.2.0-24", [192, 168, 10, 2], mac(2)),
            ),
            (
                "10.244.3.0-24",
                vx_lease("10.244.3.0-24", [192, 168, 20, 3], mac(3)),
            ),
        ]);
        let d = desired(&local, &snap, &facts());
        assert_eq!(d.notes, vec![]);
        assert_eq!(
            d.peers,
            vec![
                Peer {
                    id: "10.244.2.0-24".into(),
                    v4: Some(PeerPath {
                        subnet: net("10.244.2.0/24"),
                        reach: Reach::Vxlan {
                            vtep_mac: mac(2),
                            vni: 1,
                            public_ip: ip("192.168.10.2"),
                        },
                    }),
                    v6: None,
                },
                Peer {
                    id: "10.244.3.0-24".into(),
                    v4: Some(PeerPath {
                        subnet: net("10.244.3.0/24"),
                        reach: Reach::Vxlan {
                            vtep_mac: mac(3),
                            vni: 1,
                            public_ip: ip("192.168.20.3"),
                        },
                    }),
                    v6: None,
                },
            ]
        );
    }

    #[test]
    fn direct_routing_only_for_connected_peers() {
        let local = local(vxlan(true), IpStack::V4);
        let snap = snapshot(vec![
            (
                "10.244.2.0-24",
                vx_lease("10.244.2.0-24", [192, 168, 10, 2], mac(2)),
            ),
            (
                "10.244.3.0-24",
                vx_lease("10.244.3.0-24", [192, 168, 20, 3], mac(3)),
            ),
        ]);
        let d = desired(&local, &snap, &facts());
        let reaches: Vec<Reach> = d.paths().map(|(_, p)| p.reach).collect();
        assert_eq!(
            reaches,
            vec![
                Reach::Direct {
                    gateway: ip("192.168.10.2"),
                    oif: EXT_INDEX
                },
                Reach::Vxlan {
                    vtep_mac: mac(3),
                    vni: 1,
                    public_ip: ip("192.168.20.3")
                },
            ]
        );
        // Without facts nothing is known to be direct: everything goes through vxlan.
        let d = desired(&local, &snap, &Facts::none());
        assert!(
            d.paths()
                .all(|(_, p)| matches!(p.reach, Reach::Vxlan { .. }))
        );
    }

    #[test]
    fn dual_stack_vxlan_uses_each_familys_data() {
        let local = local(vxlan(false), IpStack::Dual);
        let mut l = vx_lease("10.244.2.0-24&fd00:244:2::-64", [192, 168, 10, 2], mac(2));
        l.attrs.public_ipv6 = Some("fd00:10::2".parse::<Ipv6Addr>().unwrap());
        l.attrs.backend_v6_data = Some(vxlan_data(mac(0x62)));
        // A v4-only peer in a dual-stack cluster gets a v4 path only.
        let v4only = vx_lease("10.244.3.0-24", [192, 168, 10, 3], mac(3));
        // A peer with a v6 subnet but no v6 data: v4 works, v6 is reported.
        let mut nov6 = vx_lease("10.244.4.0-24&fd00:244:4::-64", [192, 168, 10, 4], mac(4));
        nov6.attrs.public_ipv6 = Some("fd00:10::4".parse::<Ipv6Addr>().unwrap());
        let snap = snapshot(vec![("a", l), ("b", v4only), ("c", nov6)]);
        let d = desired(&local, &snap, &facts());
        assert_eq!(d.peers.len(), 3);
        assert_eq!(
            d.peers[0].v6,
            Some(PeerPath {
                subnet: net("fd00:244:2::/64"),
                reach: Reach::Vxlan {
                    vtep_mac: mac(0x62),
                    vni: 1,
                    public_ip: ip("fd00:10::2"),
                },
            })
        );
        assert!(d.peers[1].v4.is_some() && d.peers[1].v6.is_none());
        assert!(d.peers[2].v4.is_some() && d.peers[2].v6.is_none());
        assert!(matches!(
            &d.notes[..],
            [Note::Ignored {
                id,
                reason: IgnoreReason::BadBackendData {
                    family: IpFamily::V6,
                    ..
                },
            }] if id == "c"
        ));
        // With IPv6 disabled locally the v6 halves are not considered at all.
        let local = super::super::model::Local {
            stack: IpStack::V4,
            ..local
        };
        let d = desired(&local, &snap, &facts());
        assert!(d.peers.iter().all(|p| p.v6.is_none()));
        assert!(d.notes.is_empty());
    }

    #[test]
    fn host_gw_routes_connected_peers_and_reports_the_others() {
        let local = local(BackendOptions::HostGw, IpStack::V4);
        let snap = snapshot(vec![
            (
                "10.244.2.0-24",
                lease("10.244.2.0-24", "host-gw", [192, 168, 10, 2]),
            ),
            (
                "10.244.3.0-24",
                lease("10.244.3.0-24", "host-gw", [192, 168, 20, 3]),
            ),
        ]);
        let d = desired(&local, &snap, &facts());
        assert_eq!(
            d.peers,
            vec![Peer {
                id: "10.244.2.0-24".into(),
                v4: Some(PeerPath {
                    subnet: net("10.244.2.0/24"),
                    reach: Reach::Direct {
                        gateway: ip("192.168.10.2"),
                        oif: EXT_INDEX,
                    },
                }),
                v6: None,
            }]
        );
        assert_eq!(
            d.notes,
            vec![Note::Unreachable {
                id: "10.244.3.0-24".into(),
                subnet: net("10.244.3.0/24"),
                public_ip: ip("192.168.20.3"),
                why: Reachability::Gateway {
                    gateway: ip("192.168.10.254")
                },
            }]
        );
        assert_eq!(d.unreachable(), 1);
        let text = d.notes[0].to_string();
        assert!(
            text.contains("192.168.20.3") && text.contains("10.244.3.0/24"),
            "{text}"
        );
        // No facts at all: nothing is known to be reachable, nothing is routed.
        let d = desired(&local, &snap, &Facts::none());
        assert!(d.peers.is_empty());
        assert_eq!(d.unreachable(), 2);
    }

    #[test]
    fn ipip_tunnels_unless_direct() {
        let local = local(
            BackendOptions::Ipip(IpipOptions {
                direct_routing: true,
            }),
            IpStack::V4,
        );
        let snap = snapshot(vec![
            (
                "10.244.2.0-24",
                lease("10.244.2.0-24", "ipip", [192, 168, 10, 2]),
            ),
            (
                "10.244.3.0-24",
                lease("10.244.3.0-24", "ipip", [192, 168, 20, 3]),
            ),
        ]);
        let d = desired(&local, &snap, &facts());
        let reaches: Vec<Reach> = d.paths().map(|(_, p)| p.reach).collect();
        assert_eq!(
            reaches,
            vec![
                Reach::Direct {
                    gateway: ip("192.168.10.2"),
                    oif: EXT_INDEX
                },
                Reach::Ipip {
                    public_ip: Ipv4Addr::new(192, 168, 20, 3),
                    // Behind the default gateway: that is the underlay next hop.
                    next_hop: Some(ip("192.168.10.254")),
                },
            ]
        );
    }

    #[test]
    fn udp_takes_every_lease_over_ipv4_with_our_port() {
        let local = local(
            BackendOptions::Udp(crate::backend::UdpOptions { port: 9000 }),
            IpStack::Dual,
        );
        let mut v6 = lease("10.244.4.0-24&fd00:244:4::-64", "", [192, 168, 10, 4]);
        v6.attrs.public_ipv6 = Some("fd00:10::4".parse::<Ipv6Addr>().unwrap());
        let snap = snapshot(vec![
            // udp leases have no BackendType; upstream's udp backend filters nothing.
            ("a", lease("10.244.2.0-24", "", [192, 168, 10, 2])),
            ("b", lease("10.244.3.0-24", "vxlan", [192, 168, 20, 3])),
            ("c", v6),
        ]);
        let d = desired(&local, &snap, &Facts::none());
        assert_eq!(d.notes, vec![]);
        let reaches: Vec<(IpNet, Reach)> = d.paths().map(|(_, p)| (p.subnet, p.reach)).collect();
        assert_eq!(
            reaches,
            vec![
                (
                    net("10.244.2.0/24"),
                    Reach::Udp {
                        public_ip: Ipv4Addr::new(192, 168, 10, 2),
                        port: 9000
                    }
                ),
                (
                    net("10.244.3.0/24"),
                    Reach::Udp {
                        public_ip: Ipv4Addr::new(192, 168, 20, 3),
                        port: 9000
                    }
                ),
                (
                    net("10.244.4.0/24"),
                    Reach::Udp {
                        public_ip: Ipv4Addr::new(192, 168, 10, 4),
                        port: 9000
                    }
                ),
            ],
            "IPv4 only, even for dual-stack leases"
        );
        assert_eq!(
            d.peers[0].v4.map(|p| p.reach.to_string()),
            Some("udp 192.168.10.2:9000".into())
        );
    }

    #[test]
    fn leases_of_other_backends_are_ignored_with_a_note_each() {
        let local = local(vxlan(false), IpStack::V4);
        let snap = snapshot(vec![
            (
                "10.244.2.0-24",
                lease("10.244.2.0-24", "host-gw", [192, 168, 10, 2]),
            ),
            (
                "10.244.3.0-24",
                lease("10.244.3.0-24", "", [192, 168, 10, 3]),
            ),
            (
                "10.244.4.0-24",
                vx_lease("10.244.4.0-24", [192, 168, 10, 4], mac(4)),
            ),
        ]);
        let d = desired(&local, &snap, &facts());
        assert_eq!(d.peers.len(), 1);
        assert_eq!(d.peers[0].id, "10.244.4.0-24");
        assert_eq!(
            d.notes,
            vec![
                Note::Ignored {
                    id: "10.244.2.0-24".into(),
                    reason: IgnoreReason::OtherBackend {
                        found: "host-gw".into()
                    },
                },
                Note::Ignored {
                    id: "10.244.3.0-24".into(),
                    reason: IgnoreReason::OtherBackend { found: "".into() },
                },
            ]
        );
        assert!(!d.notes[0].is_warning());
        assert_eq!(
            d.notes[1].to_string(),
            "ignoring lease 10.244.3.0-24: its backend type is (none)"
        );
    }

    #[test]
    fn malformed_vxlan_data_and_missing_public_ip_are_reported() {
        let local = local(vxlan(false), IpStack::V4);
        let mut bad = lease("10.244.2.0-24", "vxlan", [192, 168, 10, 2]);
        bad.attrs.backend_data = Some(RawJson::from_json(r#"{"VtepMAC":"zz"}"#).unwrap());
        let nodata = lease("10.244.3.0-24", "vxlan", [192, 168, 10, 3]);
        let noip = vx_lease("10.244.4.0-24", [0, 0, 0, 0], mac(4));
        let snap = snapshot(vec![("a", bad), ("b", nodata), ("c", noip)]);
        let d = desired(&local, &snap, &facts());
        assert!(d.peers.is_empty());
        assert_eq!(d.ignored(), 3);
        assert!(matches!(
            &d.notes[2],
            Note::Ignored {
                reason: IgnoreReason::NoPublicIp {
                    family: IpFamily::V4
                },
                ..
            }
        ));
        assert!(
            d.notes[0].to_string().contains("invalid MAC"),
            "{}",
            d.notes[0]
        );
    }

    #[test]
    fn overlapping_leases_first_id_wins() {
        let local = local(vxlan(false), IpStack::V4);
        let snap = snapshot(vec![
            // Same subnet claimed twice (kube: two Node objects with one podCIDR).
            (
                "node/a",
                vx_lease("10.244.2.0-24", [192, 168, 10, 2], mac(2)),
            ),
            (
                "node/b",
                vx_lease("10.244.2.0-24", [192, 168, 10, 3], mac(3)),
            ),
            // A wider subnet covering one already taken.
            (
                "node/c",
                vx_lease("10.244.0.0-22", [192, 168, 10, 4], mac(4)),
            ),
            // A subnet inside this node's own.
            (
                "node/d",
                vx_lease("10.244.1.128-25", [192, 168, 10, 5], mac(5)),
            ),
            // Adjacent but not overlapping: fine.
            (
                "node/e",
                vx_lease("10.244.3.0-24", [192, 168, 10, 6], mac(6)),
            ),
        ]);
        let d = desired(&local, &snap, &facts());
        let ids: Vec<&str> = d.peers.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["node/a", "node/e"]);
        assert_eq!(
            d.notes,
            vec![
                Note::Overlap {
                    id: "node/b".into(),
                    subnet: net("10.244.2.0/24"),
                    winner: Some("node/a".into()),
                    winner_subnet: net("10.244.2.0/24"),
                },
                Note::Overlap {
                    id: "node/c".into(),
                    subnet: net("10.244.0.0/22"),
                    winner: None,
                    winner_subnet: net("10.244.1.0/24"),
                },
                Note::Overlap {
                    id: "node/d".into(),
                    subnet: net("10.244.1.128/25"),
                    winner: None,
                    winner_subnet: net("10.244.1.0/24"),
                },
            ]
        );
        assert_eq!(d.conflicts(), 3);
        // The choice does not depend on anything but the ids.
        let again = desired(&local, &snap, &facts());
        assert_eq!(again, d);
    }

    #[test]
    fn own_lease_is_skipped_silently_but_a_stranger_on_our_subnet_is_not() {
        let local = local(vxlan(false), IpStack::V4);
        let own = vx_lease("10.244.1.0-24", [192, 168, 10, 1], mac(1));
        let stranger = vx_lease("10.244.1.0-24", [192, 168, 10, 9], mac(9));
        let d = desired(&local, &snapshot(vec![("10.244.1.0-24", own)]), &facts());
        assert_eq!(d, Desired::default());
        let d = desired(&local, &snapshot(vec![("node/x", stranger)]), &facts());
        assert!(d.peers.is_empty());
        assert!(matches!(&d.notes[..], [Note::Overlap { winner: None, .. }]));
        // No leases at all (a single-node cluster): nothing desired.
        assert_eq!(
            desired(&local, &snapshot(vec![]), &facts()),
            Desired::default()
        );
    }

    #[test]
    fn a_vtep_mac_claimed_for_two_public_ips_goes_to_the_first() {
        let local = local(vxlan(false), IpStack::V4);
        let snap = snapshot(vec![
            (
                "10.244.2.0-24",
                vx_lease("10.244.2.0-24", [192, 168, 10, 2], mac(2)),
            ),
            // Same node re-registered with a second subnet: same MAC and IP, both fine.
            (
                "10.244.5.0-24",
                vx_lease("10.244.5.0-24", [192, 168, 10, 2], mac(2)),
            ),
            // Another node with a copied MAC.
            (
                "10.244.3.0-24",
                vx_lease("10.244.3.0-24", [192, 168, 10, 3], mac(2)),
            ),
        ]);
        let d = desired(&local, &snap, &facts());
        let ids: Vec<&str> = d.peers.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["10.244.2.0-24", "10.244.5.0-24"]);
        assert_eq!(
            d.notes,
            vec![Note::DuplicateVtepMac {
                id: "10.244.3.0-24".into(),
                vtep_mac: mac(2),
                winner: "10.244.2.0-24".into(),
            }]
        );
    }

    #[test]
    fn peer_vni_defaults_to_ours() {
        let local = local(
            BackendOptions::Vxlan(VxlanOptions {
                vni: 7,
                ..VxlanOptions::default()
            }),
            IpStack::V4,
        );
        let mut l = lease("10.244.2.0-24", "vxlan", [192, 168, 10, 2]);
        l.attrs.backend_data =
            Some(RawJson::from_json(r#"{"VtepMAC":"0e:2a:00:00:00:02"}"#).unwrap());
        let d = desired(&local, &snapshot(vec![("x", l)]), &facts());
        assert!(matches!(
            d.peers[0].v4.map(|p| p.reach),
            Some(Reach::Vxlan { vni: 7, .. })
        ));
    }

    #[test]
    fn backends_without_kernel_routes_desire_nothing() {
        let local = local(BackendOptions::Alloc, IpStack::V4);
        let snap = snapshot(vec![("a", lease("10.244.2.0-24", "", [192, 168, 10, 2]))]);
        assert_eq!(desired(&local, &snap, &facts()), Desired::default());
    }

    #[test]
    fn extension_leases_are_handed_to_its_commands() {
        let local = local(
            BackendOptions::Extension(crate::backend::ExtensionOptions::default()),
            IpStack::Dual,
        );
        let mut with_data = lease(
            "10.244.2.0-24&fd00:244:2::-64",
            "extension",
            [192, 168, 10, 2],
        );
        with_data.attrs.backend_data =
            Some(RawJson::from_json(r#""aa:bb \u003cx\u003e""#).unwrap());
        with_data.attrs.public_ipv6 = Some("fd00:10::2".parse().unwrap());
        let plain = lease("10.244.3.0-24", "extension", [192, 168, 10, 3]);
        let mut not_a_string = lease("10.244.4.0-24", "extension", [192, 168, 10, 4]);
        not_a_string.attrs.backend_data = Some(RawJson::from_json(r#"{"VtepMAC":"x"}"#).unwrap());
        let overlapping = lease("10.244.2.128-25", "extension", [192, 168, 10, 5]);
        let own = lease("10.244.1.0-24", "extension", [192, 168, 10, 1]);
        let snap = snapshot(vec![
            ("a", with_data),
            ("b", plain),
            ("c", not_a_string),
            ("d", overlapping),
            ("e", own),
            ("f", lease("10.244.6.0-24", "vxlan", [192, 168, 10, 6])),
        ]);
        let d = desired(&local, &snap, &facts());
        assert!(d.peers.is_empty());
        assert_eq!(
            d.extension,
            vec![
                ExtensionPeer {
                    id: "a".into(),
                    subnet: Some("10.244.2.0/24".parse().unwrap()),
                    ipv6_subnet: Some("fd00:244:2::/64".parse().unwrap()),
                    public_ip: Ipv4Addr::new(192, 168, 10, 2),
                    public_ipv6: Some("fd00:10::2".parse().unwrap()),
                    data: "aa:bb <x>".into(),
                },
                ExtensionPeer {
                    id: "b".into(),
                    subnet: Some("10.244.3.0/24".parse().unwrap()),
                    ipv6_subnet: None,
                    public_ip: Ipv4Addr::new(192, 168, 10, 3),
                    public_ipv6: None,
                    data: String::new(),
                },
            ]
        );
        let notes: Vec<String> = d.notes.iter().map(|n| format!("{n:?}")).collect();
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert!(
            matches!(&d.notes[0], Note::Ignored { id, reason: IgnoreReason::BadBackendData { .. } } if id == "c")
        );
        assert!(matches!(&d.notes[1], Note::Overlap { id, .. } if id == "d"));
        assert!(
            matches!(&d.notes[2], Note::Ignored { id, reason: IgnoreReason::OtherBackend { found } } if id == "f" && found == "vxlan")
        );
    }

    #[test]
    fn five_thousand_peers_are_quick() {
        let local = local(vxlan(true), IpStack::V4);
        let mut leases = Vec::new();
        let keys: Vec<String> = (0..5000u32)
            .map(|i| format!("10.{}.{}.0-24", 100 + i / 256, i % 256))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            let i = i as u32;
            let m = MacAddr([0x0e, 0x2b, 0, 0, (i >> 8) as u8, i as u8]);
            leases.push((
                key.as_str(),
                vx_lease(key, [192, 168, 10 + (i % 2) as u8, (i % 250) as u8 + 2], m),
            ));
        }
        let snap = snapshot(leases);
        let start = std::time::Instant::now();
        let d = desired(&local, &snap, &facts());
        let took = start.elapsed();
        assert_eq!(d.peers.len(), 5000);
        let direct = d
            .paths()
            .filter(|(_, p)| matches!(p.reach, Reach::Direct { .. }))
            .count();
        assert_eq!(direct, 2500);
        assert!(took < std::time::Duration::from_secs(2), "{took:?}");
    }

    fn wg_opts(mode: WireguardMode) -> BackendOptions {
        BackendOptions::Wireguard(crate::backend::WireguardOptions {
            mode,
            ..Default::default()
        })
    }

    fn wg_key(b: u8) -> crate::backend::WgKey {
        crate::backend::WgKey([b; 32])
    }

    fn wg_data(b: u8, port: u16) -> RawJson {
        WireguardLeaseData {
            public_key: wg_key(b),
            port,
        }
        .to_json()
    }

    /// A dual-stack wireguard lease: v4 key `b`, v6 key `b + 0x40`.
    fn wg_lease(key: &str, ip: [u8; 4], ip6: Option<&str>, b: u8, port: u16) -> Lease {
        let mut l = lease(key, "wireguard", ip);
        l.attrs.backend_data = Some(wg_data(b, port));
        if let Some(ip6) = ip6 {
            l.attrs.public_ipv6 = Some(ip6.parse().unwrap());
            l.attrs.backend_v6_data = Some(wg_data(b + 0x40, port + 1));
        }
        l
    }

    #[test]
    fn wireguard_separate_mode_uses_each_familys_key_and_port() {
        let local = local(wg_opts(WireguardMode::Separate), IpStack::Dual);
        let k = "10.244.2.0-24&fd00:244:2::-64";
        let mut l = wg_lease(k, [192, 168, 10, 2], Some("fd00:10::2"), 2, 51830);
        let snap = snapshot(vec![(k, l.clone())]);
        let d = desired(&local, &snap, &Facts::none());
        assert_eq!(d.notes, vec![]);
        let reaches: Vec<(IpNet, Reach)> = d.paths().map(|(_, p)| (p.subnet, p.reach)).collect();
        assert_eq!(
            reaches,
            vec![
                (
                    net("10.244.2.0/24"),
                    Reach::Wireguard {
                        public_key: wg_key(2),
                        endpoint: "192.168.10.2:51830".parse().unwrap()
                    }
                ),
                (
                    net("fd00:244:2::/64"),
                    Reach::Wireguard {
                        public_key: wg_key(0x42),
                        endpoint: "[fd00:10::2]:51831".parse().unwrap()
                    }
                ),
            ]
        );
        // Port 0 (unpublished) falls back to the local port of that family.
        l.attrs.backend_data = Some(wg_data(2, 0));
        l.attrs.backend_v6_data = Some(wg_data(0x42, 0));
        let d = desired(&local, &snapshot(vec![(k, l.clone())]), &Facts::none());
        let eps: Vec<SocketAddr> = d
            .paths()
            .map(|(_, p)| match p.reach {
                Reach::Wireguard { endpoint, .. } => endpoint,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            eps,
            vec![
                "192.168.10.2:51820".parse().unwrap(),
                "[fd00:10::2]:51821".parse().unwrap()
            ]
        );
        // Broken v6 data drops only that family, with a note.
        l.attrs.backend_v6_data = Some(RawJson::from_json(r#"{"PublicKey":"x"}"#).unwrap());
        let d = desired(&local, &snapshot(vec![(k, l)]), &Facts::none());
        assert_eq!(d.paths().count(), 1);
        assert!(matches!(
            &d.notes[..],
            [Note::Ignored {
                reason: IgnoreReason::BadBackendData {
                    family: IpFamily::V6,
                    ..
                },
                ..
            }]
        ));
        // Leases of other backends are ignored.
        let other = vx_lease("10.244.5.0-24", [192, 168, 10, 5], mac(5));
        let d = desired(
            &local,
            &snapshot(vec![("10.244.5.0-24", other)]),
            &Facts::none(),
        );
        assert!(d.peers.is_empty());
        assert_eq!(d.ignored(), 1);
    }

    #[test]
    fn wireguard_single_device_modes_share_key_and_endpoint() {
        let k = "10.244.2.0-24&fd00:244:2::-64";
        // RFC 1918 v4 and ULA v6: auto falls through to IPv4.
        let l = wg_lease(k, [192, 168, 10, 2], Some("fd00:10::2"), 2, 51820);
        let check = |mode, l: &Lease, want: &str| {
            let local = local(wg_opts(mode), IpStack::Dual);
            let d = desired(&local, &snapshot(vec![(k, l.clone())]), &Facts::none());
            let reaches: Vec<Reach> = d.paths().map(|(_, p)| p.reach).collect();
            assert_eq!(reaches.len(), 2, "{mode:?}");
            for r in reaches {
                assert_eq!(
                    r,
                    Reach::Wireguard {
                        // The v6 data's key, as upstream.
                        public_key: wg_key(0x42),
                        endpoint: want.parse().unwrap()
                    },
                    "{mode:?}"
                );
            }
        };
        check(WireguardMode::Ipv4, &l, "192.168.10.2:51820");
        check(WireguardMode::Ipv6, &l, "[fd00:10::2]:51821");
        check(WireguardMode::Auto, &l, "192.168.10.2:51820");
        // A public v4 address wins in auto mode.
        let public = wg_lease(k, [203, 0, 113, 7], Some("2001:db8::7"), 2, 51820);
        check(WireguardMode::Auto, &public, "203.0.113.7:51820");
    }

    #[test]
    fn wireguard_auto_endpoint_rules() {
        let e4: SocketAddr = "192.168.1.2:51820".parse().unwrap();
        let p4: SocketAddr = "198.51.100.2:51820".parse().unwrap();
        let g6: SocketAddr = "[2001:db8::2]:51820".parse().unwrap();
        let u6: SocketAddr = "[fd00::2]:51820".parse().unwrap();
        let own4 = Some(Ipv4Addr::new(192, 168, 1, 1));
        let own_g6: Option<Ipv6Addr> = Some("2001:db8::1".parse().unwrap());
        let own_u6: Option<Ipv6Addr> = Some("fd00::1".parse().unwrap());
        let auto = WireguardMode::Auto;
        // No v6 endpoint: v4.
        assert_eq!(
            wireguard_endpoint(auto, Some(e4), None, own4, own_g6),
            Some(e4)
        );
        // Only v6: v6.
        assert_eq!(
            wireguard_endpoint(auto, None, Some(g6), own4, own_g6),
            Some(g6)
        );
        // Public v4 and a local v4 address: v4.
        assert_eq!(
            wireguard_endpoint(auto, Some(p4), Some(g6), own4, own_g6),
            Some(p4)
        );
        // Public v4 but no local v4: global v6.
        assert_eq!(
            wireguard_endpoint(auto, Some(p4), Some(g6), None, own_g6),
            Some(g6)
        );
        // Private v4, global v6 on both sides: v6.
        assert_eq!(
            wireguard_endpoint(auto, Some(e4), Some(g6), own4, own_g6),
            Some(g6)
        );
        // Private v4, peer's v6 is a ULA: v4.
        assert_eq!(
            wireguard_endpoint(auto, Some(e4), Some(u6), own4, own_g6),
            Some(e4)
        );
        // Private v4, our own v6 is a ULA: v4.
        assert_eq!(
            wireguard_endpoint(auto, Some(e4), Some(g6), own4, own_u6),
            Some(e4)
        );
        assert_eq!(wireguard_endpoint(auto, None, None, own4, own_g6), None);
        assert_eq!(
            wireguard_endpoint(WireguardMode::Ipv6, Some(e4), None, own4, None),
            Some(e4)
        );
    }

    #[test]
    fn ipsec_peers_are_ipv4_only() {
        let local = local(
            BackendOptions::Ipsec(crate::backend::IpsecOptions {
                psk: crate::backend::Secret::new("k".repeat(96)),
                udp_encap: false,
                esp_proposal: "aes128gcm16".into(),
            }),
            IpStack::Dual,
        );
        let k = "10.244.2.0-24&fd00:244:2::-64";
        let mut l = lease(k, "ipsec", [192, 168, 10, 2]);
        l.attrs.public_ipv6 = Some("fd00:10::2".parse().unwrap());
        let d = desired(&local, &snapshot(vec![(k, l)]), &Facts::none());
        assert_eq!(d.notes, vec![]);
        assert_eq!(
            d.peers,
            vec![Peer {
                id: k.into(),
                v4: Some(PeerPath {
                    subnet: net("10.244.2.0/24"),
                    reach: Reach::Ipsec {
                        public_ip: Ipv4Addr::new(192, 168, 10, 2)
                    }
                }),
                v6: None,
            }]
        );
    }
}
