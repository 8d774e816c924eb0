//! Test kit for flannel's integration tests, benchmarks and the `flannel-lab` topology:
//! network namespaces with a per-run prefix that are always cleaned up, a real etcd on
//! loopback, and helpers to run commands inside namespaces.
//!
//! Everything created here carries [`netns::run_prefix`] in its name, so concurrent runs never
//! collide and leftovers of a crashed run can be recognised (and only those are ever removed).

pub mod bench;
pub mod bpfrig;
pub mod etcd;
pub mod kube_mock;
pub mod lab;
pub mod netns;
pub mod packet;
pub mod topology;

/// Skips the calling test (returns early with a message) unless running as root, which
/// network namespaces, netlink writes and BPF need.
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::is_root() {
            eprintln!("skipped: needs root (network namespaces, netlink, BPF)");
            return;
        }
    };
}

/// Skips the calling test (returns early with a message) when `flannel-agent` was built
/// without its eBPF object (`AYA_BUILD_SKIP=1`).
#[macro_export]
macro_rules! require_ebpf_object {
    () => {
        if !$crate::has_ebpf_object() {
            eprintln!("skipped: flannel-agent was built with AYA_BUILD_SKIP=1");
            return;
        }
    };
}

/// Whether `flannel-agent` carries its eBPF object.
pub fn has_ebpf_object() -> bool {
    !flannel_agent::EBPF_OBJECT.is_empty()
}

/// Ends a test whose body returns a `Result`: panics with the whole error chain.
pub fn check(result: anyhow::Result<()>) {
    if let Err(e) = result {
        panic!("{e:#}");
    }
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
