//! `dckpt inspect` and `validate` on metadata files an operator did not expect: oversized,
//! or crafted with a correct checksum to break what docs/format.md promises.

use std::path::Path;
use std::process::{Command, Output};

use dckpt::format::{META_BYTES_MAX, META_NAME, Metadata};

const BIN: &str = env!("CARGO_BIN_EXE_dckpt");

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs dckpt with its address space held below the size of a metadata file at the limit,
/// so that a command that read such a file would fail to allocate it.
fn dckpt_small(args: &[&str]) -> Output {
    let limit_kib = (META_BYTES_MAX * 3 / 4) >> 10;
    Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {limit_kib} && exec \"$0\" \"$@\""))
        .arg(BIN)
        .args(args)
        .output()
        .expect("running dckpt")
}

fn dckpt(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("running dckpt")
}

// A 1 GiB sparse dckpt.meta was refused "exceeds the limit", but only after the process had
// grown to 1 GiB reading it.
#[test]
fn an_oversized_metadata_file_is_refused_without_reading_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = std::fs::File::create(dir.path().join(META_NAME)).expect("create");
    f.set_len(META_BYTES_MAX + 1).expect("a sparse file");
    for cmd in ["inspect", "validate"] {
        let o = dckpt_small(&[cmd, s(dir.path())]);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("dckpt.meta: length") && e.contains("exceeds the limit of 1073741824"), "{cmd}: {e}");
    }
    // The same address space is enough for a small checkpoint, so the limit above is not
    // what failed the commands.
    let ok = tempfile::tempdir().expect("tempdir");
    let o = dckpt(&["demo", "--model", "tiny", "--dir", s(ok.path())]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for cmd in ["inspect", "validate"] {
        let o = dckpt_small(&[cmd, s(ok.path())]);
        assert_eq!(o.status.code(), Some(0), "{cmd}: {}", stderr(&o));
    }
}

/// A checkpoint of the tiny model in a fresh directory, and its metadata.
fn demo() -> (tempfile::TempDir, Metadata) {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = dckpt(&["demo", "--model", "tiny", "--dir", s(dir.path())]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let bytes = std::fs::read(dir.path().join(META_NAME)).expect("metadata");
    let meta = Metadata::decode(&bytes, META_NAME).expect("valid");
    (dir, meta)
}

/// Renames data file `fi` to `to`, on disk and in a metadata file rewritten to match.
fn rename(dir: &Path, meta: &mut Metadata, fi: usize, to: String) {
    std::fs::rename(dir.join(&meta.files[fi].name), dir.join(&to)).expect("rename");
    meta.files[fi].name = to;
}

// validate called a checkpoint sound when its save id was not 16 lower-case hex digits or a
// data file was renamed: an independent reader written from docs/format.md refuses both.
#[test]
fn validate_and_inspect_refuse_what_the_spec_refuses() {
    let (dir, mut meta) = demo();
    let upper = meta.save_id.to_uppercase();
    assert_ne!(upper, meta.save_id, "a save id with a letter in it");
    for fi in 0..meta.files.len() {
        let to = meta.files[fi].name.replace(&meta.save_id, &upper);
        rename(dir.path(), &mut meta, fi, to);
    }
    meta.save_id = upper;
    std::fs::write(dir.path().join(META_NAME), meta.encode()).expect("write");
    for cmd in ["validate", "inspect"] {
        let o = dckpt(&[cmd, s(dir.path())]);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {}", stderr(&o));
        assert!(stderr(&o).contains("save_id") && stderr(&o).contains("lower-case"), "{cmd}: {}", stderr(&o));
    }

    let (dir, mut meta) = demo();
    let last = meta.files.len() - 1;
    let to = format!("renamed-{}", meta.files[last].name);
    rename(dir.path(), &mut meta, last, to);
    std::fs::write(dir.path().join(META_NAME), meta.encode()).expect("write");
    let o = dckpt(&["validate", s(dir.path())]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains(&format!("files[{last}].name")) && stderr(&o).contains("renamed-"), "{}", stderr(&o));
}
