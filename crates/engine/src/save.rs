//! Save: plan (with the coverage proof), stream every rank's chunks into its data file,
//! commit the metadata file last, and make every rank return the same outcome.

use std::collections::BTreeMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::Bytes;
use dckpt_collective::{Collective, ReduceOp};
use dckpt_shard_spec::{Dims, ShardedObject, ShardedTensor, TensorDecl};
use dckpt_storage::{Storage, StorageExt, WriterOptions};
use serde::{Deserialize, Serialize};

use crate::error::first_failure;
use crate::format::{
    BLOCK_BYTES_DEFAULT, BlockCrc, ChunkMeta, ChunkView, FORMAT_VERSION, FileMeta, META_NAME, Metadata, MetadataView,
    ObjectEntry, ObjectMeta, SafetensorsEntry, TensorMeta, TensorView, data_file_name, encode_view, is_data_file_name,
    safetensors_header,
};
use crate::plan::{Assignment, LocalPlan, ObjectItem, RankWrites, SavePlan, file_order, plan_save};
use crate::protocol::{COORDINATOR, gather_decide, gather_decide_each};
use crate::{Error, Result};

/// A tensor piece with its bytes: `region.numel() * dtype.size()` bytes in row-major order.
#[derive(Debug, Clone)]
pub struct TensorData<'a> {
    pub tensor: ShardedTensor,
    pub data: &'a [u8],
}

/// An object with its bytes.
#[derive(Debug, Clone)]
pub struct ObjectData<'a> {
    pub object: ShardedObject,
    pub data: &'a [u8],
}

/// What one rank hands to a save. Empty is fine.
///
/// ```
/// use dckpt_engine::SaveState;
/// use dckpt_shard_spec::{DType, ShardedObject, ShardedTensor};
///
/// let (w, rng) = (vec![0u8; 16], b"seed".to_vec());
/// let state = SaveState::new()
///     .tensor(ShardedTensor::whole("w", DType::F32, [4]), &w)
///     .object(ShardedObject::single("rng"), &rng);
/// assert_eq!((state.tensors.len(), state.objects.len()), (1, 1));
/// ```
#[derive(Debug, Clone, Default)]
pub struct SaveState<'a> {
    pub tensors: Vec<TensorData<'a>>,
    pub objects: Vec<ObjectData<'a>>,
}

impl<'a> SaveState<'a> {
    /// An empty state (a rank with nothing to save is an ordinary rank).
    pub fn new() -> SaveState<'a> {
        SaveState::default()
    }

    /// With one more tensor piece and its bytes (`tensor.nbytes()` of them, row-major).
    pub fn tensor(mut self, tensor: ShardedTensor, data: &'a [u8]) -> SaveState<'a> {
        self.push_tensor(tensor, data);
        self
    }

    /// With one more object and its bytes.
    pub fn object(mut self, object: ShardedObject, data: &'a [u8]) -> SaveState<'a> {
        self.push_object(object, data);
        self
    }

    /// Adds a tensor piece and its bytes.
    pub fn push_tensor(&mut self, tensor: ShardedTensor, data: &'a [u8]) {
        self.tensors.push(TensorData { tensor, data });
    }

    /// Adds an object and its bytes.
    pub fn push_object(&mut self, object: ShardedObject, data: &'a [u8]) {
        self.objects.push(ObjectData { object, data });
    }
}

/// How to save. Every rank must pass the same options.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    pub assignment: Assignment,
    /// The model's global tensors; when given, the plan proves the state is exactly these.
    pub declared: Option<Vec<TensorDecl>>,
    /// Replace a committed checkpoint instead of failing with [`Error::AlreadyExists`].
    pub replace: bool,
    /// Checksum block of data files.
    pub block_bytes: u64,
    /// Recorded in the metadata as the layout the state was saved with.
    pub layout: BTreeMap<String, String>,
    /// For [`crate::Engine::save_async`]: keep the host copy of the state once the save is
    /// done, and copy the next background save into it. A training loop that saves every so
    /// many steps then pays for fresh memory once, not at every save (the copy is what the
    /// caller waits for), at the price of holding a copy of its state between saves.
    /// A background save without it releases them, as does
    /// [`crate::Engine::release_staging`]; [`crate::Engine::staging_bytes`] tells how much
    /// is kept.
    pub keep_staging: bool,
    /// The save's id, which begins the name of each of its data files. `None`: a
    /// fresh random id that every rank agrees on. Giving one makes a save's file names
    /// deterministic (replays in tests, `format!("{step:016x}")`); it must be 16
    /// hexadecimal digits ([`is_save_id`](crate::format::is_save_id)), and different from the id of
    /// any save whose files may still be there.
    pub save_id: Option<String>,
}

impl SaveOptions {
    /// Whether to replace a committed checkpoint instead of failing with
    /// [`Error::AlreadyExists`].
    pub fn replace(self, replace: bool) -> SaveOptions {
        SaveOptions { replace, ..self }
    }

    /// The model's global tensors, which the plan then proves the state is exactly.
    pub fn declared(self, declared: Vec<TensorDecl>) -> SaveOptions {
        SaveOptions { declared: Some(declared), ..self }
    }

    /// How writers are chosen among the holders of each chunk.
    pub fn assignment(self, assignment: Assignment) -> SaveOptions {
        SaveOptions { assignment, ..self }
    }

    /// One more entry of the layout recorded in the metadata (`"tp" = "2"`, ...).
    pub fn layout_entry(mut self, name: impl Into<String>, value: impl ToString) -> SaveOptions {
        self.layout.insert(name.into(), value.to_string());
        self
    }

    /// A given save id instead of a random one (see [`SaveOptions::save_id`]).
    pub fn save_id(self, id: impl Into<String>) -> SaveOptions {
        SaveOptions { save_id: Some(id.into()), ..self }
    }

    /// Keep the host copy of a background save for the next one (see
    /// [`SaveOptions::keep_staging`]).
    pub fn keep_staging(self, keep: bool) -> SaveOptions {
        SaveOptions { keep_staging: keep, ..self }
    }
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            assignment: Assignment::Balanced,
            declared: None,
            replace: false,
            block_bytes: BLOCK_BYTES_DEFAULT,
            layout: BTreeMap::new(),
            keep_staging: false,
            save_id: None,
        }
    }
}

/// What a committed save did; the same on every rank except `rank_bytes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaveOutcome {
    pub save_id: String,
    /// Bytes of chunk data and objects written by all ranks.
    pub bytes: u64,
    pub files: usize,
    pub chunks: usize,
    /// Bytes this rank wrote.
    pub rank_bytes: u64,
    /// Whether the plan of the previous save was reused.
    pub plan_reused: bool,
}

/// What one rank remembers between saves for the plan cache.
#[derive(Debug, Default)]
pub(crate) struct PlanCache {
    structure: Option<u64>,
    writes: RankWrites,
    /// The global plan, on the coordinator only.
    plan: Option<SavePlan>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Go {
    save_id: String,
    /// This rank's writes, or `None` when the cached plan stands.
    writes: Option<RankWrites>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct WriteResult {
    /// The rank's data files, in order (none when it wrote nothing).
    files: Vec<FileMeta>,
    /// Each written tensor chunk, then each written object, in write order: which of the
    /// rank's files holds it, its byte offset there, and where its block checksums end in
    /// `crcs` (they start where the previous piece's end).
    pieces: Vec<(u32, u64, u64)>,
    /// Every piece's block checksums, back to back (one buffer, not one per piece).
    crcs: serde_bytes::ByteBuf,
}

/// Saves `state` as one rank of `coll`. See the crate docs for the protocol.
pub(crate) fn save(
    storage: &dyn Storage,
    coll: &dyn Collective,
    state: &SaveState<'_>,
    opts: &SaveOptions,
    cache: &mut PlanCache,
) -> Result<SaveOutcome> {
    let rank = coll.rank();
    let local_check = check_save_id(opts).and_then(|()| check_buffers(state));
    let structure = structure_hash(state, opts);
    let reuse = local_check.is_ok() && cache.structure == Some(structure);
    let v = coll.all_reduce_u64(&[u64::from(reuse), random_u64()], ReduceOp::Min)?;
    let (all_reuse, seed) = (v[0] == 1, v[1]);
    let save_id = opts.save_id.clone().unwrap_or_else(|| format!("{seed:016x}"));

    // Phase 1: plan. The coordinator validates, assigns writers and checks the target.
    let go: Result<Go> = if all_reuse {
        let local_ok: Result<()> = Ok(());
        gather_decide(coll, local_ok, "save decision", |_| {
            check_target(storage, opts)
                .map(|()| Go { save_id: save_id.clone(), writes: None })
                .map_err(|e| e.on_rank(COORDINATOR as u32))
        })?
    } else {
        // The shard list is copied only when it is planned: not when the cached plan stands.
        let local = LocalPlan {
            tensors: state.tensors.iter().map(|t| t.tensor.clone()).collect(),
            objects: state
                .objects
                .iter()
                .map(|o| ObjectItem { object: o.object.clone(), nbytes: o.data.len() as u64 })
                .collect(),
        };
        let msg: Result<LocalPlan> = local_check.map(|()| local);
        let mut plan_out = None;
        // Each rank hears only its own writes: at scale the whole list is large.
        let go = gather_decide_each(coll, msg, "save plan", |all| {
            let world = all.len();
            match decide(storage, opts, all) {
                Ok(plan) => {
                    let each = plan
                        .ranks
                        .iter()
                        .map(|w| Ok(Go { save_id: save_id.clone(), writes: Some(w.clone()) }))
                        .collect();
                    plan_out = Some(plan);
                    each
                }
                Err(e) => {
                    let mut each: Vec<Result<Go>> = (1..world).map(|_| Err(e.replicate())).collect();
                    each.insert(COORDINATOR, Err(e));
                    each
                }
            }
        })?;
        if rank == COORDINATOR {
            cache.plan = plan_out;
        }
        go
    };
    let go = go?;
    let plan_reused = go.writes.is_none();
    if let Some(writes) = go.writes {
        cache.writes = writes;
        cache.structure = Some(structure);
    }

    // Phase 2: every rank streams its chunks; a rank with nothing to write writes no file.
    let result = write_rank_files(storage, state, &cache.writes, &go.save_id, rank, opts.block_bytes);

    // Phase 3: the coordinator commits only if every rank succeeded.
    let plan = cache.plan.as_ref();
    let outcome: Result<SaveOutcome> = gather_decide(coll, result, "save commit", |all| {
        commit(storage, opts, plan.expect("the coordinator holds the plan"), &go.save_id, all, plan_reused)
            .map_err(|e| e.on_rank(COORDINATOR as u32))
    })?;
    let mut outcome = outcome?;
    outcome.rank_bytes = cache.writes.bytes;
    Ok(outcome)
}

fn check_save_id(opts: &SaveOptions) -> Result<()> {
    match &opts.save_id {
        Some(id) if !crate::format::is_save_id(id) => Err(Error::InvalidOptions {
            rank: None,
            detail: format!(
                "save id {id:?}: must be {} hexadecimal digits, the shape of the data file names a save may remove",
                crate::format::SAVE_ID_DIGITS
            ),
        }),
        _ => Ok(()),
    }
}

fn check_buffers(state: &SaveState<'_>) -> Result<()> {
    for t in &state.tensors {
        if t.data.len() as u64 != t.tensor.nbytes() {
            return Err(Error::Request {
                rank: None,
                key: t.tensor.key.to_string(),
                detail: format!(
                    "region {}: buffer has {} bytes, the region needs {}",
                    t.tensor.region,
                    t.data.len(),
                    t.tensor.nbytes()
                ),
            });
        }
    }
    Ok(())
}

/// Hash of everything the plan depends on: this rank's shard list and the options.
fn structure_hash(state: &SaveState<'_>, opts: &SaveOptions) -> u64 {
    let mut h = DefaultHasher::new();
    state.tensors.len().hash(&mut h);
    for t in &state.tensors {
        t.tensor.hash(&mut h);
    }
    state.objects.len().hash(&mut h);
    for o in &state.objects {
        o.object.hash(&mut h);
        o.data.len().hash(&mut h);
    }
    opts.assignment.hash(&mut h);
    opts.declared.hash(&mut h);
    h.finish()
}

fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    std::time::SystemTime::now().hash(&mut h);
    std::process::id().hash(&mut h);
    h.finish()
}

/// Refuses to write over a committed checkpoint unless asked to replace it.
fn check_target(storage: &dyn Storage, opts: &SaveOptions) -> Result<()> {
    match storage.exists(META_NAME)? {
        true if !opts.replace => Err(Error::AlreadyExists { rank: None, location: storage.location(META_NAME) }),
        _ => Ok(()),
    }
}

/// On the coordinator: every rank's shard list in, the validated plan out, or the first
/// failure, stamped with the rank that had it.
fn decide(storage: &dyn Storage, opts: &SaveOptions, all: Vec<Result<LocalPlan>>) -> Result<SavePlan> {
    let locals = first_failure(all)?;
    let here = |e: Error| e.on_rank(COORDINATOR as u32);
    let plan = plan_save(&locals, opts.declared.as_deref(), opts.assignment).map_err(here)?;
    check_target(storage, opts).map_err(here)?;
    Ok(plan)
}

/// A chunk's entry in its data file's safetensors header: named `key@region`, shaped as
/// its box (or flat, for a narrowed region).
fn tensor_entry(
    key: &str,
    region: &dckpt_shard_spec::Region,
    dtype: dckpt_shard_spec::DType,
    len: u64,
) -> SafetensorsEntry {
    let shape = if region.is_whole_box() { region.shape.clone() } else { Dims::from([region.numel()]) };
    SafetensorsEntry { name: crate::format::chunk_entry_name(key, region), dtype, shape, len }
}

fn object_entry(key: &str, grid_offset: &[u64], len: u64) -> SafetensorsEntry {
    SafetensorsEntry {
        name: format!("{key}@object{grid_offset:?}"),
        dtype: dckpt_shard_spec::DType::U8,
        shape: Dims::from([len]),
        len,
    }
}

fn rank_header(entries: &[SafetensorsEntry], save_id: &str, rank: usize) -> Vec<u8> {
    let meta = BTreeMap::from([
        ("format".to_string(), "dckpt".to_string()),
        ("save_id".to_string(), save_id.to_string()),
        ("rank".to_string(), rank.to_string()),
    ]);
    safetensors_header(entries, &meta)
}

/// The metadata a save of `plan` would commit to a store whose objects are at most
/// `file_bytes_max` bytes (the store's `object_bytes_max` hint): data files laid out exactly as the
/// save lays them, block checksum lists sized but holding placeholders (headers and their
/// checksums are real: they need no data). For sizing and inspection without any data.
pub fn planned_metadata(plan: &SavePlan, opts: &SaveOptions, save_id: &str, file_bytes_max: Option<u64>) -> Metadata {
    let results = planned_results(plan, opts, save_id, file_bytes_max);
    build_metadata(opts, plan, save_id, results).expect("a plan's own layout is consistent")
}

/// The write results a save of `plan` would gather, checksums left zero.
fn planned_results(
    plan: &SavePlan,
    opts: &SaveOptions,
    save_id: &str,
    file_bytes_max: Option<u64>,
) -> Vec<WriteResult> {
    let (chunk_pos, object_pos) = file_order(plan);
    let mut placed: Vec<Vec<(usize, SafetensorsEntry)>> = vec![Vec::new(); plan.ranks.len()];
    for (c, &k) in plan.chunks.iter().zip(&chunk_pos) {
        placed[c.writer as usize].push((k, tensor_entry(&c.key, &c.region, c.dtype, c.nbytes)));
    }
    for (o, &k) in plan.objects.iter().zip(&object_pos) {
        placed[o.writer as usize].push((k, object_entry(&o.key, &o.grid_offset, o.nbytes)));
    }
    placed
        .into_iter()
        .enumerate()
        .map(|(rank, mut p)| {
            p.sort_unstable_by_key(|e| e.0);
            let entries: Vec<SafetensorsEntry> = p.into_iter().map(|e| e.1).collect();
            let mut result = WriteResult::default();
            for (fi, file) in cut_files(&entries, save_id, rank, file_bytes_max).into_iter().enumerate() {
                let mut pos = file.header.len() as u64;
                for x in &entries[file.pieces.clone()] {
                    let crcs = 4 * crate::format::blocks_in(x.len, opts.block_bytes) as usize;
                    let len = result.crcs.len() + crcs;
                    result.crcs.resize(len, 0);
                    result.pieces.push((fi as u32, pos, result.crcs.len() as u64));
                    pos += x.len;
                }
                result.files.push(file.meta(pos, save_id, rank, fi));
            }
            result
        })
        .collect()
}

/// One data file of a rank: which of its pieces (in file order) it holds, and its header.
struct FileCut {
    pieces: std::ops::Range<usize>,
    header: Vec<u8>,
}

impl FileCut {
    fn meta(&self, bytes: u64, save_id: &str, rank: usize, file: usize) -> FileMeta {
        FileMeta {
            name: data_file_name(save_id, rank, file),
            bytes,
            data_start: self.header.len() as u64,
            header_crc32: crc32fast::hash(&self.header),
        }
    }
}

/// A rank's pieces (in file order) cut into data files: one file when `max` is `None`, else
/// consecutive runs that keep each file, header included, within `max` bytes, where the
/// pieces allow (a piece larger than that gets a file of its own). No pieces, no files.
fn cut_files(entries: &[SafetensorsEntry], save_id: &str, rank: usize, max: Option<u64>) -> Vec<FileCut> {
    let max = max.unwrap_or(u64::MAX);
    let mut files = Vec::new();
    let mut start = 0;
    while start < entries.len() {
        // The longest run whose data fits, then shorter by about what the header overshoots
        // (a header is a small fraction of the file: it is built two or three times).
        let (mut end, mut data) = (start + 1, entries[start].len);
        while let Some(e) = entries.get(end).filter(|e| data.saturating_add(e.len) <= max) {
            data += e.len;
            end += 1;
        }
        loop {
            let header = rank_header(&entries[start..end], save_id, rank);
            let size = header.len() as u64 + data;
            if size <= max || end == start + 1 {
                files.push(FileCut { pieces: start..end, header });
                break;
            }
            let header_per_piece = header.len() as u64 / (end - start) as u64 + 1;
            let mut excess = size - max;
            while end > start + 1 && excess > 0 {
                end -= 1;
                data -= entries[end].len;
                excess = excess.saturating_sub(entries[end].len + header_per_piece);
            }
        }
        start = end;
    }
    files
}

/// About how many bytes are checksummed and then handed to the writer at once.
const WRITE_BATCH_BYTES: usize = 8 << 20;

/// Data files of one rank written at once. On an object store each file is one request
/// buffered whole (at most the store's `object_bytes_max` hint), so this bounds that memory
/// and keeps several requests in flight; on local disk a rank writes one file.
const FILES_IN_FLIGHT: usize = 4;

/// Writes this rank's pieces into its data files (none when it has nothing to write).
/// On failure the files it finished are removed again.
fn write_rank_files(
    storage: &dyn Storage,
    state: &SaveState<'_>,
    writes: &RankWrites,
    save_id: &str,
    rank: usize,
    block_bytes: u64,
) -> Result<WriteResult> {
    let mut entries = Vec::with_capacity(writes.chunks());
    let mut data: Vec<&[u8]> = Vec::with_capacity(writes.chunks());
    for &i in &writes.tensors {
        let t =
            state.tensors.get(i as usize).ok_or_else(|| Error::Protocol { detail: format!("write of tensor {i}") })?;
        entries.push(tensor_entry(&t.tensor.key, &t.tensor.region, t.tensor.dtype, t.data.len() as u64));
        data.push(t.data);
    }
    for &i in &writes.objects {
        let o =
            state.objects.get(i as usize).ok_or_else(|| Error::Protocol { detail: format!("write of object {i}") })?;
        entries.push(object_entry(&o.object.key, &o.object.grid_offset, o.data.len() as u64));
        data.push(o.data);
    }
    let cuts = cut_files(&entries, save_id, rank, storage.hints().object_bytes_max);
    // Workers take the next file until none is left or one failed.
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let mut done: Vec<(usize, Result<WrittenFile>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..FILES_IN_FLIGHT.min(cuts.len()))
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(cut) = cuts.get(i).filter(|_| !failed.load(Ordering::Relaxed)) else {
                            return mine;
                        };
                        let res = write_file(storage, cut, &data[cut.pieces.clone()], save_id, rank, i, block_bytes);
                        failed.fetch_or(res.is_err(), Ordering::Relaxed);
                        mine.push((i, res));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| {
                w.join().unwrap_or_else(|_| {
                    vec![(0, Err(Error::Protocol { detail: format!("rank {rank}: a write thread panicked") }))]
                })
            })
            .collect()
    });
    done.sort_by_key(|d| d.0);
    let mut result = WriteResult::default();
    let mut first_err = None;
    for (i, res) in done {
        match res {
            Ok(WrittenFile { meta, pieces, crcs }) => {
                result.files.push(meta);
                let before = result.crcs.len() as u64;
                result.pieces.extend(pieces.into_iter().map(|(at, end)| (i as u32, at, before + end)));
                if result.crcs.is_empty() {
                    result.crcs = serde_bytes::ByteBuf::from(crcs);
                } else {
                    result.crcs.extend_from_slice(&crcs);
                }
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        for f in &result.files {
            let _ = storage.delete(&f.name);
        }
        return Err(e);
    }
    Ok(result)
}

/// A data file as written.
struct WrittenFile {
    meta: FileMeta,
    /// Each piece's offset in the file and where its block checksums end in `crcs`.
    pieces: Vec<(u64, u64)>,
    crcs: Vec<u8>,
}

/// Streams one data file: its header, then its pieces' bytes, each piece's blocks
/// checksummed on the way.
fn write_file(
    storage: &dyn Storage,
    cut: &FileCut,
    data: &[&[u8]],
    save_id: &str,
    rank: usize,
    file: usize,
    block_bytes: u64,
) -> Result<WrittenFile> {
    let data_start = cut.header.len() as u64;
    let total = data_start + data.iter().map(|d| d.len() as u64).sum::<u64>();
    let meta = cut.meta(total, save_id, rank, file);
    let name = &meta.name;
    let mut w = storage.writer(name, &WriterOptions { size_hint_bytes: Some(total) })?;
    w.write(&cut.header)?;
    let mut pieces = Vec::with_capacity(data.len());
    let mut crcs = Vec::with_capacity(4 * data.len());
    // The bytes go out in batches of about WRITE_BATCH_BYTES (a large tensor in several, many
    // small ones in one), each checksummed just before it is handed over, while the bytes
    // are hot. A second thread writes batch i while this one checksums batch i + 1; on local
    // disk a batch is one vectored write straight from the caller's memory.
    let written = std::thread::scope(|s| -> Result<u64> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<&[u8]>>(1);
        let writer = s.spawn(move || -> Result<u64> {
            for batch in rx {
                w.write_vectored(&batch)?;
            }
            Ok(w.finish()?)
        });
        let mut pos = data_start;
        let mut batch: Vec<&[u8]> = Vec::new();
        let mut batch_bytes = 0;
        'pieces: for d in data {
            let mut blocks = BlockCrc::new(block_bytes);
            for part in d.chunks(WRITE_BATCH_BYTES) {
                blocks.update(part);
                batch.push(part);
                batch_bytes += part.len();
                if batch_bytes >= WRITE_BATCH_BYTES {
                    batch_bytes = 0;
                    // A closed channel means the writer failed: its error is returned below.
                    if tx.send(std::mem::take(&mut batch)).is_err() {
                        break 'pieces;
                    }
                }
            }
            blocks.finish_into(&mut crcs);
            pieces.push((pos, crcs.len() as u64));
            pos += d.len() as u64;
        }
        if !batch.is_empty() {
            let _ = tx.send(batch);
        }
        drop(tx);
        writer.join().unwrap_or_else(|_| Err(Error::Protocol { detail: format!("{name}: the write thread panicked") }))
    })?;
    if written != total {
        return Err(Error::Protocol { detail: format!("{name}: wrote {written} bytes, expected {total}") });
    }
    Ok(WrittenFile { meta, pieces, crcs })
}

/// On the coordinator: build the metadata from the plan and every rank's write result and
/// commit it, or clean up this save's files if any rank failed.
fn commit(
    storage: &dyn Storage,
    opts: &SaveOptions,
    plan: &SavePlan,
    save_id: &str,
    results: Vec<Result<WriteResult>>,
    plan_reused: bool,
) -> Result<SaveOutcome> {
    if results.iter().any(|r| r.is_err()) {
        for f in results.iter().flatten().flat_map(|res| &res.files) {
            let _ = storage.delete(&f.name);
        }
    }
    let results = first_failure(results)?;
    let placed = place_all(plan, opts.block_bytes, results).map_err(|detail| Error::Protocol { detail })?;
    let bytes =
        Bytes::from(encode_metadata(opts, plan, save_id, &placed).map_err(|detail| Error::Protocol { detail })?);
    // The old checkpoint's files, to remove once a replacing commit has landed.
    let old = if opts.replace {
        storage.get(META_NAME).ok().and_then(|b| Metadata::decode_files(&b, META_NAME).ok())
    } else {
        None
    };
    match commit_metadata(storage, &bytes, opts.replace) {
        Commit::Landed => {
            let ours: std::collections::HashSet<&str> = placed.files.iter().map(|f| f.name.as_str()).collect();
            // Only what could be an old save's data file: never the metadata just committed,
            // whatever an old (or crafted) metadata file names.
            for f in old.iter().flatten().filter(|f| is_data_file_name(&f.name) && !ours.contains(f.name.as_str())) {
                let _ = storage.delete(&f.name);
            }
        }
        Commit::Failed(e) => {
            // Our metadata is certainly not there: our data files are garbage.
            for f in &placed.files {
                let _ = storage.delete(&f.name);
            }
            return Err(e);
        }
        Commit::Unknown(detail) => {
            // It may have landed: its data files must stay.
            return Err(Error::CommitUncertain { rank: None, location: storage.location(META_NAME), detail });
        }
    }
    Ok(SaveOutcome {
        save_id: save_id.to_string(),
        bytes: plan.total_bytes(),
        files: placed.files.len(),
        chunks: plan.chunks.len() + plan.objects.len(),
        rank_bytes: 0,
        plan_reused,
    })
}

/// What became of a commit.
enum Commit {
    Landed,
    /// It did not land (or another save's landed instead).
    Failed(Error),
    /// The write failed and reading back failed too.
    Unknown(String),
}

/// Writes the metadata file: a conditional create, or an atomic replace. An error does not
/// say whether the write landed (a lost reply, a retried create that finds its own first
/// attempt), so the stored bytes decide.
fn commit_metadata(storage: &dyn Storage, bytes: &Bytes, replace: bool) -> Commit {
    let attempt =
        if replace { storage.put(META_NAME, bytes.clone()) } else { storage.put_if_absent(META_NAME, bytes.clone()) };
    let Err(e) = attempt else { return Commit::Landed };
    match storage.get(META_NAME) {
        Ok(found) if found == *bytes => Commit::Landed,
        // Another save committed this checkpoint first.
        Ok(_) if matches!(e, dckpt_storage::Error::AlreadyExists { .. }) => {
            Commit::Failed(Error::AlreadyExists { rank: None, location: storage.location(META_NAME) })
        }
        Ok(_) | Err(dckpt_storage::Error::NotFound { .. }) => Commit::Failed(e.into()),
        Err(read_back) => Commit::Unknown(format!("{e} (reading it back: {read_back})")),
    }
}

/// Where every planned chunk and object landed, from the ranks' write results.
struct Placed {
    /// Every rank's files, in rank order.
    files: Vec<FileMeta>,
    /// For each of the plan's chunks: its file (index into `files`), offset, and its
    /// checksums as (writer, range of that writer's `crcs`).
    chunks: Vec<(u32, u64, (u32, std::ops::Range<usize>))>,
    /// Each rank's checksums, from its write result.
    crcs: Vec<serde_bytes::ByteBuf>,
    objects: Vec<ObjectMeta>,
}

impl Placed {
    fn crc32(&self, (rank, range): &(u32, std::ops::Range<usize>)) -> &[u8] {
        &self.crcs[*rank as usize][range.clone()]
    }
}

fn place_all(plan: &SavePlan, block_bytes: u64, results: Vec<WriteResult>) -> std::result::Result<Placed, String> {
    // Files in rank order; remember the index of each rank's first file.
    let mut files = Vec::new();
    let mut file_of = vec![0u32; results.len()];
    for (r, res) in results.iter().enumerate() {
        file_of[r] = files.len() as u32;
        files.extend(res.files.iter().cloned());
    }
    // Each chunk's position among its writer's pieces, as the writer laid them out.
    let (chunk_pos, object_pos) = file_order(plan);
    type Place = (u32, u64, (u32, std::ops::Range<usize>));
    let place = |writer: u32, k: usize, nbytes: u64| -> std::result::Result<Place, String> {
        let w = writer as usize;
        let r = results.get(w).ok_or_else(|| format!("no write result from rank {w}"))?;
        let &(file, at, end) = r.pieces.get(k).ok_or_else(|| format!("rank {w} reported fewer chunks than planned"))?;
        if file as usize >= r.files.len() {
            return Err(format!("rank {w} reported a chunk in its file {file} of {}", r.files.len()));
        }
        let start = if k == 0 { 0 } else { r.pieces[k - 1].2 };
        if start > end || end > r.crcs.len() as u64 {
            return Err(format!("rank {w} reported checksums {start}..{end} of its {} bytes of them", r.crcs.len()));
        }
        let want = 4 * crate::format::blocks_in(nbytes, block_bytes);
        if end - start != want {
            return Err(format!(
                "rank {w} reported {} bytes of checksums for a piece of {nbytes} bytes, not {want}",
                end - start
            ));
        }
        Ok((file_of[w] + file, at, (writer, start as usize..end as usize)))
    };
    let chunks = plan
        .chunks
        .iter()
        .zip(&chunk_pos)
        .map(|(c, &k)| place(c.writer, k, c.nbytes))
        .collect::<std::result::Result<_, _>>()?;
    let mut objects: Vec<ObjectMeta> = Vec::new();
    for (o, &k) in plan.objects.iter().zip(&object_pos) {
        let (file, at, (w, range)) = place(o.writer, k, o.nbytes)?;
        let crc32 = results[w as usize].crcs[range].to_vec();
        if objects.last().is_none_or(|m| m.key != o.key) {
            objects.push(ObjectMeta { key: o.key.to_string(), grid_shape: o.grid_shape.clone(), entries: Vec::new() });
        }
        let entry = ObjectEntry { grid_offset: o.grid_offset.clone(), file, at, len: o.nbytes, crc32 };
        objects.last_mut().expect("pushed").entries.push(entry);
    }
    let crcs = results.into_iter().map(|r| r.crcs).collect();
    Ok(Placed { files, chunks, crcs, objects })
}

/// Each declared tensor's run of the plan's chunks (both are in key order; a tensor without
/// elements has none).
fn chunk_runs(plan: &SavePlan) -> std::result::Result<Vec<std::ops::Range<usize>>, String> {
    let mut next = 0;
    let runs = plan
        .tensors
        .iter()
        .map(|d| {
            let start = next;
            while plan.chunks.get(next).is_some_and(|c| c.key == d.key) {
                next += 1;
            }
            start..next
        })
        .collect();
    match plan.chunks.get(next) {
        None => Ok(runs),
        Some(c) => {
            Err(format!("the plan's chunk {:?} {} is not under a declared tensor in key order", c.key, c.region))
        }
    }
}

fn writer_name() -> String {
    format!("dckpt {}", env!("CARGO_PKG_VERSION"))
}

/// Each declared tensor with its chunks and where they landed, borrowed from the plan: the
/// one pairing of declarations, chunks and placements that both the encoded metadata and
/// the [`Metadata`] value are made from.
fn tensor_views<'a>(
    plan: &'a SavePlan,
    placed: &'a Placed,
) -> std::result::Result<
    impl ExactSizeIterator<Item = TensorView<'a, impl ExactSizeIterator<Item = ChunkView<'a>> + 'a>> + 'a,
    String,
> {
    let runs = chunk_runs(plan)?;
    Ok(plan.tensors.iter().zip(runs).map(|(d, run)| TensorView {
        key: &d.key,
        dtype: d.dtype,
        global_shape: &d.global_shape,
        chunks: plan.chunks[run.clone()].iter().zip(&placed.chunks[run]).map(|(c, (file, at, crc))| ChunkView {
            offset: &c.region.offset,
            shape: &c.region.shape,
            flat: c.region.flat.map(|f| [f.start, f.stop]),
            file: *file,
            at: *at,
            crc32: placed.crc32(crc),
        }),
    }))
}

/// The metadata file a save commits: encoded straight from the plan and where its chunks
/// landed, the same bytes as [`build_metadata`]'s [`Metadata::encode`] without copying the
/// plan's keys and shapes (a save can hold hundreds of thousands of chunks).
fn encode_metadata(
    opts: &SaveOptions,
    plan: &SavePlan,
    save_id: &str,
    placed: &Placed,
) -> std::result::Result<Vec<u8>, String> {
    let writer = writer_name();
    let view = MetadataView {
        save_id,
        writer: &writer,
        block_bytes: opts.block_bytes,
        layout: &opts.layout,
        files: &placed.files,
        tensors: tensor_views(plan, placed)?,
        objects: &placed.objects,
    };
    Ok(encode_view(FORMAT_VERSION, view, plan.chunks.len()))
}

/// The metadata a save commits, as a value (for [`planned_metadata`]).
fn build_metadata(
    opts: &SaveOptions,
    plan: &SavePlan,
    save_id: &str,
    results: Vec<WriteResult>,
) -> std::result::Result<Metadata, String> {
    let placed = place_all(plan, opts.block_bytes, results)?;
    let tensors = tensor_views(plan, &placed)?
        .map(|t| TensorMeta {
            key: t.key.to_string(),
            dtype: t.dtype,
            global_shape: t.global_shape.into(),
            chunks: t
                .chunks
                .map(|c| ChunkMeta {
                    offset: c.offset.into(),
                    shape: c.shape.into(),
                    flat: c.flat,
                    file: c.file,
                    at: c.at,
                    crc32: c.crc32.to_vec(),
                })
                .collect(),
        })
        .collect();
    Ok(Metadata {
        format_version: FORMAT_VERSION,
        save_id: save_id.to_string(),
        writer: writer_name(),
        block_bytes: opts.block_bytes,
        layout: opts.layout.clone(),
        files: placed.files,
        tensors,
        objects: placed.objects,
    })
}

#[cfg(test)]
mod tests {
    use dckpt_layout::{Layout, ModelSpec, OptimizerMode, ParallelConfig, ReferenceModel};
    use dckpt_shard_spec::{DType, Region, ReplicaId};

    use super::*;

    /// The metadata a save commits is encoded from the plan without building a [`Metadata`];
    /// it must be byte for byte what encoding the value gives (replicas, flat regions, a
    /// tensor without elements, objects, one file per rank or several).
    #[test]
    fn a_save_encodes_the_bytes_of_its_metadata_value() {
        let c = ParallelConfig { tp: 2, pp: 2, ..Default::default() };
        let layout = Layout::new(c, 8).unwrap();
        let model =
            ReferenceModel::new(ModelSpec::preset("tiny").unwrap(), layout, OptimizerMode::Distributed).unwrap();
        let mut locals: Vec<LocalPlan> =
            (0..8).map(|r| LocalPlan { tensors: model.rank_state(r), objects: Vec::new() }).collect();
        assert!(locals.iter().flat_map(|l| &l.tensors).any(|t| t.region.flat.is_some()), "no flat region");
        locals[3].tensors.push(ShardedTensor {
            key: "a.empty".into(),
            dtype: DType::F32,
            global_shape: vec![0, 4].into(),
            region: Region::full(&[0, 4]),
            replica_id: ReplicaId::MAIN,
        });
        for (r, l) in locals.iter_mut().enumerate() {
            let object = |key: &str, grid_shape: Vec<u64>, grid_offset: Vec<u64>, main: bool| ObjectItem {
                object: ShardedObject {
                    key: key.into(),
                    grid_shape,
                    grid_offset,
                    replica_id: if main { ReplicaId::MAIN } else { ReplicaId::new(0, 0, 1) },
                },
                nbytes: 10 + r as u64,
            };
            l.objects.push(object("rng", vec![8], vec![r as u64], true));
            l.objects.push(object("args", vec![], vec![], r == 0));
        }
        let opts = SaveOptions { layout: BTreeMap::from([("tp".into(), "2".into())]), ..SaveOptions::default() };
        let plan = plan_save(&locals, None, opts.assignment).unwrap();
        for max in [None, Some(3000)] {
            let results = planned_results(&plan, &opts, "0123456789abcdef", max);
            let placed = place_all(&plan, opts.block_bytes, results.clone()).unwrap();
            let value = build_metadata(&opts, &plan, "0123456789abcdef", results).unwrap();
            assert!(value.tensors.iter().any(|t| t.key == "a.empty" && t.chunks.is_empty()));
            assert_eq!(value.objects.len(), 2);
            let bytes = encode_metadata(&opts, &plan, "0123456789abcdef", &placed).unwrap();
            assert_eq!(bytes, value.encode(), "files of at most {max:?}");
            // Independently of the view both go through: the body is what the value's own
            // serde encoding writes.
            let body = &bytes[crate::format::META_PREFIX_BYTES..bytes.len() - 4];
            assert_eq!(body, &rmp_serde::to_vec_named(&value).unwrap()[..], "files of at most {max:?}");
        }
        // A chunk outside the declarations is refused, not dropped.
        let mut broken = plan.clone();
        broken.tensors.retain(|d| d.key != broken.chunks[0].key);
        let placed =
            place_all(&broken, opts.block_bytes, planned_results(&broken, &opts, "0123456789abcdef", None)).unwrap();
        let err = encode_metadata(&opts, &broken, "0123456789abcdef", &placed).unwrap_err();
        assert!(err.contains(&*broken.chunks[0].key), "{err}");
    }

    /// Write results arrive from other ranks: offsets into their checksums that run
    /// backwards, past the end, or cover the wrong number of blocks are refused, not sliced.
    #[test]
    fn write_results_with_bad_checksum_offsets_are_refused() {
        let t = |key: &str, n: u64| ShardedTensor {
            key: key.into(),
            dtype: DType::U8,
            global_shape: [n].into(),
            region: Region::full(&[n]),
            replica_id: ReplicaId::MAIN,
        };
        let opts = SaveOptions { block_bytes: 4, ..SaveOptions::default() };
        let local = LocalPlan { tensors: vec![t("a", 10), t("b", 3)], objects: Vec::new() };
        let plan = plan_save(&[local], None, opts.assignment).unwrap();
        let good = planned_results(&plan, &opts, "0123456789abcdef", None);
        assert_eq!(good[0].pieces.iter().map(|p| p.2).collect::<Vec<_>>(), [12, 16], "3 blocks, then 1");
        place_all(&plan, opts.block_bytes, good.clone()).unwrap();
        for (ends, crcs, why) in [
            ([12, 8], 16, "checksums 12..8"),
            ([12, 20], 16, "checksums 12..20 of its 16"),
            ([8, 16], 16, "8 bytes of checksums for a piece of 10 bytes, not 12"),
            ([12, 16], 12, "checksums 12..16 of its 12"),
        ] {
            let mut bad = good.clone();
            for (p, end) in bad[0].pieces.iter_mut().zip(ends) {
                p.2 = end;
            }
            bad[0].crcs.truncate(crcs);
            let err = place_all(&plan, opts.block_bytes, bad).err().expect(why);
            assert!(err.contains(why), "{err}");
        }
    }
}
