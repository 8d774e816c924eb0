//! XFRM through netlink (`NETLINK_XFRM`): the three policies per remote subnet that send
//! pod traffic into the ESP tunnel (charon runs with `install_policy = no`, as upstream), and
//! the probe that tells whether this kernel can do ESP at all.
//!
//! Per remote lease (upstream 2.6), template ESP tunnel mode, reqid [`REQID`]:
//! * `out`: local subnet → remote subnet, template local public IP → remote public IP;
//! * `in` and `fwd`: remote subnet → local subnet, template remote → local.
//!
//! Policies are written with `XFRM_MSG_UPDPOLICY` (create or update), listed with a dump and
//! recognised as ours by reqid [`REQID`] and ESP tunnel templates touching the local subnet;
//! stale ones are deleted (upstream leaves them behind across restarts).
//!
//! The structures are laid out as in `include/uapi/linux/xfrm.h` (x86-64 and other LP64
//! targets: `xfrm_selector` 56 bytes, `xfrm_userpolicy_info` 168, `xfrm_user_tmpl` 64,
//! `xfrm_userpolicy_id` 64, `xfrm_usersa_info` 224, `xfrm_usersa_id` 24).

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    sync::{Arc, Mutex},
};

use ipnet::Ipv4Net;

use crate::netlink::raw::{
    MessageBuilder, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, RawError, RawSocket, attributes,
};

/// `NETLINK_XFRM`.
pub const NETLINK_XFRM: isize = 6;
/// The reqid upstream's policies and charon's child SAs share.
pub const REQID: u32 = 11;

const XFRM_MSG_NEWSA: u16 = 16;
const XFRM_MSG_DELSA: u16 = 17;
const XFRM_MSG_DELPOLICY: u16 = 20;
const XFRM_MSG_GETPOLICY: u16 = 21;
const XFRM_MSG_UPDPOLICY: u16 = 25;
const XFRMA_ALG_AUTH: u16 = 1;
const XFRMA_ALG_CRYPT: u16 = 2;
const XFRMA_TMPL: u16 = 5;
const IPPROTO_ESP: u8 = 50;
const XFRM_MODE_TUNNEL: u8 = 1;
const AF_INET: u16 = 2;
const XFRM_INF: u64 = u64::MAX;

const SELECTOR_LEN: usize = 56;
const POLICY_INFO_LEN: usize = 168;
const TMPL_LEN: usize = 64;
const POLICY_ID_LEN: usize = 64;
const SA_INFO_LEN: usize = 224;
const SA_ID_LEN: usize = 24;

/// A policy direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dir {
    /// `XFRM_POLICY_IN`.
    In = 0,
    /// `XFRM_POLICY_OUT`.
    Out = 1,
    /// `XFRM_POLICY_FWD`.
    Fwd = 2,
}

impl Dir {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Dir::In),
            1 => Some(Dir::Out),
            2 => Some(Dir::Fwd),
            _ => None,
        }
    }
}

/// One ESP tunnel policy (the fields flannel sets).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Policy {
    /// Direction.
    pub dir: Dir,
    /// Selector source.
    pub src: Ipv4Net,
    /// Selector destination.
    pub dst: Ipv4Net,
    /// Template (tunnel) source.
    pub tmpl_src: Ipv4Addr,
    /// Template (tunnel) destination.
    pub tmpl_dst: Ipv4Addr,
    /// Template reqid.
    pub reqid: u32,
}

/// The three policies for a remote subnet (upstream 2.6).
pub fn policies_for(
    local_subnet: Ipv4Net,
    local_ip: Ipv4Addr,
    remote_subnet: Ipv4Net,
    remote_ip: Ipv4Addr,
) -> [Policy; 3] {
    let out = Policy {
        dir: Dir::Out,
        src: local_subnet,
        dst: remote_subnet,
        tmpl_src: local_ip,
        tmpl_dst: remote_ip,
        reqid: REQID,
    };
    let inbound = Policy {
        dir: Dir::In,
        src: remote_subnet,
        dst: local_subnet,
        tmpl_src: remote_ip,
        tmpl_dst: local_ip,
        reqid: REQID,
    };
    [
        out,
        inbound,
        Policy {
            dir: Dir::Fwd,
            ..inbound
        },
    ]
}

fn addr16(a: Ipv4Addr) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&a.octets());
    b
}

fn selector(src: Ipv4Net, dst: Ipv4Net) -> [u8; SELECTOR_LEN] {
    let mut s = [0u8; SELECTOR_LEN];
    s[0..16].copy_from_slice(&addr16(dst.network()));
    s[16..32].copy_from_slice(&addr16(src.network()));
    s[40..42].copy_from_slice(&AF_INET.to_ne_bytes());
    s[42] = dst.prefix_len();
    s[43] = src.prefix_len();
    s
}

fn lifetime_cfg() -> [u8; 64] {
    let mut b = [0u8; 64];
    // Byte and packet limits unlimited, as iproute2 sets them; time limits 0 (none).
    for i in 0..4 {
        b[i * 8..i * 8 + 8].copy_from_slice(&XFRM_INF.to_ne_bytes());
    }
    b
}

fn tmpl(p: &Policy) -> [u8; TMPL_LEN] {
    let mut t = [0u8; TMPL_LEN];
    // xfrm_id { daddr[16], spi u32, proto u8 } padded to 24
    t[0..16].copy_from_slice(&addr16(p.tmpl_dst));
    t[20] = IPPROTO_ESP;
    t[24..26].copy_from_slice(&AF_INET.to_ne_bytes());
    t[28..44].copy_from_slice(&addr16(p.tmpl_src));
    t[44..48].copy_from_slice(&p.reqid.to_ne_bytes());
    t[48] = XFRM_MODE_TUNNEL;
    // aalgos/ealgos/calgos: any.
    t[52..56].copy_from_slice(&u32::MAX.to_ne_bytes());
    t[56..60].copy_from_slice(&u32::MAX.to_ne_bytes());
    t[60..64].copy_from_slice(&u32::MAX.to_ne_bytes());
    t
}

/// The `XFRM_MSG_UPDPOLICY` message for `p`.
pub fn encode_update(p: &Policy) -> MessageBuilder {
    let mut info = [0u8; POLICY_INFO_LEN];
    info[..SELECTOR_LEN].copy_from_slice(&selector(p.src, p.dst));
    info[56..120].copy_from_slice(&lifetime_cfg());
    info[160] = p.dir as u8;
    let mut m = MessageBuilder::new(XFRM_MSG_UPDPOLICY, NLM_F_REQUEST | NLM_F_ACK);
    m.header(&info);
    m.attr(XFRMA_TMPL, &tmpl(p));
    m
}

/// The `XFRM_MSG_DELPOLICY` message for `p` (by selector and direction).
pub fn encode_delete(p: &Policy) -> MessageBuilder {
    let mut id = [0u8; POLICY_ID_LEN];
    id[..SELECTOR_LEN].copy_from_slice(&selector(p.src, p.dst));
    id[60] = p.dir as u8;
    let mut m = MessageBuilder::new(XFRM_MSG_DELPOLICY, NLM_F_REQUEST | NLM_F_ACK);
    m.header(&id);
    m
}

fn v4_of(b: &[u8]) -> Option<Ipv4Addr> {
    Some(Ipv4Addr::new(
        *b.first()?,
        *b.get(1)?,
        *b.get(2)?,
        *b.get(3)?,
    ))
}

/// Decodes a policy dump entry; `None` for anything that is not an IPv4 ESP tunnel policy
/// with one template.
pub fn decode_policy(payload: &[u8]) -> Option<Policy> {
    let info = payload.get(..POLICY_INFO_LEN)?;
    let family = u16::from_ne_bytes([info[40], info[41]]);
    if family != AF_INET {
        return None;
    }
    let dst = Ipv4Net::new(v4_of(&info[0..4])?, info[42]).ok()?;
    let src = Ipv4Net::new(v4_of(&info[16..20])?, info[43]).ok()?;
    let dir = Dir::from_u8(info[160])?;
    let attrs = attributes(payload.get(POLICY_INFO_LEN..)?).ok()?;
    let t = attrs.iter().find(|(ty, _)| *ty == XFRMA_TMPL)?.1;
    if t.len() != TMPL_LEN || t[20] != IPPROTO_ESP || t[48] != XFRM_MODE_TUNNEL {
        return None;
    }
    Some(Policy {
        dir,
        src,
        dst,
        tmpl_src: v4_of(&t[28..32])?,
        tmpl_dst: v4_of(&t[0..4])?,
        reqid: u32::from_ne_bytes(t[44..48].try_into().ok()?),
    })
}

/// Errors of XFRM operations.
#[derive(Debug, thiserror::Error)]
pub enum XfrmError {
    /// The kernel has no XFRM netlink interface.
    #[error("the kernel has no XFRM netlink interface (CONFIG_XFRM_USER): {0}")]
    NoXfrm(RawError),
    /// An operation failed.
    #[error("XFRM {op}: {source}")]
    Op {
        /// What was done.
        op: String,
        /// The kernel's answer.
        #[source]
        source: RawError,
    },
}

/// Why ESP cannot run here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EspUnavailable {
    /// No XFRM netlink interface.
    #[error("the kernel has no XFRM netlink interface (CONFIG_XFRM_USER): {0}")]
    NoXfrm(String),
    /// XFRM is there but ESP states cannot be created.
    #[error(
        "the kernel cannot create ESP security associations ({0}); load the esp4 module (and \
         the ciphers of the ESP proposal) or choose another backend"
    )]
    NoEsp(String),
}

/// XFRM access on one netlink socket, opened in the calling thread's network namespace.
#[derive(Debug, Clone)]
pub struct Xfrm {
    socket: Arc<Mutex<RawSocket>>,
}

impl Xfrm {
    /// Opens the socket.
    pub fn open() -> Result<Self, XfrmError> {
        let socket = RawSocket::open(NETLINK_XFRM).map_err(XfrmError::NoXfrm)?;
        Ok(Xfrm {
            socket: Arc::new(Mutex::new(socket)),
        })
    }

    async fn run<T: Send + 'static>(
        &self,
        op: String,
        f: impl FnOnce(&mut RawSocket) -> Result<T, RawError> + Send + 'static,
    ) -> Result<T, XfrmError> {
        let socket = self.socket.clone();
        let op2 = op.clone();
        tokio::task::spawn_blocking(move || {
            let mut s = socket.lock().map_err(|_| XfrmError::Op {
                op: op2.clone(),
                source: RawError::Io(std::io::Error::other("socket lock poisoned")),
            })?;
            f(&mut s).map_err(|source| XfrmError::Op { op: op2, source })
        })
        .await
        .map_err(|e| XfrmError::Op {
            op,
            source: RawError::Io(std::io::Error::other(e.to_string())),
        })?
    }

    /// Creates or updates `p`.
    pub async fn update(&self, p: Policy) -> Result<(), XfrmError> {
        self.run(format!("update policy {p:?}"), move |s| {
            s.request(encode_update(&p)).map(|_| ())
        })
        .await
    }

    /// Deletes `p` (a missing policy is not an error).
    pub async fn delete(&self, p: Policy) -> Result<(), XfrmError> {
        self.run(format!("delete policy {p:?}"), move |s| {
            match s.request(encode_delete(&p)) {
                Err(e) if e.errno() == Some(libc::ENOENT) => Ok(()),
                other => other.map(|_| ()),
            }
        })
        .await
    }

    /// Lists the IPv4 ESP tunnel policies.
    pub async fn list(&self) -> Result<BTreeSet<Policy>, XfrmError> {
        let answers = self
            .run("list policies".into(), |s| {
                let mut m = MessageBuilder::new(XFRM_MSG_GETPOLICY, NLM_F_REQUEST | NLM_F_DUMP);
                m.header(&[0u8; POLICY_ID_LEN]);
                s.request(m)
            })
            .await?;
        Ok(answers
            .iter()
            .filter(|(ty, _)| *ty == crate::ipsec::xfrm::XFRM_MSG_NEWPOLICY)
            .filter_map(|(_, p)| decode_policy(p))
            .collect())
    }

    /// Whether ESP works: creates an ESP tunnel SA between two TEST-NET-1 addresses
    /// (AES-CBC + HMAC-SHA256) and deletes it again.
    pub async fn probe_esp(&self) -> Result<(), EspUnavailable> {
        let spi: u32 = 0x0f1a_0000 | (std::process::id() & 0xffff);
        let src = Ipv4Addr::new(192, 0, 2, 1);
        let dst = Ipv4Addr::new(192, 0, 2, 2);
        let added = self
            .run("probe ESP".into(), move |s| {
                s.request(encode_probe_sa(src, dst, spi)).map(|_| ())
            })
            .await;
        match added {
            Ok(()) => {
                let _ = self
                    .run("remove the ESP probe".into(), move |s| {
                        s.request(encode_delete_sa(dst, spi)).map(|_| ())
                    })
                    .await;
                Ok(())
            }
            Err(XfrmError::Op { source, .. }) | Err(XfrmError::NoXfrm(source)) => {
                let why = match source.errno() {
                    Some(libc::EPROTONOSUPPORT) => {
                        format!("{source}: the kernel has no ESP transform")
                    }
                    Some(libc::ENOSYS) | Some(libc::ENOENT) => {
                        format!("{source}: AES-CBC or HMAC-SHA256 is missing")
                    }
                    _ => source.to_string(),
                };
                Err(EspUnavailable::NoEsp(why))
            }
        }
    }
}

/// `XFRM_MSG_NEWPOLICY` (what a policy dump answers with).
pub const XFRM_MSG_NEWPOLICY: u16 = 19;

fn algo(name: &str, key: &[u8]) -> Vec<u8> {
    let mut v = vec![0u8; 64];
    v[..name.len().min(63)].copy_from_slice(&name.as_bytes()[..name.len().min(63)]);
    let bits = u32::try_from(key.len() * 8).unwrap_or(0);
    v.extend_from_slice(&bits.to_ne_bytes());
    v.extend_from_slice(key);
    v
}

/// The probe SA (see [`Xfrm::probe_esp`]).
pub fn encode_probe_sa(src: Ipv4Addr, dst: Ipv4Addr, spi: u32) -> MessageBuilder {
    let mut info = [0u8; SA_INFO_LEN];
    // sel stays zero (any); id { daddr, spi (network order), proto }
    info[40..42].copy_from_slice(&AF_INET.to_ne_bytes()); // sel.family
    info[56..72].copy_from_slice(&addr16(dst));
    info[72..76].copy_from_slice(&spi.to_be_bytes());
    info[76] = IPPROTO_ESP;
    info[80..96].copy_from_slice(&addr16(src));
    info[96..160].copy_from_slice(&lifetime_cfg());
    info[212..214].copy_from_slice(&AF_INET.to_ne_bytes());
    info[214] = XFRM_MODE_TUNNEL;
    let mut m = MessageBuilder::new(XFRM_MSG_NEWSA, NLM_F_REQUEST | NLM_F_ACK);
    m.header(&info);
    m.attr(XFRMA_ALG_CRYPT, &algo("cbc(aes)", &[0x42; 16]));
    m.attr(XFRMA_ALG_AUTH, &algo("hmac(sha256)", &[0x24; 32]));
    m
}

/// Deletes the probe SA.
pub fn encode_delete_sa(dst: Ipv4Addr, spi: u32) -> MessageBuilder {
    let mut id = [0u8; SA_ID_LEN];
    id[0..16].copy_from_slice(&addr16(dst));
    id[16..20].copy_from_slice(&spi.to_be_bytes());
    id[20..22].copy_from_slice(&AF_INET.to_ne_bytes());
    id[22] = IPPROTO_ESP;
    let mut m = MessageBuilder::new(XFRM_MSG_DELSA, NLM_F_REQUEST | NLM_F_ACK);
    m.header(&id);
    m
}

/// Whether `p` is one of the policies this node's ipsec backend manages: reqid [`REQID`]
/// and the local subnet on the side facing this node.
pub fn is_ours(p: &Policy, local_subnet: Ipv4Net, local_ip: IpAddr) -> bool {
    p.reqid == REQID
        && match p.dir {
            Dir::Out => p.src == local_subnet && IpAddr::V4(p.tmpl_src) == local_ip,
            Dir::In | Dir::Fwd => p.dst == local_subnet && IpAddr::V4(p.tmpl_dst) == local_ip,
        }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;
    use crate::netlink::raw::messages;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    #[test]
    fn three_policies_like_upstream() {
        let [out, inb, fwd] = policies_for(
            net("10.244.1.0/24"),
            Ipv4Addr::new(192, 168, 10, 1),
            net("10.244.2.0/24"),
            Ipv4Addr::new(192, 168, 10, 2),
        );
        assert_eq!(
            (out.dir, out.src, out.dst),
            (Dir::Out, net("10.244.1.0/24"), net("10.244.2.0/24"))
        );
        assert_eq!(
            (out.tmpl_src, out.tmpl_dst),
            (
                Ipv4Addr::new(192, 168, 10, 1),
                Ipv4Addr::new(192, 168, 10, 2)
            )
        );
        assert_eq!(
            (inb.dir, inb.src, inb.dst),
            (Dir::In, net("10.244.2.0/24"), net("10.244.1.0/24"))
        );
        assert_eq!(
            (inb.tmpl_src, inb.tmpl_dst),
            (
                Ipv4Addr::new(192, 168, 10, 2),
                Ipv4Addr::new(192, 168, 10, 1)
            )
        );
        assert_eq!(
            fwd,
            Policy {
                dir: Dir::Fwd,
                ..inb
            }
        );
        assert!([out, inb, fwd].iter().all(|p| p.reqid == 11));
        let local = IpAddr::V4(Ipv4Addr::new(192, 168, 10, 1));
        assert!(
            [out, inb, fwd]
                .iter()
                .all(|p| is_ours(p, net("10.244.1.0/24"), local))
        );
        assert!(!is_ours(&out, net("10.244.9.0/24"), local));
    }

    #[test]
    fn update_message_decodes_back() {
        let [out, ..] = policies_for(
            net("10.244.1.0/24"),
            Ipv4Addr::new(192, 168, 10, 1),
            net("10.244.2.0/24"),
            Ipv4Addr::new(192, 168, 10, 2),
        );
        let bytes = encode_update(&out).finish(1);
        let m = messages(&bytes).unwrap()[0];
        assert_eq!(m.msg_type, XFRM_MSG_UPDPOLICY);
        assert_eq!(m.payload.len(), POLICY_INFO_LEN + 4 + TMPL_LEN);
        // Selector: daddr first, then saddr, family at 40, prefix lengths at 42/43.
        assert_eq!(&m.payload[0..4], &[10, 244, 2, 0]);
        assert_eq!(&m.payload[16..20], &[10, 244, 1, 0]);
        assert_eq!((m.payload[42], m.payload[43]), (24, 24));
        assert_eq!(decode_policy(m.payload), Some(out));
        let del = encode_delete(&out).finish(2);
        let d = messages(&del).unwrap()[0];
        assert_eq!(d.payload.len(), POLICY_ID_LEN);
        assert_eq!(d.payload[60], Dir::Out as u8);
        assert_eq!(decode_policy(&[0; 10]), None);
    }

    #[test]
    fn probe_sa_layout() {
        let bytes = encode_probe_sa(
            Ipv4Addr::new(192, 0, 2, 1),
            Ipv4Addr::new(192, 0, 2, 2),
            0x0f1a0001,
        )
        .finish(1);
        let m = messages(&bytes).unwrap()[0];
        assert_eq!(m.msg_type, XFRM_MSG_NEWSA);
        assert_eq!(&m.payload[56..60], &[192, 0, 2, 2]);
        assert_eq!(&m.payload[72..76], &[0x0f, 0x1a, 0x00, 0x01]);
        assert_eq!(m.payload[76], IPPROTO_ESP);
        let attrs = attributes(&m.payload[SA_INFO_LEN..]).unwrap();
        assert_eq!(attrs.len(), 2);
        assert_eq!(&attrs[0].1[..8], b"cbc(aes)");
        assert_eq!(
            u32::from_ne_bytes(attrs[0].1[64..68].try_into().unwrap()),
            128
        );
    }
}
