//! Byte sizes as people write them (`5GB`, `500MB`, `1GiB`, `4096`).

use crate::{ConvertError, Result};

/// Parses a size: plain bytes, or a number (decimals allowed) with a unit: `KB`, `MB`,
/// `GB`, `TB` are powers of 1000 (as `transformers`' `max_shard_size` reads them), `KiB`,
/// `MiB`, `GiB`, `TiB` powers of 1024; `B` is bytes. Case-insensitive, spaces allowed.
pub fn parse_size(text: &str) -> Result<u64> {
    let bad =
        |why: &str| ConvertError::Options { detail: format!("size {text:?}: {why} (e.g. 5GB, 500MB, 1GiB, 4096)") };
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim().to_ascii_lowercase());
    let mult: u64 = match unit.as_str() {
        "" | "b" => 1,
        "kb" | "k" => 1000,
        "mb" | "m" => 1_000_000,
        "gb" | "g" => 1_000_000_000,
        "tb" | "t" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(bad("unknown unit")),
    };
    if num.is_empty() {
        return Err(bad("no number"));
    }
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(|| bad("too large"));
    }
    let v: f64 = num.parse().map_err(|_| bad("not a number"))?;
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(bad("too large"));
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_decimal_and_binary_units() {
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("500MB").unwrap(), 500_000_000);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size(" 1.5 kib ").unwrap(), 1536);
        assert_eq!(parse_size("256MiB").unwrap(), 256 << 20);
        for bad in ["", "GB", "5XB", "1e3", "-5MB", "99999999999999999999TB"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.to_string().contains("size"), "{bad:?}: {e}");
        }
    }
}
