//! Bounded retries with exponential backoff for transient errors.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::{ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions};

/// How transient failures are retried: at most `attempts_max` tries in all, sleeping
/// `backoff_initial_ms`, then twice that, ... capped at `backoff_max_ms`, between tries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Total tries, the first included (1 = no retry).
    pub attempts_max: u32,
    /// Sleep before the second try.
    pub backoff_initial_ms: u64,
    /// Upper bound of one sleep.
    pub backoff_max_ms: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { attempts_max: 8, backoff_initial_ms: 50, backoff_max_ms: 5_000 }
    }
}

impl RetryPolicy {
    /// The sleep before try number `attempt` (0-based; 0 sleeps nothing).
    pub fn backoff(&self, attempt: u32) -> Duration {
        if attempt == 0 {
            return Duration::ZERO;
        }
        let factor = 1u64.checked_shl(attempt - 1).unwrap_or(u64::MAX);
        Duration::from_millis(self.backoff_initial_ms.saturating_mul(factor).min(self.backoff_max_ms))
    }

    /// Runs `op` until it succeeds, fails permanently, or `attempts_max` tries are spent.
    pub fn run<T>(&self, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        let attempts = self.attempts_max.max(1);
        let mut attempt = 0;
        loop {
            std::thread::sleep(self.backoff(attempt));
            match op() {
                Err(e) if e.is_transient() && attempt + 1 < attempts => attempt += 1,
                other => return other,
            }
        }
    }
}

/// Retries transient failures of any backend's single-shot operations with a [`RetryPolicy`].
///
/// Writers are passed through: a chunk of a stream is not retried here (the S3 backend
/// retries its part uploads itself). A retried `put_if_absent` whose earlier try landed
/// reports `AlreadyExists`, a retried `put_if_match` `Precondition` (see the crate docs).
#[derive(Debug, Clone)]
pub struct Retrying {
    inner: Arc<dyn Storage>,
    policy: RetryPolicy,
}

impl Retrying {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Storage>, policy: RetryPolicy) -> Self {
        Retrying { inner, policy }
    }
}

impl Storage for Retrying {
    fn location(&self, path: &str) -> String {
        self.inner.location(path)
    }

    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        self.policy.run(|| self.inner.put(path, data.clone()))
    }

    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        self.policy.run(|| self.inner.put_if_absent(path, data.clone()))
    }

    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        self.policy.run(|| self.inner.put_if_match(path, data.clone(), expected))
    }

    fn writer(&self, path: &str, options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        self.policy.run(|| self.inner.writer(path, options))
    }

    fn get(&self, path: &str) -> Result<Bytes> {
        self.policy.run(|| self.inner.get(path))
    }

    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.policy.run(|| self.inner.get_ranges(path, ranges))
    }

    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.policy.run(|| self.inner.read_into(path, reads))
    }

    /// Each read of the reader is retried as `read_into` is.
    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>> {
        let inner = self.policy.run(|| self.inner.reader_sized(path, len))?;
        Ok(Box::new(RetryingReader { inner, policy: &self.policy }))
    }

    fn hints(&self) -> StorageHints {
        self.inner.hints()
    }

    fn prefetch(&self, path: &str, at: u64, len: u64) {
        self.inner.prefetch(path, at, len)
    }

    fn size(&self, path: &str) -> Result<u64> {
        self.policy.run(|| self.inner.size(path))
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.policy.run(|| self.inner.list(prefix))
    }

    fn delete(&self, path: &str) -> Result<()> {
        self.policy.run(|| self.inner.delete(path))
    }

    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.policy.run(|| self.inner.list_abandoned(prefix))
    }

    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.policy.run(|| self.inner.remove_abandoned(prefix))
    }
}

/// A reader whose every read is retried by the policy.
struct RetryingReader<'a> {
    inner: Box<dyn ObjectReader + 'a>,
    policy: &'a RetryPolicy,
}

impl ObjectReader for RetryingReader<'_> {
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.policy.run(|| self.inner.read_into(reads))
    }

    /// Retried as a plain read, then inspected: a retried inspected read would show
    /// `inspect` the bytes again.
    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        crate::read_then_inspect(self, reads, inspect)
    }

    /// Retried as plain reads, then inspected, as [`ObjectReader::read_into_inspected`].
    fn read_picked_inspected(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        crate::read_then_pick(self, range, picks, inspect)
    }
}
