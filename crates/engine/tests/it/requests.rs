//! What a save and a load cost in messages and storage requests: a cached save is one small
//! vote whatever the world, and each rank's requests are few and counted by kind.

use std::sync::Arc;

use dckpt_collective::{CollectiveOptions, ThreadGroup};
use dckpt_engine::{Engine, LoadOptions, LoadRequest, SaveOptions, SaveState, TensorRequest};
use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedTensor};
use dckpt_storage::{Counting, Storage};

const ROWS: u64 = 4;
const COLS: u64 = 256;
const META: &str = "dckpt.meta";

/// Rank `rank`'s pieces of a world of `world`: its rows of a row-split weight, and a norm
/// every rank holds whole (a replica set the check compares).
fn pieces(rank: usize, world: usize) -> Vec<(ShardedTensor, Vec<u8>)> {
    let w = ShardedTensor {
        key: "w".into(),
        dtype: DType::U8,
        global_shape: [world as u64 * ROWS, COLS].into(),
        region: Region::boxed([rank as u64 * ROWS, 0], [ROWS, COLS]),
        replica_id: ReplicaId::MAIN,
    };
    let norm = ShardedTensor {
        replica_id: ReplicaId { dp: rank as u32, ..ReplicaId::MAIN },
        ..ShardedTensor::whole("norm", DType::U8, [64])
    };
    let rows: Vec<u8> = (0..ROWS * COLS).map(|i| (i as u8) ^ (rank as u8)).collect();
    vec![(w, rows), (norm, (0..64).collect())]
}

fn state(pieces: &[(ShardedTensor, Vec<u8>)]) -> SaveState<'_> {
    let mut s = SaveState::new();
    for (t, d) in pieces {
        s.push_tensor(t.clone(), d);
    }
    s
}

/// The bytes each rank received during the second of two saves of the same structure.
fn second_save_traffic(world: usize) -> Vec<u64> {
    let store: Arc<dyn Storage> = dckpt_storage::open("memory://").expect("memory storage");
    let opts = SaveOptions::default().replace(true);
    ThreadGroup::run(world, &CollectiveOptions::default(), |r, c| {
        let c = Arc::new(c);
        let engine = Engine::new(c.clone());
        let p = pieces(r, world);
        let first = engine.save(store.as_ref(), &state(&p), &opts).expect("first save");
        assert!(!first.plan_reused);
        let before = c.bytes_received();
        let second = engine.save(store.as_ref(), &state(&p), &opts).expect("second save");
        assert!(second.plan_reused, "rank {r}: the plan was not reused");
        c.bytes_received() - before
    })
    .expect("threads")
}

/// A cached save costs every rank but the coordinator a fixed-size vote and its answers:
/// what such a rank receives in the second save of a structure is the same at 8 ranks and
/// at 64 (the coordinator's share of the replica check grows with the world: one CRC per
/// copy held). A decision that held one entry per rank, broadcast, would grow here.
#[test]
fn a_cached_save_is_one_small_vote_whatever_the_world() {
    let (small, large) = (second_save_traffic(8), second_save_traffic(64));
    let most = |v: &[u64]| v[1..].iter().copied().max().unwrap();
    eprintln!(
        "second save, bytes received: coordinator {} and {}, any other rank at most {} and {} (8, 64 ranks)",
        small[0],
        large[0],
        most(&small),
        most(&large)
    );
    // A few bytes of slack: the outcome's counts (bytes, files) are longer numbers at 64.
    assert!(
        most(&large) <= most(&small) + 16,
        "non-coordinator bytes: {} at 8 ranks, {} at 64",
        most(&small),
        most(&large)
    );
    assert!(most(&small) < 1024, "a cached save cost a rank {} bytes", most(&small));
    assert!(large[0] > small[0], "the coordinator receives every rank's checksums");
}

/// Each rank's requests of a save and a load of 4 ranks, counted by kind on its own
/// [`Counting`] over one store, data files apart from the metadata: a save writes one data
/// file per rank and nothing else but the coordinator's check of the target and its commit;
/// a load asks for no size of a data file, reads each file it needs in one call, and no rank
/// but the coordinator lists anything. With the fan-out, the file every rank reads from
/// (the norm's) is read by one of them: fewer requests in all, none more than two.
#[test]
fn a_save_and_a_load_make_few_requests_of_each_kind() {
    let world = 4;
    let store: Arc<dyn Storage> = dckpt_storage::open("memory://").expect("memory storage");
    let counts = ThreadGroup::run(world, &CollectiveOptions::default(), |r, c| {
        let engine = Engine::new(Arc::new(c));
        // Two counters in a row: the inner one sees the metadata's calls, the outer the data's.
        let meta = Arc::new(Counting::only(store.clone(), |p| p == META));
        let data = Counting::only(meta.clone(), |p| p != META);
        let both = || (data.counts(), meta.counts());
        let p = pieces(r, world);
        engine.save(&data, &state(&p), &SaveOptions::default()).expect("save");
        let saved = both();
        let mut bufs: Vec<Vec<u8>> = p.iter().map(|(_, d)| vec![0; d.len()]).collect();
        let mut req = LoadRequest::default();
        for ((t, _), b) in p.iter().zip(bufs.iter_mut()) {
            req.tensors.push(TensorRequest {
                tensor: t.clone(),
                data: b,
                allow_shape_mismatch: false,
                allow_dtype_cast: false,
            });
        }
        let alone = LoadOptions { fan_out: false, ..LoadOptions::default() };
        engine.load(&data, &mut req, &alone).expect("load");
        let loaded = both();
        bufs.iter_mut().for_each(|b| b.fill(0));
        let mut req = LoadRequest::default();
        for ((t, _), b) in p.iter().zip(bufs.iter_mut()) {
            req.tensors.push(TensorRequest {
                tensor: t.clone(),
                data: b,
                allow_shape_mismatch: false,
                allow_dtype_cast: false,
            });
        }
        engine.load(&data, &mut req, &LoadOptions::default()).expect("load, fanned out");
        let fanned = data.counts().since(&loaded.0);
        assert_eq!(bufs[0], p[0].1, "rank {r}: loaded other bytes");
        (saved, loaded, fanned)
    })
    .expect("threads");
    let (mut alone, mut fanned) = ((0, 0), (0, 0));
    for (r, (_, (data, _), f)) in counts.iter().enumerate() {
        let ctx = format!("rank {r}: fanned out {f:?}");
        assert_eq!((f.sizes, f.lists, f.gets), (0, 0, 0), "{ctx}");
        assert!(f.requests() <= 2, "{ctx}");
        let load = data.since(&counts[r].0.0);
        alone = (alone.0 + load.requests(), alone.1 + load.bytes_read);
        fanned = (fanned.0 + f.requests(), fanned.1 + f.bytes_read);
    }
    assert!(fanned.0 < alone.0 && fanned.1 < alone.1, "requests and bytes: {fanned:?} fanned out, {alone:?} not");
    for (r, ((saved_data, saved_meta), (data, meta), _)) in counts.iter().enumerate() {
        let ctx = format!("rank {r}: saved {saved_data:?} {saved_meta:?}, then {data:?} {meta:?}");
        // One data file per rank, whether a PUT or a multipart upload; only the coordinator
        // touches the metadata during a save (whether it exists, then its commit), looks at
        // three other ranks' files before it commits (the ranks save to one store), and
        // removes what dead writers left (on S3 no request: a lifecycle rule's job).
        let coordinator = r == 0;
        assert_eq!(saved_data.writes(), 1, "{ctx}");
        assert_eq!(
            (saved_data.abandoned, saved_data.sizes, saved_data.requests()),
            (u64::from(coordinator), 3 * u64::from(coordinator), 1 + 4 * u64::from(coordinator)),
            "{ctx}"
        );
        assert_eq!(saved_meta.requests(), if coordinator { 2 } else { 0 }, "{ctx}");
        assert_eq!(saved_meta.creates, u64::from(coordinator), "{ctx}");
        let load = data.since(saved_data);
        // This rank's own file (its rows) and the coordinator's (the norm's main copy): one
        // ranged read each, no size asked.
        let files = if coordinator { 1 } else { 2 };
        assert_eq!((load.sizes, load.lists, load.gets), (0, 0, 0), "{ctx}");
        assert_eq!(load.ranged_reads, files, "{ctx}");
        assert_eq!(load.requests(), files, "{ctx}");
        assert_eq!(meta.lists + data.lists, 0, "{ctx}");
    }
}

/// A replace given the save id of the checkpoint it replaces is refused on every rank and
/// touches nothing: its data files would take the old ones' names and be written over them
/// before the commit, and a failure or a crash then left the old metadata naming other
/// bytes, or none.
#[test]
fn a_replace_with_the_replaced_save_s_own_id_is_refused() {
    let store: Arc<dyn Storage> = dckpt_storage::open("memory://").expect("memory storage");
    let id = "00000000000000aa";
    let outcomes = ThreadGroup::run(2, &CollectiveOptions::default(), |r, c| {
        let engine = Engine::new(Arc::new(c));
        let p = pieces(r, 2);
        engine.save(store.as_ref(), &state(&p), &SaveOptions::default().save_id(id)).expect("first save");
        let before = store.list("").expect("list");
        let again = engine.save(store.as_ref(), &state(&p), &SaveOptions::default().save_id(id).replace(true));
        (again.map(|_| ()).map_err(|e| e.to_string()), before)
    })
    .expect("threads");
    for (r, (again, before)) in outcomes.into_iter().enumerate() {
        let e = again.expect_err("refused");
        assert!(e.contains(&format!("save id {id}")) && e.contains("give another"), "rank {r}: {e}");
        let now = store.list("").expect("list");
        assert_eq!(now.len(), before.len(), "rank {r}: nothing written or removed");
    }
}

/// A panic in one rank's read of a data file (a bug, or a host's storage wrapper that
/// panics) fails the load on every rank, naming that rank: it unwound out of that rank's
/// load, and the other waited for its outcome until the collective's timeout.
#[test]
fn a_panic_in_one_ranks_read_fails_the_load_on_every_rank() {
    use crate::local::{Fault, Faulty};
    let world = 2;
    let store: Arc<dyn Storage> = dckpt_storage::open("memory://").expect("memory storage");
    let opts = CollectiveOptions { timeout: std::time::Duration::from_secs(20), ..CollectiveOptions::default() };
    ThreadGroup::run(world, &opts, |r, c| {
        let p = pieces(r, world);
        Engine::new(Arc::new(c)).save(store.as_ref(), &state(&p), &SaveOptions::default()).expect("save");
    })
    .expect("world");
    let names: Vec<String> = store.list("").expect("list").into_iter().map(|o| o.path).filter(|p| p != META).collect();
    for (i, name) in names.iter().enumerate() {
        let name: &'static str = Box::leak(name.clone().into_boxed_str());
        let results = ThreadGroup::run(world, &opts, |r, c| {
            let faulty: Arc<dyn Storage> = Arc::new(Faulty { inner: store.clone(), fault: Fault::PanicReader(name) });
            let at = if r == 1 { faulty } else { store.clone() };
            // Every rank reads every file: the whole weight, and the norm.
            let w = ShardedTensor::whole("w", DType::U8, [world as u64 * ROWS, COLS]);
            let (mut wd, mut nd) = (vec![0u8; w.nbytes() as usize], vec![0u8; 64]);
            let mut req = LoadRequest::new();
            req.push_tensor(w, &mut wd);
            req.push_tensor(ShardedTensor::whole("norm", DType::U8, [64]), &mut nd);
            Engine::new(Arc::new(c)).load(at.as_ref(), &mut req, &LoadOptions::default()).map(drop)
        })
        .expect("no rank unwinds");
        for (r, res) in results.into_iter().enumerate() {
            let e = res.expect_err("every rank fails");
            assert_eq!(e.rank(), Some(1), "file {i}, rank {r}: {e}");
            assert!(e.to_string().contains("panicked"), "file {i}, rank {r}: {e}");
        }
    }
}
