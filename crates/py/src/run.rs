//! The run manager's storage work for `dckpt.torch.CheckpointManager`: each function opens
//! the run root, does one thing of `dckpt::manager` and answers in JSON. Python calls them on
//! rank 0 and sends the answer to the other ranks, so that every rule (step names, which
//! step is latest, what retention and gc delete, in which order) is the facade's.

use std::sync::Arc;

use dckpt::manager::{self, RetentionPolicy};
use dckpt::{Error, ErrorKind, Storage};
use pyo3::prelude::*;

use crate::errors::engine_error;

fn root(url: &str) -> dckpt::Result<Arc<dyn Storage>> {
    dckpt::open(url).map_err(Error::from)
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("the manager's values serialize")
}

fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> dckpt::Result<T> + Send) -> PyResult<T> {
    py.detach(f).map_err(|e| engine_error(py, &e))
}

/// The directory name of `step` under a run root.
#[pyfunction]
pub fn run_step_dir(step: u64) -> String {
    manager::step_dir(step)
}

/// `{"latest": {...}, "steps": [...]}` of the run root (see `dckpt::manager::resolve_latest`).
#[pyfunction]
pub fn run_scan(py: Python<'_>, url: String) -> PyResult<String> {
    run(py, || {
        let (latest, steps) = manager::resolve_latest(&root(&url)?)?;
        Ok(serde_json::json!({"latest": latest, "steps": steps}).to_string())
    })
}

/// Refuses a step that is committed already (`dckpt.AlreadyExists`).
#[pyfunction]
pub fn run_check_new_step(py: Python<'_>, url: String, step: u64) -> PyResult<()> {
    run(py, || {
        let dir = manager::step_storage(&root(&url)?, step);
        match dckpt::engine::read_metadata_local(dir.as_ref()) {
            Ok(_) => Err(Error::new(ErrorKind::AlreadyExists { location: dir.location("") }).on_rank(0)),
            Err(_) => Ok(()),
        }
    })
}

/// After `step` committed with `save_id`: the pointer, then retention (never `step` nor
/// `protected`); the steps deleted, as JSON.
#[pyfunction]
#[pyo3(signature = (url, step, save_id, keep_last=None, keep_every=None))]
pub fn run_after_commit(
    py: Python<'_>,
    url: String,
    step: u64,
    save_id: String,
    keep_last: Option<u64>,
    keep_every: Option<u64>,
) -> PyResult<String> {
    let policy = RetentionPolicy { keep_last, keep_every };
    run(py, || {
        let root = root(&url)?;
        manager::write_pointer(&root, step, &save_id)?;
        let committed: Vec<u64> = manager::scan(&root)?.into_iter().filter(|s| s.committed).map(|s| s.step).collect();
        let doomed = manager::retention_deletes(&committed, policy, &[step]);
        for &s in &doomed {
            manager::delete_step(&root, s, &mut |_| {})?;
        }
        Ok(json(&doomed))
    })
}

/// Garbage collection of the run root (`dckpt::manager::gc_root`); the report as JSON.
#[pyfunction]
#[pyo3(signature = (url, keep_last=None, keep_every=None, protected=Vec::new(), dry_run=false))]
pub fn run_gc(
    py: Python<'_>,
    url: String,
    keep_last: Option<u64>,
    keep_every: Option<u64>,
    protected: Vec<u64>,
    dry_run: bool,
) -> PyResult<String> {
    let policy = RetentionPolicy { keep_last, keep_every };
    run(py, || {
        let report = manager::gc_root(&root(&url)?, Some(policy), &protected, dry_run, &mut |_| {}, &mut |_| {})?;
        Ok(json(&report))
    })
}
