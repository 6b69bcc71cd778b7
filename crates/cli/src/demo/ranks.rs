//! The demo's ranks: as threads of this process, or as this process in a launched job.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use dckpt::LoadPhases;
use dckpt::collective::{Bytes, Collective, ReduceOp, TcpCollective, ThreadGroup};
use dckpt::engine::Engine;
use dckpt::layout::ReferenceModel;
use dckpt::{LoadOptions, SaveOptions, SaveOutcome};
use dckpt_reference::{RankState, save_options};
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use super::report::{Report, report};
use super::{Ctx, DemoArgs, EXIT_RANK_ENV, MADE_BY, collective_options};
use crate::progress::{self, Bars};

/// What one rank of the save did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct SaveRank {
    pub(super) state_bytes: u64,
    pub(super) fill_seconds: f64,
    pub(super) copy_seconds: Option<f64>,
    pub(super) save_seconds: f64,
    pub(super) outcome: SaveOutcome,
}

/// What one rank of the load did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct LoadRank {
    pub(super) state_bytes: u64,
    pub(super) bytes_read: u64,
    pub(super) load_seconds: f64,
    pub(super) check_seconds: f64,
    /// Elements checked, or the first wrong element.
    pub(super) check: Result<u64, String>,
    /// The load's phases (the same on every rank).
    pub(super) phases: LoadPhases,
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
    fn barrier(&self) -> dckpt::collective::Result<()> {
        self.lock().barrier()
    }
    fn broadcast(&self, root: usize, data: Option<&[u8]>) -> dckpt::collective::Result<Vec<u8>> {
        self.lock().broadcast(root, data)
    }
    fn gather(&self, root: usize, data: Vec<u8>) -> dckpt::collective::Result<Option<Vec<Vec<u8>>>> {
        self.lock().gather(root, data)
    }
    fn all_gather(&self, data: Vec<u8>) -> dckpt::collective::Result<Vec<Vec<u8>>> {
        self.lock().all_gather(data)
    }
    fn all_reduce_u64(&self, values: &[u64], op: ReduceOp) -> dckpt::collective::Result<Vec<u64>> {
        self.lock().all_reduce_u64(values, op)
    }
    fn scatter(&self, root: usize, parts: Option<Vec<Vec<u8>>>) -> dckpt::collective::Result<Vec<u8>> {
        self.lock().scatter(root, parts)
    }
    fn exchange(&self, sends: Vec<(usize, Bytes)>, from: &[usize]) -> dckpt::collective::Result<Vec<Bytes>> {
        self.lock().exchange(sends, from)
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
    let check = if outcome.save_id != save_id {
        // Another save replaced this run's while it ran: what was loaded is that one.
        Err(format!("rank {rank}: the checkpoint is now save {}, not this run's {save_id}", outcome.save_id))
    } else {
        state.check(ctx.values, &ctx.saved_shapes).map_err(|e| format!("rank {rank}: {e}"))
    };
    check_bar.inc(state_bytes);
    Ok(LoadRank {
        state_bytes,
        bytes_read: outcome.bytes_read,
        load_seconds,
        check_seconds: t1.elapsed().as_secs_f64(),
        check,
        phases: outcome.phases,
    })
}

/// Runs `f` on `world` rank threads sharing one thread group; results in rank order.
fn threads<T: Send>(world: u32, f: impl Fn(u32, Shared) -> Result<T> + Sync) -> Result<Vec<T>> {
    let results =
        ThreadGroup::run(world as usize, &collective_options()?, |r, c| f(r as u32, Shared::new(Box::new(c))))?;
    // Every rank fails with the same error; report the first.
    results.into_iter().collect()
}

pub(super) fn run_threads(a: &DemoArgs, ctx: &Ctx) -> Result<Option<Report>> {
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

pub(super) fn run_process(a: &DemoArgs, ctx: &Ctx, rank: u32) -> Result<Option<Report>> {
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
