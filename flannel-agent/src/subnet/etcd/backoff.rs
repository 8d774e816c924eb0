//! Retry pacing (exponential back-off) and cancellation.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Doubling back-off between `min` and `max` (upstream's watch retry: 100 ms doubling to 5 s).
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Starts at `min` (raised to at least 1 ms so that no loop can spin).
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        let min = min.max(Duration::from_millis(1));
        let max = max.max(min);
        Backoff {
            min,
            max,
            next: min,
        }
    }

    /// The delay to wait now; the following one is twice as long, up to `max`.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    /// Back to `min` after a success.
    pub(crate) fn reset(&mut self) {
        self.next = self.min;
    }

    /// The upper bound (also how long a connection must last to count as healthy).
    pub(crate) fn max(&self) -> Duration {
        self.max
    }
}

/// Runs `fut` unless `cancel` fires first (`None` then).
pub(crate) async fn or_cancel<T>(
    cancel: &CancellationToken,
    fut: impl Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        _ = cancel.cancelled() => None,
        v = fut => Some(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_max_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let delays: Vec<u128> = (0..9).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
        // A zero minimum still waits: no hot loop.
        let mut z = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert_eq!(z.next_delay(), Duration::from_millis(1));
        assert_eq!(z.next_delay(), Duration::from_millis(1));
    }

    #[tokio::test]
    async fn cancellation_interrupts_the_future() {
        let cancel = CancellationToken::new();
        cancel.cancel();
        assert_eq!(or_cancel(&cancel, std::future::pending::<()>()).await, None);
        let live = CancellationToken::new();
        assert_eq!(or_cancel(&live, async { 7 }).await, Some(7));
    }
}
