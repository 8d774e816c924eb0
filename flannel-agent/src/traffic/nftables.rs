//! flannel's rules through nftables (`EnableNFTables: true`): tables `ip flannel-ipv4` and
//! `ip6 flannel-ipv6`, base chains `postrtg` (nat, postrouting, srcnat) and `forward` (filter,
//! forward, filter), upstream's exact rules.
//!
//! State is read with `nft -j list tables` and `nft -j list table <family> <name>` and parsed
//! into [`NftExpr`] statements, so the comparison is semantic (it does not depend on how a
//! given nft version prints numbers or flags) and exact (order, duplicates, any extra
//! statement such as a counter). A repair is one `nft -f -` transaction for everything:
//!
//! ```text
//! add table ip flannel-ipv4 { comment "rules for flannel-ipv4" ; }      (only if missing)
//! add chain ip flannel-ipv4 postrtg { comment "…" ; type nat hook postrouting priority srcnat ; policy accept ; }
//! flush chain ip flannel-ipv4 postrtg
//! add rule ip flannel-ipv4 postrtg meta mark 0x4000 return
//! …
//! ```
//!
//! The kernel applies the batch atomically, so the chain is never seen empty. A chain whose
//! type, hook, priority or policy differs is deleted and re-added in the same transaction.
//! Chain and table comments are compared when the nft version reports them in JSON (1.0.6
//! does not); other chains in our tables are left alone. Unlike upstream, the rules are
//! checked and repaired on every [`NftablesManager::ensure`] (upstream has no resync here).

use std::{collections::BTreeMap, sync::Arc};

use ipnet::IpNet;
use serde_json::Value;

use super::{
    Desired, TrafficError,
    rules::{
        AddrField, Family, KUBE_PROXY_MARK, MasqOptions, NFT_FORWARD_CHAIN, NFT_MASQ_CHAIN,
        NftChain, NftExpr, NftRule, nft_forward_chain, nft_icmp_type_name, nft_masq_chain_with,
        nft_proto_name,
    },
    runner::{CommandRunner, command_line, run_ok},
};

/// The nft binary.
pub const NFT: &str = "nft";

/// A base chain as `nft -j` reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NftChainState {
    /// `nat`, `filter`, ... (`None` for a regular chain).
    pub kind: Option<String>,
    /// The hook, if any.
    pub hook: Option<String>,
    /// Numeric priority, if any.
    pub priority: Option<i64>,
    /// `accept` / `drop`, if any.
    pub policy: Option<String>,
    /// The comment, when the nft version reports it.
    pub comment: Option<String>,
    /// Rules in order; `None` for a rule with a statement outside flannel's vocabulary.
    pub rules: Vec<Option<NftRule>>,
}

impl NftChainState {
    /// Whether type, hook, priority, policy (and the comment, if known) are those of `want`.
    pub fn definition_matches(&self, want: &NftChain) -> bool {
        self.kind.as_deref() == Some(want.kind)
            && self.hook.as_deref() == Some(want.hook)
            && self.priority == Some(i64::from(want.priority))
            && self.policy.as_deref().unwrap_or("accept") == "accept"
            && self.comment.as_deref().is_none_or(|c| c == want.comment)
    }

    /// Whether the rules are exactly `want`'s.
    pub fn rules_match(&self, want: &NftChain) -> bool {
        self.rules.len() == want.rules.len()
            && self
                .rules
                .iter()
                .zip(&want.rules)
                .all(|(have, want)| have.as_ref() == Some(want))
    }
}

/// The chains of one of our tables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NftTableState {
    /// Chains by name.
    pub chains: BTreeMap<String, NftChainState>,
}

fn parse_err(command: &str, detail: impl Into<String>) -> TrafficError {
    TrafficError::Parse {
        command: command.to_owned(),
        detail: detail.into(),
    }
}

/// The `nftables` array of `nft -j` output.
fn objects<'a>(json: &'a Value, command: &str) -> Result<&'a Vec<Value>, TrafficError> {
    json.get("nftables")
        .and_then(Value::as_array)
        .ok_or_else(|| parse_err(command, "no \"nftables\" array"))
}

/// Parses `nft -j list tables` into (family, name) pairs.
pub fn parse_tables(output: &str) -> Result<Vec<(String, String)>, TrafficError> {
    let command = "nft -j list tables";
    let json: Value =
        serde_json::from_str(output).map_err(|e| parse_err(command, e.to_string()))?;
    Ok(objects(&json, command)?
        .iter()
        .filter_map(|o| o.get("table"))
        .filter_map(|t| {
            Some((
                t.get("family")?.as_str()?.to_owned(),
                t.get("name")?.as_str()?.to_owned(),
            ))
        })
        .collect())
}

/// Parses `nft -j list table <family> <name>`.
pub fn parse_table(output: &str, family: Family) -> Result<NftTableState, TrafficError> {
    let command = format!(
        "nft -j list table {} {}",
        family.nft_family(),
        family.nft_table()
    );
    let json: Value =
        serde_json::from_str(output).map_err(|e| parse_err(&command, e.to_string()))?;
    let mut state = NftTableState::default();
    let str_of = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    for object in objects(&json, &command)? {
        if let Some(chain) = object.get("chain") {
            let name =
                str_of(chain, "name").ok_or_else(|| parse_err(&command, "chain without name"))?;
            let entry = state.chains.entry(name).or_default();
            entry.kind = str_of(chain, "type");
            entry.hook = str_of(chain, "hook");
            entry.priority = chain.get("prio").and_then(Value::as_i64);
            entry.policy = str_of(chain, "policy");
            entry.comment = str_of(chain, "comment");
        } else if let Some(rule) = object.get("rule") {
            let name =
                str_of(rule, "chain").ok_or_else(|| parse_err(&command, "rule without chain"))?;
            let parsed = rule
                .get("expr")
                .and_then(Value::as_array)
                .and_then(|exprs| parse_rule(exprs, family));
            state.chains.entry(name).or_default().rules.push(parsed);
        }
    }
    Ok(state)
}

/// A rule's `expr` array in flannel's vocabulary, `None` if anything else appears.
pub fn parse_rule(exprs: &[Value], family: Family) -> Option<NftRule> {
    exprs
        .iter()
        .map(|e| parse_expr(e, family))
        .collect::<Option<Vec<_>>>()
        .map(NftRule)
}

fn parse_expr(expr: &Value, family: Family) -> Option<NftExpr> {
    let obj = expr.as_object()?;
    if obj.len() != 1 {
        return None;
    }
    let (key, body) = obj.iter().next()?;
    match key.as_str() {
        "return" => Some(NftExpr::Return),
        "accept" => Some(NftExpr::Accept),
        "masquerade" => {
            let flags: Vec<&str> = match body.get("flags") {
                None => Vec::new(),
                Some(Value::String(s)) => vec![s.as_str()],
                Some(Value::Array(a)) => a.iter().map(Value::as_str).collect::<Option<_>>()?,
                Some(_) => return None,
            };
            if body.is_object()
                && body
                    .as_object()
                    .is_some_and(|o| o.keys().any(|k| k != "flags"))
            {
                return None;
            }
            match flags.as_slice() {
                [] => Some(NftExpr::Masquerade {
                    fully_random: false,
                }),
                ["fully-random"] => Some(NftExpr::Masquerade { fully_random: true }),
                _ => None,
            }
        }
        "match" => parse_match(body, family),
        _ => None,
    }
}

fn parse_match(body: &Value, family: Family) -> Option<NftExpr> {
    let negated = match body.get("op")?.as_str()? {
        "==" => false,
        "!=" => true,
        _ => return None,
    };
    let left = body.get("left")?;
    let right = body.get("right")?;
    if let Some(meta) = left.get("meta") {
        if negated {
            return None;
        }
        return match meta.get("key")?.as_str()? {
            "mark" => {
                let mark = match right {
                    Value::Number(n) => u32::try_from(n.as_u64()?).ok()?,
                    Value::String(s) => u32::from_str_radix(s.strip_prefix("0x")?, 16).ok()?,
                    _ => return None,
                };
                Some(NftExpr::MetaMark(mark))
            }
            "oifname" => Some(NftExpr::OifName(right.as_str()?.to_owned())),
            "l4proto" => Some(NftExpr::L4Proto(match right {
                Value::Number(n) => u8::try_from(n.as_u64()?).ok()?,
                Value::String(s) => (0..=255u8).find(|p| nft_proto_name(*p) == Some(s))?,
                _ => return None,
            })),
            _ => None,
        };
    }
    let payload = left.get("payload")?;
    if payload.get("protocol")?.as_str()? == "icmp"
        && payload.get("field")?.as_str()? == "type"
        && !negated
        && family == Family::Ipv4
    {
        return Some(NftExpr::IcmpType(match right {
            Value::Number(n) => u8::try_from(n.as_u64()?).ok()?,
            Value::String(s) => (0..=255u8).find(|t| nft_icmp_type_name(*t) == Some(s))?,
            _ => return None,
        }));
    }
    if payload.get("protocol")?.as_str()? != family.nft_family() {
        return None;
    }
    let field = match payload.get("field")?.as_str()? {
        "saddr" => AddrField::Saddr,
        "daddr" => AddrField::Daddr,
        _ => return None,
    };
    let prefix: IpNet = match right {
        Value::String(addr) => addr.parse::<std::net::IpAddr>().ok()?.into(),
        Value::Object(_) => {
            let p = right.get("prefix")?;
            let addr: std::net::IpAddr = p.get("addr")?.as_str()?.parse().ok()?;
            let len = u8::try_from(p.get("len")?.as_u64()?).ok()?;
            IpNet::new(addr, len).ok()?
        }
        _ => return None,
    };
    if Family::of(&prefix) != family {
        return None;
    }
    Some(NftExpr::Addr {
        field,
        negated,
        prefix,
    })
}

/// Manages flannel's nftables tables.
#[derive(Debug)]
pub struct NftablesManager {
    runner: Arc<dyn CommandRunner>,
    fully_random: Option<bool>,
    masq_options: MasqOptions,
}

impl NftablesManager {
    /// A manager running `nft` through `runner`.
    pub fn new(runner: Arc<dyn CommandRunner>) -> Self {
        NftablesManager {
            runner,
            fully_random: None,
            masq_options: MasqOptions::default(),
        }
    }

    /// Sets what the masquerade chain adds to upstream's rules (see
    /// [`super::rules::nft_masq_chain_with`]); applied by the next [`Self::ensure`].
    pub fn set_masq_options(&mut self, options: MasqOptions) {
        self.masq_options = options;
    }

    /// The runner the commands go through.
    pub fn runner(&self) -> Arc<dyn CommandRunner> {
        self.runner.clone()
    }

    /// Whether `masquerade fully-random` is accepted, checked once like upstream: a dry run
    /// (`nft --check`, nothing is committed) of a test chain `masqueradeTest`.
    pub fn supports_fully_random(&mut self) -> Result<bool, TrafficError> {
        if let Some(v) = self.fully_random {
            return Ok(v);
        }
        let payload = format!(
            "add table ip {t}\nadd chain ip {t} masqueradeTest {{ type nat hook postrouting priority srcnat ; }}\nadd rule ip {t} masqueradeTest masquerade fully-random\n",
            t = Family::Ipv4.nft_table()
        );
        let supported = match run_ok(
            self.runner.as_ref(),
            NFT,
            &["--check", "-f", "-"],
            Some(payload.as_bytes()),
        ) {
            Ok(_) => true,
            Err(TrafficError::Command { stderr, .. }) => {
                tracing::info!(%stderr, "nftables: masquerade fully-random is not supported");
                false
            }
            Err(e) => return Err(e),
        };
        self.fully_random = Some(supported);
        Ok(supported)
    }

    fn list_tables(&self) -> Result<Vec<(String, String)>, TrafficError> {
        parse_tables(&run_ok(
            self.runner.as_ref(),
            NFT,
            &["-j", "list", "tables"],
            None,
        )?)
    }

    /// Our table of `family`, `None` if it does not exist.
    pub fn read_table(&self, family: Family) -> Result<Option<NftTableState>, TrafficError> {
        let tables = self.list_tables()?;
        self.read_table_in(&tables, family)
    }

    fn read_table_in(
        &self,
        tables: &[(String, String)],
        family: Family,
    ) -> Result<Option<NftTableState>, TrafficError> {
        let present = tables
            .iter()
            .any(|(f, n)| f == family.nft_family() && n == family.nft_table());
        if !present {
            return Ok(None);
        }
        let out = run_ok(
            self.runner.as_ref(),
            NFT,
            &[
                "-j",
                "list",
                "table",
                family.nft_family(),
                family.nft_table(),
            ],
            None,
        )?;
        parse_table(&out, family).map(Some)
    }

    /// The transaction that brings the current state to `desired`; empty when exact.
    fn plan(&mut self, desired: &Desired) -> Result<Vec<String>, TrafficError> {
        desired.validate()?;
        let fully_random = desired.random_fully && self.supports_fully_random()?;
        let tables = self.list_tables()?;
        let mut lines = Vec::new();
        for family in Family::ALL {
            let (fam, table) = (family.nft_family(), family.nft_table());
            let state = self.read_table_in(&tables, family)?;
            if state.is_none() {
                // Upstream creates both tables whatever families are enabled.
                lines.push(format!(
                    "add table {fam} {table} {{ comment \"{}\" ; }}",
                    family.nft_table_comment()
                ));
            }
            let Some(want) = desired.family(family) else {
                continue;
            };
            let masq = if want.masquerade {
                Some(nft_masq_chain_with(
                    want.network,
                    want.subnet,
                    fully_random,
                    &self.masq_options,
                )?)
            } else {
                None
            };
            let forward = want.forward.then(|| nft_forward_chain(want.network));
            let state = state.unwrap_or_default();
            for (name, chain) in [(NFT_MASQ_CHAIN, masq), (NFT_FORWARD_CHAIN, forward)] {
                chain_lines(
                    &mut lines,
                    family,
                    name,
                    chain.as_ref(),
                    state.chains.get(name),
                );
            }
        }
        Ok(lines)
    }

    /// Brings every family in `desired` to the exact desired chains in one transaction and
    /// returns whether anything was written. Families absent from `desired` only get their
    /// (empty) table; their chains are not touched (see [`Self::remove`]). A present family
    /// whose masquerade or forward part is off has that chain deleted.
    pub fn ensure(&mut self, desired: &Desired) -> Result<bool, TrafficError> {
        let lines = self.plan(desired)?;
        if lines.is_empty() {
            return Ok(false);
        }
        self.apply(&lines)?;
        let rest = self.plan(desired)?;
        if !rest.is_empty() {
            return Err(TrafficError::Unconverged {
                what: "nftables flannel tables".to_owned(),
                expected: lines,
                found: rest,
            });
        }
        Ok(true)
    }

    /// Deletes our chains of `family` (the table stays, as upstream creates it anyway);
    /// returns whether anything was deleted.
    pub fn remove(&mut self, family: Family) -> Result<bool, TrafficError> {
        let Some(state) = self.read_table(family)? else {
            return Ok(false);
        };
        let mut lines = Vec::new();
        for name in [NFT_MASQ_CHAIN, NFT_FORWARD_CHAIN] {
            chain_lines(&mut lines, family, name, None, state.chains.get(name));
        }
        if lines.is_empty() {
            return Ok(false);
        }
        self.apply(&lines)?;
        Ok(true)
    }

    fn apply(&self, lines: &[String]) -> Result<(), TrafficError> {
        let mut payload = lines.join("\n");
        payload.push('\n');
        tracing::debug!(%payload, "nft -f -");
        run_ok(
            self.runner.as_ref(),
            NFT,
            &["-f", "-"],
            Some(payload.as_bytes()),
        )
        .map(drop)
    }
}

/// Appends the statements that turn `have` into `want` for chain `name` of `family`'s table.
fn chain_lines(
    lines: &mut Vec<String>,
    family: Family,
    name: &str,
    want: Option<&NftChain>,
    have: Option<&NftChainState>,
) {
    let (fam, table) = (family.nft_family(), family.nft_table());
    match (want, have) {
        (Some(want), Some(have)) if have.definition_matches(want) && have.rules_match(want) => {}
        (Some(want), have) => {
            match have {
                Some(have) if have.definition_matches(want) => {
                    lines.push(format!("flush chain {fam} {table} {name}"));
                }
                Some(_) => {
                    lines.push(format!("delete chain {fam} {table} {name}"));
                    lines.push(format!(
                        "add chain {fam} {table} {name} {}",
                        want.definition()
                    ));
                }
                None => {
                    lines.push(format!(
                        "add chain {fam} {table} {name} {}",
                        want.definition()
                    ));
                }
            }
            for rule in &want.rules {
                lines.push(format!("add rule {fam} {table} {name} {rule}"));
            }
        }
        (None, Some(_)) => lines.push(format!("delete chain {fam} {table} {name}")),
        (None, None) => {}
    }
}

/// Deletes flannel's nftables tables (`ip flannel-ipv4`, `ip6 flannel-ipv6`) if present, in
/// one transaction; returns whether anything was deleted. Returns `Ok(false)` when `nft` is
/// not installed (then there can be no tables we made).
pub fn cleanup_nftables(runner: &dyn CommandRunner) -> Result<bool, TrafficError> {
    let out = match run_ok(runner, NFT, &["-j", "list", "tables"], None) {
        Ok(out) => out,
        Err(TrafficError::Spawn { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            return Ok(false);
        }
        Err(e) => return Err(e),
    };
    let tables = parse_tables(&out)?;
    let mut lines = Vec::new();
    for family in Family::ALL {
        if tables
            .iter()
            .any(|(f, n)| f == family.nft_family() && n == family.nft_table())
        {
            lines.push(format!(
                "delete table {} {}",
                family.nft_family(),
                family.nft_table()
            ));
        }
    }
    if lines.is_empty() {
        return Ok(false);
    }
    let payload = lines.join("\n") + "\n";
    run_ok(runner, NFT, &["-f", "-"], Some(payload.as_bytes()))?;
    tracing::debug!(cmd = %command_line(NFT, &["-f", "-"]), %payload, "deleted flannel nftables tables");
    Ok(true)
}

/// Keeps the mark constant in the rule vocabulary honest: upstream matches `meta mark 0x4000`.
const _: () = assert!(KUBE_PROXY_MARK == 0x4000);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traffic::{FamilyRules, testing::FakeRunner};

    fn net(s: &str) -> IpNet {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    /// What nft 1.0.6 prints for upstream's ipv4 table (10.244.0.0/16, 10.244.1.0/24).
    const TABLE_V4: &str = r#"{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}, {"table": {"family": "ip", "name": "flannel-ipv4", "handle": 1}}, {"chain": {"family": "ip", "table": "flannel-ipv4", "name": "postrtg", "handle": 1, "type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"}}, {"chain": {"family": "ip", "table": "flannel-ipv4", "name": "forward", "handle": 8, "type": "filter", "hook": "forward", "prio": 0, "policy": "accept"}}, {"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "postrtg", "handle": 2, "expr": [{"match": {"op": "==", "left": {"meta": {"key": "mark"}}, "right": 16384}}, {"return": null}]}}, {"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "postrtg", "handle": 3, "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "10.244.1.0", "len": 24}}}}, {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}}, {"return": null}]}}, {"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "postrtg", "handle": 4, "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}}, {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": {"prefix": {"addr": "10.244.1.0", "len": 24}}}}, {"return": null}]}}, {"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "postrtg", "handle": 5, "expr": [{"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "10.244.1.0", "len": 24}}}}, {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}}, {"return": null}]}}, {"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "postrtg", "handle": 6, "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}}, {"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": {"prefix": {"addr": "224.0.0.0", "len": 4}}}}, {"masquerade": {"flags": "fully-random"}}]}}, {"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "postrtg", "handle": 7, "expr": [{"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}}, {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}}, {"masquerade": {"flags": "fully-random"}}]}}, {"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "forward", "handle": 9, "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}}, {"accept": null}]}}, {"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "forward", "handle": 10, "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}}, {"accept": null}]}}]}"#;
    const TABLE_V6_EMPTY: &str = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"table": {"family": "ip6", "name": "flannel-ipv6", "handle": 2}}]}"#;
    const TABLES: &str = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"table": {"family": "ip", "name": "nat", "handle": 3}}, {"table": {"family": "ip", "name": "flannel-ipv4", "handle": 1}}, {"table": {"family": "ip6", "name": "flannel-ipv6", "handle": 2}}]}"#;

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

    fn runner_with(table_v4: &str) -> Arc<FakeRunner> {
        let runner = Arc::new(FakeRunner::new());
        runner.expect("nft --check -f -", "");
        runner.expect("nft -j list tables", TABLES);
        runner.expect("nft -j list table ip flannel-ipv4", table_v4);
        runner.expect("nft -j list table ip6 flannel-ipv6", TABLE_V6_EMPTY);
        runner
    }

    #[test]
    fn parsed_upstream_table_equals_generated_chains() {
        let state = parse_table(TABLE_V4, Family::Ipv4).expect("parse");
        let masq =
            super::super::rules::nft_masq_chain(net("10.244.0.0/16"), net("10.244.1.0/24"), true)
                .expect("chain");
        let have = state.chains.get("postrtg").expect("postrtg");
        assert!(
            have.definition_matches(&masq) && have.rules_match(&masq),
            "{have:?}"
        );
        let fwd = nft_forward_chain(net("10.244.0.0/16"));
        let have = state.chains.get("forward").expect("forward");
        assert!(have.definition_matches(&fwd) && have.rules_match(&fwd));
        let no_rf =
            super::super::rules::nft_masq_chain(net("10.244.0.0/16"), net("10.244.1.0/24"), false)
                .expect("chain");
        assert!(!state.chains["postrtg"].rules_match(&no_rf));
    }

    /// `nft -j` (1.0.6) output for the eBPF masquerade RETURN rules, as this machine prints
    /// them: `oifname`, `meta l4proto` and `icmp type` parse back to the generated rules.
    #[test]
    fn ebpf_return_rules_parse_back() {
        let rules: Value = serde_json::from_str(
            r#"[
            [{"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "eth0"}},
             {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}},
             {"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}},
             {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}},
             {"return": null}],
            [{"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "eth0"}},
             {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}},
             {"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": {"prefix": {"addr": "10.244.0.0", "len": 16}}}},
             {"match": {"op": "==", "left": {"payload": {"protocol": "icmp", "field": "type"}}, "right": "echo-request"}},
             {"return": null}]
            ]"#,
        )
        .expect("json");
        let options = MasqOptions {
            ebpf_out_iface: Some("eth0".into()),
            exclude: Vec::new(),
        };
        let chain = nft_masq_chain_with(net("10.244.0.0/16"), net("10.244.1.0/24"), true, &options)
            .expect("chain");
        let parsed: Vec<NftRule> = rules
            .as_array()
            .expect("rules")
            .iter()
            .map(|r| parse_rule(r.as_array().expect("exprs"), Family::Ipv4).expect("known"))
            .collect();
        assert_eq!(parsed[0], chain.rules[4]);
        assert_eq!(parsed[1], chain.rules[6]);
        // Another interface or protocol is another rule.
        assert_ne!(parsed[0], chain.rules[5]);
    }

    #[test]
    fn exprs_outside_the_vocabulary_are_foreign() {
        let counter: Value =
            serde_json::from_str(r#"[{"counter": {"packets": 0, "bytes": 0}}, {"return": null}]"#)
                .expect("json");
        assert_eq!(
            parse_rule(counter.as_array().expect("array"), Family::Ipv4),
            None
        );
        let wrong_family: Value = serde_json::from_str(
            r#"[{"match": {"op": "==", "left": {"payload": {"protocol": "ip6", "field": "saddr"}}, "right": "fd00::1"}}, {"accept": null}]"#,
        )
        .expect("json");
        assert_eq!(
            parse_rule(wrong_family.as_array().expect("array"), Family::Ipv4),
            None
        );
        let plain_addr_and_flag_list: Value = serde_json::from_str(
            r#"[{"match": {"op": "==", "left": {"payload": {"protocol": "ip6", "field": "daddr"}}, "right": "fd00::1"}}, {"masquerade": {"flags": ["fully-random"]}}]"#,
        )
        .expect("json");
        assert_eq!(
            parse_rule(
                plain_addr_and_flag_list.as_array().expect("array"),
                Family::Ipv6
            ),
            Some(NftRule(vec![
                NftExpr::Addr {
                    field: AddrField::Daddr,
                    negated: false,
                    prefix: net("fd00::1/128"),
                },
                NftExpr::Masquerade { fully_random: true },
            ]))
        );
    }

    #[test]
    fn exact_state_needs_no_transaction() {
        let runner = runner_with(TABLE_V4);
        let mut m = NftablesManager::new(runner.clone());
        assert!(!m.ensure(&desired()).expect("ensure"));
        assert!(runner.calls_of("nft -f").is_empty());
    }

    #[test]
    fn missing_rule_flushes_and_refills_in_one_transaction() {
        // Drop the first postrtg rule (handle 2).
        let start = TABLE_V4.find(r#"{"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "postrtg", "handle": 2"#).expect("rule 2");
        let end = TABLE_V4.find(r#"{"rule": {"family": "ip", "table": "flannel-ipv4", "chain": "postrtg", "handle": 3"#).expect("rule 3");
        let broken = format!("{}{}", &TABLE_V4[..start], &TABLE_V4[end..]);
        let runner = runner_with(TABLE_V4);
        runner.expect_seq("nft -j list table ip flannel-ipv4", &[&broken, TABLE_V4]);
        runner.expect("nft -f -", "");
        let mut m = NftablesManager::new(runner.clone());
        assert!(m.ensure(&desired()).expect("ensure"));
        let calls = runner.calls_of("nft -f -");
        assert_eq!(calls.len(), 1);
        assert_eq!(
            calls[0].1.as_deref(),
            Some(
                "flush chain ip flannel-ipv4 postrtg\n\
                 add rule ip flannel-ipv4 postrtg meta mark 0x4000 return\n\
                 add rule ip flannel-ipv4 postrtg ip saddr 10.244.1.0/24 ip daddr 10.244.0.0/16 return\n\
                 add rule ip flannel-ipv4 postrtg ip saddr 10.244.0.0/16 ip daddr 10.244.1.0/24 return\n\
                 add rule ip flannel-ipv4 postrtg ip saddr != 10.244.1.0/24 ip daddr 10.244.0.0/16 return\n\
                 add rule ip flannel-ipv4 postrtg ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade fully-random\n\
                 add rule ip flannel-ipv4 postrtg ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade fully-random\n"
            )
        );
    }

    #[test]
    fn fresh_system_gets_tables_chains_and_rules() {
        let runner = Arc::new(FakeRunner::new());
        runner.expect_fail("nft --check -f -", "Error: syntax error");
        runner.expect_seq(
            "nft -j list tables",
            &[r#"{"nftables": [{"metainfo": {}}]}"#, TABLES],
        );
        runner.expect("nft -j list table ip6 flannel-ipv6", TABLE_V6_EMPTY);
        let no_rf = TABLE_V4.replace(r#"{"flags": "fully-random"}"#, "null");
        runner.expect("nft -j list table ip flannel-ipv4", &no_rf);
        runner.expect("nft -f -", "");
        let mut m = NftablesManager::new(runner.clone());
        assert!(m.ensure(&desired()).expect("ensure"));
        let payload = runner.calls_of("nft -f -")[0].1.clone().unwrap_or_default();
        let lines: Vec<&str> = payload.lines().collect();
        assert_eq!(
            lines[0],
            r#"add table ip flannel-ipv4 { comment "rules for flannel-ipv4" ; }"#
        );
        assert_eq!(
            lines[1],
            r#"add chain ip flannel-ipv4 postrtg { comment "chain to manage traffic masquerading by flannel" ; type nat hook postrouting priority srcnat ; policy accept ; }"#
        );
        assert!(
            lines
                .iter()
                .any(|l| l.ends_with("ip daddr 10.244.0.0/16 masquerade"))
        );
        assert!(
            !payload.contains("fully-random"),
            "probe failed, so no fully-random"
        );
        assert_eq!(
            lines.last().copied(),
            Some(r#"add table ip6 flannel-ipv6 { comment "rules for flannel-ipv6" ; }"#)
        );
        assert_eq!(runner.calls_of("nft --check").len(), 1);
    }

    #[test]
    fn wrong_definition_is_replaced_and_disabled_part_deleted() {
        let tampered = TABLE_V4.replace(
            r#""prio": 100, "policy": "accept""#,
            r#""prio": 100, "policy": "drop""#,
        );
        let runner = runner_with(&tampered);
        runner.expect("nft -f -", "");
        let mut want = desired();
        if let Some(v4) = want.ipv4.as_mut() {
            v4.forward = false;
        }
        let mut m = NftablesManager::new(runner.clone());
        // The fake keeps answering the tampered table, so the check afterwards fails.
        let err = m.ensure(&want).expect_err("fake never converges");
        assert!(matches!(err, TrafficError::Unconverged { .. }));
        let payload = runner.calls_of("nft -f -")[0].1.clone().unwrap_or_default();
        let lines: Vec<&str> = payload.lines().collect();
        assert_eq!(lines[0], "delete chain ip flannel-ipv4 postrtg");
        assert!(lines[1].starts_with("add chain ip flannel-ipv4 postrtg {"));
        assert_eq!(
            lines.last().copied(),
            Some("delete chain ip flannel-ipv4 forward")
        );
    }

    #[test]
    fn cleanup_deletes_only_our_tables() {
        let runner = FakeRunner::new();
        runner.expect("nft -j list tables", TABLES);
        runner.expect("nft -f -", "");
        assert!(cleanup_nftables(&runner).expect("cleanup"));
        assert_eq!(
            runner.calls_of("nft -f -")[0].1.as_deref(),
            Some("delete table ip flannel-ipv4\ndelete table ip6 flannel-ipv6\n")
        );
        let none = FakeRunner::new();
        assert!(!cleanup_nftables(&none).expect("nft missing"));
    }
}
