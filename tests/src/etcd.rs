//! A real etcd (Debian's etcd-server, v3 API) on loopback with a temporary data directory.
//! It can be stopped and started again on the same ports and data (outage tests) and is killed
//! on drop.

use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

pub struct Etcd {
    client_port: u16,
    peer_port: u16,
    data_dir: tempfile::TempDir,
    child: Option<Child>,
    bind: String,
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Etcd {
    /// Starts etcd on free loopback ports and waits until it answers `/health`.
    pub fn start() -> Result<Self> {
        Self::start_on("127.0.0.1")
    }

    /// Starts etcd listening on `bind` (an address of the current network namespace). The
    /// free ports are picked before etcd binds them, so a test starting anything else at the
    /// same moment can take one first: then it is tried again on other ports.
    pub fn start_on(bind: &str) -> Result<Self> {
        let mut attempt = 0;
        loop {
            let mut etcd = Etcd {
                client_port: free_port()?,
                peer_port: free_port()?,
                data_dir: tempfile::Builder::new().prefix("flannel-etcd").tempdir()?,
                child: None,
                bind: bind.to_owned(),
            };
            match etcd.resume() {
                Ok(()) => return Ok(etcd),
                Err(e) if attempt < 4 && format!("{e:#}").contains("address already in use") => {
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// `http://<bind>:<port>`, the value for `--etcd-endpoints`.
    pub fn endpoint(&self) -> String {
        format!("http://{}:{}", self.bind, self.client_port)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.data_dir.path().to_path_buf()
    }

    /// Stops the server (SIGKILL, as a crash or a network outage would look to clients).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again with the same ports and data.
    pub fn resume(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let client = format!("http://{}:{}", self.bind, self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.data_dir.path().join("etcd.log"))?;
        let child = Command::new("etcd")
            .args(["--name", "default", "--data-dir"])
            .arg(self.data_dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("default={peer}")])
            .args(["--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting etcd (is etcd-server installed? run `cargo xtask setup`)")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.healthy() {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                let log = std::fs::read_to_string(self.data_dir.path().join("etcd.log"))
                    .unwrap_or_default();
                bail!("etcd exited ({status}): {log}");
            }
            thread::sleep(Duration::from_millis(100));
        }
        bail!("etcd did not become healthy on {}", self.endpoint())
    }

    fn healthy(&self) -> bool {
        self.http_get("/health")
            .is_ok_and(|body| body.contains("\"health\":\"true\""))
    }

    /// How many gRPC requests of `method` (e.g. `LeaseTimeToLive`) the server has started
    /// since it was (re)started, from its Prometheus metrics (`grpc_server_started_total`).
    pub fn requests_started(&self, method: &str) -> Result<u64> {
        let metrics = self.http_get("/metrics")?;
        let label = format!("grpc_method=\"{method}\"");
        let line = metrics
            .lines()
            .find(|l| l.starts_with("grpc_server_started_total{") && l.contains(&label))
            .with_context(|| format!("no grpc_server_started_total for {method} in /metrics"))?;
        let value = line.rsplit(' ').next().unwrap_or_default();
        value
            .parse::<f64>()
            .map(|v| v as u64)
            .with_context(|| format!("bad metric line {line:?}"))
    }

    /// The body (with the response head) of an HTTP/1.0 GET of `path` on the client port.
    fn http_get(&self, path: &str) -> Result<String> {
        let mut stream = TcpStream::connect((self.bind.as_str(), self.client_port))?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut body = String::new();
        stream.read_to_string(&mut body)?;
        Ok(body)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_starts_stops_and_resumes() {
        if Command::new("etcd").arg("--version").output().is_err() {
            eprintln!("skipped: etcd not installed");
            return;
        }
        let mut etcd = Etcd::start().expect("start etcd");
        assert!(etcd.healthy());
        etcd.stop();
        assert!(!etcd.healthy());
        etcd.resume().expect("resume");
        assert!(etcd.healthy());
    }
}
