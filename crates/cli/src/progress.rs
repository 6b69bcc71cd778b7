//! Progress bars on stderr (hidden when stderr is not a terminal or output is JSON), and a
//! storage wrapper that counts the bytes going through it so a bar can follow a save or load,
//! and its requests by kind, which object stores bill and throttle by.

use std::io::IsTerminal;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use dckpt::storage::{ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A set of byte-counting bars drawn together on stderr; all hidden when `show` is false
/// or stderr is not a terminal.
#[derive(Debug)]
pub struct Bars {
    mp: MultiProgress,
}

impl Bars {
    pub fn new(show: bool) -> Bars {
        let target = if show && std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        Bars { mp: MultiProgress::with_draw_target(target) }
    }

    /// A new bar of `len` bytes labelled `what`, below the others.
    pub fn bar(&self, len: u64, what: &str) -> ProgressBar {
        let style = ProgressStyle::with_template(
            "{prefix:>6} [{bar:40.cyan/blue}] {binary_bytes:>10}/{binary_total_bytes:<10} {binary_bytes_per_sec:>12} {elapsed_precise}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden()).with_style(style);
        pb.set_prefix(what.to_string());
        self.mp.add(pb)
    }
}

/// Byte and request counters: shared by every rank of this process (the demo), or one set
/// per rank (`bench scale`).
#[derive(Debug, Default)]
pub struct Counters {
    pub written: AtomicU64,
    pub read: AtomicU64,
    pub requests: Requests,
}

/// A kind of storage request, as the wrapper sees it: one call of the trait. A ranged read
/// through an opened reader is one `read` (the backend may split or merge it); the store's
/// own `read_into` opens a reader and reads once, so counts one of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    Put,
    PutIfAbsent,
    PutIfMatch,
    Writer,
    Get,
    GetRanges,
    Reader,
    Read,
    Prefetch,
    Size,
    List,
    Delete,
    ListAbandoned,
    RemoveAbandoned,
}

impl Request {
    pub const ALL: [Request; 14] = [
        Request::Put,
        Request::PutIfAbsent,
        Request::PutIfMatch,
        Request::Writer,
        Request::Get,
        Request::GetRanges,
        Request::Reader,
        Request::Read,
        Request::Prefetch,
        Request::Size,
        Request::List,
        Request::Delete,
        Request::ListAbandoned,
        Request::RemoveAbandoned,
    ];

    /// The trait method's name.
    pub fn name(self) -> &'static str {
        match self {
            Request::Put => "put",
            Request::PutIfAbsent => "put_if_absent",
            Request::PutIfMatch => "put_if_match",
            Request::Writer => "writer",
            Request::Get => "get",
            Request::GetRanges => "get_ranges",
            Request::Reader => "reader",
            Request::Read => "read",
            Request::Prefetch => "prefetch",
            Request::Size => "size",
            Request::List => "list",
            Request::Delete => "delete",
            Request::ListAbandoned => "list_abandoned",
            Request::RemoveAbandoned => "remove_abandoned",
        }
    }
}

/// Requests made, by kind.
#[derive(Debug, Default)]
pub struct Requests {
    counts: [AtomicU64; Request::ALL.len()],
}

impl Requests {
    fn add(&self, kind: Request) {
        self.counts[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// How many of `kind` so far.
    pub fn get(&self, kind: Request) -> u64 {
        self.counts[kind as usize].load(Ordering::Relaxed)
    }

    /// Every kind's count so far, in [`Request::ALL`] order.
    pub fn snapshot(&self) -> [u64; Request::ALL.len()] {
        Request::ALL.map(|k| self.get(k))
    }
}

/// Follows `counter` on `pb` (every 100 ms) while `f` runs; finishes the bar after.
pub fn follow<T>(pb: &ProgressBar, counter: &AtomicU64, f: impl FnOnce() -> T) -> T {
    if pb.is_hidden() {
        return f();
    }
    let start = counter.load(Ordering::Relaxed);
    let stop = AtomicBool::new(false);
    let out = std::thread::scope(|s| {
        s.spawn(|| {
            let mut moving = false;
            while !stop.load(Ordering::Relaxed) && !pb.is_finished() {
                // Rate and elapsed time count from the first byte, not from the bar's creation.
                if !moving && counter.load(Ordering::Relaxed) > start {
                    moving = true;
                    pb.reset_elapsed();
                    pb.reset_eta();
                }
                pb.set_position(
                    counter.load(Ordering::Relaxed).saturating_sub(start).min(pb.length().unwrap_or(u64::MAX)),
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let out = f();
        stop.store(true, Ordering::Relaxed);
        out
    });
    complete(pb);
    out
}

/// Fills the bar to its length and stops it (its rate and time freeze), once.
pub fn complete(pb: &ProgressBar) {
    if !pb.is_finished() {
        pb.set_position(pb.length().unwrap_or(0));
        pb.finish();
    }
}

/// A storage that counts bytes written (puts and writers) and read (gets and ranged reads).
#[derive(Debug)]
pub struct Counted {
    pub inner: Arc<dyn Storage>,
    pub counters: Arc<Counters>,
}

impl Storage for Counted {
    fn location(&self, path: &str) -> String {
        self.inner.location(path)
    }
    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        self.counters.requests.add(Request::Put);
        let n = data.len() as u64;
        self.inner.put(path, data)?;
        self.counters.written.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }
    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        self.counters.requests.add(Request::PutIfAbsent);
        let n = data.len() as u64;
        self.inner.put_if_absent(path, data)?;
        self.counters.written.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }
    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        self.counters.requests.add(Request::PutIfMatch);
        let n = data.len() as u64;
        self.inner.put_if_match(path, data, expected)?;
        self.counters.written.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }
    fn writer(&self, path: &str, options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        self.counters.requests.add(Request::Writer);
        let inner = self.inner.writer(path, options)?;
        Ok(Box::new(CountedWriter { inner, counters: self.counters.clone() }))
    }
    fn get(&self, path: &str) -> Result<Bytes> {
        self.counters.requests.add(Request::Get);
        let b = self.inner.get(path)?;
        self.counters.read.fetch_add(b.len() as u64, Ordering::Relaxed);
        Ok(b)
    }
    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.counters.requests.add(Request::GetRanges);
        let v = self.inner.get_ranges(path, ranges)?;
        self.counters.read.fetch_add(v.iter().map(|b| b.len() as u64).sum(), Ordering::Relaxed);
        Ok(v)
    }
    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.reader(path)?.read_into(reads)
    }
    fn reader(&self, path: &str) -> Result<Box<dyn ObjectReader + '_>> {
        self.counters.requests.add(Request::Reader);
        Ok(Box::new(CountedReader { inner: self.inner.reader(path)?, counters: &self.counters }))
    }
    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>> {
        self.counters.requests.add(Request::Reader);
        Ok(Box::new(CountedReader { inner: self.inner.reader_sized(path, len)?, counters: &self.counters }))
    }
    fn hints(&self) -> StorageHints {
        self.inner.hints()
    }
    fn prefetch(&self, path: &str, at: u64, len: u64) {
        self.counters.requests.add(Request::Prefetch);
        self.inner.prefetch(path, at, len)
    }
    fn size(&self, path: &str) -> Result<u64> {
        self.counters.requests.add(Request::Size);
        self.inner.size(path)
    }
    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.counters.requests.add(Request::List);
        self.inner.list(prefix)
    }
    fn delete(&self, path: &str) -> Result<()> {
        self.counters.requests.add(Request::Delete);
        self.inner.delete(path)
    }
    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.counters.requests.add(Request::ListAbandoned);
        self.inner.list_abandoned(prefix)
    }
    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.counters.requests.add(Request::RemoveAbandoned);
        self.inner.remove_abandoned(prefix)
    }
}

struct CountedReader<'a> {
    inner: Box<dyn ObjectReader + 'a>,
    counters: &'a Counters,
}

impl ObjectReader for CountedReader<'_> {
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.counters.requests.add(Request::Read);
        self.inner.read_into(reads)?;
        self.counters.read.fetch_add(reads.iter().map(|(_, b)| b.len() as u64).sum(), Ordering::Relaxed);
        Ok(())
    }

    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        self.counters.requests.add(Request::Read);
        self.inner.read_into_inspected(reads, inspect)?;
        self.counters.read.fetch_add(reads.iter().map(|(_, b)| b.len() as u64).sum(), Ordering::Relaxed);
        Ok(())
    }

    fn read_picked_inspected(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        self.counters.requests.add(Request::Read);
        self.inner.read_picked_inspected(range.clone(), picks, inspect)?;
        self.counters.read.fetch_add(range.end.saturating_sub(range.start), Ordering::Relaxed);
        Ok(())
    }
}

#[derive(Debug)]
struct CountedWriter {
    inner: Box<dyn ObjectWriter>,
    counters: Arc<Counters>,
}

impl ObjectWriter for CountedWriter {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.inner.write(data)?;
        self.counters.written.fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn write_bytes(&mut self, data: Bytes) -> Result<()> {
        let n = data.len() as u64;
        self.inner.write_bytes(data)?;
        self.counters.written.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }
    fn write_vectored(&mut self, bufs: &[&[u8]]) -> Result<()> {
        self.inner.write_vectored(bufs)?;
        self.counters.written.fetch_add(bufs.iter().map(|b| b.len() as u64).sum(), Ordering::Relaxed);
        Ok(())
    }
    fn finish(self: Box<Self>) -> Result<u64> {
        self.inner.finish()
    }
    fn abort(self: Box<Self>) -> Result<()> {
        self.inner.abort()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The counting wrapper passes the backend's hints through: without `object_bytes_max`
    /// a demo on S3 wrote one multipart upload per rank.
    #[test]
    fn counted_storage_forwards_the_hints() {
        let config =
            dckpt::storage::FaultConfig { read_window: Some(77), object_bytes_max: Some(123), ..Default::default() };
        let inner = Arc::new(dckpt::storage::FaultStorage::new(Arc::new(dckpt::storage::MemoryStorage::new()), config));
        let counted = Counted { inner, counters: Arc::new(Counters::default()) };
        assert_eq!(counted.hints().read_window, Some(77));
        assert_eq!(counted.hints().object_bytes_max, Some(123));
    }

    #[test]
    fn counted_storage_counts_each_request_by_kind() {
        let counted =
            Counted { inner: Arc::new(dckpt::storage::MemoryStorage::new()), counters: Arc::new(Counters::default()) };
        counted.put("a", Bytes::from_static(b"abcd")).unwrap();
        counted.get("a").unwrap();
        counted.size("a").unwrap();
        let mut buf = [0u8; 2];
        counted.read_into("a", &mut [(1, &mut buf[..])]).unwrap();
        assert_eq!(&buf, b"bc");
        counted.list("").unwrap();
        counted.delete("a").unwrap();
        let r = &counted.counters.requests;
        let kinds = [Request::Put, Request::Get, Request::Size, Request::Reader, Request::Read, Request::List];
        for k in kinds.into_iter().chain([Request::Delete]) {
            assert_eq!(r.get(k), 1, "{}", k.name());
        }
        assert_eq!(r.snapshot().iter().sum::<u64>(), 7);
        assert_eq!(counted.counters.read.load(Ordering::Relaxed), 6);
    }
}
