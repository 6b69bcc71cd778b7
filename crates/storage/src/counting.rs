//! A wrapper that counts the calls of each kind made to a store, and the bytes they moved.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::{ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions};

/// What a [`Counting`] store saw: calls of each kind, counted when made (a call that fails
/// was still sent), and the bytes of those that succeeded.
///
/// These are calls of the [`Storage`] API, which is what an object store bills and
/// throttles by, nearly: a ranged read is one GET per stretch of the object it covers (S3
/// coalesces ranges less than 1 MiB apart), a writer one PUT or, past its store's
/// `object_bytes_max`, a multipart upload, a conditional replace a GET and a PUT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RequestCounts {
    /// [`Storage::put`] calls.
    pub puts: u64,
    /// [`Storage::put_if_absent`] calls.
    pub creates: u64,
    /// [`Storage::put_if_match`] calls.
    pub replaces: u64,
    /// Streaming writers opened ([`Storage::writer`]).
    pub writers: u64,
    /// Whole objects read ([`Storage::get`]).
    pub gets: u64,
    /// Ranged reads: [`Storage::get_ranges`], [`Storage::read_into`] and each
    /// [`ObjectReader::read_into`] of a reader.
    pub ranged_reads: u64,
    /// The nonempty ranges those asked for.
    pub ranges: u64,
    /// Readers opened ([`Storage::reader`], [`Storage::reader_sized`]); they send nothing by
    /// themselves on an object store.
    pub readers: u64,
    /// Sizes asked for ([`Storage::size`], a HEAD on S3).
    pub sizes: u64,
    /// Listings ([`Storage::list`]).
    pub lists: u64,
    /// Deletes ([`Storage::delete`]).
    pub deletes: u64,
    /// Abandoned writes listed or removed ([`Storage::list_abandoned`],
    /// [`Storage::remove_abandoned`]).
    pub abandoned: u64,
    /// Bytes read by the calls that succeeded.
    pub bytes_read: u64,
    /// Bytes written by puts and writers (as each write succeeds, so a writer's bytes count
    /// before it finishes).
    pub bytes_written: u64,
}

impl RequestCounts {
    /// Every call that reaches the store as a request of its own: all but the readers opened.
    pub fn requests(&self) -> u64 {
        self.puts
            + self.creates
            + self.replaces
            + self.writers
            + self.gets
            + self.ranged_reads
            + self.sizes
            + self.lists
            + self.deletes
            + self.abandoned
    }

    /// What was counted after `earlier` (counts of the same store taken before), kind by
    /// kind: the requests of one phase.
    pub fn since(&self, earlier: &RequestCounts) -> RequestCounts {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        RequestCounts {
            puts: d(self.puts, earlier.puts),
            creates: d(self.creates, earlier.creates),
            replaces: d(self.replaces, earlier.replaces),
            writers: d(self.writers, earlier.writers),
            gets: d(self.gets, earlier.gets),
            ranged_reads: d(self.ranged_reads, earlier.ranged_reads),
            ranges: d(self.ranges, earlier.ranges),
            readers: d(self.readers, earlier.readers),
            sizes: d(self.sizes, earlier.sizes),
            lists: d(self.lists, earlier.lists),
            deletes: d(self.deletes, earlier.deletes),
            abandoned: d(self.abandoned, earlier.abandoned),
            bytes_read: d(self.bytes_read, earlier.bytes_read),
            bytes_written: d(self.bytes_written, earlier.bytes_written),
        }
    }

    /// Whole-object writes: puts, conditional creates and replaces, writers.
    pub fn writes(&self) -> u64 {
        self.puts + self.creates + self.replaces + self.writers
    }
}

/// The kinds, in the order of [`RequestCounts`]'s fields.
#[derive(Clone, Copy)]
enum Kind {
    Put,
    Create,
    Replace,
    Writer,
    Get,
    RangedRead,
    Range,
    Reader,
    Size,
    List,
    Delete,
    Abandoned,
    BytesRead,
    BytesWritten,
}

const KINDS: usize = Kind::BytesWritten as usize + 1;

/// The live counts of one [`Counting`] store (shared with its readers and writers).
#[derive(Debug, Default)]
struct Counters([AtomicU64; KINDS]);

impl Counters {
    fn add(&self, kind: Kind, n: u64) {
        self.0[kind as usize].fetch_add(n, Ordering::Relaxed);
    }

    fn ranged(&self, ranges: impl Iterator<Item = u64>) {
        self.add(Kind::RangedRead, 1);
        self.add(Kind::Range, ranges.filter(|&n| n > 0).count() as u64);
    }

    fn snapshot(&self) -> RequestCounts {
        let c = |k: Kind| self.0[k as usize].load(Ordering::Relaxed);
        RequestCounts {
            puts: c(Kind::Put),
            creates: c(Kind::Create),
            replaces: c(Kind::Replace),
            writers: c(Kind::Writer),
            gets: c(Kind::Get),
            ranged_reads: c(Kind::RangedRead),
            ranges: c(Kind::Range),
            readers: c(Kind::Reader),
            sizes: c(Kind::Size),
            lists: c(Kind::List),
            deletes: c(Kind::Delete),
            abandoned: c(Kind::Abandoned),
            bytes_read: c(Kind::BytesRead),
            bytes_written: c(Kind::BytesWritten),
        }
    }
}

/// Which paths a [`Counting`] store counts.
type Filter = Box<dyn Fn(&str) -> bool + Send + Sync>;

/// Counts the calls of each kind made through it ([`RequestCounts`]), and the bytes they
/// moved, then passes every call on to `inner` unchanged (hints and abandoned writes
/// included). One instance counts one caller's calls: give each rank its own over the
/// shared store to see the requests by kind per rank.
///
/// ```
/// use std::sync::Arc;
/// use bytes::Bytes;
/// use dckpt_storage::{Counting, MemoryStorage, Storage};
///
/// let store = Counting::new(Arc::new(MemoryStorage::new()));
/// store.put("a", Bytes::from_static(b"hello"))?;
/// store.reader_sized("a", 5)?.read_into(&mut [(1, &mut [0u8; 3][..])])?;
/// let counts = store.counts();
/// assert_eq!((counts.puts, counts.readers, counts.ranged_reads, counts.sizes), (1, 1, 1, 0));
/// assert_eq!((counts.bytes_written, counts.bytes_read), (5, 3));
/// # Ok::<(), dckpt_storage::Error>(())
/// ```
pub struct Counting {
    inner: Arc<dyn Storage>,
    counters: Arc<Counters>,
    filter: Option<Filter>,
}

impl std::fmt::Debug for Counting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counting").field("inner", &self.inner).field("counts", &self.counts()).finish()
    }
}

impl Counting {
    /// Counts every call made to `inner` through it.
    pub fn new(inner: Arc<dyn Storage>) -> Counting {
        Counting { inner, counters: Arc::default(), filter: None }
    }

    /// Counts only the calls on paths (or list prefixes) that `filter` accepts: the data
    /// files of a checkpoint apart from its metadata, say.
    pub fn only(inner: Arc<dyn Storage>, filter: impl Fn(&str) -> bool + Send + Sync + 'static) -> Counting {
        Counting { inner, counters: Arc::default(), filter: Some(Box::new(filter)) }
    }

    /// The counts so far.
    pub fn counts(&self) -> RequestCounts {
        self.counters.snapshot()
    }

    /// The counters for a call on `path`, if it is counted.
    fn on(&self, path: &str) -> Option<&Arc<Counters>> {
        self.filter.as_ref().is_none_or(|f| f(path)).then_some(&self.counters)
    }

    fn count(&self, path: &str, kind: Kind) {
        if let Some(c) = self.on(path) {
            c.add(kind, 1);
        }
    }

    fn count_bytes(&self, path: &str, kind: Kind, n: u64) {
        if let Some(c) = self.on(path) {
            c.add(kind, n);
        }
    }

    fn ranged(&self, path: &str, lens: impl Iterator<Item = u64>) {
        if let Some(c) = self.on(path) {
            c.ranged(lens);
        }
    }

    /// A write of the whole object in one call.
    fn put_with(&self, path: &str, kind: Kind, data: Bytes, put: impl FnOnce(Bytes) -> Result<()>) -> Result<()> {
        self.count(path, kind);
        let n = data.len() as u64;
        put(data)?;
        self.count_bytes(path, Kind::BytesWritten, n);
        Ok(())
    }

    /// `reader` wrapped so that its reads are counted, when `path` is.
    fn counted_reader<'a>(&'a self, path: &str, reader: Box<dyn ObjectReader + 'a>) -> Box<dyn ObjectReader + 'a> {
        match self.on(path) {
            Some(counters) => Box::new(CountingReader { inner: reader, counters }),
            None => reader,
        }
    }
}

impl Storage for Counting {
    fn location(&self, path: &str) -> String {
        self.inner.location(path)
    }

    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        self.put_with(path, Kind::Put, data, |d| self.inner.put(path, d))
    }

    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        self.put_with(path, Kind::Create, data, |d| self.inner.put_if_absent(path, d))
    }

    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        self.put_with(path, Kind::Replace, data, |d| self.inner.put_if_match(path, d, expected))
    }

    fn writer(&self, path: &str, options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        self.count(path, Kind::Writer);
        let inner = self.inner.writer(path, options)?;
        Ok(match self.on(path) {
            Some(counters) => Box::new(CountingWriter { inner, counters: counters.clone() }),
            None => inner,
        })
    }

    fn get(&self, path: &str) -> Result<Bytes> {
        self.count(path, Kind::Get);
        let b = self.inner.get(path)?;
        self.count_bytes(path, Kind::BytesRead, b.len() as u64);
        Ok(b)
    }

    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.ranged(path, ranges.iter().map(|r| r.end.saturating_sub(r.start)));
        let out = self.inner.get_ranges(path, ranges)?;
        self.count_bytes(path, Kind::BytesRead, out.iter().map(|b| b.len() as u64).sum());
        Ok(out)
    }

    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.ranged(path, reads.iter().map(|(_, b)| b.len() as u64));
        self.inner.read_into(path, reads)?;
        self.count_bytes(path, Kind::BytesRead, reads.iter().map(|(_, b)| b.len() as u64).sum());
        Ok(())
    }

    fn reader(&self, path: &str) -> Result<Box<dyn ObjectReader + '_>> {
        self.count(path, Kind::Reader);
        let inner = self.inner.reader(path)?;
        Ok(self.counted_reader(path, inner))
    }

    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>> {
        self.count(path, Kind::Reader);
        let inner = self.inner.reader_sized(path, len)?;
        Ok(self.counted_reader(path, inner))
    }

    fn hints(&self) -> StorageHints {
        self.inner.hints()
    }

    /// A hint, not a request: not counted.
    fn prefetch(&self, path: &str, at: u64, len: u64) {
        self.inner.prefetch(path, at, len)
    }

    fn size(&self, path: &str) -> Result<u64> {
        self.count(path, Kind::Size);
        self.inner.size(path)
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.count(prefix, Kind::List);
        self.inner.list(prefix)
    }

    fn delete(&self, path: &str) -> Result<()> {
        self.count(path, Kind::Delete);
        self.inner.delete(path)
    }

    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.count(prefix, Kind::Abandoned);
        self.inner.list_abandoned(prefix)
    }

    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.count(prefix, Kind::Abandoned);
        self.inner.remove_abandoned(prefix)
    }
}

/// A reader whose reads are counted.
struct CountingReader<'a> {
    inner: Box<dyn ObjectReader + 'a>,
    counters: &'a Counters,
}

impl ObjectReader for CountingReader<'_> {
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.counters.ranged(reads.iter().map(|(_, b)| b.len() as u64));
        self.inner.read_into(reads)?;
        self.counters.add(Kind::BytesRead, reads.iter().map(|(_, b)| b.len() as u64).sum());
        Ok(())
    }

    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        self.counters.ranged(reads.iter().map(|(_, b)| b.len() as u64));
        self.inner.read_into_inspected(reads, inspect)?;
        self.counters.add(Kind::BytesRead, reads.iter().map(|(_, b)| b.len() as u64).sum());
        Ok(())
    }

    /// Counted as one ranged read of the whole range: the store reads all of it.
    fn read_picked_inspected(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        let len = range.end.saturating_sub(range.start);
        self.counters.ranged([len].into_iter());
        self.inner.read_picked_inspected(range, picks, inspect)?;
        self.counters.add(Kind::BytesRead, len);
        Ok(())
    }
}

/// A writer whose bytes are counted as each write succeeds.
#[derive(Debug)]
struct CountingWriter {
    inner: Box<dyn ObjectWriter>,
    counters: Arc<Counters>,
}

impl ObjectWriter for CountingWriter {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.inner.write(data)?;
        self.counters.add(Kind::BytesWritten, data.len() as u64);
        Ok(())
    }

    fn write_bytes(&mut self, data: Bytes) -> Result<()> {
        let n = data.len() as u64;
        self.inner.write_bytes(data)?;
        self.counters.add(Kind::BytesWritten, n);
        Ok(())
    }

    fn write_vectored(&mut self, bufs: &[&[u8]]) -> Result<()> {
        self.inner.write_vectored(bufs)?;
        self.counters.add(Kind::BytesWritten, bufs.iter().map(|b| b.len() as u64).sum());
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<u64> {
        self.inner.finish()
    }

    fn abort(self: Box<Self>) -> Result<()> {
        self.inner.abort()
    }
}
