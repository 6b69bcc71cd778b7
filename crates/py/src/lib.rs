//! `dckpt._dckpt`: the native half of the `dckpt` Python package.
//!
//! Torch-free on purpose: Python describes each leaf by one function returning a typed
//! piece (`piece.rs`): `tensor_piece`, a `TensorPiece` (key, dtype name, global shape,
//! region, and the address and length of a host buffer it keeps alive for the call, checked
//! when the piece is made), or `object_piece`, an `ObjectPiece` (key, grid position, bytes). This module builds the engine's
//! [`SaveState`] and [`LoadRequest`] from them and runs the facade's [`Checkpointer`] with
//! the GIL released, so a Rust thread (a background save) may call back into Python
//! meanwhile; what it returns is built in `outcome.rs`.
//!
//! The collective is either a world of one (no Python involved) or a Python object whose
//! methods carry the messages (`collective::PyCollective`, `dckpt.torch.TorchCollective`
//! over a dedicated gloo group), or dckpt's own TCP star on a port rank 0 announces.

mod collective;
mod errors;
mod logs;
mod manager;
mod outcome;
mod piece;
mod tiers;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use dckpt::{
    Checkpointer, KeyPolicy, LoadOptions, LoadRequest, Location, ObjectData, OpenOptions, ReplicaCheck, SaveHandle,
    SaveOptions, SaveState, Strictness, TieredOutcome,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::{engine_error, request_error};
use crate::piece::{ObjectPiece, TensorPiece, pieces};

/// One rank's checkpointer, kept by Python per process group so repeated saves reuse their
/// plan. Rank and world size are read once: asking the engine would wait on a background
/// save, which may need the GIL this thread holds.
#[pyclass(module = "dckpt._dckpt", name = "Checkpointer", frozen)]
struct PyCheckpointer {
    inner: Mutex<Option<Arc<Checkpointer>>>,
    rank: usize,
    world_size: usize,
    /// The process that made it: a forked child must not touch the parent's engine (its
    /// background thread does not exist there, its locks may be held forever).
    pid: u32,
}

impl PyCheckpointer {
    fn get(&self) -> PyResult<Arc<Checkpointer>> {
        if std::process::id() != self.pid {
            return Err(errors::DckptError::new_err(
                "this checkpointer belongs to the parent of a forked process; make a new one in the child",
            ));
        }
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.clone().ok_or_else(|| errors::DckptError::new_err("this checkpointer is closed"))
    }

    fn from_checkpointer(checkpointer: Checkpointer) -> PyCheckpointer {
        let (rank, world_size) = (checkpointer.rank(), checkpointer.world_size());
        PyCheckpointer { inner: Mutex::new(Some(Arc::new(checkpointer))), rank, world_size, pid: std::process::id() }
    }
}

/// `checkpointer` opening local disk with [`LocalConfig::mapped_reads`] as asked.
fn with_mapped_reads(checkpointer: Checkpointer, mapped_reads: bool) -> Checkpointer {
    let mut options = OpenOptions::default();
    options.local.mapped_reads = mapped_reads;
    checkpointer.with_open_options(options)
}

impl Drop for PyCheckpointer {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // Inherited across fork: its collective's sockets and threads are the parent's.
            if let Some(c) = self.inner.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
                std::mem::forget(c);
            }
        }
    }
}

#[pymethods]
impl PyCheckpointer {
    /// A checkpointer over `collective`: `None` for a world of one, else an object with the
    /// methods of `dckpt.torch.TorchCollective` (`rank`, `world_size`, `barrier`,
    /// `broadcast`, `gather`, `all_gather`, `all_reduce_u64`, `scatter`).
    ///
    /// `mapped_reads`: loads from local disk copy out of mappings of the files, checking
    /// each piece in cache just before it is copied (a warm load runs faster), and install,
    /// on first use, a process-wide `SIGBUS` handler that turns an unreadable page into an
    /// error (every other `SIGBUS` goes to the handler that was there before). Off unless
    /// asked for: the handler is the host's to allow.
    #[new]
    #[pyo3(signature = (collective=None, *, mapped_reads=false))]
    fn new(py: Python<'_>, collective: Option<Py<PyAny>>, mapped_reads: bool) -> PyResult<PyCheckpointer> {
        let checkpointer = match collective {
            None => Checkpointer::local(),
            Some(obj) => Checkpointer::new(Arc::new(collective::PyCollective::new(py, obj)?)),
        };
        Ok(PyCheckpointer::from_checkpointer(with_mapped_reads(checkpointer, mapped_reads)))
    }

    /// A checkpointer over dckpt's own TCP star (for very large worlds: no Python in the
    /// collective path). Rank 0 listens on `port` (0: an ephemeral port, which it passes to
    /// `announce(port)` before waiting, so the caller can publish it in the job's store);
    /// the others connect to `host:port`. `job_id` must be the same on every rank and
    /// unique to this world; `timeout_s` bounds the rendezvous. `mapped_reads` as for the
    /// constructor.
    #[staticmethod]
    #[pyo3(signature = (rank, world_size, host, port, job_id, timeout_s=300.0, announce=None, *, mapped_reads=false))]
    #[allow(clippy::too_many_arguments)] // the Python signature's arguments
    fn tcp(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        host: String,
        port: u16,
        job_id: String,
        timeout_s: f64,
        announce: Option<Py<PyAny>>,
        mapped_reads: bool,
    ) -> PyResult<PyCheckpointer> {
        let c = collective::tcp(py, rank, world_size, host, port, job_id, timeout_s, announce)?;
        Ok(PyCheckpointer::from_checkpointer(with_mapped_reads(Checkpointer::new(Arc::new(c)), mapped_reads)))
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.world_size
    }

    /// Saves this rank's pieces at `location`: `tensors`, `TensorPiece`s whose buffers stay
    /// alive and unchanged until the call returns (for `async_save`, until it returns the
    /// handle: the bytes are copied first), and `objects`, `ObjectPiece`s with their data.
    /// Returns the outcome as a dict, or a `SaveHandle` for `async_save`.
    ///
    /// `local`, `{"dir", "step", "ranks_per_node", "copies", "keep"}`, also saves the pieces
    /// as this rank's part of a node-local step under `dir`, with copies on peers of other
    /// nodes (first, from the same copy when async); `location` may then be `None` (a
    /// step due on the local tier only). The outcome then carries `"local"`.
    ///
    /// `caller_failed`, the caller's error as text where it could not make this rank's
    /// pieces: the save (pass no pieces) fails on every rank in its first round, naming this
    /// rank and the error, instead of the others waiting for it.
    #[pyo3(signature = (location, tensors, objects, *, replace=false, async_save=false, layout=None, replica_check="sample", local=None, caller_failed=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature's keyword arguments
    fn save(
        &self,
        py: Python<'_>,
        location: Option<String>,
        tensors: Vec<Bound<'_, PyAny>>,
        objects: Vec<Bound<'_, PyAny>>,
        replace: bool,
        async_save: bool,
        layout: Option<BTreeMap<String, String>>,
        replica_check: &str,
        local: Option<Bound<'_, PyDict>>,
        caller_failed: Option<String>,
    ) -> PyResult<Py<PyAny>> {
        let ckpt = self.get()?;
        let tensors = pieces::<TensorPiece>(&tensors, "TensorPiece")?;
        let objects = pieces::<ObjectPiece>(&objects, "ObjectPiece")?;
        let mut opts = SaveOptions::default().replace(replace).replica_check(replica_check_of(replica_check)?);
        opts.caller_failed.clone_from(&caller_failed);
        for (k, v) in layout.unwrap_or_default() {
            opts = opts.layout_entry(k, v);
        }
        let mut state = SaveState::new();
        for t in &tensors {
            let t = t.get();
            // SAFETY: each buffer was checked against its piece's size when the piece was
            // made, and the caller (dckpt.torch) keeps every source tensor referenced and
            // unmodified until this call returns; nothing below keeps the slices past it
            // (save_async copies them).
            let data = unsafe { t.slice() };
            state.push_tensor(t.to_save(), data);
        }
        for o in &objects {
            let o = o.get();
            state.objects.push(ObjectData { object: o.to_save(), data: o.bytes(py)?, compare: o.compare() });
        }
        let local = local.map(|d| tiers::local_save_options(&d, caller_failed)).transpose()?;
        if location.is_none() && local.is_none() {
            return Err(errors::request_error("save: neither a location nor a local tier"));
        }
        let persistent = location.map(|l| (Location::from(l), opts));
        let local = local.map(|(dir, o)| (Location::from(dir), o));
        if async_save {
            let handle = logs::detached(py, || ckpt.save_tiers_async(&state, local, persistent));
            let handle = handle.map_err(|e| engine_error(py, &e))?;
            let h = PySaveHandle { handle: Mutex::new(Some(handle)), outcome: Mutex::new(None) };
            Ok(Py::new(py, h)?.into_any())
        } else {
            let saved = logs::detached(py, || ckpt.save_tiers(&state, local, persistent));
            let saved = saved.map_err(|e| engine_error(py, &e))?;
            Ok(tiers::tiered_outcome(py, &saved)?.into_any().unbind())
        }
    }

    /// Fills the buffers of `tensors` (`TensorPiece`s) from the checkpoint at `location`,
    /// and fetches `objects` (`ObjectPiece`s, their data unused). `missing`/`unexpected`:
    /// "raise", "return", "log" or "ignore". Buffers may share bytes (tied weights, views
    /// into one flat buffer): where they overlap, the piece listed last wins. Returns
    /// `(outcome, [bytes | None per object])`.
    ///
    /// `local`, `{"min_step", "below", "run"}`: restores instead the newest whole node-local
    /// step under `location` (this rank's node directory) at least `min_step` new and older
    /// than `below` (either `None`: no bound), saved for `run`, from this rank's
    /// own copy or a peer's; the outcome is then `{"step", "own", "peer", "failed",
    /// "reasons", "bytes_read", "bytes_received"}` (the requests of ranks in `failed`
    /// hold no defined bytes: load those from the persistent tier).
    ///
    /// `caller_failed`: as for `save`, the caller's error where it could not make this
    /// rank's pieces; the load fails on every rank before anything is read.
    ///
    /// `check_objects`: called with the objects' bytes (`[bytes | None per object]`) once
    /// this rank's reads are done, before the ranks agree on the outcome; where it returns
    /// the caller's error as `"Class: message"` (decoding an object failed here), the load
    /// fails on every rank, naming this rank and that error. `None` where it succeeded.
    #[pyo3(signature = (location, tensors, objects, *, missing="raise", unexpected="raise", local=None, caller_failed=None, check_objects=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature's keyword arguments
    fn load<'py>(
        &self,
        py: Python<'py>,
        location: String,
        tensors: Vec<Bound<'py, PyAny>>,
        objects: Vec<Bound<'py, PyAny>>,
        missing: &str,
        unexpected: &str,
        local: Option<Bound<'py, PyDict>>,
        caller_failed: Option<String>,
        check_objects: Option<Py<PyAny>>,
    ) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyList>)> {
        let ckpt = self.get()?;
        let tensors = pieces::<TensorPiece>(&tensors, "TensorPiece")?;
        let objects = pieces::<ObjectPiece>(&objects, "ObjectPiece")?;
        let targets: Vec<&TensorPiece> = tensors.iter().map(|t| t.get()).collect();
        // The missing keys whatever the caller asked (see `finish_load`).
        let asked = key_policy(missing)?;
        let opts = LoadOptions {
            strictness: Strictness {
                missing: if asked == KeyPolicy::Raise { asked } else { KeyPolicy::Return },
                unexpected: key_policy(unexpected)?,
            },
            caller_failed: caller_failed.clone(),
            ..LoadOptions::default()
        };
        // Buffers sharing bytes with an earlier one are filled through temporaries.
        let overlapping = piece::overlapping(&targets);
        let mut scratch: Vec<(&TensorPiece, Vec<u8>)> = (targets.iter().zip(&overlapping))
            .filter(|&(_, &o)| o)
            .map(|(t, _)| (*t, vec![0u8; t.byte_len()]))
            .collect();
        // The bytes the object check was given, returned as they are rather than made again.
        let checked: Arc<Mutex<Option<Py<PyList>>>> = Arc::default();
        let (mut outcome, fetched) = {
            let mut spare = scratch.iter_mut();
            let mut req = LoadRequest::new();
            for (t, &o) in targets.iter().zip(&overlapping) {
                let data: &mut [u8] = if o {
                    &mut spare.next().expect("one temporary per overlapping buffer").1
                } else {
                    // SAFETY: checked against the piece's size; it overlaps no other buffer
                    // handed out here, and the caller keeps it alive and untouched until the
                    // return.
                    unsafe { t.slice_mut() }
                };
                req.tensors.push(t.to_request(data));
            }
            for o in &objects {
                req = req.object(o.get().to_load());
            }
            req.check_objects = check_objects.map(|c| piece::object_check(c, checked.clone()));
            let outcome = match &local {
                Some(l) => {
                    let lopts = tiers::local_restore_options(l, caller_failed)?;
                    let r = logs::detached(py, || ckpt.restore_local(location.as_str(), &mut req, &lopts));
                    tiers::Loaded::Local(r.map_err(|e| engine_error(py, &e))?)
                }
                None => {
                    let r = logs::detached(py, || ckpt.load(location.as_str(), &mut req, &opts));
                    tiers::Loaded::Persistent(r.map_err(|e| engine_error(py, &e))?)
                }
            };
            (outcome, std::mem::take(&mut req.objects))
        };
        finish_load(&mut outcome, &scratch, ckpt.rank(), asked);
        let given = checked.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let datas = match given {
            Some(list) => list.into_bound(py),
            None => outcome::fetched_list(py, &fetched)?,
        };
        match &outcome {
            tiers::Loaded::Persistent(o) => outcome::load_outcome(py, o, datas),
            tiers::Loaded::Local(o) => tiers::restore_outcome(py, o, datas),
        }
    }

    /// The checkpoint's index (see the module function `metadata`), read collectively.
    fn metadata<'py>(&self, py: Python<'py>, location: String) -> PyResult<Bound<'py, PyDict>> {
        let ckpt = self.get()?;
        let meta = logs::detached(py, || ckpt.metadata(location.as_str())).map_err(|e| engine_error(py, &e))?;
        outcome::metadata(py, &meta)
    }

    /// After resuming from `after` (`None`: from nothing): this rank's markers of `run`'s
    /// newer local steps under `dir` removed (an abandoned branch gc would otherwise keep);
    /// the steps unmarked.
    #[pyo3(signature = (dir, after, run))]
    fn unmark_local_newer(&self, py: Python<'_>, dir: String, after: Option<u64>, run: String) -> PyResult<Vec<u64>> {
        let c = self.get()?;
        logs::detached(py, || c.unmark_local_newer(dir.as_str(), after, &run)).map_err(|e| engine_error(py, &e))
    }

    /// This rank's files of `run`'s local steps under `dir` that retention does not keep (the
    /// newest `keep` complete ones and anything newer stay) removed; the steps removed. Not
    /// collective.
    #[pyo3(signature = (dir, ranks_per_node, copies, keep, run))]
    fn gc_local(
        &self,
        py: Python<'_>,
        dir: String,
        ranks_per_node: usize,
        copies: usize,
        keep: usize,
        run: String,
    ) -> PyResult<Vec<u64>> {
        let c = self.get()?;
        let placement = dckpt::local::Placement { ranks_per_node, copies };
        logs::detached(py, || c.gc_local(dir.as_str(), placement, keep, &run)).map_err(|e| engine_error(py, &e))
    }

    /// Waits for a background save (its outcome stays with its handle) and releases the
    /// engine; later calls fail. Safe to call twice.
    fn close(&self, py: Python<'_>) {
        let taken = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(c) = taken {
            if std::process::id() == self.pid {
                // Dropping may wait on a background save that needs the GIL.
                logs::detached(py, move || {
                    c.release_staging();
                    drop(c)
                });
            } else {
                std::mem::forget(c);
            }
        }
    }
}

/// A save running in the background (`Checkpointer.save(..., async_save=True)`).
#[pyclass(module = "dckpt._dckpt", name = "SaveHandle", frozen)]
struct PySaveHandle {
    handle: Mutex<Option<SaveHandle>>,
    /// The outcome once waited for, so that `wait()` may be called again.
    outcome: Mutex<Option<PyResult<TieredOutcome>>>,
}

#[pymethods]
impl PySaveHandle {
    /// Whether the save has committed or failed (then `wait()` returns at once).
    fn done(&self) -> bool {
        match &*self.handle.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(h) => h.is_done(),
            None => true,
        }
    }

    /// Blocks (GIL released) until the save has committed, and returns its outcome; raises
    /// the save's error, the same on every rank. Later calls return or raise the same.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let taken = self.handle.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = taken {
            let r = logs::detached(py, move || h.wait_tiers()).map_err(|e| engine_error(py, &e));
            *self.outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        }
        match &*self.outcome.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(Ok(o)) => tiers::tiered_outcome(py, o),
            Some(Err(e)) => Err(e.clone_ref(py)),
            None => Err(errors::DckptError::new_err("another thread is waiting for this save")),
        }
    }
}

fn replica_check_of(s: &str) -> PyResult<ReplicaCheck> {
    Ok(match s {
        "sample" => ReplicaCheck::default(),
        "all" => ReplicaCheck::All,
        "off" => ReplicaCheck::Off,
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "replica_check={other:?}: expected \"sample\", \"all\" or \"off\""
            )));
        }
    })
}

fn key_policy(s: &str) -> PyResult<KeyPolicy> {
    Ok(match s {
        "raise" => KeyPolicy::Raise,
        "return" => KeyPolicy::Return,
        "log" => KeyPolicy::Log,
        "ignore" => KeyPolicy::Ignore,
        other => return Err(request_error(format!("key policy {other:?}: expected raise, return, log or ignore"))),
    })
}

/// The index of the checkpoint at `location`, read by this process alone (a world of one):
/// `{"save_id", "layout", "tensors": {key: {"dtype", "shape", "chunks": [(offset, shape)],
/// "flat_chunks": [(offset, shape, start, stop)]}}, "objects": {key: {"grid_shape",
/// "entries": [grid_offset]}}}`. `chunks` are the stored boxes; `flat_chunks` the stored
/// pieces that are a row-major range `start..stop` of the box of `shape` at `offset` (ZeRO-1
/// buffers): a reader that can only place boxes must refuse a tensor that has any.
#[pyfunction]
fn metadata<'py>(py: Python<'py>, location: String) -> PyResult<Bound<'py, PyDict>> {
    let ckpt = PyCheckpointer::new(py, None, false)?;
    let c = ckpt.get()?;
    let meta = logs::detached(py, || c.metadata(location.as_str())).map_err(|e| engine_error(py, &e))?;
    outcome::metadata(py, &meta)
}

/// The dtype names this module accepts, canonical first (`bf16`, `f32`, ...).
#[pyfunction]
fn dtype_names() -> Vec<&'static str> {
    dckpt::DType::ALL.iter().map(|d| d.name()).collect()
}

/// After a load: the temporaries of the targets it filled copied into them (a temporary of
/// a key not stored, or of a restore that read nothing for this rank, would overwrite its
/// target, or the target it shares bytes with, loaded in place, with zeros), and the
/// missing keys reported, or logged, only as the caller `asked`.
fn finish_load(outcome: &mut tiers::Loaded, scratch: &[(&TensorPiece, Vec<u8>)], rank: usize, asked: KeyPolicy) {
    let filled = outcome.filled(rank);
    for (t, bytes) in scratch.iter().filter(|(t, _)| filled(t.tensor_key())) {
        // SAFETY: the target was checked against its piece's size and is kept alive by the
        // caller; the request that held slices of the other targets is gone, so nothing else
        // refers to these bytes now.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), t.address() as *mut u8, bytes.len()) };
    }
    drop(filled);
    if let tiers::Loaded::Persistent(o) = outcome {
        if asked == KeyPolicy::Log && rank == 0 && !o.missing.is_empty() {
            log::warn!("load: {} requested keys are not stored: {}", o.missing.len(), o.missing.join(", "));
        }
        if asked != KeyPolicy::Return {
            o.missing.clear();
        }
    }
}

#[pymodule]
fn _dckpt(m: &Bound<'_, PyModule>) -> PyResult<()> {
    logs::install();
    m.add_class::<PyCheckpointer>()?;
    m.add_class::<PySaveHandle>()?;
    m.add_class::<TensorPiece>()?;
    m.add_class::<ObjectPiece>()?;
    m.add_function(wrap_pyfunction!(piece::tensor_piece, m)?)?;
    m.add_function(wrap_pyfunction!(piece::object_piece, m)?)?;
    m.add_function(wrap_pyfunction!(metadata, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_names, m)?)?;
    m.add_class::<manager::PyRunRoot>()?;
    errors::register(m)?;
    Ok(())
}
