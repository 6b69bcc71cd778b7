//! The reading side of an export: a checkpoint as global tensors read by flat ranges.

use std::sync::Arc;

use dckpt::storage::Storage;
use dckpt::{Checkpointer, KeyPolicy, LoadOptions, LoadRequest, Strictness};
use dckpt_shard_spec::{DType, Dims, Region, ReplicaId, ShardedObject, ShardedTensor};

use crate::{ConvertError, Result};

/// A global tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceTensor {
    /// Its key.
    pub key: String,
    /// Its element type.
    pub dtype: DType,
    /// Its global shape.
    pub shape: Dims,
}

impl SourceTensor {
    /// Elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes.
    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size()
    }
}

/// One read of a [`TensorSource`]: elements `flat_start..` of the tensor `key`, in
/// row-major order, `buf.len() / dtype.size()` of them.
#[derive(Debug)]
pub struct RangeRead<'a> {
    /// The tensor.
    pub key: &'a str,
    /// Its first element wanted (row-major index into the global tensor).
    pub flat_start: u64,
    /// Receives the elements.
    pub buf: &'a mut [u8],
}

/// A checkpoint read as whole global tensors, a range at a time, so that an export holds
/// no more than the ranges it asks for. dckpt checkpoints are one ([`DckptSource`]); a
/// torch_dist reader is another.
pub trait TensorSource {
    /// Every tensor, sorted by key.
    fn tensors(&self) -> &[SourceTensor];

    /// The keys of the objects (not tensors) the checkpoint also holds.
    fn objects(&self) -> &[String];

    /// Fills every read (several at once, so a source can serve them in one pass), each
    /// byte checked as the source's format allows.
    fn read_ranges(&self, reads: &mut [RangeRead<'_>]) -> Result<()>;

    /// One read.
    fn read_range(&self, key: &str, flat_start: u64, buf: &mut [u8]) -> Result<()> {
        self.read_ranges(&mut [RangeRead { key, flat_start, buf }])
    }
}

/// A dckpt checkpoint as a [`TensorSource`]: every read is a load through the engine (a
/// world of one), so every byte is checked against its checksum as loads check them, and
/// nothing here reads a data file itself.
pub struct DckptSource {
    storage: Arc<dyn Storage>,
    ckpt: Checkpointer,
    tensors: Vec<SourceTensor>,
    objects: Vec<String>,
    /// Every stored object: key, grid shape, grid offset.
    grid: Vec<(String, Vec<u64>, Vec<u64>)>,
    save_id: String,
    layout: std::collections::BTreeMap<String, String>,
}

impl std::fmt::Debug for DckptSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DckptSource").field("storage", &self.storage).field("tensors", &self.tensors.len()).finish()
    }
}

impl DckptSource {
    /// Opens the committed checkpoint in `storage` (its metadata read and validated).
    pub fn open(storage: Arc<dyn Storage>) -> Result<DckptSource> {
        let ckpt = Checkpointer::local();
        let meta = ckpt.metadata(&storage)?;
        let tensors = meta
            .tensors
            .iter()
            .map(|t| SourceTensor { key: t.key.clone(), dtype: t.dtype, shape: t.global_shape.clone() })
            .collect();
        let objects = meta.objects.iter().map(|o| o.key.clone()).collect();
        let grid = meta
            .objects
            .iter()
            .flat_map(|o| o.entries.iter().map(|e| (o.key.clone(), o.grid_shape.clone(), e.grid_offset.clone())))
            .collect();
        Ok(DckptSource { storage, ckpt, tensors, objects, grid, save_id: meta.save_id, layout: meta.layout })
    }

    /// Every stored object: its key, its grid's shape and its place in the grid (`[]` and
    /// `[]` for a single object), sorted by key.
    pub fn stored_objects(&self) -> &[(String, Vec<u64>, Vec<u64>)] {
        &self.grid
    }

    /// The id of the save that wrote the checkpoint.
    pub fn save_id(&self) -> &str {
        &self.save_id
    }

    /// The layout entries the save recorded (`converted_from`, ...).
    pub fn layout(&self) -> &std::collections::BTreeMap<String, String> {
        &self.layout
    }

    /// The storage the checkpoint is in: files beside it (Megatron's `common.pt`) are read
    /// from there.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// Every read is a load of its own, which reads the metadata again: a save that
    /// replaced the checkpoint since it was opened would mix two saves in one output.
    fn same_save(&self, load: dckpt::LoadOutcome) -> Result<()> {
        if load.save_id == self.save_id {
            return Ok(());
        }
        Err(ConvertError::Replaced {
            location: self.storage.location(""),
            opened: self.save_id.clone(),
            now: load.save_id,
        })
    }

    /// The bytes of the object `key` at `grid_offset` of a grid of `grid_shape`, loaded
    /// through the engine (checked against their checksums).
    pub fn read_object(&self, key: &str, grid_shape: &[u64], grid_offset: &[u64]) -> Result<Vec<u8>> {
        let object = ShardedObject::in_grid(key, grid_shape.to_vec(), grid_offset.to_vec());
        let mut req = LoadRequest::new().object(object);
        let opts = LoadOptions {
            strictness: Strictness { missing: KeyPolicy::Raise, unexpected: KeyPolicy::Ignore },
            ..LoadOptions::default()
        };
        self.same_save(self.ckpt.load(&self.storage, &mut req, &opts)?)?;
        req.objects.pop().and_then(|o| o.data).ok_or_else(|| {
            dckpt::Error::from(dckpt::ErrorKind::MissingKeys { keys: vec![key.to_string()], more: 0 }).into()
        })
    }
}

/// The region of elements `start..start + n` of a tensor of `shape`: whole rows as a box
/// (the engine reads boxes straight into place), anything else as a flat range of the
/// whole box.
pub fn range_region(shape: &[u64], start: u64, n: u64) -> Region {
    let row: u64 = shape.iter().skip(1).product();
    if shape.is_empty() || (start == 0 && n == shape.iter().product::<u64>()) {
        return Region::full(shape);
    }
    if row > 0 && start.is_multiple_of(row) && n.is_multiple_of(row) {
        let mut offset = vec![0; shape.len()];
        let mut extent = shape.to_vec();
        offset[0] = start / row;
        extent[0] = n / row;
        return Region::boxed(offset, extent);
    }
    Region::full(shape).narrowed(start, start + n)
}

impl TensorSource for DckptSource {
    fn tensors(&self) -> &[SourceTensor] {
        &self.tensors
    }

    fn objects(&self) -> &[String] {
        &self.objects
    }

    fn read_ranges(&self, reads: &mut [RangeRead<'_>]) -> Result<()> {
        let mut req = LoadRequest::new();
        for r in reads.iter_mut().filter(|r| !r.buf.is_empty()) {
            let t = self.tensors.binary_search_by(|t| t.key.as_str().cmp(r.key)).map(|i| &self.tensors[i]).map_err(
                |_| dckpt::Error::from(dckpt::ErrorKind::MissingKeys { keys: vec![r.key.to_string()], more: 0 }),
            )?;
            let n = r.buf.len() as u64 / t.dtype.size();
            let tensor = ShardedTensor {
                key: t.key.as_str().into(),
                dtype: t.dtype,
                global_shape: t.shape.clone(),
                region: range_region(&t.shape, r.flat_start, n),
                replica_id: ReplicaId::MAIN,
            };
            req.push_tensor(tensor, r.buf);
        }
        if req.tensors.is_empty() {
            return Ok(());
        }
        let opts = LoadOptions {
            strictness: Strictness { missing: KeyPolicy::Raise, unexpected: KeyPolicy::Ignore },
            ..LoadOptions::default()
        };
        self.same_save(self.ckpt.load(&self.storage, &mut req, &opts)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_of_whole_rows_are_boxes_and_others_flat() {
        assert_eq!(range_region(&[4, 3], 0, 12), Region::full(&[4, 3]));
        assert_eq!(range_region(&[4, 3], 3, 6), Region::boxed([1, 0], [2, 3]));
        assert_eq!(range_region(&[4, 3], 4, 2), Region::full(&[4, 3]).narrowed(4, 6));
        assert_eq!(range_region(&[10], 2, 5), Region::boxed([2], [5]));
        assert_eq!(range_region(&[], 0, 1), Region::full(&[]));
    }
}
