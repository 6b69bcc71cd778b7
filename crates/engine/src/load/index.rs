//! Which stored chunks of a tensor a requested region can touch, found without trying each
//! chunk: a load at 16,384 ranks asks for about as many pieces as there are chunks, and
//! trying every chunk of a tensor for every request costs the square of the world for a
//! tensor split over the data-parallel ranks.
//!
//! Chunks are grouped by their box (the flat narrowings of one box together, by start) and
//! the boxes sorted along the axis where they start at the most places. A request's
//! candidates are the boxes that start within one box's reach before its end on that axis,
//! those whose box meets its box, and of their narrowings those inside the stretch of the
//! box the meeting spans. That is a superset of the chunks that overlap (the caller
//! intersects each), and, for the boxes parallel layouts make, little more.

use dckpt_shard_spec::Region;

use crate::format::{ChunkMeta, TensorMeta};

/// One tensor's chunks, indexed.
pub(super) struct ChunkIndex {
    /// The axis boxes are sorted along (`None` for a scalar: every chunk is a candidate).
    axis: Option<usize>,
    /// The largest extent of a box along `axis`.
    reach: u64,
    /// The distinct boxes, by where they start along `axis`.
    boxes: Vec<BoxEntry>,
    /// Chunk indices, each box's narrowings together, by flat start.
    order: Vec<u32>,
}

/// A box and where its chunks are in [`ChunkIndex::order`].
struct BoxEntry {
    start: u64,
    first: u32,
    count: u32,
}

impl ChunkIndex {
    pub(super) fn new(t: &TensorMeta) -> ChunkIndex {
        let chunks = &t.chunks;
        let ndim = t.global_shape.len();
        let axis = (0..ndim).max_by_key(|&d| {
            let mut starts: Vec<u64> = chunks.iter().filter_map(|c| c.offset.get(d).copied()).collect();
            starts.sort_unstable();
            starts.dedup();
            (starts.len(), std::cmp::Reverse(d))
        });
        let at = |c: &ChunkMeta| axis.and_then(|a| c.offset.get(a).copied()).unwrap_or(0);
        // A chunk without elements overlaps nothing; among a box's narrowings it would break
        // the order of their ends that `candidates` searches (it validates: it covers nothing).
        let mut order: Vec<u32> = (0..chunks.len() as u32)
            .filter(|&i| {
                let [start, stop] = flat_of(&chunks[i as usize]);
                start < stop
            })
            .collect();
        order.sort_unstable_by(|&a, &b| {
            let (x, y) = (&chunks[a as usize], &chunks[b as usize]);
            (at(x), &x.offset, &x.shape, flat_of(x)[0]).cmp(&(at(y), &y.offset, &y.shape, flat_of(y)[0]))
        });
        let mut boxes: Vec<BoxEntry> = Vec::new();
        let mut reach = 0;
        for (i, &ci) in order.iter().enumerate() {
            let c = &chunks[ci as usize];
            let same = boxes.last().is_some_and(|b| {
                let f = &chunks[order[b.first as usize] as usize];
                (&f.offset, &f.shape) == (&c.offset, &c.shape)
            });
            match boxes.last_mut() {
                Some(b) if same => b.count += 1,
                _ => {
                    reach = reach.max(axis.and_then(|a| c.shape.get(a).copied()).unwrap_or(0));
                    boxes.push(BoxEntry { start: at(c), first: i as u32, count: 1 });
                }
            }
        }
        ChunkIndex { axis, reach, boxes, order }
    }

    /// The chunks of `t` that `want` may overlap, into `out` (cleared first), through the
    /// index in `slot`, built on first use. A tensor of one chunk (every small one) needs
    /// none: that chunk is the candidate.
    pub(super) fn candidates_of(slot: &mut Option<ChunkIndex>, t: &TensorMeta, want: &Region, out: &mut Vec<u32>) {
        if t.chunks.len() == 1 {
            out.clear();
            out.push(0);
            return;
        }
        slot.get_or_insert_with(|| ChunkIndex::new(t)).candidates(&t.chunks, want, out);
    }

    /// The chunks `want` may overlap, in ascending index order, into `out` (cleared first).
    pub(super) fn candidates(&self, chunks: &[ChunkMeta], want: &Region, out: &mut Vec<u32>) {
        out.clear();
        let Some(axis) = self.axis.filter(|&a| a < want.ndim()) else {
            out.extend_from_slice(&self.order);
            out.sort_unstable();
            return;
        };
        let (lo, hi) = (want.offset[axis], want.offset[axis].saturating_add(want.shape[axis]));
        let from = self.boxes.partition_point(|b| b.start.saturating_add(self.reach) <= lo);
        let to = self.boxes.partition_point(|b| b.start < hi);
        for b in self.boxes.get(from..to.max(from)).unwrap_or(&[]) {
            let ids = &self.order[b.first as usize..(b.first + b.count) as usize];
            let first = &chunks[ids[0] as usize];
            let stored = Region { offset: first.offset.clone(), shape: first.shape.clone(), flat: None };
            let Some(meet) = stored.box_intersection(want) else { continue };
            let (mut start, mut stop) = span_in(&stored, &meet);
            if let Some(f) = want.flat.filter(|_| (&want.offset, &want.shape) == (&stored.offset, &stored.shape)) {
                (start, stop) = (start.max(f.start), stop.min(f.stop));
            }
            let skip = ids.partition_point(|&c| flat_of(&chunks[c as usize])[1] <= start);
            out.extend(ids[skip..].iter().take_while(|&&c| flat_of(&chunks[c as usize])[0] < stop));
        }
        out.sort_unstable();
    }
}

/// A chunk's flat range of its box (the whole box when it is not narrowed).
fn flat_of(c: &ChunkMeta) -> [u64; 2] {
    c.flat.unwrap_or_else(|| [0, c.shape.iter().product()])
}

/// The row-major stretch of `outer`'s elements from the first to one past the last element
/// of `inner`, a box inside it.
fn span_in(outer: &Region, inner: &Region) -> (u64, u64) {
    let (mut first, mut last) = (0u64, 0u64);
    for d in 0..outer.ndim() {
        let rel = inner.offset[d] - outer.offset[d];
        first = first * outer.shape[d] + rel;
        last = last * outer.shape[d] + rel + inner.shape[d] - 1;
    }
    (first, last + 1)
}

#[cfg(test)]
mod tests {
    use dckpt_shard_spec::{DType, Dims, overlap_numel};

    use super::*;

    fn chunk(region: &Region) -> ChunkMeta {
        ChunkMeta {
            offset: region.offset.clone(),
            shape: region.shape.clone(),
            flat: region.flat.map(|f| [f.start, f.stop]),
            file: 0,
            at: 0,
            crc32: Vec::new(),
        }
    }

    fn tensor(shape: &[u64], regions: &[Region]) -> TensorMeta {
        TensorMeta {
            key: "t".into(),
            dtype: DType::F32,
            global_shape: Dims::from(shape),
            chunks: regions.iter().map(chunk).collect(),
        }
    }

    /// Every chunk that overlaps a request is among its candidates, over grids, column
    /// splits, flat narrowings of boxes and requests of every kind.
    #[test]
    fn candidates_hold_every_overlapping_chunk() {
        let mut layouts: Vec<(Vec<u64>, Vec<Region>)> = Vec::new();
        // A 2-d grid of 3 x 4 boxes, each split into 3 flat ranges.
        let mut grid = Vec::new();
        for i in 0..3u64 {
            for j in 0..4u64 {
                let b = Region::boxed([i * 4, j * 5], [4, 5]);
                grid.extend([b.clone().narrowed(0, 7), b.clone().narrowed(7, 13), b.narrowed(13, 20)]);
            }
        }
        layouts.push((vec![12, 20], grid));
        // Columns only, and uneven rows.
        layouts.push((vec![6, 8], (0..4).map(|j| Region::boxed([0, j * 2], [6, 2])).collect()));
        layouts.push((vec![10], vec![Region::boxed([0], [7]), Region::boxed([7], [3])]));
        layouts.push((vec![], vec![Region::full(&[])]));
        // Chunks without elements among the narrowings (metadata validates them: they
        // cover nothing), which broke the order of the narrowings' ends.
        let w = Region::full(&[10]);
        layouts.push((vec![10], vec![w.clone().narrowed(0, 7), w.clone().narrowed(3, 3), w.narrowed(7, 10)]));
        for (shape, regions) in layouts {
            let t = tensor(&shape, &regions);
            let index = ChunkIndex::new(&t);
            let mut wants = vec![Region::full(&shape)];
            if shape == [10] {
                wants.push(Region::full(&shape).narrowed(4, 6));
            }
            if shape.len() == 2 {
                wants.extend([
                    Region::boxed([1, 3], [5, 9]),
                    Region::boxed([0, 0], [shape[0], 1]),
                    Region::boxed([4, 5], [4, 5]).narrowed(2, 9),
                    Region::full(&shape).narrowed(30, 31),
                ]);
            }
            let mut out = Vec::new();
            for want in wants {
                index.candidates(&t.chunks, &want, &mut out);
                for (i, c) in t.chunks.iter().enumerate() {
                    if overlap_numel(&c.region(), &want) > 0 {
                        assert!(out.contains(&(i as u32)), "{shape:?}: chunk {:?} misses {want:?}", c.region());
                    }
                }
                assert!(out.is_sorted());
            }
        }
    }

    /// A request for one piece of a tensor split over many ranks gets a few candidates, not
    /// every chunk.
    #[test]
    fn candidates_stay_few_for_a_tensor_split_many_ways() {
        let n = 4096u64;
        let flat: Vec<Region> = (0..n).map(|i| Region::full(&[n * 8]).narrowed(i * 8, i * 8 + 8)).collect();
        let rows: Vec<Region> = (0..n).map(|i| Region::boxed([i, 0], [1, 8])).collect();
        for (shape, regions) in [(vec![n * 8], flat), (vec![n, 8], rows)] {
            let t = tensor(&shape, &regions);
            let index = ChunkIndex::new(&t);
            let mut out = Vec::new();
            let want = t.chunks[100].region();
            index.candidates(&t.chunks, &want, &mut out);
            assert!(out.len() <= 3 && out.contains(&100), "{shape:?}: {out:?}");
        }
    }
}
