//! Summaries of repeated measurements.

use serde::{Deserialize, Serialize};

/// Median, min and max of a metric's repetitions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Median (mean of the middle two for an even count).
    pub median: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
    /// Number of samples.
    pub reps: usize,
    /// The samples, in measurement order.
    pub samples: Vec<f64>,
}

impl Summary {
    /// Summarises the finite samples; `None` if there are none.
    pub fn of(samples: &[f64]) -> Option<Summary> {
        let mut sorted: Vec<f64> = samples.iter().copied().filter(|v| v.is_finite()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Summary {
            median,
            min: sorted[0],
            max: sorted[n - 1],
            reps: n,
            samples: samples.to_vec(),
        })
    }
}

/// `value / baseline`, `None` unless both are finite and the baseline is positive.
pub fn ratio(value: f64, baseline: f64) -> Option<f64> {
    (value.is_finite() && baseline.is_finite() && baseline > 0.0).then(|| value / baseline)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries() {
        let s = Summary::of(&[3.0, 1.0, 2.0]).expect("some");
        assert_eq!((s.median, s.min, s.max, s.reps), (2.0, 1.0, 3.0, 3));
        assert_eq!(s.samples, vec![3.0, 1.0, 2.0]);
        let s = Summary::of(&[4.0, 1.0, f64::NAN, 2.0, 3.0]).expect("some");
        assert_eq!((s.median, s.reps), (2.5, 4));
        assert_eq!(Summary::of(&[f64::NAN]), None);
        assert_eq!(ratio(1.5, 3.0), Some(0.5));
        assert_eq!(ratio(1.0, 0.0), None);
    }
}
