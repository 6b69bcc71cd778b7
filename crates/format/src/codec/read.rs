//! The body's reader: every MessagePack encoding of the body's types, unknown fields
//! skipped, errors with the field's path.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use dckpt_shard_spec::{DType, Dims};

use crate::error::{FormatError, FormatErrorKind, malformed};
use crate::meta::{ChunkMeta, FileMeta, META_PREFIX_BYTES, Metadata, ObjectEntry, ObjectMeta, TensorMeta};

/// Most entries of the free-form `layout` map a reader accepts.
pub const LAYOUT_ENTRIES_MAX: usize = 1 << 17;

/// The fewest bytes a struct with these required fields takes: a one-byte map header, and
/// per field its name as a fixstr and the smallest encoding of its value.
const fn struct_bytes_min(fields: &[(&str, usize)]) -> usize {
    let mut n = 1;
    let mut i = 0;
    while i < fields.len() {
        n += 1 + fields[i].0.len() + fields[i].1;
        i += 1;
    }
    n
}

// The smallest encodings: an integer, a string, an array 1 byte; an empty bin 2 (`c4 00`);
// a dtype the shortest name (`u8`) as a fixstr.
const INT: usize = 1;
const STR: usize = 1;
const ARRAY: usize = 1;
const BIN: usize = 2;
const DTYPE: usize = 3;

/// Fewest bytes of a `FileMeta`, `TensorMeta`, ...: a list of `n` of them needs `n` times
/// that, which bounds the list before anything is reserved for it.
pub(crate) const FILE_BYTES_MIN: usize =
    struct_bytes_min(&[("name", STR), ("bytes", INT), ("data_start", INT), ("header_crc32", INT)]);
pub(crate) const TENSOR_BYTES_MIN: usize =
    struct_bytes_min(&[("key", STR), ("dtype", DTYPE), ("global_shape", ARRAY), ("chunks", ARRAY)]);
pub(crate) const CHUNK_BYTES_MIN: usize =
    struct_bytes_min(&[("offset", ARRAY), ("shape", ARRAY), ("file", INT), ("at", INT), ("crc32", BIN)]);
pub(crate) const OBJECT_BYTES_MIN: usize = struct_bytes_min(&[("key", STR), ("grid_shape", ARRAY), ("entries", ARRAY)]);
pub(crate) const ENTRY_BYTES_MIN: usize =
    struct_bytes_min(&[("grid_offset", ARRAY), ("file", INT), ("at", INT), ("len", INT), ("crc32", BIN)]);

/// A failure deep in the body, with the path to it collected on the way out.
#[derive(Debug)]
pub(crate) struct Fail {
    /// Innermost first: each level adds itself as the failure passes through it, so the
    /// path costs nothing unless something fails.
    path: Vec<Seg>,
    why: Why,
    /// Byte offset in the body.
    at: usize,
}

/// What went wrong, as values: words are made only for the error that is returned, so
/// the reader's hot paths carry no formatting.
#[derive(Debug)]
enum Why {
    Ended,
    PastEnd {
        n: usize,
        left: usize,
    },
    LengthTooLarge(u64),
    /// Expected this, found a value starting with marker `m`.
    Expected {
        what: &'static str,
        m: u8,
    },
    Negative(i64),
    Over32Bits(u64),
    NotUtf8(std::str::Utf8Error),
    ArrayTooLong {
        n: usize,
        /// The fewest bytes an item takes.
        min: usize,
        left: usize,
    },
    MapTooLong {
        n: usize,
        left: usize,
    },
    BadValue,
    UnknownDtype(String),
    FlatLength(usize),
    Twice,
    Missing,
    KeyTwice(String),
    Trailing(usize),
    /// More than this reader accepts: not malformed, a limit.
    Limit {
        what: &'static str,
        found: u64,
        limit: u64,
    },
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::Ended => write!(f, "the body ends inside a value"),
            Why::PastEnd { n, left } => write!(f, "{n} bytes declared, {left} left in the body"),
            Why::LengthTooLarge(v) => write!(f, "a length of {v} does not fit this machine"),
            Why::Expected { what: want, m } => write!(f, "expected {want}, found {} (marker {m:#04x})", what(*m)),
            Why::Negative(v) => write!(f, "{v} is negative; expected an unsigned integer"),
            Why::Over32Bits(v) => write!(f, "{v} does not fit in 32 bits"),
            Why::NotUtf8(e) => write!(f, "the string is not UTF-8: {e}"),
            Why::ArrayTooLong { n, min, left } => {
                write!(f, "an array of {n} items of at least {min} bytes each in the {left} bytes left")
            }
            Why::MapTooLong { n, left } => write!(f, "a map of {n} entries in the {left} bytes left"),
            Why::BadValue => write!(f, "a value that is truncated or not MessagePack"),
            Why::UnknownDtype(name) => write!(f, "unknown dtype {name:?}"),
            Why::FlatLength(n) => write!(f, "expected [start, stop], found an array of {n} items"),
            Why::Twice => write!(f, "appears twice"),
            Why::Missing => write!(f, "missing"),
            Why::KeyTwice(k) => write!(f, "the key {k:?} appears twice"),
            Why::Trailing(n) => write!(f, "{n} bytes follow the metadata"),
            Why::Limit { what, found, limit } => write!(f, "{found} {what} exceeds the limit of {limit}"),
        }
    }
}

#[derive(Debug)]
enum Seg {
    Field(&'static str),
    /// A field this version does not know, named as it was written.
    Unknown(String),
    Index(usize),
}

/// Boxed, so that the success path of every small read moves one word of error.
type R<T> = Result<T, Box<Fail>>;

impl Fail {
    /// The error for a metadata file `file` whose body this was.
    pub(crate) fn into_error(self, file: &str) -> FormatError {
        let mut field = String::new();
        for seg in self.path.iter().rev() {
            match seg {
                Seg::Field(name) if field.is_empty() => field.push_str(name),
                Seg::Field(name) => {
                    let _ = write!(field, ".{name}");
                }
                Seg::Unknown(name) if field.is_empty() => field.push_str(name),
                Seg::Unknown(name) => {
                    let _ = write!(field, ".{name}");
                }
                Seg::Index(i) => {
                    let _ = write!(field, "[{i}]");
                }
            }
        }
        if field.is_empty() {
            field.push_str("body");
        }
        if let Why::Limit { what, found, limit } = self.why {
            return FormatError::new(file, field, FormatErrorKind::LimitExceeded { what: what.into(), found, limit });
        }
        malformed(file, field, self.why.to_string(), (META_PREFIX_BYTES + self.at) as u64)
    }
}

#[inline]
fn fail<T>(at: usize, why: Why) -> R<T> {
    Err(boxed(at, why))
}

#[cold]
#[inline(never)]
fn boxed(at: usize, why: Why) -> Box<Fail> {
    Box::new(Fail { path: Vec::new(), why, at })
}

/// Adds a level to the path of a failure on its way out.
trait Within<T> {
    fn within(self, seg: impl FnOnce() -> Seg) -> R<T>;
}

impl<T> Within<T> for R<T> {
    #[inline]
    fn within(self, seg: impl FnOnce() -> Seg) -> R<T> {
        match self {
            Ok(v) => Ok(v),
            Err(e) => Err(push_seg(e, seg())),
        }
    }
}

#[cold]
#[inline(never)]
fn push_seg(mut e: Box<Fail>, seg: Seg) -> Box<Fail> {
    e.path.push(seg);
    e
}

/// The metadata in `body`, which must hold it and nothing after it.
pub(crate) fn read_metadata(body: &[u8]) -> Result<Metadata, Box<Fail>> {
    let mut r = Reader { b: body, pos: 0 };
    let m = r.metadata()?;
    if r.pos != body.len() {
        return fail(r.pos, Why::Trailing(body.len() - r.pos));
    }
    Ok(m)
}

/// The format version and the `files` of a body, reading no more of it than it must: it
/// stops once it has both (dckpt writes them before the tensors), and skips other fields
/// without decoding them. The caller has checked the framing's CRC.
pub(crate) fn read_files(body: &[u8]) -> Result<(u32, Vec<FileMeta>), Box<Fail>> {
    let mut r = Reader { b: body, pos: 0 };
    let start = r.pos;
    let (mut version, mut files) = (None, None);
    for _ in 0..r.map_len()? {
        let key_at = r.pos;
        match r.field_name()? {
            b"format_version" => once(&mut version, key_at, "format_version", |r| r.u32(), &mut r)?,
            b"files" => once(&mut files, key_at, "files", |r| r.vec(FILE_BYTES_MIN, Reader::file), &mut r)?,
            name => r.skip().within(|| Seg::Unknown(String::from_utf8_lossy(name).into_owned()))?,
        }
        if version.is_some() && files.is_some() {
            break;
        }
    }
    Ok((need(version, "format_version", start)?, need(files, "files", start)?))
}

/// Reads a field into `slot` unless it was read before.
fn once<'a, T>(
    slot: &mut Option<T>,
    key_at: usize,
    name: &'static str,
    read: impl FnOnce(&mut Reader<'a>) -> R<T>,
    r: &mut Reader<'a>,
) -> R<()> {
    if slot.is_some() {
        return fail(key_at, Why::Twice).within(|| Seg::Field(name));
    }
    *slot = Some(read(r).within(|| Seg::Field(name))?);
    Ok(())
}

/// A field that must be there: its absence is a failure at the map that lacks it.
fn need<T>(v: Option<T>, name: &'static str, map_at: usize) -> R<T> {
    match v {
        Some(v) => Ok(v),
        None => fail(map_at, Why::Missing).within(|| Seg::Field(name)),
    }
}

/// What a MessagePack marker starts, for errors.
fn what(m: u8) -> &'static str {
    match m {
        0x00..=0x7f | 0xcc..=0xcf => "an unsigned integer",
        0xe0..=0xff | 0xd0..=0xd3 => "a signed integer",
        0x80..=0x8f | 0xde | 0xdf => "a map",
        0x90..=0x9f | 0xdc | 0xdd => "an array",
        0xa0..=0xbf | 0xd9..=0xdb => "a string",
        0xc0 => "nil",
        0xc1 => "the unused marker 0xc1",
        0xc2 | 0xc3 => "a boolean",
        0xc4..=0xc6 => "binary",
        0xca | 0xcb => "a float",
        0xc7..=0xc9 | 0xd4..=0xd8 => "an extension value",
    }
}

/// Reads a struct's fields, in any order, into one `Option` each (a missing one is left
/// `None` for the caller); a field named twice is a failure, one it does not know is
/// skipped. Each `read` is an `R<T>`; a failure in it gets the field's name on its path.
macro_rules! fields {
    ($r:ident, $( $name:ident : $ty:ty = $read:expr ),+ $(,)?) => {{
        $( let mut $name: Option<$ty> = None; )+
        for _ in 0..$r.map_len()? {
            let key_at = $r.pos;
            match $r.field_name()? {
                $( k if k == stringify!($name).as_bytes() => {
                    if $name.is_some() {
                        return fail(key_at, Why::Twice).within(|| Seg::Field(stringify!($name)));
                    }
                    $name = Some($read.within(|| Seg::Field(stringify!($name)))?);
                } )+
                name => $r.skip().within(|| Seg::Unknown(String::from_utf8_lossy(name).into_owned()))?,
            }
        }
        ($( $name, )+)
    }};
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    #[inline]
    fn left(&self) -> usize {
        self.b.len() - self.pos
    }

    #[inline]
    fn byte(&mut self) -> R<u8> {
        let Some(&m) = self.b.get(self.pos) else {
            return fail(self.pos, Why::Ended);
        };
        self.pos += 1;
        Ok(m)
    }

    #[inline]
    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        match self.pos.checked_add(n).and_then(|end| self.b.get(self.pos..end)) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => fail(self.pos, Why::PastEnd { n, left: self.left() }),
        }
    }

    /// A big-endian unsigned integer of `n` bytes.
    #[inline]
    fn be(&mut self, n: usize) -> R<u64> {
        Ok(self.take(n)?.iter().fold(0u64, |v, &x| v << 8 | u64::from(x)))
    }

    /// A length or count that must fit this machine's `usize`.
    #[inline]
    fn len(&mut self, n: usize) -> R<usize> {
        let at = self.pos;
        let v = self.be(n)?;
        match usize::try_from(v) {
            Ok(v) => Ok(v),
            Err(_) => fail(at, Why::LengthTooLarge(v)),
        }
    }

    /// An integer that must not be negative, in any of MessagePack's integer encodings.
    #[inline]
    fn u64(&mut self) -> R<u64> {
        let at = self.pos;
        match self.byte()? {
            m @ 0x00..=0x7f => Ok(u64::from(m)),
            0xcc => self.be(1),
            0xcd => self.be(2),
            0xce => self.be(4),
            0xcf => self.be(8),
            m => self.signed(at, m),
        }
    }

    /// The rest of [`Reader::u64`]: what dckpt does not write, so out of its way.
    #[cold]
    #[inline(never)]
    fn signed(&mut self, at: usize, m: u8) -> R<u64> {
        let v = match m {
            0xe0..=0xff => i64::from(m as i8),
            0xd0 => i64::from(self.be(1)? as u8 as i8),
            0xd1 => i64::from(self.be(2)? as u16 as i16),
            0xd2 => i64::from(self.be(4)? as u32 as i32),
            0xd3 => self.be(8)? as i64,
            _ => return fail(at, Why::Expected { what: "an unsigned integer", m }),
        };
        u64::try_from(v).or_else(|_| fail(at, Why::Negative(v)))
    }

    #[inline]
    fn u32(&mut self) -> R<u32> {
        let at = self.pos;
        let v = self.u64()?;
        u32::try_from(v).or_else(|_| fail(at, Why::Over32Bits(v)))
    }

    /// A string's bytes, not checked as UTF-8.
    #[inline]
    fn str_bytes(&mut self) -> R<&'a [u8]> {
        self.str_bytes_as("a string")
    }

    /// A string's bytes; anything else is a failure that expected `what`.
    #[inline]
    fn str_bytes_as(&mut self, what: &'static str) -> R<&'a [u8]> {
        let at = self.pos;
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => usize::from(m & 0x1f),
            0xd9 => self.len(1)?,
            0xda => self.len(2)?,
            0xdb => self.len(4)?,
            m => return fail(at, Why::Expected { what, m }),
        };
        self.take(n)
    }

    /// A field name: a string, compared as bytes with the names this version knows.
    #[inline]
    fn field_name(&mut self) -> R<&'a [u8]> {
        self.str_bytes_as("a field name (a string)")
    }

    #[inline]
    fn str(&mut self) -> R<&'a str> {
        let at = self.pos;
        let b = self.str_bytes()?;
        std::str::from_utf8(b).or_else(|e| fail(at, Why::NotUtf8(e)))
    }

    #[inline]
    fn string(&mut self) -> R<String> {
        self.str().map(str::to_owned)
    }

    fn bin(&mut self) -> R<Vec<u8>> {
        let at = self.pos;
        let n = match self.byte()? {
            0xc4 => self.len(1)?,
            0xc5 => self.len(2)?,
            0xc6 => self.len(4)?,
            m => return fail(at, Why::Expected { what: "binary", m }),
        };
        Ok(self.take(n)?.to_vec())
    }

    /// An array's length, at most the items of `min` bytes each that the bytes left hold.
    #[inline]
    fn array_len(&mut self, min: usize) -> R<usize> {
        let at = self.pos;
        let n = match self.byte()? {
            m @ 0x90..=0x9f => usize::from(m & 0x0f),
            0xdc => self.len(2)?,
            0xdd => self.len(4)?,
            m => return fail(at, Why::Expected { what: "an array", m }),
        };
        if n > self.left() / min {
            return fail(at, Why::ArrayTooLong { n, min, left: self.left() });
        }
        Ok(n)
    }

    /// A map's length, at most half the bytes left (a key and a value take one each).
    #[inline]
    fn map_len(&mut self) -> R<usize> {
        let at = self.pos;
        let n = match self.byte()? {
            m @ 0x80..=0x8f => usize::from(m & 0x0f),
            0xde => self.len(2)?,
            0xdf => self.len(4)?,
            m @ (0x90..=0x9f | 0xdc | 0xdd) => {
                return fail(at, Why::Expected { what: "a map with named fields", m });
            }
            m => return fail(at, Why::Expected { what: "a map", m }),
        };
        if n > self.left() / 2 {
            return fail(at, Why::MapTooLong { n, left: self.left() });
        }
        Ok(n)
    }

    /// Steps over one value of any kind, without decoding or allocating.
    fn skip(&mut self) -> R<()> {
        match msgpack_value_len(&self.b[self.pos..]) {
            Some(n) => {
                self.pos += n;
                Ok(())
            }
            None => fail(self.pos, Why::BadValue),
        }
    }

    /// An array of items that take `min` bytes each at least. Its length is held to what the
    /// bytes left can hold before anything is reserved, and then reserved exactly: memory
    /// stays a fixed multiple of the bytes read (the size of a `T` over `min`), with no
    /// spare capacity from growing the list.
    fn vec<T>(&mut self, min: usize, mut item: impl FnMut(&mut Self) -> R<T>) -> R<Vec<T>> {
        let n = self.array_len(min)?;
        let mut v = Vec::with_capacity(n);
        for i in 0..n {
            v.push(item(self).within(|| Seg::Index(i))?);
        }
        Ok(v)
    }

    fn u64s(&mut self) -> R<Vec<u64>> {
        self.vec(INT, Self::u64)
    }

    fn dims(&mut self) -> R<Dims> {
        let n = self.array_len(INT)?;
        // Inline up to DIMS_INLINE, else exactly n on the heap.
        let mut v = Dims::with_capacity(n);
        for i in 0..n {
            v.push(self.u64().within(|| Seg::Index(i))?);
        }
        Ok(v)
    }

    fn dtype(&mut self) -> R<DType> {
        let at = self.pos;
        let name = self.str()?;
        match DType::ALL.into_iter().find(|d| d.name() == name) {
            Some(d) => Ok(d),
            None => fail(at, Why::UnknownDtype(name.to_string())),
        }
    }

    /// `nil` or `[start, stop]`.
    fn flat(&mut self) -> R<Option<[u64; 2]>> {
        if self.b.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            return Ok(None);
        }
        let at = self.pos;
        let n = self.array_len(INT)?;
        if n != 2 {
            return fail(at, Why::FlatLength(n));
        }
        let start = self.u64().within(|| Seg::Index(0))?;
        let stop = self.u64().within(|| Seg::Index(1))?;
        Ok(Some([start, stop]))
    }

    /// A map of strings to strings; a key may appear once.
    fn layout(&mut self) -> R<BTreeMap<String, String>> {
        let mut map = BTreeMap::new();
        let at = self.pos;
        let n = self.map_len()?;
        // An entry of two short strings costs tens of bytes in a map, far more than in the
        // file: the count is limited, so that the layout cannot be the bulk of a file.
        if n > LAYOUT_ENTRIES_MAX {
            return fail(at, Why::Limit { what: "layout entries", found: n as u64, limit: LAYOUT_ENTRIES_MAX as u64 });
        }
        for _ in 0..n {
            let at = self.pos;
            let k = self.string()?;
            let v = self.string().within(|| Seg::Unknown(k.clone()))?;
            if map.contains_key(&k) {
                return fail(at, Why::KeyTwice(k));
            }
            map.insert(k, v);
        }
        Ok(map)
    }

    fn metadata(&mut self) -> R<Metadata> {
        let start = self.pos;
        let (format_version, save_id, writer, block_bytes, layout, files, tensors, objects) = fields!(self,
            format_version: u32 = self.u32(),
            save_id: String = self.string(),
            writer: String = self.string(),
            block_bytes: u64 = self.u64(),
            layout: BTreeMap<String, String> = self.layout(),
            files: Vec<FileMeta> = self.vec(FILE_BYTES_MIN, Self::file),
            tensors: Vec<TensorMeta> = self.vec(TENSOR_BYTES_MIN, Self::tensor),
            objects: Vec<ObjectMeta> = self.vec(OBJECT_BYTES_MIN, Self::object),
        );
        Ok(Metadata {
            format_version: need(format_version, "format_version", start)?,
            save_id: need(save_id, "save_id", start)?,
            writer: need(writer, "writer", start)?,
            block_bytes: need(block_bytes, "block_bytes", start)?,
            layout: need(layout, "layout", start)?,
            files: need(files, "files", start)?,
            tensors: need(tensors, "tensors", start)?,
            objects: need(objects, "objects", start)?,
        })
    }

    fn file(&mut self) -> R<FileMeta> {
        let start = self.pos;
        let (name, bytes, data_start, header_crc32) = fields!(self,
            name: String = self.string(),
            bytes: u64 = self.u64(),
            data_start: u64 = self.u64(),
            header_crc32: u32 = self.u32(),
        );
        Ok(FileMeta {
            name: need(name, "name", start)?,
            bytes: need(bytes, "bytes", start)?,
            data_start: need(data_start, "data_start", start)?,
            header_crc32: need(header_crc32, "header_crc32", start)?,
        })
    }

    fn tensor(&mut self) -> R<TensorMeta> {
        let start = self.pos;
        let (key, dtype, global_shape, chunks) = fields!(self,
            key: String = self.string(),
            dtype: DType = self.dtype(),
            global_shape: Dims = self.dims(),
            chunks: Vec<ChunkMeta> = self.vec(CHUNK_BYTES_MIN, Self::chunk),
        );
        Ok(TensorMeta {
            key: need(key, "key", start)?,
            dtype: need(dtype, "dtype", start)?,
            global_shape: need(global_shape, "global_shape", start)?,
            chunks: need(chunks, "chunks", start)?,
        })
    }

    fn chunk(&mut self) -> R<ChunkMeta> {
        let start = self.pos;
        let (offset, shape, flat, file, at, crc32) = fields!(self,
            offset: Dims = self.dims(),
            shape: Dims = self.dims(),
            flat: Option<[u64; 2]> = self.flat(),
            file: u32 = self.u32(),
            at: u64 = self.u64(),
            crc32: Vec<u8> = self.bin(),
        );
        Ok(ChunkMeta {
            offset: need(offset, "offset", start)?,
            shape: need(shape, "shape", start)?,
            // The one optional field: absent and nil both mean the whole box.
            flat: flat.flatten(),
            file: need(file, "file", start)?,
            at: need(at, "at", start)?,
            crc32: need(crc32, "crc32", start)?,
        })
    }

    fn object(&mut self) -> R<ObjectMeta> {
        let start = self.pos;
        let (key, grid_shape, entries) = fields!(self,
            key: String = self.string(),
            grid_shape: Vec<u64> = self.u64s(),
            entries: Vec<ObjectEntry> = self.vec(ENTRY_BYTES_MIN, Self::entry),
        );
        Ok(ObjectMeta {
            key: need(key, "key", start)?,
            grid_shape: need(grid_shape, "grid_shape", start)?,
            entries: need(entries, "entries", start)?,
        })
    }

    fn entry(&mut self) -> R<ObjectEntry> {
        let start = self.pos;
        let (grid_offset, file, at, len, crc32) = fields!(self,
            grid_offset: Vec<u64> = self.u64s(),
            file: u32 = self.u32(),
            at: u64 = self.u64(),
            len: u64 = self.u64(),
            crc32: Vec<u8> = self.bin(),
        );
        Ok(ObjectEntry {
            grid_offset: need(grid_offset, "grid_offset", start)?,
            file: need(file, "file", start)?,
            at: need(at, "at", start)?,
            len: need(len, "len", start)?,
            crc32: need(crc32, "crc32", start)?,
        })
    }
}

/// The length of the first MessagePack value in `b`, or `None` when `b` ends inside it or
/// holds a byte that is no MessagePack marker. One pass, no recursion, no allocation.
pub(crate) fn msgpack_value_len(b: &[u8]) -> Option<usize> {
    let (mut pos, mut pending) = (0usize, 1u64);
    let be = |at: usize, n: usize| -> Option<u64> {
        b.get(at..at.checked_add(n)?).map(|s| s.iter().fold(0u64, |v, &x| v << 8 | u64::from(x)))
    };
    while pending > 0 {
        pending -= 1;
        let m = *b.get(pos)?;
        // (header bytes after the marker, payload bytes, items that follow)
        let (head, body, items): (usize, u64, u64) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0, 0),
            0x80..=0x8f => (0, 0, 2 * u64::from(m & 0x0f)),
            0x90..=0x9f => (0, 0, u64::from(m & 0x0f)),
            0xa0..=0xbf => (0, u64::from(m & 0x1f), 0),
            0xc4 | 0xd9 => (1, be(pos + 1, 1)?, 0),
            0xc5 | 0xda => (2, be(pos + 1, 2)?, 0),
            0xc6 | 0xdb => (4, be(pos + 1, 4)?, 0),
            0xc7 => (2, be(pos + 1, 1)?, 0),
            0xc8 => (3, be(pos + 1, 2)?, 0),
            0xc9 => (5, be(pos + 1, 4)?, 0),
            0xca | 0xce | 0xd2 => (4, 0, 0),
            0xcb | 0xcf | 0xd3 => (8, 0, 0),
            0xcc | 0xd0 => (1, 0, 0),
            0xcd | 0xd1 => (2, 0, 0),
            0xd4..=0xd8 => (1, 1 << (m - 0xd4), 0),
            0xdc => (2, 0, be(pos + 1, 2)?),
            0xdd => (4, 0, be(pos + 1, 4)?),
            0xde => (2, 0, 2 * be(pos + 1, 2)?),
            0xdf => (4, 0, 2 * be(pos + 1, 4)?),
            0xc1 => return None,
        };
        pos = pos.checked_add(1 + head)?.checked_add(usize::try_from(body).ok()?)?;
        if pos > b.len() {
            return None;
        }
        pending = pending.checked_add(items)?;
    }
    Some(pos)
}
