//! Load with resharding: every rank asks for its own pieces in its own layout; the engine
//! intersects them with the stored chunks, reads only the overlapping bytes (coalesced,
//! checksum-verified block by block) and copies them into place.

use std::collections::BTreeMap;

use dckpt_collective::{Collective, ReduceOp};
use dckpt_shard_spec::{Dims, Region, ShardedObject, ShardedTensor, for_each_overlap_run, overlap_numel};
use dckpt_storage::Storage;
use serde::{Deserialize, Serialize};

use crate::error::first_failure;
use crate::format::{META_NAME, Metadata, block_crc};
use crate::plan::FxMap;
use crate::protocol::{COORDINATOR, agree, gather_decide};
use crate::shared_check::{self, ChunkKey, Offer, PartCrc, Shared};
use crate::split_crc;
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
///
/// ```
/// use dckpt_engine::LoadRequest;
/// use dckpt_shard_spec::{DType, ShardedObject, ShardedTensor};
///
/// let mut half = vec![0u8; 8];
/// let req = LoadRequest::new()
///     .tensor(ShardedTensor::chunk("w", DType::F32, [4], [2], [2]), &mut half)
///     .object(ShardedObject::single("rng"));
/// assert_eq!(req.object_data("rng"), None); // filled by a load
/// ```
#[derive(Debug, Default)]
pub struct LoadRequest<'a> {
    pub tensors: Vec<TensorRequest<'a>>,
    pub objects: Vec<ObjectRequest>,
}

impl<'a> LoadRequest<'a> {
    /// An empty request (a rank may load nothing).
    pub fn new() -> LoadRequest<'a> {
        LoadRequest::default()
    }

    /// With one more piece to fill: `data` receives the piece's elements, row-major.
    pub fn tensor(mut self, tensor: ShardedTensor, data: &'a mut [u8]) -> LoadRequest<'a> {
        self.push_tensor(tensor, data);
        self
    }

    /// With one more piece whose stored global shape may differ (a padded vocabulary at
    /// another tp): the overlap is loaded, the rest zero-filled.
    pub fn tensor_allowing_shape_mismatch(mut self, tensor: ShardedTensor, data: &'a mut [u8]) -> LoadRequest<'a> {
        self.tensors.push(TensorRequest { tensor, data, allow_shape_mismatch: true });
        self
    }

    /// With one more object to fetch.
    pub fn object(mut self, object: ShardedObject) -> LoadRequest<'a> {
        self.objects.push(ObjectRequest { object, data: None });
        self
    }

    /// Adds a piece to fill.
    pub fn push_tensor(&mut self, tensor: ShardedTensor, data: &'a mut [u8]) {
        self.tensors.push(TensorRequest { tensor, data, allow_shape_mismatch: false });
    }

    /// The bytes a load gave the first requested object under `key`, if it was stored.
    pub fn object_data(&self, key: &str) -> Option<&[u8]> {
        self.objects.iter().find(|o| o.object.key.as_str() == key).and_then(|o| o.data.as_deref())
    }
}

/// What to do about a kind of key mismatch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyPolicy {
    /// Say nothing.
    Ignore,
    /// Log the keys as a warning through the `log` facade (once, from the coordinator);
    /// where it goes is the host program's choice.
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

/// Reads the metadata on every rank; the coordinator validates it fully and shares its
/// digest (length and CRC-32), against which every other rank checks the bytes it read.
/// Storage serves the file to every rank (object stores and shared file systems fan out
/// well), so the coordinator does not send it world-size times; decoding is all the others
/// do. Every rank returns the same outcome.
pub(crate) fn read_metadata(storage: &dyn Storage, coll: &dyn Collective) -> Result<Metadata> {
    let mut mine = None;
    let digest: Result<(u64, u32)> = gather_decide(coll, (), "metadata", |_| {
        fetch_metadata(storage)
            .map(|(bytes, meta)| {
                mine = Some(meta);
                digest(&bytes)
            })
            .map_err(|e| e.on_rank(COORDINATOR as u32))
    })?;
    let (len, crc) = digest?;
    let (meta, check) = match mine.map_or_else(|| fetch_matching(storage, len, crc), Ok) {
        Ok(meta) => (Some(meta), Ok(())),
        Err(e) => (None, Err(e)),
    };
    agree(coll, check, "metadata")?;
    Ok(meta.expect("agreed that every rank read the metadata"))
}

/// Length and CRC-32 of a metadata file, its CRC trailer left out: the CRC of bytes followed
/// by their own CRC is the same constant for every file.
fn digest(bytes: &[u8]) -> (u64, u32) {
    (bytes.len() as u64, crc32fast::hash(&bytes[..bytes.len().saturating_sub(4)]))
}

/// The metadata as this rank reads it, if its bytes are the ones the coordinator validated.
fn fetch_matching(storage: &dyn Storage, len: u64, crc: u32) -> Result<Metadata> {
    let location = storage.location(META_NAME);
    let bytes = storage.get(META_NAME)?;
    let actual = digest(&bytes);
    if actual != (len, crc) {
        return Err(Error::Checksum {
            rank: None,
            file: location,
            offset: 0,
            detail: format!(
                "{} bytes with crc32 {:08x} here, {len} bytes with crc32 {crc:08x} on the coordinator: \
                 the checkpoint changed during the load, or the ranks were given different locations",
                actual.0, actual.1
            ),
        });
    }
    Ok(Metadata::decode_unvalidated(&bytes, &location)?)
}

/// Reads and fully validates the metadata on this process alone.
pub fn read_metadata_local(storage: &dyn Storage) -> Result<Metadata> {
    fetch_metadata(storage).map(|(_, m)| m)
}

fn fetch_metadata(storage: &dyn Storage) -> Result<(bytes::Bytes, Metadata)> {
    let location = storage.location(META_NAME);
    let bytes = storage.get(META_NAME).map_err(|e| match e {
        dckpt_storage::Error::NotFound { .. } => Error::NotACheckpoint { rank: None, location: location.clone() },
        e => e.into(),
    })?;
    let meta = Metadata::decode(&bytes, &location)?;
    Ok((bytes, meta))
}

/// Loads `req` as one rank of `coll`.
pub(crate) fn load(
    storage: &dyn Storage,
    coll: &dyn Collective,
    req: &mut LoadRequest<'_>,
    opts: &LoadOptions,
) -> Result<LoadOutcome> {
    let meta = read_metadata(storage, coll)?;
    let found = Found::new(&meta, req);
    let (missing, unexpected) = reconcile_keys(coll, &meta, &found, req)?;
    let s = opts.strictness;
    if s.missing == KeyPolicy::Raise && !missing.is_empty() {
        return Err(Error::MissingKeys { keys: missing });
    }
    if s.unexpected == KeyPolicy::Raise && !unexpected.is_empty() {
        return Err(Error::UnexpectedKeys { keys: unexpected });
    }
    if coll.rank() == COORDINATOR {
        if s.missing == KeyPolicy::Log && !missing.is_empty() {
            log::warn!("load: {} requested keys are not stored: {}", missing.len(), missing.join(", "));
        }
        if s.unexpected == KeyPolicy::Log && !unexpected.is_empty() {
            log::warn!("load: {} stored keys were not requested: {}", unexpected.len(), unexpected.join(", "));
        }
    }
    let bytes_read = read_all(storage, coll, &meta, &found, req, opts.read_bytes_max)?;
    Ok(LoadOutcome {
        missing: if s.missing == KeyPolicy::Return { missing } else { Vec::new() },
        unexpected: if s.unexpected == KeyPolicy::Return { unexpected } else { Vec::new() },
        bytes_read,
        layout: meta.layout,
    })
}

/// Where each requested key is stored, request by request: its index in the metadata's
/// tensors (or objects), `None` when it is not stored. Each key is looked up once.
struct Found {
    tensors: Vec<Option<usize>>,
    objects: Vec<Option<usize>>,
}

impl Found {
    fn new(meta: &Metadata, req: &LoadRequest<'_>) -> Found {
        let mut tensor = finder(&meta.tensors, |t| &t.key);
        let mut object = finder(&meta.objects, |o| &o.key);
        Found {
            tensors: req.tensors.iter().map(|r| tensor(&r.tensor.key)).collect(),
            objects: req.objects.iter().map(|r| object(&r.object.key)).collect(),
        }
    }
}

/// Looks keys up in `list`, sorted by key without repeats (as validated metadata is):
/// requests usually come in key order too, so the entry after the last one found (and that
/// one again: several regions of one tensor) is tried before a binary search.
fn finder<T>(list: &[T], key_of: impl Fn(&T) -> &str) -> impl FnMut(&str) -> Option<usize> {
    let mut next = 0;
    move |key| {
        let i = match (list.get(next), next.checked_sub(1).and_then(|p| list.get(p))) {
            (Some(t), _) if key_of(t) == key => next,
            (_, Some(t)) if key_of(t) == key => next - 1,
            _ => list.binary_search_by(|t| key_of(t).cmp(key)).ok()?,
        };
        next = i + 1;
        Some(i)
    }
}

/// Global missing and unexpected keys, identical on every rank.
fn reconcile_keys(
    coll: &dyn Collective,
    meta: &Metadata,
    found: &Found,
    req: &LoadRequest<'_>,
) -> Result<(Vec<String>, Vec<String>)> {
    // Stored keys counted as tensors first, then objects.
    let first_object = meta.tensors.len();
    let mut requested = vec![0u64; first_object + meta.objects.len()];
    let mut missing: Vec<String> = Vec::new();
    for (r, f) in req.tensors.iter().zip(&found.tensors) {
        match f {
            Some(i) => requested[*i] = 1,
            None => missing.push(r.tensor.key.to_string()),
        }
    }
    for (r, f) in req.objects.iter().zip(&found.objects) {
        match f {
            Some(i) => requested[first_object + i] = 1,
            None => missing.push(r.object.key.to_string()),
        }
    }
    let counts = coll.all_reduce_u64(&requested, ReduceOp::Sum)?;
    let stored = meta.tensors.iter().map(|t| &t.key).chain(meta.objects.iter().map(|o| &o.key));
    let mut unexpected: Vec<String> = stored.zip(&counts).filter(|(_, n)| **n == 0).map(|(k, _)| k.clone()).collect();
    unexpected.sort_unstable();
    missing.sort_unstable();
    missing.dedup();
    let all_missing: Vec<String> = gather_decide(coll, missing, "missing keys", |all| {
        let mut u: Vec<String> = all.into_iter().flatten().collect();
        u.sort_unstable();
        u.dedup();
        u
    })?;
    Ok((all_missing, unexpected))
}

/// A stored chunk or object: where its bytes are and their block checksums.
#[derive(Debug, Clone, Copy)]
struct Stored<'m> {
    /// The tensor chunk it is, `None` for an object.
    chunk: Option<ChunkKey>,
    file: u32,
    at: u64,
    len: u64,
    crc32: &'m [u8],
}

/// One transfer: `len` bytes from offset `src` of a stored piece to offset `dest_at` of
/// destination buffer `dest`, repeated for `rows` rows, each `src_step` further in the piece
/// and `dest_step` further in the destination. A column split copies part of every row of
/// a chunk: one copy, not one per row.
#[derive(Debug, Clone, Copy)]
struct Copy {
    piece: usize,
    src: u64,
    len: u64,
    dest: usize,
    dest_at: u64,
    rows: u64,
    src_step: u64,
    dest_step: u64,
    /// Verified with the other ranks' parts of the same blocks (see `shared_check`).
    shared: bool,
}

impl Copy {
    /// One row, `len` bytes from `src` to `dest_at`.
    fn one(piece: usize, src: u64, len: u64, dest: usize, dest_at: u64) -> Copy {
        Copy { piece, src, len, dest, dest_at, rows: 1, src_step: 0, dest_step: 0, shared: false }
    }

    /// Row `k` as a copy of its own.
    fn row(&self, k: u64) -> Copy {
        Copy { src: self.src + k * self.src_step, dest_at: self.dest_at + k * self.dest_step, rows: 1, ..*self }
    }

    fn each_row(&self) -> impl Iterator<Item = Copy> + '_ {
        (0..self.rows).map(|k| self.row(k))
    }

    /// Where the last row ends in the destination.
    fn dest_end(&self) -> u64 {
        self.dest_at + (self.rows - 1) * self.dest_step + self.len
    }

    /// Takes `next` (one row) as a further row when it continues the pattern: same piece,
    /// destination and length, after the last row in both, at the same distances.
    fn extend(&mut self, next: &Copy) -> bool {
        if (next.piece, next.dest, next.len, next.shared) != (self.piece, self.dest, self.len, self.shared) {
            return false;
        }
        let (last_src, last_dest) = (self.src + (self.rows - 1) * self.src_step, self.dest_end() - self.len);
        if next.src < last_src + self.len || next.dest_at < last_dest + self.len {
            return false;
        }
        let steps = (next.src - last_src, next.dest_at - last_dest);
        if self.rows > 1 && steps != (self.src_step, self.dest_step) {
            return false;
        }
        (self.src_step, self.dest_step) = steps;
        self.rows += 1;
        true
    }
}

/// What one rank reads: the stored pieces and the transfers from them.
struct ReadPlan<'m> {
    pieces: Vec<Stored<'m>>,
    copies: Vec<Copy>,
}

/// Reads everything this rank asked for, with every other rank; returns the bytes this
/// rank read from storage. Two rounds: the ranks offer the chunks they read in part (the
/// coordinator decides which to check together), then every rank's result and parts are
/// gathered and checked. A rank that fails locally still takes part in both.
fn read_all(
    storage: &dyn Storage,
    coll: &dyn Collective,
    meta: &Metadata,
    found: &Found,
    req: &mut LoadRequest<'_>,
    read_bytes_max: u64,
) -> Result<u64> {
    let plan = plan_reads(meta, found, req);
    let (plan, offers) = match plan {
        Ok(p) => {
            let o = offers(meta, &p, req);
            (Some(p), Ok(o))
        }
        Err(e) => (None, Err(e)),
    };
    let offered: Vec<ChunkKey> = offers.as_ref().map(|o| o.iter().map(|(k, _)| *k).collect()).unwrap_or_default();
    let mut shared = Shared::new();
    let decision: Result<Vec<ChunkKey>> = gather_decide(coll, offers, "read plan", |all| {
        Ok(shared_check::decide(meta, first_failure(all)?, &mut shared))
    })?;
    // The shared chunks this rank offered regions of; it reads the others the usual way.
    let together: Vec<ChunkKey> = decision?.into_iter().filter(|k| offered.binary_search(k).is_ok()).collect();
    let plan = plan.expect("a rank that could not plan its reads failed the read plan");
    let local = read_planned(storage, meta, plan, &together, req, read_bytes_max);
    let bytes_read = *local.as_ref().map(|(n, _)| n).unwrap_or(&0);
    let summary = local.map(|(_, parts)| parts);
    // The coordinator combines the ranks' parts of shared blocks, so a mismatch there is its finding.
    let verdict: Result<()> = gather_decide(coll, summary, "load result", |all| {
        shared_check::verify(meta, &shared, first_failure(all)?).map_err(|m| Error::Checksum {
            rank: Some(COORDINATOR as u32),
            file: m.file,
            offset: m.offset,
            detail: m.detail,
        })
    })?;
    verdict.map(|()| bytes_read)
}

/// The chunks this rank reads in part (some block not whole), with the regions of them it
/// needs; a chunk whose part is not a union of regions ([`shared_check::region_overlap`])
/// is left out and read the usual way.
fn offers(meta: &Metadata, plan: &ReadPlan<'_>, req: &LoadRequest<'_>) -> Vec<Offer> {
    let block = meta.block_bytes;
    let mut partial = vec![false; plan.pieces.len()];
    for c in &plan.copies {
        let len = plan.pieces[c.piece].len;
        partial[c.piece] |= c.each_row().any(|r| {
            let (lo, hi) = whole_blocks(&r, len, block);
            lo > r.src || hi < r.src + r.len
        });
    }
    // Every request that reads from a chunk read in part, not only the parts it reads in part.
    let mut reading: Vec<(usize, usize)> =
        plan.copies.iter().filter(|c| partial[c.piece]).map(|c| (c.piece, c.dest)).collect();
    reading.sort_unstable();
    reading.dedup();
    let mut out = Vec::new();
    for same in reading.chunk_by(|a, b| a.0 == b.0) {
        let Some(key) = plan.pieces[same[0].0].chunk else { continue };
        let chunk = meta.tensors[key.0 as usize].chunks[key.1 as usize].region();
        let regions: Option<Vec<Region>> =
            same.iter().map(|&(_, d)| shared_check::region_overlap(&chunk, &req.tensors[d].tensor.region)).collect();
        // A rank whose requests take some elements of the chunk twice reads it the usual way:
        // its parts of a block would count those bytes twice.
        if let Some(mut regions) = regions {
            regions.sort_unstable();
            let n = regions.len();
            if (0..n).all(|i| (i + 1..n).all(|j| overlap_numel(&regions[i], &regions[j]) == 0)) {
                out.push((key, regions));
            }
        }
    }
    out.sort_unstable_by_key(|o| o.0);
    out
}

/// The span of whole checksum blocks inside a copy of one row, `lo >= hi` when there is
/// none; the piece's end closes its last, short block.
fn whole_blocks(c: &Copy, piece_len: u64, block: u64) -> (u64, u64) {
    debug_assert_eq!(c.rows, 1, "one row at a time");
    let end = c.src + c.len;
    let lo = c.src.div_ceil(block) * block;
    let hi = if end == piece_len { end } else { end / block * block };
    (lo, hi)
}

/// Intersects this rank's requests with the stored chunks and objects.
fn plan_reads<'m>(meta: &'m Metadata, found: &Found, req: &mut LoadRequest<'_>) -> Result<ReadPlan<'m>> {
    let mut pieces: Vec<Stored<'_>> = Vec::with_capacity(req.tensors.len());
    let mut piece_of: FxMap<(usize, usize), usize> = FxMap::default();
    piece_of.reserve(req.tensors.len());
    let mut copies = Vec::with_capacity(req.tensors.len());
    // One region, refilled for each stored chunk (not allocated for each).
    let mut region = Region { offset: Dims::new(), shape: Dims::new(), flat: None };
    for ((ri, r), &ti) in req.tensors.iter_mut().enumerate().zip(&found.tensors) {
        let Some(ti) = ti else { continue };
        let stored = &meta.tensors[ti];
        let esz = check_request(r, stored.dtype, &stored.global_shape)?;
        let want: &Region = &r.tensor.region;
        for (ci, c) in stored.chunks.iter().enumerate() {
            c.region_into(&mut region);
            let mut piece = None;
            for_each_overlap_run(&region, want, |run| {
                let piece = *piece.get_or_insert_with(|| {
                    *piece_of.entry((ti, ci)).or_insert_with(|| {
                        let chunk = Some((ti as u32, ci as u32));
                        pieces.push(Stored {
                            chunk,
                            file: c.file,
                            at: c.at,
                            len: region.numel() * esz,
                            crc32: &c.crc32,
                        });
                        pieces.len() - 1
                    })
                });
                let row = Copy::one(piece, run.a * esz, run.len * esz, ri, run.b * esz);
                if !copies.last_mut().is_some_and(|c: &mut Copy| c.extend(&row)) {
                    copies.push(row);
                }
            });
        }
    }
    let first_object = req.tensors.len();
    for ((oi, o), &mi) in req.objects.iter_mut().enumerate().zip(&found.objects) {
        let Some(mi) = mi else { continue };
        let Some(e) = meta.objects[mi].entries.iter().find(|e| e.grid_offset == o.object.grid_offset) else {
            return Err(Error::Request {
                rank: None,
                key: o.object.key.to_string(),
                detail: format!("no stored object at grid position {:?}", o.object.grid_offset),
            });
        };
        pieces.push(Stored { chunk: None, file: e.file, at: e.at, len: e.len, crc32: &e.crc32 });
        copies.push(Copy::one(pieces.len() - 1, 0, e.len, first_object + oi, 0));
    }
    Ok(ReadPlan { pieces, copies })
}

/// Reads a plan; `together` are the chunks checked with the other ranks. Returns the bytes
/// read and this rank's parts of the blocks of those chunks.
fn read_planned(
    storage: &dyn Storage,
    meta: &Metadata,
    plan: ReadPlan<'_>,
    together: &[ChunkKey],
    req: &mut LoadRequest<'_>,
    read_bytes_max: u64,
) -> Result<(u64, Vec<PartCrc>)> {
    let ReadPlan { pieces, mut copies } = plan;
    if !together.is_empty() {
        // Looked up once per piece: a column split makes a copy of every row.
        let together: std::collections::HashSet<ChunkKey> = together.iter().copied().collect();
        let shared: Vec<bool> = pieces.iter().map(|p| p.chunk.is_some_and(|k| together.contains(&k))).collect();
        for c in &mut copies {
            c.shared = shared[c.piece];
        }
    }
    // Every file this rank reads from: its size as recorded, its header intact. Only then
    // are object buffers sized from the metadata.
    let mut files: Vec<u32> = pieces.iter().map(|p| p.file).collect();
    files.sort_unstable();
    files.dedup();
    // Several at once on an object store (each is a request), in order on local disk.
    for group in files.chunks_mut(reads_in_flight(storage)) {
        in_parallel(group, |&mut fi| check_file(storage, meta, fi))?;
    }
    let first_object = req.tensors.len();
    for c in copies.iter().filter(|c| c.dest >= first_object) {
        req.objects[c.dest - first_object].data = Some(vec![0; c.len as usize]);
    }
    let mut dests: Vec<&mut [u8]> = req
        .tensors
        .iter_mut()
        .map(|r| &mut *r.data)
        .chain(req.objects.iter_mut().map(|o| o.data.as_deref_mut().unwrap_or(&mut [])))
        .collect();
    execute(storage, meta, &pieces, copies, &mut dests, read_bytes_max)
}

/// A data file must have the size the metadata records (checked before anything is sized
/// by the metadata; its header is checked with the first read of it).
fn check_file(storage: &dyn Storage, meta: &Metadata, fi: u32) -> Result<()> {
    let f = &meta.files[fi as usize];
    let size = storage.size(&f.name)?;
    if size != f.bytes {
        return Err(Error::Checksum {
            rank: None,
            file: f.name.clone(),
            offset: size.min(f.bytes),
            detail: format!("the file has {size} bytes, the metadata records {}", f.bytes),
        });
    }
    Ok(())
}

/// The header of a data file, as read, must match its checksum.
fn verify_header(f: &crate::format::FileMeta, header: &[u8]) -> Result<()> {
    let crc = crc32fast::hash(header);
    if crc != f.header_crc32 {
        return Err(Error::Checksum {
            rank: None,
            file: f.name.clone(),
            offset: 0,
            detail: format!("header: stored crc32 {:08x}, computed {crc:08x}", f.header_crc32),
        });
    }
    Ok(())
}

/// Checks a request against what is stored; zero-fills it when shapes differ. Returns the
/// element size.
fn check_request(r: &mut TensorRequest<'_>, dtype: dckpt_shard_spec::DType, global_shape: &[u64]) -> Result<u64> {
    let key = &r.tensor.key;
    let bad = |detail: String| Error::Request { rank: None, key: key.to_string(), detail };
    if dtype != r.tensor.dtype {
        return Err(bad(format!("stored as {dtype}, requested as {}", r.tensor.dtype)));
    }
    let shapes_differ = global_shape != r.tensor.global_shape.as_slice();
    if shapes_differ && !r.allow_shape_mismatch {
        return Err(bad(format!(
            "stored global shape {global_shape:?}, requested {:?}; allow a shape mismatch to load the overlap",
            r.tensor.global_shape
        )));
    }
    r.tensor.region.check(&r.tensor.global_shape).map_err(|e| bad(format!("region {}: {e}", r.tensor.region)))?;
    let esz = dtype.size();
    let need = r.tensor.region.numel() * esz;
    if r.data.len() as u64 != need {
        return Err(bad(format!("buffer has {} bytes, region {} needs {need}", r.data.len(), r.tensor.region)));
    }
    if shapes_differ {
        // Zero what lies outside the stored tensor; the rest is about to be overwritten.
        let (mut filled, data) = (0u64, &mut *r.data);
        for_each_overlap_run(&Region::full(global_shape), &r.tensor.region, |run| {
            data[(filled * esz) as usize..(run.b * esz) as usize].fill(0);
            filled = run.b + run.len;
        });
        data[(filled * esz) as usize..].fill(0);
    }
    Ok(esz)
}

/// Performs `copies`. The whole checksum blocks a copy covers are read straight into its
/// destination and verified there (a whole stored piece is the common case); the partial
/// blocks at its ends go through a staging buffer of at most `read_bytes_max` (rounded up
/// to a block), are verified, and copied out.
fn execute(
    storage: &dyn Storage,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    copies: Vec<Copy>,
    dests: &mut [&mut [u8]],
    read_bytes_max: u64,
) -> Result<(u64, Vec<PartCrc>)> {
    let block = meta.block_bytes;
    let (mut direct, mut staged) = (Vec::with_capacity(copies.len()), Vec::new());
    for c in copies {
        let piece_len = pieces[c.piece].len;
        // Rows without a whole block (a column split's rows, shorter than a block) stay
        // together: read exactly and checked in parts with the other ranks when the chunk is
        // shared, through the staging window otherwise.
        if c.each_row().all(|r| {
            let (lo, hi) = whole_blocks(&r, piece_len, block);
            lo >= hi
        }) {
            if c.shared {
                direct.push(c)
            } else {
                staged.push(c)
            }
            continue;
        }
        for r in c.each_row() {
            // Whole blocks go straight into place and are verified here; the partial blocks
            // at the ends go as above.
            let (lo, hi) = whole_blocks(&r, piece_len, block);
            let end = r.src + r.len;
            if lo < hi {
                direct.push(Copy { src: lo, len: hi - lo, dest_at: r.dest_at + (lo - r.src), shared: false, ..r });
            }
            let head = (lo < hi && r.src < lo).then(|| Copy { len: lo - r.src, ..r });
            let tail =
                (lo < hi && hi < end).then(|| Copy { src: hi, len: end - hi, dest_at: r.dest_at + (hi - r.src), ..r });
            let whole = (lo >= hi).then_some(r);
            for e in [head, tail, whole].into_iter().flatten() {
                if e.shared { direct.push(e) } else { staged.push(e) }
            }
        }
    }
    // Destination ranges are disjoint (stored chunks are); split the buffers into exactly
    // the slices the direct reads fill, a large one further at block boundaries, so that the
    // reads can go a window at a time.
    let window = storage.hints().read_window.unwrap_or(u64::MAX);
    let step = if window == u64::MAX { u64::MAX } else { (window / block).max(1) * block };
    direct.sort_unstable_by_key(|c| (c.dest, c.dest_at));
    // The rows of two copies into one buffer may interleave (a buffer filled from two
    // stored column halves): such a buffer's copies are split into their rows.
    let mut interleaved: Vec<usize> = direct
        .windows(2)
        .filter(|w| w[0].dest == w[1].dest && w[0].dest_end() > w[1].dest_at)
        .map(|w| w[0].dest)
        .collect();
    if !interleaved.is_empty() {
        interleaved.dedup();
        let mut rows = Vec::new();
        direct.retain(|c| {
            let split = c.rows > 1 && interleaved.binary_search(&c.dest).is_ok();
            if split {
                rows.extend(c.each_row());
            }
            !split
        });
        direct.extend(rows);
        direct.sort_unstable_by_key(|c| (c.dest, c.dest_at));
    }
    let mut targets: Vec<Target<'_>> = Vec::with_capacity(direct.len());
    let mut rest: Vec<&mut [u8]> = dests.iter_mut().map(|d| &mut **d).collect();
    let mut consumed = vec![0u64; rest.len()];
    for c in &direct {
        let p = &pieces[c.piece];
        let mut take = |r: &Copy| -> &mut [u8] {
            let buf = std::mem::take(&mut rest[r.dest]);
            let (_, tail) = buf.split_at_mut((r.dest_at - consumed[r.dest]) as usize);
            let (mine, after) = tail.split_at_mut(r.len as usize);
            rest[r.dest] = after;
            consumed[r.dest] = r.dest_at + r.len;
            mine
        };
        if c.rows > 1 {
            // Shared rows (never whole blocks), as many to a target as a window holds.
            let mut open: Option<Target<'_>> = None;
            for r in c.each_row() {
                let buf = take(&r);
                match &mut open {
                    Some(t) if t.bytes + r.len <= step => {
                        t.bytes += r.len;
                        t.more.push(buf);
                    }
                    _ => targets.extend(open.replace(Target::new(p, &r, c.src_step, buf))),
                }
            }
            targets.extend(open);
            continue;
        }
        let mut mine = take(c);
        let mut src = c.src;
        // A shared stretch is never split: it is not whole blocks.
        while !c.shared && mine.len() as u64 > step {
            let (now, later) = mine.split_at_mut(step as usize);
            targets.push(Target::new(p, &Copy { src, ..*c }, 0, now));
            src += step;
            mine = later;
        }
        targets.push(Target::new(p, &Copy { src, ..*c }, 0, mine));
    }
    drop(rest);
    targets.sort_unstable_by_key(|t| (t.file, t.at));
    let mut bytes_read = 0;
    let mut parts = Vec::new();
    // The direct reads in windows of one file each; each file's header rides along with its
    // first window (one request on object stores).
    let mut header_in_window = vec![false; meta.files.len()];
    let mut windows: Vec<Window<'_>> = Vec::new();
    // A window holds at most `window` bytes of one file (or a single larger target). Its
    // targets are counted first, so each window's list is allocated once.
    let mut sizes = Vec::new();
    let mut start = 0;
    while start < targets.len() {
        let (fi, mut span, mut end) = (targets[start].file, targets[start].bytes, start + 1);
        while let Some(n) = targets.get(end).filter(|n| n.file == fi && span.saturating_add(n.bytes) <= window) {
            span += n.bytes;
            end += 1;
        }
        sizes.push(end - start);
        start = end;
    }
    let mut it = targets.into_iter();
    for n in sizes {
        let win: Vec<Target<'_>> = it.by_ref().take(n).collect();
        let fi = win[0].file as usize;
        let header = vec![0u8; if header_in_window[fi] { 0 } else { meta.files[fi].data_start as usize }];
        header_in_window[fi] = true;
        windows.push(Window { file: fi, header, targets: win, stretches: Vec::new() });
    }
    let in_flight = reads_in_flight(storage);
    // Read in parts small enough to be checked while still in the CPU's cache (and no larger
    // than the largest read asked for), where a store reads in windows (local disk); in one
    // request per window otherwise.
    let hot = match storage.hints().read_window {
        Some(_) => usize::try_from(read_bytes_max).unwrap_or(usize::MAX).clamp(1, HOT_BYTES),
        None => usize::MAX,
    };
    // Stretches of shared blocks read so far, as (piece, offset in it, bytes, raw CRC); their
    // parts are computed once every stretch of their piece is in.
    let mut stretches: Vec<Stretch> = Vec::new();
    let mut ws = windows.into_iter().peekable();
    while ws.peek().is_some() {
        let mut batch: Vec<Window<'_>> = ws.by_ref().take(in_flight).collect();
        in_parallel(&mut batch, |w| read_checked(storage, meta, pieces, hot, w))?;
        // What follows each window of the batch: the next window's file and first piece.
        let after: Vec<Option<(usize, usize)>> =
            batch.iter().skip(1).chain(ws.peek()).map(|w| Some((w.file, w.targets[0].piece))).chain([None]).collect();
        // The next window of the last one's file is read ahead (as a whole, deeper than the
        // kernel's own readahead) from here on. Asking for it before this window was read
        // made a cold load slower in stop 13: the request can block on a busy queue.
        if let Some(n) = ws.peek().filter(|n| batch.last().is_some_and(|w| w.file == n.file)) {
            storage.prefetch(&meta.files[n.file].name, n.targets[0].at, window);
        }
        for (w, next) in batch.into_iter().zip(after) {
            bytes_read += w.header.len() as u64 + w.targets.iter().map(|t| t.bytes).sum::<u64>();
            stretches.extend(w.stretches);
            // Targets are in file order, so only the piece the next window of this file
            // starts in can have stretches still to come.
            let open = next.filter(|n| n.0 == w.file).map(|n| n.1);
            let done = stretches.iter().rposition(|s| Some(s.piece) != open).map_or(0, |i| i + 1);
            for same in stretches[..done].chunk_by(|a, b| a.piece == b.piece) {
                let p = &pieces[same[0].piece];
                let mut list: Vec<(u64, u64, u32)> = same.iter().map(|s| (s.at, s.len, s.raw)).collect();
                // In order already, unless two requests take alternate rows of one chunk.
                list.sort_unstable_by_key(|s| s.0);
                let key = p.chunk.expect("only tensor chunks are shared");
                shared_check::parts_of(key, p.len, block, &list, &mut parts);
            }
            stretches.drain(..done);
        }
    }
    let mut staged_files: Vec<u32> = staged.iter().map(|c| pieces[c.piece].file).collect();
    staged_files.sort_unstable();
    staged_files.dedup();
    for fi in staged_files.into_iter().filter(|&fi| !header_in_window[fi as usize]) {
        let f = &meta.files[fi as usize];
        let mut header = vec![0u8; f.data_start as usize];
        storage.read_into(&f.name, &mut [(0, &mut header[..])])?;
        bytes_read += header.len() as u64;
        verify_header(f, &header)?;
    }
    bytes_read += execute_partial(storage, meta, pieces, staged, dests, read_bytes_max)?;
    Ok((bytes_read, parts))
}

/// Requests an object store serves at once: a load fetches this many files together.
const READS_IN_FLIGHT: usize = 4;

/// How many reads (or size checks) a load runs at once: one on a store with a read window
/// (local disk: each window read and checked a part at a time, the next one prefetched),
/// [`READS_IN_FLIGHT`] on one without (object stores, where each is a request).
fn reads_in_flight(storage: &dyn Storage) -> usize {
    if storage.hints().read_window.is_some() { 1 } else { READS_IN_FLIGHT }
}

/// `f` on each item, each on a thread of its own when there are several; the first error
/// in item order.
fn in_parallel<T: Send>(items: &mut [T], f: impl Fn(&mut T) -> Result<()> + Sync) -> Result<()> {
    if let [one] = items {
        return f(one);
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = items.iter_mut().map(|item| s.spawn(|| f(item))).collect();
        handles.into_iter().try_for_each(|h| {
            h.join().unwrap_or_else(|_| Err(Error::Protocol { detail: "a read thread panicked".into() }))
        })
    })
}

/// Direct reads of one file, read in one request (or in parts of [`HOT_BYTES`]).
struct Window<'a> {
    file: usize,
    /// The file's header when this is its first window, else empty.
    header: Vec<u8>,
    targets: Vec<Target<'a>>,
    /// The shared targets' rows as read, each split at block boundaries, with their CRCs.
    stretches: Vec<Stretch>,
}

/// A stretch of a shared chunk this rank read: `len` bytes at `at` in piece `piece`, inside
/// one checksum block, and their [`split_crc::raw`] CRC.
struct Stretch {
    piece: usize,
    at: u64,
    len: u64,
    raw: u32,
}

/// Bytes a load asks a store with a read window (local disk) for at a time, and checks as
/// soon as they are in: few enough to still be in the CPU's cache. CRC-32 ran at 45 GB/s
/// over 64 KiB to 1 MiB, at 10 GB/s over a 64 MiB buffer (2 MiB of L2 per core here).
/// Checking each 64 MiB window after reading it, a same-layout load of 2.6 GB on 4 ranks
/// (tmpfs) took a fifth longer; 512 KiB came out a little ahead of 128 and 256 KiB.
const HOT_BYTES: usize = 512 << 10;

/// What one read of a window's batch holds, for the check after it.
#[derive(Clone, Copy)]
enum Holds {
    Header,
    /// Bytes of a target checked block by block (index in the window).
    Blocks(usize),
    /// One row of a shared target: its offset in piece `piece`.
    Row {
        piece: usize,
        at: u64,
    },
}

/// Reads window `w` in batches of about `hot` bytes (one request when `hot` is
/// `usize::MAX`; a row of a shared target is never split, so a batch can hold more) and
/// checks each batch right after it is read: the file's header against its CRC, the blocks
/// of plain targets against theirs, the rows of shared ones into CRC'd stretches for the
/// parts.
fn read_checked(
    storage: &dyn Storage,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    hot: usize,
    w: &mut Window<'_>,
) -> Result<()> {
    let Window { file, header, targets, stretches } = w;
    let name = &meta.files[*file].name;
    let block = meta.block_bytes;
    let mut checks: Vec<Option<BlockCheck<'_>>> = targets
        .iter()
        .map(|t| (!t.shared).then(|| BlockCheck::new(name, t.at, pieces[t.piece].crc32, block, t.src / block)))
        .collect();
    let mut reads: Vec<(u64, &mut [u8])> = Vec::new();
    let mut holds: Vec<Holds> = Vec::new();
    let mut pending = 0;
    let mut reader = storage.reader(name)?;
    let mut flush = |reads: &mut Vec<(u64, &mut [u8])>, holds: &mut Vec<Holds>| -> Result<()> {
        reader.read_into(reads)?;
        for ((_, buf), h) in reads.iter().zip(holds.iter()) {
            match *h {
                Holds::Header => verify_header(&meta.files[*file], buf)?,
                Holds::Blocks(i) => checks[i].as_mut().expect("a plain target").update(buf)?,
                Holds::Row { piece, mut at } => {
                    let mut data: &[u8] = buf;
                    while !data.is_empty() {
                        let n = (((at / block + 1) * block - at) as usize).min(data.len());
                        stretches.push(Stretch { piece, at, len: n as u64, raw: split_crc::raw(&data[..n]) });
                        at += n as u64;
                        data = &data[n..];
                    }
                }
            }
        }
        reads.clear();
        holds.clear();
        Ok(())
    };
    if !header.is_empty() {
        pending += header.len();
        reads.push((0, &mut header[..]));
        holds.push(Holds::Header);
        if pending >= hot {
            flush(&mut reads, &mut holds)?;
            pending = 0;
        }
    }
    for (i, t) in targets.iter_mut().enumerate() {
        let (at, step, piece, src) = (t.at, t.step, t.piece, t.src);
        if t.shared {
            // Rows are read whole: a row's CRC is computed in one piece.
            let rows = std::iter::once(&mut *t.buf).chain(t.more.iter_mut().map(|b| &mut **b));
            for (k, b) in rows.enumerate() {
                let k = k as u64;
                pending += b.len();
                reads.push((at + k * step, b));
                holds.push(Holds::Row { piece, at: src + k * step });
                if pending >= hot {
                    flush(&mut reads, &mut holds)?;
                    pending = 0;
                }
            }
        } else {
            debug_assert!(t.more.is_empty(), "only shared targets have rows");
            let (mut rest, mut at): (&mut [u8], u64) = (&mut *t.buf, at);
            while !rest.is_empty() {
                let n = rest.len().min(hot - pending);
                let (now, later) = std::mem::take(&mut rest).split_at_mut(n);
                reads.push((at, now));
                pending += n;
                at += n as u64;
                holds.push(Holds::Blocks(i));
                rest = later;
                if pending >= hot {
                    flush(&mut reads, &mut holds)?;
                    pending = 0;
                }
            }
        }
    }
    if !reads.is_empty() {
        flush(&mut reads, &mut holds)?;
    }
    checks.into_iter().flatten().try_for_each(BlockCheck::finish)
}

/// A direct read: bytes of a stored piece straight into (part of) a destination buffer, or
/// rows of them, `step` apart in the piece, each into its own slice.
struct Target<'a> {
    file: u32,
    /// File offset of the first byte.
    at: u64,
    piece: usize,
    /// Offset of the first byte in the piece.
    src: u64,
    step: u64,
    /// Checked in parts with the other ranks rather than block by block here.
    shared: bool,
    /// Bytes of all rows.
    bytes: u64,
    /// The first row.
    buf: &'a mut [u8],
    /// The rows after it.
    more: Vec<&'a mut [u8]>,
}

impl<'a> Target<'a> {
    /// The first row of `c` (of piece `p`) into `buf`.
    fn new(p: &Stored<'_>, c: &Copy, step: u64, buf: &'a mut [u8]) -> Target<'a> {
        let (file, at, bytes) = (p.file, p.at + c.src, buf.len() as u64);
        Target { file, at, piece: c.piece, src: c.src, step, shared: c.shared, bytes, buf, more: Vec::new() }
    }
}

/// Staged reads go through a buffer of about this size (whole checksum blocks, so at least
/// one): small enough to stay in cache between the read, the checksum and the copy out.
const STAGE_BYTES: u64 = 4 << 20;

fn execute_partial(
    storage: &dyn Storage,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    mut copies: Vec<Copy>,
    dests: &mut [&mut [u8]],
    read_bytes_max: u64,
) -> Result<u64> {
    let block = meta.block_bytes;
    let window = (read_bytes_max.min(STAGE_BYTES) / block).max(1);
    if copies.iter().any(|c| c.rows > 1) {
        copies = copies.iter().flat_map(Copy::each_row).collect();
    }
    copies.sort_unstable_by_key(|c| (c.piece, c.src));
    let mut buf: Vec<u8> = Vec::new();
    let mut bytes_read = 0;
    for group in copies.chunk_by(|a, b| a.piece == b.piece) {
        let p = &pieces[group[0].piece];
        let f = &meta.files[p.file as usize];
        // Blocks the copies touch, merged into runs, read a window at a time.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for c in group {
            let (b0, b1) = (c.src / block, (c.src + c.len).div_ceil(block));
            match runs.last_mut() {
                Some(r) if b0 <= r.1 => r.1 = r.1.max(b1),
                _ => runs.push((b0, b1)),
            }
        }
        for (b_lo, b_hi) in runs {
            let mut b = b_lo;
            while b < b_hi {
                let e = (b + window).min(b_hi);
                let (lo, hi) = (b * block, (e * block).min(p.len));
                buf.resize((hi - lo) as usize, 0);
                storage.read_into(&f.name, &mut [(p.at + lo, &mut buf[..])])?;
                bytes_read += hi - lo;
                verify_blocks(&f.name, p.at + lo, p.crc32, block, b, &buf)?;
                for c in group {
                    let (s, t) = (c.src.max(lo), (c.src + c.len).min(hi));
                    if s < t {
                        let d = &mut dests[c.dest];
                        let at = (c.dest_at + s - c.src) as usize;
                        d[at..at + (t - s) as usize].copy_from_slice(&buf[(s - lo) as usize..(t - lo) as usize]);
                    }
                }
                b = e;
            }
        }
    }
    Ok(bytes_read)
}

/// Verifies `buf`, which holds a piece's blocks from `first_block` on (read at file byte
/// `at`), against the piece's stored block checksums.
fn verify_blocks(file: &str, at: u64, crcs: &[u8], block: u64, first_block: u64, buf: &[u8]) -> Result<()> {
    let mut check = BlockCheck::new(file, at, crcs, block, first_block);
    check.update(buf)?;
    check.finish()
}

/// Checks a piece's bytes from the start of its block `first_block` on (file byte `at`),
/// given in order a slice at a time, against the piece's stored block checksums: each block
/// as soon as its last byte is in, a short last block at [`BlockCheck::finish`].
struct BlockCheck<'c> {
    file: &'c str,
    at: u64,
    crcs: &'c [u8],
    block: u64,
    first_block: u64,
    /// Blocks checked so far.
    done: u64,
    /// Bytes of the current block hashed so far.
    filled: u64,
    hasher: crc32fast::Hasher,
}

impl<'c> BlockCheck<'c> {
    fn new(file: &'c str, at: u64, crcs: &'c [u8], block: u64, first_block: u64) -> BlockCheck<'c> {
        BlockCheck { file, at, crcs, block, first_block, done: 0, filled: 0, hasher: crc32fast::Hasher::new() }
    }

    fn update(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let n = ((self.block - self.filled) as usize).min(data.len());
            self.hasher.update(&data[..n]);
            self.filled += n as u64;
            data = &data[n..];
            if self.filled == self.block {
                self.check()?;
            }
        }
        Ok(())
    }

    /// Checks the block hashed so far.
    fn check(&mut self) -> Result<()> {
        let b = self.first_block + self.done;
        let offset = self.at + self.done * self.block;
        let actual = std::mem::take(&mut self.hasher).finalize();
        let bytes = std::mem::take(&mut self.filled);
        self.done += 1;
        let Some(stored) = block_crc(self.crcs, b) else {
            return Err(Error::Checksum {
                rank: None,
                file: self.file.to_string(),
                offset,
                detail: format!("no checksum for block {b}"),
            });
        };
        if stored != actual {
            return Err(Error::Checksum {
                rank: None,
                file: self.file.to_string(),
                offset,
                detail: format!("{bytes} bytes: stored crc32 {stored:08x}, computed {actual:08x}"),
            });
        }
        Ok(())
    }

    /// Checks the last, short block, if any.
    fn finish(mut self) -> Result<()> {
        if self.filled > 0 { self.check() } else { Ok(()) }
    }
}

#[cfg(test)]
mod tests {
    use super::finder;

    #[test]
    fn finder_finds_keys_in_any_order_and_repeated() {
        let list = ["a", "b.0", "b.1", "c", "d"];
        let mut find = finder(&list, |s| s);
        let asked = ["a", "b.0", "b.1", "x", "c", "c", "a", "d", "", "e", "b.1"];
        let got: Vec<Option<usize>> = asked.iter().map(|k| find(k)).collect();
        let want: Vec<Option<usize>> = asked.iter().map(|k| list.iter().position(|s| s == k)).collect();
        assert_eq!(got, want);
        let mut none = finder(&[] as &[&str], |s| s);
        assert_eq!(none("a"), None);
    }
}
