//! How the CLI opens storage: as the library does, plus what a program that owns its
//! process may turn on.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dckpt::storage::{OpenOptions, Storage};

/// The options every command opens storage with: the library's defaults, with mapped
/// copies on local disk (faster column-split loads; they install a process-wide `SIGBUS`
/// handler, which this process, unlike a library's host, may do).
pub fn options() -> OpenOptions {
    let mut options = OpenOptions::default();
    options.local.mapped_reads = true;
    options
}

/// Opens `url` with [`options`].
pub fn open(url: &str) -> dckpt::storage::Result<Arc<dyn Storage>> {
    dckpt::storage::open_with(url, &options())
}

/// Opens `url` to read what is already there: a local path that does not exist is
/// `NotFound`. Opening a local store creates its directory, which a command that only reads
/// must not do: a mistyped path became an empty run root that `ls` listed as one.
pub fn open_existing(url: &str) -> dckpt::storage::Result<Arc<dyn Storage>> {
    if let Some(path) = local_path(url).filter(|p| !p.is_empty() && !Path::new(p).exists()) {
        return Err(dckpt::storage::Error::NotFound { path: path.to_string() });
    }
    open(url)
}

/// [`open_existing`] of a directory (a run root): a file there is refused, where it was
/// listed as an empty run.
pub fn open_existing_dir(url: &str) -> dckpt::storage::Result<Arc<dyn Storage>> {
    if let Some(path) = local_path(url).filter(|p| Path::new(p).is_file()) {
        let reason = "a file, not a directory".into();
        return Err(dckpt::storage::Error::InvalidPath { path: path.to_string(), reason });
    }
    open_existing(url)
}

/// The directory `url` names on local disk where it is not there yet: a command that makes it
/// by opening it and then fails gives it to [`remove_if_empty`], so that a refused export or
/// conversion leaves no empty output behind.
pub fn new_local_dir(url: &str) -> Option<PathBuf> {
    local_path(url).filter(|p| !p.is_empty() && !Path::new(p).exists()).map(PathBuf::from)
}

/// Removes `dir` if it is there and empty (see [`new_local_dir`]); anything in it stays.
pub fn remove_if_empty(dir: Option<&Path>) {
    if let Some(d) = dir {
        let _ = std::fs::remove_dir(d);
    }
}

/// Refuses an output in the very directory its source is read from (`src_dir`): `convert X
/// X` put a dckpt checkpoint among the torch_dist files it came from, after which the
/// directory was detected as dckpt. A directory below the source's is its own place, and
/// allowed. Local paths are compared absolute, through any link in the part that exists;
/// other locations as written, less trailing slashes. `Err`: the reason, naming both.
pub fn refuse_same_dir(src_dir: &str, dst: &str) -> Result<(), String> {
    let (s, d) = match (local_path(src_dir), local_path(dst)) {
        (Some(s), Some(d)) => (resolved(s), resolved(d)),
        (None, None) => (PathBuf::from(src_dir.trim_end_matches('/')), PathBuf::from(dst.trim_end_matches('/'))),
        _ => return Ok(()),
    };
    if d == s {
        return Err(format!(
            "the output {dst} is the source's own directory {src_dir}: give it a directory of its own"
        ));
    }
    Ok(())
}

/// `path` made absolute, its longest existing ancestor resolved through links (the rest may
/// not be there yet); as given where even that fails.
fn resolved(path: &str) -> PathBuf {
    let path = if path.is_empty() { Path::new(".") } else { Path::new(path) };
    let Ok(abs) = std::path::absolute(path) else { return path.to_path_buf() };
    let mut rest = Vec::new();
    let mut at = abs.as_path();
    loop {
        if let Ok(real) = at.canonicalize() {
            return rest.iter().rev().fold(real, |p, c| p.join(c));
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                at = parent;
            }
            _ => return abs,
        }
    }
}

/// The path of a local `url` (a plain path or `file://`); `None` for any other scheme.
fn local_path(url: &str) -> Option<&str> {
    if url.contains("://") { url.strip_prefix("file://") } else { Some(url) }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use bytes::Bytes;

    use super::*;

    /// An output in its source's directory is refused, named as written or through a
    /// link; a directory below it or beside it is not.
    #[test]
    fn an_output_in_its_sources_own_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("ckpt");
        std::fs::create_dir(&src).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&src, &link).unwrap();
        let s = src.to_str().unwrap();
        for dst in [s.to_string(), format!("{s}/"), link.display().to_string()] {
            let e = refuse_same_dir(s, &dst).unwrap_err();
            assert!(e.contains(&dst) && e.contains(s), "{e}");
        }
        for dst in [format!("{s}/dckpt"), format!("{s}-converted"), dir.path().display().to_string()] {
            assert!(refuse_same_dir(s, &dst).is_ok(), "{dst}");
        }
        assert!(refuse_same_dir("s3://b/run/ckpt", "s3://b/run/ckpt/").is_err());
        assert!(refuse_same_dir("s3://b/run/ckpt", "s3://b/run/ckpt/sub").is_ok());
        assert!(refuse_same_dir(s, "s3://b/x").is_ok());
    }

    /// Short stretches far apart, read through a store the CLI opened, come out of a
    /// mapping of the file (the library's default would read them by system calls).
    #[test]
    fn local_stores_read_through_mapped_copies() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path().to_str().unwrap()).unwrap();
        let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
        store.put("data", Bytes::from(data.clone())).unwrap();
        let mut reader = store.reader("data").unwrap();
        let mut bufs: Vec<(usize, Vec<u8>)> = (0..data.len()).step_by(2048).map(|at| (at, vec![0u8; 1024])).collect();
        let mut reads: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(at, b)| (*at as u64, b.as_mut_slice())).collect();
        reader.read_into(&mut reads).unwrap();
        assert!(bufs.iter().all(|(at, b)| b[..] == data[*at..*at + b.len()]));
        let file = dir.path().join("data").canonicalize().unwrap().display().to_string();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(maps.lines().any(|l| l.ends_with(&file)), "{file} is not mapped");
    }
}
