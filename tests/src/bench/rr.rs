//! A TCP request/response (ping-pong) latency tool for IPv6, which the installed sockperf
//! (3.7) rejects: the client opens one connection with `TCP_NODELAY`, sends a 64-byte request,
//! waits for the server to echo it back, and does it again until the time is up; every round
//! trip is timed. The first [`WARMUP`] (at most half the run) is a warm-up left out of the
//! statistics, as sockperf leaves out its own; the round-trip count covers the whole run (what
//! the programs' run time is divided by).
//!
//! `flannel-lab rr server --listen ADDR` and `flannel-lab rr client --server ADDR --seconds N`
//! run it in a namespace through `nsenter` ([`super::measure::lab_rr`] pins both to a CPU with
//! `taskset`, as [`super::measure::sockperf_rr`] pins sockperf). The client prints one
//! [`summary_line`], which [`parse_summary`] reads back.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use nix::sys::{socket::sockopt::ReceiveTimeout, time::TimeVal};

use super::measure::Latency;

/// Request and response size, as sockperf's `-m 64`.
pub const MESSAGE_LEN: usize = 64;

/// The warm-up left out of the statistics (sockperf's default), cut to half of shorter runs.
pub const WARMUP: Duration = Duration::from_millis(400);

/// How long the client waits to connect or for a response before failing.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// The prefix of the client's summary line.
const SUMMARY_PREFIX: &str = "rr:";

/// A ping-pong server: one thread accepting, one thread per connection echoing every
/// [`MESSAGE_LEN`]-byte request until the client closes.
#[derive(Debug)]
pub struct RrServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<thread::JoinHandle<()>>,
}

impl RrServer {
    /// Serves on `listener` (bound by the caller, in its namespace).
    pub fn start(listener: TcpListener) -> Result<RrServer> {
        let addr = listener.local_addr()?;
        // accept() honours SO_RCVTIMEO: the thread wakes up to notice `stop`.
        nix::sys::socket::setsockopt(&listener, ReceiveTimeout, &TimeVal::new(0, 100_000))
            .context("SO_RCVTIMEO on the listener")?;
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let stop = stop.clone();
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((conn, _)) = listener.accept() {
                        thread::spawn(move || echo(conn));
                    }
                }
            })
        };
        Ok(RrServer {
            addr,
            stop,
            accept: Some(accept),
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for RrServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// Echoes requests on `conn` until the client closes (or anything fails).
fn echo(mut conn: TcpStream) {
    // The accepted socket inherits the listener's receive timeout: a client idle for longer
    // than that is normal, so wait without one.
    let _ = conn.set_read_timeout(None);
    let _ = conn.set_nodelay(true);
    let mut buf = [0u8; MESSAGE_LEN];
    while conn.read_exact(&mut buf).is_ok() {
        if conn.write_all(&buf).is_err() {
            break;
        }
    }
}

/// The request of round trip `seq`: the sequence number, then filler; the client checks the
/// echo against it.
fn request(seq: u64) -> [u8; MESSAGE_LEN] {
    let mut msg = [b'p'; MESSAGE_LEN];
    msg[..8].copy_from_slice(&seq.to_be_bytes());
    msg
}

/// Round trips of one client run: each one's time, and when it started relative to the run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoundTrips {
    /// Round-trip times of the round trips after the warm-up, in nanoseconds.
    pub measured_ns: Vec<u64>,
    /// Every completed round trip, warm-up included.
    pub total: u64,
}

/// One client connection to `server` for `duration`: round trips back to back, the first
/// `warmup` (at most half of `duration`) left out of [`RoundTrips::measured_ns`]. Fails if
/// connecting, a request or a response fails, or an echo differs from its request.
pub fn ping_pong(server: SocketAddr, duration: Duration, warmup: Duration) -> Result<RoundTrips> {
    let mut conn = TcpStream::connect_timeout(&server, CLIENT_TIMEOUT)
        .with_context(|| format!("connecting to {server}"))?;
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    let start = Instant::now();
    let measure_from = start + warmup.min(duration / 2);
    let deadline = start + duration;
    let mut trips = RoundTrips::default();
    let mut reply = [0u8; MESSAGE_LEN];
    loop {
        let sent_at = Instant::now();
        if sent_at >= deadline {
            break;
        }
        let msg = request(trips.total);
        let done = conn
            .write_all(&msg)
            .and_then(|()| conn.read_exact(&mut reply));
        let took = sent_at.elapsed();
        if let Err(e) = done {
            let what = if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                format!("no response within {CLIENT_TIMEOUT:?}")
            } else {
                e.to_string()
            };
            bail!(
                "round trip {} to {server} failed: {what} ({} done)",
                trips.total + 1,
                trips.total
            );
        }
        ensure!(
            reply == msg,
            "round trip {} to {server}: the echo differs from the request",
            trips.total + 1
        );
        trips.total += 1;
        if sent_at >= measure_from {
            trips.measured_ns.push(took.as_nanos() as u64);
        }
    }
    Ok(trips)
}

/// The statistics of a run: nearest-rank median and 99th percentile and the mean of the
/// measured round trips, in µs; `None` if none was measured.
pub fn summarize(trips: &RoundTrips) -> Option<Latency> {
    let mut sorted = trips.measured_ns.clone();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_unstable();
    let n = sorted.len();
    // Nearest rank: the smallest value with at least p % of the observations at or below it.
    let rank = |p: f64| {
        let r = (p / 100.0 * n as f64).ceil() as usize;
        sorted[r.clamp(1, n) - 1] as f64 / 1000.0
    };
    let sum: u128 = sorted.iter().map(|&v| u128::from(v)).sum();
    Some(Latency {
        p50_us: rank(50.0),
        p99_us: rank(99.0),
        avg_us: sum as f64 / n as f64 / 1000.0,
        observations: n as u64,
        round_trips: trips.total,
    })
}

/// The client's output line for `l`.
pub fn summary_line(l: &Latency) -> String {
    format!(
        "{SUMMARY_PREFIX} round_trips={} observations={} p50_us={:.3} p99_us={:.3} avg_us={:.3}",
        l.round_trips, l.observations, l.p50_us, l.p99_us, l.avg_us
    )
}

/// Reads the [`summary_line`] in the client's output.
pub fn parse_summary(text: &str) -> Result<Latency> {
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix(SUMMARY_PREFIX))
        .context("no `rr:` summary line")?;
    let field = |key: &str| -> Result<&str> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .with_context(|| format!("the summary has no {key}: {line}"))
    };
    let float = |key: &str| -> Result<f64> {
        let v: f64 = field(key)?
            .parse()
            .with_context(|| format!("{key} in {line}"))?;
        ensure!(v.is_finite() && v >= 0.0, "{key} = {v} in {line}");
        Ok(v)
    };
    let count = |key: &str| -> Result<u64> {
        field(key)?
            .parse()
            .with_context(|| format!("{key} in {line}"))
    };
    let l = Latency {
        p50_us: float("p50_us")?,
        p99_us: float("p99_us")?,
        avg_us: float("avg_us")?,
        observations: count("observations")?,
        round_trips: count("round_trips")?,
    };
    ensure!(
        l.observations > 0 && l.observations <= l.round_trips,
        "{} observations of {} round trips: {line}",
        l.observations,
        l.round_trips
    );
    Ok(l)
}

/// `flannel-lab rr client`: one run, its [`summary_line`]; fails if nothing was measured.
pub fn client(server: SocketAddr, duration: Duration, warmup: Duration) -> Result<String> {
    let trips = ping_pong(server, duration, warmup)?;
    let l = summarize(&trips)
        .with_context(|| format!("no round trip to {server} after the warm-up"))?;
    Ok(summary_line(&l))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trips(measured_us: &[u64], total: u64) -> RoundTrips {
        RoundTrips {
            measured_ns: measured_us.iter().map(|us| us * 1000).collect(),
            total,
        }
    }

    #[test]
    fn statistics_are_nearest_rank_percentiles_and_the_mean() {
        // 1..=100 µs in a shuffled order.
        let values: Vec<u64> = (1..=100).map(|i| (i * 37) % 100 + 1).collect();
        let l = summarize(&trips(&values, 130)).expect("some");
        assert_eq!(
            l,
            Latency {
                p50_us: 50.0,
                p99_us: 99.0,
                avg_us: 50.5,
                observations: 100,
                round_trips: 130,
            }
        );
        // One slow outlier moves the mean and the tail, not the median.
        let l = summarize(&trips(&[10, 10, 10, 11, 500], 5)).expect("some");
        assert_eq!((l.p50_us, l.p99_us, l.avg_us), (10.0, 500.0, 108.2));
        let l = summarize(&trips(&[7], 1)).expect("one");
        assert_eq!((l.p50_us, l.p99_us, l.avg_us), (7.0, 7.0, 7.0));
        assert_eq!(summarize(&trips(&[], 10)), None);
    }

    #[test]
    fn summary_line_round_trips() {
        let l = Latency {
            p50_us: 14.601,
            p99_us: 21.431,
            avg_us: 16.968,
            observations: 32386,
            round_trips: 40000,
        };
        let line = summary_line(&l);
        assert_eq!(
            line,
            "rr: round_trips=40000 observations=32386 p50_us=14.601 p99_us=21.431 avg_us=16.968"
        );
        let text = format!("==> connected\n{line}\n");
        assert_eq!(parse_summary(&text).expect("parse"), l);
    }

    #[test]
    fn bad_summaries_are_errors() {
        for bad in [
            "",
            "sockperf: ---> percentile 50.000 = 14.601",
            "rr: round_trips=10 observations=5 p99_us=2 avg_us=1",
            "rr: round_trips=10 observations=5 p50_us=abc p99_us=2 avg_us=1",
            "rr: round_trips=10 observations=5 p50_us=NaN p99_us=2 avg_us=1",
            "rr: round_trips=10 observations=5 p50_us=-1 p99_us=2 avg_us=1",
            "rr: round_trips=10 observations=0 p50_us=1 p99_us=2 avg_us=1",
            "rr: round_trips=4 observations=5 p50_us=1 p99_us=2 avg_us=1",
        ] {
            assert!(parse_summary(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn loopback_ping_pong_over_ipv6() {
        let listener = TcpListener::bind("[::1]:0").expect("bind [::1]");
        let server = RrServer::start(listener).expect("server");
        let run = ping_pong(
            server.addr(),
            Duration::from_millis(300),
            Duration::from_millis(100),
        )
        .expect("ping-pong");
        assert!(run.total > 10, "{} round trips", run.total);
        // The warm-up's round trips are counted, not measured.
        let measured = run.measured_ns.len() as u64;
        assert!(
            measured > 0 && measured < run.total,
            "{measured} of {}",
            run.total
        );
        let l = parse_summary(
            &client(server.addr(), Duration::from_millis(200), WARMUP).expect("client"),
        )
        .expect("summary");
        assert!(l.p50_us > 0.0 && l.p50_us <= l.p99_us, "{l:?}");
        assert!(
            l.observations > 0 && l.observations < l.round_trips,
            "{l:?}"
        );
        // Two clients at once: each connection has its own echo thread.
        let (a, b) = thread::scope(|s| {
            let a =
                s.spawn(|| ping_pong(server.addr(), Duration::from_millis(200), Duration::ZERO));
            let b =
                s.spawn(|| ping_pong(server.addr(), Duration::from_millis(200), Duration::ZERO));
            (a.join().expect("a"), b.join().expect("b"))
        });
        assert!(a.expect("a").total > 0 && b.expect("b").total > 0);
    }

    #[test]
    fn a_server_that_does_not_echo_fails_the_client() {
        // Accepts (the kernel does) but never answers.
        let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
        let err = ping_pong(
            silent.local_addr().expect("addr"),
            Duration::from_secs(5),
            Duration::ZERO,
        )
        .expect_err("no echo");
        assert!(err.to_string().contains("no response"), "{err:#}");
        // Nothing listening.
        let addr = silent.local_addr().expect("addr");
        drop(silent);
        let err = ping_pong(addr, Duration::from_millis(100), Duration::ZERO).expect_err("refused");
        assert!(err.to_string().contains("connecting"), "{err:#}");
    }

    #[test]
    fn a_wrong_echo_fails_the_client() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let liar = thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut buf = [0u8; MESSAGE_LEN];
            conn.read_exact(&mut buf).expect("request");
            buf[0] ^= 0xff;
            conn.write_all(&buf).expect("reply");
            // Keep the connection open until the client gives up.
            let _ = conn.read(&mut buf);
        });
        let err = ping_pong(addr, Duration::from_secs(5), Duration::ZERO).expect_err("wrong echo");
        assert!(err.to_string().contains("differs"), "{err:#}");
        liar.join().expect("liar");
    }
}
