//! Coverage validation: the proof, before any byte is written, that a sharded state holds
//! every element of every global tensor exactly once.
//!
//! For every key: all pieces agree on dtype and global shape; every region fits the global
//! shape; the main replicas cover the tensor with no gap and no overlap — for regular grids,
//! irregular boxes and flat ranges alike; the objects of a key sit on distinct grid
//! positions and fill the grid. Optionally, the keys, dtypes and global shapes must be
//! exactly a model's declared tensors.
//!
//! The mechanism is the same for every layout: flat ranges that tile a box are folded
//! into that box; the boxes are then checked on the grid their own boundaries induce
//! (one cell per piece for a regular grid). Anything that does not fold — flat ranges
//! that straddle boxes — is checked element-exactly on global row-major intervals.

mod declared;
mod objects;
mod problem;
mod tensor;

use crate::{ShardedObject, ShardedTensor, TensorDecl};
use declared::check_declared;
use objects::check_objects;
pub use problem::{Problem, ValidationError};
use tensor::check_tensor;

/// Problems reported in full; further ones are counted.
pub const PROBLEMS_SHOWN_MAX: usize = 32;

/// A sharded tensor together with the rank that holds it.
#[derive(Clone, Copy, Debug)]
pub struct TensorPiece<'a> {
    /// The rank that holds the tensor; problems name it.
    pub rank: u32,
    /// The piece itself.
    pub tensor: &'a ShardedTensor,
}

/// A sharded object together with the rank that holds it.
#[derive(Clone, Copy, Debug)]
pub struct ObjectPiece<'a> {
    /// The rank that holds the object; problems name it.
    pub rank: u32,
    /// The object itself.
    pub object: &'a ShardedObject,
}

/// What a successful validation proved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Distinct tensor keys.
    pub tensors: usize,
    /// Distinct object keys.
    pub objects: usize,
    /// Main-replica tensor pieces (distinct chunks that will be stored).
    pub main_pieces: usize,
    /// Bytes of all global tensors.
    pub tensor_bytes: u64,
}

/// The problems found so far: the first [`PROBLEMS_SHOWN_MAX`] in full, then a count.
#[derive(Default)]
struct Problems {
    shown: Vec<Problem>,
    more: usize,
}

impl Problems {
    pub(super) fn push(&mut self, p: Problem) {
        if self.shown.len() < PROBLEMS_SHOWN_MAX {
            self.shown.push(p);
        } else {
            self.more += 1;
        }
    }
}

/// Validates a whole sharded state: every rank's tensors and objects, and, when given,
/// the model's declared tensors. Deterministic: tensor problems first, then object
/// problems, then declaration problems, each group in key order.
pub fn validate(
    tensors: &[TensorPiece<'_>],
    objects: &[ObjectPiece<'_>],
    declared: Option<&[TensorDecl]>,
) -> Result<Coverage, ValidationError> {
    let mut problems = Problems::default();
    let mut coverage = Coverage::default();

    let tensor_sorted = sorted_by_key(tensors, |p| p.tensor.key.as_str());
    let tensor_groups = groups(&tensor_sorted, |p| p.tensor.key.as_str());
    coverage.tensors = tensor_groups.len();
    for (key, pieces) in &tensor_groups {
        if let Some(stats) = check_tensor(key, pieces, &mut problems) {
            coverage.main_pieces += stats.0;
            coverage.tensor_bytes = coverage.tensor_bytes.saturating_add(stats.1);
        }
    }
    let object_sorted = sorted_by_key(objects, |p| p.object.key.as_str());
    let object_groups = groups(&object_sorted, |p| p.object.key.as_str());
    coverage.objects = object_groups.len();
    for (key, pieces) in &object_groups {
        check_objects(key, pieces, &mut problems);
    }
    if let Some(decls) = declared {
        check_declared(&tensor_groups, decls, &mut problems);
    }
    if problems.shown.is_empty() {
        Ok(coverage)
    } else {
        Err(ValidationError { problems: problems.shown, more: problems.more })
    }
}

/// The pieces sorted by key, pieces of one key in input order.
fn sorted_by_key<'a, T: Copy>(items: &[T], key: impl Fn(&T) -> &'a str) -> Vec<T> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_unstable_by(|&a, &b| key(&items[a]).cmp(key(&items[b])).then(a.cmp(&b)));
    order.into_iter().map(|i| items[i]).collect()
}

/// The runs of one key in pieces sorted by key.
fn groups<'a, 'p, T>(sorted: &'p [T], key: impl Fn(&T) -> &'a str) -> Vec<(&'a str, &'p [T])> {
    sorted.chunk_by(|a, b| key(a) == key(b)).map(|g| (key(&g[0]), g)).collect()
}
