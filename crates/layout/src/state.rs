//! Every rank's sharded state: parameters placed by the parallel layout, and optimizer
//! state sharded as the optimizer mode says.

use dckpt_shard_spec::{DType, Key, Region, ReplicaId, ShardedTensor};

use crate::model::{ParamDef, Split, optimizer_keys};
use crate::{Layout, OptimizerMode};

/// Chunk `index` of `count` equal chunks of `region` along `axis`.
///
/// The builder behind every sharded dimension: TP and ETP chunks, EP expert ranges, and
/// (with `2 * n` chunks) the two halves of a GLU weight.
pub fn chunk(region: &Region, axis: usize, index: u64, count: u64) -> Region {
    debug_assert!(index < count && region.shape[axis].is_multiple_of(count));
    let mut r = region.clone();
    let len = r.shape[axis] / count;
    r.offset[axis] += index * len;
    r.shape[axis] = len;
    r
}

/// The two pieces a rank holds of a GLU-canonical `[W; V]` weight split `n` ways along
/// `axis`: W at chunk `rank`, V at chunk `rank + n` of `2 * n`.
pub fn glu_chunks(region: &Region, axis: usize, rank: u64, n: u64) -> [Region; 2] {
    [chunk(region, axis, rank, 2 * n), chunk(region, axis, rank + n, 2 * n)]
}

/// A parameter as one rank holds it: one region, or two for a GLU weight (W, then V).
#[derive(Clone, Debug)]
pub struct LocalParam<'a> {
    /// The parameter as a whole.
    pub def: &'a ParamDef,
    /// The boxes of the global tensor this rank holds.
    pub regions: Vec<Region>,
    /// Which replica this rank's copy is; main on exactly one rank per box.
    pub replica_id: ReplicaId,
}

impl LocalParam<'_> {
    /// Elements this rank holds of the parameter, over all its regions.
    pub fn numel(&self) -> u64 {
        self.regions.iter().map(Region::numel).sum()
    }
}

/// The parameters `rank` holds, in `params` order (sorted by key within a stage).
pub fn local_params<'a>(params: &'a [ParamDef], layout: &Layout, rank: u32) -> Vec<LocalParam<'a>> {
    let (d, e) = (layout.dense_coord(rank), layout.expert_coord(rank));
    let c = layout.config;
    let dp_entry = layout.dp_cp_rank(rank);
    params
        .iter()
        .filter(|p| p.stage == d.pp)
        .map(|p| {
            let full = Region::full(&p.shape);
            let (regions, tp_entry, dp) = match p.split {
                Split::Replicated => (vec![full], d.tp, dp_entry),
                Split::Tp { axis } => (vec![chunk(&full, axis, d.tp as u64, c.tp as u64)], 0, dp_entry),
                Split::GluTp { axis } => (glu_chunks(&full, axis, d.tp as u64, c.tp as u64).to_vec(), 0, dp_entry),
                Split::Expert { axis, glu } => {
                    let experts = chunk(&full, 0, e.ep as u64, c.ep as u64);
                    match axis {
                        None => (vec![experts], e.etp, e.edp),
                        Some(ax) if glu => (glu_chunks(&experts, ax, e.etp as u64, c.etp as u64).to_vec(), 0, e.edp),
                        Some(ax) => (vec![chunk(&experts, ax, e.etp as u64, c.etp as u64)], 0, e.edp),
                    }
                }
            };
            LocalParam { def: p, regions, replica_id: ReplicaId::new(p.pp_copy, tp_entry, dp) }
        })
        .collect()
}

/// The full sharded state of `rank`: its parameters, then its optimizer state.
pub fn rank_state(
    params: &[ParamDef],
    layout: &Layout,
    dtype: DType,
    optimizer: OptimizerMode,
    rank: u32,
) -> Vec<ShardedTensor> {
    let local = local_params(params, layout, rank);
    let mut out = Vec::new();
    for lp in &local {
        for r in &lp.regions {
            out.push(piece(lp.def.key.clone(), dtype, lp, r.clone(), lp.replica_id));
        }
    }
    match optimizer {
        OptimizerMode::None => {}
        OptimizerMode::Adam => {
            for lp in &local {
                for r in &lp.regions {
                    push_state(&mut out, lp, r.clone(), lp.replica_id);
                }
            }
        }
        OptimizerMode::Distributed => {
            for (members, group_rank, group) in groups(layout, rank, &local) {
                distributed(&mut out, &group, members, group_rank);
            }
        }
        OptimizerMode::Layerwise => {
            for (members, group_rank, group) in groups(layout, rank, &local) {
                layerwise(&mut out, &group, members, group_rank);
            }
        }
    }
    out
}

/// The optimizer groups of a rank: (group size, rank in group, its local parameters) for
/// the non-expert DP x CP group and the expert-DP group.
fn groups<'a, 'b>(layout: &Layout, rank: u32, local: &'b [LocalParam<'a>]) -> [(u64, u64, Vec<&'b LocalParam<'a>>); 2] {
    let (dense, expert): (Vec<_>, Vec<_>) = local.iter().partition(|lp| !lp.def.is_expert());
    [
        (layout.dp_cp_size() as u64, layout.dp_cp_rank(rank) as u64, dense),
        (layout.expert_dp as u64, layout.expert_coord(rank).edp as u64, expert),
    ]
}

/// ZeRO-1: the group's boxes concatenated in canonical order (keys sorted, GLU W then V),
/// padded to a multiple of the group size and split evenly; this rank's slice cut back
/// into flat ranges of the boxes. Padding is never part of a region.
fn distributed(out: &mut Vec<ShardedTensor>, group: &[&LocalParam<'_>], members: u64, group_rank: u64) {
    let total: u64 = group.iter().map(|lp| lp.numel()).sum();
    let slice = total.div_ceil(members);
    let (lo, hi) = (group_rank * slice, ((group_rank + 1) * slice).min(total));
    let mut start = 0u64;
    for lp in group {
        for r in &lp.regions {
            let (b_lo, b_hi) = (start, start + r.numel());
            start = b_hi;
            let (s, e) = (lo.max(b_lo), hi.min(b_hi));
            if s < e {
                let narrowed = r.clone().narrowed(s - b_lo, e - b_lo);
                push_state(out, lp, narrowed, owner_replica(lp));
            }
        }
    }
}

/// Layer-wise: the group's parameters sorted by local size (largest first, ties by key),
/// dealt out in snake order; a rank keeps whole state for the parameters dealt to it.
fn layerwise(out: &mut Vec<ShardedTensor>, group: &[&LocalParam<'_>], members: u64, group_rank: u64) {
    let mut order: Vec<&&LocalParam<'_>> = group.iter().collect();
    order.sort_by(|a, b| b.numel().cmp(&a.numel()).then_with(|| a.def.key.cmp(&b.def.key)));
    for (i, lp) in order.into_iter().enumerate() {
        if snake_owner(i as u64, members) == group_rank {
            for r in &lp.regions {
                push_state(out, lp, r.clone(), owner_replica(lp));
            }
        }
    }
}

/// The group rank that receives the `i`-th item dealt 0, 1, .., n-1, n-1, .., 0, 0, 1, ...
pub fn snake_owner(i: u64, n: u64) -> u64 {
    let (round, pos) = (i / n, i % n);
    if round % 2 == 0 { pos } else { n - 1 - pos }
}

/// Optimizer state owned by one rank of the group keeps the parameter's (pp_copy, tp)
/// entries, so TP-replicated parameters and the tied copy stay non-main where it is.
fn owner_replica(lp: &LocalParam<'_>) -> ReplicaId {
    ReplicaId::new(lp.replica_id.pp_copy, lp.replica_id.tp, 0)
}

fn push_state(out: &mut Vec<ShardedTensor>, lp: &LocalParam<'_>, region: Region, replica: ReplicaId) {
    for key in optimizer_keys(&lp.def.key) {
        out.push(piece(key.into(), DType::F32, lp, region.clone(), replica));
    }
}

fn piece(key: Key, dtype: DType, lp: &LocalParam<'_>, region: Region, replica_id: ReplicaId) -> ShardedTensor {
    ShardedTensor { key, dtype, global_shape: lp.def.shape.clone(), region, replica_id }
}
