//! The eBPF applier: the reconciler's desired model ([`Desired`]) written into the fast path's
//! route maps through [`FastPath::sync`] and [`FastPath::sync6`] — the second of the "one
//! reconciler, two appliers".
//!
//! Every peer path becomes one [`Remote`] (IPv4) or [`Remote6`]: host-gw and DirectRouting
//! peers are followed through the kernel FIB, vxlan peers are encapsulated in the program (when
//! the VXLAN fast path is enabled: not with GBP), ipip and udp peers (IPv4 only) too. A path
//! whose peer address is of the other family than its pod subnet stays on the kernel path.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::{Arc, Mutex},
};

use futures::future::BoxFuture;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use prometheus_client::metrics::{family::Family, gauge::Gauge};

use super::{BpfError, FastPath, Remote, Remote6, SyncStats, Via};
use crate::{
    backend::BackendOptions,
    dataplane::{Applier, ApplyReport, ApplyStats, Desired, Local, Reach, SyncMode},
    metrics::{CounterSource, FastPathCount, KindLabel},
};

/// The loaded fast path, shared by the applier, the bridge attacher and the metrics.
pub type SharedFastPath = Arc<Mutex<FastPath>>;

/// The route-map entries for `desired`. `vxlan_vni` is the local device's VNI when the VXLAN
/// fast path is enabled (`None`: vxlan paths stay on `flannel.<VNI>`).
pub fn remotes(
    local: &Local,
    desired: &Desired,
    vxlan_vni: Option<u32>,
) -> BTreeMap<Ipv4Net, Remote> {
    entries(local, desired, vxlan_vni)
        .filter_map(|(subnet, public_ip, via)| match (subnet, public_ip) {
            (IpNet::V4(subnet), IpAddr::V4(public_ip)) => Some((subnet, Remote { public_ip, via })),
            _ => None,
        })
        .collect()
}

/// The IPv6 route-map entries for `desired`: host-gw and DirectRouting peers through the
/// kernel FIB, vxlan peers (their v6 VtepMAC and public IPv6) when the VXLAN fast path is
/// enabled (`vxlan_vni`).
pub fn remotes6(
    local: &Local,
    desired: &Desired,
    vxlan_vni: Option<u32>,
) -> BTreeMap<Ipv6Net, Remote6> {
    entries(local, desired, vxlan_vni)
        .filter_map(|(subnet, public_ip, via)| match (subnet, public_ip) {
            (IpNet::V6(subnet), IpAddr::V6(public_ip)) => {
                Some((subnet, Remote6 { public_ip, via }))
            }
            _ => None,
        })
        .collect()
}

/// Every desired path the programs can carry, as (pod subnet, the peer's public IP, how): a
/// path whose public IP is of the other family than its subnet is left to the kernel path.
fn entries<'a>(
    local: &Local,
    desired: &'a Desired,
    vxlan_vni: Option<u32>,
) -> impl Iterator<Item = (IpNet, IpAddr, Via)> + 'a {
    let host_gw = matches!(local.backend, BackendOptions::HostGw);
    desired.paths().filter_map(move |(_, path)| {
        let (public_ip, via) = match path.reach {
            Reach::Direct { gateway, .. } => (
                gateway,
                if host_gw {
                    Via::HostGw
                } else {
                    Via::DirectRouting
                },
            ),
            Reach::Vxlan {
                vtep_mac,
                public_ip,
                ..
            } => (
                public_ip,
                Via::Vxlan {
                    vtep_mac: vtep_mac.octets(),
                    vni: vxlan_vni?,
                },
            ),
            Reach::Ipip { public_ip, .. } => (IpAddr::V4(public_ip), Via::Ipip),
            // The port is this node's own (`UdpLocal`), as upstream sends to every peer.
            Reach::Udp { public_ip, .. } => (IpAddr::V4(public_ip), Via::Udp),
            _ => return None,
        };
        Some((path.subnet, public_ip, via))
    })
}

/// Keeps the fast path's maps equal to the desired model.
pub struct BpfApplier {
    fast_path: SharedFastPath,
    vxlan_vni: Option<u32>,
    /// `flannel_bpf_map_entries`, when exported: route entries per family after each sync.
    entries: Option<Family<KindLabel, Gauge>>,
}

impl BpfApplier {
    pub fn new(fast_path: SharedFastPath, vxlan_vni: Option<u32>) -> Self {
        Self {
            fast_path,
            vxlan_vni,
            entries: None,
        }
    }

    /// Reports the route maps' entries (`routes4`, `routes6`) in `entries` after every sync.
    pub fn with_entries_gauge(mut self, entries: Family<KindLabel, Gauge>) -> Self {
        self.entries = Some(entries);
        self
    }

    /// Sets the `kind` gauge to the entries a successful sync left.
    fn report_entries(&self, kind: &str, s: &SyncStats) {
        if let Some(entries) = &self.entries {
            entries
                .get_or_create(&KindLabel { kind: kind.into() })
                .set((s.added + s.updated + s.unchanged) as i64);
        }
    }

    fn apply(&self, local: &Local, desired: &Desired, mode: SyncMode) -> ApplyReport {
        let mut report = ApplyReport::default();
        let Ok(mut fp) = self.fast_path.lock() else {
            report.fail("bpf:lock", "the fast-path handle is poisoned");
            return report;
        };
        // The reconciler follows the external interface to a new index (deleted and created
        // again); the programs go with it.
        let ext = &local.ext;
        match fp.follow_netdev(ext.index) {
            Ok(None) => {}
            Ok(Some(old)) => tracing::warn!(
                iface = %ext.name,
                old,
                new = ext.index,
                "the external interface was re-created; fast path following it"
            ),
            Err(err) => report.fail(
                "bpf:attach",
                format!(
                    "moving the fast path to the external interface {} (index {}): {err}",
                    ext.name, ext.index
                ),
            ),
        }
        if self.sync_family(
            &mut report,
            mode,
            remotes(local, desired, self.vxlan_vni),
            &V4,
            &mut fp,
        ) {
            let want6 = remotes6(local, desired, self.vxlan_vni);
            self.sync_family(&mut report, mode, want6, &V6, &mut fp);
        }
        report
    }

    /// Writes one family's route map to `want` (after a first complete listing; before it,
    /// `mode` keeps what the map holds, e.g. entries adopted from the previous run's pins).
    /// `false` if the map could not be read, so that nothing else is written this round.
    fn sync_family<N: Ord, R>(
        &self,
        report: &mut ApplyReport,
        mode: SyncMode,
        mut want: BTreeMap<N, R>,
        family: &RouteMaps<N, R>,
        fp: &mut FastPath,
    ) -> bool {
        if mode == SyncMode::AddOnly {
            match (family.current)(fp) {
                Ok(current) => {
                    for (subnet, remote) in current {
                        want.entry(subnet).or_insert(remote);
                    }
                }
                Err(err) => {
                    let what = family.name;
                    report.fail("bpf:read", format!("reading the {what} route map: {err}"));
                    return false;
                }
            }
        }
        match (family.sync)(fp, &want) {
            Ok(s) => {
                add_stats(&mut report.stats, &s);
                self.report_entries(family.entries, &s);
            }
            Err(err) => {
                let what = family.name;
                report.fail(
                    "bpf:sync",
                    format!("syncing the fast-path {what} maps: {err}"),
                );
            }
        }
        true
    }
}

/// One address family's route maps, as the applier reads and writes them.
struct RouteMaps<N, R> {
    /// The family, for messages.
    name: &'static str,
    /// The `flannel_bpf_map_entries` kind.
    entries: &'static str,
    current: fn(&FastPath) -> Result<BTreeMap<N, R>, BpfError>,
    sync: fn(&mut FastPath, &BTreeMap<N, R>) -> Result<SyncStats, BpfError>,
}

const V4: RouteMaps<Ipv4Net, Remote> = RouteMaps {
    name: "IPv4",
    entries: "routes4",
    current: FastPath::remotes,
    sync: FastPath::sync,
};

const V6: RouteMaps<Ipv6Net, Remote6> = RouteMaps {
    name: "IPv6",
    entries: "routes6",
    current: FastPath::remotes6,
    sync: FastPath::sync6,
};

/// Adds one map family's sync counts to the applier's statistics.
fn add_stats(stats: &mut ApplyStats, s: &SyncStats) {
    stats.added += s.added as u64;
    stats.replaced += s.updated as u64;
    stats.deleted += s.removed as u64;
    stats.unchanged += s.unchanged as u64;
    stats.ops += (s.added + s.updated + s.removed + s.nodes_written + s.nodes_removed) as u64;
}

impl Applier for BpfApplier {
    fn name(&self) -> &'static str {
        "ebpf"
    }

    fn quick(&self) -> bool {
        true
    }

    fn sync<'a>(
        &'a mut self,
        local: &'a Local,
        desired: &'a Desired,
        mode: SyncMode,
    ) -> BoxFuture<'a, ApplyReport> {
        Box::pin(async move { self.apply(local, desired, mode) })
    }
}

/// The fast path's per-program counters for `/metrics`, read at scrape time.
pub struct FastPathCounters(pub SharedFastPath);

impl CounterSource for FastPathCounters {
    fn read(&self) -> Result<Vec<FastPathCount>, String> {
        let fp = self
            .0
            .lock()
            .map_err(|_| "the fast path's lock is poisoned".to_owned())?;
        let counters = fp.counters().map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        for (program, per_reason) in counters.by_program() {
            for (reason, c) in per_reason.nonzero() {
                out.push(FastPathCount {
                    program,
                    reason: reason.name(),
                    packets: c.packets,
                    bytes: c.bytes,
                });
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::{
        dataplane::{
            Peer, PeerPath,
            desired::tests::{local, mac, vxlan},
        },
        ip::IpStack,
    };

    const PEER4: Ipv4Addr = Ipv4Addr::new(192, 168, 10, 2);
    const PEER6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 2);

    fn path(subnet: &str, reach: Reach) -> Option<PeerPath> {
        Some(PeerPath {
            subnet: subnet.parse().unwrap(),
            reach,
        })
    }

    fn direct(subnet: &str, gateway: IpAddr) -> Option<PeerPath> {
        path(subnet, Reach::Direct { gateway, oif: 2 })
    }

    fn vxlan_to(subnet: &str, last: u8, public_ip: IpAddr) -> Option<PeerPath> {
        let vtep_mac = mac(last);
        path(
            subnet,
            Reach::Vxlan {
                vtep_mac,
                vni: 1,
                public_ip,
            },
        )
    }

    /// One peer per `(v4, v6)` pair.
    fn desired(peers: Vec<(Option<PeerPath>, Option<PeerPath>)>) -> Desired {
        let peers = peers.into_iter().enumerate();
        Desired {
            peers: peers
                .map(|(i, (v4, v6))| Peer {
                    id: format!("lease-{i}"),
                    v4,
                    v6,
                })
                .collect(),
            notes: Vec::new(),
            extension: Vec::new(),
        }
    }

    fn vias4(want: &Desired, backend: BackendOptions, vni: Option<u32>) -> Vec<(String, Via)> {
        let local = local(backend, IpStack::Dual);
        let out = remotes(&local, want, vni).into_iter();
        out.map(|(n, r)| (format!("{n} via {}", r.public_ip), r.via))
            .collect()
    }

    fn vias6(want: &Desired, backend: BackendOptions, vni: Option<u32>) -> Vec<(String, Via)> {
        let local = local(backend, IpStack::Dual);
        let out = remotes6(&local, want, vni).into_iter();
        out.map(|(n, r)| (format!("{n} via {}", r.public_ip), r.via))
            .collect()
    }

    #[test]
    fn each_path_becomes_the_entry_of_its_family() {
        let want = desired(vec![
            (
                vxlan_to("10.244.2.0/24", 2, PEER4.into()),
                vxlan_to("fd00:244:2::/64", 0x62, PEER6.into()),
            ),
            (
                direct("10.244.3.0/24", PEER4.into()),
                direct("fd00:244:3::/64", PEER6.into()),
            ),
            // An IPv6 pod subnet behind an IPv4 VTEP: not the programs' to carry.
            (None, vxlan_to("fd00:244:4::/64", 0x64, PEER4.into())),
        ]);
        let vx = |last: u8| Via::Vxlan {
            vtep_mac: mac(last).octets(),
            vni: 7,
        };
        assert_eq!(
            vias4(&want, vxlan(true), Some(7)),
            [
                ("10.244.2.0/24 via 192.168.10.2".to_owned(), vx(2)),
                (
                    "10.244.3.0/24 via 192.168.10.2".to_owned(),
                    Via::DirectRouting
                ),
            ]
        );
        assert_eq!(
            vias6(&want, vxlan(true), Some(7)),
            [
                ("fd00:244:2::/64 via fd00:10::2".to_owned(), vx(0x62)),
                (
                    "fd00:244:3::/64 via fd00:10::2".to_owned(),
                    Via::DirectRouting
                ),
            ]
        );
        // Without the VXLAN fast path the tunnelled peers stay on flannel.<VNI>.
        assert_eq!(vias4(&want, vxlan(true), None).len(), 1);
        assert_eq!(vias6(&want, vxlan(true), None).len(), 1);
    }

    #[test]
    fn host_gw_ipip_and_udp_paths() {
        let want = desired(vec![
            (
                direct("10.244.2.0/24", PEER4.into()),
                direct("fd00:244:2::/64", PEER6.into()),
            ),
            (
                path(
                    "10.244.3.0/24",
                    Reach::Ipip {
                        public_ip: PEER4,
                        next_hop: None,
                    },
                ),
                None,
            ),
            (
                path(
                    "10.244.4.0/24",
                    Reach::Udp {
                        public_ip: PEER4,
                        port: 8285,
                    },
                ),
                None,
            ),
            (
                path("10.244.5.0/24", Reach::Ipsec { public_ip: PEER4 }),
                None,
            ),
        ]);
        let vias = |v: Vec<(String, Via)>| v.into_iter().map(|(_, via)| via).collect::<Vec<_>>();
        assert_eq!(
            vias(vias4(&want, BackendOptions::HostGw, None)),
            [Via::HostGw, Via::Ipip, Via::Udp]
        );
        assert_eq!(
            vias(vias6(&want, BackendOptions::HostGw, None)),
            [Via::HostGw]
        );
    }
}
