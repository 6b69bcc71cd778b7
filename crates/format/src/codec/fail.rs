//! A failure deep in the body, as values, and the path to it collected on the way out.

use std::fmt::Write as _;

use crate::error::{FormatError, FormatErrorKind};
use crate::frame::META_PREFIX_BYTES;

/// A failure deep in the body, with the path to it collected on the way out.
#[derive(Debug)]
pub(crate) struct Fail {
    /// Innermost first: each level adds itself as the failure passes through it, so the
    /// path costs nothing unless something fails.
    path: Vec<Seg>,
    why: Why,
    /// Byte offset in the body.
    at: usize,
}

/// What went wrong, as values: words are made only for the error that is returned, so
/// the reader's hot paths carry no formatting.
#[derive(Debug)]
pub(super) enum Why {
    Ended,
    PastEnd {
        n: usize,
        left: usize,
    },
    LengthTooLarge(u64),
    /// Expected this, found a value starting with marker `m`.
    Expected {
        what: &'static str,
        m: u8,
    },
    Negative(i64),
    Over32Bits(u64),
    NotUtf8(std::str::Utf8Error),
    ArrayTooLong {
        n: usize,
        /// The fewest bytes an item takes.
        min: usize,
        left: usize,
    },
    MapTooLong {
        n: usize,
        left: usize,
    },
    BadValue,
    UnknownDtype(String),
    FlatLength(usize),
    Twice,
    Missing,
    KeyTwice(String),
    Trailing(usize),
    /// More than this reader accepts: not malformed, a limit.
    Limit {
        what: &'static str,
        found: u64,
        limit: u64,
    },
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::Ended => write!(f, "the body ends inside a value"),
            Why::PastEnd { n, left } => write!(f, "{n} bytes declared, {left} left in the body"),
            Why::LengthTooLarge(v) => write!(f, "a length of {v} does not fit this machine"),
            Why::Expected { what: want, m } => write!(f, "expected {want}, found {} (marker {m:#04x})", what(*m)),
            Why::Negative(v) => write!(f, "{v} is negative; expected an unsigned integer"),
            Why::Over32Bits(v) => write!(f, "{v} does not fit in 32 bits"),
            Why::NotUtf8(e) => write!(f, "the string is not UTF-8: {e}"),
            Why::ArrayTooLong { n, min, left } => {
                write!(f, "an array of {n} items of at least {min} bytes each in the {left} bytes left")
            }
            Why::MapTooLong { n, left } => write!(f, "a map of {n} entries in the {left} bytes left"),
            Why::BadValue => write!(f, "a value that is truncated or not MessagePack"),
            Why::UnknownDtype(name) => write!(f, "unknown dtype {name:?}"),
            Why::FlatLength(n) => write!(f, "expected [start, stop], found an array of {n} items"),
            Why::Twice => write!(f, "appears twice"),
            Why::Missing => write!(f, "missing"),
            Why::KeyTwice(k) => write!(f, "the key {k:?} appears twice"),
            Why::Trailing(n) => write!(f, "{n} bytes follow the metadata"),
            Why::Limit { what, found, limit } => write!(f, "{found} {what} exceeds the limit of {limit}"),
        }
    }
}

/// One level of a failure's path.
#[derive(Debug)]
pub(super) enum Seg {
    Field(&'static str),
    /// A field this version does not know, named as it was written.
    Unknown(String),
    Index(usize),
}

/// What every read of the body returns. The failure is boxed, so that the success path of
/// every small read moves one word of error.
pub(crate) type ReadResult<T> = Result<T, Box<Fail>>;

impl Fail {
    /// The error for a metadata file `file` whose body this was.
    pub(crate) fn into_error(self, file: &str) -> FormatError {
        let mut field = String::new();
        for seg in self.path.iter().rev() {
            match seg {
                Seg::Field(name) if field.is_empty() => field.push_str(name),
                Seg::Field(name) => {
                    let _ = write!(field, ".{name}");
                }
                Seg::Unknown(name) if field.is_empty() => field.push_str(name),
                Seg::Unknown(name) => {
                    let _ = write!(field, ".{name}");
                }
                Seg::Index(i) => {
                    let _ = write!(field, "[{i}]");
                }
            }
        }
        if field.is_empty() {
            field.push_str("body");
        }
        if let Why::Limit { what, found, limit } = self.why {
            return FormatError::new(file, field, FormatErrorKind::LimitExceeded { what: what.into(), found, limit });
        }
        FormatError::malformed(file, field, self.why.to_string(), (META_PREFIX_BYTES + self.at) as u64)
    }
}

#[inline]
pub(super) fn fail<T>(at: usize, why: Why) -> ReadResult<T> {
    Err(boxed(at, why))
}

#[cold]
#[inline(never)]
fn boxed(at: usize, why: Why) -> Box<Fail> {
    Box::new(Fail { path: Vec::new(), why, at })
}

/// Adds a level to the path of a failure on its way out.
pub(super) trait Within<T> {
    fn within(self, seg: impl FnOnce() -> Seg) -> ReadResult<T>;
}

impl<T> Within<T> for ReadResult<T> {
    #[inline]
    fn within(self, seg: impl FnOnce() -> Seg) -> ReadResult<T> {
        match self {
            Ok(v) => Ok(v),
            Err(e) => Err(push_seg(e, seg())),
        }
    }
}

#[cold]
#[inline(never)]
fn push_seg(mut e: Box<Fail>, seg: Seg) -> Box<Fail> {
    e.path.push(seg);
    e
}

/// What a MessagePack marker starts, for errors.
fn what(m: u8) -> &'static str {
    match m {
        0x00..=0x7f | 0xcc..=0xcf => "an unsigned integer",
        0xe0..=0xff | 0xd0..=0xd3 => "a signed integer",
        0x80..=0x8f | 0xde | 0xdf => "a map",
        0x90..=0x9f | 0xdc | 0xdd => "an array",
        0xa0..=0xbf | 0xd9..=0xdb => "a string",
        0xc0 => "nil",
        0xc1 => "the unused marker 0xc1",
        0xc2 | 0xc3 => "a boolean",
        0xc4..=0xc6 => "binary",
        0xca | 0xcb => "a float",
        0xc7..=0xc9 | 0xd4..=0xd8 => "an extension value",
    }
}
