//! A raw IPv4 socket: the few calls the IPIP receiver (and the tests' IPIP sender) make.

use std::{
    io,
    mem::{size_of, size_of_val},
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsRawFd, FromRawFd as _, OwnedFd, RawFd},
};

use crate::udp::mmsg::sockaddr;

/// A packet [`RawSocket::recv`] took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// Its length, IPv4 header included.
    pub len: usize,
    /// For a packet the kernel reassembled, the length of its largest fragment, when the
    /// socket asked for it (`IP_RECVFRAGSIZE`).
    pub max_fragment: Option<usize>,
}

/// The `IP_RECVFRAGSIZE` control message among those `msg` carries.
///
/// # Safety
/// `msg` must have been filled in by `recvmsg(2)`, its control buffer still alive.
unsafe fn fragment_size(msg: &libc::msghdr) -> Option<usize> {
    // SAFETY (all three calls): the caller promises a control buffer recvmsg filled in; the
    // CMSG_* macros stay within its `msg_controllen` bytes.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(msg) };
    while !cmsg.is_null() {
        // SAFETY: non-null, from CMSG_FIRSTHDR/CMSG_NXTHDR: a header within the buffer.
        let hdr = unsafe { &*cmsg };
        if hdr.cmsg_level == libc::SOL_IP && hdr.cmsg_type == libc::IP_RECVFRAGSIZE {
            // SAFETY: an IP_RECVFRAGSIZE message carries one int.
            let size = unsafe { libc::CMSG_DATA(cmsg).cast::<libc::c_int>().read_unaligned() };
            return usize::try_from(size).ok();
        }
        // SAFETY: as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(msg, cmsg) };
    }
    None
}

/// A raw IPv4 socket of one protocol.
#[derive(Debug)]
pub struct RawSocket(OwnedFd);

impl AsRawFd for RawSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// A system call's return value, or the error it left in `errno`.
fn checked(rc: isize) -> io::Result<usize> {
    usize::try_from(rc).map_err(|_| io::Error::last_os_error())
}

impl RawSocket {
    /// A raw IPv4 socket of `protocol` (`IPPROTO_RAW`: one that sends whole IPv4 packets),
    /// non-blocking or not.
    pub fn open(protocol: libc::c_int, nonblocking: bool) -> io::Result<RawSocket> {
        let mut ty = libc::SOCK_RAW | libc::SOCK_CLOEXEC;
        if nonblocking {
            ty |= libc::SOCK_NONBLOCK;
        }
        // SAFETY: plain socket(2); the descriptor is owned from here on.
        let fd = checked(unsafe { libc::socket(libc::AF_INET, ty, protocol) } as isize)?;
        // SAFETY: `fd` was just opened and is owned by nobody else.
        Ok(RawSocket(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }))
    }

    /// Sets the integer socket option `name` of `level`.
    pub fn set_option(
        &self,
        level: libc::c_int,
        name: libc::c_int,
        value: libc::c_int,
    ) -> io::Result<()> {
        self.set_option_bytes(level, name, &value.to_ne_bytes())
    }

    /// Sets the socket option `name` of `level` to `value` as it is (`IP_OPTIONS`: the
    /// options of every packet sent).
    pub fn set_option_bytes(
        &self,
        level: libc::c_int,
        name: libc::c_int,
        value: &[u8],
    ) -> io::Result<()> {
        let len = libc::socklen_t::try_from(value.len())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `value` is valid for reads of `len` bytes for the call.
        let rc =
            unsafe { libc::setsockopt(self.as_raw_fd(), level, name, value.as_ptr().cast(), len) };
        checked(rc as isize).map(drop)
    }

    /// Binds the socket to the local address `addr` (the source of what it sends).
    pub fn bind(&self, addr: Ipv4Addr) -> io::Result<()> {
        let sa = sockaddr(&SocketAddrV4::new(addr, 0));
        let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: `sa` is a sockaddr_in of the length given.
        let rc = unsafe { libc::bind(self.as_raw_fd(), (&raw const sa).cast(), len) };
        checked(rc as isize).map(drop)
    }

    /// Receives one packet into `buf` (with its IPv4 header).
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // Room for a few control messages, aligned for `cmsghdr`.
        let mut control = [0u64; 16];
        // SAFETY: an all-zero msghdr is valid (no name, no iovecs, no control).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&control);
        // SAFETY: `msg` points at `iov` (valid for writes of `buf`'s length) and at `control`,
        // all of which outlive the call.
        let len = checked(unsafe { libc::recvmsg(self.as_raw_fd(), &raw mut msg, 0) })?;
        Ok(Received {
            len,
            // SAFETY: `msg` was filled in by recvmsg: its control messages lie within
            // `control`.
            max_fragment: unsafe { fragment_size(&msg) },
        })
    }

    /// Sends `pkt` to `dst`; the bytes sent.
    pub fn send_to(&self, pkt: &[u8], dst: Ipv4Addr) -> io::Result<usize> {
        let sa = sockaddr(&SocketAddrV4::new(dst, 0));
        let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: `pkt` and `sa` are valid for reads of the lengths given.
        checked(unsafe {
            libc::sendto(
                self.as_raw_fd(),
                pkt.as_ptr().cast(),
                pkt.len(),
                0,
                (&raw const sa).cast(),
                len,
            )
        })
    }
}
