//! The daemon: upstream's start-up order (flannel-upstream.md 10.1) with this project's
//! pieces, then the long-running tasks until SIGTERM/SIGINT or a revoked lease.
//!
//! 1. subnet manager (etcd client or Kubernetes client + node name); health server
//! 2. network config (etcd: retried every second), backend options, IP stack
//! 3. external interface (kube: annotation-stored public IPs override the flags)
//! 4. backend data (persisted VTEP MACs) → lease attributes → lease
//! 5. devices (udp: the forwarder creates `flannel0` and binds its socket first, and its
//!    applier joins the reconciler), traffic rules, subnet.env → ready once the first
//!    reconcile on a complete lease set succeeded
//! 6. tasks: lease watch → reconciler; lease keeper (etcd) / NetworkUnavailable (kube);
//!    traffic-rule resync; subnet.env kept as written; blackhole route; status → metrics
//!    and readiness
//!
//! On SIGTERM everything that forwards traffic stays in place (devices, routes, rules, BPF
//! programs and pins) so a restarted agent adopts it without a gap.

mod fastpath;
mod manager;
mod masq;
mod policy;
mod rules;
mod subnet_file;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use tokio::{sync::watch, task::JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

pub use manager::SubnetManager;

use crate::{
    backend::{BackendError, BackendOptions, MtuError, OptionsError, VxlanLeaseData},
    cli::{Cli, Dataplane},
    dataplane::{
        self, DataplaneError, DataplaneStatus, Local, MacStore, Reconciler, ReconcilerConfig,
        Trigger, VtepMacs,
    },
    extension,
    health::{self, Readiness},
    hostnet, iface,
    ip::IpStack,
    ipsec,
    lease::{Lease, LeaseAttrs},
    metrics::{CounterSource, KindLabel, Metrics},
    netconf::ConfigError,
    netlink::{Netlink, NetlinkError, Route},
    subnet::{
        LeaseSnapshot,
        etcd::EtcdError,
        kube::{KubeError, node as kube_node},
        lease_channel,
    },
    subnet_env::{self, FamilyEnv, SubnetEnv, SubnetEnvError},
    traffic::{
        self, BR_NETFILTER_SYSCTL_DIR, IptablesVariant, SystemRunner, TrafficError, TrafficManager,
        TrafficMode,
    },
    udp::{UdpConfig, UdpError, UdpForwarder},
    wireguard,
};

/// Why the daemon stopped with an error (exit code 1). A revoked lease and a signal are not
/// errors (exit code 0), as upstream.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error(transparent)]
    Kube(#[from] KubeError),
    #[error("invalid network config: {0}")]
    Config(#[from] ConfigError),
    #[error("Error fetching backend: {0}")]
    Backend(#[from] BackendError),
    #[error("invalid backend options: {0}")]
    Options(#[from] OptionsError),
    #[error(transparent)]
    Mtu(#[from] MtuError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error("Failed to find any valid interface to use: {0}")]
    Iface(#[from] iface::IfaceError),
    #[error("failed to register network: {0}")]
    Dataplane(#[from] DataplaneError),
    #[error("failed to register network: {0}")]
    Wireguard(Box<wireguard::WireguardError>),
    #[error("failed to register network: {0}")]
    Ipsec(Box<ipsec::IpsecError>),
    #[error("failed to register network: {0}")]
    Extension(Box<extension::Failed>),
    #[error("failed to set up masquerade/forward rules: {0}")]
    Traffic(#[from] TrafficError),
    #[error("failed to start the udp backend: {0}")]
    Udp(#[from] UdpError),
    #[error("Failed to write subnet file: {0}")]
    SubnetEnv(#[from] SubnetEnvError),
    #[error("health server on {addr}: {source}")]
    Health {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid --healthz-ip {0:?}")]
    HealthzIp(String),
    #[error("invalid masquerade settings: {0}")]
    NatPortRange(String),
    #[error("the eBPF fast path was requested (--dataplane=ebpf) but {0}")]
    FastPathUnavailable(String),
    #[error(transparent)]
    NodeLock(#[from] crate::node_lock::LockError),
    #[error("stopped before start-up completed")]
    Cancelled,
    #[error("a background task failed: {0}")]
    Task(String),
}

impl From<wireguard::WireguardError> for DaemonError {
    fn from(e: wireguard::WireguardError) -> Self {
        DaemonError::Wireguard(Box::new(e))
    }
}

impl From<extension::Failed> for DaemonError {
    fn from(e: extension::Failed) -> Self {
        DaemonError::Extension(Box::new(e))
    }
}

impl From<ipsec::IpsecError> for DaemonError {
    fn from(e: ipsec::IpsecError) -> Self {
        DaemonError::Ipsec(Box::new(e))
    }
}

/// How a run ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// SIGTERM/SIGINT.
    Signalled,
    /// etcd mode: our lease was deleted or expired (upstream: "Lease has been revoked.
    /// Shutting down daemon.", exit 0).
    LeaseRevoked,
}

/// Runs the agent until `cancel` fires or the lease is revoked.
pub async fn run(cli: Cli, cancel: CancellationToken) -> Result<Exit, DaemonError> {
    info!("CLI flags config: {cli:?}");
    let _node_lock = crate::node_lock::take(&cli.state_dir)?;
    let metrics = Arc::new(Metrics::new());
    let ready = Readiness::default();

    // 1. Subnet manager and health server.
    let manager = SubnetManager::from_cli(&cli).await?;
    if cli.healthz_port > 0 {
        let ip = cli
            .healthz_ip
            .parse()
            .map_err(|_| DaemonError::HealthzIp(cli.healthz_ip.clone()))?;
        let addr = SocketAddr::new(ip, cli.healthz_port);
        health::serve(addr, ready.clone(), metrics.clone(), cancel.clone())
            .await
            .map_err(|source| DaemonError::Health { addr, source })?;
    }

    // 2. Network config and backend.
    let config = manager.network_config(&cancel).await?;
    let stack = config.stack()?;
    let backend = BackendOptions::from_config(&config)?;
    masq::check_port_range(&cli, &backend).map_err(DaemonError::NatPortRange)?;
    let backend_type = backend.backend_type();
    info!(backend = %backend_type, ?stack, "network config loaded");
    // The fast path loads (verifying the programs takes a third of a second of kernel time)
    // while the interface is chosen and the lease taken: nothing of it depends on them, and
    // nothing is attached before step 5.
    let fast_path_load = {
        let (cli, backend) = (cli.clone(), backend.clone());
        tokio::task::spawn_blocking(move || fastpath::start(&cli, &backend, stack))
    };
    manager.wait_ready().await?;

    // 3. External interface.
    let nl = Netlink::new()?;
    let mut iface_opts = cli.iface_options(stack);
    let stored = manager.stored_public_ips().await?;
    if let Some(ip) = stored.ipv4 {
        info!("using public IP {ip} from the node annotation");
        iface_opts.public_ip = Some(ip);
    }
    if let Some(ip) = stored.ipv6 {
        info!("using public IPv6 {ip} from the node annotation");
        iface_opts.public_ipv6 = Some(ip);
    }
    let snapshot = hostnet::snapshot(&nl, iface_opts.iface_can_reach).await?;
    let ext = iface::select(&iface_opts, &snapshot)?;
    info!(
        iface = %ext.name,
        addr = ?ext.iface_addr,
        public_ip = ?ext.ext_addr,
        public_ipv6 = ?ext.ext_v6_addr,
        "using interface"
    );
    if matches!(backend, BackendOptions::HostGw) {
        dataplane::check_host_gw(&ext)?;
    }
    let mtu = backend.mtu(ext.mtu, stack)?;

    // 4. Backend data, then the lease.
    let vtep_macs = match &backend {
        BackendOptions::Vxlan(opts) => {
            let (v4, v6) = manager.stored_vtep_macs().await;
            let store = MacStore::new(cli.state_dir.clone());
            dataplane::prepare_vtep_macs(&nl, &store, opts, stack, VtepMacs { v4, v6 }).await?
        }
        _ => VtepMacs::default(),
    };
    let mut attrs = lease_attrs(&backend, &ext, stack, &vtep_macs);
    let wireguard_key = match &backend {
        BackendOptions::Wireguard(opts) => {
            let key = wireguard::load_key(&cli.wireguard_key_file)?;
            (attrs.backend_data, attrs.backend_v6_data) = wireguard::lease_data(opts, &key, stack);
            Some(key)
        }
        _ => None,
    };
    if let BackendOptions::Extension(opts) = &backend {
        attrs.backend_data = extension::pre_startup(opts).await?;
    }
    let ipsec_backend = match &backend {
        // Before the lease: a node that cannot encrypt must not announce itself.
        BackendOptions::Ipsec(opts) => Some(ipsec::IpsecBackend::prepare(opts, &ext).await?),
        _ => None,
    };
    let previous = subnet_env::previous_subnets(&cli.subnet_file);
    let lease = tokio::select! {
        () = cancel.cancelled() => return Err(DaemonError::Cancelled),
        lease = manager.acquire_lease(&attrs, &previous) => lease?,
    };
    info!(subnet = ?lease.subnet, ipv6_subnet = ?lease.ipv6_subnet, "lease acquired");
    if let BackendOptions::Extension(opts) = &backend {
        let node = extension::NodeVars {
            network: config.network,
            subnet: lease.subnet,
            ipv6_subnet: lease.ipv6_subnet,
            public_ip: Some(attrs.public_ip).filter(|ip| !ip.is_unspecified()),
            public_ipv6: attrs.public_ipv6,
        };
        extension::post_startup(opts, &node).await?;
    }

    // 5. Devices, traffic rules, subnet.env.
    let mut local = Local::new(
        lease.clone(),
        stack,
        config.network,
        config.ipv6_network,
        backend.clone(),
        ext.clone(),
        mtu,
        vtep_macs,
    );
    let fastpath::Started {
        mut active,
        nat_sizing,
    } = fast_path_load
        .await
        .map_err(|e| DaemonError::FastPathUnavailable(format!("loading thread: {e}")))??;
    local.ipip_via_ebpf =
        matches!(backend, BackendOptions::Ipip(_)) && active.fast_path().is_some();
    // udp: the forwarder creates flannel0 (it holds the TUN descriptor) before the device
    // set-up configures it; it lives until `run` returns.
    let udp = match &backend {
        BackendOptions::Udp(opts) => {
            if stack.has_v6() {
                warn!("the udp backend carries IPv4 only: IPv6 pod traffic will not cross nodes");
            }
            let config = UdpConfig::for_node(&local, opts)?;
            Some(UdpForwarder::start(&config, cancel.clone())?)
        }
        _ => None,
    };
    dataplane::ensure_devices(&nl, &mut local).await?;
    let mut backend_appliers: Vec<Box<dyn dataplane::Applier>> = Vec::new();
    if let (BackendOptions::Wireguard(opts), Some(key)) = (&backend, wireguard_key) {
        let userspace = wireguard::Userspace::new(cli.wireguard_socket_dir.clone());
        let mut applier =
            wireguard::WireguardApplier::new(nl.clone(), opts.clone(), key, userspace);
        for d in applier.ensure_devices(&local).await? {
            info!(
                device = %d.name,
                index = d.index,
                implementation = %d.implementation,
                ensured = ?d.ensured,
                "WireGuard device ready"
            );
        }
        backend_appliers.push(Box::new(applier));
    }
    if let Some(ipsec_backend) = ipsec_backend {
        backend_appliers.push(Box::new(ipsec_backend.start(&local).await?));
    }
    if let BackendOptions::Extension(opts) = &backend {
        backend_appliers.push(Box::new(extension::ExtensionApplier::new(opts)));
    }
    // Reassembled IPIP packets, where no kernel IPIP device takes them.
    let ipip_receiver = match active.fast_path() {
        Some(fp) if local.ipip_via_ebpf => fastpath::ipip_receiver(fp, &local, &metrics),
        _ => None,
    };
    if let Some(fp) = active.fast_path()
        && let Err(err) = fastpath::configure(fp, &local, &metrics)
    {
        if cli.dataplane == Dataplane::Ebpf || local.ipip_via_ebpf {
            return Err(err);
        }
        if let Err(e) = crate::bpf::cleanup(&cli.bpf_pin_path) {
            warn!("removing the fast path's pins: {e}");
        }
        active = fastpath::ActivePath::Kernel {
            why: format!("falling back to the kernel path: {err}"),
        };
    }
    let counters = active
        .fast_path()
        .map(|fp| Arc::new(crate::bpf::FastPathCounters(fp.clone())) as Arc<dyn CounterSource>);
    // The programs before the path, so that no scrape shows the eBPF path without them.
    if let Some(Ok(fp)) = active.fast_path().map(|fp| fp.lock()) {
        metrics.set_programs(fp.loaded());
    }
    metrics.set_dataplane(active.name(), backend_type.name(), counters);
    match &active {
        fastpath::ActivePath::Ebpf { fast_path } => {
            let tc_attach = fast_path.lock().map(|fp| fp.tc_attach().to_string());
            info!(
                tc_attach = tc_attach.as_deref().unwrap_or("unknown"),
                "dataplane: eBPF fast path active"
            );
        }
        fastpath::ActivePath::Kernel { why } => info!("dataplane: kernel path ({why})"),
    }

    // Before the traffic rules: the programs masquerade before the kernel stops doing it.
    let masquerade = masq::configure(&cli, active.fast_path(), &local, nat_sizing);

    let traffic_desired = rules::desired(&cli, &config, &lease);
    let traffic_previous = rules::previous(&cli.subnet_file);
    let mode = TrafficMode::from_netconf(config.enable_nftables, IptablesVariant::System);
    if mode.wants_br_netfilter() {
        for family in [traffic::Family::Ipv4, traffic::Family::Ipv6] {
            let enabled = match family {
                traffic::Family::Ipv4 => traffic_desired.ipv4.is_some(),
                traffic::Family::Ipv6 => traffic_desired.ipv6.is_some(),
            };
            if enabled
                && let Err(w) =
                    traffic::check_br_netfilter(BR_NETFILTER_SYSCTL_DIR.as_ref(), family)
            {
                warn!("{w}");
            }
        }
    }
    let mut traffic_manager = TrafficManager::new(mode, Arc::new(SystemRunner::new()));
    traffic_manager.set_masq_options(masquerade.traffic_options(&cli));
    let init_desired = traffic_desired.clone();
    let (traffic_manager, report) = tokio::task::spawn_blocking(move || {
        let report = traffic_manager.init(&init_desired, &traffic_previous);
        (traffic_manager, report)
    })
    .await
    .map_err(|e| DaemonError::Task(e.to_string()))?;
    let report = report?;
    for w in &report.warnings {
        warn!("{w}");
    }
    if !report.cleaned.is_empty() {
        info!("removed leftover rules: {}", report.cleaned.join(", "));
    }

    let env = SubnetEnv {
        ipv4: config
            .network
            .zip(lease.subnet)
            .filter(|_| stack.has_v4())
            .map(|(network, subnet)| FamilyEnv { network, subnet }),
        ipv6: config
            .ipv6_network
            .zip(lease.ipv6_subnet)
            .filter(|_| stack.has_v6())
            .map(|(network, subnet)| FamilyEnv { network, subnet }),
        mtu: mtu.flannel_mtu,
        ip_masq: cli.ip_masq,
    };
    subnet_env::write(&cli.subnet_file, &env)?;
    info!("Wrote subnet file to {}", cli.subnet_file.display());

    // 6. Long-running tasks.
    let (publisher, snapshots) = lease_channel();
    // The eBPF applier goes first: a lease event reaches the maps (a few map writes) before
    // the kernel applier lists and diffs the kernel's tables; the kernel path carries the
    // peer's traffic until the map entry exists, so the order is safe either way.
    let mut appliers: Vec<Box<dyn dataplane::Applier>> = Vec::new();
    if let Some(fp) = active.fast_path() {
        appliers.push(Box::new(
            crate::bpf::BpfApplier::new(fp.clone(), fastpath::vxlan_vni(&backend))
                .with_entries_gauge(metrics.bpf_entries.clone()),
        ));
    }
    appliers.push(Box::new(dataplane::kernel::KernelApplier::new(nl.clone())));
    let mut reconciler = Reconciler::with_appliers(
        nl.clone(),
        local,
        ReconcilerConfig::from_cli(&cli),
        appliers,
    );
    for applier in backend_appliers {
        reconciler.push_applier(applier);
    }
    if let Some(forwarder) = &udp {
        reconciler.push_applier(Box::new(forwarder.applier()));
        metrics.set_udp_counter_source(forwarder.counters());
    }
    let status = reconciler.status();
    let mut tasks: JoinSet<Result<Option<Exit>, DaemonError>> = JoinSet::new();

    {
        let manager = manager.clone();
        let cancel = cancel.clone();
        let own = lease.clone();
        tasks.spawn(async move {
            manager.watch_leases(own, publisher, cancel).await?;
            Ok(None)
        });
    }
    {
        let path = cli.subnet_file.clone();
        let cancel = cancel.clone();
        tasks.spawn(async move {
            subnet_file::keep(path, env, subnet_file::CHECK_EVERY, cancel).await;
            Ok(None)
        });
    }
    {
        // Netlink tells of the kernel's entries changing; the fast path's maps are compared
        // with what the agent wrote instead ([`fastpath::check_maps`]).
        let (drifted_tx, drifted_rx) = tokio::sync::mpsc::channel(1);
        if let Some(fp) = active.fast_path() {
            let fp = fp.clone();
            let cancel = cancel.clone();
            tasks.spawn(async move {
                fastpath::check_maps(fp, drifted_tx, cancel).await;
                Ok(None)
            });
        }
        let triggers = tokio_stream::StreamExt::merge(
            tokio_stream::StreamExt::map(nl.dataplane_events()?, Trigger::Kernel),
            tokio_stream::wrappers::ReceiverStream::new(drifted_rx),
        );
        let shutdown = cancel.clone().cancelled_owned();
        let snapshots = snapshots.clone();
        tasks.spawn(async move {
            reconciler.run(snapshots, triggers, shutdown).await;
            Ok(None)
        });
    }
    {
        let (_desired_tx, desired_rx) = watch::channel(traffic_desired);
        let period = Duration::from_secs(cli.iptables_resync);
        let shutdown = cancel.clone().cancelled_owned();
        tasks.spawn(async move {
            // The sender lives as long as this task: the rule set is fixed for a run.
            let _keep = _desired_tx;
            traffic_manager.run(desired_rx, period, shutdown).await;
            Ok(None)
        });
    }
    if let Some(fp) = active.fast_path() {
        let fp = fp.clone();
        let nl = nl.clone();
        let bridge = cli.pod_bridge.clone();
        let cancel = cancel.clone();
        let metrics = metrics.clone();
        tasks.spawn(async move {
            fastpath::follow_bridge_ports(fp, nl, bridge, metrics, cancel).await;
            Ok(None)
        });
    }
    if let Some(fp) = active.fast_path() {
        let fp = fp.clone();
        let period = Duration::from_secs(cli.resync_interval);
        let cancel = cancel.clone();
        let metrics = metrics.clone();
        tasks.spawn(async move {
            fastpath::keep_attached(fp, period, metrics, cancel).await;
            Ok(None)
        });
    }
    if let Some(fp) = active.fast_path() {
        let fp = fp.clone();
        let period = Duration::from_secs(cli.ebpf_conntrack_resync);
        let cancel = cancel.clone();
        let metrics = metrics.clone();
        tasks.spawn(async move {
            fastpath::resync_conntrack(fp, period, metrics, cancel).await;
            Ok(None)
        });
    }
    if let (Some(receiver), Some(fp)) = (ipip_receiver, active.fast_path().cloned()) {
        let cancel = cancel.clone();
        let hold = Duration::from_secs(cli.ebpf_ipip_reassembly_hold);
        let gauge = metrics.ipip_inner_fragments_to_agent.clone();
        tasks.spawn(async move {
            fastpath::run_ipip_receiver(fp, receiver, hold, gauge, cancel).await;
            Ok(None)
        });
    }
    let sweep = Duration::from_secs(cli.ebpf_nat_sweep_interval);
    match &masquerade {
        masq::Masquerade::Ebpf { fast_path, .. } => {
            let fp = fast_path.clone();
            let cancel = cancel.clone();
            tasks.spawn(async move {
                masq::maintain(fp, sweep, cancel).await;
                Ok(None)
            });
        }
        // The traffic rules are the kernel's by now.
        masq::Masquerade::Handover { fast_path } => {
            let fp = fast_path.clone();
            let cancel = cancel.clone();
            tasks.spawn(async move {
                masq::hand_over(fp, sweep, cancel).await;
                Ok(None)
            });
        }
        masq::Masquerade::Off | masq::Masquerade::Netfilter => {}
    }
    if cli.ip_blackhole_route {
        let nl = nl.clone();
        let lease = lease.clone();
        let period = Duration::from_secs(cli.iptables_resync);
        let cancel = cancel.clone();
        tasks.spawn(async move {
            blackhole_routes(nl, lease, period, cancel).await;
            Ok(None)
        });
    }
    {
        let metrics = metrics.clone();
        let ready = ready.clone();
        let cancel = cancel.clone();
        let snapshots = snapshots.clone();
        tasks.spawn(async move {
            report_status(status, snapshots, metrics, ready, cancel).await;
            Ok(None)
        });
    }
    {
        let manager = manager.clone();
        let cancel = cancel.clone();
        let lease = lease.clone();
        tasks.spawn(async move {
            info!("Running backend.");
            notify_systemd_ready();
            match manager.complete_lease(lease, cancel.clone()).await {
                Ok(()) => Ok(None),
                Err(DaemonError::Etcd(EtcdError::LeaseRevoked)) => {
                    info!("Lease has been revoked. Shutting down daemon.");
                    cancel.cancel();
                    Ok(Some(Exit::LeaseRevoked))
                }
                Err(err) => Err(err),
            }
        });
    }

    let mut exit = Exit::Signalled;
    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(Some(e))) => exit = e,
            Ok(Ok(None)) => {}
            Ok(Err(err)) => {
                error!("{err}");
                metrics.error("task");
                failure.get_or_insert(err);
                cancel.cancel();
            }
            Err(join) => {
                failure.get_or_insert(DaemonError::Task(join.to_string()));
                cancel.cancel();
            }
        }
    }
    if failure.is_none() && active.fast_path().is_some() {
        detach_for_upstream(&manager, &cli.bpf_pin_path).await;
    }
    // Closing the TUN descriptor removes flannel0, as upstream does on shutdown.
    drop(udp);
    info!("Exiting cleanly...");
    match failure {
        Some(err) => Err(err),
        None => Ok(exit),
    }
}

/// On the way out of a node labelled to be handed to upstream flanneld (kube mode, see
/// deploy/README.md): the fast path's pod connections are entered into conntrack, its
/// programs detached and its pins removed ([`crate::bpf::cleanup`]), so that upstream finds
/// the kernel path alone and without `--ip-masq` the connections are not reset. Any other
/// exit leaves the programs attached for the next agent (a restart without a gap).
async fn detach_for_upstream(manager: &SubnetManager, pin_path: &std::path::Path) {
    let labelled = tokio::time::timeout(Duration::from_secs(5), manager.labelled_for_upstream())
        .await
        .unwrap_or(false);
    if !labelled {
        return;
    }
    let label = format!("{}={}", kube_node::AGENT_LABEL, kube_node::UPSTREAM_VALUE);
    let path = pin_path.to_owned();
    match tokio::task::spawn_blocking(move || crate::bpf::cleanup(&path)).await {
        Ok(Ok(removed)) => info!(
            removed,
            "the node is labelled {label}: the fast path is detached for upstream flanneld, its \
             pod connections handed to conntrack"
        ),
        Ok(Err(e)) => warn!(
            "the node is labelled {label}, but detaching the fast path failed ({e}); remove {} \
             by hand",
            pin_path.display()
        ),
        Err(e) => warn!("detaching the fast path for upstream flanneld: {e}"),
    }
}

/// The attributes we publish: public IPs, BackendType and BackendData.
fn lease_attrs(
    backend: &BackendOptions,
    ext: &iface::ExternalInterface,
    stack: IpStack,
    macs: &VtepMacs,
) -> LeaseAttrs {
    let mut attrs = LeaseAttrs {
        public_ip: ext.ext_addr.unwrap_or(std::net::Ipv4Addr::UNSPECIFIED),
        public_ipv6: ext.ext_v6_addr.filter(|_| stack.has_v6()),
        backend_type: backend.backend_type().lease_type().to_owned(),
        ..LeaseAttrs::default()
    };
    if let BackendOptions::Vxlan(opts) = backend {
        let data = |mac| {
            VxlanLeaseData {
                vni: opts.vni,
                vtep_mac: mac,
            }
            .to_json()
        };
        attrs.backend_data = macs.v4.filter(|_| stack.has_v4()).map(data);
        attrs.backend_v6_data = macs.v6.filter(|_| stack.has_v6()).map(data);
    }
    attrs
}

/// `--ip-blackhole-route`: keeps `blackhole <own subnet>` in place (for Canal), checked every
/// `--iptables-resync` seconds, first after one period (as upstream).
async fn blackhole_routes(nl: Netlink, lease: Lease, period: Duration, cancel: CancellationToken) {
    let subnets: Vec<ipnet::IpNet> = lease
        .subnet
        .map(ipnet::IpNet::V4)
        .into_iter()
        .chain(lease.ipv6_subnet.map(ipnet::IpNet::V6))
        .collect();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(period) => {}
        }
        for subnet in &subnets {
            if let Err(err) = nl.replace_route(&Route::new(*subnet).blackhole()).await {
                warn!("ensuring blackhole route {subnet}: {err}");
            }
        }
    }
}

/// Mirrors the reconciler's status into metrics, and declares readiness once a complete
/// lease set has been programmed (subnet.env is already written by then).
async fn report_status(
    mut status: watch::Receiver<DataplaneStatus>,
    mut snapshots: watch::Receiver<LeaseSnapshot>,
    metrics: Arc<Metrics>,
    ready: Readiness,
    cancel: CancellationToken,
) {
    let mut seen_runs = 0u64;
    let mut seen_errors = std::collections::BTreeMap::<String, u64>::new();
    loop {
        {
            let s = status.borrow_and_update();
            if s.reconciles > seen_runs {
                metrics.reconcile_runs.inc_by(s.reconciles - seen_runs);
                metrics
                    .reconcile_duration
                    .observe(s.last_duration.as_secs_f64());
                seen_runs = s.reconciles;
            }
            for (kind, count) in &s.errors_by_kind {
                let before = seen_errors.insert(kind.clone(), *count).unwrap_or(0);
                if *count > before {
                    metrics
                        .errors
                        .get_or_create(&KindLabel { kind: kind.clone() })
                        .inc_by(count - before);
                }
            }
            metrics.peers_unreachable.set(s.unreachable as i64);
            metrics
                .external_addresses_missing
                .set(s.missing_addresses.len() as i64);
            let programmed = s.last.added + s.last.replaced + s.last.unchanged;
            metrics
                .kernel_entries
                .get_or_create(&KindLabel {
                    kind: "total".into(),
                })
                .set(programmed as i64);
            if !ready.is_ready() && s.healthy() {
                ready.set_ready();
                info!("flannel is ready");
            }
        }
        metrics
            .leases
            .set(snapshots.borrow_and_update().leases.len() as i64);
        tokio::select! {
            () = cancel.cancelled() => return,
            r = status.changed() => if r.is_err() { return },
            r = snapshots.changed() => if r.is_err() { return },
        }
    }
}

/// systemd `READY=1` through `NOTIFY_SOCKET` (a no-op when unset; failures are only logged).
fn notify_systemd_ready() {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let path = PathBuf::from(path);
    let sock = match std::os::unix::net::UnixDatagram::unbound() {
        Ok(s) => s,
        Err(err) => {
            warn!("systemd notify: {err}");
            return;
        }
    };
    if let Err(err) = sock.send_to(b"READY=1", &path) {
        warn!("systemd notify via {}: {err}", path.display());
    }
}
