//! VTEP MAC persistence: one small file per vxlan device in `--state-dir`, so the MAC of
//! `flannel.<VNI>` never changes across restarts and reboots (upstream draws a new random MAC
//! whenever it creates the device, and peers keep a stale FDB entry: flannel#1795, #1788).
//!
//! The MAC of a device is chosen once, in this order: a MAC handed in by the daemon (kube
//! mode: the one in the node's `backend-data` annotation, as upstream does), the persisted
//! one, the MAC of an existing device of that name (a node taken over from upstream flanneld
//! keeps its MAC), or a new random locally administered unicast MAC. Whatever was chosen is
//! written back, so the next start finds it.

use std::{
    fs,
    io::{self, Write as _},
    path::{Path, PathBuf},
};

use crate::{
    backend::{MacAddr, VxlanOptions},
    ip::IpStack,
    netlink::Netlink,
};

use super::{DataplaneError, model::VtepMacs};

/// The directory of persisted VTEP MACs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MacStore {
    dir: PathBuf,
}

/// Whether `mac` can be a device address: unicast and not all zeros.
pub fn is_usable_mac(mac: MacAddr) -> bool {
    mac.0[0] & 1 == 0 && mac.0 != [0; 6]
}

impl MacStore {
    /// A store in `dir` (`--state-dir`); the directory is created on the first save.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The file for `device`: `<dir>/vtep-mac-<device>` (e.g. `vtep-mac-flannel.1`).
    pub fn path(&self, device: &str) -> PathBuf {
        self.dir.join(format!("vtep-mac-{device}"))
    }

    /// The persisted MAC of `device`: `Ok(None)` when there is none, an error when the file
    /// cannot be read or does not hold a usable MAC.
    pub fn load(&self, device: &str) -> Result<Option<MacAddr>, DataplaneError> {
        let path = self.path(device);
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(DataplaneError::StateFile { path, source }),
        };
        let trimmed = text.trim();
        match trimmed.parse::<MacAddr>() {
            Ok(mac) if is_usable_mac(mac) => Ok(Some(mac)),
            _ => Err(DataplaneError::StateFileContent {
                path,
                content: trimmed.chars().take(64).collect(),
            }),
        }
    }

    /// Persists `mac` for `device` (write to a temporary file, sync, rename).
    pub fn save(&self, device: &str, mac: MacAddr) -> Result<(), DataplaneError> {
        let path = self.path(device);
        let err = |source| DataplaneError::StateFile {
            path: path.clone(),
            source,
        };
        fs::create_dir_all(&self.dir).map_err(err)?;
        let tmp = self.dir.join(format!(".vtep-mac-{device}.tmp"));
        write_synced(&tmp, format!("{mac}\n").as_bytes()).map_err(err)?;
        fs::rename(&tmp, &path).map_err(err)
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Chooses and persists the MAC of vxlan device `device` (see the module documentation).
pub async fn resolve_vtep_mac(
    nl: &Netlink,
    store: &MacStore,
    device: &str,
    given: Option<MacAddr>,
) -> Result<MacAddr, DataplaneError> {
    let given = given.filter(|m| {
        let ok = is_usable_mac(*m);
        if !ok {
            tracing::warn!(%device, mac = %m, "ignoring the VTEP MAC handed in: not a unicast MAC");
        }
        ok
    });
    let stored = match store.load(device) {
        Ok(m) => m,
        Err(e @ DataplaneError::StateFileContent { .. }) => {
            tracing::warn!("{e}; choosing a new VTEP MAC");
            None
        }
        Err(e) => return Err(e),
    };
    let (mac, source) = if let Some(m) = given {
        (m, "handed in")
    } else if let Some(m) = stored {
        (m, "persisted")
    } else if let Some(m) = existing_device_mac(nl, device).await? {
        (m, "existing device")
    } else {
        (MacAddr::random_local(&mut rand::rng()), "new random")
    };
    if stored != Some(mac) {
        store.save(device, mac)?;
    }
    tracing::info!(%device, %mac, source, "VTEP MAC");
    Ok(mac)
}

async fn existing_device_mac(
    nl: &Netlink,
    device: &str,
) -> Result<Option<MacAddr>, DataplaneError> {
    let link = nl
        .link_by_name(device)
        .await
        .map_err(DataplaneError::netlink(format!("look up {device}")))?;
    Ok(link
        .filter(|l| l.is_kind("vxlan"))
        .and_then(|l| l.mac)
        .map(MacAddr)
        .filter(|m| is_usable_mac(*m)))
}

/// The VTEP MACs of both vxlan devices for families `stack` (daemon step "backend prepare",
/// before the lease is acquired, so the MACs can be published in it).
pub async fn prepare_vtep_macs(
    nl: &Netlink,
    store: &MacStore,
    options: &VxlanOptions,
    stack: IpStack,
    given: VtepMacs,
) -> Result<VtepMacs, DataplaneError> {
    let mut out = VtepMacs::default();
    if stack.has_v4() {
        out.v4 = Some(resolve_vtep_mac(nl, store, &options.device_name(), given.v4).await?);
    }
    if stack.has_v6() {
        out.v6 = Some(resolve_vtep_mac(nl, store, &options.v6_device_name(), given.v6).await?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_round_trip_through_the_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let store = MacStore::new(dir.path().join("nested"));
        assert_eq!(store.load("flannel.1").unwrap(), None);
        let mac = MacAddr([0x0e, 0x2a, 1, 2, 3, 4]);
        store.save("flannel.1", mac).unwrap();
        assert_eq!(store.load("flannel.1").unwrap(), Some(mac));
        assert_eq!(
            fs::read_to_string(store.path("flannel.1")).unwrap(),
            "0e:2a:01:02:03:04\n"
        );
        // One file per device.
        assert_eq!(store.load("flannel-v6.1").unwrap(), None);
        // Rewriting replaces atomically and leaves no temporary file.
        store
            .save("flannel.1", MacAddr([2, 0, 0, 0, 0, 1]))
            .unwrap();
        let names: Vec<String> = fs::read_dir(dir.path().join("nested"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["vtep-mac-flannel.1"]);
    }

    /// Only a lookup of a link name that does not exist touches the host's netlink.
    #[tokio::test]
    async fn handed_in_beats_persisted_and_random_is_kept() {
        let nl = Netlink::new().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = MacStore::new(dir.path());
        let device = "flnomac-test0";
        let first = resolve_vtep_mac(&nl, &store, device, None).await.unwrap();
        assert!(is_usable_mac(first) && first.0[0] & 2 == 2, "{first}");
        // The next start finds the same MAC.
        assert_eq!(
            resolve_vtep_mac(&nl, &store, device, None).await.unwrap(),
            first
        );
        // Kube mode: the annotation's MAC wins and is persisted.
        let annotated = MacAddr([0x0e, 0x2a, 9, 9, 9, 9]);
        let got = resolve_vtep_mac(&nl, &store, device, Some(annotated))
            .await
            .unwrap();
        assert_eq!(got, annotated);
        assert_eq!(store.load(device).unwrap(), Some(annotated));
        // An unusable handed-in MAC is ignored.
        let multicast = MacAddr([0x01, 0, 0x5e, 0, 0, 1]);
        let got = resolve_vtep_mac(&nl, &store, device, Some(multicast))
            .await
            .unwrap();
        assert_eq!(got, annotated);
        // A corrupt state file is replaced rather than fatal.
        fs::write(store.path(device), "garbage").unwrap();
        let got = resolve_vtep_mac(&nl, &store, device, None).await.unwrap();
        assert!(is_usable_mac(got));
        assert_eq!(store.load(device).unwrap(), Some(got));
    }

    #[test]
    fn garbage_and_multicast_are_rejected_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let store = MacStore::new(dir.path());
        fs::write(store.path("flannel.1"), "not a mac").unwrap();
        let e = store.load("flannel.1").unwrap_err().to_string();
        assert!(
            e.contains("vtep-mac-flannel.1") && e.contains("not a mac"),
            "{e}"
        );
        fs::write(store.path("flannel.1"), "01:00:5e:00:00:01\n").unwrap();
        assert!(store.load("flannel.1").is_err());
        assert!(!is_usable_mac(MacAddr([0; 6])));
        assert!(is_usable_mac(MacAddr::random_local(&mut rand::rng())));
    }
}
