//! Hugging Face safetensors models -> dckpt, loaded back at another layout; hostile headers.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::common::*;
use bytes::Bytes;
use dckpt::storage::Storage;
use dckpt::{Checkpointer, KeyPolicy, LoadOptions, LoadRequest, ThreadGroup};
use dckpt_convert::{ConvertError, DckptSource, ExportOptions, HfModel, export, hf_to_dckpt};
use dckpt_shard_spec::{DType, ShardedTensor};

fn put(s: &Arc<dyn Storage>, name: &str, bytes: Vec<u8>) {
    s.put(name, Bytes::from(bytes)).unwrap();
}

/// Loads rows of `key` ([rows, row_bytes / dtype size]) split over `world` ranks, and
/// returns the rows each rank got, concatenated in rank order.
fn load_row_split(ckpt: &Arc<dyn Storage>, key: &str, dtype: DType, shape: [u64; 2], world: usize) -> Vec<u8> {
    let ranks = ThreadGroup::new(world).unwrap();
    let per = shape[0] / world as u64;
    let parts: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let ckpt = ckpt.clone();
                s.spawn(move || {
                    let t = ShardedTensor::chunk(key, dtype, shape, [per * r as u64, 0], [per, shape[1]]);
                    let mut buf = vec![0u8; t.nbytes() as usize];
                    let mut req = LoadRequest::new().tensor(t, &mut buf);
                    let mut opts = LoadOptions::default();
                    opts.strictness.unexpected = KeyPolicy::Ignore;
                    Checkpointer::new(Arc::new(c)).load(&ckpt, &mut req, &opts).unwrap();
                    drop(req);
                    buf
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    parts.concat()
}

#[test]
fn a_single_file_model_converts_and_loads_at_tp2_bit_exact() {
    let hf = dckpt::storage::open("memory://").unwrap();
    let (emb, bias, scalar) = (pattern(8 * 6 * 2, 1), pattern(3 * 4, 2), pattern(8, 3));
    put(
        &hf,
        "model.safetensors",
        safetensors_file(&[
            ("model.embed.weight", DType::Bf16, vec![8, 6], emb.clone()),
            ("model.bias", DType::F32, vec![3], bias.clone()),
            ("step", DType::I64, vec![], scalar.clone()),
            ("empty", DType::F16, vec![0, 4], vec![]),
        ]),
    );
    let model = HfModel::open(hf.clone(), None).unwrap();
    assert_eq!(model.files, ["model.safetensors"]);
    let ckpt = dckpt::storage::open("memory://").unwrap();
    let read = AtomicU64::new(0);
    let r = hf_to_dckpt(&model, &ckpt, &read).unwrap();
    assert_eq!((r.tensors, r.bytes), (4, (emb.len() + bias.len() + scalar.len()) as u64));
    assert_eq!(read.into_inner(), r.bytes);
    assert!(load_row_split(&ckpt, "model.embed.weight", DType::Bf16, [8, 6], 2) == emb);

    // And back out to safetensors: the same bytes.
    let out = dckpt::storage::open("memory://").unwrap();
    export(&DckptSource::open(ckpt).unwrap(), out.as_ref(), &ExportOptions::default(), &AtomicU64::new(0)).unwrap();
    let got = read_safetensors(out.as_ref(), "model.safetensors");
    assert_eq!(got["model.embed.weight"].2, emb);
    assert_eq!(got["model.bias"].2, bias);
    assert_eq!(got["step"], ("I64".into(), vec![], scalar));
    assert_eq!(got["empty"], ("F16".into(), vec![0, 4], vec![]));
}

#[test]
fn a_sharded_model_with_an_index_converts_whole() {
    let hf = dckpt::storage::open("memory://").unwrap();
    let (a, b, c) = (pattern(4 * 4 * 4, 4), pattern(4 * 4 * 4, 5), pattern(16, 6));
    put(&hf, "model-00001-of-00002.safetensors", safetensors_file(&[("a", DType::F32, vec![4, 4], a.clone())]));
    put(
        &hf,
        "model-00002-of-00002.safetensors",
        safetensors_file(&[("b", DType::F32, vec![4, 4], b.clone()), ("c", DType::U8, vec![16], c.clone())]),
    );
    let index = serde_json::json!({
        "metadata": {"total_size": 144},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"},
    });
    put(&hf, "model.safetensors.index.json", serde_json::to_vec(&index).unwrap());
    let model = HfModel::open(hf.clone(), None).unwrap();
    assert_eq!(model.files.len(), 2);
    let ckpt = dckpt::storage::open("memory://").unwrap();
    hf_to_dckpt(&model, &ckpt, &AtomicU64::new(0)).unwrap();
    assert!(load_row_split(&ckpt, "a", DType::F32, [4, 4], 2) == a);
    assert!(load_row_split(&ckpt, "b", DType::F32, [4, 4], 4) == b);

    // An index naming a key its file does not hold is refused, naming both.
    let broken = serde_json::json!({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}});
    put(&hf, "model.safetensors.index.json", serde_json::to_vec(&broken).unwrap());
    let e = HfModel::open(hf.clone(), None).unwrap_err().to_string();
    assert!(e.contains("model.safetensors.index.json") && e.contains("\"b\""), "{e}");

    // An index whose weight_map is empty is broken, not a model of nothing (it converted
    // to an empty checkpoint, with success).
    put(&hf, "model.safetensors.index.json", br#"{"metadata": {}, "weight_map": {}}"#.to_vec());
    let e = HfModel::open(hf.clone(), None).unwrap_err().to_string();
    assert!(e.contains("model.safetensors.index.json") && e.contains("weight_map"), "{e}");

    // A converted model is a checkpoint: converting onto it again is refused.
    let index_ok = serde_json::to_vec(&index).unwrap();
    put(&hf, "model.safetensors.index.json", index_ok);
    let model = HfModel::open(hf, None).unwrap();
    let e = hf_to_dckpt(&model, &ckpt, &AtomicU64::new(0)).unwrap_err();
    assert!(matches!(&e, ConvertError::Engine(e) if matches!(e.kind(), dckpt::ErrorKind::AlreadyExists { .. })), "{e}");
}

/// Opening a model of one file with this header and data fails, naming the file and (when
/// given) the tensor.
fn refused(json: &str, data_len: usize, tensor: Option<&str>, says: &str) {
    let hf = dckpt::storage::open("memory://").unwrap();
    put(&hf, "bad.safetensors", raw_safetensors(json, &vec![0u8; data_len]));
    let e = HfModel::open(hf, Some("bad.safetensors")).expect_err(json).to_string();
    assert!(e.contains("bad.safetensors"), "names the file: {e}");
    if let Some(t) = tensor {
        // As a tensor, or as the header field the parser names.
        assert!(e.contains(&format!("\"{t}\"")) || e.contains(&format!("header.{t}")), "names the tensor {t}: {e}");
    }
    assert!(e.contains(says), "says {says:?}: {e}");
}

#[test]
fn hostile_headers_are_refused_naming_file_and_tensor() {
    refused(r#"{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}"#, 8, Some("w"), "past the end");
    refused(
        r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}"#,
        16,
        Some("b"),
        "overlaps",
    );
    refused(r#"{"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}"#, 4, Some("w"), "dtype");
    refused(
        r#"{"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}}"#,
        4,
        Some("w"),
        "overflows",
    );
    refused(
        r#"{"w": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 4]}}"#,
        4,
        Some("w"),
        "overflows",
    );
    refused(r#"{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}"#, 8, Some("w"), "needs 12");
    refused(
        r#"{"w": {"dtype": "F32", "shape": [1], "data_offsets": [18446744073709551612, 18446744073709551615]}}"#,
        8,
        Some("w"),
        "needs 4",
    );
    refused(r#"{"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}"#, 8, Some("w"), "backwards");
    refused("[1, 2]", 0, None, "JSON");
    // A header length that runs past the file, and one past the limit.
    let hf = dckpt::storage::open("memory://").unwrap();
    let mut f = raw_safetensors("{}", &[]);
    f[..8].copy_from_slice(&1000u64.to_le_bytes());
    put(&hf, "short.safetensors", f.clone());
    let e = HfModel::open(hf.clone(), Some("short.safetensors")).unwrap_err().to_string();
    assert!(e.contains("short.safetensors") && e.contains("past the end"), "{e}");
    f[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    put(&hf, "short.safetensors", f);
    let e = HfModel::open(hf.clone(), Some("short.safetensors")).unwrap_err().to_string();
    assert!(e.contains("short.safetensors") && e.contains("limit"), "{e}");
    put(&hf, "tiny.safetensors", vec![1, 2, 3]);
    let e = HfModel::open(hf, Some("tiny.safetensors")).unwrap_err().to_string();
    assert!(e.contains("tiny.safetensors") && e.contains("shorter"), "{e}");
}
