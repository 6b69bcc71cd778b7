//! Save planning: pure, deterministic, and the place where a save proves it is complete.
//!
//! From every rank's shard list the coordinator validates exact-once coverage (and, when
//! the caller declares its model's tensors, that the state is exactly those), finds the
//! distinct chunks — one per main replica — with every rank that holds an identical copy,
//! and picks exactly one writer per chunk:
//! - [`Assignment::Replica0`]: the main replica's holder writes;
//! - [`Assignment::Balanced`] (default): largest chunks first, each to its least-loaded
//!   holder (ties to the lower rank). If that ever ends with a larger per-rank maximum
//!   than `Replica0`, the `Replica0` assignment is used, so balanced is never worse.
//!
//! A rank with nothing to write is an ordinary rank: an empty [`LocalPlan`] in, an empty
//! write list out.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;

use dckpt_shard_spec::{
    Coverage, DType, Key, ObjectPiece, Region, ShardedObject, ShardedTensor, TensorDecl, TensorPiece, validate,
};
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::radix::{sort_by_u64, sort_moving_by_u64};

/// How writers are chosen among the holders of a chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Assignment {
    /// Spread replicated tensor chunks over their holders to even out per-rank bytes (an
    /// object is written by its main copy; with [`ReplicaCheck::Off`](crate::ReplicaCheck)
    /// every chunk is: copies not compared are not trusted to be current).
    #[default]
    Balanced,
    /// The main replica writes.
    Replica0,
}

impl Assignment {
    /// The name options and the metadata use (`balanced`, `replica0`).
    pub fn name(self) -> &'static str {
        match self {
            Assignment::Balanced => "balanced",
            Assignment::Replica0 => "replica0",
        }
    }
}

impl fmt::Display for Assignment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Assignment {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "balanced" => Ok(Assignment::Balanced),
            "replica0" => Ok(Assignment::Replica0),
            _ => Err(format!("unknown assignment {s:?}; expected balanced or replica0")),
        }
    }
}

/// An object a rank holds, with the size of its bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectItem {
    /// The object's key and place in its grid.
    pub object: ShardedObject,
    /// Length of its bytes.
    pub nbytes: u64,
    /// Whether the replica check compares this copy (its [`crate::ObjectCompare`] is not `Not`).
    pub compared: bool,
}

/// What one rank holds, as metadata: the input to planning.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalPlan {
    /// The rank's tensor pieces, in the order it hands their bytes over.
    pub tensors: Vec<ShardedTensor>,
    /// The rank's objects, likewise.
    pub objects: Vec<ObjectItem>,
}

/// A distinct stored chunk and the rank that writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkPlan {
    /// The tensor's key.
    pub key: Key,
    /// Its element type.
    pub dtype: DType,
    /// The part of the global tensor this chunk is.
    pub region: Region,
    /// Length of the chunk's bytes.
    pub nbytes: u64,
    /// The rank that writes it.
    pub writer: u32,
    /// How many ranks hold an identical copy (the writer among them).
    pub holders: u32,
}

/// A distinct stored object and the rank that writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectPlan {
    /// The object's key.
    pub key: Key,
    /// The shape of the grid of objects it belongs to.
    pub grid_shape: Vec<u64>,
    /// Its place in that grid.
    pub grid_offset: Vec<u64>,
    /// Length of its bytes.
    pub nbytes: u64,
    /// The rank that writes it.
    pub writer: u32,
    /// How many ranks hold an identical copy (the writer among them).
    pub holders: u32,
}

/// What one rank writes under a plan.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankWrites {
    /// Indices into the rank's `LocalPlan::tensors`, in file order: the chunks other ranks
    /// also hold first, then the rest, each part in plan order (`file_order`).
    pub tensors: Vec<u32>,
    /// Indices into the rank's `LocalPlan::objects`.
    pub objects: Vec<u32>,
    /// The bytes it writes in all.
    pub bytes: u64,
}

impl RankWrites {
    /// The tensor chunks and objects it writes.
    pub fn chunks(&self) -> usize {
        self.tensors.len() + self.objects.len()
    }

    /// Whether it writes nothing (and so makes no data file).
    pub fn is_empty(&self) -> bool {
        self.chunks() == 0
    }
}

/// The global save plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavePlan {
    /// How the writers were chosen.
    pub assignment: Assignment,
    /// Distinct tensor chunks, sorted by (key, region).
    pub chunks: Vec<ChunkPlan>,
    /// Distinct objects, sorted by (key, grid offset).
    pub objects: Vec<ObjectPlan>,
    /// Every tensor key in the state, sorted, with its dtype and global shape (a tensor
    /// without elements has no chunk but is still stored).
    pub tensors: Vec<TensorDecl>,
    /// One entry per rank, in rank order.
    pub ranks: Vec<RankWrites>,
    /// The tensor chunks that more than one rank holds, in chunk order, then the objects
    /// likewise: the copies a save compares before it writes, since replicas must hold the
    /// same bytes.
    pub(crate) replicas: Vec<ReplicaSet>,
    /// What the coverage proof counted (zeros for a preview, which proves nothing).
    pub coverage: Coverage,
}

/// The holders of one tensor chunk or object that several ranks hold, each as (rank, index
/// into that rank's pieces: its `LocalPlan::tensors`, then its `LocalPlan::objects`): the
/// main piece and the pieces with the same key and region or grid offset (each rank once,
/// the main's rank not again). A piece marked as a replica whose region is no main piece's
/// region belongs to no set: it is neither written nor compared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ReplicaSet {
    /// Index into [`SavePlan::chunks`], or into [`SavePlan::objects`] where `object`.
    pub(crate) at: u32,
    pub(crate) object: bool,
    pub(crate) main: (u32, u32),
    pub(crate) replicas: Vec<(u32, u32)>,
}

impl SavePlan {
    /// The number of ranks planned for.
    pub fn world_size(&self) -> u32 {
        self.ranks.len() as u32
    }

    /// Bytes written by all ranks together.
    pub fn total_bytes(&self) -> u64 {
        self.ranks.iter().fold(0, |n, r| n.saturating_add(r.bytes))
    }

    /// The largest number of bytes one rank writes.
    pub fn max_rank_bytes(&self) -> u64 {
        self.ranks.iter().map(|r| r.bytes).max().unwrap_or(0)
    }

    /// Ranks that write nothing.
    pub fn empty_ranks(&self) -> Vec<u32> {
        (0..self.world_size()).filter(|&r| self.ranks[r as usize].is_empty()).collect()
    }
}

/// Plans a save from every rank's local plan (`locals[r]` is rank `r`'s).
///
/// Fails with [`ErrorKind::InvalidState`](crate::ErrorKind::InvalidState) naming every key,
/// region and rank at fault when coverage or the declaration check fails; nothing is planned
/// then.
pub fn plan_save(
    locals: &[LocalPlan],
    declared: Option<&[TensorDecl]>,
    assignment: Assignment,
) -> Result<SavePlan, Error> {
    let tensor_pieces: Vec<TensorPiece<'_>> = locals
        .iter()
        .enumerate()
        .flat_map(|(r, l)| l.tensors.iter().map(move |t| TensorPiece { rank: r as u32, tensor: t }))
        .collect();
    let object_pieces: Vec<ObjectPiece<'_>> = locals
        .iter()
        .enumerate()
        .flat_map(|(r, l)| l.objects.iter().map(move |o| ObjectPiece { rank: r as u32, object: &o.object }))
        .collect();
    // The coverage proof and the writer assignment only read the local plans: side by side
    // on two cores, the proof (a third of the planning at 16,384 ranks) costs little wall
    // time. A failed proof discards the assignment. Without a thread to spare (a process
    // at its thread limit), one runs after the other.
    let (coverage, plan) = crate::threads::beside(
        || validate(&tensor_pieces, &object_pieces, declared),
        || assign_writers(locals, assignment),
    );
    let coverage = coverage.map_err(|_| Error::internal("the coverage check panicked"))?;
    Ok(SavePlan { coverage: coverage.map_err(Error::from)?, ..plan })
}

/// What a save of an *unvalidated* state would write: the same writer assignment without
/// the coverage proof. For reporting on a state that [`plan_save`] rejected (how many bytes
/// a naive save would have stored); never write from it.
pub fn preview_save(locals: &[LocalPlan], assignment: Assignment) -> SavePlan {
    assign_writers(locals, assignment)
}

fn assign_writers(locals: &[LocalPlan], assignment: Assignment) -> SavePlan {
    // Distinct chunks are the main pieces; holders are every rank with the same key and region.
    let tensor_slots = slots(locals.iter().enumerate().flat_map(|(rank, l)| {
        l.tensors.iter().enumerate().map(move |(i, t)| Piece {
            id: (t.key.as_str(), &t.region),
            rank: rank as u32,
            item: i as u32,
            main: t.is_main(),
            nbytes: t.nbytes(),
            empty: t.region.numel() == 0,
        })
    }));
    let object_slots = slots(locals.iter().enumerate().flat_map(|(rank, l)| {
        l.objects.iter().enumerate().map(move |(i, o)| Piece {
            id: (o.object.key.as_str(), o.object.grid_offset.as_slice()),
            rank: rank as u32,
            item: i as u32,
            main: o.object.is_main(),
            nbytes: o.nbytes,
            empty: false,
        })
    }));

    let world = locals.len();
    let writers = assign(&tensor_slots, &object_slots, world, assignment);
    let (tw, ow) = writers.split_at(tensor_slots.len());
    let mut ranks = vec![RankWrites::default(); world];
    let (chunks, mut replicas, mut tensors) = plan_chunks(locals, &tensor_slots, tw, &mut ranks);
    let objects = plan_objects(locals, &object_slots, ow, &mut ranks, &mut replicas);
    declare_bare(locals, &mut tensors);
    SavePlan { assignment, chunks, objects, tensors, ranks, replicas, coverage: Coverage::default() }
}

/// The tensor chunks with their writers (`writers[i]` is slot `i`'s), each added to its
/// writer's part of `ranks`; the chunks several ranks hold as replica sets; and one
/// declaration per key that has a chunk.
fn plan_chunks<K>(
    locals: &[LocalPlan],
    slots: &[Slot<K>],
    writers: &[Holder],
    ranks: &mut [RankWrites],
) -> (Vec<ChunkPlan>, Vec<ReplicaSet>, Vec<TensorDecl>) {
    let mut chunks = Vec::with_capacity(slots.len());
    let mut replicas = Vec::new();
    let mut singles: Vec<Vec<u32>> = vec![Vec::new(); ranks.len()];
    // One declaration per key: from its first chunk (in key order; validated, its chunks
    // agree on dtype and global shape).
    let mut tensors: Vec<TensorDecl> = Vec::new();
    for (slot, &(writer, item)) in slots.iter().zip(writers) {
        let t = &locals[writer as usize].tensors[item as usize];
        if tensors.last().is_none_or(|d| d.key != t.key) {
            tensors.push(decl(t));
        }
        let w = &mut ranks[writer as usize];
        match slot.holders() {
            1 => singles[writer as usize].push(item),
            _ => w.tensors.push(item),
        }
        w.bytes = w.bytes.saturating_add(slot.nbytes);
        if !slot.replicas.is_empty() {
            let set =
                ReplicaSet { at: chunks.len() as u32, object: false, main: slot.main, replicas: slot.replicas.clone() };
            replicas.push(set);
        }
        chunks.push(ChunkPlan {
            key: t.key.clone(),
            dtype: t.dtype,
            region: t.region.clone(),
            nbytes: slot.nbytes,
            writer,
            holders: slot.holders() as u32,
        });
    }
    // File order: the chunks other ranks also hold first (see `file_order`).
    for (w, mut s) in ranks.iter_mut().zip(singles) {
        w.tensors.append(&mut s);
    }
    (chunks, replicas, tensors)
}

/// The objects with their writers (`writers[i]` is slot `i`'s), each added to its writer's
/// part of `ranks`; those several ranks hold, one of them compared, added to `sets`.
fn plan_objects<K>(
    locals: &[LocalPlan],
    slots: &[Slot<K>],
    writers: &[Holder],
    ranks: &mut [RankWrites],
    sets: &mut Vec<ReplicaSet>,
) -> Vec<ObjectPlan> {
    let mut objects = Vec::with_capacity(slots.len());
    // A rank's objects follow its tensors among its pieces.
    let piece = |&(rank, item): &Holder| (rank, locals[rank as usize].tensors.len() as u32 + item);
    let compared = |&(rank, item): &Holder| locals[rank as usize].objects[item as usize].compared;
    for (slot, &(writer, item)) in slots.iter().zip(writers) {
        let o = &locals[writer as usize].objects[item as usize];
        let w = &mut ranks[writer as usize];
        w.objects.push(item);
        w.bytes = w.bytes.saturating_add(slot.nbytes);
        if compared(&slot.main) || slot.replicas.iter().any(compared) {
            let (main, replicas) = (piece(&slot.main), slot.replicas.iter().map(piece).collect());
            sets.push(ReplicaSet { at: objects.len() as u32, object: true, main, replicas });
        }
        objects.push(ObjectPlan {
            key: o.object.key.clone(),
            grid_shape: o.object.grid_shape.clone(),
            grid_offset: o.object.grid_offset.clone(),
            nbytes: slot.nbytes,
            writer,
            holders: slot.holders() as u32,
        });
    }
    objects
}

/// Adds the declarations of the pieces without elements, whose keys alone can have no
/// chunk in a validated plan (an unvalidated preview declares only what it writes), keeping
/// `tensors` sorted by key, one per key.
fn declare_bare(locals: &[LocalPlan], tensors: &mut Vec<TensorDecl>) {
    let bare = locals.iter().flat_map(|l| &l.tensors).filter(|t| t.region.numel() == 0);
    let before = tensors.len();
    tensors.extend(bare.map(decl));
    if tensors.len() > before {
        tensors.sort_by(|a, b| a.key.cmp(&b.key));
        tensors.dedup_by(|a, b| a.key == b.key);
    }
}

fn decl(t: &ShardedTensor) -> TensorDecl {
    TensorDecl { key: t.key.clone(), dtype: t.dtype, global_shape: t.global_shape.clone() }
}

/// Where each planned chunk sits among its writer's pieces (tensor chunks, then objects):
/// a writer stores the chunks other ranks also hold first, then the ones only it holds,
/// each part in plan order. A load in the same layout then finds everything it needs from
/// another rank's file in one span at the file's start (one request on object stores).
pub(crate) fn file_order(plan: &SavePlan) -> (Vec<usize>, Vec<usize>) {
    let world = plan.ranks.len();
    let mut shared = vec![0usize; world];
    for c in plan.chunks.iter().filter(|c| c.holders > 1) {
        shared[c.writer as usize] += 1;
    }
    let (mut next_shared, mut next_single) = (vec![0usize; world], shared.clone());
    let chunks = plan
        .chunks
        .iter()
        .map(|c| {
            let next = if c.holders > 1 { &mut next_shared } else { &mut next_single };
            next[c.writer as usize] += 1;
            next[c.writer as usize] - 1
        })
        .collect();
    let mut next_object: Vec<usize> = plan.ranks.iter().map(|r| r.tensors.len()).collect();
    let objects = plan
        .objects
        .iter()
        .map(|o| {
            next_object[o.writer as usize] += 1;
            next_object[o.writer as usize] - 1
        })
        .collect();
    (chunks, objects)
}

/// A holder of a chunk: (rank, index in that rank's local plan).
type Holder = (u32, u32);

/// A distinct chunk (or object) being planned: its holders as (rank, local index), the main
/// one apart (most chunks have no other, and then nothing is allocated for them).
#[derive(Debug)]
struct Slot<K> {
    id: K,
    nbytes: u64,
    main: (u32, u32),
    replicas: Vec<(u32, u32)>,
}

impl<K> Slot<K> {
    fn holders(&self) -> usize {
        1 + self.replicas.len()
    }
}

/// One rank's piece as planning sees it.
struct Piece<K> {
    id: K,
    rank: u32,
    item: u32,
    main: bool,
    nbytes: u64,
    /// Holds no elements (a main piece without elements is not stored).
    empty: bool,
}

/// The distinct pieces with their holders, sorted by id: every main piece with elements
/// makes a slot, and the other pieces with its id are its replicas, each rank once.
/// Validation guarantees one main piece per id; an unvalidated preview makes a slot of every
/// main piece, as a naive save would write them all (replicas then go to the last).
fn slots<K: Ord + Copy + Hash>(pieces: impl Iterator<Item = Piece<K>>) -> Vec<Slot<K>> {
    let all: Vec<Piece<K>> = pieces.filter(|p| !(p.main && p.empty)).collect();
    // Grouping sorts integers, in linear time: one key per piece packs the top 63 bits of a
    // hash of its id and whether it is not main (mains first); its index in `all` rides
    // along. The sort is stable, so a run of one id lists its holders in input order: rank
    // and item order from the planner, checked, and sorted so where it is not. Equal ids
    // have equal hashes; ids that merely share one are sorted apart. Only the distinct slots
    // are sorted by id itself.
    let key = |p: &Piece<K>| ((quick_hash(p.id) >> 1) << 1) | u64::from(!p.main);
    let mut order: Vec<(u64, u32)> = all.iter().enumerate().map(|(i, p)| (key(p), i as u32)).collect();
    sort_by_u64(&mut order, |o| o.0);
    let mut out: Vec<Slot<K>> = Vec::with_capacity(order.len());
    let holder = |o: &(u64, u32)| (o.0, all[o.1 as usize].rank, all[o.1 as usize].item);
    for run in order.chunk_by_mut(|a, b| a.0 >> 1 == b.0 >> 1) {
        let id_of = |o: &(u64, u32)| all[o.1 as usize].id;
        if run.len() > 1 && run[1..].iter().any(|o| id_of(o) != id_of(&run[0])) {
            run.sort_unstable_by(|a, b| id_of(a).cmp(&id_of(b)).then(holder(a).cmp(&holder(b))));
        } else if !run.is_sorted_by_key(holder) {
            run.sort_unstable_by_key(holder);
        }
        let mut current: Option<(K, usize)> = None;
        for o in run.iter() {
            let p = &all[o.1 as usize];
            if p.main {
                current = Some((p.id, out.len()));
                out.push(Slot { id: p.id, nbytes: p.nbytes, main: (p.rank, p.item), replicas: Vec::new() });
            } else if let Some((_, i)) = current.filter(|(id, _)| *id == p.id) {
                // A rank that holds the same piece twice still writes it at most once.
                let slot = &mut out[i];
                if slot.main.0 != p.rank && slot.replicas.last().is_none_or(|h| h.0 != p.rank) {
                    slot.replicas.push((p.rank, p.item));
                }
            }
        }
    }
    // Into the callers' order first (integers, in linear time), then by id: callers list
    // their pieces mostly sorted already, and the stable sort merges such runs instead of
    // sorting afresh.
    sort_moving_by_u64(&mut out, |s| (u64::from(s.main.0) << 32) | u64::from(s.main.1));
    out.sort_by_key(|s| s.id);
    out
}

/// A fast, non-cryptographic hash (the Fx multiply-rotate scheme): only the speed of
/// grouping depends on it, never its result.
fn quick_hash(v: impl Hash) -> u64 {
    let mut h = Fx::default();
    v.hash(&mut h);
    h.finish()
}

/// The Fx hasher: for maps keyed by our own small integers, where SipHash's protection
/// against chosen keys buys nothing and costs most of the lookup.
#[derive(Default)]
pub(crate) struct Fx(u64);

/// Hash maps keyed by our own indices.
pub(crate) type FxMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<Fx>>;

impl Fx {
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.add(u64::from(v));
    }
    fn write_u64(&mut self, v: u64) {
        self.add(v);
    }
    fn write_usize(&mut self, v: usize) {
        self.add(v as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Writers (rank, local index) for tensor slots followed by object slots. An object is
/// written by its main copy whatever the assignment: its copies are one value, not always
/// one string of bytes (compared by a digest of a canonical form, or not at all), and the
/// metadata records the main copy's length (a shorter copy written in its place left
/// pieces that overlapped, and a checkpoint no reader would open).
fn assign<A, B>(tensors: &[Slot<A>], objects: &[Slot<B>], world: usize, assignment: Assignment) -> Vec<(u32, u32)> {
    let all: Vec<(u64, Holder, &[Holder])> = tensors
        .iter()
        .map(|s| (s.nbytes, s.main, s.replicas.as_slice()))
        .chain(objects.iter().map(|s| (s.nbytes, s.main, &[][..])))
        .collect();
    let replica0: Vec<(u32, u32)> = all.iter().map(|a| a.1).collect();
    if assignment == Assignment::Replica0 {
        return replica0;
    }
    // Largest first; the sort is stable, so equal sizes keep plan order.
    let mut order: Vec<usize> = (0..all.len()).collect();
    order.sort_by(|&a, &b| all[b].0.cmp(&all[a].0));
    let mut load = vec![0u64; world];
    let mut balanced = vec![(0u32, 0u32); all.len()];
    for i in order {
        let (nbytes, main, replicas) = all[i];
        let best = std::iter::once(main)
            .chain(replicas.iter().copied())
            .min_by_key(|(r, _)| (load[*r as usize], *r))
            .unwrap_or(main);
        // Saturating: the sizes are the ranks' word, checked only beside this.
        load[best.0 as usize] = load[best.0 as usize].saturating_add(nbytes);
        balanced[i] = best;
    }
    let max_of = |w: &[(u32, u32)]| {
        let mut l = vec![0u64; world];
        for (i, (r, _)) in w.iter().enumerate() {
            l[*r as usize] = l[*r as usize].saturating_add(all[i].0);
        }
        l.into_iter().max().unwrap_or(0)
    };
    if max_of(&balanced) <= max_of(&replica0) { balanced } else { replica0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An id whose hash is the same for every value: every piece lands in one run, so the
    /// run has to be sorted apart by id.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
    struct Colliding(u32);

    impl Hash for Colliding {
        fn hash<H: Hasher>(&self, _: &mut H) {}
    }

    fn piece(id: u32, rank: u32, main: bool) -> Piece<Colliding> {
        Piece { id: Colliding(id), rank, item: id, main, nbytes: u64::from(id) * 10, empty: false }
    }

    #[test]
    fn slots_group_ids_whose_hashes_collide() {
        let pieces = vec![
            piece(3, 2, false),
            piece(1, 0, true),
            piece(3, 0, true),
            piece(2, 1, true),
            piece(1, 2, false),
            piece(1, 1, false),
            piece(2, 1, false), // the main holder again: not a replica of itself
            piece(9, 1, false), // a replica of nothing stored
        ];
        let s = slots(pieces.into_iter());
        let got: Vec<_> = s.into_iter().map(|s| (s.id.0, s.nbytes, s.main, s.replicas)).collect();
        assert_eq!(
            got,
            vec![(1, 10, (0, 1), vec![(1, 1), (2, 1)]), (2, 20, (1, 2), vec![]), (3, 30, (0, 3), vec![(2, 3)])]
        );
    }
}
