//! Reading flanneld's `subnet.env` the way upstream's plugin does.
//!
//! Lines are `KEY=VALUE` (no quoting or comments; other keys are ignored):
//! `FLANNEL_NETWORK` / `FLANNEL_IPV6_NETWORK` are comma-separated CIDR lists, each masked and
//! de-duplicated; `FLANNEL_SUBNET` / `FLANNEL_IPV6_SUBNET` are masked (`10.1.17.1/24` →
//! `10.1.17.0/24`); `FLANNEL_MTU` is an unsigned integer; `FLANNEL_IPMASQ` is true only for
//! exactly `true`. Unlike flanneld's own reader, any invalid CIDR is an error here.

use std::{fs::File, io::Read, path::Path};

use ipnet::IpNet;

use crate::cni::{CniError, code, io_text};

/// The plugin-side view of `subnet.env`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubnetEnv {
    /// `FLANNEL_NETWORK`, masked, duplicates dropped.
    pub networks: Vec<IpNet>,
    /// `FLANNEL_SUBNET`, masked.
    pub subnet: Option<IpNet>,
    /// `FLANNEL_IPV6_NETWORK`, masked, duplicates dropped.
    pub ipv6_networks: Vec<IpNet>,
    /// `FLANNEL_IPV6_SUBNET`, masked.
    pub ipv6_subnet: Option<IpNet>,
    /// `FLANNEL_MTU`.
    pub mtu: u32,
    /// `FLANNEL_IPMASQ`: flanneld masquerades itself, so the delegate must not.
    pub ipmasq: bool,
}

/// Why `subnet.env` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SubnetEnvError {
    /// The file does not exist: flanneld has not written it (yet).
    #[error("open {path}: {}", io_text(.source))]
    NotFound {
        /// The file as configured.
        path: String,
        /// The open error.
        source: std::io::Error,
    },
    /// The file exists but cannot be opened or read.
    #[error("{op} {path}: {}", io_text(.source))]
    Io {
        /// `open` or `read`.
        op: &'static str,
        /// The file as configured.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A CIDR value does not parse.
    #[error("invalid CIDR address: {value} (in {key})")]
    InvalidCidr {
        /// The key it appeared under.
        key: &'static str,
        /// The offending element.
        value: String,
    },
    /// `FLANNEL_MTU` is not an unsigned 32-bit integer.
    #[error("invalid FLANNEL_MTU {value:?}: want an unsigned integer")]
    InvalidMtu {
        /// The value as written.
        value: String,
    },
    /// Required keys are absent; `list` names them in upstream's order.
    #[error("{path} is missing {list}")]
    Missing {
        /// The file as configured.
        path: String,
        /// e.g. `FLANNEL_MTU, FLANNEL_IPMASQ`.
        list: String,
    },
}

impl SubnetEnvError {
    /// The CNI error code for ADD.
    ///
    /// A missing file gets 11 ("try again later"): `subnet.env` is written by flanneld once it
    /// holds a lease, so on a booting node (or while the flannel pod restarts) pod sandboxes are
    /// created before it exists. That is transient, and 11 tells the runtime to retry instead
    /// of treating the config as broken (upstream reports the generic 999).
    /// A file that cannot be read is an I/O failure (5). A file with bad or missing values gets
    /// the plugin-specific 100: it is not our stdin config (7 would point at the wrong file) and
    /// it will not fix itself by waiting.
    pub fn code(&self) -> u32 {
        match self {
            SubnetEnvError::NotFound { .. } => code::TRY_AGAIN_LATER,
            SubnetEnvError::Io { .. } => code::IO_FAILURE,
            _ => code::INVALID_SUBNET_ENV,
        }
    }

    /// Upstream's wrapped message:
    /// `failed to load flannel 'subnet.env' file: <err>. Check the flannel pod log for this node.`
    pub fn into_cni(self) -> CniError {
        CniError::new(
            self.code(),
            format!(
                "failed to load flannel 'subnet.env' file: {self}. Check the flannel pod log for this node."
            ),
        )
    }
}

/// Reads and parses `path`.
pub fn load(path: &Path) -> Result<SubnetEnv, SubnetEnvError> {
    let shown = path.display().to_string();
    let mut file = File::open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            SubnetEnvError::NotFound {
                path: shown.clone(),
                source,
            }
        } else {
            SubnetEnvError::Io {
                op: "open",
                path: shown.clone(),
                source,
            }
        }
    })?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|source| SubnetEnvError::Io {
            op: "read",
            path: shown.clone(),
            source,
        })?;
    parse(&shown, &String::from_utf8_lossy(&bytes))
}

fn parse_cidr(key: &'static str, value: &str) -> Result<IpNet, SubnetEnvError> {
    value
        .parse::<IpNet>()
        .map(|net| net.trunc())
        .map_err(|_| SubnetEnvError::InvalidCidr {
            key,
            value: value.to_owned(),
        })
}

fn parse_list(key: &'static str, value: &str) -> Result<Vec<IpNet>, SubnetEnvError> {
    let mut nets: Vec<IpNet> = Vec::new();
    for item in value.split(',') {
        let net = parse_cidr(key, item)?;
        if !nets.contains(&net) {
            nets.push(net);
        }
    }
    Ok(nets)
}

/// Parses the content of the file named `path` (the name is only used in messages).
pub fn parse(path: &str, text: &str) -> Result<SubnetEnv, SubnetEnvError> {
    let mut networks = Vec::new();
    let mut ipv6_networks = Vec::new();
    let mut subnet = None;
    let mut ipv6_subnet = None;
    let mut mtu = None;
    let mut ipmasq = None;
    for line in text.lines() {
        let (key, value) = line.split_once('=').unwrap_or((line, ""));
        match key {
            "FLANNEL_NETWORK" => networks = parse_list("FLANNEL_NETWORK", value)?,
            "FLANNEL_IPV6_NETWORK" => {
                ipv6_networks = parse_list("FLANNEL_IPV6_NETWORK", value)?;
            }
            "FLANNEL_SUBNET" => subnet = Some(parse_cidr("FLANNEL_SUBNET", value)?),
            "FLANNEL_IPV6_SUBNET" => {
                ipv6_subnet = Some(parse_cidr("FLANNEL_IPV6_SUBNET", value)?);
            }
            "FLANNEL_MTU" => {
                let parsed = value
                    .bytes()
                    .all(|b| b.is_ascii_digit())
                    .then(|| value.parse::<u32>().ok())
                    .flatten()
                    .ok_or_else(|| SubnetEnvError::InvalidMtu {
                        value: value.to_owned(),
                    })?;
                mtu = Some(parsed);
            }
            "FLANNEL_IPMASQ" => ipmasq = Some(value == "true"),
            _ => {}
        }
    }

    let mut missing = Vec::new();
    if networks.is_empty() && ipv6_networks.is_empty() {
        missing.extend(["FLANNEL_NETWORK", "FLANNEL_IPV6_NETWORK"]);
    }
    if subnet.is_none() && ipv6_subnet.is_none() {
        missing.extend(["FLANNEL_SUBNET", "FLANNEL_IPV6_SUBNET"]);
    }
    if mtu.is_none() {
        missing.push("FLANNEL_MTU");
    }
    if ipmasq.is_none() {
        missing.push("FLANNEL_IPMASQ");
    }
    match (mtu, ipmasq) {
        (Some(mtu), Some(ipmasq)) if missing.is_empty() => Ok(SubnetEnv {
            networks,
            subnet,
            ipv6_networks,
            ipv6_subnet,
            mtu,
            ipmasq,
        }),
        _ => Err(SubnetEnvError::Missing {
            path: path.to_owned(),
            list: missing.join(", "),
        }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn ipv4_file_is_masked() {
        let env = parse(
            "s",
            "\nFLANNEL_NETWORK=10.1.0.0/16\nFLANNEL_SUBNET=10.1.17.1/24\nFLANNEL_MTU=1472\nFLANNEL_IPMASQ=true\n",
        )
        .unwrap();
        assert_eq!(
            env,
            SubnetEnv {
                networks: vec![net("10.1.0.0/16")],
                subnet: Some(net("10.1.17.0/24")),
                ipv6_networks: vec![],
                ipv6_subnet: None,
                mtu: 1472,
                ipmasq: true,
            }
        );
    }

    #[test]
    fn dual_stack_and_lists() {
        let env = parse(
            "s",
            "FLANNEL_NETWORK=10.1.0.0/16,192.168.0.0/16,10.1.5.0/16\r\n\
             FLANNEL_SUBNET=10.1.17.1/24\r\n\
             FLANNEL_IPV6_NETWORK=fc00::/48\r\n\
             FLANNEL_IPV6_SUBNET=fc00::1/64\r\n\
             FLANNEL_MTU=1450\r\n\
             FLANNEL_IPMASQ=false\r\n\
             OTHER=ignored\r\n",
        )
        .unwrap();
        // 10.1.5.0/16 masks to 10.1.0.0/16 and is dropped as a duplicate.
        assert_eq!(
            env.networks,
            vec![net("10.1.0.0/16"), net("192.168.0.0/16")]
        );
        assert_eq!(env.ipv6_networks, vec![net("fc00::/48")]);
        assert_eq!(env.ipv6_subnet, Some(net("fc00::/64")));
        assert_eq!(env.mtu, 1450);
        assert!(!env.ipmasq);
    }

    #[test]
    fn ipmasq_is_true_only_for_exactly_true() {
        let base = "FLANNEL_NETWORK=10.1.0.0/16\nFLANNEL_SUBNET=10.1.17.1/24\nFLANNEL_MTU=1472\n";
        for (value, want) in [("true", true), ("True", false), ("1", false), ("", false)] {
            let env = parse("s", &format!("{base}FLANNEL_IPMASQ={value}\n")).unwrap();
            assert_eq!(env.ipmasq, want, "{value:?}");
        }
    }

    #[test]
    fn missing_everything_lists_all_keys() {
        let err = parse("/tmp/foo.env", "foo=bar\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "/tmp/foo.env is missing FLANNEL_NETWORK, FLANNEL_IPV6_NETWORK, FLANNEL_SUBNET, FLANNEL_IPV6_SUBNET, FLANNEL_MTU, FLANNEL_IPMASQ"
        );
        assert_eq!(err.code(), 100);
    }

    #[test]
    fn missing_only_some_keys() {
        let err = parse("f", "FLANNEL_IPV6_NETWORK=fc00::/48\nFLANNEL_MTU=1\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "f is missing FLANNEL_SUBNET, FLANNEL_IPV6_SUBNET, FLANNEL_IPMASQ"
        );
    }

    #[test]
    fn invalid_values_fail() {
        let err = parse("f", "FLANNEL_NETWORK=10.1.0.0/16,not-a-cidr\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid CIDR address: not-a-cidr (in FLANNEL_NETWORK)"
        );
        assert_eq!(err.code(), 100);
        assert!(matches!(
            parse("f", "FLANNEL_SUBNET=10.1.17.1\n"),
            Err(SubnetEnvError::InvalidCidr {
                key: "FLANNEL_SUBNET",
                ..
            })
        ));
        assert!(matches!(
            parse("f", "FLANNEL_IPV6_SUBNET=fc00::1/129\n"),
            Err(SubnetEnvError::InvalidCidr { .. })
        ));
        assert!(matches!(
            parse("f", "FLANNEL_NETWORK=\n"),
            Err(SubnetEnvError::InvalidCidr { .. })
        ));
        for mtu in ["abc", "-1", "+5", "4294967296", ""] {
            assert!(
                matches!(
                    parse("f", &format!("FLANNEL_MTU={mtu}\n")),
                    Err(SubnetEnvError::InvalidMtu { .. })
                ),
                "{mtu:?}"
            );
        }
        // A key without '=' is an empty value (upstream would crash on it).
        assert!(matches!(
            parse("f", "FLANNEL_MTU\n"),
            Err(SubnetEnvError::InvalidMtu { .. })
        ));
    }

    #[test]
    fn missing_file_is_try_again_later_with_upstream_text() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("subnet.env");
        let err = load(&path).unwrap_err();
        assert_eq!(err.code(), 11);
        let cni = err.into_cni();
        assert_eq!(
            cni.msg,
            format!(
                "failed to load flannel 'subnet.env' file: open {}: no such file or directory. Check the flannel pod log for this node.",
                path.display()
            )
        );
    }

    #[test]
    fn unreadable_file_is_io_failure() {
        let dir = tempfile::tempdir().unwrap();
        // A directory opens but cannot be read.
        let err = load(dir.path()).unwrap_err();
        assert_eq!(err.code(), 5);
        assert!(err.to_string().starts_with("read "), "{err}");
    }

    #[test]
    fn load_reads_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("subnet.env");
        std::fs::write(
            &path,
            "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.5.1/24\nFLANNEL_MTU=1450\nFLANNEL_IPMASQ=true\n",
        )
        .unwrap();
        let env = load(&path).unwrap();
        assert_eq!(env.subnet, Some(net("10.244.5.0/24")));
    }
}
