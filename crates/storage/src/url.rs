//! Choosing a backend from a URL.

use std::sync::Arc;

use crate::{Error, LocalConfig, LocalStorage, MemoryStorage, Result, Storage};
#[cfg(feature = "s3")]
use crate::{S3Config, S3Storage};

/// Backend tuning used by [`open_with`].
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Used for plain paths and `file://` URLs; set [`LocalConfig::mapped_reads`] here to
    /// opt in to mapped copies (and their process-wide `SIGBUS` handler).
    pub local: LocalConfig,
    /// Used for `s3://` URLs.
    #[cfg(feature = "s3")]
    pub s3: S3Config,
}

/// Opens the storage named by `url` with default tuning:
///
/// - a plain path (`/data/ckpt`, `ckpt`) or `file:///data/ckpt`: [`LocalStorage`] rooted there;
/// - `s3://bucket/prefix`: `S3Storage`, configured from the `AWS_*` environment (feature
///   `s3`; without it such a URL is an [`Error::Config`] that says so);
/// - `memory://`: a fresh private [`MemoryStorage`]; `memory://NAME`: the process-wide memory
///   store called `NAME` (shared by every `open` of the same name in this process);
///   `memory://NAME/a/b`: that store's objects under `a/b`.
pub fn open(url: &str) -> Result<Arc<dyn Storage>> {
    open_with(url, &OpenOptions::default())
}

/// [`open`] with explicit backend tuning.
pub fn open_with(url: &str, options: &OpenOptions) -> Result<Arc<dyn Storage>> {
    if let Some(name) = url.strip_prefix("memory://") {
        let name = name.trim_end_matches('/');
        // `memory://NAME/a/b` is the store `NAME` under `a/b`, as its locations read (and as
        // `s3://bucket/prefix` is): a run root's step directory opened by its URL is the
        // same objects the run root lists.
        return Ok(match name.split_once('/') {
            _ if name.is_empty() => Arc::new(MemoryStorage::new()),
            Some((store, under)) => Arc::new(crate::Prefixed::new(Arc::new(MemoryStorage::named(store)), under)?),
            None => Arc::new(MemoryStorage::named(name)),
        });
    }
    if url.starts_with("s3://") {
        #[cfg(feature = "s3")]
        return Ok(Arc::new(S3Storage::from_url(url, options.s3.clone())?));
        #[cfg(not(feature = "s3"))]
        return Err(Error::Config {
            url: url.to_string(),
            message: "this build of dckpt-storage has no S3 backend (enable its feature `s3`)".into(),
        });
    }
    let path = match url.strip_prefix("file://") {
        Some(p) if p.starts_with('/') => p,
        Some(_) => {
            return Err(Error::Config { url: url.to_string(), message: "expected file:///absolute/path".into() });
        }
        None if url.contains("://") => {
            return Err(Error::Config {
                url: url.to_string(),
                message: "unknown scheme; expected a path, file://, s3:// or memory://".into(),
            });
        }
        None => url,
    };
    if path.is_empty() {
        return Err(Error::Config { url: url.to_string(), message: "empty path".into() });
    }
    Ok(Arc::new(LocalStorage::with_config(path, options.local.clone())?))
}
