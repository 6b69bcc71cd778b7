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

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use dckpt_shard_spec::{
    Coverage, DType, ObjectPiece, Region, ShardedObject, ShardedTensor, TensorDecl, TensorPiece, validate,
};
use serde::{Deserialize, Serialize};

use crate::Error;

/// How writers are chosen among the holders of a chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Assignment {
    /// Spread replicated chunks over their holders to even out per-rank bytes.
    #[default]
    Balanced,
    /// The main replica writes.
    Replica0,
}

impl Assignment {
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
    pub object: ShardedObject,
    pub nbytes: u64,
}

/// What one rank holds, as metadata: the input to planning.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalPlan {
    pub tensors: Vec<ShardedTensor>,
    pub objects: Vec<ObjectItem>,
}

/// A distinct stored chunk and the rank that writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkPlan {
    pub key: String,
    pub dtype: DType,
    pub global_shape: Vec<u64>,
    pub region: Region,
    pub nbytes: u64,
    pub writer: u32,
    /// How many ranks hold an identical copy (the writer among them).
    pub holders: u32,
}

/// A distinct stored object and the rank that writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectPlan {
    pub key: String,
    pub grid_shape: Vec<u64>,
    pub grid_offset: Vec<u64>,
    pub nbytes: u64,
    pub writer: u32,
    pub holders: u32,
}

/// What one rank writes under a plan.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankWrites {
    /// Indices into the rank's `LocalPlan::tensors`, in file order: the chunks other ranks
    /// also hold first, then the rest, each part in plan order ([`file_order`]).
    pub tensors: Vec<u32>,
    /// Indices into the rank's `LocalPlan::objects`.
    pub objects: Vec<u32>,
    pub bytes: u64,
}

impl RankWrites {
    pub fn chunks(&self) -> usize {
        self.tensors.len() + self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks() == 0
    }
}

/// The global save plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavePlan {
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
    pub coverage: Coverage,
}

impl SavePlan {
    pub fn world_size(&self) -> u32 {
        self.ranks.len() as u32
    }

    /// Bytes written by all ranks together.
    pub fn total_bytes(&self) -> u64 {
        self.ranks.iter().map(|r| r.bytes).sum()
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
/// Fails with [`Error::InvalidState`] naming every key, region and rank at fault when
/// coverage or the declaration check fails; nothing is planned then.
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
    let coverage = validate(&tensor_pieces, &object_pieces, declared).map_err(Error::InvalidState)?;
    Ok(SavePlan { coverage, ..assign_writers(locals, assignment) })
}

/// What a save of an *unvalidated* state would write: the same writer assignment without
/// the coverage proof. For reporting on a state that [`plan_save`] rejected (how many bytes
/// a naive save would have stored); never write from it.
pub fn preview_save(locals: &[LocalPlan], assignment: Assignment) -> SavePlan {
    assign_writers(locals, assignment)
}

fn assign_writers(locals: &[LocalPlan], assignment: Assignment) -> SavePlan {
    // Distinct chunks are the main pieces; holders are every rank with the same key and region.
    let mut tensor_slots = Slots::default();
    for (rank, l) in locals.iter().enumerate() {
        for (i, t) in l.tensors.iter().enumerate() {
            if t.is_main() && t.region.numel() > 0 {
                tensor_slots.add_main((t.key.as_str(), &t.region), rank as u32, i as u32, t.nbytes());
            }
        }
    }
    let mut object_slots = Slots::default();
    for (rank, l) in locals.iter().enumerate() {
        for (i, o) in l.objects.iter().enumerate() {
            if o.object.is_main() {
                object_slots.add_main((o.object.key.as_str(), &o.object.grid_offset), rank as u32, i as u32, o.nbytes);
            }
        }
    }
    for (rank, l) in locals.iter().enumerate() {
        for (i, t) in l.tensors.iter().enumerate() {
            tensor_slots.add_replica((t.key.as_str(), &t.region), rank as u32, i as u32, t.is_main());
        }
        for (i, o) in l.objects.iter().enumerate() {
            object_slots.add_replica(
                (o.object.key.as_str(), &o.object.grid_offset),
                rank as u32,
                i as u32,
                o.object.is_main(),
            );
        }
    }
    let tensor_slots = tensor_slots.into_sorted();
    let object_slots = object_slots.into_sorted();

    let world = locals.len();
    let writers = assign(&tensor_slots, &object_slots, world, assignment);
    let (tw, ow) = writers.split_at(tensor_slots.len());

    let mut ranks = vec![RankWrites::default(); world];
    let mut chunks = Vec::with_capacity(tensor_slots.len());
    let mut singles: Vec<Vec<u32>> = vec![Vec::new(); world];
    for (slot, &(writer, item)) in tensor_slots.iter().zip(tw) {
        let t = &locals[writer as usize].tensors[item as usize];
        let w = &mut ranks[writer as usize];
        match slot.holders() {
            1 => singles[writer as usize].push(item),
            _ => w.tensors.push(item),
        }
        w.bytes += slot.nbytes;
        chunks.push(ChunkPlan {
            key: t.key.clone(),
            dtype: t.dtype,
            global_shape: t.global_shape.clone(),
            region: t.region.clone(),
            nbytes: slot.nbytes,
            writer,
            holders: slot.holders() as u32,
        });
    }
    for (w, mut s) in ranks.iter_mut().zip(singles) {
        w.tensors.append(&mut s);
    }
    let mut objects = Vec::with_capacity(object_slots.len());
    for (slot, &(writer, item)) in object_slots.iter().zip(ow) {
        let o = &locals[writer as usize].objects[item as usize];
        let w = &mut ranks[writer as usize];
        w.objects.push(item);
        w.bytes += slot.nbytes;
        objects.push(ObjectPlan {
            key: o.object.key.clone(),
            grid_shape: o.object.grid_shape.clone(),
            grid_offset: o.object.grid_offset.clone(),
            nbytes: slot.nbytes,
            writer,
            holders: slot.holders() as u32,
        });
    }
    // One declaration per key: the first holder's (in rank order) dtype and shape.
    let mut decls: Vec<&ShardedTensor> = locals.iter().flat_map(|l| &l.tensors).collect();
    decls.sort_by(|a, b| a.key.cmp(&b.key));
    decls.dedup_by(|a, b| a.key == b.key);
    let mut tensors: Vec<TensorDecl> = decls
        .into_iter()
        .map(|t| TensorDecl { key: t.key.clone(), dtype: t.dtype, global_shape: t.global_shape.clone() })
        .collect();
    tensors.sort_unstable();
    SavePlan { assignment, chunks, objects, tensors, ranks, coverage: Coverage::default() }
}

/// Where each planned chunk sits among its writer's pieces (tensor chunks, then objects):
/// a writer stores the chunks other ranks also hold first, then the ones only it holds,
/// each part in plan order. A load in the same layout then finds everything it needs from
/// another rank's file in one span at the file's start (one request on object stores).
pub fn file_order(plan: &SavePlan) -> (Vec<usize>, Vec<usize>) {
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

#[derive(Debug)]
struct Slots<K> {
    index: HashMap<K, usize>,
    slots: Vec<Slot<K>>,
}

impl<K> Default for Slots<K> {
    fn default() -> Self {
        Slots { index: HashMap::new(), slots: Vec::new() }
    }
}

impl<K: std::hash::Hash + Eq + Ord + Copy> Slots<K> {
    fn add_main(&mut self, id: K, rank: u32, item: u32, nbytes: u64) {
        // Validation guarantees one main holder per id; an unvalidated preview counts
        // every main holder, as a naive save would write them all.
        self.index.insert(id, self.slots.len());
        self.slots.push(Slot { id, nbytes, main: (rank, item), replicas: Vec::new() });
    }

    fn add_replica(&mut self, id: K, rank: u32, item: u32, is_main: bool) {
        if is_main {
            return;
        }
        if let Some(&i) = self.index.get(&id) {
            let slot = &mut self.slots[i];
            // A rank that holds the same piece twice still writes it at most once.
            if slot.main.0 != rank && !slot.replicas.iter().any(|h| h.0 == rank) {
                slot.replicas.push((rank, item));
            }
        }
    }

    fn into_sorted(self) -> Vec<Slot<K>> {
        let mut s = self.slots;
        s.sort_unstable_by_key(|a| a.id);
        s
    }
}

/// Writers (rank, local index) for tensor slots followed by object slots.
fn assign<A, B>(tensors: &[Slot<A>], objects: &[Slot<B>], world: usize, assignment: Assignment) -> Vec<(u32, u32)> {
    let all: Vec<(u64, Holder, &[Holder])> = tensors
        .iter()
        .map(|s| (s.nbytes, s.main, s.replicas.as_slice()))
        .chain(objects.iter().map(|s| (s.nbytes, s.main, s.replicas.as_slice())))
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
        load[best.0 as usize] += nbytes;
        balanced[i] = best;
    }
    let max_of = |w: &[(u32, u32)]| {
        let mut l = vec![0u64; world];
        for (i, (r, _)) in w.iter().enumerate() {
            l[*r as usize] += all[i].0;
        }
        l.into_iter().max().unwrap_or(0)
    };
    if max_of(&balanced) <= max_of(&replica0) { balanced } else { replica0 }
}
