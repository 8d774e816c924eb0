//! Feature probes: whether this kernel can run the fast path at all, checked before anything
//! is loaded so that the fallback message names the missing piece.

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported, is_map_supported, is_program_supported},
    util::KernelVersion,
};

use super::BpfError;

/// The oldest kernel the fast path loads on: the helpers below are all there (the newest,
/// `bpf_check_mtu`, since 5.12), and it is the oldest long-term kernel after them. Before TCX
/// (6.6) the programs are attached as `clsact` filters. Only 6.18 is tested here; on kernels
/// before 6.3, whose `bpf_skb_adjust_room` lacks the decapsulation flags, tunnel packets the
/// programs cannot decapsulate go to the kernel's devices, packet by packet.
pub const MIN_KERNEL: (u8, u8) = (5, 15);

/// The oldest kernel with TCX links (pinnable, atomically replaceable TC attachments).
pub const TCX_KERNEL: (u8, u8) = (6, 6);

/// Whether this kernel has TCX links.
pub fn tcx_supported() -> bool {
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(TCX_KERNEL.0, TCX_KERNEL.1, 0))
}

/// Checks the kernel version, the program and map types and the helpers the programs call.
pub fn probe() -> Result<(), BpfError> {
    let version = KernelVersion::current().map_err(|e| BpfError::Unsupported {
        what: format!("version detection ({e})"),
    })?;
    if version < KernelVersion::new(MIN_KERNEL.0, MIN_KERNEL.1, 0) {
        return Err(BpfError::Unsupported {
            what: format!(
                "a kernel this old (Linux >= {}.{} needed, this is {version:?})",
                MIN_KERNEL.0, MIN_KERNEL.1
            ),
        });
    }
    if !is_program_supported(ProgramType::SchedClassifier).unwrap_or(false) {
        return Err(BpfError::Unsupported {
            what: "TC (sched_cls) programs; is the agent missing CAP_BPF/CAP_NET_ADMIN?".into(),
        });
    }
    for (map, name) in [
        (MapType::LpmTrie, "LPM trie maps"),
        (MapType::LruHash, "LRU hash maps"),
        (MapType::PerCpuArray, "per-CPU array maps"),
    ] {
        if !is_map_supported(map).unwrap_or(false) {
            return Err(BpfError::Unsupported { what: name.into() });
        }
    }
    for (helper, name) in [
        (BpfHelper::BPF_FUNC_fib_lookup, "bpf_fib_lookup"),
        (BpfHelper::BPF_FUNC_redirect_neigh, "bpf_redirect_neigh"),
        (BpfHelper::BPF_FUNC_redirect_peer, "bpf_redirect_peer"),
        (
            BpfHelper::BPF_FUNC_ktime_get_coarse_ns,
            "bpf_ktime_get_coarse_ns",
        ),
        (BpfHelper::BPF_FUNC_jiffies64, "bpf_jiffies64"),
        (BpfHelper::BPF_FUNC_skb_adjust_room, "bpf_skb_adjust_room"),
        (BpfHelper::BPF_FUNC_check_mtu, "bpf_check_mtu"),
        (BpfHelper::BPF_FUNC_get_hash_recalc, "bpf_get_hash_recalc"),
    ] {
        if !is_helper_supported(ProgramType::SchedClassifier, helper).unwrap_or(false) {
            return Err(BpfError::Unsupported {
                what: format!("the {name} helper for TC programs"),
            });
        }
    }
    Ok(())
}
