//! The body's writer: serde's bytes from borrowed views.

use std::collections::BTreeMap;

use dckpt_shard_spec::DType;

use crate::frame;
use crate::meta::{ChunkMeta, FileMeta, ObjectMeta};

/// A [`Metadata`](crate::Metadata) borrowed for writing, with the tensors from an
/// iterator: a save writes its metadata from its plan without building a `Metadata` of
/// copies (a save can hold hundreds of thousands of chunks). Encoded by [`encode_view`],
/// it gives the same bytes as the equal `Metadata`'s [`encode`](crate::Metadata::encode).
#[derive(Debug)]
pub struct MetadataView<'a, T> {
    /// [`Metadata::save_id`](crate::Metadata::save_id).
    pub save_id: &'a str,
    /// [`Metadata::writer`](crate::Metadata::writer).
    pub writer: &'a str,
    /// [`Metadata::block_bytes`](crate::Metadata::block_bytes).
    pub block_bytes: u64,
    /// [`Metadata::layout`](crate::Metadata::layout).
    pub layout: &'a BTreeMap<String, String>,
    /// [`Metadata::files`](crate::Metadata::files).
    pub files: &'a [FileMeta],
    /// The tensors as [`TensorView`]s, sorted by key.
    pub tensors: T,
    /// [`Metadata::objects`](crate::Metadata::objects).
    pub objects: &'a [ObjectMeta],
}

/// A [`TensorMeta`](crate::TensorMeta) borrowed, its chunks from an iterator of
/// [`ChunkView`]s.
#[derive(Debug)]
pub struct TensorView<'a, C> {
    /// The tensor's name.
    pub key: &'a str,
    /// Its element type.
    pub dtype: DType,
    /// The whole tensor's shape.
    pub global_shape: &'a [u64],
    /// The chunks, as [`ChunkView`]s.
    pub chunks: C,
}

/// A [`ChunkMeta`] borrowed.
#[derive(Clone, Copy, Debug)]
pub struct ChunkView<'a> {
    /// [`ChunkMeta::offset`].
    pub offset: &'a [u64],
    /// [`ChunkMeta::shape`].
    pub shape: &'a [u64],
    /// [`ChunkMeta::flat`].
    pub flat: Option<[u64; 2]>,
    /// [`ChunkMeta::file`].
    pub file: u32,
    /// [`ChunkMeta::at`].
    pub at: u64,
    /// [`ChunkMeta::crc32`].
    pub crc32: &'a [u8],
}

impl<'a> ChunkView<'a> {
    /// `c` borrowed.
    pub fn of(c: &'a ChunkMeta) -> ChunkView<'a> {
        ChunkView { offset: &c.offset, shape: &c.shape, flat: c.flat, file: c.file, at: c.at, crc32: &c.crc32 }
    }
}

/// The whole metadata file for `view`: the framing (with [`crate::FORMAT_VERSION`]) around
/// a body that says `version` (so tests can write a body that disagrees). `chunks` is how
/// many chunks the view holds in all, a guess that sizes the buffer.
pub fn encode_view<'a, T, C>(version: u32, view: MetadataView<'a, T>, chunks: usize) -> Vec<u8>
where
    T: ExactSizeIterator<Item = TensorView<'a, C>>,
    C: ExactSizeIterator<Item = ChunkView<'a>>,
{
    // The body is written in place after the prefix; its length is filled in after.
    let guess = 256 + 128 * view.files.len() + 160 * chunks;
    let mut out = frame::begin(guess);
    write_metadata(&mut out, version, view);
    frame::finish(out)
}

/// Appends the body for `view`, with `version` as its `format_version`, to `out`.
pub fn write_metadata<'a, T, C>(out: &mut Vec<u8>, version: u32, view: MetadataView<'a, T>)
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
    /// the sized forms `sized` (marker, bytes) that holds it. Inlined, so the fix form (most
    /// lengths and small numbers) is a compare and a push: the body is written value by value,
    /// about twenty per chunk.
    #[inline]
    fn head(&mut self, n: u64, fix: u8, fix_max: u64, sized: &[(u8, usize)]) -> &mut Self {
        if n < fix_max {
            self.0.push(fix | n as u8);
            return self;
        }
        self.sized(n, sized)
    }

    #[inline(never)]
    fn sized(&mut self, n: u64, sized: &[(u8, usize)]) -> &mut Self {
        let &(marker, bytes) =
            sized.iter().find(|(_, b)| *b == 8 || n >> (8 * b) == 0).expect("the last form holds 8 bytes");
        self.0.push(marker);
        self.0.extend_from_slice(&n.to_be_bytes()[8 - bytes..]);
        self
    }

    #[inline]
    fn uint(&mut self, v: u64) -> &mut Self {
        self.head(v, 0x00, 0x80, &[(0xcc, 1), (0xcd, 2), (0xce, 4), (0xcf, 8)])
    }

    #[inline]
    fn str(&mut self, s: &str) -> &mut Self {
        self.head(s.len() as u64, 0xa0, 32, &[(0xd9, 1), (0xda, 2), (0xdb, 4)]);
        self.0.extend_from_slice(s.as_bytes());
        self
    }

    /// A field's name: always a fixstr (the format's names are short).
    #[inline]
    fn field(&mut self, name: &'static str) -> &mut Self {
        debug_assert!(name.len() < 32);
        self.0.push(0xa0 | name.len() as u8);
        self.0.extend_from_slice(name.as_bytes());
        self
    }

    #[inline]
    fn bin(&mut self, b: &[u8]) -> &mut Self {
        self.head(b.len() as u64, 0xc4, 0, &[(0xc4, 1), (0xc5, 2), (0xc6, 4)]);
        self.0.extend_from_slice(b);
        self
    }

    #[inline]
    fn array(&mut self, n: usize) -> &mut Self {
        self.head(n as u64, 0x90, 16, &[(0xdc, 2), (0xdd, 4)])
    }

    #[inline]
    fn map(&mut self, n: usize) -> &mut Self {
        self.head(n as u64, 0x80, 16, &[(0xde, 2), (0xdf, 4)])
    }

    #[inline]
    fn uints(&mut self, v: &[u64]) -> &mut Self {
        self.array(v.len());
        for &x in v {
            self.uint(x);
        }
        self
    }
}
