//! The node's WireGuard key pair: generated once, kept in `--wireguard-key-file` and reused
//! on every start (upstream pain point: a regenerated key leaves a stale peer on every other
//! node until their next lease event).
//!
//! The file holds the private key as standard base64 (44 characters, no newline), exactly what
//! upstream writes, so an upstream flanneld and this agent can take over each other's file.
//! It is written atomically (temporary file, `fsync`, rename) with mode 0400 in a directory
//! created 0755, so a crash never leaves a truncated key behind.

use std::{
    fmt,
    fs::{self, DirBuilder, OpenOptions},
    io::Write as _,
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

use rand::RngCore as _;

use crate::backend::WgKey;

/// Mode of the key file.
pub const KEY_FILE_MODE: u32 = 0o400;
/// Mode of directories created for the key file.
pub const KEY_DIR_MODE: u32 = 0o755;

/// Errors loading or creating the key file.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The file could not be read, created or written.
    #[error("WireGuard key file {}: {source}", path.display())]
    Io {
        /// The file (or its directory).
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file exists but does not hold a key.
    #[error(
        "WireGuard key file {} does not hold a base64 private key ({reason}); remove it to \
         generate a new key (every other node then learns the new public key from the lease)",
        path.display()
    )]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// A WireGuard private key. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct PrivateKey([u8; 32]);

impl fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PrivateKey(<redacted>, public {})", self.public_key())
    }
}

impl PrivateKey {
    /// A fresh random key, clamped as `wg genkey` does.
    pub fn generate() -> Self {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        Self::from_bytes(clamp(bytes))
    }

    /// Wraps raw key bytes (as stored; no clamping is applied here).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        PrivateKey(bytes)
    }

    /// The raw bytes (for the device configuration only).
    pub fn expose(&self) -> &[u8; 32] {
        &self.0
    }

    /// The matching public key (X25519 with the base point, which clamps the scalar).
    pub fn public_key(&self) -> WgKey {
        let secret = x25519_dalek::StaticSecret::from(self.0);
        WgKey(x25519_dalek::PublicKey::from(&secret).to_bytes())
    }

    /// Standard base64, as `wg genkey` prints it and as the key file holds it.
    pub fn to_base64(&self) -> String {
        WgKey(self.0).to_string()
    }

    /// Parses standard base64 of 32 bytes (surrounding whitespace ignored).
    pub fn from_base64(text: &str) -> Result<Self, String> {
        text.trim()
            .parse::<WgKey>()
            .map(|k| PrivateKey(k.0))
            .map_err(|e| e.to_string())
    }
}

/// Curve25519 clamping: clear the low 3 bits, clear the top bit, set bit 254.
fn clamp(mut b: [u8; 32]) -> [u8; 32] {
    b[0] &= 248;
    b[31] = (b[31] & 127) | 64;
    b
}

/// Whether the key was read or created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOrigin {
    /// Read from the existing file.
    Loaded,
    /// Generated and written now.
    Generated,
}

/// Reads the private key from `path`, or generates one and writes it there when the file
/// does not exist. A file that exists but holds no key is an error (never silently replaced:
/// the public key is the node's identity on every other node).
pub fn load_or_generate(path: &Path) -> Result<(PrivateKey, KeyOrigin), KeyError> {
    let io = |source| KeyError::Io {
        path: path.to_owned(),
        source,
    };
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8(bytes).map_err(|_| KeyError::Invalid {
                path: path.to_owned(),
                reason: "not UTF-8 text".into(),
            })?;
            let key = PrivateKey::from_base64(&text).map_err(|reason| KeyError::Invalid {
                path: path.to_owned(),
                reason,
            })?;
            Ok((key, KeyOrigin::Loaded))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = PrivateKey::generate();
            write_key(path, &key).map_err(io)?;
            Ok((key, KeyOrigin::Generated))
        }
        Err(e) => Err(io(e)),
    }
}

/// Writes `key` to `path` atomically: directory 0755 (created if missing), file 0400.
pub fn write_key(path: &Path, key: &PrivateKey) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    DirBuilder::new()
        .recursive(true)
        .mode(KEY_DIR_MODE)
        .create(&dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "wgkey".into());
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(KEY_FILE_MODE)
            .open(&tmp)?;
        file.write_all(key.to_base64().as_bytes())?;
        file.sync_all()?;
        // The umask may have narrowed the mode; 0400 is what upstream sets.
        fs::set_permissions(&tmp, fs::Permissions::from_mode(KEY_FILE_MODE))?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use super::*;

    #[test]
    fn rfc7748_public_key() {
        // RFC 7748 section 6.1: Alice's private and public key.
        let hex = |s: &str| -> [u8; 32] {
            let v: Vec<u8> = (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect();
            v.try_into().unwrap()
        };
        let alice = PrivateKey::from_bytes(hex(
            "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a",
        ));
        assert_eq!(
            alice.public_key().0,
            hex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
        );
    }

    #[test]
    fn generated_keys_are_clamped_distinct_and_round_trip() {
        let a = PrivateKey::generate();
        let b = PrivateKey::generate();
        assert_ne!(a, b);
        assert_eq!(a.0[0] & 7, 0);
        assert_eq!(a.0[31] & 0xc0, 0x40);
        let text = a.to_base64();
        assert_eq!(text.len(), 44);
        assert_eq!(PrivateKey::from_base64(&format!("{text}\n")).unwrap(), a);
        assert!(!format!("{a:?}").contains(&text));
        assert!(PrivateKey::from_base64("abc").is_err());
    }

    #[test]
    fn file_is_created_once_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/flannel/wgkey");
        let (key, origin) = load_or_generate(&path).unwrap();
        assert_eq!(origin, KeyOrigin::Generated);
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o400);
        let dir_mode = fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(dir_mode & 0o777, 0o755);
        assert_eq!(fs::read_to_string(&path).unwrap(), key.to_base64());
        let (again, origin) = load_or_generate(&path).unwrap();
        assert_eq!(origin, KeyOrigin::Loaded);
        assert_eq!(again, key);
        assert_eq!(again.public_key(), key.public_key());
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("wgkey")]);
    }

    #[test]
    fn corrupt_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wgkey");
        fs::write(&path, "not a key").unwrap();
        let e = load_or_generate(&path).unwrap_err().to_string();
        assert!(e.contains(&path.display().to_string()), "{e}");
        assert!(e.contains("remove it"), "{e}");
        // The file is left as it was.
        assert_eq!(fs::read_to_string(&path).unwrap(), "not a key");
    }
}
