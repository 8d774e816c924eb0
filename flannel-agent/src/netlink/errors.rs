//! [`NetlinkError`]: the one error type of the netlink layer, with kinds callers can match.
//!
//! Kernel errors arrive as a negative errno in an `NLMSG_ERROR` (or `NLMSG_DONE` for dumps),
//! optionally followed by extended-ack attributes carrying a human-readable message (for
//! example `Unknown device type`). Every error names the operation and the object it was about.

use std::fmt;

use nix::errno::Errno;

/// Errors of the netlink layer.
///
/// Match on the variant to decide what to do: [`NotFound`](Self::NotFound) on a delete is
/// usually success, [`AlreadyExists`](Self::AlreadyExists) on a create means "look at what is
/// there", [`Unsupported`](Self::Unsupported) means the kernel lacks a link type (fall back to
/// another backend), everything else is logged and retried.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// The object does not exist (`ENOENT`, `ESRCH`, `ENODEV`, `EADDRNOTAVAIL`; for
    /// [`route_get`](super::Netlink::route_get) also `ENETUNREACH`/`EHOSTUNREACH`).
    #[error("{op} {object}: not found ({})", describe(*.errno, .message))]
    NotFound {
        /// The operation, e.g. `"delete route"`.
        op: &'static str,
        /// The object, e.g. `"10.244.2.0/24 table 254"`.
        object: String,
        /// The errno reported by the kernel (positive).
        errno: i32,
        /// The kernel's extended-ack message, if any.
        message: Option<String>,
    },
    /// The object already exists (`EEXIST`).
    #[error("{op} {object}: already exists ({})", describe(*.errno, .message))]
    AlreadyExists {
        /// The operation.
        op: &'static str,
        /// The object.
        object: String,
        /// The errno reported by the kernel (positive).
        errno: i32,
        /// The kernel's extended-ack message, if any.
        message: Option<String>,
    },
    /// The kernel has no support for this link type (`EOPNOTSUPP` when creating a link; on
    /// this kernel for example `ipip` and `wireguard`). Callers detect this and fall back.
    #[error(
        "create {kind} link {name}: the kernel lacks the `{kind}` link type (module missing or \
         not built; {})",
        describe(*.errno, .message)
    )]
    Unsupported {
        /// The link kind, e.g. `"wireguard"`.
        kind: String,
        /// The link name that was being created.
        name: String,
        /// The errno reported by the kernel (positive).
        errno: i32,
        /// The kernel's extended-ack message, if any.
        message: Option<String>,
    },
    /// Not allowed (`EPERM`, `EACCES`): the agent needs CAP_NET_ADMIN.
    #[error("{op} {object}: permission denied, CAP_NET_ADMIN is needed ({})", describe(*.errno, .message))]
    Permission {
        /// The operation.
        op: &'static str,
        /// The object.
        object: String,
        /// The errno reported by the kernel (positive).
        errno: i32,
        /// The kernel's extended-ack message, if any.
        message: Option<String>,
    },
    /// The request was rejected before it was sent (bad name, mixed address families, a
    /// destination prefix with host bits, ...).
    #[error("{op}: invalid {field} {value:?}: {reason}")]
    Invalid {
        /// The operation.
        op: &'static str,
        /// The field that is wrong.
        field: &'static str,
        /// The offending value, as text.
        value: String,
        /// Why it is wrong.
        reason: &'static str,
    },
    /// No answer from the kernel in time (a lost acknowledgement, e.g. after a receive-buffer
    /// overrun).
    #[error("{op} {object}: no answer from the kernel within {seconds} s")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The object.
        object: String,
        /// The time waited.
        seconds: u64,
    },
    /// The netlink socket could not be opened or configured, or its background task is gone.
    #[error("netlink socket: {what}")]
    Socket {
        /// What failed.
        what: String,
        /// The I/O error, if there was one.
        #[source]
        source: Option<std::io::Error>,
    },
    /// Any other kernel error, or an answer we could not understand (`errno` is 0 then).
    #[error("{op} {object}: {}", describe(*.errno, .message))]
    Other {
        /// The operation.
        op: &'static str,
        /// The object.
        object: String,
        /// The errno reported by the kernel (positive; 0 when the problem was not an errno).
        errno: i32,
        /// The kernel's extended-ack message, or our description of the problem.
        message: Option<String>,
    },
}

impl NetlinkError {
    /// The kernel errno behind this error (positive), if there is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::NotFound { errno, .. }
            | Self::AlreadyExists { errno, .. }
            | Self::Unsupported { errno, .. }
            | Self::Permission { errno, .. }
            | Self::Other { errno, .. }
                if *errno != 0 =>
            {
                Some(*errno)
            }
            _ => None,
        }
    }

    /// True for [`NotFound`](Self::NotFound).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::NotFound { .. })
    }

    /// True for [`AlreadyExists`](Self::AlreadyExists).
    pub fn is_already_exists(&self) -> bool {
        matches!(self, Self::AlreadyExists { .. })
    }

    /// True for [`Unsupported`](Self::Unsupported).
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Self::Unsupported { .. })
    }

    pub(crate) fn socket(what: impl Into<String>, source: Option<std::io::Error>) -> Self {
        Self::Socket {
            what: what.into(),
            source,
        }
    }
}

/// `ENOENT (No such file or directory): kernel message`.
fn describe(errno: i32, message: &Option<String>) -> String {
    let mut out = if errno == 0 {
        String::new()
    } else {
        let e = Errno::from_raw(errno);
        format!("{e:?}: {}", e.desc())
    };
    if let Some(m) = message {
        if !out.is_empty() {
            out.push_str("; ");
        }
        out.push_str(m);
    }
    if out.is_empty() {
        out.push_str("unknown error");
    }
    out
}

/// What an operation is about, used to build errors. `unsupported_kind` is set when creating a
/// link, so `EOPNOTSUPP` becomes [`NetlinkError::Unsupported`]; `unreachable_is_not_found`
/// is set for route lookups.
#[derive(Debug, Clone)]
pub(crate) struct Ctx {
    pub op: &'static str,
    pub object: String,
    pub create_kind: Option<(String, String)>,
    pub unreachable_is_not_found: bool,
}

impl Ctx {
    pub fn new(op: &'static str, object: impl fmt::Display) -> Self {
        Self {
            op,
            object: object.to_string(),
            create_kind: None,
            unreachable_is_not_found: false,
        }
    }

    /// This request creates a link of `kind` named `name`.
    pub fn creating(mut self, kind: &str, name: &str) -> Self {
        self.create_kind = Some((kind.to_owned(), name.to_owned()));
        self
    }

    /// `ENETUNREACH`/`EHOSTUNREACH` mean "no route" for this request.
    pub fn unreachable_is_not_found(mut self) -> Self {
        self.unreachable_is_not_found = true;
        self
    }

    /// Maps a positive errno plus optional kernel message to an error of the right kind.
    pub fn errno(&self, errno: i32, message: Option<String>) -> NetlinkError {
        let op = self.op;
        let object = self.object.clone();
        let unreachable = self.unreachable_is_not_found
            && matches!(errno, libc::ENETUNREACH | libc::EHOSTUNREACH);
        match errno {
            libc::ENOENT | libc::ESRCH | libc::ENODEV | libc::EADDRNOTAVAIL => {
                NetlinkError::NotFound {
                    op,
                    object,
                    errno,
                    message,
                }
            }
            _ if unreachable => NetlinkError::NotFound {
                op,
                object,
                errno,
                message,
            },
            libc::EEXIST => NetlinkError::AlreadyExists {
                op,
                object,
                errno,
                message,
            },
            libc::EPERM | libc::EACCES => NetlinkError::Permission {
                op,
                object,
                errno,
                message,
            },
            libc::EOPNOTSUPP if self.create_kind.is_some() => {
                let (kind, name) = self.create_kind.clone().unwrap_or_default();
                NetlinkError::Unsupported {
                    kind,
                    name,
                    errno,
                    message,
                }
            }
            _ => NetlinkError::Other {
                op,
                object,
                errno,
                message,
            },
        }
    }

    /// A problem that is not a kernel errno (an unexpected answer).
    pub fn other(&self, message: impl Into<String>) -> NetlinkError {
        NetlinkError::Other {
            op: self.op,
            object: self.object.clone(),
            errno: 0,
            message: Some(message.into()),
        }
    }

    pub fn invalid(
        op: &'static str,
        field: &'static str,
        value: impl fmt::Display,
        reason: &'static str,
    ) -> NetlinkError {
        NetlinkError::Invalid {
            op,
            field,
            value: value.to_string(),
            reason,
        }
    }
}

/// `NLMSGERR_ATTR_MSG`: the extended-ack attribute carrying a NUL-terminated message.
const NLMSGERR_ATTR_MSG: u16 = 1;
/// Length of `struct nlmsghdr`.
const NLMSG_HDRLEN: usize = 16;
const NLM_F_CAPPED: u16 = 0x100;
const NLM_F_ACK_TLVS: u16 = 0x200;

/// Extracts the extended-ack message from the bytes that follow the errno of an `NLMSG_ERROR`
/// (the echoed request header, the echoed payload unless `NLM_F_CAPPED`, then TLVs when
/// `NLM_F_ACK_TLVS`). `flags` are the flags of the error message itself.
pub(crate) fn extack_from_error(after_errno: &[u8], flags: u16) -> Option<String> {
    if flags & NLM_F_ACK_TLVS == 0 || after_errno.len() < NLMSG_HDRLEN {
        return None;
    }
    let offset = if flags & NLM_F_CAPPED != 0 {
        NLMSG_HDRLEN
    } else {
        let len = u32::from_ne_bytes(after_errno[0..4].try_into().ok()?) as usize;
        align4(len)
    };
    extack_from_tlvs(after_errno.get(offset..)?)
}

/// Finds `NLMSGERR_ATTR_MSG` in a run of netlink attributes.
pub(crate) fn extack_from_tlvs(mut tlvs: &[u8]) -> Option<String> {
    while tlvs.len() >= 4 {
        let len = u16::from_ne_bytes([tlvs[0], tlvs[1]]) as usize;
        let kind = u16::from_ne_bytes([tlvs[2], tlvs[3]]) & 0x3fff;
        if len < 4 || len > tlvs.len() {
            return None;
        }
        if kind == NLMSGERR_ATTR_MSG {
            let value = &tlvs[4..len];
            let end = value.iter().position(|b| *b == 0).unwrap_or(value.len());
            let text = String::from_utf8_lossy(&value[..end]).trim().to_owned();
            return (!text.is_empty()).then_some(text);
        }
        tlvs = tlvs.get(align4(len)..)?;
    }
    None
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tlv(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(value);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out
    }

    #[test]
    fn extack_message_is_found_after_a_capped_header() {
        let mut bytes = vec![0u8; 16];
        bytes[0..4].copy_from_slice(&64u32.to_ne_bytes());
        bytes.extend(tlv(2, &8u32.to_ne_bytes())); // NLMSGERR_ATTR_OFFS first
        bytes.extend(tlv(1, b"Unknown device type\0"));
        assert_eq!(
            extack_from_error(&bytes, NLM_F_CAPPED | NLM_F_ACK_TLVS).as_deref(),
            Some("Unknown device type")
        );
        // Without NLM_F_ACK_TLVS there are no attributes to read.
        assert_eq!(extack_from_error(&bytes, NLM_F_CAPPED), None);
    }

    #[test]
    fn extack_message_is_found_after_an_echoed_request() {
        // Echoed request of 22 bytes (header + 6 payload bytes), padded to 24.
        let mut bytes = vec![0u8; 24];
        bytes[0..4].copy_from_slice(&22u32.to_ne_bytes());
        bytes.extend(tlv(1, b"Invalid prefix for given prefix length\0"));
        assert_eq!(
            extack_from_error(&bytes, NLM_F_ACK_TLVS).as_deref(),
            Some("Invalid prefix for given prefix length")
        );
    }

    #[test]
    fn truncated_attributes_are_ignored() {
        let mut bytes = vec![0u8; 16];
        bytes.extend_from_slice(&[40, 0, 1, 0, b'x']);
        assert_eq!(
            extack_from_error(&bytes, NLM_F_CAPPED | NLM_F_ACK_TLVS),
            None
        );
        assert_eq!(extack_from_tlvs(&[]), None);
    }

    #[test]
    fn errnos_map_to_kinds() {
        let ctx = Ctx::new("delete route", "10.0.0.0/24");
        assert!(ctx.errno(libc::ESRCH, None).is_not_found());
        assert!(ctx.errno(libc::ENOENT, None).is_not_found());
        assert!(ctx.errno(libc::EEXIST, None).is_already_exists());
        assert!(matches!(
            ctx.errno(libc::EPERM, None),
            NetlinkError::Permission { .. }
        ));
        // EOPNOTSUPP is only "unsupported link type" when creating a link.
        assert!(matches!(
            ctx.errno(libc::EOPNOTSUPP, None),
            NetlinkError::Other {
                errno: libc::EOPNOTSUPP,
                ..
            }
        ));
        assert!(!ctx.errno(libc::ENETUNREACH, None).is_not_found());
        let create = Ctx::new("create link", "flannel-wg").creating("wireguard", "flannel-wg");
        let err = create.errno(libc::EOPNOTSUPP, Some("Unknown device type".into()));
        assert!(err.is_unsupported());
        let text = err.to_string();
        assert!(text.contains("lacks the `wireguard` link type"), "{text}");
        assert!(text.contains("Unknown device type"), "{text}");
        assert!(text.contains("EOPNOTSUPP"), "{text}");
        let get = Ctx::new("route get", "10.9.9.9").unreachable_is_not_found();
        assert!(get.errno(libc::ENETUNREACH, None).is_not_found());
        assert_eq!(
            get.errno(libc::ENETUNREACH, None).errno(),
            Some(libc::ENETUNREACH)
        );
    }

    #[test]
    fn messages_name_operation_and_object() {
        let err = Ctx::new("replace route", "10.244.2.0/24 table 254")
            .errno(libc::EINVAL, Some("Nexthop has invalid gateway".into()));
        assert_eq!(
            err.to_string(),
            "replace route 10.244.2.0/24 table 254: EINVAL: Invalid argument; Nexthop has invalid gateway"
        );
    }
}
