//! Locating and reading a chunk reads only that chunk's item, and only the parts of it
//! that say where the elements are (its zip directory, two local headers, data.pkl) and
//! the elements themselves: never a whole data file, as a reader on S3 needs.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use dckpt::storage::{ObjectInfo, ObjectReader, ObjectWriter, Result, Storage, StorageHints, WriterOptions};
use dckpt_convert::torch_dist::{Checkpoint, read_chunk};

/// A storage that records every read: the path and the byte range (`None` for a whole get).
#[derive(Debug)]
struct Recorded {
    inner: Arc<dyn Storage>,
    reads: Mutex<Vec<(String, Option<Range<u64>>)>>,
}

impl Recorded {
    fn take(&self) -> Vec<(String, Option<Range<u64>>)> {
        std::mem::take(&mut self.reads.lock().unwrap())
    }
}

impl Storage for Recorded {
    fn location(&self, path: &str) -> String {
        self.inner.location(path)
    }
    fn put(&self, path: &str, data: Bytes) -> Result<()> {
        self.inner.put(path, data)
    }
    fn put_if_absent(&self, path: &str, data: Bytes) -> Result<()> {
        self.inner.put_if_absent(path, data)
    }
    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> Result<()> {
        self.inner.put_if_match(path, data, expected)
    }
    fn writer(&self, path: &str, options: &WriterOptions) -> Result<Box<dyn ObjectWriter>> {
        self.inner.writer(path, options)
    }
    fn get(&self, path: &str) -> Result<Bytes> {
        self.reads.lock().unwrap().push((path.to_string(), None));
        self.inner.get(path)
    }
    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.reads.lock().unwrap().extend(ranges.iter().map(|r| (path.to_string(), Some(r.clone()))));
        self.inner.get_ranges(path, ranges)
    }
    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        let mut log = self.reads.lock().unwrap();
        log.extend(reads.iter().map(|(at, b)| (path.to_string(), Some(*at..*at + b.len() as u64))));
        drop(log);
        self.inner.read_into(path, reads)
    }
    fn reader(&self, path: &str) -> Result<Box<dyn ObjectReader + '_>> {
        Ok(Box::new(RecordedReader { path: path.to_string(), of: self }))
    }
    fn reader_sized(&self, path: &str, len: u64) -> Result<Box<dyn ObjectReader + '_>> {
        // The inner reader checks the length; the reads are recorded by path.
        self.inner.reader_sized(path, len)?;
        self.reader(path)
    }
    fn hints(&self) -> StorageHints {
        self.inner.hints()
    }
    fn prefetch(&self, path: &str, at: u64, len: u64) {
        self.inner.prefetch(path, at, len)
    }
    fn size(&self, path: &str) -> Result<u64> {
        self.inner.size(path)
    }
    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.inner.list(prefix)
    }
    fn delete(&self, path: &str) -> Result<()> {
        self.inner.delete(path)
    }
    fn list_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.inner.list_abandoned(prefix)
    }
    fn remove_abandoned(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.inner.remove_abandoned(prefix)
    }
}

struct RecordedReader<'a> {
    path: String,
    of: &'a Recorded,
}

impl ObjectReader for RecordedReader<'_> {
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.of.read_into(&self.path, reads)
    }

    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        dckpt::storage::read_then_inspect(self, reads, inspect)
    }

    fn read_picked_inspected(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        dckpt::storage::read_then_pick(self, range, picks, inspect)
    }
}

#[test]
fn a_chunk_is_located_and_read_from_its_item_alone() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torch/megatron-0.16.1");
    let storage =
        Recorded { inner: dckpt::storage::open(dir.to_str().unwrap()).unwrap(), reads: Mutex::new(Vec::new()) };
    let ckpt = Checkpoint::open(&storage).unwrap();
    let opened = storage.take();
    assert!(opened.iter().all(|(p, _)| p == ".metadata" || p == "metadata.json"), "{opened:?}");
    let mut chunks = 0;
    for (key, t) in ckpt.tensors().map(|(k, t)| (k.to_string(), t.clone())).collect::<Vec<_>>() {
        for (i, c) in t.chunks.iter().enumerate() {
            let info = ckpt.item(&key, Some(&c.offsets)).unwrap().clone();
            let item = info.offset..info.offset + info.length;
            let loc = ckpt.locate_chunk(&storage, &key, i).unwrap();
            let located = storage.take();
            let mut buf = vec![0u8; loc.nbytes() as usize];
            read_chunk(&storage, &loc, &mut buf).unwrap();
            let read = storage.take();
            for (p, r) in located.iter().chain(&read) {
                let r = r.clone().unwrap_or_else(|| panic!("{key}: the whole of {p} was read"));
                assert_eq!(p, &info.relative_path, "{key}");
                assert!(item.start <= r.start && r.end <= item.end, "{key}: read {r:?} outside item {item:?}");
            }
            let located_bytes: u64 =
                located.iter().map(|(_, r)| r.as_ref().unwrap().end - r.as_ref().unwrap().start).sum();
            // The item's tail (its zip directory), two local headers and data.pkl: less than the
            // item, which on a real checkpoint is mostly the storage's bytes.
            assert!(
                located_bytes < info.length,
                "{key}: {located_bytes} bytes read to locate an item of {}",
                info.length
            );
            // The elements: exactly the storage's bytes, in one read (every view here is contiguous).
            assert_eq!(read, [(info.relative_path.clone(), Some(loc.data.clone()))], "{key}");
            chunks += 1;
        }
    }
    assert_eq!(chunks, 9);
}
