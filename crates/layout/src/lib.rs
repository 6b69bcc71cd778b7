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

#![warn(missing_docs)]

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
    /// Every mode, in the order the CLI lists them.
    pub const ALL: [OptimizerMode; 4] =
        [OptimizerMode::None, OptimizerMode::Adam, OptimizerMode::Distributed, OptimizerMode::Layerwise];

    /// The mode's name on the command line and in JSON.
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
    /// A parallel size or the world size is 0.
    #[error("{name} must be at least 1")]
    ZeroSize {
        /// The size that is 0: `world`, `tp`, `pp`, `cp`, `ep` or `etp`.
        name: &'static str,
    },
    #[error("world size {world} is not divisible by {what} = {product}; use a multiple of {product}")]
    /// The world size is not a multiple of the ranks one model replica spans in a view.
    WorldNotDivisible {
        /// The world size asked for.
        world: u32,
        /// The product of the view's sizes that must divide it.
        product: u64,
        /// Which product: `tp * pp * cp` (dense view) or `etp * ep * pp` (expert view).
        what: &'static str,
    },
    #[error("rank order {order:?} is not a permutation of tp, cp, ep, dp, pp (e.g. tp-cp-ep-dp-pp)")]
    /// A rank order that does not name each of tp, cp, ep, dp, pp exactly once.
    BadOrder {
        /// The order as given.
        order: String,
    },
    #[error(
        "rank order {order} puts a rank on different pipeline stages in the dense and expert views; \
         move pp to the end (e.g. tp-cp-ep-dp-pp)"
    )]
    /// A rank order under which a rank's pipeline stage in the dense view differs from
    /// its stage in the expert view.
    PipelineViewsDisagree {
        /// The order, written `tp-cp-ep-dp-pp` style.
        order: String,
    },
    #[error("unknown optimizer {name:?}; expected none, adam, distributed or layerwise")]
    /// An optimizer name that is not one of [`OptimizerMode::ALL`].
    UnknownOptimizer {
        /// The name as given.
        name: String,
    },
    #[error("model does not fit the layout: {reason}")]
    /// A model spec that is inconsistent on its own or does not divide over the layout.
    Model {
        /// What is wrong and what to change.
        reason: String,
    },
    #[error("unknown model preset {name:?}; expected one of tiny, gpt-small, moe-small, moe-xl, or a JSON file")]
    /// A model name that is neither one of [`PRESETS`] nor a JSON file.
    UnknownPreset {
        /// The name as given.
        name: String,
    },
}

/// The reference model placed on a layout with an optimizer mode.
#[derive(Clone, Debug)]
pub struct ReferenceModel {
    /// The model's shape.
    pub spec: ModelSpec,
    /// The parallel layout it is placed on.
    pub layout: Layout,
    /// Which optimizer state each rank holds besides its parameters.
    pub optimizer: OptimizerMode,
    params: Vec<ParamDef>,
}

impl ReferenceModel {
    /// Places `spec` on `layout`; fails if the model does not divide over it
    /// ([`ModelSpec::check`]).
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
