//! Keeping the node's own lease: renew it before it expires and watch its key, so that a
//! deletion (by hand or by expiry) stops the daemon and a changed value is written back.

use std::time::{Duration, SystemTime};

use etcd_client::{
    Compare, CompareOp, KeyValue, PutOptions, Txn, TxnOp, WatchOptions, WatchResponse, WatchStream,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::backoff::{Backoff, or_cancel};
use super::registry::{expiration_from_ttl, is_delete};
use super::{EtcdError, EtcdSubnetManager};
use crate::lease::Lease;
use crate::pace::RewritePace;

/// The shortest wait before a renewal, so that a renew margin as long as the TTL cannot spin.
const MIN_RENEW_DELAY: Duration = Duration::from_secs(1);

impl EtcdSubnetManager {
    /// Keeps `lease` (as returned by [`acquire_lease`](Self::acquire_lease)) alive until
    /// `cancel` fires (then `Ok(())`), or its key disappears (then
    /// [`EtcdError::LeaseRevoked`]: the daemon shuts down, exit code 0, as upstream).
    ///
    /// * Renewal happens [`renew_margin`](super::EtcdTuning::renew_margin) before expiry:
    ///   grant a new etcd lease with the full TTL and re-put the same value attached to it
    ///   (upstream's semantics, so upstream nodes reading the TTL see the same thing). Unlike
    ///   upstream the put only happens if the key still exists, and the etcd lease of the
    ///   previous renewal is revoked. A failed renewal is retried after
    ///   [`renew_retry`](super::EtcdTuning::renew_retry) (1 min).
    /// * The key is watched: a put (another writer, or a restarted agent) re-reads the TTL
    ///   and reschedules the renewal, and a value other than ours is written back (paced;
    ///   upstream's next renewal does the same, up to a day later); a key without TTL (a
    ///   reservation) is neither renewed nor written back; a delete ends with
    ///   `LeaseRevoked`. A broken watch is re-established with back-off
    ///   from the last revision seen; if that revision was compacted the key is read again.
    pub async fn keep_lease(
        &self,
        lease: Lease,
        cancel: CancellationToken,
    ) -> Result<(), EtcdError> {
        let sk = lease.key().ok_or(EtcdError::NoSubnet)?;
        let mut keeper = Keeper {
            mgr: self,
            key: self.keys.lease(&sk),
            value: lease.attrs.to_json(),
            attached: None,
            granted: None,
            renew_at: None,
            watch: None,
            watch_opened: Instant::now(),
            resume: None,
            reconnect_at: Instant::now(),
            backoff: Backoff::new(self.tuning.backoff_min, self.tuning.backoff_max),
            restore_at: None,
            pace: RewritePace::default(),
        };
        if let Some(expiration) = lease.expiration {
            keeper.schedule(expiration);
        }
        or_cancel(&cancel, keeper.run()).await.unwrap_or(Ok(()))
    }
}

/// The state of one `keep_lease` call.
struct Keeper<'a> {
    mgr: &'a EtcdSubnetManager,
    key: String,
    value: String,
    /// The etcd lease the key was attached to when last seen (0: none).
    attached: Option<i64>,
    /// The etcd lease this call granted last, while the key is attached to it.
    granted: Option<i64>,
    /// When to renew; `None` when the key has no TTL.
    renew_at: Option<Instant>,
    watch: Option<WatchStream>,
    watch_opened: Instant,
    /// The revision to watch from; `None`: read the key first.
    resume: Option<i64>,
    reconnect_at: Instant,
    backoff: Backoff,
    /// When to write the value back (someone else changed it).
    restore_at: Option<Instant>,
    pace: RewritePace,
}

impl Keeper<'_> {
    async fn run(&mut self) -> Result<(), EtcdError> {
        loop {
            if self.watch.is_none() && Instant::now() >= self.reconnect_at {
                match self.open().await {
                    Ok(true) => {}
                    Ok(false) => return Err(EtcdError::LeaseRevoked),
                    Err(e) => self.retry_watch(&e.to_string()),
                }
            }
            let renew_at = self.renew_at;
            tokio::select! {
                msg = next_message(&mut self.watch) => self.on_message(msg).await?,
                () = sleep_until(renew_at) => self.renew().await?,
                () = sleep_until(self.restore_at) => self.restore().await?,
                () = tokio::time::sleep_until(self.reconnect_at), if self.watch.is_none() => {}
            }
        }
    }

    /// Reads the key if needed and starts watching it. `false`: the key does not exist.
    async fn open(&mut self) -> Result<bool, EtcdError> {
        let mgr = self.mgr;
        let start = match self.resume {
            Some(rev) => rev,
            None => {
                let mut kv = mgr.kv();
                let resp = mgr
                    .request("get", &self.key, kv.get(self.key.as_str(), None))
                    .await?;
                let rev = mgr.revision("get", &self.key, resp.header())?;
                let Some(current) = resp.kvs().first() else {
                    return Ok(false);
                };
                self.observe(current).await;
                rev + 1
            }
        };
        self.resume = Some(start);
        let mut wc = mgr.client.watch_client();
        let options = WatchOptions::new().with_start_revision(start);
        let stream = mgr
            .request(
                "watch",
                &self.key,
                wc.watch(self.key.as_str(), Some(options)),
            )
            .await?;
        self.watch = Some(stream);
        self.watch_opened = Instant::now();
        Ok(true)
    }

    /// An open watch broke: drop it and schedule the next attempt. A watch that lasted
    /// longer than the longest back-off counts as a success.
    fn watch_broke(&mut self, why: &str) {
        if self.watch_opened.elapsed() >= self.backoff.max() {
            self.backoff.reset();
        }
        self.retry_watch(why);
    }

    /// Schedules the next attempt to open the watch.
    fn retry_watch(&mut self, why: &str) {
        self.watch = None;
        let delay = self.backoff.next_delay();
        tracing::warn!(
            "watch of own lease {} failed, retrying in {delay:?}: {why}",
            self.key
        );
        self.reconnect_at = Instant::now() + delay;
    }

    async fn on_message(
        &mut self,
        msg: Result<Option<WatchResponse>, etcd_client::Error>,
    ) -> Result<(), EtcdError> {
        let resp = match msg {
            Ok(Some(resp)) => resp,
            Ok(None) => {
                self.watch_broke("the server closed the watch");
                return Ok(());
            }
            Err(e) => {
                self.watch_broke(&e.to_string());
                return Ok(());
            }
        };
        if resp.canceled() {
            if resp.compact_revision() > 0 {
                tracing::info!(
                    "revision {} of own lease {} was compacted; reading the key again",
                    self.resume.unwrap_or_default(),
                    self.key
                );
                self.watch = None;
                self.resume = None;
                self.reconnect_at = Instant::now();
            } else {
                let why = format!("watch canceled by the server: {}", resp.cancel_reason());
                self.watch_broke(&why);
            }
            return Ok(());
        }
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            self.resume = Some(kv.mod_revision() + 1);
            if is_delete(kv) {
                tracing::warn!("own lease {} was deleted", self.key);
                return Err(EtcdError::LeaseRevoked);
            }
            self.observe(kv).await;
            self.backoff.reset();
        }
        Ok(())
    }

    /// Takes note of the key's current etcd lease; a new one means a new expiry. A value
    /// other than ours under an etcd lease is written back (paced): a restart would write
    /// ours, and upstream's next renewal does, up to a day later. A reservation's (no etcd
    /// lease) belongs to whoever made it and is left alone.
    async fn observe(&mut self, kv: &KeyValue) {
        let id = kv.lease();
        if id == 0 {
            self.restore_at = None;
        } else if kv.value() != self.value.as_bytes() {
            if self.restore_at.is_none() {
                tracing::warn!(
                    "own lease {} was changed to {}; writing ours again",
                    self.key,
                    String::from_utf8_lossy(kv.value())
                );
            }
            self.restore_at = Some(self.pace.wait_for().unwrap_or_else(Instant::now));
        }
        if self.attached == Some(id) {
            return;
        }
        self.attached = Some(id);
        if self.granted != Some(id) {
            self.granted = None;
        }
        if id == 0 {
            tracing::info!(
                "lease {} has no TTL (a reservation): not renewing it",
                self.key
            );
            self.renew_at = None;
            return;
        }
        let now = SystemTime::now();
        let mut lc = self.mgr.client.lease_client();
        match self
            .mgr
            .request("lease time-to-live", &self.key, lc.time_to_live(id, None))
            .await
        {
            Ok(ttl) => self.schedule(expiration_from_ttl(now, ttl.ttl())),
            Err(e) => {
                tracing::warn!("{e}");
                if self.renew_at.is_none() {
                    self.renew_at = Some(Instant::now());
                }
            }
        }
    }

    /// Plans the renewal for a lease expiring at `expiration`.
    fn schedule(&mut self, expiration: SystemTime) {
        let remaining = expiration
            .duration_since(SystemTime::now())
            .unwrap_or_default();
        let delay = remaining
            .saturating_sub(self.mgr.tuning.renew_margin)
            .max(MIN_RENEW_DELAY);
        self.renew_at = Some(Instant::now() + delay);
    }

    /// Grants a new etcd lease and re-puts the value attached to it, if the key still exists.
    async fn renew(&mut self) -> Result<(), EtcdError> {
        let mgr = self.mgr;
        let now = SystemTime::now();
        let ttl = i64::try_from(mgr.tuning.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let mut lc = mgr.client.lease_client();
        let grant = match mgr
            .request("lease grant", &self.key, lc.grant(ttl, None))
            .await
        {
            Ok(g) => g,
            Err(e) => {
                self.retry_renewal(&e);
                return Ok(());
            }
        };
        let txn = Txn::new()
            .when([Compare::version(self.key.as_str(), CompareOp::Greater, 0)])
            .and_then([TxnOp::put(
                self.key.as_str(),
                self.value.as_str(),
                Some(PutOptions::new().with_lease(grant.id())),
            )]);
        let mut kv = mgr.kv();
        match mgr.request("txn", &self.key, kv.txn(txn)).await {
            Ok(resp) if resp.succeeded() => {
                let replaced = self.granted.filter(|g| self.attached == Some(*g));
                self.attached = Some(grant.id());
                self.granted = Some(grant.id());
                self.schedule(expiration_from_ttl(now, grant.ttl()));
                tracing::info!("renewed lease {} (TTL {} s)", self.key, grant.ttl());
                if let Some(old) = replaced.filter(|old| *old != grant.id()) {
                    mgr.revoke_quietly(old).await;
                }
                Ok(())
            }
            Ok(_) => {
                mgr.revoke_quietly(grant.id()).await;
                tracing::warn!("own lease {} no longer exists", self.key);
                Err(EtcdError::LeaseRevoked)
            }
            // The outcome is unknown: leave the new etcd lease alone (the key may be attached
            // to it now; the watch will tell).
            Err(e) => {
                self.retry_renewal(&e);
                Ok(())
            }
        }
    }

    /// Puts our value back, attached to the key's current etcd lease, if the key is still
    /// attached to it (its deletion is the watch's to report; a reservation made meanwhile
    /// is left alone).
    async fn restore(&mut self) -> Result<(), EtcdError> {
        self.restore_at = None;
        // A write put off by the pace counts from now (one written at once counted already).
        let _ = self.pace.wait_for();
        let Some(id) = self.attached.filter(|id| *id != 0) else {
            return Ok(());
        };
        let mgr = self.mgr;
        let txn = Txn::new()
            .when([Compare::lease(self.key.as_str(), CompareOp::Equal, id)])
            .and_then([TxnOp::put(
                self.key.as_str(),
                self.value.as_str(),
                Some(PutOptions::new().with_lease(id)),
            )]);
        let mut kv = mgr.kv();
        if let Err(e) = mgr.request("txn", &self.key, kv.txn(txn)).await {
            tracing::warn!("{e}");
            self.restore_at = Some(Instant::now() + self.mgr.tuning.backoff_min);
        }
        Ok(())
    }

    fn retry_renewal(&mut self, e: &EtcdError) {
        let retry = self.mgr.tuning.renew_retry;
        tracing::error!("Error renewing lease (trying again in {retry:?}): {e}");
        self.renew_at = Some(Instant::now() + retry);
    }
}

/// The next message of a watch, or never without one.
pub(crate) async fn next_message(
    watch: &mut Option<WatchStream>,
) -> Result<Option<WatchResponse>, etcd_client::Error> {
    match watch {
        Some(stream) => stream.message().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`, or forever without a deadline.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
