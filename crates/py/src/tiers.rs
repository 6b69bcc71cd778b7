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
/// the caller's failure on this rank, if any.
pub(crate) fn local_save_options(
    d: &Bound<'_, PyDict>,
    caller_failed: Option<String>,
) -> PyResult<(String, LocalSaveOptions)> {
    let placement = Placement { ranks_per_node: required(d, "ranks_per_node")?, copies: optional(d, "copies", 2)? };
    let mut o = LocalSaveOptions::new(required(d, "step")?, placement);
    o.keep = optional(d, "keep", 1)?;
    o.run = optional(d, "run", String::new())?;
    o.if_whole = match optional(d, "if_whole", "refuse".to_string())?.as_str() {
        "refuse" => IfWhole::Refuse,
        "keep" => IfWhole::Keep,
        "replace" => IfWhole::Replace,
        other => {
            return Err(request_error(format!("local[\"if_whole\"]: {other:?}: expected refuse, keep or replace")));
        }
    };
    o.caller_failed = caller_failed;
    Ok((required(d, "dir")?, o))
}

/// `{"min_step" (None), "run" ("")}`, with the caller's failure on this rank, if any.
pub(crate) fn local_restore_options(
    d: &Bound<'_, PyDict>,
    caller_failed: Option<String>,
) -> PyResult<LocalRestoreOptions> {
    let (min_step, run) = (optional(d, "min_step", None)?, optional(d, "run", String::new())?);
    Ok(LocalRestoreOptions { min_step, run, caller_failed, ..LocalRestoreOptions::default() })
}

/// The persistent outcome's dict (empty where the save wrote the local tier only), with
/// `"local": {"step", "bytes", "received_bytes", "removed", "seconds", "kept"}` where it
/// wrote one or kept it whole.
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
