//! Leftovers: what lies under a checkpoint's root that its committed metadata does not name.
//! Data files of failed or replaced saves, unfinished writes of processes that died (on local
//! disk `.dckpt-tmp.*` temporaries), anything else. [`crate::verify::verify`] lists them,
//! [`remove_leftovers`] removes the first two kinds, and every commit removes the unfinished
//! writes that no live writer holds, so a killed save's temporaries do not outlive the next
//! save. Which writes are still live the storage decides (`Storage::list_abandoned`): a
//! write a running save holds never counts as a leftover.

use std::collections::HashSet;

use dckpt_storage::{ObjectInfo, Storage, StorageExt};
use serde::Serialize;

use crate::Result;
use crate::format::{META_NAME, Metadata, is_data_file_name};
use crate::load::read_metadata_local;

/// What a [`Leftover`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LeftoverKind {
    /// A data file (its name has the data-file pattern) that the metadata does not name: a
    /// save's that failed, was replaced, or is still running.
    DataFile,
    /// An unfinished write that no live writer holds: its process died while writing it.
    UnfinishedWrite,
    /// Any other object. dckpt never removes it.
    Other,
}

/// One leftover under a checkpoint's root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Leftover {
    /// The path under the root (for an unfinished write, the store's own name for it).
    pub path: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// What it is, and so whether `remove_leftovers` removes it (all but `Other`).
    pub kind: LeftoverKind,
}

impl Leftover {
    fn new(o: ObjectInfo, kind: LeftoverKind) -> Leftover {
        Leftover { path: o.path, bytes: o.size, kind }
    }
}

/// Every leftover under the root of checkpoint `meta`, sorted by path.
pub(crate) fn list(storage: &dyn Storage, meta: &Metadata) -> Result<Vec<Leftover>> {
    let referenced: HashSet<&str> = meta.files.iter().map(|f| f.name.as_str()).chain([META_NAME]).collect();
    let mut out: Vec<Leftover> = storage
        .list("")?
        .into_iter()
        .filter(|o| !referenced.contains(o.path.as_str()))
        .map(|o| {
            let kind = if is_data_file_name(&o.path) { LeftoverKind::DataFile } else { LeftoverKind::Other };
            Leftover::new(o, kind)
        })
        .collect();
    out.extend(unfinished_writes(storage)?);
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// The unfinished writes under the root that no live writer holds (a checkpoint need not be
/// committed there).
pub fn unfinished_writes(storage: &dyn Storage) -> Result<Vec<Leftover>> {
    let found = storage.list_abandoned("")?;
    Ok(found.into_iter().map(|o| Leftover::new(o, LeftoverKind::UnfinishedWrite)).collect())
}

/// Removes the unfinished writes under the root that no live writer holds; returns them.
/// Safe while other saves run, and whether or not a checkpoint is committed there.
pub fn remove_unfinished_writes(storage: &dyn Storage) -> Result<Vec<Leftover>> {
    let removed = storage.remove_abandoned("")?;
    Ok(removed.into_iter().map(|o| Leftover::new(o, LeftoverKind::UnfinishedWrite)).collect())
}

/// Removes the data files of other saves (failed or replaced ones) and the unfinished writes
/// of dead processes from the root; other objects are left alone. Returns what was removed.
/// Do not run it while a save to the same location is in progress: that save's data files
/// are not yet named by the metadata (its unfinished writes are safe).
pub fn remove_leftovers(storage: &dyn Storage) -> Result<Vec<Leftover>> {
    let meta = read_metadata_local(storage)?;
    let files: Vec<Leftover> = list(storage, &meta)?.into_iter().filter(|l| l.kind == LeftoverKind::DataFile).collect();
    let paths: Vec<&str> = files.iter().map(|l| l.path.as_str()).collect();
    let (mut deleted, mut failed) = (HashSet::new(), None);
    storage.delete_all(&paths, |path, result| match result {
        Ok(()) => {
            deleted.insert(path.to_string());
            true
        }
        Err(e) => {
            failed.get_or_insert(e);
            false
        }
    });
    if let Some(e) = failed {
        return Err(e.into());
    }
    let mut removed: Vec<Leftover> = files.into_iter().filter(|l| deleted.contains(&l.path)).collect();
    removed.extend(remove_unfinished_writes(storage)?);
    Ok(removed)
}

/// After a commit landed: what earlier saves' dead processes left unfinished goes. Best
/// effort, as the save has succeeded already; a failure is logged.
pub(crate) fn clean_after_commit(storage: &dyn Storage) {
    match remove_unfinished_writes(storage) {
        Ok(removed) if !removed.is_empty() => log::info!(
            "removed {} unfinished writes of dead processes ({} bytes) from {}",
            removed.len(),
            removed.iter().map(|l| l.bytes).sum::<u64>(),
            storage.location("")
        ),
        Ok(_) => {}
        Err(e) => log::warn!("removing unfinished writes of dead processes from {}: {e}", storage.location("")),
    }
}
