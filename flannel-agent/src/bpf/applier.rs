//! The eBPF applier: the reconciler's desired model ([`Desired`]) written into the fast path's
//! route map through [`FastPath::sync`] — the second of the "one reconciler, two appliers".
//!
//! Every IPv4 peer path becomes one [`Remote`]: host-gw and DirectRouting peers are followed
//! through the kernel FIB, vxlan peers are encapsulated in the program (when the VXLAN fast
//! path is enabled: not with GBP), ipip peers too. IPv6 paths stay on the kernel path.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::{Arc, Mutex},
};

use futures::future::BoxFuture;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use prometheus_client::metrics::{family::Family, gauge::Gauge};

use super::{FastPath, Remote, Remote6, Via};
use crate::{
    backend::BackendOptions,
    dataplane::{Applier, ApplyError, ApplyReport, ApplyStats, Desired, Local, Reach, SyncMode},
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
    let host_gw = matches!(local.backend, BackendOptions::HostGw);
    let mut out = BTreeMap::new();
    for (_, path) in desired.paths() {
        let IpNet::V4(subnet) = path.subnet else {
            continue;
        };
        let remote = match path.reach {
            Reach::Direct {
                gateway: IpAddr::V4(gateway),
                ..
            } => Remote {
                public_ip: gateway,
                via: if host_gw {
                    Via::HostGw
                } else {
                    Via::DirectRouting
                },
            },
            Reach::Vxlan {
                vtep_mac,
                public_ip: IpAddr::V4(public_ip),
                ..
            } => match vxlan_vni {
                Some(vni) => Remote {
                    public_ip,
                    via: Via::Vxlan {
                        vtep_mac: vtep_mac.octets(),
                        vni,
                    },
                },
                None => continue,
            },
            Reach::Ipip { public_ip, .. } => Remote {
                public_ip,
                via: Via::Ipip,
            },
            // The port is this node's own (`UdpLocal`), as upstream sends to every peer.
            Reach::Udp { public_ip, .. } => Remote {
                public_ip,
                via: Via::Udp,
            },
            _ => continue,
        };
        out.insert(subnet, remote);
    }
    out
}

/// The IPv6 route-map entries for `desired`: host-gw and DirectRouting peers through the
/// kernel FIB, vxlan peers (their v6 VtepMAC and public IPv6) when the VXLAN fast path is
/// enabled (`vxlan_vni`).
pub fn remotes6(
    local: &Local,
    desired: &Desired,
    vxlan_vni: Option<u32>,
) -> BTreeMap<Ipv6Net, Remote6> {
    let host_gw = matches!(local.backend, BackendOptions::HostGw);
    let mut out = BTreeMap::new();
    for (_, path) in desired.paths() {
        let IpNet::V6(subnet) = path.subnet else {
            continue;
        };
        let remote = match path.reach {
            Reach::Direct {
                gateway: IpAddr::V6(gateway),
                ..
            } => Remote6 {
                public_ip: gateway,
                via: if host_gw {
                    Via::HostGw
                } else {
                    Via::DirectRouting
                },
            },
            Reach::Vxlan {
                vtep_mac,
                public_ip: IpAddr::V6(public_ip),
                ..
            } => match vxlan_vni {
                Some(vni) => Remote6 {
                    public_ip,
                    via: Via::Vxlan {
                        vtep_mac: vtep_mac.octets(),
                        vni,
                    },
                },
                None => continue,
            },
            _ => continue,
        };
        out.insert(subnet, remote);
    }
    out
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
    fn report_entries(&self, kind: &str, s: &super::SyncStats) {
        if let Some(entries) = &self.entries {
            entries
                .get_or_create(&KindLabel { kind: kind.into() })
                .set((s.added + s.updated + s.unchanged) as i64);
        }
    }

    fn apply(&self, local: &Local, desired: &Desired, mode: SyncMode) -> ApplyReport {
        let mut want = remotes(local, desired, self.vxlan_vni);
        let mut report = ApplyReport::default();
        let Ok(mut fp) = self.fast_path.lock() else {
            report.errors.push(ApplyError {
                kind: "bpf:lock".into(),
                message: "the fast-path handle is poisoned".into(),
            });
            report.stats.errors += 1;
            return report;
        };
        if mode == SyncMode::AddOnly {
            // Before the first complete listing nothing may be deleted: keep what the maps
            // hold (e.g. entries adopted from the previous run's pins).
            match fp.remotes() {
                Ok(current) => {
                    for (subnet, remote) in current {
                        want.entry(subnet).or_insert(remote);
                    }
                }
                Err(err) => {
                    report.errors.push(ApplyError {
                        kind: "bpf:read".into(),
                        message: format!("reading the route map: {err}"),
                    });
                    report.stats.errors += 1;
                    return report;
                }
            }
        }
        match fp.sync(&want) {
            Ok(s) => {
                add_stats(&mut report.stats, &s);
                self.report_entries("routes4", &s);
            }
            Err(err) => {
                report.errors.push(ApplyError {
                    kind: "bpf:sync".into(),
                    message: format!("syncing the fast-path maps: {err}"),
                });
                report.stats.errors += 1;
            }
        }
        let mut want6 = remotes6(local, desired, self.vxlan_vni);
        if mode == SyncMode::AddOnly {
            match fp.remotes6() {
                Ok(current) => {
                    for (subnet, remote) in current {
                        want6.entry(subnet).or_insert(remote);
                    }
                }
                Err(err) => {
                    report.errors.push(ApplyError {
                        kind: "bpf:read".into(),
                        message: format!("reading the IPv6 route map: {err}"),
                    });
                    report.stats.errors += 1;
                    return report;
                }
            }
        }
        match fp.sync6(&want6) {
            Ok(s) => {
                add_stats(&mut report.stats, &s);
                self.report_entries("routes6", &s);
            }
            Err(err) => {
                report.errors.push(ApplyError {
                    kind: "bpf:sync".into(),
                    message: format!("syncing the fast-path IPv6 maps: {err}"),
                });
                report.stats.errors += 1;
            }
        }
        report
    }
}

/// Adds one map family's sync counts to the applier's statistics.
fn add_stats(stats: &mut ApplyStats, s: &super::SyncStats) {
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
    fn read(&self) -> Vec<FastPathCount> {
        let Ok(fp) = self.0.lock() else {
            return Vec::new();
        };
        let Ok(counters) = fp.counters() else {
            return Vec::new();
        };
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
        out
    }
}
