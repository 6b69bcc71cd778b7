//! The one error type of this crate.

use std::borrow::Cow;
use std::io;

use serde::{Deserialize, Serialize};

/// A boxed error source, kept for the error chain.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in storage. Every variant names the object (or URL) involved:
/// `path` is the full location (`/abs/dir/name`, `s3://bucket/prefix/name`, `memory://x/name`).
///
/// Classification: [`Error::is_transient`] says whether trying the same operation again may
/// succeed (5xx, throttling, timeouts, injected throttling). Everything else is permanent.
///
/// Serializable, so that it can be sent to another process as it is: the names it holds are
/// `Cow`s that come back with the same text, and a boxed `source` travels as its message, so
/// the error read back displays the same.
#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Error {
    /// The object does not exist.
    #[error("not found: {path}")]
    NotFound {
        /// The object's location.
        path: String,
    },

    /// A conditional create (`put_if_absent`) found the object already there. This is the
    /// "someone else committed first" answer, distinct from every other failure.
    #[error("already exists: {path}")]
    AlreadyExists {
        /// The object's location.
        path: String,
    },

    /// A precondition other than "absent" did not hold (e.g. the store reported 412 / 304).
    #[error("precondition failed for {path}: {message}")]
    Precondition {
        /// The object's location.
        path: String,
        /// What the store said.
        message: String,
    },

    /// The relative object path is not acceptable (empty, absolute, `.`/`..` or empty
    /// segments, backslashes, control characters, or a reserved temporary name).
    #[error("invalid object path {path:?}: {reason}")]
    InvalidPath {
        /// The path as given.
        path: String,
        /// Which rule it breaks.
        reason: Cow<'static, str>,
    },

    /// A requested byte range does not lie inside the object.
    #[error("range {start}..{end} is outside {path} ({size} bytes)")]
    OutOfRange {
        /// The object's location.
        path: String,
        /// First byte asked for.
        start: u64,
        /// One past the last byte asked for.
        end: u64,
        /// The object's size in bytes.
        size: u64,
    },

    /// The object's length is not the one its reader was opened for
    /// ([`crate::Storage::reader_sized`]): it was cut short, grown or replaced.
    #[error("{path} has {size} bytes, {expected} were expected")]
    SizeMismatch {
        /// The object's location.
        path: String,
        /// The length the reader was opened for.
        expected: u64,
        /// The object's length as the store reported it.
        size: u64,
    },

    /// The storage URL or configuration is not usable.
    #[error("invalid storage configuration for {url}: {message}")]
    Config {
        /// The URL (or backend) being configured.
        url: String,
        /// What is wrong with it.
        message: String,
    },

    /// A writer was used after it failed (or after an earlier write failed); the object was
    /// not and will not be made visible.
    #[error("writer for {path} already failed; nothing was made visible")]
    WriterFailed {
        /// The location the writer was writing.
        path: String,
    },

    /// A failure that may go away if the operation is tried again.
    #[error("transient failure during {op} on {path}: {source}")]
    Transient {
        /// The object's location.
        path: String,
        /// The operation that failed (`put`, `get_ranges`, ...).
        op: Cow<'static, str>,
        /// The backend's error (its message only, once it crossed a process).
        #[serde(with = "source_text")]
        source: BoxError,
    },

    /// A failure that will not go away by itself.
    #[error("{op} failed on {path}: {source}")]
    Permanent {
        /// The object's location.
        path: String,
        /// The operation that failed (`put`, `get_ranges`, ...).
        op: Cow<'static, str>,
        /// The backend's error (its message only, once it crossed a process).
        #[serde(with = "source_text")]
        source: BoxError,
    },

    /// A fault injected by [`crate::FaultStorage`]. `op_index` and `seed` replay it.
    #[error("injected fault at operation {op_index} ({kind}) on {path} (seed {seed})")]
    Injected {
        /// The object's location.
        path: String,
        /// The wrapper's count of operations when it failed this one.
        op_index: u64,
        /// The wrapper's seed.
        seed: u64,
        /// Which fault (`fail`, `throttle`, `fail after effect`, `torn write`).
        kind: Cow<'static, str>,
        /// Whether it reports itself as worth retrying.
        transient: bool,
    },
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
            | Error::SizeMismatch { path, .. }
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
                Error::Transient { path, op: op.into(), source: Box::new(e) }
            }
            _ => Error::Permanent { path, op: op.into(), source: Box::new(e) },
        }
    }

    /// A transient failure of `op` on `path`, told by a message.
    #[cfg(feature = "s3")]
    pub(crate) fn transient(op: &'static str, path: String, message: impl Into<String>) -> Error {
        let message: String = message.into();
        Error::Transient { path, op: op.into(), source: message.into() }
    }

    pub(crate) fn permanent(op: &'static str, path: &str, message: impl Into<String>) -> Error {
        let message: String = message.into();
        Error::Permanent { path: path.to_string(), op: op.into(), source: message.into() }
    }
}

/// A boxed source as its message: serialized as its `Display`, read back as an error that
/// displays that text.
mod source_text {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::BoxError;

    pub(super) fn serialize<S: Serializer>(source: &BoxError, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(source)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BoxError, D::Error> {
        String::deserialize(d).map(BoxError::from)
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// An error read back is the same variant with the same text, the source's included.
    #[test]
    fn errors_round_trip_with_their_text() {
        let io_source = Error::io("rename", "/d/x", io::Error::from(io::ErrorKind::PermissionDenied));
        for e in [
            Error::InvalidPath { path: "a//b".into(), reason: "empty segment".into() },
            Error::SizeMismatch { path: "p".into(), expected: 9, size: 4 },
            Error::Transient { path: "p".into(), op: "put".into(), source: "slow down".into() },
            io_source,
            Error::Injected { path: "p".into(), op_index: 4, seed: 9, kind: "throttle".into(), transient: true },
        ] {
            let back: Error = serde_json::from_str(&serde_json::to_string(&e).unwrap()).unwrap();
            assert_eq!(std::mem::discriminant(&back), std::mem::discriminant(&e), "{e:?} became {back:?}");
            assert_eq!(back.to_string(), e.to_string());
            assert_eq!(back.is_transient(), e.is_transient(), "{e}");
            let source = |e: &Error| std::error::Error::source(e).map(|s| s.to_string());
            assert_eq!(source(&back), source(&e), "{e}");
        }
    }
}
