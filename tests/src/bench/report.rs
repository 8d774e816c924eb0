//! Benchmark reports: a Markdown table, JSON (one record per variant) and an SVG bar chart of
//! the ratios to the baseline (hand-written, no plotting dependency), saved as
//! `<dir>/<timestamp>-<name>.{md,json,svg}`, each headed by the machine, kernel and date.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::stats::Summary;

/// Where and when the numbers were taken.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// `model name` from /proc/cpuinfo.
    pub cpu_model: String,
    /// Online CPUs.
    pub cores: usize,
    /// `uname -r`.
    pub kernel: String,
    /// UTC, ISO 8601.
    pub date: String,
}

impl Machine {
    /// Reads this machine's description.
    pub fn current() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_else(|| "unknown".to_owned());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "unknown".to_owned());
        let (date, _) = utc_now();
        Machine {
            cpu_model,
            cores,
            kernel,
            date,
        }
    }
}

/// (`2026-11-29T11:33:00Z`, `20261129-113300`) for now.
pub fn utc_now() -> (String, String) {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    utc_strings(secs)
}

/// ISO date and file-name stamp for a Unix time.
pub fn utc_strings(unix: u64) -> (String, String) {
    let days = (unix / 86_400) as i64;
    let rem = unix % 86_400;
    let (h, m, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Days since 1970-01-01 to a civil date (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    (
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{m:02}:{s:02}Z"),
        format!("{y:04}{mo:02}{d:02}-{h:02}{m:02}{s:02}"),
    )
}

/// One metric of one variant.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MetricResult {
    /// Short key, e.g. `tcp1_gbps`.
    pub key: String,
    /// Human label.
    pub label: String,
    /// Unit of median/min/max.
    pub unit: String,
    /// Whether a larger value is better (throughput) or worse (latency, CPU).
    pub higher_is_better: bool,
    /// The repetitions.
    #[serde(flatten)]
    pub summary: Summary,
    /// Median divided by the baseline variant's median.
    pub ratio: Option<f64>,
    /// Paired ratios: each repetition's value divided by the baseline's from the same
    /// repetition (measured back to back, seconds apart), summarised over the repetitions.
    /// `None` for a baseline itself and where no repetition has both values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paired: Option<Summary>,
}

/// Everything measured for one variant.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VariantRecord {
    /// Variant name.
    pub variant: String,
    /// What it is.
    pub description: String,
    /// The variant its ratios are to: its own baseline when that ran (`underlay-v6` for the
    /// IPv6 variants), the run's otherwise. `None` in reports written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    /// Its metrics (same order for every variant).
    pub metrics: Vec<MetricResult>,
    /// Failed repetitions, with the reason.
    pub errors: Vec<String>,
}

impl VariantRecord {
    /// The metric with this key, if the variant has it.
    pub fn metric(&self, key: &str) -> Option<&MetricResult> {
        self.metrics.iter().find(|m| m.key == key)
    }
}

/// A finished benchmark.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// e.g. `dataplane`.
    pub name: String,
    /// Where it ran.
    pub machine: Machine,
    /// The variant every ratio is relative to.
    pub baseline: String,
    /// Run settings (reps, durations, …).
    pub settings: Value,
    /// One record per variant.
    pub variants: Vec<VariantRecord>,
    /// The bench's targets checked on the numbers, one sentence each (see `flannel-lab
    /// bench`; empty for a bench without targets).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<String>,
}

fn fmt_value(v: f64) -> String {
    if !v.is_finite() {
        "n/a".to_owned()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

impl Report {
    /// The median of metric `key` of `variant` (`None` if either is missing).
    pub fn median(&self, variant: &str, key: &str) -> Option<f64> {
        self.variants
            .iter()
            .find(|v| v.variant == variant)?
            .metrics
            .iter()
            .find(|m| m.key == key)
            .map(|m| m.summary.median)
    }

    /// The header lines shared by every format.
    fn header(&self) -> Vec<String> {
        vec![
            format!("benchmark: {}", self.name),
            format!(
                "machine: {} ({} cores), kernel {}",
                self.machine.cpu_model, self.machine.cores, self.machine.kernel
            ),
            format!("date: {}", self.machine.date),
            format!(
                "baseline: {}; {}",
                self.baseline,
                short_settings(&self.settings)
            ),
        ]
    }

    /// Every metric some variant has (a variant may lack some: a measurement that failed
    /// every time, or one that only applies to some variants), in the variants' own order: a
    /// metric first seen in a later variant goes right after the one it follows there.
    fn columns(&self) -> Vec<&MetricResult> {
        let mut columns: Vec<&MetricResult> = Vec::new();
        for variant in &self.variants {
            let mut at = 0;
            for m in &variant.metrics {
                match columns.iter().position(|c| c.key == m.key) {
                    Some(i) => at = i + 1,
                    None => {
                        columns.insert(at, m);
                        at += 1;
                    }
                }
            }
        }
        columns
    }

    /// The Markdown report: header, then one table (variants × metrics, each cell
    /// `median [min–max] ratio×`, or `—` where a variant lacks the metric).
    pub fn markdown(&self) -> String {
        let mut out = format!("# flannel-lab bench {}\n\n", self.name);
        for line in self.header().iter().skip(1) {
            let _ = writeln!(out, "- {line}");
        }
        if let Some(obj) = self.settings.as_object() {
            for (k, v) in obj
                .iter()
                .filter(|(_, v)| v.as_str().is_some_and(|s| s.len() > 24))
            {
                let _ = writeln!(out, "- {k}: {}", v.as_str().unwrap_or_default());
            }
        }
        out += "\nCells: median [min–max] over the repetitions, then the ratio of the median \
                to the baseline's (for throughput higher is better; for latency and CPU lower \
                is better).\n\n";
        let columns = self.columns();
        if columns.is_empty() {
            return out + "(no variants)\n";
        }
        out += "| variant |";
        for m in &columns {
            let _ = write!(out, " {} ({}) |", m.label, m.unit);
        }
        out += "\n|---|";
        for _ in &columns {
            out += "---|";
        }
        out += "\n";
        for v in &self.variants {
            let _ = write!(out, "| {} |", v.variant);
            for column in &columns {
                let Some(m) = v.metric(&column.key) else {
                    out += " — |";
                    continue;
                };
                let ratio = m.ratio.map(|r| format!(" **{r:.2}×**")).unwrap_or_default();
                let _ = write!(
                    out,
                    " {} [{}–{}]{ratio} |",
                    fmt_value(m.summary.median),
                    fmt_value(m.summary.min),
                    fmt_value(m.summary.max),
                );
            }
            out += "\n";
        }
        out += "\n";
        out += &self.paired_table(&columns);
        if !self.targets.is_empty() {
            out += "Targets:\n\n";
            for line in &self.targets {
                let _ = writeln!(out, "- {line}");
            }
            out += "\n";
        }
        for v in &self.variants {
            let _ = writeln!(out, "- `{}`: {}", v.variant, v.description);
            for e in &v.errors {
                let _ = writeln!(out, "  - error: {e}");
            }
        }
        out
    }

    /// The table of paired ratios (see [`MetricResult::paired`]), one row per variant that
    /// has any; empty when none has.
    fn paired_table(&self, columns: &[&MetricResult]) -> String {
        let rows: Vec<&VariantRecord> = self
            .variants
            .iter()
            .filter(|v| v.metrics.iter().any(|m| m.paired.is_some()))
            .collect();
        if rows.is_empty() {
            return String::new();
        }
        let mut out = "Paired ratios: each repetition's value divided by the baseline's from the \
                       same repetition (the two measured back to back), median [min–max] over \
                       the repetitions. Slow drifts of the machine between repetitions cancel \
                       out; the range shows how steady the ratio is.\n\n"
            .to_owned();
        out += "| variant |";
        for m in columns {
            let _ = write!(out, " {} |", m.label);
        }
        out += "\n|---|";
        for _ in columns {
            out += "---|";
        }
        out += "\n";
        for v in rows {
            let _ = write!(out, "| {} |", v.variant);
            for column in columns {
                match v.metric(&column.key).and_then(|m| m.paired.as_ref()) {
                    Some(p) => {
                        let _ = write!(out, " **{:.2}×** [{:.2}–{:.2}] |", p.median, p.min, p.max);
                    }
                    None => out += " — |",
                }
            }
            out += "\n";
        }
        out + "\n"
    }

    /// The JSON report.
    pub fn json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).context("serialising the report")
    }

    /// A grouped bar chart of the ratios (one group per metric, one bar per variant, a
    /// dashed line at 1.0 = baseline).
    pub fn svg(&self) -> String {
        const COLORS: [&str; 8] = [
            "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f",
        ];
        // Only metrics with a ratio to the baseline can be drawn on the ratio axis.
        let metrics: Vec<(&str, &str, String)> = self
            .columns()
            .into_iter()
            .filter(|c| {
                self.variants
                    .iter()
                    .any(|v| v.metric(&c.key).is_some_and(|m| m.ratio.is_some()))
            })
            .map(|m| {
                let better = if m.higher_is_better {
                    "higher"
                } else {
                    "lower"
                };
                (
                    m.key.as_str(),
                    m.label.as_str(),
                    format!("{}, {better} is better", m.unit),
                )
            })
            .collect();
        let nv = self.variants.len().max(1);
        let (bar, left, top, plot_h) = (24.0, 60.0, 90.0, 260.0);
        // Room for the longest group label (about 6 px per character at 11 px).
        let longest = metrics
            .iter()
            .map(|(_, l, u)| l.len().max(u.len()))
            .max()
            .unwrap_or(0) as f64;
        let group_w = (nv as f64 * bar + 30.0).max(longest * 6.0 + 12.0);
        let gap = group_w - nv as f64 * bar;
        let legend_w = self
            .variants
            .iter()
            .map(|v| v.variant.len() + v.description.len() + 2)
            .max()
            .unwrap_or(0) as f64
            * 6.0
            + left
            + 40.0;
        let width = (left + metrics.len().max(1) as f64 * group_w + 20.0).max(legend_w);
        let legend_h = 18.0 * nv as f64;
        let height = top + plot_h + 60.0 + legend_h;
        let max_ratio = self
            .variants
            .iter()
            .flat_map(|v| v.metrics.iter().filter_map(|m| m.ratio))
            .fold(1.5_f64, f64::max)
            * 1.1;
        let y = |r: f64| top + plot_h - r / max_ratio * plot_h;
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" \
             font-family=\"sans-serif\" font-size=\"11\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
        );
        for (i, line) in self.header().iter().enumerate() {
            let _ = writeln!(
                s,
                "<text x=\"10\" y=\"{}\" font-size=\"{}\">{}</text>",
                16 + i * 16,
                if i == 0 { 14 } else { 11 },
                xml_escape(line)
            );
        }
        // Axis with ticks every 0.25.
        let mut tick = 0.0;
        while tick <= max_ratio {
            let _ = writeln!(
                s,
                "<line x1=\"{left}\" x2=\"{:.1}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{tick:.2}×</text>",
                width - 20.0,
                left - 4.0,
                y(tick) + 4.0,
                y = y(tick),
            );
            tick += 0.25;
        }
        let _ = writeln!(
            s,
            "<line x1=\"{left}\" x2=\"{:.1}\" y1=\"{y1:.1}\" y2=\"{y1:.1}\" stroke=\"black\" \
             stroke-dasharray=\"6,3\"/>",
            width - 20.0,
            y1 = y(1.0)
        );
        for (mi, (key, label, unit)) in metrics.iter().enumerate() {
            let gx = left + mi as f64 * group_w + gap / 2.0;
            for (vi, v) in self.variants.iter().enumerate() {
                let Some(r) = v.metric(key).and_then(|m| m.ratio) else {
                    continue;
                };
                let x = gx + vi as f64 * bar;
                let _ = writeln!(
                    s,
                    "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\">\
                     <title>{} {}: {r:.3}×</title></rect>\
                     <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"9\">{r:.2}</text>",
                    y(r),
                    bar - 2.0,
                    top + plot_h - y(r),
                    COLORS[vi % COLORS.len()],
                    xml_escape(&v.variant),
                    xml_escape(label),
                    x + (bar - 2.0) / 2.0,
                    y(r) - 3.0,
                );
            }
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#666\" \
                 font-size=\"10\">{}</text>",
                gx + nv as f64 * bar / 2.0,
                top + plot_h + 16.0,
                xml_escape(label),
                gx + nv as f64 * bar / 2.0,
                top + plot_h + 30.0,
                xml_escape(unit),
            );
        }
        for (vi, v) in self.variants.iter().enumerate() {
            let ly = top + plot_h + 48.0 + vi as f64 * 18.0;
            let _ = writeln!(
                s,
                "<rect x=\"{left}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{}\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\">{}: {}</text>",
                ly,
                COLORS[vi % COLORS.len()],
                left + 18.0,
                ly + 10.0,
                xml_escape(&v.variant),
                xml_escape(&v.description),
            );
        }
        s += "</svg>\n";
        s
    }

    /// Reads a report back from its JSON (to re-render the Markdown and SVG).
    pub fn from_json(text: &str) -> Result<Report> {
        serde_json::from_str(text).context("parsing a report JSON")
    }

    /// Writes `<dir>/<stamp>-<name>.{md,json,svg}` and returns the paths.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let (_, stamp) = utc_now();
        let base = dir.join(format!("{stamp}-{}", self.name));
        let mut paths = Vec::new();
        for (ext, body) in [
            ("md", self.markdown()),
            ("json", self.json()?),
            ("svg", self.svg()),
        ] {
            let path = base.with_extension(ext);
            std::fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
            paths.push(path);
        }
        Ok(paths)
    }
}

/// `key value` pairs of the settings' numbers and short strings (long descriptions are in
/// the JSON and Markdown only).
fn short_settings(settings: &Value) -> String {
    let Some(obj) = settings.as_object() else {
        return settings.to_string();
    };
    obj.iter()
        .filter_map(|(k, v)| match v {
            Value::String(s) if s.len() <= 24 => Some(format!("{k} {s}")),
            Value::String(_) => None,
            other => Some(format!("{k} {other}")),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `target/bench` of this workspace (next to the running executable's target directory),
/// else `./target/bench`.
pub fn default_dir() -> PathBuf {
    crate::lab::bins::target_dir()
        .unwrap_or_else(|| PathBuf::from("target"))
        .join("bench")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metric(key: &str, median: f64, ratio: Option<f64>) -> MetricResult {
        MetricResult {
            key: key.into(),
            label: key.into(),
            unit: "Gbit/s".into(),
            higher_is_better: true,
            summary: Summary::of(&[median]).expect("summary"),
            ratio,
            paired: None,
        }
    }

    fn report() -> Report {
        Report {
            name: "dataplane".into(),
            machine: Machine {
                cpu_model: "Test CPU <x>".into(),
                cores: 2,
                kernel: "6.18".into(),
                date: "2026-11-29T00:00:00Z".into(),
            },
            baseline: "underlay".into(),
            settings: serde_json::json!({"reps": 1}),
            variants: vec![
                VariantRecord {
                    variant: "underlay".into(),
                    description: "node to node".into(),
                    baseline: Some("underlay".into()),
                    metrics: vec![metric("tcp1", 40.0, Some(1.0))],
                    errors: vec![],
                },
                VariantRecord {
                    variant: "ref-vxlan".into(),
                    description: "vxlan by hand".into(),
                    baseline: Some("underlay".into()),
                    metrics: vec![metric("tcp1", 30.0, Some(0.75))],
                    errors: vec!["rep 2: boom".into()],
                },
            ],
            targets: Vec::new(),
        }
    }

    #[test]
    fn dates() {
        assert_eq!(
            utc_strings(0),
            ("1970-01-01T00:00:00Z".into(), "19700101-000000".into())
        );
        assert_eq!(utc_strings(1_795_951_980).0, "2026-11-29T11:33:00Z");
        assert_eq!(utc_strings(951_782_400).0, "2000-02-29T00:00:00Z");
    }

    #[test]
    fn formats() {
        let r = report();
        let md = r.markdown();
        assert!(
            md.contains("| ref-vxlan | 30.0 [30.0–30.0] **0.75×** |"),
            "{md}"
        );
        assert!(md.contains("kernel 6.18"), "{md}");
        assert!(md.contains("error: rep 2: boom"), "{md}");
        let text = r.json().expect("json");
        let back = Report::from_json(&text).expect("round trip");
        assert_eq!(back.markdown(), md);
        assert_eq!(back.variants[1].baseline.as_deref(), Some("underlay"));
        let json: Value = serde_json::from_str(&text).expect("parse");
        assert_eq!(json["variants"].as_array().map(Vec::len), Some(2));
        assert_eq!(json["variants"][1]["metrics"][0]["ratio"], 0.75);
        assert_eq!(json["variants"][1]["metrics"][0]["median"], 30.0);
        assert_eq!(json["machine"]["cores"], 2);
        let svg = r.svg();
        assert!(svg.starts_with("<svg"), "{svg}");
        assert_eq!(
            svg.matches("<rect x=").count(),
            2 + 2,
            "2 bars + 2 legend boxes"
        );
        assert!(svg.contains("Test CPU &lt;x&gt;"));
        assert!(svg.contains(">0.75<"));
        assert!(!md.contains("Paired ratios"), "{md}");
        assert!(!md.contains("Targets"), "{md}");
    }

    #[test]
    fn targets_are_listed_and_kept_in_the_json() {
        let mut r = report();
        r.targets = vec!["ref-vxlan TCP 1 stream: 0.75x (target >= 0.95x): NOT met".into()];
        let md = r.markdown();
        assert!(
            md.contains("Targets:\n\n- ref-vxlan TCP 1 stream: 0.75x (target >= 0.95x): NOT met\n"),
            "{md}"
        );
        let back = Report::from_json(&r.json().expect("json")).expect("round trip");
        assert_eq!(back.targets, r.targets);
        assert_eq!(back.markdown(), md);
    }

    #[test]
    fn paired_ratios_get_their_own_table() {
        let mut r = report();
        r.variants[1].metrics[0].paired = Summary::of(&[0.7, 0.8, 0.76]);
        let md = r.markdown();
        assert!(md.contains("Paired ratios"), "{md}");
        assert!(md.contains("| ref-vxlan | **0.76×** [0.70–0.80] |"), "{md}");
        assert!(
            !md.contains("| underlay | **"),
            "the baseline has no row: {md}"
        );
        let back = Report::from_json(&r.json().expect("json")).expect("round trip");
        assert_eq!(back.markdown(), md);
    }

    #[test]
    fn a_metric_only_some_variants_have_gets_its_column() {
        let mut r = report();
        r.variants[1].metrics.push(metric("bpf_ns", 250.0, None));
        let md = r.markdown();
        assert!(
            md.contains("| underlay | 40.0 [40.0–40.0] **1.00×** | — |"),
            "{md}"
        );
        assert!(
            md.contains("| ref-vxlan | 30.0 [30.0–30.0] **0.75×** | 250 [250–250] |"),
            "{md}"
        );
        // No ratio, no bar: still 2 bars + 2 legend boxes.
        assert_eq!(r.svg().matches("<rect x=").count(), 4);
    }

    #[test]
    fn columns_keep_the_metrics_order_when_the_first_variant_lacks_one() {
        let mut r = report();
        r.variants[0].metrics.push(metric("c", 3.0, None));
        r.variants[1].metrics.push(metric("b", 2.0, None));
        r.variants[1].metrics.push(metric("c", 3.0, None));
        let keys: Vec<&str> = r.columns().iter().map(|m| m.key.as_str()).collect();
        assert_eq!(keys, ["tcp1", "b", "c"]);
    }
}
