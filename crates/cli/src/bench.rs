//! `dckpt bench`: measurements reported as ratios to ceilings measured in the same run.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use dckpt_engine::{Assignment, LocalPlan, plan_save};
use dckpt_layout::{Layout, ModelSpec, OptimizerMode, ParallelConfig, ReferenceModel};
use serde::Serialize;

use crate::fmt;

/// Run benchmarks. Figures without a ceiling (plan time, memory) are reported as measured.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Which benchmark: plan, or all.
    #[arg(default_value = "all")]
    pub name: String,
    /// Print one JSON array of {name, value, ceiling, ratio, note} instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One measured figure.
#[derive(Debug, Serialize)]
pub struct Figure {
    pub name: &'static str,
    pub value: Option<f64>,
    pub ceiling: Option<f64>,
    pub ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Figure {
    fn plain(name: &'static str, value: f64, note: impl Into<String>) -> Figure {
        Figure { name, value: Some(value), ceiling: None, ratio: None, note: Some(note.into()) }
    }
}

pub fn run(a: &BenchArgs) -> Result<ExitCode> {
    let mut figures = Vec::new();
    match a.name.as_str() {
        "plan" | "all" => figures.extend(bench_plan()?),
        other => bail!("unknown benchmark {other:?}; expected plan or all"),
    }
    if a.json {
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&figures)?));
    } else {
        let mut out = format!("{:<28} {:>16} {:>16} {:>8}  note\n", "figure", "value", "ceiling", "ratio");
        for f in &figures {
            let num = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
            out.push_str(&format!(
                "{:<28} {:>16} {:>16} {:>8}  {}\n",
                f.name,
                num(f.value),
                num(f.ceiling),
                num(f.ratio),
                f.note.as_deref().unwrap_or("")
            ));
        }
        fmt::emit(&out);
    }
    Ok(ExitCode::SUCCESS)
}

/// Plan and validate `moe-xl` on 16,384 ranks (tp 8, pp 16, ep 64, distributed optimizer):
/// the coordinator's work at the scale of a large training job.
fn bench_plan() -> Result<Vec<Figure>> {
    let c = ParallelConfig { tp: 8, pp: 16, ep: 64, ..Default::default() };
    let layout = Layout::new(c, 16_384)?;
    let model = ReferenceModel::new(ModelSpec::preset("moe-xl").expect("preset"), layout, OptimizerMode::Distributed)?;
    let base_rss = peak_rss_bytes();
    let t0 = Instant::now();
    let locals: Vec<LocalPlan> =
        (0..16_384).map(|r| LocalPlan { tensors: model.rank_state(r), objects: Vec::new() }).collect();
    let state_s = t0.elapsed().as_secs_f64();
    let entries: usize = locals.iter().map(|l| l.tensors.len()).sum();
    let t1 = Instant::now();
    let plan = plan_save(&locals, Some(&model.declared_tensors()), Assignment::Balanced)?;
    let plan_s = t1.elapsed().as_secs_f64();
    let peak = peak_rss_bytes();
    if plan.total_bytes() != model.expected_bytes() {
        bail!("moe-xl plan writes {} bytes, model has {}", plan.total_bytes(), model.expected_bytes());
    }
    Ok(vec![
        Figure::plain(
            "plan_xl_seconds",
            plan_s,
            format!(
                "moe-xl, 16384 ranks, {} shard entries -> {} chunks ({} written); building the states took {state_s:.2} s more",
                entries,
                plan.chunks.len(),
                fmt::bytes(plan.total_bytes())
            ),
        ),
        Figure::plain(
            "plan_xl_peak_bytes",
            peak as f64,
            format!("peak RSS of the process ({} before building the states)", fmt::bytes(base_rss)),
        ),
    ])
}

/// The process's peak resident set (VmHWM), or 0 where /proc is not available.
pub fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
