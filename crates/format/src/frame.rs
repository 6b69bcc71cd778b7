//! The metadata file's framing: a fixed prefix (magic, version, reserved, body length),
//! the body, and a CRC-32 of everything before it.
//!
//! ```text
//! [0, 8)        magic "DCKPTMD\0"
//! [8, 12)       version, u32 LE
//! [12, 16)      reserved, u32 LE, written as 0
//! [16, 24)      body length n, u64 LE
//! [24, 24 + n)  body
//! [24 + n, +4)  CRC-32 of [0, 24 + n), u32 LE
//! ```

use crate::error::{FormatError, FormatErrorKind};

/// First 8 bytes of the metadata file.
pub const META_MAGIC: [u8; 8] = *b"DCKPTMD\0";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Fixed bytes before the body: magic, version, reserved, body length.
pub const META_PREFIX_BYTES: usize = 24;
/// The largest metadata file a reader accepts.
pub const META_BYTES_MAX: u64 = 1 << 30;

/// The metadata file around `body`: the prefix with [`FORMAT_VERSION`], the body, the
/// CRC-32.
pub fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = begin(body.len());
    out.extend_from_slice(body);
    finish(out)
}

/// Refuses a metadata file of `len` bytes above [`META_BYTES_MAX`]: a reader asks the
/// storage for the file's size and calls this before it reads the file, so that an
/// oversized (or sparse) file costs no memory. [`unframe`] checks the same.
pub fn check_meta_bytes(len: u64, file: &str) -> Result<(), FormatError> {
    if len > META_BYTES_MAX {
        let kind = FormatErrorKind::LimitExceeded { what: "bytes".into(), found: len, limit: META_BYTES_MAX };
        return Err(FormatError::new(file, "length", kind));
    }
    Ok(())
}

/// The smallest metadata file: the prefix and the CRC-32, around an empty body.
const META_BYTES_MIN: usize = META_PREFIX_BYTES + 4;

/// The body inside a metadata file, its framing checked in this order: the size limit,
/// the prefix's length, the magic, the version (before anything whose meaning a newer
/// version could change), the length of prefix and CRC, the body length, the CRC-32.
/// `file` names it in errors.
pub fn unframe<'b>(bytes: &'b [u8], file: &str) -> Result<&'b [u8], FormatError> {
    check_meta_bytes(bytes.len() as u64, file)?;
    let short = || {
        FormatError::damaged(
            file,
            "length",
            format!("{} bytes is shorter than the {META_BYTES_MIN} bytes of the prefix and the CRC", bytes.len()),
        )
    };
    let Some(prefix) = bytes.get(..META_PREFIX_BYTES) else {
        // A cut-short metadata file still starts with (part of) the magic; other files do not.
        let n = bytes.len().min(META_MAGIC.len());
        if bytes[..n] != META_MAGIC[..n] {
            return Err(FormatError::new(file, "magic", FormatErrorKind::NotMetadata));
        }
        return Err(short());
    };
    if prefix[..8] != META_MAGIC {
        return Err(FormatError::new(file, "magic", FormatErrorKind::NotMetadata));
    }
    let version = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]);
    if version != FORMAT_VERSION {
        let kind = FormatErrorKind::UnsupportedVersion { found: version, supported: FORMAT_VERSION };
        return Err(FormatError::new(file, "format_version", kind));
    }
    if bytes.len() < META_BYTES_MIN {
        return Err(short());
    }
    let mut len = [0; 8];
    len.copy_from_slice(&prefix[16..24]);
    let body_len = u64::from_le_bytes(len);
    let expect_total = (META_PREFIX_BYTES as u64).checked_add(body_len).and_then(|n| n.checked_add(4));
    if expect_total != Some(bytes.len() as u64) {
        // The file's length against the length the prefix implies, so like is told with like.
        let says = match expect_total {
            Some(total) => format!("a {total}-byte file"),
            None => "a file longer than any".into(),
        };
        let detail = format!("says a {body_len}-byte body, so {says}, but the file has {} bytes", bytes.len());
        return Err(FormatError::damaged(file, "body_length", detail));
    }
    let crc_at = bytes.len() - 4;
    let stored = u32::from_le_bytes([bytes[crc_at], bytes[crc_at + 1], bytes[crc_at + 2], bytes[crc_at + 3]]);
    let actual = crc32fast::hash(&bytes[..crc_at]);
    if stored != actual {
        return Err(FormatError::damaged(
            file,
            "crc32",
            format!("stored {stored:08x}, computed {actual:08x}: the file is damaged"),
        ));
    }
    Ok(&bytes[META_PREFIX_BYTES..crc_at])
}

/// A metadata file's prefix, its body length left to [`finish`], with room for a body of
/// about `body_guess` bytes: the encoder writes the body in place after it.
pub(crate) fn begin(body_guess: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(META_PREFIX_BYTES + body_guess + 4);
    out.extend_from_slice(&META_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&[0; 8]);
    out
}

/// Fills in the body length of a file [`begin`] started and appends its CRC-32.
pub(crate) fn finish(mut out: Vec<u8>) -> Vec<u8> {
    let body_len = (out.len() - META_PREFIX_BYTES) as u64;
    out[16..24].copy_from_slice(&body_len.to_le_bytes());
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(bytes: &[u8]) -> (String, FormatErrorKind) {
        let e = unframe(bytes, "m").expect_err("refused");
        assert_eq!(e.file(), "m");
        (e.field().to_string(), e.kind().clone())
    }

    #[test]
    fn frame_and_unframe_are_inverse() {
        for body in [&b""[..], b"\x80", &[7; 1000]] {
            let f = frame(body);
            assert_eq!(f.len(), META_PREFIX_BYTES + body.len() + 4);
            assert_eq!(f[..8], META_MAGIC);
            assert_eq!(f[12..16], [0; 4], "reserved");
            assert_eq!(unframe(&f, "m"), Ok(body));
        }
    }

    #[test]
    fn the_size_limit_is_checked_from_the_size_alone() {
        assert_eq!(check_meta_bytes(META_BYTES_MAX, "m"), Ok(()));
        let e = check_meta_bytes(META_BYTES_MAX + 1, "m").unwrap_err();
        assert_eq!(e.field(), "length");
        assert_eq!(
            e.kind(),
            &FormatErrorKind::LimitExceeded { what: "bytes".into(), found: META_BYTES_MAX + 1, limit: META_BYTES_MAX }
        );
    }

    #[test]
    fn each_framing_failure_has_its_kind() {
        let good = frame(b"\x80");
        let damaged = |d: &str| FormatErrorKind::Damaged { detail: d.to_string() };
        let short = |n: usize| damaged(&format!("{n} bytes is shorter than the 28 bytes of the prefix and the CRC"));
        assert_eq!(kind(&[]), ("length".into(), short(0)));
        assert_eq!(kind(&good[..5]).1, short(5));
        assert_eq!(kind(&good[..23]).1, short(23));
        // The prefix alone, or with part of the CRC: too short for any body, even an empty one.
        for n in 24..28 {
            assert_eq!(kind(&good[..n]), ("length".into(), short(n)));
        }
        assert_eq!(unframe(&frame(b""), "m"), Ok(&b""[..]), "28 bytes: an empty body");
        assert_eq!(kind(b"PK\x03\x04"), ("magic".into(), FormatErrorKind::NotMetadata));
        let mut b = good.clone();
        b[0] ^= 1;
        assert_eq!(kind(&b), ("magic".into(), FormatErrorKind::NotMetadata));
        // A newer version is told apart from damage even when the rest would not check out.
        let mut b = good[..META_PREFIX_BYTES].to_vec();
        b[8] = 2;
        assert_eq!(
            kind(&b),
            ("format_version".into(), FormatErrorKind::UnsupportedVersion { found: 2, supported: FORMAT_VERSION })
        );
        // A 1-byte body makes a 29-byte file: the message compares file with file.
        assert_eq!(
            kind(&good[..good.len() - 1]),
            ("body_length".into(), damaged("says a 1-byte body, so a 29-byte file, but the file has 28 bytes"))
        );
        let mut b = good.clone();
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            kind(&b),
            (
                "body_length".into(),
                damaged(&format!(
                    "says a {}-byte body, so a file longer than any, but the file has 29 bytes",
                    u64::MAX
                ))
            )
        );
        let mut b = good.clone();
        b[13] ^= 0x80; // reserved: only the CRC covers it
        let (field, k) = kind(&b);
        assert_eq!(field, "crc32");
        assert!(matches!(&k, FormatErrorKind::Damaged { detail } if detail.contains("damaged")), "{k:?}");
    }
}
