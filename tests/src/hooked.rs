//! A storage that shows each call to a hook before passing it on: the tests' wrappers (a
//! rank that dies at its write, a gate that holds commits, a read counter) differ only in
//! that hook, so they share one forwarding of the whole trait.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use dckpt_storage::{ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions};

/// What a [`Hooked`] store is about to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Put,
    PutIfAbsent,
    PutIfMatch,
    /// A streaming writer is opened.
    Writer,
    /// An object's bytes are read (`get`, `get_ranges`, `read_into`, a `reader` opened).
    Read,
    /// Anything else: sizes, lists, deletes, hints of abandoned writes.
    Other,
}

impl Call {
    /// A whole object written in one call: a commit's metadata, say.
    pub fn puts(self) -> bool {
        matches!(self, Call::Put | Call::PutIfAbsent | Call::PutIfMatch)
    }
}

/// Passes every call to `inner` after `hook(call, path)` returned.
pub struct Hooked<H> {
    inner: Arc<dyn Storage>,
    hook: H,
}

/// `inner` with `hook` seeing every call first.
pub fn hooked(inner: Arc<dyn Storage>, hook: impl Fn(Call, &str) + Send + Sync + 'static) -> Arc<dyn Storage> {
    Arc::new(Hooked { inner, hook })
}

impl<H> std::fmt::Debug for Hooked<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooked").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<H: Fn(Call, &str) + Send + Sync> Storage for Hooked<H> {
    fn location(&self, path: &str) -> String {
        self.inner.location(path)
    }
    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        (self.hook)(Call::Put, path);
        self.inner.put(path, data)
    }
    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        (self.hook)(Call::PutIfAbsent, path);
        self.inner.put_if_absent(path, data)
    }
    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        (self.hook)(Call::PutIfMatch, path);
        self.inner.put_if_match(path, data, expected)
    }
    fn writer(&self, path: &str, options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        (self.hook)(Call::Writer, path);
        self.inner.writer(path, options)
    }
    fn get(&self, path: &str) -> Result<Bytes> {
        (self.hook)(Call::Read, path);
        self.inner.get(path)
    }
    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        (self.hook)(Call::Read, path);
        self.inner.get_ranges(path, ranges)
    }
    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        (self.hook)(Call::Read, path);
        self.inner.read_into(path, reads)
    }
    fn reader(&self, path: &str) -> Result<Box<dyn ObjectReader + '_>> {
        (self.hook)(Call::Read, path);
        self.inner.reader(path)
    }
    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>> {
        (self.hook)(Call::Read, path);
        self.inner.reader_sized(path, len)
    }
    fn hints(&self) -> StorageHints {
        self.inner.hints()
    }
    fn prefetch(&self, path: &str, at: u64, len: u64) {
        self.inner.prefetch(path, at, len)
    }
    fn size(&self, path: &str) -> Result<u64> {
        (self.hook)(Call::Other, path);
        self.inner.size(path)
    }
    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        (self.hook)(Call::Other, prefix);
        self.inner.list(prefix)
    }
    fn delete(&self, path: &str) -> Result<()> {
        (self.hook)(Call::Other, path);
        self.inner.delete(path)
    }
    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        (self.hook)(Call::Other, prefix);
        self.inner.list_abandoned(prefix)
    }
    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        (self.hook)(Call::Other, prefix);
        self.inner.remove_abandoned(prefix)
    }
}
