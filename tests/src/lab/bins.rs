//! Finding this workspace's binaries (`flannel-agent`, the CNI plugin `flannel`).
//!
//! Tests build them through cargo, which is a no-op when they are up to date, because
//! `cargo test -p flannel-tests` does not build other packages' binaries and a file lying in
//! `target/` may be stale. The lab binary looks next to itself (where `cargo xtask build`
//! puts everything) unless given a path.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::OnceLock,
};

use anyhow::{Context as _, Result, bail};

/// The CNI plugin's binary name (package `flannel-cni`).
pub const CNI_PLUGIN: &str = "flannel";
/// The agent's binary name (package `flannel-agent`).
pub const AGENT: &str = "flannel-agent";
/// The lab's binary name (package `flannel-tests`), which also carries the benchmarks' own
/// tools (`flannel-lab rr`, `flannel-lab crr`).
pub const LAB: &str = "flannel-lab";
/// Where Debian's containernetworking-plugins live (`bridge`, `host-local`, `loopback`).
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// `<dir of the running executable>/<name>`, also looking one level up (test executables
/// live in `target/<profile>/deps`).
pub fn sibling(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    exe.ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// The target directory (`.../target`) above the running executable, found by its
/// `CACHEDIR.TAG`.
pub fn target_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    exe.ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").exists())
        .map(Path::to_path_buf)
}

/// Builds `bin` of `package` with cargo into the target directory and profile of the running
/// executable and returns its path. `env_override` names an environment variable that, when
/// set, is returned instead (e.g. `FLANNEL_AGENT_BIN=/usr/local/bin/flannel-agent`).
pub fn cargo_build(package: &str, bin: &str, env_override: &str) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(env_override) {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe().context("current_exe")?;
    let target = target_dir().context("no cargo target directory above the executable")?;
    // <target>/[<triple>/]<profile>/[deps/]<exe>
    let profile_dir = exe
        .ancestors()
        .skip(1)
        .find(|d| d.parent().is_some_and(|p| p == target) || d.join("deps").is_dir())
        .context("no profile directory above the executable")?;
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(name) => name.to_owned(),
    };
    let cargo = std::env::var_os("CARGO")
        .map(PathBuf::from)
        .or_else(|| option_env!("CARGO").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("cargo"));
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let mut cmd = Command::new(&cargo);
    // Not the variables cargo set for this test binary: build scripts such as ring's track
    // some of them (`rerun-if-env-changed=CARGO_PKG_NAME`), so passing them on would rebuild
    // ring, rustls, kube and the agent here and again in the next plain `cargo test`.
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_package_var) {
            cmd.env_remove(name);
        }
    }
    let out = cmd
        .args(["build", "--quiet", "--message-format=json", "-p", package])
        .args(["--bin", bin, "--profile", &profile])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", cargo.display()))?;
    if !out.status.success() {
        bail!(
            "cargo build -p {package} --bin {bin} failed ({})",
            out.status
        );
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] == "compiler-artifact"
            && msg["target"]["name"] == bin
            && let Some(path) = msg["executable"].as_str()
        {
            return Ok(PathBuf::from(path));
        }
    }
    bail!("cargo reported no executable for {bin}")
}

/// Whether `name` is one of the variables cargo sets for the crate it builds or runs.
fn is_package_var(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_BIN_EXE_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "CARGO_RUSTC_CURRENT_DIR"
                | "OUT_DIR"
        )
}

/// [`cargo_build`] once per process: concurrent tests share one build and one answer.
fn built_once(
    cell: &'static OnceLock<Result<PathBuf, String>>,
    package: &str,
    bin: &str,
    env_override: &str,
) -> Result<PathBuf> {
    cell.get_or_init(|| cargo_build(package, bin, env_override).map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow::anyhow!("building {bin}: {e}"))
}

/// `flannel-agent` for tests, built once per process (`FLANNEL_AGENT_BIN` overrides).
pub fn test_agent() -> Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    built_once(&BIN, "flannel-agent", AGENT, "FLANNEL_AGENT_BIN")
}

/// The CNI plugin `flannel` for tests, built once per process (`FLANNEL_CNI_BIN`
/// overrides).
pub fn test_cni_plugin() -> Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    built_once(&BIN, "flannel-cni", CNI_PLUGIN, "FLANNEL_CNI_BIN")
}

/// `flannel-lab` for running its tools in namespaces: the running executable when it is
/// `flannel-lab`, else (tests) built once per process like [`test_agent`] (`FLANNEL_LAB_BIN`
/// overrides).
pub fn lab_tool() -> Result<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    if let Ok(exe) = std::env::current_exe()
        && exe.file_name().is_some_and(|n| n == LAB)
        && std::env::var_os("FLANNEL_LAB_BIN").is_none()
    {
        return Ok(exe);
    }
    built_once(&BIN, "flannel-tests", LAB, "FLANNEL_LAB_BIN")
}

/// Resolves a binary for the lab: the explicit path if given, else the one next to the running
/// executable; the error says how to build it.
pub fn resolve(explicit: Option<&Path>, name: &str, package: &str) -> Result<PathBuf> {
    if let Some(path) = explicit {
        if !path.is_file() {
            bail!("{} does not exist", path.display());
        }
        return Ok(path.to_path_buf());
    }
    sibling(name).with_context(|| {
        format!(
            "no {name} next to {}: build it (`cargo build --release -p {package}` or \
             `cargo xtask build`) or pass its path",
            std::env::current_exe()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        )
    })
}
