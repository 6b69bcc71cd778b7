//! Every fixture written by real PyTorch / Megatron (scripts/make_torch_fixtures.py) read
//! through the chunk reader and compared, byte for byte, with the values its generator
//! recorded; and the validator's verdict on each.

use std::path::PathBuf;

use dckpt::storage::Storage;
use dckpt_convert::torch_dist::{Checkpoint, read_chunk, torch_name, validate, validate_with};
use dckpt_convert::{SourceFormat, detect};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torch").join(name)
}

fn open(name: &str) -> std::sync::Arc<dyn Storage> {
    dckpt::storage::open(fixture(name).to_str().unwrap()).unwrap()
}

fn expected(name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture(name).join("expected.json")).unwrap()).unwrap()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Copies a row-major box of `sizes` at `offsets` into the row-major global buffer.
fn place(global: &mut [u8], shape: &[u64], offsets: &[u64], sizes: &[u64], chunk: &[u8], isz: usize) {
    let n = shape.len();
    if n == 0 {
        global.copy_from_slice(chunk);
        return;
    }
    let row = sizes[n - 1] as usize * isz;
    let rows: u64 = sizes[..n - 1].iter().product();
    let mut idx = vec![0u64; n - 1];
    for r in 0..rows as usize {
        let mut at = 0u64;
        for d in 0..n {
            let i = if d < n - 1 { idx[d] } else { 0 } + offsets[d];
            at = at * shape[d] + i;
        }
        let at = at as usize * isz;
        global[at..at + row].copy_from_slice(&chunk[r * row..(r + 1) * row]);
        for d in (0..n - 1).rev() {
            idx[d] += 1;
            if idx[d] < sizes[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Reads every tensor of `name` and compares it with expected.json; returns the keys read.
fn read_all(name: &str) -> usize {
    let storage = open(name);
    let ckpt = Checkpoint::open(storage.as_ref()).unwrap();
    let exp = expected(name);
    let incomplete: Vec<&str> =
        exp["incomplete"].as_array().map(|a| a.iter().map(|v| v.as_str().unwrap()).collect()).unwrap_or_default();
    let tensors = exp["tensors"].as_object().unwrap();
    assert_eq!(ckpt.tensors().count(), tensors.len(), "{name}: tensor count");
    for (key, e) in tensors {
        let (_, t) = ckpt.tensors().find(|(k, _)| k == key).unwrap_or_else(|| panic!("{name}: no tensor {key}"));
        assert_eq!(torch_name(t.dtype), e["dtype"].as_str().unwrap(), "{name}: {key} dtype");
        let shape: Vec<u64> = e["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(t.size, shape, "{name}: {key} shape");
        let want = unhex(e["hex"].as_str().unwrap());
        let isz = t.dtype.size() as usize;
        let mut got = vec![0u8; want.len()];
        for (i, c) in t.chunks.iter().enumerate() {
            let loc = ckpt.locate_chunk(storage.as_ref(), key, i).unwrap();
            let mut buf = vec![0u8; loc.nbytes() as usize];
            read_chunk(storage.as_ref(), &loc, &mut buf).unwrap();
            place(&mut got, &shape, &c.offsets, &c.sizes, &buf, isz);
            // Each chunk on its own matches the expected values where it lies.
            let mut alone = vec![0u8; want.len()];
            let mut expect_part = vec![0u8; want.len()];
            place(&mut alone, &shape, &c.offsets, &c.sizes, &buf, isz);
            let mask = vec![0xffu8; buf.len()];
            place(&mut expect_part, &shape, &c.offsets, &c.sizes, &mask, isz);
            for ((a, w), m) in alone.iter().zip(&want).zip(&expect_part) {
                assert_eq!(*a, *w & *m, "{name}: {key} chunk {i}");
            }
        }
        if !incomplete.contains(&key.as_str()) {
            assert_eq!(got, want, "{name}: {key} bytes");
        }
    }
    let objects: Vec<&str> = exp["objects"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for o in &objects {
        // DCP flattens nested dicts of plain values into dotted keys in recent releases.
        assert!(ckpt.objects().any(|k| k == *o || k.starts_with(&format!("{o}."))), "{name}: object {o}");
    }
    tensors.len()
}

#[test]
fn dcp_2_15_reads_bit_exact() {
    assert_eq!(read_all("dcp-2.15"), 7);
    assert_eq!(detect(open("dcp-2.15").as_ref(), None).unwrap(), SourceFormat::Dcp);
}

#[test]
fn dcp_2_3_reads_bit_exact() {
    assert_eq!(read_all("dcp-2.3"), 7);
    let ckpt = Checkpoint::open(open("dcp-2.3").as_ref()).unwrap();
    // 2.3 records no metadata version; 2.15 does.
    assert_eq!(ckpt.metadata.version, None);
    assert_eq!(Checkpoint::open(open("dcp-2.15").as_ref()).unwrap().metadata.version.as_deref(), Some("1.0.0"));
}

#[test]
fn megatron_reads_bit_exact() {
    assert_eq!(read_all("megatron-0.16.1"), 4);
    let storage = open("megatron-0.16.1");
    assert_eq!(detect(storage.as_ref(), None).unwrap(), SourceFormat::TorchDist);
    let ckpt = Checkpoint::open(storage.as_ref()).unwrap();
    assert!(ckpt.common_bytes.unwrap() > 0);
    assert!(ckpt.metadata.extra_attributes.contains(&"all_local_plans".to_string()));
    let o = dckpt_convert::torch_dist::sharded_object("decoder.extra_state/shard_1_2").unwrap();
    assert_eq!((o.key.as_str(), o.offset, o.shape), ("decoder.extra_state", vec![1], vec![2]));
}

#[test]
fn transposed_tensor_keeps_its_stride() {
    for name in ["dcp-2.15", "dcp-2.3"] {
        let storage = open(name);
        let ckpt = Checkpoint::open(storage.as_ref()).unwrap();
        let loc = ckpt.locate_chunk(storage.as_ref(), "transposed", 0).unwrap();
        assert_eq!((loc.tensor.size.clone(), loc.tensor.stride.clone()), (vec![3, 2], vec![1, 3]), "{name}");
    }
}

#[test]
fn every_fixture_but_the_etp_bug_validates() {
    for name in ["dcp-2.15", "dcp-2.3", "megatron-0.16.1", "etp-ok"] {
        let storage = open(name);
        let ckpt = Checkpoint::open(storage.as_ref()).unwrap();
        let mut seen = 0;
        let r = validate(storage.as_ref(), &ckpt, |n| seen = n);
        assert!(r.ok(), "{name}: {:?}", r.problems);
        assert_eq!(r.items, r.chunks + r.objects, "{name}");
        assert!(seen > 0 && seen == r.bytes_checked, "{name}");
        // Every item streamed (located by ranged reads, CRCs a window at a time) instead.
        let s = validate_with(storage.as_ref(), &ckpt, 0, |_| {});
        assert!(s.ok(), "{name}: {:?}", s.problems);
        assert_eq!(s.items, r.items, "{name}");
        assert!(s.bytes_checked > 0, "{name}");
    }
}

#[test]
fn etp_bug_reports_its_expert_tensors_covered_half() {
    assert_eq!(read_all("etp-bug"), 3);
    let storage = open("etp-bug");
    let ckpt = Checkpoint::open(storage.as_ref()).unwrap();
    let r = validate(storage.as_ref(), &ckpt, |_| {});
    assert!(!r.ok());
    assert_eq!(validate_with(storage.as_ref(), &ckpt, 0, |_| {}).problems, r.problems);
    let keys: Vec<&str> = r.incomplete.iter().map(|c| c.key.as_str()).collect();
    assert_eq!(keys, ["decoder.experts.fc1.weight", "decoder.experts.fc2.weight"]);
    assert!(r.incomplete.iter().all(|c| c.covered * 2 == c.total));
    assert_eq!(
        r.problems,
        [
            "decoder.experts.fc1.weight: covered 50.0% (1/2): gap at [0:2, 4:8, 0:4]",
            "decoder.experts.fc2.weight: covered 50.0% (1/2): gap at [0:2, 0:4, 4:8]",
        ]
    );
}

/// Nothing assumes a local file system: the same checkpoint in memory storage reads and
/// validates the same.
#[test]
fn a_checkpoint_in_other_storage_reads_the_same() {
    let local = open("megatron-0.16.1");
    let mem = dckpt::storage::MemoryStorage::new();
    for o in local.list("").unwrap() {
        mem.put(&o.path, local.get(&o.path).unwrap()).unwrap();
    }
    let (a, b) = (Checkpoint::open(local.as_ref()).unwrap(), Checkpoint::open(&mem).unwrap());
    assert_eq!(a.metadata, b.metadata);
    assert_eq!(detect(&mem, None).unwrap(), SourceFormat::TorchDist);
    for (key, t) in a.tensors() {
        for i in 0..t.chunks.len() {
            let (la, lb) = (a.locate_chunk(local.as_ref(), key, i).unwrap(), b.locate_chunk(&mem, key, i).unwrap());
            assert_eq!(la, lb);
            let (mut x, mut y) = (vec![0u8; la.nbytes() as usize], vec![1u8; lb.nbytes() as usize]);
            read_chunk(local.as_ref(), &la, &mut x).unwrap();
            read_chunk(&mem, &lb, &mut y).unwrap();
            assert_eq!(x, y, "{key}");
        }
    }
    let r = validate(&mem, &b, |_| {});
    assert!(r.ok() && r.items == 11, "{:?}", r.problems);
}
