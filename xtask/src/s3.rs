//! The local S3-compatible test server (moto). Owned by the storage work.

use std::process::Command;

use anyhow::Result;

/// A running (or externally provided) S3 server; stops the server on drop if we started it.
#[derive(Debug)]
pub struct Server {
    env: Vec<(String, String)>,
}

impl Server {
    pub fn apply_env(&self, cmd: &mut Command) {
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
    }
}

pub fn ensure_server() -> Result<Server> {
    Ok(Server { env: Vec::new() })
}
