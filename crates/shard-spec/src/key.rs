//! [`Key`]: a tensor's or object's name, shared rather than copied.

use std::borrow::Borrow;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The name of a global tensor or object (`decoder.layers.3.mlp.linear_fc1.weight`).
///
/// It behaves as a `str` (it dereferences to one, compares with `&str` and `String`, and
/// serializes as a string) but a clone shares the bytes: a key is copied into every plan a
/// save makes and every request a load gets, so a state of many small tensors would
/// otherwise allocate for each copy.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key(Arc<str>);

impl Key {
    /// A key holding a copy of `s`.
    #[inline]
    pub fn new(s: &str) -> Key {
        Key(Arc::from(s))
    }

    /// The name as a `str`.
    #[inline]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Key {
    #[inline]
    fn default() -> Key {
        Key::new("")
    }
}

impl Deref for Key {
    type Target = str;

    #[inline]
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Key {
    #[inline]
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for Key {
    #[inline]
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// Hashes as the `str` it holds, so `Borrow<str>` lookups agree.
impl Hash for Key {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl fmt::Debug for Key {
    #[inline]
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Key {
    #[inline]
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for Key {
    #[inline]
    fn from(s: &str) -> Key {
        Key::new(s)
    }
}

impl From<&String> for Key {
    #[inline]
    fn from(s: &String) -> Key {
        Key::new(s)
    }
}

impl From<String> for Key {
    #[inline]
    fn from(s: String) -> Key {
        Key(Arc::from(s))
    }
}

impl From<&Key> for Key {
    #[inline]
    fn from(k: &Key) -> Key {
        k.clone()
    }
}

impl From<Key> for String {
    #[inline]
    fn from(k: Key) -> String {
        k.as_str().to_owned()
    }
}

impl PartialEq<str> for Key {
    #[inline]
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Key {
    #[inline]
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for Key {
    #[inline]
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialEq<Key> for str {
    #[inline]
    fn eq(&self, other: &Key) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<Key> for &str {
    #[inline]
    fn eq(&self, other: &Key) -> bool {
        *self == other.as_str()
    }
}

impl PartialEq<Key> for String {
    #[inline]
    fn eq(&self, other: &Key) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Serialize for Key {
    #[inline]
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// One allocation: the string is copied straight into the shared one, not into a `String`
/// first.
impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct Str;
        impl serde::de::Visitor<'_> for Str {
            type Value = Key;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(Key::new(v))
            }
        }
        d.deserialize_str(Str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_as_a_string() {
        let k = Key::from("decoder.layers.0.weight");
        let c = k.clone();
        assert!(std::ptr::eq(k.as_ptr(), c.as_ptr()), "a clone shares the bytes");
        assert_eq!(k, "decoder.layers.0.weight");
        assert_eq!(k, String::from("decoder.layers.0.weight"));
        assert_eq!(format!("{k} {k:?}"), "decoder.layers.0.weight \"decoder.layers.0.weight\"");
        let (a, b, ab) = (Key::from("a"), Key::from("b"), Key::from("a.b"));
        assert!(a < b && ab > a);
        let json = serde_json::to_string(&k).unwrap();
        assert_eq!(json, serde_json::to_string("decoder.layers.0.weight").unwrap());
        assert_eq!(serde_json::from_str::<Key>(&json).unwrap(), k);
        let mut m = std::collections::HashMap::new();
        m.insert(k.clone(), 1);
        assert_eq!(m.get("decoder.layers.0.weight"), Some(&1));
    }
}
