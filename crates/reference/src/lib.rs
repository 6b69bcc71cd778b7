//! The reference model through the engine: one rank's state filled with synthetic values,
//! saved, then loaded in any layout and checked element by element. Used by `dckpt demo`,
//! the cross-layout test matrix and the benchmarks; not part of the engine's API.

use std::collections::{BTreeMap, HashMap};

use dckpt::engine::Engine;
use dckpt::layout::{ReferenceModel, Synthetic};
use dckpt::{
    Dims, LoadOptions, LoadOutcome, LoadRequest, Result, SaveOptions, SaveOutcome, SaveState, ShardedTensor, Storage,
    TensorData, TensorRequest,
};

/// One rank's pieces of the reference model with their bytes.
#[derive(Debug)]
pub struct RankState {
    pub tensors: Vec<ShardedTensor>,
    pub buffers: Vec<Vec<u8>>,
}

impl RankState {
    /// `rank`'s pieces under `model`, filled with `values`.
    pub fn filled(model: &ReferenceModel, rank: u32, values: Synthetic) -> RankState {
        let tensors = model.rank_state(rank);
        let buffers = tensors
            .iter()
            .map(|t| {
                let mut b = vec![0u8; t.nbytes() as usize];
                values.fill(t, &mut b);
                b
            })
            .collect();
        RankState { tensors, buffers }
    }

    /// `rank`'s pieces under `model`, zeroed, ready to be loaded into.
    pub fn empty(model: &ReferenceModel, rank: u32) -> RankState {
        let tensors = model.rank_state(rank);
        let buffers = tensors.iter().map(|t| vec![0u8; t.nbytes() as usize]).collect();
        RankState { tensors, buffers }
    }

    pub fn bytes(&self) -> u64 {
        self.buffers.iter().map(|b| b.len() as u64).sum()
    }

    pub fn save_state(&self) -> SaveState<'_> {
        SaveState {
            tensors: self
                .tensors
                .iter()
                .zip(&self.buffers)
                .map(|(t, b)| TensorData { tensor: t.clone(), data: b })
                .collect(),
            objects: Vec::new(),
        }
    }

    /// A request for every piece, into this state's buffers; vocabulary-padded tensors
    /// accept another padded size.
    pub fn request(&mut self) -> LoadRequest<'_> {
        LoadRequest {
            tensors: self
                .tensors
                .iter()
                .zip(self.buffers.iter_mut())
                .map(|(t, b)| TensorRequest {
                    tensor: t.clone(),
                    data: b,
                    allow_shape_mismatch: ReferenceModel::vocab_padded(&t.key),
                    allow_dtype_cast: false,
                })
                .collect(),
            ..LoadRequest::default()
        }
    }

    /// Loads every piece ([`RankState::request`]).
    pub fn load(&mut self, engine: &Engine, storage: &dyn Storage, opts: &LoadOptions) -> Result<LoadOutcome> {
        let mut req = self.request();
        engine.load(storage, &mut req, opts)
    }

    /// Checks every loaded element against `values`, given the global shapes the
    /// checkpoint holds. Returns the number of elements checked.
    pub fn check(&self, values: Synthetic, saved_shapes: &HashMap<String, Dims>) -> std::result::Result<u64, String> {
        let mut n = 0;
        for (t, b) in self.tensors.iter().zip(&self.buffers) {
            let saved = saved_shapes
                .get(t.key.as_str())
                .ok_or_else(|| format!("tensor {:?} is not in the checkpoint", t.key))?;
            values.check(t, saved, b)?;
            n += t.region.numel();
        }
        Ok(n)
    }
}

/// The global shape of every tensor a save of `model` stores, by key: what
/// [`RankState::check`] takes for a checkpoint this model saved.
pub fn saved_shapes(model: &ReferenceModel) -> HashMap<String, Dims> {
    model.declared_tensors().into_iter().map(|t| (t.key.to_string(), t.global_shape)).collect()
}

/// Save options for the reference model: its declared tensors and its layout recorded.
pub fn save_options(model: &ReferenceModel) -> SaveOptions {
    let c = model.layout.config;
    let layout = BTreeMap::from([
        ("world_size".to_string(), model.layout.world_size.to_string()),
        ("tp".to_string(), c.tp.to_string()),
        ("pp".to_string(), c.pp.to_string()),
        ("cp".to_string(), c.cp.to_string()),
        ("ep".to_string(), c.ep.to_string()),
        ("etp".to_string(), c.etp.to_string()),
        ("dp".to_string(), model.layout.dp.to_string()),
        ("expert_dp".to_string(), model.layout.expert_dp.to_string()),
        ("optimizer".to_string(), model.optimizer.to_string()),
        ("order".to_string(), model.layout.order.to_string()),
    ]);
    SaveOptions { declared: Some(model.declared_tensors()), layout, ..SaveOptions::default() }
}

/// Saves `state` of the reference model.
pub fn save_reference(
    engine: &Engine,
    storage: &dyn Storage,
    model: &ReferenceModel,
    state: &RankState,
    replace: bool,
) -> Result<SaveOutcome> {
    let opts = SaveOptions { replace, ..save_options(model) };
    engine.save(storage, &state.save_state(), &opts)
}
