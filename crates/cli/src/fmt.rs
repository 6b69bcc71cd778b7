//! Human-readable numbers, error chains said once, and output that survives a closed pipe.

use std::io::Write;

/// Writes `text` to stdout. A reader that went away (`dckpt plan | head`) is not an error.
pub fn emit(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
}

/// `e` and its causes, `outer: cause: root`, like `{e:#}` but each said once: an error that
/// both shows its source in its own message and returns it from `source()` (as the storage
/// errors do) would otherwise repeat it ("Permission denied (os error 13): Permission denied
/// (os error 13)").
pub fn chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut parent = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.is_empty() {
            out = text.clone();
        } else if !parent.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        parent = text;
    }
    out
}

/// The one JSON object a `--json` command prints when it fails before it has a report:
/// `{"location": ..., "error": ...}`, plus `hint` when there is one.
pub fn error_json(location: &str, error: &str, hint: Option<&str>) -> String {
    let mut v = serde_json::json!({ "location": location, "error": error });
    if let Some(h) = hint {
        v["hint"] = h.into();
    }
    format!("{}\n", serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string()))
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
    /// An error that shows its source in its message and also returns it.
    #[derive(Debug, thiserror::Error)]
    #[error("delete failed on /ckpt/x: {source}")]
    struct Shows {
        source: std::io::Error,
    }

    #[test]
    fn a_cause_shown_by_its_parent_is_said_once() {
        let io = std::io::Error::from_raw_os_error(13);
        let io_text = io.to_string();
        let e = anyhow::Error::new(Shows { source: io }).context("removing leftovers");
        assert_eq!(format!("{e:#}").matches(&io_text).count(), 2, "the doubling this guards against");
        let text = super::chain(&e);
        assert_eq!(text, format!("removing leftovers: delete failed on /ckpt/x: {io_text}"));
        // Causes not shown by their parent are all kept.
        let e = anyhow::anyhow!("root").context("middle").context("outer");
        assert_eq!(super::chain(&e), "outer: middle: root");
    }

    #[test]
    fn error_json_is_one_object_with_an_error() {
        let v: serde_json::Value = serde_json::from_str(&super::error_json("/d", "it broke", None)).unwrap();
        assert_eq!(v, serde_json::json!({ "location": "/d", "error": "it broke" }));
        let v: serde_json::Value = serde_json::from_str(&super::error_json("/d", "e", Some("try this"))).unwrap();
        assert_eq!(v["hint"], "try this");
    }

    #[test]
    fn formats() {
        assert_eq!(super::bytes(512), "512 B");
        assert_eq!(super::bytes(3 << 29), "1.50 GiB");
        assert_eq!(super::ranks(&[0, 2, 3, 4, 5, 9], 8), "0, 2-5, 9");
        assert_eq!(super::ranks(&[0, 2, 4], 2), "0, 2, ... (1 more runs)");
    }
}
