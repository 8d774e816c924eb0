//! The CNI protocol as a plugin sees it: the `CNI_*` environment, spec versions, error codes
//! and the error JSON printed on stdout.
//!
//! Behaviour follows the reference library's plugin skeleton (`containernetworking/cni`,
//! `pkg/skel`), which upstream's flannel plugin is built on, so runtimes see the same checks
//! and messages.

use std::fmt;

use serde_json::{Map, Value};

/// The newest CNI spec version this plugin implements.
pub const CURRENT_VERSION: &str = "1.1.0";

/// Every spec version accepted in `cniVersion` (the same list as upstream's `version.All`).
pub const SUPPORTED_VERSIONS: [&str; 7] = [
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// Error codes of the CNI spec, plus this plugin's own codes (100 and up).
pub mod code {
    /// The config's `cniVersion` is not supported (or too old for the command).
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    /// A required `CNI_*` variable is missing or invalid, or `CNI_COMMAND` is unknown.
    pub const INVALID_ENV: u32 = 4;
    /// Reading or writing a file failed (stdin, `subnet.env`, the stored delegate config).
    pub const IO_FAILURE: u32 = 5;
    /// stdin is not JSON, or a field has the wrong JSON type.
    pub const DECODING_FAILURE: u32 = 6;
    /// The network config is well-formed JSON but not acceptable (name, delegate, ipam).
    pub const INVALID_NETWORK_CONFIG: u32 = 7;
    /// `CNI_NETNS` is the plugin's own network namespace.
    pub const INVALID_NETNS: u32 = 8;
    /// Transient: flanneld has not written `subnet.env` yet; the runtime retries.
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// STATUS: the plugin cannot serve ADD requests (flanneld is not up on this node).
    pub const PLUGIN_NOT_AVAILABLE: u32 = 50;
    /// Plugin-specific: `subnet.env` exists but its content is invalid or incomplete.
    pub const INVALID_SUBNET_ENV: u32 = 100;
    /// Plugin-specific: the delegate plugin (e.g. `bridge`) is not in `CNI_PATH`.
    pub const DELEGATE_NOT_FOUND: u32 = 101;
    /// Plugin-specific: the delegate could not be run, or failed without a CNI error of its
    /// own, or printed an unusable result.
    pub const DELEGATE_FAILED: u32 = 102;
}

/// A CNI error: printed as JSON on stdout, and the plugin exits non-zero.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniError {
    /// Spec error code (see [`code`]).
    pub code: u32,
    /// Short message.
    pub msg: String,
    /// Longer explanation; omitted from the JSON when empty.
    pub details: String,
}

impl CniError {
    /// An error without details.
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    /// Sets the details.
    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// The error object `{"cniVersion","code","msg","details"}`, indented like the reference
    /// library prints it.
    pub fn to_json(&self, cni_version: &str) -> Vec<u8> {
        let mut obj = Map::new();
        obj.insert("cniVersion".into(), Value::from(cni_version));
        obj.insert("code".into(), Value::from(self.code));
        obj.insert("msg".into(), Value::from(self.msg.as_str()));
        if !self.details.is_empty() {
            obj.insert("details".into(), Value::from(self.details.as_str()));
        }
        pretty(&Value::Object(obj))
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.details.is_empty() {
            write!(f, "{}", self.msg)
        } else {
            write!(f, "{}; {}", self.msg, self.details)
        }
    }
}

impl std::error::Error for CniError {}

/// JSON indented by four spaces (the reference library's `MarshalIndent(.., "", "    ")`).
pub fn pretty(value: &Value) -> Vec<u8> {
    use serde::Serialize as _;
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut out,
        serde_json::ser::PrettyFormatter::with_indent(b"    "),
    );
    // Serializing a Value into a Vec cannot fail.
    let _ = value.serialize(&mut ser);
    out
}

/// The `CNI_COMMAND` verbs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Attach a container.
    Add,
    /// Detach a container.
    Del,
    /// Verify a container's attachment.
    Check,
    /// Report supported spec versions.
    Version,
    /// Garbage-collect stale attachments (spec 1.1).
    Gc,
    /// Report whether the plugin can serve ADD (spec 1.1).
    Status,
}

impl Command {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "VERSION" => Command::Version,
            "GC" => Command::Gc,
            "STATUS" => Command::Status,
            _ => return None,
        })
    }

    /// The verb as written in `CNI_COMMAND`.
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Version => "VERSION",
            Command::Gc => "GC",
            Command::Status => "STATUS",
        }
    }
}

/// The `CNI_*` variables of one invocation (empty string = unset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniEnv {
    /// `CNI_COMMAND`
    pub command: String,
    /// `CNI_CONTAINERID`
    pub container_id: String,
    /// `CNI_NETNS`
    pub netns: String,
    /// `CNI_IFNAME`
    pub ifname: String,
    /// `CNI_ARGS`
    pub args: String,
    /// `CNI_PATH` (colon-separated directories)
    pub path: String,
    /// `CNI_NETNS_OVERRIDE` (`true`/`1` skips the own-namespace check)
    pub netns_override: String,
}

/// Which commands require a variable.
struct Var {
    name: &'static str,
    required_for: &'static [Command],
}

const VARS: [Var; 6] = [
    Var {
        name: "CNI_COMMAND",
        required_for: &[],
    },
    Var {
        name: "CNI_CONTAINERID",
        required_for: &[Command::Add, Command::Check, Command::Del],
    },
    Var {
        name: "CNI_NETNS",
        required_for: &[Command::Add, Command::Check],
    },
    Var {
        name: "CNI_IFNAME",
        required_for: &[Command::Add, Command::Check, Command::Del],
    },
    Var {
        name: "CNI_ARGS",
        required_for: &[],
    },
    Var {
        name: "CNI_PATH",
        required_for: &[
            Command::Add,
            Command::Check,
            Command::Del,
            Command::Gc,
            Command::Status,
        ],
    },
];

impl CniEnv {
    /// Reads the variables through `get` (`std::env::var` in the binary).
    pub fn from_getenv(get: impl Fn(&str) -> Option<String>) -> Self {
        let get = |name: &str| get(name).unwrap_or_default();
        CniEnv {
            command: get("CNI_COMMAND"),
            container_id: get("CNI_CONTAINERID"),
            netns: get("CNI_NETNS"),
            ifname: get("CNI_IFNAME"),
            args: get("CNI_ARGS"),
            path: get("CNI_PATH"),
            netns_override: get("CNI_NETNS_OVERRIDE"),
        }
    }

    fn value(&self, name: &str) -> &str {
        match name {
            "CNI_COMMAND" => &self.command,
            "CNI_CONTAINERID" => &self.container_id,
            "CNI_NETNS" => &self.netns,
            "CNI_IFNAME" => &self.ifname,
            "CNI_ARGS" => &self.args,
            "CNI_PATH" => &self.path,
            _ => "",
        }
    }

    /// Checks the variables the command needs (code 4, `required env variables [..] missing`),
    /// validates the container ID and interface name, and parses the command.
    pub fn validate(&self) -> Result<Command, CniError> {
        let command = Command::parse(&self.command);
        let required = |var: &Var| match command {
            Some(c) => var.required_for.contains(&c),
            None => false,
        };
        let mut missing = Vec::new();
        for var in &VARS {
            let value = self.value(var.name);
            if value.is_empty() {
                if var.name == "CNI_COMMAND" || required(var) {
                    missing.push(var.name);
                }
            } else if required(var) {
                match var.name {
                    "CNI_CONTAINERID" => validate_container_id(value)?,
                    "CNI_IFNAME" => validate_interface_name(value)?,
                    _ => {}
                }
            }
        }
        if !missing.is_empty() {
            return Err(CniError::new(
                code::INVALID_ENV,
                format!("required env variables [{}] missing", missing.join(",")),
            ));
        }
        command.ok_or_else(|| {
            CniError::new(
                code::INVALID_ENV,
                format!("unknown CNI_COMMAND: {}", self.command),
            )
        })
    }

    /// Whether `CNI_NETNS_OVERRIDE` disables the own-namespace check.
    pub fn netns_overridden(&self) -> bool {
        self.netns_override.eq_ignore_ascii_case("true") || self.netns_override == "1"
    }
}

/// `[a-zA-Z0-9][a-zA-Z0-9_.-]*`, the spec's rule for container IDs and network names.
pub fn is_valid_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    match bytes.next() {
        Some(b) if b.is_ascii_alphanumeric() => {}
        _ => return false,
    }
    bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

fn validate_container_id(id: &str) -> Result<(), CniError> {
    if is_valid_name(id) {
        Ok(())
    } else {
        Err(CniError::new(code::INVALID_ENV, "invalid characters in containerID").with_details(id))
    }
}

fn validate_interface_name(name: &str) -> Result<(), CniError> {
    let err = |msg: &str| CniError::new(code::INVALID_ENV, msg);
    if name.len() > 15 {
        return Err(err("interface name is too long")
            .with_details("interface name should be less than 16 characters"));
    }
    if name == "." || name == ".." {
        return Err(err("interface name is . or .."));
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        return Err(err(
            "interface name contains / or : or whitespace characters",
        ));
    }
    Ok(())
}

/// A spec version as `(major, minor, patch)`; `""` means 0.1.0 as in the spec.
pub fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    if v.is_empty() {
        return Some((0, 1, 0));
    }
    let mut parts = v.split('.').map(|p| {
        if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) {
            p.parse::<u64>().ok()
        } else {
            None
        }
    });
    let major = parts.next()??;
    let minor = parts.next().unwrap_or(Some(0))?;
    let patch = parts.next().unwrap_or(Some(0))?;
    if parts.next().is_some() {
        return None;
    }
    Some((major, minor, patch))
}

/// The reply to VERSION: `{"cniVersion":"1.1.0","supportedVersions":[..]}` and a newline.
pub fn version_info() -> Vec<u8> {
    let mut obj = Map::new();
    obj.insert("cniVersion".into(), Value::from(CURRENT_VERSION));
    obj.insert(
        "supportedVersions".into(),
        Value::from(SUPPORTED_VERSIONS.to_vec()),
    );
    let mut out = Value::Object(obj).to_string().into_bytes();
    out.push(b'\n');
    out
}

/// Go's `%q` of a string slice, used in upstream's version mismatch details.
fn quoted_list(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("{s:?}")).collect();
    format!("[{}]", quoted.join(" "))
}

/// Checks a config's `cniVersion` (already defaulted to 0.1.0) against what `command` allows:
/// CHECK needs 0.4.0 or newer, GC and STATUS 1.1.0 or newer, and the version must be one of
/// [`SUPPORTED_VERSIONS`].
pub fn check_version(command: Command, version: &str) -> Result<(), CniError> {
    let minimum = match command {
        Command::Check => Some((0, 4, 0)),
        Command::Gc | Command::Status => Some((1, 1, 0)),
        _ => None,
    };
    if let Some(minimum) = minimum {
        let parsed = parse_version(version).ok_or_else(|| {
            CniError::new(
                code::DECODING_FAILURE,
                format!("failed to parse version {version:?}"),
            )
        })?;
        if parsed < minimum {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!("config version does not allow {}", command.as_str()),
            ));
        }
        let newest = SUPPORTED_VERSIONS
            .iter()
            .filter_map(|v| parse_version(v))
            .max()
            .unwrap_or((0, 0, 0));
        if newest < parsed {
            return Err(CniError::new(
                code::INCOMPATIBLE_VERSION,
                format!("plugin version does not allow {}", command.as_str()),
            ));
        }
    }
    if SUPPORTED_VERSIONS.contains(&version) {
        Ok(())
    } else {
        Err(
            CniError::new(code::INCOMPATIBLE_VERSION, "incompatible CNI versions").with_details(
                format!(
                    "config is {version:?}, plugin supports {}",
                    quoted_list(&SUPPORTED_VERSIONS)
                ),
            ),
        )
    }
}

/// An I/O error as Go prints it (`no such file or directory`), without Rust's
/// ` (os error N)` suffix, so messages match upstream's.
pub fn io_text(err: &std::io::Error) -> String {
    let text = err.to_string();
    let text = match text.find(" (os error ") {
        Some(i) => &text[..i],
        None => &text,
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> CniEnv {
        CniEnv::from_getenv(|name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn missing_variables_are_listed_in_order() {
        let e = env(&[("CNI_COMMAND", "ADD")]).validate().unwrap_err();
        assert_eq!(e.code, code::INVALID_ENV);
        assert_eq!(
            e.msg,
            "required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_IFNAME,CNI_PATH] missing"
        );
        let e = env(&[]).validate().unwrap_err();
        assert_eq!(e.msg, "required env variables [CNI_COMMAND] missing");
        // DEL does not need CNI_NETNS.
        let e = env(&[("CNI_COMMAND", "DEL"), ("CNI_CONTAINERID", "c1")])
            .validate()
            .unwrap_err();
        assert_eq!(
            e.msg,
            "required env variables [CNI_IFNAME,CNI_PATH] missing"
        );
        assert_eq!(
            env(&[("CNI_COMMAND", "VERSION")]).validate(),
            Ok(Command::Version)
        );
        assert_eq!(
            env(&[("CNI_COMMAND", "STATUS"), ("CNI_PATH", "/x")]).validate(),
            Ok(Command::Status)
        );
    }

    #[test]
    fn unknown_command_is_invalid_env() {
        let e = env(&[("CNI_COMMAND", "FROB")]).validate().unwrap_err();
        assert_eq!((e.code, e.msg.as_str()), (4, "unknown CNI_COMMAND: FROB"));
    }

    #[test]
    fn container_id_and_ifname_are_validated() {
        let base = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_NETNS", "/run/netns/x"),
            ("CNI_PATH", "/opt/cni/bin"),
        ];
        let with = |id: &str, ifname: &str| {
            let mut v = base.to_vec();
            v.push(("CNI_CONTAINERID", id));
            v.push(("CNI_IFNAME", ifname));
            env(&v).validate()
        };
        assert_eq!(with("abc-1.2_3", "eth0"), Ok(Command::Add));
        let e = with("../etc", "eth0").unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str(), e.details.as_str()),
            (4, "invalid characters in containerID", "../etc")
        );
        assert_eq!(
            with("c", "0123456789abcdef").unwrap_err().msg,
            "interface name is too long"
        );
        assert_eq!(
            with("c", "..").unwrap_err().msg,
            "interface name is . or .."
        );
        assert_eq!(
            with("c", "eth:0").unwrap_err().msg,
            "interface name contains / or : or whitespace characters"
        );
    }

    #[test]
    fn version_info_matches_upstream() {
        assert_eq!(
            String::from_utf8(version_info()).unwrap(),
            "{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[\"0.1.0\",\"0.2.0\",\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\",\"1.1.0\"]}\n"
        );
    }

    #[test]
    fn version_checks() {
        assert!(check_version(Command::Add, "0.3.1").is_ok());
        assert!(check_version(Command::Add, "0.1.0").is_ok());
        let e = check_version(Command::Add, "9.0.0").unwrap_err();
        assert_eq!(e.code, code::INCOMPATIBLE_VERSION);
        assert_eq!(
            e.details,
            r#"config is "9.0.0", plugin supports ["0.1.0" "0.2.0" "0.3.0" "0.3.1" "0.4.0" "1.0.0" "1.1.0"]"#
        );
        let e = check_version(Command::Check, "0.3.1").unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (1, "config version does not allow CHECK")
        );
        assert!(check_version(Command::Check, "1.0.0").is_ok());
        let e = check_version(Command::Check, "2.0.0").unwrap_err();
        assert_eq!(e.msg, "plugin version does not allow CHECK");
        let e = check_version(Command::Status, "1.0.0").unwrap_err();
        assert_eq!(e.msg, "config version does not allow STATUS");
        assert_eq!(check_version(Command::Check, "x.y").unwrap_err().code, 6);
    }

    #[test]
    fn error_json_has_version_code_msg_details() {
        let e = CniError::new(11, "later").with_details("why");
        let v: Value = serde_json::from_slice(&e.to_json("1.0.0")).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"cniVersion":"1.0.0","code":11,"msg":"later","details":"why"})
        );
        let text = String::from_utf8(CniError::new(7, "bad").to_json("0.3.1")).unwrap();
        assert_eq!(
            text,
            "{\n    \"cniVersion\": \"0.3.1\",\n    \"code\": 7,\n    \"msg\": \"bad\"\n}"
        );
    }

    #[test]
    fn io_errors_read_like_go() {
        let err = std::fs::File::open("/nonexistent/x").unwrap_err();
        assert_eq!(io_text(&err), "no such file or directory");
    }
}
