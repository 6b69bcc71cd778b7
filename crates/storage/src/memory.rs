//! In-process storage for tests and simulation.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use bytes::{Bytes, BytesMut};

use crate::{
    Error, ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions, check_path,
    check_ranges,
};

type Objects = Arc<RwLock<BTreeMap<String, Bytes>>>;

/// Objects in a map in this process.
///
/// [`MemoryStorage::new`] (URL `memory://`) is a fresh, private store.
/// [`MemoryStorage::named`] (URL `memory://NAME`) shares its objects with every other store of
/// the same name in this process, for as long as the process lives, so that simulated ranks
/// opening the same URL see the same objects. Writers buffer the whole object in memory.
#[derive(Debug, Clone)]
pub struct MemoryStorage {
    name: String,
    objects: Objects,
}

impl Default for MemoryStorage {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStorage {
    /// A fresh, empty store that shares nothing.
    pub fn new() -> Self {
        MemoryStorage { name: String::new(), objects: Objects::default() }
    }

    /// The process-wide store called `name` (created empty on first use).
    pub fn named(name: &str) -> Self {
        static REGISTRY: OnceLock<Mutex<HashMap<String, Objects>>> = OnceLock::new();
        let registry = REGISTRY.get_or_init(Default::default);
        let mut map = registry.lock().unwrap_or_else(|p| p.into_inner());
        let objects = map.entry(name.to_string()).or_default().clone();
        MemoryStorage { name: name.to_string(), objects }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Bytes>> {
        // A panic while holding the lock cannot leave the map half-updated (single inserts).
        self.objects.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Bytes>> {
        self.objects.write().unwrap_or_else(|p| p.into_inner())
    }

    fn object(&self, path: &str) -> Result<Bytes> {
        check_path(path, false)?;
        self.read().get(path).cloned().ok_or_else(|| Error::NotFound { path: self.location(path) })
    }
}

/// Fills `reads` from `obj`, the object at `location`.
fn read_from(obj: &[u8], location: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
    let ranges = crate::read_ranges(location, reads)?;
    check_ranges(location, &ranges, obj.len() as u64)?;
    for ((_, buf), r) in reads.iter_mut().zip(&ranges) {
        buf.copy_from_slice(&obj[r.start as usize..r.end as usize]);
    }
    Ok(())
}

/// One version of an object, held for its reads.
struct MemoryReader {
    obj: Bytes,
    location: String,
}

impl ObjectReader for MemoryReader {
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        read_from(&self.obj, &self.location, reads)
    }

    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        crate::read_then_inspect(self, reads, inspect)
    }

    fn read_picked_inspected(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        crate::read_then_pick(self, range, picks, inspect)
    }
}

impl Storage for MemoryStorage {
    fn location(&self, path: &str) -> String {
        format!("memory://{}/{}", self.name, path)
    }

    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        check_path(path, false)?;
        self.write().insert(path.to_string(), data);
        Ok(())
    }

    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        check_path(path, false)?;
        let mut map = self.write();
        if map.contains_key(path) {
            return Err(Error::AlreadyExists { path: self.location(path) });
        }
        map.insert(path.to_string(), data);
        Ok(())
    }

    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        check_path(path, false)?;
        let mut map = self.write();
        match map.get_mut(path) {
            Some(current) if current[..] == *expected => {
                *current = data;
                Ok(())
            }
            found => Err(crate::not_expected(self.location(path), found.is_some())),
        }
    }

    fn writer(&self, path: &str, _options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        check_path(path, false)?;
        Ok(Box::new(MemoryWriter { store: self.clone(), path: path.to_string(), buf: BytesMut::new() }))
    }

    fn get(&self, path: &str) -> Result<Bytes> {
        self.object(path)
    }

    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        let obj = self.object(path)?;
        check_ranges(&self.location(path), ranges, obj.len() as u64)?;
        // In bounds of a usize-sized buffer, so the casts are exact.
        Ok(ranges.iter().map(|r| obj.slice(r.start as usize..r.end as usize)).collect())
    }

    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        read_from(&self.object(path)?, &self.location(path), reads)
    }

    fn hints(&self) -> StorageHints {
        StorageHints::NONE
    }

    fn prefetch(&self, _path: &str, _at: u64, _len: u64) {}

    /// Holds the object as it was when opened: every read is of that version.
    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>> {
        let obj = self.object(path)?;
        let location = self.location(path);
        if obj.len() as u64 != len {
            return Err(Error::SizeMismatch { path: location, expected: len, size: obj.len() as u64 });
        }
        Ok(Box::new(MemoryReader { obj, location }))
    }

    fn size(&self, path: &str) -> Result<u64> {
        Ok(self.object(path)?.len() as u64)
    }

    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        check_path(prefix, true)?;
        let map = self.read();
        Ok(map
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .filter(|(k, _)| crate::under_prefix(k, prefix))
            .map(|(k, v)| ObjectInfo { path: k.clone(), size: v.len() as u64 })
            .collect())
    }

    fn delete(&self, path: &str) -> Result<()> {
        check_path(path, false)?;
        self.write().remove(path);
        Ok(())
    }

    /// None: a writer buffers its object in the writer, which dies with its process.
    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        check_path(prefix, true)?;
        Ok(Vec::new())
    }

    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.list_abandoned(prefix)
    }
}

#[derive(Debug)]
struct MemoryWriter {
    store: MemoryStorage,
    path: String,
    buf: BytesMut,
}

impl ObjectWriter for MemoryWriter {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.buf.extend_from_slice(data);
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<u64> {
        let len = self.buf.len() as u64;
        self.store.put(&self.path, self.buf.freeze())?;
        Ok(len)
    }

    fn abort(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}
