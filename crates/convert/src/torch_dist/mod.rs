//! PyTorch DCP and Megatron `torch_dist` checkpoints, read through [`Storage`].
//!
//! A DCP directory is a `.metadata` pickle and data files (`__<rank>_<i>.distcp`) that
//! concatenate items: each tensor chunk a whole `torch.save` zip archive, each plain value
//! opaque bytes. Megatron's `torch_dist` adds `metadata.json` (its backend) and `common.pt`
//! (its non-sharded state, kept opaque here). [`crate::detect`] tells these from a dckpt
//! checkpoint and from a safetensors model; [`Checkpoint::open`] reads the metadata
//! (`open.rs`); [`Checkpoint::locate_chunk`] finds where a chunk's elements lie by reading
//! only the item's central directory, two local headers and its `data.pkl` (ranged reads,
//! never the file), and [`read_chunk`] reads them in row-major order, whatever the view's
//! strides (`locate.rs`); [`validate`] checks everything a DCP checkpoint records
//! (`validate.rs`). No pickle is executed: the parsing is `dckpt_torch_format`'s. Bytes are
//! copied as stored, so an archive whose `byteorder` record says `big` is refused, not read.
//!
//! [`Storage`]: dckpt::storage::Storage

mod convert;
mod locate;
mod objects;
mod open;
mod source;
mod validate;

use dckpt_shard_spec::DType;
use dckpt_torch_format::dcp::ShardedObjectKey;

pub use convert::{
    COMMON_LAYOUT_ENTRY, COMMON_OBJECT, DATA_FILE, TorchDistReport, dckpt_to_torch_dist, torch_dist_to_dckpt,
};
pub use locate::{ChunkLocation, is_row_major, read_chunk};
pub use open::Checkpoint;
pub use source::TorchDistSource;
pub use validate::{
    ITEM_WHOLE_BYTES_MAX, PROBLEMS_MAX, TensorCoverage, ValidateReport, fraction, validate, validate_with,
};

/// DCP's metadata file.
pub const DCP_METADATA: &str = ".metadata";
/// Megatron's marker of a `dist_checkpointing` directory.
pub const MEGATRON_METADATA: &str = "metadata.json";
/// Megatron's common (non-sharded) state, a `torch.save` pickle.
pub const MEGATRON_COMMON: &str = "common.pt";
/// The largest `.metadata` file read (DCP metadata is a few bytes per chunk).
pub const DCP_METADATA_BYTES_MAX: u64 = 1 << 30;
/// The largest `data.pkl` read (a tensor's pickle is a few hundred bytes).
const DATA_PKL_BYTES_MAX: u64 = 1 << 20;

/// A Megatron ShardedObject key split into its parts (`key/shard_<offsets>_<shape>`).
pub fn sharded_object(key: &str) -> Option<ShardedObjectKey> {
    ShardedObjectKey::parse(key)
}

/// The dtype name PyTorch users write (`bfloat16`, `float32`, ...).
pub fn torch_name(d: DType) -> &'static str {
    dckpt_torch_format::write::torch_dtype_name(d)
}
