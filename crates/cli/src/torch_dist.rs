//! `dckpt inspect` and `dckpt validate` of a PyTorch DCP or Megatron `torch_dist`
//! checkpoint: printing what `dckpt_convert::torch_dist` reads and checks.

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::Result;
use dckpt::storage::Storage;
use dckpt_convert::torch_dist::{self, Checkpoint, TensorCoverage, ValidateReport, torch_name};
use dckpt_convert::{ConvertError, SourceFormat};
use serde::Serialize;

use crate::fmt;
use crate::progress::Bars;

/// What `validate` says about checksums: DCP records none of its own.
pub const CHECKSUMS_NOTE: &str = "DCP records no checksums of its own: checked instead the CRC-32 of every zip entry torch.save wrote into the items (items that are not torch.save archives: their length only)";

#[derive(Debug, Serialize)]
struct ChunkRow {
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    file: Option<String>,
    offset: Option<u64>,
    length: Option<u64>,
}

#[derive(Debug, Serialize)]
struct TensorRow {
    key: String,
    /// dckpt's name, as `inspect` of a dckpt checkpoint gives it (`bf16`).
    dtype: String,
    /// PyTorch's (`torch.bfloat16`).
    torch_dtype: String,
    global_shape: Vec<u64>,
    chunks: usize,
    bytes: u64,
    regions: Vec<ChunkRow>,
}

#[derive(Debug, Serialize)]
struct ObjectRow {
    key: String,
    bytes: u64,
    file: Option<String>,
    offset: Option<u64>,
    /// A Megatron ShardedObject key, split.
    sharded_object: Option<ShardedObjectRow>,
}

#[derive(Debug, Serialize)]
struct ShardedObjectRow {
    key: String,
    offset: Vec<u64>,
    shape: Vec<u64>,
}

#[derive(Debug, Serialize)]
struct FileRow {
    name: String,
    bytes: u64,
    items: usize,
}

#[derive(Debug, Serialize)]
struct InspectReport {
    location: String,
    format: &'static str,
    versions: Vec<String>,
    save_id: Option<String>,
    megatron: Option<serde_json::Value>,
    common_bytes: Option<u64>,
    tensors: Vec<TensorRow>,
    objects: Vec<ObjectRow>,
    files: Vec<FileRow>,
    chunks: usize,
    data_bytes: u64,
    file_bytes: u64,
}

/// The code a failure to open the checkpoint exits with: 2 when it is not there, 1 when it
/// is damaged or malformed.
fn open_failed(e: &ConvertError) -> u8 {
    match e {
        ConvertError::NotACheckpoint { .. } => 2,
        _ => 1,
    }
}

pub fn inspect(location: &str, storage: &dyn Storage, json: bool) -> Result<ExitCode> {
    let ckpt = match Checkpoint::open(storage) {
        Ok(c) => c,
        Err(e) => {
            let error = e.to_string();
            eprintln!("dckpt inspect: {error}");
            if json {
                fmt::emit(&fmt::error_json(location, &error, None));
            }
            return Ok(ExitCode::from(open_failed(&e)));
        }
    };
    let r = inspect_report(location, &ckpt);
    if json {
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
    } else {
        fmt::emit(&inspect_human(&r));
    }
    Ok(ExitCode::SUCCESS)
}

fn inspect_report(location: &str, c: &Checkpoint) -> InspectReport {
    let index = c.metadata.storage_index();
    let mut per_file: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, s) in &c.metadata.storage_data {
        *per_file.entry(s.relative_path.as_str()).or_default() += 1;
    }
    let tensors: Vec<TensorRow> = c
        .tensors()
        .map(|(k, t)| {
            let regions: Vec<ChunkRow> = t
                .chunks
                .iter()
                .map(|ch| {
                    let s = index.get(&(k, Some(ch.offsets.as_slice())));
                    ChunkRow {
                        offsets: ch.offsets.clone(),
                        sizes: ch.sizes.clone(),
                        file: s.map(|s| s.relative_path.clone()),
                        offset: s.map(|s| s.offset),
                        length: s.map(|s| s.length),
                    }
                })
                .collect();
            let numel: u64 = t
                .chunks
                .iter()
                .map(|ch| ch.sizes.iter().fold(1u64, |a, &d| a.saturating_mul(d)))
                .fold(0, u64::saturating_add);
            TensorRow {
                key: k.to_string(),
                dtype: t.dtype.to_string(),
                torch_dtype: format!("torch.{}", torch_name(t.dtype)),
                global_shape: t.size.clone(),
                chunks: t.chunks.len(),
                bytes: numel.saturating_mul(t.dtype.size()),
                regions,
            }
        })
        .collect();
    let objects: Vec<ObjectRow> = c
        .objects()
        .map(|k| {
            let s = index.get(&(k, None));
            ObjectRow {
                key: k.to_string(),
                bytes: s.map_or(0, |s| s.length),
                file: s.map(|s| s.relative_path.clone()),
                offset: s.map(|s| s.offset),
                sharded_object: torch_dist::sharded_object(k).map(|o| ShardedObjectRow {
                    key: o.key,
                    offset: o.offset,
                    shape: o.shape,
                }),
            }
        })
        .collect();
    let files: Vec<FileRow> = c
        .files
        .iter()
        .map(|(name, &bytes)| FileRow {
            name: name.clone(),
            bytes,
            items: per_file.get(name.as_str()).copied().unwrap_or(0),
        })
        .collect();
    InspectReport {
        location: location.to_string(),
        format: c.format.name(),
        versions: c.versions(),
        save_id: c.metadata.save_id.clone(),
        megatron: c.megatron.clone(),
        common_bytes: c.common_bytes,
        chunks: tensors.iter().map(|t| t.chunks).sum(),
        data_bytes: c.metadata.storage_data.iter().map(|(_, s)| s.length).fold(0, u64::saturating_add),
        file_bytes: c.files.values().sum(),
        tensors,
        objects,
        files,
    }
}

fn what(format: &str) -> &'static str {
    if format == SourceFormat::TorchDist.name() { "Megatron torch_dist checkpoint" } else { "PyTorch DCP checkpoint" }
}

fn inspect_human(r: &InspectReport) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(o, "{}: {} (format {})", r.location, what(r.format), r.format);
    if !r.versions.is_empty() {
        let _ = writeln!(o, "  written by   {}", r.versions.join(", "));
    }
    if let Some(id) = &r.save_id {
        let _ = writeln!(o, "  save id      {id}");
    }
    if let Some(n) = r.common_bytes {
        let _ = writeln!(o, "  common state common.pt, {} (opaque)", fmt::bytes(n));
    }
    let _ = writeln!(
        o,
        "  contents     {} tensors in {} chunks, {} objects, {} of items in {} files ({})",
        r.tensors.len(),
        r.chunks,
        r.objects.len(),
        fmt::bytes(r.data_bytes),
        r.files.len(),
        fmt::bytes(r.file_bytes)
    );
    let _ = writeln!(o, "  checksums    none recorded by DCP (torch.save's zip entries carry CRC-32)");
    let kw =
        r.tensors.iter().map(|t| t.key.len()).chain(r.objects.iter().map(|x| x.key.len())).max().unwrap_or(6).max(6);
    let shapes: Vec<String> = r.tensors.iter().map(|t| format!("{:?}", t.global_shape)).collect();
    let sw = shapes.iter().map(String::len).max().unwrap_or(5).max(12);
    let _ =
        writeln!(o, "\n{:<kw$}  {:<13}  {:<sw$}  {:>6}  {:>11}", "tensor", "dtype", "global shape", "chunks", "bytes");
    for (t, s) in r.tensors.iter().zip(&shapes) {
        let _ = writeln!(
            o,
            "{:<kw$}  {:<13}  {:<sw$}  {:>6}  {:>11}",
            t.key,
            t.torch_dtype.trim_start_matches("torch."),
            s,
            t.chunks,
            fmt::bytes(t.bytes)
        );
    }
    if !r.objects.is_empty() {
        let _ = writeln!(o, "\n{:<kw$}  {:>11}  sharded object", "object", "bytes");
        for x in &r.objects {
            let so = x
                .sharded_object
                .as_ref()
                .map(|s| format!("{} at {:?} of grid {:?}", s.key, s.offset, s.shape))
                .unwrap_or_default();
            let _ = writeln!(o, "{:<kw$}  {:>11}  {so}", x.key, fmt::bytes(x.bytes));
        }
    }
    let fw = r.files.iter().map(|f| f.name.len()).max().unwrap_or(4).max(4);
    let _ = writeln!(o, "\n{:<fw$}  {:>6}  {:>11}", "file", "items", "bytes");
    for f in &r.files {
        let _ = writeln!(o, "{:<fw$}  {:>6}  {:>11}", f.name, f.items, fmt::bytes(f.bytes));
    }
    o
}

/// `dckpt validate --json` of a DCP checkpoint: the fields of dckpt's report that apply,
/// and what only DCP has.
#[derive(Debug, Serialize)]
struct ValidateJson<'a> {
    location: &'a str,
    format: &'static str,
    status: &'static str,
    sound: bool,
    save_id: Option<String>,
    files: usize,
    tensors: usize,
    chunks: usize,
    objects: usize,
    items: usize,
    bytes_checked: u64,
    problems: &'a [String],
    problems_more: usize,
    incomplete: &'a [TensorCoverage],
    checksums: &'static str,
    leftovers: [(); 0],
    removed: [(); 0],
    remove_error: Option<String>,
    reason: Option<String>,
}

pub fn validate(location: &str, storage: &dyn Storage, json: bool, remove_leftovers: bool) -> Result<ExitCode> {
    if remove_leftovers {
        let error = "--remove-leftovers applies to dckpt checkpoints only, not to DCP / torch_dist";
        eprintln!("dckpt validate: {error}");
        if json {
            crate::fmt::emit(&crate::fmt::error_json(location, error, None));
        }
        return Ok(ExitCode::from(2));
    }
    let ckpt = match Checkpoint::open(storage) {
        Ok(c) => c,
        Err(e) => return unopened(location, &e, json),
    };
    let bars = Bars::new(!json);
    let total: u64 = ckpt.metadata.storage_data.iter().map(|(_, s)| s.length).fold(0, u64::saturating_add);
    let bar = bars.bar(total, "validate");
    let r = torch_dist::validate(storage, &ckpt, |n| bar.set_position(n));
    bar.finish_and_clear();
    let sound = r.ok();
    if json {
        let v = ValidateJson {
            location,
            format: ckpt.format.name(),
            status: if sound { "sound" } else { "problems" },
            sound,
            save_id: ckpt.metadata.save_id.clone(),
            files: r.files,
            tensors: r.tensors,
            chunks: r.chunks,
            objects: r.objects,
            items: r.items,
            bytes_checked: r.bytes_checked,
            problems: &r.problems,
            problems_more: r.problems_more,
            incomplete: &r.incomplete,
            checksums: CHECKSUMS_NOTE,
            leftovers: [],
            removed: [],
            remove_error: None,
            reason: None,
        };
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&v)?));
    } else {
        fmt::emit(&validate_human(location, &ckpt, &r));
    }
    for p in &r.problems {
        eprintln!("dckpt validate: {p}");
    }
    if r.problems_more > 0 {
        eprintln!("dckpt validate: ... and {} more problems", r.problems_more);
    }
    Ok(ExitCode::from(if sound { 0 } else { 1 }))
}

/// The report on a DCP directory whose metadata cannot be read: not a checkpoint (exit 2),
/// or a damaged one (exit 1).
fn unopened(location: &str, e: &ConvertError, json: bool) -> Result<ExitCode> {
    let code = open_failed(e);
    let v = ValidateJson {
        location,
        format: "dcp",
        status: if code == 2 { "not a checkpoint" } else { "problems" },
        sound: false,
        save_id: None,
        files: 0,
        tensors: 0,
        chunks: 0,
        objects: 0,
        items: 0,
        bytes_checked: 0,
        problems: &[],
        problems_more: 0,
        incomplete: &[],
        checksums: CHECKSUMS_NOTE,
        leftovers: [],
        removed: [],
        remove_error: None,
        reason: None,
    };
    let problems = [e.to_string()];
    let v = if code == 2 {
        ValidateJson { reason: Some(e.to_string()), ..v }
    } else {
        ValidateJson { problems: &problems, ..v }
    };
    if json {
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&v)?));
    } else if code == 2 {
        fmt::emit(&format!("{location}: {e}\n"));
    } else {
        fmt::emit(&format!("{location}: DCP metadata that cannot be read\n  result       1 PROBLEMS:\n    {e}\n"));
    }
    eprintln!("dckpt validate: {e}");
    Ok(ExitCode::from(code))
}

fn validate_human(location: &str, c: &Checkpoint, r: &ValidateReport) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(o, "{location}: {} (format {})", what(c.format.name()), c.format.name());
    let _ = writeln!(
        o,
        "  checked      {} tensors, {} chunks, {} objects, {} items in {} files, {} read",
        r.tensors,
        r.chunks,
        r.objects,
        r.items,
        r.files,
        fmt::bytes(r.bytes_checked)
    );
    let _ = writeln!(o, "  checksums    {CHECKSUMS_NOTE}");
    if r.ok() {
        let _ = writeln!(
            o,
            "  result       SOUND: exact-once coverage, items within their files, zip structure, data.pkl against every chunk, every CRC-32"
        );
    } else {
        let n = r.problems.len() + r.problems_more;
        let _ = writeln!(o, "  result       {n} PROBLEMS:");
        for p in &r.problems {
            let _ = writeln!(o, "    {p}");
        }
        if r.problems_more > 0 {
            let _ = writeln!(o, "    ... and {} more", r.problems_more);
        }
    }
    o
}
