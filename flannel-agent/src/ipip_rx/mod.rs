//! The eBPF IPIP backend's receive of IPIP packets that arrive in fragments.
//!
//! `tc_from_netdev` decapsulates whole IPIP packets. An IPIP packet that a router fragmented
//! on the way (a peer whose kernel `ipip` device copies the inner packet's DF bit, as
//! upstream's `flannel.ipip` does, sent one without DF over a narrower path) reaches it in
//! fragments, which it cannot decapsulate and leaves to the kernel. The kernel reassembles
//! them, and then, with no `ipip` module, has no receiver for protocol 4 and drops the packet.
//! That is the only kernel receive left to fill, so this agent fills it: it reads the
//! reassembled packets from a raw IPv4 socket of protocol 4 (which the kernel hands every
//! such packet for a local address, with the outer header), checks each as a kernel tunnel
//! and the programs would ([`decap::decapsulate`]: for our public IP, from a node in
//! `FLANNEL_NODES4` that may send us IPIP, an inner packet for a pod of this node, from any
//! source, its TTL decremented), and sends the inner packet on through a raw socket
//! that writes whole IPv4 headers (`IPPROTO_RAW`): the kernel routes it to the pod through
//! the bridge. Each packet is counted in `flannel_ipip_reassembled_packets_total{kind}`
//! (`delivered`, or the reason it was dropped).
//!
//! A raw socket taking a protocol also stops the kernel from answering each such packet with
//! an ICMP "protocol unreachable". It receives, too, whole IPIP packets the programs left to
//! the kernel: from a sender that is not a peer (dropped here as the programs would) and with
//! IP options (decapsulated here as a kernel tunnel would).
//!
//! Once it has taken a reassembled packet from a peer (a router fragments IPIP on its way
//! here; the kernel tells reassembled packets apart with `IP_RECVFRAGSIZE`), `tc_from_netdev`
//! leaves IPIP packets that carry an inner fragment to it as well (`CFG_IPIP_USER_RX`), so
//! that all fragments of a datagram reach conntrack at the same hook. When no reassembled
//! packet from a peer has come for a while (`--ebpf-ipip-reassembly-hold`), and when it stops,
//! the agent clears that flag (`daemon::fastpath::run_ipip_receiver`).
//!
//! Only nodes whose IPIP runs in eBPF start it ([`crate::dataplane::Local::ipip_via_ebpf`]);
//! with a kernel `ipip` device, the kernel receives reassembled packets itself. The inner
//! packets leave as this node's own (through `OUTPUT` and conntrack, not `FORWARD`), which is
//! why only the node's own pods are taken as destinations. It costs a copy to user space and
//! back per packet (about 6.5 µs of the agent's CPU per fragment, measured): fine for what is
//! rare (our own fast path sends DF, so no router fragments it), not a path for bulk traffic.

pub mod decap;
pub mod raw;

use std::{io, net::Ipv4Addr, time::Duration};

use aya::maps::{HashMap, Map, MapData};
use flannel_common::route::{NODE_F_IPIP, NodeEntry};
use prometheus_client::metrics::{counter::Counter, family::Family};
use tokio::{io::unix::AsyncFd, time::Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub use decap::{DELIVERED, Drop, Local};
pub use raw::{RawSocket, Received};

use crate::{
    bpf::{BpfError, PinLayout},
    metrics::KindLabel,
};

/// What the receive socket may queue (bytes; `SO_RCVBUFFORCE`, else the system's default):
/// a burst of reassembled packets of up to 64 KiB each.
const RECEIVE_BUFFER: libc::c_int = 4 << 20;

/// The nodes that may send us IPIP: the programs' `FLANNEL_NODES4`, read through its pin.
struct Peers(HashMap<MapData, [u8; 4], NodeEntry>);

impl Peers {
    fn open(layout: &PinLayout) -> Result<Peers, BpfError> {
        let name = flannel_common::maps::NODES4;
        let data = MapData::from_pin(layout.map(name)).map_err(|e| BpfError::map(name, e))?;
        HashMap::try_from(Map::HashMap(data))
            .map(Peers)
            .map_err(|e| BpfError::map(name, e))
    }

    fn may_send_ipip(&self, addr: Ipv4Addr) -> bool {
        self.0
            .get(&addr.octets(), 0)
            .is_ok_and(|node| node.flags & NODE_F_IPIP != 0)
    }
}

/// The receiver, its sockets open.
pub struct Receiver {
    local: Local,
    peers: Peers,
    rx: AsyncFd<RawSocket>,
    tx: RawSocket,
    counts: Family<KindLabel, Counter>,
}

impl Receiver {
    /// Opens the sockets (CAP_NET_RAW) and the node map pinned in `pins`.
    pub fn open(
        local: Local,
        pins: &PinLayout,
        counts: Family<KindLabel, Counter>,
    ) -> Result<Receiver, String> {
        let peers = Peers::open(pins).map_err(|e| e.to_string())?;
        let rx = RawSocket::open(libc::IPPROTO_IPIP, true)
            .map_err(|e| format!("a raw socket for IPIP: {e}"))?;
        if let Err(e) = rx.set_option(libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, RECEIVE_BUFFER) {
            debug!("the IPIP socket keeps the default receive buffer: {e}");
        }
        rx.set_option(libc::SOL_IP, libc::IP_RECVFRAGSIZE, 1)
            .map_err(|e| format!("IP_RECVFRAGSIZE on the IPIP socket: {e}"))?;
        let tx = RawSocket::open(libc::IPPROTO_RAW, true)
            .map_err(|e| format!("a raw socket to send decapsulated packets: {e}"))?;
        // SAFETY: the descriptor is owned by `rx`, which the AsyncFd owns and drops (closing
        // it) only after deregistering it.
        let rx = unsafe { AsyncFd::register(rx) }
            .map_err(|e| format!("registering the IPIP socket: {}", e.into_parts().1))?;
        Ok(Receiver {
            local,
            peers,
            rx,
            tx,
            counts,
        })
    }

    fn count(&self, kind: &str) {
        self.counts
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .inc();
    }

    /// Decapsulates and sends on one received packet; what became of it.
    fn handle(&self, pkt: &mut [u8]) -> Result<(), Drop> {
        let (inner, dst) =
            decap::decapsulate(pkt, &self.local, |src| self.peers.may_send_ipip(src))?;
        self.tx.send_to(inner, dst).map_err(|e| {
            debug!(%dst, error = %e, "sending a decapsulated IPIP packet");
            match e.raw_os_error() {
                Some(libc::EMSGSIZE) => Drop::TooBig,
                _ => Drop::SendError,
            }
        })?;
        Ok(())
    }

    /// Receives until `cancel`. `switch` turns `CFG_IPIP_USER_RX` on or off (whether it
    /// did): on at a reassembled packet from an IPIP peer (delivered, or dropped for what it
    /// carries), i.e. one a router fragmented on the way; off again once `hold` has passed
    /// without another. Returns whether it is on at the end.
    pub async fn run(
        self,
        cancel: CancellationToken,
        hold: Duration,
        mut switch: impl FnMut(bool) -> bool,
    ) -> bool {
        let mut on = false;
        let mut last = Instant::now();
        info!(
            public_ip = %self.local.public_ip,
            "taking reassembled IPIP packets (fragmented on the way) from a raw socket"
        );
        // The largest IPv4 packet.
        let mut buf = vec![0u8; 65536];
        loop {
            // A hold too long to add to the clock never ends.
            let deadline = last.checked_add(hold);
            let mut ready = tokio::select! {
                _ = cancel.cancelled() => return on,
                () = tokio::time::sleep_until(deadline.unwrap_or(last)),
                    if on && deadline.is_some() => {
                    // Not switched off (the write failed, and was logged): again after `hold`.
                    on = !switch(false);
                    last = Instant::now();
                    continue;
                }
                ready = self.rx.readable() => match ready {
                    Ok(ready) => ready,
                    Err(e) => {
                        warn!(
                            "the IPIP socket failed; reassembled IPIP packets are lost from \
                             now on: {e}"
                        );
                        return on;
                    }
                },
            };
            loop {
                match self.rx.get_ref().recv(&mut buf) {
                    Ok(received) => {
                        let handled = self.handle(&mut buf[..received.len]);
                        // Before the count, which tells a watcher the packet was taken.
                        if received.max_fragment.is_some()
                            && handled.map_or_else(Drop::after_peer_check, |()| true)
                        {
                            last = Instant::now();
                            if !on {
                                on = switch(true);
                            }
                        }
                        self.count(match handled {
                            Ok(()) => DELIVERED,
                            Err(drop) => drop.name(),
                        });
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        ready.clear_ready();
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        debug!("receiving from the IPIP socket: {e}");
                        ready.clear_ready();
                        break;
                    }
                }
            }
        }
    }
}
