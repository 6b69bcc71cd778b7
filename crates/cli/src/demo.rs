//! `dckpt demo`: the reference model's state saved in one layout, loaded in another, and
//! every element checked. Ranks are threads of this process, or one process each when
//! started by `dckpt launch` (TCP).

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use dckpt::engine::{Engine, read_metadata_local};
use dckpt::format::META_NAME;
use dckpt::layout::{Layout, OptimizerMode, ParallelConfig, ReferenceModel, Synthetic};
use dckpt::verify::is_data_file_name;
use dckpt::{ErrorKind, LoadOptions, SaveOptions, SaveOutcome};
use dckpt_collective::{Collective, CollectiveOptions, ReduceOp, TcpCollective, ThreadGroup};
use dckpt_reference::{RankState, save_options};
use dckpt_storage::Storage;
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use crate::args::{LayoutSummary, ModelArgs, parse_optimizer};
use crate::fmt;
use crate::progress::{self, Bars, Counted, Counters};

/// Test hook: the rank named here leaves the job just before the save (its process exits
/// with code 3 under `dckpt launch`; as a thread it drops its connection), so the save must
/// fail on every other rank with an error naming it.
pub const EXIT_RANK_ENV: &str = "DCKPT_DEMO_EXIT_RANK";

/// Save the reference model in one layout, load it into another, check every element.
///
/// Every rank builds its pieces filled with values that depend only on (seed, key, global
/// element index), saves them (one writer per distinct chunk, metadata committed last),
/// frees them, then every rank of the load layout asks for its own pieces, which are read,
/// checksum-verified and checked element by element: elements the checkpoint holds must
/// equal the generator's values, elements beyond it (a larger padded vocabulary) zero.
///
/// Without any layout option it saves moe-small on 8 ranks (tp 2, pp 2, ep 2, etp 2,
/// layerwise optimizer) and loads it on 4 (ep 4, distributed optimizer). Once a layout
/// option is given, the layout is what the options say: every parallel size not given is 1
/// (Megatron's convention).
/// - Any save-layout option: save sizes not given are 1 (the world stays 8, the optimizer
///   layerwise), and the load layout is the save layout unless a --load-* option is given.
/// - Any --load-* option: load sizes not given are 1 (the load world and optimizer are the
///   save's, or 4 and distributed without save-layout options).
///
/// So `--world 8 --tp 1 --ep 4 --etp 2` saves and loads at pp 1.
///
/// Ranks are threads of this process, or, when started by `dckpt launch` (WORLD_SIZE and
/// RANK set), one rank per process over TCP; then both worlds must equal WORLD_SIZE and the
/// directory must be shared (a path or s3://).
///
/// The demo saves into an empty directory, or over a checkpoint an earlier demo made there
/// (marked `made_by = dckpt demo` in its metadata's layout), which it replaces: the old
/// checkpoint stays whole until the new metadata is committed over it, then its data files
/// are deleted. It refuses a checkpoint it did not make, or a directory holding anything else
/// (exit 2), unless --replace is given. Of demos racing into one directory that found the
/// same there, exactly one commits; the others fail (exit 1) and leave nothing behind. Exit 0 only when every element matched; 1 when the
/// save, the load or a check failed; 2 for invalid options or a refused directory.
///
/// Testing: DCKPT_DEMO_EXIT_RANK=R makes rank R leave just before the save, to show a dead
/// rank failing the save on every other rank (use DCKPT_COLLECTIVE_TIMEOUT_MS to bound it).
#[derive(Debug, Args)]
#[command(verbatim_doc_comment)]
pub struct DemoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Save layout: number of ranks [default: 8].
    #[arg(long, value_name = "N")]
    pub world: Option<u32>,
    /// Save layout: tensor-parallel size [default: 2; 1 once a save-layout option is given].
    #[arg(long, value_name = "N")]
    pub tp: Option<u32>,
    /// Save layout: pipeline-parallel size [default: 2; 1 once a save-layout option is given].
    #[arg(long, value_name = "N")]
    pub pp: Option<u32>,
    /// Save layout: context-parallel size [default: 1].
    #[arg(long, value_name = "N")]
    pub cp: Option<u32>,
    /// Save layout: expert-parallel size [default: 2; 1 once a save-layout option is given].
    #[arg(long, value_name = "N")]
    pub ep: Option<u32>,
    /// Save layout: expert-tensor-parallel size [default: 2; 1 once a save-layout option is
    /// given].
    #[arg(long, value_name = "N")]
    pub etp: Option<u32>,
    /// Save layout: optimizer state, none, adam, distributed or layerwise [default: layerwise].
    #[arg(long, value_name = "M", value_parser = parse_optimizer)]
    pub optimizer: Option<OptimizerMode>,
    /// Load layout: number of ranks [default: 4, or --world once a save-layout option is given].
    #[arg(long, value_name = "N")]
    pub load_world: Option<u32>,
    /// Load layout: tensor-parallel size [default: 1, or --tp when only save-layout options
    /// are given].
    #[arg(long, value_name = "N")]
    pub load_tp: Option<u32>,
    /// Load layout: pipeline-parallel size [default: like --load-tp, with --pp].
    #[arg(long, value_name = "N")]
    pub load_pp: Option<u32>,
    /// Load layout: context-parallel size [default: like --load-tp, with --cp].
    #[arg(long, value_name = "N")]
    pub load_cp: Option<u32>,
    /// Load layout: expert-parallel size [default: 4 without any layout option, else like
    /// --load-tp, with --ep].
    #[arg(long, value_name = "N")]
    pub load_ep: Option<u32>,
    /// Load layout: expert-tensor-parallel size [default: like --load-tp, with --etp].
    #[arg(long, value_name = "N")]
    pub load_etp: Option<u32>,
    /// Load layout: optimizer state [default: distributed, or --optimizer once a save-layout
    /// option is given].
    #[arg(long, value_name = "M", value_parser = parse_optimizer)]
    pub load_optimizer: Option<OptimizerMode>,
    /// Where to save: a directory, file:///path, s3://bucket/prefix or memory://.
    #[arg(long, default_value = "./dckpt-demo", value_name = "PATH|URL")]
    pub dir: String,
    /// Seed of the synthetic values.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Save in the background: the call returns once the state is copied, the state is
    /// freed at once, and the demo then waits for the commit.
    #[arg(long = "async")]
    pub asynchronous: bool,
    /// Print one JSON object instead of the summary (and no progress bars).
    #[arg(long)]
    pub json: bool,
    /// Save even where --dir holds a checkpoint the demo did not make, or other objects: a
    /// checkpoint there is replaced (its data files deleted once the new one is committed);
    /// nothing else there is touched.
    #[arg(long)]
    pub replace: bool,
    /// A run: save steps 1..--steps as checkpoints `step-<N>` under this run root (resuming
    /// after its latest committed step, loaded and checked first), each with values of its
    /// own, "training" between saves, retention after each commit; then load the latest in
    /// the load layout and check every element. --dir is not used.
    #[arg(long, value_name = "ROOT")]
    pub run: Option<String>,
    /// With --run: the last step to save.
    #[arg(long, value_name = "S", requires = "run")]
    pub steps: Option<u64>,
    /// With --run: keep the newest N committed steps.
    #[arg(long, value_name = "N", requires = "run")]
    pub keep_last: Option<u64>,
    /// With --run: keep every step that is a multiple of K.
    #[arg(long, value_name = "K", requires = "run")]
    pub keep_every: Option<u64>,
    /// With --run: milliseconds of "training" before each step's save.
    #[arg(long, value_name = "MS", default_value_t = 100)]
    pub train_ms: u64,
}

/// What one rank of the save did.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SaveRank {
    state_bytes: u64,
    fill_seconds: f64,
    copy_seconds: Option<f64>,
    save_seconds: f64,
    outcome: SaveOutcome,
}

/// What one rank of the load did.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LoadRank {
    state_bytes: u64,
    bytes_read: u64,
    load_seconds: f64,
    check_seconds: f64,
    /// Elements checked, or the first wrong element.
    check: Result<u64, String>,
}

#[derive(Debug, Serialize)]
struct Report {
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
    verified: bool,
    problems: Vec<String>,
}

/// The entry of the metadata's layout map that marks a checkpoint as the demo's own, which
/// a later run replaces without being asked.
const MADE_BY: (&str, &str) = ("made_by", "dckpt demo");

/// Everything a rank needs.
struct Ctx {
    save: ReferenceModel,
    load: ReferenceModel,
    storage: Arc<dyn Storage>,
    /// Whether the save replaces the checkpoint there (see [`save_target`]).
    replace: bool,
    counters: Arc<Counters>,
    values: Synthetic,
    asynchronous: bool,
    exit_rank: Option<u32>,
    launched: bool,
}

/// A collective shared by the engine and the demo's own barriers and gathers.
#[derive(Debug, Clone)]
struct Shared(Arc<Mutex<Box<dyn Collective>>>);

impl Shared {
    fn new(c: Box<dyn Collective>) -> Shared {
        Shared(Arc::new(Mutex::new(c)))
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Box<dyn Collective>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Collective for Shared {
    fn rank(&self) -> usize {
        self.lock().rank()
    }
    fn world_size(&self) -> usize {
        self.lock().world_size()
    }
    fn barrier(&self) -> dckpt_collective::Result<()> {
        self.lock().barrier()
    }
    fn broadcast(&self, root: usize, data: Option<&[u8]>) -> dckpt_collective::Result<Vec<u8>> {
        self.lock().broadcast(root, data)
    }
    fn gather(&self, root: usize, data: Vec<u8>) -> dckpt_collective::Result<Option<Vec<Vec<u8>>>> {
        self.lock().gather(root, data)
    }
    fn all_gather(&self, data: Vec<u8>) -> dckpt_collective::Result<Vec<Vec<u8>>> {
        self.lock().all_gather(data)
    }
    fn all_reduce_u64(&self, values: &[u64], op: ReduceOp) -> dckpt_collective::Result<Vec<u64>> {
        self.lock().all_reduce_u64(values, op)
    }
    fn scatter(&self, root: usize, parts: Option<Vec<Vec<u8>>>) -> dckpt_collective::Result<Vec<u8>> {
        self.lock().scatter(root, parts)
    }
}

/// Save and load layouts from the options (see [`DemoArgs`] for the defaults).
pub(crate) fn layouts(a: &DemoArgs) -> Result<(ReferenceModel, ReferenceModel)> {
    let spec = a.model.spec()?;
    let save_sizes = [a.tp, a.pp, a.cp, a.ep, a.etp];
    let any_save = a.world.is_some() || a.optimizer.is_some() || save_sizes.iter().any(Option::is_some);
    // Without options: the documented demo. With any: Megatron's convention, a size not
    // given is 1, so a layout is never silently mixed with the demo's own sizes.
    let size = |given: Option<u32>, preset: u32| given.unwrap_or(if any_save { 1 } else { preset });
    let s = (
        a.world.unwrap_or(8),
        ParallelConfig {
            tp: size(a.tp, 2),
            pp: size(a.pp, 2),
            cp: size(a.cp, 1),
            ep: size(a.ep, 2),
            etp: size(a.etp, 2),
        },
        a.optimizer.unwrap_or(OptimizerMode::Layerwise),
    );
    let load_sizes = [a.load_tp, a.load_pp, a.load_cp, a.load_ep, a.load_etp];
    let any_load = a.load_world.is_some() || a.load_optimizer.is_some() || load_sizes.iter().any(Option::is_some);
    let load_size = |given: Option<u32>, save: u32, preset: u32| {
        given.unwrap_or(if any_load {
            1
        } else if any_save {
            save
        } else {
            preset
        })
    };
    let l = (
        a.load_world.unwrap_or(if any_save { s.0 } else { 4 }),
        ParallelConfig {
            tp: load_size(a.load_tp, s.1.tp, 1),
            pp: load_size(a.load_pp, s.1.pp, 1),
            cp: load_size(a.load_cp, s.1.cp, 1),
            ep: load_size(a.load_ep, s.1.ep, 4),
            etp: load_size(a.load_etp, s.1.etp, 1),
        },
        a.load_optimizer.unwrap_or(if any_save { s.2 } else { OptimizerMode::Distributed }),
    );
    let save =
        ReferenceModel::new(spec.clone(), Layout::new(s.1, s.0).context("save layout")?, s.2).context("save layout")?;
    let load = ReferenceModel::new(spec, Layout::new(l.1, l.0).context("load layout")?, l.2).context("load layout")?;
    Ok((save, load))
}

/// The process's rank and world when started by `dckpt launch` (or torchrun).
pub(crate) fn launched() -> Result<Option<(u32, u32)>> {
    let (Ok(world), Ok(rank)) = (std::env::var("WORLD_SIZE"), std::env::var("RANK")) else { return Ok(None) };
    let world: u32 = world.trim().parse().with_context(|| format!("WORLD_SIZE={world:?}"))?;
    let rank: u32 = rank.trim().parse().with_context(|| format!("RANK={rank:?}"))?;
    Ok(Some((rank, world)))
}

pub fn run(a: &DemoArgs) -> Result<ExitCode> {
    // Invalid options exit 2 (through main); failures of the job itself exit 1.
    let (save, load) = layouts(a)?;
    if let Some(root) = &a.run {
        return crate::run::demo_run(a, root, save, load);
    }
    let job = launched()?;
    if let Some((_, world)) = job {
        if save.layout.world_size != world || load.layout.world_size != world {
            bail!(
                "under dckpt launch both worlds must equal WORLD_SIZE={world}: the save world is {}, the load world \
                 is {} (pass --world {world} --load-world {world})",
                save.layout.world_size,
                load.layout.world_size
            );
        }
        if a.dir.starts_with("memory://") {
            bail!("memory:// is private to each process; under dckpt launch use a directory or s3://");
        }
    }
    let exit_rank = match std::env::var(EXIT_RANK_ENV) {
        Ok(v) => Some(v.trim().parse::<u32>().with_context(|| format!("{EXIT_RANK_ENV}={v:?}"))?),
        Err(_) => None,
    };
    let storage = match crate::store::open(&a.dir) {
        Ok(s) => s,
        // A URL that cannot name a store is a bad option; a store that cannot be opened (a
        // directory that cannot be created) fails the job.
        Err(e @ dckpt_storage::Error::Config { .. }) => {
            return Err(anyhow::Error::new(e).context(format!("opening {}", a.dir)));
        }
        Err(e) => {
            let e = anyhow::Error::new(e).context(format!("opening {}", a.dir));
            eprintln!("dckpt demo: {}", fmt::chain(&e));
            return Ok(ExitCode::from(1));
        }
    };
    let replace = match save_target(storage.as_ref(), a.replace) {
        Ok(replace) => replace,
        Err(Target::Refused(why)) => bail!("{why}"),
        Err(Target::Failed(e)) => {
            eprintln!("dckpt demo: {}", fmt::chain(&e));
            return Ok(ExitCode::from(1));
        }
    };
    let counters = Arc::new(Counters::default());
    let counted: Arc<dyn Storage> = Arc::new(Counted { inner: storage, counters: counters.clone() });
    let ctx = Ctx {
        save,
        load,
        storage: counted,
        replace,
        counters,
        values: Synthetic::new(a.seed),
        asynchronous: a.asynchronous,
        exit_rank,
        launched: job.is_some(),
    };
    let outcome = match job {
        None => run_threads(a, &ctx),
        Some((rank, _)) => run_process(a, &ctx, rank),
    };
    match outcome {
        Ok(Some(report)) => {
            if a.json {
                let text =
                    if ctx.launched { serde_json::to_string(&report)? } else { serde_json::to_string_pretty(&report)? };
                fmt::emit(&format!("{text}\n"));
            } else {
                fmt::emit(&human(&report));
            }
            for p in &report.problems {
                eprintln!("dckpt demo: {p}");
            }
            Ok(if report.verified && report.saved_bytes == report.expected_bytes {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        // A rank other than 0 of a launched job: rank 0 reports.
        Ok(None) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("dckpt demo: {}", fmt::chain(&e));
            Ok(ExitCode::from(1))
        }
    }
}

/// Why the demo does not save into a target.
#[derive(Debug)]
enum Target {
    /// It holds what the demo may not replace unasked (exit 2: choose another or --replace).
    Refused(String),
    /// Looking at it failed (exit 1).
    Failed(anyhow::Error),
}

/// Whether the save replaces the checkpoint at `storage`, or why the demo does not save
/// there. Nothing is deleted here: the engine's replace deletes the old checkpoint's files
/// only once the new metadata has landed over it, and only if it is still the one it read.
///
/// Without `replace_asked`: the demo's own checkpoint is replaced; a place holding nothing
/// but data files no metadata names (saves that never committed, harmless) gets a new
/// checkpoint, which fails if another save commits there first; anything else is refused.
/// The demo looks before the engine plans: a checkpoint committed by another program in
/// between is replaced as the demo's own would be (still only once the new metadata has
/// landed over exactly what the plan read).
fn save_target(storage: &dyn Storage, replace_asked: bool) -> Result<bool, Target> {
    let dir = storage.location("");
    let dir = dir.trim_end_matches('/');
    let meta = match read_metadata_local(storage) {
        Ok(m) => Some(Ok(m)),
        Err(e) if matches!(e.kind(), ErrorKind::NotACheckpoint { .. }) => None,
        Err(e) if matches!(e.kind(), ErrorKind::Storage { .. }) => {
            return Err(Target::Failed(anyhow!(e).context(format!("reading {}", storage.location(META_NAME)))));
        }
        Err(e) => Some(Err(e)),
    };
    if replace_asked {
        // The engine replaces whatever is committed when the save plans.
        return Ok(true);
    }
    let hint = "pass --replace to save there anyway, or choose another --dir";
    match meta {
        Some(Ok(m)) if m.layout.get(MADE_BY.0).map(String::as_str) == Some(MADE_BY.1) => Ok(true),
        Some(Ok(m)) => Err(Target::Refused(format!(
            "{dir} holds a checkpoint the demo did not make (save id {}, written by {}); the demo replaces only its \
             own: {hint}",
            m.save_id, m.writer
        ))),
        Some(Err(e)) => Err(Target::Refused(format!(
            "{dir} holds a {META_NAME} the demo cannot read as its own checkpoint ({e}): {hint}"
        ))),
        None => {
            let objects = storage.list("").map_err(|e| Target::Failed(anyhow!(e).context(format!("listing {dir}"))))?;
            let foreign: Vec<&str> =
                objects.iter().map(|o| o.path.as_str()).filter(|p| !is_data_file_name(p)).collect();
            match foreign.first() {
                None => Ok(false),
                Some(first) => Err(Target::Refused(format!(
                    "{dir} is not empty and holds no checkpoint of the demo ({} other object{}, such as {first}): \
                     {hint}",
                    foreign.len(),
                    if foreign.len() == 1 { "" } else { "s" }
                ))),
            }
        }
    }
}

fn save_rank(ctx: &Ctx, rank: u32, coll: Shared, fill_bar: &ProgressBar) -> Result<Option<SaveRank>> {
    let t = Instant::now();
    let state = RankState::filled(&ctx.save, rank, ctx.values);
    let fill_seconds = t.elapsed().as_secs_f64();
    fill_bar.inc(state.bytes());
    let state_bytes = state.bytes();
    // Everyone is filled before the clock starts.
    coll.barrier().context("before the save")?;
    if ctx.exit_rank == Some(rank) {
        eprintln!("rank {rank}: leaving the job before the save ({EXIT_RANK_ENV}={rank})");
        if ctx.launched {
            std::process::exit(3);
        }
        return Ok(None);
    }
    let engine = Engine::new(Arc::new(coll));
    let opts = SaveOptions { replace: ctx.replace, ..save_options(&ctx.save) }.layout_entry(MADE_BY.0, MADE_BY.1);
    let t0 = Instant::now();
    let (outcome, copy_seconds) = if ctx.asynchronous {
        let handle = engine.save_async(ctx.storage.clone(), &state.save_state(), &opts).context("save")?;
        let copy = t0.elapsed().as_secs_f64();
        drop(state);
        (handle.wait().context("save")?, Some(copy))
    } else {
        let o = engine.save(ctx.storage.as_ref(), &state.save_state(), &opts).context("save")?;
        drop(state);
        (o, None)
    };
    Ok(Some(SaveRank { state_bytes, fill_seconds, copy_seconds, save_seconds: t0.elapsed().as_secs_f64(), outcome }))
}

/// `loaded` is called once this rank's load returned (before its check). `save_id` is the
/// id of this run's save, which the checkpoint must still be.
fn load_rank(
    ctx: &Ctx,
    rank: u32,
    save_id: &str,
    coll: Shared,
    loaded: &(dyn Fn() + Sync),
    check_bar: &ProgressBar,
) -> Result<LoadRank> {
    let mut state = RankState::empty(&ctx.load, rank);
    let state_bytes = state.bytes();
    coll.barrier().context("before the load")?;
    let engine = Engine::new(Arc::new(coll));
    let t0 = Instant::now();
    let outcome = state.load(&engine, ctx.storage.as_ref(), &LoadOptions::default());
    loaded();
    let outcome = outcome.context("load")?;
    let load_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let meta = read_metadata_local(ctx.storage.as_ref()).context("reading the metadata for the check")?;
    let replaced_by = (meta.save_id != save_id).then(|| meta.save_id.clone());
    let shapes: HashMap<String, dckpt_shard_spec::Dims> =
        meta.tensors.into_iter().map(|t| (t.key, t.global_shape)).collect();
    let check = match replaced_by {
        // Another save replaced this run's while it ran: what was loaded may be that one.
        Some(other) => Err(format!("rank {rank}: the checkpoint is now save {other}, not this run's {save_id}")),
        None => state.check(ctx.values, &shapes).map_err(|e| format!("rank {rank}: {e}")),
    };
    check_bar.inc(state_bytes);
    Ok(LoadRank {
        state_bytes,
        bytes_read: outcome.bytes_read,
        load_seconds,
        check_seconds: t1.elapsed().as_secs_f64(),
        check,
    })
}

/// Runs `f` on `world` rank threads sharing one thread group; results in rank order.
fn threads<T: Send>(world: u32, f: impl Fn(u32, Shared) -> Result<T> + Sync) -> Result<Vec<T>> {
    let results =
        ThreadGroup::run(world as usize, &collective_options()?, |r, c| f(r as u32, Shared::new(Box::new(c))))?;
    // Every rank fails with the same error; report the first.
    results.into_iter().collect()
}

/// The thread group's bounds: the TCP defaults and environment overrides.
pub(crate) fn collective_options() -> Result<CollectiveOptions> {
    let mut o = CollectiveOptions::default();
    if let Ok(ms) = std::env::var("DCKPT_COLLECTIVE_TIMEOUT_MS") {
        o.timeout = std::time::Duration::from_millis(
            ms.trim().parse().with_context(|| format!("DCKPT_COLLECTIVE_TIMEOUT_MS={ms:?}"))?,
        );
    }
    Ok(o)
}

fn run_threads(a: &DemoArgs, ctx: &Ctx) -> Result<Option<Report>> {
    let bars = Bars::new(!a.json);
    let sw = ctx.save.layout.world_size;
    let fill_bar = bars.bar(state_bytes(&ctx.save), "build");
    let save_bar = bars.bar(ctx.save.expected_bytes(), "save");
    let saved: Vec<Option<SaveRank>> = {
        // The save bar starts with the first byte written.
        let ranks =
            progress::follow(&save_bar, &ctx.counters.written, || threads(sw, |r, c| save_rank(ctx, r, c, &fill_bar)));
        fill_bar.finish_and_clear();
        ranks?
    };
    let saved: Vec<SaveRank> = saved.into_iter().flatten().collect();
    if saved.len() != sw as usize {
        bail!("save: a rank left the job and the save did not fail");
    }
    let lw = ctx.load.layout.world_size;
    let load_bar = bars.bar(state_bytes(&ctx.load), "load");
    let check_bar = bars.bar(state_bytes(&ctx.load), "check");
    // The load bar stops when the last rank's load returned; the checks follow.
    let done = std::sync::atomic::AtomicU32::new(0);
    let on_loaded = || {
        if done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1 == lw {
            progress::complete(&load_bar);
        }
    };
    let save_id = &saved[0].outcome.save_id;
    let loaded = progress::follow(&load_bar, &ctx.counters.read, || {
        threads(lw, |r, c| load_rank(ctx, r, save_id, c, &on_loaded, &check_bar))
    })?;
    check_bar.finish_and_clear();
    Ok(Some(report(a, ctx, &saved, &loaded, "threads")))
}

fn run_process(a: &DemoArgs, ctx: &Ctx, rank: u32) -> Result<Option<Report>> {
    let coll = Shared::new(Box::new(TcpCollective::from_env().context("joining the job (TCP)")?));
    // Rank 0 may exit right after a failure: the collective makes the peers prefer its
    // verdict (naming the failed rank) over noticing that rank 0 is gone.
    process_body(a, ctx, rank, &coll)
}

fn process_body(a: &DemoArgs, ctx: &Ctx, rank: u32, coll: &Shared) -> Result<Option<Report>> {
    // Rank 0 shows its own bytes against the job's.
    let bars = Bars::new(!a.json && rank == 0);
    let fill_bar = ProgressBar::hidden();
    let save_bar = bars.bar(ctx.save.expected_bytes() / ctx.save.layout.world_size as u64, "save");
    let saved = progress::follow(&save_bar, &ctx.counters.written, || save_rank(ctx, rank, coll.clone(), &fill_bar))?
        .ok_or_else(|| anyhow!("left the job"))?;
    let load_bar = bars.bar(ctx.load.expected_bytes() / ctx.load.layout.world_size as u64, "load");
    let check_bar = ProgressBar::hidden();
    let loaded = progress::follow(&load_bar, &ctx.counters.read, || {
        load_rank(ctx, rank, &saved.outcome.save_id, coll.clone(), &|| progress::complete(&load_bar), &check_bar)
    })?;
    let ok = loaded.check.is_ok();
    let msg = serde_json::to_vec(&(&saved, &loaded))?;
    let all = coll.gather(0, msg).context("gathering the results")?;
    let verified = coll.all_reduce_u64(&[u64::from(ok)], ReduceOp::Min).context("agreeing on the result")?[0] == 1;
    let Some(all) = all else {
        if !verified {
            bail!("the check failed on some rank (rank 0 reports which)");
        }
        return Ok(None);
    };
    let mut s = Vec::new();
    let mut l = Vec::new();
    for m in all {
        let (sr, lr): (SaveRank, LoadRank) = serde_json::from_slice(&m).context("a rank's results")?;
        s.push(sr);
        l.push(lr);
    }
    Ok(Some(report(a, ctx, &s, &l, "processes")))
}

/// Bytes every rank of `m` holds (replicas included).
fn state_bytes(m: &ReferenceModel) -> u64 {
    (0..m.layout.world_size).map(|r| m.rank_state(r).iter().map(|t| t.nbytes()).sum::<u64>()).sum()
}

fn report(a: &DemoArgs, ctx: &Ctx, s: &[SaveRank], l: &[LoadRank], ranks_as: &'static str) -> Report {
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
    let _ = writeln!(o, "  check         {} elements in {:.2} s", r.elements_checked, r.check_seconds);
    let _ = writeln!(
        o,
        "  result        {}",
        if r.verified { "VERIFIED: every element matched" } else { "FAILED: see the reasons on stderr" }
    );
    o
}
