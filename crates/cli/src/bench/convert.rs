//! Conversions and exports against plain IO of the same bytes, `dckpt validate` of a
//! torch_dist checkpoint against PyTorch's own `dcp.load` of it, and the peak memory of an
//! export whose largest tensor is larger than its budget; and the cast a load or an export
//! with `--dtype` runs (f32 to bf16) against a plain copy of the same bytes.
//!
//! The state: a dckpt checkpoint of a few bf16 and f32 tensors (one of them a quarter of
//! the bytes), saved through the engine, and its torch_dist form (`dckpt convert --to
//! torch_dist`, the directory PyTorch's readers read). Ceilings, in the same rounds: a
//! plain copy of the torch_dist data file (read, write, fsync of the file and directory)
//! for the conversions, a plain write of the same bytes from memory with fsync for the
//! export. Page cache warm on both sides.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use dckpt::spec::{DType, ShardedTensor};
use dckpt::storage::Storage;
use dckpt::{Checkpointer, SaveOptions, SaveState};
use dckpt_convert::torch_dist::{self, Checkpoint};
use dckpt_convert::{DckptSource, ExportOptions, export};

use super::{BenchArgs, Figure, median, pair};

/// The largest state these figures use, whatever `--bytes` says: the point is the ratio.
const BYTES_MAX: u64 = 1 << 30;
/// The export budget of the peak-memory figure, at most: a quarter of the largest tensor
/// when that is smaller, so the tensor is always larger than the budget.
const EXPORT_BUDGET: u64 = 64 << 20;

/// The figures, in order.
pub const NAMES: [&str; 6] = [
    "convert_torch_dist_vs_copy",
    "convert_to_torch_dist_vs_copy",
    "export_vs_write",
    "validate_torch_dist_vs_dcp_load",
    "export_peak_rss_mib",
    "cast_f32_to_bf16_vs_copy",
];

/// The most f32s the cast figure casts: 64 Mi (256 MiB), far past the caches.
const CAST_ELEMENTS_MAX: u64 = 64 << 20;

/// `cast_into` of f32s to bf16 against a copy of the same input into a buffer of its size,
/// alternating; GB/s of the bytes each reads and writes.
fn cast_figure(a: &BenchArgs) -> Figure {
    let n = (a.bytes / 4).clamp(1, CAST_ELEMENTS_MAX) as usize;
    let input: Vec<u8> = (0..n).flat_map(|i| (i as f32 * 1.0001e-3 - 7.0).to_le_bytes()).collect();
    let (mut half, mut copy) = (vec![0u8; n * 2], vec![0u8; input.len()]);
    let gbps = |bytes: usize, f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        bytes as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let rounds: Vec<(f64, f64)> = (0..a.rounds.max(1))
        .map(|_| {
            let cast = gbps(input.len() + half.len(), &mut || {
                dckpt::spec::cast::cast_into(DType::F32, DType::Bf16, &input, &mut half)
            });
            (cast, gbps(2 * input.len(), &mut || copy.copy_from_slice(&input)))
        })
        .collect();
    let note =
        format!("GB/s read + written: {} of f32s cast to bf16 vs a copy of them", crate::fmt::bytes(4 * n as u64));
    Figure::paired(NAMES[5], &rounds, note)
}

fn open(dir: &Path) -> Result<std::sync::Arc<dyn Storage>> {
    Ok(crate::store::open(dir.to_str().context("a UTF-8 path")?)?)
}

fn fresh(dir: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    Ok(())
}

/// The tensors of a state of about `bytes`: one of a quarter of it (bf16, larger than
/// the export budget), the rest f32 and bf16 matrices.
fn tensors(bytes: u64) -> Vec<(String, DType, Vec<u64>)> {
    let mut out = vec![("big.weight".to_string(), DType::Bf16, vec![(bytes / 4 / 2 / 4096).max(1), 4096])];
    for i in 0..6 {
        let dtype = if i % 2 == 0 { DType::F32 } else { DType::Bf16 };
        let rows = (bytes / 8 / dtype.size() / 1024).max(1);
        out.push((format!("layers.{i}.weight"), dtype, vec![rows, 1024]));
    }
    out
}

/// Saves the state as a dckpt checkpoint in `dir`; returns its distinct bytes.
fn save_state(dir: &Path, bytes: u64) -> Result<u64> {
    fresh(dir)?;
    let specs = tensors(bytes);
    let buffers: Vec<Vec<u8>> = specs
        .iter()
        .enumerate()
        .map(|(i, (_, d, s))| {
            let n = (s.iter().product::<u64>() * d.size()) as usize;
            // Mixed bytes, not zeros, so no layer can take a shortcut.
            (0..n).map(|j| ((j as u64).wrapping_mul(2654435761).wrapping_add(i as u64) >> 13) as u8).collect()
        })
        .collect();
    let mut state = SaveState::new();
    for ((k, d, s), b) in specs.iter().zip(&buffers) {
        state.push_tensor(ShardedTensor::whole(k.as_str(), *d, s.clone()), b);
    }
    Checkpointer::local().save(open(dir)?, &state, &SaveOptions::default())?;
    Ok(buffers.iter().map(|b| b.len() as u64).sum())
}

/// A plain copy of `src` into `dst_dir` with fsync; seconds.
fn plain_copy(src: &Path, dst_dir: &Path, buf: &mut [u8]) -> Result<f64> {
    fresh(dst_dir)?;
    let t = Instant::now();
    let mut r = File::open(src)?;
    let mut w = File::create(dst_dir.join("copy.bin"))?;
    loop {
        let n = r.read(buf)?;
        if n == 0 {
            break;
        }
        w.write_all(&buf[..n])?;
    }
    w.sync_all()?;
    File::open(dst_dir)?.sync_all()?;
    Ok(t.elapsed().as_secs_f64())
}

/// A plain write of `bytes` bytes from memory with fsync; seconds.
fn plain_write(dst_dir: &Path, bytes: u64, buf: &[u8]) -> Result<f64> {
    fresh(dst_dir)?;
    let t = Instant::now();
    let mut w = File::create(dst_dir.join("plain.bin"))?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        w.write_all(&buf[..n])?;
        left -= n as u64;
    }
    w.sync_all()?;
    File::open(dst_dir)?.sync_all()?;
    Ok(t.elapsed().as_secs_f64())
}

fn timed<T>(f: impl FnOnce() -> Result<T>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// The script that times `dcp.load` of a directory into tensors allocated beforehand from
/// its metadata: one warm-up load, then `rounds` timed ones; prints their seconds as JSON.
const DCP_LOAD: &str = r#"
import inspect, json, sys, time
import torch, torch.distributed.checkpoint as dcp
d, rounds = sys.argv[1], int(sys.argv[2])
md = dcp.FileSystemReader(d).read_metadata()
sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
      for k, m in md.state_dict_metadata.items() if hasattr(m, "size")}
kw = {"no_dist": True} if "no_dist" in inspect.signature(dcp.load).parameters else {}
dcp.load(sd, checkpoint_id=d, **kw)
out = []
for _ in range(rounds):
    t = time.perf_counter()
    dcp.load(sd, checkpoint_id=d, **kw)
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"#;

fn dcp_load_seconds(python: &Path, dir: &Path, rounds: usize) -> Result<Vec<f64>> {
    let out = Command::new(python)
        .arg("-c")
        .arg(DCP_LOAD)
        .arg(dir)
        .arg(rounds.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    if !out.status.success() {
        bail!("{} timing dcp.load failed ({})", python.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    serde_json::from_str(last).with_context(|| format!("dcp.load timings: {last:?}"))
}

/// The peak resident set of `dckpt export` of `src` with the given budget, in a child
/// process: its `VmHWM`, read from `/proc/<pid>/status` every few milliseconds until it
/// exits (the child's own `ru_maxrss` is no use: at `exec` the kernel folds in the peak of
/// the memory the child was spawned from, this process's).
fn export_peak_rss(src: &Path, out: &Path, budget: u64) -> Result<u64> {
    let _ = std::fs::remove_dir_all(out);
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args(["export", src.to_str().context("UTF-8")?, out.to_str().context("UTF-8")?, "--format", "safetensors"])
        .args(["--buffer-size", &budget.to_string(), "--json"])
        .stdout(Stdio::null())
        .spawn()?;
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak = 0u64;
    let status = loop {
        if let Ok(text) = std::fs::read_to_string(&status_file) {
            let kb = text
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
            peak = peak.max(kb.unwrap_or(0) * 1024);
        }
        if let Some(st) = child.try_wait()? {
            break st;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    if !status.success() {
        bail!("the export exited {status}");
    }
    let _ = std::fs::remove_dir_all(out);
    if peak == 0 {
        bail!("no /proc/<pid>/status to read the peak from");
    }
    Ok(peak)
}

pub fn figures(a: &BenchArgs) -> Result<Vec<Figure>> {
    let root = a.dir().join("convert");
    let out = measure(a, &root);
    let _ = std::fs::remove_dir_all(&root);
    out
}

fn measure(a: &BenchArgs, root: &Path) -> Result<Vec<Figure>> {
    let bytes = a.bytes.min(BYTES_MAX);
    let src = root.join("dckpt");
    let td = root.join("torch_dist");
    let total = save_state(&src, bytes)?;
    fresh(&td)?;
    let source = DckptSource::open(open(&src)?)?;
    torch_dist::dckpt_to_torch_dist(&source, open(&td)?.as_ref(), &AtomicU64::new(0))?;
    let Rounds { td_bytes, from_td, to_td, exp, val } = rounds(a, root, &source, total)?;
    let mut figs = vec![
        Figure::paired(
            NAMES[0],
            &from_td,
            format!(
                "GB/s: dckpt convert of a torch_dist checkpoint ({}) into dckpt vs a plain copy of its data file + fsync",
                crate::fmt::bytes(td_bytes)
            ),
        ),
        Figure::paired(
            NAMES[1],
            &to_td,
            "GB/s: dckpt convert --to torch_dist of the same state vs the same plain copy",
        ),
        Figure::paired(
            NAMES[2],
            &exp,
            "GB/s: dckpt export to safetensors (default 256 MiB budget) vs a plain write of the bytes + fsync",
        ),
    ];
    figs.push(dcp_figure(a, &td, &val, total));
    figs.push(peak_figure(&src, root, bytes));
    figs.push(cast_figure(a));
    Ok(figs)
}

/// Each round's (dckpt, ceiling) GB/s of the conversions and the export, and validate's
/// seconds.
struct Rounds {
    /// The torch_dist data file's size.
    td_bytes: u64,
    from_td: Vec<(f64, f64)>,
    to_td: Vec<(f64, f64)>,
    exp: Vec<(f64, f64)>,
    val: Vec<f64>,
}

/// `a.rounds` rounds of every conversion against its plain-IO ceiling.
fn rounds(a: &BenchArgs, root: &Path, source: &DckptSource, total: u64) -> Result<Rounds> {
    let td = root.join("torch_dist");
    let td_file: PathBuf = td.join(torch_dist::DATA_FILE);
    let td_bytes = std::fs::metadata(&td_file)?.len();
    let (out_a, out_b) = (root.join("out"), root.join("plain"));
    let mut buf = vec![0u8; 8 << 20];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    let mut r = Rounds { td_bytes, from_td: Vec::new(), to_td: Vec::new(), exp: Vec::new(), val: Vec::new() };
    let gbps = |b: u64, (c, p): (f64, f64), pb: u64| (b as f64 / c / 1e9, pb as f64 / p / 1e9);
    for round in 0..a.rounds {
        // Alternate which side goes first, so drift hits both alike.
        let first = round % 2 == 0;
        let ckpt = Checkpoint::open(open(&td)?.as_ref())?;
        let mut copy_buf = buf.clone();
        let mut convert = || -> Result<f64> {
            fresh(&out_a)?;
            timed(|| {
                torch_dist::torch_dist_to_dckpt(open(&td)?.as_ref(), &ckpt, &open(&out_a)?, &AtomicU64::new(0))?;
                Ok(())
            })
        };
        let secs = pair(first, &mut convert, &mut || plain_copy(&td_file, &out_b, &mut copy_buf))?;
        r.from_td.push(gbps(total, secs, td_bytes));
        let mut back = || -> Result<f64> {
            fresh(&out_a)?;
            timed(|| {
                torch_dist::dckpt_to_torch_dist(source, open(&out_a)?.as_ref(), &AtomicU64::new(0))?;
                Ok(())
            })
        };
        let secs = pair(first, &mut back, &mut || plain_copy(&td_file, &out_b, &mut copy_buf))?;
        r.to_td.push(gbps(total, secs, td_bytes));
        let mut run_export = || -> Result<f64> {
            fresh(&out_a)?;
            timed(|| {
                export(source, open(&out_a)?.as_ref(), &ExportOptions::default(), &AtomicU64::new(0))?;
                Ok(())
            })
        };
        let secs = pair(first, &mut run_export, &mut || plain_write(&out_b, total, &buf))?;
        r.exp.push(gbps(total, secs, total));
        let store = open(&td)?;
        let t = Instant::now();
        let report = torch_dist::validate(store.as_ref(), &ckpt, |_| {});
        let secs = t.elapsed().as_secs_f64();
        if !report.ok() {
            bail!("validate of the bench's torch_dist checkpoint: {:?}", report.problems);
        }
        r.val.push(secs);
    }
    let _ = std::fs::remove_dir_all(&out_a);
    let _ = std::fs::remove_dir_all(&out_b);
    Ok(r)
}

/// dckpt's validate against PyTorch's `dcp.load` of the same checkpoint, when a python with
/// torch is at hand.
fn dcp_figure(a: &BenchArgs, td: &Path, val: &[f64], total: u64) -> Figure {
    match super::torch::python(a) {
        None => Figure::missing(NAMES[3], "no python with torch: set DCKPT_BENCH_PYTHON or --torch-python"),
        Some(py) => match dcp_load_seconds(&py, td, a.rounds) {
            Ok(dcp) => {
                // Larger is better for paired figures: throughputs of the same bytes.
                let rounds: Vec<(f64, f64)> =
                    val.iter().zip(&dcp).map(|(v, d)| (total as f64 / v / 1e9, total as f64 / d / 1e9)).collect();
                Figure::paired(
                    NAMES[3],
                    &rounds,
                    format!(
                        "GB/s: dckpt validate (every item's zip, data.pkl and CRC-32, coverage) vs PyTorch {}'s dcp.load into preallocated tensors (median {:.3} s vs {:.3} s)",
                        py.display(),
                        median(val.to_vec()),
                        median(dcp.clone())
                    ),
                )
            }
            Err(e) => Figure::missing(NAMES[3], format!("{e:#}")),
        },
    }
}

/// The peak memory of an export whose budget is below its largest tensor.
fn peak_figure(src: &Path, root: &Path, bytes: u64) -> Figure {
    let largest = tensors(bytes)[0].2.iter().product::<u64>() * 2;
    let budget = (largest / 4).clamp(1 << 20, EXPORT_BUDGET);
    match export_peak_rss(src, &root.join("peak"), budget) {
        Ok(peak) => Figure::plain(
            NAMES[4],
            peak as f64 / (1 << 20) as f64,
            format!(
                "peak RSS (MiB) of dckpt export with --buffer-size {} whose largest tensor is {}",
                crate::fmt::bytes(budget),
                crate::fmt::bytes(largest)
            ),
        ),
        Err(e) => Figure::missing(NAMES[4], format!("{e:#}")),
    }
}
