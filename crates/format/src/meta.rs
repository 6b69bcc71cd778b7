//! The metadata file's types (`docs/format.md`, section 3) and its whole-file encode and
//! decode.

use std::collections::BTreeMap;

use dckpt_shard_spec::{DType, Dims, FlatRange, Region};
use serde::{Deserialize, Serialize};

use crate::codec::{self, ChunkView, MetadataView, TensorView};
use crate::error::FormatError;
use crate::frame::{FORMAT_VERSION, unframe};

/// Default checksum block of data sections.
pub const BLOCK_BYTES_DEFAULT: u64 = 4 << 20;
/// Largest checksum block a reader accepts.
pub const BLOCK_BYTES_MAX: u64 = 1 << 30;

/// The decoded metadata file: what a checkpoint holds and where every byte of it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metadata {
    /// The format version of the body; it must equal the framing's.
    pub format_version: u32,
    /// Unique id of the save that wrote the checkpoint; data file names start with it.
    pub save_id: String,
    /// The program that wrote it (`dckpt 0.1.0`).
    pub writer: String,
    /// Checksum block of every data section.
    pub block_bytes: u64,
    /// Free-form description of the layout the state was saved with (world size, tp, ...).
    pub layout: BTreeMap<String, String>,
    /// The data files, in rank order.
    pub files: Vec<FileMeta>,
    /// The tensors, sorted by key.
    pub tensors: Vec<TensorMeta>,
    /// The object keys, sorted by key.
    pub objects: Vec<ObjectMeta>,
}

/// One data file. Its data section `[data_start, bytes)` is tiled exactly by the chunks and
/// objects stored in it, each under its own block checksums.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    /// Its plain name inside the checkpoint ([`crate::data_file_name`]).
    pub name: String,
    /// Total length of the file.
    pub bytes: u64,
    /// Where the data section starts: 8 + the safetensors header length.
    pub data_start: u64,
    /// CRC-32 of `[0, data_start)`.
    pub header_crc32: u32,
}

/// One global tensor: what its chunks share, then the chunks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// The tensor's name.
    pub key: String,
    /// Its element type.
    pub dtype: DType,
    /// The whole tensor's shape.
    pub global_shape: Dims,
    /// The stored pieces; together they cover the tensor exactly once.
    pub chunks: Vec<ChunkMeta>,
}

/// One stored chunk of a tensor: its region and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkMeta {
    /// The chunk's box: first index in each dimension.
    pub offset: Dims,
    /// The chunk's box: extent in each dimension.
    pub shape: Dims,
    /// When present, the chunk is elements `a..b` (row-major) of its box.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flat: Option<[u64; 2]>,
    /// Index into [`Metadata::files`].
    pub file: u32,
    /// Byte offset of the chunk's first element in the file.
    pub at: u64,
    /// CRC-32 of each `block_bytes` block of the chunk's bytes (the last one possibly
    /// short), as little-endian u32s.
    #[serde(with = "serde_bytes")]
    pub crc32: Vec<u8>,
}

impl ChunkMeta {
    /// The chunk's region of its tensor.
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

/// One key of opaque objects, laid out on a grid.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectMeta {
    /// The object's name.
    pub key: String,
    /// The grid's shape (`[]` for a single object).
    pub grid_shape: Vec<u64>,
    /// One per grid position.
    pub entries: Vec<ObjectEntry>,
}

/// One object of an [`ObjectMeta`]'s grid and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectEntry {
    /// Its position in the grid.
    pub grid_offset: Vec<u64>,
    /// Index into [`Metadata::files`].
    pub file: u32,
    /// Byte offset of the object's bytes in the file.
    pub at: u64,
    /// Its length in bytes.
    pub len: u64,
    /// CRC-32 per block of the object's bytes, as for chunks.
    #[serde(with = "serde_bytes")]
    pub crc32: Vec<u8>,
}

impl Metadata {
    /// The metadata file's bytes: the framing ([`crate::frame`]) around the MessagePack
    /// body with named fields.
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
        codec::encode_view(self.format_version, view, chunks)
    }

    /// Decodes and fully validates a metadata file; `file` names it in errors.
    pub fn decode(bytes: &[u8], file: &str) -> Result<Metadata, FormatError> {
        let m = Metadata::decode_unvalidated(bytes, file)?;
        m.validate(file)?;
        Ok(m)
    }

    /// Decodes the framing and body without the semantic checks of [`Metadata::validate`]
    /// (for a reader that checked the same bytes before, such as a rank that compared them
    /// with the coordinator's digest).
    pub fn decode_unvalidated(bytes: &[u8], file: &str) -> Result<Metadata, FormatError> {
        let body = unframe(bytes, file)?;
        let m = codec::read_metadata(body).map_err(|e| e.into_error(file))?;
        check_body_version(m.format_version, file)?;
        Ok(m)
    }

    /// The data files a metadata file names, its framing checked but its tensors not read
    /// (a save that replaces a checkpoint needs only these, to remove the old data files).
    /// Fields after `files` are not read, so a repeated field there goes unnoticed.
    pub fn decode_files(bytes: &[u8], file: &str) -> Result<Vec<FileMeta>, FormatError> {
        let body = unframe(bytes, file)?;
        let (version, files) = codec::read_files(body).map_err(|e| e.into_error(file))?;
        check_body_version(version, file)?;
        Ok(files)
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

/// The body's version must be the framing's (which [`unframe`] held to [`FORMAT_VERSION`]).
fn check_body_version(version: u32, file: &str) -> Result<(), FormatError> {
    if version != FORMAT_VERSION {
        return Err(FormatError::invalid(
            file,
            "format_version",
            format!("body and prefix disagree: the body says {version}, the prefix {FORMAT_VERSION}"),
        ));
    }
    Ok(())
}
