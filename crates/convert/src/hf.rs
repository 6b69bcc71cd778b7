//! Hugging Face safetensors models read through [`Storage`], and their conversion to a
//! dckpt checkpoint.
//!
//! A model is one `.safetensors` file, a directory with `model.safetensors`, or shards
//! listed by `model.safetensors.index.json`. Every header is validated before anything is
//! written: known dtypes, sizes equal to dtype times shape (overflow checked), offsets
//! inside the file, no two tensors overlapping, every key once; `__metadata__` is ignored.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dckpt::storage::{Storage, StorageExt};
use dckpt::{Checkpointer, PieceSource, SaveOptions, SaveOutcome, SaveState, SourcedTensor};
use dckpt_format::{SAFETENSORS_HEADER_BYTES_MAX, parse_safetensors_header};
use dckpt_shard_spec::{DType, Dims, ShardedTensor};
use serde::{Deserialize, Serialize};

use crate::export::{INDEX_NAME, SINGLE_NAME};
use crate::source::{RangeRead, SourceTensor, TensorSource};
use crate::{ConvertError, Result};

/// One tensor of a model and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfTensor {
    /// Its key, dtype and shape.
    pub tensor: SourceTensor,
    /// The file that holds it.
    pub file: String,
    /// Its first byte in that file.
    pub at: u64,
}

/// A validated Hugging Face safetensors model.
#[derive(Debug)]
pub struct HfModel {
    storage: Arc<dyn Storage>,
    /// The files, in order.
    pub files: Vec<String>,
    /// Every tensor, sorted by key.
    pub tensors: Vec<HfTensor>,
    views: Vec<SourceTensor>,
}

#[derive(Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

impl HfModel {
    /// Opens the model in `storage`: the file `file` when given, else the shards its
    /// `model.safetensors.index.json` names, else its `model.safetensors`.
    pub fn open(storage: Arc<dyn Storage>, file: Option<&str>) -> Result<HfModel> {
        let (files, weight_map) = match file {
            Some(f) => (vec![f.to_string()], None),
            None => match storage.get(INDEX_NAME) {
                Ok(bytes) => {
                    let index: Index = serde_json::from_slice(&bytes).map_err(|e| {
                        ConvertError::safetensors(&storage.location(INDEX_NAME), None, format!("not an index: {e}"))
                    })?;
                    if index.weight_map.is_empty() {
                        // A broken index; converted, it would look like a model of nothing.
                        return Err(ConvertError::safetensors(
                            &storage.location(INDEX_NAME),
                            None,
                            "its weight_map names no tensor: nothing to convert",
                        ));
                    }
                    let mut files: Vec<String> = index.weight_map.values().cloned().collect();
                    files.sort();
                    files.dedup();
                    if let Some(bad) = files.iter().find(|f| f.contains("..") || f.starts_with('/')) {
                        return Err(ConvertError::safetensors(
                            &storage.location(INDEX_NAME),
                            None,
                            format!("file {bad:?} is outside the model's directory"),
                        ));
                    }
                    (files, Some(index.weight_map))
                }
                Err(dckpt::storage::Error::NotFound { .. }) => (vec![SINGLE_NAME.to_string()], None),
                Err(e) => return Err(e.into()),
            },
        };
        let mut tensors = Vec::new();
        for f in &files {
            tensors.extend(read_header(storage.as_ref(), f)?);
        }
        tensors.sort_by(|a: &HfTensor, b| a.tensor.key.cmp(&b.tensor.key));
        if let Some(w) = tensors.windows(2).find(|w| w[0].tensor.key == w[1].tensor.key) {
            return Err(ConvertError::safetensors(
                &storage.location(&w[1].file),
                Some(&w[1].tensor.key),
                format!("also in {}", w[0].file),
            ));
        }
        if let Some(map) = weight_map {
            let index = storage.location(INDEX_NAME);
            for (key, file) in &map {
                match tensors.binary_search_by(|t| t.tensor.key.as_str().cmp(key)) {
                    Ok(i) if &tensors[i].file == file => {}
                    Ok(i) => {
                        return Err(ConvertError::safetensors(
                            &index,
                            Some(key),
                            format!("the index says {file}, the tensor is in {}", tensors[i].file),
                        ));
                    }
                    Err(_) => {
                        return Err(ConvertError::safetensors(&index, Some(key), format!("not in {file}")));
                    }
                }
            }
            if let Some(t) = tensors.iter().find(|t| !map.contains_key(&t.tensor.key)) {
                return Err(ConvertError::safetensors(
                    &storage.location(&t.file),
                    Some(&t.tensor.key),
                    "not in the index's weight_map",
                ));
            }
        }
        let views = tensors.iter().map(|t| t.tensor.clone()).collect();
        Ok(HfModel { storage, files, tensors, views })
    }

    /// Bytes of tensor data.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.tensor.nbytes()).sum()
    }
}

/// The validated tensors of one safetensors file.
fn read_header(storage: &dyn Storage, file: &str) -> Result<Vec<HfTensor>> {
    let loc = storage.location(file);
    let size = storage.size(file)?;
    let bad = |tensor: Option<&str>, detail: String| ConvertError::safetensors(&loc, tensor, detail);
    if size < 8 {
        return Err(bad(None, format!("{size} bytes, shorter than the 8-byte header length")));
    }
    let len_bytes = storage.get_range(file, 0..8)?;
    let n = u64::from_le_bytes(len_bytes[..].try_into().map_err(|_| bad(None, "short read".into()))?);
    if n > SAFETENSORS_HEADER_BYTES_MAX {
        return Err(bad(None, format!("header length {n} is over the limit of {SAFETENSORS_HEADER_BYTES_MAX}")));
    }
    if 8 + n > size {
        return Err(bad(None, format!("header length {n} runs past the end of the file ({size} bytes)")));
    }
    let header_bytes = storage.get_range(file, 0..8 + n)?;
    let header = parse_safetensors_header(&header_bytes, &loc)?;
    let data_len = size - header.data_start;
    let mut out = Vec::with_capacity(header.entries.len());
    for e in header.entries {
        let name = e.name.as_str();
        let dtype = DType::ALL
            .into_iter()
            .find(|d| d.safetensors_name() == e.dtype)
            .ok_or_else(|| bad(Some(name), format!("dtype {:?} is not one dckpt stores", e.dtype)))?;
        let numel = dckpt_shard_spec::checked_numel(&e.shape)
            .ok_or_else(|| bad(Some(name), format!("shape {:?} overflows", e.shape)))?;
        let nbytes =
            numel.checked_mul(dtype.size()).ok_or_else(|| bad(Some(name), format!("shape {:?} overflows", e.shape)))?;
        let [begin, end] = e.data_offsets;
        if end - begin != nbytes {
            return Err(bad(
                Some(name),
                format!(
                    "data_offsets [{begin}, {end}] hold {} bytes, {dtype} {:?} needs {nbytes}",
                    end - begin,
                    e.shape
                ),
            ));
        }
        if end > data_len {
            return Err(bad(
                Some(name),
                format!("data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes)"),
            ));
        }
        out.push(HfTensor {
            tensor: SourceTensor { key: e.name, dtype, shape: Dims::from(e.shape) },
            file: file.to_string(),
            at: header.data_start + begin,
        });
    }
    // No two tensors share a byte (empty ones hold none).
    let mut by_offset: Vec<&HfTensor> = out.iter().filter(|t| t.tensor.nbytes() > 0).collect();
    by_offset.sort_by_key(|t| t.at);
    if let Some(w) = by_offset.windows(2).find(|w| w[0].at + w[0].tensor.nbytes() > w[1].at) {
        return Err(bad(Some(&w[1].tensor.key), format!("overlaps tensor {:?}", w[0].tensor.key)));
    }
    Ok(out)
}

impl TensorSource for HfModel {
    fn tensors(&self) -> &[SourceTensor] {
        &self.views
    }

    fn objects(&self) -> &[String] {
        &[]
    }

    fn read_ranges(&self, reads: &mut [RangeRead<'_>]) -> Result<()> {
        for r in reads.iter_mut() {
            let t =
                self.tensors.binary_search_by(|t| t.tensor.key.as_str().cmp(r.key)).map(|i| &self.tensors[i]).map_err(
                    |_| dckpt::Error::from(dckpt::ErrorKind::MissingKeys { keys: vec![r.key.to_string()], more: 0 }),
                )?;
            let at = t.at + r.flat_start * t.tensor.dtype.size();
            self.storage.read_into(&t.file, &mut [(at, &mut *r.buf)])?;
        }
        Ok(())
    }
}

/// A tensor's bytes in its file, as the engine pulls them.
struct FileBytes<'a> {
    storage: &'a dyn Storage,
    file: &'a str,
    at: u64,
    read: &'a AtomicU64,
}

impl PieceSource for FileBytes<'_> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> dckpt::Result<()> {
        self.storage.read_into(self.file, &mut [(self.at + offset, buf)])?;
        self.read.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// What a conversion wrote.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ConvertReport {
    /// The source's format (`safetensors`).
    pub source_format: &'static str,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data written.
    pub bytes: u64,
    /// Data files of the checkpoint.
    pub files: usize,
    /// The save's id.
    pub save_id: String,
}

/// Writes `model` as a new dckpt checkpoint into `dst` through the engine (a world of one,
/// each tensor one whole chunk, checksummed on the way). The engine pulls each tensor's
/// bytes from its file while it writes it: memory stays a few write buffers, whatever the
/// model's size. `read` counts the bytes read.
pub fn hf_to_dckpt(model: &HfModel, dst: &Arc<dyn Storage>, read: &AtomicU64) -> Result<ConvertReport> {
    let sources: Vec<FileBytes<'_>> = model
        .tensors
        .iter()
        .map(|t| FileBytes { storage: model.storage.as_ref(), file: &t.file, at: t.at, read })
        .collect();
    let sourced: Vec<SourcedTensor<'_>> = model
        .tensors
        .iter()
        .zip(&sources)
        .map(|(t, s)| SourcedTensor {
            tensor: ShardedTensor::whole(t.tensor.key.as_str(), t.tensor.dtype, t.tensor.shape.clone()),
            source: s,
        })
        .collect();
    let opts = SaveOptions::default().layout_entry("converted_from", "safetensors");
    let SaveOutcome { save_id, bytes, files, .. } =
        Checkpointer::local().save_sourced(dst, &SaveState::new(), &sourced, &opts)?;
    Ok(ConvertReport { source_format: "safetensors", tensors: sourced.len(), bytes, files, save_id })
}
