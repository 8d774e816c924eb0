//! The agent's command line: every upstream flanneld flag (§3.1) with its default, plus the
//! flags of this implementation.
//!
//! Upstream parses with Go's `flag` package and then fills every flag not given on the command
//! line from `FLANNELD_<FLAG>` (upper case, `-` and `.` → `_`); [`Cli::parse_from`] does the
//! same:
//! * `-flag` and `--flag` are equivalent (`-iface eth0`, `-ip-masq`);
//! * booleans take `--flag`, `--flag=true|false` (Go `strconv.ParseBool` spellings);
//! * a later occurrence of a single-valued flag overrides an earlier one; `--iface` and
//!   `--iface-regex` accumulate;
//! * environment variables fill flags absent from the command line; empty values are ignored,
//!   and a repeatable flag gets exactly one value from its variable;
//! * an empty value (`--public-ip=`) leaves a flag without default unset, as upstream.
//!
//! Deliberate differences: an unknown flag or an invalid value (also from the environment) is
//! an error (exit code 2) instead of upstream's usage text with exit code 0 or a logged error;
//! `--iface-regex` must compile.

use std::collections::HashMap;
use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgAction, CommandFactory, FromArgMatches, Parser, ValueEnum};

use crate::backend::Secret;
use crate::iface::IfaceOptions;
use crate::ip::IpStack;

/// Which data path forwards pod traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Dataplane {
    /// eBPF where the kernel supports it, otherwise the kernel path.
    #[default]
    Auto,
    /// eBPF only (fail if it cannot be loaded).
    Ebpf,
    /// Kernel devices, routes and neighbours only, as upstream.
    Kernel,
}

/// How the eBPF fast path's TC programs are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum TcAttachMode {
    /// TCX links where the kernel has them (Linux 6.6+), clsact filters otherwise.
    #[default]
    Auto,
    /// TCX links (fail on kernels without them).
    Tcx,
    /// Direct-action bpf filters under a clsact qdisc.
    Clsact,
}

const ENV_HELP: &str = "Every flag can also be set through the environment variable \
FLANNELD_<FLAG> (upper case, '-' replaced by '_', e.g. FLANNELD_IFACE, FLANNELD_IP_MASQ=true); \
the command line wins, empty values are ignored. --wireguard-key-file also reads \
WIREGUARD_KEY_FILE.";

/// The parsed command line.
#[derive(Debug, Clone, PartialEq, Eq, Parser)]
#[command(
    name = "flanneld",
    about = "flannel-compatible node agent with an eBPF fast path",
    disable_version_flag = true,
    args_override_self = true,
    after_help = ENV_HELP
)]
pub struct Cli {
    /// a comma-delimited list of etcd endpoints
    #[arg(long, default_value = "http://127.0.0.1:4001,http://127.0.0.1:2379")]
    pub etcd_endpoints: String,

    /// etcd prefix
    #[arg(long, default_value = "/coreos.com/network")]
    pub etcd_prefix: String,

    /// SSL key file used to secure etcd communication
    #[arg(long)]
    pub etcd_keyfile: Option<PathBuf>,

    /// SSL certification file used to secure etcd communication
    #[arg(long)]
    pub etcd_certfile: Option<PathBuf>,

    /// SSL Certificate Authority file used to secure etcd communication
    #[arg(long)]
    pub etcd_cafile: Option<PathBuf>,

    /// username for BasicAuth to etcd
    #[arg(long)]
    pub etcd_username: Option<String>,

    /// password for BasicAuth to etcd
    #[arg(long, value_parser = parse_secret)]
    pub etcd_password: Option<Secret<String>>,

    /// contact the Kubernetes API for subnet assignment instead of etcd.
    #[arg(long, num_args = 0..=1, require_equals = true, default_value = "false",
          default_missing_value = "true", value_parser = parse_go_bool, action = ArgAction::Set)]
    pub kube_subnet_mgr: bool,

    /// Kubernetes API server URL. Does not need to be specified if flannel is running in a pod.
    #[arg(long)]
    pub kube_api_url: Option<String>,

    /// kubeconfig file location. Does not need to be specified if flannel is running in a pod.
    #[arg(long)]
    pub kubeconfig_file: Option<PathBuf>,

    /// Kubernetes annotation prefix. Can contain single slash "/", otherwise it will be
    /// appended at the end.
    #[arg(long, default_value = "flannel.alpha.coreos.com")]
    pub kube_annotation_prefix: String,

    /// interface to use (IP or name) for inter-host communication. Can be specified multiple
    /// times to check each option in order. Returns the first match found.
    #[arg(long, action = ArgAction::Append)]
    pub iface: Vec<String>,

    /// regex expression to match the first interface to use (IP or name) for inter-host
    /// communication. Can be specified multiple times to check each regex in order. Returns
    /// the first match found. Regexes are checked after specific interfaces specified by the
    /// iface option have already been checked.
    #[arg(long, action = ArgAction::Append, value_parser = parse_regex)]
    pub iface_regex: Vec<String>,

    /// Detect the interface from the route to this IP (`ip route get`).
    #[arg(
        long,
        help = "detect interface to use (IP or name) for inter-host communication based on which \
                will be used for provided IP. This is exactly the interface to use of command \
                'ip route get <ip-address>'"
    )]
    pub iface_can_reach: Option<IpAddr>,

    /// filename where env variables (subnet, MTU, ... ) will be written to
    #[arg(long, default_value = "/run/flannel/subnet.env")]
    pub subnet_file: PathBuf,

    /// IP accessible by other nodes for inter-host communication
    #[arg(long)]
    pub public_ip: Option<Ipv4Addr>,

    /// IPv6 accessible by other nodes for inter-host communication
    #[arg(long)]
    pub public_ipv6: Option<Ipv6Addr>,

    /// subnet lease renewal margin, in minutes, ranging from 1 to 1439
    #[arg(long, default_value = "60", value_parser = parse_renew_margin)]
    pub subnet_lease_renew_margin: u32,

    /// setup IP masquerade rule for traffic destined outside of overlay network
    #[arg(long, num_args = 0..=1, require_equals = true, default_value = "false",
          default_missing_value = "true", value_parser = parse_go_bool, action = ArgAction::Set)]
    pub ip_masq: bool,

    /// disable fully-random mode for MASQUERADE
    #[arg(long, num_args = 0..=1, require_equals = true, default_value = "false",
          default_missing_value = "true", value_parser = parse_go_bool, action = ArgAction::Set)]
    pub ip_masq_fully_random_disable: bool,

    /// resync period for iptables rules, in seconds
    #[arg(long, default_value = "5", value_parser = parse_seconds)]
    pub iptables_resync: u64,

    /// add default accept rules to FORWARD chain in iptables
    #[arg(long, num_args = 0..=1, require_equals = true, default_value = "true",
          default_missing_value = "true", value_parser = parse_go_bool, action = ArgAction::Set)]
    pub iptables_forward_rules: bool,

    /// add blackhole route on the node for the local podCIDR
    #[arg(long, num_args = 0..=1, require_equals = true, default_value = "false",
          default_missing_value = "true", value_parser = parse_go_bool, action = ArgAction::Set)]
    pub ip_blackhole_route: bool,

    /// path to the network configuration file
    #[arg(long, default_value = "/etc/kube-flannel/net-conf.json")]
    pub net_config_path: PathBuf,

    /// set NodeNetworkUnavailable after ready
    #[arg(long, num_args = 0..=1, require_equals = true, default_value = "true",
          default_missing_value = "true", value_parser = parse_go_bool, action = ArgAction::Set)]
    pub set_node_network_unavailable: bool,

    /// the IP address for healthz server to listen
    #[arg(long, default_value = "0.0.0.0")]
    pub healthz_ip: String,

    /// the port for healthz server to listen(0 to disable)
    #[arg(long, default_value = "0")]
    pub healthz_port: u16,

    /// print version and exit
    #[arg(long, num_args = 0..=1, require_equals = true, default_value = "false",
          default_missing_value = "true", value_parser = parse_go_bool, action = ArgAction::Set)]
    pub version: bool,

    /// number for the log level verbosity
    #[arg(
        short = 'v',
        long = "v",
        default_value = "0",
        allow_negative_numbers = true
    )]
    pub v: i32,

    /// comma-separated list of pattern=N settings for file-filtered logging
    #[arg(long)]
    pub vmodule: Option<String>,

    /// when logging hits line file:N, emit a stack trace
    #[arg(long = "log_backtrace_at")]
    pub log_backtrace_at: Option<String>,

    /// data path for pod traffic: auto (eBPF when available), ebpf, kernel
    #[arg(long, value_enum, default_value_t = Dataplane::Auto)]
    pub dataplane: Dataplane,

    /// how the eBPF programs attach to TC: auto (TCX links on Linux 6.6+, clsact filters
    /// before), tcx, clsact
    #[arg(long, value_enum, default_value_t = TcAttachMode::Auto)]
    pub tc_attach: TcAttachMode,

    /// bpffs directory where the eBPF programs and maps are pinned
    #[arg(long, default_value = "/sys/fs/bpf/flannel")]
    pub bpf_pin_path: PathBuf,

    /// enter the fast path's open pod connections into conntrack, detach its programs and
    /// remove the pins under --bpf-pin-path, then exit (refused while an agent with this
    /// --state-dir runs, e.g. before upstream flanneld takes the node over)
    #[arg(long, num_args = 0..=1, require_equals = true, default_value = "false",
          default_missing_value = "true", value_parser = parse_go_bool, action = ArgAction::Set)]
    pub detach_fastpath: bool,

    /// directory for persistent agent state (VTEP MAC addresses, the node's agent.lock, ...)
    #[arg(long, default_value = "/var/lib/flannel")]
    pub state_dir: PathBuf,

    /// WireGuard private key file (created when missing)
    #[arg(long, default_value = "/run/flannel/wgkey")]
    pub wireguard_key_file: PathBuf,

    /// the pod bridge the CNI plugin creates (the eBPF fast path attaches to it when it appears)
    #[arg(long, default_value = "cni0")]
    pub pod_bridge: String,

    /// directory of the UAPI sockets of userspace WireGuard devices (kernels without
    /// WireGuard); another directory than /var/run/wireguard runs the userspace device in a
    /// private mount namespace (one directory per node when several share a host)
    #[arg(long, default_value = "/var/run/wireguard")]
    pub wireguard_socket_dir: PathBuf,

    /// seconds between full reconciliations of the data path
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    pub resync_interval: u64,

    /// with --ip-masq and the eBPF fast path active, masquerade in eBPF (TCP, UDP, ICMP echo
    /// leaving the external interface); false keeps iptables/nftables MASQUERADE for all
    #[arg(long, num_args = 0..=1, require_equals = true, default_value = "true",
          default_missing_value = "true", value_parser = parse_go_bool, action = ArgAction::Set)]
    pub ebpf_masq: bool,

    /// flows the eBPF NAT maps hold; 0 sizes them from node memory (0.25 %, at least 65536)
    #[arg(long, default_value = "0")]
    pub ebpf_nat_max_entries: u32,

    /// open NATed connections per family the eBPF held flow tables keep out of reach of LRU
    /// eviction (hostPort guards: a quarter); 0 sizes them to conntrack's maximum
    /// (nf_conntrack_max, within 65536-1048576)
    #[arg(long, default_value = "0",
          value_parser = clap::value_parser!(u32).range(0..=i64::from(crate::bpf::held::HELD_MAX_ENTRIES)))]
    pub ebpf_held_max_entries: u32,

    /// ports eBPF masquerade hands out, MIN-MAX (default: the node's
    /// net.ipv4.ip_local_port_range)
    #[arg(long, value_parser = crate::bpf::nat::parse_port_range)]
    pub ebpf_nat_port_range: Option<(u16, u16)>,

    /// seconds between sweeps of expired eBPF NAT entries (and, while masquerade is handed
    /// back to iptables/nftables, checks whether the last eBPF-translated flow has ended)
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    pub ebpf_nat_sweep_interval: u64,

    /// seconds between reads of conntrack's table that keep the open NATed pod connections
    /// on the kernel path (holding them, putting evicted entries back); a read comes sooner
    /// once the programs have learnt half a flow table since the last
    #[arg(long, default_value = "10", value_parser = parse_seconds)]
    pub ebpf_conntrack_resync: u64,

    /// seconds IPIP packets carrying an inner fragment keep going to the agent's IPIP socket
    /// after the last IPIP packet a router fragmented on its way here (eBPF IPIP without a
    /// kernel ipip device)
    #[arg(long, default_value = "600", value_parser = parse_seconds)]
    pub ebpf_ipip_reassembly_hold: u64,

    /// destinations (comma-separated CIDRs) pod traffic is never masqueraded to, with
    /// iptables, nftables or eBPF masquerade
    #[arg(long, value_delimiter = ',', action = ArgAction::Append)]
    pub ip_masq_exclude_cidrs: Vec<ipnet::IpNet>,
}

/// Upstream's message for an out-of-range `--subnet-lease-renew-margin`.
pub const RENEW_MARGIN_ERROR: &str =
    "Invalid subnet-lease-renew-margin option, out of acceptable range";

fn parse_renew_margin(s: &str) -> Result<u32, String> {
    let v: i64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not an integer"))?;
    if (1..24 * 60).contains(&v) {
        u32::try_from(v).map_err(|_| RENEW_MARGIN_ERROR.to_owned())
    } else {
        Err(RENEW_MARGIN_ERROR.to_owned())
    }
}

/// Go `strconv.ParseBool`.
fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("{s:?} is not a boolean (use true or false)")),
    }
}

/// The longest period a seconds flag takes: a year. (Longer ones mean "never" to nobody, and
/// a deadline that far would overflow the clock.)
pub const MAX_SECONDS: u64 = 365 * 24 * 3600;

fn parse_seconds(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(v) if (1..=MAX_SECONDS).contains(&v) => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of seconds from 1 to {MAX_SECONDS} (a year)"
        )),
    }
}

fn parse_regex(s: &str) -> Result<String, String> {
    regex::Regex::new(s)
        .map(|_| s.to_owned())
        .map_err(|e| format!("invalid regex: {e}"))
}

fn parse_secret(s: &str) -> Result<Secret<String>, String> {
    Ok(Secret::new(s.to_owned()))
}

/// The environment variable names consulted for flag `long`: `FLANNELD_<FLAG>`, plus
/// `WIREGUARD_KEY_FILE` for `--wireguard-key-file`.
pub fn env_names(long: &str) -> Vec<String> {
    let mut names = vec![format!(
        "FLANNELD_{}",
        long.to_uppercase().replace(['-', '.'], "_")
    )];
    if long == "wireguard-key-file" {
        names.push("WIREGUARD_KEY_FILE".to_owned());
    }
    names
}

/// How a flag consumes values, for the argument rewriting.
#[derive(Clone, Copy)]
struct FlagShape {
    /// Takes a value as the next argument when not given with `=`.
    separate_value: bool,
    /// Has no default, so an empty value means "unset".
    empty_is_unset: bool,
}

impl Cli {
    /// Parses `args` (including the program name) with `env` as the environment lookup.
    pub fn parse_from<I, T>(
        args: I,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString>,
    {
        let cmd = Self::command();
        let mut argv = normalize_args(&cmd, args.into_iter().map(Into::into).collect());
        let matches = cmd.clone().try_get_matches_from(&argv)?;
        // Upstream checks --version before reading the environment.
        if matches.get_one::<bool>("version").copied() != Some(true) {
            let mut from_env = Vec::new();
            for arg in cmd.get_arguments() {
                let (Some(long), id) = (arg.get_long(), arg.get_id().as_str()) else {
                    continue;
                };
                if long == "version" || matches.value_source(id) == Some(ValueSource::CommandLine) {
                    continue;
                }
                if let Some(value) = env_names(long)
                    .iter()
                    .find_map(|n| env(n).filter(|v| !v.is_empty()))
                {
                    from_env.push(OsString::from(format!("--{long}={value}")));
                }
            }
            let at = argv.len().min(1);
            argv.splice(at..at, from_env);
        }
        let matches = cmd.try_get_matches_from(&argv)?;
        Self::from_arg_matches(&matches)
    }

    /// Parses the process arguments and environment.
    pub fn from_process() -> Result<Self, clap::Error> {
        Self::parse_from(std::env::args_os(), |k| std::env::var(k).ok())
    }

    /// The agent version (printed by `--version`; upstream prints it to stderr).
    pub fn version_string() -> &'static str {
        env!("CARGO_PKG_VERSION")
    }

    /// `--etcd-endpoints` split on commas (empty elements dropped).
    pub fn etcd_endpoint_list(&self) -> Vec<String> {
        self.etcd_endpoints
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// `--subnet-lease-renew-margin` as a duration.
    pub fn renew_margin(&self) -> Duration {
        Duration::from_secs(u64::from(self.subnet_lease_renew_margin) * 60)
    }

    /// The interface selection options for the enabled families.
    pub fn iface_options(&self, stack: IpStack) -> IfaceOptions {
        IfaceOptions {
            ifaces: self.iface.clone(),
            iface_regex: self.iface_regex.clone(),
            iface_can_reach: self.iface_can_reach,
            public_ip: self.public_ip,
            public_ipv6: self.public_ipv6,
            stack,
        }
    }
}

/// Rewrites Go-style arguments for clap: `-flag[=v]` → `--flag[=v]` for known long flags, and
/// drops empty values of flags without a default (`--public-ip=`, `--iface ""`).
fn normalize_args(cmd: &clap::Command, args: Vec<OsString>) -> Vec<OsString> {
    let shapes: HashMap<String, FlagShape> = cmd
        .get_arguments()
        .filter_map(|a| {
            let long = a.get_long()?;
            let shape = FlagShape {
                separate_value: a.get_action().takes_values() && !a.is_require_equals_set(),
                empty_is_unset: a.get_default_values().is_empty(),
            };
            Some((long.to_owned(), shape))
        })
        .chain([(
            "help".to_owned(),
            FlagShape {
                separate_value: false,
                empty_is_unset: false,
            },
        )])
        .collect();
    let mut out = Vec::with_capacity(args.len());
    let mut iter = args.into_iter();
    out.extend(iter.next());
    while let Some(arg) = iter.next() {
        let Some(text) = arg.to_str() else {
            out.push(arg);
            continue;
        };
        if text == "--" {
            out.push(arg);
            out.extend(iter);
            break;
        }
        let long_form = match text.strip_prefix('-') {
            Some(rest) if !rest.starts_with('-') => {
                let name = rest.split('=').next().unwrap_or(rest);
                if name.len() > 1 && shapes.contains_key(name) {
                    format!("-{text}")
                } else {
                    text.to_owned()
                }
            }
            _ => text.to_owned(),
        };
        let Some(body) = long_form.strip_prefix("--") else {
            out.push(OsString::from(long_form));
            continue;
        };
        let (name, value) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (body, None),
        };
        let Some(shape) = shapes.get(name).copied() else {
            out.push(OsString::from(long_form));
            continue;
        };
        match value {
            Some("") if shape.empty_is_unset => {}
            Some(_) => out.push(OsString::from(long_form)),
            None if shape.separate_value => match iter.next() {
                Some(v) if v.is_empty() && shape.empty_is_unset => {}
                Some(v) => {
                    // Joined with `=` so that values starting with '-' stay values, as in Go.
                    let mut joined = OsString::from(format!("{long_form}="));
                    joined.push(v);
                    out.push(joined);
                }
                None => out.push(OsString::from(long_form)),
            },
            None => out.push(OsString::from(long_form)),
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn parse_env(args: &[&str], env: &[(&str, &str)]) -> Result<Cli, clap::Error> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut argv = vec!["flanneld"];
        argv.extend_from_slice(args);
        Cli::parse_from(argv, |k| env.get(k).cloned())
    }

    fn parse(args: &[&str]) -> Cli {
        parse_env(args, &[]).unwrap()
    }

    fn err(args: &[&str]) -> String {
        parse_env(args, &[]).unwrap_err().to_string()
    }

    #[test]
    fn detach_fastpath_is_a_boolean_flag() {
        assert!(parse(&["--detach-fastpath"]).detach_fastpath);
        assert!(parse(&["--detach-fastpath=true"]).detach_fastpath);
        assert!(!parse(&["--detach-fastpath=false"]).detach_fastpath);
        assert!(err(&["--detach-fastpath=maybe"]).contains("maybe"));
    }

    #[test]
    fn periods_are_one_second_to_a_year() {
        for flag in [
            "--iptables-resync",
            "--resync-interval",
            "--ebpf-nat-sweep-interval",
            "--ebpf-conntrack-resync",
            "--ebpf-ipip-reassembly-hold",
        ] {
            for bad in ["0", "-1", "31536001", "18446744073709551615", "x"] {
                let e = err(&[&format!("{flag}={bad}")]);
                assert!(e.contains("from 1 to 31536000"), "{flag}={bad}: {e}");
            }
            parse(&[&format!("{flag}=31536000")]);
            parse(&[&format!("{flag}=1")]);
        }
    }

    #[test]
    fn masquerade_flags() {
        let c = parse(&[
            "--ebpf-masq=false",
            "--ebpf-nat-max-entries",
            "100000",
            "--ebpf-held-max-entries=200000",
            "--ebpf-nat-port-range=20000-29999",
            "--ebpf-nat-sweep-interval=2",
            "--ebpf-conntrack-resync=3",
            "--ebpf-ipip-reassembly-hold=5",
            "--ip-masq-exclude-cidrs=100.64.0.0/10,192.0.2.0/24",
            "--ip-masq-exclude-cidrs",
            "fd00:64::/64",
        ]);
        assert!(!c.ebpf_masq);
        assert_eq!(c.ebpf_nat_max_entries, 100_000);
        assert_eq!(c.ebpf_held_max_entries, 200_000);
        assert_eq!(c.ebpf_nat_port_range, Some((20000, 29999)));
        assert_eq!(c.ebpf_nat_sweep_interval, 2);
        assert_eq!(c.ebpf_conntrack_resync, 3);
        assert_eq!(c.ebpf_ipip_reassembly_hold, 5);
        let nets: Vec<String> = c
            .ip_masq_exclude_cidrs
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(nets, ["100.64.0.0/10", "192.0.2.0/24", "fd00:64::/64"]);
        let c = parse_env(
            &[],
            &[(
                "FLANNELD_IP_MASQ_EXCLUDE_CIDRS",
                "10.10.0.0/16,10.11.0.0/16",
            )],
        )
        .unwrap();
        assert_eq!(c.ip_masq_exclude_cidrs.len(), 2);
        assert!(err(&["--ebpf-nat-port-range=9-1"]).contains("MIN <= MAX"));
        assert!(err(&["--ebpf-held-max-entries=16777217"]).contains("16777216"));
        assert!(err(&["--ip-masq-exclude-cidrs=10.0.0.0/33"]).contains("10.0.0.0/33"));
    }

    #[test]
    fn defaults_match_upstream() {
        let c = parse(&[]);
        assert_eq!(
            c.etcd_endpoints,
            "http://127.0.0.1:4001,http://127.0.0.1:2379"
        );
        assert_eq!(
            c.etcd_endpoint_list(),
            ["http://127.0.0.1:4001", "http://127.0.0.1:2379"]
        );
        assert_eq!(c.etcd_prefix, "/coreos.com/network");
        assert_eq!(
            (
                c.etcd_keyfile.clone(),
                c.etcd_certfile.clone(),
                c.etcd_cafile.clone()
            ),
            (None, None, None)
        );
        assert_eq!(
            (c.etcd_username.clone(), c.etcd_password.clone()),
            (None, None)
        );
        assert!(!c.kube_subnet_mgr);
        assert_eq!(
            (c.kube_api_url.clone(), c.kubeconfig_file.clone()),
            (None, None)
        );
        assert_eq!(c.kube_annotation_prefix, "flannel.alpha.coreos.com");
        assert!(c.iface.is_empty() && c.iface_regex.is_empty());
        assert_eq!(c.iface_can_reach, None);
        assert_eq!(c.subnet_file, PathBuf::from("/run/flannel/subnet.env"));
        assert_eq!((c.public_ip, c.public_ipv6), (None, None));
        assert_eq!(c.subnet_lease_renew_margin, 60);
        assert_eq!(c.renew_margin(), Duration::from_secs(3600));
        assert!(!c.ip_masq && !c.ip_masq_fully_random_disable && !c.ip_blackhole_route);
        assert_eq!(c.iptables_resync, 5);
        assert!(c.iptables_forward_rules && c.set_node_network_unavailable);
        assert_eq!(
            c.net_config_path,
            PathBuf::from("/etc/kube-flannel/net-conf.json")
        );
        assert_eq!((c.healthz_ip.as_str(), c.healthz_port), ("0.0.0.0", 0));
        assert!(!c.version && !c.detach_fastpath);
        assert_eq!(c.v, 0);
        assert_eq!(c.dataplane, Dataplane::Auto);
        assert!(c.ebpf_masq);
        assert_eq!(c.ebpf_nat_max_entries, 0);
        assert_eq!(c.ebpf_held_max_entries, 0);
        assert_eq!(c.ebpf_nat_port_range, None);
        assert_eq!(c.ebpf_nat_sweep_interval, 30);
        assert_eq!(c.ebpf_conntrack_resync, 10);
        assert_eq!(c.ebpf_ipip_reassembly_hold, 600);
        assert!(c.ip_masq_exclude_cidrs.is_empty());
        assert_eq!(c.bpf_pin_path, PathBuf::from("/sys/fs/bpf/flannel"));
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/flannel"));
        assert_eq!(c.wireguard_key_file, PathBuf::from("/run/flannel/wgkey"));
        assert_eq!(c.wireguard_socket_dir, PathBuf::from("/var/run/wireguard"));
        assert_eq!(c.resync_interval, 30);
    }

    #[test]
    fn go_style_single_dash_flags() {
        let c = parse(&[
            "-iface",
            "eth0",
            "-ip-masq",
            "-kube-subnet-mgr=true",
            "-subnet-file=/x.env",
            "-v=2",
            "-iptables-forward-rules=false",
        ]);
        assert_eq!(c.iface, ["eth0"]);
        assert!(c.ip_masq && c.kube_subnet_mgr);
        assert_eq!(c.subnet_file, PathBuf::from("/x.env"));
        assert_eq!(c.v, 2);
        assert!(!c.iptables_forward_rules);
        assert_eq!(parse(&["-v", "3"]).v, 3);
        assert_eq!(parse(&["--v=4"]).v, 4);
        assert_eq!(
            parse(&["-log_backtrace_at=main.go:1"])
                .log_backtrace_at
                .as_deref(),
            Some("main.go:1")
        );
        // A value that looks like a flag name is left alone.
        assert_eq!(
            parse(&["--kube-annotation-prefix", "-iface"]).kube_annotation_prefix,
            "-iface"
        );
    }

    #[test]
    fn boolean_forms() {
        for (args, want) in [
            (vec!["--ip-masq"], true),
            (vec!["--ip-masq=true"], true),
            (vec!["--ip-masq=false"], false),
            (vec!["--ip-masq=1"], true),
            (vec!["--ip-masq=F"], false),
            (vec!["--ip-masq", "--ip-masq=false"], false),
        ] {
            assert_eq!(parse(&args).ip_masq, want, "{args:?}");
        }
        assert!(!parse(&["--set-node-network-unavailable=false"]).set_node_network_unavailable);
        assert!(err(&["--ip-masq=maybe"]).contains("is not a boolean"));
        // Go does not take a separate value for booleans.
        assert!(parse_env(&["--ip-masq", "false"], &[]).is_err());
    }

    #[test]
    fn repeatable_flags() {
        let c = parse(&[
            "--iface=eth0",
            "-iface",
            "10.0.0.1",
            "--iface-regex",
            "^en",
            "--iface-regex=eth[0-9]+",
        ]);
        assert_eq!(c.iface, ["eth0", "10.0.0.1"]);
        assert_eq!(c.iface_regex, ["^en", "eth[0-9]+"]);
        let o = c.iface_options(IpStack::V4);
        assert_eq!(o.ifaces, c.iface);
        assert_eq!(o.stack, IpStack::V4);
        // Single-valued flags: the last one wins.
        assert_eq!(
            parse(&["--etcd-prefix=/a", "--etcd-prefix=/b"]).etcd_prefix,
            "/b"
        );
    }

    #[test]
    fn env_fallback_and_precedence() {
        let env = [
            ("FLANNELD_IFACE", "eth1,eth2"),
            ("FLANNELD_IP_MASQ", "true"),
            ("FLANNELD_ETCD_PREFIX", "/from/env"),
            ("FLANNELD_PUBLIC_IP", ""),
            ("FLANNELD_SUBNET_LEASE_RENEW_MARGIN", "30"),
            ("FLANNELD_V", "5"),
            ("FLANNELD_LOG_BACKTRACE_AT", "x.go:3"),
            ("FLANNELD_ETCD_PASSWORD", "hunter2"),
            ("WIREGUARD_KEY_FILE", "/etc/wg.key"),
        ];
        let c = parse_env(&[], &env).unwrap();
        assert_eq!(c.iface, ["eth1,eth2"]); // exactly one value, no splitting
        assert!(c.ip_masq);
        assert_eq!(c.etcd_prefix, "/from/env");
        assert_eq!(c.public_ip, None); // empty ignored
        assert_eq!(c.subnet_lease_renew_margin, 30);
        assert_eq!(c.v, 5);
        assert_eq!(c.log_backtrace_at.as_deref(), Some("x.go:3"));
        assert_eq!(
            c.etcd_password.as_ref().map(|p| p.expose().as_str()),
            Some("hunter2")
        );
        assert!(!format!("{c:?}").contains("hunter2"));
        assert_eq!(c.wireguard_key_file, PathBuf::from("/etc/wg.key"));
        // The command line wins.
        let c = parse_env(
            &["--iface=eth9", "--ip-masq=false", "--etcd-prefix", "/cli"],
            &env,
        )
        .unwrap();
        assert_eq!(c.iface, ["eth9"]);
        assert!(!c.ip_masq);
        assert_eq!(c.etcd_prefix, "/cli");
        // FLANNELD_ wins over WIREGUARD_KEY_FILE.
        let c = parse_env(
            &[],
            &[
                ("FLANNELD_WIREGUARD_KEY_FILE", "/a"),
                ("WIREGUARD_KEY_FILE", "/b"),
            ],
        )
        .unwrap();
        assert_eq!(c.wireguard_key_file, PathBuf::from("/a"));
        // Invalid environment values are errors.
        let e = parse_env(&[], &[("FLANNELD_HEALTHZ_PORT", "http")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--healthz-port"), "{e}");
        // --version is checked before the environment.
        let c = parse_env(&["--version"], &[("FLANNELD_HEALTHZ_PORT", "http")]).unwrap();
        assert!(c.version);
        assert_eq!(c.healthz_port, 0);
        // Env values can start with '-' and reach the flag intact.
        let c = parse_env(&[], &[("FLANNELD_KUBE_ANNOTATION_PREFIX", "-x")]).unwrap();
        assert_eq!(c.kube_annotation_prefix, "-x");
    }

    #[test]
    fn empty_values_unset_flags_without_default() {
        let c = parse(&[
            "--public-ip=",
            "--etcd-keyfile",
            "",
            "--iface=",
            "-kubeconfig-file=",
        ]);
        assert_eq!(c.public_ip, None);
        assert_eq!(c.etcd_keyfile, None);
        assert!(c.iface.is_empty());
        assert_eq!(c.kubeconfig_file, None);
    }

    #[test]
    fn typed_values() {
        let c = parse(&[
            "--public-ip=192.0.2.1",
            "--public-ipv6=2001:db8::1",
            "--iface-can-reach=10.0.0.1",
            "--healthz-port=8080",
            "--dataplane=kernel",
            "--resync-interval=10",
            "--iptables-resync=1",
            "--etcd-endpoints=http://a:2379, http://b:2379,",
        ]);
        assert_eq!(c.public_ip, Some(Ipv4Addr::new(192, 0, 2, 1)));
        assert_eq!(c.public_ipv6, Some("2001:db8::1".parse().unwrap()));
        assert_eq!(c.iface_can_reach, Some("10.0.0.1".parse().unwrap()));
        assert_eq!(c.healthz_port, 8080);
        assert_eq!(c.dataplane, Dataplane::Kernel);
        assert_eq!((c.resync_interval, c.iptables_resync), (10, 1));
        assert_eq!(c.etcd_endpoint_list(), ["http://a:2379", "http://b:2379"]);
        assert_eq!(parse(&["--dataplane", "ebpf"]).dataplane, Dataplane::Ebpf);
        assert_eq!(c.tc_attach, TcAttachMode::Auto);
        assert_eq!(
            parse(&["--tc-attach=clsact"]).tc_attach,
            TcAttachMode::Clsact
        );
        assert_eq!(parse(&["--tc-attach", "tcx"]).tc_attach, TcAttachMode::Tcx);
        assert!(err(&["--tc-attach=netlink"]).contains("netlink"));
    }

    #[test]
    fn invalid_values_give_clear_errors() {
        for margin in ["0", "1440", "-5"] {
            let e = err(&[&format!("--subnet-lease-renew-margin={margin}")]);
            assert!(e.contains(RENEW_MARGIN_ERROR), "{e}");
        }
        assert!(err(&["-subnet-lease-renew-margin", "-5"]).contains(RENEW_MARGIN_ERROR));
        assert_eq!(
            parse(&["--subnet-lease-renew-margin=1439"]).subnet_lease_renew_margin,
            1439
        );
        assert_eq!(
            parse(&["--subnet-lease-renew-margin=1"]).subnet_lease_renew_margin,
            1
        );
        let e = err(&["--public-ip=fd00::1"]);
        assert!(e.contains("--public-ip") && e.contains("fd00::1"), "{e}");
        let e = err(&["--iface-regex=("]);
        assert!(e.contains("invalid regex"), "{e}");
        let e = err(&["--dataplane=fast"]);
        assert!(e.contains("fast"), "{e}");
        assert!(err(&["--no-such-flag"]).contains("--no-such-flag"));
        assert!(err(&["--iptables-resync=0"]).contains("is not a number of seconds from 1"));
        assert!(err(&["--healthz-port=70000"]).contains("--healthz-port"));
    }

    #[test]
    fn help_and_env_names() {
        let e = parse_env(&["-help"], &[]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp);
        let help = e.to_string();
        assert!(help.contains("--iface-can-reach") && help.contains("FLANNELD_<FLAG>"));
        assert!(help.contains("<ip-address>'"), "{help}");
        assert!(help.contains("subnet lease renewal margin, in minutes, ranging from 1 to 1439"));
        assert_eq!(env_names("ip-masq"), ["FLANNELD_IP_MASQ"]);
        assert_eq!(env_names("log_backtrace_at"), ["FLANNELD_LOG_BACKTRACE_AT"]);
        assert_eq!(
            env_names("wireguard-key-file"),
            ["FLANNELD_WIREGUARD_KEY_FILE", "WIREGUARD_KEY_FILE"]
        );
        assert!(!Cli::version_string().is_empty());
    }

    #[test]
    fn never_panics_on_random_arguments() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let pieces = [
            "-iface",
            "--ip-masq",
            "=",
            "true",
            "-",
            "--",
            "-v",
            "eth0",
            "",
            "--public-ip",
            "1.2.3.4",
            "--subnet-lease-renew-margin",
            "-5",
            "x",
            "--iface-regex",
            "(",
            "-help",
        ];
        let mut rng = StdRng::seed_from_u64(0xc11);
        for _ in 0..1500 {
            let n = rng.random_range(0..6);
            let args: Vec<String> = (0..n)
                .map(|_| {
                    let a = pieces[rng.random_range(0..pieces.len())];
                    if rng.random_bool(0.3) {
                        format!("{a}{}", pieces[rng.random_range(0..pieces.len())])
                    } else {
                        a.to_owned()
                    }
                })
                .collect();
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let _ = parse_env(&refs, &[("FLANNELD_IFACE", "-x")]);
        }
    }
}
