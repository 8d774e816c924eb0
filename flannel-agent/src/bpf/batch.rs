//! Reading every key of a hash map in batches (`BPF_MAP_LOOKUP_BATCH`, Linux 5.6): one syscall
//! per few thousand entries instead of one per key (`BPF_MAP_GET_NEXT_KEY`, what aya's
//! iterators do), which is most of what a walk over a large held flow table costs
//! ([`super::seed`]). aya 0.14 has no batch API, so this is the syscall itself.

use std::{
    io,
    mem::size_of,
    os::fd::{AsFd as _, AsRawFd as _},
};

use aya::maps::MapData;

/// `BPF_MAP_LOOKUP_BATCH` (`enum bpf_cmd`).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// The kernel's `ENOTSUPP` (not `EOPNOTSUPP`): a map type without batch operations.
const ENOTSUPP: i32 = 524;
/// Entries asked for per call (a hash bucket never holds more).
const BATCH: usize = 4096;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Every key of the hash map `map`, whose keys are `K` and values `value_size` bytes, read in
/// batches. `Ok(None)` when the kernel or the map type has no batch lookup (the caller walks
/// the keys one by one instead).
pub fn keys<K: aya::Pod>(map: &MapData, value_size: usize) -> io::Result<Option<Vec<K>>> {
    let fd = map.fd().as_fd().as_raw_fd();
    let key_size = size_of::<K>();
    let mut key_buf = vec![0u8; BATCH * key_size];
    let mut value_buf = vec![0u8; BATCH * value_size.max(1)];
    // A hash map's batch token: the bucket to go on from.
    let mut token: u32 = 0;
    let mut out = Vec::new();
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { (&raw const token) as u64 },
            out_batch: (&raw mut token) as u64,
            keys: key_buf.as_mut_ptr() as u64,
            values: value_buf.as_mut_ptr() as u64,
            count: BATCH as u32,
            map_fd: fd as u32,
            ..BatchAttr::default()
        };
        // SAFETY: `attr` describes buffers of `BATCH` keys and values of this map's sizes and a
        // token of the size a hash map's batch takes, all alive for the call; the kernel reads
        // and writes no more than that.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &raw mut attr,
                size_of::<BatchAttr>(),
            )
        };
        let err = (rc < 0).then(io::Error::last_os_error);
        // The kernel says how many entries it filled in, also with the last batch (ENOENT).
        let filled = (attr.count as usize).min(BATCH);
        out.extend(key_buf.chunks_exact(key_size).take(filled).map(|bytes| {
            // SAFETY: `bytes` holds a key the kernel copied out, `size_of::<K>()` bytes;
            // `K: Pod` takes any bit pattern, read unaligned from the byte buffer.
            unsafe { bytes.as_ptr().cast::<K>().read_unaligned() }
        }));
        match err {
            // (A kernel that found nothing more says ENOENT; an empty batch ends it too.)
            None if filled == 0 => return Ok(Some(out)),
            None => first = false,
            Some(e) => {
                return match e.raw_os_error() {
                    Some(libc::ENOENT) => Ok(Some(out)),
                    Some(libc::EINVAL | ENOTSUPP | libc::EOPNOTSUPP) if first => Ok(None),
                    _ => Err(e),
                };
            }
        }
    }
}
