//! Masquerade and forward rules: upstream flannel's exact rules, through iptables (default)
//! or nftables (`EnableNFTables: true` in net-conf), kept exact.
//!
//! | file | job |
//! |---|---|
//! | [`rules`] | pure rule generation (iptables text, nftables statements) |
//! | [`iptables`] | iptables-save reading, exact comparison, iptables-restore repair |
//! | [`nftables`] | `nft -j` reading, exact comparison, one `nft -f -` transaction |
//! | [`runner`] | how commands are run (host, or `nsenter` into a namespace) |
//! | [`br_netfilter`] | the bridge-netfilter sysctl check (a warning, not fatal) |
//!
//! # Use from the daemon
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use flannel_agent::traffic::*;
//! # fn demo(desired: Desired, previous: Previous) -> Result<(), TrafficError> {
//! let mode = TrafficMode::from_netconf(false, IptablesVariant::System);
//! if mode.wants_br_netfilter() {
//!     if let Err(w) = check_br_netfilter(BR_NETFILTER_SYSCTL_DIR.as_ref(), Family::Ipv4) {
//!         tracing::warn!("{w}");
//!     }
//! }
//! let mut manager = TrafficManager::new(mode, Arc::new(SystemRunner::new()));
//! let report = manager.init(&desired, &previous)?; // log report.warnings, report.recycled
//! // then, on every --iptables-resync tick and whenever the desired state changes:
//! manager.ensure(&desired)?;
//! # Ok(()) }
//! ```
//!
//! or hand the manager to [`TrafficManager::run`], which does the periodic part.
//!
//! # Compared with upstream
//!
//! * **No window without masquerade** (upstream issue 2237): chains are never flushed on
//!   their own. A repair replaces a chain's content in the same kernel transaction that
//!   installs the new rules.
//! * **Exact comparison** (issue 1337): order, duplicates, extra and missing rules, and
//!   duplicate or stale jumps are all detected and repaired. Upstream's resync only checks
//!   that each rule is present.
//! * **No rule-by-rule commands**: one `iptables-save` per table to read, and one
//!   `iptables-restore --noflush --wait` per table to write, only when something differs.
//!   `ensure` on a correct state writes nothing. nftables gets the same check and repair
//!   (upstream never resyncs it).
//! * **Correct cleanup** of the mode not in use, and of the other iptables backend: jumps,
//!   then chains, in the right tables (upstream deletes `FLANNEL-FWD` from `nat`, and leaves
//!   the jumps and the filter chain behind).
//! * **Nothing is removed on exit** (as upstream since v0.27.0): rules keep working while the
//!   daemon restarts.
//! * Within an enabled family, a part that is switched off (`--ip-masq=false`,
//!   `--iptables-forward-rules=false`) has its chain removed, so stale rules from an earlier
//!   configuration do not linger (upstream leaves them).
//!
//! The managers are synchronous (they run short external commands); call them from
//! `spawn_blocking`, as [`TrafficManager::run`] does. One manager must own the rules of a
//! node: two daemons with different networks on one host would rewrite each other's chains.

pub mod br_netfilter;
mod error;
pub mod iptables;
pub mod nftables;
pub mod rules;
pub mod runner;
#[cfg(test)]
mod testing;

use std::{sync::Arc, time::Duration};

use ipnet::IpNet;
use tokio::sync::watch;

pub use br_netfilter::{BR_NETFILTER_SYSCTL_DIR, BrNetfilterWarning, check_br_netfilter};
pub use error::TrafficError;
pub use iptables::{IptablesBackend, IptablesManager, IptablesVariant};
pub use nftables::NftablesManager;
pub use rules::{Family, MasqOptions};
pub use runner::{CommandOutput, CommandRunner, SystemRunner};

/// The rules wanted for one address family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyRules {
    /// The cluster Network `N` (net-conf `Network` / `IPv6Network`).
    pub network: IpNet,
    /// This node's lease subnet `P`.
    pub subnet: IpNet,
    /// Masquerade rules (`--ip-masq`).
    pub masquerade: bool,
    /// Forward-accept rules (`--iptables-forward-rules`, upstream default on).
    pub forward: bool,
}

/// Everything the node wants. A family that is `None` is not managed by `ensure`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    /// IPv4 rules, if IPv4 is enabled.
    pub ipv4: Option<FamilyRules>,
    /// IPv6 rules, if IPv6 is enabled.
    pub ipv6: Option<FamilyRules>,
    /// Use `--random-fully` / `fully-random` when the tool supports it
    /// (upstream: unless `--ip-masq-fully-random-disable`).
    pub random_fully: bool,
}

impl Desired {
    /// The rules of `family`.
    pub fn family(&self, family: Family) -> Option<&FamilyRules> {
        match family {
            Family::Ipv4 => self.ipv4.as_ref(),
            Family::Ipv6 => self.ipv6.as_ref(),
        }
    }

    /// Checks that every network and subnet has the family of the slot it is in.
    pub fn validate(&self) -> Result<(), TrafficError> {
        for family in Family::ALL {
            let Some(f) = self.family(family) else {
                continue;
            };
            for (field, value) in [("network", f.network), ("subnet", f.subnet)] {
                if Family::of(&value) != family {
                    return Err(TrafficError::InvalidInput {
                        field,
                        value: value.to_string(),
                        reason: match family {
                            Family::Ipv4 => "an IPv6 prefix was given for IPv4",
                            Family::Ipv6 => "an IPv4 prefix was given for IPv6",
                        },
                    });
                }
            }
        }
        Ok(())
    }
}

/// One family's values from the previous `subnet.env` (`FLANNEL_NETWORK` / `FLANNEL_SUBNET`,
/// or the IPv6 pair).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreviousLease {
    /// The previous cluster Network.
    pub network: IpNet,
    /// The previous lease subnet.
    pub subnet: IpNet,
}

/// The previous `subnet.env`, per family (`Default` = none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Previous {
    /// Previous IPv4 values.
    pub ipv4: Option<PreviousLease>,
    /// Previous IPv6 values.
    pub ipv6: Option<PreviousLease>,
}

impl Previous {
    /// The previous values of `family`.
    pub fn family(&self, family: Family) -> Option<&PreviousLease> {
        match family {
            Family::Ipv4 => self.ipv4.as_ref(),
            Family::Ipv6 => self.ipv6.as_ref(),
        }
    }
}

/// Which rule engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrafficMode {
    /// iptables (upstream's default), with the given binaries.
    Iptables(IptablesVariant),
    /// nftables (`EnableNFTables: true`).
    Nftables,
}

impl TrafficMode {
    /// From net-conf's `EnableNFTables` and the iptables variant option.
    pub fn from_netconf(enable_nftables: bool, variant: IptablesVariant) -> Self {
        if enable_nftables {
            TrafficMode::Nftables
        } else {
            TrafficMode::Iptables(variant)
        }
    }

    /// Whether upstream checks br_netfilter in this mode (iptables only); see
    /// [`check_br_netfilter`] for why the result is only a warning here.
    pub fn wants_br_netfilter(&self) -> bool {
        matches!(self, TrafficMode::Iptables(_))
    }
}

/// What [`TrafficManager::init`] did, for the caller to log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InitReport {
    /// Leftovers of the other mode (or other iptables backend) that were removed.
    pub cleaned: Vec<String>,
    /// Families whose network or subnet changed since the previous subnet.env (their old
    /// rules were replaced atomically) or that are no longer enabled (their chains were
    /// removed).
    pub recycled: Vec<Family>,
    /// Whether the first ensure wrote anything.
    pub changed: bool,
    /// Cleanup steps that failed; not fatal, like upstream (which logs them at V(2)).
    pub warnings: Vec<String>,
}

/// The front the daemon uses: one rule engine with its state.
#[derive(Debug)]
pub enum TrafficManager {
    /// iptables mode.
    Iptables(IptablesManager),
    /// nftables mode.
    Nftables(NftablesManager),
}

impl TrafficManager {
    /// A manager for `mode` that runs its commands through `runner`
    /// ([`SystemRunner::new`] on a node).
    pub fn new(mode: TrafficMode, runner: Arc<dyn CommandRunner>) -> Self {
        match mode {
            TrafficMode::Iptables(variant) => {
                TrafficManager::Iptables(IptablesManager::new(runner, variant))
            }
            TrafficMode::Nftables => TrafficManager::Nftables(NftablesManager::new(runner)),
        }
    }

    /// Sets what the masquerade chains add to upstream's rules: the RETURN rules for traffic
    /// the eBPF fast path masquerades, and excluded destinations ([`MasqOptions`]; the default
    /// is upstream's rule set exactly). Applied by the next [`Self::init`] / [`Self::ensure`].
    pub fn set_masq_options(&mut self, options: MasqOptions) {
        match self {
            TrafficManager::Iptables(m) => m.set_masq_options(options),
            TrafficManager::Nftables(m) => m.set_masq_options(options),
        }
    }

    fn runner(&self) -> Arc<dyn CommandRunner> {
        match self {
            TrafficManager::Iptables(m) => m.runner(),
            TrafficManager::Nftables(m) => m.runner(),
        }
    }

    /// Startup, in upstream's order: clean up the mode not in use, recycle the previous
    /// state, then apply `desired` (the first [`Self::ensure`]).
    ///
    /// * iptables mode removes our nftables tables and our chains in the *other* iptables
    ///   backend (e.g. legacy rules left by an earlier run with another variant); nftables
    ///   mode removes our iptables chains and jumps from both backends. Tables that do not
    ///   exist are not created. Failures are reported in [`InitReport::warnings`].
    /// * Recycling: upstream deletes the rules computed from the previous subnet.env when
    ///   the Network or subnet changed, then adds the new ones (a window without
    ///   masquerade). Here the new rules replace the old ones in the same transaction, so a
    ///   changed family only needs reporting. A family present in `previous` but absent
    ///   from `desired` has its chains removed (upstream leaves them).
    ///
    /// Only an error applying `desired` fails init.
    pub fn init(
        &mut self,
        desired: &Desired,
        previous: &Previous,
    ) -> Result<InitReport, TrafficError> {
        desired.validate()?;
        let mut report = InitReport::default();
        let runner = self.runner();
        let mut note = |what: String, result: Result<bool, TrafficError>| match result {
            Ok(true) => report.cleaned.push(what),
            Ok(false) => {}
            Err(e) => report.warnings.push(format!("{what}: {e}")),
        };
        match self {
            TrafficManager::Iptables(m) => {
                note(
                    "nftables tables flannel-ipv4/flannel-ipv6".to_owned(),
                    nftables::cleanup_nftables(runner.as_ref()),
                );
                let active = m.tool(Family::Ipv4).map(|t| t.backend);
                match active {
                    Ok(active) => {
                        let other = match active {
                            IptablesBackend::Legacy => IptablesBackend::Nft,
                            IptablesBackend::Nft => IptablesBackend::Legacy,
                        };
                        for family in Family::ALL {
                            note(
                                format!("{family} iptables chains in the {other:?} backend"),
                                iptables::cleanup_backend(runner.as_ref(), family, other),
                            );
                        }
                    }
                    Err(e) => report.warnings.push(format!("iptables: {e}")),
                }
            }
            TrafficManager::Nftables(_) => {
                for backend in [IptablesBackend::Legacy, IptablesBackend::Nft] {
                    for family in Family::ALL {
                        note(
                            format!("{family} iptables chains in the {backend:?} backend"),
                            iptables::cleanup_backend(runner.as_ref(), family, backend),
                        );
                    }
                }
            }
        }
        for family in Family::ALL {
            let Some(prev) = previous.family(family) else {
                continue;
            };
            match desired.family(family) {
                Some(cur) => {
                    if cur.network != prev.network || cur.subnet != prev.subnet {
                        report.recycled.push(family);
                    }
                }
                None => {
                    report.recycled.push(family);
                    let removed = match self {
                        TrafficManager::Iptables(m) => m.remove(family),
                        TrafficManager::Nftables(m) => m.remove(family),
                    };
                    if let Err(e) = removed {
                        report.warnings.push(format!(
                            "removing {family} rules of the previous lease: {e}"
                        ));
                    }
                }
            }
        }
        report.changed = self.ensure(desired)?;
        Ok(report)
    }

    /// Checks the rules against `desired` and repairs any difference in one transaction per
    /// table (iptables) or one in total (nftables). Returns whether anything was written;
    /// when the rules are already exact, only reads happen.
    pub fn ensure(&mut self, desired: &Desired) -> Result<bool, TrafficError> {
        match self {
            TrafficManager::Iptables(m) => m.ensure(desired),
            TrafficManager::Nftables(m) => m.ensure(desired),
        }
    }

    /// Runs [`Self::ensure`] every `period` (upstream's `--iptables-resync`, default 5 s) and
    /// whenever `desired` changes, until `shutdown` completes (e.g. a
    /// `CancellationToken::cancelled_owned()`) or the sender is dropped. Repairs are logged as
    /// warnings (something changed the rules behind our back), errors as errors; the loop goes
    /// on either way. Rules are left in place on return, and the manager is handed back.
    pub async fn run(
        self,
        mut desired: watch::Receiver<Desired>,
        period: Duration,
        shutdown: impl Future<Output = ()>,
    ) -> Option<Self> {
        tokio::pin!(shutdown);
        let mut manager = Some(self);
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last: Option<Desired> = None;
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                _ = ticker.tick() => {}
                changed = desired.changed() => if changed.is_err() { break },
            }
            let want = desired.borrow_and_update().clone();
            let Some(m) = manager.take() else { break };
            let want2 = want.clone();
            let joined = tokio::task::spawn_blocking(move || {
                let mut m = m;
                let result = m.ensure(&want2);
                (m, result)
            })
            .await;
            let (m, result) = match joined {
                Ok(pair) => pair,
                Err(e) => {
                    tracing::error!("traffic rules: ensure task failed: {e}");
                    break;
                }
            };
            manager = Some(m);
            match result {
                Ok(true) if last.as_ref() == Some(&want) => {
                    tracing::warn!("traffic rules differed from the desired state; repaired")
                }
                Ok(true) => tracing::info!("traffic rules updated"),
                Ok(false) => tracing::debug!("traffic rules are exact"),
                Err(e) => tracing::error!("traffic rules: {e}"),
            }
            last = Some(want);
        }
        manager
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traffic::testing::FakeRunner;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn validate_names_the_wrong_field() {
        let d = Desired {
            ipv4: None,
            ipv6: Some(FamilyRules {
                network: net("fd00::/56"),
                subnet: net("10.0.0.0/24"),
                masquerade: true,
                forward: true,
            }),
            random_fully: true,
        };
        let err = d.validate().expect_err("mixed");
        assert!(err.to_string().contains("subnet 10.0.0.0/24"), "{err}");
    }

    #[test]
    fn nftables_init_cleans_both_iptables_backends() {
        let runner = Arc::new(FakeRunner::new());
        runner.expect("iptables-legacy --version", "iptables v1.8.9 (legacy)\n");
        runner.expect("iptables-nft --version", "iptables v1.8.9 (nf_tables)\n");
        runner.file("/proc/net/ip_tables_names", "nat\n");
        runner.expect_seq(
            "iptables-legacy-save -t nat",
            &[
                "*nat\n:POSTROUTING ACCEPT [0:0]\n:FLANNEL-POSTRTG - [0:0]\n-A POSTROUTING -m comment --comment \"flanneld masq\" -j FLANNEL-POSTRTG\nCOMMIT\n",
                "*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n",
            ],
        );
        runner.expect("iptables-legacy-restore --noflush --wait", "");
        runner.expect(
            "iptables-nft-save -t nat",
            "*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n",
        );
        runner.expect(
            "iptables-nft-save -t filter",
            "*filter\n:FORWARD ACCEPT [0:0]\nCOMMIT\n",
        );
        // ip6tables* are not scripted: not installed, skipped.
        runner.expect("nft --check -f -", "");
        let v4_table = r#"{"nftables": [{"table": {"family": "ip", "name": "flannel-ipv4"}}]}"#;
        runner.expect_seq(
            "nft -j list tables",
            &[r#"{"nftables": []}"#, r#"{"nftables": [{"table": {"family": "ip", "name": "flannel-ipv4"}}, {"table": {"family": "ip6", "name": "flannel-ipv6"}}]}"#],
        );
        runner.expect("nft -j list table ip flannel-ipv4", v4_table);
        runner.expect("nft -j list table ip6 flannel-ipv6", r#"{"nftables": []}"#);
        runner.expect("nft -f -", "");
        let mut m = TrafficManager::new(TrafficMode::Nftables, runner.clone());
        let desired = Desired {
            ipv4: None,
            ipv6: None,
            random_fully: true,
        };
        let report = m.init(&desired, &Previous::default()).expect("init");
        assert_eq!(
            report.cleaned,
            ["IPv4 iptables chains in the Legacy backend"]
        );
        assert!(report.warnings.is_empty(), "{:?}", report.warnings);
        assert!(report.changed, "tables created");
        assert_eq!(
            runner.calls_of("iptables-legacy-restore")[0].1.as_deref(),
            Some(
                "*nat\n-D POSTROUTING -m comment --comment \"flanneld masq\" -j FLANNEL-POSTRTG\n-F FLANNEL-POSTRTG\n-X FLANNEL-POSTRTG\nCOMMIT\n"
            )
        );
        assert!(
            runner.calls_of("iptables-legacy-save -t filter").is_empty(),
            "legacy filter table does not exist and must not be created"
        );
    }

    #[test]
    fn recycling_reports_changed_and_dropped_families() {
        let runner = Arc::new(FakeRunner::new());
        runner.expect("iptables --version", "iptables v1.8.9 (nf_tables)\n");
        runner.expect("ip6tables --version", "ip6tables v1.8.9 (nf_tables)\n");
        runner.expect(
            "iptables-save -t nat",
            "*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n",
        );
        runner.expect(
            "iptables-save -t filter",
            "*filter\n:FORWARD ACCEPT [0:0]\nCOMMIT\n",
        );
        runner.expect(
            "ip6tables-save -t nat",
            "*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n",
        );
        runner.expect(
            "ip6tables-save -t filter",
            "*filter\n:FORWARD ACCEPT [0:0]\nCOMMIT\n",
        );
        let mut m = TrafficManager::new(
            TrafficMode::Iptables(IptablesVariant::System),
            runner.clone(),
        );
        let desired = Desired {
            ipv4: Some(FamilyRules {
                network: net("10.244.0.0/16"),
                subnet: net("10.244.1.0/24"),
                masquerade: false,
                forward: false,
            }),
            ipv6: None,
            random_fully: true,
        };
        let previous = Previous {
            ipv4: Some(PreviousLease {
                network: net("10.245.0.0/16"),
                subnet: net("10.245.3.0/24"),
            }),
            ipv6: Some(PreviousLease {
                network: net("fd00::/56"),
                subnet: net("fd00:0:0:1::/64"),
            }),
        };
        let report = m.init(&desired, &previous).expect("init");
        assert_eq!(report.recycled, [Family::Ipv4, Family::Ipv6]);
        assert!(!report.changed);
        assert_eq!(
            runner.calls_of("ip6tables-save").len(),
            2,
            "IPv6 chains were checked"
        );
    }
}
