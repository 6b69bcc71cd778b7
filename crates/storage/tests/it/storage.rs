//! The conformance suite against memory, local disk and S3, and the fault wrapper's tests.
//!
//! S3 tests need a server: `cargo xtask test` starts one and sets `DCKPT_TEST_S3_URL` and
//! `AWS_*`. Without them the S3 tests fail (they never skip).

use std::sync::Arc;

use crate::suite::{self, pattern};
use bytes::Bytes;
use dckpt_storage::{
    Counting, Error, FaultConfig, FaultStorage, LocalConfig, LocalStorage, MemoryStorage, ObjectInfo, ObjectWriter,
    RetryPolicy, Retrying, Storage, StorageExt, StorageHints, WriterOptions,
};

/// A backend under test, with whatever must outlive it.
struct Fixture {
    store: Arc<dyn Storage>,
    _dir: Option<tempfile::TempDir>,
}

fn memory() -> Fixture {
    Fixture { store: Arc::new(MemoryStorage::new()), _dir: None }
}

/// Local disk with 1 MiB blocks, so `BIG_LOCAL` spans several blocks and threads.
fn local() -> Fixture {
    local_with(2, false)
}

/// [`local`], with short stretches far apart copied out of a mapping of the file.
fn local_mapped() -> Fixture {
    local_with(2, true)
}

/// [`local`] without write threads: every block written on the writer's calling thread,
/// as in a process that cannot start a thread.
fn local_unthreaded() -> Fixture {
    local_with(0, false)
}

fn local_with(write_threads: usize, mapped_reads: bool) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let config = LocalConfig { write_threads, block_bytes: 1 << 20, mapped_reads, ..Default::default() };
    let store = LocalStorage::with_config(dir.path(), config).unwrap();
    Fixture { store: Arc::new(store), _dir: Some(dir) }
}

/// Over three blocks of `local()`.
const BIG_LOCAL: usize = (3 << 20) + 777;

macro_rules! conformance {
    ($name:ident, $make:expr, $big:expr, $race_len:expr, $race_rounds:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn round_trips() {
                suite::round_trips(&$make.store, $big);
            }
            #[test]
            fn ranged_reads() {
                suite::ranged_reads(&$make.store);
            }
            #[test]
            fn picked_reads() {
                suite::picked_reads(&$make.store);
            }
            #[test]
            fn sized_reads() {
                suite::sized_reads(&$make.store);
            }
            #[test]
            fn list_and_delete() {
                suite::list_and_delete(&$make.store);
            }
            #[test]
            fn conditional_create_one_winner() {
                suite::conditional_create_one_winner(&$make.store);
            }
            #[test]
            fn conditional_replace_one_winner() {
                suite::conditional_replace_one_winner(&$make.store);
            }
            #[test]
            fn abort_leaves_nothing() {
                suite::abort_leaves_nothing(&$make.store, $big);
            }
            #[test]
            fn reader_sees_old_or_new() {
                suite::reader_sees_old_or_new(&$make.store, $race_len, $race_rounds);
            }
            #[test]
            fn odd_names() {
                suite::odd_names(&$make.store);
            }
            #[test]
            fn invalid_paths() {
                suite::invalid_paths(&$make.store);
            }
            #[test]
            fn live_writes_are_not_abandoned() {
                suite::live_writes_are_not_abandoned(&$make.store, $big);
            }
        }
    };
}

conformance!(memory_backend, memory(), BIG_LOCAL, 1 << 20, 50);
conformance!(local_backend, local(), BIG_LOCAL, 1 << 20, 30);
conformance!(local_backend_mapped, local_mapped(), BIG_LOCAL, 1 << 20, 30);
conformance!(local_backend_unthreaded, local_unthreaded(), BIG_LOCAL, 1 << 20, 30);
// The wrapper with no faults configured is transparent, as the counting one is.
conformance!(fault_wrapper_without_faults, faulty_local(), BIG_LOCAL, 1 << 20, 10);
conformance!(counting_wrapper, counting_memory(), BIG_LOCAL, 1 << 20, 10);

/// A local file cut short after its reader was opened: the error says where the file ends
/// (it said only that it ended before the range).
#[test]
fn a_local_read_past_a_cut_file_names_where_it_ends() {
    let f = local();
    let dir = f._dir.as_ref().unwrap().path().to_path_buf();
    f.store.put("cut/t", pattern(100, 3)).unwrap();
    let mut r = f.store.reader("cut/t").unwrap();
    std::fs::OpenOptions::new().write(true).open(dir.join("cut/t")).unwrap().set_len(10).unwrap();
    let mut buf = [0u8; 20];
    let e = r.read_into(&mut [(50, &mut buf[..])]).unwrap_err().to_string();
    assert!(e.contains("cut/t") && e.contains("ends before byte 50"), "{e}");
}

fn counting_memory() -> Fixture {
    Fixture { store: Arc::new(Counting::new(memory().store)), _dir: None }
}

fn faulty_local() -> Fixture {
    let Fixture { store, _dir } = local();
    Fixture { store: Arc::new(FaultStorage::new(store, FaultConfig::default())), _dir }
}

/// A small save: two data objects (one put, one streamed) then a conditional-create commit.
fn save(s: &dyn Storage) -> dckpt_storage::Result<()> {
    s.put("ck/data_0", pattern(5000, 1))?;
    suite::stream(s, "ck/data_1", &pattern(BIG_LOCAL, 2))?;
    s.put_if_absent("ck/commit", Bytes::from_static(b"committed"))
}

fn expected(path: &str) -> Bytes {
    match path {
        "ck/data_0" => pattern(5000, 1),
        "ck/data_1" => pattern(BIG_LOCAL, 2),
        "ck/commit" => Bytes::from_static(b"committed"),
        other => panic!("unexpected object {other}"),
    }
}

/// Every visible object is whole; the commit is there only if everything before it is.
fn check_after_fault(inner: &dyn Storage, seed: u64, op: u64) {
    let listed = inner.list("").unwrap();
    for o in &listed {
        assert_eq!(inner.get(&o.path).unwrap(), expected(&o.path), "seed {seed}, op {op}: {} is torn", o.path);
    }
    if inner.exists("ck/commit").unwrap() {
        assert_eq!(listed.len(), 3, "seed {seed}, op {op}: commit without its data");
    }
}

fn backends_for_faults() -> Vec<(&'static str, Fixture)> {
    vec![("memory", memory()), ("local", local())]
}

/// Failing each operation of a save in turn, before or after it takes effect, never leaves a
/// torn object, and a failure before effect leaves nothing under that name.
#[test]
fn failed_operations_leave_whole_objects_or_nothing() {
    for (name, _) in backends_for_faults() {
        let dry_fixture = if name == "memory" { memory() } else { local() };
        let dry = FaultStorage::new(dry_fixture.store.clone(), FaultConfig::default());
        save(&dry).unwrap();
        let ops = dry.ops();
        assert!(ops > 5, "the save should be several operations, got {ops}");
        for after_effect in [false, true] {
            for i in 0..ops {
                let f = if name == "memory" { memory() } else { local() };
                let seed = 1000 + i;
                let config =
                    FaultConfig { seed, fail_op: Some(i), fail_after_effect: after_effect, ..Default::default() };
                let s = FaultStorage::new(f.store.clone(), config);
                let r = save(&s);
                assert!(matches!(r, Err(Error::Injected { op_index, .. }) if op_index == i), "{name} op {i}: {r:?}");
                assert_eq!(s.injected().len(), 1);
                check_after_fault(f.store.as_ref(), seed, i);
                if !after_effect {
                    assert!(!f.store.exists("ck/commit").unwrap(), "{name} op {i}: committed despite a failure");
                }
            }
        }
    }
}

/// A crash at each operation (every later operation fails too) leaves whole objects only.
#[test]
fn crash_at_any_operation_leaves_whole_objects() {
    for i in 0..12 {
        let f = local();
        let s =
            FaultStorage::new(f.store.clone(), FaultConfig { seed: i, fail_from_op: Some(i), ..Default::default() });
        let _ = save(&s);
        check_after_fault(f.store.as_ref(), i, i);
        // Nothing left behind either, not even temporaries: the writers were dropped.
        let tmp = f._dir.as_ref().unwrap().path();
        let names: Vec<String> = walkdir(tmp);
        assert!(names.iter().all(|n| !n.contains(".dckpt-tmp")), "leftovers: {names:?}");
    }
}

fn walkdir(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            out.extend(walkdir(&e.path()));
        } else {
            out.push(e.path().display().to_string());
        }
    }
    out
}

/// A write torn after k bytes (put, create or stream) fails and leaves nothing visible.
#[test]
fn torn_writes_leave_nothing_visible() {
    for (name, f) in backends_for_faults() {
        for k in [0u64, 1, 4999, 1 << 20, BIG_LOCAL as u64 - 1] {
            let s = FaultStorage::new(
                f.store.clone(),
                FaultConfig { seed: k, tear_after_bytes: Some(k), ..Default::default() },
            );
            let r = s.put("torn/put", pattern(5000, 1));
            assert!(
                matches!(&r, Err(Error::Injected { kind, .. }) if kind == "torn write") || k >= 5000,
                "{name} k={k}: {r:?}"
            );
            let r = suite::stream(&s, "torn/stream", &pattern(BIG_LOCAL, 2));
            assert!(matches!(&r, Err(Error::Injected { kind, .. }) if kind == "torn write"), "{name} k={k}: {r:?}");
            let r = s.put_if_absent("torn/commit", pattern(5000, 3));
            assert!(r.is_err() || k >= 5000, "{name} k={k}: {r:?}");
            assert!(!f.store.exists("torn/stream").unwrap(), "{name} k={k}");
            if k < 5000 {
                assert!(f.store.list("torn").unwrap().is_empty(), "{name} k={k}");
            }
            f.store.delete("torn/put").unwrap();
            f.store.delete("torn/commit").unwrap();
        }
    }
}

/// Throttled operations succeed through `Retrying` within its bound, and fail with a
/// transient error once the bound is spent.
#[test]
fn retries_turn_throttling_into_success_within_the_bound() {
    let policy = RetryPolicy { attempts_max: 30, backoff_initial_ms: 1, backoff_max_ms: 4 };
    let config = FaultConfig { seed: 77, throttle_probability: 0.5, ..Default::default() };
    let faulty = Arc::new(FaultStorage::new(Arc::new(MemoryStorage::new()), config));
    let s: Arc<dyn Storage> = Arc::new(Retrying::new(faulty.clone(), policy));
    suite::list_and_delete(&s);
    suite::ranged_reads(&s);
    suite::picked_reads(&s);
    let throttles = faulty.injected().iter().filter(|f| f.kind == "throttle").count();
    assert!(throttles > 10, "seed 77 should throttle often, got {throttles}");

    // Always throttled: exactly `attempts_max` tries, then the transient error surfaces.
    let always = Arc::new(FaultStorage::new(
        Arc::new(MemoryStorage::new()),
        FaultConfig { seed: 1, throttle_probability: 1.0, ..Default::default() },
    ));
    let s = Retrying::new(always.clone(), RetryPolicy { attempts_max: 3, backoff_initial_ms: 1, backoff_max_ms: 2 });
    let r = s.put("x", Bytes::from_static(b"x"));
    assert!(matches!(&r, Err(e) if e.is_transient()), "{r:?}");
    assert_eq!(always.ops(), 3);
    // Permanent errors are not retried.
    let fresh = Arc::new(FaultStorage::new(Arc::new(MemoryStorage::new()), FaultConfig::default()));
    let s = Retrying::new(fresh.clone(), RetryPolicy::default());
    assert!(matches!(s.get("missing"), Err(Error::NotFound { .. })));
    assert_eq!(fresh.ops(), 1);
}

/// A read with a flipped bit differs from the stored bytes in exactly one bit.
/// A store whose deletes take a while, counting how many are in flight at once.
#[derive(Debug)]
struct SlowDeletes {
    inner: MemoryStorage,
    now: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
}

impl Storage for SlowDeletes {
    fn location(&self, path: &str) -> String {
        self.inner.location(path)
    }
    fn put(&self, path: &str, data: Bytes) -> dckpt_storage::Result<()> {
        self.inner.put(path, data)
    }
    fn put_if_absent(&self, path: &str, data: Bytes) -> dckpt_storage::Result<()> {
        self.inner.put_if_absent(path, data)
    }
    fn put_if_match(&self, path: &str, data: Bytes, expected: &[u8]) -> dckpt_storage::Result<()> {
        self.inner.put_if_match(path, data, expected)
    }
    fn writer(&self, path: &str, options: &WriterOptions) -> dckpt_storage::Result<Box<dyn ObjectWriter>> {
        self.inner.writer(path, options)
    }
    fn get(&self, path: &str) -> dckpt_storage::Result<Bytes> {
        self.inner.get(path)
    }
    fn get_ranges(&self, path: &str, ranges: &[std::ops::Range<u64>]) -> dckpt_storage::Result<Vec<Bytes>> {
        self.inner.get_ranges(path, ranges)
    }
    fn read_into(&self, path: &str, reads: &mut [(u64, &mut [u8])]) -> dckpt_storage::Result<()> {
        self.inner.read_into(path, reads)
    }
    fn reader_sized(&self, path: &str, len: u64) -> dckpt_storage::Result<Box<dyn dckpt_storage::ObjectReader + '_>> {
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
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.now.fetch_add(1, SeqCst) + 1;
        self.most.fetch_max(now, SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(20));
        self.now.fetch_sub(1, SeqCst);
        if path.ends_with("bad") {
            return Err(Error::WriterFailed { path: path.into() });
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

/// `delete_all` has several deletes in flight (a replacing save's coordinator deleted the old
/// files one after another, its peers waiting), hears every result, and begins no more once
/// told to stop.
#[test]
fn delete_all_deletes_several_at_once_and_stops_when_told() {
    let store = SlowDeletes { inner: MemoryStorage::new(), now: Default::default(), most: Default::default() };
    let paths: Vec<String> = (0..40).map(|i| format!("f{i:02}")).collect();
    for p in &paths {
        store.put(p, Bytes::from_static(b"x")).unwrap();
    }
    let mut heard = Vec::new();
    store.delete_all(&paths, |p, r| {
        heard.push((p.to_string(), r.is_ok()));
        true
    });
    heard.sort();
    assert_eq!(heard, paths.iter().map(|p| (p.clone(), true)).collect::<Vec<_>>());
    assert!(store.list("").unwrap().is_empty());
    assert!(store.most.load(std::sync::atomic::Ordering::SeqCst) > 1, "one delete at a time");
    // A failure that stops it: what was not begun stays.
    let paths: Vec<String> = (0..200).map(|i| if i == 0 { "bad".to_string() } else { format!("g{i:03}") }).collect();
    for p in &paths {
        store.put(p, Bytes::from_static(b"x")).unwrap();
    }
    let mut failures = 0;
    store.delete_all(&paths, |_, r| {
        failures += usize::from(r.is_err());
        r.is_ok()
    });
    assert_eq!(failures, 1);
    let left = store.list("").unwrap().len();
    assert!(left > 100, "{left} of 200 left: the deletes went on after the stop");
}

#[test]
fn bit_flips_change_exactly_one_bit() {
    let inner = Arc::new(MemoryStorage::new());
    inner.put("obj", pattern(4096, 5)).unwrap();
    let s = FaultStorage::new(inner, FaultConfig { seed: 3, bit_flip_probability: 1.0, ..Default::default() });
    let got = s.get("obj").unwrap();
    let diff: u32 = got.iter().zip(pattern(4096, 5).iter()).map(|(a, b)| (a ^ b).count_ones()).sum();
    assert_eq!(diff, 1);
    let r = s.get_ranges("obj", &[0..10, 100..4096]).unwrap();
    let diff: u32 = r[0]
        .iter()
        .chain(r[1].iter())
        .zip(pattern(4096, 5)[..10].iter().chain(pattern(4096, 5)[100..].iter()))
        .map(|(a, b)| (a ^ b).count_ones())
        .sum();
    assert_eq!(diff, 1);
}

/// The same seed and workload inject the same faults; the seed is in every injected error.
#[test]
fn faults_replay_from_the_seed() {
    let run = |seed: u64| {
        let config = FaultConfig { seed, throttle_probability: 0.3, bit_flip_probability: 0.3, ..Default::default() };
        let s = FaultStorage::new(Arc::new(MemoryStorage::new()), config);
        let mut errors = Vec::new();
        for i in 0..50 {
            if let Err(e) = s.put(&format!("o{i}"), pattern(64, i)) {
                assert!(e.to_string().contains(&format!("seed {seed}")), "{e}");
                errors.push(i);
            }
            let _ = s.get(&format!("o{i}"));
        }
        (s.injected(), errors)
    };
    assert_eq!(run(11), run(11));
    assert_ne!(run(11), run(12));
}

/// Latency is added per operation.
#[test]
fn latency_is_added() {
    let s = FaultStorage::new(
        Arc::new(MemoryStorage::new()),
        FaultConfig { seed: 1, latency_min_ms: 20, latency_max_ms: 30, ..Default::default() },
    );
    let start = std::time::Instant::now();
    s.put("a", Bytes::new()).unwrap();
    s.get("a").unwrap();
    assert!(start.elapsed() >= std::time::Duration::from_millis(40));
}

/// A failed writer stays failed and its object never appears.
#[test]
fn failed_writer_stays_failed() {
    let inner: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    let s = FaultStorage::new(inner.clone(), FaultConfig { seed: 5, fail_op: Some(2), ..Default::default() });
    let mut w = s.writer("w", &WriterOptions::default()).unwrap(); // op 0
    w.write(b"abc").unwrap(); // op 1
    assert!(matches!(w.write(b"def"), Err(Error::Injected { op_index: 2, .. })));
    assert!(matches!(w.write(b"ghi"), Err(Error::WriterFailed { .. })));
    assert!(matches!(w.finish(), Err(Error::WriterFailed { .. })));
    assert!(!inner.exists("w").unwrap());
}

/// URLs choose the backend; named memory stores are shared, bad URLs are errors.
#[test]
fn urls_select_backends() {
    let a = dckpt_storage::open("memory://shared-test").unwrap();
    let b = dckpt_storage::open("memory://shared-test").unwrap();
    a.put("x", Bytes::from_static(b"1")).unwrap();
    assert_eq!(b.get("x").unwrap(), Bytes::from_static(b"1"));
    let fresh = dckpt_storage::open("memory://").unwrap();
    assert!(!fresh.exists("x").unwrap());
    // A path after the name is a directory of that store, as its locations read.
    let under = dckpt_storage::open("memory://shared-test/step-1/").unwrap();
    under.put("y", Bytes::from_static(b"3")).unwrap();
    assert_eq!(a.get("step-1/y").unwrap(), Bytes::from_static(b"3"));
    assert_eq!(under.location("y"), a.location("step-1/y"));

    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    dckpt_storage::open(&url).unwrap().put("f", Bytes::from_static(b"2")).unwrap();
    let plain = dckpt_storage::open(&dir.path().display().to_string()).unwrap();
    assert_eq!(plain.get("f").unwrap(), Bytes::from_static(b"2"));
    assert_eq!(std::fs::read(dir.path().join("f")).unwrap(), b"2");

    for bad in ["gs://bucket/x", "file://relative", "s3://", ""] {
        let r = dckpt_storage::open(bad);
        assert!(matches!(r, Err(Error::Config { .. })), "{bad:?}: {:?}", r.map(|_| ()));
    }
}

#[allow(dead_code)]
fn writer_is_object_safe(_: Box<dyn ObjectWriter>) {}

/// Wrappers pass the hints of what they wrap on (a wrapper that dropped `object_bytes_max`
/// once made every S3 save one multipart upload per rank), and the fault wrapper replaces
/// only the hint it is told to.
#[test]
fn wrappers_pass_the_hints_on() {
    let local = local();
    let own = local.store.hints();
    assert!(own.read_window.is_some_and(|w| w > 0) && own.object_bytes_max.is_none(), "{own:?}");
    assert!(own.writes_in_flight.is_some_and(|n| n > 1), "local disk writes several files at once: {own:?}");
    assert_eq!(MemoryStorage::new().hints(), StorageHints::NONE);
    let retrying = Retrying::new(local.store.clone(), RetryPolicy::default());
    assert_eq!(retrying.hints(), own);
    let faulty = FaultStorage::new(local.store.clone(), FaultConfig::default());
    assert_eq!(faulty.hints(), own);
    let cut = FaultStorage::new(local.store.clone(), FaultConfig { object_bytes_max: Some(99), ..Default::default() });
    assert_eq!(cut.hints(), own.with_object_bytes_max(Some(99)));
    let windowed = FaultStorage::new(Arc::new(retrying), FaultConfig { read_window: Some(7), ..Default::default() });
    assert_eq!(windowed.hints(), own.with_read_window(Some(7)));
    assert_eq!(Counting::new(Arc::new(windowed)).hints(), own.with_read_window(Some(7)));
}

/// The temporaries of writers in other processes: one that died (its lock is free), one
/// still running (an open file holds its lock). Returns their paths under the root and the
/// file that holds the live one's lock.
#[cfg(unix)]
fn foreign_temporaries(root: &std::path::Path) -> (String, String, std::fs::File) {
    use std::os::fd::AsRawFd;
    std::fs::create_dir_all(root.join("ck")).unwrap();
    let dead = "ck/.dckpt-tmp.4000001-0badf00d.0.data".to_string();
    let live = "ck/.dckpt-tmp.4000002-0badf00d.0.data".to_string();
    std::fs::write(root.join(&dead), b"partial").unwrap();
    std::fs::write(root.join(&live), b"still being written").unwrap();
    let holder = std::fs::File::open(root.join(&live)).unwrap();
    // SAFETY: a plain system call on a descriptor the test owns.
    assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    (dead, live, holder)
}

/// A dead process's temporary for the very object a prefix names is listed at that prefix,
/// whether or not the object is there (it was listed only under the name as a directory).
#[cfg(unix)]
#[test]
fn local_abandoned_write_of_the_prefixs_own_object_is_listed() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStorage::new(dir.path()).unwrap();
    let (dead, _live, _holder) = foreign_temporaries(dir.path());
    let paths = |v: Vec<ObjectInfo>| v.into_iter().map(|o| o.path).collect::<Vec<_>>();
    assert_eq!(paths(store.list_abandoned("ck/data").unwrap()), vec![dead.clone()]);
    store.put("ck/data", Bytes::from_static(b"x")).unwrap();
    assert_eq!(paths(store.list_abandoned("ck/data").unwrap()), vec![dead.clone()]);
    assert_eq!(paths(store.list_abandoned("ck/dat").unwrap()), Vec::<String>::new());
    assert_eq!(paths(store.remove_abandoned("ck/data").unwrap()), vec![dead.clone()]);
    assert!(!dir.path().join(&dead).exists());
    assert_eq!(store.get("ck/data").unwrap(), Bytes::from_static(b"x"));
}

/// A conditional replace sizes the object before it reads it: one now far larger than the
/// bytes expected fails the precondition (it was read whole first, and the process aborted
/// allocating a terabyte).
#[cfg(unix)]
#[test]
fn local_replace_of_a_huge_object_fails_its_precondition_without_reading_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStorage::new(dir.path()).unwrap();
    store.put("m", Bytes::from_static(b"old")).unwrap();
    std::fs::OpenOptions::new().write(true).open(dir.path().join("m")).unwrap().set_len(1 << 40).unwrap();
    let r = store.put_if_match("m", Bytes::from_static(b"new"), b"old");
    assert!(matches!(r, Err(Error::Precondition { .. })), "{r:?}");
}

/// A writer whose temporary was removed under it (a cleaner on a host that cannot see its
/// lock) fails naming the temporary, not as the target's absence.
#[cfg(unix)]
#[test]
fn local_writer_whose_temporary_vanished_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStorage::new(dir.path()).unwrap();
    let mut w = store.writer("v/obj", &WriterOptions::default()).unwrap();
    w.write(b"x").unwrap();
    let tmp: Vec<_> = std::fs::read_dir(dir.path().join("v")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(tmp.len(), 1, "{tmp:?}");
    std::fs::remove_file(&tmp[0]).unwrap();
    let e = w.finish().unwrap_err();
    assert!(!matches!(e, Error::NotFound { .. }), "{e:?}");
    let text = format!("{e}");
    assert!(text.contains("temporary") && text.contains(".dckpt-tmp"), "{text}");
    assert!(!dir.path().join("v/obj").exists());
}

/// A dead process's temporary (lock free) is an abandoned write: never listed as an object,
/// listed with its size by `list_abandoned`, removed by `remove_abandoned`. A temporary whose
/// lock a live writer holds, and this process's own unfinished writer, are neither.
#[cfg(unix)]
#[test]
fn local_abandoned_writes_are_listed_and_removed_and_live_ones_kept() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStorage::new(dir.path()).unwrap();
    let mut own = store.writer("ck/own", &WriterOptions::default()).unwrap();
    own.write(b"mine").unwrap();
    let (dead, live, holder) = foreign_temporaries(dir.path());
    assert!(store.list("").unwrap().is_empty());
    assert_eq!(walkdir(dir.path()).len(), 3);
    let dead_info = ObjectInfo { path: dead.clone(), size: 7 };
    assert_eq!(store.list_abandoned("").unwrap(), vec![dead_info.clone()]);
    assert_eq!(store.list_abandoned("ck").unwrap(), vec![dead_info.clone()]);
    assert_eq!(store.list_abandoned("other").unwrap(), vec![]);
    assert_eq!(store.remove_abandoned("").unwrap(), vec![dead_info]);
    assert!(!dir.path().join(&dead).exists());
    assert_eq!(walkdir(dir.path()).len(), 2);
    assert_eq!(own.finish().unwrap(), 4);
    assert_eq!(store.get("ck/own").unwrap(), Bytes::from_static(b"mine"));
    // Its writer gone, the other one is abandoned too.
    drop(holder);
    assert_eq!(store.remove_abandoned("ck").unwrap(), vec![ObjectInfo { path: live, size: 19 }]);
    assert_eq!(walkdir(dir.path()), vec![dir.path().join("ck/own").display().to_string()]);
}

/// A writer of this process that never finishes nor drops (`mem::forget`) keeps its file
/// open, so its temporary is never abandoned while the process lives.
#[test]
fn local_forgotten_writer_of_a_live_process_is_not_abandoned() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStorage::new(dir.path()).unwrap();
    let mut w = store.writer("ck/data", &WriterOptions::default()).unwrap();
    w.write(b"partial").unwrap();
    std::mem::forget(w);
    assert!(store.list("").unwrap().is_empty());
    assert!(!store.exists("ck/data").unwrap());
    assert_eq!(store.remove_abandoned("").unwrap(), vec![]);
    assert_eq!(walkdir(dir.path()).len(), 1);
}

/// The wrappers pass the abandoned writes on, and the fault wrapper counts and fails them
/// like every other operation.
#[cfg(unix)]
#[test]
fn wrappers_pass_abandoned_writes_on() {
    let dir = tempfile::tempdir().unwrap();
    let local: Arc<dyn Storage> = Arc::new(LocalStorage::new(dir.path()).unwrap());
    let (dead, _live, _holder) = foreign_temporaries(dir.path());
    let dead_info = vec![ObjectInfo { path: dead, size: 7 }];
    let retrying = Retrying::new(local.clone(), RetryPolicy::default());
    assert_eq!(retrying.list_abandoned("").unwrap(), dead_info);
    let counted = FaultStorage::new(local.clone(), FaultConfig::default());
    assert_eq!(counted.list_abandoned("").unwrap(), dead_info);
    assert_eq!(counted.ops(), 1);
    let counting = Counting::new(local.clone());
    assert_eq!(counting.list_abandoned("").unwrap(), dead_info);
    assert_eq!(counting.counts().abandoned, 1);
    let failing = FaultStorage::new(local.clone(), FaultConfig { fail_op: Some(0), ..Default::default() });
    let r = failing.remove_abandoned("");
    assert!(matches!(r, Err(Error::Injected { op_index: 0, .. })), "{r:?}");
    assert_eq!(failing.injected()[0].op, "remove_abandoned");
    assert_eq!(local.list_abandoned("").unwrap(), dead_info);
    assert_eq!(failing.remove_abandoned("").unwrap(), dead_info);
    assert_eq!(local.list_abandoned("").unwrap(), vec![]);
}

/// The counting wrapper counts each call by kind when made (a failed one too), the bytes of
/// those that succeeded, and only the paths its filter accepts.
#[test]
fn counting_counts_calls_by_kind() {
    let store = Counting::new(memory().store);
    store.put("ck/a", pattern(100, 1)).unwrap();
    store.put_if_absent("ck/b", pattern(10, 2)).unwrap();
    assert!(store.put_if_absent("ck/b", pattern(10, 2)).is_err());
    store.put_if_match("ck/b", pattern(20, 3), &pattern(10, 2)).unwrap();
    suite::stream(&store, "ck/c", &pattern(5000, 4)).unwrap();
    store.get("ck/a").unwrap();
    store.get_ranges("ck/a", &[0..10, 20..20, 30..40]).unwrap();
    store.read_into("ck/c", &mut [(0, &mut [0u8; 7][..])]).unwrap();
    let mut reader = store.reader_sized("ck/c", 5000).unwrap();
    reader.read_into(&mut [(1, &mut [0u8; 3][..]), (9, &mut [0u8; 2][..])]).unwrap();
    drop(reader);
    assert!(store.reader_sized("ck/c", 4999).is_err());
    store.size("ck/a").unwrap();
    store.list("ck").unwrap();
    store.delete("ck/a").unwrap();
    store.prefetch("ck/c", 0, 10);
    let c = store.counts();
    assert_eq!((c.puts, c.creates, c.replaces, c.writers, c.gets), (1, 2, 1, 1, 1), "{c:?}");
    assert_eq!((c.ranged_reads, c.ranges, c.readers, c.sizes, c.lists, c.deletes), (3, 5, 2, 1, 1, 1), "{c:?}");
    assert_eq!(c.bytes_written, 100 + 10 + 20 + 5000, "{c:?}");
    assert_eq!(c.bytes_read, 100 + 20 + 7 + 5, "{c:?}");
    assert_eq!((c.requests(), c.writes()), (12, 5), "{c:?}");

    let data_only = Counting::only(memory().store, |p| p.starts_with("data/"));
    data_only.put("meta", pattern(5, 1)).unwrap();
    data_only.put("data/0", pattern(5, 1)).unwrap();
    data_only.size("meta").unwrap();
    data_only.reader_sized("meta", 5).unwrap().read_into(&mut [(0, &mut [0u8; 5][..])]).unwrap();
    data_only.reader_sized("data/0", 5).unwrap().read_into(&mut [(0, &mut [0u8; 5][..])]).unwrap();
    let c = data_only.counts();
    assert_eq!((c.puts, c.sizes, c.readers, c.ranged_reads, c.bytes_read), (1, 0, 1, 1, 5), "{c:?}");
}

/// Every other 1 KiB of `from..to`: short stretches far apart, as a column split of a
/// row-major chunk reads them.
#[cfg(target_os = "linux")]
fn strided(from: usize, to: usize) -> Vec<(usize, Vec<u8>)> {
    (from..to).step_by(2048).map(|at| (at, vec![0u8; 1024])).collect()
}

/// Whether this process has a mapping of `file` now.
#[cfg(target_os = "linux")]
fn mapped_now(file: &std::path::Path) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let name = file.canonicalize().unwrap().display().to_string();
    maps.lines().any(|l| l.ends_with(&name))
}

/// Mapped copies are an opt-in: by default a local reader reads short stretches far apart
/// by system calls and never maps the file (so it never installs its `SIGBUS` handler);
/// with `mapped_reads` the same reads come out of a mapping. Both read the right bytes.
#[cfg(target_os = "linux")]
#[test]
fn local_mapped_reads_are_opt_in() {
    for mapped_reads in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let config = LocalConfig { mapped_reads, ..Default::default() };
        let store = LocalStorage::with_config(dir.path(), config).unwrap();
        let len = 1 << 20;
        let data = pattern(len, 5);
        store.put("ck/data", data.clone()).unwrap();
        let mut reader = store.reader("ck/data").unwrap();
        let mut bufs = strided(0, len);
        let mut reads: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(at, b)| (*at as u64, b.as_mut_slice())).collect();
        reader.read_into(&mut reads).unwrap();
        for (at, b) in &bufs {
            assert_eq!(&b[..], &data[*at..*at + b.len()], "at {at}, mapped_reads {mapped_reads}");
        }
        assert_eq!(mapped_now(&dir.path().join("ck/data")), mapped_reads, "mapped_reads {mapped_reads}");
        assert_eq!(store.hints().reads_in_place, mapped_reads, "inspected reads in place only when mapped");
        drop(reader);
        assert!(!mapped_now(&dir.path().join("ck/data")), "a dropped reader unmaps");
    }
}

/// Short stretches far apart are copied out of a mapping of the file on local disk (when
/// asked to). A file cut short after the reader mapped it is an error naming the file and an
/// offset (not `SIGBUS`), and the same reader then reads what is left by system calls.
#[cfg(target_os = "linux")]
#[test]
fn local_file_cut_short_under_a_reader_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        LocalStorage::with_config(dir.path(), LocalConfig { mapped_reads: true, ..Default::default() }).unwrap();
    let len = 4 << 20;
    let data = pattern(len, 9);
    store.put("ck/data", data.clone()).unwrap();
    let mut reader = store.reader("ck/data").unwrap();
    let mut bufs = strided(0, len);
    let mut reads: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(at, b)| (*at as u64, b.as_mut_slice())).collect();
    reader.read_into(&mut reads).unwrap();
    for (at, b) in &bufs {
        assert_eq!(&b[..], &data[*at..*at + b.len()], "at {at}");
    }
    let cut = 1 << 20;
    std::fs::OpenOptions::new().write(true).open(dir.path().join("ck/data")).unwrap().set_len(cut as u64).unwrap();
    let mut bufs = strided(0, len);
    let mut reads: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(at, b)| (*at as u64, b.as_mut_slice())).collect();
    let e = reader.read_into(&mut reads).expect_err("the file was cut short");
    let msg = e.to_string();
    assert!(msg.contains("ck/data") && msg.contains("cut short"), "{msg}");
    // A page past the new end faulted ("the page at offset N could not be read"), or, where
    // a kernel maps a large page-cache folio across the new end as zeros, the size check
    // after the copy caught it ("... short of a read that ended at N").
    let after =
        |key: &str| msg.split(key).nth(1).and_then(|m| m.split(' ').next()).map(|n| n.parse::<usize>().unwrap());
    let at = after("offset ").or_else(|| after("ended at ")).unwrap_or_else(|| panic!("{msg}"));
    assert!((cut..=len).contains(&at), "{msg}");
    // What is left reads, through the same reader.
    let mut bufs = strided(0, cut);
    let mut reads: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(at, b)| (*at as u64, b.as_mut_slice())).collect();
    reader.read_into(&mut reads).unwrap();
    for (at, b) in &bufs {
        assert_eq!(&b[..], &data[*at..*at + b.len()], "at {at}");
    }
}

/// The S3 backend (feature `s3`). Most of these need a server; see the top of this file.
#[cfg(feature = "s3")]
mod s3 {
    use std::sync::atomic::{AtomicU64, Ordering};

    use dckpt_storage::{S3Config, S3Storage};

    use super::*;

    /// Over three 5 MiB parts of `s3()`.
    const BIG_S3: usize = (15 << 20) + 4321;

    /// The test S3 server, under a prefix of its own per call.
    fn s3() -> Fixture {
        s3_with(4)
    }

    fn s3_with(concurrency_max: usize) -> Fixture {
        Fixture { store: Arc::new(S3Storage::from_url(&s3_url(), s3_config(concurrency_max)).unwrap()), _dir: None }
    }

    /// A fresh prefix of the test server.
    fn s3_url() -> String {
        let Some(base) = std::env::var("DCKPT_TEST_S3_URL").ok().filter(|u| !u.is_empty()) else {
            panic!(
                "DCKPT_TEST_S3_URL is not set, so there is no S3 server to test against. \
                 Run `cargo xtask test` (it starts a local moto S3 server and sets DCKPT_TEST_S3_URL \
                 and AWS_*), or point DCKPT_TEST_S3_URL=s3://bucket/prefix and AWS_ENDPOINT_URL, \
                 AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP at a running one."
            )
        };
        static N: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        format!("{}/t{}-{}-{}", base.trim_end_matches('/'), std::process::id(), nanos, N.fetch_add(1, Ordering::SeqCst))
    }

    fn s3_config(concurrency_max: usize) -> S3Config {
        // Objects over one part are multipart uploads even with a size hint (see
        // `s3_writer_with_a_hint_within_put_bytes_max_is_one_put` for the single PUT).
        S3Config {
            part_bytes: 5 << 20,
            put_bytes_max: 5 << 20,
            concurrency_max,
            retry: RetryPolicy { attempts_max: 4, backoff_initial_ms: 20, backoff_max_ms: 500 },
            ..Default::default()
        }
    }

    /// The multipart uploads open under `url` (`s3://bucket/prefix`) on the test server, by
    /// a plain ListMultipartUploads request (`object_store` has no call for it; the test
    /// server takes unsigned requests).
    fn open_uploads(url: &str) -> usize {
        use std::io::{Read, Write};
        let endpoint = std::env::var("AWS_ENDPOINT_URL").expect("AWS_ENDPOINT_URL of the test server");
        let host = endpoint.strip_prefix("http://").expect("an http:// test server").trim_end_matches('/');
        let (bucket, prefix) = url.strip_prefix("s3://").unwrap().split_once('/').unwrap();
        let mut s = std::net::TcpStream::connect(host).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        let req =
            format!("GET /{bucket}?uploads&prefix={prefix}/ HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        reply.matches("<UploadId>").count()
    }

    /// An empty object at `key` of `bucket` on the test server, by a plain PUT (the store's
    /// own calls refuse a key ending in `/`, as a console's "create folder" makes).
    fn raw_put_empty(bucket: &str, key: &str) {
        use std::io::{Read, Write};
        let endpoint = std::env::var("AWS_ENDPOINT_URL").expect("AWS_ENDPOINT_URL of the test server");
        let host = endpoint.strip_prefix("http://").expect("an http:// test server").trim_end_matches('/');
        let mut s = std::net::TcpStream::connect(host).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        let req =
            format!("PUT /{bucket}/{key} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    }

    /// The folder markers a console's "create folder" leaves (empty `dir/` objects) are not
    /// listed: the store's own root's was listed under its whole key, a stray object that
    /// made a new save's root look taken; one over objects, as an empty object beside them.
    #[test]
    fn s3_folder_markers_are_not_listed() {
        let url = s3_url();
        let (bucket, prefix) = url.strip_prefix("s3://").unwrap().split_once('/').unwrap();
        raw_put_empty(bucket, &format!("{prefix}/"));
        let store = S3Storage::from_url(&url, s3_config(2)).unwrap();
        assert_eq!(store.list("").unwrap(), []);
        store.put("step-1/data", Bytes::from_static(b"xyz")).unwrap();
        store.put("empty", Bytes::new()).unwrap();
        raw_put_empty(bucket, &format!("{prefix}/step-1/"));
        let listed: Vec<(String, u64)> = store.list("").unwrap().into_iter().map(|o| (o.path, o.size)).collect();
        assert_eq!(listed, [("empty".to_string(), 0), ("step-1/data".to_string(), 3)]);
    }

    /// A writer that started a multipart upload and then is aborted, or dropped unfinished (a
    /// failed save drops its writers, and its process may exit right after), leaves no upload
    /// open: the drop waits for S3 to confirm the abort.
    #[test]
    fn s3_aborted_or_dropped_writers_leave_no_upload_open() {
        let url = s3_url();
        let store = S3Storage::from_url(&url, s3_config(2)).unwrap();
        let data = pattern(11 << 20, 5);
        for how in ["drop", "abort"] {
            let mut w = store.writer(&format!("up/{how}"), &WriterOptions::default()).unwrap();
            w.write(&data).unwrap();
            assert_eq!(open_uploads(&url), 1, "{how}: two parts sent, the upload is open");
            match how {
                "drop" => drop(w),
                _ => w.abort().unwrap(),
            }
            assert_eq!(open_uploads(&url), 0, "{how}");
            assert!(!store.exists(&format!("up/{how}")).unwrap());
        }
        let mut w = store.writer("up/done", &WriterOptions::default()).unwrap();
        w.write(&data).unwrap();
        assert_eq!(w.finish().unwrap(), data.len() as u64);
        assert_eq!(open_uploads(&url), 0);
        assert_eq!(store.list_abandoned("").unwrap(), vec![]);
    }

    conformance!(s3_backend, s3(), BIG_S3, 256 << 10, 8);

    /// A size hint past S3's largest object is refused when the writer is made (it sized a
    /// part from it, and the first write's allocation aborted the process).
    #[test]
    fn s3_a_writer_told_of_more_than_an_object_holds_is_refused() {
        let s = s3();
        let hint = WriterOptions { size_hint_bytes: Some(u64::MAX) };
        let e = s.store.writer("huge", &hint).map(drop).unwrap_err().to_string();
        assert!(e.contains("huge") && e.contains("at most 5 TiB"), "{e}");
        let fits = WriterOptions { size_hint_bytes: Some(5 << 40) };
        let mut w = s.store.writer("small", &fits).unwrap();
        w.write(b"abc").unwrap();
        w.finish().unwrap();
        assert_eq!(s.store.get("small").unwrap(), Bytes::from_static(b"abc"));
    }

    /// Under a prefix with characters `object_store` would percent-encode, objects are
    /// stored under the keys asked for: a listing finds them, and names them as written.
    #[test]
    fn s3_a_prefix_with_odd_characters_lists_what_it_holds() {
        let url = format!("{}/exp~1/zo\u{eb}", s3_url());
        let s: Arc<dyn Storage> = Arc::new(S3Storage::from_url(&url, s3_config(4)).unwrap());
        suite::list_and_delete(&s);
        suite::odd_names(&s);
        s.put("step/x", pattern(5, 1)).unwrap();
        let parent = url.rsplit_once('/').unwrap().0;
        let up: Arc<dyn Storage> = Arc::new(S3Storage::from_url(parent, s3_config(4)).unwrap());
        assert_eq!(up.list("").unwrap(), vec![ObjectInfo { path: "zo\u{eb}/step/x".into(), size: 5 }]);
    }

    /// A reader of known length sends no HEAD: one GET per stretch it reads (ranges less than
    /// 1 MiB apart are one), none for empty ranges; a plain read of only empty ranges costs
    /// the HEAD that tells whether they lie inside the object.
    #[test]
    fn s3_sized_reader_sends_one_get_per_stretch_and_no_head() {
        let store = S3Storage::from_url(&s3_url(), s3_config(4)).unwrap();
        let n = 9u64 << 20;
        store.put("sized/obj", suite::pattern(n as usize, 9)).unwrap();
        let before = store.requests();
        let mut reader = store.reader_sized("sized/obj", n).unwrap();
        let mut bufs = [vec![0u8; 100], vec![0u8; 100], vec![0u8; 100]];
        let [a, b, c] = &mut bufs;
        // Two stretches: the first two ranges are less than 1 MiB apart.
        reader.read_into(&mut [(0, &mut a[..]), (1000, &mut b[..]), (5 << 20, &mut c[..])]).unwrap();
        reader.read_into(&mut [(7, &mut [][..]), (n, &mut [][..])]).unwrap();
        reader.read_into(&mut [(n - 100, &mut a[..])]).unwrap();
        drop(reader);
        let sent = store.requests();
        assert_eq!((sent.gets - before.gets, sent.heads - before.heads), (3, 0), "{sent:?}");
        store.read_into("sized/obj", &mut [(7, &mut [][..])]).unwrap();
        assert_eq!(store.requests().heads - sent.heads, 1);
    }

    /// The blocking S3 calls work from inside a tokio runtime (they must not panic there).
    #[test]
    fn s3_backend_works_inside_a_tokio_runtime() {
        let f = s3();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            f.store.put("rt/a", Bytes::from_static(b"inside")).unwrap();
            assert_eq!(f.store.get("rt/a").unwrap(), Bytes::from_static(b"inside"));
        });
    }

    /// The suite's fault invariants hold on S3 too: each operation of a save failing in turn.
    #[test]
    fn s3_backend_failed_operations_leave_whole_objects_or_nothing() {
        let dry = FaultStorage::new(s3().store, FaultConfig::default());
        save(&dry).unwrap();
        for after_effect in [false, true] {
            for i in 0..dry.ops() {
                let f = s3();
                let config =
                    FaultConfig { seed: i, fail_op: Some(i), fail_after_effect: after_effect, ..Default::default() };
                let s = FaultStorage::new(f.store.clone(), config);
                assert!(save(&s).is_err());
                check_after_fault(f.store.as_ref(), i, i);
                if !after_effect {
                    assert!(!f.store.exists("ck/commit").unwrap());
                }
            }
        }
    }

    /// A loopback HTTP server that answers the first `failures` requests with 503 SlowDown and
    /// every later one with 200; returns its port and a request counter.
    fn flaky_s3(failures: u64) -> (u16, Arc<AtomicU64>) {
        scripted_s3(move |n, _| {
            if n < failures {
                "HTTP/1.1 503 Slow Down\r\nContent-Length: 0\r\n\r\n"
            } else {
                "HTTP/1.1 200 OK\r\nETag: \"e\"\r\nContent-Length: 0\r\n\r\n"
            }
        })
    }

    /// A loopback HTTP server whose reply to the `n`th request (from 0), whose first line is
    /// `line`, is `reply(n, line)`; returns its port and a request counter.
    fn scripted_s3(reply: impl Fn(u64, &str) -> &'static str + Send + Sync + 'static) -> (u16, Arc<AtomicU64>) {
        use std::io::{BufRead, BufReader, Read, Write};
        let reply = Arc::new(reply);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(AtomicU64::new(0));
        let counter = seen.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (counter, reply) = (counter.clone(), reply.clone());
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().unwrap());
                    let mut stream = stream;
                    loop {
                        let mut len = 0usize;
                        let mut line = String::new();
                        let mut first = String::new();
                        loop {
                            line.clear();
                            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                                return;
                            }
                            if first.is_empty() {
                                first.clone_from(&line);
                            }
                            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                                len = v.trim().parse().unwrap_or(0);
                            }
                            if line == "\r\n" {
                                break;
                            }
                        }
                        let mut body = vec![0u8; len];
                        if reader.read_exact(&mut body).is_err() {
                            return;
                        }
                        let n = counter.fetch_add(1, Ordering::SeqCst);
                        if stream.write_all(reply(n, &first).as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (port, seen)
    }

    fn s3_at(port: u16, attempts_max: u32) -> S3Storage {
        let retry = RetryPolicy { attempts_max, backoff_initial_ms: 1, backoff_max_ms: 5 };
        s3_configured(port, S3Config { retry, ..Default::default() })
    }

    /// `config` with the options that point it at the loopback server on `port`.
    fn s3_configured(port: u16, config: S3Config) -> S3Storage {
        let options = [
            ("aws_endpoint", format!("http://127.0.0.1:{port}")),
            ("aws_allow_http", "true".to_string()),
            ("aws_region", "us-east-1".to_string()),
            ("aws_access_key_id", "k".to_string()),
            ("aws_secret_access_key", "s".to_string()),
        ];
        let config = S3Config { options: options.into_iter().map(|(k, v)| (k.to_string(), v)).collect(), ..config };
        S3Storage::from_url("s3://bucket/p", config).unwrap()
    }

    /// S3 answers a conditional create with 409 ConditionalRequestConflict while another
    /// conditional write of the key is in flight, meaning "try again"; `object_store` calls it
    /// AlreadyExists. It is retried while the object is not there (a commit that met one
    /// deleted its data, saying another save had committed); a 412 with the object there is
    /// AlreadyExists; a conflict that never ends is transient, not "exists".
    #[test]
    fn a_conflicting_conditional_create_is_tried_again_and_only_an_object_there_exists() {
        const CONFLICT: &str = "HTTP/1.1 409 Conflict\r\nContent-Type: application/xml\r\nContent-Length: 52\r\n\r\n\
                                <Error><Code>ConditionalRequestConflict</Code></Error>";
        const ABSENT: &str = "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";
        const PRESENT: &str = "HTTP/1.1 200 OK\r\nETag: \"e\"\r\nLast-Modified: Mon, 07 Dec 2026 00:00:00 GMT\r\n\
                               Content-Length: 0\r\n\r\n";
        const CREATED: &str = "HTTP/1.1 200 OK\r\nETag: \"e\"\r\nContent-Length: 0\r\n\r\n";
        const TAKEN: &str = "HTTP/1.1 412 Precondition Failed\r\nContent-Length: 0\r\n\r\n";
        let head = |line: &str| line.starts_with("HEAD");
        // One conflict, then the create: PUT, HEAD (nothing there), PUT.
        let (port, seen) = scripted_s3(move |n, line| {
            if head(line) {
                ABSENT
            } else if n == 0 {
                CONFLICT
            } else {
                CREATED
            }
        });
        s3_at(port, 4).put_if_absent("commit", Bytes::from_static(b"m")).unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 3);
        // Taken: AlreadyExists, after one look that finds it there.
        let (port, seen) = scripted_s3(move |_, line| if head(line) { PRESENT } else { TAKEN });
        let e = s3_at(port, 4).put_if_absent("commit", Bytes::from_static(b"m")).unwrap_err();
        assert!(matches!(e, Error::AlreadyExists { .. }), "{e}");
        assert_eq!(seen.load(Ordering::SeqCst), 2);
        // Conflicts without end: transient, after `attempts_max` creates and a look after each.
        let (port, seen) = scripted_s3(move |_, line| if head(line) { ABSENT } else { CONFLICT });
        let e = s3_at(port, 3).put_if_absent("commit", Bytes::from_static(b"m")).unwrap_err();
        assert!(e.is_transient() && e.to_string().contains("conflicting"), "{e}");
        assert_eq!(seen.load(Ordering::SeqCst), 6);
    }

    /// A writer told its size, within `put_bytes_max`, sends the object as one PUT (a multipart
    /// upload would be three requests at least), and the store reports the limit to callers.
    #[test]
    fn s3_writer_with_a_hint_within_put_bytes_max_is_one_put() {
        let (port, seen) = flaky_s3(0);
        let config = S3Config { part_bytes: 5 << 20, put_bytes_max: 16 << 20, ..Default::default() };
        let store = s3_configured(port, config);
        assert_eq!(store.hints().object_bytes_max, Some(16 << 20));
        let data = vec![7u8; 12 << 20];
        let mut w = store.writer("x", &WriterOptions { size_hint_bytes: Some(data.len() as u64) }).unwrap();
        for part in data.chunks(1 << 20) {
            w.write(part).unwrap();
        }
        assert_eq!(w.finish().unwrap(), data.len() as u64);
        assert_eq!(seen.load(Ordering::SeqCst), 1);

        let too_small = S3Config { part_bytes: 8 << 20, put_bytes_max: 5 << 20, ..Default::default() };
        let r = S3Storage::from_url("s3://b/p", too_small);
        assert!(matches!(&r, Err(Error::Config { message, .. }) if message.contains("put_bytes_max")), "{r:?}");
    }

    /// S3 throttling (503 SlowDown) is retried with backoff: within the bound the put succeeds;
    /// past it the error is transient and exactly `attempts_max` requests were made.
    #[test]
    fn s3_retries_throttling_within_the_bound() {
        let (port, seen) = flaky_s3(3);
        s3_at(port, 4).put("x", Bytes::from_static(b"abc")).unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 4);

        let (port, seen) = flaky_s3(u64::MAX);
        let r = s3_at(port, 3).put("x", Bytes::from_static(b"abc"));
        assert!(matches!(&r, Err(e) if e.is_transient()), "{r:?}");
        assert_eq!(seen.load(Ordering::SeqCst), 3);
    }

    /// Ranged reads and streamed writes keep working at every concurrency bound.
    #[test]
    fn s3_backend_ranges_and_parts_at_low_concurrency() {
        for c in [1, 2] {
            let f = s3_with(c);
            suite::ranged_reads(&f.store);
            suite::picked_reads(&f.store);
            suite::round_trips(&f.store, BIG_S3);
        }
    }

    /// A bad S3 configuration is an error, not a store.
    #[test]
    fn bad_configurations_are_errors() {
        let small_parts = S3Config { part_bytes: 1 << 20, ..Default::default() };
        assert!(matches!(S3Storage::from_url("s3://b/p", small_parts), Err(Error::Config { .. })));
    }
}

/// Without the feature an `s3://` URL is a configuration error that names it.
#[cfg(not(feature = "s3"))]
#[test]
fn s3_urls_need_the_feature() {
    let r = dckpt_storage::open("s3://bucket/prefix");
    assert!(matches!(&r, Err(Error::Config { message, .. }) if message.contains("`s3`")), "{:?}", r.map(|_| ()));
}

/// A link to a regular file is listed as that file, at its size, as `size` and `get` see it
/// (gc took a step whose data file was moved to another disk and linked back for damaged,
/// and removed it); a dangling link, or one to a directory, is no object.
#[cfg(unix)]
#[test]
fn local_links_to_files_are_listed_as_the_files() {
    let (dir, elsewhere) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let store = LocalStorage::new(dir.path()).unwrap();
    store.put("ck/a", Bytes::from_static(b"here")).unwrap();
    std::fs::write(elsewhere.path().join("moved"), b"on another disk").unwrap();
    std::os::unix::fs::symlink(elsewhere.path().join("moved"), dir.path().join("ck/b")).unwrap();
    std::os::unix::fs::symlink(elsewhere.path().join("gone"), dir.path().join("ck/dangling")).unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), dir.path().join("ck/dir")).unwrap();
    let listed: Vec<(String, u64)> = store.list("ck").unwrap().into_iter().map(|o| (o.path, o.size)).collect();
    assert_eq!(listed, [("ck/a".to_string(), 4), ("ck/b".to_string(), 15)]);
    assert_eq!(store.size("ck/b").unwrap(), 15);
}
