//! Crash consistency: a save whose storage fails at any operation (or tears a write, or
//! whose process "crashes" from some operation on) leaves either no committed checkpoint or
//! one that verifies clean and loads bit-exact, and every rank returns the same outcome; a
//! replacing save that fails anywhere leaves exactly one of the old and the new checkpoint,
//! whole (memory, local disk, and S3 when `DCKPT_TEST_S3_URL` is set). Every run asserts that
//! its fault was injected. A dead rank fails the save on every other rank within the
//! collective timeout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::handmade::Handmade;
use dckpt_collective::{CollectiveOptions, ThreadGroup};
use dckpt_engine::verify::verify;
use dckpt_engine::{Engine, ErrorKind, SaveOptions, read_metadata_local};
use dckpt_layout::{ModelSpec, OptimizerMode};
use dckpt_storage::{FaultConfig, FaultStorage, MemoryStorage, Storage};
use dckpt_tests::{Call, Setup, load_and_check, save_model};

const OPTS: SaveOptions = SaveOptions {
    assignment: dckpt_engine::Assignment::Balanced,
    declared: None,
    replace: false,
    block_bytes: 64,
    layout: std::collections::BTreeMap::new(),
    keep_staging: false,
    save_id: None,
    replica_check: dckpt_engine::ReplicaCheck::All,
    caller_failed: None,
};

/// How a fault run is set up; printed with every failure so it replays.
#[derive(Debug, Clone)]
struct Case {
    config: FaultConfig,
    backend: &'static str,
}

/// The S3 test server's URL, when the suite runs with one (`cargo xtask test`).
fn s3_url() -> Option<String> {
    std::env::var("DCKPT_TEST_S3_URL").ok().filter(|u| !u.is_empty())
}

/// A fresh store of the given kind (`memory`, `local`, `s3`) and, for local disk, the
/// directory that holds it.
fn backend(kind: &str) -> (Arc<dyn Storage>, Option<tempfile::TempDir>) {
    match kind {
        "memory" => (Arc::new(MemoryStorage::new()), None),
        "s3" => {
            static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_nanos();
            let base = s3_url().expect("DCKPT_TEST_S3_URL");
            let url = format!("{}/crash-{}-{nanos}-{n}", base.trim_end_matches('/'), std::process::id());
            (dckpt_storage::open(&url).expect("open s3"), None)
        }
        _ => {
            let dir = tempfile::tempdir().expect("tempdir");
            let s = dckpt_storage::open(dir.path().to_str().expect("utf-8")).expect("open");
            (s, Some(dir))
        }
    }
}

/// The operations of a clean save of `state` (to objects of at most `object_bytes_max`).
fn clean_ops(state: &Handmade, object_bytes_max: Option<u64>) -> u64 {
    let fs = FaultStorage::new(Arc::new(MemoryStorage::new()), FaultConfig { object_bytes_max, ..Default::default() });
    let storage: Arc<dyn Storage> = Arc::new(fs.clone());
    for o in state.save_all(&storage, &OPTS) {
        o.expect("clean save");
    }
    fs.ops()
}

/// What one fault run ended in, once its checks passed.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    /// The save returned `Ok` (on every rank: they agree).
    saved: bool,
    /// A checkpoint is committed there afterwards.
    committed: bool,
}

/// Runs a save under `case` and checks what it left.
fn run_case(state: &Handmade, case: &Case) -> Outcome {
    run_case_counted(state, case).0
}

/// [`run_case`], and the faults injected.
fn run_case_counted(state: &Handmade, case: &Case) -> (Outcome, Vec<dckpt_storage::InjectedFault>) {
    let (inner, _dir) = backend(case.backend);
    let fs = FaultStorage::new(inner.clone(), case.config.clone());
    let storage: Arc<dyn Storage> = Arc::new(fs.clone());
    let results = state.save_all(&storage, &OPTS);
    let ctx = || format!("{case:?}; world {}; injected {:?}", state.world, fs.injected());
    assert_fired(&case.config, &fs, &ctx);
    // Every rank returns the same outcome.
    let ok = results[0].is_ok();
    for (r, res) in results.iter().enumerate() {
        match (res, &results[0]) {
            (Ok(a), Ok(b)) => assert_eq!(a.save_id, b.save_id, "rank {r}: {}", ctx()),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "rank {r}: {}", ctx()),
            _ => panic!("rank {r} returned {res:?}, rank 0 {:?}: {}", results[0], ctx()),
        }
    }
    let committed = match read_metadata_local(inner.as_ref()) {
        Err(e) if matches!(e.kind(), ErrorKind::NotACheckpoint { .. }) => {
            assert!(!ok, "the save succeeded but nothing is committed: {}", ctx());
            false
        }
        Err(e) => panic!("a damaged checkpoint was committed: {e}: {}", ctx()),
        Ok(_) => {
            let report = verify(inner.as_ref(), |_| {}).expect("verify");
            assert!(report.ok(), "the committed checkpoint does not verify: {report:?}: {}", ctx());
            if let Err(e) = state.load_check1(&inner) {
                panic!("the committed checkpoint does not load: {e}: {}", ctx());
            }
            true
        }
    };
    if !committed {
        // The failed attempt clobbers nothing: a new save to the same place commits.
        for o in state.save_all(&inner, &OPTS) {
            o.unwrap_or_else(|e| panic!("a save after the failed one: {e}: {}", ctx()));
        }
        let report = verify(inner.as_ref(), |_| {}).expect("verify");
        assert!(report.ok(), "{report:?}: {}", ctx());
        state.load_check1(&inner).unwrap_or_else(|e| panic!("{e}: {}", ctx()));
    }
    (Outcome { saved: ok, committed }, fs.injected())
}

/// Asserts that the fault `config` asks for at an operation was injected there: a run whose
/// injector never fired proves nothing.
fn assert_fired(config: &FaultConfig, fs: &FaultStorage, ctx: &dyn Fn() -> String) {
    let Some(at) = config.fail_op.or(config.fail_from_op) else { return };
    let fired = fs.injected().iter().any(|f| f.op_index == at);
    assert!(fired, "no fault was injected at operation {at} of {}: {}", fs.ops(), ctx());
}

/// The ways an operation fails: (fail from it on, the failed operations take effect).
/// `(false, _)`: this one operation fails, its effect lost or not; `(true, false)`: the
/// process "crashes" there; `(true, true)`: every operation from there on lands but its reply
/// is lost (a network partition after the requests went out).
const SINGLE_AND_CRASH: [(bool, bool); 3] = [(false, false), (false, true), (true, false)];
const REPLIES_LOST: [(bool, bool); 1] = [(true, true)];

fn config(i: u64, (from, after): (bool, bool)) -> FaultConfig {
    FaultConfig {
        seed: i,
        fail_op: (!from).then_some(i),
        fail_from_op: from.then_some(i),
        fail_after_effect: after,
        ..FaultConfig::default()
    }
}

/// Fails each operation of a save in turn, in each of `modes`.
fn fail_each_op(world: usize, backend: &'static str, modes: &[(bool, bool)]) {
    fail_each_op_into(world, backend, modes, None);
}

/// [`fail_each_op`] on a store that keeps objects within `object_bytes_max`.
fn fail_each_op_into(world: usize, backend: &'static str, modes: &[(bool, bool)], object_bytes_max: Option<u64>) {
    let started = Instant::now();
    let state = Handmade::new(world, 3);
    let ops = clean_ops(&state, object_bytes_max);
    let (mut runs, mut failed, mut committed) = (0, 0, 0);
    for i in 0..ops {
        for &mode in modes {
            let case = Case { config: FaultConfig { object_bytes_max, ..config(i, mode) }, backend };
            let outcome = run_case(&state, &case);
            failed += u64::from(!outcome.saved);
            committed += u64::from(outcome.committed);
            runs += 1;
        }
    }
    let summary = format!(
        "world {world} on {backend}, modes {modes:?}: {ops} operations, {runs} runs, {failed} failed, {committed} committed"
    );
    eprintln!("{summary}; {:.1?}", started.elapsed());
    // Each run's checks pass whether or not its fault did anything; across all of them, a
    // fault that fails no save, or one that never lets a commit through, means the injection
    // (or the operation count) is broken, not that the save is sound.
    assert!(failed > 0, "no injected fault failed a save: {summary}");
    assert!(committed < runs, "every run committed despite its fault: {summary}");
    assert!(committed > 0, "no run committed: {summary}");
}

#[test]
fn each_failed_operation_world_1_memory() {
    fail_each_op(1, "memory", &SINGLE_AND_CRASH);
}

#[test]
fn each_failed_operation_world_3_memory() {
    fail_each_op(3, "memory", &SINGLE_AND_CRASH);
}

#[test]
fn each_failed_operation_world_2_local() {
    fail_each_op(2, "local", &SINGLE_AND_CRASH);
}

/// Each rank spreads its pieces over several files (written several at once), as on an
/// object store: a failure in any of them leaves no checkpoint or a sound one.
#[test]
fn each_failed_operation_with_several_files_per_rank() {
    fail_each_op_into(3, "memory", &SINGLE_AND_CRASH, Some(300));
    fail_each_op_into(3, "memory", &REPLIES_LOST, Some(300));
}

// A commit whose reply is lost (the metadata landed) and whose read-back fails too must not
// be followed by deleting the data files that metadata names: that left a committed
// checkpoint without its data (save.rs `commit` cleaned up after any commit error).
#[test]
fn lost_replies_after_the_commit_keep_its_data_files() {
    fail_each_op(1, "memory", &REPLIES_LOST);
    fail_each_op(3, "memory", &REPLIES_LOST);
    fail_each_op(2, "local", &REPLIES_LOST);
}

/// A replacing save of `world` ranks on a `kind` store that fails as `config` says: exactly
/// one of the old and the new checkpoint is committed, sound, and loads bit-exact (never
/// neither), and a replace that reported success left the new one. Returns whether the new
/// one is there.
fn replace_case(world: usize, kind: &str, config: FaultConfig) -> bool {
    let (old, new) = (Handmade::new(world, 100), Handmade::new(world, 200));
    let (inner, _dir) = backend(kind);
    for o in old.save_all(&inner, &OPTS) {
        o.expect("first save");
    }
    let fs = FaultStorage::new(inner.clone(), config.clone());
    let storage: Arc<dyn Storage> = Arc::new(fs.clone());
    let results = new.save_all(&storage, &SaveOptions { replace: true, ..OPTS });
    let ctx = || format!("replace on {kind}, world {world}, {config:?}; injected {:?}", fs.injected());
    assert_fired(&config, &fs, &ctx);
    let ok = results[0].is_ok();
    assert!(results.iter().all(|r| r.is_ok() == ok), "ranks disagree: {results:?}: {}", ctx());
    let report = verify(inner.as_ref(), |_| {}).unwrap_or_else(|e| panic!("no checkpoint left: {e}: {}", ctx()));
    assert!(report.ok(), "the committed checkpoint does not verify: {report:?}: {}", ctx());
    let (is_new, is_old) = (new.load_check1(&inner), old.load_check1(&inner));
    assert!(
        is_new.is_ok() != is_old.is_ok(),
        "exactly one of the old and the new state must load: new {is_new:?}, old {is_old:?}: {}",
        ctx()
    );
    assert!(!ok || is_new.is_ok(), "the replace succeeded but the old checkpoint is there: {}", ctx());
    is_new.is_ok()
}

/// Fails each operation of a replacing save on a `kind` store in turn, in each of `modes`.
fn fail_each_replace_op(kind: &str, modes: &[(bool, bool)]) {
    let started = Instant::now();
    let world = 2;
    let dry = {
        let (inner, _dir) = backend(kind);
        for o in Handmade::new(world, 100).save_all(&inner, &OPTS) {
            o.expect("first save");
        }
        let fs = FaultStorage::new(inner, FaultConfig::default());
        let storage: Arc<dyn Storage> = Arc::new(fs.clone());
        for o in Handmade::new(world, 200).save_all(&storage, &SaveOptions { replace: true, ..OPTS }) {
            o.expect("replace");
        }
        fs.ops()
    };
    // The plan's read of the old metadata, the data files, the commit and the deletes.
    assert!(dry >= 8, "a replace of {world} ranks took only {dry} operations");
    let (mut runs, mut replaced) = (0, 0);
    for i in 0..dry {
        for &mode in modes {
            replaced += u64::from(replace_case(world, kind, config(i, mode)));
            runs += 1;
        }
    }
    // Failing early keeps the old checkpoint, failing after the swap the new one.
    assert!(0 < replaced && replaced < runs, "{replaced} of {runs} runs ended replaced");
    eprintln!("replace on {kind}: {dry} operations, {runs} runs, {replaced} ended replaced; {:.1?}", started.elapsed());
}

#[test]
fn each_failed_operation_of_a_replace() {
    fail_each_replace_op("memory", &SINGLE_AND_CRASH);
}

#[test]
fn each_failed_operation_of_a_replace_on_local_disk() {
    fail_each_replace_op("local", &SINGLE_AND_CRASH);
    fail_each_replace_op("local", &REPLIES_LOST);
}

#[test]
fn each_failed_operation_of_a_replace_on_s3() {
    if s3_url().is_none() {
        panic!("DCKPT_TEST_S3_URL is not set: no S3 server to test against (cargo xtask test starts one)");
    }
    fail_each_replace_op("s3", &SINGLE_AND_CRASH);
    fail_each_replace_op("s3", &REPLIES_LOST);
}

// The replacing put lands but its reply is lost: deleting the new files then destroyed both
// the old checkpoint (already replaced) and the new one.
#[test]
fn lost_replies_after_a_replace_keep_its_data_files() {
    fail_each_replace_op("memory", &REPLIES_LOST);
}

// Tear every object write after k bytes: each data file and the metadata file in turn.
#[test]
fn torn_writes() {
    let state = Handmade::new(3, 4);
    let (inner, _dir) = backend("memory");
    for o in state.save_all(&inner, &OPTS) {
        o.expect("save");
    }
    let mut sizes: Vec<u64> = inner.list("").expect("list").iter().map(|o| o.size).collect();
    sizes.sort_unstable();
    let largest = *sizes.last().expect("objects");
    let mut ks: Vec<u64> = vec![0, 1, 7, 8, 9, 100];
    for s in sizes {
        ks.extend([s / 2, s - 1, s, s + 1]);
    }
    ks.sort_unstable();
    ks.dedup();
    for k in ks {
        for backend in ["memory", "local"] {
            let config = FaultConfig { seed: k, tear_after_bytes: Some(k), ..FaultConfig::default() };
            let (outcome, injected) = run_case_counted(&state, &Case { config, backend });
            let committed = outcome.committed;
            // A write tears exactly when some object is longer than k.
            let torn = injected.iter().filter(|f| f.kind == "torn write").count();
            assert_eq!(
                torn > 0,
                k < largest,
                "tear after {k} bytes on {backend} (largest object {largest}): {injected:?}"
            );
            assert_eq!(committed, torn == 0, "tear after {k} bytes on {backend}: {injected:?}");
        }
    }
}

// The reference model with its many chunks: every operation fails in turn.
#[test]
fn each_failed_operation_tiny_model() {
    let started = Instant::now();
    let spec = ModelSpec::preset("tiny").expect("tiny");
    let model = Setup::new(2, 1, 1, 1, 2, 1, OptimizerMode::Distributed).model(&spec);
    let fs = FaultStorage::new(Arc::new(MemoryStorage::new()), FaultConfig::default());
    let dry: Arc<dyn Storage> = Arc::new(fs.clone());
    assert!(save_model(&dry, &model, 9).iter().all(Result::is_ok));
    let ops = fs.ops();
    let mut failed = 0;
    for i in 0..ops {
        let config = FaultConfig { seed: i, fail_op: Some(i), fail_after_effect: i % 2 == 1, ..Default::default() };
        let inner: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
        let fs = FaultStorage::new(inner.clone(), config.clone());
        let storage: Arc<dyn Storage> = Arc::new(fs.clone());
        let results = save_model(&storage, &model, 9);
        let ctx = || format!("{config:?}: injected {:?}", fs.injected());
        assert_fired(&config, &fs, &ctx);
        let ok = results[0].is_ok();
        failed += usize::from(!ok);
        assert!(results.iter().all(|r| r.is_ok() == ok), "{results:?}: {}", ctx());
        match read_metadata_local(inner.as_ref()) {
            Err(e) if matches!(e.kind(), ErrorKind::NotACheckpoint { .. }) => assert!(!ok, "{}", ctx()),
            Err(e) => panic!("{e}: {}", ctx()),
            Ok(_) => {
                assert!(verify(inner.as_ref(), |_| {}).expect("verify").ok(), "{}", ctx());
                for r in load_and_check(&inner, &model, 9) {
                    r.unwrap_or_else(|e| panic!("{e}: {}", ctx()));
                }
            }
        }
    }
    // Most failed operations fail the save (some are retried, or best effort after it).
    assert!(failed * 2 > ops as usize, "only {failed} of {ops} failed operations failed the save");
    eprintln!("tiny model: {ops} operations failed in turn, {failed} saves failed; {:.1?}", started.elapsed());
}

/// `inner`, panicking in the thread that starts writing `victim`'s data file: a rank dying
/// mid-save. With a gate, conditional creates and replaces wait for each other there (racing
/// commits).
fn die_on_write(inner: &Arc<dyn Storage>, victim: usize, gate: Option<Arc<std::sync::Barrier>>) -> Arc<dyn Storage> {
    let file = format!("-{victim:05}.safetensors");
    dckpt_tests::hooked(inner.clone(), move |call, path| match call {
        Call::Writer if path.ends_with(&file) => panic!("rank {victim} dies while writing {path}"),
        Call::PutIfAbsent | Call::PutIfMatch => {
            if let Some(g) = &gate {
                g.wait();
            }
        }
        _ => {}
    })
}

/// How the victim rank dies.
#[derive(Debug, Clone, Copy)]
enum Death {
    /// Drops its collective before the save.
    Drop,
    /// Panics before the save.
    Panic,
    /// Panics while writing its data file, after the plan.
    PanicWriting,
    /// Never calls, holding its collective until the others are done.
    Silent,
}

const TIMEOUT: Duration = Duration::from_secs(2);

fn dead_rank(world: usize, victim: usize, death: Death) {
    let state = Handmade::new(world, 8);
    let inner: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    let storage = die_on_write(&inner, victim, None);
    let opts = CollectiveOptions { timeout: TIMEOUT, ..CollectiveOptions::default() };
    let group = ThreadGroup::with_options(world, &opts).expect("group");
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let started = Instant::now();
    let results: Vec<Option<(dckpt_engine::Result<dckpt_engine::SaveOutcome>, Duration)>> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let (state, storage, done_tx, done_rx) = (&state, &storage, done_tx.clone(), &done_rx);
                s.spawn(move || {
                    if r == victim {
                        match death {
                            Death::Drop => return None,
                            Death::Panic => panic!("rank {r} dies before the save"),
                            Death::Silent => {
                                // Wait until every other rank has returned.
                                let rx = done_rx.lock().expect("lock");
                                for _ in 0..world - 1 {
                                    let _ = rx.recv_timeout(TIMEOUT * 10);
                                }
                                drop(c);
                                return None;
                            }
                            Death::PanicWriting => {}
                        }
                    }
                    let engine = Engine::new(Arc::new(c));
                    let res = state.save(&engine, storage.as_ref(), r, &OPTS);
                    let took = started.elapsed();
                    let _ = done_tx.send(());
                    Some((res, took))
                })
            })
            .collect();
        drop(done_tx);
        handles.into_iter().map(|h| h.join().unwrap_or(None)).collect()
    });
    let what = format!("world {world}, rank {victim} {death:?}");
    for (r, res) in results.into_iter().enumerate() {
        if r == victim {
            continue;
        }
        let (res, took) = res.unwrap_or_else(|| panic!("{what}: rank {r} did not return"));
        let e = res.expect_err(&format!("{what}: rank {r} must fail"));
        // Ranks other than 0 wait a quarter longer (at most 2 s more) for rank 0's verdict.
        assert!(took < TIMEOUT * 2 + Duration::from_secs(1), "{what}: rank {r} took {took:?}");
        let text = e.to_string();
        // The survivors name the rank that died, whichever way it died.
        let named = [format!("rank {victim} "), format!("rank {victim}:")].iter().any(|n| text.contains(n.as_str()));
        assert!(named, "{what}: rank {r} does not name rank {victim}: {text}");
        eprintln!("{what}: rank {r} after {took:.1?}: {text}");
    }
    match read_metadata_local(inner.as_ref()) {
        Err(e) if matches!(e.kind(), ErrorKind::NotACheckpoint { .. }) => {}
        other => panic!("{what}: a checkpoint is committed: {other:?}"),
    }
}

#[test]
fn dead_rank_fails_the_save_everywhere() {
    for death in [Death::Drop, Death::Panic, Death::PanicWriting, Death::Silent] {
        for (world, victim) in [(3, 0), (3, 2), (4, 1)] {
            dead_rank(world, victim, death);
        }
    }
}

// Two jobs save to the same root at once: exactly one commits, the other fails on every one
// of its ranks and leaves nothing behind; the winner's checkpoint is sound and loads.
#[test]
fn concurrent_saves_to_one_root_have_one_winner() {
    for round in 0..20u64 {
        let inner: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
        // Both commits are attempted at once.
        let gate = Some(Arc::new(std::sync::Barrier::new(2)));
        let raced = die_on_write(&inner, usize::MAX, gate);
        let (a, b) = (Handmade::new(2, 1000 + round), Handmade::new(3, 2000 + round));
        let (ra, rb) = std::thread::scope(|s| {
            let ja = s.spawn(|| a.save_all(&raced, &OPTS));
            let jb = s.spawn(|| b.save_all(&raced, &OPTS));
            (ja.join().expect("job a"), jb.join().expect("job b"))
        });
        let ok = |r: &[dckpt_engine::Result<dckpt_engine::SaveOutcome>]| {
            let ok = r[0].is_ok();
            assert!(r.iter().all(|x| x.is_ok() == ok), "round {round}: ranks disagree: {r:?}");
            ok
        };
        let (oka, okb) = (ok(&ra), ok(&rb));
        assert!(oka != okb, "round {round}: a {ra:?}, b {rb:?}");
        let (winner, loser) = if oka { (&a, &rb) } else { (&b, &ra) };
        for (r, e) in loser.iter().enumerate() {
            assert!(
                matches!(e, Err(e) if e.rank() == Some(0) && matches!(e.kind(), ErrorKind::AlreadyExists { .. })),
                "round {round}, rank {r}: the loser's ranks all fail with AlreadyExists, got {e:?}"
            );
        }
        let report = verify(inner.as_ref(), |_| {}).expect("verify");
        assert!(report.ok() && report.leftovers.is_empty(), "round {round}: {report:?}");
        winner.load_check1(&inner).unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
}
