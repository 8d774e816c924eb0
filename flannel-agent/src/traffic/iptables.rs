//! flannel's rules through iptables: read with `iptables-save -t <table>`, compare our chains
//! and jumps exactly, repair with one `iptables-restore --noflush --wait` transaction per table.
//!
//! # How a repair looks
//!
//! When `FLANNEL-POSTRTG` differs in any way (a rule missing, reordered, duplicated, foreign,
//! or the chain missing), the payload for the `nat` table is
//!
//! ```text
//! *nat
//! :FLANNEL-POSTRTG - [0:0]
//! -A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 -m comment --comment "flanneld masq" -j RETURN
//! ... the other 5 rules ...
//! -A POSTROUTING -m comment --comment "flanneld masq" -j FLANNEL-POSTRTG   (only if missing)
//! COMMIT
//! ```
//!
//! With `--noflush`, a `:CHAIN` line creates the chain or empties it, and everything up to
//! `COMMIT` is one kernel transaction (a single table replace for iptables-legacy, a single
//! nf_tables batch for iptables-nft). So packets see either the old or the new chain, never an
//! empty one; upstream instead flushes the chain at startup and re-adds rules one by one
//! (upstream issue 2237). Nothing is written when the state is already exact.
//!
//! # What is ours
//!
//! Our chains (`FLANNEL-POSTRTG` in `nat`, `FLANNEL-FWD` in `filter`), and in `POSTROUTING` /
//! `FORWARD` every rule that jumps to them or carries our comment (`flanneld masq` /
//! `flanneld forward`, which also catches the rules older flannel releases put straight into
//! `POSTROUTING`). Exactly one exact jump is kept: a missing one is appended (after kube-proxy's
//! and everyone else's rules, as upstream does), duplicates and variants are deleted. The
//! jump's position is not enforced afterwards, so we never fight another agent that appends
//! behind us. All other chains and rules are left untouched.
//!
//! # Which binaries
//!
//! [`IptablesVariant::System`] (the default) uses `iptables`/`ip6tables` — whatever the host's
//! alternative is — and reports whether that is the legacy or the nf_tables backend.
//! [`IptablesVariant::Legacy`] and [`IptablesVariant::Nft`] force `iptables-legacy*` or
//! `iptables-nft*`. The kernel evaluates both backends, so rules work in either, but they
//! should sit next to kube-proxy's: kube-proxy images pick their backend themselves (the
//! iptables-wrappers heuristic: whichever backend already has more kube rules, or the
//! `KUBE-IPTABLES-HINT` chain kubelet creates in `mangle`). In a container whose
//! `iptables` differs from the host's, set the variant explicitly.
//!
//! `--random-fully` and `iptables-restore --wait` are used when the binary is at least 1.6.2
//! (upstream's rule, from `iptables --version`).

use std::sync::Arc;

use super::{
    Desired, TrafficError,
    rules::{
        FORWARD_CHAIN, FORWARD_COMMENT, FORWARD_HOOK_CHAIN, Family, IptRule, IptTable, MASQ_CHAIN,
        MASQ_COMMENT, MASQ_HOOK_CHAIN, MasqOptions, iptables_forward_rules,
        iptables_masq_rules_with,
    },
    runner::{CommandRunner, command_line, run_ok},
};

/// Which iptables binaries to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IptablesVariant {
    /// `iptables`, `iptables-save`, `iptables-restore` (and `ip6tables*`): the system default.
    #[default]
    System,
    /// `iptables-legacy*` / `ip6tables-legacy*`.
    Legacy,
    /// `iptables-nft*` / `ip6tables-nft*`.
    Nft,
}

impl IptablesVariant {
    /// (main, save, restore) binary names for a family.
    pub fn binaries(self, family: Family) -> (String, String, String) {
        let base = match family {
            Family::Ipv4 => "iptables",
            Family::Ipv6 => "ip6tables",
        };
        let mid = match self {
            IptablesVariant::System => "",
            IptablesVariant::Legacy => "-legacy",
            IptablesVariant::Nft => "-nft",
        };
        (
            format!("{base}{mid}"),
            format!("{base}{mid}-save"),
            format!("{base}{mid}-restore"),
        )
    }
}

/// The kernel interface an iptables binary drives, from its `--version` output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IptablesBackend {
    /// x_tables (`(legacy)`, or no suffix before iptables 1.8).
    Legacy,
    /// nf_tables (`(nf_tables)`).
    Nft,
}

/// Parses `iptables v1.8.9 (nf_tables)` into ((1, 8, 9), Nft).
pub fn parse_version(output: &str) -> Option<((u32, u32, u32), IptablesBackend)> {
    let word = output.split_whitespace().find(|w| w.starts_with('v'))?;
    let mut parts = word[1..].split('.').map(|p| {
        let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u32>().ok()
    });
    let major = parts.next()??;
    let minor = parts.next()??;
    let patch = parts.next().flatten().unwrap_or(0);
    let backend = if output.contains("nf_tables") {
        IptablesBackend::Nft
    } else {
        IptablesBackend::Legacy
    };
    Some(((major, minor, patch), backend))
}

/// A detected iptables binary set for one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IptablesTool {
    /// The family it serves.
    pub family: Family,
    /// `iptables`, `ip6tables-legacy`, ...
    pub program: String,
    /// The matching `-save` binary.
    pub save_program: String,
    /// The matching `-restore` binary.
    pub restore_program: String,
    /// `(major, minor, patch)` from `--version`.
    pub version: (u32, u32, u32),
    /// Legacy or nf_tables.
    pub backend: IptablesBackend,
    /// `--random-fully` is available (>= 1.6.2).
    pub random_fully: bool,
    /// `iptables-restore --wait` is available (>= 1.6.2).
    pub wait: bool,
}

impl IptablesTool {
    /// Runs `<program> --version` and derives the capabilities.
    pub fn detect(
        runner: &dyn CommandRunner,
        family: Family,
        variant: IptablesVariant,
    ) -> Result<Self, TrafficError> {
        let (program, save_program, restore_program) = variant.binaries(family);
        let out = run_ok(runner, &program, &["--version"], None)?;
        let (version, backend) = parse_version(&out).ok_or_else(|| TrafficError::Parse {
            command: command_line(&program, &["--version"]),
            detail: format!("no version in {:?}", out.trim()),
        })?;
        let modern = version >= (1, 6, 2);
        Ok(IptablesTool {
            family,
            program,
            save_program,
            restore_program,
            version,
            backend,
            random_fully: modern,
            wait: modern,
        })
    }

    /// `iptables-save -t <table>`, parsed.
    pub fn save(
        &self,
        runner: &dyn CommandRunner,
        table: IptTable,
    ) -> Result<TableState, TrafficError> {
        let args = ["-t", table.as_str()];
        let out = run_ok(runner, &self.save_program, &args, None)?;
        TableState::parse(&out, table.as_str()).map_err(|detail| TrafficError::Parse {
            command: command_line(&self.save_program, &args),
            detail,
        })
    }

    /// Applies `lines` to `table` in one `iptables-restore --noflush [--wait]` call.
    pub fn restore(
        &self,
        runner: &dyn CommandRunner,
        table: IptTable,
        lines: &[String],
    ) -> Result<(), TrafficError> {
        let payload = restore_payload(table, lines);
        let args: &[&str] = if self.wait {
            &["--noflush", "--wait"]
        } else {
            &["--noflush"]
        };
        tracing::debug!(program = %self.restore_program, %payload, "iptables-restore");
        run_ok(
            runner,
            &self.restore_program,
            args,
            Some(payload.as_bytes()),
        )
        .map(drop)
    }

    /// Whether `table` exists for this backend, without creating it. Reading a legacy table
    /// with iptables-save loads its kernel module and creates it, so for the legacy backend
    /// `/proc/net/ip{,6}_tables_names` is consulted; iptables-nft-save never creates tables.
    pub fn table_exists(
        &self,
        runner: &dyn CommandRunner,
        table: IptTable,
    ) -> Result<bool, TrafficError> {
        if self.backend == IptablesBackend::Nft {
            return Ok(true);
        }
        let path = match self.family {
            Family::Ipv4 => "/proc/net/ip_tables_names",
            Family::Ipv6 => "/proc/net/ip6_tables_names",
        };
        let names = runner
            .read_file(path)
            .map_err(|source| TrafficError::Spawn {
                command: format!("read {path}"),
                source,
            })?;
        Ok(names.is_some_and(|n| n.lines().any(|l| l.trim() == table.as_str())))
    }
}

/// `*<table>\n<lines>\nCOMMIT\n`.
pub fn restore_payload(table: IptTable, lines: &[String]) -> String {
    let mut payload = format!("*{}\n", table.as_str());
    for line in lines {
        payload.push_str(line);
        payload.push('\n');
    }
    payload.push_str("COMMIT\n");
    payload
}

/// One table as `iptables-save` printed it: each chain with its rules (the text after
/// `-A <chain> `), in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableState {
    chains: Vec<(String, Vec<String>)>,
}

impl TableState {
    /// Parses the `*<table>` section of iptables-save output. Output without that section
    /// (a table that does not exist yet) is an empty state.
    pub fn parse(output: &str, table: &str) -> Result<Self, String> {
        let mut state = TableState::default();
        let mut inside = false;
        for (n, line) in output.lines().enumerate() {
            let line = line.trim_end();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(name) = line.strip_prefix('*') {
                inside = name == table;
                continue;
            }
            if !inside {
                continue;
            }
            if line == "COMMIT" {
                inside = false;
            } else if let Some(decl) = line.strip_prefix(':') {
                let name = decl.split_whitespace().next().unwrap_or_default();
                if name.is_empty() {
                    return Err(format!("line {}: chain without a name: {line:?}", n + 1));
                }
                state.chain_mut(name);
            } else if let Some(rest) = line.strip_prefix("-A ") {
                let (chain, spec) = rest.split_once(' ').unwrap_or((rest, ""));
                state.chain_mut(chain).push(spec.to_owned());
            } else {
                return Err(format!("line {}: unexpected {line:?}", n + 1));
            }
        }
        Ok(state)
    }

    fn chain_mut(&mut self, name: &str) -> &mut Vec<String> {
        let idx = match self.chains.iter().position(|(n, _)| n == name) {
            Some(i) => i,
            None => {
                self.chains.push((name.to_owned(), Vec::new()));
                self.chains.len() - 1
            }
        };
        &mut self.chains[idx].1
    }

    /// The rules of `chain`, `None` if the chain does not exist.
    pub fn chain(&self, name: &str) -> Option<&[String]> {
        self.chains
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r.as_slice())
    }
}

/// Splits a rule spec into words the way iptables-restore does (double quotes group,
/// backslash escapes the next character).
pub fn split_words(spec: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quoted = false;
    let mut chars = spec.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    cur.push(next);
                }
                in_word = true;
            }
            '"' => {
                quoted = !quoted;
                in_word = true;
            }
            c if c.is_whitespace() && !quoted => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    words
}

/// Whether a rule in a built-in chain belongs to flannel: it jumps (or goes) to `chain` or
/// carries `comment`.
fn is_ours(spec: &str, chain: &str, comment: &str) -> bool {
    let words = split_words(spec);
    words.windows(2).any(|w| {
        (matches!(w[0].as_str(), "-j" | "--jump" | "-g" | "--goto") && w[1] == chain)
            || (w[0] == "--comment" && w[1] == comment)
    })
}

/// What flannel wants in one table: a built-in chain jumping to our chain.
#[derive(Debug, Clone, Copy)]
pub struct ChainTarget<'a> {
    /// `POSTROUTING` or `FORWARD`.
    pub hook: &'static str,
    /// `FLANNEL-POSTRTG` or `FLANNEL-FWD`.
    pub chain: &'static str,
    /// `flanneld masq` or `flanneld forward`.
    pub comment: &'static str,
    /// The jump rule and the chain's rules; `None` removes chain and jumps.
    pub rules: Option<&'a [IptRule]>,
}

impl<'a> ChainTarget<'a> {
    fn masq(rules: Option<&'a [IptRule]>) -> Self {
        ChainTarget {
            hook: MASQ_HOOK_CHAIN,
            chain: MASQ_CHAIN,
            comment: MASQ_COMMENT,
            rules,
        }
    }

    fn forward(rules: Option<&'a [IptRule]>) -> Self {
        ChainTarget {
            hook: FORWARD_HOOK_CHAIN,
            chain: FORWARD_CHAIN,
            comment: FORWARD_COMMENT,
            rules,
        }
    }

    /// (jump spec, chain specs) when present.
    fn split(&self) -> Option<(String, Vec<String>)> {
        let rules = self.rules?;
        let jump = rules
            .iter()
            .find(|r| r.chain == self.hook)
            .map(IptRule::spec)
            .unwrap_or_default();
        let body = rules
            .iter()
            .filter(|r| r.chain == self.chain)
            .map(IptRule::spec)
            .collect();
        Some((jump, body))
    }
}

/// Computes the restore lines (without `*table` / `COMMIT`) that turn `state` into `target`;
/// empty when nothing differs.
pub fn plan(state: &TableState, target: &ChainTarget<'_>) -> Vec<String> {
    let mut lines = Vec::new();
    let hook_rules = state.chain(target.hook).unwrap_or_default();
    let ours: Vec<&String> = hook_rules
        .iter()
        .filter(|r| is_ours(r, target.chain, target.comment))
        .collect();
    match target.split() {
        Some((jump, body)) => {
            if state.chain(target.chain) != Some(body.as_slice()) {
                lines.push(format!(":{} - [0:0]", target.chain));
                lines.extend(body.iter().map(|r| format!("-A {} {r}", target.chain)));
            }
            let exact = ours.iter().filter(|r| ***r == jump).count();
            for r in ours.iter().filter(|r| ***r != jump) {
                lines.push(format!("-D {} {r}", target.hook));
            }
            if exact == 0 {
                lines.push(format!("-A {} {jump}", target.hook));
            }
            for _ in 1..exact.max(1) {
                lines.push(format!("-D {} {jump}", target.hook));
            }
        }
        None => {
            for r in &ours {
                lines.push(format!("-D {} {r}", target.hook));
            }
            if state.chain(target.chain).is_some() {
                lines.push(format!("-F {}", target.chain));
                lines.push(format!("-X {}", target.chain));
            }
        }
    }
    lines
}

/// Manages flannel's iptables rules for both families.
#[derive(Debug)]
pub struct IptablesManager {
    runner: Arc<dyn CommandRunner>,
    variant: IptablesVariant,
    tools: [Option<IptablesTool>; 2],
    masq_options: MasqOptions,
}

fn slot(family: Family) -> usize {
    match family {
        Family::Ipv4 => 0,
        Family::Ipv6 => 1,
    }
}

impl IptablesManager {
    /// A manager running `variant`'s binaries through `runner`. Binaries are probed on first
    /// use per family, so an IPv4-only node never runs ip6tables.
    pub fn new(runner: Arc<dyn CommandRunner>, variant: IptablesVariant) -> Self {
        IptablesManager {
            runner,
            variant,
            tools: [None, None],
            masq_options: MasqOptions::default(),
        }
    }

    /// Sets what the masquerade chain adds to upstream's rules (see
    /// [`super::rules::iptables_masq_rules_with`]); applied by the next [`Self::ensure`].
    pub fn set_masq_options(&mut self, options: MasqOptions) {
        self.masq_options = options;
    }

    /// The runner the commands go through.
    pub fn runner(&self) -> Arc<dyn CommandRunner> {
        self.runner.clone()
    }

    /// The configured variant.
    pub fn variant(&self) -> IptablesVariant {
        self.variant
    }

    /// The detected binaries for `family` (probing them on first call).
    pub fn tool(&mut self, family: Family) -> Result<&IptablesTool, TrafficError> {
        let i = slot(family);
        if self.tools[i].is_none() {
            let tool = IptablesTool::detect(self.runner.as_ref(), family, self.variant)?;
            tracing::debug!(?tool, "detected iptables");
            self.tools[i] = Some(tool);
        }
        self.tools[i].as_ref().ok_or_else(|| TrafficError::Parse {
            command: "iptables --version".to_owned(),
            detail: "no tool".to_owned(),
        })
    }

    /// Brings every family in `desired` to the exact desired rules; returns whether anything
    /// was written. Families absent from `desired` are not touched (see [`Self::remove`]).
    /// Within a present family, a part that is switched off (masquerade or forward) has its
    /// chain and jumps removed.
    pub fn ensure(&mut self, desired: &Desired) -> Result<bool, TrafficError> {
        desired.validate()?;
        let mut changed = false;
        for family in Family::ALL {
            let Some(want) = desired.family(family) else {
                continue;
            };
            let tool = self.tool(family)?.clone();
            let masq = if want.masquerade {
                Some(iptables_masq_rules_with(
                    want.network,
                    want.subnet,
                    desired.random_fully && tool.random_fully,
                    &self.masq_options,
                )?)
            } else {
                None
            };
            let forward = want.forward.then(|| iptables_forward_rules(want.network));
            changed |= self.apply(&tool, IptTable::Nat, &ChainTarget::masq(masq.as_deref()))?;
            changed |= self.apply(
                &tool,
                IptTable::Filter,
                &ChainTarget::forward(forward.as_deref()),
            )?;
        }
        Ok(changed)
    }

    /// Removes flannel's chains and jumps of `family` (tables that do not exist are not
    /// created); returns whether anything was removed.
    pub fn remove(&mut self, family: Family) -> Result<bool, TrafficError> {
        let tool = self.tool(family)?.clone();
        remove_with(self.runner.as_ref(), &tool)
    }

    fn apply(
        &self,
        tool: &IptablesTool,
        table: IptTable,
        target: &ChainTarget<'_>,
    ) -> Result<bool, TrafficError> {
        apply_target(self.runner.as_ref(), tool, table, target)
    }
}

/// Reads `table`, applies the plan if any and checks that the result is exact.
fn apply_target(
    runner: &dyn CommandRunner,
    tool: &IptablesTool,
    table: IptTable,
    target: &ChainTarget<'_>,
) -> Result<bool, TrafficError> {
    let state = tool.save(runner, table)?;
    let lines = plan(&state, target);
    if lines.is_empty() {
        return Ok(false);
    }
    tool.restore(runner, table, &lines)?;
    let after = tool.save(runner, table)?;
    let rest = plan(&after, target);
    if !rest.is_empty() {
        return Err(TrafficError::Unconverged {
            what: format!(
                "{} table {} chain {}",
                tool.program,
                table.as_str(),
                target.chain
            ),
            expected: target
                .split()
                .map(|(jump, body)| {
                    std::iter::once(format!("-A {} {jump}", target.hook))
                        .chain(body.iter().map(|r| format!("-A {} {r}", target.chain)))
                        .collect()
                })
                .unwrap_or_default(),
            found: after
                .chain(target.chain)
                .unwrap_or_default()
                .iter()
                .map(|r| format!("-A {} {r}", target.chain))
                .collect(),
        });
    }
    Ok(true)
}

/// Removes flannel's chains and jumps from both tables of `tool`, skipping absent tables.
fn remove_with(runner: &dyn CommandRunner, tool: &IptablesTool) -> Result<bool, TrafficError> {
    let mut changed = false;
    for (table, target) in [
        (IptTable::Nat, ChainTarget::masq(None)),
        (IptTable::Filter, ChainTarget::forward(None)),
    ] {
        if tool.table_exists(runner, table)? {
            changed |= apply_target(runner, tool, table, &target)?;
        }
    }
    Ok(changed)
}

fn is_not_found(err: &TrafficError) -> bool {
    matches!(err, TrafficError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

/// Removes flannel's iptables chains and jumps for `family` from the `backend` (legacy or
/// nf_tables), wherever they are: through the explicit `iptables-legacy` / `iptables-nft`
/// binaries, or the system `iptables` when it drives that backend and the explicit ones are
/// missing. Returns `Ok(false)` when no binary for that backend exists.
///
/// Unlike upstream's cleanup (which targets `FLANNEL-FWD` in the wrong table and cannot delete
/// a chain that is still referenced), this deletes the jumps first, then both chains.
pub fn cleanup_backend(
    runner: &dyn CommandRunner,
    family: Family,
    backend: IptablesBackend,
) -> Result<bool, TrafficError> {
    let explicit = match backend {
        IptablesBackend::Legacy => IptablesVariant::Legacy,
        IptablesBackend::Nft => IptablesVariant::Nft,
    };
    let tool = match IptablesTool::detect(runner, family, explicit) {
        Ok(tool) => tool,
        Err(e) if is_not_found(&e) => {
            match IptablesTool::detect(runner, family, IptablesVariant::System) {
                Ok(tool) if tool.backend == backend => tool,
                Ok(_) => return Ok(false),
                Err(e) if is_not_found(&e) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Err(e) => return Err(e),
    };
    remove_with(runner, &tool)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traffic::{FamilyRules, testing::FakeRunner};

    fn net(s: &str) -> ipnet::IpNet {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    const GOLDEN_NAT: &str = r#"# Generated by iptables-save v1.8.9 (nf_tables) on Sun Nov 29 11:24:48 2026
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-POSTROUTING - [0:0]
:FLANNEL-POSTRTG - [0:0]
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -m comment --comment "flanneld masq" -j FLANNEL-POSTRTG
-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s 10.244.1.0/24 -d 10.244.0.0/16 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.244.1.0/24 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.1.0/24 -m comment --comment "flanneld masq" -j RETURN
-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 224.0.0.0/4 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully
-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.0.0/16 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully
COMMIT
# Completed on Sun Nov 29 11:24:48 2026
"#;

    const EMPTY_FILTER: &str =
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";

    fn masq() -> Vec<IptRule> {
        super::super::rules::iptables_masq_rules(net("10.244.0.0/16"), net("10.244.1.0/24"), true)
            .expect("rules")
    }

    #[test]
    fn version_parsing() {
        assert_eq!(
            parse_version("iptables v1.8.9 (nf_tables)\n"),
            Some(((1, 8, 9), IptablesBackend::Nft))
        );
        assert_eq!(
            parse_version("ip6tables v1.8.7 (legacy)"),
            Some(((1, 8, 7), IptablesBackend::Legacy))
        );
        assert_eq!(
            parse_version("iptables v1.6.1"),
            Some(((1, 6, 1), IptablesBackend::Legacy))
        );
        assert_eq!(parse_version("iptables: command not found"), None);
    }

    #[test]
    fn old_iptables_has_neither_random_fully_nor_wait() {
        let runner = FakeRunner::new();
        runner.expect("iptables --version", "iptables v1.6.1\n");
        let tool =
            IptablesTool::detect(&runner, Family::Ipv4, IptablesVariant::System).expect("detect");
        assert!(!tool.random_fully && !tool.wait);
        runner.expect("ip6tables-nft --version", "ip6tables v1.6.2 (nf_tables)\n");
        let tool =
            IptablesTool::detect(&runner, Family::Ipv6, IptablesVariant::Nft).expect("detect");
        assert!(tool.random_fully && tool.wait);
        assert_eq!(tool.restore_program, "ip6tables-nft-restore");
    }

    #[test]
    fn parse_keeps_order_and_duplicates() {
        let text = "*nat\n:POSTROUTING ACCEPT [0:0]\n:X - [0:0]\n-A X -j RETURN\n-A X -s 1.2.3.4/32 -j RETURN\n-A X -j RETURN\nCOMMIT\n*filter\n:FORWARD ACCEPT [0:0]\n-A FORWARD -j X\nCOMMIT\n";
        let nat = TableState::parse(text, "nat").expect("parse");
        assert_eq!(
            nat.chain("X").expect("X"),
            ["-j RETURN", "-s 1.2.3.4/32 -j RETURN", "-j RETURN"]
        );
        assert_eq!(nat.chain("POSTROUTING"), Some(&[][..]));
        assert_eq!(nat.chain("FORWARD"), None);
        assert!(TableState::parse("*nat\nbogus\nCOMMIT\n", "nat").is_err());
        assert_eq!(
            TableState::parse("", "nat").expect("empty"),
            TableState::default()
        );
    }

    #[test]
    fn words_follow_restore_quoting() {
        assert_eq!(
            split_words(r#"-m comment --comment "flanneld masq" -j X"#),
            ["-m", "comment", "--comment", "flanneld masq", "-j", "X"]
        );
        assert_eq!(
            split_words(r#"--comment "a \"b\"" -j Y"#),
            ["--comment", r#"a "b""#, "-j", "Y"]
        );
    }

    #[test]
    fn exact_state_needs_no_change() {
        let state = TableState::parse(GOLDEN_NAT, "nat").expect("parse");
        let rules = masq();
        assert!(plan(&state, &ChainTarget::masq(Some(&rules))).is_empty());
    }

    #[test]
    fn empty_table_gets_chain_then_jump() {
        let state =
            TableState::parse("*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n", "nat").expect("parse");
        let rules = masq();
        let lines = plan(&state, &ChainTarget::masq(Some(&rules)));
        let mut expected = vec![":FLANNEL-POSTRTG - [0:0]".to_owned()];
        expected.extend(rules[1..].iter().map(IptRule::append_line));
        expected.push(rules[0].append_line());
        assert_eq!(lines, expected);
    }

    #[test]
    fn reordered_or_duplicated_chain_is_rewritten_whole() {
        let rules = masq();
        // Swap two rules.
        let swapped = GOLDEN_NAT.replace(
            "-A FLANNEL-POSTRTG -s 10.244.1.0/24 -d 10.244.0.0/16 -m comment --comment \"flanneld masq\" -j RETURN\n-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.244.1.0/24 -m comment --comment \"flanneld masq\" -j RETURN\n",
            "-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.244.1.0/24 -m comment --comment \"flanneld masq\" -j RETURN\n-A FLANNEL-POSTRTG -s 10.244.1.0/24 -d 10.244.0.0/16 -m comment --comment \"flanneld masq\" -j RETURN\n",
        );
        assert_ne!(swapped, GOLDEN_NAT);
        // Duplicate the last rule.
        let last = rules[6].append_line();
        let duplicated = GOLDEN_NAT.replace("COMMIT", &format!("{last}\nCOMMIT"));
        for text in [swapped, duplicated] {
            let state = TableState::parse(&text, "nat").expect("parse");
            let lines = plan(&state, &ChainTarget::masq(Some(&rules)));
            let mut expected = vec![":FLANNEL-POSTRTG - [0:0]".to_owned()];
            expected.extend(rules[1..].iter().map(IptRule::append_line));
            assert_eq!(
                lines, expected,
                "jump is fine, so only the chain is rewritten"
            );
        }
    }

    #[test]
    fn duplicate_and_stale_jumps_are_deleted_foreign_rules_kept() {
        let rules = masq();
        let text = GOLDEN_NAT.replace(
            ":KUBE-POSTROUTING - [0:0]\n",
            ":KUBE-POSTROUTING - [0:0]\n-A POSTROUTING -j FLANNEL-POSTRTG\n-A POSTROUTING -m comment --comment \"flanneld masq\" -j FLANNEL-POSTRTG\n-A POSTROUTING -s 10.244.0.0/16 -d 10.244.0.0/16 -m comment --comment \"flanneld masq\" -j RETURN\n-A POSTROUTING -s 10.9.0.0/16 -j MASQUERADE\n",
        );
        let state = TableState::parse(&text, "nat").expect("parse");
        let lines = plan(&state, &ChainTarget::masq(Some(&rules)));
        assert_eq!(
            lines,
            [
                "-D POSTROUTING -j FLANNEL-POSTRTG",
                "-D POSTROUTING -s 10.244.0.0/16 -d 10.244.0.0/16 -m comment --comment \"flanneld masq\" -j RETURN",
                "-D POSTROUTING -m comment --comment \"flanneld masq\" -j FLANNEL-POSTRTG",
            ]
        );
    }

    #[test]
    fn removal_deletes_jumps_then_chain() {
        let state = TableState::parse(GOLDEN_NAT, "nat").expect("parse");
        let lines = plan(&state, &ChainTarget::masq(None));
        assert_eq!(
            lines,
            [
                "-D POSTROUTING -m comment --comment \"flanneld masq\" -j FLANNEL-POSTRTG",
                "-F FLANNEL-POSTRTG",
                "-X FLANNEL-POSTRTG",
            ]
        );
        let empty = TableState::parse(EMPTY_FILTER, "filter").expect("parse");
        assert!(plan(&empty, &ChainTarget::forward(None)).is_empty());
    }

    fn desired() -> Desired {
        Desired {
            ipv4: Some(FamilyRules {
                network: net("10.244.0.0/16"),
                subnet: net("10.244.1.0/24"),
                masquerade: true,
                forward: true,
            }),
            ipv6: None,
            random_fully: true,
        }
    }

    fn filter_golden() -> String {
        let mut s = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:FLANNEL-FWD - [0:0]\n".to_owned();
        for r in iptables_forward_rules(net("10.244.0.0/16")) {
            s.push_str(&r.append_line());
            s.push('\n');
        }
        s.push_str("COMMIT\n");
        s
    }

    #[test]
    fn ensure_on_exact_state_issues_no_restore() {
        let runner = Arc::new(FakeRunner::new());
        runner.expect("iptables --version", "iptables v1.8.9 (nf_tables)\n");
        runner.expect("iptables-save -t nat", GOLDEN_NAT);
        runner.expect("iptables-save -t filter", &filter_golden());
        let mut m = IptablesManager::new(runner.clone(), IptablesVariant::System);
        assert!(!m.ensure(&desired()).expect("ensure"));
        assert!(runner.calls_of("iptables-restore").is_empty());
        assert!(runner.calls_of("ip6tables").is_empty(), "IPv4-only node");
    }

    #[test]
    fn ensure_repairs_with_one_restore_per_table() {
        let runner = Arc::new(FakeRunner::new());
        runner.expect("iptables --version", "iptables v1.8.9 (legacy)\n");
        // First read: a rule is missing; second read (after restore): golden.
        runner.expect_seq(
            "iptables-save -t nat",
            &[
                &GOLDEN_NAT.replace(
                    "-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 -m comment --comment \"flanneld masq\" -j RETURN\n",
                    "",
                ),
                GOLDEN_NAT,
            ],
        );
        runner.expect_seq("iptables-save -t filter", &[EMPTY_FILTER, &filter_golden()]);
        runner.expect("iptables-restore --noflush --wait", "");
        let mut m = IptablesManager::new(runner.clone(), IptablesVariant::System);
        assert!(m.ensure(&desired()).expect("ensure"));
        let restores = runner.calls_of("iptables-restore");
        assert_eq!(restores.len(), 2, "{restores:?}");
        let mut nat = "*nat\n:FLANNEL-POSTRTG - [0:0]\n".to_owned();
        for r in &masq()[1..] {
            nat.push_str(&r.append_line());
            nat.push('\n');
        }
        nat.push_str("COMMIT\n");
        assert_eq!(restores[0].1.as_deref(), Some(nat.as_str()));
        let filter = restores[1].1.as_deref().unwrap_or_default();
        assert!(
            filter.starts_with("*filter\n:FLANNEL-FWD - [0:0]\n"),
            "{filter}"
        );
        assert!(
            filter.ends_with(
                "-A FORWARD -m comment --comment \"flanneld forward\" -j FLANNEL-FWD\nCOMMIT\n"
            ),
            "{filter}"
        );
    }

    #[test]
    fn unconverged_state_is_an_error_not_a_loop() {
        let runner = Arc::new(FakeRunner::new());
        runner.expect("iptables --version", "iptables v1.8.9 (legacy)\n");
        runner.expect(
            "iptables-save -t nat",
            "*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n",
        );
        runner.expect("iptables-restore --noflush --wait", "");
        let mut m = IptablesManager::new(runner.clone(), IptablesVariant::System);
        let err = m.ensure(&desired()).expect_err("never converges");
        assert!(matches!(err, TrafficError::Unconverged { .. }), "{err}");
    }

    #[test]
    fn random_fully_is_dropped_when_unsupported() {
        let runner = Arc::new(FakeRunner::new());
        runner.expect("iptables-legacy --version", "iptables v1.6.1\n");
        let no_rf = GOLDEN_NAT.replace(" --random-fully", "");
        runner.expect("iptables-legacy-save -t nat", &no_rf);
        runner.expect("iptables-legacy-save -t filter", &filter_golden());
        let mut m = IptablesManager::new(runner.clone(), IptablesVariant::Legacy);
        assert!(!m.ensure(&desired()).expect("ensure"));
    }

    #[test]
    fn cleanup_skips_missing_binaries_and_absent_legacy_tables() {
        let runner = FakeRunner::new();
        // No iptables-nft and a legacy system iptables: nothing to clean for nf_tables.
        runner.expect("iptables --version", "iptables v1.8.9 (legacy)\n");
        assert!(!cleanup_backend(&runner, Family::Ipv4, IptablesBackend::Nft).expect("cleanup"));
        // Legacy binary present but no legacy tables loaded: nothing is read (no autoload).
        runner.expect("iptables-legacy --version", "iptables v1.8.9 (legacy)\n");
        runner.file("/proc/net/ip_tables_names", "mangle\n");
        assert!(!cleanup_backend(&runner, Family::Ipv4, IptablesBackend::Legacy).expect("cleanup"));
        assert!(runner.calls_of("iptables-legacy-save").is_empty());
    }
}
