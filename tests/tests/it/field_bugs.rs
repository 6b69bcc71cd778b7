//! The two field bugs dckpt exists for, as end-to-end regressions.

use std::sync::Arc;

use dckpt_engine::{
    Assignment, Engine, LoadOptions, LoadRequest, ObjectData, ObjectRequest, SaveOptions, SaveState, TensorData,
    TensorRequest, read_metadata_local,
};
use dckpt_layout::{ModelSpec, OptimizerMode::*};
use dckpt_reference::save_options;
use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedObject, ShardedTensor, TensorDecl};
use dckpt_tests::{Setup, load_and_check, memory, run_ranks, save_model, save_model_with};

// Megatron's ETP bug wrote only one ETP shard of each expert tensor: checkpoints 1/2,
// 1/4, 1/8 of their size. Here ETP 2, 4 and 8 store the full expert bytes and reload at ETP 1.
#[test]
fn etp_saves_hold_full_expert_bytes_and_reload_at_etp_1() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let moe_layers = (0..spec.num_layers).filter(|&i| spec.is_moe_layer(i)).count() as u64;
    let (e, h, fe) = (spec.num_experts, spec.hidden_size, spec.moe_ffn());
    let expert_numel = moe_layers * (e * 2 * fe * h + e * h * fe);
    for etp in [2, 4, 8] {
        let store = memory();
        let m = Setup::new(2 * etp, 1, 1, 1, 2, etp, Layerwise).model(&spec);
        assert!(save_model(&store, &m, etp as u64).iter().all(|o| o.is_ok()), "etp {etp}");
        let meta = read_metadata_local(store.as_ref()).unwrap();
        let stored: u64 = meta
            .tensors
            .iter()
            .filter(|t| t.key.contains("mlp.experts."))
            .flat_map(|t| t.chunks.iter().map(move |c| c.region().numel() * t.dtype.size()))
            .sum();
        assert_eq!(stored, expert_numel * (2 + 12), "etp {etp}: expert weights and their fp32 state");
        let back = Setup::new(2, 1, 1, 1, 2, 1, Layerwise).model(&spec);
        for r in load_and_check(&store, &back, etp as u64) {
            r.unwrap_or_else(|err| panic!("etp {etp}: {err}"));
        }
    }
}

// Megatron's layerwise optimizer failed to save when DP ranks owned nothing. Here a save
// where most ranks write nothing commits, and reloads at other DP sizes.
#[test]
fn layerwise_save_with_many_empty_ranks_commits_and_reloads() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(64, 1, 4, 1, 1, 1, Layerwise).model(&spec);
    let store = memory();
    let opts = SaveOptions { assignment: Assignment::Replica0, ..save_options(&m) };
    let outcomes: Vec<_> = save_model_with(&store, &m, 5, &opts).into_iter().map(|o| o.unwrap()).collect();
    let empty = outcomes.iter().filter(|o| o.rank_bytes == 0).count();
    assert!(empty >= 16, "only {empty} of 64 ranks wrote nothing");
    assert!(outcomes.iter().all(|o| o.save_id == outcomes[0].save_id && o.bytes == m.expected_bytes()));
    for to in [Setup::new(4, 1, 1, 1, 1, 1, Layerwise), Setup::new(12, 1, 2, 1, 1, 1, Distributed)] {
        for r in load_and_check(&store, &to.model(&spec), 5) {
            r.unwrap_or_else(|e| panic!("{to:?}: {e}"));
        }
    }
}

fn piece(rows: std::ops::Range<u64>, dp: u32) -> ShardedTensor {
    ShardedTensor {
        key: "w".into(),
        dtype: DType::I32,
        global_shape: vec![6, 4].into(),
        region: Region::boxed(vec![rows.start, 0], vec![rows.end - rows.start, 4]),
        replica_id: ReplicaId::new(0, 0, dp),
    }
}

fn values(rows: std::ops::Range<u64>) -> Vec<u8> {
    (rows.start * 4..rows.end * 4).flat_map(|i| (i as i32 * 7 - 3).to_le_bytes()).collect()
}

// The coordinator itself holding nothing at all is the ordinary path too.
#[test]
fn coordinator_with_nothing_commits_and_reloads() {
    let store = memory();
    let decl = vec![TensorDecl { key: "w".into(), dtype: DType::I32, global_shape: vec![6, 4].into() }];
    let rng = ShardedObject { key: "rng".into(), grid_shape: vec![], grid_offset: vec![], replica_id: ReplicaId::MAIN };
    let outcomes = run_ranks(4, |r, c| {
        let engine = Engine::new(c);
        // Rank 0 holds nothing; ranks 1-3 hold two rows each; rank 3 also a replica of rows 0-2 and an object.
        let mine: Vec<(ShardedTensor, Vec<u8>)> = match r {
            0 => vec![],
            3 => vec![(piece(4..6, 0), values(4..6)), (piece(0..2, 1), values(0..2))],
            _ => vec![(piece(2 * (r as u64 - 1)..2 * r as u64, 0), values(2 * (r as u64 - 1)..2 * r as u64))],
        };
        let blob = b"rng-state".to_vec();
        let state = SaveState {
            tensors: mine.iter().map(|(t, d)| TensorData { tensor: t.clone(), data: d }).collect(),
            objects: if r == 3 {
                vec![ObjectData { object: rng.clone(), data: &blob, compare: Default::default() }]
            } else {
                vec![]
            },
        };
        let opts = SaveOptions { declared: Some(decl.clone()), assignment: Assignment::Replica0, ..Default::default() };
        engine.save(store.as_ref(), &state, &opts)
    });
    let outcomes: Vec<_> = outcomes.into_iter().map(|o| o.unwrap()).collect();
    assert_eq!(outcomes[0].rank_bytes, 0);
    assert_eq!(outcomes[0].bytes, 6 * 4 * 4 + 9);

    // Reload on 2 ranks, 3 rows each, and the object on rank 1.
    let loaded = run_ranks(2, |r, c| {
        let engine = Engine::new(c);
        let rows = 3 * r as u64..3 * r as u64 + 3;
        let mut buf = vec![0u8; 48];
        let mut req = LoadRequest {
            tensors: vec![TensorRequest {
                tensor: piece(rows.clone(), 0),
                data: &mut buf,
                allow_shape_mismatch: false,
                allow_dtype_cast: false,
            }],
            objects: if r == 1 { vec![ObjectRequest { object: rng.clone(), data: Option::None }] } else { vec![] },
            check_objects: Option::None,
        };
        engine.load(store.as_ref(), &mut req, &LoadOptions::default()).unwrap();
        let obj = req.objects.first().and_then(|o| o.data.clone());
        (buf, values(rows), obj)
    });
    for (got, want, _) in &loaded {
        assert_eq!(got, want);
    }
    assert_eq!(loaded[1].2.as_deref(), Some(&b"rng-state"[..]));
}

#[test]
fn a_rank_with_a_wrong_buffer_fails_the_save_everywhere() {
    let store = memory();
    let outcomes = run_ranks(3, |r, c| {
        let engine = Engine::new(c);
        let rows = 2 * r as u64..2 * r as u64 + 2;
        let mut data = values(rows.clone());
        if r == 2 {
            data.pop();
        }
        let state = SaveState { tensors: vec![TensorData { tensor: piece(rows, 0), data: &data }], objects: vec![] };
        engine.save(store.as_ref(), &state, &SaveOptions::default())
    });
    for (r, o) in outcomes.iter().enumerate() {
        match o.as_ref().map_err(|e| (e, e.rank(), e.kind())) {
            Err((e, Some(2), dckpt_engine::ErrorKind::Request { detail, .. })) => {
                assert!(detail.contains("buffer has 31 bytes"), "rank {r}: {detail}");
                assert!(e.to_string().starts_with("rank 2: "), "rank {r}: {e}");
            }
            other => panic!("rank {r}: expected rank 2's request error, got {other:?}"),
        }
    }
    assert!(read_metadata_local(store.as_ref()).is_err());
    assert!(store.list("").unwrap().is_empty(), "nothing was written");
}

#[test]
fn a_second_save_to_a_committed_checkpoint_is_refused_unless_replacing() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(2, 1, 1, 1, 1, 1, Adam).model(&spec);
    let store: Arc<dyn dckpt_storage::Storage> = memory();
    assert!(save_model(&store, &m, 1).iter().all(|o| o.is_ok()));
    let first = read_metadata_local(store.as_ref()).unwrap();
    // Every rank gets the coordinator's finding as the same typed error, naming rank 0.
    for (r, o) in save_model(&store, &m, 2).into_iter().enumerate() {
        match o.as_ref().map_err(|e| (e.rank(), e.kind())) {
            Err((Some(0), dckpt_engine::ErrorKind::AlreadyExists { location })) => {
                assert!(location.ends_with("dckpt.meta"), "rank {r}: {location}");
            }
            other => panic!("rank {r}: expected AlreadyExists from rank 0, got {other:?}"),
        }
    }
    assert_eq!(read_metadata_local(store.as_ref()).unwrap(), first, "the committed checkpoint is untouched");
    let opts = SaveOptions { replace: true, ..save_options(&m) };
    assert!(save_model_with(&store, &m, 3, &opts).iter().all(|o| o.is_ok()));
    for r in load_and_check(&store, &m, 3) {
        r.unwrap();
    }
    // The replaced save's data files are gone; only the new ones and the metadata remain.
    let second = read_metadata_local(store.as_ref()).unwrap();
    let names: Vec<String> = store.list("").unwrap().into_iter().map(|o| o.path).collect();
    assert_eq!(names.len(), second.files.len() + 1, "{names:?}");
}
