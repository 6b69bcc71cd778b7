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

/// The pieces sorted by key, pieces of one key in input order: each piece counted into its
/// key's place among the distinct keys ([`key_order`]), integers, rather than sorted by the
/// strings themselves. Pieces already in key order (one rank's) are taken as they are,
/// after one pass that checks it.
fn sorted_by_key<'a, T: Copy>(items: &[T], key: impl Fn(&T) -> &'a str) -> Vec<T> {
    if items.is_sorted_by(|a, b| key(a) <= key(b)) {
        return items.to_vec();
    }
    let place = key_order(items.iter().map(&key));
    // Where each place's pieces start, then each piece put there in input order.
    let mut start = vec![0usize; place.iter().max().map_or(0, |&p| p as usize + 1) + 1];
    for &p in &place {
        start[p as usize + 1] += 1;
    }
    for i in 1..start.len() {
        start[i] += start[i - 1];
    }
    let mut order = vec![0u32; items.len()];
    for (i, &p) in place.iter().enumerate() {
        order[start[p as usize]] = i as u32;
        start[p as usize] += 1;
    }
    order.into_iter().map(|i| items[i as usize]).collect()
}

/// The place of each of `keys` among the distinct ones in string order: equal keys get
/// equal places, the first in order 0. Each key is looked up once in a map of those seen, and
/// only the distinct keys are sorted by their strings. Where keys repeat (a tensor's pieces
/// on every rank) this is much faster than sorting them all by string: keys share long
/// prefixes (`decoder.layers.`) and a sort compares each some twenty times; at thousands of
/// ranks that sort was a fifth of the save's plan.
fn key_order<'a>(keys: impl Iterator<Item = &'a str>) -> Vec<u32> {
    let mut seen: std::collections::HashMap<&'a str, u32> = std::collections::HashMap::new();
    let mut distinct: Vec<&'a str> = Vec::new();
    let first: Vec<u32> = keys
        .map(|k| {
            *seen.entry(k).or_insert_with(|| {
                distinct.push(k);
                distinct.len() as u32 - 1
            })
        })
        .collect();
    let mut by_string: Vec<u32> = (0..distinct.len() as u32).collect();
    by_string.sort_unstable_by_key(|&d| distinct[d as usize]);
    let mut place = vec![0u32; distinct.len()];
    for (p, &d) in by_string.iter().enumerate() {
        place[d as usize] = p as u32;
    }
    first.into_iter().map(|d| place[d as usize]).collect()
}

/// The runs of one key in pieces sorted by key.
fn groups<'a, 'p, T>(sorted: &'p [T], key: impl Fn(&T) -> &'a str) -> Vec<(&'a str, &'p [T])> {
    sorted.chunk_by(|a, b| key(a) == key(b)).map(|g| (key(&g[0]), g)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_order_gives_equal_keys_one_place_in_string_order() {
        let keys = ["b.2", "a", "b.10", "a", "", "b.2"];
        assert_eq!(key_order(keys.iter().copied()), vec![3, 1, 2, 1, 0, 3]);
        assert!(key_order(std::iter::empty()).is_empty());
    }

    /// The same order as a stable sort by the key strings, whatever the input's order:
    /// pieces of one key keep their input order.
    #[test]
    fn pieces_sort_by_key_as_a_stable_sort_of_the_strings_would() {
        let names = ["decoder.layers.10.w", "decoder.layers.2.w", "decoder.layers.1.w", "embedding", ""];
        let mut x: u64 = 7;
        for n in [0, 1, 2, 5, 40, 300] {
            let items: Vec<(&str, usize)> = (0..n)
                .map(|i| {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    (names[(x >> 33) as usize % names.len()], i)
                })
                .collect();
            let mut want = items.clone();
            want.sort_by_key(|p| p.0);
            assert_eq!(sorted_by_key(&items, |p| p.0), want, "{n} pieces");
            assert_eq!(sorted_by_key(&want, |p| p.0), want, "{n} pieces in order already");
        }
    }
}
