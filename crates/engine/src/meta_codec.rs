//! The metadata body's codec, by hand: the MessagePack that `rmp_serde::to_vec_named` would
//! write for [`Metadata`], and a fast reader of it.
//!
//! **Writing** ([`write_metadata`]) produces exactly serde's bytes (maps with named fields in
//! declaration order, every number and length in its smallest encoding, `flat` left out
//! when absent) from borrowed views, so a save encodes its metadata straight from its plan.
//! A property test compares it with `rmp_serde::to_vec_named` byte for byte.
//!
//! **Reading** ([`read_metadata`]) either returns the value the serde decoder would return
//! for the same bytes, or gives up (`None`), and
//! [`crate::format::Metadata::decode_unvalidated`] then runs the serde decoder, which
//! accepts every encoding serde does and words every error. Giving up is the answer to
//! anything unusual: an unknown or repeated field, a missing one, a struct written as an
//! array, a signed or float number, an extension type, bytes left over. So the fast path can
//! only be faster, never different; a property test holds it to that. Every length is
//! checked against the bytes that remain, and a list reserves at most [`RESERVE_MAX`]
//! elements before reading them, so a declared length never allocates what the input
//! does not hold.

use std::collections::BTreeMap;

use dckpt_shard_spec::{DIMS_INLINE, DType, Dims};

use crate::format::{ChunkMeta, FileMeta, Metadata, ObjectEntry, ObjectMeta, TensorMeta};

/// [`Metadata`] borrowed for writing, with the tensors from an iterator: a save writes its
/// metadata from its plan without building a [`Metadata`] of copies.
pub(crate) struct MetadataView<'a, T> {
    pub save_id: &'a str,
    pub writer: &'a str,
    pub block_bytes: u64,
    pub layout: &'a BTreeMap<String, String>,
    pub files: &'a [FileMeta],
    /// [`TensorView`]s.
    pub tensors: T,
    pub objects: &'a [ObjectMeta],
}

/// [`TensorMeta`] borrowed; `chunks` are [`ChunkView`]s.
pub(crate) struct TensorView<'a, C> {
    pub key: &'a str,
    pub dtype: DType,
    pub global_shape: &'a [u64],
    pub chunks: C,
}

/// [`ChunkMeta`] borrowed.
pub(crate) struct ChunkView<'a> {
    pub offset: &'a [u64],
    pub shape: &'a [u64],
    pub flat: Option<[u64; 2]>,
    pub file: u32,
    pub at: u64,
    pub crc32: &'a [u8],
}

impl<'a> ChunkView<'a> {
    pub fn of(c: &'a ChunkMeta) -> ChunkView<'a> {
        ChunkView { offset: &c.offset, shape: &c.shape, flat: c.flat, file: c.file, at: c.at, crc32: &c.crc32 }
    }
}

/// Appends the body for `view` (format version `version`) to `out`.
pub(crate) fn write_metadata<'a, T, C>(out: &mut Vec<u8>, version: u32, view: MetadataView<'a, T>)
where
    T: ExactSizeIterator<Item = TensorView<'a, C>>,
    C: ExactSizeIterator<Item = ChunkView<'a>>,
{
    let w = &mut Writer(out);
    w.map(8);
    w.field("format_version").uint(u64::from(version));
    w.field("save_id").str(view.save_id);
    w.field("writer").str(view.writer);
    w.field("block_bytes").uint(view.block_bytes);
    w.field("layout").map(view.layout.len());
    for (k, v) in view.layout {
        w.str(k).str(v);
    }
    w.field("files").array(view.files.len());
    for f in view.files {
        w.map(4);
        w.field("name").str(&f.name);
        w.field("bytes").uint(f.bytes);
        w.field("data_start").uint(f.data_start);
        w.field("header_crc32").uint(u64::from(f.header_crc32));
    }
    w.field("tensors").array(view.tensors.len());
    for t in view.tensors {
        w.map(4);
        w.field("key").str(t.key);
        w.field("dtype").str(t.dtype.name());
        w.field("global_shape").uints(t.global_shape);
        w.field("chunks").array(t.chunks.len());
        for c in t.chunks {
            w.map(if c.flat.is_some() { 6 } else { 5 });
            w.field("offset").uints(c.offset);
            w.field("shape").uints(c.shape);
            if let Some(flat) = c.flat {
                w.field("flat").uints(&flat);
            }
            w.field("file").uint(u64::from(c.file));
            w.field("at").uint(c.at);
            w.field("crc32").bin(c.crc32);
        }
    }
    w.field("objects").array(view.objects.len());
    for o in view.objects {
        w.map(3);
        w.field("key").str(&o.key);
        w.field("grid_shape").uints(&o.grid_shape);
        w.field("entries").array(o.entries.len());
        for e in &o.entries {
            w.map(5);
            w.field("grid_offset").uints(&e.grid_offset);
            w.field("file").uint(u64::from(e.file));
            w.field("at").uint(e.at);
            w.field("len").uint(e.len);
            w.field("crc32").bin(&e.crc32);
        }
    }
}

/// MessagePack out, each value in its smallest encoding.
struct Writer<'o>(&'o mut Vec<u8>);

impl Writer<'_> {
    /// A marker for a length or number: the fix form when `n < fix_max`, else the smallest of
    /// the sized forms `sized` (marker, bytes) that holds it.
    fn head(&mut self, n: u64, fix: u8, fix_max: u64, sized: &[(u8, usize)]) -> &mut Self {
        if n < fix_max {
            self.0.push(fix | n as u8);
            return self;
        }
        let &(marker, bytes) =
            sized.iter().find(|(_, b)| *b == 8 || n >> (8 * b) == 0).expect("the last form holds 8 bytes");
        self.0.push(marker);
        self.0.extend_from_slice(&n.to_be_bytes()[8 - bytes..]);
        self
    }

    fn uint(&mut self, v: u64) -> &mut Self {
        self.head(v, 0x00, 0x80, &[(0xcc, 1), (0xcd, 2), (0xce, 4), (0xcf, 8)])
    }

    fn str(&mut self, s: &str) -> &mut Self {
        self.head(s.len() as u64, 0xa0, 32, &[(0xd9, 1), (0xda, 2), (0xdb, 4)]);
        self.0.extend_from_slice(s.as_bytes());
        self
    }

    fn field(&mut self, name: &str) -> &mut Self {
        self.str(name)
    }

    fn bin(&mut self, b: &[u8]) -> &mut Self {
        self.head(b.len() as u64, 0xc4, 0, &[(0xc4, 1), (0xc5, 2), (0xc6, 4)]);
        self.0.extend_from_slice(b);
        self
    }

    fn array(&mut self, n: usize) -> &mut Self {
        self.head(n as u64, 0x90, 16, &[(0xdc, 2), (0xdd, 4)])
    }

    fn map(&mut self, n: usize) -> &mut Self {
        self.head(n as u64, 0x80, 16, &[(0xde, 2), (0xdf, 4)])
    }

    fn uints(&mut self, v: &[u64]) -> &mut Self {
        self.array(v.len());
        for &x in v {
            self.uint(x);
        }
        self
    }
}

/// Gave up: the serde decoder decides.
type R<T> = Option<T>;

/// Elements of a list reserved before any is read.
const RESERVE_MAX: usize = 1024;

/// The metadata in `body` (the whole body, nothing after it), or `None` to leave it to serde.
pub(crate) fn read_metadata(body: &[u8]) -> Option<Metadata> {
    let mut r = Reader { b: body, pos: 0 };
    let m = r.metadata()?;
    (r.pos == body.len()).then_some(m)
}

/// The format version and the `files` of a body, when the files come before the tensors
/// (as dckpt writes them): reading them costs nothing per tensor. What follows the files is
/// not read (the caller has checked the framing's CRC). `None`, for a field it does not
/// know, one named twice, or files not found before the tensors, leaves it to a whole decode.
pub(crate) fn read_files(body: &[u8]) -> Option<(u32, Vec<FileMeta>)> {
    let mut r = Reader { b: body, pos: 0 };
    let (mut version, mut seen) = (None, [false; 5]);
    for _ in 0..r.map_len()? {
        let field = match r.str_bytes()? {
            b"format_version" => {
                version = Some(r.u32()?);
                0
            }
            b"save_id" => r.str_bytes().map(|_| 1)?,
            b"writer" => r.str_bytes().map(|_| 2)?,
            b"block_bytes" => r.u64().map(|_| 3)?,
            b"layout" => r.layout().map(|_| 4)?,
            b"files" => return Some((version?, r.vec(Reader::file)?)),
            _ => return None,
        };
        if std::mem::replace(&mut seen[field], true) {
            return None;
        }
    }
    None
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

/// Reads a struct's fields into one `Option` each: a field it does not know, or one named
/// twice, makes the reader give up; a missing one is left `None` for the caller to refuse.
macro_rules! fields {
    ($r:ident, $( $name:ident : $ty:ty = $read:expr ),+ $(,)?) => {{
        $( let mut $name: Option<$ty> = None; )+
        for _ in 0..$r.map_len()? {
            match $r.str_bytes()? {
                $( k if k == stringify!($name).as_bytes() && $name.is_none() => $name = Some($read), )+
                _ => return None,
            }
        }
        ($( $name, )+)
    }};
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> R<u8> {
        let m = *self.b.get(self.pos)?;
        self.pos += 1;
        Some(m)
    }

    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        let s = self.b.get(self.pos..self.pos.checked_add(n)?)?;
        self.pos += n;
        Some(s)
    }

    /// A big-endian unsigned integer of `n` bytes.
    fn be(&mut self, n: usize) -> R<u64> {
        Some(self.take(n)?.iter().fold(0u64, |v, &x| v << 8 | u64::from(x)))
    }

    fn u64(&mut self) -> R<u64> {
        match self.byte()? {
            m @ 0x00..=0x7f => Some(u64::from(m)),
            0xcc => self.be(1),
            0xcd => self.be(2),
            0xce => self.be(4),
            0xcf => self.be(8),
            _ => None,
        }
    }

    fn u32(&mut self) -> R<u32> {
        u32::try_from(self.u64()?).ok()
    }

    /// A string's bytes, not checked as UTF-8: for field names, compared with ours.
    fn str_bytes(&mut self) -> R<&'a [u8]> {
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => u64::from(m & 0x1f),
            0xd9 => self.be(1)?,
            0xda => self.be(2)?,
            0xdb => self.be(4)?,
            _ => return None,
        };
        self.take(usize::try_from(n).ok()?)
    }

    fn str(&mut self) -> R<&'a str> {
        std::str::from_utf8(self.str_bytes()?).ok()
    }

    fn string(&mut self) -> R<String> {
        self.str().map(str::to_owned)
    }

    fn bin(&mut self) -> R<Vec<u8>> {
        let n = match self.byte()? {
            0xc4 => self.be(1)?,
            0xc5 => self.be(2)?,
            0xc6 => self.be(4)?,
            _ => return None,
        };
        Some(self.take(usize::try_from(n).ok()?)?.to_vec())
    }

    /// An array's length, at most the bytes left (every element takes one at least).
    fn array_len(&mut self) -> R<usize> {
        let n = match self.byte()? {
            m @ 0x90..=0x9f => u64::from(m & 0x0f),
            0xdc => self.be(2)?,
            0xdd => self.be(4)?,
            _ => return None,
        };
        usize::try_from(n).ok().filter(|&n| n <= self.b.len() - self.pos)
    }

    fn map_len(&mut self) -> R<usize> {
        let n = match self.byte()? {
            m @ 0x80..=0x8f => u64::from(m & 0x0f),
            0xde => self.be(2)?,
            0xdf => self.be(4)?,
            _ => return None,
        };
        usize::try_from(n).ok().filter(|&n| n <= (self.b.len() - self.pos) / 2)
    }

    fn vec<T>(&mut self, mut item: impl FnMut(&mut Self) -> R<T>) -> R<Vec<T>> {
        let n = self.array_len()?;
        // An element takes one byte at least but is many in memory: reserve no more than
        // RESERVE_MAX ahead of reading them (lists nest, so this bounds every level).
        let mut v = Vec::with_capacity(n.min(RESERVE_MAX));
        for _ in 0..n {
            v.push(item(self)?);
        }
        Some(v)
    }

    fn u64s(&mut self) -> R<Vec<u64>> {
        self.vec(Self::u64)
    }

    fn dims(&mut self) -> R<Dims> {
        let n = self.array_len()?;
        let mut v = Dims::with_capacity(n.min(DIMS_INLINE));
        for _ in 0..n {
            v.push(self.u64()?);
        }
        Some(v)
    }

    fn dtype(&mut self) -> R<DType> {
        let name = self.str()?;
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// `nil` or `[start, stop]`.
    fn flat(&mut self) -> R<Option<[u64; 2]>> {
        if self.b.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            return Some(None);
        }
        match self.byte()? {
            0x92 => Some(Some([self.u64()?, self.u64()?])),
            _ => None,
        }
    }

    fn metadata(&mut self) -> R<Metadata> {
        let (format_version, save_id, writer, block_bytes, layout, files, tensors, objects) = fields!(self,
            format_version: u32 = self.u32()?,
            save_id: String = self.string()?,
            writer: String = self.string()?,
            block_bytes: u64 = self.u64()?,
            layout: BTreeMap<String, String> = self.layout()?,
            files: Vec<FileMeta> = self.vec(Self::file)?,
            tensors: Vec<TensorMeta> = self.vec(Self::tensor)?,
            objects: Vec<ObjectMeta> = self.vec(Self::object)?,
        );
        Some(Metadata {
            format_version: format_version?,
            save_id: save_id?,
            writer: writer?,
            block_bytes: block_bytes?,
            layout: layout?,
            files: files?,
            tensors: tensors?,
            objects: objects?,
        })
    }

    /// A map of strings; a repeated key keeps its last value, as serde's map does.
    fn layout(&mut self) -> R<BTreeMap<String, String>> {
        let mut map = BTreeMap::new();
        for _ in 0..self.map_len()? {
            map.insert(self.string()?, self.string()?);
        }
        Some(map)
    }

    fn file(&mut self) -> R<FileMeta> {
        let (name, bytes, data_start, header_crc32) = fields!(self,
            name: String = self.string()?,
            bytes: u64 = self.u64()?,
            data_start: u64 = self.u64()?,
            header_crc32: u32 = self.u32()?,
        );
        Some(FileMeta { name: name?, bytes: bytes?, data_start: data_start?, header_crc32: header_crc32? })
    }

    fn tensor(&mut self) -> R<TensorMeta> {
        let (key, dtype, global_shape, chunks) = fields!(self,
            key: String = self.string()?,
            dtype: DType = self.dtype()?,
            global_shape: Dims = self.dims()?,
            chunks: Vec<ChunkMeta> = self.vec(Self::chunk)?,
        );
        Some(TensorMeta { key: key?, dtype: dtype?, global_shape: global_shape?, chunks: chunks? })
    }

    fn chunk(&mut self) -> R<ChunkMeta> {
        let (offset, shape, flat, file, at, crc32) = fields!(self,
            offset: Dims = self.dims()?,
            shape: Dims = self.dims()?,
            flat: Option<[u64; 2]> = self.flat()?,
            file: u32 = self.u32()?,
            at: u64 = self.u64()?,
            crc32: Vec<u8> = self.bin()?,
        );
        // `flat` alone may be left out (serde's default).
        Some(ChunkMeta { offset: offset?, shape: shape?, flat: flat.flatten(), file: file?, at: at?, crc32: crc32? })
    }

    fn object(&mut self) -> R<ObjectMeta> {
        let (key, grid_shape, entries) = fields!(self,
            key: String = self.string()?,
            grid_shape: Vec<u64> = self.u64s()?,
            entries: Vec<ObjectEntry> = self.vec(Self::entry)?,
        );
        Some(ObjectMeta { key: key?, grid_shape: grid_shape?, entries: entries? })
    }

    fn entry(&mut self) -> R<ObjectEntry> {
        let (grid_offset, file, at, len, crc32) = fields!(self,
            grid_offset: Vec<u64> = self.u64s()?,
            file: u32 = self.u32()?,
            at: u64 = self.u64()?,
            len: u64 = self.u64()?,
            crc32: Vec<u8> = self.bin()?,
        );
        Some(ObjectEntry { grid_offset: grid_offset?, file: file?, at: at?, len: len?, crc32: crc32? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::{btree_map, vec};
    use proptest::prelude::*;
    use serde::{Deserialize, Serialize};

    fn by_serde(body: &[u8]) -> Result<Metadata, rmp_serde::decode::Error> {
        Metadata::deserialize(&mut rmp_serde::Deserializer::from_read_ref(body))
    }

    /// The body of dckpt's own encoding.
    fn ours(m: &Metadata) -> Vec<u8> {
        let file = m.encode();
        file[crate::format::META_PREFIX_BYTES..file.len() - 4].to_vec()
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
        let chunk =
            (numbers(), numbers(), proptest::option::of(any::<[u64; 2]>()), any::<u32>(), any::<u64>(), bytes())
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
            .prop_map(|(format_version, (save_id, writer, block_bytes), layout, files, tensors, objects)| {
                Metadata { format_version, save_id, writer, block_bytes, layout, files, tensors, objects }
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

        /// dckpt writes serde's bytes, and reads them without leaving the fast path.
        #[test]
        fn writes_serde_bytes_and_reads_them(m in metadata_values()) {
            prop_assert_eq!(ours(&m), rmp_serde::to_vec_named(&m).unwrap());
            prop_assert_eq!(read_metadata(&ours(&m)), Some(m.clone()));
            prop_assert_eq!(read_metadata(&rmp_serde::to_vec_named(&m).unwrap()), Some(m.clone()));
            prop_assert_eq!(read_files(&ours(&m)), Some((m.format_version, m.files)));
        }

        /// Whatever the fast path returns for damaged bytes, serde returns too; the rest it
        /// leaves to serde.
        #[test]
        fn agrees_with_serde_or_gives_up(
            m in metadata_values(),
            edits in vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..4),
        ) {
            let mut body = ours(&m);
            for (at, byte, how) in edits {
                let i = at.index(body.len() + 1);
                match how {
                    0 if i < body.len() => body[i] = byte,
                    1 => body.insert(i, byte),
                    _ => body.truncate(i),
                }
            }
            if let Some(fast) = read_metadata(&body) {
                prop_assert_eq!(by_serde(&body).ok(), Some(fast));
            }
            // The file list alone agrees with every whole decode that succeeds.
            if let (Some(files), Ok(whole)) = (read_files(&body), by_serde(&body)) {
                prop_assert_eq!(files, (whole.format_version, whole.files));
            }
        }
    }

    fn sample() -> Metadata {
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let mut m = proptest::strategy::ValueTree::current(&metadata_values().new_tree(&mut runner).unwrap());
        m.block_bytes = 1 << 40;
        m.tensors.push(TensorMeta {
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
        });
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
            assert_eq!(read_metadata(&ours(&m)), Some(m));
        }
    }

    /// Encodings serde accepts and the fast path does not take: serde decides them.
    #[test]
    fn gives_up_on_other_encodings_and_serde_decides() {
        let m = sample();
        let via_serde = |body: &[u8]| {
            assert_eq!(read_metadata(body), None);
            by_serde(body)
        };
        // Structs as arrays (serde's compact form, which needs `flat` written).
        let mut flat = m.clone();
        flat.tensors.iter_mut().flat_map(|t| &mut t.chunks).for_each(|c| c.flat = Some([1, 2]));
        assert_eq!(via_serde(&rmp_serde::to_vec(&flat).unwrap()).unwrap(), flat);
        // A field this version does not know.
        #[derive(Serialize)]
        struct Newer<'a> {
            #[serde(flatten)]
            m: &'a Metadata,
            future: Vec<u8>,
        }
        let newer = rmp_serde::to_vec_named(&Newer { m: &m, future: vec![1, 2] }).unwrap();
        assert_eq!(via_serde(&newer).unwrap(), m);
        // A number written signed.
        let body = ours(&m);
        let find = |pat: &[u8]| body.windows(pat.len()).position(|w| w == pat).unwrap();
        let at = find(b"\xabblock_bytes") + 12;
        assert_eq!(body[at], 0xcf, "block_bytes 1 << 40 is a u64");
        let signed = [&body[..at], &[0xd3], &(1i64 << 40).to_be_bytes(), &body[at + 9..]].concat();
        assert_eq!(via_serde(&signed).unwrap(), m);
        // A field written twice, which serde refuses.
        assert_eq!(body[0], 0x88, "eight fields");
        let twice = [&[0x89], &body[1..], b"\xa6writer\xa1x"].concat();
        assert_eq!(read_metadata(&twice), None);
        assert!(by_serde(&twice).unwrap_err().to_string().contains("duplicate field"));
        // `flat` written as nil reads as absent, on both paths.
        let chunk = find(b"\x85\xa6offset");
        let nil_flat = [&body[..chunk], b"\x86\xa4flat\xc0", &body[chunk + 1..]].concat();
        assert_eq!(read_metadata(&nil_flat).as_ref(), Some(&m));
        assert_eq!(by_serde(&nil_flat).unwrap(), m);
        // Trailing bytes.
        let mut longer = body.clone();
        longer.push(0xc0);
        assert_eq!(read_metadata(&longer), None);
    }
}
