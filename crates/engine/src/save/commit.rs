//! Phase 3: the coordinator commits the metadata file, or cleans up.
//!
//! The commit is conditional on what the coordinator found when it planned ([`Found`]): a
//! create where there was no checkpoint, a replace of exactly the metadata bytes it read
//! where it was asked to replace one. The old checkpoint's data files are deleted only after
//! the new metadata has landed over it, and only those that metadata named, so a failure at
//! any point leaves the old checkpoint or the new one whole, and a save never deletes the
//! files of a save that committed (or is still writing) after it looked.

use bytes::Bytes;
use dckpt_storage::{Settled, Storage, StorageExt};

use crate::error::first_failure;
use crate::format::{META_NAME, Metadata, is_data_file_name};
use crate::plan::SavePlan;
use crate::{Error, ErrorKind, Result};

use super::metadata::*;
use super::write::*;
use super::*;

/// What a landed commit leaves to do once every rank has its outcome: the replaced
/// checkpoint's data files, and dead processes' unfinished writes, removed. Done inside the
/// commit's round it kept every other rank waiting (a delete per old file on an object
/// store), up to the collective's timeout, and a committed save was then reported failed.
#[derive(Debug, Default)]
pub(super) struct AfterCommit {
    replaced: Option<(Bytes, Vec<String>)>,
    landed: bool,
}

impl AfterCommit {
    pub(super) fn run(self, storage: &dyn Storage) {
        if let Some((old, ours)) = &self.replaced {
            remove_replaced(storage, old, &ours.iter().map(String::as_str).collect());
        }
        if self.landed {
            crate::leftovers::clean_after_commit(storage);
        }
    }
}

/// On the coordinator: build the metadata from the plan and every rank's write result and
/// commit it over what was `found`, or clean up this save's files if any rank failed; what
/// is left to do once the ranks have the outcome comes with it.
pub(super) fn commit(
    storage: &dyn Storage,
    opts: &SaveOptions,
    plan: &SavePlan,
    found: &Found,
    save_id: &str,
    results: Vec<Result<WriteResult>>,
    plan_reused: bool,
) -> Result<(SaveOutcome, AfterCommit)> {
    // The files the ranks wrote: a save refused from here on (a rank failed, or the commit
    // is refused) leaves none of them behind.
    let written: Vec<String> = results.iter().flatten().flat_map(|r| r.files.iter().map(|f| f.name.clone())).collect();
    let remove_written = || {
        for name in &written {
            let _ = storage.delete(name);
        }
    };
    let results = first_failure(results).inspect_err(|_| remove_written())?;
    check_shared(storage, &results).inspect_err(|_| remove_written())?;
    let built = place_all(plan, opts.block_bytes, results).map_err(Error::protocol).and_then(|placed| {
        let bytes = Bytes::from(encode_metadata(opts, plan, save_id, &placed).map_err(Error::protocol)?);
        // Larger than any reader takes (tens of millions of chunks): fail here, as a reader
        // would, rather than commit a checkpoint none opens (over the one it replaces).
        crate::format::check_meta_bytes(bytes.len() as u64, &storage.location(META_NAME))?;
        Ok((placed, bytes))
    });
    let (placed, bytes) = built.inspect_err(|_| remove_written())?;
    let mut after = AfterCommit::default();
    match commit_metadata(storage, &bytes, found) {
        Commit::Landed => {
            if let Found::Checkpoint(old) = found {
                let ours = placed.files.iter().map(|f| f.name.clone()).collect();
                after.replaced = Some((old.clone(), ours));
            }
            after.landed = true;
        }
        Commit::Failed(e) => {
            // Our metadata is certainly not there: our data files are garbage.
            remove_written();
            return Err(e);
        }
        Commit::Unknown(detail) => {
            // It may have landed: its data files must stay.
            return Err(Error::from(ErrorKind::CommitUncertain { location: storage.location(META_NAME), detail }));
        }
    }
    let outcome = SaveOutcome {
        save_id: save_id.to_string(),
        bytes: plan.total_bytes(),
        files: placed.files.len(),
        chunks: plan.chunks.len() + plan.objects.len(),
        rank_bytes: 0,
        plan_reused,
        replicas_checked: 0,
        phases: Default::default(),
    };
    Ok((outcome, after))
}

/// Fails where a data file another rank wrote is not at the coordinator's location with the
/// length written. Ranks whose storage is not one store (one path on each node's own disk,
/// `memory://` in each process) wrote files the metadata would name and no reader finds, and
/// the save reported success on every rank. A few ranks are looked at, not all: the last
/// first (on another node wherever there is one), then ranks spread towards the coordinator;
/// constant work whatever the world.
fn check_shared(storage: &dyn Storage, results: &[WriteResult]) -> Result<()> {
    let world = results.len();
    let mut ranks = vec![world.saturating_sub(1), world / 2, world / 4, 1];
    ranks.retain(|&r| r > 0 && r < world);
    ranks.dedup();
    for r in ranks {
        let Some(f) = results[r].files.first() else { continue };
        let found = match storage.size(&f.name) {
            Ok(n) if n == f.bytes => continue,
            Ok(n) => format!("has {n} bytes"),
            Err(dckpt_storage::Error::NotFound { .. }) => "is not there".to_string(),
            Err(e) => format!("cannot be looked at ({e})"),
        };
        return Err(Error::invalid_options(format!(
            "the ranks do not save to one store: rank {r} wrote {} ({} bytes), which at {} {found}; \
             a checkpoint location must be shared by every rank (a path on each node's own disk is not)",
            f.name,
            f.bytes,
            storage.location(&f.name)
        ))
        .on_rank(r as u32));
    }
    Ok(())
}

/// Deletes the data files that `old`, the metadata a commit just replaced, names, except
/// `ours`. Only names of the data-file pattern: never the metadata just committed, whatever an
/// old (or crafted) metadata file lists. Best effort: a file that cannot be deleted is a
/// leftover, which the new checkpoint does not need.
/// `ours` is a set: both lists hold a file per rank or more, tens of thousands at scale.
fn remove_replaced(storage: &dyn Storage, old: &[u8], ours: &std::collections::HashSet<&str>) {
    // Metadata that does not decode names nothing we could trust: delete nothing.
    let Ok(files) = Metadata::decode_files(old, META_NAME) else { return };
    let gone: Vec<&str> =
        files.iter().map(|f| f.name.as_str()).filter(|n| is_data_file_name(n) && !ours.contains(n)).collect();
    // Several at once: the coordinator's save returns only after them, while the others
    // wait in their next collective.
    storage.delete_all(&gone, |name, result| {
        if let Err(e) = result {
            log::warn!("save: the replaced checkpoint's {name} stays behind as a leftover: {e}");
        }
        true
    });
}

/// What became of a commit.
pub(super) enum Commit {
    Landed,
    /// It did not land (or another save's landed instead).
    Failed(Error),
    /// The write failed and reading back failed too.
    Unknown(String),
}

/// Writes the metadata file: a conditional create where nothing was found, or a conditional
/// replace of the metadata that was found. An error does not say whether the write landed (a
/// lost reply, a retried create or replace that finds its own first attempt), so the stored
/// bytes decide.
pub(super) fn commit_metadata(storage: &dyn Storage, bytes: &Bytes, found: &Found) -> Commit {
    let attempt = match found {
        Found::Nothing => storage.put_if_absent(META_NAME, bytes.clone()),
        Found::Checkpoint(old) => storage.put_if_match(META_NAME, bytes.clone(), old),
    };
    match storage.settle(META_NAME, bytes, attempt) {
        Settled::Landed => Commit::Landed,
        // Another save committed here after this one looked.
        Settled::Failed(dckpt_storage::Error::AlreadyExists { .. } | dckpt_storage::Error::Precondition { .. }) => {
            Commit::Failed(Error::from(ErrorKind::AlreadyExists { location: storage.location(META_NAME) }))
        }
        Settled::Failed(e) => Commit::Failed(e.into()),
        // Its data files must stay, or the metadata could land naming files already deleted.
        Settled::Unknown(detail) => Commit::Unknown(detail),
    }
}

#[cfg(test)]
mod tests {
    use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedTensor};
    use dckpt_storage::MemoryStorage;

    use super::*;
    use crate::plan::{LocalPlan, plan_save};

    /// Write results the metadata cannot be built from (a rank's checksums cover fewer
    /// blocks than its piece has): the commit is refused and every rank's data files go, as
    /// for any other refused commit. They stayed behind.
    #[test]
    fn a_commit_refused_for_its_write_results_leaves_no_data_file() {
        let t = |key: &str| ShardedTensor {
            key: key.into(),
            dtype: DType::U8,
            global_shape: [10].into(),
            region: Region::full(&[10]),
            replica_id: ReplicaId::MAIN,
        };
        let opts = SaveOptions { block_bytes: 4, ..SaveOptions::default() };
        let local = LocalPlan { tensors: vec![t("a"), t("b")], objects: Vec::new() };
        let plan = plan_save(&[local], None, opts.assignment).unwrap();
        let mut results = planned_results(&plan, &opts, "0123456789abcdef", None);
        let storage = MemoryStorage::new();
        for f in &results[0].files {
            storage.put(&f.name, Bytes::from_static(b"written")).unwrap();
        }
        assert!(!storage.list("").unwrap().is_empty());
        results[0].crcs.truncate(4);
        let written = vec![Ok(results.remove(0))];
        let Err(err) = commit(&storage, &opts, &plan, &Found::Nothing, "0123456789abcdef", written, false) else {
            panic!("committed")
        };
        assert!(matches!(err.kind(), ErrorKind::Protocol { .. }), "{err}");
        assert_eq!(storage.list("").unwrap(), Vec::new(), "the data files are gone");
    }
}
