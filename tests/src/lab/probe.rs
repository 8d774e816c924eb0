//! Reachability checks without `ping` (not installed here): a TCP echo [`Responder`] bound in
//! one namespace and [`tcp_probe`] connecting from another, plus the pod-to-pod
//! [`Matrix`].

use std::{
    fmt,
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{netns::NetNs, topology::Pod};

/// Port the matrix responders listen on in every pod.
pub const MATRIX_PORT: u16 = 7777;

/// A TCP echo server on a thread, listening in some namespace; stops when dropped.
#[derive(Debug)]
pub struct Responder {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Responder {
    /// Listens on `ip:port` (port 0 = any) inside `ns`. The socket is created inside the
    /// namespace, so the accept loop can run on an ordinary thread.
    pub fn start(ns: &NetNs, ip: IpAddr, port: u16) -> Result<Responder> {
        let listener = ns
            .enter(move || TcpListener::bind(SocketAddr::new(ip, port)))?
            .with_context(|| format!("bind {ip}:{port} in {}", ns.name()))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                // Wait (at most 50 ms, to notice `stop`) for a connection, then accept it at
                // once so probe round trips are not inflated by polling.
                if !readable(&listener, 50) {
                    continue;
                }
                if let Ok((conn, _)) = listener.accept() {
                    thread::spawn(move || echo(conn));
                }
            }
        });
        Ok(Responder {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Whether `listener` has a pending connection within `timeout_ms`.
fn readable(listener: &TcpListener, timeout_ms: i32) -> bool {
    let mut fds = [libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    // SAFETY: `fds` is a live array of one pollfd for a socket we own.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, timeout_ms) };
    n > 0 && fds[0].revents & libc::POLLIN != 0
}

fn echo(mut conn: TcpStream) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut buf = [0u8; 64];
    if let Ok(n) = conn.read(&mut buf) {
        let _ = conn.write_all(&buf[..n]);
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Connects from `from` to a [`Responder`] at `target`, sends a token and checks the echo.
/// Returns the time from connect to echo.
pub fn tcp_probe(from: &NetNs, target: SocketAddr, timeout: Duration) -> Result<Duration> {
    from.enter(move || -> Result<Duration> {
        let start = Instant::now();
        let mut stream = TcpStream::connect_timeout(&target, timeout)
            .with_context(|| format!("connect {target}"))?;
        stream.set_read_timeout(Some(timeout))?;
        let token = format!("flannel-lab {}", start.elapsed().as_nanos());
        stream.write_all(token.as_bytes())?;
        let mut got = vec![0u8; token.len()];
        stream
            .read_exact(&mut got)
            .with_context(|| format!("echo from {target}"))?;
        if got != token.as_bytes() {
            bail!("{target} echoed {:?}", String::from_utf8_lossy(&got));
        }
        Ok(start.elapsed())
    })?
}

/// Convenience: a responder in `to` on `ip`, a probe from `from`.
pub fn tcp_reaches(from: &NetNs, to: &NetNs, ip: IpAddr, timeout: Duration) -> Result<Duration> {
    let responder = Responder::start(to, ip, 0)?;
    tcp_probe(from, responder.addr(), timeout)
}

/// Result of probing every pod from every other pod.
#[derive(Debug, Clone)]
pub struct Matrix {
    /// Row/column labels (`n1p1 10.244.3.2`).
    pub labels: Vec<String>,
    /// `cells[from][to]`: `None` on the diagonal, `Some(Ok(rtt))` or `Some(Err(reason))`.
    pub cells: Vec<Vec<Option<Result<Duration, String>>>>,
}

impl Matrix {
    /// Number of (from, to) pairs that failed.
    pub fn failures(&self) -> usize {
        self.cells
            .iter()
            .flatten()
            .filter(|c| matches!(c, Some(Err(_))))
            .count()
    }

    /// Number of pairs probed (everything but the diagonal).
    pub fn pairs(&self) -> usize {
        self.cells.iter().flatten().filter(|c| c.is_some()).count()
    }

    /// Whether every pair connected.
    pub fn all_ok(&self) -> bool {
        self.failures() == 0
    }

    /// `(from, to)` index pairs that failed.
    pub fn failed_pairs(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for (i, row) in self.cells.iter().enumerate() {
            for (j, c) in row.iter().enumerate() {
                if matches!(c, Some(Err(_))) {
                    out.push((i, j));
                }
            }
        }
        out
    }
}

impl fmt::Display for Matrix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let short: Vec<&str> = self
            .labels
            .iter()
            .map(|l| l.split_whitespace().next().unwrap_or(l))
            .collect();
        let width = self.labels.iter().map(String::len).max().unwrap_or(4);
        write!(f, "{:width$} ", "from \\ to")?;
        for s in &short {
            write!(f, " {s:>8}")?;
        }
        writeln!(f)?;
        for (label, row) in self.labels.iter().zip(&self.cells) {
            write!(f, "{label:width$} ")?;
            for cell in row {
                let text = match cell {
                    None => "-".to_owned(),
                    Some(Ok(rtt)) => format!("ok {:.1}ms", rtt.as_secs_f64() * 1e3),
                    Some(Err(_)) => "FAIL".to_owned(),
                };
                write!(f, " {text:>8}")?;
            }
            writeln!(f)?;
        }
        write!(
            f,
            "{} of {} pairs reachable",
            self.pairs() - self.failures(),
            self.pairs()
        )
    }
}

/// Probes every pod from every other pod (TCP to a responder on the target pod's IP),
/// sources in parallel.
pub fn matrix(pods: &[&Pod], timeout: Duration) -> Result<Matrix> {
    let responders = pods
        .iter()
        .map(|p| Responder::start(p.ns(), IpAddr::V4(p.ip()), MATRIX_PORT))
        .collect::<Result<Vec<_>>>()?;
    let targets: Vec<SocketAddr> = responders.iter().map(Responder::addr).collect();
    let cells = thread::scope(|scope| {
        let handles: Vec<_> = pods
            .iter()
            .enumerate()
            .map(|(i, from)| {
                let targets = &targets;
                scope.spawn(move || {
                    targets
                        .iter()
                        .enumerate()
                        .map(|(j, target)| {
                            (i != j).then(|| {
                                tcp_probe(from.ns(), *target, timeout).map_err(|e| format!("{e:#}"))
                            })
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect::<Vec<_>>()
    });
    Ok(Matrix {
        labels: pods
            .iter()
            .map(|p| format!("{} {}", p.name(), p.ip()))
            .collect(),
        cells,
    })
}
