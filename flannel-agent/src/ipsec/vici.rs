//! The VICI wire format (strongSwan's "Versatile IKE Control Interface"): packets framed by
//! a 32-bit big-endian length, a packet type byte, a name for the named types, then a
//! message of elements.
//!
//! Message elements: `SECTION_START name`, `SECTION_END`, `KEY_VALUE name value`,
//! `LIST_START name`, `LIST_ITEM value`, `LIST_END`; names are 8-bit length prefixed, values
//! 16-bit big-endian length prefixed. [`Message`] keeps the order of its entries (charon
//! cares for some, e.g. authentication rounds).

use std::fmt;

/// `CMD_REQUEST` (named).
pub const CMD_REQUEST: u8 = 0;
/// `CMD_RESPONSE`.
pub const CMD_RESPONSE: u8 = 1;
/// `CMD_UNKNOWN`.
pub const CMD_UNKNOWN: u8 = 2;
/// `EVENT_REGISTER` (named).
pub const EVENT_REGISTER: u8 = 3;
/// `EVENT_UNREGISTER` (named).
pub const EVENT_UNREGISTER: u8 = 4;
/// `EVENT_CONFIRM`.
pub const EVENT_CONFIRM: u8 = 5;
/// `EVENT_UNKNOWN`.
pub const EVENT_UNKNOWN: u8 = 6;
/// `EVENT` (named).
pub const EVENT: u8 = 7;

const SECTION_START: u8 = 1;
const SECTION_END: u8 = 2;
const KEY_VALUE: u8 = 3;
const LIST_START: u8 = 4;
const LIST_ITEM: u8 = 5;
const LIST_END: u8 = 6;

/// The largest packet accepted (charon's own limit is far lower in practice).
pub const MAX_PACKET: usize = 16 << 20;

/// Malformed VICI data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed VICI data: {0}")]
pub struct ViciDecodeError(pub String);

/// Errors building a message that cannot be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot encode VICI {what} of {len} bytes (limit {limit})")]
pub struct ViciEncodeError {
    /// Name or value.
    pub what: &'static str,
    /// Its length.
    pub len: usize,
    /// The limit.
    pub limit: usize,
}

/// A value in a message.
#[derive(Clone, PartialEq, Eq)]
pub enum Value {
    /// A key-value's value (usually text).
    Bytes(Vec<u8>),
    /// A section.
    Section(Message),
    /// A list of values.
    List(Vec<Vec<u8>>),
}

impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Bytes(b) => write!(f, "{:?}", String::from_utf8_lossy(b)),
            Value::Section(m) => m.fmt(f),
            Value::List(items) => f
                .debug_list()
                .entries(items.iter().map(|i| String::from_utf8_lossy(i)))
                .finish(),
        }
    }
}

/// A VICI message: named entries in order.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Message {
    entries: Vec<(String, Value)>,
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|(k, v)| (k, v)))
            .finish()
    }
}

impl Message {
    /// An empty message.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a key-value (builder style).
    pub fn kv(mut self, key: &str, value: impl AsRef<[u8]>) -> Self {
        self.entries
            .push((key.to_owned(), Value::Bytes(value.as_ref().to_vec())));
        self
    }

    /// Adds a section.
    pub fn section(mut self, key: &str, section: Message) -> Self {
        self.entries.push((key.to_owned(), Value::Section(section)));
        self
    }

    /// Adds a list.
    pub fn list<I, T>(mut self, key: &str, items: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: AsRef<[u8]>,
    {
        let items = items.into_iter().map(|i| i.as_ref().to_vec()).collect();
        self.entries.push((key.to_owned(), Value::List(items)));
        self
    }

    /// The entries in order.
    pub fn entries(&self) -> &[(String, Value)] {
        &self.entries
    }

    /// The first value named `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// A key-value as text.
    pub fn get_str(&self, key: &str) -> Option<String> {
        match self.get(key)? {
            Value::Bytes(b) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }

    /// A section.
    pub fn get_section(&self, key: &str) -> Option<&Message> {
        match self.get(key)? {
            Value::Section(m) => Some(m),
            _ => None,
        }
    }

    /// A list as text items.
    pub fn get_list(&self, key: &str) -> Option<Vec<String>> {
        match self.get(key)? {
            Value::List(items) => Some(
                items
                    .iter()
                    .map(|i| String::from_utf8_lossy(i).into_owned())
                    .collect(),
            ),
            _ => None,
        }
    }

    /// Encodes the elements.
    pub fn encode(&self) -> Result<Vec<u8>, ViciEncodeError> {
        let mut out = Vec::new();
        self.encode_into(&mut out)?;
        Ok(out)
    }

    fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), ViciEncodeError> {
        for (key, value) in &self.entries {
            match value {
                Value::Bytes(b) => {
                    out.push(KEY_VALUE);
                    put_name(out, key)?;
                    put_value(out, b)?;
                }
                Value::Section(m) => {
                    out.push(SECTION_START);
                    put_name(out, key)?;
                    m.encode_into(out)?;
                    out.push(SECTION_END);
                }
                Value::List(items) => {
                    out.push(LIST_START);
                    put_name(out, key)?;
                    for item in items {
                        out.push(LIST_ITEM);
                        put_value(out, item)?;
                    }
                    out.push(LIST_END);
                }
            }
        }
        Ok(())
    }

    /// Decodes the elements of a whole message.
    pub fn decode(buf: &[u8]) -> Result<Self, ViciDecodeError> {
        let mut r = Reader { buf, pos: 0 };
        let m = Self::decode_level(&mut r, 0)?;
        if r.pos != buf.len() {
            return Err(ViciDecodeError("unbalanced SECTION_END".into()));
        }
        Ok(m)
    }

    fn decode_level(r: &mut Reader<'_>, depth: usize) -> Result<Self, ViciDecodeError> {
        if depth > 32 {
            return Err(ViciDecodeError("sections nested too deeply".into()));
        }
        let mut m = Message::new();
        while let Some(ty) = r.peek() {
            match ty {
                KEY_VALUE => {
                    r.byte()?;
                    let name = r.name()?;
                    let value = r.value()?;
                    m.entries.push((name, Value::Bytes(value)));
                }
                SECTION_START => {
                    r.byte()?;
                    let name = r.name()?;
                    let inner = Self::decode_level(r, depth + 1)?;
                    if r.byte()? != SECTION_END {
                        return Err(ViciDecodeError(format!("section {name} not closed")));
                    }
                    m.entries.push((name, Value::Section(inner)));
                }
                SECTION_END => {
                    if depth == 0 {
                        return Err(ViciDecodeError("SECTION_END outside a section".into()));
                    }
                    return Ok(m);
                }
                LIST_START => {
                    r.byte()?;
                    let name = r.name()?;
                    let mut items = Vec::new();
                    loop {
                        match r.byte()? {
                            LIST_ITEM => items.push(r.value()?),
                            LIST_END => break,
                            other => {
                                return Err(ViciDecodeError(format!(
                                    "element {other} inside list {name}"
                                )));
                            }
                        }
                    }
                    m.entries.push((name, Value::List(items)));
                }
                other => return Err(ViciDecodeError(format!("unknown element type {other}"))),
            }
        }
        if depth > 0 {
            return Err(ViciDecodeError("message ends inside a section".into()));
        }
        Ok(m)
    }
}

fn put_name(out: &mut Vec<u8>, name: &str) -> Result<(), ViciEncodeError> {
    let len = u8::try_from(name.len()).map_err(|_| ViciEncodeError {
        what: "name",
        len: name.len(),
        limit: 255,
    })?;
    out.push(len);
    out.extend_from_slice(name.as_bytes());
    Ok(())
}

fn put_value(out: &mut Vec<u8>, value: &[u8]) -> Result<(), ViciEncodeError> {
    let len = u16::try_from(value.len()).map_err(|_| ViciEncodeError {
        what: "value",
        len: value.len(),
        limit: 65535,
    })?;
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(value);
    Ok(())
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn peek(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    fn byte(&mut self) -> Result<u8, ViciDecodeError> {
        let b = self
            .peek()
            .ok_or_else(|| ViciDecodeError("truncated".into()))?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&[u8], ViciDecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| ViciDecodeError(format!("truncated: {n} bytes wanted")))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn name(&mut self) -> Result<String, ViciDecodeError> {
        let len = usize::from(self.byte()?);
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ViciDecodeError("name not UTF-8".into()))
    }

    fn value(&mut self) -> Result<Vec<u8>, ViciDecodeError> {
        let len = self.take(2)?;
        let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
        Ok(self.take(len)?.to_vec())
    }
}

/// A VICI packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet {
    /// A command.
    CmdRequest {
        /// The command (`version`, `load-conn`, …).
        command: String,
        /// Its arguments.
        message: Message,
    },
    /// The answer to a command.
    CmdResponse(Message),
    /// The daemon does not know the command.
    CmdUnknown,
    /// Register for an event.
    EventRegister(String),
    /// Unregister from an event.
    EventUnregister(String),
    /// (Un)registration succeeded.
    EventConfirm,
    /// The daemon does not know the event.
    EventUnknown,
    /// An event (e.g. `list-conn` during `list-conns`).
    Event {
        /// The event.
        name: String,
        /// Its content.
        message: Message,
    },
}

impl Packet {
    /// Encodes the packet including the 4-byte length.
    pub fn encode(&self) -> Result<Vec<u8>, ViciEncodeError> {
        let mut body = Vec::new();
        match self {
            Packet::CmdRequest { command, message } => {
                body.push(CMD_REQUEST);
                put_name(&mut body, command)?;
                message.encode_into(&mut body)?;
            }
            Packet::CmdResponse(m) => {
                body.push(CMD_RESPONSE);
                m.encode_into(&mut body)?;
            }
            Packet::CmdUnknown => body.push(CMD_UNKNOWN),
            Packet::EventRegister(n) => {
                body.push(EVENT_REGISTER);
                put_name(&mut body, n)?;
            }
            Packet::EventUnregister(n) => {
                body.push(EVENT_UNREGISTER);
                put_name(&mut body, n)?;
            }
            Packet::EventConfirm => body.push(EVENT_CONFIRM),
            Packet::EventUnknown => body.push(EVENT_UNKNOWN),
            Packet::Event { name, message } => {
                body.push(EVENT);
                put_name(&mut body, name)?;
                message.encode_into(&mut body)?;
            }
        }
        let len = u32::try_from(body.len()).map_err(|_| ViciEncodeError {
            what: "packet",
            len: body.len(),
            limit: MAX_PACKET,
        })?;
        let mut out = Vec::with_capacity(body.len() + 4);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Decodes a packet body (without the length).
    pub fn decode(body: &[u8]) -> Result<Self, ViciDecodeError> {
        let mut r = Reader { buf: body, pos: 0 };
        let ty = r.byte()?;
        let rest = |r: &Reader<'_>| Message::decode(&body[r.pos..]);
        Ok(match ty {
            CMD_REQUEST => {
                let command = r.name()?;
                Packet::CmdRequest {
                    command,
                    message: rest(&r)?,
                }
            }
            CMD_RESPONSE => Packet::CmdResponse(rest(&r)?),
            CMD_UNKNOWN => Packet::CmdUnknown,
            EVENT_REGISTER => Packet::EventRegister(r.name()?),
            EVENT_UNREGISTER => Packet::EventUnregister(r.name()?),
            EVENT_CONFIRM => Packet::EventConfirm,
            EVENT_UNKNOWN => Packet::EventUnknown,
            EVENT => {
                let name = r.name()?;
                Packet::Event {
                    name,
                    message: rest(&r)?,
                }
            }
            other => return Err(ViciDecodeError(format!("unknown packet type {other}"))),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn request_bytes_match_the_protocol() {
        let p = Packet::CmdRequest {
            command: "unload-conn".into(),
            message: Message::new().kv("name", "a"),
        };
        let bytes = p.encode().unwrap();
        let mut want = vec![0, 0, 0, 22, CMD_REQUEST, 11];
        want.extend_from_slice(b"unload-conn");
        want.extend_from_slice(&[KEY_VALUE, 4]);
        want.extend_from_slice(b"name");
        want.extend_from_slice(&[0, 1, b'a']);
        assert_eq!(bytes, want);
        assert_eq!(Packet::decode(&bytes[4..]).unwrap(), p);
    }

    #[test]
    fn nested_sections_and_lists_round_trip() {
        let m = Message::new()
            .section(
                "conn",
                Message::new()
                    .kv("version", "2")
                    .list("local_addrs", ["192.168.10.1"])
                    .section(
                        "children",
                        Message::new()
                            .section("c", Message::new().list("esp_proposals", ["a", "b"])),
                    ),
            )
            .list("empty", Vec::<&str>::new());
        let bytes = m.encode().unwrap();
        assert_eq!(bytes[0], SECTION_START);
        let back = Message::decode(&bytes).unwrap();
        assert_eq!(back, m);
        let conn = back.get_section("conn").unwrap();
        assert_eq!(conn.get_str("version").as_deref(), Some("2"));
        assert_eq!(conn.get_list("local_addrs").unwrap(), ["192.168.10.1"]);
        let esp = conn
            .get_section("children")
            .and_then(|c| c.get_section("c"))
            .and_then(|c| c.get_list("esp_proposals"))
            .unwrap();
        assert_eq!(esp, ["a", "b"]);
        assert_eq!(back.get_list("empty").unwrap(), Vec::<String>::new());
        let ev = Packet::Event {
            name: "list-conn".into(),
            message: m,
        };
        assert_eq!(Packet::decode(&ev.encode().unwrap()[4..]).unwrap(), ev);
        for p in [
            Packet::CmdUnknown,
            Packet::EventConfirm,
            Packet::EventUnknown,
            Packet::EventRegister("x".into()),
            Packet::EventUnregister("x".into()),
            Packet::CmdResponse(Message::new().kv("success", "yes")),
        ] {
            assert_eq!(Packet::decode(&p.encode().unwrap()[4..]).unwrap(), p);
        }
    }

    #[test]
    fn limits_and_garbage() {
        let long = "x".repeat(256);
        assert!(Message::new().kv(&long, "v").encode().is_err());
        assert!(Message::new().kv("k", vec![0u8; 65536]).encode().is_err());
        assert!(Message::decode(&[SECTION_END]).is_err());
        assert!(Message::decode(&[SECTION_START, 1, b'a']).is_err());
        assert!(Message::decode(&[LIST_START, 1, b'a', KEY_VALUE]).is_err());
        assert!(Message::decode(&[KEY_VALUE, 1, b'a', 0, 5, b'x']).is_err());
        assert!(Message::decode(&[9]).is_err());
        assert!(Packet::decode(&[]).is_err());
        assert!(Packet::decode(&[42]).is_err());
        // Every prefix of a valid message is rejected or decodes, never panics.
        let bytes = Message::new()
            .section("s", Message::new().list("l", ["1", "22"]).kv("k", "v"))
            .encode()
            .unwrap();
        for cut in 0..bytes.len() {
            let _ = Message::decode(&bytes[..cut]);
        }
        let deep: Vec<u8> = std::iter::repeat_n([SECTION_START, 0], 40)
            .flatten()
            .collect();
        assert!(Message::decode(&deep).is_err());
    }
}
