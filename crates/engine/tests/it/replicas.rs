//! The replica check: pieces described as copies of one region must hold the same bytes.
//!
//! The state is the ETP bug's form (a): 4 ranks, 2 expert-parallel groups of 2
//! expert-tensor-parallel ranks; each expert's fc1 weight is split by rows across its ETP
//! ranks, but described as replicas of one tensor of 1/ETP the size (same key, global shape
//! and offset on both ETP ranks, replica ids 0 and 1). Every shape check passes; only the
//! bytes differ.

use std::sync::Arc;

use dckpt_collective::{CollectiveOptions, ThreadGroup};
use dckpt_engine::{
    Engine, Error, ErrorKind, LoadOptions, LoadRequest, ObjectCompare, ObjectData, ObjectRequest, ReplicaCheck,
    SAMPLE_WINDOW_BYTES, SaveOptions, SaveOutcome, SaveState, TensorRequest,
};
use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedObject, ShardedTensor};
use dckpt_storage::Storage;

const WORLD: usize = 4;
const ETP: u32 = 2;
const KEY: &str = "decoder.experts.fc1";
/// Rows and columns of one ETP shard of an expert's weight.
const ROWS: u64 = 64;
const COLS: u64 = 128;

fn run<T: Send>(f: impl Fn(usize, Engine) -> T + Sync) -> Vec<T> {
    ThreadGroup::run(WORLD, &CollectiveOptions::default(), |r, c| f(r, Engine::new(Arc::new(c)))).expect("threads")
}

fn memory() -> Arc<dyn Storage> {
    dckpt_storage::open("memory://").expect("memory storage")
}

/// What `rank` holds of the expert weights, described as in form (a): `experts` expert
/// weights of global shape [experts * 2, ROWS, COLS] (the true one has 2 * ROWS rows), the
/// rank's expert group owning every other expert. Its bytes: ETP shard `etp_rank` of the
/// true weight, or shard 0 on every ETP rank when `identical`.
fn form_a(rank: usize, experts: u64, rows: u64, identical: bool) -> Vec<(ShardedTensor, Vec<u8>)> {
    let (ep_rank, etp_rank) = (rank as u32 / ETP, rank as u32 % ETP);
    let global = [experts * 2, rows, COLS];
    (0..experts)
        .map(|i| {
            let e = i * 2 + u64::from(ep_rank);
            let t = ShardedTensor {
                key: KEY.into(),
                dtype: DType::U8,
                global_shape: global.into(),
                region: Region::boxed([e, 0, 0], [1, rows, COLS]),
                replica_id: ReplicaId { tp: etp_rank, ..ReplicaId::MAIN },
            };
            let shard = if identical { 0 } else { etp_rank };
            (t, bytes(e, shard, rows * COLS))
        })
        .collect()
}

/// The bytes of ETP shard `shard` of expert `e`'s weight.
fn bytes(e: u64, shard: u32, len: u64) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7) ^ (e as u8) ^ (shard as u8).wrapping_mul(0x55)).collect()
}

/// A dense weight held whole by every rank with the same bytes: a set that always passes.
fn dense(rank: usize) -> (ShardedTensor, Vec<u8>) {
    let t = ShardedTensor {
        replica_id: ReplicaId { dp: rank as u32, ..ReplicaId::MAIN },
        ..ShardedTensor::whole("decoder.norm", DType::U8, [32])
    };
    (t, (0..32).collect())
}

fn state(pieces: &[(ShardedTensor, Vec<u8>)]) -> SaveState<'_> {
    let mut s = SaveState::new();
    for (t, d) in pieces {
        s.push_tensor(t.clone(), d);
    }
    s
}

fn pieces(rank: usize, experts: u64, identical: bool) -> Vec<(ShardedTensor, Vec<u8>)> {
    let mut p = form_a(rank, experts, ROWS, identical);
    p.push(dense(rank));
    p
}

/// Nothing at all is stored: no data file, no metadata.
fn assert_nothing_written(store: &Arc<dyn Storage>) {
    let listed = store.list("").expect("list");
    assert!(listed.is_empty(), "a refused save wrote {listed:?}");
}

/// Every rank failed with `ReplicasDiffer` about the first expert (main copy on rank 0,
/// differing on rank 1), counting `more` other regions; returns rank 0's message.
fn assert_refused(results: &[dckpt_engine::Result<SaveOutcome>], more: u64) -> String {
    for (r, res) in results.iter().enumerate() {
        let rank = res.as_ref().err().and_then(Error::rank);
        match res.as_ref().map_err(Error::kind) {
            Err(ErrorKind::ReplicasDiffer { key, region, main_rank, ranks, crcs, more: m, .. }) => {
                assert_eq!(key, KEY, "rank {r}");
                assert_eq!(**region, Region::boxed([0, 0, 0], [1, ROWS, COLS]), "rank {r}");
                assert_eq!((*main_rank, ranks.as_slice(), crcs.len()), (0, &[1u32][..], 1), "rank {r}");
                assert_eq!(*m, more, "rank {r}");
                assert_eq!(rank, Some(0), "rank {r}: the coordinator found it");
            }
            other => panic!("rank {r}: expected ReplicasDiffer, got {other:?}"),
        }
    }
    results[0].as_ref().unwrap_err().to_string()
}

#[test]
fn form_a_of_the_etp_bug_is_refused_on_every_rank_before_anything_is_written() {
    let store = memory();
    let results = run(|r, engine| {
        let p = pieces(r, 1, false);
        engine.save(store.as_ref(), &state(&p), &SaveOptions::default())
    });
    // Expert 0's replica on rank 1 differs, and so does expert 1's on rank 3.
    let msg = assert_refused(&results, 1);
    for part in [
        "tensor \"decoder.experts.fc1\" region [0:1, 0:64, 0:128]",
        "main copy on rank 0",
        "rank 1 (crc 0x",
        "is this tensor split across ranks but described as replicas?",
        "1 more replicated pieces differ too",
    ] {
        assert!(msg.contains(part), "{part:?} not in {msg:?}");
    }
    assert_nothing_written(&store);
}

/// The default compares a window of every chunk outside its sample: shards that differ
/// throughout are caught however large their chunks, at every save.
#[test]
fn the_default_refuses_form_a_in_chunks_larger_than_its_window() {
    const ROWS_BIG: u64 = 1024;
    const { assert!(ROWS_BIG * COLS > 4 * SAMPLE_WINDOW_BYTES) };
    for id in ["0000000000000001", "0000000000000002", "0000000000000003"] {
        let store = memory();
        let results = run(|r, engine| {
            let p = form_a(r, 4, ROWS_BIG, false);
            engine.save(store.as_ref(), &state(&p), &SaveOptions::default().save_id(id))
        });
        for (r, res) in results.into_iter().enumerate() {
            match res.map_err(Error::into_kind) {
                // The 8 experts' copies all differ: the first is named, the others counted.
                Err(ErrorKind::ReplicasDiffer { key, main_rank: 0, ranks, more: 7, .. }) => {
                    assert_eq!((key.as_str(), ranks), (KEY, vec![1]), "rank {r}, save {id}");
                }
                other => panic!("rank {r}, save {id}: expected ReplicasDiffer, got {other:?}"),
            }
        }
        assert_nothing_written(&store);
    }
}

#[test]
fn identical_replicas_save_and_load() {
    let store = memory();
    let saved = run(|r, engine| {
        let p = pieces(r, 3, true);
        engine.save(store.as_ref(), &state(&p), &SaveOptions::default())
    });
    for (r, o) in saved.into_iter().enumerate() {
        let o = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        // 6 experts (3 per expert group), each held by 2 ranks, and the dense weight.
        assert_eq!(o.replicas_checked, 7, "rank {r}");
    }
    // Every rank reads back what its ETP rank 0 holds.
    let loaded = run(|r, engine| {
        let want = pieces(r, 3, true);
        let mut bufs: Vec<Vec<u8>> = want.iter().map(|(_, d)| vec![0; d.len()]).collect();
        let mut req = LoadRequest::default();
        for ((t, _), b) in want.iter().zip(bufs.iter_mut()) {
            req.tensors.push(TensorRequest {
                tensor: t.clone(),
                data: b,
                allow_shape_mismatch: false,
                allow_dtype_cast: false,
            });
        }
        engine.load(store.as_ref(), &mut req, &LoadOptions::default()).map(|_| ())?;
        drop(req);
        Ok::<bool, Error>(want.iter().zip(&bufs).all(|((_, d), b)| d == b))
    });
    for (r, same) in loaded.into_iter().enumerate() {
        assert!(same.unwrap_or_else(|e| panic!("rank {r}: {e}")), "rank {r} loaded other bytes");
    }
}

/// The cached plan's save exchanges only the checksums: replicas that differ at the second
/// save of the same structure are refused there too, and the plan stays cached.
#[test]
fn a_save_that_reuses_the_plan_checks_the_replicas_too() {
    let stores: Vec<Arc<dyn Storage>> = (0..3).map(|_| memory()).collect();
    let results = run(|r, engine| {
        [true, false, true]
            .into_iter()
            .zip(&stores)
            .map(|(identical, store)| {
                let p = pieces(r, 1, identical);
                engine.save(store.as_ref(), &state(&p), &SaveOptions::default())
            })
            .collect::<Vec<_>>()
    });
    let mut column: [Vec<_>; 3] = Default::default();
    for per_rank in results {
        for (i, o) in per_rank.into_iter().enumerate() {
            column[i].push(o);
        }
    }
    let [planned, refused, reused] = column;
    for (r, o) in planned.into_iter().enumerate() {
        assert!(!o.unwrap_or_else(|e| panic!("rank {r}: {e}")).plan_reused);
    }
    assert_refused(&refused, 1);
    assert_nothing_written(&stores[1]);
    for (r, o) in reused.into_iter().enumerate() {
        let o = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(o.plan_reused, "rank {r}: the refused save dropped the cached plan");
        assert_eq!(o.replicas_checked, 3, "rank {r}");
    }
}

/// `Off` trusts the description, as a caller that proved its replicas identical may want:
/// form (a) then saves, and only ETP rank 0's shard of each expert is stored.
#[test]
fn with_the_check_off_form_a_goes_through_and_loses_shards() {
    let store = memory();
    let opts = SaveOptions::default().replica_check(ReplicaCheck::Off);
    let results = run(|r, engine| {
        let p = pieces(r, 1, false);
        engine.save(store.as_ref(), &state(&p), &opts)
    });
    for (r, o) in results.into_iter().enumerate() {
        let o = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(o.replicas_checked, 0);
        // Two expert shards of ROWS x COLS bytes and the dense weight: half the expert bytes.
        assert_eq!(o.bytes, 2 * ROWS * COLS + 32, "rank {r}");
    }
}

/// A sample compares exactly the bytes [`ReplicaCheck::compared`] names: a chunk in the
/// sample on all its bytes, every other one on its window.
#[test]
fn a_sample_compares_the_bytes_it_says_it_compares() {
    const EXPERTS: u64 = 12;
    const ROWS_BIG: u64 = 512;
    let len = ROWS_BIG * COLS;
    assert!(len > 2 * SAMPLE_WINDOW_BYTES);
    let mode = ReplicaCheck::Sample { fraction: 0.5 };
    let id = "00000000000000a1";
    let opts = SaveOptions::default().replica_check(mode).save_id(id);
    let region = |e: u64| Region::boxed([e, 0, 0], [1, ROWS_BIG, COLS]);
    let compared = |e: u64| mode.compared(id, KEY, &region(e), len).expect("a sample compares every chunk");
    let whole: Vec<u64> = (0..EXPERTS * 2).filter(|&e| compared(e) == (0..len)).collect();
    assert!(whole.len() > 2 && whole.len() < 22, "a fraction of 0.5 sampled {} of 24", whole.len());
    let windowed = (0..EXPERTS * 2).find(|e| !whole.contains(e)).expect("an expert outside the sample");
    let w = compared(windowed);
    assert_eq!(w.end - w.start, SAMPLE_WINDOW_BYTES);
    let outside_window = if w.start > 0 { 0 } else { len - 1 };

    // Only byte `at` of expert `bad`'s copy on its second ETP rank differs.
    let save_with = |bad: u64, at: u64| {
        let store = memory();
        let results = run(|r, engine| {
            let mut p = form_a(r, EXPERTS, ROWS_BIG, true);
            for (t, d) in &mut p {
                if t.region == region(bad) && t.replica_id.tp == 1 {
                    d[at as usize] ^= 1;
                }
            }
            engine.save(store.as_ref(), &state(&p), &opts)
        });
        (store, results)
    };
    let refused = |bad: u64, at: u64| {
        let (store, results) = save_with(bad, at);
        let bad_rank = (bad % 2) as u32 * ETP + 1;
        for (r, res) in results.into_iter().enumerate() {
            match res.map_err(Error::into_kind) {
                Err(ErrorKind::ReplicasDiffer { region: reg, ranks, more: 0, .. }) => {
                    assert_eq!((*reg, ranks), (region(bad), vec![bad_rank]), "rank {r}, expert {bad}, byte {at}");
                }
                other => panic!("rank {r}, expert {bad}, byte {at}: expected ReplicasDiffer, got {other:?}"),
            }
        }
        assert_nothing_written(&store);
    };
    // Outside the window of a chunk outside the sample: not compared, so it goes through.
    let (_, passed) = save_with(windowed, outside_window);
    for (r, o) in passed.into_iter().enumerate() {
        let o = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(o.replicas_checked, whole.len() as u64, "rank {r}");
    }
    // Inside its window, or anywhere in a chunk of the sample: refused.
    refused(windowed, w.start + SAMPLE_WINDOW_BYTES / 2);
    refused(whole[0], outside_window);
    refused(whole[0], len / 2);
}

/// A background save compares its own copy of the state: the caller scribbling on its
/// buffers after `save_async` returned changes nothing, and differing replicas are reported
/// by `wait` on every rank.
#[test]
fn a_background_save_checks_the_copy_it_took() {
    let (good, bad) = (memory(), memory());
    let results = run(|r, engine| {
        let mut p = pieces(r, 1, true);
        let h = engine.save_async(good.clone(), &state(&p), &SaveOptions::default()).expect("started");
        // Rank 1's copies now differ, but the save took its copy before.
        if r == 1 {
            for (_, d) in &mut p {
                d.fill(0xAB);
            }
        }
        let first = h.wait();
        let p = pieces(r, 1, false);
        let second = engine.save_async(bad.clone(), &state(&p), &SaveOptions::default()).expect("started").wait();
        (first, second)
    });
    let (first, second): (Vec<_>, Vec<_>) = results.into_iter().unzip();
    for (r, o) in first.into_iter().enumerate() {
        o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
    assert_refused(&second, 1);
    assert_nothing_written(&bad);
}

/// Options no save can honour are refused on every rank before anything is written: a
/// sample fraction outside 0 to 1, and a checksum block or a layout no reader accepts
/// (such a save committed a checkpoint that no load would open).
#[test]
fn a_sample_fraction_outside_0_to_1_is_refused_on_every_rank() {
    let fraction = SaveOptions::default().replica_check(ReplicaCheck::Sample { fraction: 1.5 });
    let block = |block_bytes| SaveOptions { block_bytes, ..SaveOptions::default() };
    let layout = (0..=(1u32 << 17)).map(|i| (format!("k{i}"), String::new())).collect();
    let layout = SaveOptions { layout, ..SaveOptions::default() };
    let cases = [
        (fraction, "fraction 1.5"),
        (block(0), "block_bytes 0"),
        (block((1 << 30) + 1), "block_bytes 1073741825"),
        (layout, "131073 layout entries"),
    ];
    for (opts, says) in cases {
        let store = memory();
        let results = run(|r, engine| {
            let p = pieces(r, 1, true);
            engine.save(store.as_ref(), &state(&p), &opts)
        });
        for (r, res) in results.into_iter().enumerate() {
            assert!(
                matches!(res.as_ref().map_err(Error::kind), Err(ErrorKind::InvalidOptions { detail }) if detail.contains(says)),
                "rank {r}: {res:?}"
            );
        }
        assert_nothing_written(&store);
    }
}

/// A checksum block so small for the save's bytes that its checksums alone overflow what a
/// reader takes of a metadata file is refused on every rank before anything is written:
/// the commit refused it after every byte was written (and for a piece of 1 GiB at one
/// byte a block, the encoder panicked on the coordinator).
#[test]
fn checksums_no_reader_takes_are_refused_before_the_writes() {
    const SHARD: u64 = 96 << 20;
    let store = memory();
    let results = run(|r, engine| {
        // Zeroed and never touched: the plan does not read the bytes.
        let data = vec![0u8; SHARD as usize];
        let t = ShardedTensor {
            key: "embedding".into(),
            dtype: DType::U8,
            global_shape: [WORLD as u64 * SHARD].into(),
            region: Region::boxed([r as u64 * SHARD], [SHARD]),
            replica_id: ReplicaId::MAIN,
        };
        let mut s = SaveState::new();
        s.push_tensor(t, &data);
        engine.save(store.as_ref(), &s, &SaveOptions { block_bytes: 1, ..SaveOptions::default() })
    });
    for (r, res) in results.into_iter().enumerate() {
        assert!(
            matches!(res.as_ref().map_err(Error::kind), Err(ErrorKind::InvalidOptions { detail })
                if detail.contains("block_bytes 1: the checksums of 402653184 bytes would take 1610612736 bytes")),
            "rank {r}: {res:?}"
        );
    }
    assert_nothing_written(&store);
}

/// What a rank holds of the object "iteration", which every rank holds (rank 0 the main
/// copy), and how its copy is compared.
type Held = (&'static [u8], ObjectCompare);

/// Saves the identical experts and the object as `hold` says on each rank; every rank's
/// outcome, and the store.
fn save_object(
    hold: impl Fn(usize) -> Held + Sync,
    check: ReplicaCheck,
) -> (Vec<dckpt_engine::Result<SaveOutcome>>, Arc<dyn Storage>) {
    let store = memory();
    let results = run(|r, engine| {
        let p = pieces(r, 1, true);
        let mut s = state(&p);
        let (data, compare) = hold(r);
        let object = ShardedObject::single("iteration").replica(ReplicaId { dp: r as u32, ..ReplicaId::MAIN });
        s.objects.push(ObjectData { object, data, compare });
        engine.save(store.as_ref(), &s, &SaveOptions { replica_check: check, ..SaveOptions::default() })
    });
    (results, store)
}

/// Only one copy of an object is written, so copies that hold another value are
/// refused on every rank, naming the object and the ranks, before anything is written:
/// compared by their bytes (the default), by a digest the caller computed of a canonical
/// form, or not at all, as each holder says.
#[test]
fn copies_of_an_object_must_hold_its_value() {
    const A: &[u8] = br#"{"a":1,"b":2}"#;
    const B: &[u8] = br#"{"b":2,"a":1}"#;
    let refused = |results: &[dckpt_engine::Result<SaveOutcome>], store: &Arc<dyn Storage>, differ: &[u32]| {
        for (r, res) in results.iter().enumerate() {
            match res.as_ref().map_err(Error::kind) {
                Err(ErrorKind::ObjectsDiffer { key, grid_offset, main_rank: 0, ranks, more: 0 }) => {
                    assert_eq!(
                        (key.as_str(), grid_offset.as_slice(), ranks.as_slice()),
                        ("iteration", &[][..], differ)
                    );
                }
                other => panic!("rank {r}: expected ObjectsDiffer, got {other:?}"),
            }
        }
        assert_nothing_written(store);
        results[0].as_ref().unwrap_err().to_string()
    };
    let bytes = ObjectCompare::Bytes;

    // By their bytes: rank 2 holds another value.
    let (results, store) = save_object(|r| (if r == 2 { B } else { A }, bytes), ReplicaCheck::default());
    let msg = refused(&results, &store, &[2]);
    for part in ["object \"iteration\": rank 2 holds", "main copy's on rank 0, and only one copy is saved"] {
        assert!(msg.contains(part), "{part:?} not in {msg:?}");
    }
    // A copy compared and one not: the main copy's value has no canonical form, rank 3's has.
    let (results, store) =
        save_object(|r| (A, if r == 3 { bytes } else { ObjectCompare::Not }), ReplicaCheck::default());
    refused(&results, &store, &[3]);
    // The same digest on every rank, though the bytes differ: one value.
    let (results, store) =
        save_object(|r| (if r % 2 == 0 { A } else { B }, ObjectCompare::Digest(7)), ReplicaCheck::All);
    for (r, o) in results.iter().enumerate() {
        // Two experts and the dense weight, then the object.
        assert_eq!(o.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}")).replicas_checked, 4, "rank {r}");
    }
    let loaded = run(|_, engine| {
        let mut req = LoadRequest::default();
        req.objects.push(ObjectRequest { object: ShardedObject::single("iteration"), data: None });
        let strictness = dckpt_engine::Strictness { unexpected: dckpt_engine::KeyPolicy::Ignore, ..Default::default() };
        let opts = LoadOptions { strictness, ..LoadOptions::default() };
        engine.load(store.as_ref(), &mut req, &opts).map(|_| req.objects[0].data.clone())
    });
    for (r, data) in loaded.into_iter().enumerate() {
        // The main copy's bytes: the same value by the digest.
        let data = data.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(data.as_deref(), Some(A), "rank {r}");
    }
    // Different digests differ whatever the bytes.
    let (results, store) =
        save_object(|r| (A, ObjectCompare::Digest(if r == 1 { 8 } else { 7 })), ReplicaCheck::default());
    refused(&results, &store, &[1]);
    // Not compared where no holder compares, nor with the check off: the main copy is saved,
    // though the others hold shorter values (rank 0 carries the most bytes, so a balanced
    // plan once had another copy write it, at the main copy's length: no reader opened it).
    const SHORT: &[u8] = br#"{"a":1}"#;
    for (compare, check, checked) in [(ObjectCompare::Not, ReplicaCheck::All, 3), (bytes, ReplicaCheck::Off, 0)] {
        let (results, store) = save_object(|r| (if r == 0 { A } else { SHORT }, compare), check);
        for (r, o) in results.iter().enumerate() {
            assert_eq!(o.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}")).replicas_checked, checked, "rank {r}");
        }
        for (r, data) in load_object(&store).into_iter().enumerate() {
            assert_eq!(data.unwrap_or_else(|e| panic!("rank {r}: {e}")).as_deref(), Some(A), "rank {r}");
        }
    }
}

/// Every rank's load of the object "iteration".
fn load_object(store: &Arc<dyn Storage>) -> Vec<dckpt_engine::Result<Option<Vec<u8>>>> {
    run(|_, engine| {
        let mut req = LoadRequest::default();
        req.objects.push(ObjectRequest { object: ShardedObject::single("iteration"), data: None });
        let strictness = dckpt_engine::Strictness { unexpected: dckpt_engine::KeyPolicy::Ignore, ..Default::default() };
        let opts = LoadOptions { strictness, ..LoadOptions::default() };
        engine.load(store.as_ref(), &mut req, &opts).map(|_| req.objects[0].data.clone())
    })
}

/// With the check off, replicas are not compared, and so not written either: a copy known
/// to be stale (rank 1's, below) never replaces the main copy's bytes, where a balanced
/// plan gave the write to the least loaded holder.
#[test]
fn with_the_check_off_the_main_copies_are_written() {
    let store = memory();
    let results = run(|r, engine| {
        let (t, mut d) = dense(r);
        if r != 0 {
            d.iter_mut().for_each(|b| *b = 0xee); // stale
        }
        // Rank 0 also holds a large tensor of its own: a balanced plan moves the rest away.
        let own = (
            ShardedTensor::whole(format!("own.{r}"), DType::U8, [if r == 0 { 4096 } else { 8 }]),
            vec![r as u8; if r == 0 { 4096 } else { 8 }],
        );
        let p = vec![(t, d), own];
        engine.save(
            store.as_ref(),
            &state(&p),
            &SaveOptions { replica_check: ReplicaCheck::Off, ..SaveOptions::default() },
        )
    });
    results.into_iter().enumerate().for_each(|(r, o)| drop(o.unwrap_or_else(|e| panic!("rank {r}: {e}"))));
    let loaded = run(|_, engine| {
        let mut norm = vec![0u8; 32];
        let mut req = LoadRequest::default();
        req.tensors.push(TensorRequest {
            tensor: ShardedTensor::whole("decoder.norm", DType::U8, [32]),
            data: &mut norm,
            allow_shape_mismatch: false,
            allow_dtype_cast: false,
        });
        let strictness = dckpt_engine::Strictness { unexpected: dckpt_engine::KeyPolicy::Ignore, ..Default::default() };
        engine.load(store.as_ref(), &mut req, &LoadOptions { strictness, ..LoadOptions::default() }).map(|_| norm)
    });
    for (r, norm) in loaded.into_iter().enumerate() {
        assert_eq!(norm.unwrap_or_else(|e| panic!("rank {r}: {e}")), (0..32).collect::<Vec<u8>>(), "rank {r}");
    }
}

/// An object's copies are found among each rank's pieces after its tensors, however many
/// tensors each rank holds, and compared again by a save that reuses its plan.
#[test]
fn copies_of_objects_are_compared_when_the_plan_is_reused() {
    let stores: Vec<Arc<dyn Storage>> = (0..3).map(|_| memory()).collect();
    let results = run(|r, engine| {
        // Rank r holds r tensors of its own besides the dense weight.
        let mut p = vec![dense(r)];
        p.extend((0..r).map(|i| (ShardedTensor::whole(format!("own.{r}.{i}"), DType::U8, [8]), vec![r as u8; 8])));
        let saves = stores.iter().enumerate().map(|(save, store)| {
            let mut s = state(&p);
            // At the third save, rank 3 is at another step.
            let step: &[u8] = if save == 2 && r == 3 { b"8" } else { b"7" };
            for (key, data) in [("config", &b"{}"[..]), ("step", step)] {
                let object = ShardedObject::single(key).replica(ReplicaId { dp: r as u32, ..ReplicaId::MAIN });
                s.objects.push(ObjectData { object, data, compare: ObjectCompare::Bytes });
            }
            engine.save(store.as_ref(), &s, &SaveOptions::default())
        });
        saves.collect::<Vec<_>>()
    });
    for (r, saves) in results.into_iter().enumerate() {
        let mut saves = saves.into_iter();
        for reused in [false, true] {
            let o = saves.next().expect("three saves").unwrap_or_else(|e| panic!("rank {r}: {e}"));
            // The dense weight and both objects.
            assert_eq!((o.replicas_checked, o.plan_reused), (3, reused), "rank {r}");
        }
        match saves.next().expect("three saves").map_err(Error::into_kind) {
            Err(ErrorKind::ObjectsDiffer { key, main_rank: 0, ranks, .. }) => {
                assert_eq!((key.as_str(), ranks.as_slice()), ("step", &[3u32][..]), "rank {r}");
            }
            other => panic!("rank {r}: expected ObjectsDiffer, got {other:?}"),
        }
    }
    assert_nothing_written(&stores[2]);
}

/// Ranks passing different replica checks are refused as options that differ, naming the
/// rank: one sampling another fraction sent a window's checksum where the others sent a
/// whole chunk's, and identical replicas failed as replicas that differ.
#[test]
fn ranks_passing_different_replica_checks_are_refused_as_options() {
    let store = memory();
    let results = run(|r, engine| {
        let p = pieces(r, 1, true);
        let check = if r == 3 { ReplicaCheck::Sample { fraction: 0.5 } } else { ReplicaCheck::All };
        engine.save(store.as_ref(), &state(&p), &SaveOptions::default().replica_check(check))
    });
    for (r, o) in results.into_iter().enumerate() {
        let e = o.expect_err("refused on every rank");
        assert!(matches!(e.kind(), ErrorKind::InvalidOptions { .. }), "rank {r}: {e}");
        assert!(e.to_string().contains("rank 3 passes another replica_check"), "rank {r}: {e}");
    }
}
