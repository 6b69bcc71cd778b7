//! The metadata body's MessagePack codec, by hand.
//!
//! **Writing** ([`write_metadata`], [`encode_view`]) produces exactly the bytes that
//! `rmp_serde::to_vec_named` writes for [`Metadata`](crate::Metadata) (maps with named
//! fields in declaration order, every number and length in its smallest encoding, `flat`
//! left out when absent), from borrowed views, so a save encodes its metadata straight from
//! its plan. A property test compares the two byte for byte.
//!
//! **Reading** ([`read_metadata`]) is the one decoder: it takes every MessagePack encoding
//! of the body's types (every integer width, non-negative signed integers too, `str8` to
//! `str32`, `bin8` to `bin32`, `array16`/`array32`, `map16`/`map32`, fields in any order,
//! `flat` as `nil`), skips fields it does not know, and refuses everything else with the
//! path of the field and the byte offset: a repeated or missing field, a negative or
//! oversized number, a struct written as an array, bytes left over. Every length is checked
//! against the bytes that remain, and a list's length against the items of their smallest
//! encoding that those bytes can hold, before the list is reserved (exactly), so a
//! declared length never allocates what the input does not hold and memory stays a fixed
//! multiple of the bytes read. It does
//! not recurse beyond the structure's fixed depth: unknown values are skipped by a loop.
//! `reader` holds MessagePack's primitives, `read` the body's types built from them, and
//! `fail` what goes wrong, with the field's path.

mod fail;
mod read;
mod reader;
#[cfg(test)]
mod tests;
mod write;

pub use read::LAYOUT_ENTRIES_MAX;
pub(crate) use read::{read_files, read_metadata};
pub use write::{ChunkView, MetadataView, TensorView, encode_view, write_metadata};
