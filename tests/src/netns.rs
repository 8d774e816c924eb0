//! Network namespaces for tests, named `<run prefix><suffix>` and deleted on drop.
//!
//! The run prefix is `fl` + the process id in base 36 + `x`, e.g. `flk3x`. A namespace whose
//! prefix names a process that no longer exists is a leftover of a crashed run and
//! [`sweep_stale`] deletes it; namespaces without this pattern are never touched.
//!
//! Namespaces are entered with `nsenter --net=` (not `ip netns exec`, which remounts /sys and
//! hides bpffs) or, for code in this process, with `setns` on a dedicated thread.

use std::{
    fs::File,
    os::fd::AsFd,
    path::PathBuf,
    process::{Command, Output, Stdio},
    sync::OnceLock,
    thread,
};

use anyhow::{Context as _, Result, bail};

fn base36(mut n: u32) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

/// `fl<pid base36>x`: unique per process, short enough for 15-character link names.
pub fn run_prefix() -> &'static str {
    static PREFIX: OnceLock<String> = OnceLock::new();
    PREFIX.get_or_init(|| format!("fl{}x", base36(std::process::id())))
}

/// The process ids a `fl<pid base36>x…` name may encode. Base-36 digits include `x`
/// itself, so `flhlxxt1n1` is `hlx` (the real pid) or `hl`: every `x` is a candidate end.
fn prefix_pids(name: &str) -> Vec<u32> {
    let Some(rest) = name.strip_prefix("fl") else {
        return Vec::new();
    };
    let digits_end = rest
        .bytes()
        .position(|b| !(b.is_ascii_digit() || b.is_ascii_lowercase()))
        .unwrap_or(rest.len());
    rest.char_indices()
        .filter(|&(i, c)| c == 'x' && i > 0 && i <= digits_end)
        .filter_map(|(i, _)| u32::from_str_radix(&rest[..i], 36).ok())
        .collect()
}

/// Names of all network namespaces in /run/netns.
pub fn list() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Deletes namespaces left behind by runs of this kit whose process is gone: only when no
/// pid the name may encode (`prefix_pids`) is this process or a live one.
pub fn sweep_stale() {
    for name in list() {
        let pids = prefix_pids(&name);
        if !pids.is_empty()
            && pids.iter().all(|&pid| {
                pid != std::process::id() && !PathBuf::from(format!("/proc/{pid}")).exists()
            })
        {
            kill_pids_in(&name);
            let _ = Command::new("ip").args(["netns", "del", &name]).status();
        }
    }
}

fn kill_pids_in(name: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", name]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            if let Ok(pid) = pid.parse::<i32>() {
                // SAFETY: plain kill(2) on a pid that lives in our own namespace.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }
}

/// A network namespace that is deleted (with every process still in it) when dropped.
#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Creates `<run prefix><suffix>` with `lo` up.
    pub fn new(suffix: &str) -> Result<Self> {
        static SWEPT: OnceLock<()> = OnceLock::new();
        SWEPT.get_or_init(sweep_stale);
        let name = format!("{}{suffix}", run_prefix());
        if list().contains(&name) {
            // Same process, same suffix: a previous test's guard did not run (it leaked).
            kill_pids_in(&name);
            let _ = Command::new("ip").args(["netns", "del", &name]).status();
        }
        run_checked(Command::new("ip").args(["netns", "add", &name]))?;
        let ns = NetNs { name };
        ns.run(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>`, usable with `nsenter --net=` and `setns`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// A command that runs `program` inside this namespace (network namespace only, so
    /// /sys/fs/bpf stays visible).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.path().display()))
            .arg("--")
            .arg(program);
        cmd
    }

    /// Runs `argv` inside the namespace; fails with the command's stderr when it fails.
    pub fn run(&self, argv: &[&str]) -> Result<String> {
        let (program, args) = argv.split_first().context("empty command")?;
        run_checked(self.command(program).args(args))
    }

    /// A counter of link `dev`'s statistics (`ip -s -j link show`, `stats64`): `dir` is `rx` or
    /// `tx`, `field` e.g. `bytes`, `packets` or `dropped`.
    pub fn link_counter(&self, dev: &str, dir: &str, field: &str) -> Result<u64> {
        let out = self.run(&["ip", "-s", "-j", "link", "show", dev])?;
        let v: serde_json::Value = serde_json::from_str(&out)
            .with_context(|| format!("ip -s -j link show {dev} in {}: {out}", self.name))?;
        v[0]["stats64"][dir][field]
            .as_u64()
            .with_context(|| format!("{dev} in {} has no {dir} {field}: {out}", self.name))
    }

    /// Runs `argv` inside the namespace and returns its output whatever the exit status.
    pub fn output(&self, argv: &[&str]) -> Result<Output> {
        let (program, args) = argv.split_first().context("empty command")?;
        self.command(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {argv:?} in {}", self.name))
    }

    /// Runs `f` on a new thread that has entered this namespace (only that thread moves), and
    /// returns its result. Use it for netlink or BPF code under test: build a current-thread
    /// tokio runtime inside `f` so sockets are opened in the namespace.
    pub fn enter<F, R>(&self, f: F) -> Result<R>
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        let file = File::open(self.path()).with_context(|| format!("open {}", self.name))?;
        thread::scope(|scope| {
            scope
                .spawn(move || -> Result<R> {
                    nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                        .context("setns")?;
                    Ok(f())
                })
                .join()
                .map_err(|_| anyhow::anyhow!("thread in netns panicked"))?
        })
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        kill_pids_in(&self.name);
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stderr(Stdio::null())
            .status();
    }
}

/// Runs a command and returns its stdout; a non-zero exit becomes an error with stderr.
pub fn run_checked(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("spawning {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Creates a veth pair `a_name` (in `a`) <-> `b_name` (in `b`), both up.
pub fn veth(a: &NetNs, a_name: &str, b: &NetNs, b_name: &str) -> Result<()> {
    a.run(&[
        "ip",
        "link",
        "add",
        a_name,
        "type",
        "veth",
        "peer",
        "name",
        b_name,
        "netns",
        b.name(),
    ])?;
    a.run(&["ip", "link", "set", a_name, "up"])?;
    b.run(&["ip", "link", "set", b_name, "up"])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_round_trips_the_pid() {
        let p = run_prefix();
        assert!(prefix_pids(&format!("{p}node1")).contains(&std::process::id()));
        assert!(prefix_pids("cni-1234").is_empty());
        assert!(prefix_pids("flx").is_empty());
        assert!(prefix_pids("fl_Ax").is_empty());
        // A pid whose base-36 digits contain `x`: both readings, the real one included.
        let hlx = u32::from_str_radix("hlx", 36).expect("base 36");
        assert_eq!(
            prefix_pids("flhlxxt1n1"),
            vec![u32::from_str_radix("hl", 36).expect("base 36"), hlx]
        );
        assert_eq!(
            prefix_pids(&format!("fl{}xt1hub", base36(hlx))),
            vec![u32::from_str_radix("hl", 36).expect("base 36"), hlx]
        );
    }

    #[test]
    fn namespace_is_created_and_removed() {
        crate::require_root!();
        let name = {
            let ns = NetNs::new("kit").expect("create netns");
            let links = ns.run(&["ip", "-o", "link", "show"]).expect("ip link");
            assert!(links.contains("lo"), "{links}");
            let inode_inside = ns
                .enter(|| std::fs::read_link("/proc/thread-self/ns/net").expect("readlink"))
                .expect("enter");
            let inode_here = std::fs::read_link("/proc/self/ns/net").expect("readlink");
            assert_ne!(inode_inside, inode_here);
            ns.name().to_owned()
        };
        assert!(!list().contains(&name), "{name} still exists after drop");
    }
}
