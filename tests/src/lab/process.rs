//! Processes started inside a network namespace and kept as guards: dropping the guard kills
//! the process (SIGKILL) and reaps it, so nothing outlives a test or a lab run, even on panic.

use std::{
    fs::OpenOptions,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use nix::{sys::signal::Signal, unistd::Pid};

use crate::netns::NetNs;

/// `nsenter --net=<ns_path> -- <program>`: only the network namespace changes, so the
/// process still sees the host's mounts (notably bpffs under /sys/fs/bpf, which
/// `ip netns exec` would hide by remounting /sys). nsenter execs the program without forking,
/// so the child's pid is the program's.
pub fn ns_command(ns_path: &Path, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", ns_path.display()))
        .arg("--")
        .arg(program);
    cmd
}

/// Where a process's stdout and stderr go.
#[derive(Debug, Clone, Default)]
pub enum Output {
    /// Discarded.
    #[default]
    Null,
    /// Written to this file (created or truncated).
    File(PathBuf),
    /// Appended to this file (created if missing), e.g. for a restarted agent.
    Append(PathBuf),
}

/// A running (or exited, not yet dropped) child process.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
    status: Option<ExitStatus>,
}

impl Process {
    /// Spawns `argv` inside `ns` with stdin from /dev/null and output to `output`.
    pub fn spawn(ns: &NetNs, argv: &[&str], output: Output) -> Result<Process> {
        let (program, args) = argv.split_first().context("empty command")?;
        let mut cmd = ns_command(&ns.path(), program);
        cmd.args(args);
        Process::start(&format!("{} in {}", argv.join(" "), ns.name()), cmd, output)
    }

    /// Spawns a prepared command (see [`ns_command`]); `name` is used in messages.
    pub fn start(name: &str, mut cmd: Command, output: Output) -> Result<Process> {
        let (stdout, stderr) = match &output {
            Output::Null => (Stdio::null(), Stdio::null()),
            Output::File(path) | Output::Append(path) => {
                let file = OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(matches!(output, Output::Append(_)))
                    .truncate(matches!(output, Output::File(_)))
                    .open(path)
                    .with_context(|| format!("opening log {}", path.display()))?;
                (Stdio::from(file.try_clone()?), Stdio::from(file))
            }
        };
        let child = cmd
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Process {
            name: name.to_owned(),
            child,
            status: None,
        })
    }

    /// The description given at start.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The process id (of the program itself: nsenter execs it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the process has exited (reaps it), `None` while it runs.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.exit_status().is_none()
    }

    /// Sends `signal` if the process still runs (never to a reaped pid).
    pub fn signal(&mut self, signal: Signal) -> Result<()> {
        if !self.is_running() {
            return Ok(());
        }
        let pid = i32::try_from(self.pid()).context("pid out of range")?;
        nix::sys::signal::kill(Pid::from_raw(pid), signal)
            .with_context(|| format!("sending {signal} to {}", self.name))
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit_status() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then SIGKILL if the process has not exited within `grace`. Returns how it
    /// ended.
    pub fn terminate(&mut self, grace: Duration) -> Result<ExitStatus> {
        self.signal(Signal::SIGTERM)?;
        match self.wait_timeout(grace) {
            Some(status) => Ok(status),
            None => self.kill(),
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.exit_status() {
            return Ok(status);
        }
        let _ = self.child.kill();
        let status = self
            .child
            .wait()
            .with_context(|| format!("waiting for {}", self.name))?;
        self.status = Some(status);
        Ok(status)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// Waits until something in `ns` listens on TCP `port` (as `ss -ltn` shows it), for servers
/// started with [`Process::spawn`]. Fails early if `process` exits.
pub fn wait_tcp_listen(
    ns: &NetNs,
    port: u16,
    process: &mut Process,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let needle = format!(":{port} ");
    loop {
        let out = ns.output(&["ss", "-Hltn"])?;
        if String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.contains(&needle))
        {
            return Ok(());
        }
        if let Some(status) = process.exit_status() {
            bail!(
                "{} exited ({status}) before listening on {port}",
                process.name()
            );
        }
        if Instant::now() >= deadline {
            bail!(
                "{} does not listen on TCP {port} after {timeout:?}",
                process.name()
            );
        }
        thread::sleep(Duration::from_millis(50));
    }
}
