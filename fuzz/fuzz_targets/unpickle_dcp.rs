//! The restricted unpickler and the DCP readers on arbitrary bytes: they must return, never
//! panic, never allocate by an unchecked length, never call anything. Run with
//! `cargo +nightly fuzz run unpickle_dcp` from `fuzz/`.
//!
//! The input is decoded as a pickle with DCP's allow-list and with none, as a `.metadata`
//! file, and as an item's `data.pkl`, so that mutations of a real metadata file (the
//! corpus) reach the typed readers too.
#![no_main]

use dckpt_torch_format::dcp::{DcpMetadata, TorchSaveTensor};
use dckpt_torch_format::pickle::{DCP_METADATA_GLOBALS, unpickle};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = unpickle(data, DCP_METADATA_GLOBALS);
    let _ = unpickle(data, &[]);
    let _ = DcpMetadata::decode(data, "fuzz/.metadata");
    if let Ok(t) = TorchSaveTensor::decode(data, "fuzz/data.pkl") {
        let _ = t.span();
        let _ = t.check_storage(data.len() as u64, "fuzz/data.pkl");
    }
});
