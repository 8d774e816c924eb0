//! The control bench's floor: what the least any agent can do costs on this machine, in the
//! same topology as the agent's run, so that the agent's figures have a same-run baseline.
//!
//! - **List**: one etcd client connects from the node's namespace, reads the N leases with
//!   one prefix range and parses each lease's JSON (its public IP and VTEP MAC).
//! - **Kernel**: their N routes, N neighbours and N FDB entries written by iproute2 (`ip -batch`
//!   and `bridge -batch`, one netlink request and acknowledgement per entry) onto a VXLAN
//!   device like `flannel.1`, in a second node's namespace, where no agent runs.
//! - **Events**: a bare watcher on the subnets prefix, in the node's namespace; for each event
//!   lease put (and deleted), the time from the start of the put until the watcher holds the
//!   event. The agent's lease events are timed from the same point, until the dataplane holds
//!   them.
//!
//! The agent's kernel-complete time against list + kernel, and its lease event times against
//! the watcher's, are the report's "against the floor" ratios ([`FloorRatio`]).

use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use etcd_client::{EventType, WatchOptions};
use ipnet::Ipv4Net;
use serde::Serialize;

use super::control::{ControlResult, Latency};
use crate::{
    lab::{kv::Kv, lease},
    topology::Node,
};

/// The floor measured before one agent run.
#[derive(Debug, Clone, Serialize)]
pub struct Floor {
    /// Connect, read the N leases with one range and parse them, seconds.
    pub list_seconds: f64,
    /// Write their 3N kernel entries with iproute2, seconds.
    pub kernel_seconds: f64,
    /// Put of an event lease until a bare watcher has it, ms.
    pub event_add_ms: Option<Latency>,
    /// Delete of an event lease until a bare watcher has it, ms.
    pub event_delete_ms: Option<Latency>,
}

/// One lease as the floor needs it.
#[derive(Debug, Clone, PartialEq)]
struct Peer {
    subnet: Ipv4Net,
    public_ip: Ipv4Addr,
    vtep_mac: String,
}

/// Measures the floor for `n` leases already in etcd (`kv`, as seen from `node`'s namespace),
/// writing kernel entries in `scratch`'s namespace; `event` gives the `i`-th event lease
/// (key, value), put and deleted `events` times. Leaves etcd as it found it.
pub fn measure(
    kv: &Kv,
    n: usize,
    scratch: &Node,
    events: usize,
    event: &dyn Fn(usize) -> Result<(String, String)>,
) -> Result<Floor> {
    let prefix = format!("{}/subnets/", lease::DEFAULT_PREFIX);
    let start = Instant::now();
    let peers = list(kv, &prefix)?;
    let list_seconds = start.elapsed().as_secs_f64();
    if peers.len() != n {
        bail!("the floor listed {} leases, {n} expected", peers.len());
    }
    let kernel_seconds = write_kernel(scratch, &peers)?;
    let (add, delete) = watch_events(kv, &prefix, events, event)?;
    Ok(Floor {
        list_seconds,
        kernel_seconds,
        event_add_ms: Latency::of(&add),
        event_delete_ms: Latency::of(&delete),
    })
}

/// Connects, reads every lease under `prefix` with one range and parses them.
fn list(kv: &Kv, prefix: &str) -> Result<Vec<Peer>> {
    kv.get_prefix(prefix)?
        .iter()
        .map(|(key, value)| peer(key, value))
        .collect()
}

/// One lease key and upstream's lease JSON as a [`Peer`].
fn peer(key: &str, value: &str) -> Result<Peer> {
    let (subnet, _) = key
        .rsplit('/')
        .next()
        .and_then(lease::parse_subnet_key)
        .with_context(|| format!("no subnet in {key}"))?;
    let lease: serde_json::Value =
        serde_json::from_str(value).with_context(|| format!("lease {key}"))?;
    Ok(Peer {
        subnet,
        public_ip: lease["PublicIP"]
            .as_str()
            .and_then(|ip| ip.parse().ok())
            .with_context(|| format!("PublicIP of {key}"))?,
        vtep_mac: lease["BackendData"]["VtepMAC"]
            .as_str()
            .with_context(|| format!("VtepMAC of {key}"))?
            .to_owned(),
    })
}

/// The VXLAN device the floor writes onto, as upstream names it.
const DEVICE: &str = "flannel.1";

/// iproute2's batch input for `peers` on [`DEVICE`]: routes and neighbours for `ip -batch`,
/// FDB entries for `bridge -batch` (what upstream's vxlan backend writes per lease).
fn batches(peers: &[Peer]) -> (String, String) {
    let (mut ip, mut bridge) = (String::new(), String::new());
    for p in peers {
        let gw = p.subnet.network();
        let _ = writeln!(
            ip,
            "route add {} via {gw} dev {DEVICE} onlink\nneigh add {gw} lladdr {} dev {DEVICE} nud permanent",
            p.subnet, p.vtep_mac
        );
        let _ = writeln!(
            bridge,
            "fdb add {} dev {DEVICE} dst {} self permanent",
            p.vtep_mac, p.public_ip
        );
    }
    (ip, bridge)
}

/// Creates [`DEVICE`] in `node`'s namespace and writes the entries of `peers` with iproute2;
/// seconds the two batches took. Checks that the kernel then holds them all.
fn write_kernel(node: &Node, peers: &[Peer]) -> Result<f64> {
    node.add_vxlan(DEVICE, 1, 8472, 1450)?;
    let (ip, bridge) = batches(peers);
    let (ip_file, bridge_file) = (node.dir().join("floor-ip"), node.dir().join("floor-bridge"));
    std::fs::write(&ip_file, ip)?;
    std::fs::write(&bridge_file, bridge)?;
    let (ip_file, bridge_file) = (
        ip_file.to_string_lossy().into_owned(),
        bridge_file.to_string_lossy().into_owned(),
    );
    let start = Instant::now();
    node.run(&["ip", "-batch", &ip_file])?;
    node.run(&["bridge", "-batch", &bridge_file])?;
    let seconds = start.elapsed().as_secs_f64();
    let routes = node.run(&["ip", "-4", "route", "show", "dev", DEVICE])?;
    let neighbours = node.run(&[
        "ip",
        "-4",
        "neigh",
        "show",
        "dev",
        DEVICE,
        "nud",
        "permanent",
    ])?;
    let fdb = node.run(&["bridge", "fdb", "show", "dev", DEVICE])?;
    let count = |text: &str, needle: &str| text.lines().filter(|l| l.contains(needle)).count();
    let written = (
        count(&routes, "onlink"),
        count(&neighbours, "lladdr"),
        count(&fdb, "dst "),
    );
    if written != (peers.len(), peers.len(), peers.len()) {
        bail!(
            "the floor's kernel writes left {written:?} routes, neighbours and FDB entries, \
             {} of each expected",
            peers.len()
        );
    }
    Ok(seconds)
}

/// Puts and deletes `events` event leases, each timed from the start of the put (delete)
/// until a watcher on `prefix`, started before, has the event; ms.
fn watch_events(
    kv: &Kv,
    prefix: &str,
    events: usize,
    event: &dyn Fn(usize) -> Result<(String, String)>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (tx, rx) = mpsc::channel::<Seen>();
    let stop = AtomicBool::new(false);
    thread::scope(|scope| {
        let watcher = scope.spawn(|| watch(kv, prefix, &tx, &stop));
        let timed = (|| {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Seen::Ready) => {}
                _ => bail!("the floor's watcher did not start"),
            }
            let (mut add, mut delete) = (Vec::new(), Vec::new());
            for i in 0..events {
                let (key, value) = event(i)?;
                let t0 = Instant::now();
                kv.put(&key, &value)?;
                add.push(wait(&rx, &key, EventType::Put, t0)?);
                let t0 = Instant::now();
                kv.delete(&key)?;
                delete.push(wait(&rx, &key, EventType::Delete, t0)?);
            }
            Ok((add, delete))
        })();
        stop.store(true, Ordering::Relaxed);
        let watched = watcher
            .join()
            .map_err(|_| anyhow::anyhow!("the floor's watcher panicked"))?;
        let timed = timed?;
        watched?;
        Ok(timed)
    })
}

/// What the watcher reports.
enum Seen {
    /// The watch is established.
    Ready,
    /// An event for a key, when the watcher had it.
    Event(String, EventType, Instant),
}

/// Watches `prefix` until `stop`, reporting each event on `tx`.
fn watch(kv: &Kv, prefix: &str, tx: &mpsc::Sender<Seen>, stop: &AtomicBool) -> Result<()> {
    let prefix = prefix.to_owned();
    kv.with_client(|client| async move {
        let mut wc = client.watch_client();
        let mut stream = wc
            .watch(prefix.as_str(), Some(WatchOptions::new().with_prefix()))
            .await
            .context("watch")?;
        let _ = tx.send(Seen::Ready);
        while !stop.load(Ordering::Relaxed) {
            let Ok(message) =
                tokio::time::timeout(Duration::from_millis(100), stream.message()).await
            else {
                continue;
            };
            let Some(resp) = message.context("watch stream")? else {
                bail!("etcd closed the floor's watch");
            };
            let at = Instant::now();
            for ev in resp.events() {
                if let Some(kv) = ev.kv() {
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    let _ = tx.send(Seen::Event(key, ev.event_type(), at));
                }
            }
        }
        Ok(())
    })
}

/// Waits for the watcher's event of `kind` on `key`; ms from `t0` until the watcher had it.
fn wait(rx: &mpsc::Receiver<Seen>, key: &str, kind: EventType, t0: Instant) -> Result<f64> {
    let deadline = t0 + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Seen::Event(k, t, at)) if k == key && t == kind => {
                return Ok(at.duration_since(t0).as_secs_f64() * 1e3);
            }
            Ok(_) => {}
            Err(_) => bail!("the floor's watcher did not see {kind:?} of {key} within 10 s"),
        }
    }
}

/// The agent against the floor, for one run: below 1 would mean the agent beat the floor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FloorRatio {
    /// Kernel complete after start, over list + kernel.
    pub converge: Option<f64>,
    /// Lease event added, p50 over the watcher's p50.
    pub event_add: Option<f64>,
    /// Lease event deleted, p50 over the watcher's p50.
    pub event_delete: Option<f64>,
}

/// The run's figures over its floor; `None` without a floor (kube mode, or no agent) or for
/// a failed run.
pub fn ratio(r: &ControlResult) -> Option<FloorRatio> {
    let floor = r.floor.as_ref()?;
    if r.error.is_some() {
        return None;
    }
    let over = |a: Option<f64>, b: Option<f64>| {
        let (a, b) = (a?, b?);
        (b > 0.0).then(|| a / b)
    };
    let p50 = |l: Option<Latency>| l.map(|l| l.p50);
    Some(FloorRatio {
        converge: over(
            r.converge_seconds,
            Some(floor.list_seconds + floor.kernel_seconds),
        ),
        event_add: over(p50(r.event_add_ms), p50(floor.event_add_ms)),
        event_delete: over(p50(r.event_delete_ms), p50(floor.event_delete_ms)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_become_upstreams_vxlan_entries() {
        let (key, value) = lease::fake_vxlan_leases(lease::DEFAULT_PREFIX, 2)
            .expect("leases")
            .pop()
            .expect("two");
        let p = peer(&key, &value).expect("peer");
        assert_eq!(p.subnet.to_string(), "10.1.1.0/24");
        assert_eq!(p.public_ip, Ipv4Addr::new(100, 64, 0, 2));
        let (ip, bridge) = batches(std::slice::from_ref(&p));
        assert_eq!(
            ip,
            format!(
                "route add 10.1.1.0/24 via 10.1.1.0 dev flannel.1 onlink\n\
                 neigh add 10.1.1.0 lladdr {} dev flannel.1 nud permanent\n",
                p.vtep_mac
            )
        );
        assert_eq!(
            bridge,
            format!(
                "fdb add {} dev flannel.1 dst 100.64.0.2 self permanent\n",
                p.vtep_mac
            )
        );
        assert!(peer(&key, "{}").is_err());
        assert!(peer("/coreos.com/network/subnets/nonsense", &value).is_err());
    }
}
