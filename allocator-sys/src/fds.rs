//! Moving file descriptors between processes over a Unix socket (`SCM_RIGHTS`): how the
//! descriptors of exported pages ([`crate::Device::export_page`]) reach the process that
//! imports them.
//!
//! [`send_fds`] sends some bytes and up to [`MAX_FDS`] descriptors in one message;
//! [`recv_fds`] receives exactly as many bytes as its buffer holds and every descriptor that
//! arrives with them, each as an [`OwnedFd`] of the receiving process (closed on exec). The
//! kernel duplicates a descriptor into the receiver: the sender's copy stays the sender's.
//!
//! A message's descriptors travel with its first byte; a receiver that reads the bytes of two
//! messages in one call gets the descriptors of both, and one that reads a message's bytes
//! without asking for descriptors (a plain `read`) loses them (the kernel closes them), so
//! both sides agree on how many bytes each message has. Descriptors that do not fit the
//! receiver's room are an error (`MSG_CTRUNC`), and those that did arrive are closed.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// The most descriptors one message carries (the kernel's `SCM_MAX_FD` is 253).
pub const MAX_FDS: usize = 250;

const FD_BYTES: usize = std::mem::size_of::<libc::c_int>();

/// Room for the control message of `n` descriptors, in `u64`s (aligned as `cmsghdr` needs).
fn control_buffer(n: usize) -> (Vec<u64>, usize) {
    // SAFETY: `CMSG_SPACE` is arithmetic on its argument; it reads no memory.
    let space = unsafe { libc::CMSG_SPACE((n * FD_BYTES) as u32) } as usize;
    (vec![0u64; space.div_ceil(8)], space)
}

/// Sends `data` (not empty) with the descriptors `fds` (at most [`MAX_FDS`]) as one message.
pub fn send_fds(sock: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if data.is_empty() || fds.len() > MAX_FDS {
        let msg = format!(
            "a message carries 1 byte or more and at most {MAX_FDS} descriptors ({} bytes, {} descriptors)",
            data.len(),
            fds.len()
        );
        return Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
    }
    let (mut control, space) = control_buffer(fds.len());
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    // SAFETY: `msghdr` is plain data for which all-zero bytes are a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg.msg_control` points to `space` zeroed, aligned bytes, room for one
        // control header and `fds.len()` descriptors (`CMSG_SPACE`), so the first header and its
        // data lie inside `control`, which outlives these writes.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN((fds.len() * FD_BYTES) as u32) as _;
            let out = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                out.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    let sent = loop {
        // SAFETY: `msg` points to `iov` (over `data`, valid for reads of `data.len()` bytes) and
        // to `control` (initialised above), all alive for the call; the socket is open.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // The descriptors went with the first byte; the rest of the bytes, if any, follow plainly.
    io::Write::write_all(&mut &*sock, &data[sent..])
}

/// Receives exactly `buf.len()` bytes (not zero) and the descriptors that arrive with them (at
/// most `max_fds`). An end of stream before `buf` is full is `UnexpectedEof`.
pub fn recv_fds(sock: &UnixStream, buf: &mut [u8], max_fds: usize) -> io::Result<Vec<OwnedFd>> {
    let mut fds = Vec::new();
    let mut filled = 0;
    while filled < buf.len() {
        let room = max_fds.saturating_sub(fds.len()).max(1);
        filled += recv_some(sock, &mut buf[filled..], room, &mut fds)?;
    }
    if fds.len() > max_fds {
        let msg = format!("{} descriptors arrived, more than {max_fds}", fds.len());
        return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
    }
    Ok(fds)
}

/// One `recvmsg` into `buf` with room for `room` descriptors, which it appends to `fds`;
/// returns the bytes received.
fn recv_some(
    sock: &UnixStream,
    buf: &mut [u8],
    room: usize,
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    let (mut control, space) = control_buffer(room);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: `msghdr` is plain data for which all-zero bytes are a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: `msg` points to `iov` (over `buf`, exclusively borrowed and valid for writes
        // of `buf.len()` bytes) and to `control` (writable, `space` bytes), alive for the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // SAFETY: the kernel filled `msg.msg_control` with `msg.msg_controllen` bytes of control
    // messages inside `control`; `CMSG_FIRSTHDR`/`CMSG_NXTHDR` stay inside that length, and each
    // SCM_RIGHTS message's data holds `(cmsg_len - CMSG_LEN(0)) / FD_BYTES` descriptors that
    // the kernel installed in this process for us alone, so each is owned once.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                for i in 0..bytes / FD_BYTES {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        let msg = "more descriptors arrived than there was room for (they were closed)";
        return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
    }
    if n == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(n)
}

/// A new descriptor (closed on exec) for the file behind `fd`, a descriptor the caller holds
/// open (one that arrived as a number, through the C ABI); `EBADF` if it is not open.
pub fn duplicate(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: `F_DUPFD_CLOEXEC` reads no memory; the kernel checks `fd` and, on success, makes
    // a new descriptor that nothing else in this process owns.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` is the fresh descriptor made above; the `OwnedFd` closes it once.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}
