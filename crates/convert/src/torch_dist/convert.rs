//! Conversions between DCP / Megatron `torch_dist` checkpoints and dckpt checkpoints.
//!
//! [`torch_dist_to_dckpt`]: every chunk of the source becomes one main piece of a dckpt
//! save through the engine's sourced pieces, its bytes pulled from the item's storage
//! entry while the data file is written (checksummed on the way), so memory stays a few
//! write buffers; a row-major chunk is read straight from its place, a strided one
//! (a transposed tensor) is gathered into row-major order one chunk at a time. The zip
//! CRC-32 `torch.save` recorded is checked against the bytes as they pass, so a damaged
//! source fails the save and leaves nothing behind. Objects (DCP's bytes items) are
//! carried as their opaque bytes: a Megatron ShardedObject `key/shard_<offsets>_<shape>`
//! becomes the object `key` at that place of that grid (when every place of the grid is
//! there), any other key a single object;
//! Megatron's `common.pt` becomes the single object [`COMMON_OBJECT`] (the layout entry
//! [`COMMON_LAYOUT_ENTRY`] says whether it did).
//!
//! [`dckpt_to_torch_dist`]: every tensor, read through the engine (so checked against its
//! checksums) in slabs, written as one whole chunk: a `torch.save` archive in the data file
//! `__0_0.distcp`, its CRC-32 computed as the bytes pass; every object as one bytes item
//! holding the `torch.save` archive of its value (`objects.rs`; a grid object under
//! Megatron's `key/shard_<offsets>_<shape>`); Megatron's common state as `common.pt`: the object a conversion kept it as, else the
//! `common.pt` Megatron's own save wrote beside the checkpoint, else `torch.save({})`; no
//! two outputs of one DCP key (refused, naming both). Then Megatron's `metadata.json`,
//! and `.metadata` last, as DCP writes it: a directory that `dcp.load` and Megatron's
//! `dist_checkpointing.load` read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use dckpt::storage::{Pipe, PipeOptions, Settled, Storage, StorageExt, write_pipelined};
use dckpt::{Checkpointer, ObjectData, PieceSource, SaveOptions, SaveOutcome, SaveState, SourcedTensor, TensorData};
use dckpt_shard_spec::{ShardedObject, ShardedTensor, TensorDecl};
use dckpt_torch_format::dcp::{
    ChunkMeta, DcpMetadata, MetadataIndex, ShardedObjectKey, StateEntry, StorageInfo, TensorMeta, megatron_key,
};
use dckpt_torch_format::write::{TensorArchive, empty_dict_archive, encode_dcp_metadata};
use serde::Serialize;

use super::locate::{gather, item_range};
use super::{
    Checkpoint, ChunkLocation, DCP_METADATA, MEGATRON_COMMON, MEGATRON_METADATA, is_row_major, sharded_object,
};
use crate::source::TensorSource;
use crate::{ConvertError, ConvertReport, DckptSource, Result};

/// The dckpt object that holds Megatron's `common.pt` (its bytes, as they are).
pub const COMMON_OBJECT: &str = "common.pt";

/// The layout entry naming the object that holds the source's `common.pt`: [`COMMON_OBJECT`]
/// where the source had that file, empty where it had none, so that a DCP item of that name
/// is not taken for it on the way back.
pub const COMMON_LAYOUT_ENTRY: &str = "megatron_common";
/// The one data file [`dckpt_to_torch_dist`] writes.
pub const DATA_FILE: &str = "__0_0.distcp";
/// The slab a tensor is read in when written to torch_dist.
const SLAB_BYTES: u64 = 32 << 20;
/// The largest object item read into memory (objects are small Python values).
const OBJECT_BYTES_MAX: u64 = 1 << 30;

/// One chunk's bytes as the engine pulls them, the storage entry's CRC-32 checked on the
/// way when the chunk is its whole storage.
struct ChunkBytes<'a> {
    storage: &'a dyn Storage,
    loc: ChunkLocation,
    read: &'a AtomicU64,
    /// The CRC-32 so far and the next offset expected (reads come in order, once).
    crc: Mutex<(crc32fast::Hasher, u64)>,
    /// A strided chunk, gathered row-major on its first read.
    gathered: Mutex<Option<Vec<u8>>>,
}

impl ChunkBytes<'_> {
    fn whole_storage(&self) -> bool {
        let t = &self.loc.tensor;
        t.span().is_some_and(|s| s.start == 0 && s.end == t.storage_numel)
    }

    fn fail(&self, detail: String) -> dckpt::Error {
        dckpt::Error::from(dckpt::ErrorKind::Request { key: self.loc.key.clone(), detail })
    }

    fn check_crc(&self, offset: u64, buf: &[u8]) -> dckpt::Result<()> {
        let mut g = self.crc.lock().unwrap_or_else(|p| p.into_inner());
        if g.1 != offset {
            // The engine promises reads in order; out of order, nothing could be checked.
            return Err(self.fail(format!("read at {offset} out of order (expected {}): not checked", g.1)));
        }
        g.0.update(buf);
        g.1 += buf.len() as u64;
        // The zip entry's CRC-32 covers the whole storage, which a strided view (every
        // other element) spans without being all of it: checked when all of it is hashed.
        let t = &self.loc.tensor;
        if g.1 == t.storage_numel.saturating_mul(t.dtype.size()) {
            let found = g.0.clone().finalize();
            if found != self.loc.crc32 {
                return Err(dckpt::Error::from(dckpt::ErrorKind::Checksum {
                    file: format!("{} (item at {})", self.storage.location(&self.loc.file), self.loc.item.start),
                    offset: self.loc.data.start,
                    detail: format!(
                        "tensor {:?} chunk at {:?}: CRC-32 {found:08x}, the zip directory says {:08x}",
                        self.loc.key, self.loc.chunk.offsets, self.loc.crc32
                    ),
                }));
            }
        }
        Ok(())
    }
}

impl PieceSource for ChunkBytes<'_> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> dckpt::Result<()> {
        let t = &self.loc.tensor;
        let isz = t.dtype.size();
        let span = t.span().ok_or_else(|| self.fail("chunk view overflows".into()))?;
        if is_row_major(&t.size, &t.stride) {
            let at = self.loc.data.start + span.start * isz + offset;
            self.storage.read_into(&self.loc.file, &mut [(at, &mut *buf)])?;
            if self.whole_storage() {
                self.check_crc(offset, buf)?;
            }
        } else {
            let mut g = self.gathered.lock().unwrap_or_else(|p| p.into_inner());
            if g.is_none() {
                let bytes = (self.loc.data.start + span.start * isz)..(self.loc.data.start + span.end * isz);
                let src = self.storage.get_range(&self.loc.file, bytes)?;
                if self.whole_storage() {
                    self.check_crc(0, &src)?;
                }
                let mut out = vec![0u8; self.loc.nbytes() as usize];
                gather(&src, &t.size, &t.stride, isz as usize, &mut out);
                *g = Some(out);
            }
            let all = g.as_ref().expect("gathered above");
            let end = offset as usize + buf.len();
            buf.copy_from_slice(all.get(offset as usize..end).ok_or_else(|| self.fail("read past the chunk".into()))?);
            if end == all.len() {
                *g = None;
            }
        }
        self.read.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// The dckpt object each DCP bytes key becomes: a Megatron ShardedObject key whose grid
/// is complete among `keys` (every position once, as Megatron saves them) the object at its
/// place in that grid; any other key (a lone `x/shard_0_2` among them) a single object, so
/// that dckpt's check that every grid is complete never refuses a checkpoint for a key's
/// spelling.
fn objects_of<'k>(keys: &[&'k str]) -> Vec<(&'k str, ShardedObject)> {
    use std::collections::{BTreeSet, HashMap};
    let parsed: Vec<_> =
        keys.iter().map(|k| sharded_object(k).filter(|s| megatron_key(&s.key, &s.offset, &s.shape) == *k)).collect();
    let mut grids: HashMap<(&str, &[u64]), BTreeSet<&[u64]>> = HashMap::new();
    for s in parsed.iter().flatten() {
        grids.entry((s.key.as_str(), s.shape.as_slice())).or_default().insert(s.offset.as_slice());
    }
    let complete = |s: &ShardedObjectKey| {
        let n = s.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let have = grids.get(&(s.key.as_str(), s.shape.as_slice())).map_or(0, |g| g.len() as u64);
        n == Some(have) && s.offset.iter().zip(&s.shape).all(|(o, d)| o < d)
    };
    keys.iter()
        .zip(&parsed)
        .map(|(k, p)| match p {
            Some(s) if complete(s) => (*k, ShardedObject::in_grid(s.key.as_str(), s.shape.clone(), s.offset.clone())),
            _ => (*k, ShardedObject::single(*k)),
        })
        .collect()
}

/// Writes the DCP / `torch_dist` checkpoint `ckpt` (opened from `src`) as a new dckpt
/// checkpoint into `dst` (see the module docs). Every chunk is located and checked against
/// the metadata before anything is written. `read` counts the tensor bytes read.
pub fn torch_dist_to_dckpt(
    src: &dyn Storage,
    ckpt: &Checkpoint,
    dst: &Arc<dyn Storage>,
    read: &AtomicU64,
) -> Result<ConvertReport> {
    let mut sources = Vec::new();
    // A tensor of no elements listed without a chunk has nothing to store: an empty piece
    // stands for it. One with elements and no chunk is left to the declarations below.
    let empty: Vec<ShardedTensor> = ckpt
        .tensors()
        .filter(|(_, t)| t.chunks.is_empty() && t.size.contains(&0))
        .map(|(key, t)| ShardedTensor::chunk(key, t.dtype, t.size.clone(), vec![0; t.size.len()], t.size.clone()))
        .collect();
    for (key, t) in ckpt.tensors() {
        for (i, c) in t.chunks.iter().enumerate() {
            let loc = ckpt.locate_chunk(src, key, i)?;
            let tensor = ShardedTensor::chunk(key, t.dtype, t.size.clone(), c.offsets.clone(), c.sizes.clone());
            sources.push((
                tensor,
                ChunkBytes {
                    storage: src,
                    loc,
                    read,
                    crc: Mutex::new((crc32fast::Hasher::new(), 0)),
                    gathered: Mutex::new(None),
                },
            ));
        }
    }
    let keys: Vec<&str> = ckpt.objects().collect();
    let mut objects: Vec<(ShardedObject, Bytes)> = Vec::new();
    for (key, object) in objects_of(&keys) {
        let info = ckpt.item(key, None)?;
        let range = item_range(&ckpt.files, src, info, key)?;
        if range.end - range.start > OBJECT_BYTES_MAX {
            return Err(ConvertError::torch_dist(format!(
                "{key}: an object of {} bytes, more than the {OBJECT_BYTES_MAX} converted",
                range.end - range.start
            )));
        }
        objects.push((object, src.get_range(&info.relative_path, range)?));
    }
    if ckpt.common_bytes.is_some() {
        if objects.iter().any(|(o, _)| o.key.as_str() == COMMON_OBJECT) {
            return Err(ConvertError::torch_dist(format!(
                "an object is named {COMMON_OBJECT:?}, the name {MEGATRON_COMMON} is kept under"
            )));
        }
        objects.push((ShardedObject::single(COMMON_OBJECT), src.get(MEGATRON_COMMON)?));
    }
    let state = SaveState {
        tensors: empty.iter().map(|t| TensorData { tensor: t.clone(), data: &[] }).collect(),
        objects: objects
            .iter()
            .map(|(o, b)| ObjectData { object: o.clone(), data: b, compare: Default::default() })
            .collect(),
    };
    let sourced: Vec<SourcedTensor<'_>> =
        sources.iter().map(|(t, s)| SourcedTensor { tensor: t.clone(), source: s }).collect();
    // Every tensor the source lists, declared: the save's plan proves the converted state is
    // exactly these, so none is dropped (one listed without a chunk was, with success).
    let declared = ckpt
        .tensors()
        .map(|(key, t)| TensorDecl { key: key.into(), dtype: t.dtype, global_shape: t.size.clone().into() })
        .collect();
    let mut opts = SaveOptions::default().layout_entry("converted_from", ckpt.format.name()).declared(declared);
    if let Some(m) = &ckpt.megatron {
        opts = opts.layout_entry("megatron_metadata", m);
    }
    // Written either way, so that the way back tells an item named common.pt from the file.
    opts = opts.layout_entry(COMMON_LAYOUT_ENTRY, if ckpt.common_bytes.is_some() { COMMON_OBJECT } else { "" });
    let SaveOutcome { save_id, bytes, files, .. } = Checkpointer::local().save_sourced(dst, &state, &sourced, &opts)?;
    Ok(ConvertReport { source_format: ckpt.format.name(), tensors: ckpt.tensors().count(), bytes, files, save_id })
}

/// What [`dckpt_to_torch_dist`] wrote.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TorchDistReport {
    /// The source's format (`dckpt`).
    pub source_format: &'static str,
    /// The id of the save that wrote the source.
    pub source_save_id: String,
    /// Tensors written (each one whole chunk).
    pub tensors: usize,
    /// Objects written as bytes items (Megatron's common state not counted).
    pub objects: usize,
    /// Bytes of tensor data written.
    pub bytes: u64,
    /// The data files.
    pub files: Vec<String>,
    /// Whether `common.pt` holds the source's common state (else it is an empty dict).
    pub common_from_source: bool,
}

/// Writes the dckpt checkpoint `source` as a new torch_dist directory into `dst` (see the
/// module docs). Refuses a `dst` that holds any file it would write already. `progress` counts the
/// tensor bytes written. On failure the files written are removed.
pub fn dckpt_to_torch_dist(source: &DckptSource, dst: &dyn Storage, progress: &AtomicU64) -> Result<TorchDistReport> {
    // Every file it writes: another's `common.pt` or `metadata.json` there would be
    // overwritten, and removed where the conversion then failed.
    for name in [DCP_METADATA, DATA_FILE, MEGATRON_COMMON, MEGATRON_METADATA] {
        if dst.exists(name)? {
            return Err(ConvertError::Exists { location: dst.location(name) });
        }
    }
    let written = std::cell::RefCell::new(Vec::<&'static str>::new());
    let result = write_torch_dist(source, dst, progress, &written);
    if result.is_err() {
        for f in written.borrow().iter() {
            let _ = dst.delete(f);
        }
    }
    result
}

fn write_torch_dist(
    source: &DckptSource,
    dst: &dyn Storage,
    progress: &AtomicU64,
    written: &std::cell::RefCell<Vec<&'static str>>,
) -> Result<TorchDistReport> {
    let mut md = DcpMetadata {
        state_dict_metadata: Vec::new(),
        storage_data: Vec::new(),
        planner_data: true,
        version: Some("1.0.0".into()),
        // No `StorageMeta`: releases before 2.4 have no such class and cannot unpickle
        // it; later ones make an empty one when it is absent.
        save_id: None,
        extra_attributes: Vec::new(),
        reformulated: Vec::new(),
    };
    let (common, objects) = objects_and_common(source)?;
    let tensors = source.tensors();
    let total: u64 = tensors.iter().map(|t| TensorArchive::new(t.dtype, &t.shape).len()).sum::<u64>()
        + objects.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
    // Handed over at a rendezvous, two slabs at most: one filled here while the writer
    // writes the other.
    let options = PipeOptions { queue: 0, buffers: 2, buffer_bytes: SLAB_BYTES as usize, inline_bytes: 0 };
    let bytes = write_pipelined(dst, DATA_FILE, total, options, |pipe| {
        fill_data_file(pipe, source, &objects, &mut md, progress)
    })?;
    written.borrow_mut().push(DATA_FILE);
    let common_from_source = common.is_some();
    dst.put(MEGATRON_COMMON, Bytes::from(common.unwrap_or_else(empty_dict_archive)))?;
    written.borrow_mut().push(MEGATRON_COMMON);
    let megatron = serde_json::json!({
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    });
    dst.put(MEGATRON_METADATA, Bytes::from(megatron.to_string()))?;
    written.borrow_mut().push(MEGATRON_METADATA);
    // Last: DCP's readers take `.metadata` as the mark of a whole checkpoint. Its error does
    // not say whether it landed: the files it names go only where it certainly did not.
    let marker = Bytes::from(encode_dcp_metadata(&md));
    match dst.settle(DCP_METADATA, &marker, dst.put_if_absent(DCP_METADATA, marker.clone())) {
        Settled::Landed => {}
        Settled::Failed(e) => return Err(e.into()),
        Settled::Unknown(detail) => {
            written.borrow_mut().clear();
            return Err(ConvertError::CommitUncertain { location: dst.location(DCP_METADATA), detail });
        }
    }
    Ok(TorchDistReport {
        source_format: "dckpt",
        source_save_id: source.save_id().to_string(),
        tensors: tensors.len(),
        objects: objects.len(),
        bytes,
        files: vec![DATA_FILE.to_string()],
        common_from_source,
    })
}

/// Hands the data file to `pipe`: the objects' bytes, then each tensor as a `torch.save`
/// archive whose records go around its bytes, read in slabs and CRC-32'd on the way; each
/// item is entered in `md` where it lies. Returns the bytes of tensor data.
/// The `torch.save` archive of every object, under its DCP key (none of them one a tensor
/// or another object has), and that of Megatron's common state: the object a conversion kept
/// it as, else the file Megatron's save wrote beside dckpt's (its common strategy is
/// Megatron's, not dckpt's), else none.
#[allow(clippy::type_complexity)]
fn objects_and_common(source: &DckptSource) -> Result<(Option<Vec<u8>>, Vec<(String, Vec<u8>)>)> {
    let common_object = common_is_object(source);
    let mut common = None;
    let mut objects = Vec::new();
    let mut names = OutputNames::default();
    for t in source.tensors() {
        names.claim(&t.key, || format!("the tensor {:?}", t.key))?;
    }
    for (key, shape, offset) in source.stored_objects() {
        if common_object && key == COMMON_OBJECT && shape.is_empty() {
            common = Some(source.read_object(key, shape, offset)?);
            continue;
        }
        let name = if shape.is_empty() { key.clone() } else { megatron_key(key, offset, shape) };
        names.claim(&name, || format!("the object {key:?} at {offset:?} of a grid of {shape:?}"))?;
        let bytes = source.read_object(key, shape, offset)?;
        objects.push((name.clone(), super::objects::as_torch_save(&name, &bytes)?));
    }
    let common = match common {
        Some(bytes) => Some(super::objects::as_torch_save(MEGATRON_COMMON, &bytes)?),
        None if source.storage().exists(MEGATRON_COMMON)? => Some(source.storage().get(MEGATRON_COMMON)?.to_vec()),
        None => None,
    };
    Ok((common, objects))
}

/// Whether the object [`COMMON_OBJECT`] holds Megatron's `common.pt`: where the conversion
/// that wrote it says so, or (conversions written before [`COMMON_LAYOUT_ENTRY`]) where it
/// came from torch_dist. Otherwise it is a DCP item of that name, written back as one.
fn common_is_object(source: &DckptSource) -> bool {
    let layout = source.layout();
    match layout.get(COMMON_LAYOUT_ENTRY) {
        Some(key) => key == COMMON_OBJECT,
        None => layout.get("converted_from").is_some_and(|f| f == "torch_dist"),
    }
}

/// The DCP keys given out so far: a tensor and an object of one name, or a grid object's
/// `key/shard_...` and a single object named so, would be one key of `.metadata`, the last
/// written silently the only one read.
#[derive(Default)]
struct OutputNames(std::collections::HashMap<String, String>);

impl OutputNames {
    fn claim(&mut self, name: &str, what: impl Fn() -> String) -> Result<()> {
        match self.0.entry(name.to_string()) {
            std::collections::hash_map::Entry::Occupied(first) => Err(ConvertError::torch_dist(format!(
                "{} and {} would both be the DCP key {name:?}",
                first.get(),
                what()
            ))),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(what());
                Ok(())
            }
        }
    }
}

fn fill_data_file<'a>(
    pipe: &mut Pipe<'_, 'a>,
    source: &DckptSource,
    objects: &'a [(String, Vec<u8>)],
    md: &mut DcpMetadata,
    progress: &AtomicU64,
) -> Result<u64> {
    let mut at = 0u64;
    let mut bytes = 0u64;
    // Objects first: they are in memory already.
    for (name, b) in objects {
        pipe.write(b)?;
        md.state_dict_metadata.push((name.clone(), StateEntry::Bytes));
        md.storage_data.push((
            MetadataIndex { fqn: name.clone(), offset: None, index: None },
            StorageInfo { relative_path: DATA_FILE.into(), offset: at, length: b.len() as u64, transformed: false },
        ));
        at += b.len() as u64;
    }
    for t in source.tensors() {
        let archive = TensorArchive::new(t.dtype, &t.shape);
        pipe.write_owned(archive.head().to_vec())?;
        let mut crc = crc32fast::Hasher::new();
        let isz = t.dtype.size();
        let per = (SLAB_BYTES / isz).max(1);
        let numel = t.numel();
        let mut pos = 0;
        while pos < numel {
            let n = per.min(numel - pos);
            // A reused slab is not cleared, since each read overwrites all of it.
            pipe.fill((n * isz) as usize, |buf| {
                source.read_range(&t.key, pos, buf)?;
                crc.update(buf);
                Ok::<(), ConvertError>(())
            })?;
            bytes += n * isz;
            progress.fetch_add(n * isz, Ordering::Relaxed);
            pos += n;
        }
        pipe.write_owned(archive.tail(crc.finalize()))?;
        md.state_dict_metadata.push((
            t.key.clone(),
            StateEntry::Tensor(TensorMeta {
                dtype: t.dtype,
                size: t.shape.to_vec(),
                chunks: vec![ChunkMeta { offsets: vec![0; t.shape.len()], sizes: t.shape.to_vec() }],
            }),
        ));
        md.storage_data.push((
            MetadataIndex { fqn: t.key.clone(), offset: Some(vec![0; t.shape.len()]), index: Some(0) },
            StorageInfo { relative_path: DATA_FILE.into(), offset: at, length: archive.len(), transformed: false },
        ));
        at += archive.len();
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_complete_megatron_grids_become_grids() {
        let keys =
            ["a/shard_0_2", "a/shard_1_2", "b/shard_0_2", "c/shard_0.1_1.2", "c/shard_0.0_1.2", "d", "e/shard_01_2"];
        let got: Vec<(String, Vec<u64>, Vec<u64>)> =
            objects_of(&keys).into_iter().map(|(_, o)| (o.key.to_string(), o.grid_shape, o.grid_offset)).collect();
        assert_eq!(
            got,
            [
                ("a".into(), vec![2], vec![0]),
                ("a".into(), vec![2], vec![1]),
                // Half a grid: kept under its own key.
                ("b/shard_0_2".into(), vec![], vec![]),
                ("c".into(), vec![1, 2], vec![0, 1]),
                ("c".into(), vec![1, 2], vec![0, 0]),
                ("d".into(), vec![], vec![]),
                // Not how Megatron spells offset 1: it would not come back the same.
                ("e/shard_01_2".into(), vec![], vec![]),
            ]
        );
    }
}
