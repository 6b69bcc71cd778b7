//! Checkpoints over a training run: one checkpoint per step under a run root, a `latest`
//! pointer, retention and garbage collection.
//!
//! A run root (a directory, an `s3://` prefix, any storage) holds `step-<N>` (N zero-padded
//! to [`STEP_DIGITS`] digits, so that names sort as numbers in S3's lexicographic listings),
//! each an ordinary checkpoint location, and [`LATEST_NAME`], a small JSON
//! ([`LatestPointer`]) written whole after that step's commit. A step is committed exactly
//! when its metadata (the engine's commit marker) is there and decodes: a step is deleted
//! metadata first, so a half-deleted step is never taken for a committed one.
//!
//! The rooms: `names` (step directory names, the layout entries a managed save records),
//! `policy` (what the steps' states mean, retention, the latest step, what gc removes: pure
//! functions), `root` (the storage work: [`scan`], [`resolve_latest`], [`gc_root`], which
//! the CLI runs without a collective). [`RunRoot`] runs that work on rank 0 for every rank,
//! and splits a managed save into [`RunRoot::begin_step`] and [`RunRoot::finish_step`]
//! around whatever saves the step; [`CheckpointManager`] is that with the facade's save.

mod names;
mod policy;
mod root;

use std::sync::{Arc, Mutex};

use dckpt_collective::Collective;
use dckpt_engine::{
    Error, ErrorKind, LoadOptions, LoadOutcome, LoadRequest, Result, SaveHandle, SaveOptions, SaveOutcome, SaveState,
    read_metadata_local,
};
use dckpt_storage::Storage;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use names::{LATEST_NAME, SAVED_AT_ENTRY, STEP_DIGITS, STEP_ENTRY, parse_step_dir, step_dir};
pub use policy::{
    Damage, GcOptions, GcReport, Latest, LatestPointer, RemovalReason, RemovedStep, RetentionPolicy, Skipped, StepInfo,
    StepState, choose_latest, gc_removals, retention_deletes,
};
pub use root::{GcProgress, delete_step, gc_root, read_pointer, resolve_latest, scan, step_storage, write_pointer};

use crate::{Checkpointer, Location};

/// A step begun by [`RunRoot::begin_step`]: what its save must record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepStart {
    /// The step.
    pub step: u64,
    /// Rank 0's clock when the step began (Unix seconds).
    pub saved_at_unix: u64,
}

impl StepStart {
    /// The layout entries the step's save records ([`STEP_ENTRY`], [`SAVED_AT_ENTRY`]).
    pub fn layout(&self) -> [(&'static str, String); 2] {
        [(STEP_ENTRY, self.step.to_string()), (SAVED_AT_ENTRY, self.saved_at_unix.to_string())]
    }

    /// `opts` with [`StepStart::layout`] recorded.
    pub fn save_options(&self, opts: &SaveOptions) -> SaveOptions {
        self.layout().into_iter().fold(opts.clone(), |o, (k, v)| o.layout_entry(k, v))
    }
}

/// A run root shared by the ranks of one collective. What touches the root itself
/// (listing, the pointer, deletions) is done by rank 0, and its outcome, or its error, is
/// sent to every rank, so every rank returns the same; every rank makes the same calls in
/// the same order. It saves nothing: a managed save is [`RunRoot::begin_step`], the save
/// of the step's location by any means, then [`RunRoot::finish_step`].
#[derive(Debug, Clone)]
pub struct RunRoot {
    collective: Arc<dyn Collective>,
    root: Arc<dyn Storage>,
}

impl RunRoot {
    /// The run root `root` (a URL or path is opened on every rank; a rank that cannot open
    /// it fails the call on every rank).
    pub fn open(collective: Arc<dyn Collective>, root: impl Into<Location>) -> Result<RunRoot> {
        let root = Checkpointer::new(collective.clone()).storage(root.into())?;
        Ok(RunRoot { collective, root })
    }

    /// The run root's storage.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.root
    }

    /// The storage of `step`'s checkpoint.
    pub fn step_location(&self, step: u64) -> Arc<dyn Storage> {
        step_storage(&self.root, step)
    }

    /// Refuses a step that is committed already ([`ErrorKind::AlreadyExists`]: a step is
    /// saved once) and records the step and rank 0's clock for its save.
    pub fn begin_step(&self, step: u64) -> Result<StepStart> {
        self.on_root("run root: begin step", |root| {
            let dir = step_storage(root, step);
            if read_metadata_local(dir.as_ref()).is_ok() {
                return Err(Error::new(ErrorKind::AlreadyExists { location: dir.location("") }).on_rank(0));
            }
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs());
            Ok(StepStart { step, saved_at_unix: t.unwrap_or(0) })
        })
    }

    /// After `step` committed as save `save_id`: the pointer, then retention (never the
    /// step just saved: it is the newest committed step unless a newer one exists, which
    /// retention keeps too). The steps deleted, ascending.
    pub fn finish_step(&self, step: u64, save_id: &str, policy: RetentionPolicy) -> Result<Vec<u64>> {
        self.on_root("run root: finish step", |root| {
            write_pointer(root, step, save_id)?;
            if policy.keeps_all() {
                return Ok(Vec::new());
            }
            let committed: Vec<u64> = scan(root)?.into_iter().filter(StepInfo::committed).map(|s| s.step).collect();
            let doomed = retention_deletes(&committed, policy, &[step]);
            for &s in &doomed {
                delete_step(root, s, &mut |_| {})?;
            }
            Ok(doomed)
        })
    }

    /// The latest committed step (see [`choose_latest`]).
    pub fn latest(&self) -> Result<Latest> {
        self.on_root("run root: latest", |root| resolve_latest(root).map(|(l, _)| l))
    }

    /// Every step directory under the run root.
    pub fn steps(&self) -> Result<Vec<StepInfo>> {
        self.on_root("run root: steps", scan)
    }

    /// Garbage collection ([`gc_root`]).
    pub fn gc(&self, opts: &GcOptions) -> Result<GcReport> {
        self.on_root("run root: gc", |root| gc_root(root, opts, &mut |_| {}))
    }

    /// Runs `f` on rank 0 and gives every rank its outcome (or its error, stamped rank 0);
    /// `what` names the phase in a collective failure (a rank 0 stalled on the run root is
    /// named with it).
    fn on_root<T: Serialize + DeserializeOwned>(
        &self,
        what: &str,
        f: impl FnOnce(&Arc<dyn Storage>) -> Result<T>,
    ) -> Result<T> {
        let in_phase = |e: dckpt_collective::Error| Error::from(e.in_phase(what));
        if self.collective.rank() != 0 {
            let bytes = self.collective.broadcast(0, None).map_err(in_phase)?;
            let r: std::result::Result<T, Error> = serde_json::from_slice(&bytes)
                .map_err(|e| Error::protocol(format!("undecodable run-root answer from rank 0: {e}")))?;
            return r;
        }
        let r = f(&self.root).map_err(stamp_rank0);
        let bytes = match &r {
            Ok(v) => serde_json::to_vec(&Ok::<&T, &Error>(v)),
            Err(e) => serde_json::to_vec(&Err::<&T, &Error>(e)),
        }
        .map_err(|e| Error::internal(format!("encoding a run-root answer: {e}")))?;
        self.collective.broadcast(0, Some(&bytes)).map_err(in_phase)?;
        r
    }
}

/// Names rank 0 in an error that names no rank, as the engine's errors do.
fn stamp_rank0(e: Error) -> Error {
    match e.kind() {
        ErrorKind::Storage { .. } | ErrorKind::Format { .. } | ErrorKind::NotACheckpoint { .. } => e.on_rank(0),
        _ => e,
    }
}

/// Refuses a replace: a managed step is saved once.
fn refuse_replace(step: u64, opts: &SaveOptions) -> Result<()> {
    if opts.replace {
        return Err(Error::invalid_options(format!("step {step}: a managed step is saved once; replace is refused")));
    }
    Ok(())
}

/// A committed step saved by [`CheckpointManager`], and what retention removed after it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepOutcome {
    /// The step.
    pub step: u64,
    /// The engine's outcome of its save.
    pub outcome: SaveOutcome,
    /// The steps retention deleted after its commit.
    pub removed: Vec<u64>,
}

/// Checkpoints over a training run, one per step, under a run root (see the module docs):
/// a [`RunRoot`] and the facade's save. One per rank; every rank makes the same calls in
/// the same order, as with [`Checkpointer`].
///
/// Retention runs after each successful commit: for a background save when its handle is
/// waited on, or at the next call, so that it never runs while a save is in flight. Every
/// call waits for a background save first (the collective carries one call at a time).
#[derive(Debug)]
pub struct CheckpointManager {
    run: RunRoot,
    ckpt: Checkpointer,
    policy: RetentionPolicy,
    pending: Mutex<Option<(u64, SaveHandle)>>,
}

/// A step being saved in the background; [`PendingStep::wait`] gives its outcome, after
/// retention has run.
#[derive(Debug)]
pub struct PendingStep<'m> {
    manager: &'m CheckpointManager,
    step: u64,
}

impl PendingStep<'_> {
    /// The step being saved.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Waits for the commit, then writes the pointer and applies retention.
    pub fn wait(self) -> Result<StepOutcome> {
        match self.manager.finish_pending()? {
            Some(o) => Ok(o),
            None => Err(Error::usage(format!("step {}: its save was already waited for", self.step))),
        }
    }
}

impl CheckpointManager {
    /// A manager over this rank's collective for the run root `root` (a URL or path is
    /// opened on every rank; a rank that cannot open it fails the call on every rank).
    pub fn new(
        collective: Arc<dyn Collective>,
        root: impl Into<Location>,
        policy: RetentionPolicy,
    ) -> Result<CheckpointManager> {
        let ckpt = Checkpointer::new(collective.clone());
        let root = ckpt.storage(root.into())?;
        let run = RunRoot { collective, root };
        Ok(CheckpointManager { run, ckpt, policy, pending: Mutex::new(None) })
    }

    /// The checkpointer it saves and loads with.
    pub fn checkpointer(&self) -> &Checkpointer {
        &self.ckpt
    }

    /// The run root it manages.
    pub fn run_root(&self) -> &RunRoot {
        &self.run
    }

    /// The run root's storage.
    pub fn root(&self) -> &Arc<dyn Storage> {
        self.run.storage()
    }

    /// The retention policy.
    pub fn policy(&self) -> RetentionPolicy {
        self.policy
    }

    /// The storage of `step`'s checkpoint.
    pub fn step_location(&self, step: u64) -> Arc<dyn Storage> {
        self.run.step_location(step)
    }

    /// Saves `step` and returns once it is committed, the pointer names it and retention has
    /// run. A step that is committed already is refused ([`ErrorKind::AlreadyExists`]), as is a
    /// replace asked for in `opts`: a step is saved once.
    pub fn save(&self, step: u64, state: &SaveState<'_>, opts: &SaveOptions) -> Result<StepOutcome> {
        self.finish_pending()?;
        let opts = self.begin(step, opts)?;
        let outcome = self.ckpt.save(Location::Storage(self.step_location(step)), state, &opts)?;
        self.finish(step, outcome)
    }

    /// Copies the state and returns; the save goes on in the background. Retention runs
    /// when the handle is waited on, or at the next call of this manager.
    pub fn save_async(&self, step: u64, state: &SaveState<'_>, opts: &SaveOptions) -> Result<PendingStep<'_>> {
        self.finish_pending()?;
        let opts = self.begin(step, opts)?;
        let handle = self.ckpt.save_async(Location::Storage(self.step_location(step)), state, &opts)?;
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some((step, handle));
        Ok(PendingStep { manager: self, step })
    }

    /// The step being saved in the background, if one is.
    pub fn in_flight(&self) -> Option<u64> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|p| p.0)
    }

    /// Waits for a background save, if one is running, and finishes it (pointer, retention).
    pub fn finish_pending(&self) -> Result<Option<StepOutcome>> {
        let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner()).take();
        match pending {
            None => Ok(None),
            Some((step, handle)) => {
                let outcome = handle.wait()?;
                self.finish(step, outcome).map(Some)
            }
        }
    }

    /// The latest committed step (see [`choose_latest`]).
    pub fn latest(&self) -> Result<Latest> {
        self.finish_pending()?;
        self.run.latest()
    }

    /// Loads the latest committed step into `req`; `None` where no step is committed.
    pub fn load_latest(&self, req: &mut LoadRequest<'_>, opts: &LoadOptions) -> Result<Option<(u64, LoadOutcome)>> {
        let Some(step) = self.latest()?.step else { return Ok(None) };
        let outcome = self.ckpt.load(Location::Storage(self.step_location(step)), req, opts)?;
        Ok(Some((step, outcome)))
    }

    /// Every step directory under the run root.
    pub fn steps(&self) -> Result<Vec<StepInfo>> {
        self.finish_pending()?;
        self.run.steps()
    }

    /// Garbage collection ([`gc_root`]) with this manager's retention policy.
    pub fn gc(&self) -> Result<GcReport> {
        self.finish_pending()?;
        self.run.gc(&GcOptions { policy: self.policy, ..GcOptions::default() })
    }

    /// The options of `step`'s save: a replace refused, then the step begun.
    fn begin(&self, step: u64, opts: &SaveOptions) -> Result<SaveOptions> {
        refuse_replace(step, opts)?;
        Ok(self.run.begin_step(step)?.save_options(opts))
    }

    fn finish(&self, step: u64, outcome: SaveOutcome) -> Result<StepOutcome> {
        let removed = self.run.finish_step(step, &outcome.save_id, self.policy)?;
        Ok(StepOutcome { step, outcome, removed })
    }
}
