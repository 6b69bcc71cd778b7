//! Planning at the scale of a large job, and the size of its metadata.

use std::time::Instant;

use anyhow::{Result, bail};
use dckpt::engine::{LocalPlan, plan_save, planned_metadata};
use dckpt::layout::{Layout, ModelSpec, OptimizerMode, ParallelConfig, ReferenceModel};
use dckpt_reference::save_options;

use super::{Figure, peak_rss_bytes, reset_peak_rss, rss_bytes};
use crate::fmt;

/// Plan and validate `moe-xl` on 16,384 ranks (tp 8, pp 16, ep 64, distributed optimizer):
/// the coordinator's work at the scale of a large training job; then the metadata it commits.
pub fn figures() -> Result<Vec<Figure>> {
    let c = ParallelConfig { tp: 8, pp: 16, ep: 64, ..Default::default() };
    let layout = Layout::new(c, 16_384)?;
    let model = ReferenceModel::new(ModelSpec::preset("moe-xl").expect("preset"), layout, OptimizerMode::Distributed)?;
    let t0 = Instant::now();
    let locals: Vec<LocalPlan> =
        (0..16_384).map(|r| LocalPlan { tensors: model.rank_state(r), objects: Vec::new() }).collect();
    let state_s = t0.elapsed().as_secs_f64();
    let entries: usize = locals.iter().map(|l| l.tensors.len()).sum();
    let before = rss_bytes();
    let reset = reset_peak_rss();
    let opts = save_options(&model);
    let t1 = Instant::now();
    let plan = plan_save(&locals, opts.declared.as_deref(), opts.assignment)?;
    let plan_s = t1.elapsed().as_secs_f64();
    let peak = peak_rss_bytes();
    if plan.total_bytes() != model.expected_bytes() {
        bail!("moe-xl plan writes {} bytes, model has {}", plan.total_bytes(), model.expected_bytes());
    }
    let t2 = Instant::now();
    let meta = planned_metadata(&plan, &opts, "0123456789abcdef", None).encode();
    let meta_s = t2.elapsed().as_secs_f64();
    let chunks = plan.chunks.len() + plan.objects.len();
    let peak_note = if reset {
        format!("peak RSS while planning; the 16384 ranks' shard lists held before it took {}", fmt::bytes(before))
    } else {
        "peak RSS of the whole process (the peak could not be reset)".to_string()
    };
    Ok(vec![
        Figure::plain(
            "plan_xl_seconds",
            plan_s,
            format!(
                "moe-xl on 16384 ranks: {entries} shard entries -> {} chunks, {}; building the shard lists took \
                 {state_s:.2} s more; each rank is sent only its own write list (at most {} entries; {} for all ranks)",
                plan.chunks.len(),
                fmt::bytes(plan.total_bytes()),
                plan.ranks.iter().map(|r| r.chunks()).max().unwrap_or(0),
                plan.ranks.iter().map(|r| r.chunks()).sum::<usize>(),
            ),
        ),
        Figure::plain("plan_xl_peak_bytes", peak as f64, peak_note),
        Figure::plain(
            "metadata_bytes_per_chunk",
            meta.len() as f64 / chunks as f64,
            format!(
                "{} of metadata for {chunks} chunks in {} files, encoded in {meta_s:.2} s",
                fmt::bytes(meta.len() as u64),
                plan.ranks.iter().filter(|r| !r.is_empty()).count()
            ),
        ),
    ])
}
