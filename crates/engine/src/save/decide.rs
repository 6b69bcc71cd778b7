//! Phase 1: the plan, decided on the coordinator (or the cached one, after one
//! all-reduce), what the coordinator found at the target, and the replica check.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use bytes::Bytes;
use dckpt_storage::{Storage, StorageExt};
use serde::{Deserialize, Serialize};

use crate::error::first_failure;
use crate::format::META_NAME;
use crate::plan::{LocalPlan, ObjectItem, RankWrites, SavePlan, plan_save};
use crate::protocol::{COORDINATOR, gather_decide, gather_decide_each};
use crate::{Error, ErrorKind, Result};

use super::replicas::{check_lists, compare, local_crcs};
use super::{Inputs, PlanCache, ReplicaCheck, SaveOptions, SaveState, SourcedTensor};

/// What the coordinator tells each rank once it has planned.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct PlanDecision {
    pub(super) save_id: String,
    /// This rank's writes and its check list, or `None` when the cached plan stands.
    pub(super) writes: Option<(RankWrites, Vec<u32>)>,
    /// Whether the replica check's exchange follows (a new plan with replicated chunks or
    /// compared objects, and a coordinator that checks them): the same on every rank.
    pub(super) check_replicas: bool,
}

/// What phase 1 leaves for the commit.
pub(super) struct Planned {
    /// The coordinator's id of the save, which names its files.
    pub(super) save_id: String,
    /// On the coordinator: what it found at the target, which the commit may replace.
    pub(super) found: Option<Found>,
    /// How many replicated chunks were compared on all their bytes, and objects compared.
    pub(super) checked: u64,
    /// Whether the cached plan stood.
    pub(super) plan_reused: bool,
}

/// The coordinator validates, assigns writers and checks the target, keeping what it found
/// there for the commit; then it compares the replicas. Every rank's `cache` then holds the
/// plan this save writes by.
pub(super) fn plan_phase(
    io: &Inputs<'_, '_>,
    cache: &mut PlanCache,
    all_reuse: bool,
    local_check: Result<()>,
    structure: u64,
) -> Result<Planned> {
    let mut found = None;
    let mut checked = 0;
    let decision = if all_reuse {
        reuse_plan(io, cache, &mut found, &mut checked)?
    } else {
        new_plan(io, cache, local_check, &mut found)?
    };
    let plan_reused = decision.writes.is_none();
    if let Some((writes, checks)) = decision.writes {
        cache.writes = writes;
        cache.checks = checks;
        cache.structure = Some(structure);
    }
    if decision.check_replicas {
        checked = check_new_replicas(io, cache)?;
    }
    Ok(Planned { save_id: decision.save_id, found, checked, plan_reused })
}

/// The cached plan stands: the replicas' checksums are this exchange's message.
fn reuse_plan(
    io: &Inputs<'_, '_>,
    cache: &PlanCache,
    found: &mut Option<Found>,
    checked: &mut u64,
) -> Result<PlanDecision> {
    let (opts, save_id) = (io.opts, &io.save_id);
    let crcs = local_crcs(io.state, io.sourced, &cache.checks, opts.replica_check, save_id);
    let crcs = crcs.map(|c| (mode_code(opts.replica_check), c));
    let (plan, sets) = (cache.plan.as_ref(), &cache.sets);
    gather_decide(io.coll, crcs, "save decision", |all| {
        let plan = plan.expect("the coordinator holds the plan");
        let all = same_mode(first_failure(all)?, opts.replica_check)?;
        compare(plan, sets, &all, opts.replica_check, save_id)
            .and_then(|n| {
                *checked = n;
                check_target(io.storage, opts)
            })
            .map(|f| {
                *found = Some(f);
                PlanDecision { save_id: save_id.clone(), writes: None, check_replicas: false }
            })
            .map_err(|e| e.on_rank(COORDINATOR as u32))
    })?
}

/// Every rank sends its shard list; the coordinator plans and sends each rank its writes.
fn new_plan(
    io: &Inputs<'_, '_>,
    cache: &mut PlanCache,
    local_check: Result<()>,
    found: &mut Option<Found>,
) -> Result<PlanDecision> {
    // The shard list is copied only when it is planned: not when the cached plan stands.
    let msg: Result<LocalPlan> = local_check.map(|()| local_plan(io.state, io.sourced));
    let mut plan_out = None;
    // Each rank hears only its own writes: at scale the whole list is large.
    let decision = gather_decide_each(io.coll, msg, "save plan", |all| {
        let world = all.len();
        match decide(io.storage, io.opts, all) {
            Ok((plan, f)) => {
                *found = Some(f);
                let (lists, sets) = check_lists(&plan);
                let check_replicas = !sets.is_empty() && io.opts.replica_check != ReplicaCheck::Off;
                let each = plan
                    .ranks
                    .iter()
                    .zip(lists)
                    .map(|(w, l)| {
                        Ok(PlanDecision { save_id: io.save_id.clone(), writes: Some((w.clone(), l)), check_replicas })
                    })
                    .collect();
                plan_out = Some((plan, sets));
                each
            }
            Err(e) => {
                let mut each: Vec<Result<PlanDecision>> = (1..world).map(|_| Err(e.replicate())).collect();
                each.insert(COORDINATOR, Err(e));
                each
            }
        }
    })?;
    if let Some((plan, sets)) = plan_out {
        cache.plan = Some(plan);
        cache.sets = sets;
    }
    decision
}

/// This rank's shard list, as the coordinator plans it.
fn local_plan(state: &SaveState<'_>, sourced: &[SourcedTensor<'_>]) -> LocalPlan {
    LocalPlan {
        tensors: state
            .tensors
            .iter()
            .map(|t| t.tensor.clone())
            .chain(sourced.iter().map(|t| t.tensor.clone()))
            .collect(),
        objects: state
            .objects
            .iter()
            .map(|o| ObjectItem {
                object: o.object.clone(),
                nbytes: o.data.len() as u64,
                compared: o.compare.compares(),
            })
            .collect(),
    }
}

/// A new plan: its check lists arrived with it, so the checksums follow in one more
/// exchange (a rank cannot tell alone which of its main pieces others hold too). Returns
/// how many chunks were compared on all their bytes, and objects compared.
fn check_new_replicas(io: &Inputs<'_, '_>, cache: &PlanCache) -> Result<u64> {
    let (opts, save_id) = (io.opts, &io.save_id);
    let crcs = local_crcs(io.state, io.sourced, &cache.checks, opts.replica_check, save_id);
    let crcs = crcs.map(|c| (mode_code(opts.replica_check), c));
    let (plan, sets) = (cache.plan.as_ref(), &cache.sets);
    let verdict: Result<u64> = gather_decide(io.coll, crcs, "replica check", |all| {
        let plan = plan.expect("the coordinator holds the plan");
        let all = same_mode(first_failure(all)?, opts.replica_check)?;
        compare(plan, sets, &all, opts.replica_check, save_id).map_err(|e| e.on_rank(COORDINATOR as u32))
    })?;
    verdict
}

/// `mode` as a number each rank sends beside its checksums.
fn mode_code(mode: ReplicaCheck) -> u64 {
    match mode {
        ReplicaCheck::All => u64::MAX,
        ReplicaCheck::Off => u64::MAX - 1,
        ReplicaCheck::Sample { fraction } => fraction.to_bits(),
    }
}

/// The ranks' checksums, once every rank checks as the coordinator does (`mine`): a rank
/// sampling another fraction sends a window's checksum where others send a whole chunk's,
/// and the save failed as replicas that differ (a layout bug's hint).
fn same_mode(all: Vec<(u64, Vec<u32>)>, mine: ReplicaCheck) -> Result<Vec<Vec<u32>>> {
    match all.iter().position(|(code, _)| *code != mode_code(mine)) {
        Some(r) => Err(Error::invalid_options(format!(
            "rank {r} passes another replica_check than rank {COORDINATOR}'s {mine:?}: every rank must pass the same"
        ))),
        None => Ok(all.into_iter().map(|(_, c)| c).collect()),
    }
}

/// Hash of everything the plan depends on: this rank's shard list and the options.
pub(super) fn structure_hash(state: &SaveState<'_>, sourced: &[SourcedTensor<'_>], opts: &SaveOptions) -> u64 {
    let mut h = Gathered::default();
    (state.tensors.len() + sourced.len()).hash(&mut h);
    for t in state.tensors.iter().map(|t| &t.tensor).chain(sourced.iter().map(|t| &t.tensor)) {
        t.hash(&mut h);
    }
    state.objects.len().hash(&mut h);
    for o in &state.objects {
        o.object.hash(&mut h);
        o.data.len().hash(&mut h);
        // Which objects the replica check compares is part of the plan.
        (o.compare.compares()).hash(&mut h);
    }
    opts.writers().hash(&mut h);
    opts.declared.hash(&mut h);
    h.finish()
}

/// SipHash over what `Hash` feeds it, taken in pieces of [`Gathered::PIECE`] bytes: a
/// tensor's `Hash` makes a dozen small writes, and SipHash costs tens of instructions per
/// write however short (measured: 890 instructions a tensor, against about 150 gathered).
/// SipHash streams, so the pieces give the hash of the whole.
#[derive(Default)]
struct Gathered {
    hash: DefaultHasher,
    piece: Vec<u8>,
}

impl Gathered {
    const PIECE: usize = 16 << 10;
}

impl Hasher for Gathered {
    fn write(&mut self, bytes: &[u8]) {
        self.piece.extend_from_slice(bytes);
        if self.piece.len() >= Self::PIECE {
            self.hash.write(&self.piece);
            self.piece.clear();
        }
    }

    fn finish(&self) -> u64 {
        let mut h = self.hash.clone();
        h.write(&self.piece);
        h.finish()
    }
}

/// What the coordinator found at the target when it planned: what the commit may replace.
#[derive(Debug)]
pub(super) enum Found {
    /// No committed checkpoint: the commit creates the metadata file, if no other save has.
    Nothing,
    /// The bytes of the committed metadata file, when asked to replace it: the commit
    /// replaces exactly these (and then deletes the files they name), or nothing.
    Checkpoint(Bytes),
}

/// Refuses to write over a committed checkpoint unless asked to replace it; says what a
/// replacing commit will replace. The metadata file is read whole (however large it is, the
/// coordinator holds it until the commit) because the replace is conditional on its bytes.
fn check_target(storage: &dyn Storage, opts: &SaveOptions) -> Result<Found> {
    let location = || storage.location(META_NAME);
    if !opts.replace {
        return match storage.exists(META_NAME)? {
            true => Err(Error::from(ErrorKind::AlreadyExists { location: location() })),
            false => Ok(Found::Nothing),
        };
    }
    // Its size first: a file too large to be metadata is refused before it is read.
    match storage.size(META_NAME) {
        Ok(n) => crate::format::check_meta_bytes(n, &location())?,
        Err(dckpt_storage::Error::NotFound { .. }) => return Ok(Found::Nothing),
        Err(e) => return Err(e.into()),
    }
    let bytes = match storage.get(META_NAME) {
        Ok(bytes) => bytes,
        Err(dckpt_storage::Error::NotFound { .. }) => return Ok(Found::Nothing),
        Err(e) => return Err(e.into()),
    };
    // A save id given is the caller's to keep distinct: the committed save's own would give
    // the new data files its files' names, written over before the commit (a failure, or
    // a crash, then left its metadata naming other bytes, or none).
    if let Some(id) = &opts.save_id {
        let files = crate::format::Metadata::decode_files(&bytes, &location()).unwrap_or_default();
        if files.iter().any(|f| crate::format::parse_data_file_name(&f.name).is_some_and(|n| n.save_id == id)) {
            return Err(Error::from(ErrorKind::InvalidOptions {
                detail: format!("save id {id}: the checkpoint it would replace is that save's; give another"),
            }));
        }
    }
    Ok(Found::Checkpoint(bytes))
}

/// On the coordinator: every rank's shard list in, the validated plan (and what the target
/// holds) out, or the first failure, stamped with the rank that had it.
fn decide(storage: &dyn Storage, opts: &SaveOptions, all: Vec<Result<LocalPlan>>) -> Result<(SavePlan, Found)> {
    let locals = first_failure(all)?;
    let here = |e: Error| e.on_rank(COORDINATOR as u32);
    let plan = plan_save(&locals, opts.declared.as_deref(), opts.writers()).map_err(here)?;
    check_checksum_bytes(&plan, opts.block_bytes).map_err(here)?;
    let found = check_target(storage, opts).map_err(here)?;
    Ok((plan, found))
}

/// The block checksums alone within what a reader takes of a metadata file: otherwise the
/// commit, after every byte was written, fails (or the encoder meets a list it has no form
/// for); a small `block_bytes` over a large save is what gets here.
fn check_checksum_bytes(plan: &SavePlan, block_bytes: u64) -> Result<()> {
    let most = crate::format::META_BYTES_MAX;
    let pieces = plan.chunks.iter().map(|c| c.nbytes).chain(plan.objects.iter().map(|o| o.nbytes));
    let crc_bytes = pieces.fold(0u64, |n, b| n.saturating_add(b.div_ceil(block_bytes).saturating_mul(4)));
    if crc_bytes <= most {
        return Ok(());
    }
    Err(Error::from(ErrorKind::InvalidOptions {
        detail: format!(
            "block_bytes {block_bytes}: the checksums of {} bytes would take {crc_bytes} bytes of metadata, \
             more than the {most} a reader takes; a larger block_bytes (the default is {}) holds them",
            plan.total_bytes(),
            crate::format::BLOCK_BYTES_DEFAULT
        ),
    }))
}
