//! A rank whose caller failed to make its part (`caller_failed`): every rank fails at once,
//! naming that rank and the caller's reason, in a save, a load, and the local tier's save and
//! restore; nothing is written. Without it the others waited for the rank until the
//! collective timed out, and then named no cause.

use std::sync::Arc;
use std::time::Duration;

use dckpt_collective::{CollectiveOptions, ThreadGroup};
use dckpt_engine::local::{IfWhole, LocalRestoreOptions, LocalSaveOptions, Placement, restore_local, save_local};
use dckpt_engine::{Engine, Error, LoadOptions, LoadRequest, ObjectCheck, SaveOptions, SaveState};
use dckpt_shard_spec::{DType, ShardedObject, ShardedTensor};
use dckpt_storage::Storage;

const WORLD: usize = 3;
const FAILING: usize = 1;
const WHY: &str = "TypeError: optim.step: a set is not a plain value";

fn options() -> CollectiveOptions {
    CollectiveOptions { timeout: Duration::from_secs(60), ..CollectiveOptions::default() }
}

fn piece(rank: usize) -> ShardedTensor {
    ShardedTensor::chunk("w", DType::U8, [WORLD as u64 * 8], [rank as u64 * 8], [8])
}

/// Each rank's own object, and its bytes.
fn object(rank: usize) -> (ShardedObject, Vec<u8>) {
    (ShardedObject::in_grid("rng", vec![WORLD as u64], vec![rank as u64]), vec![rank as u8 + 10; 4])
}

/// A check of the rank's objects that fails on the failing rank where `fail` says so, and
/// on any rank whose object did not come back as saved.
fn check(rank: usize, fail: bool) -> Option<ObjectCheck> {
    Some(ObjectCheck(Box::new(move |objects| {
        if objects.len() != 1 || objects[0].data.as_deref() != Some(&object(rank).1[..]) {
            return Err(format!("ValueError: rank {rank} got {objects:?}"));
        }
        failed(rank).filter(|_| fail).map_or(Ok(()), Err)
    })))
}

/// What the failing rank's caller passes: its error, and no state.
fn failed(rank: usize) -> Option<String> {
    (rank == FAILING).then(|| WHY.to_string())
}

/// Every rank's error names the failing rank and its caller's reason (a timeout would not).
fn assert_named(results: Vec<Result<(), Error>>) {
    for (rank, r) in results.into_iter().enumerate() {
        let e = r.expect_err("every rank fails");
        assert_eq!(e.rank(), Some(FAILING as u32), "rank {rank}: {e}");
        assert!(e.to_string().contains(WHY), "rank {rank}: {e}");
    }
}

fn save_all(store: &dyn Storage, caller_failed: impl Fn(usize) -> Option<String> + Sync) -> Vec<Result<(), Error>> {
    ThreadGroup::run(WORLD, &options(), |rank, c| {
        let (data, (o, od)) = (vec![rank as u8; 8], object(rank));
        let mut state = SaveState::new();
        if rank != FAILING || caller_failed(rank).is_none() {
            state.push_tensor(piece(rank), &data);
            state.push_object(o, &od);
        }
        let opts = SaveOptions { caller_failed: caller_failed(rank), ..SaveOptions::default() };
        Engine::new(Arc::new(c)).save(store, &state, &opts).map(drop)
    })
    .expect("world")
}

#[test]
fn a_save_fails_on_every_rank_naming_the_rank_whose_caller_failed() {
    let store = dckpt_storage::open("memory://caller-save").expect("memory");
    assert_named(save_all(store.as_ref(), failed));
    assert!(store.list("").expect("list").is_empty(), "nothing is written");
}

#[test]
fn a_load_fails_on_every_rank_naming_the_rank_whose_caller_failed() {
    let store = dckpt_storage::open("memory://caller-load").expect("memory");
    save_all(store.as_ref(), |_| None).into_iter().for_each(|r| r.expect("save"));
    let results = ThreadGroup::run(WORLD, &options(), |rank, c| {
        let mut data = vec![0u8; 8];
        let mut req = LoadRequest::new();
        if rank != FAILING {
            req = req.tensor(piece(rank), &mut data);
        }
        let opts = LoadOptions { caller_failed: failed(rank), ..LoadOptions::default() };
        Engine::new(Arc::new(c)).load(store.as_ref(), &mut req, &opts).map(drop)
    })
    .expect("world");
    assert_named(results);
}

#[test]
fn a_load_fails_on_every_rank_naming_the_rank_whose_object_check_failed() {
    let store = dckpt_storage::open("memory://caller-check").expect("memory");
    save_all(store.as_ref(), |_| None).into_iter().for_each(|r| r.expect("save"));
    let load = |fail: bool| {
        ThreadGroup::run(WORLD, &options(), |rank, c| {
            let mut data = vec![0u8; 8];
            let mut req = LoadRequest::new().tensor(piece(rank), &mut data).object(object(rank).0);
            req.check_objects = check(rank, fail);
            Engine::new(Arc::new(c)).load(store.as_ref(), &mut req, &LoadOptions::default()).map(drop)
        })
        .expect("world")
    };
    load(false).into_iter().for_each(|r| r.expect("every check passes"));
    assert_named(load(true));
}

fn local_dirs(name: &str) -> Vec<Arc<dyn Storage>> {
    (0..WORLD).map(|n| dckpt_storage::open(&format!("memory://{name}-{n}")).expect("memory")).collect()
}

/// A local save of step 4 by every rank, each node's directory its own; the failing rank's
/// caller fails where `fail` says so.
fn local_save(dirs: &[Arc<dyn Storage>], fail: bool) -> Vec<Result<(), Error>> {
    let placement = Placement { ranks_per_node: 1, copies: 2 };
    ThreadGroup::run(WORLD, &options(), |rank, c| {
        let (data, (o, od)) = (vec![rank as u8 + 1; 8], object(rank));
        let state = SaveState::new().tensor(piece(rank), &data).object(o, &od);
        // Step 4 saved again is written again: these tests fail its save in other ways.
        let caller_failed = failed(rank).filter(|_| fail);
        let opts =
            LocalSaveOptions { caller_failed, if_whole: IfWhole::Replace, ..LocalSaveOptions::new(4, placement) };
        save_local(&c, dirs[rank].as_ref(), &state, &opts).map(drop)
    })
    .expect("world")
}

/// Each rank's restored step, and whether its piece came back as saved; the failing rank's
/// caller fails where `fail` says so, and each rank's objects are checked by `checks`.
fn local_restore(
    dirs: &[Arc<dyn Storage>],
    fail: bool,
    checks: impl Fn(usize) -> Option<ObjectCheck> + Sync,
) -> Vec<Result<(Option<u64>, bool), Error>> {
    ThreadGroup::run(WORLD, &options(), |rank, c| {
        let mut data = vec![0u8; 8];
        let mut req = LoadRequest::new().tensor(piece(rank), &mut data).object(object(rank).0);
        req.check_objects = checks(rank);
        let opts = LocalRestoreOptions { caller_failed: failed(rank).filter(|_| fail), ..Default::default() };
        let out = restore_local(&c, dirs[rank].as_ref(), &mut req, &opts);
        drop(req);
        out.map(|o| (o.step, data == vec![rank as u8 + 1; 8]))
    })
    .expect("world")
}

/// Every rank restored step 4, its piece as saved.
fn assert_whole(restored: Vec<Result<(Option<u64>, bool), Error>>) {
    for (rank, r) in restored.into_iter().enumerate() {
        assert_eq!(r.expect("restore"), (Some(4), true), "rank {rank}");
    }
}

#[test]
fn the_local_tier_fails_on_every_rank_naming_the_rank_whose_caller_failed() {
    let dirs = local_dirs("caller-local");
    assert_named(local_save(&dirs, true));
    for (n, d) in dirs.iter().enumerate() {
        assert!(d.list("").expect("list").is_empty(), "node {n}: nothing is written");
    }
    local_save(&dirs, false).into_iter().for_each(|r| r.expect("local save"));
    assert_named(local_restore(&dirs, true, |_| None).into_iter().map(|r| r.map(drop)).collect());
    assert_whole(local_restore(&dirs, false, |_| None));
}

/// A step saved again whose save a caller's failure refuses stays complete: before, every
/// rank dropped its marker of the step before it learnt of the failure, and the step saved
/// before could no longer be restored.
#[test]
fn a_step_saved_again_stays_complete_when_a_callers_failure_refuses_the_save() {
    let dirs = local_dirs("caller-again");
    local_save(&dirs, false).into_iter().for_each(|r| r.expect("local save"));
    assert_named(local_save(&dirs, true));
    assert_whole(local_restore(&dirs, false, |_| None));
}

#[test]
fn a_local_restore_fails_on_every_rank_naming_the_rank_whose_object_check_failed() {
    let dirs = local_dirs("caller-check");
    local_save(&dirs, false).into_iter().for_each(|r| r.expect("local save"));
    assert_named(local_restore(&dirs, false, |r| check(r, true)).into_iter().map(|r| r.map(drop)).collect());
    // Only the failing rank checks its objects: the others still agree on its check.
    let only = |r: usize| check(r, true).filter(|_| r == FAILING);
    assert_named(local_restore(&dirs, false, only).into_iter().map(|r| r.map(drop)).collect());
    assert_whole(local_restore(&dirs, false, |r| check(r, false)));
}

/// A check that panics fails the load on every rank too, rather than leaving the others to
/// wait for the rank it unwound out of.
#[test]
fn an_object_check_that_panics_fails_the_load_on_every_rank() {
    let store = dckpt_storage::open("memory://caller-panic").expect("memory");
    save_all(store.as_ref(), |_| None).into_iter().for_each(|r| r.expect("save"));
    let results = ThreadGroup::run(WORLD, &options(), |rank, c| {
        let mut data = vec![0u8; 8];
        let mut req = LoadRequest::new().tensor(piece(rank), &mut data).object(object(rank).0);
        if rank == FAILING {
            req.check_objects = Some(ObjectCheck(Box::new(|_| panic!("{WHY}"))));
        }
        Engine::new(Arc::new(c)).load(store.as_ref(), &mut req, &LoadOptions::default()).map(drop)
    })
    .expect("world");
    for r in &results {
        assert!(r.as_ref().is_err_and(|e| e.to_string().contains("panicked")), "{r:?}");
    }
    assert_named(results);
}

/// A rank that cannot drop its marker of a step saved again writes nothing of it: its
/// marker and the parts it lists stay as they were, and the save fails on every rank.
#[test]
fn a_rank_that_cannot_drop_its_marker_writes_nothing() {
    let dirs = local_dirs("caller-marker");
    local_save(&dirs, false).into_iter().for_each(|r| r.expect("local save"));
    let snapshot = |d: &dyn Storage| -> Vec<(String, Vec<u8>)> {
        let mut all: Vec<(String, Vec<u8>)> = d
            .list("")
            .expect("list")
            .into_iter()
            .map(|i| (i.path.clone(), d.get(&i.path).expect("get").to_vec()))
            .collect();
        all.sort();
        all
    };
    let before = snapshot(dirs[FAILING].as_ref());
    // The failing rank's first operation in a save is dropping its marker.
    let refusing: Arc<dyn Storage> = Arc::new(dckpt_storage::FaultStorage::new(
        dirs[FAILING].clone(),
        dckpt_storage::FaultConfig { fail_op: Some(0), ..Default::default() },
    ));
    let mut faulty = dirs.clone();
    faulty[FAILING] = refusing;
    for (rank, r) in local_save(&faulty, false).into_iter().enumerate() {
        assert_eq!(r.expect_err("every rank fails").rank(), Some(FAILING as u32), "rank {rank}");
    }
    assert_eq!(snapshot(dirs[FAILING].as_ref()), before, "nothing of the new save is written there");
}
