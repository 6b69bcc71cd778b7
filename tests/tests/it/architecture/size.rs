//! Sizes of the workspace's production code: non-test lines per module, lines per function.
//!
//! A small lexer, not a parser: it blanks comments, strings and character literals (keeping
//! newlines, so positions keep their line), after which every brace left is code. Test code
//! is what `#[cfg(test)]` marks: an item with a body, and the file a `#[cfg(test)] mod x;`
//! pulls in. Lines are raw line spans: a function counts from its `fn` line to its closing
//! brace, blank lines and comments included (its doc comment not), as a reader sees it.

use std::path::{Path, PathBuf};

/// One file's production lines and functions.
#[derive(Debug, PartialEq)]
pub struct Sizes {
    /// Lines outside `#[cfg(test)]` items.
    pub lines: usize,
    /// Production functions as (name, first line counted from 1, lines).
    pub fns: Vec<(String, usize, usize)>,
}

/// The source files the rule covers, sorted, without those only a `#[cfg(test)] mod` reaches.
pub fn production_files(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for top in ["crates", "tests", "xtask"] {
        let dirs: Vec<PathBuf> = if top == "crates" {
            read_dir(&root.join(top)).into_iter().map(|d| d.join("src")).collect()
        } else {
            vec![root.join(top).join("src")]
        };
        for d in dirs {
            rust_files(&d, &mut files);
        }
    }
    let mut test_only = Vec::new();
    for f in &files {
        let masked = mask(&std::fs::read_to_string(f).expect("read a source file"));
        test_only.extend(test_mods(&masked).into_iter().flat_map(|m| included(f, &m)));
    }
    files.retain(|f| !test_only.contains(f));
    files.sort();
    files
}

/// The sizes of one file's source.
pub fn sizes(src: &str) -> Sizes {
    let m = mask(src);
    let line_of = |pos: usize| m[..pos].iter().filter(|&&b| b == b'\n').count();
    let mut spans = Vec::new();
    for at in find_all(&m, b"#[cfg(test)]") {
        let after = at + b"#[cfg(test)]".len();
        let Some(open) = m[after..].iter().position(|&b| b == b'{').map(|p| after + p) else { continue };
        if m[after..open].contains(&b';') {
            continue;
        }
        spans.push((line_of(at), line_of(matching_brace(&m, open))));
    }
    let total = src.matches('\n').count() + usize::from(!src.ends_with('\n'));
    let test_lines: usize = spans.iter().map(|(a, b)| b - a + 1).sum();
    let in_test = |line: usize| spans.iter().any(|&(a, b)| a <= line && line <= b);
    let mut fns = Vec::new();
    let mut start = 0;
    for (first, line) in m.split(|&b| b == b'\n').enumerate() {
        if let Some((name, sig_end)) = fn_start(line)
            && let Some(open) = body_open(&m, start + sig_end)
            && !in_test(first)
        {
            fns.push((name, first + 1, line_of(matching_brace(&m, open)) - first + 1));
        }
        start += line.len() + 1;
    }
    Sizes { lines: total - test_lines, fns }
}

/// `src` with comments, strings and character literals blanked, newlines kept.
pub fn mask(src: &str) -> Vec<u8> {
    let s = src.as_bytes();
    let mut out = s.to_vec();
    let mut i = 0;
    while i < s.len() {
        let end = literal_end(s, i);
        if end == i {
            i += 1;
            continue;
        }
        for b in &mut out[i..end] {
            if *b != b'\n' {
                *b = b' ';
            }
        }
        i = end;
    }
    out
}

/// Where the comment or literal that starts at `i` ends, or `i` when none starts there.
fn literal_end(s: &[u8], i: usize) -> usize {
    let rest = &s[i..];
    let ident_before = |k: usize| k > 0 && (s[k - 1].is_ascii_alphanumeric() || s[k - 1] == b'_');
    if rest.starts_with(b"//") {
        return rest.iter().position(|&b| b == b'\n').map_or(s.len(), |p| i + p);
    }
    if rest.starts_with(b"/*") {
        let (mut depth, mut j) = (1, i + 2);
        while j < s.len() && depth > 0 {
            if s[j..].starts_with(b"/*") {
                (depth, j) = (depth + 1, j + 2);
            } else if s[j..].starts_with(b"*/") {
                (depth, j) = (depth - 1, j + 2);
            } else {
                j += 1;
            }
        }
        return j;
    }
    // A raw string: `r"`, `r#"`, ..., also after `b` (`br"..."`).
    let raw_start = rest[0] == b'r' && (!ident_before(i) || (i > 0 && s[i - 1] == b'b' && !ident_before(i - 1)));
    if raw_start {
        let hashes = rest[1..].iter().take_while(|&&b| b == b'#').count();
        if rest.get(1 + hashes) == Some(&b'"') {
            let mut close = vec![b'"'];
            close.extend(std::iter::repeat_n(b'#', hashes));
            let from = i + 2 + hashes;
            return s[from..].windows(close.len()).position(|w| w == close).map_or(s.len(), |p| from + p + close.len());
        }
        return i;
    }
    if rest[0] == b'"' {
        let mut j = i + 1;
        while j < s.len() && s[j] != b'"' {
            j += if s[j] == b'\\' { 2 } else { 1 };
        }
        return (j + 1).min(s.len());
    }
    if rest[0] == b'\'' {
        return char_literal_end(s, i);
    }
    i
}

/// The end of a character literal at `i`, or `i` for a lifetime or label (`'a`).
fn char_literal_end(s: &[u8], i: usize) -> usize {
    let rest = &s[i..];
    if rest.get(1) == Some(&b'\\') {
        // An escape (its first character may be a quote): up to the next quote, within the
        // longest escape (`'\u{10FFFF}'`).
        return rest.iter().take(12).skip(3).position(|&b| b == b'\'').map_or(i, |p| i + 3 + p + 1);
    }
    let Some(&lead) = rest.get(1) else { return i };
    let width = match lead {
        b'\'' => return i,
        0..0x80 => 1,
        0xf0.. => 4,
        0xe0.. => 3,
        _ => 2,
    };
    if rest.get(1 + width) == Some(&b'\'') { i + 2 + width } else { i }
}

/// The name of the function a (masked) line starts, and where its name ends in the line.
fn fn_start(line: &[u8]) -> Option<(String, usize)> {
    let text = std::str::from_utf8(line).ok()?;
    let mut rest = text.trim_start_matches([' ', '\t']);
    if let Some(r) = rest.strip_prefix("pub") {
        rest = match r.strip_prefix('(') {
            Some(r) => r.split_once(')')?.1,
            None => r,
        };
        rest = rest.trim_start();
    }
    loop {
        let before = rest;
        for q in ["const ", "async ", "unsafe ", "extern "] {
            if let Some(r) = rest.strip_prefix(q) {
                rest = r.trim_start();
            }
        }
        if rest == before {
            break;
        }
    }
    let r = rest.strip_prefix("fn")?;
    let name_at = r.len() - r.trim_start().len();
    if name_at == 0 {
        return None;
    }
    let name: String = r[name_at..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    if name.is_empty() {
        return None;
    }
    let end = text.len() - r.len() + name_at + name.len();
    Some((name, end))
}

/// The `{` that opens the body of the function whose signature goes on from `from`, or
/// `None` when a `;` ends it first (a declaration without a body).
fn body_open(m: &[u8], from: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (k, &b) in m.iter().enumerate().skip(from) {
        match b {
            b'(' | b'<' | b'[' => depth += 1,
            b')' | b'>' | b']' => depth -= 1,
            b';' if depth <= 0 => return None,
            b'{' if depth <= 0 => return Some(k),
            _ => {}
        }
    }
    None
}

/// The `}` that closes the `{` at `open` (the last byte when none does).
fn matching_brace(m: &[u8], open: usize) -> usize {
    let mut depth = 0;
    for (k, &b) in m.iter().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    m.len().saturating_sub(1)
}

/// The names `x` of every `#[cfg(test)] mod x;` (any visibility) in a masked file.
pub fn test_mods(m: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(m);
    let mut names = Vec::new();
    for (at, _) in text.match_indices("#[cfg(test)]") {
        let mut rest = text[at + "#[cfg(test)]".len()..].trim_start();
        if let Some(r) = rest.strip_prefix("pub") {
            rest = match r.strip_prefix('(') {
                Some(r) => r.split_once(')').map_or("", |(_, r)| r),
                None => r,
            };
            rest = rest.trim_start();
        }
        let Some(r) = rest.strip_prefix("mod").filter(|r| r.starts_with(char::is_whitespace)) else { continue };
        let r = r.trim_start();
        let name: String = r.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if !name.is_empty() && r[name.len()..].trim_start().starts_with(';') {
            names.push(name);
        }
    }
    names
}

/// The files a `mod name;` in `file` may be: `x.rs` or `x/mod.rs` in the module's directory.
fn included(file: &Path, name: &str) -> [PathBuf; 2] {
    let dir = file.parent().expect("a file's directory");
    let stem = file.file_stem().and_then(|s| s.to_str()).expect("a UTF-8 name");
    let sub = if matches!(stem, "mod" | "lib" | "main") { dir.to_path_buf() } else { dir.join(stem) };
    [sub.join(format!("{name}.rs")), sub.join(name).join("mod.rs")]
}

fn find_all(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    hay.windows(needle.len()).enumerate().filter(|(_, w)| *w == needle).map(|(k, _)| k).collect()
}

fn read_dir(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut paths: Vec<PathBuf> = entries.map(|e| e.expect("a directory entry").path()).collect();
    paths.sort();
    paths
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for p in read_dir(dir) {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}
