//! Plan cache, async save and strictness, end to end.

use std::sync::Arc;

use dckpt_reference::{RankState, save_options};
use std::collections::HashMap;

use dckpt_engine::{
    Engine, ErrorKind, KeyPolicy, LoadOptions, LocalPlan, SaveOptions, Strictness, plan_save, read_metadata_local,
};
use dckpt_layout::{ModelSpec, OptimizerMode::*, Synthetic};
use dckpt_shard_spec::Region;
use dckpt_storage::Storage;
use dckpt_tests::{Setup, load_and_check, memory, objects_of_at_most, run_ranks, save_model};

#[test]
fn a_repeated_save_reuses_the_plan_and_a_changed_one_replans() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(4, 2, 1, 1, 2, 1, Distributed).model(&spec);
    let other = Setup::new(4, 2, 1, 1, 2, 1, Layerwise).model(&spec);
    let stores: Vec<Arc<dyn Storage>> = (0..3).map(|_| memory()).collect();
    let reused = run_ranks(4, |r, c| {
        let engine = Engine::new(c);
        let mut flags = Vec::new();
        for (i, (model, seed)) in [(&m, 1), (&m, 2), (&other, 3)].into_iter().enumerate() {
            let state = RankState::filled(model, r as u32, Synthetic::new(seed));
            let o = engine.save(stores[i].as_ref(), &state.save_state(), &save_options(model)).unwrap();
            flags.push(o.plan_reused);
        }
        flags
    });
    for f in &reused {
        assert_eq!(f, &[false, true, false]);
    }
    // The save that reused the plan is as good as a planned one.
    for r in load_and_check(&stores[1], &m, 2) {
        r.unwrap();
    }
    for r in load_and_check(&stores[2], &other, 3) {
        r.unwrap();
    }
}

#[test]
fn async_save_commits_in_the_background() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(4, 1, 2, 1, 2, 1, Layerwise).model(&spec);
    let stores: Vec<Arc<dyn Storage>> = (0..2).map(|_| memory()).collect();
    let outcomes = run_ranks(4, |r, c| {
        let engine = Engine::new(c);
        let mut handles = Vec::new();
        for (i, store) in stores.iter().enumerate() {
            let mut state = RankState::filled(&m, r as u32, Synthetic::new(10 + i as u64));
            handles.push(engine.save_async(store.clone(), &state.save_state(), &save_options(&m)).unwrap());
            // The caller owns its buffers again at once: scribbling on them cannot reach the checkpoint.
            for b in &mut state.buffers {
                b.fill(0xAB);
            }
        }
        handles.into_iter().map(|h| h.wait()).collect::<Vec<_>>()
    });
    for per_rank in outcomes {
        for o in per_rank {
            assert_eq!(o.unwrap().bytes, m.expected_bytes());
        }
    }
    for (i, store) in stores.iter().enumerate() {
        for r in load_and_check(store, &m, 10 + i as u64) {
            r.unwrap();
        }
    }
}

#[test]
fn async_saves_can_keep_their_staging_buffers_for_the_next_one() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(2, 2, 1, 1, 1, 1, Adam).model(&spec);
    let other = Setup::new(2, 1, 1, 1, 2, 1, Layerwise).model(&spec);
    let stores: Vec<Arc<dyn Storage>> = (0..5).map(|_| memory()).collect();
    let kept = run_ranks(2, |r, c| {
        let engine = Engine::new(c);
        let keep = |model| SaveOptions { keep_staging: true, ..save_options(model) };
        let mut kept = Vec::new();
        // Kept, reused for new values of the same state, reused where they fit for another
        // layout, then released by a save that does not keep them.
        for (i, (model, opts)) in
            [(&m, keep(&m)), (&m, keep(&m)), (&other, keep(&other)), (&m, save_options(&m))].into_iter().enumerate()
        {
            let state = RankState::filled(model, r as u32, Synthetic::new(20 + i as u64));
            engine.save_async(stores[i].clone(), &state.save_state(), &opts).unwrap().wait().unwrap();
            kept.push((engine.staging_bytes(), state.buffers.iter().map(|b| b.len() as u64).sum::<u64>()));
        }
        // Kept again, then released without a save.
        let state = RankState::filled(&m, r as u32, Synthetic::new(24));
        engine.save_async(stores[4].clone(), &state.save_state(), &keep(&m)).unwrap().wait().unwrap();
        assert!(engine.staging_bytes() > 0);
        engine.release_staging();
        assert_eq!(engine.staging_bytes(), 0);
        kept
    });
    for per_rank in &kept {
        for (i, &(kept, state)) in per_rank.iter().enumerate() {
            if i < 3 {
                assert!(kept >= state && kept <= 2 * state, "save {i}: {kept} bytes kept for a state of {state}");
            } else {
                assert_eq!(kept, 0, "a save without keep_staging releases the buffers");
            }
        }
    }
    for (i, (store, model)) in stores.iter().zip([&m, &m, &other, &m, &m]).enumerate() {
        for r in load_and_check(store, model, 20 + i as u64) {
            r.unwrap();
        }
    }
}

/// Missing and unexpected keys a load returned, or its error in short.
type KeysOrError = Result<(Vec<String>, Vec<String>), String>;

fn load_with(store: &Arc<dyn Storage>, setup: Setup, strictness: Strictness) -> Vec<KeysOrError> {
    let m = setup.model(&ModelSpec::preset("tiny").unwrap());
    run_ranks(setup.world as usize, |r, c| {
        let engine = Engine::new(c);
        let mut state = RankState::empty(&m, r as u32);
        let opts = LoadOptions { strictness, ..LoadOptions::default() };
        state.load(&engine, store.as_ref(), &opts).map(|o| (o.missing, o.unexpected)).map_err(|e| match e.kind() {
            ErrorKind::MissingKeys { keys, .. } => format!("missing {}", keys.len()),
            ErrorKind::UnexpectedKeys { keys, .. } => format!("unexpected {}", keys.len()),
            _ => e.to_string(),
        })
    })
}

#[test]
fn strictness_modes_for_missing_and_unexpected_keys() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let with_opt = Setup::new(2, 1, 1, 1, 1, 1, Adam);
    let store = memory();
    assert!(save_model(&store, &with_opt.model(&spec), 4).iter().all(|o| o.is_ok()));
    let params_only = Setup::new(2, 1, 1, 1, 1, 1, None);
    let n_params = params_only.model(&spec).declared_tensors().len();

    let s = |missing, unexpected| Strictness { missing, unexpected };
    // Raise: every rank fails the same way.
    for r in load_with(&store, params_only, s(KeyPolicy::Raise, KeyPolicy::Raise)) {
        assert_eq!(r.unwrap_err(), format!("unexpected {}", 3 * n_params));
    }
    // Return: every rank gets the same list, all optimizer state.
    for r in load_with(&store, params_only, s(KeyPolicy::Raise, KeyPolicy::Return)) {
        let (missing, unexpected) = r.unwrap();
        assert!(missing.is_empty());
        assert_eq!(unexpected.len(), 3 * n_params);
        assert!(unexpected.iter().all(|k| k.starts_with("optimizer.state.")));
    }
    // Ignore and Log load and return nothing.
    for p in [KeyPolicy::Ignore, KeyPolicy::Log] {
        for r in load_with(&store, params_only, s(KeyPolicy::Raise, p)) {
            assert_eq!(r.unwrap(), (vec![], vec![]));
        }
    }
    // Missing keys: optimizer state requested from a checkpoint without it.
    let store2 = memory();
    assert!(save_model(&store2, &params_only.model(&spec), 4).iter().all(|o| o.is_ok()));
    for r in load_with(&store2, with_opt, s(KeyPolicy::Raise, KeyPolicy::Raise)) {
        assert_eq!(r.unwrap_err(), format!("missing {}", 3 * n_params));
    }
    for r in load_with(&store2, with_opt, s(KeyPolicy::Return, KeyPolicy::Raise)) {
        assert_eq!(r.unwrap().0.len(), 3 * n_params);
    }
}

#[test]
fn loading_nothing_is_ordinary() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let store = memory();
    assert!(save_model(&store, &Setup::new(2, 1, 1, 1, 1, 1, None).model(&spec), 4).iter().all(|o| o.is_ok()));
    let r = run_ranks(3, |_, c| {
        let engine = Engine::new(c);
        let opts = LoadOptions {
            strictness: Strictness { unexpected: KeyPolicy::Return, ..Strictness::default() },
            ..LoadOptions::default()
        };
        engine.load(store.as_ref(), &mut Default::default(), &opts).map(|o| (o.bytes_read, o.unexpected.len()))
    });
    let n = spec.expected_bytes(1, None);
    assert!(n > 0);
    for x in r {
        let (read, unexpected) = x.unwrap();
        assert_eq!(read, 0);
        assert!(unexpected > 0);
    }
}

/// The layout `planned_metadata` predicts is the one a save commits: with one file per rank,
/// and on a store that wants objects of at most a few KiB, where every rank spreads its
/// pieces over several files (and a piece larger than that gets one of its own).
#[test]
fn planned_metadata_matches_what_a_save_commits() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(4, 2, 1, 1, 2, 2, Distributed).model(&spec);
    for max in [Option::None, Some(6000)] {
        let store = max.map_or_else(memory, |bytes| objects_of_at_most(memory(), bytes));
        assert!(save_model(&store, &m, 9).iter().all(|o| o.is_ok()));
        let real = dckpt_engine::read_metadata_local(store.as_ref()).unwrap();
        let locals: Vec<dckpt_engine::LocalPlan> =
            (0..4).map(|r| dckpt_engine::LocalPlan { tensors: m.rank_state(r), objects: Vec::new() }).collect();
        let opts = save_options(&m);
        let plan = dckpt_engine::plan_save(&locals, opts.declared.as_deref(), opts.assignment).unwrap();
        let planned = dckpt_engine::planned_metadata(&plan, &opts, &real.save_id, max);
        planned.validate("planned").unwrap();
        let layout = |meta: &dckpt_engine::format::Metadata| {
            let files: Vec<_> = meta.files.iter().map(|f| (f.name.clone(), f.bytes, f.data_start)).collect();
            let chunks: Vec<_> =
                meta.tensors.iter().flat_map(|t| t.chunks.iter().map(|c| (c.file, c.at, c.crc32.len()))).collect();
            (files, chunks)
        };
        assert_eq!(layout(&planned), layout(&real), "files of at most {max:?} bytes");
        assert_eq!(planned.encode().len(), real.encode().len());
        let stored = store.list("").unwrap();
        assert_eq!(stored.len(), real.files.len() + 1, "{max:?}: exactly the metadata's files are stored");
        let Some(max) = max else {
            assert_eq!(real.files.len(), 4, "one file per rank");
            continue;
        };
        assert!(real.files.len() >= 8, "several files per rank: {}", real.files.len());
        // A file over the limit holds exactly one piece, which alone is over it.
        for (fi, f) in real.files.iter().enumerate() {
            let chunks = real.tensors.iter().flat_map(|t| {
                t.chunks.iter().filter(|c| c.file as usize == fi).map(|c| c.region().numel() * t.dtype.size())
            });
            let objects = real.objects.iter().flat_map(|o| o.entries.iter().filter(|e| e.file as usize == fi));
            let pieces: Vec<u64> = chunks.chain(objects.map(|e| e.len)).collect();
            assert!(f.bytes <= max || (pieces.len() == 1 && pieces[0] > max), "{}: {} bytes", f.name, f.bytes);
            assert!(dckpt_engine::verify::is_data_file_name(&f.name), "{}", f.name);
        }
        assert!(dckpt_engine::verify::verify(store.as_ref(), |_| ()).unwrap().ok());
        for r in load_and_check(&store, &m, 9) {
            r.unwrap();
        }
    }
}

/// The coordinator alone reads the metadata; a rank given another location (here, holding
/// another checkpoint) cannot find the data files that metadata names, and fails the load
/// on every rank: the error names that rank and the file. (A copy of the same files would
/// load: every byte is checked against the coordinator's checksums.)
#[test]
fn ranks_that_read_different_metadata_all_fail() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(2, 2, 1, 1, 1, 1, Adam).model(&spec);
    let (a, b) = (memory(), memory());
    for store in [&a, &b] {
        for o in save_model(store, &m, 5) {
            o.unwrap();
        }
    }
    let results = run_ranks(2, |r, c| {
        let store = if r == 0 { &a } else { &b };
        let mut state = RankState::empty(&m, r as u32);
        state.load(&Engine::new(c), store.as_ref(), &LoadOptions::default())
    });
    for (r, res) in results.into_iter().enumerate() {
        match res.as_ref().map_err(|e| (e.rank(), e.kind())) {
            Err((Some(1), ErrorKind::Storage { error: dckpt_storage::Error::NotFound { path } })) => {
                let id = &read_metadata_local(a.as_ref()).unwrap().save_id;
                assert!(path.contains(id.as_str()), "rank {r}: {path} is not a file of save {id}");
            }
            other => panic!("rank {r}: expected rank 1 missing a data file, got {other:?}"),
        }
    }
    // Each checkpoint on its own still loads.
    for store in [&a, &b] {
        for r in load_and_check(store, &m, 5) {
            r.unwrap();
        }
    }
}

/// A writer stores the chunks other ranks also hold (tensor-parallel replicas: layer norms,
/// biases) before the chunks only it holds, so a load in the same layout reads what it needs
/// from another rank's file in one span right after the header.
#[test]
fn replicated_chunks_come_first_in_each_file() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(4, 2, 2, 1, 1, 1, Adam).model(&spec);
    let store = memory();
    for o in save_model(&store, &m, 5) {
        o.unwrap();
    }
    let locals: Vec<LocalPlan> = (0..4).map(|r| LocalPlan { tensors: m.rank_state(r), objects: Vec::new() }).collect();
    let plan = plan_save(&locals, Some(&m.declared_tensors()), save_options(&m).assignment).unwrap();
    let holders: HashMap<(&str, &Region), u32> =
        plan.chunks.iter().map(|c| ((c.key.as_str(), &c.region), c.holders)).collect();
    let meta = dckpt_engine::read_metadata_local(store.as_ref()).unwrap();
    let mut mixed = 0;
    for (fi, f) in meta.files.iter().enumerate() {
        // (offset, held by another rank too?) of every chunk in this file, in file order.
        let mut chunks: Vec<(u64, bool)> = Vec::new();
        for t in &meta.tensors {
            for c in t.chunks.iter().filter(|c| c.file == fi as u32) {
                chunks.push((c.at, holders[&(t.key.as_str(), &c.region())] > 1));
            }
        }
        chunks.sort_unstable();
        let shared = chunks.iter().filter(|c| c.1).count();
        mixed += usize::from(shared > 0 && shared < chunks.len());
        assert!(chunks[..shared].iter().all(|c| c.1), "{}: a chunk only it holds before a replicated one", f.name);
        assert_eq!(chunks[0].0, f.data_start, "{}", f.name);
    }
    assert!(mixed > 0, "no file holds both kinds: the test checks nothing");
    for r in load_and_check(&store, &m, 5) {
        r.unwrap();
    }
}

/// A tensor without elements has no chunk to store, yet the checkpoint declares it (key,
/// dtype, shape) next to the others, and a strict load of both succeeds. Rank 1 holds
/// nothing at all.
#[test]
fn a_tensor_without_elements_is_declared_and_loads() {
    use dckpt_engine::{SaveOptions, SaveState, TensorData, TensorRequest};
    use dckpt_shard_spec::{DType, ReplicaId, ShardedTensor};
    let t = |key: &str, dtype, shape: Vec<u64>| ShardedTensor {
        key: key.into(),
        dtype,
        global_shape: shape.clone().into(),
        region: Region::full(&shape),
        replica_id: ReplicaId::MAIN,
    };
    let (w, empty) = (t("w", DType::U8, vec![4]), t("a.empty", DType::F32, vec![0, 4]));
    let store = memory();
    let data = [1u8, 2, 3, 4];
    for o in run_ranks(2, |r, c| {
        let tensors = match r {
            0 => vec![TensorData { tensor: w.clone(), data: &data }, TensorData { tensor: empty.clone(), data: &[] }],
            _ => vec![],
        };
        Engine::new(c).save(store.as_ref(), &SaveState { tensors, objects: vec![] }, &SaveOptions::default())
    }) {
        o.unwrap();
    }
    let meta = dckpt_engine::read_metadata_local(store.as_ref()).unwrap();
    let declared: Vec<_> =
        meta.tensors.iter().map(|m| (m.key.as_str(), m.global_shape.to_vec(), m.chunks.len())).collect();
    assert_eq!(declared, [("a.empty", vec![0, 4], 0), ("w", vec![4], 1)]);
    let loaded = run_ranks(1, |_, c| {
        let mut got = [0u8; 4];
        let mut req = dckpt_engine::LoadRequest {
            tensors: vec![
                TensorRequest {
                    tensor: w.clone(),
                    data: &mut got,
                    allow_shape_mismatch: false,
                    allow_dtype_cast: false,
                },
                TensorRequest {
                    tensor: empty.clone(),
                    data: &mut [],
                    allow_shape_mismatch: false,
                    allow_dtype_cast: false,
                },
            ],
            ..Default::default()
        };
        Engine::new(c).load(store.as_ref(), &mut req, &LoadOptions::default()).map(|_| got)
    });
    assert_eq!(loaded[0].as_ref().unwrap(), &data);
}

/// An object of no bytes loads as one, with the fan-out on: two replicas that share the
/// reads of a tensor each hold units, and a copy of no bytes was cut into no copy at all, so
/// the object came back `None`, "not stored", from a load that succeeded.
#[test]
fn an_empty_object_loads_beside_a_fanned_out_tensor() {
    use dckpt_engine::{LoadRequest, ObjectRequest, SaveState, TensorRequest};
    use dckpt_shard_spec::{DType, ReplicaId, ShardedObject, ShardedTensor};
    let norm = |r: usize| ShardedTensor {
        replica_id: ReplicaId { dp: r as u32, ..ReplicaId::MAIN },
        ..ShardedTensor::whole("norm", DType::U8, [8 << 20])
    };
    let empty = |r: usize| ShardedObject {
        replica_id: ReplicaId { dp: r as u32, ..ReplicaId::MAIN },
        ..ShardedObject::single("empty")
    };
    let bytes: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
    let store = memory();
    for o in run_ranks(2, |r, c| {
        let state = SaveState::new().tensor(norm(r), &bytes).object(empty(r), &[]);
        Engine::new(c).save(store.as_ref(), &state, &SaveOptions::default())
    }) {
        o.unwrap();
    }
    let loaded = run_ranks(2, |r, c| {
        let mut got = vec![0u8; bytes.len()];
        let mut req = LoadRequest {
            tensors: vec![TensorRequest {
                tensor: norm(r),
                data: &mut got,
                allow_shape_mismatch: false,
                allow_dtype_cast: false,
            }],
            objects: vec![ObjectRequest { object: empty(r), data: Option::None }],
            ..Default::default()
        };
        let o = Engine::new(c).load(store.as_ref(), &mut req, &LoadOptions::default()).unwrap();
        let empty = req.object_data("empty").map(<[u8]>::to_vec);
        drop(req);
        (o.bytes_received, got == bytes, empty)
    });
    assert!(loaded.iter().any(|l| l.0 > 0), "the tensor's reads were shared: {loaded:?}");
    for (r, (_, same, empty)) in loaded.iter().enumerate() {
        assert!(same, "rank {r}: the tensor's bytes");
        assert_eq!(empty.as_deref(), Some(&[][..]), "rank {r}: the empty object");
    }
}

/// A replacing save removes the old checkpoint's data files, named by the old metadata;
/// whatever else that metadata names (the metadata file itself, other objects, a
/// `.safetensors` file whose name is not one dckpt makes) stays: a crafted metadata file
/// cannot make a save delete a user's model.
#[test]
fn a_replacing_save_removes_only_old_data_files() {
    use dckpt_engine::format::{FileMeta, META_NAME};
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(2, 1, 1, 1, 1, 1, Adam).model(&spec);
    let store: Arc<dyn Storage> = memory();
    assert!(save_model(&store, &m, 1).iter().all(|o| o.is_ok()));
    let mut old = dckpt_engine::read_metadata_local(store.as_ref()).unwrap();
    let named = |name: &str| FileMeta { name: name.into(), bytes: 0, data_start: 0, header_crc32: 0 };
    for name in [META_NAME, "notes.txt", "sub/x.safetensors", "stale.safetensors"] {
        old.files.push(named(name));
        if name != META_NAME {
            store.put(name, bytes::Bytes::from_static(b"x")).unwrap();
        }
    }
    store.put(META_NAME, old.encode().into()).unwrap();
    let opts = SaveOptions { replace: true, ..save_options(&m) };
    assert!(dckpt_tests::save_model_with(&store, &m, 2, &opts).iter().all(|o| o.is_ok()));
    for r in load_and_check(&store, &m, 2) {
        r.unwrap();
    }
    let mut names: Vec<String> = store.list("").unwrap().into_iter().map(|o| o.path).collect();
    names.sort();
    let new = dckpt_engine::read_metadata_local(store.as_ref()).unwrap();
    let mut want: Vec<String> = new.files.iter().map(|f| f.name.clone()).collect();
    want.extend([META_NAME.to_string(), "notes.txt".into(), "sub/x.safetensors".into(), "stale.safetensors".into()]);
    want.sort();
    assert_eq!(names, want, "the old data files removed, the rest kept");
}

/// A storage failure on one rank reaches every rank as the same typed error, naming that
/// rank and keeping the storage error's variant (here an injected fault), not as text.
#[test]
fn a_storage_failure_on_one_rank_is_the_same_typed_error_everywhere() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(2, 2, 1, 1, 1, 1, Adam).model(&spec);
    let store = memory();
    let config = dckpt_storage::FaultConfig { seed: 3, fail_from_op: Some(0), ..Default::default() };
    let broken: Arc<dyn Storage> = Arc::new(dckpt_storage::FaultStorage::new(store.clone(), config));
    let results = run_ranks(2, |r, c| {
        let state = RankState::filled(&m, r as u32, Synthetic::new(1));
        let mine = if r == 1 { &broken } else { &store };
        Engine::new(c).save(mine.as_ref(), &state.save_state(), &save_options(&m))
    });
    for (r, res) in results.into_iter().enumerate() {
        match res.as_ref().map_err(|e| (e.rank(), e.kind())) {
            Err((Some(1), ErrorKind::Storage { error: dckpt_storage::Error::Injected { seed: 3, transient, .. } })) => {
                assert!(!transient, "rank {r}");
            }
            other => panic!("rank {r}: expected rank 1's injected storage fault, got {other:?}"),
        }
    }
    assert!(store.list("").unwrap().is_empty(), "the failed save left nothing behind");
}

/// A save id given in the options names the data files, so a replayed save writes the same
/// names; one that could not be a file name is refused on every rank before anything is
/// written.
#[test]
fn a_given_save_id_names_the_files_and_a_bad_one_is_refused_everywhere() {
    let spec = ModelSpec::preset("tiny").unwrap();
    let m = Setup::new(2, 2, 1, 1, 1, 1, Adam).model(&spec);
    let save_with = |store: &Arc<dyn Storage>, id: &str| {
        let opts = SaveOptions { save_id: Some(id.to_string()), ..save_options(&m) };
        run_ranks(2, |r, c| {
            let state = RankState::filled(&m, r as u32, Synthetic::new(4));
            Engine::new(c).save(store.as_ref(), &state.save_state(), &opts)
        })
    };
    let store = memory();
    for o in save_with(&store, "00000000000000a7") {
        assert_eq!(o.unwrap().save_id, "00000000000000a7");
    }
    let mut names: Vec<String> = store.list("").unwrap().into_iter().map(|o| o.path).collect();
    names.sort();
    assert_eq!(names, ["00000000000000a7-00000.safetensors", "00000000000000a7-00001.safetensors", "dckpt.meta"]);
    for r in load_and_check(&store, &m, 4) {
        r.unwrap();
    }
    let fresh = memory();
    for (r, o) in save_with(&fresh, "model").into_iter().enumerate() {
        assert!(
            matches!(&o, Err(e) if e.rank() == Some(0) && matches!(e.kind(), ErrorKind::InvalidOptions { .. })),
            "rank {r}: {o:?}"
        );
    }
    assert!(fresh.list("").unwrap().is_empty());
}
