//! One object written by a thread of its own while the caller produces its bytes:
//! [`write_pipelined`].
//!
//! The contract is [`write_pipelined`]'s.

use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::thread::{self, ScopedJoinHandle};

use crate::{Error, ObjectWriter, Result, Storage, WriterOptions};

/// How a pipelined write holds its bytes (see [`write_pipelined`], contract item 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipeOptions {
    /// Calls queued for the writer thread besides the one it is writing: 0 hands each over
    /// only once the thread is ready for it.
    pub queue: usize,
    /// Buffers of the pool ([`Pipe::fill`]); at least 1.
    pub buffers: usize,
    /// The largest buffer, in bytes; each is allocated with this capacity.
    pub buffer_bytes: usize,
    /// An object of at most this many bytes is written on the calling thread, each call on
    /// the storage writer as it is made: starting a thread and handing every call across
    /// costs more than the overlap buys for a small object, and a world of many ranks in one
    /// process (threads as ranks) would start one thread per rank for its few kilobytes.
    /// The contract holds the same, except that a failed write is the error of the call that
    /// made it, and a storage writer that panics panics the caller. 0: always a writer thread.
    pub inline_bytes: u64,
}

/// What the filling thread hands the writer thread.
enum Msg<'env> {
    Slice(&'env [u8]),
    Slices(Vec<&'env [u8]>),
    Owned(Vec<u8>),
    /// A buffer of the pool, sent back once written.
    Pooled(Vec<u8>),
    /// Everything was handed over: make the object visible. Without it the write is aborted.
    Finish,
}

impl Msg<'_> {
    /// Writes the bytes this message carries to `w`; a pool buffer goes to `give_back` once
    /// written. [`Msg::Finish`] carries none.
    fn write_to(self, w: &mut dyn ObjectWriter, give_back: impl FnOnce(Vec<u8>)) -> Result<()> {
        match self {
            Msg::Slice(data) => w.write(data),
            Msg::Slices(bufs) => w.write_vectored(&bufs),
            Msg::Owned(data) => w.write(&data),
            Msg::Pooled(buf) => {
                let res = w.write(&buf);
                give_back(buf);
                res
            }
            Msg::Finish => Ok(()),
        }
    }
}

/// The filling side of a pipelined write: what a fill hands its bytes to. See
/// [`write_pipelined`].
pub struct Pipe<'scope, 'env> {
    tx: Option<SyncSender<Msg<'env>>>,
    back: Receiver<Vec<u8>>,
    thread: Option<ScopedJoinHandle<'scope, Result<u64>>>,
    /// The storage writer itself, for an object written on the calling thread
    /// ([`PipeOptions::inline_bytes`], or no thread to be had); `tx` and `thread` are then
    /// `None`.
    inline: Option<Box<dyn ObjectWriter>>,
    options: PipeOptions,
    /// Buffers of the pool made so far, and those back and not handed out again.
    made: usize,
    spare: Vec<Vec<u8>>,
    /// Bytes handed over so far, and the declared length.
    sent: u64,
    len: u64,
    location: String,
    /// A call failed: the object will not be made visible.
    failed: bool,
}

impl std::fmt::Debug for Pipe<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipe")
            .field("location", &self.location)
            .field("sent", &self.sent)
            .field("len", &self.len)
            .finish()
    }
}

/// Writes the object `path` of `len` bytes from what `fill` hands its [`Pipe`], written by a
/// thread of its own while `fill` runs on this one; returns what `fill` returned.
///
/// A caller that computes what it writes (reads it from elsewhere, casts it, checksums it)
/// should not wait for the store while it does, nor the store for it. The caller's `fill`
/// runs on the calling thread and hands bytes to a [`Pipe`]; one writer thread takes them
/// in order and writes them to a [`Storage::writer`], so the fill prepares the next bytes
/// while the last ones are written.
///
/// # The contract
///
/// 1. **Order.** The object holds exactly the bytes handed over, in the order of the calls
///    that handed them, whatever kind of call each was. Each call is one call on the
///    storage writer: [`Pipe::write`] and [`Pipe::write_owned`] a `write`,
///    [`Pipe::write_vectored`] a `write_vectored`, [`Pipe::fill`] a `write` of its buffer.
/// 2. **Memory.** Bytes the caller lends ([`Pipe::write`], [`Pipe::write_vectored`]) are
///    written from the caller's memory, never copied here (the local backend writes them from
///    there). The pool holds at most [`PipeOptions::buffers`] buffers of at most
///    [`PipeOptions::buffer_bytes`] bytes each; a buffer comes back to it once written and is
///    handed out again, so a pipeline allocates at most that many whatever the object's
///    size. Besides, at most [`PipeOptions::queue`] + 1 calls' worth of bytes are on their way
///    (queued or being written), and the storage writer holds what its backend's
///    configuration says (contract item 3 of this crate).
/// 3. **Length.** The object's length is declared up front (the writer's size hint). A call
///    that would hand over more fails there, and a fill that returns having handed over
///    fewer fails: each error names the object's location and both lengths, and nothing
///    becomes visible.
/// 4. **Finish.** When the fill returns `Ok` and every byte was written, the storage writer
///    finishes: the whole object becomes visible at once, and [`write_pipelined`] returns
///    after that.
/// 5. **Failure and drop.** When the fill returns an error or panics, or a write of the
///    store fails, or the length is wrong, the storage writer is aborted and nothing becomes
///    visible under the object's name; [`write_pipelined`] returns (or the fill's panic goes
///    on) only once the writer thread has ended. A failed write of the store comes back on
///    the fill's side as the error of a later call on the pipe (at most
///    [`PipeOptions::queue`] + 1 calls later, as those may already be on their way; calls
///    after it fail with [`Error::WriterFailed`]), or of [`write_pipelined`] itself when the
///    fill had handed over everything; a panic of the writer thread is an error too, never
///    a hang or a crash. The fill's own errors are returned as they are.
///
/// # Example
///
/// ```
/// use dckpt_storage::{MemoryStorage, PipeOptions, Storage, write_pipelined};
///
/// let store = MemoryStorage::new();
/// let header = b"head:".to_vec();
/// let options = PipeOptions { queue: 1, buffers: 2, buffer_bytes: 4, inline_bytes: 0 };
/// let sum = write_pipelined(&store, "object", 13, options, |pipe| {
///     pipe.write(&header)?;
///     let mut sum = 0u64;
///     for i in 0..2u8 {
///         pipe.fill(4, |buf| {
///             buf.fill(b'a' + i);
///             sum += buf.len() as u64;
///             Ok::<(), dckpt_storage::Error>(())
///         })?;
///     }
///     Ok::<u64, dckpt_storage::Error>(sum)
/// })?;
/// assert_eq!(sum, 8);
/// assert_eq!(&store.get("object")?[..], b"head:aaaabbbb");
/// # Ok::<(), dckpt_storage::Error>(())
/// ```
pub fn write_pipelined<'env, R, E>(
    storage: &dyn Storage,
    path: &str,
    len: u64,
    options: PipeOptions,
    fill: impl FnOnce(&mut Pipe<'_, 'env>) -> std::result::Result<R, E>,
) -> std::result::Result<R, E>
where
    E: From<Error>,
{
    let location = storage.location(path);
    let writer = storage.writer(path, &WriterOptions { size_hint_bytes: Some(len) })?;
    thread::scope(|s| {
        let (tx, rx) = mpsc::sync_channel(options.queue);
        let (back_tx, back) = mpsc::channel();
        let (tx, thread, inline) = if len <= options.inline_bytes {
            (None, None, Some(writer))
        } else {
            // The writer goes to the thread once it runs: where the process cannot start
            // one, it stays here and the pipe writes inline, as for a small object.
            let drained = location.clone();
            let (give, take) = mpsc::sync_channel::<Box<dyn ObjectWriter>>(1);
            let body = move || match take.recv() {
                Ok(writer) => drain(writer, rx, back_tx, &drained),
                Err(_) => Err(Error::permanent("write", &drained, "no writer was handed to its thread")),
            };
            match thread::Builder::new().spawn_scoped(s, body) {
                Ok(t) => match give.send(writer) {
                    Ok(()) => (Some(tx), Some(t), None),
                    Err(mpsc::SendError(writer)) => (None, None, Some(writer)),
                },
                Err(_) => (None, None, Some(writer)),
            }
        };
        let mut pipe = Pipe {
            tx,
            back,
            thread,
            inline,
            options: PipeOptions { buffers: options.buffers.max(1), ..options },
            made: 0,
            spare: Vec::new(),
            sent: 0,
            len,
            location,
            failed: false,
        };
        let r = match fill(&mut pipe) {
            Ok(r) => r,
            Err(e) => {
                pipe.abandon();
                return Err(e);
            }
        };
        let written = pipe.finish()?;
        if written != len {
            // The store's count of what it wrote is not what was handed to it: the object
            // became visible, wrong, so it goes again (leaving none, as a failed put may).
            let _ = storage.delete(path);
            let detail = format!("the store wrote {written} bytes, {len} were handed to it");
            return Err(Error::permanent("finish", &pipe.location, detail).into());
        }
        Ok(r)
    })
}

/// The writer thread: writes what arrives, in order; finishes on [`Msg::Finish`], aborts when
/// the pipe goes without it or a write fails. Returns the bytes the store wrote.
fn drain(mut w: Box<dyn ObjectWriter>, rx: Receiver<Msg<'_>>, back: Sender<Vec<u8>>, location: &str) -> Result<u64> {
    for m in rx {
        let res = match m {
            Msg::Finish => return w.finish(),
            m => m.write_to(&mut *w, |buf| {
                let _ = back.send(buf);
            }),
        };
        if let Err(e) = res {
            let _ = w.abort();
            return Err(e);
        }
    }
    // Abandoned: the fill failed or panicked.
    let _ = w.abort();
    Err(Error::permanent("write", location, "abandoned by its fill; nothing was made visible"))
}

impl<'env> Pipe<'_, 'env> {
    /// Writes `data`, from the caller's memory.
    pub fn write(&mut self, data: &'env [u8]) -> Result<()> {
        self.send(data.len() as u64, Msg::Slice(data))
    }

    /// Writes each of `bufs` in order, in one vectored write, from the caller's memory.
    pub fn write_vectored(&mut self, bufs: Vec<&'env [u8]>) -> Result<()> {
        let n = bufs.iter().map(|b| b.len() as u64).sum();
        self.send(n, Msg::Slices(bufs))
    }

    /// Writes `data`, dropped once written: small bytes made on the way (records around a
    /// payload); what is made in bulk goes through [`Pipe::fill`].
    pub fn write_owned(&mut self, data: Vec<u8>) -> Result<()> {
        self.send(data.len() as u64, Msg::Owned(data))
    }

    /// Writes `len` bytes that `fill` puts into a buffer of the pool: a new one while fewer
    /// than [`PipeOptions::buffers`] exist, else one back from the writer thread (waiting for
    /// it). The buffer is `len` bytes long and not cleared: `fill` overwrites all of it, as
    /// what it leaves is what the buffer last held (zeros, or bytes written earlier to this
    /// object). An error of `fill` is returned as it is, and nothing of the buffer is written.
    pub fn fill<E: From<Error>>(
        &mut self,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if len > self.options.buffer_bytes {
            self.failed = true;
            let detail = format!("a buffer of {len} bytes, over the {} a buffer holds", self.options.buffer_bytes);
            return Err(Error::permanent("write", &self.location, detail).into());
        }
        self.admit(len as u64)?;
        let mut buf = self.buffer()?;
        // Only a different length is set: clearing every buffer would cost a pass over it.
        if buf.len() != len {
            buf.resize(len, 0);
        }
        if let Err(e) = fill(&mut buf) {
            self.spare.push(buf);
            self.failed = true;
            return Err(e);
        }
        Ok(self.send(len as u64, Msg::Pooled(buf))?)
    }

    /// Bytes handed over so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// A buffer of the pool: a spare one, a new one while under the limit, else the next
    /// one the writer thread sends back.
    fn buffer(&mut self) -> Result<Vec<u8>> {
        self.spare.extend(self.back.try_iter());
        if let Some(buf) = self.spare.pop() {
            return Ok(buf);
        }
        if self.made < self.options.buffers {
            self.made += 1;
            return Ok(Vec::with_capacity(self.options.buffer_bytes));
        }
        match self.back.recv() {
            Ok(buf) => Ok(buf),
            // The thread ended, so it failed: its error says why.
            Err(_) => Err(self.thread_error()),
        }
    }

    /// Refuses a call once one failed, or one that would pass the declared length.
    fn admit(&mut self, n: u64) -> Result<()> {
        if self.failed {
            return Err(Error::WriterFailed { path: self.location.clone() });
        }
        let total = self.sent.saturating_add(n);
        if total > self.len {
            self.failed = true;
            let detail = format!("{total} bytes handed over, more than the {} declared", self.len);
            return Err(Error::permanent("write", &self.location, detail));
        }
        Ok(())
    }

    fn send(&mut self, n: u64, m: Msg<'env>) -> Result<()> {
        self.admit(n)?;
        if let Some(w) = self.inline.as_mut() {
            let spare = &mut self.spare;
            if let Err(e) = m.write_to(&mut **w, |buf| spare.push(buf)) {
                self.abandon();
                return Err(e);
            }
            self.sent += n;
            return Ok(());
        }
        let tx = self.tx.as_ref().ok_or_else(|| Error::WriterFailed { path: self.location.clone() })?;
        if tx.send(m).is_err() {
            return Err(self.thread_error());
        }
        self.sent += n;
        Ok(())
    }

    /// Why the writer thread ended early: its error, or its panic as one.
    fn thread_error(&mut self) -> Error {
        self.failed = true;
        self.tx = None;
        match self.thread.take().map(ScopedJoinHandle::join) {
            Some(Ok(Err(e))) => e,
            Some(Err(_)) => self.panicked(),
            Some(Ok(Ok(_))) | None => Error::WriterFailed { path: self.location.clone() },
        }
    }

    fn panicked(&self) -> Error {
        Error::permanent("write", &self.location, "the write thread panicked; nothing was made visible")
    }

    /// Checks the length, makes the object visible and waits for the writer thread; returns
    /// the bytes the store says it wrote.
    fn finish(&mut self) -> Result<u64> {
        if self.failed {
            self.abandon();
            return Err(Error::WriterFailed { path: self.location.clone() });
        }
        if self.sent != self.len {
            self.abandon();
            let detail = format!("{} bytes handed over, {} declared; nothing was made visible", self.sent, self.len);
            return Err(Error::permanent("write", &self.location, detail));
        }
        if let Some(w) = self.inline.take() {
            return w.finish();
        }
        let sent = self.tx.take().is_some_and(|tx| tx.send(Msg::Finish).is_ok());
        if !sent {
            return Err(self.thread_error());
        }
        match self.thread.take().map(ScopedJoinHandle::join) {
            Some(Ok(written)) => written,
            Some(Err(_)) => Err(self.panicked()),
            None => Err(Error::WriterFailed { path: self.location.clone() }),
        }
    }

    /// Aborts the write and waits for the writer thread to end.
    fn abandon(&mut self) {
        self.failed = true;
        if let Some(w) = self.inline.take() {
            let _ = w.abort();
        }
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A fill that panics leaves an object written on its thread unfinished: nothing of it
/// becomes visible.
impl Drop for Pipe<'_, '_> {
    fn drop(&mut self) {
        if let Some(w) = self.inline.take() {
            let _ = w.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;
    use std::ops::Range;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::Arc;

    use bytes::Bytes;

    use super::*;
    use crate::{FaultConfig, FaultStorage, LocalStorage, MemoryStorage, ObjectInfo, StorageExt, StorageHints};

    /// Counts this thread's allocations of at least [`LARGE`] bytes, so that a test sees the
    /// buffers a pipeline allocates (on the filling thread) and nothing of other tests.
    struct Counting;

    const LARGE: usize = 1 << 20;

    thread_local! {
        static LARGE_ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
    }

    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            if layout.size() >= LARGE {
                let _ = LARGE_ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
            }
            // SAFETY: the caller's layout, passed on as it is.
            unsafe { System.alloc(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: `ptr` came from `System.alloc` with this layout.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static ALLOCATOR: Counting = Counting;

    const OPTIONS: PipeOptions = PipeOptions { queue: 1, buffers: 2, buffer_bytes: 16, inline_bytes: 0 };

    /// A fill's own error, or the pipe's.
    #[derive(Debug)]
    enum FillError {
        Source,
        Pipe(Error),
    }

    impl From<Error> for FillError {
        fn from(e: Error) -> Self {
            FillError::Pipe(e)
        }
    }

    /// What [`Odd`]'s writers do wrong.
    #[derive(Debug, Clone, Copy)]
    enum Oddity {
        PanicOnWrite,
        CountsOneMore,
        /// Each write takes a millisecond, so that a fill runs ahead of it.
        Slow,
    }

    /// A memory store whose writers misbehave.
    #[derive(Debug)]
    struct Odd {
        inner: MemoryStorage,
        oddity: Oddity,
    }

    #[derive(Debug)]
    struct OddWriter {
        inner: Box<dyn ObjectWriter>,
        oddity: Oddity,
    }

    impl ObjectWriter for OddWriter {
        fn write(&mut self, data: &[u8]) -> Result<()> {
            match self.oddity {
                Oddity::PanicOnWrite => panic!("a write that panics"),
                Oddity::Slow => std::thread::sleep(std::time::Duration::from_millis(1)),
                Oddity::CountsOneMore => {}
            }
            self.inner.write(data)
        }

        fn finish(self: Box<Self>) -> Result<u64> {
            let more = u64::from(matches!(self.oddity, Oddity::CountsOneMore));
            Ok(self.inner.finish()? + more)
        }

        fn abort(self: Box<Self>) -> Result<()> {
            self.inner.abort()
        }
    }

    impl Storage for Odd {
        fn location(&self, path: &str) -> String {
            self.inner.location(path)
        }
        fn put(&self, path: &str, data: Bytes) -> Result<()> {
            self.inner.put(path, data)
        }
        fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
            self.inner.put_if_absent(path, data)
        }
        fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
            self.inner.put_if_match(path, data, expected)
        }
        fn writer(&self, path: &str, options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
            Ok(Box::new(OddWriter { inner: self.inner.writer(path, options)?, oddity: self.oddity }))
        }
        fn get(&self, path: &str) -> Result<Bytes> {
            self.inner.get(path)
        }
        fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
            self.inner.get_ranges(path, ranges)
        }
        fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
            self.inner.read_into(path, reads)
        }
        fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn crate::ObjectReader + '_>> {
            self.inner.reader_sized(path, len)
        }
        fn hints(&self) -> StorageHints {
            self.inner.hints()
        }
        fn prefetch(&self, path: &str, at: u64, len: u64) {
            self.inner.prefetch(path, at, len)
        }
        fn size(&self, path: &str) -> Result<u64> {
            self.inner.size(path)
        }
        fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
            self.inner.list(prefix)
        }
        fn delete(&self, path: &str) -> Result<()> {
            self.inner.delete(path)
        }
        fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
            self.inner.list_abandoned(prefix)
        }
        fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
            self.inner.remove_abandoned(prefix)
        }
    }

    /// Every file under `dir`, temporaries included.
    fn files(dir: &std::path::Path) -> Vec<String> {
        let mut out: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        out.sort();
        out
    }

    #[test]
    fn the_bytes_land_in_the_order_handed_over_whatever_the_call() {
        let store = MemoryStorage::new();
        let (head, parts) = (b"head".to_vec(), [b"ab".to_vec(), b"cde".to_vec()]);
        let got = write_pipelined(&store, "o", 4 + 5 + 3 + 3 * 16, OPTIONS, |pipe| {
            pipe.write(&head)?;
            pipe.write_vectored(parts.iter().map(Vec::as_slice).collect())?;
            pipe.write_owned(b"xyz".to_vec())?;
            for i in 0..3u8 {
                pipe.fill(16, |buf| {
                    buf.fill(b'0' + i);
                    Ok::<(), Error>(())
                })?;
            }
            Ok::<u64, Error>(pipe.sent())
        })
        .unwrap();
        assert_eq!(got, 60);
        let want = [&b"headabcdexyz"[..], &[b'0'; 16], &[b'1'; 16], &[b'2'; 16]].concat();
        assert_eq!(store.get("o").unwrap(), want);
    }

    #[test]
    fn a_failed_fill_returns_its_error_and_leaves_the_old_object() {
        let store = MemoryStorage::new();
        store.put("o", Bytes::from_static(b"old")).unwrap();
        let res = write_pipelined(&store, "o", 32, OPTIONS, |pipe| {
            pipe.fill(16, |buf| {
                buf.fill(1);
                Ok::<(), FillError>(())
            })?;
            pipe.fill(16, |_| Err(FillError::Source))
        });
        assert!(matches!(res, Err(FillError::Source)), "{res:?}");
        assert_eq!(store.get("o").unwrap(), &b"old"[..]);
    }

    #[test]
    fn a_dropped_pipe_leaves_nothing_on_local_disk() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStorage::new(dir.path()).unwrap();
        let data = vec![7u8; 4096];
        let res = write_pipelined(&store, "o", 8192, OPTIONS, |pipe| {
            pipe.write(&data)?;
            Err::<(), FillError>(FillError::Source)
        });
        assert!(matches!(res, Err(FillError::Source)), "{res:?}");
        assert_eq!(files(dir.path()), Vec::<String>::new());
        // A fill that panics: the panic goes on, and the temporary is gone with the pipe.
        let panicked = catch_unwind(AssertUnwindSafe(|| {
            write_pipelined(&store, "o", 8192, OPTIONS, |pipe| -> Result<()> {
                pipe.write(&data)?;
                panic!("a fill that panics");
            })
        }));
        assert!(panicked.is_err());
        assert_eq!(files(dir.path()), Vec::<String>::new());
        assert!(!store.exists("o").unwrap());
    }

    #[test]
    fn a_failed_store_write_is_an_error_on_the_fill_side() {
        let inner = Arc::new(MemoryStorage::new());
        // Operation 0 opens the writer, 1 is the first write: the second write fails.
        let config = FaultConfig { fail_op: Some(2), ..FaultConfig::default() };
        let store = FaultStorage::new(inner.clone(), config);
        let options = PipeOptions { queue: 0, buffers: 1, buffer_bytes: 16, inline_bytes: 0 };
        let mut seen = None;
        let res = write_pipelined(&store, "o", 16 * 100, options, |pipe| {
            for i in 0..100 {
                let res = pipe.fill(16, |buf| {
                    buf.fill(3);
                    Ok::<(), FillError>(())
                });
                if let Err(e) = res {
                    seen = Some((i, format!("{e:?}")));
                    // A pipe that failed stays failed.
                    assert!(matches!(pipe.write(b"x"), Err(Error::WriterFailed { .. })));
                    return Err(e);
                }
            }
            Ok(())
        });
        let (at, seen) = seen.expect("the fill saw the failure");
        assert!(at < 4, "seen only at call {at}");
        assert!(matches!(res, Err(FillError::Pipe(Error::Injected { op_index: 2, .. }))), "{res:?}");
        assert_eq!(seen, format!("{:?}", res.unwrap_err()));
        assert!(!inner.exists("o").unwrap());
    }

    #[test]
    fn a_short_or_long_fill_fails_the_length_check_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStorage::new(dir.path()).unwrap();
        let location = store.location("o");
        let data = [5u8; 6];
        let short = write_pipelined(&store, "o", 10, OPTIONS, |pipe| pipe.write(&data)).unwrap_err().to_string();
        assert!(short.contains(&location) && short.contains("6 bytes") && short.contains("10 declared"), "{short}");
        let long = write_pipelined(&store, "o", 10, OPTIONS, |pipe| {
            pipe.write(&data)?;
            pipe.write(&data)
        });
        let long = long.unwrap_err().to_string();
        assert!(long.contains(&location) && long.contains("12 bytes") && long.contains("10 declared"), "{long}");
        // A fill that goes on as if the refused call had not happened still fails.
        let ignored = write_pipelined(&store, "o", 6, OPTIONS, |pipe| {
            pipe.write(&data)?;
            let _ = pipe.write(&data);
            Ok::<(), Error>(())
        });
        assert!(matches!(ignored, Err(Error::WriterFailed { .. })), "{ignored:?}");
        let oversized = write_pipelined(&store, "o", 17, OPTIONS, |pipe| pipe.fill(17, |_| Ok::<(), Error>(())));
        assert!(oversized.unwrap_err().to_string().contains("17 bytes, over the 16"));
        assert_eq!(files(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn buffers_are_recycled_so_allocations_are_bounded() {
        // A store slower than the fill, and a queue longer than the pool: without the bound,
        // the fill would make a buffer whenever none is back yet, six at once.
        let store = Odd { inner: MemoryStorage::new(), oddity: Oddity::Slow };
        let options = PipeOptions { queue: 4, buffers: 2, buffer_bytes: LARGE, inline_bytes: 0 };
        let before = LARGE_ALLOCATIONS.with(Cell::get);
        write_pipelined(&store, "o", 64 * LARGE as u64, options, |pipe| {
            for i in 0..64u8 {
                pipe.fill(LARGE, |buf| {
                    buf[0] = i;
                    Ok::<(), Error>(())
                })?;
            }
            Ok::<(), Error>(())
        })
        .unwrap();
        let made = LARGE_ALLOCATIONS.with(Cell::get) - before;
        assert!((1..=2).contains(&made), "{made} buffers allocated for 64 fills of a pool of 2");
        let object = store.get("o").unwrap();
        assert!((0..64).all(|i| object[i * LARGE] == i as u8));
    }

    #[test]
    fn a_panicking_write_thread_is_an_error() {
        let store = Odd { inner: MemoryStorage::new(), oddity: Oddity::PanicOnWrite };
        let data = [1u8; 8];
        let res = write_pipelined(&store, "o", 80, OPTIONS, |pipe| {
            for _ in 0..10 {
                pipe.write(&data)?;
            }
            Ok::<(), Error>(())
        });
        let e = res.unwrap_err().to_string();
        assert!(e.contains("the write thread panicked") && e.contains(&store.location("o")), "{e}");
        assert!(!store.exists("o").unwrap());
    }

    #[test]
    fn a_store_that_miscounts_what_it_wrote_keeps_no_object() {
        let store = Odd { inner: MemoryStorage::new(), oddity: Oddity::CountsOneMore };
        let data = [1u8; 8];
        let e = write_pipelined(&store, "o", 8, OPTIONS, |pipe| pipe.write(&data)).unwrap_err().to_string();
        assert!(e.contains("the store wrote 9 bytes, 8 were handed to it"), "{e}");
        assert!(!store.exists("o").unwrap());
    }

    /// An object written on the calling thread keeps the contract: order, the old object
    /// kept when the fill fails, nothing left by a fill that fails or panics, a failed
    /// write the error of the call that made it, the length checked.
    #[test]
    fn small_objects_written_inline_keep_the_contract() {
        let inline = PipeOptions { inline_bytes: u64::MAX, ..OPTIONS };
        let store = MemoryStorage::new();
        store.put("o", Bytes::from_static(b"old")).unwrap();
        let failed = write_pipelined(&store, "o", 32, inline, |pipe| {
            pipe.write(b"0123456789abcdef")?;
            pipe.fill(16, |_| Err(FillError::Source))
        });
        assert!(matches!(failed, Err(FillError::Source)), "{failed:?}");
        assert_eq!(store.get("o").unwrap(), &b"old"[..]);
        let parts = [b"ab".to_vec(), b"cde".to_vec()];
        write_pipelined(&store, "o", 4 + 5 + 3 + 16, inline, |pipe| {
            pipe.write(b"head")?;
            pipe.write_vectored(parts.iter().map(Vec::as_slice).collect())?;
            pipe.write_owned(b"xyz".to_vec())?;
            pipe.fill(16, |buf| {
                buf.fill(b'0');
                Ok::<(), Error>(())
            })
        })
        .unwrap();
        assert_eq!(store.get("o").unwrap(), [&b"headabcdexyz"[..], &[b'0'; 16]].concat());

        let dir = tempfile::tempdir().unwrap();
        let local = LocalStorage::new(dir.path()).unwrap();
        let panicked = catch_unwind(AssertUnwindSafe(|| {
            write_pipelined(&local, "o", 8, inline, |pipe| -> Result<()> {
                pipe.write(b"1234")?;
                panic!("a fill that panics");
            })
        }));
        assert!(panicked.is_err());
        let short = write_pipelined(&local, "o", 10, inline, |pipe| pipe.write(b"123456")).unwrap_err();
        assert!(short.to_string().contains("6 bytes") && short.to_string().contains("10 declared"), "{short}");
        assert_eq!(files(dir.path()), Vec::<String>::new());

        let inner = Arc::new(MemoryStorage::new());
        let config = FaultConfig { fail_op: Some(2), ..FaultConfig::default() };
        let faulty = FaultStorage::new(inner.clone(), config);
        let mut calls = 0;
        let res = write_pipelined(&faulty, "o", 16 * 4, inline, |pipe| {
            for _ in 0..4 {
                calls += 1;
                pipe.write(b"0123456789abcdef")?;
            }
            Ok::<(), Error>(())
        });
        assert!(matches!(res, Err(Error::Injected { op_index: 2, .. })), "{res:?}");
        assert_eq!(calls, 2, "the failed write is the error of its own call");
        assert!(!inner.exists("o").unwrap());
        let odd = Odd { inner: MemoryStorage::new(), oddity: Oddity::CountsOneMore };
        let e = write_pipelined(&odd, "o", 8, inline, |pipe| pipe.write(&[1u8; 8])).unwrap_err().to_string();
        assert!(e.contains("the store wrote 9 bytes, 8 were handed to it"), "{e}");
    }
}
