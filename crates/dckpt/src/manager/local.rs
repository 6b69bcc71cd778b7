//! A run's node-local tier: where each rank's node directory is, how often the tiers are
//! saved, and what a restore that used both tiers reports.

use std::sync::Arc;

use dckpt_engine::local::{IfWhole, LocalRestoreOptions, LocalRestoreOutcome, LocalSaveOptions, Placement};
use dckpt_engine::{
    Error, ErrorKind, KeyPolicy, LoadOptions, LoadOutcome, LoadRequest, Result, SaveOptions, Strictness,
};
use dckpt_storage::Storage;
use serde::{Deserialize, Serialize};

use crate::Location;

/// The node-local tier of a run, beside its run root (the persistent tier). Each rank saves
/// its state as it holds it under its node's directory, with copies on other nodes (see
/// [`dckpt_engine::local`]); a restart restores from there when it can, and from the run
/// root otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalTier {
    /// The node-local directory: `{node}` and `{rank}` expand (`/local/nvme/run-a/{node}`).
    pub template: String,
    /// The local tier is saved at every step divisible by this (0: never).
    pub every: u64,
    /// Copies of each rank's part, its own included (default 2: its own and one on
    /// another node).
    pub copies: usize,
    /// Complete local steps kept (default 1).
    pub keep: usize,
    /// Ranks per node; `None` reads `LOCAL_WORLD_SIZE` (torchrun's), as `GROUP_RANK` names
    /// the node, which must agree with it.
    pub ranks_per_node: Option<usize>,
    /// The run root is saved at every step divisible by this (0: never).
    pub persistent_every: u64,
}

impl LocalTier {
    /// The tier at `template`: local every step, persistent every 100, 2 copies, 1 kept,
    /// nodes from the environment.
    pub fn new(template: impl Into<String>) -> LocalTier {
        LocalTier {
            template: template.into(),
            every: 1,
            copies: 2,
            keep: 1,
            ranks_per_node: None,
            persistent_every: 100,
        }
    }

    /// Whether `step` saves the local tier.
    pub fn local_due(&self, step: u64) -> bool {
        self.every > 0 && step.is_multiple_of(self.every)
    }

    /// Whether `step` saves the persistent tier.
    pub fn persistent_due(&self, step: u64) -> bool {
        self.persistent_every > 0 && step.is_multiple_of(self.persistent_every)
    }

    /// The placement of copies in a world of `world` ranks, and the node-local directory
    /// of `rank`, with the template expanded.
    pub fn resolve(&self, rank: usize, world: usize) -> Result<(Placement, String)> {
        let rpn = match self.ranks_per_node {
            Some(n) => n,
            None => env_usize("LOCAL_WORLD_SIZE")?.ok_or_else(|| {
                Error::invalid_options(
                    "local tier: ranks per node not given, and LOCAL_WORLD_SIZE is not set (torchrun sets it)",
                )
            })?,
        };
        let placement = Placement { ranks_per_node: rpn, copies: self.copies };
        placement.check(world)?;
        let node = placement.node_of(rank);
        if self.ranks_per_node.is_none()
            && let Some(group) = env_usize("GROUP_RANK")?
            && group != node
        {
            return Err(Error::invalid_options(format!(
                "local tier: rank {rank} is on node {group} (GROUP_RANK), not {node} (rank / LOCAL_WORLD_SIZE): \
                 dckpt places copies by consecutive ranks per node"
            )));
        }
        if !self.template.contains("{node}") && !self.template.contains("{rank}") {
            return Err(Error::invalid_options(format!(
                "local tier: the template {:?} names neither {{node}} nor {{rank}}: every node would share one directory",
                self.template
            )));
        }
        let dir = self.template.replace("{node}", &node.to_string()).replace("{rank}", &rank.to_string());
        Ok((placement, dir))
    }
}

fn env_usize(var: &str) -> Result<Option<usize>> {
    match std::env::var(var) {
        Ok(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| Error::invalid_options(format!("local tier: {var}={v:?} is not a number"))),
        Err(_) => Ok(None),
    }
}

/// Where a restore took each rank's part from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sources {
    /// Ranks restored from their own local copy.
    pub own: u64,
    /// Ranks restored from a peer's local copy.
    pub peer: u64,
    /// Ranks loaded from the persistent tier.
    pub persistent: u64,
}

/// What [`super::CheckpointManager::load_latest`] restored: the same on every rank except
/// the byte counts.
#[derive(Debug, Clone, Default)]
pub struct Restored {
    /// The step restored.
    pub step: u64,
    /// Where the parts came from.
    pub sources: Sources,
    /// Why each fallback happened (also logged as warnings).
    pub fallbacks: Vec<String>,
    /// The local tier's restore, when one was tried.
    pub local: Option<LocalRestoreOutcome>,
    /// The persistent tier's load, when parts came from there.
    pub persistent: Option<LoadOutcome>,
}

impl super::CheckpointManager {
    /// [`super::CheckpointManager::load_latest`] with a local tier: the newest whole local
    /// step at least `latest` new; where one fails to restore whole and the run root has no
    /// copy of it, the next older local step (an abandoned step's markers go at the end, so a
    /// step passed over here could never restore); the failed parts from the run root's step
    /// of the same number, or the whole restore from the run root's `latest`. `passed` are the
    /// run root's steps passed over, for the report.
    pub(super) fn load_latest_local(
        &self,
        local: &super::Local,
        req: &mut LoadRequest<'_>,
        opts: &LoadOptions,
        latest: Option<u64>,
        passed: Vec<String>,
    ) -> Result<Option<Restored>> {
        let caller_failed = opts.caller_failed.clone(); // fails the restore's first round, as the load's
        // The newest whole local step first; where one fails to restore whole and the run root
        // has no copy of it, the next older local step (newer than the run root's latest): an
        // abandoned step's markers go below, so one passed over here could never restore.
        let (mut below, mut tried, mut first_failed) = (None, Vec::new(), None);
        let got = loop {
            let run = self.run_name();
            let lopts = LocalRestoreOptions {
                min_step: latest,
                below,
                run,
                caller_failed: caller_failed.clone(),
                ..Default::default()
            };
            let got = self.ckpt.restore_local(Location::Storage(local.dir.clone()), req, &lopts)?;
            match got.step {
                Some(step) if !got.failed.is_empty() && !self.run.committed(step)? => {
                    // The engine logged its reasons; this one is the manager's to log.
                    let why = format!("local step {step} is not whole and the run root has no step {step}");
                    if self.ckpt.rank() == 0 {
                        log::warn!("restore: {why}");
                    }
                    tried.extend(got.reasons.iter().cloned());
                    tried.push(why);
                    below = Some(step);
                    first_failed.get_or_insert(got);
                }
                _ => break got,
            }
        };
        let mut r = Restored { fallbacks: tried, ..Restored::default() };
        r.fallbacks.extend(got.reasons.iter().cloned());
        r.fallbacks.extend(passed.iter().cloned());
        let told = r.fallbacks.len() - passed.len();
        r.sources = Sources { own: got.own, peer: got.peer, persistent: got.failed.len() as u64 };
        match got.step {
            Some(step) if got.failed.is_empty() => r.step = step,
            Some(step) => {
                // Only the failed parts are asked for; the others ask for nothing.
                let mine = got.failed.contains(&(self.ckpt.rank() as u32));
                let mut nothing = LoadRequest::new();
                let strictness = Strictness { unexpected: KeyPolicy::Ignore, ..opts.strictness };
                let partial = LoadOptions { strictness, ..opts.clone() };
                let at = Location::Storage(self.step_location(step));
                r.persistent = Some(self.ckpt.load(at, if mine { &mut *req } else { &mut nothing }, &partial)?);
                r.fallbacks.push(format!("the parts of ranks {:?} came from the run root's step {step}", got.failed));
                r.step = step;
            }
            None => {
                let Some(step) = latest else {
                    // The first step that failed is what the error names (it is kept).
                    return self.nothing_in_the_run_root(local, first_failed.as_ref().unwrap_or(&got)).map(|()| None);
                };
                r.fallbacks.push(format!("the whole restore is the run root's step {step}"));
                r.persistent = Some(self.ckpt.load(Location::Storage(self.step_location(step)), req, opts)?);
                (r.step, r.sources) =
                    (step, Sources { persistent: self.ckpt.world_size() as u64, ..Sources::default() });
            }
        }
        if self.ckpt.rank() == 0 {
            for why in &r.fallbacks[told..] {
                log::warn!("restore: {why}");
            }
        }
        // Local steps newer than the one resumed from are an abandoned branch: their markers
        // go, so that gc never keeps one as the newest over this run's own steps.
        self.ckpt.unmark_local_newer(Location::Storage(local.dir.clone()), Some(r.step), &self.run_name())?;
        r.local = Some(got);
        Ok(Some(r))
    }

    /// A restore whose local step `got` could not give whole, where the run root holds no
    /// step. A step some rank marked complete is the run's only checkpoint, so it is kept
    /// and the restore fails naming it: its nodes or layout may come back. Where there is
    /// none, the run starts afresh, unmarking what a save cut short may have left.
    pub(super) fn nothing_in_the_run_root(&self, local: &super::Local, got: &LocalRestoreOutcome) -> Result<()> {
        let failed = |message: String| Err(Error::new(ErrorKind::Other { message }));
        match got.step {
            Some(s) => failed(format!(
                "local step {s} cannot be restored whole (ranks {:?}) and the run root holds no step",
                got.failed
            )),
            None if !got.not_whole.is_empty() => failed(format!(
                "local steps {:?} of this run cannot be restored whole here ({}) and the run root holds no \
                 step: restore them with the nodes and layout they were saved with, or remove them from the \
                 node-local directories to start afresh",
                got.not_whole,
                got.reasons.join("; ")
            )),
            None => {
                let dir = Location::Storage(local.dir.clone());
                self.ckpt.unmark_local_newer(dir, None, &self.run_name()).map(drop)
            }
        }
    }
}

/// The local tier as this rank resolved it.
#[derive(Debug)]
pub(super) struct Local {
    pub(super) tier: LocalTier,
    pub(super) placement: Placement,
    pub(super) dir: Arc<dyn Storage>,
}

impl Local {
    /// A digest of the tier's schedule and placement ([`super::RunRoot::same_step`]): FNV-1a
    /// over fixed-width numbers, the same wherever the manager runs (ranks of one job may
    /// run builds of other toolchains, whose `Hash` may differ); never 0, a manager
    /// without a local tier's.
    pub(super) fn config(&self) -> u64 {
        let (t, p) = (&self.tier, &self.placement);
        let fields = [t.every, t.persistent_every, t.keep as u64, p.ranks_per_node as u64, p.copies as u64];
        let h = fields
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        h.max(1)
    }

    /// A local save of `step` for the run at `run` (the run root's location): a restore
    /// of this run takes no other run's steps left in the same node directories. A caller's
    /// failure on this rank (`opts`) fails its first round, as it fails the persistent save's.
    /// A step this tier holds whole is refused, as a committed one is, unless the run root
    /// saves it too (`persistent`): then it is that save retried after it failed, and kept.
    pub(super) fn options(&self, step: u64, run: String, opts: &SaveOptions, persistent: bool) -> LocalSaveOptions {
        let caller_failed = opts.caller_failed.clone();
        let if_whole = if persistent { IfWhole::Keep } else { IfWhole::Refuse };
        LocalSaveOptions {
            keep: self.tier.keep,
            run,
            caller_failed,
            if_whole,
            ..LocalSaveOptions::new(step, self.placement)
        }
    }
}
