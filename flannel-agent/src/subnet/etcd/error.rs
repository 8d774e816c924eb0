//! [`EtcdError`]: the one error type of the etcd subnet manager.

use std::path::PathBuf;
use std::time::Duration;

use crate::alloc::AllocError;
use crate::netconf::ConfigError;

/// Errors of the etcd subnet manager. Every message names what was being done and where.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// `--etcd-endpoints` holds no endpoint.
    #[error("no etcd endpoints given (--etcd-endpoints is empty)")]
    NoEndpoints,
    /// The endpoints mix `http://` and `https://`, which one client cannot serve.
    #[error("etcd endpoints mix http:// and https:// ({endpoints}); use one scheme for all")]
    MixedSchemes {
        /// The endpoints as given.
        endpoints: String,
    },
    /// A TLS file (`--etcd-cafile`, `--etcd-certfile`, `--etcd-keyfile`) cannot be read.
    #[error("cannot read {flag} {}: {error}", path.display())]
    TlsFile {
        /// The flag naming the file, e.g. `--etcd-cafile`.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        error: std::io::Error,
    },
    /// The client could not be set up (invalid endpoint URL, TLS material, failed
    /// authentication).
    #[error("cannot connect to etcd at {endpoints}: {error}")]
    Connect {
        /// The endpoints, comma separated.
        endpoints: String,
        /// The client's error.
        error: etcd_client::Error,
    },
    /// An etcd request failed.
    #[error("etcd {op} {key} at {endpoints} failed: {error}")]
    Request {
        /// The operation, e.g. `get`, `txn`, `lease grant`.
        op: &'static str,
        /// The key (or prefix, or lease) it was about.
        key: String,
        /// The endpoints, comma separated.
        endpoints: String,
        /// The client's error.
        error: etcd_client::Error,
    },
    /// An etcd request got no answer in time (server down or unreachable).
    #[error("etcd {op} {key} at {endpoints} timed out after {timeout:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The key (or prefix) it was about.
        key: String,
        /// The endpoints, comma separated.
        endpoints: String,
        /// The request timeout that passed.
        timeout: Duration,
    },
    /// An etcd response lacked its header (and so its revision).
    #[error("etcd {op} {key} at {endpoints}: response without a header")]
    NoHeader {
        /// The operation.
        op: &'static str,
        /// The key (or prefix).
        key: String,
        /// The endpoints, comma separated.
        endpoints: String,
    },
    /// `<prefix>/config` does not exist (upstream's text).
    #[error("flannel config not found in etcd store. Did you create your config using etcdv3 API?")]
    ConfigNotFound,
    /// `<prefix>/config` is not a valid network configuration.
    #[error("invalid network config in etcd key {key}: {error}")]
    Config {
        /// The config key.
        key: String,
        /// What is wrong with it (names the field).
        error: ConfigError,
    },
    /// No subnet can be allocated (`out of subnets`, IPv6-only config).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// The node's attributes have no IPv4 `PublicIP`, which etcd mode needs.
    #[error("lease attributes have no IPv4 PublicIP (0.0.0.0); etcd mode needs one")]
    NoPublicIp,
    /// The lease has no IPv4 subnet, so it has no etcd key.
    #[error("lease has no IPv4 subnet and so no etcd key")]
    NoSubnet,
    /// Every attempt to write a chosen subnet lost the race against other nodes.
    #[error(
        "max retries reached trying to acquire a subnet: {attempts} attempts lost the race \
         against other nodes writing the same subnet"
    )]
    RaceRetriesExhausted {
        /// How many attempts were made.
        attempts: u32,
    },
    /// The node's lease key was deleted (by hand or by TTL expiry): the daemon must stop.
    #[error("Lease has been revoked")]
    LeaseRevoked,
}
