//! Checkpoints over a training run: `dckpt ls`, `dckpt gc` and `dckpt demo --run`, over the
//! facade's run manager (`dckpt::manager`), which holds every rule; this prints.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use dckpt::LoadOptions;
use dckpt::collective::ThreadGroup;
use dckpt::engine::read_metadata_local;
use dckpt::layout::{ReferenceModel, Synthetic};
use dckpt::manager::{self, GcOptions, GcProgress, GcReport, Latest, LocalTier, Sources, StepInfo};
use dckpt::storage::{FaultConfig, FaultStorage, Storage};
use dckpt::{CheckpointManager, Location, RetentionPolicy};
use dckpt_reference::{RankState, save_options};
use serde::Serialize;

use crate::demo::DemoArgs;
use crate::fmt;
use crate::progress::Bars;

/// Test hook: every storage operation of `dckpt demo --run` (the run root's and the local
/// tier's) takes this many milliseconds more, so that a test can kill it in the middle of
/// a step's save.
pub const LATENCY_ENV: &str = "DCKPT_DEMO_STORAGE_LATENCY_MS";

/// List the steps of a run root and which one is the latest.
///
/// List the steps of a run root: each `step-<N>` directory, committed or not (and why not),
/// its bytes, when it was saved, its layout, and which step is the latest (the `latest`
/// pointer when it names a committed step and none is newer, else the newest committed
/// step). Exits 0, or 1 when the root cannot be read.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// The run root: a directory, file:///path or s3://bucket/prefix.
    #[arg(value_name = "ROOT")]
    pub root: String,
    /// Print one JSON object: {"root", "latest", "steps": [{"step", "committed", "bytes", ...}], "skipped"},
    /// and with --local, "local": {"template", "nodes": [...], "steps": [{"step", "complete", ...}]}.
    #[arg(long)]
    pub json: bool,
    /// Also list the node-local tier at this template (a local path with {node} or {rank}
    /// in one component, e.g. 'nodes/{node}'): each node's steps, and whether each step is
    /// complete (every rank's part has a marked copy somewhere). Missing node directories
    /// are listed as missing.
    #[arg(long, value_name = "TEMPLATE")]
    pub local: Option<String>,
    /// With --local: the nodes there should be (at most 131072), for telling missing
    /// directories apart [default: up to the highest one found].
    #[arg(long, value_name = "N", requires = "local", value_parser = crate::local_ls::parse_nodes)]
    pub nodes: Option<usize>,
}

/// Remove what dead saves and retention leave under a run root.
///
/// Remove what dead saves left under a run root: step directories that never committed (or
/// are damaged) and are older than the newest committed step, data files in committed steps
/// that their metadata does not name, and unfinished writes of dead processes; with
/// --keep-last / --keep-every, also the committed steps that policy does not keep. Never the
/// latest committed step, nor a step newer than it (a save may be running there). A step is
/// deleted metadata first. Exits 0, or 1 when something could not be removed.
#[derive(Debug, Args)]
pub struct GcArgs {
    /// The run root: a directory, file:///path or s3://bucket/prefix.
    #[arg(value_name = "ROOT")]
    pub root: String,
    /// Keep the newest N committed steps (and delete the other committed ones).
    #[arg(long, value_name = "N")]
    pub keep_last: Option<u64>,
    /// Keep every committed step that is a multiple of K (K of at least 1).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    pub keep_every: Option<u64>,
    /// Say what would be removed; remove nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print one JSON object instead of the summary (and no progress bar).
    #[arg(long)]
    pub json: bool,
}

fn open(root: &str) -> Result<Arc<dyn Storage>> {
    crate::store::open(root).with_context(|| format!("opening {root}"))
}

/// One step as `ls --json` prints it: its state as `committed` and `problem`.
#[derive(Debug, Serialize)]
struct LsStep<'a> {
    step: u64,
    directory: &'a str,
    committed: bool,
    bytes: u64,
    objects: u64,
    save_id: Option<&'a str>,
    saved_at_unix: Option<u64>,
    layout: &'a std::collections::BTreeMap<String, String>,
    problem: Option<String>,
    latest: bool,
}

impl<'a> LsStep<'a> {
    fn new(s: &'a StepInfo, latest: &Latest) -> LsStep<'a> {
        LsStep {
            step: s.step,
            directory: &s.directory,
            committed: s.committed(),
            bytes: s.bytes,
            objects: s.objects,
            save_id: s.save_id.as_deref(),
            saved_at_unix: s.saved_at_unix,
            layout: &s.layout,
            problem: s.state.problem(),
            latest: Some(s.step) == latest.step,
        }
    }
}

#[derive(Debug, Serialize)]
struct LsReport<'a> {
    root: String,
    latest: Option<u64>,
    from_pointer: bool,
    steps: Vec<LsStep<'a>>,
    skipped: &'a [manager::Skipped],
    #[serde(skip_serializing_if = "Option::is_none")]
    local: Option<&'a crate::local_ls::LocalListing>,
}

/// A run root that `ls` or `gc` only reads: one that is not there, or cannot be read, is
/// a failure said on stderr and, with `--json`, as one object on stdout (exit 1).
fn failed(cmd: &str, root: &str, error: &str, json: bool) -> ExitCode {
    eprintln!("dckpt {cmd}: {error}");
    if json {
        fmt::emit(&fmt::error_json(root, error, None));
    }
    ExitCode::from(1)
}

fn open_existing(cmd: &str, root: &str, json: bool) -> std::result::Result<Arc<dyn Storage>, ExitCode> {
    crate::store::open_existing_dir(root).map_err(|e| failed(cmd, root, &format!("opening {root}: {e}"), json))
}

pub fn ls(a: &LsArgs) -> Result<ExitCode> {
    let root = match open_existing("ls", &a.root, a.json) {
        Ok(r) => r,
        Err(code) => return Ok(code),
    };
    let (latest, steps) = match manager::resolve_latest(&root) {
        Ok(v) => v,
        Err(e) => return Ok(failed("ls", &a.root, &format!("{}: {e}", root.location("")), a.json)),
    };
    let local = match &a.local {
        Some(t) => match crate::local_ls::scan(t, a.nodes) {
            Ok(l) => Some(l),
            Err(e) => return Ok(failed("ls", &a.root, &fmt::chain(&e), a.json)),
        },
        None => None,
    };
    if a.json {
        let report = LsReport {
            root: root.location(""),
            latest: latest.step,
            from_pointer: latest.from_pointer,
            steps: steps.iter().map(|info| LsStep::new(info, &latest)).collect(),
            skipped: &latest.skipped,
            local: local.as_ref(),
        };
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&report)?));
    } else {
        fmt::emit(&human_ls(&root.location(""), &latest, &steps));
        if let Some(l) = &local {
            fmt::emit(&crate::local_ls::human(l));
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn human_ls(root: &str, latest: &Latest, steps: &[StepInfo]) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let committed = steps.iter().filter(|s| s.committed()).count();
    let which = match latest.step {
        Some(s) => format!("latest {s}{}", if latest.from_pointer { "" } else { " (found by listing)" }),
        None => "no committed step".into(),
    };
    let _ = writeln!(o, "{root}: {} steps, {committed} committed, {which}", steps.len());
    for s in steps {
        let state = if s.committed() { "committed" } else { "NOT COMMITTED" };
        let when = s.saved_at_unix.map(utc).unwrap_or_else(|| "-".into());
        let layout: Vec<String> = ["world_size", "tp", "pp", "ep", "etp", "optimizer"]
            .iter()
            .filter_map(|k| s.layout.get(*k).map(|v| format!("{k} {v}")))
            .collect();
        let mark = if Some(s.step) == latest.step { "  <- latest" } else { "" };
        let _ = writeln!(
            o,
            "  {:>12}  {state:<13}  {:>10}  {when}  {}{mark}",
            s.step,
            fmt::bytes(s.bytes),
            if layout.is_empty() { "-".into() } else { layout.join(", ") }
        );
        if let Some(p) = s.state.problem() {
            let _ = writeln!(o, "                {p}");
        }
    }
    for k in latest.skipped.iter().filter(|k| !steps.iter().any(|s| s.step == k.step)) {
        let _ = writeln!(o, "  skipped {}: {}", k.step, k.reason);
    }
    o
}

/// Unix seconds as `YYYY-MM-DD HH:MM:SS UTC` (the civil calendar from days since 1970).
fn utc(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", rem / 3600, rem % 3600 / 60, rem % 60)
}

pub fn gc(a: &GcArgs) -> Result<ExitCode> {
    let root = match open_existing("gc", &a.root, a.json) {
        Ok(r) => r,
        Err(code) => return Ok(code),
    };
    let policy = RetentionPolicy { keep_last: a.keep_last, keep_every: a.keep_every };
    let bars = Bars::new(!a.json);
    let bar = bars.bar(0, "gc");
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{prefix:>6} [{bar:40.cyan/blue}] {pos}/{len} objects {elapsed_precise}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let opts = GcOptions { policy, protected: Vec::new(), dry_run: a.dry_run };
    let result = manager::gc_root(&root, &opts, &mut |p| match p {
        GcProgress::Total(n) => bar.set_length(n),
        GcProgress::Deleted(n) => bar.inc(n),
    });
    bar.finish_and_clear();
    let report = match result {
        Ok(r) => r,
        Err(e) => return Ok(failed("gc", &a.root, &format!("{}: {e}", root.location("")), a.json)),
    };
    if a.json {
        #[derive(Serialize)]
        struct Out<'a> {
            root: String,
            #[serde(flatten)]
            report: &'a GcReport,
        }
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&Out { root: root.location(""), report: &report })?));
    } else {
        fmt::emit(&human_gc(&root.location(""), &report));
    }
    for e in &report.errors {
        eprintln!("dckpt gc: could not remove {e}");
    }
    Ok(if report.errors.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn human_gc(root: &str, r: &GcReport) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let verb = if r.dry_run { "would remove" } else { "removed" };
    let _ = writeln!(
        o,
        "{root}: {verb} {} steps, {} stray data files, {} unfinished writes ({})",
        r.steps.len(),
        r.data_files.len(),
        r.unfinished_writes.len(),
        fmt::bytes(r.bytes)
    );
    for s in &r.steps {
        let _ = writeln!(
            o,
            "  step {:>12}  {:<11}  {:>10}  {} objects",
            s.step,
            s.reason.as_str(),
            fmt::bytes(s.bytes),
            s.objects
        );
    }
    for f in r.data_files.iter().chain(&r.unfinished_writes) {
        let _ = writeln!(o, "  {}  {}", f.path, fmt::bytes(f.size));
    }
    o
}

/// The values of `step`: the demo's seed moved by the step, so that every step differs.
fn values(seed: u64, step: u64) -> Synthetic {
    Synthetic::new(seed.wrapping_add(step.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
}

#[derive(Debug, Serialize)]
struct RunReport {
    root: String,
    model: String,
    #[serde(rename = "async")]
    asynchronous: bool,
    keep_last: Option<u64>,
    keep_every: Option<u64>,
    /// The latest committed step found at the start, loaded and checked before resuming.
    resumed_from: Option<u64>,
    resume_elements_checked: u64,
    /// With --local: where the resume took each rank's part from, and why it fell back.
    resume_sources: Option<Sources>,
    resume_fallbacks: Vec<String>,
    /// With --local: the template, and the node whose directory was deleted first.
    local: Option<String>,
    lost_node: Option<usize>,
    saved_steps: Vec<u64>,
    save_seconds: f64,
    /// The committed steps at the end, after retention.
    kept_steps: Vec<u64>,
    latest: Option<u64>,
    load_layout: crate::args::LayoutSummary,
    elements_checked: u64,
    verified: bool,
}

struct RunCtx<'a> {
    a: &'a DemoArgs,
    root: Arc<dyn Storage>,
    policy: RetentionPolicy,
    steps: u64,
    tier: Option<LocalTier>,
    /// Milliseconds added to every storage operation ([`LATENCY_ENV`]).
    latency: u64,
}

/// `storage` with `ms` added to every operation (none with 0).
fn slowed(storage: Arc<dyn Storage>, ms: u64) -> Arc<dyn Storage> {
    if ms == 0 {
        return storage;
    }
    let config = FaultConfig { latency_min_ms: ms, latency_max_ms: ms, ..FaultConfig::default() };
    Arc::new(FaultStorage::new(storage, config))
}

/// `dckpt demo --run ROOT --steps S`: steps 1..S saved (resuming after the latest committed
/// step, which is loaded and checked first), "training" between saves, retention after
/// each commit; then the latest step loaded in the load layout and checked element by
/// element. Exit 0 only when every check matched; 1 when a save, load or check failed.
pub fn demo_run(a: &DemoArgs, root_url: &str, save: ReferenceModel, load: ReferenceModel) -> Result<ExitCode> {
    if crate::demo::launched()?.is_some() {
        bail!("--run runs its ranks as threads; it does not run under dckpt launch");
    }
    let Some(steps) = a.steps else { bail!("--run needs --steps S") };
    // Refused here (exit 2) rather than found out as a run that saved nothing and "FAILED".
    if steps == 0 {
        bail!("--steps 0 saves nothing: give at least 1");
    }
    if a.local.is_some() && a.local_every == 0 && a.persistent_every == 0 {
        bail!("--local-every 0 and --persistent-every 0 save no step on either tier");
    }
    let latency = match std::env::var(LATENCY_ENV) {
        Ok(v) => v.trim().parse::<u64>().with_context(|| format!("{LATENCY_ENV}={v:?}"))?,
        Err(_) => 0,
    };
    let root = match open(root_url) {
        Ok(r) => r,
        Err(e) => return Ok(crate::demo::failed(a.json, root_url, &e)),
    };
    let root = slowed(root, latency);
    let tier = a.local.as_ref().map(|t| LocalTier {
        template: t.clone(),
        every: a.local_every,
        copies: a.local_copies,
        keep: a.local_keep,
        ranks_per_node: a.ranks_per_node,
        persistent_every: a.persistent_every,
    });
    if let (Some(t), Some(n)) = (&tier, a.lose_node) {
        check_lose_node(t, n, save.layout.world_size as usize)?;
    }
    let policy = RetentionPolicy { keep_last: a.keep_last, keep_every: a.keep_every };
    let ctx = RunCtx { a, root, policy, steps, tier, latency };
    match run_body(&ctx, &save, &load) {
        Ok(report) => {
            if a.json {
                fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&report)?));
            } else {
                fmt::emit(&format!(
                    "dckpt demo --run {}: saved steps {:?} ({:.2} s){}; kept {:?}; latest {} loaded at {} and {}\n",
                    report.root,
                    report.saved_steps,
                    report.save_seconds,
                    report.resumed_from.map(|s| format!(", resumed after step {s} (checked)")).unwrap_or_default(),
                    report.kept_steps,
                    report.latest.map_or("none".to_string(), |s| s.to_string()),
                    report.load_layout.line(),
                    if report.verified { "VERIFIED: every element matched" } else { "FAILED" }
                ));
            }
            Ok(if report.verified { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Err(e) => Ok(crate::demo::failed(a.json, root_url, &e)),
    }
}

/// The saved shapes of `step`, which the checks need (a padded vocabulary may differ).
fn shapes(root: &Arc<dyn Storage>, step: u64) -> Result<HashMap<String, dckpt::spec::Dims>> {
    let meta = read_metadata_local(manager::step_storage(root, step).as_ref())
        .with_context(|| format!("reading step {step}'s metadata"))?;
    Ok(meta.tensors.into_iter().map(|t| (t.key, t.global_shape)).collect())
}

fn threads<T: Send>(world: u32, f: impl Fn(u32, Arc<dyn dckpt::Collective>) -> Result<T> + Sync) -> Result<Vec<T>> {
    let opts = crate::demo::collective_options()?;
    let results = ThreadGroup::run(world as usize, &opts, |r, c| f(r as u32, Arc::new(c)))?;
    results.into_iter().collect()
}

/// What a rank restored and checked: the step, the elements checked, where the parts came
/// from and why it fell back.
type Checked = (u64, u64, Sources, Vec<String>);

/// Loads the latest step into `model`'s layout on `rank` and checks every element (`None`
/// when no step is committed).
fn load_checked(m: &CheckpointManager, ctx: &RunCtx, model: &ReferenceModel, rank: u32) -> Result<Option<Checked>> {
    let mut state = RankState::empty(model, rank);
    let loaded = m.load_latest(&mut state.request(), &LoadOptions::default()).context("loading the latest step")?;
    let Some(r) = loaded else { return Ok(None) };
    let step = r.step;
    // A step restored from the local tier has the shapes this layout holds; one loaded from
    // the run root, the shapes it stored (a padded vocabulary may differ).
    let shapes = if r.persistent.is_some() { shapes(&ctx.root, step)? } else { dckpt_reference::saved_shapes(model) };
    let n =
        state.check(values(ctx.a.seed, step), &shapes).map_err(|e| anyhow::anyhow!("step {step}, rank {rank}: {e}"))?;
    Ok(Some((step, n, r.sources, r.fallbacks)))
}

/// The manager of one rank: the run root, and the local tier when --local asks for one.
fn manager_of(ctx: &RunCtx, c: Arc<dyn dckpt::Collective>, local: bool) -> Result<CheckpointManager> {
    let m = CheckpointManager::new(c, Location::Storage(ctx.root.clone()), ctx.policy)?;
    match (&ctx.tier, local) {
        (Some(t), true) => Ok(m.with_local_tier_wrapped(t.clone(), |dir| slowed(dir, ctx.latency))?),
        _ => Ok(m),
    }
}

/// Deletes node `node`'s local directories (every rank's, where the template names {rank}).
/// Refuses `--lose-node` past the job's nodes (it was accepted, and nothing lost).
fn check_lose_node(tier: &LocalTier, node: usize, world: usize) -> Result<()> {
    let nodes = world / tier.resolve(0, world)?.0.ranks_per_node.max(1);
    if node >= nodes {
        bail!("--lose-node {node}: the job has nodes 0 to {} ({world} ranks)", nodes.saturating_sub(1));
    }
    Ok(())
}

fn lose_node(tier: &LocalTier, node: usize, world: usize) -> Result<()> {
    for rank in 0..world {
        let (placement, dir) = tier.resolve(rank, world)?;
        if placement.node_of(rank) == node && std::path::Path::new(&dir).exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("deleting node {node}'s directory {dir}"))?;
        }
    }
    Ok(())
}

fn run_body(ctx: &RunCtx, save: &ReferenceModel, load: &ReferenceModel) -> Result<RunReport> {
    let a = ctx.a;
    let train = Duration::from_millis(a.train_ms);
    let t0 = Instant::now();
    if let (Some(t), Some(n)) = (&ctx.tier, a.lose_node) {
        lose_node(t, n, save.layout.world_size as usize)?;
    }
    let per_rank = threads(save.layout.world_size, |r, c| {
        let m = manager_of(ctx, c, true)?;
        let resumed = load_checked(&m, ctx, save, r)?;
        // The last step there is resumes nothing (and adding one to it overflowed).
        let start = resumed.as_ref().map_or(1, |(s, ..)| s.saturating_add(1));
        let opts = save_options(save);
        let mut saved = Vec::new();
        for step in start..=ctx.steps {
            // "Training": the background save of the previous step overlaps it.
            std::thread::sleep(train);
            let state = RankState::filled(save, r, values(a.seed, step));
            if a.asynchronous {
                m.save_async(step, &state.save_state(), &opts).with_context(|| format!("step {step}"))?;
            } else {
                m.save(step, &state.save_state(), &opts).with_context(|| format!("step {step}"))?;
            }
            drop(state);
            if r == 0 && !a.json {
                let tiers = match m.due(step) {
                    (true, true) => "local and run root",
                    (true, false) => "local",
                    (false, true) => "run root",
                    (false, false) => "nothing due",
                };
                eprintln!(
                    "step {step}: {} ({tiers})",
                    if a.asynchronous { "saving in the background" } else { "committed" }
                );
            }
            saved.push(step);
        }
        m.finish_pending().context("the last step")?;
        let kept: Vec<u64> = m.steps()?.into_iter().filter(StepInfo::committed).map(|s| s.step).collect();
        Ok((resumed, saved, kept))
    })?;
    let save_seconds = t0.elapsed().as_secs_f64();
    let (resumed, saved, kept) = per_rank.into_iter().next().context("no rank")?;
    // The local tier serves the same layout only: another one loads the run root.
    let same_layout = save_options(load).layout == save_options(save).layout;
    let loaded = threads(load.layout.world_size, |r, c| {
        let m = manager_of(ctx, c, same_layout)?;
        load_checked(&m, ctx, load, r)
    })?;
    let latest = loaded.first().and_then(|l| l.as_ref().map(|(s, ..)| *s));
    let expected = (1..=ctx.steps.max(resumed.as_ref().map_or(0, |(s, ..)| *s))).rev().find(|&s| match &ctx.tier {
        None => true,
        Some(t) => t.persistent_due(s) || (same_layout && t.local_due(s)),
    });
    Ok(RunReport {
        root: ctx.root.location(""),
        model: a.model.model.clone(),
        asynchronous: a.asynchronous,
        keep_last: a.keep_last,
        keep_every: a.keep_every,
        resumed_from: resumed.as_ref().map(|(s, ..)| *s),
        resume_elements_checked: resumed.as_ref().map_or(0, |(_, n, ..)| *n),
        resume_sources: resumed.as_ref().filter(|_| ctx.tier.is_some()).map(|r| r.2),
        resume_fallbacks: resumed.as_ref().map(|r| r.3.clone()).unwrap_or_default(),
        local: ctx.tier.as_ref().map(|t| t.template.clone()),
        lost_node: a.lose_node,
        saved_steps: saved,
        save_seconds,
        kept_steps: kept,
        latest,
        load_layout: crate::args::LayoutSummary::of(load),
        elements_checked: loaded.iter().flatten().map(|(_, n, ..)| n).sum(),
        verified: latest.is_some() && latest == expected,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_dates() {
        assert_eq!(super::utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(super::utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(super::utc(1_764_611_045), "2025-12-01 17:44:05 UTC");
    }
}
