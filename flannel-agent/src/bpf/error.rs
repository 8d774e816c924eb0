//! [`BpfError`]: everything that can stop the fast path, worded for the one log line the
//! daemon prints when it falls back to the kernel path.

use std::{io, path::PathBuf};

/// Why the fast path could not be loaded, configured or attached.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    /// The agent was built with `AYA_BUILD_SKIP=1`: it carries no eBPF object.
    #[error("this agent was built without the eBPF object (AYA_BUILD_SKIP=1)")]
    NoObject,
    /// The kernel lacks a feature the programs need.
    #[error("the kernel does not support {what}")]
    Unsupported {
        /// The missing feature, e.g. "TCX links (Linux >= 6.6, this is 5.15.0)".
        what: String,
    },
    /// The pin path is not on a BPF filesystem.
    #[error("{} is not on a BPF filesystem (mount one: mount -t bpf bpf /sys/fs/bpf)", path.display())]
    NotBpffs {
        /// The `--bpf-pin-path` directory (or its closest existing parent).
        path: PathBuf,
    },
    /// A file-system operation on the pin path failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done ("creating", "removing", ...).
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// aya could not parse the object or create its maps.
    #[error("loading the eBPF object: {0}")]
    Load(#[source] Box<aya::EbpfError>),
    /// A program the agent needs is not in the object.
    #[error("program {0} is missing from the eBPF object")]
    MissingProgram(&'static str),
    /// A map the agent needs is not in the object, or has another type.
    #[error("map {name}: {reason}")]
    BadMap {
        /// The map's name.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The verifier (or the kernel) refused a program.
    #[error("program {program} was rejected: {error}{}", log_tail(log))]
    Verifier {
        /// The program.
        program: &'static str,
        /// The kernel's error.
        error: String,
        /// The verifier log (the last lines are part of the message).
        log: String,
    },
    /// A map operation failed.
    #[error("map {map}: {source}")]
    Map {
        /// The map's name.
        map: &'static str,
        /// The error.
        #[source]
        source: Box<aya::maps::MapError>,
    },
    /// Attaching, replacing or pinning a program's link failed.
    #[error("attaching {program} to interface {ifindex}: {reason}")]
    Attach {
        /// The program.
        program: &'static str,
        /// The interface.
        ifindex: u32,
        /// What failed.
        reason: String,
    },
    /// Removing a program's `clsact` filter failed (it stays attached).
    #[error("detaching {program} from interface {ifindex}: {reason}")]
    Detach {
        /// The program.
        program: &'static str,
        /// The interface.
        ifindex: u32,
        /// What failed.
        reason: String,
    },
    /// No interface has this index (in the agent's network namespace).
    #[error("interface index {0} does not exist")]
    NoSuchInterface(u32),
    /// Conntrack could not be reached (handing flows over to it).
    #[error("conntrack: {0}")]
    Conntrack(#[source] crate::netlink::raw::RawError),
    /// A configuration or entry value the programs cannot represent.
    #[error("invalid {field} {value}: {reason}")]
    Invalid {
        /// The field ("vni", "subnet", ...).
        field: &'static str,
        /// Its value.
        value: String,
        /// Why it is invalid.
        reason: &'static str,
    },
}

impl BpfError {
    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        BpfError::Io {
            action,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn map(map: &'static str, source: aya::maps::MapError) -> Self {
        BpfError::Map {
            map,
            source: Box::new(source),
        }
    }
}

/// The last lines of a verifier log, indented, for the error message.
fn log_tail(log: &str) -> String {
    const LINES: usize = 12;
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return String::new();
    }
    let start = lines.len().saturating_sub(LINES);
    let mut out = String::from("; verifier log (last lines):");
    for line in &lines[start..] {
        out.push_str("\n    ");
        out.push_str(line);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifier_errors_carry_the_end_of_the_log() {
        let log: String = (1..=20).map(|i| format!("line {i}\n")).collect();
        let e = BpfError::Verifier {
            program: "tc_from_bridge",
            error: "Permission denied (os error 13)".into(),
            log,
        };
        let text = e.to_string();
        assert!(text.starts_with("program tc_from_bridge was rejected: Permission denied"));
        assert!(text.contains("line 20") && text.contains("line 9"));
        assert!(!text.contains("line 8\n"));
    }
}
