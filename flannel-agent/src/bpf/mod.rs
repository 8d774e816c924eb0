//! The eBPF fast path, agent side: loading, pinning, attaching, map sync, counters, cleanup.
//!
//! The reconciler computes one desired model and hands it to two appliers; this is the eBPF
//! one. The kernel path (routes, `flannel.<VNI>` with neighbours and FDB, masquerade) is always
//! configured as well: whatever the programs do not handle, and everything when they are
//! detached, goes through it.
//!
//! # Lifecycle (what the daemon calls, in this order)
//!
//! ```text
//! let startup = bpf::start(mode, pin_path)?;        // --dataplane auto|ebpf|kernel
//! if let Some(line) = startup.fallback_message() { warn!("{line}") }
//! if let Startup::FastPath(mut fp) = startup {
//!     fp.set_config(&LocalConfig { .. })?;          // after the lease: public IP, subnet, VTEP
//!     fp.sync(&desired)?;                            // reconciler: subnet -> Remote, every pass
//!     fp.seed(&seed::collect(&fp.seed_scope()?)?)?;  // open NATed connections stay in the kernel
//!     fp.attach_netdev(ext_ifindex, false)?;         // external interface (XDP: opt-in)
//!     fp.sync_ports(&macs)?; fp.attach_ports(&veths)?; // port watcher: cni0's FDB and veth ports
//!                                                    // (seeding again before new ports)
//!     fp.counters()?;                                // metrics / status
//! }
//! ```
//!
//! `sync` before `attach_*` matters on upgrades: attaching replaces the program behind a link
//! pinned by the previous agent atomically, and the new program reads this object's maps at
//! once. With the same layout version the maps are the pinned ones, entries intact, so a
//! restart forwards without a gap.
//!
//! # Modes (`--dataplane`)
//!
//! - `kernel`: never loads; removes the pins (links, maps) of a previous eBPF run so the kernel
//!   path is really the one in use.
//! - `ebpf`: loads or fails ([`BpfError`]); pins of an earlier run stay in place.
//! - `auto`: loads; on any failure removes leftovers like `kernel` and reports the reason for
//!   the daemon's single `falling back to the kernel path: <reason>` line.
//!
//! # What the kernel applier must provide for the programs
//!
//! - host-gw and DirectRouting peers: `<subnet> via <peer public IP> dev <ext>` (the programs
//!   route by `bpf_fib_lookup`); `net.ipv4.ip_forward = 1`.
//! - vxlan peers: upstream's `flannel.<VNI>` setup (it receives what kernel-path peers send and
//!   carries host traffic); the entries carry the peer's VtepMAC.
//! - udp peers: the TUN path as it is (`flannel0`, `<Network> dev flannel0`, the forwarder
//!   bound to `IfaceAddr:Port`); the programs need [`FastPath::set_udp`] with the same address
//!   and port.
//! - ipip peers (no kernel IPIP device is needed): `<subnet> via <next hop towards the peer's
//!   public IP> dev <ext> onlink mtu <ext MTU - 20>`, so that host-originated packets leave
//!   through the external interface, where `tc_to_netdev` encapsulates them; the pod MTU is
//!   ext MTU - 20 as upstream's.
//!
//! | module | job |
//! |---|---|
//! | [`applier`] | the reconciler's eBPF applier (desired model → route map) and the metrics source |
//! | [`fastpath`] | [`FastPath`]: load, config, sync, attach/detach, counters |
//! | [`handover`] | the way back: the fast path's connections entered into conntrack before detaching |
//! | [`config`] | [`LocalConfig`] |
//! | [`netdev`] | following the external interface to a new index; configuration flags |
//! | [`nat`] | masquerade in eBPF: [`NatSettings`], map sizing, flows read-out, sweep |
//! | [`remote`] | [`Remote`] / [`Via`] and the diff behind `sync` |
//! | [`seed`] | open NATed connections (from conntrack) written into the flow tables before attaching |
//! | [`pins`] | the pin layout, adopted-map checks, cleanup |
//! | [`probe`] | kernel feature probes |
//! | [`programs`] | loading the programs (in parallel) and what the verifier reported |
//! | [`tcfilter`] | TC attachment as `clsact` filters, for kernels without TCX links |
//! | [`counters`] | [`Counters`] |
//! | [`error`] | [`BpfError`] |
//! | [`udp`] | [`UdpLocal`]: the udp backend's encapsulation on the fast path |
//! | [`ports`] | local pods' bridge ports (FDB mirror) for delivery into their namespace |
//! | [`v6`] | [`LocalConfig6`], [`Remote6`]: IPv6 on the fast path |

pub mod applier;
pub mod attached;
pub mod batch;
pub mod config;
pub mod counters;
pub mod drift;
pub mod error;
pub mod fastpath;
pub mod handover;
pub mod held;
pub mod nat;
pub mod netdev;
pub mod pins;
pub mod ports;
pub mod probe;
pub mod programs;
pub mod remote;
pub mod seed;
mod sys;
pub mod tcfilter;
pub mod udp;
pub mod v6;

use std::{fmt, path::Path, str::FromStr};

pub use applier::{BpfApplier, FastPathCounters, SharedFastPath};
pub use config::{LocalConfig, VxlanLocal};
pub use counters::{Counters, Learnt, ReasonCounters};
pub use error::BpfError;
pub use fastpath::{
    Attached, FastPath, Healed, Hook, LoadOptions, NetdevAttach, PortAttach, TcAttach,
};
pub use held::HeldSizing;
pub use nat::{NatFlow, NatSettings, NatSizing, NatTimeouts, SweepStats};
pub use pins::PinLayout;
pub use remote::{Remote, SyncStats, Via};
pub use udp::UdpLocal;
pub use v6::{LocalConfig6, Remote6};

/// `--dataplane`: which data path forwards pod traffic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DataplaneMode {
    /// Use the eBPF fast path if it loads, the kernel path otherwise.
    #[default]
    Auto,
    /// The eBPF fast path or nothing (fail if it cannot load).
    Ebpf,
    /// The kernel path only; remove leftovers of an earlier eBPF run.
    Kernel,
}

impl FromStr for DataplaneMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(DataplaneMode::Auto),
            "ebpf" => Ok(DataplaneMode::Ebpf),
            "kernel" => Ok(DataplaneMode::Kernel),
            other => Err(format!(
                "invalid --dataplane {other:?}: expected auto, ebpf or kernel"
            )),
        }
    }
}

impl fmt::Display for DataplaneMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DataplaneMode::Auto => "auto",
            DataplaneMode::Ebpf => "ebpf",
            DataplaneMode::Kernel => "kernel",
        })
    }
}

/// The outcome of [`start`].
#[derive(Debug)]
pub enum Startup {
    /// The fast path is loaded (not attached yet).
    FastPath(Box<FastPath>),
    /// The kernel path alone forwards.
    KernelPath {
        /// Why the fast path is not in use (`None` for `--dataplane kernel`).
        reason: Option<BpfError>,
        /// Removing an earlier run's pins failed (the old programs may still be attached).
        cleanup_error: Option<BpfError>,
    },
}

impl Startup {
    /// The line to log when `auto` fell back to the kernel path.
    pub fn fallback_message(&self) -> Option<String> {
        match self {
            Startup::KernelPath {
                reason: Some(reason),
                cleanup_error,
            } => Some(match cleanup_error {
                None => format!("falling back to the kernel path: {reason}"),
                Some(e) => format!(
                    "falling back to the kernel path: {reason} (and removing the previous eBPF \
                     run's pins failed: {e})"
                ),
            }),
            _ => None,
        }
    }
}

/// Applies `--dataplane` with pins under `pin_path` (`--bpf-pin-path`). Only `ebpf` returns
/// an error (the load failure); `kernel` fails only if removing old pins fails.
pub fn start(mode: DataplaneMode, pin_path: &Path) -> Result<Startup, BpfError> {
    start_with(mode, pin_path, &LoadOptions::default())
}

/// [`start`] with load-time options (map sizes).
pub fn start_with(
    mode: DataplaneMode,
    pin_path: &Path,
    options: &LoadOptions,
) -> Result<Startup, BpfError> {
    match mode {
        DataplaneMode::Kernel => {
            cleanup(pin_path)?;
            Ok(Startup::KernelPath {
                reason: None,
                cleanup_error: None,
            })
        }
        DataplaneMode::Ebpf => FastPath::load_with(pin_path, options)
            .map(|fast_path| Startup::FastPath(Box::new(fast_path))),
        DataplaneMode::Auto => match FastPath::load_with(pin_path, options) {
            Ok(fast_path) => Ok(Startup::FastPath(Box::new(fast_path))),
            Err(reason) => Ok(Startup::KernelPath {
                reason: Some(reason),
                cleanup_error: cleanup(pin_path).err(),
            }),
        },
    }
}

/// Removes every pin under `pin_path` (links first, which detaches the programs once the
/// connections they carried are entered into conntrack, see [`handover`]; then the maps of
/// every layout version) and the programs' `clsact` filters on every interface of this
/// network namespace. Returns how many pins and filters were removed; a missing directory is
/// fine.
pub fn cleanup(pin_path: &Path) -> Result<usize, BpfError> {
    let layout = PinLayout::new(pin_path);
    let handed = handover::detach_handing_over(&layout);
    let filters: usize = Hook::ALL
        .iter()
        .map(|hook| {
            tcfilter::sweep(
                hook.program(),
                hook.attach_type(),
                &std::collections::BTreeSet::new(),
            )
        })
        .sum();
    Ok(handed.links + layout.remove_all()? + filters)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calls of `object` (an eBPF ELF object) to the compiler's memory builtins, as
    /// `builtin from function+offset`.
    fn memory_builtin_calls(object: &[u8]) -> Vec<String> {
        use object::{Object as _, ObjectSection as _, ObjectSymbol as _, RelocationTarget};
        let file = object::File::parse(object).expect("the eBPF object parses");
        let mut calls = Vec::new();
        for section in file.sections() {
            for (offset, reloc) in section.relocations() {
                let RelocationTarget::Symbol(index) = reloc.target() else {
                    continue;
                };
                let name = file.symbol_by_index(index).and_then(|s| s.name());
                let Ok(builtin @ ("memset" | "memcpy" | "memmove" | "memcmp")) = name else {
                    continue;
                };
                let caller = file
                    .symbols()
                    .filter(|s| s.section_index() == Some(section.index()) && s.size() > 0)
                    .find(|s| (s.address()..s.address() + s.size()).contains(&offset))
                    .and_then(|s| Some((s.name().ok()?.to_owned(), offset - s.address())))
                    .unwrap_or_else(|| (section.name().unwrap_or("?").to_owned(), offset));
                calls.push(format!("{builtin} from {}+{:#x}", caller.0, caller.1));
            }
        }
        calls
    }

    /// LLVM's BPF backend in this toolchain expands no zero-fill or copy inline: `[0; N]`,
    /// `mem::zeroed()`, a key's zero padding or a large assignment each become a call to the
    /// object's own `memset`/`memmove`, a byte loop (eight instructions a byte) run on every
    /// packet. The programs avoid them (`flannel_ebpf::zeroed`, `copy_words`); this keeps it
    /// so.
    #[test]
    fn the_ebpf_object_calls_no_byte_wise_memory_builtins() {
        if crate::EBPF_OBJECT.is_empty() {
            eprintln!("skipped: built with AYA_BUILD_SKIP=1");
            return;
        }
        let calls = memory_builtin_calls(crate::EBPF_OBJECT);
        assert!(
            calls.is_empty(),
            "{} calls to memory builtins (find the zero-fill or copy in each caller):\n{}",
            calls.len(),
            calls.join("\n")
        );
    }

    #[test]
    fn modes_parse_and_print() {
        for mode in [
            DataplaneMode::Auto,
            DataplaneMode::Ebpf,
            DataplaneMode::Kernel,
        ] {
            assert_eq!(mode.to_string().parse::<DataplaneMode>(), Ok(mode));
        }
        let err = "xdp".parse::<DataplaneMode>().expect_err("invalid");
        assert!(err.contains("\"xdp\"") && err.contains("auto, ebpf or kernel"));
    }

    #[test]
    fn fallback_message_names_the_reason() {
        let startup = Startup::KernelPath {
            reason: Some(BpfError::NoObject),
            cleanup_error: None,
        };
        assert_eq!(
            startup.fallback_message().as_deref(),
            Some(
                "falling back to the kernel path: this agent was built without the eBPF \
                 object (AYA_BUILD_SKIP=1)"
            )
        );
        let kernel = Startup::KernelPath {
            reason: None,
            cleanup_error: None,
        };
        assert_eq!(kernel.fallback_message(), None);
    }

    #[test]
    fn cleanup_of_a_missing_directory_is_fine() {
        let dir = std::env::temp_dir().join(format!("flannel-bpf-none-{}", std::process::id()));
        assert_eq!(cleanup(&dir).ok(), Some(0));
    }
}
