//! `bench scale` with ranks as threads: one world saves the reference model, another loads
//! it in its own layout and checks every element, each rank through its own `Checkpointer`
//! and its own request-counting view of one store.
//!
//! The synthetic values depend only on (seed, key, global element index), so every rank
//! that holds the same (key, region) holds the same bytes: the save's state is one buffer
//! per distinct piece, borrowed by every rank that holds it. That keeps 16,384 ranks of a
//! model whose dense weights are replicated over 128 data-parallel ranks within memory. The
//! load cannot share (every rank writes into its own buffers), so it holds what its world
//! holds.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use dckpt::collective::ThreadCollective;
use dckpt::layout::{ReferenceModel, Synthetic};
use dckpt::spec::{Dims, Key, Region, ShardedTensor};
use dckpt::storage::Storage;
use dckpt::{Checkpointer, Collective, LoadOptions, SaveOutcome, SaveState, TensorData, ThreadGroup};
use dckpt_reference::{RankState, save_options};

use crate::progress::{Counted, Counters, Request};

/// Requests of one rank in one phase, in [`Request::ALL`] order.
pub(super) type Requests = [u64; Request::ALL.len()];

/// What one phase (the save, or the load) cost, over its ranks.
#[derive(Debug)]
pub(super) struct Phase {
    /// From the first rank's start to the last rank's return.
    pub seconds: f64,
    /// Collective payload bytes each rank received during the phase.
    pub received: Vec<u64>,
    /// Storage requests each rank made during the phase.
    pub requests: Vec<Requests>,
}

/// One save and load of the reference model.
#[derive(Debug)]
pub(super) struct Run {
    pub save: Phase,
    pub load: Phase,
    /// Seconds to build every save rank's shard list and fill the distinct pieces.
    pub build_seconds: f64,
    /// Shard entries over all save ranks, and the distinct pieces among them.
    pub entries: usize,
    pub distinct: usize,
    /// Bytes of the distinct pieces (the save's state), and of every load rank's buffers.
    pub save_state_bytes: u64,
    pub load_state_bytes: u64,
    /// The save's outcome on rank 0, and the bytes each rank says it wrote, summed.
    pub outcome: SaveOutcome,
    pub rank_bytes: u64,
    /// The largest `LoadOutcome::metadata_bytes` over the load ranks, and that rank.
    pub metadata_bytes_max: (u64, usize),
    pub elements_checked: u64,
}

/// Saves `save` (its world as threads) into `store`, loads it with `load`'s world and checks
/// every element; fails on any rank's failure or a wrong element.
pub(super) fn run(save: &ReferenceModel, load: &ReferenceModel, store: &Arc<dyn Storage>) -> Result<Run> {
    let values = Synthetic::new(0);
    let t = Instant::now();
    let shared = Shared::build(save, values);
    let build_seconds = t.elapsed().as_secs_f64();
    let (save_phase, outcomes) = save_all(save, &shared, store)?;
    eprintln!(
        "dckpt bench scale: {} ranks saved in {:.2} s; loading with {}",
        save.layout.world_size, save_phase.seconds, load.layout.world_size
    );
    let outcome = outcomes.first().context("a world has a rank 0")?.clone();
    let rank_bytes = outcomes.iter().map(|o| o.rank_bytes).sum();
    let (entries, distinct, save_state_bytes) =
        (shared.ranks.iter().map(Vec::len).sum(), shared.bufs.len(), shared.bytes());
    drop(shared);
    let meta = Checkpointer::local().metadata(store).context("reading the metadata for the check")?;
    let shapes: HashMap<String, Dims> = meta.tensors.into_iter().map(|t| (t.key, t.global_shape)).collect();
    let loaded = load_all(load, store, values, &shapes)?;
    let metadata_bytes_max =
        loaded.ranks.iter().enumerate().map(|(r, l)| (l.metadata_bytes, r)).max_by_key(|m| m.0).unwrap_or((0, 0));
    Ok(Run {
        save: save_phase,
        load: loaded.phase,
        build_seconds,
        entries,
        distinct,
        save_state_bytes,
        load_state_bytes: loaded.ranks.iter().map(|l| l.state_bytes).sum(),
        outcome,
        rank_bytes,
        metadata_bytes_max,
        elements_checked: loaded.ranks.iter().map(|l| l.checked).sum(),
    })
}

/// Every save rank's pieces, each naming one of the distinct pieces' buffers.
struct Shared {
    bufs: Vec<Vec<u8>>,
    ranks: Vec<Vec<(ShardedTensor, usize)>>,
}

impl Shared {
    fn build(model: &ReferenceModel, values: Synthetic) -> Shared {
        let mut index: HashMap<(Key, Region), usize> = HashMap::new();
        let mut bufs: Vec<Vec<u8>> = Vec::new();
        let ranks = (0..model.layout.world_size)
            .map(|r| {
                let pieces = model.rank_state(r).into_iter().map(|t| {
                    let i = *index.entry((t.key.clone(), t.region.clone())).or_insert_with(|| {
                        let mut b = vec![0u8; t.nbytes() as usize];
                        values.fill(&t, &mut b);
                        bufs.push(b);
                        bufs.len() - 1
                    });
                    (t, i)
                });
                pieces.collect()
            })
            .collect();
        Shared { bufs, ranks }
    }

    fn bytes(&self) -> u64 {
        self.bufs.iter().map(|b| b.len() as u64).sum()
    }

    fn state(&self, rank: usize) -> SaveState<'_> {
        let tensors =
            self.ranks[rank].iter().map(|(t, i)| TensorData { tensor: t.clone(), data: &self.bufs[*i] }).collect();
        SaveState { tensors, objects: Vec::new() }
    }
}

/// One rank's part of a phase: when it started and returned, what it received and asked.
struct Timed<T> {
    start: Instant,
    end: Instant,
    received: u64,
    requests: Requests,
    value: T,
}

/// The phase over all ranks, and each rank's value.
fn phase<T>(ranks: Vec<Timed<T>>) -> Result<(Phase, Vec<T>)> {
    let start = ranks.iter().map(|r| r.start).min().context("a world has ranks")?;
    let end = ranks.iter().map(|r| r.end).max().context("a world has ranks")?;
    let received = ranks.iter().map(|r| r.received).collect();
    let requests = ranks.iter().map(|r| r.requests).collect();
    let phase = Phase { seconds: end.duration_since(start).as_secs_f64(), received, requests };
    Ok((phase, ranks.into_iter().map(|r| r.value).collect()))
}

/// Runs a phase on every rank of a `world`-thread group, each with its own checkpointer and
/// counted store: `prepare` builds the rank's input, a barrier starts the clock, `body` is
/// timed and counted, a second barrier stops every rank's part before `finish` (the check)
/// runs, so no rank times or counts another's remaining work.
fn timed<P, T, U: Send>(
    world: u32,
    store: &Arc<dyn Storage>,
    prepare: impl Fn(usize) -> P + Sync,
    body: impl Fn(&mut P, &Checkpointer, &Arc<dyn Storage>) -> Result<T> + Sync,
    finish: impl Fn(usize, P, T) -> Result<U> + Sync,
) -> Result<Vec<Timed<U>>> {
    let opts = crate::demo::collective_options()?;
    let ranks = ThreadGroup::run(world as usize, &opts, |r, c: ThreadCollective| -> Result<Timed<U>> {
        let c = Arc::new(c);
        let ckpt = Checkpointer::new(c.clone());
        let counters = Arc::new(Counters::default());
        let counted: Arc<dyn Storage> = Arc::new(Counted { inner: store.clone(), counters: counters.clone() });
        let mut input = prepare(r);
        barrier(&c, r, "before")?;
        let (received, start) = (c.bytes_received(), Instant::now());
        let value = body(&mut input, &ckpt, &counted);
        let end = Instant::now();
        let received = c.bytes_received() - received;
        let requests = counters.requests.snapshot();
        let value = value.with_context(|| format!("rank {r}"))?;
        barrier(&c, r, "after")?;
        let value = finish(r, input, value)?;
        Ok(Timed { start, end, received, requests, value })
    })?;
    // Every rank fails with the same error; report the first.
    ranks.into_iter().collect()
}

fn barrier(c: &ThreadCollective, rank: usize, when: &str) -> Result<()> {
    c.barrier().with_context(|| format!("rank {rank}: the barrier {when} the phase"))
}

fn save_all(model: &ReferenceModel, shared: &Shared, store: &Arc<dyn Storage>) -> Result<(Phase, Vec<SaveOutcome>)> {
    let opts = save_options(model);
    let ranks = timed(
        model.layout.world_size,
        store,
        |r| shared.state(r),
        |state, ckpt, counted| Ok(ckpt.save(counted, state, &opts)?),
        |_, _, outcome| Ok(outcome),
    )?;
    let (phase, outcomes) = phase(ranks)?;
    if let Some(o) = outcomes.first()
        && o.chunks != shared.bufs.len()
    {
        bail!("the save stored {} chunks; the ranks hold {} distinct pieces", o.chunks, shared.bufs.len());
    }
    Ok((phase, outcomes))
}

/// What one load rank found.
struct Loaded {
    state_bytes: u64,
    metadata_bytes: u64,
    checked: u64,
}

struct LoadRun {
    phase: Phase,
    ranks: Vec<Loaded>,
}

fn load_all(
    model: &ReferenceModel,
    store: &Arc<dyn Storage>,
    values: Synthetic,
    shapes: &HashMap<String, Dims>,
) -> Result<LoadRun> {
    let opts = LoadOptions::default();
    let ranks = timed(
        model.layout.world_size,
        store,
        |r| RankState::empty(model, r as u32),
        |state, ckpt, counted| Ok(ckpt.load(counted, &mut state.request(), &opts)?),
        |r, state, out| {
            let checked = state.check(values, shapes).map_err(|e| anyhow!("load rank {r}: {e}"))?;
            Ok(Loaded { state_bytes: state.bytes(), metadata_bytes: out.metadata_bytes, checked })
        },
    )?;
    let (phase, ranks) = phase(ranks)?;
    Ok(LoadRun { phase, ranks })
}
