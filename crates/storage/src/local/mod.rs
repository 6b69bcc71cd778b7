//! Local-disk storage: temporary name, fsync, rename, directory fsync.
//!
//! [`LocalStorage`] here; positional and vectored system calls in `sys`, ranged reads
//! (gaps filled from scratch, short stretches far apart copied out of a mapping when asked
//! for) in `reader`, streaming writes (positional, writeback started per block) in
//! `writer`.

mod reader;
mod sys;
mod temp;
mod writer;

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;

use bytes::Bytes;

use self::reader::*;
use self::sys::{open_nonblocking, set_blocking};
use self::writer::*;
use crate::ranges::coalesce;
use crate::{
    Error, ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions, check_path,
    check_ranges,
};

/// The read window (see [`StorageHints::read_window`]): a caller that checks what it reads has
/// the next window read ahead (`fadvise(WILLNEED)`) while it reads and checks this one.
pub(super) const READ_WINDOW: u64 = 64 << 20;

/// Files a writer writes at once (see [`StorageHints::writes_in_flight`]): a save of 2 ranks
/// writing four files each beat one file each in 16 of 21 alternating runs
/// (docs/benchmarks.md, "Decisions behind the constants").
pub(super) const WRITES_IN_FLIGHT: usize = 4;

/// The longest gap between two reads of one `read_into` that is read (into scratch) rather
/// than skipped with another system call: about where a system call costs as much as
/// copying the gap (docs/benchmarks.md, "Decisions behind the constants").
pub(super) const READ_GAP_FILL: u64 = 3 << 10;

/// Name prefix of in-progress files; never listed, never a valid object path segment.
pub(crate) const TMP_PREFIX: &str = ".dckpt-tmp";

/// Tuning of [`LocalStorage`].
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// Threads doing positional writes for one streaming writer; 0 writes every block on
    /// the writer's calling thread, as does a process that cannot start one.
    pub write_threads: usize,
    /// Size of one write block: a writer holds at most `write_threads + 3` of them.
    pub block_bytes: usize,
    /// `get_ranges` reads two ranges with one read when the gap between them is at most this.
    pub coalesce_gap_bytes: u64,
    /// Copy many short stretches far apart (a column split of a chunk) out of a mapping of
    /// the file instead of reading each with a system call (Linux; elsewhere ignored). Off
    /// by default: the first such copy installs a **process-wide `SIGBUS` handler** (see the
    /// crate docs), which a library must not do to its host process unasked. A program that
    /// owns its process, like the `dckpt` CLI, turns it on.
    pub mapped_reads: bool,
}

impl Default for LocalConfig {
    fn default() -> Self {
        LocalConfig { write_threads: 2, block_bytes: 8 << 20, coalesce_gap_bytes: 64 << 10, mapped_reads: false }
    }
}

/// Objects as files under a root directory.
///
/// A put writes a temporary file next to the target (`.dckpt-tmp.*`), fsyncs it, renames it
/// over the target and fsyncs the directory. A conditional create hard-links the fsynced
/// temporary file to the target name (the link fails if the name exists), so it needs a file
/// system with hard links (ext4, xfs, btrfs, tmpfs do; some network mounts do not). A
/// conditional replace writes its temporary file, then compares the target with what was
/// expected and renames under an exclusive `flock` of the directory, which puts take for their
/// rename too (the kernel drops it with the process: no stale lock; a file system that cannot
/// lock a directory fails the conditional replace, never silently skips the lock). Objects
/// are files and prefixes are directories, so unlike on S3 one name cannot be both an object
/// and a prefix of other objects (`a` and `a/b`): the second put fails. Unix only (`pwrite`).
///
/// Streaming writers write the temporary file with positional writes (`pwrite`): small chunks
/// are gathered into blocks that a few threads write while the caller goes on; a borrowed
/// chunk of at least a block is written in place by the caller (no copy); a `Bytes` chunk of
/// at least a block goes to the threads without a copy. Why not more threads: buffered writes
/// to one file are serialized by the kernel (ext4 takes the inode lock), so the threads buy
/// overlap with the caller's work (checksums, the next chunk), not parallel disk IO.
///
/// Every temporary file is held by its writer with an exclusive `flock` until the writer closes
/// it, which a dying process does too, `kill -9` included. `list` never shows temporaries;
/// [`Storage::list_abandoned`] shows those whose lock is free (their writer is gone), and
/// [`Storage::remove_abandoned`] removes them, never one a live writer holds. Where the file
/// system refuses `flock`, a temporary is abandoned once unmodified for an hour. Temporaries
/// named by this process are never judged abandoned by it (NFS emulates `flock` with POSIX
/// locks, which one process cannot use against itself); it removes its own as its writers
/// end. On a file system shared between hosts whose locks are local to each host (NFS with
/// `local_lock=flock`), a cleaner on another host cannot see a live writer's lock.
///
/// Reads are positional vectored reads (`preadv`), short gaps between them read into
/// scratch; with [`LocalConfig::mapped_reads`] on, many short stretches far apart are copied
/// out of a mapping of the file instead. Reading (or sizing) a name that is not a regular
/// file, such as a directory, a FIFO, a socket or a device, fails at once with a permanent
/// error that says what it is; a FIFO is never opened in a way that waits for a writer.
#[derive(Debug)]
pub struct LocalStorage {
    root: PathBuf,
    config: LocalConfig,
    counter: AtomicU64,
}

impl LocalStorage {
    /// Storage rooted at `root` (created if missing), default tuning.
    pub fn new(root: impl AsRef<Path>) -> Result<Self> {
        Self::with_config(root, LocalConfig::default())
    }

    /// Storage rooted at `root` (created if missing).
    pub fn with_config(root: impl AsRef<Path>, config: LocalConfig) -> Result<Self> {
        let root = root.as_ref().to_path_buf();
        let url = root.display().to_string();
        if config.block_bytes == 0 {
            return Err(Error::Config { url, message: "block_bytes must be > 0".into() });
        }
        // Each directory made is synced into its parent: a commit under a root made here is
        // durable only if the root's own entry is.
        ensure_dir(&root).map_err(|e| Error::io("create root", &url, e))?;
        Ok(LocalStorage { root, config, counter: AtomicU64::new(0) })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn file_path(&self, path: &str) -> Result<PathBuf> {
        check_path(path, false)?;
        Ok(self.root.join(path))
    }

    /// Writes `data` to a new fsynced temporary file for `target`; returns its path and the
    /// file, whose lock keeps cleaners away until the caller has published it and drops it.
    fn write_temp(&self, target: &Path, location: &str, data: &[u8]) -> Result<(File, PathBuf)> {
        let dir = parent(target);
        ensure_dir(dir).map_err(|e| Error::io("create directory", location, e))?;
        let (mut f, tmp) = temp::create(target, &self.counter).map_err(|e| Error::io("create", location, e))?;
        if let Err(e) = f.write_all(data).and_then(|()| f.sync_all()) {
            let _ = fs::remove_file(&tmp);
            return Err(Error::io("write", location, e));
        }
        Ok((f, tmp))
    }

    /// The temporaries at or under `prefix`, as `(path relative to the root, absolute path)`.
    fn temporaries(&self, prefix: &str) -> Result<Vec<(String, PathBuf)>> {
        check_path(prefix, true)?;
        let start = self.root.join(prefix);
        let loc = self.location(prefix);
        let mut found = Vec::new();
        walk(&start, "", &mut found, true).map_err(|e| Error::io("list", &loc, e))?;
        let mut out: Vec<(String, PathBuf)> = found
            .into_iter()
            .map(|(rel, _)| {
                let path = if prefix.is_empty() { rel.clone() } else { format!("{prefix}/{rel}") };
                (path, start.join(rel))
            })
            .collect();
        // A write of the object the prefix itself names sits beside it, in its directory.
        if let Some(name) = Path::new(prefix).file_name().and_then(|n| n.to_str()) {
            let dir = prefix.strip_suffix(name).unwrap_or_default().trim_end_matches('/');
            let entries = match fs::read_dir(self.root.join(dir)) {
                Ok(entries) => entries.collect::<io::Result<Vec<_>>>().map_err(|e| Error::io("list", &loc, e))?,
                Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => Vec::new(),
                Err(e) => return Err(Error::io("list", &loc, e)),
            };
            for entry in entries {
                let Ok(file) = entry.file_name().into_string() else { continue };
                if temp::target_of(&file) == Some(name) && entry.file_type().is_ok_and(|t| t.is_file()) {
                    let path = if dir.is_empty() { file } else { format!("{dir}/{file}") };
                    out.push((path, entry.path()));
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// A reader of `file`, opened from `path`, `len` bytes long.
    fn opened(&self, path: &str, file: File, len: u64) -> Box<dyn ObjectReader + '_> {
        Box::new(LocalReader {
            file,
            len,
            location: self.location(path),
            order: Vec::new(),
            scratch: Vec::new(),
            taken: Vec::new(),
            // Without the opt-in the reader never maps, so the handler is never installed.
            map: if self.config.mapped_reads { Mapped::NotYet } else { Mapped::Never },
        })
    }

    /// Opens an object for reading, refusing (and naming) anything that is not a regular
    /// file without blocking on it: opening a FIFO waits for a writer, forever if none comes.
    fn open_read(&self, path: &str) -> Result<(File, u64)> {
        let p = self.file_path(path)?;
        let loc = self.location(path);
        // Checked before the open, so that a device is never opened (opening one can act on
        // it: a tape rewinds).
        let meta = fs::metadata(&p).map_err(|e| Error::io("stat", &loc, e))?;
        if !meta.is_file() {
            return Err(not_regular("open", &loc, &meta.file_type()));
        }
        // Non-blocking, so that a FIFO put in its place since the check cannot hang the open;
        // what was opened is checked again, then reads block as usual.
        let f = open_nonblocking(&p).map_err(|e| Error::io("open", &loc, e))?;
        let meta = f.metadata().map_err(|e| Error::io("stat", &loc, e))?;
        if !meta.is_file() {
            return Err(not_regular("open", &loc, &meta.file_type()));
        }
        set_blocking(&f).map_err(|e| Error::io("open", &loc, e))?;
        Ok((f, meta.len()))
    }
}

impl Storage for LocalStorage {
    fn location(&self, path: &str) -> String {
        self.root.join(path).display().to_string()
    }

    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        let target = self.file_path(path)?;
        let loc = self.location(path);
        let (_held, tmp) = self.write_temp(&target, &loc, &data)?;
        publish_locked(&tmp, &target).map_err(|e| Error::io("rename", &loc, e))
    }

    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        let target = self.file_path(path)?;
        let loc = self.location(path);
        let (_held, tmp) = self.write_temp(&target, &loc, &data)?;
        let linked = fs::hard_link(&tmp, &target).map_err(|e| vanished(e, &tmp));
        let _ = fs::remove_file(&tmp);
        linked.map_err(|e| Error::io("create", &loc, e))?;
        sync_dir(parent(&target)).map_err(|e| Error::io("fsync directory", &loc, e))
    }

    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        let target = self.file_path(path)?;
        let loc = self.location(path);
        // Written and fsynced first: the lock covers only the comparison and the rename.
        let (_held, tmp) = self.write_temp(&target, &loc, &data)?;
        let _lock = lock_dir(&target, &tmp, &loc)?;
        // Sized before it is read: an object now far larger than what is expected differs
        // from it, and reading it whole could exhaust memory first. `None`: there is none.
        let same = match self.open_read(path) {
            Ok((_, len)) if len != expected.len() as u64 => Ok(Some(false)),
            Ok((mut f, len)) => {
                let mut buf = Vec::with_capacity(len as usize);
                f.read_to_end(&mut buf).map(|_| Some(buf == expected)).map_err(|e| Error::io("read", &loc, e))
            }
            Err(Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        };
        let same = same.inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })?;
        if same != Some(true) {
            let _ = fs::remove_file(&tmp);
            return Err(crate::not_expected(loc, same.is_some()));
        }
        publish(&tmp, &target).map_err(|e| Error::io("rename", &loc, e))
    }

    fn writer(&self, path: &str, _options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        let target = self.file_path(path)?;
        let loc = self.location(path);
        ensure_dir(parent(&target)).map_err(|e| Error::io("create directory", &loc, e))?;
        let (file, tmp) = temp::create(&target, &self.counter).map_err(|e| Error::io("create", &loc, e))?;
        Ok(Box::new(LocalWriter::new(file, tmp, target, loc, &self.config)))
    }

    fn get(&self, path: &str) -> Result<Bytes> {
        let (mut f, len) = self.open_read(path)?;
        let mut buf = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        f.read_to_end(&mut buf).map_err(|e| Error::io("read", &self.location(path), e))?;
        Ok(Bytes::from(buf))
    }

    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        let (f, len) = self.open_read(path)?;
        let loc = self.location(path);
        check_ranges(&loc, ranges, len)?;
        let mut out = vec![Bytes::new(); ranges.len()];
        for span in coalesce(ranges, self.config.coalesce_gap_bytes) {
            let n = usize::try_from(span.range.end - span.range.start)
                .map_err(|_| Error::permanent("read", &loc, "range larger than memory"))?;
            let mut buf = vec![0u8; n];
            f.read_exact_at(&mut buf, span.range.start).map_err(|e| {
                let e = io::Error::new(e.kind(), format!("bytes {}..{}: {e}", span.range.start, span.range.end));
                Error::io("read", &loc, e)
            })?;
            let buf = Bytes::from(buf);
            for i in span.members {
                let r = &ranges[i];
                out[i] = buf.slice((r.start - span.range.start) as usize..(r.end - span.range.start) as usize);
            }
        }
        Ok(out)
    }

    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.reader(path)?.read_into(reads)
    }

    fn reader(&self, path: &str) -> Result<Box<dyn ObjectReader + '_>> {
        let (file, len) = self.open_read(path)?;
        Ok(self.opened(path, file, len))
    }

    /// The length is the open file's, from the `fstat` its open makes anyway.
    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>> {
        let (file, size) = self.open_read(path)?;
        if size != len {
            return Err(Error::SizeMismatch { path: self.location(path), expected: len, size });
        }
        Ok(self.opened(path, file, len))
    }

    fn hints(&self) -> StorageHints {
        // Inspected reads come out of the file's mapping where mapped reads are on.
        StorageHints::NONE
            .with_read_window(Some(READ_WINDOW))
            .with_reads_in_place(self.config.mapped_reads)
            .with_writes_in_flight(Some(WRITES_IN_FLIGHT))
    }

    fn prefetch(&self, path: &str, at: u64, len: u64) {
        use std::os::fd::AsRawFd;
        let Ok((f, size)) = self.open_read(path) else { return };
        let len = len.min(size.saturating_sub(at));
        if len > 0 {
            // SAFETY: a plain system call on a descriptor this function owns.
            unsafe {
                libc::posix_fadvise(f.as_raw_fd(), at as libc::off_t, len as libc::off_t, libc::POSIX_FADV_WILLNEED)
            };
        }
    }

    fn size(&self, path: &str) -> Result<u64> {
        let p = self.file_path(path)?;
        let loc = self.location(path);
        let meta = fs::metadata(&p).map_err(|e| Error::io("stat", &loc, e))?;
        if !meta.is_file() {
            return Err(not_regular("stat", &loc, &meta.file_type()));
        }
        Ok(meta.len())
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        check_path(prefix, true)?;
        let start = self.root.join(prefix);
        let loc = self.location(prefix);
        let mut found = Vec::new();
        match fs::metadata(&start) {
            Ok(m) if m.is_file() => found.push((String::new(), m.len())),
            Ok(m) if m.is_dir() => walk(&start, "", &mut found, false).map_err(|e| Error::io("list", &loc, e))?,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => {}
            Err(e) => return Err(Error::io("list", &loc, e)),
        }
        let mut out: Vec<ObjectInfo> = found
            .into_iter()
            .map(|(rel, size)| {
                let path = match (prefix.is_empty(), rel.is_empty()) {
                    (true, _) => rel,
                    (false, true) => prefix.to_string(),
                    (false, false) => format!("{prefix}/{rel}"),
                };
                ObjectInfo { path, size }
            })
            .collect();
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let now = std::time::SystemTime::now();
        let mut out = Vec::new();
        for (path, file) in self.temporaries(prefix)? {
            let judged =
                temp::abandoned(&file, now).map_err(|e| Error::io("inspect temporary", &self.location(&path), e))?;
            if let Some((_, size)) = judged {
                out.push(ObjectInfo { path, size });
            }
        }
        Ok(out)
    }

    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let now = std::time::SystemTime::now();
        let mut out = Vec::new();
        for (path, file) in self.temporaries(prefix)? {
            let removed = temp::remove_if_abandoned(&file, now)
                .map_err(|e| Error::io("remove temporary", &self.location(&path), e))?;
            if let Some(size) = removed {
                out.push(ObjectInfo { path, size });
            }
        }
        Ok(out)
    }

    fn delete(&self, path: &str) -> Result<()> {
        let p = self.file_path(path)?;
        match fs::remove_file(&p) {
            Ok(()) => sync_dir(parent(&p)).map_err(|e| Error::io("fsync directory", &self.location(path), e)),
            // No object by that name: nothing at it, a file above it, or a directory (which
            // holds objects under the name, as a prefix does on S3).
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::NotADirectory | io::ErrorKind::IsADirectory
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(Error::io("delete", &self.location(path), e)),
        }
    }
}

/// Collects `(relative path, size)` of files under `dir`: objects, or with `temporaries` only
/// the temporary files.
/// An error names the entry it met (an `io::Error` carries no path, and the caller names
/// only the top of the walk).
pub(super) fn walk(dir: &Path, rel: &str, out: &mut Vec<(String, u64)>, temporaries: bool) -> io::Result<()> {
    let at = |e: io::Error, p: &Path| io::Error::new(e.kind(), format!("{}: {e}", p.display()));
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        // Removed concurrently, never there, or an object: nothing under it.
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => return Ok(()),
        Err(e) => return Err(at(e, dir)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| at(e, dir))?;
        // An object's path is text: a name that is not (made by hand) is no object, where
        // its lossy form named a file no call could reach (a delete of it "succeeded").
        let Ok(name) = entry.file_name().into_string() else { continue };
        let child = if rel.is_empty() { name.clone() } else { format!("{rel}/{name}") };
        let ty = entry.file_type().map_err(|e| at(e, &entry.path()))?;
        if ty.is_dir() {
            walk(&entry.path(), &child, out, temporaries)?;
        } else if (ty.is_file() || ty.is_symlink()) && name.starts_with(TMP_PREFIX) == temporaries {
            // A link to a regular file is that file, as `size` and `get` (which follow it)
            // see it: a data file moved to another disk and linked back is there, where gc
            // took its step for damaged. A link to anything else is not an object.
            let meta = if ty.is_symlink() { fs::metadata(entry.path()) } else { entry.metadata() };
            match meta {
                Ok(m) if m.is_file() => out.push((child, m.len())),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(at(e, &entry.path())),
            }
        }
    }
    Ok(())
}

/// The error for a name that is there but is not a regular file: what it is, so that an
/// operator who finds a FIFO or a directory where an object should be is told so, not "not
/// found".
fn not_regular(op: &'static str, location: &str, ty: &fs::FileType) -> Error {
    use std::os::unix::fs::FileTypeExt;
    let what = if ty.is_dir() {
        "a directory"
    } else if ty.is_fifo() {
        "a FIFO (named pipe)"
    } else if ty.is_socket() {
        "a socket"
    } else if ty.is_char_device() {
        "a character device"
    } else if ty.is_block_device() {
        "a block device"
    } else {
        "of an unknown type"
    };
    Error::permanent(op, location, format!("it is {what}, not a regular file"))
}

/// The lock of `target`'s directory, which conditional replaces hold for their comparison
/// and rename (and puts for their rename); removes `tmp` when it cannot be taken.
fn lock_dir(target: &Path, tmp: &Path, location: &str) -> Result<sys::DirLock> {
    sys::DirLock::exclusive(parent(target)).map_err(|e| {
        let _ = fs::remove_file(tmp);
        Error::io("lock directory", location, e)
    })
}

/// The directory `p` is in (`.` for a relative name of one segment).
pub(super) fn parent(p: &Path) -> &Path {
    match p.parent() {
        Some(up) if !up.as_os_str().is_empty() => up,
        _ => Path::new("."),
    }
}

/// Creates `dir` and missing parents, fsyncing each parent whose entry list changed.
pub(super) fn ensure_dir(dir: &Path) -> io::Result<()> {
    if dir.as_os_str().is_empty() || dir.is_dir() {
        return Ok(());
    }
    if let Some(up) = dir.parent() {
        ensure_dir(up)?;
    }
    match fs::create_dir(dir) {
        Ok(()) => sync_dir(parent(dir)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

pub(super) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Renames the fsynced `tmp` over `target` and fsyncs the directory; removes `tmp` on failure.
pub(super) fn publish(tmp: &Path, target: &Path) -> io::Result<()> {
    if let Err(e) = fs::rename(tmp, target) {
        let _ = fs::remove_file(tmp);
        return Err(vanished(e, tmp));
    }
    sync_dir(parent(target))
}

/// [`publish`] under the directory's lock, as a put lands, so that none lands inside a
/// conditional replace's comparison. Where the file system cannot lock it (some network
/// mounts), no conditional replace can succeed there either, so the rename goes on without
/// it.
fn publish_locked(tmp: &Path, target: &Path) -> io::Result<()> {
    let _lock = match sys::DirLock::exclusive(parent(target)) {
        Ok(lock) => Some(lock),
        // Held elsewhere past the wait: a rename now could land inside a comparison.
        Err(e) if e.kind() == io::ErrorKind::TimedOut => {
            let _ = fs::remove_file(tmp);
            return Err(e);
        }
        Err(_) => None,
    };
    publish(tmp, target)
}

/// A rename or link of `tmp` that found no `tmp`: its temporary was removed under it (by a
/// cleaner on a host that cannot see this writer's lock). Named as such, where a plain
/// "not found" reads as the target's absence.
fn vanished(e: io::Error, tmp: &Path) -> io::Error {
    if e.kind() != io::ErrorKind::NotFound {
        return e;
    }
    io::Error::other(format!("its temporary file {} was removed before it was published: {e}", tmp.display()))
}
