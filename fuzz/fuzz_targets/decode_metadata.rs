//! `Metadata::decode` on arbitrary bytes: it must return, never panic, never allocate by an
//! unchecked length. Run with `cargo +nightly fuzz run decode_metadata` from `fuzz/`.
//!
//! The input is decoded twice: as a whole file, and framed as the body of one (a valid
//! prefix, length and CRC added) so that mutations reach the MessagePack decoder and the
//! semantic checks instead of stopping at the checksum.
#![no_main]

use dckpt_engine::format::{FORMAT_VERSION, META_MAGIC, Metadata};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = Metadata::decode(data, "fuzz/dckpt.meta");
    let mut framed = Vec::with_capacity(data.len() + 28);
    framed.extend_from_slice(&META_MAGIC);
    framed.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    framed.extend_from_slice(&0u32.to_le_bytes());
    framed.extend_from_slice(&(data.len() as u64).to_le_bytes());
    framed.extend_from_slice(data);
    let crc = crc32fast::hash(&framed);
    framed.extend_from_slice(&crc.to_le_bytes());
    let _ = Metadata::decode(&framed, "fuzz/dckpt.meta");
});
