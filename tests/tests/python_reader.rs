//! The format is readable from Python with standard packages: `scripts/read_checkpoint.py`
//! (stdlib + msgpack, and safetensors when present) reads a checkpoint the engine wrote,
//! verifies every checksum, rebuilds every tensor bit-exact, and rejects a damaged file.
//!
//! Needs `DCKPT_TEST_PYTHON`, a python that can import msgpack; `cargo xtask test` provides it.

mod handmade;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dckpt_engine::SaveOptions;
use dckpt_format::{META_NAME, Metadata};
use handmade::Handmade;

fn python() -> PathBuf {
    match std::env::var_os("DCKPT_TEST_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "DCKPT_TEST_PYTHON is not set: it must name a python that can import msgpack (and \
             safetensors). Run the suite with `cargo xtask test`, which installs them into \
             target/moto-venv and sets it, or set it yourself."
        ),
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/read_checkpoint.py")
}

fn read(dir: &Path, extra: &[&str]) -> Output {
    let py = python();
    Command::new(&py)
        .arg(script())
        .arg(dir)
        .args(extra)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", py.display()))
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn python_reads_and_verifies_an_engine_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = dckpt_storage::open(dir.path().to_str().expect("utf-8")).expect("open");
    let state = Handmade::new(3, 21);
    for o in state.save_all(&storage, &SaveOptions { block_bytes: 64, ..SaveOptions::default() }) {
        o.expect("save");
    }
    let out = read(dir.path(), &["--json", "--assemble"]);
    assert!(out.status.success(), "{}", text(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(summary["format_version"], 1, "{summary}");
    assert_eq!(summary["files"], 3, "{summary}");
    assert_eq!(summary["safetensors_checked"], true, "the safetensors package must be installed: {summary}");
    assert!(summary["blocks_verified"].as_u64().unwrap_or(0) >= 6, "{summary}");
    let tensors = summary["tensors"].as_array().expect("tensors");
    assert_eq!(tensors.len(), state.tensors.len());
    for g in &state.tensors {
        let t = tensors.iter().find(|t| t["key"] == g.key).unwrap_or_else(|| panic!("{} missing: {summary}", g.key));
        assert_eq!(t["dtype"], g.dtype.name());
        assert_eq!(t["global_shape"], serde_json::json!(g.shape));
        assert_eq!(t["crc32"], crc32fast::hash(&g.bytes), "{}: python rebuilt other bytes", g.key);
    }
    let objects = &summary["objects"][0];
    let crcs: Vec<u32> = state.objects.iter().map(|o| crc32fast::hash(o)).collect();
    assert_eq!(objects["crc32"], serde_json::json!(crcs), "{summary}");
    // The plain listing works too.
    let out = read(dir.path(), &[]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn python_rejects_damage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = dckpt_storage::open(dir.path().to_str().expect("utf-8")).expect("open");
    let state = Handmade::new(2, 22);
    for o in state.save_all(&storage, &SaveOptions { block_bytes: 64, ..SaveOptions::default() }) {
        o.expect("save");
    }
    let bytes = storage.get(META_NAME).expect("metadata");
    let meta = Metadata::decode(&bytes, META_NAME).expect("metadata");
    let mut targets: Vec<(String, u64, &str)> =
        vec![(META_NAME.into(), 0, "magic"), (META_NAME.into(), 9, "format_version"), (META_NAME.into(), 40, "crc32")];
    for f in &meta.files {
        targets.push((f.name.clone(), 3, "header_crc32"));
        targets.push((f.name.clone(), f.bytes - 1, "crc32["));
    }
    for (name, pos, field) in targets {
        let path = dir.path().join(&name);
        let good = std::fs::read(&path).expect("read");
        let mut bad = good.clone();
        bad[pos as usize] ^= 0x10;
        std::fs::write(&path, &bad).expect("write");
        let out = read(dir.path(), &[]);
        std::fs::write(&path, &good).expect("restore");
        assert!(!out.status.success(), "{name} byte {pos}: the reader did not notice\n{}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&name) && err.contains(field), "{name} byte {pos}: expected {field}: {err}");
    }
    std::fs::remove_file(dir.path().join(META_NAME)).expect("remove");
    let out = read(dir.path(), &[]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not a checkpoint"),
        "{}",
        text(&out)
    );
}
