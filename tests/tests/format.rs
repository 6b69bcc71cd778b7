//! The metadata decoder treats every byte as untrusted: random bytes and mutations of a real
//! metadata file never panic, errors name the file and the field, crafted file names cannot
//! leave the checkpoint, and declared lengths are not trusted for allocation.
//!
//! A file of its own: the allocator below, which records the largest allocation, is this
//! test binary's global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::{Arc, OnceLock};

use dckpt_engine::{Engine, SaveOptions, SaveState, TensorData};
use dckpt_format::{
    ChunkMeta, FORMAT_VERSION, FileMeta, FormatError, FormatErrorKind, META_NAME, META_PREFIX_BYTES, Metadata,
    ObjectEntry, ObjectMeta, TensorMeta, frame,
};
use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedObject, ShardedTensor};
use dckpt_storage::Storage;
use proptest::prelude::*;

/// Records the largest single allocation made on a thread while it is tracking.
struct PeakAlloc;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn note(size: usize) {
    let _ = TRACKING.try_with(|t| {
        if t.get() {
            let _ = PEAK.try_with(|p| p.set(p.get().max(size)));
        }
    });
}

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

/// Runs `f` and returns its result with the largest single allocation it made.
fn peak_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    PEAK.with(|p| p.set(0));
    TRACKING.with(|t| t.set(true));
    let out = f();
    TRACKING.with(|t| t.set(false));
    (out, PEAK.with(Cell::get))
}

const FILE: &str = "ckpt/dckpt.meta";

/// A real metadata file: two ranks save two tensors (one with flat ranges) and an object grid.
fn saved_metadata() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let storage: Arc<dyn Storage> = Arc::new(dckpt_storage::MemoryStorage::new());
        let results = dckpt_tests::run_ranks(2, |r, c| {
            let engine = Engine::new(c);
            let rows = r as u64 * 2;
            let a = ShardedTensor {
                key: "a".into(),
                dtype: DType::F32,
                global_shape: vec![4, 6].into(),
                region: Region::boxed(vec![rows, 0], vec![2, 6]),
                replica_id: ReplicaId::MAIN,
            };
            let b = ShardedTensor {
                key: "b".into(),
                dtype: DType::Bf16,
                global_shape: vec![3, 5].into(),
                region: Region::full(&[3, 5]).narrowed(r as u64 * 7, if r == 0 { 7 } else { 15 }),
                replica_id: ReplicaId::MAIN,
            };
            let o = ShardedObject {
                key: "rng".into(),
                grid_shape: vec![2],
                grid_offset: vec![r as u64],
                replica_id: ReplicaId::MAIN,
            };
            let (da, db) = (vec![r as u8; 48], vec![7u8; b.nbytes() as usize]);
            let state = SaveState {
                tensors: vec![TensorData { tensor: a, data: &da }, TensorData { tensor: b, data: &db }],
                objects: vec![dckpt_engine::ObjectData { object: o, data: b"state", compare: Default::default() }],
            };
            engine.save(storage.as_ref(), &state, &SaveOptions { block_bytes: 16, ..SaveOptions::default() })
        });
        for r in results {
            r.expect("save");
        }
        storage.get(META_NAME).expect("metadata").to_vec()
    })
}

/// The decoded form of [`saved_metadata`].
fn valid() -> Metadata {
    Metadata::decode(saved_metadata(), FILE).expect("the saved metadata decodes")
}

fn body() -> &'static [u8] {
    let m = saved_metadata();
    &m[META_PREFIX_BYTES..m.len() - 4]
}

/// Decodes without panicking; an error must name the file and a field.
fn decode_checked(bytes: &[u8]) -> Result<Metadata, FormatError> {
    let r = std::panic::catch_unwind(|| Metadata::decode(bytes, FILE));
    let r = r.unwrap_or_else(|_| panic!("decode panicked on {} bytes: {:02x?}", bytes.len(), bytes));
    if let Err(e) = &r {
        assert_eq!(e.file(), FILE, "{e}");
        assert!(!e.field().is_empty() && !e.kind().to_string().is_empty(), "{e:?}");
        assert!(e.to_string().starts_with(FILE), "{e}");
    }
    r
}

/// Crafted metadata, framed and encoded correctly, must fail validation at `field`; returns
/// what is inconsistent.
fn rejects(m: &Metadata, field: &str) -> String {
    let e = Metadata::decode(&m.encode(), FILE).expect_err("crafted metadata must be rejected");
    assert_eq!(e.file(), FILE);
    assert!(e.field().contains(field), "expected field {field:?} in {e}");
    match e.kind() {
        FormatErrorKind::Invalid { detail } => detail.clone(),
        FormatErrorKind::LimitExceeded { .. } => e.kind().to_string(),
        _ => panic!("decoded but inconsistent is Invalid: {e:?}"),
    }
}

#[test]
fn saved_metadata_round_trips() {
    let m = valid();
    assert_eq!(m.encode(), saved_metadata());
    assert_eq!(m.files.len(), 2);
    assert_eq!(m.tensors.len(), 2);
    assert_eq!(m.objects.len(), 1);
}

#[test]
fn framing_errors_name_their_field() {
    let good = saved_metadata();
    let check = |bytes: &[u8], field: &str, kind: fn(&FormatErrorKind) -> bool| {
        let e = decode_checked(bytes).expect_err("must be rejected");
        assert_eq!(e.field(), field, "{e}");
        assert!(kind(e.kind()), "{e:?}");
    };
    let damaged = |k: &FormatErrorKind| matches!(k, FormatErrorKind::Damaged { .. });
    let malformed = |k: &FormatErrorKind| matches!(k, FormatErrorKind::Malformed { .. });
    check(&[], "length", damaged);
    check(&good[..23], "length", damaged);
    check(b"{\"a\": 1}", "magic", |k| k == &FormatErrorKind::NotMetadata);
    let mut b = good.to_vec();
    b[0] ^= 1;
    check(&b, "magic", |k| k == &FormatErrorKind::NotMetadata);
    // A newer version, told apart from damage: nothing after the version is trusted.
    let mut b = good.to_vec();
    b[8] = 2;
    b.truncate(40);
    check(&b, "format_version", |k| k == &FormatErrorKind::UnsupportedVersion { found: 2, supported: FORMAT_VERSION });
    check(&good[..good.len() - 1], "body_length", damaged);
    let mut b = good.to_vec();
    b[13] ^= 0x80; // reserved: only the CRC covers it
    check(&b, "crc32", damaged);
    let mut b = good.to_vec();
    let last = b.len() - 1;
    b[last] ^= 1;
    check(&b, "crc32", damaged);
    check(&frame(b"\xc1"), "body", malformed);
    // One MessagePack value and nothing after it.
    let mut b = body().to_vec();
    b.push(0xc0);
    check(&frame(&b), "body", malformed);
    // The body's version must be the prefix's.
    let mut m = valid();
    m.format_version = 7;
    check(&m.encode(), "format_version", |k| matches!(k, FormatErrorKind::Invalid { .. }));
}

#[test]
fn file_names_must_stay_inside_the_checkpoint() {
    for bad in ["../x.safetensors", "/etc/passwd", "a/b", "a\\b", ".hidden", "..", ".", "", "x\0y", "dckpt.meta"] {
        let mut m = valid();
        m.files[0].name = bad.to_string();
        rejects(&m, "files[0].name");
    }
    let mut m = valid();
    m.files[1].name = m.files[0].name.clone();
    rejects(&m, "files[1].name");
    let mut m = valid();
    m.save_id = "../../x".into();
    rejects(&m, "save_id");
}

/// What docs/format.md says of names, an independent reader of it checks: the save id is 16
/// lower-case hex digits, and each data file is named after it and its rank, in rank order.
#[test]
fn save_ids_and_data_file_names_are_what_the_spec_says() {
    let m = valid();
    let id = m.save_id.clone();
    for bad in [id.to_uppercase(), id[..15].to_string(), format!("{id}0"), "not-a-save-id".into()] {
        let mut m = valid();
        m.save_id = bad.clone();
        // The file names follow, so that only the save id is wrong.
        for (r, f) in m.files.iter_mut().enumerate() {
            f.name = format!("{bad}-{r:05}.safetensors");
        }
        let e = rejects(&m, "save_id");
        assert!(e.contains("lower-case hexadecimal"), "{bad}: {e}");
    }
    // A data file renamed, in the metadata and on disk alike.
    for renamed in [
        "model-00001-of-00002.safetensors".to_string(),
        format!("{id}-1.safetensors"),
        format!("{id}-00001.0.safetensors"),
        format!("{}-00001.safetensors", "fedcba9876543210"),
    ] {
        let mut m = valid();
        m.files[1].name = renamed.clone();
        let e = rejects(&m, "files[1].name");
        assert!(e.contains(&format!("{renamed:?}")), "{e}");
    }
    // Files in rank order, each rank's numbered from 0.
    let mut m = valid();
    m.files.swap(0, 1);
    for t in &mut m.tensors {
        for c in &mut t.chunks {
            c.file = 1 - c.file;
        }
    }
    for o in &mut m.objects {
        for e in &mut o.entries {
            e.file = 1 - e.file;
        }
    }
    let e = rejects(&m, "files[1].name");
    assert!(e.contains("rank order"), "{e}");
    let mut m = valid();
    m.files[1].name = format!("{id}-00000.2.safetensors");
    let e = rejects(&m, "files[1].name");
    assert!(e.contains("cannot follow rank 0's file 0"), "{e}");
    let mut m = valid();
    m.files[1].name = format!("{id}-00000.1.safetensors");
    Metadata::decode(&m.encode(), FILE).expect("rank 0's second file");
    let mut m = valid();
    m.files[1].name = format!("{id}-00007.safetensors");
    Metadata::decode(&m.encode(), FILE).expect("ranks need not be consecutive");
}

/// Tensors and objects are separate lists: one key may name a tensor and an object.
#[test]
fn a_tensor_and_an_object_may_share_a_key() {
    let mut m = valid();
    m.objects[0].key = m.tensors[0].key.clone();
    assert_eq!(Metadata::decode(&m.encode(), FILE), Ok(m));
}

#[test]
fn crafted_structure_is_rejected() {
    let mut m = valid();
    m.tensors[0].chunks[0].file = 9;
    rejects(&m, ".file");
    let mut m = valid();
    m.tensors[0].chunks[0].at = u64::MAX - 3;
    rejects(&m, ".at");
    let mut m = valid();
    m.tensors[0].chunks[0].at = 0; // inside the safetensors header
    rejects(&m, ".at");
    let mut m = valid();
    m.files[0].data_start = m.files[0].bytes + 1;
    rejects(&m, "data_start");
    // A header past safetensors' bound, though the file is larger still: a load sizes a
    // buffer by it.
    let mut m = valid();
    m.files[0].bytes += 1 << 40;
    m.files[0].data_start = 8 + 100_000_001;
    rejects(&m, "data_start");
    let mut m = valid();
    m.tensors[0].chunks[0].crc32.pop();
    rejects(&m, "tensors[0] (a).chunks[0].crc32");
    let mut m = valid();
    m.objects[0].entries[0].crc32.extend([0; 4]);
    rejects(&m, "objects[0] (rng).entries[0].crc32");
    let mut m = valid();
    m.files[0].bytes += 1; // a byte under no checksum
    rejects(&m, "files[0]");
    let mut m = valid();
    m.block_bytes = 0;
    rejects(&m, "block_bytes");
    let mut m = valid();
    m.block_bytes = (1 << 30) + 1;
    let e = Metadata::decode(&m.encode(), FILE).unwrap_err();
    assert!(matches!(e.kind(), FormatErrorKind::LimitExceeded { limit: 1073741824, .. }), "{e}");
    let mut m = valid();
    m.tensors[0].chunks[0].shape[0] = 3; // overlaps the other rank's rows
    rejects(&m, "");
    let mut m = valid();
    m.tensors[0].chunks.pop(); // a hole in the tensor, and bytes of a file under no checksum
    rejects(&m, "files[");
    let mut m = valid();
    m.tensors[0].chunks[1].offset[0] = 1; // rows 1..3 overlap rank 0's rows 0..2
    rejects(&m, "coverage");
    let mut m = valid();
    m.tensors[1].global_shape = vec![u64::MAX, u64::MAX].into();
    rejects(&m, "tensors[1]");
    let mut m = valid();
    m.objects[0].entries.pop();
    rejects(&m, "files[");
    let mut m = valid();
    m.tensors.push(m.tensors[0].clone());
    rejects(&m, "tensors[2].key");
}

// A tensor listed with no chunks at all was accepted, and a load then returned zeros for it.
#[test]
fn tensor_without_chunks_is_rejected() {
    let mut m = valid();
    m.tensors.push(TensorMeta { key: "ghost".into(), dtype: DType::F32, global_shape: vec![8].into(), chunks: vec![] });
    rejects(&m, "tensors[2] (ghost).chunks");
    let mut m = valid();
    m.objects.push(ObjectMeta { key: "z.ghost".into(), grid_shape: vec![2], entries: vec![] });
    rejects(&m, "objects[1] (z.ghost).entries");
    // An empty tensor has nothing to store.
    let mut m = valid();
    m.tensors.push(TensorMeta {
        key: "empty".into(),
        dtype: DType::F32,
        global_shape: vec![0, 4].into(),
        chunks: vec![],
    });
    Metadata::decode(&m.encode(), FILE).expect("an empty tensor needs no chunks");
}

/// Tensors and objects are sorted by key, each key once: a reader refuses a repeated key
/// and one out of order, naming it.
#[test]
fn keys_out_of_order_or_repeated_are_rejected() {
    let mut m = valid();
    m.tensors.swap(0, 1);
    let e = rejects(&m, "tensors[1].key");
    assert!(e.contains("out of order"), "{e}");
    let mut m = valid();
    m.tensors[1].key = m.tensors[0].key.clone();
    let e = rejects(&m, "tensors[1].key");
    assert!(e.contains("appears twice"), "{e}");
    let mut m = valid();
    let o = m.objects[0].clone();
    m.objects.push(o);
    let e = rejects(&m, "objects[1].key");
    assert!(e.contains("appears twice"), "{e}");
}

/// MessagePack markers that declare the largest lengths.
const HUGE: [&[u8]; 5] = [
    b"\xdd\xff\xff\xff\xff", // array32
    b"\xdf\xff\xff\xff\xff", // map32
    b"\xc6\xff\xff\xff\xff", // bin32
    b"\xdb\xff\xff\xff\xff", // str32
    b"\xdc\xff\xff",         // array16
];

#[test]
fn huge_declared_lengths_do_not_allocate() {
    // The decoder reserves at most 1024 elements of a list before reading them.
    let limit = (1 << 20) + 1;
    // In the prefix.
    let mut b = saved_metadata().to_vec();
    b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let (r, peak) = peak_alloc(|| decode_checked(&b));
    assert_eq!(r.expect_err("huge body length").field(), "body_length");
    assert!(peak < limit, "{peak} bytes allocated");
    // In the body: replace every value after each field name by a huge length marker.
    let body = body();
    let names: [&[u8]; 8] =
        [b"files", b"tensors", b"objects", b"crc32", b"chunks", b"layout", b"save_id", b"global_shape"];
    for name in names {
        let at = body.windows(name.len()).position(|w| w == name).expect("field present") + name.len();
        for marker in HUGE {
            let mut nb = body[..at].to_vec();
            nb.extend_from_slice(marker);
            nb.extend_from_slice(&body[at..]);
            let (r, peak) = peak_alloc(|| decode_checked(&frame(&nb)));
            let e = r.expect_err("a huge length must be rejected");
            assert!(peak < limit, "{}: {marker:02x?}: {peak} bytes allocated; {e}", String::from_utf8_lossy(name));
            assert!(matches!(e.kind(), FormatErrorKind::Malformed { .. }), "{e:?}");
        }
    }
}

#[test]
fn declared_lengths_backed_by_filler_reserve_little() {
    // Nested lists each declaring a million elements, with a million bytes behind them: any
    // reader that reserves what a length declares would ask for hundreds of MiB here. A
    // tensor takes 37 bytes at least, so a million of them cannot be in a million bytes.
    let n: u32 = 1 << 20;
    let nested = |names: &[(&str, u32)]| {
        let mut body = Vec::new();
        for (name, n) in names {
            body.push(0x81);
            body.push(0xa0 | name.len() as u8);
            body.extend_from_slice(name.as_bytes());
            body.push(0xdd);
            body.extend_from_slice(&n.to_be_bytes());
        }
        body.extend(std::iter::repeat_n(0xc0, n as usize));
        frame(&body)
    };
    let file = nested(&[("tensors", n), ("chunks", n), ("offset", n)]);
    let (r, peak) = peak_alloc(|| decode_checked(&file));
    let e = r.expect_err("a million tensors in a million bytes");
    assert!(peak <= 1 << 10, "{peak} bytes allocated; {e}");
    assert_eq!(e.field(), "tensors", "{e}");
    assert!(matches!(e.kind(), FormatErrorKind::Malformed { .. }), "{e:?}");
    // A million dimensions do fit in a million bytes: the list is reserved exactly, 8 bytes
    // an integer, within the bound docs/format.md states (8 times the file).
    let file = nested(&[("tensors", 1), ("global_shape", n)]);
    let (r, peak) = peak_alloc(|| decode_checked(&file));
    let e = r.expect_err("nils are not dimensions");
    assert_eq!(e.field(), "tensors[0].global_shape[0]", "{e}");
    assert!(peak <= 8 * n as usize && peak <= 8 * file.len(), "{peak} bytes allocated; {e}");
}

#[derive(Debug, Clone)]
enum Mutation {
    Truncate(usize),
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), 1..=255u8).prop_map(|(i, x)| Mutation::Flip(i, x)),
        (any::<usize>(), prop_oneof![Just(0u8), Just(0xff), Just(0xc1), Just(0xdd), Just(0x7f), any::<u8>()])
            .prop_map(|(i, x)| Mutation::Set(i, x)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..9)).prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<usize>(), 1..16usize).prop_map(|(i, n)| Mutation::Remove(i, n)),
    ]
}

fn apply(mut b: Vec<u8>, m: &Mutation) -> Vec<u8> {
    let at = |i: usize, n: usize| if n == 0 { 0 } else { i % n };
    match m {
        Mutation::Truncate(i) => b.truncate(at(*i, b.len())),
        Mutation::Flip(i, x) if !b.is_empty() => {
            let i = at(*i, b.len());
            b[i] ^= x;
        }
        Mutation::Set(i, x) if !b.is_empty() => {
            let i = at(*i, b.len());
            b[i] = *x;
        }
        Mutation::Insert(i, v) => {
            let i = at(*i, b.len() + 1);
            b.splice(i..i, v.iter().copied());
        }
        Mutation::Remove(i, n) if !b.is_empty() => {
            let i = at(*i, b.len());
            b.drain(i..(i + n).min(b.len()));
        }
        _ => {}
    }
    b
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512), magic in any::<bool>()) {
        let mut b = bytes;
        if magic && b.len() >= 24 {
            b[..16].copy_from_slice(&saved_metadata()[..16]);
        }
        prop_assert!(decode_checked(&b).is_err());
        // The same bytes as a body with valid framing reach the MessagePack decoder.
        let _ = decode_checked(&frame(&b));
    }

    #[test]
    fn mutated_files_never_panic(muts in prop::collection::vec(mutation(), 1..4)) {
        let good = saved_metadata().to_vec();
        let raw = muts.iter().fold(good, apply);
        if raw != saved_metadata() {
            // Without a CRC fix-up any change is damage.
            prop_assert!(decode_checked(&raw).is_err());
        }
        // With the framing repaired, the body parser and the semantic checks see the change.
        let body = muts.iter().fold(body().to_vec(), apply);
        let (r, peak) = peak_alloc(|| decode_checked(&frame(&body)));
        prop_assert!(peak <= 1 << 20, "{} bytes allocated", peak);
        if let Ok(m) = r {
            // Whatever decodes passed validation: re-encoding gives a file that decodes the same.
            prop_assert_eq!(Metadata::decode(&m.encode(), FILE), Ok(m));
        }
    }
}

#[test]
fn hand_built_metadata_decodes() {
    // The smallest sound checkpoint: one file, one tensor in one chunk, one object.
    let m = Metadata {
        format_version: 1,
        save_id: "0123456789abcdef".into(),
        writer: "test".into(),
        block_bytes: 4,
        layout: Default::default(),
        files: vec![FileMeta {
            name: "0123456789abcdef-00000.safetensors".into(),
            bytes: 8 + 8 + 12,
            data_start: 16,
            header_crc32: 0,
        }],
        tensors: vec![TensorMeta {
            key: "w".into(),
            dtype: DType::U8,
            global_shape: vec![2, 5].into(),
            chunks: vec![ChunkMeta {
                offset: vec![0, 0].into(),
                shape: vec![2, 5].into(),
                flat: None,
                file: 0,
                at: 16,
                crc32: vec![0; 12],
            }],
        }],
        objects: vec![ObjectMeta {
            key: "o".into(),
            grid_shape: vec![],
            entries: vec![ObjectEntry { grid_offset: vec![], file: 0, at: 26, len: 2, crc32: vec![0; 4] }],
        }],
    };
    assert_eq!(Metadata::decode(&m.encode(), FILE), Ok(m.clone()));
    let mut bad = m.clone();
    bad.files[0].bytes -= 1; // the object now ends past the file
    rejects(&bad, "objects[0] (o).entries[0].at");
    let mut gap = m;
    gap.objects[0].entries[0].at += 1; // a byte between the chunk and the object
    gap.files[0].bytes += 1;
    rejects(&gap, "files[0]");
}

/// A body as another MessagePack library (or a newer dckpt) may write it decodes to the same
/// metadata: a field this version does not know, and a number in a wider signed encoding.
#[test]
fn other_writers_encodings_decode_the_same() {
    let body = body();
    assert_eq!(body[0], 0x88, "eight fields");
    let at = body.windows(12).position(|w| w == b"\xabblock_bytes").expect("block_bytes") + 12;
    assert_eq!(body[at], 16, "block_bytes 16 as a fixint");
    let mut other = vec![0x89];
    other.extend_from_slice(&body[1..at]);
    other.push(0xd3);
    other.extend_from_slice(&16i64.to_be_bytes());
    other.extend_from_slice(&body[at + 1..]);
    other.extend_from_slice(b"\xa6future\x92\xc3\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00");
    assert_eq!(Metadata::decode(&frame(&other), FILE), Ok(valid()));
    // The same field written twice is not a newer writer's: it is refused.
    let mut twice = other.clone();
    twice[0] = 0x8a;
    twice.extend_from_slice(b"\xa6writer\xa1x");
    let e = Metadata::decode(&frame(&twice), FILE).unwrap_err();
    assert_eq!(e.field(), "writer", "{e}");
    assert!(matches!(e.kind(), FormatErrorKind::Malformed { .. }), "{e:?}");
}
