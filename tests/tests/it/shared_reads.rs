//! Chunks that a load splits between ranks: each rank reads only its bytes and the ranks
//! check the checksum blocks together, or, where the store reads in place, each rank checks
//! the whole blocks its rows touch; a flipped byte anywhere in such a block fails the load
//! on every rank with the block's file and offset.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use dckpt_engine::read_metadata_local;
use dckpt_engine::{
    Engine, Error, ErrorKind, LoadOptions, LoadRequest, SaveOptions, SaveState, TensorData, TensorRequest,
};
use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedTensor};
use dckpt_storage::Storage;
use dckpt_tests::{run_ranks, windowed};

const ROWS: u64 = 16;
const COLS: u64 = 24;
/// Checksum blocks of 32 bytes: rows are 24, so blocks straddle rows.
const BLOCK: u64 = 32;

fn tensor(region: Region) -> ShardedTensor {
    ShardedTensor {
        key: "w".into(),
        dtype: DType::U8,
        global_shape: vec![ROWS, COLS].into(),
        region,
        replica_id: ReplicaId::MAIN,
    }
}

fn value(row: u64, col: u64) -> u8 {
    (row * 31 + col * 7 + 3) as u8
}

/// The saved directory and the three stores over it.
type Saved = (tempfile::TempDir, Arc<dyn Storage>, Arc<dyn Storage>, Arc<dyn Storage>);

/// One rank saves the whole tensor as one chunk; returns the directory, its storage opened
/// as the CLI opens it (reads out of mappings: in place), the same storage read by system
/// calls, and that storage asking for reads of 40 bytes at a time (so that a load goes
/// through many read windows, and the stretches of one shared block through several).
fn saved() -> Saved {
    let dir = tempfile::tempdir().expect("tempdir");
    let open = |mapped_reads: bool| {
        let local = dckpt_storage::LocalConfig { mapped_reads, ..Default::default() };
        let options = dckpt_storage::OpenOptions { local, ..Default::default() };
        dckpt_storage::open_with(dir.path().to_str().expect("utf-8"), &options).expect("open")
    };
    let (in_place, storage) = (open(true), open(false));
    assert!(in_place.hints().reads_in_place && !storage.hints().reads_in_place);
    let data: Vec<u8> = (0..ROWS).flat_map(|r| (0..COLS).map(move |c| value(r, c))).collect();
    let state = SaveState {
        tensors: vec![TensorData { tensor: tensor(Region::full(&[ROWS, COLS])), data: &data }],
        ..Default::default()
    };
    let opts = SaveOptions { block_bytes: BLOCK, ..SaveOptions::default() };
    for o in run_ranks(1, |_, c| Engine::new(c).save(storage.as_ref(), &state, &opts)) {
        o.expect("save");
    }
    let small_windows = windowed(storage.clone(), 40);
    (dir, in_place, storage, small_windows)
}

/// Loads `boxes[rank]` (row range, column range) on `boxes.len()` ranks; per rank the
/// bytes read, after checking every element.
fn load(storage: &Arc<dyn Storage>, boxes: &[([u64; 2], [u64; 2])]) -> Vec<Result<u64, Error>> {
    run_ranks(boxes.len(), |r, c| {
        let ([r0, r1], [c0, c1]) = boxes[r];
        let region = Region::boxed(vec![r0, c0], vec![r1 - r0, c1 - c0]);
        let mut buf = vec![0u8; region.numel() as usize];
        let mut req = LoadRequest {
            tensors: vec![TensorRequest {
                tensor: tensor(region),
                data: &mut buf,
                allow_shape_mismatch: false,
                allow_dtype_cast: false,
            }],
            ..Default::default()
        };
        let out = Engine::new(c).load(storage.as_ref(), &mut req, &LoadOptions::default())?;
        let want: Vec<u8> = (r0..r1).flat_map(|row| (c0..c1).map(move |col| value(row, col))).collect();
        assert_eq!(buf, want, "rank {r} loaded wrong data");
        Ok(out.bytes_read)
    })
}

fn data_start(storage: &Arc<dyn Storage>) -> (String, u64) {
    let meta = read_metadata_local(storage.as_ref()).expect("metadata");
    (meta.files[0].name.clone(), meta.files[0].data_start)
}

const HALVES: [([u64; 2], [u64; 2]); 2] = [([0, ROWS], [0, 12]), ([0, ROWS], [12, COLS])];

const SPLITS: [&[([u64; 2], [u64; 2])]; 4] = [
    &HALVES,
    // Three uneven column stripes.
    &[([0, ROWS], [0, 5]), ([0, ROWS], [5, 17]), ([0, ROWS], [17, COLS])],
    // A 2 x 2 grid.
    &[([0, 7], [0, 10]), ([0, 7], [10, COLS]), ([7, ROWS], [0, 10]), ([7, ROWS], [10, COLS])],
    // Data-parallel copies: ranks 0 and 2 want the same half, so do 1 and 3.
    &[HALVES[0], HALVES[1], HALVES[0], HALVES[1]],
];

#[test]
fn ranks_that_split_a_chunk_read_each_byte_once() {
    let (_dir, _, storage, small_windows) = saved();
    let (_, header) = data_start(&storage);
    for store in [&storage, &small_windows] {
        for boxes in SPLITS {
            let read: Vec<u64> = load(store, boxes).into_iter().map(|r| r.expect("load")).collect();
            let own = boxes.iter().map(|(rows, cols)| (rows[1] - rows[0]) * (cols[1] - cols[0]));
            header_read_once(&read, own, header, &format!("{boxes:?}"));
        }
    }
}

/// Where the store reads in place, each rank of a column split checks the whole blocks its
/// rows touch itself and picks its rows out of them: it reads exactly those blocks, and
/// the header is still read once.
#[test]
fn ranks_that_split_a_chunk_in_place_pick_their_rows_from_whole_blocks() {
    let (_dir, in_place, _, _) = saved();
    let (_, header) = data_start(&in_place);
    for boxes in SPLITS {
        let read: Vec<u64> = load(&in_place, boxes).into_iter().map(|r| r.expect("load")).collect();
        let blocks = boxes.iter().map(|([r0, r1], [c0, c1])| {
            let (first, end) = (r0 * COLS + c0, (r1 - 1) * COLS + c1);
            (end.div_ceil(BLOCK) * BLOCK).min(ROWS * COLS) - first / BLOCK * BLOCK
        });
        header_read_once(&read, blocks, header, &format!("{boxes:?}, in place"));
    }
}

/// Each rank read `own` bytes of data, and the file's `header` was read by exactly one of
/// them: the others received it from that one (the load's fan-out).
fn header_read_once(read: &[u64], own: impl Iterator<Item = u64>, header: u64, ctx: &str) {
    let mut readers = 0;
    for (r, (&n, own)) in read.iter().zip(own).enumerate() {
        assert!(n == own || n == own + header, "rank {r} of {ctx} read {n} bytes, {own} of its own");
        readers += usize::from(n == own + header);
    }
    assert_eq!(readers, 1, "{ctx}: the header read by one rank, read {read:?}");
}

#[test]
fn ranks_whose_parts_do_not_tile_a_chunk_read_whole_blocks() {
    let (_dir, _, storage, _) = saved();
    let (_, header) = data_start(&storage);
    // Overlapping columns, and a half nobody else completes: each rank verifies alone.
    for boxes in [&[([0, ROWS], [0, 14]), ([0, ROWS], [10, COLS])][..], &[HALVES[0]][..]] {
        let read: Vec<u64> = load(&storage, boxes).into_iter().map(|r| r.expect("load")).collect();
        let whole = boxes.iter().map(|_| ROWS * COLS);
        header_read_once(&read, whole, header, &format!("{boxes:?}: every block it touches, whole"));
    }
}

#[test]
fn a_flipped_byte_in_a_shared_block_fails_every_rank() {
    let (dir, in_place, storage, small_windows) = saved();
    let (name, start) = data_start(&storage);
    let path = dir.path().join(&name);
    let flip = |pos: u64| {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("open");
        let mut b = [0u8];
        f.read_exact_at(&mut b, pos).expect("read");
        f.write_all_at(&[b[0] ^ 0x10], pos).expect("write");
    };
    let quads = [HALVES[0], HALVES[1], HALVES[0], HALVES[1]];
    let stores =
        [(&storage, &HALVES[..]), (&storage, &quads[..]), (&small_windows, &HALVES[..]), (&in_place, &quads[..])];
    for (store, boxes) in stores {
        for pos in start..start + ROWS * COLS {
            flip(pos);
            let results = load(store, boxes);
            flip(pos);
            let block_at = start + (pos - start) / BLOCK * BLOCK;
            for (r, res) in results.into_iter().enumerate() {
                match res.map_err(Error::into_kind) {
                    Err(ErrorKind::Checksum { file, offset, .. }) => {
                        assert_eq!((file.as_str(), offset), (name.as_str(), block_at), "rank {r}, byte {pos}");
                    }
                    other => panic!("rank {r}, byte {pos} flipped: expected a checksum error, got {other:?}"),
                }
            }
        }
    }
    for r in load(&storage, &HALVES) {
        r.expect("load after restoring");
    }
}
