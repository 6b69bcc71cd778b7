//! `dckpt convert` and `dckpt export` as an operator runs them: a Hugging Face model
//! converted to dckpt and exported back, sharded and cast, with `--json`, and the exit codes
//! of bad options and sources.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use dckpt::format::{SafetensorsEntry, parse_safetensors_header, safetensors_header};
use dckpt::spec::DType;

const BIN: &str = env!("CARGO_BIN_EXE_dckpt");

fn dckpt(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("running dckpt")
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("an exit code")
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

/// A safetensors file of `(name, dtype, shape, bytes)` as the safetensors package lays it out.
fn write_model(path: &Path, tensors: &[(&str, DType, Vec<u64>, Vec<u8>)]) {
    let entries: Vec<SafetensorsEntry> = tensors
        .iter()
        .map(|(n, d, s, b)| SafetensorsEntry {
            name: n.to_string(),
            dtype: *d,
            shape: s.clone().into(),
            len: b.len() as u64,
        })
        .collect();
    let mut bytes = safetensors_header(&entries, &BTreeMap::from([("format".to_string(), "pt".to_string())]));
    for t in tensors {
        bytes.extend_from_slice(&t.3);
    }
    std::fs::write(path, bytes).unwrap();
}

/// name -> (dtype, shape, bytes) of every tensor of a safetensors file.
fn read_model(path: &Path) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let h = parse_safetensors_header(&bytes, &path.display().to_string()).unwrap();
    let at = h.data_start as usize;
    h.entries
        .into_iter()
        .map(|e| {
            let [b, x] = e.data_offsets;
            (e.name, (e.dtype, e.shape, bytes[at + b as usize..at + x as usize].to_vec()))
        })
        .collect()
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn a_model_converted_and_exported_back_is_the_same_and_casts_and_shards_as_asked() {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf.safetensors");
    let w: Vec<f32> = (0..64 * 16).map(|i| (i as f32 - 300.0) * 0.37).collect();
    let tensors = vec![
        ("model.w", DType::F32, vec![64, 16], f32s(&w)),
        ("model.b", DType::F32, vec![16], f32s(&[1.0; 16])),
        ("optimizer.state.w", DType::F32, vec![64, 16], f32s(&w)),
        ("step", DType::I64, vec![], 9i64.to_le_bytes().to_vec()),
    ];
    write_model(&hf, &tensors);
    let ckpt = dir.path().join("ckpt");
    let o = dckpt(&["convert", hf.to_str().unwrap(), ckpt.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stderr));
    let r = json(&o);
    assert_eq!((r["tensors"].as_u64(), r["source_format"].as_str()), (Some(4), Some("safetensors")));
    assert_eq!(r["bytes"].as_u64(), Some(4096 + 64 + 4096 + 8));
    assert!(r["bytes_per_second"].as_f64().unwrap() > 0.0);
    assert!(ckpt.join("dckpt.meta").exists());
    let o = dckpt(&["validate", ckpt.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "the converted checkpoint validates: {}", String::from_utf8_lossy(&o.stdout));

    // Back, unchanged: one model.safetensors with the same tensors.
    let same = dir.path().join("same");
    let o = dckpt(&["export", ckpt.to_str().unwrap(), same.to_str().unwrap(), "--format", "safetensors"]);
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("exported 4 tensors"));
    let got = read_model(&same.join("model.safetensors"));
    for (k, d, s, b) in &tensors {
        assert_eq!(got[*k], (d.safetensors_name().to_string(), s.clone(), b.clone()), "{k}");
    }

    // Cast to bf16, without the optimizer, in shards of at most 2 KB.
    let out = dir.path().join("out");
    let o = dckpt(&[
        "export",
        ckpt.to_str().unwrap(),
        out.to_str().unwrap(),
        "--format",
        "safetensors",
        "--dtype",
        "bf16",
        "--max-shard-size",
        "2KB",
        "--exclude",
        "optimizer.*",
        "--buffer-size",
        "1KiB",
        "--json",
    ]);
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stderr));
    let r = json(&o);
    assert_eq!(
        (r["tensors"].as_u64(), r["skipped_tensors"].as_u64(), r["cast_tensors"].as_u64()),
        (Some(3), Some(1), Some(2))
    );
    // Sorted: model.b (32 B), model.w (2048 B), step (8 B): three shards.
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(32 + 2048 + 8));
    assert_eq!(index["weight_map"]["model.w"], "model-00002-of-00003.safetensors");
    let shard = read_model(&out.join("model-00002-of-00003.safetensors"));
    let want: Vec<u8> = w.iter().flat_map(|&x| dckpt_convert::f32_to_bf16(x).to_le_bytes()).collect();
    assert_eq!(shard["model.w"], ("BF16".to_string(), vec![64, 16], want));
    assert_eq!(read_model(&out.join("model-00003-of-00003.safetensors"))["step"].0, "I64");

    // Exporting onto a model fails (1) and leaves it as it was.
    let before = std::fs::read(same.join("model.safetensors")).unwrap();
    let o = dckpt(&["export", ckpt.to_str().unwrap(), same.to_str().unwrap(), "--format", "safetensors"]);
    assert_eq!(code(&o), 1, "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("already exists"));
    assert_eq!(std::fs::read(same.join("model.safetensors")).unwrap(), before);
}

#[test]
fn bad_options_and_sources_exit_2_and_a_damaged_model_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let d = |p: &str| dir.path().join(p).to_str().unwrap().to_string();
    // Nothing there.
    std::fs::create_dir(dir.path().join("empty")).unwrap();
    let o = dckpt(&["export", &d("empty"), &d("o1"), "--format", "safetensors", "--json"]);
    assert_eq!(code(&o), 2);
    assert!(json(&o)["error"].as_str().unwrap().contains("no dckpt checkpoint"));
    let o = dckpt(&["convert", &d("empty"), &d("c1")]);
    assert_eq!(code(&o), 2);
    // A DCP directory whose metadata is damaged: named, exit 1, nothing written.
    std::fs::create_dir(dir.path().join("dcp")).unwrap();
    std::fs::write(dir.path().join("dcp/.metadata"), b"x").unwrap();
    let o = dckpt(&["convert", &d("dcp"), &d("c2")]);
    assert_eq!(code(&o), 1);
    assert!(String::from_utf8_lossy(&o.stderr).contains(".metadata"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!dir.path().join("c2/dckpt.meta").exists());
    // No conversion from torch_dist to torch_dist.
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/torch/dcp-2.15");
    let o = dckpt(&["convert", fixture, &d("c3"), "--to", "torch_dist"]);
    assert_eq!(code(&o), 2);
    // Bad sizes and dtypes are usage errors.
    let hf = dir.path().join("m.safetensors");
    write_model(&hf, &[("w", DType::F32, vec![2], f32s(&[1.0, 2.0]))]);
    let o = dckpt(&["convert", hf.to_str().unwrap(), &d("ck")]);
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stderr));
    let bads = [["--max-shard-size", "5XB"], ["--max-shard-size", "0"], ["--buffer-size", "8"], ["--dtype", "int8"]];
    for bad in bads.into_iter().chain([["--dtype", "nope"]]) {
        let o = dckpt(&["export", &d("ck"), &d("o2"), "--format", "safetensors", bad[0], bad[1]]);
        assert_eq!(code(&o), 2, "{bad:?}: {}", String::from_utf8_lossy(&o.stderr));
        // The output it made to write into is not left behind, empty.
        assert!(!dir.path().join("o2").exists(), "{bad:?}");
    }
    let o = dckpt(&["export", &d("ck"), &d("o2")]);
    assert_eq!(code(&o), 2, "--format is required");
    // An output in the source's own directory is refused, naming it, before anything is written.
    let before = std::fs::read_dir(dir.path().join("ck")).unwrap().count();
    for args in [
        vec!["convert", hf.to_str().unwrap(), dir.path().to_str().unwrap()],
        vec!["convert", &d("ck"), &d("ck/"), "--to", "torch_dist"],
    ] {
        let o = dckpt(&[&args[..], &["--json"]].concat());
        assert_eq!(code(&o), 2, "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        assert!(json(&o)["error"].as_str().unwrap().contains("the source's own directory"), "{args:?}");
    }
    let o = dckpt(&["export", &d("ck"), &d("ck"), "--format", "safetensors"]);
    assert_eq!(code(&o), 2, "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read_dir(dir.path().join("ck")).unwrap().count(), before);
    // A header whose tensor runs past the end of the file: named, exit 1.
    let mut bytes = std::fs::read(&hf).unwrap();
    bytes.truncate(bytes.len() - 4);
    std::fs::write(&hf, bytes).unwrap();
    let o = dckpt(&["convert", hf.to_str().unwrap(), &d("ck2")]);
    assert_eq!(code(&o), 1);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("m.safetensors") && err.contains("tensor \"w\"") && err.contains("past the end"), "{err}");
    assert!(!dir.path().join("ck2/dckpt.meta").exists());
}
