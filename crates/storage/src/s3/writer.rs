//! Streaming writes: one part buffered, a multipart upload once there is more than one part.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::aws::AmazonS3;
use object_store::path::Path as StorePath;
use object_store::{MultipartUpload, ObjectStoreExt, PutPayload};
use tokio::task::JoinHandle;

use super::S3Config;
use super::requests::{Request, Sent};
use super::runtime::{RUNTIME_THREAD, block_on, join, map_err, runtime};
use crate::{Error, ObjectWriter, Result};

/// S3 allows at most this many parts in one upload.
const PARTS_MAX: u64 = 10_000;
/// S3's largest object: a writer told of more is refused before it buffers anything (a part
/// sized for it would be an allocation that aborts the process).
pub(super) const OBJECT_BYTES_MAX: u64 = 5 << 40;

/// How long dropping an unfinished writer waits for S3 to confirm that its upload is aborted
/// (one request; longer only when S3 is in trouble, and then a drop should not hang on it).
pub const ABORT_ON_DROP_WAIT_MS: u64 = 10_000;

/// The part a writer buffers: the whole object when its size hint is within `put_bytes_max`
/// (one PUT), else the configured part size, grown (in whole MiB) when the size hint says the
/// object would otherwise need more than [`PARTS_MAX`] parts.
fn part_bytes_for(config: &S3Config, size_hint_bytes: Option<u64>) -> usize {
    let configured = config.part_bytes;
    match size_hint_bytes.map(|n| usize::try_from(n).unwrap_or(usize::MAX)) {
        Some(n) if n <= config.put_bytes_max => configured.max(n),
        _ => {
            let needed = size_hint_bytes.unwrap_or(0).div_ceil(PARTS_MAX).next_multiple_of(1 << 20);
            configured.max(usize::try_from(needed).unwrap_or(usize::MAX))
        }
    }
}

/// A streaming write: one part buffered, up to `concurrency_max` parts uploading.
pub(super) struct S3Writer {
    key: StorePath,
    location: String,
    store: Arc<AmazonS3>,
    sent: Arc<Sent>,
    part_bytes: usize,
    concurrency_max: usize,
    size_hint: Option<u64>,
    buf: Vec<u8>,
    total: u64,
    upload: Option<Box<dyn MultipartUpload>>,
    inflight: VecDeque<JoinHandle<Result<()>>>,
    failed: bool,
    done: bool,
}

impl std::fmt::Debug for S3Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Writer").field("location", &self.location).field("total", &self.total).finish()
    }
}

impl S3Writer {
    /// A writer of `key` that has sent nothing yet.
    pub(super) fn new(
        key: StorePath,
        location: String,
        (store, sent): (Arc<AmazonS3>, Arc<Sent>),
        config: &S3Config,
        size_hint: Option<u64>,
    ) -> Self {
        S3Writer {
            key,
            location,
            store,
            sent,
            part_bytes: part_bytes_for(config, size_hint),
            concurrency_max: config.concurrency_max,
            size_hint,
            buf: Vec::new(),
            total: 0,
            upload: None,
            inflight: VecDeque::new(),
            failed: false,
            done: false,
        }
    }

    fn start_upload(&mut self) -> Result<()> {
        if self.upload.is_some() {
            return Ok(());
        }
        let (store, key, l) = (self.store.clone(), self.key.clone(), self.location.clone());
        self.sent.count(Request::Multipart);
        let upload = block_on(&self.location, async move {
            store.put_multipart(&key).await.map_err(|e| map_err("start multipart", &l, e))
        })?;
        self.upload = Some(upload);
        Ok(())
    }

    /// Uploads `part`, first waiting for the oldest part while `concurrency_max` are in flight.
    fn send_part(&mut self, part: Bytes) -> Result<()> {
        self.start_upload()?;
        while self.inflight.len() >= self.concurrency_max {
            self.wait_oldest()?;
        }
        let rt = runtime()?;
        let upload = self.upload.as_mut().ok_or_else(|| Error::WriterFailed { path: self.location.clone() })?;
        self.sent.count(Request::Multipart);
        let fut = upload.put_part(PutPayload::from(part));
        let l = self.location.clone();
        self.inflight.push_back(rt.spawn(async move { fut.await.map_err(|e| map_err("put part", &l, e)) }));
        Ok(())
    }

    fn wait_oldest(&mut self) -> Result<()> {
        match self.inflight.pop_front() {
            Some(h) => join(&self.location, h),
            None => Ok(()),
        }
    }

    fn append(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            if self.buf.len() == self.part_bytes {
                // A full part with more to come: the object is multipart. (A full part with
                // nothing after it stays buffered, so an object of one part is one PUT.)
                let part = Bytes::from(std::mem::take(&mut self.buf));
                self.send_part(part)?;
            }
            if self.buf.capacity() == 0 {
                // What the size hint says is left, if less than a part (a small object).
                let left = self.size_hint.map_or(u64::MAX, |n| n.saturating_sub(self.total).max(1));
                self.buf = Vec::with_capacity(self.part_bytes.min(usize::try_from(left).unwrap_or(usize::MAX)));
            }
            let room = self.part_bytes - self.buf.len();
            let (now, rest) = data.split_at(room.min(data.len()));
            self.buf.extend_from_slice(now);
            self.total += now.len() as u64;
            data = rest;
        }
        Ok(())
    }

    fn complete(&mut self) -> Result<u64> {
        let tail = Bytes::from(std::mem::take(&mut self.buf));
        if self.upload.is_none() {
            let (store, key, l) = (self.store.clone(), self.key.clone(), self.location.clone());
            self.sent.count(Request::Put);
            block_on(&self.location, async move {
                store.put(&key, PutPayload::from(tail)).await.map(drop).map_err(|e| map_err("put", &l, e))
            })?;
            return Ok(self.total);
        }
        if !tail.is_empty() {
            self.send_part(tail)?;
        }
        while !self.inflight.is_empty() {
            self.wait_oldest()?;
        }
        let mut upload = self.upload.take().ok_or_else(|| Error::WriterFailed { path: self.location.clone() })?;
        let l = self.location.clone();
        self.sent.count(Request::Multipart);
        let res = block_on(&self.location, async move {
            match upload.complete().await {
                Ok(_) => Ok(()),
                Err(e) => {
                    let _ = upload.abort().await;
                    Err(map_err("complete multipart", &l, e))
                }
            }
        });
        res.map(|()| self.total)
    }

    /// Stops in-flight parts and aborts the multipart upload, waiting up to `wait_ms` for S3's
    /// answer (`None`: as long as the request takes).
    fn cleanup(&mut self, wait_ms: Option<u64>) -> Result<()> {
        self.done = true;
        for h in self.inflight.drain(..) {
            h.abort();
        }
        let Some(mut upload) = self.upload.take() else { return Ok(()) };
        self.sent.count(Request::Multipart);
        let l = self.location.clone();
        let fut = async move { upload.abort().await.map_err(|e| map_err("abort multipart", &l, e)) };
        let Some(ms) = wait_ms else { return block_on(&self.location, fut) };
        // On one of the runtime's own threads, waiting for the runtime could starve it:
        // the abort then runs on without us (the runtime lives as long as the process).
        if std::thread::current().name() == Some(RUNTIME_THREAD) {
            runtime()?.spawn(fut);
            return Ok(());
        }
        let l = self.location.clone();
        block_on(&self.location, async move {
            tokio::time::timeout(Duration::from_millis(ms), fut).await.unwrap_or_else(|_| {
                Err(Error::permanent(
                    "abort multipart",
                    &l,
                    format!("no answer within {ms} ms; the upload may stay open"),
                ))
            })
        })
    }

    fn guarded<T>(&mut self, res: Result<T>) -> Result<T> {
        if res.is_err() {
            self.failed = true;
        }
        res
    }
}

impl ObjectWriter for S3Writer {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        if self.failed {
            return Err(Error::WriterFailed { path: self.location.clone() });
        }
        let res = self.append(data);
        self.guarded(res)
    }

    fn write_bytes(&mut self, data: Bytes) -> Result<()> {
        if self.failed {
            return Err(Error::WriterFailed { path: self.location.clone() });
        }
        // A whole part with nothing buffered is sent without copying, once the upload is
        // known to be multipart (something already sent).
        if self.buf.is_empty() && data.len() == self.part_bytes && self.upload.is_some() {
            self.total += data.len() as u64;
            let res = self.send_part(data);
            return self.guarded(res);
        }
        let res = self.append(&data);
        self.guarded(res)
    }

    fn finish(mut self: Box<Self>) -> Result<u64> {
        if self.failed {
            let _ = self.cleanup(None);
            return Err(Error::WriterFailed { path: self.location.clone() });
        }
        match self.complete() {
            Ok(n) => {
                self.done = true;
                Ok(n)
            }
            Err(e) => {
                let _ = self.cleanup(None);
                Err(e)
            }
        }
    }

    fn abort(mut self: Box<Self>) -> Result<()> {
        self.cleanup(None)
    }
}

impl Drop for S3Writer {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cleanup(Some(ABORT_ON_DROP_WAIT_MS));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_size_grows_only_past_ten_thousand_parts() {
        let mib = 1usize << 20;
        let config = |part_bytes| S3Config { part_bytes, put_bytes_max: 64 * mib, ..Default::default() };
        let c16 = config(16 * mib);
        assert_eq!(part_bytes_for(&c16, None), 16 * mib);
        assert_eq!(part_bytes_for(&c16, Some(1 << 30)), 16 * mib);
        assert_eq!(part_bytes_for(&c16, Some(10_000 * 16 * mib as u64)), 16 * mib);
        assert_eq!(part_bytes_for(&c16, Some(10_000 * 16 * mib as u64 + 1)), 17 * mib);
        assert!(part_bytes_for(&config(5 * mib), Some(u64::MAX)) as u64 >= u64::MAX / 10_000);
    }

    #[test]
    fn an_object_within_put_bytes_max_is_one_part() {
        let mib = 1usize << 20;
        let c = S3Config { part_bytes: 16 * mib, put_bytes_max: 64 * mib, ..Default::default() };
        assert_eq!(part_bytes_for(&c, Some(3)), 16 * mib);
        assert_eq!(part_bytes_for(&c, Some(40 * mib as u64)), 40 * mib);
        assert_eq!(part_bytes_for(&c, Some(64 * mib as u64)), 64 * mib);
        assert_eq!(part_bytes_for(&c, Some(64 * mib as u64 + 1)), 16 * mib);
    }
}
