//! What a node's kernel holds for the cluster (routes, neighbours, FDB entries) and what its
//! agent reports on `/healthz` and `/metrics`.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};
use ipnet::Ipv4Net;
use serde_json::Value;

use super::wait;
use crate::netns::NetNs;

/// How long an agent gets to converge after a change (it reacts within a second; the rest is
/// slack for a loaded CI machine).
pub const CONVERGE: Duration = Duration::from_secs(30);

/// Cluster state in one node's kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelCounts {
    /// IPv4 routes whose destination lies inside the cluster network, except the node's own
    /// pod subnet (the `cni0` route).
    pub routes: usize,
    /// Those routes by protocol (`ip route`'s name or number), e.g. `{"boot": 2}`.
    pub route_protocols: BTreeMap<String, usize>,
    /// PERMANENT IPv4 neighbour entries for addresses inside the cluster network (VXLAN's
    /// per-peer ARP entries).
    pub neighbours: usize,
    /// FDB entries with a remote `dst` (VXLAN's per-peer entries).
    pub fdb: usize,
}

fn parse_dst(dst: &str) -> Option<Ipv4Net> {
    if dst.contains('/') {
        dst.parse().ok()
    } else {
        Ipv4Net::new(dst.parse().ok()?, 32).ok()
    }
}

/// Counts what `ns`'s kernel holds for the cluster `network`, leaving out `local` (the node's
/// own pod subnet).
pub fn kernel_counts(ns: &NetNs, network: Ipv4Net, local: Option<Ipv4Net>) -> Result<KernelCounts> {
    let mut counts = KernelCounts::default();
    let routes: Value = serde_json::from_str(&ns.run(&["ip", "-j", "-4", "route", "show"])?)
        .context("ip -j route output")?;
    for route in routes.as_array().into_iter().flatten() {
        let Some(dst) = route["dst"].as_str().and_then(parse_dst) else {
            continue;
        };
        if !network.contains(&dst) || Some(dst) == local {
            continue;
        }
        counts.routes += 1;
        let proto = match &route["protocol"] {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => "boot".to_owned(),
        };
        *counts.route_protocols.entry(proto).or_default() += 1;
    }
    let neigh: Value =
        serde_json::from_str(&ns.run(&["ip", "-j", "-4", "neigh", "show", "nud", "permanent"])?)
            .context("ip -j neigh output")?;
    counts.neighbours = neigh
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| {
            n["dst"]
                .as_str()
                .and_then(|d| d.parse::<Ipv4Addr>().ok())
                .is_some_and(|a| network.contains(&a))
        })
        .count();
    let fdb: Value = serde_json::from_str(&ns.run(&["bridge", "-j", "fdb", "show"])?)
        .context("bridge -j fdb output")?;
    counts.fdb = fdb
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e.get("dst").is_some())
        .count();
    Ok(counts)
}

/// The cluster entries of one node's kernel in detail, each as a normalised line, sorted:
/// for comparing before/after (restart, stale state) and asserting exact routes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelState {
    /// IPv4 routes into the cluster network (all types, except the node's own subnet):
    /// `<dst> [type <t>] [via <gw>] [dev <dev>] proto <p>[ onlink]`.
    pub routes: Vec<String>,
    /// Permanent IPv4 neighbours in the cluster network: `<ip> lladdr <mac> dev <dev>`.
    pub neighbours: Vec<String>,
    /// FDB entries with a remote destination: `<mac> dev <dev> dst <ip>`.
    pub fdb: Vec<String>,
}

impl KernelState {
    /// Entries that appear more than once in a list (the kernel refuses exact duplicates of
    /// routes and neighbours, but FDB entries can be appended).
    pub fn duplicates(&self) -> Vec<String> {
        let mut out = Vec::new();
        for list in [&self.routes, &self.neighbours, &self.fdb] {
            for pair in list.windows(2) {
                if pair[0] == pair[1] {
                    out.push(pair[0].clone());
                }
            }
        }
        out
    }

    /// The route line for `dst` (e.g. `10.244.3.0/24`), if there is one.
    pub fn route_to(&self, dst: &str) -> Option<&str> {
        self.routes
            .iter()
            .find(|r| r.split_whitespace().next() == Some(dst))
            .map(String::as_str)
    }

    /// Whether any entry (route, neighbour, FDB) mentions `needle` as a whole word.
    pub fn mentions(&self, needle: &str) -> bool {
        self.routes
            .iter()
            .chain(&self.neighbours)
            .chain(&self.fdb)
            .any(|line| line.split_whitespace().any(|w| w == needle))
    }
}

impl std::fmt::Display for KernelState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (what, list) in [
            ("route", &self.routes),
            ("neigh", &self.neighbours),
            ("fdb", &self.fdb),
        ] {
            for line in list {
                writeln!(f, "  {what} {line}")?;
            }
        }
        Ok(())
    }
}

fn text_field(v: &Value, key: &str) -> Option<String> {
    match &v[key] {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Reads [`KernelState`] of `ns` for the cluster `network`, leaving out `local`.
pub fn kernel_state(ns: &NetNs, network: Ipv4Net, local: Option<Ipv4Net>) -> Result<KernelState> {
    let mut state = KernelState::default();
    let routes: Value = serde_json::from_str(&ns.run(&["ip", "-j", "-4", "route", "show"])?)
        .context("ip -j route output")?;
    for route in routes.as_array().into_iter().flatten() {
        let Some(dst) = route["dst"].as_str().and_then(parse_dst) else {
            continue;
        };
        if !network.contains(&dst) || Some(dst) == local {
            continue;
        }
        let mut line = dst.to_string();
        if let Some(t) = text_field(route, "type") {
            line += &format!(" type {t}");
        }
        if let Some(gw) = text_field(route, "gateway") {
            line += &format!(" via {gw}");
        }
        if let Some(dev) = text_field(route, "dev") {
            line += &format!(" dev {dev}");
        }
        line += &format!(
            " proto {}",
            text_field(route, "protocol").unwrap_or_else(|| "boot".to_owned())
        );
        if route["flags"]
            .as_array()
            .is_some_and(|f| f.iter().any(|x| x == "onlink"))
        {
            line += " onlink";
        }
        state.routes.push(line);
    }
    let neigh: Value =
        serde_json::from_str(&ns.run(&["ip", "-j", "-4", "neigh", "show", "nud", "permanent"])?)
            .context("ip -j neigh output")?;
    for n in neigh.as_array().into_iter().flatten() {
        let Some(dst) = n["dst"].as_str().and_then(|d| d.parse::<Ipv4Addr>().ok()) else {
            continue;
        };
        if !network.contains(&dst) {
            continue;
        }
        state.neighbours.push(format!(
            "{dst} lladdr {} dev {}",
            text_field(n, "lladdr").unwrap_or_default(),
            text_field(n, "dev").unwrap_or_default()
        ));
    }
    let fdb: Value = serde_json::from_str(&ns.run(&["bridge", "-j", "fdb", "show"])?)
        .context("bridge -j fdb output")?;
    for e in fdb.as_array().into_iter().flatten() {
        let Some(dst) = text_field(e, "dst") else {
            continue;
        };
        state.fdb.push(format!(
            "{} dev {} dst {dst}",
            text_field(e, "mac").unwrap_or_default(),
            text_field(e, "ifname").unwrap_or_default()
        ));
    }
    state.routes.sort();
    state.neighbours.sort();
    state.fdb.sort();
    Ok(state)
}

/// The value of the first sample of metric `name` (exact name, any labels) on the agent's
/// `/metrics` at `127.0.0.1:port` in `ns`.
pub fn metric(ns: &NetNs, port: u16, name: &str) -> Result<Option<f64>> {
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let (code, body) = http_get(ns, addr, "/metrics")?;
    if code != 200 {
        bail!("/metrics answered {code}");
    }
    Ok(parse_metrics(&body)
        .into_iter()
        .find(|s| s.name == name)
        .map(|s| s.value))
}

/// The samples of metric `name` on the agent's `/metrics` at `127.0.0.1:port` in `ns` whose
/// label set contains `label` (e.g. `reason="fast_udp"`), summed.
pub fn metric_sum(ns: &NetNs, port: u16, name: &str, label: &str) -> Result<f64> {
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let (code, body) = http_get(ns, addr, "/metrics")?;
    ensure!(code == 200, "/metrics answered {code}");
    Ok(parse_metrics(&body)
        .into_iter()
        .filter(|s| s.name == name && s.labels.contains(label))
        .map(|s| s.value)
        .sum())
}

/// The lines of `argv`'s output in `ns`, trimmed, empty ones left out, as a set.
pub fn line_set(ns: &NetNs, argv: &[&str]) -> Result<BTreeSet<String>> {
    Ok(ns
        .run(argv)?
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect())
}

/// The routes of one family (`"-4"` or `"-6"`) the agent installed in `ns` (protocol 165),
/// one line each, without what the kernel adds by default (` metric 1024`, ` pref medium`)
/// and without the protocol.
pub fn agent_routes(ns: &NetNs, family: &str) -> Result<BTreeSet<String>> {
    Ok(
        line_set(ns, &["ip", family, "route", "show", "proto", "165"])?
            .into_iter()
            .map(|l| {
                l.replace(" metric 1024", "")
                    .replace(" pref medium", "")
                    .replace(" proto 165", "")
            })
            .collect(),
    )
}

/// Waits (up to [`CONVERGE`]) until [`agent_routes`] of `family` in `ns` are exactly `want`;
/// the error shows both. A wait, because a peer's lease reaches an agent through its watch a
/// moment after the peer wrote it.
pub fn expect_agent_routes(ns: &NetNs, family: &str, want: &BTreeSet<String>) -> Result<()> {
    wait::until_ok(CONVERGE, &format!("{}'s routes", ns.name()), || {
        let got = agent_routes(ns, family)?;
        ensure!(
            &got == want,
            "{} routes ({family}) {got:#?}, want {want:#?}",
            ns.name()
        );
        Ok(())
    })
}

/// The HTTP status of `path` (`/healthz`, `/readyz`) on the agent at `127.0.0.1:port` in
/// `ns`.
pub fn http_status(ns: &NetNs, port: u16, path: &str) -> Result<u16> {
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    Ok(http_get(ns, addr, path)?.0)
}

/// A plain HTTP/1.0 GET from inside `ns`; returns (status code, body).
pub fn http_get(ns: &NetNs, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    ns.enter(move || -> Result<(u16, String)> {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))
            .with_context(|| format!("connect {addr}"))?;
        stream.set_read_timeout(Some(Duration::from_secs(2)))?;
        stream.write_all(request.as_bytes())?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .with_context(|| format!("bad HTTP response from {addr}: {head:?}"))?;
        Ok((code, body.to_owned()))
    })?
}

/// One Prometheus sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name.
    pub name: String,
    /// `{...}` labels as written (empty if none).
    pub labels: String,
    /// Value.
    pub value: f64,
}

/// Parses the Prometheus text format (comments skipped, malformed lines ignored).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, rest) = match l.find('}') {
                Some(end) => (&l[..=end], &l[end + 1..]),
                None => l.split_once(' ')?,
            };
            let value = rest.split_whitespace().next()?.parse().ok()?;
            let (name, labels) = match series.find('{') {
                Some(start) => (&series[..start], &series[start..]),
                None => (series, ""),
            };
            Some(Sample {
                name: name.trim().to_owned(),
                labels: labels.to_owned(),
                value,
            })
        })
        .collect()
}

/// One line about the agent's `/metrics`: the dataplane info and packet/drop counters if it
/// exposes them, else how many samples it has; `n/a` if nothing answers.
pub fn metrics_line(ns: &NetNs, port: u16) -> String {
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let body = match http_get(ns, addr, "/metrics") {
        Ok((200, body)) => body,
        Ok((code, _)) => return format!("n/a (/metrics answered {code})"),
        Err(_) => return "n/a".to_owned(),
    };
    let samples = parse_metrics(&body);
    let interesting: Vec<String> = samples
        .iter()
        .filter(|s| {
            s.name.contains("dataplane") || s.name.contains("packets") || s.name.contains("drop")
        })
        .take(6)
        .map(|s| format!("{}{}={}", s.name, s.labels, s.value))
        .collect();
    if interesting.is_empty() {
        format!("{} samples", samples.len())
    } else {
        interesting.join(" ")
    }
}

/// `ok`, `not ready (<code>)` or `n/a` for `/healthz` and `/readyz`.
pub fn health_line(ns: &NetNs, port: u16) -> String {
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let mut parts = Vec::new();
    for path in ["/healthz", "/readyz"] {
        parts.push(match http_get(ns, addr, path) {
            Ok((200, _)) => format!("{path} ok"),
            Ok((code, _)) => format!("{path} {code}"),
            Err(_) => format!("{path} n/a"),
        });
    }
    parts.join(", ")
}

/// Fails unless `counts` has at least `routes`, `neighbours` and `fdb` entries (for
/// waiting loops that want a message).
pub fn require_counts(
    counts: &KernelCounts,
    routes: usize,
    neigh: usize,
    fdb: usize,
) -> Result<()> {
    if counts.routes < routes || counts.neighbours < neigh || counts.fdb < fdb {
        bail!(
            "kernel has {} routes, {} neighbours, {} FDB entries; want {routes}, {neigh}, {fdb}",
            counts.routes,
            counts.neighbours,
            counts.fdb
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text() {
        let text = "# HELP flannel_dataplane_info x\n# TYPE flannel_dataplane_info gauge\n\
                    flannel_dataplane_info{mode=\"ebpf\",backend=\"vxlan\"} 1\n\
                    flannel_leases 3\nbroken\n";
        let samples = parse_metrics(text);
        assert_eq!(
            samples,
            vec![
                Sample {
                    name: "flannel_dataplane_info".into(),
                    labels: "{mode=\"ebpf\",backend=\"vxlan\"}".into(),
                    value: 1.0
                },
                Sample {
                    name: "flannel_leases".into(),
                    labels: String::new(),
                    value: 3.0
                },
            ]
        );
    }

    #[test]
    fn route_dst_forms() {
        assert_eq!(parse_dst("10.244.1.0/24").map(|n| n.prefix_len()), Some(24));
        assert_eq!(parse_dst("10.244.1.0").map(|n| n.prefix_len()), Some(32));
        assert_eq!(parse_dst("default"), None);
    }
}
