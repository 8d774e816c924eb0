//! Pure generation of flannel's masquerade and forward rules, exactly as upstream writes them.
//!
//! Nothing here touches the system. The iptables rules render to the text `iptables-save`
//! prints (so they compare line by line with the kernel's state and feed `iptables-restore`
//! unchanged); the nftables rules render to `nft` syntax and compare with `nft -j` listings
//! through [`NftExpr`].
//!
//! Inputs: `N` is the cluster Network (`10.244.0.0/16`), `P` the node's lease subnet
//! (`10.244.1.0/24`). Host bits are cleared, as the kernel would print them.

use std::fmt;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use super::TrafficError;

/// Chain that holds the masquerade rules (iptables, `nat` table).
pub const MASQ_CHAIN: &str = "FLANNEL-POSTRTG";
/// Chain that holds the forward-accept rules (iptables, `filter` table).
pub const FORWARD_CHAIN: &str = "FLANNEL-FWD";
/// Built-in chain that jumps to [`MASQ_CHAIN`].
pub const MASQ_HOOK_CHAIN: &str = "POSTROUTING";
/// Built-in chain that jumps to [`FORWARD_CHAIN`].
pub const FORWARD_HOOK_CHAIN: &str = "FORWARD";
/// Comment on every masquerade rule.
pub const MASQ_COMMENT: &str = "flanneld masq";
/// Comment on every forward rule.
pub const FORWARD_COMMENT: &str = "flanneld forward";
/// Comment on the masquerade chain's RETURN rules for what the eBPF fast path masquerades.
pub const MASQ_EBPF_COMMENT: &str = "flanneld masq: eBPF SNAT";
/// kube-proxy's masquerade mark: packets it marked are left to its own rules.
pub const KUBE_PROXY_MARK: u32 = 0x4000;
/// nftables chain with the masquerade rules.
pub const NFT_MASQ_CHAIN: &str = "postrtg";
/// nftables chain with the forward rules.
pub const NFT_FORWARD_CHAIN: &str = "forward";
/// Comment of the nftables masquerade chain.
pub const NFT_MASQ_CHAIN_COMMENT: &str = "chain to manage traffic masquerading by flannel";
/// Comment of the nftables forward chain.
pub const NFT_FORWARD_CHAIN_COMMENT: &str = "chain to accept flannel traffic";

/// An address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// IPv4 (`iptables`, nft family `ip`).
    Ipv4,
    /// IPv6 (`ip6tables`, nft family `ip6`).
    Ipv6,
}

impl Family {
    /// Both families, IPv4 first.
    pub const ALL: [Family; 2] = [Family::Ipv4, Family::Ipv6];

    /// The family of a network.
    pub fn of(net: &IpNet) -> Family {
        match net {
            IpNet::V4(_) => Family::Ipv4,
            IpNet::V6(_) => Family::Ipv6,
        }
    }

    /// The multicast range that is never masqueraded: `224.0.0.0/4` or `ff00::/8`.
    pub fn multicast(self) -> IpNet {
        match self {
            Family::Ipv4 => IpNet::V4(Ipv4Net::new_assert([224, 0, 0, 0].into(), 4)),
            Family::Ipv6 => IpNet::V6(Ipv6Net::new_assert([0xff00, 0, 0, 0, 0, 0, 0, 0].into(), 8)),
        }
    }

    /// The nftables address family keyword, also the payload protocol: `ip` / `ip6`.
    pub fn nft_family(self) -> &'static str {
        match self {
            Family::Ipv4 => "ip",
            Family::Ipv6 => "ip6",
        }
    }

    /// flannel's nftables table: `flannel-ipv4` / `flannel-ipv6`.
    pub fn nft_table(self) -> &'static str {
        match self {
            Family::Ipv4 => "flannel-ipv4",
            Family::Ipv6 => "flannel-ipv6",
        }
    }

    /// The comment upstream puts on its nftables table: `rules for flannel-ipv4`.
    pub fn nft_table_comment(self) -> &'static str {
        match self {
            Family::Ipv4 => "rules for flannel-ipv4",
            Family::Ipv6 => "rules for flannel-ipv6",
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::Ipv4 => "IPv4",
            Family::Ipv6 => "IPv6",
        })
    }
}

/// Masquerade settings beyond upstream's rule set (both default to none, which gives
/// upstream's exact rules).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MasqOptions {
    /// The eBPF fast path source-NATs pod traffic (TCP, UDP, ICMP echo) leaving through this
    /// interface (IPv4 only): the masquerade chain RETURNs that traffic so the kernel does not
    /// NAT it a second time (see `flannel_ebpf::nat`).
    pub ebpf_out_iface: Option<String>,
    /// Destinations pod traffic is never masqueraded to (`--ip-masq-exclude-cidrs`): RETURN
    /// rules before the MASQUERADE rules. Prefixes of the other family are ignored.
    pub exclude: Vec<IpNet>,
}

impl MasqOptions {
    /// Whether these are upstream's rules exactly.
    pub fn is_upstream(&self) -> bool {
        self.ebpf_out_iface.is_none() && self.exclude.is_empty()
    }

    /// The excluded prefixes of `family`, without host bits, deduplicated, in order.
    pub fn exclude_of(&self, family: Family) -> Vec<IpNet> {
        let mut out: Vec<IpNet> = Vec::new();
        for net in self.exclude.iter().filter(|n| Family::of(n) == family) {
            let net = net.trunc();
            if !out.contains(&net) {
                out.push(net);
            }
        }
        out
    }

    /// The interface whose TCP/UDP/ICMP echo eBPF masquerades in `family`, if any.
    pub fn ebpf_iface(&self, family: Family) -> Option<&str> {
        match family {
            Family::Ipv4 => self.ebpf_out_iface.as_deref(),
            Family::Ipv6 => None,
        }
    }
}

/// Protocols (IP protocol number, ICMP type) the eBPF masquerade handles, in rule order.
const EBPF_PROTOCOLS: [(u8, Option<u8>); 3] = [(6, None), (17, None), (1, Some(8))];

/// Checks that `subnet` has the family of `network` and returns both without host bits.
fn same_family(network: IpNet, subnet: IpNet) -> Result<(IpNet, IpNet), TrafficError> {
    if Family::of(&network) != Family::of(&subnet) {
        return Err(TrafficError::InvalidInput {
            field: "subnet",
            value: subnet.to_string(),
            reason: "its address family differs from the network's",
        });
    }
    Ok((network.trunc(), subnet.trunc()))
}

// ---------------------------------------------------------------------------------------------
// iptables

/// An iptables table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IptTable {
    /// `nat` (masquerade).
    Nat,
    /// `filter` (forward).
    Filter,
}

impl IptTable {
    /// The table's name as the tools spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            IptTable::Nat => "nat",
            IptTable::Filter => "filter",
        }
    }
}

/// One iptables rule: a table, a chain and the rule's arguments (without `-A chain`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IptRule {
    /// Its table.
    pub table: IptTable,
    /// Its chain.
    pub chain: &'static str,
    /// The match and target arguments, one word each (`["-s", "10.244.1.0/24", ...]`).
    pub args: Vec<String>,
}

impl IptRule {
    fn new(table: IptTable, chain: &'static str, args: &[&str]) -> Self {
        IptRule {
            table,
            chain,
            args: args.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    /// The rule's arguments as `iptables-save` prints them (comment values quoted).
    pub fn spec(&self) -> String {
        render_spec(&self.args)
    }

    /// `-A <chain> <spec>`, a line of `iptables -S` / `iptables-save` / a restore payload.
    pub fn append_line(&self) -> String {
        format!("-A {} {}", self.chain, self.spec())
    }
}

/// Renders rule arguments as `iptables-save` does: words joined by spaces, and the value after
/// `--comment` quoted unless it consists only of `[A-Za-z0-9_-]` (then it is bare, as
/// iptables prints it). Upstream's payload writer quotes every comment; for flannel's
/// comments, which contain a space, both give the same text.
pub fn render_spec(args: &[String]) -> String {
    let mut out = String::new();
    let mut quote_next = false;
    for arg in args {
        if !out.is_empty() {
            out.push(' ');
        }
        if quote_next {
            out.push_str(&save_string(arg));
        } else {
            out.push_str(arg);
        }
        quote_next = arg == "--comment";
    }
    out
}

/// A string value the way iptables-save writes it.
fn save_string(value: &str) -> String {
    let plain = !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if plain {
        return value.to_owned();
    }
    let mut s = String::with_capacity(value.len() + 2);
    s.push('"');
    for c in value.chars() {
        if matches!(c, '"' | '\\' | '\'') {
            s.push('\\');
        }
        s.push(c);
    }
    s.push('"');
    s
}

/// The 7 masquerade rules of upstream, in order: the `POSTROUTING` jump, then the 6 rules of
/// `FLANNEL-POSTRTG`, all commented `flanneld masq`. `random_fully` appends `--random-fully`
/// to both MASQUERADE rules (pass `false` when the binary lacks it or the operator disabled it).
pub fn iptables_masq_rules(
    network: IpNet,
    subnet: IpNet,
    random_fully: bool,
) -> Result<Vec<IptRule>, TrafficError> {
    let (n, p) = same_family(network, subnet)?;
    let (n, p) = (n.to_string(), p.to_string());
    let multicast = Family::of(&network).multicast().to_string();
    let mark = format!("{KUBE_PROXY_MARK:#x}/{KUBE_PROXY_MARK:#x}");
    let c = ["-m", "comment", "--comment", MASQ_COMMENT];
    let nat = |args: &[&str]| IptRule::new(IptTable::Nat, MASQ_CHAIN, args);
    let masquerade: &[&str] = if random_fully {
        &["-j", "MASQUERADE", "--random-fully"]
    } else {
        &["-j", "MASQUERADE"]
    };
    let ret = ["-j", "RETURN"];
    Ok(vec![
        IptRule::new(
            IptTable::Nat,
            MASQ_HOOK_CHAIN,
            &[&c[..], &["-j", MASQ_CHAIN]].concat(),
        ),
        nat(&[&["-m", "mark", "--mark", &mark][..], &c, &ret].concat()),
        nat(&[&["-s", &p, "-d", &n][..], &c, &ret].concat()),
        nat(&[&["-s", &n, "-d", &p][..], &c, &ret].concat()),
        nat(&[&["!", "-s", &n, "-d", &p][..], &c, &ret].concat()),
        nat(&[&["-s", &n, "!", "-d", &multicast][..], &c, masquerade].concat()),
        nat(&[&["!", "-s", &n, "-d", &n][..], &c, masquerade].concat()),
    ])
}

/// [`iptables_masq_rules`] with `options`: after upstream's four RETURN rules and before its
/// two MASQUERADE rules come
///
/// ```text
/// -A FLANNEL-POSTRTG -s N -d <excluded> -m comment --comment "flanneld masq" -j RETURN
/// -A FLANNEL-POSTRTG -s N ! -d N -o <iface> -p tcp -m comment --comment "flanneld masq: eBPF SNAT" -j RETURN
/// -A FLANNEL-POSTRTG -s N ! -d N -o <iface> -p udp -m comment --comment "flanneld masq: eBPF SNAT" -j RETURN
/// -A FLANNEL-POSTRTG -s N ! -d N -o <iface> -p icmp -m icmp --icmp-type 8 -m comment --comment "flanneld masq: eBPF SNAT" -j RETURN
/// ```
///
/// (as `iptables-save` prints them). Everything else keeps upstream's treatment: other
/// protocols and ICMP types, pod traffic through other interfaces, and traffic into the
/// cluster network are masqueraded by the kernel.
pub fn iptables_masq_rules_with(
    network: IpNet,
    subnet: IpNet,
    random_fully: bool,
    options: &MasqOptions,
) -> Result<Vec<IptRule>, TrafficError> {
    let mut rules = iptables_masq_rules(network, subnet, random_fully)?;
    let family = Family::of(&network);
    let n = network.trunc().to_string();
    let c = ["-m", "comment", "--comment", MASQ_COMMENT];
    let mut extra = Vec::new();
    for net in options.exclude_of(family) {
        let d = net.to_string();
        extra.push(IptRule::new(
            IptTable::Nat,
            MASQ_CHAIN,
            &[&["-s", &n, "-d", &d][..], &c, &["-j", "RETURN"]].concat(),
        ));
    }
    if let Some(iface) = options.ebpf_iface(family) {
        let c = ["-m", "comment", "--comment", MASQ_EBPF_COMMENT];
        let base = ["-s", &n, "!", "-d", &n, "-o", iface];
        for (proto, icmp_type) in EBPF_PROTOCOLS {
            let matches: Vec<String> = match (proto, icmp_type) {
                (1, Some(t)) => vec![
                    "-p".into(),
                    "icmp".into(),
                    "-m".into(),
                    "icmp".into(),
                    "--icmp-type".into(),
                    t.to_string(),
                ],
                (6, _) => vec!["-p".into(), "tcp".into()],
                _ => vec!["-p".into(), "udp".into()],
            };
            let matches: Vec<&str> = matches.iter().map(String::as_str).collect();
            extra.push(IptRule::new(
                IptTable::Nat,
                MASQ_CHAIN,
                &[&base[..], &matches, &c, &["-j", "RETURN"]].concat(),
            ));
        }
    }
    // The jump and upstream's four RETURN rules come first.
    let at = 5.min(rules.len());
    rules.splice(at..at, extra);
    Ok(rules)
}

/// The 3 forward rules of upstream, in order: the `FORWARD` jump, then the 2 ACCEPT rules of
/// `FLANNEL-FWD`, all commented `flanneld forward`.
pub fn iptables_forward_rules(network: IpNet) -> Vec<IptRule> {
    let n = network.trunc().to_string();
    let c = ["-m", "comment", "--comment", FORWARD_COMMENT];
    let fwd = |args: &[&str]| IptRule::new(IptTable::Filter, FORWARD_CHAIN, args);
    vec![
        IptRule::new(
            IptTable::Filter,
            FORWARD_HOOK_CHAIN,
            &[&c[..], &["-j", FORWARD_CHAIN]].concat(),
        ),
        fwd(&[&["-s", &n][..], &c, &["-j", "ACCEPT"]].concat()),
        fwd(&[&["-d", &n][..], &c, &["-j", "ACCEPT"]].concat()),
    ]
}

// ---------------------------------------------------------------------------------------------
// nftables

/// Which address of the IP header a match looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddrField {
    /// `saddr`.
    Saddr,
    /// `daddr`.
    Daddr,
}

/// One statement of an nftables rule, in the small vocabulary flannel's rules use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NftExpr {
    /// `ip saddr [!=] 10.244.0.0/16` (`ip6 ...` for IPv6).
    Addr {
        /// Source or destination.
        field: AddrField,
        /// `!=` instead of `==`.
        negated: bool,
        /// The prefix (its family gives `ip` or `ip6`).
        prefix: IpNet,
    },
    /// `meta mark <value>` (exact match, as upstream's nftables rules do).
    MetaMark(u32),
    /// `return`.
    Return,
    /// `accept`.
    Accept,
    /// `masquerade [fully-random]`.
    Masquerade {
        /// Whether `fully-random` is set.
        fully_random: bool,
    },
    /// `oifname "<name>"`.
    OifName(String),
    /// `meta l4proto <tcp|udp|icmp|number>`.
    L4Proto(u8),
    /// `icmp type <name|number>` (8 prints as `echo-request`).
    IcmpType(u8),
}

/// nft's name of an IP protocol, if flannel's rules use it.
pub fn nft_proto_name(proto: u8) -> Option<&'static str> {
    match proto {
        1 => Some("icmp"),
        6 => Some("tcp"),
        17 => Some("udp"),
        _ => None,
    }
}

/// nft's name of an ICMP type, if flannel's rules use it.
pub fn nft_icmp_type_name(ty: u8) -> Option<&'static str> {
    match ty {
        0 => Some("echo-reply"),
        8 => Some("echo-request"),
        _ => None,
    }
}

impl fmt::Display for NftExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NftExpr::Addr {
                field,
                negated,
                prefix,
            } => write!(
                f,
                "{} {}{} {}",
                Family::of(prefix).nft_family(),
                match field {
                    AddrField::Saddr => "saddr",
                    AddrField::Daddr => "daddr",
                },
                if *negated { " !=" } else { "" },
                prefix
            ),
            NftExpr::MetaMark(mark) => write!(f, "meta mark {mark:#x}"),
            NftExpr::Return => f.write_str("return"),
            NftExpr::Accept => f.write_str("accept"),
            NftExpr::Masquerade { fully_random: true } => f.write_str("masquerade fully-random"),
            NftExpr::Masquerade {
                fully_random: false,
            } => f.write_str("masquerade"),
            NftExpr::OifName(name) => write!(f, "oifname \"{name}\""),
            NftExpr::L4Proto(p) => match nft_proto_name(*p) {
                Some(name) => write!(f, "meta l4proto {name}"),
                None => write!(f, "meta l4proto {p}"),
            },
            NftExpr::IcmpType(t) => match nft_icmp_type_name(*t) {
                Some(name) => write!(f, "icmp type {name}"),
                None => write!(f, "icmp type {t}"),
            },
        }
    }
}

/// An nftables rule: its statements in order. `Display` gives the `nft` syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftRule(pub Vec<NftExpr>);

impl fmt::Display for NftRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// A base chain of flannel's nftables table with its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftChain {
    /// `postrtg` or `forward`.
    pub name: &'static str,
    /// The chain comment.
    pub comment: &'static str,
    /// The chain type: `nat` or `filter`.
    pub kind: &'static str,
    /// The hook: `postrouting` or `forward`.
    pub hook: &'static str,
    /// Numeric priority (`srcnat` = 100, `filter` = 0).
    pub priority: i32,
    /// The priority's keyword as written in the definition.
    pub priority_name: &'static str,
    /// The rules, in order.
    pub rules: Vec<NftRule>,
}

impl NftChain {
    /// The chain definition for `add chain`:
    /// `{ comment "…" ; type nat hook postrouting priority srcnat ; policy accept ; }`.
    pub fn definition(&self) -> String {
        format!(
            "{{ comment \"{}\" ; type {} hook {} priority {} ; policy accept ; }}",
            self.comment, self.kind, self.hook, self.priority_name
        )
    }
}

fn addr(field: AddrField, negated: bool, prefix: IpNet) -> NftExpr {
    NftExpr::Addr {
        field,
        negated,
        prefix,
    }
}

/// Upstream's nftables masquerade chain `postrtg` (type nat, hook postrouting, priority
/// srcnat) with its 6 rules:
///
/// ```text
/// meta mark 0x4000 return
/// ip saddr P ip daddr N return
/// ip saddr N ip daddr P return
/// ip saddr != P ip daddr N return
/// ip saddr N ip daddr != 224.0.0.0/4 masquerade fully-random
/// ip saddr != N ip daddr N masquerade fully-random
/// ```
///
/// The mark is matched exactly (not masked) and rule 4 differs from iptables rule 5: both
/// are upstream's choices, kept so that the e2e goldens hold.
pub fn nft_masq_chain(
    network: IpNet,
    subnet: IpNet,
    random_fully: bool,
) -> Result<NftChain, TrafficError> {
    use AddrField::{Daddr, Saddr};
    let (n, p) = same_family(network, subnet)?;
    let masq = NftExpr::Masquerade {
        fully_random: random_fully,
    };
    let multicast = Family::of(&n).multicast();
    Ok(NftChain {
        name: NFT_MASQ_CHAIN,
        comment: NFT_MASQ_CHAIN_COMMENT,
        kind: "nat",
        hook: "postrouting",
        priority: 100,
        priority_name: "srcnat",
        rules: vec![
            NftRule(vec![NftExpr::MetaMark(KUBE_PROXY_MARK), NftExpr::Return]),
            NftRule(vec![
                addr(Saddr, false, p),
                addr(Daddr, false, n),
                NftExpr::Return,
            ]),
            NftRule(vec![
                addr(Saddr, false, n),
                addr(Daddr, false, p),
                NftExpr::Return,
            ]),
            NftRule(vec![
                addr(Saddr, true, p),
                addr(Daddr, false, n),
                NftExpr::Return,
            ]),
            NftRule(vec![
                addr(Saddr, false, n),
                addr(Daddr, true, multicast),
                masq.clone(),
            ]),
            NftRule(vec![addr(Saddr, true, n), addr(Daddr, false, n), masq]),
        ],
    })
}

/// [`nft_masq_chain`] with `options`, the same additions as [`iptables_masq_rules_with`]:
///
/// ```text
/// ip saddr N ip daddr <excluded> return
/// oifname "<iface>" ip saddr N ip daddr != N meta l4proto tcp return
/// oifname "<iface>" ip saddr N ip daddr != N meta l4proto udp return
/// oifname "<iface>" ip saddr N ip daddr != N icmp type echo-request return
/// ```
pub fn nft_masq_chain_with(
    network: IpNet,
    subnet: IpNet,
    random_fully: bool,
    options: &MasqOptions,
) -> Result<NftChain, TrafficError> {
    use AddrField::{Daddr, Saddr};
    let mut chain = nft_masq_chain(network, subnet, random_fully)?;
    let family = Family::of(&network);
    let n = network.trunc();
    let mut extra = Vec::new();
    for net in options.exclude_of(family) {
        extra.push(NftRule(vec![
            addr(Saddr, false, n),
            addr(Daddr, false, net),
            NftExpr::Return,
        ]));
    }
    if let Some(iface) = options.ebpf_iface(family) {
        for (proto, icmp_type) in EBPF_PROTOCOLS {
            let matcher = match icmp_type {
                Some(t) => NftExpr::IcmpType(t),
                None => NftExpr::L4Proto(proto),
            };
            extra.push(NftRule(vec![
                NftExpr::OifName(iface.to_owned()),
                addr(Saddr, false, n),
                addr(Daddr, true, n),
                matcher,
                NftExpr::Return,
            ]));
        }
    }
    // Upstream's four RETURN rules come first.
    let at = 4.min(chain.rules.len());
    chain.rules.splice(at..at, extra);
    Ok(chain)
}

/// Upstream's nftables forward chain `forward` (type filter, hook forward, priority filter,
/// policy accept) with `ip saddr N accept` and `ip daddr N accept`.
pub fn nft_forward_chain(network: IpNet) -> NftChain {
    let n = network.trunc();
    NftChain {
        name: NFT_FORWARD_CHAIN,
        comment: NFT_FORWARD_CHAIN_COMMENT,
        kind: "filter",
        hook: "forward",
        priority: 0,
        priority_name: "filter",
        rules: vec![
            NftRule(vec![addr(AddrField::Saddr, false, n), NftExpr::Accept]),
            NftRule(vec![addr(AddrField::Daddr, false, n), NftExpr::Accept]),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn lines(rules: &[IptRule]) -> Vec<String> {
        rules.iter().map(IptRule::append_line).collect()
    }

    /// Section 7.1 golden (`iptables -t nat -S`), N = 10.244.0.0/16, P = 10.244.1.0/24.
    const GOLDEN_MASQ_V4: &[&str] = &[
        r#"-A POSTROUTING -m comment --comment "flanneld masq" -j FLANNEL-POSTRTG"#,
        r#"-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 -m comment --comment "flanneld masq" -j RETURN"#,
        r#"-A FLANNEL-POSTRTG -s 10.244.1.0/24 -d 10.244.0.0/16 -m comment --comment "flanneld masq" -j RETURN"#,
        r#"-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.244.1.0/24 -m comment --comment "flanneld masq" -j RETURN"#,
        r#"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.1.0/24 -m comment --comment "flanneld masq" -j RETURN"#,
        r#"-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 224.0.0.0/4 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully"#,
        r#"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.0.0/16 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully"#,
    ];

    #[test]
    fn masq_rules_match_upstream_golden() {
        let rules =
            iptables_masq_rules(net("10.244.0.0/16"), net("10.244.1.0/24"), true).expect("rules");
        assert_eq!(lines(&rules), GOLDEN_MASQ_V4);
        assert!(rules.iter().all(|r| r.table == IptTable::Nat));
        assert_eq!(rules[0].chain, "POSTROUTING");
        assert!(rules[1..].iter().all(|r| r.chain == MASQ_CHAIN));
    }

    #[test]
    fn masq_rules_without_random_fully() {
        let rules =
            iptables_masq_rules(net("10.244.0.0/16"), net("10.244.1.0/24"), false).expect("rules");
        assert_eq!(
            rules[5].append_line(),
            r#"-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 224.0.0.0/4 -m comment --comment "flanneld masq" -j MASQUERADE"#
        );
        assert_eq!(
            rules[6].append_line(),
            r#"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.0.0/16 -m comment --comment "flanneld masq" -j MASQUERADE"#
        );
        assert!(!rules.iter().any(|r| r.spec().contains("random")));
    }

    /// Upstream's unit test: Network 10.0.1.0/16 (host bits set) and lease 192.168.0.0/16
    /// give 7 rules; the kernel prints the network without host bits.
    #[test]
    fn masq_rules_count_and_host_bits() {
        let rules =
            iptables_masq_rules(net("10.0.1.0/16"), net("192.168.0.0/16"), true).expect("rules");
        assert_eq!(rules.len(), 7);
        assert_eq!(
            rules[2].spec(),
            r#"-s 192.168.0.0/16 -d 10.0.0.0/16 -m comment --comment "flanneld masq" -j RETURN"#
        );
    }

    #[test]
    fn masq_rules_ipv6_use_ff00() {
        let rules = iptables_masq_rules(net("fd00:10:244::/56"), net("fd00:10:244:100::/64"), true)
            .expect("rules");
        assert_eq!(
            lines(&rules),
            [
                r#"-A POSTROUTING -m comment --comment "flanneld masq" -j FLANNEL-POSTRTG"#,
                r#"-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 -m comment --comment "flanneld masq" -j RETURN"#,
                r#"-A FLANNEL-POSTRTG -s fd00:10:244:100::/64 -d fd00:10:244::/56 -m comment --comment "flanneld masq" -j RETURN"#,
                r#"-A FLANNEL-POSTRTG -s fd00:10:244::/56 -d fd00:10:244:100::/64 -m comment --comment "flanneld masq" -j RETURN"#,
                r#"-A FLANNEL-POSTRTG ! -s fd00:10:244::/56 -d fd00:10:244:100::/64 -m comment --comment "flanneld masq" -j RETURN"#,
                r#"-A FLANNEL-POSTRTG -s fd00:10:244::/56 ! -d ff00::/8 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully"#,
                r#"-A FLANNEL-POSTRTG ! -s fd00:10:244::/56 -d fd00:10:244::/56 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully"#,
            ]
        );
    }

    #[test]
    fn mixed_families_are_rejected_naming_the_subnet() {
        let err = iptables_masq_rules(net("10.244.0.0/16"), net("fd00::/64"), true)
            .expect_err("mixed families");
        let msg = err.to_string();
        assert!(msg.contains("subnet") && msg.contains("fd00::/64"), "{msg}");
        assert!(nft_masq_chain(net("fd00::/56"), net("10.0.0.0/24"), true).is_err());
    }

    /// Section 7.2 golden.
    #[test]
    fn forward_rules_match_upstream_golden() {
        assert_eq!(
            lines(&iptables_forward_rules(net("10.244.0.0/16"))),
            [
                r#"-A FORWARD -m comment --comment "flanneld forward" -j FLANNEL-FWD"#,
                r#"-A FLANNEL-FWD -s 10.244.0.0/16 -m comment --comment "flanneld forward" -j ACCEPT"#,
                r#"-A FLANNEL-FWD -d 10.244.0.0/16 -m comment --comment "flanneld forward" -j ACCEPT"#,
            ]
        );
        let v6 = iptables_forward_rules(net("fd00:10:244::/56"));
        assert_eq!(
            v6[2].spec(),
            r#"-d fd00:10:244::/56 -m comment --comment "flanneld forward" -j ACCEPT"#
        );
        assert!(v6.iter().all(|r| r.table == IptTable::Filter));
    }

    /// Upstream's `iptables_restore_test.go` payload line: comment words wrapped in quotes.
    #[test]
    fn comment_quoting_matches_upstream_payload_vector() {
        let rule = IptRule::new(
            IptTable::Filter,
            "INPUT",
            &[
                "-s",
                "127.0.0.1",
                "!",
                "-d",
                "224.0.0.0/4",
                "-m",
                "comment",
                "--comment",
                "flanneld masq",
                "-j",
                "MASQUERADE",
                "--random-fully",
            ],
        );
        assert_eq!(
            rule.append_line(),
            r#"-A INPUT -s 127.0.0.1 ! -d 224.0.0.0/4 -m comment --comment "flanneld masq" -j MASQUERADE --random-fully"#
        );
        let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            render_spec(&strings(&["--comment", "single", "-j", "X"])),
            "--comment single -j X"
        );
        assert_eq!(
            render_spec(&strings(&["--comment", r#"with "quote""#])),
            r#"--comment "with \"quote\"""#
        );
        assert_eq!(render_spec(&strings(&["--comment", ""])), r#"--comment """#);
    }

    fn ebpf_options() -> MasqOptions {
        MasqOptions {
            ebpf_out_iface: Some("eth0".into()),
            exclude: vec![
                net("100.64.0.0/10"),
                net("fd00:64::/64"),
                net("100.64.1.1/10"),
            ],
        }
    }

    #[test]
    fn masq_rules_with_ebpf_and_exclusions() {
        let rules = iptables_masq_rules_with(
            net("10.244.0.0/16"),
            net("10.244.1.0/24"),
            true,
            &ebpf_options(),
        )
        .expect("rules");
        let mut want: Vec<&str> = GOLDEN_MASQ_V4[..5].to_vec();
        want.extend([
            r#"-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 100.64.0.0/10 -m comment --comment "flanneld masq" -j RETURN"#,
            r#"-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 10.244.0.0/16 -o eth0 -p tcp -m comment --comment "flanneld masq: eBPF SNAT" -j RETURN"#,
            r#"-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 10.244.0.0/16 -o eth0 -p udp -m comment --comment "flanneld masq: eBPF SNAT" -j RETURN"#,
            r#"-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 10.244.0.0/16 -o eth0 -p icmp -m icmp --icmp-type 8 -m comment --comment "flanneld masq: eBPF SNAT" -j RETURN"#,
        ]);
        want.extend(&GOLDEN_MASQ_V4[5..]);
        assert_eq!(lines(&rules), want);
        // IPv6 gets its own exclusions and no eBPF rules.
        let v6 = iptables_masq_rules_with(
            net("fd00:10:244::/56"),
            net("fd00:10:244:100::/64"),
            true,
            &ebpf_options(),
        )
        .expect("rules");
        assert_eq!(v6.len(), 8);
        assert_eq!(
            v6[5].spec(),
            r#"-s fd00:10:244::/56 -d fd00:64::/64 -m comment --comment "flanneld masq" -j RETURN"#
        );
        // No options: upstream's rules exactly.
        assert!(MasqOptions::default().is_upstream());
        assert_eq!(
            lines(
                &iptables_masq_rules_with(
                    net("10.244.0.0/16"),
                    net("10.244.1.0/24"),
                    true,
                    &MasqOptions::default()
                )
                .expect("rules")
            ),
            GOLDEN_MASQ_V4
        );
    }

    #[test]
    fn nft_masq_chain_with_ebpf_and_exclusions() {
        let chain = nft_masq_chain_with(
            net("10.244.0.0/16"),
            net("10.244.1.0/24"),
            true,
            &ebpf_options(),
        )
        .expect("chain");
        assert_eq!(
            rule_texts(&chain),
            [
                "meta mark 0x4000 return",
                "ip saddr 10.244.1.0/24 ip daddr 10.244.0.0/16 return",
                "ip saddr 10.244.0.0/16 ip daddr 10.244.1.0/24 return",
                "ip saddr != 10.244.1.0/24 ip daddr 10.244.0.0/16 return",
                "ip saddr 10.244.0.0/16 ip daddr 100.64.0.0/10 return",
                "oifname \"eth0\" ip saddr 10.244.0.0/16 ip daddr != 10.244.0.0/16 meta l4proto tcp return",
                "oifname \"eth0\" ip saddr 10.244.0.0/16 ip daddr != 10.244.0.0/16 meta l4proto udp return",
                "oifname \"eth0\" ip saddr 10.244.0.0/16 ip daddr != 10.244.0.0/16 icmp type echo-request return",
                "ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade fully-random",
                "ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade fully-random",
            ]
        );
    }

    fn rule_texts(chain: &NftChain) -> Vec<String> {
        chain.rules.iter().map(ToString::to_string).collect()
    }

    /// Section 7.4: upstream's rule texts.
    #[test]
    fn nft_masq_chain_matches_upstream() {
        let chain =
            nft_masq_chain(net("10.244.0.0/16"), net("10.244.1.0/24"), true).expect("chain");
        assert_eq!(
            rule_texts(&chain),
            [
                "meta mark 0x4000 return",
                "ip saddr 10.244.1.0/24 ip daddr 10.244.0.0/16 return",
                "ip saddr 10.244.0.0/16 ip daddr 10.244.1.0/24 return",
                "ip saddr != 10.244.1.0/24 ip daddr 10.244.0.0/16 return",
                "ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade fully-random",
                "ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade fully-random",
            ]
        );
        assert_eq!(
            chain.definition(),
            r#"{ comment "chain to manage traffic masquerading by flannel" ; type nat hook postrouting priority srcnat ; policy accept ; }"#
        );
        assert_eq!((chain.name, chain.priority), ("postrtg", 100));
    }

    #[test]
    fn nft_masq_chain_ipv6_without_fully_random() {
        let chain = nft_masq_chain(net("fd00:10:244::/56"), net("fd00:10:244:100::/64"), false)
            .expect("chain");
        assert_eq!(
            rule_texts(&chain)[4..],
            [
                "ip6 saddr fd00:10:244::/56 ip6 daddr != ff00::/8 masquerade",
                "ip6 saddr != fd00:10:244::/56 ip6 daddr fd00:10:244::/56 masquerade",
            ]
        );
    }

    #[test]
    fn nft_forward_chain_matches_upstream() {
        let chain = nft_forward_chain(net("10.244.0.0/16"));
        assert_eq!(
            rule_texts(&chain),
            [
                "ip saddr 10.244.0.0/16 accept",
                "ip daddr 10.244.0.0/16 accept"
            ]
        );
        assert_eq!(
            chain.definition(),
            r#"{ comment "chain to accept flannel traffic" ; type filter hook forward priority filter ; policy accept ; }"#
        );
        assert_eq!(Family::Ipv6.nft_table(), "flannel-ipv6");
        assert_eq!(Family::Ipv4.nft_table_comment(), "rules for flannel-ipv4");
    }
}
