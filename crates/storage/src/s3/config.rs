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
        for (key, value) in profile_settings(&|k| std::env::var(k).ok(), &self.options)? {
            builder = builder.with_config(key, value);
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

/// What the AWS CLI's shared files give the profile `AWS_PROFILE` names (else `default`):
/// its static keys from the credentials file (`AWS_SHARED_CREDENTIALS_FILE`, else
/// `~/.aws/credentials`) and the config file (`AWS_CONFIG_FILE`, else `~/.aws/config`), and
/// its region, each only where neither the environment nor `options` sets it. Without
/// them, a user whose `aws s3 ls` works through a profile got no credentials, and the
/// client asked the instance metadata service for three minutes before failing. A profile
/// named by `AWS_PROFILE` that neither file holds is an error naming it; one that holds no
/// static keys (single sign-on, a role, a process) is left to the client's own chain, with
/// a warning. `env` reads a variable (the process environment, or a test's).
fn profile_settings(
    env: &dyn Fn(&str) -> Option<String>,
    options: &[(String, String)],
) -> std::result::Result<Vec<(AmazonS3ConfigKey, String)>, String> {
    let set = |var: &str, option: &str| {
        env(var).is_some_and(|v| !v.is_empty()) || options.iter().any(|(k, _)| k.eq_ignore_ascii_case(option))
    };
    let named = env("AWS_PROFILE").filter(|p| !p.is_empty());
    let home = env("HOME").unwrap_or_default();
    let file = |var: &str, default: &str| env(var).unwrap_or_else(|| format!("{home}/.aws/{default}"));
    let read = |path: String| std::fs::read_to_string(&path).ok().map(|text| (path, text));
    let profile = named.clone().unwrap_or_else(|| "default".into());
    let credentials = read(file("AWS_SHARED_CREDENTIALS_FILE", "credentials"))
        .and_then(|(path, text)| ini_section(&text, &profile).map(|s| (path, s)));
    let config_section = if profile == "default" { profile.clone() } else { format!("profile {profile}") };
    let config = read(file("AWS_CONFIG_FILE", "config")).and_then(|(path, text)| {
        ini_section(&text, &config_section).or_else(|| ini_section(&text, &profile)).map(|s| (path, s))
    });
    if credentials.is_none() && config.is_none() {
        return match named {
            Some(p) => Err(format!("AWS_PROFILE={p}: no such profile in the AWS credentials or config file")),
            None => Ok(Vec::new()),
        };
    }
    let value = |name: &str| {
        let from = |s: &Option<(String, Vec<(String, String)>)>| {
            s.as_ref().and_then(|(_, kv)| kv.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
        };
        from(&credentials).or_else(|| from(&config))
    };
    let mut out = Vec::new();
    let keyed = set("AWS_ACCESS_KEY_ID", "aws_access_key_id");
    match (value("aws_access_key_id"), value("aws_secret_access_key")) {
        (Some(id), Some(secret)) if !keyed => {
            out.push((AmazonS3ConfigKey::AccessKeyId, id));
            out.push((AmazonS3ConfigKey::SecretAccessKey, secret));
            if let Some(token) = value("aws_session_token") {
                out.push((AmazonS3ConfigKey::Token, token));
            }
        }
        _ if keyed => {}
        _ => log::warn!(
            "S3: the AWS profile {profile:?} holds no static keys (aws_access_key_id and aws_secret_access_key); \
             single sign-on, roles and credential processes are not read here: export AWS_ACCESS_KEY_ID, \
             AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN (`aws configure export-credentials --format env`)"
        ),
    }
    let region_set = set("AWS_REGION", "aws_region") || set("AWS_DEFAULT_REGION", "aws_default_region");
    if let Some(region) = value("region").filter(|_| !region_set) {
        out.push((AmazonS3ConfigKey::Region, region));
    }
    Ok(out)
}

/// The `key = value` lines of the section `[name]` of an INI text, keys lowercased; `None`
/// where there is no such section.
fn ini_section(text: &str, name: &str) -> Option<Vec<(String, String)>> {
    let mut found = None;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            if found.is_some() {
                break;
            }
            if header.trim() == name {
                found = Some(Vec::new());
            }
            continue;
        }
        if let (Some(section), Some((k, v))) = (found.as_mut(), line.split_once('=')) {
            let section: &mut Vec<(String, String)> = section;
            section.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)], options: &[(&str, &str)]) -> Result<Vec<(String, String)>, String> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let env = move |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        let options: Vec<(String, String)> = options.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let out = profile_settings(&env, &options)?;
        Ok(out.into_iter().map(|(k, v)| (format!("{k:?}"), v)).collect())
    }

    /// A profile's static keys and region are used where nothing else sets them: the one
    /// `AWS_PROFILE` names, else `default`; the config file's `[profile x]` too. The
    /// environment and the options win; a named profile that is nowhere is an error.
    #[test]
    fn the_shared_files_give_a_profiles_keys_and_region() {
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials");
        let config = dir.path().join("config");
        std::fs::write(
            &creds,
            "[default]\naws_access_key_id = D\naws_secret_access_key = d\n\n[work]\n# a note\n\
             AWS_ACCESS_KEY_ID=W\naws_secret_access_key = w\naws_session_token = t\n",
        )
        .unwrap();
        std::fs::write(
            &config,
            "[default]\nregion = eu-west-1\n[profile work]\nregion = us-west-2\n[profile sso]\nsso_session = x\n",
        )
        .unwrap();
        let (c, f) = (creds.to_str().unwrap(), config.to_str().unwrap());
        let files = [("AWS_SHARED_CREDENTIALS_FILE", c), ("AWS_CONFIG_FILE", f)];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v: Vec<(&str, &str)> = files.to_vec();
            v.extend_from_slice(extra);
            v
        };
        let pairs = |v: &[(&str, &str)]| v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        assert_eq!(
            settings(&with(&[]), &[]).unwrap(),
            pairs(&[("AccessKeyId", "D"), ("SecretAccessKey", "d"), ("Region", "eu-west-1")])
        );
        assert_eq!(
            settings(&with(&[("AWS_PROFILE", "work")]), &[]).unwrap(),
            pairs(&[("AccessKeyId", "W"), ("SecretAccessKey", "w"), ("Token", "t"), ("Region", "us-west-2")])
        );
        // The environment's keys and region, or the options', win.
        assert_eq!(settings(&with(&[("AWS_ACCESS_KEY_ID", "E"), ("AWS_REGION", "r")]), &[]).unwrap(), []);
        assert_eq!(settings(&with(&[]), &[("aws_access_key_id", "O"), ("aws_region", "r")]).unwrap(), []);
        // No static keys: nothing but the region, and the client's own chain goes on.
        assert_eq!(settings(&with(&[("AWS_PROFILE", "sso")]), &[]).unwrap(), []);
        let e = settings(&with(&[("AWS_PROFILE", "nope")]), &[]).unwrap_err();
        assert!(e.contains("AWS_PROFILE=nope"), "{e}");
        // No files: nothing, unless a profile was named.
        let none = [("HOME", dir.path().join("nowhere").to_str().unwrap().to_string())];
        let none: Vec<(&str, &str)> = none.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(settings(&none, &[]).unwrap(), []);
    }
}
