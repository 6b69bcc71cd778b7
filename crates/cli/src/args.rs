//! Arguments shared by several subcommands: the model and its parallel layout.

use std::path::Path;

use anyhow::{Context, Result};
use clap::Args;
use dckpt::layout::{Layout, LayoutError, ModelSpec, OptimizerMode, ParallelConfig, RankOrder, ReferenceModel};
use dckpt::spec::DType;
use serde::Serialize;

/// The reference model: a preset or a spec file, optionally in another parameter dtype.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// A preset (tiny, gpt-small, moe-small, moe-xl) or a JSON model spec file.
    #[arg(long, default_value = "moe-small")]
    pub model: String,
    /// Parameter dtype instead of the model's: bf16, fp16 or fp32, by any of their common
    /// names (bfloat16, float16, float32, torch.float32, ...); a spec file's "dtype" takes
    /// the same names.
    #[arg(long, value_name = "NAME")]
    pub dtype: Option<DType>,
}

impl ModelArgs {
    pub fn spec(&self) -> Result<ModelSpec> {
        let mut spec = load_model(&self.model)?;
        if let Some(d) = self.dtype {
            spec.dtype = d;
        }
        Ok(spec)
    }
}

/// The most ranks a layout of the command line may have: four times the 16,384 dckpt is
/// built and measured for. `plan` and `demo` hold every rank's pieces at once (16 KB a rank
/// for the tiny model's plan), so a mistyped world aborted on memory or ran for hours.
pub const WORLD_MAX: u32 = 1 << 16;

/// Parses a world size of 1 to [`WORLD_MAX`] ranks.
pub fn parse_world(s: &str) -> Result<u32, String> {
    let n: u32 = s.parse().map_err(|e| format!("{e}"))?;
    match n {
        1..=WORLD_MAX => Ok(n),
        _ => Err(format!("a world of 1 to {WORLD_MAX} ranks")),
    }
}

/// A parallel layout of the reference model. Sizes not given are 1 (Megatron's convention).
#[derive(Debug, Clone, Args)]
pub struct LayoutArgs {
    /// Number of ranks (at most 65536).
    #[arg(long, value_name = "N", value_parser = parse_world)]
    pub world: u32,
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tp: u32,
    /// Pipeline-parallel size.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub pp: u32,
    /// Context-parallel size.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub cp: u32,
    /// Expert-parallel size.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub ep: u32,
    /// Expert-tensor-parallel size.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub etp: u32,
    /// Optimizer state: none, adam, distributed (ZeRO-1 flat buffers) or layerwise.
    #[arg(long, default_value = "distributed", value_parser = parse_optimizer)]
    pub optimizer: OptimizerMode,
    /// Rank order, fastest-varying first (Megatron's default).
    #[arg(long, default_value = "tp-cp-ep-dp-pp", value_parser = parse_order)]
    pub order: RankOrder,
}

impl LayoutArgs {
    pub fn config(&self) -> ParallelConfig {
        ParallelConfig { tp: self.tp, pp: self.pp, cp: self.cp, ep: self.ep, etp: self.etp }
    }

    /// The reference model on this layout; every inconsistency is an error saying what to change.
    pub fn model(&self, spec: ModelSpec) -> Result<ReferenceModel> {
        let layout = Layout::with_order(self.config(), self.world, self.order)?;
        Ok(ReferenceModel::new(spec, layout, self.optimizer)?)
    }
}

pub fn parse_optimizer(s: &str) -> Result<OptimizerMode, String> {
    s.parse().map_err(|e: LayoutError| e.to_string())
}

fn parse_order(s: &str) -> Result<RankOrder, String> {
    s.parse().map_err(|e: LayoutError| e.to_string())
}

/// A preset name, or a path to a JSON model spec.
fn load_model(model: &str) -> Result<ModelSpec> {
    if let Some(spec) = ModelSpec::preset(model) {
        return Ok(spec);
    }
    let path = Path::new(model);
    if !path.exists() {
        return Err(LayoutError::UnknownPreset { name: model.to_string() }.into());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading model spec {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("model spec {}", path.display()))
}

/// A layout as reports show it (flattened into `dckpt plan --json`, nested in `dckpt demo --json`).
#[derive(Debug, Clone, Serialize)]
pub struct LayoutSummary {
    pub world_size: u32,
    pub tp: u32,
    pub pp: u32,
    pub cp: u32,
    pub ep: u32,
    pub etp: u32,
    pub dp: u32,
    pub expert_dp: u32,
    pub optimizer: String,
}

impl LayoutSummary {
    pub fn of(m: &ReferenceModel) -> LayoutSummary {
        let c = m.layout.config;
        LayoutSummary {
            world_size: m.layout.world_size,
            tp: c.tp,
            pp: c.pp,
            cp: c.cp,
            ep: c.ep,
            etp: c.etp,
            dp: m.layout.dp,
            expert_dp: m.layout.expert_dp,
            optimizer: m.optimizer.to_string(),
        }
    }

    pub fn line(&self) -> String {
        format!(
            "{} ranks: tp {} pp {} cp {} ep {} etp {} (dp {}, expert-dp {}), {} optimizer",
            self.world_size, self.tp, self.pp, self.cp, self.ep, self.etp, self.dp, self.expert_dp, self.optimizer
        )
    }
}
