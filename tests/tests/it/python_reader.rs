//! The format is readable from Python with standard packages: `scripts/read_checkpoint.py`
//! (stdlib + msgpack, and safetensors when present) reads a checkpoint the engine wrote,
//! verifies every checksum, rebuilds every tensor bit-exact, and rejects a damaged file.
//!
//! Needs `DCKPT_TEST_PYTHON`, a python that can import msgpack; `cargo xtask test` provides it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::handmade::Handmade;
use dckpt_engine::SaveOptions;
use dckpt_format::{META_NAME, Metadata};

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

/// Writes `body` framed as the metadata file of `dir`.
fn write_body(dir: &Path, body: &[u8]) {
    std::fs::write(dir.join(META_NAME), dckpt_format::frame(body)).expect("write the metadata");
}

/// The Python reader and the Rust decoder refuse `body` alike, naming `field`.
fn both_refuse(dir: &Path, body: &[u8], field: &str) {
    write_body(dir, body);
    let out = read(dir, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(field), "python, expected {field}:\n{}", text(&out));
    let e = Metadata::decode(&dckpt_format::frame(body), META_NAME).expect_err("the decoder refuses it too");
    assert!(e.field().contains(field), "rust, expected {field}: {e}");
}

// An independent reader written from docs/format.md and the decoder must agree: what one
// refuses, the other does, and both read what dckpt writes.
#[test]
fn python_refuses_what_the_spec_refuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = dckpt_storage::open(dir.path().to_str().expect("utf-8")).expect("open");
    let state = Handmade::new(2, 23);
    for o in state.save_all(&storage, &SaveOptions { block_bytes: 64, ..SaveOptions::default() }) {
        o.expect("save");
    }
    let good = storage.get(META_NAME).expect("metadata").to_vec();
    let meta = Metadata::decode(&good, META_NAME).expect("metadata");
    let body = good[24..good.len() - 4].to_vec();
    let find = |what: &[u8]| body.windows(what.len()).position(|w| w == what).expect("in the body") + what.len();
    let splice = |at: usize, cut: usize, with: &[u8]| [&body[..at], with, &body[at + cut..]].concat();

    // A known field written twice; an unknown one written twice is skipped by both.
    assert_eq!(body[0], 0x88, "eight fields");
    let mut twice = body.clone();
    twice[0] = 0x89;
    twice.extend_from_slice(b"\xa6writer\xa1x");
    both_refuse(dir.path(), &twice, "writer");
    let mut unknown = body.clone();
    unknown[0] = 0x8a;
    unknown.extend_from_slice(b"\xa6future\x01\xa6future\x02");
    write_body(dir.path(), &unknown);
    assert!(read(dir.path(), &[]).status.success(), "an unknown field twice");
    assert_eq!(Metadata::decode(&dckpt_format::frame(&unknown), META_NAME).as_ref(), Ok(&meta));
    // Types: a dtype as an integer, a block list as an array, a name as bin.
    let dtype = find(b"\xa5dtype");
    let len = usize::from(body[dtype] & 0x1f) + 1;
    both_refuse(dir.path(), &splice(dtype, len, b"\x08"), "tensors[0].dtype");
    let crc = find(b"\xa5crc32");
    let n = usize::from(body[crc + 1]);
    let as_array: Vec<u8> =
        [0x90 | n as u8].into_iter().chain(body[crc + 2..crc + 2 + n].iter().map(|b| b & 0x7f)).collect();
    both_refuse(dir.path(), &splice(crc, 2 + n, &as_array), "crc32");
    let name = find(b"\xa4name");
    assert_eq!(body[name], 0xd9, "a name of 34 bytes is a str8");
    // The same length byte after a bin8 marker: the name as binary.
    both_refuse(dir.path(), &splice(name, 1, b"\xc4"), "files[0].name");
    // Names: an upper-case save id, a renamed data file.
    let id = find(b"\xa7save_id\xb0");
    both_refuse(dir.path(), &splice(id, 16, meta.save_id.to_uppercase().as_bytes()), "save_id");
    let first = meta.files[0].name.as_bytes();
    let at = find(first) - first.len();
    let renamed = meta.files[0].name.replace("-00000.", "-0000x.");
    both_refuse(dir.path(), &splice(at, first.len(), renamed.as_bytes()), "files[0].name");
    std::fs::write(dir.path().join(META_NAME), &good).expect("restore");
    assert!(read(dir.path(), &[]).status.success());

    // A header of another save, its checksum fixed in the metadata: verify and Python both
    // see it.
    let f = &meta.files[1];
    let path = dir.path().join(&f.name);
    let mut data = std::fs::read(&path).expect("read");
    let header = &mut data[..f.data_start as usize];
    let at = header.windows(16).position(|w| w == meta.save_id.as_bytes()).expect("the save id in the header");
    header[at..at + 16].copy_from_slice(b"fedcba9876543210");
    let mut m = meta.clone();
    m.files[1].header_crc32 = crc32fast::hash(header);
    std::fs::write(&path, &data).expect("write");
    std::fs::write(dir.path().join(META_NAME), m.encode()).expect("write the metadata");
    let out = read(dir.path(), &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("__metadata__.save_id"), "{}", text(&out));
    let r = dckpt_engine::verify::verify(storage.as_ref(), |_| {}).expect("verify");
    assert!(r.problems.iter().any(|p| p.contains("__metadata__.save_id")), "{r:?}");
}
