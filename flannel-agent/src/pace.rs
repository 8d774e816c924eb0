//! Pacing the agent's rewrites of what it published, and its repairs of the dataplane's
//! kernel entries, when something else changes them.

use std::time::Duration;

use tokio::time::Instant;

/// How soon what the agent published (its Node's annotations, its etcd lease) may be written
/// again after something changed it: a second after the last rewrite, the gap doubling up to
/// a minute while rewrites follow each other within a minute (something that keeps undoing
/// them is not fought at full speed).
#[derive(Debug, Default)]
pub struct RewritePace {
    last: Option<Instant>,
    gap: Duration,
}

impl RewritePace {
    /// The gap after a rewrite alone.
    pub const FIRST: Duration = Duration::from_secs(1);
    /// The longest gap.
    pub const MAX: Duration = Duration::from_secs(60);

    /// `None`: write now (counted as done); `Some(t)`: not before `t`.
    pub fn wait_for(&mut self) -> Option<Instant> {
        self.at(Instant::now())
    }

    /// The gap the last rewrite set: [`RewritePace::FIRST`] after one alone, longer while
    /// rewrites keep following each other.
    pub fn gap(&self) -> Duration {
        self.gap
    }

    fn at(&mut self, now: Instant) -> Option<Instant> {
        self.gap = match self.last {
            Some(last) if now < last + self.gap => return Some(last + self.gap),
            Some(last) if now <= last + Self::MAX => (self.gap * 2).min(Self::MAX),
            _ => Self::FIRST,
        };
        self.last = Some(now);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_back_off_while_something_undoes_them() {
        let s = Duration::from_secs;
        let t0 = Instant::now();
        let mut pace = RewritePace::default();
        assert_eq!(pace.at(t0), None);
        assert_eq!(pace.at(t0 + s(0)), Some(t0 + s(1)));
        // Undone again and again: 1, 2, 4, ... up to 60 s between rewrites.
        let mut t = t0;
        for gap in [1, 2, 4, 8, 16, 32, 60, 60] {
            assert_eq!(
                pace.at(t + s(gap) - Duration::from_millis(1)),
                Some(t + s(gap))
            );
            t += s(gap);
            assert_eq!(pace.at(t), None, "after {gap} s");
        }
        // Left alone for a minute: a second again.
        t += s(61);
        assert_eq!(pace.at(t), None);
        assert_eq!(pace.at(t + s(0)), Some(t + s(1)));
    }
}
