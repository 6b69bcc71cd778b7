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
//! The pure parts (step names, which steps retention keeps, which step is latest) are free
//! functions; the storage work is [`scan`], [`resolve_latest`] and [`gc_root`], which the
//! CLI runs without a collective; [`CheckpointManager`] runs them on rank 0 for every rank.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use dckpt_collective::Collective;
use dckpt_engine::format::{META_NAME, is_data_file_name};
use dckpt_engine::{
    Error, ErrorKind, LoadOptions, LoadOutcome, LoadRequest, Result, SaveHandle, SaveOptions, SaveOutcome, SaveState,
    read_metadata_local,
};
use dckpt_storage::{ObjectInfo, Prefixed, Storage};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::{Checkpointer, Location};

/// The name of the pointer to the latest committed step, under the run root.
pub const LATEST_NAME: &str = "latest";

/// The digits a step number is padded to in its directory's name.
pub const STEP_DIGITS: usize = 12;

/// The layout entry a managed save records its step under.
pub const STEP_ENTRY: &str = "step";

/// The layout entry a managed save records its start under (Unix seconds, from rank 0).
pub const SAVED_AT_ENTRY: &str = "saved_at_unix";

/// The directory of `step` under the run root: `step-000000000042`.
pub fn step_dir(step: u64) -> String {
    format!("step-{step:0width$}", width = STEP_DIGITS)
}

/// The step a directory name stands for, if it is exactly what [`step_dir`] makes (so that
/// one step has one name: `step-42` and `step-0042` are not steps).
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step: u64 = digits.parse().ok()?;
    (step_dir(step) == name).then_some(step)
}

/// Which committed steps retention keeps: the last `keep_last` and every step that is a
/// multiple of `keep_every`. Neither set keeps every step. The latest committed step and a
/// step being saved are kept whatever the policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetentionPolicy {
    /// Keep the newest N committed steps.
    pub keep_last: Option<u64>,
    /// Keep every step that is a multiple of K.
    pub keep_every: Option<u64>,
}

impl RetentionPolicy {
    /// Keeps every step.
    pub const KEEP_ALL: RetentionPolicy = RetentionPolicy { keep_last: None, keep_every: None };

    /// Whether this policy deletes anything at all.
    pub fn keeps_all(&self) -> bool {
        self.keep_last.is_none() && self.keep_every.is_none()
    }
}

/// The committed steps (in any order) that `policy` deletes, ascending. `protected` (steps
/// being saved) and the newest committed step are never among them.
pub fn retention_deletes(committed: &[u64], policy: RetentionPolicy, protected: &[u64]) -> Vec<u64> {
    if policy.keeps_all() {
        return Vec::new();
    }
    let sorted: BTreeSet<u64> = committed.iter().copied().collect();
    let newest = sorted.iter().next_back().copied();
    let last: BTreeSet<u64> = match policy.keep_last {
        Some(n) => sorted.iter().rev().take(usize::try_from(n).unwrap_or(usize::MAX)).copied().collect(),
        None => BTreeSet::new(),
    };
    sorted
        .into_iter()
        .filter(|s| Some(*s) != newest && !protected.contains(s) && !last.contains(s))
        .filter(|s| !matches!(policy.keep_every, Some(k) if k > 0 && s % k == 0))
        .collect()
}

/// The `latest` pointer's contents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatestPointer {
    /// The step.
    pub step: u64,
    /// Its directory under the run root.
    pub directory: String,
    /// The save id of that step's checkpoint.
    pub save_id: String,
}

/// One step directory under a run root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepInfo {
    /// The step.
    pub step: u64,
    /// Its directory under the run root.
    pub directory: String,
    /// Whether its metadata is there and decodes, and names only files that are there at
    /// their size.
    pub committed: bool,
    /// Bytes of every object in the directory.
    pub bytes: u64,
    /// Objects in the directory.
    pub objects: u64,
    /// The committed save's id.
    pub save_id: Option<String>,
    /// When the save started (Unix seconds), where the save recorded it (managed saves do);
    /// the storage API gives no modification times.
    pub saved_at_unix: Option<u64>,
    /// The layout the committed save recorded.
    pub layout: BTreeMap<String, String>,
    /// Why it is not committed: no metadata (a save that never committed, or one running),
    /// or what is wrong with it.
    pub problem: Option<String>,
}

/// A step that [`resolve_latest`] passed over, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    /// The step.
    pub step: u64,
    /// Why it is not the latest.
    pub reason: String,
}

/// Which step is the latest committed one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Latest {
    /// The step, or `None` where no step is committed.
    pub step: Option<u64>,
    /// Its directory.
    pub directory: Option<String>,
    /// Its save id.
    pub save_id: Option<String>,
    /// Whether the pointer named it (else listing found it).
    pub from_pointer: bool,
    /// Newer steps (and a pointer's step) passed over, and why.
    pub skipped: Vec<Skipped>,
}

/// The latest committed step among `steps`, given what the pointer held (`None`: no
/// pointer; `Some(Err)`: one that does not decode). The pointer is taken when it names a
/// committed step with its save id and no newer step is committed (a commit whose pointer
/// write failed is newer than the pointer); otherwise the newest committed step listed.
pub fn choose_latest(steps: &[StepInfo], pointer: Option<std::result::Result<LatestPointer, String>>) -> Latest {
    let newest = steps.iter().filter(|s| s.committed).max_by_key(|s| s.step);
    let mut skipped: Vec<Skipped> = steps
        .iter()
        .filter(|s| !s.committed && newest.is_none_or(|n| s.step > n.step))
        .map(|s| Skipped { step: s.step, reason: s.problem.clone().unwrap_or_else(|| "not committed".into()) })
        .collect();
    let mut from_pointer = false;
    match pointer {
        Some(Ok(p)) => match steps.iter().find(|s| s.step == p.step) {
            Some(s) if s.committed && s.save_id.as_deref() == Some(p.save_id.as_str()) => {
                from_pointer = newest.is_some_and(|n| n.step == s.step);
            }
            Some(s) if s.committed => skipped.push(Skipped {
                step: p.step,
                reason: format!(
                    "the pointer names save {} but the step holds save {}",
                    p.save_id,
                    s.save_id.as_deref().unwrap_or("?")
                ),
            }),
            Some(_) => {}
            None => skipped.push(Skipped { step: p.step, reason: "the pointer names a step that is not there".into() }),
        },
        Some(Err(why)) => skipped.push(Skipped { step: 0, reason: format!("the {LATEST_NAME} pointer: {why}") }),
        None => {}
    }
    skipped.sort_by_key(|s| s.step);
    skipped.dedup();
    Latest {
        step: newest.map(|s| s.step),
        directory: newest.map(|s| s.directory.clone()),
        save_id: newest.and_then(|s| s.save_id.clone()),
        from_pointer,
        skipped,
    }
}

/// The storage of one step under the run root.
pub fn step_storage(root: &Arc<dyn Storage>, step: u64) -> Arc<dyn Storage> {
    Arc::new(Prefixed::new(root.clone(), &step_dir(step)).expect("step directory names are valid paths"))
}

fn storage_err(e: dckpt_storage::Error) -> Error {
    Error::from(e)
}

/// Every step directory under the run root, ascending, each looked at as [`StepInfo`] says
/// (its bytes and objects count the unfinished writes of dead processes in it). Objects that are not in a step directory (the pointer, anything else) are not listed.
pub fn scan(root: &Arc<dyn Storage>) -> Result<Vec<StepInfo>> {
    let mut dirs: BTreeMap<u64, Vec<ObjectInfo>> = BTreeMap::new();
    // A dead save's unfinished writes belong to its step: a step that holds nothing else
    // (killed before its first file was finished) is listed too.
    let mut found = root.list("").map_err(storage_err)?;
    found.extend(root.list_abandoned("").map_err(storage_err)?);
    for o in found {
        let Some((first, rest)) = o.path.split_once('/') else { continue };
        if let Some(step) = parse_step_dir(first) {
            dirs.entry(step).or_default().push(ObjectInfo { path: rest.to_string(), size: o.size });
        }
    }
    let mut out = Vec::with_capacity(dirs.len());
    for (step, objects) in dirs {
        out.push(look_at(root, step, &objects));
    }
    Ok(out)
}

fn look_at(root: &Arc<dyn Storage>, step: u64, objects: &[ObjectInfo]) -> StepInfo {
    let mut info = StepInfo {
        step,
        directory: step_dir(step),
        committed: false,
        bytes: objects.iter().map(|o| o.size).sum(),
        objects: objects.len() as u64,
        save_id: None,
        saved_at_unix: None,
        layout: BTreeMap::new(),
        problem: None,
    };
    if !objects.iter().any(|o| o.path == META_NAME) {
        info.problem = Some(format!("no {META_NAME} (a save that never committed, or one still running)"));
        return info;
    }
    match read_metadata_local(step_storage(root, step).as_ref()) {
        Ok(meta) => {
            let sizes: BTreeMap<&str, u64> = objects.iter().map(|o| (o.path.as_str(), o.size)).collect();
            let bad = meta.files.iter().find(|f| sizes.get(f.name.as_str()) != Some(&f.bytes));
            match bad {
                Some(f) => {
                    info.problem = Some(match sizes.get(f.name.as_str()) {
                        None => format!("damaged: its data file {} is missing", f.name),
                        Some(n) => format!("damaged: its data file {} has {n} bytes, not {}", f.name, f.bytes),
                    })
                }
                None => info.committed = true,
            }
            info.saved_at_unix = meta.layout.get(SAVED_AT_ENTRY).and_then(|v| v.parse().ok());
            info.save_id = Some(meta.save_id);
            info.layout = meta.layout;
        }
        Err(e) => info.problem = Some(format!("damaged: {e}")),
    }
    info
}

/// The pointer as stored: `None` where there is none.
pub fn read_pointer(root: &dyn Storage) -> Result<Option<std::result::Result<LatestPointer, String>>> {
    match root.get(LATEST_NAME) {
        Ok(b) => Ok(Some(serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", root.location(LATEST_NAME))))),
        Err(dckpt_storage::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(storage_err(e)),
    }
}

/// [`choose_latest`] over what the run root holds; the steps scanned come along.
pub fn resolve_latest(root: &Arc<dyn Storage>) -> Result<(Latest, Vec<StepInfo>)> {
    let steps = scan(root)?;
    let pointer = read_pointer(root.as_ref())?;
    Ok((choose_latest(&steps, pointer), steps))
}

/// Points `latest` at `step` unless it names a newer committed step already: the pointer
/// never goes back. Written whole (a conditional create or replace of what was read), so a
/// reader sees the old pointer or the new one; another writer in between wins.
pub fn write_pointer(root: &Arc<dyn Storage>, step: u64, save_id: &str) -> Result<()> {
    let new = LatestPointer { step, directory: step_dir(step), save_id: save_id.to_string() };
    let body = Bytes::from(serde_json::to_vec(&new).expect("the pointer serializes"));
    let old = match root.get(LATEST_NAME) {
        Ok(b) => Some(b),
        Err(dckpt_storage::Error::NotFound { .. }) => None,
        Err(e) => return Err(storage_err(e)),
    };
    if let Some(Ok(p)) = old.as_ref().map(|o| serde_json::from_slice::<LatestPointer>(o)) {
        let newer_committed = p.step > step
            && matches!(read_metadata_local(step_storage(root, p.step).as_ref()), Ok(m) if m.save_id == p.save_id);
        if newer_committed {
            return Ok(());
        }
    }
    match old {
        Some(old) => root.put_if_match(LATEST_NAME, body, &old),
        None => root.put_if_absent(LATEST_NAME, body),
    }
    .map_err(storage_err)
}

/// Deletes one step directory: its metadata first, so that what is left of a half-deleted
/// step is never taken for a committed checkpoint; then every other object, then the
/// unfinished writes no live writer holds. Calls `progress` once per object deleted.
pub fn delete_step(root: &Arc<dyn Storage>, step: u64, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let dir = step_storage(root, step);
    dir.delete(META_NAME).map_err(storage_err)?;
    progress(1);
    for o in dir.list("").map_err(storage_err)? {
        dir.delete(&o.path).map_err(storage_err)?;
        progress(1);
    }
    dir.remove_abandoned("").map_err(storage_err)?;
    Ok(())
}

/// What [`gc_root`] removed (or, in a dry run, would remove).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcReport {
    /// Whether nothing was deleted.
    pub dry_run: bool,
    /// Whole step directories, each with why.
    pub steps: Vec<RemovedStep>,
    /// Data files in committed steps that their metadata does not name (saves into that
    /// step that never committed), as `step-N/name`.
    pub data_files: Vec<ObjectInfo>,
    /// Unfinished writes of dead processes (temporaries), by the store's names for them.
    pub unfinished_writes: Vec<ObjectInfo>,
    /// Bytes of all of it.
    pub bytes: u64,
}

/// One step directory [`gc_root`] removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovedStep {
    /// The step.
    pub step: u64,
    /// Its directory.
    pub directory: String,
    /// `uncommitted`, `damaged` or `retention`.
    pub reason: String,
    /// Its bytes.
    pub bytes: u64,
    /// Its objects.
    pub objects: u64,
}

/// Garbage collection of a run root: step directories that are not committed (or damaged)
/// and older than the newest committed step, the committed steps `policy` does not keep
/// (`None`: none), data files in committed steps that their metadata does not name, and
/// unfinished writes no live writer holds. Never a step in `protected` (being saved), never
/// the newest committed step, never a step newer than it (a save may be running there), never
/// an object outside the step directories but for temporaries. `progress` counts objects
/// deleted; `total` is told how many there are first.
pub fn gc_root(
    root: &Arc<dyn Storage>,
    policy: Option<RetentionPolicy>,
    protected: &[u64],
    dry_run: bool,
    total: &mut dyn FnMut(u64),
    progress: &mut dyn FnMut(u64),
) -> Result<GcReport> {
    let steps = scan(root)?;
    let newest = steps.iter().filter(|s| s.committed).map(|s| s.step).max();
    let mut report = GcReport { dry_run, ..GcReport::default() };
    let Some(newest) = newest else {
        // Nothing committed: every step may be a save still running.
        report.unfinished_writes =
            if dry_run { root.list_abandoned("") } else { root.remove_abandoned("") }.map_err(storage_err)?;
        report.bytes = report.unfinished_writes.iter().map(|o| o.size).sum();
        return Ok(report);
    };
    let committed: Vec<u64> = steps.iter().filter(|s| s.committed).map(|s| s.step).collect();
    let retired: BTreeSet<u64> =
        retention_deletes(&committed, policy.unwrap_or_default(), protected).into_iter().collect();
    for s in &steps {
        if protected.contains(&s.step) || s.step >= newest {
            continue;
        }
        let reason = if retired.contains(&s.step) {
            "retention"
        } else if s.committed {
            continue;
        } else if s.problem.as_deref().is_some_and(|p| p.starts_with("damaged")) {
            "damaged"
        } else {
            "uncommitted"
        };
        report.steps.push(RemovedStep {
            step: s.step,
            directory: s.directory.clone(),
            reason: reason.into(),
            bytes: s.bytes,
            objects: s.objects,
        });
    }
    let removed: BTreeSet<u64> = report.steps.iter().map(|s| s.step).collect();
    for s in steps.iter().filter(|s| s.committed && !removed.contains(&s.step) && !protected.contains(&s.step)) {
        let dir = step_storage(root, s.step);
        let meta = read_metadata_local(dir.as_ref())?;
        let named: BTreeSet<&str> = meta.files.iter().map(|f| f.name.as_str()).collect();
        for o in dir.list("").map_err(storage_err)? {
            if is_data_file_name(&o.path) && !named.contains(o.path.as_str()) {
                report.data_files.push(ObjectInfo { path: format!("{}/{}", s.directory, o.path), size: o.size });
            }
        }
    }
    total(report.steps.iter().map(|s| s.objects).sum::<u64>() + report.data_files.len() as u64);
    if !dry_run {
        for s in &report.steps {
            delete_step(root, s.step, progress)?;
        }
        for f in &report.data_files {
            root.delete(&f.path).map_err(storage_err)?;
            progress(1);
        }
    }
    report.unfinished_writes =
        if dry_run { root.list_abandoned("") } else { root.remove_abandoned("") }.map_err(storage_err)?;
    report.bytes = report.steps.iter().map(|s| s.bytes).sum::<u64>()
        + report.data_files.iter().chain(&report.unfinished_writes).map(|o| o.size).sum::<u64>();
    Ok(report)
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

/// Checkpoints over a training run, one per step, under a run root (see the module docs).
/// One per rank; every rank makes the same calls in the same order, as with
/// [`Checkpointer`]. What touches the run root itself (listing, the pointer, deletions) is
/// done by rank 0 and its outcome, or its error, is sent to every rank, so every rank returns
/// the same.
///
/// Retention runs after each successful commit: for a background save when its handle is
/// waited on, or at the next call, so that it never runs while a save is in flight. Every
/// call waits for a background save first (the collective carries one call at a time).
#[derive(Debug)]
pub struct CheckpointManager {
    collective: Arc<dyn Collective>,
    ckpt: Checkpointer,
    root: Arc<dyn Storage>,
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
        Ok(CheckpointManager { collective, ckpt, root, policy, pending: Mutex::new(None) })
    }

    /// The checkpointer it saves and loads with.
    pub fn checkpointer(&self) -> &Checkpointer {
        &self.ckpt
    }

    /// The run root.
    pub fn root(&self) -> &Arc<dyn Storage> {
        &self.root
    }

    /// The retention policy.
    pub fn policy(&self) -> RetentionPolicy {
        self.policy
    }

    /// The storage of `step`'s checkpoint.
    pub fn step_location(&self, step: u64) -> Arc<dyn Storage> {
        step_storage(&self.root, step)
    }

    /// Saves `step` and returns once it is committed, the pointer names it and retention has
    /// run. A step that is committed already is refused ([`ErrorKind::AlreadyExists`]), as is a
    /// replace asked for in `opts`: a step is saved once.
    pub fn save(&self, step: u64, state: &SaveState<'_>, opts: &SaveOptions) -> Result<StepOutcome> {
        self.finish_pending()?;
        let opts = self.step_options(step, opts)?;
        let outcome = self.ckpt.save(Location::Storage(self.step_location(step)), state, &opts)?;
        self.after_commit(step, outcome)
    }

    /// Copies the state and returns; the save goes on in the background. Retention runs
    /// when the handle is waited on, or at the next call of this manager.
    pub fn save_async(&self, step: u64, state: &SaveState<'_>, opts: &SaveOptions) -> Result<PendingStep<'_>> {
        self.finish_pending()?;
        let opts = self.step_options(step, opts)?;
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
                self.after_commit(step, outcome).map(Some)
            }
        }
    }

    /// The latest committed step (see [`choose_latest`]).
    pub fn latest(&self) -> Result<Latest> {
        self.finish_pending()?;
        self.on_root(|root| resolve_latest(root).map(|(l, _)| l))
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
        self.on_root(scan)
    }

    /// Garbage collection ([`gc_root`]) with this manager's retention policy.
    pub fn gc(&self) -> Result<GcReport> {
        self.finish_pending()?;
        let policy = self.policy;
        self.on_root(|root| gc_root(root, Some(policy), &[], false, &mut |_| {}, &mut |_| {}))
    }

    /// Checks on rank 0 that `step` may be saved, and returns the options of its save (the
    /// step and rank 0's clock recorded, never a replace).
    fn step_options(&self, step: u64, opts: &SaveOptions) -> Result<SaveOptions> {
        if opts.replace {
            return Err(Error::invalid_options(format!(
                "step {step}: a managed step is saved once; replace is refused"
            )));
        }
        let now = self.on_root(|root| {
            let dir = step_storage(root, step);
            if read_metadata_local(dir.as_ref()).is_ok() {
                return Err(Error::new(ErrorKind::AlreadyExists { location: dir.location("") }).on_rank(0));
            }
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs());
            Ok(t.unwrap_or(0))
        })?;
        Ok(opts.clone().layout_entry(STEP_ENTRY, step).layout_entry(SAVED_AT_ENTRY, now))
    }

    /// After `step` committed: the pointer, then retention (never the step just saved: it
    /// is the newest committed step unless a newer one exists, which retention keeps too).
    fn after_commit(&self, step: u64, outcome: SaveOutcome) -> Result<StepOutcome> {
        let policy = self.policy;
        let save_id = outcome.save_id.clone();
        let removed = self.on_root(|root| {
            write_pointer(root, step, &save_id)?;
            if policy.keeps_all() {
                return Ok(Vec::new());
            }
            let committed: Vec<u64> = scan(root)?.into_iter().filter(|s| s.committed).map(|s| s.step).collect();
            let doomed = retention_deletes(&committed, policy, &[step]);
            for &s in &doomed {
                delete_step(root, s, &mut |_| {})?;
            }
            Ok(doomed)
        })?;
        Ok(StepOutcome { step, outcome, removed })
    }

    /// Runs `f` on rank 0 and gives every rank its outcome (or its error, stamped rank 0).
    fn on_root<T: Serialize + DeserializeOwned>(&self, f: impl FnOnce(&Arc<dyn Storage>) -> Result<T>) -> Result<T> {
        if self.collective.rank() != 0 {
            let bytes = self.collective.broadcast(0, None)?;
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
        if self.collective.world_size() > 1 {
            self.collective.broadcast(0, Some(&bytes))?;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_sort_as_numbers_and_parse_back_exactly() {
        assert_eq!(step_dir(42), "step-000000000042");
        let mut names: Vec<String> = [10, 9, 100, 1].iter().map(|&s| step_dir(s)).collect();
        names.sort();
        let parsed: Vec<u64> = names.iter().map(|n| parse_step_dir(n).unwrap()).collect();
        assert_eq!(parsed, [1, 9, 10, 100]);
        assert_eq!(parse_step_dir(&step_dir(u64::MAX)), Some(u64::MAX));
        for bad in ["step-42", "step-0000000000042", "step-", "step-00000000004x", "latest", "step-+00000000042"] {
            assert_eq!(parse_step_dir(bad), None, "{bad}");
        }
    }

    #[test]
    fn retention_keeps_the_last_n_every_kth_the_newest_and_the_protected() {
        let all: Vec<u64> = (1..=10).collect();
        let p = |keep_last, keep_every| RetentionPolicy { keep_last, keep_every };
        assert_eq!(retention_deletes(&all, p(None, None), &[]), Vec::<u64>::new());
        assert_eq!(retention_deletes(&all, p(Some(3), None), &[]), (1..=7).collect::<Vec<_>>());
        assert_eq!(retention_deletes(&all, p(Some(2), Some(4)), &[]), [1, 2, 3, 5, 6, 7]);
        assert_eq!(retention_deletes(&all, p(None, Some(5)), &[]), [1, 2, 3, 4, 6, 7, 8, 9]);
        // keep_last 0 still keeps the newest committed step, and protected steps stay.
        assert_eq!(retention_deletes(&all, p(Some(0), None), &[3]), [1, 2, 4, 5, 6, 7, 8, 9]);
        assert_eq!(retention_deletes(&[7, 2, 5], p(Some(1), None), &[]), [2, 5]);
        assert_eq!(retention_deletes(&[], p(Some(1), None), &[]), Vec::<u64>::new());
    }

    fn info(step: u64, committed: bool, save_id: &str) -> StepInfo {
        StepInfo {
            step,
            directory: step_dir(step),
            committed,
            bytes: 0,
            objects: 0,
            save_id: committed.then(|| save_id.to_string()),
            saved_at_unix: None,
            layout: BTreeMap::new(),
            problem: (!committed).then(|| "no dckpt.meta".to_string()),
        }
    }

    fn pointer(step: u64, save_id: &str) -> Option<std::result::Result<LatestPointer, String>> {
        Some(Ok(LatestPointer { step, directory: step_dir(step), save_id: save_id.into() }))
    }

    #[test]
    fn latest_is_never_uncommitted_and_says_what_it_skipped() {
        let steps = [info(1, true, "a"), info(2, true, "b"), info(3, false, "")];
        let l = choose_latest(&steps, pointer(2, "b"));
        assert_eq!((l.step, l.from_pointer), (Some(2), true));
        assert_eq!(l.skipped, [Skipped { step: 3, reason: "no dckpt.meta".into() }]);
        // A pointer to a step that is gone, or to another save, is passed over by name.
        let l = choose_latest(&steps, pointer(9, "z"));
        assert_eq!((l.step, l.from_pointer), (Some(2), false));
        assert!(l.skipped.iter().any(|s| s.step == 9 && s.reason.contains("not there")), "{l:?}");
        let l = choose_latest(&steps, pointer(1, "other"));
        assert!(l.skipped.iter().any(|s| s.step == 1 && s.reason.contains("save other")), "{l:?}");
        // A commit whose pointer write was lost is newer than the pointer: listing wins.
        let l = choose_latest(&[info(1, true, "a"), info(2, true, "b")], pointer(1, "a"));
        assert_eq!((l.step, l.from_pointer), (Some(2), false));
        let l = choose_latest(&[info(1, false, "")], Some(Err("bad json".into())));
        assert_eq!(l.step, None);
        assert_eq!(l.skipped.len(), 2);
        assert_eq!(choose_latest(&[], None).step, None);
    }
}
