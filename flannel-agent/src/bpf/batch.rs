//! Reading every entry of a map, and writing many entries, in batches
//! (`BPF_MAP_LOOKUP_BATCH`, `BPF_MAP_UPDATE_BATCH`, Linux 5.6): one syscall per few thousand
//! entries instead of one per key (`BPF_MAP_GET_NEXT_KEY`, `BPF_MAP_UPDATE_ELEM`, what aya's
//! maps do), which is most of what a read of conntrack into large flow tables costs
//! ([`super::seed`]) and what a read of the route and node maps cost. aya 0.14 has no batch
//! API, so these are the syscalls themselves. Every kernel the fast path loads on (>= 5.15) has
//! them for hash, LRU hash and LPM trie maps, the only maps they are used on: there is no
//! one-entry-at-a-time fallback, and a kernel or map without them is an error
//! ([`io::ErrorKind::Unsupported`]).

use std::{
    io,
    mem::size_of,
    os::fd::{AsFd as _, AsRawFd as _},
};

use aya::maps::MapData;

use super::sys::bpf;

/// `BPF_ANY`: insert or update (the `flags` of a map update).
pub const BPF_ANY: u64 = 0;
/// `BPF_NOEXIST`: insert only when the key is absent.
pub const BPF_NOEXIST: u64 = 1;

/// `BPF_MAP_LOOKUP_BATCH` (`enum bpf_cmd`).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// `BPF_MAP_UPDATE_BATCH` (`enum bpf_cmd`).
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
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

/// The data of `map` if it is a map these operations serve: a hash or LRU hash map, or an
/// LPM trie (the route maps; the kernel's generic batch lookup keys its batches by the last
/// key read, Linux 5.6).
pub fn batch_data(map: &aya::maps::Map) -> io::Result<&MapData> {
    match map {
        aya::maps::Map::HashMap(data)
        | aya::maps::Map::LruHashMap(data)
        | aya::maps::Map::LpmTrie(data) => Ok(data),
        _ => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "not a hash, LRU hash or LPM trie map",
        )),
    }
}

/// Every entry of the map `map` (keys `K`, values `V`), read as [`keys`] does.
pub fn entries<K: aya::Pod, V: aya::Pod>(map: &MapData) -> io::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    for_each_batch::<K, V>(map, |batch| {
        out.extend(batch);
        Ok(())
    })?;
    Ok(out)
}

/// Every key of the map `map` (a hash map, or any map the kernel's batch lookup serves), whose
/// keys are `K` and values `value_size` bytes, read in batches.
pub fn keys<K: aya::Pod>(map: &MapData, value_size: usize) -> io::Result<Vec<K>> {
    let mut out = Vec::new();
    lookup_all(map, size_of::<K>(), value_size, |keys, _| {
        out.extend(keys.map(read_pod::<K>));
        Ok(())
    })?;
    Ok(out)
}

/// Calls `each` with every batch of entries of the map `map` (keys `K`, values `V`), read as
/// [`keys`] does, holding one batch at a time; the first error `each` returns ends the read
/// and is returned.
pub fn for_each_batch<K: aya::Pod, V: aya::Pod>(
    map: &MapData,
    mut each: impl FnMut(Vec<(K, V)>) -> io::Result<()>,
) -> io::Result<()> {
    lookup_all(map, size_of::<K>(), size_of::<V>(), |keys, values| {
        each(
            keys.map(read_pod::<K>)
                .zip(values.map(read_pod::<V>))
                .collect(),
        )
    })
}

/// A `T` from the front of `bytes`, which holds at least `size_of::<T>()` bytes the kernel
/// copied out.
fn read_pod<T: aya::Pod>(bytes: &[u8]) -> T {
    assert!(bytes.len() >= size_of::<T>());
    // SAFETY: `bytes` holds at least `size_of::<T>()` bytes (checked above); `T: Pod` takes
    // any bit pattern, read unaligned from the byte buffer.
    unsafe { bytes.as_ptr().cast::<T>().read_unaligned() }
}

/// Reads every entry of the map `map` (keys `key_size` bytes, values `value_size`) with
/// `BPF_MAP_LOOKUP_BATCH`, calling `each` with the bytes of each batch's keys and values (one
/// item per entry); an error of `each` ends the read.
fn lookup_all(
    map: &MapData,
    key_size: usize,
    value_size: usize,
    mut each: impl FnMut(
        std::slice::ChunksExact<'_, u8>,
        std::slice::ChunksExact<'_, u8>,
    ) -> io::Result<()>,
) -> io::Result<()> {
    let fd = map.fd().as_fd().as_raw_fd();
    let value_size = value_size.max(1);
    let mut key_buf = vec![0u8; BATCH * key_size];
    let mut value_buf = vec![0u8; BATCH * value_size];
    // The batch token: a bucket index (4 bytes) for a hash map, the last key read for the
    // maps the kernel's generic batch serves (an LPM trie): room for either.
    let mut token = vec![0u64; key_size.div_ceil(8).max(1)];
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { token.as_ptr() as u64 },
            out_batch: token.as_mut_ptr() as u64,
            keys: key_buf.as_mut_ptr() as u64,
            values: value_buf.as_mut_ptr() as u64,
            count: BATCH as u32,
            map_fd: fd as u32,
            ..BatchAttr::default()
        };
        // SAFETY: `attr` describes buffers of `BATCH` keys and values of this map's sizes and a
        // token as large as a key (and at least the 4 bytes of a hash map's), all alive for the
        // call; the kernel reads and writes no more than that.
        let err = unsafe { bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) }.err();
        // The kernel says how many entries it filled in, also with the last batch (ENOENT).
        let filled = (attr.count as usize).min(BATCH);
        if filled > 0 {
            each(
                key_buf[..filled * key_size].chunks_exact(key_size),
                value_buf[..filled * value_size].chunks_exact(value_size),
            )?;
        }
        match err {
            // (A kernel that found nothing more says ENOENT; an empty batch ends it too.)
            None if filled == 0 => return Ok(()),
            None => first = false,
            Some(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
            Some(e) => return Err(if first { unsupported(e, "lookup") } else { e }),
        }
    }
}

/// Writes `values[i]` under `keys[i]` into the map `map` (whose keys are `K` and values `V`)
/// with `flags` (`BPF_ANY`, ...), a few thousand entries a syscall. An error after some were
/// written is returned as is.
pub fn update<K: aya::Pod, V: aya::Pod>(
    map: &MapData,
    keys: &[K],
    values: &[V],
    flags: u64,
) -> io::Result<()> {
    if keys.len() != values.len() {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let fd = map.fd().as_fd().as_raw_fd();
    for (first, (keys, values)) in keys.chunks(BATCH).zip(values.chunks(BATCH)).enumerate() {
        let mut attr = BatchAttr {
            keys: keys.as_ptr() as u64,
            values: values.as_ptr() as u64,
            count: keys.len() as u32,
            map_fd: fd as u32,
            elem_flags: flags,
            ..BatchAttr::default()
        };
        // SAFETY: `attr` describes `count` keys and values of this map's sizes, alive for the
        // call; the kernel only reads them.
        if let Err(e) = unsafe { bpf(BPF_MAP_UPDATE_BATCH, &mut attr) } {
            return Err(if first == 0 {
                unsupported(e, "update")
            } else {
                e
            });
        }
    }
    Ok(())
}

/// The error of a first batch call: [`io::ErrorKind::Unsupported`] when it says the kernel
/// or the map type has no batch `op` (`EINVAL`, `ENOTSUPP`, `EOPNOTSUPP`), as is otherwise.
fn unsupported(e: io::Error, op: &str) -> io::Error {
    match e.raw_os_error() {
        Some(libc::EINVAL | ENOTSUPP | libc::EOPNOTSUPP) => io::Error::new(
            io::ErrorKind::Unsupported,
            format!("no batch {op} for this map (hash maps have it from Linux 5.6): {e}"),
        ),
        _ => e,
    }
}
