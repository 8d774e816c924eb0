//! The error type of the traffic module.

use std::io;

/// Everything that can go wrong while generating, reading or applying traffic rules.
#[derive(Debug, thiserror::Error)]
pub enum TrafficError {
    /// A caller-supplied value is unusable (wrong address family, unsupported prefix, ...).
    #[error("invalid {field} {value}: {reason}")]
    InvalidInput {
        /// The name of the offending input, e.g. `subnet`.
        field: &'static str,
        /// The value as given.
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// A command could not be started (binary missing, nsenter failure, ...).
    #[error("cannot run `{command}`: {source}")]
    Spawn {
        /// The command line.
        command: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A command ran and failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Exit status as text (`exit status 1`, `signal 9`).
        status: String,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// The output of a command could not be understood.
    #[error("cannot parse the output of `{command}`: {detail}")]
    Parse {
        /// The command whose output was parsed.
        command: String,
        /// What was wrong.
        detail: String,
    },
    /// Rules were applied but reading them back still differs from the desired set, so the
    /// tool renders rules differently from what this module expects (an unknown version).
    /// Reported instead of rewriting the rules on every resync.
    #[error(
        "{what}: rules applied but read back differently; expected {expected:?}, found {found:?}"
    )]
    Unconverged {
        /// Which chain or table.
        what: String,
        /// The rules we wrote.
        expected: Vec<String>,
        /// The rules read back.
        found: Vec<String>,
    },
}
