//! A small hand-built sharded state for byte-level tests: every shard is a contiguous slice
//! of its tensor's global bytes, so a loaded tensor is checked by one comparison.
//! Shared by `corruption.rs` and `crash.rs`.

#![allow(dead_code)]

use std::sync::Arc;

use dckpt_collective::Collective;
use dckpt_engine::{
    Engine, LoadOptions, LoadRequest, ObjectData, ObjectRequest, SaveOptions, SaveOutcome, SaveState, TensorData,
    TensorRequest,
};
use dckpt_shard_spec::{DType, Region, ReplicaId, ShardedObject, ShardedTensor};
use dckpt_storage::Storage;

/// A global tensor and its bytes, split by rows (or flat ranges) over the ranks.
#[derive(Debug)]
pub struct Global {
    pub key: &'static str,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
    /// Split as flat ranges of the whole box instead of row blocks.
    pub flat: bool,
}

#[derive(Debug)]
pub struct Handmade {
    pub world: usize,
    pub tensors: Vec<Global>,
    /// One object per rank under key `rng`, grid `[world]`.
    pub objects: Vec<Vec<u8>>,
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    (0..n as u64).map(|i| (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(97)) as u8).collect()
}

impl Handmade {
    /// Tensors of several dtypes, some split by rows and one by flat ranges; rank
    /// `world - 1` holds only a small slice of each so files differ in size.
    pub fn new(world: usize, seed: u64) -> Handmade {
        let mk = |key, dtype: DType, shape: Vec<u64>, flat| {
            let n = (shape.iter().product::<u64>() * dtype.size()) as usize;
            let bytes = pattern(seed ^ key_seed(key), n);
            Global { key, dtype, shape, bytes, flat }
        };
        let rows = 2 * world as u64 + 1;
        Handmade {
            world,
            tensors: vec![
                mk("decoder.a.weight", DType::F32, vec![rows, 6], false),
                mk("decoder.b.bias", DType::Bf16, vec![3, 5], true),
                mk("embedding.c", DType::U8, vec![rows * 5, 10], false),
            ],
            objects: (0..world).map(|r| format!("rng state of rank {r}").into_bytes()).collect(),
        }
    }

    /// `rank`'s pieces: `(tensor, byte range of the global buffer)`.
    pub fn pieces(&self, rank: usize) -> Vec<(ShardedTensor, std::ops::Range<usize>)> {
        self.tensors
            .iter()
            .map(|g| {
                let (region, range) = split(g, rank, self.world);
                let t = ShardedTensor {
                    key: g.key.into(),
                    dtype: g.dtype,
                    global_shape: g.shape.clone().into(),
                    region,
                    replica_id: ReplicaId::MAIN,
                };
                (t, range)
            })
            .collect()
    }

    fn object(&self, rank: usize) -> ShardedObject {
        ShardedObject {
            key: "rng".into(),
            grid_shape: vec![self.world as u64],
            grid_offset: vec![rank as u64],
            replica_id: ReplicaId::MAIN,
        }
    }

    /// Saves `rank`'s state.
    pub fn save(
        &self,
        engine: &Engine,
        storage: &dyn Storage,
        rank: usize,
        opts: &SaveOptions,
    ) -> dckpt_engine::Result<SaveOutcome> {
        let pieces = self.pieces(rank);
        let state = SaveState {
            tensors: pieces
                .iter()
                .zip(&self.tensors)
                .map(|((t, range), g)| TensorData { tensor: t.clone(), data: &g.bytes[range.clone()] })
                .collect(),
            objects: vec![ObjectData {
                object: self.object(rank),
                data: &self.objects[rank],
                compare: Default::default(),
            }],
        };
        engine.save(storage, &state, opts)
    }

    /// Saves on `world` threads over `storage`; every rank's outcome.
    pub fn save_all(&self, storage: &Arc<dyn Storage>, opts: &SaveOptions) -> Vec<dckpt_engine::Result<SaveOutcome>> {
        dckpt_tests::run_ranks(self.world, |r, c| self.save(&Engine::new(c), storage.as_ref(), r, opts))
    }

    /// Loads every tensor whole and every object on one rank and compares with the
    /// original bytes: `Ok` only when everything is bit-exact.
    pub fn load_check(&self, storage: &Arc<dyn Storage>, coll: Arc<dyn Collective>) -> Result<(), String> {
        let engine = Engine::new(coll);
        let mut bufs: Vec<Vec<u8>> = self.tensors.iter().map(|g| vec![0xAA; g.bytes.len()]).collect();
        let mut req = LoadRequest {
            tensors: self
                .tensors
                .iter()
                .zip(bufs.iter_mut())
                .map(|(g, b)| TensorRequest {
                    tensor: ShardedTensor {
                        key: g.key.into(),
                        dtype: g.dtype,
                        global_shape: g.shape.clone().into(),
                        region: Region::full(&g.shape),
                        replica_id: ReplicaId::MAIN,
                    },
                    data: b,
                    allow_shape_mismatch: false,
                    allow_dtype_cast: false,
                })
                .collect(),
            objects: (0..self.world).map(|r| ObjectRequest { object: self.object(r), data: None }).collect(),
            check_objects: None,
        };
        engine.load(storage.as_ref(), &mut req, &LoadOptions::default()).map_err(|e| e.to_string())?;
        let objects: Vec<Option<Vec<u8>>> = req.objects.into_iter().map(|o| o.data).collect();
        drop(req.tensors);
        for (g, b) in self.tensors.iter().zip(&bufs) {
            if let Some(i) = g.bytes.iter().zip(b).position(|(x, y)| x != y) {
                return Err(format!("WRONG DATA: {} differs at byte {i}", g.key));
            }
        }
        for (r, o) in objects.iter().enumerate() {
            if o.as_deref() != Some(&self.objects[r][..]) {
                return Err(format!("WRONG DATA: object rng[{r}] is {o:?}"));
            }
        }
        Ok(())
    }

    /// [`Handmade::load_check`] on one thread rank.
    pub fn load_check1(&self, storage: &Arc<dyn Storage>) -> Result<(), String> {
        dckpt_tests::run_ranks(1, |_, c| self.load_check(storage, c)).pop().expect("one rank")
    }
}

fn key_seed(key: &str) -> u64 {
    key.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
}

/// Rank `r`'s part of `g`: ranks `0..world-1` share all but one row (or element), the last
/// rank takes that one.
fn split(g: &Global, r: usize, world: usize) -> (Region, std::ops::Range<usize>) {
    let esz = g.dtype.size();
    if g.flat {
        let n: u64 = g.shape.iter().product();
        let (lo, hi) = share(n, r, world);
        let region = Region::full(&g.shape).narrowed(lo, hi);
        return (region, (lo * esz) as usize..(hi * esz) as usize);
    }
    let row: u64 = g.shape[1..].iter().product::<u64>() * esz;
    let (lo, hi) = share(g.shape[0], r, world);
    let mut offset = vec![0; g.shape.len()];
    offset[0] = lo;
    let mut shape = g.shape.clone();
    shape[0] = hi - lo;
    (Region::boxed(offset, shape), (lo * row) as usize..(hi * row) as usize)
}

/// `[lo, hi)` of `n` items for rank `r`: the last rank gets one item, the others share the rest.
fn share(n: u64, r: usize, world: usize) -> (u64, u64) {
    if world == 1 {
        return (0, n);
    }
    let rest = n - 1;
    let k = (world - 1) as u64;
    let r = r as u64;
    if r == k {
        return (rest, n);
    }
    (rest * r / k, rest * (r + 1) / k)
}
