//! The udp backend's [`Applier`]: turns the desired peers reached over
//! [`Reach::Udp`] into the forwarder's [`UdpRoutes`] and swaps the table in when it changed.
//! The kernel applier has nothing to do for these peers (the only kernel route, `<Network>
//! dev flannel0`, belongs to the device set-up).

use std::{net::SocketAddrV4, sync::Arc};

use futures::future::{BoxFuture, FutureExt as _};
use ipnet::IpNet;
use tokio::sync::watch;

use crate::dataplane::{Applier, ApplyReport, ApplyStats, Desired, Local, Reach, SyncMode};

use super::routes::{UdpRoute, UdpRoutes};

/// Publishes the routing table to the forwarder.
#[derive(Debug, Clone)]
pub struct UdpApplier {
    routes: watch::Sender<Arc<UdpRoutes>>,
}

impl UdpApplier {
    /// An applier feeding `routes` (see [`UdpForwarder::applier`](super::UdpForwarder::applier)).
    pub fn new(routes: watch::Sender<Arc<UdpRoutes>>) -> Self {
        Self { routes }
    }
}

/// The udp routes of `desired`.
pub fn routes_of(desired: &Desired) -> Vec<UdpRoute> {
    desired
        .paths()
        .filter_map(|(_, path)| match (path.subnet, path.reach) {
            (IpNet::V4(subnet), Reach::Udp { public_ip, port }) => Some(UdpRoute {
                subnet: subnet.trunc(),
                endpoint: SocketAddrV4::new(public_ip, port),
            }),
            _ => None,
        })
        .collect()
}

/// The table for `desired` given the `current` one: in [`SyncMode::AddOnly`] routes of
/// subnets not desired are kept.
pub fn next_table(current: &UdpRoutes, desired: &Desired, mode: SyncMode) -> UdpRoutes {
    let mut want = routes_of(desired);
    if mode == SyncMode::AddOnly {
        let kept: Vec<UdpRoute> = current
            .iter()
            .filter(|r| !want.iter().any(|w| w.subnet == r.subnet))
            .collect();
        want.extend(kept);
    }
    UdpRoutes::new(want)
}

/// What changed between two tables.
pub fn diff(current: &UdpRoutes, next: &UdpRoutes) -> ApplyStats {
    let mut stats = ApplyStats::default();
    for r in next.iter() {
        match current.get(r.subnet) {
            None => stats.added += 1,
            Some(ep) if ep == r.endpoint => stats.unchanged += 1,
            Some(_) => stats.replaced += 1,
        }
    }
    stats.deleted = current
        .iter()
        .filter(|r| next.get(r.subnet).is_none())
        .count() as u64;
    stats
}

impl Applier for UdpApplier {
    fn name(&self) -> &'static str {
        "udp"
    }

    fn sync<'a>(
        &'a mut self,
        _local: &'a Local,
        desired: &'a Desired,
        mode: SyncMode,
    ) -> BoxFuture<'a, ApplyReport> {
        let current = self.routes.borrow().clone();
        let next = next_table(&current, desired, mode);
        let mut stats = diff(&current, &next);
        if next != *current {
            self.routes.send_replace(Arc::new(next));
            stats.ops = 1;
        }
        futures::future::ready(ApplyReport {
            stats,
            ..ApplyReport::default()
        })
        .boxed()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;
    use crate::dataplane::{Peer, PeerPath};

    fn peer(id: &str, subnet: &str, ip: [u8; 4]) -> Peer {
        Peer {
            id: id.into(),
            v4: Some(PeerPath {
                subnet: subnet.parse().unwrap(),
                reach: Reach::Udp {
                    public_ip: ip.into(),
                    port: 8285,
                },
            }),
            v6: None,
        }
    }

    fn desired(peers: Vec<Peer>) -> Desired {
        Desired {
            peers,
            notes: Vec::new(),
            extension: Vec::new(),
        }
    }

    #[test]
    fn tables_follow_the_desired_peers() {
        let d = desired(vec![
            peer("a", "10.244.2.0/24", [192, 168, 1, 12]),
            peer("b", "10.244.3.0/24", [192, 168, 1, 13]),
        ]);
        let t1 = next_table(&UdpRoutes::default(), &d, SyncMode::Full);
        assert_eq!(t1.len(), 2);
        assert_eq!(
            t1.lookup("10.244.3.9".parse().unwrap()),
            Some("192.168.1.13:8285".parse().unwrap())
        );
        let s = diff(&UdpRoutes::default(), &t1);
        assert_eq!((s.added, s.unchanged, s.replaced, s.deleted), (2, 0, 0, 0));

        // b moves to another public IP, a goes away, c arrives.
        let d2 = desired(vec![
            peer("b", "10.244.3.0/24", [192, 168, 1, 99]),
            peer("c", "10.244.4.0/24", [192, 168, 1, 14]),
        ]);
        let t2 = next_table(&t1, &d2, SyncMode::Full);
        let s = diff(&t1, &t2);
        assert_eq!((s.added, s.unchanged, s.replaced, s.deleted), (1, 0, 1, 1));
        assert_eq!(t2.lookup("10.244.2.1".parse().unwrap()), None);

        // Add-only keeps what is not desired.
        let t3 = next_table(&t1, &d2, SyncMode::AddOnly);
        assert_eq!(t3.len(), 3);
        assert_eq!(
            t3.lookup("10.244.3.1".parse().unwrap()),
            Some("192.168.1.99:8285".parse().unwrap())
        );
        assert!(t3.lookup("10.244.2.1".parse().unwrap()).is_some());
    }

    #[test]
    fn other_reaches_are_not_udp_routes() {
        let mut p = peer("a", "10.244.2.0/24", [192, 168, 1, 12]);
        p.v4 = Some(PeerPath {
            subnet: "10.244.2.0/24".parse().unwrap(),
            reach: Reach::Ipip {
                public_ip: [192, 168, 1, 12].into(),
                next_hop: None,
            },
        });
        assert!(routes_of(&desired(vec![p])).is_empty());
    }

    #[tokio::test]
    async fn sync_publishes_only_changes() {
        let (tx, mut rx) = watch::channel(Arc::new(UdpRoutes::default()));
        let mut a = UdpApplier::new(tx);
        let d = desired(vec![peer("a", "10.244.2.0/24", [192, 168, 1, 12])]);
        let local = crate::udp::device::tests::local();
        let r = a.sync(&local, &d, SyncMode::Full).await;
        assert_eq!((r.stats.added, r.stats.ops), (1, 1));
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();
        let r = a.sync(&local, &d, SyncMode::Full).await;
        assert_eq!((r.stats.unchanged, r.stats.ops), (1, 0));
        assert!(!rx.has_changed().unwrap());
        let r = a.sync(&local, &desired(vec![]), SyncMode::Full).await;
        assert_eq!(r.stats.deleted, 1);
        assert!(rx.borrow().is_empty());
    }
}
