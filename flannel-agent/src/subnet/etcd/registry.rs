//! Reading leases: the allocation listing (with each key's expiry) and how an etcd key/value
//! becomes a [`Lease`].

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
    /// attributes (`PublicIP` 0.0.0.0), so that its subnet still counts as taken.
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
    /// each key's etcd lease. Keys that do not parse are ignored; keys whose TTL cannot be
    /// read are skipped, as upstream does; keys without an etcd lease never expire.
    pub(crate) async fn list_for_allocation(&self) -> Result<Vec<Listed>, EtcdError> {
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
            .map(|kv| self.listed(kv, now))
            .buffered(TTL_CONCURRENCY)
            .try_filter_map(|l| async move { Ok(l) })
            .try_collect()
            .await?;
        Ok(listed)
    }

    async fn listed(&self, kv: KeyValue, now: SystemTime) -> Result<Option<Listed>, EtcdError> {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        let Some(sk) = SubnetKey::parse(&key) else {
            tracing::warn!("Ignoring bad subnet node {key:?}");
            return Ok(None);
        };
        let expiration = match kv.lease() {
            0 => None,
            id => {
                let mut lc = self.client.lease_client();
                match self
                    .request("lease time-to-live", &key, lc.time_to_live(id, None))
                    .await
                {
                    Ok(ttl) => Some(expiration_from_ttl(now, ttl.ttl())),
                    Err(e) => {
                        tracing::error!("Could not read ttl: {e}");
                        return Ok(None);
                    }
                }
            }
        };
        let lease = match decode(&key, kv.value()) {
            Ok(mut lease) => {
                lease.expiration = expiration;
                lease
            }
            Err(e) => {
                tracing::warn!("subnet {key} has an invalid value; its subnet stays taken: {e}");
                Lease::new(sk, LeaseAttrs::default(), expiration)
            }
        };
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
