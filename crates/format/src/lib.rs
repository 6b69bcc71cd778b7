//! The dckpt on-storage format, version 1, as values and bytes: what a checkpoint's files
//! hold and how they are encoded, decoded and checked. `docs/format.md` is the
//! specification; this crate is its reference implementation.
//!
//! It owns:
//! - the metadata file's types ([`Metadata`], [`FileMeta`], [`TensorMeta`], [`ChunkMeta`],
//!   [`ObjectMeta`], [`ObjectEntry`]) and constants ([`META_NAME`], [`FORMAT_VERSION`], ...);
//! - its framing ([`frame`], [`unframe`]: magic, version, length, CRC-32; [`check_meta_bytes`],
//!   the size limit a reader checks before it reads the file);
//! - the body's MessagePack codec, by hand: the writer produces exactly the bytes of
//!   `rmp_serde::to_vec_named`, also from borrowed views ([`MetadataView`], [`encode_view`])
//!   so that a save encodes straight from its plan; the one reader takes every MessagePack
//!   encoding of the body's types, skips fields it does not know, and names the path of
//!   whatever it refuses;
//! - validation of a decoded metadata file ([`Metadata::validate`]: plain names, every piece
//!   inside its file, data sections tiled, exact-once coverage);
//! - safetensors headers ([`safetensors_header`] writes one, [`parse_safetensors_header`]
//!   reads one);
//! - block checksums ([`BlockCrc`], [`block_crc`], [`blocks_in`]);
//! - the naming of a checkpoint's files ([`data_file_name`], [`parse_data_file_name`],
//!   [`is_data_file_name`]).
//!
//! It holds dckpt's own format only: PyTorch's files (pickles, `torch.save` zips, DCP
//! metadata) are `dckpt-torch-format`'s, which reports through this crate's [`FormatError`].
//!
//! It deliberately does no IO (bytes in, `Vec<u8>` out), spawns nothing and has no async:
//! reading files, the commit protocol, planning and loading are the engine's. A third-party
//! reader, a converter or a fuzz target needs this crate alone. Decoding treats every byte
//! as untrusted: sizes are checked before use, arithmetic is checked, nothing is allocated
//! by a declared length, and a failure is a [`FormatError`] naming the file, the field and
//! its [`FormatErrorKind`] (a newer format, another file, damage, a bad encoding, an
//! inconsistency), never a panic.
//!
//! ```
//! use dckpt_format::{FORMAT_VERSION, FormatErrorKind, Metadata, frame, unframe};
//!
//! // The smallest checkpoint: no files, nothing stored.
//! let m = Metadata {
//!     format_version: FORMAT_VERSION,
//!     save_id: "0123456789abcdef".into(),
//!     writer: "example".into(),
//!     block_bytes: 1 << 20,
//!     layout: Default::default(),
//!     files: vec![],
//!     tensors: vec![],
//!     objects: vec![],
//! };
//! let bytes = m.encode();
//! assert_eq!(Metadata::decode(&bytes, "dckpt.meta").unwrap(), m);
//!
//! // The framing alone: the body is MessagePack that any library reads.
//! let body = unframe(&bytes, "dckpt.meta").unwrap();
//! assert_eq!(frame(body), bytes);
//!
//! // A newer format is told apart from damage.
//! let mut newer = bytes.clone();
//! newer[8] = 2;
//! let e = Metadata::decode(&newer, "dckpt.meta").unwrap_err();
//! assert_eq!(e.kind(), &FormatErrorKind::UnsupportedVersion { found: 2, supported: 1 });
//! let mut flipped = bytes;
//! flipped[30] ^= 1;
//! let e = Metadata::decode(&flipped, "dckpt.meta").unwrap_err();
//! assert!(matches!(e.kind(), FormatErrorKind::Damaged { .. }), "{e}");
//! ```
#![warn(missing_docs)]

mod checksum;
mod codec;
mod error;
mod frame;
mod grid;
mod meta;
mod names;
mod safetensors;
mod validate;

pub use checksum::{BlockCrc, block_crc, blocks_in};
pub use codec::{ChunkView, LAYOUT_ENTRIES_MAX, MetadataView, TensorView, encode_view, write_metadata};
pub use error::{FormatError, FormatErrorKind};
pub use frame::{FORMAT_VERSION, META_BYTES_MAX, META_MAGIC, META_PREFIX_BYTES, check_meta_bytes, frame, unframe};
pub use meta::{
    BLOCK_BYTES_DEFAULT, BLOCK_BYTES_MAX, ChunkMeta, FileMeta, Metadata, ObjectEntry, ObjectMeta, TensorMeta,
};
pub use names::{
    DataFileName, FILE_NAME_BYTES_MAX, META_NAME, SAVE_ID_DIGITS, check_plain_name, data_file_name, is_data_file_name,
    is_save_id, parse_data_file_name,
};
pub use safetensors::{
    HeaderEntry, SAFETENSORS_HEADER_BYTES_MAX, SafetensorsEntry, SafetensorsHeader, chunk_entry_name,
    parse_safetensors_header, safetensors_header,
};
