//! Developer automation for dckpt: `cargo xtask <task>`.
//!
//! - `test`  — starts a local S3-compatible server (moto, in a venv under `target/`) unless
//!   `DCKPT_TEST_S3_URL` already points at one, sets `DCKPT_TEST_PYTHON` to a python with
//!   msgpack and safetensors (for the format's Python reader test), then runs the whole
//!   test suite against it.
//! - `bench [NAME] [--torch] [dckpt bench options]` — benchmarks (`plan`, `storage`, ...);
//!   `--torch` makes a venv with CPU torch and safetensors (`torchenv.rs`) and passes it as
//!   `DCKPT_BENCH_PYTHON`, so that the PyTorch DCP and safetensors figures are measured.
//! - `tidy` — formatting and lints.

mod pyenv;
mod s3;
mod torchenv;

use std::process::Command;

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (task, rest) = args.split_first().map(|(t, r)| (t.as_str(), r)).unwrap_or(("help", &[]));
    match task {
        "test" => test(rest),
        "bench" => bench(rest),
        "tidy" => tidy(),
        "help" | "--help" | "-h" => {
            println!("usage: cargo xtask <test [cargo test args]|bench [NAME] [--torch] [options]|tidy>");
            Ok(())
        }
        other => bail!("unknown task {other:?}; try `cargo xtask help`"),
    }
}

/// Runs the whole suite with the S3 server up, built with the `ci` profile: optimized (tests
/// move real bytes) with overflow checks and debug assertions on.
fn test(extra: &[String]) -> Result<()> {
    // The NCCL backend cannot run here (no GPU), but it must keep compiling.
    run(Command::new(cargo()).args(["check", "-p", "dckpt-collective", "--features", "nccl", "--tests"]))?;
    let server = s3::ensure_server().context("starting the S3 test server")?;
    let mut cmd = Command::new(cargo());
    cmd.args(["test", "--workspace", "--profile", "ci"]).args(extra);
    server.apply_env(&mut cmd);
    let python = pyenv::reader_python().context("preparing the Python that reads checkpoints")?;
    cmd.env("DCKPT_TEST_PYTHON", python);
    let status = cmd.status().context("running cargo test")?;
    drop(server);
    if !status.success() {
        bail!("cargo test failed: {status}");
    }
    Ok(())
}

fn bench(rest: &[String]) -> Result<()> {
    let torch = rest.iter().any(|a| a == "--torch");
    let rest: Vec<&String> = rest.iter().filter(|a| *a != "--torch").collect();
    let name = rest.first().map(|s| s.as_str()).unwrap_or("all");
    let needs_s3 = matches!(name, "storage" | "s3" | "all");
    let python = if torch { Some(torchenv::torch_python().context("preparing a Python with torch")?) } else { None };
    let server = if needs_s3 { Some(s3::ensure_server()?) } else { None };
    let mut cmd = Command::new(cargo());
    cmd.args(["run", "--release", "--quiet", "-p", "dckpt-cli", "--", "bench", name]);
    cmd.args(rest.iter().skip(1));
    if let Some(s) = &server {
        s.apply_env(&mut cmd);
    }
    if let Some(p) = python {
        cmd.env(torchenv::ENV, p);
    }
    let status = cmd.status().context("running dckpt bench")?;
    if !status.success() {
        bail!("bench {name} failed: {status}");
    }
    Ok(())
}

fn tidy() -> Result<()> {
    run(Command::new(cargo()).args(["fmt", "--all", "--", "--check"]))?;
    run(Command::new(cargo()).args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}
