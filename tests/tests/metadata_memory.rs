//! Memory on large or oversized metadata: decoding (validation included) holds at most a
//! small multiple of the file's size, and a metadata file above the limit is refused from
//! its size alone, before a byte of it is read.
//!
//! A file of its own: the counting allocator below is this test binary's global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dckpt_engine::format::{
    ChunkMeta, FORMAT_VERSION, FileMeta, FormatErrorKind, META_BYTES_MAX, META_NAME, Metadata, TensorMeta,
    data_file_name,
};
use dckpt_engine::{Error, ErrorKind, read_metadata_local};
use dckpt_shard_spec::DType;

/// Counts the bytes live on a thread while it is tracking, and their peak.
struct Counting;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn add(n: i64) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            let _ = LIVE.try_with(|l| {
                l.set(l.get() + n);
                let _ = PEAK.try_with(|p| p.set(p.get().max(l.get())));
            });
        }
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        add(layout.size() as i64);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        add(-(layout.size() as i64));
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        add(layout.size() as i64);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        add(new_size as i64 - layout.size() as i64);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result with the peak of the bytes it held at once (what it
/// allocated and had not freed, its result included).
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, u64) {
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    TRACKING.with(|t| t.set(true));
    let out = f();
    TRACKING.with(|t| t.set(false));
    (out, PEAK.with(Cell::get).max(0) as u64)
}

const SAVE_ID: &str = "0123456789abcdef";

/// A valid metadata file: `tensors` tensors of f32, each split into `rows` x `cols` chunks
/// of 2 x 3 elements (every row and column split, as tensor and pipeline splits cut
/// them), or, with `flat`, each chunk also cut into two flat ranges as a distributed
/// optimizer cuts its boxes. One checksum block per piece, the pieces dealt over 8 files.
fn grid_metadata(tensors: usize, rows: u64, cols: u64, flat: bool) -> Vec<u8> {
    const FILES: usize = 8;
    let piece_bytes = |flat_part: Option<[u64; 2]>| flat_part.map_or(6, |[a, b]| b - a) * 4;
    let mut files: Vec<FileMeta> = (0..FILES)
        .map(|r| FileMeta { name: data_file_name(SAVE_ID, r, 0), bytes: 64, data_start: 64, header_crc32: 0 })
        .collect();
    let mut next = 0;
    let mut metas = Vec::with_capacity(tensors);
    for t in 0..tensors {
        let mut chunks = Vec::new();
        for i in 0..rows {
            for j in 0..cols {
                let parts: &[Option<[u64; 2]>] = if flat { &[Some([0, 2]), Some([2, 6])] } else { &[None] };
                for &part in parts {
                    let fi = next % FILES;
                    next += 1;
                    let f = &mut files[fi];
                    chunks.push(ChunkMeta {
                        offset: vec![i * 2, j * 3].into(),
                        shape: vec![2, 3].into(),
                        flat: part,
                        file: fi as u32,
                        at: f.bytes,
                        crc32: vec![0; 4],
                    });
                    f.bytes += piece_bytes(part);
                }
            }
        }
        metas.push(TensorMeta {
            key: format!("decoder.layers.{t:05}.self_attention.linear_qkv.weight"),
            dtype: DType::F32,
            global_shape: vec![rows * 2, cols * 3].into(),
            chunks,
        });
    }
    let m = Metadata {
        format_version: FORMAT_VERSION,
        save_id: SAVE_ID.into(),
        writer: "test".into(),
        block_bytes: 1 << 20,
        layout: BTreeMap::from([("world_size".to_string(), "8".to_string())]),
        files,
        tensors: metas,
        objects: vec![],
    };
    m.encode()
}

/// Peak bytes held while decoding `bytes`, over the file's size.
fn decode_ratio(bytes: &[u8]) -> f64 {
    let (m, peak) = peak_of(|| Metadata::decode(bytes, "dckpt.meta"));
    let m = m.expect("the synthetic metadata is valid");
    let chunks: usize = m.tensors.iter().map(|t| t.chunks.len()).sum();
    drop(m);
    let ratio = peak as f64 / bytes.len() as f64;
    eprintln!("{} bytes, {chunks} chunks: peak {peak} bytes held, {ratio:.2}x", bytes.len());
    ratio
}

// An 84 MB metadata file with 2 M chunks took 933 MiB to decode: 11 times its size. The
// bound docs/format.md states for what dckpt writes is 5 times the file.
#[test]
fn decoding_two_million_chunks_holds_a_small_multiple_of_the_file() {
    // One tensor of 2 M chunks, then 20,000 tensors of 100.
    let one = grid_metadata(1, 2000, 1000, false);
    assert!(one.len() > 60 << 20, "{} bytes", one.len());
    let ratio = decode_ratio(&one);
    assert!(ratio < 5.0, "one tensor of 2 M chunks: {ratio:.2}x the file's size");
    let many = grid_metadata(20_000, 10, 10, false);
    let ratio = decode_ratio(&many);
    assert!(ratio < 5.0, "20,000 tensors of 100 chunks: {ratio:.2}x the file's size");
}

#[test]
fn flat_ranges_that_tile_their_boxes_hold_a_small_multiple_of_the_file() {
    let flat = grid_metadata(1, 1000, 1000, true);
    let ratio = decode_ratio(&flat);
    assert!(ratio < 5.0, "2 M flat ranges: {ratio:.2}x the file's size");
}

// A 1 GiB sparse metadata file was refused "exceeds the limit", but only after the process
// had read all of it.
#[test]
fn an_oversized_metadata_file_is_refused_unread() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = std::fs::File::create(dir.path().join(META_NAME)).expect("create");
    f.set_len(META_BYTES_MAX + 1).expect("a sparse file");
    let local = dckpt_storage::open(dir.path().to_str().expect("a UTF-8 path")).expect("open");
    // Counts the calls that read an object's bytes.
    let reads = Arc::new(AtomicUsize::new(0));
    let counted = reads.clone();
    let storage = dckpt_tests::hooked(local, move |call, _| {
        if call == dckpt_tests::Call::Read {
            counted.fetch_add(1, Ordering::SeqCst);
        }
    });
    let (r, peak) = peak_of(|| read_metadata_local(storage.as_ref()));
    let Err(ErrorKind::Format { error: e }) = r.as_ref().map_err(Error::kind) else {
        panic!("refused as too large: {r:?}")
    };
    assert_eq!(e.field(), "length", "{e}");
    assert_eq!(
        e.kind(),
        &FormatErrorKind::LimitExceeded { what: "bytes".into(), found: META_BYTES_MAX + 1, limit: META_BYTES_MAX },
    );
    assert!(e.to_string().contains("exceeds the limit"), "{e}");
    assert_eq!(reads.load(Ordering::SeqCst), 0, "the file was read");
    assert!(peak < 1 << 20, "{peak} bytes held");
    // verify reads the metadata the same way.
    let r = dckpt_engine::verify::verify(storage.as_ref(), |_| {});
    assert!(
        matches!(r.as_ref().map_err(Error::kind), Err(ErrorKind::Format { error: e }) if matches!(e.kind(), FormatErrorKind::LimitExceeded { .. })),
        "{r:?}"
    );
    assert_eq!(reads.load(Ordering::SeqCst), 0, "verify read the file");
    // Within the limit it is read, and refused for what it holds.
    f.set_len(100).expect("resize");
    drop(f);
    let r = read_metadata_local(storage.as_ref());
    assert!(
        matches!(r.as_ref().map_err(Error::kind), Err(ErrorKind::Format { error: e }) if e.kind() == &FormatErrorKind::NotMetadata),
        "{r:?}"
    );
    assert_eq!(reads.load(Ordering::SeqCst), 1);
}
