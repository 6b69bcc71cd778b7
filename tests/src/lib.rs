//! Harness for cross-crate scenarios: ranks as threads, the reference model saved in one
//! layout and loaded in another, every element checked.
//!
//! The scenarios themselves live in `tests/tests/it/` (one test binary), and in
//! `tests/tests/format.rs` and `metadata_memory.rs` (one each, for their global allocators).

mod hooked;

pub use hooked::{Call, Hooked, hooked};

use std::collections::HashMap;
use std::sync::Arc;

use dckpt_collective::{Collective, CollectiveOptions, ThreadGroup};
use dckpt_engine::{Engine, KeyPolicy, LoadOptions, SaveOptions, SaveOutcome, read_metadata_local};
use dckpt_layout::{Layout, ModelSpec, OptimizerMode, ParallelConfig, ReferenceModel, Synthetic};
use dckpt_reference::{RankState, save_options};
use dckpt_storage::Storage;

/// Runs `f(rank, collective)` on `world` threads and returns the results in rank order.
pub fn run_ranks<T: Send>(world: usize, f: impl Fn(usize, Arc<dyn Collective>) -> T + Sync) -> Vec<T> {
    let opts = CollectiveOptions { timeout: std::time::Duration::from_secs(60), ..CollectiveOptions::default() };
    ThreadGroup::run(world, &opts, |r, c| f(r, Arc::new(c))).expect("thread group")
}

/// A layout of a model: `(world, tp, pp, cp, ep, etp, optimizer)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setup {
    pub world: u32,
    pub tp: u32,
    pub pp: u32,
    pub cp: u32,
    pub ep: u32,
    pub etp: u32,
    pub optimizer: OptimizerMode,
}

impl Setup {
    pub fn new(world: u32, tp: u32, pp: u32, cp: u32, ep: u32, etp: u32, optimizer: OptimizerMode) -> Setup {
        Setup { world, tp, pp, cp, ep, etp, optimizer }
    }

    pub fn model(&self, spec: &ModelSpec) -> ReferenceModel {
        let c = ParallelConfig { tp: self.tp, pp: self.pp, cp: self.cp, ep: self.ep, etp: self.etp };
        let layout = Layout::new(c, self.world).unwrap_or_else(|e| panic!("{self:?}: {e}"));
        ReferenceModel::new(spec.clone(), layout, self.optimizer).unwrap_or_else(|e| panic!("{self:?}: {e}"))
    }
}

/// Saves `model` filled with `seed`'s values; every rank's outcome.
pub fn save_model(
    storage: &Arc<dyn Storage>,
    model: &ReferenceModel,
    seed: u64,
) -> Vec<dckpt_engine::Result<SaveOutcome>> {
    save_model_with(storage, model, seed, &save_options(model))
}

/// Saves `model` with explicit options.
pub fn save_model_with(
    storage: &Arc<dyn Storage>,
    model: &ReferenceModel,
    seed: u64,
    opts: &SaveOptions,
) -> Vec<dckpt_engine::Result<SaveOutcome>> {
    let values = Synthetic::new(seed);
    run_ranks(model.layout.world_size as usize, |r, c| {
        let engine = Engine::new(c);
        let state = RankState::filled(model, r as u32, values);
        engine.save(storage.as_ref(), &state.save_state(), opts)
    })
}

/// Loads into `model`'s layout and checks every element; elements checked per rank.
pub fn load_and_check(storage: &Arc<dyn Storage>, model: &ReferenceModel, seed: u64) -> Vec<Result<u64, String>> {
    load_and_check_with(storage, model, seed, &LoadOptions::default())
}

/// Like [`load_and_check`] with explicit load options.
pub fn load_and_check_with(
    storage: &Arc<dyn Storage>,
    model: &ReferenceModel,
    seed: u64,
    opts: &LoadOptions,
) -> Vec<Result<u64, String>> {
    let values = Synthetic::new(seed);
    let saved: HashMap<String, dckpt_shard_spec::Dims> = match read_metadata_local(storage.as_ref()) {
        Ok(m) => m.tensors.into_iter().map(|t| (t.key, t.global_shape)).collect(),
        Err(e) => return vec![Err(e.to_string())],
    };
    run_ranks(model.layout.world_size as usize, |r, c| {
        let engine = Engine::new(c);
        let mut state = RankState::empty(model, r as u32);
        state.load(&engine, storage.as_ref(), opts).map_err(|e| format!("rank {r}: {e}"))?;
        state.check(values, &saved).map_err(|e| format!("rank {r}: {e}"))
    })
}

/// Saves at `from`, loads at `to`, checks every element; panics with the pair on failure.
/// Loading without optimizer state from a checkpoint that has it ignores those keys.
/// Checksum blocks and staging reads are tiny so that every read path (whole pieces,
/// partial pieces over many blocks, several staging windows) runs.
pub fn reshard(storage: &Arc<dyn Storage>, spec: &ModelSpec, from: Setup, to: Setup, seed: u64) -> u64 {
    let (m1, m2) = (from.model(spec), to.model(spec));
    let save_opts = SaveOptions { block_bytes: 256, ..save_options(&m1) };
    for (r, o) in save_model_with(storage, &m1, seed, &save_opts).into_iter().enumerate() {
        let o = o.unwrap_or_else(|e| panic!("{from:?} -> {to:?}: save on rank {r}: {e}"));
        assert_eq!(o.bytes, m1.expected_bytes(), "{from:?}: bytes written");
    }
    let mut opts = LoadOptions { read_bytes_max: 1000, ..LoadOptions::default() };
    if to.optimizer == OptimizerMode::None {
        opts.strictness.unexpected = KeyPolicy::Ignore;
    }
    let mut elements = 0;
    for r in load_and_check_with(storage, &m2, seed, &opts) {
        elements += r.unwrap_or_else(|e| panic!("{from:?} -> {to:?}: {e}"));
    }
    elements
}

/// `inner` asking its callers for reads of about `bytes` at a time, so that loads of small
/// test states go through many read windows.
pub fn windowed(inner: Arc<dyn Storage>, bytes: u64) -> Arc<dyn Storage> {
    let config = dckpt_storage::FaultConfig { read_window: Some(bytes), ..Default::default() };
    Arc::new(dckpt_storage::FaultStorage::new(inner, config))
}

/// `inner` asking writers to keep objects within `bytes` (as an object store does), so that
/// saves of small test states spread each rank's pieces over many data files.
pub fn objects_of_at_most(inner: Arc<dyn Storage>, bytes: u64) -> Arc<dyn Storage> {
    let config = dckpt_storage::FaultConfig { object_bytes_max: Some(bytes), ..Default::default() };
    Arc::new(dckpt_storage::FaultStorage::new(inner, config))
}

/// A local store in `dir` that reads in place, as the CLI opens one: inspected reads come
/// out of mappings of the files, and a load picks partial blocks out of whole ones.
pub fn in_place(dir: &std::path::Path) -> Arc<dyn Storage> {
    let local = dckpt_storage::LocalConfig { mapped_reads: true, ..Default::default() };
    let options = dckpt_storage::OpenOptions { local, ..Default::default() };
    dckpt_storage::open_with(dir.to_str().expect("a UTF-8 path"), &options).expect("open a local store")
}

/// A fresh in-memory store.
pub fn memory() -> Arc<dyn Storage> {
    Arc::new(dckpt_storage::MemoryStorage::new())
}
