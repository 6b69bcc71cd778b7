//! Sharded tensors, sharded objects, replica ids and tensor declarations.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{DType, Dims, Key, Region};

/// Which copy of a piece this is, per kind of replication: `(pp_copy, tp, dp)`.
///
/// A piece is the *main* replica iff every entry is zero. Several ranks holding the same
/// key and region hold identical data; exactly one of them may be main.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(from = "[u32; 3]", into = "[u32; 3]")]
pub struct ReplicaId {
    /// Non-zero for a copy kept on another pipeline stage (a tied output embedding).
    pub pp_copy: u32,
    /// Non-zero for a copy on a tensor-parallel rank other than the first.
    pub tp: u32,
    /// Non-zero for a copy on a data-parallel (or context-parallel) rank other than the first.
    pub dp: u32,
}

impl ReplicaId {
    /// The main replica: every entry zero.
    pub const MAIN: ReplicaId = ReplicaId { pp_copy: 0, tp: 0, dp: 0 };

    /// The replica id with these entries.
    pub const fn new(pp_copy: u32, tp: u32, dp: u32) -> ReplicaId {
        ReplicaId { pp_copy, tp, dp }
    }

    /// True for the main replica (every entry zero).
    pub const fn is_main(self) -> bool {
        self.pp_copy == 0 && self.tp == 0 && self.dp == 0
    }
}

impl From<[u32; 3]> for ReplicaId {
    fn from([pp_copy, tp, dp]: [u32; 3]) -> Self {
        ReplicaId { pp_copy, tp, dp }
    }
}

impl From<ReplicaId> for [u32; 3] {
    fn from(r: ReplicaId) -> Self {
        [r.pp_copy, r.tp, r.dp]
    }
}

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {}, {})", self.pp_copy, self.tp, self.dp)
    }
}

/// One rank's piece of a global tensor: what it is and where it sits, without its bytes.
///
/// At save time the engine pairs it with a host buffer of `region.numel() * dtype.size()`
/// bytes holding the region's elements in row-major order.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShardedTensor {
    /// The global tensor's name.
    pub key: Key,
    /// The global tensor's element type.
    pub dtype: DType,
    /// The shape of the whole global tensor.
    pub global_shape: Dims,
    /// The part of the global tensor this piece holds.
    pub region: Region,
    /// Which copy of the region this is; only main replicas count towards coverage.
    pub replica_id: ReplicaId,
}

impl ShardedTensor {
    /// The whole of a global tensor, as the main replica (a tensor every rank holds in
    /// full: mark the copies on all ranks but one with [`ShardedTensor::replica`]).
    pub fn whole(key: impl Into<Key>, dtype: DType, global_shape: impl Into<Dims>) -> ShardedTensor {
        let global_shape = global_shape.into();
        let region = Region::full(&global_shape);
        ShardedTensor { key: key.into(), dtype, global_shape, region, replica_id: ReplicaId::MAIN }
    }

    /// The box of `shape` at `offset` of a global tensor, as the main replica.
    pub fn chunk(
        key: impl Into<Key>,
        dtype: DType,
        global_shape: impl Into<Dims>,
        offset: impl Into<Dims>,
        shape: impl Into<Dims>,
    ) -> ShardedTensor {
        let region = Region::boxed(offset, shape);
        ShardedTensor { key: key.into(), dtype, global_shape: global_shape.into(), region, replica_id: ReplicaId::MAIN }
    }

    /// The same piece with another replica id (a copy that is not main when any entry is
    /// nonzero).
    pub fn replica(self, replica_id: impl Into<ReplicaId>) -> ShardedTensor {
        ShardedTensor { replica_id: replica_id.into(), ..self }
    }

    /// The same box narrowed to the flat row-major range `start..stop` of it (a ZeRO-1
    /// flat-buffer slice).
    pub fn narrowed(self, start: u64, stop: u64) -> ShardedTensor {
        ShardedTensor { region: self.region.narrowed(start, stop), ..self }
    }

    /// Bytes of the piece's local buffer.
    pub fn nbytes(&self) -> u64 {
        self.region.numel().saturating_mul(self.dtype.size())
    }

    /// True if this piece is the main replica of its region.
    pub fn is_main(&self) -> bool {
        self.replica_id.is_main()
    }
}

/// Opaque bytes with a key and a position in a grid of objects (RNG state per (pp, tp),
/// tokenizer files, framework metadata). Never resharded: loaded back whole by position.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShardedObject {
    /// The name shared by every object of the grid.
    pub key: Key,
    /// The shape of the grid of objects under this key (`[]` for a single object).
    pub grid_shape: Vec<u64>,
    /// This object's position in the grid.
    pub grid_offset: Vec<u64>,
    /// Which copy of the object at this position this is; exactly one per position is main.
    pub replica_id: ReplicaId,
}

impl ShardedObject {
    /// A single object (a grid of one), as the main replica.
    pub fn single(key: impl Into<Key>) -> ShardedObject {
        ShardedObject { key: key.into(), grid_shape: Vec::new(), grid_offset: Vec::new(), replica_id: ReplicaId::MAIN }
    }

    /// The object at `grid_offset` of a grid of `grid_shape` objects (one per pipeline and
    /// tensor rank, say), as the main replica.
    pub fn in_grid(key: impl Into<Key>, grid_shape: Vec<u64>, grid_offset: Vec<u64>) -> ShardedObject {
        ShardedObject { key: key.into(), grid_shape, grid_offset, replica_id: ReplicaId::MAIN }
    }

    /// The same object with another replica id.
    pub fn replica(self, replica_id: impl Into<ReplicaId>) -> ShardedObject {
        ShardedObject { replica_id: replica_id.into(), ..self }
    }

    /// True if this object is the main replica of its position.
    pub fn is_main(&self) -> bool {
        self.replica_id.is_main()
    }
}

/// A model's declaration of one of its global tensors: the key, dtype and global shape a
/// sharded state must cover exactly.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorDecl {
    /// The tensor's name.
    pub key: Key,
    /// The tensor's element type.
    pub dtype: DType,
    /// The tensor's shape.
    pub global_shape: Dims,
}

impl TensorDecl {
    /// Bytes of the whole global tensor (saturating).
    pub fn nbytes(&self) -> u64 {
        crate::region::numel(&self.global_shape).saturating_mul(self.dtype.size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_id_is_a_triple_on_the_wire() {
        let r = ReplicaId::new(1, 2, 3);
        assert_eq!(serde_json::to_string(&r).unwrap(), "[1,2,3]");
        assert_eq!(serde_json::from_str::<ReplicaId>("[1,2,3]").unwrap(), r);
        assert!(ReplicaId::MAIN.is_main());
        assert!(!ReplicaId::new(0, 0, 1).is_main());
    }
}
