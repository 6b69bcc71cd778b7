//! The engine's `log` records, handed to Python's `logging` (the logger `dckpt`): the
//! warnings of a load's unrequested keys (`unexpected="log"`), the local tier's fallbacks,
//! leftovers a save could not remove. The logger is this extension's own (its `log` crate is
//! linked into it), so the host process's logging is not touched.
//!
//! A record is queued on whatever thread logs it and handed over on the calling thread when
//! a call into the engine returns ([`detached`]): taking the GIL from an engine thread that
//! holds a lock the caller waits on would deadlock.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use pyo3::prelude::*;

/// Records held until the next call returns; past this, the oldest go (and are counted).
const QUEUED_MAX: usize = 1024;

struct Queue {
    records: VecDeque<(log::Level, String)>,
    dropped: u64,
}

static QUEUE: Mutex<Queue> = Mutex::new(Queue { records: VecDeque::new(), dropped: 0 });

struct Queued;

impl log::Log for Queued {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let mut q = QUEUE.lock().unwrap_or_else(PoisonError::into_inner);
        if q.records.len() == QUEUED_MAX {
            q.records.pop_front();
            q.dropped += 1;
        }
        q.records.push_back((record.level(), record.args().to_string()));
    }

    fn flush(&self) {}
}

static LOGGER: Queued = Queued;

/// Sends this extension's `log` records to the queue (once; a second call changes nothing).
pub fn install() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}

/// Runs `f` with the GIL released, then hands the records logged meanwhile (on any thread)
/// to Python's `logging`.
pub fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    let out = py.detach(f);
    emit(py);
    out
}

/// Hands the queued records to the `dckpt` logger of Python's `logging`. A failure there
/// (a handler that raises) is Python's to report, not the call's.
pub fn emit(py: Python<'_>) {
    let (records, dropped) = {
        let mut q = QUEUE.lock().unwrap_or_else(PoisonError::into_inner);
        if q.records.is_empty() && q.dropped == 0 {
            return;
        }
        (std::mem::take(&mut q.records), std::mem::take(&mut q.dropped))
    };
    let logger = match py.import("logging").and_then(|m| m.call_method1("getLogger", ("dckpt",))) {
        Ok(l) => l,
        Err(e) => return e.write_unraisable(py, None),
    };
    let level = |l: log::Level| match l {
        log::Level::Error => 40,
        log::Level::Warn => 30,
        _ => 20,
    };
    if dropped > 0 {
        let msg = format!("{dropped} earlier records were dropped (more than {QUEUED_MAX} between calls)");
        if let Err(e) = logger.call_method1("log", (30, "%s", msg)) {
            e.write_unraisable(py, None);
        }
    }
    for (l, msg) in records {
        if let Err(e) = logger.call_method1("log", (level(l), "%s", msg)) {
            e.write_unraisable(py, None);
        }
    }
}
