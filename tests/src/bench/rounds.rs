//! The interleaved runner behind `bench dataplane` and `bench masq`: every variant is set up
//! side by side, then measured in round-robin repetitions (rep 1: A B C, rep 2: B C A, …) so
//! slow drifts of the machine spread over all variants; a repetition's measurements
//! ([`Bench::steps`]) are each taken for every variant back to back; each metric's median is
//! compared with the baseline variant's of the same run, and each repetition's value with the
//! baseline's of the same repetition (the paired ratios).

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use super::{
    report::{Machine, MetricResult, Report, VariantRecord},
    stats::{Summary, ratio},
};

/// A reported metric: key, label, unit, higher is better.
pub type Metric = (&'static str, &'static str, &'static str, bool);

/// A benchmark [`run`] drives: its variants, how one is set up, and one repetition of its
/// metrics.
pub trait Bench {
    /// A setup to compare.
    type Variant;
    /// A variant set up; dropped (torn down) after the last repetition.
    type Bed;

    /// The metrics, in report order.
    const METRICS: &'static [Metric];
    /// What a variant is called in the unknown-name error (`variant`, `masq variant`).
    const KIND: &'static str;

    /// Every variant.
    fn all() -> Vec<Self::Variant>;
    /// A variant's name and one-line description.
    fn label(v: &Self::Variant) -> (&'static str, &'static str);
    /// The variant `v`'s ratios are taken to instead of the run's baseline when both run
    /// (another address family's own underlay, measured with its own tools).
    fn own_baseline(_v: &Self::Variant) -> Option<&'static str> {
        None
    }
    /// Sets a variant up; `log` gets progress lines.
    fn set_up(&self, v: &Self::Variant, log: &dyn Fn(&str)) -> Result<Self::Bed>;
    /// How many measurements a repetition takes. Each is taken for every variant back to
    /// back before the next one starts, so the values a ratio compares were measured
    /// seconds apart, not a whole repetition apart.
    fn steps(&self) -> usize {
        1
    }
    /// Measurement `step` of a repetition: `(index into` [`Bench::METRICS`]`, value)` pairs.
    fn measure(&self, bed: &Self::Bed, step: usize) -> Result<Vec<(usize, f64)>>;
    /// The progress line of a measurement after `rep i/n name: `: each value with its
    /// metric's key and unit.
    fn progress(&self, values: &[(usize, f64)]) -> String {
        let shown: Vec<String> = values
            .iter()
            .filter_map(|(m, v)| {
                let (key, _, unit, _) = Self::METRICS.get(*m)?;
                Some(format!("{key} {v:.3} {unit}"))
            })
            .collect();
        shown.join(", ")
    }
}

/// Settings of a run shared by every benchmark.
#[derive(Debug, Clone, Copy)]
pub struct Plan<'a> {
    /// Report name (file names and title).
    pub name: &'a str,
    /// Variant names, in set-up order.
    pub variants: &'a [String],
    /// The variant ratios are relative to.
    pub baseline: &'a str,
    /// Repetitions of every measurement.
    pub reps: usize,
}

impl<'a> Plan<'a> {
    /// The plan of a run of `variants` against `baseline`, `reps` times, reported as `name`.
    pub fn new(name: &'a str, variants: &'a [String], baseline: &'a str, reps: usize) -> Self {
        Plan {
            name,
            variants,
            baseline,
            reps,
        }
    }
}

/// Sets up the plan's variants, measures them round-robin and summarises against the
/// baseline; `settings` is recorded in the report as is. `log` gets progress lines;
/// `cancelled` is polled between steps (Ctrl-C).
pub fn run<B: Bench>(
    bench: &B,
    plan: Plan<'_>,
    settings: Value,
    log: &dyn Fn(&str),
    cancelled: &dyn Fn() -> bool,
) -> Result<Report> {
    if plan.reps == 0 {
        bail!("--reps must be at least 1");
    }
    let variants = resolve::<B>(plan.variants)?;
    let labels: Vec<_> = variants.iter().map(B::label).collect();
    let Some(base) = labels.iter().position(|(name, _)| *name == plan.baseline) else {
        bail!("the baseline {:?} is not among the variants", plan.baseline);
    };
    let own: Vec<Option<&str>> = variants.iter().map(B::own_baseline).collect();
    let bases = baselines(&labels, &own, base);
    let mut beds = Vec::new();
    for (v, (name, description)) in variants.iter().zip(&labels) {
        if cancelled() {
            bail!("cancelled");
        }
        log(&format!("setting up {name}: {description}"));
        beds.push(bench.set_up(v, log)?);
    }
    let n = beds.len();
    // Per variant and metric: (repetition, value).
    let mut samples = vec![vec![Vec::<(usize, f64)>::new(); B::METRICS.len()]; n];
    let mut errors = vec![Vec::<String>::new(); n];
    let steps = bench.steps();
    for rep in 0..plan.reps {
        for step in 0..steps {
            for k in 0..n {
                if cancelled() {
                    bail!("cancelled");
                }
                let i = (k + rep) % n;
                let name = labels[i].0;
                let head = format!("rep {}/{} {name}", rep + 1, plan.reps);
                let at = if steps > 1 {
                    format!(" step {}", step + 1)
                } else {
                    String::new()
                };
                match bench.measure(&beds[i], step) {
                    Ok(values) => {
                        log(&format!("{head}: {}", bench.progress(&values)));
                        for (m, v) in values {
                            if let Some(s) = samples[i].get_mut(m) {
                                s.push((rep, v));
                            }
                        }
                    }
                    Err(e) => {
                        log(&format!("{head}{at}: FAILED {e:#}"));
                        errors[i].push(format!("rep {}{at}: {e:#}", rep + 1));
                    }
                }
            }
        }
    }
    drop(beds);
    let summaries: Vec<Vec<Option<Summary>>> = samples
        .iter()
        .map(|per| {
            per.iter()
                .map(|s| Summary::of(&s.iter().map(|(_, v)| *v).collect::<Vec<_>>()))
                .collect()
        })
        .collect();
    let records = labels
        .iter()
        .enumerate()
        .map(|(i, (name, description))| VariantRecord {
            variant: (*name).to_owned(),
            description: (*description).to_owned(),
            baseline: Some(labels[bases[i]].0.to_owned()),
            metrics: B::METRICS
                .iter()
                .enumerate()
                .filter_map(|(m, (key, label, unit, higher))| {
                    let summary = summaries[i][m].clone()?;
                    let baseline = summaries[bases[i]][m]
                        .as_ref()
                        .map_or(f64::NAN, |s| s.median);
                    Some(MetricResult {
                        key: (*key).to_owned(),
                        label: (*label).to_owned(),
                        unit: (*unit).to_owned(),
                        higher_is_better: *higher,
                        ratio: ratio(summary.median, baseline),
                        paired: (bases[i] != i)
                            .then(|| Summary::of(&paired(&samples[i][m], &samples[bases[i]][m])))
                            .flatten(),
                        summary,
                    })
                })
                .collect(),
            errors: std::mem::take(&mut errors[i]),
        })
        .collect();
    Ok(Report {
        name: plan.name.to_owned(),
        machine: Machine::current(),
        baseline: plan.baseline.to_owned(),
        settings,
        variants: records,
        targets: Vec::new(),
    })
}

/// Each repetition's `value` divided by the `baseline` value of the same repetition, where
/// both were measured (a failed measurement leaves its repetition out).
fn paired(values: &[(usize, f64)], baseline: &[(usize, f64)]) -> Vec<f64> {
    values
        .iter()
        .filter_map(|(rep, v)| {
            let (_, b) = baseline.iter().find(|(r, _)| r == rep)?;
            ratio(*v, *b)
        })
        .collect()
}

/// For each variant, the index of the variant its ratios are taken to: its own baseline
/// (`own`) when that runs too, the run's (`base`) otherwise.
fn baselines(labels: &[(&str, &str)], own: &[Option<&str>], base: usize) -> Vec<usize> {
    own.iter()
        .map(|wanted| {
            wanted
                .and_then(|w| labels.iter().position(|(name, _)| *name == w))
                .unwrap_or(base)
        })
        .collect()
}

/// The variants of these names, in this order; an unknown name is an error listing the known.
fn resolve<B: Bench>(names: &[String]) -> Result<Vec<B::Variant>> {
    names
        .iter()
        .map(|name| {
            B::all()
                .into_iter()
                .find(|v| B::label(v).0 == name)
                .with_context(|| {
                    let known: Vec<_> = B::all().iter().map(|v| B::label(v).0).collect();
                    format!("unknown {} {name:?}; known: {}", B::KIND, known.join(", "))
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_ratios_match_repetitions() {
        // Repetition 1 of the variant failed, repetition 2 of the baseline did.
        let values = [(0, 9.0), (2, 12.0), (3, 8.0)];
        let baseline = [(0, 10.0), (1, 10.0), (3, 0.0)];
        assert_eq!(paired(&values, &baseline), vec![0.9]);
        assert_eq!(paired(&values, &[]), Vec::<f64>::new());
    }

    #[test]
    fn a_variant_with_its_own_baseline_is_compared_with_it_when_it_runs() {
        let labels = [
            ("underlay", ""),
            ("a", ""),
            ("underlay-v6", ""),
            ("b-v6", ""),
        ];
        let own = [None, None, Some("underlay-v6"), Some("underlay-v6")];
        assert_eq!(baselines(&labels, &own, 0), vec![0, 0, 2, 2]);
        // Its own baseline not in the run: the run's.
        let labels = [("underlay", ""), ("b-v6", "")];
        assert_eq!(
            baselines(&labels, &[None, Some("underlay-v6")], 0),
            vec![0, 0]
        );
    }
}
