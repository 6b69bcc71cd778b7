//! `dckpt bench`: each figure measured against a ceiling in the same run, as a ratio.
//!
//! Ratios are medians over alternating rounds (dckpt, ceiling, dckpt, ...), so drift in the
//! disk or the page cache hits both sides alike. Figures without a ceiling (plan time,
//! memory) are reported as measured.

mod allgather;
mod ceilings;
mod convert;
mod engine;
mod fanout;
mod local;
mod plan;
mod scale;
mod scale_procs;
mod scale_threads;
mod storage;
mod torch;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Result, bail};
use clap::Args;
use dckpt::collective::{Collective, CollectiveOptions, ThreadGroup};
use serde::Serialize;

use crate::fmt;

/// Run benchmarks, each figure against its ceiling measured in the same run.
///
/// Run benchmarks and print a table (or JSON) of figures, each against its ceiling.
///
/// `scale` runs the whole save and load protocol at the world sizes of --ranks, ranks as
/// threads of this process, each with its own Checkpointer over the thread collective and
/// its own request-counting view of one store (memory, or local disk under --dir). The
/// model is moe-xl (64 layers, 256 experts, 128 heads of width 128) narrowed to a hidden
/// width of 1 and experts 8 wide: 64 MiB of parameters and distributed-optimizer state, at
/// 16,384 ranks in 138,750 chunks and 657,608 shard entries (moe-xl: 138,624 and 656,600;
/// its optimizer slices round differently). It is saved at tp 8, pp 16, ep 64 and loaded
/// by half the ranks at tp 4, pp 8, ep 32, every element checked; a world too small for a
/// layout gets the nearest that fits (ep, then pp, then tp halved), named in the notes.
/// For each N:
///   scale_N_save_seconds, scale_N_load_seconds: first rank's start to last rank's return
///   scale_N_metadata_bytes_max: most metadata bytes one load rank read and decoded
///   scale_N_data_bytes: bytes the save wrote, against the model's (they must be equal)
///   scale_N_coordinator_received_bytes, scale_N_coordinator_sent_bytes: collective payload
///     through rank 0, save plus load (the note splits them)
///   scale_N_{save,load}_requests_rank_max: storage requests of the busiest rank, with
///     "by_kind" each kind's most on any rank; ..._requests_coordinator: rank 0's, by kind
///   scale_N_peak_rss_bytes: peak resident memory over the save and the load
///   scale_seconds_ratio: save + load seconds at the largest N over the N nearest a quarter
///     of it, against 5 scaled to the sizes given
/// With --processes, for each N: scale_processes_N_seconds, the wall time of `dckpt launch`
/// of the tiny demo on N processes (save at tp 2, pp 4, ep 4, distributed optimizer; load
/// at tp 4, pp 2; local disk), and scale_processes_seconds_ratio, the largest N over the N
/// nearest half of it, against 2.5 scaled likewise.
#[derive(Debug, Args)]
#[command(verbatim_doc_comment)]
pub struct BenchArgs {
    /// Which benchmarks: plan, engine (local disk), s3 (needs DCKPT_TEST_S3_URL and AWS_*),
    /// storage (the storage layer alone, local and S3), allgather (the TCP collective alone,
    /// see --world), small (the many-small-tensors figure alone), reshard (the
    /// resharded-load figure alone), replicas (the replica check's cost alone), torch (PyTorch
    /// DCP and safetensors alone, see --torch-python), convert (conversions, export, validate
    /// of torch_dist against dcp.load, export memory), local (the node-local tier: 4 thread
    /// ranks on 2 simulated nodes, each part copied to the other node, in a fresh directory
    /// under /dev/shm unless --dir is given; at most 1 GiB of --bytes), scale (the protocol at
    /// many ranks, see above and --ranks, --processes), fanout (a load by 4 data-parallel
    /// thread ranks with the fan-out against every rank reading its own, on local disk and
    /// S3; at most 512 MiB of --bytes, 128 MiB on S3), or all (plan, engine with the torch
    /// figures, convert, local at most 256 MiB, fanout at most 128 MiB, s3, scale at 256
    /// and 1024 thread ranks).
    #[arg(default_value = "all")]
    pub name: String,
    /// Directory under which the local-disk benchmarks work, in a directory of their own
    /// (`dckpt-bench-<pid>`, removed afterwards; nothing else in PATH is touched)
    /// [default: target]; `scale` saves in memory unless it is given.
    #[arg(long, value_name = "PATH")]
    pub dir: Option<PathBuf>,
    /// Rounds per figure; ratios are medians over them (nine: on a shared machine the
    /// medians of five rounds of one figure still moved by up to 0.15 from run to run).
    #[arg(long, default_value_t = 9)]
    pub rounds: usize,
    /// Bytes of state for the save/load figures (default 2 GiB).
    #[arg(long, default_value_t = 2 << 30)]
    pub bytes: u64,
    /// Print one JSON array of {name, value, ceiling, ratio, note, by_kind} instead of a
    /// table (note and by_kind only where a figure has them).
    #[arg(long)]
    pub json: bool,
    /// A Python with torch and safetensors for the PyTorch DCP and safetensors figures
    /// (default: $DCKPT_BENCH_PYTHON); without one those figures are null, with a note.
    #[arg(long, value_name = "PATH")]
    pub torch_python: Option<PathBuf>,
    /// Ranks of the all-gather benchmark (threads of this process, each with its own TCP
    /// connection to rank 0).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub world: usize,
    /// `scale`: world sizes of the save, ranks as threads [default: 1024,4096,16384; 256,1024
    /// in `all`]; 0 alone runs none.
    #[arg(long, value_delimiter = ',', value_name = "N,...")]
    pub ranks: Option<Vec<usize>>,
    /// `scale`: numbers of processes of the launched tiny demo [default: 256,512,1024; none
    /// in `all`]; 0 alone runs none.
    #[arg(long, value_delimiter = ',', value_name = "N,...")]
    pub processes: Option<Vec<usize>>,
}

impl BenchArgs {
    /// The local-disk benchmarks' directory.
    /// This run's own directory under `--dir`: removing it afterwards removes nothing the
    /// user keeps there (`--dir ~/data` once meant `~/data` itself, removed at the end).
    pub fn dir(&self) -> PathBuf {
        let base = self.dir.clone().unwrap_or_else(|| PathBuf::from("target"));
        base.join(format!("dckpt-bench-{}", std::process::id()))
    }
}

/// One measured figure.
#[derive(Debug, Serialize)]
pub struct Figure {
    pub name: Cow<'static, str>,
    pub value: Option<f64>,
    pub ceiling: Option<f64>,
    pub ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Counts by kind behind the value, for figures that sum several (requests by kind).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by_kind: Option<BTreeMap<&'static str, u64>>,
}

impl Figure {
    fn plain(name: impl Into<Cow<'static, str>>, value: f64, note: impl Into<String>) -> Figure {
        Figure {
            name: name.into(),
            value: Some(value),
            ceiling: None,
            ratio: None,
            note: Some(note.into()),
            by_kind: None,
        }
    }

    /// A figure from paired rounds of (dckpt, ceiling) measurements where larger is better
    /// (throughputs): value and ceiling are medians, ratio the median of per-round ratios,
    /// which the note lists.
    fn paired(name: &'static str, rounds: &[(f64, f64)], note: impl Into<String>) -> Figure {
        let value = median(rounds.iter().map(|r| r.0).collect());
        let ceiling = median(rounds.iter().map(|r| r.1).collect());
        let ratios: Vec<f64> = rounds.iter().map(|r| r.0 / r.1).collect();
        let each: Vec<String> = ratios.iter().map(|r| format!("{r:.3}")).collect();
        let note = format!("{}; ratio per round: {}", note.into(), each.join(", "));
        Figure {
            name: name.into(),
            value: Some(value),
            ceiling: Some(ceiling),
            ratio: Some(median(ratios)),
            note: Some(note),
            by_kind: None,
        }
    }

    fn missing(name: impl Into<Cow<'static, str>>, note: impl Into<String>) -> Figure {
        Figure { name: name.into(), value: None, ceiling: None, ratio: None, note: Some(note.into()), by_kind: None }
    }
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub fn run(a: &BenchArgs) -> Result<ExitCode> {
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    match a.name.as_str() {
        "plan" | "engine" | "s3" | "small" | "reshard" | "replicas" | "storage" | "allgather" | "torch" | "convert"
        | "local" | "fanout" | "scale" | "all" => {}
        other => bail!(
            "unknown benchmark {other:?}; expected plan, engine, s3, storage, allgather, small, reshard, replicas, \
             torch, convert, local, fanout, scale or all"
        ),
    }
    // This run's directory goes whether the figures were measured or one failed.
    let figures = measure(a);
    let _ = std::fs::remove_dir_all(a.dir());
    let figures = figures?;
    if a.json {
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&figures)?));
    } else {
        fmt::emit(&table(&figures));
    }
    Ok(ExitCode::SUCCESS)
}

/// The figures `a.name` names.
fn measure(a: &BenchArgs) -> Result<Vec<Figure>> {
    let mut figures = Vec::new();
    let all = a.name == "all";
    // Planning first: its memory figure is the process's peak, before any state existed.
    if all || a.name == "plan" {
        figures.extend(plan::figures()?);
    }
    if all || a.name == "engine" {
        figures.extend(engine::local_figures(a)?);
    }
    if all || a.name == "engine" || a.name == "torch" {
        figures.extend(torch::figures(a)?);
    }
    if all || a.name == "convert" {
        figures.extend(convert::figures(a)?);
    }
    if all || a.name == "local" {
        figures.extend(local::figures(a, all)?);
    }
    if all || a.name == "fanout" {
        figures.extend(fanout::figures(a, all)?);
    }
    if a.name == "storage" {
        figures.extend(storage_figures(a)?);
    }
    if a.name == "allgather" {
        figures.extend(allgather::figures(a)?);
    }
    if a.name == "small" {
        figures.extend(engine::small_tensors(a)?);
    }
    if a.name == "reshard" {
        figures.push(engine::reshard_alone(a)?);
    }
    if a.name == "replicas" {
        figures.extend(engine::replica_check(a)?);
    }
    if all || a.name == "s3" {
        figures.extend(engine::s3_figures(a)?);
    }
    if all || a.name == "scale" {
        figures.extend(scale::figures(a, all)?);
    }
    Ok(figures)
}

/// The figures as a table, a line each; counts by kind after the note.
fn table(figures: &[Figure]) -> String {
    let mut out = format!("{:<36} {:>14} {:>14} {:>8}  note\n", "figure", "value", "ceiling", "ratio");
    for f in figures {
        let num = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
        let kinds = f.by_kind.as_ref().map_or(String::new(), |k| {
            let each: Vec<String> = k.iter().map(|(k, n)| format!("{k} {n}")).collect();
            format!(" [{}]", each.join(", "))
        });
        out.push_str(&format!(
            "{:<36} {:>14} {:>14} {:>8}  {}{kinds}\n",
            f.name,
            num(f.value),
            num(f.ceiling),
            num(f.ratio),
            f.note.as_deref().unwrap_or("")
        ));
    }
    out
}

/// The storage layer alone: streaming writes and reads against plain IO (local disk), and
/// against one plain put/get (S3, when a server is configured).
fn storage_figures(a: &BenchArgs) -> Result<Vec<Figure>> {
    std::fs::create_dir_all(a.dir())?;
    let mut out = Vec::new();
    let mut add = |prefix: &'static [&'static str; 2], r: storage::BenchReport| {
        for (name, c) in prefix.iter().zip([r.write, r.read]) {
            let note = format!("MiB/s: {} vs {}, {} ({} rounds)", c.storage, c.baseline, fmt::bytes(r.bytes), r.runs);
            out.push(Figure {
                name: (*name).into(),
                value: Some(c.storage_mib_s),
                ceiling: Some(c.baseline_mib_s),
                ratio: Some(c.ratio),
                note: Some(note),
                by_kind: None,
            });
        }
    };
    add(
        &["storage_local_write_vs_write", "storage_local_read_vs_read"],
        storage::bench_local(&a.dir(), a.bytes, a.rounds)?,
    );
    match std::env::var("DCKPT_TEST_S3_URL").ok().filter(|u| !u.is_empty()) {
        Some(url) => {
            let url = format!("{}/storage-bench-{}", url.trim_end_matches('/'), std::process::id());
            add(
                &["storage_s3_write_vs_put", "storage_s3_read_vs_get"],
                storage::bench_s3(&url, a.bytes.min(512 << 20), a.rounds)?,
            );
        }
        None => {
            for name in ["storage_s3_write_vs_put", "storage_s3_read_vs_get"] {
                out.push(Figure::missing(
                    name,
                    "no S3 server: set DCKPT_TEST_S3_URL and AWS_* (cargo xtask bench starts one)",
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(a.dir());
    Ok(out)
}

/// The process's peak resident set (VmHWM), or 0 where /proc is not available.
pub fn peak_rss_bytes() -> u64 {
    proc_status_kb("VmHWM:") * 1024
}

/// CPU seconds the process has used so far, every thread's, user and system: what a run
/// costs the machine, beside its wall time.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given; a zeroed one is a valid start.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

/// The process's resident set now (VmRSS).
pub fn rss_bytes() -> u64 {
    proc_status_kb("VmRSS:") * 1024
}

fn proc_status_kb(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
}

/// Resets the peak resident set to the current one (Linux `clear_refs` 5); false if not possible.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Runs `f(task)` for each of `tasks` on a thread of its own, all at once; the first
/// failure, or a panic, fails the whole.
fn each_on_a_thread<T: Send>(tasks: Vec<T>, f: impl Fn(T) -> Result<()> + Sync) -> Result<()> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = tasks.into_iter().map(|t| s.spawn(move || f(t))).collect();
        handles.into_iter().try_for_each(|h| h.join().map_err(|_| anyhow::anyhow!("a bench thread panicked"))?)
    })
}

/// Runs `f(rank, collective)` on `world` thread ranks; the results in rank order.
fn run_ranks<T: Send>(world: usize, f: impl Fn(usize, Arc<dyn Collective>) -> T + Sync) -> Result<Vec<T>> {
    Ok(ThreadGroup::run(world, &CollectiveOptions::default(), |r, c| f(r, Arc::new(c)))?)
}

/// `rounds` rounds of (dckpt seconds, ceiling seconds), alternating which side goes first
/// so that drift in the disk or the page cache hits both alike.
fn alternating(
    rounds: usize,
    mut dckpt: impl FnMut() -> Result<f64>,
    mut ceiling: impl FnMut() -> Result<f64>,
) -> Result<Vec<(f64, f64)>> {
    (0..rounds).map(|i| pair(i % 2 == 0, &mut dckpt, &mut ceiling)).collect()
}

/// Seconds for `bytes` to GB/s (10^9 bytes), both sides of every round.
fn gbps(bytes: f64, rounds: &[(f64, f64)]) -> Vec<(f64, f64)> {
    rounds.iter().map(|&(d, c)| (bytes / d / 1e9, bytes / c / 1e9)).collect()
}

/// Runs both sides of one round, `dckpt` first or second (alternated over the rounds, so
/// neither side always meets a warm or a cold cache); their seconds as (dckpt, ceiling).
fn pair(
    dckpt_first: bool,
    dckpt: &mut impl FnMut() -> Result<f64>,
    ceiling: &mut impl FnMut() -> Result<f64>,
) -> Result<(f64, f64)> {
    if dckpt_first {
        let d = dckpt()?;
        Ok((d, ceiling()?))
    } else {
        let c = ceiling()?;
        Ok((dckpt()?, c))
    }
}
