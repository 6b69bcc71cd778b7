//! S3-compatible storage through `object_store`, driven from blocking calls.

use std::collections::VecDeque;
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as StorePath;
use object_store::{
    BackoffConfig, GetOptions, MultipartUpload, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    RetryConfig, UpdateVersion,
};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::ranges::{Span, coalesce};
use crate::{
    Error, ObjectInfo, ObjectWriter, Result, RetryPolicy, Storage, StorageHints, WriterOptions, check_path,
    check_ranges,
};

/// The smallest part S3 accepts (all parts but the last).
pub const PART_BYTES_MIN: usize = 5 << 20;

/// Tuning of [`S3Storage`].
#[derive(Debug, Clone)]
pub struct S3Config {
    /// Size of one multipart part; at least 5 MiB. A writer holds at most
    /// `concurrency_max + 1` parts in memory. S3 allows 10,000 parts per object, so a writer
    /// whose size hint needs more uses bigger parts; without a hint the limit is
    /// `10_000 * part_bytes` bytes.
    pub part_bytes: usize,
    /// Parts uploaded at once by one writer.
    pub concurrency_max: usize,
    /// A writer whose size hint is at most this buffers the whole object and sends one PUT
    /// (no multipart upload to assemble); [`StorageHints::object_bytes_max`] reports it, so that
    /// callers that can split their output keep objects within it. At least `part_bytes`.
    pub put_bytes_max: usize,
    /// Retries of transient HTTP failures (5xx, 429, timeouts, connection errors), done by
    /// `object_store` for each request.
    pub retry: RetryPolicy,
    /// Timeout of one HTTP request.
    pub request_timeout_ms: u64,
    /// Extra `object_store` S3 settings applied after the `AWS_*` environment, as
    /// `(key, value)` with the keys `object_store` knows (`aws_endpoint`, `aws_region`,
    /// `aws_access_key_id`, `aws_allow_http`, ...). Lets a caller configure a store without
    /// touching the process environment.
    pub options: Vec<(String, String)>,
}

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            part_bytes: 16 << 20,
            concurrency_max: 8,
            put_bytes_max: 64 << 20,
            retry: RetryPolicy::default(),
            request_timeout_ms: 60_000,
            options: Vec::new(),
        }
    }
}

/// An S3 bucket prefix (`s3://bucket/prefix`), configured from the usual `AWS_*` environment:
/// `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
/// `AWS_SESSION_TOKEN`, `AWS_ALLOW_HTTP`, ...
///
/// Puts are single PUT requests (S3 caps those at 5 GiB: stream bigger objects through a
/// writer); conditional create is a PUT with `If-None-Match: *`; conditional replace reads
/// the object and its ETag, compares, and sends a PUT with `If-Match: <ETag>`;
/// streaming writers buffer one part and switch to a multipart upload once more than one part
/// is written (so small objects are one PUT), uploading up to `concurrency_max` parts at once;
/// a writer whose size hint is within `put_bytes_max` buffers it all and sends one PUT.
/// An unfinished multipart upload is aborted by `abort`, by a `finish` that fails, and on
/// drop (which waits up to [`ABORT_ON_DROP_WAIT_MS`] for S3's answer, so that a process that
/// exits right after a failed save does not leave its parts behind).
///
/// What a killed process left open (`kill -9`, a lost node) no writer is left to abort, and
/// [`Storage::list_abandoned`] cannot tell from a live upload. Abandoned parts are stored and
/// billed until aborted, and listing the bucket never shows them; give the bucket a lifecycle
/// rule that aborts incomplete multipart uploads after a day (longer than any save):
///
/// ```json
/// {"Rules": [{"ID": "abort-incomplete-uploads", "Status": "Enabled", "Filter": {"Prefix": ""},
///   "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}}]}
/// ```
///
/// (`aws s3api put-bucket-lifecycle-configuration --bucket BUCKET --lifecycle-configuration
/// file://rule.json`; `aws s3api list-multipart-uploads --bucket BUCKET` shows what is open.)
/// Ranged reads coalesce ranges less than 1 MiB apart, run up to `concurrency_max` GETs at once
/// pinned by `If-Match` to the version the first GET saw (so all ranges come from one
/// version; a concurrent overwrite gives a transient error), and `read_into` streams the
/// bodies straight into the caller's buffers.
///
/// Calls block the calling thread while a process-wide tokio runtime (started on first use)
/// does the IO, so this type may be used from plain threads and from inside other tokio
/// runtimes alike.
#[derive(Debug)]
pub struct S3Storage {
    url: String,
    prefix: String,
    store: Arc<AmazonS3>,
    config: S3Config,
}

impl S3Storage {
    /// Opens `s3://bucket/prefix` with the `AWS_*` environment.
    pub fn from_url(url: &str, config: S3Config) -> Result<Self> {
        let cfg_err = |message: String| Error::Config { url: url.to_string(), message };
        let rest = url.strip_prefix("s3://").ok_or_else(|| cfg_err("expected s3://bucket/prefix".into()))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_end_matches('/');
        if bucket.is_empty() {
            return Err(cfg_err("missing bucket name".into()));
        }
        check_path(prefix, true).map_err(|e| cfg_err(e.to_string()))?;
        if config.part_bytes < PART_BYTES_MIN || config.concurrency_max == 0 || config.put_bytes_max < config.part_bytes
        {
            return Err(cfg_err(format!(
                "part_bytes must be at least {PART_BYTES_MIN}, concurrency_max at least 1 and put_bytes_max at least \
                 part_bytes (got {}, {} and {})",
                config.part_bytes, config.concurrency_max, config.put_bytes_max
            )));
        }
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(config.retry.backoff_initial_ms),
                max_backoff: Duration::from_millis(config.retry.backoff_max_ms),
                base: 2.0,
            },
            max_retries: config.retry.attempts_max.saturating_sub(1) as usize,
            retry_timeout: Duration::from_secs(180),
        };
        let client =
            object_store::ClientOptions::new().with_timeout(Duration::from_millis(config.request_timeout_ms.max(1)));
        // Like `AmazonS3Builder::from_env`, but on top of our client options (the builder's
        // `with_client_options` would drop env settings such as AWS_ALLOW_HTTP).
        let mut builder = AmazonS3Builder::new().with_client_options(client).with_retry(retry);
        for (key, value) in std::env::vars_os() {
            let (Some(key), Some(value)) = (key.to_str(), value.to_str()) else { continue };
            if !key.starts_with("AWS_") {
                continue;
            }
            if let Ok(config_key) = key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                builder = builder.with_config(config_key, value);
            }
        }
        for (key, value) in &config.options {
            let config_key = key
                .to_ascii_lowercase()
                .parse::<AmazonS3ConfigKey>()
                .map_err(|e| cfg_err(format!("unknown S3 option {key:?}: {e}")))?;
            builder = builder.with_config(config_key, value);
        }
        let store = builder.with_bucket_name(bucket).build().map_err(|e| cfg_err(e.to_string()))?;
        Ok(S3Storage {
            url: format!("s3://{bucket}/{prefix}"),
            prefix: prefix.to_string(),
            store: Arc::new(store),
            config,
        })
    }

    fn key(&self, path: &str) -> Result<StorePath> {
        check_path(path, false)?;
        Ok(self.key_unchecked(path))
    }

    fn key_unchecked(&self, path: &str) -> StorePath {
        let full = if self.prefix.is_empty() { path.to_string() } else { format!("{}/{path}", self.prefix) };
        StorePath::from(full.as_str())
    }

    /// Strips the storage prefix from a listed key.
    fn relative(&self, key: &StorePath) -> String {
        let key = key.as_ref();
        if self.prefix.is_empty() {
            return key.to_string();
        }
        key.strip_prefix(self.prefix.as_str()).and_then(|k| k.strip_prefix('/')).unwrap_or(key).to_string()
    }
}

/// The name of the runtime's threads.
const RUNTIME_THREAD: &str = "dckpt-s3";

/// The runtime that runs every S3 request, one per process. A forked child (a DataLoader
/// worker, a checkpoint writer forked from a trainer) inherits the parent's runtime without
/// its worker threads, where every request would hang, so a child builds its own. Never
/// dropped (an inherited one is leaked), so no drop can happen inside an async context; an
/// atomic rather than a lock, since a lock held by another thread at the fork would never
/// be released in the child.
fn runtime() -> Result<&'static Runtime> {
    static RT: AtomicPtr<(u32, Runtime)> = AtomicPtr::new(std::ptr::null_mut());
    let pid = std::process::id();
    loop {
        let current = RT.load(Ordering::Acquire);
        // SAFETY: every pointer stored in RT comes from `Box::into_raw` and is never freed.
        if let Some((owner, rt)) = unsafe { current.as_ref() }
            && *owner == pid
        {
            return Ok(rt);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name(RUNTIME_THREAD)
            .enable_all()
            .build()
            .map_err(|e| Error::Config { url: "s3://".into(), message: format!("cannot start the IO runtime: {e}") })?;
        let fresh = Box::into_raw(Box::new((pid, rt)));
        if RT.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire).is_err() {
            // Another thread installed one first: use that. Ours was never shared, and
            // shutting it down in the background is allowed in an async context.
            // SAFETY: `fresh` came from `Box::into_raw` above and was not published.
            unsafe { Box::from_raw(fresh) }.1.shutdown_background();
        }
    }
}

/// Runs `fut` on the runtime and blocks this thread until it is done. Spawning (rather than
/// `Runtime::block_on`) keeps this safe when the caller is itself inside a tokio runtime.
fn block_on<T: Send + 'static>(location: &str, fut: impl Future<Output = Result<T>> + Send + 'static) -> Result<T> {
    let handle = runtime()?.spawn(fut);
    join(location, handle)
}

fn join<T>(location: &str, handle: JoinHandle<Result<T>>) -> Result<T> {
    futures::executor::block_on(handle)
        .map_err(|e| Error::permanent("s3 request", location, format!("IO task failed: {e}")))?
}

/// Maps an `object_store` error on `location`.
fn map_err(op: &'static str, location: &str, e: object_store::Error) -> Error {
    let (path, op) = (location.to_string(), op.into());
    match e {
        object_store::Error::NotFound { .. } => Error::NotFound { path },
        object_store::Error::AlreadyExists { .. } => Error::AlreadyExists { path },
        object_store::Error::Precondition { source, .. } | object_store::Error::NotModified { source, .. } => {
            Error::Precondition { path, message: source.to_string() }
        }
        object_store::Error::Generic { .. } if is_transient(&e) => Error::Transient { path, op, source: Box::new(e) },
        other => Error::Permanent { path, op, source: Box::new(other) },
    }
}

/// `object_store` already retried the request; what is left is transient unless the server
/// answered with a client error (4xx other than 408 / 429). Its status is only visible in the
/// message, so this reads the message.
fn is_transient(e: &object_store::Error) -> bool {
    let text = e.to_string();
    let client_error = text
        .split("status code: ")
        .nth(1)
        .and_then(|s| s.get(..3))
        .is_some_and(|code| code.starts_with('4') && code != "408" && code != "429");
    !client_error
}

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

/// What one ranged GET task reports, in order: the response's ETag, then body chunks.
enum Body {
    Head(Option<String>),
    Chunk(Bytes),
    Failed(Error),
}

impl S3Storage {
    /// Checks the ranges and groups the nonempty ones into spans, one GET each. Requests with
    /// only empty ranges (or none) still need the object, and an empty range must lie inside
    /// it: those rare cases cost a HEAD.
    fn plan_reads(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Span>> {
        let loc = self.location(path);
        if let Some(r) = ranges.iter().find(|r| r.start > r.end) {
            return Err(Error::OutOfRange { path: loc, start: r.start, end: r.end, size: 0 });
        }
        if ranges.iter().all(|r| r.start == r.end) || ranges.iter().any(|r| r.start == r.end && r.start > 0) {
            check_ranges(&loc, ranges, self.size(path)?)?;
        }
        let mut spans = coalesce(ranges, COALESCE_GAP_BYTES);
        spans.retain(|s| s.range.start < s.range.end);
        Ok(spans)
    }

    /// Fetches `spans` with at most `concurrency_max` GETs at once, all pinned (If-Match) to the
    /// version the first GET saw, and calls `sink(span index, offset in span, chunk)` with each
    /// span's bytes in order. Memory: a few body chunks per GET in flight.
    fn fetch_spans(
        &self,
        path: &str,
        ranges: &[Range<u64>],
        spans: &[Span],
        mut sink: impl FnMut(usize, u64, &[u8]),
    ) -> Result<()> {
        let key = self.key(path)?;
        let loc = self.location(path);
        let rt = runtime()?;
        let start = |i: usize, etag: Option<String>| {
            let (tx, rx) = tokio::sync::mpsc::channel::<Body>(8);
            let (store, key, l, range) = (self.store.clone(), key.clone(), loc.clone(), spans[i].range.clone());
            rt.spawn(async move {
                let opts = GetOptions { range: Some(range.into()), if_match: etag, ..Default::default() };
                let res = match store.get_opts(&key, opts).await {
                    Ok(res) => res,
                    Err(e) => return drop(tx.send(Body::Failed(map_err("get_ranges", &l, e))).await),
                };
                if tx.send(Body::Head(res.meta.e_tag.clone())).await.is_err() {
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
        let mut etag: Option<String> = None;
        let mut head0_taken = false;
        for i in 0..spans.len() {
            if i == 1 {
                // The first reply names the version every later GET must match.
                if let Some((0, rx)) = pending.front_mut() {
                    match recv(rx) {
                        Some(Body::Head(tag)) => (etag, head0_taken) = (tag, true),
                        Some(Body::Failed(e)) => return Err(self.read_error(path, ranges, e)),
                        _ => return Err(Error::permanent("get_ranges", &loc, "GET task ended early")),
                    }
                }
            }
            pending.push_back((i, start(i, etag.clone())));
            if pending.len() >= self.config.concurrency_max
                && let Some((j, mut rx)) = pending.pop_front()
            {
                let tag =
                    self.drain(path, ranges, &mut rx, &spans[j], j == 0 && head0_taken, |at, c| sink(j, at, c))?;
                if j == 0 && !head0_taken {
                    etag = tag;
                }
            }
        }
        while let Some((j, mut rx)) = pending.pop_front() {
            self.drain(path, ranges, &mut rx, &spans[j], j == 0 && head0_taken, |at, c| sink(j, at, c))?;
        }
        Ok(())
    }

    /// Receives one span's body into `sink`; returns the ETag its reply carried.
    /// `head_taken` when that reply's head was already read.
    fn drain(
        &self,
        path: &str,
        ranges: &[Range<u64>],
        rx: &mut tokio::sync::mpsc::Receiver<Body>,
        span: &Span,
        head_taken: bool,
        mut sink: impl FnMut(u64, &[u8]),
    ) -> Result<Option<String>> {
        let want = span.range.end - span.range.start;
        let mut got = 0u64;
        let mut tag = None;
        let mut head_seen = head_taken;
        while let Some(msg) = recv(rx) {
            match msg {
                Body::Head(t) if !head_seen => (tag, head_seen) = (t, true),
                Body::Head(_) => {}
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
        Ok(tag)
    }

    /// A failed ranged GET: a changed object is transient, a missing one `NotFound`, a bad range
    /// `OutOfRange`.
    fn read_error(&self, path: &str, ranges: &[Range<u64>], e: Error) -> Error {
        match e {
            Error::Precondition { path: p, message } => {
                Error::transient("get_ranges", p, format!("object changed during the read: {message}"))
            }
            Error::Permanent { .. } => self.range_error(path, ranges),
            other => other,
        }
    }
}

/// Waits for the next message without needing (or disturbing) any runtime on this thread.
fn recv(rx: &mut tokio::sync::mpsc::Receiver<Body>) -> Option<Body> {
    futures::executor::block_on(rx.recv())
}

impl Storage for S3Storage {
    fn location(&self, path: &str) -> String {
        if self.prefix.is_empty() { format!("{}{path}", self.url) } else { format!("{}/{path}", self.url) }
    }

    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let l = loc.clone();
        block_on(&loc, async move {
            store.put(&key, PutPayload::from(data)).await.map(drop).map_err(|e| map_err("put", &l, e))
        })
    }

    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let l = loc.clone();
        block_on(&loc, async move {
            let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
            store.put_opts(&key, PutPayload::from(data), opts).await.map(drop).map_err(|e| map_err("create", &l, e))
        })
    }

    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let (k, l, st) = (key.clone(), loc.clone(), store.clone());
        let current = block_on(&loc, async move {
            match st.get(&k).await {
                Ok(res) => {
                    let version = UpdateVersion { e_tag: res.meta.e_tag.clone(), version: res.meta.version.clone() };
                    let bytes = res.bytes().await.map_err(|e| map_err("get", &l, e))?;
                    Ok(Some((bytes, version)))
                }
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(map_err("get", &l, e)),
            }
        })?;
        let version = match current {
            Some((bytes, version)) if bytes[..] == *expected => version,
            other => return Err(crate::not_expected(loc, other.is_some())),
        };
        // Pinned to the version just compared: a write since then fails the precondition.
        let l = loc.clone();
        block_on(&loc, async move {
            let opts = PutOptions { mode: PutMode::Update(version), ..Default::default() };
            match store.put_opts(&key, PutPayload::from(data), opts).await {
                Ok(_) => Ok(()),
                // S3 answers a missing object with 404 to `If-Match`.
                Err(object_store::Error::NotFound { .. }) => Err(crate::not_expected(l, false)),
                Err(e) => Err(map_err("replace", &l, e)),
            }
        })
    }

    fn writer(&self, path: &str, options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        Ok(Box::new(S3Writer {
            key: self.key(path)?,
            location: self.location(path),
            store: self.store.clone(),
            part_bytes: part_bytes_for(&self.config, options.size_hint_bytes),
            concurrency_max: self.config.concurrency_max,
            size_hint: options.size_hint_bytes,
            buf: Vec::new(),
            total: 0,
            upload: None,
            inflight: VecDeque::new(),
            failed: false,
            done: false,
        }))
    }

    fn get(&self, path: &str) -> Result<Bytes> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let l = loc.clone();
        block_on(&loc, async move {
            let res = store.get(&key).await.map_err(|e| map_err("get", &l, e))?;
            res.bytes().await.map_err(|e| map_err("get", &l, e))
        })
    }

    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        let spans = self.plan_reads(path, ranges)?;
        let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(spans.len());
        for span in &spans {
            let n = usize::try_from(span.range.end - span.range.start)
                .map_err(|_| Error::permanent("get_ranges", &self.location(path), "range larger than memory"))?;
            // The object's size is not known yet: reserve at most a little up front, so a range
            // far past the end is an `OutOfRange` error, not a huge allocation.
            bodies.push(Vec::with_capacity(n.min(16 << 20)));
        }
        self.fetch_spans(path, ranges, &spans, |i, _, chunk| bodies[i].extend_from_slice(chunk))?;
        let mut out = vec![Bytes::new(); ranges.len()];
        for (span, body) in spans.iter().zip(bodies) {
            let body = Bytes::from(body);
            for &m in &span.members {
                let r = &ranges[m];
                out[m] = body.slice((r.start - span.range.start) as usize..(r.end - span.range.start) as usize);
            }
        }
        Ok(out)
    }

    /// Streams each response body straight into the caller's buffers: no whole-span copy.
    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        let ranges = crate::read_ranges(&self.location(path), reads)?;
        let spans = self.plan_reads(path, &ranges)?;
        self.fetch_spans(path, &ranges, &spans, |i, at, chunk| {
            let span = &spans[i];
            let (lo, hi) = (span.range.start + at, span.range.start + at + chunk.len() as u64);
            for &m in &span.members {
                let r = &ranges[m];
                let (a, b) = (r.start.max(lo), r.end.min(hi));
                if a < b {
                    reads[m].1[(a - r.start) as usize..(b - r.start) as usize]
                        .copy_from_slice(&chunk[(a - lo) as usize..(b - lo) as usize]);
                }
            }
        })
    }

    fn hints(&self) -> StorageHints {
        StorageHints::NONE.with_object_bytes_max(Some(self.config.put_bytes_max as u64))
    }

    fn prefetch(&self, _path: &str, _at: u64, _len: u64) {}

    fn size(&self, path: &str) -> Result<u64> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let l = loc.clone();
        block_on(&loc, async move { store.head(&key).await.map(|m| m.size).map_err(|e| map_err("head", &l, e)) })
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        check_path(prefix, true)?;
        let loc = self.location(prefix);
        let full = match (self.prefix.is_empty(), prefix.is_empty()) {
            (true, true) => None,
            (false, true) => Some(StorePath::from(self.prefix.as_str())),
            _ => Some(self.key_unchecked(prefix)),
        };
        let store = self.store.clone();
        let l = loc.clone();
        let metas = block_on(&loc, async move {
            store.list(full.as_ref()).try_collect::<Vec<_>>().await.map_err(|e| map_err("list", &l, e))
        })?;
        let mut out: Vec<ObjectInfo> =
            metas.iter().map(|m| ObjectInfo { path: self.relative(&m.location), size: m.size }).collect();
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    fn delete(&self, path: &str) -> Result<()> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let l = loc.clone();
        block_on(&loc, async move {
            match store.delete(&key).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(map_err("delete", &l, e)),
            }
        })
    }

    /// None: S3 cannot tell an upload a live writer is sending from one a dead process left
    /// (an upload has no owner to ask, and an age long enough for every live writer would
    /// keep a killed save's parts that long anyway). The bucket's lifecycle rule aborts them;
    /// see [`S3Storage`].
    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        check_path(prefix, true)?;
        Ok(Vec::new())
    }

    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.list_abandoned(prefix)
    }
}

/// S3 allows at most this many parts in one upload.
const PARTS_MAX: u64 = 10_000;

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
struct S3Writer {
    key: StorePath,
    location: String,
    store: Arc<AmazonS3>,
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
    fn start_upload(&mut self) -> Result<()> {
        if self.upload.is_some() {
            return Ok(());
        }
        let (store, key, l) = (self.store.clone(), self.key.clone(), self.location.clone());
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
