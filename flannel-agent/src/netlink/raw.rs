//! Hand-built netlink messages for the families rtnetlink crates do not cover here: the
//! WireGuard generic netlink family (`crate::wireguard::genl`) and XFRM policies
//! (`crate::ipsec::xfrm`).
//!
//! [`MessageBuilder`] writes a message (header, fixed family header, attributes, nests);
//! [`messages`] and [`attributes`] read them back; [`RawSocket`] sends one request and
//! collects the answers (ACK, a single reply, or a dump up to `NLMSG_DONE`). The socket is
//! blocking: callers run requests on `tokio::task::spawn_blocking`.

use std::io;

use netlink_sys::{Socket, SocketAddr};

/// `NLMSG_ERROR`.
pub const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`.
pub const NLMSG_DONE: u16 = 3;
/// `NLM_F_REQUEST`.
pub const NLM_F_REQUEST: u16 = 0x1;
/// `NLM_F_ACK`.
pub const NLM_F_ACK: u16 = 0x4;
/// `NLM_F_DUMP` (`ROOT | MATCH`).
pub const NLM_F_DUMP: u16 = 0x300;
/// `NLM_F_CREATE`.
pub const NLM_F_CREATE: u16 = 0x400;
/// `NLM_F_EXCL`.
pub const NLM_F_EXCL: u16 = 0x200;
/// `NLA_F_NESTED`.
pub const NLA_F_NESTED: u16 = 1 << 15;
/// Mask of the attribute type without the flag bits.
pub const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | (1 << 14));
/// Size of `struct nlmsghdr`.
pub const NLMSG_HDRLEN: usize = 16;

/// Rounds up to the 4-byte netlink alignment.
pub const fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// Builds one netlink message.
#[derive(Debug, Clone)]
pub struct MessageBuilder {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl MessageBuilder {
    /// A message of `msg_type` with `flags` (length and sequence are filled by
    /// [`finish`](Self::finish)).
    pub fn new(msg_type: u16, flags: u16) -> Self {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&msg_type.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // seq
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it
        MessageBuilder {
            buf,
            nests: Vec::new(),
        }
    }

    /// Appends a fixed header (e.g. `genlmsghdr`, `xfrm_userpolicy_info`), padded to 4.
    pub fn header(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(bytes);
        self.pad();
        self
    }

    fn pad(&mut self) {
        let len = align(self.buf.len());
        self.buf.resize(len, 0);
    }

    /// Appends attribute `ty` with `payload`.
    pub fn attr(&mut self, ty: u16, payload: &[u8]) -> &mut Self {
        let len = u16::try_from(4 + payload.len()).unwrap_or(u16::MAX);
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.pad();
        self
    }

    /// Appends a `u8` attribute.
    pub fn attr_u8(&mut self, ty: u16, v: u8) -> &mut Self {
        self.attr(ty, &[v])
    }

    /// Appends a host-order `u16` attribute.
    pub fn attr_u16(&mut self, ty: u16, v: u16) -> &mut Self {
        self.attr(ty, &v.to_ne_bytes())
    }

    /// Appends a host-order `u32` attribute.
    pub fn attr_u32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.attr(ty, &v.to_ne_bytes())
    }

    /// Appends a NUL-terminated string attribute.
    pub fn attr_str(&mut self, ty: u16, s: &str) -> &mut Self {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.attr(ty, &v)
    }

    /// Opens a nested attribute `ty` (`NLA_F_NESTED` is added); close it with
    /// [`nest_end`](Self::nest_end).
    pub fn nest_start(&mut self, ty: u16) -> &mut Self {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
        self
    }

    /// Closes the innermost open nest.
    pub fn nest_end(&mut self) -> &mut Self {
        if let Some(start) = self.nests.pop() {
            let len = u16::try_from(self.buf.len() - start).unwrap_or(u16::MAX);
            self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        }
        self
    }

    /// Current length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether only the netlink header is there.
    pub fn is_empty(&self) -> bool {
        self.buf.len() <= NLMSG_HDRLEN
    }

    /// The finished message with sequence number `seq` (open nests are closed).
    pub fn finish(mut self, seq: u32) -> Vec<u8> {
        while !self.nests.is_empty() {
            self.nest_end();
        }
        let len = u32::try_from(self.buf.len()).unwrap_or(u32::MAX);
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        self.buf
    }
}

/// One received message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawMessage<'a> {
    /// `nlmsg_type`.
    pub msg_type: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// `nlmsg_seq`.
    pub seq: u32,
    /// Everything after the netlink header.
    pub payload: &'a [u8],
}

/// Malformed netlink data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed netlink data: {0}")]
pub struct Malformed(pub String);

/// Splits a datagram into messages.
pub fn messages(mut buf: &[u8]) -> Result<Vec<RawMessage<'_>>, Malformed> {
    let mut out = Vec::new();
    while buf.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            return Err(Malformed(format!(
                "message length {len} with {} bytes left",
                buf.len()
            )));
        }
        out.push(RawMessage {
            msg_type: u16::from_ne_bytes([buf[4], buf[5]]),
            flags: u16::from_ne_bytes([buf[6], buf[7]]),
            seq: u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]),
            payload: &buf[NLMSG_HDRLEN..len],
        });
        buf = &buf[align(len).min(buf.len())..];
    }
    Ok(out)
}

/// Splits attribute data into `(type without flags, payload)` pairs.
pub fn attributes(mut buf: &[u8]) -> Result<Vec<(u16, &[u8])>, Malformed> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([buf[0], buf[1]]));
        let ty = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return Err(Malformed(format!(
                "attribute {ty} length {len} with {} bytes left",
                buf.len()
            )));
        }
        out.push((ty, &buf[4..len]));
        buf = &buf[align(len).min(buf.len())..];
    }
    Ok(out)
}

/// Reads a host-order `u16` attribute payload.
pub fn get_u16(p: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes(p.get(..2)?.try_into().ok()?))
}

/// Reads a host-order `u32` attribute payload.
pub fn get_u32(p: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(p.get(..4)?.try_into().ok()?))
}

/// Reads a host-order `u64` attribute payload.
pub fn get_u64(p: &[u8]) -> Option<u64> {
    Some(u64::from_ne_bytes(p.get(..8)?.try_into().ok()?))
}

/// Errors of a raw request.
#[derive(Debug, thiserror::Error)]
pub enum RawError {
    /// Socket I/O failed (including creating the socket: `EPROTONOSUPPORT` means the kernel
    /// has no such netlink family).
    #[error("netlink socket: {0}")]
    Io(#[from] io::Error),
    /// The kernel refused the request.
    #[error("{}", io::Error::from_raw_os_error(*.0))]
    Errno(i32),
    /// The answer could not be parsed.
    #[error(transparent)]
    Malformed(#[from] Malformed),
}

impl RawError {
    /// The kernel's errno, if it refused.
    pub fn errno(&self) -> Option<i32> {
        match self {
            RawError::Errno(e) => Some(*e),
            RawError::Io(e) => e.raw_os_error(),
            RawError::Malformed(_) => None,
        }
    }
}

/// A blocking netlink socket of one protocol.
#[derive(Debug)]
pub struct RawSocket {
    socket: Socket,
    seq: u32,
}

impl RawSocket {
    /// Opens and binds a socket of `protocol` (e.g. `NETLINK_GENERIC`, `NETLINK_XFRM`).
    pub fn open(protocol: isize) -> Result<Self, RawError> {
        let mut socket = Socket::new(protocol)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(RawSocket { socket, seq: 0 })
    }

    /// Sends `message` (built without a sequence number) and returns the payloads of the
    /// answers of type other than ERROR/DONE, with their types. A request with `NLM_F_DUMP`
    /// collects until `NLMSG_DONE`; any other until the ACK (set `NLM_F_ACK`) or an error.
    pub fn request(&mut self, message: MessageBuilder) -> Result<Vec<(u16, Vec<u8>)>, RawError> {
        let mut out = Vec::new();
        self.request_each(message, |ty, payload| out.push((ty, payload.to_vec())))?;
        Ok(out)
    }

    /// [`request`](Self::request) handing each answer's type and payload to `each` as it
    /// arrives instead of collecting them (a dump of a large table need not be held whole).
    pub fn request_each(
        &mut self,
        message: MessageBuilder,
        mut each: impl FnMut(u16, &[u8]),
    ) -> Result<(), RawError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let bytes = message.finish(seq);
        let flags = u16::from_ne_bytes([bytes[6], bytes[7]]);
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        self.socket.send(&bytes, 0)?;
        loop {
            let (datagram, _) = self.socket.recv_from_full()?;
            for m in messages(&datagram)? {
                if m.seq != seq {
                    continue;
                }
                match m.msg_type {
                    NLMSG_ERROR => {
                        let code = m
                            .payload
                            .get(..4)
                            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                            .ok_or_else(|| Malformed("short NLMSG_ERROR".into()))?;
                        if code != 0 {
                            return Err(RawError::Errno(-code));
                        }
                        return Ok(());
                    }
                    NLMSG_DONE => return Ok(()),
                    ty => {
                        each(ty, m.payload);
                        if !dump && flags & NLM_F_ACK == 0 {
                            return Ok(());
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn build_and_parse_round_trip() {
        let mut b = MessageBuilder::new(0x20, NLM_F_REQUEST | NLM_F_ACK);
        b.header(&[1, 1, 0, 0]);
        b.attr_str(2, "wg0");
        b.nest_start(8);
        b.nest_start(0);
        b.attr_u16(6, 51820);
        b.nest_end();
        b.nest_end();
        b.attr_u8(3, 7);
        let bytes = b.finish(9);
        assert_eq!(bytes.len() % 4, 0);
        let msgs = messages(&bytes).unwrap();
        assert_eq!(msgs.len(), 1);
        let m = msgs[0];
        assert_eq!((m.msg_type, m.flags, m.seq), (0x20, 5, 9));
        assert_eq!(&m.payload[..4], &[1, 1, 0, 0]);
        let attrs = attributes(&m.payload[4..]).unwrap();
        assert_eq!(attrs.len(), 3);
        assert_eq!(attrs[0], (2, &b"wg0\0"[..]));
        assert_eq!(attrs[1].0, 8);
        let inner = attributes(attrs[1].1).unwrap();
        assert_eq!(inner.len(), 1);
        let leaf = attributes(inner[0].1).unwrap();
        assert_eq!(get_u16(leaf[0].1), Some(51820));
        assert_eq!(attrs[2], (3, &[7u8][..]));
    }

    #[test]
    fn truncated_input_is_an_error_not_a_panic() {
        let mut b = MessageBuilder::new(1, 0);
        b.attr_u32(1, 5);
        let bytes = b.finish(1);
        for cut in 0..bytes.len() {
            let _ = messages(&bytes[..cut]);
            let _ = attributes(&bytes[NLMSG_HDRLEN.min(cut)..cut]);
        }
        assert!(messages(&bytes[..bytes.len() - 1]).is_err());
        assert!(attributes(&[8, 0, 1, 0, 0]).is_err());
    }
}
