//! A [`Collective`] whose calls are methods of a Python object (`dckpt.torch.TorchCollective`,
//! which moves the bytes as uint8 tensors over a dedicated gloo group).
//!
//! Every call attaches to the interpreter for its duration: the engine calls it from the
//! thread that called into Rust (which released the GIL first) or from a background save's
//! thread. A Python exception, or an answer of the wrong shape, becomes a collective error,
//! and, as the trait's contract requires, poisons the instance: the ranks no longer agree
//! on where they are in the call sequence.

use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use dckpt::collective::{Bytes, Error, ReduceOp, Result};
use dckpt::{Collective, TcpCollective, TcpConfig, TcpOptions};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

pub(crate) struct PyCollective {
    obj: Py<PyAny>,
    rank: usize,
    world_size: usize,
    /// The first failure, after which every call fails.
    poisoned: Mutex<Option<String>>,
}

impl fmt::Debug for PyCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PyCollective").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

impl PyCollective {
    /// Reads `rank()` and `world_size()` once; they do not change.
    pub fn new(py: Python<'_>, obj: Py<PyAny>) -> PyResult<PyCollective> {
        let b = obj.bind(py);
        let rank: usize = b.call_method0("rank")?.extract()?;
        let world_size: usize = b.call_method0("world_size")?.extract()?;
        if world_size == 0 || rank >= world_size {
            return Err(crate::errors::request_error(format!(
                "collective reports rank {rank} of a world of {world_size}"
            )));
        }
        Ok(PyCollective { obj, rank, world_size, poisoned: Mutex::new(None) })
    }

    /// Runs one call under the GIL, with poisoning.
    fn call<T>(&self, op: &'static str, f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>) -> Result<T> {
        let mut poisoned = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cause) = &*poisoned {
            return Err(Error::Poisoned { cause: cause.clone() });
        }
        let r = Python::attach(|py| {
            f(self.obj.bind(py)).map_err(|e| {
                // Ctrl-C (or SystemExit) while torch.distributed waited: raised again by the
                // call that led here, not turned into an error an `except Exception` takes.
                if !e.is_instance_of::<pyo3::exceptions::PyException>(py) {
                    *INTERRUPTED.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone_ref(py));
                }
                describe(py, &e)
            })
        });
        r.map_err(|detail| {
            let msg = format!("rank {}: torch.distributed {op} failed: {detail}", self.rank);
            *poisoned = Some(msg.clone());
            Error::Io { context: msg, source: std::io::Error::other("the Python collective raised") }
        })
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.world_size {
            return Err(self.refuse(format!("root {root} in a world of {}", self.world_size)));
        }
        Ok(())
    }

    /// A call refused for its arguments: the instance is poisoned as by any other failure
    /// (the ranks no longer agree on where they are in the call sequence).
    fn refuse(&self, detail: String) -> Error {
        let mut poisoned = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
        poisoned.get_or_insert_with(|| format!("rank {}: {detail}", self.rank));
        Error::InvalidArgument { detail }
    }
}

/// A `BaseException` that is not an `Exception` (KeyboardInterrupt, SystemExit) that a
/// Python collective raised, for [`take_interrupt`].
static INTERRUPTED: Mutex<Option<PyErr>> = Mutex::new(None);

/// The interrupt a Python collective raised since the last call, if any: what the failed
/// engine call raises in its place.
pub(crate) fn take_interrupt() -> Option<PyErr> {
    INTERRUPTED.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// A Python exception as one line: its type and message.
fn describe(py: Python<'_>, e: &PyErr) -> String {
    let ty = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_else(|_| "Exception".into());
    format!("{ty}: {}", e.value(py))
}

fn bytes_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    Ok(obj.cast::<PyBytes>()?.as_bytes().to_vec())
}

fn list_of_bytes(obj: &Bound<'_, PyAny>, n: usize, op: &str) -> PyResult<Vec<Vec<u8>>> {
    let list = obj.cast::<PyList>()?;
    if list.len() != n {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("{op} returned {} messages for {n}", list.len())));
    }
    list.iter().map(|m| bytes_of(&m)).collect()
}

impl Collective for PyCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn barrier(&self) -> Result<()> {
        self.call("barrier", |o| o.call_method0("barrier").map(drop))
    }

    fn broadcast(&self, root: usize, data: Option<&[u8]>) -> Result<Vec<u8>> {
        self.check_root(root)?;
        if root == self.rank && data.is_none() {
            return Err(self.refuse(format!("broadcast root {root} passed no data")));
        }
        let data = if root == self.rank { data } else { None };
        self.call("broadcast", |o| {
            let py = o.py();
            let arg = data.map(|d| PyBytes::new(py, d));
            bytes_of(&o.call_method1("broadcast", (root, arg))?)
        })
    }

    fn gather(&self, root: usize, data: Vec<u8>) -> Result<Option<Vec<Vec<u8>>>> {
        self.check_root(root)?;
        let (rank, world) = (self.rank, self.world_size);
        self.call("gather", |o| {
            let r = o.call_method1("gather", (root, PyBytes::new(o.py(), &data)))?;
            if rank == root { list_of_bytes(&r, world, "gather").map(Some) } else { Ok(None) }
        })
    }

    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let world = self.world_size;
        self.call("all_gather", |o| {
            let r = o.call_method1("all_gather", (PyBytes::new(o.py(), &data),))?;
            list_of_bytes(&r, world, "all_gather")
        })
    }

    fn all_reduce_u64(&self, values: &[u64], op: ReduceOp) -> Result<Vec<u64>> {
        let name = match op {
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Sum => "sum",
        };
        let n = values.len();
        self.call("all_reduce", |o| {
            let r: Vec<u64> = o.call_method1("all_reduce_u64", (values.to_vec(), name))?.extract()?;
            if r.len() != n {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "all_reduce_u64 returned {} values for {n}",
                    r.len()
                )));
            }
            Ok(r)
        })
    }

    fn scatter(&self, root: usize, parts: Option<Vec<Vec<u8>>>) -> Result<Vec<u8>> {
        self.check_root(root)?;
        let parts = if root == self.rank {
            match parts {
                Some(p) if p.len() == self.world_size => Some(p),
                Some(p) => {
                    return Err(self.refuse(format!("scatter of {} parts in a world of {}", p.len(), self.world_size)));
                }
                None => return Err(self.refuse(format!("scatter root {root} passed no parts"))),
            }
        } else {
            None
        };
        self.call("scatter", |o| {
            let py = o.py();
            let arg = match &parts {
                Some(p) => Some(PyList::new(py, p.iter().map(|x| PyBytes::new(py, x)))?),
                None => None,
            };
            bytes_of(&o.call_method1("scatter", (root, arg))?)
        })
    }

    fn exchange(&self, sends: Vec<(usize, Bytes)>, from: &[usize]) -> Result<Vec<Bytes>> {
        for &r in sends.iter().map(|(to, _)| to).chain(from) {
            if r >= self.world_size || r == self.rank {
                return Err(
                    self.refuse(format!("exchange: rank {} with rank {r} (world of {})", self.rank, self.world_size))
                );
            }
        }
        let n = from.len();
        self.call("exchange", |o| {
            let py = o.py();
            let sends = PyList::new(py, sends.iter().map(|(to, m)| (*to, PyBytes::new(py, m))))?;
            let r = o.call_method1("exchange", (sends, from.to_vec()))?;
            Ok(list_of_bytes(&r, n, "exchange")?.into_iter().map(Bytes::from).collect())
        })
    }
}

/// dckpt's TCP star, joined with the GIL released; rank 0 calls `announce(port)` (under the
/// GIL) once it listens.
#[allow(clippy::too_many_arguments)] // PyCheckpointer::tcp's arguments
pub(crate) fn tcp(
    py: Python<'_>,
    rank: usize,
    world_size: usize,
    host: String,
    port: u16,
    job_id: String,
    timeout_s: f64,
    announce: Option<Py<PyAny>>,
) -> PyResult<TcpCollective> {
    if !(timeout_s.is_finite() && timeout_s > 0.0) {
        return Err(crate::errors::request_error(format!(
            "timeout_s must be a positive number of seconds, not {timeout_s}"
        )));
    }
    let cfg = TcpConfig { rank, world_size, local_rank: 0, master_addr: host, master_port: port, job_id };
    // A variable that does not parse is a setting to fix, not a peer that failed.
    let mut opts = TcpOptions::from_env().map_err(|e| crate::errors::request_error(e.to_string()))?;
    // Past what a `Duration` holds (about 5.8e11 years) is as good as forever.
    opts.rendezvous_timeout = Duration::try_from_secs_f64(timeout_s).unwrap_or(Duration::MAX);
    let joined = crate::logs::detached(py, || {
        TcpCollective::connect_announcing(&cfg, &opts, |port| match &announce {
            None => Ok(()),
            Some(f) => Python::attach(|py| {
                f.call1(py, (port,)).map(drop).map_err(|e| Error::Io {
                    context: format!("rank 0: announcing port {port}: {}", describe(py, &e)),
                    source: std::io::Error::other("the announce callback raised"),
                })
            }),
        })
    });
    joined.map_err(|e| crate::errors::CollectiveError::new_err(e.to_string()))
}
