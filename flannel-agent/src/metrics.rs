//! Prometheus metrics: what the agent knows (leases), what it programmed (kernel entries, BPF
//! map entries), how reconciling goes (runs, duration, errors by kind) and, read at scrape time,
//! the fast path's (and the udp backend forwarder's) per-reason packet and byte counters.
//!
//! The daemon and the reconciler update the families directly; the fast-path counters come
//! from a [`CounterSource`] that reads the BPF maps when `/metrics` is scraped. A read that
//! fails is counted (`flannel_errors_total{kind="fastpath-counters"}`, shown from the next
//! scrape on) and logged once until a read succeeds again; that scrape omits the series.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, text::encode},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use crate::bpf::programs::Loaded;

/// Label of metrics broken down by a kind (entry kind, error kind).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

/// Label of the per-program metrics of the fast path.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProgramLabel {
    pub program: String,
}

/// Labels of `flannel_dataplane_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DataplaneLabels {
    /// `ebpf` or `kernel`.
    pub path: String,
    /// The backend type (`vxlan`, `host-gw`, ...).
    pub backend: String,
}

/// One fast-path counter, as read from the per-CPU counters map (summed over CPUs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FastPathCount {
    /// Where it was counted: the eBPF program (`tc_from_bridge`, ...) or `udp-forwarder`.
    pub program: &'static str,
    /// The reason's name (`flannel_common::stats::Reason::name`).
    pub reason: &'static str,
    pub packets: u64,
    pub bytes: u64,
}

/// Reads the fast-path counters at scrape time.
pub trait CounterSource: Send + Sync + 'static {
    /// The counters, or why they could not be read.
    fn read(&self) -> Result<Vec<FastPathCount>, String>;
}

/// Per-reason packet/byte counters read at scrape time from a [`CounterSource`], exported as
/// `<prefix>_packets_total{reason}` and `<prefix>_bytes_total{reason}`.
struct FastPathCollector {
    packets: (&'static str, &'static str),
    bytes: (&'static str, &'static str),
    source: Mutex<Option<Arc<dyn CounterSource>>>,
    /// Where failed reads are counted, under `error_kind`.
    errors: Family<KindLabel, Counter>,
    error_kind: &'static str,
    /// The last read failed (so the next failure is not logged again).
    failing: AtomicBool,
}

impl FastPathCollector {
    /// The eBPF programs' counters.
    fn fast_path(errors: Family<KindLabel, Counter>) -> Self {
        Self {
            packets: (
                "fastpath_packets",
                "Packets seen by the eBPF programs, by reason (fast-pathed, passed to the kernel path, dropped)",
            ),
            bytes: (
                "fastpath_bytes",
                "Bytes seen by the eBPF programs, by reason",
            ),
            source: Mutex::new(None),
            errors,
            error_kind: "fastpath-counters",
            failing: AtomicBool::new(false),
        }
    }

    /// The udp backend's user-space forwarder (TUN path).
    fn udp(errors: Family<KindLabel, Counter>) -> Self {
        Self {
            packets: (
                "udp_packets",
                "Packets handled by the udp backend's TUN forwarder, by reason (encapsulated, decapsulated, dropped)",
            ),
            bytes: (
                "udp_bytes",
                "Bytes of inner packets handled by the udp backend's TUN forwarder, by reason",
            ),
            source: Mutex::new(None),
            errors,
            error_kind: "udp-counters",
            failing: AtomicBool::new(false),
        }
    }

    /// `source`'s counters; a failure is counted, logged when the previous read succeeded,
    /// and gives no series.
    fn read(&self, source: &dyn CounterSource) -> Vec<FastPathCount> {
        match source.read() {
            Ok(counts) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(counters = self.error_kind, "counters readable again");
                }
                counts
            }
            Err(e) => {
                self.errors
                    .get_or_create(&KindLabel {
                        kind: self.error_kind.to_owned(),
                    })
                    .inc();
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        counters = self.error_kind,
                        "reading the counters failed, /metrics omits them until a read succeeds: {e}"
                    );
                }
                Vec::new()
            }
        }
    }
}

impl std::fmt::Debug for FastPathCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FastPathCollector")
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    program: &'static str,
    reason: &'static str,
}

impl Collector for FastPathCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let source = self.source.lock().ok().and_then(|s| s.clone());
        let Some(source) = source else {
            return Ok(());
        };
        let counts = self.read(source.as_ref());
        for ((name, help), pick) in [
            (
                self.packets,
                (|c: &FastPathCount| c.packets) as fn(&FastPathCount) -> u64,
            ),
            (self.bytes, |c: &FastPathCount| c.bytes),
        ] {
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                ConstCounter::new(0u64).metric_type(),
            )?;
            for count in &counts {
                let label = ReasonLabel {
                    program: count.program,
                    reason: count.reason,
                };
                ConstCounter::new(pick(count)).encode(family.encode_family(&label)?)?;
            }
        }
        Ok(())
    }
}

/// Every metric the agent exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    fast_path: Arc<FastPathCollector>,
    udp: Arc<FastPathCollector>,
    /// Remote leases currently known.
    pub leases: Gauge,
    /// 1 for the active dataplane path and backend.
    pub dataplane: Family<DataplaneLabels, Gauge>,
    /// Kernel entries programmed by us, by kind (`route`, `neighbour`, `fdb`).
    pub kernel_entries: Family<KindLabel, Gauge>,
    /// BPF map entries programmed, by map.
    pub bpf_entries: Family<KindLabel, Gauge>,
    /// Remote peers that cannot be reached with the configured backend (e.g. host-gw across
    /// an L3 underlay).
    pub peers_unreachable: Gauge,
    /// Addresses the external interface had when the agent started that it no longer
    /// holds (the lease still advertises them).
    pub external_addresses_missing: Gauge,
    /// Pod bridge ports the fast path's pod-side program is attached to.
    pub fastpath_pod_ports: Gauge,
    /// Open NATed connections read from conntrack that the flow tables lacked, written into
    /// them (when the fast path attached, or on a resync), by table (`kernel_flow`,
    /// `nat_guard`).
    pub fastpath_conntrack_kept: Family<KindLabel, Counter>,
    /// Reads of conntrack by the fast path's resync, by what started them (`period`, or
    /// `learning`: the programs learnt half a flow table since the last read).
    pub fastpath_conntrack_resyncs: Family<KindLabel, Counter>,
    /// IPIP packets that arrived in fragments and were reassembled by the kernel, taken by
    /// [`crate::ipip_rx`]: `delivered`, or why each was dropped.
    pub ipip_reassembled: Family<KindLabel, Counter>,
    /// 1 while IPIP packets that carry an inner fragment go to [`crate::ipip_rx`] too
    /// (`CFG_IPIP_USER_RX`: a router was seen fragmenting IPIP), 0 otherwise.
    pub ipip_inner_fragments_to_agent: Gauge,
    /// Per fast-path program: the instructions the verifier processed to load it.
    fastpath_program_verified: Family<ProgramLabel, Gauge>,
    /// Per fast-path program: how long its load took, in seconds.
    fastpath_program_load: Family<ProgramLabel, Gauge<f64, AtomicU64>>,
    /// Completed reconcile runs.
    pub reconcile_runs: Counter,
    /// Duration of reconcile runs in seconds.
    pub reconcile_duration: Histogram,
    /// Errors by kind (`netlink`, `bpf`, `etcd`, `kube`, `traffic-rules`, `lease`, ...).
    pub errors: Family<KindLabel, Counter>,
    /// Times the masquerade/forward rules were found wrong and repaired.
    pub traffic_rule_repairs: Counter,
    /// Fast-path TC programs found detached by something else and attached again, by program.
    pub fastpath_reattached: Family<KindLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("flannel");
        let leases = Gauge::default();
        registry.register("leases", "Remote leases currently known", leases.clone());
        let dataplane = Family::<DataplaneLabels, Gauge>::default();
        registry.register(
            "dataplane_info",
            "The active dataplane path (ebpf or kernel) and backend",
            dataplane.clone(),
        );
        let kernel_entries = Family::<KindLabel, Gauge>::default();
        registry.register(
            "kernel_entries",
            "Kernel routes, neighbours and FDB entries programmed by flannel",
            kernel_entries.clone(),
        );
        let bpf_entries = Family::<KindLabel, Gauge>::default();
        registry.register(
            "bpf_map_entries",
            "Entries in flannel's BPF maps",
            bpf_entries.clone(),
        );
        let peers_unreachable = Gauge::default();
        registry.register(
            "peers_unreachable",
            "Remote nodes that the configured backend cannot reach",
            peers_unreachable.clone(),
        );
        let external_addresses_missing = Gauge::default();
        registry.register(
            "external_addresses_missing",
            "Addresses the external interface had when the agent started that it no longer \
             holds (restart the agent to lease with its new address)",
            external_addresses_missing.clone(),
        );
        let fastpath_pod_ports = Gauge::default();
        registry.register(
            "fastpath_pod_ports",
            "Pod bridge ports whose pods' packets the eBPF fast path takes",
            fastpath_pod_ports.clone(),
        );
        let fastpath_conntrack_kept = Family::<KindLabel, Counter>::default();
        registry.register(
            "fastpath_conntrack_kept",
            "Open connections conntrack had NATed that the flow tables lacked, written into them \
             to keep them on the kernel path, when the fast path attached or on a resync \
             (kind: kernel_flow, nat_guard)",
            fastpath_conntrack_kept.clone(),
        );
        let fastpath_conntrack_resyncs = Family::<KindLabel, Counter>::default();
        registry.register(
            "fastpath_conntrack_resyncs",
            "Reads of conntrack's table into the eBPF flow tables by the periodic resync, by \
             what started them (kind: period, or learning: the programs learnt half a flow \
             table since the last read)",
            fastpath_conntrack_resyncs.clone(),
        );
        let ipip_reassembled = Family::<KindLabel, Counter>::default();
        registry.register(
            "ipip_reassembled_packets",
            "IPIP packets that arrived in fragments, reassembled by the kernel and decapsulated \
             by the agent (eBPF IPIP without a kernel ipip device): delivered, or why dropped",
            ipip_reassembled.clone(),
        );
        let ipip_inner_fragments_to_agent = Gauge::default();
        registry.register(
            "ipip_inner_fragments_to_agent",
            "1 while the fast path leaves IPIP packets that carry an inner fragment to the \
             agent's IPIP socket (a router was seen fragmenting IPIP on its way here), 0 while \
             it decapsulates them itself",
            ipip_inner_fragments_to_agent.clone(),
        );
        let fastpath_program_verified = Family::<ProgramLabel, Gauge>::default();
        registry.register(
            "fastpath_program_verified_instructions",
            "Instructions the kernel's verifier processed to load each fast-path program (the \
             kernel refuses a program above 1,000,000)",
            fastpath_program_verified.clone(),
        );
        let fastpath_program_load = Family::<ProgramLabel, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "fastpath_program_load_seconds",
            "How long loading each fast-path program took, verification included",
            fastpath_program_load.clone(),
        );
        let reconcile_runs = Counter::default();
        registry.register(
            "reconcile_runs",
            "Dataplane reconcile runs",
            reconcile_runs.clone(),
        );
        let reconcile_duration = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        registry.register(
            "reconcile_duration_seconds",
            "Duration of dataplane reconcile runs",
            reconcile_duration.clone(),
        );
        let errors = Family::<KindLabel, Counter>::default();
        registry.register("errors", "Errors by kind", errors.clone());
        let traffic_rule_repairs = Counter::default();
        registry.register(
            "traffic_rule_repairs",
            "Times the masquerade/forward rules were found changed and repaired",
            traffic_rule_repairs.clone(),
        );
        let fastpath_reattached = Family::<KindLabel, Counter>::default();
        registry.register(
            "fastpath_reattached",
            "eBPF fast-path programs found detached from an interface by something else and \
             attached again, by program (kind: tc_from_netdev, tc_to_netdev, tc_from_bridge)",
            fastpath_reattached.clone(),
        );
        let fast_path = Arc::new(FastPathCollector::fast_path(errors.clone()));
        registry.register_collector(Box::new(fast_path.clone()));
        let udp = Arc::new(FastPathCollector::udp(errors.clone()));
        registry.register_collector(Box::new(udp.clone()));
        Metrics {
            registry,
            fast_path,
            udp,
            leases,
            dataplane,
            kernel_entries,
            bpf_entries,
            peers_unreachable,
            external_addresses_missing,
            fastpath_pod_ports,
            fastpath_conntrack_kept,
            fastpath_conntrack_resyncs,
            ipip_reassembled,
            ipip_inner_fragments_to_agent,
            fastpath_program_verified,
            fastpath_program_load,
            reconcile_runs,
            reconcile_duration,
            errors,
            traffic_rule_repairs,
            fastpath_reattached,
        }
    }

    /// Sets where the udp backend's forwarder counters are read from
    /// (`flannel_udp_packets_total{reason}`, `flannel_udp_bytes_total{reason}`).
    pub fn set_udp_counter_source(&self, source: Arc<dyn CounterSource>) {
        if let Ok(mut slot) = self.udp.source.lock() {
            *slot = Some(source);
        }
    }

    /// Marks `path`/`backend` as the active dataplane (and clears any previous one), with
    /// `counters` as where its fast-path counters are read from (`None`: no fast path). The
    /// counters are in place before the path is shown, so that no scrape shows the eBPF path
    /// without them (after a restart they are the adopted pinned ones).
    pub fn set_dataplane(
        &self,
        path: &str,
        backend: &str,
        counters: Option<Arc<dyn CounterSource>>,
    ) {
        if let Ok(mut slot) = self.fast_path.source.lock() {
            *slot = counters;
        }
        self.dataplane.clear();
        self.dataplane
            .get_or_create(&DataplaneLabels {
                path: path.to_owned(),
                backend: backend.to_owned(),
            })
            .set(1);
    }

    /// Shows the fast path's programs as loaded (replacing what was shown; an empty slice, on
    /// the kernel path, shows none).
    pub fn set_programs(&self, programs: &[Loaded]) {
        self.fastpath_program_verified.clear();
        self.fastpath_program_load.clear();
        for p in programs {
            let label = ProgramLabel {
                program: p.name.to_owned(),
            };
            if let Some(n) = p.verified_insns {
                self.fastpath_program_verified
                    .get_or_create(&label)
                    .set(i64::from(n));
            }
            self.fastpath_program_load
                .get_or_create(&label)
                .set(p.took.as_secs_f64());
        }
    }

    /// Counts one error of `kind`.
    pub fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Encoding into a String cannot fail except through a broken collector.
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed;
    impl CounterSource for Fixed {
        fn read(&self) -> Result<Vec<FastPathCount>, String> {
            Ok(vec![FastPathCount {
                program: "tc_from_bridge",
                reason: "vxlan_encap",
                packets: 7,
                bytes: 700,
            }])
        }
    }

    /// Fails while `failing` is set, then reads as [`Fixed`].
    #[derive(Default)]
    struct Flaky {
        failing: AtomicBool,
    }
    impl CounterSource for Flaky {
        fn read(&self) -> Result<Vec<FastPathCount>, String> {
            if self.failing.load(Ordering::Relaxed) {
                return Err("map gone".into());
            }
            Fixed.read()
        }
    }

    #[test]
    fn renders_families_and_scrape_time_counters() {
        let m = Metrics::new();
        m.leases.set(3);
        m.set_dataplane("kernel", "vxlan", None);
        m.set_dataplane("ebpf", "vxlan", None);
        m.error("netlink");
        m.reconcile_runs.inc();
        let text = m.render();
        assert!(text.contains("flannel_leases 3"), "{text}");
        assert!(
            text.contains("flannel_dataplane_info{path=\"ebpf\",backend=\"vxlan\"} 1"),
            "{text}"
        );
        assert!(!text.contains("path=\"kernel\""), "{text}");
        assert!(
            text.contains("flannel_errors_total{kind=\"netlink\"} 1"),
            "{text}"
        );
        assert!(text.contains("flannel_reconcile_runs_total 1"), "{text}");
        assert!(!text.contains("fastpath_packets"), "{text}");
        assert!(!text.contains("fastpath_bytes"), "{text}");
        m.fastpath_pod_ports.set(2);
        assert!(
            m.render()
                .lines()
                .any(|l| l == "flannel_fastpath_pod_ports 2"),
            "{text}"
        );
        m.fastpath_conntrack_kept
            .get_or_create(&KindLabel {
                kind: "nat_guard".into(),
            })
            .inc_by(3);
        assert!(
            m.render()
                .lines()
                .any(|l| l == "flannel_fastpath_conntrack_kept_total{kind=\"nat_guard\"} 3"),
            "{text}"
        );

        m.set_dataplane("ebpf", "vxlan", Some(Arc::new(Fixed)));
        let text = m.render();
        assert!(
            text.lines()
                .any(|l| l == "flannel_fastpath_packets_total{program=\"tc_from_bridge\",reason=\"vxlan_encap\"} 7"),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l == "flannel_fastpath_bytes_total{program=\"tc_from_bridge\",reason=\"vxlan_encap\"} 700"),
            "{text}"
        );
        assert!(!text.contains("flannel_udp_"), "{text}");
        m.set_udp_counter_source(Arc::new(Fixed));
        let text = m.render();
        assert!(
            text.lines()
                .any(|l| l == "flannel_udp_packets_total{program=\"tc_from_bridge\",reason=\"vxlan_encap\"} 7"),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l == "flannel_udp_bytes_total{program=\"tc_from_bridge\",reason=\"vxlan_encap\"} 700"),
            "{text}"
        );
        m.set_programs(&[Loaded {
            name: "tc_to_netdev",
            verified_insns: Some(227_629),
            took: std::time::Duration::from_millis(250),
        }]);
        let text = m.render();
        assert!(
            text.lines().any(|l| l
                == "flannel_fastpath_program_verified_instructions{program=\"tc_to_netdev\"} 227629"),
            "{text}"
        );
        assert!(
            text.lines().any(
                |l| l == "flannel_fastpath_program_load_seconds{program=\"tc_to_netdev\"} 0.25"
            ),
            "{text}"
        );
        m.set_programs(&[]);
        assert!(!m.render().contains("program=\"tc_to_netdev\""));
        // The kernel path has no fast-path counters: they go with the eBPF path.
        m.set_dataplane("kernel", "vxlan", None);
        let text = m.render();
        assert!(!text.contains("flannel_fastpath_packets_total"), "{text}");
        assert!(text.contains("flannel_udp_packets_total"), "{text}");
    }

    /// A counter read that fails gives no series and is counted (from the next scrape on,
    /// since the error family is encoded before the collectors); the next good read shows
    /// the series again and counts nothing.
    #[test]
    fn failed_counter_reads_are_counted() {
        let m = Metrics::new();
        let source = Arc::new(Flaky::default());
        source.failing.store(true, Ordering::Relaxed);
        m.set_dataplane("ebpf", "vxlan", Some(source.clone()));
        let errors = |text: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix("flannel_errors_total{kind=\"fastpath-counters\"} "))
                .map(|n| n.parse::<u64>().expect("a count"))
        };
        let text = m.render();
        assert!(!text.contains("flannel_fastpath_packets_total{"), "{text}");
        let text = m.render();
        assert_eq!(errors(&text), Some(1), "{text}");
        source.failing.store(false, Ordering::Relaxed);
        let text = m.render();
        assert_eq!(errors(&text), Some(2), "{text}");
        assert!(
            text.lines()
                .any(|l| l == "flannel_fastpath_packets_total{program=\"tc_from_bridge\",reason=\"vxlan_encap\"} 7"),
            "{text}"
        );
        assert_eq!(errors(&m.render()), Some(2), "no new error");
    }
}
