//! Packet capture without tcpdump: an `AF_PACKET` socket bound to one interface of a
//! namespace, seeing frames in both directions from the moment [`Capture::start`] returns
//! (no start-up race). Frames come as the device carries them: with the Ethernet header on
//! veths and bridges, raw IP on TUN devices. Parse them with [`crate::packet::parse`].

use std::{
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::netns::NetNs;

/// `ETH_P_ALL` in network byte order, as `socket(2)` and `sockaddr_ll` want it.
fn eth_p_all() -> u16 {
    (libc::ETH_P_ALL as u16).to_be()
}

/// A capture on one interface; closed when dropped.
#[derive(Debug)]
pub struct Capture {
    fd: OwnedFd,
    iface: String,
}

impl Capture {
    /// Starts capturing on `iface` inside `ns`.
    pub fn start(ns: &NetNs, iface: &str) -> Result<Capture> {
        let name = std::ffi::CString::new(iface).context("interface name")?;
        let fd = ns
            .enter(move || -> io::Result<OwnedFd> {
                // SAFETY: plain socket(2) call; the result is checked before use.
                let raw = unsafe {
                    libc::socket(
                        libc::AF_PACKET,
                        libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                        i32::from(eth_p_all()),
                    )
                };
                if raw < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: `raw` is a fresh descriptor nobody else owns.
                let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                // SAFETY: `name` is a valid NUL-terminated string.
                let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
                if index == 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: sockaddr_ll is plain old data; all-zero is valid.
                let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                sll.sll_family = libc::AF_PACKET as u16;
                sll.sll_protocol = eth_p_all();
                sll.sll_ifindex = index as i32;
                // SAFETY: binds with a correctly sized sockaddr_ll on the stack.
                let rc = unsafe {
                    libc::bind(
                        fd.as_raw_fd(),
                        (&raw const sll).cast(),
                        std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
                    )
                };
                if rc < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(fd)
            })?
            .with_context(|| format!("capture on {iface} in {}", ns.name()))?;
        let capture = Capture {
            fd,
            iface: iface.to_owned(),
        };
        // Frames of other interfaces may have queued between socket() and bind().
        while capture.recv(Duration::ZERO)?.is_some() {}
        Ok(capture)
    }

    /// The next frame, waiting at most `timeout`; `None` on timeout.
    pub fn recv(&self, timeout: Duration) -> Result<Option<Vec<u8>>> {
        let mut fds = [libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one live pollfd for a descriptor we own.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(None);
            }
            return Err(e).context("poll");
        }
        if n == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; 65536 + 64];
        // SAFETY: receives into a live buffer of the given length.
        let len = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if len < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(e).with_context(|| format!("recv on {}", self.iface));
        }
        buf.truncate(len as usize);
        Ok(Some(buf))
    }

    /// Waits up to `timeout` for a frame that `pick` accepts (returns `Some` for) and returns
    /// what `pick` made of it; other frames are skipped.
    pub fn find<T>(
        &self,
        timeout: Duration,
        mut pick: impl FnMut(&[u8]) -> Option<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + timeout;
        let mut seen = 0usize;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "no matching frame on {} within {timeout:?} ({seen} others seen)",
                    self.iface
                );
            }
            if let Some(frame) = self.recv(left)? {
                if let Some(t) = pick(&frame) {
                    return Ok(t);
                }
                seen += 1;
            }
        }
    }

    /// Every frame `pick` accepts during `window` (for "nothing like this was sent").
    pub fn collect<T>(
        &self,
        window: Duration,
        mut pick: impl FnMut(&[u8]) -> Option<T>,
    ) -> Result<Vec<T>> {
        let deadline = Instant::now() + window;
        let mut out = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(out);
            }
            if let Some(frame) = self.recv(left)?
                && let Some(t) = pick(&frame)
            {
                out.push(t);
            }
        }
    }
}
