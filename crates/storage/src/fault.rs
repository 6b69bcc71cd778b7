//! Seeded, reproducible fault injection over any backend.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use serde::Serialize;

use crate::{Error, ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions};

/// What to inject. The default injects nothing (the wrapper then only counts operations).
///
/// Operations are numbered from 0 in the order they start: every [`Storage`] call, and every
/// `write`, `write_bytes`, `finish` and `abort` of a writer it handed out. Random choices
/// depend only on `seed` and the operation's number, so a single-threaded run replays exactly.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FaultConfig {
    /// Seed of every random choice; printed in each injected error.
    pub seed: u64,
    /// Fail operation number `i` (a permanent [`Error::Injected`]).
    pub fail_op: Option<u64>,
    /// Fail every operation from number `i` on: the process "crashed" there.
    pub fail_from_op: Option<u64>,
    /// Whether a failed operation first takes effect on the backend (the reply is lost) instead
    /// of never reaching it. A failed writer `write` never takes effect either way.
    pub fail_after_effect: bool,
    /// Tear every object write (a put, a conditional create or replace, or a streamed object) that goes
    /// past this many bytes: exactly the first `k` bytes reach the backend's writer, then the
    /// operation fails and the backend's writer is aborted.
    pub tear_after_bytes: Option<u64>,
    /// Added latency of each operation, uniform in `latency_min_ms..=latency_max_ms`.
    pub latency_min_ms: u64,
    /// See `latency_min_ms`.
    pub latency_max_ms: u64,
    /// Chance that a read (`get`, `get_ranges`, `read_into`) returns one flipped bit.
    pub bit_flip_probability: f64,
    /// Chance that a single-shot operation (not a writer's write / finish) is throttled: it
    /// fails with a transient error without reaching the backend.
    pub throttle_probability: f64,
    /// Replaces the backend's [`StorageHints::read_window`], so that tests run windowed reads
    /// over a few bytes of data (`None`: the backend's).
    pub read_window: Option<u64>,
    /// Replaces the backend's [`StorageHints::object_bytes_max`], so that tests spread small
    /// states over many objects (`None`: the backend's).
    pub object_bytes_max: Option<u64>,
    /// Replaces the backend's [`StorageHints::reads_in_flight`], so that tests read several
    /// objects at once, as from an object store (`None`: the backend's).
    pub reads_in_flight: Option<usize>,
}

/// One fault that was injected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InjectedFault {
    /// The operation's number (see [`FaultConfig`]).
    pub op_index: u64,
    /// The operation: `put`, `get_ranges`, `write`, `finish`, ...
    pub op: &'static str,
    /// `fail`, `fail after effect`, `torn write`, `throttle` or `bit flip`.
    pub kind: &'static str,
    /// The location involved.
    pub path: String,
}

/// A [`Storage`] that injects faults into another one, as [`FaultConfig`] says, and counts
/// operations so that a crash test can fail each one in turn:
///
/// ```
/// use std::sync::Arc;
/// use bytes::Bytes;
/// use dckpt_storage::{FaultConfig, FaultStorage, MemoryStorage, Storage, StorageExt};
///
/// let work = |s: &dyn Storage| -> dckpt_storage::Result<()> {
///     s.put("data", Bytes::from_static(b"payload"))?;
///     s.put_if_absent("commit", Bytes::from_static(b"ok"))
/// };
/// let dry = FaultStorage::new(Arc::new(MemoryStorage::new()), FaultConfig::default());
/// work(&dry).unwrap();
/// for i in 0..dry.ops() {
///     let inner = Arc::new(MemoryStorage::new());
///     let s = FaultStorage::new(inner.clone(), FaultConfig { seed: 7, fail_op: Some(i), ..Default::default() });
///     assert!(work(&s).is_err());
///     assert!(!inner.exists("commit").unwrap()); // a failed save never commits
/// }
/// ```
#[derive(Debug, Clone)]
pub struct FaultStorage {
    inner: Arc<dyn Storage>,
    state: Arc<State>,
}

#[derive(Debug)]
struct State {
    config: FaultConfig,
    ops: AtomicU64,
    log: Mutex<Vec<InjectedFault>>,
}

/// What happens to one operation.
struct Op {
    index: u64,
    name: &'static str,
    random: u64,
}

impl FaultStorage {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Storage>, config: FaultConfig) -> Self {
        let state = State { config, ops: AtomicU64::new(0), log: Mutex::default() };
        FaultStorage { inner, state: Arc::new(state) }
    }

    /// The number of operations started so far.
    pub fn ops(&self) -> u64 {
        self.state.ops.load(Ordering::SeqCst)
    }

    /// The seed in use.
    pub fn seed(&self) -> u64 {
        self.state.config.seed
    }

    /// Every fault injected so far, in order.
    pub fn injected(&self) -> Vec<InjectedFault> {
        self.state.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl State {
    /// Numbers the operation and sleeps its latency.
    fn begin(&self, name: &'static str) -> Op {
        let index = self.ops.fetch_add(1, Ordering::SeqCst);
        let random = splitmix64(self.config.seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let c = &self.config;
        if c.latency_max_ms > 0 {
            let span = c.latency_max_ms.saturating_sub(c.latency_min_ms).saturating_add(1);
            std::thread::sleep(Duration::from_millis(c.latency_min_ms + splitmix64(random) % span));
        }
        Op { index, name, random }
    }

    fn fails(&self, op: &Op) -> bool {
        self.config.fail_op == Some(op.index) || self.config.fail_from_op.is_some_and(|f| op.index >= f)
    }

    fn chance(random: u64, p: f64) -> bool {
        p > 0.0 && (random >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    fn throttled(&self, op: &Op) -> bool {
        Self::chance(splitmix64(op.random ^ 1), self.config.throttle_probability)
    }

    fn injected(&self, op: &Op, kind: &'static str, path: String, transient: bool) -> Error {
        let fault = InjectedFault { op_index: op.index, op: op.name, kind, path: path.clone() };
        self.log.lock().unwrap_or_else(|p| p.into_inner()).push(fault);
        Error::Injected { path, op_index: op.index, seed: self.config.seed, kind: kind.into(), transient }
    }

    /// The throttling or failure (before effect) this single-shot operation gets, if any.
    fn gate(&self, op: &Op, location: impl FnOnce() -> String) -> Result<()> {
        if self.fails(op) && !self.config.fail_after_effect {
            return Err(self.injected(op, "fail", location(), false));
        }
        if self.throttled(op) {
            return Err(self.injected(op, "throttle", location(), true));
        }
        Ok(())
    }

    /// The result of an operation that ran: replaced by a failure when failing after effect.
    fn after<T>(&self, op: &Op, location: impl FnOnce() -> String, res: Result<T>) -> Result<T> {
        if self.fails(op) && self.config.fail_after_effect {
            return Err(self.injected(op, "fail after effect", location(), false));
        }
        res
    }

    /// Flips one bit of `data` (if nonempty) when this read draws a bit flip.
    fn maybe_flip(&self, op: &Op, data: &mut [u8], location: impl FnOnce() -> String) {
        if data.is_empty() || !Self::chance(splitmix64(op.random ^ 2), self.config.bit_flip_probability) {
            return;
        }
        let r = splitmix64(op.random ^ 3);
        let bit = r % (data.len() as u64 * 8);
        data[(bit / 8) as usize] ^= 1 << (bit % 8);
        let fault = InjectedFault { op_index: op.index, op: op.name, kind: "bit flip", path: location() };
        self.log.lock().unwrap_or_else(|p| p.into_inner()).push(fault);
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl FaultStorage {
    /// A put, conditional create or conditional replace (`put` on the backend): torn, failed,
    /// throttled, or passed through.
    fn put_with(
        &self,
        name: &'static str,
        path: &str,
        data: Bytes,
        put: impl FnOnce(&dyn Storage, Bytes) -> Result<()>,
    ) -> Result<()> {
        let st = &self.state;
        let op = st.begin(name);
        st.gate(&op, || self.location(path))?;
        if let Some(k) = st.config.tear_after_bytes.filter(|&k| data.len() as u64 > k) {
            let mut w = self.inner.writer(path, &WriterOptions::default())?;
            w.write(&data[..k as usize])?;
            drop(w);
            return Err(st.injected(&op, "torn write", self.location(path), false));
        }
        let res = put(self.inner.as_ref(), data);
        st.after(&op, || self.location(path), res)
    }
}

impl Storage for FaultStorage {
    fn location(&self, path: &str) -> String {
        self.inner.location(path)
    }

    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        self.put_with("put", path, data, |s, d| s.put(path, d))
    }

    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        self.put_with("put_if_absent", path, data, |s, d| s.put_if_absent(path, d))
    }

    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        self.put_with("put_if_match", path, data, |s, d| s.put_if_match(path, d, expected))
    }

    fn writer(&self, path: &str, options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        let op = self.state.begin("writer");
        self.state.gate(&op, || self.location(path))?;
        let inner = self.inner.writer(path, options);
        let inner = self.state.after(&op, || self.location(path), inner)?;
        Ok(Box::new(FaultWriter {
            inner: Some(inner),
            state: self.state.clone(),
            location: self.location(path),
            written: 0,
        }))
    }

    fn get(&self, path: &str) -> Result<Bytes> {
        let op = self.state.begin("get");
        self.state.gate(&op, || self.location(path))?;
        let res = self.inner.get(path);
        let data = self.state.after(&op, || self.location(path), res)?;
        let mut data = BytesMut::from(data);
        self.state.maybe_flip(&op, &mut data, || self.location(path));
        Ok(data.freeze())
    }

    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        let op = self.state.begin("get_ranges");
        self.state.gate(&op, || self.location(path))?;
        let res = self.inner.get_ranges(path, ranges);
        let mut out = self.state.after(&op, || self.location(path), res)?;
        if let Some(i) = pick_nonempty(op.random, out.iter().map(Bytes::len)) {
            let mut b = BytesMut::from(std::mem::take(&mut out[i]));
            self.state.maybe_flip(&op, &mut b, || self.location(path));
            out[i] = b.freeze();
        }
        Ok(out)
    }

    fn hints(&self) -> StorageHints {
        let (inner, config) = (self.inner.hints(), &self.state.config);
        inner
            .with_read_window(config.read_window.or(inner.read_window))
            .with_object_bytes_max(config.object_bytes_max.or(inner.object_bytes_max))
            .with_reads_in_flight(config.reads_in_flight.or(inner.reads_in_flight))
            // Its readers read, flip, then show what they read: never the store's own memory.
            .with_reads_in_place(false)
    }

    /// A hint, not an operation: not counted, never failed.
    fn prefetch(&self, path: &str, at: u64, len: u64) {
        self.inner.prefetch(path, at, len)
    }

    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        let op = self.state.begin("read_into");
        self.state.gate(&op, || self.location(path))?;
        let res = self.inner.read_into(path, reads);
        self.state.after(&op, || self.location(path), res)?;
        if let Some(i) = pick_nonempty(op.random, reads.iter().map(|(_, b)| b.len())) {
            self.state.maybe_flip(&op, reads[i].1, || self.location(path));
        }
        Ok(())
    }

    /// Opening is an operation (it checks the length); each read of the reader is one
    /// more, failed, counted and flipped as `read_into` is.
    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>> {
        let op = self.state.begin("reader_sized");
        self.state.gate(&op, || self.location(path))?;
        let res = self.inner.reader_sized(path, len);
        let inner = self.state.after(&op, || self.location(path), res)?;
        Ok(Box::new(FaultReader { inner, state: &self.state, location: self.location(path) }))
    }

    fn size(&self, path: &str) -> Result<u64> {
        let op = self.state.begin("size");
        self.state.gate(&op, || self.location(path))?;
        let res = self.inner.size(path);
        self.state.after(&op, || self.location(path), res)
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let op = self.state.begin("list");
        self.state.gate(&op, || self.location(prefix))?;
        let res = self.inner.list(prefix);
        self.state.after(&op, || self.location(prefix), res)
    }

    fn delete(&self, path: &str) -> Result<()> {
        let op = self.state.begin("delete");
        self.state.gate(&op, || self.location(path))?;
        let res = self.inner.delete(path);
        self.state.after(&op, || self.location(path), res)
    }

    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let op = self.state.begin("list_abandoned");
        self.state.gate(&op, || self.location(prefix))?;
        let res = self.inner.list_abandoned(prefix);
        self.state.after(&op, || self.location(prefix), res)
    }

    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let op = self.state.begin("remove_abandoned");
        self.state.gate(&op, || self.location(prefix))?;
        let res = self.inner.remove_abandoned(prefix);
        self.state.after(&op, || self.location(prefix), res)
    }
}

/// A random nonempty entry, for a bit flip.
fn pick_nonempty(random: u64, lens: impl Iterator<Item = usize>) -> Option<usize> {
    let nonempty: Vec<usize> = lens.enumerate().filter(|(_, n)| *n > 0).map(|(i, _)| i).collect();
    if nonempty.is_empty() {
        return None;
    }
    nonempty.get((splitmix64(random ^ 4) % nonempty.len() as u64) as usize).copied()
}

/// A reader whose every read is an operation of the wrapper.
struct FaultReader<'a> {
    inner: Box<dyn ObjectReader + 'a>,
    state: &'a State,
    location: String,
}

impl ObjectReader for FaultReader<'_> {
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        let op = self.state.begin("read_into");
        self.state.gate(&op, || self.location.clone())?;
        let res = self.inner.read_into(reads);
        self.state.after(&op, || self.location.clone(), res)?;
        if let Some(i) = pick_nonempty(op.random, reads.iter().map(|(_, b)| b.len())) {
            self.state.maybe_flip(&op, reads[i].1, || self.location.clone());
        }
        Ok(())
    }

    /// Read, flipped, then inspected: the caller sees the bytes a flip left in its buffer,
    /// as a store that corrupts them would show it.
    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        crate::read_then_inspect(self, reads, inspect)
    }

    /// Read, flipped, then inspected, as [`ObjectReader::read_into_inspected`].
    fn read_picked_inspected(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        crate::read_then_pick(self, range, picks, inspect)
    }
}

/// A writer whose every call is an operation. Once a fault hits it, the backend's writer is
/// dropped (aborted) and every later call fails.
#[derive(Debug)]
struct FaultWriter {
    inner: Option<Box<dyn ObjectWriter>>,
    state: Arc<State>,
    location: String,
    written: u64,
}

impl FaultWriter {
    fn fail(&mut self, op: &Op, kind: &'static str) -> Error {
        self.inner = None;
        self.state.injected(op, kind, self.location.clone(), false)
    }

    fn inner(&mut self) -> Result<&mut Box<dyn ObjectWriter>> {
        self.inner.as_mut().ok_or_else(|| Error::WriterFailed { path: self.location.clone() })
    }

    fn write_with(&mut self, name: &'static str, data: Bytes) -> Result<()> {
        let op = self.state.begin(name);
        self.inner()?;
        if self.state.fails(&op) {
            return Err(self.fail(&op, "fail"));
        }
        let tear = self.state.config.tear_after_bytes.filter(|&k| self.written + data.len() as u64 > k);
        if let Some(k) = tear {
            let keep = (k - self.written) as usize;
            self.inner()?.write(&data[..keep])?;
            return Err(self.fail(&op, "torn write"));
        }
        self.written += data.len() as u64;
        let res = self.inner()?.write_bytes(data);
        if res.is_err() {
            self.inner = None;
        }
        res
    }
}

impl ObjectWriter for FaultWriter {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.write_with("write", Bytes::copy_from_slice(data))
    }

    fn write_bytes(&mut self, data: Bytes) -> Result<()> {
        self.write_with("write_bytes", data)
    }

    /// One operation, like the call it stands for.
    fn write_vectored(&mut self, bufs: &[&[u8]]) -> Result<()> {
        self.write_with("write_vectored", Bytes::from(bufs.concat()))
    }

    fn finish(mut self: Box<Self>) -> Result<u64> {
        let op = self.state.begin("finish");
        let inner = self.inner.take().ok_or_else(|| Error::WriterFailed { path: self.location.clone() })?;
        if !self.state.fails(&op) {
            return inner.finish();
        }
        if self.state.config.fail_after_effect {
            inner.finish()?;
        }
        Err(self.fail(&op, "fail"))
    }

    fn abort(mut self: Box<Self>) -> Result<()> {
        let op = self.state.begin("abort");
        let inner = self.inner.take();
        if self.state.fails(&op) {
            // The backend's writer is dropped, which aborts it best-effort.
            return Err(self.fail(&op, "fail"));
        }
        inner.map_or(Ok(()), |w| w.abort())
    }
}
