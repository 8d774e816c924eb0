//! The TC programs attached the way kernels without TCX links (before Linux 6.6) allow: as a
//! direct-action `bpf` filter under a `clsact` qdisc, at this agent's own priority and handle.
//!
//! A filter is not a pinnable link: it lives as long as its interface, whether or not an agent
//! runs, which gives the same restart without a gap as a pinned TCX link. The next agent swaps
//! its program in by replacing the filter at the same priority and handle (one netlink request,
//! atomic: no packet meets an empty hook), and the agent removes its filters by that priority
//! and handle, or by program name on every interface for the ones an earlier run left on
//! interfaces it no longer uses. The `clsact` qdisc itself stays: other tools' filters may
//! live under it, and an empty one costs nothing.

use std::collections::BTreeSet;

use aya::programs::{
    Link as _, ProgramError, SchedClassifier, TcAttachType,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
};

use super::fastpath::Attached;
use crate::netlink::raw::{self, MessageBuilder, NLM_F_DUMP, NLM_F_REQUEST, RawSocket};

/// The filters' priority (`tc filter ... pref`): ours alone, so that the agent never replaces
/// or removes a filter another tool installed ("FL").
pub const PRIORITY: u16 = 0x464c;

/// The filters' handle at [`PRIORITY`].
pub const HANDLE: TcHandle = TcHandle::new(0, 1);

/// Attaches `program` to `if_name`'s `attach_type` hook as this agent's filter: replaces the
/// program of the filter an earlier run left there ([`Attached::Replaced`]), or creates the
/// `clsact` qdisc (when missing) and the filter ([`Attached::New`]). The filter is left in the
/// kernel when this process exits.
pub fn attach(
    program: &mut SchedClassifier,
    if_name: &str,
    attach_type: TcAttachType,
) -> Result<Attached, String> {
    let existing = SchedClassifierLink::attached(if_name, attach_type, PRIORITY, HANDLE, None)
        .map_err(|e| e.to_string())?;
    let (id, outcome) = match program.attach_to_link(existing) {
        Ok(id) => (id, Attached::Replaced),
        Err(_) => {
            // No filter of ours there yet. The qdisc may already exist (another tool's
            // filters): an error here is only reported if the attach then fails too.
            let qdisc = tc::qdisc_add_clsact(if_name).err();
            let options = TcAttachOptions::Netlink(NlOptions {
                priority: PRIORITY,
                handle: HANDLE,
                classid: None,
            });
            let id = program
                .attach_with_options(if_name, attach_type, options)
                .map_err(|e| match qdisc {
                    Some(q) => format!("{e} (adding the clsact qdisc: {q})"),
                    None => e.to_string(),
                })?;
            (id, Attached::New)
        }
    };
    let link = program.take_link(id).map_err(|e| e.to_string())?;
    // Dropping the link would remove the filter: it must outlive this process.
    std::mem::forget(link);
    Ok(outcome)
}

/// Whether `errno` from a filter lookup or removal says there is nothing to remove: no
/// `clsact` qdisc (`EINVAL`), no such filter (`ENOENT`), or no such interface (`ENODEV`), whose
/// filters went with it.
fn absent(errno: Option<i32>) -> bool {
    matches!(
        errno,
        Some(libc::ENOENT) | Some(libc::EINVAL) | Some(libc::ENODEV)
    )
}

/// Removes this agent's filter from `if_name`'s `attach_type` hook: `Ok(false)` when there was
/// none (`absent`).
pub fn detach(if_name: &str, attach_type: TcAttachType) -> Result<bool, String> {
    let link = match SchedClassifierLink::attached(if_name, attach_type, PRIORITY, HANDLE, None) {
        Ok(link) => link,
        Err(e) if absent(e.raw_os_error()) => return Ok(false),
        Err(e) => return Err(format!("{if_name}: {e}")),
    };
    match link.detach() {
        Ok(()) => Ok(true),
        Err(ProgramError::NetlinkError(e)) if absent(e.raw_os_error()) => Ok(false),
        Err(e) => Err(format!("{if_name}: {e}")),
    }
}

/// Removes the filters running `program` (by name: this agent's programs) from the
/// `attach_type` hook of every interface of this network namespace whose index is not in
/// `keep`: what an earlier run left where this one does not run it as a filter. Returns how
/// many interfaces had one; a filter that is there but cannot be removed is logged.
pub fn sweep(program: &str, attach_type: TcAttachType, keep: &BTreeSet<u32>) -> usize {
    let interfaces = match nix::net::if_::if_nameindex() {
        Ok(interfaces) => interfaces,
        Err(errno) => {
            tracing::warn!(program, %errno, "listing interfaces for stale clsact filters");
            return 0;
        }
    };
    let mut removed = 0;
    for interface in interfaces.iter().filter(|i| !keep.contains(&i.index())) {
        let Ok(name) = interface.name().to_str() else {
            continue;
        };
        match tc::qdisc_detach_program(name, attach_type, program) {
            Ok(()) => removed += 1,
            // None there (`NotFound`), or no qdisc or interface.
            Err(TcError::IoError(e))
                if e.kind() == std::io::ErrorKind::NotFound || absent(e.raw_os_error()) => {}
            Err(TcError::NetlinkError(e)) if absent(e.raw_os_error()) => {}
            Err(error) => tracing::warn!(
                program,
                interface = name,
                %error,
                "could not remove a clsact filter of an earlier run"
            ),
        }
    }
    removed
}

/// `RTM_GETTFILTER` / `RTM_NEWTFILTER`.
const RTM_GETTFILTER: u16 = 46;
const RTM_NEWTFILTER: u16 = 44;
/// `TCA_KIND`, `TCA_OPTIONS`, and `TCA_BPF_ID` inside the options of a `bpf` filter.
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_ID: u16 = 11;
/// `struct tcmsg` is 20 bytes: family, padding, ifindex, handle, parent, info.
const TCMSG_LEN: usize = 20;
/// The `clsact` parents of the ingress and egress hooks (`TC_H_MAKE(TC_H_CLSACT,
/// TC_H_MIN_INGRESS)` and `..._EGRESS`).
const CLSACT_PARENTS: [u32; 2] = [0xFFFF_FFF2, 0xFFFF_FFF3];

/// The ids of the programs behind this agent's filters (at [`PRIORITY`]) on every interface
/// of this network namespace, either hook: what an earlier run attached as filters, for
/// `super::handover`. Interfaces or hooks that cannot be read are skipped.
pub fn program_ids() -> BTreeSet<u32> {
    let mut ids = BTreeSet::new();
    let Ok(interfaces) = nix::net::if_::if_nameindex() else {
        return ids;
    };
    let Ok(mut socket) = RawSocket::open(netlink_sys::constants::NETLINK_ROUTE) else {
        return ids;
    };
    for interface in interfaces.iter() {
        for parent in CLSACT_PARENTS {
            ids.extend(filter_programs(&mut socket, interface.index(), parent).unwrap_or_default());
        }
    }
    ids
}

/// The id of the program behind this agent's filter on `ifindex`'s `attach_type` hook:
/// `Ok(None)` when there is none (the filter, the `clsact` qdisc or the interface was
/// removed); an error when the hook cannot be read.
pub fn program_id_on(ifindex: u32, attach_type: TcAttachType) -> Result<Option<u32>, String> {
    let parent = match attach_type {
        TcAttachType::Ingress => CLSACT_PARENTS[0],
        TcAttachType::Egress => CLSACT_PARENTS[1],
        TcAttachType::Custom(parent) => parent,
    };
    let mut socket =
        RawSocket::open(netlink_sys::constants::NETLINK_ROUTE).map_err(|e| e.to_string())?;
    match filter_programs(&mut socket, ifindex, parent) {
        Ok(ids) => Ok(ids.into_iter().next()),
        Err(e) if absent(e.errno()) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// The programs of this agent's filters under `parent` on `ifindex` (a dump of its filters).
fn filter_programs(
    socket: &mut RawSocket,
    ifindex: u32,
    parent: u32,
) -> Result<Vec<u32>, raw::RawError> {
    let mut ids = Vec::new();
    let ifindex = i32::try_from(ifindex).map_err(|_| raw::RawError::Errno(libc::ENODEV))?;
    let mut message = MessageBuilder::new(RTM_GETTFILTER, NLM_F_REQUEST | NLM_F_DUMP);
    let mut tcmsg = [0u8; TCMSG_LEN];
    tcmsg[4..8].copy_from_slice(&ifindex.to_ne_bytes());
    tcmsg[12..16].copy_from_slice(&parent.to_ne_bytes());
    message.header(&tcmsg);
    socket.request_each(message, |ty, payload| {
        if ty == RTM_NEWTFILTER
            && let Some(id) = our_program_id(payload)
        {
            ids.push(id);
        }
    })?;
    Ok(ids)
}

/// The program id of a filter dump entry (`tcmsg` and attributes) if it is a `bpf` filter at
/// [`PRIORITY`].
fn our_program_id(payload: &[u8]) -> Option<u32> {
    let info = raw::get_u32(payload.get(16..TCMSG_LEN)?)?;
    if info >> 16 != u32::from(PRIORITY) {
        return None;
    }
    let attrs = raw::attributes(payload.get(TCMSG_LEN..)?).ok()?;
    let kind = attrs.iter().find(|(ty, _)| *ty == TCA_KIND)?.1;
    if kind != b"bpf\0" {
        return None;
    }
    let options = attrs.iter().find(|(ty, _)| *ty == TCA_OPTIONS)?.1;
    raw::attributes(options)
        .ok()?
        .into_iter()
        .find(|(ty, _)| *ty == TCA_BPF_ID)
        .and_then(|(_, v)| raw::get_u32(v))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    fn filter(priority: u16, kind: &str, id: u32) -> Vec<u8> {
        let mut b = MessageBuilder::new(RTM_NEWTFILTER, 0);
        let mut tcmsg = [0u8; TCMSG_LEN];
        tcmsg[16..20].copy_from_slice(&((u32::from(priority) << 16) | 0x0300).to_ne_bytes());
        b.header(&tcmsg);
        b.attr_str(TCA_KIND, kind);
        b.nest_start(TCA_OPTIONS);
        b.attr_str(7, "tc_from_bridge");
        b.attr_u32(TCA_BPF_ID, id);
        b.nest_end();
        b.finish(1)
    }

    #[test]
    fn only_our_bpf_filters_give_their_program() {
        let id_of = |bytes: Vec<u8>| {
            let msgs = raw::messages(&bytes).unwrap();
            our_program_id(msgs[0].payload)
        };
        assert_eq!(id_of(filter(PRIORITY, "bpf", 42)), Some(42));
        assert_eq!(id_of(filter(PRIORITY + 1, "bpf", 42)), None);
        assert_eq!(id_of(filter(PRIORITY, "u32", 42)), None);
        assert_eq!(our_program_id(&[0; 3]), None);
    }
}
