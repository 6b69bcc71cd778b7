//! The run manager for `dckpt.torch.CheckpointManager`: the facade's [`RunRoot`] over the
//! process group's collective, its answers as Python values. Every rule (step names, which
//! step is latest, what retention and gc delete, in which order, what a step records) is
//! the facade's; the Python side saves and loads the state dict between `begin_step` and
//! `finish_step`.

use std::sync::Arc;

use dckpt::manager::{GcOptions, GcReport, Latest, StepInfo};
use dckpt::storage::ObjectInfo;
use dckpt::{Collective, RetentionPolicy, RunRoot};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::collective::PyCollective;
use crate::errors::engine_error;

/// A run root shared by the ranks of a collective (see `dckpt::manager::RunRoot`): rank 0
/// does the storage work, and every rank returns its answer or raises its error (with
/// `rank`). Every call blocks with the GIL released.
#[pyclass(module = "dckpt._dckpt", name = "RunRoot", frozen)]
pub(crate) struct PyRunRoot {
    run: RunRoot,
}

/// A retention policy from Python's arguments; `keep_every=0` is refused (no step is a
/// multiple of 0 but step 0: read literally, it kept none).
fn policy(keep_last: Option<u64>, keep_every: Option<u64>) -> PyResult<RetentionPolicy> {
    if keep_every == Some(0) {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "keep_every=0: expected a step interval of at least 1, or None",
        ));
    }
    Ok(RetentionPolicy { keep_last, keep_every })
}

fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> dckpt::Result<T> + Send) -> PyResult<T> {
    crate::logs::detached(py, f).map_err(|e| engine_error(py, &e))
}

#[pymethods]
impl PyRunRoot {
    /// The run root at `root` (a path or URL, opened on every rank) over `collective`:
    /// `None` for a world of one, else an object with the methods of
    /// `dckpt.torch.TorchCollective`.
    #[new]
    #[pyo3(signature = (root, collective=None))]
    fn new(py: Python<'_>, root: String, collective: Option<Py<PyAny>>) -> PyResult<PyRunRoot> {
        let collective: Arc<dyn Collective> = match collective {
            None => dckpt::local_collective(),
            Some(obj) => Arc::new(PyCollective::new(py, obj)?),
        };
        let run = run(py, || RunRoot::open(collective, root))?;
        Ok(PyRunRoot { run })
    }

    /// The run root's location, as its storage names it: what the local tier records its
    /// steps under, so that a run restores no other run's.
    #[getter]
    fn location(&self) -> String {
        self.run.name()
    }

    /// Refuses, on every rank, a step the ranks do not all give, or one a rank `refused`
    /// (it raises its own error; the others one naming it), or ranks whose `config` (a
    /// digest of the caller's tiers and intervals) differs (collective).
    #[pyo3(signature = (step, refused = false, config = 0))]
    fn same_step(&self, py: Python<'_>, step: u64, refused: bool, config: u64) -> PyResult<()> {
        run(py, || self.run.same_step(step, refused, config))
    }

    /// The directory name of `step` under a run root.
    #[staticmethod]
    fn step_dir(step: u64) -> String {
        dckpt::manager::step_dir(step)
    }

    /// Refuses a committed step (`dckpt.AlreadyExists`) and records the step's start:
    /// `{"step", "saved_at_unix", "layout"}`, `layout` being the entries its save records.
    fn begin_step<'py>(&self, py: Python<'py>, step: u64) -> PyResult<Bound<'py, PyDict>> {
        let start = run(py, || self.run.begin_step(step))?;
        let layout = PyDict::new(py);
        for (k, v) in start.layout() {
            layout.set_item(k, v)?;
        }
        let d = PyDict::new(py);
        d.set_item("step", start.step)?;
        d.set_item("saved_at_unix", start.saved_at_unix)?;
        d.set_item("layout", layout)?;
        Ok(d)
    }

    /// After `step` committed as `save_id`: the pointer, then retention; the steps deleted.
    #[pyo3(signature = (step, save_id, keep_last=None, keep_every=None))]
    fn finish_step(
        &self,
        py: Python<'_>,
        step: u64,
        save_id: String,
        keep_last: Option<u64>,
        keep_every: Option<u64>,
    ) -> PyResult<Vec<u64>> {
        let policy = policy(keep_last, keep_every)?;
        run(py, || self.run.finish_step(step, &save_id, policy))
    }

    /// The latest committed step: `{"step", "directory", "save_id", "from_pointer",
    /// "skipped": [{"step", "reason"}]}` (`step` None where no step is committed).
    fn latest<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let latest = run(py, || self.run.latest())?;
        latest_dict(py, &latest)
    }

    /// Whether `step` is committed under the run root.
    fn committed(&self, py: Python<'_>, step: u64) -> PyResult<bool> {
        run(py, || self.run.committed(step))
    }

    /// Every step directory: `{"step", "directory", "committed", "bytes", "objects",
    /// "save_id", "saved_at_unix", "layout", "problem"}` each, ascending.
    fn steps<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let steps = run(py, || self.run.steps())?;
        let out = PyList::empty(py);
        for s in &steps {
            out.append(step_dict(py, s)?)?;
        }
        Ok(out)
    }

    /// Garbage collection with the retention policy given; the report: `{"dry_run",
    /// "steps": [{"step", "directory", "reason", "bytes", "objects"}], "data_files",
    /// "unfinished_writes": [{"path", "size"}], "bytes"}`.
    #[pyo3(signature = (keep_last=None, keep_every=None, protected=Vec::new(), dry_run=false))]
    fn gc<'py>(
        &self,
        py: Python<'py>,
        keep_last: Option<u64>,
        keep_every: Option<u64>,
        protected: Vec<u64>,
        dry_run: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let opts = GcOptions { policy: policy(keep_last, keep_every)?, protected, dry_run };
        let report = run(py, || self.run.gc(&opts))?;
        gc_dict(py, &report)
    }
}

fn latest_dict<'py>(py: Python<'py>, l: &Latest) -> PyResult<Bound<'py, PyDict>> {
    let skipped = PyList::empty(py);
    for s in &l.skipped {
        let d = PyDict::new(py);
        d.set_item("step", s.step)?;
        d.set_item("reason", &s.reason)?;
        d.set_item("unreadable", s.unreadable)?;
        skipped.append(d)?;
    }
    let d = PyDict::new(py);
    d.set_item("step", l.step)?;
    d.set_item("directory", &l.directory)?;
    d.set_item("save_id", &l.save_id)?;
    d.set_item("from_pointer", l.from_pointer)?;
    d.set_item("skipped", skipped)?;
    Ok(d)
}

fn step_dict<'py>(py: Python<'py>, s: &StepInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", s.step)?;
    d.set_item("directory", &s.directory)?;
    d.set_item("committed", s.committed())?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("objects", s.objects)?;
    d.set_item("save_id", &s.save_id)?;
    d.set_item("saved_at_unix", s.saved_at_unix)?;
    d.set_item("layout", &s.layout)?;
    d.set_item("problem", s.state.problem())?;
    Ok(d)
}

fn objects_list<'py>(py: Python<'py>, objects: &[ObjectInfo]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for o in objects {
        let d = PyDict::new(py);
        d.set_item("path", &o.path)?;
        d.set_item("size", o.size)?;
        out.append(d)?;
    }
    Ok(out)
}

fn gc_dict<'py>(py: Python<'py>, r: &GcReport) -> PyResult<Bound<'py, PyDict>> {
    let steps = PyList::empty(py);
    for s in &r.steps {
        let d = PyDict::new(py);
        d.set_item("step", s.step)?;
        d.set_item("directory", &s.directory)?;
        d.set_item("reason", s.reason.as_str())?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("objects", s.objects)?;
        steps.append(d)?;
    }
    let d = PyDict::new(py);
    d.set_item("dry_run", r.dry_run)?;
    d.set_item("steps", steps)?;
    d.set_item("data_files", objects_list(py, &r.data_files)?)?;
    d.set_item("unfinished_writes", objects_list(py, &r.unfinished_writes)?)?;
    d.set_item("bytes", r.bytes)?;
    Ok(d)
}
