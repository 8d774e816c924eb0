//! The reconciler's own deletions, so that the kernel's notification of each
//! (`RTM_DELROUTE`, `RTM_DELNEIGH`) does not bring another reconcile: every removal
//! notification of a route, neighbour or FDB entry of the dataplane otherwise does, which is
//! how an entry deleted by hand comes back at once. At 5,000 peers such a reconcile lists and
//! diffs 15,000 kernel entries (about 30 ms), and a lease event arriving meanwhile waited for
//! it: every lease that went away cost the next event two of them.
//!
//! A deletion is remembered until its notification arrives, or for [`KEPT_FOR`] at most (a
//! notification lost with an overrun brings a reconcile anyway).

use std::{collections::HashMap, time::Duration};

use tokio::time::Instant;

use crate::netlink::{LinkEvent, Removal};

/// How long a deletion waits for its notification.
pub const KEPT_FOR: Duration = Duration::from_secs(10);

/// The entries the appliers deleted whose notifications have not arrived yet.
#[derive(Debug, Default)]
pub struct OwnRemovals {
    /// Each entry: how many deletions of it are awaited, and until when.
    awaited: HashMap<Removal, (u32, Instant)>,
}

impl OwnRemovals {
    /// Remembers that the appliers deleted `removed` just now.
    pub fn deleted(&mut self, removed: impl IntoIterator<Item = Removal>) {
        let now = Instant::now();
        self.awaited.retain(|_, (_, until)| *until > now);
        for entry in removed {
            let (count, until) = self.awaited.entry(entry).or_insert((0, now));
            *count += 1;
            *until = now + KEPT_FOR;
        }
    }

    /// Whether `event` tells of one of those deletions (which it then no longer awaits).
    pub fn is_own(&mut self, event: &LinkEvent) -> bool {
        let (LinkEvent::RouteRemoved {
            entry: Some(entry), ..
        }
        | LinkEvent::NeighbourRemoved {
            entry: Some(entry), ..
        }) = event
        else {
            return false;
        };
        let now = Instant::now();
        match self.awaited.get_mut(entry) {
            Some((count, until)) if *until > now => {
                *count -= 1;
                if *count == 0 {
                    self.awaited.remove(entry);
                }
                true
            }
            Some(_) => {
                self.awaited.remove(entry);
                false
            }
            None => false,
        }
    }

    /// Deletions still awaited.
    pub fn len(&self) -> usize {
        self.awaited.len()
    }

    /// Nothing awaited.
    pub fn is_empty(&self) -> bool {
        self.awaited.is_empty()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn route(dst: &str) -> Removal {
        Removal::Route {
            table: 254,
            dst: dst.parse().unwrap(),
        }
    }

    fn removed(entry: Removal) -> LinkEvent {
        match entry {
            Removal::Route { .. } => LinkEvent::RouteRemoved {
                protocol: 165,
                entry: Some(entry),
            },
            Removal::Neighbour { index, .. } | Removal::Fdb { index, .. } => {
                LinkEvent::NeighbourRemoved {
                    index,
                    entry: Some(entry),
                }
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn each_deletion_absorbs_one_notification_of_it() {
        let mut own = OwnRemovals::default();
        let neighbour = Removal::Neighbour {
            index: 3,
            ip: "10.244.2.0".parse().unwrap(),
        };
        let fdb = Removal::Fdb {
            index: 3,
            mac: [0x0e, 0, 0, 0, 0, 2],
        };
        own.deleted([
            route("10.244.2.0/24"),
            neighbour,
            fdb,
            route("10.244.2.0/24"),
        ]);
        assert_eq!(own.len(), 3);
        // Someone else's deletion of another entry, or one the message does not name.
        assert!(!own.is_own(&removed(route("10.244.3.0/24"))));
        assert!(!own.is_own(&LinkEvent::RouteRemoved {
            protocol: 165,
            entry: None
        }));
        assert!(!own.is_own(&removed(Removal::Neighbour {
            index: 4,
            ip: "10.244.2.0".parse().unwrap(),
        })));
        assert!(own.is_own(&removed(neighbour)));
        assert!(own.is_own(&removed(fdb)));
        // Deleted twice: two notifications are ours, a third is not.
        assert!(own.is_own(&removed(route("10.244.2.0/24"))));
        assert!(own.is_own(&removed(route("10.244.2.0/24"))));
        assert!(!own.is_own(&removed(route("10.244.2.0/24"))));
        assert!(!own.is_own(&removed(neighbour)), "absorbed once only");
        assert!(own.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_notification_too_late_is_not_taken_for_ours() {
        let mut own = OwnRemovals::default();
        own.deleted([route("10.244.2.0/24")]);
        tokio::time::advance(KEPT_FOR + Duration::from_millis(1)).await;
        assert!(!own.is_own(&removed(route("10.244.2.0/24"))));
        assert!(own.is_empty());
        // Expired ones are dropped when more deletions come.
        own.deleted([route("10.244.3.0/24")]);
        tokio::time::advance(KEPT_FOR + Duration::from_millis(1)).await;
        own.deleted([route("10.244.4.0/24")]);
        assert_eq!(own.len(), 1);
    }
}
