//! The pieces Python hands over: [`TensorPiece`] and [`ObjectPiece`], frozen classes made
//! (and checked) once per leaf by [`tensor_piece`] and [`object_piece`], and read by save
//! and load alike. Functions rather than constructors: a fast call costs a leaf less than
//! a type's call does, and a state of 20,000 small tensors makes 20,000 of them.
//!
//! A tensor piece's buffer is an address and a length that Python read from a tensor it
//! keeps alive. Nothing here can check that the address is valid; what it checks, when the
//! piece is made, is that the length is exactly what the piece's dtype and region need and
//! that the address is not null for a non-empty buffer. For loads, [`overlapping`] tells
//! which buffers share bytes with an earlier one: those are filled through temporaries (two
//! `&mut` slices over the same bytes would be undefined behaviour).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use dckpt::{DType, Dims, ObjectCompare, ReplicaId, ShardedObject, ShardedTensor, TensorRequest};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::errors::request_error;

/// The replica id given to every piece that is not main. The engine counts only main
/// replicas towards coverage; which copy a non-main piece is does not matter to it.
const NOT_MAIN: ReplicaId = ReplicaId::new(0, 0, 1);

/// A piece of a global tensor and where its bytes are: the box of `shape` at `offset` of a
/// tensor of `global_shape` (narrowed, with `flat_range=(start, stop)`, to that row-major
/// range of the box), in `nbytes` bytes at address `ptr`. `main`: on save, whether this
/// copy counts towards coverage (exactly one holder of each region is main); `allow_shape_mismatch`:
/// on load, whether a stored tensor of another global shape may fill the region it shares
/// with it; `allow_dtype_cast`: on load, whether a stored tensor of another floating dtype
/// may fill it, cast as `tensor.to(dtype)` casts. Each flag means one thing, and the call it does not concern ignores it. Made
/// by [`tensor_piece`].
#[pyclass(module = "dckpt._dckpt", name = "TensorPiece", frozen)]
pub(crate) struct TensorPiece {
    /// With the main replica id: `main` applies on save only.
    tensor: ShardedTensor,
    dtype: &'static str,
    main: bool,
    allow_shape_mismatch: bool,
    allow_dtype_cast: bool,
    ptr: usize,
    nbytes: usize,
}

/// An object at `grid_offset` of a grid of `grid_shape` objects under `key` (both empty
/// for a single object). `data`: its bytes, to save; `None` in a load's request. `main`:
/// as a tensor piece's, on save. Made by [`object_piece`].
#[pyclass(module = "dckpt._dckpt", name = "ObjectPiece", frozen)]
pub(crate) struct ObjectPiece {
    /// With the main replica id: `main` applies on save only.
    object: ShardedObject,
    main: bool,
    /// Immutable, so its bytes may be read with the GIL released while the piece is held.
    data: Option<Py<PyBytes>>,
    /// How the replica check compares its copies on other ranks.
    compare: ObjectCompare,
}

/// The one way a tensor leaf is described to the native module: the piece of `key` of
/// `dtype` (any name dckpt accepts) whose buffer is `nbytes` bytes at address `ptr`, checked
/// against its region now, so that a save or load given it only reads it.
#[pyfunction]
#[pyo3(signature = (key, dtype, global_shape, offset, shape, ptr, nbytes, *, flat_range=None, main=true, allow_shape_mismatch=false, allow_dtype_cast=false))]
#[allow(clippy::too_many_arguments)] // the Python signature's arguments
pub(crate) fn tensor_piece(
    key: &str,
    dtype: &str,
    global_shape: &Bound<'_, PyAny>,
    offset: &Bound<'_, PyAny>,
    shape: &Bound<'_, PyAny>,
    ptr: usize,
    nbytes: usize,
    flat_range: Option<(u64, u64)>,
    main: bool,
    allow_shape_mismatch: bool,
    allow_dtype_cast: bool,
) -> PyResult<TensorPiece> {
    let dims = |what: &str, obj| {
        dims(obj).map_err(|e| request_error(format!("tensor {key:?}: {what} {obj}: {}", e.value(obj.py()))))
    };
    let (global_shape, offset, shape) =
        (dims("global shape", global_shape)?, dims("offset", offset)?, dims("shape", shape)?);
    let dt = DType::from_name(dtype).map_err(|e| request_error(format!("tensor {key:?}: {e}")))?;
    if offset.len() != shape.len() || shape.len() != global_shape.len() {
        return Err(request_error(format!(
            "tensor {key:?}: global shape {global_shape:?}, offset {offset:?} and shape {shape:?} have different lengths"
        )));
    }
    check_buffer(key, dt, &shape, flat_range, ptr, nbytes)?;
    let mut tensor = ShardedTensor::chunk(key, dt, Dims::from(&global_shape[..]), &offset[..], &shape[..]);
    if let Some((start, stop)) = flat_range {
        tensor = tensor.narrowed(start, stop);
    }
    Ok(TensorPiece { tensor, dtype: dt.name(), main, allow_shape_mismatch, allow_dtype_cast, ptr, nbytes })
}

#[pymethods]
impl TensorPiece {
    #[getter]
    fn key(&self) -> &str {
        self.tensor.key.as_str()
    }

    /// dckpt's canonical name of the dtype (`bf16`, `f32`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype
    }

    #[getter]
    fn global_shape(&self) -> Vec<u64> {
        self.tensor.global_shape.as_slice().to_vec()
    }

    #[getter]
    fn offset(&self) -> Vec<u64> {
        self.tensor.region.offset.as_slice().to_vec()
    }

    #[getter]
    fn shape(&self) -> Vec<u64> {
        self.tensor.region.shape.as_slice().to_vec()
    }

    #[getter]
    fn flat_range(&self) -> Option<(u64, u64)> {
        self.tensor.region.flat.map(|f| (f.start, f.stop))
    }

    #[getter]
    fn main(&self) -> bool {
        self.main
    }

    #[getter]
    fn allow_shape_mismatch(&self) -> bool {
        self.allow_shape_mismatch
    }

    #[getter]
    fn allow_dtype_cast(&self) -> bool {
        self.allow_dtype_cast
    }

    #[getter]
    fn ptr(&self) -> usize {
        self.ptr
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    fn __repr__(&self) -> String {
        let r = &self.tensor.region;
        format!(
            "TensorPiece({:?}, {:?}, {:?}, {:?}, {:?}, {:#x}, {}, flat_range={:?}, main={}, allow_shape_mismatch={}, allow_dtype_cast={})",
            self.key(),
            self.dtype,
            self.tensor.global_shape.as_slice(),
            r.offset.as_slice(),
            r.shape.as_slice(),
            self.ptr,
            self.nbytes,
            self.flat_range(),
            py_bool(self.main),
            py_bool(self.allow_shape_mismatch),
            py_bool(self.allow_dtype_cast),
        )
    }
}

/// The one way an object leaf is described to the native module: the object at
/// `grid_offset` of a grid of `grid_shape` under `key` (both empty for a single object),
/// with `data`, its bytes, to save. The replica check compares its copies on other ranks by
/// their bytes; by `digest` instead (a CRC-32 of a canonical form of the value) where one is
/// given; not at all where `compare` is false (a pickle of classes, which has no canonical form).
#[pyfunction]
#[pyo3(
    signature = (key, grid_shape=Vec::new(), grid_offset=Vec::new(), *, main=true, data=None, compare=true, digest=None),
    text_signature = "(key, grid_shape=(), grid_offset=(), *, main=True, data=None, compare=True, digest=None)"
)]
#[allow(clippy::too_many_arguments)] // the Python signature's arguments
pub(crate) fn object_piece(
    key: &str,
    grid_shape: Vec<u64>,
    grid_offset: Vec<u64>,
    main: bool,
    data: Option<Bound<'_, PyAny>>,
    compare: bool,
    digest: Option<u32>,
) -> PyResult<ObjectPiece> {
    if grid_shape.len() != grid_offset.len() {
        return Err(request_error(format!(
            "object {key:?}: grid shape {grid_shape:?} and grid offset {grid_offset:?} have different lengths"
        )));
    }
    let object = if grid_shape.is_empty() {
        ShardedObject::single(key)
    } else {
        ShardedObject::in_grid(key, grid_shape, grid_offset)
    };
    let data = match data {
        None => None,
        Some(d) => Some(d.cast_into::<PyBytes>().map_err(|e| {
            request_error(format!("object {key:?}: its data must be bytes, not {}", type_name(e.into_inner().as_any())))
        })?),
    };
    let compare = match (compare, digest) {
        (false, _) => ObjectCompare::Not,
        (true, Some(d)) => ObjectCompare::Digest(d),
        (true, None) => ObjectCompare::Bytes,
    };
    Ok(ObjectPiece { object, main, data: data.map(Bound::unbind), compare })
}

#[pymethods]
impl ObjectPiece {
    #[getter]
    fn key(&self) -> &str {
        self.object.key.as_str()
    }

    #[getter]
    fn grid_shape(&self) -> Vec<u64> {
        self.object.grid_shape.clone()
    }

    #[getter]
    fn grid_offset(&self) -> Vec<u64> {
        self.object.grid_offset.clone()
    }

    #[getter]
    fn main(&self) -> bool {
        self.main
    }

    #[getter]
    fn data(&self, py: Python<'_>) -> Option<Py<PyBytes>> {
        self.data.as_ref().map(|d| d.clone_ref(py))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let data = match &self.data {
            None => "None".to_string(),
            Some(d) => format!("<{} bytes>", d.bind(py).as_bytes().len()),
        };
        format!(
            "ObjectPiece({:?}, {:?}, {:?}, main={}, data={data})",
            self.key(),
            self.object.grid_shape,
            self.object.grid_offset,
            py_bool(self.main)
        )
    }
}

impl TensorPiece {
    /// The piece to save: main, or a replica.
    pub fn to_save(&self) -> ShardedTensor {
        let t = self.tensor.clone();
        if self.main { t } else { t.replica(NOT_MAIN) }
    }

    /// The piece to load (which copy it is does not matter there).
    pub fn to_load(&self) -> ShardedTensor {
        self.tensor.clone()
    }

    /// Its tensor's key.
    pub fn tensor_key(&self) -> &str {
        self.tensor.key.as_str()
    }

    /// The piece to load into `data`, with what its load allows.
    pub fn to_request<'a>(&self, data: &'a mut [u8]) -> TensorRequest<'a> {
        TensorRequest {
            tensor: self.to_load(),
            data,
            allow_shape_mismatch: self.allow_shape_mismatch,
            allow_dtype_cast: self.allow_dtype_cast,
        }
    }

    /// The address of the piece's buffer.
    pub fn address(&self) -> usize {
        self.ptr
    }

    /// The length of the piece's buffer in bytes.
    pub fn byte_len(&self) -> usize {
        self.nbytes
    }

    /// The piece's bytes.
    ///
    /// # Safety
    /// `ptr..ptr + nbytes` must be readable and unchanged for the slice's lifetime.
    pub unsafe fn slice<'a>(&self) -> &'a [u8] {
        if self.nbytes == 0 {
            return &[];
        }
        // SAFETY: non-null and non-wrapping (checked when made); readability and lifetime
        // are the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.nbytes) }
    }

    /// The piece's buffer, to be filled.
    ///
    /// # Safety
    /// `ptr..ptr + nbytes` must be writable, used by nothing else for the slice's lifetime,
    /// and disjoint from every other buffer handed out ([`overlapping`]).
    pub unsafe fn slice_mut<'a>(&self) -> &'a mut [u8] {
        if self.nbytes == 0 {
            return &mut [];
        }
        // SAFETY: as for `slice`, plus exclusivity, which `overlapping` and the caller's
        // promise give.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.nbytes) }
    }
}

impl ObjectPiece {
    /// The object to save: main, or a replica.
    pub fn to_save(&self) -> ShardedObject {
        let o = self.object.clone();
        if self.main { o } else { o.replica(NOT_MAIN) }
    }

    /// The object to load.
    pub fn to_load(&self) -> ShardedObject {
        self.object.clone()
    }

    /// How its copies are compared.
    pub fn compare(&self) -> ObjectCompare {
        self.compare
    }

    /// Its bytes, to save; a piece made without data is refused, naming its key.
    pub fn bytes<'a>(&'a self, py: Python<'_>) -> PyResult<&'a [u8]> {
        match &self.data {
            Some(d) => Ok(d.as_bytes(py)),
            None => Err(request_error(format!("object {:?}: no data to save", self.key()))),
        }
    }
}

/// A sequence of dimensions. Tuples (a `torch.Size` is one) are read by index: the
/// generic sequence path goes through an iterator, a cost every leaf pays three times.
fn dims(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    match obj.cast::<PyTuple>() {
        Ok(t) => t.iter().map(|d| d.extract::<u64>()).collect(),
        Err(_) => obj.extract(),
    }
}

/// Checks that the buffer is exactly the piece's size, and not null or wrapping.
fn check_buffer(
    key: &str,
    dt: DType,
    shape: &[u64],
    flat: Option<(u64, u64)>,
    ptr: usize,
    nbytes: usize,
) -> PyResult<()> {
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
    Ok(())
}

/// The pieces of a list, each a `TensorPiece` or `ObjectPiece` (`what` names the class).
pub(crate) fn pieces<'a, 'py, T: pyo3::PyClass>(
    list: &'a [Bound<'py, PyAny>],
    what: &str,
) -> PyResult<Vec<&'a Bound<'py, T>>> {
    list.iter()
        .map(|obj| {
            obj.cast::<T>()
                .map_err(|_| request_error(format!("expected a dckpt._dckpt.{what}, got a {}", type_name(obj))))
        })
        .collect()
}

/// Which load buffers share bytes with one listed before them (tied weights, views into
/// one flat buffer). Those are read into temporaries and copied in after the load, in list
/// order, so no two slices handed to the engine alias and where targets overlap the one
/// listed last wins.
pub(crate) fn overlapping(tensors: &[&TensorPiece]) -> Vec<bool> {
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

fn py_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// The engine's object check made of the caller's `check_objects` (see `Checkpointer.load`):
/// called with the GIL taken again, it gets the objects' bytes (the list kept in `given`,
/// for the load to return) and returns its error as `"Class: message"`, or `None`. Where it
/// raises instead, that exception's class and message are its error.
pub(crate) fn object_check(check: Py<PyAny>, given: Arc<Mutex<Option<Py<PyList>>>>) -> dckpt::ObjectCheck {
    dckpt::ObjectCheck(Box::new(move |objects: &[dckpt::ObjectRequest]| {
        Python::attach(|py| {
            let datas = objects.iter().map(|o| o.data.as_deref().map(|d| PyBytes::new(py, d)));
            let said = PyList::new(py, datas).and_then(|list| {
                let said = check.call1(py, (&list,));
                *given.lock().unwrap_or_else(PoisonError::into_inner) = Some(list.unbind());
                said.and_then(|r| r.extract::<Option<String>>(py))
            });
            match said {
                Ok(None) => Ok(()),
                Ok(Some(why)) => Err(why),
                Err(e) => {
                    let class = e.get_type(py).name().map_or_else(|_| "Exception".to_string(), |n| n.to_string());
                    Err(format!("{class}: {}", e.value(py)))
                }
            }
        })
    }))
}
