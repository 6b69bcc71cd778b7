//! Safetensors headers (`docs/format.md`, section 2): the writer of a data file's header,
//! and a parser of one for readers that check it against the metadata.
//!
//! A header is `[0, 8)` the JSON's length `n` (u64 LE), then `n` bytes of JSON padded with
//! spaces so that the data section starts 8-aligned at `8 + n`: an object with an optional
//! `"__metadata__"` (strings to strings) and one entry per tensor, each with `dtype`,
//! `shape` and `data_offsets` `[begin, end]` relative to the data section.

use std::collections::BTreeMap;

use dckpt_shard_spec::{DType, Dims, Region};
use serde::Deserialize;

use crate::error::{FormatError, FormatErrorKind};

/// The longest header [`parse_safetensors_header`] reads: the limit the `safetensors`
/// package itself sets.
pub const SAFETENSORS_HEADER_BYTES_MAX: u64 = 100_000_000;

/// One tensor entry of a safetensors header to write.
#[derive(Clone, Debug)]
pub struct SafetensorsEntry {
    /// The entry's name ([`chunk_entry_name`] for a chunk, `<key>@object[...]` for an object).
    pub name: String,
    /// Its dtype, written as its safetensors name.
    pub dtype: DType,
    /// Its shape.
    pub shape: Dims,
    /// Its length in bytes.
    pub len: u64,
}

/// A safetensors header for `entries` laid out back to back, padded with spaces so the
/// data section starts 8-aligned. Returns the bytes of `[0, data_start)`.
pub fn safetensors_header(entries: &[SafetensorsEntry], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    // Written by hand, in file order, after the 8 bytes of its length: a data file can hold
    // tens of thousands of entries.
    let mut out = Vec::with_capacity(72 + entries.iter().map(|e| e.name.len() + 72).sum::<usize>());
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(b"{\"__metadata__\":");
    out.extend_from_slice(serde_json::to_string(metadata).expect("string map").as_bytes());
    let mut at = 0u64;
    for e in entries {
        out.push(b',');
        push_json_string(&mut out, &e.name);
        out.extend_from_slice(b":{\"dtype\":\"");
        out.extend_from_slice(e.dtype.safetensors_name().as_bytes());
        out.extend_from_slice(b"\",\"shape\":[");
        for (i, d) in e.shape.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            push_u64(&mut out, *d);
        }
        out.extend_from_slice(b"],\"data_offsets\":[");
        push_u64(&mut out, at);
        out.push(b',');
        at += e.len;
        push_u64(&mut out, at);
        out.extend_from_slice(b"]}");
    }
    out.push(b'}');
    while out.len() % 8 != 0 {
        out.push(b' ');
    }
    let n = out.len() as u64 - 8;
    out[..8].copy_from_slice(&n.to_le_bytes());
    out
}

/// `s` as a JSON string, escaped as `serde_json` escapes it.
fn push_json_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let bytes = s.as_bytes();
    // Names almost never need an escape: one pass over every byte (without an early exit,
    // so it vectorizes), then one copy.
    if !bytes.iter().fold(false, |found, &c| found | (c < 0x20) | (c == b'"') | (c == b'\\')) {
        out.extend_from_slice(bytes);
        out.push(b'"');
        return;
    }
    // Runs that need no escape are copied whole.
    let mut run = 0;
    for (i, &c) in bytes.iter().enumerate() {
        let escaped: &[u8] = match c {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..0x20 => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[run..i]);
        run = i + 1;
        if escaped.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(&[b'\\', b'u', b'0', b'0', HEX[usize::from(c >> 4)], HEX[usize::from(c & 15)]]);
        } else {
            out.extend_from_slice(escaped);
        }
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

/// `key@region`, the name of a chunk's entry in its data file's header: what
/// `format!("{key}@{region}")` writes, without the formatting machinery (a file can hold
/// tens of thousands of entries).
pub fn chunk_entry_name(key: &str, region: &Region) -> String {
    let mut out = Vec::with_capacity(key.len() + 3 + 24 * region.offset.len());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"@[");
    for (i, (o, s)) in region.offset.iter().zip(&region.shape).enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        push_u64(&mut out, *o);
        out.push(b':');
        push_u64(&mut out, o.saturating_add(*s));
    }
    out.push(b']');
    if let Some(r) = region.flat {
        out.extend_from_slice(b" flat[");
        push_u64(&mut out, r.start);
        out.push(b':');
        push_u64(&mut out, r.stop);
        out.push(b')');
    }
    String::from_utf8(out).expect("a str and ASCII")
}

/// `v` in decimal.
fn push_u64(out: &mut Vec<u8>, mut v: u64) {
    // Two digits at a time from a table of "00" to "99".
    const PAIRS: [u8; 200] = {
        let mut t = [0u8; 200];
        let mut i = 0;
        while i < 100 {
            t[2 * i] = b'0' + (i / 10) as u8;
            t[2 * i + 1] = b'0' + (i % 10) as u8;
            i += 1;
        }
        t
    };
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    while v >= 100 {
        let p = (v % 100) as usize * 2;
        v /= 100;
        i -= 2;
        digits[i..i + 2].copy_from_slice(&PAIRS[p..p + 2]);
    }
    if v >= 10 {
        let p = v as usize * 2;
        i -= 2;
        digits[i..i + 2].copy_from_slice(&PAIRS[p..p + 2]);
    } else {
        i -= 1;
        digits[i] = b'0' + v as u8;
    }
    out.extend_from_slice(&digits[i..]);
}

/// A parsed safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SafetensorsHeader {
    /// Where the data section starts: 8 + the declared JSON length.
    pub data_start: u64,
    /// The `"__metadata__"` entry (empty when there is none).
    pub metadata: BTreeMap<String, String>,
    /// The tensor entries, sorted by name.
    pub entries: Vec<HeaderEntry>,
}

/// One tensor entry of a parsed safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderEntry {
    /// The entry's name.
    pub name: String,
    /// Its dtype's safetensors name (`BF16`, ...), kept as written: safetensors has dtypes
    /// that dckpt does not.
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// `[begin, end)` of its bytes, relative to the data section; `begin <= end`.
    pub data_offsets: [u64; 2],
}

/// An entry as JSON; fields other writers add are ignored.
#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// Parses the safetensors header at the start of `bytes` (the header alone, or more of
/// the file: only the declared header is read). `file` names the data file in errors,
/// which are [`FormatErrorKind::Malformed`] (field `header`, or `header.<entry name>`) or,
/// for a header longer than [`SAFETENSORS_HEADER_BYTES_MAX`],
/// [`FormatErrorKind::LimitExceeded`]. Entries are parsed, not checked against each other
/// or against a metadata file.
pub fn parse_safetensors_header(bytes: &[u8], file: &str) -> Result<SafetensorsHeader, FormatError> {
    let Some(len) = bytes.get(..8) else {
        return Err(FormatError::malformed(
            file,
            "header",
            format!("{} bytes, shorter than the 8-byte length", bytes.len()),
            0,
        ));
    };
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    if n > SAFETENSORS_HEADER_BYTES_MAX {
        let kind = FormatErrorKind::LimitExceeded {
            what: "header bytes".into(),
            found: n,
            limit: SAFETENSORS_HEADER_BYTES_MAX,
        };
        return Err(FormatError::new(file, "header", kind));
    }
    // Within the limit, so it fits `usize` wherever 100 MB does.
    let json = usize::try_from(n).ok().and_then(|n| bytes.get(8..8 + n)).ok_or_else(|| {
        FormatError::malformed(file, "header", format!("declares {n} bytes of JSON, {} are there", bytes.len() - 8), 0)
    })?;
    let map: BTreeMap<String, serde_json::Value> = serde_json::from_slice(json)
        .map_err(|e| FormatError::malformed(file, "header", format!("not a JSON object: {e}"), 8))?;
    let mut header = SafetensorsHeader { data_start: 8 + n, metadata: BTreeMap::new(), entries: Vec::new() };
    for (name, value) in map {
        let bad = |e: serde_json::Error| FormatError::malformed(file, format!("header.{name}"), e.to_string(), 8);
        if name == "__metadata__" {
            header.metadata = serde_json::from_value(value).map_err(bad)?;
            continue;
        }
        let raw: RawEntry = serde_json::from_value(value).map_err(bad)?;
        let [begin, end] = raw.data_offsets;
        if begin > end {
            return Err(FormatError::malformed(
                file,
                format!("header.{name}.data_offsets"),
                format!("[{begin}, {end}] runs backwards"),
                8,
            ));
        }
        header.entries.push(HeaderEntry { name, dtype: raw.dtype, shape: raw.shape, data_offsets: raw.data_offsets });
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dckpt_shard_spec::FlatRange;

    #[test]
    fn header_strings_and_numbers_are_written_as_serde_json_writes_them() {
        for name in ["", "plain.key@[0:2, 4:8]", "q\"uote\\back", "ctl\u{0}\u{1f}\n\r\t\u{8}\u{c}", "é∂ ☃ \u{7f}"]
        {
            let mut out = Vec::new();
            push_json_string(&mut out, name);
            assert_eq!(String::from_utf8(out).unwrap(), serde_json::to_string(name).unwrap(), "{name:?}");
        }
        for v in [0, 7, 10, 99, 100, 101, 999, 1000, 12_345, 1 << 40, 10u64.pow(19), u64::MAX] {
            let mut out = Vec::new();
            push_u64(&mut out, v);
            assert_eq!(out, v.to_string().as_bytes());
        }
    }

    #[test]
    fn safetensors_header_is_json_with_contiguous_offsets_and_aligned_data() {
        let entries = [
            SafetensorsEntry { name: "a\"b@[0:2]".into(), dtype: DType::Bf16, shape: vec![2, 3].into(), len: 12 },
            SafetensorsEntry { name: "c".into(), dtype: DType::U8, shape: vec![5].into(), len: 5 },
        ];
        let meta = BTreeMap::from([("format".to_string(), "dckpt".to_string())]);
        let h = safetensors_header(&entries, &meta);
        assert_eq!(h.len() % 8, 0);
        let n = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(n + 8, h.len());
        let v: serde_json::Value = serde_json::from_slice(&h[8..]).unwrap();
        assert_eq!(v["__metadata__"]["format"], "dckpt");
        assert_eq!(v["a\"b@[0:2]"]["dtype"], "BF16");
        assert_eq!(v["a\"b@[0:2]"]["shape"], serde_json::json!([2, 3]));
        assert_eq!(v["a\"b@[0:2]"]["data_offsets"], serde_json::json!([0, 12]));
        assert_eq!(v["c"]["data_offsets"], serde_json::json!([12, 17]));
    }

    #[test]
    fn chunk_entry_names_are_what_region_display_writes() {
        let regions = [
            Region::full(&[]),
            Region::full(&[1024]),
            Region { offset: vec![0, 9_999_999_999].into(), shape: vec![7, u64::MAX].into(), flat: None },
            Region {
                offset: vec![4, 0].into(),
                shape: vec![2, 8].into(),
                flat: Some(FlatRange { start: 3, stop: 11 }),
            },
        ];
        for key in ["w", "decoder.layers.0.q\"é", ""] {
            for r in &regions {
                assert_eq!(chunk_entry_name(key, r), format!("{key}@{r}"));
            }
        }
    }

    #[test]
    fn parsed_headers_are_what_was_written() {
        let entries = [
            SafetensorsEntry { name: "w@[0:2, 0:3]".into(), dtype: DType::F32, shape: vec![2, 3].into(), len: 24 },
            SafetensorsEntry { name: "o@object[1]".into(), dtype: DType::U8, shape: vec![5].into(), len: 5 },
        ];
        let meta = BTreeMap::from([("format".to_string(), "dckpt".to_string()), ("rank".into(), "3".into())]);
        let mut h = safetensors_header(&entries, &meta);
        let p = parse_safetensors_header(&h, "f").unwrap();
        assert_eq!(p.data_start, h.len() as u64);
        assert_eq!(p.metadata, meta);
        let e = |name: &str, dtype: &str, shape: Vec<u64>, data_offsets| HeaderEntry {
            name: name.into(),
            dtype: dtype.into(),
            shape,
            data_offsets,
        };
        assert_eq!(
            p.entries,
            [e("o@object[1]", "U8", vec![5], [24, 29]), e("w@[0:2, 0:3]", "F32", vec![2, 3], [0, 24])]
        );
        // The data after the header is not read.
        h.extend_from_slice(&[0xff; 29]);
        assert_eq!(parse_safetensors_header(&h, "f").unwrap(), p);
    }

    #[test]
    fn broken_headers_are_refused_with_their_field() {
        let check = |bytes: &[u8], field: &str| {
            let e = parse_safetensors_header(bytes, "f.safetensors").expect_err("refused");
            assert_eq!((e.file(), e.field()), ("f.safetensors", field), "{e}");
            e
        };
        let framed = |json: &str| [&(json.len() as u64).to_le_bytes()[..], json.as_bytes()].concat();
        check(b"\x01\x00", "header");
        let e = check(&u64::MAX.to_le_bytes(), "header");
        assert!(matches!(e.kind(), FormatErrorKind::LimitExceeded { found: u64::MAX, .. }), "{e}");
        check(&framed("{}")[..9], "header");
        check(&framed("[1, 2]"), "header");
        check(&framed("{\"a\":"), "header");
        check(&framed(r#"{"a": {"dtype": "F32", "shape": [1]}}"#), "header.a");
        check(&framed(r#"{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}"#), "header.a");
        check(&framed(r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}"#), "header.a.data_offsets");
        check(&framed(r#"{"__metadata__": {"k": 1}}"#), "header.__metadata__");
        let ok =
            parse_safetensors_header(&framed(r#"{"a": {"dtype": "X9", "shape": [], "data_offsets": [0, 0]}}  "#), "f");
        assert_eq!(ok.unwrap().entries[0].dtype, "X9", "dtypes dckpt does not know parse");
    }
}
