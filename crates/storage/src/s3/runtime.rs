//! The process-wide tokio runtime every S3 request runs on, and how its answers become
//! [`Error`]s.

use std::future::Future;
use std::sync::atomic::{AtomicPtr, Ordering};

use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::{Error, Result};

/// The name of the runtime's threads.
pub(super) const RUNTIME_THREAD: &str = "dckpt-s3";

/// The runtime that runs every S3 request, one per process. A forked child (a DataLoader
/// worker, a checkpoint writer forked from a trainer) inherits the parent's runtime without
/// its worker threads, where every request would hang, so a child builds its own. Never
/// dropped (an inherited one is leaked), so no drop can happen inside an async context; an
/// atomic rather than a lock, since a lock held by another thread at the fork would never
/// be released in the child.
pub(super) fn runtime() -> Result<&'static Runtime> {
    static RT: AtomicPtr<(u32, Runtime)> = AtomicPtr::new(std::ptr::null_mut());
    let pid = std::process::id();
    loop {
        let current = RT.load(Ordering::Acquire);
        // SAFETY: every pointer stored in RT comes from `Box::into_raw` and is never freed.
        if let Some((owner, rt)) = unsafe { current.as_ref() }
            && *owner == pid
        {
            return Ok(rt);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name(RUNTIME_THREAD)
            .enable_all()
            .build()
            .map_err(|e| Error::Config { url: "s3://".into(), message: format!("cannot start the IO runtime: {e}") })?;
        let fresh = Box::into_raw(Box::new((pid, rt)));
        if RT.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire).is_err() {
            // Another thread installed one first: use that. Ours was never shared, and
            // shutting it down in the background is allowed in an async context.
            // SAFETY: `fresh` came from `Box::into_raw` above and was not published.
            unsafe { Box::from_raw(fresh) }.1.shutdown_background();
        }
    }
}

/// Runs `fut` on the runtime and blocks this thread until it is done. Spawning (rather than
/// `Runtime::block_on`) keeps this safe when the caller is itself inside a tokio runtime.
pub(super) fn block_on<T: Send + 'static>(
    location: &str,
    fut: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    let handle = runtime()?.spawn(fut);
    join(location, handle)
}

pub(super) fn join<T>(location: &str, handle: JoinHandle<Result<T>>) -> Result<T> {
    futures::executor::block_on(handle)
        .map_err(|e| Error::permanent("s3 request", location, format!("IO task failed: {e}")))?
}

/// Maps an `object_store` error on `location`.
pub(super) fn map_err(op: &'static str, location: &str, e: object_store::Error) -> Error {
    let (path, op) = (location.to_string(), op.into());
    match e {
        object_store::Error::NotFound { .. } => Error::NotFound { path },
        object_store::Error::AlreadyExists { .. } => Error::AlreadyExists { path },
        object_store::Error::Precondition { source, .. } | object_store::Error::NotModified { source, .. } => {
            Error::Precondition { path, message: source.to_string() }
        }
        object_store::Error::Generic { .. } if is_transient(&e) => Error::Transient { path, op, source: Box::new(e) },
        other => Error::Permanent { path, op, source: Box::new(other) },
    }
}

/// `object_store` already retried the request; what is left is transient unless the server
/// answered with a client error (4xx other than 408 / 429). Its status is only visible in the
/// message, so this reads the message.
fn is_transient(e: &object_store::Error) -> bool {
    let text = e.to_string();
    let client_error = text
        .split("status code: ")
        .nth(1)
        .and_then(|s| s.get(..3))
        .is_some_and(|code| code.starts_with('4') && code != "408" && code != "429");
    !client_error
}
