//! PyTorch DCP and Megatron `torch_dist` checkpoints, read through [`Storage`].
//!
//! A DCP directory is a `.metadata` pickle and data files (`__<rank>_<i>.distcp`) that
//! concatenate items: each tensor chunk a whole `torch.save` zip archive, each plain value
//! opaque bytes. Megatron's `torch_dist` adds `metadata.json` (its backend) and `common.pt`
//! (its non-sharded state, kept opaque here). [`detect`] tells these from a dckpt
//! checkpoint; [`Checkpoint::open`] reads the metadata; [`Checkpoint::locate_chunk`] finds
//! where a chunk's elements lie by reading only the item's central directory, two local
//! headers and its `data.pkl` (ranged reads, never the file); [`read_chunk`] reads them in
//! row-major order, whatever the view's strides; [`validate`] checks everything a DCP
//! checkpoint records. No pickle is executed: the parsing is `dckpt_format::torch`'s.

mod convert;
mod source;

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use dckpt_format::FormatError;
use dckpt_format::torch::dcp::{
    ChunkMeta, DcpMetadata, ShardedObjectKey, StateEntry, StorageInfo, TensorMeta, TorchSaveTensor,
};
use dckpt_format::torch::zip::{self, CentralDirectory, Entry, TailLookup};
use dckpt_shard_spec::{DType, ShardedTensor, TensorPiece};
use dckpt_storage::{Storage, StorageExt};
use serde::Serialize;

pub use convert::{COMMON_OBJECT, DATA_FILE, TorchDistReport, dckpt_to_torch_dist, torch_dist_to_dckpt};
pub use source::TorchDistSource;

/// DCP's metadata file.
pub const DCP_METADATA: &str = ".metadata";
/// Megatron's marker of a `dist_checkpointing` directory.
pub const MEGATRON_METADATA: &str = "metadata.json";
/// Megatron's common (non-sharded) state, a `torch.save` pickle.
pub const MEGATRON_COMMON: &str = "common.pt";
/// The largest `.metadata` file read (DCP metadata is a few bytes per chunk).
pub const DCP_METADATA_BYTES_MAX: u64 = 1 << 30;
/// The largest `data.pkl` read (a tensor's pickle is a few hundred bytes).
const DATA_PKL_BYTES_MAX: u64 = 1 << 20;
/// How much of an item's end is read first to find its central directory; a `torch.save`
/// archive's directory is under a KiB for a tensor and it writes no comment.
const TAIL_FIRST: u64 = 1024;

/// The checkpoint formats [`detect`] tells apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// dckpt's own metadata file is there.
    Dckpt,
    /// A PyTorch DCP directory (`.metadata`).
    Dcp,
    /// A Megatron `dist_checkpointing` directory (`.metadata` and `metadata.json`).
    TorchDist,
}

impl Format {
    /// `dckpt`, `dcp` or `torch_dist`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Dckpt => "dckpt",
            Format::Dcp => "dcp",
            Format::TorchDist => "torch_dist",
        }
    }
}

/// What can go wrong reading a DCP checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The storage failed.
    #[error(transparent)]
    Storage(#[from] dckpt_storage::Error),
    /// A file (or an item in one) is not what DCP writes.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// Neither a dckpt nor a DCP metadata file is there.
    #[error("not a checkpoint: no {} or {DCP_METADATA} at {location}", dckpt_format::META_NAME)]
    NotACheckpoint {
        /// Where it looked.
        location: String,
    },
    /// The metadata does not describe what is asked of it.
    #[error("{0}")]
    Invalid(String),
}

/// Which format is at the storage root, or `None` when neither metadata file is there.
pub fn detect(storage: &dyn Storage) -> Result<Option<Format>, Error> {
    if exists(storage, dckpt_format::META_NAME)? {
        return Ok(Some(Format::Dckpt));
    }
    if !exists(storage, DCP_METADATA)? {
        return Ok(None);
    }
    Ok(Some(if exists(storage, MEGATRON_METADATA)? { Format::TorchDist } else { Format::Dcp }))
}

fn exists(storage: &dyn Storage, path: &str) -> Result<bool, Error> {
    match storage.size(path) {
        Ok(_) => Ok(true),
        Err(dckpt_storage::Error::NotFound { .. }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// An opened DCP or `torch_dist` checkpoint: its metadata and what lies beside it.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// [`Format::Dcp`] or [`Format::TorchDist`].
    pub format: Format,
    /// The decoded `.metadata`.
    pub metadata: DcpMetadata,
    /// `metadata.json`, for `torch_dist`.
    pub megatron: Option<serde_json::Value>,
    /// The size of `common.pt`, when there is one.
    pub common_bytes: Option<u64>,
    /// Every object at the root with its size, by name.
    pub files: BTreeMap<String, u64>,
    /// `storage_data`'s place of each item, by key and offsets.
    items: HashMap<(String, Option<Vec<u64>>), usize>,
}

/// Where one tensor chunk's elements lie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkLocation {
    /// The tensor's key.
    pub key: String,
    /// The chunk's box in the global tensor.
    pub chunk: ChunkMeta,
    /// The data file.
    pub file: String,
    /// The item (the chunk's `torch.save` archive) in the file.
    pub item: Range<u64>,
    /// The storage's bytes (the zip entry `<archive>/data/<key>`) in the file.
    pub data: Range<u64>,
    /// The view `data.pkl` describes: dtype, offset and strides within the storage.
    pub tensor: TorchSaveTensor,
    /// The storage entry's CRC-32, as its central directory records it.
    pub crc32: u32,
}

impl ChunkLocation {
    /// The chunk's bytes in row-major order.
    pub fn nbytes(&self) -> u64 {
        self.tensor.numel().unwrap_or(0) * self.tensor.dtype.size()
    }
}

impl Checkpoint {
    /// Reads the metadata at the storage root. Fails with [`Error::NotACheckpoint`] when
    /// there is no `.metadata`.
    pub fn open(storage: &dyn Storage) -> Result<Checkpoint, Error> {
        let files: BTreeMap<String, u64> = storage.list("")?.into_iter().map(|o| (o.path, o.size)).collect();
        let Some(&size) = files.get(DCP_METADATA) else {
            return Err(Error::NotACheckpoint { location: storage.location("") });
        };
        let location = storage.location(DCP_METADATA);
        if size > DCP_METADATA_BYTES_MAX {
            return Err(Error::Invalid(format!(
                "{location}: {size} bytes, more than the {DCP_METADATA_BYTES_MAX} a DCP metadata file may have"
            )));
        }
        let bytes = storage.get(DCP_METADATA)?;
        let metadata = DcpMetadata::decode(&bytes, &location)?;
        let (format, megatron) = match files.get(MEGATRON_METADATA) {
            Some(&n) if n <= 1 << 20 => {
                let raw = storage.get(MEGATRON_METADATA)?;
                let v = serde_json::from_slice(&raw)
                    .map_err(|e| Error::Invalid(format!("{}: not JSON: {e}", storage.location(MEGATRON_METADATA))))?;
                (Format::TorchDist, Some(v))
            }
            Some(_) => {
                return Err(Error::Invalid(format!("{}: larger than 1 MiB", storage.location(MEGATRON_METADATA))));
            }
            None => (Format::Dcp, None),
        };
        let common_bytes = files.get(MEGATRON_COMMON).copied();
        let items = metadata
            .storage_data
            .iter()
            .enumerate()
            .map(|(i, (k, _))| ((k.fqn.clone(), k.offset.clone()), i))
            .collect();
        Ok(Checkpoint { format, metadata, megatron, common_bytes, files, items })
    }

    /// The tensors, in the metadata's order.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &TensorMeta)> {
        self.metadata.state_dict_metadata.iter().filter_map(|(k, e)| match e {
            StateEntry::Tensor(t) => Some((k.as_str(), t)),
            StateEntry::Bytes => None,
        })
    }

    /// The keys of the opaque (bytes) items, in the metadata's order.
    pub fn objects(&self) -> impl Iterator<Item = &str> {
        self.metadata.state_dict_metadata.iter().filter_map(|(k, e)| match e {
            StateEntry::Bytes => Some(k.as_str()),
            StateEntry::Tensor(_) => None,
        })
    }

    /// The PyTorch or Megatron version the checkpoint records, if any: DCP's metadata
    /// version (releases from 2.4 or so), and Megatron's backend and its version.
    pub fn versions(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(v) = &self.metadata.version {
            out.push(format!("DCP metadata {v}"));
        }
        if let Some(m) = &self.megatron {
            let backend = m.get("sharded_backend").and_then(|v| v.as_str()).unwrap_or("?");
            let version = m.get("sharded_backend_version").map(|v| v.to_string()).unwrap_or_else(|| "?".into());
            out.push(format!("Megatron {backend} backend version {version}"));
        }
        out
    }

    /// Where the item of `key` at `offsets` (`None` for a bytes item) lies.
    pub fn item(&self, key: &str, offsets: Option<&[u64]>) -> Result<&StorageInfo, Error> {
        self.items
            .get(&(key.to_string(), offsets.map(<[u64]>::to_vec)))
            .map(|&i| &self.metadata.storage_data[i].1)
            .ok_or_else(|| match offsets {
                Some(o) => Error::Invalid(format!("{key}: no item for the chunk at {o:?} in {DCP_METADATA}")),
                None => Error::Invalid(format!("{key}: no item in {DCP_METADATA}")),
            })
    }

    /// Locates chunk `index` of tensor `key`: reads the item's central directory, the
    /// local headers of `data.pkl` and of the storage, and `data.pkl`, and checks them
    /// against the metadata (dtype, sizes, storage length).
    pub fn locate_chunk(&self, storage: &dyn Storage, key: &str, index: usize) -> Result<ChunkLocation, Error> {
        let Some(StateEntry::Tensor(t)) = self.metadata.entry(key) else {
            return Err(Error::Invalid(format!("{key}: no such tensor in {DCP_METADATA}")));
        };
        let chunk = t.chunks.get(index).ok_or_else(|| Error::Invalid(format!("{key}: no chunk {index}")))?;
        let info = self.item(key, Some(&chunk.offsets))?;
        let item = self.item_range(storage, info, key)?;
        let name = item_name(storage, info);
        let (dir, records) = read_directory(storage, &info.relative_path, &item, &name)?;
        let pkl = find_record(&records, "data.pkl", None, &name)?;
        let (pkl_record, pkl_index) = (records[pkl].clone(), pkl);
        let pkl_entry = locate(storage, &info.relative_path, &item, &dir, pkl_record, pkl_index, &name)?;
        pkl_entry.check_stored(&name)?;
        let pkl_range = pkl_entry.data_range();
        if pkl_range.end - pkl_range.start > DATA_PKL_BYTES_MAX {
            return Err(Error::Invalid(format!("{name}: data.pkl of {} bytes", pkl_range.end - pkl_range.start)));
        }
        let pkl_bytes =
            storage.get_range(&info.relative_path, item.start + pkl_range.start..item.start + pkl_range.end)?;
        pkl_entry.verify_crc(&pkl_bytes, &name)?;
        let tensor = TorchSaveTensor::decode(&pkl_bytes, &name)?;
        let data = find_record(&records, "data.pkl", Some(&tensor.storage_key), &name)?;
        let data_entry = locate(storage, &info.relative_path, &item, &dir, records[data].clone(), data, &name)?;
        data_entry.check_stored(&name)?;
        check_view(key, t, chunk, &tensor, data_entry.record.compressed_size, &name)?;
        let d = data_entry.data_range();
        Ok(ChunkLocation {
            key: key.to_string(),
            chunk: chunk.clone(),
            file: info.relative_path.clone(),
            item: item.clone(),
            data: item.start + d.start..item.start + d.end,
            tensor,
            crc32: data_entry.record.crc32,
        })
    }

    /// The item's bytes in its file, checked against the file's size.
    fn item_range(&self, storage: &dyn Storage, info: &StorageInfo, key: &str) -> Result<Range<u64>, Error> {
        item_range(&self.files, storage, info, key)
    }
}

fn item_name(storage: &dyn Storage, info: &StorageInfo) -> String {
    format!("{} (item at {})", storage.location(&info.relative_path), info.offset)
}

fn item_range(
    files: &BTreeMap<String, u64>,
    storage: &dyn Storage,
    info: &StorageInfo,
    key: &str,
) -> Result<Range<u64>, Error> {
    let loc = storage.location(&info.relative_path);
    if info.relative_path.contains('/') || info.relative_path.starts_with('.') {
        return Err(Error::Invalid(format!("{key}: item file {:?} is outside the checkpoint", info.relative_path)));
    }
    let Some(&size) = files.get(&info.relative_path) else {
        return Err(Error::Invalid(format!("{key}: item file {loc} does not exist")));
    };
    if info.transformed {
        return Err(Error::Invalid(format!(
            "{key}: the item at {} of {loc} has transforms (compression?) this reader does not read",
            info.offset
        )));
    }
    match info.offset.checked_add(info.length) {
        Some(end) if end <= size => Ok(info.offset..end),
        Some(end) => Err(Error::Invalid(format!(
            "{key}: item at {}..{end} of {loc} runs past the file's end at {size}",
            info.offset
        ))),
        None => Err(Error::Invalid(format!(
            "{key}: item at offset {} of {loc} with length {} overflows",
            info.offset, info.length
        ))),
    }
}

/// The item's central directory, read from its end (one ranged read, a second one when the
/// directory is longer than the first).
fn read_directory(
    storage: &dyn Storage,
    path: &str,
    item: &Range<u64>,
    name: &str,
) -> Result<(CentralDirectory, Vec<zip::DirectoryEntry>), Error> {
    let len = item.end - item.start;
    let mut from = len.saturating_sub(TAIL_FIRST);
    loop {
        let tail = storage.get_range(path, item.start + from..item.end)?;
        match zip::find_central_directory(&tail, len, name)? {
            TailLookup::Found(dir) => {
                let bytes = if dir.range.start >= from {
                    let at = (dir.range.start - from) as usize..(dir.range.end - from) as usize;
                    tail.slice(at)
                } else {
                    storage.get_range(path, item.start + dir.range.start..item.start + dir.range.end)?
                };
                let records = zip::parse_central_directory(&bytes, &dir, name)?;
                return Ok((dir, records));
            }
            TailLookup::NeedFrom(f) if f < from => from = f,
            TailLookup::NeedFrom(f) => {
                return Err(Error::Invalid(format!("{name}: the zip end records ask for bytes from {f} again")));
            }
        }
    }
}

/// The record of `data.pkl` (`storage: None`) or of storage `data/<key>`: an entry of the
/// archive's one top-level folder.
fn find_record(records: &[zip::DirectoryEntry], pkl: &str, storage: Option<&str>, name: &str) -> Result<usize, Error> {
    let wanted = |n: &str| match n.split_once('/') {
        Some((_, rest)) => match storage {
            None => rest == pkl,
            Some(k) => rest.strip_prefix("data/") == Some(k),
        },
        None => false,
    };
    let found: Vec<usize> = records.iter().enumerate().filter(|(_, r)| wanted(&r.name)).map(|(i, _)| i).collect();
    match (found.as_slice(), storage) {
        ([i], _) => Ok(*i),
        ([], None) => Err(Error::Invalid(format!("{name}: no data.pkl: not a torch.save archive"))),
        ([], Some(k)) => Err(Error::Invalid(format!("{name}: no entry for storage {k} that data.pkl names"))),
        (_, _) => Err(Error::Invalid(format!("{name}: several archives in one item"))),
    }
}

fn locate(
    storage: &dyn Storage,
    path: &str,
    item: &Range<u64>,
    dir: &CentralDirectory,
    record: zip::DirectoryEntry,
    index: usize,
    name: &str,
) -> Result<Entry, Error> {
    let at = record.local_header_offset;
    let want = zip::LOCAL_HEADER_BYTES + record.name.len() as u64;
    let end = at.saturating_add(want).min(dir.range.start);
    let local = storage.get_range(path, item.start + at..item.start + end)?;
    Ok(Entry::locate(record, &local, dir.range.start, index, name)?)
}

/// That the view `data.pkl` describes is the chunk the metadata says: same dtype, same
/// sizes (a legacy sharded-tensor view may drop or add axes of extent 1), within its
/// storage.
fn check_view(
    key: &str,
    t: &TensorMeta,
    chunk: &ChunkMeta,
    v: &TorchSaveTensor,
    storage_bytes: u64,
    name: &str,
) -> Result<(), Error> {
    if v.dtype != t.dtype {
        return Err(Error::Invalid(format!(
            "{key}: {name}: data.pkl holds {} but the metadata says {}",
            v.dtype, t.dtype
        )));
    }
    let squeeze = |s: &[u64]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<u64>>();
    if v.size != chunk.sizes && squeeze(&v.size) != squeeze(&chunk.sizes) {
        return Err(Error::Invalid(format!(
            "{key}: {name}: data.pkl holds size {:?} but the chunk at {:?} has sizes {:?}",
            v.size, chunk.offsets, chunk.sizes
        )));
    }
    v.check_storage(storage_bytes, name)?;
    Ok(())
}

/// Reads the chunk's elements into `out` in row-major order (`out` holds exactly
/// [`ChunkLocation::nbytes`]): one ranged read of the storage's bytes the view reaches,
/// then, for a strided view, each element gathered from its place.
pub fn read_chunk(storage: &dyn Storage, loc: &ChunkLocation, out: &mut [u8]) -> Result<(), Error> {
    let t = &loc.tensor;
    let isz = t.dtype.size();
    let numel = t.numel().ok_or_else(|| Error::Invalid(format!("{}: chunk size overflows", loc.key)))?;
    if out.len() as u64 != numel * isz {
        return Err(Error::Invalid(format!("{}: a buffer of {} bytes for {} bytes", loc.key, out.len(), numel * isz)));
    }
    if numel == 0 {
        return Ok(());
    }
    let span = t.span().ok_or_else(|| Error::Invalid(format!("{}: chunk view overflows", loc.key)))?;
    let bytes = (loc.data.start + span.start * isz)..(loc.data.start + span.end * isz);
    if bytes.end > loc.data.end {
        return Err(Error::Invalid(format!("{}: view reaches past its storage in {}", loc.key, loc.file)));
    }
    if is_row_major(&t.size, &t.stride) {
        storage.read_exact_at(&loc.file, bytes.start, out)?;
        return Ok(());
    }
    let src = storage.get_range(&loc.file, bytes)?;
    gather(&src, &t.size, &t.stride, isz as usize, out);
    Ok(())
}

/// Whether a view of `size` and `stride` is its storage's elements in row-major order
/// (axes of extent 1 have any stride).
pub fn is_row_major(size: &[u64], stride: &[u64]) -> bool {
    let mut want = 1u64;
    for (&s, &st) in size.iter().zip(stride).rev() {
        if s != 1 && st != want {
            return false;
        }
        want = want.saturating_mul(s);
    }
    true
}

/// Copies the view's elements from `src` (the storage from the view's first element on)
/// into `out` in row-major order.
fn gather(src: &[u8], size: &[u64], stride: &[u64], isz: usize, out: &mut [u8]) {
    let n = size.len();
    let mut idx = vec![0u64; n];
    let mut at: u64 = 0;
    for dst in out.chunks_exact_mut(isz) {
        let s = at as usize * isz;
        dst.copy_from_slice(&src[s..s + isz]);
        // Next index, row-major: the last axis fastest.
        for d in (0..n).rev() {
            idx[d] += 1;
            at += stride[d];
            if idx[d] < size[d] {
                break;
            }
            at -= stride[d] * size[d];
            idx[d] = 0;
        }
    }
}

/// One tensor's coverage, as `validate` found it.
#[derive(Clone, Debug, Serialize)]
pub struct TensorCoverage {
    /// The tensor's key.
    pub key: String,
    /// Elements the chunks cover (summed).
    pub covered: u64,
    /// Elements of the global tensor.
    pub total: u64,
}

/// What [`validate`] found. Problems are messages naming the key, file and offset.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ValidateReport {
    /// Tensors in the metadata.
    pub tensors: usize,
    /// Their chunks.
    pub chunks: usize,
    /// Bytes items (objects).
    pub objects: usize,
    /// Data files the items are in.
    pub files: usize,
    /// Items read.
    pub items: usize,
    /// Bytes read and checked (every item's zip entries against their CRC-32).
    pub bytes_checked: u64,
    /// Tensors whose chunks do not cover them exactly once.
    pub incomplete: Vec<TensorCoverage>,
    /// Everything wrong, one message each (the first [`PROBLEMS_MAX`]).
    pub problems: Vec<String>,
    /// Problems found beyond those.
    pub problems_more: usize,
}

/// The most problems a report lists.
pub const PROBLEMS_MAX: usize = 100;

impl ValidateReport {
    /// Whether nothing is wrong.
    pub fn ok(&self) -> bool {
        self.problems.is_empty() && self.problems_more == 0
    }

    fn problem(&mut self, p: String) {
        if self.problems.len() < PROBLEMS_MAX {
            self.problems.push(p);
        } else {
            self.problems_more += 1;
        }
    }
}

/// Checks a DCP / `torch_dist` checkpoint: exact-once coverage of every tensor by its
/// chunks (shard-spec's validation, each chunk a main piece), an item for every chunk and
/// object within its file, and every item read once: a tensor item's zip structure (central
/// directory, local headers, stored entries), every entry's CRC-32 (`torch.save` writes
/// real ones), and its `data.pkl` against the chunk (dtype, sizes, storage bytes). Object
/// items are opaque; those that are `torch.save` archives (as DCP and Megatron write plain
/// values) get their zip structure and CRCs checked too. DCP itself records no checksum.
/// `progress` is called with the bytes checked so far.
pub fn validate(storage: &dyn Storage, ckpt: &Checkpoint, progress: impl FnMut(u64)) -> ValidateReport {
    validate_with(storage, ckpt, ITEM_WHOLE_BYTES_MAX, progress)
}

/// Items up to this size are read whole, in one request; larger ones are located by
/// ranged reads and their entries' CRC-32 computed a window at a time, so that memory stays
/// bounded whatever the size of a chunk.
pub const ITEM_WHOLE_BYTES_MAX: u64 = 8 << 20;
/// The window a large item's entries are read in.
const CRC_WINDOW: u64 = 8 << 20;

/// [`validate`] with the size above which items are streamed rather than read whole.
pub fn validate_with(
    storage: &dyn Storage,
    ckpt: &Checkpoint,
    whole_max: u64,
    mut progress: impl FnMut(u64),
) -> ValidateReport {
    let md = &ckpt.metadata;
    let mut r = ValidateReport {
        tensors: ckpt.tensors().count(),
        chunks: ckpt.tensors().map(|(_, t)| t.chunks.len()).sum(),
        objects: ckpt.objects().count(),
        files: md
            .storage_data
            .iter()
            .map(|(_, s)| s.relative_path.as_str())
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        ..Default::default()
    };
    coverage(ckpt, &mut r);
    let items = Items { storage, ckpt, whole_max };
    let index = md.storage_index();
    let mut used: HashMap<(&str, Option<&[u64]>), ()> = HashMap::new();
    for (key, entry) in &md.state_dict_metadata {
        match entry {
            StateEntry::Tensor(t) => {
                for c in &t.chunks {
                    match index.get(&(key.as_str(), Some(c.offsets.as_slice()))) {
                        Some(info) => {
                            used.insert((key.as_str(), Some(c.offsets.as_slice())), ());
                            if let Err(e) = check_tensor_item(&items, key, (t, c), info, &mut r) {
                                r.problem(e.to_string());
                            }
                            progress(r.bytes_checked);
                        }
                        None => r.problem(format!("{key}: no item for the chunk at {:?} in {DCP_METADATA}", c.offsets)),
                    }
                }
            }
            StateEntry::Bytes => match index.get(&(key.as_str(), None)) {
                Some(info) => {
                    used.insert((key.as_str(), None), ());
                    if let Err(e) = check_object_item(&items, key, info, &mut r) {
                        r.problem(e.to_string());
                    }
                    progress(r.bytes_checked);
                }
                None => r.problem(format!("{key}: no item for the object in {DCP_METADATA}")),
            },
        }
    }
    let mut seen = std::collections::HashSet::new();
    for (k, _) in &md.storage_data {
        let id = (k.fqn.as_str(), k.offset.as_deref());
        let what = match &k.offset {
            Some(o) => format!("a chunk item at {o:?}"),
            None => "an object item".to_string(),
        };
        if !used.contains_key(&id) {
            r.problem(format!("{}: {what} that the state dict metadata does not list", k.fqn));
        }
        if !seen.insert(id) {
            // Only one of them can be what a reader finds.
            r.problem(format!("{}: {what} listed twice in {DCP_METADATA}", k.fqn));
        }
    }
    r
}

fn coverage(ckpt: &Checkpoint, r: &mut ValidateReport) {
    let pieces: Vec<ShardedTensor> = ckpt
        .tensors()
        .flat_map(|(k, t)| {
            t.chunks
                .iter()
                .map(move |c| ShardedTensor::chunk(k, t.dtype, t.size.clone(), c.offsets.clone(), c.sizes.clone()))
        })
        .collect();
    let refs: Vec<TensorPiece<'_>> = pieces.iter().map(|t| TensorPiece { rank: 0, tensor: t }).collect();
    let Err(e) = dckpt_shard_spec::validate(&refs, &[], None) else {
        return;
    };
    let totals: HashMap<&str, (u64, u64)> = ckpt
        .tensors()
        .map(|(k, t)| {
            let total = t.size.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).unwrap_or(u64::MAX);
            let covered = t
                .chunks
                .iter()
                .map(|c| c.sizes.iter().fold(1u64, |a, &d| a.saturating_mul(d)))
                .fold(0u64, u64::saturating_add);
            (k, (covered, total))
        })
        .collect();
    for p in &e.problems {
        use dckpt_shard_spec::Problem;
        let msg = match p {
            Problem::Gap { key, covered, total, missing } => {
                r.incomplete.push(TensorCoverage { key: key.clone(), covered: *covered, total: *total });
                let at = missing.as_ref().map(|m| format!(": gap at {m}")).unwrap_or_default();
                format!("{key}: covered {}{at}", fraction(*covered, *total))
            }
            Problem::Overlap { key, region_a, region_b, .. } => {
                let (c, t) = totals.get(key.as_str()).copied().unwrap_or((0, 0));
                r.incomplete.push(TensorCoverage { key: key.clone(), covered: c, total: t });
                format!("{key}: covered {}: chunk {region_a} overlaps chunk {region_b}", fraction(c, t))
            }
            Problem::DuplicateMain { key, region, .. } => {
                let (c, t) = totals.get(key.as_str()).copied().unwrap_or((0, 0));
                r.incomplete.push(TensorCoverage { key: key.clone(), covered: c, total: t });
                format!("{key}: covered {}: chunk {region} is listed twice", fraction(c, t))
            }
            other => other.to_string(),
        };
        r.problem(msg);
    }
    r.problems_more += e.more;
}

/// `50.0% (1/2)`: the percentage and, when it is a simple one, the reduced fraction.
pub fn fraction(covered: u64, total: u64) -> String {
    if total == 0 {
        return "0 of 0 elements".into();
    }
    let pct = covered as f64 * 100.0 / total as f64;
    let g = gcd(covered, total);
    let (n, d) = (covered / g.max(1), total / g.max(1));
    if d <= 1024 { format!("{pct:.1}% ({n}/{d})") } else { format!("{pct:.1}% ({covered} of {total} elements)") }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// What every item check reads through: the storage, the checkpoint, and the size above
/// which an item is streamed.
struct Items<'a> {
    storage: &'a dyn Storage,
    ckpt: &'a Checkpoint,
    whole_max: u64,
}

fn check_tensor_item(
    items: &Items<'_>,
    key: &str,
    (t, chunk): (&TensorMeta, &ChunkMeta),
    info: &StorageInfo,
    r: &mut ValidateReport,
) -> Result<(), Error> {
    let Items { storage, ckpt, whole_max } = *items;
    let range = item_range(&ckpt.files, storage, info, key)?;
    let name = item_name(storage, info);
    r.items += 1;
    let (records, pkl_bytes) = if info.length <= whole_max {
        let bytes = storage.get_range(&info.relative_path, range)?;
        r.bytes_checked += bytes.len() as u64;
        let entries = checked_entries(&bytes, &name).map_err(|e| Error::Invalid(format!("{key}: {e}")))?;
        let records: Vec<zip::DirectoryEntry> = entries.iter().map(|e| e.record.clone()).collect();
        let pkl = &entries[find_record(&records, "data.pkl", None, &name)?];
        let pkl_bytes = pkl.stored_data(&bytes, &name)?.to_vec();
        (records, pkl_bytes)
    } else {
        let (entries, pkl_bytes) = streamed_entries(storage, &info.relative_path, &range, &name, r)
            .map_err(|e| Error::Invalid(format!("{key}: {e}")))?;
        (entries.into_iter().map(|e| e.record).collect(), pkl_bytes.unwrap_or_default())
    };
    let tensor = TorchSaveTensor::decode(&pkl_bytes, &name).map_err(|e| Error::Invalid(format!("{key}: {e}")))?;
    let data = &records[find_record(&records, "data.pkl", Some(&tensor.storage_key), &name)?];
    check_view(key, t, chunk, &tensor, data.compressed_size, &name)
}

/// Every entry of an item located, stored, and matching its CRC-32.
fn checked_entries(bytes: &[u8], name: &str) -> Result<Vec<Entry>, FormatError> {
    let entries = zip::entries(bytes, name)?;
    for e in &entries {
        e.verify_crc(e.stored_data(bytes, name)?, name)?;
    }
    Ok(entries)
}

/// What [`checked_entries`] proves, for an item too large to hold: its directory and every
/// local header by ranged reads, then each entry's bytes a window at a time into its
/// CRC-32. Returns the entries and `data.pkl`'s bytes, if it has one.
fn streamed_entries(
    storage: &dyn Storage,
    path: &str,
    item: &Range<u64>,
    name: &str,
    r: &mut ValidateReport,
) -> Result<(Vec<Entry>, Option<Vec<u8>>), Error> {
    let (dir, records) = read_directory(storage, path, item, name)?;
    r.bytes_checked += dir.range.end - dir.range.start;
    let mut entries = Vec::with_capacity(records.len());
    for (i, rec) in records.into_iter().enumerate() {
        entries.push(locate(storage, path, item, &dir, rec, i, name)?);
    }
    zip::check_entries(&entries, dir.range.start, name)?;
    let mut pkl = None;
    for e in &entries {
        e.check_stored(name)?;
        let d = e.data_range();
        let is_pkl = e.record.name.split_once('/').is_some_and(|(_, rest)| rest == "data.pkl");
        if is_pkl && d.end - d.start > DATA_PKL_BYTES_MAX {
            return Err(Error::Invalid(format!("{name}: data.pkl of {} bytes", d.end - d.start)));
        }
        let mut hasher = crc32fast::Hasher::new();
        let mut at = d.start;
        let mut kept = Vec::new();
        while at < d.end {
            let end = d.end.min(at + CRC_WINDOW);
            let window = storage.get_range(path, item.start + at..item.start + end)?;
            hasher.update(&window);
            if is_pkl {
                kept.extend_from_slice(&window);
            }
            r.bytes_checked += window.len() as u64;
            at = end;
        }
        let found = hasher.finalize();
        if found != e.record.crc32 {
            return Err(Error::Invalid(format!(
                "{name}: entry `{}`: CRC-32 {found:08x}, the directory says {:08x}",
                e.record.name, e.record.crc32
            )));
        }
        if is_pkl {
            pkl = Some(kept);
        }
    }
    Ok((entries, pkl))
}

fn check_object_item(items: &Items<'_>, key: &str, info: &StorageInfo, r: &mut ValidateReport) -> Result<(), Error> {
    let Items { storage, ckpt, whole_max } = *items;
    let range = item_range(&ckpt.files, storage, info, key)?;
    r.items += 1;
    let name = item_name(storage, info);
    if info.length <= whole_max {
        let bytes = storage.get_range(&info.relative_path, range)?;
        r.bytes_checked += bytes.len() as u64;
        if bytes.starts_with(b"PK\x03\x04") {
            checked_entries(&bytes, &name).map_err(|e| Error::Invalid(format!("{key}: {e}")))?;
        }
        return Ok(());
    }
    let head = storage.get_range(&info.relative_path, range.start..range.start + 4)?;
    if head.as_ref() == b"PK\x03\x04" {
        streamed_entries(storage, &info.relative_path, &range, &name, r)
            .map_err(|e| Error::Invalid(format!("{key}: {e}")))?;
    }
    // Other bytes are opaque: only their place in the file says anything.
    Ok(())
}

/// A Megatron ShardedObject key split into its parts (`key/shard_<offsets>_<shape>`).
pub fn sharded_object(key: &str) -> Option<ShardedObjectKey> {
    ShardedObjectKey::parse(key)
}

/// The dtype name PyTorch users write (`bfloat16`, `float32`, ...).
pub fn torch_name(d: DType) -> &'static str {
    dckpt_format::torch::write::torch_dtype_name(d)
}
