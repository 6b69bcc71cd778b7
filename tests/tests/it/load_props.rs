//! Random layouts saved and loaded in random other layouts: every loaded byte must be the
//! one saved. The checksum blocks are tiny (a few elements), so that rows straddle blocks,
//! loads split blocks between ranks, and every path of a load is taken: whole blocks read
//! in place, partial blocks staged, blocks checked together by the ranks that split them.

use std::sync::Arc;

use dckpt_engine::{Engine, LoadOptions, LoadRequest, SaveOptions, SaveState, TensorData, TensorRequest};
use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedTensor};
use dckpt_storage::Storage;
use dckpt_tests::{memory, run_ranks, windowed};
use proptest::prelude::*;

const KEYS: [&str; 2] = ["a", "b"];

/// The byte `j` of element `g` (row-major global index) of tensor `key`.
fn byte(key: usize, g: u64, j: u64) -> u8 {
    (g.wrapping_mul(0x9e37_79b9).wrapping_add(j * 131 + key as u64 * 17) >> 3) as u8
}

/// A region's bytes in its own buffer order.
fn bytes_of(key: usize, global: &[u64], region: &Region, esz: u64) -> Vec<u8> {
    let full = Region::full(global);
    let mut out = Vec::with_capacity((region.numel() * esz) as usize);
    for local in 0..region.numel() {
        let idx = region.global_index(local);
        let g = idx.iter().zip(&full.shape).fold(0u64, |acc, (&i, &s)| acc * s + i);
        out.extend((0..esz).map(|j| byte(key, g, j)));
    }
    out
}

/// How a tensor is cut: a grid of boxes (cut points per dimension), or flat ranges of the
/// whole tensor (as a distributed optimizer cuts its buffers).
#[derive(Debug, Clone)]
enum Cut {
    Grid(Vec<Vec<u64>>),
    Flat(Vec<u64>),
}

impl Cut {
    fn regions(&self, global: &[u64]) -> Vec<Region> {
        match self {
            Cut::Grid(cuts) => {
                let mut out = vec![Region::boxed(Vec::new(), Vec::new())];
                for (d, &extent) in global.iter().enumerate() {
                    let mut points: Vec<u64> = cuts[d].iter().map(|c| c % extent).filter(|&c| c > 0).collect();
                    points.push(0);
                    points.push(extent);
                    points.sort_unstable();
                    points.dedup();
                    out = out
                        .into_iter()
                        .flat_map(|r| {
                            points.windows(2).map(move |w| {
                                let mut r = r.clone();
                                r.offset.push(w[0]);
                                r.shape.push(w[1] - w[0]);
                                r
                            })
                        })
                        .collect();
                }
                out
            }
            Cut::Flat(cuts) => {
                let n: u64 = global.iter().product();
                let mut points: Vec<u64> = cuts.iter().map(|c| c % n).filter(|&c| c > 0).collect();
                points.push(0);
                points.push(n);
                points.sort_unstable();
                points.dedup();
                points.windows(2).map(|w| Region::full(global).narrowed(w[0], w[1])).collect()
            }
        }
    }
}

fn cut() -> impl Strategy<Value = Cut> {
    prop_oneof![
        3 => prop::collection::vec(prop::collection::vec(0u64..12, 0..3), 3).prop_map(Cut::Grid),
        1 => prop::collection::vec(0u64..2000, 0..4).prop_map(Cut::Flat),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    /// Global shape of each key.
    shapes: Vec<Vec<u64>>,
    dtype: DType,
    saved: Vec<Cut>,
    savers: usize,
    loaded: Vec<Cut>,
    loaders: usize,
    /// Load ranks that ask for another rank's regions as well (data-parallel copies).
    copies: usize,
    /// The first load rank asks for its first region twice.
    twice: bool,
    block: u64,
    window: Option<u64>,
    read_bytes_max: u64,
    /// A data file and a byte of its data section to flip for a second load, which must fail.
    flip: (usize, u64),
}

fn case() -> impl Strategy<Value = Case> {
    let shape = prop::collection::vec(1u64..10, 1..4);
    (
        prop::collection::vec(shape, KEYS.len()),
        prop::sample::select(vec![DType::U8, DType::Bf16, DType::F32]),
        prop::collection::vec(cut(), KEYS.len()),
        1usize..4,
        prop::collection::vec(cut(), KEYS.len()),
        1usize..5,
        (0usize..3, any::<bool>()),
        prop::sample::select(vec![1u64, 3, 8, 16, 40, 4096]),
        prop::option::of(prop::sample::select(vec![7u64, 40, 300])),
        prop::sample::select(vec![1u64, 5, 64, 64 << 20]),
        (any::<usize>(), any::<u64>()),
    )
        .prop_map(
            |(shapes, dtype, saved, savers, loaded, loaders, (copies, twice), block, window, read_bytes_max, flip)| {
                Case {
                    shapes,
                    dtype,
                    saved,
                    savers,
                    loaded,
                    loaders,
                    copies,
                    twice,
                    block,
                    window,
                    read_bytes_max,
                    flip,
                }
            },
        )
}

fn sharded(key: usize, global: &[u64], region: Region, dtype: DType) -> ShardedTensor {
    ShardedTensor {
        key: KEYS[key].into(),
        dtype,
        global_shape: global.to_vec().into(),
        region,
        replica_id: ReplicaId::MAIN,
    }
}

/// Each rank's pieces of each key: the cut's regions dealt round robin, rank by rank.
fn deal(cuts: &[Cut], shapes: &[Vec<u64>], ranks: usize) -> Vec<Vec<(usize, Region)>> {
    let mut out = vec![Vec::new(); ranks];
    for (key, (c, shape)) in cuts.iter().zip(shapes).enumerate() {
        for (i, r) in c.regions(shape).into_iter().enumerate() {
            out[(i + key) % ranks].push((key, r));
        }
    }
    out
}

fn run(case: &Case) -> Result<(), TestCaseError> {
    let esz = case.dtype.size();
    let storage: Arc<dyn Storage> = match case.window {
        Some(w) => windowed(memory(), w),
        None => memory(),
    };
    let pieces = deal(&case.saved, &case.shapes, case.savers);
    let datas: Vec<Vec<Vec<u8>>> =
        pieces.iter().map(|mine| mine.iter().map(|(k, r)| bytes_of(*k, &case.shapes[*k], r, esz)).collect()).collect();
    let opts = SaveOptions { block_bytes: case.block, ..SaveOptions::default() };
    for (rank, outcome) in run_ranks(case.savers, |r, c| {
        let tensors = pieces[r]
            .iter()
            .zip(&datas[r])
            .map(|((k, region), data)| TensorData {
                tensor: sharded(*k, &case.shapes[*k], region.clone(), case.dtype),
                data,
            })
            .collect();
        Engine::new(c).save(storage.as_ref(), &SaveState { tensors, ..Default::default() }, &opts)
    })
    .into_iter()
    .enumerate()
    {
        outcome.map_err(|e| TestCaseError::fail(format!("save on rank {rank}: {e}")))?;
    }
    // Some load ranks also take the pieces of the ranks after them: overlapping requests.
    let mut wanted = deal(&case.loaded, &case.shapes, case.loaders);
    for r in 0..case.copies.min(case.loaders.saturating_sub(1)) {
        let next = wanted[r + 1].clone();
        wanted[r].extend(next);
    }
    if let Some(first) = wanted[0].first().filter(|_| case.twice).cloned() {
        wanted[0].push(first);
    }
    let mut opts = LoadOptions { read_bytes_max: case.read_bytes_max, ..LoadOptions::default() };
    // A key that no rank asks for is not an error here.
    opts.strictness.unexpected = dckpt_engine::KeyPolicy::Ignore;
    let load = |check: bool| {
        run_ranks(case.loaders, |r, c| -> Vec<String> {
            // All of a rank's regions in one request, several of one key among them.
            let mine = &wanted[r];
            let mut bufs: Vec<Vec<u8>> = mine.iter().map(|(_, reg)| vec![0xAA; (reg.numel() * esz) as usize]).collect();
            let mut req = LoadRequest {
                tensors: mine
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|((k, reg), buf)| TensorRequest {
                        tensor: sharded(*k, &case.shapes[*k], reg.clone(), case.dtype),
                        data: buf,
                        allow_shape_mismatch: false,
                        allow_dtype_cast: false,
                    })
                    .collect(),
                ..Default::default()
            };
            match Engine::new(c).load(storage.as_ref(), &mut req, &opts) {
                Err(e) if check => return vec![format!("rank {r}: load: {e}")],
                Err(_) => return Vec::new(),
                Ok(_) if !check => return vec![format!("rank {r}: loaded a checkpoint with a flipped byte")],
                Ok(_) => {}
            }
            drop(req);
            let wrong =
                mine.iter().zip(&bufs).filter(|((k, reg), buf)| **buf != bytes_of(*k, &case.shapes[*k], reg, esz));
            wrong.map(|((k, reg), _)| format!("rank {r}: key {} region {reg}: wrong bytes", KEYS[*k])).collect()
        })
        .concat()
    };
    let failures = load(true);
    prop_assert!(failures.is_empty(), "{failures:#?}");
    // The loaders ask for every stored byte between them, so a flipped one fails every rank.
    let meta = dckpt_engine::read_metadata_local(storage.as_ref()).expect("metadata");
    let f = &meta.files[case.flip.0 % meta.files.len()];
    if f.bytes > f.data_start {
        let mut bytes = storage.get(&f.name).expect("data file").to_vec();
        let at = f.data_start + case.flip.1 % (f.bytes - f.data_start);
        bytes[at as usize] ^= 0x10;
        storage.put(&f.name, bytes.into()).expect("put");
        let failures = load(false);
        prop_assert!(failures.is_empty(), "byte {at} of {}: {failures:#?}", f.name);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn any_layout_loads_into_any_other(case in case()) {
        run(&case)?;
    }
}
