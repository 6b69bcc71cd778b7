//! dckpt-storage: bytes in named objects, behind one contract.
//!
//! This crate owns the [`Storage`] trait, its written contract, and the backends that keep
//! it: local disk ([`LocalStorage`]), S3-compatible object stores through `object_store`
//! (`S3Storage`, feature `s3`, on by default), memory ([`MemoryStorage`]), plus wrappers
//! that work over any backend: [`FaultStorage`] (seeded, reproducible fault injection for
//! crash tests), [`Retrying`] (bounded exponential backoff on transient errors),
//! [`Counting`] (the calls of each kind and the bytes they moved, which is what an object
//! store bills and throttles by) and [`Prefixed`] (one prefix as a store of its own). [`open`] picks a backend
//! from a URL. [`write_pipelined`] writes one object from a thread of its own while the
//! caller produces its bytes, through a bounded pool of recycled buffers (its contract is in
//! its own docs).
//!
//! It deliberately knows nothing of tensors, ranks, checkpoints or checksums: callers hand
//! it bytes and names. It has no async API: every call blocks the calling thread (the engine's
//! ranks are OS threads). The S3 backend runs its own tokio runtime internally, so it may be
//! called from any thread, including one inside another tokio runtime (the call then blocks
//! that worker; from async code prefer `spawn_blocking`).
//!
//! # Process-wide effects
//!
//! By default none: the crate installs no signal handler and changes no process setting,
//! so it can be loaded into someone else's process (a Python interpreter, a training
//! framework). One opt-in changes that: [`LocalConfig::mapped_reads`] (through
//! [`OpenOptions::local`] for [`open_with`]) lets a local reader copy many short stretches
//! far apart out of a mapping of the file, which is faster than a system call each. A page
//! of a mapping that cannot be read raises `SIGBUS`, so on first use it installs a
//! **process-wide `SIGBUS` handler** that turns a fault inside one of its own copies into
//! an [`Error`] naming the file and offset, and hands every other `SIGBUS` to the
//! disposition that was there before. Before each copy it checks that it is still the
//! installed handler and that the thread does not block `SIGBUS`, and otherwise reads by
//! system calls. Turn it on only in a program that owns its process; the `dckpt` CLI does.
//!
//! ```
//! use dckpt_storage::{LocalConfig, OpenOptions, open_with};
//!
//! let dir = std::env::temp_dir().join(format!("dckpt-doc-mapped-{}", std::process::id()));
//! let local = LocalConfig { mapped_reads: true, ..LocalConfig::default() };
//! let store = open_with(dir.to_str().unwrap(), &OpenOptions { local, ..OpenOptions::default() })?;
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), dckpt_storage::Error>(())
//! ```
//!
//! The S3 backend (feature `s3`) runs one tokio runtime for the process, started on first
//! use; it is internal and touches no other runtime.
//!
//! # Paths
//!
//! Objects are named by relative, `/`-separated paths under the storage root (a directory,
//! a bucket prefix, or a memory namespace): `step_100/__0_0.distcp`. Empty, absolute, `.` or
//! `..` segments, backslashes and control characters are rejected with
//! [`Error::InvalidPath`]. Segments starting with `.dckpt-tmp` are reserved for the local
//! backend's temporary files (see contract item 6 for those a dead process left).
//!
//! # The contract
//!
//! Every backend (and every wrapper that injects no faults) keeps these promises; the
//! conformance suite in `tests/` checks each of them on memory, local disk and S3.
//!
//! 1. **Atomic whole-object put.** After [`Storage::put`] returns `Ok`, readers see the new
//!    object. While it runs, and if it fails, readers see the old object or none — never a
//!    prefix, a mix, or a torn write. A failed put leaves nothing new under the final name.
//! 2. **Conditional create.** [`Storage::put_if_absent`] creates the object only if no object
//!    exists under that name, and otherwise fails with [`Error::AlreadyExists`] (and no other
//!    error means "someone else was first"). Of any number of concurrent creators, exactly
//!    one succeeds. This is the commit primitive. Caveat: if a create is retried after a
//!    timeout whose first attempt did land, the retry reports `AlreadyExists`; a committer that
//!    must tell "I won" from "someone else won" should compare the stored bytes.
//!
//!    **Conditional replace.** [`Storage::put_if_match`] replaces the object only if it holds
//!    exactly the bytes the caller read, and otherwise fails with [`Error::Precondition`]
//!    (no object there is a precondition failure too). Of any number of concurrent replaces
//!    of what they all read, at most one succeeds, and no put, create or conditional replace
//!    lands between its comparison and its write. This is the replace primitive: a replacing
//!    commit never overwrites a commit it did not read. Local disk compares and renames
//!    under an exclusive `flock` of the object's directory (which plain puts take too; a
//!    streamed writer's finish does not, so that thousands of ranks finishing their data
//!    files in one directory of a shared file system are not serialised on its lock: a
//!    name that a writer streams to is not one to replace conditionally); S3
//!    reads the object with its ETag, compares, and sends `PUT If-Match: <ETag>`. The same
//!    caveat as for a create: a retried replace whose first attempt landed reports
//!    `Precondition`; compare the stored bytes.
//! 3. **Streaming writes with bounded memory.** [`Storage::writer`] returns an
//!    [`ObjectWriter`] that takes chunks in order. Memory stays bounded by the backend's
//!    configuration (a few blocks / parts), whatever the object size. [`ObjectWriter::finish`]
//!    makes the whole object visible atomically (as a put does). [`ObjectWriter::abort`], an
//!    error, or dropping the writer without `finish` leave nothing visible under the final
//!    name. A writer whose write failed stays failed ([`Error::WriterFailed`]).
//! 4. **Reads.** [`Storage::get`] returns one consistent version of the object.
//!    [`Storage::get_ranges`] returns several ranges in one call (the backend coalesces
//!    nearby ranges into fewer reads); [`Storage::read_into`] fills caller buffers directly.
//!    Every range must lie inside the object, else [`Error::OutOfRange`]; empty ranges are
//!    fine.
//! 5. **Metadata.** [`Storage::size`] gives the object's length; [`Storage::list`] gives every
//!    object at or under a prefix (segment-wise: `a/b` covers `a/b` and `a/b/...` but not
//!    `a/bc`), with sizes, sorted by path; in-progress writes are never listed.
//!    [`Storage::delete`] is idempotent: deleting a missing object succeeds.
//! 6. **Abandoned writes.** A write whose process died (killed, crashed) leaves on local disk
//!    a temporary file, and on S3 a multipart upload; nothing of it is visible under the
//!    final name. [`Storage::list_abandoned`] lists those unfinished writes at or under a
//!    prefix that no live writer holds any more, with their sizes, and
//!    [`Storage::remove_abandoned`] removes them; neither ever touches a write still in
//!    progress, in this process or another. Local disk tells by a lock each writer holds on
//!    its temporary while its process lives (`flock`; where the file system refuses locks, by
//!    an hour without modification): see [`LocalStorage`]. An S3 store lists none: it cannot
//!    tell a live writer's upload from a dead one's, so the uploads a killed process left are
//!    for the bucket's lifecycle rule to abort (see `S3Storage`); a writer that fails, is
//!    aborted or dropped aborts its own upload. Memory loses nothing to a dead writer.
//! 7. **Errors** are one [`Error`] enum; each variant carries the full location;
//!    [`Error::is_transient`] classifies. The S3 backend retries transient HTTP failures
//!    itself (bounded, exponential backoff, see [`RetryPolicy`]); [`Retrying`] adds the same
//!    policy over any backend.
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use dckpt_storage::{Error, WriterOptions, open};
//!
//! let store = open("memory://")?;
//! let mut w = store.writer("ckpt/data_0", &WriterOptions::default())?;
//! w.write(b"hello ")?;
//! w.write(b"world")?;
//! assert_eq!(w.finish()?, 11);
//! assert_eq!(store.get_ranges("ckpt/data_0", &[0..5, 6..11])?, vec![Bytes::from("hello"), Bytes::from("world")]);
//!
//! store.put_if_absent("ckpt/metadata", Bytes::from("commit"))?;
//! let again = store.put_if_absent("ckpt/metadata", Bytes::from("commit"));
//! assert!(matches!(again, Err(Error::AlreadyExists { .. })));
//! # Ok::<(), Error>(())
//! ```

#![warn(missing_docs)]

mod counting;
mod error;
mod ext;
mod fault;
mod hints;
mod local;
#[cfg(target_os = "linux")]
mod mapped;
mod memory;
mod pipeline;
mod prefixed;
mod ranges;
mod retry;
#[cfg(feature = "s3")]
mod s3;
mod url;

use std::fmt::Debug;
use std::ops::Range;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

pub use counting::{Counting, RequestCounts};
pub use error::{BoxError, Error, Result};
pub use ext::{DELETES_IN_FLIGHT, Settled, StorageExt};
pub use fault::{FaultConfig, FaultStorage, InjectedFault};
pub use hints::StorageHints;
pub use local::{LocalConfig, LocalStorage};
pub use memory::MemoryStorage;
pub use pipeline::{Pipe, PipeOptions, write_pipelined};
pub use prefixed::Prefixed;
pub use retry::{RetryPolicy, Retrying};
#[cfg(feature = "s3")]
pub use s3::{ABORT_ON_DROP_WAIT_MS, PART_BYTES_MIN, S3Config, S3Requests, S3Storage};
pub use url::{OpenOptions, open, open_with};

/// One object found by [`Storage::list`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectInfo {
    /// Relative path under the storage root.
    pub path: String,
    /// Length in bytes.
    pub size: u64,
}

/// Options for [`Storage::writer`].
#[derive(Debug, Clone, Default)]
pub struct WriterOptions {
    /// The final size, when known up front. A hint only: backends may use it to choose a
    /// single put over a multipart upload; writing a different number of bytes is fine.
    pub size_hint_bytes: Option<u64>,
}

/// Positional reads of one object, opened once by [`Storage::reader`].
pub trait ObjectReader {
    /// Fills each `(offset, buffer)` as [`Storage::read_into`] does.
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()>;

    // No default, as for `hints`: a wrapper that forgot it would silently send every
    // inspected read of what it wraps down the slow path.

    /// Fills each `(offset, buffer)` as [`ObjectReader::read_into`] does, and shows the
    /// caller each read's bytes while they are likely still in the CPU's cache (a caller
    /// checksums them there, not in a second pass over memory). `inspect(i, bytes)` is
    /// called for the reads in the order given, each read's bytes in order, in pieces that
    /// together are exactly the read's bytes (an empty read: one empty piece, or none). A piece may be the store's own
    /// memory (a mapping of the file) rather than the buffer: what lands in the buffer is
    /// the same bytes. On an error, what `inspect` saw means nothing.
    ///
    /// A reader with nothing faster reads, then inspects each buffer ([`read_then_inspect`]).
    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()>;

    /// Shows `inspect` every byte of `range` (`offset..end` of the object), in order, in
    /// pieces that together are exactly those bytes, and fills each `(offset, buffer)` of
    /// `picks` with its bytes as [`ObjectReader::read_into`] would: the picks lie inside
    /// the range, in increasing order, disjoint. Each pick's bytes are the bytes shown. For
    /// a caller that checks a whole stretch (a checksum block) but keeps only parts of it:
    /// where the store reads in place ([`StorageHints::reads_in_place`]) nothing but the
    /// picks is copied. On an error, what `inspect` saw means nothing.
    ///
    /// A reader with nothing faster reads the range a bounded piece at a time into a buffer
    /// of its own, shows it and copies the picks out ([`read_then_pick`]).
    ///
    /// # Panics
    ///
    /// When a pick is outside the range, or not after the pick before it.
    fn read_picked_inspected(
        &mut self,
        range: Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()>;
}

/// The most [`read_then_pick`] reads at once: the buffer it shows stays in a core's
/// second-level cache, so the inspection and the picks' copies read it from there (256 KiB
/// beat 64 and 128 KiB: docs/benchmarks.md, "Decisions behind the constants").
pub const PICK_PIECE_BYTES: usize = 256 << 10;

/// [`ObjectReader::read_picked_inspected`] for a reader with nothing faster: `reader`
/// reads the range [`PICK_PIECE_BYTES`] at a time into one buffer, `inspect` is shown each
/// piece, and the picks' parts in it are copied out.
pub fn read_then_pick<R: ObjectReader + ?Sized>(
    reader: &mut R,
    range: Range<u64>,
    picks: &mut [(u64, &mut [u8])],
    inspect: &mut dyn FnMut(&[u8]),
) -> Result<()> {
    assert_picks(&range, picks);
    let mut buf = vec![0u8; range.end.saturating_sub(range.start).min(PICK_PIECE_BYTES as u64) as usize];
    let mut next = 0;
    let mut at = range.start;
    while at < range.end {
        let piece = &mut buf[..(range.end - at).min(PICK_PIECE_BYTES as u64) as usize];
        reader.read_into(&mut [(at, &mut *piece)])?;
        inspect(piece);
        next = copy_picks(at, piece, picks, next, |src, dst| dst.copy_from_slice(src));
        at += piece.len() as u64;
    }
    Ok(())
}

/// Copies, by `copy(source, destination)`, into the picks from `next` on the parts that
/// `piece` (the object's bytes from `at`) holds; returns the first pick not wholly copied yet.
pub(crate) fn copy_picks(
    at: u64,
    piece: &[u8],
    picks: &mut [(u64, &mut [u8])],
    mut next: usize,
    mut copy: impl FnMut(&[u8], &mut [u8]),
) -> usize {
    let end = at + piece.len() as u64;
    while let Some((p_at, buf)) = picks.get_mut(next) {
        let p_end = *p_at + buf.len() as u64;
        let (from, to) = ((*p_at).max(at), p_end.min(end));
        if from < to {
            copy(
                &piece[(from - at) as usize..(to - at) as usize],
                &mut buf[(from - *p_at) as usize..(to - *p_at) as usize],
            );
        }
        if p_end > end {
            break;
        }
        next += 1;
    }
    next
}

/// Asserts that `picks` lie inside `range`, in increasing order and disjoint, as
/// [`ObjectReader::read_picked_inspected`] requires: the caller computed them, so a pick
/// astray is a bug of its own, not a fault of the store.
pub(crate) fn assert_picks(range: &Range<u64>, picks: &[(u64, &mut [u8])]) {
    let mut from = range.start;
    for (at, buf) in picks {
        let end = at.checked_add(buf.len() as u64).expect("a pick's end overflows");
        assert!(*at >= from && end <= range.end, "pick {at}..{end} is not inside {range:?} after the one before it");
        from = end;
    }
}

/// [`ObjectReader::read_into_inspected`] for a reader with nothing faster: `reader` reads,
/// then `inspect` is shown each buffer whole, in order.
pub fn read_then_inspect<R: ObjectReader + ?Sized>(
    reader: &mut R,
    reads: &mut [(u64, &mut [u8])],
    inspect: &mut dyn FnMut(usize, &[u8]),
) -> Result<()> {
    reader.read_into(reads)?;
    for (i, (_, buf)) in reads.iter().enumerate() {
        inspect(i, buf);
    }
    Ok(())
}

/// The default [`ObjectReader`]: every call goes to the store's `read_into` by path.
struct ByPath<'s, S: ?Sized> {
    storage: &'s S,
    path: String,
}

impl<S: Storage + ?Sized> ObjectReader for ByPath<'_, S> {
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.storage.read_into(&self.path, reads)
    }

    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        read_then_inspect(self, reads, inspect)
    }

    fn read_picked_inspected(
        &mut self,
        range: Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        read_then_pick(self, range, picks, inspect)
    }
}

/// A store of named byte objects. See the crate docs for the contract every implementation
/// keeps. All methods block; implementations are shared between threads as
/// `Arc<dyn Storage>`.
pub trait Storage: Send + Sync + Debug {
    /// The full location of `path` (for messages): `/root/path`, `s3://bucket/prefix/path`.
    fn location(&self, path: &str) -> String;

    /// Atomically replaces (or creates) the object with `data`.
    fn put(&self, path: &str, data: Bytes) -> Result<()>;

    /// Atomically creates the object with `data` if absent; [`Error::AlreadyExists`] otherwise.
    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()>;

    /// Atomically replaces the object with `data` if it holds exactly the bytes `expected`
    /// now; [`Error::Precondition`] otherwise (other bytes, or no object). See contract item 2.
    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()>;

    /// Starts a streaming write; nothing is visible under `path` until `finish` succeeds.
    fn writer(&self, path: &str, options: &WriterOptions) -> Result<Box<dyn ObjectWriter>>;

    /// The whole object.
    fn get(&self, path: &str) -> Result<Bytes>;

    /// The bytes of each range, in the order asked, from one version of the object.
    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>>;

    /// Fills each `(offset, buffer)` with the object's bytes at `offset..offset + buffer.len()`.
    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()>;

    /// Opens `path` for several [`ObjectReader::read_into`] calls. Local disk opens the file
    /// once for all of them. The default reads by path through [`Storage::read_into`] each
    /// time: right for object stores (a request per call either way) and for wrappers,
    /// whose own `read_into` then still sees every read.
    fn reader(&self, path: &str) -> Result<Box<dyn ObjectReader + '_>> {
        Ok(Box::new(ByPath { storage: self, path: path.to_string() }))
    }

    // `reader_sized` has no default: a wrapper that forgot it would cost every read of a
    // known length a size request again (a HEAD on S3, one per file a rank loads from).

    /// Opens `path`, which the caller knows to be `len` bytes long, for several
    /// [`ObjectReader::read_into`] calls, without asking the store for its size: a reader
    /// whose object has another length fails with [`Error::SizeMismatch`], at the latest on
    /// its first read (local disk and memory when opening, S3 from the first GET's answer,
    /// which carries the object's size). Ranges are checked against `len`, so reads of
    /// empty ranges cost no request; an S3 reader pins every GET of all its reads to the
    /// version its first GET saw.
    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>>;

    // `hints` and `prefetch` have no default: a wrapper that forgot one would silently turn
    // it off for everything it wraps (a wrapper without `object_bytes_max` made S3 saves one
    // multipart upload per rank again). A wrapper passes both on in one line each.

    /// How a caller should use this store: see [`StorageHints`].
    fn hints(&self) -> StorageHints;

    /// Hints that `len` bytes of `path` from `at` on will be read soon, so that a backend
    /// can start reading them (local disk: `fadvise(WILLNEED)`, the kernel reads ahead).
    /// Best effort: it never fails and may do nothing.
    ///
    /// An action by path, not a value, so not part of [`StorageHints`], and not a method of
    /// [`ObjectReader`]: a caller asks for the next window of a file while it still checks
    /// this one, without holding a reader open for it.
    fn prefetch(&self, path: &str, at: u64, len: u64);

    /// The object's length in bytes.
    fn size(&self, path: &str) -> Result<u64>;

    /// Every object at or under `prefix` (segment-wise; `""` lists everything), sorted by path.
    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>>;

    /// Removes the object; succeeds when it does not exist.
    fn delete(&self, path: &str) -> Result<()>;

    // `list_abandoned` and `remove_abandoned` have no default either: a wrapper that forgot
    // them would hide every dead process's leftovers from the callers that clean up.

    /// The unfinished writes at or under `prefix` (segment-wise) that no live writer holds
    /// any more: what processes that died mid-write left (contract item 6). Each is named by
    /// the store's own path for it (on local disk a temporary file, `.dckpt-tmp.*`), which is
    /// not an object path: no other method accepts it. Sorted by path.
    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>>;

    /// Removes what [`Storage::list_abandoned`] lists, judging each write again as it removes
    /// it, so a write that a live writer holds is never removed; returns what was removed.
    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>>;
}

/// A streaming write in progress. Chunks are appended in call order.
///
/// Dropping a writer without calling [`ObjectWriter::finish`] aborts it (best effort, errors
/// ignored); call [`ObjectWriter::abort`] to see cleanup errors.
pub trait ObjectWriter: Send + Debug {
    /// Appends a copy of `data`.
    fn write(&mut self, data: &[u8]) -> Result<()>;

    /// Appends `data`; backends may keep the buffer instead of copying it.
    fn write_bytes(&mut self, data: Bytes) -> Result<()> {
        self.write(&data)
    }

    /// Appends each of `bufs` in order, as [`ObjectWriter::write`] would one by one; backends
    /// may write them straight from the caller's memory (many small pieces in one call).
    fn write_vectored(&mut self, bufs: &[&[u8]]) -> Result<()> {
        bufs.iter().try_for_each(|b| self.write(b))
    }

    /// Makes the object visible, atomically; returns the number of bytes written.
    fn finish(self: Box<Self>) -> Result<u64>;

    /// Discards everything written; nothing becomes visible.
    fn abort(self: Box<Self>) -> Result<()>;
}

/// The failure of a conditional replace ([`Storage::put_if_match`]) whose object is not the
/// expected one.
pub(crate) fn not_expected(path: String, present: bool) -> Error {
    let message = if present { "it holds other bytes than expected" } else { "there is no such object" };
    Error::Precondition { path, message: message.into() }
}

/// Checks a relative object path (see the crate docs); `allow_empty` is for list prefixes.
pub(crate) fn check_path(path: &str, allow_empty: bool) -> Result<()> {
    let bad = |reason: &'static str| Err(Error::InvalidPath { path: path.to_string(), reason: reason.into() });
    if path.is_empty() {
        return if allow_empty { Ok(()) } else { bad("empty path") };
    }
    if path.starts_with('/') {
        return bad("absolute path; paths are relative to the storage root");
    }
    if path.contains('\\') || path.chars().any(char::is_control) {
        return bad("backslash or control character");
    }
    for seg in path.split('/') {
        match seg {
            "" => return bad("empty segment"),
            "." | ".." => return bad("`.` or `..` segment"),
            s if s.starts_with(local::TMP_PREFIX) => return bad("reserved temporary name"),
            _ => {}
        }
    }
    Ok(())
}

/// Checks that every range lies inside an object of `size` bytes.
pub(crate) fn check_ranges(location: &str, ranges: &[Range<u64>], size: u64) -> Result<()> {
    for r in ranges {
        if r.start > r.end || r.end > size {
            return Err(Error::OutOfRange { path: location.to_string(), start: r.start, end: r.end, size });
        }
    }
    Ok(())
}

/// The ranges that `read_into` requests describe, or an error if one overflows `u64`.
pub(crate) fn read_ranges(location: &str, reads: &[(u64, &mut [u8])]) -> Result<Vec<Range<u64>>> {
    reads
        .iter()
        .map(|(offset, buf)| {
            let end = offset.checked_add(buf.len() as u64).ok_or_else(|| Error::OutOfRange {
                path: location.to_string(),
                start: *offset,
                end: u64::MAX,
                size: 0,
            })?;
            Ok(*offset..end)
        })
        .collect()
}

/// Whether `path` is at or under `prefix`, segment-wise.
pub(crate) fn under_prefix(path: &str, prefix: &str) -> bool {
    prefix.is_empty()
        || path == prefix
        || (path.starts_with(prefix) && path.as_bytes().get(prefix.len()) == Some(&b'/'))
}
