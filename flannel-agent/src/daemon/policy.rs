//! Detects netfilter-based NetworkPolicy engines on the node.
//!
//! The eBPF fast path redirects pod-to-pod packets past netfilter (both directions of a flow
//! must take the same path, see `crate::bpf`), so policy rules in the FORWARD chain or in an
//! nftables forward hook would no longer see that traffic. With `--dataplane=auto` the agent
//! therefore keeps the kernel path when such an engine is active; `--dataplane=ebpf` is the
//! operator's explicit choice and only gets a warning.

use std::process::{Command, Stdio};

/// Markers of known engines: (what to look for, the engine's name).
const IPTABLES_MARKERS: &[(&str, &str)] = &[
    (":cali-", "Calico/Canal"),
    (":KUBE-NWPLCY-", "kube-router"),
    (":KUBE-POD-FW-", "kube-router"),
    (":KUBE-ROUTER-FORWARD", "kube-router"),
    (":ANTREA-", "Antrea"),
];
const NFT_MARKERS: &[(&str, &str)] = &[
    ("table inet kube-network-policies", "kube-network-policies"),
    ("table ip calico", "Calico/Canal"),
    ("table inet kube-router", "kube-router"),
];

/// The engine whose rules are present, if any, given the outputs of `iptables-save -t filter`
/// (both variants) and `nft list tables`.
pub fn detect_in(iptables_save: &str, nft_tables: &str) -> Option<&'static str> {
    IPTABLES_MARKERS
        .iter()
        .find(|(m, _)| iptables_save.lines().any(|l| l.starts_with(m)))
        .or_else(|| {
            NFT_MARKERS
                .iter()
                .find(|(m, _)| nft_tables.lines().any(|l| l.trim() == *m))
        })
        .map(|(_, engine)| *engine)
}

fn output(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Reads the node's rules (missing tools count as "nothing there").
pub fn detect() -> Option<&'static str> {
    let mut save = output("iptables-nft-save", &["-t", "filter"]);
    save.push_str(&output("iptables-legacy-save", &["-t", "filter"]));
    if save.is_empty() {
        save = output("iptables-save", &["-t", "filter"]);
    }
    detect_in(&save, &output("nft", &["list", "tables"]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_engines_and_ignores_plain_kube_proxy() {
        let kube_proxy =
            "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FORWARD - [0:0]\n:FLANNEL-FWD - [0:0]\nCOMMIT\n";
        assert_eq!(detect_in(kube_proxy, "table ip flannel-ipv4\n"), None);
        let canal = "*filter\n:cali-FORWARD - [0:0]\n-A FORWARD -j cali-FORWARD\nCOMMIT\n";
        assert_eq!(detect_in(canal, ""), Some("Calico/Canal"));
        let router = "*filter\n:KUBE-NWPLCY-ABCDEF - [0:0]\nCOMMIT\n";
        assert_eq!(detect_in(router, ""), Some("kube-router"));
        assert_eq!(
            detect_in(
                "",
                "table ip flannel-ipv4\ntable inet kube-network-policies\n"
            ),
            Some("kube-network-policies")
        );
        // A rule that merely mentions a chain name is not a chain definition.
        assert_eq!(
            detect_in("-A FORWARD -m comment --comment \":cali-x\"\n", ""),
            None
        );
    }
}
