//! `dckpt bench storage`: throughput of the storage backends alone, as ratios to plain IO
//! of the same bytes in the same run.
//!
//! Numbers are medians over `runs` rounds; each round measures both sides, and which side goes
//! first alternates, so that drifting disk or cache state hits both sides alike. Reads follow the writes of the same
//! round and therefore come mostly from the page cache, for both sides alike. Nothing is
//! printed; the caller serializes the report.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use bytes::Bytes;
use dckpt::storage::{LocalStorage, S3Config, S3Storage, Storage, WriterOptions};
use serde::Serialize;

/// Size of the chunks handed to writers and readers.
pub const CHUNK_BYTES: usize = 8 << 20;

/// One measured pair: the plain baseline and the storage path, in MiB/s, and their ratio.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub baseline: &'static str,
    pub baseline_mib_s: f64,
    pub storage: &'static str,
    pub storage_mib_s: f64,
    /// `storage_mib_s / baseline_mib_s`.
    pub ratio: f64,
}

/// The result of [`bench_local`] or [`bench_s3`].
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub target: String,
    pub bytes: u64,
    pub runs: usize,
    pub write: Comparison,
    pub read: Comparison,
}

/// Streams `bytes` through a [`LocalStorage`] writer in `dir` (8 MiB `write` calls, `finish`)
/// against a plain sequential `write_all` + `fsync` of the same bytes; then reads them with
/// `read_into` (8 MiB) against a plain sequential `read`. Median of `runs` (at least 3).
/// The store is tuned as every CLI command opens it.
pub fn bench_local(dir: &Path, bytes: u64, runs: usize) -> Result<BenchReport> {
    let runs = runs.max(3);
    let loc = dir.display().to_string();
    let store = LocalStorage::with_config(dir, crate::store::options().local)?;
    let source = pattern(CHUNK_BYTES);
    let plain_path = dir.join("bench-plain");
    let mut t = Times::default();
    for _ in 0..runs {
        // Both sides write a new file, as a save does (data files have fresh names): freeing
        // the previous round's blocks is not part of either measurement.
        // The directory fsync makes the file system finish freeing them (with online discard
        // that takes a while) before the clock starts.
        let _ = std::fs::remove_file(&plain_path);
        store.delete("bench-storage")?;
        File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("bench in {loc}"))?;
        // Alternate which side goes first, so neither always inherits the other's writeback.
        let plain_first = t.base_write.len() % 2 == 0;
        for plain in [plain_first, !plain_first] {
            if plain {
                t.base_write.push(
                    timed(|| plain_write(&plain_path, &source, bytes)).with_context(|| format!("bench in {loc}"))?,
                );
            } else {
                t.store_write.push(timed(|| stream_write(&store, "bench-storage", &source, bytes))?);
            }
        }
        for plain in [plain_first, !plain_first] {
            if plain {
                t.base_read.push(timed(|| plain_read(&plain_path)).with_context(|| format!("bench in {loc}"))?);
            } else {
                t.store_read.push(timed(|| chunked_read(&store, "bench-storage", bytes))?);
            }
        }
    }
    let _ = std::fs::remove_file(&plain_path);
    store.delete("bench-storage")?;
    Ok(t.report(loc, bytes, runs, ("plain write_all + fsync", "LocalStorage writer"), ("plain read", "read_into")))
}

/// Streams `bytes` through an [`S3Storage`] writer (multipart, default part size) against one
/// plain `put` of the whole object; reads back with one `read_into` call of 8 MiB ranges into
/// one buffer (what a loader does) against one `get`. `url` is `s3://bucket/prefix` with the `AWS_*` environment set.
pub fn bench_s3(url: &str, bytes: u64, runs: usize) -> Result<BenchReport> {
    let runs = runs.max(3);
    let store = S3Storage::from_url(url, S3Config::default())?;
    let source = pattern(CHUNK_BYTES);
    let whole = whole_object(&source, bytes, url)?;
    let mut t = Times::default();
    for _ in 0..runs {
        t.base_write.push(timed(|| store.put("bench-put", whole.clone()))?);
        t.store_write.push(timed(|| stream_write(&store, "bench-stream", &source, bytes))?);
        t.base_read.push(timed(|| store.get("bench-put").map(drop))?);
        t.store_read.push(timed(|| one_call_read(&store, "bench-stream", bytes))?);
    }
    store.delete("bench-put")?;
    store.delete("bench-stream")?;
    Ok(t.report(url.to_string(), bytes, runs, ("single put", "S3Storage writer"), ("single get", "read_into")))
}

#[derive(Default)]
struct Times {
    base_write: Vec<f64>,
    store_write: Vec<f64>,
    base_read: Vec<f64>,
    store_read: Vec<f64>,
}

impl Times {
    fn report(
        mut self,
        target: String,
        bytes: u64,
        runs: usize,
        write: (&'static str, &'static str),
        read: (&'static str, &'static str),
    ) -> BenchReport {
        let mib = bytes as f64 / (1u64 << 20) as f64;
        let cmp = |base: &mut Vec<f64>, st: &mut Vec<f64>, names: (&'static str, &'static str)| {
            let (b, s) = (mib / median(base), mib / median(st));
            Comparison { baseline: names.0, baseline_mib_s: b, storage: names.1, storage_mib_s: s, ratio: s / b }
        };
        BenchReport {
            target,
            bytes,
            runs,
            write: cmp(&mut self.base_write, &mut self.store_write, write),
            read: cmp(&mut self.base_read, &mut self.store_read, read),
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN).max(1e-9)
}

fn timed<E>(f: impl FnOnce() -> Result<(), E>) -> Result<f64, E> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed().as_secs_f64())
}

/// Non-constant bytes, so no layer can shortcut zeros.
fn pattern(n: usize) -> Bytes {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

fn whole_object(source: &[u8], bytes: u64, url: &str) -> Result<Bytes> {
    let n = usize::try_from(bytes).with_context(|| format!("{bytes} bytes for {url}: too large"))?;
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let take = (n - v.len()).min(source.len());
        v.extend_from_slice(&source[..take]);
    }
    Ok(v.into())
}

/// Chunk lengths that add up to `bytes`.
fn chunks(bytes: u64, chunk: usize) -> impl Iterator<Item = usize> {
    let chunk = chunk as u64;
    (0..bytes.div_ceil(chunk)).map(move |i| (bytes - i * chunk).min(chunk) as usize)
}

fn plain_write(path: &Path, source: &[u8], bytes: u64) -> std::io::Result<()> {
    let mut f = File::create(path)?;
    for n in chunks(bytes, source.len()) {
        f.write_all(&source[..n])?;
    }
    f.sync_all()
}

fn plain_read(path: &Path) -> std::io::Result<()> {
    let mut f = File::open(path)?;
    let mut buf = vec![0u8; CHUNK_BYTES];
    while f.read(&mut buf)? > 0 {}
    Ok(())
}

fn stream_write(store: &dyn Storage, path: &str, source: &[u8], bytes: u64) -> dckpt::storage::Result<()> {
    let mut w = store.writer(path, &WriterOptions { size_hint_bytes: Some(bytes) })?;
    for n in chunks(bytes, source.len()) {
        w.write(&source[..n])?;
    }
    w.finish().map(drop)
}

fn one_call_read(store: &dyn Storage, path: &str, bytes: u64) -> dckpt::storage::Result<()> {
    let mut buf = vec![0u8; usize::try_from(bytes).unwrap_or(0)];
    let mut offset = 0u64;
    let mut reads: Vec<(u64, &mut [u8])> = Vec::new();
    for piece in buf.chunks_mut(CHUNK_BYTES) {
        let n = piece.len() as u64;
        reads.push((offset, piece));
        offset += n;
    }
    store.read_into(path, &mut reads)
}

fn chunked_read(store: &dyn Storage, path: &str, bytes: u64) -> dckpt::storage::Result<()> {
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut offset = 0u64;
    for n in chunks(bytes, CHUNK_BYTES) {
        store.read_into(path, &mut [(offset, &mut buf[..n])])?;
        offset += n as u64;
    }
    Ok(())
}
