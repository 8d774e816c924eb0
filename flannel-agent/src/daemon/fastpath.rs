//! The daemon's side of the eBPF fast path: load it or fall back (`--dataplane`), configure it
//! for this node, attach it to the external interface and to the pod bridge (again whenever the
//! CNI plugin recreates the bridge), and say which path is active.

use std::{
    collections::BTreeSet,
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use flannel_common::maps as names;
use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::DaemonError;
use crate::{
    backend::BackendOptions,
    bpf::{
        self, DataplaneMode, LocalConfig, LocalConfig6, SharedFastPath, Startup, UdpLocal,
        VxlanLocal,
    },
    cli::{Cli, Dataplane, TcAttachMode},
    dataplane::{Local, Trigger},
    ip::IpStack,
    metrics::{KindLabel, Metrics},
    netlink::{FdbEvent, FdbEvents, LinkEvent, Netlink},
};

/// The active forwarding path.
pub enum ActivePath {
    /// Only the kernel path forwards; `why` says why (for the log and `xtask run`'s status).
    Kernel { why: String },
    /// The eBPF fast path is loaded (the kernel path stays configured underneath).
    Ebpf { fast_path: SharedFastPath },
}

impl ActivePath {
    pub fn name(&self) -> &'static str {
        match self {
            ActivePath::Kernel { .. } => "kernel",
            ActivePath::Ebpf { .. } => "ebpf",
        }
    }

    pub fn fast_path(&self) -> Option<&SharedFastPath> {
        match self {
            ActivePath::Ebpf { fast_path } => Some(fast_path),
            ActivePath::Kernel { .. } => None,
        }
    }
}

/// Why the fast path cannot serve this configuration, if it cannot.
fn unsupported(backend: &BackendOptions, stack: IpStack) -> Option<String> {
    match backend {
        BackendOptions::Vxlan(o) if o.gbp => {
            Some("VXLAN Group Based Policy (GBP) is not supported by the fast path".into())
        }
        BackendOptions::Vxlan(_) | BackendOptions::HostGw => None,
        BackendOptions::Ipip(_) | BackendOptions::Udp(_) if !stack.has_v4() => Some(format!(
            "the {} backend carries IPv4 only; this cluster is IPv6-only",
            backend.backend_type()
        )),
        BackendOptions::Ipip(_) | BackendOptions::Udp(_) => None,
        other => Some(format!(
            "the {} backend has no eBPF fast path",
            other.backend_type()
        )),
    }
}

/// What [`start`] leaves: the active path and the NAT map's sizing (for the masquerade).
pub struct Started {
    /// The active path.
    pub active: ActivePath,
    /// The NAT map's size, as resolved from `--ebpf-nat-max-entries`.
    pub nat_sizing: bpf::NatSizing,
}

/// Applies `--dataplane` to `backend`: `auto` keeps the kernel path where netfilter holds
/// NetworkPolicy rules, which the fast path would bypass; the map sizes come from the flags.
/// Needs nothing of the lease and attaches nothing, so the daemon runs it while the lease is
/// taken.
pub fn start(cli: &Cli, backend: &BackendOptions, stack: IpStack) -> Result<Started, DaemonError> {
    let requested = match (cli.dataplane, super::policy::detect()) {
        (Dataplane::Auto, Some(engine)) => {
            info!(
                "{engine} NetworkPolicy rules found in netfilter: keeping the kernel path, which \
                 they filter (the eBPF fast path would bypass them); --dataplane=ebpf overrides"
            );
            Dataplane::Kernel
        }
        (Dataplane::Ebpf, Some(engine)) => {
            warn!(
                "{engine} NetworkPolicy rules found in netfilter: the eBPF fast path bypasses \
                 them for pod-to-pod traffic (--dataplane=ebpf was asked for explicitly)"
            );
            Dataplane::Ebpf
        }
        (requested, _) => requested,
    };
    let nat_sizing = bpf::NatSizing::resolve(cli.ebpf_nat_max_entries);
    let held_sizing = bpf::HeldSizing::resolve(cli.ebpf_held_max_entries);
    let options = bpf::LoadOptions {
        nat_max_entries: nat_sizing.entries,
        held_max_entries: held_sizing.flows,
        tc_attach: match cli.tc_attach {
            TcAttachMode::Auto => None,
            TcAttachMode::Tcx => Some(bpf::TcAttach::Tcx),
            TcAttachMode::Clsact => Some(bpf::TcAttach::Clsact),
        },
    };
    let active = load(requested, &cli.bpf_pin_path, backend, stack, &options)?;
    if let Some(fp) = active.fast_path()
        && let Ok(fp) = fp.lock()
    {
        let flows = fp.held_capacity().unwrap_or(held_sizing.flows);
        info!(
            "held flow tables: {}",
            bpf::HeldSizing {
                flows,
                ..held_sizing
            }
        );
    }
    Ok(Started { active, nat_sizing })
}

/// Loads the fast path as `--dataplane` asks, or says why the kernel path runs alone. With
/// `ebpf`, a fast path that cannot run is an error; with `auto`, a fallback with its reason.
fn load(
    requested: Dataplane,
    pin_path: &Path,
    backend: &BackendOptions,
    stack: IpStack,
    options: &bpf::LoadOptions,
) -> Result<ActivePath, DaemonError> {
    let mode = match requested {
        Dataplane::Auto => DataplaneMode::Auto,
        Dataplane::Ebpf => DataplaneMode::Ebpf,
        Dataplane::Kernel => DataplaneMode::Kernel,
    };
    if mode != DataplaneMode::Kernel
        && let Some(why) = unsupported(backend, stack)
    {
        if mode == DataplaneMode::Ebpf {
            return Err(DaemonError::FastPathUnavailable(why));
        }
        // Make sure no earlier eBPF run keeps forwarding behind our back.
        if let Err(err) = bpf::cleanup(pin_path) {
            warn!("removing the pins of an earlier eBPF run: {err}");
        }
        return Ok(ActivePath::Kernel {
            why: format!("falling back to the kernel path: {why}"),
        });
    }
    match bpf::start_with(mode, pin_path, options) {
        Ok(Startup::FastPath(fp)) => Ok(ActivePath::Ebpf {
            fast_path: Arc::new(Mutex::new(*fp)),
        }),
        Ok(startup @ Startup::KernelPath { .. }) => Ok(ActivePath::Kernel {
            why: startup
                .fallback_message()
                .unwrap_or_else(|| "--dataplane=kernel".into()),
        }),
        Err(err) => Err(DaemonError::FastPathUnavailable(err.to_string())),
    }
}

/// The receiver of IPIP packets that arrive in fragments ([`crate::ipip_rx`]), for a node
/// whose IPIP runs in eBPF; none (said in the log) when its sockets cannot be opened.
pub fn ipip_receiver(
    fast_path: &SharedFastPath,
    local: &Local,
    metrics: &Metrics,
) -> Option<crate::ipip_rx::Receiver> {
    let (Some(public_ip), Some(subnet)) = (local.ext.ext_addr, local.lease.subnet) else {
        return None;
    };
    let pins = fast_path.lock().ok()?.pins().clone();
    let rx_local = crate::ipip_rx::Local { public_ip, subnet };
    match crate::ipip_rx::Receiver::open(rx_local, &pins, metrics.ipip_reassembled.clone()) {
        Ok(receiver) => Some(receiver),
        Err(e) => {
            warn!("IPIP packets that a router fragmented on the way will be lost: {e}");
            None
        }
    }
}

/// Runs the IPIP receiver until `cancel`. The programs decapsulate IPIP inner fragments
/// themselves until the receiver takes a packet from a peer that the kernel reassembled, i.e.
/// until a router is seen fragmenting a peer's IPIP (a peer whose kernel device copies DF):
/// from then on they leave those to the agent too (`CFG_IPIP_USER_RX`, shown by the gauge
/// `flannel_ipip_inner_fragments_to_agent`), so that a datagram whose fragments partly come
/// through the agent meets conntrack at one hook. Where no router fragments IPIP (our nodes
/// without the module send DF), inner fragments never make the trip to user space; where one
/// did, they go back to the programs once `hold` passes without another such packet. When
/// the receiver stops (shutdown, or its socket failed) the flag is cleared again, so that
/// while the agent is down (the programs stay attached) inner fragments are not left to a
/// kernel that has no receiver for them.
pub async fn run_ipip_receiver(
    fast_path: SharedFastPath,
    receiver: crate::ipip_rx::Receiver,
    hold: Duration,
    gauge: Gauge,
    cancel: CancellationToken,
) {
    let switch = |on: bool| {
        if !set_ipip_user_rx(&fast_path, on) {
            return false;
        }
        gauge.set(i64::from(on));
        if on {
            info!(
                "a router fragments IPIP on its way here: IPIP packets carrying an inner \
                 fragment go to the agent's IPIP socket until none has been fragmented for {}s",
                hold.as_secs()
            );
        } else {
            info!("the fast path decapsulates IPIP inner fragments itself again");
        }
        true
    };
    if receiver.run(cancel, hold, switch).await {
        switch(false);
    }
}

/// Sets `CFG_IPIP_USER_RX` in the IPv4 configuration as it is (the external interface may
/// have moved since the start); whether it was written (a failure is logged).
fn set_ipip_user_rx(fast_path: &SharedFastPath, on: bool) -> bool {
    let written = match fast_path.lock() {
        Ok(mut fp) => fp.set_ipip_user_rx(on).map_err(|e| e.to_string()),
        Err(_) => Err("fast-path handle poisoned".to_owned()),
    };
    if let Err(e) = &written {
        warn!(
            on,
            "setting whether IPIP inner fragments go to the agent's socket: {e}"
        );
    }
    written.is_ok()
}

/// The VNI the VXLAN fast path writes, when the backend is vxlan.
pub fn vxlan_vni(backend: &BackendOptions) -> Option<u32> {
    match backend {
        BackendOptions::Vxlan(o) => Some(o.vni),
        _ => None,
    }
}

/// Writes this node's configuration into the fast path (IPv4 and IPv6 sides, each when that
/// family is enabled and leased) and attaches it to the external interface (TC ingress and
/// egress; XDP stays off: it measured slower on veth).
pub fn configure(
    fast_path: &SharedFastPath,
    local: &Local,
    metrics: &Metrics,
) -> Result<(), DaemonError> {
    let fail =
        |what: &str, err: bpf::BpfError| DaemonError::FastPathUnavailable(format!("{what}: {err}"));
    let (config, config6) = local_configs(local)?;
    let udp = match &local.backend {
        BackendOptions::Udp(o) => {
            let iface_addr = local.ext.iface_addr.ok_or_else(|| {
                DaemonError::FastPathUnavailable(
                    "the udp backend needs an IPv4 interface address".into(),
                )
            })?;
            Some(UdpLocal {
                iface_addr,
                port: o.port,
            })
        }
        _ => None,
    };
    let mut fp = fast_path
        .lock()
        .map_err(|_| DaemonError::FastPathUnavailable("fast-path handle poisoned".into()))?;
    match &config {
        Some(config) => fp.set_config(config).map_err(|e| fail("configuring", e))?,
        // IPv6-only: the IPv4 side stays disabled (an all-zero entry).
        None => fp
            .disable_ipv4()
            .map_err(|e| fail("disabling the IPv4 side", e))?,
    }
    fp.set_config6(config6.as_ref())
        .map_err(|e| fail("configuring IPv6", e))?;
    fp.set_udp(udp.as_ref())
        .map_err(|e| fail("configuring the udp encapsulation", e))?;
    // Before the programs see the node's traffic: a one-off blocking dump at start-up.
    match fp.seed_scope() {
        Ok(scope) => seed_before_attach(
            &mut fp,
            bpf::seed::collect(&scope),
            "the external interface",
            metrics,
        ),
        Err(err) => warn!("reading the fast path's configuration back: {err}"),
    }
    fp.attach_netdev(local.ext.index, false)
        .map_err(|e| fail("attaching to the external interface", e))?;
    Ok(())
}

/// The IPv4 and IPv6 configurations for `local`: each family's when it is enabled (IPv4
/// needs a public IPv4, a lease and `Network`; IPv6 a public IPv6, an IPv6 lease and
/// `IPv6Network`). At least one is required.
fn local_configs(
    local: &Local,
) -> Result<(Option<LocalConfig>, Option<LocalConfig6>), DaemonError> {
    let vxlan = |mac: Option<crate::backend::MacAddr>| match (&local.backend, mac) {
        (BackendOptions::Vxlan(o), Some(mac)) => Some(VxlanLocal {
            vni: o.vni,
            port: o.effective_port(),
            vtep_mac: mac.octets(),
        }),
        _ => None,
    };
    let v4 = match (
        local.ext.ext_addr,
        local.lease.subnet,
        local.network,
        local.stack.has_v4(),
    ) {
        (Some(public_ip), Some(subnet), Some(network), true) => {
            let mut config = LocalConfig::new(public_ip, local.ext.index, subnet, network);
            config.vxlan = vxlan(local.vtep_macs.v4);
            Some(config)
        }
        (_, _, _, true) => {
            return Err(DaemonError::FastPathUnavailable(
                "no IPv4 public address, lease or network".into(),
            ));
        }
        _ => None,
    };
    let v6 = match (
        local.ext.ext_v6_addr,
        local.lease.ipv6_subnet,
        local.network_v6,
        local.stack.has_v6(),
    ) {
        (Some(public_ip), Some(subnet), Some(network), true) => {
            let mut config = LocalConfig6::new(public_ip, local.ext.index, subnet, network);
            config.vxlan = vxlan(local.vtep_macs.v6);
            if let Some(hop_limit) = bpf::v6::kernel_hop_limit(Some(&local.ext.name)) {
                config.hop_limit = hop_limit;
            }
            Some(config)
        }
        (_, _, _, true) if !local.stack.has_v4() => {
            return Err(DaemonError::FastPathUnavailable(
                "no IPv6 public address, lease or network".into(),
            ));
        }
        // Dual stack without a usable IPv6 side: IPv6 stays on the kernel path.
        _ => None,
    };
    Ok((v4, v6))
}

/// How long the port mirror waits after a bridge FDB or link change before it re-reads them,
/// so that a burst of changes (a pod starting) is read once.
const PORTS_SETTLE: Duration = Duration::from_millis(20);
/// How often the port mirror re-reads everything anyway (lost notifications).
const PORTS_RESYNC: Duration = Duration::from_secs(30);
/// How soon a sync that could not finish (the bridge unreadable, a port that vanished while
/// being attached, a map write refused) is tried again.
const PORTS_RETRY: Duration = Duration::from_secs(1);

/// Keeps the pod-side program attached to every veth port of `bridge` (found now if it exists,
/// and again every time it is re-created) and the fast path's pod ports ([`bpf::ports`]) equal
/// to the bridge's forwarding database, until `cancel`. A link of the program on the bridge
/// itself (left by an older agent) is removed with the first sync. `metrics` shows how many
/// ports the program is on and how many pods the map knows.
pub async fn follow_bridge_ports(
    fast_path: SharedFastPath,
    nl: Netlink,
    bridge: String,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let attach = |index: u32| {
        info!(bridge = %bridge, index, "fast path following the pod bridge's ports");
    };
    let mut events = match nl.link_events() {
        Ok(events) => events,
        Err(err) => {
            warn!("cannot watch links for the pod bridge: {err}");
            return;
        }
    };
    let mut fdb_events = match nl.fdb_events() {
        Ok(events) => Some(events),
        Err(err) => {
            warn!(
                "cannot watch the pod bridge's forwarding database ({err}); pods' ports are \
                 re-read every {}s",
                PORTS_RESYNC.as_secs()
            );
            None
        }
    };
    let mut bridge_index = None;
    match nl.link_by_name(&bridge).await {
        Ok(Some(link)) => {
            attach(link.index);
            bridge_index = Some(link.index);
        }
        Ok(None) => info!(bridge = %bridge, "pod bridge not there yet; attaching when it appears"),
        Err(err) => warn!("looking up the pod bridge: {err}"),
    }
    let mut resync = tokio::time::interval(PORTS_RESYNC);
    // The first read happens at once (the interval's first tick).
    let mut settle: Option<Instant> = None;
    loop {
        let mark = |settle: &mut Option<Instant>| {
            settle.get_or_insert_with(|| Instant::now() + PORTS_SETTLE);
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            event = events.next() => match event {
                // Every change of the bridge (a port added, its MTU) is an RTM_NEWLINK too.
                Some(LinkEvent::New { index, name }) if name == bridge => {
                    if bridge_index != Some(index) {
                        attach(index);
                    }
                    bridge_index = Some(index);
                    mark(&mut settle);
                }
                Some(LinkEvent::Overrun) => {
                    if let Ok(Some(link)) = nl.link_by_name(&bridge).await {
                        if bridge_index != Some(link.index) {
                            attach(link.index);
                        }
                        bridge_index = Some(link.index);
                    }
                    mark(&mut settle);
                }
                // A port added or removed (or any other link change: cheap to re-read).
                Some(_) => mark(&mut settle),
                None => return,
            },
            event = next_fdb_event(&mut fdb_events) => match event {
                Some(FdbEvent::Changed { master, .. }) if master.is_some() && master == bridge_index => {
                    mark(&mut settle);
                }
                Some(FdbEvent::Overrun) => mark(&mut settle),
                Some(_) => {}
                None => fdb_events = None,
            },
            _ = resync.tick() => mark(&mut settle),
            () = sleep_until_some(settle) => {
                settle = None;
                if let Some(index) = bridge_index {
                    let synced = sync_ports(&fast_path, &nl, index, &metrics).await;
                    if let Some(synced) = &synced {
                        metrics.fastpath_pod_ports.set(synced.attached as i64);
                        metrics
                            .bpf_entries
                            .get_or_create(&KindLabel { kind: "ports".into() })
                            .set(synced.pods as i64);
                    }
                    if !synced.is_some_and(|s| s.complete) {
                        settle = Some(Instant::now() + PORTS_RETRY);
                    }
                }
            }
        }
    }
}

/// The next FDB event, or never when there is no subscription.
async fn next_fdb_event(events: &mut Option<FdbEvents>) -> Option<FdbEvent> {
    match events {
        Some(events) => events.next().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `deadline`, or forever when there is none.
async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}

/// What one [`sync_ports`] left in place.
struct PortsSynced {
    /// Ports with `tc_from_bridge` attached.
    attached: usize,
    /// Pods (MACs) in the pod ports map.
    pods: usize,
    /// Whether the map and the links are what the bridge's state asks for (no error).
    complete: bool,
}

/// Re-reads the ports and FDB of bridge `bridge` and writes the difference into the fast
/// path's pod ports; `None` when the bridge could not be read.
async fn sync_ports(
    fast_path: &SharedFastPath,
    nl: &Netlink,
    bridge: u32,
    metrics: &Metrics,
) -> Option<PortsSynced> {
    let read = async {
        Ok::<_, crate::netlink::NetlinkError>((
            nl.list_links().await?,
            nl.list_bridge_fdb(bridge).await?,
        ))
    };
    let (links, fdb) = match read.await {
        Ok(read) => read,
        Err(err) => {
            warn!(bridge, "reading the pod bridge's ports: {err}");
            return None;
        }
    };
    let desired = bpf::ports::desired_ports(bridge, &links, &fdb);
    let veths = bpf::ports::veth_ports(bridge, &links);
    // New ports: their pods' open connections are read from conntrack before the program
    // goes on (the dump without the lock, so the reconciler is not held up by it). An earlier
    // read (the external interface's, at start-up, or a failed attempt's) does not do: every
    // connection those pods opened since then went through the kernel path as well.
    let scope = {
        let fp = fast_path.lock().ok()?;
        let attached: BTreeSet<u32> = fp
            .attachments()
            .iter()
            .filter(|(hook, _)| *hook == bpf::Hook::FromBridge)
            .map(|(_, index)| *index)
            .collect();
        if veths.is_subset(&attached) {
            None
        } else {
            fp.seed_scope().ok()
        }
    };
    let seeds = match scope {
        Some(scope) => Some(
            tokio::task::spawn_blocking(move || bpf::seed::collect(&scope))
                .await
                .ok()?,
        ),
        None => None,
    };
    let Ok(mut fp) = fast_path.lock() else {
        return None;
    };
    if let Some(seeds) = seeds {
        seed_before_attach(&mut fp, seeds, "new pod ports", metrics);
    }
    let mut complete = true;
    // The map first: a program adopted by the attach reads it at once.
    let pods = match fp.sync_ports(&desired) {
        Ok(sync) => {
            if sync.written + sync.removed > 0 {
                debug!(
                    bridge,
                    pods = sync.total,
                    written = sync.written,
                    removed = sync.removed,
                    "pod ports synced"
                );
            }
            sync.total
        }
        Err(err) => {
            warn!(bridge, "writing the pod ports map: {err}");
            complete = false;
            fp.ports().map(|p| p.len()).unwrap_or(0)
        }
    };
    match fp.attach_ports(&veths) {
        Ok(change) if change.attached + change.detached > 0 => debug!(
            bridge,
            ports = veths.len(),
            attached = change.attached,
            detached = change.detached,
            "pod egress program attached to the bridge's ports"
        ),
        Ok(_) => {}
        Err(err) => {
            warn!(bridge, "attaching to the pod bridge's ports: {err}");
            complete = false;
        }
    }
    let attached = fp
        .attachments()
        .iter()
        .filter(|(hook, _)| *hook == bpf::Hook::FromBridge)
        .count();
    Some(PortsSynced {
        attached,
        pods,
        complete,
    })
}

/// Every `period` (`--resync-interval`), until `cancel`: attaches again the fast path's TC
/// programs that something else detached from their interfaces ([`bpf::FastPath::heal`]), as
/// the reconciler puts back a route deleted by hand. Without it a `bpftool link detach` or
/// a `tc qdisc del dev <if> clsact` would leave the node without its programs until the next
/// agent start: VXLAN and host-gw traffic fall back on the kernel path, but traffic the
/// programs masquerade leaves untranslated.
/// Compares the fast path's route and node maps with what the agent last wrote
/// ([`bpf::FastPath::drift`]) every [`bpf::drift::CHECK_PERIOD`] or so, until `cancel`; when they
/// differ (entries deleted or changed by hand), says so once and sends
/// [`Trigger::MapsDrifted`] to the reconciler, whose next sync writes them again.
pub async fn check_maps(
    fast_path: SharedFastPath,
    drifted: tokio::sync::mpsc::Sender<Trigger>,
    cancel: CancellationToken,
) {
    let mut wait = bpf::drift::CHECK_PERIOD;
    let mut clean = true;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
        let began = Instant::now();
        let drift = match fast_path.lock() {
            Ok(mut fp) => fp.drift(),
            Err(_) => return,
        };
        wait = bpf::drift::CHECK_PERIOD.max(began.elapsed() * 50);
        match drift {
            Ok(drift) if drift.is_empty() => clean = true,
            Ok(drift) => {
                if clean {
                    warn!(
                        %drift,
                        "fast-path route or node map entries were changed by something else; \
                         writing them again"
                    );
                }
                clean = false;
                // Full: a reconcile is already asked for.
                let _ = drifted.try_send(Trigger::MapsDrifted);
            }
            Err(err) => debug!("comparing the fast path's maps with what was written: {err}"),
        }
    }
}

pub async fn keep_attached(
    fast_path: SharedFastPath,
    period: Duration,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let healed = match fast_path.lock() {
            Ok(mut fp) => fp.heal(),
            Err(_) => return,
        };
        for bpf::Healed {
            hook,
            ifindex,
            outcome,
        } in healed
        {
            let program = hook.program();
            match outcome {
                Ok(true) => {
                    warn!(
                        program,
                        ifindex, "fast-path program was detached by something else; attached again"
                    );
                    metrics
                        .fastpath_reattached
                        .get_or_create(&KindLabel {
                            kind: program.into(),
                        })
                        .inc();
                }
                Ok(false) => debug!(
                    program,
                    ifindex, "interface gone with its fast-path program"
                ),
                Err(err) => warn!(
                    program,
                    ifindex,
                    "fast-path program was detached by something else; attaching it again \
                     failed ({err}), trying again in {}s",
                    period.as_secs()
                ),
            }
        }
    }
}

/// When conntrack's table is read into the flow tables.
#[derive(Clone, Copy, Debug)]
enum SeedAt<'a> {
    /// Before the programs take over what is named.
    Attach(&'a str),
    /// On the periodic resync.
    Resync,
}

/// [`seed`] before the programs take over `what`; a table that could not be read only costs
/// the connections it would have kept (logged).
fn seed_before_attach(
    fp: &mut bpf::FastPath,
    seeds: Result<bpf::seed::Seeds, crate::netlink::raw::RawError>,
    what: &str,
    metrics: &Metrics,
) {
    match seeds {
        Ok(seeds) => seed(fp, &seeds, SeedAt::Attach(what), metrics),
        Err(err) => warn!(
            "cannot read conntrack's table before attaching to {what} ({err}); NATed \
             connections already open may be reset"
        ),
    }
}

/// Writes what conntrack's table called for ([`bpf::seed`]) into the flow tables, and says so
/// when it kept connections on the kernel path that the tables lacked.
fn seed(fp: &mut bpf::FastPath, seeds: &bpf::seed::Seeds, at: SeedAt<'_>, metrics: &Metrics) {
    let seeded = fp.seed(seeds);
    if let Ok(added) = &seeded {
        report_held(&added.held, metrics);
    }
    match seeded {
        Ok(added) if added.kernel_flows + added.nat_guards > 0 => {
            match at {
                SeedAt::Attach(what) => info!(
                    kernel_flows = added.kernel_flows,
                    nat_guards = added.nat_guards,
                    "open NATed connections kept on the kernel path before attaching to {what}"
                ),
                SeedAt::Resync => info!(
                    kernel_flows = added.kernel_flows,
                    nat_guards = added.nat_guards,
                    refreshed = added.refreshed,
                    "open NATed connections the flow tables had lost (evicted, or begun while \
                     the fast path attached) put back on the kernel path"
                ),
            }
            for (kind, n) in [
                ("kernel_flow", added.kernel_flows),
                ("nat_guard", added.nat_guards),
            ] {
                metrics
                    .fastpath_conntrack_kept
                    .get_or_create(&KindLabel { kind: kind.into() })
                    .inc_by(n as u64);
            }
        }
        Ok(_) => {}
        Err(err) => warn!("writing open NATed connections into the flow tables: {err}"),
    }
    if seeds.unreadable > 0 {
        debug!(
            entries = seeds.unreadable,
            "conntrack entries that could not be read"
        );
    }
}

/// Sets the `held` entries gauge to what the held flow tables hold
/// ([`bpf::seed::Seeds::held`]); says when they changed, and warns when open connections did
/// not fit (those rely on the LRU tables and the resync, as all did before).
fn report_held(held: &bpf::seed::HeldSync, metrics: &Metrics) {
    metrics
        .bpf_entries
        .get_or_create(&KindLabel {
            kind: "held".into(),
        })
        .set(held.held as i64);
    if held.full > 0 {
        warn!(
            held = held.held,
            not_held = held.full,
            "the held flow tables are full: open NATed connections beyond them can lose their \
             flow-table entry to an eviction until the next resync (--ebpf-held-max-entries \
             raises their size)"
        );
    } else if held.added + held.removed > 0 {
        debug!(
            held = held.held,
            added = held.added,
            removed = held.removed,
            "held flow tables updated from conntrack"
        );
    }
}

/// How many times its own duration a resync waits at least before the next one: a table so
/// large that reading it takes a while (0.15 s at 130,000 NATed flows) is read less often,
/// so that the resync never takes more than 2 % of a core.
const RESYNC_DUTY: u32 = 50;

/// How often the resync looks at how many flow-table entries the programs have learnt.
const LEARN_POLL: Duration = Duration::from_secs(1);

/// The wait before the next resync: `period`, or longer when the last one took `took`
/// ([`RESYNC_DUTY`]).
fn resync_delay(period: Duration, took: Duration) -> Duration {
    period.max(took.saturating_mul(RESYNC_DUTY))
}

/// Whether the programs have learnt so many flow-table entries since the last read that the
/// next one should not wait for its period: half an LRU table's worth (of kernel flows, or of
/// NAT guards; both families counted together). A connection opened just after a read is then
/// read, and held, before the entries learnt after it could have evicted it from the LRU
/// table, however fast short flows (DNS lookups through a Service) come.
fn learning_calls_for_a_read(learnt: bpf::Learnt) -> bool {
    learnt.kernel_flows >= u64::from(names::KERNEL_FLOWS4_MAX_ENTRIES / 2)
        || learnt.nat_guards >= u64::from(names::NAT_GUARD4_MAX_ENTRIES / 2)
}

/// What started a resync.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ResyncCause {
    /// Its period passed.
    Period,
    /// The programs learnt half an LRU table since the last read ([`learning_calls_for_a_read`]).
    Learning,
}

impl ResyncCause {
    fn label(self) -> &'static str {
        match self {
            ResyncCause::Period => "period",
            ResyncCause::Learning => "learning",
        }
    }
}

/// The programs' learnt entries so far; `None` when the handle cannot be read (the period
/// alone then paces the reads).
fn learnt(fast_path: &SharedFastPath) -> Option<bpf::Learnt> {
    fast_path.lock().ok()?.learnt().ok()
}

/// Waits for the next resync: `delay` after the last one ended (`ended`), or sooner once the
/// programs have learnt enough since `before` ([`learning_calls_for_a_read`]), but never
/// sooner than `floor` after it (the duty limit). `None` when `cancel` fired.
async fn next_resync(
    fast_path: &SharedFastPath,
    before: Option<bpf::Learnt>,
    ended: Instant,
    delay: Duration,
    floor: Duration,
    cancel: &CancellationToken,
) -> Option<ResyncCause> {
    loop {
        let elapsed = ended.elapsed();
        if elapsed >= delay {
            return Some(ResyncCause::Period);
        }
        if elapsed >= floor
            && let (Some(before), Some(now)) = (before, learnt(fast_path))
            && learning_calls_for_a_read(now.since(before))
        {
            return Some(ResyncCause::Learning);
        }
        tokio::select! {
            () = cancel.cancelled() => return None,
            () = tokio::time::sleep(LEARN_POLL.min(delay - elapsed)) => {}
        }
    }
}

/// Reads conntrack's table every `period` (`--ebpf-conntrack-resync`, stretched for a huge
/// table: [`resync_delay`]), or sooner when the programs learn flows fast
/// ([`learning_calls_for_a_read`]), and writes what it calls for into the flow tables
/// ([`bpf::seed`]), until `cancel`. The programs learn a NATed connection from its packets,
/// and the start-up and new-port reads cover the ones open before; this resync covers the
/// rest: an entry the LRU evicted (a long-idle Service connection on a node whose DNS lookups
/// fill the table: the backend's next packet would reach the pod un-translated) comes back
/// within a period, open connections are held, and every other live one is rewritten, so that
/// eviction takes closed flows first. Also a connection begun between a read and the attach
/// it preceded.
pub async fn resync_conntrack(
    fast_path: SharedFastPath,
    period: Duration,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    // The attach has just read the table: the first resync is a period away.
    let (mut delay, mut floor) = (period, Duration::ZERO);
    let mut ended = Instant::now();
    let mut before = learnt(&fast_path);
    let mut failing = false;
    loop {
        let Some(cause) = next_resync(&fast_path, before, ended, delay, floor, &cancel).await
        else {
            return;
        };
        metrics
            .fastpath_conntrack_resyncs
            .get_or_create(&KindLabel {
                kind: cause.label().into(),
            })
            .inc();
        if cause == ResyncCause::Learning {
            debug!("conntrack read early: the programs learnt half a flow table since the last");
        }
        let started = Instant::now();
        // Learnt from here on counts towards the next read (this one may miss it).
        before = learnt(&fast_path);
        let scope = match fast_path.lock() {
            Ok(fp) => fp.seed_scope(),
            Err(_) => return,
        };
        let seeds = match scope {
            Ok(scope) => {
                match tokio::task::spawn_blocking(move || bpf::seed::collect(&scope)).await {
                    Ok(read) => read.map_err(|e| format!("reading conntrack's table: {e}")),
                    Err(_) => continue,
                }
            }
            Err(e) => Err(format!("reading the fast path's configuration back: {e}")),
        };
        // Logged once per outage.
        match (&seeds, failing) {
            (Err(err), false) => warn!(
                "cannot resync the flow tables from conntrack ({err}); evicted entries of \
                 NATed connections stay lost until it works again"
            ),
            (Ok(_), true) => info!("the flow tables are resynced from conntrack again"),
            _ => {}
        }
        failing = seeds.is_err();
        if let Ok(seeds) = seeds {
            let Ok(mut fp) = fast_path.lock() else {
                return;
            };
            seed(&mut fp, &seeds, SeedAt::Resync, &metrics);
        }
        let took = started.elapsed();
        ended = Instant::now();
        delay = resync_delay(period, took);
        floor = took.saturating_mul(RESYNC_DUTY);
        if delay > period {
            debug!(
                took_ms = took.as_millis() as u64,
                next_in_s = delay.as_secs(),
                "conntrack resync slow; the next one waits longer"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{IpipOptions, UdpOptions, VxlanOptions};

    #[test]
    fn half_a_flow_table_learnt_calls_for_a_read() {
        let learnt = |kernel_flows, nat_guards| bpf::Learnt {
            kernel_flows,
            nat_guards,
        };
        assert!(!learning_calls_for_a_read(learnt(32_767, 8_191)));
        assert!(learning_calls_for_a_read(learnt(32_768, 0)));
        assert!(learning_calls_for_a_read(learnt(0, 8_192)));
        // Counters read after the programs were reloaded (lower than before): nothing learnt.
        assert_eq!(learnt(5, 5).since(learnt(40_000, 9_000)), learnt(0, 0));
        assert_eq!(
            learnt(40_000, 9_000).since(learnt(5, 5)),
            learnt(39_995, 8_995)
        );
    }

    #[test]
    fn a_slow_resync_waits_longer() {
        let period = Duration::from_secs(10);
        assert_eq!(resync_delay(period, Duration::from_millis(5)), period);
        assert_eq!(resync_delay(period, Duration::from_millis(200)), period);
        assert_eq!(
            resync_delay(period, Duration::from_millis(500)),
            Duration::from_secs(25)
        );
    }

    #[test]
    fn every_backend_with_a_fast_path_and_both_families() {
        let vxlan = BackendOptions::Vxlan(VxlanOptions::default());
        for stack in [IpStack::V4, IpStack::Dual, IpStack::V6] {
            assert_eq!(unsupported(&vxlan, stack), None, "vxlan {stack:?}");
            assert_eq!(
                unsupported(&BackendOptions::HostGw, stack),
                None,
                "host-gw {stack:?}"
            );
        }
        for backend in [
            BackendOptions::Udp(UdpOptions::default()),
            BackendOptions::Ipip(IpipOptions::default()),
        ] {
            assert_eq!(unsupported(&backend, IpStack::V4), None);
            assert_eq!(unsupported(&backend, IpStack::Dual), None);
            let why = unsupported(&backend, IpStack::V6).expect("IPv4-only backend");
            assert!(why.contains("IPv4 only"), "{why}");
        }
        let gbp = BackendOptions::Vxlan(VxlanOptions {
            gbp: true,
            ..VxlanOptions::default()
        });
        assert!(unsupported(&gbp, IpStack::V4).is_some());
    }
}
