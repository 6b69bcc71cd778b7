//! Where a chunk's elements lie, found by ranged reads of its item (the zip's central
//! directory, two local headers and `data.pkl`, never the whole file), and the elements
//! read in row-major order whatever the view's strides.

use std::collections::BTreeMap;
use std::ops::Range;

use dckpt::storage::{Storage, StorageExt};
use dckpt_torch_format::dcp::{ChunkMeta, StateEntry, StorageInfo, TensorMeta, TorchSaveTensor};
use dckpt_torch_format::zip::{self, CentralDirectory, Entry, TailLookup};

use super::{Checkpoint, DATA_PKL_BYTES_MAX, DCP_METADATA};
use crate::{ConvertError, Result};

/// How much of an item's end is read first to find its central directory; a `torch.save`
/// archive's directory is under a KiB for a tensor and it writes no comment.
const TAIL_FIRST: u64 = 1024;

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
        // Saturating: `locate_chunk` held the view within its storage's bytes already.
        self.tensor.numel().unwrap_or(0).saturating_mul(self.tensor.dtype.size())
    }
}

impl Checkpoint {
    /// Locates chunk `index` of tensor `key`: reads the item's central directory, the
    /// local headers of `data.pkl` and of the storage, and `data.pkl`, and checks them
    /// against the metadata (dtype, sizes, storage length).
    pub fn locate_chunk(&self, storage: &dyn Storage, key: &str, index: usize) -> Result<ChunkLocation> {
        let Some(StateEntry::Tensor(t)) = self.metadata.entry(key) else {
            return Err(ConvertError::torch_dist(format!("{key}: no such tensor in {DCP_METADATA}")));
        };
        let chunk = t.chunks.get(index).ok_or_else(|| ConvertError::torch_dist(format!("{key}: no chunk {index}")))?;
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
            return Err(ConvertError::torch_dist(format!(
                "{name}: data.pkl of {} bytes",
                pkl_range.end - pkl_range.start
            )));
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
    fn item_range(&self, storage: &dyn Storage, info: &StorageInfo, key: &str) -> Result<Range<u64>> {
        item_range(&self.files, storage, info, key)
    }
}

pub(super) fn item_name(storage: &dyn Storage, info: &StorageInfo) -> String {
    format!("{} (item at {})", storage.location(&info.relative_path), info.offset)
}

pub(super) fn item_range(
    files: &BTreeMap<String, u64>,
    storage: &dyn Storage,
    info: &StorageInfo,
    key: &str,
) -> Result<Range<u64>> {
    let loc = storage.location(&info.relative_path);
    if info.relative_path.contains('/') || info.relative_path.starts_with('.') {
        return Err(ConvertError::torch_dist(format!(
            "{key}: item file {:?} is outside the checkpoint",
            info.relative_path
        )));
    }
    let Some(&size) = files.get(&info.relative_path) else {
        return Err(ConvertError::torch_dist(format!("{key}: item file {loc} does not exist")));
    };
    if info.transformed {
        return Err(ConvertError::torch_dist(format!(
            "{key}: the item at {} of {loc} has transforms (compression?) this reader does not read",
            info.offset
        )));
    }
    match info.offset.checked_add(info.length) {
        Some(end) if end <= size => Ok(info.offset..end),
        Some(end) => Err(ConvertError::torch_dist(format!(
            "{key}: item at {}..{end} of {loc} runs past the file's end at {size}",
            info.offset
        ))),
        None => Err(ConvertError::torch_dist(format!(
            "{key}: item at offset {} of {loc} with length {} overflows",
            info.offset, info.length
        ))),
    }
}

/// The most of an item's end its zip records may ask to read: a `torch.save` archive's
/// directory is a record per entry, a few of them. End records claiming more (a directory
/// starting at the item's first byte) fetched a whole item of gigabytes in one read before
/// its parse failed.
const DIRECTORY_BYTES_MAX: u64 = 16 << 20;

fn within_directory_bound(tail_bytes: u64, name: &str) -> Result<()> {
    match tail_bytes > DIRECTORY_BYTES_MAX {
        true => Err(ConvertError::torch_dist(format!(
            "{name}: the zip end records ask for its last {tail_bytes} bytes, more than the \
             {DIRECTORY_BYTES_MAX} an archive's directory may take"
        ))),
        false => Ok(()),
    }
}

/// The item's central directory, read from its end (one ranged read, a second one when the
/// directory is longer than the first).
pub(super) fn read_directory(
    storage: &dyn Storage,
    path: &str,
    item: &Range<u64>,
    name: &str,
) -> Result<(CentralDirectory, Vec<zip::DirectoryEntry>)> {
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
                    within_directory_bound(len - dir.range.start, name)?;
                    storage.get_range(path, item.start + dir.range.start..item.start + dir.range.end)?
                };
                let records = zip::parse_central_directory(&bytes, &dir, name)?;
                return Ok((dir, records));
            }
            TailLookup::NeedFrom(f) if f < from => {
                within_directory_bound(len - f, name)?;
                from = f
            }
            TailLookup::NeedFrom(f) => {
                return Err(ConvertError::torch_dist(format!(
                    "{name}: the zip end records ask for bytes from {f} again"
                )));
            }
        }
    }
}

/// The record of `data.pkl` (`storage: None`) or of storage `data/<key>`: an entry of the
/// archive's one top-level folder.
pub(super) fn find_record(
    records: &[zip::DirectoryEntry],
    pkl: &str,
    storage: Option<&str>,
    name: &str,
) -> Result<usize> {
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
        ([], None) => Err(ConvertError::torch_dist(format!("{name}: no data.pkl: not a torch.save archive"))),
        ([], Some(k)) => Err(ConvertError::torch_dist(format!("{name}: no entry for storage {k} that data.pkl names"))),
        (_, _) => Err(ConvertError::torch_dist(format!("{name}: several archives in one item"))),
    }
}

pub(super) fn locate(
    storage: &dyn Storage,
    path: &str,
    item: &Range<u64>,
    dir: &CentralDirectory,
    record: zip::DirectoryEntry,
    index: usize,
    name: &str,
) -> Result<Entry> {
    let at = record.local_header_offset;
    let want = zip::LOCAL_HEADER_BYTES + record.name.len() as u64;
    let end = at.saturating_add(want).min(dir.range.start);
    let local = storage.get_range(path, item.start + at..item.start + end)?;
    Ok(Entry::locate(record, &local, dir.range.start, index, name)?)
}

/// That the view `data.pkl` describes is the chunk the metadata says: same dtype, same
/// sizes (a legacy sharded-tensor view may drop or add axes of extent 1), within its
/// storage.
pub(super) fn check_view(
    key: &str,
    t: &TensorMeta,
    chunk: &ChunkMeta,
    v: &TorchSaveTensor,
    storage_bytes: u64,
    name: &str,
) -> Result<()> {
    if v.dtype != t.dtype {
        return Err(ConvertError::torch_dist(format!(
            "{key}: {name}: data.pkl holds {} but the metadata says {}",
            v.dtype, t.dtype
        )));
    }
    let squeeze = |s: &[u64]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<u64>>();
    if v.size != chunk.sizes && squeeze(&v.size) != squeeze(&chunk.sizes) {
        return Err(ConvertError::torch_dist(format!(
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
pub fn read_chunk(storage: &dyn Storage, loc: &ChunkLocation, out: &mut [u8]) -> Result<()> {
    let t = &loc.tensor;
    let isz = t.dtype.size();
    let numel = t.numel().ok_or_else(|| ConvertError::torch_dist(format!("{}: chunk size overflows", loc.key)))?;
    let need =
        numel.checked_mul(isz).ok_or_else(|| ConvertError::torch_dist(format!("{}: chunk size overflows", loc.key)))?;
    if out.len() as u64 != need {
        return Err(ConvertError::torch_dist(format!("{}: a buffer of {} bytes for {need} bytes", loc.key, out.len())));
    }
    if numel == 0 {
        return Ok(());
    }
    let span = t.span().ok_or_else(|| ConvertError::torch_dist(format!("{}: chunk view overflows", loc.key)))?;
    let bytes = (loc.data.start + span.start * isz)..(loc.data.start + span.end * isz);
    if bytes.end > loc.data.end {
        return Err(ConvertError::torch_dist(format!("{}: view reaches past its storage in {}", loc.key, loc.file)));
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
pub(super) fn gather(src: &[u8], size: &[u64], stride: &[u64], isz: usize, out: &mut [u8]) {
    let n = size.len();
    let mut idx = vec![0u64; n];
    let mut at: u64 = 0;
    for dst in out.chunks_exact_mut(isz) {
        let s = at as usize * isz;
        dst.copy_from_slice(&src[s..s + isz]);
        // Next index, row-major: the last axis fastest. `at` moves only to elements of the
        // view, whose span was checked: a step past an axis's end first (an axis of extent 1
        // may have any stride) overflowed.
        for d in (0..n).rev() {
            if idx[d] + 1 < size[d] {
                idx[d] += 1;
                at += stride[d];
                break;
            }
            at -= stride[d] * idx[d];
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use dckpt::storage::MemoryStorage;

    use super::*;

    /// An axis of extent 1 may carry any stride (torch leaves it as it was): the walk over a
    /// view stepped past it first, which overflowed for a stride near 2^64.
    #[test]
    fn gather_walks_a_view_whose_unit_axis_has_any_stride() {
        let src: Vec<u8> = (0..6).collect();
        for unit in [0, 7, u64::MAX / 2, u64::MAX] {
            // A 3 x 1 x 2 view, transposed: element (i, 0, j) at j * 3 + i.
            let mut out = vec![0u8; 6];
            gather(&src, &[3, 1, 2], &[1, unit, 3], 1, &mut out);
            assert_eq!(out, [0, 3, 1, 4, 2, 5], "stride {unit}");
        }
    }

    /// End records that put an item's directory at its first byte, 20 MiB before them, are
    /// refused before anything is read: the whole item was fetched in one read first.
    #[test]
    fn end_records_claiming_a_huge_directory_are_refused_before_reading_it() {
        let pad = 20u32 << 20;
        let mut item = vec![0u8; pad as usize];
        item.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        item.extend_from_slice(&[0, 0, 0, 0, 1, 0, 1, 0]);
        item.extend_from_slice(&pad.to_le_bytes());
        item.extend_from_slice(&0u32.to_le_bytes());
        item.extend_from_slice(&[0, 0]);
        let s = MemoryStorage::new();
        let len = item.len() as u64;
        s.put("f", Bytes::from(item)).unwrap();
        let Err(e) = read_directory(&s, "f", &(0..len), "f (item at 0)") else { panic!("read") };
        assert!(e.to_string().contains("ask for its last 20971542 bytes"), "{e}");
    }
}
