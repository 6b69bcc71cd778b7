//! The engine's one error type, and how an error decided on one rank reaches every rank as
//! the same typed value.
//!
//! Every phase of a save or load ends with the ranks exchanging their results through the
//! coordinator (`protocol.rs`). A failure travels in that exchange in a serializable form
//! ([`Wire`]) and is rebuilt on every rank as the same [`Error`] variant, stamped with the
//! rank that saw it. Storage errors hold `&'static str` names and boxed sources that cannot
//! travel as they are: the rebuilt error keeps the variant, the location and the message
//! (the source becomes its text), and maps the operation name back to the storage crate's
//! own names.

use dckpt_shard_spec::{Region, ValidationError};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::format::{FormatError, FormatErrorKind};

/// Results of the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the engine. Each variant carries what it is about.
///
/// `rank` is the rank that saw the failure. A save or load returns the same error on every
/// rank (the coordinator picks the first failing rank), so every rank can report it the same
/// way; it is `None` only from calls that involve no other rank (such as
/// [`read_metadata_local`](crate::read_metadata_local) and [`verify`](crate::verify)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The sharded state failed coverage or declaration checks; nothing was written.
    #[error("{}{error}", on(rank))]
    InvalidState { rank: Option<u32>, error: ValidationError },
    /// Ranks that describe their pieces of `key`'s `region` as copies of one chunk hold
    /// different bytes (by a CRC-32 of the bytes compared, see
    /// [`ReplicaCheck`](crate::ReplicaCheck)): on `ranks`, each with its CRC in `crcs`, the
    /// bytes differ from the main copy on `main_rank`, whose CRC is `main_crc`. Every shape and offset check passes on such
    /// a state (the shards of a split tensor described as replicas of one tensor of a
    /// fraction of its size), so only the bytes tell. `more` other replicated regions differ
    /// too. Nothing was written.
    #[error("{}{}", on(rank), replicas_differ(key, region, *main_rank, *main_crc, ranks, crcs, *more))]
    ReplicasDiffer {
        rank: Option<u32>,
        key: String,
        /// Boxed: the error type stays small.
        region: Box<Region>,
        main_rank: u32,
        main_crc: u32,
        ranks: Vec<u32>,
        crcs: Vec<u32>,
        more: u64,
    },
    /// A checkpoint is already committed there: it was there when the save planned and
    /// replacing it was not asked for, or another save committed there while this one ran
    /// (whether it was asked to replace or not). Nothing of this save is left behind.
    #[error(
        "{}a checkpoint is already committed at {location} (there before this save, which did not ask to \
         replace it, or committed by another save while this one ran); choose another location or replace it",
        on(rank)
    )]
    AlreadyExists { rank: Option<u32>, location: String },
    /// No committed checkpoint there (nothing, or a save that never committed).
    #[error("{}{location}: not a checkpoint (no committed metadata file)", on(rank))]
    NotACheckpoint { rank: Option<u32>, location: String },
    /// A malformed or damaged file.
    #[error("{}{error}", on(rank))]
    Format { rank: Option<u32>, error: FormatError },
    /// Writing the metadata file (the commit) failed and reading it back failed too:
    /// whether the save committed is unknown, so its data files were kept.
    #[error(
        "{}{location}: {detail}; whether the metadata landed is unknown, so this save's data files were kept",
        on(rank)
    )]
    CommitUncertain { rank: Option<u32>, location: String, detail: String },
    /// Stored bytes that do not match their checksum.
    #[error("{}{file}: checksum mismatch at byte {offset}: {detail}", on(rank))]
    Checksum { rank: Option<u32>, file: String, offset: u64, detail: String },
    /// Options that cannot be used (every rank must pass the same options).
    #[error("{}invalid options: {detail}", on(rank))]
    InvalidOptions { rank: Option<u32>, detail: String },
    /// A request or a piece of state that cannot be served (wrong dtype, shape, buffer size).
    #[error("{}tensor {key:?}: {detail}", on(rank))]
    Request { rank: Option<u32>, key: String, detail: String },
    /// Requested keys that the checkpoint does not hold (the union over all ranks).
    #[error("{} requested keys are not stored: {}", keys.len(), keys.join(", "))]
    MissingKeys { keys: Vec<String> },
    /// Stored keys that no rank requested.
    #[error("{} stored keys were not requested by any rank: {}", keys.len(), keys.join(", "))]
    UnexpectedKeys { keys: Vec<String> },
    /// A storage operation failed.
    #[error("{}{error}", on(rank))]
    Storage { rank: Option<u32>, error: dckpt_storage::Error },
    /// This rank's collective failed (a dead or silent peer, a timeout). Each rank reports
    /// its own view: the collective is what would carry anything else.
    #[error(transparent)]
    Collective(#[from] dckpt_collective::Error),
    /// A failure on a rank that has no typed form here (its collective failed while it could
    /// still report, or a newer version sent a failure this one does not know).
    #[error("rank {rank}: {message}")]
    Rank { rank: u32, message: String },
    /// Ranks disagree about the protocol (a bug, or ranks running different versions).
    #[error("protocol: {detail}")]
    Protocol { detail: String },
}

fn on(rank: &Option<u32>) -> String {
    rank.map(|r| format!("rank {r}: ")).unwrap_or_default()
}

/// The ranks listed in a [`Error::ReplicasDiffer`] message; the rest are counted.
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
    let others = match more {
        0 => String::new(),
        n => format!("; {n} more replicated regions differ too"),
    };
    format!(
        "tensor {key:?} region {region}: replicas differ from the main copy on rank {main_rank} (crc {main_crc:#010x}): \
         {} {}; replicas must hold the same bytes (is this tensor split across ranks but described as replicas?){others}",
        if ranks.len() == 1 { "rank" } else { "ranks" },
        listed.join(", ")
    )
}

impl From<dckpt_storage::Error> for Error {
    fn from(error: dckpt_storage::Error) -> Self {
        Error::Storage { rank: None, error }
    }
}

impl From<FormatError> for Error {
    fn from(error: FormatError) -> Self {
        Error::Format { rank: None, error }
    }
}

impl From<ValidationError> for Error {
    fn from(error: ValidationError) -> Self {
        Error::InvalidState { rank: None, error }
    }
}

impl Error {
    /// The rank that saw the failure, where one did.
    pub fn rank(&self) -> Option<u32> {
        match self {
            Error::InvalidState { rank, .. }
            | Error::ReplicasDiffer { rank, .. }
            | Error::AlreadyExists { rank, .. }
            | Error::NotACheckpoint { rank, .. }
            | Error::CommitUncertain { rank, .. }
            | Error::Format { rank, .. }
            | Error::Checksum { rank, .. }
            | Error::Request { rank, .. }
            | Error::InvalidOptions { rank, .. }
            | Error::Storage { rank, .. } => *rank,
            Error::Rank { rank, .. } => Some(*rank),
            Error::MissingKeys { .. }
            | Error::UnexpectedKeys { .. }
            | Error::Collective(_)
            | Error::Protocol { .. } => None,
        }
    }

    /// Whether trying the same save or load again may succeed (a transient storage failure
    /// such as throttling, or a collective timeout).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Storage { error, .. } => error.is_transient(),
            _ => false,
        }
    }

    /// The same error as a new value, as another rank receives it.
    pub(crate) fn replicate(&self) -> Error {
        Error::from(Wire::from(self))
    }

    /// The same error, said to have been seen on `rank` (unless it already names one).
    pub(crate) fn on_rank(mut self, r: u32) -> Error {
        match &mut self {
            Error::InvalidState { rank, .. }
            | Error::ReplicasDiffer { rank, .. }
            | Error::AlreadyExists { rank, .. }
            | Error::NotACheckpoint { rank, .. }
            | Error::CommitUncertain { rank, .. }
            | Error::Format { rank, .. }
            | Error::Checksum { rank, .. }
            | Error::Request { rank, .. }
            | Error::InvalidOptions { rank, .. }
            | Error::Storage { rank, .. } => {
                rank.get_or_insert(r);
            }
            Error::Collective(e) => return Error::Rank { rank: r, message: e.to_string() },
            Error::Rank { .. } | Error::MissingKeys { .. } | Error::UnexpectedKeys { .. } | Error::Protocol { .. } => {}
        }
        self
    }
}

/// An [`Error`] as it travels between ranks.
#[derive(Serialize, Deserialize)]
enum Wire {
    InvalidState {
        rank: Option<u32>,
        error: ValidationError,
    },
    AlreadyExists {
        rank: Option<u32>,
        location: String,
    },
    NotACheckpoint {
        rank: Option<u32>,
        location: String,
    },
    CommitUncertain {
        rank: Option<u32>,
        location: String,
        detail: String,
    },
    Format {
        rank: Option<u32>,
        file: String,
        field: String,
        kind: FormatKindWire,
    },
    Checksum {
        rank: Option<u32>,
        file: String,
        offset: u64,
        detail: String,
    },
    Request {
        rank: Option<u32>,
        key: String,
        detail: String,
    },
    InvalidOptions {
        rank: Option<u32>,
        detail: String,
    },
    MissingKeys {
        keys: Vec<String>,
    },
    UnexpectedKeys {
        keys: Vec<String>,
    },
    Storage {
        rank: Option<u32>,
        error: StorageWire,
    },
    Rank {
        rank: u32,
        message: String,
    },
    Protocol {
        detail: String,
    },
    ReplicasDiffer {
        rank: Option<u32>,
        key: String,
        region: Box<Region>,
        main_rank: u32,
        main_crc: u32,
        ranks: Vec<u32>,
        crcs: Vec<u32>,
        more: u64,
    },
}

/// A [`FormatErrorKind`] as it travels between ranks.
#[derive(Serialize, Deserialize)]
enum FormatKindWire {
    NotMetadata,
    UnsupportedVersion {
        found: u32,
        supported: u32,
    },
    Damaged {
        detail: String,
    },
    Malformed {
        detail: String,
        offset: u64,
    },
    Invalid {
        detail: String,
    },
    LimitExceeded {
        what: String,
        found: u64,
        limit: u64,
    },
    /// A kind a newer format crate added.
    Other {
        detail: String,
    },
}

impl From<&FormatErrorKind> for FormatKindWire {
    fn from(k: &FormatErrorKind) -> Self {
        match k {
            FormatErrorKind::NotMetadata => FormatKindWire::NotMetadata,
            FormatErrorKind::UnsupportedVersion { found, supported } => {
                FormatKindWire::UnsupportedVersion { found: *found, supported: *supported }
            }
            FormatErrorKind::Damaged { detail } => FormatKindWire::Damaged { detail: detail.clone() },
            FormatErrorKind::Malformed { detail, offset } => {
                FormatKindWire::Malformed { detail: detail.clone(), offset: *offset }
            }
            FormatErrorKind::Invalid { detail } => FormatKindWire::Invalid { detail: detail.clone() },
            FormatErrorKind::LimitExceeded { what, found, limit } => {
                FormatKindWire::LimitExceeded { what: what.to_string(), found: *found, limit: *limit }
            }
            other => FormatKindWire::Other { detail: other.to_string() },
        }
    }
}

/// The units the format crate names in its limits, for the same reason as [`STORAGE_NAMES`].
const FORMAT_UNITS: &[&str] = &["bytes", "header bytes", "bytes per block"];

impl From<FormatKindWire> for FormatErrorKind {
    fn from(w: FormatKindWire) -> Self {
        match w {
            FormatKindWire::NotMetadata => FormatErrorKind::NotMetadata,
            FormatKindWire::UnsupportedVersion { found, supported } => {
                FormatErrorKind::UnsupportedVersion { found, supported }
            }
            FormatKindWire::Damaged { detail } => FormatErrorKind::Damaged { detail },
            FormatKindWire::Malformed { detail, offset } => FormatErrorKind::Malformed { detail, offset },
            FormatKindWire::Invalid { detail } => FormatErrorKind::Invalid { detail },
            FormatKindWire::LimitExceeded { what, found, limit } => match FORMAT_UNITS.iter().find(|u| **u == what) {
                Some(what) => FormatErrorKind::LimitExceeded { what, found, limit },
                None => FormatErrorKind::Invalid { detail: format!("{found} {what} exceeds the limit of {limit}") },
            },
            FormatKindWire::Other { detail } => FormatErrorKind::Invalid { detail },
        }
    }
}

/// A [`dckpt_storage::Error`] as it travels between ranks.
#[derive(Serialize, Deserialize)]
enum StorageWire {
    NotFound {
        path: String,
    },
    AlreadyExists {
        path: String,
    },
    Precondition {
        path: String,
        message: String,
    },
    InvalidPath {
        path: String,
        reason: String,
    },
    OutOfRange {
        path: String,
        start: u64,
        end: u64,
        size: u64,
    },
    Config {
        url: String,
        message: String,
    },
    WriterFailed {
        path: String,
    },
    Transient {
        path: String,
        op: String,
        message: String,
    },
    Permanent {
        path: String,
        op: String,
        message: String,
    },
    Injected {
        path: String,
        op_index: u64,
        seed: u64,
        kind: String,
        transient: bool,
    },
    /// A variant a newer storage crate added.
    Other {
        path: String,
        message: String,
    },
}

impl From<&dckpt_storage::Error> for StorageWire {
    fn from(e: &dckpt_storage::Error) -> Self {
        use dckpt_storage::Error as S;
        let s = |v: &str| v.to_string();
        match e {
            S::NotFound { path } => StorageWire::NotFound { path: s(path) },
            S::AlreadyExists { path } => StorageWire::AlreadyExists { path: s(path) },
            S::Precondition { path, message } => StorageWire::Precondition { path: s(path), message: s(message) },
            S::InvalidPath { path, reason } => StorageWire::InvalidPath { path: s(path), reason: s(reason) },
            S::OutOfRange { path, start, end, size } => {
                StorageWire::OutOfRange { path: s(path), start: *start, end: *end, size: *size }
            }
            S::Config { url, message } => StorageWire::Config { url: s(url), message: s(message) },
            S::WriterFailed { path } => StorageWire::WriterFailed { path: s(path) },
            S::Transient { path, op, source } => {
                StorageWire::Transient { path: s(path), op: s(op), message: source.to_string() }
            }
            S::Permanent { path, op, source } => {
                StorageWire::Permanent { path: s(path), op: s(op), message: source.to_string() }
            }
            S::Injected { path, op_index, seed, kind, transient } => StorageWire::Injected {
                path: s(path),
                op_index: *op_index,
                seed: *seed,
                kind: s(kind),
                transient: *transient,
            },
            other => StorageWire::Other { path: s(other.path()), message: other.to_string() },
        }
    }
}

/// The storage crate's operation, fault and invalid-path names, so that a rebuilt error carries
/// the same `&'static str` as the original; a name not in the list (a newer version's)
/// becomes [`UNKNOWN_NAME`].
const STORAGE_NAMES: &[&str] = &[
    "abort",
    "create",
    "create directory",
    "create root",
    "delete",
    "finish",
    "fsync directory",
    "get",
    "get_range",
    "get_ranges",
    "head",
    "list",
    "open",
    "put",
    "put_if_absent",
    "read",
    "rename",
    "stat",
    "write",
    "writer",
    "fail",
    "fail after effect",
    "throttle",
    "torn write",
    "bit flip",
    "empty path",
    "absolute path; paths are relative to the storage root",
    "backslash or control character",
    "empty segment",
    "`.` or `..` segment",
    "reserved temporary name",
];
const UNKNOWN_NAME: &str = "storage operation";

fn static_name(name: &str) -> &'static str {
    STORAGE_NAMES.iter().copied().find(|n| *n == name).unwrap_or(UNKNOWN_NAME)
}

impl From<StorageWire> for dckpt_storage::Error {
    fn from(w: StorageWire) -> Self {
        use dckpt_storage::Error as S;
        match w {
            StorageWire::NotFound { path } => S::NotFound { path },
            StorageWire::AlreadyExists { path } => S::AlreadyExists { path },
            StorageWire::Precondition { path, message } => S::Precondition { path, message },
            StorageWire::InvalidPath { path, reason } => S::InvalidPath { path, reason: static_name(&reason) },
            StorageWire::OutOfRange { path, start, end, size } => S::OutOfRange { path, start, end, size },
            StorageWire::Config { url, message } => S::Config { url, message },
            StorageWire::WriterFailed { path } => S::WriterFailed { path },
            StorageWire::Transient { path, op, message } => {
                S::Transient { path, op: static_name(&op), source: message.into() }
            }
            StorageWire::Permanent { path, op, message } => {
                S::Permanent { path, op: static_name(&op), source: message.into() }
            }
            StorageWire::Injected { path, op_index, seed, kind, transient } => {
                S::Injected { path, op_index, seed, kind: static_name(&kind), transient }
            }
            StorageWire::Other { path, message } => S::Permanent { path, op: UNKNOWN_NAME, source: message.into() },
        }
    }
}

impl From<&Error> for Wire {
    fn from(e: &Error) -> Self {
        match e {
            Error::InvalidState { rank, error } => Wire::InvalidState { rank: *rank, error: error.clone() },
            Error::AlreadyExists { rank, location } => Wire::AlreadyExists { rank: *rank, location: location.clone() },
            Error::ReplicasDiffer { rank, key, region, main_rank, main_crc, ranks, crcs, more } => {
                Wire::ReplicasDiffer {
                    rank: *rank,
                    key: key.clone(),
                    region: region.clone(),
                    main_rank: *main_rank,
                    main_crc: *main_crc,
                    ranks: ranks.clone(),
                    crcs: crcs.clone(),
                    more: *more,
                }
            }
            Error::NotACheckpoint { rank, location } => {
                Wire::NotACheckpoint { rank: *rank, location: location.clone() }
            }
            Error::CommitUncertain { rank, location, detail } => {
                Wire::CommitUncertain { rank: *rank, location: location.clone(), detail: detail.clone() }
            }
            Error::Format { rank, error } => Wire::Format {
                rank: *rank,
                file: error.file().to_string(),
                field: error.field().to_string(),
                kind: error.kind().into(),
            },
            Error::Checksum { rank, file, offset, detail } => {
                Wire::Checksum { rank: *rank, file: file.clone(), offset: *offset, detail: detail.clone() }
            }
            Error::Request { rank, key, detail } => {
                Wire::Request { rank: *rank, key: key.clone(), detail: detail.clone() }
            }
            Error::InvalidOptions { rank, detail } => Wire::InvalidOptions { rank: *rank, detail: detail.clone() },
            Error::MissingKeys { keys } => Wire::MissingKeys { keys: keys.clone() },
            Error::UnexpectedKeys { keys } => Wire::UnexpectedKeys { keys: keys.clone() },
            Error::Storage { rank, error } => Wire::Storage { rank: *rank, error: error.into() },
            Error::Collective(c) => Wire::Protocol { detail: c.to_string() },
            Error::Rank { rank, message } => Wire::Rank { rank: *rank, message: message.clone() },
            Error::Protocol { detail } => Wire::Protocol { detail: detail.clone() },
        }
    }
}

impl From<Wire> for Error {
    fn from(w: Wire) -> Self {
        match w {
            Wire::InvalidState { rank, error } => Error::InvalidState { rank, error },
            Wire::AlreadyExists { rank, location } => Error::AlreadyExists { rank, location },
            Wire::ReplicasDiffer { rank, key, region, main_rank, main_crc, ranks, crcs, more } => {
                Error::ReplicasDiffer { rank, key, region, main_rank, main_crc, ranks, crcs, more }
            }
            Wire::NotACheckpoint { rank, location } => Error::NotACheckpoint { rank, location },
            Wire::CommitUncertain { rank, location, detail } => Error::CommitUncertain { rank, location, detail },
            Wire::Format { rank, file, field, kind } => {
                Error::Format { rank, error: FormatError::new(&file, field, kind.into()) }
            }
            Wire::Checksum { rank, file, offset, detail } => Error::Checksum { rank, file, offset, detail },
            Wire::Request { rank, key, detail } => Error::Request { rank, key, detail },
            Wire::InvalidOptions { rank, detail } => Error::InvalidOptions { rank, detail },
            Wire::MissingKeys { keys } => Error::MissingKeys { keys },
            Wire::UnexpectedKeys { keys } => Error::UnexpectedKeys { keys },
            Wire::Storage { rank, error } => Error::Storage { rank, error: error.into() },
            Wire::Rank { rank, message } => Error::Rank { rank, message },
            Wire::Protocol { detail } => Error::Protocol { detail },
        }
    }
}

impl Serialize for Error {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        Wire::from(self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Error {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Wire::deserialize(d).map(Error::from)
    }
}

/// The results of every rank, in rank order, as one: all the values, or the first failure,
/// stamped with the rank that had it.
pub(crate) fn first_failure<T>(all: Vec<Result<T>>) -> Result<Vec<T>> {
    all.into_iter().enumerate().map(|(r, res)| res.map_err(|e| e.on_rank(r as u32))).collect()
}

#[cfg(test)]
mod tests {
    use dckpt_shard_spec::Problem;

    use super::*;
    use crate::protocol::{decode, encode};

    fn sample() -> Vec<Error> {
        use dckpt_storage::Error as S;
        let storage = |error| Error::Storage { rank: Some(3), error };
        vec![
            Error::InvalidState {
                rank: Some(0),
                error: ValidationError { problems: vec![Problem::MissingTensor { key: "w".into() }], more: 2 },
            },
            Error::AlreadyExists { rank: Some(0), location: "/x/dckpt.meta".into() },
            Error::ReplicasDiffer {
                rank: Some(0),
                key: "decoder.experts.fc1".into(),
                region: Box::new(Region::boxed([0, 0], [64, 128])),
                main_rank: 0,
                main_crc: 0xdead_beef,
                ranks: vec![1, 3],
                crcs: vec![1, 2],
                more: 4,
            },
            Error::NotACheckpoint { rank: None, location: "s3://b/p".into() },
            Error::CommitUncertain { rank: Some(0), location: "l".into(), detail: "d".into() },
            Error::Format {
                rank: Some(1),
                error: FormatError::new(
                    "f",
                    "tensors[0]",
                    FormatErrorKind::Malformed { detail: "bad".into(), offset: 9 },
                ),
            },
            Error::Format {
                rank: Some(0),
                error: FormatError::new(
                    "f",
                    "format_version",
                    FormatErrorKind::UnsupportedVersion { found: 2, supported: 1 },
                ),
            },
            Error::Format {
                rank: Some(0),
                error: FormatError::new(
                    "f",
                    "block_bytes",
                    FormatErrorKind::LimitExceeded { what: "bytes per block", found: 9, limit: 8 },
                ),
            },
            Error::Checksum { rank: Some(2), file: "f".into(), offset: 7, detail: "d".into() },
            Error::Request { rank: Some(1), key: "k".into(), detail: "d".into() },
            Error::InvalidOptions { rank: Some(0), detail: "d".into() },
            Error::MissingKeys { keys: vec!["a".into()] },
            Error::UnexpectedKeys { keys: vec!["b".into()] },
            storage(S::NotFound { path: "p".into() }),
            storage(S::InvalidPath { path: "p".into(), reason: "empty segment" }),
            storage(S::OutOfRange { path: "p".into(), start: 1, end: 9, size: 4 }),
            storage(S::Transient { path: "p".into(), op: "put", source: "slow down".into() }),
            storage(S::Permanent { path: "p".into(), op: "rename", source: "denied".into() }),
            storage(S::Injected { path: "p".into(), op_index: 4, seed: 9, kind: "torn write", transient: false }),
            Error::Rank { rank: 5, message: "m".into() },
            Error::Protocol { detail: "p".into() },
        ]
    }

    /// Every variant reaches another rank as the same variant with the same text.
    #[test]
    fn errors_cross_ranks_unchanged() {
        for e in sample() {
            let back: Error = decode(&encode(&e), "error").unwrap();
            assert_eq!(std::mem::discriminant(&back), std::mem::discriminant(&e), "{e:?} became {back:?}");
            assert_eq!(back.to_string(), e.to_string());
            assert_eq!(back.rank(), e.rank());
            assert_eq!(back.is_transient(), e.is_transient(), "{e}");
            if let (Error::Storage { error: a, .. }, Error::Storage { error: b, .. }) = (&e, &back) {
                assert_eq!(std::mem::discriminant(a), std::mem::discriminant(b), "{a:?} became {b:?}");
            }
            if let (Error::Format { error: a, .. }, Error::Format { error: b, .. }) = (&e, &back) {
                assert_eq!(a, b);
            }
        }
    }

    /// The first failing rank is the one every rank reports; a rank already named stays named.
    #[test]
    fn the_first_failure_is_stamped_with_its_rank() {
        let all: Vec<Result<u8>> = vec![
            Ok(1),
            Err(Error::Checksum { rank: None, file: "f".into(), offset: 0, detail: "d".into() }),
            Err(Error::Protocol { detail: "later".into() }),
        ];
        assert!(matches!(first_failure(all), Err(Error::Checksum { rank: Some(1), .. })));
        let named = Error::AlreadyExists { rank: Some(0), location: "l".into() }.on_rank(4);
        assert_eq!(named.rank(), Some(0));
    }
}
