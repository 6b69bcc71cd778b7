//! Regions of a global tensor and their algebra.
//!
//! A [`Region`] is an n-d box (offset + shape in the global index space), optionally
//! narrowed to a flat range `[start, stop)` of that box in row-major order — the form a
//! ZeRO-1 flat buffer slice takes. A region's *local buffer* holds exactly its elements,
//! in the box's row-major order, starting at the flat range's start.
//!
//! [`overlap_runs`] is the one primitive resharding needs: the elements two regions share,
//! as maximal runs that are contiguous in both local buffers.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::Dims;

/// A half-open range `[start, stop)` of element positions in a box's row-major order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FlatRange {
    /// The first position in the range.
    pub start: u64,
    /// One past the last position in the range.
    pub stop: u64,
}

impl FlatRange {
    /// Positions in the range; zero if `stop <= start`.
    pub fn len(self) -> u64 {
        self.stop.saturating_sub(self.start)
    }

    /// True if the range holds no position (`stop <= start`).
    pub fn is_empty(self) -> bool {
        self.stop <= self.start
    }
}

/// A piece of a global tensor: an n-d box, optionally narrowed to a flat range of it.
///
/// Fields are public so that regions are plain data; [`Region::check`] says whether a
/// region is well-formed inside a global shape, and the coverage validator runs it on every
/// piece before any arithmetic that could overflow.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Region {
    /// Where the box starts in the global tensor, one index per dimension.
    pub offset: Dims,
    /// The box's extent, one length per dimension.
    pub shape: Dims,
    /// The row-major range of the box's elements the region is narrowed to; `None` for the
    /// whole box.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flat: Option<FlatRange>,
}

/// Why a region does not fit a global shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum RegionError {
    /// The region's offset and shape have different lengths.
    #[error("offset and shape have different lengths")]
    RankMismatch,
    /// The region and the global shape have different numbers of dimensions.
    #[error("the region has {region} dimensions but the tensor has {global}")]
    NdimMismatch {
        /// The region's dimensions.
        region: usize,
        /// The global shape's dimensions.
        global: usize,
    },
    /// The box extends past the global shape on a dimension.
    #[error("dimension {dim} ends at {end} beyond the tensor's extent {extent}")]
    OutOfBounds {
        /// The first such dimension.
        dim: usize,
        /// Where the box ends on it (offset + shape, without overflow).
        end: u128,
        /// The global shape's extent on it.
        extent: u64,
    },
    /// The flat range is reversed or extends past the box's elements.
    #[error("flat range [{start}, {stop}) does not fit a box of {numel} elements")]
    FlatOutOfBounds {
        /// The flat range's start.
        start: u64,
        /// The flat range's stop.
        stop: u64,
        /// Elements in the box.
        numel: u64,
    },
    /// The global shape's element count does not fit in a `u64`.
    #[error("the element count overflows 64 bits")]
    Overflow,
}

/// A stretch of elements contiguous in two local buffers: `len` elements starting at
/// element `a` of the first buffer and element `b` of the second.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Run {
    /// Start of the run in the first local buffer, in elements.
    pub a: u64,
    /// Start of the run in the second local buffer, in elements.
    pub b: u64,
    /// Elements in the run.
    pub len: u64,
}

impl Region {
    /// The whole of a tensor of `shape`.
    pub fn full(shape: &[u64]) -> Region {
        Region { offset: shape.iter().map(|_| 0).collect(), shape: shape.into(), flat: None }
    }

    /// A plain box.
    pub fn boxed(offset: impl Into<Dims>, shape: impl Into<Dims>) -> Region {
        let (offset, shape) = (offset.into(), shape.into());
        debug_assert_eq!(offset.len(), shape.len());
        Region { offset, shape, flat: None }
    }

    /// This region's box narrowed to `[start, stop)`.
    pub fn narrowed(mut self, start: u64, stop: u64) -> Region {
        self.flat = Some(FlatRange { start, stop });
        self
    }

    /// Number of dimensions (of its shape).
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Elements of the box, ignoring any flat range. Saturates instead of overflowing;
    /// [`Region::check`] rejects regions where that would matter.
    pub fn box_numel(&self) -> u64 {
        numel(&self.shape)
    }

    /// Elements in the region (and in its local buffer).
    pub fn numel(&self) -> u64 {
        match self.flat {
            Some(f) => f.len(),
            None => self.box_numel(),
        }
    }

    /// The flat range this region covers of its box (the whole box if not narrowed).
    pub fn flat_range(&self) -> FlatRange {
        self.flat.unwrap_or(FlatRange { start: 0, stop: self.box_numel() })
    }

    /// True if the region is its whole box (no flat range, or one covering the box).
    pub fn is_whole_box(&self) -> bool {
        self.flat_range() == (FlatRange { start: 0, stop: self.box_numel() })
    }

    /// The same box without a flat range.
    pub fn box_only(&self) -> Region {
        Region { offset: self.offset.clone(), shape: self.shape.clone(), flat: None }
    }

    /// Checks that the region is well-formed inside a tensor of `global` shape, with
    /// every element count representable.
    pub fn check(&self, global: &[u64]) -> Result<(), RegionError> {
        if self.offset.len() != self.shape.len() {
            return Err(RegionError::RankMismatch);
        }
        if self.shape.len() != global.len() {
            return Err(RegionError::NdimMismatch { region: self.shape.len(), global: global.len() });
        }
        checked_numel(global).ok_or(RegionError::Overflow)?;
        for (dim, ((&o, &s), &g)) in self.offset.iter().zip(&self.shape).zip(global).enumerate() {
            let end = o as u128 + s as u128;
            if end > g as u128 {
                return Err(RegionError::OutOfBounds { dim, end, extent: g });
            }
        }
        let n = self.box_numel();
        if let Some(f) = self.flat
            && (f.start > f.stop || f.stop > n)
        {
            return Err(RegionError::FlatOutOfBounds { start: f.start, stop: f.stop, numel: n });
        }
        Ok(())
    }

    /// The box shared by two regions' boxes (flat ranges ignored), if any element is shared.
    pub fn box_intersection(&self, other: &Region) -> Option<Region> {
        if self.ndim() != other.ndim() {
            return None;
        }
        let mut offset = Dims::with_capacity(self.ndim());
        let mut shape = Dims::with_capacity(self.ndim());
        for d in 0..self.ndim() {
            let lo = self.offset[d].max(other.offset[d]);
            let hi = (self.offset[d] + self.shape[d]).min(other.offset[d] + other.shape[d]);
            if lo >= hi {
                return None;
            }
            offset.push(lo);
            shape.push(hi - lo);
        }
        Some(Region { offset, shape, flat: None })
    }

    /// The global multi-index of the element at `local` position of this region's buffer.
    pub fn global_index(&self, local: u64) -> Vec<u64> {
        let mut pos = self.flat_range().start + local;
        let mut idx = vec![0; self.ndim()];
        for d in (0..self.ndim()).rev() {
            let s = self.shape[d].max(1);
            idx[d] = self.offset[d] + pos % s;
            pos /= s;
        }
        idx
    }
}

impl fmt::Display for Region {
    /// `[0:4, 16:32]`, with ` flat[10:20)` appended for a narrowed region.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, (o, s)) in self.offset.iter().zip(&self.shape).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{o}:{}", o.saturating_add(*s))?;
        }
        f.write_str("]")?;
        if let Some(r) = self.flat {
            write!(f, " flat[{}:{})", r.start, r.stop)?;
        }
        Ok(())
    }
}

/// Product of `shape`, saturating.
pub fn numel(shape: &[u64]) -> u64 {
    shape.iter().fold(1u64, |acc, &s| acc.saturating_mul(s))
}

/// Product of `shape`, or `None` on overflow.
pub fn checked_numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &s| acc.checked_mul(s))
}

/// The elements `a` and `b` share, as maximal runs contiguous in both local buffers,
/// sorted by position (in both buffers at once: row-major order agrees between boxes).
///
/// Works for every combination of plain boxes and flat-narrowed boxes. Cost is
/// proportional to the number of runs produced plus a logarithmic search, not to the
/// size of the boxes. Regions of different dimensionality share nothing.
pub fn overlap_runs(a: &Region, b: &Region) -> Vec<Run> {
    let mut out = Vec::new();
    for_each_overlap_run(a, b, |r| out.push(r));
    out
}

/// Elements shared by `a` and `b`.
pub fn overlap_numel(a: &Region, b: &Region) -> u64 {
    if a.flat.is_none() && b.flat.is_none() {
        // Two plain boxes share a box: the product of what each dimension shares, without
        // the walk's strides and bisections (a load counts this once per requested tensor).
        if a.ndim() != b.ndim() {
            return 0;
        }
        let ends = |o: u64, s: u64| (o, o.saturating_add(s));
        return (0..a.ndim())
            .map(|d| {
                let ((alo, ahi), (blo, bhi)) = (ends(a.offset[d], a.shape[d]), ends(b.offset[d], b.shape[d]));
                ahi.min(bhi).saturating_sub(alo.max(blo))
            })
            .fold(1u64, u64::saturating_mul);
    }
    let mut n = 0;
    for_each_overlap_run(a, b, |r| n += r.len);
    n
}

/// Like [`overlap_runs`], calling `f` for each run instead of collecting.
pub fn for_each_overlap_run(a: &Region, b: &Region, f: impl FnMut(Run)) {
    with_scratch(a.ndim(), |scratch| overlap_runs_with(a, b, scratch, f))
}

/// Boxes of up to this many dimensions are intersected on the stack: a load calls the
/// overlap walks once per requested tensor and stored chunk, hundreds of thousands of times.
const INLINE_DIMS: usize = 8;

/// `f` with `4 * n` words of scratch (the shared box, both boxes' strides): on the stack up
/// to [`INLINE_DIMS`] dimensions.
fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [u64]) -> R) -> R {
    if n <= INLINE_DIMS { f(&mut [0; 4 * INLINE_DIMS][..4 * n]) } else { f(&mut vec![0; 4 * n]) }
}

/// Runs repeated at constant steps: `count` runs like `first`, run `k` at `first.a + k *
/// step_a` and `first.b + k * step_b` (steps 0 when `count` is 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    /// The first run.
    pub first: Run,
    /// How many runs, at least 1.
    pub count: u64,
    /// Elements from one run to the next in the first buffer.
    pub step_a: u64,
    /// Elements from one run to the next in the second buffer.
    pub step_b: u64,
}

/// The runs of [`for_each_overlap_run`], in the same order, grouped: where neither region
/// is narrowed to a flat range, the runs along the last dimension that has several (a
/// column split's rows) come as one [`Strided`] group, so that a caller does constant work
/// per group rather than per row. Narrowed regions give one group per run.
pub fn for_each_overlap_strided(a: &Region, b: &Region, mut f: impl FnMut(Strided)) {
    if a.flat.is_some() || b.flat.is_some() {
        return for_each_overlap_run(a, b, |first| f(Strided { first, count: 1, step_a: 0, step_b: 0 }));
    }
    with_scratch(a.ndim(), |scratch| {
        let Some(w) = Walk::new(a, b, scratch) else { return };
        let (shape, (stride_a, stride_b)) = (w.shape, w.strides);
        // The runs repeat along `row`, the dimension before the run's own, one group per
        // index of the dimensions before it; with no such dimension the overlap is one run.
        let (outer, count, steps) = match w.run_dim.checked_sub(1) {
            Some(row) if shape[row] > 1 => (&shape[..row], shape[row], (stride_a[row], stride_b[row])),
            Some(row) => (&shape[..row], 1, (0, 0)),
            None => (&shape[..0], 1, (0, 0)),
        };
        for g in 0..outer.iter().product::<u64>() {
            let (pa, pb) = w.positions(g, outer);
            f(Strided { first: Run { a: pa, b: pb, len: w.run_len }, count, step_a: steps.0, step_b: steps.1 });
        }
    })
}

/// The shared box of two regions laid out for walking it in runs: its shape, both boxes'
/// strides, where its first element lies in each buffer, and its runs (along `run_dim` and
/// every dimension after it, `run_len` elements each).
struct Walk<'s> {
    shape: &'s [u64],
    strides: (&'s [u64], &'s [u64]),
    bases: (u64, u64),
    run_dim: usize,
    run_len: u64,
}

impl<'s> Walk<'s> {
    /// The walk over what `a` and `b` share, in `4 * ndim` words of `scratch`; `None` when
    /// they share nothing or differ in dimensions. A 0-d box is one element; its
    /// intersection with another 0-d box is that element.
    fn new(a: &Region, b: &Region, scratch: &'s mut [u64]) -> Option<Walk<'s>> {
        let n = a.ndim();
        if b.ndim() != n {
            return None;
        }
        let (i_offset, rest) = scratch.split_at_mut(n);
        let (i_shape, rest) = rest.split_at_mut(n);
        let (stride_a, stride_b) = rest.split_at_mut(n);
        let t = shared_box(a, b, i_offset, i_shape)?;
        let run_dim = t.saturating_sub(1);
        let run_len: u64 = i_shape[run_dim..].iter().product();
        strides_into(&a.shape, stride_a);
        strides_into(&b.shape, stride_b);
        let base = |s: &[u64], r: &Region| -> u64 { (0..n).map(|d| (i_offset[d] - r.offset[d]) * s[d]).sum() };
        let bases = (base(stride_a, a), base(stride_b, b));
        Some(Walk { shape: i_shape, strides: (stride_a, stride_b), bases, run_dim, run_len })
    }

    /// Where the `j`-th index (row-major) of the dimensions `outer` (the box's first ones)
    /// starts in both buffers.
    fn positions(&self, j: u64, outer: &[u64]) -> (u64, u64) {
        let ((mut pa, mut pb), mut rest) = (self.bases, j);
        for d in (0..outer.len()).rev() {
            let m = rest % outer[d];
            rest /= outer[d];
            pa += m * self.strides.0[d];
            pb += m * self.strides.1[d];
        }
        (pa, pb)
    }
}

/// [`for_each_overlap_run`] with `4 * ndim` words of scratch for the intersection's box and
/// both boxes' strides.
/// At least as many as the runs [`for_each_overlap_run`] gives for `a` and `b` (the rows it
/// walks; adjacent runs merge), found without walking them: a caller that must bound its
/// work refuses a pair of regions before a walk of 2^40 rows.
pub(crate) fn overlap_runs_bound(a: &Region, b: &Region) -> u64 {
    with_scratch(a.ndim(), |scratch| match Walk::new(a, b, scratch) {
        Some(w) => {
            let (lo, hi) = walked_rows(&w, a, b);
            hi.saturating_sub(lo)
        }
        None => 0,
    })
}

/// The rows `lo..hi` of a walk that can hold elements of both flat ranges: rows before `lo`
/// end before a flat range starts; rows from `hi` on start after one ends. Both positions
/// grow with the row, so both bounds are found by bisection.
fn walked_rows(w: &Walk<'_>, a: &Region, b: &Region) -> (u64, u64) {
    let (outer, run_len) = (&w.shape[..w.run_dim], w.run_len);
    let count: u64 = outer.iter().product();
    let pos = |j: u64| w.positions(j, outer);
    let (fa, fb) = (a.flat_range(), b.flat_range());
    let lo = partition_point(count, |j| {
        let (pa, pb) = pos(j);
        pa + run_len <= fa.start || pb + run_len <= fb.start
    });
    let hi = partition_point(count, |j| {
        let (pa, pb) = pos(j);
        pa < fa.stop && pb < fb.stop
    });
    (lo, hi)
}

fn overlap_runs_with(a: &Region, b: &Region, scratch: &mut [u64], mut f: impl FnMut(Run)) {
    let Some(w) = Walk::new(a, b, scratch) else { return };
    let (outer, run_len) = (&w.shape[..w.run_dim], w.run_len);
    let pos = |j: u64| w.positions(j, outer);
    let (fa, fb) = (a.flat_range(), b.flat_range());
    let (lo, hi) = walked_rows(&w, a, b);
    let mut pending: Option<Run> = None;
    let mut push = |r: Run| match &mut pending {
        Some(p) if p.a + p.len == r.a && p.b + p.len == r.b => p.len += r.len,
        _ => {
            if let Some(p) = pending.replace(r) {
                f(p);
            }
        }
    };
    for j in lo..hi.max(lo) {
        let (pa, pb) = pos(j);
        emit_clipped(pa, pb, run_len, fa, fb, &mut push);
    }
    if let Some(p) = pending {
        f(p);
    }
}

/// The box `a` and `b` (of equal dimensions) share, into `offset` and `shape`, and `t`: the
/// dimensions from `t` on span both boxes whole, so a run covers them and dimension `t - 1`
/// together. `None` when the boxes share nothing.
fn shared_box(a: &Region, b: &Region, offset: &mut [u64], shape: &mut [u64]) -> Option<usize> {
    let n = a.ndim();
    for d in 0..n {
        let lo = a.offset[d].max(b.offset[d]);
        let hi = (a.offset[d] + a.shape[d]).min(b.offset[d] + b.shape[d]);
        if lo >= hi {
            return None;
        }
        (offset[d], shape[d]) = (lo, hi - lo);
    }
    let mut t = n;
    while t > 0 && shape[t - 1] == a.shape[t - 1] && shape[t - 1] == b.shape[t - 1] {
        t -= 1;
    }
    Some(t)
}

/// Clips a run at box positions `(pa, pb)` of `len` elements to both flat ranges and emits
/// it in local-buffer coordinates.
fn emit_clipped(pa: u64, pb: u64, len: u64, fa: FlatRange, fb: FlatRange, f: &mut impl FnMut(Run)) {
    let lo = fa.start.saturating_sub(pa).max(fb.start.saturating_sub(pb));
    let hi = len.min(fa.stop.saturating_sub(pa)).min(fb.stop.saturating_sub(pb));
    if lo < hi {
        f(Run { a: pa + lo - fa.start, b: pb + lo - fb.start, len: hi - lo });
    }
}

/// Row-major strides of `shape` into `out` (of the same length).
fn strides_into(shape: &[u64], out: &mut [u64]) {
    let mut acc = 1u64;
    for d in (0..shape.len()).rev() {
        out[d] = acc;
        acc = acc.wrapping_mul(shape[d]);
    }
}

/// First `j` in `0..count` for which `pred` is false (`pred` true then false).
fn partition_point(count: u64, pred: impl Fn(u64) -> bool) -> u64 {
    let (mut lo, mut hi) = (0u64, count);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(a: Region, b: Region, expect: &[(u64, u64, u64)]) {
        let got: Vec<(u64, u64, u64)> = overlap_runs(&a, &b).iter().map(|r| (r.a, r.b, r.len)).collect();
        assert_eq!(got, expect, "{a} ∩ {b}");
    }

    #[test]
    fn box_with_box() {
        // Column split vs row split of a 4x4 tensor.
        check(Region::boxed(vec![0, 0], vec![4, 2]), Region::boxed(vec![2, 0], vec![2, 4]), &[(4, 0, 2), (6, 4, 2)]);
        // Identical boxes: one run.
        check(Region::full(&[4, 4]), Region::full(&[4, 4]), &[(0, 0, 16)]);
        // Disjoint.
        check(Region::boxed(vec![0], vec![2]), Region::boxed(vec![2], vec![2]), &[]);
        // Row band inside full: one run.
        check(Region::boxed(vec![1, 0], vec![2, 4]), Region::full(&[4, 4]), &[(0, 4, 8)]);
    }

    #[test]
    fn flat_with_box_and_flat() {
        let full = Region::full(&[4, 4]);
        check(full.clone().narrowed(3, 9), Region::boxed(vec![0, 2], vec![4, 2]), &[(0, 1, 1), (3, 2, 2)]);
        check(full.clone().narrowed(3, 9), full.clone().narrowed(5, 12), &[(2, 0, 4)]);
        check(full.clone().narrowed(0, 4), full.narrowed(4, 8), &[]);
    }

    /// The strided groups expand to exactly the runs, in order, for boxes of 1 to 4
    /// dimensions cut every way, and narrowed regions come a run at a time.
    #[test]
    fn strided_groups_are_the_runs() {
        let expand = |a: &Region, b: &Region| {
            let mut out = Vec::new();
            for_each_overlap_strided(a, b, |g| {
                assert!(g.count >= 1);
                out.extend((0..g.count).map(|k| Run {
                    a: g.first.a + k * g.step_a,
                    b: g.first.b + k * g.step_b,
                    len: g.first.len,
                }));
            });
            out
        };
        let shape = [4u64, 3, 6, 5];
        for n in 1..=4 {
            let full = Region::full(&shape[..n]);
            let cuts = |k: u64| -> Vec<Region> {
                let mut v = vec![full.clone()];
                for d in 0..n {
                    let (mut off, mut sh) = (vec![0; n], shape[..n].to_vec());
                    off[d] = k % shape[d];
                    sh[d] = (shape[d] - off[d]).min(1 + k % 3);
                    v.push(Region::boxed(off, sh));
                }
                v
            };
            for ka in 0..5 {
                for kb in 0..5 {
                    for a in cuts(ka) {
                        for b in cuts(kb) {
                            assert_eq!(expand(&a, &b), overlap_runs(&a, &b), "{a} ∩ {b}");
                        }
                    }
                }
            }
        }
        let scalar = Region::full(&[]);
        assert_eq!(expand(&scalar, &scalar), overlap_runs(&scalar, &scalar), "a 0-d box is one element");
        let narrowed = Region::full(&[4, 4]).narrowed(3, 9);
        let b = Region::boxed(vec![0, 2], vec![4, 2]);
        assert_eq!(expand(&narrowed, &b), overlap_runs(&narrowed, &b));
        let mut groups = 0;
        for_each_overlap_strided(&Region::full(&[8, 6]), &Region::boxed(vec![0, 3], vec![8, 3]), |g| {
            assert_eq!((g.count, g.step_a, g.step_b, g.first.len), (8, 6, 3, 3));
            groups += 1;
        });
        assert_eq!(groups, 1, "a column split is one group");
    }

    #[test]
    fn scalar_tensor() {
        check(Region::full(&[]), Region::full(&[]), &[(0, 0, 1)]);
    }

    #[test]
    fn check_rejects_bad_regions() {
        let g = [4u64, 4];
        assert_eq!(
            Region::boxed(vec![0, 3], vec![4, 2]).check(&g),
            Err(RegionError::OutOfBounds { dim: 1, end: 5, extent: 4 })
        );
        assert!(matches!(Region::boxed(vec![0], vec![4]).check(&g), Err(RegionError::NdimMismatch { .. })));
        assert!(matches!(Region::full(&g).narrowed(3, 17).check(&g), Err(RegionError::FlatOutOfBounds { .. })));
        assert!(matches!(Region::full(&g).narrowed(5, 3).check(&g), Err(RegionError::FlatOutOfBounds { .. })));
        assert_eq!(Region::full(&[u64::MAX, 2]).check(&[u64::MAX, 2]), Err(RegionError::Overflow));
        assert_eq!(Region::full(&g).check(&g), Ok(()));
    }

    #[test]
    fn display() {
        assert_eq!(Region::boxed(vec![0, 16], vec![4, 16]).narrowed(10, 20).to_string(), "[0:4, 16:32] flat[10:20)");
    }
}
