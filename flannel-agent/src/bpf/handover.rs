//! The way back from the fast path: before the programs of an earlier run are detached
//! (`--dataplane kernel`, a fallback of `auto`), the flows they carried are entered into
//! conntrack, so that the kernel path takes them over as they were.
//!
//! The programs send a pod's packets to remote pods past netfilter, so conntrack holds nothing
//! for those connections. When the kernel path takes over, conntrack picks each one up midway
//! as a new connection, and the NAT rules see it as such: without `--ip-masq` the CNI bridge's
//! masquerade (`ipMasq`) rewrites its source from then on, and the remote pod, which knows the
//! pod's own address, resets it (with `--ip-masq` no rule matches pod-to-pod traffic and
//! nothing changes). The connections are in the programs' memo maps (`FLANNEL_MEMO4`,
//! `FLANNEL_MEMO6`: a remembered decision per flow and direction, see
//! [`flannel_common::memo`]), which the agent that attached the programs pinned under
//! [`PinLayout::memos_dir`], and which are also reachable from the pinned links: link →
//! program → its maps. The pins are what an agent with the DaemonSet's capabilities can
//! read: opening programs and maps by ID takes `CAP_SYS_ADMIN`; by ID it also finds the memos
//! of programs attached by an agent that pinned none. Each flow checked recently is entered as
//! an established connection without NAT ([`crate::netlink::conntrack::insert_established`]),
//! whose packets no NAT rule touches; then the links are dropped, which detaches the programs.
//!
//! Only flows checked within [`RECENT_TICKS`] of the newest memo are entered: the LRU also
//! holds connections long closed, and an entry for one of those could meet a new connection
//! reusing its ports. Programs attached as `clsact` filters (kernels without TCX links) are
//! found through this agent's filters instead ([`super::tcfilter::program_ids`]).
//!
//! Pod connections to the outside that the programs masqueraded (eBPF SNAT, see
//! [`super::nat`]) are entered too, each bound to the address and port the programs gave it
//! ([`crate::netlink::conntrack::insert_masqueraded`]): their replies come to that port, and
//! without the binding the kernel would send their next packets with the pod's address. The
//! live ones are read from the pinned NAT maps (TCP, UDP and ICMP echo, not expired by the
//! programs' own timeouts, TCP not closed): conntrack holds an entry without a binding for
//! each (it saw the pod's packets before the programs translated them), and a flow that goes
//! on (a ping every second) would keep matching it and leave with the pod's address. So are the
//! node's own connections that the programs moved to another port (a pod flow held theirs):
//! conntrack tracks those with the port the node's socket chose and no binding, so that their
//! next packets would leave from a port the remote end does not know. Their entries are
//! replaced first, because until then each holds, as its reply, the very tuple the pod flow
//! that took its port is to be bound to, and conntrack refuses a second entry with it.

use std::{
    collections::{BTreeSet, HashSet},
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4},
};

use aya::{
    maps::{HashMap, Map, MapData},
    programs::{
        links::{FdLink, PinnedLink},
        loaded_programs,
    },
};
use flannel_common::{
    memo::{FlowMemo, FlowMemo6, MEMO4, MEMO6, MemoKey, MemoKey6},
    nat::{proto as nat_proto, tcp_closed},
};
use tracing::{info, warn};

use super::{
    nat,
    pins::{PinLayout, remove_pin},
};
use crate::netlink::conntrack::{self, CtTuple};

/// How far behind the newest memo (in kernel ticks, `bpf_jiffies64`) a memo may have been
/// checked to be handed over: a minute at `HZ=1000`, four at 250, ten at 100. A flow that
/// carries traffic has its memo re-checked at least every second or so.
pub const RECENT_TICKS: u64 = 60_000;

/// What [`detach_handing_over`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandOver {
    /// Pinned links removed (each detaching its program from one interface).
    pub links: usize,
    /// Flows found in the memo maps (recent ones, both families).
    pub flows: usize,
    /// What conntrack did with them.
    pub inserted: conntrack::Inserted,
    /// Live masqueraded flows found in the NAT maps (pods', and the node's moved ones).
    pub masqueraded: usize,
    /// What conntrack did with those.
    pub masqueraded_inserted: conntrack::Inserted,
}

/// Opens every link pinned under `layout`, enters the recent flows of their programs' memo
/// maps (and of the programs of this agent's `clsact` filters) into conntrack, then unpins and
/// drops the links (the programs are detached; the filters are the caller's to remove). A
/// conntrack that cannot be reached is logged; the links are detached all the same. The links
/// stay pinned until conntrack holds the flows: an agent that dies before leaves the fast path
/// attached and forwarding, and the next start hands over again (a flow entered twice is
/// counted as already tracked).
pub fn detach_handing_over(layout: &PinLayout) -> HandOver {
    let mut held = Vec::new();
    let mut programs = BTreeSet::new();
    if let Ok(entries) = fs::read_dir(layout.links_dir()) {
        for entry in entries.flatten() {
            let Ok(pinned) = PinnedLink::from_pin(entry.path()) else {
                continue;
            };
            let link = FdLink::from(pinned);
            if let Ok(info) = link.info() {
                programs.insert(info.program_id());
            }
            held.push((entry.path(), link));
        }
    }
    // Programs attached as `clsact` filters: found through the filters (removed afterwards by
    // the caller's sweep).
    programs.extend(super::tcfilter::program_ids());
    let mut out = HandOver {
        links: held.len(),
        ..HandOver::default()
    };
    let flows = recent_flows(layout, &programs);
    out.flows = flows.len();
    if let Some(inserted) = entered(
        flows.len(),
        conntrack::insert_established(&flows),
        "the fast path's pod connections",
        "without --ip-masq they may be reset",
    ) {
        out.inserted = inserted;
    }
    let masqueraded = masqueraded_flows(layout);
    out.masqueraded = masqueraded.len();
    if let Some(inserted) = entered(
        masqueraded.len(),
        conntrack::insert_masqueraded(&masqueraded),
        "the fast path's masqueraded connections (with their NAT bindings)",
        "they will be cut",
    ) {
        out.masqueraded_inserted = inserted;
    }
    // Unpinned, the links live on in `held` until it is dropped, which detaches the programs.
    for (path, _) in &held {
        if let Err(e) = remove_pin(path) {
            warn!(error = %e, "cannot unpin a fast-path link");
        }
    }
    drop(held);
    out
}

/// Logs what entering `count` flows (`what`) into conntrack did (`result`), or, when
/// conntrack could not be reached, that they were not entered and what that means (`cost`);
/// nothing for no flows. The tally, when there is one.
fn entered(
    count: usize,
    result: Result<conntrack::Inserted, crate::netlink::raw::RawError>,
    what: &str,
    cost: &str,
) -> Option<conntrack::Inserted> {
    if count == 0 {
        return None;
    }
    match result {
        Ok(inserted) => {
            info!(
                flows = count,
                created = inserted.created,
                already_tracked = inserted.existed,
                refused = inserted.refused,
                why = inserted
                    .first_refusal
                    .map(|e| std::io::Error::from_raw_os_error(e).to_string()),
                "{what} handed to conntrack before detaching the fast path"
            );
            Some(inserted)
        }
        Err(err) => {
            warn!(
                flows = count,
                "cannot enter {what} into conntrack before detaching the fast path ({err}); \
                 {cost}"
            );
            None
        }
    }
}

/// The live flows the programs masquerade (the pinned NAT maps under `layout`), each with the
/// address and port it leaves with ([`to_hand_over`]). None when the maps are not there or
/// cannot be read.
fn masqueraded_flows(layout: &PinLayout) -> Vec<(CtTuple, SocketAddrV4)> {
    match nat::pinned_nat_flows(layout) {
        Ok(flows) => to_hand_over(flows.unwrap_or_default()),
        Err(e) => {
            warn!("reading the fast path's NAT flows to hand them over: {e}");
            Vec::new()
        }
    }
}

/// Of the programs' NAT `flows`, those conntrack must bind to the address and port the
/// programs gave them ([`binding`]): TCP, UDP and ICMP echo, not expired by the programs'
/// timeouts, TCP not closed; pod flows, and the node's own flows the programs moved to another
/// port (the node's other flows are translated to themselves and conntrack tracks them as they
/// are). The moved node flows come first (see the module's documentation).
fn to_hand_over(flows: Vec<nat::NatFlow>) -> Vec<(CtTuple, SocketAddrV4)> {
    let mut out: Vec<_> = flows
        .into_iter()
        .filter(|f| {
            (!f.host || f.nat != f.orig)
                && !f.expired
                && match f.proto {
                    nat_proto::TCP => !tcp_closed(f.state),
                    nat_proto::UDP | nat_proto::ICMP => true,
                    _ => false,
                }
        })
        .map(|f| binding(&f))
        .collect();
    // Stable: pod flows keep their order after the node's.
    out.sort_by_key(|(flow, nat)| flow.src != IpAddr::V4(*nat.ip()));
    out
}

/// The conntrack tuple of the NAT flow `f` as its source sent it (an ICMP echo's identifier in
/// place of both ports), and the address and port it leaves with.
fn binding(f: &nat::NatFlow) -> (CtTuple, SocketAddrV4) {
    let dport = if f.proto == nat_proto::ICMP {
        f.orig.port()
    } else {
        f.remote.port()
    };
    let flow = CtTuple {
        src: IpAddr::V4(*f.orig.ip()),
        dst: IpAddr::V4(*f.remote.ip()),
        proto: f.proto,
        sport: f.orig.port(),
        dport,
    };
    (flow, f.nat)
}

/// For a masquerade handover with the programs still attached (eBPF SNAT switched off, see
/// `flannel_ebpf::nat`): enters the live ICMP echo flows of pods into conntrack, each bound to
/// the identifier the programs gave it, and removes them from the programs' NAT maps. The
/// programs would translate such a flow for as long as it lives, and a ping that goes on
/// never ends, nor would the handover waiting for it; from now on the kernel translates it.
/// Returns how many were handed over. When conntrack cannot be reached the flows stay with the
/// programs (the error says why).
pub fn hand_echoes_over(fp: &mut super::FastPath) -> Result<usize, super::BpfError> {
    let echoes: Vec<nat::NatFlow> = fp
        .nat_flows()?
        .into_iter()
        .filter(|f| f.proto == nat_proto::ICMP && !f.host && !f.expired)
        .collect();
    if echoes.is_empty() {
        return Ok(0);
    }
    let bound: Vec<_> = echoes.iter().map(binding).collect();
    let inserted = conntrack::insert_masqueraded(&bound).map_err(super::BpfError::Conntrack)?;
    fp.nat_forget(&echoes)?;
    info!(
        flows = echoes.len(),
        created = inserted.created,
        replaced = inserted.existed,
        refused = inserted.refused,
        "pods' ICMP echo flows handed from eBPF SNAT to conntrack"
    );
    Ok(echoes.len())
}

/// The flows (local pod → remote pod tuples, one per connection) in the memo maps of
/// `programs` (the ones pinned under `layout`, and those found by ID), checked within
/// [`RECENT_TICKS`] of the newest. Nothing when no program is attached.
fn recent_flows(layout: &PinLayout, programs: &BTreeSet<u32>) -> Vec<CtTuple> {
    if programs.is_empty() {
        return Vec::new();
    }
    let mut memos: Vec<(CtTuple, u64)> = Vec::new();
    let pinned = pinned_memos(layout, &mut memos);
    let listed = memos_by_id(programs, &mut memos);
    if !pinned && !listed {
        warn!(
            "the fast path's flow memos cannot be read (none pinned under {}, and finding them \
             by program needs CAP_SYS_ADMIN): its pod connections are not handed to conntrack, \
             and without --ip-masq they may be reset",
            layout.memos_dir().display()
        );
    }
    recent(memos, RECENT_TICKS)
}

/// Adds the memos of the memo maps pinned by the agent that attached the programs
/// ([`PinLayout::memos_dir`]; by path, which takes no more than `CAP_BPF`) to `memos`. Whether
/// any was found.
fn pinned_memos(layout: &PinLayout, memos: &mut Vec<(CtTuple, u64)>) -> bool {
    let mut found = false;
    for name in [MEMO4, MEMO6] {
        if let Ok(data) = MapData::from_pin(layout.memo(name)) {
            memos.extend(memos_of(name, data));
            found = true;
        }
    }
    found
}

/// Adds the memos of the memo maps of `programs` (by ID: the programs behind this layout's
/// links and this agent's filters, also those of an agent that pinned no memo maps) to
/// `memos`. Opening programs and maps by ID takes `CAP_SYS_ADMIN`: `false` when no program
/// could be opened.
fn memos_by_id(programs: &BTreeSet<u32>, memos: &mut Vec<(CtTuple, u64)>) -> bool {
    let mut map_ids = BTreeSet::new();
    let mut listed = false;
    for info in loaded_programs() {
        // Refused listing (one error, then the end), or a program gone meanwhile.
        let Ok(info) = info else { continue };
        listed = true;
        if programs.contains(&info.id())
            && let Ok(Some(ids)) = info.map_ids()
        {
            map_ids.extend(ids);
        }
    }
    for id in map_ids {
        let Ok(data) = MapData::from_id(id) else {
            continue;
        };
        let Ok(Some(name)) = data.info().map(|i| i.name_as_str().map(str::to_owned)) else {
            continue;
        };
        memos.extend(memos_of(&name, data));
    }
    listed
}

/// The memos (tuple, checked at) of the map `data` named `name`: none unless it is
/// [`MEMO4`] or [`MEMO6`].
fn memos_of(name: &str, data: MapData) -> Vec<(CtTuple, u64)> {
    match name {
        MEMO4 => read_memos(data, tuple4, |m: &FlowMemo| m.checked_at),
        MEMO6 => read_memos(data, tuple6, |m: &FlowMemo6| m.checked_at),
        _ => Vec::new(),
    }
}

/// Every memo of the LRU map `data` as (its flow's tuple, when it was checked); none when the
/// map is not of that key and value.
fn read_memos<K: aya::Pod, V: aya::Pod>(
    data: MapData,
    tuple: fn(&K) -> CtTuple,
    checked_at: fn(&V) -> u64,
) -> Vec<(CtTuple, u64)> {
    HashMap::<MapData, K, V>::try_from(Map::LruHashMap(data))
        .map(|map| {
            map.iter()
                .flatten()
                .map(|(k, v)| (tuple(&k), checked_at(&v)))
                .collect()
        })
        .unwrap_or_default()
}

/// The distinct tuples of `memos` (tuple, checked at) checked within `window` ticks of the
/// newest. (`bpf_jiffies64` starts near 2^32 and does not wrap.)
fn recent(memos: Vec<(CtTuple, u64)>, window: u64) -> Vec<CtTuple> {
    let Some(newest) = memos.iter().map(|(_, at)| *at).max() else {
        return Vec::new();
    };
    let mut seen = HashSet::new();
    memos
        .into_iter()
        .filter(|(_, at)| newest.saturating_sub(*at) <= window)
        .filter_map(|(t, _)| seen.insert(t).then_some(t))
        .collect()
}

fn tuple4(k: &MemoKey) -> CtTuple {
    CtTuple {
        src: IpAddr::V4(Ipv4Addr::from(k.local_addr)),
        dst: IpAddr::V4(Ipv4Addr::from(k.remote_addr)),
        proto: k.proto,
        sport: u16::from_be_bytes(k.local_port),
        dport: u16::from_be_bytes(k.remote_port),
    }
}

fn tuple6(k: &MemoKey6) -> CtTuple {
    CtTuple {
        src: IpAddr::V6(Ipv6Addr::from(k.local_addr)),
        dst: IpAddr::V6(Ipv6Addr::from(k.remote_addr)),
        proto: k.proto,
        sport: u16::from_be_bytes(k.local_port),
        dport: u16::from_be_bytes(k.remote_port),
    }
}

#[cfg(test)]
mod tests {
    use flannel_common::memo::{DIR_IN, DIR_OUT};

    use super::*;

    #[test]
    fn both_directions_of_a_flow_make_one_connection_local_side_first() {
        let out = MemoKey {
            local_addr: [10, 244, 1, 5],
            remote_addr: [10, 244, 2, 7],
            local_port: 40000u16.to_be_bytes(),
            remote_port: 7100u16.to_be_bytes(),
            proto: 6,
            dir: DIR_OUT,
            _pad: [0; 2],
        };
        let back = MemoKey { dir: DIR_IN, ..out };
        let tuples = recent(vec![(tuple4(&out), 500), (tuple4(&back), 510)], 100);
        assert_eq!(
            tuples,
            [CtTuple::of("10.244.1.5", "10.244.2.7", 6, 40000, 7100)]
        );
    }

    #[test]
    fn flows_not_checked_lately_are_left_out() {
        let a = CtTuple::of("10.244.1.5", "10.244.2.7", 6, 1, 2);
        let b = CtTuple::of("10.244.1.5", "10.244.2.7", 6, 3, 4);
        let c = CtTuple::of("10.244.1.5", "10.244.2.7", 17, 5, 6);
        // `c` newest; `a` 100 ticks before it, `b` 1,000 before.
        let now = 1 << 32;
        let memos = vec![(a, now - 100), (b, now - 1000), (c, now)];
        assert_eq!(recent(memos, 100), [a, c]);
        assert!(recent(Vec::new(), 100).is_empty());
    }

    /// A NAT flow from `orig` to 192.0.2.9:7100 leaving as `nat`, live and open.
    fn nat_flow(proto: u8, orig: &str, nat: &str, host: bool) -> nat::NatFlow {
        nat::NatFlow {
            proto,
            orig: orig.parse().expect("orig"),
            remote: "192.0.2.9:7100".parse().expect("remote"),
            nat: nat.parse().expect("nat"),
            state: 0,
            host,
            age: std::time::Duration::from_secs(3),
            idle: std::time::Duration::from_secs(1),
            expired: false,
            reverse_ok: true,
        }
    }

    #[test]
    fn pod_flows_echoes_and_moved_node_flows_are_handed_over_node_flows_first() {
        let pod = nat_flow(6, "10.244.1.5:45000", "172.18.0.2:45000", false);
        let pod_udp = nat_flow(17, "10.244.1.5:5353", "172.18.0.2:40001", false);
        let moved = nat_flow(6, "172.18.0.2:45000", "172.18.0.2:51234", true);
        let unmoved = nat_flow(6, "172.18.0.2:46000", "172.18.0.2:46000", true);
        let expired = nat::NatFlow {
            expired: true,
            ..nat_flow(17, "10.244.1.6:5000", "172.18.0.2:5000", false)
        };
        let echo = nat::NatFlow {
            remote: "192.0.2.9:0".parse().expect("remote"),
            ..nat_flow(1, "10.244.1.5:77", "172.18.0.2:32801", false)
        };
        let out = to_hand_over(vec![pod.clone(), pod_udp, moved, unmoved, expired, echo]);
        let at = |s: &str| s.parse::<SocketAddrV4>().expect("addr");
        assert_eq!(
            out,
            [
                (
                    CtTuple::of("172.18.0.2", "192.0.2.9", 6, 45000, 7100),
                    at("172.18.0.2:51234")
                ),
                (
                    CtTuple::of("10.244.1.5", "192.0.2.9", 6, 45000, 7100),
                    at("172.18.0.2:45000")
                ),
                (
                    CtTuple::of("10.244.1.5", "192.0.2.9", 17, 5353, 7100),
                    at("172.18.0.2:40001")
                ),
                (
                    CtTuple::of("10.244.1.5", "192.0.2.9", 1, 77, 77),
                    at("172.18.0.2:32801")
                ),
            ]
        );
        // A closed TCP flow is not handed over.
        let closed = nat::NatFlow {
            state: flannel_common::nat::ST_RST,
            ..pod
        };
        assert!(to_hand_over(vec![closed]).is_empty());
    }

    #[test]
    fn ipv6_memos_become_ipv6_tuples() {
        let k = MemoKey6 {
            local_addr: "fd00:0:0:1::5".parse::<Ipv6Addr>().expect("addr").octets(),
            remote_addr: "fd00:0:0:2::7".parse::<Ipv6Addr>().expect("addr").octets(),
            local_port: 5353u16.to_be_bytes(),
            remote_port: 53u16.to_be_bytes(),
            proto: 17,
            dir: DIR_OUT,
            _pad: [0; 2],
        };
        assert_eq!(
            tuple6(&k),
            CtTuple::of("fd00:0:0:1::5", "fd00:0:0:2::7", 17, 5353, 53)
        );
    }
}
