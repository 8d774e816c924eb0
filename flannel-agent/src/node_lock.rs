//! One agent per node. Two agents on one node (a second one started by hand, a DaemonSet
//! rolled with `maxSurge`, `--detach-fastpath` run while the agent is up) would fight over the
//! same routes, rules and pinned maps: the second would, for instance, remove the pins the
//! first one's programs are driven by. Every agent (and `--detach-fastpath`) therefore holds
//! an exclusive `flock` on `<--state-dir>/agent.lock` while it runs, and refuses to start while
//! another process holds it. The file lives in the state directory, not in bpffs: it has to
//! survive the pin directory being removed, and a kernel-path agent takes it too. The kernel
//! drops the lock when its holder exits, however it exits (a crash or SIGKILL included), so a
//! stale lock cannot keep a node down. The holder writes its pid into the file, for the
//! message of the one it refuses.

use std::{
    fs::{self, File, OpenOptions, TryLockError},
    io::{self, Read as _, Seek as _, SeekFrom, Write as _},
    path::{Path, PathBuf},
};

/// The lock file's name in `--state-dir`.
pub const LOCK_FILE: &str = "agent.lock";

/// Why the lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process holds it.
    #[error(
        "another flannel-agent runs on this node ({holder} holds {}); stop it first",
        path.display()
    )]
    Held {
        /// The lock file.
        path: PathBuf,
        /// `pid N` as the holder wrote it, or what the file holds instead.
        holder: String,
    },
    /// The file could not be created, opened or locked.
    #[error("cannot take the node's agent lock {}: {source}", path.display())]
    Io {
        /// The lock file.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
}

/// The lock, held until dropped (or until the process exits).
#[derive(Debug)]
pub struct NodeLock {
    path: PathBuf,
    _file: File,
}

impl NodeLock {
    /// Takes the lock in `state_dir` (created if missing) without waiting, and writes this
    /// process's pid into it.
    pub fn acquire(state_dir: &Path) -> Result<NodeLock, LockError> {
        let path = state_dir.join(LOCK_FILE);
        let io_error = |source| LockError::Io {
            path: path.clone(),
            source,
        };
        fs::create_dir_all(state_dir).map_err(io_error)?;
        // Not truncated on open: the holder's pid is read from it when the lock is taken.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_error)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(LockError::Held {
                    holder: holder(&mut file),
                    path,
                });
            }
            Err(TryLockError::Error(source)) => return Err(io_error(source)),
        }
        let written = file
            .set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| writeln!(file, "{}", std::process::id()));
        written.map_err(io_error)?;
        Ok(NodeLock { path, _file: file })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The lock for the agent and `--detach-fastpath`: an error when another agent holds it;
/// when it cannot be taken at all (a read-only state directory), a warning, and the caller
/// runs unguarded.
pub fn take(state_dir: &Path) -> Result<Option<NodeLock>, LockError> {
    match NodeLock::acquire(state_dir) {
        Ok(lock) => Ok(Some(lock)),
        Err(err @ LockError::Held { .. }) => Err(err),
        Err(err @ LockError::Io { .. }) => {
            tracing::warn!("{err}: nothing keeps a second agent off this node");
            Ok(None)
        }
    }
}

/// Who holds the lock, from the pid in the file.
fn holder(file: &mut File) -> String {
    let mut text = String::new();
    let _ = file.take(64).read_to_string(&mut text);
    match text.trim().parse::<u32>() {
        Ok(pid) => format!("pid {pid}"),
        Err(_) => "a process".to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let first = NodeLock::acquire(&state).unwrap();
        assert_eq!(first.path(), state.join(LOCK_FILE));
        let pid = std::process::id();
        assert_eq!(
            fs::read_to_string(first.path()).unwrap(),
            format!("{pid}\n")
        );
        // flock conflicts between two opens of the file, within one process too.
        let err = NodeLock::acquire(&state).unwrap_err();
        match &err {
            LockError::Held { holder, path } => {
                assert_eq!(holder, &format!("pid {pid}"));
                assert_eq!(path, first.path());
            }
            other => panic!("{other:?}"),
        }
        let text = err.to_string();
        assert!(
            text.contains("another flannel-agent runs on this node"),
            "{text}"
        );
        assert!(text.contains(&format!("pid {pid}")), "{text}");
        drop(first);
        let again = NodeLock::acquire(&state).unwrap();
        assert_eq!(
            fs::read_to_string(again.path()).unwrap(),
            format!("{pid}\n")
        );
    }

    #[test]
    fn a_lock_file_without_a_pid_names_no_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        fs::write(&path, "garbage\u{0}\n").unwrap();
        let file = File::open(&path).unwrap();
        file.lock().unwrap();
        match NodeLock::acquire(dir.path()).unwrap_err() {
            LockError::Held { holder, .. } => assert_eq!(holder, "a process"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_state_dir_that_cannot_be_made_is_an_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        fs::write(&file, "").unwrap();
        let err = NodeLock::acquire(&file.join("state")).unwrap_err();
        assert!(matches!(err, LockError::Io { .. }), "{err:?}");
        assert!(err.to_string().contains("a-file/state/agent.lock"), "{err}");
    }
}
