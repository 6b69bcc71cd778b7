//! `dckpt convert`: checkpoints of other formats into dckpt.

use std::process::ExitCode;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use anyhow::Result;
use clap::{Args, ValueEnum};
use dckpt_convert::torch_dist::{self, TorchDistReport};
use dckpt_convert::{
    Conversion, ConvertError, ConvertReport, ConvertTarget, DckptSource, HfModel, TensorSource, conversion, detect,
    hf_to_dckpt, split_file_location,
};
use serde::Serialize;

use crate::export::exit_code;
use crate::fmt;
use crate::progress::{Bars, follow};

/// Convert a checkpoint: safetensors, DCP or torch_dist to dckpt, or dckpt to torch_dist.
///
/// Convert a checkpoint between formats: into a new dckpt checkpoint, which any parallel
/// layout then loads through the engine, or from one into a torch_dist directory.
///
/// SRC is detected. A Hugging Face safetensors model (one .safetensors file, a directory
/// with model.safetensors, or shards listed by model.safetensors.index.json): every header
/// is validated first, each tensor becomes one whole chunk. A PyTorch DCP or Megatron
/// torch_dist directory: every chunk is located and checked against the metadata first,
/// then becomes one chunk of the dckpt checkpoint (a strided one written row-major), its
/// zip CRC-32 checked as its bytes pass; bytes items become objects of their opaque bytes
/// (a Megatron ShardedObject `key/shard_<offsets>_<shape>` the object key at that place of
/// its grid, when the grid is complete), and Megatron's common.pt the object "common.pt".
/// Either way the engine reads each piece from its file while it writes it, checksummed,
/// so memory stays a few write buffers whatever the model's size.
///
/// With --to torch_dist, SRC is a dckpt checkpoint: every tensor is read through the
/// engine (checksums checked) and written as one whole chunk, a torch.save archive in
/// __0_0.distcp, with every object as the torch.save archive of its value (one that is an
/// archive already kept as it is; untagged bytes saved through the Rust API refused, naming
/// the key), common.pt (Megatron's common state: the object a conversion kept it as, else
/// the common.pt Megatron's save wrote beside the checkpoint, else an empty dict), Megatron's
/// metadata.json and DCP's .metadata last.
/// PyTorch's dcp.load and Megatron-Core's dist_checkpointing.load read the result.
///
/// DST must hold no checkpoint and be a directory other than the one SRC is read from
/// (one below it will do). Exits 0, 1 when the conversion failed (a damaged source,
/// storage, a checkpoint already at DST), 2 on bad options, a location that cannot be
/// opened or a source it cannot convert.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The model or checkpoint: a directory, a .safetensors file, s3://bucket/prefix, ...
    #[arg(value_name = "SRC")]
    pub src: String,
    /// The new checkpoint: a directory or s3://bucket/prefix.
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
    /// A PyTorch DCP / Megatron torch_dist directory (from a dckpt checkpoint).
    #[value(name = "torch_dist")]
    TorchDist,
}

/// What a conversion wrote, by direction.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Done {
    Dckpt(ConvertReport),
    TorchDist(TorchDistReport),
}

#[derive(Debug, Serialize)]
struct Report {
    src: String,
    dst: String,
    to: &'static str,
    #[serde(flatten)]
    convert: Done,
    seconds: f64,
    bytes_per_second: f64,
}

pub fn run(a: &ConvertArgs) -> Result<ExitCode> {
    // `location` names what failed: SRC, or DST where opening or writing it did.
    let created = crate::store::new_local_dir(&a.dst);
    let fail_at = |location: &str, error: String, code: u8| {
        crate::store::remove_if_empty(created.as_deref());
        eprintln!("dckpt convert: {error}");
        if a.json {
            fmt::emit(&fmt::error_json(location, &error, None));
        }
        Ok(ExitCode::from(code))
    };
    let fail = |error: String, code: u8| fail_at(&a.src, error, code);
    if let Err(e) = crate::store::refuse_same_dir(&split_file_location(&a.src).0, &a.dst) {
        return fail_at(&a.dst, e, 2);
    }
    let (dir, file) = split_file_location(&a.src);
    let src = match crate::store::open_existing(&dir) {
        Ok(s) => s,
        Err(e) => return fail(format!("opening {dir}: {e}"), 2),
    };
    if let Some(missing) = crate::export::file_missing(src.as_ref(), file.as_deref()) {
        return fail(missing, 2);
    }
    let to = match a.to {
        Target::Dckpt => ConvertTarget::Dckpt,
        Target::TorchDist => ConvertTarget::TorchDist,
    };
    let plan = match detect(src.as_ref(), file.as_deref()).and_then(|f| conversion(f, to)) {
        Ok(c) => c,
        Err(e) => return fail(e.to_string(), exit_code(&e)),
    };
    let dst = match crate::store::open(&a.dst) {
        Ok(s) => s,
        Err(e) => return fail_at(&a.dst, format!("opening {}: {e}", a.dst), 2),
    };
    let bars = Bars::new(!a.json);
    let read = AtomicU64::new(0);
    let start = Instant::now();
    let outcome: std::result::Result<Done, ConvertError> = match plan {
        Conversion::SafetensorsToDckpt => match HfModel::open(src, file.as_deref()) {
            Ok(model) => {
                let bar = bars.bar(model.bytes(), "convert");
                follow(&bar, &read, || hf_to_dckpt(&model, &dst, &read)).map(Done::Dckpt)
            }
            Err(e) => Err(e),
        },
        Conversion::TorchDistToDckpt => match torch_dist::Checkpoint::open(src.as_ref()) {
            Ok(ckpt) => {
                let total = ckpt
                    .tensors()
                    // Saturating: the sizes are the file's word, for a progress bar only.
                    .map(|(_, t)| {
                        let numel = t.chunks.iter().map(|c| dckpt::spec::numel(&c.sizes));
                        numel.fold(0u64, u64::saturating_add).saturating_mul(t.dtype.size())
                    })
                    .fold(0u64, u64::saturating_add);
                let bar = bars.bar(total, "convert");
                follow(&bar, &read, || torch_dist::torch_dist_to_dckpt(src.as_ref(), &ckpt, &dst, &read))
                    .map(Done::Dckpt)
            }
            Err(e) => Err(e),
        },
        Conversion::DckptToTorchDist => match DckptSource::open(src) {
            Ok(source) => {
                let total = source.tensors().iter().map(|t| t.nbytes()).sum();
                let bar = bars.bar(total, "convert");
                follow(&bar, &read, || torch_dist::dckpt_to_torch_dist(&source, dst.as_ref(), &read))
                    .map(Done::TorchDist)
            }
            Err(e) => Err(e),
        },
    };
    let seconds = start.elapsed().as_secs_f64();
    match outcome {
        Ok(done) => emit(a, done, seconds),
        Err(e) if about_dst(&e) => fail_at(&a.dst, e.to_string(), exit_code(&e)),
        Err(e) => fail(e.to_string(), exit_code(&e)),
    }
}

/// Whether a failed conversion is about DST (a checkpoint there already, the converter's
/// refusal or the engine's at its commit), and so reported at DST rather than SRC.
fn about_dst(e: &ConvertError) -> bool {
    match e {
        ConvertError::Exists { .. } => true,
        ConvertError::Engine(e) => matches!(e.kind(), dckpt::ErrorKind::AlreadyExists { .. }),
        _ => false,
    }
}

/// Prints what a conversion that succeeded did: one JSON object, or one line for a person.
fn emit(a: &ConvertArgs, convert: Done, seconds: f64) -> Result<ExitCode> {
    let bytes = match &convert {
        Done::Dckpt(r) => r.bytes,
        Done::TorchDist(r) => r.bytes,
    };
    let r = Report {
        src: a.src.clone(),
        dst: a.dst.clone(),
        to: match a.to {
            Target::Dckpt => "dckpt",
            Target::TorchDist => "torch_dist",
        },
        bytes_per_second: bytes as f64 / seconds.max(1e-9),
        convert,
        seconds,
    };
    if a.json {
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
        return Ok(ExitCode::SUCCESS);
    }
    let what = match &r.convert {
        Done::Dckpt(c) => format!(
            "converted {} tensors ({}) from {} ({}) into a dckpt checkpoint at {} ({} data files, save {})",
            c.tensors,
            fmt::bytes(c.bytes),
            r.src,
            c.source_format,
            r.dst,
            c.files,
            c.save_id
        ),
        Done::TorchDist(c) => format!(
            "converted {} tensors ({}) and {} objects from {} (dckpt) into a torch_dist checkpoint at {} ({}, common.pt {})",
            c.tensors,
            fmt::bytes(c.bytes),
            c.objects,
            r.src,
            r.dst,
            c.files.join(", "),
            if c.common_from_source { "from the source" } else { "an empty dict" }
        ),
    };
    fmt::emit(&format!("{what} in {:.2} s ({}/s)\n", r.seconds, fmt::bytes(r.bytes_per_second as u64)));
    Ok(ExitCode::SUCCESS)
}
