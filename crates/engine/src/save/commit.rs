//! Phase 3: the coordinator commits the metadata file, or cleans up.

use bytes::Bytes;
use dckpt_storage::Storage;

use crate::error::first_failure;
use crate::format::{META_NAME, Metadata, is_data_file_name};
use crate::plan::SavePlan;
use crate::{Error, Result};

use super::metadata::*;
use super::write::*;
use super::*;

/// On the coordinator: build the metadata from the plan and every rank's write result and
/// commit it, or clean up this save's files if any rank failed.
pub(super) fn commit(
    storage: &dyn Storage,
    opts: &SaveOptions,
    plan: &SavePlan,
    save_id: &str,
    results: Vec<Result<WriteResult>>,
    plan_reused: bool,
) -> Result<SaveOutcome> {
    if results.iter().any(|r| r.is_err()) {
        for f in results.iter().flatten().flat_map(|res| &res.files) {
            let _ = storage.delete(&f.name);
        }
    }
    let results = first_failure(results)?;
    let placed = place_all(plan, opts.block_bytes, results).map_err(|detail| Error::Protocol { detail })?;
    let bytes =
        Bytes::from(encode_metadata(opts, plan, save_id, &placed).map_err(|detail| Error::Protocol { detail })?);
    // The old checkpoint's files, to remove once a replacing commit has landed.
    let old = if opts.replace {
        storage.get(META_NAME).ok().and_then(|b| Metadata::decode_files(&b, META_NAME).ok())
    } else {
        None
    };
    match commit_metadata(storage, &bytes, opts.replace) {
        Commit::Landed => {
            let ours: std::collections::HashSet<&str> = placed.files.iter().map(|f| f.name.as_str()).collect();
            // Only what could be an old save's data file: never the metadata just committed,
            // whatever an old (or crafted) metadata file names.
            for f in old.iter().flatten().filter(|f| is_data_file_name(&f.name) && !ours.contains(f.name.as_str())) {
                let _ = storage.delete(&f.name);
            }
            crate::leftovers::clean_after_commit(storage);
        }
        Commit::Failed(e) => {
            // Our metadata is certainly not there: our data files are garbage.
            for f in &placed.files {
                let _ = storage.delete(&f.name);
            }
            return Err(e);
        }
        Commit::Unknown(detail) => {
            // It may have landed: its data files must stay.
            return Err(Error::CommitUncertain { rank: None, location: storage.location(META_NAME), detail });
        }
    }
    Ok(SaveOutcome {
        save_id: save_id.to_string(),
        bytes: plan.total_bytes(),
        files: placed.files.len(),
        chunks: plan.chunks.len() + plan.objects.len(),
        rank_bytes: 0,
        plan_reused,
    })
}

/// What became of a commit.
pub(super) enum Commit {
    Landed,
    /// It did not land (or another save's landed instead).
    Failed(Error),
    /// The write failed and reading back failed too.
    Unknown(String),
}

/// Writes the metadata file: a conditional create, or an atomic replace. An error does not
/// say whether the write landed (a lost reply, a retried create that finds its own first
/// attempt), so the stored bytes decide.
pub(super) fn commit_metadata(storage: &dyn Storage, bytes: &Bytes, replace: bool) -> Commit {
    let attempt =
        if replace { storage.put(META_NAME, bytes.clone()) } else { storage.put_if_absent(META_NAME, bytes.clone()) };
    let Err(e) = attempt else { return Commit::Landed };
    match storage.get(META_NAME) {
        Ok(found) if found == *bytes => Commit::Landed,
        // Another save committed this checkpoint first.
        Ok(_) if matches!(e, dckpt_storage::Error::AlreadyExists { .. }) => {
            Commit::Failed(Error::AlreadyExists { rank: None, location: storage.location(META_NAME) })
        }
        Ok(_) | Err(dckpt_storage::Error::NotFound { .. }) => Commit::Failed(e.into()),
        Err(read_back) => Commit::Unknown(format!("{e} (reading it back: {read_back})")),
    }
}
