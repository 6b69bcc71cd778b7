//! S3-compatible storage through `object_store`, driven from blocking calls.
//!
//! `config` holds the tuning and builds the client, `runtime` the process-wide runtime the
//! blocking calls wait on, `reads` the ranged reads and `writer` the streaming writes.

mod config;
mod reads;
mod requests;
mod runtime;
mod writer;

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::AmazonS3;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};

pub use config::{PART_BYTES_MIN, S3Config};
use reads::Pinned;
pub use requests::S3Requests;
use requests::{Request, Sent};
use runtime::{block_on, map_err};
pub use writer::ABORT_ON_DROP_WAIT_MS;
use writer::S3Writer;

use crate::{Error, ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions, check_path};

/// Requests a reader of this store keeps in flight at once (its [`StorageHints`]): each
/// waits for a round trip, so a few together keep the connection busy.
const READS_IN_FLIGHT: usize = 4;

/// An S3 bucket prefix (`s3://bucket/prefix`), configured from the usual `AWS_*` environment:
/// `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
/// `AWS_SESSION_TOKEN`, `AWS_ALLOW_HTTP`, ...; where those set no keys or region, the
/// static keys and region of the AWS CLI's profile (`AWS_PROFILE`, else `default`, from
/// `~/.aws/credentials` and `~/.aws/config`); else the instance's role.
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
/// bodies straight into the caller's buffers. A reader of known length
/// ([`Storage::reader_sized`]) sends no HEAD: it checks the size each GET's `Content-Range`
/// gives and pins all its reads to the version of its first.
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
    sent: Arc<Sent>,
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
        if let Some(message) = config.check() {
            return Err(cfg_err(message));
        }
        let store = config.build_store(bucket).map_err(cfg_err)?;
        Ok(S3Storage {
            url: format!("s3://{bucket}/{prefix}"),
            prefix: prefix.to_string(),
            store: Arc::new(store),
            config,
            sent: Arc::default(),
        })
    }

    /// The requests this store (and its writers) sent so far, by kind.
    pub fn requests(&self) -> S3Requests {
        self.sent.snapshot()
    }

    fn key(&self, path: &str) -> Result<StorePath> {
        check_path(path, false)?;
        self.key_unchecked(path)
    }

    /// The key of `path` under the prefix (the prefix itself for `""`), taken literally.
    /// `StorePath::from` would percent-encode `~`, `%`, `#`, non-ASCII and more: such an
    /// object was stored under another key than the one asked for, and listed back under
    /// that one. `check_path` has refused all that `parse` refuses.
    fn key_unchecked(&self, path: &str) -> Result<StorePath> {
        let full = match (self.prefix.is_empty(), path.is_empty()) {
            (_, true) => self.prefix.clone(),
            (true, false) => path.to_string(),
            (false, false) => format!("{}/{path}", self.prefix),
        };
        StorePath::parse(&full).map_err(|e| Error::InvalidPath { path: full, reason: e.to_string().into() })
    }

    /// Strips the storage prefix from a listed key.
    fn relative(&self, key: &StorePath) -> String {
        let key = key.as_ref();
        if self.prefix.is_empty() {
            return key.to_string();
        }
        key.strip_prefix(self.prefix.as_str()).and_then(|k| k.strip_prefix('/')).unwrap_or(key).to_string()
    }

    /// Reads into the caller's buffers, pinned by `pin`: each response body streamed straight
    /// into them, no whole-span copy.
    fn read_pinned(&self, path: &str, reads: &mut [(u64, &mut [u8])], pin: &mut Pinned) -> Result<()> {
        let ranges = crate::read_ranges(&self.location(path), reads)?;
        let spans = self.plan_reads(path, &ranges, pin.len)?;
        let res = self.fetch_spans(path, &ranges, &spans, pin, |i, at, chunk| {
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
        });
        res.map_err(|e| pin.explain(e))
    }
}

/// The reader of an object of known length: every read pinned to the version of its first.
struct S3Reader<'s> {
    storage: &'s S3Storage,
    path: String,
    pin: Pinned,
}

impl ObjectReader for S3Reader<'_> {
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.storage.read_pinned(&self.path, reads, &mut self.pin)
    }

    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        crate::read_then_inspect(self, reads, inspect)
    }

    fn read_picked_inspected(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        crate::read_then_pick(self, range, picks, inspect)
    }
}

impl Storage for S3Storage {
    fn location(&self, path: &str) -> String {
        if self.prefix.is_empty() { format!("{}{path}", self.url) } else { format!("{}/{path}", self.url) }
    }

    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let l = loc.clone();
        self.sent.count(Request::Put);
        block_on(&loc, async move {
            store.put(&key, PutPayload::from(data)).await.map(drop).map_err(|e| map_err("put", &l, e))
        })
    }

    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        let (key, loc) = (self.key(path)?, self.location(path));
        let mut attempt = 0;
        loop {
            let (key, l, store, data) = (key.clone(), loc.clone(), self.store.clone(), data.clone());
            self.sent.count(Request::Put);
            let created = block_on(&loc, async move {
                let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
                store.put_opts(&key, PutPayload::from(data), opts).await.map(drop).map_err(|e| map_err("create", &l, e))
            });
            // `object_store` reports S3's 409 ConditionalRequestConflict (another conditional
            // write of the key in flight: "try again") as AlreadyExists, as it does 412. Taken
            // at its word, a commit that met one deleted its data as if another save had
            // committed; so "exists" is believed only where the object is there.
            let Err(e @ Error::AlreadyExists { .. }) = created else { return created };
            if !matches!(self.size(path), Err(Error::NotFound { .. })) {
                return Err(e);
            }
            attempt += 1;
            if attempt >= self.config.retry.attempts_max {
                let why =
                    format!("the store kept reporting a conflicting write, yet nothing is there ({attempt} tries)");
                return Err(Error::transient("create", loc, why));
            }
            std::thread::sleep(self.config.retry.backoff(attempt));
        }
    }

    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let (k, l, st) = (key.clone(), loc.clone(), store.clone());
        let want = Bytes::copy_from_slice(expected);
        self.sent.count(Request::Get);
        let current = block_on(&loc, async move {
            match st.get(&k).await {
                Ok(res) => {
                    let version = UpdateVersion { e_tag: res.meta.e_tag.clone(), version: res.meta.version.clone() };
                    // Sized before it is read: an object far larger than what is expected
                    // differs from it, and reading it whole could exhaust memory first.
                    if res.meta.size != want.len() as u64 {
                        return Ok(Some((false, version)));
                    }
                    let bytes = res.bytes().await.map_err(|e| map_err("get", &l, e))?;
                    Ok(Some((bytes == want, version)))
                }
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(map_err("get", &l, e)),
            }
        })?;
        let version = match current {
            Some((true, version)) => version,
            other => return Err(crate::not_expected(loc, other.is_some())),
        };
        // Pinned to the version just compared: a write since then fails the precondition.
        let l = loc.clone();
        self.sent.count(Request::Put);
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
        let (key, location) = (self.key(path)?, self.location(path));
        if let Some(n) = options.size_hint_bytes.filter(|&n| n > writer::OBJECT_BYTES_MAX) {
            return Err(Error::permanent("writer", &location, format!("{n} bytes: an S3 object holds at most 5 TiB")));
        }
        let store = (self.store.clone(), self.sent.clone());
        Ok(Box::new(S3Writer::new(key, location, store, &self.config, options.size_hint_bytes)))
    }

    fn get(&self, path: &str) -> Result<Bytes> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let l = loc.clone();
        self.sent.count(Request::Get);
        block_on(&loc, async move {
            let res = store.get(&key).await.map_err(|e| map_err("get", &l, e))?;
            res.bytes().await.map_err(|e| map_err("get", &l, e))
        })
    }

    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        let spans = self.plan_reads(path, ranges, None)?;
        let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(spans.len());
        for span in &spans {
            let n = usize::try_from(span.range.end - span.range.start)
                .map_err(|_| Error::permanent("get_ranges", &self.location(path), "range larger than memory"))?;
            // The object's size is not known yet: reserve at most a little up front, so a range
            // far past the end is an `OutOfRange` error, not a huge allocation.
            bodies.push(Vec::with_capacity(n.min(16 << 20)));
        }
        let pin = &mut Pinned::default();
        self.fetch_spans(path, ranges, &spans, pin, |i, _, chunk| bodies[i].extend_from_slice(chunk))?;
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

    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.read_pinned(path, reads, &mut Pinned::default())
    }

    /// Sends nothing: the first GET's answer carries the object's size and version.
    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>> {
        self.key(path)?;
        let pin = Pinned { etag: None, len: Some(len) };
        Ok(Box::new(S3Reader { storage: self, path: path.to_string(), pin }))
    }

    fn hints(&self) -> StorageHints {
        StorageHints::NONE
            .with_object_bytes_max(Some(self.config.put_bytes_max as u64))
            .with_reads_in_flight(Some(READS_IN_FLIGHT))
    }

    fn prefetch(&self, _path: &str, _at: u64, _len: u64) {}

    fn size(&self, path: &str) -> Result<u64> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let l = loc.clone();
        self.sent.count(Request::Head);
        block_on(&loc, async move { store.head(&key).await.map(|m| m.size).map_err(|e| map_err("head", &l, e)) })
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        check_path(prefix, true)?;
        let loc = self.location(prefix);
        let full = match (self.prefix.is_empty(), prefix.is_empty()) {
            (true, true) => None,
            _ => Some(self.key_unchecked(prefix)?),
        };
        let store = self.store.clone();
        let l = loc.clone();
        self.sent.count(Request::List);
        let metas = block_on(&loc, async move {
            store.list(full.as_ref()).try_collect::<Vec<_>>().await.map_err(|e| map_err("list", &l, e))
        })?;
        // The storage root's own folder marker (the empty `prefix/` object a console's "create
        // folder" makes) is no object under it: listed, it was taken for a stray file.
        let root_marker = |m: &&object_store::ObjectMeta| !self.prefix.is_empty() && m.location.as_ref() == self.prefix;
        let mut out: Vec<ObjectInfo> = metas
            .iter()
            .filter(|m| !root_marker(m))
            .map(|m| ObjectInfo { path: self.relative(&m.location), size: m.size })
            .collect();
        drop_folder_markers(&mut out);
        // S3 lists below `prefix/`: the object named `prefix` itself, which the listing
        // covers (as on every other backend), is asked for on its own.
        if !prefix.is_empty() {
            match self.size(prefix) {
                Ok(size) => out.push(ObjectInfo { path: prefix.to_string(), size }),
                Err(Error::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    fn delete(&self, path: &str) -> Result<()> {
        let (key, loc, store) = (self.key(path)?, self.location(path), self.store.clone());
        let l = loc.clone();
        self.sent.count(Request::Delete);
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

/// Drops the empty objects that name a folder of other listed objects: the `dir/` markers a
/// console's "create folder" leaves, which the store hands back without their slash, as
/// `dir`. No backend has an object and a folder of one name otherwise.
fn drop_folder_markers(out: &mut Vec<ObjectInfo>) {
    if !out.iter().any(|o| o.size == 0) {
        return;
    }
    let folders: std::collections::HashSet<&str> =
        out.iter().flat_map(|o| o.path.match_indices('/').map(|(at, _)| &o.path[..at])).collect();
    let markers: std::collections::HashSet<String> =
        out.iter().filter(|o| o.size == 0 && folders.contains(o.path.as_str())).map(|o| o.path.clone()).collect();
    out.retain(|o| !markers.contains(&o.path));
}
