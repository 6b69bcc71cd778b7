//! One Python exception class per kind of engine failure, so callers catch what they can
//! handle (`except dckpt.AlreadyExists`) without reading messages. The message is the
//! engine's own (it names the key, rank and file); `rank` is the rank that saw the failure
//! (`None` where none did), and the key errors carry `keys`.
//!
//! The classes of the engine's [`ErrorKind`](dckpt::ErrorKind)s:
//!
//! | kind | class |
//! |---|---|
//! | `InvalidState`, `ReplicasDiffer`, `ObjectsDiffer` | `CoverageError` |
//! | `AlreadyExists` | `AlreadyExists` |
//! | `NotACheckpoint` | `NotACheckpoint` |
//! | `Format` | `FormatError` |
//! | `CommitUncertain` | `CommitUncertain` |
//! | `Checksum` | `ChecksumError` |
//! | `InvalidOptions`, `Request` | `RequestError` |
//! | `MissingKeys`, `UnexpectedKeys` | `MissingKeys`, `UnexpectedKeys` (with `keys`) |
//! | `Storage` | `StorageError` |
//! | `Collective`, `Protocol` | `CollectiveError` |
//! | `CallerFailed` | the class the failing rank's caller raised, where it is one of dckpt's or `TypeError`, `ValueError`, `KeyError`, `IndexError`, `RuntimeError`; else `DckptError` |
//! | `Internal`, `Usage`, `Other`, and any kind added later | `DckptError` |

use pyo3::exceptions::PyException;
use pyo3::prelude::*;

pyo3::create_exception!(
    dckpt,
    DckptError,
    PyException,
    "Base class of dckpt's errors; `rank` is the rank that saw the failure, or None."
);
pyo3::create_exception!(dckpt, AlreadyExists, DckptError, "A checkpoint is already committed at the location.");
pyo3::create_exception!(
    dckpt,
    CoverageError,
    DckptError,
    "The sharded state is invalid: a gap or overlap in a tensor's coverage, pieces that disagree, replicas that differ."
);
pyo3::create_exception!(dckpt, ChecksumError, DckptError, "Stored bytes do not match their checksum.");
pyo3::create_exception!(dckpt, NotACheckpoint, DckptError, "No committed checkpoint at the location.");
pyo3::create_exception!(dckpt, MissingKeys, DckptError, "Requested keys are not stored; `keys` lists them.");
pyo3::create_exception!(dckpt, UnexpectedKeys, DckptError, "Stored keys nobody requested; `keys` lists them.");
pyo3::create_exception!(
    dckpt,
    RequestError,
    DckptError,
    "A piece or buffer that cannot be served (wrong dtype, shape or buffer size), or invalid options."
);
pyo3::create_exception!(dckpt, StorageError, DckptError, "A storage operation failed.");
pyo3::create_exception!(dckpt, CollectiveError, DckptError, "The ranks could not talk (a dead or silent peer).");
pyo3::create_exception!(dckpt, FormatError, DckptError, "A malformed or damaged checkpoint file.");
pyo3::create_exception!(
    dckpt,
    CommitUncertain,
    DckptError,
    "Whether the save committed is unknown: the metadata write failed and could not be read back."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("DckptError", py.get_type::<DckptError>())?;
    m.add("AlreadyExists", py.get_type::<AlreadyExists>())?;
    m.add("CoverageError", py.get_type::<CoverageError>())?;
    m.add("ChecksumError", py.get_type::<ChecksumError>())?;
    m.add("NotACheckpoint", py.get_type::<NotACheckpoint>())?;
    m.add("MissingKeys", py.get_type::<MissingKeys>())?;
    m.add("UnexpectedKeys", py.get_type::<UnexpectedKeys>())?;
    m.add("RequestError", py.get_type::<RequestError>())?;
    m.add("StorageError", py.get_type::<StorageError>())?;
    m.add("CollectiveError", py.get_type::<CollectiveError>())?;
    m.add("FormatError", py.get_type::<FormatError>())?;
    m.add("CommitUncertain", py.get_type::<CommitUncertain>())?;
    // Defaults for errors raised before any rank was involved.
    py.get_type::<DckptError>().setattr("rank", py.None())?;
    py.get_type::<MissingKeys>().setattr("keys", Vec::<String>::new())?;
    py.get_type::<UnexpectedKeys>().setattr("keys", Vec::<String>::new())?;
    Ok(())
}

/// A bad piece or option from the Python side, before the engine ran.
pub(crate) fn request_error(msg: impl Into<String>) -> PyErr {
    RequestError::new_err(msg.into())
}

/// An exception of the class named `class` (one of dckpt's or a few builtins that callers
/// catch), or a `DckptError`.
fn caller_class(py: Python<'_>, class: &str, msg: String) -> PyErr {
    use pyo3::exceptions::{PyIndexError, PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
    match class {
        "TypeError" => PyTypeError::new_err(msg),
        "ValueError" => PyValueError::new_err(msg),
        "KeyError" => PyKeyError::new_err(msg),
        "IndexError" => PyIndexError::new_err(msg),
        "RuntimeError" => PyRuntimeError::new_err(msg),
        _ => {
            let module = py.import("dckpt._dckpt").ok();
            let cls = module
                .and_then(|m| m.getattr(class).ok())
                .and_then(|c| c.cast_into::<pyo3::types::PyType>().ok())
                .filter(|t| t.is_subclass_of::<DckptError>().unwrap_or(false));
            match cls {
                Some(t) => PyErr::from_type(t, msg),
                None => DckptError::new_err(msg),
            }
        }
    }
}

/// The engine's error as the Python exception of its kind, with `rank` (and `keys`) set.
pub(crate) fn engine_error(py: Python<'_>, e: &dckpt::Error) -> PyErr {
    use dckpt::ErrorKind as E;
    if let Some(interrupt) = crate::collective::take_interrupt() {
        return interrupt;
    }
    let msg = e.to_string();
    let mut keys: Option<&Vec<String>> = None;
    let err = match e.kind() {
        // Replicas whose bytes differ are a coverage failure seen in the bytes: the ranks
        // that call them copies hold different parts of the tensor.
        E::InvalidState { .. } | E::ReplicasDiffer { .. } | E::ObjectsDiffer { .. } => CoverageError::new_err(msg),
        E::AlreadyExists { .. } => AlreadyExists::new_err(msg),
        E::NotACheckpoint { .. } => NotACheckpoint::new_err(msg),
        E::Format { .. } => FormatError::new_err(msg),
        E::CommitUncertain { .. } => CommitUncertain::new_err(msg),
        E::Checksum { .. } => ChecksumError::new_err(msg),
        E::InvalidOptions { .. } | E::Request { .. } => RequestError::new_err(msg),
        E::MissingKeys { keys: k, .. } => {
            keys = Some(k);
            MissingKeys::new_err(msg)
        }
        E::UnexpectedKeys { keys: k, .. } => {
            keys = Some(k);
            UnexpectedKeys::new_err(msg)
        }
        E::Storage { .. } => StorageError::new_err(msg),
        // The ranks could not talk, or do not agree on what they say.
        E::Collective(_) | E::Protocol { .. } => CollectiveError::new_err(msg),
        // Every rank raises what the failing one did, as far as the class is a known one.
        E::CallerFailed { detail } => caller_class(py, detail.split_once(':').map_or("", |(c, _)| c), msg),
        // A bug or the host failing, the API used wrongly, a failure with no typed form:
        // none is one of the kinds above.
        _ => DckptError::new_err(msg),
    };
    let value = err.value(py);
    // Attributes on a fresh exception instance cannot fail short of memory exhaustion; an
    // exception without them is still the right exception.
    let _ = value.setattr("rank", e.rank());
    if let Some(k) = keys {
        let _ = value.setattr("keys", k.clone());
    }
    err
}
