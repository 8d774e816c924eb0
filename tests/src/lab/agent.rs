//! Running `flannel-agent` in a simulated node: [`AgentSpec`] holds the cluster-wide flags,
//! [`Agent::start`] adds the node's own (subnet file, state dir, bpffs pin path, WireGuard key
//! file and socket directory, public IP)
//! and runs it with `nsenter --net=` (not `ip netns exec`, which hides /sys/fs/bpf), logging
//! to the node's `agent.log`. The [`Agent`] guard stops it on drop.

use std::{
    fmt,
    path::{Path, PathBuf},
    process::ExitStatus,
    str::FromStr,
    time::Duration,
};

use anyhow::{Result, bail};

use super::{
    lease::DEFAULT_PREFIX,
    process::{Output, Process, ns_command},
};
use crate::topology::{Node, SubnetEnv};

/// Health/metrics port every lab agent listens on (each node is its own namespace, so one
/// port fits all).
pub const DEFAULT_HEALTHZ_PORT: u16 = 9473;

/// `--dataplane` of the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dataplane {
    /// eBPF if it loads, else the kernel path.
    Auto,
    /// eBPF only (fail if it cannot load).
    Ebpf,
    /// Kernel routes/neighbours/FDB only.
    #[default]
    Kernel,
}

impl fmt::Display for Dataplane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dataplane::Auto => "auto",
            Dataplane::Ebpf => "ebpf",
            Dataplane::Kernel => "kernel",
        })
    }
}

impl FromStr for Dataplane {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Dataplane::Auto),
            "ebpf" => Ok(Dataplane::Ebpf),
            "kernel" => Ok(Dataplane::Kernel),
            other => Err(format!(
                "unknown dataplane {other:?} (expected auto, ebpf or kernel)"
            )),
        }
    }
}

/// How to run the agent on every node.
#[derive(Debug, Clone)]
pub struct AgentSpec {
    /// The `flannel-agent` binary.
    pub binary: PathBuf,
    /// `--etcd-endpoints` (must be reachable from the nodes: the topology's etcd).
    pub etcd_endpoints: String,
    /// `--etcd-prefix`
    pub etcd_prefix: String,
    /// `--iface` (default `eth0`, the node's underlay link); `None` leaves the agent to pick.
    pub iface: Option<String>,
    /// Pass `--public-ip <node's underlay address>`.
    pub public_ip: bool,
    /// `--ip-masq`
    pub ip_masq: bool,
    /// `--dataplane`; `None` omits the flag.
    pub dataplane: Option<Dataplane>,
    /// `--healthz-port`; `None` omits the flag.
    pub healthz_port: Option<u16>,
    /// Further flags, appended last.
    pub extra_args: Vec<String>,
    /// Environment for the agent (e.g. `RUST_LOG`); `RUST_LOG=info` unless set here or in
    /// the lab's own environment.
    pub env: Vec<(String, String)>,
    /// The only capabilities the agent gets (names as in a pod's `securityContext`, e.g.
    /// `NET_ADMIN`), as a container runtime grants them to a root process: it runs under
    /// `setpriv` with every other one dropped from its bounding set. `None`: all of root's.
    /// Defaults to [`CAPS_ENV`] when set.
    pub capabilities: Option<Vec<String>>,
}

impl AgentSpec {
    /// Defaults: upstream's prefix, `--iface eth0`, kernel dataplane, healthz on
    /// [`DEFAULT_HEALTHZ_PORT`], no masquerade.
    pub fn new(binary: impl Into<PathBuf>, etcd_endpoints: impl Into<String>) -> Self {
        AgentSpec {
            binary: binary.into(),
            etcd_endpoints: etcd_endpoints.into(),
            etcd_prefix: DEFAULT_PREFIX.to_owned(),
            iface: Some("eth0".to_owned()),
            public_ip: false,
            ip_masq: false,
            dataplane: Some(Dataplane::Kernel),
            healthz_port: Some(DEFAULT_HEALTHZ_PORT),
            extra_args: Vec::new(),
            env: Vec::new(),
            capabilities: capabilities_from_env(),
        }
    }

    /// The command-line flags for `node`.
    pub fn args_for(&self, node: &Node) -> Vec<String> {
        let mut args = vec![
            format!("--etcd-endpoints={}", self.etcd_endpoints),
            format!("--etcd-prefix={}", self.etcd_prefix),
        ];
        if let Some(iface) = &self.iface {
            args.push(format!("--iface={iface}"));
        }
        if self.public_ip {
            args.push(format!("--public-ip={}", node.addr()));
        }
        if self.ip_masq {
            args.push("--ip-masq".to_owned());
        }
        args.push(format!("--subnet-file={}", node.subnet_file().display()));
        args.push(format!("--state-dir={}", node.state_dir().display()));
        args.push(format!("--bpf-pin-path={}", node.bpf_pin_path().display()));
        // WireGuard: a key per node, and a UAPI socket directory per node (userspace devices
        // of several nodes on one host would otherwise share /var/run/wireguard).
        args.push(format!(
            "--wireguard-key-file={}",
            node.dir().join("wgkey").display()
        ));
        args.push(format!(
            "--wireguard-socket-dir={}",
            node.dir().join("wireguard").display()
        ));
        if let Some(dp) = self.dataplane {
            args.push(format!("--dataplane={dp}"));
        }
        if let Some(port) = self.healthz_port {
            args.push(format!("--healthz-port={port}"));
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }
}

/// A running agent on one node; killed on drop.
#[derive(Debug)]
pub struct Agent {
    node: String,
    ns_path: PathBuf,
    binary: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    capabilities: Option<Vec<String>>,
    log: PathBuf,
    healthz_port: Option<u16>,
    process: Process,
}

impl Agent {
    /// Starts the agent in `node` with `spec`; the log (stdout and stderr) goes to
    /// [`Node::agent_log`], truncated.
    pub fn start(node: &Node, spec: &AgentSpec) -> Result<Agent> {
        if !spec.binary.is_file() {
            bail!("agent binary {} does not exist", spec.binary.display());
        }
        let mut env = spec.env.clone();
        if !env.iter().any(|(k, _)| k == "RUST_LOG") && std::env::var_os("RUST_LOG").is_none() {
            env.push(("RUST_LOG".to_owned(), "info".to_owned()));
        }
        let args = spec.args_for(node);
        let log = node.agent_log();
        let process = spawn(
            &node.name(),
            &node.ns().path(),
            (&spec.binary, spec.capabilities.as_deref()),
            &args,
            &env,
            Output::File(log.clone()),
        )?;
        Ok(Agent {
            node: node.name(),
            ns_path: node.ns().path(),
            binary: spec.binary.clone(),
            args,
            env,
            capabilities: spec.capabilities.clone(),
            log,
            healthz_port: spec.healthz_port,
            process,
        })
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The flags it runs with.
    pub fn args(&self) -> &[String] {
        &self.args
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Where it logs.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// `--healthz-port`, if given.
    pub fn healthz_port(&self) -> Option<u16> {
        self.healthz_port
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Whether it still runs.
    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }

    /// Its exit status once it has exited.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.process.exit_status()
    }

    /// An error with the exit status and log tail if the agent has exited.
    pub fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self.process.exit_status() {
            bail!(
                "flannel-agent on {} exited ({status}); last lines of {}:\n{}",
                self.node,
                self.log.display(),
                self.log_tail(30)
            );
        }
        Ok(())
    }

    /// SIGTERM, SIGKILL after `grace`; returns how it ended.
    pub fn stop(&mut self, grace: Duration) -> Result<ExitStatus> {
        self.process.terminate(grace)
    }

    /// SIGKILL (a crash, as far as the dataplane can tell).
    pub fn kill(&mut self) -> Result<ExitStatus> {
        self.process.kill()
    }

    /// Stops it if running (SIGTERM, 10 s grace) and starts it again with the same flags;
    /// the log is appended to.
    pub fn restart(&mut self) -> Result<()> {
        self.process.terminate(Duration::from_secs(10))?;
        self.process = spawn(
            &self.node,
            &self.ns_path,
            (&self.binary, self.capabilities.as_deref()),
            &self.args,
            &self.env,
            Output::Append(self.log.clone()),
        )?;
        Ok(())
    }

    /// [`Agent::restart`] with its flags changed by `change` first (they stay changed).
    pub fn restart_with(&mut self, change: impl FnOnce(&mut Vec<String>)) -> Result<()> {
        change(&mut self.args);
        self.restart()
    }

    /// Peak resident set size (`VmHWM` of `/proc/<pid>/status`) in KiB, while it runs.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        proc_status_kib(self.pid(), "VmHWM")
    }

    /// Current resident set size (`VmRSS`) in KiB, while it runs.
    pub fn rss_kib(&self) -> Option<u64> {
        proc_status_kib(self.pid(), "VmRSS")
    }

    /// Waits for the node's subnet.env, failing early (with the log tail) if the agent exits.
    pub fn wait_subnet_env(&mut self, node: &Node, timeout: Duration) -> Result<SubnetEnv> {
        let result = node.wait_subnet_env(timeout, || self.check_running());
        match result {
            Ok(env) => Ok(env),
            Err(e) if self.is_running() => bail!(
                "{e:#}; the agent still runs, last lines of {}:\n{}",
                self.log.display(),
                self.log_tail(30)
            ),
            Err(e) => Err(e),
        }
    }
}

/// Starts `binary` in the namespace at `ns_path`, with only `capabilities` when given
/// ([`AgentSpec::capabilities`]).
fn spawn(
    node: &str,
    ns_path: &Path,
    (binary, capabilities): (&Path, Option<&[String]>),
    args: &[String],
    env: &[(String, String)],
    output: Output,
) -> Result<Process> {
    let mut cmd = match capabilities {
        None => ns_command(ns_path, binary),
        Some(caps) => {
            let mut cmd = ns_command(ns_path, "setpriv");
            cmd.arg(bounding_set(caps))
                .args(["--inh-caps=-all", "--"])
                .arg(binary);
            cmd
        }
    };
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Process::start(&format!("flannel-agent on {node}"), cmd, output)
}

/// An environment variable that runs every test agent with only the capabilities it lists
/// (comma-separated, e.g. `NET_ADMIN,NET_RAW,BPF,PERFMON`, what `deploy/kube-flannel.yml`
/// gives), to check a whole test suite against a container's capabilities.
pub const CAPS_ENV: &str = "FLANNEL_TEST_AGENT_CAPS";

/// The capabilities [`CAPS_ENV`] lists, if set.
pub fn capabilities_from_env() -> Option<Vec<String>> {
    let list = std::env::var(CAPS_ENV).ok()?;
    Some(
        list.split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_owned)
            .collect(),
    )
}

/// `setpriv`'s flag that leaves a root process only `caps` (`NET_ADMIN` → `+net_admin`): a
/// root process's permitted and effective sets are its bounding set.
fn bounding_set(caps: &[String]) -> String {
    let keep: Vec<String> = caps
        .iter()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    format!("--bounding-set=-all,{}", keep.join(","))
}

/// A `kB` field of `/proc/<pid>/status`.
pub fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_become_setpriv_bounding_set() {
        let caps = ["NET_ADMIN", "CAP_BPF"].map(String::from);
        assert_eq!(bounding_set(&caps), "--bounding-set=-all,+net_admin,+bpf");
    }

    #[test]
    fn dataplane_parses() {
        assert_eq!("ebpf".parse::<Dataplane>(), Ok(Dataplane::Ebpf));
        assert_eq!(Dataplane::Auto.to_string(), "auto");
        assert!("xdp".parse::<Dataplane>().is_err());
    }

    #[test]
    fn own_status_has_hwm() {
        // RSS first: the high-water mark read afterwards is at least that.
        let rss = proc_status_kib(std::process::id(), "VmRSS").expect("VmRSS");
        let hwm = proc_status_kib(std::process::id(), "VmHWM").expect("VmHWM");
        assert!(hwm >= rss && rss > 0, "{hwm} {rss}");
        assert_eq!(proc_status_kib(std::process::id(), "NoSuchField"), None);
    }
}
