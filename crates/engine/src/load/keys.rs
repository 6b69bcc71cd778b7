//! Stage 2: where each requested key is stored, and the keys missing or unexpected over
//! all ranks, decided on the coordinator from every rank's asks.

use super::coordinator::Asks;
use crate::format::Metadata;

/// Where each requested key is stored, request by request: its index in the metadata's
/// tensors (or objects), `None` when it is not stored. Each key is looked up once.
pub(super) struct Found {
    pub(super) tensors: Vec<Option<usize>>,
    pub(super) objects: Vec<Option<usize>>,
}

impl Found {
    pub(super) fn new(meta: &Metadata, asks: &Asks<'_>) -> Found {
        let mut tensor = finder(&meta.tensors, |t| &t.key);
        let mut object = finder(&meta.objects, |o| &o.key);
        Found {
            tensors: asks.tensors.iter().map(|r| tensor(&r.tensor.key)).collect(),
            objects: asks.objects.iter().map(|o| object(&o.key)).collect(),
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

/// The keys requested by some rank and not stored, and the stored keys no rank requested,
/// each sorted: one pass over every rank's asks and one over the stored keys.
pub(super) fn reconcile_keys(meta: &Metadata, asks: &[Asks<'_>], found: &[Found]) -> (Vec<String>, Vec<String>) {
    // Stored keys counted as tensors first, then objects.
    let first_object = meta.tensors.len();
    let mut requested = vec![false; first_object + meta.objects.len()];
    let mut missing: Vec<&str> = Vec::new();
    for (a, f) in asks.iter().zip(found) {
        for (r, f) in a.tensors.iter().zip(&f.tensors) {
            match f {
                Some(i) => requested[*i] = true,
                None => missing.push(&r.tensor.key),
            }
        }
        for (o, f) in a.objects.iter().zip(&f.objects) {
            match f {
                Some(i) => requested[first_object + i] = true,
                None => missing.push(&o.key),
            }
        }
    }
    let stored = meta.tensors.iter().map(|t| &t.key).chain(meta.objects.iter().map(|o| &o.key));
    let mut unexpected: Vec<String> =
        stored.zip(&requested).filter(|(_, asked)| !**asked).map(|(k, _)| k.clone()).collect();
    unexpected.sort_unstable();
    missing.sort_unstable();
    missing.dedup();
    (missing.into_iter().map(str::to_string).collect(), unexpected)
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
