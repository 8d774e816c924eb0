//! etcd access from inside a namespace (etcd of a topology listens in its hub, which the
//! host's namespace cannot reach): each call runs on a thread that entered the namespace, with
//! a small current-thread tokio runtime and a fresh client.

use std::{
    fs::File,
    future::Future,
    os::fd::AsFd,
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result};
use etcd_client::{Client, ConnectOptions, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp};

use crate::netns::NetNs;

/// etcd allows at most 128 operations per transaction by default (`--max-txn-ops`).
const TXN_OPS: usize = 128;

/// Runs `f` on a thread inside the namespace at `ns_path` and returns its result.
pub fn in_netns<F, R>(ns_path: &Path, f: F) -> Result<R>
where
    F: FnOnce() -> Result<R> + Send,
    R: Send,
{
    let file = File::open(ns_path).with_context(|| format!("open {}", ns_path.display()))?;
    thread::scope(|scope| {
        scope
            .spawn(move || -> Result<R> {
                nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .context("setns")?;
                f()
            })
            .join()
            .map_err(|_| anyhow::anyhow!("thread in netns panicked"))?
    })
}

/// An etcd endpoint reached from a given namespace.
#[derive(Debug, Clone)]
pub struct Kv {
    ns_path: PathBuf,
    endpoint: String,
}

impl Kv {
    /// `endpoint` (e.g. `http://192.168.1.1:2379`) as seen from `ns`.
    pub fn new(ns: &NetNs, endpoint: impl Into<String>) -> Self {
        Kv {
            ns_path: ns.path(),
            endpoint: endpoint.into(),
        }
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Connects from the namespace and runs `op` with the client.
    pub fn with_client<R, F, Fut>(&self, op: F) -> Result<R>
    where
        F: FnOnce(Client) -> Fut + Send,
        Fut: Future<Output = Result<R>>,
        R: Send,
    {
        let endpoint = self.endpoint.clone();
        in_netns(&self.ns_path, move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("tokio runtime")?;
            rt.block_on(async move {
                let options = ConnectOptions::new()
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(30));
                let client = Client::connect([endpoint.as_str()], Some(options))
                    .await
                    .with_context(|| format!("connecting to etcd at {endpoint}"))?;
                op(client).await
            })
        })
    }

    /// Puts one key.
    pub fn put(&self, key: &str, value: &str) -> Result<()> {
        let (key, value) = (key.to_owned(), value.to_owned());
        self.with_client(|mut c| async move {
            c.put(key.as_str(), value, None)
                .await
                .with_context(|| format!("put {key}"))?;
            Ok(())
        })
    }

    /// Reads one key.
    pub fn get(&self, key: &str) -> Result<Option<String>> {
        let key = key.to_owned();
        self.with_client(|mut c| async move {
            let resp = c
                .get(key.as_str(), None)
                .await
                .with_context(|| format!("get {key}"))?;
            Ok(resp
                .kvs()
                .first()
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
        })
    }

    /// All keys under `prefix` with their values, sorted by key.
    pub fn get_prefix(&self, prefix: &str) -> Result<Vec<(String, String)>> {
        let prefix = prefix.to_owned();
        self.with_client(|mut c| async move {
            let resp = c
                .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
                .await
                .with_context(|| format!("get {prefix}*"))?;
            let mut out: Vec<(String, String)> = resp
                .kvs()
                .iter()
                .map(|kv| {
                    (
                        String::from_utf8_lossy(kv.key()).into_owned(),
                        String::from_utf8_lossy(kv.value()).into_owned(),
                    )
                })
                .collect();
            out.sort();
            Ok(out)
        })
    }

    /// Deletes one key; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        let key = key.to_owned();
        self.with_client(|mut c| async move {
            let resp = c
                .delete(key.as_str(), None)
                .await
                .with_context(|| format!("delete {key}"))?;
            Ok(resp.deleted() > 0)
        })
    }

    /// Puts one key attached to a new etcd lease of `ttl_secs`; returns the lease id.
    pub fn put_with_ttl(&self, key: &str, value: &str, ttl_secs: i64) -> Result<i64> {
        let (key, value) = (key.to_owned(), value.to_owned());
        self.with_client(|mut c| async move {
            let lease = c
                .lease_grant(ttl_secs, None)
                .await
                .context("lease grant")?
                .id();
            c.put(
                key.as_str(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .with_context(|| format!("put {key}"))?;
            Ok(lease)
        })
    }

    /// The etcd lease `key` is attached to and its remaining TTL in seconds: `None` if the
    /// key does not exist, `Some((0, -1))` for a key without a lease.
    pub fn lease_of(&self, key: &str) -> Result<Option<(i64, i64)>> {
        let key = key.to_owned();
        self.with_client(|mut c| async move {
            let resp = c
                .get(key.as_str(), None)
                .await
                .with_context(|| format!("get {key}"))?;
            let Some(kv) = resp.kvs().first() else {
                return Ok(None);
            };
            let id = kv.lease();
            if id == 0 {
                return Ok(Some((0, -1)));
            }
            let ttl = c
                .lease_time_to_live(id, None)
                .await
                .with_context(|| format!("time-to-live of lease {id:x}"))?;
            Ok(Some((id, ttl.ttl())))
        })
    }

    /// Number of keys under `prefix`.
    pub fn count_prefix(&self, prefix: &str) -> Result<i64> {
        let prefix = prefix.to_owned();
        self.with_client(|mut c| async move {
            let resp = c
                .get(
                    prefix.as_str(),
                    Some(GetOptions::new().with_prefix().with_count_only()),
                )
                .await
                .with_context(|| format!("count {prefix}*"))?;
            Ok(resp.count())
        })
    }

    /// Deletes every key under `prefix`; returns how many went.
    pub fn delete_prefix(&self, prefix: &str) -> Result<i64> {
        let prefix = prefix.to_owned();
        self.with_client(|mut c| async move {
            let resp = c
                .delete(prefix.as_str(), Some(DeleteOptions::new().with_prefix()))
                .await
                .with_context(|| format!("delete {prefix}*"))?;
            Ok(resp.deleted())
        })
    }

    /// Puts many keys, all attached to one new etcd lease of `ttl_secs` (as upstream's
    /// subnet leases are), in transactions of 128 operations. Returns the lease id.
    pub fn put_all_with_ttl(&self, items: Vec<(String, String)>, ttl_secs: i64) -> Result<i64> {
        self.with_client(|mut c| async move {
            let lease = c
                .lease_grant(ttl_secs, None)
                .await
                .context("lease grant")?
                .id();
            for chunk in items.chunks(TXN_OPS) {
                let ops: Vec<TxnOp> = chunk
                    .iter()
                    .map(|(k, v)| {
                        TxnOp::put(
                            k.as_str(),
                            v.as_str(),
                            Some(PutOptions::new().with_lease(lease)),
                        )
                    })
                    .collect();
                c.txn(Txn::new().and_then(ops))
                    .await
                    .context("txn of lease puts")?;
            }
            Ok(lease)
        })
    }
}
