//! The dckpt checkpoint engine: save, commit and load with resharding.
//!
//! It composes the pure spec work (`dckpt-shard-spec`) with storage and collectives, and
//! talks to the world only through `dyn Storage` and `dyn Collective`.
//!
//! **Save** ([`Engine::save`], [`save()`]): each rank describes its pieces (no data) →
//! the coordinator (rank 0) gathers them, proves exact-once coverage (and, when the model's
//! tensors are declared, that the state is exactly those), picks one writer per distinct
//! chunk ([`plan_save`]) and refuses to overwrite a committed checkpoint → each rank
//! streams its chunks into one safetensors data file named with the save's id, CRC-32 per
//! block computed on the way → the coordinator gathers the write results and, only if every
//! rank succeeded, writes the metadata file last with a conditional create (the commit) →
//! every rank returns the same outcome. A rank with nothing to write goes through the same
//! steps and writes no file. A repeated save of the same structure skips the plan exchange
//! after one all-reduce ([`PlanCache`]). [`Engine::save_async`] returns once the state is
//! copied.
//!
//! **Load** ([`Engine::load`], [`load()`]): the coordinator reads and validates the
//! metadata and shares its digest; every other rank reads it too and checks it against the
//! digest → every rank intersects each requested piece with the stored
//! chunks and reads only the overlapping bytes, straight into place: whole checksum blocks
//! are verified by the rank; blocks that ranks split between them (a column split) are
//! verified by the coordinator from each rank's CRC of its part, when the parts tile the
//! chunk, and otherwise read whole and verified locally → missing and unexpected keys are reconciled across
//! ranks and handled as [`Strictness`] says → every rank returns the same outcome.
//!
//! The format is in [`format`](mod@format) and `docs/format.md`.
//!
//! ```
//! use dckpt_engine::{Engine, LoadRequest, SaveOptions, SaveState, TensorData, TensorRequest, LoadOptions};
//! use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedTensor};
//!
//! let storage = dckpt_storage::open("memory://").unwrap();
//! let mut ranks = dckpt_collective::ThreadGroup::new(1).unwrap();
//! let engine = Engine::new(Box::new(ranks.remove(0)));
//! let t = ShardedTensor { key: "w".into(), dtype: DType::U8, global_shape: [4].into(), region: Region::full(&[4]), replica_id: ReplicaId::MAIN };
//! let state = SaveState { tensors: vec![TensorData { tensor: t.clone(), data: &[1, 2, 3, 4] }], ..Default::default() };
//! engine.save(storage.as_ref(), &state, &SaveOptions::default()).unwrap();
//!
//! // Load the second half only.
//! let mut half = [0u8; 2];
//! let want = ShardedTensor { region: Region::boxed([2], [2]), ..t };
//! let mut req = LoadRequest { tensors: vec![TensorRequest { tensor: want, data: &mut half, allow_shape_mismatch: false }], ..Default::default() };
//! engine.load(storage.as_ref(), &mut req, &LoadOptions::default()).unwrap();
//! assert_eq!(half, [3, 4]);
//! ```

mod engine;
/// The on-storage format: the `dckpt-format` crate, here so that `dckpt_engine::format::...`
/// keeps naming it.
pub use dckpt_format as format;
mod load;
mod plan;
mod protocol;
pub mod reference;
mod save;
mod shared_check;
mod split_crc;
pub mod verify;

pub use engine::{Engine, SaveHandle};
pub use load::{
    KeyPolicy, LoadOptions, LoadOutcome, LoadRequest, ObjectRequest, Strictness, TensorRequest, load, read_metadata,
    read_metadata_local,
};
pub use plan::{
    Assignment, ChunkPlan, LocalPlan, ObjectItem, ObjectPlan, RankWrites, SavePlan, plan_save, preview_save,
};
pub use save::{ObjectData, PlanCache, SaveOptions, SaveOutcome, SaveState, TensorData, planned_metadata, save};

/// Results of the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the engine. Each variant carries what it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The sharded state failed coverage or declaration checks; nothing was written.
    #[error("{0}")]
    InvalidState(dckpt_shard_spec::ValidationError),
    /// A checkpoint is already committed there, and replacing it was not asked for.
    #[error("a checkpoint is already committed at {location}; choose another location or ask to replace it")]
    AlreadyExists { location: String },
    /// No committed checkpoint there (nothing, or a save that never committed).
    #[error("{location}: not a checkpoint (no committed metadata file)")]
    NotACheckpoint { location: String },
    /// A malformed or damaged file.
    #[error("{0}")]
    Format(format::FormatError),
    /// Stored bytes that do not match their checksum.
    #[error("{file}: checksum mismatch at byte {offset}: {detail}")]
    Checksum { file: String, offset: u64, detail: String },
    /// A request that cannot be served (wrong dtype, shape, buffer size).
    #[error("tensor {key:?}: {detail}")]
    Request { key: String, detail: String },
    #[error("{} requested keys are not stored: {}", keys.len(), keys.join(", "))]
    MissingKeys { keys: Vec<String> },
    #[error("{} stored keys were not requested by any rank: {}", keys.len(), keys.join(", "))]
    UnexpectedKeys { keys: Vec<String> },
    /// A failure on some rank, reported identically on every rank.
    #[error("rank {rank}: {message}")]
    Rank { rank: u32, message: String },
    #[error(transparent)]
    Storage(#[from] dckpt_storage::Error),
    #[error(transparent)]
    Collective(#[from] dckpt_collective::Error),
    /// Ranks disagree about the protocol (a bug, or ranks running different versions).
    #[error("protocol: {detail}")]
    Protocol { detail: String },
}
