//! Subnet managers: where the node's own lease and everybody else's come from.
//!
//! Two implementations share this contract: [`etcd`] (upstream's default registry) and
//! [`kube`] (`--kube-subnet-mgr`, leases in Node objects). Neither emits events to the
//! dataplane. Each keeps the *current, complete set* of remote leases and publishes it through a
//! [`LeasePublisher`]; the dataplane reconciler reads [`LeaseSnapshot`]s from the matching
//! `watch::Receiver`. Bursts coalesce into one snapshot and a consumer that falls behind simply
//! sees the newest set, so there is no event queue to overflow and no event to miss: after a
//! reconnect or a compacted revision a manager re-lists and publishes the fresh set.

pub mod etcd;
pub mod kube;

use std::{collections::BTreeMap, sync::Arc};

use tokio::sync::watch;

use crate::lease::Lease;

/// Identifies a remote lease inside a snapshot: the etcd subnet key (`10.5.52.0-24`, with
/// `&<v6>-<len>` when dual stack) in etcd mode, `node/<name>` in kube mode.
pub type LeaseId = String;

/// The remote leases known at one moment (the node's own lease is never included).
#[derive(Clone, Debug, Default)]
pub struct LeaseSnapshot {
    /// Increases by one with every published change; 0 is the empty initial value.
    pub generation: u64,
    /// True once the manager has delivered its first complete listing. Before that the set
    /// is empty because nothing is known yet, not because there are no peers, so a
    /// reconciler must not delete state on an unsynced snapshot.
    pub synced: bool,
    /// Every remote lease, by id.
    pub leases: Arc<BTreeMap<LeaseId, Lease>>,
}

/// Creates the channel a subnet manager publishes into and the dataplane reads from.
pub fn lease_channel() -> (LeasePublisher, watch::Receiver<LeaseSnapshot>) {
    let (tx, rx) = watch::channel(LeaseSnapshot::default());
    (LeasePublisher { tx }, rx)
}

/// The writing end of [`lease_channel`]. Cheap to clone.
#[derive(Clone, Debug)]
pub struct LeasePublisher {
    tx: watch::Sender<LeaseSnapshot>,
}

impl LeasePublisher {
    /// Replaces the whole set (after a listing); marks the snapshot synced.
    pub fn replace_all(&self, leases: BTreeMap<LeaseId, Lease>) {
        self.tx.send_if_modified(|snap| {
            if snap.synced && *snap.leases == leases {
                return false;
            }
            snap.generation += 1;
            snap.synced = true;
            snap.leases = Arc::new(leases);
            true
        });
    }

    /// Adds or replaces one lease. Publishes only if it differs from what is known.
    pub fn upsert(&self, id: LeaseId, lease: Lease) {
        self.tx.send_if_modified(|snap| {
            if snap.leases.get(&id) == Some(&lease) {
                return false;
            }
            Arc::make_mut(&mut snap.leases).insert(id, lease);
            snap.generation += 1;
            true
        });
    }

    /// Applies `changes` (a lease by id, `None` to remove it) in one snapshot, which is then
    /// complete (`synced`): the first call's changes are the whole set. Publishes only if
    /// that makes a difference.
    pub fn apply(&self, changes: Vec<(LeaseId, Option<Lease>)>) {
        self.tx.send_if_modified(|snap| {
            if snap.synced
                && changes
                    .iter()
                    .all(|(id, lease)| snap.leases.get(id) == lease.as_ref())
            {
                return false;
            }
            snap.synced = true;
            let leases = Arc::make_mut(&mut snap.leases);
            for (id, lease) in changes {
                match lease {
                    Some(lease) => {
                        leases.insert(id, lease);
                    }
                    None => {
                        leases.remove(&id);
                    }
                }
            }
            snap.generation += 1;
            true
        });
    }

    /// Removes one lease. Publishes only if it was known.
    pub fn remove(&self, id: &str) {
        self.tx.send_if_modified(|snap| {
            if !snap.leases.contains_key(id) {
                return false;
            }
            Arc::make_mut(&mut snap.leases).remove(id);
            snap.generation += 1;
            true
        });
    }

    /// The current snapshot (for status output and tests).
    pub fn current(&self) -> LeaseSnapshot {
        self.tx.borrow().clone()
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::lease::{LeaseAttrs, SubnetKey};

    fn lease(key: &str, ip: [u8; 4]) -> Lease {
        let attrs = LeaseAttrs {
            public_ip: Ipv4Addr::from(ip),
            ..LeaseAttrs::default()
        };
        Lease::new(SubnetKey::parse(key).unwrap(), attrs, None)
    }

    #[test]
    fn publisher_coalesces_and_skips_no_ops() {
        let (publisher, mut rx) = lease_channel();
        assert!(!rx.borrow().synced);

        publisher.replace_all(BTreeMap::new());
        assert!(rx.has_changed().unwrap());
        let snap = rx.borrow_and_update().clone();
        assert!(snap.synced);
        assert_eq!(snap.generation, 1);

        publisher.upsert("10.5.1.0-24".into(), lease("10.5.1.0-24", [1, 1, 1, 1]));
        publisher.upsert("10.5.2.0-24".into(), lease("10.5.2.0-24", [1, 1, 1, 2]));
        // The same value again is not a change.
        publisher.upsert("10.5.2.0-24".into(), lease("10.5.2.0-24", [1, 1, 1, 2]));
        let snap = rx.borrow_and_update().clone();
        assert_eq!(snap.generation, 3);
        assert_eq!(snap.leases.len(), 2);

        publisher.remove("10.5.9.0-24");
        assert!(!rx.has_changed().unwrap());
        publisher.remove("10.5.1.0-24");
        let snap = rx.borrow_and_update().clone();
        assert_eq!(snap.generation, 4);
        assert_eq!(snap.leases.keys().collect::<Vec<_>>(), ["10.5.2.0-24"]);

        // An identical full listing does not wake the reconciler.
        let same = (*snap.leases).clone();
        publisher.replace_all(same);
        assert!(!rx.has_changed().unwrap());
    }
}
