//! What the native module returns to Python, built in one place: a save's outcome, a
//! load's outcome and the objects it fetched, and a checkpoint's index. Plain dicts and
//! lists, so the Python API hands them on as they are.

use dckpt::format::Metadata;
use dckpt::{LoadOutcome, ObjectRequest, Phases, SaveOutcome};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// `{"save_id", "bytes", "files", "chunks", "rank_bytes", "plan_reused", "phases"}`.
pub(crate) fn save_outcome<'py>(py: Python<'py>, o: &SaveOutcome) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("save_id", &o.save_id)?;
    d.set_item("bytes", o.bytes)?;
    d.set_item("files", o.files)?;
    d.set_item("chunks", o.chunks)?;
    d.set_item("rank_bytes", o.rank_bytes)?;
    d.set_item("plan_reused", o.plan_reused)?;
    d.set_item("phases", phases(py, &o.phases)?)?;
    Ok(d)
}

/// The bytes a load fetched for each requested object (`None` where it is not stored), in
/// the order requested.
pub(crate) fn fetched_list<'py>(py: Python<'py>, fetched: &[ObjectRequest]) -> PyResult<Bound<'py, PyList>> {
    let datas = PyList::empty(py);
    for f in fetched {
        match &f.data {
            Some(d) => datas.append(PyBytes::new(py, d))?,
            None => datas.append(py.None())?,
        }
    }
    Ok(datas)
}

/// `{phase: {"rank", "seconds"}}`: each phase's slowest rank and its time.
fn phases<'py>(py: Python<'py>, p: &dyn Phases) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, s) in p.each() {
        let one = PyDict::new(py);
        one.set_item("rank", s.rank)?;
        one.set_item("seconds", s.time.as_secs_f64())?;
        d.set_item(name, one)?;
    }
    Ok(d)
}

/// `({"missing", "unexpected", "bytes_read", "bytes_received", "metadata_bytes", "layout",
/// "save_id", "phases"}, [bytes | None per object])`, the
/// objects in the order they were requested.
pub(crate) fn load_outcome<'py>(
    py: Python<'py>,
    o: &LoadOutcome,
    datas: Bound<'py, PyList>,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyList>)> {
    let d = PyDict::new(py);
    d.set_item("missing", &o.missing)?;
    d.set_item("unexpected", &o.unexpected)?;
    d.set_item("bytes_read", o.bytes_read)?;
    d.set_item("bytes_received", o.bytes_received)?;
    d.set_item("metadata_bytes", o.metadata_bytes)?;
    d.set_item("layout", &o.layout)?;
    d.set_item("save_id", &o.save_id)?;
    d.set_item("phases", phases(py, &o.phases)?)?;
    Ok((d, datas))
}

/// `(offset, shape, start, stop)` of a stored chunk narrowed to a flat range of its box.
type FlatChunk = (Vec<u64>, Vec<u64>, u64, u64);

/// The index as plain Python values; what `dckpt.dcp` synthesises DCP metadata from:
/// `{"format_version", "save_id", "writer", "layout", "tensors": {key: {"dtype", "shape",
/// "chunks": [(offset, shape)], "flat_chunks": [(offset, shape, start, stop)]}}, "objects":
/// {key: {"grid_shape", "entries": [grid_offset]}}}`.
pub(crate) fn metadata<'py>(py: Python<'py>, m: &Metadata) -> PyResult<Bound<'py, PyDict>> {
    let tensors = PyDict::new(py);
    for t in &m.tensors {
        // Boxes as (offset, shape); chunks narrowed to a flat range of their box (ZeRO-1
        // buffers) apart, since (offset, shape) alone would misdescribe them.
        let mut chunks: Vec<(Vec<u64>, Vec<u64>)> = Vec::new();
        let mut flat_chunks: Vec<FlatChunk> = Vec::new();
        for c in &t.chunks {
            let (offset, shape) = (c.offset.as_slice().to_vec(), c.shape.as_slice().to_vec());
            match c.flat {
                None => chunks.push((offset, shape)),
                Some([start, stop]) => flat_chunks.push((offset, shape, start, stop)),
            }
        }
        let e = PyDict::new(py);
        e.set_item("dtype", t.dtype.name())?;
        e.set_item("shape", t.global_shape.as_slice().to_vec())?;
        e.set_item("chunks", chunks)?;
        e.set_item("flat_chunks", flat_chunks)?;
        tensors.set_item(&t.key, e)?;
    }
    let objects = PyDict::new(py);
    for o in &m.objects {
        let e = PyDict::new(py);
        e.set_item("grid_shape", o.grid_shape.clone())?;
        let entries: Vec<Vec<u64>> = o.entries.iter().map(|x| x.grid_offset.clone()).collect();
        e.set_item("entries", entries)?;
        objects.set_item(&o.key, e)?;
    }
    let d = PyDict::new(py);
    d.set_item("format_version", m.format_version)?;
    d.set_item("save_id", &m.save_id)?;
    d.set_item("writer", &m.writer)?;
    d.set_item("layout", &m.layout)?;
    d.set_item("tensors", tensors)?;
    d.set_item("objects", objects)?;
    Ok(d)
}
