//! Stage 3: each request intersected with the stored chunks, as copies.

use dckpt_shard_spec::cast::can_cast;
use dckpt_shard_spec::{DType, Dims, Region, for_each_overlap_run, for_each_overlap_strided, overlap_numel};

use super::coordinator::{Asks, TensorAsk};
use super::index::ChunkIndex;
use super::keys::*;
use super::*;
use crate::format::Metadata;
use crate::plan::FxMap;
use crate::shared_check::{self, ChunkKey, Offer};
use crate::{Error, ErrorKind, Result};

/// A stored chunk or object: where its bytes are and their block checksums.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stored<'m> {
    /// The tensor chunk it is, `None` for an object.
    pub(super) chunk: Option<ChunkKey>,
    pub(super) file: u32,
    pub(super) at: u64,
    pub(super) len: u64,
    pub(super) crc32: &'m [u8],
}

/// One transfer: `len` bytes from offset `src` of a stored piece to offset `dest_at` of
/// destination buffer `dest`, repeated for `rows` rows, each `src_step` further in the piece
/// and `dest_step` further in the destination. A column split copies part of every row of
/// a chunk: one copy, not one per row.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(super) struct PieceCopy {
    pub(super) piece: usize,
    pub(super) src: u64,
    pub(super) len: u64,
    pub(super) dest: usize,
    pub(super) dest_at: u64,
    pub(super) rows: u64,
    pub(super) src_step: u64,
    pub(super) dest_step: u64,
    /// Verified with the other ranks' parts of the same blocks (see `shared_check`).
    pub(super) shared: bool,
}

impl PieceCopy {
    /// One row, `len` bytes from `src` to `dest_at`.
    pub(super) fn one(piece: usize, src: u64, len: u64, dest: usize, dest_at: u64) -> PieceCopy {
        PieceCopy { piece, src, len, dest, dest_at, rows: 1, src_step: 0, dest_step: 0, shared: false }
    }

    /// Row `k` as a copy of its own.
    pub(super) fn row(&self, k: u64) -> PieceCopy {
        PieceCopy { src: self.src + k * self.src_step, dest_at: self.dest_at + k * self.dest_step, rows: 1, ..*self }
    }

    pub(super) fn each_row(&self) -> impl Iterator<Item = PieceCopy> + '_ {
        (0..self.rows).map(|k| self.row(k))
    }

    /// Where the last row ends in the destination.
    pub(super) fn dest_end(&self) -> u64 {
        self.dest_at + (self.rows - 1) * self.dest_step + self.len
    }

    /// Takes `next`'s rows as further rows when they continue the pattern: same piece,
    /// destination and length, after the last row in both, at the same distances (between
    /// the two copies, and within each that has several rows).
    pub(super) fn extend(&mut self, next: &PieceCopy) -> bool {
        if (next.piece, next.dest, next.len, next.shared) != (self.piece, self.dest, self.len, self.shared) {
            return false;
        }
        let (last_src, last_dest) = (self.src + (self.rows - 1) * self.src_step, self.dest_end() - self.len);
        if next.src < last_src + self.len || next.dest_at < last_dest + self.len {
            return false;
        }
        let steps = (next.src - last_src, next.dest_at - last_dest);
        let agree = |rows: u64, s: (u64, u64)| rows == 1 || s == steps;
        if !agree(self.rows, (self.src_step, self.dest_step)) || !agree(next.rows, (next.src_step, next.dest_step)) {
            return false;
        }
        (self.src_step, self.dest_step) = steps;
        self.rows += next.rows;
        true
    }
}

/// What one rank reads: the stored pieces and the transfers from them.
pub(super) struct ReadPlan<'m> {
    pub(super) pieces: Vec<Stored<'m>>,
    pub(super) copies: Vec<PieceCopy>,
    /// The requests whose stored global shape differs, with that shape: what lies outside
    /// it is zero-filled.
    pub(super) zero_fill: Vec<(u32, Dims)>,
    /// The requests that are cast from another stored dtype, with that dtype: read into a
    /// buffer of it, then cast into theirs.
    pub(super) casts: Vec<(u32, DType)>,
}

/// The chunks this rank reads in part (some block not whole), with the regions of them it
/// needs; a chunk whose part is not a union of regions ([`shared_check::region_overlap`])
/// is left out and read the usual way. Where the store reads in place (`in_place`), a
/// chunk this rank reads in rows (a column split) is left out too: the rank picks its rows
/// out of whole blocks it checks itself, which streams where its rows alone would stall
/// (`picked`).
pub(super) fn offers(meta: &Metadata, plan: &ReadPlan<'_>, asks: &Asks<'_>, in_place: bool) -> Vec<Offer> {
    let block = meta.block_bytes;
    let mut partial = vec![false; plan.pieces.len()];
    let mut in_rows = vec![false; plan.pieces.len()];
    for c in &plan.copies {
        let len = plan.pieces[c.piece].len;
        in_rows[c.piece] |= in_place && c.rows > 1;
        partial[c.piece] |= c.each_row().any(|r| {
            let (lo, hi) = whole_blocks(&r, len, block);
            lo > r.src || hi < r.src + r.len
        });
    }
    for (p, rows) in partial.iter_mut().zip(in_rows) {
        *p &= !rows;
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
            same.iter().map(|&(_, d)| shared_check::region_overlap(&chunk, &asks.tensors[d].tensor.region)).collect();
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
pub(super) fn whole_blocks(c: &PieceCopy, piece_len: u64, block: u64) -> (u64, u64) {
    debug_assert_eq!(c.rows, 1, "one row at a time");
    let end = c.src + c.len;
    let lo = c.src.div_ceil(block) * block;
    let hi = if end == piece_len { end } else { end / block * block };
    (lo, hi)
}

/// What finds the stored pieces a request meets, per stored tensor and object, each built
/// when a request first needs it and kept for the other ranks' requests.
pub(super) struct Indexes {
    tensors: Vec<Option<ChunkIndex>>,
    /// An object's entries by grid position: per-rank objects (a grid of the world, each
    /// rank asking for its own) cost the square of the world searched one by one.
    objects: Vec<Option<Vec<u32>>>,
}

impl Indexes {
    pub(super) fn new(meta: &Metadata) -> Indexes {
        Indexes {
            tensors: (0..meta.tensors.len()).map(|_| None).collect(),
            objects: (0..meta.objects.len()).map(|_| None).collect(),
        }
    }
}

/// Intersects one rank's requests with the stored chunks and objects.
pub(super) fn plan_reads<'m>(
    meta: &'m Metadata,
    indexes: &mut Indexes,
    found: &Found,
    asks: &Asks<'_>,
) -> Result<ReadPlan<'m>> {
    let mut plan = ReadPlan {
        pieces: Vec::with_capacity(asks.tensors.len()),
        copies: Vec::new(),
        zero_fill: Vec::new(),
        casts: Vec::new(),
    };
    let mut piece_of: FxMap<(usize, usize), usize> = FxMap::default();
    piece_of.reserve(asks.tensors.len());
    plan.copies.reserve(asks.tensors.len());
    // One region and one candidate list, refilled for each chunk (not allocated for each).
    let mut region = Region { offset: Dims::new(), shape: Dims::new(), flat: None };
    let mut candidates = Vec::new();
    for ((ri, r), &ti) in asks.tensors.iter().enumerate().zip(&found.tensors) {
        let Some(ti) = ti else { continue };
        let stored = &meta.tensors[ti];
        let esz = check_ask(r, stored.dtype, &stored.global_shape)?;
        if stored.global_shape != r.tensor.global_shape {
            plan.zero_fill.push((ri as u32, stored.global_shape.clone()));
        }
        if stored.dtype != r.tensor.dtype {
            plan.casts.push((ri as u32, stored.dtype));
        }
        let want: &Region = &r.tensor.region;
        ChunkIndex::candidates_of(&mut indexes.tensors[ti], stored, want, &mut candidates);
        let mut copied = 0u64;
        for &ci in &candidates {
            let (ci, c) = (ci as usize, &stored.chunks[ci as usize]);
            c.region_into(&mut region);
            let mut piece = None;
            // A column split's rows come as one group: constant work per chunk, not per row.
            for_each_overlap_strided(&region, want, |g| {
                let piece = *piece.get_or_insert_with(|| {
                    *piece_of.entry((ti, ci)).or_insert_with(|| {
                        let chunk = Some((ti as u32, ci as u32));
                        let len = region.numel() * esz;
                        plan.pieces.push(Stored { chunk, file: c.file, at: c.at, len, crc32: &c.crc32 });
                        plan.pieces.len() - 1
                    })
                });
                let run = g.first;
                copied = copied.saturating_add(g.count.saturating_mul(run.len));
                let rows = PieceCopy {
                    rows: g.count,
                    src_step: g.step_a * esz,
                    dest_step: g.step_b * esz,
                    ..PieceCopy::one(piece, run.a * esz, run.len * esz, ri, run.b * esz)
                };
                if !plan.copies.last_mut().is_some_and(|c: &mut PieceCopy| c.extend(&rows)) {
                    plan.copies.push(rows);
                }
            });
        }
        // Every element of the request inside the stored tensor is copied once (the rest is
        // zero-filled): a plan that fills less would leave bytes as they were, silently.
        let inside = overlap_numel(&Region::full(&stored.global_shape), want);
        if copied != inside {
            return Err(Error::internal(format!(
                "the load plan copies {copied} of the {inside} stored elements of {:?} region {want}",
                r.tensor.key
            )));
        }
    }
    plan_objects(meta, &mut indexes.objects, found, asks, &mut plan)?;
    Ok(plan)
}

/// The objects asked for, each a piece of its own, after the tensors in destination order.
fn plan_objects<'m>(
    meta: &'m Metadata,
    indexes: &mut [Option<Vec<u32>>],
    found: &Found,
    asks: &Asks<'_>,
    plan: &mut ReadPlan<'m>,
) -> Result<()> {
    let first_object = asks.tensors.len();
    for ((oi, o), &mi) in asks.objects.iter().enumerate().zip(&found.objects) {
        let Some(mi) = mi else { continue };
        let stored = &meta.objects[mi];
        let bad = |detail: String| Error::from(ErrorKind::Request { key: o.key.to_string(), detail });
        if stored.grid_shape != o.grid_shape {
            // The same key in another grid is another set of objects (another layout's rng
            // states): a position in it names a different one.
            return Err(bad(format!(
                "stored in a grid of {:?}, requested in a grid of {:?}",
                stored.grid_shape, o.grid_shape
            )));
        }
        let by_offset = indexes[mi].get_or_insert_with(|| {
            let mut order: Vec<u32> = (0..stored.entries.len() as u32).collect();
            order.sort_unstable_by(|&a, &b| {
                stored.entries[a as usize].grid_offset.cmp(&stored.entries[b as usize].grid_offset)
            });
            order
        });
        let at = by_offset.binary_search_by(|&e| stored.entries[e as usize].grid_offset.as_slice().cmp(&o.grid_offset));
        let Some(e) = at.ok().map(|i| &stored.entries[by_offset[i] as usize]) else {
            return Err(bad(format!("no stored object at grid position {:?}", o.grid_offset)));
        };
        plan.pieces.push(Stored { chunk: None, file: e.file, at: e.at, len: e.len, crc32: &e.crc32 });
        plan.copies.push(PieceCopy::one(plan.pieces.len() - 1, 0, e.len, first_object + oi, 0));
    }
    Ok(())
}

/// Checks a request against what is stored (on the coordinator, from the rank's asks).
/// Returns the stored element size, the unit of the plan's copies (a request cast from
/// another dtype is read into a buffer of the stored one).
pub(super) fn check_ask(r: &TensorAsk<'_>, dtype: DType, global_shape: &[u64]) -> Result<u64> {
    let key = &r.tensor.key;
    let bad = |detail: String| Error::from(ErrorKind::Request { key: key.to_string(), detail });
    let wanted = r.tensor.dtype;
    if dtype != wanted && !(r.allow_dtype_cast && can_cast(dtype, wanted)) {
        let how = match can_cast(dtype, wanted) {
            true => "; allow a dtype cast to load it cast",
            false => "",
        };
        return Err(bad(format!("stored as {dtype}, requested as {wanted}{how}")));
    }
    let shapes_differ = global_shape != r.tensor.global_shape.as_slice();
    if global_shape.len() != r.tensor.global_shape.len() {
        // Nothing of a box of other dimensions overlaps: all of it would be zero-filled.
        return Err(bad(format!(
            "stored global shape {global_shape:?}, requested {:?}: the number of dimensions differs",
            r.tensor.global_shape
        )));
    }
    if shapes_differ && !r.allow_shape_mismatch {
        return Err(bad(format!(
            "stored global shape {global_shape:?}, requested {:?}; allow a shape mismatch to load the overlap",
            r.tensor.global_shape
        )));
    }
    r.tensor.region.check(&r.tensor.global_shape).map_err(|e| bad(format!("region {}: {e}", r.tensor.region)))?;
    // Checked: a region of 2^62 four-byte elements would otherwise need a buffer of 0 bytes.
    let bytes_of = |d: DType| {
        r.tensor
            .region
            .numel()
            .checked_mul(d.size())
            .ok_or_else(|| bad(format!("region {} of {d} holds more than 2^64 bytes", r.tensor.region)))
    };
    bytes_of(dtype)?;
    let need = bytes_of(wanted)?;
    if r.buffer_bytes != need {
        return Err(bad(format!("buffer has {} bytes, region {} needs {need}", r.buffer_bytes, r.tensor.region)));
    }
    Ok(dtype.size())
}

/// Zeroes what of a request's buffer lies outside the stored tensor (a larger padded
/// vocabulary); the rest is about to be overwritten.
pub(super) fn zero_outside(r: &mut TensorRequest<'_>, stored_shape: &[u64]) {
    let esz = r.tensor.dtype.size();
    let (mut filled, data) = (0u64, &mut *r.data);
    for_each_overlap_run(&Region::full(stored_shape), &r.tensor.region, |run| {
        data[(filled * esz) as usize..(run.b * esz) as usize].fill(0);
        filled = run.b + run.len;
    });
    data[(filled * esz) as usize..].fill(0);
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use dckpt_shard_spec::{DType, ReplicaId, ShardedTensor};

    use super::*;
    use crate::format::{ChunkMeta, TensorMeta};

    fn chunk(offset: u64, len: u64, at: u64) -> ChunkMeta {
        ChunkMeta { offset: Dims::from([offset]), shape: Dims::from([len]), flat: None, file: 0, at, crc32: vec![0; 4] }
    }

    fn ask(key: &str, offset: u64, len: u64) -> TensorAsk<'static> {
        let tensor = ShardedTensor {
            key: key.into(),
            dtype: DType::U8,
            global_shape: Dims::from([8]),
            region: Region { offset: Dims::from([offset]), shape: Dims::from([len]), flat: None },
            replica_id: ReplicaId::MAIN,
        };
        TensorAsk {
            tensor: Cow::Owned(tensor),
            allow_shape_mismatch: false,
            allow_dtype_cast: false,
            buffer_bytes: len,
        }
    }

    /// A region whose bytes overflow 64 bits is refused by name; before, 2^62 four-byte
    /// elements wrapped to a need of 0 bytes and an empty buffer was accepted.
    #[test]
    fn an_ask_of_more_than_2_64_bytes_is_a_request_error() {
        let mut huge = ask("w", 0, 1);
        let t = huge.tensor.to_mut();
        (t.dtype, t.global_shape, t.region) = (DType::F32, Dims::from([1 << 62]), Region::full(&[1 << 62]));
        (huge.allow_shape_mismatch, huge.buffer_bytes) = (true, 0);
        let err = check_ask(&huge, DType::F32, &[8]).unwrap_err();
        assert!(err.to_string().contains("more than 2^64 bytes") && err.to_string().contains("\"w\""), "{err}");
    }

    /// A shape mismatch is allowed within the same dimensions only: a box of others meets
    /// nothing stored, and the whole buffer was zero-filled without a word.
    #[test]
    fn a_shape_mismatch_of_other_dimensions_is_a_request_error() {
        let mut flat = ask("w", 0, 8);
        flat.allow_shape_mismatch = true;
        let err = check_ask(&flat, DType::U8, &[2, 4]).unwrap_err();
        assert!(err.to_string().contains("number of dimensions differs") && err.to_string().contains("\"w\""), "{err}");
    }

    /// Chunks that leave part of a request uncovered (metadata that skipped validation, or a
    /// planner's mistake) fail the plan rather than leave those bytes as they were.
    #[test]
    fn a_plan_that_fills_less_than_the_request_fails() {
        let tensor = TensorMeta {
            key: "w".into(),
            dtype: DType::U8,
            global_shape: Dims::from([8]),
            chunks: vec![chunk(0, 4, 0)],
        };
        let meta = super::super::bare_metadata(4, vec![tensor]);
        let asks =
            Asks { tensors: vec![ask("w", 2, 6)], objects: Vec::new(), failed: None, strictness: Default::default() };
        let found = Found::new(&meta, &asks);
        let err = plan_reads(&meta, &mut Indexes::new(&meta), &found, &asks).err().expect("a hole in the plan");
        assert!(err.to_string().contains("copies 2 of the 6 stored elements of \"w\""), "{err}");
    }

    /// Objects are found by their grid position in any stored order, and only in the grid
    /// they were stored in: the same key in another grid (another layout's per-rank states)
    /// is refused by name, where a position in it was taken for the stored one.
    #[test]
    fn objects_are_found_by_position_in_the_grid_they_were_stored_in() {
        use crate::format::{ObjectEntry, ObjectMeta};
        use dckpt_shard_spec::ShardedObject;
        let entry = |i: u64| ObjectEntry { grid_offset: vec![i], file: 0, at: 10 * i, len: 1, crc32: vec![0; 4] };
        let mut meta = super::super::bare_metadata(4, Vec::new());
        meta.objects =
            vec![ObjectMeta { key: "rng".into(), grid_shape: vec![4], entries: (0..4).rev().map(entry).collect() }];
        let asks = |grid: u64| Asks {
            tensors: Vec::new(),
            objects: (0..grid.min(4)).map(|i| ShardedObject::in_grid("rng", vec![grid], vec![i])).collect(),
            failed: None,
            strictness: Default::default(),
        };
        let (a, mut indexes) = (asks(4), Indexes::new(&meta));
        let plan = plan_reads(&meta, &mut indexes, &Found::new(&meta, &a), &a).unwrap();
        assert_eq!(plan.pieces.iter().map(|p| p.at).collect::<Vec<_>>(), [0, 10, 20, 30]);
        let a = asks(8);
        let err = plan_reads(&meta, &mut indexes, &Found::new(&meta, &a), &a).err().expect("another grid");
        assert!(err.to_string().contains("stored in a grid of [4], requested in a grid of [8]"), "{err}");
    }

    #[test]
    fn asks_of_one_tensor_share_the_pieces_they_meet_in_any_order() {
        let tensor =
            |key: &str, chunks| TensorMeta { key: key.into(), dtype: DType::U8, global_shape: Dims::from([8]), chunks };
        let meta = super::super::bare_metadata(
            4,
            vec![tensor("v", vec![chunk(0, 4, 0), chunk(4, 4, 4)]), tensor("w", vec![chunk(0, 8, 8)])],
        );
        // "w" is one chunk that two asks each take half of; "v" is asked once, between them.
        for tensors in
            [vec![ask("w", 0, 4), ask("v", 0, 8), ask("w", 4, 4)], vec![ask("w", 4, 4), ask("w", 0, 4), ask("v", 0, 8)]]
        {
            let asks = Asks { tensors, objects: Vec::new(), failed: None, strictness: Default::default() };
            let found = Found::new(&meta, &asks);
            let plan = plan_reads(&meta, &mut Indexes::new(&meta), &found, &asks).unwrap();
            let mut read: Vec<(u64, u64)> = plan.pieces.iter().map(|p| (p.at, p.len)).collect();
            read.sort_unstable();
            assert_eq!(read, [(0, 4), (4, 4), (8, 8)], "each stored chunk is one piece");
            let w = plan.pieces.iter().position(|p| p.at == 8).unwrap();
            let mut from_w: Vec<(usize, u64)> =
                plan.copies.iter().filter(|c| c.piece == w).map(|c| (c.dest, c.src)).collect();
            from_w.sort_unstable();
            let w_asks: Vec<usize> = (0..3).filter(|&d| asks.tensors[d].tensor.key.as_str() == "w").collect();
            let srcs: Vec<u64> = w_asks.iter().map(|&d| asks.tensors[d].tensor.region.offset[0]).collect();
            assert_eq!(from_w, w_asks.into_iter().zip(srcs).collect::<Vec<_>>());
        }
    }
}
