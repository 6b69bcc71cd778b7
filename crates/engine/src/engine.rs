//! One rank's engine: storage, collective, plan cache, and the background save.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use dckpt_collective::Collective;
use dckpt_storage::{OpenOptions, Storage};

use crate::load::{LoadOptions, LoadOutcome, LoadRequest, load, read_metadata};
use crate::local::{self, LocalRestoreOptions, LocalRestoreOutcome, LocalSaveOptions, LocalSaveOutcome};
use crate::protocol::{COORDINATOR, agree};
use crate::save::{ObjectData, PlanCache, SaveOptions, SaveOutcome, SaveState, SourcedTensor, TensorData, save};
use crate::{Error, ErrorKind, Result};

/// The checkpoint engine of one rank: its collective, its plan cache and its background
/// save. Every rank of the job makes the same calls in the same order (saves and loads are
/// collective). Each call names the checkpoint's storage (one checkpoint per storage root),
/// so one engine serves a whole training run and reuses its plan from step to step.
#[derive(Debug)]
pub struct Engine {
    inner: Arc<Mutex<Inner>>,
    in_flight: Mutex<Option<Arc<Slot>>>,
    // Copied out of the collective at construction, so that asking for them never waits
    // on the lock a background save holds.
    rank: usize,
    world_size: usize,
}

#[derive(Debug)]
struct Inner {
    collective: Arc<dyn Collective>,
    cache: PlanCache,
    /// The buffers of the last background save that asked to keep them
    /// ([`SaveOptions::keep_staging`]), in the order it used them.
    staging: Vec<Vec<u8>>,
}

/// What a background save of one or both tiers gave.
#[derive(Debug, Clone, Default)]
pub struct TieredOutcome {
    /// The persistent checkpoint's save, when it was asked for.
    pub persistent: Option<SaveOutcome>,
    /// The local step's save, when it was asked for and succeeded.
    pub local: Option<LocalSaveOutcome>,
    /// Why the local step was not saved, where its node-local storage failed and the
    /// persistent save went on (see [`Engine::save_tiers`]); the same on every rank.
    pub local_error: Option<Arc<Error>>,
}

/// The result of a background save: set once, taken once by its handle, or logged where
/// the handle was dropped before it was taken.
#[derive(Debug, Default)]
struct Slot {
    state: Mutex<SlotState>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct SlotState {
    done: bool,
    outcome: Option<Result<TieredOutcome>>,
    /// The handle was dropped unwaited: nobody will take the outcome.
    abandoned: bool,
}

impl Slot {
    fn wait_done(&self) -> std::sync::MutexGuard<'_, SlotState> {
        let mut s = self.lock();
        while !s.done {
            s = self.done.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, v: Result<TieredOutcome>) {
        let mut s = self.lock();
        s.done = true;
        match s.abandoned {
            true => log_abandoned(v),
            false => s.outcome = Some(v),
        }
        drop(s);
        self.done.notify_all();
    }

    fn is_done(&self) -> bool {
        self.lock().done
    }
}

/// A background save whose handle was dropped unwaited: its failure goes to the log, the
/// one place left to say it (the next save starts as if it had not been made).
fn log_abandoned(outcome: Result<TieredOutcome>) {
    if let Err(e) = outcome {
        log::error!("a background save whose handle was dropped without waiting failed: {e}");
    }
}

/// A save running in the background; [`SaveHandle::wait`] gives its outcome. Dropped
/// unwaited, the save still runs to its end (the next call of the engine waits for it),
/// and a failure is logged, since no caller can see it.
#[derive(Debug)]
#[must_use = "a background save's failure is seen only through its handle"]
pub struct SaveHandle {
    slot: Arc<Slot>,
}

impl SaveHandle {
    /// Blocks until the save has committed or failed.
    pub fn wait(self) -> Result<SaveOutcome> {
        let tiers = self.wait_tiers()?;
        tiers.persistent.ok_or_else(|| Error::usage("this background save wrote the local tier only"))
    }

    /// Blocks until every tier the save was asked for has committed, or one failed.
    pub fn wait_tiers(self) -> Result<TieredOutcome> {
        self.slot.wait_done().outcome.take().expect("the outcome is taken once, by its handle")
    }

    /// Whether the save has finished, so that [`SaveHandle::wait`] returns at once.
    pub fn is_done(&self) -> bool {
        self.slot.is_done()
    }
}

impl Drop for SaveHandle {
    fn drop(&mut self) {
        let mut s = self.slot.lock();
        match s.outcome.take() {
            Some(outcome) => log_abandoned(outcome),
            None => s.abandoned = !s.done,
        }
    }
}

impl Engine {
    /// An engine over this rank's collective. The collective may be shared with the host's
    /// own calls, as long as they are not made while a call of this engine (or its
    /// background save) is using it: every rank must see the same order of calls.
    pub fn new(collective: Arc<dyn Collective>) -> Engine {
        let (rank, world_size) = (collective.rank(), collective.world_size());
        Engine {
            inner: Arc::new(Mutex::new(Inner { collective, cache: PlanCache::default(), staging: Vec::new() })),
            in_flight: Mutex::new(None),
            rank,
            world_size,
        }
    }

    /// This rank; answers at once, also while a background save runs.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks; answers at once, also while a background save runs.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Bytes of host memory kept for the next background save
    /// ([`SaveOptions::keep_staging`]); waits for a background save first.
    pub fn staging_bytes(&self) -> u64 {
        self.wait_background();
        self.lock().staging.iter().map(|b| b.capacity() as u64).sum()
    }

    /// Frees the host memory kept for the next background save
    /// ([`SaveOptions::keep_staging`]); waits for a background save first.
    pub fn release_staging(&self) {
        self.wait_background();
        self.lock().staging = Vec::new();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for a background save, if one is running; its outcome goes to its handle (or
    /// to the log, where the handle was dropped). Every call of the engine does this first;
    /// a host that shares the collective calls it before its own calls, which must not
    /// meet a background save's on the wire.
    pub fn wait_background(&self) {
        let slot = self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(s) = slot {
            drop(s.wait_done());
        }
    }

    /// Opens the storage at `url` (a path, `file://`, `s3://`, `memory://NAME`) on every
    /// rank. Collective: a rank that cannot open it fails the call on every rank, with that
    /// rank's error, instead of leaving the others waiting in the next save or load.
    pub fn open(&self, url: &str, options: &OpenOptions) -> Result<Arc<dyn Storage>> {
        self.wait_background();
        let (storage, check) = match dckpt_storage::open_with(url, options) {
            Ok(s) => (Some(s), Ok(())),
            Err(e) => (None, Err(Error::from(e))),
        };
        agree(self.lock().collective.as_ref(), check, "open")?;
        Ok(storage.expect("every rank agreed that it opened the storage"))
    }

    /// The checkpoint's whole metadata on every rank (the coordinator validates it, every
    /// other rank checks its copy against the coordinator's digest). Every rank reads the
    /// file: at scale, a load does not need this, as it reads the metadata on the
    /// coordinator alone.
    pub fn read_metadata(&self, storage: &dyn Storage) -> Result<crate::format::Metadata> {
        self.wait_background();
        read_metadata(storage, self.lock().collective.as_ref())
    }

    /// Saves and returns once the checkpoint is committed (or the save failed everywhere).
    pub fn save(&self, storage: &dyn Storage, state: &SaveState<'_>, opts: &SaveOptions) -> Result<SaveOutcome> {
        self.wait_background();
        let mut inner = self.lock();
        let Inner { collective, cache, .. } = &mut *inner;
        save(storage, collective.as_ref(), state, &[], opts, cache, Duration::ZERO)
    }

    /// Saves `state` and the `sourced` pieces, whose bytes the engine pulls from their
    /// sources into a few bounce buffers while it writes them, and returns once the
    /// checkpoint is committed. A converter saves a model larger than its memory this way.
    /// Each sourced piece must be a main replica (see [`SourcedTensor`]).
    pub fn save_sourced(
        &self,
        storage: &dyn Storage,
        state: &SaveState<'_>,
        sourced: &[SourcedTensor<'_>],
        opts: &SaveOptions,
    ) -> Result<SaveOutcome> {
        self.wait_background();
        let mut inner = self.lock();
        let Inner { collective, cache, .. } = &mut *inner;
        save(storage, collective.as_ref(), state, sourced, opts, cache, Duration::ZERO)
    }

    /// Copies the state into engine-owned buffers and returns; planning, writing and the
    /// commit run in the background. At most one save is in flight: a new one first waits
    /// for the previous one to finish.
    pub fn save_async(
        &self,
        storage: Arc<dyn Storage>,
        state: &SaveState<'_>,
        opts: &SaveOptions,
    ) -> Result<SaveHandle> {
        self.save_tiers_async(state, None, Some((storage, opts.clone())))
    }

    /// Saves this rank's part of a local step (see [`crate::local`]) under `dir`, its
    /// node-local storage, with its copies on peers, and returns once the step is complete.
    pub fn save_local(
        &self,
        dir: &dyn Storage,
        state: &SaveState<'_>,
        opts: &LocalSaveOptions,
    ) -> Result<LocalSaveOutcome> {
        self.wait_background();
        local::save_local(self.lock().collective.as_ref(), dir, state, opts)
    }

    /// Saves the local step (first: it is the fast one) and the persistent checkpoint,
    /// whichever are given, and returns once both are done. Where the local step's
    /// node-local storage fails (a full or failing disk: every rank agreed on that failure,
    /// so every rank goes on alike), the persistent save still runs, since the local tier
    /// only caches it: the failure is in [`TieredOutcome::local_error`] and logged once.
    /// Any other failure (a refusal, the caller's, the collective's) ends the save on every
    /// rank, as does a local failure where no persistent save follows.
    pub fn save_tiers(
        &self,
        state: &SaveState<'_>,
        local: Option<(&dyn Storage, &LocalSaveOptions)>,
        persistent: Option<(&dyn Storage, &SaveOptions)>,
    ) -> Result<TieredOutcome> {
        self.wait_background();
        let mut inner = self.lock();
        let Inner { collective, cache, .. } = &mut *inner;
        let coll = collective.as_ref();
        let mut persist = persistent.map(|(at, opts)| || save(at, coll, state, &[], opts, cache, Duration::ZERO));
        save_tiers(coll, state, local, persist.as_mut().map(|p| p as &mut dyn FnMut() -> _))
    }

    /// Restores the newest whole local step under `dir` into `req` (see
    /// [`local::restore_local`]).
    pub fn restore_local(
        &self,
        dir: &dyn Storage,
        req: &mut LoadRequest<'_>,
        opts: &LocalRestoreOptions,
    ) -> Result<LocalRestoreOutcome> {
        self.wait_background();
        local::restore_local(self.lock().collective.as_ref(), dir, req, opts)
    }

    /// Copies the state once and returns; the local step (first: it is the fast one) and
    /// the persistent checkpoint, whichever are given, are saved from that copy in the
    /// background. The handle's [`SaveHandle::wait_tiers`] gives both outcomes, as
    /// [`Engine::save_tiers`] returns them.
    pub fn save_tiers_async(
        &self,
        state: &SaveState<'_>,
        local: Option<(Arc<dyn Storage>, LocalSaveOptions)>,
        persistent: Option<(Arc<dyn Storage>, SaveOptions)>,
    ) -> Result<SaveHandle> {
        self.wait_background();
        let staging = Instant::now();
        // Kept buffers are reused in order where they fit (the same state saved again fits
        // exactly); any other piece gets fresh memory.
        let mut kept = std::mem::take(&mut self.lock().staging).into_iter();
        let mut copy = |data: &[u8]| match kept.next() {
            Some(mut b) if b.capacity() >= data.len() && b.capacity() / 2 <= data.len() => {
                b.clear();
                b.extend_from_slice(data);
                b
            }
            _ => data.to_vec(),
        };
        let tensors: Vec<(dckpt_shard_spec::ShardedTensor, Vec<u8>)> =
            state.tensors.iter().map(|t| (t.tensor.clone(), copy(t.data))).collect();
        let objects: Vec<(dckpt_shard_spec::ShardedObject, Vec<u8>, crate::ObjectCompare)> =
            state.objects.iter().map(|o| (o.object.clone(), copy(o.data), o.compare)).collect();
        drop(kept);
        let stage = staging.elapsed();
        let slot = Arc::new(Slot::default());
        let (inner, s) = (self.inner.clone(), slot.clone());
        let keep_staging = persistent.as_ref().is_some_and(|p| p.1.keep_staging);
        // Where no thread can be started the save runs here, and returns settled: a rank
        // that failed alone would leave the others in the save's first round.
        crate::threads::detached("dckpt-save", move || {
            let owned = SaveState {
                tensors: tensors.iter().map(|(t, d)| TensorData { tensor: t.clone(), data: d }).collect(),
                objects: objects
                    .iter()
                    .map(|(o, d, c)| ObjectData { object: o.clone(), data: d, compare: *c })
                    .collect(),
            };
            let mut guard = inner.lock().unwrap_or_else(|p| p.into_inner());
            let Inner { collective, cache, staging } = &mut *guard;
            let coll = collective.as_ref();
            let run = || {
                let local = local.as_ref().map(|(dir, opts)| (dir.as_ref(), opts));
                let mut persist =
                    persistent.as_ref().map(|(at, opts)| || save(at.as_ref(), coll, &owned, &[], opts, cache, stage));
                save_tiers(coll, &owned, local, persist.as_mut().map(|p| p as &mut dyn FnMut() -> _))
            };
            // A panic still settles the handle: `wait`, and every later call of this
            // engine, waited for it forever.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|panic| {
                Err(Error::internal(format!(
                    "the background save panicked: {}",
                    crate::error::panic_text(panic.as_ref())
                )))
            });
            drop(owned);
            if keep_staging {
                *staging = tensors.into_iter().map(|t| t.1).chain(objects.into_iter().map(|o| o.1)).collect();
            }
            drop(guard);
            s.set(r);
        });
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = Some(slot.clone());
        Ok(SaveHandle { slot })
    }

    /// Loads into `req`'s buffers, resharding from whatever layout was saved. Waits for a
    /// background save first.
    pub fn load(&self, storage: &dyn Storage, req: &mut LoadRequest<'_>, opts: &LoadOptions) -> Result<LoadOutcome> {
        self.wait_background();
        let inner = self.lock();
        load(storage, inner.collective.as_ref(), req, opts)
    }
}

/// [`Engine::save_tiers`]'s order and its one exception: a local failure of storage does not
/// stop the persistent save (`persistent`) that follows.
fn save_tiers(
    coll: &dyn Collective,
    state: &SaveState<'_>,
    local: Option<(&dyn Storage, &LocalSaveOptions)>,
    persistent: Option<&mut dyn FnMut() -> Result<SaveOutcome>>,
) -> Result<TieredOutcome> {
    let mut out = TieredOutcome::default();
    if let Some((dir, opts)) = local {
        match local::save_local(coll, dir, state, opts) {
            Ok(o) => out.local = Some(o),
            Err(e) if persistent.is_some() && matches!(e.kind(), ErrorKind::Storage { .. }) => {
                if coll.rank() == COORDINATOR {
                    log::warn!("local tier: step {} was not saved, the persistent save goes on: {e}", opts.step);
                }
                out.local_error = Some(Arc::new(e));
            }
            Err(e) => return Err(e),
        }
    }
    if let Some(save) = persistent {
        out.persistent = Some(save()?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{Receiver, Sender, channel};
    use std::time::Duration;

    use dckpt_collective::{ReduceOp, ThreadGroup};
    use dckpt_shard_spec::{DType, ShardedTensor};

    use super::*;

    /// A collective whose first exchange tells the test it started and then waits until the
    /// test lets it go: a background save held in the middle, with the engine's lock taken.
    #[derive(Debug)]
    struct Gated {
        inner: dckpt_collective::ThreadCollective,
        gate: Mutex<Option<(Sender<()>, Receiver<()>)>>,
    }

    impl Gated {
        fn pass(&self) {
            let gate = self.gate.lock().unwrap().take();
            if let Some((entered, release)) = gate {
                entered.send(()).unwrap();
                release.recv().unwrap();
            }
        }
    }

    impl Collective for Gated {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world_size(&self) -> usize {
            self.inner.world_size()
        }
        fn barrier(&self) -> dckpt_collective::Result<()> {
            self.pass();
            self.inner.barrier()
        }
        fn broadcast(&self, root: usize, data: Option<&[u8]>) -> dckpt_collective::Result<Vec<u8>> {
            self.pass();
            self.inner.broadcast(root, data)
        }
        fn gather(&self, root: usize, data: Vec<u8>) -> dckpt_collective::Result<Option<Vec<Vec<u8>>>> {
            self.pass();
            self.inner.gather(root, data)
        }
        fn all_gather(&self, data: Vec<u8>) -> dckpt_collective::Result<Vec<Vec<u8>>> {
            self.pass();
            self.inner.all_gather(data)
        }
        fn all_reduce_u64(&self, values: &[u64], op: ReduceOp) -> dckpt_collective::Result<Vec<u64>> {
            self.pass();
            self.inner.all_reduce_u64(values, op)
        }
        fn scatter(&self, root: usize, parts: Option<Vec<Vec<u8>>>) -> dckpt_collective::Result<Vec<u8>> {
            self.pass();
            self.inner.scatter(root, parts)
        }
        fn exchange(
            &self,
            sends: Vec<(usize, bytes::Bytes)>,
            from: &[usize],
        ) -> dckpt_collective::Result<Vec<bytes::Bytes>> {
            self.pass();
            self.inner.exchange(sends, from)
        }
    }

    /// Ranks whose process cannot start another thread save, load and keep local copies all
    /// the same: every thread the engine would start is refused, its work done on the
    /// calling thread.
    #[test]
    fn ranks_that_cannot_start_a_thread_save_load_and_restore() {
        use crate::local::{LocalRestoreOptions, LocalSaveOptions, Placement};
        use dckpt_storage::{FaultConfig, FaultStorage};
        let opts = dckpt_collective::CollectiveOptions { timeout: Duration::from_secs(60), ..Default::default() };
        let refused = ThreadGroup::run(2, &opts, |rank, c| {
            let run = || {
                // Small objects, read four at a time: a rank writes several files and reads
                // several at once, each of which would have a thread.
                let inner = dckpt_storage::open("memory://engine-threads-refused").unwrap();
                let config =
                    FaultConfig { object_bytes_max: Some(1000), reads_in_flight: Some(4), ..Default::default() };
                let store = FaultStorage::new(inner, config);
                let engine = Engine::new(Arc::new(c));
                let tensors: Vec<ShardedTensor> = (0..8)
                    .map(|i| ShardedTensor::chunk(format!("w{i}"), DType::U8, [1000], [rank as u64 * 500], [500]))
                    .collect();
                let data: Vec<Vec<u8>> = (0..8).map(|i| vec![(rank * 8 + i) as u8; 500]).collect();
                let state = tensors.iter().zip(&data).fold(SaveState::new(), |s, (t, d)| s.tensor(t.clone(), d));
                engine.save(&store, &state, &SaveOptions::default()).unwrap();
                let mut back = vec![vec![0u8; 500]; 8];
                let mut req =
                    tensors.iter().zip(&mut back).fold(LoadRequest::new(), |r, (t, d)| r.tensor(t.clone(), d));
                engine.load(&store, &mut req, &LoadOptions::default()).unwrap();
                drop(req);
                assert_eq!(back, data, "rank {rank}: load");

                let dir = dckpt_storage::open(&format!("memory://engine-threads-refused-node-{rank}")).unwrap();
                let placement = Placement { ranks_per_node: 1, copies: 2 };
                let saved = engine.save_local(dir.as_ref(), &state, &LocalSaveOptions::new(1, placement)).unwrap();
                assert_eq!(saved.received_bytes, 8 * 500, "rank {rank}: its peer's copy");
                let mut back = vec![vec![0u8; 500]; 8];
                let mut req =
                    tensors.iter().zip(&mut back).fold(LoadRequest::new(), |r, (t, d)| r.tensor(t.clone(), d));
                let restored = engine.restore_local(dir.as_ref(), &mut req, &LocalRestoreOptions::default()).unwrap();
                drop(req);
                assert_eq!((restored.step, &back), (Some(1), &data), "rank {rank}: local restore");
                // A background save runs on the calling thread, and returns settled (the
                // rank once failed alone, and the other waited in the save's first round).
                let later = dckpt_storage::open("memory://engine-threads-refused-async").unwrap();
                engine.save_async(later, &state, &SaveOptions::default()).unwrap().wait().unwrap();
            };
            crate::threads::without_threads(run).1
        })
        .unwrap();
        // The coverage proof (coordinator), the file writers, the parallel reads, and the
        // local tier's own write and own read on each rank.
        assert!(refused[0] >= 5 && refused[1] >= 4, "threads refused: {refused:?}");
    }

    /// `rank()` once waited on the lock a background save holds, so a host asking its rank
    /// (to log, to decide what to save next) stalled for the whole save.
    /// A world of one whose background save is held at its first collective call, with the
    /// engine's lock taken: the engine, the save's handle, and what lets the save go on
    /// (dropped, it makes the save panic there).
    fn held_background_save() -> (Engine, SaveHandle, Sender<()>) {
        let (entered_tx, entered) = channel();
        let (release, release_rx) = channel();
        let inner = ThreadGroup::new(1).unwrap().remove(0);
        let engine = Engine::new(Arc::new(Gated { inner, gate: Mutex::new(Some((entered_tx, release_rx))) }));
        let data = [1u8, 2, 3, 4];
        let state = SaveState::new().tensor(ShardedTensor::whole("w", DType::U8, [4]), &data);
        let storage = dckpt_storage::open("memory://").unwrap();
        let handle = engine.save_async(storage, &state, &SaveOptions::default()).unwrap();
        entered.recv_timeout(Duration::from_secs(60)).expect("the background save reached the collective");
        (engine, handle, release)
    }

    #[test]
    fn rank_answers_while_a_background_save_is_blocked() {
        let (engine, handle, release) = held_background_save();
        let (answer_tx, answer) = channel();
        std::thread::scope(|s| {
            s.spawn(|| answer_tx.send((engine.rank(), engine.world_size())).unwrap());
            let got = answer.recv_timeout(Duration::from_secs(10));
            release.send(()).unwrap();
            assert_eq!(got, Ok((0, 1)), "rank() and world_size() waited for the background save");
        });
        handle.wait().unwrap();
    }

    /// A panic in a background save settles its handle with an error naming it, and the
    /// engine goes on: `wait`, and every later call, waited for it forever.
    #[test]
    fn a_background_save_that_panics_fails_its_handle() {
        let (engine, handle, release) = held_background_save();
        drop(release); // the gate's `recv().unwrap()` panics in the background save
        let (done_tx, done) = channel();
        std::thread::scope(|s| {
            s.spawn(|| done_tx.send(handle.wait().map_err(|e| e.to_string())).unwrap());
            let got = done.recv_timeout(Duration::from_secs(30)).expect("wait() returned");
            let e = got.expect_err("the save failed");
            assert!(e.contains("the background save panicked"), "{e}");
        });
        assert_eq!(engine.rank(), 0);
    }

    /// What the engine logs, for the test below (the only logger of this test binary).
    struct Captured(Mutex<Vec<String>>);

    impl log::Log for Captured {
        fn enabled(&self, _: &log::Metadata<'_>) -> bool {
            true
        }
        fn log(&self, record: &log::Record<'_>) {
            self.0.lock().unwrap().push(format!("{} {}", record.level(), record.args()));
        }
        fn flush(&self) {}
    }

    static CAPTURED: Captured = Captured(Mutex::new(Vec::new()));

    /// A background save whose handle was dropped unwaited, and which then fails: its
    /// failure is logged, the one place left to say it. It vanished: the next call waited
    /// for the save and dropped its outcome.
    #[test]
    fn the_failure_of_a_save_whose_handle_was_dropped_is_logged() {
        log::set_logger(&CAPTURED).expect("the only logger");
        log::set_max_level(log::LevelFilter::Warn);
        let (engine, handle, release) = held_background_save();
        drop(handle);
        drop(release); // the save panics at its first collective call, and fails
        engine.wait_background();
        let logged = CAPTURED.0.lock().unwrap().clone();
        assert!(
            logged
                .iter()
                .any(|l| l.starts_with("ERROR") && l.contains("dropped without waiting") && l.contains("panicked")),
            "{logged:?}"
        );
    }
}
