//! A node's eBPF fast path seen from outside its agent: the pinned route map (what the agent
//! programmed), the ids of the pinned maps and TCX links (to prove a restarted agent adopted
//! them instead of creating new ones), and the per-reason packet counters and the active path
//! the agent reports on `/metrics`.
//!
//! The pins live on the host's bpffs (`--bpf-pin-path`, one directory per lab node), which the
//! test process sees directly: no namespace has to be entered to read them.

use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
};

use anyhow::{Context as _, Result, bail, ensure};
use aya::{
    maps::{Map, MapData, MapInfo, lpm_trie::Key, lpm_trie::LpmTrie},
    programs::links::{FdLink, PinnedLink},
};
use flannel_agent::bpf::PinLayout;
use flannel_common::{
    flow::FlowKey,
    maps as names, programs,
    route::{NodeEntry, RemoteEntry, RouteKind},
    stats::Reason,
    v6::{self, FlowKey6},
};
use ipnet::Ipv4Net;

use super::{
    status::{self, Sample},
    wait,
};
use crate::netns::NetNs;

/// One entry of the route map (`FLANNEL_ROUTES4`), decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `host-gw`, `vxlan`, `ipip` ([`RouteKind::name`]), or `kind <n>` for an unknown kind.
    pub kind: String,
    /// The peer's public IP.
    pub public_ip: Ipv4Addr,
    /// The VNI (vxlan only; 0 otherwise).
    pub vni: u32,
    /// The peer's VTEP MAC, `aa:bb:..` (vxlan only; all zero otherwise).
    pub vtep_mac: String,
    /// `ROUTE_F_*` bits.
    pub flags: u32,
}

impl Route {
    /// What a host-gw (or DirectRouting, with `flags` = `ROUTE_F_DIRECT`) peer looks like.
    pub fn host_gw(public_ip: Ipv4Addr, flags: u32) -> Route {
        Route {
            kind: RouteKind::HostGw.name().to_owned(),
            public_ip,
            vni: 0,
            vtep_mac: "00:00:00:00:00:00".to_owned(),
            flags,
        }
    }

    /// What a vxlan peer looks like.
    pub fn vxlan(public_ip: Ipv4Addr, vni: u32, vtep_mac: &str) -> Route {
        Route {
            kind: RouteKind::Vxlan.name().to_owned(),
            public_ip,
            vni,
            vtep_mac: vtep_mac.to_ascii_lowercase(),
            flags: 0,
        }
    }

    /// What an ipip peer looks like.
    pub fn ipip(public_ip: Ipv4Addr) -> Route {
        Route {
            kind: RouteKind::Ipip.name().to_owned(),
            public_ip,
            vni: 0,
            vtep_mac: "00:00:00:00:00:00".to_owned(),
            flags: 0,
        }
    }

    fn from_entry(e: &RemoteEntry) -> Route {
        let kind = match RouteKind::from_u32(e.kind) {
            Some(k) => k.name().to_owned(),
            None => format!("kind {}", e.kind),
        };
        let m = e.vtep_mac;
        Route {
            kind,
            public_ip: Ipv4Addr::from(e.public_ip),
            vni: e.vni,
            vtep_mac: format!(
                "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
                m[0], m[1], m[2], m[3], m[4], m[5]
            ),
            flags: e.flags,
        }
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} via {}", self.kind, self.public_ip)?;
        if self.vni != 0 || self.vtep_mac != "00:00:00:00:00:00" {
            write!(f, " vni {} mac {}", self.vni, self.vtep_mac)?;
        }
        if self.flags != 0 {
            write!(f, " flags {:#x}", self.flags)?;
        }
        Ok(())
    }
}

/// The route map of the fast path pinned under `pin_path`, opened once for repeated reads.
#[derive(Debug)]
pub struct RouteMap {
    trie: LpmTrie<MapData, [u8; 4], RemoteEntry>,
}

impl RouteMap {
    /// Opens `<pin_path>/<layout version>/FLANNEL_ROUTES4`.
    pub fn open(pin_path: &Path) -> Result<RouteMap> {
        let map = pinned_map(pin_path, names::ROUTES4)?;
        if !matches!(map, Map::LpmTrie(_)) {
            bail!("{} is not an LPM trie", names::ROUTES4);
        }
        let trie = LpmTrie::try_from(map).context("route map key/value sizes")?;
        Ok(RouteMap { trie })
    }

    /// Every entry.
    pub fn entries(&self) -> Result<BTreeMap<Ipv4Net, Route>> {
        let mut out = BTreeMap::new();
        for item in self.trie.iter() {
            let (key, value) = item.context("reading the route map")?;
            let net = Ipv4Net::new(Ipv4Addr::from(key.data()), key.prefix_len() as u8)
                .context("route map key")?;
            out.insert(net, Route::from_entry(&value));
        }
        Ok(out)
    }

    /// The number of entries.
    pub fn len(&self) -> Result<usize> {
        let mut n = 0;
        for key in self.trie.keys() {
            key.context("reading the route map")?;
            n += 1;
        }
        Ok(n)
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Deletes the entry of `subnet`, as `bpftool map delete` would behind the agent's back.
    pub fn remove(&mut self, subnet: Ipv4Net) -> Result<()> {
        let key = Key::new(u32::from(subnet.prefix_len()), subnet.network().octets());
        self.trie
            .remove(&key)
            .with_context(|| format!("deleting {subnet} from the route map"))
    }

    /// Points the entry of `subnet` at `public_ip`, as `bpftool map update` would behind the
    /// agent's back.
    pub fn repoint(&mut self, subnet: Ipv4Net, public_ip: Ipv4Addr) -> Result<()> {
        let key = Key::new(u32::from(subnet.prefix_len()), subnet.network().octets());
        let mut entry = self
            .trie
            .get(&key, 0)
            .with_context(|| format!("{subnet} in the route map"))?;
        entry.public_ip = public_ip.octets();
        self.trie
            .insert(&key, entry, 0)
            .with_context(|| format!("rewriting {subnet} in the route map"))
    }

    /// The entry stored for exactly `subnet` (longest-prefix match, then checked to be that
    /// prefix), `None` if there is none. One syscall: cheap enough to poll.
    pub fn get(&self, subnet: Ipv4Net) -> Result<Option<Route>> {
        let key = Key::new(u32::from(subnet.prefix_len()), subnet.network().octets());
        match self.trie.get(&key, 0) {
            Ok(entry) => Ok(Some(Route::from_entry(&entry))),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e).context("route map lookup"),
        }
    }
}

/// Every entry of the route map pinned under `pin_path`.
pub fn routes(pin_path: &Path) -> Result<BTreeMap<Ipv4Net, Route>> {
    RouteMap::open(pin_path)?.entries()
}

/// Kernel object ids of everything pinned under a pin path: equal ids before and after an
/// agent restart mean the new agent adopted the pins.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PinIds {
    /// Map name → map id, for the maps of this layout version.
    pub maps: BTreeMap<String, u32>,
    /// Link pin name (`<program>-<ifindex>`) → link id.
    pub links: BTreeMap<String, u32>,
    /// Link pin name → id of the program currently behind the link (changes when a new agent
    /// swaps its program in).
    pub programs: BTreeMap<String, u32>,
}

/// Reads the ids of the maps and links pinned under `pin_path`.
pub fn pin_ids(pin_path: &Path) -> Result<PinIds> {
    let mut ids = PinIds::default();
    let maps_dir = pin_path.join(names::PIN_LAYOUT_VERSION);
    for entry in
        std::fs::read_dir(&maps_dir).with_context(|| format!("reading {}", maps_dir.display()))?
    {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let info = MapInfo::from_pin(entry.path())
            .with_context(|| format!("map pin {}", entry.path().display()))?;
        ids.maps.insert(name, info.id());
    }
    let links_dir = pin_path.join(names::PIN_LINKS_DIR);
    for entry in
        std::fs::read_dir(&links_dir).with_context(|| format!("reading {}", links_dir.display()))?
    {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let link: FdLink = PinnedLink::from_pin(entry.path())
            .with_context(|| format!("link pin {}", entry.path().display()))?
            .into();
        let info = link.info().context("link info")?;
        ids.links.insert(name.clone(), info.id());
        ids.programs.insert(name, info.program_id());
    }
    Ok(ids)
}

/// The names of the programs attached through TCX to `dev` in `ns`, ingress and egress.
pub fn tcx_programs(ns: &NetNs, dev: &str) -> Result<Vec<String>> {
    let dev = dev.to_owned();
    ns.enter(move || -> Result<Vec<String>> {
        let mut names = Vec::new();
        for direction in [
            aya::programs::TcAttachType::Ingress,
            aya::programs::TcAttachType::Egress,
        ] {
            let (_, programs) = aya::programs::SchedClassifier::query_tcx(&dev, direction)
                .with_context(|| format!("querying TCX on {dev}"))?;
            names.extend(
                programs
                    .iter()
                    .filter_map(|p| p.name_as_str().map(str::to_owned)),
            );
        }
        Ok(names)
    })?
}

/// A fast-path counter family by `(program, reason)`.
pub type Counts = BTreeMap<(String, String), u64>;

/// The fast-path counters of one scrape.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// `flannel_fastpath_packets_total`
    pub packets: Counts,
    /// `flannel_fastpath_bytes_total`
    pub bytes: Counts,
}

impl Counters {
    /// Both families from the samples of one scrape.
    pub fn from_samples(samples: &[Sample]) -> Counters {
        Counters {
            packets: family(samples, "flannel_fastpath_packets_total"),
            bytes: family(samples, "flannel_fastpath_bytes_total"),
        }
    }
}

/// The samples of one counter family by `(program, reason)`.
pub fn family(samples: &[Sample], name: &str) -> Counts {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter_map(|s| {
            Some((
                (label(&s.labels, "program")?, label(&s.labels, "reason")?),
                s.value as u64,
            ))
        })
        .collect()
}

/// The value of label `name` in a `{a="x",b="y"}` label set.
pub fn label(labels: &str, name: &str) -> Option<String> {
    let inner = labels.strip_prefix('{')?.strip_suffix('}')?;
    inner.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"').to_owned())
    })
}

/// Every sample of the agent's `/metrics` at `127.0.0.1:port` in `ns`.
pub fn scrape(ns: &NetNs, port: u16) -> Result<Vec<Sample>> {
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
    let (code, body) = status::http_get(ns, addr, "/metrics")?;
    if code != 200 {
        bail!("/metrics answered {code}");
    }
    Ok(status::parse_metrics(&body))
}

/// The agent's fast-path counters.
pub fn counters(ns: &NetNs, port: u16) -> Result<Counters> {
    Ok(Counters::from_samples(&scrape(ns, port)?))
}

/// The `path` label of `flannel_dataplane_info` (`ebpf` or `kernel`), `None` if not exported.
pub fn active_path(ns: &NetNs, port: u16) -> Result<Option<String>> {
    Ok(scrape(ns, port)?
        .iter()
        .find(|s| s.name == "flannel_dataplane_info" && s.value == 1.0)
        .and_then(|s| label(&s.labels, "path")))
}

/// Fails unless the agent's active path ([`active_path`]) is `want` (`ebpf` or `kernel`).
pub fn expect_path(ns: &NetNs, port: u16, want: &str) -> Result<()> {
    let active = active_path(ns, port)?;
    if active.as_deref() != Some(want) {
        bail!("the agent's dataplane is {active:?}, not {want}");
    }
    Ok(())
}

/// Fails unless the agent's fast path takes the packets of at least `pods` pod bridge ports
/// (`flannel_fastpath_pod_ports`): the agent attaches to the ports shortly after it reports
/// the eBPF path, and until then pods' packets take the kernel path.
pub fn expect_pod_ports(ns: &NetNs, port: u16, pods: usize) -> Result<()> {
    let ports = status::metric_sum(ns, port, "flannel_fastpath_pod_ports", "")?;
    if ports < pods as f64 {
        bail!("the fast path is on {ports} pod port(s), not yet on {pods}");
    }
    Ok(())
}

/// The fast-path counters read from the pinned counter maps under `pin_path` (the same
/// `(program, reason)` keys as [`counters`]): readable while no agent runs, so a test can
/// see the programs go on counting, i.e. stay attached, while the agent is down.
pub fn pinned_counters(pin_path: &Path) -> Result<Counters> {
    let read = flannel_agent::bpf::Counters::read_pinned(pin_path)
        .with_context(|| format!("the counters pinned under {}", pin_path.display()))?;
    let mut out = Counters::default();
    for (program, per_reason) in read.by_program() {
        for (reason, c) in per_reason.nonzero() {
            let key = (program.to_owned(), reason.name().to_owned());
            out.packets.insert(key.clone(), c.packets);
            out.bytes.insert(key, c.bytes);
        }
    }
    Ok(out)
}

/// Packets the agent's fast path counted under `reason`, summed over its programs.
pub fn packets(ns: &NetNs, port: u16, reason: &str) -> Result<f64> {
    status::metric_sum(
        ns,
        port,
        "flannel_fastpath_packets_total",
        &format!("reason=\"{reason}\""),
    )
}

/// How much counter `(program, reason)` grew from `before` to `after`.
pub fn grown(before: &Counts, after: &Counts, program: &str, reason: &str) -> u64 {
    let key = (program.to_owned(), reason.to_owned());
    after
        .get(&key)
        .copied()
        .unwrap_or(0)
        .saturating_sub(before.get(&key).copied().unwrap_or(0))
}

/// The counters that grew from `before` to `after`, as `program/reason +n` (for messages).
pub fn growth_text(before: &Counts, after: &Counts) -> String {
    let parts: Vec<String> = after
        .iter()
        .filter_map(|((p, r), v)| {
            let d = v.saturating_sub(before.get(&(p.clone(), r.clone())).copied().unwrap_or(0));
            (d > 0).then(|| format!("{p}/{r} +{d}"))
        })
        .collect();
    if parts.is_empty() {
        "no counter moved".to_owned()
    } else {
        parts.join(", ")
    }
}

/// The program that handles a pod's packet to a remote pod on the sending node, and the
/// reason it counts a fast-pathed packet under, for a route of `kind` (`host-gw`, `vxlan`,
/// `ipip`).
pub fn egress_reason(kind: &str) -> Option<(&'static str, &'static str)> {
    let reason = match kind {
        "host-gw" => Reason::FastHostGw,
        "vxlan" => Reason::FastVxlan,
        "ipip" => Reason::FastIpip,
        _ => return None,
    };
    Some((programs::TC_FROM_BRIDGE, reason.name()))
}

/// The program and reason a fast path counts a packet from a remote pod under when it
/// delivers it to a local pod, for a peer reached by `kind`.
pub fn ingress_reason(kind: &str) -> Option<(&'static str, &'static str)> {
    let reason = match kind {
        "host-gw" => Reason::FastDeliver,
        "vxlan" => Reason::FastDeliverVxlan,
        "ipip" => Reason::FastDeliverIpip,
        _ => return None,
    };
    Some((programs::TC_FROM_NETDEV, reason.name()))
}

/// The tunnel peers map (`FLANNEL_NODES4`) pinned under `pin_path`: public IP → `NODE_F_*`
/// flags.
pub fn tunnel_peers(pin_path: &Path) -> Result<BTreeMap<Ipv4Addr, u32>> {
    let hash: aya::maps::HashMap<MapData, [u8; 4], NodeEntry> =
        aya::maps::HashMap::try_from(pinned_map(pin_path, names::NODES4)?)
            .context("nodes map key/value sizes")?;
    let mut out = BTreeMap::new();
    for item in hash.iter() {
        let (ip, entry) = item.context("reading the nodes map")?;
        out.insert(Ipv4Addr::from(ip), entry.flags);
    }
    Ok(out)
}

/// The external interface index the programs pinned under `pin_path` are configured with,
/// IPv4 and IPv6 (0 for a side that is disabled).
pub fn config_ext_ifindex(pin_path: &Path) -> Result<(u32, u32)> {
    let v4: aya::maps::Array<MapData, flannel_common::config::Config> =
        aya::maps::Array::try_from(pinned_map(pin_path, names::CONFIG)?)
            .context("config map value size")?;
    let v6: aya::maps::Array<MapData, v6::Config6> =
        aya::maps::Array::try_from(pinned_map(pin_path, v6::CONFIG6)?)
            .context("IPv6 config map value size")?;
    Ok((
        v4.get(&0, 0).context("reading the config map")?.ext_ifindex,
        v6.get(&0, 0)
            .context("reading the IPv6 config map")?
            .ext_ifindex,
    ))
}

/// The map `name` of the layout pinned under `pin_path` (the agent's [`PinLayout`]).
fn pinned_map(pin_path: &Path, name: &str) -> Result<Map> {
    let path = PinLayout::new(pin_path).map(name);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    Map::from_map_data(data).with_context(|| format!("map {name}"))
}

/// The key of a kernel-flow table: [`FlowKey`] in `FLANNEL_KFLOWS4`, [`FlowKey6`] in
/// `FLANNEL_KFLOWS6`.
pub trait KernelFlowKey: aya::Pod + fmt::Debug {
    /// The table's pinned name.
    const TABLE: &'static str;
    /// The pinned name of its held twin (written by the agent from conntrack).
    const HELD: &'static str;
}

impl KernelFlowKey for FlowKey {
    const TABLE: &'static str = names::KERNEL_FLOWS4;
    const HELD: &'static str = names::HELD_FLOWS4;
}

impl KernelFlowKey for FlowKey6 {
    const TABLE: &'static str = v6::KERNEL_FLOWS6;
    const HELD: &'static str = v6::HELD_FLOWS6;
}

/// The kernel-flow table of `K`s pinned under `pin_path`.
fn kernel_flow_table<K: KernelFlowKey>(
    pin_path: &Path,
) -> Result<aya::maps::HashMap<MapData, K, u32>> {
    aya::maps::HashMap::try_from(pinned_map(pin_path, K::TABLE)?)
        .with_context(|| format!("{}: key/value sizes", K::TABLE))
}

/// The keys of the held kernel-flow table of `K`s pinned under `pin_path`.
pub fn held_kernel_flows<K: KernelFlowKey>(pin_path: &Path) -> Result<Vec<K>> {
    let table: aya::maps::HashMap<MapData, K, u32> =
        aya::maps::HashMap::try_from(pinned_map(pin_path, K::HELD)?)
            .with_context(|| format!("{}: key/value sizes", K::HELD))?;
    keys_of(&table)
}

/// The keys of `table`.
fn keys_of<K: KernelFlowKey>(table: &aya::maps::HashMap<MapData, K, u32>) -> Result<Vec<K>> {
    table
        .keys()
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading {}", K::TABLE))
}

/// The keys of the kernel-flow table of `K`s pinned under `pin_path`.
pub fn kernel_flows<K: KernelFlowKey>(pin_path: &Path) -> Result<Vec<K>> {
    keys_of(&kernel_flow_table(pin_path)?)
}

/// Empties the kernel-flow table of `K`s pinned under `pin_path`, as the LRU's eviction
/// would; returns how many entries it removed.
pub fn clear_kernel_flows<K: KernelFlowKey>(pin_path: &Path) -> Result<usize> {
    let mut table = kernel_flow_table::<K>(pin_path)?;
    let keys = keys_of(&table)?;
    for key in &keys {
        table.remove(key).context("removing a kernel flow")?;
    }
    Ok(keys.len())
}

/// The agent in `ns` (metrics on `port`, pins under `pin_path`) learns the idle connection
/// whose kernel-flow key `ours` matches within `timeout`; then its table is emptied, as the
/// LRU's eviction would, and the agent must put the entry back from conntrack within
/// `timeout` (its `--ebpf-conntrack-resync`) and count it in
/// `flannel_fastpath_conntrack_kept_total{kind="kernel_flow"}`; the flow must not be held
/// (a held one is kept in the held table, not put back into this one). Returns that count
/// after.
pub fn kernel_flow_comes_back<K: KernelFlowKey>(
    ns: &NetNs,
    port: u16,
    pin_path: &Path,
    ours: impl Fn(&K) -> bool,
    timeout: std::time::Duration,
) -> Result<f64> {
    let present = || {
        let flows = kernel_flows::<K>(pin_path)?;
        ensure!(flows.iter().any(&ours), "{}: {flows:?}", K::TABLE);
        Ok(())
    };
    let kept = || {
        status::metric_sum(
            ns,
            port,
            "flannel_fastpath_conntrack_kept_total",
            "kind=\"kernel_flow\"",
        )
    };
    wait::until_ok(timeout, "the agent to learn the connection", present)?;
    // Idle: the last ACKs (which the programs would learn from again) are out before the
    // entry goes.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let before = kept()?;
    let removed = clear_kernel_flows::<K>(pin_path)?;
    ensure!(removed >= 1, "{} was empty", K::TABLE);
    wait::until_ok(
        timeout,
        "the connection's entry back from conntrack",
        present,
    )?;
    let after = kept()?;
    ensure!(
        after >= before + 1.0,
        "the agent counted {before} then {after} kernel flows kept from conntrack"
    );
    ensure!(
        !held_kernel_flows::<K>(pin_path)?.iter().any(&ours),
        "the flow is held: it was to come back to {}",
        K::TABLE
    );
    Ok(after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_counts() {
        let samples = status::parse_metrics(
            "flannel_fastpath_packets_total{program=\"tc_from_bridge\",reason=\"fast_vxlan\"} 7\n\
             flannel_fastpath_bytes_total{program=\"tc_from_bridge\",reason=\"fast_vxlan\"} 700\n\
             flannel_dataplane_info{path=\"ebpf\",backend=\"vxlan\"} 1\n",
        );
        let both = Counters::from_samples(&samples);
        assert_eq!(
            both.bytes
                .get(&("tc_from_bridge".to_owned(), "fast_vxlan".to_owned())),
            Some(&700)
        );
        let counts = both.packets;
        assert_eq!(
            counts.get(&("tc_from_bridge".to_owned(), "fast_vxlan".to_owned())),
            Some(&7)
        );
        assert_eq!(counts.len(), 1);
        assert_eq!(
            label("{path=\"ebpf\",backend=\"vxlan\"}", "backend").as_deref(),
            Some("vxlan")
        );
        assert_eq!(label("", "path"), None);
        let mut after = counts.clone();
        *after
            .entry(("tc_from_bridge".to_owned(), "fast_vxlan".to_owned()))
            .or_default() += 5;
        assert_eq!(grown(&counts, &after, "tc_from_bridge", "fast_vxlan"), 5);
        assert_eq!(growth_text(&counts, &after), "tc_from_bridge/fast_vxlan +5");
        assert_eq!(egress_reason("ipip"), Some(("tc_from_bridge", "fast_ipip")));
        assert_eq!(
            ingress_reason("vxlan"),
            Some(("tc_from_netdev", "fast_deliver_vxlan"))
        );
    }

    #[test]
    fn route_display() {
        let r = Route::vxlan(Ipv4Addr::new(192, 168, 1, 12), 1, "0E:00:00:00:00:01");
        assert_eq!(
            r.to_string(),
            "vxlan via 192.168.1.12 vni 1 mac 0e:00:00:00:00:01"
        );
        assert_eq!(
            Route::host_gw(Ipv4Addr::new(192, 168, 1, 12), 0).to_string(),
            "host-gw via 192.168.1.12"
        );
    }
}
