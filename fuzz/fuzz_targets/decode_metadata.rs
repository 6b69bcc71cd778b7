//! `Metadata::decode` on arbitrary bytes: it must return, never panic, never allocate by an
//! unchecked length. Run with `cargo +nightly fuzz run decode_metadata` from `fuzz/`.
#![no_main]

use dckpt_engine::format::Metadata;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = Metadata::decode(data, "fuzz/dckpt.meta");
});
