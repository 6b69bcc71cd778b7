//! Save and load figures on local disk and S3, each against plain IO of the same bytes.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use dckpt::collective::{Collective, ThreadGroup};
use dckpt::engine::Engine;
use dckpt::layout::{Layout, ModelSpec, OptimizerMode, ParallelConfig, ReferenceModel, Synthetic};
use dckpt::spec::{DType, Region, ReplicaId, ShardedTensor};
use dckpt::storage::Storage;
use dckpt::{Checkpointer, LoadOptions, LoadRequest, ReplicaCheck, SaveOptions, SaveState, TensorData, TensorRequest};
use dckpt_reference::{RankState, save_options};

use super::ceilings::{
    PARALLEL_COUNTS, drop_caches, fastest_count, parallel_read, parallel_write, plain_read, plain_write, three_way,
    tries_note,
};
use super::{BenchArgs, Figure, alternating, gbps, median, pair, peak_rss_bytes, reset_peak_rss, rss_bytes, run_ranks};
use crate::fmt;

/// A `gpt-small`-shaped model with Adam state whose layer count makes about `bytes`.
fn bench_spec(bytes: u64) -> ModelSpec {
    let base = ModelSpec { num_query_groups: Some(4), ..ModelSpec::preset("gpt-small").expect("preset") };
    let with = |l: u64| ModelSpec { num_layers: l, ..base.clone() }.expected_bytes(2, OptimizerMode::Adam);
    let per_layer = with(4) - with(2);
    let outside = with(2) - 2 * per_layer / 2;
    let layers = (bytes.saturating_sub(outside) / (per_layer / 2)).max(2);
    ModelSpec { num_layers: layers + layers % 2, ..base }
}

fn model(spec: &ModelSpec, world: u32, tp: u32, pp: u32) -> Result<ReferenceModel> {
    let layout = Layout::new(ParallelConfig { tp, pp, ..Default::default() }, world)?;
    Ok(ReferenceModel::new(spec.clone(), layout, OptimizerMode::Adam)?)
}

fn filled(m: &ReferenceModel) -> Vec<RankState> {
    (0..m.layout.world_size).map(|r| RankState::filled(m, r, Synthetic::new(1))).collect()
}

fn empty(m: &ReferenceModel) -> Vec<RankState> {
    (0..m.layout.world_size).map(|r| RankState::empty(m, r)).collect()
}

fn local(dir: &Path) -> Result<Arc<dyn Storage>> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    Ok(crate::store::open(dir.to_str().context("non-UTF-8 directory")?)?)
}

/// Saves `states` (one per rank); seconds.
fn save(store: &Arc<dyn Storage>, states: &[RankState], opts: &SaveOptions) -> Result<f64> {
    let t = Instant::now();
    for (r, o) in run_ranks(states.len(), |r, c| Engine::new(c).save(store.as_ref(), &states[r].save_state(), opts))?
        .into_iter()
        .enumerate()
    {
        o.with_context(|| format!("save on rank {r}"))?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Loads into `states` (one per rank); seconds.
fn load(store: &Arc<dyn Storage>, states: &mut [RankState]) -> Result<f64> {
    load_counting(store, states).map(|(secs, _)| secs)
}

/// Loads into `states` (one per rank); seconds and the bytes all ranks read from storage.
fn load_counting(store: &Arc<dyn Storage>, states: &mut [RankState]) -> Result<(f64, u64)> {
    let opts = LoadOptions::default();
    let t = Instant::now();
    let cells: Vec<std::sync::Mutex<&mut RankState>> = states.iter_mut().map(std::sync::Mutex::new).collect();
    let mut read = 0;
    for (r, o) in run_ranks(cells.len(), |r, c| {
        let mut s = cells[r].lock().expect("one rank per state");
        s.load(&Engine::new(c), store.as_ref(), &opts)
    })?
    .into_iter()
    .enumerate()
    {
        read += o.with_context(|| format!("load on rank {r}"))?.bytes_read;
    }
    Ok((t.elapsed().as_secs_f64(), read))
}

pub fn local_figures(a: &BenchArgs) -> Result<Vec<Figure>> {
    let spec = bench_spec(a.bytes);
    let m2 = model(&spec, 2, 2, 1)?;
    let bytes = m2.expected_bytes() as f64;
    eprintln!(
        "dckpt bench: {} of state ({} layers of gpt-small shape, Adam), 2 ranks, in {}",
        fmt::bytes(bytes as u64),
        spec.num_layers,
        a.dir().display()
    );

    let states = filled(&m2);
    let mut figs = save_figures(a, &m2, &states)?;
    figs.push(async_figure(a, &m2, &states)?);
    drop(states);
    figs.extend(load_figures(a, &m2)?);
    figs.push(reshard(a, &spec)?);
    figs.extend(small_tensors(a)?);
    let _ = std::fs::remove_dir_all(a.dir());
    Ok(figs)
}

/// Save vs a plain write with fsync; the first dckpt round also measures peak memory.
fn save_figures(a: &BenchArgs, m2: &ReferenceModel, states: &[RankState]) -> Result<Vec<Figure>> {
    let bytes = m2.expected_bytes() as f64;
    let (ckpt, plain) = (a.dir().join("ckpt"), a.dir().join("plain"));
    let opts = save_options(m2);
    // One write first, not counted: the first writer after a quiet spell was up to 1.7x
    // faster on this machine's virtual disk, which favoured whichever side went first.
    plain_write(&plain, states)?;
    let parallel = a.dir().join("parallel");
    let (writers, tries) = fastest_count(|n| parallel_write(&parallel, states, n))?;
    let mut extra_rss = None;
    let rounds = three_way(
        a.rounds,
        || {
            let store = local(&ckpt)?;
            let before = rss_bytes();
            let reset = reset_peak_rss();
            let d = save(&store, states, &opts)?;
            if reset && extra_rss.is_none() {
                extra_rss = Some(peak_rss_bytes().saturating_sub(before));
            }
            Ok(d)
        },
        || plain_write(&plain, states),
        || parallel_write(&parallel, states, writers),
    )?;
    let _ = std::fs::remove_dir_all(&parallel);
    let single = gbps(bytes, &rounds.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>());
    let many = gbps(bytes, &rounds.iter().map(|r| (r.0, r.2)).collect::<Vec<_>>());
    let extra_rss = extra_rss.unwrap_or(0);
    let save_vs_write = Figure::paired(
        "save_vs_write",
        &single,
        "GB/s: dckpt save (2 ranks, fsync, commit) vs one plain sequential write + fsync",
    );
    let save_vs_parallel_write = Figure::paired(
        "save_vs_parallel_write",
        &many,
        format!(
            "GB/s: the same dckpt saves vs {writers} plain writers in parallel, each writing and fsyncing its own \
             file of a contiguous part of the same bytes (the fastest of {PARALLEL_COUNTS:?} writers, one try \
             each: {})",
            tries_note(&tries)
        ),
    );
    let rss = Figure {
        name: "save_peak_rss_extra_bytes".into(),
        value: Some(extra_rss as f64),
        ceiling: Some((256u64 << 20) as f64),
        ratio: Some(extra_rss as f64 / (256u64 << 20) as f64),
        note: Some(format!("peak RSS during a synchronous save above the {} held before it", fmt::bytes(rss_bytes()))),
        by_kind: None,
    };
    Ok(vec![save_vs_write, save_vs_parallel_write, rss])
}

/// Async save: the time the caller is blocked vs copying the state, in the steady state
/// of a training loop that saves every so many steps: one engine per rank for every round,
/// keeping its staging buffers between saves (`SaveOptions::keep_staging`), against a copy
/// into buffers kept from the previous round likewise. A first round, not counted, pays
/// for the fresh memory on both sides.
fn async_figure(a: &BenchArgs, m2: &ReferenceModel, states: &[RankState]) -> Result<Figure> {
    let async_dir = a.dir().join("async");
    let keep = SaveOptions { keep_staging: true, ..save_options(m2) };
    // The two sides start together on every rank: a barrier over a second in-process world,
    // which fails (instead of waiting forever) when a rank is gone, even by a panic.
    let sides: Vec<std::sync::Mutex<Option<_>>> =
        ThreadGroup::new(states.len())?.into_iter().map(|c| std::sync::Mutex::new(Some(c))).collect();
    let per_rank = run_ranks(states.len(), |r, c| -> Result<Vec<(f64, f64)>> {
        let sync = sides[r].lock().map_err(|_| anyhow::anyhow!("rank {r}: a bench lock was poisoned"))?.take();
        let sync = sync.context("one barrier handle per rank")?;
        let e = Engine::new(c);
        let mut kept: Vec<Vec<u8>> = Vec::new();
        let mut dckpt = || -> Result<f64> {
            // Rank 0 clears the directory; a failure there still meets the other rank at
            // the barrier, whose save then fails for want of rank 0.
            let cleared = if r == 0 { local(&async_dir).map(drop) } else { Ok(()) };
            sync.barrier().context("before the async save")?;
            cleared?;
            let store = crate::store::open(async_dir.to_str().context("non-UTF-8 directory")?)?;
            let t = Instant::now();
            let h = e.save_async(store, &states[r].save_state(), &keep)?;
            let blocked = t.elapsed().as_secs_f64();
            h.wait()?;
            Ok(blocked)
        };
        let mut ceiling = || -> Result<f64> {
            sync.barrier().context("before the copy")?;
            let t = Instant::now();
            if kept.is_empty() {
                kept = states[r].buffers.iter().map(|b| b.to_vec()).collect();
            } else {
                for (k, b) in kept.iter_mut().zip(&states[r].buffers) {
                    k.copy_from_slice(b);
                }
            }
            let s = t.elapsed().as_secs_f64();
            std::hint::black_box(&kept);
            Ok(s)
        };
        (0..=a.rounds).map(|i| pair(i % 2 == 0, &mut dckpt, &mut ceiling)).collect()
    })?;
    let per_rank = per_rank.into_iter().collect::<Result<Vec<_>>>()?;
    // Each round's seconds are those of the slowest rank.
    let slowest = |i: usize| per_rank.iter().map(|p| p[i]).fold((0.0f64, 0.0f64), |m, (d, c)| (m.0.max(d), m.1.max(c)));
    let first = slowest(0);
    let rounds: Vec<(f64, f64)> = (1..=a.rounds).map(slowest).collect();
    Ok(Figure::paired(
        "async_block_vs_memcpy",
        &rounds,
        format!(
            "seconds the caller is blocked by save_async vs copying the state (lower is better), steady state: \
             staging buffers kept between saves (keep_staging), the copy into kept buffers; the first save and \
             copy, into fresh memory, took {:.3} s and {:.3} s",
            first.0, first.1
        ),
    ))
}

/// Loads of the last checkpoint the save figures wrote: warm, then cold, vs plain reads of
/// its files.
fn load_figures(a: &BenchArgs, m2: &ReferenceModel) -> Result<Vec<Figure>> {
    let bytes = m2.expected_bytes() as f64;
    let ckpt = a.dir().join("ckpt");
    let mut figs = Vec::new();
    let mut targets = empty(m2);
    let store = crate::store::open(ckpt.to_str().context("path")?)?;
    load(&store, &mut targets)?;
    let (mut buf, mut bufs) = (Vec::new(), Vec::new());
    plain_read(&ckpt, &mut buf)?;
    let mapped_readers = 2;
    parallel_read(&ckpt, &mut bufs, mapped_readers, true)?;
    let rounds = three_way(
        a.rounds,
        || load(&store, &mut targets),
        || plain_read(&ckpt, &mut buf),
        || parallel_read(&ckpt, &mut bufs, mapped_readers, true),
    )?;
    let warm = |pick: fn(&(f64, f64, f64)) -> f64| -> Vec<(f64, f64)> {
        gbps(bytes, &rounds.iter().map(|r| (r.0, pick(r))).collect::<Vec<_>>())
    };
    figs.push(Figure::paired(
        "load_warm_vs_read",
        &warm(|r| r.1),
        "GB/s: dckpt load, same layout, page cache warm, checksums verified vs a plain read of the same files",
    ));
    figs.push(Figure::paired(
        "load_warm_vs_mmap",
        &warm(|r| r.2),
        format!(
            "GB/s: the same dckpt loads vs {mapped_readers} threads (one per rank) mapping the same files \
             (MAP_POPULATE) and copying them into buffers allocated and touched beforehand, nothing checked"
        ),
    ));
    if drop_caches() {
        let cold = |f: &mut dyn FnMut() -> Result<f64>| -> Result<f64> {
            drop_caches();
            f()
        };
        let (readers, tries) = fastest_count(|n| cold(&mut || parallel_read(&ckpt, &mut bufs, n, false)))?;
        let rounds = three_way(
            a.rounds,
            || cold(&mut || load(&store, &mut targets)),
            || cold(&mut || plain_read(&ckpt, &mut buf)),
            || cold(&mut || parallel_read(&ckpt, &mut bufs, readers, false)),
        )?;
        let pick = |second: bool| -> Vec<(f64, f64)> {
            gbps(bytes, &rounds.iter().map(|r| (r.0, if second { r.1 } else { r.2 })).collect::<Vec<_>>())
        };
        figs.push(Figure::paired(
            "load_cold_vs_read",
            &pick(true),
            "GB/s: after dropping the page cache, dckpt load vs a plain read",
        ));
        figs.push(Figure::paired(
            "load_cold_vs_parallel_read",
            &pick(false),
            format!(
                "GB/s: after dropping the page cache, the same dckpt loads vs {readers} plain readers in parallel, the \
                 files dealt among them (the fastest of {PARALLEL_COUNTS:?} readers, one try each: {})",
                tries_note(&tries)
            ),
        ));
    } else {
        let why = "the page cache cannot be dropped here (needs root and a writable /proc/sys/vm/drop_caches)";
        figs.push(Figure::missing("load_cold_vs_read", why));
        figs.push(Figure::missing("load_cold_vs_parallel_read", why));
    }
    Ok(figs)
}

/// The replica check's cost (`dckpt bench replicas`): the same state, every byte of it held
/// by both ranks (tp 1, so dp 2), saved with [`ReplicaCheck::All`] and with the default
/// sample, each against [`ReplicaCheck::Off`], alternating; on local disk, and (All) in
/// memory, where no disk hides the checksums' CPU time.
pub fn replica_check(a: &BenchArgs) -> Result<Vec<Figure>> {
    // Each rank holds the whole state: half the bytes of the other figures by default.
    let spec = bench_spec(a.bytes / 2);
    let m = model(&spec, 2, 1, 1)?;
    let bytes = m.expected_bytes() as f64;
    let states = filled(&m);
    let held: u64 = states.iter().map(|s| s.bytes()).sum();
    let with = |replica_check| SaveOptions { replica_check, ..save_options(&m) };
    let (all, sample, off) = (with(ReplicaCheck::All), with(ReplicaCheck::default()), with(ReplicaCheck::Off));
    let dir = a.dir().join("replicas");
    eprintln!(
        "dckpt bench replicas: {} stored, {} held by 2 ranks (dp 2), in {}",
        fmt::bytes(bytes as u64),
        fmt::bytes(held),
        dir.display()
    );
    let on_disk = |opts: &SaveOptions| -> Result<f64> { save(&local(&dir)?, &states, opts) };
    // One save first, not counted (see `local_figures`).
    on_disk(&off)?;
    let disk_all = gbps(bytes, &alternating(a.rounds, || on_disk(&all), || on_disk(&off))?);
    let disk_sample = gbps(bytes, &alternating(a.rounds, || on_disk(&sample), || on_disk(&off))?);
    let in_memory = |opts: &SaveOptions| -> Result<f64> { save(&crate::store::open("memory://")?, &states, opts) };
    let memory_all = gbps(bytes, &alternating(a.rounds, || in_memory(&all), || in_memory(&off))?);
    let _ = std::fs::remove_dir_all(&dir);
    let note = |what: &str| {
        format!(
            "GB/s: save with replica_check {what} vs Off; {} stored, every byte held by both ranks (dp 2, {} in all)",
            fmt::bytes(bytes as u64),
            fmt::bytes(held)
        )
    };
    Ok(vec![
        Figure::paired("replica_check_all_vs_off", &disk_all, note("All, local disk (fsync, commit),")),
        Figure::paired("replica_check_default_vs_off", &disk_sample, note("default (a sample), local disk,")),
        Figure::paired("replica_check_all_memory", &memory_all, note("All, memory storage,")),
    ])
}

/// The resharded-load figure on its own (`dckpt bench reshard`).
pub fn reshard_alone(a: &BenchArgs) -> Result<Figure> {
    let fig = reshard(a, &bench_spec(a.bytes))?;
    let _ = std::fs::remove_dir_all(a.dir());
    Ok(fig)
}

/// Resharded load (tp 2 -> 4, pp 2 -> 1) vs a same-layout load of the same checkpoint.
fn reshard(a: &BenchArgs, spec: &ModelSpec) -> Result<Figure> {
    let from = model(spec, 4, 2, 2)?;
    let to = model(spec, 4, 4, 1)?;
    let bytes = from.expected_bytes() as f64;
    let reshard_dir = a.dir().join("reshard");
    let rstore = local(&reshard_dir)?;
    {
        let states = filled(&from);
        save(&rstore, &states, &save_options(&from))?;
    }
    let mut same = empty(&from);
    let mut other = empty(&to);
    let (_, same_read) = load_counting(&rstore, &mut same)?;
    let (_, other_read) = load_counting(&rstore, &mut other)?;
    let rounds = gbps(bytes, &alternating(a.rounds, || load(&rstore, &mut other), || load(&rstore, &mut same))?);
    let fig = Figure::paired(
        "reshard_vs_load",
        &rounds,
        format!(
            "GB/s: load at tp 4 pp 1 of a tp 2 pp 2 checkpoint vs loading it at tp 2 pp 2 (4 ranks, warm); \
             the resharded load reads {:.2}x the bytes of the same-layout load",
            other_read as f64 / same_read.max(1) as f64
        ),
    );
    drop(same);
    drop(other);
    let _ = std::fs::remove_dir_all(&reshard_dir);
    Ok(fig)
}

/// 20,000 tensors of 4 KiB vs one tensor of the same bytes: save + load on one rank; and
/// what each tensor costs beyond its bytes, from the same rounds.
pub fn small_tensors(a: &BenchArgs) -> Result<Vec<Figure>> {
    const N: u64 = 20_000;
    const ELEMS: u64 = 1024;
    let t = |key: String, shape: Vec<u64>| ShardedTensor {
        key: key.into(),
        dtype: DType::F32,
        global_shape: shape.clone().into(),
        region: Region::full(&shape),
        replica_id: ReplicaId::MAIN,
    };
    let small: Vec<ShardedTensor> = (0..N).map(|i| t(format!("small.{i:05}"), vec![ELEMS])).collect();
    let large = vec![t("large".into(), vec![N, ELEMS])];
    let data = vec![7u8; (N * ELEMS * 4) as usize];
    let bytes = data.len() as f64;
    // The CPU each side's save and load take, beside their wall time.
    let (mut cpu_small, mut cpu_large) = (Vec::new(), Vec::new());
    let timed = |tensors: &[ShardedTensor], cpu: &mut Vec<f64>| -> Result<f64> {
        let (s, c) = small_round(&a.dir().join("small"), tensors, &data)?;
        cpu.push(c);
        Ok(s)
    };
    let seconds = alternating(a.rounds, || timed(&small, &mut cpu_small), || timed(&large, &mut cpu_large))?;
    // What a tensor costs itself, as CPU time: the ratio also moves with the bytes' time
    // (memory and the disk).
    let each: Vec<f64> = cpu_small.iter().zip(&cpu_large).map(|(s, l)| (s - l) / N as f64 * 1e6).collect();
    let listed: Vec<String> = each.iter().map(|u| format!("{u:.2}")).collect();
    let per_tensor = Figure::plain(
        "small_tensors_cpu_us_per_tensor",
        median(each),
        format!(
            "µs of CPU (every thread's, user and system) a tensor costs beyond its bytes: the 20,000 tensors' save + \
             load less the one tensor's, over 20,000; per round: {}",
            listed.join(", ")
        ),
    );
    let ratio = Figure::paired(
        "small_tensors_vs_large",
        &gbps(bytes, &seconds),
        "GB/s of save + load: 20,000 tensors of 4 KiB vs one tensor of the same 78 MiB",
    );
    Ok(vec![ratio, per_tensor])
}

/// One save and load of `data` as `tensors` (equal parts, in order) in a fresh store at
/// `dir`: its wall seconds and the process's CPU seconds.
fn small_round(dir: &Path, tensors: &[ShardedTensor], data: &[u8]) -> Result<(f64, f64)> {
    let store = local(dir)?;
    let per = data.len() / tensors.len();
    let state = SaveState {
        tensors: tensors
            .iter()
            .enumerate()
            .map(|(i, t)| TensorData { tensor: t.clone(), data: &data[i * per..(i + 1) * per] })
            .collect(),
        objects: Vec::new(),
    };
    let mut out = vec![0u8; data.len()];
    // The caller's request is made before the clock starts, as its state is: describing
    // 20,000 tensors is the caller's work, not the checkpointer's.
    let mut req = LoadRequest {
        tensors: tensors
            .iter()
            .zip(out.chunks_mut(per))
            .map(|(t, d)| TensorRequest {
                tensor: t.clone(),
                data: d,
                allow_shape_mismatch: false,
                allow_dtype_cast: false,
            })
            .collect(),
        ..LoadRequest::default()
    };
    let (start, cpu) = (Instant::now(), super::cpu_seconds());
    let ckpt = Checkpointer::local();
    let saving = ckpt.save(&store, &state, &SaveOptions::default())?;
    let saved = start.elapsed().as_secs_f64();
    let loading = ckpt.load(&store, &mut req, &LoadOptions::default())?;
    let s = start.elapsed().as_secs_f64();
    let cpu = super::cpu_seconds() - cpu;
    drop(req);
    if std::env::var_os("DCKPT_BENCH_VERBOSE").is_some() {
        let (sp, lp) = (saving.phases, loading.phases);
        let ms = |p: dckpt::Slowest| p.time.as_secs_f64() * 1e3;
        eprintln!(
            "{} tensors: save {saved:.3} s (plan {:.1} ms, write {:.1}, commit {:.1}), \
             load {:.3} s (metadata {:.1} ms, plan {:.1}, read {:.1})",
            tensors.len(),
            ms(sp.plan),
            ms(sp.write),
            ms(sp.commit),
            s - saved,
            ms(lp.metadata),
            ms(lp.plan),
            ms(lp.read),
        );
    }
    if out != data {
        bail!("small-tensor round trip changed the bytes");
    }
    Ok((s, cpu))
}

pub fn s3_figures(a: &BenchArgs) -> Result<Vec<Figure>> {
    let Some(url) = std::env::var("DCKPT_TEST_S3_URL").ok().filter(|u| !u.is_empty()) else {
        let note = "no S3 server: set DCKPT_TEST_S3_URL and AWS_* (cargo xtask bench starts one)";
        return Ok(vec![Figure::missing("s3_save_vs_put", note), Figure::missing("s3_load_vs_get", note)]);
    };
    let spec = bench_spec(a.bytes.min(256 << 20));
    let m = model(&spec, 2, 2, 1)?;
    let bytes = m.expected_bytes() as f64;
    let states = filled(&m);
    let opts = save_options(&m);
    let blobs: Vec<Bytes> = states.iter().map(|s| Bytes::from(s.buffers.concat())).collect();
    let base = format!("{}/bench-{}", url.trim_end_matches('/'), std::process::id());
    let plain: Arc<dyn Storage> = crate::store::open(&format!("{base}/plain"))?;
    let mut targets = empty(&m);
    let (mut save_rounds, mut load_rounds) = (Vec::new(), Vec::new());
    for i in 0..a.rounds {
        let store: Arc<dyn Storage> = crate::store::open(&format!("{base}/ckpt-{i}"))?;
        let mut put = || -> Result<f64> {
            let t = Instant::now();
            for r in run_ranks(blobs.len(), |r, _| plain.put(&format!("rank-{r}"), blobs[r].clone()))? {
                r?;
            }
            Ok(t.elapsed().as_secs_f64())
        };
        let mut get = || -> Result<f64> {
            let t = Instant::now();
            for r in run_ranks(blobs.len(), |r, _| plain.get(&format!("rank-{r}")))? {
                r?;
            }
            Ok(t.elapsed().as_secs_f64())
        };
        save_rounds.push(pair(i % 2 == 0, &mut || save(&store, &states, &opts), &mut put)?);
        load_rounds.push(pair(i % 2 == 0, &mut || load(&store, &mut targets), &mut get)?);
        for o in store.list("")? {
            store.delete(&o.path)?;
        }
    }
    for o in plain.list("")? {
        plain.delete(&o.path)?;
    }
    let (save_rounds, load_rounds) = (gbps(bytes, &save_rounds), gbps(bytes, &load_rounds));
    let note = format!(
        "{} state, 2 ranks, against {}",
        fmt::bytes(bytes as u64),
        std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "S3".into())
    );
    Ok(vec![
        Figure::paired("s3_save_vs_put", &save_rounds, format!("GB/s: dckpt save vs one plain put per rank, {note}")),
        Figure::paired("s3_load_vs_get", &load_rounds, format!("GB/s: dckpt load vs one plain get per rank, {note}")),
    ])
}

/// The model the local save/load figures use for `bytes` of state: tp 2 on 2 ranks, Adam
/// (for companions that measure other engines on the same state).
pub fn bench_model(bytes: u64) -> Result<ReferenceModel> {
    model(&bench_spec(bytes), 2, 2, 1)
}
