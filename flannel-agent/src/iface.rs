//! External interface and public IP selection (§3.3, upstream `pkg/ipmatch`) as a pure
//! function over a snapshot of the host's interfaces and routes.
//!
//! The caller fills a [`NetSnapshot`] from netlink (interfaces in kernel order with their
//! addresses and flags, the default-route interfaces, and the answer of `ip route get` for
//! `--iface-can-reach`) and calls [`select`].
//!
//! Order, as upstream: with no `--iface`, `--iface-regex` or `--iface-can-reach`, the interface
//! holding the public IP (if one is given) or else the default-route interface; otherwise each
//! `--iface` (an IP → the interface holding it; else a name), then each `--iface-regex` (first
//! interface with a usable address matching it, else the first whose name matches), then
//! `--iface-can-reach`. Upstream bugs fixed here (documented at the code):
//! * dual-stack regex matching no longer keeps the IPv4 address of an interface whose IPv6
//!   addresses did not match;
//! * an IPv6 address in `--iface` with dual-stack finds its interface (upstream dereferences
//!   a nil interface);
//! * the `--iface-can-reach` source address is used for its own family only;
//! * in an IPv6-only setup the IPv6 public IP selects the interface even when an IPv4 one is
//!   also given.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use regex::Regex;

use crate::ip::{self, IpStack};

/// One address of an interface, with the flags that rank it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddrInfo {
    /// The address.
    pub addr: IpAddr,
    /// Its prefix length.
    pub prefix_len: u8,
    /// `IFA_F_PERMANENT`: configured, not autoconfigured.
    pub permanent: bool,
    /// `IFA_F_DEPRECATED`: not to be used for new connections.
    pub deprecated: bool,
    /// `IFA_F_TEMPORARY`: an IPv6 privacy address.
    pub temporary: bool,
}

/// One network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceInfo {
    /// Interface index.
    pub index: u32,
    /// Interface name.
    pub name: String,
    /// MTU (0 = unknown, which is an error).
    pub mtu: u32,
    /// Addresses in kernel order.
    pub addrs: Vec<AddrInfo>,
}

/// The answer of `ip route get <ip>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteAnswer {
    /// The output interface index.
    pub ifindex: u32,
    /// The preferred source address, if the kernel gave one.
    pub src: Option<IpAddr>,
}

/// What the selection looks at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetSnapshot {
    /// All interfaces in kernel (index) order.
    pub interfaces: Vec<InterfaceInfo>,
    /// Output interface index of the first main-table IPv4 default route (`Some(0)` when the
    /// route has no interface).
    pub default_route_v4: Option<u32>,
    /// The same for IPv6.
    pub default_route_v6: Option<u32>,
    /// The answer of `ip route get <--iface-can-reach>`; `None` when there is no route.
    pub can_reach: Option<RouteAnswer>,
}

/// The selection options (from the command line, possibly overridden by node annotations).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfaceOptions {
    /// `--iface` values (names or IPs), in order.
    pub ifaces: Vec<String>,
    /// `--iface-regex` values, in order.
    pub iface_regex: Vec<String>,
    /// `--iface-can-reach`.
    pub iface_can_reach: Option<IpAddr>,
    /// `--public-ip`.
    pub public_ip: Option<Ipv4Addr>,
    /// `--public-ipv6`.
    pub public_ipv6: Option<Ipv6Addr>,
    /// The enabled families.
    pub stack: IpStack,
}

/// The chosen external interface (upstream `backend.ExternalInterface`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalInterface {
    /// Interface name.
    pub name: String,
    /// Interface index.
    pub index: u32,
    /// Interface MTU.
    pub mtu: u32,
    /// IPv4 address on the interface (`IfaceAddr`).
    pub iface_addr: Option<Ipv4Addr>,
    /// IPv6 address on the interface (`IfaceV6Addr`).
    pub iface_v6_addr: Option<Ipv6Addr>,
    /// The IPv4 public address (`ExtAddr`): `--public-ip` or the interface address.
    pub ext_addr: Option<Ipv4Addr>,
    /// The IPv6 public address (`ExtV6Addr`).
    pub ext_v6_addr: Option<Ipv6Addr>,
}

impl ExternalInterface {
    /// The interface addresses it was chosen with (`IfaceAddr`, `IfaceV6Addr`).
    pub fn iface_addrs(&self) -> impl Iterator<Item = IpAddr> + use<> {
        [
            self.iface_addr.map(IpAddr::V4),
            self.iface_v6_addr.map(IpAddr::V6),
        ]
        .into_iter()
        .flatten()
    }
}

/// Why one lookup failed (upstream's texts).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    /// `--iface-regex` does not compile.
    #[error("could not compile the IP address regex '{regex}': {reason}")]
    BadRegex {
        /// The pattern.
        regex: String,
        /// The compiler's message.
        reason: String,
    },
    /// No interface has this name, or holds this IPv4 address.
    #[error("error looking up interface {0}: no interface with given IP or name found")]
    NotFound(String),
    /// No interface holds this IPv6 address.
    #[error("error looking up v6 interface {0}: no interface with given IPv6 found")]
    NotFoundV6(String),
    /// Dual-stack: the IPv6 public address is on another interface.
    #[error("v6 interface {v6} must be the same with v4 interface {v4}")]
    DifferentV6Interface {
        /// The IPv6 interface.
        v6: String,
        /// The IPv4 interface.
        v4: String,
    },
    /// No interface matches the regex.
    #[error(
        "could not match pattern {regex} to any of the available network interfaces ({available})"
    )]
    NoRegexMatch {
        /// The pattern.
        regex: String,
        /// `name:[addrs]` of every interface.
        available: String,
    },
    /// `ip route get` gave nothing usable for `--iface-can-reach`.
    #[error("failed to get ifcanreach based interface: {0}")]
    CanReach(String),
    /// No IPv4 default route.
    #[error("failed to get default interface: {0}")]
    DefaultRoute(&'static str),
    /// No IPv6 default route.
    #[error("failed to get default v6 interface: {0}")]
    DefaultRouteV6(&'static str),
    /// Dual-stack default routes on different interfaces.
    #[error(
        "v6 default route interface {v6} must be the same with v4 default route interface {v4}"
    )]
    DifferentDefaultInterfaces {
        /// The IPv6 default-route interface.
        v6: String,
        /// The IPv4 default-route interface.
        v4: String,
    },
    /// The chosen interface has no usable IPv4 address.
    #[error("failed to find IPv4 address for interface {0}")]
    NoIpv4Address(String),
    /// The chosen interface has no usable IPv6 address.
    #[error("failed to find IPv6 address for interface {0}")]
    NoIpv6Address(String),
    /// The chosen interface reports MTU 0.
    #[error("failed to determine MTU for {0} interface")]
    NoMtu(String),
}

/// Why no interface was selected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IfaceError {
    /// The default / public-IP lookup failed (no selection options given).
    #[error("Failed to find any valid interface to use: {0}")]
    NoValidInterface(LookupError),
    /// None of `--iface`, `--iface-regex`, `--iface-can-reach` matched. `attempts` holds each
    /// option with its failure, for logging.
    #[error("Failed to find interface to use that matches the interfaces and/or regexes provided")]
    NoMatch {
        /// `(option value, why it failed)` in the order tried.
        attempts: Vec<(String, LookupError)>,
    },
}

/// Upstream's text for an unparsable `--public-ip` (e.g. from a node annotation).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublicIpError {
    /// Not an IPv4 address.
    #[error("invalid public IP address: {0}")]
    V4(String),
    /// Not an IPv6 address.
    #[error("invalid public IPv6 address: {0}")]
    V6(String),
}

/// Parses a public IPv4 address given as text (flag or annotation).
pub fn parse_public_ip(s: &str) -> Result<Ipv4Addr, PublicIpError> {
    s.trim()
        .parse()
        .map_err(|_| PublicIpError::V4(s.to_owned()))
}

/// Parses a public IPv6 address given as text.
pub fn parse_public_ipv6(s: &str) -> Result<Ipv6Addr, PublicIpError> {
    s.trim()
        .parse()
        .map_err(|_| PublicIpError::V6(s.to_owned()))
}

/// Selects the external interface (see the module docs for the order).
pub fn select(opts: &IfaceOptions, snap: &NetSnapshot) -> Result<ExternalInterface, IfaceError> {
    let ctx = Ctx { opts, snap };
    if opts.ifaces.is_empty() && opts.iface_regex.is_empty() && opts.iface_can_reach.is_none() {
        let public = match (opts.stack.has_v4(), opts.public_ip, opts.public_ipv6) {
            (true, Some(v4), _) => Some(IpAddr::V4(v4)),
            (_, _, Some(v6)) if opts.stack.has_v6() => Some(IpAddr::V6(v6)),
            _ => None,
        };
        let found = match public {
            Some(addr) => ctx.by_ip(addr),
            None => ctx.by_default_route(),
        };
        return found
            .and_then(|f| ctx.finish(f))
            .map_err(IfaceError::NoValidInterface);
    }
    let mut attempts = Vec::new();
    let candidates = opts
        .ifaces
        .iter()
        .map(|s| (s.clone(), Spec::IpOrName(s)))
        .chain(opts.iface_regex.iter().map(|r| (r.clone(), Spec::Regex(r))))
        .chain(
            opts.iface_can_reach
                .map(|a| (a.to_string(), Spec::CanReach(a))),
        );
    for (label, spec) in candidates {
        let found = match spec {
            Spec::IpOrName(s) => ctx.by_ip_or_name(s),
            Spec::Regex(r) => ctx.by_regex(r),
            Spec::CanReach(a) => ctx.by_can_reach(a),
        };
        match found.and_then(|f| ctx.finish(f)) {
            Ok(ext) => return Ok(ext),
            Err(e) => attempts.push((label, e)),
        }
    }
    Err(IfaceError::NoMatch { attempts })
}

enum Spec<'a> {
    IpOrName(&'a str),
    Regex(&'a str),
    CanReach(IpAddr),
}

/// An interface with the addresses fixed by the lookup itself (the rest is filled in later).
struct Found<'s> {
    iface: &'s InterfaceInfo,
    v4: Option<Ipv4Addr>,
    v6: Option<Ipv6Addr>,
}

struct Ctx<'a> {
    opts: &'a IfaceOptions,
    snap: &'a NetSnapshot,
}

impl<'a> Ctx<'a> {
    fn by_index(&self, index: u32) -> Option<&'a InterfaceInfo> {
        self.snap.interfaces.iter().find(|i| i.index == index)
    }

    fn holding(&self, addr: IpAddr) -> Option<&'a InterfaceInfo> {
        self.snap
            .interfaces
            .iter()
            .find(|i| i.addrs.iter().any(|a| a.addr == addr))
    }

    /// `--iface` value: an IP selects the interface holding it, otherwise a name.
    fn by_ip_or_name(&self, s: &str) -> Result<Found<'a>, LookupError> {
        match s.parse::<IpAddr>() {
            Ok(addr) => self.by_ip(addr),
            Err(_) => self
                .snap
                .interfaces
                .iter()
                .find(|i| i.name == s)
                .map(|iface| Found {
                    iface,
                    v4: None,
                    v6: None,
                })
                .ok_or_else(|| LookupError::NotFound(s.to_owned())),
        }
    }

    /// The interface holding `addr`; in dual-stack the IPv6 public IP must be on it too.
    fn by_ip(&self, addr: IpAddr) -> Result<Found<'a>, LookupError> {
        let stack = self.opts.stack;
        let (iface, v4, mut v6) = match addr {
            IpAddr::V4(a) if stack.has_v4() => {
                let iface = self
                    .holding(addr)
                    .ok_or_else(|| LookupError::NotFound(a.to_string()))?;
                (iface, Some(a), None)
            }
            IpAddr::V6(a) if stack.has_v6() => {
                let iface = self
                    .holding(addr)
                    .ok_or_else(|| LookupError::NotFoundV6(a.to_string()))?;
                (iface, None, Some(a))
            }
            IpAddr::V4(a) => return Err(LookupError::NotFound(a.to_string())),
            IpAddr::V6(a) => return Err(LookupError::NotFoundV6(a.to_string())),
        };
        if stack == IpStack::Dual
            && let Some(pub6) = self.opts.public_ipv6
        {
            let v6_iface = self
                .holding(IpAddr::V6(pub6))
                .ok_or_else(|| LookupError::NotFoundV6(pub6.to_string()))?;
            if v6_iface.index != iface.index {
                return Err(LookupError::DifferentV6Interface {
                    v6: v6_iface.name.clone(),
                    v4: iface.name.clone(),
                });
            }
            v6 = Some(pub6);
        }
        Ok(Found { iface, v4, v6 })
    }

    /// First interface with a usable address matching `pattern` (both families in dual-stack),
    /// else the first interface whose name matches.
    fn by_regex(&self, pattern: &str) -> Result<Found<'a>, LookupError> {
        let re = Regex::new(pattern).map_err(|e| LookupError::BadRegex {
            regex: pattern.to_owned(),
            reason: e.to_string(),
        })?;
        let stack = self.opts.stack;
        for iface in &self.snap.interfaces {
            let v4 = usable_v4(iface)
                .into_iter()
                .find(|a| re.is_match(&a.to_string()));
            let v6 = usable_v6(iface)
                .into_iter()
                .find(|a| re.is_match(&a.to_string()));
            let matched = match stack {
                IpStack::V4 => v4.is_some(),
                IpStack::V6 => v6.is_some(),
                IpStack::Dual => v4.is_some() && v6.is_some(),
            };
            if matched {
                return Ok(Found {
                    iface,
                    v4: v4.filter(|_| stack.has_v4()),
                    v6: v6.filter(|_| stack.has_v6()),
                });
            }
        }
        if let Some(iface) = self.snap.interfaces.iter().find(|i| re.is_match(&i.name)) {
            return Ok(Found {
                iface,
                v4: None,
                v6: None,
            });
        }
        let available = self
            .snap
            .interfaces
            .iter()
            .map(|i| {
                let addrs: Vec<String> = if stack.has_v4() {
                    usable_v4(i).iter().map(|a| a.to_string()).collect()
                } else {
                    usable_v6(i).iter().map(|a| a.to_string()).collect()
                };
                format!("{}:[{}]", i.name, addrs.join(" "))
            })
            .collect::<Vec<_>>()
            .join(", ");
        Err(LookupError::NoRegexMatch {
            regex: pattern.to_owned(),
            available,
        })
    }

    /// The interface of `ip route get <target>`, with its source address for that family.
    fn by_can_reach(&self, target: IpAddr) -> Result<Found<'a>, LookupError> {
        let route = self
            .snap
            .can_reach
            .ok_or_else(|| LookupError::CanReach(format!("couldn't lookup route to {target}")))?;
        let iface = self.by_index(route.ifindex).ok_or_else(|| {
            LookupError::CanReach(format!("couldn't lookup interface {}", route.ifindex))
        })?;
        let stack = self.opts.stack;
        let (v4, v6) = match route.src {
            Some(IpAddr::V4(a)) if stack.has_v4() => (Some(a), None),
            Some(IpAddr::V6(a)) if stack.has_v6() => (None, Some(a)),
            _ => (None, None),
        };
        Ok(Found { iface, v4, v6 })
    }

    /// The default-route interface (the same one for both families in dual-stack).
    fn by_default_route(&self) -> Result<Found<'a>, LookupError> {
        let stack = self.opts.stack;
        let v4 = if stack.has_v4() {
            Some(self.default_iface(self.snap.default_route_v4, LookupError::DefaultRoute)?)
        } else {
            None
        };
        let v6 = if stack.has_v6() {
            Some(self.default_iface(self.snap.default_route_v6, LookupError::DefaultRouteV6)?)
        } else {
            None
        };
        let iface = match (v4, v6) {
            (Some(a), Some(b)) if a.index != b.index => {
                return Err(LookupError::DifferentDefaultInterfaces {
                    v6: b.name.clone(),
                    v4: a.name.clone(),
                });
            }
            (Some(a), _) => a,
            (None, Some(b)) => b,
            (None, None) => return Err(LookupError::DefaultRoute("unable to find default route")),
        };
        Ok(Found {
            iface,
            v4: None,
            v6: None,
        })
    }

    fn default_iface(
        &self,
        route: Option<u32>,
        err: fn(&'static str) -> LookupError,
    ) -> Result<&'a InterfaceInfo, LookupError> {
        match route {
            None => Err(err("unable to find default route")),
            Some(0) => Err(err("found default route but could not determine interface")),
            Some(index) => self
                .by_index(index)
                .ok_or_else(|| err("default route interface not found")),
        }
    }

    /// Fills in missing interface addresses, checks the MTU and derives the public addresses.
    fn finish(&self, found: Found<'a>) -> Result<ExternalInterface, LookupError> {
        let stack = self.opts.stack;
        let iface = found.iface;
        let v4 = match found.v4 {
            Some(a) => Some(a),
            None if stack.has_v4() => Some(
                *usable_v4(iface)
                    .first()
                    .ok_or_else(|| LookupError::NoIpv4Address(iface.name.clone()))?,
            ),
            None => None,
        };
        let v6 = match found.v6 {
            Some(a) => Some(a),
            None if stack.has_v6() => Some(
                *usable_v6(iface)
                    .first()
                    .ok_or_else(|| LookupError::NoIpv6Address(iface.name.clone()))?,
            ),
            None => None,
        };
        if iface.mtu == 0 {
            return Err(LookupError::NoMtu(iface.name.clone()));
        }
        Ok(ExternalInterface {
            name: iface.name.clone(),
            index: iface.index,
            mtu: iface.mtu,
            iface_addr: v4,
            iface_v6_addr: v6,
            ext_addr: self
                .opts
                .public_ip
                .or(if stack.has_v4() { v4 } else { None }),
            ext_v6_addr: self
                .opts
                .public_ipv6
                .or(if stack.has_v6() { v6 } else { None }),
        })
    }
}

/// Usable addresses of one family in preference order: global or link-local unicast and not
/// deprecated; global before link-local, permanent before dynamic, non-temporary before
/// temporary, otherwise kernel order.
fn usable(iface: &InterfaceInfo, v4: bool) -> Vec<&AddrInfo> {
    let mut addrs: Vec<&AddrInfo> = iface
        .addrs
        .iter()
        .filter(|a| a.addr.is_ipv4() == v4)
        .filter(|a| ip::is_global_unicast(a.addr) || ip::is_link_local_unicast(a.addr))
        .filter(|a| !a.deprecated)
        .collect();
    addrs.sort_by_key(|a| (!ip::is_global_unicast(a.addr), !a.permanent, a.temporary));
    addrs
}

fn usable_v4(iface: &InterfaceInfo) -> Vec<Ipv4Addr> {
    usable(iface, true)
        .into_iter()
        .filter_map(|a| match a.addr {
            IpAddr::V4(v) => Some(v),
            IpAddr::V6(_) => None,
        })
        .collect()
}

fn usable_v6(iface: &InterfaceInfo) -> Vec<Ipv6Addr> {
    usable(iface, false)
        .into_iter()
        .filter_map(|a| match a.addr {
            IpAddr::V6(v) => Some(v),
            IpAddr::V4(_) => None,
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn addr(s: &str) -> AddrInfo {
        let (a, len) = s.split_once('/').unwrap_or((s, "32"));
        AddrInfo {
            addr: a.parse().unwrap(),
            prefix_len: len.parse().unwrap(),
            permanent: true,
            deprecated: false,
            temporary: false,
        }
    }

    /// The `pkg/ipmatch/match_test.go` setup: dummy0 with five IPv4 addresses and
    /// 2001:db8::1/64, and a route to 172.16.32.254 via 172.16.32.100.
    fn ipmatch_snapshot() -> NetSnapshot {
        NetSnapshot {
            interfaces: vec![
                InterfaceInfo {
                    index: 1,
                    name: "lo".into(),
                    mtu: 65536,
                    addrs: vec![addr("127.0.0.1/8"), addr("::1/128")],
                },
                InterfaceInfo {
                    index: 2,
                    name: "eth0".into(),
                    mtu: 1500,
                    addrs: vec![
                        addr("192.0.2.10/24"),
                        addr("2001:db8:1::10/64"),
                        addr("fe80::1/64"),
                    ],
                },
                InterfaceInfo {
                    index: 3,
                    name: "dummy0".into(),
                    mtu: 1500,
                    addrs: vec![
                        addr("1.10.100.1/24"),
                        addr("192.168.200.128/24"),
                        addr("172.16.30.18/24"),
                        addr("172.16.31.200/24"),
                        addr("172.16.32.100/24"),
                        addr("2001:db8::1/64"),
                    ],
                },
            ],
            default_route_v4: Some(2),
            default_route_v6: Some(2),
            can_reach: Some(RouteAnswer {
                ifindex: 3,
                src: Some("172.16.32.100".parse().unwrap()),
            }),
        }
    }

    fn opts(stack: IpStack) -> IfaceOptions {
        IfaceOptions {
            ifaces: vec![],
            iface_regex: vec![],
            iface_can_reach: None,
            public_ip: None,
            public_ipv6: None,
            stack,
        }
    }

    fn v4(s: &str) -> Option<Ipv4Addr> {
        Some(s.parse().unwrap())
    }
    fn v6(s: &str) -> Option<Ipv6Addr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn regex_on_addresses() {
        let o = IfaceOptions {
            iface_regex: vec![r"192\.168\.200\.\d+".into()],
            ..opts(IpStack::V4)
        };
        let e = select(&o, &ipmatch_snapshot()).unwrap();
        assert_eq!((e.name.as_str(), e.index, e.mtu), ("dummy0", 3, 1500));
        assert_eq!(e.iface_addr, v4("192.168.200.128"));
        assert_eq!(e.ext_addr, v4("192.168.200.128"));
        assert_eq!(e.iface_v6_addr, None);
    }

    #[test]
    fn regex_on_names_takes_the_first_address() {
        let o = IfaceOptions {
            iface_regex: vec![r"dummy\d+".into()],
            ..opts(IpStack::V4)
        };
        let e = select(&o, &ipmatch_snapshot()).unwrap();
        assert_eq!(e.name, "dummy0");
        assert_eq!(e.iface_addr, v4("1.10.100.1"));
    }

    #[test]
    fn by_name_and_by_ip() {
        let o = IfaceOptions {
            ifaces: vec!["dummy0".into()],
            ..opts(IpStack::V4)
        };
        assert_eq!(
            select(&o, &ipmatch_snapshot()).unwrap().iface_addr,
            v4("1.10.100.1")
        );
        let o = IfaceOptions {
            ifaces: vec!["172.16.30.18".into()],
            ..opts(IpStack::V4)
        };
        let e = select(&o, &ipmatch_snapshot()).unwrap();
        assert_eq!(
            (e.name.as_str(), e.iface_addr),
            ("dummy0", v4("172.16.30.18"))
        );
    }

    #[test]
    fn dual_stack_by_ip() {
        let o = IfaceOptions {
            ifaces: vec!["172.16.30.18".into()],
            ..opts(IpStack::Dual)
        };
        let e = select(&o, &ipmatch_snapshot()).unwrap();
        assert_eq!(e.name, "dummy0");
        assert_eq!(e.iface_addr, v4("172.16.30.18"));
        assert_eq!(e.iface_v6_addr, v6("2001:db8::1"));
        assert_eq!(e.ext_v6_addr, v6("2001:db8::1"));
        // With an IPv6 public IP on the same interface.
        let o = IfaceOptions {
            public_ipv6: v6("2001:db8::1"),
            ..o
        };
        let e = select(&o, &ipmatch_snapshot()).unwrap();
        assert_eq!(e.iface_v6_addr, v6("2001:db8::1"));
        // On another interface: error.
        let o = IfaceOptions {
            public_ipv6: v6("2001:db8:1::10"),
            ..o
        };
        let IfaceError::NoMatch { attempts } = select(&o, &ipmatch_snapshot()).unwrap_err() else {
            panic!()
        };
        assert_eq!(
            attempts[0].1.to_string(),
            "v6 interface eth0 must be the same with v4 interface dummy0"
        );
        // An IPv6 address in --iface (upstream crashes here).
        let o = IfaceOptions {
            ifaces: vec!["2001:db8::1".into()],
            ..opts(IpStack::Dual)
        };
        let e = select(&o, &ipmatch_snapshot()).unwrap();
        assert_eq!(
            (e.name.as_str(), e.iface_addr, e.iface_v6_addr),
            ("dummy0", v4("1.10.100.1"), v6("2001:db8::1"))
        );
    }

    #[test]
    fn regex_with_public_ip() {
        let o = IfaceOptions {
            iface_regex: vec![r"172\.16\.30\.\d+".into()],
            public_ip: v4("172.16.31.200"),
            ..opts(IpStack::V4)
        };
        let e = select(&o, &ipmatch_snapshot()).unwrap();
        assert_eq!(e.iface_addr, v4("172.16.30.18"));
        assert_eq!(e.ext_addr, v4("172.16.31.200"));
    }

    #[test]
    fn can_reach() {
        let o = IfaceOptions {
            iface_can_reach: Some("172.16.32.254".parse().unwrap()),
            ..opts(IpStack::V4)
        };
        let e = select(&o, &ipmatch_snapshot()).unwrap();
        assert_eq!(
            (e.name.as_str(), e.iface_addr),
            ("dummy0", v4("172.16.32.100"))
        );
        // No route.
        let snap = NetSnapshot {
            can_reach: None,
            ..ipmatch_snapshot()
        };
        let IfaceError::NoMatch { attempts } = select(&o, &snap).unwrap_err() else {
            panic!()
        };
        assert_eq!(attempts[0].0, "172.16.32.254");
        assert_eq!(
            attempts[0].1.to_string(),
            "failed to get ifcanreach based interface: couldn't lookup route to 172.16.32.254"
        );
    }

    #[test]
    fn default_route_and_public_ip() {
        let e = select(&opts(IpStack::V4), &ipmatch_snapshot()).unwrap();
        assert_eq!(
            (e.name.as_str(), e.iface_addr, e.ext_addr),
            ("eth0", v4("192.0.2.10"), v4("192.0.2.10"))
        );
        let e = select(&opts(IpStack::Dual), &ipmatch_snapshot()).unwrap();
        assert_eq!(e.iface_v6_addr, v6("2001:db8:1::10"));
        // Link-local comes after global even when listed first.
        let mut snap = ipmatch_snapshot();
        snap.interfaces[1].addrs.swap(1, 2);
        assert_eq!(
            select(&opts(IpStack::V6), &snap).unwrap().iface_v6_addr,
            v6("2001:db8:1::10")
        );
        // A public IP selects the interface holding it.
        let o = IfaceOptions {
            public_ip: v4("172.16.31.200"),
            ..opts(IpStack::V4)
        };
        let e = select(&o, &ipmatch_snapshot()).unwrap();
        assert_eq!(
            (e.name.as_str(), e.iface_addr, e.ext_addr),
            ("dummy0", v4("172.16.31.200"), v4("172.16.31.200"))
        );
        let o = IfaceOptions {
            public_ip: v4("8.8.8.8"),
            ..opts(IpStack::V4)
        };
        assert_eq!(
            select(&o, &ipmatch_snapshot()).unwrap_err().to_string(),
            "Failed to find any valid interface to use: error looking up interface 8.8.8.8: no interface with given IP or name found"
        );
        // IPv6-only with both public IPs: the IPv6 one selects.
        let o = IfaceOptions {
            public_ip: v4("192.0.2.10"),
            public_ipv6: v6("2001:db8::1"),
            ..opts(IpStack::V6)
        };
        let e = select(&o, &ipmatch_snapshot()).unwrap();
        assert_eq!(
            (e.name.as_str(), e.iface_v6_addr, e.iface_addr),
            ("dummy0", v6("2001:db8::1"), None)
        );
    }

    #[test]
    fn default_route_errors() {
        let snap = NetSnapshot {
            default_route_v4: None,
            ..ipmatch_snapshot()
        };
        assert_eq!(
            select(&opts(IpStack::V4), &snap).unwrap_err().to_string(),
            "Failed to find any valid interface to use: failed to get default interface: unable to find default route"
        );
        let snap = NetSnapshot {
            default_route_v4: Some(0),
            ..ipmatch_snapshot()
        };
        assert_eq!(
            select(&opts(IpStack::V4), &snap).unwrap_err(),
            IfaceError::NoValidInterface(LookupError::DefaultRoute(
                "found default route but could not determine interface"
            ))
        );
        let snap = NetSnapshot {
            default_route_v6: Some(3),
            ..ipmatch_snapshot()
        };
        assert_eq!(
            select(&opts(IpStack::Dual), &snap).unwrap_err().to_string(),
            "Failed to find any valid interface to use: v6 default route interface dummy0 must be the same with v4 default route interface eth0"
        );
    }

    #[test]
    fn options_are_tried_in_order() {
        let o = IfaceOptions {
            ifaces: vec!["nope0".into(), "eth0".into()],
            iface_regex: vec!["dummy".into()],
            ..opts(IpStack::V4)
        };
        assert_eq!(select(&o, &ipmatch_snapshot()).unwrap().name, "eth0");
        let o = IfaceOptions {
            ifaces: vec!["nope0".into()],
            iface_regex: vec!["(".into(), "zzz".into()],
            iface_can_reach: Some("10.0.0.1".parse().unwrap()),
            ..opts(IpStack::V4)
        };
        let snap = NetSnapshot {
            can_reach: None,
            ..ipmatch_snapshot()
        };
        let err = select(&o, &snap).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Failed to find interface to use that matches the interfaces and/or regexes provided"
        );
        let IfaceError::NoMatch { attempts } = err else {
            panic!()
        };
        let labels: Vec<&str> = attempts.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(labels, ["nope0", "(", "zzz", "10.0.0.1"]);
        assert_eq!(
            attempts[0].1.to_string(),
            "error looking up interface nope0: no interface with given IP or name found"
        );
        assert!(
            attempts[1]
                .1
                .to_string()
                .starts_with("could not compile the IP address regex '(': ")
        );
        assert_eq!(
            attempts[2].1.to_string(),
            "could not match pattern zzz to any of the available network interfaces (lo:[], eth0:[192.0.2.10], dummy0:[1.10.100.1 192.168.200.128 172.16.30.18 172.16.31.200 172.16.32.100])"
        );
    }

    #[test]
    fn dual_stack_regex_needs_both_families_on_one_interface() {
        let mut snap = ipmatch_snapshot();
        snap.interfaces.push(InterfaceInfo {
            index: 4,
            name: "eth1".into(),
            mtu: 1500,
            addrs: vec![addr("10.9.0.1/24"), addr("fd09::1/64")],
        });
        let o = IfaceOptions {
            iface_regex: vec!["^(10\\.9|fd09)".into()],
            ..opts(IpStack::Dual)
        };
        let e = select(&o, &snap).unwrap();
        assert_eq!(
            (e.name.as_str(), e.iface_addr, e.iface_v6_addr),
            ("eth1", v4("10.9.0.1"), v6("fd09::1"))
        );
        // IPv4 matches on dummy0 but IPv6 does not: falls through to the name match, and the
        // address comes from the matched interface (upstream would keep dummy0's address).
        let o = IfaceOptions {
            iface_regex: vec!["^1\\.10|eth1".into()],
            ..opts(IpStack::Dual)
        };
        let e = select(&o, &snap).unwrap();
        assert_eq!((e.name.as_str(), e.iface_addr), ("eth1", v4("10.9.0.1")));
    }

    #[test]
    fn address_preference_and_filters() {
        let mut tmp = addr("2001:db8:5::9/64");
        tmp.temporary = true;
        tmp.permanent = false;
        let mut dynamic = addr("2001:db8:5::8/64");
        dynamic.permanent = false;
        let mut deprecated = addr("2001:db8:5::7/64");
        deprecated.deprecated = true;
        let iface = InterfaceInfo {
            index: 9,
            name: "x".into(),
            mtu: 1500,
            addrs: vec![
                addr("fe80::9/64"),
                tmp,
                dynamic,
                deprecated,
                addr("2001:db8:5::6/64"),
                addr("ff02::1/128"),
            ],
        };
        let got: Vec<String> = usable_v6(&iface).iter().map(|a| a.to_string()).collect();
        assert_eq!(
            got,
            ["2001:db8:5::6", "2001:db8:5::8", "2001:db8:5::9", "fe80::9"]
        );
    }

    #[test]
    fn zero_mtu_and_missing_address() {
        let mut snap = ipmatch_snapshot();
        snap.interfaces[1].mtu = 0;
        assert_eq!(
            select(&opts(IpStack::V4), &snap).unwrap_err().to_string(),
            "Failed to find any valid interface to use: failed to determine MTU for eth0 interface"
        );
        let o = IfaceOptions {
            ifaces: vec!["lo".into()],
            ..opts(IpStack::V4)
        };
        let IfaceError::NoMatch { attempts } = select(&o, &ipmatch_snapshot()).unwrap_err() else {
            panic!()
        };
        assert_eq!(attempts[0].1, LookupError::NoIpv4Address("lo".into()));
    }

    #[test]
    fn public_ip_parsing() {
        assert_eq!(parse_public_ip("1.2.3.4"), Ok(Ipv4Addr::new(1, 2, 3, 4)));
        assert_eq!(
            parse_public_ip("x").unwrap_err().to_string(),
            "invalid public IP address: x"
        );
        assert_eq!(parse_public_ipv6("fd00::1"), Ok("fd00::1".parse().unwrap()));
        assert_eq!(
            parse_public_ipv6("1.2.3.4").unwrap_err().to_string(),
            "invalid public IPv6 address: 1.2.3.4"
        );
    }
}
