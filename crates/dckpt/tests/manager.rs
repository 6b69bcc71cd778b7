//! The run manager under faults: every storage operation of a step's save and the retention
//! after it failed in turn (memory, local disk, and S3 when `DCKPT_TEST_S3_URL` is set);
//! afterwards the latest step is committed and loads bit-exact, the steps retention
//! promised are there, and a resumed save plus `gc` leave no uncommitted step, stray data
//! file or temporary. Background saves of consecutive steps with retention, and two saves
//! into one step.

use std::collections::BTreeSet;
use std::sync::Arc;

use bytes::Bytes;
use dckpt::manager::{LATEST_NAME, scan, step_dir};
use dckpt::storage::{FaultConfig, FaultStorage, MemoryStorage};
use dckpt::{
    CheckpointManager, Collective, DType, Error, ErrorKind, LoadOptions, LoadRequest, RetentionPolicy, SaveOptions,
    SaveState, ShardedTensor, Storage, ThreadGroup,
};

const WORLD: usize = 2;
const ROWS: u64 = 4;
const COLS: u64 = 6;

/// Element (i, j) of step `step`'s weight, different at every step.
fn value(step: u64, i: u64, j: u64) -> f32 {
    (step * 1000 + i * COLS + j) as f32
}

/// This rank's columns of step `step`'s weight (tp 2 by columns), saved with a tiny block so
/// that a save has many operations.
fn piece(rank: u64, step: u64) -> (ShardedTensor, Vec<u8>) {
    let half = COLS / 2;
    let bytes =
        (0..ROWS).flat_map(|i| (0..half).flat_map(move |j| value(step, i, rank * half + j).to_le_bytes())).collect();
    (ShardedTensor::chunk("w", DType::F32, [ROWS, COLS], [0, rank * half], [ROWS, half]), bytes)
}

fn opts() -> SaveOptions {
    SaveOptions { block_bytes: 16, ..SaveOptions::default() }
}

/// Runs `f(manager)` on every rank over `root`, returning rank 0's result after checking
/// every rank returned the same outcome.
fn on_ranks<T: Send + std::fmt::Debug>(
    root: &Arc<dyn Storage>,
    policy: RetentionPolicy,
    f: impl Fn(&CheckpointManager, u64) -> dckpt::Result<T> + Sync,
) -> dckpt::Result<T> {
    let ranks = ThreadGroup::new(WORLD).expect("thread group");
    let results: Vec<dckpt::Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || {
                    let rank = c.rank() as u64;
                    let m = CheckpointManager::new(Arc::new(c), root, policy)?;
                    f(&m, rank)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    let first = format!("{:?}", results[0].as_ref().map(|_| ()).map_err(|e| e.to_string()));
    for (r, res) in results.iter().enumerate() {
        let this = format!("{:?}", res.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        assert_eq!(this, first, "rank {r} returned another outcome than rank 0");
    }
    results.into_iter().next().expect("rank 0")
}

fn save_step(m: &CheckpointManager, rank: u64, step: u64) -> dckpt::Result<Vec<u64>> {
    let (t, b) = piece(rank, step);
    Ok(m.save(step, &SaveState::new().tensor(t, &b), &opts())?.removed)
}

/// Loads the latest step whole on every rank and checks every element bit-exact; its step.
fn load_latest_checked(root: &Arc<dyn Storage>) -> Option<u64> {
    on_ranks(root, RetentionPolicy::KEEP_ALL, |m, _| {
        let mut whole = vec![0u8; (ROWS * COLS * 4) as usize];
        let mut req = LoadRequest::new().tensor(ShardedTensor::whole("w", DType::F32, [ROWS, COLS]), &mut whole);
        let Some(step) = m.load_latest(&mut req, &LoadOptions::default())?.map(|r| r.step) else { return Ok(None) };
        for (k, v) in whole.chunks_exact(4).enumerate() {
            let (i, j) = (k as u64 / COLS, k as u64 % COLS);
            assert_eq!(
                f32::from_le_bytes(v.try_into().unwrap()).to_bits(),
                value(step, i, j).to_bits(),
                "step {step} ({i}, {j})"
            );
        }
        Ok(Some(step))
    })
    .expect("loading the latest step")
}

fn committed(root: &Arc<dyn Storage>) -> BTreeSet<u64> {
    scan(root).expect("scan").into_iter().filter(|s| s.committed()).map(|s| s.step).collect()
}

fn s3_url() -> Option<String> {
    std::env::var("DCKPT_TEST_S3_URL").ok().filter(|u| !u.is_empty())
}

fn fresh(kind: &str) -> (Arc<dyn Storage>, Option<tempfile::TempDir>) {
    match kind {
        "memory" => (Arc::new(MemoryStorage::new()), None),
        "s3" => {
            static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
            let url = format!("{}/run-{}-{nanos}-{n}", s3_url().unwrap().trim_end_matches('/'), std::process::id());
            (dckpt::open(&url).expect("open s3"), None)
        }
        _ => {
            let dir = tempfile::tempdir().expect("tempdir");
            (dckpt::open(dir.path().to_str().unwrap()).expect("open"), Some(dir))
        }
    }
}

const KEEP_2: RetentionPolicy = RetentionPolicy { keep_last: Some(2), keep_every: None };

/// A root with steps 2 and 3 saved under keep-last-2.
fn prepared(kind: &str) -> (Arc<dyn Storage>, Option<tempfile::TempDir>) {
    let (root, dir) = fresh(kind);
    for step in 2..=3 {
        on_ranks(&root, KEEP_2, |m, r| save_step(m, r, step)).expect("clean save");
    }
    assert_eq!(committed(&root), BTreeSet::from([2, 3]));
    (root, dir)
}

fn fail_each_operation(kind: &str) {
    // The operations of a clean step-4 save with its retention.
    let (root, _dir) = prepared(kind);
    let counting = FaultStorage::new(root.clone(), FaultConfig::default());
    let wrapped: Arc<dyn Storage> = Arc::new(counting.clone());
    let removed = on_ranks(&wrapped, KEEP_2, |m, r| save_step(m, r, 4)).expect("clean save");
    assert_eq!(removed, [2]);
    let ops = counting.ops();
    // Every operation failing from `i` on is a crash at `i`, whose outcome depends only on
    // which operations landed: memory and local disk check it. Against the S3 server, whose
    // requests are most of this test's time, the failures that S3 answers in its own way
    // (a conditional put failing, or its reply lost after it landed) are enough.
    let ways: &[(bool, bool)] =
        if kind == "s3" { &[(false, false), (false, true)] } else { &[(false, false), (false, true), (true, false)] };
    let mut committed_runs = 0;
    for i in 0..ops {
        for &(from, after) in ways {
            let config = FaultConfig {
                seed: i,
                fail_op: (!from).then_some(i),
                fail_from_op: from.then_some(i),
                fail_after_effect: after,
                ..FaultConfig::default()
            };
            let ctx = format!("{kind}: operation {i} of {ops}, {config:?}");
            let (root, _dir) = prepared(kind);
            let fs = FaultStorage::new(root.clone(), config);
            let faulty: Arc<dyn Storage> = Arc::new(fs.clone());
            let outcome = on_ranks(&faulty, KEEP_2, |m, r| save_step(m, r, 4));
            assert!(fs.injected().iter().any(|f| f.op_index == i), "no fault at {i}: {ctx}");
            // What a restarted job finds: a committed latest step that loads bit-exact,
            // and the steps retention promised.
            let now = committed(&root);
            let latest = load_latest_checked(&root).unwrap_or_else(|| panic!("no latest step: {ctx}"));
            assert_eq!(Some(&latest), now.iter().next_back(), "{ctx}");
            let promised: BTreeSet<u64> = if now.contains(&4) { [3, 4].into() } else { [2, 3].into() };
            assert!(promised.is_subset(&now), "retention lost a step it keeps: {now:?}, {outcome:?}: {ctx}");
            if outcome.is_ok() {
                assert_eq!(latest, 4, "{ctx}");
            }
            committed_runs += u64::from(now.contains(&4));
            // The job resumes after the latest step, then collects garbage.
            if latest < 4 {
                on_ranks(&root, KEEP_2, |m, r| save_step(m, r, 4))
                    .unwrap_or_else(|e| panic!("resumed save: {e}: {ctx}"));
            }
            let report = on_ranks(&root, KEEP_2, |m, _| m.gc()).unwrap_or_else(|e| panic!("gc: {e}: {ctx}"));
            let steps = scan(&root).unwrap();
            assert!(steps.iter().all(|s| s.committed()), "gc left an uncommitted step: {steps:?}, {report:?}: {ctx}");
            assert_eq!(committed(&root), BTreeSet::from([3, 4]), "{ctx}");
            assert!(root.list_abandoned("").unwrap().is_empty(), "{ctx}");
            for s in &steps {
                let report =
                    dckpt::verify::verify(dckpt::manager::step_storage(&root, s.step).as_ref(), |_| {}).unwrap();
                assert!(report.ok() && report.leftovers.is_empty(), "step {}: {report:?}: {ctx}", s.step);
            }
            assert_eq!(load_latest_checked(&root), Some(4), "{ctx}");
        }
    }
    eprintln!("{kind}: {ops} operations, {committed_runs} of {} runs committed step 4", ops * ways.len() as u64);
}

#[test]
fn each_failed_operation_of_a_step_and_its_retention_memory() {
    fail_each_operation("memory");
}

#[test]
fn each_failed_operation_of_a_step_and_its_retention_local() {
    fail_each_operation("local");
}

#[test]
fn each_failed_operation_of_a_step_and_its_retention_s3() {
    if s3_url().is_none() {
        panic!("DCKPT_TEST_S3_URL is not set: no S3 server to test against (cargo xtask test starts one)");
    }
    fail_each_operation("s3");
}

#[test]
fn background_saves_of_consecutive_steps_with_retention() {
    let (root, _dir) = fresh("local");
    let policy = RetentionPolicy { keep_last: Some(2), keep_every: Some(3) };
    let log = on_ranks(&root, policy, |m, r| {
        let mut seen = Vec::new();
        for step in 1..=8 {
            let (t, b) = piece(r, step);
            let pending = m.save_async(step, &SaveState::new().tensor(t, &b), &opts())?;
            assert_eq!(m.in_flight(), Some(step));
            let removed = if step % 2 == 0 {
                pending.wait()?.removed
            } else {
                // A second save into the step in flight waits for it, then is refused.
                let again = m.save_async(step, &SaveState::new(), &opts());
                assert!(
                    matches!(again.as_ref().map_err(Error::kind), Err(ErrorKind::AlreadyExists { .. })),
                    "step {step}: {again:?}"
                );
                Vec::new()
            };
            assert!(!removed.contains(&step));
            seen.push((step, removed));
        }
        Ok(seen)
    })
    .expect("background saves");
    assert_eq!(log.len(), 8);
    assert_eq!(committed(&root), BTreeSet::from([3, 6, 7, 8]));
    assert_eq!(load_latest_checked(&root), Some(8));
    let p: dckpt::LatestPointer = serde_json::from_slice(&root.get(LATEST_NAME).unwrap()).unwrap();
    assert_eq!((p.step, p.directory.as_str()), (8, step_dir(8).as_str()));
}

#[test]
fn latest_skips_damaged_and_uncommitted_steps_and_names_them() {
    let (root, _dir) = fresh("memory");
    for step in 1..=3 {
        on_ranks(&root, RetentionPolicy::KEEP_ALL, |m, r| save_step(m, r, step)).unwrap();
    }
    // The pointer never goes back to an older step while the newer one is committed.
    let pointer = || -> dckpt::LatestPointer { serde_json::from_slice(&root.get(LATEST_NAME).unwrap()).unwrap() };
    assert_eq!(pointer().step, 3);
    dckpt::manager::write_pointer(&root, 2, "older").unwrap();
    assert_eq!(pointer().step, 3);
    // Step 3's metadata is damaged, step 4 never committed.
    let meta = format!("{}/dckpt.meta", step_dir(3));
    let mut bytes = root.get(&meta).unwrap().to_vec();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    root.put(&meta, Bytes::from(bytes)).unwrap();
    root.put(&format!("{}/stray", step_dir(4)), Bytes::from_static(b"x")).unwrap();
    let latest = on_ranks(&root, RetentionPolicy::KEEP_ALL, |m, _| m.latest()).unwrap();
    assert_eq!(latest.step, Some(2));
    let skipped: Vec<u64> = latest.skipped.iter().map(|s| s.step).collect();
    assert_eq!(skipped, [3, 4], "{latest:?}");
    assert!(latest.skipped[0].reason.starts_with("damaged"), "{latest:?}");
    assert_eq!(load_latest_checked(&root), Some(2));
    // Saving into the damaged step is allowed (it is not committed): the damaged checkpoint
    // is removed first (it refused every save of step 3); then it is the latest.
    on_ranks(&root, RetentionPolicy::KEEP_ALL, |m, r| save_step(m, r, 3)).unwrap();
    assert_eq!(load_latest_checked(&root), Some(3));
    // Likewise a step whose metadata reads but one of whose data files is gone.
    let data = root.list(&step_dir(3)).unwrap().into_iter().find(|o| !o.path.ends_with("dckpt.meta")).unwrap();
    root.delete(&data.path).unwrap();
    assert_eq!(load_latest_checked(&root), Some(2));
    on_ranks(&root, RetentionPolicy::KEEP_ALL, |m, r| save_step(m, r, 3)).unwrap();
    assert_eq!(load_latest_checked(&root), Some(3));
    // gc keeps step 4: it is newer than the newest commit (a save may be running there).
    let report = on_ranks(&root, RetentionPolicy::KEEP_ALL, |m, _| m.gc()).unwrap();
    assert!(report.steps.is_empty(), "{report:?}");
    assert!(scan(&root).unwrap().iter().any(|s| s.step == 4 && !s.committed()));
}

/// A rank 0 that is late on the run root (stalled in its storage) is named by the others with
/// the run root's phase, not only the call they waited in.
#[test]
fn a_late_rank_0_is_named_with_the_run_roots_phase() {
    use std::time::Duration;
    let opts = dckpt::CollectiveOptions { timeout: Duration::from_millis(300), ..Default::default() };
    let root: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    let results = ThreadGroup::run(2, &opts, |r, c| {
        let run = dckpt::RunRoot::open(Arc::new(c), root.clone()).expect("open");
        if r == 0 {
            std::thread::sleep(Duration::from_millis(1200));
        }
        run.latest().map(|_| ())
    })
    .expect("threads");
    let e = results[1].as_ref().expect_err("rank 1 waited for rank 0 past the timeout").to_string();
    assert!(e.contains("rank 0") && e.contains("'run root: latest'"), "{e}");
}

/// A memory root with steps `1..=n` saved, every one kept.
fn saved_steps(n: u64) -> (Arc<dyn Storage>, Option<tempfile::TempDir>) {
    let (root, dir) = fresh("memory");
    for step in 1..=n {
        on_ranks(&root, RetentionPolicy::KEEP_ALL, |m, r| save_step(m, r, step)).unwrap();
    }
    (root, dir)
}

/// The metadata file of `step` under a run root.
fn meta_of(step: u64) -> String {
    format!("{}/dckpt.meta", step_dir(step))
}

/// A store whose `get` of one path fails as a refused read would (permissions, I/O); or,
/// with `lost_replies`, whose next conditional writes of that path land and then report a
/// transient failure (the reply lost) while its reads pass.
#[derive(Debug)]
struct RefusingGet {
    inner: Arc<dyn Storage>,
    path: String,
    refuse_get: bool,
    refuse_delete: bool,
    lost_replies: std::sync::atomic::AtomicU32,
}

impl RefusingGet {
    fn new(inner: Arc<dyn Storage>, path: String) -> RefusingGet {
        RefusingGet { inner, path, refuse_get: true, refuse_delete: false, lost_replies: 0.into() }
    }

    /// A store whose `delete` of `path` is refused (permissions), its reads passing.
    fn refusing_delete(inner: Arc<dyn Storage>, path: String) -> RefusingGet {
        RefusingGet { refuse_get: false, refuse_delete: true, ..RefusingGet::new(inner, path) }
    }

    fn losing_replies(inner: Arc<dyn Storage>, path: String) -> RefusingGet {
        RefusingGet { refuse_get: false, ..RefusingGet::new(inner, path) }
    }

    /// Passes `landed` on, unless a lost reply is due: then a transient error instead.
    fn reply(&self, path: &str, landed: dckpt::storage::Result<()>) -> dckpt::storage::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        if path != self.path || self.lost_replies.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_err() {
            return landed;
        }
        landed?;
        Err(dckpt::storage::Error::Transient {
            path: self.location(path),
            op: "put".into(),
            source: "reply lost".into(),
        })
    }
}

impl Storage for RefusingGet {
    fn location(&self, path: &str) -> String {
        self.inner.location(path)
    }
    fn put(&self, path: &str, data: Bytes) -> dckpt::storage::Result<()> {
        self.inner.put(path, data)
    }
    fn put_if_absent(&self, path: &str, data: Bytes) -> dckpt::storage::Result<()> {
        self.reply(path, self.inner.put_if_absent(path, data))
    }
    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> dckpt::storage::Result<()> {
        self.reply(path, self.inner.put_if_match(path, data, expected))
    }
    fn writer(
        &self,
        path: &str,
        options: &dckpt::storage::WriterOptions,
    ) -> dckpt::storage::Result<Box<dyn dckpt::storage::ObjectWriter>> {
        self.inner.writer(path, options)
    }
    fn get(&self, path: &str) -> dckpt::storage::Result<Bytes> {
        if path == self.path && self.refuse_get {
            return Err(dckpt::storage::Error::Permanent {
                path: self.location(path),
                op: "get".into(),
                source: "Permission denied (os error 13)".into(),
            });
        }
        self.inner.get(path)
    }
    fn get_ranges(&self, path: &str, ranges: &[std::ops::Range<u64>]) -> dckpt::storage::Result<Vec<Bytes>> {
        self.inner.get_ranges(path, ranges)
    }
    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> dckpt::storage::Result<()> {
        self.inner.read_into(path, reads)
    }
    fn reader_sized(&self, path: &str, len: u64) -> dckpt::storage::Result<Box<dyn dckpt::storage::ObjectReader + '_>> {
        self.inner.reader_sized(path, len)
    }
    fn hints(&self) -> dckpt::storage::StorageHints {
        self.inner.hints()
    }
    fn prefetch(&self, path: &str, at: u64, len: u64) {
        self.inner.prefetch(path, at, len)
    }
    fn size(&self, path: &str) -> dckpt::storage::Result<u64> {
        self.inner.size(path)
    }
    fn list(&self, prefix: &str) -> dckpt::storage::Result<Vec<dckpt::storage::ObjectInfo>> {
        self.inner.list(prefix)
    }
    fn delete(&self, path: &str) -> dckpt::storage::Result<()> {
        if path == self.path && self.refuse_delete {
            return Err(dckpt::storage::Error::Permanent {
                path: self.location(path),
                op: "delete".into(),
                source: "Permission denied (os error 13)".into(),
            });
        }
        self.inner.delete(path)
    }
    fn list_abandoned(&self, prefix: &str) -> dckpt::storage::Result<Vec<dckpt::storage::ObjectInfo>> {
        self.inner.list_abandoned(prefix)
    }
    fn remove_abandoned(&self, prefix: &str) -> dckpt::storage::Result<Vec<dckpt::storage::ObjectInfo>> {
        self.inner.remove_abandoned(prefix)
    }
}

/// A step gc cannot remove (its metadata's delete refused) is named in the report's errors,
/// and gc goes on: the other step it removes is removed and reported. It stopped at the
/// first such step, and its caller heard nothing of what it had removed before.
#[test]
fn gc_names_a_step_it_cannot_remove_and_removes_the_rest() {
    let inner: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    for step in 1..=3 {
        on_ranks(&inner, RetentionPolicy::KEEP_ALL, |m, r| save_step(m, r, step)).unwrap();
    }
    let root: Arc<dyn Storage> = Arc::new(RefusingGet::refusing_delete(inner.clone(), meta_of(1)));
    let opts = dckpt::GcOptions {
        policy: RetentionPolicy { keep_last: Some(1), ..RetentionPolicy::KEEP_ALL },
        ..Default::default()
    };
    let report = dckpt::manager::gc_root(&root, &opts, &mut |_| {}).unwrap();
    let removed: Vec<u64> = report.steps.iter().map(|s| s.step).collect();
    assert_eq!(removed, [2]);
    assert!(
        matches!(&report.errors[..], [e] if e.starts_with("step 1:") && e.contains("Permission denied")),
        "{:?}",
        report.errors
    );
    assert_eq!(committed(&inner), [1, 3].into());
}

/// The pointer's write retried after its first attempt landed (its reply lost) reports
/// `AlreadyExists` (a create) or `Precondition` (a replace), as the storage contract warns:
/// the manager compares what is stored. It failed the step on every rank after it had
/// committed, and retention was skipped.
#[test]
fn a_pointer_write_whose_reply_was_lost_and_retried_succeeds() {
    use dckpt::storage::{RetryPolicy, Retrying};
    let (inner, _dir) = fresh("memory");
    let lossy = Arc::new(RefusingGet::losing_replies(inner.clone(), LATEST_NAME.to_string()));
    let policy = RetryPolicy { attempts_max: 3, backoff_initial_ms: 1, backoff_max_ms: 1 };
    let root: Arc<dyn Storage> = Arc::new(Retrying::new(lossy.clone(), policy));
    for step in 1..=3 {
        lossy.lost_replies.store(1, std::sync::atomic::Ordering::SeqCst);
        let removed =
            on_ranks(&root, KEEP_2, |m, r| save_step(m, r, step)).unwrap_or_else(|e| panic!("step {step}: {e}"));
        assert_eq!(removed, if step == 3 { vec![1] } else { vec![] }, "step {step}");
        assert_eq!(lossy.lost_replies.load(std::sync::atomic::Ordering::SeqCst), 0, "no reply was lost");
    }
    let pointer: dckpt::LatestPointer = serde_json::from_slice(&inner.get(LATEST_NAME).unwrap()).unwrap();
    assert_eq!(pointer.step, 3);
    assert_eq!(load_latest_checked(&inner), Some(3));
}

/// A pointer the store will not give (a permission, a directory in its place) is a note: the
/// listing decides the latest step. It failed `ls` and every restart.
#[test]
fn a_pointer_that_cannot_be_read_is_passed_over() {
    let (inner, _dir) = saved_steps(2);
    let root: Arc<dyn Storage> = Arc::new(RefusingGet::new(inner, LATEST_NAME.to_string()));
    let (latest, _) = dckpt::manager::resolve_latest(&root).unwrap();
    assert_eq!(latest.step, Some(2), "{latest:?}");
    assert!(!latest.from_pointer, "{latest:?}");
    assert!(latest.skipped.iter().any(|s| s.reason.contains("Permission denied")), "{latest:?}");
}

/// gc removes a step whose metadata is damaged, but keeps one whose metadata it could not
/// judge: refused by the store (a permission or I/O error) or of a newer format. Both were
/// once called damaged, and gc deleted whole checkpoints it merely failed to read.
#[test]
fn gc_keeps_steps_it_cannot_read_and_removes_damaged_ones() {
    let (inner, _dir) = saved_steps(4);
    let meta = meta_of;
    // Step 1: a format version this build does not read (bytes 8..12 of the framing).
    let mut newer = inner.get(&meta(1)).unwrap().to_vec();
    newer[8..12].copy_from_slice(&99u32.to_le_bytes());
    inner.put(&meta(1), Bytes::from(newer)).unwrap();
    // Step 3: damaged (its last byte, under the framing's checksum).
    let mut damaged = inner.get(&meta(3)).unwrap().to_vec();
    *damaged.last_mut().unwrap() ^= 0xff;
    inner.put(&meta(3), Bytes::from(damaged)).unwrap();
    // Step 2: the store refuses to read its metadata.
    let root: Arc<dyn Storage> = Arc::new(RefusingGet::new(inner.clone(), meta(2)));

    let steps = scan(&root).unwrap();
    let problem = |step: u64| steps.iter().find(|s| s.step == step).unwrap().state.problem().unwrap_or_default();
    assert!(problem(1).starts_with("unreadable here, kept:") && problem(1).contains("version 99"), "{}", problem(1));
    assert!(
        problem(2).starts_with("unreadable here, kept:") && problem(2).contains("Permission denied"),
        "{}",
        problem(2)
    );
    assert!(problem(3).starts_with("damaged"), "{}", problem(3));

    let report = dckpt::manager::gc_root(&root, &dckpt::GcOptions::default(), &mut |_| {}).unwrap();
    let removed: Vec<(u64, dckpt::RemovalReason)> = report.steps.iter().map(|s| (s.step, s.reason)).collect();
    assert_eq!(removed, [(3, dckpt::RemovalReason::Damaged)]);
    let left: Vec<u64> = scan(&inner).unwrap().iter().map(|s| s.step).collect();
    assert_eq!(left, [1, 2, 4]);
    // Once readable again, step 2 is the committed checkpoint it always was.
    assert!(committed(&inner).contains(&2));
}

/// A file whose name the store will not take (a backslash: put there by hand) in a step gc
/// removes is left, and gc goes on to the rest of its work, where it failed at that file,
/// after the step's metadata, on every run.
#[test]
fn gc_leaves_a_name_it_cannot_remove_and_goes_on() {
    let (root, dir) = fresh("local");
    let dir = dir.expect("a local root");
    for step in 1..=3 {
        on_ranks(&root, RetentionPolicy::KEEP_ALL, |m, r| save_step(m, r, step)).unwrap();
    }
    let odd = dir.path().join(step_dir(1)).join("old\\notes");
    std::fs::write(&odd, b"by hand").unwrap();
    let opts = dckpt::GcOptions {
        policy: RetentionPolicy { keep_last: Some(1), ..RetentionPolicy::KEEP_ALL },
        ..Default::default()
    };
    let report = dckpt::manager::gc_root(&root, &opts, &mut |_| {}).unwrap();
    let removed: Vec<u64> = report.steps.iter().map(|s| s.step).collect();
    assert_eq!(removed, [1, 2]);
    assert!(odd.exists(), "left as it was");
    assert_eq!(committed(&root), [3].into());
    assert!(!dir.path().join(meta_of(2)).exists(), "step 2 went too");
}

/// Ranks given different steps are refused on every rank before anything is written (rank
/// 1's data files once went to another step's directory than the metadata rank 0
/// committed, and the save succeeded).
#[test]
fn ranks_saving_different_steps_are_refused_on_every_rank() {
    let (root, _dir) = fresh("memory");
    let e = on_ranks(&root, RetentionPolicy::KEEP_ALL, |m, r| save_step(m, r, 100 + r)).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidOptions { .. }), "{e}");
    assert!(e.to_string().contains("different steps, from 100 to 101"), "{e}");
    assert!(root.list("").unwrap().is_empty(), "something was written");
}

/// A replace that one rank alone asks for is refused on that rank, and every other rank is
/// told which rank stopped, at once: on the old code the refusing rank returned before the
/// step's first collective, and the others learnt only that it was gone from it (a process
/// that lives on, as a training job does, left them waiting until their timeout).
#[test]
fn a_replace_asked_by_one_rank_is_refused_on_every_rank() {
    let (root, _dir) = fresh("memory");
    let ranks = ThreadGroup::new(WORLD).expect("thread group");
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|c| {
                let root = &root;
                s.spawn(move || {
                    let rank = c.rank() as u64;
                    let m = CheckpointManager::new(Arc::new(c), root, RetentionPolicy::KEEP_ALL).unwrap();
                    let (t, b) = piece(rank, 5);
                    let opts = SaveOptions { replace: rank == 1, ..opts() };
                    m.save(5, &SaveState::new().tensor(t, &b), &opts).unwrap_err().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    assert!(errors[1].contains("step 5: a managed step is saved once"), "{}", errors[1]);
    assert!(errors[0].contains("rank 1 refused to go on"), "{}", errors[0]);
    assert!(root.list("").unwrap().is_empty(), "something was written");
}

/// A restart says which newer steps it passed over (a damaged one, one never committed),
/// and refuses to pass over one it cannot read (it may be whole: resuming before it lost
/// its progress without a word).
#[test]
fn a_restart_names_the_newer_steps_it_passes_over_and_stops_at_one_it_cannot_read() {
    let (inner, _dir) = saved_steps(3);
    let meta = meta_of;
    let mut damaged = inner.get(&meta(3)).unwrap().to_vec();
    *damaged.last_mut().unwrap() ^= 0xff;
    inner.put(&meta(3), Bytes::from(damaged)).unwrap();
    let restore = |root: &Arc<dyn Storage>| {
        on_ranks(root, RetentionPolicy::KEEP_ALL, |m, _| {
            let mut whole = vec![0u8; (ROWS * COLS * 4) as usize];
            let mut req = LoadRequest::new().tensor(ShardedTensor::whole("w", DType::F32, [ROWS, COLS]), &mut whole);
            m.load_latest(&mut req, &LoadOptions::default())
        })
    };
    let r = restore(&inner).unwrap().expect("a step");
    assert_eq!(r.step, 2);
    assert!(r.fallbacks.iter().any(|f| f.starts_with("step 3: damaged")), "{:?}", r.fallbacks);
    // Step 4's metadata cannot be read here: the restart stops, naming it.
    on_ranks(&inner, RetentionPolicy::KEEP_ALL, |m, r| save_step(m, r, 4)).unwrap();
    let refusing: Arc<dyn Storage> = Arc::new(RefusingGet::new(inner.clone(), meta(4)));
    let e = restore(&refusing).unwrap_err().to_string();
    assert!(
        e.contains("step 4 is newer than the latest step it could read (2)") && e.contains("Permission denied"),
        "{e}"
    );
    assert_eq!(restore(&inner).unwrap().map(|r| r.step), Some(4));
}

/// A save started through the manager's checkpointer, in flight when the manager's own
/// call begins: the manager waits for it before its run root's collectives, which shared
/// the wire with the save's and failed (or waited out the timeout) on every rank.
#[test]
fn a_save_in_flight_through_the_checkpointer_is_waited_for() {
    let (root, _dir) = fresh("memory");
    let config = FaultConfig { latency_min_ms: 300, latency_max_ms: 300, ..FaultConfig::default() };
    let slow: Arc<dyn Storage> = Arc::new(FaultStorage::new(Arc::new(MemoryStorage::new()), config));
    let opts_c = dckpt::CollectiveOptions { timeout: std::time::Duration::from_secs(30), ..Default::default() };
    let started = std::time::Instant::now();
    let results = ThreadGroup::run(WORLD, &opts_c, |r, c| -> dckpt::Result<u64> {
        let m = CheckpointManager::new(Arc::new(c), &root, RetentionPolicy::default())?;
        let (t, b) = piece(r as u64, 1);
        let elsewhere = m.checkpointer().save_async(slow.clone(), &SaveState::new().tensor(t, &b), &opts())?;
        // Rank 0 begins the step while its save waits on the slow storage; rank 1 after.
        std::thread::sleep(std::time::Duration::from_millis(if r == 0 { 0 } else { 1500 }));
        let steps = save_step(&m, r as u64, 1).map(|_| 1)?;
        elsewhere.wait()?;
        Ok(steps)
    })
    .expect("threads");
    for (r, res) in results.into_iter().enumerate() {
        assert_eq!(res.map_err(|e| e.to_string()), Ok(1), "rank {r}");
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "ranks waited for the timeout");
    assert_eq!(committed(&root), BTreeSet::from([1]));
    assert!(slow.size(dckpt::format::META_NAME).is_ok(), "the other save committed");
}

/// A step's objects are deleted several at once: every rank waits for retention, and one
/// delete after another (a file per rank or more, on an object store) ran past the
/// collective's timeout. Here each operation takes 200 ms: 32 objects one by one take 6.4 s
/// at least.
#[test]
fn a_steps_objects_are_deleted_several_at_once() {
    let config = FaultConfig { latency_min_ms: 200, latency_max_ms: 200, ..FaultConfig::default() };
    let inner: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    for i in 0..32 {
        inner.put(&format!("{}/f{i:02}", step_dir(3)), Bytes::from_static(b"x")).unwrap();
    }
    inner.put(&format!("{}/{}", step_dir(3), dckpt::format::META_NAME), Bytes::from_static(b"m")).unwrap();
    let root: Arc<dyn Storage> = Arc::new(FaultStorage::new(inner.clone(), config));
    let (started, mut reported) = (std::time::Instant::now(), 0);
    dckpt::manager::delete_step(&root, 3, &mut |n| reported += n).expect("deleted");
    let took = started.elapsed();
    assert_eq!(inner.list("").unwrap(), Vec::new());
    assert_eq!(reported, 33, "every object deleted is reported");
    assert!(took < std::time::Duration::from_secs(3), "took {took:?}");
}
