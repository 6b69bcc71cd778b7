//! Saves racing into one place, with and without replace, on memory, local disk and S3 (when
//! `DCKPT_TEST_S3_URL` is set): of the saves that found the same state there exactly one
//! commits, every other fails with `AlreadyExists` on every one of its ranks and leaves
//! nothing behind, and no committed checkpoint ever loses a file.

use std::collections::BTreeSet;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::handmade::Handmade;
use dckpt_engine::format::META_NAME;
use dckpt_engine::verify::verify;
use dckpt_engine::{ErrorKind, Result, SaveOptions, SaveOutcome, read_metadata_local};
use dckpt_storage::{MemoryStorage, Storage};
use dckpt_tests::hooked;

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

/// How long a commit waits at the gate for the others before it goes on alone.
const GATE_TIMEOUT: Duration = Duration::from_secs(30);

/// Holds every write of the metadata file until `expected` of them have arrived, so that the
/// racing saves all plan before any commits: they all found the same state there.
#[derive(Debug)]
struct Gate {
    expected: usize,
    arrived: Mutex<usize>,
    all_here: Condvar,
}

impl Gate {
    fn new(expected: usize) -> Arc<Gate> {
        Arc::new(Gate { expected, arrived: Mutex::new(0), all_here: Condvar::new() })
    }

    /// `inner`, its puts held at this gate.
    fn store(self: &Arc<Self>, inner: &Arc<dyn Storage>) -> Arc<dyn Storage> {
        let gate = self.clone();
        hooked(inner.clone(), move |call, path| {
            if call.puts() {
                gate.wait(path)
            }
        })
    }

    fn wait(&self, path: &str) {
        if path != META_NAME {
            return;
        }
        let mut n = self.arrived.lock().expect("gate");
        *n += 1;
        self.all_here.notify_all();
        let (n, timeout) = self.all_here.wait_timeout_while(n, GATE_TIMEOUT, |n| *n < self.expected).expect("gate");
        assert!(!timeout.timed_out(), "only {} of {} commits reached the gate", *n, self.expected);
    }

    fn arrived(&self) -> usize {
        *self.arrived.lock().expect("gate")
    }
}

fn s3_url() -> Option<String> {
    std::env::var("DCKPT_TEST_S3_URL").ok().filter(|u| !u.is_empty())
}

/// A fresh store of `kind` (`memory`, `local`, `s3`) and what must outlive it.
fn backend(kind: &str) -> (Arc<dyn Storage>, Option<tempfile::TempDir>) {
    match kind {
        "memory" => (Arc::new(MemoryStorage::new()), None),
        "local" => {
            let dir = tempfile::tempdir().expect("tempdir");
            (dckpt_storage::open(dir.path().to_str().expect("utf-8")).expect("open"), Some(dir))
        }
        _ => {
            static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_nanos();
            let base = s3_url().expect("DCKPT_TEST_S3_URL");
            let url = format!("{}/race-{}-{nanos}-{n}", base.trim_end_matches('/'), std::process::id());
            (dckpt_storage::open(&url).expect("open s3"), None)
        }
    }
}

/// The jobs of one round: different worlds and contents, so a checkpoint names its writer.
fn jobs(round: u64) -> Vec<Handmade> {
    [1, 2, 3, 2].iter().enumerate().map(|(j, &w)| Handmade::new(w, 1000 * round + j as u64)).collect()
}

/// Runs every job's save at once; each job's outcome on each of its ranks.
fn race(jobs: &[Handmade], storage: &Arc<dyn Storage>, replace: &[bool]) -> Vec<Vec<Result<SaveOutcome>>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .zip(replace)
            .map(|(job, &replace)| s.spawn(move || job.save_all(storage, &SaveOptions { replace, ..OPTS })))
            .collect();
        handles.into_iter().map(|h| h.join().expect("job")).collect()
    })
}

/// Exactly one job committed, on every rank; every other failed with `AlreadyExists` on every
/// rank. Returns the winner's index.
fn one_winner(results: &[Vec<Result<SaveOutcome>>], what: &str) -> usize {
    let winners: Vec<usize> = (0..results.len()).filter(|&j| results[j].iter().any(|r| r.is_ok())).collect();
    assert_eq!(winners.len(), 1, "{what}: one job commits, got {winners:?}: {results:?}");
    let w = winners[0];
    let id = &results[w][0].as_ref().expect("the winner's rank 0").save_id;
    for (r, res) in results[w].iter().enumerate() {
        assert_eq!(&res.as_ref().expect("every rank of the winner succeeds").save_id, id, "{what}: rank {r}");
    }
    for (j, job) in results.iter().enumerate().filter(|(j, _)| *j != w) {
        for (r, res) in job.iter().enumerate() {
            assert!(
                matches!(res, Err(e) if e.rank() == Some(0) && matches!(e.kind(), ErrorKind::AlreadyExists { .. })),
                "{what}: job {j} rank {r} must fail with AlreadyExists from the coordinator, got {res:?}"
            );
        }
    }
    w
}

/// The committed checkpoint is `winner`'s, sound, bit-exact, and the store holds exactly its
/// metadata and data files: the losers' files and the replaced checkpoint's are gone.
fn check_committed(inner: &Arc<dyn Storage>, winner: &Handmade, save_id: &str, what: &str) {
    let meta = read_metadata_local(inner.as_ref()).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(meta.save_id, save_id, "{what}: the winner's metadata is committed");
    let report = verify(inner.as_ref(), |_| {}).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(report.ok(), "{what}: the committed checkpoint lost or damaged a file: {report:?}");
    assert!(report.leftovers.is_empty(), "{what}: files left behind: {:?}", report.leftovers);
    winner.load_check1(inner).unwrap_or_else(|e| panic!("{what}: {e}"));
    let stored: BTreeSet<String> = inner.list("").expect("list").into_iter().map(|o| o.path).collect();
    let named: BTreeSet<String> = meta.files.iter().map(|f| f.name.clone()).chain([META_NAME.to_string()]).collect();
    assert_eq!(stored, named, "{what}: exactly the metadata and its files");
}

/// Saves that do not ask to replace, all into one empty place at once, several rounds.
fn racing_creates(kind: &str, rounds: u64) {
    for round in 0..rounds {
        let what = format!("{kind}, creates, round {round}");
        let (inner, _dir) = backend(kind);
        let jobs = jobs(round);
        let gate = Gate::new(jobs.len());
        let raced: Arc<dyn Storage> = gate.store(&inner);
        let results = race(&jobs, &raced, &vec![false; jobs.len()]);
        assert_eq!(gate.arrived(), jobs.len(), "{what}: every job reached its commit");
        let w = one_winner(&results, &what);
        check_committed(&inner, &jobs[w], &results[w][0].as_ref().expect("winner").save_id, &what);
    }
}

/// Replacing saves, all into one place at once, several rounds: each round replaces the
/// previous round's checkpoint. With `mixed`, every other job does not ask to replace (it
/// fails at its plan once a checkpoint is there, or at the commit in the first round).
fn racing_replaces(kind: &str, rounds: u64, mixed: bool) {
    let (inner, _dir) = backend(kind);
    for round in 0..rounds {
        let what = format!("{kind}, replaces (mixed {mixed}), round {round}");
        let jobs = jobs(round);
        let replace: Vec<bool> = (0..jobs.len()).map(|j| !mixed || j % 2 == 0).collect();
        // Saves that do not replace stop at their plan when a checkpoint is there.
        let committing = if round == 0 { jobs.len() } else { replace.iter().filter(|r| **r).count() };
        let gate = Gate::new(committing);
        let raced: Arc<dyn Storage> = gate.store(&inner);
        let results = race(&jobs, &raced, &replace);
        assert_eq!(gate.arrived(), committing, "{what}: the saves that plan to commit reach the commit");
        let w = one_winner(&results, &what);
        assert!(round == 0 || replace[w], "{what}: a save that did not ask to replace replaced");
        check_committed(&inner, &jobs[w], &results[w][0].as_ref().expect("winner").save_id, &what);
    }
}

/// Replacing saves with no gate: each job saves several times in a row while the others do.
/// Every save commits or fails with `AlreadyExists`, and whatever is committed at the end is
/// sound, the last commit, and the only thing stored.
fn free_for_all(kind: &str, saves_per_job: u64) {
    let what = format!("{kind}, free for all");
    let (inner, _dir) = backend(kind);
    let jobs = jobs(7);
    let outcomes: Vec<Vec<(usize, Result<SaveOutcome>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .enumerate()
            .map(|(j, job)| {
                let inner = &inner;
                s.spawn(move || {
                    let mut mine = Vec::new();
                    for _ in 0..saves_per_job {
                        let results = job.save_all(inner, &SaveOptions { replace: true, ..OPTS });
                        let ok = results[0].is_ok();
                        assert!(results.iter().all(|r| r.is_ok() == ok), "{j}: ranks disagree: {results:?}");
                        mine.push((j, results.into_iter().next().expect("rank 0")));
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("job")).collect()
    });
    let mut committed = BTreeSet::new();
    for (j, res) in outcomes.into_iter().flatten() {
        match res {
            Ok(o) => {
                committed.insert((o.save_id, j));
            }
            Err(e) if matches!(e.kind(), ErrorKind::AlreadyExists { .. }) => {}
            Err(e) => panic!("{what}: job {j}: only AlreadyExists may stop a replacing save here: {e}"),
        }
    }
    assert!(!committed.is_empty(), "{what}: nothing committed");
    let meta = read_metadata_local(inner.as_ref()).expect("a checkpoint");
    let (_, j) = committed.iter().find(|(id, _)| *id == meta.save_id).expect("the checkpoint is a committed save's");
    check_committed(&inner, &jobs[*j], &meta.save_id, &what);
    eprintln!("{what}: {} of {} saves committed", committed.len(), jobs.len() as u64 * saves_per_job);
}

#[test]
fn racing_creates_have_one_winner_per_round() {
    racing_creates("memory", 10);
    racing_creates("local", 5);
}

#[test]
fn racing_replaces_have_one_winner_per_round() {
    racing_replaces("memory", 10, false);
    racing_replaces("local", 5, false);
}

#[test]
fn racing_replaces_and_creates_have_one_winner_per_round() {
    racing_replaces("memory", 6, true);
    racing_replaces("local", 4, true);
}

#[test]
fn replacing_saves_racing_freely_never_lose_a_committed_file() {
    free_for_all("memory", 8);
    free_for_all("local", 4);
}

#[test]
fn racing_saves_on_s3() {
    if s3_url().is_none() {
        panic!("DCKPT_TEST_S3_URL is not set: no S3 server to test against (cargo xtask test starts one)");
    }
    racing_creates("s3", 3);
    racing_replaces("s3", 3, false);
    racing_replaces("s3", 2, true);
    free_for_all("s3", 3);
}

/// A replacing save that planned over one checkpoint while another save replaced it fails at
/// its commit and deletes nothing: the other save's checkpoint is whole.
#[test]
fn a_replace_never_deletes_a_checkpoint_committed_after_it_planned() {
    for kind in ["memory", "local"] {
        let (inner, _dir) = backend(kind);
        let (first, slow, fast) = (Handmade::new(2, 1), Handmade::new(2, 2), Handmade::new(3, 3));
        for r in first.save_all(&inner, &OPTS) {
            r.expect("first");
        }
        // The slow save's commit waits until the fast one has committed.
        let gate = Gate::new(2);
        let slow_store: Arc<dyn Storage> = gate.store(&inner);
        let (slow_res, fast_res) = std::thread::scope(|s| {
            let slow_job = s.spawn(|| slow.save_all(&slow_store, &SaveOptions { replace: true, ..OPTS }));
            // Once the slow save is at its commit (it planned over `first`), the fast one
            // replaces `first` and then lets the slow one go on.
            let fast_job = s.spawn(|| {
                while gate.arrived() == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let res = fast.save_all(&inner, &SaveOptions { replace: true, ..OPTS });
                gate.wait(META_NAME);
                res
            });
            (slow_job.join().expect("slow"), fast_job.join().expect("fast"))
        });
        let id = fast_res[0].as_ref().expect("the fast save commits").save_id.clone();
        for (r, res) in slow_res.iter().enumerate() {
            assert!(
                matches!(res, Err(e) if matches!(e.kind(), ErrorKind::AlreadyExists { .. })),
                "{kind}: slow rank {r}: {res:?}"
            );
        }
        check_committed(&inner, &fast, &id, kind);
    }
}

/// A training loop's replacing saves with the plan reused (one engine per rank): each
/// replaces the last and removes its files; one that planned before another save committed
/// fails at its commit and leaves that save's checkpoint whole.
#[test]
fn replacing_saves_with_a_reused_plan() {
    let (inner, _dir) = backend("local");
    let world = 3;
    let states: Vec<Handmade> = (0..4).map(|i| Handmade::new(world, 50 + i)).collect();
    let other = Handmade::new(2, 99);
    let gate = Gate::new(2);
    let gated: Arc<dyn Storage> = gate.store(&inner);
    let opts = SaveOptions { replace: true, ..OPTS };
    let (loop_results, other_result) = std::thread::scope(|s| {
        let job = s.spawn(|| {
            dckpt_tests::run_ranks(world, |r, c| {
                let engine = dckpt_engine::Engine::new(c);
                let mut out = Vec::new();
                for (i, state) in states.iter().enumerate() {
                    // The last save's commit waits at the gate for the other job's commit.
                    let storage = if i + 1 == states.len() { gated.as_ref() } else { inner.as_ref() };
                    out.push(state.save(&engine, storage, r, &opts));
                    if i + 2 < states.len() {
                        // Nothing else runs yet: what is committed is this save, alone.
                        engine_checked(&inner, state, &out[i], r);
                    }
                }
                out
            })
        });
        let interloper = s.spawn(|| {
            while gate.arrived() == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            let res = other.save_all(&inner, &opts);
            gate.wait(META_NAME);
            res
        });
        (job.join().expect("loop"), interloper.join().expect("other"))
    });
    for (r, results) in loop_results.iter().enumerate() {
        for (i, res) in results.iter().enumerate().skip(1) {
            assert!(i + 1 == results.len() || matches!(res, Ok(o) if o.plan_reused), "rank {r}, save {i}: {res:?}");
        }
        let last = results.last().expect("saves");
        assert!(
            matches!(last, Err(e) if e.rank() == Some(0) && matches!(e.kind(), ErrorKind::AlreadyExists { .. })),
            "rank {r}: {last:?}"
        );
    }
    let id = other_result[0].as_ref().expect("the other job commits").save_id.clone();
    check_committed(&inner, &other, &id, "after the reused plan lost");
}

/// On rank 0 of a loop: `state`'s save committed and is the only checkpoint stored.
fn engine_checked(inner: &Arc<dyn Storage>, state: &Handmade, res: &Result<SaveOutcome>, rank: usize) {
    let o = res.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    if rank == 0 {
        check_committed(inner, state, &o.save_id, &format!("save {}", o.save_id));
    }
}
