//! Stage 2: where each requested key is stored, and the keys missing or unexpected over all ranks.

use dckpt_collective::{Collective, ReduceOp};

use super::*;
use crate::Result;
use crate::format::Metadata;
use crate::protocol::gather_decide;

/// Where each requested key is stored, request by request: its index in the metadata's
/// tensors (or objects), `None` when it is not stored. Each key is looked up once.
pub(super) struct Found {
    pub(super) tensors: Vec<Option<usize>>,
    pub(super) objects: Vec<Option<usize>>,
}

impl Found {
    pub(super) fn new(meta: &Metadata, req: &LoadRequest<'_>) -> Found {
        let mut tensor = finder(&meta.tensors, |t| &t.key);
        let mut object = finder(&meta.objects, |o| &o.key);
        Found {
            tensors: req.tensors.iter().map(|r| tensor(&r.tensor.key)).collect(),
            objects: req.objects.iter().map(|r| object(&r.object.key)).collect(),
        }
    }
}

/// Looks keys up in `list`, sorted by key without repeats (as validated metadata is):
/// requests usually come in key order too, so the entry after the last one found (and that
/// one again: several regions of one tensor) is tried before a binary search.
pub(super) fn finder<T>(list: &[T], key_of: impl Fn(&T) -> &str) -> impl FnMut(&str) -> Option<usize> {
    let mut next = 0;
    move |key| {
        let i = match (list.get(next), next.checked_sub(1).and_then(|p| list.get(p))) {
            (Some(t), _) if key_of(t) == key => next,
            (_, Some(t)) if key_of(t) == key => next - 1,
            _ => list.binary_search_by(|t| key_of(t).cmp(key)).ok()?,
        };
        next = i + 1;
        Some(i)
    }
}

/// Global missing and unexpected keys, identical on every rank.
pub(super) fn reconcile_keys(
    coll: &dyn Collective,
    meta: &Metadata,
    found: &Found,
    req: &LoadRequest<'_>,
) -> Result<(Vec<String>, Vec<String>)> {
    // Stored keys counted as tensors first, then objects.
    let first_object = meta.tensors.len();
    let mut requested = vec![0u64; first_object + meta.objects.len()];
    let mut missing: Vec<String> = Vec::new();
    for (r, f) in req.tensors.iter().zip(&found.tensors) {
        match f {
            Some(i) => requested[*i] = 1,
            None => missing.push(r.tensor.key.to_string()),
        }
    }
    for (r, f) in req.objects.iter().zip(&found.objects) {
        match f {
            Some(i) => requested[first_object + i] = 1,
            None => missing.push(r.object.key.to_string()),
        }
    }
    let counts = coll.all_reduce_u64(&requested, ReduceOp::Sum)?;
    let stored = meta.tensors.iter().map(|t| &t.key).chain(meta.objects.iter().map(|o| &o.key));
    let mut unexpected: Vec<String> = stored.zip(&counts).filter(|(_, n)| **n == 0).map(|(k, _)| k.clone()).collect();
    unexpected.sort_unstable();
    missing.sort_unstable();
    missing.dedup();
    let all_missing: Vec<String> = gather_decide(coll, missing, "missing keys", |all| {
        let mut u: Vec<String> = all.into_iter().flatten().collect();
        u.sort_unstable();
        u.dedup();
        u
    })?;
    Ok((all_missing, unexpected))
}

#[cfg(test)]
mod tests {
    use super::finder;

    #[test]
    fn finder_finds_keys_in_any_order_and_repeated() {
        let list = ["a", "b.0", "b.1", "c", "d"];
        let mut find = finder(&list, |s| s);
        let asked = ["a", "b.0", "b.1", "x", "c", "c", "a", "d", "", "e", "b.1"];
        let got: Vec<Option<usize>> = asked.iter().map(|k| find(k)).collect();
        let want: Vec<Option<usize>> = asked.iter().map(|k| list.iter().position(|s| s == k)).collect();
        assert_eq!(got, want);
        let mut none = finder(&[] as &[&str], |s| s);
        assert_eq!(none("a"), None);
    }
}
