//! The dckpt checkpoint engine: save, commit and load with resharding.
//!
//! It composes the pure spec work (`dckpt-shard-spec`) with storage and collectives, and
//! talks to the world only through `dyn Storage` and `dyn Collective`.
//!
//! **Save** ([`Engine::save`]): each rank describes its pieces (no data) →
//! the coordinator (rank 0) gathers them, proves exact-once coverage (and, when the model's
//! tensors are declared, that the state is exactly those), picks one writer per distinct
//! chunk ([`plan_save`]) and refuses to overwrite a committed checkpoint unless asked to
//! replace it → each rank streams its chunks into one or more safetensors data files named
//! with the save's id (several where the store caps an object's size or a large rank gains
//! from parallel writes), CRC-32 per block computed on the way → the coordinator gathers the
//! write results and, only if every rank succeeded, writes the metadata file last with a
//! conditional create, or a conditional replace of the metadata it read (the commit) →
//! every rank returns the same outcome. A rank with nothing to write goes through the same
//! steps and writes no file. A repeated save of the same structure skips the plan exchange
//! after one all-reduce (the plan cache). [`Engine::save_async`] returns once the state is
//! copied.
//!
//! **Load** ([`Engine::load`]): each rank describes what it asks for (no buffers) → the
//! coordinator gathers the asks, alone reads and validates the metadata, reconciles the
//! missing and unexpected keys over all ranks (handled as [`Strictness`] says), intersects
//! each requested piece with the stored chunks, and sends each rank only its own read plan
//! (what a rank receives grows with its own requests, not with the world) → every rank
//! reads only the overlapping bytes, straight into place: whole checksum blocks are
//! verified by the rank; blocks that ranks split between them (a column split) are
//! verified by the coordinator from each rank's CRC of its part, when the parts tile the
//! chunk, and otherwise read whole and verified locally → every rank returns the same
//! outcome, with each phase's slowest rank ([`LoadPhases`]).
//!
//! The format is in [`format`](mod@format) and `docs/format.md`.
//!
//! ```
//! use dckpt_engine::{Engine, LoadRequest, SaveOptions, SaveState, TensorData, TensorRequest, LoadOptions};
//! use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedTensor};
//!
//! let storage = dckpt_storage::open("memory://").unwrap();
//! let mut ranks = dckpt_collective::ThreadGroup::new(1).unwrap();
//! let engine = Engine::new(std::sync::Arc::new(ranks.remove(0)));
//! let t = ShardedTensor { key: "w".into(), dtype: DType::U8, global_shape: [4].into(), region: Region::full(&[4]), replica_id: ReplicaId::MAIN };
//! let state = SaveState { tensors: vec![TensorData { tensor: t.clone(), data: &[1, 2, 3, 4] }], ..Default::default() };
//! engine.save(storage.as_ref(), &state, &SaveOptions::default()).unwrap();
//!
//! // Load the second half only.
//! let mut half = [0u8; 2];
//! let want = ShardedTensor { region: Region::boxed([2], [2]), ..t };
//! let mut req = LoadRequest { tensors: vec![TensorRequest { tensor: want, data: &mut half, allow_shape_mismatch: false, allow_dtype_cast: false }], ..Default::default() };
//! engine.load(storage.as_ref(), &mut req, &LoadOptions::default()).unwrap();
//! assert_eq!(half, [3, 4]);
//! ```

#![warn(missing_docs)]

mod engine;
mod error;
mod leftovers;
/// The on-storage format: the `dckpt-format` crate, here so that `dckpt_engine::format::...`
/// keeps naming it.
pub use dckpt_format as format;
mod load;
pub mod local;
mod phases;
mod plan;
mod protocol;
mod radix;
mod save;
mod shared_check;
mod split_crc;
mod threads;
pub mod verify;

pub use engine::{Engine, SaveHandle, TieredOutcome};
pub use load::{
    KeyPolicy, LoadOptions, LoadOutcome, LoadRequest, ObjectCheck, ObjectRequest, Strictness, TensorRequest,
    read_metadata_local,
};
pub use phases::{LoadPhases, Phases, SavePhases, Slowest};
pub use plan::{
    Assignment, ChunkPlan, LocalPlan, ObjectItem, ObjectPlan, RankWrites, SavePlan, plan_save, preview_save,
};
pub use save::{
    ObjectCompare, ObjectData, PieceSource, ReplicaCheck, SAMPLE_WINDOW_BYTES, SaveOptions, SaveOutcome, SaveState,
    SourcedTensor, TensorData, planned_metadata,
};

pub use error::{Error, ErrorKind, KEYS_SENT_MAX, Result};
