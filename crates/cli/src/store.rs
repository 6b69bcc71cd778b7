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

/// The path of a local `url` (a plain path or `file://`); `None` for any other scheme.
fn local_path(url: &str) -> Option<&str> {
    if url.contains("://") { url.strip_prefix("file://") } else { Some(url) }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use bytes::Bytes;

    use super::*;

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
