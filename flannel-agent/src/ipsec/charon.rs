//! strongSwan's IKE daemon: use the one answering on the VICI socket, or start `charon`
//! (searched as upstream: `PATH`, then `/usr/lib/strongswan`, `/usr/lib/ipsec`,
//! `/usr/libexec/strongswan`, `/usr/libexec/ipsec`) as a child that receives SIGTERM when
//! the agent ends (parent-death signal) or drops it.
//!
//! A charon the agent did not start (a host strongSwan service) keeps running across agent
//! restarts; one the agent started ends with it, as upstream.
//!
//! `private_run` starts charon in a private mount namespace with a fresh tmpfs on `/run`, so
//! its fixed pid file `/var/run/charon.pid` does not collide with another charon on the same
//! host (tests, simulated nodes); the VICI socket must then lie outside `/run`
//! (`charon.plugins.vici.socket` in the `strongswan.conf` named by `STRONGSWAN_CONF`).

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use super::client::ViciClient;
use crate::child_mount::ChildMount;

/// Upstream's VICI socket.
pub const DEFAULT_VICI_SOCKET: &str = "/var/run/charon.vici";
/// Where charon is searched after `PATH`.
pub const SEARCH_PATHS: [&str; 4] = [
    "/usr/lib/strongswan/charon",
    "/usr/lib/ipsec/charon",
    "/usr/libexec/strongswan/charon",
    "/usr/libexec/ipsec/charon",
];
/// How long a started charon may take to open its VICI socket.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Errors starting or reaching charon.
#[derive(Debug, thiserror::Error)]
pub enum CharonError {
    /// No charon binary.
    #[error(
        "charon (strongSwan's IKE daemon) not found in PATH nor in {}; install strongSwan \
         (Debian: strongswan-charon)",
        SEARCH_PATHS.join(", ")
    )]
    NotFound,
    /// It could not be started.
    #[error("starting {}: {source}", program.display())]
    Spawn {
        /// The binary.
        program: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// It exited during start-up.
    #[error("{} exited during start-up ({status}); its output: {output}", program.display())]
    Exited {
        /// The binary.
        program: PathBuf,
        /// The exit status.
        status: String,
        /// Its log (trimmed).
        output: String,
    },
    /// The socket did not answer in time.
    #[error("charon did not open its VICI socket {} within {START_TIMEOUT:?}", socket.display())]
    NoSocket {
        /// The socket.
        socket: PathBuf,
    },
}

/// How to find or start charon.
#[derive(Debug, Clone)]
pub struct CharonOptions {
    /// The binary; `None` searches as upstream.
    pub program: Option<PathBuf>,
    /// The VICI socket to use or wait for.
    pub vici_socket: PathBuf,
    /// `STRONGSWAN_CONF` for a started charon; `None` keeps the system's.
    pub strongswan_conf: Option<PathBuf>,
    /// Start it in a private mount namespace with its own `/run` (see the module docs).
    pub private_run: bool,
    /// Where a started charon's stdout/stderr go (`None`: discarded).
    pub log: Option<PathBuf>,
}

impl Default for CharonOptions {
    fn default() -> Self {
        CharonOptions {
            program: None,
            vici_socket: PathBuf::from(DEFAULT_VICI_SOCKET),
            strongswan_conf: None,
            private_run: false,
            log: None,
        }
    }
}

/// Finds charon as upstream does.
pub fn find_charon() -> Option<PathBuf> {
    let in_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("charon"))
            .find(|p| p.is_file())
    });
    in_path.or_else(|| SEARCH_PATHS.iter().map(PathBuf::from).find(|p| p.is_file()))
}

/// A charon in use: started by us (and stopped with us) or found running.
#[derive(Debug)]
pub struct Charon {
    socket: PathBuf,
    child: Option<tokio::process::Child>,
}

impl Charon {
    /// Uses the charon answering on `options.vici_socket`, or starts one and waits for the
    /// socket.
    pub async fn start_or_attach(options: &CharonOptions) -> Result<Charon, CharonError> {
        if ViciClient::connect(&options.vici_socket).await.is_ok() {
            tracing::info!(
                socket = %options.vici_socket.display(),
                "using the running charon"
            );
            return Ok(Charon {
                socket: options.vici_socket.clone(),
                child: None,
            });
        }
        let program = match &options.program {
            Some(p) => p.clone(),
            None => find_charon().ok_or(CharonError::NotFound)?,
        };
        let (stdout, stderr) = match &options.log {
            Some(path) => {
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| CharonError::Spawn {
                        program: program.clone(),
                        source,
                    })?;
                let clone = file.try_clone().map_err(|source| CharonError::Spawn {
                    program: program.clone(),
                    source,
                })?;
                (Stdio::from(file), Stdio::from(clone))
            }
            None => (Stdio::null(), Stdio::null()),
        };
        let mut cmd = tokio::process::Command::new(&program);
        cmd.stdin(Stdio::null()).stdout(stdout).stderr(stderr);
        if let Some(conf) = &options.strongswan_conf {
            cmd.env("STRONGSWAN_CONF", conf);
        }
        let private = if options.private_run {
            Some(
                ChildMount::tmpfs(Path::new("/run")).map_err(|source| CharonError::Spawn {
                    program: program.clone(),
                    source,
                })?,
            )
        } else {
            None
        };
        // SAFETY: only async-signal-safe system calls on data prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(p) = &private {
                    p.apply()?;
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| CharonError::Spawn {
            program: program.clone(),
            source,
        })?;
        tracing::info!(
            program = %program.display(),
            pid = ?child.id(),
            socket = %options.vici_socket.display(),
            "started charon"
        );
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let output = options
                    .log
                    .as_ref()
                    .and_then(|p| std::fs::read_to_string(p).ok())
                    .map(|t| {
                        let lines: Vec<&str> = t.lines().collect();
                        lines[lines.len().saturating_sub(5)..].join("; ")
                    })
                    .unwrap_or_default();
                return Err(CharonError::Exited {
                    program,
                    status: status.to_string(),
                    output,
                });
            }
            if ViciClient::connect(&options.vici_socket).await.is_ok() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.start_kill();
                return Err(CharonError::NoSocket {
                    socket: options.vici_socket.clone(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Charon {
            socket: options.vici_socket.clone(),
            child: Some(child),
        })
    }

    /// The VICI socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The pid of a charon this agent started.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(|c| c.id())
    }

    /// SIGTERM to a charon this agent started, then waits up to 10 s (SIGKILL after).
    pub async fn stop(mut self) {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
                // SAFETY: signalling our own child by pid.
                unsafe {
                    libc::kill(pid, libc::SIGTERM);
                }
            }
            if tokio::time::timeout(Duration::from_secs(10), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }
}

impl Drop for Charon {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child
            && let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok())
        {
            // SAFETY: signalling our own child by pid; tokio reaps it.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_finds_debians_charon_when_installed() {
        let found = find_charon();
        if Path::new("/usr/lib/ipsec/charon").is_file() {
            assert!(found.is_some());
        }
        if let Some(p) = found {
            assert!(p.ends_with("charon"));
        }
    }
}
