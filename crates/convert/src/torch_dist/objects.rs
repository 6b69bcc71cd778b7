//! Objects between the two formats. DCP stores each as `torch.save` of the value (a zip
//! archive that `torch.load` reads back); `dckpt.torch` stores a tag byte and a body
//! (docs/format.md, "Object bytes written by the Python package"): `J` JSON, `B` bytes,
//! `P` a pickle. A conversion into torch_dist writes each tagged object as the archive
//! `torch.save` would have written for its value; copied as they were, the bytes were a
//! bytes item that `dcp.load` (so Megatron's `dist_checkpointing.load`) fails on. A JSON
//! object's keys come out sorted (the JSON reader's map).

use dckpt_torch_format::write::{Pickler, torch_save_archive};

use crate::{ConvertError, Result};

/// What every zip archive, so every `torch.save` archive, starts with.
const ZIP_START: &[u8] = b"PK\x03\x04";

/// Past this, an integral JSON number may have been an `int` of more than 64 bits that the
/// JSON reader rounded into a float: refused rather than written rounded.
const EXACT_FLOAT_MAX: f64 = 9_007_199_254_740_992.0; // 2^53

/// The `torch.save` archive of the object `key` whose dckpt bytes are `data`: an archive
/// already (a torch_dist checkpoint converted into dckpt) as it is, a tagged value as the
/// archive of that value. Bytes of neither kind (written through the Rust API) name no value
/// PyTorch could read: refused, naming the key.
pub(crate) fn as_torch_save(key: &str, data: &[u8]) -> Result<Vec<u8>> {
    if data.starts_with(ZIP_START) {
        return Ok(data.to_vec());
    }
    let bad = |why: String| ConvertError::torch_dist(format!("object {key}: {why}"));
    let (tag, body) = data.split_first().ok_or_else(|| bad("empty, not an object of dckpt.torch".into()))?;
    let pkl = match tag {
        // Unpickled by `torch.load` as by `pickle.loads`: the body is the archive's pickle.
        b'P' => body.to_vec(),
        b'B' => {
            let mut p = Pickler::new();
            p.bytes(body);
            p.finish()
        }
        b'J' => {
            let value: serde_json::Value = serde_json::from_slice(body)
                .map_err(|e| bad(format!("its JSON does not parse ({e}): NaN or Infinity are not converted")))?;
            let mut p = Pickler::new();
            pickle_json(&mut p, &value).map_err(bad)?;
            p.finish()
        }
        other => {
            return Err(bad(format!(
                "its first byte {other:#04x} is no tag of dckpt.torch (J, B or P) and no torch.save archive: \
                 written through the Rust API, it names no value PyTorch could load"
            )));
        }
    };
    Ok(torch_save_archive(&pkl, &[]))
}

/// `value` as Python's `json.loads` gives it, pickled.
fn pickle_json(p: &mut Pickler, value: &serde_json::Value) -> std::result::Result<(), String> {
    use serde_json::Value;
    match value {
        Value::Null => {
            p.none();
        }
        Value::Bool(b) => {
            p.bool(*b);
        }
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => {
                p.int(i128::from(i));
            }
            (_, Some(u), _) => {
                p.int(i128::from(u));
            }
            (_, _, Some(f)) if f.fract() == 0.0 && f.abs() >= EXACT_FLOAT_MAX => {
                return Err(format!("the number {n} may be an int past 64 bits, which is not converted"));
            }
            (_, _, Some(f)) => {
                p.float(f);
            }
            _ => return Err(format!("the number {n} is not converted")),
        },
        Value::String(s) => {
            p.str(s);
        }
        Value::Array(items) => {
            p.empty_list().mark();
            for v in items {
                pickle_json(p, v)?;
            }
            p.appends();
        }
        Value::Object(map) => {
            p.empty_dict().mark();
            for (k, v) in map {
                p.str(k);
                pickle_json(p, v)?;
            }
            p.setitems();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(data: &[u8]) -> String {
        as_torch_save("k", data).expect_err("refused").to_string()
    }

    /// An archive passes as it is; the tags become archives around their pickle (what
    /// `torch.load` makes of them is checked against PyTorch in python/tests/test_convert.py).
    #[test]
    fn archives_pass_and_tags_become_archives() {
        let archive = torch_save_archive(b"\x80\x02N.", &[]);
        assert_eq!(as_torch_save("k", &archive).unwrap(), archive);
        assert_eq!(as_torch_save("k", b"P\x80\x02N.").unwrap(), archive);
        let mut p = Pickler::new();
        p.bytes(b"xy");
        assert_eq!(as_torch_save("k", b"Bxy").unwrap(), torch_save_archive(&p.finish(), &[]));
        let mut p = Pickler::new();
        p.empty_list().mark().int(1).float(0.5).none().bool(true).str("s").appends();
        assert_eq!(as_torch_save("k", b"J[1,0.5,null,true,\"s\"]").unwrap(), torch_save_archive(&p.finish(), &[]));
    }

    /// A float written with its 17 significant digits (Python's `repr`) is pickled as the
    /// very double: JSON's default float parser was a unit in the last place off for some.
    #[test]
    fn json_floats_become_the_doubles_written() {
        for text in ["0.00023308445025757262", "0.012088995980580643", "92.00864349327219", "2.2250738585072014e-308"] {
            let mut p = Pickler::new();
            p.float(text.parse::<f64>().unwrap());
            let json = format!("J{text}");
            assert_eq!(as_torch_save("k", json.as_bytes()).unwrap(), torch_save_archive(&p.finish(), &[]), "{text}");
        }
    }

    /// What names no value PyTorch could load is refused naming the key, not written.
    #[test]
    fn bytes_of_no_value_are_refused_naming_the_key() {
        for (data, why) in [
            (&b""[..], "empty"),
            (b"\x00raw", "0x00 is no tag"),
            (b"J{\"a\": NaN}", "does not parse"),
            (b"J18446744073709551616", "past 64 bits"),
        ] {
            let e = refused(data);
            assert!(e.contains("object k") && e.contains(why), "{e}");
        }
    }
}
