//! The userspace WireGuard device for kernels without WireGuard: `wireguard-go <dev>` (or
//! the program named by `WG_QUICK_USERSPACE_IMPLEMENTATION`, as wg-quick does, e.g.
//! boringtun), configured through its UAPI socket `<socket dir>/<dev>.sock`.
//!
//! Lifetime: the implementation is started *detached*. wireguard-go daemonizes itself (the
//! launched process opens the TUN device and the UAPI socket, hands both to a re-executed
//! child and exits 0), and the agent starts it in a session of its own. So it outlives the
//! agent: a restarted agent finds the device and its socket, checks that the process behind
//! the socket runs in its own network namespace (`SO_PEERCRED` pid, `/proc/<pid>/ns/net`),
//! and adopts it with its peers and sessions intact. Traffic never stops for an agent
//! restart. The device disappears only when the process exits (it is stopped with the
//! device: `ip link del flannel-wg` ends it), and the reconciler then starts a new one.
//! (In a container whose PID namespace ends with the agent, the kernel ends the process too;
//! that is the container runtime's doing and the same for any child.)
//!
//! Socket directory: wireguard-go always uses `/var/run/wireguard`, which `wg show` reads.
//! With another directory (`--wireguard-socket-dir`, for several simulated nodes on one
//! host), the program is started in a private mount namespace where that directory is
//! bind-mounted over `/run/wireguard`; the socket then appears in the chosen directory.

use std::{
    ffi::OsString,
    os::unix::{ffi::OsStrExt as _, fs::DirBuilderExt as _},
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use super::uapi::UapiClient;
use crate::child_mount::ChildMount;

/// Where wireguard-go and wg-tools keep UAPI sockets.
pub const STANDARD_SOCKET_DIR: &str = "/var/run/wireguard";
/// The same directory without the `/var/run` symlink (the bind-mount target).
const STANDARD_SOCKET_DIR_REAL: &str = "/run/wireguard";
/// wg-quick's variable naming the userspace implementation.
pub const USERSPACE_PROGRAM_ENV: &str = "WG_QUICK_USERSPACE_IMPLEMENTATION";
/// The default userspace implementation.
pub const DEFAULT_USERSPACE_PROGRAM: &str = "wireguard-go";
/// How long the launcher may take to bring the device up.
pub const LAUNCH_TIMEOUT: Duration = Duration::from_secs(15);

/// Errors of the userspace device.
#[derive(Debug, thiserror::Error)]
pub enum UserspaceError {
    /// The program could not be started.
    #[error(
        "cannot start the userspace WireGuard implementation {program:?} for {device}: {source} \
         (install wireguard-go, or set {USERSPACE_PROGRAM_ENV})"
    )]
    Spawn {
        /// The program.
        program: String,
        /// The device.
        device: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A socket directory of its own could not be given to the program: the bind mount over
    /// the standard one, in a mount namespace of the program's own, takes `CAP_SYS_ADMIN`.
    #[error(
        "cannot start the userspace WireGuard implementation {program:?} for {device} with its \
         socket in {}: a --wireguard-socket-dir other than {STANDARD_SOCKET_DIR} is bind-mounted \
         over it in a mount namespace of the program's own, which takes CAP_SYS_ADMIN ({source}); \
         leave --wireguard-socket-dir at {STANDARD_SOCKET_DIR} or grant CAP_SYS_ADMIN",
        dir.display()
    )]
    SocketDirMount {
        /// The program.
        program: String,
        /// The device.
        device: String,
        /// The socket directory asked for.
        dir: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The program ran and failed.
    #[error("{program} {device} failed ({status}): {stderr}")]
    Failed {
        /// The program.
        program: String,
        /// The device.
        device: String,
        /// Its exit status.
        status: String,
        /// What it printed (trimmed).
        stderr: String,
    },
    /// The program did not finish in time.
    #[error("{program} {device} did not finish within {LAUNCH_TIMEOUT:?}")]
    Timeout {
        /// The program.
        program: String,
        /// The device.
        device: String,
    },
    /// The UAPI socket belongs to a process in another network namespace.
    #[error(
        "the WireGuard UAPI socket {} belongs to process {pid} in another network namespace; \
         give each node its own --wireguard-socket-dir",
        path.display()
    )]
    Foreign {
        /// The socket.
        path: PathBuf,
        /// The process.
        pid: i32,
    },
    /// A directory could not be created.
    #[error("WireGuard socket directory {}: {source}", path.display())]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// A running userspace device found behind its socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Running {
    /// The process serving the socket, when it can be told (wireguard-go's socket was
    /// opened by its launcher, which has exited; the server is then looked up by name).
    pub pid: Option<i32>,
}

fn netns_of(pid: i32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()
}

fn own_netns() -> Option<PathBuf> {
    std::fs::read_link("/proc/thread-self/ns/net").ok()
}

/// A process in this network namespace whose command line is `<program> [-f] <device>`.
fn find_server(program: &str, device: &str) -> Option<i32> {
    let ours = own_netns()?;
    let base = Path::new(program).file_name()?.to_owned();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .collect();
        let first = Path::new(std::ffi::OsStr::from_bytes(args.first()?));
        (first.file_name()? == base
            && args.last() == Some(&device.as_bytes())
            && netns_of(pid).as_ref() == Some(&ours))
        .then_some(pid)
    })
}

/// Starts and finds userspace WireGuard devices.
#[derive(Debug, Clone)]
pub struct Userspace {
    socket_dir: PathBuf,
    program: OsString,
}

impl Userspace {
    /// Devices with sockets in `socket_dir`; the program from
    /// [`USERSPACE_PROGRAM_ENV`] or [`DEFAULT_USERSPACE_PROGRAM`].
    pub fn new(socket_dir: impl Into<PathBuf>) -> Self {
        let program = std::env::var_os(USERSPACE_PROGRAM_ENV)
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| DEFAULT_USERSPACE_PROGRAM.into());
        Userspace {
            socket_dir: socket_dir.into(),
            program,
        }
    }

    /// Uses `program` instead.
    pub fn with_program(mut self, program: impl Into<OsString>) -> Self {
        self.program = program.into();
        self
    }

    /// The program's name as given.
    pub fn program(&self) -> String {
        self.program.to_string_lossy().into_owned()
    }

    /// The socket directory.
    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// The UAPI socket of `device`.
    pub fn socket_path(&self, device: &str) -> PathBuf {
        self.socket_dir.join(format!("{device}.sock"))
    }

    /// The UAPI client of `device`.
    pub fn client(&self, device: &str) -> UapiClient {
        UapiClient::new(self.socket_path(device))
    }

    /// Whether the socket directory is the standard one (no mount namespace needed).
    pub fn uses_standard_dir(&self) -> bool {
        let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned());
        let dir = canon(&self.socket_dir);
        dir == Path::new(STANDARD_SOCKET_DIR_REAL)
            || dir == canon(Path::new(STANDARD_SOCKET_DIR))
            || self.socket_dir == Path::new(STANDARD_SOCKET_DIR)
    }

    /// Whether `device`'s socket answers: `None` when nothing does;
    /// [`UserspaceError::Foreign`] when the process that opened it is known to run in
    /// another network namespace (several nodes sharing one socket directory).
    pub async fn find(&self, device: &str) -> Result<Option<Running>, UserspaceError> {
        let client = self.client(device);
        let Ok(stream) = client.connect().await else {
            return Ok(None);
        };
        let pid = stream
            .peer_cred()
            .ok()
            .and_then(|c| c.pid())
            .filter(|p| *p > 0);
        drop(stream);
        if let Some(pid) = pid
            && let (Some(ours), Some(theirs)) = (own_netns(), netns_of(pid))
        {
            if ours != theirs {
                return Err(UserspaceError::Foreign {
                    path: client.path().to_owned(),
                    pid,
                });
            }
            return Ok(Some(Running { pid: Some(pid) }));
        }
        Ok(Some(Running {
            pid: find_server(&self.program(), device),
        }))
    }

    /// Starts the implementation for `device` (detached, see the module documentation) and
    /// waits until it has created the device and its socket.
    pub async fn launch(&self, device: &str) -> Result<(), UserspaceError> {
        let dir_err = |path: &Path| {
            let path = path.to_owned();
            move |source| UserspaceError::Dir { path, source }
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&self.socket_dir)
            .map_err(dir_err(&self.socket_dir))?;
        let private_dir = if self.uses_standard_dir() {
            None
        } else {
            let target = Path::new(STANDARD_SOCKET_DIR_REAL);
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(target)
                .map_err(dir_err(target))?;
            let source =
                std::fs::canonicalize(&self.socket_dir).map_err(dir_err(&self.socket_dir))?;
            Some(ChildMount::bind(&source, target).map_err(dir_err(&source))?)
        };

        let mut cmd = tokio::process::Command::new(&self.program);
        cmd.arg(device)
            .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
            // With LOG_LEVEL set wireguard-go's daemon would keep our stderr pipe open.
            .env_remove("LOG_LEVEL")
            .env_remove("WG_TUN_FD")
            .env_remove("WG_UAPI_FD")
            .env_remove("WG_PROCESS_FOREGROUND")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe system calls on data prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(m) = &private_dir {
                    m.apply()?;
                }
                Ok(())
            });
        }
        let program = self.program();
        let output = cmd.output();
        let output = tokio::time::timeout(LAUNCH_TIMEOUT, output)
            .await
            .map_err(|_| UserspaceError::Timeout {
                program: program.clone(),
                device: device.to_owned(),
            })?
            .map_err(|source| {
                if !self.uses_standard_dir() && source.raw_os_error() == Some(libc::EPERM) {
                    UserspaceError::SocketDirMount {
                        program: program.clone(),
                        device: device.to_owned(),
                        dir: self.socket_dir.clone(),
                        source,
                    }
                } else {
                    UserspaceError::Spawn {
                        program: program.clone(),
                        device: device.to_owned(),
                        source,
                    }
                }
            })?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            // Drop wireguard-go's banner box, keep its error lines.
            let text: Vec<&str> = stderr
                .lines()
                .filter(|l| !l.starts_with(['┌', '│', '└']))
                .filter(|l| !l.trim().is_empty())
                .collect();
            return Err(UserspaceError::Failed {
                program,
                device: device.to_owned(),
                status: output.status.to_string(),
                stderr: text.join("; "),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn socket_paths_and_standard_dir() {
        let u = Userspace::new("/var/run/wireguard");
        assert!(u.uses_standard_dir());
        assert_eq!(
            u.socket_path("flannel-wg"),
            PathBuf::from("/var/run/wireguard/flannel-wg.sock")
        );
        let dir = tempfile::tempdir().unwrap();
        let u = Userspace::new(dir.path()).with_program("/bin/false");
        assert!(!u.uses_standard_dir());
        assert_eq!(u.program(), "/bin/false");
    }

    #[tokio::test]
    async fn nothing_listening_is_none_and_failures_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let u = Userspace::new(dir.path()).with_program("/nonexistent/wireguard-go");
        assert_eq!(u.find("flannel-wg").await.unwrap(), None);
        let e = u.launch("flannel-wg").await.unwrap_err().to_string();
        assert!(e.contains("/nonexistent/wireguard-go"), "{e}");
        assert!(e.contains("install wireguard-go"), "{e}");
    }
}
