//! Save: plan (with the coverage proof), stream every rank's chunks into its data file,
//! commit the metadata file last, and make every rank return the same outcome.
//!
//! The phases, each in a module of its own:
//! 1. [`decide`]: the plan, decided on the coordinator (or the cached one, after one
//!    all-reduce), and the replica check;
//! 2. [`write`]: every rank streams its chunks into its data files, checksummed on the way;
//! 3. [`commit`]: the coordinator gathers the write results and commits the metadata file
//!    ([`metadata`] builds it from the plan and where each piece landed), or removes this
//!    save's files when any rank failed.
//!
//! What the coordinator finds at the target when it plans (no checkpoint, or the bytes of
//! the committed metadata file) is what the commit may replace, and nothing else: the commit
//! is a conditional create, or a conditional replace of exactly those bytes. So of saves
//! racing into one place exactly one commits per committed state, the others fail with
//! [`ErrorKind::AlreadyExists`], and a replacing save deletes only the files of the checkpoint it
//! replaced, never those of a save that committed after it looked.

mod commit;
mod decide;
mod metadata;
mod replicas;
mod write;

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use dckpt_collective::{Collective, ReduceOp};
use dckpt_shard_spec::{ShardedObject, ShardedTensor, TensorDecl};
use dckpt_storage::Storage;
use serde::{Deserialize, Serialize};

use crate::format::BLOCK_BYTES_DEFAULT;
use crate::phases::{SavePhases, Slowest};
use crate::plan::{Assignment, RankWrites, SavePlan};
use crate::protocol::{COORDINATOR, Call, gather_decide, in_phase};
use crate::{Error, ErrorKind, Result};
use commit::*;
use decide::{Found, Planned, plan_phase, structure_hash};
use write::*;

pub use metadata::planned_metadata;
use replicas::CheckSet;
pub use replicas::{ReplicaCheck, SAMPLE_WINDOW_BYTES};

/// A tensor piece with its bytes: `region.numel() * dtype.size()` bytes in row-major order.
#[derive(Debug, Clone)]
pub struct TensorData<'a> {
    /// Which piece of which global tensor, and whether it is the main replica.
    pub tensor: ShardedTensor,
    /// Its bytes, borrowed until the save returns (a background save copies them first).
    pub data: &'a [u8],
}

/// An object with its bytes.
#[derive(Debug, Clone)]
pub struct ObjectData<'a> {
    /// The object's key, its place in its grid, and whether it is the main replica.
    pub object: ShardedObject,
    /// Its bytes, opaque to the engine.
    pub data: &'a [u8],
    /// How its copies on other ranks are compared with it.
    pub compare: ObjectCompare,
}

/// How the replica check ([`SaveOptions::replica_check`]) compares the copies of an object
/// that several ranks hold: only one copy is written, so a replica holding another value
/// would be lost without a word.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum ObjectCompare {
    /// By their bytes: equal values are encoded to equal bytes.
    #[default]
    Bytes,
    /// By this checksum of a canonical form, which the caller computed: for encodings where
    /// equal values can differ in bytes (a JSON object's keys in insertion order, say). Its
    /// low 31 bits are compared (the check marks compared copies with the top bit).
    Digest(u32),
    /// Not compared: the encoding has no canonical form (a pickle of classes, whose bytes
    /// for equal values can differ). Copies compared otherwise on another rank still differ from it.
    Not,
}

impl ObjectCompare {
    /// Whether the replica check compares this copy at all.
    pub(crate) fn compares(self) -> bool {
        self != ObjectCompare::Not
    }
}

/// Where the bytes of a sourced piece come from: the engine pulls them into its own bounce
/// buffers while it writes (a few batches of 8 MiB at a time), so that a
/// converter never holds a whole model. Reads ask for consecutive ranges, in order, once.
pub trait PieceSource: Sync {
    /// Fills `buf` with the piece's bytes at `offset..offset + buf.len()` (row-major, as
    /// [`TensorData::data`] would hold them). An error fails the save on every rank and
    /// leaves no file behind; it should name the file and offset it could not read.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()>;
}

/// A tensor piece whose bytes the engine pulls from `source` as it writes them
/// ([`crate::Engine::save_sourced`]): `tensor.nbytes()` bytes, row-major. For synchronous
/// saves only (a background save would have to copy it whole), and of main replicas only:
/// a sourced piece is the one copy of its bytes a converter has, and replicas are what
/// training ranks hold in memory, which they pass as borrowed bytes.
#[derive(Clone)]
pub struct SourcedTensor<'a> {
    /// Which piece of which global tensor; a main replica.
    pub tensor: ShardedTensor,
    /// Where its bytes are read from while they are written.
    pub source: &'a dyn PieceSource,
}

impl std::fmt::Debug for SourcedTensor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourcedTensor").field("tensor", &self.tensor).finish_non_exhaustive()
    }
}

/// What one rank hands to a save. Empty is fine.
///
/// ```
/// use dckpt_engine::SaveState;
/// use dckpt_shard_spec::{DType, ShardedObject, ShardedTensor};
///
/// let (w, rng) = (vec![0u8; 16], b"seed".to_vec());
/// let state = SaveState::new()
///     .tensor(ShardedTensor::whole("w", DType::F32, [4]), &w)
///     .object(ShardedObject::single("rng"), &rng);
/// assert_eq!((state.tensors.len(), state.objects.len()), (1, 1));
/// ```
#[derive(Debug, Clone, Default)]
pub struct SaveState<'a> {
    /// This rank's tensor pieces, in any order.
    pub tensors: Vec<TensorData<'a>>,
    /// This rank's objects.
    pub objects: Vec<ObjectData<'a>>,
}

impl<'a> SaveState<'a> {
    /// An empty state (a rank with nothing to save is an ordinary rank).
    pub fn new() -> SaveState<'a> {
        SaveState::default()
    }

    /// With one more tensor piece and its bytes (`tensor.nbytes()` of them, row-major).
    pub fn tensor(mut self, tensor: ShardedTensor, data: &'a [u8]) -> SaveState<'a> {
        self.push_tensor(tensor, data);
        self
    }

    /// With one more object and its bytes.
    pub fn object(mut self, object: ShardedObject, data: &'a [u8]) -> SaveState<'a> {
        self.push_object(object, data);
        self
    }

    /// Adds a tensor piece and its bytes.
    pub fn push_tensor(&mut self, tensor: ShardedTensor, data: &'a [u8]) {
        self.tensors.push(TensorData { tensor, data });
    }

    /// Adds an object and its bytes.
    pub fn push_object(&mut self, object: ShardedObject, data: &'a [u8]) {
        self.objects.push(ObjectData { object, data, compare: ObjectCompare::Bytes });
    }
}

/// How to save. Every rank must pass the same options.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// Which holder of a chunk several ranks hold writes it.
    pub assignment: Assignment,
    /// The model's global tensors; when given, the plan proves the state is exactly these.
    pub declared: Option<Vec<TensorDecl>>,
    /// Replace a committed checkpoint instead of failing with [`ErrorKind::AlreadyExists`]: the
    /// one committed when the save plans. Its data files are deleted once the new metadata
    /// has landed over it; until then it stays whole. If another save commits there in
    /// between, this one fails with [`ErrorKind::AlreadyExists`] and touches nothing of it.
    pub replace: bool,
    /// Checksum block of data files.
    pub block_bytes: u64,
    /// Recorded in the metadata as the layout the state was saved with.
    pub layout: BTreeMap<String, String>,
    /// For [`crate::Engine::save_async`]: keep the host copy of the state once the save is
    /// done, and copy the next background save into it. A training loop that saves every so
    /// many steps then pays for fresh memory once, not at every save (the copy is what the
    /// caller waits for), at the price of holding a copy of its state between saves.
    /// A background save without it releases them, as does
    /// [`crate::Engine::release_staging`]; [`crate::Engine::staging_bytes`] tells how much
    /// is kept.
    pub keep_staging: bool,
    /// The save's id, which begins the name of each of its data files. `None`: a
    /// fresh random id that every rank agrees on. Giving one makes a save's file names
    /// deterministic (replays in tests, `format!("{step:016x}")`); it must be 16
    /// hexadecimal digits ([`is_save_id`](crate::format::is_save_id)), and different from the id of
    /// any save whose files may still be there.
    pub save_id: Option<String>,
    /// Which bytes of the chunks that several ranks hold are compared across their holders
    /// before anything is written. Every holder of such a chunk (the main piece and the
    /// replicas with the same key and region) sends a CRC-32 of those bytes of its copy to
    /// the coordinator, with the plan when it is made and in one small exchange when the
    /// cached plan is reused; a save whose replicas differ from their main copy fails on
    /// every rank with [`ErrorKind::ReplicasDiffer`], naming the tensor, the region and the
    /// ranks, and writes nothing. A replica whose region matches no main piece's exactly is
    /// not compared (nothing of it is written). The copies of an object are compared whole,
    /// as each holder's [`ObjectCompare`] says, and a copy holding another value fails the
    /// save with [`ErrorKind::ObjectsDiffer`] in the same way. A background save compares
    /// its own copy of the state, so [`crate::SaveHandle::wait`] reports it.
    ///
    /// Default [`ReplicaCheck::Sample`] of a tenth of the chunks whole and a window of every
    /// other one: [`ReplicaCheck::All`] reads every replica, which made a save of a state
    /// that two ranks hold whole about 5 to 20% slower (`dckpt bench replicas`), and more
    /// with more holders.
    pub replica_check: ReplicaCheck,
    /// Set by a rank whose caller failed to make its part of the state (its error, as text;
    /// `state` may then be empty): the rank still takes part in the save's first round, and
    /// the save fails on every rank naming it and the reason, rather than leaving the others
    /// to wait for it until the collective times out. Nothing is written.
    pub caller_failed: Option<String>,
}

impl SaveOptions {
    /// Whether to replace a committed checkpoint instead of failing with
    /// [`ErrorKind::AlreadyExists`].
    pub fn replace(self, replace: bool) -> SaveOptions {
        SaveOptions { replace, ..self }
    }

    /// The model's global tensors, which the plan then proves the state is exactly.
    pub fn declared(self, declared: Vec<TensorDecl>) -> SaveOptions {
        SaveOptions { declared: Some(declared), ..self }
    }

    /// How writers are chosen among the holders of each chunk.
    pub fn assignment(self, assignment: Assignment) -> SaveOptions {
        SaveOptions { assignment, ..self }
    }

    /// The assignment the plan uses: the main copies write where the replica check is
    /// off, as [`ReplicaCheck::Off`] promises (a copy not compared may be stale, and a
    /// balanced plan wrote it).
    pub(crate) fn writers(&self) -> Assignment {
        match self.replica_check {
            ReplicaCheck::Off => Assignment::Replica0,
            _ => self.assignment,
        }
    }

    /// One more entry of the layout recorded in the metadata (`"tp" = "2"`, ...).
    pub fn layout_entry(mut self, name: impl Into<String>, value: impl ToString) -> SaveOptions {
        self.layout.insert(name.into(), value.to_string());
        self
    }

    /// A given save id instead of a random one (see [`SaveOptions::save_id`]).
    pub fn save_id(self, id: impl Into<String>) -> SaveOptions {
        SaveOptions { save_id: Some(id.into()), ..self }
    }

    /// Which bytes of the replicated chunks are compared across their holders (see
    /// [`SaveOptions::replica_check`]).
    pub fn replica_check(self, replica_check: ReplicaCheck) -> SaveOptions {
        SaveOptions { replica_check, ..self }
    }

    /// Keep the host copy of a background save for the next one (see
    /// [`SaveOptions::keep_staging`]).
    pub fn keep_staging(self, keep: bool) -> SaveOptions {
        SaveOptions { keep_staging: keep, ..self }
    }
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            assignment: Assignment::Balanced,
            declared: None,
            replace: false,
            block_bytes: BLOCK_BYTES_DEFAULT,
            layout: BTreeMap::new(),
            keep_staging: false,
            save_id: None,
            replica_check: ReplicaCheck::default(),
            caller_failed: None,
        }
    }
}

/// What a committed save did; the same on every rank except `rank_bytes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaveOutcome {
    /// The id of this save, which its data files are named with.
    pub save_id: String,
    /// Bytes of chunk data and objects written by all ranks.
    pub bytes: u64,
    /// Data files written (ranks with nothing to write make none).
    pub files: usize,
    /// Distinct tensor chunks and objects stored.
    pub chunks: usize,
    /// Bytes this rank wrote.
    pub rank_bytes: u64,
    /// Whether the plan of the previous save was reused.
    pub plan_reused: bool,
    /// How many chunks held by several ranks had their copies compared on all their bytes
    /// ([`SaveOptions::replica_check`]; a sample compares a window of each other one), and
    /// how many objects held by several ranks had their copies compared.
    pub replicas_checked: u64,
    /// Where the time went: each phase's slowest rank.
    pub phases: SavePhases,
}

/// What one rank remembers between saves for the plan cache.
#[derive(Debug, Default)]
pub(crate) struct PlanCache {
    structure: Option<u64>,
    writes: RankWrites,
    /// The global plan, on the coordinator only.
    plan: Option<SavePlan>,
    /// This rank's pieces (tensors, then objects) whose checksums the replica check needs
    /// (ascending).
    checks: Vec<u32>,
    /// The plan's replica sets by position in each rank's `checks`, on the coordinator only.
    sets: Vec<CheckSet>,
}

/// One save's inputs, as each phase sees them.
pub(super) struct Inputs<'a, 's> {
    pub(super) storage: &'a dyn Storage,
    pub(super) coll: &'a dyn Collective,
    pub(super) state: &'a SaveState<'s>,
    pub(super) sourced: &'a [SourcedTensor<'s>],
    pub(super) opts: &'a SaveOptions,
    /// This rank's id of the save: the one given, or the random one the ranks agreed on.
    pub(super) save_id: String,
}

/// Saves `state` as one rank of `coll`. See the crate docs for the protocol. `stage` is how
/// long the host copy of a background save took (zero otherwise).
pub(crate) fn save(
    storage: &dyn Storage,
    coll: &dyn Collective,
    state: &SaveState<'_>,
    sourced: &[SourcedTensor<'_>],
    opts: &SaveOptions,
    cache: &mut PlanCache,
    stage: Duration,
) -> Result<SaveOutcome> {
    let rank = coll.rank();
    let started = Instant::now();
    let local_check = check_request(state, sourced, opts);
    let structure = structure_hash(state, sourced, opts);
    let reuse = local_check.is_ok() && cache.structure == Some(structure);
    let [c0, c1] = Call::Save.words();
    let v = coll
        .all_reduce_u64(&[u64::from(reuse), random_u64(), c0, c1], ReduceOp::Min)
        .map_err(in_phase("save start"))?;
    Call::check(&v[2..])?;
    let (all_reuse, seed) = (v[0] == 1, v[1]);
    let save_id = opts.save_id.clone().unwrap_or_else(|| format!("{seed:016x}"));
    let io = Inputs { storage, coll, state, sourced, opts, save_id };

    // Phase 1: plan, and compare the replicas.
    let planned = plan_phase(&io, cache, all_reuse, local_check, structure)?;

    // Phase 2: every rank streams its chunks; a rank with nothing to write writes no file.
    let Planned { save_id, found, checked, plan_reused } = planned;
    let planned_at = started.elapsed();
    let result = write_rank_files(storage, state, sourced, &cache.writes, &save_id, rank, opts.block_bytes);
    let times = [stage, planned_at, started.elapsed() - planned_at];

    // Phase 3: the coordinator commits only if every rank succeeded.
    let plan = cache.plan.as_ref();
    let mut after = None;
    let outcome: Result<SaveOutcome> = gather_decide(coll, (result, times), "save commit", |all| {
        let plan = plan.expect("the coordinator holds the plan");
        let found = found.expect("the coordinator checked the target");
        let (results, times): (Vec<_>, Vec<[Duration; 3]>) = all.into_iter().unzip();
        let committing = Instant::now();
        let slowest = |i: usize| Slowest::of(times.iter().map(|t| t[i]));
        commit(storage, opts, plan, &found, &save_id, results, plan_reused)
            .map(|(o, then)| {
                after = Some(then);
                o
            })
            .map(|o| SaveOutcome {
                replicas_checked: checked,
                phases: SavePhases {
                    stage: slowest(0),
                    plan: slowest(1),
                    write: slowest(2),
                    commit: Slowest::on(COORDINATOR as u32, committing.elapsed()),
                },
                ..o
            })
            .map_err(|e| e.on_rank(COORDINATOR as u32))
    })?;
    if let Some(after) = after {
        after.run(storage);
    }
    let mut outcome = outcome?;
    outcome.rank_bytes = cache.writes.bytes;
    Ok(outcome)
}

/// What this rank may check of a request alone, before any exchange.
fn check_request(state: &SaveState<'_>, sourced: &[SourcedTensor<'_>], opts: &SaveOptions) -> Result<()> {
    Error::caller_failed(&opts.caller_failed)
        .and_then(|()| check_save_id(opts))
        .and_then(|()| check_block_bytes(opts.block_bytes))
        .and_then(|()| check_layout(opts))
        .and_then(|()| opts.replica_check.check())
        .and_then(|()| check_buffers(state))
        .and_then(|()| check_sourced(sourced))
}

/// The checksum block within what a reader accepts: a save with another committed a
/// checkpoint that no load would open (0 was taken as one byte a block, a checksum for
/// every byte).
fn check_block_bytes(block_bytes: u64) -> Result<()> {
    let most = crate::format::BLOCK_BYTES_MAX;
    if (1..=most).contains(&block_bytes) {
        return Ok(());
    }
    Err(Error::from(ErrorKind::InvalidOptions { detail: format!("block_bytes {block_bytes}: must be 1 to {most}") }))
}

/// No more layout entries than a reader accepts (the save committed what no load opened).
fn check_layout(opts: &SaveOptions) -> Result<()> {
    let most = crate::format::LAYOUT_ENTRIES_MAX;
    if opts.layout.len() <= most {
        return Ok(());
    }
    Err(Error::from(ErrorKind::InvalidOptions {
        detail: format!("{} layout entries: a reader takes at most {most}", opts.layout.len()),
    }))
}

fn check_save_id(opts: &SaveOptions) -> Result<()> {
    match &opts.save_id {
        Some(id) if !crate::format::is_save_id(id) => Err(Error::from(ErrorKind::InvalidOptions {
            detail: format!(
                "save id {id:?}: must be {} hexadecimal digits, the shape of the data file names a save may remove",
                crate::format::SAVE_ID_DIGITS
            ),
        })),
        _ => Ok(()),
    }
}

fn check_buffers(state: &SaveState<'_>) -> Result<()> {
    for t in &state.tensors {
        if t.data.len() as u64 != t.tensor.nbytes() {
            return Err(Error::from(ErrorKind::Request {
                key: t.tensor.key.to_string(),
                detail: format!(
                    "region {}: buffer has {} bytes, the region needs {}",
                    t.tensor.region,
                    t.data.len(),
                    t.tensor.nbytes()
                ),
            }));
        }
    }
    Ok(())
}

fn check_sourced(sourced: &[SourcedTensor<'_>]) -> Result<()> {
    match sourced.iter().find(|t| !t.tensor.replica_id.is_main()) {
        Some(t) => Err(Error::from(ErrorKind::Request {
            key: t.tensor.key.to_string(),
            detail: format!("region {}: a sourced piece must be a main replica", t.tensor.region),
        })),
        None => Ok(()),
    }
}

pub(crate) fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    std::time::SystemTime::now().hash(&mut h);
    std::process::id().hash(&mut h);
    h.finish()
}
