//! The run root's storage work, without a collective: listing and looking at the steps,
//! reading and writing the pointer, deleting a step, garbage collection. The CLI runs
//! these directly; [`RunRoot`](super::RunRoot) runs them on rank 0 for every rank.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bytes::Bytes;
use dckpt_engine::format::{META_NAME, is_data_file_name};
use dckpt_engine::{Error, Result, read_metadata_local};
use dckpt_storage::{ObjectInfo, Prefixed, Storage, StorageExt};

use super::names::{LATEST_NAME, SAVED_AT_ENTRY, parse_step_dir, step_dir};
use super::policy::{Damage, GcOptions, GcReport, Latest, LatestPointer, StepInfo, StepState};
use super::policy::{choose_latest, gc_removals};

/// The storage of one step under the run root.
pub fn step_storage(root: &Arc<dyn Storage>, step: u64) -> Arc<dyn Storage> {
    Arc::new(Prefixed::new(root.clone(), &step_dir(step)).expect("step directory names are valid paths"))
}

fn storage_err(e: dckpt_storage::Error) -> Error {
    Error::from(e)
}

/// Every step directory under the run root, ascending, each looked at as [`StepInfo`] says
/// (its bytes and objects count the unfinished writes of dead processes in it). Objects
/// that are not in a step directory (the pointer, anything else) are not listed.
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
    Ok(dirs.into_iter().map(|(step, objects)| look_at(root, step, &objects)).collect())
}

/// One step directory looked at as [`scan`] looks at each, listing that directory alone.
pub fn look_at_step(root: &Arc<dyn Storage>, step: u64) -> Result<StepInfo> {
    let dir = step_storage(root, step);
    let mut objects = dir.list("").map_err(storage_err)?;
    objects.extend(dir.list_abandoned("").map_err(storage_err)?);
    Ok(look_at(root, step, &objects))
}

fn look_at(root: &Arc<dyn Storage>, step: u64, objects: &[ObjectInfo]) -> StepInfo {
    let mut info = StepInfo {
        step,
        directory: step_dir(step),
        state: StepState::Uncommitted,
        bytes: objects.iter().map(|o| o.size).sum(),
        objects: objects.len() as u64,
        save_id: None,
        saved_at_unix: None,
        layout: BTreeMap::new(),
    };
    if !objects.iter().any(|o| o.path == META_NAME) {
        return info;
    }
    match read_metadata_local(step_storage(root, step).as_ref()) {
        Ok(meta) => {
            let sizes: BTreeMap<&str, u64> = objects.iter().map(|o| (o.path.as_str(), o.size)).collect();
            let bad = meta.files.iter().find(|f| sizes.get(f.name.as_str()) != Some(&f.bytes));
            info.state = match bad {
                Some(f) => StepState::Damaged(match sizes.get(f.name.as_str()) {
                    None => Damage::MissingFile { name: f.name.clone() },
                    Some(&bytes) => Damage::FileSize { name: f.name.clone(), bytes, expected: f.bytes },
                }),
                None => StepState::Committed,
            };
            info.saved_at_unix = meta.layout.get(SAVED_AT_ENTRY).and_then(|v| v.parse().ok());
            info.save_id = Some(meta.save_id);
            info.layout = meta.layout;
        }
        Err(e) => info.state = judged(e),
    }
    info
}

/// What an error reading a step's metadata says of the step: damaged only where the bytes
/// read are wrong; a step whose metadata could not be read or judged here stays, since gc
/// removes damaged steps (a permission or I/O error, a network failure, a newer format).
fn judged(e: Error) -> StepState {
    use dckpt_engine::ErrorKind;
    use dckpt_engine::format::FormatErrorKind as F;
    match e.kind() {
        ErrorKind::Format { error }
            if matches!(error.kind(), F::NotMetadata | F::Damaged { .. } | F::Malformed { .. } | F::Invalid { .. }) =>
        {
            StepState::Damaged(Damage::Metadata { error: e.to_string() })
        }
        _ => StepState::Unreadable { error: e.to_string() },
    }
}

/// Makes `step` ready for a save: refuses it where it is committed already
/// (`ErrorKind::AlreadyExists`); removes it, with a warning, where it is damaged (its
/// metadata or a data file it names broken or gone: one a restart passed over): nothing
/// reads it, and left there it refused this step's every save, while gc keeps steps newer
/// than the newest commit. Metadata that could not be judged (a storage error reading it)
/// fails the call and is left alone.
pub(super) fn clear_for_save(root: &Arc<dyn Storage>, step: u64) -> Result<()> {
    use dckpt_engine::ErrorKind;
    let dir = step_storage(root, step);
    let committed = || Error::new(ErrorKind::AlreadyExists { location: dir.location("") }).on_rank(0);
    match look_at_step(root, step)?.state {
        StepState::Committed => Err(committed()),
        // Its own error, read again (one that now reads is taken as committed).
        StepState::Unreadable { .. } => {
            Err(read_metadata_local(dir.as_ref()).map_or_else(|e| e.on_rank(0), |_| committed()))
        }
        StepState::Damaged(damage) => {
            log::warn!(
                "step {step}: removing the damaged checkpoint at {} ({damage}) to save it again",
                dir.location("")
            );
            delete_step(root, step, &mut |_| {})
        }
        StepState::Uncommitted => Ok(()),
    }
}

/// The pointer as stored: `None` where there is none; what keeps it from being read (it
/// does not decode, or the store will not give it: a permission, a directory in its place)
/// as the error's text. The pointer never decides which step is latest (the listing does),
/// so a pointer that cannot be read is a note, where it failed `ls` and every restart.
pub fn read_pointer(root: &dyn Storage) -> Result<Option<std::result::Result<LatestPointer, String>>> {
    match root.get(LATEST_NAME) {
        Ok(b) => Ok(Some(serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", root.location(LATEST_NAME))))),
        Err(dckpt_storage::Error::NotFound { .. }) => Ok(None),
        Err(e) => Ok(Some(Err(e.to_string()))),
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
    let newer_committed = |stored: &[u8]| match serde_json::from_slice::<LatestPointer>(stored) {
        Ok(p) => {
            p.step > step
                && matches!(read_metadata_local(step_storage(root, p.step).as_ref()), Ok(m) if m.save_id == p.save_id)
        }
        Err(_) => false,
    };
    if old.as_deref().is_some_and(newer_committed) {
        return Ok(());
    }
    let written = match old {
        Some(old) => root.put_if_match(LATEST_NAME, body.clone(), &old),
        None => root.put_if_absent(LATEST_NAME, body.clone()),
    };
    // A write retried after its first attempt landed reports `AlreadyExists` or
    // `Precondition` (the storage contract's caveat), and one whose last attempt timed out
    // may have landed too: what is stored now says. The body names this save's id, so it is
    // this write's alone. Failing here failed a step that had committed.
    written.or_else(|e| match root.get(LATEST_NAME) {
        Ok(stored) if stored == body || newer_committed(&stored) => Ok(()),
        _ => Err(storage_err(e)),
    })
}

/// Deletes one step directory: its metadata first, so that what is left of a half-deleted
/// step is never taken for a committed checkpoint; then every other object, then the
/// unfinished writes no live writer holds. Calls `progress` once per object deleted. A
/// name the store will not take (a backslash or a control character: not dckpt's, put
/// there by hand) is left, with a warning naming it, and the rest goes on: one such file
/// stopped every gc of the run root before the rest of its work.
pub fn delete_step(root: &Arc<dyn Storage>, step: u64, progress: &mut dyn FnMut(u64)) -> Result<()> {
    let dir = step_storage(root, step);
    dir.delete(META_NAME).map_err(storage_err)?;
    progress(1);
    let objects = dir.list("").map_err(storage_err)?;
    let paths: Vec<&str> = objects.iter().map(|o| o.path.as_str()).collect();
    // Several at once: every rank waits for retention.
    let mut failed = None;
    dir.delete_all(&paths, |path, result| match result {
        Ok(()) => {
            progress(1);
            true
        }
        Err(dckpt_storage::Error::InvalidPath { reason, .. }) => {
            log::warn!("left {}: a name this store cannot remove ({reason})", dir.location(path));
            true
        }
        Err(e) => {
            failed.get_or_insert(storage_err(e));
            false
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    dir.remove_abandoned("").map_err(storage_err)?;
    Ok(())
}

/// What [`gc_root`] tells its caller as it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GcProgress {
    /// How many objects it is going to delete, once, before the first.
    Total(u64),
    /// Objects deleted since the last report.
    Deleted(u64),
}

/// Garbage collection of a run root: the step directories [`gc_removals`] names, data files
/// in committed steps that their metadata does not name, and unfinished writes no live
/// writer holds. Never a protected step, never an object outside the step directories but
/// for temporaries. `progress` hears of the objects deleted. What cannot be removed is in
/// [`GcReport::errors`], the rest removed all the same.
pub fn gc_root(root: &Arc<dyn Storage>, opts: &GcOptions, progress: &mut dyn FnMut(GcProgress)) -> Result<GcReport> {
    let steps = scan(root)?;
    let mut report = GcReport { dry_run: opts.dry_run, steps: gc_removals(&steps, opts), ..GcReport::default() };
    let removed: BTreeSet<u64> = report.steps.iter().map(|s| s.step).collect();
    let kept =
        steps.iter().filter(|s| s.committed() && !removed.contains(&s.step) && !opts.protected.contains(&s.step));
    for s in kept {
        report.data_files.extend(stray_data_files(root, s)?);
    }
    let objects = report.steps.iter().map(|s| s.objects).sum::<u64>() + report.data_files.len() as u64;
    progress(GcProgress::Total(objects));
    if !opts.dry_run {
        let errors = &mut report.errors;
        report.steps.retain(|s| match delete_step(root, s.step, &mut |n| progress(GcProgress::Deleted(n))) {
            Ok(()) => true,
            Err(e) => {
                errors.push(format!("step {}: {e}", s.step));
                false
            }
        });
        report.data_files.retain(|f| match root.delete(&f.path) {
            Ok(()) => {
                progress(GcProgress::Deleted(1));
                true
            }
            Err(e) => {
                errors.push(format!("{}: {e}", f.path));
                false
            }
        });
    }
    let unfinished = if opts.dry_run { root.list_abandoned("") } else { root.remove_abandoned("") };
    report.unfinished_writes = unfinished.unwrap_or_else(|e| {
        report.errors.push(format!("unfinished writes: {e}"));
        Vec::new()
    });
    report.bytes = report.steps.iter().map(|s| s.bytes).sum::<u64>()
        + report.data_files.iter().chain(&report.unfinished_writes).map(|o| o.size).sum::<u64>();
    Ok(report)
}

/// The data files in committed step `s` that its metadata does not name, as `step-N/name`.
fn stray_data_files(root: &Arc<dyn Storage>, s: &StepInfo) -> Result<Vec<ObjectInfo>> {
    let dir = step_storage(root, s.step);
    let meta = read_metadata_local(dir.as_ref())?;
    let named: BTreeSet<&str> = meta.files.iter().map(|f| f.name.as_str()).collect();
    let listed = dir.list("").map_err(storage_err)?;
    Ok(listed
        .into_iter()
        .filter(|o| is_data_file_name(&o.path) && !named.contains(o.path.as_str()))
        .map(|o| ObjectInfo { path: format!("{}/{}", s.directory, o.path), size: o.size })
        .collect())
}
