//! The vocabulary of a sharded model state, and the proof that it is complete.
//!
//! This crate owns:
//! - [`DType`]: element types (bf16, fp16, fp32, fp64, int8..int64, uint8, bool, fp8).
//! - [`Region`]: an n-d box of a global tensor, optionally narrowed to a flat row-major
//!   range of that box (a ZeRO-1 flat-buffer slice), and its algebra: box intersection
//!   and [`overlap_runs`], the elements two regions share as maximal runs contiguous in
//!   both local buffers — the primitive every resharding read is built from.
//! - [`Dims`]: a shape or an offset, held inline up to four dimensions; [`Key`]: a
//!   tensor's name, whose clones share its bytes.
//! - [`ShardedTensor`] (key, dtype, global shape, region, [`ReplicaId`]) and
//!   [`ShardedObject`] (opaque bytes at a position in a grid), and [`TensorDecl`], a
//!   model's declaration of a global tensor.
//! - [`cast`]: element casts between the floating dtypes, bit-exact with PyTorch's.
//! - [`validate`]: exact-once coverage of every global tensor by main replicas, dtype and
//!   shape agreement, complete and unique objects, and agreement with declared tensors.
//!   Its errors name the key, the regions and the ranks.
//!
//! It deliberately does no IO, spawns nothing and knows nothing of parallel layouts or
//! storage: values in, values out. Every type is `serde`-serializable.
//!
//! ```
//! use dckpt_shard_spec::{validate, DType, Region, ReplicaId, ShardedTensor, TensorPiece};
//!
//! // A [4, 6] tensor split in two column blocks over ranks 0 and 1.
//! let piece = |rank: u64| ShardedTensor {
//!     key: "w".into(),
//!     dtype: DType::Bf16,
//!     global_shape: [4, 6].into(),
//!     region: Region::boxed([0, 3 * rank], [4, 3]),
//!     replica_id: ReplicaId::MAIN,
//! };
//! let (a, b) = (piece(0), piece(1));
//! let pieces = [TensorPiece { rank: 0, tensor: &a }, TensorPiece { rank: 1, tensor: &b }];
//! let coverage = validate(&pieces, &[], None).unwrap();
//! assert_eq!(coverage.main_pieces, 2);
//!
//! // Rank 1 forgetting it is main leaves columns 3..6 uncovered: an error naming them.
//! let mut c = piece(1);
//! c.replica_id = ReplicaId::new(0, 1, 0);
//! let err = validate(&[pieces[0], TensorPiece { rank: 1, tensor: &c }], &[], None).unwrap_err();
//! assert!(err.to_string().contains("nothing main holds [0:4, 3:6]"), "{err}");
//! ```

#![warn(missing_docs)]

pub mod cast;
mod coverage;
mod dims;
mod dtype;
mod key;
mod region;
mod tensor;

pub use coverage::{Coverage, ObjectPiece, PROBLEMS_SHOWN_MAX, Problem, TensorPiece, ValidationError, validate};
pub use dims::{DIMS_INLINE, Dims};
pub use dtype::{DType, UnknownDType};
pub use key::Key;
pub use region::{
    FlatRange, Region, RegionError, Run, Strided, checked_numel, for_each_overlap_run, for_each_overlap_strided, numel,
    overlap_numel, overlap_runs,
};
pub use tensor::{ReplicaId, ShardedObject, ShardedTensor, TensorDecl};
