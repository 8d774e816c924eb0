//! The eBPF fast path's targets (issue 4) checked on a `bench dataplane` report, one sentence
//! each, with the floor variant's figure for the same metric next to the agent's when the
//! floor ran too: whether a miss is the agent's or the path's.
//!
//! A target is judged on the median of the paired ratios (each repetition against the
//! baseline measured next to it, [`MetricResult::paired`]), the steadier figure on a noisy
//! machine, or on the ratio of the medians where there are no pairs; "in every repetition"
//! says that each paired ratio met it, not only their median.

use super::{
    report::{MetricResult, Report, VariantRecord},
    variant::{UNDERLAY, UNDERLAY_V6},
};

/// A bound on a ratio.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bound {
    /// At least this ratio (throughput).
    AtLeast(f64),
    /// At most this ratio (latency, CPU).
    AtMost(f64),
}

impl Bound {
    fn holds(self, ratio: f64) -> bool {
        match self {
            Bound::AtLeast(min) => ratio >= min,
            Bound::AtMost(max) => ratio <= max,
        }
    }
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bound::AtLeast(min) => write!(f, ">= {min}x"),
            Bound::AtMost(max) => write!(f, "<= {max}x"),
        }
    }
}

/// One target: metric `key` of the agent's `variant` against `underlay`, with the floor
/// variant that shows the least any eBPF forwarder reaches on the same path.
struct Target {
    variant: &'static str,
    underlay: &'static str,
    floor: Option<&'static str>,
    key: &'static str,
    bound: Bound,
}

/// Whether `record`'s ratios are to `underlay`, as the targets are: to the baseline the run
/// recorded for it (reports written before that was kept: the run's baseline).
fn against(report: &Report, record: &VariantRecord, underlay: &str) -> bool {
    record.baseline.as_deref().unwrap_or(&report.baseline) == underlay
}

/// Throughput, latency and CPU per Gbit targets of issue 4 for an eBPF variant.
fn dataplane_targets(
    variant: &'static str,
    underlay: &'static str,
    floor: Option<&'static str>,
    throughput: Option<f64>,
    latency: Option<f64>,
) -> Vec<Target> {
    let mut out = Vec::new();
    let mut add = |key, bound| {
        out.push(Target {
            variant,
            underlay,
            floor,
            key,
            bound,
        })
    };
    if let Some(min) = throughput {
        add("tcp1_gbps", Bound::AtLeast(min));
        add("tcp2_gbps", Bound::AtLeast(min));
    }
    if let Some(max) = latency {
        add("rr_p50_us", Bound::AtMost(max));
        add("rr_best_us", Bound::AtMost(max));
    }
    add("cpu1_s_per_gbit", Bound::AtMost(1.1));
    add("cpu2_s_per_gbit", Bound::AtMost(1.1));
    out
}

/// Every target against the baseline: host-gw (throughput >= 0.98x, latency <= 1.1x) and VXLAN
/// (>= 0.95x, <= 1.25x) of both families, CPU per Gbit <= 1.1x for those and IPIP.
fn targets() -> Vec<Target> {
    [
        dataplane_targets(
            "agent-ebpf-host-gw",
            UNDERLAY,
            Some("floor-ebpf-host-gw"),
            Some(0.98),
            Some(1.1),
        ),
        dataplane_targets(
            "agent-ebpf-vxlan",
            UNDERLAY,
            Some("floor-ebpf-vxlan"),
            Some(0.95),
            Some(1.25),
        ),
        dataplane_targets("agent-ebpf-ipip", UNDERLAY, None, None, None),
        dataplane_targets(
            "agent-ebpf-host-gw-v6",
            UNDERLAY_V6,
            None,
            Some(0.98),
            Some(1.1),
        ),
        dataplane_targets(
            "agent-ebpf-vxlan-v6",
            UNDERLAY_V6,
            None,
            Some(0.95),
            Some(1.25),
        ),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// eBPF VXLAN against kernel VXLAN: (eBPF variant, kernel variant), throughput at least 1.15x.
const AGAINST_KERNEL: [(&str, &str); 2] = [
    ("agent-ebpf-vxlan", "agent-vxlan"),
    ("agent-ebpf-vxlan-v6", "agent-vxlan-v6"),
];

/// The ratio a target is judged on ([`MetricResult::paired`]'s median, else the ratio of the
/// medians), in words, and whether the bound holds for it and for every repetition.
fn judged(m: &MetricResult, bound: Bound) -> Option<(String, bool, bool)> {
    match (&m.paired, m.ratio) {
        (Some(p), ratio) => {
            let of_medians = ratio.map(|r| format!("{r:.2}x, ")).unwrap_or_default();
            Some((
                format!(
                    "{of_medians}paired {:.2}x [{:.2}-{:.2}]",
                    p.median, p.min, p.max
                ),
                bound.holds(p.median),
                bound.holds(p.min) && bound.holds(p.max),
            ))
        }
        (None, Some(r)) => Some((format!("{r:.2}x"), bound.holds(r), false)),
        (None, None) => None,
    }
}

fn verdict(met: bool, every: bool) -> &'static str {
    match (met, every) {
        (true, true) => "met in every repetition",
        (true, false) => "met",
        (false, _) => "NOT met",
    }
}

/// The targets of issue 4 checked on a `bench dataplane` report, one sentence each (variants
/// or metrics missing from the report, and ratios to another baseline than the variant's
/// underlay, are skipped).
pub fn check(report: &Report) -> Vec<String> {
    let record = |variant: &str| report.variants.iter().find(|v| v.variant == variant);
    let metric = |variant: &str, key: &str| record(variant)?.metric(key);
    let mut out = Vec::new();
    for t in targets() {
        let Some(r) = record(t.variant) else {
            continue;
        };
        let Some(m) = r.metric(t.key) else {
            continue;
        };
        if !against(report, r, t.underlay) {
            continue;
        }
        let Some((figure, met, every)) = judged(m, t.bound) else {
            continue;
        };
        let mut line = format!(
            "{} {}: {figure} (target {}): {}",
            t.variant,
            m.label,
            t.bound,
            verdict(met, every)
        );
        if let Some((floor, f)) = t
            .floor
            .and_then(|floor| Some((floor, metric(floor, t.key)?)))
            && let Some((figure, met, every)) = judged(f, t.bound)
        {
            line += &format!("; {floor} {figure}: {}", verdict(met, every));
        }
        out.push(line);
    }
    for (ebpf, kernel) in AGAINST_KERNEL {
        for key in ["tcp1_gbps", "tcp2_gbps"] {
            let (Some(e), Some(k)) = (metric(ebpf, key), metric(kernel, key)) else {
                continue;
            };
            if k.summary.median <= 0.0 {
                continue;
            }
            let r = e.summary.median / k.summary.median;
            out.push(format!(
                "{ebpf} {} against {kernel}: {r:.2}x (target >= 1.15x): {}",
                e.label,
                verdict(r >= 1.15, false)
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::bench::{report::Machine, stats::Summary};

    fn metric(key: &str, label: &str, median: f64, ratio: f64, paired: &[f64]) -> MetricResult {
        MetricResult {
            key: key.into(),
            label: label.into(),
            unit: "x".into(),
            higher_is_better: key.ends_with("gbps"),
            summary: Summary::of(&[median]).expect("summary"),
            ratio: Some(ratio),
            paired: Summary::of(paired),
        }
    }

    fn record(name: &str, metrics: Vec<MetricResult>) -> VariantRecord {
        VariantRecord {
            variant: name.into(),
            description: String::new(),
            baseline: None,
            metrics,
            errors: Vec::new(),
        }
    }

    fn report(variants: Vec<VariantRecord>) -> Report {
        Report {
            name: "dataplane".into(),
            machine: Machine::current(),
            baseline: "underlay".into(),
            settings: json!({}),
            variants,
            targets: Vec::new(),
        }
    }

    #[test]
    fn targets_are_judged_on_the_paired_median_with_the_floor_next_to_them() {
        let r = report(vec![
            record(
                "agent-ebpf-host-gw",
                vec![
                    metric("tcp1_gbps", "TCP 1 stream", 30.0, 0.97, &[0.99, 1.0, 0.984]),
                    metric("rr_best_us", "RR fastest", 8.5, 1.12, &[1.05, 1.2, 1.12]),
                    metric("cpu1_s_per_gbit", "CPU 1", 0.07, 1.0, &[]),
                ],
            ),
            record(
                "floor-ebpf-host-gw",
                vec![metric(
                    "rr_best_us",
                    "RR fastest",
                    8.4,
                    1.1,
                    &[1.0, 1.09, 1.08],
                )],
            ),
        ]);
        let lines = check(&r);
        assert_eq!(
            lines,
            [
                "agent-ebpf-host-gw TCP 1 stream: 0.97x, paired 0.99x [0.98-1.00] \
                 (target >= 0.98x): met in every repetition",
                "agent-ebpf-host-gw RR fastest: 1.12x, paired 1.12x [1.05-1.20] \
                 (target <= 1.1x): NOT met; floor-ebpf-host-gw 1.10x, paired 1.08x \
                 [1.00-1.09]: met in every repetition",
                "agent-ebpf-host-gw CPU 1: 1.00x (target <= 1.1x): met",
            ]
        );
    }

    #[test]
    fn ebpf_vxlan_is_checked_against_kernel_vxlan() {
        let r = report(vec![
            record(
                "agent-ebpf-vxlan",
                vec![metric("tcp1_gbps", "TCP 1 stream", 23.0, 0.9, &[0.9])],
            ),
            record(
                "agent-vxlan",
                vec![metric("tcp1_gbps", "TCP 1 stream", 20.0, 0.7, &[0.7])],
            ),
        ]);
        let lines = check(&r);
        assert_eq!(
            lines,
            [
                "agent-ebpf-vxlan TCP 1 stream: 0.90x, paired 0.90x [0.90-0.90] \
                 (target >= 0.95x): NOT met",
                "agent-ebpf-vxlan TCP 1 stream against agent-vxlan: 1.15x (target >= 1.15x): met",
            ]
        );
    }

    #[test]
    fn targets_need_ratios_to_the_variants_own_underlay() {
        let variants = || {
            vec![
                record(
                    "agent-ebpf-host-gw",
                    vec![metric("cpu1_s_per_gbit", "CPU 1", 0.07, 1.0, &[])],
                ),
                record(
                    "agent-ebpf-host-gw-v6",
                    vec![metric("cpu1_s_per_gbit", "CPU 1", 0.07, 1.2, &[])],
                ),
            ]
        };
        // As the run records it when underlay-v6 runs too: the IPv6 variant's own baseline.
        let with_underlay_v6 = |mut r: Report| {
            for v in r.variants.iter_mut().filter(|v| v.variant.ends_with("-v6")) {
                v.baseline = Some(UNDERLAY_V6.into());
            }
            r.variants.push(record(UNDERLAY_V6, Vec::new()));
            r
        };
        let mut other = report(variants());
        other.baseline = "ref-hostgw".into();
        assert!(check(&other).is_empty(), "{:?}", check(&other));
        let ipv4_only = [String::from(
            "agent-ebpf-host-gw CPU 1: 1.00x (target <= 1.1x): met",
        )];
        assert_eq!(check(&report(variants())), ipv4_only);
        let both = check(&with_underlay_v6(report(variants())));
        assert_eq!(
            both,
            [
                ipv4_only[0].clone(),
                "agent-ebpf-host-gw-v6 CPU 1: 1.20x (target <= 1.1x): NOT met".into()
            ]
        );
        let mut v6_run = with_underlay_v6(report(variants()));
        v6_run.baseline = UNDERLAY_V6.into();
        assert_eq!(check(&v6_run), both[1..]);
    }

    #[test]
    fn a_report_without_the_variants_has_no_targets() {
        let r = report(vec![record(
            "underlay",
            vec![metric("tcp1_gbps", "TCP 1 stream", 30.0, 1.0, &[])],
        )]);
        assert!(check(&r).is_empty());
    }
}
