//! One tensor key: its pieces agree on dtype and shape, their regions fit, and the main
//! replicas cover it exactly once (boxes on the grid they induce or by a sweep, flat ranges
//! folded into their boxes or checked element-exactly).

use std::collections::HashMap;

use super::{Problems, TensorPiece};
use crate::Problem;
use crate::region::{FlatRange, Region, checked_numel, for_each_overlap_run, overlap_runs_bound};

/// Beyond this many grid cells per key, overlaps are found by a sweep instead.
const GRID_CELLS_MAX: u128 = 1 << 22;
/// Beyond this many pairs of boxes compared per key, the sweep gives up with an error.
const SWEEP_PAIRS_MAX: u64 = 1 << 27;
/// Beyond this many global intervals per key, the exact check gives up with an error.
const EXACT_INTERVALS_MAX: usize = 1 << 24;

/// A candidate for exact-once coverage: a region with the ranks that hold it as main.
#[derive(Clone, Debug)]
struct Main {
    region: Region,
    ranks: Vec<u32>,
}

/// Checks one key; on success returns (main pieces, bytes of the global tensor).
pub(super) fn check_tensor(key: &str, pieces: &[TensorPiece<'_>], problems: &mut Problems) -> Option<(usize, u64)> {
    let first = pieces[0];
    let (dtype, shape) = (first.tensor.dtype, &first.tensor.global_shape);
    for p in &pieces[1..] {
        if p.tensor.dtype != dtype {
            problems.push(Problem::DtypeMismatch {
                key: key.into(),
                rank_a: first.rank,
                dtype_a: dtype,
                rank_b: p.rank,
                dtype_b: p.tensor.dtype,
            });
            return None;
        }
        if &p.tensor.global_shape != shape {
            problems.push(Problem::ShapeMismatch {
                key: key.into(),
                rank_a: first.rank,
                shape_a: shape.clone(),
                rank_b: p.rank,
                shape_b: p.tensor.global_shape.clone(),
            });
            return None;
        }
    }
    let Some(total) = checked_numel(shape).filter(|n| n.checked_mul(dtype.size()).is_some()) else {
        problems.push(Problem::TooLarge { key: key.into(), shape: shape.clone(), dtype });
        return None;
    };
    let mut bad = false;
    for p in pieces {
        if let Err(reason) = p.tensor.region.check(shape) {
            bad = true;
            problems.push(Problem::BadRegion {
                key: key.into(),
                rank: p.rank,
                region: p.tensor.region.clone(),
                global_shape: shape.clone(),
                reason,
            });
        }
    }
    if bad {
        return None;
    }
    // One main piece holding every element covers the tensor exactly once (the common
    // case of a replicated or unsplit tensor); no grid to build.
    let mut with_elements = pieces.iter().filter(|p| p.tensor.is_main() && p.tensor.region.numel() > 0);
    if let (Some(only), None) = (with_elements.next(), with_elements.next())
        && only.tensor.region.numel() == total
    {
        return Some((1, total * dtype.size()));
    }
    let mains = unique_mains(key, pieces, problems)?;
    let count = mains.len();
    match find_overlap_or_gap(key, shape, total, mains) {
        Some(p) => {
            problems.push(p);
            None
        }
        None => Some((count, total * dtype.size())),
    }
}

/// Main pieces with identical regions merged; more than one main holder of one region is
/// a problem (the "every ETP rank claims to be main" failure). Pieces without elements
/// hold nothing to cover and are left out.
fn unique_mains(key: &str, pieces: &[TensorPiece<'_>], problems: &mut Problems) -> Option<Vec<Main>> {
    let mut mains: Vec<(&Region, u32)> = pieces
        .iter()
        .filter(|p| p.tensor.is_main() && p.tensor.region.numel() > 0)
        .map(|p| (&p.tensor.region, p.rank))
        .collect();
    mains.sort_unstable();
    let mut out: Vec<Main> = Vec::with_capacity(mains.len());
    let mut dup = false;
    for (region, rank) in mains {
        match out.last_mut() {
            Some(m) if &m.region == region => {
                m.ranks.push(rank);
                dup = true;
            }
            _ => out.push(Main { region: region.clone(), ranks: vec![rank] }),
        }
    }
    if dup {
        for m in out.iter().filter(|m| m.ranks.len() > 1) {
            problems.push(Problem::DuplicateMain { key: key.into(), region: m.region.clone(), ranks: m.ranks.clone() });
        }
        return None;
    }
    Some(out)
}

fn find_overlap_or_gap(key: &str, shape: &[u64], total: u64, mains: Vec<Main>) -> Option<Problem> {
    let covered: u128 = mains.iter().map(|m| m.region.numel() as u128).sum();
    let boxes = match fold_flat_ranges(key, &mains) {
        Folded::Boxes(b) => b,
        Folded::Overlap(p) => return Some(*p),
        Folded::Straddling => return exact_check(key, shape, total, &mains),
    };
    if let Some(p) = box_check(key, shape, total, &boxes, covered) {
        return Some(p);
    }
    (covered != total as u128).then(|| Problem::Gap {
        key: key.into(),
        covered: covered.min(u64::MAX as u128) as u64,
        total,
        missing: None,
    })
}

enum Folded {
    Boxes(Vec<Main>),
    Overlap(Box<Problem>),
    Straddling,
}

/// Replaces the flat pieces of each box by the box itself when they tile it exactly.
fn fold_flat_ranges(key: &str, mains: &[Main]) -> Folded {
    let mut boxes = Vec::new();
    let mut partial: HashMap<Region, Vec<(FlatRange, &Main)>> = HashMap::new();
    for m in mains {
        if m.region.is_whole_box() {
            boxes.push(Main { region: m.region.box_only(), ranks: m.ranks.clone() });
        } else {
            partial.entry(m.region.box_only()).or_default().push((m.region.flat_range(), m));
        }
    }
    let mut partial: Vec<_> = partial.into_iter().collect();
    partial.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let mut straddling = false;
    for (bx, mut ranges) in partial {
        ranges.sort_unstable_by_key(|(r, _)| (r.start, r.stop));
        let mut end = 0u64;
        let mut contiguous = true;
        for w in ranges.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            if b.0.start < a.0.stop && !b.0.is_empty() && !a.0.is_empty() {
                return Folded::Overlap(Box::new(overlap(key, a.1, b.1)));
            }
        }
        for (r, _) in ranges.iter().filter(|(r, _)| !r.is_empty()) {
            contiguous &= r.start == end;
            end = r.stop;
        }
        if contiguous && end == bx.box_numel() {
            let ranks = ranges.iter().flat_map(|(_, m)| m.ranks.iter().copied()).collect();
            boxes.push(Main { region: bx, ranks });
        } else {
            straddling = true;
        }
    }
    if straddling { Folded::Straddling } else { Folded::Boxes(boxes) }
}

fn overlap(key: &str, a: &Main, b: &Main) -> Problem {
    Problem::Overlap {
        key: key.into(),
        region_a: a.region.clone(),
        ranks_a: a.ranks.clone(),
        region_b: b.region.clone(),
        ranks_b: b.ranks.clone(),
    }
}

/// Exact-once check of plain boxes: on the grid induced by their boundaries when that grid
/// is small, else by a sweep along axis 0.
fn box_check(key: &str, shape: &[u64], total: u64, boxes: &[Main], covered: u128) -> Option<Problem> {
    if total == 0 {
        return None;
    }
    let bounds: Vec<Vec<u64>> = (0..shape.len())
        .map(|d| {
            let mut b: Vec<u64> = vec![0, shape[d]];
            for m in boxes {
                b.push(m.region.offset[d]);
                b.push(m.region.offset[d] + m.region.shape[d]);
            }
            b.sort_unstable();
            b.dedup();
            b
        })
        .collect();
    let cells: u128 = bounds.iter().map(|b| (b.len() - 1) as u128).product();
    if cells <= GRID_CELLS_MAX.max(8 * boxes.len() as u128) {
        grid_check(key, total, boxes, &bounds, covered)
    } else {
        sweep_check(key, boxes)
    }
}

fn grid_check(key: &str, total: u64, boxes: &[Main], bounds: &[Vec<u64>], covered: u128) -> Option<Problem> {
    let dims: Vec<usize> = bounds.iter().map(|b| b.len() - 1).collect();
    let mut cstride = vec![1usize; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        cstride[d] = cstride[d + 1] * dims[d + 1];
    }
    let ncells: usize = dims.iter().product();
    let mut owner = vec![0u32; ncells];
    for (i, m) in boxes.iter().enumerate() {
        if m.region.box_numel() == 0 {
            continue;
        }
        let ranges: Vec<(usize, usize)> = (0..dims.len())
            .map(|d| {
                let lo = bounds[d].partition_point(|&x| x < m.region.offset[d]);
                let hi = bounds[d].partition_point(|&x| x < m.region.offset[d] + m.region.shape[d]);
                (lo, hi)
            })
            .collect();
        let count: usize = ranges.iter().map(|(lo, hi)| hi - lo).product();
        for k in 0..count {
            // Decode k over the piece's cell ranges, last axis fastest.
            let (mut rest, mut cell) = (k, 0usize);
            for d in (0..dims.len()).rev() {
                let (lo, hi) = ranges[d];
                cell += (lo + rest % (hi - lo)) * cstride[d];
                rest /= hi - lo;
            }
            if owner[cell] != 0 {
                return Some(overlap(key, &boxes[owner[cell] as usize - 1], m));
            }
            owner[cell] = i as u32 + 1;
        }
    }
    let hole = owner.iter().position(|&o| o == 0)?;
    let mut rest = hole;
    let mut offset = vec![0; dims.len()];
    let mut extent = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        let c = rest % dims[d];
        rest /= dims[d];
        offset[d] = bounds[d][c];
        extent[d] = bounds[d][c + 1] - bounds[d][c];
    }
    Some(Problem::Gap {
        key: key.into(),
        covered: covered.min(u64::MAX as u128) as u64,
        total,
        missing: Some(Region::boxed(offset, extent)),
    })
}

fn sweep_check(key: &str, boxes: &[Main]) -> Option<Problem> {
    let mut order: Vec<&Main> = boxes.iter().filter(|m| m.region.box_numel() > 0).collect();
    order.sort_unstable_by_key(|m| m.region.offset[0]);
    let mut active: Vec<&Main> = Vec::new();
    // Each box is compared with every box whose rows it shares: quadratic where thousands
    // share rows (hours at a million boxes, from a crafted file too), so bounded.
    let mut pairs = 0u64;
    for m in order {
        let start = m.region.offset[0];
        active.retain(|a| a.region.offset[0] + a.region.shape[0] > start);
        pairs += active.len() as u64;
        if pairs > SWEEP_PAIRS_MAX {
            return Some(Problem::TooManyOverlaps { key: key.into(), boxes: boxes.len(), pairs: SWEEP_PAIRS_MAX });
        }
        if let Some(a) = active.iter().find(|a| a.region.box_intersection(&m.region).is_some()) {
            return Some(overlap(key, a, m));
        }
        active.push(m);
    }
    None
}

/// Element-exact check on global row-major intervals, for flat ranges that do not tile
/// their boxes.
fn exact_check(key: &str, shape: &[u64], total: u64, mains: &[Main]) -> Option<Problem> {
    let full = Region::full(shape);
    let mut intervals: Vec<(u64, u64, usize)> = Vec::new();
    for (i, m) in mains.iter().enumerate() {
        // Bounded before the walk: a region of 2^40 rows (one rank's plan, or a crafted
        // metadata file) was walked whole, for hours, before the bound refused it.
        let rows = overlap_runs_bound(&m.region, &full);
        if rows > (EXACT_INTERVALS_MAX - intervals.len()) as u64 {
            return Some(Problem::TooFragmented { key: key.into(), intervals: EXACT_INTERVALS_MAX });
        }
        for_each_overlap_run(&m.region, &full, |r| intervals.push((r.b, r.b + r.len, i)));
    }
    intervals.sort_unstable();
    let mut end = 0u64;
    let mut last: Option<usize> = None;
    let mut hole: Option<(u64, u64)> = None;
    for &(s, e, i) in &intervals {
        if s < end {
            return Some(overlap(key, &mains[last.unwrap_or(i)], &mains[i]));
        }
        if s > end && hole.is_none() {
            hole = Some((end, s));
        }
        end = e;
        last = Some(i);
    }
    if end < total && hole.is_none() {
        hole = Some((end, total));
    }
    let covered: u64 = intervals.iter().map(|(s, e, _)| e - s).sum();
    hole.map(|(s, e)| Problem::Gap { key: key.into(), covered, total, missing: Some(full.narrowed(s, e)) })
}
