//! The body's reader: every MessagePack encoding of the body's types, unknown fields
//! skipped, errors with the field's path.

use std::collections::BTreeMap;

use dckpt_shard_spec::{DType, Dims};

use super::fail::{Fail, ReadResult, Seg, Why, Within, fail};
use super::reader::Reader;
use crate::meta::{ChunkMeta, FileMeta, Metadata, ObjectEntry, ObjectMeta, TensorMeta};

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
    read: impl FnOnce(&mut Reader<'a>) -> ReadResult<T>,
    r: &mut Reader<'a>,
) -> ReadResult<()> {
    if slot.is_some() {
        return fail(key_at, Why::Twice).within(|| Seg::Field(name));
    }
    *slot = Some(read(r).within(|| Seg::Field(name))?);
    Ok(())
}

/// A field that must be there: its absence is a failure at the map that lacks it.
/// Inlined: called out of line, every field's value (a chunk's dims are 40 bytes each)
/// was moved through it once more.
#[inline(always)]
fn need<T>(v: Option<T>, name: &'static str, map_at: usize) -> ReadResult<T> {
    match v {
        Some(v) => Ok(v),
        None => fail(map_at, Why::Missing).within(|| Seg::Field(name)),
    }
}

/// Reads a struct's fields, in any order, into one `Option` each (a missing one is left
/// `None` for the caller); a field named twice is a failure, one it does not know is
/// skipped. Each `read` is an `ReadResult<T>`; a failure in it gets the field's name on its path.
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

impl<'a> Reader<'a> {
    fn u64s(&mut self) -> ReadResult<Vec<u64>> {
        self.vec(INT, Self::u64)
    }

    fn dims(&mut self) -> ReadResult<Dims> {
        let n = self.array_len(INT)?;
        // Inline up to DIMS_INLINE, else exactly n on the heap.
        let mut v = Dims::with_capacity(n);
        for i in 0..n {
            v.push(self.u64().within(|| Seg::Index(i))?);
        }
        Ok(v)
    }

    fn dtype(&mut self) -> ReadResult<DType> {
        let at = self.pos;
        // Compared as bytes: a name that matches is ASCII, so no UTF-8 check is needed first.
        let name = self.str_bytes()?;
        match DType::ALL.into_iter().find(|d| d.name().as_bytes() == name) {
            Some(d) => Ok(d),
            None => fail(at, Why::UnknownDtype(String::from_utf8_lossy(name).into_owned())),
        }
    }

    /// `nil` or `[start, stop]`.
    fn flat(&mut self) -> ReadResult<Option<[u64; 2]>> {
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
    fn layout(&mut self) -> ReadResult<BTreeMap<String, String>> {
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

    fn metadata(&mut self) -> ReadResult<Metadata> {
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

    fn file(&mut self) -> ReadResult<FileMeta> {
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

    fn tensor(&mut self) -> ReadResult<TensorMeta> {
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

    fn chunk(&mut self) -> ReadResult<ChunkMeta> {
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

    fn object(&mut self) -> ReadResult<ObjectMeta> {
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

    fn entry(&mut self) -> ReadResult<ObjectEntry> {
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
