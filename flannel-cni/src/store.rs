//! The delegate config stored per container in `<dataDir>/<containerID>`, so DEL (and CHECK)
//! can call the delegate with exactly what ADD sent, without reading `subnet.env`.

use std::{
    fs::{self, DirBuilder, OpenOptions, Permissions},
    io::{self, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use crate::cni::{CniError, code, io_text};

/// The file for `container_id` (already validated by [`crate::cni::CniEnv::validate`]: no `/`).
pub fn path(data_dir: &Path, container_id: &str) -> PathBuf {
    data_dir.join(container_id)
}

fn io_error(what: &str, path: &Path, err: &io::Error) -> CniError {
    CniError::new(
        code::IO_FAILURE,
        format!("{what} {}: {}", path.display(), io_text(err)),
    )
}

/// Writes `bytes` to `<data_dir>/<container_id>`: the directory is created with mode 0700,
/// the file (truncated in place, not renamed) gets mode 0600, and it is fsynced before
/// returning.
pub fn save(data_dir: &Path, container_id: &str, bytes: &[u8]) -> Result<(), CniError> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(data_dir)
        .map_err(|e| io_error("mkdir", data_dir, &e))?;
    let file_path = path(data_dir, container_id);
    let write = || -> io::Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&file_path)?;
        // The mode above is subject to the umask and ignored for an existing file.
        file.set_permissions(Permissions::from_mode(0o600))?;
        file.write_all(bytes)?;
        file.sync_all()
    };
    write().map_err(|e| io_error("write", &file_path, &e))
}

/// Reads the stored config; `Ok(None)` if there is none.
pub fn load(data_dir: &Path, container_id: &str) -> Result<Option<Vec<u8>>, CniError> {
    let file_path = path(data_dir, container_id);
    match fs::read(&file_path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error("read", &file_path, &e)),
    }
}

/// Removes the stored config; a missing file is fine.
pub fn remove(data_dir: &Path, container_id: &str) -> io::Result<()> {
    match fs::remove_file(path(data_dir, container_id)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn save_load_remove() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/flannel");
        assert_eq!(load(&dir, "c1").unwrap(), None);
        save(&dir, "c1", b"{\"type\":\"bridge\"}").unwrap();
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        let meta = fs::metadata(dir.join("c1")).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(
            load(&dir, "c1").unwrap().as_deref(),
            Some(&b"{\"type\":\"bridge\"}"[..])
        );
        // Overwrite: shorter content truncates, a loose mode is tightened.
        fs::set_permissions(dir.join("c1"), Permissions::from_mode(0o644)).unwrap();
        save(&dir, "c1", b"{}").unwrap();
        assert_eq!(load(&dir, "c1").unwrap().as_deref(), Some(&b"{}"[..]));
        assert_eq!(fs::metadata(dir.join("c1")).unwrap().mode() & 0o777, 0o600);
        remove(&dir, "c1").unwrap();
        assert!(!dir.join("c1").exists());
        remove(&dir, "c1").unwrap();
    }

    #[test]
    fn unwritable_dir_is_io_failure() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("plain");
        fs::write(&file, b"x").unwrap();
        let err = save(&file.join("sub"), "c1", b"{}").unwrap_err();
        assert_eq!(err.code, 5);
        assert!(err.msg.starts_with("mkdir "), "{}", err.msg);
    }
}
