//! Ranged reads: ranges coalesced into spans, one GET each, all pinned to one version of the
//! object, bodies streamed to a sink.

use std::collections::VecDeque;
use std::ops::Range;

use bytes::Bytes;
use futures::StreamExt;
use object_store::{GetOptions, ObjectStore};

use super::S3Storage;
use super::runtime::{map_err, runtime};
use crate::ranges::{Span, coalesce};
use crate::{Error, Result, Storage, check_ranges};

impl S3Storage {
    /// The error for ranges that could not be served: `NotFound`, or `OutOfRange` against the
    /// object's current size.
    fn range_error(&self, path: &str, ranges: &[Range<u64>]) -> Error {
        let loc = self.location(path);
        match self.size(path) {
            Err(e) => e,
            Ok(size) => match check_ranges(&loc, ranges, size) {
                Err(e) => e,
                // In bounds now: the object changed while being read.
                Ok(()) => Error::transient("get_ranges", loc, "object changed during the read"),
            },
        }
    }
}

/// Ranges closer than this are fetched with one GET.
const COALESCE_GAP_BYTES: u64 = 1 << 20;

/// What one ranged GET task reports, in order: the response's ETag and the object's size
/// (from its `Content-Range`), then body chunks.
enum Body {
    Head(Option<String>, u64),
    Chunk(Bytes),
    Failed(Error),
}

/// What the reads of one object have learnt of it: the version they are pinned to, and the
/// length the caller knows it has (then every GET's answer is checked against it).
#[derive(Debug, Default)]
pub(super) struct Pinned {
    pub(super) etag: Option<String>,
    pub(super) len: Option<u64>,
}

impl Pinned {
    /// Takes the version of a GET's answer (unless pinned already) and checks its size.
    fn answer(&mut self, loc: &str, etag: Option<String>, size: u64) -> Result<()> {
        if let Some(expected) = self.len.filter(|&l| l != size) {
            return Err(Error::SizeMismatch { path: loc.to_string(), expected, size });
        }
        if self.etag.is_none() {
            self.etag = etag;
        }
        Ok(())
    }

    /// A failed read of an object of known length that turned out to be shorter is a
    /// mismatch of the length.
    pub(super) fn explain(&self, e: Error) -> Error {
        match (e, self.len) {
            (Error::OutOfRange { path, size, .. }, Some(expected)) if size != expected => {
                Error::SizeMismatch { path, expected, size }
            }
            (e, _) => e,
        }
    }
}

impl S3Storage {
    /// Checks the ranges and groups the nonempty ones into spans, one GET each. Requests with
    /// only empty ranges (or none) still need the object, and an empty range must lie inside
    /// it: those rare cases cost a HEAD, unless the object's length is known.
    pub(super) fn plan_reads(&self, path: &str, ranges: &[Range<u64>], len: Option<u64>) -> Result<Vec<Span>> {
        let loc = self.location(path);
        if let Some(r) = ranges.iter().find(|r| r.start > r.end) {
            return Err(Error::OutOfRange { path: loc, start: r.start, end: r.end, size: 0 });
        }
        if let Some(len) = len {
            check_ranges(&loc, ranges, len)?;
        } else if ranges.iter().all(|r| r.start == r.end) || ranges.iter().any(|r| r.start == r.end && r.start > 0) {
            check_ranges(&loc, ranges, self.size(path)?)?;
        }
        let mut spans = coalesce(ranges, COALESCE_GAP_BYTES);
        spans.retain(|s| s.range.start < s.range.end);
        Ok(spans)
    }

    /// Fetches `spans` with at most `concurrency_max` GETs at once, all pinned (If-Match) to
    /// `pin`'s version, or else to the version the first GET saw (then `pin`'s), and calls
    /// `sink(span index, offset in span, chunk)` with each span's bytes in order. Memory: a
    /// few body chunks per GET in flight.
    pub(super) fn fetch_spans(
        &self,
        path: &str,
        ranges: &[Range<u64>],
        spans: &[Span],
        pin: &mut Pinned,
        mut sink: impl FnMut(usize, u64, &[u8]),
    ) -> Result<()> {
        let key = self.key(path)?;
        let loc = self.location(path);
        let rt = runtime()?;
        let start = |i: usize, etag: Option<String>| {
            self.sent.count(super::requests::Request::Get);
            let (tx, rx) = tokio::sync::mpsc::channel::<Body>(8);
            let (store, key, l, range) = (self.store.clone(), key.clone(), loc.clone(), spans[i].range.clone());
            rt.spawn(async move {
                let opts = GetOptions { range: Some(range.into()), if_match: etag, ..Default::default() };
                let res = match store.get_opts(&key, opts).await {
                    Ok(res) => res,
                    Err(e) => return drop(tx.send(Body::Failed(map_err("get_ranges", &l, e))).await),
                };
                if tx.send(Body::Head(res.meta.e_tag.clone(), res.meta.size)).await.is_err() {
                    return;
                }
                let mut stream = res.into_stream();
                while let Some(chunk) = stream.next().await {
                    let msg = chunk.map_or_else(|e| Body::Failed(map_err("get_ranges", &l, e)), Body::Chunk);
                    let failed = matches!(msg, Body::Failed(_));
                    if tx.send(msg).await.is_err() || failed {
                        return;
                    }
                }
            });
            rx
        };
        let mut pending: VecDeque<(usize, tokio::sync::mpsc::Receiver<Body>)> = VecDeque::new();
        let mut head0_taken = false;
        for i in 0..spans.len() {
            if i == 1 && pin.etag.is_none() {
                // The first reply names the version every later GET must match.
                if let Some((0, rx)) = pending.front_mut() {
                    match recv(rx) {
                        Some(Body::Head(tag, size)) => {
                            pin.answer(&loc, tag, size)?;
                            head0_taken = true;
                        }
                        Some(Body::Failed(e)) => return Err(self.read_error(path, ranges, e)),
                        _ => return Err(Error::permanent("get_ranges", &loc, "GET task ended early")),
                    }
                }
            }
            pending.push_back((i, start(i, pin.etag.clone())));
            if pending.len() >= self.config.concurrency_max
                && let Some((j, mut rx)) = pending.pop_front()
            {
                let head =
                    self.drain(path, ranges, &mut rx, &spans[j], j == 0 && head0_taken, |at, c| sink(j, at, c))?;
                if let Some((tag, size)) = head {
                    pin.answer(&loc, tag, size)?;
                }
            }
        }
        while let Some((j, mut rx)) = pending.pop_front() {
            let head = self.drain(path, ranges, &mut rx, &spans[j], j == 0 && head0_taken, |at, c| sink(j, at, c))?;
            if let Some((tag, size)) = head {
                pin.answer(&loc, tag, size)?;
            }
        }
        Ok(())
    }

    /// Receives one span's body into `sink`; returns the ETag and object size its reply
    /// carried, unless `head_taken` (that reply's head was already read).
    fn drain(
        &self,
        path: &str,
        ranges: &[Range<u64>],
        rx: &mut tokio::sync::mpsc::Receiver<Body>,
        span: &Span,
        head_taken: bool,
        mut sink: impl FnMut(u64, &[u8]),
    ) -> Result<Option<(Option<String>, u64)>> {
        let want = span.range.end - span.range.start;
        let mut got = 0u64;
        let mut head = None;
        let mut head_seen = head_taken;
        while let Some(msg) = recv(rx) {
            match msg {
                Body::Head(t, size) if !head_seen => (head, head_seen) = (Some((t, size)), true),
                Body::Head(..) => {}
                Body::Chunk(c) => {
                    if got + c.len() as u64 > want {
                        return Err(self.range_error(path, ranges));
                    }
                    sink(got, &c);
                    got += c.len() as u64;
                }
                Body::Failed(e) => return Err(self.read_error(path, ranges, e)),
            }
        }
        if got != want {
            return Err(self.range_error(path, ranges));
        }
        Ok(head)
    }

    /// A failed ranged GET: a changed object is transient, a missing one `NotFound`, a bad range
    /// `OutOfRange`, any other refusal the store's own error.
    fn read_error(&self, path: &str, ranges: &[Range<u64>], e: Error) -> Error {
        match e {
            Error::Precondition { path: p, message } => {
                Error::transient("get_ranges", p, format!("object changed during the read: {message}"))
            }
            // Only what a HEAD proves replaces the store's answer: a refused read (403 of an
            // archived object, a key without decrypt rights) is the store's error, not a
            // change to retry.
            Error::Permanent { .. } => match self.size(path) {
                Err(gone @ Error::NotFound { .. }) => gone,
                Ok(size) => check_ranges(&self.location(path), ranges, size).err().unwrap_or(e),
                Err(_) => e,
            },
            other => other,
        }
    }
}

/// Waits for the next message without needing (or disturbing) any runtime on this thread.
fn recv(rx: &mut tokio::sync::mpsc::Receiver<Body>) -> Option<Body> {
    futures::executor::block_on(rx.recv())
}
