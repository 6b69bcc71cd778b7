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

mod local;
mod names;
mod policy;
mod root;

use std::sync::{Arc, Mutex};

use dckpt_collective::{Collective, CollectiveExt, ReduceOp};
use dckpt_engine::local::{LocalSaveOptions, LocalSaveOutcome};
use dckpt_engine::{
    Error, ErrorKind, LoadOptions, LoadRequest, Result, SaveHandle, SaveOptions, SaveOutcome, SaveState, TieredOutcome,
};
use dckpt_storage::Storage;
use local::Local;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use local::{LocalTier, Restored, Sources};
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

    /// The name the local tier records this run's steps under: the root's location, a local
    /// path resolved (so that `ckpt/run`, `./ckpt/run` and its absolute path are one run).
    pub fn name(&self) -> String {
        let location = self.root.location("");
        std::fs::canonicalize(&location).map_or(location, |p| p.display().to_string())
    }

    /// The storage of `step`'s checkpoint.
    pub fn step_location(&self, step: u64) -> Arc<dyn Storage> {
        step_storage(&self.root, step)
    }

    /// Refuses a step that is committed already ([`ErrorKind::AlreadyExists`]: a step is
    /// saved once), removes a damaged one (`root::clear_for_save`), and records the step
    /// and rank 0's clock for its save.
    pub fn begin_step(&self, step: u64) -> Result<StepStart> {
        self.on_root("run root: begin step", |root| {
            root::clear_for_save(root, step)?;
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

    /// Whether `step` is committed under the run root: its metadata decodes and names only
    /// files that are there at their sizes (a step whose metadata alone decodes is damaged).
    pub fn committed(&self, step: u64) -> Result<bool> {
        self.on_root("run root: step committed", |root| Ok(root::look_at_step(root, step)?.committed()))
    }

    /// Refuses, on every rank, a step the ranks do not all give, or one a rank `refused`
    /// (its arguments or its environment wrong; that rank reports its own error, the others
    /// one naming it). Each rank's step says what it saves where: ranks given different
    /// steps once committed a step whose data files lay in another step's directory. A rank
    /// that stopped alone would leave the others waiting in the step's next collective.
    /// `config` is a digest of what decides the caller's way through the step (its tiers,
    /// their intervals, copies and nodes): ranks whose managers were made otherwise (an
    /// interval or the ranks per node given otherwise on some ranks) would take different
    /// collectives, and are refused too.
    pub fn same_step(&self, step: u64, refused: bool, config: u64) -> Result<()> {
        let in_phase = |e: dckpt_collective::Error| Error::from(e.in_phase("run root: step"));
        let mine = if refused { self.collective.rank() as u64 + 1 } else { 0 };
        let each = [step, u64::MAX - step, mine, config, u64::MAX - config];
        let v = self.collective.all_reduce_u64(&each, ReduceOp::Max).map_err(in_phase)?;
        if v[2] != 0 {
            let rank = v[2] - 1;
            return Err(Error::invalid_options(format!("rank {rank} refused to go on (its own error says why)")));
        }
        let (max, min) = (v[0], u64::MAX - v[1]);
        if max != min {
            return Err(Error::invalid_options(format!("the ranks save different steps, from {min} to {max}")));
        }
        if v[3] != u64::MAX - v[4] {
            return Err(Error::invalid_options(
                "the ranks' managers differ (their tiers, intervals, copies or nodes): every rank must make the same",
            ));
        }
        Ok(())
    }

    /// Every step directory under the run root.
    pub fn steps(&self) -> Result<Vec<StepInfo>> {
        self.on_root("run root: steps", scan)
    }

    /// Garbage collection ([`gc_root`]): an error where anything could not be removed,
    /// naming each (the rest is removed).
    pub fn gc(&self, opts: &GcOptions) -> Result<GcReport> {
        self.on_root("run root: gc", |root| {
            let report = gc_root(root, opts, &mut |_| {})?;
            match report.errors.is_empty() {
                true => Ok(report),
                false => Err(Error::new(ErrorKind::Other {
                    message: format!("gc removed the rest but not: {}", report.errors.join("; ")),
                })),
            }
        })
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

/// The newer steps a restart passes over, and why (damaged, never committed); refused where
/// one of them could not be read here: it may be whole, and resuming before it would lose
/// its progress without a word (and collide with it at the next save of that step).
fn passed_over(found: &Latest) -> Result<Vec<String>> {
    let latest = found.step;
    let newer = found.skipped.iter().filter(|s| latest.is_none_or(|l| s.step > l));
    if let Some(s) = newer.clone().find(|s| s.unreadable) {
        return Err(Error::new(ErrorKind::Other {
            message: format!(
                "step {} is newer than the latest step it could read ({}), but {}: restore once it reads (or \
                 remove it)",
                s.step,
                latest.map_or_else(|| "none".to_string(), |l| l.to_string()),
                s.reason
            ),
        }));
    }
    Ok(newer.map(|s| format!("step {}: {}", s.step, s.reason)).collect())
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

/// A step saved by [`CheckpointManager`], and what retention removed after it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepOutcome {
    /// The step.
    pub step: u64,
    /// The engine's outcome of its save to the run root; `None` where the step was not due
    /// on the persistent tier ([`LocalTier::persistent_every`]).
    pub outcome: Option<SaveOutcome>,
    /// The local tier's save, where the step was due there and it succeeded.
    pub local: Option<LocalSaveOutcome>,
    /// Why the local tier did not save the step, where its node-local storage failed and
    /// the run root's save went on (the same on every rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_error: Option<String>,
    /// The steps retention deleted under the run root after its commit.
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
    local: Option<Local>,
    pending: Mutex<Option<(u64, SaveHandle)>>,
}

/// A step being saved in the background; [`PendingStep::wait`] gives its outcome, after
/// retention has run.
#[derive(Debug)]
pub struct PendingStep<'m> {
    manager: &'m CheckpointManager,
    step: u64,
    /// A step due on neither tier: nothing runs.
    idle: bool,
}

impl PendingStep<'_> {
    /// The step being saved.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Waits for the commit, then writes the pointer and applies retention.
    pub fn wait(self) -> Result<StepOutcome> {
        if self.idle {
            return Ok(StepOutcome {
                step: self.step,
                outcome: None,
                local: None,
                local_error: None,
                removed: Vec::new(),
            });
        }
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
        Ok(CheckpointManager { run, ckpt, policy, local: None, pending: Mutex::new(None) })
    }

    /// With a node-local tier beside the run root (see [`LocalTier`]): steps are saved to
    /// the tiers their schedule names, and [`CheckpointManager::load_latest`] restores from
    /// the local tier where it can. Collective: a rank whose tier does not resolve (nodes,
    /// template, its directory) fails the call on every rank.
    pub fn with_local_tier(self, tier: LocalTier) -> Result<CheckpointManager> {
        self.with_local_tier_wrapped(tier, |dir| dir)
    }

    /// [`CheckpointManager::with_local_tier`], the node-local directory's storage passed
    /// through `wrap` once opened (retries, metrics, or the latency a test injects).
    pub fn with_local_tier_wrapped(
        mut self,
        tier: LocalTier,
        wrap: impl FnOnce(Arc<dyn Storage>) -> Arc<dyn Storage>,
    ) -> Result<CheckpointManager> {
        self.finish_pending()?;
        let c = &self.run.collective;
        let resolved = tier.resolve(c.rank(), c.world_size());
        let everywhere = c.all_succeeded(resolved.is_ok()).map_err(|e| Error::from(e.in_phase("local tier")))?;
        let (placement, dir) = match (resolved, everywhere) {
            (Ok(r), true) => r,
            (Err(e), _) => return Err(e.on_rank(c.rank() as u32)),
            (Ok(_), false) => return Err(Error::invalid_options("local tier: another rank could not resolve it")),
        };
        let dir = wrap(self.ckpt.storage(Location::Url(dir))?);
        self.local = Some(Local { tier, placement, dir });
        Ok(self)
    }

    /// The local tier, when there is one.
    pub fn local_tier(&self) -> Option<&LocalTier> {
        self.local.as_ref().map(|l| &l.tier)
    }

    /// A digest of what decides a step's way through the collectives ([`RunRoot::same_step`]).
    fn config(&self) -> u64 {
        self.local.as_ref().map_or(0, Local::config)
    }

    /// Whether `step` saves (local, persistent): without a local tier every step is
    /// persistent.
    pub fn due(&self, step: u64) -> (bool, bool) {
        match &self.local {
            None => (false, true),
            Some(l) => (l.tier.local_due(step), l.tier.persistent_due(step)),
        }
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

    /// The name the local tier records its steps under: the run root's location.
    fn run_name(&self) -> String {
        self.run.name()
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
    ///
    /// With a local tier, the step goes to the tiers it is due on ([`CheckpointManager::due`]),
    /// the local one first; a step due on neither saves nothing. A step the local tier holds
    /// whole is refused too, unless the run root is due at it: its save there is then taken
    /// as retried after a failure, and the local copy is kept ([`IfWhole::Keep`](crate::IfWhole::Keep)).
    pub fn save(&self, step: u64, state: &SaveState<'_>, opts: &SaveOptions) -> Result<StepOutcome> {
        self.finish_pending()?;
        let (local, persistent) = self.plan_step(step, opts)?;
        self.finish(step, self.ckpt.save_tiers(state, local, persistent)?)
    }

    /// Copies the state and returns; the save of each tier it is due on goes on in the
    /// background. Retention runs when the handle is waited on, or at the next call of this
    /// manager.
    pub fn save_async(&self, step: u64, state: &SaveState<'_>, opts: &SaveOptions) -> Result<PendingStep<'_>> {
        self.finish_pending()?;
        let (local, persistent) = self.plan_step(step, opts)?;
        if local.is_none() && persistent.is_none() {
            return Ok(PendingStep { manager: self, step, idle: true });
        }
        let handle = self.ckpt.save_tiers_async(state, local, persistent)?;
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some((step, handle));
        Ok(PendingStep { manager: self, step, idle: false })
    }

    /// Where `step` goes: the local tier's directory and options, the run root's step and
    /// its options (a replace refused, the step begun).
    #[allow(clippy::type_complexity)]
    fn plan_step(
        &self,
        step: u64,
        opts: &SaveOptions,
    ) -> Result<(Option<(Location, LocalSaveOptions)>, Option<(Location, SaveOptions)>)> {
        let refused = refuse_replace(step, opts).err();
        let agreed = self.run.same_step(step, refused.is_some(), self.config());
        if let Some(e) = refused {
            return Err(e);
        }
        agreed?;
        let (local_due, persistent_due) = self.due(step);
        let local = self
            .local
            .as_ref()
            .filter(|_| local_due)
            .map(|l| (Location::Storage(l.dir.clone()), l.options(step, self.run_name(), opts, persistent_due)));
        let persistent = match persistent_due {
            true => Some((Location::Storage(self.step_location(step)), self.begin(step, opts)?)),
            false => None,
        };
        Ok((local, persistent))
    }

    /// The step being saved in the background, if one is.
    pub fn in_flight(&self) -> Option<u64> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|p| p.0)
    }

    /// Waits for a background save, if one is running, and finishes it (pointer, retention).
    /// A save started through [`CheckpointManager::checkpointer`] is waited for too (its
    /// outcome goes to its handle): the run root's calls that follow share its collective.
    pub fn finish_pending(&self) -> Result<Option<StepOutcome>> {
        let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.ckpt.wait_background();
        let Some((step, handle)) = pending else { return Ok(None) };
        self.finish(step, handle.wait_tiers()?).map(Some)
    }

    /// The latest committed step (see [`choose_latest`]).
    pub fn latest(&self) -> Result<Latest> {
        self.finish_pending()?;
        self.run.latest()
    }

    /// Restores the newest step it can prove whole into `req`; `None` where there is none.
    ///
    /// Without a local tier that is the latest committed step under the run root. With one,
    /// a local step at least as new as that is tried first: each rank's part from its own
    /// copy, else a peer's, every byte checked. A part no copy can give comes from the run
    /// root's step of the same number, if it has one; otherwise the whole restore is the
    /// run root's latest step (a normal load, so it reshards where the layout changed). The
    /// ranks never mix steps. [`Restored`] says which step, where the parts came from, and
    /// why each fallback happened. Where the run root holds no step and no local step can be
    /// restored whole here, but this run marked some complete (their nodes away, another
    /// layout), it fails on every rank naming them: they are the run's only checkpoints.
    /// Ranks whose managers were made otherwise are refused first, as a save refuses them
    /// ([`RunRoot::same_step`]).
    pub fn load_latest(&self, req: &mut LoadRequest<'_>, opts: &LoadOptions) -> Result<Option<Restored>> {
        let found = self.latest()?;
        let latest = found.step;
        // Managers made otherwise (a local tier on some ranks only) would take different
        // collectives below; refused here, at the job's start, not at its first save.
        self.run.same_step(latest.unwrap_or(0), false, self.config())?;
        let passed = passed_over(&found)?;
        let Some(local) = &self.local else {
            let Some(step) = latest else { return Ok(None) };
            let load = self.ckpt.load(Location::Storage(self.step_location(step)), req, opts)?;
            let sources = Sources { persistent: self.ckpt.world_size() as u64, ..Sources::default() };
            if self.ckpt.rank() == 0 {
                passed.iter().for_each(|why| log::warn!("restore: {why}"));
            }
            return Ok(Some(Restored {
                step,
                sources,
                persistent: Some(load),
                fallbacks: passed,
                ..Restored::default()
            }));
        };
        self.load_latest_local(local, req, opts, latest, passed)
    }

    /// Every step directory under the run root.
    pub fn steps(&self) -> Result<Vec<StepInfo>> {
        self.finish_pending()?;
        self.run.steps()
    }

    /// Garbage collection ([`gc_root`]) with this manager's retention policy.
    ///
    /// With a local tier, each rank also removes its local steps older than the newest
    /// `keep` complete ones (and older dead saves) from its node's directory
    /// ([`GcReport::local_steps`]).
    pub fn gc(&self) -> Result<GcReport> {
        self.finish_pending()?;
        let mut report = self.run.gc(&GcOptions { policy: self.policy, ..GcOptions::default() })?;
        if let Some(l) = &self.local {
            let (rank, world) = (self.ckpt.rank(), self.ckpt.world_size());
            let run = self.run_name();
            report.local_steps =
                dckpt_engine::local::gc_local(l.dir.as_ref(), rank, world, l.placement, l.tier.keep, &run);
        }
        Ok(report)
    }

    /// The options of `step`'s save: a replace refused, then the step begun.
    fn begin(&self, step: u64, opts: &SaveOptions) -> Result<SaveOptions> {
        refuse_replace(step, opts)?;
        Ok(self.run.begin_step(step)?.save_options(opts))
    }

    fn finish(&self, step: u64, tiers: TieredOutcome) -> Result<StepOutcome> {
        let TieredOutcome { persistent: outcome, local, local_error } = tiers;
        let removed = match &outcome {
            Some(o) => self.run.finish_step(step, &o.save_id, self.policy)?,
            None => Vec::new(),
        };
        let local_error = local_error.map(|e| e.to_string());
        Ok(StepOutcome { step, outcome, local, local_error, removed })
    }
}
