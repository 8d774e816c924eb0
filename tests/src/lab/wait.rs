//! Bounded polling: every wait in the lab and its tests has a deadline and, when it runs out,
//! says what it waited for and what it saw last.

use std::{
    thread,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};

/// How often [`until`] polls.
pub const POLL: Duration = Duration::from_millis(100);

/// Calls `check` every [`POLL`] until it returns `Ok(Some(value))` (then returns the value)
/// or `timeout` passes (then fails with `what` and the last `Err`, if any). An `Err` from
/// `check` does not end the wait: it is the "not yet" reason.
pub fn until<T>(
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match check() {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => None,
            Err(e) => Some(format!("{e:#}")),
        };
        if Instant::now() >= deadline {
            match last {
                Some(why) => bail!("timed out after {timeout:?} waiting for {what}: {why}"),
                None => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
        thread::sleep(POLL);
    }
}

/// [`until`] for a condition: `Ok(())` once `check` returns `Ok(())`.
pub fn until_ok(
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> Result<()>,
) -> Result<()> {
    until(timeout, what, || check().map(Some))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_the_value_or_the_last_reason() {
        let mut n = 0;
        let v = until(Duration::from_secs(5), "three calls", || {
            n += 1;
            Ok((n >= 3).then_some(n))
        })
        .expect("value");
        assert_eq!(v, 3);
        let err = until_ok(Duration::from_millis(250), "never", || bail!("still 7"))
            .expect_err("times out");
        let text = format!("{err:#}");
        assert!(text.contains("waiting for never: still 7"), "{text}");
    }
}
