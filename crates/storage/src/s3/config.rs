//! What an [`S3Storage`](super::S3Storage) is tuned by, and the `object_store` client built from it.

use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::{BackoffConfig, RetryConfig};

use crate::RetryPolicy;
#[cfg(doc)]
use crate::StorageHints;

/// The smallest part S3 accepts (all parts but the last).
pub const PART_BYTES_MIN: usize = 5 << 20;

/// Tuning of [`S3Storage`](super::S3Storage).
#[derive(Debug, Clone)]
pub struct S3Config {
    /// Size of one multipart part; at least 5 MiB. A writer holds at most
    /// `concurrency_max + 1` parts in memory. S3 allows 10,000 parts per object, so a writer
    /// whose size hint needs more uses bigger parts; without a hint the limit is
    /// `10_000 * part_bytes` bytes.
    pub part_bytes: usize,
    /// Parts uploaded at once by one writer.
    pub concurrency_max: usize,
    /// A writer whose size hint is at most this buffers the whole object and sends one PUT
    /// (no multipart upload to assemble); [`StorageHints::object_bytes_max`] reports it, so that
    /// callers that can split their output keep objects within it. At least `part_bytes`.
    pub put_bytes_max: usize,
    /// Retries of transient HTTP failures (5xx, 429, timeouts, connection errors), done by
    /// `object_store` for each request.
    pub retry: RetryPolicy,
    /// Timeout of one HTTP request.
    pub request_timeout_ms: u64,
    /// Extra `object_store` S3 settings applied after the `AWS_*` environment, as
    /// `(key, value)` with the keys `object_store` knows (`aws_endpoint`, `aws_region`,
    /// `aws_access_key_id`, `aws_allow_http`, ...). Lets a caller configure a store without
    /// touching the process environment.
    pub options: Vec<(String, String)>,
}

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            part_bytes: 16 << 20,
            concurrency_max: 8,
            put_bytes_max: 64 << 20,
            retry: RetryPolicy::default(),
            request_timeout_ms: 60_000,
            options: Vec::new(),
        }
    }
}

impl S3Config {
    /// Why this configuration cannot be used, if it cannot.
    pub(super) fn check(&self) -> Option<String> {
        if self.part_bytes < PART_BYTES_MIN || self.concurrency_max == 0 || self.put_bytes_max < self.part_bytes {
            return Some(format!(
                "part_bytes must be at least {PART_BYTES_MIN}, concurrency_max at least 1 and put_bytes_max at least \
                 part_bytes (got {}, {} and {})",
                self.part_bytes, self.concurrency_max, self.put_bytes_max
            ));
        }
        None
    }

    /// The client for `bucket`: the `AWS_*` environment, then [`S3Config::options`] on top.
    /// The error is a message for [`Error::Config`](crate::Error::Config).
    pub(super) fn build_store(&self, bucket: &str) -> std::result::Result<AmazonS3, String> {
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(self.retry.backoff_initial_ms),
                max_backoff: Duration::from_millis(self.retry.backoff_max_ms),
                base: 2.0,
            },
            max_retries: self.retry.attempts_max.saturating_sub(1) as usize,
            retry_timeout: Duration::from_secs(180),
        };
        let client =
            object_store::ClientOptions::new().with_timeout(Duration::from_millis(self.request_timeout_ms.max(1)));
        // Like `AmazonS3Builder::from_env`, but on top of our client options (the builder's
        // `with_client_options` would drop env settings such as AWS_ALLOW_HTTP).
        let mut builder = AmazonS3Builder::new().with_client_options(client).with_retry(retry);
        for (key, value) in std::env::vars_os() {
            let (Some(key), Some(value)) = (key.to_str(), value.to_str()) else { continue };
            if !key.starts_with("AWS_") {
                continue;
            }
            if let Ok(config_key) = key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                builder = builder.with_config(config_key, value);
            }
        }
        for (key, value) in &self.options {
            let config_key = key
                .to_ascii_lowercase()
                .parse::<AmazonS3ConfigKey>()
                .map_err(|e| format!("unknown S3 option {key:?}: {e}"))?;
            builder = builder.with_config(config_key, value);
        }
        builder.with_bucket_name(bucket).build().map_err(|e| e.to_string())
    }
}
