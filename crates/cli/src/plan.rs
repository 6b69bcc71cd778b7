//! `dckpt plan`: a layout's save plan, without touching data.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use dckpt::ErrorKind;
use dckpt::engine::{Assignment, LocalPlan, SavePlan, plan_save, planned_metadata, preview_save};
use dckpt::layout::ReferenceModel;
use dckpt_reference::save_options;
use serde::Serialize;

use crate::args::{LayoutArgs, LayoutSummary, ModelArgs};
use crate::fmt;

/// Show which rank writes what of a model on a layout, and the exact-once proof.
///
/// Show the save plan of a model on a parallel layout: which rank writes what, how many
/// bytes, and the proof that every element of every tensor is stored exactly once.
///
/// Exits 0 when coverage holds and the plan writes exactly the model's bytes, 1 when the
/// plan was computed but fails either (the report says why), 2 when the layout is invalid.
///
/// Parallel sizes not given are 1 (Megatron's convention): `--world 8 --ep 4` is tp 1,
/// pp 1, cp 1, ep 4, etp 1 (dp 8, expert-dp 2).
#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Writer choice: balanced (spread replicated chunks evenly) or replica0 (main replica writes).
    #[arg(long, default_value = "balanced")]
    pub assign: Assignment,
    /// Deliberately break the state the way a known field bug did, to see the guard catch it:
    /// etp-replica-ids (non-zero ETP ranks marked as replicas) or etp-region (ETP coordinate
    /// dropped from expert regions).
    #[arg(long, value_name = "BUG")]
    pub inject: Option<Injection>,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Injection {
    EtpReplicaIds,
    EtpRegion,
}

#[derive(Debug, Serialize)]
struct RankRow {
    rank: u32,
    chunks: usize,
    bytes: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    /// The parameters' dtype (the canonical name, whatever name the spec used).
    dtype: String,
    #[serde(flatten)]
    layout: LayoutSummary,
    assignment: String,
    tensors: usize,
    chunks: usize,
    total_bytes: u64,
    expected_bytes: u64,
    /// Size of the metadata file this plan would commit (null for an invalid plan).
    metadata_bytes: Option<u64>,
    max_rank_bytes: u64,
    min_rank_bytes: u64,
    ranks: Vec<RankRow>,
    empty_ranks: Vec<u32>,
    valid: bool,
    problems: Vec<String>,
    state_seconds: f64,
    plan_seconds: f64,
}

pub fn run(a: &PlanArgs) -> Result<ExitCode> {
    let model = a.layout.model(a.model.spec()?)?;
    let t0 = Instant::now();
    let mut locals: Vec<LocalPlan> =
        (0..model.layout.world_size).map(|r| LocalPlan { tensors: model.rank_state(r), objects: Vec::new() }).collect();
    if let Some(bug) = a.inject {
        inject(&model, &mut locals, bug);
    }
    let state_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let declared = model.declared_tensors();
    let (plan, problems) = match plan_save(&locals, Some(&declared), a.assign) {
        Ok(p) => (p, Vec::new()),
        Err(err) => {
            let ErrorKind::InvalidState { error: e } = err.kind() else { return Err(err.into()) };
            let mut msgs: Vec<String> = e.problems.iter().map(|p| p.to_string()).collect();
            if e.more > 0 {
                msgs.push(format!("... and {} more problems", e.more));
            }
            (preview_save(&locals, a.assign), msgs)
        }
    };
    let plan_seconds = t1.elapsed().as_secs_f64();
    let report = report(a, &model, &plan, &locals, problems, state_seconds, plan_seconds);
    if a.json {
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&report)?));
    } else {
        fmt::emit(&human(&report));
    }
    if report.valid {
        return Ok(ExitCode::SUCCESS);
    }
    for p in &report.problems {
        eprintln!("dckpt plan: {p}");
    }
    if report.total_bytes != report.expected_bytes {
        eprintln!(
            "dckpt plan: the plan writes {} bytes but the model has {} bytes",
            report.total_bytes, report.expected_bytes
        );
    }
    Ok(ExitCode::from(1))
}

fn report(
    a: &PlanArgs,
    m: &ReferenceModel,
    plan: &SavePlan,
    locals: &[LocalPlan],
    problems: Vec<String>,
    state_seconds: f64,
    plan_seconds: f64,
) -> Report {
    let mut keys: Vec<&str> = locals.iter().flat_map(|l| l.tensors.iter().map(|t| t.key.as_str())).collect();
    keys.sort_unstable();
    keys.dedup();
    let expected = m.expected_bytes();
    let total = plan.total_bytes();
    Report {
        model: a.model.model.clone(),
        dtype: m.spec.dtype.to_string(),
        layout: LayoutSummary::of(m),
        assignment: plan.assignment.to_string(),
        tensors: keys.len(),
        chunks: plan.chunks.len() + plan.objects.len(),
        total_bytes: total,
        expected_bytes: expected,
        metadata_bytes: problems
            .is_empty()
            .then(|| planned_metadata(plan, &save_options(m), "0123456789abcdef", None).encode().len() as u64),
        max_rank_bytes: plan.max_rank_bytes(),
        min_rank_bytes: plan.ranks.iter().map(|r| r.bytes).min().unwrap_or(0),
        ranks: plan
            .ranks
            .iter()
            .enumerate()
            .map(|(r, w)| RankRow { rank: r as u32, chunks: w.chunks(), bytes: w.bytes })
            .collect(),
        empty_ranks: plan.empty_ranks(),
        valid: problems.is_empty() && total == expected,
        problems,
        state_seconds,
        plan_seconds,
    }
}

fn human(r: &Report) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(o, "{} ({}) on {}, assignment {}", r.model, r.dtype, r.layout.line(), r.assignment);
    let _ = writeln!(o, "  tensors      {} keys in {} distinct chunks", r.tensors, r.chunks);
    if let Some(m) = r.metadata_bytes {
        let per = m as f64 / r.chunks.max(1) as f64;
        let _ = writeln!(o, "  metadata     {} ({per:.0} bytes per chunk)", fmt::bytes(m));
    }
    let _ = writeln!(o, "  bytes        {}", fmt::written_vs_expected(r.total_bytes, r.expected_bytes));
    let mean = r.total_bytes as f64 / r.layout.world_size.max(1) as f64;
    let _ = writeln!(
        o,
        "  per rank     min {}, mean {}, max {} (max/mean {:.3})",
        fmt::bytes(r.min_rank_bytes),
        fmt::bytes(mean as u64),
        fmt::bytes(r.max_rank_bytes),
        if mean > 0.0 { r.max_rank_bytes as f64 / mean } else { 0.0 }
    );
    let empty = if r.empty_ranks.is_empty() { "none".to_string() } else { fmt::ranks(&r.empty_ranks, 12) };
    let _ = writeln!(o, "  empty ranks  {} of {}: {empty}", r.empty_ranks.len(), r.layout.world_size);
    let cov = if r.problems.is_empty() { "exact-once, checked against the model's declared tensors" } else { "FAILED" };
    let _ = writeln!(o, "  coverage     {cov}");
    let _ = writeln!(o, "  time         state {:.3} s, plan + validate {:.3} s", r.state_seconds, r.plan_seconds);
    if !r.valid {
        let _ = writeln!(o, "  INVALID: see the reasons on stderr");
    }
    o
}

/// Breaks the expert pieces of ranks whose ETP coordinate is not 0, as Megatron's ETP bug did.
fn inject(m: &ReferenceModel, locals: &mut [LocalPlan], bug: Injection) {
    let c = m.layout.config;
    for (rank, l) in locals.iter_mut().enumerate() {
        let etp = m.layout.expert_coord(rank as u32).etp;
        if etp == 0 {
            continue;
        }
        for t in l.tensors.iter_mut().filter(|t| t.key.contains("mlp.experts.")) {
            match bug {
                Injection::EtpReplicaIds => t.replica_id.tp = etp,
                Injection::EtpRegion => {
                    // Expert fc1/fc2 weights carry ETP on axis 1 / 2; fc2 bias has none.
                    let axis = if t.key.contains("linear_fc1") { 1 } else { 2 };
                    if axis < t.region.ndim() {
                        let chunk = m.spec.moe_ffn() / c.etp as u64;
                        t.region.offset[axis] -= etp as u64 * chunk;
                    }
                }
            }
        }
    }
}
