//! The two forwarding loops of the udp backend's TUN path, each a tokio task with its own
//! preallocated buffers (nothing is allocated per packet):
//!
//! * **egress** (`flannel0` → UDP): read up to [`BATCH`] packets from the TUN device, look
//!   each destination up in the [`UdpRoutes`], decrement the TTL and send the whole batch
//!   with one `sendmmsg`. A destination without a route gets an ICMP "net unreachable"
//!   written back into the TUN device (rate-limited). The egress task also replaces the
//!   TUN device when it was deleted under the agent.
//! * **ingress** (UDP → `flannel0`): receive up to [`BATCH`] datagrams with one
//!   `recvmmsg`, check each inner packet (IPv4, lengths, header checksum, destination inside
//!   this node's subnet), decrement the TTL and write it to the TUN device.

use std::{
    io,
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::AsRawFd as _,
    sync::Arc,
    time::{Duration, Instant},
};

use ipnet::Ipv4Net;
use tokio::{
    io::{Interest, unix::AsyncFd},
    net::UdpSocket,
    sync::watch,
};
use tokio_util::sync::CancellationToken;

use super::{
    counters::{Reason, Tally, UdpCounters},
    mmsg::{BATCH, Received, recv_batch, send_batch},
    packet::{self, ICMP_ERROR_MAX, Ipv4Header, PacketError},
    routes::UdpRoutes,
    tun::{Tun, device_gone},
};

/// Bytes per packet buffer: the largest IPv4 packet (and UDP payload) fits.
pub const SLOT: usize = 65536;

/// ICMP errors per second the egress loop may originate (and its burst).
pub const ICMP_PER_SECOND: u32 = 100;

/// What the loops share.
pub(crate) struct Shared {
    /// The TUN device now (replaced when it was deleted).
    pub tun: watch::Sender<Arc<AsyncFd<Tun>>>,
    /// The routing table now.
    pub routes: watch::Sender<Arc<UdpRoutes>>,
    /// The UDP socket bound to `IfaceAddr:Port`.
    pub socket: Arc<UdpSocket>,
    /// Counters.
    pub counters: Arc<UdpCounters>,
    /// Inner destinations accepted from the network: this node's subnet.
    pub own_subnet: Ipv4Net,
}

/// Logs a repeated problem at most once per period.
struct Throttle {
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttle {
    const PERIOD: Duration = Duration::from_secs(10);

    fn new() -> Self {
        Self {
            last: None,
            suppressed: 0,
        }
    }

    fn warn(&mut self, what: &str, e: &dyn std::fmt::Display) {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Self::PERIOD)
        {
            self.suppressed += 1;
            return;
        }
        tracing::warn!(suppressed = self.suppressed, "udp backend: {what}: {e}");
        self.last = Some(now);
        self.suppressed = 0;
    }
}

/// A token bucket for ICMP errors.
struct IcmpBudget {
    tokens: u32,
    refilled: Instant,
}

impl IcmpBudget {
    fn new() -> Self {
        Self {
            tokens: ICMP_PER_SECOND,
            refilled: Instant::now(),
        }
    }

    fn take(&mut self) -> bool {
        let now = Instant::now();
        let elapsed = now.duration_since(self.refilled);
        let earned = elapsed.as_millis() * u128::from(ICMP_PER_SECOND) / 1000;
        if earned > 0 {
            let earned = u32::try_from(earned).unwrap_or(u32::MAX);
            self.tokens = self.tokens.saturating_add(earned).min(ICMP_PER_SECOND);
            self.refilled = now;
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

/// What to do with a packet read from `flannel0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EgressVerdict {
    /// Send the first `len` bytes (TTL already decremented) to `to`.
    Send {
        /// The peer's endpoint.
        to: SocketAddrV4,
        /// The packet's total length.
        len: usize,
    },
    /// No route: answer with ICMP net unreachable.
    NoRoute(Ipv4Header),
    /// Drop.
    Drop(Reason),
}

/// Classifies (and on [`EgressVerdict::Send`], TTL-decrements) a packet read from the TUN
/// device. The kernel wrote it, so its header checksum is not verified again.
pub fn egress_verdict(pkt: &mut [u8], routes: &UdpRoutes) -> EgressVerdict {
    let h = match packet::parse(pkt) {
        Ok(h) => h,
        Err(PacketError::NotIpv4) => return EgressVerdict::Drop(Reason::DropNotIpv4),
        Err(_) => return EgressVerdict::Drop(Reason::DropMalformed),
    };
    let Some(to) = routes.lookup(h.dst) else {
        return EgressVerdict::NoRoute(h);
    };
    match packet::decrement_ttl(pkt) {
        Ok(_) => EgressVerdict::Send {
            to,
            len: h.total_len,
        },
        Err(PacketError::TtlExpired) => EgressVerdict::Drop(Reason::DropTtl),
        Err(_) => EgressVerdict::Drop(Reason::DropMalformed),
    }
}

/// An inner packet [`ingress_verdict`] accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    /// Its length: what to write to the TUN device.
    pub len: usize,
    /// Whether its TCP or UDP checksum was left unfinished by the sender and has been
    /// finished ([`packet::finish_l4_checksum`]).
    pub checksum_finished: bool,
}

/// Checks (and TTL-decrements) a datagram's payload received from a peer, finishing a TCP or
/// UDP checksum the sender left unfinished; returns the inner packet to write to the TUN
/// device, or why it is dropped.
///
/// The inner destination must lie in `own_subnet`: a peer only ever sends us packets for our
/// subnet, and anything else would make this node an open relay into whatever its routing
/// table reaches (upstream writes every datagram to the TUN device). The outer source is not
/// checked, as upstream: nodes behind NAT or with `--public-ip` set send from an address that
/// is not the public IP in their lease.
pub fn ingress_verdict(pkt: &mut [u8], own_subnet: Ipv4Net) -> Result<Accepted, Reason> {
    let h = match packet::parse(pkt) {
        Ok(h) => h,
        Err(PacketError::NotIpv4) => return Err(Reason::DropNotIpv4),
        Err(_) => return Err(Reason::DropMalformed),
    };
    if !packet::header_checksum_ok(pkt, &h) {
        return Err(Reason::DropMalformed);
    }
    if !own_subnet.contains(&h.dst) {
        return Err(Reason::DropNotLocal);
    }
    match packet::decrement_ttl(pkt) {
        Ok(_) => Ok(Accepted {
            len: h.total_len,
            checksum_finished: packet::finish_l4_checksum(pkt, &h),
        }),
        Err(PacketError::TtlExpired) => Err(Reason::DropTtl),
        Err(_) => Err(Reason::DropMalformed),
    }
}

/// flannel0 → UDP, until `cancel`.
pub(crate) async fn egress(shared: Arc<Shared>, cancel: CancellationToken) {
    let mut slots = vec![0u8; BATCH * SLOT];
    let mut lens = [0usize; BATCH];
    let mut dsts = [SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0); BATCH];
    let mut icmp = [0u8; ICMP_ERROR_MAX];
    let mut budget = IcmpBudget::new();
    let mut tally = Tally::default();
    let mut read_errors = Throttle::new();
    let mut send_errors = Throttle::new();
    let mut tun_errors = Throttle::new();
    let mut routes_rx = shared.routes.subscribe();
    let mut routes = routes_rx.borrow_and_update().clone();
    let mut tun = shared.tun.borrow().clone();

    loop {
        let ready = tokio::select! {
            () = cancel.cancelled() => return,
            r = tun.ready(Interest::READABLE | Interest::ERROR) => r,
        };
        // After the wait: the table may have changed while no packet came.
        if routes_rx.has_changed().unwrap_or(false) {
            routes = routes_rx.borrow_and_update().clone();
        }
        let mut guard = match ready {
            Ok(g) => g,
            Err(e) => {
                read_errors.warn("waiting for flannel0", &e);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let mut gone = guard.ready().is_error();
        let mut n = 0;
        while n < BATCH && !gone {
            let slot = &mut slots[n * SLOT..(n + 1) * SLOT];
            let len = match guard.try_io(|fd| fd.get_ref().read(slot)) {
                Err(_would_block) => break,
                Ok(Ok(len)) => len,
                Ok(Err(e)) if device_gone(&e) => {
                    gone = true;
                    break;
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => {
                    read_errors.warn("reading flannel0", &e);
                    break;
                }
            };
            let pkt = &mut slot[..len];
            match egress_verdict(pkt, &routes) {
                EgressVerdict::Send { to, len } => {
                    lens[n] = len;
                    dsts[n] = to;
                    n += 1;
                }
                EgressVerdict::NoRoute(h) => {
                    tally.add(Reason::DropNoRoute, len);
                    if budget.take()
                        && let Some(m) = packet::net_unreachable(pkt, &h, &mut icmp)
                    {
                        match guard.get_inner().write(&icmp[..m]) {
                            Ok(_) => tally.add(Reason::IcmpUnreachable, m),
                            Err(e) => tun_errors.warn("writing ICMP to flannel0", &e),
                        }
                    }
                }
                EgressVerdict::Drop(reason) => tally.add(reason, len),
            }
        }
        drop(guard);

        let mut off = 0;
        while off < n {
            let fd = shared.socket.as_raw_fd();
            let batch = (off..n).map(|i| (&slots[i * SLOT..i * SLOT + lens[i]], dsts[i]));
            let sent = shared
                .socket
                .async_io(Interest::WRITABLE, || send_batch(fd, batch.clone()))
                .await;
            match sent {
                Ok(k) if k > 0 => {
                    for len in &lens[off..off + k] {
                        tally.add(Reason::Encap, *len);
                    }
                    off += k;
                }
                Ok(_) => {
                    // The kernel took nothing without an error; do not spin on it.
                    for len in &lens[off..n] {
                        tally.add(Reason::DropSendError, *len);
                    }
                    break;
                }
                Err(e) => {
                    send_errors.warn(&format!("sending to {}", dsts[off]), &e);
                    tally.add(Reason::DropSendError, lens[off]);
                    off += 1;
                }
            }
        }
        shared.counters.flush(&mut tally);

        if gone {
            match reopen(&shared, &cancel).await {
                Some(fresh) => tun = fresh,
                None => return,
            }
        }
    }
}

/// Opens `flannel0` again after it was deleted, with back-off; publishes it to the ingress
/// loop. `None` when cancelled.
async fn reopen(shared: &Shared, cancel: &CancellationToken) -> Option<Arc<AsyncFd<Tun>>> {
    let name = shared.tun.borrow().get_ref().name().to_owned();
    tracing::warn!("udp backend: {name} was deleted; creating it again");
    let mut delay = Duration::from_millis(100);
    loop {
        match Tun::open(&name)
            .map_err(|e| e.to_string())
            .and_then(|t| t.register().map_err(|e| e.to_string()))
        {
            Ok(fd) => {
                let fd = Arc::new(fd);
                shared.tun.send_replace(fd.clone());
                tracing::info!("udp backend: {name} is back (the reconciler configures it)");
                return Some(fd);
            }
            Err(e) => tracing::warn!("udp backend: reopening {name} (retrying in {delay:?}): {e}"),
        }
        tokio::select! {
            () = cancel.cancelled() => return None,
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// UDP → flannel0, until `cancel`.
pub(crate) async fn ingress(shared: Arc<Shared>, cancel: CancellationToken) {
    let mut slots = vec![0u8; BATCH * SLOT];
    let mut got = [Received::default(); BATCH];
    let mut tally = Tally::default();
    let mut recv_errors = Throttle::new();
    let mut tun_errors = Throttle::new();
    let mut tun_rx = shared.tun.subscribe();
    let mut tun = tun_rx.borrow_and_update().clone();
    let fd = shared.socket.as_raw_fd();

    loop {
        let received = tokio::select! {
            () = cancel.cancelled() => return,
            r = shared.socket.async_io(Interest::READABLE, || recv_batch(fd, &mut slots, SLOT, &mut got)) => r,
        };
        if tun_rx.has_changed().unwrap_or(false) {
            tun = tun_rx.borrow_and_update().clone();
        }
        let n = match received {
            Ok(n) => n,
            Err(e) => {
                recv_errors.warn("receiving", &e);
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        for (i, r) in got.iter().enumerate().take(n) {
            let pkt = &mut slots[i * SLOT..i * SLOT + r.len];
            if r.truncated {
                tally.add(Reason::DropMalformed, r.len);
                continue;
            }
            match ingress_verdict(pkt, shared.own_subnet) {
                Ok(Accepted {
                    len,
                    checksum_finished,
                }) => match write_tun(&tun, &pkt[..len]).await {
                    Ok(()) => {
                        if checksum_finished {
                            tally.add(Reason::ChecksumFinished, len);
                        }
                        tally.add(Reason::Decap, len);
                    }
                    Err(e) => {
                        tun_errors.warn("writing to flannel0", &e);
                        tally.add(Reason::DropTunError, len);
                    }
                },
                Err(reason) => tally.add(reason, r.len),
            }
        }
        shared.counters.flush(&mut tally);
    }
}

/// Writes one packet to the TUN device, waiting for writability if the kernel ever pushes
/// back (it normally does not for TUN devices).
async fn write_tun(tun: &AsyncFd<Tun>, pkt: &[u8]) -> io::Result<()> {
    match tun.get_ref().write(pkt) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => tun
            .async_io(Interest::WRITABLE, |t| t.write(pkt))
            .await
            .map(|_| ()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;
    use crate::udp::routes::UdpRoute;

    fn pkt(dst: [u8; 4], ttl: u8) -> Vec<u8> {
        let mut p = vec![0u8; 28];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&28u16.to_be_bytes());
        p[8] = ttl;
        p[9] = 17;
        p[12..16].copy_from_slice(&[10, 244, 1, 2]);
        p[16..20].copy_from_slice(&dst);
        let c = packet::checksum(&p[..20]);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        p
    }

    fn routes() -> UdpRoutes {
        UdpRoutes::new([UdpRoute {
            subnet: "10.244.2.0/24".parse().unwrap(),
            endpoint: "192.168.1.12:8285".parse().unwrap(),
        }])
    }

    #[test]
    fn egress_routes_decrements_or_reports() {
        let mut p = pkt([10, 244, 2, 7], 63);
        assert_eq!(
            egress_verdict(&mut p, &routes()),
            EgressVerdict::Send {
                to: "192.168.1.12:8285".parse().unwrap(),
                len: 28
            }
        );
        assert_eq!(p[8], 62);
        let mut unknown = pkt([10, 244, 9, 7], 63);
        assert!(matches!(
            egress_verdict(&mut unknown, &routes()),
            EgressVerdict::NoRoute(h) if h.dst == Ipv4Addr::new(10, 244, 9, 7)
        ));
        assert_eq!(unknown[8], 63, "not decremented");
        let mut dying = pkt([10, 244, 2, 7], 1);
        assert_eq!(
            egress_verdict(&mut dying, &routes()),
            EgressVerdict::Drop(Reason::DropTtl)
        );
        let mut v6 = pkt([10, 244, 2, 7], 63);
        v6[0] = 0x60;
        assert_eq!(
            egress_verdict(&mut v6, &routes()),
            EgressVerdict::Drop(Reason::DropNotIpv4)
        );
        assert_eq!(
            egress_verdict(&mut [0x45, 0, 0], &routes()),
            EgressVerdict::Drop(Reason::DropMalformed)
        );
    }

    #[test]
    fn ingress_accepts_only_our_subnet_with_a_valid_header() {
        let own: Ipv4Net = "10.244.2.0/24".parse().unwrap();
        let mut p = pkt([10, 244, 2, 7], 62);
        assert_eq!(ingress_verdict(&mut p, own).map(|a| a.len), Ok(28));
        assert_eq!(p[8], 61);
        let h = packet::parse(&p).unwrap();
        assert!(packet::header_checksum_ok(&p, &h));
        // Trailing bytes beyond total length are cut off.
        let mut padded = [pkt([10, 244, 2, 7], 62), vec![0; 6]].concat();
        assert_eq!(ingress_verdict(&mut padded, own).map(|a| a.len), Ok(28));
        let mut relay = pkt([8, 8, 8, 8], 62);
        assert_eq!(ingress_verdict(&mut relay, own), Err(Reason::DropNotLocal));
        let mut corrupt = pkt([10, 244, 2, 7], 62);
        corrupt[13] ^= 0x40;
        assert_eq!(
            ingress_verdict(&mut corrupt, own),
            Err(Reason::DropMalformed)
        );
        let mut dying = pkt([10, 244, 2, 7], 1);
        assert_eq!(ingress_verdict(&mut dying, own), Err(Reason::DropTtl));
        assert_eq!(
            ingress_verdict(&mut [0x60; 40], own),
            Err(Reason::DropNotIpv4)
        );
        assert_eq!(ingress_verdict(&mut [], own), Err(Reason::DropMalformed));
    }

    #[test]
    fn icmp_budget_refills() {
        let mut b = IcmpBudget::new();
        for _ in 0..ICMP_PER_SECOND {
            assert!(b.take());
        }
        assert!(!b.take());
        b.refilled -= Duration::from_millis(50);
        // 50 ms earn 5 tokens.
        for _ in 0..5 {
            assert!(b.take());
        }
        assert!(!b.take());
    }
}
