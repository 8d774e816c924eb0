//! `AcquireLease`: list, plan ([`crate::alloc::plan`]), write with a compare-and-swap, and on
//! a lost race list again.
//!
//! The compare-and-swap only guards the exact key, and a dual-stack key names both subnets:
//! two nodes joining at the same moment can pick different IPv4 but the same IPv6 subnet
//! (upstream has this race). So after creating a key the registry is read once more, and a
//! node whose new subnet overlaps a lease created before it (lower create revision) deletes
//! its key and chooses again.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use futures::future::BoxFuture;

use super::registry::Listed;
use super::{EtcdError, EtcdSubnetManager};
use crate::alloc::{self, Choice, Plan, PreviousSubnets};
use crate::ip;
use crate::lease::{Lease, LeaseAttrs, SubnetKey};

/// A test hook run with the full key just before the write transaction of each attempt
/// (tests use it to write the chosen key first and so force a lost race).
pub type WriteHook = Arc<dyn Fn(String) -> BoxFuture<'static, ()> + Send + Sync>;

/// The outcome of one attempt.
enum Attempt {
    Won {
        key: SubnetKey,
        expiration: Option<SystemTime>,
        /// A new key was created (not an existing lease rewritten).
        created: bool,
        /// The etcd lease the key is attached to.
        etcd_lease: Option<i64>,
    },
    Lost,
}

/// Whether two subnet keys overlap in either family.
pub(crate) fn keys_overlap(a: &SubnetKey, b: &SubnetKey) -> bool {
    ip::overlaps(a.ipv4, b.ipv4)
        || matches!((a.ipv6, b.ipv6), (Some(x), Some(y)) if ip::overlaps(x, y))
}

impl EtcdSubnetManager {
    /// Installs a [`WriteHook`] (tests only).
    #[doc(hidden)]
    pub fn set_before_write_hook(&mut self, hook: WriteHook) {
        self.before_write = Some(hook);
    }

    /// Acquires this node's subnet (upstream `AcquireLease`) and returns the lease written.
    ///
    /// Re-reads and validates the config, lists all leases (the expiry of our own only), asks
    /// [`alloc::plan`] for a subnet and writes it in one transaction: a new subnet only if its
    /// key does not exist yet (`version == 0`), a reused lease only if it is unchanged since
    /// the listing (`mod_revision`); a lease of ours that no longer fits the config is deleted
    /// in the same transaction. The key is attached to a fresh etcd lease with
    /// [`EtcdTuning::lease_ttl`](super::EtcdTuning::lease_ttl), except when an existing key
    /// without TTL (a reservation) is reused: it stays without TTL.
    ///
    /// A transaction whose condition fails means another node won the race: the etcd lease
    /// just granted is revoked and the next attempt starts from a fresh listing, up to
    /// [`EtcdTuning::race_attempts`](super::EtcdTuning::race_attempts) times.
    pub async fn acquire_lease(
        &self,
        attrs: &LeaseAttrs,
        previous: &PreviousSubnets,
    ) -> Result<Lease, EtcdError> {
        let config = self.network_config().await?;
        if config.ipv4.is_some() && attrs.public_ip.is_unspecified() {
            return Err(EtcdError::NoPublicIp);
        }
        let value = attrs.to_json();
        let attempts = self.tuning.race_attempts.max(1);
        for attempt in 1..=attempts {
            let listed = self.list_for_allocation(attrs.public_ip).await?;
            let leases: Vec<Lease> = listed.iter().map(|l| l.lease.clone()).collect();
            let plan = alloc::plan(
                &config,
                &leases,
                attrs.public_ip,
                previous,
                &mut rand::rng(),
            )?;
            match self.write(&plan, &listed, &value, attrs).await? {
                Attempt::Won {
                    key,
                    expiration,
                    created,
                    etcd_lease,
                } => {
                    if created && self.yield_to_earlier_overlap(&key, etcd_lease).await? {
                        continue;
                    }
                    return Ok(Lease::new(key, attrs.clone(), expiration));
                }
                Attempt::Lost => tracing::info!(
                    "another node took subnet {} first (attempt {attempt} of {attempts}); \
                     listing again",
                    plan.choice.key().map(|k| k.to_string()).unwrap_or_default()
                ),
            }
        }
        Err(EtcdError::RaceRetriesExhausted { attempts })
    }

    /// Writes one plan. `Lost` when the registry changed since `listed` was read.
    async fn write(
        &self,
        plan: &Plan,
        listed: &[Listed],
        value: &str,
        attrs: &LeaseAttrs,
    ) -> Result<Attempt, EtcdError> {
        let find = |lease: &Lease| listed.iter().find(|l| l.lease == *lease);
        let mut when = Vec::new();
        let mut then = Vec::new();
        if let Some(old) = &plan.delete {
            let Some(entry) = find(old) else {
                return Ok(Attempt::Lost);
            };
            tracing::info!(
                "lease {} of this node no longer fits the network config; deleting it",
                entry.key
            );
            when.push(Compare::mod_revision(
                entry.key.as_str(),
                CompareOp::Equal,
                entry.mod_revision,
            ));
            then.push(TxnOp::delete(entry.key.as_str(), None));
        }
        let (sk, with_ttl) = match &plan.choice {
            Choice::Reuse(found) => {
                let (Some(entry), Some(sk)) = (find(found), found.key()) else {
                    return Ok(Attempt::Lost);
                };
                tracing::info!(
                    "Found lease ({sk}) for current IP ({}), reusing",
                    attrs.public_ip
                );
                when.push(Compare::mod_revision(
                    entry.key.as_str(),
                    CompareOp::Equal,
                    entry.mod_revision,
                ));
                let target = self.keys.lease(&sk);
                if entry.key != target {
                    // A key that parses but is not spelled canonically: move it.
                    when.push(Compare::version(target.as_str(), CompareOp::Equal, 0));
                    then.push(TxnOp::delete(entry.key.as_str(), None));
                }
                // A key without TTL is a reservation: keep it permanent.
                (sk, found.expiration.is_some())
            }
            Choice::Previous(sk) => {
                tracing::info!("Found previously leased subnet ({sk}), reusing");
                when.push(Compare::version(self.keys.lease(sk), CompareOp::Equal, 0));
                (*sk, true)
            }
            Choice::Allocated(sk) => {
                tracing::info!(
                    "Allocated lease ({sk}) to current node ({})",
                    attrs.public_ip
                );
                when.push(Compare::version(self.keys.lease(sk), CompareOp::Equal, 0));
                (*sk, true)
            }
        };
        let key = self.keys.lease(&sk);

        let now = SystemTime::now();
        let granted = if with_ttl {
            let mut lc = self.client.lease_client();
            let ttl = i64::try_from(self.tuning.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX);
            let g = self
                .request("lease grant", &key, lc.grant(ttl, None))
                .await?;
            Some((g.id(), g.ttl()))
        } else {
            None
        };
        let put_options = granted.map(|(id, _)| PutOptions::new().with_lease(id));
        then.push(TxnOp::put(key.as_str(), value, put_options));

        if let Some(hook) = &self.before_write {
            hook(key.clone()).await;
        }
        let mut kv = self.kv();
        // On a request error the outcome is unknown: the granted lease is left alone (it
        // expires by itself if nothing got attached to it).
        let resp = self
            .request("txn", &key, kv.txn(Txn::new().when(when).and_then(then)))
            .await?;
        if !resp.succeeded() {
            if let Some((id, _)) = granted {
                self.revoke_quietly(id).await;
            }
            return Ok(Attempt::Lost);
        }
        let expiration =
            granted.map(|(_, ttl)| now + Duration::from_secs(u64::try_from(ttl).unwrap_or(0)));
        Ok(Attempt::Won {
            key: sk,
            expiration,
            created: !matches!(plan.choice, Choice::Reuse(_)),
            etcd_lease: granted.map(|(id, _)| id),
        })
    }

    /// After creating the key of `sk`: if another lease overlapping it (in either family) was
    /// created before it, deletes our key (unless it changed meanwhile), revokes its etcd
    /// lease and returns `true` so that the caller chooses again. Ties in creation order
    /// cannot happen (one revision per transaction).
    async fn yield_to_earlier_overlap(
        &self,
        sk: &SubnetKey,
        etcd_lease: Option<i64>,
    ) -> Result<bool, EtcdError> {
        let ours = self.keys.lease(sk);
        let prefix = self.keys.subnets.as_str();
        let mut kv = self.kv();
        let resp = self
            .request(
                "get",
                prefix,
                kv.get(prefix, Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let Some(mine) = resp.kvs().iter().find(|e| e.key() == ours.as_bytes()) else {
            // Deleted already (by hand, or expired): the keeper reports it as revoked.
            return Ok(false);
        };
        let earlier = resp.kvs().iter().find(|e| {
            e.key() != ours.as_bytes()
                && e.create_revision() < mine.create_revision()
                && std::str::from_utf8(e.key())
                    .ok()
                    .and_then(SubnetKey::parse)
                    .is_some_and(|other| keys_overlap(sk, &other))
        });
        let Some(earlier) = earlier else {
            return Ok(false);
        };
        tracing::warn!(
            "subnet {sk} overlaps {}, created a moment earlier by another node; choosing again",
            String::from_utf8_lossy(earlier.key())
        );
        let when = [Compare::mod_revision(
            ours.as_str(),
            CompareOp::Equal,
            mine.mod_revision(),
        )];
        let then = [TxnOp::delete(ours.as_str(), None)];
        self.request("txn", &ours, kv.txn(Txn::new().when(when).and_then(then)))
            .await?;
        if let Some(id) = etcd_lease {
            self.revoke_quietly(id).await;
        }
        Ok(true)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn overlap_in_either_family() {
        let k = |s: &str| SubnetKey::parse(s).unwrap();
        let a = k("10.244.1.0-24&fd00:244:0:48::-64");
        assert!(keys_overlap(&a, &k("10.244.2.0-24&fd00:244:0:48::-64")));
        assert!(keys_overlap(&a, &k("10.244.1.0-24&fd00:244:0:49::-64")));
        assert!(keys_overlap(&a, &k("10.244.0.0-16")));
        assert!(!keys_overlap(&a, &k("10.244.2.0-24&fd00:244:0:49::-64")));
        assert!(!keys_overlap(&a, &k("10.244.2.0-24")));
    }
}
