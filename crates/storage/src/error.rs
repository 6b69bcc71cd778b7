//! The one error type of this crate.

use std::io;

/// A boxed error source, kept for the error chain.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in storage. Every variant names the object (or URL) involved:
/// `path` is the full location (`/abs/dir/name`, `s3://bucket/prefix/name`, `memory://x/name`).
///
/// Classification: [`Error::is_transient`] says whether trying the same operation again may
/// succeed (5xx, throttling, timeouts, injected throttling). Everything else is permanent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The object does not exist.
    #[error("not found: {path}")]
    NotFound { path: String },

    /// A conditional create (`put_if_absent`) found the object already there. This is the
    /// "someone else committed first" answer, distinct from every other failure.
    #[error("already exists: {path}")]
    AlreadyExists { path: String },

    /// A precondition other than "absent" did not hold (e.g. the store reported 412 / 304).
    #[error("precondition failed for {path}: {message}")]
    Precondition { path: String, message: String },

    /// The relative object path is not acceptable (empty, absolute, `.`/`..` or empty
    /// segments, backslashes, control characters, or a reserved temporary name).
    #[error("invalid object path {path:?}: {reason}")]
    InvalidPath { path: String, reason: &'static str },

    /// A requested byte range does not lie inside the object.
    #[error("range {start}..{end} is outside {path} ({size} bytes)")]
    OutOfRange { path: String, start: u64, end: u64, size: u64 },

    /// The storage URL or configuration is not usable.
    #[error("invalid storage configuration for {url}: {message}")]
    Config { url: String, message: String },

    /// A writer was used after it failed (or after an earlier write failed); the object was
    /// not and will not be made visible.
    #[error("writer for {path} already failed; nothing was made visible")]
    WriterFailed { path: String },

    /// A failure that may go away if the operation is tried again.
    #[error("transient failure during {op} on {path}: {source}")]
    Transient { path: String, op: &'static str, source: BoxError },

    /// A failure that will not go away by itself.
    #[error("{op} failed on {path}: {source}")]
    Permanent { path: String, op: &'static str, source: BoxError },

    /// A fault injected by [`crate::FaultStorage`]. `op_index` and `seed` replay it.
    #[error("injected fault at operation {op_index} ({kind}) on {path} (seed {seed})")]
    Injected { path: String, op_index: u64, seed: u64, kind: &'static str, transient: bool },
}

impl Error {
    /// Whether trying the same operation again may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Transient { .. } => true,
            Error::Injected { transient, .. } => *transient,
            _ => false,
        }
    }

    /// The location (or URL) this error is about.
    pub fn path(&self) -> &str {
        match self {
            Error::NotFound { path }
            | Error::AlreadyExists { path }
            | Error::Precondition { path, .. }
            | Error::InvalidPath { path, .. }
            | Error::OutOfRange { path, .. }
            | Error::WriterFailed { path }
            | Error::Transient { path, .. }
            | Error::Permanent { path, .. }
            | Error::Injected { path, .. } => path,
            Error::Config { url, .. } => url,
        }
    }

    /// Maps an IO error of operation `op` on `path`, keeping the not-found / exists distinction
    /// and classifying interrupted / timed-out / would-block as transient.
    pub(crate) fn io(op: &'static str, path: &str, e: io::Error) -> Error {
        let path = path.to_string();
        match e.kind() {
            io::ErrorKind::NotFound => Error::NotFound { path },
            // `a/b` where `a` is an object: there is no object `a/b`.
            io::ErrorKind::NotADirectory if matches!(op, "open" | "stat") => Error::NotFound { path },
            io::ErrorKind::AlreadyExists => Error::AlreadyExists { path },
            io::ErrorKind::Interrupted | io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
                Error::Transient { path, op, source: Box::new(e) }
            }
            _ => Error::Permanent { path, op, source: Box::new(e) },
        }
    }

    pub(crate) fn permanent(op: &'static str, path: &str, message: impl Into<String>) -> Error {
        let message: String = message.into();
        Error::Permanent { path: path.to_string(), op, source: message.into() }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
