//! Local-disk storage: temporary name, fsync, rename, directory fsync.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use bytes::Bytes;

use crate::ranges::coalesce;

/// Buffers per vectored read (Linux's IOV_MAX).
const IOVECS_MAX: usize = 1024;

/// The read window (see [`StorageHints::read_window`]): a caller that checks what it reads has
/// the next window read ahead (`fadvise(WILLNEED)`) while it reads and checks this one.
const READ_WINDOW: u64 = 64 << 20;

/// The longest gap between two reads of one `read_into` that is read (into scratch) rather
/// than skipped with another system call. Where a system call costs about as much as
/// copying the gap: reading every other stretch of a file in the page cache, one call per
/// stretch beat filling the gaps from 4 KiB stretches up (by a quarter at 16 KiB) and lost
/// below 2 KiB, with two readers at once as with one.
const READ_GAP_FILL: u64 = 3 << 10;

/// Runs a positional vectored transfer (`preadv` or `pwritev`, as `call`) until every
/// buffer of `iov` is done, at most [`IOVECS_MAX`] buffers per call, retrying interrupted
/// and short transfers; `stuck` is the error when a call moves no byte.
fn vectored_at(
    iov: &mut [libc::iovec],
    mut offset: u64,
    call: impl Fn(&[libc::iovec], libc::off_t) -> isize,
    stuck: impl Fn() -> io::Error,
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
            return Err(stuck());
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
fn preadv_exact(file: &File, iov: &mut [libc::iovec], offset: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    vectored_at(
        iov,
        offset,
        // SAFETY: every iovec describes a live, exclusively borrowed buffer of the caller.
        |v, at| unsafe { libc::preadv(file.as_raw_fd(), v.as_ptr(), v.len() as libc::c_int, at) },
        || io::Error::new(io::ErrorKind::UnexpectedEof, "file ended before the requested range"),
    )
}

/// A vectored write of at least this many bytes skips the block buffers.
const VECTORED_IN_PLACE_BYTES: usize = 1 << 20;

/// Starts writing `len` bytes at `offset` of `file` back to the device without waiting
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`): the disk is busy while the rest of the object
/// is still being written, instead of from the final `fsync` on (2 GiB fit under the
/// kernel's dirty limits, so nothing else starts it), and the dirty pages a save leaves for
/// the rest of the machine stay few. A hint: the final `fsync` is what makes the bytes
/// durable and reports errors.
fn start_writeback(file: &File, offset: u64, len: usize) {
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
fn pwritev_all(file: &File, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut iov: Vec<libc::iovec> =
        bufs.iter().map(|b| libc::iovec { iov_base: b.as_ptr().cast_mut().cast(), iov_len: b.len() }).collect();
    vectored_at(
        &mut iov,
        offset,
        // SAFETY: every iovec describes a live buffer borrowed from the caller; pwritev only
        // reads from them.
        |v, at| unsafe { libc::pwritev(file.as_raw_fd(), v.as_ptr(), v.len() as libc::c_int, at) },
        || io::Error::new(io::ErrorKind::WriteZero, "the file accepted no bytes"),
    )
}

use crate::{
    Error, ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions, check_path,
    check_ranges,
};

/// Name prefix of in-progress files; never listed, never a valid object path segment.
pub(crate) const TMP_PREFIX: &str = ".dckpt-tmp";

/// Tuning of [`LocalStorage`].
#[derive(Debug, Clone)]
pub struct LocalConfig {
    /// Threads doing positional writes for one streaming writer (at least 1).
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
/// system with hard links (ext4, xfs, btrfs, tmpfs do; some network mounts do not). Objects
/// are files and prefixes are directories, so unlike on S3 one name cannot be both an object
/// and a prefix of other objects (`a` and `a/b`): the second put fails. Unix only (`pwrite`).
///
/// Streaming writers write the temporary file with positional writes (`pwrite`): small chunks
/// are gathered into blocks that a few threads write while the caller goes on; a borrowed
/// chunk of at least a block is written in place by the caller (no copy); a `Bytes` chunk of
/// at least a block goes to the threads without a copy. Why not more threads: buffered writes
/// to one file are serialized by the kernel (ext4 takes the inode lock), so the threads buy
/// overlap with the caller's work (checksums, the next chunk), not parallel disk IO. Leftover
/// temporary files of a crashed process are ignored by `list` and can be removed with
/// [`LocalStorage::remove_temporaries`].
///
/// Reads are positional vectored reads (`preadv`), short gaps between them read into
/// scratch; with [`LocalConfig::mapped_reads`] on, many short stretches far apart are copied
/// out of a mapping of the file instead.
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
        if config.write_threads == 0 || config.block_bytes == 0 {
            return Err(Error::Config { url, message: "write_threads and block_bytes must be > 0".into() });
        }
        fs::create_dir_all(&root).map_err(|e| Error::io("create root", &url, e))?;
        Ok(LocalStorage { root, config, counter: AtomicU64::new(0) })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Removes temporary files left under `prefix` by writers that never finished (for
    /// example in a crashed process). Do not call while writers are active there.
    pub fn remove_temporaries(&self, prefix: &str) -> Result<usize> {
        check_path(prefix, true)?;
        let mut files = Vec::new();
        walk(&self.root.join(prefix), "", &mut files, true)
            .map_err(|e| Error::io("list", &self.location(prefix), e))?;
        let n = files.len();
        for (rel, _) in files {
            let p = self.root.join(prefix).join(rel);
            fs::remove_file(&p).map_err(|e| Error::io("delete", &p.display().to_string(), e))?;
        }
        Ok(n)
    }

    fn file_path(&self, path: &str) -> Result<PathBuf> {
        check_path(path, false)?;
        Ok(self.root.join(path))
    }

    /// A fresh temporary path next to `target`.
    fn temp_for(&self, target: &Path) -> PathBuf {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let name = target.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        target.with_file_name(format!("{TMP_PREFIX}.{}.{n}.{name}", std::process::id()))
    }

    /// Writes `data` to a new fsynced temporary file for `target`; returns its path.
    fn write_temp(&self, target: &Path, location: &str, data: &[u8]) -> Result<PathBuf> {
        let dir = parent(target);
        ensure_dir(dir).map_err(|e| Error::io("create directory", location, e))?;
        let tmp = self.temp_for(target);
        let res = (|| {
            let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            f.write_all(data)?;
            f.sync_all()
        })();
        if let Err(e) = res {
            let _ = fs::remove_file(&tmp);
            return Err(Error::io("write", location, e));
        }
        Ok(tmp)
    }

    fn open_read(&self, path: &str) -> Result<(File, u64)> {
        let p = self.file_path(path)?;
        let loc = self.location(path);
        let f = File::open(&p).map_err(|e| Error::io("open", &loc, e))?;
        let meta = f.metadata().map_err(|e| Error::io("stat", &loc, e))?;
        if !meta.is_file() {
            return Err(Error::NotFound { path: loc });
        }
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
        let tmp = self.write_temp(&target, &loc, &data)?;
        publish(&tmp, &target).map_err(|e| Error::io("rename", &loc, e))
    }

    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        let target = self.file_path(path)?;
        let loc = self.location(path);
        let tmp = self.write_temp(&target, &loc, &data)?;
        let linked = fs::hard_link(&tmp, &target);
        let _ = fs::remove_file(&tmp);
        linked.map_err(|e| Error::io("create", &loc, e))?;
        sync_dir(parent(&target)).map_err(|e| Error::io("fsync directory", &loc, e))
    }

    fn writer(&self, path: &str, _options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        let target = self.file_path(path)?;
        let loc = self.location(path);
        ensure_dir(parent(&target)).map_err(|e| Error::io("create directory", &loc, e))?;
        let tmp = self.temp_for(&target);
        let file =
            OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(|e| Error::io("create", &loc, e))?;
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
            f.read_exact_at(&mut buf, span.range.start).map_err(|e| Error::io("read", &loc, e))?;
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
        Ok(Box::new(LocalReader {
            file,
            len,
            location: self.location(path),
            order: Vec::new(),
            scratch: Vec::new(),
            taken: Vec::new(),
            // Without the opt-in the reader never maps, so the handler is never installed.
            map: if self.config.mapped_reads { Mapped::NotYet } else { Mapped::Never },
        }))
    }

    fn hints(&self) -> StorageHints {
        StorageHints::NONE.with_read_window(Some(READ_WINDOW))
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
            return Err(Error::NotFound { path: loc });
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

    fn delete(&self, path: &str) -> Result<()> {
        let p = self.file_path(path)?;
        match fs::remove_file(&p) {
            Ok(()) => sync_dir(parent(&p)).map_err(|e| Error::io("fsync directory", &self.location(path), e)),
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => Ok(()),
            Err(e) => Err(Error::io("delete", &self.location(path), e)),
        }
    }
}

/// One file opened for reading (see [`Storage::reader`]).
struct LocalReader {
    file: File,
    len: u64,
    location: String,
    /// Reused between calls: the reads in file order, the buffer gaps are read into, and
    /// which reads are copied out of the mapping.
    order: Vec<usize>,
    scratch: Vec<u8>,
    taken: Vec<bool>,
    /// The file mapped, for short stretches far apart (see [`MAPPED_BELOW`]): made on the
    /// first call that has enough of them, dropped after a failed copy; never made unless
    /// [`LocalConfig::mapped_reads`] is on.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    map: Mapped,
}

/// A run of reads (reads that continue one another) shorter than this is copied out of a
/// mapping of the file when a call has at least [`MAPPED_RUNS_MIN`] of them, instead of
/// costing a system call, or a kernel copy of the gap before it, each: below it the mapping
/// was faster, from it on the same (docs/benchmarks.md, "Decisions behind the constants").
const MAPPED_BELOW: u64 = 32 << 10;

/// The fewest short runs in one call worth a mapping (a judgement, not measured: a call with
/// a handful of short reads does not make a mapping of the whole file for them).
const MAPPED_RUNS_MIN: usize = 16;

/// Where a reader stands with its mapping.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
enum Mapped {
    /// Not needed yet.
    NotYet,
    #[cfg(target_os = "linux")]
    Ready(crate::mapped::Mapping),
    /// Not wanted ([`LocalConfig::mapped_reads`] off), not possible, or given up after a
    /// fault: every read is a system call.
    Never,
}

impl LocalReader {
    /// Copies the reads of `order` that lie in runs shorter than [`MAPPED_BELOW`] out of the
    /// file's mapping, when there are enough of them, and removes them from `order`.
    #[cfg(target_os = "linux")]
    fn copy_short_runs(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        use crate::mapped::{Mapping, Unreadable};
        if matches!(self.map, Mapped::Never) {
            return Ok(());
        }
        let order = &mut self.order;
        // Which reads lie in short runs (runs: reads in `order`, sorted by offset, each
        // starting where the one before ends).
        let taken = &mut self.taken;
        taken.clear();
        taken.resize(reads.len(), false);
        let mut runs = 0;
        let mut i = 0;
        while i < order.len() {
            let start = reads[order[i]].0;
            let mut end = start + reads[order[i]].1.len() as u64;
            let mut j = i + 1;
            while j < order.len() && reads[order[j]].0 == end {
                end += reads[order[j]].1.len() as u64;
                j += 1;
            }
            if end - start < MAPPED_BELOW {
                runs += 1;
                for &k in &order[i..j] {
                    taken[k] = true;
                }
            }
            i = j;
        }
        if runs < MAPPED_RUNS_MIN {
            return Ok(());
        }
        if matches!(self.map, Mapped::NotYet) {
            self.map = Mapping::new(&self.file, self.len).map_or(Mapped::Never, Mapped::Ready);
        }
        let Mapped::Ready(map) = &self.map else { return Ok(()) };
        let copied = map.copy_out(
            &self.file,
            reads.iter_mut().enumerate().filter(|(k, _)| taken[*k]).map(|(_, (at, buf))| (*at, &mut **buf)),
        );
        let why = match copied {
            Ok(()) => {
                order.retain(|&k| !taken[k]);
                return Ok(());
            }
            Err(why) => why,
        };
        self.map = Mapped::Never;
        let message = match why {
            // Nothing was copied: read instead, as without a mapping.
            Unreadable::NoHandler | Unreadable::Failed => return Ok(()),
            Unreadable::Fault(at) => format!(
                "the page at offset {at} could not be read (a read error, or the file was cut short while being read)"
            ),
            Unreadable::Shorter { size, end } => {
                format!(
                    "the file is now {size} bytes, short of a read that ended at {end} (it was cut short while being read)"
                )
            }
            Unreadable::Stat => "the file's size could not be checked after reading".to_string(),
        };
        Err(Error::io("read", &self.location, io::Error::other(message)))
    }

    #[cfg(not(target_os = "linux"))]
    fn copy_short_runs(&mut self, _reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        Ok(())
    }
}

impl ObjectReader for LocalReader {
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        let loc = &self.location;
        check_ranges(loc, &crate::read_ranges(loc, reads)?, self.len)?;
        self.order.clear();
        self.order.extend((0..reads.len()).filter(|&i| !reads[i].1.is_empty()));
        self.order.sort_unstable_by_key(|&i| reads[i].0);
        self.copy_short_runs(reads)?;
        // Reads that continue one another, or nearly, go into one vectored read: many small
        // pieces of one file cost a few system calls, not one each, and still no copy. A
        // short gap between two reads is read into a scratch buffer, which is cheaper than
        // a system call for it (every gap reuses the same scratch).
        let loc = &self.location;
        let order = &self.order;
        let scratch = &mut self.scratch;
        let mut iov: Vec<libc::iovec> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let start = reads[order[i]].0;
            let mut end = start;
            iov.clear();
            while i < order.len() && iov.len() < IOVECS_MAX {
                let (at, ref mut buf) = reads[order[i]];
                // Reads may overlap; an overlapping one starts a new system call.
                if at < end || (at > end && (at - end > READ_GAP_FILL || iov.len() + 1 == IOVECS_MAX)) {
                    break;
                }
                if at > end {
                    if scratch.is_empty() {
                        scratch.resize(READ_GAP_FILL as usize, 0);
                    }
                    iov.push(libc::iovec { iov_base: scratch.as_mut_ptr().cast(), iov_len: (at - end) as usize });
                }
                iov.push(libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() });
                end = at + buf.len() as u64;
                i += 1;
            }
            preadv_exact(&self.file, &mut iov, start).map_err(|e| Error::io("read", loc, e))?;
        }
        Ok(())
    }
}

/// Collects `(relative path, size)` of files under `dir`: objects, or with `temporaries` only
/// the temporary files.
fn walk(dir: &Path, rel: &str, out: &mut Vec<(String, u64)>, temporaries: bool) -> io::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        // Removed concurrently, or never there: nothing under it.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let child = if rel.is_empty() { name.clone() } else { format!("{rel}/{name}") };
        let ty = entry.file_type()?;
        if ty.is_dir() {
            walk(&entry.path(), &child, out, temporaries)?;
        } else if ty.is_file() && name.starts_with(TMP_PREFIX) == temporaries {
            match entry.metadata() {
                Ok(m) => out.push((child, m.len())),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

fn parent(p: &Path) -> &Path {
    p.parent().unwrap_or(Path::new("."))
}

/// Creates `dir` and missing parents, fsyncing each parent whose entry list changed.
fn ensure_dir(dir: &Path) -> io::Result<()> {
    if dir.is_dir() {
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

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Renames the fsynced `tmp` over `target` and fsyncs the directory; removes `tmp` on failure.
fn publish(tmp: &Path, target: &Path) -> io::Result<()> {
    if let Err(e) = fs::rename(tmp, target) {
        let _ = fs::remove_file(tmp);
        return Err(e);
    }
    sync_dir(parent(target))
}

/// A block on its way to disk.
enum Block {
    Owned(Vec<u8>),
    Shared(Bytes),
}

impl Block {
    fn as_slice(&self) -> &[u8] {
        match self {
            Block::Owned(v) => v,
            Block::Shared(b) => b,
        }
    }
}

/// Positional writers on a few threads. Memory: at most `threads + 2` owned blocks exist
/// (recycled through `free_rx`), and at most `threads` shared blocks wait in the queue.
struct WritePool {
    work_tx: Option<SyncSender<(u64, Block)>>,
    free_rx: Receiver<Vec<u8>>,
    workers: Vec<JoinHandle<()>>,
    error: Arc<Mutex<Option<io::Error>>>,
    owned_blocks: usize,
}

impl WritePool {
    fn new(file: Arc<File>, threads: usize) -> WritePool {
        let (work_tx, work_rx) = mpsc::sync_channel::<(u64, Block)>(threads);
        let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
        let work_rx = Arc::new(Mutex::new(work_rx));
        let error: Arc<Mutex<Option<io::Error>>> = Arc::default();
        let workers = (0..threads)
            .map(|_| {
                let (file, work_rx, free_tx, error) = (file.clone(), work_rx.clone(), free_tx.clone(), error.clone());
                std::thread::spawn(move || {
                    loop {
                        let next = work_rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok((offset, block)) = next else { break };
                        let failed = error.lock().unwrap_or_else(|p| p.into_inner()).is_some();
                        if !failed {
                            match file.write_all_at(block.as_slice(), offset) {
                                Ok(()) => start_writeback(&file, offset, block.as_slice().len()),
                                Err(e) => {
                                    error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                                }
                            }
                        }
                        if let Block::Owned(mut v) = block {
                            v.clear();
                            let _ = free_tx.send(v);
                        }
                    }
                })
            })
            .collect();
        WritePool { work_tx: Some(work_tx), free_rx, workers, error, owned_blocks: 0 }
    }

    fn take_error(&self) -> Option<io::Error> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn submit(&mut self, offset: u64, block: Block) -> io::Result<()> {
        if let Some(e) = self.take_error() {
            return Err(e);
        }
        let tx = self.work_tx.as_ref().ok_or_else(|| io::Error::other("write pool closed"))?;
        tx.send((offset, block)).map_err(|_| io::Error::other("write threads stopped"))
    }

    /// An empty block buffer: a recycled one, a new one while under `max`, else waits.
    fn buffer(&mut self, max: usize, block_bytes: usize) -> io::Result<Vec<u8>> {
        if let Ok(v) = self.free_rx.try_recv() {
            return Ok(v);
        }
        if self.owned_blocks < max {
            self.owned_blocks += 1;
            return Ok(Vec::with_capacity(block_bytes));
        }
        self.free_rx.recv().map_err(|_| io::Error::other("write threads stopped"))
    }

    /// Waits for every queued write; returns the first error.
    fn close(&mut self) -> io::Result<()> {
        self.work_tx = None;
        for w in self.workers.drain(..) {
            if w.join().is_err() {
                return Err(io::Error::other("write thread panicked"));
            }
        }
        self.take_error().map_or(Ok(()), Err)
    }
}

struct LocalWriter {
    file: Arc<File>,
    tmp: PathBuf,
    target: PathBuf,
    location: String,
    threads: usize,
    block_bytes: usize,
    buf: Vec<u8>,
    /// Bytes handed to the pool (or written) so far; `buf` starts here.
    offset: u64,
    pool: Option<WritePool>,
    failed: bool,
    done: bool,
}

impl std::fmt::Debug for LocalWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalWriter").field("location", &self.location).field("offset", &self.offset).finish()
    }
}

impl LocalWriter {
    fn new(file: File, tmp: PathBuf, target: PathBuf, location: String, config: &LocalConfig) -> Self {
        LocalWriter {
            file: Arc::new(file),
            tmp,
            target,
            location,
            threads: config.write_threads,
            block_bytes: config.block_bytes,
            buf: Vec::new(),
            offset: 0,
            pool: None,
            failed: false,
            done: false,
        }
    }

    fn pool(&mut self) -> &mut WritePool {
        let (file, threads) = (&self.file, self.threads);
        self.pool.get_or_insert_with(|| WritePool::new(file.clone(), threads))
    }

    /// Sends the full buffer to the pool and takes an empty one.
    fn flush_block(&mut self) -> io::Result<()> {
        let (max, block_bytes) = (self.threads + 2, self.block_bytes);
        let fresh = self.pool().buffer(max, block_bytes)?;
        let full = std::mem::replace(&mut self.buf, fresh);
        let n = full.len() as u64;
        let offset = self.offset;
        self.pool().submit(offset, Block::Owned(full))?;
        self.offset += n;
        Ok(())
    }

    fn append(&mut self, mut data: &[u8]) -> io::Result<()> {
        if data.len() >= self.block_bytes {
            return self.write_in_place(&[data]);
        }
        while !data.is_empty() {
            if self.buf.capacity() == 0 {
                // The first block grows as needed, so a small object spawns no threads.
                let (max, block_bytes) = (self.threads + 2, self.block_bytes);
                if let Some(pool) = self.pool.as_mut() {
                    self.buf = pool.buffer(max, block_bytes)?;
                }
            }
            let room = self.block_bytes - self.buf.len();
            let (now, rest) = data.split_at(room.min(data.len()));
            self.buf.extend_from_slice(now);
            data = rest;
            if self.buf.len() == self.block_bytes {
                self.flush_block()?;
            }
        }
        Ok(())
    }

    /// Pieces adding up to at least [`VECTORED_IN_PLACE_BYTES`] are written straight from
    /// the caller's memory; fewer bytes are buffered like single writes.
    fn append_vectored(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        if bufs.iter().map(|b| b.len()).sum::<usize>() >= VECTORED_IN_PLACE_BYTES.min(self.block_bytes) {
            return self.write_in_place(bufs);
        }
        bufs.iter().try_for_each(|b| self.append(b))
    }

    /// Writes large borrowed pieces from the calling thread, without copying them (one
    /// vectored write): the buffered bytes before them go to the pool first (positional
    /// writes need no order).
    fn write_in_place(&mut self, bufs: &[&[u8]]) -> io::Result<()> {
        if !self.buf.is_empty() {
            let partial = std::mem::take(&mut self.buf);
            let (offset, n) = (self.offset, partial.len() as u64);
            self.pool().submit(offset, Block::Owned(partial))?;
            self.offset += n;
        }
        if let Some(e) = self.pool.as_ref().and_then(WritePool::take_error) {
            return Err(e);
        }
        pwritev_all(&self.file, bufs, self.offset)?;
        let n = bufs.iter().map(|b| b.len()).sum::<usize>();
        start_writeback(&self.file, self.offset, n);
        self.offset += n as u64;
        Ok(())
    }

    fn append_bytes(&mut self, data: Bytes) -> io::Result<()> {
        if !self.buf.is_empty() || data.len() < self.block_bytes {
            return self.append(&data);
        }
        let (offset, n) = (self.offset, data.len() as u64);
        self.pool().submit(offset, Block::Shared(data))?;
        self.offset += n;
        Ok(())
    }

    /// Runs one write operation unless the writer already failed; a failure poisons it.
    fn guard(&mut self, op: impl FnOnce(&mut Self) -> io::Result<()>) -> Result<()> {
        if self.failed {
            return Err(Error::WriterFailed { path: self.location.clone() });
        }
        op(self).map_err(|e| {
            self.failed = true;
            Error::io("write", &self.location, e)
        })
    }

    fn complete(&mut self) -> io::Result<u64> {
        let tail = std::mem::take(&mut self.buf);
        let total = self.offset + tail.len() as u64;
        if let Some(pool) = self.pool.as_mut() {
            if !tail.is_empty() {
                pool.submit(self.offset, Block::Owned(tail))?;
            }
            pool.close()?;
        } else {
            self.file.write_all_at(&tail, self.offset)?;
        }
        self.file.sync_all()?;
        publish(&self.tmp, &self.target)?;
        Ok(total)
    }

    fn cleanup(&mut self) -> io::Result<()> {
        self.done = true;
        if let Some(pool) = self.pool.as_mut() {
            let _ = pool.close();
        }
        match fs::remove_file(&self.tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

impl ObjectWriter for LocalWriter {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.guard(|w| w.append(data))
    }

    fn write_bytes(&mut self, data: Bytes) -> Result<()> {
        self.guard(|w| w.append_bytes(data))
    }

    fn write_vectored(&mut self, bufs: &[&[u8]]) -> Result<()> {
        self.guard(|w| w.append_vectored(bufs))
    }

    fn finish(mut self: Box<Self>) -> Result<u64> {
        if self.failed {
            let _ = self.cleanup();
            return Err(Error::WriterFailed { path: self.location.clone() });
        }
        match self.complete() {
            Ok(n) => {
                self.done = true;
                Ok(n)
            }
            Err(e) => {
                let _ = self.cleanup();
                Err(Error::io("finish", &self.location, e))
            }
        }
    }

    fn abort(mut self: Box<Self>) -> Result<()> {
        self.cleanup().map_err(|e| Error::io("abort", &self.location, e))
    }
}

impl Drop for LocalWriter {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cleanup();
        }
    }
}
