//! Reachability checks without `ping` (not installed here): a TCP echo [`Responder`] bound in
//! one namespace and [`tcp_probe`] connecting from another, the pod-to-pod [`Matrix`] and
//! its cross-node, both-family variant [`pods_talk`], a
//! checksummed bulk [`transfer`], the source address a server sees ([`source_seen`]), UDP
//! datagrams awaited by payload ([`udp_listener`], [`recv_payload`]), a
//! continuous UDP request stream ([`UdpStream`] against a [`UdpEcho`]) that counts every
//! lost request, and a long paced TCP transfer ([`TcpFlow`]) that reports retransmissions
//! and its longest stall. A line echo server ([`line_echo_server`], [`line_round_trip`])
//! keeps a connection open and idle between round trips. [`send_ipip`] sends an IPIP packet
//! the way a kernel tunnel without path MTU discovery does, fragmented when it does not fit.

use std::{
    collections::BTreeMap,
    fmt,
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use flannel_agent::ipip_rx::RawSocket;

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

/// The peer address of each connection a [`line_echo_server`] accepted, in order.
#[derive(Debug, Clone, Default)]
pub struct Peers(Arc<std::sync::Mutex<Vec<IpAddr>>>);

impl Peers {
    /// The addresses so far.
    pub fn seen(&self) -> Vec<IpAddr> {
        self.0
            .lock()
            .map(|p| p.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    fn push(&self, peer: IpAddr) {
        match self.0.lock() {
            Ok(mut p) => p.push(peer),
            Err(e) => e.into_inner().push(peer),
        }
    }
}

/// A TCP server in `ns` on `addr` that accepts `connections` connections and echoes each line
/// back on every one until its client closes it (so a connection can stay open and idle
/// between round trips, [`line_round_trip`]). Bounded, so that no socket outlives the test's
/// namespaces.
pub fn line_echo_server(ns: &NetNs, addr: SocketAddr, connections: usize) -> Result<Peers> {
    use std::io::BufRead as _;
    let listener = ns
        .enter(move || TcpListener::bind(addr))?
        .with_context(|| format!("bind {addr} in {}", ns.name()))?;
    let peers = Peers::default();
    let seen = peers.clone();
    thread::spawn(move || {
        for conn in listener.incoming().flatten().take(connections) {
            if let Ok(peer) = conn.peer_addr() {
                seen.push(peer.ip());
            }
            thread::spawn(move || {
                let Ok(mut out) = conn.try_clone() else {
                    return;
                };
                for line in std::io::BufReader::new(conn).lines() {
                    let Ok(line) = line else { return };
                    if writeln!(out, "{line}").is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(peers)
}

/// Sends `text` and a newline on `stream` and reads the same line back.
pub fn line_round_trip(stream: &mut TcpStream, text: &str) -> Result<()> {
    stream.write_all(format!("{text}\n").as_bytes())?;
    let mut got = vec![0u8; text.len() + 1];
    stream.read_exact(&mut got)?;
    ensure!(got == format!("{text}\n").as_bytes(), "echoed {got:?}");
    Ok(())
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

    /// `Ok` if every pair connected, else an error showing the matrix.
    pub fn check(&self) -> Result<()> {
        ensure!(self.all_ok(), "pod matrix:\n{self}");
        Ok(())
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

/// TCP echo from every pod to every pod of another node over IPv6 (every pod needs an IPv6
/// address) and, when `v4`, over IPv4 too; the error lists every pair that failed.
pub fn pods_talk(pods: &[&Pod], v4: bool) -> Result<()> {
    let mut failures = Vec::new();
    for from in pods {
        for to in pods {
            if from.node() == to.node() {
                continue;
            }
            let mut targets = vec![IpAddr::V6(to.ip6_required()?)];
            if v4 {
                targets.push(IpAddr::V4(to.ip()));
            }
            for ip in targets {
                if let Err(e) = tcp_reaches(from.ns(), to.ns(), ip, Duration::from_secs(5)) {
                    failures.push(format!("{} → {} {ip}: {e:#}", from.name(), to.name()));
                }
            }
        }
    }
    ensure!(failures.is_empty(), "unreachable:\n{}", failures.join("\n"));
    Ok(())
}

/// What [`transfer`] measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transfer {
    /// Bytes the receiver counted (equal to the bytes sent on success).
    pub bytes: u64,
    /// Time from connect to the receiver's verdict.
    pub elapsed: Duration,
}

impl Transfer {
    /// Throughput in Mbit/s.
    pub fn mbit_per_s(&self) -> f64 {
        self.bytes as f64 * 8.0 / 1e6 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// FNV-1a over a byte stream, continued across calls.
fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// The `i`-th byte of the transfer pattern (not periodic in any small power of two, so a
/// lost or repeated segment changes the checksum).
fn pattern_byte(i: u64) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ (i % 251) as u8
}

/// `conn.read(buf)`, again when a signal interrupted it: a socket with a receive timeout
/// answers any handled signal (a child's exit, here) with `EINTR`, `SA_RESTART` or not.
fn read_retrying(conn: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match conn.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// Sends `bytes` bytes of a fixed pattern over one TCP connection from `from` to a receiver
/// bound on `ip` in `to`, which counts and checksums what arrives and answers with both once
/// the sender has shut its side down. Fails unless count and checksum match exactly (so
/// truncation, corruption and a stall beyond `timeout` all fail).
pub fn transfer(
    from: &NetNs,
    to: &NetNs,
    ip: IpAddr,
    bytes: u64,
    timeout: Duration,
) -> Result<Transfer> {
    let listener = to
        .enter(move || TcpListener::bind(SocketAddr::new(ip, 0)))?
        .with_context(|| format!("bind {ip}:0 in {}", to.name()))?;
    let target = listener.local_addr()?;
    let receiver = thread::spawn(move || -> Result<()> {
        listener.set_nonblocking(true)?;
        let deadline = Instant::now() + timeout;
        let (mut conn, _) = loop {
            match listener.accept() {
                Ok(c) => break c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        bail!("no connection within {timeout:?}");
                    }
                    thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e.into()),
            }
        };
        conn.set_nonblocking(false)?;
        conn.set_read_timeout(Some(timeout))?;
        let mut buf = vec![0u8; 64 * 1024];
        let (mut count, mut hash) = (0u64, FNV_OFFSET);
        loop {
            let n = read_retrying(&mut conn, &mut buf).context("receiving")?;
            if n == 0 {
                break;
            }
            hash = fnv1a(hash, &buf[..n]);
            count += n as u64;
        }
        let mut verdict = [0u8; 16];
        verdict[..8].copy_from_slice(&count.to_be_bytes());
        verdict[8..].copy_from_slice(&hash.to_be_bytes());
        conn.write_all(&verdict).context("answering")?;
        Ok(())
    });
    let sent = from.enter(move || -> Result<Transfer> {
        let start = Instant::now();
        let mut stream = TcpStream::connect_timeout(&target, timeout)
            .with_context(|| format!("connect {target}"))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_read_timeout(Some(timeout))?;
        let mut chunk = vec![0u8; 64 * 1024];
        let (mut offset, mut hash) = (0u64, FNV_OFFSET);
        while offset < bytes {
            let n = (bytes - offset).min(chunk.len() as u64) as usize;
            for (k, b) in chunk[..n].iter_mut().enumerate() {
                *b = pattern_byte(offset + k as u64);
            }
            stream
                .write_all(&chunk[..n])
                .with_context(|| format!("sending at byte {offset} of {bytes} to {target}"))?;
            hash = fnv1a(hash, &chunk[..n]);
            offset += n as u64;
        }
        stream.shutdown(std::net::Shutdown::Write)?;
        let mut verdict = [0u8; 16];
        stream
            .read_exact(&mut verdict)
            .with_context(|| format!("verdict from {target}"))?;
        let elapsed = start.elapsed();
        let mut count = [0u8; 8];
        count.copy_from_slice(&verdict[..8]);
        let mut got_hash = [0u8; 8];
        got_hash.copy_from_slice(&verdict[8..]);
        let (count, got_hash) = (u64::from_be_bytes(count), u64::from_be_bytes(got_hash));
        if count != bytes || got_hash != hash {
            bail!(
                "{target} received {count} bytes with checksum {got_hash:016x}; \
                 sent {bytes} with {hash:016x}"
            );
        }
        Ok(Transfer {
            bytes: count,
            elapsed,
        })
    });
    let received = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("receiver thread panicked"))?;
    match (sent?, received) {
        (Ok(sent), Ok(())) => Ok(sent),
        (Ok(_), Err(err)) => Err(err.context("receiver")),
        // The sender's error (a reset, a broken pipe) is often the receiver's doing: say both.
        (Err(err), Err(receiver)) => Err(err.context(format!("receiver: {receiver:#}"))),
        (Err(err), Ok(())) => Err(err),
    }
}

/// A [`transfer`] of `size` bytes with 30 s to finish; the throughput in Mbit/s.
pub fn transfer_mbit(from: &NetNs, to: &NetNs, ip: IpAddr, size: u64) -> Result<f64> {
    Ok(transfer(from, to, ip, size, Duration::from_secs(30))?.mbit_per_s())
}

/// `setsockopt(level, name, value)` for an `int` option.
pub fn set_int_option(
    socket: &impl std::os::fd::AsRawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> Result<()> {
    // SAFETY: the option value is a valid int of the size given.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    anyhow::ensure!(
        rc == 0,
        "setsockopt({level}, {name}): {}",
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// UDP with segmentation offload (`UDP_SEGMENT`, as QUIC senders use) from pod `from` to pod
/// `to`, port 6000: a first plain datagram (which resolves the neighbours on the way), then
/// three 60,000-byte sends in 1,000-byte segments. Fails unless those arrive as exactly 180
/// datagrams of 1,000 bytes (the receiving socket has room for all of them: they are read
/// after the sends).
pub fn udp_gso_arrives_segmented(from: &Pod, to: &Pod) -> Result<()> {
    const UDP_SEGMENT: libc::c_int = 103;
    let rx = to.ns().enter(|| UdpSocket::bind((to.ip(), 6000)))??;
    rx.set_read_timeout(Some(Duration::from_secs(2)))?;
    set_int_option(&rx, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 8 << 20)?;
    let tx = from.ns().enter(|| UdpSocket::bind((from.ip(), 0)))??;
    tx.send_to(b"hello", (to.ip(), 6000))?;
    let mut buf = vec![0u8; 65536];
    let (n, _) = rx.recv_from(&mut buf).context("the first datagram")?;
    ensure!(n == 5, "first datagram of {n} bytes");
    set_int_option(&tx, libc::SOL_UDP, UDP_SEGMENT, 1000)?;
    for _ in 0..3 {
        let sent = tx.send_to(&[7u8; 60_000], (to.ip(), 6000))?;
        ensure!(sent == 60_000, "sent {sent} bytes");
    }
    let mut sizes = BTreeMap::new();
    while let Ok((n, _)) = rx.recv_from(&mut buf) {
        *sizes.entry(n).or_insert(0) += 1;
    }
    ensure!(
        sizes == BTreeMap::from([(1000, 180)]),
        "received (size: count) {sizes:?}, want 180 datagrams of 1000 bytes"
    );
    Ok(())
}

/// A UDP socket bound to `addr` in `ns` (the namespace only matters at bind time), reading
/// with a 300 ms timeout (see [`recv_payload`]).
pub fn udp_listener(ns: &NetNs, addr: SocketAddr) -> Result<UdpSocket> {
    let s = ns.enter(move || UdpSocket::bind(addr))??;
    s.set_read_timeout(Some(Duration::from_millis(300)))?;
    Ok(s)
}

/// Receives on `s` until a datagram carrying exactly `payload` arrives (of any size a UDP
/// datagram can have: fragmented ones too); returns its source.
pub fn recv_payload(s: &UdpSocket, payload: &[u8], timeout: Duration) -> Result<SocketAddr> {
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; 65536];
    while Instant::now() < deadline {
        match s.recv_from(&mut buf) {
            Ok((n, from)) if &buf[..n] == payload => return Ok(from),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e.into()),
        }
    }
    bail!(
        "no datagram {:?} ({} bytes) within {timeout:?}",
        String::from_utf8_lossy(&payload[..payload.len().min(32)]),
        payload.len()
    )
}

/// Sends `payload` from `tx` to `rx`'s address and waits up to `timeout` for exactly it on
/// `rx` ([`recv_payload`]); returns the source `rx` saw.
pub fn send_and_receive(
    tx: &UdpSocket,
    rx: &UdpSocket,
    payload: &[u8],
    timeout: Duration,
) -> Result<SocketAddr> {
    tx.send_to(payload, rx.local_addr()?)?;
    recv_payload(rx, payload, timeout)
}

/// Accepts one TCP connection on `ip` in `to` from a client in `from` and returns the source
/// address the server saw (to tell masqueraded from pod-sourced traffic).
pub fn source_seen(from: &NetNs, to: &NetNs, ip: IpAddr, timeout: Duration) -> Result<IpAddr> {
    let listener = to
        .enter(move || TcpListener::bind(SocketAddr::new(ip, 0)))?
        .with_context(|| format!("bind {ip}:0 in {}", to.name()))?;
    let target = listener.local_addr()?;
    let server = thread::spawn(move || -> Result<SocketAddr> {
        listener.set_nonblocking(true)?;
        let deadline = Instant::now() + timeout;
        loop {
            match listener.accept() {
                Ok((mut conn, peer)) => {
                    let _ = conn.set_nonblocking(false);
                    let _ = conn.write_all(peer.ip().to_string().as_bytes());
                    return Ok(peer);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        bail!("no connection within {timeout:?}");
                    }
                    thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e.into()),
            }
        }
    });
    let client = from.enter(move || -> Result<String> {
        let mut stream = TcpStream::connect_timeout(&target, timeout)
            .with_context(|| format!("connect {target}"))?;
        stream.set_read_timeout(Some(timeout))?;
        let mut text = String::new();
        stream.read_to_string(&mut text)?;
        Ok(text)
    });
    let peer = server
        .join()
        .map_err(|_| anyhow::anyhow!("server thread panicked"))?;
    let told = client??;
    let peer = peer?;
    if told != peer.ip().to_string() {
        bail!("the server saw {peer} but the client read {told:?}");
    }
    Ok(peer.ip())
}

/// A UDP echo server on a thread in some namespace; stops when dropped.
#[derive(Debug)]
pub struct UdpEcho {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl UdpEcho {
    /// Binds `ip:port` (0 = any) in `ns` and echoes every datagram to its sender.
    pub fn start(ns: &NetNs, ip: IpAddr, port: u16) -> Result<UdpEcho> {
        let socket = ns
            .enter(move || UdpSocket::bind(SocketAddr::new(ip, port)))?
            .with_context(|| format!("bind udp {ip}:{port} in {}", ns.name()))?;
        socket.set_read_timeout(Some(Duration::from_millis(50)))?;
        let addr = socket.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !flag.load(Ordering::Relaxed) {
                if let Ok((n, peer)) = socket.recv_from(&mut buf) {
                    let _ = socket.send_to(&buf[..n], peer);
                }
            }
        });
        Ok(UdpEcho {
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

impl Drop for UdpEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A UDP socket in some namespace connected to one address (it takes datagrams from that
/// address only), for request/response exchanges with a [`UdpEcho`] behind it.
#[derive(Debug)]
pub struct UdpClient {
    socket: UdpSocket,
}

impl UdpClient {
    /// Binds an ephemeral port in `ns` and connects it to `target`; answers wait 3 s.
    pub fn connect(ns: &NetNs, target: SocketAddr) -> Result<UdpClient> {
        let any: SocketAddr = if target.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let socket = ns.enter(move || -> std::io::Result<UdpSocket> {
            let s = UdpSocket::bind(any)?;
            s.connect(target)?;
            Ok(s)
        })??;
        socket.set_read_timeout(Some(Duration::from_secs(3)))?;
        Ok(UdpClient { socket })
    }

    /// The local port.
    pub fn port(&self) -> Result<u16> {
        Ok(self.socket.local_addr()?.port())
    }

    /// Sends `text` and waits for it to come back from the connected address.
    pub fn echo(&self, text: &str) -> Result<()> {
        self.socket.send(text.as_bytes())?;
        let mut buf = [0u8; 64];
        // A signal (a child process of the test ending) interrupts the wait; wait on.
        let n = loop {
            match self.socket.recv(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                read => break read.with_context(|| format!("the answer to {text:?}"))?,
            }
        };
        ensure!(&buf[..n] == text.as_bytes(), "answered {:?}", &buf[..n]);
        Ok(())
    }
}

/// Counts of a [`UdpStream`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Requests sent.
    pub sent: u64,
    /// Requests answered (within the reply timeout).
    pub answered: u64,
    /// Sequence numbers that got no answer, in order (at most the first 100).
    pub lost: Vec<u64>,
    /// Lost requests in total.
    pub lost_count: u64,
    /// Longest run of consecutive lost requests.
    pub longest_outage: u64,
    /// Slowest answer.
    pub max_rtt: Duration,
}

/// A continuous request/response stream: one numbered UDP request every `interval` from a
/// namespace to a [`UdpEcho`], each answered or counted lost after a reply timeout. Runs on
/// a thread until [`UdpStream::finish`].
#[derive(Debug)]
pub struct UdpStream {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<Result<StreamStats>>>,
}

impl UdpStream {
    /// Starts sending from `from` to `target`.
    pub fn start(from: &NetNs, target: SocketAddr, interval: Duration) -> Result<UdpStream> {
        let bind = match target {
            SocketAddr::V4(_) => SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0),
            SocketAddr::V6(_) => SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), 0),
        };
        let socket = from
            .enter(move || UdpSocket::bind(bind))?
            .with_context(|| format!("bind udp in {}", from.name()))?;
        socket.connect(target)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = thread::spawn(move || run_stream(&socket, interval, &flag));
        Ok(UdpStream {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops sending, waits for the last answers and returns the counts.
    pub fn finish(mut self) -> Result<StreamStats> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow::anyhow!("stream thread panicked"))?,
            None => bail!("stream already finished"),
        }
    }
}

impl Drop for UdpStream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long a request may wait for its answer before it counts as lost.
const UDP_REPLY_TIMEOUT: Duration = Duration::from_secs(1);

fn run_stream(socket: &UdpSocket, interval: Duration, stop: &AtomicBool) -> Result<StreamStats> {
    let mut stats = StreamStats::default();
    let mut pending: BTreeMap<u64, Instant> = BTreeMap::new();
    let mut answered: std::collections::BTreeSet<u64> = Default::default();
    let mut next_send = Instant::now();
    let mut seq = 0u64;
    let mut buf = [0u8; 64];
    let mut stop_at: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if stop_at.is_none() && stop.load(Ordering::Relaxed) {
            stop_at = Some(now + UDP_REPLY_TIMEOUT);
        }
        if let Some(at) = stop_at
            && (now >= at || pending.is_empty())
        {
            break;
        }
        if stop_at.is_none() && now >= next_send {
            let mut msg = [0u8; 16];
            msg[..8].copy_from_slice(&seq.to_be_bytes());
            msg[8..].copy_from_slice(b"flannel!");
            // A send error (no route for a moment) is a lost request, not a failure.
            let _ = socket.send(&msg);
            pending.insert(seq, now);
            stats.sent += 1;
            seq += 1;
            next_send += interval;
            if next_send < now {
                next_send = now + interval;
            }
        }
        let wait = next_send
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        socket.set_read_timeout(Some(wait))?;
        if let Ok(n) = socket.recv(&mut buf)
            && n >= 8
        {
            let mut s = [0u8; 8];
            s.copy_from_slice(&buf[..8]);
            let s = u64::from_be_bytes(s);
            if let Some(sent_at) = pending.remove(&s) {
                stats.max_rtt = stats.max_rtt.max(sent_at.elapsed());
                answered.insert(s);
            }
        }
        // Requests older than the reply timeout are lost.
        let now = Instant::now();
        let expired: Vec<u64> = pending
            .iter()
            .filter(|(_, at)| now.duration_since(**at) > UDP_REPLY_TIMEOUT)
            .map(|(s, _)| *s)
            .collect();
        for s in expired {
            pending.remove(&s);
        }
    }
    stats.answered = answered.len() as u64;
    let mut run = 0u64;
    for s in 0..seq {
        if answered.contains(&s) {
            run = 0;
        } else {
            stats.lost_count += 1;
            if stats.lost.len() < 100 {
                stats.lost.push(s);
            }
            run += 1;
            stats.longest_outage = stats.longest_outage.max(run);
        }
    }
    Ok(stats)
}

/// What a [`TcpFlow`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowStats {
    /// Bytes the receiver counted and checksummed (equal to the bytes sent).
    pub bytes: u64,
    /// From connect to the receiver's verdict.
    pub elapsed: Duration,
    /// The longest time the receiver waited for the next data, after the first byte.
    pub longest_stall: Duration,
    /// Segments the sender retransmitted (`tcpi_total_retrans`): 0 means no segment was lost
    /// (or delayed past the retransmission timeout) on the way.
    pub retransmits: u32,
    /// Retransmitted segments shown needless: a tail loss probe or a retransmission after
    /// reordering that duplicated a segment that had arrived. The larger of two counts of the
    /// same thing: the segments covered by the D-SACKs the sender received
    /// (`TcpExtTCPDSACKRecvSegs` of the sender's namespace; one D-SACK block may cover a
    /// retransmission of several segments, as [`FlowStats::retransmits`] counts them), and
    /// the duplicates the receiver reported (`TCPDSACKOldSent` + `TCPDSACKOfoSent` of its
    /// namespace, one per duplicate packet, so never more than the segments), which the
    /// sender may not have counted yet when the flow ends or may have taken for an old one.
    pub spurious: u64,
    /// The sender namespace's non-zero retransmission counters (`TcpExt` of
    /// `/proc/net/netstat`: `TCPLossProbes`, `TCPFastRetrans`, `TCPTimeouts`, ...), which
    /// say why segments were sent again: their growth from the start of the flow to its end,
    /// so nothing else may send TCP from that namespace meanwhile.
    pub sender_netstat: BTreeMap<String, u64>,
    /// The receiver namespace's non-zero counters of what arrived out of order, twice or not
    /// at all into the socket (`TCPOFOQueue`, `TCPDSACKOldSent`, `TCPRcvQDrop`, ...): their
    /// growth over the flow, as [`FlowStats::sender_netstat`]. A segment lost on the way
    /// shows as the segments after it queued out of order; one dropped at the receiver, in
    /// its drop counters.
    pub receiver_netstat: BTreeMap<String, u64>,
}

impl FlowStats {
    /// Retransmissions not shown needless by a D-SACK: segments that were really lost (or
    /// so late that the receiver never saw them twice).
    pub fn lost(&self) -> u64 {
        u64::from(self.retransmits).saturating_sub(self.spurious)
    }
}

/// The retransmissions shown needless ([`FlowStats::spurious`]): from the sender's counters,
/// the segments its D-SACKs covered, `TCPDSACKRecvSegs` (or on kernels without it
/// `TCPDSACKRecv`, blocks, a lower bound); from the receiver's, the duplicates it reported.
fn spurious_retransmits(sender: &BTreeMap<String, u64>, receiver: &BTreeMap<String, u64>) -> u64 {
    let count = |netstat: &BTreeMap<String, u64>, name: &str| netstat.get(name).copied();
    let acked = count(sender, "TCPDSACKRecvSegs")
        .or_else(|| count(sender, "TCPDSACKRecv"))
        .unwrap_or(0);
    let reported = ["TCPDSACKOldSent", "TCPDSACKOfoSent"]
        .iter()
        .filter_map(|name| count(receiver, name))
        .sum();
    acked.max(reported)
}

/// `TcpExt` counters about retransmissions, as named in `/proc/net/netstat`.
const RETRANS_COUNTERS: &[&str] = &[
    "TCPLossProbes",
    "TCPLossProbeRecovery",
    "TCPFastRetrans",
    "TCPSlowStartRetrans",
    "TCPTimeouts",
    "TCPLostRetransmit",
    "TCPSpuriousRTOs",
    "TCPSpuriousRtxHostQueues",
    "TCPDSACKRecv",
    "TCPDSACKRecvSegs",
    "TCPDSACKOfoRecv",
    "TCPSACKReorder",
    "TCPTSReorder",
    "TCPRenoReorder",
    "TCPRetransFail",
];

/// `TcpExt` counters of what reached a receiving socket out of order, twice or not at all,
/// as named in `/proc/net/netstat`.
const RECEIVE_COUNTERS: &[&str] = &[
    "TCPOFOQueue",
    "TCPOFODrop",
    "TCPOFOMerge",
    "TCPDSACKOldSent",
    "TCPDSACKOfoSent",
    "TCPRcvQDrop",
    "TCPBacklogDrop",
    "TCPZeroWindowDrop",
    "RcvPruned",
    "OfoPruned",
    "TCPMinTTLDrop",
];

/// The non-zero counters named in `names` of the namespace at `ns_path` (`TcpExt`).
fn tcp_ext_counters(ns_path: &std::path::Path, names: &[&str]) -> Result<BTreeMap<String, u64>> {
    let text = crate::lab::kv::in_netns(ns_path, || {
        std::fs::read_to_string("/proc/thread-self/net/netstat").context("netstat")
    })?;
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("TcpExt:")).collect();
    let mut out = BTreeMap::new();
    if let [header, values] = lines.as_slice() {
        for (name, value) in header
            .split_whitespace()
            .zip(values.split_whitespace())
            .skip(1)
        {
            if names.contains(&name)
                && let Ok(v) = value.parse::<u64>()
                && v > 0
            {
                out.insert(name.to_owned(), v);
            }
        }
    }
    Ok(out)
}

/// Some `TcpExt` counters of a namespace, from a start to now.
#[derive(Debug)]
struct CounterWatch {
    ns: std::path::PathBuf,
    names: &'static [&'static str],
    before: BTreeMap<String, u64>,
}

impl CounterWatch {
    fn start(ns: &NetNs, names: &'static [&'static str]) -> Result<CounterWatch> {
        let ns = ns.path();
        let before = tcp_ext_counters(&ns, names)?;
        Ok(CounterWatch { ns, names, before })
    }

    /// The counters that grew since the start, by how much.
    fn growth(&self) -> Result<BTreeMap<String, u64>> {
        Ok(tcp_ext_counters(&self.ns, self.names)?
            .into_iter()
            .map(|(k, v)| {
                let base = self.before.get(&k).copied().unwrap_or(0);
                (k, v.saturating_sub(base))
            })
            .filter(|&(_, v)| v > 0)
            .collect())
    }
}

/// A long TCP transfer at a fixed pace from one namespace to a receiver in another, running
/// on two threads until [`TcpFlow::finish`]: every byte is checksummed, the receiver records
/// its longest wait for data, the sender reads its retransmission count at the end.
#[derive(Debug)]
pub struct TcpFlow {
    stop: Arc<AtomicBool>,
    /// The sender namespace's [`RETRANS_COUNTERS`].
    sender_netstat: CounterWatch,
    /// The receiver namespace's [`RECEIVE_COUNTERS`].
    receiver_netstat: CounterWatch,
    sender: Option<thread::JoinHandle<Result<(u64, u64, u32)>>>,
    receiver: Option<thread::JoinHandle<Result<(u64, u64, Duration)>>>,
    started: Instant,
}

/// Size of one write of a [`TcpFlow`].
const FLOW_CHUNK: usize = 16 * 1024;

impl TcpFlow {
    /// Connects from `from` to a receiver bound on `ip` in `to` and starts sending
    /// `bytes_per_sec` (in `FLOW_CHUNK` writes).
    pub fn start(from: &NetNs, to: &NetNs, ip: IpAddr, bytes_per_sec: u64) -> Result<TcpFlow> {
        let listener = to
            .enter(move || TcpListener::bind(SocketAddr::new(ip, 0)))?
            .with_context(|| format!("bind {ip}:0 in {}", to.name()))?;
        let target = listener.local_addr()?;
        let sender_netstat = CounterWatch::start(from, RETRANS_COUNTERS)?;
        let receiver_netstat = CounterWatch::start(to, RECEIVE_COUNTERS)?;
        let stream = from
            .enter(move || TcpStream::connect_timeout(&target, Duration::from_secs(5)))?
            .with_context(|| format!("connect {target} from {}", from.name()))?;
        let (conn, _) = listener.accept().context("accept")?;
        let stop = Arc::new(AtomicBool::new(false));
        let receiver = thread::spawn(move || flow_receive(conn));
        let flag = stop.clone();
        let sender = thread::spawn(move || flow_send(stream, bytes_per_sec.max(1), &flag));
        Ok(TcpFlow {
            stop,
            sender_netstat,
            receiver_netstat,
            sender: Some(sender),
            receiver: Some(receiver),
            started: Instant::now(),
        })
    }

    /// Stops sending, waits for the receiver's verdict and fails unless every byte arrived
    /// intact.
    pub fn finish(mut self) -> Result<FlowStats> {
        self.stop.store(true, Ordering::Relaxed);
        let sent = self
            .sender
            .take()
            .context("flow already finished")?
            .join()
            .map_err(|_| anyhow::anyhow!("sender thread panicked"))?;
        let received = self
            .receiver
            .take()
            .context("flow already finished")?
            .join()
            .map_err(|_| anyhow::anyhow!("receiver thread panicked"))?;
        let (sent_bytes, sent_hash, retransmits) = sent.context("sender")?;
        let (got_bytes, got_hash, longest_stall) = received.context("receiver")?;
        if (sent_bytes, sent_hash) != (got_bytes, got_hash) {
            bail!(
                "received {got_bytes} bytes with checksum {got_hash:016x}; sent {sent_bytes} \
                 with {sent_hash:016x}"
            );
        }
        let sender_netstat = self.sender_netstat.growth()?;
        let receiver_netstat = self.receiver_netstat.growth()?;
        Ok(FlowStats {
            bytes: got_bytes,
            elapsed: self.started.elapsed(),
            longest_stall,
            retransmits,
            spurious: spurious_retransmits(&sender_netstat, &receiver_netstat),
            sender_netstat,
            receiver_netstat,
        })
    }
}

impl Drop for TcpFlow {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.sender.take() {
            let _ = t.join();
        }
        if let Some(t) = self.receiver.take() {
            let _ = t.join();
        }
    }
}

/// Sends the pattern until `stop`, paced to `rate` bytes per second; returns (bytes, checksum,
/// total retransmissions) once the receiver has read everything.
fn flow_send(mut stream: TcpStream, rate: u64, stop: &AtomicBool) -> Result<(u64, u64, u32)> {
    stream.set_write_timeout(Some(Duration::from_secs(30)))?;
    let mut chunk = vec![0u8; FLOW_CHUNK];
    let (mut offset, mut hash) = (0u64, FNV_OFFSET);
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        for (k, b) in chunk.iter_mut().enumerate() {
            *b = pattern_byte(offset + k as u64);
        }
        stream
            .write_all(&chunk)
            .with_context(|| format!("sending at byte {offset}"))?;
        hash = fnv1a(hash, &chunk);
        offset += chunk.len() as u64;
        // Pace: byte `offset` is due at offset / rate seconds after the start.
        let due = Duration::from_secs_f64(offset as f64 / rate as f64);
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            thread::sleep(wait);
        }
    }
    // Wait until everything sent is acknowledged, so the retransmission count is final.
    let deadline = Instant::now() + Duration::from_secs(30);
    let retransmits = loop {
        let info = tcp_info(&stream)?;
        if info.tcpi_unacked == 0 || Instant::now() >= deadline {
            break info.tcpi_total_retrans;
        }
        thread::sleep(Duration::from_millis(10));
    };
    stream.shutdown(std::net::Shutdown::Write)?;
    Ok((offset, hash, retransmits))
}

/// Reads until EOF; returns (bytes, checksum, longest wait between reads after the first).
fn flow_receive(mut conn: TcpStream) -> Result<(u64, u64, Duration)> {
    conn.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut buf = vec![0u8; 64 * 1024];
    let (mut count, mut hash) = (0u64, FNV_OFFSET);
    let mut last: Option<Instant> = None;
    let mut longest = Duration::ZERO;
    loop {
        let n = read_retrying(&mut conn, &mut buf).context("receiving")?;
        if n == 0 {
            break;
        }
        let now = Instant::now();
        if let Some(prev) = last {
            longest = longest.max(now - prev);
        }
        last = Some(now);
        hash = fnv1a(hash, &buf[..n]);
        count += n as u64;
    }
    Ok((count, hash, longest))
}

/// `TCP_INFO` of a connected socket.
fn tcp_info(stream: &TcpStream) -> Result<libc::tcp_info> {
    // SAFETY: tcp_info is plain old data; all-zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the fd is a live TCP socket; `info` and `len` describe a writable buffer of
    // `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("getsockopt TCP_INFO");
    }
    Ok(info)
}

/// Sends `inner` (a whole IPv4 packet) from `ns` to `to` in an IPv4 header of protocol 4
/// (IPIP) that the kernel writes, from `from` (else the route's source), without DF: a packet
/// larger than the interface's MTU leaves in fragments, as a router fragments the packets of
/// a kernel IPIP tunnel without path MTU discovery (upstream's `flannel.ipip`) on a narrower
/// path.
pub fn send_ipip(ns: &NetNs, from: Option<Ipv4Addr>, to: Ipv4Addr, inner: &[u8]) -> Result<()> {
    send_ipip_with_options(ns, from, to, inner, &[])
}

/// [`send_ipip`] with `options` (a multiple of 4 bytes) as the outer header's IP options.
pub fn send_ipip_with_options(
    ns: &NetNs,
    from: Option<Ipv4Addr>,
    to: Ipv4Addr,
    inner: &[u8],
    options: &[u8],
) -> Result<()> {
    let (inner, options) = (inner.to_vec(), options.to_vec());
    ns.enter(move || -> std::io::Result<usize> {
        let socket = RawSocket::open(libc::IPPROTO_IPIP, false)?;
        socket.set_option(
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DONT,
        )?;
        if !options.is_empty() {
            socket.set_option_bytes(libc::IPPROTO_IP, libc::IP_OPTIONS, &options)?;
        }
        if let Some(from) = from {
            socket.bind(from)?;
        }
        socket.send_to(&inner, to)
    })?
    .with_context(|| format!("sending IPIP to {to} in {}", ns.name()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needless_retransmissions_are_counted_on_either_end() {
        let counters = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
            pairs.iter().map(|&(k, v)| (k.to_owned(), v)).collect()
        };
        let none = counters(&[]);
        // One D-SACK block covering a two-segment retransmission.
        let both = counters(&[("TCPDSACKRecv", 1), ("TCPDSACKRecvSegs", 2)]);
        assert_eq!(spurious_retransmits(&both, &none), 2);
        let stats = FlowStats {
            bytes: 0,
            elapsed: Duration::ZERO,
            longest_stall: Duration::ZERO,
            retransmits: 2,
            spurious: spurious_retransmits(&both, &none),
            sender_netstat: both.clone(),
            receiver_netstat: none.clone(),
        };
        assert_eq!(stats.lost(), 0);
        assert_eq!(
            spurious_retransmits(&counters(&[("TCPDSACKRecv", 3)]), &none),
            3
        );
        assert_eq!(spurious_retransmits(&none, &none), 0);
        // Three duplicates the receiver reported, two of which the sender counted: three.
        let dups = counters(&[("TCPDSACKOldSent", 2), ("TCPDSACKOfoSent", 1)]);
        assert_eq!(spurious_retransmits(&both, &dups), 3);
        // Segments that only arrived out of order are no duplicates.
        let ofo = counters(&[("TCPOFOQueue", 5)]);
        assert_eq!(spurious_retransmits(&none, &ofo), 0);
    }
}
