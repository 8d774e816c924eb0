//! Watching all leases: list once, then follow the prefix, and publish the current set of
//! remote leases (see [`crate::subnet`] for the snapshot contract).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use etcd_client::{GetOptions, KeyValue, WatchOptions};
use tokio_util::sync::CancellationToken;

use super::backoff::{Backoff, or_cancel};
use super::keys::Keys;
use super::registry::{decode, is_delete};
use super::{EtcdError, EtcdSubnetManager};
use crate::lease::Lease;
use crate::subnet::{LeaseId, LeasePublisher};

impl EtcdSubnetManager {
    /// Publishes every lease under `<prefix>/subnets/` except `own` into `publisher` until
    /// `cancel` fires.
    ///
    /// Lists all leases at revision R and publishes them with
    /// [`LeasePublisher::replace_all`], then watches the prefix from R+1: a put upserts, a
    /// delete (by hand or TTL expiry) removes. Lease ids are the keys below
    /// `<prefix>/subnets/` (`10.5.52.0-24`). Keys that do not parse and values that do not
    /// decode are skipped, logged once per key and revision; a key whose value turns bad is
    /// removed from the set. The published leases carry no expiry: the dataplane does not
    /// use it, and etcd reports an expired lease as a delete.
    ///
    /// A broken watch is re-established after a back-off (100 ms doubling to 5 s, reset once
    /// a watch has delivered events or lasted that long) from the revision after the last
    /// event seen, so nothing is missed; if that revision was compacted, everything is listed
    /// again and replaced, which also catches deletions that happened meanwhile.
    pub async fn watch_leases(
        &self,
        own: &Lease,
        publisher: LeasePublisher,
        cancel: CancellationToken,
    ) {
        let mut watcher = Watcher {
            mgr: self,
            set: LeaseSet {
                keys: &self.keys,
                own,
                publisher,
                warned: HashMap::new(),
            },
            resume: None,
            backoff: Backoff::new(self.tuning.backoff_min, self.tuning.backoff_max),
        };
        or_cancel(&cancel, watcher.run()).await;
    }
}

/// Why one watch ended.
enum End {
    /// The revision to resume from was compacted: list again.
    Compacted(i64),
    /// Anything else: retry from the same revision.
    Failed(String),
}

struct Watcher<'a> {
    mgr: &'a EtcdSubnetManager,
    set: LeaseSet<'a>,
    /// The revision to watch from; `None`: list first.
    resume: Option<i64>,
    backoff: Backoff,
}

impl Watcher<'_> {
    async fn run(&mut self) {
        loop {
            let started = Instant::now();
            let mut events_seen = false;
            let end = self.watch_once(&mut events_seen).await;
            if events_seen || started.elapsed() >= self.backoff.max() {
                self.backoff.reset();
            }
            let delay = self.backoff.next_delay();
            match end {
                End::Compacted(compact) => {
                    self.resume = None;
                    tracing::info!(
                        "lease watch under {} fell behind the compaction (revision {compact}); \
                         listing again in {delay:?}",
                        self.mgr.keys.subnets
                    );
                }
                End::Failed(why) => tracing::warn!(
                    "lease watch under {} failed, retrying in {delay:?}: {why}",
                    self.mgr.keys.subnets
                ),
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// Lists if needed, then follows the watch until it ends.
    async fn watch_once(&mut self, events_seen: &mut bool) -> End {
        let mgr = self.mgr;
        let prefix = mgr.keys.subnets.as_str();
        let start = match self.resume {
            Some(rev) => rev,
            None => match self.relist().await {
                Ok(rev) => rev + 1,
                Err(e) => return End::Failed(e.to_string()),
            },
        };
        self.resume = Some(start);
        let mut wc = mgr.client.watch_client();
        let options = WatchOptions::new().with_prefix().with_start_revision(start);
        let mut stream = match mgr
            .request("watch", prefix, wc.watch(prefix, Some(options)))
            .await
        {
            Ok(s) => s,
            Err(e) => return End::Failed(e.to_string()),
        };
        loop {
            let resp = match stream.message().await {
                Ok(Some(resp)) => resp,
                Ok(None) => return End::Failed("the server closed the watch".to_owned()),
                Err(e) => return End::Failed(e.to_string()),
            };
            if resp.canceled() {
                if resp.compact_revision() > 0 {
                    return End::Compacted(resp.compact_revision());
                }
                return End::Failed(format!(
                    "watch canceled by the server: {}",
                    resp.cancel_reason()
                ));
            }
            // The first response only confirms the watch (`created`, no events).
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                self.set.apply(kv);
                self.resume = Some(kv.mod_revision() + 1);
                *events_seen = true;
            }
        }
    }

    /// Lists everything and replaces the published set; returns the listing's revision.
    async fn relist(&mut self) -> Result<i64, EtcdError> {
        let mgr = self.mgr;
        let prefix = mgr.keys.subnets.as_str();
        let mut kv = mgr.kv();
        let resp = mgr
            .request(
                "get",
                prefix,
                kv.get(prefix, Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let rev = mgr.revision("get", prefix, resp.header())?;
        self.set.replace_all(resp.kvs());
        Ok(rev)
    }
}

/// The published set and the bookkeeping for logging bad entries once.
struct LeaseSet<'a> {
    keys: &'a Keys,
    own: &'a Lease,
    publisher: LeasePublisher,
    /// Bad keys already logged, with the revision logged.
    warned: HashMap<String, i64>,
}

/// What a key/value means for the set.
enum Entry {
    /// A remote lease.
    Lease(LeaseId, Lease),
    /// Not part of the set (own lease, bad key or value).
    Absent(LeaseId),
}

impl LeaseSet<'_> {
    fn replace_all(&mut self, kvs: &[KeyValue]) {
        let mut leases = BTreeMap::new();
        let mut seen = HashSet::with_capacity(kvs.len());
        for kv in kvs {
            let entry = self.entry(kv);
            match entry {
                Some(Entry::Lease(id, lease)) => {
                    seen.insert(id.clone());
                    leases.insert(id, lease);
                }
                Some(Entry::Absent(id)) => {
                    seen.insert(id);
                }
                None => {}
            }
        }
        self.warned.retain(|id, _| seen.contains(id));
        self.publisher.replace_all(leases);
    }

    fn apply(&mut self, kv: &KeyValue) {
        if is_delete(kv) {
            if let Some(id) = self.id(kv) {
                self.warned.remove(&id);
                self.publisher.remove(&id);
            }
            return;
        }
        match self.entry(kv) {
            Some(Entry::Lease(id, lease)) => self.publisher.upsert(id, lease),
            Some(Entry::Absent(id)) => self.publisher.remove(&id),
            None => {}
        }
    }

    fn id(&self, kv: &KeyValue) -> Option<LeaseId> {
        let key = String::from_utf8_lossy(kv.key());
        self.keys.lease_id(&key).map(str::to_owned)
    }

    /// Decodes one key/value, logging a bad one once per key and revision.
    fn entry(&mut self, kv: &KeyValue) -> Option<Entry> {
        let key = String::from_utf8_lossy(kv.key());
        let id = self.keys.lease_id(&key)?.to_owned();
        match decode(&key, kv.value()) {
            Ok(lease) if lease.same_subnet(self.own) || self.own.same_subnet(&lease) => {
                Some(Entry::Absent(id))
            }
            Ok(lease) => {
                self.warned.remove(&id);
                Some(Entry::Lease(id, lease))
            }
            Err(e) => {
                let rev = kv.mod_revision();
                if self.warned.get(&id) != Some(&rev) {
                    tracing::warn!("ignoring lease {key} (revision {rev}): {e}");
                    self.warned.insert(id.clone(), rev);
                }
                Some(Entry::Absent(id))
            }
        }
    }
}
