//! `AcquireLease`: list, plan ([`crate::alloc::plan`]), write with a compare-and-swap, and on
//! a lost race list again.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use futures::future::BoxFuture;

use super::registry::Listed;
use super::{EtcdError, EtcdSubnetManager};
use crate::alloc::{self, Choice, Plan, PreviousSubnets};
use crate::lease::{Lease, LeaseAttrs, SubnetKey};

/// A test hook run with the full key just before the write transaction of each attempt
/// (tests use it to write the chosen key first and so force a lost race).
pub type WriteHook = Arc<dyn Fn(String) -> BoxFuture<'static, ()> + Send + Sync>;

/// The outcome of one attempt.
enum Attempt {
    Won {
        key: SubnetKey,
        expiration: Option<SystemTime>,
    },
    Lost,
}

impl EtcdSubnetManager {
    /// Installs a [`WriteHook`] (tests only).
    #[doc(hidden)]
    pub fn set_before_write_hook(&mut self, hook: WriteHook) {
        self.before_write = Some(hook);
    }

    /// Acquires this node's subnet (upstream `AcquireLease`) and returns the lease written.
    ///
    /// Re-reads and validates the config, lists all leases with their expiry, asks
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
            let listed = self.list_for_allocation().await?;
            let leases: Vec<Lease> = listed.iter().map(|l| l.lease.clone()).collect();
            let plan = alloc::plan(
                &config,
                &leases,
                attrs.public_ip,
                previous,
                &mut rand::rng(),
            )?;
            match self.write(&plan, &listed, &value, attrs).await? {
                Attempt::Won { key, expiration } => {
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
        })
    }
}
