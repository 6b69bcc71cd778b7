//! `dckpt validate`: the whole checkpoint checked, every byte.

use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use dckpt::storage::Storage;
use dckpt::verify::{
    Leftover, LeftoverKind, VerifyReport, is_data_file_name, remove_leftovers, remove_unfinished_writes,
    unfinished_writes, verify,
};
use dckpt::{Error, ErrorKind};
use dckpt_convert::SourceFormat;
use serde::Serialize;

use crate::fmt;
use crate::progress::Bars;

/// Check a checkpoint completely, every byte against its checksum, and list leftovers.
///
/// Check a checkpoint completely: the metadata (structure, exact-once coverage of every
/// tensor), every data file's size and safetensors header, and every checksum over every
/// byte. Also lists leftovers, with their sizes: data files of failed or replaced saves,
/// unfinished writes of processes that died mid-save (`.dckpt-tmp.*` files on local disk;
/// never those of a save still running), other objects.
///
/// A PyTorch DCP or Megatron torch_dist directory is checked as far as it can be:
/// exact-once coverage of every tensor by its chunks (naming each gap or overlap with the
/// fraction covered), every item within its file, every item's zip structure and data.pkl
/// against its chunk, and every zip entry's CRC-32 (DCP records no checksums of its own).
///
/// Exits 0 when sound (leftovers or not), 1 naming each problem (or, with
/// --remove-leftovers, when a leftover could not be removed), 2 when there is no committed
/// checkpoint (nothing there, or a save that did not commit).
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// A directory, file:///path or s3://bucket/prefix.
    #[arg(value_name = "PATH|URL")]
    pub location: String,
    /// Print one JSON object instead of the summary (and no progress bar).
    #[arg(long)]
    pub json: bool,
    /// Delete leftover data files of other saves (not while a save to it is running) and
    /// unfinished writes of dead processes (a running save's are never touched; without a
    /// committed checkpoint, only those).
    #[arg(long)]
    pub remove_leftovers: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    location: String,
    /// "dckpt" here; "dcp" or "torch_dist" for the checkpoints dckpt-convert checks.
    format: &'static str,
    /// "sound", "problems" or "not a checkpoint".
    status: &'static str,
    sound: bool,
    #[serde(flatten)]
    verify: VerifyReport,
    removed: Vec<Leftover>,
    /// Why --remove-leftovers failed (the checkpoint itself may still be sound).
    remove_error: Option<String>,
    /// Why it is not a checkpoint.
    reason: Option<String>,
}

pub fn run(a: &ValidateArgs) -> Result<ExitCode> {
    let storage = match crate::store::open_existing(&a.location) {
        Ok(s) => s,
        // A URL that names no store, or a location that cannot be opened: no checkpoint there.
        Err(e) => {
            let error = fmt::chain(&anyhow::Error::new(e).context(format!("opening {}", a.location)));
            eprintln!("dckpt validate: {error}");
            if a.json {
                fmt::emit(&fmt::error_json(&a.location, &error, None));
            }
            return Ok(ExitCode::from(2));
        }
    };
    // A PyTorch DCP or Megatron torch_dist directory is checked by dckpt-convert.
    if let Ok(SourceFormat::Dcp | SourceFormat::TorchDist) = dckpt_convert::detect(storage.as_ref(), None) {
        return crate::torch_dist::validate(&a.location, storage.as_ref(), a.json, a.remove_leftovers);
    }
    let mut r = Report {
        location: a.location.clone(),
        format: "dckpt",
        status: "sound",
        sound: false,
        verify: VerifyReport::default(),
        removed: Vec::new(),
        remove_error: None,
        reason: None,
    };
    let bars = Bars::new(!a.json);
    let total: u64 = storage.list("").map(|l| l.iter().map(|o| o.size).sum()).unwrap_or(0);
    let bar = bars.bar(total, "verify");
    let outcome = verify(storage.as_ref(), |n| bar.set_position(n));
    bar.finish_and_clear();
    let code = match outcome {
        Ok(v) => verified(a, storage.as_ref(), &mut r, v),
        Err(e) if matches!(e.kind(), ErrorKind::NotACheckpoint { .. }) => {
            r.status = "not a checkpoint";
            // Unfinished writes of dead processes are garbage with or without a checkpoint
            // (a killed first save leaves nothing else).
            if a.remove_leftovers {
                match remove_unfinished_writes(storage.as_ref()) {
                    Ok(removed) => r.removed = removed,
                    Err(e) => r.remove_error = Some(format!("removing unfinished writes: {e}")),
                }
            }
            r.verify.leftovers = unfinished_writes(storage.as_ref()).unwrap_or_default();
            r.reason = Some(not_a_checkpoint(storage.as_ref(), &e, &r.verify.leftovers, &r.removed));
            2
        }
        // The metadata file is there but cannot be read or is damaged.
        Err(e) => {
            r.status = "problems";
            r.verify.problems.push(e.to_string());
            1
        }
    };
    emit(a, &r)?;
    Ok(ExitCode::from(code))
}

/// What a verified checkpoint's report says, with its leftovers removed when asked; the
/// exit code.
fn verified(a: &ValidateArgs, storage: &dyn Storage, r: &mut Report, v: VerifyReport) -> u8 {
    r.verify = v;
    r.sound = r.verify.ok();
    if a.remove_leftovers && r.verify.leftovers.iter().any(|l| l.kind != LeftoverKind::Other) {
        match remove_leftovers(storage) {
            Ok(removed) => {
                r.removed = removed;
                r.verify.leftovers.retain(|l| !r.removed.contains(l));
            }
            Err(e) => r.remove_error = Some(format!("removing leftovers: {e}")),
        }
    }
    if r.sound && r.remove_error.is_none() {
        0
    } else if r.sound {
        // A sound checkpoint, but what was asked for did not happen.
        1
    } else {
        r.status = "problems";
        1
    }
}

/// Prints the report (JSON or lines for a person), and its problems on stderr.
fn emit(a: &ValidateArgs, r: &Report) -> Result<()> {
    if a.json {
        fmt::emit(&format!("{}\n", serde_json::to_string_pretty(r)?));
    } else {
        fmt::emit(&human(r));
    }
    for p in &r.verify.problems {
        eprintln!("dckpt validate: {p}");
    }
    if r.verify.problems_more > 0 {
        eprintln!("dckpt validate: ... and {} more problems", r.verify.problems_more);
    }
    if let Some(reason) = &r.reason {
        eprintln!("dckpt validate: {reason}");
    }
    if let Some(e) = &r.remove_error {
        eprintln!("dckpt validate: {e}");
    }
    Ok(())
}

fn not_a_checkpoint(storage: &dyn Storage, e: &Error, unfinished: &[Leftover], removed: &[Leftover]) -> String {
    let why = not_committed(storage, e);
    match (unfinished, removed) {
        ([], []) => why,
        (left, []) => format!(
            "{why}; {} unfinished writes of dead processes there ({}; --remove-leftovers deletes them)",
            left.len(),
            fmt::bytes(left.iter().map(|l| l.bytes).sum())
        ),
        (_, gone) => format!(
            "{why}; removed {} unfinished writes of dead processes ({})",
            gone.len(),
            fmt::bytes(gone.iter().map(|l| l.bytes).sum())
        ),
    }
}

fn not_committed(storage: &dyn Storage, e: &Error) -> String {
    match storage.list("") {
        Ok(all) => {
            let data = all.iter().filter(|o| is_data_file_name(&o.path)).count();
            if data > 0 {
                format!(
                    "not a checkpoint: the save did not commit ({data} data files but no metadata file at {})",
                    storage.location(dckpt::format::META_NAME)
                )
            } else if all.is_empty() {
                format!("not a checkpoint: nothing at {}", storage.location(""))
            } else {
                format!("{e} ({} other objects there)", all.len())
            }
        }
        Err(_) => e.to_string(),
    }
}

fn human(r: &Report) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    if let Some(reason) = &r.reason {
        let _ = writeln!(o, "{}: {reason}", r.location);
        return o;
    }
    let v = &r.verify;
    let _ = writeln!(o, "{}: save id {}", r.location, v.save_id);
    let _ = writeln!(
        o,
        "  checked      {} tensors, {} chunks, {} objects, {} files, {} read and checksummed",
        v.tensors,
        v.chunks,
        v.objects,
        v.files,
        fmt::bytes(v.bytes_checked)
    );
    if !v.leftovers.is_empty() {
        let removable = v.leftovers.iter().any(|l| l.kind != LeftoverKind::Other);
        let verb = if removable { "found (--remove-leftovers deletes all but other objects)" } else { "found" };
        let _ = writeln!(o, "  leftovers    {} {verb}: {}", v.leftovers.len(), listed(&v.leftovers));
    }
    if !r.removed.is_empty() {
        let _ = writeln!(o, "  removed      {}", listed(&r.removed));
    }
    if let Some(e) = &r.remove_error {
        let _ = writeln!(o, "  NOT REMOVED  {e}");
    }
    if r.sound {
        let _ = writeln!(o, "  result       SOUND: structure, exact-once coverage, headers and every checksum");
    } else {
        let n = v.problems.len() + v.problems_more;
        let _ = writeln!(o, "  result       {n} PROBLEMS:");
        for p in &v.problems {
            let _ = writeln!(o, "    {p}");
        }
        if v.problems_more > 0 {
            let _ = writeln!(o, "    ... and {} more", v.problems_more);
        }
    }
    o
}

/// `path (size, what)` for each leftover.
fn listed(leftovers: &[Leftover]) -> String {
    let what = |k: LeftoverKind| match k {
        LeftoverKind::DataFile => "another save's data file",
        LeftoverKind::UnfinishedWrite => "unfinished write of a dead process",
        LeftoverKind::Other => "other object",
    };
    let each: Vec<String> =
        leftovers.iter().map(|l| format!("{} ({}, {})", l.path, fmt::bytes(l.bytes), what(l.kind))).collect();
    each.join(", ")
}
