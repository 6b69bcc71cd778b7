//! Descriptors from Python into the engine's types, and the engine's answers back.
//!
//! A descriptor's buffer is an address and a length that Python read from a tensor it
//! keeps alive. Nothing here can check that the address is valid; what it checks is that
//! the length is exactly what the piece's dtype and region need, that the address is not
//! null for a non-empty buffer, and, for loads, which buffers overlap an earlier one: those
//! are filled through temporaries (two `&mut` slices over the same bytes would be undefined
//! behaviour).

use std::collections::BTreeMap;

use dckpt::format::Metadata;
use dckpt::{DType, Dims, ReplicaId, SaveOutcome, ShardedObject, ShardedTensor};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::errors::request_error;

/// The replica id given to every piece that is not main. The engine counts only main
/// replicas towards coverage; which copy a non-main piece is does not matter to it.
const NOT_MAIN: ReplicaId = ReplicaId::new(0, 0, 1);

/// A tensor piece to save and where its bytes are.
pub(crate) struct SaveTensor {
    pub tensor: ShardedTensor,
    ptr: usize,
    nbytes: usize,
}

/// A tensor piece to load and where to put its bytes.
pub(crate) struct LoadTensor {
    pub tensor: ShardedTensor,
    pub allow_shape_mismatch: bool,
    ptr: usize,
    nbytes: usize,
}

/// An object to save, its bytes borrowed from a Python `bytes`.
pub(crate) struct SaveObject<'py> {
    pub object: ShardedObject,
    /// Immutable, so its bytes may be read with the GIL released while this is held.
    pub data: Bound<'py, PyBytes>,
}

type Parts = (String, String, Vec<u64>, Vec<u64>, Vec<u64>, Option<(u64, u64)>, bool, usize, usize);

/// The common part of both tensor descriptors: a piece, checked against its buffer length.
fn piece(parts: Parts) -> PyResult<(ShardedTensor, bool, usize, usize)> {
    let (key, dtype, global_shape, offset, shape, flat, flag, ptr, nbytes) = parts;
    let dt = DType::from_name(&dtype).map_err(|e| request_error(format!("tensor {key:?}: {e}")))?;
    if offset.len() != shape.len() || shape.len() != global_shape.len() {
        return Err(request_error(format!(
            "tensor {key:?}: global shape {global_shape:?}, offset {offset:?} and shape {shape:?} have different lengths"
        )));
    }
    let mut t = ShardedTensor::chunk(key.as_str(), dt, Dims::from(&global_shape[..]), &offset[..], &shape[..]);
    if let Some((start, stop)) = flat {
        t = t.narrowed(start, stop);
    }
    // The region's numel saturates; a region that does not fit is the engine's to report,
    // with the key and rank, but the buffer must match whatever it claims.
    let box_numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
    let numel = match (box_numel, flat) {
        (None, _) => None,
        (Some(n), None) => Some(n),
        (Some(n), Some((start, stop))) if start <= stop && stop <= n => Some(stop - start),
        (Some(n), Some((start, stop))) => {
            return Err(request_error(format!(
                "tensor {key:?}: flat range ({start}, {stop}) does not fit its box of {n} elements (shape {shape:?})"
            )));
        }
    };
    let want = numel.and_then(|n| n.checked_mul(dt.size()));
    if want != Some(nbytes as u64) {
        return Err(request_error(format!(
            "tensor {key:?}: its buffer has {nbytes} bytes but a region of shape {shape:?}{} of {dt} needs {}",
            flat.map(|(a, b)| format!(" narrowed to ({a}, {b})")).unwrap_or_default(),
            want.map(|w| w.to_string()).unwrap_or_else(|| "more than 2^64".into()),
        )));
    }
    if ptr == 0 && nbytes != 0 {
        return Err(request_error(format!("tensor {key:?}: null buffer address for {nbytes} bytes")));
    }
    if ptr.checked_add(nbytes).is_none() {
        return Err(request_error(format!("tensor {key:?}: buffer at {ptr:#x} of {nbytes} bytes wraps around")));
    }
    Ok((t, flag, ptr, nbytes))
}

impl SaveTensor {
    pub fn extract(obj: &Bound<'_, PyAny>) -> PyResult<SaveTensor> {
        let parts: Parts = obj.extract().map_err(|e| descriptor_error(obj, "save", e))?;
        let (t, is_main, ptr, nbytes) = piece(parts)?;
        let tensor = if is_main { t } else { t.replica(NOT_MAIN) };
        Ok(SaveTensor { tensor, ptr, nbytes })
    }

    /// The piece's bytes.
    ///
    /// # Safety
    /// `ptr..ptr + nbytes` must be readable and unchanged for the slice's lifetime.
    pub unsafe fn slice<'a>(&self) -> &'a [u8] {
        if self.nbytes == 0 {
            return &[];
        }
        // SAFETY: non-null and non-wrapping (checked in `piece`); readability and lifetime
        // are the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.nbytes) }
    }
}

impl LoadTensor {
    pub fn extract(obj: &Bound<'_, PyAny>) -> PyResult<LoadTensor> {
        let parts: Parts = obj.extract().map_err(|e| descriptor_error(obj, "load", e))?;
        let (tensor, allow_shape_mismatch, ptr, nbytes) = piece(parts)?;
        Ok(LoadTensor { tensor, allow_shape_mismatch, ptr, nbytes })
    }

    /// The address of the piece's buffer.
    pub fn target_address(&self) -> usize {
        self.ptr
    }

    /// The length of the piece's buffer in bytes.
    pub fn byte_len(&self) -> usize {
        self.nbytes
    }

    /// The piece's buffer, to be filled.
    ///
    /// # Safety
    /// `ptr..ptr + nbytes` must be writable, used by nothing else for the slice's lifetime,
    /// and disjoint from every other buffer handed out ([`check_disjoint`]).
    pub unsafe fn slice_mut<'a>(&self) -> &'a mut [u8] {
        if self.nbytes == 0 {
            return &mut [];
        }
        // SAFETY: as for `SaveTensor::slice`, plus exclusivity, which check_disjoint and
        // the caller's promise give.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.nbytes) }
    }
}

/// Which load buffers share bytes with one listed before them (tied weights, views into
/// one flat buffer). Those are read into temporaries and copied in after the load, in list
/// order, so no two slices handed to the engine alias and where targets overlap the one
/// listed last wins.
pub(crate) fn overlapping(tensors: &[LoadTensor]) -> Vec<bool> {
    // The bytes covered so far, as disjoint merged spans: start -> end.
    let mut covered: BTreeMap<usize, usize> = BTreeMap::new();
    tensors
        .iter()
        .map(|t| {
            if t.nbytes == 0 {
                return false;
            }
            let (mut start, mut end) = (t.ptr, t.ptr + t.nbytes);
            let mut hit = false;
            if let Some((&s, &e)) = covered.range(..=start).next_back()
                && e > start
            {
                hit = true;
                covered.remove(&s);
                (start, end) = (s, end.max(e));
            }
            while let Some((&s, &e)) = covered.range(start..end).next() {
                hit = true;
                covered.remove(&s);
                end = end.max(e);
            }
            covered.insert(start, end);
            hit
        })
        .collect()
}

impl<'py> SaveObject<'py> {
    pub fn extract(obj: &Bound<'py, PyAny>) -> PyResult<SaveObject<'py>> {
        let tuple = obj.cast::<PyTuple>().map_err(|_| object_descriptor_error(obj))?;
        if tuple.len() != 5 {
            return Err(object_descriptor_error(obj));
        }
        let key: String = tuple.get_item(0)?.extract()?;
        let (grid_shape, grid_offset, is_main): (Vec<u64>, Vec<u64>, bool) =
            (tuple.get_item(1)?.extract()?, tuple.get_item(2)?.extract()?, tuple.get_item(3)?.extract()?);
        let mut object = grid_object(key, grid_shape, grid_offset)?;
        if !is_main {
            object = object.replica(NOT_MAIN);
        }
        let item = tuple.get_item(4)?;
        let data = item.cast_into::<PyBytes>().map_err(|e| {
            request_error(format!(
                "object {:?}: its data must be bytes, not {}",
                object.key.as_str(),
                type_name(e.into_inner().as_any())
            ))
        })?;
        Ok(SaveObject { object, data })
    }
}

/// `(key, grid_shape, grid_offset)` of an object to load.
pub(crate) fn parse_object_key(obj: &Bound<'_, PyAny>) -> PyResult<ShardedObject> {
    let (key, grid_shape, grid_offset): (String, Vec<u64>, Vec<u64>) =
        obj.extract().map_err(|e| descriptor_error(obj, "object load", e))?;
    grid_object(key, grid_shape, grid_offset)
}

fn grid_object(key: String, grid_shape: Vec<u64>, grid_offset: Vec<u64>) -> PyResult<ShardedObject> {
    if grid_shape.len() != grid_offset.len() {
        return Err(request_error(format!(
            "object {key:?}: grid shape {grid_shape:?} and grid offset {grid_offset:?} have different lengths"
        )));
    }
    Ok(if grid_shape.is_empty() {
        ShardedObject::single(key.as_str())
    } else {
        ShardedObject::in_grid(key.as_str(), grid_shape, grid_offset)
    })
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

fn descriptor_error(obj: &Bound<'_, PyAny>, what: &str, e: PyErr) -> PyErr {
    request_error(format!(
        "malformed {what} descriptor {}: expected (key, dtype, global_shape, offset, shape, flat_range | None, \
         flag, ptr, nbytes): {e}",
        obj.repr().map(|r| r.to_string()).unwrap_or_default()
    ))
}

fn object_descriptor_error(obj: &Bound<'_, PyAny>) -> PyErr {
    request_error(format!(
        "malformed object descriptor of type {}: expected (key, grid_shape, grid_offset, is_main, data: bytes)",
        type_name(obj)
    ))
}

pub(crate) fn outcome_dict<'py>(py: Python<'py>, o: &SaveOutcome) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("save_id", &o.save_id)?;
    d.set_item("bytes", o.bytes)?;
    d.set_item("files", o.files)?;
    d.set_item("chunks", o.chunks)?;
    d.set_item("rank_bytes", o.rank_bytes)?;
    d.set_item("plan_reused", o.plan_reused)?;
    Ok(d)
}

/// `(offset, shape, start, stop)` of a stored chunk narrowed to a flat range of its box.
type FlatChunk = (Vec<u64>, Vec<u64>, u64, u64);

/// The index as plain Python values; what `dckpt.dcp` synthesises DCP metadata from.
pub(crate) fn metadata_dict<'py>(py: Python<'py>, m: &Metadata) -> PyResult<Bound<'py, PyDict>> {
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
