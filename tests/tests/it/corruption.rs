//! Corruption: a flipped bit anywhere in a checkpoint on local disk is reported by `verify`
//! and makes a full load fail rather than return wrong data, whether the load reads by
//! system calls or copies out of mappings.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::handmade::Handmade;
use dckpt_engine::format::{META_NAME, Metadata};
use dckpt_engine::verify::verify;
use dckpt_engine::{SaveOptions, read_metadata_local};
use dckpt_layout::{ModelSpec, OptimizerMode};
use dckpt_storage::Storage;
use dckpt_tests::{Setup, load_and_check, save_model};

/// XORs `mask` into byte `pos` of `path`, in place.
fn flip(path: &Path, pos: u64, mask: u8) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).expect("open");
    let mut b = [0u8];
    f.read_exact_at(&mut b, pos).expect("read");
    b[0] ^= mask;
    f.write_all_at(&b, pos).expect("write");
}

/// What the checks made of one flipped byte.
#[derive(Debug, Default)]
struct Tally {
    flips: u64,
    /// Flips that a full load reported (the rest loaded correct data).
    load_failed: u64,
}

/// Flips bit `pos % 8` of byte `pos` of `name`, runs `verify` and `load`, restores the byte.
/// `verify` must see a problem; `load` must fail or return exactly the saved data
/// (`load_must_fail`: fail).
fn check_flip(
    dir: &Path,
    storage: &Arc<dyn Storage>,
    name: &str,
    pos: u64,
    load_must_fail: bool,
    load: &dyn Fn() -> Result<(), String>,
    tally: &mut Tally,
) {
    let path = dir.join(name);
    let mask = 1u8 << (pos % 8);
    flip(&path, pos, mask);
    let verdict = verify(storage.as_ref(), |_| {});
    let loaded = load();
    flip(&path, pos, mask);
    let what = format!("{name} byte {pos} (mask {mask:#04x})");
    if let Ok(r) = &verdict {
        assert!(!r.ok(), "{what}: verify found nothing: {r:?}");
    }
    match loaded {
        Ok(()) => assert!(!load_must_fail, "{what}: the load did not notice"),
        Err(e) => {
            assert!(!e.contains("WRONG DATA"), "{what}: the load returned wrong data: {e}");
            tally.load_failed += 1;
        }
    }
    tally.flips += 1;
}

/// The checkpoint directory `dir` opened as the CLI opens it (reads copied out of a mapping
/// of each file, each piece checked just before it is copied) or plainly (reads by system
/// call, checked after): the load checks every byte either way.
fn opened(dir: &Path, mapped_reads: bool) -> Arc<dyn Storage> {
    let local = dckpt_storage::LocalConfig { mapped_reads, ..Default::default() };
    let options = dckpt_storage::OpenOptions { local, ..Default::default() };
    dckpt_storage::open_with(dir.to_str().expect("utf-8 path"), &options).expect("open")
}

/// Both loads of `load(mapped_reads)`: the first error where both fail, and a wrong-data
/// error where only one does (one of them let a flip through).
fn both_ways(load: impl Fn(bool) -> Result<(), String>) -> Result<(), String> {
    match (load(false), load(true)) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(e), Err(_)) => Err(e),
        (plain, mapped) => {
            Err(format!("WRONG DATA: the loads disagree: plain reads {plain:?}, mapped reads {mapped:?}"))
        }
    }
}

/// The checkpoint is sound before and after the flips.
fn assert_sound(storage: &Arc<dyn Storage>) {
    let r = verify(storage.as_ref(), |_| {}).expect("verify");
    assert!(r.ok() && r.leftovers.is_empty(), "{r:?}");
}

// Every byte of every file of a small checkpoint, with 32-byte checksum blocks so files span
// several blocks and end in a partial one.
#[test]
fn every_flipped_byte_is_detected() {
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = dckpt_storage::open(dir.path().to_str().expect("utf-8 path")).expect("open");
    let state = Handmade::new(3, 11);
    for o in state.save_all(&storage, &SaveOptions { block_bytes: 32, ..SaveOptions::default() }) {
        o.expect("save");
    }
    assert_sound(&storage);
    state.load_check1(&storage).expect("clean load");
    let meta = read_metadata_local(storage.as_ref()).expect("metadata");
    assert_eq!(meta.files.len(), 3);
    // Some chunks span several blocks and end in a partial one.
    let multi = meta.tensors.iter().flat_map(|t| &t.chunks).filter(|c| c.crc32.len() >= 12).count();
    assert!(multi >= 3, "{multi} chunks of 3 or more blocks");
    let stores = [opened(dir.path(), false), opened(dir.path(), true)];
    let load = || both_ways(|mapped| state.load_check1(&stores[usize::from(mapped)]));

    let mut tally = Tally::default();
    let meta_len = std::fs::metadata(dir.path().join(META_NAME)).expect("stat").len();
    for pos in 0..meta_len {
        check_flip(dir.path(), &storage, META_NAME, pos, true, &load, &mut tally);
    }
    for f in &meta.files {
        for pos in 0..f.bytes {
            // A load checks the header of every file it reads from, and every block it reads.
            check_flip(dir.path(), &storage, &f.name, pos, true, &load, &mut tally);
        }
    }
    assert_sound(&storage);
    state.load_check1(&storage).expect("load after restoring");
    eprintln!(
        "{} flips in metadata, headers and data, all caught by verify and load; {:.1?}",
        tally.flips,
        started.elapsed()
    );
}

// The reference model: the metadata in full, and in each data file its first bytes, the
// header's end, the first and last data bytes, and a spread of positions in between.
#[test]
fn tiny_model_flips_are_detected() {
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = dckpt_storage::open(dir.path().to_str().expect("utf-8 path")).expect("open");
    let spec = ModelSpec::preset("tiny").expect("tiny");
    let model = Setup::new(4, 2, 1, 1, 2, 1, OptimizerMode::Distributed).model(&spec);
    for o in save_model(&storage, &model, 5) {
        o.expect("save");
    }
    assert_sound(&storage);
    let stores = [opened(dir.path(), false), opened(dir.path(), true)];
    let load_one = |mapped: bool| {
        let results = load_and_check(&stores[usize::from(mapped)], &model, 5);
        // The element check names the first wrong element; the load errors name a file.
        match results.into_iter().find_map(Result::err) {
            None => Ok(()),
            Some(e) if e.contains("element") => Err(format!("WRONG DATA: {e}")),
            Some(e) => Err(e),
        }
    };
    let load = || both_ways(load_one);
    load().expect("clean load");
    let bytes = std::fs::read(dir.path().join(META_NAME)).expect("metadata");
    let meta = Metadata::decode(&bytes, META_NAME).expect("decode");
    let mut tally = Tally::default();
    // The metadata file: a spread of positions (every byte would be one full load each).
    let step = (bytes.len() as u64 / 397).max(1);
    for pos in (0..bytes.len() as u64).step_by(step as usize).chain([bytes.len() as u64 - 1]) {
        check_flip(dir.path(), &storage, META_NAME, pos, true, &load, &mut tally);
    }
    for f in &meta.files {
        let ds = f.data_start;
        let spread = (0..64).map(|k| ds + (f.bytes - ds) * k / 64);
        for pos in [0, 7, 8, ds / 2, ds - 1].into_iter().chain(spread).chain([f.bytes - 1]) {
            check_flip(dir.path(), &storage, &f.name, pos, true, &load, &mut tally);
        }
    }
    assert_sound(&storage);
    load().expect("load after restoring");
    eprintln!(
        "tiny model: {} files, {} flips caught by verify and load; {:.1?}",
        meta.files.len(),
        tally.flips,
        started.elapsed()
    );
}

// A data file cut short, grown by a byte, or gone; the metadata file cut short or grown.
#[test]
fn resized_and_missing_files_are_detected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = dckpt_storage::open(dir.path().to_str().expect("utf-8 path")).expect("open");
    let state = Handmade::new(2, 12);
    for o in state.save_all(&storage, &SaveOptions { block_bytes: 32, ..SaveOptions::default() }) {
        o.expect("save");
    }
    let meta = read_metadata_local(storage.as_ref()).expect("metadata");
    let names: Vec<String> = meta.files.iter().map(|f| f.name.clone()).chain([META_NAME.to_string()]).collect();
    for name in &names {
        let path = dir.path().join(name);
        let good = std::fs::read(&path).expect("read");
        let mut longer = good.clone();
        longer.push(0);
        for (what, bytes) in
            [("cut short", Some(&good[..good.len() - 1])), ("grown", Some(&longer[..])), ("gone", None)]
        {
            match bytes {
                Some(b) => std::fs::write(&path, b).expect("write"),
                None => std::fs::remove_file(&path).expect("remove"),
            }
            let verdict = verify(storage.as_ref(), |_| {});
            let loaded = state.load_check1(&storage);
            std::fs::write(&path, &good).expect("restore");
            assert!(verdict.as_ref().map_or(true, |r| !r.ok()), "{name} {what}: verify found nothing");
            match loaded {
                // Bytes past the last piece are never read: the data that loads is right.
                Ok(()) => assert!(what == "grown" && name != META_NAME, "{name} {what}: the load did not notice"),
                Err(e) => assert!(!e.contains("WRONG DATA"), "{name} {what}: {e}"),
            }
        }
    }
    assert_sound(&storage);
}

/// A checkpoint of two ranks on local disk, with its metadata.
fn saved_pair() -> (tempfile::TempDir, Arc<dyn Storage>, Metadata) {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = dckpt_storage::open(dir.path().to_str().expect("utf-8 path")).expect("open");
    for o in Handmade::new(2, 5).save_all(&storage, &SaveOptions { block_bytes: 32, ..SaveOptions::default() }) {
        o.expect("save");
    }
    let meta = read_metadata_local(storage.as_ref()).expect("metadata");
    (dir, storage, meta)
}

/// Replaces `from` by `to` (of the same length) in the header of data file `fi`, and fixes
/// the header's checksum in the metadata, so that only what the header says is wrong.
fn rewrite_header(dir: &Path, meta: &mut Metadata, fi: usize, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let f = &mut meta.files[fi];
    let path = dir.join(&f.name);
    let mut bytes = std::fs::read(&path).expect("read");
    let header = &mut bytes[..f.data_start as usize];
    let at =
        header.windows(from.len()).position(|w| w == from.as_bytes()).unwrap_or_else(|| panic!("{from} in the header"));
    header[at..at + to.len()].copy_from_slice(to.as_bytes());
    f.header_crc32 = crc32fast::hash(header);
    std::fs::write(&path, &bytes).expect("write");
    std::fs::write(dir.join(META_NAME), meta.encode()).expect("write the metadata");
}

/// The one problem verify reports.
fn the_problem(storage: &Arc<dyn Storage>) -> String {
    let r = verify(storage.as_ref(), |_| {}).expect("the metadata is valid");
    assert_eq!(r.problems.len(), 1, "{r:?}");
    r.problems[0].clone()
}

// validate called a checkpoint sound whose data file's header carried another save id,
// which an independent reader written from docs/format.md refuses.
#[test]
fn a_header_of_another_save_or_rank_is_a_problem() {
    let (dir, storage, mut meta) = saved_pair();
    let id = meta.save_id.clone();
    rewrite_header(dir.path(), &mut meta, 1, &format!("\"save_id\":\"{id}\""), "\"save_id\":\"fedcba9876543210\"");
    let p = the_problem(&storage);
    assert!(p.contains(&meta.files[1].name) && p.contains("__metadata__.save_id") && p.contains(&id), "{p}");

    let (dir, storage, mut meta) = saved_pair();
    rewrite_header(dir.path(), &mut meta, 0, "\"rank\":\"0\"", "\"rank\":\"1\"");
    let p = the_problem(&storage);
    assert!(p.contains(&meta.files[0].name) && p.contains("__metadata__.rank"), "{p}");

    let (dir, storage, mut meta) = saved_pair();
    rewrite_header(dir.path(), &mut meta, 0, "\"format\":\"dckpt\"", "\"format\":\"other\"");
    assert!(the_problem(&storage).contains("__metadata__.format"));
}

// validate called a checkpoint sound whose data file was renamed (on disk and in a metadata
// file crafted to match): the name no longer says its save and rank.
#[test]
fn a_renamed_data_file_is_refused() {
    let (dir, storage, mut meta) = saved_pair();
    let old = meta.files[1].name.clone();
    let new = old.replace("-00001.", "-00002.");
    std::fs::rename(dir.path().join(&old), dir.path().join(&new)).expect("rename");
    meta.files[1].name = new.clone();
    std::fs::write(dir.path().join(META_NAME), meta.encode()).expect("write the metadata");
    // The name still fits the pattern and the rank order: the header's rank tells.
    let p = the_problem(&storage);
    assert!(p.contains(&new) && p.contains("__metadata__.rank is Some(\"1\")"), "{p}");
    // Another name the pattern does not allow: the metadata itself is refused.
    let other = "model-00001-of-00002.safetensors";
    std::fs::rename(dir.path().join(&new), dir.path().join(other)).expect("rename");
    meta.files[1].name = other.into();
    std::fs::write(dir.path().join(META_NAME), meta.encode()).expect("write the metadata");
    let r = verify(storage.as_ref(), |_| {});
    let Err(dckpt_engine::ErrorKind::Format { error }) = r.as_ref().map_err(dckpt_engine::Error::kind) else {
        panic!("{r:?}")
    };
    assert_eq!(error.field(), "files[1].name", "{error}");
    assert!(matches!(error.kind(), dckpt_engine::format::FormatErrorKind::Invalid { .. }), "{error:?}");
    assert!(read_metadata_local(storage.as_ref()).is_err(), "a load refuses it too");
}

// docs/format.md, section 1: on local disk a checkpoint's entries that are symbolic links
// are followed, wherever they point. Pinned here, so that a change of that rule is a
// change of the documented format.
#[test]
fn links_among_a_checkpoints_entries_are_followed() {
    let outside = tempfile::tempdir().expect("tempdir");
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = dckpt_storage::open(dir.path().to_str().expect("utf-8 path")).expect("open");
    let state = Handmade::new(2, 9);
    for o in state.save_all(&storage, &SaveOptions { block_bytes: 32, ..SaveOptions::default() }) {
        o.expect("save");
    }
    let meta = read_metadata_local(storage.as_ref()).expect("metadata");
    for name in [meta.files[1].name.as_str(), META_NAME] {
        let (inside, target) = (dir.path().join(name), outside.path().join(name));
        std::fs::rename(&inside, &target).expect("move out");
        std::os::unix::fs::symlink(&target, &inside).expect("link");
    }
    state.load_check1(&storage).expect("a load reads through the links");
    let r = verify(storage.as_ref(), |_| {}).expect("verify");
    assert!(r.ok() && r.leftovers.is_empty(), "{r:?}");
    // A link to a file that is not the one the metadata names is caught as any other file.
    let other = outside.path().join("other");
    std::fs::write(&other, b"not a data file").expect("write");
    std::fs::remove_file(dir.path().join(&meta.files[1].name)).expect("unlink");
    std::os::unix::fs::symlink(&other, dir.path().join(&meta.files[1].name)).expect("link");
    let r = verify(storage.as_ref(), |_| {}).expect("verify");
    assert!(r.problems.iter().any(|p| p.contains(&meta.files[1].name) && p.contains("bytes")), "{r:?}");
    assert!(state.load_check1(&storage).is_err());
}
