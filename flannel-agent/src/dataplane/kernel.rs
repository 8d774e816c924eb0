//! The kernel applier: expands [`Desired`] peers into routes, neighbours and FDB entries the
//! way upstream flannel programs them (flannel-upstream.md 2.1–2.3), lists what the kernel
//! holds that the dataplane owns, and applies the difference in batches.
//!
//! Per peer path:
//! * vxlan: `ip neigh replace <subnet addr> dev flannel.<VNI> lladdr <VtepMAC> nud permanent`,
//!   `bridge fdb replace <VtepMAC> dev flannel.<VNI> self dst <public IP> permanent`,
//!   `ip route replace <subnet> via <subnet addr> dev flannel.<VNI> onlink` (IPv6 on
//!   `flannel-v6.<VNI>`);
//! * direct (host-gw, DirectRouting): `ip route replace <subnet> via <public IP> dev <oif>`;
//! * ipip: `ip route replace <subnet> via <public IP> dev flannel.ipip onlink`;
//! * udp: nothing (the forwarder's table, [`crate::udp::UdpApplier`]).
//!
//! Every route carries protocol [`RTPROT_FLANNEL`]. What the applier owns, and therefore may
//! delete when it is not desired:
//! * unicast routes of the main table with protocol [`RTPROT_FLANNEL`], except routes to this
//!   node's own subnets (blackhole and other route types are left alone);
//! * routes of any protocol but `kernel` out of its own devices whose destination lies in the
//!   cluster network (so a node taken over from upstream flanneld, whose routes say
//!   `proto boot`, converges; link-local and kernel routes of the devices stay);
//! * permanent neighbours and permanent `self` FDB entries of its own vxlan devices.
//!
//! Nothing else is touched. Adds and replaces go first (neighbour, FDB, then route, so a
//! route never points at a missing neighbour), deletes last (route first).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use futures::future::BoxFuture;
use ipnet::IpNet;

use crate::netlink::{
    DEFAULT_IN_FLIGHT, Entry, FdbEntry, IpFamily, Neighbour, NeighbourFlags, NeighbourState,
    Netlink, NetlinkError, Op, RT_TABLE_MAIN, RTPROT_FLANNEL, Route, RouteFilter, RouteKind,
    routes::IP6_DEFAULT_METRIC,
};

use crate::sorted::{Joined, join};

use super::{
    applier::{Applier, ApplyReport, SyncMode},
    model::{Desired, Local, Reach, subnet_address},
};

/// `RTPROT_KERNEL`: routes the kernel derives from addresses.
pub(crate) const RTPROT_KERNEL: u8 = 2;

/// A route's identity in its table: `(table, destination, metric)` with IPv6's implicit
/// metric made explicit, which is what `ip route replace` replaces.
pub type RouteKey = (u32, IpNet, u32);

/// An FDB entry's identity: `(vxlan ifindex, MAC, destination)`.
pub type FdbKey = (u32, [u8; 6], IpAddr);

/// The kernel objects of a desired state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelObjects {
    /// Routes by key.
    pub routes: BTreeMap<RouteKey, Route>,
    /// Neighbours: `(ifindex, IP)` → MAC.
    pub neighbours: BTreeMap<(u32, IpAddr), [u8; 6]>,
    /// FDB entries.
    pub fdb: BTreeSet<FdbKey>,
    /// Peer paths that could not be expanded because their device is missing.
    pub skipped: u64,
}

/// The key of `route`.
pub fn route_key(route: &Route) -> RouteKey {
    let metric = match (route.family(), route.metric) {
        (IpFamily::V6, 0) => IP6_DEFAULT_METRIC,
        (_, m) => m,
    };
    (route.table, route.dst, metric)
}

/// Expands the desired peers into kernel objects for node `local`'s devices. The objects are
/// gathered first and the maps built from them at once (sorted, then filled in bulk): a lease
/// event expands every peer, and thousands of single inserts at scattered keys cost several
/// times more. Of two objects with one key the later one stays, as with inserts.
pub fn expand(local: &Local, desired: &Desired) -> KernelObjects {
    let mut routes = Vec::new();
    let mut neighbours = Vec::new();
    let mut fdb = Vec::new();
    let mut skipped = 0;
    for (_, path) in desired.paths() {
        let family = path.family();
        let route = match path.reach {
            Reach::Direct { gateway, oif } => Route::new(path.subnet).via(gateway).dev(oif),
            Reach::Vxlan {
                vtep_mac,
                public_ip,
                ..
            } => {
                let Some(dev) = local.devices.vxlan(family) else {
                    skipped += 1;
                    continue;
                };
                let next_hop = subnet_address(path.subnet);
                let mac = vtep_mac.octets();
                neighbours.push(((dev.index, next_hop), mac));
                fdb.push((dev.index, mac, public_ip));
                Route::new(path.subnet)
                    .via(next_hop)
                    .dev(dev.index)
                    .onlink()
            }
            // Programmed by their own appliers; no per-peer kernel objects.
            Reach::Wireguard { .. } | Reach::Ipsec { .. } => continue,
            Reach::Ipip {
                public_ip,
                next_hop,
            } => match (local.devices.ipip.as_ref(), next_hop) {
                (Some(dev), _) => Route::new(path.subnet)
                    .via(IpAddr::V4(public_ip))
                    .dev(dev.index)
                    .onlink(),
                // No kernel device: the eBPF program on the external interface's egress
                // encapsulates, so route towards the underlay next hop with room for the
                // 20-byte outer header (host-originated packets honour the route MTU).
                (None, Some(next_hop)) if local.ipip_via_ebpf => Route::new(path.subnet)
                    .via(next_hop)
                    .dev(local.ext.index)
                    .onlink()
                    .mtu(local.mtu.flannel_mtu),
                _ => {
                    skipped += 1;
                    continue;
                }
            },
            // The udp forwarder's own table carries these (`crate::udp::UdpApplier`); the
            // kernel only has `<Network> dev flannel0`, set up with the device.
            Reach::Udp { .. } => continue,
        };
        routes.push((route_key(&route), route));
    }
    KernelObjects {
        routes: routes.into_iter().collect(),
        neighbours: neighbours.into_iter().collect(),
        fdb: fdb.into_iter().collect(),
        skipped,
    }
}

/// What the kernel holds that the applier owns (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Owned routes.
    pub routes: Vec<Route>,
    /// Neighbours of the vxlan devices.
    pub neighbours: Vec<Neighbour>,
    /// FDB entries of the vxlan devices.
    pub fdb: Vec<FdbEntry>,
}

/// Whether a route with protocol [`RTPROT_FLANNEL`] in the main table is the applier's.
fn owned_flannel_route(local: &Local, route: &Route) -> bool {
    route.kind == RouteKind::Unicast
        && route.table == RT_TABLE_MAIN
        && [IpFamily::V4, IpFamily::V6]
            .into_iter()
            .filter_map(|f| local.own_subnet(f))
            .all(|own| !own.contains(&route.dst) && !route.dst.contains(&own.addr()))
}

/// Whether a route of another protocol out of one of the applier's devices is adopted.
fn adopted_device_route(local: &Local, route: &Route) -> bool {
    route.protocol != RTPROT_FLANNEL
        && route.protocol != RTPROT_KERNEL
        && route.kind == RouteKind::Unicast
        && route.table == RT_TABLE_MAIN
        && local
            .network_of(route.family())
            .is_some_and(|n| n.contains(&route.dst))
        && owned_flannel_route(local, route)
}

impl Observed {
    /// What the kernel lists after a sync wrote `objects` and deleted every other owned
    /// object: `objects`, as the kernel reports them (neighbours and FDB entries permanent,
    /// the FDB entries the vxlan device's own). The applier plans against `objects` directly
    /// ([`plan_from_left`]); the tests hold that to planning against this listing.
    #[cfg(test)]
    pub fn left_by(objects: &KernelObjects) -> Self {
        Self {
            routes: objects.routes.values().cloned().collect(),
            neighbours: objects
                .neighbours
                .iter()
                .map(|(&(ifindex, ip), &mac)| Neighbour {
                    ifindex,
                    ip,
                    mac: Some(mac),
                    state: NeighbourState::Permanent,
                    flags: NeighbourFlags::default(),
                    protocol: Some(RTPROT_FLANNEL),
                })
                .collect(),
            fdb: objects
                .fdb
                .iter()
                .map(|&(ifindex, mac, dst)| FdbEntry {
                    ifindex,
                    mac,
                    dst: Some(dst),
                    vni: None,
                    port: None,
                    state: NeighbourState::Permanent,
                    flags: NeighbourFlags(NeighbourFlags::SELF),
                    master: None,
                })
                .collect(),
        }
    }

    /// Lists the owned objects.
    pub async fn read(nl: &Netlink, local: &Local) -> Result<Self, NetlinkError> {
        let mut routes: Vec<Route> = nl
            .list_routes(RouteFilter::ours().table(RT_TABLE_MAIN))
            .await?
            .into_iter()
            .filter(|r| owned_flannel_route(local, r))
            .collect();
        for dev in local.devices.all() {
            let on_dev = nl
                .list_routes(RouteFilter::default().table(RT_TABLE_MAIN).oif(dev.index))
                .await?;
            routes.extend(
                on_dev
                    .into_iter()
                    .filter(|r| adopted_device_route(local, r)),
            );
        }
        let mut neighbours = Vec::new();
        let mut fdb = Vec::new();
        for family in [IpFamily::V4, IpFamily::V6] {
            if let Some(dev) = local.devices.vxlan(family) {
                neighbours.extend(nl.list_neighbours(dev.index).await?);
                fdb.extend(nl.list_fdb(dev.index).await?);
            }
        }
        Ok(Self {
            routes,
            neighbours,
            fdb,
        })
    }
}

/// What a planned operation does to the counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Adds a missing object.
    Add,
    /// Replaces an object with other attributes.
    Replace,
    /// Removes an object that is not desired.
    Delete,
}

/// The difference between desired and observed, in the order it is applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Operations with what each one counts as.
    pub ops: Vec<(Action, Op)>,
    /// Desired objects already in place.
    pub unchanged: u64,
}

impl Plan {
    /// The operations of one action, in order (for tests and logs).
    pub fn of(&self, action: Action) -> impl Iterator<Item = &Op> {
        self.ops
            .iter()
            .filter(move |(a, _)| *a == action)
            .map(|(_, op)| op)
    }
}

fn same_route(want: &Route, have: &Route) -> bool {
    want.gateway == have.gateway
        && want.oif == have.oif
        && want.onlink == have.onlink
        && want.scope == have.scope
        && want.kind == have.kind
        && want.protocol == have.protocol
        && want.table == have.table
        && want.prefsrc == have.prefsrc
        && route_key(want) == route_key(have)
}

fn is_fdb_candidate(e: &FdbEntry) -> bool {
    e.flags.contains(NeighbourFlags::SELF) && e.dst.is_some() && e.master.is_none()
}

/// [`plan`] against what the last complete sync left (`left`, exactly the objects it
/// desired), without building the kernel's listing of them or indexing it: both sides are
/// keyed and sorted already, so one pass over each kind side by side ([`join`]) finds what to
/// add, replace and delete. The same operations in the same order as [`plan`] against that
/// listing (tests `what_a_sync_left_plans_as_the_kernels_listing_does`,
/// `planning_from_what_was_left_equals_planning_from_its_listing`).
pub fn plan_from_left(desired: &KernelObjects, left: &KernelObjects, mode: SyncMode) -> Plan {
    let mut plan = Plan::default();
    let mut neighbour_deletes = Vec::new();
    for joined in join(&desired.neighbours, &left.neighbours) {
        match joined {
            Joined::Both(_, want, have) if want == have => plan.unchanged += 1,
            Joined::Both(&(ifindex, ip), &mac, _) => plan
                .ops
                .push((Action::Replace, Op::ReplaceNeighbour { ifindex, ip, mac })),
            Joined::First(&(ifindex, ip), &mac) => plan
                .ops
                .push((Action::Add, Op::ReplaceNeighbour { ifindex, ip, mac })),
            Joined::Second(&(ifindex, ip), _) => {
                neighbour_deletes.push(Op::DeleteNeighbour { ifindex, ip });
            }
        }
    }
    let mut fdb_deletes = Vec::new();
    let (want_fdb, left_fdb) = (desired.fdb.iter(), left.fdb.iter());
    for joined in join(want_fdb.map(|k| (*k, ())), left_fdb.map(|k| (*k, ()))) {
        match joined {
            Joined::Both(..) => plan.unchanged += 1,
            Joined::First((ifindex, mac, dst), ()) => plan
                .ops
                .push((Action::Add, Op::ReplaceFdb { ifindex, mac, dst })),
            Joined::Second((ifindex, mac, dst), ()) => {
                fdb_deletes.push(Op::DeleteFdb { ifindex, mac, dst });
            }
        }
    }
    let mut route_deletes = Vec::new();
    for joined in join(&desired.routes, &left.routes) {
        match joined {
            Joined::Both(_, want, have) if same_route(want, have) => plan.unchanged += 1,
            Joined::Both(_, want, _) => plan
                .ops
                .push((Action::Replace, Op::ReplaceRoute(want.clone()))),
            Joined::First(_, want) => plan.ops.push((Action::Add, Op::ReplaceRoute(want.clone()))),
            Joined::Second(_, have) => route_deletes.push(Op::DeleteRoute(have.clone())),
        }
    }
    if mode == SyncMode::Full {
        plan.ops.extend(
            route_deletes
                .into_iter()
                .chain(neighbour_deletes)
                .chain(fdb_deletes)
                .map(|op| (Action::Delete, op)),
        );
    }
    plan
}

/// Computes the operations that turn `observed` into `desired`.
pub fn plan(desired: &KernelObjects, observed: &Observed, mode: SyncMode) -> Plan {
    let mut plan = Plan::default();
    let mut deletes = Vec::new();

    // Neighbours.
    let have_neigh: BTreeMap<(u32, IpAddr), &Neighbour> = observed
        .neighbours
        .iter()
        .map(|n| ((n.ifindex, n.ip), n))
        .collect();
    for (&(ifindex, ip), &mac) in &desired.neighbours {
        match have_neigh.get(&(ifindex, ip)) {
            Some(n) if n.mac == Some(mac) && n.state == NeighbourState::Permanent => {
                plan.unchanged += 1;
            }
            Some(_) => plan
                .ops
                .push((Action::Replace, Op::ReplaceNeighbour { ifindex, ip, mac })),
            None => plan
                .ops
                .push((Action::Add, Op::ReplaceNeighbour { ifindex, ip, mac })),
        }
    }
    let mut neigh_deletes = Vec::new();
    for n in &observed.neighbours {
        if n.state == NeighbourState::Permanent
            && !desired.neighbours.contains_key(&(n.ifindex, n.ip))
        {
            neigh_deletes.push(Op::DeleteNeighbour {
                ifindex: n.ifindex,
                ip: n.ip,
            });
        }
    }

    // FDB entries.
    let have_fdb: BTreeMap<FdbKey, &FdbEntry> = observed
        .fdb
        .iter()
        .filter(|e| is_fdb_candidate(e))
        .filter_map(|e| e.dst.map(|dst| ((e.ifindex, e.mac, dst), e)))
        .collect();
    for &(ifindex, mac, dst) in &desired.fdb {
        match have_fdb.get(&(ifindex, mac, dst)) {
            Some(e) if e.state == NeighbourState::Permanent => plan.unchanged += 1,
            Some(_) => plan
                .ops
                .push((Action::Replace, Op::ReplaceFdb { ifindex, mac, dst })),
            None => plan
                .ops
                .push((Action::Add, Op::ReplaceFdb { ifindex, mac, dst })),
        }
    }
    let mut fdb_deletes = Vec::new();
    for (&(ifindex, mac, dst), e) in &have_fdb {
        if e.state == NeighbourState::Permanent && !desired.fdb.contains(&(ifindex, mac, dst)) {
            fdb_deletes.push(Op::DeleteFdb { ifindex, mac, dst });
        }
    }

    // Routes.
    let mut have_routes: BTreeMap<RouteKey, Vec<&Route>> = BTreeMap::new();
    for r in &observed.routes {
        have_routes.entry(route_key(r)).or_default().push(r);
    }
    for (key, want) in &desired.routes {
        let have = have_routes.get(key).map(Vec::as_slice).unwrap_or_default();
        if let Some(first) = have.first() {
            if same_route(want, first) {
                plan.unchanged += 1;
            } else {
                plan.ops
                    .push((Action::Replace, Op::ReplaceRoute(want.clone())));
            }
            // Appended duplicates under the same key (`ip route append`) are removed.
            for extra in have.iter().skip(1) {
                deletes.push(Op::DeleteRoute((*extra).clone()));
            }
        } else {
            plan.ops.push((Action::Add, Op::ReplaceRoute(want.clone())));
        }
    }
    for (key, have) in &have_routes {
        if !desired.routes.contains_key(key) {
            deletes.extend(have.iter().map(|r| Op::DeleteRoute((*r).clone())));
        }
    }

    if mode == SyncMode::Full {
        deletes.extend(neigh_deletes);
        deletes.extend(fdb_deletes);
        plan.ops
            .extend(deletes.into_iter().map(|op| (Action::Delete, op)));
    }
    plan
}

/// A bounded label for an error: `<object>:<errno name or kind>`.
pub fn error_kind(object: &str, e: &NetlinkError) -> String {
    let class = match e {
        NetlinkError::Timeout { .. } => "timeout".to_owned(),
        NetlinkError::Socket { .. } => "socket".to_owned(),
        NetlinkError::Invalid { .. } => "invalid".to_owned(),
        other => match other.errno() {
            Some(errno) => format!("{:?}", nix::errno::Errno::from_raw(errno)),
            None => "other".to_owned(),
        },
    };
    format!("{object}:{class}")
}

fn op_object(op: &Op) -> &'static str {
    match op {
        Op::ReplaceRoute(_) | Op::DeleteRoute(_) => "route",
        Op::ReplaceNeighbour { .. } | Op::DeleteNeighbour { .. } => "neighbour",
        Op::ReplaceFdb { .. } | Op::AppendFdb { .. } | Op::DeleteFdb { .. } => "fdb",
        Op::AddAddress { .. } | Op::DeleteAddress { .. } => "address",
    }
}

/// The entry an operation writes or removes, as the kernel's notification of it names it.
fn op_entry(op: &Op) -> Option<Entry> {
    match op {
        Op::ReplaceRoute(route) | Op::DeleteRoute(route) => Some(Entry::Route {
            table: route.table,
            dst: route.dst,
        }),
        Op::ReplaceNeighbour { ifindex, ip, .. } | Op::DeleteNeighbour { ifindex, ip } => {
            Some(Entry::Neighbour {
                index: *ifindex,
                ip: *ip,
            })
        }
        Op::ReplaceFdb { ifindex, mac, .. }
        | Op::AppendFdb { ifindex, mac, .. }
        | Op::DeleteFdb { ifindex, mac, .. } => Some(Entry::Fdb {
            index: *ifindex,
            mac: *mac,
        }),
        _ => None,
    }
}

/// Applies routes, neighbours and FDB entries through rtnetlink.
#[derive(Debug, Clone)]
pub struct KernelApplier {
    nl: Netlink,
    in_flight: usize,
    /// What the kernel holds after the last sync, when it succeeded in full: the next sync
    /// diffs against it instead of listing the kernel's tables (15,000 entries at 5,000 peers,
    /// about 30 ms), until [`Applier::invalidate`].
    left: Option<Left>,
}

/// What a complete sync left in the kernel, and for which devices.
#[derive(Debug, Clone)]
struct Left {
    /// The owned objects: exactly what was desired.
    objects: KernelObjects,
    /// The devices' indexes (the external interface's first) they were written for.
    devices: Vec<u32>,
}

/// The indexes of `local`'s external interface and devices.
fn device_indexes(local: &Local) -> Vec<u32> {
    std::iter::once(local.ext.index)
        .chain(local.devices.all().map(|d| d.index))
        .collect()
}

impl KernelApplier {
    /// An applier on `nl`, sending [`DEFAULT_IN_FLIGHT`] × 4 requests per datagram.
    pub fn new(nl: Netlink) -> Self {
        Self {
            nl,
            in_flight: DEFAULT_IN_FLIGHT * 4,
            left: None,
        }
    }

    /// Sets how many requests go into one datagram.
    pub fn with_in_flight(mut self, in_flight: usize) -> Self {
        self.in_flight = in_flight.max(1);
        self
    }

    /// Lists (or takes what the last complete sync left), diffs and applies; see the module
    /// documentation.
    pub async fn apply(&mut self, local: &Local, desired: &Desired, mode: SyncMode) -> ApplyReport {
        let mut report = ApplyReport::default();
        let want = expand(local, desired);
        report.stats.skipped = want.skipped;
        let devices = device_indexes(local);
        // Expanding, diffing and planning thousands of peers is CPU work without a wait in
        // it: yielding between the steps lets a newer lease snapshot reach the quick appliers
        // (the eBPF maps) meanwhile, as the kernel's listings used to.
        tokio::task::yield_now().await;
        let plan = match self.left.take().filter(|left| left.devices == devices) {
            Some(left) => plan_from_left(&want, &left.objects, mode),
            None => match Observed::read(&self.nl, local).await {
                Ok(observed) => plan(&want, &observed, mode),
                Err(e) => {
                    report.fail(error_kind("list", &e), e.to_string());
                    return report;
                }
            },
        };
        tokio::task::yield_now().await;
        report.stats.unchanged = plan.unchanged;
        report.stats.ops = plan.ops.len() as u64;
        let (actions, ops): (Vec<Action>, Vec<Op>) = plan.ops.into_iter().unzip();
        let objects: Vec<(&'static str, Option<Entry>)> =
            ops.iter().map(|op| (op_object(op), op_entry(op))).collect();
        let results = self.nl.apply_all(ops, self.in_flight).await;
        for ((action, (object, entry)), result) in actions.into_iter().zip(objects).zip(results) {
            match (action, result) {
                (Action::Add, Ok(())) => {
                    report.stats.added += 1;
                    report.written.extend(entry);
                }
                (Action::Replace, Ok(())) => {
                    report.stats.replaced += 1;
                    report.written.extend(entry);
                }
                (Action::Delete, Ok(())) => {
                    report.stats.deleted += 1;
                    report.removed.extend(entry);
                }
                // Already gone (the kernel removed it with its device, or a replace did).
                (Action::Delete, Err(e)) if e.is_not_found() => report.stats.deleted += 1,
                (_, Err(e)) => {
                    report.fail(error_kind(object, &e), e.to_string());
                }
            }
        }
        // After a complete sync that wrote everything, the kernel holds what was desired.
        if mode == SyncMode::Full && report.errors.is_empty() {
            self.left = Some(Left {
                objects: want,
                devices,
            });
        }
        report
    }
}

impl Applier for KernelApplier {
    fn name(&self) -> &'static str {
        "kernel"
    }

    fn invalidate(&mut self) {
        self.left = None;
    }

    fn sync<'a>(
        &'a mut self,
        local: &'a Local,
        desired: &'a Desired,
        mode: SyncMode,
    ) -> BoxFuture<'a, ApplyReport> {
        Box::pin(self.apply(local, desired, mode))
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::{
        backend::{BackendOptions, MacAddr, MtuPlan, VxlanOptions},
        iface::ExternalInterface,
        ip::IpStack,
        lease::{Lease, LeaseAttrs, SubnetKey},
        netlink::RouteScope,
    };

    use super::super::model::{DeviceInfo, Peer, PeerPath, VtepMacs};

    const EXT: u32 = 2;
    const VX4: u32 = 10;
    const VX6: u32 = 11;

    fn mac(last: u8) -> MacAddr {
        MacAddr([0x0e, 0x2a, 0, 0, 0, last])
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn local() -> Local {
        let mut l = Local::new(
            Lease::new(
                SubnetKey::parse("10.244.1.0-24&fd00:244:1::-64").unwrap(),
                LeaseAttrs::default(),
                None,
            ),
            IpStack::Dual,
            Some("10.244.0.0/16".parse().unwrap()),
            Some("fd00:244::/48".parse().unwrap()),
            BackendOptions::Vxlan(VxlanOptions::default()),
            ExternalInterface {
                name: "eth0".into(),
                index: EXT,
                mtu: 1500,
                iface_addr: Some(Ipv4Addr::new(192, 168, 10, 1)),
                iface_v6_addr: None,
                ext_addr: Some(Ipv4Addr::new(192, 168, 10, 1)),
                ext_v6_addr: Some("fd00:10::1".parse().unwrap()),
            },
            MtuPlan {
                device_v4: Some(1450),
                device_v6: Some(1430),
                flannel_mtu: 1430,
            },
            VtepMacs {
                v4: Some(mac(1)),
                v6: Some(mac(0x61)),
            },
        );
        l.devices.vxlan_v4 = Some(DeviceInfo {
            name: "flannel.1".into(),
            index: VX4,
            mac: Some(mac(1)),
        });
        l.devices.vxlan_v6 = Some(DeviceInfo {
            name: "flannel-v6.1".into(),
            index: VX6,
            mac: Some(mac(0x61)),
        });
        l
    }

    fn vx(subnet: &str, m: MacAddr, public: &str) -> PeerPath {
        PeerPath {
            subnet: net(subnet),
            reach: Reach::Vxlan {
                vtep_mac: m,
                vni: 1,
                public_ip: ip(public),
            },
        }
    }

    fn desired() -> Desired {
        Desired {
            peers: vec![
                Peer {
                    id: "a".into(),
                    v4: Some(vx("10.244.2.0/24", mac(2), "192.168.10.2")),
                    v6: Some(vx("fd00:244:2::/64", mac(0x62), "fd00:10::2")),
                },
                Peer {
                    id: "b".into(),
                    v4: Some(PeerPath {
                        subnet: net("10.244.3.0/24"),
                        reach: Reach::Direct {
                            gateway: ip("192.168.10.3"),
                            oif: EXT,
                        },
                    }),
                    v6: None,
                },
            ],
            notes: vec![],
            extension: vec![],
        }
    }

    /// What the kernel reports back for a route the applier installed.
    fn as_listed(r: &Route) -> Route {
        let mut r = r.clone();
        if r.family() == IpFamily::V6 && r.metric == 0 {
            r.metric = 1024;
        }
        r
    }

    fn neighbour(ifindex: u32, ip_: &str, m: MacAddr) -> Neighbour {
        Neighbour {
            ifindex,
            ip: ip(ip_),
            mac: Some(m.octets()),
            state: NeighbourState::Permanent,
            flags: NeighbourFlags::default(),
            protocol: Some(RTPROT_FLANNEL),
        }
    }

    fn fdb(ifindex: u32, m: MacAddr, dst: &str) -> FdbEntry {
        FdbEntry {
            ifindex,
            mac: m.octets(),
            dst: Some(ip(dst)),
            vni: None,
            port: None,
            state: NeighbourState::Permanent,
            flags: NeighbourFlags(NeighbourFlags::SELF),
            master: None,
        }
    }

    /// The observed state after a perfect apply of `objects`, as the kernel lists it.
    fn observed_of(objects: &KernelObjects) -> Observed {
        let mut observed = Observed::left_by(objects);
        observed.routes = objects.routes.values().map(as_listed).collect();
        observed
    }

    #[test]
    fn expansion_matches_upstream() {
        let objects = expand(&local(), &desired());
        let routes: Vec<String> = objects.routes.values().map(|r| r.to_string()).collect();
        assert_eq!(
            routes,
            [
                "10.244.2.0/24 via 10.244.2.0 dev #10 onlink table 254 proto 165",
                "10.244.3.0/24 via 192.168.10.3 dev #2 table 254 proto 165",
                "fd00:244:2::/64 via fd00:244:2:: dev #11 onlink table 254 proto 165",
            ]
        );
        assert_eq!(
            objects.neighbours,
            BTreeMap::from([
                ((VX4, ip("10.244.2.0")), mac(2).octets()),
                ((VX6, ip("fd00:244:2::")), mac(0x62).octets()),
            ])
        );
        assert_eq!(
            objects.fdb,
            BTreeSet::from([
                (VX4, mac(2).octets(), ip("192.168.10.2")),
                (VX6, mac(0x62).octets(), ip("fd00:10::2")),
            ])
        );
        assert_eq!(objects.skipped, 0);
        // Without the v6 device its paths are skipped and counted.
        let mut l = local();
        l.devices.vxlan_v6 = None;
        let objects = expand(&l, &desired());
        assert_eq!(objects.skipped, 1);
        assert_eq!(objects.routes.len(), 2);
    }

    #[test]
    fn ipip_without_a_device_routes_out_of_the_external_interface_when_ebpf_carries_it() {
        let ipip = |next_hop: Option<&str>| Desired {
            peers: vec![Peer {
                id: "c".into(),
                v4: Some(PeerPath {
                    subnet: net("10.244.4.0/24"),
                    reach: Reach::Ipip {
                        public_ip: "192.168.20.4".parse().unwrap(),
                        next_hop: next_hop.map(ip),
                    },
                }),
                v6: None,
            }],
            notes: vec![],
            extension: vec![],
        };
        let mut l = local();
        l.mtu.flannel_mtu = 1480;
        // Neither a kernel ipip device nor the fast path: nothing to route through.
        let objects = expand(&l, &ipip(Some("192.168.10.254")));
        assert_eq!((objects.routes.len(), objects.skipped), (0, 1));
        // The fast path carries it: towards the underlay next hop, with the tunnel's MTU.
        l.ipip_via_ebpf = true;
        let objects = expand(&l, &ipip(Some("192.168.10.254")));
        let routes: Vec<String> = objects.routes.values().map(|r| r.to_string()).collect();
        assert_eq!(
            routes,
            ["10.244.4.0/24 via 192.168.10.254 dev #2 onlink mtu 1480 table 254 proto 165"]
        );
        // No known next hop (no route to the peer): skipped, never a guess.
        let objects = expand(&l, &ipip(None));
        assert_eq!((objects.routes.len(), objects.skipped), (0, 1));
    }

    /// Two paths to one subnet (which `desired()` never yields): the later one's objects
    /// stay, as when the maps were filled one insert at a time.
    #[test]
    fn of_two_objects_with_one_key_the_later_stays() {
        let path = |m: u8| Peer {
            id: format!("p{m}"),
            v4: Some(vx("10.244.2.0/24", mac(m), "192.168.10.2")),
            v6: None,
        };
        let twice = Desired {
            peers: vec![path(2), path(3)],
            notes: vec![],
            extension: vec![],
        };
        let objects = expand(&local(), &twice);
        assert_eq!(objects.routes.len(), 1);
        assert_eq!(
            objects.neighbours.get(&(VX4, ip("10.244.2.0"))),
            Some(&mac(3).octets())
        );
        assert_eq!(objects.fdb.len(), 2);
    }

    #[test]
    fn empty_kernel_gets_everything_in_upstream_order() {
        let objects = expand(&local(), &desired());
        let p = plan(&objects, &Observed::default(), SyncMode::Full);
        assert_eq!(p.unchanged, 0);
        let kinds: Vec<&str> = p.ops.iter().map(|(_, op)| op_object(op)).collect();
        assert_eq!(
            kinds,
            [
                "neighbour",
                "neighbour",
                "fdb",
                "fdb",
                "route",
                "route",
                "route"
            ]
        );
        assert!(p.ops.iter().all(|(a, _)| *a == Action::Add));
    }

    #[test]
    fn applied_state_is_a_no_op() {
        let objects = expand(&local(), &desired());
        let p = plan(&objects, &observed_of(&objects), SyncMode::Full);
        assert_eq!(p.ops, vec![]);
        assert_eq!(p.unchanged, 7);
    }

    /// What a complete sync left stands in for the kernel's listing: the next sync plans the
    /// same operations against it (deletions named as the kernel's notification names them:
    /// an IPv6 route's metric is the kernel's implicit one in the listing, absent in what was
    /// written) for every kind of change of the peers.
    #[test]
    fn what_a_sync_left_plans_as_the_kernels_listing_does() {
        let before = desired();
        let left = expand(&local(), &before);
        let nothing = plan(&left, &Observed::left_by(&left), SyncMode::Full);
        assert_eq!((nothing.ops.len(), nothing.unchanged), (0, 7));
        type Change = Box<dyn Fn(&mut Desired)>;
        let changes: Vec<(&str, Change)> = vec![
            ("a peer gone", Box::new(|d| d.peers.retain(|p| p.id != "a"))),
            (
                "a peer added",
                Box::new(|d| {
                    d.peers.push(Peer {
                        id: "c".into(),
                        v4: Some(vx("10.244.4.0/24", mac(4), "192.168.10.4")),
                        v6: Some(vx("fd00:244:4::/64", mac(0x64), "fd00:10::4")),
                    });
                }),
            ),
            (
                "a VTEP MAC and a public IP changed",
                Box::new(|d| {
                    d.peers[0].v4 = Some(vx("10.244.2.0/24", mac(0x22), "192.168.10.9"));
                }),
            ),
            (
                "host-gw to vxlan",
                Box::new(|d| {
                    d.peers[1].v4 = Some(vx("10.244.3.0/24", mac(3), "192.168.10.3"));
                }),
            ),
            ("everything gone", Box::new(|d| d.peers.clear())),
        ];
        let named = |p: &Plan| -> Vec<String> {
            p.ops
                .iter()
                .map(|(action, op)| match (action, op_entry(op)) {
                    (Action::Delete, Some(removal)) => format!("delete {removal:?}"),
                    _ => format!("{action:?} {op}"),
                })
                .collect()
        };
        for (what, change) in changes {
            let mut after = desired();
            change(&mut after);
            let want = expand(&local(), &after);
            let from_left = plan(&want, &Observed::left_by(&left), SyncMode::Full);
            let from_kernel = plan(&want, &observed_of(&left), SyncMode::Full);
            assert!(!from_left.ops.is_empty(), "{what}: nothing to do");
            assert_eq!(named(&from_left), named(&from_kernel), "{what}");
            assert_eq!(from_left.unchanged, from_kernel.unchanged, "{what}");
            assert_eq!(
                plan_from_left(&want, &left, SyncMode::Full),
                from_left,
                "{what}"
            );
        }
    }

    /// Random kernel objects over a small pool of subnets, MACs and gateways, so that two of
    /// them share some keys with equal values, some with other values, and miss others.
    fn random_objects(rng: &mut impl rand::Rng) -> KernelObjects {
        let mut objects = KernelObjects::default();
        for _ in 0..rng.random_range(0..40) {
            let k: u8 = rng.random_range(0..30);
            let subnet = net(&format!("10.244.{k}.0/24"));
            let route = if rng.random_bool(0.7) {
                Route::new(subnet)
                    .via(ip(&format!("10.244.{k}.0")))
                    .dev(VX4)
                    .onlink()
            } else {
                let gw = rng.random_range(1..3);
                Route::new(subnet)
                    .via(ip(&format!("192.168.10.{gw}")))
                    .dev(EXT)
            };
            objects.routes.insert(route_key(&route), route);
            let m = mac(k.wrapping_add(rng.random_range(0..2)));
            objects
                .neighbours
                .insert((VX4, ip(&format!("10.244.{k}.0"))), m.octets());
            let dst = ip(&format!("192.168.10.{}", rng.random_range(1..3)));
            objects.fdb.insert((VX4, m.octets(), dst));
        }
        objects
    }

    /// Planning against what the last sync left, without listing it, plans exactly what
    /// planning against its listing does, for random pairs in both modes.
    #[test]
    fn planning_from_what_was_left_equals_planning_from_its_listing() {
        use rand::{SeedableRng as _, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(11);
        let mut changed = 0;
        for _ in 0..2_000 {
            let (want, left) = (random_objects(&mut rng), random_objects(&mut rng));
            for mode in [SyncMode::Full, SyncMode::AddOnly] {
                let expected = plan(&want, &Observed::left_by(&left), mode);
                changed += usize::from(!expected.ops.is_empty());
                assert_eq!(
                    plan_from_left(&want, &left, mode),
                    expected,
                    "want {want:?}\nleft {left:?}"
                );
            }
        }
        assert!(changed > 1_000, "the random pairs seldom differ: {changed}");
    }

    #[test]
    fn drift_is_repaired_and_strays_removed() {
        let objects = expand(&local(), &desired());
        let mut observed = observed_of(&objects);
        // A route deleted by hand.
        observed.routes.retain(|r| r.dst != net("10.244.3.0/24"));
        // A stale route with our protocol for a lease that is gone.
        let stale = Route::new(net("10.244.9.0/24"))
            .via(ip("10.244.9.0"))
            .dev(VX4)
            .onlink();
        observed.routes.push(stale.clone());
        // The v4 neighbour points at an old MAC (the peer's VtepMAC changed) and the old
        // FDB entry is still there.
        observed.neighbours[0] = neighbour(VX4, "10.244.2.0", mac(0x22));
        observed.fdb.retain(|e| e.ifindex != VX4);
        observed.fdb.push(fdb(VX4, mac(0x22), "192.168.10.2"));
        // A transient (non-permanent) neighbour is the kernel's business.
        let mut transient = neighbour(VX4, "10.244.7.0", mac(7));
        transient.state = NeighbourState::Failed;
        observed.neighbours.push(transient);

        let p = plan(&objects, &observed, SyncMode::Full);
        let adds: Vec<String> = p.of(Action::Add).map(|o| o.to_string()).collect();
        let replaces: Vec<String> = p.of(Action::Replace).map(|o| o.to_string()).collect();
        let deletes: Vec<String> = p.of(Action::Delete).map(|o| o.to_string()).collect();
        assert_eq!(
            adds,
            [
                "replace fdb 0e:2a:00:00:00:02 dst 192.168.10.2 dev #10",
                "replace route 10.244.3.0/24 via 192.168.10.3 dev #2 table 254 proto 165",
            ]
        );
        assert_eq!(
            replaces,
            ["replace neighbour 10.244.2.0 lladdr 0e:2a:00:00:00:02 dev #10"]
        );
        assert_eq!(
            deletes,
            [
                "delete route 10.244.9.0/24 via 10.244.9.0 dev #10 onlink table 254 proto 165",
                "delete fdb 0e:2a:00:00:00:22 dst 192.168.10.2 dev #10",
            ]
        );
        // Deletes come last.
        let first_delete = p.ops.iter().position(|(a, _)| *a == Action::Delete);
        assert_eq!(first_delete, Some(p.ops.len() - 2));
        // Before the lease set is known nothing is deleted.
        let p = plan(&objects, &observed, SyncMode::AddOnly);
        assert_eq!(p.of(Action::Delete).count(), 0);
        assert_eq!(p.of(Action::Add).count(), 2);
    }

    #[test]
    fn a_changed_route_is_replaced_and_an_appended_twin_deleted() {
        let objects = expand(&local(), &desired());
        let mut observed = observed_of(&objects);
        // Upstream flanneld's route (proto boot) for the same subnet: adopted and replaced.
        for r in &mut observed.routes {
            if r.dst == net("10.244.2.0/24") {
                r.protocol = 3;
            }
        }
        // Same key, appended a second time with another gateway.
        let twin = Route::new(net("10.244.3.0/24"))
            .via(ip("192.168.10.99"))
            .dev(EXT);
        observed.routes.push(twin.clone());
        // A route of the same subnet with another metric is another key: deleted.
        let metric = Route::new(net("fd00:244:2::/64"))
            .via(ip("fd00:244:2::"))
            .dev(VX6)
            .onlink()
            .metric(100);
        observed.routes.push(metric.clone());
        let p = plan(&objects, &observed, SyncMode::Full);
        let replaces: Vec<&Op> = p.of(Action::Replace).collect();
        assert_eq!(replaces.len(), 1);
        assert!(
            matches!(replaces[0], Op::ReplaceRoute(r) if r.dst == net("10.244.2.0/24") && r.protocol == RTPROT_FLANNEL)
        );
        let deletes: Vec<&Op> = p.of(Action::Delete).collect();
        assert_eq!(
            deletes,
            vec![&Op::DeleteRoute(twin), &Op::DeleteRoute(metric)]
        );
    }

    #[test]
    fn ownership_rules() {
        let l = local();
        let ours = |r: &Route| owned_flannel_route(&l, r);
        let adopted = |r: &Route| adopted_device_route(&l, r);
        // A flannel route to the node's own subnet (or covering it) is not the applier's.
        assert!(!ours(&Route::new(net("10.244.1.0/24")).dev(VX4)));
        assert!(!ours(&Route::new(net("10.244.0.0/16")).dev(VX4)));
        assert!(!ours(&Route::new(net("10.244.1.0/24")).blackhole()));
        assert!(ours(&Route::new(net("10.244.2.0/24")).dev(VX4)));
        assert!(!ours(&Route::new(net("10.244.5.0/24")).blackhole()));
        assert!(!ours(&Route::new(net("10.244.5.0/24")).dev(VX4).table(100)));
        // Routes of other protocols on our device inside the network are adopted, kernel
        // routes and routes outside the network are not.
        let boot = Route::new(net("10.244.2.0/24"))
            .via(ip("10.244.2.0"))
            .dev(VX4)
            .onlink()
            .protocol(3);
        assert!(adopted(&boot));
        assert!(!adopted(&boot.clone().protocol(RTPROT_KERNEL)));
        assert!(!adopted(
            &Route::new(net("10.96.0.0/12")).dev(VX4).protocol(3)
        ));
        assert!(!adopted(
            &Route::new(net("fe80::/64"))
                .dev(VX6)
                .protocol(RTPROT_KERNEL)
                .scope(RouteScope::Universe)
        ));
    }

    #[test]
    fn error_kinds_are_bounded_labels() {
        let e = NetlinkError::Other {
            op: "replace route",
            object: "x".into(),
            errno: libc::EINVAL,
            message: None,
        };
        assert_eq!(error_kind("route", &e), "route:EINVAL");
        let t = NetlinkError::Timeout {
            op: "replace route",
            object: "x".into(),
            seconds: 15,
        };
        assert_eq!(error_kind("fdb", &t), "fdb:timeout");
    }
}
