//! A rank stalled inside a storage call (blocked, not dead) at 64 ranks: every other rank
//! fails within the collective timeout plus a grace, naming the stalled rank and the phase
//! it did not reach; the stalled rank fails as soon as its storage call returns.
//!
//! The stalled rank itself waits for its storage call: its data file is written from the
//! caller's buffers (lent, not copied) by a writer thread that the save joins, so it cannot
//! return while that thread may still read them. A job whose rank stays stuck is ended by
//! its launcher once the others have failed (`dckpt launch` kills every rank at the first
//! failure; torchrun does the same).

use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use dckpt_collective::{CollectiveOptions, Error as CollectiveError, ThreadGroup};
use dckpt_engine::{Engine, ErrorKind, SaveOutcome, read_metadata_local};
use dckpt_layout::{ModelSpec, OptimizerMode, Synthetic};
use dckpt_reference::{RankState, save_options};
use dckpt_storage::{MemoryStorage, Storage};
use dckpt_tests::{Call, Setup, hooked};

const WORLD: usize = 64;
const TIMEOUT: Duration = Duration::from_secs(2);
/// Beyond the timeout: the other ranks' extra wait for rank 0's verdict (a quarter of the
/// timeout) and the scheduling of 64 threads on a small, shared machine.
const GRACE: Duration = Duration::from_secs(3);

/// Holds the first call to open `file` until released, and records when it began to.
#[derive(Default)]
struct Stall {
    since: OnceLock<Instant>,
    released: Mutex<bool>,
    cv: Condvar,
}

impl Stall {
    fn hold(&self) {
        let _ = self.since.set(Instant::now());
        let mut released = self.released.lock().unwrap();
        while !*released {
            released = self.cv.wait(released).unwrap();
        }
    }

    fn release(&self) {
        *self.released.lock().unwrap() = true;
        self.cv.notify_all();
    }
}

/// `inner`, stalling the opening of `victim`'s data file until `stall` is released.
fn stalling(inner: Arc<dyn Storage>, victim: usize, stall: &Arc<Stall>) -> Arc<dyn Storage> {
    let file = format!("-{victim:05}.safetensors");
    let stall = Arc::clone(stall);
    hooked(inner, move |call, path| {
        if call == Call::Writer && path.ends_with(&file) {
            stall.hold();
        }
    })
}

type Outcome = (dckpt_engine::Result<SaveOutcome>, Instant);

/// Saves `tiny` on 64 ranks with `victim` stalled in its data file's write; checks every
/// other rank's failure against the bound while it is stalled, then releases it and
/// returns its result and the store.
fn save_with_a_stalled_rank(victim: usize) -> (dckpt_engine::Result<SaveOutcome>, Arc<dyn Storage>) {
    let model = Setup::new(WORLD as u32, 2, 4, 1, 4, 1, OptimizerMode::Distributed)
        .model(&ModelSpec::preset("tiny").expect("tiny"));
    let stall = Arc::new(Stall::default());
    let inner: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    let storage = stalling(Arc::clone(&inner), victim, &stall);
    let opts = CollectiveOptions { timeout: TIMEOUT, ..CollectiveOptions::default() };
    let group = ThreadGroup::with_options(WORLD, &opts).expect("group");
    let (model, storage) = (&model, &storage);
    let result = thread::scope(|s| {
        let mut handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                s.spawn(move || -> Outcome {
                    let engine = Engine::new(Arc::new(c));
                    let state = RankState::filled(model, r as u32, Synthetic::new(5));
                    let result = engine.save(storage.as_ref(), &state.save_state(), &save_options(model));
                    (result, Instant::now())
                })
            })
            .collect();
        let stalled = handles.remove(victim);
        for (i, h) in handles.into_iter().enumerate() {
            let r = if i < victim { i } else { i + 1 };
            let (result, at) = h.join().expect("no rank panics");
            let since = *stall.since.get().unwrap_or_else(|| panic!("rank {victim} never opened its data file"));
            assert!(at - since <= TIMEOUT + GRACE, "rank {r} returned {:?} after rank {victim} stalled", at - since);
            check_names_the_stall(r, &result, victim);
        }
        assert!(!stalled.is_finished(), "rank {victim} returned while its storage call was stalled");
        let released = Instant::now();
        stall.release();
        let (result, at) = stalled.join().expect("the stalled rank does not panic");
        assert!(at - released <= GRACE, "rank {victim} took {:?} after its storage call returned", at - released);
        result
    });
    (result, inner)
}

/// `result` is a timeout naming `victim` and the phase the others waited for it in.
fn check_names_the_stall(r: usize, result: &dckpt_engine::Result<SaveOutcome>, victim: usize) {
    let e = match result {
        Ok(_) => panic!("rank {r} committed while rank {victim} was stalled"),
        Err(e) => e,
    };
    let text = e.to_string();
    match e.kind() {
        ErrorKind::Collective(CollectiveError::Timeout { rank, op, .. }) => {
            assert_eq!(*rank, victim, "rank {r}: {text}");
            assert!(op.contains("'save commit'"), "rank {r} does not name the phase: {text}");
        }
        other => panic!("rank {r}: expected a timeout naming rank {victim}, got {other:?}: {text}"),
    }
    assert!(text.contains(&format!("rank {victim}")) && text.contains("'save commit'"), "rank {r}: {text}");
}

// A rank blocked in its data file's write left the others waiting for it inside the commit:
// each must fail at the timeout, naming it and the phase, and so must it once unblocked.
#[test]
fn a_rank_stalled_in_its_write_is_named_with_the_phase_on_every_rank() {
    let (result, _) = save_with_a_stalled_rank(17);
    check_names_the_stall(17, &result, 17);
}

// The coordinator stalled in its own write: the others wait for its decision, and fail
// naming rank 0 a quarter of the timeout later than rank 0 would have named one of them.
// Released, it finds their parts and then their aborts queued, and must not commit on
// those parts what every other rank reported failed.
#[test]
fn a_stalled_coordinator_is_named_with_the_phase_on_every_rank_and_commits_nothing() {
    let (result, storage) = save_with_a_stalled_rank(0);
    check_names_the_stall(0, &result, 0);
    match read_metadata_local(storage.as_ref()) {
        Err(e) if matches!(e.kind(), ErrorKind::NotACheckpoint { .. }) => {}
        other => panic!("a save every rank reported failed left {other:?}"),
    }
}
