//! A view of one prefix of another store, as a store of its own.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

use crate::{ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions, check_path};

/// The objects under `prefix/` of another store, named without the prefix: a run root's
/// step directory is a checkpoint location of its own, on one connection to the store.
///
/// ```
/// use std::sync::Arc;
/// use bytes::Bytes;
/// use dckpt_storage::{MemoryStorage, Prefixed, Storage, StorageExt};
///
/// let root: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
/// let step = Prefixed::new(root.clone(), "step-1")?;
/// step.put("a", Bytes::from_static(b"x"))?;
/// assert!(root.exists("step-1/a")?);
/// assert_eq!(step.list("")?[0].path, "a");
/// # Ok::<(), dckpt_storage::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Prefixed {
    inner: Arc<dyn Storage>,
    prefix: String,
}

impl Prefixed {
    /// The view of `prefix` (a relative path, see the crate docs) of `inner`.
    pub fn new(inner: Arc<dyn Storage>, prefix: &str) -> Result<Prefixed> {
        check_path(prefix, false)?;
        Ok(Prefixed { inner, prefix: prefix.to_string() })
    }

    fn full(&self, path: &str) -> String {
        if path.is_empty() { self.prefix.clone() } else { format!("{}/{path}", self.prefix) }
    }

    /// The inner store's listing under the prefix, renamed relative to it.
    fn strip(&self, found: Vec<ObjectInfo>) -> Vec<ObjectInfo> {
        // Checked, not cut at a length: a listing that names something outside the prefix
        // (or splits a character there) must not come back as one of its objects.
        let dir = format!("{}/", self.prefix);
        found
            .into_iter()
            .filter_map(|o| {
                let path = o.path.strip_prefix(&dir).filter(|p| !p.is_empty())?;
                Some(ObjectInfo { path: path.to_string(), size: o.size })
            })
            .collect()
    }
}

impl Storage for Prefixed {
    fn location(&self, path: &str) -> String {
        self.inner.location(&self.full(path))
    }
    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        check_path(path, false)?;
        self.inner.put(&self.full(path), data)
    }
    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        check_path(path, false)?;
        self.inner.put_if_absent(&self.full(path), data)
    }
    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        check_path(path, false)?;
        self.inner.put_if_match(&self.full(path), data, expected)
    }
    fn writer(&self, path: &str, options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        check_path(path, false)?;
        self.inner.writer(&self.full(path), options)
    }
    fn get(&self, path: &str) -> Result<Bytes> {
        check_path(path, false)?;
        self.inner.get(&self.full(path))
    }
    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        check_path(path, false)?;
        self.inner.get_ranges(&self.full(path), ranges)
    }
    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        check_path(path, false)?;
        self.inner.read_into(&self.full(path), reads)
    }
    fn reader(&self, path: &str) -> Result<Box<dyn ObjectReader + '_>> {
        check_path(path, false)?;
        self.inner.reader(&self.full(path))
    }
    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>> {
        check_path(path, false)?;
        self.inner.reader_sized(&self.full(path), len)
    }
    fn hints(&self) -> StorageHints {
        self.inner.hints()
    }
    fn prefetch(&self, path: &str, at: u64, len: u64) {
        self.inner.prefetch(&self.full(path), at, len)
    }
    fn size(&self, path: &str) -> Result<u64> {
        check_path(path, false)?;
        self.inner.size(&self.full(path))
    }
    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        check_path(prefix, true)?;
        Ok(self.strip(self.inner.list(&self.full(prefix))?))
    }
    fn delete(&self, path: &str) -> Result<()> {
        check_path(path, false)?;
        self.inner.delete(&self.full(path))
    }
    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        check_path(prefix, true)?;
        Ok(self.strip(self.inner.list_abandoned(&self.full(prefix))?))
    }
    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        check_path(prefix, true)?;
        Ok(self.strip(self.inner.remove_abandoned(&self.full(prefix))?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryStorage, StorageExt};

    #[test]
    fn names_are_relative_to_the_prefix_and_siblings_stay_out() {
        let root: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
        root.put("step-1x/other", Bytes::from_static(b"o")).unwrap();
        let p = Prefixed::new(root.clone(), "step-1").unwrap();
        p.put("d/f", Bytes::from_static(b"abc")).unwrap();
        p.put_if_absent("meta", Bytes::from_static(b"m")).unwrap();
        assert!(p.put_if_absent("meta", Bytes::from_static(b"m")).is_err());
        let names: Vec<String> = p.list("").unwrap().into_iter().map(|o| o.path).collect();
        assert_eq!(names, ["d/f", "meta"]);
        assert_eq!(p.list("d").unwrap()[0].size, 3);
        assert_eq!(p.get("d/f").unwrap(), Bytes::from_static(b"abc"));
        p.delete("meta").unwrap();
        assert!(!root.exists("step-1/meta").unwrap());
        assert!(root.exists("step-1x/other").unwrap());
        assert!(p.location("meta").ends_with("step-1/meta"));
        assert!(Prefixed::new(root.clone(), "../x").is_err());
        assert!(p.get("../x").is_err());
    }
}
