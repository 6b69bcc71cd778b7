//! `dckpt inspect`: what a committed checkpoint holds.

use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use dckpt::format::{FormatErrorKind, META_NAME, Metadata, check_meta_bytes};
use dckpt_convert::SourceFormat;
use serde::Serialize;

use crate::fmt;

/// Show a checkpoint's tensors, objects, files and layout (dckpt, DCP or torch_dist).
///
/// Show a checkpoint: its tensors (dtype, global shape, chunks, bytes), objects, files and
/// the layout it was saved with. Reads only the metadata file. A PyTorch DCP or Megatron
/// torch_dist directory is shown too: its tensors, chunks and where each item lies, its
/// objects (Megatron ShardedObject keys split), files and recorded versions.
///
/// Exits 0, 1 when the metadata is unreadable or damaged, 2 when there is no committed
/// checkpoint there. With --json a failure is one JSON object too, with an `error` field.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// A directory, file:///path or s3://bucket/prefix.
    #[arg(value_name = "PATH|URL")]
    pub location: String,
    /// Print one JSON object instead of the tables.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct TensorRow {
    key: String,
    dtype: String,
    global_shape: Vec<u64>,
    chunks: usize,
    bytes: u64,
}

#[derive(Debug, Serialize)]
struct FileRow {
    name: String,
    bytes: u64,
    chunks: usize,
}

#[derive(Debug, Serialize)]
struct ObjectRow {
    key: String,
    entries: usize,
    bytes: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    location: String,
    /// Always "dckpt" here; "dcp" or "torch_dist" for the checkpoints dckpt-convert reads.
    format: &'static str,
    format_version: u32,
    save_id: String,
    writer: String,
    block_bytes: u64,
    layout: std::collections::BTreeMap<String, String>,
    tensors: Vec<TensorRow>,
    objects: Vec<ObjectRow>,
    files: Vec<FileRow>,
    chunks: usize,
    data_bytes: u64,
    file_bytes: u64,
}

pub fn run(a: &InspectArgs) -> Result<ExitCode> {
    // Every failure says the same on stderr and, with --json, as one object on stdout.
    let fail = |error: String, hint: Option<&str>, code: u8| {
        eprintln!("dckpt inspect: {error}");
        if let Some(h) = hint {
            eprintln!("dckpt inspect: {h}");
        }
        if a.json {
            fmt::emit(&fmt::error_json(&a.location, &error, hint));
        }
        Ok(ExitCode::from(code))
    };
    let storage = match crate::store::open_existing(&a.location) {
        Ok(s) => s,
        // A URL that names no store, or a location that cannot be opened: no checkpoint there.
        Err(e) => return fail(fmt::chain(&anyhow::Error::new(e).context(format!("opening {}", a.location))), None, 2),
    };
    // A PyTorch DCP or Megatron torch_dist directory is read by dckpt-convert.
    if let Ok(SourceFormat::Dcp | SourceFormat::TorchDist) = dckpt_convert::detect(storage.as_ref(), None) {
        return crate::torch_dist::inspect(&a.location, storage.as_ref(), a.json);
    }
    // The metadata alone, decoded (and validated) by the format crate: no engine involved.
    let location = storage.location(META_NAME);
    // The size before the bytes: an oversized (or sparse) file is refused without reading it.
    let bytes = match storage.size(META_NAME).map(|n| check_meta_bytes(n, &location)) {
        Ok(Ok(())) => storage.get(META_NAME),
        Ok(Err(e)) => return fail(e.to_string(), None, 1),
        Err(e) => Err(e),
    };
    let bytes = match bytes {
        Ok(b) => b,
        Err(dckpt::storage::Error::NotFound { .. }) => {
            return fail(format!("{location}: not a checkpoint (no committed metadata file)"), None, 2);
        }
        Err(e) => return fail(e.to_string(), None, 1),
    };
    let meta = match Metadata::decode(&bytes, &location) {
        Ok(m) => m,
        Err(e) => {
            let hint = match e.kind() {
                FormatErrorKind::UnsupportedVersion { .. } => {
                    Some("it was written by a newer dckpt; inspect it with that version")
                }
                _ => None,
            };
            return fail(e.to_string(), hint, 1);
        }
    };
    let r = report(&a.location, &meta);
    if a.json {
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(&r)?));
    } else {
        fmt::emit(&human(&r));
    }
    Ok(ExitCode::SUCCESS)
}

fn report(location: &str, m: &Metadata) -> Report {
    let tensors: Vec<TensorRow> = m
        .tensors
        .iter()
        .map(|t| TensorRow {
            key: t.key.clone(),
            dtype: t.dtype.to_string(),
            global_shape: t.global_shape.to_vec(),
            chunks: t.chunks.len(),
            bytes: t.chunks.iter().map(|c| c.region().numel()).sum::<u64>() * t.dtype.size(),
        })
        .collect();
    let files = m
        .files
        .iter()
        .enumerate()
        .map(|(i, f)| FileRow {
            name: f.name.clone(),
            bytes: f.bytes,
            chunks: m.tensors.iter().flat_map(|t| &t.chunks).filter(|c| c.file == i as u32).count()
                + m.objects.iter().flat_map(|o| &o.entries).filter(|e| e.file == i as u32).count(),
        })
        .collect();
    let objects = m
        .objects
        .iter()
        .map(|o| ObjectRow {
            key: o.key.clone(),
            entries: o.entries.len(),
            bytes: o.entries.iter().map(|e| e.len).sum(),
        })
        .collect();
    Report {
        location: location.to_string(),
        format: "dckpt",
        format_version: m.format_version,
        save_id: m.save_id.clone(),
        writer: m.writer.clone(),
        block_bytes: m.block_bytes,
        layout: m.layout.clone(),
        chunks: tensors.iter().map(|t| t.chunks).sum(),
        data_bytes: m.data_bytes(),
        file_bytes: m.files.iter().map(|f| f.bytes).sum(),
        tensors,
        objects,
        files,
    }
}

fn human(r: &Report) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{}: dckpt checkpoint, format {}, save id {}, written by {}",
        r.location, r.format_version, r.save_id, r.writer
    );
    let layout: Vec<String> = r.layout.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let _ = writeln!(
        o,
        "  saved with   {}",
        if layout.is_empty() { "(no layout recorded)".into() } else { layout.join(", ") }
    );
    let _ = writeln!(
        o,
        "  contents     {} tensors in {} chunks, {} objects, {} of data in {} files ({} with headers)",
        r.tensors.len(),
        r.chunks,
        r.objects.len(),
        fmt::bytes(r.data_bytes),
        r.files.len(),
        fmt::bytes(r.file_bytes)
    );
    let _ = writeln!(o, "  checksums    CRC-32 per {} block", fmt::bytes(r.block_bytes));
    let kw =
        r.tensors.iter().map(|t| t.key.len()).chain(r.objects.iter().map(|x| x.key.len())).max().unwrap_or(3).max(3);
    let shapes: Vec<String> = r.tensors.iter().map(|t| format!("{:?}", t.global_shape)).collect();
    let sw = shapes.iter().map(String::len).max().unwrap_or(5).max(12);
    let _ =
        writeln!(o, "\n{:<kw$}  {:<5}  {:<sw$}  {:>6}  {:>11}", "tensor", "dtype", "global shape", "chunks", "bytes");
    for (t, s) in r.tensors.iter().zip(&shapes) {
        let _ = writeln!(o, "{:<kw$}  {:<5}  {:<sw$}  {:>6}  {:>11}", t.key, t.dtype, s, t.chunks, fmt::bytes(t.bytes));
    }
    if !r.objects.is_empty() {
        let _ = writeln!(o, "\n{:<kw$}  {:>7}  {:>11}", "object", "entries", "bytes");
        for x in &r.objects {
            let _ = writeln!(o, "{:<kw$}  {:>7}  {:>11}", x.key, x.entries, fmt::bytes(x.bytes));
        }
    }
    let fw = r.files.iter().map(|f| f.name.len()).max().unwrap_or(4).max(4);
    let _ = writeln!(o, "\n{:<fw$}  {:>6}  {:>11}", "file", "chunks", "bytes");
    for f in &r.files {
        let _ = writeln!(o, "{:<fw$}  {:>6}  {:>11}", f.name, f.chunks, fmt::bytes(f.bytes));
    }
    o
}
