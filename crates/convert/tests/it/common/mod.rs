//! Shared by the convert tests: checkpoints saved by ranks as threads, safetensors files
//! written and read back by hand.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use dckpt::storage::Storage;
use dckpt::{Checkpointer, SaveOptions, SaveState, ThreadGroup};
use dckpt_format::{SafetensorsEntry, parse_safetensors_header, safetensors_header};
use dckpt_shard_spec::{DType, ShardedObject, ShardedTensor};

/// Deterministic bytes.
pub fn pattern(n: usize, seed: u32) -> Vec<u8> {
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed.wrapping_mul(97)) >> 13) as u8).collect()
}

/// Each rank's pieces with their bytes, saved by `world` ranks as threads.
pub fn save_ranks(
    storage: &Arc<dyn Storage>,
    world: usize,
    pieces: impl Fn(usize) -> (Vec<(ShardedTensor, Vec<u8>)>, Vec<(ShardedObject, Vec<u8>)>) + Sync,
) {
    let ranks = ThreadGroup::new(world).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let (pieces, storage) = (&pieces, storage.clone());
                s.spawn(move || {
                    let (tensors, objects) = pieces(r);
                    let mut state = SaveState::new();
                    for (t, d) in &tensors {
                        state.push_tensor(t.clone(), d);
                    }
                    for (o, d) in &objects {
                        state.push_object(o.clone(), d);
                    }
                    Checkpointer::new(Arc::new(c)).save(&storage, &state, &SaveOptions::default()).unwrap();
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    });
}

/// Rows `r0..r1` of a row-major tensor whose rows are `row` bytes.
pub fn rows(data: &[u8], row: usize, r0: usize, r1: usize) -> Vec<u8> {
    data[r0 * row..r1 * row].to_vec()
}

/// Every tensor of a safetensors file: name -> (dtype name, shape, bytes).
pub fn read_safetensors(storage: &dyn Storage, file: &str) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let bytes = storage.get(file).unwrap();
    let h = parse_safetensors_header(&bytes, file).unwrap();
    let mut out = BTreeMap::new();
    let mut end = 0;
    for e in h.entries {
        let [b, x] = e.data_offsets;
        end = end.max(x);
        let at = h.data_start as usize;
        out.insert(e.name, (e.dtype, e.shape, bytes[at + b as usize..at + x as usize].to_vec()));
    }
    assert_eq!(h.data_start + end, bytes.len() as u64, "{file}: the data section ends where the tensors do");
    assert_eq!(h.metadata.get("format").map(String::as_str), Some("pt"));
    out
}

/// A safetensors file of `tensors` (laid back to back in the order given).
pub fn safetensors_file(tensors: &[(&str, DType, Vec<u64>, Vec<u8>)]) -> Vec<u8> {
    let entries: Vec<SafetensorsEntry> = tensors
        .iter()
        .map(|(k, d, s, b)| SafetensorsEntry {
            name: k.to_string(),
            dtype: *d,
            shape: s.clone().into(),
            len: b.len() as u64,
        })
        .collect();
    let mut out = safetensors_header(&entries, &BTreeMap::from([("format".to_string(), "pt".to_string())]));
    for (_, _, _, b) in tensors {
        out.extend_from_slice(b);
    }
    out
}

/// A safetensors file from a header written as JSON and `data` after it.
pub fn raw_safetensors(json: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(data);
    out
}
