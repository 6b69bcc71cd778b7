//! Leftovers of dead saves on local disk: the unfinished writes a dead process left are listed
//! by `verify` with their sizes, removed by `remove_leftovers`, and removed by the next save's
//! commit, while a temporary that a live writer holds survives all three. (A real `kill -9`
//! of a save is in `crates/cli/tests/it/killed_save.rs`.)

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use dckpt_engine::SaveOptions;
use dckpt_engine::verify::{Leftover, LeftoverKind, remove_leftovers, verify};
use dckpt_layout::{ModelSpec, OptimizerMode, ReferenceModel};
use dckpt_reference::save_options;
use dckpt_storage::{FaultConfig, FaultStorage, Storage};
use dckpt_tests::{Setup, load_and_check, save_model, save_model_with};

fn tiny(world: u32) -> ReferenceModel {
    Setup::new(world, world, 1, 1, 1, 1, OptimizerMode::Adam).model(&ModelSpec::preset("tiny").expect("tiny"))
}

/// A temporary of another process's writer, named as the local backend names them, with
/// `bytes` bytes; with `held`, an open file holds its lock as a live writer does (returned).
fn foreign_temporary(dir: &Path, writer: u32, bytes: usize, held: bool) -> (String, Option<File>) {
    let name = format!(".dckpt-tmp.{writer}-0badf00d.0.0123456789abcdef-00000.safetensors");
    std::fs::write(dir.join(&name), vec![7u8; bytes]).expect("write a temporary");
    let holder = held.then(|| {
        let f = File::open(dir.join(&name)).expect("open");
        // SAFETY: a plain system call on a descriptor the test owns.
        assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        f
    });
    (name, holder)
}

fn unfinished(path: &str, bytes: u64) -> Leftover {
    Leftover { path: path.to_string(), bytes, kind: LeftoverKind::UnfinishedWrite }
}

fn leftovers(storage: &dyn Storage) -> Vec<Leftover> {
    let report = verify(storage, |_| {}).expect("verify");
    assert!(report.ok(), "{report:?}");
    report.leftovers
}

#[test]
fn a_save_removes_what_dead_writers_left_and_keeps_what_live_ones_hold() {
    let dir = tempfile::tempdir().expect("tempdir");
    let storage = dckpt_storage::open(dir.path().to_str().expect("utf-8 path")).expect("open");
    let (dead, _) = foreign_temporary(dir.path(), 4_000_001, 1000, false);
    let (live, holder) = foreign_temporary(dir.path(), 4_000_002, 10, true);
    let model = tiny(2);
    for r in save_model(&storage, &model, 1) {
        r.expect("save");
    }
    assert!(!dir.path().join(&dead).exists(), "the save left {dead}");
    assert!(dir.path().join(&live).exists(), "the save removed a live writer's {live}");
    assert_eq!(leftovers(storage.as_ref()), vec![]);

    // Leftovers of each kind; `remove_leftovers` removes all but the other object.
    let (dead, _) = foreign_temporary(dir.path(), 4_000_003, 5, false);
    storage.put("0123456789abcdef-00003.safetensors", Bytes::from_static(b"stray")).expect("put");
    storage.put("notes.txt", Bytes::from_static(b"mine")).expect("put");
    let data = Leftover { path: "0123456789abcdef-00003.safetensors".into(), bytes: 5, kind: LeftoverKind::DataFile };
    let other = Leftover { path: "notes.txt".into(), bytes: 4, kind: LeftoverKind::Other };
    assert_eq!(leftovers(storage.as_ref()), vec![unfinished(&dead, 5), data.clone(), other.clone()]);
    let mut removed = remove_leftovers(storage.as_ref()).expect("remove leftovers");
    removed.sort_by(|a, b| a.path.cmp(&b.path));
    assert_eq!(removed, vec![unfinished(&dead, 5), data]);
    assert_eq!(leftovers(storage.as_ref()), vec![other]);
    assert!(dir.path().join(&live).exists());

    // Its writer gone, the live one is a leftover too, and the next save removes it.
    drop(holder);
    assert_eq!(leftovers(storage.as_ref())[0], unfinished(&live, 10));
    let replace = SaveOptions { replace: true, ..save_options(&model) };
    for r in save_model_with(&storage, &model, 2, &replace) {
        r.expect("save");
    }
    assert!(!dir.path().join(&live).exists());
    assert!(load_and_check(&storage, &model, 2).iter().all(Result::is_ok));
}

/// The clean-up after a commit is best effort: when it fails, the save has still succeeded
/// (and the fault did fire, at the clean-up, the save's last operation).
#[test]
fn a_failed_clean_up_after_the_commit_does_not_fail_the_save() {
    let dir = tempfile::tempdir().expect("tempdir");
    let local = dckpt_storage::open(dir.path().to_str().expect("utf-8 path")).expect("open");
    let model = tiny(1);
    let opts = SaveOptions { replace: true, ..save_options(&model) };
    let save = |config: FaultConfig, seed: u64| {
        let faulty = FaultStorage::new(local.clone(), config);
        let storage: Arc<dyn Storage> = Arc::new(faulty.clone());
        (save_model_with(&storage, &model, seed, &opts).remove(0), faulty)
    };
    save(FaultConfig::default(), 1).0.expect("save");
    // The operations of replacing a checkpoint (reading the old metadata, deleting its file).
    let (second, dry) = save(FaultConfig::default(), 2);
    second.expect("save");
    let (dead, _) = foreign_temporary(dir.path(), 4_000_004, 3, false);
    let (outcome, failing) = save(FaultConfig { fail_op: Some(dry.ops() - 1), ..Default::default() }, 3);
    let injected = failing.injected();
    assert_eq!(injected.iter().map(|f| f.op).collect::<Vec<_>>(), vec!["remove_abandoned"], "{injected:?}");
    outcome.expect("the save succeeds");
    assert!(dir.path().join(&dead).exists());
    assert!(load_and_check(&local, &model, 3).iter().all(Result::is_ok));
}
