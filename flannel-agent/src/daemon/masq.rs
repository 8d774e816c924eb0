//! `--ip-masq`: which engine masquerades, and keeping the eBPF one healthy.
//!
//! With the eBPF fast path active and `--ebpf-masq` (the default), the programs source-NAT pod
//! traffic to the outside (TCP, UDP, ICMP echo through the external interface; see
//! `flannel_ebpf::nat`) and the traffic manager installs upstream's masquerade chain with
//! RETURN rules for exactly that traffic, so the kernel does not NAT it a second time;
//! everything else is still masqueraded by the kernel. Otherwise (kernel dataplane, or
//! `--ebpf-masq=false`) upstream's rules do it all. `--ip-masq-exclude-cidrs` applies to both.
//!
//! Order at start-up: the programs' NAT is configured before the traffic rules change, so no
//! new flow leaves unmasqueraded in between (a flow the kernel still NATs reaches the programs
//! with the node's address and is only registered). Flows the kernel masqueraded before
//! (upstream, or an earlier run without eBPF) keep their conntrack NAT binding and go on.
//!
//! The other way (eBPF SNAT was on, the programs stay loaded, masquerade goes back to the
//! kernel: `--ebpf-masq=false`, no IPv4 address on the external interface), the pod flows the
//! programs translate have conntrack entries without a NAT binding, which the kernel will
//! not masquerade now. So when such flows are live the agent *hands over*
//! ([`Masquerade::Handover`]): once the traffic rules are the kernel's, the programs keep
//! translating the flows they hold and map no new ones (`NAT_CFG_HANDOVER`), and the NAT is
//! turned off when the last of them has ended ([`hand_over`]).

use std::{net::Ipv4Addr, time::Duration};

use ipnet::{IpNet, Ipv4Net};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    backend::BackendOptions,
    bpf::{
        NatSettings, NatSizing, SharedFastPath,
        nat::{default_port_range, handover_pending},
    },
    cli::{Cli, Dataplane},
    dataplane::Local,
    traffic::MasqOptions,
};
use flannel_common::stats::Reason;

/// Who masquerades pod traffic.
pub enum Masquerade {
    /// `--ip-masq` is off.
    Off,
    /// The iptables/nftables rules, as upstream.
    Netfilter,
    /// The eBPF programs, for TCP/UDP/ICMP echo leaving `iface`.
    Ebpf {
        /// The external interface.
        iface: String,
        /// The fast path whose NAT maps to keep.
        fast_path: SharedFastPath,
    },
    /// The rules are upstream's (as [`Masquerade::Netfilter`], or none with `--ip-masq=false`),
    /// but the programs still translate the pod flows they masqueraded before, until these end.
    Handover {
        /// The fast path whose NAT to wind down.
        fast_path: SharedFastPath,
    },
}

impl Masquerade {
    /// What the traffic manager adds to upstream's masquerade rules.
    pub fn traffic_options(&self, cli: &Cli) -> MasqOptions {
        MasqOptions {
            ebpf_out_iface: match self {
                Masquerade::Ebpf { iface, .. } => Some(iface.clone()),
                _ => None,
            },
            exclude: cli.ip_masq_exclude_cidrs.clone(),
        }
    }
}

/// The IPv4 prefixes of `--ip-masq-exclude-cidrs`.
fn excluded_v4(cli: &Cli) -> Vec<Ipv4Net> {
    cli.ip_masq_exclude_cidrs
        .iter()
        .filter_map(|net| match net {
            IpNet::V4(n) => Some(n.trunc()),
            IpNet::V6(_) => None,
        })
        .collect()
}

/// Decides who masquerades and configures the programs accordingly (turning their NAT off
/// when they do not masquerade, so a previous run's setting does not linger).
pub fn configure(
    cli: &Cli,
    fast_path: Option<&SharedFastPath>,
    local: &Local,
    sizing: NatSizing,
) -> Masquerade {
    let Some(fp) = fast_path else {
        return if cli.ip_masq {
            Masquerade::Netfilter
        } else {
            Masquerade::Off
        };
    };
    let wanted = cli.ip_masq && cli.ebpf_masq;
    let settings = match (wanted, local.ext.iface_addr) {
        (true, Some(addr)) if !addr.is_unspecified() => Some(settings(cli, addr)),
        (true, _) => {
            warn!(
                iface = %local.ext.name,
                "masquerade stays with iptables/nftables: the external interface has no IPv4 address"
            );
            None
        }
        (false, _) => None,
    };
    let Ok(mut guard) = fp.lock() else {
        warn!("the fast-path handle is poisoned; masquerade stays with iptables/nftables");
        return fallback(cli);
    };
    match settings {
        Some(settings) => match guard.set_nat(Some(&settings)) {
            Ok(()) => {
                let capacity = guard.nat_capacity().unwrap_or(sizing.entries);
                info!(
                    address = %settings.nat_addr,
                    ports = %format!("{}-{}", settings.ports.0, settings.ports.1),
                    excluded = ?settings.no_masq,
                    "masquerade: eBPF SNAT of TCP, UDP and ICMP echo leaving {}; NAT maps: {}",
                    local.ext.name,
                    NatSizing {
                        entries: capacity,
                        ..sizing
                    }
                );
                Masquerade::Ebpf {
                    iface: local.ext.name.clone(),
                    fast_path: fp.clone(),
                }
            }
            Err(err) => {
                warn!("masquerade stays with iptables/nftables: configuring eBPF SNAT: {err}");
                if let Err(e) = guard.set_nat(None) {
                    warn!("turning eBPF SNAT off: {e}");
                }
                fallback(cli)
            }
        },
        None => {
            if let Some(pending) = flows_to_hand_over(&guard) {
                info!(
                    flows = pending,
                    "masquerade: {}; eBPF SNAT keeps translating the established flows it \
                     holds until they end",
                    if cli.ip_masq {
                        "iptables/nftables"
                    } else {
                        "off (--ip-masq=false)"
                    }
                );
                return Masquerade::Handover {
                    fast_path: fp.clone(),
                };
            }
            if let Err(err) = guard.set_nat(None) {
                warn!("turning eBPF SNAT off: {err}");
            }
            if cli.ip_masq {
                info!("masquerade: iptables/nftables (--ebpf-masq=false)");
            }
            fallback(cli)
        }
    }
}

/// How many live flows the programs' NAT (on, from an earlier run or a handover in progress)
/// still translates, if any.
fn flows_to_hand_over(fp: &crate::bpf::FastPath) -> Option<usize> {
    let cfg = fp.nat_config().ok()?;
    if !cfg.enabled() {
        return None;
    }
    match fp.nat_flows() {
        Ok(flows) => Some(handover_pending(&flows)).filter(|n| *n > 0),
        Err(err) => {
            warn!("reading the NAT flows: {err}; eBPF SNAT is turned off");
            None
        }
    }
}

/// The handover: marks the programs' NAT as handing over (call it once the traffic rules are
/// the kernel's: until then new flows still skip the kernel's MASQUERADE) and hands its ICMP
/// echo flows to conntrack, then every `period` (`--ebpf-nat-sweep-interval`) sweeps expired
/// flows and turns the NAT off when none is left to translate. Runs until then or `cancel` (a
/// restarted agent takes the handover up again).
pub async fn hand_over(fast_path: SharedFastPath, period: Duration, cancel: CancellationToken) {
    let fp = fast_path.clone();
    let begun = tokio::task::spawn_blocking(move || {
        let mut fp = fp
            .lock()
            .map_err(|_| "the fast-path handle is poisoned".to_owned())?;
        let begun = fp.begin_nat_handover().map_err(|e| e.to_string())?;
        if begun {
            hand_echoes_over(&mut fp);
        }
        Ok::<_, String>(begun)
    })
    .await;
    match begun {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => return,
        Ok(Err(err)) => warn!("handing masquerade over to the kernel: {err}"),
        Err(err) => warn!("handing masquerade over to the kernel: {err}"),
    }
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(period) => {}
        }
        let fp = fast_path.clone();
        let result = tokio::task::spawn_blocking(move || {
            let mut fp = fp
                .lock()
                .map_err(|_| "the fast-path handle is poisoned".to_owned())?;
            fp.nat_sweep().map_err(|e| e.to_string())?;
            hand_echoes_over(&mut fp);
            let pending = handover_pending(&fp.nat_flows().map_err(|e| e.to_string())?);
            if pending == 0 {
                fp.set_nat(None).map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(pending)
        })
        .await;
        match result {
            Ok(Ok(0)) => {
                info!("masquerade handover finished: eBPF SNAT is off");
                return;
            }
            Ok(Ok(pending)) => tracing::debug!(flows = pending, "masquerade handover"),
            Ok(Err(err)) => warn!("masquerade handover: {err}"),
            Err(err) => warn!("masquerade handover task: {err}"),
        }
    }
}

/// Hands the pods' ICMP echo flows of the programs' NAT over to conntrack
/// ([`crate::bpf::handover::hand_echoes_over`]): a ping that goes on would keep the handover
/// going for as long as it runs. A failure leaves them to the programs (logged).
fn hand_echoes_over(fp: &mut crate::bpf::FastPath) {
    if let Err(err) = crate::bpf::handover::hand_echoes_over(fp) {
        warn!("handing the pods' ICMP echo flows to conntrack: {err}");
    }
}

fn fallback(cli: &Cli) -> Masquerade {
    if cli.ip_masq {
        Masquerade::Netfilter
    } else {
        Masquerade::Off
    }
}

/// Checks, before anything is set up, that the eBPF NAT's port range leaves the udp backend's
/// port alone. The programs take every packet for the masquerade address with a destination
/// port in the range for a reply to a masqueraded flow (and a pod flow may be given that port
/// as its source), so the range must not hold the port on which the udp backend receives from
/// its peers (8285, or the network config's `Port`). Only when eBPF masquerade may be used:
/// `--ip-masq`, `--ebpf-masq` and a dataplane other than `kernel`. The range is
/// `--ebpf-nat-port-range`, or the node's `ip_local_port_range` when the flag is not given.
pub fn check_port_range(cli: &Cli, backend: &BackendOptions) -> Result<(), String> {
    let BackendOptions::Udp(udp) = backend else {
        return Ok(());
    };
    if !cli.ip_masq || !cli.ebpf_masq || cli.dataplane == Dataplane::Kernel {
        return Ok(());
    }
    match cli.ebpf_nat_port_range {
        Some(range) => port_range_excludes(range, udp.port, "--ebpf-nat-port-range"),
        None => port_range_excludes(
            default_port_range(),
            udp.port,
            "the default eBPF NAT port range (net.ipv4.ip_local_port_range)",
        ),
    }
}

/// [`check_port_range`] for one range (`what` names where it came from in the message).
fn port_range_excludes((min, max): (u16, u16), udp_port: u16, what: &str) -> Result<(), String> {
    if (min..=max).contains(&udp_port) {
        return Err(format!(
            "{what} {min}-{max} includes the udp backend's port {udp_port}: eBPF masquerade \
             would take the backend's packets for replies to masqueraded flows; give \
             --ebpf-nat-port-range a range without port {udp_port} (or set the backend's \
             Port outside the range, or --ebpf-masq=false)"
        ));
    }
    Ok(())
}

/// The programs' NAT settings from the command line.
pub fn settings(cli: &Cli, addr: Ipv4Addr) -> NatSettings {
    NatSettings {
        ports: cli.ebpf_nat_port_range.unwrap_or_else(default_port_range),
        no_masq: excluded_v4(cli),
        ..NatSettings::new(addr)
    }
}

/// Sweeps expired NAT entries every `period` (`--ebpf-nat-sweep-interval`) and reports
/// exhaustion (packets dropped for lack of a free port since the last check) as a warning;
/// the counter itself is in `/metrics` as `flannel_fastpath_packets_total{program=
/// "tc_to_netdev", reason="drop_snat_exhausted"}`. Runs until `cancel`.
pub async fn maintain(fast_path: SharedFastPath, period: Duration, cancel: CancellationToken) {
    let mut seen = None;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(period) => {}
        }
        let fp = fast_path.clone();
        let result = tokio::task::spawn_blocking(move || {
            let Ok(mut fp) = fp.lock() else {
                return Err("the fast-path handle is poisoned".to_owned());
            };
            let swept = fp.nat_sweep().map_err(|e| e.to_string())?;
            let exhausted = fp
                .counters()
                .map(|c| c.to_netdev.get(Reason::DropSnatExhausted).packets)
                .map_err(|e| e.to_string())?;
            let config = fp.nat_config().map_err(|e| e.to_string())?;
            Ok((swept, exhausted, config))
        })
        .await;
        match result {
            Ok(Ok((swept, exhausted, config))) => {
                if swept.expired + swept.orphans > 0 {
                    tracing::debug!(
                        flows = swept.flows,
                        expired = swept.expired,
                        orphans = swept.orphans,
                        "NAT sweep"
                    );
                }
                if let Some(before) = seen
                    && exhausted > before
                {
                    warn!(
                        dropped = exhausted - before,
                        flows = swept.flows,
                        "eBPF SNAT ran out of ports for some destinations (range {}-{}): new \
                         connections were dropped; widen --ebpf-nat-port-range",
                        config.port_min,
                        config.port_max
                    );
                }
                seen = Some(exhausted);
            }
            Ok(Err(err)) => warn!("NAT maintenance: {err}"),
            Err(err) => warn!("NAT maintenance task: {err}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::options::{UdpOptions, VxlanOptions};

    fn cli(args: &[&str]) -> Cli {
        let mut argv = vec!["flanneld"];
        argv.extend_from_slice(args);
        Cli::parse_from(argv, |_| None).expect("flags")
    }

    fn udp(port: u16) -> BackendOptions {
        BackendOptions::Udp(UdpOptions { port })
    }

    #[test]
    fn the_nat_port_range_must_leave_the_udp_port_out() {
        let err = check_port_range(
            &cli(&["--ip-masq", "--ebpf-nat-port-range=8000-9000"]),
            &udp(8285),
        )
        .expect_err("8285 in 8000-9000");
        assert_eq!(
            err,
            "--ebpf-nat-port-range 8000-9000 includes the udp backend's port 8285: eBPF \
             masquerade would take the backend's packets for replies to masqueraded flows; give \
             --ebpf-nat-port-range a range without port 8285 (or set the backend's Port outside \
             the range, or --ebpf-masq=false)"
        );
        // The configured Port, at either end of the range.
        for range in [
            "--ebpf-nat-port-range=40000-50000",
            "--ebpf-nat-port-range=30000-40000",
        ] {
            let err = check_port_range(&cli(&["--ip-masq", range]), &udp(40000))
                .expect_err("the configured port");
            assert!(err.contains("port 40000"), "{err}");
        }
        // A range beside the port is fine.
        for range in [
            "--ebpf-nat-port-range=8286-9000",
            "--ebpf-nat-port-range=1024-8284",
        ] {
            assert_eq!(
                check_port_range(&cli(&["--ip-masq", range]), &udp(8285)),
                Ok(())
            );
        }
    }

    #[test]
    fn the_guard_applies_only_where_ebpf_masquerade_may_run() {
        let range = "--ebpf-nat-port-range=8000-9000";
        for args in [
            vec![range],
            vec!["--ip-masq", "--ebpf-masq=false", range],
            vec!["--ip-masq", "--dataplane=kernel", range],
        ] {
            assert_eq!(
                check_port_range(&cli(&args), &udp(8285)),
                Ok(()),
                "{args:?}"
            );
        }
        for args in [
            vec!["--ip-masq", range],
            vec!["--ip-masq", "--dataplane=ebpf", range],
            vec!["--ip-masq", "--dataplane=auto", range],
        ] {
            assert!(
                check_port_range(&cli(&args), &udp(8285)).is_err(),
                "{args:?}"
            );
        }
        // Other backends have no such port.
        assert_eq!(
            check_port_range(
                &cli(&["--ip-masq", range]),
                &BackendOptions::Vxlan(VxlanOptions::default())
            ),
            Ok(())
        );
    }

    #[test]
    fn the_default_range_is_checked_too_and_named() {
        let (min, max) = default_port_range();
        let err = check_port_range(&cli(&["--ip-masq"]), &udp(min)).expect_err("in the default");
        assert!(
            err.starts_with(&format!(
                "the default eBPF NAT port range (net.ipv4.ip_local_port_range) {min}-{max} \
                 includes the udp backend's port {min}"
            )),
            "{err}"
        );
        if min > 1 {
            assert_eq!(
                check_port_range(&cli(&["--ip-masq"]), &udp(min - 1)),
                Ok(())
            );
        }
    }
}
