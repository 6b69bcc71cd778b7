//! Load with resharding: every rank asks for its own pieces in its own layout; the engine
//! intersects them with the stored chunks, reads only the overlapping bytes (coalesced,
//! checksum-verified block by block) and copies them into place.

use std::collections::{BTreeMap, HashMap};

use dckpt_collective::{Collective, ReduceOp};
use dckpt_shard_spec::{Region, ShardedObject, ShardedTensor, for_each_overlap_run};
use dckpt_storage::Storage;
use serde::{Deserialize, Serialize};

use crate::format::{FileMeta, META_NAME, Metadata};
use crate::protocol::{COORDINATOR, agree, gather_decide};
use crate::{Error, Result};

/// A piece to fill: where it sits (its region in its own global shape) and its buffer.
#[derive(Debug)]
pub struct TensorRequest<'a> {
    /// Key, dtype, global shape and region wanted; the replica id is ignored.
    pub tensor: ShardedTensor,
    pub data: &'a mut [u8],
    /// Accept a stored global shape that differs (a padded vocabulary at another tp):
    /// the overlap is loaded, the rest zero-filled.
    pub allow_shape_mismatch: bool,
}

/// An object to fetch; `data` is filled when it is stored.
#[derive(Debug, Clone)]
pub struct ObjectRequest {
    pub object: ShardedObject,
    pub data: Option<Vec<u8>>,
}

/// What one rank asks for. Empty is fine.
#[derive(Debug, Default)]
pub struct LoadRequest<'a> {
    pub tensors: Vec<TensorRequest<'a>>,
    pub objects: Vec<ObjectRequest>,
}

/// What to do about a kind of key mismatch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyPolicy {
    /// Say nothing.
    Ignore,
    /// Print the keys to stderr (once, from the coordinator).
    Log,
    /// Report them in [`LoadOutcome`].
    Return,
    /// Fail the load on every rank.
    #[default]
    Raise,
}

/// Megatron's strictness modes with PyTorch's names: `missing` keys were requested but are
/// not stored; `unexpected` keys are stored but nobody requested them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Strictness {
    pub missing: KeyPolicy,
    pub unexpected: KeyPolicy,
}

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub strictness: Strictness,
    /// The largest single read; bounds the staging memory of a load.
    pub read_bytes_max: u64,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { strictness: Strictness::default(), read_bytes_max: 64 << 20 }
    }
}

/// The same on every rank except `bytes_read`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadOutcome {
    /// Requested by some rank, not stored (when the policy is `Return`).
    pub missing: Vec<String>,
    /// Stored, requested by no rank (when the policy is `Return`).
    pub unexpected: Vec<String>,
    /// Bytes this rank read from storage (including checksum-block rounding).
    pub bytes_read: u64,
    /// The layout the checkpoint was saved with.
    pub layout: BTreeMap<String, String>,
}

/// Reads and validates the metadata once (on the coordinator) and shares its bytes.
pub fn read_metadata(storage: &dyn Storage, coll: &dyn Collective) -> Result<Metadata> {
    let shared: std::result::Result<Vec<u8>, String> = gather_decide(coll, &(), "metadata", |_| {
        fetch_metadata(storage).map(|(bytes, _)| bytes).map_err(|e| e.to_string())
    })?;
    let bytes = shared.map_err(|message| Error::Rank { rank: COORDINATOR as u32, message })?;
    Metadata::decode_unvalidated(&bytes, &storage.location(META_NAME)).map_err(Error::Format)
}

/// Reads and fully validates the metadata on this process alone.
pub fn read_metadata_local(storage: &dyn Storage) -> Result<Metadata> {
    fetch_metadata(storage).map(|(_, m)| m)
}

fn fetch_metadata(storage: &dyn Storage) -> Result<(Vec<u8>, Metadata)> {
    let location = storage.location(META_NAME);
    let bytes = storage.get(META_NAME).map_err(|e| match e {
        dckpt_storage::Error::NotFound { .. } => Error::NotACheckpoint { location: location.clone() },
        e => Error::Storage(e),
    })?;
    let meta = Metadata::decode(&bytes, &location).map_err(Error::Format)?;
    Ok((bytes.to_vec(), meta))
}

/// Loads `req` as one rank of `coll`.
pub fn load(
    storage: &dyn Storage,
    coll: &dyn Collective,
    req: &mut LoadRequest<'_>,
    opts: &LoadOptions,
) -> Result<LoadOutcome> {
    let meta = read_metadata(storage, coll)?;
    let (missing, unexpected) = reconcile_keys(coll, &meta, req)?;
    let s = opts.strictness;
    if s.missing == KeyPolicy::Raise && !missing.is_empty() {
        return Err(Error::MissingKeys { keys: missing });
    }
    if s.unexpected == KeyPolicy::Raise && !unexpected.is_empty() {
        return Err(Error::UnexpectedKeys { keys: unexpected });
    }
    if coll.rank() == COORDINATOR {
        if s.missing == KeyPolicy::Log && !missing.is_empty() {
            eprintln!("dckpt: load: {} requested keys are not stored: {}", missing.len(), missing.join(", "));
        }
        if s.unexpected == KeyPolicy::Log && !unexpected.is_empty() {
            eprintln!("dckpt: load: {} stored keys were not requested: {}", unexpected.len(), unexpected.join(", "));
        }
    }
    let local = read_all(storage, &meta, req, opts.read_bytes_max);
    let bytes_read = *local.as_ref().unwrap_or(&0);
    agree(coll, local.map(|_| ()).map_err(|e| e.to_string()), "load result")?;
    Ok(LoadOutcome {
        missing: if s.missing == KeyPolicy::Return { missing } else { Vec::new() },
        unexpected: if s.unexpected == KeyPolicy::Return { unexpected } else { Vec::new() },
        bytes_read,
        layout: meta.layout,
    })
}

/// Global missing and unexpected keys, identical on every rank.
fn reconcile_keys(coll: &dyn Collective, meta: &Metadata, req: &LoadRequest<'_>) -> Result<(Vec<String>, Vec<String>)> {
    let stored: HashMap<&str, usize> = meta
        .tensors
        .iter()
        .map(|t| t.key.as_str())
        .chain(meta.objects.iter().map(|o| o.key.as_str()))
        .enumerate()
        .map(|(i, k)| (k, i))
        .collect();
    let mut requested = vec![0u64; stored.len()];
    let mut missing: Vec<String> = Vec::new();
    let keys =
        req.tensors.iter().map(|t| t.tensor.key.as_str()).chain(req.objects.iter().map(|o| o.object.key.as_str()));
    for k in keys {
        match stored.get(k) {
            Some(&i) => requested[i] = 1,
            None => missing.push(k.to_string()),
        }
    }
    let counts = coll.all_reduce_u64(&requested, ReduceOp::Sum)?;
    let mut unexpected: Vec<String> =
        stored.iter().filter(|(_, i)| counts.get(**i) == Some(&0)).map(|(k, _)| k.to_string()).collect();
    unexpected.sort_unstable();
    missing.sort_unstable();
    missing.dedup();
    let all_missing: Vec<String> = gather_decide(coll, &missing, "missing keys", |all| {
        let mut u: Vec<String> = all.into_iter().flatten().collect();
        u.sort_unstable();
        u.dedup();
        u
    })?;
    Ok((all_missing, unexpected))
}

/// One copy from a stored file into a request buffer.
#[derive(Debug, Clone, Copy)]
struct Copy {
    file: u32,
    at: u64,
    len: u64,
    dest: usize,
    dest_at: u64,
}

/// Reads everything this rank asked for; returns the bytes read from storage.
fn read_all(storage: &dyn Storage, meta: &Metadata, req: &mut LoadRequest<'_>, read_bytes_max: u64) -> Result<u64> {
    let tensors: HashMap<&str, usize> = meta.tensors.iter().enumerate().map(|(i, t)| (t.key.as_str(), i)).collect();
    let mut copies = Vec::new();
    for (ri, r) in req.tensors.iter_mut().enumerate() {
        let Some(&ti) = tensors.get(r.tensor.key.as_str()) else { continue };
        let stored = &meta.tensors[ti];
        let key = &r.tensor.key;
        if stored.dtype != r.tensor.dtype {
            return Err(Error::Request {
                key: key.clone(),
                detail: format!("stored as {}, requested as {}", stored.dtype, r.tensor.dtype),
            });
        }
        let shapes_differ = stored.global_shape != r.tensor.global_shape;
        if shapes_differ && !r.allow_shape_mismatch {
            return Err(Error::Request {
                key: key.clone(),
                detail: format!(
                    "stored global shape {:?}, requested {:?}; allow a shape mismatch to load the overlap",
                    stored.global_shape, r.tensor.global_shape
                ),
            });
        }
        r.tensor
            .region
            .check(&r.tensor.global_shape)
            .map_err(|e| Error::Request { key: key.clone(), detail: format!("region {}: {e}", r.tensor.region) })?;
        let esz = r.tensor.dtype.size();
        if r.data.len() as u64 != r.tensor.region.numel() * esz {
            return Err(Error::Request {
                key: key.clone(),
                detail: format!(
                    "buffer has {} bytes, region {} needs {}",
                    r.data.len(),
                    r.tensor.region,
                    r.tensor.region.numel() * esz
                ),
            });
        }
        if shapes_differ {
            r.data.fill(0);
        }
        let want: &Region = &r.tensor.region;
        for c in &stored.chunks {
            let region = c.region();
            for_each_overlap_run(&region, want, |run| {
                copies.push(Copy {
                    file: c.file,
                    at: c.at + run.a * esz,
                    len: run.len * esz,
                    dest: ri,
                    dest_at: run.b * esz,
                });
            });
        }
    }
    let mut bytes_read = execute(storage, meta, &mut copies, read_bytes_max, |dest, dest_at, src| {
        let buf = &mut req.tensors[dest].data;
        buf[dest_at as usize..dest_at as usize + src.len()].copy_from_slice(src);
    })?;
    bytes_read += read_objects(storage, meta, &mut req.objects, read_bytes_max)?;
    Ok(bytes_read)
}

fn read_objects(
    storage: &dyn Storage,
    meta: &Metadata,
    objects: &mut [ObjectRequest],
    read_bytes_max: u64,
) -> Result<u64> {
    let index: HashMap<&str, usize> = meta.objects.iter().enumerate().map(|(i, o)| (o.key.as_str(), i)).collect();
    let mut copies = Vec::new();
    for (oi, o) in objects.iter_mut().enumerate() {
        let Some(&mi) = index.get(o.object.key.as_str()) else { continue };
        let stored = &meta.objects[mi];
        let Some(e) = stored.entries.iter().find(|e| e.grid_offset == o.object.grid_offset) else {
            return Err(Error::Request {
                key: o.object.key.clone(),
                detail: format!("no stored object at grid position {:?}", o.object.grid_offset),
            });
        };
        o.data = Some(vec![0; e.len as usize]);
        copies.push(Copy { file: e.file, at: e.at, len: e.len, dest: oi, dest_at: 0 });
    }
    execute(storage, meta, &mut copies, read_bytes_max, |dest, dest_at, src| {
        let buf = objects[dest].data.as_mut().expect("allocated above");
        buf[dest_at as usize..dest_at as usize + src.len()].copy_from_slice(src);
    })
}

/// Performs `copies`: per file, block-aligned spans (coalesced, at most `read_bytes_max`
/// each unless one copy is larger), each block's CRC verified before any byte is used.
fn execute(
    storage: &dyn Storage,
    meta: &Metadata,
    copies: &mut [Copy],
    read_bytes_max: u64,
    mut put: impl FnMut(usize, u64, &[u8]),
) -> Result<u64> {
    copies.sort_unstable_by_key(|c| (c.file, c.at));
    let block = meta.block_bytes;
    let mut bytes_read = 0;
    let mut i = 0;
    let mut buf: Vec<u8> = Vec::new();
    while i < copies.len() {
        let f = &meta.files[copies[i].file as usize];
        let (lo, mut hi) = block_span(f, block, copies[i].at, copies[i].len);
        let mut j = i + 1;
        while j < copies.len() && copies[j].file == copies[i].file {
            let (l, h) = block_span(f, block, copies[j].at, copies[j].len);
            // Coalesce when the next span starts within one block of this one and fits.
            if l > hi + block || h.max(hi) - lo > read_bytes_max {
                break;
            }
            hi = hi.max(h);
            j += 1;
        }
        buf.resize((hi - lo) as usize, 0);
        storage.read_into(&f.name, &mut [(lo, &mut buf[..])])?;
        bytes_read += hi - lo;
        verify_blocks(f, block, lo, &buf)?;
        for c in &copies[i..j] {
            let s = (c.at - lo) as usize;
            put(c.dest, c.dest_at, &buf[s..s + c.len as usize]);
        }
        i = j;
    }
    Ok(bytes_read)
}

/// The block-aligned byte span of the data section that holds `[at, at + len)`.
fn block_span(f: &FileMeta, block: u64, at: u64, len: u64) -> (u64, u64) {
    let ds = f.data_start;
    let lo = ds + (at - ds) / block * block;
    let hi = (ds + (at + len - ds).div_ceil(block) * block).min(f.bytes);
    (lo, hi)
}

fn verify_blocks(f: &FileMeta, block: u64, lo: u64, buf: &[u8]) -> Result<()> {
    let first = (lo - f.data_start) / block;
    for (k, piece) in buf.chunks(block as usize).enumerate() {
        let b = first + k as u64;
        let stored = f.block_crc(b).ok_or_else(|| Error::Checksum {
            file: f.name.clone(),
            offset: f.data_start + b * block,
            detail: "no checksum for this block".into(),
        })?;
        let actual = crc32fast::hash(piece);
        if stored != actual {
            return Err(Error::Checksum {
                file: f.name.clone(),
                offset: f.data_start + b * block,
                detail: format!("block {b} of {} bytes: stored crc32 {stored:08x}, computed {actual:08x}", piece.len()),
            });
        }
    }
    Ok(())
}
