//! What validation reports: each problem as a value that names the key, the regions and
//! the ranks, and all of them together.

use std::fmt;

#[cfg(doc)]
use super::{PROBLEMS_SHOWN_MAX, validate};
use crate::region::{Region, RegionError};
use crate::{DType, Dims};

/// One thing wrong with a sharded state. Every variant names the key; most name the
/// regions and ranks involved. Serializable, so that the rank that validated can send it to
/// the others as it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum Problem {
    /// Two pieces of a tensor disagree on its dtype.
    #[error("tensor {key:?}: rank {rank_a} says dtype {dtype_a} but rank {rank_b} says {dtype_b}")]
    DtypeMismatch {
        /// The tensor's key.
        key: String,
        /// The rank of the key's first piece (in input order).
        rank_a: u32,
        /// The dtype that first piece has.
        dtype_a: DType,
        /// The rank of the first piece with another dtype.
        rank_b: u32,
        /// The dtype that piece has.
        dtype_b: DType,
    },
    /// Two pieces of a tensor disagree on its global shape.
    #[error("tensor {key:?}: rank {rank_a} says global shape {shape_a:?} but rank {rank_b} says {shape_b:?}")]
    ShapeMismatch {
        /// The tensor's key.
        key: String,
        /// The rank of the key's first piece (in input order).
        rank_a: u32,
        /// The global shape that first piece has.
        shape_a: Dims,
        /// The rank of the first piece with another global shape.
        rank_b: u32,
        /// The global shape that piece has.
        shape_b: Dims,
    },
    /// The tensor's element count or byte count does not fit in a `u64`.
    #[error("tensor {key:?}: global shape {shape:?} of {dtype} has more bytes than fit in 64 bits")]
    TooLarge {
        /// The tensor's key.
        key: String,
        /// Its global shape.
        shape: Dims,
        /// Its dtype.
        dtype: DType,
    },
    /// A piece's region is malformed or lies outside the global shape ([`Region::check`]).
    #[error(
        "tensor {key:?}: rank {rank} holds region {region} that does not fit global shape {global_shape:?}: {reason}"
    )]
    BadRegion {
        /// The tensor's key.
        key: String,
        /// The rank holding the piece.
        rank: u32,
        /// The piece's region.
        region: Region,
        /// The tensor's global shape.
        global_shape: Dims,
        /// What is wrong with the region.
        reason: RegionError,
    },
    /// Several ranks hold the same region, each marked as the main replica.
    #[error(
        "tensor {key:?}: region {region} is marked main replica on several ranks {ranks:?}; exactly one holder may be main"
    )]
    DuplicateMain {
        /// The tensor's key.
        key: String,
        /// The region they all hold.
        region: Region,
        /// The ranks marking it main, ascending.
        ranks: Vec<u32>,
    },
    /// Two different main regions share elements.
    #[error(
        "tensor {key:?}: main replica {region_a} on rank(s) {ranks_a:?} overlaps main replica {region_b} on rank(s) {ranks_b:?}"
    )]
    Overlap {
        /// The tensor's key.
        key: String,
        /// One main region; a whole box where flat ranges that tile it were folded into it.
        region_a: Region,
        /// The ranks holding `region_a` as main (for a folded box, the holders of its ranges).
        ranks_a: Vec<u32>,
        /// The other main region, in the same form as `region_a`.
        region_b: Region,
        /// The ranks holding `region_b` as main.
        ranks_b: Vec<u32>,
    },
    /// The main replicas leave some elements of the tensor uncovered.
    #[error("tensor {key:?}: main replicas cover {covered} of {total} elements{}", missing_text(.missing))]
    Gap {
        /// The tensor's key.
        key: String,
        /// Elements the main replicas hold, summed (saturating at `u64::MAX`).
        covered: u64,
        /// Elements of the global tensor.
        total: u64,
        /// The first uncovered part found: a cell of the grid the main boxes' boundaries
        /// induce or, for flat ranges that straddle boxes, the whole tensor narrowed to the
        /// first uncovered flat range. `None` when only the count shows the gap (that grid
        /// too large, so the boxes were checked by a sweep instead).
        missing: Option<Region>,
    },
    /// Flat ranges that straddle boxes make more global intervals than the exact check
    /// handles.
    #[error("tensor {key:?}: {intervals}+ disjoint pieces in global order; too fragmented to validate exactly")]
    TooFragmented {
        /// The tensor's key.
        key: String,
        /// The interval limit that was reached.
        intervals: usize,
    },
    /// Boxes too large for the grid check that overlap each other's first dimension so
    /// much that the sweep would compare too many pairs (a staircase of thousands of column
    /// strips; or a crafted file).
    #[error(
        "tensor {key:?}: {boxes} boxes whose rows overlap too much to check pairwise ({pairs}+ pairs); too fragmented to validate"
    )]
    TooManyOverlaps {
        /// The tensor's key.
        key: String,
        /// Its main boxes.
        boxes: usize,
        /// The pair limit that was reached.
        pairs: u64,
    },
    /// Two objects of a key disagree on the grid's shape.
    #[error("object {key:?}: rank {rank_a} says grid {grid_a:?} but rank {rank_b} says {grid_b:?}")]
    ObjectGridMismatch {
        /// The object's key.
        key: String,
        /// The rank of the key's first object (in input order).
        rank_a: u32,
        /// The grid shape that first object has.
        grid_a: Vec<u64>,
        /// The rank of the first object with another grid shape.
        rank_b: u32,
        /// The grid shape that object has.
        grid_b: Vec<u64>,
    },
    /// An object's position is not inside its grid (wrong length or an entry too large).
    #[error("object {key:?}: rank {rank} holds position {offset:?} outside grid {grid:?}")]
    ObjectOutOfBounds {
        /// The object's key.
        key: String,
        /// The rank holding the object.
        rank: u32,
        /// The object's position.
        offset: Vec<u64>,
        /// The grid's shape.
        grid: Vec<u64>,
    },
    /// Several ranks hold the object at one grid position, each marked as the main replica.
    #[error("object {key:?}: position {offset:?} is marked main replica on several ranks {ranks:?}")]
    ObjectDuplicate {
        /// The object's key.
        key: String,
        /// The grid position.
        offset: Vec<u64>,
        /// The ranks marking it main, ascending.
        ranks: Vec<u32>,
    },
    /// Some grid positions have no main object.
    #[error(
        "object {key:?}: {missing} of {total} grid positions have no main replica, first {offset:?} ({})",
        held_as_replicas(replicas)
    )]
    ObjectMissing {
        /// The object's key.
        key: String,
        /// The first position without a main object, in row-major order.
        offset: Vec<u64>,
        /// How many positions have none.
        missing: u64,
        /// Positions in the grid (saturating at `u64::MAX`).
        total: u64,
        /// The ranks that hold that first position as a replica only, ascending.
        replicas: Vec<u32>,
    },
    /// The model declares a tensor that no rank holds.
    #[error("tensor {key:?} is declared by the model but no rank holds it")]
    MissingTensor {
        /// The declared key.
        key: String,
    },
    /// A rank holds a tensor the model does not declare.
    #[error("tensor {key:?} is held by rank {rank} but the model does not declare it")]
    UndeclaredTensor {
        /// The tensor's key.
        key: String,
        /// The rank of the key's first piece.
        rank: u32,
    },
    /// A held tensor's dtype or global shape differs from the model's declaration.
    #[error(
        "tensor {key:?}: the model declares {declared_dtype} {declared_shape:?} but the state holds {dtype} {shape:?}"
    )]
    DeclarationMismatch {
        /// The tensor's key.
        key: String,
        /// The declared dtype.
        declared_dtype: DType,
        /// The declared global shape.
        declared_shape: Dims,
        /// The dtype the pieces have.
        dtype: DType,
        /// The global shape the pieces have.
        shape: Dims,
    },
    /// The model declares one key more than once.
    #[error("tensor {key:?} is declared twice by the model")]
    DuplicateDeclaration {
        /// The key declared twice.
        key: String,
    },
}

fn missing_text(m: &Option<Region>) -> String {
    match m {
        Some(r) => format!("; nothing main holds {r}"),
        None => String::new(),
    }
}

/// Everything wrong with a sharded state (the first [`PROBLEMS_SHOWN_MAX`], and a count of
/// the rest).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ValidationError {
    /// The first [`PROBLEMS_SHOWN_MAX`] problems found, in [`validate`]'s deterministic order.
    pub problems: Vec<Problem>,
    /// How many further problems were found and left out.
    pub more: usize,
}

impl std::error::Error for ValidationError {}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len() + self.more;
        write!(f, "invalid sharded state ({n} problem{})", if n == 1 { "" } else { "s" })?;
        for p in &self.problems {
            write!(f, "\n  - {p}")?;
        }
        if self.more > 0 {
            write!(f, "\n  ... and {} more", self.more)?;
        }
        Ok(())
    }
}

/// Who holds a position that has no main object, for [`Problem::ObjectMissing`]'s message.
fn held_as_replicas(ranks: &[u32]) -> String {
    match ranks {
        [] => "no rank holds it".to_string(),
        _ => format!("ranks {ranks:?} hold it as a replica only"),
    }
}
