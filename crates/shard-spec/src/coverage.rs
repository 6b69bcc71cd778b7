//! Coverage validation: the proof, before any byte is written, that a sharded state holds
//! every element of every global tensor exactly once.
//!
//! For every key: all pieces agree on dtype and global shape; every region fits the global
//! shape; the main replicas cover the tensor with no gap and no overlap — for regular grids,
//! irregular boxes and flat ranges alike; the objects of a key sit on distinct grid
//! positions and fill the grid. Optionally, the keys, dtypes and global shapes must be
//! exactly a model's declared tensors.
//!
//! The mechanism is the same for every layout: flat ranges that tile a box are folded
//! into that box; the boxes are then checked on the grid their own boundaries induce
//! (one cell per piece for a regular grid). Anything that does not fold — flat ranges
//! that straddle boxes — is checked element-exactly on global row-major intervals.

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::region::{FlatRange, Region, RegionError, checked_numel, for_each_overlap_run};
use crate::{DType, Dims, ShardedObject, ShardedTensor, TensorDecl};

/// Problems reported in full; further ones are counted.
pub const PROBLEMS_SHOWN_MAX: usize = 32;
/// Beyond this many grid cells per key, overlaps are found by a sweep instead.
const GRID_CELLS_MAX: u128 = 1 << 22;
/// Beyond this many global intervals per key, the exact check gives up with an error.
const EXACT_INTERVALS_MAX: usize = 1 << 24;

/// A sharded tensor together with the rank that holds it.
#[derive(Clone, Copy, Debug)]
pub struct TensorPiece<'a> {
    /// The rank that holds the tensor; problems name it.
    pub rank: u32,
    /// The piece itself.
    pub tensor: &'a ShardedTensor,
}

/// A sharded object together with the rank that holds it.
#[derive(Clone, Copy, Debug)]
pub struct ObjectPiece<'a> {
    /// The rank that holds the object; problems name it.
    pub rank: u32,
    /// The object itself.
    pub object: &'a ShardedObject,
}

/// What a successful validation proved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Distinct tensor keys.
    pub tensors: usize,
    /// Distinct object keys.
    pub objects: usize,
    /// Main-replica tensor pieces (distinct chunks that will be stored).
    pub main_pieces: usize,
    /// Bytes of all global tensors.
    pub tensor_bytes: u64,
}

/// One thing wrong with a sharded state. Every variant names the key; most name the
/// regions and ranks involved. Serializable, so that the rank that validated can send it to
/// the others as it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum Problem {
    /// Two pieces of a tensor disagree on its dtype.
    #[error("tensor {key:?}: rank {rank_a} says dtype {dtype_a} but rank {rank_b} says {dtype_b}")]
    DtypeMismatch {
        /// The tensor's key.
        key: String,
        /// The rank of the key's first piece (in input order).
        rank_a: u32,
        /// The dtype that first piece has.
        dtype_a: DType,
        /// The rank of the first piece with another dtype.
        rank_b: u32,
        /// The dtype that piece has.
        dtype_b: DType,
    },
    /// Two pieces of a tensor disagree on its global shape.
    #[error("tensor {key:?}: rank {rank_a} says global shape {shape_a:?} but rank {rank_b} says {shape_b:?}")]
    ShapeMismatch {
        /// The tensor's key.
        key: String,
        /// The rank of the key's first piece (in input order).
        rank_a: u32,
        /// The global shape that first piece has.
        shape_a: Dims,
        /// The rank of the first piece with another global shape.
        rank_b: u32,
        /// The global shape that piece has.
        shape_b: Dims,
    },
    /// The tensor's element count or byte count does not fit in a `u64`.
    #[error("tensor {key:?}: global shape {shape:?} of {dtype} has more bytes than fit in 64 bits")]
    TooLarge {
        /// The tensor's key.
        key: String,
        /// Its global shape.
        shape: Dims,
        /// Its dtype.
        dtype: DType,
    },
    /// A piece's region is malformed or lies outside the global shape ([`Region::check`]).
    #[error(
        "tensor {key:?}: rank {rank} holds region {region} that does not fit global shape {global_shape:?}: {reason}"
    )]
    BadRegion {
        /// The tensor's key.
        key: String,
        /// The rank holding the piece.
        rank: u32,
        /// The piece's region.
        region: Region,
        /// The tensor's global shape.
        global_shape: Dims,
        /// What is wrong with the region.
        reason: RegionError,
    },
    /// Several ranks hold the same region, each marked as the main replica.
    #[error(
        "tensor {key:?}: region {region} is marked main replica on several ranks {ranks:?}; exactly one holder may be main"
    )]
    DuplicateMain {
        /// The tensor's key.
        key: String,
        /// The region they all hold.
        region: Region,
        /// The ranks marking it main, ascending.
        ranks: Vec<u32>,
    },
    /// Two different main regions share elements.
    #[error(
        "tensor {key:?}: main replica {region_a} on rank(s) {ranks_a:?} overlaps main replica {region_b} on rank(s) {ranks_b:?}"
    )]
    Overlap {
        /// The tensor's key.
        key: String,
        /// One main region; a whole box where flat ranges that tile it were folded into it.
        region_a: Region,
        /// The ranks holding `region_a` as main (for a folded box, the holders of its ranges).
        ranks_a: Vec<u32>,
        /// The other main region, in the same form as `region_a`.
        region_b: Region,
        /// The ranks holding `region_b` as main.
        ranks_b: Vec<u32>,
    },
    /// The main replicas leave some elements of the tensor uncovered.
    #[error("tensor {key:?}: main replicas cover {covered} of {total} elements{}", missing_text(.missing))]
    Gap {
        /// The tensor's key.
        key: String,
        /// Elements the main replicas hold, summed (saturating at `u64::MAX`).
        covered: u64,
        /// Elements of the global tensor.
        total: u64,
        /// The first uncovered part found: a cell of the grid the main boxes' boundaries
        /// induce or, for flat ranges that straddle boxes, the whole tensor narrowed to the
        /// first uncovered flat range. `None` when only the count shows the gap (that grid
        /// too large, so the boxes were checked by a sweep instead).
        missing: Option<Region>,
    },
    /// Flat ranges that straddle boxes make more global intervals than the exact check
    /// handles.
    #[error("tensor {key:?}: {intervals}+ disjoint pieces in global order; too fragmented to validate exactly")]
    TooFragmented {
        /// The tensor's key.
        key: String,
        /// The interval limit that was reached.
        intervals: usize,
    },
    /// Two objects of a key disagree on the grid's shape.
    #[error("object {key:?}: rank {rank_a} says grid {grid_a:?} but rank {rank_b} says {grid_b:?}")]
    ObjectGridMismatch {
        /// The object's key.
        key: String,
        /// The rank of the key's first object (in input order).
        rank_a: u32,
        /// The grid shape that first object has.
        grid_a: Vec<u64>,
        /// The rank of the first object with another grid shape.
        rank_b: u32,
        /// The grid shape that object has.
        grid_b: Vec<u64>,
    },
    /// An object's position is not inside its grid (wrong length or an entry too large).
    #[error("object {key:?}: rank {rank} holds position {offset:?} outside grid {grid:?}")]
    ObjectOutOfBounds {
        /// The object's key.
        key: String,
        /// The rank holding the object.
        rank: u32,
        /// The object's position.
        offset: Vec<u64>,
        /// The grid's shape.
        grid: Vec<u64>,
    },
    /// Several ranks hold the object at one grid position, each marked as the main replica.
    #[error("object {key:?}: position {offset:?} is marked main replica on several ranks {ranks:?}")]
    ObjectDuplicate {
        /// The object's key.
        key: String,
        /// The grid position.
        offset: Vec<u64>,
        /// The ranks marking it main, ascending.
        ranks: Vec<u32>,
    },
    /// Some grid positions have no main object.
    #[error("object {key:?}: {missing} of {total} grid positions have no main replica, first {offset:?}")]
    ObjectMissing {
        /// The object's key.
        key: String,
        /// The first position without a main object, in row-major order.
        offset: Vec<u64>,
        /// How many positions have none.
        missing: u64,
        /// Positions in the grid (saturating at `u64::MAX`).
        total: u64,
    },
    /// The model declares a tensor that no rank holds.
    #[error("tensor {key:?} is declared by the model but no rank holds it")]
    MissingTensor {
        /// The declared key.
        key: String,
    },
    /// A rank holds a tensor the model does not declare.
    #[error("tensor {key:?} is held by rank {rank} but the model does not declare it")]
    UndeclaredTensor {
        /// The tensor's key.
        key: String,
        /// The rank of the key's first piece.
        rank: u32,
    },
    /// A held tensor's dtype or global shape differs from the model's declaration.
    #[error(
        "tensor {key:?}: the model declares {declared_dtype} {declared_shape:?} but the state holds {dtype} {shape:?}"
    )]
    DeclarationMismatch {
        /// The tensor's key.
        key: String,
        /// The declared dtype.
        declared_dtype: DType,
        /// The declared global shape.
        declared_shape: Dims,
        /// The dtype the pieces have.
        dtype: DType,
        /// The global shape the pieces have.
        shape: Dims,
    },
    /// The model declares one key more than once.
    #[error("tensor {key:?} is declared twice by the model")]
    DuplicateDeclaration {
        /// The key declared twice.
        key: String,
    },
}

fn missing_text(m: &Option<Region>) -> String {
    match m {
        Some(r) => format!("; nothing main holds {r}"),
        None => String::new(),
    }
}

/// Everything wrong with a sharded state (the first [`PROBLEMS_SHOWN_MAX`], and a count of
/// the rest).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ValidationError {
    /// The first [`PROBLEMS_SHOWN_MAX`] problems found, in [`validate`]'s deterministic order.
    pub problems: Vec<Problem>,
    /// How many further problems were found and left out.
    pub more: usize,
}

impl std::error::Error for ValidationError {}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len() + self.more;
        write!(f, "invalid sharded state ({n} problem{})", if n == 1 { "" } else { "s" })?;
        for p in &self.problems {
            write!(f, "\n  - {p}")?;
        }
        if self.more > 0 {
            write!(f, "\n  ... and {} more", self.more)?;
        }
        Ok(())
    }
}

#[derive(Default)]
struct Problems {
    shown: Vec<Problem>,
    more: usize,
}

impl Problems {
    fn push(&mut self, p: Problem) {
        if self.shown.len() < PROBLEMS_SHOWN_MAX {
            self.shown.push(p);
        } else {
            self.more += 1;
        }
    }
}

/// Validates a whole sharded state: every rank's tensors and objects, and, when given,
/// the model's declared tensors. Deterministic: tensor problems first, then object
/// problems, then declaration problems, each group in key order.
pub fn validate(
    tensors: &[TensorPiece<'_>],
    objects: &[ObjectPiece<'_>],
    declared: Option<&[TensorDecl]>,
) -> Result<Coverage, ValidationError> {
    let mut problems = Problems::default();
    let mut coverage = Coverage::default();

    let tensor_sorted = sorted_by_key(tensors, |p| p.tensor.key.as_str());
    let tensor_groups = groups(&tensor_sorted, |p| p.tensor.key.as_str());
    coverage.tensors = tensor_groups.len();
    for (key, pieces) in &tensor_groups {
        if let Some(stats) = check_tensor(key, pieces, &mut problems) {
            coverage.main_pieces += stats.0;
            coverage.tensor_bytes = coverage.tensor_bytes.saturating_add(stats.1);
        }
    }
    let object_sorted = sorted_by_key(objects, |p| p.object.key.as_str());
    let object_groups = groups(&object_sorted, |p| p.object.key.as_str());
    coverage.objects = object_groups.len();
    for (key, pieces) in &object_groups {
        check_objects(key, pieces, &mut problems);
    }
    if let Some(decls) = declared {
        check_declared(&tensor_groups, decls, &mut problems);
    }
    if problems.shown.is_empty() {
        Ok(coverage)
    } else {
        Err(ValidationError { problems: problems.shown, more: problems.more })
    }
}

/// The pieces sorted by key, pieces of one key in input order.
fn sorted_by_key<'a, T: Copy>(items: &[T], key: impl Fn(&T) -> &'a str) -> Vec<T> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_unstable_by(|&a, &b| key(&items[a]).cmp(key(&items[b])).then(a.cmp(&b)));
    order.into_iter().map(|i| items[i]).collect()
}

/// The runs of one key in pieces sorted by key.
fn groups<'a, 'p, T>(sorted: &'p [T], key: impl Fn(&T) -> &'a str) -> Vec<(&'a str, &'p [T])> {
    sorted.chunk_by(|a, b| key(a) == key(b)).map(|g| (key(&g[0]), g)).collect()
}

/// A candidate for exact-once coverage: a region with the ranks that hold it as main.
#[derive(Clone, Debug)]
struct Main {
    region: Region,
    ranks: Vec<u32>,
}

/// Checks one key; on success returns (main pieces, bytes of the global tensor).
fn check_tensor(key: &str, pieces: &[TensorPiece<'_>], problems: &mut Problems) -> Option<(usize, u64)> {
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
    for m in order {
        let start = m.region.offset[0];
        active.retain(|a| a.region.offset[0] + a.region.shape[0] > start);
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
        let mut too_many = false;
        for_each_overlap_run(&m.region, &full, |r| {
            if intervals.len() < EXACT_INTERVALS_MAX {
                intervals.push((r.b, r.b + r.len, i));
            } else {
                too_many = true;
            }
        });
        if too_many {
            return Some(Problem::TooFragmented { key: key.into(), intervals: EXACT_INTERVALS_MAX });
        }
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

fn check_objects(key: &str, pieces: &[ObjectPiece<'_>], problems: &mut Problems) {
    let first = pieces[0];
    let grid = &first.object.grid_shape;
    for p in pieces {
        if &p.object.grid_shape != grid {
            problems.push(Problem::ObjectGridMismatch {
                key: key.into(),
                rank_a: first.rank,
                grid_a: grid.clone(),
                rank_b: p.rank,
                grid_b: p.object.grid_shape.clone(),
            });
            return;
        }
        let o = &p.object.grid_offset;
        if o.len() != grid.len() || o.iter().zip(grid).any(|(a, g)| a >= g) {
            problems.push(Problem::ObjectOutOfBounds {
                key: key.into(),
                rank: p.rank,
                offset: o.clone(),
                grid: grid.clone(),
            });
            return;
        }
    }
    let mut mains: Vec<(&Vec<u64>, u32)> =
        pieces.iter().filter(|p| p.object.is_main()).map(|p| (&p.object.grid_offset, p.rank)).collect();
    mains.sort_unstable();
    for w in mains.chunk_by(|a, b| a.0 == b.0) {
        if w.len() > 1 {
            let ranks = w.iter().map(|x| x.1).collect();
            problems.push(Problem::ObjectDuplicate { key: key.into(), offset: w[0].0.clone(), ranks });
            return;
        }
    }
    let total = checked_numel(grid).unwrap_or(u64::MAX);
    let found = mains.len() as u64;
    if found < total {
        // Positions are sorted row-major; the first one out of step is missing.
        let mut pos = vec![0u64; grid.len()];
        for (o, _) in &mains {
            if *o != &pos {
                break;
            }
            for d in (0..grid.len()).rev() {
                pos[d] += 1;
                if pos[d] < grid[d] {
                    break;
                }
                pos[d] = 0;
            }
        }
        problems.push(Problem::ObjectMissing { key: key.into(), offset: pos, missing: total - found, total });
    }
}

fn check_declared(groups: &[(&str, &[TensorPiece<'_>])], decls: &[TensorDecl], problems: &mut Problems) {
    let mut declared: HashMap<&str, &TensorDecl> = HashMap::with_capacity(decls.len());
    let mut sorted: Vec<&TensorDecl> = decls.iter().collect();
    sorted.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    for d in sorted {
        if declared.insert(d.key.as_str(), d).is_some() {
            problems.push(Problem::DuplicateDeclaration { key: d.key.to_string() });
        }
    }
    let mut held: HashSet<&str> = HashSet::with_capacity(groups.len());
    for (key, pieces) in groups {
        held.insert(key);
        let t = pieces[0].tensor;
        match declared.get(key) {
            None => problems.push(Problem::UndeclaredTensor { key: (*key).into(), rank: pieces[0].rank }),
            Some(d) if d.dtype != t.dtype || d.global_shape != t.global_shape => {
                problems.push(Problem::DeclarationMismatch {
                    key: (*key).into(),
                    declared_dtype: d.dtype,
                    declared_shape: d.global_shape.clone(),
                    dtype: t.dtype,
                    shape: t.global_shape.clone(),
                })
            }
            Some(_) => {}
        }
    }
    let mut missing: Vec<&str> = declared.keys().filter(|k| !held.contains(*k)).copied().collect();
    missing.sort_unstable();
    for key in missing {
        problems.push(Problem::MissingTensor { key: key.into() });
    }
}
