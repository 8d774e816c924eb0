//! Reading the kernel's connection tracking table through ctnetlink (`NETLINK_NETFILTER`,
//! subsystem `CTNETLINK`): a dump of one address family, each entry reduced to its two tuples
//! ([`CtEntry`]). Used by the fast path to find the flows conntrack holds NAT state for before
//! it takes a node's or a pod's traffic over (`crate::bpf::seed`).
//!
//! Blocking, like [`super::raw`]: run [`dump`] on `tokio::task::spawn_blocking`. Entries are
//! handed over one at a time as they arrive, so a table of a million connections is never
//! held whole.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4};

use super::raw::{
    self, Malformed, MessageBuilder, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL,
    NLM_F_REQUEST, RawError, RawSocket,
};

/// `NETLINK_NETFILTER`.
const NETLINK_NETFILTER: isize = 12;
/// `NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_GET`.
const CT_GET: u16 = 1 << 8 | 1;
/// `NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW`: each entry of a dump.
const CT_NEW: u16 = 1 << 8;
/// `NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_DELETE`.
const CT_DELETE: u16 = 1 << 8 | 2;
/// `struct nfgenmsg` is 4 bytes: family, version, resource id.
const NFGENMSG_LEN: usize = 4;

// `enum ctattr_type`, `ctattr_tuple`, `ctattr_ip`, `ctattr_l4proto`.
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_TIMEOUT: u16 = 7;
const CTA_PROTOINFO: u16 = 4;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
const CTA_PROTOINFO_TCP_FLAGS_ORIGINAL: u16 = 4;
const CTA_PROTOINFO_TCP_FLAGS_REPLY: u16 = 5;
/// `IP_CT_TCP_FLAG_BE_LIBERAL`: no window checks for this side (the entry starts midway).
const IP_CT_TCP_FLAG_BE_LIBERAL: u8 = 0x08;
/// `TCP_CONNTRACK_ESTABLISHED`.
const TCP_CONNTRACK_ESTABLISHED: u8 = 3;
/// `IPS_SEEN_REPLY | IPS_ASSURED | IPS_CONFIRMED` (the kernel marks an entry it creates for
/// ctnetlink confirmed before applying the status, and refuses a status that clears it).
const STATUS_ESTABLISHED: u32 = 1 << 1 | IPS_ASSURED | 1 << 3;
/// `IPS_ASSURED` in `CTA_STATUS`.
const IPS_ASSURED: u32 = 1 << 2;
/// `TCP_CONNTRACK_TIME_WAIT` and `TCP_CONNTRACK_CLOSE`: a connection that is over.
const TCP_CONNTRACK_TIME_WAIT: u8 = 7;
const TCP_CONNTRACK_CLOSE: u8 = 8;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTO_ICMP_ID: u16 = 4;
const CTA_PROTO_ICMP_TYPE: u16 = 5;
const CTA_PROTO_ICMP_CODE: u16 = 6;
const CTA_PROTO_ICMPV6_ID: u16 = 7;
const CTA_PROTO_ICMPV6_TYPE: u16 = 8;
const CTA_PROTO_ICMPV6_CODE: u16 = 9;
/// `IPPROTO_ICMP`, `IPPROTO_ICMPV6`.
const ICMP: u8 = 1;
const ICMPV6: u8 = 58;
// `CTA_NAT_SRC` and `enum ctattr_nat`, `ctattr_protonat`.
const CTA_NAT_SRC: u16 = 6;
const CTA_NAT_V4_MINIP: u16 = 1;
const CTA_NAT_V4_MAXIP: u16 = 2;
const CTA_NAT_PROTO: u16 = 3;
const CTA_PROTONAT_PORT_MIN: u16 = 1;
const CTA_PROTONAT_PORT_MAX: u16 = 2;

/// The address family of a dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `AF_INET`.
    V4,
    /// `AF_INET6`.
    V6,
}

impl Family {
    fn af(self) -> u8 {
        match self {
            Family::V4 => libc::AF_INET as u8,
            Family::V6 => libc::AF_INET6 as u8,
        }
    }
}

/// One direction of a tracked connection, as conntrack records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtTuple {
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// IP protocol.
    pub proto: u8,
    /// Source port; the echo identifier for ICMP/ICMPv6; 0 for protocols without ports.
    pub sport: u16,
    /// Destination port; the echo identifier for ICMP/ICMPv6 (so that both sides carry it,
    /// as the fast path's flow keys do); 0 for protocols without ports.
    pub dport: u16,
}

impl CtTuple {
    /// A tuple from address text (tests).
    #[cfg(test)]
    #[allow(clippy::unwrap_used)] // tests fail loudly by design
    pub(crate) fn of(src: &str, dst: &str, proto: u8, sport: u16, dport: u16) -> CtTuple {
        CtTuple {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto,
            sport,
            dport,
        }
    }

    /// The tuple a packet going the other way, untranslated, would have.
    pub fn inverse(&self) -> CtTuple {
        CtTuple {
            src: self.dst,
            dst: self.src,
            proto: self.proto,
            sport: self.dport,
            dport: self.sport,
        }
    }
}

/// A tracked connection: the tuple of the packets that opened it and the tuple its answers
/// have. They are each other's inverse unless a NAT rewrote one side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtEntry {
    /// As the first packet arrived (before any NAT).
    pub orig: CtTuple,
    /// As the answers arrive (before the NAT is undone).
    pub reply: CtTuple,
    /// Conntrack's TCP state (`TCP_CONNTRACK_*`), for TCP.
    pub tcp_state: Option<u8>,
    /// `IPS_ASSURED`: for UDP, answered and still sending after its first two seconds (a
    /// stream, not a lookup); for TCP, established.
    pub assured: bool,
}

impl CtEntry {
    /// Whether this is a TCP connection that is over (closed, or in `TIME_WAIT`): its entry
    /// only lingers.
    pub fn is_closed(&self) -> bool {
        matches!(
            self.tcp_state,
            Some(TCP_CONNTRACK_TIME_WAIT | TCP_CONNTRACK_CLOSE)
        )
    }

    /// Whether a NAT (source or destination) rewrote the connection.
    pub fn is_nated(&self) -> bool {
        self.reply != self.orig.inverse()
    }
}

/// Dumps the conntrack table of `family` in the calling thread's network namespace, calling
/// `each` for every entry; returns how many entries could not be read (skipped). An error
/// means the table could not be dumped at all (no ctnetlink in this kernel, no permission).
pub fn dump(family: Family, mut each: impl FnMut(CtEntry)) -> Result<usize, RawError> {
    let mut socket = RawSocket::open(NETLINK_NETFILTER)?;
    let mut message = MessageBuilder::new(CT_GET, NLM_F_REQUEST | NLM_F_DUMP);
    // nfgenmsg: family, NFNETLINK_V0, resource id 0 (big endian).
    message.header(&[family.af(), 0, 0, 0]);
    let mut skipped = 0;
    socket.request_each(message, |ty, payload| {
        if ty != CT_NEW {
            return;
        }
        match parse_entry(payload) {
            Ok(Some(entry)) => each(entry),
            Ok(None) | Err(_) => skipped += 1,
        }
    })?;
    Ok(skipped)
}

/// What [`insert_established`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Inserted {
    /// Entries created.
    pub created: usize,
    /// Connections conntrack already tracked (left as they are by [`insert_established`],
    /// replaced with a NAT binding by [`insert_masqueraded`]).
    pub existed: usize,
    /// Entries the kernel refused (another error than "exists").
    pub refused: usize,
    /// The kernel's errno for the first refusal.
    pub first_refusal: Option<i32>,
}

/// Enters each of `flows` (the tuple of its packets in one direction; TCP, UDP or an ICMP
/// echo, one family or both) into the conntrack table of the calling thread's network
/// namespace as an established connection without NAT: seen both ways, assured, TCP in
/// `ESTABLISHED` with no window checks (its sequence numbers are not known). Packets of such
/// a connection are `ESTABLISHED` to netfilter, so no NAT rule (a masquerade) is applied to
/// them, as none was when they first passed. A connection conntrack already tracks is left
/// alone. An error means conntrack could not be reached at all.
pub fn insert_established(flows: &[CtTuple]) -> Result<Inserted, RawError> {
    insert_each(flows.iter().map(|flow| established_message(flow, None)))
}

/// [`insert_established`] for connections a source NAT gave another address and port (the
/// fast path's masquerade): each of `flows` (IPv4 TCP, UDP or ICMP echo, its tuple as the pod
/// sent it) with the address and port (echo identifier) its packets leave with, as the
/// kernel's own masquerade would have bound it. Its packets are then translated by the kernel
/// as they were by the programs.
/// An entry conntrack holds for the flow already (without the binding: the programs
/// translated past conntrack, and a binding cannot be added to an existing entry) is replaced
/// and counted in `existed`; one whose binding another entry's tuple clashes with is refused
/// (`EEXIST`).
pub fn insert_masqueraded(flows: &[(CtTuple, SocketAddrV4)]) -> Result<Inserted, RawError> {
    let mut socket = RawSocket::open(NETLINK_NETFILTER)?;
    let mut out = Inserted::default();
    for (flow, nat) in flows {
        let replaced = match socket.request(delete_message(flow)) {
            Ok(_) => true,
            Err(RawError::Errno(_)) => false,
            Err(e) => return Err(e),
        };
        match socket.request(established_message(flow, Some(*nat))) {
            Ok(_) if replaced => out.existed += 1,
            // Its own entry is gone: another one holds the tuple the binding makes.
            Err(RawError::Errno(libc::EEXIST)) => {
                out.refused += 1;
                out.first_refusal.get_or_insert(libc::EEXIST);
            }
            answer => tally(&mut out, answer)?,
        }
    }
    Ok(out)
}

/// Sends each of `messages` (an `IPCTNL_MSG_CT_NEW` request) and tallies the answers.
fn insert_each(messages: impl Iterator<Item = MessageBuilder>) -> Result<Inserted, RawError> {
    let mut socket = RawSocket::open(NETLINK_NETFILTER)?;
    let mut out = Inserted::default();
    for message in messages {
        tally(&mut out, socket.request(message))?;
    }
    Ok(out)
}

/// Counts the kernel's answer to one `IPCTNL_MSG_CT_NEW` request in `out`; any other error
/// (conntrack unreachable) is returned.
fn tally<T>(out: &mut Inserted, answer: Result<T, RawError>) -> Result<(), RawError> {
    match answer {
        Ok(_) => out.created += 1,
        Err(RawError::Errno(libc::EEXIST)) => out.existed += 1,
        Err(RawError::Errno(errno)) => {
            out.refused += 1;
            out.first_refusal.get_or_insert(errno);
        }
        Err(e) => return Err(e),
    }
    Ok(())
}

/// The `IPCTNL_MSG_CT_NEW` request of [`insert_established`] for `flow`, with a source NAT
/// binding to exactly `snat` when given ([`insert_masqueraded`]: the kernel then derives the
/// reply tuple from it).
fn established_message(flow: &CtTuple, snat: Option<SocketAddrV4>) -> MessageBuilder {
    let mut m = MessageBuilder::new(
        CT_NEW,
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
    );
    m.header(&[family_of(flow).af(), 0, 0, 0]);
    tuple_nest(&mut m, CTA_TUPLE_ORIG, flow);
    tuple_nest(&mut m, CTA_TUPLE_REPLY, &flow.inverse());
    if let Some(nat) = snat {
        m.nest_start(CTA_NAT_SRC);
        m.attr(CTA_NAT_V4_MINIP, &nat.ip().octets());
        m.attr(CTA_NAT_V4_MAXIP, &nat.ip().octets());
        m.nest_start(CTA_NAT_PROTO);
        m.attr(CTA_PROTONAT_PORT_MIN, &nat.port().to_be_bytes());
        m.attr(CTA_PROTONAT_PORT_MAX, &nat.port().to_be_bytes());
        m.nest_end();
        m.nest_end();
    }
    m.attr(CTA_STATUS, &STATUS_ESTABLISHED.to_be_bytes());
    // Conntrack sets its own timeout from the state at the next packet.
    let timeout: u32 = match flow.proto {
        6 => 3600,
        ICMP | ICMPV6 => 30,
        _ => 180,
    };
    m.attr(CTA_TIMEOUT, &timeout.to_be_bytes());
    if flow.proto == 6 {
        m.nest_start(CTA_PROTOINFO);
        m.nest_start(CTA_PROTOINFO_TCP);
        m.attr_u8(CTA_PROTOINFO_TCP_STATE, TCP_CONNTRACK_ESTABLISHED);
        let liberal = [IP_CT_TCP_FLAG_BE_LIBERAL, IP_CT_TCP_FLAG_BE_LIBERAL];
        m.attr(CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, &liberal);
        m.attr(CTA_PROTOINFO_TCP_FLAGS_REPLY, &liberal);
        m.nest_end();
        m.nest_end();
    }
    m
}

/// The `IPCTNL_MSG_CT_DELETE` request for the entry whose original tuple is `flow`.
fn delete_message(flow: &CtTuple) -> MessageBuilder {
    let mut m = MessageBuilder::new(CT_DELETE, NLM_F_REQUEST | NLM_F_ACK);
    m.header(&[family_of(flow).af(), 0, 0, 0]);
    tuple_nest(&mut m, CTA_TUPLE_ORIG, flow);
    m
}

fn family_of(flow: &CtTuple) -> Family {
    match flow.src {
        IpAddr::V4(_) => Family::V4,
        IpAddr::V6(_) => Family::V6,
    }
}

/// Writes `t` as the tuple attribute `ty` (`CTA_TUPLE_ORIG` or `CTA_TUPLE_REPLY`). An ICMP or
/// ICMPv6 tuple is an echo's: its identifier, and the request's type one way (original), the
/// reply's the other.
fn tuple_nest(m: &mut MessageBuilder, ty: u16, t: &CtTuple) {
    m.nest_start(ty);
    m.nest_start(CTA_TUPLE_IP);
    match (t.src, t.dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            m.attr(CTA_IP_V4_SRC, &src.octets());
            m.attr(CTA_IP_V4_DST, &dst.octets());
        }
        (src, dst) => {
            m.attr(CTA_IP_V6_SRC, &v6_octets(src));
            m.attr(CTA_IP_V6_DST, &v6_octets(dst));
        }
    }
    m.nest_end();
    m.nest_start(CTA_TUPLE_PROTO);
    m.attr_u8(CTA_PROTO_NUM, t.proto);
    let echo = match t.proto {
        ICMP => Some((
            CTA_PROTO_ICMP_ID,
            CTA_PROTO_ICMP_TYPE,
            CTA_PROTO_ICMP_CODE,
            8,
            0,
        )),
        ICMPV6 => Some((
            CTA_PROTO_ICMPV6_ID,
            CTA_PROTO_ICMPV6_TYPE,
            CTA_PROTO_ICMPV6_CODE,
            128,
            129,
        )),
        _ => None,
    };
    match echo {
        Some((id, type_, code, request, reply)) => {
            m.attr(id, &t.sport.to_be_bytes());
            m.attr_u8(type_, if ty == CTA_TUPLE_ORIG { request } else { reply });
            m.attr_u8(code, 0);
        }
        None => {
            m.attr(CTA_PROTO_SRC_PORT, &t.sport.to_be_bytes());
            m.attr(CTA_PROTO_DST_PORT, &t.dport.to_be_bytes());
        }
    }
    m.nest_end();
    m.nest_end();
}

fn v6_octets(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V6(a) => a.octets(),
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
    }
}

/// Parses one `IPCTNL_MSG_CT_NEW` payload (`nfgenmsg` and attributes); `None` when it lacks
/// a tuple.
pub fn parse_entry(payload: &[u8]) -> Result<Option<CtEntry>, Malformed> {
    let attrs = raw::attributes(payload.get(NFGENMSG_LEN..).unwrap_or_default())?;
    let mut orig = None;
    let mut reply = None;
    let mut tcp_state = None;
    let mut assured = false;
    for (ty, value) in attrs {
        match ty {
            CTA_TUPLE_ORIG => orig = parse_tuple(value)?,
            CTA_TUPLE_REPLY => reply = parse_tuple(value)?,
            CTA_PROTOINFO => tcp_state = parse_tcp_state(value)?,
            CTA_STATUS => {
                let status = <[u8; 4]>::try_from(value)
                    .map_err(|_| Malformed(format!("conntrack status of {} bytes", value.len())))?;
                assured = u32::from_be_bytes(status) & IPS_ASSURED != 0;
            }
            _ => {}
        }
    }
    Ok(orig.zip(reply).map(|(orig, reply)| CtEntry {
        orig,
        reply,
        tcp_state,
        assured,
    }))
}

/// The TCP state in a `CTA_PROTOINFO` nest, if it holds one.
fn parse_tcp_state(buf: &[u8]) -> Result<Option<u8>, Malformed> {
    for (ty, value) in raw::attributes(buf)? {
        if ty == CTA_PROTOINFO_TCP {
            for (ty, v) in raw::attributes(value)? {
                if ty == CTA_PROTOINFO_TCP_STATE {
                    return Ok(v.first().copied());
                }
            }
        }
    }
    Ok(None)
}

/// Parses a `CTA_TUPLE_*` nest; `None` when its addresses or protocol are missing.
fn parse_tuple(buf: &[u8]) -> Result<Option<CtTuple>, Malformed> {
    let (mut src, mut dst, mut proto) = (None, None, None);
    let (mut sport, mut dport) = (0, 0);
    for (ty, value) in raw::attributes(buf)? {
        match ty {
            CTA_TUPLE_IP => {
                for (ty, bytes) in raw::attributes(value)? {
                    let addr = match ty {
                        CTA_IP_V4_SRC | CTA_IP_V4_DST => <[u8; 4]>::try_from(bytes)
                            .ok()
                            .map(|a| IpAddr::V4(Ipv4Addr::from(a))),
                        CTA_IP_V6_SRC | CTA_IP_V6_DST => <[u8; 16]>::try_from(bytes)
                            .ok()
                            .map(|a| IpAddr::V6(Ipv6Addr::from(a))),
                        _ => continue,
                    };
                    let Some(addr) = addr else {
                        return Err(Malformed(format!(
                            "conntrack address attribute {ty} of {} bytes",
                            bytes.len()
                        )));
                    };
                    match ty {
                        CTA_IP_V4_SRC | CTA_IP_V6_SRC => src = Some(addr),
                        _ => dst = Some(addr),
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (ty, v) in raw::attributes(value)? {
                    let be16 = || v.get(..2).map(|b| u16::from_be_bytes([b[0], b[1]]));
                    match ty {
                        CTA_PROTO_NUM => proto = v.first().copied(),
                        CTA_PROTO_SRC_PORT => sport = be16().unwrap_or(0),
                        CTA_PROTO_DST_PORT => dport = be16().unwrap_or(0),
                        CTA_PROTO_ICMP_ID | CTA_PROTO_ICMPV6_ID => {
                            let id = be16().unwrap_or(0);
                            (sport, dport) = (id, id);
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Ok(match (src, dst, proto) {
        (Some(src), Some(dst), Some(proto)) => Some(CtTuple {
            src,
            dst,
            proto,
            sport,
            dport,
        }),
        _ => None,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    /// An entry as the kernel sends it (attribute layout of `ctnetlink_dump_tuples`).
    fn message(orig: &CtTuple, reply: &CtTuple) -> Vec<u8> {
        message_in(orig, reply, 3)
    }

    /// The same with TCP state `state` (`TCP_CONNTRACK_ESTABLISHED` is 3).
    fn message_in(orig: &CtTuple, reply: &CtTuple, state: u8) -> Vec<u8> {
        let mut b = MessageBuilder::new(CT_NEW, 0);
        b.header(&[libc::AF_INET as u8, 0, 0, 0]);
        for (ty, t) in [(CTA_TUPLE_ORIG, orig), (CTA_TUPLE_REPLY, reply)] {
            b.nest_start(ty);
            b.nest_start(CTA_TUPLE_IP);
            for (v4, v6, addr) in [
                (CTA_IP_V4_SRC, CTA_IP_V6_SRC, t.src),
                (CTA_IP_V4_DST, CTA_IP_V6_DST, t.dst),
            ] {
                match addr {
                    IpAddr::V4(a) => b.attr(v4, &a.octets()),
                    IpAddr::V6(a) => b.attr(v6, &a.octets()),
                };
            }
            b.nest_end();
            b.nest_start(CTA_TUPLE_PROTO);
            b.attr_u8(CTA_PROTO_NUM, t.proto);
            if t.proto == 1 {
                b.attr(CTA_PROTO_ICMP_ID, &t.sport.to_be_bytes());
                b.attr_u8(5, 8); // type
                b.attr_u8(6, 0); // code
            } else {
                b.attr(CTA_PROTO_SRC_PORT, &t.sport.to_be_bytes());
                b.attr(CTA_PROTO_DST_PORT, &t.dport.to_be_bytes());
            }
            b.nest_end();
            b.nest_end();
        }
        b.attr(3, &0x18e_u32.to_be_bytes()); // CTA_STATUS
        if orig.proto == 6 {
            b.nest_start(CTA_PROTOINFO);
            b.nest_start(CTA_PROTOINFO_TCP);
            b.attr_u8(CTA_PROTOINFO_TCP_STATE, state);
            b.attr_u8(2, 7); // window scale, original
            b.nest_end();
            b.nest_end();
        }
        b.finish(1)
    }

    #[test]
    fn entries_round_trip_and_nat_is_seen() {
        let orig = CtTuple::of("10.244.1.5", "10.244.2.7", 6, 40000, 7100);
        let masqueraded = CtTuple::of("10.244.2.7", "10.244.1.0", 6, 7100, 40000);
        let bytes = message(&orig, &masqueraded);
        let msgs = raw::messages(&bytes).unwrap();
        let entry = parse_entry(msgs[0].payload).unwrap().unwrap();
        assert_eq!(entry.orig, orig);
        assert_eq!(entry.reply, masqueraded);
        assert!(entry.is_nated());
        assert_eq!(entry.tcp_state, Some(3));
        assert!(!entry.is_closed());
        for over in [TCP_CONNTRACK_TIME_WAIT, TCP_CONNTRACK_CLOSE] {
            let bytes = message_in(&orig, &masqueraded, over);
            let entry = parse_entry(raw::messages(&bytes).unwrap()[0].payload)
                .unwrap()
                .unwrap();
            assert!(entry.is_closed());
        }

        let plain = orig.inverse();
        let bytes = message(&orig, &plain);
        let entry = parse_entry(raw::messages(&bytes).unwrap()[0].payload)
            .unwrap()
            .unwrap();
        assert!(!entry.is_nated());

        let v6 = CtTuple::of("fd00:1::5", "fd00:2::7", 17, 5353, 53);
        let bytes = message(&v6, &v6.inverse());
        let entry = parse_entry(raw::messages(&bytes).unwrap()[0].payload)
            .unwrap()
            .unwrap();
        assert_eq!(entry.orig, v6);
        assert_eq!(entry.tcp_state, None);
    }

    #[test]
    fn an_established_entry_request_reads_back_as_that_connection() {
        for (flow, state) in [
            (
                CtTuple::of("10.244.1.5", "10.244.2.7", 6, 40000, 7100),
                Some(3),
            ),
            (CtTuple::of("fd00:1::5", "fd00:2::7", 17, 5353, 53), None),
        ] {
            let bytes = established_message(&flow, None).finish(1);
            let msgs = raw::messages(&bytes).unwrap();
            assert_eq!(msgs[0].msg_type, CT_NEW);
            assert_eq!(
                msgs[0].flags,
                NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
            );
            let entry = parse_entry(msgs[0].payload).unwrap().unwrap();
            assert_eq!(entry.orig, flow);
            assert_eq!(entry.reply, flow.inverse());
            assert!(!entry.is_nated());
            assert_eq!(entry.tcp_state, state);
            assert!(entry.assured, "the status entered is read back");
        }
    }

    #[test]
    fn a_masqueraded_entry_request_binds_exactly_the_address_and_port() {
        let flow = CtTuple::of("10.244.1.5", "192.0.2.9", 6, 40000, 443);
        let nat = SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, 11), 61000);
        let bytes = established_message(&flow, Some(nat)).finish(1);
        let msgs = raw::messages(&bytes).unwrap();
        let attrs = raw::attributes(&msgs[0].payload[NFGENMSG_LEN..]).unwrap();
        let nested = |buf: &[u8], ty: u16| -> Vec<u8> {
            raw::attributes(buf)
                .unwrap()
                .into_iter()
                .find(|(t, _)| *t == ty)
                .map(|(_, v)| v.to_vec())
                .unwrap_or_else(|| panic!("attribute {ty}"))
        };
        let (_, nat_attr) = attrs
            .iter()
            .find(|(t, _)| *t == CTA_NAT_SRC)
            .expect("CTA_NAT_SRC");
        assert_eq!(nested(nat_attr, CTA_NAT_V4_MINIP), [192, 168, 1, 11]);
        assert_eq!(nested(nat_attr, CTA_NAT_V4_MAXIP), [192, 168, 1, 11]);
        let ports = nested(nat_attr, CTA_NAT_PROTO);
        assert_eq!(
            nested(&ports, CTA_PROTONAT_PORT_MIN),
            61000u16.to_be_bytes()
        );
        assert_eq!(
            nested(&ports, CTA_PROTONAT_PORT_MAX),
            61000u16.to_be_bytes()
        );
        // The tuples are the connection's own: the kernel derives the reply from the binding.
        let entry = parse_entry(msgs[0].payload).unwrap().unwrap();
        assert_eq!((entry.orig, entry.reply), (flow, flow.inverse()));
        // Without a binding, no CTA_NAT_SRC.
        let plain = established_message(&flow, None).finish(1);
        let msgs = raw::messages(&plain).unwrap();
        let attrs = raw::attributes(&msgs[0].payload[NFGENMSG_LEN..]).unwrap();
        assert!(attrs.iter().all(|(t, _)| *t != CTA_NAT_SRC));
    }

    #[test]
    fn icmp_echo_carries_the_identifier_on_both_sides() {
        let echo = CtTuple::of("10.244.1.5", "10.244.2.7", 1, 77, 77);
        let bytes = message(&echo, &echo.inverse());
        let entry = parse_entry(raw::messages(&bytes).unwrap()[0].payload)
            .unwrap()
            .unwrap();
        assert_eq!((entry.orig.sport, entry.orig.dport), (77, 77));
    }

    #[test]
    fn an_echo_request_is_the_original_way_and_its_reply_the_other() {
        for (echo, request, reply) in [
            (CtTuple::of("10.244.1.5", "192.0.2.9", 1, 77, 77), 8, 0),
            (CtTuple::of("fd00:1::5", "fd00:2::7", 58, 77, 77), 128, 129),
        ] {
            let (id, type_, code) = if echo.proto == ICMP {
                (CTA_PROTO_ICMP_ID, CTA_PROTO_ICMP_TYPE, CTA_PROTO_ICMP_CODE)
            } else {
                (
                    CTA_PROTO_ICMPV6_ID,
                    CTA_PROTO_ICMPV6_TYPE,
                    CTA_PROTO_ICMPV6_CODE,
                )
            };
            let bytes = established_message(&echo, None).finish(1);
            let msgs = raw::messages(&bytes).unwrap();
            let attrs = raw::attributes(&msgs[0].payload[NFGENMSG_LEN..]).unwrap();
            for (direction, want_type) in [(CTA_TUPLE_ORIG, request), (CTA_TUPLE_REPLY, reply)] {
                let (_, tuple) = attrs.iter().find(|(t, _)| *t == direction).unwrap();
                let (_, l4) = raw::attributes(tuple)
                    .unwrap()
                    .into_iter()
                    .find(|(t, _)| *t == CTA_TUPLE_PROTO)
                    .unwrap();
                let l4: Vec<(u16, Vec<u8>)> = raw::attributes(l4)
                    .unwrap()
                    .into_iter()
                    .map(|(t, v)| (t, v.to_vec()))
                    .collect();
                assert_eq!(
                    l4,
                    [
                        (CTA_PROTO_NUM, vec![echo.proto]),
                        (id, 77u16.to_be_bytes().to_vec()),
                        (type_, vec![want_type]),
                        (code, vec![0]),
                    ],
                    "{echo:?}, tuple {direction}"
                );
            }
            let entry = parse_entry(msgs[0].payload).unwrap().unwrap();
            assert_eq!((entry.orig, entry.reply), (echo, echo.inverse()));
        }
    }

    #[test]
    fn the_assured_bit_is_read_from_the_status() {
        let flow = CtTuple::of("10.244.1.5", "10.96.0.53", 17, 5353, 53);
        let status = |bits: &[u8]| {
            let mut b = MessageBuilder::new(CT_NEW, 0);
            b.header(&[libc::AF_INET as u8, 0, 0, 0]);
            tuple_nest(&mut b, CTA_TUPLE_ORIG, &flow);
            tuple_nest(&mut b, CTA_TUPLE_REPLY, &flow.inverse());
            b.attr(CTA_STATUS, bits);
            let bytes = b.finish(1);
            parse_entry(raw::messages(&bytes).unwrap()[0].payload).map(|e| e.unwrap().assured)
        };
        // IPS_SEEN_REPLY | IPS_CONFIRMED: a lookup answered once.
        assert_eq!(status(&0x0au32.to_be_bytes()), Ok(false));
        // ... | IPS_ASSURED: a stream.
        assert_eq!(status(&0x0eu32.to_be_bytes()), Ok(true));
        assert!(status(&[0, 0, 4]).is_err(), "a status of three bytes");
    }

    #[test]
    fn damaged_entries_are_errors_or_skipped_never_panics() {
        let orig = CtTuple::of("10.244.1.5", "10.244.2.7", 6, 40000, 7100);
        let bytes = message(&orig, &orig.inverse());
        let payload = raw::messages(&bytes).unwrap()[0].payload.to_vec();
        for cut in 0..payload.len() {
            let _ = parse_entry(&payload[..cut]);
        }
        // No tuples at all: nothing to report.
        assert_eq!(parse_entry(&[2, 0, 0, 0]).unwrap(), None);
        // An address of the wrong length.
        let mut b = MessageBuilder::new(CT_NEW, 0);
        b.header(&[2, 0, 0, 0]);
        b.nest_start(CTA_TUPLE_ORIG);
        b.nest_start(CTA_TUPLE_IP);
        b.attr(CTA_IP_V4_SRC, &[10, 0, 0]);
        let bytes = b.finish(1);
        assert!(parse_entry(raw::messages(&bytes).unwrap()[0].payload).is_err());
    }
}
