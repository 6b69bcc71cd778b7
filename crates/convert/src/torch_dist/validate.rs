//! Everything a DCP checkpoint records, checked: coverage, items, zips and CRC-32s.

use std::collections::HashMap;
use std::ops::Range;

use dckpt::storage::{Storage, StorageExt};
use dckpt_format::FormatError;
use dckpt_shard_spec::{ShardedTensor, TensorPiece};
use dckpt_torch_format::dcp::{ChunkMeta, StateEntry, StorageInfo, TensorMeta, TorchSaveTensor};
use dckpt_torch_format::zip::{self, Entry};
use serde::Serialize;

use super::locate::{check_view, find_record, item_name, item_range, locate, read_directory};
use super::{Checkpoint, DATA_PKL_BYTES_MAX, DCP_METADATA};
use crate::{ConvertError, Result};

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
    let (problems, more) = coverage_problems(ckpt.tensors());
    for (msg, incomplete) in problems {
        r.incomplete.extend(incomplete);
        r.problem(msg);
    }
    r.problems_more += more;
}

/// What is wrong with how `tensors`' chunks cover them, each problem in the words
/// `validate` prints (chunks, not ranks) with its tensor's coverage where that is short or
/// overlapping, and how many more problems were left unlisted.
pub(super) fn coverage_problems<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a TensorMeta)> + Clone,
) -> (Vec<(String, Option<TensorCoverage>)>, usize) {
    let pieces: Vec<ShardedTensor> = tensors
        .clone()
        .flat_map(|(k, t)| {
            t.chunks
                .iter()
                .map(move |c| ShardedTensor::chunk(k, t.dtype, t.size.clone(), c.offsets.clone(), c.sizes.clone()))
        })
        .collect();
    // A tensor listed without chunks has no piece for the check below to find short.
    let mut problems: Vec<(String, Option<TensorCoverage>)> = tensors
        .clone()
        .filter(|(_, t)| t.chunks.is_empty())
        .filter_map(|(k, t)| {
            let total = t.size.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).unwrap_or(u64::MAX);
            let c = TensorCoverage { key: k.to_string(), covered: 0, total };
            (total > 0).then(|| (format!("{k}: covered {}: no chunk of it is stored", fraction(0, total)), Some(c)))
        })
        .collect();
    let refs: Vec<TensorPiece<'_>> = pieces.iter().map(|t| TensorPiece { rank: 0, tensor: t }).collect();
    let Err(e) = dckpt_shard_spec::validate(&refs, &[], None) else {
        return (problems, 0);
    };
    let totals: HashMap<&str, (u64, u64)> = tensors
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
    let coverage = |key: &str| {
        let (covered, total) = totals.get(key).copied().unwrap_or((0, 0));
        TensorCoverage { key: key.to_string(), covered, total }
    };
    problems.extend(e.problems.iter().map(|p| {
        use dckpt_shard_spec::Problem;
        match p {
            Problem::Gap { key, covered, total, missing } => {
                let at = missing.as_ref().map(|m| format!(": gap at {m}")).unwrap_or_default();
                let c = TensorCoverage { key: key.clone(), covered: *covered, total: *total };
                (format!("{key}: covered {}{at}", fraction(*covered, *total)), Some(c))
            }
            Problem::Overlap { key, region_a, region_b, .. } => {
                let c = coverage(key);
                (
                    format!(
                        "{key}: covered {}: chunk {region_a} overlaps chunk {region_b}",
                        fraction(c.covered, c.total)
                    ),
                    Some(c),
                )
            }
            Problem::DuplicateMain { key, region, .. } => {
                let c = coverage(key);
                (format!("{key}: covered {}: chunk {region} is listed twice", fraction(c.covered, c.total)), Some(c))
            }
            other => (other.to_string(), None),
        }
    }));
    (problems, e.more)
}

/// `50.0% (1/2)`: the percentage and, when it is a simple one, the reduced fraction.
pub fn fraction(covered: u64, total: u64) -> String {
    if total == 0 {
        return "0 of 0 elements".into();
    }
    let pct = covered as f64 * 100.0 / total as f64;
    let g = gcd(covered, total);
    let (n, d) = (covered / g.max(1), total / g.max(1));
    // Nothing covered reduces to 0/1, which says nothing of the tensor.
    if d <= 1024 && covered > 0 {
        format!("{pct:.1}% ({n}/{d})")
    } else {
        format!("{pct:.1}% ({covered} of {total} elements)")
    }
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
) -> Result<()> {
    let Items { storage, ckpt, whole_max } = *items;
    let range = item_range(&ckpt.files, storage, info, key)?;
    let name = item_name(storage, info);
    r.items += 1;
    let (records, pkl_bytes) = if info.length <= whole_max {
        let bytes = storage.get_range(&info.relative_path, range)?;
        r.bytes_checked += bytes.len() as u64;
        let entries = checked_entries(&bytes, &name).map_err(|e| ConvertError::torch_dist(format!("{key}: {e}")))?;
        let records: Vec<zip::DirectoryEntry> = entries.iter().map(|e| e.record.clone()).collect();
        let pkl = &entries[find_record(&records, "data.pkl", None, &name)?];
        let pkl_bytes = pkl.stored_data(&bytes, &name)?.to_vec();
        (records, pkl_bytes)
    } else {
        let (entries, pkl_bytes) = streamed_entries(storage, &info.relative_path, &range, &name, r)
            .map_err(|e| ConvertError::torch_dist(format!("{key}: {e}")))?;
        (entries.into_iter().map(|e| e.record).collect(), pkl_bytes.unwrap_or_default())
    };
    let tensor =
        TorchSaveTensor::decode(&pkl_bytes, &name).map_err(|e| ConvertError::torch_dist(format!("{key}: {e}")))?;
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
) -> Result<(Vec<Entry>, Option<Vec<u8>>)> {
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
            return Err(ConvertError::torch_dist(format!("{name}: data.pkl of {} bytes", d.end - d.start)));
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
            return Err(ConvertError::torch_dist(format!(
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

fn check_object_item(items: &Items<'_>, key: &str, info: &StorageInfo, r: &mut ValidateReport) -> Result<()> {
    let Items { storage, ckpt, whole_max } = *items;
    let range = item_range(&ckpt.files, storage, info, key)?;
    r.items += 1;
    let name = item_name(storage, info);
    if info.length <= whole_max {
        let bytes = storage.get_range(&info.relative_path, range)?;
        r.bytes_checked += bytes.len() as u64;
        if bytes.starts_with(b"PK\x03\x04") {
            checked_entries(&bytes, &name).map_err(|e| ConvertError::torch_dist(format!("{key}: {e}")))?;
        }
        return Ok(());
    }
    let head = storage.get_range(&info.relative_path, range.start..range.start + 4)?;
    if head.as_ref() == b"PK\x03\x04" {
        streamed_entries(storage, &info.relative_path, &range, &name, r)
            .map_err(|e| ConvertError::torch_dist(format!("{key}: {e}")))?;
    }
    // Other bytes are opaque: only their place in the file says anything.
    Ok(())
}
