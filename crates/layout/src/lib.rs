//! Parallel-layout math and the reference GPT / MoE model.
//!
//! This crate owns:
//! - [`ParallelConfig`] (tp, pp, cp, ep, etp) placed on a world as a [`Layout`], with data
//!   parallel sizes derived (`dp = world / (tp*pp*cp)`, `expert_dp = world / (etp*ep*pp)`),
//!   and rank <-> coordinates in the dense (`tp-cp-ep-dp-pp`) and expert (`etp-ep-edp-pp`)
//!   views, the order being a parameter ([`RankOrder`]);
//! - the builders that give a tensor its region and replica id per parallel dimension
//!   ([`chunk`], [`glu_chunks`], [`local_params`]);
//! - optimizer-state sharding: `adam` (like the parameter), `distributed` (ZeRO-1 flat
//!   buffers per DP group) and `layerwise` (whole parameters dealt out in snake order);
//! - the reference model ([`ModelSpec`], [`PRESETS`], [`ReferenceModel`]) producing every
//!   rank's sharded state, its declared global tensors, and — by a separate closed-form
//!   formula — the bytes it occupies, so that a plan can be checked against them.
//!
//! It does no IO and has no async; it depends on `dckpt-shard-spec` only. A rank that
//! holds nothing (a layerwise rank dealt no parameter) gets an empty list from the same
//! code as any other rank.
//!
//! ```
//! use dckpt_layout::{Layout, ModelSpec, OptimizerMode, ParallelConfig, ReferenceModel};
//!
//! let layout = Layout::new(ParallelConfig { tp: 2, pp: 2, ep: 2, etp: 2, ..Default::default() }, 8).unwrap();
//! let model = ReferenceModel::new(ModelSpec::preset("tiny").unwrap(), layout, OptimizerMode::Distributed).unwrap();
//! assert_eq!((layout.dp, layout.expert_dp), (2, 1));
//! let state = model.rank_state(5);
//! assert!(state.iter().any(|t| t.key.ends_with("mlp.experts.linear_fc1.weight")));
//! ```

mod model;
mod parallel;
mod state;
pub mod synthetic;

use std::fmt;
use std::str::FromStr;

use dckpt_shard_spec::{ShardedTensor, TensorDecl};
use serde::{Deserialize, Serialize};

pub use model::{ModelSpec, PRESETS, ParamDef, Split, declared_tensors, optimizer_keys, params};
pub use parallel::{DenseCoord, Dim, ExpertCoord, Layout, ParallelConfig, RankOrder};
pub use state::{LocalParam, chunk, glu_chunks, local_params, rank_state, snake_owner};
pub use synthetic::Synthetic;

/// How optimizer state is kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerMode {
    /// Parameters only.
    None,
    /// fp32 master weights and both Adam moments, sharded like each parameter.
    Adam,
    /// ZeRO-1: the same state as flat slices of each DP group's buffer.
    #[default]
    Distributed,
    /// Whole parameters' state dealt out over each DP group's ranks.
    Layerwise,
}

impl OptimizerMode {
    pub const ALL: [OptimizerMode; 4] =
        [OptimizerMode::None, OptimizerMode::Adam, OptimizerMode::Distributed, OptimizerMode::Layerwise];

    pub fn name(self) -> &'static str {
        match self {
            OptimizerMode::None => "none",
            OptimizerMode::Adam => "adam",
            OptimizerMode::Distributed => "distributed",
            OptimizerMode::Layerwise => "layerwise",
        }
    }
}

impl fmt::Display for OptimizerMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OptimizerMode {
    type Err = LayoutError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        OptimizerMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| LayoutError::UnknownOptimizer { name: s.to_string() })
    }
}

/// An invalid layout or model; each message says what to change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    #[error("{name} must be at least 1")]
    ZeroSize { name: &'static str },
    #[error("world size {world} is not divisible by {what} = {product}; use a multiple of {product}")]
    WorldNotDivisible { world: u32, product: u64, what: &'static str },
    #[error("rank order {order:?} is not a permutation of tp, cp, ep, dp, pp (e.g. tp-cp-ep-dp-pp)")]
    BadOrder { order: String },
    #[error(
        "rank order {order} puts a rank on different pipeline stages in the dense and expert views; \
         move pp to the end (e.g. tp-cp-ep-dp-pp)"
    )]
    PipelineViewsDisagree { order: String },
    #[error("unknown optimizer {name:?}; expected none, adam, distributed or layerwise")]
    UnknownOptimizer { name: String },
    #[error("model does not fit the layout: {reason}")]
    Model { reason: String },
    #[error("unknown model preset {name:?}; expected one of tiny, gpt-small, moe-small, moe-xl, or a JSON file")]
    UnknownPreset { name: String },
}

/// The reference model placed on a layout with an optimizer mode.
#[derive(Clone, Debug)]
pub struct ReferenceModel {
    pub spec: ModelSpec,
    pub layout: Layout,
    pub optimizer: OptimizerMode,
    params: Vec<ParamDef>,
}

impl ReferenceModel {
    pub fn new(spec: ModelSpec, layout: Layout, optimizer: OptimizerMode) -> Result<ReferenceModel, LayoutError> {
        spec.check(&layout)?;
        let params = params(&spec, &layout);
        Ok(ReferenceModel { spec, layout, optimizer, params })
    }

    /// Every parameter, with the stage that holds it.
    pub fn params(&self) -> &[ParamDef] {
        &self.params
    }

    /// The sharded state of one rank.
    pub fn rank_state(&self, rank: u32) -> Vec<ShardedTensor> {
        rank_state(&self.params, &self.layout, self.spec.dtype, self.optimizer, rank)
    }

    /// The model's global tensors, sorted by key.
    pub fn declared_tensors(&self) -> Vec<TensorDecl> {
        declared_tensors(&self.spec, &self.layout, self.optimizer)
    }

    /// Whether `key` (a parameter or its optimizer state) has a global shape that depends
    /// on tp through vocabulary padding; loading it at another tp needs a shape mismatch
    /// allowed.
    pub fn vocab_padded(key: &str) -> bool {
        key.ends_with("embedding.word_embeddings.weight") || key.ends_with("output_layer.weight")
    }

    /// Bytes of parameters and optimizer state, from the closed-form formula.
    pub fn expected_bytes(&self) -> u64 {
        self.spec.expected_bytes(self.layout.config.tp, self.optimizer)
    }
}
