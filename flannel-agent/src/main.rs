//! `flannel-agent`: the node daemon. Everything lives in the library; this parses the command
//! line, installs logging and signal handling, and maps the outcome to an exit code (0 for a
//! signal or a revoked lease, 1 for a fatal error, 2 for bad flags — as upstream, except that
//! upstream exits 0 on bad flags). `--detach-fastpath` removes the fast path and exits
//! instead of running; like the daemon, it refuses to while another agent runs on the node
//! ([`flannel_agent::node_lock`]).

use std::process::ExitCode;

use flannel_agent::{cli::Cli, daemon, telemetry};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let cli = match Cli::from_process() {
        Ok(cli) => cli,
        Err(err) => {
            let _ = err.print();
            return if err.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    if cli.version {
        eprintln!("{}", Cli::version_string());
        return ExitCode::SUCCESS;
    }
    telemetry::init(cli.v);
    if cli.detach_fastpath {
        // What a node handed to upstream flanneld needs where the agent could not do it on
        // its way out (etcd mode, a killed agent): the handover and removal of `--dataplane
        // kernel`, alone.
        let path = cli.bpf_pin_path.display();
        let _node_lock = match flannel_agent::node_lock::take(&cli.state_dir) {
            Ok(lock) => lock,
            Err(err) => {
                tracing::error!("not detaching the fast path under {path}: {err}");
                return ExitCode::FAILURE;
            }
        };
        return match flannel_agent::bpf::cleanup(&cli.bpf_pin_path) {
            Ok(removed) => {
                tracing::info!(
                    removed,
                    "the fast path under {path} is detached (its connections handed to \
                     conntrack, pins and filters removed)"
                );
                ExitCode::SUCCESS
            }
            Err(err) => {
                tracing::error!("detaching the fast path under {path}: {err}");
                ExitCode::FAILURE
            }
        };
    }

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let cancel = CancellationToken::new();
        tokio::spawn(stop_on_signals(cancel.clone()));
        match daemon::run(cli, cancel).await {
            Ok(_) => ExitCode::SUCCESS,
            Err(err) => {
                tracing::error!("{err}");
                ExitCode::FAILURE
            }
        }
    })
}

/// The first SIGTERM/SIGINT cancels the daemon (which leaves the dataplane in place); a second
/// one exits at once, as upstream's handler does by unregistering itself.
async fn stop_on_signals(cancel: CancellationToken) {
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down (signal received); the dataplane stays in place");
    cancel.cancel();
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    std::process::exit(1);
}
