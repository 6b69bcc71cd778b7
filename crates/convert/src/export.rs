//! `dckpt export`: a checkpoint consolidated into whole tensors in the Hugging Face
//! safetensors layout, streamed in bounded memory.
//!
//! Output: one `model.safetensors` when every tensor fits in one shard, else
//! `model-0000i-of-0000N.safetensors` and `model.safetensors.index.json`
//! (`{"metadata": {"total_size": N}, "weight_map": {key: file}}`), tensors sorted by key
//! and packed into shards in that order the way `transformers` packs them (a new shard when
//! the next tensor would pass the size; a tensor larger than the size gets one of its own).
//!
//! Memory: each tensor is read in row-major order in slabs (whole rows where one fits, a
//! flat range of the tensor where a row does not), two slabs of at most half the budget
//! (and at most [`SLAB_BYTES_MAX`]) in hand at a time, one read while the other is written,
//! whatever the size of a tensor.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use dckpt::storage::{PipeOptions, Storage, write_pipelined};
use dckpt_format::{SafetensorsEntry, safetensors_header};
use dckpt_shard_spec::DType;
use serde::Serialize;

use crate::cast::{cast_into, is_cast_target, output_dtype};
use crate::source::{RangeRead, SourceTensor, TensorSource};
use crate::{ConvertError, KeyFilter, Result};

/// The index file written beside sharded output.
pub const INDEX_NAME: &str = "model.safetensors.index.json";
/// The one file of unsharded output.
pub const SINGLE_NAME: &str = "model.safetensors";
/// Default `--max-shard-size`: 5 GB, `transformers`' default.
pub const MAX_SHARD_SIZE_DEFAULT: u64 = 5_000_000_000;
/// Default `--buffer-size`: 256 MiB.
pub const BUFFER_SIZE_DEFAULT: u64 = 256 << 20;
/// The largest slab, whatever the budget: smaller slabs keep reading and writing
/// overlapped (one slab read while the previous one is written), and every slab is one load
/// through the engine, whose fixed cost this amortizes well past.
pub const SLAB_BYTES_MAX: u64 = 32 << 20;
/// The smallest budget: two slabs, each holding an element of any dtype and its cast.
pub const BUFFER_SIZE_MIN: u64 = 64;

/// How to export.
#[derive(Clone, Debug)]
pub struct ExportOptions {
    /// Cast floating tensors (f32, bf16, f16, f64) to this (f32, bf16 or f16); others stay.
    pub dtype: Option<DType>,
    /// The largest shard (tensor bytes), except a tensor larger than it.
    pub max_shard_size: u64,
    /// Which tensor keys to export.
    pub filter: KeyFilter,
    /// Bytes of tensor data held at once (both slabs, cast buffers included).
    pub buffer_size: u64,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            dtype: None,
            max_shard_size: MAX_SHARD_SIZE_DEFAULT,
            filter: KeyFilter::default(),
            buffer_size: BUFFER_SIZE_DEFAULT,
        }
    }
}

/// One output file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExportedFile {
    /// Its name in the output directory.
    pub name: String,
    /// Tensors in it.
    pub tensors: usize,
    /// Its size, header included.
    pub bytes: u64,
}

/// What an export wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ExportReport {
    /// The safetensors files, in order.
    pub files: Vec<ExportedFile>,
    /// The index file, when the output is sharded.
    pub index: Option<String>,
    /// Tensors exported.
    pub tensors: usize,
    /// Of those, tensors cast to another dtype.
    pub cast_tensors: usize,
    /// Bytes of tensor data written (the index's `total_size`).
    pub total_size: u64,
    /// Tensors left out by `--include`/`--exclude`.
    pub skipped_tensors: usize,
    /// Objects in the source: never exported (safetensors holds tensors only).
    pub skipped_objects: usize,
}

/// A tensor as it will be written.
#[derive(Clone, Debug)]
struct Planned {
    src: SourceTensor,
    out: DType,
}

impl Planned {
    fn out_bytes(&self) -> u64 {
        self.src.numel() * self.out.size()
    }
}

/// The shards: tensors sorted by key, packed in order.
fn pack(tensors: &[Planned], max: u64) -> Vec<std::ops::Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut size) = (0, 0u64);
    for (i, t) in tensors.iter().enumerate() {
        let n = t.out_bytes();
        if i > start && size.saturating_add(n) > max {
            shards.push(start..i);
            (start, size) = (i, 0);
        }
        size += n;
    }
    if start < tensors.len() {
        shards.push(start..tensors.len());
    }
    shards
}

/// The file name of shard `i` (from 0) of `n`.
pub fn shard_name(i: usize, n: usize) -> String {
    if n == 1 { SINGLE_NAME.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) }
}

/// Exports `source` into `out` (see the module docs). `progress` counts the tensor bytes
/// written. Refuses to write where a `model*.safetensors*` file already is. Each file
/// appears whole or not at all (the index last); on failure the files written are removed.
pub fn export(
    source: &dyn TensorSource,
    out: &dyn Storage,
    opts: &ExportOptions,
    progress: &AtomicU64,
) -> Result<ExportReport> {
    if let Some(d) = opts.dtype.filter(|d| !is_cast_target(*d)) {
        return Err(ConvertError::Options { detail: format!("--dtype {d}: exports cast to f32, bf16 or f16 only") });
    }
    if opts.max_shard_size == 0 {
        return Err(ConvertError::Options { detail: "--max-shard-size must be at least 1 byte".into() });
    }
    if opts.buffer_size < BUFFER_SIZE_MIN {
        return Err(ConvertError::Options {
            detail: format!("--buffer-size {}: at least {BUFFER_SIZE_MIN} bytes", opts.buffer_size),
        });
    }
    if let Some(o) = out.list("")?.into_iter().find(|o| o.path.starts_with("model") && o.path.contains(".safetensors"))
    {
        return Err(ConvertError::Exists { location: out.location(&o.path) });
    }
    let mut report = ExportReport { skipped_objects: source.objects().len(), ..ExportReport::default() };
    let mut tensors: Vec<Planned> = Vec::new();
    for t in source.tensors() {
        if opts.filter.keeps(&t.key) {
            tensors.push(Planned { src: t.clone(), out: output_dtype(t.dtype, opts.dtype) });
        } else {
            report.skipped_tensors += 1;
        }
    }
    if tensors.is_empty() {
        // Nothing written would look like a successful export of nothing (a filter's typo).
        let why = match source.tensors().len() {
            0 => "the checkpoint holds no tensors".to_string(),
            n => format!("--include/--exclude select none of its {n} tensors"),
        };
        return Err(ConvertError::Options { detail: format!("nothing to export: {why}") });
    }
    tensors.sort_by(|a, b| a.src.key.cmp(&b.src.key));
    let shards = pack(&tensors, opts.max_shard_size);
    let n = shards.len();
    let slab = (opts.buffer_size / 2).min(SLAB_BYTES_MAX);
    let mut weight_map = BTreeMap::new();
    for (i, range) in shards.iter().enumerate() {
        let name = shard_name(i, n);
        match write_shard(source, out, &name, &tensors[range.clone()], slab, progress) {
            Ok(bytes) => report.files.push(ExportedFile { name: name.clone(), tensors: range.len(), bytes }),
            Err(e) => {
                remove(out, &report.files);
                return Err(e);
            }
        }
        for t in &tensors[range.clone()] {
            weight_map.insert(t.src.key.clone(), name.clone());
        }
    }
    report.tensors = tensors.len();
    report.cast_tensors = tensors.iter().filter(|t| t.out != t.src.dtype).count();
    report.total_size = tensors.iter().map(Planned::out_bytes).sum();
    if n > 1 {
        let index = serde_json::json!({
            "metadata": { "total_size": report.total_size },
            "weight_map": weight_map,
        });
        let text = serde_json::to_vec_pretty(&index).expect("a JSON value");
        if let Err(e) = out.put(INDEX_NAME, Bytes::from(text)) {
            remove(out, &report.files);
            return Err(e.into());
        }
        report.index = Some(INDEX_NAME.to_string());
    }
    Ok(report)
}

fn remove(out: &dyn Storage, files: &[ExportedFile]) {
    for f in files {
        let _ = out.delete(&f.name);
    }
}

/// One slab: which elements of which tensors (of the shard) it holds, in file order.
struct Slab {
    pieces: Vec<(usize, u64, u64)>,
    cost: u64,
}

impl Slab {
    /// The bytes it is in the output.
    fn out_bytes(&self, tensors: &[Planned]) -> u64 {
        self.pieces.iter().map(|&(i, _, n)| n * tensors[i].out.size()).sum()
    }
}

/// Cuts a shard's tensors into slabs of at most `slab` bytes of cost (output bytes, plus
/// source bytes where a cast needs both): whole tensors, or runs of whole rows, or, where a
/// row alone is larger than a slab, flat ranges.
fn slabs(tensors: &[Planned], slab: u64) -> Vec<Slab> {
    let mut out = Vec::new();
    let mut cur = Slab { pieces: Vec::new(), cost: 0 };
    for (i, t) in tensors.iter().enumerate() {
        let cast = t.out != t.src.dtype;
        let c = t.out.size() + if cast { t.src.dtype.size() } else { 0 };
        let numel = t.src.numel();
        let row = match t.src.shape.first() {
            Some(&d) if d > 0 => numel / d,
            _ => numel.max(1),
        };
        let mut pos = 0;
        while pos < numel {
            let room = (slab - cur.cost) / c;
            let rest = numel - pos;
            let take = if rest <= room {
                rest
            } else if row.saturating_mul(c) <= slab {
                room / row * row
            } else {
                room
            };
            if take == 0 {
                out.push(std::mem::replace(&mut cur, Slab { pieces: Vec::new(), cost: 0 }));
                continue;
            }
            cur.pieces.push((i, pos, take));
            cur.cost += take * c;
            pos += take;
        }
    }
    if !cur.pieces.is_empty() {
        out.push(cur);
    }
    out
}

/// Writes one shard: its header, then every tensor streamed in slabs. Returns its size.
fn write_shard(
    source: &dyn TensorSource,
    out: &dyn Storage,
    name: &str,
    tensors: &[Planned],
    slab: u64,
    progress: &AtomicU64,
) -> Result<u64> {
    let entries: Vec<SafetensorsEntry> = tensors
        .iter()
        .map(|t| SafetensorsEntry {
            name: t.src.key.clone(),
            dtype: t.out,
            shape: t.src.shape.clone(),
            len: t.out_bytes(),
        })
        .collect();
    // `transformers` reads the format entry to know the tensors are PyTorch's.
    let header = safetensors_header(&entries, &BTreeMap::from([("format".to_string(), "pt".to_string())]));
    let total = header.len() as u64 + entries.iter().map(|e| e.len).sum::<u64>();
    let plan = slabs(tensors, slab);
    // Handed over at a rendezvous: the writer holds one slab while this thread fills the
    // other, never more.
    let options = PipeOptions { queue: 0, buffers: 2, buffer_bytes: slab as usize, inline_bytes: 0 };
    write_pipelined(out, name, total, options, |pipe| {
        pipe.write(&header)?;
        let mut scratch: Vec<u8> = Vec::new();
        for sl in &plan {
            let n = sl.out_bytes(tensors);
            pipe.fill(n as usize, |buf| fill(source, tensors, sl, buf, &mut scratch))?;
            progress.fetch_add(n, Ordering::Relaxed);
        }
        Ok(total)
    })
}

/// Reads a slab's pieces into `buf` (output bytes, back to back, [`Slab::out_bytes`] of
/// them), through `scratch` for the pieces that are cast.
fn fill(
    source: &dyn TensorSource,
    tensors: &[Planned],
    sl: &Slab,
    buf: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let src_len: u64 = sl
        .pieces
        .iter()
        .filter(|&&(i, _, _)| tensors[i].out != tensors[i].src.dtype)
        .map(|&(i, _, n)| n * tensors[i].src.dtype.size())
        .sum();
    // Every byte of both is overwritten below: a reused buffer of the right length is not
    // cleared first (a memset of every slab costs a tenth of the write; the pipe's buffers
    // are not cleared either).
    if scratch.len() != src_len as usize {
        scratch.resize(src_len as usize, 0);
    }
    // Uncast pieces are read straight into place, cast ones into the scratch buffer.
    let mut reads = Vec::with_capacity(sl.pieces.len());
    let (mut out_rest, mut src_rest) = (&mut buf[..], &mut scratch[..]);
    for &(i, start, n) in &sl.pieces {
        let t = &tensors[i];
        let (o, rest) = std::mem::take(&mut out_rest).split_at_mut((n * t.out.size()) as usize);
        out_rest = rest;
        if t.out == t.src.dtype {
            reads.push(RangeRead { key: &t.src.key, flat_start: start, buf: o });
        } else {
            let (s, rest) = std::mem::take(&mut src_rest).split_at_mut((n * t.src.dtype.size()) as usize);
            src_rest = rest;
            reads.push(RangeRead { key: &t.src.key, flat_start: start, buf: s });
        }
    }
    source.read_ranges(&mut reads)?;
    drop(reads);
    let (mut at_out, mut at_src) = (0usize, 0usize);
    for &(i, _, n) in &sl.pieces {
        let t = &tensors[i];
        let on = (n * t.out.size()) as usize;
        if t.out != t.src.dtype {
            let sn = (n * t.src.dtype.size()) as usize;
            cast_into(t.src.dtype, t.out, &scratch[at_src..at_src + sn], &mut buf[at_out..at_out + on]);
            at_src += sn;
        }
        at_out += on;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(key: &str, dtype: DType, shape: &[u64], out: DType) -> Planned {
        Planned { src: SourceTensor { key: key.into(), dtype, shape: shape.into() }, out }
    }

    #[test]
    fn shards_pack_in_order_and_a_large_tensor_gets_its_own() {
        let t = |k: &str, n: u64| planned(k, DType::U8, &[n], DType::U8);
        let ts = [t("a", 40), t("b", 40), t("c", 30), t("d", 150), t("e", 10)];
        assert_eq!(pack(&ts, 100), vec![0..2, 2..3, 3..4, 4..5]);
        assert_eq!(pack(&ts, 1000), vec![0..5]);
        assert_eq!(pack(&[], 10), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(shard_name(0, 1), "model.safetensors");
        assert_eq!(shard_name(1, 3), "model-00002-of-00003.safetensors");
    }

    #[test]
    fn slabs_stay_within_their_budget_whole_rows_first() {
        // 8 rows of 16 f32 (64 bytes a row) in slabs of 200 bytes: 3 rows at a time.
        let ts = [planned("w", DType::F32, &[8, 16], DType::F32)];
        let s = slabs(&ts, 200);
        let pieces: Vec<_> = s.iter().flat_map(|s| s.pieces.clone()).collect();
        assert_eq!(pieces, [(0, 0, 48), (0, 48, 48), (0, 96, 32)]);
        assert!(s.iter().all(|s| s.cost <= 200));
        // A row of 400 bytes in slabs of 100: flat ranges of 25 elements.
        let ts = [planned("r", DType::F32, &[2, 100], DType::F32)];
        let s = slabs(&ts, 100);
        assert_eq!(s.len(), 8);
        assert!(s.iter().all(|s| s.cost <= 100 && s.pieces.len() == 1 && s.pieces[0].2 == 25));
        // A cast costs both sides: f32 -> bf16 is 6 bytes an element.
        let ts = [planned("c", DType::F32, &[10], DType::Bf16)];
        assert_eq!(slabs(&ts, 30)[0].pieces, [(0, 0, 5)]);
        // Small tensors share a slab; empty ones take nothing.
        let ts = [
            planned("a", DType::U8, &[3], DType::U8),
            planned("e", DType::U8, &[0, 4], DType::U8),
            planned("s", DType::I64, &[], DType::I64),
        ];
        let s = slabs(&ts, 100);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].pieces, [(0, 0, 3), (2, 0, 1)]);
    }
}
