//! dckpt: distributed checkpointing for large models.
//!
//! A model split over many ranks — by tensor, pipeline, context, data, expert and
//! expert-tensor parallelism, with optimizer state sharded over data-parallel ranks — is
//! saved once (every byte of every global tensor exactly once, checksummed, committed by
//! writing the metadata last) to local disk or S3-compatible storage, and loaded back into
//! any other layout. Every save proves that its pieces cover each global tensor exactly
//! once before it writes a byte.
//!
//! This is the crate to depend on. What it owns itself is the [`Checkpointer`] and the run
//! manager ([`manager`]: [`CheckpointManager`] saves a training run's steps under one root,
//! with retention, `gc` and restarts from the latest committed step). A checkpointer is one
//! per rank, over that rank's [`Collective`], with [`Checkpointer::save`],
//! [`Checkpointer::save_async`] and [`Checkpointer::load`] ([`Checkpointer::local`] is a
//! world of one, for tools that work on a checkpoint alone). Each rank describes its pieces
//! with [`ShardedTensor`] (key, dtype, global shape, the region it holds, replica id) and
//! hands their bytes over in a [`SaveState`]; a load fills the buffers of a
//! [`LoadRequest`], in whatever layout it describes. An [`Error`] is one typed value,
//! the same on every rank: what failed ([`ErrorKind`]) and the rank that saw it.
//!
//! The pieces are re-exported for those who need more: [`spec`] (the data model and the
//! coverage proof), [`layout`] (parallel-layout math and the reference GPT/MoE model),
//! [`storage`] (backends), [`collective`] (ranks as threads, TCP, NCCL), [`format`](mod@format) (the
//! on-storage format) and [`engine`].
//!
//! Features: `s3` (default: `s3://` locations), `tcp` (default: [`TcpCollective`] for ranks
//! as processes under `torchrun` or `dckpt launch`), `layout` (default: [`layout`], the
//! parallel-layout math; a tool that must know no model leaves it off), `nccl`
//! (`NcclCollective`).
//!
//! Nothing here changes the host process behind its back: no signal handlers (the local
//! backend's mapped reads are off unless [`OpenOptions`] asks for them), no threads
//! beyond those of a call or a background save but one: the first `s3://` location starts
//! the process's S3 runtime (4 threads, kept for the process), and messages go through the
//! `log` facade.
//!
//! # Example
//!
//! Two ranks save a `[4, 6]` weight split by columns (tensor parallel 2), then load it
//! whole on each rank (tensor parallel 1):
//!
//! ```
//! use std::sync::Arc;
//!
//! use dckpt::{Checkpointer, DType, LoadOptions, LoadRequest, SaveOptions, SaveState, ShardedTensor, ThreadGroup};
//!
//! fn rank_main(ckpt: Checkpointer) -> dckpt::Result<()> {
//!     let r = ckpt.rank() as u64;
//!     // tp 2: this rank holds columns 3r..3r+3 of every row; element (i, j) is 6i + j.
//!     let mine: Vec<u8> =
//!         (0..4).flat_map(|i| (0..3).flat_map(move |j| ((6 * i + 3 * r + j) as f32).to_le_bytes())).collect();
//!     let piece = ShardedTensor::chunk("layer.0.weight", DType::F32, [4, 6], [0, 3 * r], [4, 3]);
//!     let opts = SaveOptions::default().layout_entry("tp", 2);
//!     ckpt.save("memory://facade-doc", &SaveState::new().tensor(piece, &mine), &opts)?;
//!
//!     // tp 1: every rank loads the whole tensor.
//!     let mut whole = vec![0u8; 4 * 6 * 4];
//!     let mut req = LoadRequest::new().tensor(ShardedTensor::whole("layer.0.weight", DType::F32, [4, 6]), &mut whole);
//!     let outcome = ckpt.load("memory://facade-doc", &mut req, &LoadOptions::default())?;
//!     assert_eq!(outcome.layout["tp"], "2");
//!     for (k, v) in whole.chunks_exact(4).enumerate() {
//!         assert_eq!(f32::from_le_bytes(v.try_into().unwrap()), k as f32);
//!     }
//!     Ok(())
//! }
//!
//! let ranks = ThreadGroup::new(2).unwrap();
//! std::thread::scope(|s| {
//!     let handles: Vec<_> =
//!         ranks.into_iter().map(|c| s.spawn(move || rank_main(Checkpointer::new(Arc::new(c))))).collect();
//!     for h in handles {
//!         h.join().unwrap().unwrap();
//!     }
//! });
//! ```

#![warn(missing_docs)]

mod checkpointer;
pub mod manager;

pub use checkpointer::{Checkpointer, Location, local_collective};
pub use manager::{
    CheckpointManager, GcReport, Latest, LatestPointer, PendingStep, RetentionPolicy, StepInfo, StepOutcome,
};
pub use manager::{GcOptions, RemovalReason, RunRoot, StepStart, StepState};

#[cfg(feature = "nccl")]
pub use dckpt_collective::NcclCollective;
pub use dckpt_collective::{self as collective, Collective, CollectiveOptions, ThreadCollective, ThreadGroup};
#[cfg(feature = "tcp")]
pub use dckpt_collective::{TcpCollective, TcpConfig, TcpOptions};
pub use dckpt_engine::local::{
    self as local, IfWhole, LocalRestoreOptions, LocalRestoreOutcome, LocalSaveOptions, LocalSaveOutcome,
    LocalStepInfo, Placement,
};
pub use dckpt_engine::{
    self as engine, Assignment, Error, ErrorKind, KeyPolicy, LoadOptions, LoadOutcome, LoadPhases, LoadRequest,
    ObjectCheck, ObjectCompare, ObjectData, ObjectRequest, Phases, PieceSource, ReplicaCheck, Result, SaveHandle,
    SaveOptions, SaveOutcome, SavePhases, SaveState, Slowest, SourcedTensor, Strictness, TensorData, TensorRequest,
    TieredOutcome, format, verify,
};
#[cfg(feature = "layout")]
pub use dckpt_layout as layout;
pub use dckpt_shard_spec::{
    self as spec, DType, Dims, Key, Region, ReplicaId, ShardedObject, ShardedTensor, TensorDecl, ValidationError,
};
pub use dckpt_storage::{self as storage, OpenOptions, Storage, open, open_with};
