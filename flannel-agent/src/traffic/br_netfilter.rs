//! The `br_netfilter` check upstream runs before setting up iptables rules.
//!
//! Upstream exits (`Failed to check br_netfilter: …`, status 1) when
//! `/proc/sys/net/bridge/bridge-nf-call-iptables` (or `…-ip6tables`) does not exist. Here the
//! check returns a warning for the caller to log, and the daemon carries on, because:
//!
//! * flannel's own rules do not need it. Masquerade (nat POSTROUTING) and the forward
//!   accepts act on *routed* traffic, which passes netfilter anyway. br_netfilter only makes
//!   *bridged* frames (pod to pod on the same `cni0`) visit iptables, which matters to
//!   kube-proxy's Service DNAT and hairpin, not to flannel.
//! * The module is often loaded after flannel starts (by kubeadm's preflight, kube-proxy,
//!   the container runtime or a systemd unit). The sysctl directory only appears once it is
//!   loaded, so exiting turns a temporary condition into a crash loop. Until flannel runs,
//!   no pod on the node gets a network (subnet.env is missing). That is worse than the
//!   degraded mode the warning describes.
//! * With the eBPF datapath, pod traffic may not traverse the bridge's netfilter hooks at
//!   all, and in nftables mode upstream skips the check too.
//!
//! The check also reports a sysctl that exists but is `0`, which upstream does not look at
//! but which breaks Services between pods on the same node in the same way.

use std::{
    fmt,
    path::{Path, PathBuf},
};

use super::rules::Family;

/// Where the bridge netfilter sysctls live.
pub const BR_NETFILTER_SYSCTL_DIR: &str = "/proc/sys/net/bridge";

/// Why bridged traffic may bypass iptables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrNetfilterWarning {
    /// The sysctl does not exist: the `br_netfilter` module is not loaded.
    Missing {
        /// The sysctl file that was looked for.
        path: PathBuf,
    },
    /// The sysctl exists but is not `1`.
    Disabled {
        /// The sysctl file.
        path: PathBuf,
        /// Its value.
        value: String,
    },
    /// The sysctl could not be read.
    Unreadable {
        /// The sysctl file.
        path: PathBuf,
        /// The error.
        error: String,
    },
}

impl fmt::Display for BrNetfilterWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BrNetfilterWarning::Missing { path } => write!(
                f,
                "Failed to check br_netfilter: {} does not exist (load the br_netfilter \
                 module); bridged pod-to-pod traffic bypasses iptables, so Services between \
                 pods on this node may not work",
                path.display()
            ),
            BrNetfilterWarning::Disabled { path, value } => write!(
                f,
                "br_netfilter: {} is {value:?}, not \"1\"; bridged pod-to-pod traffic \
                 bypasses iptables, so Services between pods on this node may not work",
                path.display()
            ),
            BrNetfilterWarning::Unreadable { path, error } => {
                write!(
                    f,
                    "Failed to check br_netfilter: {}: {error}",
                    path.display()
                )
            }
        }
    }
}

/// Checks `<sysctl_dir>/bridge-nf-call-iptables` (IPv4) or `…-ip6tables` (IPv6); pass
/// [`BR_NETFILTER_SYSCTL_DIR`] outside tests. `Ok(())` when present and `1`.
pub fn check_br_netfilter(sysctl_dir: &Path, family: Family) -> Result<(), BrNetfilterWarning> {
    let path = sysctl_dir.join(match family {
        Family::Ipv4 => "bridge-nf-call-iptables",
        Family::Ipv6 => "bridge-nf-call-ip6tables",
    });
    match std::fs::read_to_string(&path) {
        Ok(v) if v.trim() == "1" => Ok(()),
        Ok(v) => Err(BrNetfilterWarning::Disabled {
            path,
            value: v.trim().to_owned(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(BrNetfilterWarning::Missing { path })
        }
        Err(e) => Err(BrNetfilterWarning::Unreadable {
            path,
            error: e.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn present_missing_and_disabled() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = check_br_netfilter(dir.path(), Family::Ipv4).expect_err("missing");
        assert_eq!(
            missing,
            BrNetfilterWarning::Missing {
                path: dir.path().join("bridge-nf-call-iptables")
            }
        );
        assert!(
            missing
                .to_string()
                .starts_with("Failed to check br_netfilter: ")
        );
        std::fs::write(dir.path().join("bridge-nf-call-iptables"), "1\n").expect("write");
        assert_eq!(check_br_netfilter(dir.path(), Family::Ipv4), Ok(()));
        std::fs::write(dir.path().join("bridge-nf-call-ip6tables"), "0\n").expect("write");
        assert!(matches!(
            check_br_netfilter(dir.path(), Family::Ipv6),
            Err(BrNetfilterWarning::Disabled { value, .. }) if value == "0"
        ));
    }
}
