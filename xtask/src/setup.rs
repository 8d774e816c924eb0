//! `cargo xtask setup`: what the project needs on the machine, how to check for it and how to
//! install it.
//!
//! [`REQUIREMENTS`] is the table. [`plan`] checks every row through a [`Probe`] (the real one
//! runs commands; tests use a fake) and decides, without changing anything, which rows can be
//! installed here and which need the user ([`Plan::blocked`]). [`crate::system`] carries out the
//! plan.

use std::{collections::BTreeSet, fmt};

use crate::llvm::{self, NightlyLlvm};

/// Which rustup toolchain a component belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Toolchain {
    /// The toolchain cargo runs with (stable 1.95 by default).
    Active,
    /// `nightly`, which aya-build uses for the eBPF object.
    Nightly,
}

impl Toolchain {
    /// The `--toolchain` argument for rustup, if any.
    pub fn rustup_arg(self) -> Option<&'static str> {
        match self {
            Toolchain::Active => None,
            Toolchain::Nightly => Some("nightly"),
        }
    }
}

/// How to tell whether a requirement is met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// A program on PATH.
    Command(&'static str),
    /// The `nightly` rustup toolchain is installed.
    NightlyToolchain,
    /// A rustup component of a toolchain is installed.
    Component(Toolchain, &'static str),
    /// bpf-linker 0.13.0 runs and links the nightly's libLLVM.
    BpfLinker,
    /// A Debian package is installed.
    Deb(&'static str),
    /// bpffs is mounted at /sys/fs/bpf.
    Bpffs,
}

/// How to meet a requirement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Install {
    /// Only the user can: run this command.
    Manual(&'static str),
    /// `rustup component add`.
    Component(Toolchain, &'static str),
    /// `cargo install bpf-linker` against the nightly's libLLVM.
    BpfLinker,
    /// `apt-get install` of this package.
    Apt(&'static str),
    /// `mount -t bpf bpf /sys/fs/bpf`.
    MountBpffs,
}

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub struct Requirement {
    /// What it is.
    pub name: &'static str,
    /// What needs it.
    pub purpose: &'static str,
    /// How to check.
    pub check: Check,
    /// How to install.
    pub install: Install,
    /// Missing and not installable is a warning, not a stop.
    pub optional: bool,
}

const fn req(
    name: &'static str,
    purpose: &'static str,
    check: Check,
    install: Install,
) -> Requirement {
    Requirement {
        name,
        purpose,
        check,
        install,
        optional: false,
    }
}

const fn deb(package: &'static str, purpose: &'static str) -> Requirement {
    req(package, purpose, Check::Deb(package), Install::Apt(package))
}

/// Everything `cargo xtask setup` makes sure of, in install order.
pub const REQUIREMENTS: &[Requirement] = &[
    req(
        "rustup",
        "manages the stable and nightly toolchains",
        Check::Command("rustup"),
        Install::Manual("curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh"),
    ),
    req(
        "cc",
        "links every Rust binary",
        Check::Command("cc"),
        Install::Manual("apt-get install -y --no-install-recommends build-essential"),
    ),
    req(
        "rustfmt",
        "`cargo fmt --check` in `cargo xtask test`",
        Check::Component(Toolchain::Active, "rustfmt"),
        Install::Component(Toolchain::Active, "rustfmt"),
    ),
    req(
        "clippy",
        "`cargo clippy` in `cargo xtask test`",
        Check::Component(Toolchain::Active, "clippy"),
        Install::Component(Toolchain::Active, "clippy"),
    ),
    req(
        "nightly toolchain",
        "builds the eBPF object (aya-build runs `rustup run nightly cargo`)",
        Check::NightlyToolchain,
        Install::Manual(
            "rustup toolchain install nightly --profile minimal --component rust-src   \
             (known good: 1.97.0-nightly of 2026-05-19, LLVM 22)",
        ),
    ),
    req(
        "rust-src (nightly)",
        "`-Z build-std=core` for bpfel-unknown-none",
        Check::Component(Toolchain::Nightly, "rust-src"),
        Install::Component(Toolchain::Nightly, "rust-src"),
    ),
    deb(
        "protobuf-compiler",
        "protoc, for etcd-client's build script",
    ),
    deb(
        "libprotobuf-dev",
        "google/protobuf/*.proto, imported by etcd-client's protos (only recommended by \
         protobuf-compiler, so --no-install-recommends leaves it out)",
    ),
    deb("etcd-server", "the etcd the tests and the lab run"),
    deb("iproute2", "ip: namespaces, links, routes"),
    deb("iptables", "masquerade rules (iptables backend)"),
    deb("nftables", "masquerade rules (nftables backend)"),
    deb(
        "bpftool",
        "inspecting programs and maps; typed map dumps in tests",
    ),
    deb(
        "containernetworking-plugins",
        "bridge and host-local, delegated to by the CNI plugin",
    ),
    deb("iperf3", "throughput benchmarks"),
    deb("sockperf", "latency benchmarks"),
    deb("tcpdump", "packet captures; checksum cross-checks in tests"),
    deb("ethtool", "offload settings on test links"),
    deb(
        "wireguard-go",
        "userspace WireGuard (this kernel has no wireguard module)",
    ),
    deb("wireguard-tools", "wg: WireGuard keys and peers"),
    deb("strongswan-charon", "IKE daemon for the ipsec backend"),
    deb("strongswan-swanctl", "swanctl: configures charon"),
    deb(
        "libstrongswan-standard-plugins",
        "charon's openssl and gcm plugins: upstream's default ESP proposal is AES-GCM",
    ),
    req(
        "bpf-linker 0.13.0",
        "links the eBPF object (aya-build); built against the nightly's libLLVM",
        Check::BpfLinker,
        Install::BpfLinker,
    ),
    Requirement {
        optional: true,
        ..req(
            "bpffs at /sys/fs/bpf",
            "pinning maps (tests, the agent)",
            Check::Bpffs,
            Install::MountBpffs,
        )
    },
];

/// The state of the installed bpf-linker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkerState {
    /// 0.13.0, runs, links the nightly's libLLVM.
    Ok,
    /// Not on PATH nor in `$CARGO_HOME/bin`.
    Missing,
    /// Another version.
    WrongVersion(String),
    /// Does not run or its libLLVM does not resolve.
    Broken(String),
    /// Links another LLVM than the nightly's.
    OtherLlvm {
        /// The soname it links.
        linked: String,
        /// The nightly's soname.
        nightly: String,
    },
}

/// Decides the linker's state from `bpf-linker --version` (None: did not run), `ldd` output
/// and the nightly's libLLVM soname (None: unknown).
pub fn linker_state(
    version_output: Option<&str>,
    ldd_output: &str,
    nightly_soname: Option<&str>,
) -> LinkerState {
    let Some(version_output) = version_output else {
        return LinkerState::Broken(match llvm::ldd_libllvm(ldd_output) {
            Some(l) if l.resolved.is_none() => format!("{} not found", l.soname),
            _ => "`bpf-linker --version` failed".to_owned(),
        });
    };
    match llvm::linker_version(version_output) {
        Some(llvm::BPF_LINKER_VERSION) => {}
        Some(other) => return LinkerState::WrongVersion(other.to_owned()),
        None => {
            return LinkerState::Broken(format!("unexpected --version output {version_output:?}"));
        }
    }
    let Some(linked) = llvm::ldd_libllvm(ldd_output) else {
        return LinkerState::Broken("ldd shows no libLLVM".to_owned());
    };
    if linked.resolved.is_none() {
        return LinkerState::Broken(format!("{} not found", linked.soname));
    }
    match nightly_soname {
        Some(nightly) if nightly != linked.soname => LinkerState::OtherLlvm {
            linked: linked.soname,
            nightly: nightly.to_owned(),
        },
        _ => LinkerState::Ok,
    }
}

impl fmt::Display for LinkerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkerState::Ok => write!(f, "ok"),
            LinkerState::Missing => write!(f, "not installed"),
            LinkerState::WrongVersion(v) => write!(
                f,
                "version {v} installed, {} needed",
                llvm::BPF_LINKER_VERSION
            ),
            LinkerState::Broken(why) => write!(f, "installed but broken: {why}"),
            LinkerState::OtherLlvm { linked, nightly } => {
                write!(f, "links {linked}, but the nightly has {nightly}")
            }
        }
    }
}

/// What the machine looks like. The real implementation runs commands
/// ([`crate::system::RealProbe`]); the tests use a fake.
pub trait Probe {
    /// Running as root.
    fn is_root(&self) -> bool;
    /// `program` is on PATH.
    fn has_command(&self, program: &str) -> bool;
    /// The `nightly` toolchain is installed.
    fn nightly_installed(&self) -> bool;
    /// A rustup component is installed.
    fn component_installed(&self, toolchain: Toolchain, component: &str) -> bool;
    /// Which of `packages` are not installed (one dpkg query for all).
    fn missing_debs(&self, packages: &[&'static str]) -> BTreeSet<&'static str>;
    /// The nightly's LLVM, or why it cannot be used.
    fn nightly_llvm(&self) -> Result<NightlyLlvm, String>;
    /// The installed bpf-linker.
    fn bpf_linker(&self) -> LinkerState;
    /// bpffs is mounted at /sys/fs/bpf.
    fn bpffs_mounted(&self) -> bool;
}

/// Something setup will do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// `apt-get install -y --no-install-recommends <packages>`.
    Apt(Vec<&'static str>),
    /// `rustup component add <component> [--toolchain <t>]`.
    Component(Toolchain, &'static str),
    /// Build and install bpf-linker for this LLVM.
    BpfLinker(NightlyLlvm),
    /// `mount -t bpf bpf /sys/fs/bpf`.
    MountBpffs,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Apt(pkgs) => write!(
                f,
                "apt-get install -y --no-install-recommends {}",
                pkgs.join(" ")
            ),
            Action::Component(t, c) => match t.rustup_arg() {
                Some(t) => write!(f, "rustup component add {c} --toolchain {t}"),
                None => write!(f, "rustup component add {c}"),
            },
            Action::BpfLinker(llvm) => write!(
                f,
                "LLVM_PREFIX=$CARGO_HOME/flannel-llvm/{} cargo install bpf-linker --version {} --no-default-features --features {}",
                llvm.version_string(),
                llvm::BPF_LINKER_VERSION,
                llvm.feature()
            ),
            Action::MountBpffs => write!(f, "mount -t bpf bpf /sys/fs/bpf"),
        }
    }
}

/// A missing requirement setup cannot install here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocked {
    /// The requirement's name.
    pub name: &'static str,
    /// What needs it.
    pub purpose: &'static str,
    /// What is wrong.
    pub problem: String,
    /// The command that gets it.
    pub fix: String,
}

/// The outcome of checking every requirement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Requirements already met.
    pub present: Vec<&'static str>,
    /// Installs setup will run, in order.
    pub actions: Vec<Action>,
    /// Missing requirements the user must install; setup stops if any.
    pub blocked: Vec<Blocked>,
    /// Missing optional requirements setup cannot install.
    pub warnings: Vec<Blocked>,
}

/// Checks every requirement and decides what to do about each.
pub fn plan(probe: &dyn Probe) -> Plan {
    let all_debs: Vec<&'static str> = REQUIREMENTS
        .iter()
        .filter_map(|r| match r.check {
            Check::Deb(p) => Some(p),
            _ => None,
        })
        .collect();
    let missing_debs = probe.missing_debs(&all_debs);
    let root = probe.is_root();
    let has_apt = probe.has_command("apt-get");
    let has_rustup = probe.has_command("rustup");
    let nightly = probe.nightly_installed();

    let mut plan = Plan::default();
    let mut apt = Vec::new();
    for r in REQUIREMENTS {
        let problem = match r.check {
            Check::Command(p) => (!probe.has_command(p)).then(|| format!("`{p}` is not on PATH")),
            Check::NightlyToolchain => (!nightly).then(|| "not installed".to_owned()),
            Check::Component(t, c) => {
                let usable = has_rustup && (t == Toolchain::Active || nightly);
                (!usable || !probe.component_installed(t, c)).then(|| "not installed".to_owned())
            }
            Check::BpfLinker => match probe.bpf_linker() {
                LinkerState::Ok => None,
                state => Some(state.to_string()),
            },
            Check::Deb(p) => missing_debs.contains(p).then(|| "not installed".to_owned()),
            Check::Bpffs => (!probe.bpffs_mounted()).then(|| "not mounted".to_owned()),
        };
        let Some(problem) = problem else {
            plan.present.push(r.name);
            continue;
        };
        let blocked = |fix: String| Blocked {
            name: r.name,
            purpose: r.purpose,
            problem: problem.clone(),
            fix,
        };
        let outcome = match r.install {
            Install::Manual(cmd) => Err(blocked(cmd.to_owned())),
            Install::Apt(pkg) if root && has_apt => {
                apt.push(pkg);
                Ok(None)
            }
            Install::Apt(pkg) if has_apt => Err(blocked(format!(
                "sudo apt-get install -y --no-install-recommends {pkg}   (or rerun setup as root)"
            ))),
            Install::Apt(pkg) => Err(blocked(format!(
                "install `{pkg}` with your package manager"
            ))),
            Install::Component(t, c) => {
                let action = Action::Component(t, c);
                if has_rustup && (t == Toolchain::Active || nightly) {
                    Ok(Some(action))
                } else {
                    Err(blocked(format!(
                        "{action}   (needs rustup and the toolchain first)"
                    )))
                }
            }
            Install::BpfLinker => match probe.nightly_llvm() {
                Ok(llvm) if llvm::SUPPORTED_LLVM_MAJORS.contains(&llvm.major) => {
                    Ok(Some(Action::BpfLinker(llvm)))
                }
                Ok(llvm) => Err(blocked(format!(
                    "the nightly uses LLVM {}, bpf-linker {} supports {:?}: install nightly {} (see the nightly row)",
                    llvm.major,
                    llvm::BPF_LINKER_VERSION,
                    llvm::SUPPORTED_LLVM_MAJORS,
                    llvm::KNOWN_GOOD_NIGHTLY
                ))),
                Err(why) => Err(blocked(format!(
                    "install the nightly toolchain first, then rerun `cargo xtask setup` ({why})"
                ))),
            },
            Install::MountBpffs if root => Ok(Some(Action::MountBpffs)),
            Install::MountBpffs => Err(blocked("sudo mount -t bpf bpf /sys/fs/bpf".to_owned())),
        };
        match outcome {
            Ok(Some(action)) => plan.actions.push(action),
            Ok(None) => {}
            Err(b) if r.optional => plan.warnings.push(b),
            Err(b) => plan.blocked.push(b),
        }
    }
    if nightly
        && let Ok(llvm) = probe.nightly_llvm()
        && llvm.rustc_release != llvm::KNOWN_GOOD_NIGHTLY
    {
        plan.warnings.push(Blocked {
            name: "nightly toolchain",
            purpose: "builds the eBPF object",
            problem: format!(
                "nightly is {}, the known-good one is {}; the eBPF build may fail",
                llvm.rustc_release,
                llvm::KNOWN_GOOD_NIGHTLY
            ),
            fix: "rustup toolchain install nightly-2026-05-19 and make it the `nightly` aya-build uses"
                .to_owned(),
        });
    }
    if !apt.is_empty() {
        // Debian packages first: protoc and friends do not depend on anything else here.
        plan.actions.insert(0, Action::Apt(apt));
    }
    plan
}

/// Whether the apt package lists must be refreshed before installing: none present, or the
/// newest is older than a day. `ages_secs` are the ages of the list files.
pub fn apt_lists_stale(ages_secs: &[u64]) -> bool {
    const DAY: u64 = 24 * 60 * 60;
    ages_secs.iter().min().is_none_or(|newest| *newest > DAY)
}

#[cfg(test)]
mod tests {
    use std::{cell::RefCell, path::PathBuf};

    use super::*;

    /// A machine described by fields; records the queries made.
    struct Fake {
        root: bool,
        commands: Vec<&'static str>,
        nightly: bool,
        components: Vec<(Toolchain, &'static str)>,
        debs: Vec<&'static str>,
        llvm: Result<NightlyLlvm, String>,
        linker: LinkerState,
        bpffs: bool,
        dpkg_queries: RefCell<usize>,
    }

    fn llvm22() -> NightlyLlvm {
        NightlyLlvm {
            rustc_release: "1.97.0-nightly".into(),
            major: 22,
            soname: "libLLVM.so.22.1-rust-1.97.0-nightly".into(),
            lib_dir: PathBuf::from("/sysroot/lib"),
        }
    }

    fn all_debs() -> Vec<&'static str> {
        REQUIREMENTS
            .iter()
            .filter_map(|r| match r.check {
                Check::Deb(p) => Some(p),
                _ => None,
            })
            .collect()
    }

    /// The machine this project is developed on: everything there.
    fn complete() -> Fake {
        Fake {
            root: true,
            commands: vec!["rustup", "cc", "apt-get"],
            nightly: true,
            components: vec![
                (Toolchain::Active, "rustfmt"),
                (Toolchain::Active, "clippy"),
                (Toolchain::Nightly, "rust-src"),
            ],
            debs: all_debs(),
            llvm: Ok(llvm22()),
            linker: LinkerState::Ok,
            bpffs: true,
            dpkg_queries: RefCell::new(0),
        }
    }

    /// The brief's fresh Debian 12: root, rustup with stable and nightly, nothing else.
    fn fresh_debian() -> Fake {
        Fake {
            components: vec![
                (Toolchain::Active, "rustfmt"),
                (Toolchain::Active, "clippy"),
            ],
            debs: vec!["iproute2"],
            linker: LinkerState::Missing,
            bpffs: false,
            ..complete()
        }
    }

    impl Probe for Fake {
        fn is_root(&self) -> bool {
            self.root
        }
        fn has_command(&self, program: &str) -> bool {
            self.commands.contains(&program)
        }
        fn nightly_installed(&self) -> bool {
            self.nightly
        }
        fn component_installed(&self, toolchain: Toolchain, component: &str) -> bool {
            self.components.contains(&(toolchain, component))
        }
        fn missing_debs(&self, packages: &[&'static str]) -> BTreeSet<&'static str> {
            *self.dpkg_queries.borrow_mut() += 1;
            packages
                .iter()
                .filter(|p| !self.debs.contains(p))
                .copied()
                .collect()
        }
        fn nightly_llvm(&self) -> Result<NightlyLlvm, String> {
            self.llvm.clone()
        }
        fn bpf_linker(&self) -> LinkerState {
            self.linker.clone()
        }
        fn bpffs_mounted(&self) -> bool {
            self.bpffs
        }
    }

    fn names(blocked: &[Blocked]) -> Vec<&'static str> {
        blocked.iter().map(|b| b.name).collect()
    }

    #[test]
    fn complete_machine_needs_nothing() {
        let fake = complete();
        let plan = plan(&fake);
        assert_eq!(plan.actions, []);
        assert_eq!(plan.blocked, []);
        assert_eq!(plan.warnings, []);
        assert_eq!(plan.present.len(), REQUIREMENTS.len());
        assert_eq!(
            *fake.dpkg_queries.borrow(),
            1,
            "one dpkg query for all packages"
        );
    }

    #[test]
    fn fresh_debian_as_root_installs_everything_itself() {
        let plan = plan(&fresh_debian());
        assert_eq!(plan.blocked, []);
        let mut debs = all_debs();
        debs.retain(|p| *p != "iproute2");
        assert_eq!(
            plan.actions,
            [
                Action::Apt(debs),
                Action::Component(Toolchain::Nightly, "rust-src"),
                Action::BpfLinker(llvm22()),
                Action::MountBpffs,
            ]
        );
        assert_eq!(
            plan.actions[0].to_string(),
            format!(
                "apt-get install -y --no-install-recommends {}",
                all_debs()
                    .into_iter()
                    .filter(|p| *p != "iproute2")
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        );
        assert_eq!(
            plan.actions[2].to_string(),
            "LLVM_PREFIX=$CARGO_HOME/flannel-llvm/22.1-rust-1.97.0-nightly cargo install bpf-linker \
             --version 0.13.0 --no-default-features --features llvm-22"
        );
    }

    #[test]
    fn not_root_stops_with_sudo_commands_and_warns_about_bpffs() {
        let plan = plan(&Fake {
            root: false,
            ..fresh_debian()
        });
        let mut expected = all_debs();
        expected.retain(|p| *p != "iproute2");
        assert_eq!(names(&plan.blocked), expected);
        assert!(plan.blocked.iter().all(|b| b.fix.starts_with(&format!(
            "sudo apt-get install -y --no-install-recommends {}",
            b.name
        ))));
        assert_eq!(names(&plan.warnings), ["bpffs at /sys/fs/bpf"]);
        assert_eq!(plan.warnings[0].fix, "sudo mount -t bpf bpf /sys/fs/bpf");
        // What does not need root is still planned.
        assert_eq!(
            plan.actions,
            [
                Action::Component(Toolchain::Nightly, "rust-src"),
                Action::BpfLinker(llvm22())
            ]
        );
    }

    #[test]
    fn no_apt_get_names_the_packages() {
        let plan = plan(&Fake {
            commands: vec!["rustup", "cc"],
            ..fresh_debian()
        });
        let fix = &plan
            .blocked
            .iter()
            .find(|b| b.name == "bpftool")
            .expect("bpftool blocked")
            .fix;
        assert_eq!(fix, "install `bpftool` with your package manager");
    }

    #[test]
    fn no_nightly_blocks_everything_built_with_it() {
        let plan = plan(&Fake {
            nightly: false,
            components: vec![
                (Toolchain::Active, "rustfmt"),
                (Toolchain::Active, "clippy"),
            ],
            llvm: Err("toolchain 'nightly' is not installed".into()),
            linker: LinkerState::Missing,
            ..complete()
        });
        assert_eq!(
            names(&plan.blocked),
            [
                "nightly toolchain",
                "rust-src (nightly)",
                "bpf-linker 0.13.0"
            ]
        );
        assert!(
            plan.blocked[0]
                .fix
                .starts_with("rustup toolchain install nightly --profile minimal")
        );
        assert_eq!(
            plan.blocked[1].fix,
            "rustup component add rust-src --toolchain nightly   (needs rustup and the toolchain first)"
        );
        assert!(
            plan.blocked[2]
                .fix
                .contains("install the nightly toolchain first")
        );
        assert_eq!(plan.actions, []);
    }

    #[test]
    fn no_rustup_is_a_manual_install() {
        let plan = plan(&Fake {
            commands: vec!["cc", "apt-get"],
            ..complete()
        });
        assert_eq!(
            names(&plan.blocked),
            ["rustup", "rustfmt", "clippy", "rust-src (nightly)"]
        );
        assert!(plan.blocked[0].fix.contains("sh.rustup.rs"));
    }

    #[test]
    fn unusable_linker_is_rebuilt() {
        for state in [
            LinkerState::Missing,
            LinkerState::WrongVersion("0.9.15".into()),
            LinkerState::Broken("libLLVM.so.21.1 not found".into()),
            LinkerState::OtherLlvm {
                linked: "libLLVM.so.21.1-rust-1.95.0-nightly".into(),
                nightly: "libLLVM.so.22.1-rust-1.97.0-nightly".into(),
            },
        ] {
            let plan = plan(&Fake {
                linker: state.clone(),
                ..complete()
            });
            assert_eq!(plan.actions, [Action::BpfLinker(llvm22())], "{state:?}");
        }
    }

    #[test]
    fn other_nightly_is_a_warning() {
        let plan = plan(&Fake {
            llvm: Ok(NightlyLlvm {
                rustc_release: "1.99.0-nightly".into(),
                major: 23,
                soname: "libLLVM.so.23.1-rust-1.99.0-nightly".into(),
                ..llvm22()
            }),
            linker: LinkerState::Missing,
            ..complete()
        });
        assert_eq!(plan.blocked, []);
        assert_eq!(names(&plan.warnings), ["nightly toolchain"]);
        assert!(plan.warnings[0].problem.contains("1.99.0-nightly"));
        match &plan.actions[..] {
            [Action::BpfLinker(llvm)] => assert_eq!(llvm.feature(), "llvm-23"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unsupported_llvm_stops() {
        let plan = plan(&Fake {
            llvm: Ok(NightlyLlvm {
                major: 24,
                soname: "libLLVM.so.24.0-rust-1.100.0-nightly".into(),
                ..llvm22()
            }),
            linker: LinkerState::Missing,
            ..complete()
        });
        assert_eq!(names(&plan.blocked), ["bpf-linker 0.13.0"]);
        assert!(plan.blocked[0].fix.contains("LLVM 24"));
    }

    #[test]
    fn linker_state_from_command_output() {
        let ldd_ok = "\tlibLLVM.so.22.1-rust-1.97.0-nightly => /p/lib/libLLVM.so.22.1-rust-1.97.0-nightly (0x1)\n";
        let nightly = Some("libLLVM.so.22.1-rust-1.97.0-nightly");
        assert_eq!(
            linker_state(Some("bpf-linker 0.13.0\n"), ldd_ok, nightly),
            LinkerState::Ok
        );
        assert_eq!(
            linker_state(Some("bpf-linker 0.13.0\n"), ldd_ok, None),
            LinkerState::Ok
        );
        assert_eq!(
            linker_state(Some("bpf-linker 0.12.1\n"), ldd_ok, nightly),
            LinkerState::WrongVersion("0.12.1".into())
        );
        assert_eq!(
            linker_state(None, "\tlibLLVM.so.22.1-x => not found\n", nightly),
            LinkerState::Broken("libLLVM.so.22.1-x not found".into())
        );
        assert_eq!(
            linker_state(
                Some("bpf-linker 0.13.0"),
                "\tlibc.so.6 => /lib/libc.so.6 (0x1)\n",
                nightly
            ),
            LinkerState::Broken("ldd shows no libLLVM".into())
        );
        assert_eq!(
            linker_state(
                Some("bpf-linker 0.13.0"),
                ldd_ok,
                Some("libLLVM.so.23.1-rust-1.99.0-nightly")
            ),
            LinkerState::OtherLlvm {
                linked: "libLLVM.so.22.1-rust-1.97.0-nightly".into(),
                nightly: "libLLVM.so.23.1-rust-1.99.0-nightly".into(),
            }
        );
    }

    #[test]
    fn apt_lists_freshness() {
        assert!(apt_lists_stale(&[]));
        assert!(apt_lists_stale(&[90_000, 200_000]));
        assert!(!apt_lists_stale(&[90_000, 60]));
    }

    #[test]
    fn table_is_consistent() {
        let mut seen = BTreeSet::new();
        for r in REQUIREMENTS {
            assert!(seen.insert(r.name), "duplicate {}", r.name);
            if let Check::Deb(p) = r.check {
                assert_eq!(r.install, Install::Apt(p), "{}", r.name);
            }
        }
        // The brief's package list, exactly, plus libprotobuf-dev (protoc's includes) and
        // libstrongswan-standard-plugins (charon's openssl and gcm plugins).
        assert_eq!(all_debs().len(), 17);
    }
}
