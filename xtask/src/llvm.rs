//! Facts about the nightly toolchain's LLVM, which bpf-linker must link against.
//!
//! bpf-linker reads the bitcode rustc writes, so it must use the same LLVM major as the nightly
//! that builds the eBPF object. We link it against the nightly's own `libLLVM.so.<version>`
//! through a small prefix directory (`LLVM_PREFIX`) holding two symlinks; the linker's runpath
//! points there, so the directory must stay put.

use std::path::{Path, PathBuf};

/// The bpf-linker release the project is pinned to.
pub const BPF_LINKER_VERSION: &str = "0.13.0";

/// LLVM majors bpf-linker 0.13.0 has a feature for (`llvm-21`, `llvm-22`, `llvm-23`).
pub const SUPPORTED_LLVM_MAJORS: [u32; 3] = [21, 22, 23];

/// The nightly known to work (rustc 1.97.0-nightly 2026-05-19, LLVM 22.1.4).
pub const KNOWN_GOOD_NIGHTLY: &str = "1.97.0-nightly";

/// The nightly's LLVM as found on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NightlyLlvm {
    /// `rustc -vV` release line, e.g. `1.97.0-nightly`.
    pub rustc_release: String,
    /// LLVM major version (the bpf-linker feature number).
    pub major: u32,
    /// The shared library's file name, which is also its soname, e.g.
    /// `libLLVM.so.22.1-rust-1.97.0-nightly`.
    pub soname: String,
    /// `<sysroot>/lib`, where the library lives.
    pub lib_dir: PathBuf,
}

impl NightlyLlvm {
    /// The part of the soname after `libLLVM.so.`, e.g. `22.1-rust-1.97.0-nightly`; names the
    /// prefix directory.
    pub fn version_string(&self) -> &str {
        self.soname
            .strip_prefix("libLLVM.so.")
            .unwrap_or(&self.soname)
    }

    /// The permanent `LLVM_PREFIX` for this LLVM: `<cargo home>/flannel-llvm/<version string>`.
    pub fn prefix_dir(&self, cargo_home: &Path) -> PathBuf {
        cargo_home.join("flannel-llvm").join(self.version_string())
    }

    /// The cargo feature that selects this LLVM in bpf-linker.
    pub fn feature(&self) -> String {
        format!("llvm-{}", self.major)
    }
}

/// Field `key: value` of `rustc -vV` output.
fn vv_field<'a>(rustc_vv: &'a str, key: &str) -> Option<&'a str> {
    rustc_vv.lines().find_map(|line| {
        line.strip_prefix(key)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}

/// The `release:` line of `rustc -vV`, e.g. `1.97.0-nightly`.
pub fn rustc_release(rustc_vv: &str) -> Option<String> {
    vv_field(rustc_vv, "release").map(str::to_owned)
}

/// The LLVM major from `rustc -vV` (`LLVM version: 22.1.4` → 22).
pub fn llvm_major(rustc_vv: &str) -> Option<u32> {
    vv_field(rustc_vv, "LLVM version")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// Among the file names of `<sysroot>/lib`, the LLVM shared library for `major`
/// (`libLLVM.so.<major>.…`). rustup also ships a linker script named `libLLVM-<major>-….so`,
/// which is not a library and is ignored.
pub fn find_libllvm<'a>(entries: impl IntoIterator<Item = &'a str>, major: u32) -> Option<String> {
    let wanted = format!("libLLVM.so.{major}.");
    let mut found: Vec<&str> = entries
        .into_iter()
        .filter(|name| name.starts_with(&wanted))
        .collect();
    found.sort_unstable();
    found.first().map(|s| (*s).to_owned())
}

/// The version `bpf-linker --version` prints (`bpf-linker 0.13.0` → `0.13.0`).
pub fn linker_version(output: &str) -> Option<&str> {
    output
        .lines()
        .find_map(|line| line.trim().strip_prefix("bpf-linker "))
        .map(str::trim)
}

/// What `ldd` says about the libLLVM a binary needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkedLlvm {
    /// The soname the binary asks for.
    pub soname: String,
    /// Where it resolves to, or `None` for "not found".
    pub resolved: Option<String>,
}

/// Parses `ldd` output for the libLLVM line:
/// `libLLVM.so.22.1-rust-1.97.0-nightly => /path/lib/libLLVM.so.22.1-… (0x…)` or
/// `libLLVM.so.X => not found`.
pub fn ldd_libllvm(ldd_output: &str) -> Option<LinkedLlvm> {
    ldd_output.lines().find_map(|line| {
        let (name, target) = line.trim().split_once("=>")?;
        let name = name.trim();
        if !name.starts_with("libLLVM") {
            return None;
        }
        let target = target.trim();
        let resolved = if target.starts_with("not found") {
            None
        } else {
            target.split_whitespace().next().map(str::to_owned)
        };
        Some(LinkedLlvm {
            soname: name.to_owned(),
            resolved,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NIGHTLY_VV: &str = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)
binary: rustc
commit-hash: e50aa6fba4e63ab34c72bf9acfd2c307c1155d1a
commit-date: 2026-05-19
host: x86_64-unknown-linux-gnu
release: 1.97.0-nightly
LLVM version: 22.1.4
";

    #[test]
    fn reads_release_and_llvm_major() {
        assert_eq!(rustc_release(NIGHTLY_VV).as_deref(), Some("1.97.0-nightly"));
        assert_eq!(llvm_major(NIGHTLY_VV), Some(22));
        assert_eq!(llvm_major("LLVM version: 23.0.0\n"), Some(23));
        assert_eq!(llvm_major("release: 1.97.0\n"), None);
        assert_eq!(llvm_major("LLVM version: banana\n"), None);
    }

    #[test]
    fn finds_the_library_not_the_linker_script() {
        let listing = [
            "librustc_driver-b5a965480ee51f9a.so",
            "libLLVM-22-rust-1.97.0-nightly.so",
            "libLLVM.so.22.1-rust-1.97.0-nightly",
            "rustlib",
        ];
        assert_eq!(
            find_libllvm(listing, 22).as_deref(),
            Some("libLLVM.so.22.1-rust-1.97.0-nightly")
        );
        // The major must match: a libLLVM 22 is no use for an LLVM 23 nightly.
        assert_eq!(find_libllvm(listing, 23), None);
        assert_eq!(find_libllvm(["libLLVM.so.2.0"], 22), None);
        assert_eq!(find_libllvm([], 22), None);
    }

    #[test]
    fn prefix_and_feature_follow_the_soname() {
        let llvm = NightlyLlvm {
            rustc_release: "1.97.0-nightly".into(),
            major: 22,
            soname: "libLLVM.so.22.1-rust-1.97.0-nightly".into(),
            lib_dir: PathBuf::from("/sysroot/lib"),
        };
        assert_eq!(llvm.version_string(), "22.1-rust-1.97.0-nightly");
        assert_eq!(
            llvm.prefix_dir(Path::new("/root/.cargo")),
            PathBuf::from("/root/.cargo/flannel-llvm/22.1-rust-1.97.0-nightly")
        );
        assert_eq!(llvm.feature(), "llvm-22");
    }

    #[test]
    fn parses_linker_version() {
        assert_eq!(linker_version("bpf-linker 0.13.0\n"), Some("0.13.0"));
        assert_eq!(linker_version("bpf-linker 0.9.15"), Some("0.9.15"));
        assert_eq!(linker_version("something else"), None);
    }

    #[test]
    fn parses_ldd_output() {
        let good = "\tlinux-vdso.so.1 (0x00007f1e823f2000)
\tlibLLVM.so.22.1-rust-1.97.0-nightly => /root/.cargo/flannel-llvm/22.1-rust-1.97.0-nightly/lib/libLLVM.so.22.1-rust-1.97.0-nightly (0x00007f1e77800000)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f1e7761e000)
";
        assert_eq!(
            ldd_libllvm(good),
            Some(LinkedLlvm {
                soname: "libLLVM.so.22.1-rust-1.97.0-nightly".into(),
                resolved: Some(
                    "/root/.cargo/flannel-llvm/22.1-rust-1.97.0-nightly/lib/libLLVM.so.22.1-rust-1.97.0-nightly"
                        .into()
                ),
            })
        );
        let broken = "\tlibLLVM.so.21.1-rust-1.95.0-nightly => not found\n";
        assert_eq!(
            ldd_libllvm(broken),
            Some(LinkedLlvm {
                soname: "libLLVM.so.21.1-rust-1.95.0-nightly".into(),
                resolved: None,
            })
        );
        assert_eq!(ldd_libllvm("\tlibc.so.6 => /lib/libc.so.6 (0x1)\n"), None);
    }
}
