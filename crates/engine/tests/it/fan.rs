//! Read once, fan out: a load at dp 4 reads each byte its ranks need about once from
//! storage, spread over them, and every rank still checks what it uses.

use std::sync::Arc;

use bytes::Bytes;
use dckpt_collective::{CollectiveOptions, ThreadGroup};
use dckpt_engine::{Engine, ErrorKind, LoadOptions, LoadOutcome, LoadRequest, SaveOptions, SaveState, TensorRequest};
use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedTensor};
use dckpt_storage::{Counting, FaultConfig, FaultStorage, Storage};

const WORLD: usize = 4;
const ROWS: u64 = 64;
const COLS: u64 = 16 << 10;
const META: &str = "dckpt.meta";

/// The weight every rank holds whole (data-parallel replicas), `ROWS x COLS` bytes.
fn weight(rank: usize) -> ShardedTensor {
    ShardedTensor {
        replica_id: ReplicaId { dp: rank as u32, ..ReplicaId::MAIN },
        ..ShardedTensor::whole("w", DType::U8, [ROWS, COLS])
    }
}

fn weight_bytes() -> Vec<u8> {
    (0..ROWS * COLS).map(|i| (i * 7 % 251) as u8).collect()
}

/// Each rank's own rows of a split tensor.
fn own(rank: usize) -> (ShardedTensor, Vec<u8>) {
    let t = ShardedTensor {
        key: "own".into(),
        dtype: DType::U8,
        global_shape: [WORLD as u64 * 4, COLS].into(),
        region: Region::boxed([rank as u64 * 4, 0], [4, COLS]),
        replica_id: ReplicaId::MAIN,
    };
    (t, (0..4 * COLS).map(|i| (i as u8) ^ (rank as u8 * 37)).collect())
}

/// A memory store with the state saved at dp 4, in blocks of 64 KiB.
fn saved() -> Arc<dyn Storage> {
    saved_into(dckpt_storage::open("memory://").expect("memory storage"))
}

/// `store` with the state saved at dp 4, in blocks of 64 KiB.
fn saved_into(store: Arc<dyn Storage>) -> Arc<dyn Storage> {
    let w = weight_bytes();
    let opts = SaveOptions { block_bytes: 64 << 10, ..SaveOptions::default() };
    ThreadGroup::run(WORLD, &CollectiveOptions::default(), |r, c| {
        let (t, d) = own(r);
        let mut s = SaveState::new();
        s.push_tensor(weight(r), &w);
        s.push_tensor(t, &d);
        Engine::new(Arc::new(c)).save(store.as_ref(), &s, &opts).expect("save");
    })
    .expect("threads");
    store
}

/// What one rank's load came to: its outcome (or error), the data bytes its store read.
type Loaded = (dckpt_engine::Result<LoadOutcome>, u64);

/// Every rank loads the whole weight, in `columns` column parts over the ranks (1: whole),
/// and its own rows, each through its own counter over `store` (`broken` ranks' stores fail
/// every request); every rank that succeeds must hold exactly the saved bytes.
fn load(store: &Arc<dyn Storage>, opts: &LoadOptions, columns: u64, broken: &[usize]) -> Vec<Loaded> {
    let w = weight_bytes();
    ThreadGroup::run(WORLD, &CollectiveOptions::default(), |r, c| {
        let inner: Arc<dyn Storage> = match broken.contains(&r) {
            true => {
                Arc::new(FaultStorage::new(store.clone(), FaultConfig { fail_from_op: Some(0), ..Default::default() }))
            }
            false => store.clone(),
        };
        let data = Counting::only(inner, |p| p != META);
        let (t, want_own) = own(r);
        let part = COLS / columns;
        let col = r as u64 % columns * part;
        let region = Region::boxed([0, col], [ROWS, part]);
        let wt = ShardedTensor { region: region.clone(), ..weight(r) };
        let (mut wbuf, mut obuf) = (vec![0u8; (ROWS * part) as usize], vec![0u8; want_own.len()]);
        let mut req = LoadRequest::default();
        req.tensors.push(TensorRequest {
            tensor: wt,
            data: &mut wbuf,
            allow_shape_mismatch: false,
            allow_dtype_cast: false,
        });
        req.tensors.push(TensorRequest {
            tensor: t,
            data: &mut obuf,
            allow_shape_mismatch: false,
            allow_dtype_cast: false,
        });
        let out = Engine::new(Arc::new(c)).load(&data, &mut req, opts);
        if out.is_ok() {
            let rows = w.chunks(COLS as usize).map(|row| &row[col as usize..(col + part) as usize]);
            assert!(rows.eq(wbuf.chunks(part as usize)), "rank {r}: other weight bytes");
            assert_eq!(obuf, want_own, "rank {r}: other rows");
        }
        (out, data.counts().bytes_read)
    })
    .expect("threads")
}

/// The bytes of all data files: what the ranks need between them, each byte once.
fn unique(store: &Arc<dyn Storage>) -> u64 {
    store.list("").expect("list").iter().filter(|o| o.path != META).map(|o| o.size).sum()
}

fn outcomes(loaded: &[Loaded]) -> Vec<&LoadOutcome> {
    loaded.iter().enumerate().map(|(r, l)| l.0.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect()
}

#[test]
fn a_dp4_load_reads_each_byte_once_spread_over_the_ranks() {
    let store = saved();
    let loaded = load(&store, &LoadOptions::default(), 1, &[]);
    let (need, outs) = (unique(&store), outcomes(&loaded));
    let read: u64 = loaded.iter().map(|l| l.1).sum();
    eprintln!(
        "read {read} of {need} bytes: {:?}",
        outs.iter().map(|o| (o.bytes_read, o.bytes_received)).collect::<Vec<_>>()
    );
    assert!(read as f64 <= 1.05 * need as f64, "read {read} bytes from storage, {need} needed");
    for (r, (o, l)) in outs.iter().zip(&loaded).enumerate() {
        assert_eq!(o.bytes_read, l.1, "rank {r}: the outcome counts other bytes than the store saw");
        // Spread: each rank reads about a quarter of the weight, and receives the rest.
        assert!(o.bytes_read < ROWS * COLS / 2, "rank {r} read {} bytes", o.bytes_read);
        assert!(o.bytes_received >= ROWS * COLS / 2, "rank {r} received {} bytes", o.bytes_received);
    }
}

/// On local disk read in place (as the CLI reads), the whole blocks every replica needs are
/// still read once and sent; each byte is read about once.
#[test]
fn an_in_place_dp4_load_reads_each_whole_block_once() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    // Field by field: the options have more fields when the `s3` feature is on.
    let mut options = dckpt_storage::OpenOptions::default();
    options.local.mapped_reads = true;
    let store = saved_into(dckpt_storage::open_with(dir.path().to_str().expect("utf-8"), &options).expect("open"));
    assert!(store.hints().reads_in_place);
    let loaded = load(&store, &LoadOptions::default(), 1, &[]);
    let read: u64 = loaded.iter().map(|l| l.1).sum();
    assert!(read as f64 <= 1.05 * unique(&store) as f64, "read {read} bytes");
    assert!(outcomes(&loaded).iter().all(|o| o.bytes_received >= ROWS * COLS / 2));
}

#[test]
fn without_the_fan_out_every_replica_reads_its_own_copy() {
    let store = saved();
    let loaded = load(&store, &LoadOptions { fan_out: false, ..LoadOptions::default() }, 1, &[]);
    let read: u64 = loaded.iter().map(|l| l.1).sum();
    assert!(read >= WORLD as u64 * ROWS * COLS, "read {read} bytes");
    assert!(outcomes(&loaded).iter().all(|o| o.bytes_received == 0));
}

#[test]
fn many_small_rounds_load_the_same_bytes() {
    let store = saved();
    let opts = LoadOptions { fan_out_round_bytes: 1, ..LoadOptions::default() };
    let loaded = load(&store, &opts, 1, &[]);
    let read: u64 = loaded.iter().map(|l| l.1).sum();
    assert!(read as f64 <= 1.05 * unique(&store) as f64, "read {read} bytes");
    assert!(outcomes(&loaded).iter().all(|o| o.bytes_received > 0));
}

#[test]
fn column_halves_at_dp2_are_loaded_exactly() {
    let store = saved();
    let loaded = load(&store, &LoadOptions::default(), 2, &[]);
    outcomes(&loaded);
}

#[test]
fn a_damaged_byte_fails_every_rank_that_uses_it_naming_the_file() {
    let store = saved();
    // The weight's file: the largest.
    let files = store.list("").expect("list");
    let big = files.iter().filter(|o| o.path != META).max_by_key(|o| o.size).expect("a data file");
    let mut bytes = store.get(&big.path).expect("get").to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    store.put(&big.path, Bytes::from(bytes)).expect("put");
    let loaded = load(&store, &LoadOptions::default(), 1, &[]);
    for (r, (out, _)) in loaded.iter().enumerate() {
        let e = out.as_ref().expect_err("a damaged byte loaded");
        match e.kind() {
            ErrorKind::Checksum { file, .. } => assert!(big.path.ends_with(file.as_str()), "rank {r}: {e}"),
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn a_rank_whose_store_fails_fails_the_load_on_every_rank_naming_it() {
    let store = saved();
    let loaded = load(&store, &LoadOptions::default(), 1, &[1]);
    for (r, (out, _)) in loaded.iter().enumerate() {
        let e = out.as_ref().expect_err("loaded with a broken store");
        assert!(matches!(e.kind(), ErrorKind::Storage { .. }), "rank {r}: {e}");
        assert_eq!(e.rank(), Some(1), "rank {r}: {e}");
    }
}

/// An object every rank loads, longer than a block, with a fan-out round boundary inside
/// it (a round a block): each rank gets all of it, where the object's buffer was sized by
/// the last of its cut copies and the load panicked.
#[test]
fn an_object_cut_by_the_fan_out_s_rounds_arrives_whole() {
    use dckpt_engine::ObjectRequest;
    use dckpt_shard_spec::ShardedObject;
    let store = dckpt_storage::open("memory://").expect("memory storage");
    let blob: Vec<u8> = (0..200u32 << 10).map(|i| (i * 13 % 251) as u8).collect();
    let opts = SaveOptions { block_bytes: 64 << 10, ..SaveOptions::default() };
    ThreadGroup::run(2, &CollectiveOptions::default(), |r, c| {
        let mut s = SaveState::new();
        let o = ShardedObject::single("blob");
        let o = if r == 0 { o } else { ShardedObject { replica_id: ReplicaId { dp: 1, ..ReplicaId::MAIN }, ..o } };
        s.push_object(o, &blob);
        Engine::new(Arc::new(c)).save(store.as_ref(), &s, &opts).expect("save");
    })
    .expect("threads");
    let lopts = LoadOptions { fan_out_round_bytes: 1, ..LoadOptions::default() };
    let got = ThreadGroup::run(2, &CollectiveOptions::default(), |_, c| {
        let mut req = LoadRequest::default();
        req.objects.push(ObjectRequest { object: ShardedObject::single("blob"), data: None });
        let out = Engine::new(Arc::new(c)).load(store.as_ref(), &mut req, &lopts);
        (out.map(|o| o.bytes_received), req.objects.pop().and_then(|o| o.data))
    })
    .expect("threads");
    for (r, (out, data)) in got.into_iter().enumerate() {
        out.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(data.as_deref() == Some(&blob[..]), "rank {r}: {:?} bytes", data.map(|d| d.len()));
    }
}
