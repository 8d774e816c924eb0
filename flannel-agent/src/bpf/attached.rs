//! Whether a TC attachment an agent made is still in place, and its pin: something else may
//! remove either while the agent runs (`bpftool link detach`, `tc qdisc del dev <if> clsact`,
//! a tool that owns the interface's hooks, the interface itself deleted, `rm` in bpffs).
//! [`super::FastPath::heal`] asks this of each attachment, attaches again what is gone and
//! pins again what lost its pin.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use super::sys::bpf;

/// `BPF_OBJ_PIN` (`enum bpf_cmd`).
const BPF_OBJ_PIN: libc::c_long = 6;
/// `BPF_OBJ_GET` (`enum bpf_cmd`).
const BPF_OBJ_GET: libc::c_long = 7;
/// `BPF_OBJ_GET_INFO_BY_FD` (`enum bpf_cmd`).
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
/// Room for `struct bpf_link_info` (120 bytes on 6.18); the kernel fills in what it has and
/// requires the rest to be zero.
const LINK_INFO_LEN: usize = 256;
/// Where `struct bpf_link_info` keeps a TCX link's interface: after `type`, `id` and `prog_id`
/// (three `u32`), the union of the link types' details, 8-byte aligned, whose `tcx` member
/// starts with `ifindex`.
const TCX_IFINDEX_OFFSET: usize = 16;

/// The `obj` member of `union bpf_attr` (`BPF_OBJ_GET`).
#[repr(C)]
#[derive(Default)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    /// The struct's padding, spelled out: the kernel refuses (`EINVAL`) an attribute whose
    /// bytes after the command's last field are not zero.
    _pad: u32,
}

/// The `info` member of `union bpf_attr`.
#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The interface the TCX link `link` runs its program on; 0 once the link is detached (by
/// `BPF_LINK_DETACH`, or with its interface).
pub fn tcx_ifindex(link: BorrowedFd<'_>) -> io::Result<u32> {
    let mut info = [0u8; LINK_INFO_LEN];
    let mut attr = InfoAttr {
        bpf_fd: link.as_raw_fd() as u32,
        info_len: LINK_INFO_LEN as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: `attr` points at `info`, `LINK_INFO_LEN` bytes alive for the call, which the
    // kernel writes at most `info_len` of.
    unsafe { bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr) }?;
    let bytes = info
        .get(TCX_IFINDEX_OFFSET..TCX_IFINDEX_OFFSET + 4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidData))?;
    Ok(u32::from_ne_bytes(bytes))
}

/// Pins the object behind `fd` at `path` (`BPF_OBJ_PIN`; the directory must exist).
pub fn pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let path = c_path(path)?;
    let mut attr = ObjAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        ..ObjAttr::default()
    };
    // SAFETY: `attr` points at `path`, a NUL-terminated string alive for the call.
    unsafe { bpf(BPF_OBJ_PIN, &mut attr) }?;
    Ok(())
}

/// `path` as the kernel takes it.
fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// A new descriptor of the object pinned at `pin` (`BPF_OBJ_GET`, which `CAP_BPF` allows,
/// unlike opening a link by id).
pub fn open_pinned(pin: &Path) -> io::Result<OwnedFd> {
    let path = c_path(pin)?;
    let mut attr = ObjAttr {
        pathname: path.as_ptr() as u64,
        ..ObjAttr::default()
    };
    // SAFETY: `attr` points at `path`, a NUL-terminated string alive for the call.
    let fd = unsafe { bpf(BPF_OBJ_GET, &mut attr) }?;
    // SAFETY: on success `BPF_OBJ_GET` returns a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
