//! PyTorch DCP and safetensors on the same state as the engine figures, side by side, and,
//! when that Python has dckpt's own package, `dckpt.torch` and `dckpt.dcp` against DCP,
//! megatron-core's torch_dist and the engine itself driven from the same processes.
//!
//! `scripts/bench_torch.py` (built into the binary, written next to its manifest) does the
//! measuring in the Python given by `--torch-python` or `DCKPT_BENCH_PYTHON`, against the
//! same kinds of ceilings the engine figures use, measured in the same script run. Nothing
//! here is ever required: without such a Python, or when it cannot import torch, every
//! figure is reported with a null value and a note saying why.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result};
use dckpt::layout::ReferenceModel;
use serde::{Deserialize, Serialize};

use super::{BenchArgs, Figure};

/// The companion script, as committed; written into the bench directory to run it.
const SCRIPT: &str = include_str!("../../../../scripts/bench_torch.py");

/// The environment variable naming the Python to run it with.
pub const PYTHON_ENV: &str = "DCKPT_BENCH_PYTHON";

/// The script's exit status when its Python lacks torch or safetensors.
const MISSING_PACKAGES: i32 = 3;

/// Every figure the script reports, in the order they are shown.
pub const NAMES: [&str; 17] = [
    "dcp_save_vs_write",
    "dcp_load_warm_vs_read",
    "safetensors_save_vs_write",
    "safetensors_load_warm_vs_read",
    "dcp_small_tensors_vs_large",
    "dckpt_torch_save_vs_dcp",
    "dckpt_torch_load_warm_vs_dcp",
    "dckpt_dcp_reader_load_warm_vs_dcp",
    "dckpt_dcp_writer_save_vs_dcp",
    "dckpt_torch_small_tensors_vs_dcp",
    "dckpt_dcp_writer_small_tensors_vs_dcp",
    "dckpt_dcp_writer_us_per_item",
    "dckpt_torch_save_vs_torch_dist",
    "dckpt_torch_load_warm_vs_torch_dist",
    "dckpt_torch_save_vs_engine",
    "dckpt_torch_load_warm_vs_engine",
    "load_warm_vs_safetensors",
];

const HOW: &str = "set DCKPT_BENCH_PYTHON (or --torch-python) to a python with torch and safetensors, \
                   or run `cargo xtask bench --torch`";

/// One piece of a rank's state, as the script reads it.
#[derive(Debug, Serialize)]
struct Piece<'a> {
    key: &'a str,
    dtype: dckpt::spec::DType,
    global_shape: &'a [u64],
    offsets: &'a [u64],
    local_shape: &'a [u64],
    /// The main replica (the copy that is counted and written once).
    main: bool,
}

#[derive(Debug, Serialize)]
struct Manifest<'a> {
    version: u32,
    /// Distinct bytes of the state (every main piece once).
    bytes: u64,
    /// Each rank's pieces, in rank order.
    ranks: Vec<Vec<Piece<'a>>>,
}

/// One figure as the script prints it.
#[derive(Debug, Deserialize)]
struct Reported {
    name: String,
    value: Option<f64>,
    ceiling: Option<f64>,
    ratio: Option<f64>,
    note: Option<String>,
}

/// The Python to use: the option, else the environment variable; `None` when neither is set.
pub fn python(a: &BenchArgs) -> Option<PathBuf> {
    a.torch_python.clone().or_else(|| std::env::var_os(PYTHON_ENV).filter(|p| !p.is_empty()).map(PathBuf::from))
}

/// The companion figures, or the same names with null values and a note saying why not.
pub fn figures(a: &BenchArgs) -> Result<Vec<Figure>> {
    let Some(python) = python(a) else {
        return Ok(missing(&format!("no python with torch: {HOW}")));
    };
    let dir = a.dir().join("torch");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let out = run_script(&python, &dir, a);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir(a.dir()); // only if nothing else is left in it
    out
}

fn run_script(python: &Path, dir: &Path, a: &BenchArgs) -> Result<Vec<Figure>> {
    let script = dir.join("bench_torch.py");
    std::fs::write(&script, SCRIPT).with_context(|| format!("writing {}", script.display()))?;

    // A probe first, so that a Python without torch is a note rather than a failure.
    let probe = match Command::new(python).arg(&script).arg("--probe").stdin(Stdio::null()).output() {
        Ok(p) => p,
        Err(e) => return Ok(missing(&format!("cannot run {}: {e}; {HOW}", python.display()))),
    };
    if !probe.status.success() {
        let why = last_line(&probe.stderr);
        let note = if probe.status.code() == Some(MISSING_PACKAGES) {
            format!("{} has no usable torch/safetensors ({why}); {HOW}", python.display())
        } else {
            format!("{} failed to start the companion script ({}: {why})", python.display(), probe.status)
        };
        return Ok(missing(&note));
    }

    let model = super::engine::bench_model(a.bytes)?;
    let manifest_path = dir.join("manifest.json");
    let rank_states: Vec<_> = (0..model.layout.world_size).map(|r| model.rank_state(r)).collect();
    let manifest = manifest(&model, &rank_states)?;
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest)?)
        .with_context(|| format!("writing {}", manifest_path.display()))?;

    eprintln!("dckpt bench: PyTorch DCP and safetensors on the same state with {}", python.display());
    let work = dir.join("work");
    let run = Command::new(python)
        .arg(&script)
        .arg("--manifest")
        .arg(&manifest_path)
        .arg("--dir")
        .arg(&work)
        .arg("--rounds")
        .arg(a.rounds.to_string())
        // dckpt.torch loads as the CLI does, out of mappings (the engine figures beside
        // them, and safetensors, map their files too).
        .env("DCKPT_MAPPED_READS", "1")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {} {}", python.display(), script.display()))?;
    if !run.status.success() {
        return Ok(missing(&format!("the companion script failed ({}); its errors are above", run.status)));
    }
    parse(&run.stdout)
}

/// The manifest of `model`'s state on every rank; flat (ZeRO) ranges have no DCP equivalent
/// here and are refused.
fn manifest<'a>(model: &ReferenceModel, ranks: &'a [Vec<dckpt::spec::ShardedTensor>]) -> Result<Manifest<'a>> {
    let mut out = Vec::with_capacity(ranks.len());
    for (r, tensors) in ranks.iter().enumerate() {
        let mut pieces = Vec::with_capacity(tensors.len());
        for t in tensors {
            if t.region.flat.is_some() {
                anyhow::bail!("rank {r}: {:?} is a flat range, which the companion cannot express", t.key);
            }
            pieces.push(Piece {
                key: &t.key,
                dtype: t.dtype,
                global_shape: &t.global_shape,
                offsets: &t.region.offset,
                local_shape: &t.region.shape,
                main: t.is_main(),
            });
        }
        out.push(pieces);
    }
    Ok(Manifest { version: 1, bytes: model.expected_bytes(), ranks: out })
}

/// The script's JSON array, in `NAMES` order; a name it did not report is a null figure.
fn parse(stdout: &[u8]) -> Result<Vec<Figure>> {
    let reported: Vec<Reported> = serde_json::from_slice(stdout).with_context(|| {
        format!("the companion script printed something other than a JSON array of figures: {}", last_line(stdout))
    })?;
    for r in &reported {
        if !NAMES.contains(&r.name.as_str()) {
            eprintln!("dckpt bench: ignoring unknown companion figure {:?}", r.name);
        }
    }
    Ok(NAMES
        .iter()
        .map(|&name| match reported.iter().find(|r| r.name == name) {
            Some(r) => Figure {
                name: name.into(),
                value: r.value,
                ceiling: r.ceiling,
                ratio: r.ratio,
                note: r.note.clone(),
                by_kind: None,
            },
            None => Figure::missing(name, "the companion script did not report it"),
        })
        .collect())
}

fn missing(note: &str) -> Vec<Figure> {
    NAMES.iter().map(|&n| Figure::missing(n, note)).collect()
}

fn last_line(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output").trim();
    line.chars().take(300).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_keeps_order_and_fills_gaps() {
        let out = br#"[{"name": "dcp_load_warm_vs_read", "value": 2.0, "ceiling": 4.0, "ratio": 0.5, "note": "n"},
                       {"name": "something_else", "value": 1.0, "ceiling": null, "ratio": null}]"#;
        let figs = parse(out).unwrap();
        assert_eq!(figs.iter().map(|f| f.name.as_ref()).collect::<Vec<_>>(), NAMES);
        assert_eq!(figs[1].ratio, Some(0.5));
        assert!(figs[0].value.is_none());
        assert!(parse(b"Traceback: oops").is_err());
    }

    #[test]
    fn manifest_covers_the_state_once() {
        let model = super::super::engine::bench_model(64 << 20).unwrap();
        let ranks: Vec<_> = (0..2).map(|r| model.rank_state(r)).collect();
        let m = manifest(&model, &ranks).unwrap();
        let main: u64 = m
            .ranks
            .iter()
            .flatten()
            .filter(|p| p.main)
            .map(|p| p.local_shape.iter().product::<u64>() * p.dtype.size())
            .sum();
        assert_eq!(main, m.bytes);
    }
}
