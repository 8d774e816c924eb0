//! The health server (`--healthz-ip:--healthz-port`, off when the port is 0): `/healthz`
//! (liveness, always 200), `/readyz` (200 once the lease is held, subnet.env written and the
//! dataplane programmed; 503 before; never reverts, as upstream) and `/metrics` (Prometheus).
//! Response texts are upstream's.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// Readiness, set once by the daemon.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set_ready(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Clone)]
struct AppState {
    ready: Readiness,
    metrics: Arc<Metrics>,
}

/// The HTTP routes, separate from the listener so tests can call them directly.
fn router(ready: Readiness, metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "flanneld is running" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(AppState { ready, metrics })
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    if state.ready.is_ready() {
        (StatusCode::OK, "flanneld is ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "flanneld is not ready yet")
    }
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
}

/// Binds `addr` and serves until `cancel` fires. Binding errors are returned (the daemon
/// treats them as fatal, as upstream does).
pub async fn serve(
    addr: SocketAddr,
    ready: Readiness,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
    let app = router(ready, metrics);
    Ok(tokio::spawn(async move {
        let shutdown = async move { cancel.cancelled().await };
        if let Err(err) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::warn!(%err, "health server stopped");
        }
    }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn endpoints_answer_as_upstream() {
        let ready = Readiness::default();
        let metrics = Arc::new(Metrics::new());
        metrics.leases.set(2);
        let cancel = CancellationToken::new();
        // Bind to an ephemeral port first to learn a free one.
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = probe.local_addr().unwrap();
        drop(probe);
        let task = serve(addr, ready.clone(), metrics, cancel.clone())
            .await
            .unwrap();

        let live = get(addr, "/healthz").await;
        assert!(live.starts_with("HTTP/1.1 200"), "{live}");
        assert!(live.ends_with("flanneld is running"), "{live}");

        let not_ready = get(addr, "/readyz").await;
        assert!(not_ready.starts_with("HTTP/1.1 503"), "{not_ready}");
        assert!(
            not_ready.ends_with("flanneld is not ready yet"),
            "{not_ready}"
        );
        ready.set_ready();
        let is_ready = get(addr, "/readyz").await;
        assert!(is_ready.starts_with("HTTP/1.1 200"), "{is_ready}");
        assert!(is_ready.ends_with("flanneld is ready"), "{is_ready}");

        let metrics = get(addr, "/metrics").await;
        assert!(metrics.contains("flannel_leases 2"), "{metrics}");
        let missing = get(addr, "/nope").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");

        cancel.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
    }
}
