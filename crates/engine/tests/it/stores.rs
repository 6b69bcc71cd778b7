//! Ranks that disagree where every rank must agree, each refused on every rank, naming what
//! differs: stores the ranks do not share (each rank's files where only it can see them, one
//! path on each node's own disk: the save committed metadata naming files no reader finds,
//! and reported success), key policies (only the coordinator's were applied), and the call
//! itself (one rank saving while another loads waited until the collective's timeout).

use std::sync::Arc;

use dckpt_collective::{CollectiveOptions, ThreadGroup};
use dckpt_engine::{Engine, SaveOptions, SaveState};
use dckpt_shard_spec::{DType, ShardedTensor};
use dckpt_storage::{MemoryStorage, Storage};

#[test]
fn a_save_to_stores_the_ranks_do_not_share_fails_on_every_rank_naming_one() {
    for world in [2, 3, 8] {
        let stores: Vec<Arc<dyn Storage>> = (0..world).map(|_| Arc::new(MemoryStorage::new()) as _).collect();
        let results = ThreadGroup::run(world, &CollectiveOptions::default(), |r, c| {
            let data = vec![r as u8; 64];
            let t = ShardedTensor::chunk("w", DType::U8, [64 * world as u64], [64 * r as u64], [64]);
            let state = SaveState::new().tensor(t, &data);
            Engine::new(Arc::new(c)).save(stores[r].as_ref(), &state, &SaveOptions::default()).map(drop)
        })
        .expect("threads");
        for (r, got) in results.into_iter().enumerate() {
            let e = got.expect_err("a save no reader can load");
            assert_eq!(e.rank(), Some(world as u32 - 1), "{world} ranks, rank {r}: {e}");
            assert!(e.to_string().contains("do not save to one store"), "{world} ranks, rank {r}: {e}");
        }
        // Nothing committed, and the coordinator's own file gone with the save.
        assert!(stores[0].list("").unwrap().is_empty(), "{world} ranks: {:?}", stores[0].list(""));
    }
}

/// A rank that passes other key policies than the coordinator's: only the coordinator's were
/// applied, so a rank that asked for a missing key to fail the load got its buffer left as
/// it was, and success. Refused on every rank, naming it.
#[test]
fn a_load_whose_ranks_pass_other_key_policies_fails_on_every_rank_naming_one() {
    use dckpt_engine::{KeyPolicy, LoadOptions, LoadRequest, Strictness};
    let store: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    let w = ShardedTensor::whole("w", DType::U8, [8]);
    ThreadGroup::run(1, &CollectiveOptions::default(), |_, c| {
        let state = SaveState::new().tensor(w.clone(), &[7; 8]);
        Engine::new(Arc::new(c)).save(store.as_ref(), &state, &SaveOptions::default()).map(drop)
    })
    .expect("threads")
    .into_iter()
    .for_each(|r| r.expect("save"));
    let results = ThreadGroup::run(3, &CollectiveOptions::default(), |r, c| {
        let (mut got, mut extra) = ([0u8; 8], [9u8; 4]);
        let mut req = LoadRequest::new().tensor(w.clone(), &mut got);
        let mut opts = LoadOptions::default();
        if r == 2 {
            // Asks for a key nobody stored, and for it to fail the load.
            req = req.tensor(ShardedTensor::whole("extra", DType::U8, [4]), &mut extra);
        } else {
            opts.strictness = Strictness { missing: KeyPolicy::Return, ..Strictness::default() };
        }
        Engine::new(Arc::new(c)).load(store.as_ref(), &mut req, &opts).map(drop)
    })
    .expect("threads");
    for (r, got) in results.into_iter().enumerate() {
        let e = got.expect_err("the ranks disagree on what a missing key does");
        assert!(e.to_string().contains("rank 2 loads with other key policies"), "rank {r}: {e}");
    }
}

/// One rank saves while the others load: both calls begin with the same kind of round, which
/// carries the call, so every rank fails at once, naming both, rather than waiting in
/// different collectives until the timeout.
#[test]
fn ranks_that_make_different_calls_fail_at_once_naming_both() {
    use dckpt_engine::{LoadOptions, LoadRequest};
    use std::time::{Duration, Instant};
    let store: Arc<dyn Storage> = Arc::new(MemoryStorage::new());
    let w = ShardedTensor::whole("w", DType::U8, [8]);
    let slow = CollectiveOptions { timeout: Duration::from_secs(120), ..CollectiveOptions::default() };
    let started = Instant::now();
    let results = ThreadGroup::run(3, &slow, |r, c| {
        let engine = Engine::new(Arc::new(c));
        let mut got = [0u8; 8];
        match r {
            1 => engine
                .save(store.as_ref(), &SaveState::new().tensor(w.clone(), &[7; 8]), &SaveOptions::default())
                .map(drop),
            _ => engine
                .load(store.as_ref(), &mut LoadRequest::new().tensor(w.clone(), &mut got), &LoadOptions::default())
                .map(drop),
        }
    })
    .expect("threads");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    for (r, got) in results.into_iter().enumerate() {
        let e = got.expect_err("a save and a load at once");
        assert!(e.to_string().contains("the ranks make different calls: some save, some load"), "rank {r}: {e}");
    }
}
