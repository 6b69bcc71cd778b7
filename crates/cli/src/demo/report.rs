//! The demo's report: every rank's figures summed up, as JSON or as lines for a person.

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::Result;
use dckpt::Phases;
use serde::Serialize;

use super::ranks::{LoadRank, SaveRank};
use super::{Ctx, DemoArgs};
use crate::args::LayoutSummary;
use crate::fmt;

/// What `dckpt demo` prints: the save's and the load's figures and the check's verdict.
#[derive(Debug, Serialize)]
pub(super) struct Report {
    model: String,
    /// The parameters' dtype (the canonical name).
    dtype: String,
    dir: String,
    ranks_as: &'static str,
    seed: u64,
    #[serde(rename = "async")]
    asynchronous: bool,
    save_layout: LayoutSummary,
    load_layout: LayoutSummary,
    save_id: String,
    saved_bytes: u64,
    expected_bytes: u64,
    files: usize,
    chunks: usize,
    /// Bytes every save rank held (replicas included).
    state_bytes: u64,
    rank_bytes: Vec<u64>,
    empty_ranks: Vec<u32>,
    fill_seconds: f64,
    /// With --async: the longest time a rank was blocked copying its state.
    copy_seconds: Option<f64>,
    save_seconds: f64,
    save_gb_per_s: f64,
    load_state_bytes: u64,
    load_bytes_read: u64,
    load_seconds: f64,
    load_gb_per_s: f64,
    check_seconds: f64,
    elements_checked: u64,
    /// Each phase of the save and of the load: its slowest rank and that rank's seconds.
    save_phases: BTreeMap<&'static str, Phase>,
    load_phases: BTreeMap<&'static str, Phase>,
    #[serde(skip)]
    save_phase_line: String,
    #[serde(skip)]
    load_phase_line: String,
    verified: bool,
    problems: Vec<String>,
}

/// One phase's slowest rank.
#[derive(Debug, Clone, Copy, Serialize)]
struct Phase {
    rank: u32,
    seconds: f64,
}

fn phases(p: &dyn Phases) -> BTreeMap<&'static str, Phase> {
    p.each().into_iter().map(|(name, s)| (name, Phase { rank: s.rank, seconds: s.time.as_secs_f64() })).collect()
}

/// `plan 0.12 s (rank 3), write ...`, in the phases' own order.
fn phase_line(p: &dyn Phases) -> String {
    let each: Vec<String> =
        p.each().iter().map(|(name, s)| format!("{name} {:.2} s (rank {})", s.time.as_secs_f64(), s.rank)).collect();
    each.join(", ")
}

impl Report {
    /// Prints the report (JSON, one line when launched, or lines for a person) and the
    /// problems it found; exit 0 only when every element matched and every byte was saved.
    pub(super) fn emit(&self, json: bool, launched: bool) -> Result<ExitCode> {
        if json {
            let text = if launched { serde_json::to_string(self)? } else { serde_json::to_string_pretty(self)? };
            fmt::emit(&format!("{text}\n"));
        } else {
            fmt::emit(&human(self));
        }
        for p in &self.problems {
            eprintln!("dckpt demo: {p}");
        }
        Ok(if self.verified && self.saved_bytes == self.expected_bytes { ExitCode::SUCCESS } else { ExitCode::from(1) })
    }
}

pub(super) fn report(a: &DemoArgs, ctx: &Ctx, s: &[SaveRank], l: &[LoadRank], ranks_as: &'static str) -> Report {
    let o = &s[0].outcome;
    let max = |v: &mut dyn Iterator<Item = f64>| v.fold(0.0f64, f64::max);
    let save_seconds = max(&mut s.iter().map(|r| r.save_seconds));
    let load_seconds = max(&mut l.iter().map(|r| r.load_seconds));
    let load_bytes_read: u64 = l.iter().map(|r| r.bytes_read).sum();
    let rank_bytes: Vec<u64> = s.iter().map(|r| r.outcome.rank_bytes).collect();
    let mut problems: Vec<String> = l.iter().filter_map(|r| r.check.as_ref().err().cloned()).collect();
    let expected = ctx.save.expected_bytes();
    if o.bytes != expected {
        problems.push(format!("the save wrote {} bytes but the model has {expected} bytes", o.bytes));
    }
    let gbps = |b: u64, t: f64| if t > 0.0 { b as f64 / 1e9 / t } else { 0.0 };
    Report {
        model: a.model.model.clone(),
        dtype: ctx.save.spec.dtype.to_string(),
        dir: a.dir.clone(),
        ranks_as,
        seed: a.seed,
        asynchronous: a.asynchronous,
        save_layout: LayoutSummary::of(&ctx.save),
        load_layout: LayoutSummary::of(&ctx.load),
        save_id: o.save_id.clone(),
        saved_bytes: o.bytes,
        expected_bytes: expected,
        files: o.files,
        chunks: o.chunks,
        state_bytes: s.iter().map(|r| r.state_bytes).sum(),
        empty_ranks: rank_bytes.iter().enumerate().filter(|(_, b)| **b == 0).map(|(r, _)| r as u32).collect(),
        rank_bytes,
        fill_seconds: max(&mut s.iter().map(|r| r.fill_seconds)),
        copy_seconds: s.iter().filter_map(|r| r.copy_seconds).reduce(f64::max),
        save_seconds,
        save_gb_per_s: gbps(o.bytes, save_seconds),
        load_state_bytes: l.iter().map(|r| r.state_bytes).sum(),
        load_bytes_read,
        load_seconds,
        load_gb_per_s: gbps(load_bytes_read, load_seconds),
        check_seconds: max(&mut l.iter().map(|r| r.check_seconds)),
        elements_checked: l.iter().filter_map(|r| r.check.as_ref().ok()).sum(),
        save_phases: phases(&o.phases),
        load_phases: l.first().map(|r| phases(&r.phases)).unwrap_or_default(),
        save_phase_line: phase_line(&o.phases),
        load_phase_line: l.first().map(|r| phase_line(&r.phases)).unwrap_or_default(),
        verified: l.iter().all(|r| r.check.is_ok()) && o.bytes == expected,
        problems,
    }
}

fn human(r: &Report) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(o, "dckpt demo: {} into {} (seed {}, ranks as {})", r.model, r.dir, r.seed, r.ranks_as);
    let _ = writeln!(o, "  save layout   {}", r.save_layout.line());
    let _ = writeln!(o, "  load layout   {}", r.load_layout.line());
    let _ = writeln!(
        o,
        "  state         {} on {} ranks (replicas included), built in {:.2} s",
        fmt::bytes(r.state_bytes),
        r.save_layout.world_size,
        r.fill_seconds
    );
    let _ = writeln!(o, "  bytes         {}", fmt::written_vs_expected(r.saved_bytes, r.expected_bytes));
    let n = r.rank_bytes.len().max(1) as f64;
    let mean = r.saved_bytes as f64 / n;
    let (min, max) = (r.rank_bytes.iter().min().copied().unwrap_or(0), r.rank_bytes.iter().max().copied().unwrap_or(0));
    let _ = writeln!(
        o,
        "  per rank      min {}, mean {}, max {} (max/mean {:.3})",
        fmt::bytes(min),
        fmt::bytes(mean as u64),
        fmt::bytes(max),
        if mean > 0.0 { max as f64 / mean } else { 0.0 }
    );
    let empty = if r.empty_ranks.is_empty() { "none".to_string() } else { fmt::ranks(&r.empty_ranks, 12) };
    let _ = writeln!(o, "  empty ranks   {} of {}: {empty}", r.empty_ranks.len(), r.rank_bytes.len());
    let copy = r.copy_seconds.map(|c| format!(", blocked {c:.2} s copying (async)")).unwrap_or_default();
    let _ = writeln!(
        o,
        "  save          {:.2} s, {:.2} GB/s, {} files, {} chunks, save id {}{copy}",
        r.save_seconds, r.save_gb_per_s, r.files, r.chunks, r.save_id
    );
    let _ = writeln!(
        o,
        "  load          {:.2} s, {:.2} GB/s, {} read for {} of state",
        r.load_seconds,
        r.load_gb_per_s,
        fmt::bytes(r.load_bytes_read),
        fmt::bytes(r.load_state_bytes)
    );
    let _ = writeln!(o, "  save phases   {}", r.save_phase_line);
    let _ = writeln!(o, "  load phases   {}", r.load_phase_line);
    let _ = writeln!(o, "  check         {} elements in {:.2} s", r.elements_checked, r.check_seconds);
    let _ = writeln!(
        o,
        "  result        {}",
        if r.verified { "VERIFIED: every element matched" } else { "FAILED: see the reasons on stderr" }
    );
    o
}
