//! Named, timed steps with a summary at the end.

use std::time::{Duration, Instant};

use anyhow::Result;

/// The outcome of one step.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    name: String,
    took: Duration,
    ok: bool,
}

/// The steps run so far.
#[derive(Debug, Default)]
pub struct Steps {
    records: Vec<Record>,
}

impl Steps {
    /// Runs `f` as step `name`: announces it, times it, records the outcome. An error is
    /// returned with the step's name and duration in front.
    pub fn run<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        eprintln!("==> {name}");
        let start = Instant::now();
        let result = f();
        let took = start.elapsed();
        self.records.push(Record {
            name: name.to_owned(),
            took,
            ok: result.is_ok(),
        });
        match result {
            Ok(v) => {
                eprintln!("<== {name}: ok ({})", human(took));
                Ok(v)
            }
            Err(e) => Err(e.context(format!("step `{name}` failed after {}", human(took)))),
        }
    }

    /// A table of every step, its result and duration, and the total.
    pub fn summary(&self) -> String {
        let width = self.records.iter().map(|r| r.name.len()).max().unwrap_or(0);
        let mut out = String::from("summary:\n");
        for r in &self.records {
            let status = if r.ok { "ok" } else { "FAILED" };
            out.push_str(&format!(
                "  {:width$}  {status:6}  {:>8}\n",
                r.name,
                human(r.took)
            ));
        }
        let total: Duration = self.records.iter().map(|r| r.took).sum();
        out.push_str(&format!(
            "  {:width$}  {:6}  {:>8}\n",
            "total",
            "",
            human(total)
        ));
        out
    }

    /// Whether any step ran.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

/// `0.4s`, `12.3s`, `4m05s`.
pub fn human(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if secs < 60.0 {
        format!("{secs:.1}s")
    } else {
        let whole = d.as_secs();
        format!("{}m{:02}s", whole / 60, whole % 60)
    }
}

#[cfg(test)]
mod tests {
    use anyhow::anyhow;

    use super::*;

    #[test]
    fn formats_durations() {
        assert_eq!(human(Duration::from_millis(420)), "0.4s");
        assert_eq!(human(Duration::from_secs_f64(59.94)), "59.9s");
        assert_eq!(human(Duration::from_secs(245)), "4m05s");
    }

    #[test]
    fn records_success_and_failure() {
        let mut steps = Steps::default();
        assert_eq!(steps.run("fmt", || Ok(7)).ok(), Some(7));
        let err = steps
            .run("clippy", || -> Result<()> { Err(anyhow!("1 warning")) })
            .expect_err("fails");
        let text = format!("{err:#}");
        assert!(
            text.starts_with("step `clippy` failed after ") && text.ends_with("s: 1 warning"),
            "{text}"
        );
        let summary = steps.summary();
        assert!(summary.contains("fmt     ok"), "{summary}");
        assert!(summary.contains("clippy  FAILED"), "{summary}");
        assert!(summary.contains("total"), "{summary}");
    }
}
