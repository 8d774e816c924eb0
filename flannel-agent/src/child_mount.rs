//! One mount in a helper process's own mount namespace (charon's private `/run`, wireguard-go's
//! socket directory): the strings are prepared before the fork, [`ChildMount::apply`] runs in
//! the child before exec and makes only async-signal-safe system calls.

use std::{ffi::CString, io, os::unix::ffi::OsStrExt, path::Path};

/// `unshare(CLONE_NEWNS)`, every mount made private (nothing leaks back to the host), then one
/// mount over `target`.
#[derive(Debug)]
pub struct ChildMount {
    source: CString,
    target: CString,
    fstype: Option<CString>,
    flags: libc::c_ulong,
}

impl ChildMount {
    /// A fresh tmpfs over `target`.
    pub fn tmpfs(target: &Path) -> io::Result<Self> {
        Ok(ChildMount {
            source: c"tmpfs".to_owned(),
            target: c_path(target)?,
            fstype: Some(c"tmpfs".to_owned()),
            flags: 0,
        })
    }

    /// `source` bound over `target`.
    pub fn bind(source: &Path, target: &Path) -> io::Result<Self> {
        Ok(ChildMount {
            source: c_path(source)?,
            target: c_path(target)?,
            fstype: None,
            flags: libc::MS_BIND,
        })
    }

    /// Enters a new mount namespace and mounts; in the child, between fork and exec.
    pub fn apply(&self) -> io::Result<()> {
        let fstype = self
            .fstype
            .as_ref()
            .map_or(std::ptr::null(), |f| f.as_ptr());
        // SAFETY: plain system calls with valid NUL-terminated strings (or null where the
        // call takes none).
        let failed = unsafe {
            libc::unshare(libc::CLONE_NEWNS) < 0
                || libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) < 0
                || libc::mount(
                    self.source.as_ptr(),
                    self.target.as_ptr(),
                    fstype,
                    self.flags,
                    std::ptr::null(),
                ) < 0
        };
        if failed {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

fn c_path(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::other("path with a NUL byte"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_with_nul_bytes_are_refused() {
        let bad = Path::new(std::ffi::OsStr::from_bytes(b"/run/a\0b"));
        assert!(ChildMount::bind(Path::new("/tmp"), bad).is_err());
        assert!(ChildMount::tmpfs(bad).is_err());
        assert!(ChildMount::tmpfs(Path::new("/run")).is_ok());
    }

    /// In a forked child (which makes only system calls, then `_exit`s) the tmpfs hides what
    /// the directory holds; the parent still sees it.
    #[test]
    fn tmpfs_is_mounted_in_the_childs_namespace_only() {
        // SAFETY: plain system call.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = std::env::temp_dir().join(format!("flannel-child-mount-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let marker = dir.join("host-file");
        std::fs::write(&marker, b"x").unwrap();
        let mount = ChildMount::tmpfs(&dir).unwrap();
        let marker_c = c_path(&marker).unwrap();
        // SAFETY: the child only makes system calls and exits with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = match mount.apply() {
                // The tmpfs hides the host's file. SAFETY: plain system call.
                Ok(()) if unsafe { libc::access(marker_c.as_ptr(), libc::F_OK) } != 0 => 0,
                Ok(()) => 1,
                Err(_) => 2,
            };
            // SAFETY: leaves the forked child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status));
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "1: file still visible, 2: apply failed"
        );
        // The host still sees its file: nothing leaked back.
        assert!(marker.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
