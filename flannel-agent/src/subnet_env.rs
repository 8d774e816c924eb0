//! `subnet.env`: the file the flannel CNI plugin reads (§4).
//!
//! [`SubnetEnv::render`] produces upstream's exact text; [`write()`] puts it in place atomically
//! (temporary file in the same directory, fsync, rename, fsync of the directory; parent created
//! with mode 0755, file mode 0644 whatever the umask). The readers follow upstream's semantics:
//! the file is parsed as a dotenv file, a value is split on commas, each element parsed as a
//! CIDR and masked, invalid elements skipped; a single-value read with zero or several valid
//! entries gives nothing.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use ipnet::{Ipv4Net, Ipv6Net};

use crate::alloc::PreviousSubnets;
use crate::ip::{self, Subnet};

/// `FLANNEL_NETWORK`
pub const KEY_NETWORK: &str = "FLANNEL_NETWORK";
/// `FLANNEL_SUBNET`
pub const KEY_SUBNET: &str = "FLANNEL_SUBNET";
/// `FLANNEL_IPV6_NETWORK`
pub const KEY_IPV6_NETWORK: &str = "FLANNEL_IPV6_NETWORK";
/// `FLANNEL_IPV6_SUBNET`
pub const KEY_IPV6_SUBNET: &str = "FLANNEL_IPV6_SUBNET";
/// `FLANNEL_MTU`
pub const KEY_MTU: &str = "FLANNEL_MTU";
/// `FLANNEL_IPMASQ`
pub const KEY_IPMASQ: &str = "FLANNEL_IPMASQ";

/// The cluster network and this node's lease subnet of one family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FamilyEnv<N> {
    /// The cluster network (`Network` / `IPv6Network`).
    pub network: N,
    /// The node's lease subnet (network address form, e.g. `10.244.1.0/24`).
    pub subnet: N,
}

/// The content of `subnet.env`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubnetEnv {
    /// Present when IPv4 is enabled.
    pub ipv4: Option<FamilyEnv<Ipv4Net>>,
    /// Present when IPv6 is enabled.
    pub ipv6: Option<FamilyEnv<Ipv6Net>>,
    /// `FLANNEL_MTU`.
    pub mtu: u32,
    /// `FLANNEL_IPMASQ` (the value of `--ip-masq`).
    pub ip_masq: bool,
}

impl SubnetEnv {
    /// The exact file text, e.g.
    /// `FLANNEL_NETWORK=10.42.0.0/16\nFLANNEL_SUBNET=10.42.0.1/24\nFLANNEL_MTU=1450\nFLANNEL_IPMASQ=true\n`.
    /// `FLANNEL_SUBNET` holds the first host of the lease (network address + 1) with the lease
    /// length; IPv6 is written in compressed form.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Some(v4) = &self.ipv4 {
            out.push_str(&format!("{KEY_NETWORK}={}\n", v4.network));
            out.push_str(&format!("{KEY_SUBNET}={}\n", gateway(v4.subnet)));
        }
        if let Some(v6) = &self.ipv6 {
            out.push_str(&format!("{KEY_IPV6_NETWORK}={}\n", v6.network));
            out.push_str(&format!("{KEY_IPV6_SUBNET}={}\n", gateway(v6.subnet)));
        }
        out.push_str(&format!("{KEY_MTU}={}\n", self.mtu));
        out.push_str(&format!("{KEY_IPMASQ}={}\n", self.ip_masq));
        out
    }
}

/// The first host of the subnet (the bridge gateway address).
fn gateway<N: Subnet>(subnet: N) -> N {
    ip::first_host(subnet).unwrap_or(subnet)
}

/// Errors writing or reading `subnet.env`.
#[derive(Debug, thiserror::Error)]
pub enum SubnetEnvError {
    /// A filesystem operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done (`creating directory`, `writing`, …).
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The path has no file name component.
    #[error("invalid subnet file path {0}")]
    InvalidPath(PathBuf),
    /// A line of the file is not `KEY=VALUE`.
    #[error("line {line}: {reason}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SubnetEnvError + use<> {
    let path = path.to_owned();
    move |source| SubnetEnvError::Io { op, path, source }
}

/// Writes `env` to `path` atomically (see the module docs).
pub fn write(path: &Path, env: &SubnetEnv) -> Result<(), SubnetEnvError> {
    write_atomic(path, env.render().as_bytes())
}

/// Atomically replaces `path` with `data`, mode 0644; creates the parent directory (0755).
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), SubnetEnvError> {
    let name = path
        .file_name()
        .ok_or_else(|| SubnetEnvError::InvalidPath(path.to_owned()))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    create_dirs(&dir)?;
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{}.tmp{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let result = write_temp(&tmp, data).and_then(|()| {
        fs::rename(&tmp, path).map_err(io_err("renaming into place", path))?;
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err("syncing directory", &dir))
    });
    if result.is_err() {
        // Best effort: never leave a half-written temporary file behind.
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Creates `dir` and any missing parents with mode 0755 (whatever the umask); existing
/// directories are left as they are.
fn create_dirs(dir: &Path) -> Result<(), SubnetEnvError> {
    let missing: Vec<&Path> = dir.ancestors().take_while(|d| !d.exists()).collect();
    for d in missing.into_iter().rev() {
        match DirBuilder::new().mode(0o755).create(d) {
            Ok(()) => fs::set_permissions(d, fs::Permissions::from_mode(0o755))
                .map_err(io_err("setting mode of", d))?,
            // Created concurrently by someone else: fine.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && d.is_dir() => {}
            Err(e) => return Err(io_err("creating directory", d)(e)),
        }
    }
    if !dir.is_dir() {
        return Err(io_err("creating directory", dir)(
            io::ErrorKind::NotADirectory.into(),
        ));
    }
    Ok(())
}

fn write_temp(tmp: &Path, data: &[u8]) -> Result<(), SubnetEnvError> {
    let _ = fs::remove_file(tmp);
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(tmp)
        .map_err(io_err("creating", tmp))?;
    // The umask may have cleared bits of the creation mode.
    f.set_permissions(fs::Permissions::from_mode(0o644))
        .map_err(io_err("setting mode of", tmp))?;
    f.write_all(data).map_err(io_err("writing", tmp))?;
    f.sync_all().map_err(io_err("syncing", tmp))
}

/// The variables of a dotenv file, in file order (a later duplicate overrides an earlier one).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvFile {
    vars: Vec<(String, String)>,
}

impl EnvFile {
    /// The value of `key` (the last assignment wins).
    pub fn get(&self, key: &str) -> Option<&str> {
        self.vars
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// All assignments in file order.
    pub fn vars(&self) -> &[(String, String)] {
        &self.vars
    }

    /// Parses dotenv text (the subset of `godotenv` that matters here): blank lines and `#`
    /// comments skipped, optional `export ` prefix, `KEY=VALUE` or `KEY: VALUE`, values in
    /// single or double quotes (double quotes understand `\n`, `\"`, `\\`), unquoted values
    /// trimmed and cut at ` #`. Variable expansion and multi-line values are not supported.
    pub fn parse(text: &str) -> Result<Self, SubnetEnvError> {
        let mut vars = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let syntax = |reason: String| SubnetEnvError::Syntax {
                line: i + 1,
                reason,
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let line = line.strip_prefix("export ").unwrap_or(line).trim_start();
            let sep = line
                .find(['=', ':'])
                .ok_or_else(|| syntax(format!("no '=' in {line:?}")))?;
            let key = line[..sep].trim();
            if key.is_empty()
                || !key
                    .chars()
                    .all(|c| c.is_alphanumeric() || matches!(c, '_' | '.' | '-'))
            {
                return Err(syntax(format!("invalid variable name {key:?}")));
            }
            let value = parse_value(line[sep + 1..].trim_start()).map_err(syntax)?;
            vars.push((key.to_owned(), value));
        }
        Ok(EnvFile { vars })
    }

    /// Reads and parses `path`; `Ok(None)` when the file does not exist.
    pub fn read(path: &Path) -> Result<Option<Self>, SubnetEnvError> {
        match fs::read_to_string(path) {
            Ok(text) => Self::parse(&text).map(Some),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("reading", path)(e)),
        }
    }
}

fn parse_value(raw: &str) -> Result<String, String> {
    let mut chars = raw.chars();
    match chars.next() {
        Some(q @ ('"' | '\'')) => {
            let mut out = String::new();
            let mut escaped = false;
            for c in chars {
                if escaped {
                    out.push(match c {
                        'n' => '\n',
                        'r' => '\r',
                        't' => '\t',
                        c => c,
                    });
                    escaped = false;
                } else if c == '\\' && q == '"' {
                    escaped = true;
                } else if c == q {
                    return Ok(out);
                } else {
                    out.push(c);
                }
            }
            Err(format!("unterminated quoted value {raw:?}"))
        }
        _ => {
            let cut = raw.find(" #").map_or(raw, |i| &raw[..i]);
            Ok(cut.trim_end().to_owned())
        }
    }
}

/// Splits a value on commas and parses each element as a CIDR of family `N`, masked; invalid
/// elements (including the other family, which upstream would crash on) are skipped.
pub fn parse_cidr_list<N: Subnet + std::str::FromStr>(value: &str) -> Vec<N> {
    value
        .split(',')
        .filter_map(|s| s.trim().parse::<N>().ok())
        .map(ip::network)
        .collect()
}

/// Upstream `ReadCIDRsFromSubnetFile`: all valid CIDRs of `key`; empty when the file or key is
/// missing or the file does not parse (logged).
pub fn read_cidrs<N: Subnet + std::str::FromStr>(path: &Path, key: &str) -> Vec<N> {
    match EnvFile::read(path) {
        Ok(Some(env)) => env.get(key).map(parse_cidr_list).unwrap_or_default(),
        Ok(None) => Vec::new(),
        Err(e) => {
            tracing::error!(
                "Couldn't fetch previous {key} from subnet file at {}: {e}",
                path.display()
            );
            Vec::new()
        }
    }
}

/// Upstream `ReadCIDRFromSubnetFile`: the single CIDR of `key`; `None` when there is none or
/// more than one (the latter logged).
pub fn read_cidr<N: Subnet + std::str::FromStr>(path: &Path, key: &str) -> Option<N> {
    let mut cidrs = read_cidrs::<N>(path, key);
    match cidrs.len() {
        // Absent on a first start: nothing to report.
        0 => None,
        1 => cidrs.pop(),
        _ => {
            tracing::error!(
                "error reading subnet: more than 1 entry found for key: {key} in file {}",
                path.display()
            );
            None
        }
    }
}

/// The subnets of a previous run (`FLANNEL_SUBNET`, `FLANNEL_IPV6_SUBNET`), for
/// [`crate::alloc::plan`].
pub fn previous_subnets(path: &Path) -> PreviousSubnets {
    PreviousSubnets {
        ipv4: read_cidr(path, KEY_SUBNET),
        ipv6: read_cidr(path, KEY_IPV6_SUBNET),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn v4(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }
    fn v6(s: &str) -> Ipv6Net {
        s.parse().unwrap()
    }

    #[test]
    fn renders_upstream_dual_stack_example() {
        let env = SubnetEnv {
            ipv4: Some(FamilyEnv {
                network: v4("10.42.0.0/16"),
                subnet: v4("10.42.0.0/24"),
            }),
            ipv6: Some(FamilyEnv {
                network: v6("2001:cafe:42::/56"),
                subnet: v6("2001:cafe:42::/64"),
            }),
            mtu: 1450,
            ip_masq: true,
        };
        assert_eq!(
            env.render(),
            "FLANNEL_NETWORK=10.42.0.0/16\nFLANNEL_SUBNET=10.42.0.1/24\nFLANNEL_IPV6_NETWORK=2001:cafe:42::/56\nFLANNEL_IPV6_SUBNET=2001:cafe:42::1/64\nFLANNEL_MTU=1450\nFLANNEL_IPMASQ=true\n"
        );
    }

    #[test]
    fn renders_only_enabled_families() {
        let v4only = SubnetEnv {
            ipv4: Some(FamilyEnv {
                network: v4("10.244.0.0/16"),
                subnet: v4("10.244.1.0/24"),
            }),
            ipv6: None,
            mtu: 1472,
            ip_masq: false,
        };
        assert_eq!(
            v4only.render(),
            "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\nFLANNEL_MTU=1472\nFLANNEL_IPMASQ=false\n"
        );
        let v6only = SubnetEnv {
            ipv4: None,
            ipv6: Some(FamilyEnv {
                network: v6("fd00:10:244::/56"),
                subnet: v6("fd00:10:244:3::/64"),
            }),
            mtu: 1430,
            ip_masq: true,
        };
        assert_eq!(
            v6only.render(),
            "FLANNEL_IPV6_NETWORK=fd00:10:244::/56\nFLANNEL_IPV6_SUBNET=fd00:10:244:3::1/64\nFLANNEL_MTU=1430\nFLANNEL_IPMASQ=true\n"
        );
    }

    #[test]
    fn writes_atomically_with_mode_0644_despite_umask() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/flannel/subnet.env");
        let env = SubnetEnv {
            ipv4: Some(FamilyEnv {
                network: v4("10.1.0.0/16"),
                subnet: v4("10.1.74.0/24"),
            }),
            ipv6: None,
            mtu: 1472,
            ip_masq: false,
        };
        // A restrictive umask must not change the file mode (set for this process only while
        // writing; umask is per process, so restore it right away).
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
        let result = write(&path, &env);
        nix::sys::stat::umask(old);
        result.unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), env.render());
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        for d in [
            path.parent().unwrap(),
            path.parent().unwrap().parent().unwrap(),
        ] {
            assert_eq!(
                fs::metadata(d).unwrap().permissions().mode() & 0o777,
                0o755,
                "{d:?}"
            );
        }
        // Overwrite, and no temporary files are left behind.
        let env2 = SubnetEnv { mtu: 1450, ..env };
        write(&path, &env2).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), env2.render());
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("subnet.env")]);
        // Reading back.
        assert_eq!(
            read_cidr::<Ipv4Net>(&path, KEY_SUBNET),
            Some(v4("10.1.74.0/24"))
        );
        assert_eq!(
            read_cidr::<Ipv4Net>(&path, KEY_NETWORK),
            Some(v4("10.1.0.0/16"))
        );
        assert_eq!(read_cidr::<Ipv6Net>(&path, KEY_IPV6_SUBNET), None);
        assert_eq!(
            previous_subnets(&path),
            PreviousSubnets {
                ipv4: Some(v4("10.1.74.0/24")),
                ipv6: None
            }
        );
    }

    #[test]
    fn write_errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        fs::write(&blocker, "x").unwrap();
        let err = write_atomic(&blocker.join("subnet.env"), b"x")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("creating directory "), "{err}");
        assert!(err.contains("file"), "{err}");
    }

    #[test]
    fn main_test_vectors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("subnet.env");
        fs::write(&path, "FLANNEL_SUBNET=10.244.1.0/24,not-a-cidr,10.244.2.0/24\nFLANNEL_IPV6_SUBNET=fd00::/64,not-a-cidr,fd01::/64\n").unwrap();
        assert_eq!(
            read_cidrs::<Ipv4Net>(&path, KEY_SUBNET),
            vec![v4("10.244.1.0/24"), v4("10.244.2.0/24")]
        );
        assert_eq!(
            read_cidrs::<Ipv6Net>(&path, KEY_IPV6_SUBNET),
            vec![v6("fd00::/64"), v6("fd01::/64")]
        );
        // More than one valid entry: no single value.
        assert_eq!(read_cidr::<Ipv4Net>(&path, KEY_SUBNET), None);
        fs::write(&path, "FLANNEL_SUBNET=not-a-cidr\n").unwrap();
        assert_eq!(read_cidrs::<Ipv4Net>(&path, KEY_SUBNET), vec![]);
        assert_eq!(read_cidr::<Ipv4Net>(&path, KEY_SUBNET), None);
        // Masked; wrong family skipped; missing file empty.
        assert_eq!(
            parse_cidr_list::<Ipv4Net>("10.244.1.1/24"),
            vec![v4("10.244.1.0/24")]
        );
        assert_eq!(
            parse_cidr_list::<Ipv4Net>("fd00::1/64, 10.0.0.1/8"),
            vec![v4("10.0.0.0/8")]
        );
        assert_eq!(
            read_cidrs::<Ipv4Net>(&dir.path().join("missing"), KEY_SUBNET),
            vec![]
        );
    }

    #[test]
    fn dotenv_syntax() {
        let env = EnvFile::parse(
            "# comment\n\nexport A=1\nB = \"x y\\n\" \nC='a#b'\nD=plain # note\nE: colon\nA=2\r\nF=\n",
        )
        .unwrap();
        assert_eq!(env.get("A"), Some("2"));
        assert_eq!(env.get("B"), Some("x y\n"));
        assert_eq!(env.get("C"), Some("a#b"));
        assert_eq!(env.get("D"), Some("plain"));
        assert_eq!(env.get("E"), Some("colon"));
        assert_eq!(env.get("F"), Some(""));
        assert_eq!(env.get("G"), None);
        assert_eq!(env.vars().len(), 7);
        assert_eq!(
            EnvFile::parse("JUSTTEXT").unwrap_err().to_string(),
            "line 1: no '=' in \"JUSTTEXT\""
        );
        assert!(EnvFile::parse("A=\"open").is_err());
        assert!(EnvFile::parse("A B=1").is_err());
    }

    #[test]
    fn unparsable_file_reads_as_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("subnet.env");
        fs::write(&path, "FLANNEL_SUBNET=10.244.1.0/24\ngarbage line\n").unwrap();
        assert_eq!(read_cidrs::<Ipv4Net>(&path, KEY_SUBNET), vec![]);
    }

    #[test]
    fn never_panics_on_random_input() {
        let mut accepted = 0u32;
        use rand::{SeedableRng, rngs::StdRng};
        let seed = "FLANNEL_NETWORK=10.42.0.0/16\nFLANNEL_SUBNET=10.42.0.1/24\nFLANNEL_IPV6_SUBNET=fd00::1/64\nexport X='y'\n";
        let alphabet: Vec<char> = "=:#'\"\\\n \t,./0123456789abcdefFLANNEL_xé"
            .chars()
            .collect();
        let mut rng = StdRng::seed_from_u64(0xe17);
        for _ in 0..3000 {
            let text = crate::test_fuzz::mutate(&mut rng, seed, &alphabet, 8);
            if let Ok(env) = EnvFile::parse(&text) {
                accepted += 1;
                for (_, v) in env.vars() {
                    for n in parse_cidr_list::<Ipv4Net>(v) {
                        assert!(ip::is_canonical(n));
                    }
                    let _ = parse_cidr_list::<Ipv6Net>(v);
                }
            }
        }
        // The mutations must exercise the accepting paths too, not only the errors.
        assert!(accepted >= 300, "only {accepted} inputs accepted");
    }
}
