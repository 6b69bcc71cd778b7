//! The engine's one error type, and how an error decided on one rank reaches every rank as
//! the same typed value.
//!
//! An [`Error`] is the rank that saw a failure, where one did, and what failed, its
//! [`ErrorKind`]. Every phase of a save or load ends with the ranks exchanging their results
//! through the coordinator (`protocol.rs`). A failure travels in that exchange serialized as
//! it is, since the storage, format, validation and collective errors it may hold are
//! serializable where they are defined, and is read back on every rank as the same kind with
//! the same rank and text.

use std::fmt;

use dckpt_shard_spec::{Region, ValidationError};
use serde::{Deserialize, Serialize};

use crate::format::FormatError;

/// Results of the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the engine: what failed ([`kind`](Self::kind)) and the
/// rank that saw it ([`rank`](Self::rank)).
///
/// A save or load returns the same error on every rank (the coordinator picks the first
/// failing rank), so every rank can report it the same way. The rank is `None` for failures
/// that concern all ranks ([`ErrorKind::MissingKeys`], [`ErrorKind::UnexpectedKeys`],
/// [`ErrorKind::Protocol`]), for a rank's own view of its collective, and from calls that
/// involve no other rank (such as [`read_metadata_local`](crate::read_metadata_local) and
/// [`verify`](crate::verify)). Displayed as `rank N: ` followed by the kind's message where
/// a rank is known, the kind's message alone where not.
#[derive(Debug, Serialize, Deserialize)]
pub struct Error {
    rank: Option<u32>,
    /// Boxed: the engine's results stay two words wide.
    kind: Box<ErrorKind>,
}

/// What went wrong in the engine. Each variant carries what it is about; its `Display` is the
/// error's message without the rank.
#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The sharded state failed coverage or declaration checks; nothing was written.
    #[error("{error}")]
    InvalidState {
        /// Every problem found (the first ones, and how many more).
        error: ValidationError,
    },
    /// Ranks that describe their pieces of `key`'s `region` as copies of one chunk hold
    /// different bytes (by a CRC-32 of the bytes compared, see
    /// [`ReplicaCheck`](crate::ReplicaCheck)): on `ranks`, each with its CRC in `crcs`, the
    /// bytes differ from the main copy on `main_rank`, whose CRC is `main_crc`. Every shape
    /// and offset check passes on such a state (the shards of a split tensor described as
    /// replicas of one tensor of a fraction of its size), so only the bytes tell. `more` other
    /// replicated regions differ too. Nothing was written.
    #[error("{}", replicas_differ(key, region, *main_rank, *main_crc, ranks, crcs, *more))]
    ReplicasDiffer {
        /// The tensor.
        key: String,
        /// The region of the chunk whose copies differ. Boxed: the kind stays small.
        region: Box<Region>,
        /// The rank holding the main copy.
        main_rank: u32,
        /// The main copy's CRC.
        main_crc: u32,
        /// The ranks whose copy differs.
        ranks: Vec<u32>,
        /// Their CRCs, in the order of `ranks`.
        crcs: Vec<u32>,
        /// How many other replicated regions or objects differ.
        more: u64,
    },
    /// The replica check found copies of an object, on `ranks`, that differ from its main
    /// copy on `main_rank`, where only one copy is written (compared as each holder's
    /// [`ObjectCompare`](crate::ObjectCompare) says). A value that differs between ranks is
    /// not one object with replicas but one object per rank: a grid with a position each.
    /// `more` other replicated pieces differ too. Nothing was written.
    #[error("{}", objects_differ(key, grid_offset, *main_rank, ranks, *more))]
    ObjectsDiffer {
        /// The object's key.
        key: String,
        /// Its place in its grid.
        grid_offset: Vec<u64>,
        /// The rank holding the main copy.
        main_rank: u32,
        /// The ranks whose copy differs.
        ranks: Vec<u32>,
        /// How many other replicated pieces differ.
        more: u64,
    },
    /// A checkpoint is already committed there: it was there when the save planned and
    /// replacing it was not asked for, or another save committed there while this one ran
    /// (whether it was asked to replace or not). Nothing of this save is left behind.
    #[error(
        "a checkpoint is already committed at {location} (there before this save, which did not ask to \
         replace it, or committed by another save while this one ran); choose another location or replace it"
    )]
    AlreadyExists {
        /// The metadata file's location.
        location: String,
    },
    /// No committed checkpoint there (nothing, or a save that never committed).
    #[error("{location}: not a checkpoint (no committed metadata file)")]
    NotACheckpoint {
        /// The location looked at.
        location: String,
    },
    /// A malformed or damaged file.
    #[error("{error}")]
    Format {
        /// Which file, which field and why.
        error: FormatError,
    },
    /// Writing the metadata file (the commit) failed and reading it back failed too:
    /// whether the save committed is unknown, so its data files were kept.
    #[error("{location}: {detail}; whether the metadata landed is unknown, so this save's data files were kept")]
    CommitUncertain {
        /// The metadata file's location.
        location: String,
        /// What failed.
        detail: String,
    },
    /// Stored bytes that do not match their checksum.
    #[error("{file}: checksum mismatch at byte {offset}: {detail}")]
    Checksum {
        /// The file.
        file: String,
        /// Where in it.
        offset: u64,
        /// Which checksum, and what it found.
        detail: String,
    },
    /// Options that cannot be used (every rank must pass the same options).
    #[error("invalid options: {detail}")]
    InvalidOptions {
        /// Which option, and why.
        detail: String,
    },
    /// A request or a piece of state that cannot be served (wrong dtype, shape, buffer size).
    #[error("tensor {key:?}: {detail}")]
    Request {
        /// The tensor.
        key: String,
        /// What does not fit.
        detail: String,
    },
    /// Requested keys that the checkpoint does not hold (the union over all ranks).
    #[error("{} requested keys are not stored: {}{}", keys.len() as u64 + more, keys.join(", "), and_more(*more))]
    MissingKeys {
        /// The keys: all of them on the coordinator, the first [`KEYS_SENT_MAX`] elsewhere.
        keys: Vec<String>,
        /// How many more there are than `keys` lists.
        #[serde(default)]
        more: u64,
    },
    /// Stored keys that no rank requested.
    #[error(
        "{} stored keys were not requested by any rank: {}{}",
        keys.len() as u64 + more,
        keys.join(", "),
        and_more(*more)
    )]
    UnexpectedKeys {
        /// The keys: all of them on the coordinator, the first [`KEYS_SENT_MAX`] elsewhere.
        keys: Vec<String>,
        /// How many more there are than `keys` lists.
        #[serde(default)]
        more: u64,
    },
    /// A storage operation failed.
    #[error("{error}")]
    Storage {
        /// The storage's error.
        error: dckpt_storage::Error,
    },
    /// A collective failed (a dead or silent peer, a timeout). Without a rank it is this
    /// rank's own view, since the collective is what would carry anything else; with one, the
    /// failure that rank reported while it still could.
    #[error(transparent)]
    Collective(dckpt_collective::Error),
    /// A failure with no typed form here (such as a [`PieceSource`](crate::PieceSource)'s
    /// own), as its text.
    #[error("{message}")]
    Other {
        /// What failed.
        message: String,
    },
    /// A rank's caller could not make its part of a save or load (`caller_failed` of the
    /// options): every rank fails with it, naming that rank, rather than waiting for it.
    #[error("its caller failed before its part was ready: {detail}")]
    CallerFailed {
        /// The caller's error as it gave it (from Python, `TypeError: key: ...`).
        detail: String,
    },
    /// Ranks disagree about the protocol: a message of the wrong shape, or a rank's part
    /// that does not match the plan or the options the others pass (ranks running different
    /// versions, or passing different arguments).
    #[error("protocol: {detail}")]
    Protocol {
        /// What does not match.
        detail: String,
    },
    /// A bug or a failure of the host rather than of the checkpoint or the caller: a panic
    /// caught in a rank's work, a write abandoned midway, a thread that could not start.
    #[error("internal error: {detail}")]
    Internal {
        /// What happened.
        detail: String,
    },
    /// The API used wrongly by its caller, such as waiting twice for one save.
    #[error("invalid use: {detail}")]
    Usage {
        /// What was done, and why it cannot be.
        detail: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(r) = self.rank {
            write!(f, "rank {r}: ")?;
        }
        fmt::Display::fmt(&self.kind, f)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.kind.source()
    }
}

/// The ranks listed in a [`ErrorKind::ReplicasDiffer`] message; the rest are counted.
const DIFFER_LISTED: usize = 8;

fn replicas_differ(
    key: &str,
    region: &Region,
    main_rank: u32,
    main_crc: u32,
    ranks: &[u32],
    crcs: &[u32],
    more: u64,
) -> String {
    format!(
        "tensor {key:?} region {region}: replicas differ from the main copy on rank {main_rank} (crc {main_crc:#010x}): \
         {}; replicas must hold the same bytes (is this tensor split across ranks but described as replicas?){}",
        listed_ranks(ranks, crcs),
        more_differ(more)
    )
}

fn objects_differ(key: &str, grid_offset: &[u64], main_rank: u32, ranks: &[u32], more: u64) -> String {
    let at = if grid_offset.is_empty() { String::new() } else { format!(" at grid offset {grid_offset:?}") };
    format!(
        "object {key:?}{at}: {} {} a value other than the main copy's on rank {main_rank}, and only one copy is \
         saved; a value that differs between ranks needs a grid position of its own on each{}",
        listed_ranks(ranks, &[]),
        if ranks.len() == 1 { "holds" } else { "hold" },
        more_differ(more)
    )
}

fn more_differ(more: u64) -> String {
    match more {
        0 => String::new(),
        n => format!("; {n} more replicated pieces differ too"),
    }
}

/// "rank 3" or "ranks 1 (crc ...), 2 (crc ...)", at most [`DIFFER_LISTED`] of them.
fn listed_ranks(ranks: &[u32], crcs: &[u32]) -> String {
    let mut listed: Vec<String> = ranks
        .iter()
        .zip(crcs.iter().map(Some).chain(std::iter::repeat(None)))
        .take(DIFFER_LISTED)
        .map(|(r, c)| match c {
            Some(c) => format!("{r} (crc {c:#010x})"),
            None => r.to_string(),
        })
        .collect();
    if ranks.len() > DIFFER_LISTED {
        listed.push(format!("and {} more", ranks.len() - DIFFER_LISTED));
    }
    format!("{} {}", if ranks.len() == 1 { "rank" } else { "ranks" }, listed.join(", "))
}

impl From<ErrorKind> for Error {
    fn from(kind: ErrorKind) -> Self {
        Error { rank: None, kind: Box::new(kind) }
    }
}

impl From<dckpt_storage::Error> for Error {
    fn from(error: dckpt_storage::Error) -> Self {
        ErrorKind::Storage { error }.into()
    }
}

impl From<FormatError> for Error {
    fn from(error: FormatError) -> Self {
        ErrorKind::Format { error }.into()
    }
}

impl From<ValidationError> for Error {
    fn from(error: ValidationError) -> Self {
        ErrorKind::InvalidState { error }.into()
    }
}

impl From<dckpt_collective::Error> for Error {
    fn from(error: dckpt_collective::Error) -> Self {
        ErrorKind::Collective(error).into()
    }
}

impl Error {
    /// An error of `kind`, seen on no rank yet.
    pub fn new(kind: ErrorKind) -> Error {
        kind.into()
    }

    /// An [`ErrorKind::Protocol`] error: ranks disagree.
    pub fn protocol(detail: impl Into<String>) -> Error {
        ErrorKind::Protocol { detail: detail.into() }.into()
    }

    /// [`ErrorKind::CallerFailed`] where the options say the caller failed (`why`).
    pub(crate) fn caller_failed(why: &Option<String>) -> Result<(), Error> {
        match why {
            None => Ok(()),
            Some(detail) => Err(ErrorKind::CallerFailed { detail: detail.clone() }.into()),
        }
    }

    /// An [`ErrorKind::Internal`] error: a bug or the host failing.
    pub fn internal(detail: impl Into<String>) -> Error {
        ErrorKind::Internal { detail: detail.into() }.into()
    }

    /// An [`ErrorKind::Usage`] error: the API used wrongly.
    pub fn usage(detail: impl Into<String>) -> Error {
        ErrorKind::Usage { detail: detail.into() }.into()
    }

    /// An [`ErrorKind::InvalidOptions`] error.
    pub fn invalid_options(detail: impl Into<String>) -> Error {
        ErrorKind::InvalidOptions { detail: detail.into() }.into()
    }

    /// An [`ErrorKind::Request`] error about tensor `key`.
    pub fn request(key: impl Into<String>, detail: impl Into<String>) -> Error {
        ErrorKind::Request { key: key.into(), detail: detail.into() }.into()
    }

    /// The rank that saw the failure, where one did.
    pub fn rank(&self) -> Option<u32> {
        self.rank
    }

    /// What failed.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// What failed, as a value.
    pub fn into_kind(self) -> ErrorKind {
        *self.kind
    }

    /// Whether trying the same save or load again may succeed (a transient storage failure
    /// such as throttling).
    pub fn is_transient(&self) -> bool {
        match &*self.kind {
            ErrorKind::Storage { error } => error.is_transient(),
            _ => false,
        }
    }

    /// The same error, said to have been seen on rank `r` (unless it already names one).
    /// Failures that concern all ranks ([`ErrorKind::MissingKeys`],
    /// [`ErrorKind::UnexpectedKeys`], [`ErrorKind::Protocol`]) name no rank and stay as they
    /// are.
    pub fn on_rank(mut self, r: u32) -> Error {
        let all_ranks = matches!(
            *self.kind,
            ErrorKind::MissingKeys { .. } | ErrorKind::UnexpectedKeys { .. } | ErrorKind::Protocol { .. }
        );
        if !all_ranks {
            self.rank.get_or_insert(r);
        }
        self
    }

    /// The same error as a new value, as another rank receives it: a list of keys cut to
    /// its first [`KEYS_SENT_MAX`] (the coordinator's own lists them all). Whole, a model-only
    /// load of a checkpoint with its optimizer state sent every rank every optimizer key:
    /// 7 MB to each of 16,384 ranks.
    pub(crate) fn replicate(&self) -> Error {
        let cut = |keys: &[String], more: u64| {
            let sent = keys.len().min(KEYS_SENT_MAX);
            (keys[..sent].to_vec(), more + (keys.len() - sent) as u64)
        };
        let kind = match &*self.kind {
            ErrorKind::MissingKeys { keys, more } => {
                let (keys, more) = cut(keys, *more);
                ErrorKind::MissingKeys { keys, more }
            }
            ErrorKind::UnexpectedKeys { keys, more } => {
                let (keys, more) = cut(keys, *more);
                ErrorKind::UnexpectedKeys { keys, more }
            }
            _ => return crate::protocol::decode(&crate::protocol::encode(self), "error").unwrap_or_else(|e| e),
        };
        Error { rank: self.rank, kind: Box::new(kind) }
    }
}

/// The keys a key-mismatch error lists on the ranks other than the coordinator.
pub const KEYS_SENT_MAX: usize = 100;

fn and_more(more: u64) -> String {
    match more {
        0 => String::new(),
        n => format!(", and {n} more (rank 0's error lists them all)"),
    }
}

/// The results of every rank, in rank order, as one: all the values, or the first failure,
/// stamped with the rank that had it.
pub(crate) fn first_failure<T>(all: Vec<Result<T>>) -> Result<Vec<T>> {
    all.into_iter().enumerate().map(|(r, res)| res.map_err(|e| e.on_rank(r as u32))).collect()
}

/// `f`'s result, with a panic in it (a bug, or a host's storage wrapper that panics) as
/// this rank's error: the ranks agree on an error, where an unwind out of the call left the
/// others waiting for this rank in the next round until the collective's timeout.
pub(crate) fn panic_as_error<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|panic| Err(Error::internal(format!("{what} panicked: {}", panic_text(panic.as_ref())))))
}

/// The message a panic carried, where it is text.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "(no message)".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dckpt_shard_spec::Problem;

    use super::*;
    use crate::format::FormatErrorKind;
    use crate::protocol::{decode, encode};

    fn sample() -> Vec<Error> {
        use dckpt_collective::Error as C;
        use dckpt_storage::Error as S;
        let on = |r: u32, kind: ErrorKind| Error::new(kind).on_rank(r);
        let storage = |error| Error::from(error).on_rank(3);
        let format = |r, field: &str, kind| on(r, ErrorKind::Format { error: FormatError::new("f", field, kind) });
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        vec![
            on(
                0,
                ErrorKind::InvalidState {
                    error: ValidationError { problems: vec![Problem::MissingTensor { key: "w".into() }], more: 2 },
                },
            ),
            on(0, ErrorKind::AlreadyExists { location: "/x/dckpt.meta".into() }),
            on(
                0,
                ErrorKind::ReplicasDiffer {
                    key: "decoder.experts.fc1".into(),
                    region: Box::new(Region::boxed([0, 0], [64, 128])),
                    main_rank: 0,
                    main_crc: 0xdead_beef,
                    ranks: vec![1, 3],
                    crcs: vec![1, 2],
                    more: 4,
                },
            ),
            on(
                0,
                ErrorKind::ObjectsDiffer {
                    key: "iteration".into(),
                    grid_offset: vec![],
                    main_rank: 0,
                    ranks: vec![2],
                    more: 0,
                },
            ),
            Error::new(ErrorKind::NotACheckpoint { location: "s3://b/p".into() }),
            on(0, ErrorKind::CommitUncertain { location: "l".into(), detail: "d".into() }),
            format(0, "magic", FormatErrorKind::NotMetadata),
            format(2, "crc32", FormatErrorKind::Damaged { detail: "crc mismatch".into() }),
            format(0, "files[1].name", FormatErrorKind::Invalid { detail: "not a data file name".into() }),
            format(1, "tensors[0]", FormatErrorKind::Malformed { detail: "bad".into(), offset: 9 }),
            format(0, "format_version", FormatErrorKind::UnsupportedVersion { found: 2, supported: 1 }),
            format(
                0,
                "block_bytes",
                FormatErrorKind::LimitExceeded { what: "bytes per block".into(), found: 9, limit: 8 },
            ),
            format(0, "layout", FormatErrorKind::LimitExceeded { what: "layout entries".into(), found: 9, limit: 8 }),
            on(2, ErrorKind::Checksum { file: "f".into(), offset: 7, detail: "d".into() }),
            Error::request("k", "d").on_rank(1),
            Error::invalid_options("d").on_rank(0),
            Error::new(ErrorKind::MissingKeys { keys: vec!["a".into()], more: 0 }),
            Error::new(ErrorKind::UnexpectedKeys { keys: vec!["b".into()], more: 0 }),
            storage(S::NotFound { path: "p".into() }),
            storage(S::AlreadyExists { path: "p".into() }),
            storage(S::Precondition { path: "p".into(), message: "412".into() }),
            storage(S::Config { url: "s3://b".into(), message: "no region".into() }),
            storage(S::WriterFailed { path: "p".into() }),
            storage(S::InvalidPath { path: "p".into(), reason: "empty segment".into() }),
            storage(S::OutOfRange { path: "p".into(), start: 1, end: 9, size: 4 }),
            storage(S::Transient { path: "p".into(), op: "put".into(), source: "slow down".into() }),
            storage(S::Permanent { path: "p".into(), op: "rename".into(), source: Box::new(denied) }),
            storage(S::Injected {
                path: "p".into(),
                op_index: 4,
                seed: 9,
                kind: "torn write".into(),
                transient: false,
            }),
            Error::from(C::Timeout { rank: 2, op: "gather".into(), timeout: Duration::from_secs(3) }),
            Error::from(C::PeerDead { rank: 1, op: "broadcast".into() }).on_rank(4),
            Error::from(C::Io { context: "bind".into(), source: std::io::Error::other("address in use") }).on_rank(0),
            on(5, ErrorKind::Other { message: "m".into() }),
            Error::protocol("p"),
            Error::internal("a write thread panicked").on_rank(1),
            Error::usage("step 3: its save was already waited for"),
        ]
    }

    /// Every kind reaches another rank as the same kind with the same text, rank and
    /// sources.
    #[test]
    fn errors_cross_ranks_unchanged() {
        use std::error::Error as _;
        let sources = |e: &Error| {
            let mut texts = Vec::new();
            let mut s = e.source();
            while let Some(inner) = s {
                texts.push(inner.to_string());
                s = inner.source();
            }
            texts
        };
        for e in sample() {
            let back: Error = decode(&encode(&e), "error").unwrap();
            assert_eq!(std::mem::discriminant(back.kind()), std::mem::discriminant(e.kind()), "{e:?} became {back:?}");
            assert_eq!(back.to_string(), e.to_string());
            assert_eq!(back.rank(), e.rank());
            assert_eq!(back.is_transient(), e.is_transient(), "{e}");
            assert_eq!(sources(&back), sources(&e), "{e}");
            assert_eq!(e.replicate().to_string(), e.to_string());
            match (e.kind(), back.kind()) {
                (ErrorKind::Storage { error: a }, ErrorKind::Storage { error: b }) => {
                    assert_eq!(std::mem::discriminant(a), std::mem::discriminant(b), "{a:?} became {b:?}");
                    let source = |s: &dckpt_storage::Error| s.source().map(|s| s.to_string());
                    assert_eq!(source(b), source(a), "{a}");
                }
                (ErrorKind::Format { error: a }, ErrorKind::Format { error: b }) => assert_eq!(a, b),
                (ErrorKind::Collective(a), ErrorKind::Collective(b)) => {
                    assert_eq!(std::mem::discriminant(a), std::mem::discriminant(b), "{a:?} became {b:?}");
                }
                _ => {}
            }
        }
    }

    /// A storage error's source is there to travel: its text reaches the other rank.
    #[test]
    fn a_storage_source_travels_as_its_text() {
        let e = Error::from(dckpt_storage::Error::Permanent {
            path: "p".into(),
            op: "rename".into(),
            source: "denied by policy".into(),
        });
        let back: Error = decode(&encode(&e), "error").unwrap();
        let ErrorKind::Storage { error } = back.kind() else { panic!("{back:?}") };
        assert_eq!(std::error::Error::source(error).map(|s| s.to_string()).as_deref(), Some("denied by policy"));
    }

    /// The first failing rank is the one every rank reports; a rank already named stays named,
    /// and a failure of all ranks names none.
    #[test]
    fn the_first_failure_is_stamped_with_its_rank() {
        let all: Vec<Result<u8>> = vec![
            Ok(1),
            Err(ErrorKind::Checksum { file: "f".into(), offset: 0, detail: "d".into() }.into()),
            Err(Error::protocol("later")),
        ];
        let e = first_failure(all).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Checksum { .. }) && e.rank() == Some(1), "{e:?}");
        let named = Error::new(ErrorKind::AlreadyExists { location: "l".into() }).on_rank(0).on_rank(4);
        assert_eq!(named.rank(), Some(0));
        assert_eq!(Error::protocol("p").on_rank(2).rank(), None);
        let keys = Error::new(ErrorKind::MissingKeys { keys: vec!["a".into()], more: 0 }).on_rank(2);
        assert_eq!((keys.rank(), keys.to_string()), (None, "1 requested keys are not stored: a".to_string()));
    }

    /// A list of keys goes to the other ranks cut to its first KEYS_SENT_MAX, with their
    /// count; the coordinator's own error keeps it whole. Every rank got every key.
    #[test]
    fn other_ranks_get_the_first_keys_and_their_count() {
        let keys: Vec<String> = (0..KEYS_SENT_MAX + 5).map(|i| format!("k{i}")).collect();
        let whole = Error::new(ErrorKind::UnexpectedKeys { keys: keys.clone(), more: 0 });
        let sent = crate::protocol::decode::<Error>(&crate::protocol::encode(&whole.replicate()), "e").unwrap();
        let ErrorKind::UnexpectedKeys { keys: got, more } = sent.kind() else { panic!("{sent:?}") };
        assert_eq!((&got[..], *more), (&keys[..KEYS_SENT_MAX], 5));
        let text = sent.to_string();
        assert!(
            text.starts_with("105 stored keys") && text.ends_with("and 5 more (rank 0's error lists them all)"),
            "{text}"
        );
        assert!(matches!(whole.kind(), ErrorKind::UnexpectedKeys { keys: k, more: 0 } if k.len() == 105));
    }

    /// The error stays two words wide, so every `Result` of the engine does too.
    #[test]
    fn the_error_is_small() {
        assert_eq!(std::mem::size_of::<Error>(), 16);
    }
}
