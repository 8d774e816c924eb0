//! The TUN device `flannel0`: `/dev/net/tun` opened non-blocking and attached with
//! `TUNSETIFF` (`IFF_TUN | IFF_NO_PI`, so every read and write is exactly one IPv4 packet),
//! registered with tokio through [`tokio::io::unix::AsyncFd`].
//!
//! The device is not persistent: it exists while the file descriptor is open and disappears
//! with the agent, as upstream's. Its address, MTU, link state and the route to the cluster
//! network are set through rtnetlink by [`super::device`].

use std::{
    fs::{File, OpenOptions},
    io::{self, Read as _, Write as _},
    os::{
        fd::{AsRawFd, RawFd},
        unix::fs::OpenOptionsExt as _,
    },
};

use tokio::io::unix::AsyncFd;

use super::UdpError;

/// The clone device.
pub const TUN_CLONE_DEVICE: &str = "/dev/net/tun";

/// An open TUN device.
#[derive(Debug)]
pub struct Tun {
    file: File,
    name: String,
}

impl Tun {
    /// Opens (creating) the TUN device `name` in the current network namespace. Fails when
    /// `name` exists and is not a free TUN device (e.g. another process holds it).
    pub fn open(name: &str) -> Result<Self, UdpError> {
        let err = |source: io::Error| UdpError::Tun {
            name: name.to_owned(),
            source,
        };
        let bytes = name.as_bytes();
        if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
            return Err(err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a valid interface name",
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(TUN_CLONE_DEVICE)
            .map_err(|e| {
                err(io::Error::new(
                    e.kind(),
                    format!("opening {TUN_CLONE_DEVICE}: {e}"),
                ))
            })?;
        // SAFETY: ifreq is plain old data; all-zero is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
            *dst = *src as libc::c_char;
        }
        // The flags fit in a c_short (IFF_TUN = 0x1, IFF_NO_PI = 0x1000).
        req.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `req` is, and the fd
        // is an open /dev/net/tun.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return Err(err(io::Error::new(
                e.kind(),
                format!("TUNSETIFF: {e} (is another process holding the device?)"),
            )));
        }
        let name = req
            .ifr_name
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8 as char)
            .collect();
        Ok(Self { file, name })
    }

    /// Registers the device with the tokio reactor of the current runtime.
    pub fn register(self) -> io::Result<AsyncFd<Tun>> {
        // SAFETY: `Tun` owns its `File` for its whole life and never replaces it, so
        // `as_raw_fd` always returns the same open descriptor until the `AsyncFd` drops it.
        unsafe { AsyncFd::register(self) }.map_err(|e| e.into_parts().1)
    }

    /// The device name the kernel gave.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads one packet into `buf` (`WouldBlock` when there is none). `buf` should hold
    /// 65535 bytes, the largest IPv4 packet, so nothing is ever cut.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    /// Writes one packet.
    pub fn write(&self, pkt: &[u8]) -> io::Result<usize> {
        (&self.file).write(pkt)
    }
}

impl AsRawFd for Tun {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// Whether an I/O error on a TUN descriptor means the device is gone (deleted with
/// `ip link del`): the descriptor must be replaced by a freshly opened device.
pub fn device_gone(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EBADFD) | Some(libc::EBADF) | Some(libc::ENODEV) | Some(libc::ENXIO)
    )
}
