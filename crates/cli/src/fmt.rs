//! Human-readable numbers, and output that survives a closed pipe.

use std::io::Write;

/// Writes `text` to stdout. A reader that went away (`dckpt plan | head`) is not an error.
pub fn emit(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
}

/// `1.50 GiB`, `12.0 MiB`, `512 B`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

/// `1.00 GiB written, 1.00 GiB expected (equal: 1073741824 vs 1073741824)`.
pub fn written_vs_expected(written: u64, expected: u64) -> String {
    let mark = if written == expected { "equal" } else { "MISMATCH" };
    format!("{} written, {} expected ({mark}: {written} vs {expected})", bytes(written), bytes(expected))
}

/// A list of ranks, with runs folded: `0, 2-5, 9`; at most `max` items then `...`.
pub fn ranks(r: &[u32], max: usize) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < r.len() {
        let mut j = i;
        while j + 1 < r.len() && r[j + 1] == r[j] + 1 {
            j += 1;
        }
        parts.push(if j > i { format!("{}-{}", r[i], r[j]) } else { r[i].to_string() });
        i = j + 1;
    }
    if parts.len() > max {
        let n = parts.len() - max;
        parts.truncate(max);
        parts.push(format!("... ({n} more runs)"));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats() {
        assert_eq!(super::bytes(512), "512 B");
        assert_eq!(super::bytes(3 << 29), "1.50 GiB");
        assert_eq!(super::ranks(&[0, 2, 3, 4, 5, 9], 8), "0, 2-5, 9");
        assert_eq!(super::ranks(&[0, 2, 4], 2), "0, 2, ... (1 more runs)");
    }
}
