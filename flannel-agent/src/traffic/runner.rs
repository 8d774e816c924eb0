//! Running the iptables/nft binaries, optionally through a prefix such as
//! `nsenter --net=/run/netns/x --` so that tests (and tools) can drive another network namespace.

use std::{
    fmt, io,
    io::Write as _,
    process::{Command, Stdio},
};

use super::TrafficError;

/// What a finished command left behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutput {
    /// Whether it exited with status 0.
    pub success: bool,
    /// The exit status as text for error messages (`exit status 1`, `signal 9`).
    pub status: String,
    /// Standard output (lossy UTF-8).
    pub stdout: String,
    /// Standard error (lossy UTF-8).
    pub stderr: String,
}

/// Runs external programs. The traffic managers never spawn processes themselves, so a runner
/// decides *where* they run (host, another network namespace) and tests can script answers.
///
/// Implementations are synchronous; async callers run the managers in `spawn_blocking`.
pub trait CommandRunner: fmt::Debug + Send + Sync {
    /// Runs `program args...`, feeding `stdin` when given (otherwise stdin is empty).
    ///
    /// A program that does not exist must be reported as an error of kind
    /// [`io::ErrorKind::NotFound`]; a program that ran returns `Ok` whatever its exit status.
    fn run(&self, program: &str, args: &[&str], stdin: Option<&[u8]>) -> io::Result<CommandOutput>;

    /// Reads a (small) file as seen from where the commands run, `Ok(None)` if it does not exist.
    /// Used for `/proc/net/ip_tables_names`, which is per network namespace.
    fn read_file(&self, path: &str) -> io::Result<Option<String>>;
}

/// Runs a command and turns a failure into [`TrafficError`].
pub(crate) fn run_ok(
    runner: &dyn CommandRunner,
    program: &str,
    args: &[&str],
    stdin: Option<&[u8]>,
) -> Result<String, TrafficError> {
    let out = runner
        .run(program, args, stdin)
        .map_err(|source| TrafficError::Spawn {
            command: command_line(program, args),
            source,
        })?;
    if out.success {
        Ok(out.stdout)
    } else {
        Err(TrafficError::Command {
            command: command_line(program, args),
            status: out.status,
            stderr: out.stderr.trim().to_owned(),
        })
    }
}

/// `program arg1 arg2` for messages.
pub(crate) fn command_line(program: &str, args: &[&str]) -> String {
    let mut s = program.to_owned();
    for a in args {
        s.push(' ');
        s.push_str(a);
    }
    s
}

/// Runs programs on this machine, optionally behind a fixed prefix
/// (e.g. `["nsenter", "--net=/run/netns/node", "--"]`).
#[derive(Debug, Clone, Default)]
pub struct SystemRunner {
    prefix: Vec<String>,
}

/// Exit status with which `nsenter` (and shells) report a program that could not be executed.
const EXEC_NOT_FOUND: i32 = 127;

impl SystemRunner {
    /// Runs programs directly in the current namespaces (what the daemon uses).
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs every program as `prefix... program args...`.
    pub fn with_prefix(prefix: Vec<String>) -> Self {
        SystemRunner { prefix }
    }

    /// Runs every program inside the network namespace at `path` via
    /// `nsenter --net=<path> --` (network namespace only, the mount namespace stays).
    pub fn in_netns(path: &std::path::Path) -> Self {
        Self::with_prefix(vec![
            "nsenter".to_owned(),
            format!("--net={}", path.display()),
            "--".to_owned(),
        ])
    }

    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut cmd = match self.prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(program);
                c
            }
            None => Command::new(program),
        };
        cmd.args(args);
        // Tools must print the C locale's messages and numbers.
        cmd.env("LC_ALL", "C");
        cmd
    }
}

impl CommandRunner for SystemRunner {
    fn run(&self, program: &str, args: &[&str], stdin: Option<&[u8]>) -> io::Result<CommandOutput> {
        let mut cmd = self.command(program, args);
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = cmd.spawn()?;
        let pipe = child.stdin.take();
        // Write stdin on its own thread while the output is collected, so a large payload
        // and a chatty program cannot block each other. A write error (the program exited
        // early) shows up in its exit status.
        let out = std::thread::scope(|scope| {
            if let (Some(data), Some(mut pipe)) = (stdin, pipe) {
                scope.spawn(move || {
                    let _ = pipe.write_all(data);
                });
            }
            child.wait_with_output()
        })?;
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if !self.prefix.is_empty()
            && out.status.code() == Some(EXEC_NOT_FOUND)
            && stderr.contains("No such file or directory")
        {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                stderr.trim().to_owned(),
            ));
        }
        Ok(CommandOutput {
            success: out.status.success(),
            status: out.status.to_string(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr,
        })
    }

    fn read_file(&self, path: &str) -> io::Result<Option<String>> {
        if self.prefix.is_empty() {
            return match std::fs::read_to_string(path) {
                Ok(s) => Ok(Some(s)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e),
            };
        }
        let out = self.run("cat", &[path], None)?;
        if out.success {
            Ok(Some(out.stdout))
        } else if out.stderr.contains("No such file or directory") {
            Ok(None)
        } else {
            Err(io::Error::other(out.stderr.trim().to_owned()))
        }
    }
}
