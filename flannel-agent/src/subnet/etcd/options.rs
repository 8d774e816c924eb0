//! [`EtcdOptions`] (endpoints, prefix, TLS, credentials) and [`EtcdTuning`] (every time
//! constant, upstream's values by default, shorter ones in tests).

use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};

use super::error::EtcdError;
use crate::backend::Secret;
use crate::cli::Cli;

/// The default `--etcd-prefix`.
pub const DEFAULT_PREFIX: &str = "/coreos.com/network";
/// The default `--etcd-endpoints`.
pub const DEFAULT_ENDPOINTS: [&str; 2] = ["http://127.0.0.1:4001", "http://127.0.0.1:2379"];

/// Time constants of the etcd subnet manager. [`Default`] gives upstream's values (and this
/// implementation's client timeouts); tests shorten them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EtcdTuning {
    /// TTL of the etcd lease a subnet key is attached to (upstream: 24 h).
    pub lease_ttl: Duration,
    /// Renew this long before the lease expires (`--subnet-lease-renew-margin`, default 60 min).
    pub renew_margin: Duration,
    /// Wait after a failed renewal (upstream: 1 min).
    pub renew_retry: Duration,
    /// First delay before re-establishing a broken watch (upstream: 100 ms).
    pub backoff_min: Duration,
    /// Longest delay between watch attempts (upstream: 5 s).
    pub backoff_max: Duration,
    /// How many times `acquire_lease` lists and writes before giving up on lost races
    /// (upstream's constant: 10).
    pub race_attempts: u32,
    /// Timeout for establishing a connection to an endpoint.
    pub connect_timeout: Duration,
    /// Timeout for one request (a watch only until it is established).
    pub request_timeout: Duration,
    /// HTTP/2 keep-alive ping interval while a stream (a watch) is open.
    pub keepalive_interval: Duration,
    /// A ping unanswered this long closes the connection, so a dead server breaks the watches
    /// instead of leaving them silent forever.
    pub keepalive_timeout: Duration,
}

impl Default for EtcdTuning {
    fn default() -> Self {
        EtcdTuning {
            lease_ttl: Duration::from_secs(24 * 60 * 60),
            renew_margin: Duration::from_secs(60 * 60),
            renew_retry: Duration::from_secs(60),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            race_attempts: 10,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            // etcd's server rejects pings more frequent than every 5 s
            // (--grpc-keepalive-min-time), so stay above that.
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
        }
    }
}

/// How to reach etcd and where flannel's keys live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdOptions {
    /// Client URLs (`http://host:port` or `https://host:port`).
    pub endpoints: Vec<String>,
    /// The key prefix (`--etcd-prefix`, default `/coreos.com/network`).
    pub prefix: String,
    /// CA bundle that signs the server certificates (`--etcd-cafile`).
    pub cafile: Option<PathBuf>,
    /// Client certificate (`--etcd-certfile`).
    pub certfile: Option<PathBuf>,
    /// Client key (`--etcd-keyfile`).
    pub keyfile: Option<PathBuf>,
    /// User name for etcd authentication (`--etcd-username`).
    pub username: Option<String>,
    /// Password for etcd authentication (`--etcd-password`).
    pub password: Option<Secret<String>>,
    /// Time constants.
    pub tuning: EtcdTuning,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            endpoints: DEFAULT_ENDPOINTS.iter().map(|e| (*e).to_owned()).collect(),
            prefix: DEFAULT_PREFIX.to_owned(),
            cafile: None,
            certfile: None,
            keyfile: None,
            username: None,
            password: None,
            tuning: EtcdTuning::default(),
        }
    }
}

/// Which transport security the options ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TlsMode<'a> {
    /// Plain HTTP/2.
    Plain,
    /// TLS verifying the server against `ca` (or the system roots), presenting `client`
    /// (certificate, key) if given.
    Tls {
        ca: Option<&'a Path>,
        client: Option<(&'a Path, &'a Path)>,
    },
}

impl EtcdOptions {
    /// The options the command line asks for (`--etcd-*`, `--subnet-lease-renew-margin`).
    pub fn from_cli(cli: &Cli) -> Self {
        EtcdOptions {
            endpoints: cli.etcd_endpoint_list(),
            prefix: cli.etcd_prefix.clone(),
            cafile: cli.etcd_cafile.clone(),
            certfile: cli.etcd_certfile.clone(),
            keyfile: cli.etcd_keyfile.clone(),
            username: cli.etcd_username.clone().filter(|u| !u.is_empty()),
            password: cli.etcd_password.clone(),
            tuning: EtcdTuning {
                renew_margin: cli.renew_margin(),
                ..EtcdTuning::default()
            },
        }
    }

    /// The endpoints as one string, for messages.
    pub fn endpoint_list(&self) -> String {
        self.endpoints.join(",")
    }

    /// Upstream's rule: TLS with a client certificate only when **both** `--etcd-certfile`
    /// and `--etcd-keyfile` are set (the CA is then optional: system roots otherwise).
    /// Additionally, `https://` endpoints get server-authenticated TLS without a client
    /// certificate (the Go client does the same), verified against `--etcd-cafile` if given.
    pub(crate) fn tls_mode(&self) -> Result<TlsMode<'_>, EtcdError> {
        let https = self.endpoints.iter().any(|e| e.starts_with("https://"));
        let http = self.endpoints.iter().any(|e| e.starts_with("http://"));
        let client = match (non_empty(&self.certfile), non_empty(&self.keyfile)) {
            (Some(cert), Some(key)) => Some((cert, key)),
            _ => None,
        };
        let ca = non_empty(&self.cafile);
        if https && http {
            return Err(EtcdError::MixedSchemes {
                endpoints: self.endpoint_list(),
            });
        }
        // Endpoints without a scheme get https:// from the client when TLS is configured.
        let use_tls = https || (client.is_some() && !http);
        if use_tls {
            return Ok(TlsMode::Tls { ca, client });
        }
        if client.is_some() {
            tracing::warn!(
                "etcd endpoints use http:// ({}): --etcd-certfile/--etcd-keyfile are not used",
                self.endpoint_list()
            );
        } else if self.certfile.is_some() || self.keyfile.is_some() || ca.is_some() {
            tracing::warn!(
                "TLS to etcd needs both --etcd-certfile and --etcd-keyfile; connecting without TLS"
            );
        }
        Ok(TlsMode::Plain)
    }

    /// The etcd-client connection options: timeouts, keep-alive, leader requirement (as
    /// upstream's watches), credentials and TLS.
    pub(crate) fn connect_options(&self) -> Result<ConnectOptions, EtcdError> {
        let t = &self.tuning;
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(t.connect_timeout)
            .with_timeout(t.request_timeout)
            .with_keep_alive(t.keepalive_interval, t.keepalive_timeout)
            // Idle pings (no open stream) count as abuse on etcd's side and end in GOAWAY.
            .with_keep_alive_while_idle(false)
            .with_require_leader(true);
        if let Some(user) = &self.username {
            let password = self
                .password
                .as_ref()
                .map(|p| p.expose().clone())
                .unwrap_or_default();
            // etcd's simple tokens expire after 5 min of inactivity.
            opts = opts
                .with_user(user.clone(), password)
                .with_auto_token_refresh(true);
        }
        if let TlsMode::Tls { ca, client } = self.tls_mode()? {
            let mut tls = TlsOptions::new().assume_http2(true);
            tls = match ca {
                Some(path) => {
                    tls.ca_certificate(Certificate::from_pem(read(path, "--etcd-cafile")?))
                }
                None => tls.with_native_roots(),
            };
            if let Some((cert, key)) = client {
                tls = tls.identity(Identity::from_pem(
                    read(cert, "--etcd-certfile")?,
                    read(key, "--etcd-keyfile")?,
                ));
            }
            opts = opts.with_tls(tls);
        }
        Ok(opts)
    }
}

fn non_empty(p: &Option<PathBuf>) -> Option<&Path> {
    p.as_deref().filter(|p| !p.as_os_str().is_empty())
}

fn read(path: &Path, flag: &'static str) -> Result<Vec<u8>, EtcdError> {
    std::fs::read(path).map_err(|error| EtcdError::TlsFile {
        flag,
        path: path.to_owned(),
        error,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        let mut argv = vec!["flanneld".to_owned()];
        argv.extend(args.iter().map(|a| (*a).to_owned()));
        Cli::parse_from(argv, |_| None).unwrap()
    }

    #[test]
    fn defaults_follow_upstream() {
        let t = EtcdTuning::default();
        assert_eq!(t.lease_ttl, Duration::from_secs(86400));
        assert_eq!(t.renew_margin, Duration::from_secs(3600));
        assert_eq!(t.renew_retry, Duration::from_secs(60));
        assert_eq!(t.backoff_min, Duration::from_millis(100));
        assert_eq!(t.backoff_max, Duration::from_secs(5));
        assert_eq!(t.race_attempts, 10);
        let o = EtcdOptions::from_cli(&cli(&[]));
        assert_eq!(
            o.endpoints,
            ["http://127.0.0.1:4001", "http://127.0.0.1:2379"]
        );
        assert_eq!(o.prefix, "/coreos.com/network");
        assert_eq!(o, EtcdOptions::default());
        assert_eq!(o.tls_mode().unwrap(), TlsMode::Plain);
    }

    #[test]
    fn cli_flags_are_carried_over() {
        let o = EtcdOptions::from_cli(&cli(&[
            "--etcd-endpoints=https://10.0.0.1:2379,https://10.0.0.2:2379",
            "--etcd-prefix=/my/net",
            "--etcd-username=flannel",
            "--etcd-password=s3cret",
            "--etcd-cafile=/etc/ca.pem",
            "--subnet-lease-renew-margin=30",
        ]));
        assert_eq!(o.endpoints.len(), 2);
        assert_eq!(o.prefix, "/my/net");
        assert_eq!(o.username.as_deref(), Some("flannel"));
        assert_eq!(
            o.password.as_ref().map(|p| p.expose().as_str()),
            Some("s3cret")
        );
        assert!(!format!("{o:?}").contains("s3cret"));
        assert_eq!(o.tuning.renew_margin, Duration::from_secs(1800));
        assert_eq!(o.tuning.lease_ttl, Duration::from_secs(86400));
        // https endpoints: server-authenticated TLS against the CA, no client certificate.
        assert_eq!(
            o.tls_mode().unwrap(),
            TlsMode::Tls {
                ca: Some(Path::new("/etc/ca.pem")),
                client: None
            }
        );
    }

    #[test]
    fn tls_needs_both_certificate_and_key() {
        let base = EtcdOptions {
            endpoints: vec!["127.0.0.1:2379".into()],
            ..EtcdOptions::default()
        };
        let with = |cert: Option<&str>, key: Option<&str>, ca: Option<&str>| EtcdOptions {
            certfile: cert.map(PathBuf::from),
            keyfile: key.map(PathBuf::from),
            cafile: ca.map(PathBuf::from),
            ..base.clone()
        };
        assert_eq!(
            with(Some("c"), Some("k"), None).tls_mode().unwrap(),
            TlsMode::Tls {
                ca: None,
                client: Some((Path::new("c"), Path::new("k")))
            }
        );
        assert_eq!(
            with(Some("c"), Some("k"), Some("ca")).tls_mode().unwrap(),
            TlsMode::Tls {
                ca: Some(Path::new("ca")),
                client: Some((Path::new("c"), Path::new("k")))
            }
        );
        // One of the two, or the CA alone: plaintext, as upstream.
        for o in [
            with(Some("c"), None, Some("ca")),
            with(None, Some("k"), None),
            with(None, None, Some("ca")),
            with(Some(""), Some(""), None),
        ] {
            assert_eq!(o.tls_mode().unwrap(), TlsMode::Plain, "{o:?}");
        }
        // http:// endpoints never use TLS.
        let http = EtcdOptions {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            ..with(Some("c"), Some("k"), None)
        };
        assert_eq!(http.tls_mode().unwrap(), TlsMode::Plain);
        let mixed = EtcdOptions {
            endpoints: vec!["http://a:2379".into(), "https://b:2379".into()],
            ..EtcdOptions::default()
        };
        assert_eq!(
            mixed.tls_mode().unwrap_err().to_string(),
            "etcd endpoints mix http:// and https:// (http://a:2379,https://b:2379); use one \
             scheme for all"
        );
    }

    #[test]
    fn unreadable_tls_files_are_named() {
        let o = EtcdOptions {
            endpoints: vec!["https://127.0.0.1:2379".into()],
            cafile: Some("/nonexistent/ca.pem".into()),
            ..EtcdOptions::default()
        };
        let e = o.connect_options().unwrap_err().to_string();
        assert!(
            e.starts_with("cannot read --etcd-cafile /nonexistent/ca.pem: "),
            "{e}"
        );
    }
}
