//! [`FastPath`]: the loaded object, its pinned maps and its TC attachments (pinned TCX links,
//! or `clsact` filters on kernels without TCX, see [`super::tcfilter`]).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    ffi::CStr,
    fs,
    net::Ipv4Addr,
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, LpmTrie, MapData, lpm_trie::Key},
    programs::{
        LinkOrder, SchedClassifier, TcAttachType, Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcAttachOptions},
        xdp::XdpLink,
    },
};
use flannel_common::{
    config::Config,
    maps as names,
    memo::{GEN_AGENT, LEARN_GEN, MEMO_GEN, MEMO_ROUTES, MEMO4, MEMO6, generation},
    programs,
    route::{NodeEntry, RemoteEntry, RouteKind},
};
use ipnet::Ipv4Net;

use super::{
    BpfError, LocalConfig, Remote, SyncStats, batch,
    counters::Counters,
    pins::{MAP_SPECS, PinLayout, remove_pin},
    probe::{probe, tcx_supported},
    remote::{DesiredEntries, desired_entries, diff},
    tcfilter,
};

/// The three attach points of the fast path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    /// `tc_from_bridge` on TC ingress of the pod bridge's ports (or of the bridge itself).
    FromBridge,
    /// `tc_from_netdev` on TC ingress of the external interface.
    FromNetdev,
    /// `tc_to_netdev` on TC egress of the external interface.
    ToNetdev,
}

impl Hook {
    /// Every hook.
    pub const ALL: [Hook; 3] = [Hook::FromBridge, Hook::FromNetdev, Hook::ToNetdev];

    /// The program attached there.
    pub fn program(self) -> &'static str {
        match self {
            Hook::FromBridge => programs::TC_FROM_BRIDGE,
            Hook::FromNetdev => programs::TC_FROM_NETDEV,
            Hook::ToNetdev => programs::TC_TO_NETDEV,
        }
    }

    /// Where in TC the program runs.
    pub fn attach_type(self) -> TcAttachType {
        match self {
            Hook::FromBridge | Hook::FromNetdev => TcAttachType::Ingress,
            Hook::ToNetdev => TcAttachType::Egress,
        }
    }
}

/// What [`FastPath::attach_netdev`] did on the external interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetdevAttach {
    /// `tc_from_netdev` on TC ingress.
    pub ingress: Attached,
    /// `tc_to_netdev` on TC egress.
    pub egress: Attached,
    /// `xdp_from_netdev` in native XDP mode; `None` when the driver has no native XDP (the TC
    /// programs then decapsulate on their own, after GRO).
    pub xdp: Option<Attached>,
}

/// What [`FastPath::attach_ports`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortAttach {
    /// Ports that got the program (new or adopted links).
    pub attached: usize,
    /// Links removed (ports gone, other interfaces).
    pub detached: usize,
}

/// How the TC programs are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TcAttach {
    /// TCX links, pinned under `<pin path>/links/` (Linux 6.6 and later).
    Tcx,
    /// Direct-action `bpf` filters under a `clsact` qdisc ([`super::tcfilter`]): kernels
    /// without TCX.
    Clsact,
}

impl std::fmt::Display for TcAttach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TcAttach::Tcx => "tcx",
            TcAttach::Clsact => "clsact",
        })
    }
}

/// What an attach call did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    /// A new TCX link was created and pinned (or a new `clsact` filter added).
    New,
    /// A pinned link (or our filter) from an earlier run now runs this object's program: the
    /// swap is atomic, no packet meets an empty hook.
    Replaced,
    /// This handle had already attached the program there.
    Already,
}

/// How far the programs' clock (`bpf_ktime_get_coarse_ns`) may lag `CLOCK_MONOTONIC`: a
/// timer tick, 10 ms at `HZ=100`; with room to spare.
const CLOCK_LAG_NS: u64 = 100_000_000;

/// The time from which a carry of resized NAT maps started now is to take the entries the
/// programs stamp (see [`super::nat::Carry`]).
fn carry_clock() -> u64 {
    super::nat::monotonic_ns().saturating_sub(CLOCK_LAG_NS)
}

/// A link this handle holds, and where it is pinned.
#[derive(Debug)]
struct HeldLink {
    path: PathBuf,
    /// A descriptor of the link, opened through the pin (aya's `FdLink` does not lend its
    /// own): it keeps the link referenced while this handle lives (the pin keeps it
    /// afterwards), and is what [`FastPath::heal`] asks whether the link is still attached,
    /// and pins again when the pin was removed.
    fd: OwnedFd,
}

impl HeldLink {
    /// `link`, just pinned (or adopted from the pin) at `path`: held through a descriptor of
    /// our own from then on.
    fn new(path: PathBuf, link: FdLink) -> std::io::Result<HeldLink> {
        let fd = super::attached::open_pinned(&path)?;
        drop(link);
        Ok(HeldLink { path, fd })
    }
}

/// A TC attachment this handle made or adopted.
#[derive(Debug)]
enum TcHeld {
    /// A pinned TCX link.
    Link(HeldLink),
    /// Our `clsact` filter (it lives in the kernel; nothing to hold).
    Filter,
}

/// The eBPF fast path of one agent: the loaded programs, the pinned maps under
/// `<pin path>/v1/` and the TC attachments: pinned TCX links under `<pin path>/links/`, or
/// `clsact` filters.
///
/// Dropping it leaves everything attached and pinned: packets keep flowing with the last map
/// contents until the next agent adopts them ([`FastPath::load`] + `attach_*`) or
/// [`super::cleanup`] removes them.
#[derive(Debug)]
pub struct FastPath {
    ebpf: Ebpf,
    layout: PinLayout,
    tc_attach: TcAttach,
    links: HashMap<(Hook, u32), TcHeld>,
    /// The hooks whose filters on other interfaces were looked for (once per handle: an
    /// earlier run's, see [`tcfilter::sweep`]).
    swept: BTreeSet<Hook>,
    xdp_links: HashMap<u32, HeldLink>,
    loaded: Vec<super::programs::Loaded>,
    /// The old instances of resized NAT maps, pinned aside until the new programs are
    /// attached ([`FastPath::attach_netdev`]): the old programs use them until then.
    resizing: Vec<(&'static str, aya::maps::Map)>,
    /// When the last carry from them started ([`carry_clock`]).
    resized_at: u64,
    /// Attachments that something else removed and that [`FastPath::heal`] could not make
    /// again: tried again at the next heal.
    unhealed: BTreeSet<(Hook, u32)>,
    /// What the last successful [`FastPath::sync`] and [`FastPath::sync6`] wrote, for
    /// [`FastPath::drift`].
    pub(super) synced: Box<super::drift::Synced>,
}

/// One of a fast path's TC attachments that something else removed, and what
/// [`FastPath::heal`] did about it.
#[derive(Debug)]
pub struct Healed {
    pub hook: Hook,
    pub ifindex: u32,
    /// `Ok(true)`: attached again; `Ok(false)`: the interface is gone, and the attachment with
    /// it; `Err`: attaching again failed (tried again at the next heal).
    pub outcome: Result<bool, BpfError>,
}

/// What [`FastPath::load_with`] decides at load time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Flows each of the NAT maps (`FLANNEL_NAT4`, `FLANNEL_NATREV4`) holds
    /// (`--ebpf-nat-max-entries`; see [`super::nat::NatSizing`]).
    pub nat_max_entries: u32,
    /// Connections each held flow table holds, per family; the guard tables a quarter
    /// (`--ebpf-held-max-entries`; see [`super::held::HeldSizing`]).
    pub held_max_entries: u32,
    /// How to attach the TC programs (`--tc-attach`); `None`: TCX where the kernel has it,
    /// `clsact` filters otherwise.
    pub tc_attach: Option<TcAttach>,
}

impl Default for LoadOptions {
    /// The object's defaults.
    fn default() -> Self {
        LoadOptions {
            nat_max_entries: names::NAT4_DEFAULT_MAX_ENTRIES,
            held_max_entries: super::held::HELD_MIN_ENTRIES,
            tc_attach: None,
        }
    }
}

impl FastPath {
    /// [`FastPath::load_with`] with the object's default map sizes.
    pub fn load(pin_path: &Path) -> Result<FastPath, BpfError> {
        FastPath::load_with(pin_path, &LoadOptions::default())
    }

    /// Probes the kernel, loads the embedded object with its maps pinned under
    /// `<pin_path>/<layout version>/` (adopting compatible pinned maps with their entries) and
    /// loads the three programs into the kernel. Nothing is attached yet.
    ///
    /// Pinned NAT maps of another size than `options` asks for are replaced by maps of the new
    /// size holding their entries (as many as fit), so resizing does not reset the
    /// masqueraded connections. The old maps stay pinned aside ([`PinLayout::resizing_dir`])
    /// until the new programs are attached, when what the old programs made or updated in
    /// them since is carried over too ([`FastPath::attach_netdev`]); a start that dies before
    /// leaves them to the next, which copies them again. Held flow tables of another size are
    /// created afresh, empty: the conntrack read before the attach fills them.
    pub fn load_with(pin_path: &Path, options: &LoadOptions) -> Result<FastPath, BpfError> {
        if crate::EBPF_OBJECT.is_empty() {
            return Err(BpfError::NoObject);
        }
        for (field, size) in [
            ("NAT map size", options.nat_max_entries),
            ("held flow table size", options.held_max_entries),
        ] {
            if size == 0 {
                return Err(BpfError::Invalid {
                    field,
                    value: "0".into(),
                    reason: "a map holds at least one entry",
                });
            }
        }
        probe()?;
        let tcx = tcx_supported();
        let tc_attach = match options.tc_attach {
            None if tcx => TcAttach::Tcx,
            None => TcAttach::Clsact,
            Some(TcAttach::Tcx) if !tcx => {
                return Err(BpfError::Unsupported {
                    what: format!(
                        "TCX links (Linux >= {}.{}; --tc-attach=clsact works without them)",
                        super::probe::TCX_KERNEL.0,
                        super::probe::TCX_KERNEL.1
                    ),
                });
            }
            Some(mode) => mode,
        };
        let layout = PinLayout::new(pin_path);
        layout.prepare()?;
        let sizes = [
            (names::NAT4, options.nat_max_entries),
            (names::NAT_REV4, options.nat_max_entries),
        ];
        let resized = super::nat::take_resized(&layout, &sizes)?;
        let held = super::held::held_sizes(options.held_max_entries);
        for (name, from, to) in layout.drop_resized(&held)? {
            tracing::info!(
                map = name,
                from,
                to,
                "held flow table resized; conntrack's next read fills it"
            );
        }
        let sizes: Vec<(&'static str, u32)> = sizes.into_iter().chain(held).collect();
        for name in layout.drop_incompatible_maps_sized(&sizes)? {
            tracing::warn!(
                map = name,
                "pinned map does not match this build's layout; creating it afresh"
            );
        }
        let paths: Vec<(&'static str, PathBuf)> = MAP_SPECS
            .iter()
            .map(|spec| (spec.name, layout.map(spec.name)))
            .collect();
        let mut loader = EbpfLoader::new();
        for (name, path) in &paths {
            loader.map_pin_path(name, path.as_path());
        }
        for (name, size) in sizes {
            loader.map_max_entries(name, size);
        }
        let mut ebpf = loader
            .load(crate::EBPF_OBJECT)
            .map_err(|e| BpfError::Load(Box::new(e)))?;
        let mut resizing = Vec::new();
        let resized_at = carry_clock();
        for (name, old) in resized {
            let old = aya::maps::Map::from_map_data(old).map_err(|e| BpfError::map(name, e))?;
            let copied = super::nat::carry_over(&ebpf, name, &old, super::nat::Carry::All)?;
            tracing::info!(
                map = name,
                entries = copied,
                size = options.nat_max_entries,
                "NAT map resized; entries carried over"
            );
            resizing.push((name, old));
        }
        let loaded = super::programs::load_all(&mut ebpf)?;
        tracing::info!(
            programs = %loaded.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
            "eBPF programs loaded"
        );
        Ok(FastPath {
            ebpf,
            layout,
            tc_attach,
            links: HashMap::new(),
            swept: BTreeSet::new(),
            xdp_links: HashMap::new(),
            loaded,
            resizing,
            resized_at,
            unhealed: BTreeSet::new(),
            synced: Box::default(),
        })
    }

    /// The programs as loaded: what the verifier processed, how long each load took.
    pub fn loaded(&self) -> &[super::programs::Loaded] {
        &self.loaded
    }

    /// How this handle attaches the TC programs.
    pub fn tc_attach(&self) -> TcAttach {
        self.tc_attach
    }

    /// The size (`max_entries`) of map `name` as loaded: created at the size asked for, or
    /// adopted from its pin.
    pub(super) fn capacity(&self, name: &'static str) -> Result<u32, BpfError> {
        aya::maps::MapInfo::from_pin(self.layout.map(name))
            .map(|info| info.max_entries())
            .map_err(|e| BpfError::map(name, e))
    }

    /// The pin layout in use.
    pub fn pins(&self) -> &PinLayout {
        &self.layout
    }

    /// The loaded object, for the modules that add maps of their own (`nat`, `udp`, `v6`).
    pub(crate) fn ebpf(&self) -> &Ebpf {
        &self.ebpf
    }

    /// Mutable access to the loaded object (see [`FastPath::ebpf`]).
    pub(crate) fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    /// Writes the local configuration (validated first). Until it is written, the programs
    /// hand every packet to the kernel.
    pub fn set_config(&mut self, config: &LocalConfig) -> Result<(), BpfError> {
        let entry = config.to_entry()?;
        let mut map = self.array_mut()?;
        map.set(0, entry, 0)
            .map_err(|e| BpfError::map(names::CONFIG, e))?;
        self.retire_memos()
    }

    /// Retires every remembered per-flow decision of the programs
    /// ([`flannel_common::memo`]): called after each change of a map they rest on (routes,
    /// nodes, pod ports, configuration); the tests call it to have the full checks decide a
    /// packet a memo decided.
    pub fn retire_memos(&mut self) -> Result<(), BpfError> {
        let mut map = self.memo_gen_mut()?;
        let agent = map
            .get(&GEN_AGENT, 0)
            .map_err(|e| BpfError::map(MEMO_GEN, e))?;
        map.set(GEN_AGENT, agent.wrapping_add(1), 0)
            .map_err(|e| BpfError::map(MEMO_GEN, e))
    }

    /// The generation the programs' memos of flows whose remote endpoint falls in learn slot
    /// `slot` ([`flannel_common::memo::learn_slot`]) must carry to be used: that slot's
    /// counter and the agent's, summed.
    pub fn memo_generation(&self, slot: u32) -> Result<u64, BpfError> {
        let counter = |name: &'static str, index: u32| -> Result<u64, BpfError> {
            let map = self.ebpf.map(name).ok_or_else(|| missing(name))?;
            let array: Array<&MapData, u64> =
                Array::try_from(map).map_err(|e| BpfError::map(name, e))?;
            array.get(&index, 0).map_err(|e| BpfError::map(name, e))
        };
        Ok(generation(
            counter(LEARN_GEN, slot)?,
            counter(MEMO_GEN, GEN_AGENT)?,
        ))
    }

    fn memo_gen_mut(&mut self) -> Result<Array<&mut MapData, u64>, BpfError> {
        let map = self
            .ebpf
            .map_mut(MEMO_GEN)
            .ok_or_else(|| missing(MEMO_GEN))?;
        Array::try_from(map).map_err(|e| BpfError::map(MEMO_GEN, e))
    }

    /// The configuration entry as the programs see it.
    pub fn config_entry(&self) -> Result<Config, BpfError> {
        let map = self
            .ebpf
            .map(names::CONFIG)
            .ok_or_else(|| missing(names::CONFIG))?;
        let array: Array<&MapData, Config> =
            Array::try_from(map).map_err(|e| BpfError::map(names::CONFIG, e))?;
        array
            .get(&0, 0)
            .map_err(|e| BpfError::map(names::CONFIG, e))
    }

    /// Makes the route and node maps hold exactly `desired` (remote subnet → how to reach it):
    /// diffs it against what the maps hold, writes only new and changed entries, deletes the
    /// rest. What they hold is what the last sync wrote, unless the maps may hold something
    /// else ([`super::drift`]): then they are read. Idempotent; a restarted agent calling it
    /// with the same set changes nothing.
    pub fn sync(&mut self, desired: &BTreeMap<Ipv4Net, Remote>) -> Result<SyncStats, BpfError> {
        let DesiredEntries { routes, nodes } = desired_entries(desired)?;

        let (current_nodes, current_routes, invalid_keys) = match self.synced.v4.take() {
            Some(written) => (written.nodes, written.routes, Vec::new()),
            None => {
                let CurrentRoutes { routes, invalid } = self.current_routes()?;
                (self.current_nodes()?, routes, invalid)
            }
        };
        let (node_upserts, node_deletes, _, _) = diff(&current_nodes, &nodes);
        let (route_upserts, route_deletes, added, unchanged) = diff(&current_routes, &routes);

        let stats = SyncStats {
            added,
            updated: route_upserts.len() - added,
            removed: route_deletes.len() + invalid_keys.len(),
            unchanged,
            nodes_written: node_upserts.len(),
            nodes_removed: node_deletes.len(),
        };
        {
            let mut map = self.nodes_mut()?;
            for (addr, entry) in &node_upserts {
                map.insert(addr.octets(), entry, 0)
                    .map_err(|e| BpfError::map(names::NODES4, e))?;
            }
        }
        {
            let mut trie = self.routes_mut()?;
            for (net, entry) in &route_upserts {
                trie.insert(&route_key(net), entry, 0)
                    .map_err(|e| BpfError::map(names::ROUTES4, e))?;
            }
            for net in &route_deletes {
                remove_ignoring_missing(trie.remove(&route_key(net)), names::ROUTES4)?;
            }
            for key in &invalid_keys {
                remove_ignoring_missing(trie.remove(key), names::ROUTES4)?;
            }
        }
        {
            let mut map = self.nodes_mut()?;
            for addr in &node_deletes {
                remove_ignoring_missing(map.remove(&addr.octets()), names::NODES4)?;
            }
        }
        // The transmit memos are for host-gw, VXLAN and IPIP flows only: `tc_from_bridge`
        // looks for one only while some subnet is reached so.
        let remembered = routes.values().any(|entry| {
            [RouteKind::HostGw, RouteKind::Vxlan, RouteKind::Ipip]
                .iter()
                .any(|kind| entry.kind == *kind as u32)
        });
        self.memo_gen_mut()?
            .set(MEMO_ROUTES, u64::from(remembered), 0)
            .map_err(|e| BpfError::map(MEMO_GEN, e))?;
        let changed = !(node_upserts.is_empty()
            && node_deletes.is_empty()
            && route_upserts.is_empty()
            && route_deletes.is_empty()
            && invalid_keys.is_empty());
        if changed {
            self.retire_memos()?;
        }
        self.synced.v4.entries = Some(DesiredEntries { routes, nodes });
        Ok(stats)
    }

    /// The remote subnets the route map holds (invalid entries are left out).
    pub fn remotes(&self) -> Result<BTreeMap<Ipv4Net, Remote>, BpfError> {
        let routes = self.current_routes()?.routes;
        Ok(routes
            .iter()
            .filter_map(|(net, entry)| Some((*net, Remote::from_entry(entry)?)))
            .collect())
    }

    /// Attaches `tc_from_netdev` (ingress) and `tc_to_netdev` (egress) to the external
    /// interface and, with `xdp`, `xdp_from_netdev` in native XDP mode if the driver supports
    /// it, replacing the programs of pinned links from an earlier run atomically; links of these
    /// programs on other interfaces are removed (and the XDP link when `xdp` is false). Then
    /// removes older layout versions' pins. Call [`FastPath::set_config`] and
    /// [`FastPath::sync`] first: a replaced program starts using this object's maps at once.
    /// After a NAT map resize, the old maps' flows are carried over right before and right
    /// after the two TC programs are replaced, and the old maps unpinned.
    ///
    /// Pass `xdp: false` by default: decapsulating in XDP (before GRO) only pays on NICs whose
    /// driver runs native XDP with GRO behind it; on veth it cost throughput (see
    /// `flannel_ebpf::xdp`).
    pub fn attach_netdev(&mut self, ifindex: u32, xdp: bool) -> Result<NetdevAttach, BpfError> {
        // A resize's old programs still run, into the old NAT maps: what they did since the
        // load copied them is carried over right before both hooks switch, back to back, and
        // again right after (then the old maps go), so that replies the new programs see
        // find their flows.
        let since = carry_clock();
        let carried = self.carry_resized(super::nat::Carry::Since(self.resized_at))?;
        let ingress = self.attach_one(Hook::FromNetdev, ifindex)?;
        let egress = self.attach_one(Hook::ToNetdev, ifindex)?;
        self.end_resizes(&carried, super::nat::Carry::SinceIfNewer(since))?;
        self.resized_at = since;
        let here = BTreeSet::from([ifindex]);
        self.prune(Hook::FromNetdev, &here)?;
        self.prune(Hook::ToNetdev, &here)?;
        if let Err(e) = self.pin_memos() {
            tracing::warn!(
                error = %e,
                "cannot pin the flow memo maps: the way back to the kernel path can find the \
                 programs' connections only with CAP_SYS_ADMIN"
            );
        }
        if !xdp {
            self.detach_xdp()?;
        }
        let xdp = if !xdp {
            None
        } else {
            match self.attach_xdp(ifindex) {
                Ok(outcome) => Some(outcome),
                Err(e) => {
                    tracing::info!(
                        ifindex,
                        error = %e,
                        "no native XDP on the external interface; TC decapsulates alone"
                    );
                    None
                }
            }
        };
        for old in self.layout.prune_old_versions()? {
            tracing::info!(path = %old.display(), "removed an older layout version's pins");
        }
        Ok(NetdevAttach {
            ingress,
            egress,
            xdp,
        })
    }

    /// Carries over, from the old instances of resized NAT maps, the flows the old programs
    /// made or updated, as `how` says; how many per map.
    fn carry_resized(
        &self,
        how: super::nat::Carry,
    ) -> Result<Vec<(&'static str, usize)>, BpfError> {
        self.resizing
            .iter()
            .map(|(name, old)| Ok((*name, super::nat::carry_over(&self.ebpf, name, old, how)?)))
            .collect()
    }

    /// Once the new programs are attached (the old ones no longer run): the last
    /// [`FastPath::carry_resized`] (`how`), then the old instances are unpinned. `before`:
    /// what the carry right before the attach wrote.
    fn end_resizes(
        &mut self,
        before: &[(&'static str, usize)],
        how: super::nat::Carry,
    ) -> Result<(), BpfError> {
        for (name, carried) in self.carry_resized(how)? {
            super::nat::end_resize(&self.layout, name)?;
            let before = before
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(0, |(_, c)| *c);
            tracing::info!(
                map = name,
                entries = before + carried,
                "NAT map resize done; entries the old programs made or updated since the load \
                 carried over"
            );
        }
        self.resizing.clear();
        Ok(())
    }

    /// Pins this object's flow memo maps under [`PinLayout::memos_dir`], in place of those of
    /// the programs attached before: now that its programs run, their memos hold the flows
    /// the way back to the kernel path hands over ([`super::handover`]), which it reads there.
    /// Each is pinned under a temporary name and renamed over the old pin, so that one of the
    /// two is always there, even if the agent dies meanwhile.
    fn pin_memos(&self) -> Result<(), BpfError> {
        for name in [MEMO4, MEMO6] {
            let map = self.ebpf.map(name).ok_or_else(|| missing(name))?;
            let path = self.layout.memo(name);
            let fresh = self.layout.memo(&format!("{name}_new"));
            remove_pin(&fresh)?;
            map.pin(&fresh)
                .map_err(|e| BpfError::io("pinning", &fresh, std::io::Error::other(e)))?;
            fs::rename(&fresh, &path).map_err(|e| BpfError::io("renaming", &fresh, e))?;
        }
        Ok(())
    }

    /// Attaches `xdp_from_netdev` to `ifindex` in native (driver) mode, adopting a pinned link.
    fn attach_xdp(&mut self, ifindex: u32) -> Result<Attached, BpfError> {
        let program_name = programs::XDP_FROM_NETDEV;
        if self.xdp_links.contains_key(&ifindex) {
            return Ok(Attached::Already);
        }
        let attach_error = |reason: String| BpfError::Attach {
            program: program_name,
            ifindex,
            reason,
        };
        let path = self.layout.link(program_name, ifindex);
        let program = xdp_program(&mut self.ebpf)?;
        let mut outcome = Attached::New;
        let mut link_id = None;
        if path.exists() {
            let adopted = PinnedLink::from_pin(&path)
                .map_err(|e| e.to_string())
                .and_then(|p| XdpLink::try_from(FdLink::from(p)).map_err(|e| e.to_string()))
                .and_then(|link| program.attach_to_link(link).map_err(|e| e.to_string()));
            match adopted {
                Ok(id) => {
                    outcome = Attached::Replaced;
                    link_id = Some(id);
                }
                Err(reason) => {
                    tracing::info!(path = %path.display(), %reason, "pinned XDP link is unusable");
                    remove_pin(&path)?;
                }
            }
        }
        let id = match link_id {
            Some(id) => id,
            None => program
                .attach_to_if_index(ifindex, XdpMode::Driver)
                .map_err(|e| attach_error(e.to_string()))?,
        };
        let link = program
            .take_link(id)
            .map_err(|e| attach_error(e.to_string()))?;
        // Netlink attachments (kernels without XDP links) cannot be pinned: give up on XDP.
        let mut fd_link = FdLink::try_from(link).map_err(|e| attach_error(e.to_string()))?;
        if outcome == Attached::New {
            fd_link = FdLink::from(
                fd_link
                    .pin(&path)
                    .map_err(|e| attach_error(format!("pinning {}: {e:?}", path.display())))?,
            );
        }
        let held = HeldLink::new(path, fd_link).map_err(|e| attach_error(e.to_string()))?;
        self.xdp_links.insert(ifindex, held);
        let stale: Vec<u32> = self
            .xdp_links
            .keys()
            .filter(|i| **i != ifindex)
            .copied()
            .collect();
        for key in stale {
            if let Some(held) = self.xdp_links.remove(&key) {
                remove_pin(&held.path)?;
            }
        }
        for (_, path) in self.layout.other_links(program_name, ifindex) {
            remove_pin(&path)?;
        }
        Ok(outcome)
    }

    /// Attaches `tc_from_bridge` to TC ingress of the bridge device itself, removing its other
    /// links. Only where bridged traffic skips netfilter (the BPF test rigs): the daemon uses
    /// [`FastPath::attach_ports`], see `flannel_ebpf::bridge` for why.
    pub fn attach_bridge(&mut self, ifindex: u32) -> Result<Attached, BpfError> {
        self.attach(Hook::FromBridge, ifindex)
    }

    /// Attaches `tc_from_bridge` to TC ingress of exactly the interfaces in `ports` (the pod
    /// bridge's veth ports; see `flannel_ebpf::bridge` for why there and not on the bridge):
    /// new ports get a link (adopting a pinned one), links on other interfaces (ports that
    /// are gone, the bridge itself) are removed. Stops at the first port that cannot be
    /// attached, keeping what is attached.
    pub fn attach_ports(&mut self, ports: &BTreeSet<u32>) -> Result<PortAttach, BpfError> {
        let mut report = PortAttach::default();
        for &port in ports {
            if self.attach_one(Hook::FromBridge, port)? != Attached::Already {
                report.attached += 1;
            }
        }
        report.detached = self.prune(Hook::FromBridge, ports)?;
        Ok(report)
    }

    /// Detaches `tc_from_bridge` from every bridge.
    pub fn detach_bridge(&mut self) -> Result<(), BpfError> {
        self.detach(Hook::FromBridge)
    }

    /// Detaches the external interface's programs.
    pub fn detach_netdev(&mut self) -> Result<(), BpfError> {
        self.detach(Hook::FromNetdev)?;
        self.detach(Hook::ToNetdev)?;
        self.detach_xdp()
    }

    fn detach_xdp(&mut self) -> Result<(), BpfError> {
        for (_, held) in self.xdp_links.drain() {
            remove_pin(&held.path)?;
        }
        for (_, path) in self.layout.other_links(programs::XDP_FROM_NETDEV, 0) {
            remove_pin(&path)?;
        }
        Ok(())
    }

    /// The interface `xdp_from_netdev` is attached to by this handle, if any.
    pub fn xdp_attachment(&self) -> Option<u32> {
        self.xdp_links.keys().next().copied()
    }

    /// Attaches again this handle's TC programs that something else removed since they were
    /// attached: a TCX link detached (`bpftool link detach`; its interface deleted), a
    /// `clsact` filter of ours deleted or replaced (`tc filter del`, `tc qdisc del dev <if>
    /// clsact`). Each comes back on the same hook of the same interface, running this
    /// handle's program with its maps; an attachment whose interface is gone is forgotten.
    /// Returns what it found (nothing when all are in place). XDP, which the daemon does not
    /// attach, is not checked.
    pub fn heal(&mut self) -> Vec<Healed> {
        let mut ours = BTreeMap::new();
        for hook in Hook::ALL {
            if let Some(info) = classifier(&mut self.ebpf, hook)
                .ok()
                .and_then(|p| p.info().ok())
            {
                ours.insert(hook, info.id());
            }
        }
        let mut lost = std::mem::take(&mut self.unhealed);
        lost.retain(|key| !self.links.contains_key(key));
        for (&(hook, ifindex), held) in &self.links {
            let in_place = match held {
                // Only a link found detached is lost (one that cannot be asked is left alone);
                // one whose pin was removed is pinned again.
                TcHeld::Link(link) => {
                    let in_place = super::attached::tcx_ifindex(link.fd.as_fd())
                        .map_or(true, |i| i == ifindex);
                    if in_place {
                        self.repin_link(link);
                    }
                    in_place
                }
                // Lost when another program or none is there; left alone when either side
                // cannot be read.
                TcHeld::Filter => match (
                    ours.get(&hook),
                    tcfilter::program_id_on(ifindex, hook.attach_type()),
                ) {
                    (Some(ours), Ok(there)) => there == Some(*ours),
                    _ => true,
                },
            };
            if !in_place {
                lost.insert((hook, ifindex));
            }
        }
        self.repin_maps();
        let mut out = Vec::new();
        for (hook, ifindex) in lost {
            // A detached link is released (unpinned and dropped) before it is made again.
            let released = match self.links.remove(&(hook, ifindex)) {
                Some(TcHeld::Link(link)) => remove_pin(&link.path),
                _ => Ok(()),
            };
            let outcome = match released {
                Err(e) => Err(e),
                Ok(()) if interface_name(ifindex).is_err() => Ok(false),
                Ok(()) => self.attach_one(hook, ifindex).map(|_| true),
            };
            if outcome.is_err() {
                self.unhealed.insert((hook, ifindex));
            }
            out.push(Healed {
                hook,
                ifindex,
                outcome,
            });
        }
        out
    }

    /// Pins `link` again where its pin was, if something removed the pin: without it the next
    /// agent would not adopt the link, and forwarding would stop between this agent's exit
    /// and the next one's attach.
    fn repin_link(&self, link: &HeldLink) {
        if link.path.exists() {
            return;
        }
        let pinned = fs::create_dir_all(self.layout.links_dir())
            .and_then(|()| super::attached::pin(link.fd.as_fd(), &link.path));
        match pinned {
            Ok(()) => tracing::warn!(
                path = %link.path.display(),
                "a fast-path link's pin was removed by something else; pinned again"
            ),
            Err(e) => tracing::warn!(
                path = %link.path.display(),
                error = %e,
                "a fast-path link's pin was removed by something else; pinning it again failed"
            ),
        }
    }

    /// Pins again the maps (and the attached programs' flow memos) whose pins something
    /// removed: without them the next agent would start with empty maps, and the masqueraded
    /// connections would be cut.
    fn repin_maps(&self) {
        let maps_dir = self.layout.maps_dir();
        for spec in MAP_SPECS.iter() {
            let path = self.layout.map(spec.name);
            if path.exists() {
                continue;
            }
            let Some(map) = self.ebpf.map(spec.name) else {
                continue;
            };
            let pinned = fs::create_dir_all(&maps_dir)
                .map_err(|e| e.to_string())
                .and_then(|()| map.pin(&path).map_err(|e| e.to_string()));
            match pinned {
                Ok(()) => tracing::warn!(
                    path = %path.display(),
                    "a fast-path map's pin was removed by something else; pinned again"
                ),
                Err(e) => tracing::warn!(
                    path = %path.display(),
                    error = %e,
                    "a fast-path map's pin was removed by something else; pinning it again failed"
                ),
            }
        }
        let netdev_attached = self.links.keys().any(|(hook, _)| *hook == Hook::FromNetdev);
        if netdev_attached
            && [MEMO4, MEMO6]
                .iter()
                .any(|name| !self.layout.memo(name).exists())
        {
            let dir = self.layout.memos_dir();
            let repinned = fs::create_dir_all(&dir)
                .map_err(|e| BpfError::io("creating", dir, e))
                .and_then(|()| self.pin_memos());
            if let Err(e) = repinned {
                tracing::warn!(error = %e, "pinning the flow memo maps again failed");
            } else {
                tracing::warn!(
                    "the flow memo maps' pins were removed by something else; pinned again"
                );
            }
        }
    }

    /// Where each hook is attached by this handle, as `(hook, ifindex)`.
    pub fn attachments(&self) -> Vec<(Hook, u32)> {
        let mut out: Vec<(Hook, u32)> = self.links.keys().copied().collect();
        out.sort();
        out
    }

    /// The loaded program of `hook`, for `BPF_PROG_TEST_RUN` (tests, debugging tools).
    pub fn program_mut(&mut self, hook: Hook) -> Result<&mut SchedClassifier, BpfError> {
        classifier(&mut self.ebpf, hook)
    }

    /// The loaded `xdp_from_netdev`, for `BPF_PROG_TEST_RUN` (tests, debugging tools).
    pub fn xdp_program_mut(&mut self) -> Result<&mut Xdp, BpfError> {
        xdp_program(&mut self.ebpf)
    }

    /// The per-reason counters of the three programs (summed over CPUs).
    pub fn counters(&self) -> Result<Counters, BpfError> {
        Counters::read(&self.ebpf)
    }

    /// Flow-table entries the programs have learnt so far (two of their counters).
    pub fn learnt(&self) -> Result<super::counters::Learnt, BpfError> {
        super::counters::Learnt::read(&self.ebpf)
    }

    /// Attaches `hook`'s program to `ifindex` and removes its links on other interfaces (an
    /// old bridge, a previous external interface).
    fn attach(&mut self, hook: Hook, ifindex: u32) -> Result<Attached, BpfError> {
        let outcome = self.attach_one(hook, ifindex)?;
        self.prune(hook, &BTreeSet::from([ifindex]))?;
        Ok(outcome)
    }

    /// Removes `hook`'s links (held and pinned) on every interface not in `keep`.
    fn prune(&mut self, hook: Hook, keep: &BTreeSet<u32>) -> Result<usize, BpfError> {
        let stale: Vec<(Hook, u32)> = self
            .links
            .keys()
            .filter(|(h, i)| *h == hook && !keep.contains(i))
            .copied()
            .collect();
        let mut removed = 0;
        for key in stale {
            if let Some(held) = self.links.remove(&key) {
                release(hook, key.1, held)?;
                removed += 1;
            }
        }
        for (ifindex, path) in self.layout.other_links(hook.program(), 0) {
            if !keep.contains(&ifindex) {
                remove_pin(&path)?;
                removed += 1;
            }
        }
        // Filters an earlier run left: on the interfaces this handle attached (after the TCX
        // link, which runs first, so none stays behind it) as well as on the others; in clsact
        // mode only on the others (the kept ones carry this handle's filters now).
        if self.swept.insert(hook) {
            let all = BTreeSet::new();
            let skip = match self.tc_attach {
                TcAttach::Tcx => &all,
                TcAttach::Clsact => keep,
            };
            let swept = tcfilter::sweep(hook.program(), hook.attach_type(), skip);
            if swept > 0 {
                tracing::info!(
                    program = hook.program(),
                    interfaces = swept,
                    "removed the clsact filters of an earlier run"
                );
            }
            removed += swept;
        }
        Ok(removed)
    }

    /// Attaches `hook`'s program to `ifindex` (adopting a pinned link), leaving its other
    /// links alone.
    fn attach_one(&mut self, hook: Hook, ifindex: u32) -> Result<Attached, BpfError> {
        if self.links.contains_key(&(hook, ifindex)) {
            return Ok(Attached::Already);
        }
        let attach_error = |reason: String| BpfError::Attach {
            program: hook.program(),
            ifindex,
            reason,
        };
        let ifname = interface_name(ifindex)?;
        let path = self.layout.link(hook.program(), ifindex);
        let program = classifier(&mut self.ebpf, hook)?;
        if self.tc_attach == TcAttach::Clsact {
            let outcome =
                tcfilter::attach(program, &ifname, hook.attach_type()).map_err(attach_error)?;
            // A TCX link of an earlier run runs before the filter (and decides): removed
            // once the filter is in place, so that no packet meets an empty hook.
            remove_pin(&path)?;
            self.links.insert((hook, ifindex), TcHeld::Filter);
            return Ok(outcome);
        }

        let mut outcome = Attached::New;
        let mut link_id = None;
        if path.exists() {
            match adopt(program, &path) {
                Ok(id) => {
                    outcome = Attached::Replaced;
                    link_id = Some(id);
                }
                Err(reason) => {
                    tracing::info!(
                        path = %path.display(),
                        %reason,
                        "pinned link is unusable; attaching afresh"
                    );
                    remove_pin(&path)?;
                }
            }
        }
        let id = match link_id {
            Some(id) => id,
            None => program
                .attach_with_options(
                    &ifname,
                    hook.attach_type(),
                    TcAttachOptions::TcxOrder(LinkOrder::default()),
                )
                .map_err(|e| attach_error(e.to_string()))?,
        };
        let link = program
            .take_link(id)
            .map_err(|e| attach_error(e.to_string()))?;
        let mut fd_link = FdLink::try_from(link).map_err(|e| attach_error(e.to_string()))?;
        if outcome == Attached::New {
            let pinned = fd_link
                .pin(&path)
                .map_err(|e| attach_error(format!("pinning {}: {e:?}", path.display())))?;
            fd_link = FdLink::from(pinned);
        }
        let held = HeldLink::new(path, fd_link).map_err(|e| attach_error(e.to_string()))?;
        self.links.insert((hook, ifindex), TcHeld::Link(held));
        Ok(outcome)
    }

    fn detach(&mut self, hook: Hook) -> Result<(), BpfError> {
        let keys: Vec<(Hook, u32)> = self
            .links
            .keys()
            .filter(|(h, _)| *h == hook)
            .copied()
            .collect();
        for key in keys {
            if let Some(held) = self.links.remove(&key) {
                release(hook, key.1, held)?;
            }
        }
        for (_, path) in self.layout.other_links(hook.program(), 0) {
            remove_pin(&path)?;
        }
        tcfilter::sweep(hook.program(), hook.attach_type(), &BTreeSet::new());
        Ok(())
    }

    pub(super) fn current_routes(&self) -> Result<CurrentRoutes, BpfError> {
        let mut routes = BTreeMap::new();
        let mut invalid = Vec::new();
        for (key, entry) in self.read_all::<Key<[u8; 4]>, RemoteEntry>(names::ROUTES4)? {
            let prefix = key.prefix_len();
            match u8::try_from(prefix)
                .ok()
                .and_then(|p| Ipv4Net::new(Ipv4Addr::from(key.data()), p).ok())
            {
                Some(net) if net.trunc() == net => {
                    routes.insert(net, entry);
                }
                _ => invalid.push(key),
            }
        }
        Ok(CurrentRoutes { routes, invalid })
    }

    pub(super) fn current_nodes(&self) -> Result<BTreeMap<Ipv4Addr, NodeEntry>, BpfError> {
        Ok(self
            .read_all::<[u8; 4], NodeEntry>(names::NODES4)?
            .into_iter()
            .map(|(addr, entry)| (Ipv4Addr::from(addr), entry))
            .collect())
    }

    /// Every entry of the route or node map `name`, read in batches: a few syscalls for
    /// thousands of entries, where reading them one by one took two each.
    pub(super) fn read_all<K: aya::Pod, V: aya::Pod>(
        &self,
        name: &'static str,
    ) -> Result<Vec<(K, V)>, BpfError> {
        let map = self.ebpf.map(name).ok_or_else(|| missing(name))?;
        batch::batch_data(map)
            .and_then(batch::entries::<K, V>)
            .map_err(|e| BpfError::map(name, aya::maps::MapError::from(e)))
    }

    fn routes_mut(&mut self) -> Result<LpmTrie<&mut MapData, [u8; 4], RemoteEntry>, BpfError> {
        let map = self
            .ebpf
            .map_mut(names::ROUTES4)
            .ok_or_else(|| missing(names::ROUTES4))?;
        LpmTrie::try_from(map).map_err(|e| BpfError::map(names::ROUTES4, e))
    }

    fn nodes_mut(&mut self) -> Result<BpfHashMap<&mut MapData, [u8; 4], NodeEntry>, BpfError> {
        let map = self
            .ebpf
            .map_mut(names::NODES4)
            .ok_or_else(|| missing(names::NODES4))?;
        BpfHashMap::try_from(map).map_err(|e| BpfError::map(names::NODES4, e))
    }

    /// The configuration map, to write.
    pub(super) fn array_mut(&mut self) -> Result<Array<&mut MapData, Config>, BpfError> {
        let map = self
            .ebpf
            .map_mut(names::CONFIG)
            .ok_or_else(|| missing(names::CONFIG))?;
        Array::try_from(map).map_err(|e| BpfError::map(names::CONFIG, e))
    }
}

/// What the route map holds.
pub(super) struct CurrentRoutes {
    /// Valid keys (normalised subnets) and their values.
    pub(super) routes: BTreeMap<Ipv4Net, RemoteEntry>,
    /// Keys that are no subnet (prefix > 32, host bits set): deleted by `sync`.
    pub(super) invalid: Vec<Key<[u8; 4]>>,
}

/// The LPM key of a (normalised) subnet.
fn route_key(net: &Ipv4Net) -> Key<[u8; 4]> {
    Key::new(u32::from(net.prefix_len()), net.network().octets())
}

pub(super) fn missing(name: &'static str) -> BpfError {
    BpfError::BadMap {
        name,
        reason: "not in the eBPF object".into(),
    }
}

fn classifier(ebpf: &mut Ebpf, hook: Hook) -> Result<&mut SchedClassifier, BpfError> {
    let program = ebpf
        .program_mut(hook.program())
        .ok_or(BpfError::MissingProgram(hook.program()))?;
    program
        .try_into()
        .map_err(|_| BpfError::MissingProgram(hook.program()))
}

fn xdp_program(ebpf: &mut Ebpf) -> Result<&mut Xdp, BpfError> {
    let name = programs::XDP_FROM_NETDEV;
    let program = ebpf
        .program_mut(name)
        .ok_or(BpfError::MissingProgram(name))?;
    program
        .try_into()
        .map_err(|_| BpfError::MissingProgram(name))
}

/// Removes `hook`'s attachment `held` on `ifindex`: the pin of a TCX link (which detaches it)
/// or our filter (unless the interface is gone, and the filter with it).
fn release(hook: Hook, ifindex: u32, held: TcHeld) -> Result<(), BpfError> {
    match held {
        TcHeld::Link(link) => remove_pin(&link.path),
        TcHeld::Filter => match interface_name(ifindex) {
            Ok(name) => tcfilter::detach(&name, hook.attach_type())
                .map(|_| ())
                .map_err(|reason| BpfError::Detach {
                    program: hook.program(),
                    ifindex,
                    reason,
                }),
            // The interface is gone, and its filters with it.
            Err(_) => Ok(()),
        },
    }
}

/// Re-targets the pinned link at `path` to `program` (atomic `BPF_LINK_UPDATE`).
fn adopt(
    program: &mut SchedClassifier,
    path: &Path,
) -> Result<aya::programs::tc::SchedClassifierLinkId, String> {
    let pinned = PinnedLink::from_pin(path).map_err(|e| e.to_string())?;
    let link = SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(|e| e.to_string())?;
    program.attach_to_link(link).map_err(|e| e.to_string())
}

pub(super) fn remove_ignoring_missing(
    result: Result<(), aya::maps::MapError>,
    map: &'static str,
) -> Result<(), BpfError> {
    match result {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.kind() == std::io::ErrorKind::NotFound =>
        {
            Ok(())
        }
        Err(e) => Err(BpfError::map(map, e)),
    }
}

/// The name of interface `ifindex` in the calling thread's network namespace (aya attaches by
/// name), checked to map back to the same index.
fn interface_name(ifindex: u32) -> Result<String, BpfError> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf has IF_NAMESIZE bytes, as if_indextoname requires.
    let name = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if name.is_null() {
        return Err(BpfError::NoSuchInterface(ifindex));
    }
    // SAFETY: on success the buffer holds a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    match nix::net::if_::if_nametoindex(name.as_str()) {
        Ok(index) if index == ifindex => Ok(name),
        _ => Err(BpfError::NoSuchInterface(ifindex)),
    }
}
