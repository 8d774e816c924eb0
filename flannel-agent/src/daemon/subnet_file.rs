//! Keeps `subnet.env` as the agent wrote it for as long as it runs.

use std::{io, path::PathBuf, time::Duration};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::subnet_env::{self, SubnetEnv};

/// How often the file is checked: a read of a few hundred bytes.
pub const CHECK_EVERY: Duration = Duration::from_secs(2);

/// Every `period` until `cancel`: writes `env` to `path` again (atomically) when the file is
/// gone or says something else, with a warning. A cleanup script, an emptied `/run` or an
/// edit by hand would otherwise make the CNI plugin fail every new pod on the node (upstream:
/// "failed to load flannel 'subnet.env' file") until the agent's next start.
pub async fn keep(path: PathBuf, env: SubnetEnv, period: Duration, cancel: CancellationToken) {
    let want = env.render();
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate: the file was just written.
    tick.tick().await;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let what = match tokio::fs::read_to_string(&path).await {
            Ok(text) if text == want => continue,
            Ok(_) => "changed",
            Err(e) if e.kind() == io::ErrorKind::NotFound => "removed",
            Err(e) => {
                warn!("reading {}: {e}", path.display());
                continue;
            }
        };
        let (written, data) = (path.clone(), want.clone());
        let result = tokio::task::spawn_blocking(move || {
            subnet_env::write_atomic(&written, data.as_bytes())
        })
        .await;
        match result {
            Ok(Ok(())) => warn!(
                "{} was {what} under the agent; written again",
                path.display()
            ),
            Ok(Err(e)) => warn!(
                "{} was {what} under the agent; writing it again failed ({e}), trying again in \
                 {}s",
                path.display(),
                period.as_secs()
            ),
            Err(e) => warn!("writing {} again: {e}", path.display()),
        }
    }
}
