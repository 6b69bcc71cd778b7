//! `dckpt plan` as an operator runs it: exit codes, JSON fields, error lines.

use std::process::{Command, Output};

fn dckpt(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dckpt")).args(args).output().expect("running dckpt")
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

#[test]
fn valid_plan_exits_zero_with_the_documented_fields() {
    let o = dckpt(&["plan", "--model", "tiny", "--world", "8", "--tp", "2", "--ep", "2", "--etp", "2", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&o);
    assert_eq!(v["world_size"], 8);
    assert_eq!(v["dp"], 4);
    assert_eq!(v["expert_dp"], 2);
    assert_eq!(v["valid"], true);
    assert_eq!(v["total_bytes"], v["expected_bytes"]);
    assert!(v["tensors"].as_u64().unwrap() > 0 && v["chunks"].as_u64().unwrap() >= v["tensors"].as_u64().unwrap());
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 8);
    let sum: u64 = ranks.iter().map(|r| r["bytes"].as_u64().unwrap()).sum();
    assert_eq!(sum, v["total_bytes"].as_u64().unwrap());
    assert!(ranks.iter().enumerate().all(|(i, r)| r["rank"] == i as u64));
    assert!(v["empty_ranks"].is_array());
    let meta = v["metadata_bytes"].as_u64().expect("a valid plan sizes its metadata");
    assert!(meta > 24 * v["chunks"].as_u64().unwrap(), "{meta} bytes of metadata");
}

#[test]
fn layerwise_replica0_lists_empty_ranks() {
    let o = dckpt(&[
        "plan",
        "--model",
        "tiny",
        "--world",
        "64",
        "--pp",
        "4",
        "--optimizer",
        "layerwise",
        "--assign",
        "replica0",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0));
    let v = json(&o);
    let empty: Vec<u64> = v["empty_ranks"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert!(empty.len() >= 16, "{empty:?}");
    for r in &empty {
        assert_eq!(v["ranks"][*r as usize]["bytes"], 0);
        assert_eq!(v["ranks"][*r as usize]["chunks"], 0);
    }
}

#[test]
fn injected_etp_bug_exits_one_and_names_the_expert_key() {
    for bug in ["etp-replica-ids", "etp-region"] {
        let o =
            dckpt(&["plan", "--model", "tiny", "--world", "8", "--ep", "2", "--etp", "4", "--inject", bug, "--json"]);
        assert_eq!(o.status.code(), Some(1), "{bug}");
        let v = json(&o);
        assert_eq!(v["valid"], false);
        assert!(v["metadata_bytes"].is_null());
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(stderr.contains("mlp.experts.linear_fc1.weight"), "{stderr}");
    }
}

#[test]
fn invalid_layout_exits_two_with_one_line_and_no_stdout() {
    for args in [
        &["plan", "--model", "tiny", "--world", "6", "--tp", "4"][..],
        &["plan", "--model", "tiny", "--world", "3", "--ep", "3"][..],
        &["plan", "--model", "no-such-model", "--world", "1"][..],
    ] {
        let o = dckpt(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(o.stdout.is_empty(), "{args:?}");
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    }
}

#[test]
fn model_spec_from_a_json_file() {
    let dir = std::env::temp_dir().join(format!("dckpt-plan-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.json");
    std::fs::write(&path, r#"{"vocab_size": 500, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64, "num_layers": 2, "tie_embeddings": true}"#).unwrap();
    let o = dckpt(&["plan", "--model", path.to_str().unwrap(), "--world", "4", "--tp", "2", "--pp", "2", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::write(&path, r#"{"vocab_size": 500, "hiden_size": 32}"#).unwrap();
    let o = dckpt(&["plan", "--model", path.to_str().unwrap(), "--world", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("hiden_size"));
    std::fs::remove_dir_all(&dir).ok();
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A dense two-layer model whose spec names its dtype `dtype`, written to a temp file.
fn spec_with_dtype(dir: &tempfile::TempDir, dtype: &str) -> String {
    let path = dir.path().join(format!("model-{dtype}.json"));
    let spec = format!(
        r#"{{"vocab_size": 500, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64, "num_layers": 2, "dtype": "{dtype}"}}"#
    );
    std::fs::write(&path, spec).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn model_spec_dtype_takes_megatron_and_pytorch_names() {
    let dir = tempfile::tempdir().unwrap();
    let plan = |spec: &str, extra: &[&str]| {
        let mut args = vec!["plan", "--model", spec, "--world", "2", "--tp", "2", "--optimizer", "none", "--json"];
        args.extend_from_slice(extra);
        let o = dckpt(&args);
        assert_eq!(o.status.code(), Some(0), "{spec} {extra:?}: {}", stderr(&o));
        let v = json(&o);
        assert_eq!(v["valid"], true, "{v}");
        assert_eq!(v["total_bytes"], v["expected_bytes"], "{v}");
        v
    };
    let fp32 = plan(&spec_with_dtype(&dir, "fp32"), &[]);
    assert_eq!(fp32["dtype"], "f32");
    // Parameters only: the same model in bf16 is exactly half the bytes.
    let bf16 = plan(&spec_with_dtype(&dir, "bfloat16"), &[]);
    assert_eq!(bf16["dtype"], "bf16");
    assert_eq!(fp32["total_bytes"].as_u64().unwrap(), 2 * bf16["total_bytes"].as_u64().unwrap());
    assert_eq!(plan(&spec_with_dtype(&dir, "torch.float32"), &[])["total_bytes"], fp32["total_bytes"]);
    // --dtype overrides the spec's, by the same names.
    let half = plan(&spec_with_dtype(&dir, "fp32"), &["--dtype", "torch.half"]);
    assert_eq!(half["dtype"], "f16");
    assert_eq!(half["total_bytes"], bf16["total_bytes"]);
}

#[test]
fn an_unknown_dtype_is_an_error_listing_the_accepted_names() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec_with_dtype(&dir, "fp33");
    let o = dckpt(&["plan", "--model", &spec, "--world", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stdout.is_empty());
    let e = stderr(&o);
    assert!(e.contains(&spec) && e.contains("unknown dtype \"fp33\""), "{e}");
    assert!(e.contains("f32 (fp32, float32)") && e.contains("bf16 (bfloat16)"), "{e}");

    let o = dckpt(&["plan", "--model", "tiny", "--world", "1", "--dtype", "fp33"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.contains("--dtype") && e.contains("f16 (fp16, float16, half)"), "{e}");

    // A dtype it knows but that parameters cannot have.
    let o = dckpt(&["plan", "--model", "tiny", "--world", "1", "--dtype", "int8"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("dtype i8 is not a parameter dtype"), "{}", stderr(&o));
}

#[test]
fn parallel_sizes_not_given_are_one() {
    let o = dckpt(&["plan", "--model", "tiny", "--world", "8", "--ep", "4", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    let sizes: Vec<u64> =
        ["tp", "pp", "cp", "ep", "etp", "dp", "expert_dp"].iter().map(|k| v[k].as_u64().unwrap()).collect();
    assert_eq!(sizes, [1, 1, 1, 4, 1, 8, 2], "{v}");
}
