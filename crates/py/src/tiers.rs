//! The node-local tier from Python: the options `Checkpointer.save(..., local=...)` and
//! `Checkpointer.load(..., local=...)` take as dicts, and the outcomes they return.

use dckpt::{
    IfWhole, LoadOutcome, LocalRestoreOptions, LocalRestoreOutcome, LocalSaveOptions, Placement, TieredOutcome,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::request_error;

/// What a load gave: a persistent checkpoint's load, or a local step's restore.
pub(crate) enum Loaded {
    Persistent(LoadOutcome),
    Local(LocalRestoreOutcome),
}

impl Loaded {
    /// Whether the load filled the targets of a key on `rank`: a stored key (the missing ones
    /// returned), or any key of a restore that read this rank's part.
    pub(crate) fn filled(&self, rank: usize) -> impl Fn(&str) -> bool + '_ {
        let (missing, read) = match self {
            Loaded::Persistent(o) => (o.missing.as_slice(), true),
            Loaded::Local(o) => (&[][..], o.step.is_some() && !o.failed.contains(&(rank as u32))),
        };
        move |key| read && !missing.iter().any(|m| m == key)
    }
}

fn required<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    match d.get_item(key)? {
        Some(v) => extract(&v, key),
        None => Err(request_error(format!("local: {key:?} is missing"))),
    }
}

fn optional<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str, default: T) -> PyResult<T> {
    match d.get_item(key)? {
        Some(v) if !v.is_none() => extract(&v, key),
        _ => Ok(default),
    }
}

fn extract<'py, T: FromPyObjectOwned<'py>>(v: &Bound<'py, PyAny>, key: &str) -> PyResult<T> {
    let got: PyResult<T> = v.extract().map_err(Into::into);
    got.map_err(|e| request_error(format!("local[{key:?}]: {e}")))
}

/// `{"dir", "step", "ranks_per_node", "copies" (2), "keep" (1), "run" (""), "if_whole"
/// ("refuse", "keep" or "replace")}`: the directory and options (`run`: the run the step
/// belongs to, see `LocalSaveOptions::run`; `if_whole`: `LocalSaveOptions::if_whole`), with
/// the caller's failure on this rank, if any. An option this rank gives wrongly is that
/// failure too (the save then fails on every rank in its first round, rather than here
/// while the others wait in it); only a directory it does not give is raised here.
pub(crate) fn local_save_options(
    d: &Bound<'_, PyDict>,
    caller_failed: Option<String>,
) -> PyResult<(String, LocalSaveOptions)> {
    let dir = required(d, "dir")?;
    let mut wrong = None;
    let placement = Placement {
        ranks_per_node: or_noted(required(d, "ranks_per_node"), 1, &mut wrong),
        copies: or_noted(optional(d, "copies", 2), 2, &mut wrong),
    };
    let mut o = LocalSaveOptions::new(or_noted(required(d, "step"), 0, &mut wrong), placement);
    o.keep = or_noted(optional(d, "keep", 1), 1, &mut wrong);
    o.run = or_noted(optional(d, "run", String::new()), String::new(), &mut wrong);
    let if_whole = optional(d, "if_whole", "refuse".to_string()).and_then(|w| match w.as_str() {
        "refuse" => Ok(IfWhole::Refuse),
        "keep" => Ok(IfWhole::Keep),
        "replace" => Ok(IfWhole::Replace),
        other => Err(request_error(format!("local[\"if_whole\"]: {other:?}: expected refuse, keep or replace"))),
    });
    o.if_whole = or_noted(if_whole, IfWhole::Refuse, &mut wrong);
    o.caller_failed = caller_failed.or(wrong);
    Ok((dir, o))
}

/// `{"min_step" (None), "below" (None), "run" ("")}`, with the caller's failure on this rank, if any; an
/// option given wrongly is that failure too (see `local_save_options`).
pub(crate) fn local_restore_options(
    d: &Bound<'_, PyDict>,
    caller_failed: Option<String>,
) -> PyResult<LocalRestoreOptions> {
    let mut wrong = None;
    let min_step = or_noted(optional(d, "min_step", None), None, &mut wrong);
    let below = or_noted(optional(d, "below", None), None, &mut wrong);
    let run = or_noted(optional(d, "run", String::new()), String::new(), &mut wrong);
    let caller_failed = caller_failed.or(wrong);
    Ok(LocalRestoreOptions { min_step, below, run, caller_failed, ..LocalRestoreOptions::default() })
}

/// `read`'s value, or `default` with its error noted in `wrong` (the first one kept).
fn or_noted<T>(read: PyResult<T>, default: T, wrong: &mut Option<String>) -> T {
    read.unwrap_or_else(|e| {
        wrong.get_or_insert_with(|| e.to_string());
        default
    })
}

/// The persistent outcome's dict (empty where the save wrote the local tier only), with
/// `"local": {"step", "bytes", "received_bytes", "removed", "seconds", "kept"}` where it
/// wrote one or kept it whole, or `"local_error"`, the message, where its storage failed
/// and the persistent save went on.
pub(crate) fn tiered_outcome<'py>(py: Python<'py>, t: &TieredOutcome) -> PyResult<Bound<'py, PyDict>> {
    let d = match &t.persistent {
        Some(o) => crate::outcome::save_outcome(py, o)?,
        None => PyDict::new(py),
    };
    if let Some(l) = &t.local {
        let ld = PyDict::new(py);
        ld.set_item("step", l.step)?;
        ld.set_item("bytes", l.bytes)?;
        ld.set_item("received_bytes", l.received_bytes)?;
        ld.set_item("removed", &l.removed)?;
        ld.set_item("seconds", l.seconds)?;
        ld.set_item("kept", l.kept)?;
        d.set_item("local", ld)?;
    }
    if let Some(e) = &t.local_error {
        d.set_item("local_error", e.to_string())?;
    }
    Ok(d)
}

/// `({"step", "own", "peer", "failed", "reasons", "bytes_read", "bytes_received"}, [bytes |
/// None per object])`.
pub(crate) fn restore_outcome<'py>(
    py: Python<'py>,
    o: &LocalRestoreOutcome,
    datas: Bound<'py, PyList>,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyList>)> {
    let d = PyDict::new(py);
    d.set_item("step", o.step)?;
    d.set_item("own", o.own)?;
    d.set_item("peer", o.peer)?;
    d.set_item("failed", &o.failed)?;
    d.set_item("reasons", &o.reasons)?;
    d.set_item("not_whole", &o.not_whole)?;
    d.set_item("bytes_read", o.bytes_read)?;
    d.set_item("bytes_received", o.bytes_received)?;
    Ok((d, datas))
}
