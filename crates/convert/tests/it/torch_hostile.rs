//! Hostile DCP checkpoints: a metadata pickle that names a dangerous global, items past
//! their file's end or at offsets that overflow, sizes that overflow, chunks that overlap by
//! their gap, damaged and cut zip items. Each is a clear error naming what and where;
//! nothing panics, nothing runs.

use std::path::{Path, PathBuf};

use dckpt_convert::ConvertError;
use dckpt_convert::torch_dist::{Checkpoint, validate, validate_with};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/torch")
}

/// A copy of the `dcp-2.15` fixture to damage.
fn copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixtures().join("dcp-2.15")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

fn problems(dir: &Path) -> Vec<String> {
    let storage = dckpt::storage::open(dir.to_str().unwrap()).unwrap();
    let ckpt = Checkpoint::open(storage.as_ref()).unwrap();
    validate(storage.as_ref(), &ckpt, |_| {}).problems
}

/// The problems when every item is streamed rather than read whole.
fn streamed_problems(dir: &Path) -> Vec<String> {
    let storage = dckpt::storage::open(dir.to_str().unwrap()).unwrap();
    let ckpt = Checkpoint::open(storage.as_ref()).unwrap();
    validate_with(storage.as_ref(), &ckpt, 0, |_| {}).problems
}

#[test]
fn a_metadata_pickle_naming_os_system_is_refused_and_nothing_runs() {
    let dir = copy();
    let marker = dir.path().join("pwned");
    // pickle of os.system("touch <marker>"), protocol 2.
    let cmd = format!("touch {}", marker.display());
    let mut p = b"\x80\x02cos\nsystem\nq\x00X".to_vec();
    p.extend_from_slice(&(cmd.len() as u32).to_le_bytes());
    p.extend_from_slice(cmd.as_bytes());
    p.extend_from_slice(b"q\x01\x85q\x02Rq\x03.");
    std::fs::write(dir.path().join(".metadata"), &p).unwrap();
    let storage = dckpt::storage::open(dir.path().to_str().unwrap()).unwrap();
    let e = Checkpoint::open(storage.as_ref()).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ConvertError::Format(_)), "{msg}");
    assert!(msg.contains("global `os.system` is not on the allow-list") && msg.contains(".metadata"), "{msg}");
    assert!(!marker.exists());
}

#[test]
fn an_item_past_its_file_end_is_named() {
    let dir = copy();
    std::fs::copy(fixtures().join("hostile/offset-past-end.metadata"), dir.path().join(".metadata")).unwrap();
    let p = problems(dir.path());
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(p[0].starts_with("row.weight: item at 1000000..1001577 of "), "{p:?}");
    let size = std::fs::metadata(dir.path().join("__0_0.distcp")).unwrap().len();
    assert!(p[0].ends_with(&format!("__0_0.distcp runs past the file's end at {size}")), "{p:?}");
}

#[test]
fn a_truncated_data_file_is_named_per_item() {
    let dir = copy();
    let f = dir.path().join("__1_0.distcp");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 100).unwrap();
    let p = problems(dir.path());
    assert!(!p.is_empty() && p.iter().all(|m| m.contains("__1_0.distcp runs past the file's end")), "{p:?}");
}

#[test]
fn offsets_and_sizes_that_overflow_are_errors_not_panics() {
    let dir = copy();
    std::fs::copy(fixtures().join("hostile/offset-overflow.metadata"), dir.path().join(".metadata")).unwrap();
    let p = problems(dir.path());
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(p[0].starts_with("col.weight: item at offset 18446744073709551600 of "), "{p:?}");
    assert!(p[0].ends_with("with length 1577 overflows"), "{p:?}");

    // A size whose bytes overflow 64 bits is refused as the metadata is read: every reader
    // sizes buffers from it.
    std::fs::copy(fixtures().join("hostile/size-overflow.metadata"), dir.path().join(".metadata")).unwrap();
    let storage = dckpt::storage::open(dir.path().to_str().unwrap()).unwrap();
    let e = Checkpoint::open(storage.as_ref()).unwrap_err().to_string();
    assert!(e.contains("state_dict_metadata[counts].size") && e.contains("more than 2^64 bytes"), "{e}");
}

/// The byte offset in `file` of the item of `key` (its first chunk).
fn item_of(dir: &Path, key: &str) -> (String, u64, u64) {
    let storage = dckpt::storage::open(dir.to_str().unwrap()).unwrap();
    let ckpt = Checkpoint::open(storage.as_ref()).unwrap();
    let (_, t) = ckpt.tensors().find(|(k, _)| *k == key).unwrap();
    let s = ckpt.item(key, Some(&t.chunks[0].offsets)).unwrap();
    (s.relative_path.clone(), s.offset, s.length)
}

#[test]
fn a_cut_zip_item_and_a_flipped_byte_are_named() {
    let dir = copy();
    let (file, offset, length) = item_of(dir.path(), "uneven.weight");
    let path = dir.path().join(&file);
    let mut bytes = std::fs::read(&path).unwrap();
    let mut damaged = bytes.clone();
    // The item's end records zeroed: its zip is cut.
    let end = (offset + length) as usize;
    damaged[end - 22..end].fill(0);
    std::fs::write(&path, &damaged).unwrap();
    for p in [problems(dir.path()), streamed_problems(dir.path())] {
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("uneven.weight: ") && p[0].contains(&format!("{file} (item at {offset})")), "{p:?}");
    }
    let storage = dckpt::storage::open(dir.path().to_str().unwrap()).unwrap();
    let ckpt = Checkpoint::open(storage.as_ref()).unwrap();
    assert!(ckpt.locate_chunk(storage.as_ref(), "uneven.weight", 0).is_err());

    // One byte of the storage flipped: its CRC-32 no longer matches.
    let loc = ckpt.locate_chunk(storage.as_ref(), "col.weight", 0).unwrap();
    bytes[loc.data.start as usize + 3] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    for p in [problems(dir.path()), streamed_problems(dir.path())] {
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("col.weight: ") && p[0].contains("CRC-32"), "{p:?}");
    }
}

/// Chunks that overlap by what they leave uncovered add up to the tensor's element count:
/// an export of that tensor is refused naming it and the chunks (it once wrote the
/// overlapped element twice and left the gap's as it found it), while `--include` of the
/// others still exports them.
#[test]
fn chunks_that_overlap_by_their_gap_are_refused_by_an_export() {
    use dckpt_convert::torch_dist::TorchDistSource;
    use dckpt_convert::{ExportOptions, KeyFilter, export};
    use std::sync::atomic::AtomicU64;

    let dir = copy();
    std::fs::copy(fixtures().join("hostile/overlap-gap.metadata"), dir.path().join(".metadata")).unwrap();
    assert!(problems(dir.path()).iter().any(|p| p.starts_with("counts: ") && p.contains("overlaps")));
    let storage = dckpt::storage::open(dir.path().to_str().unwrap()).unwrap();
    let source = TorchDistSource::open(storage).unwrap();
    let out = dckpt::storage::open("memory://").unwrap();
    let e = export(&source, out.as_ref(), &ExportOptions::default(), &AtomicU64::new(0)).unwrap_err().to_string();
    assert!(e.contains("counts: covered") && e.contains("chunk [0:3] overlaps chunk [2:5]"), "{e}");
    assert!(out.list("").unwrap().is_empty(), "a refused export left files");
    let filter = KeyFilter { include: vec!["col.weight".into()], exclude: Vec::new() };
    let r = export(&source, out.as_ref(), &ExportOptions { filter, ..ExportOptions::default() }, &AtomicU64::new(0));
    assert_eq!(r.unwrap().tensors, 1);
}
