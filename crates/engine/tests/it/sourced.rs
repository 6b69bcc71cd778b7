//! Sourced pieces: bytes the engine pulls from a source while it writes them.

use std::sync::{Arc, Mutex};

use dckpt_engine::{
    Engine, Error, ErrorKind, LoadOptions, LoadRequest, PieceSource, SaveOptions, SaveState, SourcedTensor,
};
use dckpt_shard_spec::{DType, ReplicaId, ShardedTensor};

/// Serves `bytes`, recording every read, optionally failing at one offset.
struct Recorded {
    bytes: Vec<u8>,
    reads: Mutex<Vec<(u64, usize)>>,
    fail_at: Option<u64>,
}

impl PieceSource for Recorded {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> dckpt_engine::Result<()> {
        self.reads.lock().unwrap().push((offset, buf.len()));
        if self.fail_at == Some(offset) {
            return Err(Error::new(ErrorKind::Other { message: format!("source: cannot read at {offset}") }));
        }
        let at = offset as usize;
        buf.copy_from_slice(&self.bytes[at..at + buf.len()]);
        Ok(())
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn engine() -> Engine {
    Engine::new(Arc::new(dckpt_collective::ThreadGroup::new(1).unwrap().remove(0)))
}

#[test]
fn sourced_and_borrowed_pieces_load_back_bit_exact_in_bounded_reads() {
    let storage = dckpt_storage::open("memory://").unwrap();
    // 20 MiB: several bounce buffers' worth, with a partial last one.
    let big_len = 20 << 20;
    let big = Recorded { bytes: pattern(big_len, 7), reads: Mutex::default(), fail_at: None };
    let small = pattern(12, 3);
    let big_t = ShardedTensor::whole("big", DType::U8, [(big_len / 4) as u64, 4]);
    let state = SaveState::new().tensor(ShardedTensor::whole("small", DType::F32, [3]), &small);
    let sourced = [SourcedTensor { tensor: big_t.clone(), source: &big }];
    engine().save_sourced(storage.as_ref(), &state, &sourced, &SaveOptions::default()).unwrap();

    let reads = big.reads.lock().unwrap().clone();
    assert!(reads.iter().all(|&(_, n)| n <= 8 << 20), "a read larger than a bounce buffer: {reads:?}");
    let mut at = 0;
    for &(o, n) in &reads {
        assert_eq!(o, at, "reads must be consecutive");
        at += n as u64;
    }
    assert_eq!(at, big_len as u64);

    let (mut got_big, mut got_small) = (vec![0u8; big_len], vec![0u8; 12]);
    let mut req = LoadRequest::new()
        .tensor(big_t, &mut got_big)
        .tensor(ShardedTensor::whole("small", DType::F32, [3]), &mut got_small);
    engine().load(storage.as_ref(), &mut req, &LoadOptions::default()).unwrap();
    drop(req);
    assert!(got_big == big.bytes, "the sourced piece differs");
    assert_eq!(got_small, small);
}

#[test]
fn a_failing_source_fails_the_save_and_leaves_no_file() {
    let storage = dckpt_storage::open("memory://").unwrap();
    let src = Recorded { bytes: pattern(24 << 20, 1), reads: Mutex::default(), fail_at: Some(8 << 20) };
    let sourced = [SourcedTensor { tensor: ShardedTensor::whole("w", DType::U8, [24 << 20]), source: &src }];
    let err =
        engine().save_sourced(storage.as_ref(), &SaveState::new(), &sourced, &SaveOptions::default()).unwrap_err();
    assert!(err.to_string().contains("cannot read at 8388608"), "{err}");
    assert_eq!(storage.list("").unwrap(), vec![], "a failed save left files");
}

#[test]
fn a_sourced_replica_is_refused() {
    let storage = dckpt_storage::open("memory://").unwrap();
    let src = Recorded { bytes: vec![0; 4], reads: Mutex::default(), fail_at: None };
    let mut t = ShardedTensor::whole("w", DType::U8, [4]);
    t.replica_id = ReplicaId { dp: 1, ..ReplicaId::MAIN };
    let sourced = [SourcedTensor { tensor: t, source: &src }];
    let err =
        engine().save_sourced(storage.as_ref(), &SaveState::new(), &sourced, &SaveOptions::default()).unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Request { key, .. } if key == "w"), "{err}");
}

#[test]
fn ranks_save_sourced_row_halves_that_one_rank_loads_whole() {
    let storage = dckpt_storage::open("memory://").unwrap();
    let whole = pattern(6 << 20, 9);
    let half = whole.len() / 2;
    let ranks = dckpt_collective::ThreadGroup::new(2).unwrap();
    std::thread::scope(|s| {
        for (r, c) in ranks.into_iter().enumerate() {
            let (storage, whole) = (storage.clone(), &whole);
            s.spawn(move || {
                let src = Recorded {
                    bytes: whole[r * half..(r + 1) * half].to_vec(),
                    reads: Mutex::default(),
                    fail_at: None,
                };
                let t = ShardedTensor::chunk("w", DType::U8, [2, half as u64], [r as u64, 0], [1, half as u64]);
                let sourced = [SourcedTensor { tensor: t, source: &src }];
                Engine::new(Arc::new(c))
                    .save_sourced(storage.as_ref(), &SaveState::new(), &sourced, &SaveOptions::default())
                    .unwrap();
            });
        }
    });
    let mut got = vec![0u8; whole.len()];
    let mut req = LoadRequest::new().tensor(ShardedTensor::whole("w", DType::U8, [2, half as u64]), &mut got);
    engine().load(storage.as_ref(), &mut req, &LoadOptions::default()).unwrap();
    drop(req);
    assert!(got == whole);
}

/// A sourced main copy whose read fails in the replica check fails the save with that
/// read's error, naming its rank, on every rank: it was sent as a checksum that could not
/// match, and the save failed as replicas that differ (a layout bug's hint) with the cause
/// only in one rank's log.
#[test]
fn a_source_that_fails_in_the_replica_check_is_named_on_every_rank() {
    let storage = dckpt_storage::open("memory://").unwrap();
    let bytes = pattern(64, 3);
    let ranks = dckpt_collective::ThreadGroup::new(2).unwrap();
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let (storage, bytes) = (storage.clone(), &bytes);
                s.spawn(move || {
                    let engine = Engine::new(Arc::new(c));
                    let t = ShardedTensor::whole("w", DType::U8, [64]);
                    if r == 0 {
                        let src = Recorded { bytes: bytes.clone(), reads: Mutex::default(), fail_at: Some(0) };
                        let sourced = [SourcedTensor { tensor: t, source: &src }];
                        engine.save_sourced(storage.as_ref(), &SaveState::new(), &sourced, &SaveOptions::default())
                    } else {
                        let replica = ShardedTensor { replica_id: ReplicaId { dp: 1, ..ReplicaId::MAIN }, ..t };
                        let state = SaveState::new().tensor(replica, bytes);
                        engine.save(storage.as_ref(), &state, &SaveOptions::default())
                    }
                    .unwrap_err()
                    .to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, e) in errors.iter().enumerate() {
        assert!(e.contains("cannot read at 0") && e.contains("rank 0"), "rank {r}: {e}");
    }
}
