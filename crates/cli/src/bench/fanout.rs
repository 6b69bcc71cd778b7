//! `dckpt bench fanout`: a load at data-parallel 4 with the fan-out (each stretch read from
//! storage by one replica and sent to the others) against every replica reading its own.
//!
//! 4 ranks, threads of this process, save four tensors split by rows, a quarter each; then
//! every rank loads every tensor whole, as data-parallel replicas do, with
//! [`LoadOptions::fan_out`] and without it, alternating; on local disk (under --dir) and on
//! S3 where a server is configured, over the thread collective and over TCP on loopback
//! (each rank its own [`TcpCollective`]). One round of each side first, not counted, checks
//! every byte loaded and counts the bytes read.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use dckpt::collective::{Collective, TcpCollective, TcpConfig, TcpOptions};
use dckpt::spec::{DType, Region, ReplicaId, ShardedTensor};
use dckpt::storage::Storage;
use dckpt::{Checkpointer, LoadOptions, LoadRequest, Location, SaveOptions, SaveState};

use super::{BenchArgs, Figure, alternating, gbps, run_ranks};
use crate::fmt;

const WORLD: usize = 4;
const TENSORS: usize = 4;
const COLS: u64 = 64 << 10;
/// The most state on local disk (every rank holds all of it loaded, so the process about
/// five times it); in `all`, and on S3 (an emulator's bandwidth), less.
const MAX_BYTES: u64 = 512 << 20;
const SMALL_BYTES: u64 = 128 << 20;

/// How the ranks talk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum World {
    Threads,
    Tcp,
}

impl World {
    /// Runs `f(rank, collective)` on the `WORLD` ranks; the results in rank order.
    fn run<T: Send>(self, f: impl Fn(usize, Arc<dyn Collective>) -> Result<T> + Sync) -> Result<Vec<T>> {
        let out = match self {
            World::Threads => run_ranks(WORLD, &f)?,
            World::Tcp => {
                let port = crate::launch::job::free_port()?;
                let mut opts =
                    TcpOptions { listen_addr: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)), ..TcpOptions::default() };
                opts.rendezvous_timeout = Duration::from_secs(60);
                let (opts, f) = (&opts, &f);
                std::thread::scope(|s| {
                    let ranks: Vec<_> = (0..WORLD)
                        .map(|rank| {
                            s.spawn(move || -> Result<T> {
                                let cfg = TcpConfig {
                                    rank,
                                    world_size: WORLD,
                                    local_rank: rank,
                                    master_addr: "127.0.0.1".into(),
                                    master_port: port,
                                    job_id: format!("fanout-bench-{port}"),
                                };
                                f(rank, Arc::new(TcpCollective::connect(&cfg, opts)?))
                            })
                        })
                        .collect();
                    ranks
                        .into_iter()
                        .map(|t| t.join().unwrap_or_else(|_| Err(anyhow!("a bench rank panicked"))))
                        .collect()
                })
            }
        };
        out.into_iter().enumerate().map(|(r, o)| o.with_context(|| format!("rank {r}"))).collect()
    }
}

/// The state: `TENSORS` tensors of `rows x COLS` bytes.
struct State {
    rows: u64,
    data: Vec<Vec<u8>>,
}

impl State {
    fn new(bytes: u64) -> State {
        let rows = (bytes / TENSORS as u64 / COLS / WORLD as u64).max(1) * WORLD as u64;
        let data = (0..TENSORS)
            .map(|t| (0..rows * COLS).map(|i| (i.wrapping_mul(31) ^ (t as u64 * 97)) as u8).collect())
            .collect();
        State { rows, data }
    }

    fn bytes(&self) -> u64 {
        self.rows * COLS * TENSORS as u64
    }

    fn tensor(&self, t: usize, region: Region, rank: usize) -> ShardedTensor {
        ShardedTensor {
            key: format!("layers.{t}.weight").into(),
            dtype: DType::U8,
            global_shape: [self.rows, COLS].into(),
            region,
            replica_id: ReplicaId { dp: rank as u32, ..ReplicaId::MAIN },
        }
    }

    /// Every rank saves its quarter of the rows of each tensor.
    fn save(&self, store: &Arc<dyn Storage>) -> Result<()> {
        let quarter = self.rows / WORLD as u64;
        World::Threads.run(|r, c| {
            let mut s = SaveState::new();
            let span = (r as u64 * quarter * COLS) as usize..((r as u64 + 1) * quarter * COLS) as usize;
            for (t, d) in self.data.iter().enumerate() {
                let region = Region::boxed([r as u64 * quarter, 0], [quarter, COLS]);
                s.push_tensor(
                    ShardedTensor { replica_id: ReplicaId::MAIN, ..self.tensor(t, region, r) },
                    &d[span.clone()],
                );
            }
            Ok(Checkpointer::new(c).save(Location::Storage(store.clone()), &s, &SaveOptions::default())?)
        })?;
        Ok(())
    }

    /// Every rank loads every tensor whole into `targets[rank]`; the slowest rank's
    /// seconds and the bytes all ranks read from storage.
    fn load(
        &self,
        world: World,
        store: &Arc<dyn Storage>,
        targets: &mut [Vec<Vec<u8>>],
        fan_out: bool,
    ) -> Result<(f64, u64)> {
        let opts = LoadOptions { fan_out, ..LoadOptions::default() };
        let cells: Vec<Mutex<&mut Vec<Vec<u8>>>> = targets.iter_mut().map(Mutex::new).collect();
        let ranks = world.run(|r, c| -> Result<(f64, u64)> {
            let mut bufs = cells[r].lock().map_err(|_| anyhow::anyhow!("a bench lock was poisoned"))?;
            let mut req = LoadRequest::default();
            for (t, b) in bufs.iter_mut().enumerate() {
                req.push_tensor(self.tensor(t, Region::boxed([0, 0], [self.rows, COLS]), r), b);
            }
            c.barrier()?;
            let start = Instant::now();
            let out = Checkpointer::new(c).load(Location::Storage(store.clone()), &mut req, &opts)?;
            Ok((start.elapsed().as_secs_f64(), out.bytes_read))
        })?;
        Ok(ranks.into_iter().fold((0.0f64, 0), |(t, n), (secs, read)| (t.max(secs), n + read)))
    }

    fn targets(&self) -> Vec<Vec<Vec<u8>>> {
        (0..WORLD).map(|_| (0..TENSORS).map(|_| vec![0u8; (self.rows * COLS) as usize]).collect()).collect()
    }

    /// Loads once each way, checking every byte; the bytes read with and without the
    /// fan-out.
    fn checked(&self, world: World, store: &Arc<dyn Storage>) -> Result<(u64, u64)> {
        let mut read = [0; 2];
        for (i, fan_out) in [true, false].into_iter().enumerate() {
            let mut targets = self.targets();
            read[i] = self.load(world, store, &mut targets, fan_out)?.1;
            for (r, bufs) in targets.iter().enumerate() {
                if let Some(t) = (0..TENSORS).find(|&t| bufs[t] != self.data[t]) {
                    bail!("rank {r} loaded layers.{t}.weight wrong (fan_out {fan_out})");
                }
            }
        }
        Ok((read[0], read[1]))
    }
}

/// The figures of one store: load GB/s per rank with the fan-out against without it, and
/// the bytes read over the state's.
fn world_figures(
    a: &BenchArgs,
    names: [&'static str; 2],
    world: World,
    store: &Arc<dyn Storage>,
    state: &State,
) -> Result<Vec<Figure>> {
    let (with, without) = state.checked(world, store)?;
    let mut targets = state.targets();
    let cell = std::cell::RefCell::new(&mut targets);
    let rounds = alternating(
        a.rounds,
        || Ok(state.load(world, store, &mut cell.borrow_mut(), true)?.0),
        || Ok(state.load(world, store, &mut cell.borrow_mut(), false)?.0),
    )?;
    let bytes = state.bytes() as f64;
    let [time_name, read_name] = names;
    let over = if world == World::Tcp { "TCP on loopback" } else { "the thread collective" };
    let note = format!(
        "GB/s each of {WORLD} data-parallel ranks loads (the slowest), {} of state, over {over}, with the fan-out vs \
         every rank reading its own",
        fmt::bytes(state.bytes())
    );
    Ok(vec![
        Figure::paired(time_name, &gbps(bytes, &rounds), note),
        Figure::plain(
            read_name,
            with as f64 / bytes,
            format!(
                "bytes all ranks read from storage over the state's: {} of {} with the fan-out; {:.3} without it",
                fmt::bytes(with),
                fmt::bytes(state.bytes()),
                without as f64 / bytes
            ),
        ),
    ])
}

/// Both worlds' figures on one store, named `fanout_{which}[_tcp]_...`.
fn store_figures(a: &BenchArgs, which: &str, store: &Arc<dyn Storage>, state: &State) -> Result<Vec<Figure>> {
    state.save(store)?;
    let mut out = Vec::new();
    for (world, tag) in [(World::Threads, ""), (World::Tcp, "_tcp")] {
        let names = figure_names(which, tag);
        out.extend(world_figures(a, names, world, store, state)?);
    }
    Ok(out)
}

/// The two figures' names of a store and a world.
fn figure_names(which: &str, tag: &str) -> [&'static str; 2] {
    match (which, tag) {
        ("local", "") => ["fanout_local_load_vs_no_fanout", "fanout_local_read_per_unique"],
        ("local", _) => ["fanout_local_tcp_load_vs_no_fanout", "fanout_local_tcp_read_per_unique"],
        (_, "") => ["fanout_s3_load_vs_no_fanout", "fanout_s3_read_per_unique"],
        _ => ["fanout_s3_tcp_load_vs_no_fanout", "fanout_s3_tcp_read_per_unique"],
    }
}

pub fn figures(a: &BenchArgs, all: bool) -> Result<Vec<Figure>> {
    let cap = if all { SMALL_BYTES } else { MAX_BYTES };
    let dir = a.dir().join("fanout");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let local = crate::store::open(dir.to_str().context("non-UTF-8 directory")?)?;
    let figures = store_figures(a, "local", &local, &State::new(a.bytes.min(cap)));
    let _ = std::fs::remove_dir_all(&dir);
    let mut out = figures?;
    match std::env::var("DCKPT_TEST_S3_URL").ok().filter(|u| !u.is_empty()) {
        Some(url) => {
            let store =
                crate::store::open(&format!("{}/fanout-bench-{}", url.trim_end_matches('/'), std::process::id()))?;
            let figures = store_figures(a, "s3", &store, &State::new(a.bytes.min(SMALL_BYTES)));
            for o in store.list("")? {
                store.delete(&o.path)?;
            }
            out.extend(figures?);
        }
        None => {
            let note = "no S3 server: set DCKPT_TEST_S3_URL and AWS_* (cargo xtask bench starts one)";
            for name in figure_names("s3", "").into_iter().chain(figure_names("s3", "_tcp")) {
                out.push(Figure::missing(name, note));
            }
        }
    }
    Ok(out)
}
