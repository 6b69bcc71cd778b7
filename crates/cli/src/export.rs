//! `dckpt export`: a checkpoint consolidated into Hugging Face safetensors.

use std::process::ExitCode;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use anyhow::Result;
use clap::{Args, ValueEnum};
use dckpt::spec::DType;
use dckpt_convert::torch_dist::TorchDistSource;
use dckpt_convert::{
    ConvertError, DckptSource, ExportOptions, ExportReport, HfModel, KeyFilter, SourceFormat, TensorSource, detect,
    export, output_dtype, parse_size, split_file_location,
};
use serde::Serialize;

use crate::fmt;
use crate::progress::{Bars, follow};

/// Consolidate a checkpoint into whole tensors, a Hugging Face safetensors model.
///
/// Consolidate a checkpoint into whole tensors in the Hugging Face layout: one
/// `model.safetensors` when every tensor fits in one shard, else
/// `model-0000i-of-0000N.safetensors` and `model.safetensors.index.json`. Tensors are
/// sorted by key and packed into shards in that order; a tensor larger than
/// --max-shard-size gets a shard of its own.
///
/// SRC is a dckpt checkpoint (every byte checked against its checksum as it is read), a
/// PyTorch DCP or Megatron torch_dist directory (every chunk located and checked against
/// the metadata first; DCP's CRC-32s cover whole zip entries, so parts of them are read
/// unchecked: `dckpt validate` checks them), or a Hugging Face safetensors model (to
/// re-shard or cast it). Objects (non-tensor state) are
/// not exported: safetensors holds tensors only; the summary says how many were skipped.
///
/// Memory stays within --buffer-size whatever the size of a tensor: each tensor is read
/// row-major in slabs of whole rows (or flat ranges where one row is larger than a slab),
/// one slab read while the previous one is written. Each output file appears whole or not
/// at all; OUT must hold no model*.safetensors* file yet, and be a directory other than
/// the one SRC is read from.
///
/// Exits 0, 1 when the export failed (damaged data, storage, output already there), 2 on
/// bad options, a location that cannot be opened or no checkpoint at SRC.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The checkpoint or model: a directory, a .safetensors file, file:///path or
    /// s3://bucket/prefix.
    #[arg(value_name = "SRC")]
    pub src: String,
    /// The output directory: a local path or s3://bucket/prefix.
    #[arg(value_name = "OUT")]
    pub out: String,
    /// The output format.
    #[arg(long, value_enum)]
    pub format: ExportFormat,
    /// Cast floating tensors (f32, bf16, f16, f64) to bf16, fp16 or fp32, rounding to
    /// nearest even bit-exactly as PyTorch's `.to(dtype)`; integer, bool and fp8 tensors
    /// are written unchanged.
    #[arg(long, value_name = "D")]
    pub dtype: Option<DType>,
    /// The largest shard: bytes, or with a unit (5GB, 500MB: powers of 1000 as
    /// transformers reads them; 1GiB: powers of 1024).
    #[arg(long, value_name = "SIZE", default_value = "5GB", value_parser = size_arg)]
    pub max_shard_size: u64,
    /// Export only keys matching this glob over the full key (`*` any run, `?` one
    /// character); repeatable, any may match. None: every key.
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Leave out keys matching this glob (e.g. 'optimizer.*'); repeatable; wins over
    /// --include.
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Bytes of tensor data held at once (reads in flight and casts included).
    #[arg(long, value_name = "SIZE", default_value = "256MiB", value_parser = size_arg)]
    pub buffer_size: u64,
    /// Print one JSON object instead of the summary (and no progress bar).
    #[arg(long)]
    pub json: bool,
}

/// Formats `dckpt export` writes.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ExportFormat {
    /// Hugging Face safetensors.
    Safetensors,
}

fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

#[derive(Debug, Serialize)]
struct Report {
    src: String,
    out: String,
    source_format: &'static str,
    format: &'static str,
    #[serde(flatten)]
    export: ExportReport,
    seconds: f64,
    bytes_per_second: f64,
}

/// The exit code of a failed conversion or export: 2 for what the user must change (options,
/// the source), 1 for a job that failed.
pub fn exit_code(e: &ConvertError) -> u8 {
    use dckpt::ErrorKind as E;
    match e {
        ConvertError::Options { .. }
        | ConvertError::UnknownFormat { .. }
        | ConvertError::NotACheckpoint { .. }
        | ConvertError::NotSupported { .. } => 2,
        ConvertError::Engine(e) if matches!(e.kind(), E::NotACheckpoint { .. } | E::InvalidOptions { .. }) => 2,
        _ => 1,
    }
}

/// Where a source names a file (`model.safetensors`) that is not there: a source that cannot
/// be opened, exit 2 as a missing directory; it failed as a job (1).
pub fn file_missing(storage: &dyn dckpt::Storage, file: Option<&str>) -> Option<String> {
    let f = file.filter(|f| !dckpt::storage::StorageExt::exists(storage, f).unwrap_or(true))?;
    Some(format!("not found: {}", storage.location(f)))
}

/// Opens the source at `location` as a tensor source, whatever its format.
pub fn open_source(location: &str) -> Result<(SourceFormat, Box<dyn TensorSource>), (String, u8)> {
    let (dir, file) = split_file_location(location);
    let storage = crate::store::open_existing(&dir).map_err(|e| (format!("opening {dir}: {e}"), 2))?;
    let fail = |e: ConvertError| (e.to_string(), exit_code(&e));
    if let Some(missing) = file_missing(storage.as_ref(), file.as_deref()) {
        return Err((missing, 2));
    }
    let format = detect(storage.as_ref(), file.as_deref()).map_err(fail)?;
    let source: Box<dyn TensorSource> = match format {
        SourceFormat::Dckpt => Box::new(DckptSource::open(storage).map_err(fail)?),
        SourceFormat::Safetensors => Box::new(HfModel::open(storage, file.as_deref()).map_err(fail)?),
        SourceFormat::Dcp | SourceFormat::TorchDist => Box::new(TorchDistSource::open(storage).map_err(fail)?),
    };
    Ok((format, source))
}

pub fn run(a: &ExportArgs) -> Result<ExitCode> {
    // `location` names what failed: SRC, or OUT where opening or writing it did.
    let created = crate::store::new_local_dir(&a.out);
    let fail_at = |location: &str, error: String, code: u8| {
        crate::store::remove_if_empty(created.as_deref());
        eprintln!("dckpt export: {error}");
        if a.json {
            fmt::emit(&fmt::error_json(location, &error, None));
        }
        Ok(ExitCode::from(code))
    };
    let fail = |error: String, code: u8| fail_at(&a.src, error, code);
    if let Err(e) = crate::store::refuse_same_dir(&split_file_location(&a.src).0, &a.out) {
        return fail_at(&a.out, e, 2);
    }
    let (format, source) = match open_source(&a.src) {
        Ok(s) => s,
        Err((e, code)) => return fail(e, code),
    };
    let out = match crate::store::open(&a.out) {
        Ok(s) => s,
        Err(e) => return fail_at(&a.out, format!("opening {}: {e}", a.out), 2),
    };
    let opts = ExportOptions {
        dtype: a.dtype,
        max_shard_size: a.max_shard_size,
        filter: KeyFilter { include: a.include.clone(), exclude: a.exclude.clone() },
        buffer_size: a.buffer_size,
    };
    let total: u64 = source
        .tensors()
        .iter()
        .filter(|t| opts.filter.keeps(&t.key))
        // Saturating: the shapes are the source's word, for a progress bar only.
        .map(|t| dckpt::spec::numel(&t.shape).saturating_mul(output_dtype(t.dtype, a.dtype).size()))
        .fold(0u64, u64::saturating_add);
    let bars = Bars::new(!a.json);
    let bar = bars.bar(total, "export");
    let written = AtomicU64::new(0);
    let start = Instant::now();
    let outcome = follow(&bar, &written, || export(source.as_ref(), out.as_ref(), &opts, &written));
    let seconds = start.elapsed().as_secs_f64();
    let report = match outcome {
        Ok(r) => r,
        Err(e @ ConvertError::Exists { .. }) => return fail_at(&a.out, e.to_string(), exit_code(&e)),
        Err(e) => return fail(e.to_string(), exit_code(&e)),
    };
    let r = Report {
        src: a.src.clone(),
        out: a.out.clone(),
        source_format: format.reader(),
        format: "safetensors",
        bytes_per_second: report.total_size as f64 / seconds.max(1e-9),
        export: report,
        seconds,
    };
    if a.json {
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
    } else {
        fmt::emit(&human(&r));
    }
    Ok(ExitCode::SUCCESS)
}

fn human(r: &Report) -> String {
    let e = &r.export;
    let mut s = format!(
        "exported {} tensors ({}) from {} ({}) into {} file{} at {} in {:.2} s ({}/s)\n",
        e.tensors,
        fmt::bytes(e.total_size),
        r.src,
        r.source_format,
        e.files.len(),
        if e.files.len() == 1 { "" } else { "s" },
        r.out,
        r.seconds,
        fmt::bytes(r.bytes_per_second as u64),
    );
    for f in &e.files {
        s.push_str(&format!("  {}  {} tensors  {}\n", f.name, f.tensors, fmt::bytes(f.bytes)));
    }
    if let Some(i) = &e.index {
        s.push_str(&format!("  {i}\n"));
    }
    if e.cast_tensors > 0 {
        s.push_str(&format!("cast {} tensors\n", e.cast_tensors));
    }
    if e.skipped_tensors > 0 {
        s.push_str(&format!("skipped {} tensors by --include/--exclude\n", e.skipped_tensors));
    }
    if e.skipped_objects > 0 {
        s.push_str(&format!("skipped {} objects: safetensors holds tensors only\n", e.skipped_objects));
    }
    s
}
