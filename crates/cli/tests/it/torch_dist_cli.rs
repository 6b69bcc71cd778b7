//! `dckpt inspect` and `dckpt validate` on the checkpoints PyTorch DCP and Megatron's
//! torch_dist wrote (tests/fixtures/torch, made by scripts/make_torch_fixtures.py).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_dckpt");

fn dckpt(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("running dckpt")
}

fn fixture(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torch").join(name);
    p.to_str().unwrap().to_string()
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn inspect_says_which_format_and_lists_tensors_chunks_and_objects() {
    let o = dckpt(&["inspect", &fixture("dcp-2.15"), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["format"], "dcp");
    assert_eq!(v["versions"][0], "DCP metadata 1.0.0");
    let t = v["tensors"].as_array().unwrap();
    assert_eq!(t.len(), 7);
    let row = t.iter().find(|t| t["key"] == "uneven.weight").unwrap();
    assert_eq!((row["dtype"].as_str(), row["torch_dtype"].as_str()), (Some("f32"), Some("torch.float32")));
    assert_eq!(row["global_shape"], serde_json::json!([5, 3]));
    assert_eq!(row["chunks"], 2);
    assert_eq!(row["regions"][1]["offsets"], serde_json::json!([3, 0]));
    assert_eq!(row["regions"][1]["sizes"], serde_json::json!([2, 3]));
    assert_eq!(row["regions"][1]["file"], "__1_0.distcp");
    assert_eq!(row["bytes"], 60);
    let objects: Vec<&str> = v["objects"].as_array().unwrap().iter().map(|o| o["key"].as_str().unwrap()).collect();
    assert_eq!(objects, ["step", "blob", "config.lr", "config.name"]);
    assert_eq!(v["chunks"], 11);

    let o = dckpt(&["inspect", &fixture("megatron-0.16.1"), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["format"], "torch_dist");
    assert_eq!(v["megatron"]["sharded_backend"], "torch_dist");
    assert!(v["common_bytes"].as_u64().unwrap() > 0);
    let so = &v["objects"][1]["sharded_object"];
    assert_eq!(
        (so["key"].as_str(), so["offset"].clone(), so["shape"].clone()),
        (Some("decoder.extra_state"), serde_json::json!([1]), serde_json::json!([2]))
    );

    let o = dckpt(&["inspect", &fixture("dcp-2.3")]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("PyTorch DCP checkpoint (format dcp)"), "{text}");
    assert!(text.contains("transposed") && text.contains("bfloat16"), "{text}");
}

#[test]
fn validate_proves_coverage_of_sound_checkpoints() {
    for (name, format) in
        [("dcp-2.15", "dcp"), ("dcp-2.3", "dcp"), ("megatron-0.16.1", "torch_dist"), ("etp-ok", "torch_dist")]
    {
        let o = dckpt(&["validate", &fixture(name), "--json"]);
        assert_eq!(o.status.code(), Some(0), "{name}: {}", stderr(&o));
        let v = json(&o);
        assert_eq!(
            (v["format"].as_str(), v["status"].as_str(), v["sound"].as_bool()),
            (Some(format), Some("sound"), Some(true))
        );
        assert_eq!(v["problems"].as_array().unwrap().len(), 0);
        assert_eq!(v["items"].as_u64().unwrap(), v["chunks"].as_u64().unwrap() + v["objects"].as_u64().unwrap());
        assert!(v["bytes_checked"].as_u64().unwrap() > 0);
        assert!(v["checksums"].as_str().unwrap().starts_with("DCP records no checksums"));
    }
    let o = dckpt(&["validate", &fixture("etp-ok")]);
    assert!(stdout(&o).contains("SOUND"), "{}", stdout(&o));
    assert!(stdout(&o).contains("DCP records no checksums of its own"), "{}", stdout(&o));
}

#[test]
fn validate_names_the_etp_bug_tensors_and_the_fraction_covered() {
    let o = dckpt(&["validate", &fixture("etp-bug"), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!((v["status"].as_str(), v["sound"].as_bool()), (Some("problems"), Some(false)));
    assert_eq!(
        v["problems"],
        serde_json::json!([
            "decoder.experts.fc1.weight: covered 50.0% (1/2): gap at [0:2, 4:8, 0:4]",
            "decoder.experts.fc2.weight: covered 50.0% (1/2): gap at [0:2, 0:4, 4:8]",
        ])
    );
    assert_eq!(
        v["incomplete"][0],
        serde_json::json!({"key": "decoder.experts.fc1.weight", "covered": 32, "total": 64})
    );
    let o = dckpt(&["validate", &fixture("etp-bug")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("2 PROBLEMS"), "{}", stdout(&o));
    assert!(stderr(&o).contains("decoder.experts.fc2.weight: covered 50.0% (1/2)"), "{}", stderr(&o));
}

fn copy_of(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_hostile_metadata_exits_one_naming_the_global() {
    let dir = copy_of("dcp-2.15");
    std::fs::write(dir.path().join(".metadata"), b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.")
        .unwrap();
    for cmd in ["inspect", "validate"] {
        let o = dckpt(&[cmd, s(dir.path()), "--json"]);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {}", stderr(&o));
        assert!(stderr(&o).contains("global `os.system` is not on the allow-list"), "{cmd}: {}", stderr(&o));
        let v = json(&o);
        let text = v.to_string();
        assert!(text.contains("os.system"), "{cmd}: {text}");
    }
    let o = dckpt(&["validate", s(dir.path())]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("1 PROBLEMS") && stdout(&o).contains("os.system"), "{}", stdout(&o));
}

#[test]
fn remove_leftovers_is_a_usage_error_on_dcp() {
    let o = dckpt(&["validate", &fixture("dcp-2.15"), "--remove-leftovers"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--remove-leftovers applies to dckpt checkpoints only"), "{}", stderr(&o));
}

#[test]
fn a_truncated_data_file_exits_one_naming_file_and_offset() {
    let dir = copy_of("megatron-0.16.1");
    let f = dir.path().join("__0_1.distcp");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len / 2).unwrap();
    let o = dckpt(&["validate", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v = json(&o);
    let p = v["problems"].as_array().unwrap();
    assert!(!p.is_empty());
    assert!(p.iter().all(|m| m.as_str().unwrap().contains("__0_1.distcp runs past the file's end at")), "{p:?}");
}

#[test]
fn a_directory_with_neither_metadata_is_not_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("__0_0.distcp"), b"x").unwrap();
    let o = dckpt(&["validate", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(json(&o)["status"], "not a checkpoint");
}

#[test]
fn a_dckpt_checkpoint_says_its_format_too() {
    let dir = tempfile::tempdir().unwrap();
    let o = dckpt(&["demo", "--model", "tiny", "--dir", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for cmd in ["inspect", "validate"] {
        let o = dckpt(&[cmd, s(dir.path()), "--json"]);
        assert_eq!(o.status.code(), Some(0), "{cmd}: {}", stderr(&o));
        assert_eq!(json(&o)["format"], "dckpt", "{cmd}");
    }
}

#[test]
fn convert_goes_from_torch_dist_to_dckpt_and_back_with_json_and_both_validate() {
    let dir = tempfile::tempdir().unwrap();
    let mid = dir.path().join("dckpt");
    let back = dir.path().join("torch_dist");
    let (mid, back) = (mid.to_str().unwrap(), back.to_str().unwrap());
    let o = dckpt(&["convert", &fixture("megatron-0.16.1"), mid, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!((v["to"].as_str(), v["source_format"].as_str()), (Some("dckpt"), Some("torch_dist")));
    assert_eq!(v["tensors"], 4);
    let o = dckpt(&["inspect", mid, "--json"]);
    let objects: Vec<String> =
        json(&o)["objects"].as_array().unwrap().iter().map(|o| o["key"].as_str().unwrap().to_string()).collect();
    assert_eq!(objects, ["common.pt", "decoder.extra_state"], "a ShardedObject grid and the common state");
    assert_eq!(dckpt(&["validate", mid]).status.code(), Some(0));

    let o = dckpt(&["convert", mid, back, "--to", "torch_dist", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(
        (v["to"].as_str(), v["tensors"].as_u64(), v["objects"].as_u64()),
        (Some("torch_dist"), Some(4), Some(2))
    );
    assert_eq!(v["common_from_source"], true);
    let o = dckpt(&["validate", back, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    assert_eq!(json(&o)["format"], "torch_dist");
    // The human summary names both ends; a second conversion into the same place exits 1.
    let o = dckpt(&["convert", mid, back, "--to", "torch_dist"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("already exists"), "{}", stderr(&o));
}

/// A safetensors file's tensors: key -> (dtype, bytes).
fn read_safetensors(path: &Path) -> std::collections::BTreeMap<String, (String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let o = v["data_offsets"].as_array().unwrap();
            let (a, b) = (o[0].as_u64().unwrap() as usize, o[1].as_u64().unwrap() as usize);
            (k.clone(), (v["dtype"].as_str().unwrap().to_string(), data[a..b].to_vec()))
        })
        .collect()
}

/// torch_dist (local) -> dckpt (S3) -> torch_dist (S3) -> dckpt (local), each validated,
/// and the last exported and compared with the values the fixture's generator recorded.
/// Needs the S3 server `cargo xtask test` starts (DCKPT_TEST_S3_URL and AWS_*).
#[test]
fn convert_reads_and_writes_s3_on_either_side() {
    let Ok(url) = std::env::var("DCKPT_TEST_S3_URL") else {
        panic!("DCKPT_TEST_S3_URL is not set: run the suite with `cargo xtask test`, which starts a local S3 server")
    };
    let base = format!("{}/convert-torch-{}", url.trim_end_matches('/'), std::process::id());
    let (s3_dckpt, s3_td) = (format!("{base}/dckpt"), format!("{base}/torch_dist"));
    let dir = tempfile::tempdir().unwrap();
    let (back, hf) = (dir.path().join("back"), dir.path().join("hf"));
    let steps: [Vec<&str>; 3] = [
        vec!["convert", "FIXTURE", &s3_dckpt],
        vec!["convert", &s3_dckpt, &s3_td, "--to", "torch_dist"],
        vec!["convert", &s3_td, back.to_str().unwrap()],
    ];
    let fixture_path = fixture("dcp-2.15");
    for step in &steps {
        let args: Vec<&str> = step.iter().map(|a| if *a == "FIXTURE" { fixture_path.as_str() } else { a }).collect();
        let o = dckpt(&[&args[..], &["--json"]].concat());
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        let o = dckpt(&["validate", args[2]]);
        assert_eq!(o.status.code(), Some(0), "validate {}: {}", args[2], stdout(&o));
    }
    let o = dckpt(&["export", back.to_str().unwrap(), hf.to_str().unwrap(), "--format", "safetensors"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let got = read_safetensors(&hf.join("model.safetensors"));
    let exp: serde_json::Value =
        serde_json::from_slice(&std::fs::read(Path::new(&fixture_path).join("expected.json")).unwrap()).unwrap();
    let tensors = exp["tensors"].as_object().unwrap();
    assert_eq!(got.len(), tensors.len());
    for (key, e) in tensors {
        let hex: String = got[key].1.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, e["hex"].as_str().unwrap(), "{key}");
    }
}
