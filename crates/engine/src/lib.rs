//! The dckpt checkpoint engine.
//!
//! It composes the pure spec and layout work with storage and collectives. Today it holds
//! the pure save planner ([`plan_save`]): coverage proof, declaration check and writer
//! assignment, deterministic so that every rank can trust the coordinator's decision.
//!
//! It talks to the world only through the `Storage` and `Collective` traits (of
//! `dckpt-storage` and `dckpt-collective`), never through files or sockets of its own.
//!
//! ```
//! use dckpt_engine::{plan_save, Assignment, LocalPlan};
//! use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedTensor};
//!
//! // One tensor replicated on two ranks; rank 1 also holds nothing else.
//! let t = |dp| ShardedTensor {
//!     key: "w".into(),
//!     dtype: DType::F32,
//!     global_shape: vec![8],
//!     region: Region::full(&[8]),
//!     replica_id: ReplicaId::new(0, 0, dp),
//! };
//! let locals = vec![LocalPlan { tensors: vec![t(0)], ..Default::default() }, LocalPlan { tensors: vec![t(1)], ..Default::default() }];
//! let plan = plan_save(&locals, None, Assignment::Replica0).unwrap();
//! assert_eq!(plan.total_bytes(), 32);
//! assert_eq!(plan.empty_ranks(), vec![1]);
//! ```

mod plan;

pub use plan::{
    Assignment, ChunkPlan, LocalPlan, ObjectItem, ObjectPlan, RankWrites, SavePlan, plan_save, preview_save,
};

/// Everything that can go wrong in the engine. Each variant carries what it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The sharded state failed coverage or declaration checks; nothing was written.
    #[error("{0}")]
    InvalidState(dckpt_shard_spec::ValidationError),
}
