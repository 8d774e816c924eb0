//! The etcd subnet manager (upstream's default registry, etcd v3 API), byte-compatible with
//! upstream flanneld so both can share one etcd:
//!
//! * `<prefix>/config` holds the network config ([`EtcdSubnetManager::network_config`]);
//! * `<prefix>/subnets/<subnet key>` holds each node's lease attributes JSON, attached to an
//!   etcd lease with a 24 h TTL ([`EtcdSubnetManager::acquire_lease`]);
//! * the node renews its lease before it expires and shuts down when its key disappears
//!   ([`EtcdSubnetManager::keep_lease`]);
//! * every node watches all leases and publishes the current set of remote ones
//!   ([`EtcdSubnetManager::watch_leases`]).
//!
//! Deliberate differences from upstream (all invisible to upstream nodes sharing the store):
//! * a lost allocation race (another node wrote the chosen subnet first) is retried with a
//!   fresh listing instead of killing the daemon (`subnet already exists`);
//! * a key without a TTL (an operator's reservation, upstream issue #1329) stays permanent
//!   when its node reuses it, and is not renewed;
//! * a key whose value does not decode still occupies its subnet during allocation;
//! * renewal never resurrects a deleted key (the write is conditional on the key existing),
//!   and the etcd lease replaced by a renewal of this process is revoked instead of left to
//!   expire;
//! * watches never hot-loop: every retry waits (100 ms doubling to 5 s), and a compacted
//!   revision leads to a fresh listing.

mod acquire;
mod backoff;
mod error;
mod keeper;
mod keys;
mod options;
mod registry;
mod watcher;

use std::fmt;
use std::future::Future;

use etcd_client::Client;

pub use acquire::WriteHook;
pub use error::EtcdError;
use keys::Keys;
pub use options::{DEFAULT_ENDPOINTS, DEFAULT_PREFIX, EtcdOptions, EtcdTuning};

use crate::lease::Lease;
use crate::netconf::{CheckedConfig, NetConfig};

/// Largest response accepted (a listing of all leases); etcd-client's default is 4 MiB.
const MAX_RESPONSE_BYTES: usize = 256 * 1024 * 1024;

/// The etcd subnet manager. Cheap to clone: clones share the connection.
#[derive(Clone)]
pub struct EtcdSubnetManager {
    client: Client,
    keys: Keys,
    tuning: EtcdTuning,
    endpoints: String,
    before_write: Option<WriteHook>,
}

impl fmt::Debug for EtcdSubnetManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdSubnetManager")
            .field("endpoints", &self.endpoints)
            .field("keys", &self.keys)
            .field("tuning", &self.tuning)
            .finish_non_exhaustive()
    }
}

impl EtcdSubnetManager {
    /// Creates the client. Connections are made lazily (and re-made after failures), so an
    /// etcd that is down now only shows up as request errors later; this fails on bad options
    /// (no endpoints, an invalid URL, unreadable TLS files) and, with a user name, when
    /// authentication fails.
    pub async fn connect(options: &EtcdOptions) -> Result<Self, EtcdError> {
        if options.endpoints.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        let endpoints = options.endpoint_list();
        let connect_options = options.connect_options()?;
        let connect = Client::connect(&options.endpoints, Some(connect_options));
        // Authentication is a request; bound it like every other one.
        let client = match tokio::time::timeout(
            options.tuning.connect_timeout + options.tuning.request_timeout,
            connect,
        )
        .await
        {
            Ok(Ok(client)) => client,
            Ok(Err(error)) => return Err(EtcdError::Connect { endpoints, error }),
            Err(_) => {
                return Err(EtcdError::Timeout {
                    op: "connect",
                    key: String::new(),
                    endpoints,
                    timeout: options.tuning.connect_timeout + options.tuning.request_timeout,
                });
            }
        };
        Ok(EtcdSubnetManager {
            client,
            keys: Keys::new(&options.prefix),
            tuning: options.tuning,
            endpoints,
            before_write: None,
        })
    }

    /// The key of the network config, `<prefix>/config`.
    pub fn config_key(&self) -> &str {
        &self.keys.config
    }

    /// The key of a lease, `<prefix>/subnets/10.5.52.0-24`; `None` without an IPv4 subnet.
    pub fn lease_key(&self, lease: &Lease) -> Option<String> {
        lease.key().map(|k| self.keys.lease(&k))
    }

    /// The time constants in use.
    pub fn tuning(&self) -> &EtcdTuning {
        &self.tuning
    }

    /// Reads and validates `<prefix>/config` (one attempt; the daemon retries every second
    /// at startup, as upstream).
    pub async fn network_config(&self) -> Result<CheckedConfig, EtcdError> {
        let key = &self.keys.config;
        let mut kv = self.kv();
        let resp = self.request("get", key, kv.get(key.as_str(), None)).await?;
        let value = resp.kvs().first().ok_or(EtcdError::ConfigNotFound)?;
        // Go decodes bytes; invalid UTF-8 can only make the JSON invalid, which parse reports.
        let text = String::from_utf8_lossy(value.value());
        NetConfig::parse(&text)
            .and_then(|c| c.check())
            .map_err(|error| EtcdError::Config {
                key: key.clone(),
                error,
            })
    }

    fn kv(&self) -> etcd_client::KvClient {
        self.client
            .kv_client()
            .max_decoding_message_size(MAX_RESPONSE_BYTES)
    }

    /// Runs one request with the request timeout, mapping errors to [`EtcdError`]s that name
    /// the operation, the key and the endpoints.
    async fn request<T>(
        &self,
        op: &'static str,
        key: &str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, EtcdError> {
        match tokio::time::timeout(self.tuning.request_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(error)) => Err(EtcdError::Request {
                op,
                key: key.to_owned(),
                endpoints: self.endpoints.clone(),
                error,
            }),
            Err(_) => Err(EtcdError::Timeout {
                op,
                key: key.to_owned(),
                endpoints: self.endpoints.clone(),
                timeout: self.tuning.request_timeout,
            }),
        }
    }

    /// The revision in a response header.
    fn revision(
        &self,
        op: &'static str,
        key: &str,
        header: Option<&etcd_client::ResponseHeader>,
    ) -> Result<i64, EtcdError> {
        header
            .map(|h| h.revision())
            .ok_or_else(|| EtcdError::NoHeader {
                op,
                key: key.to_owned(),
                endpoints: self.endpoints.clone(),
            })
    }

    /// Revokes an etcd lease nothing should be attached to; failures only cost a lease that
    /// expires by itself.
    async fn revoke_quietly(&self, id: i64) {
        let mut lc = self.client.lease_client();
        if let Err(e) = self
            .request("lease revoke", &format!("{id:x}"), lc.revoke(id))
            .await
        {
            tracing::debug!("{e}");
        }
    }
}
