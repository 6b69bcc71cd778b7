//! `Metadata::decode` on arbitrary bytes: it must return, never panic, never allocate by an
//! unchecked length. Run with `cargo +nightly fuzz run decode_metadata` from `fuzz/`.
//!
//! The input is decoded twice: as a whole file, and framed as the body of one (a valid
//! prefix, length and CRC added) so that mutations reach the MessagePack decoder and the
//! semantic checks instead of stopping at the checksum.
#![no_main]

use dckpt_format::{Metadata, frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = Metadata::decode(data, "fuzz/dckpt.meta");
    let _ = Metadata::decode(&frame(data), "fuzz/dckpt.meta");
});
