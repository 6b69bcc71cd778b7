//! Retention of a rank's node-local steps: after a save, and as garbage collection.

use dckpt_storage::Storage;

use super::Placement;
use super::part::{Manifest, data_name, done_name, meta_name, step_dir};
use super::restore;

/// Garbage collection of this rank's files under `dir`, its node's directory: what
/// retention after a save removes (every step older than the newest `keep` complete ones
/// this rank marked, its marker first), with no save needed. Steps newer than those, which
/// a save may be writing, stay. The steps removed. Not collective: each rank cleans its own.
/// Only `run`'s steps are looked at
/// ([`LocalSaveOptions::run`](super::LocalSaveOptions::run)); another run's are left as
/// they are, neither kept in this run's place nor removed.
pub fn gc_local(
    dir: &dyn Storage,
    rank: usize,
    world: usize,
    placement: Placement,
    keep: usize,
    run: &str,
) -> Vec<u64> {
    retain(dir, rank, world, u64::MAX, placement, keep, run)
}

/// Removes what this rank wrote of local steps older than the newest `keep` complete ones
/// it marked: its marker first (so that a half-removed step is never taken for complete),
/// then the parts it held (for a step it never marked, a save that died, the parts it
/// would hold). Failures are logged: retention never fails a save that landed.
pub(super) fn retain(
    dir: &dyn Storage,
    rank: usize,
    world: usize,
    step: u64,
    placement: Placement,
    keep: usize,
    run: &str,
) -> Vec<u64> {
    // Another run's steps are not listed: not this run's to keep or remove.
    let steps = match restore::local_steps(dir, rank, run) {
        Ok(s) => s,
        Err(e) => {
            log::warn!("local tier: rank {rank} could not list its steps for retention: {e}");
            return Vec::new();
        }
    };
    let mut would_hold: Vec<usize> = vec![rank];
    would_hold.extend(placement.sources(rank, world));
    let marked = steps.iter().rev().filter(|(s, held)| *s <= step && held.is_some());
    let oldest_kept = marked.take(keep.max(1)).last().map_or(step, |p| p.0);
    let mut removed = Vec::new();
    for (s, held) in steps.into_iter().filter(|&(s, _)| s < oldest_kept) {
        // The marker first, and nothing more where it stays: a step marked complete whose
        // parts are gone took a kept step's place in the next retention and evicted it.
        let gone = |name: String| match dir.delete(&name) {
            Ok(()) | Err(dckpt_storage::Error::NotFound { .. }) => true,
            Err(e) => {
                log::warn!("local tier: rank {rank} could not remove {}: {e}", dir.location(&name));
                false
            }
        };
        let held: Vec<usize> = match held {
            Some(held) => held,
            // Not marked by this rank: a save of this run that died, or another run's step
            // (one sharing the directory with another layout, or one whose save is in flight
            // here): only what is this run's goes.
            None => would_hold.iter().copied().filter(|&p| ours(dir, s, p, run)).collect(),
        };
        if held.is_empty() || !gone(done_name(s, rank)) {
            continue;
        }
        for name in held.iter().flat_map(|&p| [meta_name(s, p), data_name(s, p)]) {
            gone(name);
        }
        removed.push(s);
    }
    removed
}

/// Whether the part `part` of step `step` under `dir`, which no marker of this rank lists, is
/// `run`'s to remove: its manifest names `run` (or no run); with no manifest (a save that
/// died between the data and the manifest), where no manifest in the step names another run.
/// One that does not decode stays.
fn ours(dir: &dyn Storage, step: u64, part: usize, run: &str) -> bool {
    let of_run = |name: &str, bytes: &[u8]| {
        Manifest::decode(bytes, &dir.location(name)).ok().map(|m| super::run_matches(&m.run, run))
    };
    let meta = meta_name(step, part);
    match dir.get(&meta) {
        Ok(bytes) => of_run(&meta, &bytes).unwrap_or(false),
        Err(dckpt_storage::Error::NotFound { .. }) => {
            let Ok(listed) = dir.list(&step_dir(step)) else { return false };
            let manifests = listed.iter().filter(|o| o.path.ends_with(".meta"));
            manifests.filter_map(|o| dir.get(&o.path).ok().map(|b| of_run(&o.path, &b))).all(|r| r != Some(false))
        }
        Err(_) => false,
    }
}
