//! The appliers' own writes and deletions, so that the kernel's notification of each
//! (`RTM_NEWROUTE`, `RTM_NEWNEIGH`, `RTM_DELROUTE`, `RTM_DELNEIGH`) does not bring another
//! reconcile. Every notification that a route, neighbour or FDB entry of the dataplane was
//! removed, or that one was added or replaced under a key the dataplane owns, otherwise
//! does: that is how an entry deleted or changed by hand is put back at once. At 5,000 peers
//! such a reconcile lists and diffs 15,000 kernel entries (about 30 ms), and a lease event
//! arriving meanwhile waited for it: every lease that went away cost the next event two of
//! them.
//!
//! A change is remembered until its notification arrives, or for [`KEPT_FOR`] at most (a
//! notification lost with an overrun brings a reconcile anyway). A write the kernel found
//! already in place tells of nothing; it is forgotten after [`KEPT_FOR`] the same way.

use std::{collections::HashMap, time::Duration};

use tokio::time::Instant;

use crate::netlink::{Entry, EntryChange, LinkEvent};

/// How long a change waits for its notification.
pub const KEPT_FOR: Duration = Duration::from_secs(10);

/// The entries the appliers wrote or deleted whose notifications have not arrived yet.
#[derive(Debug, Default)]
pub struct OwnChanges {
    /// Each change: how many of its notifications are awaited, and until when.
    awaited: HashMap<(EntryChange, Entry), (u32, Instant)>,
}

impl OwnChanges {
    /// Remembers that the appliers added or replaced `written` just now.
    pub fn wrote(&mut self, written: impl IntoIterator<Item = Entry>) {
        self.remember(EntryChange::Written, written);
    }

    /// Remembers that the appliers deleted `removed` just now.
    pub fn deleted(&mut self, removed: impl IntoIterator<Item = Entry>) {
        self.remember(EntryChange::Removed, removed);
    }

    fn remember(&mut self, change: EntryChange, entries: impl IntoIterator<Item = Entry>) {
        let now = Instant::now();
        self.awaited.retain(|_, (_, until)| *until > now);
        for entry in entries {
            let (count, until) = self.awaited.entry((change, entry)).or_insert((0, now));
            *count += 1;
            *until = now + KEPT_FOR;
        }
    }

    /// Whether `event` tells of one of those changes (which it then no longer awaits).
    pub fn is_own(&mut self, event: &LinkEvent) -> bool {
        let Some((change, Some(entry))) = event.entry_change() else {
            return false;
        };
        let key = (change, entry);
        let now = Instant::now();
        match self.awaited.get_mut(&key) {
            Some((count, until)) if *until > now => {
                *count -= 1;
                if *count == 0 {
                    self.awaited.remove(&key);
                }
                true
            }
            Some(_) => {
                self.awaited.remove(&key);
                false
            }
            None => false,
        }
    }

    /// Changes still awaited.
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

    fn route(dst: &str) -> Entry {
        Entry::Route {
            table: 254,
            dst: dst.parse().unwrap(),
        }
    }

    /// The kernel's notification of `entry` written or removed.
    fn told(change: EntryChange, entry: Entry) -> LinkEvent {
        match (change, entry) {
            (EntryChange::Written, Entry::Route { .. }) => LinkEvent::RouteAdded {
                protocol: 165,
                entry: Some(entry),
            },
            (EntryChange::Removed, Entry::Route { .. }) => LinkEvent::RouteRemoved {
                protocol: 165,
                entry: Some(entry),
            },
            (EntryChange::Written, Entry::Neighbour { index, .. } | Entry::Fdb { index, .. }) => {
                LinkEvent::NeighbourAdded {
                    index,
                    entry: Some(entry),
                }
            }
            (EntryChange::Removed, Entry::Neighbour { index, .. } | Entry::Fdb { index, .. }) => {
                LinkEvent::NeighbourRemoved {
                    index,
                    entry: Some(entry),
                }
            }
        }
    }

    fn removed(entry: Entry) -> LinkEvent {
        told(EntryChange::Removed, entry)
    }

    fn added(entry: Entry) -> LinkEvent {
        told(EntryChange::Written, entry)
    }

    #[tokio::test(start_paused = true)]
    async fn each_deletion_absorbs_one_notification_of_it() {
        let mut own = OwnChanges::default();
        let neighbour = Entry::Neighbour {
            index: 3,
            ip: "10.244.2.0".parse().unwrap(),
        };
        let fdb = Entry::Fdb {
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
        assert!(!own.is_own(&removed(Entry::Neighbour {
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
    async fn a_write_absorbs_a_notification_of_its_write_not_of_a_deletion() {
        let mut own = OwnChanges::default();
        let neighbour = Entry::Neighbour {
            index: 3,
            ip: "10.244.2.0".parse().unwrap(),
        };
        own.wrote([route("10.244.2.0/24"), neighbour]);
        own.deleted([route("10.244.3.0/24")]);
        assert!(!own.is_own(&removed(route("10.244.2.0/24"))));
        assert!(!own.is_own(&added(route("10.244.3.0/24"))));
        assert!(!own.is_own(&LinkEvent::NeighbourAdded {
            index: 3,
            entry: None
        }));
        assert!(own.is_own(&added(route("10.244.2.0/24"))));
        assert!(own.is_own(&added(neighbour)));
        assert!(!own.is_own(&added(neighbour)), "absorbed once only");
        assert!(own.is_own(&removed(route("10.244.3.0/24"))));
        assert!(own.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_notification_too_late_is_not_taken_for_ours() {
        let mut own = OwnChanges::default();
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
