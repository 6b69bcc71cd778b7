//! `dckpt bench scale`: the whole save and load protocol at the world sizes of a large job,
//! ranks as threads of this process (`scale_threads`) and, separately, the `tiny` demo as
//! real processes under `dckpt launch` (`scale_procs`).
//!
//! The model is `moe-xl` narrowed ([`ModelSpec::narrowed`]) to a hidden width of 1 and
//! experts 8 wide: its 64 layers, 256 experts and 128 heads of width 128 kept, every tensor
//! a fixed fraction of `moe-xl`'s, 64 MiB of parameters and optimizer state whatever the
//! world, in the pieces `moe-xl` has (see [`CHUNKS`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use dckpt::layout::{Layout, ModelSpec, OptimizerMode, ParallelConfig, ReferenceModel};
use dckpt::storage::Storage;

use super::scale_threads::{Phase, Requests, Run, run};
use super::{BenchArgs, Figure, peak_rss_bytes, reset_peak_rss, rss_bytes, scale_procs};
use crate::fmt;
use crate::progress::Request;

/// The hidden and expert widths of the narrowed `moe-xl` (7168 and 2048 in `moe-xl`).
pub const HIDDEN: u64 = 1;
pub const EXPERT_FFN: u64 = 8;

/// The save layout at 16,384 ranks and the load layout at 8,192 (`bench plan`'s and the
/// issue's): smaller worlds keep them where they fit (see [`fit`]).
const SAVE: ParallelConfig = ParallelConfig { tp: 8, pp: 16, cp: 1, ep: 64, etp: 1 };
const LOAD: ParallelConfig = ParallelConfig { tp: 4, pp: 8, cp: 1, ep: 32, etp: 1 };

/// Chunks and shard entries of the narrowed model at 16,384 ranks in the [`SAVE`] layout.
/// `bench plan` counts 138,624 and 656,600 for `moe-xl` itself: at hidden width 1 the
/// distributed optimizer's slices of 1/128 of a stage's dense parameters round to other
/// element boundaries than at 7168, which cuts 0.1% more pieces. Only a hidden width of 16
/// or more rounds as `moe-xl` does, and its dense parameters, replicated over the load's
/// 256 data-parallel ranks, would need 37 GB of load buffers.
pub const CHUNKS: usize = 138_750;
pub const ENTRIES: usize = 657_608;

/// Default world sizes, and those of `bench all` (which must stay short).
pub const RANKS: [usize; 3] = [1024, 4096, 16_384];
pub const RANKS_IN_ALL: [usize; 2] = [256, 1024];
pub const PROCESSES: [usize; 3] = [256, 512, 1024];

/// The narrowed `moe-xl`.
pub fn spec() -> ModelSpec {
    ModelSpec::preset("moe-xl").expect("moe-xl is a preset").narrowed(HIDDEN, EXPERT_FFN)
}

/// The figures of `bench scale` (`all`: as part of `bench all`, with its smaller defaults).
pub fn figures(a: &BenchArgs, all: bool) -> Result<Vec<Figure>> {
    let ranks = sizes(a.ranks.as_deref(), if all { &RANKS_IN_ALL } else { &RANKS });
    let processes = sizes(a.processes.as_deref(), if all { &[] } else { &PROCESSES });
    // Too many ranks alone would abort the process (a thread that cannot map its signal
    // stack aborts), so before any run; their writers may only fail, which the run's error
    // then explains.
    if let Some(h) = ranks.iter().find_map(|&n| thread_limits(n, n)) {
        bail!("{h}");
    }
    let mut figs = Vec::new();
    let mut seconds = Vec::new();
    for &n in &ranks {
        let (f, s) = threads(a, n)?;
        figs.extend(f);
        seconds.push((n, s));
    }
    if let Some(f) = ratio("scale_seconds_ratio", &seconds, 4, 5.0, "save + load seconds, ranks as threads") {
        figs.push(f);
    }
    let mut seconds = Vec::new();
    for &n in &processes {
        let f = scale_procs::figure(a, n);
        if let Some(s) = f.value {
            seconds.push((n, s));
        }
        figs.push(f);
    }
    if let Some(f) = ratio("scale_processes_seconds_ratio", &seconds, 2, 2.5, "wall seconds, ranks as processes") {
        figs.push(f);
    }
    Ok(figs)
}

/// The sizes asked for, or the defaults; 0 stands for none.
fn sizes(given: Option<&[usize]>, default: &[usize]) -> Vec<usize> {
    let mut v: Vec<usize> = given.unwrap_or(default).iter().copied().filter(|&n| n > 0).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The reference model on `world` ranks in the layout nearest `want`: expert parallelism
/// halved first, then pipeline, then tensor parallelism, until the world and the model
/// divide over it.
pub fn fit(spec: &ModelSpec, world: usize, want: ParallelConfig) -> Result<ReferenceModel> {
    let halvings = |v: u32| std::iter::successors(Some(v), |&x| (x > 1).then_some(x / 2));
    let world = u32::try_from(world).context("world size")?;
    for tp in halvings(want.tp) {
        for pp in halvings(want.pp) {
            for ep in halvings(want.ep) {
                let c = ParallelConfig { tp, pp, ep, ..want };
                let Ok(layout) = Layout::new(c, world) else { continue };
                if let Ok(m) = ReferenceModel::new(spec.clone(), layout, OptimizerMode::Distributed) {
                    return Ok(m);
                }
            }
        }
    }
    bail!("no layout of at most tp {} pp {} ep {} fits {world} ranks", want.tp, want.pp, want.ep)
}

fn layout_text(m: &ReferenceModel) -> String {
    let c = m.layout.config;
    format!(
        "{} ranks at tp {} pp {} ep {} (dp {}, expert dp {}), {}",
        m.layout.world_size, c.tp, c.pp, c.ep, m.layout.dp, m.layout.expert_dp, m.optimizer
    )
}

/// One world size with ranks as threads: its figures and its save + load seconds.
fn threads(a: &BenchArgs, n: usize) -> Result<(Vec<Figure>, f64)> {
    let spec = spec();
    let save = fit(&spec, n, SAVE)?;
    let load = fit(&spec, (n / 2).max(1), LOAD)?;
    eprintln!("dckpt bench scale: save {}; load {}", layout_text(&save), layout_text(&load));
    let hint = thread_limits(n, 2 * n);
    if let Some(h) = &hint {
        eprintln!("dckpt bench scale: warning: {h}");
    }
    let (store, dir) = store(a, n)?;
    let before = rss_bytes();
    let reset = reset_peak_rss();
    let r = run(&save, &load, &store).with_context(|| hint.unwrap_or_default())?;
    let peak = peak_rss_bytes();
    drop(store);
    if let Some(d) = dir {
        let _ = std::fs::remove_dir_all(d);
    }
    check(&save, &r)?;
    let peak_note = if reset {
        format!(
            "peak RSS over the save and the load; the save's state (one buffer per distinct piece) {}, the load \
             ranks' buffers {}, {} resident before",
            fmt::bytes(r.save_state_bytes),
            fmt::bytes(r.load_state_bytes),
            fmt::bytes(before)
        )
    } else {
        "peak RSS of the whole process (the peak could not be reset)".to_string()
    };
    let mut figs = phase_figures(n, &save, &load, &r);
    figs.push(Figure::plain(format!("scale_{n}_peak_rss_bytes"), peak as f64, peak_note));
    Ok((figs, r.save.seconds + r.load.seconds))
}

/// Why `n` thread ranks, `threads` threads with their writers, may not start here, if the
/// kernel's limits say so. Each rank is a thread and, while it writes its data file, so is
/// its writer; each thread takes a task id (`kernel.pid_max` bounds them) and four memory
/// maps (its stack, the signal stack its runtime gives it, and their guard pages;
/// `vm.max_map_count` bounds them).
fn thread_limits(n: usize, threads: usize) -> Option<String> {
    let read = |p: &str| std::fs::read_to_string(p).ok()?.trim().parse::<usize>().ok();
    let threads = threads + 256;
    let (pids, maps) = (read("/proc/sys/kernel/pid_max")?, read("/proc/sys/vm/max_map_count")?);
    (pids < threads || maps < 4 * threads).then(|| {
        format!(
            "{n} thread ranks need up to {threads} threads and {} memory maps; this kernel allows {pids} task ids \
             (kernel.pid_max) and {maps} maps per process (vm.max_map_count); raise them, e.g. sysctl -w \
             kernel.pid_max={} vm.max_map_count={}",
            4 * threads,
            (4 * n).next_power_of_two(),
            (16 * n).next_power_of_two()
        )
    })
}

/// Memory storage, or a fresh directory under `--dir`.
fn store(a: &BenchArgs, n: usize) -> Result<(Arc<dyn Storage>, Option<std::path::PathBuf>)> {
    if a.dir.is_none() {
        return Ok((crate::store::open("memory://")?, None));
    }
    let d = a.dir().join(format!("scale-{n}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    Ok((crate::store::open(d.to_str().context("non-UTF-8 directory")?)?, Some(d)))
}

/// The save moved exactly the model's bytes, and at 16,384 ranks the model had the pieces
/// of [`CHUNKS`] and [`ENTRIES`].
fn check(save: &ReferenceModel, r: &Run) -> Result<()> {
    let expected = save.expected_bytes();
    if r.outcome.bytes != expected || r.rank_bytes != expected {
        bail!("the save wrote {} bytes (the ranks say {}); the model has {expected}", r.outcome.bytes, r.rank_bytes);
    }
    let xl = save.layout.world_size == 16_384 && save.layout.config == SAVE;
    if xl && (r.distinct != CHUNKS || r.entries != ENTRIES) {
        bail!(
            "the narrowed moe-xl has {} chunks and {} shard entries at 16384 ranks, not {CHUNKS} and {ENTRIES}",
            r.distinct,
            r.entries
        );
    }
    Ok(())
}

fn phase_figures(n: usize, save: &ReferenceModel, load: &ReferenceModel, r: &Run) -> Vec<Figure> {
    let name = |what: &str| format!("scale_{n}_{what}");
    let (meta_bytes, meta_rank) = r.metadata_bytes_max;
    let (other_bytes, other_rank) = r.metadata_bytes_other_max;
    let slowest = |p: &dyn dckpt::Phases| {
        let each: Vec<String> =
            p.each().iter().map(|(n, s)| format!("{n} {:.2} s on rank {}", s.time.as_secs_f64(), s.rank)).collect();
        each.join(", ")
    };
    let mut figs = vec![
        Figure::plain(
            name("save_seconds"),
            r.save.seconds,
            format!(
                "{}: {} shard entries, {} chunks, {} in {} files (building the shard lists and filling the \
                 pieces took {:.2} s before); slowest: {}",
                layout_text(save),
                r.entries,
                r.distinct,
                fmt::bytes(r.outcome.bytes),
                r.outcome.files,
                r.build_seconds,
                slowest(&r.outcome.phases)
            ),
        ),
        Figure::plain(
            name("load_seconds"),
            r.load.seconds,
            format!(
                "{}; {} elements checked after; slowest: {}",
                layout_text(load),
                r.elements_checked,
                slowest(&r.load_phases)
            ),
        ),
        Figure::plain(
            name("metadata_bytes_max"),
            meta_bytes as f64,
            format!("metadata bytes one load rank read and decoded, most of any rank (rank {meta_rank})"),
        ),
        Figure::plain(
            name("metadata_bytes_other_max"),
            other_bytes as f64,
            format!(
                "the most any rank but the coordinator received and decoded: its own read plan (rank {other_rank})"
            ),
        ),
        Figure {
            name: name("data_bytes").into(),
            value: Some(r.outcome.bytes as f64),
            ceiling: Some(save.expected_bytes() as f64),
            ratio: Some(r.outcome.bytes as f64 / save.expected_bytes() as f64),
            note: Some("data bytes the save wrote vs the model's bytes (must be equal)".into()),
            by_kind: None,
        },
    ];
    figs.extend(coordinator_figures(n, r));
    for (what, p) in [("save", &r.save), ("load", &r.load)] {
        figs.extend(request_figures(n, what, p));
    }
    figs
}

/// Every call goes through rank 0: what it sent is what the others received.
fn coordinator_figures(n: usize, r: &Run) -> Vec<Figure> {
    let received = |p: &Phase| p.received.first().copied().unwrap_or(0);
    let sent = |p: &Phase| p.received.iter().skip(1).sum::<u64>();
    let split = |f: &dyn Fn(&Phase) -> u64| format!("save {}, load {}", fmt::bytes(f(&r.save)), fmt::bytes(f(&r.load)));
    vec![
        Figure::plain(
            format!("scale_{n}_coordinator_received_bytes"),
            (received(&r.save) + received(&r.load)) as f64,
            format!("collective payload bytes rank 0 received: {}", split(&received)),
        ),
        Figure::plain(
            format!("scale_{n}_coordinator_sent_bytes"),
            (sent(&r.save) + sent(&r.load)) as f64,
            format!("collective payload bytes rank 0 sent (what the other ranks received): {}", split(&sent)),
        ),
    ]
}

/// The most requests any rank made (each kind's maximum over ranks), and rank 0's.
fn request_figures(n: usize, what: &str, p: &Phase) -> Vec<Figure> {
    let by_kind = |counts: &Requests| -> BTreeMap<&'static str, u64> {
        Request::ALL.iter().zip(counts).filter(|(_, c)| **c > 0).map(|(k, c)| (k.name(), *c)).collect()
    };
    let mut most: Requests = [0; Request::ALL.len()];
    for rank in &p.requests {
        for (m, c) in most.iter_mut().zip(rank) {
            *m = (*m).max(*c);
        }
    }
    let busiest = p.requests.iter().map(|r| r.iter().sum::<u64>()).enumerate().max_by_key(|(_, s)| *s);
    let (busiest, busiest_total) = busiest.unwrap_or((0, 0));
    let coordinator = p.requests.first().copied().unwrap_or([0; Request::ALL.len()]);
    let total: u64 = p.requests.iter().flatten().sum();
    vec![
        Figure {
            by_kind: Some(by_kind(&most)),
            ..Figure::plain(
                format!("scale_{n}_{what}_requests_rank_max"),
                busiest_total as f64,
                format!(
                    "storage requests of the busiest rank in the {what} (rank {busiest}); by_kind: each kind's most \
                     on any rank; {total} over all ranks"
                ),
            )
        },
        Figure {
            by_kind: Some(by_kind(&coordinator)),
            ..Figure::plain(
                format!("scale_{n}_{what}_requests_coordinator"),
                coordinator.iter().sum::<u64>() as f64,
                format!("storage requests of rank 0 in the {what}, by kind"),
            )
        },
    ]
}

/// Seconds at the largest size over seconds at the size nearest `factor` times smaller,
/// against `target` (for exactly `factor` times the ranks) scaled to the sizes there are.
fn ratio(name: &'static str, seconds: &[(usize, f64)], factor: usize, target: f64, what: &str) -> Option<Figure> {
    let &(big, t_big) = seconds.last()?;
    let want = (big as f64 / factor as f64).ln();
    let &(small, t_small) = seconds[..seconds.len() - 1]
        .iter()
        .min_by(|a, b| ((a.0 as f64).ln() - want).abs().total_cmp(&((b.0 as f64).ln() - want).abs()))?;
    let growth = big as f64 / small as f64;
    let ceiling = target * growth / factor as f64;
    let value = t_big / t_small;
    Some(Figure {
        ceiling: Some(ceiling),
        ratio: Some(value / ceiling),
        ..Figure::plain(
            name,
            value,
            format!(
                "{what}: {big} ranks over {small} ({growth}x the ranks); the target is at most {target} for {factor}x, \
                 the ceiling that target scaled to {growth}x (linear growth would be {growth})"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout nearest the issue's: kept where the world allows it, ep then pp shrunk below.
    #[test]
    fn fit_keeps_the_layout_where_it_can() {
        let spec = spec();
        let sizes = |m: ReferenceModel| (m.layout.config.tp, m.layout.config.pp, m.layout.config.ep);
        assert_eq!(sizes(fit(&spec, 16_384, SAVE).unwrap()), (8, 16, 64));
        assert_eq!(sizes(fit(&spec, 1024, SAVE).unwrap()), (8, 16, 64));
        assert_eq!(sizes(fit(&spec, 512, LOAD).unwrap()), (4, 8, 32));
        assert_eq!(sizes(fit(&spec, 256, SAVE).unwrap()), (8, 16, 16));
        assert_eq!(sizes(fit(&spec, 64, SAVE).unwrap()), (8, 8, 8));
        assert_eq!(sizes(fit(&spec, 32, LOAD).unwrap()), (4, 8, 4));
    }

    /// The narrowed model has the pieces [`CHUNKS`] and [`ENTRIES`] say at 16,384 ranks, so
    /// the bench runs (within 0.2%) the protocol of `bench plan`'s job.
    #[test]
    fn narrowed_xl_has_its_chunks_and_entries() {
        let m = fit(&spec(), 16_384, SAVE).unwrap();
        let mut distinct = std::collections::HashSet::new();
        let mut entries = 0;
        for r in 0..16_384 {
            for t in m.rank_state(r) {
                entries += 1;
                distinct.insert((t.key, t.region));
            }
        }
        assert_eq!((distinct.len(), entries), (CHUNKS, ENTRIES));
    }
}
