//! `dckpt demo`: the reference model's state saved in one layout, loaded in another, and
//! every element checked. Ranks are threads of this process, or one process each when
//! started by `dckpt launch` (TCP).

mod ranks;
mod report;
mod target;

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use dckpt::collective::CollectiveOptions;
use dckpt::layout::{Layout, OptimizerMode, ParallelConfig, ReferenceModel, Synthetic};
use dckpt::storage::Storage;

use crate::args::{ModelArgs, parse_optimizer};
use crate::fmt;
use crate::progress::{Counted, Counters};
use target::{Target, save_target};

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
/// (data files of saves that never committed do not count) (exit 2), unless --replace is
/// given. Of demos racing into one directory that found the
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
    /// Save layout: number of ranks, at most 65536 [default: 8].
    #[arg(long, value_name = "N", value_parser = crate::args::parse_world)]
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
    /// Load layout: number of ranks, at most 65536 [default: 4, or --world once a save-layout
    /// option is given].
    #[arg(long, value_name = "N", value_parser = crate::args::parse_world)]
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
    /// With --run: keep every step that is a multiple of K (K of at least 1).
    #[arg(long, value_name = "K", requires = "run", value_parser = clap::value_parser!(u64).range(1..))]
    pub keep_every: Option<u64>,
    /// With --run: milliseconds of "training" before each step's save.
    #[arg(long, value_name = "MS", default_value_t = 100)]
    pub train_ms: u64,
    /// With --run: a node-local tier beside the run root, at this path template ({node}
    /// and {rank} expand, e.g. 'nodes/{node}'): each rank's state saved there with a copy on
    /// another node, and a resume restored from it where it is whole.
    #[arg(long, value_name = "TEMPLATE", requires = "run")]
    pub local: Option<String>,
    /// With --local: ranks per simulated node [default: LOCAL_WORLD_SIZE].
    #[arg(long, value_name = "K", requires = "local")]
    pub ranks_per_node: Option<usize>,
    /// With --local: save the local tier at every step divisible by N (0: never).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "local")]
    pub local_every: u64,
    /// With --local: save the run root at every step divisible by N (0: never; the run then
    /// restores from the local tier only, in the save layout).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "local")]
    pub persistent_every: u64,
    /// With --local: copies of each rank's part, its own included.
    #[arg(long, value_name = "C", default_value_t = 2, requires = "local")]
    pub local_copies: usize,
    /// With --local: complete local steps kept.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "local")]
    pub local_keep: usize,
    /// With --local: delete node N's local directory before resuming, as a replaced machine
    /// comes back empty; the resume must restore that node's parts from their peers.
    #[arg(long, value_name = "N", requires = "local")]
    pub lose_node: Option<usize>,
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
    /// The global shapes the save stores, for the check (every rank reading the metadata
    /// for them would cost the world times the metadata).
    saved_shapes: HashMap<String, dckpt::spec::Dims>,
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

/// `dckpt demo` without `--run` (which `main` hands to the run manager).
pub fn run(a: &DemoArgs) -> Result<ExitCode> {
    // Invalid options exit 2 (through main); failures of the job itself exit 1.
    let (save, load) = layouts(a)?;
    let job = launched()?;
    if let Some((_, world)) = job {
        check_launched(a, &save, &load, world)?;
    }
    let exit_rank = match std::env::var(EXIT_RANK_ENV) {
        Ok(v) => Some(v.trim().parse::<u32>().with_context(|| format!("{EXIT_RANK_ENV}={v:?}"))?),
        Err(_) => None,
    };
    let storage = match open_store(&a.dir, a.json)? {
        Ok(s) => s,
        Err(code) => return Ok(code),
    };
    let replace = match save_target(storage.as_ref(), a.replace) {
        Ok(replace) => replace,
        Err(Target::Refused(why)) => bail!("{why}"),
        Err(Target::Failed(e)) => return Ok(failed(a.json, &a.dir, &e)),
    };
    let counters = Arc::new(Counters::default());
    let counted: Arc<dyn Storage> = Arc::new(Counted { inner: storage, counters: counters.clone() });
    let ctx = Ctx {
        saved_shapes: dckpt_reference::saved_shapes(&save),
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
        None => ranks::run_threads(a, &ctx),
        Some((rank, _)) => ranks::run_process(a, &ctx, rank),
    };
    match outcome {
        Ok(Some(report)) => report.emit(a.json, ctx.launched),
        // A rank other than 0 of a launched job: rank 0 reports.
        Ok(None) => Ok(ExitCode::SUCCESS),
        Err(e) => Ok(failed(a.json, &a.dir, &e)),
    }
}

/// Under `dckpt launch`: both worlds are the job's, and the store is one every process sees.
fn check_launched(a: &DemoArgs, save: &ReferenceModel, load: &ReferenceModel, world: u32) -> Result<()> {
    if save.layout.world_size != world || load.layout.world_size != world {
        bail!(
            "under dckpt launch both worlds must equal WORLD_SIZE={world}: the save world is {}, the load world is {} \
             (pass --world {world} --load-world {world})",
            save.layout.world_size,
            load.layout.world_size
        );
    }
    if a.dir.starts_with("memory://") {
        bail!("memory:// is private to each process; under dckpt launch use a directory or s3://");
    }
    Ok(())
}

/// The store at `dir`, or the exit code of a store that cannot be opened.
fn open_store(dir: &str, json: bool) -> Result<Result<Arc<dyn Storage>, ExitCode>> {
    match crate::store::open(dir) {
        Ok(s) => Ok(Ok(s)),
        // A URL that cannot name a store is a bad option; a store that cannot be opened (a
        // directory that cannot be created) fails the job.
        Err(e @ dckpt::storage::Error::Config { .. }) => Err(anyhow::Error::new(e).context(format!("opening {dir}"))),
        Err(e) => Ok(Err(failed(json, dir, &anyhow::Error::new(e).context(format!("opening {dir}"))))),
    }
}

/// Says why the job failed (with `json`, also as the one error object on stdout, naming
/// `location`); its exit code.
pub(crate) fn failed(json: bool, location: &str, e: &anyhow::Error) -> ExitCode {
    eprintln!("dckpt demo: {}", fmt::chain(e));
    if json {
        fmt::emit(&fmt::error_json(location, &fmt::chain(e), None));
    }
    // Options the engine or a manager refuses (a local tier of 0 copies) exit as the help
    // says invalid options do, not as a failed run.
    let invalid = e.chain().any(|c| {
        c.downcast_ref::<dckpt::Error>().is_some_and(|e| matches!(e.kind(), dckpt::ErrorKind::InvalidOptions { .. }))
    });
    ExitCode::from(if invalid { 2 } else { 1 })
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
