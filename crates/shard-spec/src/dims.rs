//! [`Dims`]: a list of dimensions (a shape or an offset) stored inline.

use std::borrow::Borrow;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::{Deref, DerefMut};

use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::SmallVec;

/// Dimensions held without a heap allocation up to this many.
pub const DIMS_INLINE: usize = 4;

/// A shape or an offset: one `u64` per dimension.
///
/// It behaves as a `[u64]` (it dereferences to one) and serializes exactly as a `Vec<u64>`
/// does, but up to [`DIMS_INLINE`] dimensions are stored in the value itself. A model state
/// has several of these per tensor piece (global shape, offset, shape), in every plan and in
/// the metadata, so a state of many small tensors would otherwise pay one allocation for each.
#[derive(Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Dims(SmallVec<[u64; DIMS_INLINE]>);

impl Dims {
    /// No dimensions (the shape of a scalar).
    #[inline]
    pub const fn new() -> Dims {
        Dims(SmallVec::new_const())
    }

    /// No dimensions, with room for `n` (on the heap only beyond [`DIMS_INLINE`]).
    #[inline]
    pub fn with_capacity(n: usize) -> Dims {
        Dims(SmallVec::with_capacity(n))
    }

    /// Appends a dimension.
    #[inline]
    pub fn push(&mut self, d: u64) {
        self.0.push(d);
    }

    /// The dimensions as a slice.
    #[inline]
    pub fn as_slice(&self) -> &[u64] {
        &self.0
    }
}

/// By slice copies: `SmallVec`'s own `clone_from` extends element by element.
impl Clone for Dims {
    #[inline]
    fn clone(&self) -> Dims {
        Dims(SmallVec::from_slice(&self.0))
    }

    #[inline]
    fn clone_from(&mut self, source: &Dims) {
        self.0.clear();
        self.0.extend_from_slice(&source.0);
    }
}

impl Deref for Dims {
    type Target = [u64];

    #[inline]
    fn deref(&self) -> &[u64] {
        &self.0
    }
}

impl DerefMut for Dims {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u64] {
        &mut self.0
    }
}

impl AsRef<[u64]> for Dims {
    #[inline]
    fn as_ref(&self) -> &[u64] {
        &self.0
    }
}

impl Borrow<[u64]> for Dims {
    #[inline]
    fn borrow(&self) -> &[u64] {
        &self.0
    }
}

/// Hashes as the slice it holds (as `Vec<u64>` does), so `Borrow<[u64]>` lookups agree.
impl Hash for Dims {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

impl fmt::Debug for Dims {
    #[inline]
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl From<&[u64]> for Dims {
    #[inline]
    fn from(d: &[u64]) -> Dims {
        Dims(SmallVec::from_slice(d))
    }
}

impl From<&Vec<u64>> for Dims {
    #[inline]
    fn from(d: &Vec<u64>) -> Dims {
        Dims::from(d.as_slice())
    }
}

impl From<Vec<u64>> for Dims {
    /// Inline when it fits, else the vector's own allocation.
    #[inline]
    fn from(d: Vec<u64>) -> Dims {
        if d.len() <= DIMS_INLINE { Dims::from(d.as_slice()) } else { Dims(SmallVec::from_vec(d)) }
    }
}

impl<const N: usize> From<[u64; N]> for Dims {
    #[inline]
    fn from(d: [u64; N]) -> Dims {
        Dims::from(d.as_slice())
    }
}

impl<const N: usize> From<&[u64; N]> for Dims {
    #[inline]
    fn from(d: &[u64; N]) -> Dims {
        Dims::from(d.as_slice())
    }
}

impl From<Dims> for Vec<u64> {
    #[inline]
    fn from(d: Dims) -> Vec<u64> {
        d.to_vec()
    }
}

impl FromIterator<u64> for Dims {
    #[inline]
    fn from_iter<I: IntoIterator<Item = u64>>(iter: I) -> Dims {
        Dims(iter.into_iter().collect())
    }
}

impl Extend<u64> for Dims {
    #[inline]
    fn extend<I: IntoIterator<Item = u64>>(&mut self, iter: I) {
        self.0.extend(iter);
    }
}

impl<'a> IntoIterator for &'a Dims {
    type Item = &'a u64;
    type IntoIter = std::slice::Iter<'a, u64>;

    #[inline]
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl IntoIterator for Dims {
    type Item = u64;
    type IntoIter = smallvec::IntoIter<[u64; DIMS_INLINE]>;

    #[inline]
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl PartialEq<[u64]> for Dims {
    #[inline]
    fn eq(&self, other: &[u64]) -> bool {
        self.as_slice() == other
    }
}

impl PartialEq<&[u64]> for Dims {
    #[inline]
    fn eq(&self, other: &&[u64]) -> bool {
        self.as_slice() == *other
    }
}

impl PartialEq<Vec<u64>> for Dims {
    #[inline]
    fn eq(&self, other: &Vec<u64>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<const N: usize> PartialEq<[u64; N]> for Dims {
    #[inline]
    fn eq(&self, other: &[u64; N]) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialEq<Dims> for Vec<u64> {
    #[inline]
    fn eq(&self, other: &Dims) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialEq<Dims> for [u64] {
    #[inline]
    fn eq(&self, other: &Dims) -> bool {
        self == other.as_slice()
    }
}

impl PartialEq<Dims> for &[u64] {
    #[inline]
    fn eq(&self, other: &Dims) -> bool {
        *self == other.as_slice()
    }
}

/// The same bytes as a `Vec<u64>` in every format.
impl Serialize for Dims {
    #[inline]
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.as_slice().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Dims {
    #[inline]
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Dims, D::Error> {
        struct Seq;
        impl<'de> Visitor<'de> for Seq {
            type Value = Dims;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence of unsigned integers")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Dims, A::Error> {
                // The hint comes from the input: never trust it for more than the inline size.
                let mut out = Dims::with_capacity(seq.size_hint().unwrap_or(0).min(DIMS_INLINE));
                while let Some(d) = seq.next_element()? {
                    out.push(d);
                }
                Ok(out)
            }
        }
        d.deserialize_seq(Seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serializes_as_a_vec_and_back() {
        for v in [vec![], vec![3], vec![1, 2, 3, 4], vec![9, 8, 7, 6, 5, u64::MAX]] {
            let d = Dims::from(&v);
            assert_eq!(d, v);
            assert_eq!(serde_json::to_string(&d).unwrap(), serde_json::to_string(&v).unwrap());
            let back: Dims = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
            assert_eq!(back, d);
            assert_eq!(format!("{d:?}"), format!("{v:?}"));
        }
        assert!(serde_json::from_str::<Dims>("[1, -2]").is_err());
        assert!(serde_json::from_str::<Dims>("{\"a\": 1}").is_err());
    }

    #[test]
    fn orders_and_hashes_as_a_slice() {
        use std::collections::hash_map::DefaultHasher;
        let h = |v: &dyn Fn(&mut DefaultHasher)| {
            let mut s = DefaultHasher::new();
            v(&mut s);
            s.finish()
        };
        let (a, b) = (Dims::from([1, 2]), Dims::from([1, 2, 0, 0, 0]));
        assert!(a < b);
        assert_eq!(a.cmp(&b), [1u64, 2].as_slice().cmp([1, 2, 0, 0, 0].as_slice()));
        assert_eq!(h(&|s| b.hash(s)), h(&|s| [1u64, 2, 0, 0, 0].as_slice().hash(s)));
    }
}
