//! Exact-once coverage of one tensor by its stored chunks, decided in a few words per
//! chunk for the layouts dckpt saves, so that validating a metadata file of millions of
//! chunks costs little more than decoding it.
//!
//! The general check (`dckpt_shard_spec::validate`) builds a sharded tensor per chunk and
//! several copies of its region on the way, hundreds of bytes per chunk: more than ten times
//! what a chunk takes in the file. Here the chunks are only indexed: flat ranges that tile a
//! box are folded into it, and the boxes must then be exactly the cells of the grid their
//! own boundaries induce. Every layout of tensor and pipeline splits is such a grid, and a
//! distributed optimizer's flat ranges tile the boxes they narrow. Anything else is left
//! to the general check.

use std::cmp::Ordering;

use dckpt_shard_spec::{Region, checked_numel};

use crate::meta::ChunkMeta;

/// What [`grid_cover`] decided.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Cover {
    /// The chunks hold every element exactly once.
    Exact,
    /// They do not; what is wrong, naming chunks by index.
    Wrong(String),
    /// Not a grid of boxes and folded ranges: the general check decides.
    Undecided,
}

/// Whether `chunks` cover a tensor of shape `global` exactly once. Every chunk's region
/// was checked to fit `global` ([`Region::check`]), so no count below overflows.
pub(crate) fn grid_cover(global: &[u64], chunks: &[ChunkMeta]) -> Cover {
    let Some(total) = checked_numel(global) else { return Cover::Undecided };
    let idx = match distinct_boxes(chunks) {
        Ok(idx) => idx,
        Err(cover) => return cover,
    };
    let bounds = grid_bounds(global, chunks, &idx);
    if !boxes_are_cells(chunks, &idx, &bounds) {
        return Cover::Undecided;
    }
    // Distinct boxes are distinct cells, so they cover the tensor exactly once when there
    // are as many as there are cells.
    let cells = bounds.iter().try_fold(1u64, |n, b| n.checked_mul(b.len() as u64 - 1));
    if cells == Some(idx.len() as u64) {
        return Cover::Exact;
    }
    let Some(cells) = cells else { return Cover::Undecided };
    missing_cell(total, chunks, &idx, &bounds, cells)
}

/// The elements of a chunk's box.
fn box_numel(c: &ChunkMeta) -> u64 {
    c.shape.iter().product::<u64>()
}

/// The flat range of its box a chunk holds: the whole box when it has none.
fn range(c: &ChunkMeta) -> (u64, u64) {
    c.flat.map_or((0, box_numel(c)), |[a, b]| (a, b))
}

/// The chunks that hold elements, one index per distinct box, each box's flat ranges folded
/// into it; `Err` with the answer when the ranges overlap (wrong) or do not tile their box
/// (undecided).
fn distinct_boxes(chunks: &[ChunkMeta]) -> Result<Vec<u32>, Cover> {
    // Chunks without elements hold nothing to cover.
    let mut idx: Vec<u32> = (0..chunks.len() as u32)
        .filter(|&i| {
            let (a, b) = range(&chunks[i as usize]);
            b > a
        })
        .collect();
    let by_box = |a: &ChunkMeta, b: &ChunkMeta| a.offset.cmp(&b.offset).then_with(|| a.shape.cmp(&b.shape));
    idx.sort_unstable_by(|&a, &b| {
        let (ca, cb) = (&chunks[a as usize], &chunks[b as usize]);
        by_box(ca, cb).then_with(|| range(ca).cmp(&range(cb)))
    });
    // Fold each box's chunks into the box, in place: one index per distinct box remains.
    let (mut kept, mut i) = (0, 0);
    while i < idx.len() {
        let first = &chunks[idx[i] as usize];
        let mut end = 0;
        let mut j = i;
        while j < idx.len() && by_box(first, &chunks[idx[j] as usize]) == Ordering::Equal {
            let (a, b) = range(&chunks[idx[j] as usize]);
            if a < end {
                return Err(Cover::Wrong(format!(
                    "chunks[{}] and chunks[{}] hold the same elements of box {}",
                    idx[j - 1],
                    idx[j],
                    box_of(first)
                )));
            }
            if a > end {
                return Err(Cover::Undecided);
            }
            end = b;
            j += 1;
        }
        if end != box_numel(first) {
            return Err(Cover::Undecided);
        }
        idx[kept] = idx[i];
        kept += 1;
        i = j;
    }
    idx.truncate(kept);
    Ok(idx)
}

/// The grid the boxes' boundaries induce, with the tensor's own bounds: per dimension, the
/// sorted distinct boundaries.
fn grid_bounds(global: &[u64], chunks: &[ChunkMeta], idx: &[u32]) -> Vec<Vec<u64>> {
    (0..global.len())
        .map(|d| {
            let mut b = Vec::with_capacity(2 * idx.len() + 2);
            b.extend([0, global[d]]);
            for &k in idx {
                let c = &chunks[k as usize];
                b.extend([c.offset[d], c.offset[d] + c.shape[d]]);
            }
            b.sort_unstable();
            b.dedup();
            b.shrink_to_fit();
            b
        })
        .collect()
}

/// Whether each box is one cell of the grid.
fn boxes_are_cells(chunks: &[ChunkMeta], idx: &[u32], bounds: &[Vec<u64>]) -> bool {
    idx.iter().all(|&k| {
        let c = &chunks[k as usize];
        bounds.iter().enumerate().all(|(d, b)| {
            let lo = b.partition_point(|&x| x < c.offset[d]);
            b.get(lo + 1) == Some(&(c.offset[d] + c.shape[d]))
        })
    })
}

/// Fewer boxes than the grid's `cells`: names the first cell none of them is.
fn missing_cell(total: u64, chunks: &[ChunkMeta], idx: &[u32], bounds: &[Vec<u64>], cells: u64) -> Cover {
    let cell = |c: &ChunkMeta| {
        bounds
            .iter()
            .enumerate()
            .fold(0u64, |id, (d, b)| id * (b.len() as u64 - 1) + b.partition_point(|&x| x < c.offset[d]) as u64)
    };
    let mut ids: Vec<u64> = idx.iter().map(|&k| cell(&chunks[k as usize])).collect();
    ids.sort_unstable();
    let missing = ids.iter().enumerate().find(|&(i, &id)| id != i as u64).map_or(ids.len() as u64, |(i, _)| i as u64);
    if missing >= cells {
        return Cover::Undecided;
    }
    let (mut rest, mut offset, mut shape) = (missing, vec![0; bounds.len()], vec![0; bounds.len()]);
    for (d, b) in bounds.iter().enumerate().rev() {
        let n = b.len() as u64 - 1;
        let c = (rest % n) as usize;
        rest /= n;
        offset[d] = b[c];
        shape[d] = b[c + 1] - b[c];
    }
    let covered: u64 = idx.iter().map(|&k| box_numel(&chunks[k as usize])).sum();
    Cover::Wrong(format!(
        "the chunks hold {covered} of its {total} elements; none holds region {}",
        Region::boxed(offset, shape)
    ))
}

fn box_of(c: &ChunkMeta) -> Region {
    Region::boxed(c.offset.clone(), c.shape.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(offset: &[u64], shape: &[u64], flat: Option<[u64; 2]>) -> ChunkMeta {
        ChunkMeta { offset: offset.into(), shape: shape.into(), flat, file: 0, at: 0, crc32: vec![] }
    }

    #[test]
    fn grids_and_folded_ranges_are_exact() {
        let grid: Vec<ChunkMeta> =
            (0..3).flat_map(|i| (0..2).map(move |j| chunk(&[i * 2, j * 5], &[2, 5], None))).collect();
        assert_eq!(grid_cover(&[6, 10], &grid), Cover::Exact);
        // Uneven cells, in any order, and empty chunks anywhere.
        let uneven = vec![
            chunk(&[3, 0], &[3, 10], None),
            chunk(&[0, 0], &[3, 4], None),
            chunk(&[0, 4], &[3, 6], None),
            chunk(&[1, 1], &[0, 3], None),
        ];
        assert_eq!(grid_cover(&[6, 10], &uneven), Cover::Undecided, "the row of 3x10 spans two cells");
        let uneven = vec![chunk(&[3, 0], &[3, 4], None), chunk(&[0, 0], &[3, 4], None), chunk(&[0, 4], &[6, 6], None)];
        assert_eq!(grid_cover(&[6, 10], &uneven), Cover::Undecided);
        let flats = vec![
            chunk(&[0, 0], &[2, 5], Some([4, 10])),
            chunk(&[0, 0], &[2, 5], Some([0, 4])),
            chunk(&[0, 0], &[2, 5], Some([4, 4])),
            chunk(&[2, 0], &[2, 5], None),
        ];
        assert_eq!(grid_cover(&[4, 5], &flats), Cover::Exact);
        assert_eq!(grid_cover(&[], &[chunk(&[], &[], None)]), Cover::Exact, "a scalar");
        assert_eq!(grid_cover(&[0, 3], &[chunk(&[0, 0], &[0, 3], None)]), Cover::Exact, "nothing to cover");
    }

    #[test]
    fn overlaps_and_gaps_are_named() {
        let twice = vec![chunk(&[0, 0], &[2, 5], None), chunk(&[2, 0], &[2, 5], None), chunk(&[0, 0], &[2, 5], None)];
        let Cover::Wrong(why) = grid_cover(&[4, 5], &twice) else { panic!() };
        assert!(why.contains("chunks[0] and chunks[2]") || why.contains("chunks[2] and chunks[0]"), "{why}");
        let ranges = vec![chunk(&[0, 0], &[1, 5], Some([0, 3])), chunk(&[0, 0], &[1, 5], Some([2, 5]))];
        assert!(matches!(grid_cover(&[1, 5], &ranges), Cover::Wrong(_)));
        let gap = vec![chunk(&[0, 0], &[2, 5], None), chunk(&[4, 0], &[2, 5], None)];
        let Cover::Wrong(why) = grid_cover(&[6, 5], &gap) else { panic!() };
        assert!(why.contains("20 of its 30") && why.contains("[2:4, 0:5]"), "{why}");
        // A range missing from a box may be held by another box: not decided here.
        let part = vec![chunk(&[0, 0], &[2, 5], Some([0, 9]))];
        assert_eq!(grid_cover(&[2, 5], &part), Cover::Undecided);
        assert_eq!(
            grid_cover(&[2, 5], &[]),
            Cover::Wrong("the chunks hold 0 of its 10 elements; none holds region [0:2, 0:5]".into())
        );
    }
}
