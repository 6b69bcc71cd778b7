//! Save planning over the reference model: the two field bugs pinned, empty ranks as the
//! normal path, and properties over random layouts.

use dckpt_engine::{Assignment, Error, ErrorKind, LocalPlan, ObjectItem, SavePlan, plan_save};
use dckpt_layout::{Layout, ModelSpec, OptimizerMode, ParallelConfig, ReferenceModel};
use dckpt_shard_spec::{DType, Problem, Region, ReplicaId, ShardedObject, ShardedTensor, TensorDecl};
use proptest::prelude::*;

fn model(preset: &str, world: u32, c: ParallelConfig, opt: OptimizerMode) -> ReferenceModel {
    let layout = Layout::new(c, world).unwrap();
    ReferenceModel::new(ModelSpec::preset(preset).unwrap(), layout, opt).unwrap()
}

fn locals(m: &ReferenceModel) -> Vec<LocalPlan> {
    (0..m.layout.world_size).map(|r| LocalPlan { tensors: m.rank_state(r), objects: Vec::new() }).collect()
}

fn plan(m: &ReferenceModel, locals: &[LocalPlan], a: Assignment) -> Result<SavePlan, Error> {
    plan_save(locals, Some(&m.declared_tensors()), a)
}

fn problems(r: Result<SavePlan, Error>) -> Vec<Problem> {
    match r.map_err(Error::into_kind) {
        Err(ErrorKind::InvalidState { error: e }) => e.problems,
        Ok(_) => panic!("expected the plan to be rejected"),
        Err(e) => panic!("unexpected error {e}"),
    }
}

fn cfg(tp: u32, pp: u32, cp: u32, ep: u32, etp: u32) -> ParallelConfig {
    ParallelConfig { tp, pp, cp, ep, etp }
}

/// Bytes of the full expert weights of `spec`, with fp32 Adam state on top when `opt`.
fn full_expert_bytes(spec: &ModelSpec, opt: OptimizerMode) -> u64 {
    let moe_layers = (0..spec.num_layers).filter(|&i| spec.is_moe_layer(i)).count() as u64;
    let (e, h, fe) = (spec.num_experts, spec.hidden_size, spec.moe_ffn());
    let numel = moe_layers * (e * 2 * fe * h + e * h * fe);
    numel * spec.dtype.size() + if opt == OptimizerMode::None { 0 } else { 12 * numel }
}

// The ETP replica-id bug: only one ETP shard of each expert tensor was written, so
// checkpoints were 1/ETP of their size. The plan stores the full expert bytes at every ETP.
#[test]
fn etp_replica_ids_cover_every_shard() {
    for etp in [2, 4, 8] {
        for opt in [OptimizerMode::None, OptimizerMode::Distributed, OptimizerMode::Layerwise] {
            let m = model("moe-small", 32, cfg(2, 2, 1, 2, etp), opt);
            let p = plan(&m, &locals(&m), Assignment::Balanced).unwrap();
            let expert: u64 = p.chunks.iter().filter(|c| c.key.contains("mlp.experts.")).map(|c| c.nbytes).sum();
            assert_eq!(expert, full_expert_bytes(&m.spec, opt), "etp {etp}, {opt}");
            assert_eq!(p.total_bytes(), m.expected_bytes(), "etp {etp}, {opt}");
        }
    }
}

/// Rewrites the expert pieces of ranks whose ETP coordinate is not 0.
fn break_etp(m: &ReferenceModel, f: impl Fn(&mut ShardedTensor, u32)) -> Vec<LocalPlan> {
    let mut l = locals(m);
    for (rank, lp) in l.iter_mut().enumerate() {
        let etp = m.layout.expert_coord(rank as u32).etp;
        for t in lp.tensors.iter_mut().filter(|t| t.key.contains("mlp.experts.") && etp != 0) {
            f(t, etp);
        }
    }
    l
}

// Non-zero ETP ranks described as replicas: their shards would silently not be written.
#[test]
fn etp_ranks_marked_non_main_are_rejected() {
    let m = model("moe-small", 16, cfg(2, 1, 1, 2, 4), OptimizerMode::None);
    let bad = break_etp(&m, |t, etp| t.replica_id.tp = etp);
    let p = problems(plan(&m, &bad, Assignment::Balanced));
    assert!(!p.is_empty());
    for pr in &p {
        let Problem::Gap { key, covered, total, .. } = pr else { panic!("expected a gap, got {pr}") };
        assert!(key.contains("mlp.experts.linear_fc"), "{pr}");
        assert_eq!(covered * 4, *total, "{pr}");
        assert!(pr.to_string().contains(key.as_str()));
    }
}

// The ETP coordinate dropped from the region: every ETP rank claims ETP chunk 0 as main.
#[test]
fn etp_coordinate_dropped_from_region_is_rejected() {
    let m = model("moe-small", 16, cfg(2, 1, 1, 2, 4), OptimizerMode::None);
    let etp_chunk = m.spec.moe_ffn() / 4;
    let bad = break_etp(&m, |t, etp| {
        let axis = if t.key.contains("linear_fc1") { 1 } else { 2 };
        t.region.offset[axis] -= etp as u64 * etp_chunk;
    });
    let p = problems(plan(&m, &bad, Assignment::Balanced));
    assert!(p.iter().all(|pr| matches!(pr, Problem::DuplicateMain { key, ranks, .. } if key.contains("mlp.experts.") && ranks.len() == 4)), "{p:?}");
}

// Global shapes consistently wrong: each EP rank describes its own experts as the whole
// tensor and the other EP ranks as replicas. Coverage alone passes; the model's
// declaration catches it.
#[test]
fn consistently_wrong_global_shapes_fail_the_declaration_check() {
    let m = model("tiny", 4, cfg(1, 1, 1, 2, 1), OptimizerMode::None);
    let mut l = locals(&m);
    for (rank, lp) in l.iter_mut().enumerate() {
        let ep = m.layout.expert_coord(rank as u32).ep;
        for t in lp.tensors.iter_mut().filter(|t| t.key.contains("mlp.experts.")) {
            t.global_shape[0] /= 2;
            t.region.offset[0] = 0;
            t.replica_id.dp += ep * 100;
        }
    }
    assert!(plan_save(&l, None, Assignment::Balanced).is_ok(), "coverage alone cannot see it");
    let p = problems(plan(&m, &l, Assignment::Balanced));
    assert!(
        !p.is_empty()
            && p.iter()
                .all(|pr| matches!(pr, Problem::DeclarationMismatch { key, .. } if key.contains("mlp.experts."))),
        "{p:?}"
    );
}

// The layerwise empty-rank bug: ranks that own no optimizer state broke saving. Here they
// plan like any other rank, and under replica0 (where they write nothing) are listed.
#[test]
fn layerwise_empty_ranks_plan_validate_and_balance() {
    let m = model("tiny", 64, cfg(1, 4, 1, 1, 1), OptimizerMode::Layerwise);
    let l = locals(&m);
    let owns_state = |r: usize| l[r].tensors.iter().any(|t| t.key.starts_with("optimizer."));
    let stateless: Vec<usize> = (0..64).filter(|&r| !owns_state(r)).collect();
    assert!(stateless.len() >= 16, "the layout must leave many DP ranks without optimizer state");

    let r0 = plan(&m, &l, Assignment::Replica0).unwrap();
    let balanced = plan(&m, &l, Assignment::Balanced).unwrap();
    for p in [&r0, &balanced] {
        assert_eq!(p.total_bytes(), m.expected_bytes());
    }
    let empty = r0.empty_ranks();
    // Under replica0 a rank writes iff it holds a main piece.
    let expect: Vec<u32> = (0..64u32).filter(|&r| !l[r as usize].tensors.iter().any(|t| t.is_main())).collect();
    assert_eq!(empty, expect);
    assert!(stateless.iter().filter(|&&r| r % 16 != 0).all(|&r| empty.contains(&(r as u32))));
    assert!(balanced.max_rank_bytes() <= r0.max_rank_bytes());
    assert!(balanced.empty_ranks().len() < empty.len(), "balancing spreads replicated parameters");
}

// The coordinator itself holding nothing is the ordinary path too.
#[test]
fn coordinator_with_nothing_plans() {
    let piece = |i: u64, dp: u32| ShardedTensor {
        key: "w".into(),
        dtype: DType::Bf16,
        global_shape: vec![6, 4].into(),
        region: Region::boxed(vec![2 * i, 0], vec![2, 4]),
        replica_id: ReplicaId::new(0, 0, dp),
    };
    let mut l = vec![LocalPlan::default()];
    for i in 0..3 {
        l.push(LocalPlan { tensors: vec![piece(i, 0)], objects: Vec::new() });
    }
    l.push(LocalPlan { tensors: vec![piece(0, 1)], objects: Vec::new() });
    let decl = [TensorDecl { key: "w".into(), dtype: DType::Bf16, global_shape: vec![6, 4].into() }];
    for a in [Assignment::Balanced, Assignment::Replica0] {
        let p = plan_save(&l, Some(&decl), a).unwrap();
        assert_eq!(p.total_bytes(), 48);
        assert_eq!(p.ranks[0].bytes, 0);
        assert!(p.empty_ranks().contains(&0));
        assert_eq!(p.chunks.len(), 3);
    }
    // Nobody holds anything at all: still a plan, with every rank empty.
    let none = plan_save(&vec![LocalPlan::default(); 4], Some(&[]), Assignment::Balanced).unwrap();
    assert_eq!(none.empty_ranks(), vec![0, 1, 2, 3]);
}

#[test]
fn balanced_spreads_replicas_deterministically() {
    let m = model("gpt-small", 8, cfg(2, 1, 1, 1, 1), OptimizerMode::Adam);
    let l = locals(&m);
    let a = plan(&m, &l, Assignment::Balanced).unwrap();
    let b = plan(&m, &l, Assignment::Balanced).unwrap();
    assert_eq!(a, b);
    let r0 = plan(&m, &l, Assignment::Replica0).unwrap();
    assert!(a.max_rank_bytes() < r0.max_rank_bytes());
    // With 4 DP replicas of everything, balanced writes are within one largest chunk.
    let largest = a.chunks.iter().map(|c| c.nbytes).max().unwrap();
    let min = a.ranks.iter().map(|r| r.bytes).min().unwrap();
    assert!(a.max_rank_bytes() - min <= largest);
}

/// Checks that rank `rank`'s pieces agree with its coordinates.
fn consistent_with_coordinates(m: &ReferenceModel, rank: u32, state: &[ShardedTensor]) -> Result<(), String> {
    let (d, e) = (m.layout.dense_coord(rank), m.layout.expert_coord(rank));
    let c = m.layout.config;
    let per_stage = m.spec.num_layers / c.pp as u64;
    for t in state {
        let param_key =
            t.key.rsplit_once("optimizer.state.").map_or(t.key.as_str(), |(_, k)| k.split_once('.').unwrap().1);
        if let Some(rest) = param_key.strip_prefix("decoder.layers.") {
            let layer: u64 = rest.split('.').next().unwrap().parse().unwrap();
            if layer / per_stage != d.pp as u64 {
                return Err(format!("rank {rank} (pp {}) holds {}", d.pp, t.key));
            }
        }
        let dp_entry = t.replica_id.dp;
        // Sharded optimizers own their state on one group rank: DP entry 0. Adam copies the parameter's.
        let is_opt = t.key.starts_with("optimizer.") && m.optimizer != OptimizerMode::Adam;
        if param_key.contains("mlp.experts.") {
            let le = t.global_shape[0] / c.ep as u64;
            if t.region.offset[0] != e.ep as u64 * le || t.region.shape[0] != le {
                return Err(format!("rank {rank} (ep {}) holds {} at {}", e.ep, t.key, t.region));
            }
            if !is_opt && dp_entry != e.edp {
                return Err(format!("rank {rank} {} dp entry {dp_entry} != edp {}", t.key, e.edp));
            }
        } else if !is_opt && dp_entry != m.layout.dp_cp_rank(rank) {
            return Err(format!("rank {rank} {} dp entry {dp_entry}", t.key));
        }
        if param_key.ends_with("linear_proj.weight")
            || param_key.ends_with("linear_fc2.weight") && !param_key.contains("experts")
        {
            let w = t.global_shape[1] / c.tp as u64;
            if t.region.offset[1] != d.tp as u64 * w {
                return Err(format!("rank {rank} (tp {}) holds {} at {}", d.tp, t.key, t.region));
            }
        }
        if param_key.ends_with("layer_norm_weight") && t.replica_id.tp != d.tp {
            return Err(format!("rank {rank} {} tp entry {}", t.key, t.replica_id.tp));
        }
        if is_opt && dp_entry != 0 {
            return Err(format!("optimizer state {} on rank {rank} has dp entry {dp_entry}", t.key));
        }
    }
    Ok(())
}

fn tiny_layouts() -> impl Strategy<Value = (u32, ParallelConfig, OptimizerMode)> {
    (
        prop::sample::select(vec![1u32, 2, 4]),
        prop::sample::select(vec![1u32, 2, 4]),
        prop::sample::select(vec![1u32, 2]),
        prop::sample::select(vec![1u32, 2, 4]),
        prop::sample::select(vec![1u32, 2, 4, 8]),
        1u32..4,
        prop::sample::select(OptimizerMode::ALL.to_vec()),
    )
        .prop_map(|(tp, pp, cp, ep, etp, mult, opt)| {
            let c = cfg(tp, pp, cp, ep, etp);
            let a = (tp * pp * cp) as u64;
            let b = (etp * ep * pp) as u64;
            let lcm = a / gcd(a, b) * b;
            ((lcm * mult as u64) as u32, c, opt)
        })
        .prop_filter("at most 128 ranks", |(w, _, _)| *w <= 128)
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_tiny_layouts_plan_exactly((world, c, opt) in tiny_layouts()) {
        let m = model("tiny", world, c, opt);
        let l = locals(&m);
        for r in 0..world {
            prop_assert_eq!(consistent_with_coordinates(&m, r, &l[r as usize].tensors), Ok(()));
        }
        let r0 = plan(&m, &l, Assignment::Replica0).unwrap();
        let bal = plan(&m, &l, Assignment::Balanced).unwrap();
        prop_assert_eq!(r0.total_bytes(), m.expected_bytes());
        prop_assert_eq!(bal.total_bytes(), m.expected_bytes());
        prop_assert!(bal.max_rank_bytes() <= r0.max_rank_bytes());
        prop_assert_eq!(r0.chunks.len(), bal.chunks.len());
        // Every chunk's writer really holds it.
        for ch in &bal.chunks {
            let held = l[ch.writer as usize].tensors.iter().any(|t| t.key == ch.key && t.region == ch.region);
            prop_assert!(held, "rank {} does not hold {} {}", ch.writer, ch.key, ch.region);
        }
    }
}

/// The sizes in the ranks' plans are their word: objects of 2^63 bytes on three ranks (a
/// damaged or hostile message) make a plan or an error, never an overflow panic in the
/// writers' byte counts, with either assignment.
#[test]
fn sizes_that_overflow_when_added_are_planned_without_a_panic() {
    let huge = |rank: u32| LocalPlan {
        tensors: vec![ShardedTensor::whole("w", DType::F32, [2]).replica([0, 0, rank])],
        objects: vec![ObjectItem {
            object: ShardedObject::single(format!("o{rank}")),
            nbytes: 1 << 63,
            compared: true,
        }],
    };
    let locals = [huge(0), huge(1), huge(2)];
    for a in [Assignment::Balanced, Assignment::Replica0] {
        let plan = plan_save(&locals, None, a).expect("a plan: nothing here is invalid");
        assert_eq!(plan.total_bytes(), u64::MAX, "{a:?}");
        assert_eq!(dckpt_engine::preview_save(&locals, a).total_bytes(), u64::MAX);
    }
}
