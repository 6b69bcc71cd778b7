//! The on-storage format, version 1 (specified in `docs/format.md`).
//!
//! A checkpoint is the set of objects under one storage root:
//! - `dckpt.meta`, the metadata file and commit marker, written last;
//! - data files `<save_id>-<rank>.safetensors` (and, on object stores that keep objects
//!   small, `<save_id>-<rank>.<n>.safetensors`), each a valid safetensors file whose tensors
//!   are chunks (and objects) that rank wrote.
//!
//! Every byte of every file is under a CRC-32 (IEEE, what `zlib.crc32` computes): the
//! metadata file as a whole; in a data file, its header (`[0, data_start)`) and, for each
//! chunk or object, each `block_bytes` block of its bytes counted from its own start — so a
//! whole chunk is read straight into its destination and verified there, and a partial
//! read verifies the few blocks it touches. The chunks and objects of a file tile its data
//! section exactly, so no byte escapes a checksum.
//!
//! Decoding treats every byte as untrusted: sizes are checked before use, arithmetic is
//! checked, file names are plain names inside the checkpoint, and stored chunks must cover
//! every tensor exactly once. Errors name the file and the field.

use std::collections::{BTreeMap, HashSet};

use dckpt_shard_spec::{
    DType, Dims, FlatRange, ObjectPiece, Region, ShardedObject, ShardedTensor, TensorPiece, checked_numel, numel,
    validate,
};
use serde::{Deserialize, Serialize};

use crate::meta_codec::{ChunkView, MetadataView, TensorView, write_metadata};

/// The metadata file's name inside a checkpoint.
pub const META_NAME: &str = "dckpt.meta";
/// First 8 bytes of the metadata file.
pub const META_MAGIC: [u8; 8] = *b"DCKPTMD\0";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Fixed bytes before the body: magic, version, reserved, body length.
pub const META_PREFIX_BYTES: usize = 24;
/// The largest metadata file a reader accepts.
pub const META_BYTES_MAX: u64 = 1 << 30;
/// Default checksum block of data sections.
pub const BLOCK_BYTES_DEFAULT: u64 = 4 << 20;
/// Largest checksum block a reader accepts.
pub const BLOCK_BYTES_MAX: u64 = 1 << 30;
/// Longest file name a reader accepts.
const FILE_NAME_BYTES_MAX: usize = 255;

/// The decoded metadata file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metadata {
    pub format_version: u32,
    /// Unique id of the save that wrote the checkpoint; data file names start with it.
    pub save_id: String,
    /// The program that wrote it (`dckpt 0.1.0`).
    pub writer: String,
    /// Checksum block of every data section.
    pub block_bytes: u64,
    /// Free-form description of the layout the state was saved with (world size, tp, ...).
    pub layout: BTreeMap<String, String>,
    pub files: Vec<FileMeta>,
    /// Sorted by key.
    pub tensors: Vec<TensorMeta>,
    /// Sorted by key.
    pub objects: Vec<ObjectMeta>,
}

/// One data file. Its data section `[data_start, bytes)` is tiled exactly by the chunks and
/// objects stored in it, each under its own block checksums.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    pub name: String,
    /// Total length of the file.
    pub bytes: u64,
    /// Where the data section starts: 8 + the safetensors header length.
    pub data_start: u64,
    /// CRC-32 of `[0, data_start)`.
    pub header_crc32: u32,
}

/// The CRC-32 of block `i` in a little-endian list of them.
pub fn block_crc(crcs: &[u8], i: u64) -> Option<u32> {
    let at = usize::try_from(i).ok()?.checked_mul(4)?;
    let b = crcs.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Number of `block` blocks in `len` bytes.
pub fn blocks_in(len: u64, block: u64) -> u64 {
    len.div_ceil(block.max(1))
}

/// One global tensor: what its chunks share, then the chunks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    pub key: String,
    pub dtype: DType,
    pub global_shape: Dims,
    pub chunks: Vec<ChunkMeta>,
}

/// One stored chunk of a tensor: its region and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkMeta {
    pub offset: Dims,
    pub shape: Dims,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flat: Option<[u64; 2]>,
    /// Index into `files`.
    pub file: u32,
    /// Byte offset of the chunk's first element in the file.
    pub at: u64,
    /// CRC-32 of each `block_bytes` block of the chunk's bytes (the last one possibly
    /// short), as little-endian u32s.
    #[serde(with = "serde_bytes")]
    pub crc32: Vec<u8>,
}

impl ChunkMeta {
    pub fn region(&self) -> Region {
        Region {
            offset: self.offset.clone(),
            shape: self.shape.clone(),
            flat: self.flat.map(|[start, stop]| FlatRange { start, stop }),
        }
    }

    /// [`ChunkMeta::region`] into `out`, reusing its allocations.
    pub fn region_into(&self, out: &mut Region) {
        out.offset.clone_from(&self.offset);
        out.shape.clone_from(&self.shape);
        out.flat = self.flat.map(|[start, stop]| FlatRange { start, stop });
    }
}

/// One key of objects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectMeta {
    pub key: String,
    pub grid_shape: Vec<u64>,
    pub entries: Vec<ObjectEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectEntry {
    pub grid_offset: Vec<u64>,
    pub file: u32,
    pub at: u64,
    pub len: u64,
    /// CRC-32 per block of the object's bytes, as for chunks.
    #[serde(with = "serde_bytes")]
    pub crc32: Vec<u8>,
}

/// The metadata file's bytes for `view`, with `version` in its body, which holds `chunks`
/// chunks in all (a size guess).
pub(crate) fn encode_view<'a, T, C>(version: u32, view: MetadataView<'a, T>, chunks: usize) -> Vec<u8>
where
    T: ExactSizeIterator<Item = TensorView<'a, C>>,
    C: ExactSizeIterator<Item = ChunkView<'a>>,
{
    // The body is written in place after the prefix; its length is filled in after.
    let guess = 256 + 128 * view.files.len() + 160 * chunks;
    let mut out = Vec::with_capacity(META_PREFIX_BYTES + guess);
    out.extend_from_slice(&META_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&[0; 8]);
    write_metadata(&mut out, version, view);
    let body_len = (out.len() - META_PREFIX_BYTES) as u64;
    out[16..24].copy_from_slice(&body_len.to_le_bytes());
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// A malformed or damaged checkpoint file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {field}: {detail}")]
pub struct FormatError {
    pub file: String,
    pub field: String,
    pub detail: String,
}

fn ferr(file: &str, field: impl Into<String>, detail: impl Into<String>) -> FormatError {
    FormatError { file: file.to_string(), field: field.into(), detail: detail.into() }
}

impl Metadata {
    /// The metadata file's bytes: magic, version, reserved, body length, MessagePack body
    /// with named fields, CRC-32 of everything before it.
    pub fn encode(&self) -> Vec<u8> {
        let tensors = self.tensors.iter().map(|t| TensorView {
            key: &t.key,
            dtype: t.dtype,
            global_shape: &t.global_shape,
            chunks: t.chunks.iter().map(ChunkView::of),
        });
        let chunks: usize = self.tensors.iter().map(|t| t.chunks.len()).sum();
        let view = MetadataView {
            save_id: &self.save_id,
            writer: &self.writer,
            block_bytes: self.block_bytes,
            layout: &self.layout,
            files: &self.files,
            tensors,
            objects: &self.objects,
        };
        encode_view(self.format_version, view, chunks)
    }

    /// Decodes and fully validates a metadata file; `file` names it in errors.
    pub fn decode(bytes: &[u8], file: &str) -> Result<Metadata, FormatError> {
        let m = Metadata::decode_unvalidated(bytes, file)?;
        m.validate(file)?;
        Ok(m)
    }

    /// The data files a metadata file names, its framing checked but its tensors not read
    /// (a save that replaces a checkpoint needs only these, to remove the old data files).
    pub fn decode_files(bytes: &[u8], file: &str) -> Result<Vec<FileMeta>, FormatError> {
        let (version, body) = Metadata::framed_body(bytes, file)?;
        match crate::meta_codec::read_files(body) {
            Some((v, _)) if v != version => Err(ferr(file, "format_version", "body and prefix disagree")),
            Some((_, files)) => Ok(files),
            None => Metadata::decode_body_of(version, body, file).map(|m| m.files),
        }
    }

    /// Decodes the framing and body without the semantic checks of [`Metadata::validate`].
    pub fn decode_unvalidated(bytes: &[u8], file: &str) -> Result<Metadata, FormatError> {
        let (version, body) = Metadata::framed_body(bytes, file)?;
        Metadata::decode_body_of(version, body, file)
    }

    /// A body whose framing said `version`: the fast reader's, or serde's.
    fn decode_body_of(version: u32, body: &[u8], file: &str) -> Result<Metadata, FormatError> {
        let m = match crate::meta_codec::read_metadata(body) {
            Some(m) => m,
            None => Metadata::decode_body(body, file)?,
        };
        if m.format_version != version {
            return Err(ferr(file, "format_version", "body and prefix disagree"));
        }
        Ok(m)
    }

    /// The format version in the prefix and the body, the framing checked (limit, magic,
    /// version, length, CRC).
    fn framed_body<'b>(bytes: &'b [u8], file: &str) -> Result<(u32, &'b [u8]), FormatError> {
        if bytes.len() as u64 > META_BYTES_MAX {
            return Err(ferr(file, "length", format!("{} bytes exceeds the {} limit", bytes.len(), META_BYTES_MAX)));
        }
        let Some(prefix) = bytes.get(..META_PREFIX_BYTES) else {
            return Err(ferr(
                file,
                "length",
                format!("{} bytes is shorter than the {META_PREFIX_BYTES}-byte prefix", bytes.len()),
            ));
        };
        if prefix[..8] != META_MAGIC {
            return Err(ferr(file, "magic", "not a dckpt metadata file"));
        }
        let version = u32::from_le_bytes(prefix[8..12].try_into().expect("4 bytes"));
        if version != FORMAT_VERSION {
            return Err(ferr(
                file,
                "format_version",
                format!("version {version} is not supported (this build reads {FORMAT_VERSION})"),
            ));
        }
        let body_len = u64::from_le_bytes(prefix[16..24].try_into().expect("8 bytes"));
        let expect_total = (META_PREFIX_BYTES as u64).checked_add(body_len).and_then(|n| n.checked_add(4));
        if expect_total != Some(bytes.len() as u64) {
            return Err(ferr(file, "body_length", format!("says {body_len} bytes but the file has {}", bytes.len())));
        }
        let crc_at = bytes.len() - 4;
        let stored = u32::from_le_bytes(bytes[crc_at..].try_into().expect("4 bytes"));
        let actual = crc32fast::hash(&bytes[..crc_at]);
        if stored != actual {
            return Err(ferr(
                file,
                "crc32",
                format!("stored {stored:08x}, computed {actual:08x}: the file is damaged"),
            ));
        }
        Ok((version, &bytes[META_PREFIX_BYTES..crc_at]))
    }

    /// The body by serde, for what the fast reader (`meta_codec`) leaves to it: every
    /// encoding serde accepts, and serde's words for what is wrong.
    fn decode_body(body: &[u8], file: &str) -> Result<Metadata, FormatError> {
        // The body must be exactly one MessagePack value. Decoding borrows strings and byte
        // strings from the slice (a declared length beyond the slice is an error, never an
        // allocation).
        match msgpack_value_len(body) {
            None => return Err(ferr(file, "body", "not valid metadata: truncated or malformed MessagePack")),
            Some(n) if n < body.len() => {
                return Err(ferr(file, "body", format!("{} bytes follow the metadata", body.len() - n)));
            }
            Some(_) => {}
        }
        Metadata::deserialize(&mut rmp_serde::Deserializer::from_read_ref(body))
            .map_err(|e| ferr(file, "body", format!("not valid metadata: {e}")))
    }

    /// Semantic checks: plain unique file names, sane sizes, every chunk and object inside
    /// its file's data section, and exact-once coverage of every tensor.
    pub fn validate(&self, file: &str) -> Result<(), FormatError> {
        if self.block_bytes == 0 || self.block_bytes > BLOCK_BYTES_MAX {
            return Err(ferr(file, "block_bytes", format!("{} is outside 1..={BLOCK_BYTES_MAX}", self.block_bytes)));
        }
        check_plain_name(&self.save_id).map_err(|d| ferr(file, "save_id", d))?;
        let mut names = HashSet::new();
        for (i, f) in self.files.iter().enumerate() {
            let field = |n: &str| format!("files[{i}].{n}");
            check_plain_name(&f.name).map_err(|d| ferr(file, field("name"), d))?;
            if f.name == META_NAME || !names.insert(f.name.as_str()) {
                return Err(ferr(file, field("name"), format!("{:?} is used twice", f.name)));
            }
            if f.data_start < 8 || f.data_start > f.bytes {
                return Err(ferr(file, field("data_start"), format!("{} is outside 8..={}", f.data_start, f.bytes)));
            }
        }
        // Every byte of every data section belongs to exactly one checksummed piece.
        let mut spans: Vec<(u32, u64, u64)> = Vec::new();
        let mut pieces: Vec<ShardedTensor> = Vec::new();
        let mut owners: Vec<u32> = Vec::new();
        // One region, refilled for each chunk; cloned only for the coverage check.
        let mut region = Region { offset: Dims::new(), shape: Dims::new(), flat: None };
        check_key_order(file, "tensors", self.tensors.iter().map(|t| t.key.as_str()))?;
        check_key_order(file, "objects", self.objects.iter().map(|o| o.key.as_str()))?;
        for (ti, t) in self.tensors.iter().enumerate() {
            // Coverage below only sees keys that have chunks; a listed tensor without any
            // would load as zeros.
            if t.chunks.is_empty() && numel(&t.global_shape) != 0 {
                return Err(ferr(
                    file,
                    format!("tensors[{ti}] ({}).chunks", t.key),
                    format!("none stored for a tensor of shape {:?}", t.global_shape),
                ));
            }
            for (ci, c) in t.chunks.iter().enumerate() {
                // Named only when something is wrong: this loop runs once per stored chunk.
                let field = || format!("tensors[{ti}] ({}).chunks[{ci}]", t.key);
                c.region_into(&mut region);
                region.check(&t.global_shape).map_err(|e| ferr(file, field(), e.to_string()))?;
                let len =
                    region.numel().checked_mul(t.dtype.size()).ok_or_else(|| ferr(file, field(), "size overflows"))?;
                self.check_span(file, field, c.file, c.at, len, &c.crc32)?;
                spans.push((c.file, c.at, len));
                if t.chunks.len() == 1 && checked_numel(&t.global_shape) == Some(region.numel()) {
                    // One chunk holding every element: exactly once by itself.
                    continue;
                }
                pieces.push(ShardedTensor {
                    key: (&t.key).into(),
                    dtype: t.dtype,
                    global_shape: t.global_shape.clone(),
                    region: region.clone(),
                    replica_id: Default::default(),
                });
                owners.push(c.file);
            }
        }
        let mut objects: Vec<ShardedObject> = Vec::new();
        let mut object_owners: Vec<u32> = Vec::new();
        for (oi, o) in self.objects.iter().enumerate() {
            if o.entries.is_empty() && numel(&o.grid_shape) != 0 {
                return Err(ferr(
                    file,
                    format!("objects[{oi}] ({}).entries", o.key),
                    format!("none stored for a grid of shape {:?}", o.grid_shape),
                ));
            }
            for (ei, e) in o.entries.iter().enumerate() {
                let field = || format!("objects[{oi}] ({}).entries[{ei}]", o.key);
                self.check_span(file, field, e.file, e.at, e.len, &e.crc32)?;
                spans.push((e.file, e.at, e.len));
                objects.push(ShardedObject {
                    key: (&o.key).into(),
                    grid_shape: o.grid_shape.clone(),
                    grid_offset: e.grid_offset.clone(),
                    replica_id: Default::default(),
                });
                object_owners.push(e.file);
            }
        }
        self.check_tiling(file, spans)?;
        // Coverage: the stored chunks are all main replicas; "ranks" here are file indices.
        let tp: Vec<TensorPiece> =
            pieces.iter().zip(&owners).map(|(t, &f)| TensorPiece { rank: f, tensor: t }).collect();
        let op: Vec<ObjectPiece> =
            objects.iter().zip(&object_owners).map(|(o, &f)| ObjectPiece { rank: f, object: o }).collect();
        validate(&tp, &op, None)
            .map_err(|e| ferr(file, "coverage", format!("stored chunks (ranks are file indices): {e}")))?;
        Ok(())
    }

    /// The pieces of each file, sorted, must run back to back from `data_start` to the end.
    fn check_tiling(&self, file: &str, mut spans: Vec<(u32, u64, u64)>) -> Result<(), FormatError> {
        spans.retain(|s| s.2 > 0);
        spans.sort_unstable();
        let mut next: Vec<u64> = self.files.iter().map(|f| f.data_start).collect();
        for (fi, at, len) in spans {
            let f = &self.files[fi as usize];
            if at != next[fi as usize] {
                let what =
                    if at < next[fi as usize] { "overlaps the previous piece" } else { "leaves a gap before it" };
                return Err(ferr(file, format!("files[{fi}] ({})", f.name), format!("the piece at byte {at} {what}")));
            }
            next[fi as usize] = at + len;
        }
        for (fi, f) in self.files.iter().enumerate() {
            if next[fi] != f.bytes {
                return Err(ferr(
                    file,
                    format!("files[{fi}] ({})", f.name),
                    format!("pieces end at byte {} but the file has {}", next[fi], f.bytes),
                ));
            }
        }
        Ok(())
    }

    fn check_span(
        &self,
        file: &str,
        field: impl Fn() -> String,
        fi: u32,
        at: u64,
        len: u64,
        crcs: &[u8],
    ) -> Result<(), FormatError> {
        let blocks = blocks_in(len, self.block_bytes);
        if crcs.len() as u64 != blocks.saturating_mul(4) {
            return Err(ferr(file, format!("{}.crc32", field()), format!("{} bytes for {blocks} blocks", crcs.len())));
        }
        let f = self.files.get(fi as usize).ok_or_else(|| {
            ferr(file, format!("{}.file", field()), format!("file index {fi} of {}", self.files.len()))
        })?;
        let end = at.checked_add(len).ok_or_else(|| ferr(file, format!("{}.at", field()), "offset overflows"))?;
        if at < f.data_start || end > f.bytes {
            return Err(ferr(
                file,
                format!("{}.at", field()),
                format!("bytes {at}..{end} are outside the data section {}..{} of {}", f.data_start, f.bytes, f.name),
            ));
        }
        Ok(())
    }

    /// Bytes of chunk data and objects (what the save wrote, headers excluded).
    pub fn data_bytes(&self) -> u64 {
        // Saturating: each chunk fits its file, but a crafted file can declare huge files.
        let t = self
            .tensors
            .iter()
            .flat_map(|t| t.chunks.iter().map(move |c| c.region().numel().saturating_mul(t.dtype.size())))
            .fold(0u64, u64::saturating_add);
        let o = self.objects.iter().flat_map(|o| o.entries.iter().map(|e| e.len)).fold(0u64, u64::saturating_add);
        t.saturating_add(o)
    }
}

/// The keys of `list` (`tensors` or `objects`) sorted and unique: each after the one before.
fn check_key_order<'a>(file: &str, list: &str, keys: impl Iterator<Item = &'a str>) -> Result<(), FormatError> {
    let mut prev: Option<&str> = None;
    for (i, key) in keys.enumerate() {
        if let Some(p) = prev
            && p >= key
        {
            let what = if p == key {
                "appears twice".to_string()
            } else {
                format!("is out of order ({list} are sorted by key)")
            };
            return Err(ferr(file, format!("{list}[{i}].key"), format!("{key:?} {what}")));
        }
        prev = Some(key);
    }
    Ok(())
}

/// A data file or save id name: `[A-Za-z0-9._-]`, not starting with `.`, at most 255 bytes.
pub fn check_plain_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > FILE_NAME_BYTES_MAX {
        return Err(format!("{name:?} must be 1 to {FILE_NAME_BYTES_MAX} bytes"));
    }
    if name.starts_with('.') || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return Err(format!("{name:?} is not a plain file name ([A-Za-z0-9._-], not starting with '.')"));
    }
    Ok(())
}

/// One tensor entry of a safetensors header.
#[derive(Clone, Debug)]
pub struct SafetensorsEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Dims,
    pub len: u64,
}

/// A safetensors header for `entries` laid out back to back, padded with spaces so the
/// data section starts 8-aligned. Returns the bytes of `[0, data_start)`.
pub fn safetensors_header(entries: &[SafetensorsEntry], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    // Written by hand, in file order, after the 8 bytes of its length: a data file can hold
    // tens of thousands of entries.
    let mut out = Vec::with_capacity(72 + entries.iter().map(|e| e.name.len() + 72).sum::<usize>());
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(b"{\"__metadata__\":");
    out.extend_from_slice(serde_json::to_string(metadata).expect("string map").as_bytes());
    let mut at = 0u64;
    for e in entries {
        out.push(b',');
        push_json_string(&mut out, &e.name);
        out.extend_from_slice(b":{\"dtype\":\"");
        out.extend_from_slice(e.dtype.safetensors_name().as_bytes());
        out.extend_from_slice(b"\",\"shape\":[");
        for (i, d) in e.shape.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            push_u64(&mut out, *d);
        }
        out.extend_from_slice(b"],\"data_offsets\":[");
        push_u64(&mut out, at);
        out.push(b',');
        at += e.len;
        push_u64(&mut out, at);
        out.extend_from_slice(b"]}");
    }
    out.push(b'}');
    while out.len() % 8 != 0 {
        out.push(b' ');
    }
    let n = out.len() as u64 - 8;
    out[..8].copy_from_slice(&n.to_le_bytes());
    out
}

/// `s` as a JSON string, escaped as `serde_json` escapes it.
fn push_json_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let bytes = s.as_bytes();
    // Names almost never need an escape: one pass over every byte (without an early exit,
    // so it vectorizes), then one copy.
    if !bytes.iter().fold(false, |found, &c| found | (c < 0x20) | (c == b'"') | (c == b'\\')) {
        out.extend_from_slice(bytes);
        out.push(b'"');
        return;
    }
    // Runs that need no escape are copied whole.
    let mut run = 0;
    for (i, &c) in bytes.iter().enumerate() {
        let escaped: &[u8] = match c {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..0x20 => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[run..i]);
        run = i + 1;
        if escaped.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(&[b'\\', b'u', b'0', b'0', HEX[usize::from(c >> 4)], HEX[usize::from(c & 15)]]);
        } else {
            out.extend_from_slice(escaped);
        }
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

/// `key@region`, the name of a chunk's entry in its data file's header: what
/// `format!("{key}@{region}")` writes, without the formatting machinery (a file can hold
/// tens of thousands of entries).
pub(crate) fn chunk_entry_name(key: &str, region: &Region) -> String {
    let mut out = Vec::with_capacity(key.len() + 3 + 24 * region.offset.len());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"@[");
    for (i, (o, s)) in region.offset.iter().zip(&region.shape).enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        push_u64(&mut out, *o);
        out.push(b':');
        push_u64(&mut out, o.saturating_add(*s));
    }
    out.push(b']');
    if let Some(r) = region.flat {
        out.extend_from_slice(b" flat[");
        push_u64(&mut out, r.start);
        out.push(b':');
        push_u64(&mut out, r.stop);
        out.push(b')');
    }
    String::from_utf8(out).expect("a str and ASCII")
}

/// `v` in decimal.
fn push_u64(out: &mut Vec<u8>, mut v: u64) {
    // Two digits at a time from a table of "00" to "99".
    const PAIRS: [u8; 200] = {
        let mut t = [0u8; 200];
        let mut i = 0;
        while i < 100 {
            t[2 * i] = b'0' + (i / 10) as u8;
            t[2 * i + 1] = b'0' + (i % 10) as u8;
            i += 1;
        }
        t
    };
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    while v >= 100 {
        let p = (v % 100) as usize * 2;
        v /= 100;
        i -= 2;
        digits[i..i + 2].copy_from_slice(&PAIRS[p..p + 2]);
    }
    if v >= 10 {
        let p = v as usize * 2;
        i -= 2;
        digits[i..i + 2].copy_from_slice(&PAIRS[p..p + 2]);
    } else {
        i -= 1;
        digits[i] = b'0' + v as u8;
    }
    out.extend_from_slice(&digits[i..]);
}

/// CRC-32 per fixed-size block of a byte stream fed in pieces of any size.
#[derive(Debug)]
pub struct BlockCrc {
    block_bytes: u64,
    filled: u64,
    hasher: crc32fast::Hasher,
    crcs: Vec<u8>,
}

impl BlockCrc {
    pub fn new(block_bytes: u64) -> BlockCrc {
        BlockCrc { block_bytes, filled: 0, hasher: crc32fast::Hasher::new(), crcs: Vec::new() }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let room = (self.block_bytes - self.filled) as usize;
            let (now, rest) = data.split_at(room.min(data.len()));
            self.hasher.update(now);
            self.filled += now.len() as u64;
            data = rest;
            if self.filled == self.block_bytes {
                let h = std::mem::take(&mut self.hasher);
                self.crcs.extend_from_slice(&h.finalize().to_le_bytes());
                self.filled = 0;
            }
        }
    }

    /// The CRCs of every block, the last one possibly short, as little-endian u32s, appended
    /// to `out` (so the pieces of a file share one buffer).
    pub fn finish_into(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.crcs);
        if self.filled > 0 {
            out.extend_from_slice(&self.hasher.finalize().to_le_bytes());
        }
    }
}

/// The length of the first MessagePack value in `b`, or `None` when `b` ends inside it or
/// holds a byte that is no MessagePack marker. One pass, no recursion, no allocation.
fn msgpack_value_len(b: &[u8]) -> Option<usize> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_strings_and_numbers_are_written_as_serde_json_writes_them() {
        for name in ["", "plain.key@[0:2, 4:8]", "q\"uote\\back", "ctl\u{0}\u{1f}\n\r\t\u{8}\u{c}", "é∂ ☃ \u{7f}"]
        {
            let mut out = Vec::new();
            push_json_string(&mut out, name);
            assert_eq!(String::from_utf8(out).unwrap(), serde_json::to_string(name).unwrap(), "{name:?}");
        }
        for v in [0, 7, 10, 99, 100, 101, 999, 1000, 12_345, 1 << 40, 10u64.pow(19), u64::MAX] {
            let mut out = Vec::new();
            push_u64(&mut out, v);
            assert_eq!(out, v.to_string().as_bytes());
        }
    }

    #[test]
    fn safetensors_header_is_json_with_contiguous_offsets_and_aligned_data() {
        let entries = [
            SafetensorsEntry { name: "a\"b@[0:2]".into(), dtype: DType::Bf16, shape: vec![2, 3].into(), len: 12 },
            SafetensorsEntry { name: "c".into(), dtype: DType::U8, shape: vec![5].into(), len: 5 },
        ];
        let meta = BTreeMap::from([("format".to_string(), "dckpt".to_string())]);
        let h = safetensors_header(&entries, &meta);
        assert_eq!(h.len() % 8, 0);
        let n = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(n + 8, h.len());
        let v: serde_json::Value = serde_json::from_slice(&h[8..]).unwrap();
        assert_eq!(v["__metadata__"]["format"], "dckpt");
        assert_eq!(v["a\"b@[0:2]"]["dtype"], "BF16");
        assert_eq!(v["a\"b@[0:2]"]["shape"], serde_json::json!([2, 3]));
        assert_eq!(v["a\"b@[0:2]"]["data_offsets"], serde_json::json!([0, 12]));
        assert_eq!(v["c"]["data_offsets"], serde_json::json!([12, 17]));
    }

    #[test]
    fn chunk_entry_names_are_what_region_display_writes() {
        let regions = [
            Region::full(&[]),
            Region::full(&[1024]),
            Region { offset: vec![0, 9_999_999_999].into(), shape: vec![7, u64::MAX].into(), flat: None },
            Region {
                offset: vec![4, 0].into(),
                shape: vec![2, 8].into(),
                flat: Some(FlatRange { start: 3, stop: 11 }),
            },
        ];
        for key in ["w", "decoder.layers.0.q\"é", ""] {
            for r in &regions {
                assert_eq!(chunk_entry_name(key, r), format!("{key}@{r}"));
            }
        }
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

    #[test]
    fn block_crcs_match_a_one_shot_crc_per_block() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let mut b = BlockCrc::new(64);
        for piece in data.chunks(37) {
            b.update(piece);
        }
        let mut out = vec![9; 4];
        b.finish_into(&mut out);
        assert_eq!(out[..4], [9; 4], "appended after what was there");
        let crcs = &out[4..];
        assert_eq!(crcs.len() as u64, 4 * blocks_in(1000, 64));
        for (i, block) in data.chunks(64).enumerate() {
            assert_eq!(block_crc(crcs, i as u64), Some(crc32fast::hash(block)));
        }
        assert_eq!(block_crc(crcs, 16), None);
    }
}
