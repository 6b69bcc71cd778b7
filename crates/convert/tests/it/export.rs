//! `export`: dckpt checkpoints saved by several ranks consolidated into HF safetensors.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use crate::common::*;
use dckpt::storage::Storage;
use dckpt_convert::{
    ConvertError, DckptSource, ExportOptions, KeyFilter, RangeRead, SourceTensor, TensorSource, export, f32_to_bf16,
    f32_to_f16,
};
use dckpt_shard_spec::{DType, ReplicaId, ShardedObject, ShardedTensor};

/// The global tensors of the test checkpoint.
struct Model {
    /// [12, 5] f32, rows split unevenly over 4 ranks.
    w: Vec<u8>,
    /// [6, 8] bf16, columns split over 2 ranks.
    col: Vec<u8>,
    /// [7] i64, replicated on every rank.
    b: Vec<u8>,
    /// optimizer.w.exp_avg [12, 5] f32, saved as flat ranges (ZeRO-1 style) over 4 ranks.
    opt: Vec<u8>,
}

fn model() -> Model {
    Model { w: pattern(12 * 5 * 4, 1), col: pattern(6 * 8 * 2, 2), b: pattern(7 * 8, 3), opt: pattern(12 * 5 * 4, 4) }
}

/// Saves the model from 4 ranks into `storage`.
fn save_model(storage: &Arc<dyn Storage>, m: &Model) {
    let row_cuts = [0usize, 2, 7, 9, 12];
    let flat_cuts = [0u64, 13, 30, 31, 60];
    save_ranks(storage, 4, |r| {
        let mut t = Vec::new();
        let (r0, r1) = (row_cuts[r], row_cuts[r + 1]);
        t.push((
            ShardedTensor::chunk("w", DType::F32, [12, 5], [r0 as u64, 0], [(r1 - r0) as u64, 5]),
            rows(&m.w, 20, r0, r1),
        ));
        if r < 2 {
            // Column half r of each row: 4 bf16 = 8 bytes of each 16-byte row.
            let part: Vec<u8> = m.col.chunks(16).flat_map(|row| row[r * 8..r * 8 + 8].to_vec()).collect();
            t.push((ShardedTensor::chunk("col", DType::Bf16, [6, 8], [0, 4 * r as u64], [6, 4]), part));
        }
        let b = ShardedTensor::whole("b", DType::I64, [7]);
        t.push((if r == 0 { b } else { b.replica(ReplicaId { dp: r as u32, ..ReplicaId::MAIN }) }, m.b.clone()));
        let (f0, f1) = (flat_cuts[r], flat_cuts[r + 1]);
        let mut o = ShardedTensor::whole("optimizer.w.exp_avg", DType::F32, [12, 5]);
        o.region = o.region.narrowed(f0, f1);
        t.push((o, m.opt[f0 as usize * 4..f1 as usize * 4].to_vec()));
        let objects = if r == 0 { vec![(ShardedObject::single("rng"), b"seed".to_vec())] } else { vec![] };
        (t, objects)
    });
}

fn setup() -> (Arc<dyn Storage>, Model) {
    let storage = dckpt::storage::open("memory://").unwrap();
    let m = model();
    save_model(&storage, &m);
    (storage, m)
}

#[test]
fn every_exported_tensor_is_its_global_tensor() {
    let (ckpt, m) = setup();
    let src = DckptSource::open(ckpt).unwrap();
    let out = dckpt::storage::open("memory://").unwrap();
    let progress = AtomicU64::new(0);
    let r = export(&src, out.as_ref(), &ExportOptions::default(), &progress).unwrap();
    assert_eq!(r.files.len(), 1);
    assert_eq!(r.files[0].name, "model.safetensors");
    assert_eq!(r.index, None);
    assert_eq!((r.tensors, r.skipped_objects, r.skipped_tensors), (4, 1, 0));
    assert_eq!(r.total_size, (m.w.len() + m.col.len() + m.b.len() + m.opt.len()) as u64);
    assert_eq!(progress.into_inner(), r.total_size);
    assert_eq!(out.list("").unwrap().len(), 1, "no index for one file");
    let got = read_safetensors(out.as_ref(), "model.safetensors");
    assert_eq!(got["w"], ("F32".into(), vec![12, 5], m.w.clone()));
    assert_eq!(got["col"], ("BF16".into(), vec![6, 8], m.col.clone()));
    assert_eq!(got["b"], ("I64".into(), vec![7], m.b.clone()));
    assert_eq!(got["optimizer.w.exp_avg"], ("F32".into(), vec![12, 5], m.opt.clone()));
}

#[test]
fn max_shard_size_cuts_files_and_the_index_names_every_key_once() {
    let (ckpt, m) = setup();
    let src = DckptSource::open(ckpt).unwrap();
    let out = dckpt::storage::open("memory://").unwrap();
    // Sorted: b (56 B), col (96 B), optimizer.w.exp_avg (240 B), w (240 B); at most 160 B a
    // shard: [b, col], [optimizer...], [w].
    let opts = ExportOptions { max_shard_size: 160, ..ExportOptions::default() };
    let r = export(&src, out.as_ref(), &opts, &AtomicU64::new(0)).unwrap();
    let names: Vec<&str> = r.files.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    );
    assert_eq!(r.index.as_deref(), Some("model.safetensors.index.json"));
    let index: serde_json::Value = serde_json::from_slice(&out.get("model.safetensors.index.json").unwrap()).unwrap();
    assert_eq!(index["metadata"]["total_size"], r.total_size);
    let map: BTreeMap<String, String> = serde_json::from_value(index["weight_map"].clone()).unwrap();
    assert_eq!(map.len(), 4);
    assert_eq!(map["b"], names[0]);
    assert_eq!(map["col"], names[0]);
    assert_eq!(map["optimizer.w.exp_avg"], names[1]);
    assert_eq!(map["w"], names[2]);
    let mut seen = BTreeMap::new();
    for f in &names {
        for (k, v) in read_safetensors(out.as_ref(), f) {
            assert_eq!(map[&k], *f, "{k} is where the index says");
            assert!(seen.insert(k, v.2).is_none(), "a key twice");
        }
    }
    assert_eq!(seen["w"], m.w);
    assert_eq!(seen["col"], m.col);
}

#[test]
fn include_and_exclude_pick_keys_and_an_exclude_wins() {
    let (ckpt, _) = setup();
    let src = DckptSource::open(ckpt).unwrap();
    let out = dckpt::storage::open("memory://").unwrap();
    let filter = KeyFilter { include: vec!["*w*".into(), "b".into()], exclude: vec!["optimizer.*".into()] };
    let r =
        export(&src, out.as_ref(), &ExportOptions { filter, ..ExportOptions::default() }, &AtomicU64::new(0)).unwrap();
    assert_eq!((r.tensors, r.skipped_tensors), (2, 2));
    let got = read_safetensors(out.as_ref(), "model.safetensors");
    assert_eq!(got.keys().collect::<Vec<_>>(), ["b", "w"]);
    // A filter that selects nothing (a typo) is an error, and writes nothing.
    let empty = dckpt::storage::open("memory://").unwrap();
    let filter = KeyFilter { include: vec!["modle.*".into()], exclude: Vec::new() };
    let opts = ExportOptions { filter, ..ExportOptions::default() };
    let e = export(&src, empty.as_ref(), &opts, &AtomicU64::new(0)).unwrap_err();
    assert!(matches!(e, ConvertError::Options { .. }) && e.to_string().contains("select none of its 4 tensors"), "{e}");
    assert!(empty.list("").unwrap().is_empty());
}

#[test]
fn dtype_casts_floats_bit_exact_and_leaves_integers() {
    let storage = dckpt::storage::open("memory://").unwrap();
    let vals: Vec<f32> = vec![
        1.0,
        -2.5,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        f32::from_bits(1),           // the smallest f32 subnormal
        f32::from_bits(0x3f80_8000), // a bf16 tie
        65520.0,                     // past the largest half
        2f32.powi(-25),              // half the smallest half subnormal: a tie
        3.0 * 2f32.powi(-25),
        1e-6,
    ];
    let f32_bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let ints = pattern(4 * 8, 9);
    save_ranks(&storage, 1, |_| {
        (
            vec![
                (ShardedTensor::whole("f", DType::F32, [vals.len() as u64]), f32_bytes.clone()),
                (ShardedTensor::whole("i", DType::I64, [4]), ints.clone()),
            ],
            vec![],
        )
    });
    let src = DckptSource::open(storage).unwrap();
    for (dtype, name, f) in
        [(DType::Bf16, "BF16", f32_to_bf16 as fn(f32) -> u16), (DType::F16, "F16", f32_to_f16 as fn(f32) -> u16)]
    {
        let out = dckpt::storage::open("memory://").unwrap();
        let opts = ExportOptions { dtype: Some(dtype), ..ExportOptions::default() };
        let r = export(&src, out.as_ref(), &opts, &AtomicU64::new(0)).unwrap();
        assert_eq!(r.cast_tensors, 1);
        let got = read_safetensors(out.as_ref(), "model.safetensors");
        assert_eq!(got["i"], ("I64".into(), vec![4], ints.clone()), "integers unchanged");
        let (d, shape, bytes) = &got["f"];
        assert_eq!((d.as_str(), shape.as_slice()), (name, &[vals.len() as u64][..]));
        let bits: Vec<u16> = bytes.chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        assert_eq!(bits, vals.iter().map(|&v| f(v)).collect::<Vec<_>>());
        // What `torch.tensor(vals).to(dtype)` gives (PyTorch 2.15 on CPU).
        let expected: &[u16] = match dtype {
            DType::Bf16 => {
                &[0x3f80, 0xc020, 0xffff, 0x7f80, 0xff80, 0x8000, 0x0000, 0x3f80, 0x4780, 0x3300, 0x33c0, 0x3586]
            }
            _ => &[0x3c00, 0xc100, 0x7e00, 0x7c00, 0xfc00, 0x8000, 0x0000, 0x3c04, 0x7c00, 0x0000, 0x0002, 0x0011],
        };
        assert_eq!(bits, expected, "{name}");
    }
    let out = dckpt::storage::open("memory://").unwrap();
    let e = export(
        &src,
        out.as_ref(),
        &ExportOptions { dtype: Some(DType::I32), ..ExportOptions::default() },
        &AtomicU64::new(0),
    )
    .unwrap_err();
    assert!(matches!(e, ConvertError::Options { .. }), "{e}");
}

/// Counts what is asked of the source it wraps.
struct Watched<S> {
    inner: S,
    reads: Mutex<Vec<u64>>,
}

impl<S: TensorSource> TensorSource for Watched<S> {
    fn tensors(&self) -> &[SourceTensor] {
        self.inner.tensors()
    }
    fn objects(&self) -> &[String] {
        self.inner.objects()
    }
    fn read_ranges(&self, reads: &mut [RangeRead<'_>]) -> dckpt_convert::Result<()> {
        self.reads.lock().unwrap().push(reads.iter().map(|r| r.buf.len() as u64).sum());
        self.inner.read_ranges(reads)
    }
}

#[test]
fn a_tensor_larger_than_the_budget_is_streamed_in_bounded_reads() {
    let storage = dckpt::storage::open("memory://").unwrap();
    // 64 rows of 1 KiB, stored as 4 row chunks by 4 ranks; a budget of 16 KiB (two slabs of
    // 8 KiB), a quarter of the tensor. A second tensor of one 40 KiB row needs flat ranges.
    let big = pattern(64 << 10, 5);
    let wide = pattern(40 << 10, 6);
    save_ranks(&storage, 4, |r| {
        let r0 = 16 * r as u64;
        let mut t = vec![(
            ShardedTensor::chunk("big", DType::F32, [64, 256], [r0, 0], [16, 256]),
            rows(&big, 1024, r0 as usize, r0 as usize + 16),
        )];
        let q = 10 << 10;
        let mut w = ShardedTensor::whole("wide", DType::U8, [1, 40 << 10]);
        w.region = w.region.narrowed((r * q) as u64, ((r + 1) * q) as u64);
        t.push((w, wide[r * q..(r + 1) * q].to_vec()));
        (t, vec![])
    });
    let budget = 16 << 10;
    let src = Watched { inner: DckptSource::open(storage).unwrap(), reads: Mutex::default() };
    for cast in [None, Some(DType::Bf16)] {
        src.reads.lock().unwrap().clear();
        let out = dckpt::storage::open("memory://").unwrap();
        let opts = ExportOptions { buffer_size: budget, dtype: cast, ..ExportOptions::default() };
        export(&src, out.as_ref(), &opts, &AtomicU64::new(0)).unwrap();
        let reads = src.reads.lock().unwrap().clone();
        assert!(reads.len() >= 8, "{reads:?}");
        assert!(reads.iter().all(|&n| n <= budget / 2), "a read over half the budget: {reads:?}");
        let got = read_safetensors(out.as_ref(), "model.safetensors");
        assert_eq!(got["wide"].2, wide);
        match cast {
            None => assert!(got["big"].2 == big),
            Some(_) => {
                let want: Vec<u8> = big
                    .chunks(4)
                    .flat_map(|c| f32_to_bf16(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes())
                    .collect();
                assert!(got["big"].2 == want, "the cast tensor differs");
            }
        }
    }
}

#[test]
fn an_export_does_not_write_over_a_model() {
    let (ckpt, _) = setup();
    let src = DckptSource::open(ckpt).unwrap();
    let out = dckpt::storage::open("memory://").unwrap();
    out.put("model.safetensors", bytes::Bytes::from_static(b"old")).unwrap();
    let e = export(&src, out.as_ref(), &ExportOptions::default(), &AtomicU64::new(0)).unwrap_err();
    assert!(matches!(&e, ConvertError::Exists { location } if location.ends_with("model.safetensors")), "{e}");
    assert_eq!(&out.get("model.safetensors").unwrap()[..], b"old");
}

/// Fails every read of one key.
struct Failing<S> {
    inner: S,
    key: &'static str,
}

impl<S: TensorSource> TensorSource for Failing<S> {
    fn tensors(&self) -> &[SourceTensor] {
        self.inner.tensors()
    }
    fn objects(&self) -> &[String] {
        self.inner.objects()
    }
    fn read_ranges(&self, reads: &mut [RangeRead<'_>]) -> dckpt_convert::Result<()> {
        if reads.iter().any(|r| r.key == self.key) {
            return Err(ConvertError::Options { detail: format!("cannot read {}", self.key) });
        }
        self.inner.read_ranges(reads)
    }
}

#[test]
fn a_failed_read_leaves_no_file_behind() {
    let (ckpt, _) = setup();
    let src = Failing { inner: DckptSource::open(ckpt).unwrap(), key: "w" };
    let out = dckpt::storage::open("memory://").unwrap();
    // Shards [b, col], [optimizer...], [w]: the last one fails after two were written.
    let opts = ExportOptions { max_shard_size: 160, ..ExportOptions::default() };
    let e = export(&src, out.as_ref(), &opts, &AtomicU64::new(0)).unwrap_err();
    assert!(e.to_string().contains("cannot read w"), "{e}");
    assert_eq!(out.list("").unwrap(), vec![], "files left behind");
}

/// A checkpoint replaced while an export reads it (each read is a load of its own) fails
/// the next read, naming both saves, rather than mixing them in one output.
#[test]
fn a_checkpoint_replaced_while_it_is_read_fails_the_next_read() {
    let (ckpt, m) = setup();
    let src = DckptSource::open(ckpt.clone()).unwrap();
    let mut first = vec![0u8; 20];
    src.read_range("w", 0, &mut first).unwrap();
    assert_eq!(first, m.w[..20]);
    let w = pattern(12 * 5 * 4, 9);
    let state = dckpt::SaveState::new().tensor(ShardedTensor::whole("w", DType::F32, [12, 5]), &w);
    let opts = dckpt::SaveOptions { replace: true, ..dckpt::SaveOptions::default() };
    let now = dckpt::Checkpointer::local().save(&ckpt, &state, &opts).unwrap().save_id;
    let mut buf = vec![0u8; 20];
    let e = src.read_range("w", 5, &mut buf).unwrap_err();
    assert!(matches!(&e, ConvertError::Replaced { opened, now: n, .. } if opened == src.save_id() && *n == now), "{e}");
    assert!(e.to_string().contains("replaced while it was read"), "{e}");
    let e = src.read_object("rng", &[], &[]).unwrap_err();
    assert!(matches!(e, ConvertError::Engine(_) | ConvertError::Replaced { .. }), "{e}");
}
