//! The system calls of local storage: positional vectored transfers, retried until done, and writeback.

use std::fs::{File, OpenOptions};
use std::io::{self};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Buffers per vectored read (Linux's IOV_MAX).
pub(super) const IOVECS_MAX: usize = 1024;

/// Runs a positional vectored transfer (`preadv` or `pwritev`, as `call`) until every
/// buffer of `iov` is done, at most [`IOVECS_MAX`] buffers per call, retrying interrupted
/// and short transfers; `stuck` is the error when a call moves no byte, given the offset
/// where it stopped.
pub(super) fn vectored_at(
    iov: &mut [libc::iovec],
    mut offset: u64,
    call: impl Fn(&[libc::iovec], libc::off_t) -> isize,
    stuck: impl Fn(u64) -> io::Error,
) -> io::Result<()> {
    let mut first = 0;
    while first < iov.len() {
        let rest = &iov[first..iov.len().min(first + IOVECS_MAX)];
        let n = call(rest, offset as libc::off_t);
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 && rest.iter().any(|v| v.iov_len > 0) {
            return Err(stuck(offset));
        }
        offset += n as u64;
        let mut n = n as usize;
        while first < iov.len() && n >= iov[first].iov_len {
            n -= iov[first].iov_len;
            first += 1;
        }
        if n > 0 {
            let v = &mut iov[first];
            // SAFETY: advancing within the same buffer.
            v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
            v.iov_len -= n;
        }
    }
    Ok(())
}

/// Fills every buffer of `iov`, in order, from `file` at `offset`, retrying short reads.
/// The buffers must stay borrowed (and unaliased) by the caller for the duration.
pub(super) fn preadv_exact(file: &File, iov: &mut [libc::iovec], offset: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    vectored_at(
        iov,
        offset,
        // SAFETY: every iovec describes a live, exclusively borrowed buffer of the caller.
        |v, at| unsafe { libc::preadv(file.as_raw_fd(), v.as_ptr(), v.len() as libc::c_int, at) },
        |at| {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the file ends before byte {at}, which the read needs"),
            )
        },
    )
}

/// A vectored write of at least this many bytes skips the block buffers.
pub(super) const VECTORED_IN_PLACE_BYTES: usize = 1 << 20;

/// Starts writing `len` bytes at `offset` of `file` back to the device without waiting
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`): the disk is busy while the rest of the object
/// is still being written, instead of from the final `fsync` on (2 GiB fit under the
/// kernel's dirty limits, so nothing else starts it), and the dirty pages a save leaves for
/// the rest of the machine stay few. A hint: the final `fsync` is what makes the bytes
/// durable and reports errors.
pub(super) fn start_writeback(file: &File, offset: u64, len: usize) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain system call on a descriptor `file` owns; it touches no memory.
        unsafe {
            libc::sync_file_range(
                file.as_raw_fd(),
                offset as libc::off64_t,
                len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            )
        };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
}

/// Writes every buffer of `bufs`, in order, to `file` at `offset`, retrying short writes.
pub(super) fn pwritev_all(file: &File, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut iov: Vec<libc::iovec> =
        bufs.iter().map(|b| libc::iovec { iov_base: b.as_ptr().cast_mut().cast(), iov_len: b.len() }).collect();
    vectored_at(
        &mut iov,
        offset,
        // SAFETY: every iovec describes a live buffer borrowed from the caller; pwritev only
        // reads from them.
        |v, at| unsafe { libc::pwritev(file.as_raw_fd(), v.as_ptr(), v.len() as libc::c_int, at) },
        |at| io::Error::new(io::ErrorKind::WriteZero, format!("the file accepted no bytes at {at}")),
    )
}

/// Opens `path` for reading with `O_NONBLOCK` (a FIFO without a writer opens at once instead
/// of waiting for one) and `O_NOCTTY` (a terminal never becomes the controlling one).
pub(super) fn open_nonblocking(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path)
}

/// Clears `O_NONBLOCK` on `file`: Linux ignores it for regular files, but not every system
/// and file system promises that, and reads must wait for their bytes.
pub(super) fn set_blocking(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: a plain system call on a descriptor `file` owns; it touches no memory.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & libc::O_NONBLOCK != 0 {
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// An exclusive `flock` of a directory, held until dropped. Closing the descriptor releases
/// it, as does the death of the process, so a killed writer leaves no stale lock behind.
#[derive(Debug)]
pub(super) struct DirLock {
    /// Held only to be closed on drop.
    _dir: File,
}

/// Longest wait for a directory's lock. It is held for a comparison and a rename, so a
/// holder past this is stopped or gone (a suspended process, a network mount's lost client,
/// an outside `flock`): an error that says so, not a save that hangs without a word.
pub(super) const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl DirLock {
    /// Waits for the lock of `dir`, at most [`LOCK_WAIT`].
    pub(super) fn exclusive(dir: &std::path::Path) -> io::Result<DirLock> {
        DirLock::exclusive_within(dir, LOCK_WAIT)
    }

    /// Waits for the lock of `dir`, at most `wait` (`TimedOut` after it).
    pub(super) fn exclusive_within(dir: &std::path::Path, wait: std::time::Duration) -> io::Result<DirLock> {
        use std::os::fd::AsRawFd;
        use std::time::{Duration, Instant};
        let f = File::open(dir)?;
        let deadline = Instant::now().checked_add(wait);
        let mut pause = Duration::from_millis(1);
        loop {
            // SAFETY: a plain system call on a descriptor `f` owns; it touches no memory.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(DirLock { _dir: f });
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock if deadline.is_none_or(|d| Instant::now() < d) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
                io::ErrorKind::WouldBlock => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("{}: its lock was held elsewhere for {wait:?}", dir.display()),
                    ));
                }
                _ => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    fn nonblocking(f: &File) -> bool {
        // SAFETY: a plain system call on a descriptor `f` owns.
        let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
        assert!(flags >= 0);
        flags & libc::O_NONBLOCK != 0
    }

    /// A directory lock held elsewhere is waited for until it is let go, and past the
    /// wait given is an error (it once waited forever).
    #[test]
    fn a_directory_lock_held_elsewhere_is_waited_for_then_refused() {
        use std::time::{Duration, Instant};
        let dir = tempfile::tempdir().unwrap();
        let held = DirLock::exclusive(dir.path()).unwrap();
        let start = Instant::now();
        let e = DirLock::exclusive_within(dir.path(), Duration::from_millis(150)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(start.elapsed() >= Duration::from_millis(150));
        assert!(e.to_string().contains("its lock was held elsewhere"), "{e}");
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(held);
        });
        DirLock::exclusive_within(dir.path(), Duration::from_secs(10)).unwrap();
        release.join().unwrap();
    }

    /// What the local reads open comes back in blocking mode.
    #[test]
    fn a_file_opened_without_blocking_is_set_back_to_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"bytes").unwrap();
        let f = open_nonblocking(&p).unwrap();
        assert!(nonblocking(&f));
        set_blocking(&f).unwrap();
        assert!(!nonblocking(&f));
        set_blocking(&f).unwrap();
        assert!(!nonblocking(&f));
    }
}
