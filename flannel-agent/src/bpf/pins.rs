//! The pin layout under `--bpf-pin-path` and what may be found there.
//!
//! ```text
//! <pin path>/
//!   v1/                       layout version (flannel_common::maps::PIN_LAYOUT_VERSION)
//!     FLANNEL_ROUTES4 ...     the pinned maps, by name
//!   links/
//!     tc_from_netdev-<ifindex>  pinned TCX links, one per program and interface
//!   memos/
//!     FLANNEL_MEMO4 ...       the attached programs' flow memos (not adopted; read by the
//!                             way back to the kernel path, see `super::handover`)
//!   resizing/
//!     FLANNEL_NAT4 ...        NAT maps of the old size, which the old programs use until
//!                             the new ones are attached (see `super::nat::take_resized`)
//! ```
//!
//! (bpffs refuses dots in the names of pinned links and programs, hence the dash.)
//!
//! Maps are adopted by a restarted agent only if their type, key and value sizes, size and
//! flags are the ones this build expects ([`MAP_SPECS`]); anything else is unpinned and
//! created afresh. Links outlive layout versions: a new agent swaps the program behind an
//! existing link atomically, and old version directories are removed afterwards.

use std::{
    fs,
    io::ErrorKind,
    mem::size_of,
    path::{Path, PathBuf},
};

use aya::maps::{MapInfo, MapType};
use flannel_common::{
    config::Config,
    flow::{FlowKey, PeerKey},
    maps as names,
    nat::{FragEntry, FragKey, NatConfig, NatEntry, NatKey, NatRevEntry},
    route::{NodeEntry, RemoteEntry, RemoteEntry6},
    stats::{COUNTER_SLOTS, Counter},
    v6::{self, Config6, FlowKey6, PeerKey6},
};

use super::BpfError;

/// `BPF_FS_MAGIC` from linux/magic.h.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// `BPF_F_NO_PREALLOC`, which LPM tries must carry.
const BPF_F_NO_PREALLOC: u32 = 1;

/// What a pinned map must look like to be adopted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MapSpec {
    /// The map's name (and pin file name).
    pub name: &'static str,
    /// Its type.
    pub map_type: MapType,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes.
    pub value_size: u32,
    /// Maximum entries.
    pub max_entries: u32,
    /// Creation flags.
    pub flags: u32,
}

/// Every pinned map of this layout version. The NAT maps' sizes are set at load time
/// ([`super::LoadOptions::nat_max_entries`]); their specs here hold the object's default.
pub const MAP_SPECS: [MapSpec; 24] = [
    MapSpec {
        name: names::ROUTES4,
        map_type: MapType::LpmTrie,
        key_size: 4 + 4,
        value_size: size_of::<RemoteEntry>() as u32,
        max_entries: names::ROUTES4_MAX_ENTRIES,
        flags: BPF_F_NO_PREALLOC,
    },
    MapSpec {
        name: names::NODES4,
        map_type: MapType::Hash,
        key_size: 4,
        value_size: size_of::<NodeEntry>() as u32,
        max_entries: names::NODES4_MAX_ENTRIES,
        flags: 0,
    },
    MapSpec {
        name: names::CONFIG,
        map_type: MapType::Array,
        key_size: 4,
        value_size: size_of::<Config>() as u32,
        max_entries: 1,
        flags: 0,
    },
    MapSpec {
        name: names::NAT_GUARD4,
        map_type: MapType::LruHash,
        key_size: size_of::<PeerKey>() as u32,
        value_size: 4,
        max_entries: names::NAT_GUARD4_MAX_ENTRIES,
        flags: 0,
    },
    MapSpec {
        name: names::KERNEL_FLOWS4,
        map_type: MapType::LruHash,
        key_size: size_of::<FlowKey>() as u32,
        value_size: 4,
        max_entries: names::KERNEL_FLOWS4_MAX_ENTRIES,
        flags: 0,
    },
    counter_spec(names::CNT_FROM_BRIDGE),
    counter_spec(names::CNT_FROM_NETDEV),
    counter_spec(names::CNT_TO_NETDEV),
    counter_spec(names::CNT_XDP_NETDEV),
    MapSpec {
        name: names::NAT_CONFIG,
        map_type: MapType::Array,
        key_size: 4,
        value_size: size_of::<NatConfig>() as u32,
        max_entries: 1,
        flags: 0,
    },
    MapSpec {
        name: names::NAT4,
        map_type: MapType::LruHash,
        key_size: size_of::<NatKey>() as u32,
        value_size: size_of::<NatEntry>() as u32,
        max_entries: names::NAT4_DEFAULT_MAX_ENTRIES,
        flags: 0,
    },
    MapSpec {
        name: names::NAT_REV4,
        map_type: MapType::LruHash,
        key_size: size_of::<NatKey>() as u32,
        value_size: size_of::<NatRevEntry>() as u32,
        max_entries: names::NAT4_DEFAULT_MAX_ENTRIES,
        flags: 0,
    },
    MapSpec {
        name: names::NAT_FRAG4,
        map_type: MapType::LruHash,
        key_size: size_of::<FragKey>() as u32,
        value_size: size_of::<FragEntry>() as u32,
        max_entries: names::NAT_FRAG4_MAX_ENTRIES,
        flags: 0,
    },
    MapSpec {
        name: names::NO_MASQ4,
        map_type: MapType::LpmTrie,
        key_size: 4 + 4,
        value_size: 4,
        max_entries: names::NO_MASQ4_MAX_ENTRIES,
        flags: BPF_F_NO_PREALLOC,
    },
    MapSpec {
        name: v6::CONFIG6,
        map_type: MapType::Array,
        key_size: 4,
        value_size: size_of::<Config6>() as u32,
        max_entries: 1,
        flags: 0,
    },
    MapSpec {
        name: v6::ROUTES6,
        map_type: MapType::LpmTrie,
        key_size: 4 + 16,
        value_size: size_of::<RemoteEntry6>() as u32,
        max_entries: v6::ROUTES6_MAX_ENTRIES,
        flags: BPF_F_NO_PREALLOC,
    },
    MapSpec {
        name: v6::NODES6,
        map_type: MapType::Hash,
        key_size: 16,
        value_size: size_of::<NodeEntry>() as u32,
        max_entries: v6::NODES6_MAX_ENTRIES,
        flags: 0,
    },
    MapSpec {
        name: v6::NAT_GUARD6,
        map_type: MapType::LruHash,
        key_size: size_of::<PeerKey6>() as u32,
        value_size: 4,
        max_entries: v6::NAT_GUARD6_MAX_ENTRIES,
        flags: 0,
    },
    MapSpec {
        name: v6::KERNEL_FLOWS6,
        map_type: MapType::LruHash,
        key_size: size_of::<FlowKey6>() as u32,
        value_size: 4,
        max_entries: v6::KERNEL_FLOWS6_MAX_ENTRIES,
        flags: 0,
    },
    held_spec(
        names::HELD_GUARD4,
        size_of::<PeerKey>(),
        names::HELD_GUARD4_MAX_ENTRIES,
    ),
    held_spec(
        names::HELD_FLOWS4,
        size_of::<FlowKey>(),
        names::HELD_FLOWS4_MAX_ENTRIES,
    ),
    held_spec(
        v6::HELD_GUARD6,
        size_of::<PeerKey6>(),
        v6::HELD_GUARD6_MAX_ENTRIES,
    ),
    held_spec(
        v6::HELD_FLOWS6,
        size_of::<FlowKey6>(),
        v6::HELD_FLOWS6_MAX_ENTRIES,
    ),
    MapSpec {
        name: names::HELD_COUNT,
        map_type: MapType::Array,
        key_size: 4,
        value_size: 4,
        max_entries: 2,
        flags: 0,
    },
];

/// A held flow table: a hash of `key_size`-byte keys to `u32`, allocated as it is written.
const fn held_spec(name: &'static str, key_size: usize, max_entries: u32) -> MapSpec {
    MapSpec {
        name,
        map_type: MapType::Hash,
        key_size: key_size as u32,
        value_size: 4,
        max_entries,
        flags: BPF_F_NO_PREALLOC,
    }
}

const fn counter_spec(name: &'static str) -> MapSpec {
    MapSpec {
        name,
        map_type: MapType::PerCpuArray,
        key_size: 4,
        value_size: size_of::<Counter>() as u32,
        max_entries: COUNTER_SLOTS as u32,
        flags: 0,
    }
}

/// The paths of one pin root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinLayout {
    root: PathBuf,
}

impl PinLayout {
    /// The layout under `root` (`--bpf-pin-path`).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        PinLayout { root: root.into() }
    }

    /// The pin root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of this build's layout version.
    pub fn maps_dir(&self) -> PathBuf {
        self.root.join(names::PIN_LAYOUT_VERSION)
    }

    /// Where map `name` is pinned.
    pub fn map(&self, name: &str) -> PathBuf {
        self.maps_dir().join(name)
    }

    /// The directory of pinned links.
    pub fn links_dir(&self) -> PathBuf {
        self.root.join(names::PIN_LINKS_DIR)
    }

    /// The directory of the attached programs' pinned flow memo maps.
    pub fn memos_dir(&self) -> PathBuf {
        self.root.join(names::PIN_MEMOS_DIR)
    }

    /// Where the attached programs' memo map `name` is pinned.
    pub fn memo(&self, name: &str) -> PathBuf {
        self.memos_dir().join(name)
    }

    /// The directory where a resize keeps the old NAT maps until their flows are copied.
    pub fn resizing_dir(&self) -> PathBuf {
        self.root.join(names::PIN_RESIZING_DIR)
    }

    /// Where a resize keeps the old instance of map `name`.
    pub fn resizing(&self, name: &str) -> PathBuf {
        self.resizing_dir().join(name)
    }

    /// Where the link of `program` on `ifindex` is pinned.
    pub fn link(&self, program: &str, ifindex: u32) -> PathBuf {
        self.links_dir().join(format!("{program}-{ifindex}"))
    }

    /// The pinned links of `program` other than the one on `keep`, as `(ifindex, path)`.
    pub fn other_links(&self, program: &str, keep: u32) -> Vec<(u32, PathBuf)> {
        let Ok(entries) = fs::read_dir(self.links_dir()) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let ifindex = parse_link_name(&name, program)?;
                (ifindex != keep).then(|| (ifindex, e.path()))
            })
            .collect()
    }

    /// Creates the root, the version directory and the links directory, after checking that
    /// the root is (or will be) on a BPF filesystem.
    pub fn prepare(&self) -> Result<(), BpfError> {
        check_bpffs(&self.root)?;
        for dir in [self.maps_dir(), self.links_dir(), self.memos_dir()] {
            fs::create_dir_all(&dir).map_err(|e| BpfError::io("creating", &dir, e))?;
        }
        Ok(())
    }

    /// Unpins every map of this version that this build could not use; returns their names.
    pub fn drop_incompatible_maps(&self) -> Result<Vec<&'static str>, BpfError> {
        self.drop_incompatible_maps_sized(&[])
    }

    /// [`Self::drop_incompatible_maps`] with the sizes set at load time (`(name,
    /// max_entries)`) in place of the specs' defaults.
    pub fn drop_incompatible_maps_sized(
        &self,
        sizes: &[(&str, u32)],
    ) -> Result<Vec<&'static str>, BpfError> {
        let mut dropped = Vec::new();
        for spec in &MAP_SPECS {
            let path = self.map(spec.name);
            if !path.exists() {
                continue;
            }
            let spec = spec.sized(sizes);
            let compatible = MapInfo::from_pin(&path).is_ok_and(|info| spec.matches(&info));
            if !compatible {
                fs::remove_file(&path).map_err(|e| BpfError::io("removing", &path, e))?;
                dropped.push(spec.name);
            }
        }
        Ok(dropped)
    }

    /// Unpins the maps of `sizes` (`(name, max_entries)`) that match their spec in everything
    /// but their size, so that the loader creates them afresh at the size asked for; returns
    /// each as `(name, old size, new size)`. Their entries are not carried over.
    pub fn drop_resized(
        &self,
        sizes: &[(&'static str, u32)],
    ) -> Result<Vec<(&'static str, u32, u32)>, BpfError> {
        let mut dropped = Vec::new();
        for (name, size) in sizes {
            let Some(spec) = MAP_SPECS.iter().find(|spec| spec.name == *name) else {
                continue;
            };
            let path = self.map(name);
            let Ok(info) = MapInfo::from_pin(&path) else {
                continue;
            };
            if spec.matches_but_size(&info) && info.max_entries() != *size {
                fs::remove_file(&path).map_err(|e| BpfError::io("removing", &path, e))?;
                dropped.push((spec.name, info.max_entries(), *size));
            }
        }
        Ok(dropped)
    }

    /// Removes layout version directories other than this build's (their maps live on while an
    /// old program still uses them); returns what was removed.
    pub fn prune_old_versions(&self) -> Result<Vec<PathBuf>, BpfError> {
        let mut removed = Vec::new();
        let Ok(entries) = fs::read_dir(&self.root) else {
            return Ok(removed);
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if is_version_dir(name) && name != names::PIN_LAYOUT_VERSION {
                remove_dir_contents(&entry.path())?;
                removed.push(entry.path());
            }
        }
        Ok(removed)
    }

    /// Removes everything this layout pinned: links first (which detaches the programs unless
    /// another process holds them), then every version's maps, then the directories. Missing
    /// paths are fine. Returns how many pins were removed.
    pub fn remove_all(&self) -> Result<usize, BpfError> {
        let mut count = 0;
        if self.links_dir().exists() {
            count += remove_dir_contents(&self.links_dir())?;
        }
        for dir in [self.memos_dir(), self.resizing_dir()] {
            if dir.exists() {
                count += remove_dir_contents(&dir)?;
            }
        }
        if let Ok(entries) = fs::read_dir(&self.root) {
            for entry in entries.flatten() {
                if entry.file_name().to_str().is_some_and(is_version_dir) {
                    count += remove_dir_contents(&entry.path())?;
                }
            }
        }
        match fs::remove_dir(&self.root) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            // Something else lives there; leave it.
            Err(e) if e.kind() == ErrorKind::DirectoryNotEmpty => {}
            Err(e) => return Err(BpfError::io("removing", &self.root, e)),
        }
        Ok(count)
    }
}

impl MapSpec {
    /// This spec with the size `sizes` gives it, if any.
    pub fn sized(&self, sizes: &[(&str, u32)]) -> MapSpec {
        match sizes.iter().find(|(name, _)| *name == self.name) {
            Some((_, max_entries)) => MapSpec {
                max_entries: *max_entries,
                ..*self
            },
            None => *self,
        }
    }

    /// Whether a pinned map matches this spec in everything but its size.
    pub fn matches_but_size(&self, info: &MapInfo) -> bool {
        info.map_type().ok() == Some(self.map_type)
            && info.key_size() == self.key_size
            && info.value_size() == self.value_size
            && info.map_flags() == self.flags
    }

    /// Whether a pinned map matches this spec.
    pub fn matches(&self, info: &MapInfo) -> bool {
        info.map_type().ok() == Some(self.map_type)
            && info.key_size() == self.key_size
            && info.value_size() == self.value_size
            && info.max_entries() == self.max_entries
            && info.map_flags() == self.flags
    }
}

/// `v<digits>`.
fn is_version_dir(name: &str) -> bool {
    name.strip_prefix('v')
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The ifindex in `<program>-<ifindex>`.
fn parse_link_name(name: &str, program: &str) -> Option<u32> {
    name.strip_prefix(program)?.strip_prefix('-')?.parse().ok()
}

/// Removes the pin at `path`; a missing one is fine.
pub(super) fn remove_pin(path: &Path) -> Result<(), BpfError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(BpfError::io("removing", path, e)),
    }
}

/// Removes the files in `dir` and then `dir`; returns how many files were removed.
fn remove_dir_contents(dir: &Path) -> Result<usize, BpfError> {
    let mut count = 0;
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(BpfError::io("reading", dir, e)),
    };
    for entry in entries.flatten() {
        let path = entry.path();
        match fs::remove_file(&path) {
            Ok(()) => count += 1,
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(BpfError::io("removing", &path, e)),
        }
    }
    match fs::remove_dir(dir) {
        Ok(()) => Ok(count),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(count),
        Err(e) => Err(BpfError::io("removing", dir, e)),
    }
}

/// Whether a `statfs` filesystem type is bpffs.
// `f_type`'s C type differs between architectures (long, int, unsigned int).
#[allow(clippy::unnecessary_cast)]
fn is_bpffs_magic(fs: nix::sys::statfs::FsType) -> bool {
    fs.0 as i64 == BPF_FS_MAGIC
}

/// Fails unless `path`, or its closest existing ancestor, is on a BPF filesystem.
fn check_bpffs(path: &Path) -> Result<(), BpfError> {
    let mut probe = path;
    while !probe.exists() {
        match probe.parent() {
            Some(parent) => probe = parent,
            None => break,
        }
    }
    let on_bpffs =
        nix::sys::statfs::statfs(probe).is_ok_and(|s| is_bpffs_magic(s.filesystem_type()));
    if on_bpffs {
        Ok(())
    } else {
        Err(BpfError::NotBpffs {
            path: probe.to_path_buf(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        let l = PinLayout::new("/sys/fs/bpf/flannel");
        assert_eq!(l.maps_dir(), PathBuf::from("/sys/fs/bpf/flannel/v1"));
        assert_eq!(
            l.map(names::ROUTES4),
            PathBuf::from("/sys/fs/bpf/flannel/v1/FLANNEL_ROUTES4")
        );
        assert_eq!(
            l.link("tc_from_bridge", 7),
            PathBuf::from("/sys/fs/bpf/flannel/links/tc_from_bridge-7")
        );
    }

    #[test]
    fn names() {
        assert!(is_version_dir("v1") && is_version_dir("v12"));
        assert!(!is_version_dir("v") && !is_version_dir("links") && !is_version_dir("v1x"));
        assert_eq!(
            parse_link_name("tc_from_netdev-12", "tc_from_netdev"),
            Some(12)
        );
        assert_eq!(parse_link_name("tc_from_netdev-12", "tc_to_netdev"), None);
        assert_eq!(
            parse_link_name("tc_from_netdevx-12", "tc_from_netdev"),
            None
        );
    }

    #[test]
    fn every_pinned_map_has_a_spec() {
        let specs: Vec<&str> = MAP_SPECS.iter().map(|s| s.name).collect();
        assert_eq!(specs, names::PINNED.to_vec());
    }

    #[test]
    fn tmpfs_is_not_bpffs() {
        let dir = std::env::temp_dir();
        assert!(matches!(
            check_bpffs(&dir.join("flannel-test-no-such-dir")),
            Err(BpfError::NotBpffs { .. })
        ));
    }
}
