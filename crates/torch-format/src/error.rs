//! The error type is `dckpt-format`'s [`FormatError`] (built with its `invalid`, `damaged`
//! and `malformed` constructors), so that a caller tells damage, a bad encoding and an
//! inconsistency apart the same way in dckpt's files and PyTorch's.

pub(crate) use dckpt_format::FormatError;
