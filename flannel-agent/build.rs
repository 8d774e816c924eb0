//! Builds the eBPF object (`flannel-ebpf`) with aya-build and leaves it in `OUT_DIR/flannel-ebpf`,
//! where `bpf::OBJECT` embeds it.
//!
//! `AYA_BUILD_SKIP=1` skips the eBPF build (no nightly or bpf-linker needed) and writes an empty
//! stub instead, so `cargo check`, clippy and the unit tests still work; an agent built that way
//! reports that it has no fast path and runs the kernel path.
use std::{env, fs, path::PathBuf};

use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

const EBPF_PACKAGE: &str = "flannel-ebpf";

fn skip_requested() -> bool {
    env::var("AYA_BUILD_SKIP").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR is not set")?);
    let object = out_dir.join("flannel-ebpf");

    if skip_requested() {
        fs::write(&object, b"").with_context(|| format!("writing stub {}", object.display()))?;
        return Ok(());
    }

    if which_bpf_linker().is_none() {
        return Err(anyhow!(
            "bpf-linker is not on PATH. Run `cargo xtask setup` to install the eBPF toolchain, \
             or set AYA_BUILD_SKIP=1 to build without the eBPF fast path"
        ));
    }

    let metadata = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let ebpf = metadata
        .packages
        .iter()
        .find(|p| p.name.as_str() == EBPF_PACKAGE)
        .ok_or_else(|| anyhow!("package {EBPF_PACKAGE} not found in the workspace"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("{EBPF_PACKAGE} manifest has no parent directory"))?;
    aya_build::build_ebpf(
        [Package {
            name: EBPF_PACKAGE,
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        Toolchain::default(),
    )
}

fn which_bpf_linker() -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join("bpf-linker"))
        .find(|candidate| candidate.is_file())
}
