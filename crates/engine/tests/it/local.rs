//! The local tier on its own: 8 thread ranks on 4 simulated nodes of 2, each node's
//! directory a named memory store; parts saved with a copy on the next node, restored from
//! own copies, from peers after a node is lost, around a damaged copy, and not at all
//! after a change of layout.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use dckpt_collective::{CollectiveOptions, ThreadGroup};
use dckpt_engine::local::{
    IfWhole, LocalRestoreOptions, LocalRestoreOutcome, LocalSaveOptions, LocalSaveOutcome, Placement, restore_local,
    save_local,
};
use dckpt_engine::{Engine, ErrorKind, LoadRequest, SaveOptions, SaveState};
use dckpt_shard_spec::{DType, ShardedObject, ShardedTensor};
use dckpt_storage::{ObjectInfo, ObjectReader, ObjectWriter, Storage, StorageHints, WriterOptions};

const WORLD: usize = 8;
const RPN: usize = 2;

/// Node `node`'s directory: a named memory store, or, for a test named `disk-*`, a
/// directory on local disk read as the CLI reads (copies out of mappings).
fn node_dir(test: &str, node: usize) -> Arc<dyn Storage> {
    if test.starts_with("disk-") {
        let dir = std::env::temp_dir().join(format!("dckpt-local-{test}-{}-node-{node}", std::process::id()));
        let mut options = dckpt_storage::OpenOptions::default();
        options.local.mapped_reads = true;
        return dckpt_storage::open_with(dir.to_str().expect("utf-8"), &options).expect("local store");
    }
    let dir = dckpt_storage::open(&format!("memory://local-{test}-node-{node}")).expect("memory store");
    match (test, node) {
        ("panic-own", 1) => Arc::new(Faulty { inner: dir, fault: Fault::PanicReader("step-000000000009/part-2.data") }),
        ("panic-serving", 2) => {
            Arc::new(Faulty { inner: dir, fault: Fault::PanicReadInto("step-000000000012/part-2.data") })
        }
        ("fail-mark", 1) => Arc::new(Faulty { inner: dir, fault: Fault::FailPut("step-000000000004/done-2") }),
        _ => dir,
    }
}

/// A directory with a fault in one file.
#[derive(Debug)]
pub(crate) struct Faulty {
    pub(crate) inner: Arc<dyn Storage>,
    pub(crate) fault: Fault,
}

#[derive(Debug)]
pub(crate) enum Fault {
    /// Its reader panics: a bug in one rank's read of its own copy.
    PanicReader(&'static str),
    /// A read into buffers panics: a bug in a read of a copy a rank serves.
    PanicReadInto(&'static str),
    /// Reading it whole fails, though it is there: an I/O error.
    FailGet(&'static str),
    /// Writing it fails (a full disk).
    FailPut(&'static str),
    /// A conditional create of it times out, without effect (yet): an object store's
    /// request that may still be applied later.
    TimedOutCreate(&'static str),
    /// Deleting it fails (a permission).
    FailDelete(&'static str),
}

impl Storage for Faulty {
    fn location(&self, path: &str) -> String {
        self.inner.location(path)
    }
    fn put(&self, path: &str, data: Bytes) -> dckpt_storage::Result<()> {
        if matches!(self.fault, Fault::FailPut(name) if name == path) {
            let source = std::io::Error::other("no space left on device").into();
            return Err(dckpt_storage::Error::Permanent { path: self.location(path), op: "put".into(), source });
        }
        self.inner.put(path, data)
    }
    fn put_if_absent(&self, path: &str, data: Bytes) -> dckpt_storage::Result<()> {
        if matches!(self.fault, Fault::TimedOutCreate(name) if name == path) {
            let source = std::io::Error::other("operation timed out").into();
            return Err(dckpt_storage::Error::Transient { path: self.location(path), op: "put".into(), source });
        }
        self.inner.put_if_absent(path, data)
    }
    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> dckpt_storage::Result<()> {
        self.inner.put_if_match(path, data, expected)
    }
    fn writer(&self, path: &str, options: &WriterOptions) -> dckpt_storage::Result<Box<dyn ObjectWriter>> {
        self.inner.writer(path, options)
    }
    fn get(&self, path: &str) -> dckpt_storage::Result<Bytes> {
        if matches!(self.fault, Fault::FailGet(name) if name == path) {
            let source = std::io::Error::other("input/output error").into();
            return Err(dckpt_storage::Error::Permanent { path: self.location(path), op: "get".into(), source });
        }
        self.inner.get(path)
    }
    fn get_ranges(&self, path: &str, ranges: &[Range<u64>]) -> dckpt_storage::Result<Vec<Bytes>> {
        self.inner.get_ranges(path, ranges)
    }
    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> dckpt_storage::Result<()> {
        assert!(!matches!(self.fault, Fault::PanicReadInto(name) if name == path), "a bug in the read of a copy");
        self.inner.read_into(path, reads)
    }
    fn reader_sized(&self, path: &str, len: u64) -> dckpt_storage::Result<Box<dyn ObjectReader + '_>> {
        assert!(!matches!(self.fault, Fault::PanicReader(name) if name == path), "a bug in the read of an own copy");
        self.inner.reader_sized(path, len)
    }
    fn hints(&self) -> StorageHints {
        self.inner.hints()
    }
    fn prefetch(&self, path: &str, at: u64, len: u64) {
        self.inner.prefetch(path, at, len)
    }
    fn size(&self, path: &str) -> dckpt_storage::Result<u64> {
        self.inner.size(path)
    }
    fn list(&self, prefix: &str) -> dckpt_storage::Result<Vec<ObjectInfo>> {
        self.inner.list(prefix)
    }
    fn delete(&self, path: &str) -> dckpt_storage::Result<()> {
        if matches!(self.fault, Fault::FailDelete(name) if name == path) {
            let source = std::io::Error::other("permission denied").into();
            return Err(dckpt_storage::Error::Permanent { path: self.location(path), op: "delete".into(), source });
        }
        self.inner.delete(path)
    }
    fn list_abandoned(&self, prefix: &str) -> dckpt_storage::Result<Vec<ObjectInfo>> {
        self.inner.list_abandoned(prefix)
    }
    fn remove_abandoned(&self, prefix: &str) -> dckpt_storage::Result<Vec<ObjectInfo>> {
        self.inner.remove_abandoned(prefix)
    }
}

/// Retention whose delete of a step's marker fails removes nothing more of that step and
/// does not report it removed: it deleted the parts and left the marker, a step marked
/// complete with its parts gone, which took a kept step's place in the next retention.
#[test]
fn retention_keeps_a_step_whose_marker_it_could_not_remove() {
    let test = "keep-marker";
    save_step(test, 3, 2);
    save_step(test, 4, 2);
    let placement = Placement { ranks_per_node: RPN, copies: 2 };
    let inner = node_dir(test, 0);
    let faulty = Faulty { inner: inner.clone(), fault: Fault::FailDelete("step-000000000003/done-0") };
    // Rank 0 keeps only step 4: step 3's marker cannot go, so its parts stay too.
    assert_eq!(dckpt_engine::local::gc_local(&faulty, 0, WORLD, placement, 1, ""), Vec::<u64>::new());
    let left: Vec<String> = inner.list("step-000000000003").unwrap().into_iter().map(|i| i.path).collect();
    for name in ["done-0", "part-0.meta", "part-0.data"] {
        assert!(left.iter().any(|p| p.ends_with(name)), "{name} was removed: {left:?}");
    }
    // Rank 1, whose marker goes, removes its step 3 whole.
    assert_eq!(dckpt_engine::local::gc_local(inner.as_ref(), 1, WORLD, placement, 1, ""), vec![3]);
    let left: Vec<String> = inner.list("step-000000000003").unwrap().into_iter().map(|i| i.path).collect();
    assert!(left.iter().all(|p| !p.ends_with("done-1") && !p.contains("part-1.")), "{left:?}");
}

/// A commit whose write timed out, and is not there when read back, may still land (an
/// object store's request in flight): the save fails as uncertain and keeps its data files,
/// where it deleted them and the metadata could land naming none.
#[test]
fn a_commit_that_timed_out_keeps_its_data_files() {
    let store: Arc<dyn Storage> = Arc::new(Faulty {
        inner: dckpt_storage::open("memory://").unwrap(),
        fault: Fault::TimedOutCreate("dckpt.meta"),
    });
    let data = bytes_of(0, 1, 64);
    let state = SaveState::new().tensor(ShardedTensor::whole("w", DType::U8, [64]), &data);
    let engine = Engine::new(Arc::new(ThreadGroup::new(1).unwrap().remove(0)));
    let e = engine.save(store.as_ref(), &state, &SaveOptions::default()).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::CommitUncertain { .. }), "{e}");
    let left: Vec<String> = store.list("").unwrap().into_iter().map(|o| o.path).collect();
    assert!(left.len() == 1 && left[0].ends_with(".safetensors"), "{left:?}");
}

/// Rank `rank`'s bytes at `step`: a tensor split over the world, a replicated one, an object.
fn bytes_of(rank: usize, step: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (rank * 131 + i * 7 + step as usize * 13) as u8).collect()
}

fn pieces(rank: usize) -> (ShardedTensor, ShardedTensor, ShardedObject) {
    let split = ShardedTensor::chunk("w", DType::U8, [WORLD as u64 * 3000], [rank as u64 * 3000], [3000]);
    let shared = ShardedTensor::whole("b", DType::U8, [40]).replica([0, 0, rank as u32]);
    (split, shared, ShardedObject::single(format!("rng/{rank}")))
}

fn save_step(test: &str, step: u64, keep: usize) {
    let opts = CollectiveOptions { timeout: Duration::from_secs(30), ..CollectiveOptions::default() };
    ThreadGroup::run(WORLD, &opts, |rank, c| {
        let (w, b, o) = pieces(rank);
        let (wd, bd, od) = (bytes_of(rank, step, 3000), bytes_of(0, step, 40), bytes_of(rank, step, 17));
        let state = SaveState::new().tensor(w, &wd).tensor(b, &bd).object(o, &od);
        let dir = node_dir(test, rank / RPN);
        let mut o = LocalSaveOptions::new(step, Placement { ranks_per_node: RPN, copies: 2 });
        (o.keep, o.chunk_bytes) = (keep, 1000);
        let out = save_local(&c, dir.as_ref(), &state, &o).expect("local save");
        assert_eq!(out.bytes, 3000 + 40 + 17);
        assert_eq!(out.received_bytes, 3000 + 40 + 17, "one peer's copy");
    })
    .expect("world");
}

/// Restores on every rank; returns each rank's outcome and whether its bytes are `step`'s.
fn restore(test: &str, world_len: u64) -> Vec<(LocalRestoreOutcome, Option<u64>)> {
    let opts = CollectiveOptions { timeout: Duration::from_secs(30), ..CollectiveOptions::default() };
    ThreadGroup::run(WORLD, &opts, |rank, c| {
        let (mut w, b, o) = pieces(rank);
        w.global_shape = [world_len].into();
        let (mut wd, mut bd) = (vec![0u8; 3000], vec![0u8; 40]);
        let mut req = LoadRequest::new().tensor(w, &mut wd).tensor(b, &mut bd).object(o.clone());
        let dir = node_dir(test, rank / RPN);
        let out =
            restore_local(&c, dir.as_ref(), &mut req, &LocalRestoreOptions { chunk_bytes: 700, ..Default::default() })
                .expect("restore");
        let od = req.object_data(o.key.as_str()).map(<[u8]>::to_vec);
        drop(req);
        let same = out.step.filter(|&s| {
            wd == bytes_of(rank, s, 3000)
                && bd == bytes_of(0, s, 40)
                && od.as_deref() == Some(&bytes_of(rank, s, 17)[..])
        });
        (out, same)
    })
    .expect("world")
}

fn wipe(dir: &dyn Storage) {
    for info in dir.list("").expect("list") {
        dir.delete(&info.path).expect("delete");
    }
}

#[test]
fn own_copies_restore_the_newest_complete_step_and_retention_keeps_one() {
    let test = "own";
    save_step(test, 3, 1);
    save_step(test, 4, 1);
    for (r, (out, same)) in restore(test, WORLD as u64 * 3000).into_iter().enumerate() {
        assert_eq!((out.step, same, out.own, out.peer), (Some(4), Some(4), 8, 0), "rank {r}: {out:?}");
        assert_eq!(out.bytes_received, 0, "rank {r}");
        assert!(out.failed.is_empty());
    }
    // Step 3 is gone from every node: its markers and parts.
    let left: Vec<String> = (0..4).flat_map(|n| node_dir(test, n).list("").unwrap()).map(|i| i.path).collect();
    assert!(left.iter().all(|p| !p.contains("000000000003")), "{left:?}");
    assert_eq!(left.len(), 4 * (2 * 2 * 2 + 2), "each node: 4 parts of 2 files, 2 markers");
}

#[test]
fn a_lost_node_is_restored_from_peers_bit_exact() {
    let test = "lost";
    save_step(test, 5, 1);
    wipe(node_dir(test, 2).as_ref());
    for (r, (out, same)) in restore(test, WORLD as u64 * 3000).into_iter().enumerate() {
        assert_eq!((out.step, same, out.own, out.peer), (Some(5), Some(5), 6, 2), "rank {r}: {out:?}");
        let peer_bytes = if r / RPN == 2 { 3057 } else { 0 };
        assert_eq!(out.bytes_received, peer_bytes, "rank {r}");
    }
}

#[test]
fn a_damaged_peer_copy_leaves_that_part_failed_and_named() {
    let test = "damaged";
    save_step(test, 6, 1);
    wipe(node_dir(test, 1).as_ref());
    // Rank 2's (node 1) only other copy is on node 2, held by rank 4: flip one byte of it.
    let holder = node_dir(test, 2);
    let name = "step-000000000006/part-2.data";
    let mut bytes = holder.get(name).unwrap().to_vec();
    bytes[1234] ^= 0x20;
    holder.put(name, bytes.into()).unwrap();
    for (r, (out, same)) in restore(test, WORLD as u64 * 3000).into_iter().enumerate() {
        assert_eq!((out.step, out.own, out.peer, &out.failed[..]), (Some(6), 6, 1, &[2u32][..]), "rank {r}: {out:?}");
        assert!(out.reasons.iter().any(|why| why.contains("rank 2") && why.contains("checksum")), "{:?}", out.reasons);
        if r != 2 {
            assert_eq!(same, Some(6), "rank {r}");
        }
    }
}

// On local disk, read through mappings: a flipped byte in a rank's own copy is caught as it
// is read, and the part comes from its copy on the next node instead.
#[test]
fn a_damaged_own_copy_on_disk_is_caught_and_restored_from_its_peer() {
    let test = "disk-own";
    save_step(test, 8, 1);
    let name = "step-000000000008/part-2.data";
    let own = node_dir(test, 1);
    let mut bytes = own.get(name).unwrap().to_vec();
    bytes[2345] ^= 0x08;
    own.put(name, bytes.into()).unwrap();
    let outcomes = restore(test, WORLD as u64 * 3000);
    for n in 0..4 {
        let dir = std::env::temp_dir().join(format!("dckpt-local-{test}-{}-node-{n}", std::process::id()));
        std::fs::remove_dir_all(dir).ok();
    }
    for (r, (out, same)) in outcomes.into_iter().enumerate() {
        assert_eq!((out.step, same, out.own, out.peer), (Some(8), Some(8), 7, 1), "rank {r}: {out:?}");
        assert!(out.failed.is_empty(), "rank {r}: {out:?}");
    }
}

/// A local save whose marker one rank could not write fails on every rank and leaves the
/// step marked nowhere: the other ranks' markers stayed, so the step every rank was told
/// had failed still restored (each part marked by another holder), and retention counted it.
#[test]
fn a_save_whose_marker_failed_on_one_rank_is_marked_on_none() {
    let test = "fail-mark";
    save_step(test, 3, 2);
    let opts = CollectiveOptions { timeout: Duration::from_secs(30), ..CollectiveOptions::default() };
    let results = ThreadGroup::run(WORLD, &opts, |rank, c| {
        let (w, b, o) = pieces(rank);
        let (wd, bd, od) = (bytes_of(rank, 4, 3000), bytes_of(0, 4, 40), bytes_of(rank, 4, 17));
        let state = SaveState::new().tensor(w, &wd).tensor(b, &bd).object(o, &od);
        let mut o = LocalSaveOptions::new(4, Placement { ranks_per_node: RPN, copies: 2 });
        o.keep = 2;
        save_local(&c, node_dir(test, rank / RPN).as_ref(), &state, &o)
    })
    .expect("world");
    for (r, res) in results.into_iter().enumerate() {
        let e = res.expect_err("every rank fails");
        assert!(e.to_string().contains("no space left"), "rank {r}: {e}");
    }
    for node in 0..WORLD / RPN {
        let marked: Vec<String> = node_dir(test, node)
            .list("step-000000000004")
            .expect("list")
            .into_iter()
            .map(|o| o.path)
            .filter(|p| p.contains("/done-"))
            .collect();
        assert!(marked.is_empty(), "node {node}: {marked:?}");
    }
    for (r, (out, same)) in restore(test, WORLD as u64 * 3000).into_iter().enumerate() {
        assert_eq!((out.step, same), (Some(3), Some(3)), "rank {r}: {out:?}");
    }
}

// A panic in one rank's read of its own copy is that part failing, taken from its peer; on
// the old code that rank raised it again, out of the restore, while the others went on
// into the next round without it.
#[test]
fn a_panic_in_a_read_of_an_own_copy_fails_that_part_alone() {
    let test = "panic-own";
    save_step(test, 9, 1);
    for (r, (out, same)) in restore(test, WORLD as u64 * 3000).into_iter().enumerate() {
        assert_eq!((out.step, same, out.own, out.peer), (Some(9), Some(9), 7, 1), "rank {r}: {out:?}");
        assert!(out.failed.is_empty(), "rank {r}: {out:?}");
    }
}

// A panic in a rank's read of a copy it serves (rank 4 holds rank 2's, whose own node is
// lost) is that part failing, named; on the old code it unwound out of the serving rank's
// restore, and the ranks waiting for it in the next round timed out.
#[test]
fn a_panic_in_a_read_of_a_served_copy_fails_that_part_alone() {
    let test = "panic-serving";
    save_step(test, 12, 1);
    wipe(node_dir(test, 1).as_ref());
    for (r, (out, same)) in restore(test, WORLD as u64 * 3000).into_iter().enumerate() {
        assert_eq!((out.step, out.own, out.peer, &out.failed[..]), (Some(12), 6, 1, &[2u32][..]), "rank {r}: {out:?}");
        if r != 2 {
            assert_eq!(same, Some(12), "rank {r}");
        }
    }
}

#[test]
fn a_new_layout_restores_nothing_from_the_local_tier() {
    let test = "layout";
    save_step(test, 7, 1);
    for (r, (out, _)) in restore(test, WORLD as u64 * 3000 + 8).into_iter().enumerate() {
        assert_eq!((out.step, out.own, out.peer), (None, 0, 0), "rank {r}: {out:?}");
        assert!(out.reasons.iter().any(|why| why.contains("new layout")), "{:?}", out.reasons);
    }
}

#[test]
fn a_placement_that_does_not_fit_is_refused_on_every_rank() {
    let opts = CollectiveOptions { timeout: Duration::from_secs(30), ..CollectiveOptions::default() };
    let errs = ThreadGroup::run(4, &opts, |_, c| {
        let dir = dckpt_storage::open("memory://").unwrap();
        let o = LocalSaveOptions::new(1, Placement { ranks_per_node: 2, copies: 3 });
        save_local(&c, dir.as_ref(), &SaveState::new(), &o).unwrap_err().to_string()
    })
    .unwrap();
    for e in errs {
        assert!(e.contains("3 copies") && e.contains("has 2 (4 ranks"), "{e}");
    }
}

// A step saved again first loses its markers on every node, so that a save of it that
// fails midway (here rank 0 cannot write its own part: a directory stands where it goes)
// cannot leave old and new parts looking like one complete step.
#[test]
fn a_step_saved_again_is_unmarked_before_its_parts_are_rewritten() {
    let test = "disk-again";
    save_step(test, 9, 2);
    let root = |n: usize| std::env::temp_dir().join(format!("dckpt-local-{test}-{}-node-{n}", std::process::id()));
    let marked = |n: usize| node_dir(test, n).list("").unwrap().iter().filter(|i| i.path.contains("/done-")).count();
    assert_eq!((0..4).map(marked).sum::<usize>(), WORLD);
    let blocked = root(0).join("step-000000000009/part-0.data");
    std::fs::remove_file(&blocked).unwrap();
    std::fs::create_dir_all(blocked.join("in-the-way")).unwrap();
    let opts = CollectiveOptions { timeout: Duration::from_secs(30), ..CollectiveOptions::default() };
    let errs = ThreadGroup::run(WORLD, &opts, |rank, c| {
        let (w, b, o) = pieces(rank);
        let (wd, bd, od) = (bytes_of(rank, 10, 3000), bytes_of(0, 10, 40), bytes_of(rank, 10, 17));
        let state = SaveState::new().tensor(w, &wd).tensor(b, &bd).object(o, &od);
        let placement = Placement { ranks_per_node: RPN, copies: 2 };
        let again = LocalSaveOptions { if_whole: IfWhole::Replace, ..LocalSaveOptions::new(9, placement) };
        save_local(&c, node_dir(test, rank / RPN).as_ref(), &state, &again).map(drop)
    })
    .unwrap();
    let gone = (0..4).map(marked).sum::<usize>();
    let outcomes = restore(test, WORLD as u64 * 3000);
    (0..4).for_each(|n| std::fs::remove_dir_all(root(n)).unwrap_or(()));
    for (rank, e) in errs.into_iter().enumerate() {
        let e = e.expect_err("the save fails on every rank");
        assert_eq!(e.rank(), Some(0), "rank {rank}: {e}");
    }
    assert_eq!(gone, 0, "every marker of step 9 is gone");
    for (out, _) in outcomes {
        assert_eq!(out.step, None, "{out:?}");
    }
}

// A whole step saved again is refused on every rank before any marker goes, and still
// restores: on the old code the save unmarked it and rewrote its parts, so a failure midway
// lost the step (the run's newest, and perhaps its only one). Kept (its parts the same
// bytes as the state's; other contents are refused, naming the rank that differs), nothing
// is written; ranks asked otherwise are refused; a marker that cannot be read fails the
// save on every rank, the step left whole (on the old code it read as no marker: the step
// was unmarked and saved again); a part that is not all there is saved again, not kept; a
// step only some ranks marked (a save that failed as it ended) is saved again whatever
// `if_whole` says; replaced, it is saved again.
#[test]
fn a_whole_step_saved_again_is_refused_kept_or_replaced_as_asked() {
    let test = "whole-again";
    save_step(test, 11, 2);
    let plain = |node: usize| node_dir(test, node);
    let restores_whole = || {
        for (r, (out, same)) in restore(test, WORLD as u64 * 3000).into_iter().enumerate() {
            assert_eq!((out.step, same, out.own), (Some(11), Some(11), 8), "rank {r}: {out:?}");
        }
    };
    let refused_by = |outs: Vec<dckpt_engine::Result<LocalSaveOutcome>>, by: u32, says: &str| {
        for (rank, e) in outs.into_iter().enumerate() {
            let e = e.expect_err("refused on every rank");
            assert_eq!(e.rank(), Some(by), "rank {rank}: {e}");
            assert!(e.to_string().contains(says), "rank {rank}: {e}");
        }
    };
    let e = again(|_| IfWhole::Refuse, |_| 11, plain);
    assert!(
        e.iter()
            .all(|e| matches!(e.as_ref().map_err(|e| e.kind()), Err(dckpt_engine::ErrorKind::AlreadyExists { .. })))
    );
    refused_by(e, 0, "step-000000000011/done-0");
    restores_whole();
    for (rank, out) in again(|_| IfWhole::Keep, |_| 11, plain).into_iter().enumerate() {
        let out = out.expect("kept");
        assert!(out.kept && out.bytes == 0 && out.received_bytes == 0, "rank {rank}: {out:?}");
    }
    restores_whole();
    // Kept only as the same bytes: other contents under a whole step are no retry.
    refused_by(
        again(|_| IfWhole::Keep, |r| if r == 5 { 12 } else { 11 }, plain),
        5,
        "done-5 in rank 5's node directory",
    );
    restores_whole();
    let unreadable = |node: usize| -> Arc<dyn Storage> {
        match node {
            2 => Arc::new(Faulty { inner: plain(node), fault: Fault::FailGet("step-000000000011/done-5") }),
            _ => plain(node),
        }
    };
    refused_by(again(|_| IfWhole::Keep, |_| 11, unreadable), 5, "input/output error");
    restores_whole();
    let asked = |r: usize| if r == 3 { IfWhole::Replace } else { IfWhole::Keep };
    for (rank, e) in again(asked, |_| 11, plain).into_iter().enumerate() {
        let e = e.expect_err("asked otherwise on one rank: refused on every rank");
        assert!(e.to_string().contains("rank 3 asks Replace of a whole local step, rank 0 Keep"), "rank {rank}: {e}");
    }
    restores_whole();
    let short = "step-000000000011/part-6.data";
    let bytes = plain(3).get(short).unwrap();
    plain(3).put(short, bytes.slice(..bytes.len() - 1)).unwrap();
    for (rank, out) in again(|_| IfWhole::Keep, |_| 11, plain).into_iter().enumerate() {
        assert!(!out.expect("saved again").kept, "rank {rank}: rank 6's part is short");
    }
    restores_whole();
    plain(3).delete("step-000000000011/done-7").unwrap();
    for (rank, out) in again(|_| IfWhole::Refuse, |_| 11, plain).into_iter().enumerate() {
        assert!(!out.expect("saved again").kept, "rank {rank}: a step one rank did not mark");
    }
    restores_whole();
    for (rank, out) in again(|_| IfWhole::Replace, |_| 13, plain).into_iter().enumerate() {
        assert!(!out.expect("replaced").kept, "rank {rank}");
    }
    for (r, (out, same)) in restore(test, WORLD as u64 * 3000).into_iter().enumerate() {
        assert_eq!((out.step, same), (Some(11), None), "rank {r}: step 11 holds other bytes now");
    }
}

/// Local step 11 saved again as `if_whole(r)` asks of rank `r`, its bytes those of step
/// `bytes_step(r)`, in node directories `dir(node)`: each rank's outcome.
fn again(
    if_whole: impl Fn(usize) -> IfWhole + Sync,
    bytes_step: impl Fn(usize) -> u64 + Sync,
    dir: impl Fn(usize) -> Arc<dyn Storage> + Sync,
) -> Vec<dckpt_engine::Result<LocalSaveOutcome>> {
    let opts = CollectiveOptions { timeout: Duration::from_secs(30), ..CollectiveOptions::default() };
    ThreadGroup::run(WORLD, &opts, |rank, c| {
        let (w, b, o) = pieces(rank);
        let s = bytes_step(rank);
        let (wd, bd, od) = (bytes_of(rank, s, 3000), bytes_of(0, 11, 40), bytes_of(rank, s, 17));
        let state = SaveState::new().tensor(w, &wd).tensor(b, &bd).object(o, &od);
        let placement = Placement { ranks_per_node: RPN, copies: 2 };
        let again = LocalSaveOptions { if_whole: if_whole(rank), ..LocalSaveOptions::new(11, placement) };
        save_local(&c, dir(rank / RPN).as_ref(), &state, &again)
    })
    .unwrap()
}

/// A local save of `step` as rank `r` sees its node's directory `dir_of(r)` (a named memory
/// store), its bytes `bytes_of(rank, step + salt)`, for the run `run`.
fn save_as(test: &str, step: u64, salt: u64, dir_of: impl Fn(usize) -> String + Sync, run: &str) {
    let opts = CollectiveOptions { timeout: Duration::from_secs(30), ..CollectiveOptions::default() };
    ThreadGroup::run(WORLD, &opts, |rank, c| {
        let (w, b, o) = pieces(rank);
        let s = step + salt;
        let (wd, bd, od) = (bytes_of(rank, s, 3000), bytes_of(0, s, 40), bytes_of(rank, s, 17));
        let state = SaveState::new().tensor(w, &wd).tensor(b, &bd).object(o, &od);
        let dir = dckpt_storage::open(&format!("memory://local-{test}-{}", dir_of(rank))).unwrap();
        let mut o = LocalSaveOptions::new(step, Placement { ranks_per_node: RPN, copies: 2 });
        o.run = run.to_string();
        save_local(&c, dir.as_ref(), &state, &o).expect("local save");
    })
    .expect("world");
}

/// Restores as `save_as` saved, for `run`; each rank's outcome and the salt its bytes are of
/// (`None`: of no save).
fn restore_as(
    test: &str,
    dir_of: impl Fn(usize) -> String + Sync,
    run: &str,
    salts: &[u64],
) -> Vec<(LocalRestoreOutcome, Option<u64>)> {
    let opts = CollectiveOptions { timeout: Duration::from_secs(30), ..CollectiveOptions::default() };
    ThreadGroup::run(WORLD, &opts, |rank, c| {
        let (w, b, o) = pieces(rank);
        let (mut wd, mut bd) = (vec![0u8; 3000], vec![0u8; 40]);
        let mut req = LoadRequest::new().tensor(w, &mut wd).tensor(b, &mut bd).object(o.clone());
        let dir = dckpt_storage::open(&format!("memory://local-{test}-{}", dir_of(rank))).unwrap();
        let ropts = LocalRestoreOptions { run: run.to_string(), ..Default::default() };
        let out = restore_local(&c, dir.as_ref(), &mut req, &ropts).expect("restore");
        let od = req.object_data(o.key.as_str()).map(<[u8]>::to_vec);
        drop(req);
        let of = out.step.and_then(|step| {
            salts.iter().copied().find(|&salt| {
                let s = step + salt;
                wd == bytes_of(rank, s, 3000)
                    && bd == bytes_of(0, s, 40)
                    && od.as_deref() == Some(&bytes_of(rank, s, 17)[..])
            })
        });
        (out, of)
    })
    .expect("world")
}

/// Directories are a host's: `h<host>-n<node>`, the node number a job gave that host.
fn on_hosts(swap: bool) -> impl Fn(usize) -> String + Sync {
    move |rank| {
        let node = rank / RPN;
        let host = if swap && node >= 2 { 5 - node } else { node };
        format!("h{host}-n{node}")
    }
}

/// A step saved, then saved again by a job whose hosts 2 and 3 swapped node numbers (their
/// directories of the first numbering untouched), then restored with the first numbering:
/// hosts 0 and 1 hold the second save's parts, hosts 2 and 3 the first's. Each save of the
/// step is missing parts there, so nothing is restored; every part of one save, and only
/// that, restored once was mixed from the two.
#[test]
fn a_step_saved_again_on_nodes_numbered_otherwise_restores_no_mix_of_both() {
    let test = "renumbered";
    save_as(test, 7, 0, on_hosts(false), "");
    save_as(test, 7, 1000, on_hosts(true), "");
    for (r, (out, of)) in restore_as(test, on_hosts(false), "", &[0, 1000]).into_iter().enumerate() {
        assert_eq!((out.step, of), (None, None), "rank {r}: {out:?}");
        assert!(out.reasons.iter().any(|w| w.contains("holds parts of 2 saves of it")), "rank {r}: {out:?}");
    }
    // The swapped numbering again: the second save is whole there, and restored.
    for (r, (out, of)) in restore_as(test, on_hosts(true), "", &[0, 1000]).into_iter().enumerate() {
        assert_eq!((out.step, of), (Some(7), Some(1000)), "rank {r}: {out:?}");
    }
}

/// A note per part held (other runs' steps on every node) made reasons that grow with the
/// world, and every rank got all of them: the world squared through rank 0. Every rank now
/// gets a bounded number, the last saying how many more rank 0's log holds.
#[test]
fn a_restores_reasons_sent_to_every_rank_are_bounded() {
    let test = "many-runs";
    for (step, run) in [(1, "run-a"), (2, "run-c"), (3, "run-d")] {
        save_as(test, step, 0, on_hosts(false), run);
    }
    for (r, (out, _)) in restore_as(test, on_hosts(false), "run-b", &[0]).into_iter().enumerate() {
        assert_eq!(out.step, None, "rank {r}: {out:?}");
        assert_eq!(out.reasons.len(), 32, "rank {r}: {out:?}");
        let more = &out.reasons[30];
        assert!(more.starts_with("and ") && more.ends_with("more reasons, each in rank 0's log"), "rank {r}: {more}");
        assert_eq!(out.reasons[31], "no whole local step", "rank {r}: {out:?}");
        assert!(out.reasons.iter().any(|w| w.contains("belongs to run \"run-a\"")), "rank {r}: {out:?}");
    }
}

/// Ranks given another step, run or placement are refused on every rank in the save's
/// first round, before any rank writes or unmarks anything: one given another run saved
/// "successfully" parts no restore of either run takes; another step unmarked that step.
#[test]
fn a_local_save_asked_otherwise_on_one_rank_is_refused_on_every_rank() {
    let test = "asked";
    save_as(test, 10, 0, on_hosts(false), "run-a");
    let before = |n: usize| dckpt_storage::open(&format!("memory://local-{test}-h{n}-n{n}")).unwrap().list("").unwrap();
    let held: Vec<_> = (0..4).map(before).collect();
    type Ask = fn(usize) -> (u64, &'static str, usize);
    let cases: [(Ask, &str); 3] = [
        (|r| (if r == 5 { 11 } else { 10 }, "run-a", 2), "rank 5 asks step 11, rank 0 step 10"),
        (|r| (10, if r == 3 { "run-b" } else { "run-a" }, 2), "rank 3 asks run \"run-b\", rank 0 run \"run-a\""),
        (|r| (10, "run-a", if r == 6 { 3 } else { 2 }), "rank 6 asks Placement { ranks_per_node: 2, copies: 3 }"),
    ];
    for (ask, want) in cases {
        let opts = CollectiveOptions { timeout: Duration::from_secs(30), ..CollectiveOptions::default() };
        let results = ThreadGroup::run(WORLD, &opts, |rank, c| {
            let (w, b, o) = pieces(rank);
            let (wd, bd, od) = (bytes_of(rank, 99, 3000), bytes_of(0, 99, 40), bytes_of(rank, 99, 17));
            let state = SaveState::new().tensor(w, &wd).tensor(b, &bd).object(o, &od);
            let dir = dckpt_storage::open(&format!("memory://local-{test}-{}", on_hosts(false)(rank))).unwrap();
            let (step, run, copies) = ask(rank);
            let mut o = LocalSaveOptions::new(step, Placement { ranks_per_node: RPN, copies });
            o.run = run.to_string();
            save_local(&c, dir.as_ref(), &state, &o)
        })
        .expect("world");
        for (rank, r) in results.into_iter().enumerate() {
            let e = r.expect_err("refused on every rank").to_string();
            assert!(e.contains(want), "rank {rank}: {e}");
        }
        assert_eq!((0..4).map(before).collect::<Vec<_>>(), held, "{want}: a node directory changed");
    }
    for (r, (out, of)) in restore_as(test, on_hosts(false), "run-a", &[0]).into_iter().enumerate() {
        assert_eq!((out.step, of), (Some(10), Some(0)), "rank {r}: {out:?}");
    }
}

/// Node directories another run left (the same template, another run root) are passed over,
/// with the reason; the run that saved them restores them.
#[test]
fn another_runs_local_steps_are_not_restored() {
    let test = "runs";
    save_as(test, 8, 0, on_hosts(false), "s3://bucket/run-a");
    for (r, (out, _)) in restore_as(test, on_hosts(false), "s3://bucket/run-b", &[0]).into_iter().enumerate() {
        assert_eq!(out.step, None, "rank {r}: {out:?}");
        assert!(out.reasons.iter().any(|w| w.contains("belongs to run \"s3://bucket/run-a\"")), "rank {r}: {out:?}");
    }
    for (r, (out, of)) in restore_as(test, on_hosts(false), "s3://bucket/run-a", &[0]).into_iter().enumerate() {
        assert_eq!((out.step, of, out.own), (Some(8), Some(0), 8), "rank {r}: {out:?}");
    }
    // Run b's own step 4: gc and the unmarking of an abandoned branch touch run b's steps
    // only. Run-blind, gc kept run a's newer step 8 as the newest and removed step 4.
    save_as(test, 4, 0, on_hosts(false), "s3://bucket/run-b");
    let placement = Placement { ranks_per_node: RPN, copies: 2 };
    let dir_of = on_hosts(false);
    for rank in 0..WORLD {
        let dir = dckpt_storage::open(&format!("memory://local-{test}-{}", dir_of(rank))).unwrap();
        let removed = dckpt_engine::local::gc_local(dir.as_ref(), rank, WORLD, placement, 1, "s3://bucket/run-b");
        assert!(removed.is_empty(), "rank {rank} removed {removed:?}");
    }
    for (r, (out, of)) in restore_as(test, on_hosts(false), "s3://bucket/run-b", &[0]).into_iter().enumerate() {
        assert_eq!((out.step, of), (Some(4), Some(0)), "rank {r}: {out:?}");
    }
    for rank in 0..WORLD {
        let dir = dckpt_storage::open(&format!("memory://local-{test}-{}", dir_of(rank))).unwrap();
        let unmarked = dckpt_engine::local::unmark_newer(dir.as_ref(), rank, Some(2), "s3://bucket/run-b");
        assert_eq!(unmarked, [4], "rank {rank}");
    }
    for (r, (out, _)) in restore_as(test, on_hosts(false), "s3://bucket/run-a", &[0]).into_iter().enumerate() {
        assert_eq!(out.step, Some(8), "rank {r}: run a's step stays marked: {out:?}");
    }
}

/// Another run sharing the node directories with another layout (its ranks on other nodes
/// than this run's): its gc, where its ranks hold no marker, removes none of this run's
/// parts. It removed them as a dead save's of its own, and this run, one node lost, could
/// no longer restore from the copies.
#[test]
fn another_runs_gc_removes_none_of_this_runs_parts() {
    let test = "runs-gc";
    save_as(test, 8, 0, on_hosts(false), "s3://bucket/run-a");
    let placement = Placement { ranks_per_node: RPN, copies: 2 };
    let dir_of = on_hosts(false);
    let open = |name: String| dckpt_storage::open(&format!("memory://local-{test}-{name}")).unwrap();
    for rank in 0..WORLD {
        // Run b's rank `rank` lives on the next node.
        let dir = open(dir_of((rank + RPN) % WORLD));
        let removed = dckpt_engine::local::gc_local(dir.as_ref(), rank, WORLD, placement, 1, "s3://bucket/run-b");
        assert!(removed.is_empty(), "rank {rank} removed {removed:?}");
    }
    wipe(open(dir_of(0)).as_ref());
    for (r, (out, of)) in restore_as(test, on_hosts(false), "s3://bucket/run-a", &[0]).into_iter().enumerate() {
        assert_eq!((out.step, of), (Some(8), Some(0)), "rank {r}: {out:?}");
    }
}

/// A part saved with no run named (before runs were named, or outside a run manager)
/// belongs to any run: a managed restore after an upgrade takes it rather than falling
/// back to an older persistent step.
#[test]
fn a_step_saved_with_no_run_named_is_any_runs() {
    let test = "unnamed";
    save_as(test, 6, 0, on_hosts(false), "");
    for (r, (out, of)) in restore_as(test, on_hosts(false), "/ckpt/run", &[0]).into_iter().enumerate() {
        assert_eq!((out.step, of), (Some(6), Some(0)), "rank {r}: {out:?}");
    }
}

/// A run that resumed from step 3 unmarks its newer local step 5 (an abandoned branch):
/// gc then keeps step 3 as the newest complete one. With 5 still marked, gc kept 5 and
/// removed 3, the run's own step, for a step it would never restore.
#[test]
fn steps_after_the_one_resumed_from_are_unmarked_and_gc_keeps_the_run_s_own() {
    let test = "abandoned";
    save_step(test, 3, 2);
    save_step(test, 5, 2);
    let placement = Placement { ranks_per_node: RPN, copies: 2 };
    for rank in 0..WORLD {
        let dir = node_dir(test, rank / RPN);
        assert_eq!(dckpt_engine::local::unmark_newer(dir.as_ref(), rank, Some(3), ""), [5], "rank {rank}");
        assert_eq!(
            dckpt_engine::local::unmark_newer(dir.as_ref(), rank, Some(3), ""),
            Vec::<u64>::new(),
            "rank {rank}"
        );
    }
    for rank in 0..WORLD {
        let dir = node_dir(test, rank / RPN);
        let removed = dckpt_engine::local::gc_local(dir.as_ref(), rank, WORLD, placement, 1, "");
        assert!(!removed.contains(&3), "rank {rank} removed {removed:?}");
    }
    for (r, (out, same)) in restore(test, WORLD as u64 * 3000).into_iter().enumerate() {
        assert_eq!((out.step, same), (Some(3), Some(3)), "rank {r}: {out:?}");
    }
}
