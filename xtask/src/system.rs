//! The real machine: the [`Probe`] that runs commands, and carrying out setup's [`Action`]s.

use std::{
    cell::OnceCell,
    collections::{BTreeMap, BTreeSet},
    env,
    ffi::OsString,
    fs,
    os::unix::fs::{PermissionsExt as _, symlink},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::SystemTime,
};

use anyhow::{Context as _, Result, bail};

use crate::{
    llvm::{self, NightlyLlvm},
    setup::{self, Action, LinkerState, Probe, Toolchain},
};

/// Where things are, and the environment child processes get.
#[derive(Clone, Debug)]
pub struct Env {
    /// The workspace root.
    pub root: PathBuf,
    /// `$CARGO_HOME` (default `~/.cargo`).
    pub cargo_home: PathBuf,
    /// The cargo that runs us.
    pub cargo: OsString,
    /// PATH with `$CARGO_HOME/bin` in front, so bpf-linker is found by aya-build.
    pub path: OsString,
}

impl Env {
    /// Reads the environment.
    pub fn detect() -> Result<Env> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .context("xtask has no parent directory")?
            .to_path_buf();
        let cargo_home = match env::var_os("CARGO_HOME") {
            Some(home) => PathBuf::from(home),
            None => {
                PathBuf::from(env::var_os("HOME").context("neither CARGO_HOME nor HOME is set")?)
                    .join(".cargo")
            }
        };
        let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut dirs = vec![cargo_home.join("bin")];
        if let Some(path) = env::var_os("PATH") {
            dirs.extend(env::split_paths(&path).filter(|d| *d != cargo_home.join("bin")));
        }
        let path = env::join_paths(dirs).context("joining PATH")?;
        Ok(Env {
            root,
            cargo_home,
            cargo,
            path,
        })
    }

    /// A command run from the workspace root with our PATH, without the variables `cargo run`
    /// set for xtask itself.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new(program);
        cmd.current_dir(&self.root).env("PATH", &self.path);
        for (name, _) in env::vars_os() {
            if name.to_str().is_some_and(is_package_var) {
                cmd.env_remove(name);
            }
        }
        cmd
    }

    /// `cargo <args>`, with the cargo that runs us.
    pub fn cargo(&self, args: &[&str]) -> Command {
        let mut cmd = self.command(&self.cargo);
        cmd.args(args);
        cmd
    }

    /// `program`'s full path if it is on our PATH.
    pub fn which(&self, program: &str) -> Option<PathBuf> {
        env::split_paths(&self.path)
            .map(|dir| dir.join(program))
            .find(|p| {
                fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            })
    }

    /// The cargo target directory.
    pub fn target_dir(&self) -> PathBuf {
        env::var_os("CARGO_TARGET_DIR").map_or_else(|| self.root.join("target"), PathBuf::from)
    }
}

/// Whether `name` is one of the variables cargo sets for the crate it runs (xtask here).
///
/// Build scripts such as ring's track some of them (`rerun-if-env-changed=CARGO_PKG_NAME`), and
/// cargo compares the values in its own environment: passing xtask's values on would make every
/// switch between `cargo xtask test` and a plain `cargo test` rebuild those crates.
pub fn is_package_var(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
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

/// Runs `cmd` with inherited stdio; fails naming the command and its exit status.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = show(cmd);
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` and returns its stdout if it succeeds.
fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The command line of `cmd`, for messages.
pub fn show(cmd: &Command) -> String {
    let mut parts = vec![cmd.get_program().to_string_lossy().into_owned()];
    parts.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    parts.join(" ")
}

/// The effective uid from `/proc/self/status` (`Uid: real effective saved fs`).
pub fn effective_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Whether `/proc/mounts` shows bpffs at /sys/fs/bpf.
pub fn bpffs_in(mounts: &str) -> bool {
    mounts.lines().any(|l| {
        let mut f = l.split_whitespace();
        let (_, point, kind) = (f.next(), f.next(), f.next());
        point == Some("/sys/fs/bpf") && kind == Some("bpf")
    })
}

/// Whether `rustup toolchain list` shows the `nightly` channel (not a dated nightly).
pub fn lists_nightly(toolchains: &str) -> bool {
    toolchains.lines().any(|l| {
        let name = l.split_whitespace().next().unwrap_or_default();
        name == "nightly"
            || name
                .strip_prefix("nightly-")
                .is_some_and(|rest| !rest.starts_with(|c: char| c.is_ascii_digit()))
    })
}

/// Whether `rustup component list --installed` shows `component`, listed as `name` or as
/// `name-<host triple>` (the triple is read off the `rustc-<triple>` line, always present).
pub fn lists_component(installed: &str, component: &str) -> bool {
    let triple = installed
        .lines()
        .find_map(|l| l.trim().strip_prefix("rustc-"));
    installed.lines().map(str::trim).any(|l| {
        l == component
            || triple.is_some_and(|t| {
                l.strip_prefix(component)
                    .and_then(|rest| rest.strip_prefix('-'))
                    == Some(t)
            })
    })
}

/// Packages `dpkg-query -W -f '${Package}\t${db:Status-Abbrev}\n'` reports as installed.
pub fn installed_debs(dpkg_output: &str) -> BTreeSet<String> {
    dpkg_output
        .lines()
        .filter_map(|l| {
            let (name, status) = l.split_once('\t')?;
            status
                .starts_with("ii")
                .then(|| name.split(':').next().unwrap_or(name).to_owned())
        })
        .collect()
}

/// The [`Probe`] for this machine; caches what it runs.
pub struct RealProbe<'a> {
    env: &'a Env,
    components: OnceCell<BTreeMap<Toolchain, String>>,
    nightly: OnceCell<bool>,
    llvm: OnceCell<Result<NightlyLlvm, String>>,
}

impl<'a> RealProbe<'a> {
    /// A probe with empty caches.
    pub fn new(env: &'a Env) -> Self {
        RealProbe {
            env,
            components: OnceCell::new(),
            nightly: OnceCell::new(),
            llvm: OnceCell::new(),
        }
    }

    fn rustup(&self, args: &[&str]) -> Option<String> {
        output(
            self.env
                .command("rustup")
                .args(args)
                .env("RUSTUP_AUTO_INSTALL", "0"),
        )
    }

    fn read_nightly_llvm(&self) -> Result<NightlyLlvm, String> {
        if !self.nightly_installed() {
            return Err("toolchain `nightly` is not installed".to_owned());
        }
        let vv = self
            .rustup(&["run", "nightly", "rustc", "-vV"])
            .ok_or("`rustup run nightly rustc -vV` failed")?;
        let major = llvm::llvm_major(&vv).ok_or_else(|| format!("no LLVM version in {vv:?}"))?;
        let rustc_release = llvm::rustc_release(&vv).unwrap_or_default();
        let sysroot = self
            .rustup(&["run", "nightly", "rustc", "--print", "sysroot"])
            .ok_or("`rustc +nightly --print sysroot` failed")?;
        let lib_dir = Path::new(sysroot.trim()).join("lib");
        let names: Vec<String> = fs::read_dir(&lib_dir)
            .map_err(|e| format!("reading {}: {e}", lib_dir.display()))?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        let soname = llvm::find_libllvm(names.iter().map(String::as_str), major)
            .ok_or_else(|| format!("no libLLVM.so.{major}.* in {}", lib_dir.display()))?;
        Ok(NightlyLlvm {
            rustc_release,
            major,
            soname,
            lib_dir,
        })
    }
}

impl Probe for RealProbe<'_> {
    fn is_root(&self) -> bool {
        fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| effective_uid(&s))
            == Some(0)
    }

    fn has_command(&self, program: &str) -> bool {
        self.env.which(program).is_some()
    }

    fn nightly_installed(&self) -> bool {
        *self.nightly.get_or_init(|| {
            self.rustup(&["toolchain", "list"])
                .is_some_and(|list| lists_nightly(&list))
        })
    }

    fn component_installed(&self, toolchain: Toolchain, component: &str) -> bool {
        let lists = self.components.get_or_init(|| {
            let mut lists = BTreeMap::new();
            for t in [Toolchain::Active, Toolchain::Nightly] {
                let mut args = vec!["component", "list", "--installed"];
                if let Some(name) = t.rustup_arg() {
                    if !self.nightly_installed() {
                        continue;
                    }
                    args.extend(["--toolchain", name]);
                }
                lists.insert(t, self.rustup(&args).unwrap_or_default());
            }
            lists
        });
        lists
            .get(&toolchain)
            .is_some_and(|list| lists_component(list, component))
    }

    fn missing_debs(&self, packages: &[&'static str]) -> BTreeSet<&'static str> {
        // dpkg-query exits 1 when some package is unknown but still lists the others.
        let installed = self
            .env
            .command("dpkg-query")
            .args(["-W", "-f", "${Package}\t${db:Status-Abbrev}\n"])
            .args(packages)
            .stderr(Stdio::null())
            .output()
            .map(|o| installed_debs(&String::from_utf8_lossy(&o.stdout)))
            .unwrap_or_default();
        packages
            .iter()
            .filter(|p| !installed.contains(**p))
            .copied()
            .collect()
    }

    fn nightly_llvm(&self) -> Result<NightlyLlvm, String> {
        self.llvm.get_or_init(|| self.read_nightly_llvm()).clone()
    }

    fn bpf_linker(&self) -> LinkerState {
        let Some(path) = self.env.which("bpf-linker") else {
            return LinkerState::Missing;
        };
        let version = output(Command::new(&path).arg("--version"));
        let ldd = output(Command::new("ldd").arg(&path)).unwrap_or_default();
        let nightly = self.nightly_llvm().ok().map(|l| l.soname);
        setup::linker_state(version.as_deref(), &ldd, nightly.as_deref())
    }

    fn bpffs_mounted(&self) -> bool {
        fs::read_to_string("/proc/mounts").is_ok_and(|m| bpffs_in(&m))
    }
}

/// Ages in seconds of the apt package lists.
fn apt_list_ages() -> Vec<u64> {
    let now = SystemTime::now();
    fs::read_dir("/var/lib/apt/lists")
        .map(|dir| {
            dir.filter_map(|e| {
                let e = e.ok()?;
                if !e.file_name().to_string_lossy().contains("_Packages") {
                    return None;
                }
                let modified = e.metadata().ok()?.modified().ok()?;
                Some(now.duration_since(modified).map_or(0, |d| d.as_secs()))
            })
            .collect()
        })
        .unwrap_or_default()
}

fn apt_get(env: &Env, args: &[&str]) -> Command {
    let mut cmd = env.command("apt-get");
    cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
    cmd
}

/// Carries out one action, printing what it does.
pub fn apply(env: &Env, action: &Action) -> Result<()> {
    match action {
        Action::Apt(packages) => {
            eprintln!(
                "setup: installing {} Debian package(s) with apt-get (a minute or two): {}",
                packages.len(),
                packages.join(" ")
            );
            let mut updated = false;
            if setup::apt_lists_stale(&apt_list_ages()) {
                eprintln!(
                    "setup: apt package lists are missing or older than a day: apt-get update"
                );
                run(&mut apt_get(env, &["update"]))?;
                updated = true;
            }
            let mut install = vec!["install", "-y", "--no-install-recommends"];
            install.extend(packages.iter().copied());
            match run(&mut apt_get(env, &install)) {
                Ok(()) => Ok(()),
                Err(e) if !updated => {
                    eprintln!("setup: {e:#}; refreshing the package lists and retrying");
                    run(&mut apt_get(env, &["update"]))?;
                    run(&mut apt_get(env, &install))
                }
                Err(e) => Err(e),
            }
        }
        Action::Component(toolchain, component) => {
            eprintln!("setup: {action}");
            let mut cmd = env.command("rustup");
            cmd.args(["component", "add", component]);
            if let Some(t) = toolchain.rustup_arg() {
                cmd.args(["--toolchain", t]);
            }
            run(&mut cmd)
        }
        Action::BpfLinker(llvm) => install_bpf_linker(env, llvm),
        Action::MountBpffs => {
            eprintln!("setup: {action}");
            run(env
                .command("mount")
                .args(["-t", "bpf", "bpf", "/sys/fs/bpf"]))
        }
    }
}

/// Makes `<prefix>/lib/{libLLVM.so, <soname>}` point at the nightly's libLLVM, replacing
/// wrong or dangling links.
fn ensure_llvm_prefix(prefix: &Path, llvm: &NightlyLlvm) -> Result<()> {
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    let target = llvm.lib_dir.join(&llvm.soname);
    for name in ["libLLVM.so", llvm.soname.as_str()] {
        let link = lib.join(name);
        if fs::read_link(&link).is_ok_and(|t| t == target) {
            continue;
        }
        if fs::symlink_metadata(&link).is_ok() {
            fs::remove_file(&link).with_context(|| format!("removing {}", link.display()))?;
        }
        symlink(&target, &link)
            .with_context(|| format!("linking {} -> {}", link.display(), target.display()))?;
    }
    Ok(())
}

fn install_bpf_linker(env: &Env, llvm: &NightlyLlvm) -> Result<()> {
    let prefix = llvm.prefix_dir(&env.cargo_home);
    ensure_llvm_prefix(&prefix, llvm)?;
    eprintln!(
        "setup: building bpf-linker {} against the nightly's {} (LLVM_PREFIX={}).\n\
         setup: this compiles LLVM bindings and takes several minutes (3-10 on 2 cores)...",
        llvm::BPF_LINKER_VERSION,
        llvm.soname,
        prefix.display()
    );
    let version = llvm::BPF_LINKER_VERSION;
    let feature = llvm.feature();
    let mut cmd = env.cargo(&[
        "install",
        "bpf-linker",
        "--version",
        version,
        "--no-default-features",
        "--features",
        &feature,
        "--force",
    ]);
    cmd.env("LLVM_PREFIX", &prefix);
    run(&mut cmd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_only_the_crate_variables() {
        for name in [
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_MANIFEST_DIR",
            "OUT_DIR",
        ] {
            assert!(is_package_var(name), "{name}");
        }
        for name in [
            "CARGO",
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "RUSTUP_TOOLCHAIN",
            "PATH",
        ] {
            assert!(!is_package_var(name), "{name}");
        }
    }

    #[test]
    fn reads_effective_uid() {
        let status = "Name:\tcargo\nUid:\t1000\t0\t0\t0\nGid:\t0\t0\t0\t0\n";
        assert_eq!(effective_uid(status), Some(0));
        assert_eq!(effective_uid("Uid:\t0\t1000\t1000\t1000\n"), Some(1000));
        assert_eq!(effective_uid("Name: x\n"), None);
    }

    #[test]
    fn finds_bpffs_in_mounts() {
        let mounts = "sysfs /sys sysfs rw 0 0\nbpf /sys/fs/bpf bpf rw,relatime 0 0\n";
        assert!(bpffs_in(mounts));
        assert!(!bpffs_in("sysfs /sys sysfs rw 0 0\n"));
        assert!(!bpffs_in("bpf /run/bpf bpf rw 0 0\n"));
        assert!(!bpffs_in("tmpfs /sys/fs/bpf tmpfs rw 0 0\n"));
    }

    #[test]
    fn recognises_the_nightly_channel() {
        let list = "stable-x86_64-unknown-linux-gnu (active, default)\n\
                    nightly-x86_64-unknown-linux-gnu\n1.95.0-x86_64-unknown-linux-gnu\n";
        assert!(lists_nightly(list));
        assert!(!lists_nightly(
            "stable-x86_64-unknown-linux-gnu (default)\nnightly-2026-05-19-x86_64-unknown-linux-gnu\n"
        ));
        assert!(!lists_nightly("no installed toolchains\n"));
    }

    #[test]
    fn recognises_components() {
        let list = "cargo-x86_64-unknown-linux-gnu\nclippy-x86_64-unknown-linux-gnu\nrust-src\n\
                    rust-std-x86_64-unknown-linux-gnu\nrustc-x86_64-unknown-linux-gnu\n";
        assert!(lists_component(list, "clippy"));
        assert!(lists_component(list, "rust-src"));
        assert!(!lists_component(list, "rustfmt"));
        assert!(!lists_component("rust-src-extra\n", "rust-src"));
        assert!(!lists_component(list, "rust"));
    }

    #[test]
    fn reads_dpkg_status() {
        let out = "bpftool\tii \netcd-server\tun \nlibc6:amd64\tii \n";
        let got = installed_debs(out);
        assert!(got.contains("bpftool"));
        assert!(got.contains("libc6"));
        assert!(!got.contains("etcd-server"));
    }

    #[test]
    fn llvm_prefix_links_are_created_and_repaired() {
        let dir = std::env::temp_dir().join(format!("xtask-llvm-{}", std::process::id()));
        let sysroot_lib = dir.join("sysroot/lib");
        fs::create_dir_all(&sysroot_lib).expect("mkdir");
        let llvm = NightlyLlvm {
            rustc_release: "1.97.0-nightly".into(),
            major: 22,
            soname: "libLLVM.so.22.1-test".into(),
            lib_dir: sysroot_lib.clone(),
        };
        let prefix = dir.join("prefix");
        ensure_llvm_prefix(&prefix, &llvm).expect("first");
        // A stale link is replaced; a second run changes nothing.
        let stale = prefix.join("lib/libLLVM.so");
        fs::remove_file(&stale).expect("rm");
        symlink("/nonexistent", &stale).expect("stale link");
        ensure_llvm_prefix(&prefix, &llvm).expect("repair");
        ensure_llvm_prefix(&prefix, &llvm).expect("idempotent");
        for name in ["libLLVM.so", "libLLVM.so.22.1-test"] {
            assert_eq!(
                fs::read_link(prefix.join("lib").join(name)).expect("link"),
                sysroot_lib.join("libLLVM.so.22.1-test")
            );
        }
        fs::remove_dir_all(&dir).expect("cleanup");
    }
}
