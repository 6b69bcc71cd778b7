//! What can be wrong with a metadata file or a data file's header.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

/// A metadata file (or a data file's header) that this crate refuses: which file, which
/// field, and why ([`FormatError::kind`]).
///
/// Displayed as `<file>: <field>: <what is wrong>`. The field is a path into the decoded
/// structure, such as `tensors[3].chunks[0].offset[1]` or, for semantic checks, one that
/// names the key too (`tensors[3] (decoder.w).chunks[0].at`); the framing's fields are
/// `length`, `magic`, `format_version`, `body_length` and `crc32`, and the body as a whole
/// is `body`.
///
/// Serializable, so that it can be sent to another process as it is and read back equal.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{file}: {field}: {kind}")]
pub struct FormatError {
    file: String,
    field: String,
    kind: FormatErrorKind,
}

/// Why a file was refused, one variant per kind of failure, so that a caller can tell a
/// checkpoint written by a newer dckpt ([`UnsupportedVersion`](Self::UnsupportedVersion))
/// or some other file ([`NotMetadata`](Self::NotMetadata)) from a damaged one
/// ([`Damaged`](Self::Damaged)) or a crafted or buggy one ([`Malformed`](Self::Malformed),
/// [`Invalid`](Self::Invalid)). Its `Display` is the detail of the error's message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum FormatErrorKind {
    /// The file does not start with the metadata magic: it is some other file.
    #[error("not a dckpt metadata file")]
    NotMetadata,
    /// The framing declares a format version this build does not read: a newer (or an
    /// unknown) writer. Nothing after the version was interpreted.
    #[error("version {found} is not supported (this build reads {supported})")]
    UnsupportedVersion {
        /// The version the file declares.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// The bytes are not the ones that were written: the file is cut short or longer than
    /// its framing says, or its checksum does not match.
    #[error("{detail}")]
    Damaged {
        /// What does not match.
        detail: String,
    },
    /// The checksum holds but the bytes are not a valid encoding: a MessagePack value of
    /// the wrong type, a missing or repeated field, a length past the end, invalid UTF-8,
    /// a negative or oversized integer, bytes after the value (or, in a safetensors
    /// header, invalid JSON).
    #[error("{detail} (at byte {offset})")]
    Malformed {
        /// What is wrong.
        detail: String,
        /// Byte offset in the file where it was found (or where the value holding it
        /// starts).
        offset: u64,
    },
    /// Decoded but inconsistent: a file name outside the checkpoint, a chunk outside its
    /// tensor or file, bytes under no checksum, keys out of order, coverage that is not
    /// exactly once, ...
    #[error("{detail}")]
    Invalid {
        /// What is inconsistent.
        detail: String,
    },
    /// A size beyond what this reader accepts.
    #[error("{found} {what} exceeds the limit of {limit}")]
    LimitExceeded {
        /// The unit of `found` and `limit`, e.g. `bytes`.
        what: Cow<'static, str>,
        /// The size found.
        found: u64,
        /// The largest size accepted.
        limit: u64,
    },
}

impl FormatError {
    /// An error about `field` of `file`.
    pub fn new(file: &str, field: impl Into<String>, kind: FormatErrorKind) -> FormatError {
        FormatError { file: file.to_string(), field: field.into(), kind }
    }

    /// The file refused, as the caller named it.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// Where in the file: a field path (see [`FormatError`]).
    pub fn field(&self) -> &str {
        &self.field
    }

    /// Why.
    pub fn kind(&self) -> &FormatErrorKind {
        &self.kind
    }

    /// An inconsistency ([`FormatErrorKind::Invalid`]) in `file` at `field`.
    pub fn invalid(file: &str, field: impl Into<String>, detail: impl Into<String>) -> FormatError {
        FormatError::new(file, field, FormatErrorKind::Invalid { detail: detail.into() })
    }

    /// Damage, a checksum that does not match ([`FormatErrorKind::Damaged`]), in `file` at `field`.
    pub fn damaged(file: &str, field: impl Into<String>, detail: impl Into<String>) -> FormatError {
        FormatError::new(file, field, FormatErrorKind::Damaged { detail: detail.into() })
    }

    /// A bad encoding ([`FormatErrorKind::Malformed`]) in `file` at `field`, `offset` bytes in.
    pub fn malformed(file: &str, field: impl Into<String>, detail: impl Into<String>, offset: u64) -> FormatError {
        FormatError::new(file, field, FormatErrorKind::Malformed { detail: detail.into(), offset })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error read back is equal to the one sent, limits' units included.
    #[test]
    fn errors_round_trip_equal() {
        for kind in [
            FormatErrorKind::NotMetadata,
            FormatErrorKind::UnsupportedVersion { found: 2, supported: 1 },
            FormatErrorKind::Malformed { detail: "bad".into(), offset: 9 },
            FormatErrorKind::LimitExceeded { what: "layout entries".into(), found: 9, limit: 8 },
        ] {
            let e = FormatError::new("f", "layout", kind);
            let back: FormatError = serde_json::from_str(&serde_json::to_string(&e).unwrap()).unwrap();
            assert_eq!(back, e);
            assert_eq!(back.to_string(), e.to_string());
        }
    }
}
