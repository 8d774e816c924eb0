//! Batched UDP I/O: `sendmmsg(2)` and `recvmmsg(2)` over caller-owned buffers, one system
//! call for up to [`BATCH`] datagrams. The message headers live on the stack for the duration
//! of the call, so nothing is allocated and no raw pointer outlives it.
//!
//! Both functions are non-blocking (`MSG_DONTWAIT`) and meant to run inside tokio's
//! `UdpSocket::async_io`, which waits for readiness on `WouldBlock`.

use std::{
    io,
    mem::{size_of, zeroed},
    net::SocketAddrV4,
    os::fd::RawFd,
};

/// Most datagrams per system call.
pub const BATCH: usize = 32;

/// `addr` as the kernel's `sockaddr_in`.
pub fn sockaddr(addr: &SocketAddrV4) -> libc::sockaddr_in {
    // SAFETY: sockaddr_in is plain old data; all-zero is a valid value.
    let mut sa: libc::sockaddr_in = unsafe { zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_port = addr.port().to_be();
    sa.sin_addr = libc::in_addr {
        s_addr: u32::from_ne_bytes(addr.ip().octets()),
    };
    sa
}

/// Sends the datagrams of `msgs` (payload, destination), at most [`BATCH`] of them, and
/// returns how many the kernel accepted. When the first one fails its error is returned
/// (`WouldBlock` when the send buffer is full); a failure later in the batch shows up as a
/// short count, and sending again from there returns that error.
pub fn send_batch<'a>(
    fd: RawFd,
    msgs: impl IntoIterator<Item = (&'a [u8], SocketAddrV4)>,
) -> io::Result<usize> {
    // SAFETY (three zeroed arrays): iovec, sockaddr_in and mmsghdr are plain old data for
    // which all-zero is a valid value (null pointers, zero lengths).
    let mut iov: [libc::iovec; BATCH] = unsafe { zeroed() };
    let mut addrs: [libc::sockaddr_in; BATCH] = unsafe { zeroed() };
    let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { zeroed() };
    let mut n = 0;
    for (payload, dst) in msgs.into_iter().take(BATCH) {
        iov[n] = libc::iovec {
            iov_base: payload.as_ptr().cast_mut().cast(),
            iov_len: payload.len(),
        };
        addrs[n] = sockaddr(&dst);
        n += 1;
    }
    if n == 0 {
        return Ok(0);
    }
    for i in 0..n {
        let h = &mut hdrs[i].msg_hdr;
        h.msg_name = (&raw mut addrs[i]).cast();
        h.msg_namelen = size_of::<libc::sockaddr_in>() as libc::socklen_t;
        h.msg_iov = &raw mut iov[i];
        h.msg_iovlen = 1;
    }
    // SAFETY: the first `n` headers point at live iovecs and addresses on this stack frame,
    // and each iovec at a payload slice borrowed for 'a; the kernel only reads them.
    let rc =
        unsafe { libc::sendmmsg(fd, hdrs.as_mut_ptr(), n as libc::c_uint, libc::MSG_DONTWAIT) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc as usize)
}

/// One received datagram's outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Received {
    /// Bytes in the buffer.
    pub len: usize,
    /// The datagram was longer than its buffer and was cut (`MSG_TRUNC`).
    pub truncated: bool,
}

/// Receives up to [`BATCH`] datagrams into `storage`, one per `slot_len`-byte slot (slot
/// *i* starts at `i * slot_len`), recording each length in `out`; returns how many arrived
/// (`WouldBlock` when none is waiting).
pub fn recv_batch(
    fd: RawFd,
    storage: &mut [u8],
    slot_len: usize,
    out: &mut [Received; BATCH],
) -> io::Result<usize> {
    // SAFETY: plain old data, all-zero is valid.
    let mut iov: [libc::iovec; BATCH] = unsafe { zeroed() };
    let mut hdrs: [libc::mmsghdr; BATCH] = unsafe { zeroed() };
    if slot_len == 0 {
        return Ok(0);
    }
    let mut n = 0;
    for (i, buf) in storage.chunks_exact_mut(slot_len).take(BATCH).enumerate() {
        iov[i] = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        hdrs[i].msg_hdr.msg_iov = &raw mut iov[i];
        hdrs[i].msg_hdr.msg_iovlen = 1;
        n = i + 1;
    }
    if n == 0 {
        return Ok(0);
    }
    // SAFETY: the first `n` headers point at live iovecs on this stack frame, each at a
    // distinct buffer borrowed mutably for the call; no source address is requested.
    let rc = unsafe {
        libc::recvmmsg(
            fd,
            hdrs.as_mut_ptr(),
            n as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    let got = rc as usize;
    for (slot, h) in out.iter_mut().zip(&hdrs).take(got) {
        *slot = Received {
            len: h.msg_len as usize,
            truncated: h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0,
        };
    }
    Ok(got)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests fail loudly by design
mod tests {
    use std::{net::UdpSocket, os::fd::AsRawFd as _, time::Duration};

    use super::*;

    #[test]
    fn batches_round_trip_over_loopback() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let SocketAddr::V4(dst) = rx.local_addr().unwrap() else {
            panic!("IPv4 expected")
        };
        let payloads: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; 10 + usize::from(i)]).collect();
        // 40 messages: the first call takes BATCH of them.
        let sent =
            send_batch(tx.as_raw_fd(), payloads.iter().map(|p| (p.as_slice(), dst))).unwrap();
        assert_eq!(sent, BATCH);
        let rest = send_batch(
            tx.as_raw_fd(),
            payloads[BATCH..].iter().map(|p| (p.as_slice(), dst)),
        )
        .unwrap();
        assert_eq!(rest, 8);
        assert_eq!(send_batch(tx.as_raw_fd(), std::iter::empty()).unwrap(), 0);

        rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut storage = vec![0u8; BATCH * 64];
        let mut out = [Received::default(); BATCH];
        let mut got = Vec::new();
        while got.len() < 40 {
            let n = match recv_batch(rx.as_raw_fd(), &mut storage, 64, &mut out) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => panic!("{e}"),
            };
            for i in 0..n {
                let r = out[i];
                assert!(!r.truncated);
                got.push(storage[i * 64..i * 64 + r.len].to_vec());
            }
        }
        assert_eq!(got, payloads);

        send_batch(tx.as_raw_fd(), [(&[9u8; 49][..], dst)]).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let mut small = [0u8; 20];
        assert_eq!(
            recv_batch(rx.as_raw_fd(), &mut small, 20, &mut out).unwrap(),
            1
        );
        assert_eq!(
            out[0],
            Received {
                len: 20,
                truncated: true
            }
        );
        let e = recv_batch(rx.as_raw_fd(), &mut small, 20, &mut out).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    }

    use std::net::SocketAddr;
}
