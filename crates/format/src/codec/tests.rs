//! The codec against serde (`rmp-serde`), the oracle: the writer gives serde's bytes, the
//! reader gives serde's value for every encoding of it, and refuses with a path what it
//! refuses.

use std::collections::BTreeMap;

use dckpt_shard_spec::DType;
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use serde::{Deserialize, Serialize};

use super::reader::msgpack_value_len;
use super::{LAYOUT_ENTRIES_MAX, read_files, read_metadata};
use crate::error::{FormatError, FormatErrorKind};
use crate::frame::{FORMAT_VERSION, META_PREFIX_BYTES};
use crate::meta::{ChunkMeta, FileMeta, Metadata, ObjectEntry, ObjectMeta, TensorMeta};

fn by_serde(body: &[u8]) -> Result<Metadata, rmp_serde::decode::Error> {
    Metadata::deserialize(&mut rmp_serde::Deserializer::from_read_ref(body))
}

fn read(body: &[u8]) -> Result<Metadata, FormatError> {
    read_metadata(body).map_err(|e| e.into_error("m"))
}

fn files_of(body: &[u8]) -> Result<(u32, Vec<FileMeta>), FormatError> {
    read_files(body).map_err(|e| e.into_error("m"))
}

/// The body of dckpt's own encoding.
fn ours(m: &Metadata) -> Vec<u8> {
    let file = m.encode();
    file[META_PREFIX_BYTES..file.len() - 4].to_vec()
}

fn text() -> impl Strategy<Value = String> {
    "[a-z0-9._é☃-]{0,40}"
}

fn numbers() -> impl Strategy<Value = Vec<u64>> {
    // Every width of MessagePack unsigned integer.
    vec(prop_oneof![0..128u64, 128..70_000u64, any::<u32>().prop_map(u64::from), any::<u64>()], 0..4)
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![vec(any::<u8>(), 0..12), vec(any::<u8>(), 250..300)]
}

fn metadata_values() -> impl Strategy<Value = Metadata> {
    let chunk = (numbers(), numbers(), proptest::option::of(any::<[u64; 2]>()), any::<u32>(), any::<u64>(), bytes())
        .prop_map(|(offset, shape, flat, file, at, crc32)| ChunkMeta {
            offset: offset.into(),
            shape: shape.into(),
            flat,
            file,
            at,
            crc32,
        });
    let tensor = (text(), proptest::sample::select(DType::ALL.to_vec()), numbers(), vec(chunk, 0..3)).prop_map(
        |(key, dtype, global_shape, chunks)| TensorMeta { key, dtype, global_shape: global_shape.into(), chunks },
    );
    let entry = (numbers(), any::<u32>(), any::<u64>(), any::<u64>(), bytes())
        .prop_map(|(grid_offset, file, at, len, crc32)| ObjectEntry { grid_offset, file, at, len, crc32 });
    let object = (text(), numbers(), vec(entry, 0..3)).prop_map(|(key, grid_shape, entries)| ObjectMeta {
        key,
        grid_shape,
        entries,
    });
    let file = (text(), any::<u64>(), any::<u64>(), any::<u32>())
        .prop_map(|(name, bytes, data_start, header_crc32)| FileMeta { name, bytes, data_start, header_crc32 });
    (
        any::<u32>(),
        (text(), text(), any::<u64>()),
        btree_map(text(), text(), 0..3),
        vec(file, 0..3),
        vec(tensor, 0..20),
        vec(object, 0..3),
    )
        .prop_map(|(format_version, (save_id, writer, block_bytes), layout, files, tensors, objects)| Metadata {
            format_version,
            save_id,
            writer,
            block_bytes,
            layout,
            files,
            tensors,
            objects,
        })
}

/// A MessagePack value, as far as these tests take dckpt's bodies apart and put them back
/// together in other encodings.
#[derive(Clone, Debug)]
enum V {
    UInt(u64),
    Str(Vec<u8>),
    Bin(Vec<u8>),
    Array(Vec<V>),
    Map(Vec<(V, V)>),
    /// Written as these bytes (anything dckpt does not write: nil, a negative or float
    /// number, an extension, a broken value).
    Raw(Vec<u8>),
}

impl V {
    /// The value at the start of `b` (one dckpt wrote), and its length.
    fn parse(b: &[u8]) -> (V, usize) {
        let be = |at: usize, n: usize| b[at..at + n].iter().fold(0u64, |v, &x| v << 8 | u64::from(x)) as usize;
        let m = b[0];
        let (head, n) = match m {
            0x00..=0x7f => return (V::UInt(u64::from(m)), 1),
            0xcc => return (V::UInt(be(1, 1) as u64), 2),
            0xcd => return (V::UInt(be(1, 2) as u64), 3),
            0xce => return (V::UInt(be(1, 4) as u64), 5),
            0xcf => return (V::UInt(be(1, 8) as u64), 9),
            0xa0..=0xbf => (1, usize::from(m & 0x1f)),
            0xd9 | 0xc4 => (2, be(1, 1)),
            0xda | 0xc5 => (3, be(1, 2)),
            0xdb | 0xc6 => (5, be(1, 4)),
            0x90..=0x9f => (1, usize::from(m & 0x0f)),
            0xdc | 0xde => (3, be(1, 2)),
            0xdd | 0xdf => (5, be(1, 4)),
            0x80..=0x8f => (1, usize::from(m & 0x0f)),
            _ => panic!("dckpt does not write marker {m:#04x}"),
        };
        match m {
            0xa0..=0xbf | 0xd9..=0xdb => (V::Str(b[head..head + n].to_vec()), head + n),
            0xc4..=0xc6 => (V::Bin(b[head..head + n].to_vec()), head + n),
            0x90..=0x9f | 0xdc | 0xdd => {
                let mut at = head;
                let items = (0..n)
                    .map(|_| {
                        let (v, len) = V::parse(&b[at..]);
                        at += len;
                        v
                    })
                    .collect();
                (V::Array(items), at)
            }
            _ => {
                let mut at = head;
                let entries = (0..n)
                    .map(|_| {
                        let (k, len) = V::parse(&b[at..]);
                        at += len;
                        let (v, len) = V::parse(&b[at..]);
                        at += len;
                        (k, v)
                    })
                    .collect();
                (V::Map(entries), at)
            }
        }
    }

    fn of(m: &Metadata) -> V {
        let body = ours(m);
        let (v, n) = V::parse(&body);
        assert_eq!(n, body.len());
        assert_eq!(v.bytes(), body, "taken apart and put together as dckpt writes it");
        v
    }

    fn str(s: &str) -> V {
        V::Str(s.as_bytes().to_vec())
    }

    /// The value of field `name` of a map.
    fn field(&mut self, name: &str) -> &mut V {
        let V::Map(entries) = self else { panic!("not a map: {self:?}") };
        entries.iter_mut().find(|(k, _)| matches!(k, V::Str(s) if s == name.as_bytes())).map(|e| &mut e.1).unwrap()
    }

    fn idx(&mut self, i: usize) -> &mut V {
        let V::Array(items) = self else { panic!("not an array: {self:?}") };
        &mut items[i]
    }

    fn entries(&mut self) -> &mut Vec<(V, V)> {
        let V::Map(entries) = self else { panic!("not a map: {self:?}") };
        entries
    }

    /// In the smallest encodings, as dckpt writes.
    fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.emit(&mut out, &mut None, true);
        out
    }

    /// Appends the value; with `rng`, each number and length in a random one of the
    /// encodings that hold it, struct fields shuffled and unknown fields added.
    fn emit(&self, out: &mut Vec<u8>, rng: &mut Option<Rng>, is_struct: bool) {
        match self {
            V::UInt(v) => {
                let v = *v;
                let mut forms: Vec<(u8, usize)> = vec![(0xcf, 8)];
                if v < 128 {
                    forms.extend([(0x00, 0), (0xd0, 1)]);
                }
                if v < 1 << 8 {
                    forms.push((0xcc, 1));
                }
                if v < 1 << 15 {
                    forms.push((0xd1, 2));
                }
                if v < 1 << 16 {
                    forms.push((0xcd, 2));
                }
                if v < 1 << 31 {
                    forms.push((0xd2, 4));
                }
                if v < 1 << 32 {
                    forms.push((0xce, 4));
                }
                if v < 1 << 63 {
                    forms.push((0xd3, 8));
                }
                let (m, n) = match rng {
                    Some(r) => forms[r.below(forms.len())],
                    None => *forms.iter().min_by_key(|f| (f.1, f.0 >= 0xd0, f.0)).unwrap(),
                };
                if n == 0 {
                    out.push(v as u8);
                } else {
                    out.push(m);
                    out.extend_from_slice(&v.to_be_bytes()[8 - n..]);
                }
            }
            V::Str(s) => {
                head(out, rng, s.len(), Some((0xa0, 32)), [0xd9, 0xda, 0xdb]);
                out.extend_from_slice(s);
            }
            V::Bin(b) => {
                head(out, rng, b.len(), None, [0xc4, 0xc5, 0xc6]);
                out.extend_from_slice(b);
            }
            V::Array(items) => {
                head(out, rng, items.len(), Some((0x90, 16)), [0, 0xdc, 0xdd]);
                for v in items {
                    v.emit(out, rng, true);
                }
            }
            V::Map(entries) => {
                let mut entries = entries.clone();
                if let Some(r) = rng.as_mut().filter(|_| is_struct) {
                    for _ in 0..r.below(3) {
                        let name = format!("future_{}", r.below(1000));
                        entries.push((V::Str(name.into_bytes()), r.unknown_value(2)));
                    }
                    let is_chunk = entries.iter().any(|(k, _)| matches!(k, V::Str(s) if s == b"offset"));
                    if is_chunk
                        && !entries.iter().any(|(k, _)| matches!(k, V::Str(s) if s == b"flat"))
                        && r.below(2) == 0
                    {
                        entries.push((V::str("flat"), V::Raw(vec![0xc0])));
                    }
                    r.shuffle(&mut entries);
                }
                head(out, rng, entries.len(), Some((0x80, 16)), [0, 0xde, 0xdf]);
                for (k, v) in &entries {
                    k.emit(out, rng, true);
                    // The layout is a string map, not a struct: no fields to add there.
                    let layout = matches!(k, V::Str(s) if s == b"layout");
                    v.emit(out, rng, !layout);
                }
            }
            V::Raw(b) => out.extend_from_slice(b),
        }
    }
}

/// A length's marker: the fix form `(marker, limit)` when there is one and it holds `n`,
/// else one of the sized markers (8, 16, 32 bits; 0 for none) that holds it.
fn head(out: &mut Vec<u8>, rng: &mut Option<Rng>, n: usize, fix: Option<(u8, usize)>, sized: [u8; 3]) {
    let mut forms: Vec<(u8, usize)> = Vec::new();
    if let Some((m, limit)) = fix.filter(|&(_, limit)| n < limit) {
        forms.push((m | n as u8, 0));
        let _ = limit;
    }
    for (m, bytes) in sized.into_iter().zip([1, 2, 4]) {
        if m != 0 && (bytes == 4 || n < 1 << (8 * bytes)) {
            forms.push((m, bytes));
        }
    }
    let (m, bytes) = match rng {
        Some(r) => forms[r.below(forms.len())],
        None => forms[0],
    };
    out.push(m);
    out.extend_from_slice(&(n as u32).to_be_bytes()[4 - bytes..]);
}

/// xorshift: the test's choices, from one seed proptest gives.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }

    /// Any MessagePack value, of kinds dckpt never writes too.
    fn unknown_value(&mut self, depth: usize) -> V {
        let raw: &[&[u8]] = &[
            b"\xc0",
            b"\xc2",
            b"\xc3",
            b"\xff",
            b"\xd0\x80",
            b"\xd3\xff\xff\xff\xff\xff\xff\xff\xfe",
            b"\xca\x3f\x80\x00\x00",
            b"\xcb\x40\x09\x21\xfb\x54\x44\x2d\x18",
            b"\xd4\x01\x02",
            b"\xd8\x05\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f",
            b"\xc7\x03\x09abc",
            b"\xc9\x00\x00\x00\x01\x09z",
        ];
        match self.below(if depth == 0 { 4 } else { 6 }) {
            0 => V::Raw(raw[self.below(raw.len())].to_vec()),
            1 => V::UInt(self.0 >> self.below(64)),
            2 => V::Str(format!("s{}", self.below(100)).into_bytes()),
            3 => V::Bin(vec![7; self.below(300)]),
            4 => V::Array((0..self.below(4)).map(|_| self.unknown_value(depth - 1)).collect()),
            _ => V::Map((0..self.below(4)).map(|_| (self.unknown_value(0), self.unknown_value(depth - 1))).collect()),
        }
    }
}

/// `m`'s body in random other encodings of the same value.
fn reencoded(m: &Metadata, seed: u64) -> Vec<u8> {
    let mut out = Vec::new();
    V::of(m).emit(&mut out, &mut Some(Rng(seed | 1)), true);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    /// dckpt writes serde's bytes, and reads them back, and reads serde's.
    #[test]
    fn writes_serde_bytes_and_reads_them(m in metadata_values()) {
        prop_assert_eq!(ours(&m), rmp_serde::to_vec_named(&m).unwrap());
        prop_assert_eq!(read(&ours(&m)), Ok(m.clone()));
        prop_assert_eq!(read(&rmp_serde::to_vec_named(&m).unwrap()), Ok(m.clone()));
        prop_assert_eq!(files_of(&ours(&m)), Ok((m.format_version, m.files)));
    }

    /// Every other encoding of the same value (any integer width, signed forms of
    /// non-negative numbers, any string, binary, array and map width, fields in any order,
    /// unknown fields of any kind, `flat` as nil) reads as that value, as serde reads it.
    #[test]
    fn reads_every_encoding_of_a_value_as_serde_does(m in metadata_values(), seed in any::<u64>()) {
        let body = reencoded(&m, seed);
        prop_assert_eq!(by_serde(&body).ok(), Some(m.clone()), "the oracle reads it");
        prop_assert_eq!(read(&body), Ok(m.clone()));
        prop_assert_eq!(files_of(&body), Ok((m.format_version, m.files)));
    }

    /// Damaged bodies never panic; whatever the reader returns for them, serde returns too
    /// (it refuses more, never accepts something else); the file list agrees with a whole
    /// read.
    #[test]
    fn damaged_bodies_read_as_serde_reads_them_or_not_at_all(
        m in metadata_values(),
        seed in any::<u64>(),
        edits in vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..4),
    ) {
        let mut body = if seed % 2 == 0 { ours(&m) } else { reencoded(&m, seed) };
        for (at, byte, how) in edits {
            let i = at.index(body.len() + 1);
            match how {
                0 if i < body.len() => body[i] = byte,
                1 => body.insert(i, byte),
                _ => body.truncate(i),
            }
        }
        let whole = std::panic::catch_unwind(|| read(&body)).expect("no panic");
        let files = std::panic::catch_unwind(|| files_of(&body)).expect("no panic");
        match &whole {
            Ok(fast) => {
                prop_assert_eq!(by_serde(&body).ok(), Some(fast.clone()));
                prop_assert_eq!(files, Ok((fast.format_version, fast.files.clone())));
            }
            Err(e) => {
                prop_assert!(matches!(e.kind(), FormatErrorKind::Malformed { .. }), "{:?}", e);
                let FormatErrorKind::Malformed { offset, .. } = e.kind() else { unreachable!() };
                prop_assert!(*offset as usize <= META_PREFIX_BYTES + body.len(), "{}", e);
            }
        }
    }
}

fn sample() -> Metadata {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut m = proptest::strategy::ValueTree::current(&metadata_values().new_tree(&mut runner).unwrap());
    m.block_bytes = 1 << 40;
    m.tensors.insert(
        0,
        TensorMeta {
            key: "w".into(),
            dtype: DType::Bf16,
            global_shape: vec![4, 300].into(),
            chunks: vec![ChunkMeta {
                offset: vec![0, 0].into(),
                shape: vec![4, 300].into(),
                flat: None,
                file: 0,
                at: 80,
                crc32: vec![9; 4],
            }],
        },
    );
    m.files.insert(0, FileMeta { name: "f".into(), bytes: 2480, data_start: 80, header_crc32: 7 });
    m.layout.insert("tp".into(), "2".into());
    m
}

/// Every length and number at the edges of its encodings, written as serde writes it.
#[test]
fn writes_every_size_class_as_serde_does() {
    let mut m = sample();
    let edges = [0usize, 15, 16, 31, 32, 255, 256, 65_535, 65_536, 70_000];
    m.layout = (0..70_000).map(|i| (format!("k{i}"), "v".repeat(edges[i % edges.len()] % 300))).collect();
    m.writer = "w".repeat(70_000);
    m.tensors.last_mut().unwrap().chunks = edges
        .iter()
        .map(|&n| ChunkMeta {
            offset: vec![n as u64; if n > 65_536 { n } else { n % 20 }].into(),
            shape: [0, 127, 128, 255, 256, 65_535, 65_536, u32::MAX as u64, 1 << 32, u64::MAX].to_vec().into(),
            flat: (n % 2 == 0).then_some([n as u64, u64::MAX]),
            file: u32::MAX,
            at: n as u64,
            crc32: vec![7; n],
        })
        .collect();
    m.files = edges
        .iter()
        .map(|&n| FileMeta { name: "f".repeat(n), bytes: n as u64, data_start: 8, header_crc32: n as u32 })
        .collect();
    for n in edges {
        let layout = m.layout.iter().take(n).map(|(k, v)| (k.clone(), v.clone())).collect();
        let m = Metadata { layout, ..m.clone() };
        assert_eq!(ours(&m), rmp_serde::to_vec_named(&m).unwrap(), "a layout of {n}");
        assert_eq!(read(&ours(&m)), Ok(m.clone()));
        assert_eq!(read(&reencoded(&m, n as u64)), Ok(m));
    }
}

/// A field a newer writer adds, at every level and of every kind, is skipped.
#[test]
fn unknown_fields_are_skipped_at_every_level() {
    let m = sample();
    /// Values of kinds dckpt never writes.
    type Future = (Vec<u8>, f64, i64, Option<u8>, BTreeMap<String, Vec<bool>>);
    #[derive(Serialize)]
    struct Newer<'a> {
        #[serde(flatten)]
        m: &'a Metadata,
        future: Future,
    }
    let future = (vec![1, 2], 1.5, -7, None, BTreeMap::from([("x".into(), vec![true])]));
    let newer = rmp_serde::to_vec_named(&Newer { m: &m, future }).unwrap();
    assert_eq!(read(&newer), Ok(m.clone()));
    let mut v = V::of(&m);
    let junk = || (V::str("zz"), V::Raw(b"\x92\xcb\x40\x09\x21\xfb\x54\x44\x2d\x18\xd4\x01\x02".to_vec()));
    v.field("files").idx(0).entries().insert(0, junk());
    v.field("tensors").idx(0).entries().push(junk());
    v.field("tensors").idx(0).field("chunks").idx(0).entries().push(junk());
    assert_eq!(read(&v.bytes()), Ok(m.clone()));
    assert_eq!(by_serde(&v.bytes()).ok(), Some(m));
}

/// A body changed at one place by `edit` must be refused at `field` with a detail that
/// says `why`; the offset points into the body. Returns the error.
fn refused(edit: impl FnOnce(&mut V), field: &str, why: &str) -> FormatError {
    let mut v = V::of(&sample());
    edit(&mut v);
    let body = v.bytes();
    let e = read(&body).expect_err("refused");
    assert_eq!(e.field(), field, "{e}");
    let FormatErrorKind::Malformed { detail, offset } = e.kind() else { panic!("not malformed: {e:?}") };
    assert!(detail.contains(why), "expected {why:?}: {e}");
    assert!((*offset as usize) < META_PREFIX_BYTES + body.len() + 1, "{e}");
    assert_eq!(e.to_string(), format!("m: {field}: {detail} (at byte {offset})"));
    e
}

/// Each field has the one MessagePack type docs/format.md gives it: a reader built on a
/// generic decoder (serde's takes a dtype's variant index, a byte list as an array, a string
/// as bin) must not accept more than the format says.
#[test]
fn fields_take_only_the_type_the_spec_gives_them() {
    refused(|v| *v.field("tensors").idx(0).field("dtype") = V::UInt(8), "tensors[0].dtype", "expected a string");
    refused(
        |v| {
            let four = vec![V::UInt(1), V::UInt(2), V::UInt(3), V::UInt(4)];
            *v.field("tensors").idx(0).field("chunks").idx(0).field("crc32") = V::Array(four)
        },
        "tensors[0].chunks[0].crc32",
        "expected binary, found an array",
    );
    refused(
        |v| *v.field("objects").idx(0).field("entries").idx(0).field("crc32") = V::Array(vec![]),
        "objects[0].entries[0].crc32",
        "expected binary, found an array",
    );
    refused(
        |v| *v.field("files").idx(0).field("name") = V::Bin(b"f".to_vec()),
        "files[0].name",
        "expected a string, found binary",
    );
    refused(
        |v| *v.field("save_id") = V::Bin(b"0123456789abcdef".to_vec()),
        "save_id",
        "expected a string, found binary",
    );
    refused(|v| *v.field("tensors").idx(0).field("key") = V::Bin(b"w".to_vec()), "tensors[0].key", "expected a string");
    refused(|v| *v.field("block_bytes") = V::Raw(vec![0xc3]), "block_bytes", "found a boolean");
    refused(
        |v| *v.field("tensors").idx(0).field("global_shape") = V::Bin(vec![]),
        "tensors[0].global_shape",
        "expected an array",
    );
}

#[test]
fn the_layout_has_a_limit() {
    let layout = |n: usize| (0..n).map(|i| (format!("{i:x}"), String::new())).collect();
    let mut m = sample();
    m.layout = layout(LAYOUT_ENTRIES_MAX);
    assert_eq!(read(&ours(&m)), Ok(m.clone()));
    m.layout = layout(LAYOUT_ENTRIES_MAX + 1);
    let e = read(&ours(&m)).unwrap_err();
    assert_eq!(e.field(), "layout", "{e}");
    assert_eq!(
        e.kind(),
        &FormatErrorKind::LimitExceeded {
            what: "layout entries".into(),
            found: LAYOUT_ENTRIES_MAX as u64 + 1,
            limit: LAYOUT_ENTRIES_MAX as u64
        }
    );
}

#[test]
fn refusals_name_the_path_of_the_field() {
    let e = refused(
        |v| *v.field("tensors").idx(0).field("chunks").idx(0).field("offset").idx(1) = V::Raw(vec![0xff]),
        "tensors[0].chunks[0].offset[1]",
        "-1 is negative",
    );
    // The offset is the file's: the prefix, then the body up to the marker.
    let FormatErrorKind::Malformed { offset, .. } = e.kind() else { unreachable!() };
    let mut v = V::of(&sample());
    *v.field("tensors").idx(0).field("chunks").idx(0).field("offset").idx(1) = V::Raw(vec![0xff]);
    assert_eq!(v.bytes()[*offset as usize - META_PREFIX_BYTES], 0xff);
    refused(
        |v| *v.field("tensors").idx(0).field("chunks").idx(0).field("at") = V::Raw(b"\xd3\x80\0\0\0\0\0\0\0".to_vec()),
        "tensors[0].chunks[0].at",
        "-9223372036854775808 is negative",
    );
    refused(|v| *v.field("files").idx(0).field("header_crc32") = V::UInt(1 << 32), "files[0].header_crc32", "32 bits");
    refused(|v| *v.field("block_bytes") = V::Raw(b"\xcb\0\0\0\0\0\0\0\0".to_vec()), "block_bytes", "found a float");
    refused(
        |v| *v.field("tensors").idx(0).field("dtype") = V::str("fp32"),
        "tensors[0].dtype",
        "unknown dtype \"fp32\"",
    );
    refused(|v| *v.field("tensors").idx(0).field("key") = V::Str(vec![0xff]), "tensors[0].key", "not UTF-8");
    refused(
        |v| *v.field("tensors").idx(0).field("chunks").idx(0).field("crc32") = V::Str(b"abcd".to_vec()),
        "tensors[0].chunks[0].crc32",
        "expected binary, found a string",
    );
    refused(
        |v| *v.field("tensors").idx(0).field("chunks").idx(0).field("offset") = V::Raw(vec![0xc0]),
        "tensors[0].chunks[0].offset",
        "expected an array, found nil",
    );
    refused(
        |v| {
            *v.field("tensors").idx(0).field("chunks").idx(0).entries().last_mut().unwrap() =
                (V::str("flat"), V::UInt(3))
        },
        "tensors[0].chunks[0].flat",
        "expected an array",
    );
    refused(
        |v| {
            let c = v.field("tensors").idx(0).field("chunks").idx(0);
            c.entries().push((V::str("flat"), V::Array(vec![V::UInt(1), V::UInt(2), V::UInt(3)])));
        },
        "tensors[0].chunks[0].flat",
        "expected [start, stop], found an array of 3 items",
    );
    // A struct written as an array (serde's compact form) is not the format.
    refused(
        |v| {
            let f = v.field("files").idx(0);
            *f = V::Array(f.entries().iter().map(|e| e.1.clone()).collect());
        },
        "files[0]",
        "expected a map with named fields, found an array",
    );
    refused(
        |v| {
            v.field("tensors")
                .idx(0)
                .field("chunks")
                .idx(0)
                .entries()
                .retain(|(k, _)| !matches!(k, V::Str(s) if s == b"at"))
        },
        "tensors[0].chunks[0].at",
        "missing",
    );
    refused(|v| v.entries().retain(|(k, _)| !matches!(k, V::Str(s) if s == b"objects")), "objects", "missing");
    refused(|v| v.entries().push((V::str("writer"), V::str("x"))), "writer", "appears twice");
    refused(
        |v| {
            let f = v.field("files").idx(0);
            f.entries().push((V::str("name"), V::str("g")));
        },
        "files[0].name",
        "appears twice",
    );
    refused(|v| v.field("layout").entries().push((V::str("tp"), V::str("4"))), "layout", "\"tp\" appears twice");
    refused(|v| *v.field("layout").field("tp") = V::UInt(2), "layout.tp", "expected a string");
    refused(
        |v| v.entries().push((V::UInt(0), V::UInt(1))),
        "body",
        "expected a field name (a string), found an unsigned",
    );
    refused(|v| v.entries().push((V::str("future"), V::Raw(vec![0xc1]))), "future", "not MessagePack");
    refused(|v| v.entries().push((V::str("future"), V::Raw(vec![0x92, 0x01]))), "future", "truncated");
    refused(|v| *v = V::Array(vec![]), "body", "expected a map with named fields");
    refused(|v| *v.field("files") = V::Raw(b"\xdd\xff\xff\xff\xff".to_vec()), "files", "an array of 4294967295 items");
    refused(|v| *v.field("layout") = V::Raw(b"\xdf\x00\x01\x00\x00".to_vec()), "layout", "a map of 65536 entries");
    refused(|v| *v.field("save_id") = V::Raw(b"\xdb\xff\xff\xff\xff".to_vec()), "save_id", "4294967295 bytes declared");
}

#[test]
fn a_body_is_one_value_and_nothing_after_it() {
    let body = ours(&sample());
    let mut longer = body.clone();
    longer.push(0xc0);
    let e = read(&longer).unwrap_err();
    assert_eq!(e.field(), "body");
    assert!(e.to_string().contains("1 bytes follow the metadata"), "{e}");
    for cut in [0, 1, body.len() / 2, body.len() - 1] {
        let e = read(&body[..cut]).expect_err("cut short");
        assert!(matches!(e.kind(), FormatErrorKind::Malformed { .. }), "{e}");
    }
    assert!(read(&[]).unwrap_err().to_string().contains("ends inside a value"));
}

/// The file list is read without the tensors: what follows it is not decoded.
#[test]
fn the_file_list_is_read_alone() {
    let m = sample();
    let body = ours(&m);
    let at = body.windows(8).position(|w| w == b"\xa7tensors").unwrap();
    assert_eq!(files_of(&body[..at]), Ok((m.format_version, m.files.clone())), "the rest is not read");
    let mut v = V::of(&m);
    v.entries().retain(|(k, _)| !matches!(k, V::Str(s) if s == b"files"));
    let e = files_of(&v.bytes()).unwrap_err();
    assert_eq!((e.field(), e.kind().to_string().contains("missing")), ("files", true), "{e}");
    let mut v = V::of(&m);
    v.entries().insert(1, (V::str("format_version"), V::UInt(1)));
    assert_eq!(files_of(&v.bytes()).unwrap_err().field(), "format_version", "repeated before the files");
    let mut v = V::of(&m);
    *v.field("files").idx(0).field("bytes") = V::str("x");
    assert_eq!(files_of(&v.bytes()).unwrap_err().field(), "files[0].bytes");
}

#[test]
fn msgpack_value_len_measures_every_kind_of_value() {
    let long: Vec<u64> = (0..70_000).map(|i| i * 977).collect();
    let map: BTreeMap<String, i64> = (0..20).map(|i| (format!("k{i}"), -i * 1000)).collect();
    let values: Vec<Vec<u8>> = vec![
        rmp_serde::to_vec(&0u8).unwrap(),
        rmp_serde::to_vec(&(1u8, 200u8, 60_000u16, 4_000_000_000u32, u64::MAX, -3i8, -100i8, -30_000i16)).unwrap(),
        rmp_serde::to_vec(&(-2_000_000_000i32, i64::MIN, 1.5f32, 2.5f64, true, false, None::<u8>)).unwrap(),
        rmp_serde::to_vec(&("short", "x".repeat(40), "y".repeat(300), "z".repeat(70_000))).unwrap(),
        rmp_serde::to_vec(&(serde_bytes::Bytes::new(&[1; 10]), serde_bytes::Bytes::new(&[2; 300]))).unwrap(),
        rmp_serde::to_vec(&serde_bytes::Bytes::new(&[3; 70_000])).unwrap(),
        rmp_serde::to_vec(&(&long[..15], &long[..300], &long)).unwrap(),
        rmp_serde::to_vec_named(&map).unwrap(),
        b"\xd4\x01\x02".to_vec(),
        b"\xc8\x01\x00\x07".iter().copied().chain([0; 256]).collect(),
        Metadata {
            format_version: FORMAT_VERSION,
            save_id: "0123456789abcdef".into(),
            writer: "test".into(),
            block_bytes: 64,
            layout: BTreeMap::new(),
            files: Vec::new(),
            tensors: Vec::new(),
            objects: Vec::new(),
        }
        .encode()[META_PREFIX_BYTES..]
            .to_vec(),
    ];
    for (i, v) in values.iter().enumerate() {
        // The metadata carries its CRC trailer: 4 bytes beyond the value.
        let len = if i == values.len() - 1 { v.len() - 4 } else { v.len() };
        assert_eq!(msgpack_value_len(v), Some(len), "value {i}");
        let mut longer = v.clone();
        longer.push(0xc0);
        assert_eq!(msgpack_value_len(&longer), Some(len), "value {i} and a trailing nil");
        for cut in [0, 1, len / 2, len - 1].into_iter().filter(|&c| c < len) {
            assert_eq!(msgpack_value_len(&v[..cut]), None, "value {i} cut to {cut} bytes");
        }
    }
    assert_eq!(msgpack_value_len(&[0xc1]), None);
    // An array that declares 2^32 - 1 items of which there are three.
    assert_eq!(msgpack_value_len(&[0xdd, 0xff, 0xff, 0xff, 0xff, 1, 2, 3]), None);
}
