//! `dckpt convert`: checkpoints of other formats into dckpt.

use std::process::ExitCode;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use anyhow::Result;
use clap::{Args, ValueEnum};
use dckpt_convert::{
    Conversion, ConvertReport, ConvertTarget, HfModel, conversion, detect, hf_to_dckpt, split_file_location,
};
use serde::Serialize;

use crate::export::exit_code;
use crate::fmt;
use crate::progress::{Bars, follow};

/// Convert a checkpoint of another format into a new dckpt checkpoint, which any parallel
/// layout then loads through the engine.
///
/// SRC is a Hugging Face safetensors model: one .safetensors file, a directory with
/// model.safetensors, or shards listed by model.safetensors.index.json (local or S3). Every
/// header is validated first (dtypes, sizes, offsets inside the file, no overlaps, the
/// index against the files). Each tensor becomes one whole chunk, checksummed as it is
/// written; the engine reads each tensor from its file while it writes it, so memory stays
/// a few write buffers whatever the model's size. The format of SRC is detected; torch_dist
/// and DCP checkpoints are recognised but not converted yet.
///
/// DST must hold no committed checkpoint. Exits 0, 1 when the conversion failed (a damaged
/// model, storage, a checkpoint already at DST), 2 on bad options, a location that cannot
/// be opened or a source it cannot convert.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The model or checkpoint: a directory, a .safetensors file, s3://bucket/prefix, ...
    #[arg(value_name = "SRC")]
    pub src: String,
    /// The new checkpoint: a directory, s3://bucket/prefix or memory://name.
    #[arg(value_name = "DST")]
    pub dst: String,
    /// What to write.
    #[arg(long, value_enum, default_value = "dckpt")]
    pub to: Target,
    /// Print one JSON object instead of the summary (and no progress bar).
    #[arg(long)]
    pub json: bool,
}

/// What `dckpt convert` writes.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Target {
    /// A dckpt checkpoint.
    Dckpt,
    /// A PyTorch DCP / Megatron torch_dist directory (not supported yet).
    TorchDist,
}

#[derive(Debug, Serialize)]
struct Report {
    src: String,
    dst: String,
    #[serde(flatten)]
    convert: ConvertReport,
    seconds: f64,
    bytes_per_second: f64,
}

pub fn run(a: &ConvertArgs) -> Result<ExitCode> {
    let fail = |error: String, code: u8| {
        eprintln!("dckpt convert: {error}");
        if a.json {
            fmt::emit(&fmt::error_json(&a.src, &error, None));
        }
        Ok(ExitCode::from(code))
    };
    let (dir, file) = split_file_location(&a.src);
    let src = match crate::store::open(&dir) {
        Ok(s) => s,
        Err(e) => return fail(format!("opening {dir}: {e}"), 2),
    };
    let to = match a.to {
        Target::Dckpt => ConvertTarget::Dckpt,
        Target::TorchDist => ConvertTarget::TorchDist,
    };
    let plan = detect(src.as_ref(), file.as_deref()).and_then(|f| conversion(f, to));
    let Conversion::SafetensorsToDckpt = match plan {
        Ok(c) => c,
        Err(e) => return fail(e.to_string(), exit_code(&e)),
    };
    let model = match HfModel::open(src, file.as_deref()) {
        Ok(m) => m,
        Err(e) => return fail(e.to_string(), exit_code(&e)),
    };
    let dst = match crate::store::open(&a.dst) {
        Ok(s) => s,
        Err(e) => return fail(format!("opening {}: {e}", a.dst), 2),
    };
    let bars = Bars::new(!a.json);
    let bar = bars.bar(model.bytes(), "convert");
    let read = AtomicU64::new(0);
    let start = Instant::now();
    let outcome = follow(&bar, &read, || hf_to_dckpt(&model, dst.as_ref(), &read));
    let seconds = start.elapsed().as_secs_f64();
    let convert = match outcome {
        Ok(r) => r,
        Err(e) => return fail(e.to_string(), exit_code(&e)),
    };
    let r = Report {
        src: a.src.clone(),
        dst: a.dst.clone(),
        bytes_per_second: convert.bytes as f64 / seconds.max(1e-9),
        convert,
        seconds,
    };
    if a.json {
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
    } else {
        fmt::emit(&format!(
            "converted {} tensors ({}) from {} ({}) into a dckpt checkpoint at {} ({} data files, save {}) in {:.2} s ({}/s)\n",
            r.convert.tensors,
            fmt::bytes(r.convert.bytes),
            r.src,
            r.convert.source_format,
            r.dst,
            r.convert.files,
            r.convert.save_id,
            r.seconds,
            fmt::bytes(r.bytes_per_second as u64),
        ));
    }
    Ok(ExitCode::SUCCESS)
}
