//! The `bpf(2)` syscall itself, for the commands aya 0.14 does not wrap (batch map operations,
//! a link's interface, pinning and opening by path with a descriptor of our own).

use std::{io, mem::size_of};

/// `bpf(2)` with `cmd` and the member of `union bpf_attr` it takes, `attr` (a `#[repr(C)]`
/// struct with no padding the kernel could read: bytes past the command's fields must be
/// zero); the syscall's return value.
///
/// # Safety
/// The pointers inside `attr` must describe memory that `cmd` may read and write.
pub unsafe fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<i32> {
    // SAFETY: `attr` is alive and `size_of::<T>()` bytes long; the caller vouches for the
    // pointers inside it.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<T>()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        i32::try_from(rc).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))
    }
}
