//! A DCP / `torch_dist` checkpoint as a [`TensorSource`], so that `dckpt export`
//! consolidates one into Hugging Face safetensors.
//!
//! Every chunk is located once, when the source is opened (ranged reads of its item's zip
//! directory and `data.pkl`, checked against the metadata). A read of a flat range of a
//! global tensor is intersected with each chunk's box ([`dckpt_shard_spec::overlap_runs`]),
//! and the runs a row-major chunk shares with it are read from the data file in one
//! vectored request per chunk; a strided chunk (a transposed tensor) is gathered into
//! row-major order whole, then copied from, and kept for the reads that follow (an export
//! reads a tensor in order, slab after slab), so memory holds one such chunk at most. DCP records no checksum a part of an entry can
//! be checked against (its CRC-32s cover whole zip entries): `dckpt validate` checks those.

use std::sync::Arc;

use dckpt::storage::Storage;
use dckpt_shard_spec::{Dims, Region, overlap_runs};

use super::{Checkpoint, ChunkLocation, is_row_major, read_chunk};
use crate::source::{RangeRead, SourceTensor, TensorSource};
use crate::{ConvertError, Result};

/// A tensor and where each of its chunks lies.
#[derive(Debug)]
struct Located {
    tensor: SourceTensor,
    chunks: Vec<(Region, ChunkLocation)>,
    /// Why its chunks cannot be read as the tensor: they overlap, leave a gap or are
    /// listed twice. Refused when it is read, so that `--include` can still take the others.
    refused: Option<String>,
}

/// A strided chunk gathered row-major: (tensor, chunk) and its bytes.
type Gathered = Option<((usize, usize), Vec<u8>)>;

/// A DCP / `torch_dist` checkpoint read as whole global tensors.
#[derive(Debug)]
pub struct TorchDistSource {
    storage: Arc<dyn Storage>,
    tensors: Vec<Located>,
    views: Vec<SourceTensor>,
    objects: Vec<String>,
    /// The strided chunk gathered last: (tensor, chunk) and its row-major bytes.
    gathered: std::sync::Mutex<Gathered>,
}

impl TorchDistSource {
    /// Opens the checkpoint in `storage` and locates every chunk.
    pub fn open(storage: Arc<dyn Storage>) -> Result<TorchDistSource> {
        let ckpt = Checkpoint::open(storage.as_ref())?;
        let mut tensors = Vec::new();
        for (key, t) in ckpt.tensors() {
            let mut chunks = Vec::with_capacity(t.chunks.len());
            for (i, c) in t.chunks.iter().enumerate() {
                let loc = ckpt.locate_chunk(storage.as_ref(), key, i)?;
                chunks.push((Region::boxed(c.offsets.clone(), c.sizes.clone()), loc));
            }
            // Chunks that overlap by as much as they leave uncovered fill the count a read
            // checks, with some elements read twice and the gap's left as they were.
            let refused =
                super::validate::coverage_problems(std::iter::once((key, t))).0.into_iter().next().map(|p| p.0);
            tensors.push(Located {
                tensor: SourceTensor { key: key.to_string(), dtype: t.dtype, shape: Dims::from(t.size.clone()) },
                chunks,
                refused,
            });
        }
        tensors.sort_by(|a, b| a.tensor.key.cmp(&b.tensor.key));
        let views = tensors.iter().map(|t| t.tensor.clone()).collect();
        let objects = ckpt.objects().map(str::to_string).collect();
        Ok(TorchDistSource { storage, tensors, views, objects, gathered: std::sync::Mutex::new(None) })
    }
}

impl TensorSource for TorchDistSource {
    fn tensors(&self) -> &[SourceTensor] {
        &self.views
    }

    fn objects(&self) -> &[String] {
        &self.objects
    }

    fn read_ranges(&self, reads: &mut [RangeRead<'_>]) -> Result<()> {
        for r in reads.iter_mut() {
            let ti = self.tensors.binary_search_by(|t| t.tensor.key.as_str().cmp(r.key)).map_err(|_| {
                dckpt::Error::from(dckpt::ErrorKind::MissingKeys { keys: vec![r.key.to_string()], more: 0 })
            })?;
            let t = &self.tensors[ti];
            if let Some(why) = &t.refused {
                return Err(ConvertError::TorchDist { detail: format!("{why} (run dckpt validate)") });
            }
            let isz = t.tensor.dtype.size();
            let n = r.buf.len() as u64 / isz;
            let want = Region::full(&t.tensor.shape).narrowed(r.flat_start, r.flat_start + n);
            let mut filled = 0u64;
            for (ci, (region, loc)) in t.chunks.iter().enumerate() {
                let runs = overlap_runs(&want, region);
                if runs.is_empty() {
                    continue;
                }
                filled += runs.iter().map(|run| run.len).sum::<u64>();
                let v = &loc.tensor;
                if is_row_major(&v.size, &v.stride) {
                    let base = loc.data.start + v.storage_offset * isz;
                    // One vectored read per chunk: the runs are disjoint parts of `buf`.
                    let mut parts: Vec<(u64, &mut [u8])> = Vec::with_capacity(runs.len());
                    let mut rest: &mut [u8] = r.buf;
                    let mut at = 0u64;
                    for run in &runs {
                        let skip = ((run.a - at) * isz) as usize;
                        let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
                        let (part, tail) = tail.split_at_mut((run.len * isz) as usize);
                        parts.push((base + run.b * isz, part));
                        rest = tail;
                        at = run.a + run.len;
                    }
                    self.storage.read_into(&loc.file, &mut parts)?;
                } else {
                    let mut cache = self.gathered.lock().unwrap_or_else(|p| p.into_inner());
                    if cache.as_ref().is_none_or(|(at, _)| *at != (ti, ci)) {
                        *cache = None; // the previous one goes before the next is read
                        let mut whole = vec![0u8; loc.nbytes() as usize];
                        read_chunk(self.storage.as_ref(), loc, &mut whole)?;
                        *cache = Some(((ti, ci), whole));
                    }
                    let whole = &cache.as_ref().expect("filled above").1;
                    for run in &runs {
                        let (a, b, len) = ((run.a * isz) as usize, (run.b * isz) as usize, (run.len * isz) as usize);
                        r.buf[a..a + len].copy_from_slice(&whole[b..b + len]);
                    }
                }
            }
            if filled != n {
                return Err(ConvertError::TorchDist {
                    detail: format!(
                        "{}: the chunks cover {filled} of the {n} elements from {} on (run dckpt validate)",
                        r.key, r.flat_start
                    ),
                });
            }
        }
        Ok(())
    }
}
