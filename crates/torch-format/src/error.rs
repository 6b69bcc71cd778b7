//! Shorthands for the [`FormatError`]s this crate returns: the error type is
//! `dckpt-format`'s, so that a caller tells damage, a bad encoding and an inconsistency
//! apart the same way in dckpt's files and PyTorch's.

pub(crate) use dckpt_format::FormatError;
use dckpt_format::FormatErrorKind;

/// A [`FormatErrorKind::Invalid`] error.
pub(crate) fn invalid(file: &str, field: impl Into<String>, detail: impl Into<String>) -> FormatError {
    FormatError::new(file, field, FormatErrorKind::Invalid { detail: detail.into() })
}

/// A [`FormatErrorKind::Damaged`] error.
pub(crate) fn damaged(file: &str, field: impl Into<String>, detail: impl Into<String>) -> FormatError {
    FormatError::new(file, field, FormatErrorKind::Damaged { detail: detail.into() })
}

/// A [`FormatErrorKind::Malformed`] error.
pub(crate) fn malformed(file: &str, field: impl Into<String>, detail: impl Into<String>, offset: u64) -> FormatError {
    FormatError::new(file, field, FormatErrorKind::Malformed { detail: detail.into(), offset })
}
