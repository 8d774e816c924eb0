//! A TCP connection-rate tool (netperf's `TCP_CRR`): every client connects, sends a
//! 64-byte request, reads the 128-byte response until the server closes, closes, and starts
//! over. The rate is completed connections per second over all clients.
//!
//! The server closes first, so its side holds `TIME_WAIT` and clients can reuse their ports
//! at once (the server accepts a new SYN on a `TIME_WAIT` tuple with newer timestamps), the
//! way short-lived HTTP/1.0 exchanges look. Sockets are created in the caller's network
//! namespace: the benches start the server with [`spawn_server`] (`flannel-lab crr --listen`,
//! which runs [`CrrServer`]) and the clients with [`run_clients_in`].

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use nix::sys::{socket::sockopt::ReceiveTimeout, time::TimeVal};

use crate::{
    lab::{
        bins,
        process::{Output, Process, wait_tcp_listen},
    },
    netns::NetNs,
};

/// The request a client sends.
pub const REQUEST: [u8; 64] = [b'q'; 64];
/// The response the server sends before closing.
pub const RESPONSE: [u8; 128] = [b'r'; 128];

/// How long a client waits for a connection or response before counting an error.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection-rate server: `threads` threads accepting on one listener.
#[derive(Debug)]
pub struct CrrServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl CrrServer {
    /// Serves on `listener` (bound by the caller, in its namespace) with `threads` threads.
    pub fn start(listener: TcpListener, threads: usize) -> Result<CrrServer> {
        let addr = listener.local_addr()?;
        // accept() honours SO_RCVTIMEO: the threads wake up to notice `stop`.
        nix::sys::socket::setsockopt(&listener, ReceiveTimeout, &TimeVal::new(0, 100_000))
            .context("SO_RCVTIMEO on the listener")?;
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..threads.max(1))
            .map(|_| {
                let listener = listener.clone();
                let stop = stop.clone();
                thread::spawn(move || serve(&listener, &stop))
            })
            .collect();
        Ok(CrrServer {
            addr,
            stop,
            threads,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for CrrServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve(listener: &TcpListener, stop: &AtomicBool) {
    let mut buf = [0u8; REQUEST.len()];
    while !stop.load(Ordering::Relaxed) {
        let Ok((mut conn, _)) = listener.accept() else {
            continue;
        };
        let _ = conn.set_read_timeout(Some(CLIENT_TIMEOUT));
        if conn.read_exact(&mut buf).is_ok() {
            let _ = conn.write_all(&RESPONSE);
        }
        // Dropping closes: the server's FIN comes first.
    }
}

/// What [`run_clients`] measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrrResult {
    /// Completed connections (request sent, whole response read).
    pub connections: u64,
    /// Failed attempts (connect, write, short or late response).
    pub errors: u64,
    /// Wall time of the run.
    pub seconds: f64,
}

impl CrrResult {
    /// Completed connections per second.
    pub fn per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.connections as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// One connection: connect, request, response until close.
fn one(server: SocketAddr) -> Result<()> {
    let mut conn = TcpStream::connect_timeout(&server, CLIENT_TIMEOUT)?;
    conn.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    conn.set_nodelay(true)?;
    conn.write_all(&REQUEST)?;
    let mut got = Vec::with_capacity(RESPONSE.len());
    conn.read_to_end(&mut got)?;
    if got.len() != RESPONSE.len() {
        bail!("short response: {} bytes", got.len());
    }
    Ok(())
}

/// Starts a connection-rate server (`flannel-lab crr --listen`, `threads` accepting threads)
/// on `addr` in `ns`, once it listens; it stops when the returned process is dropped.
pub fn spawn_server(ns: &NetNs, addr: SocketAddr, threads: usize) -> Result<Process> {
    let tool = bins::lab_tool()?.to_string_lossy().into_owned();
    let listen = addr.to_string();
    let threads = threads.to_string();
    let argv = [
        tool.as_str(),
        "crr",
        "--listen",
        &listen,
        "--clients",
        &threads,
    ];
    let mut server = Process::spawn(ns, &argv, Output::Null)?;
    wait_tcp_listen(ns, addr.port(), &mut server, Duration::from_secs(10))?;
    Ok(server)
}

/// [`run_clients`] from inside the network namespace `ns`.
pub fn run_clients_in(
    ns: &NetNs,
    server: SocketAddr,
    clients: usize,
    duration: Duration,
) -> Result<CrrResult> {
    ns.enter(move || run_clients(server, clients, duration))?
}

/// Runs `clients` clients against `server` for `duration`; fails if nothing completed.
pub fn run_clients(server: SocketAddr, clients: usize, duration: Duration) -> Result<CrrResult> {
    let start = Instant::now();
    let deadline = start + duration;
    let per_client: Vec<(u64, u64)> = thread::scope(|s| {
        let handles: Vec<_> = (0..clients.max(1))
            .map(|_| {
                s.spawn(move || {
                    let (mut ok, mut failed) = (0u64, 0u64);
                    while Instant::now() < deadline {
                        match one(server) {
                            Ok(()) => ok += 1,
                            Err(_) => failed += 1,
                        }
                    }
                    (ok, failed)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or((0, 1)))
            .collect()
    });
    let result = CrrResult {
        connections: per_client.iter().map(|(ok, _)| ok).sum(),
        errors: per_client.iter().map(|(_, e)| e).sum(),
        seconds: start.elapsed().as_secs_f64(),
    };
    if result.connections == 0 {
        bail!(
            "no connection to {server} completed ({} errors)",
            result.errors
        );
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_connections_complete() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let server = CrrServer::start(listener, 2).expect("server");
        let r = run_clients(server.addr(), 2, Duration::from_millis(300)).expect("clients");
        assert!(r.connections > 10, "{r:?}");
        assert_eq!(r.errors, 0, "{r:?}");
        assert!(r.per_second() > 0.0);
        assert!(r.seconds >= 0.3);
    }

    #[test]
    fn nothing_listening_is_an_error() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let err = run_clients(addr, 1, Duration::from_millis(100)).expect_err("refused");
        assert!(err.to_string().contains("no connection"), "{err:#}");
    }
}
