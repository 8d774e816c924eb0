//! Reading leases: the allocation listing (with the own key's expiry) and how an etcd key/value
//! becomes a [`Lease`].

use std::net::Ipv4Addr;
use std::time::{Duration, SystemTime};

use etcd_client::{GetOptions, KeyValue};
use futures::{StreamExt as _, TryStreamExt as _};

use super::{EtcdError, EtcdSubnetManager};
use crate::lease::{Lease, LeaseAttrs, LeaseError, SubnetKey};

/// How many TimeToLive requests the allocation listing keeps in flight.
const TTL_CONCURRENCY: usize = 16;

/// One key under `<prefix>/subnets/` as the allocator sees it.
#[derive(Debug, Clone)]
pub(crate) struct Listed {
    /// The full etcd key.
    pub(crate) key: String,
    /// Its modification revision (for compare-and-swap).
    pub(crate) mod_revision: i64,
    /// The decoded lease; for a value that does not decode, a placeholder with default
    /// attributes (`PublicIP` 0.0.0.0), so that its subnet still counts as taken. Its expiry
    /// is read for this node's own lease only.
    pub(crate) lease: Lease,
}

/// Expiry from a TimeToLive answer: `ttl` seconds from `now`; a negative TTL (the etcd lease
/// is gone and the key about to be deleted) means "expired now".
pub(crate) fn expiration_from_ttl(now: SystemTime, ttl: i64) -> SystemTime {
    now + Duration::from_secs(u64::try_from(ttl).unwrap_or(0))
}

/// Decodes a key/value under the subnets prefix (the expiry is left unknown).
pub(crate) fn decode(key: &str, value: &[u8]) -> Result<Lease, LeaseError> {
    Lease::from_etcd(key, value, None)
}

impl EtcdSubnetManager {
    /// Lists every lease for allocation (upstream `getSubnets`): a prefix get, then the TTL of
    /// the etcd lease of each key whose value carries `public_ip` (this node's own lease).
    /// Keys that do not parse are ignored; an own key whose TTL cannot be read is skipped, as
    /// upstream does; a key without an etcd lease never expires.
    ///
    /// Upstream reads every key's TTL, one request per node of the cluster, although the
    /// allocation needs only which subnets the others hold: here their expiry stays unread
    /// (`None`), which turns a join into a cluster of 5,000 nodes from 5,000 requests into
    /// one (`cargo xtask bench control`).
    pub(crate) async fn list_for_allocation(
        &self,
        public_ip: Ipv4Addr,
    ) -> Result<Vec<Listed>, EtcdError> {
        let prefix = self.keys.subnets.as_str();
        let mut kv = self.kv();
        let mut resp = self
            .request(
                "get",
                prefix,
                kv.get(prefix, Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let now = SystemTime::now();
        let listed = futures::stream::iter(resp.take_kvs())
            .map(|kv| self.listed(kv, public_ip, now))
            .buffered(TTL_CONCURRENCY)
            .try_filter_map(|l| async move { Ok(l) })
            .try_collect()
            .await?;
        Ok(listed)
    }

    async fn listed(
        &self,
        kv: KeyValue,
        public_ip: Ipv4Addr,
        now: SystemTime,
    ) -> Result<Option<Listed>, EtcdError> {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        let Some(sk) = SubnetKey::parse(&key) else {
            tracing::warn!("Ignoring bad subnet node {key:?}");
            return Ok(None);
        };
        let mut lease = match decode(&key, kv.value()) {
            Ok(lease) => lease,
            Err(e) => {
                tracing::warn!("subnet {key} has an invalid value; its subnet stays taken: {e}");
                Lease::new(sk, LeaseAttrs::default(), None)
            }
        };
        let id = kv.lease();
        if id != 0 && lease.attrs.public_ip == public_ip {
            let mut lc = self.client.lease_client();
            match self
                .request("lease time-to-live", &key, lc.time_to_live(id, None))
                .await
            {
                Ok(ttl) => lease.expiration = Some(expiration_from_ttl(now, ttl.ttl())),
                Err(e) => {
                    tracing::error!("Could not read ttl: {e}");
                    return Ok(None);
                }
            }
        }
        Ok(Some(Listed {
            key,
            mod_revision: kv.mod_revision(),
            lease,
        }))
    }
}

/// Whether a watch event's key/value is a deletion. etcd knows two event types; a deleted
/// key is reported with version 0 ("a deletion resets the version to zero") while every put
/// has version 1 or more. Reading the version avoids etcd-client's `Event::event_type`,
/// which panics on a type outside the protocol.
pub(crate) fn is_delete(kv: &KeyValue) -> bool {
    kv.version() == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_ttl_means_expired() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        assert_eq!(
            expiration_from_ttl(now, 86400),
            now + Duration::from_secs(86400)
        );
        assert_eq!(expiration_from_ttl(now, -1), now);
    }
}
