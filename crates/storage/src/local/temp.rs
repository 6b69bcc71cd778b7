//! Temporary files: how a writer names and holds its own, and how a cleaner tells the ones a
//! dead process left from those a live writer still holds.
//!
//! A temporary is named `.dckpt-tmp.<writer>.<n>.<target name>`, where `<writer>` is the
//! process's pid and a random number drawn once per process (two containers on different
//! hosts sharing a file system may both be pid 7). Its writer creates it, takes an exclusive
//! `flock` on it at once and holds the lock until it closes the file: after publishing it
//! (rename or link) or giving up, or when its process dies, however it dies (the kernel closes
//! every file of a process, `kill -9` included). So a temporary whose lock a cleaner can take
//! has no live writer: it is abandoned, and the cleaner removes it while holding that lock.
//!
//! Why a lock and not an age: a lock says exactly whether a writer is alive, at once after a
//! kill, on local disks and on NFS (Linux maps `flock` to NFS locks, which the server holds),
//! whereas an age must outlast the longest pause of any live writer and keeps a killed
//! save's gigabytes until it has passed. Two gaps, and what covers them:
//! - A file system that refuses `flock` (Lustre mounted without `flock`, some FUSE file
//!   systems): there a temporary is abandoned once nobody modified it for
//!   [`UNLOCKED_ABANDONED_AFTER`] (a live writer modifies its file continually).
//! - On NFS, Linux emulates `flock` with POSIX locks, which do not exclude another open file
//!   of the same process (and closing that one would drop the writer's lock): so a cleaner
//!   never judges the temporaries its own process names; its own writers remove theirs when
//!   they finish, fail or are dropped.
//!
//! What stays unseen: a file system whose locks are local to one host although it is shared
//! between hosts (NFS mounted with `local_lock=flock` or `all`). There a cleaner on another
//! host may remove a live writer's temporary; that writer then fails at its rename, naming
//! the file, and nothing already published is touched.

use std::collections::hash_map::RandomState;
use std::fs::{self, File, OpenOptions};
use std::hash::BuildHasher;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use super::TMP_PREFIX;

/// Where `flock` is refused, a temporary unmodified for this long has no live writer.
const UNLOCKED_ABANDONED_AFTER: Duration = Duration::from_secs(3600);

/// Fresh names a writer tries before it gives up creating its temporary.
const CREATE_ATTEMPTS: u32 = 8;

/// This process's writer id: `<pid>-<random>`. The pid is read each time, so a forked child
/// gets an id of its own.
pub(super) fn writer_id() -> String {
    static TOKEN: OnceLock<u32> = OnceLock::new();
    let token = *TOKEN.get_or_init(|| RandomState::new().hash_one((std::process::id(), SystemTime::now())) as u32);
    format!("{}-{token:08x}", std::process::id())
}

/// The writer id in a temporary's file name, if it is one.
fn writer_of(name: &str) -> Option<&str> {
    name.strip_prefix(TMP_PREFIX)?.strip_prefix('.')?.split('.').next()
}

/// The name of the object a temporary's file name is a write of, if it is one.
pub(super) fn target_of(name: &str) -> Option<&str> {
    let mut parts = name.strip_prefix(TMP_PREFIX)?.strip_prefix('.')?.splitn(3, '.');
    let (_writer, _n) = (parts.next()?, parts.next()?);
    parts.next()
}

/// Creates a fresh temporary next to `target`, with `flock` held through the returned file.
pub(super) fn create(target: &Path, counter: &AtomicU64) -> io::Result<(File, PathBuf)> {
    let name = target.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let id = writer_id();
    let mut last = None;
    for _ in 0..CREATE_ATTEMPTS {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        let tmp = target.with_file_name(format!("{TMP_PREFIX}.{id}.{n}.{name}"));
        let file = match OpenOptions::new().read(true).write(true).create_new(true).open(&tmp) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                last = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        };
        // Where locks are refused the file goes unlocked; cleaners then judge it by age.
        let _ = lock(&file, true);
        // A cleaner may have opened the file before the lock was taken, found it unlocked
        // and removed it: then this file has no name any more, and another name is tried.
        if is_at(&file, &tmp)? {
            return Ok((file, tmp));
        }
        last = Some(io::Error::other(format!("{} was removed as it was being created", tmp.display())));
    }
    Err(last.unwrap_or_else(|| io::Error::other("no temporary name")))
}

/// What taking the lock of a file gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Locked {
    Taken,
    /// Another open file holds it.
    Held,
    /// The file system refuses `flock`.
    Refused,
}

/// Takes the exclusive `flock` of `file`, waiting for it or not.
fn lock(file: &File, wait: bool) -> Locked {
    let op = if wait { libc::LOCK_EX } else { libc::LOCK_EX | libc::LOCK_NB };
    loop {
        // SAFETY: a plain system call on a descriptor `file` owns; it touches no memory.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Locked::Taken;
        }
        match io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => return Locked::Held,
            _ => return Locked::Refused,
        }
    }
}

/// Whether `path` names the file `file` has open (not another, nor nothing).
fn is_at(file: &File, path: &Path) -> io::Result<bool> {
    let open = file.metadata()?;
    match fs::symlink_metadata(path) {
        Ok(named) => Ok(open.dev() == named.dev() && open.ino() == named.ino()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// The temporary at `path`, opened and, where the file system allows, locked, if no live
/// writer holds it; with its size.
pub(super) fn abandoned(path: &Path, now: SystemTime) -> io::Result<Option<(File, u64)>> {
    let own = writer_id();
    let name = path.file_name().map(|s| s.to_string_lossy()).unwrap_or_default();
    if writer_of(&name) == Some(own.as_str()) {
        return Ok(None);
    }
    // Not following links and not blocking: a name in the directory is no reason to open
    // what it points at, nor to wait on a FIFO.
    let open = |write: bool| {
        OpenOptions::new().read(true).write(write).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)
    };
    // NFS locks want a file open for writing; a file of another user may only be readable.
    let file =
        match open(true).or_else(|e| if e.kind() == io::ErrorKind::PermissionDenied { open(false) } else { Err(e) }) {
            Ok(f) => f,
            // Published or removed since it was listed.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            // What cannot be opened cannot be judged: it is left alone.
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => return Ok(None),
            Err(e) => return Err(e),
        };
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Ok(None);
    }
    let dead = match lock(&file, false) {
        Locked::Taken => true,
        Locked::Held => false,
        Locked::Refused => meta
            .modified()
            .ok()
            .and_then(|m| now.duration_since(m).ok())
            .is_some_and(|idle| idle >= UNLOCKED_ABANDONED_AFTER),
    };
    Ok(dead.then_some((file, meta.len())))
}

/// Removes the temporary at `path` if no live writer holds it; returns its size if it did.
pub(super) fn remove_if_abandoned(path: &Path, now: SystemTime) -> io::Result<Option<u64>> {
    let Some((file, size)) = abandoned(path, now)? else { return Ok(None) };
    // The lock is held, so no writer can publish the file under another name meanwhile; the
    // name must still be this file's (a writer that lost its file to a cleaner takes a new one).
    if !is_at(&file, path)? {
        return Ok(None);
    }
    match fs::remove_file(path) {
        Ok(()) => Ok(Some(size)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_writer_id_is_read_from_the_name() {
        assert_eq!(writer_of(".dckpt-tmp.42-00c0ffee.7.3f9c0a1b22d4e5f6-00003.safetensors"), Some("42-00c0ffee"));
        assert_eq!(writer_of(".dckpt-tmpfoo"), None);
        assert_eq!(writer_of("dckpt.meta"), None);
        assert!(writer_id().starts_with(&format!("{}-", std::process::id())));
        assert_eq!(writer_id(), writer_id());
    }

    /// A temporary is abandoned exactly when no open file holds its lock, and then removed.
    #[test]
    fn a_held_temporary_is_kept_and_a_free_one_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("{TMP_PREFIX}.1-00000000.0.data"));
        fs::write(&path, b"12345").unwrap();
        let holder = File::open(&path).unwrap();
        assert_eq!(lock(&holder, false), Locked::Taken);
        let now = SystemTime::now();
        assert!(abandoned(&path, now).unwrap().is_none());
        assert_eq!(remove_if_abandoned(&path, now).unwrap(), None);
        assert!(path.exists());
        drop(holder);
        assert_eq!(abandoned(&path, now).unwrap().map(|(_, n)| n), Some(5));
        assert_eq!(remove_if_abandoned(&path, now).unwrap(), Some(5));
        assert!(!path.exists());
        assert_eq!(remove_if_abandoned(&path, now).unwrap(), None);
    }

    /// This process's own temporaries are never judged: on NFS its locks would not tell.
    #[test]
    fn own_temporaries_are_never_abandoned() {
        let dir = tempfile::tempdir().unwrap();
        let (file, tmp) = create(&dir.path().join("data"), &AtomicU64::new(0)).unwrap();
        drop(file);
        assert!(abandoned(&tmp, SystemTime::now()).unwrap().is_none());
        assert!(tmp.exists());
    }

    /// A name that is not a regular file (a FIFO) is neither waited on nor removed.
    #[test]
    fn a_fifo_is_not_a_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("{TMP_PREFIX}.1-00000000.0.fifo"));
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a plain system call with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(remove_if_abandoned(&path, SystemTime::now()).unwrap(), None);
        assert!(path.exists());
    }
}
