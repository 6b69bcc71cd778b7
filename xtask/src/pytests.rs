//! The Python package's tests (`python/tests`), run by `cargo xtask test` after the Rust
//! suite.
//!
//! The wheel is built by maturin with the `ci` profile in the workspace's target directory
//! (so the engine compiled for the suite is reused) and installed into a venv under
//! `target/`:
//!
//! - by default `target/py-venv`, made once with `$PYTHON -m venv` and given torch 2.15.0,
//!   numpy, pytest, safetensors, maturin 1.16, megatron-core 0.16.1 (`--no-deps`),
//!   packaging and psutil, unless it already imports them;
//! - with `DCKPT_PY_VENV=/path/to/venv`, an existing venv that already has them is used
//!   and never installed into: the wheel goes into a child venv, `target/py-child`, made
//!   from that venv's python and seeing its packages (through a `.pth` file: a venv's
//!   `--system-site-packages` sees its base interpreter's packages, not its parent venv's).
//!
//! pytest runs with the S3 server's environment; any exit but 0 fails, "no tests
//! collected" (exit 5) included.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{pyenv, s3};

const ENV: &str = "DCKPT_PY_VENV";

const TORCH: &str = "torch==2.15.0";
pub(crate) const MATURIN: &str = "maturin==1.16.*";
pub(crate) const MEGATRON: &str = "megatron-core==0.16.1";
const TOOLS: [&str; 5] = ["numpy", "pytest", "safetensors>=0.4,<1", MATURIN, "packaging"];

/// Builds the CLI binary and the wheel, prepares the venv, installs the wheel, runs pytest.
pub fn run(server: &s3::Server) -> Result<()> {
    let root = crate::workspace_root();
    let (venv, maturin) = prepare()?;
    // The round trips of `dckpt convert` / `export` through PyTorch, Megatron and
    // safetensors (python/tests/test_convert.py) run the CLI binary itself. Built before
    // the wheel (see `SUITE`).
    crate::step("the dckpt binary for the conversion round trips (profile ci)");
    // With an example among the targets, cargo turns on the dev-dependencies' features as
    // the suite's build did, so the binary is the suite's rather than a build of its own.
    crate::run(Command::new(crate::cargo()).arg("build").args(crate::SUITE).args([
        "--bin",
        "dckpt",
        "--example",
        "embed",
    ]))?;
    let dckpt_bin = crate::target_dir().join("ci").join("dckpt");
    let wheel = build_wheel(&maturin, "ci", &crate::target_dir().join("wheels"))?;
    install_wheel(&venv, &wheel)?;
    crate::step("the Python package's tests (pytest)");
    let mut pytest = Command::new(pyenv::python(&venv));
    pytest.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"]).arg(root.join("python/tests")).current_dir(&root);
    server.apply_env(&mut pytest);
    pytest.env("DCKPT_BIN", &dckpt_bin);
    // Everything is installed and the S3 server runs: a skipped test is a broken install
    // step (python/tests/conftest.py turns skips into a failure).
    pytest.env("DCKPT_NO_SKIPS", "1");
    let status = pytest.status().context("running pytest")?;
    match status.code() {
        Some(0) => Ok(()),
        Some(5) => bail!("pytest collected no tests in python/tests"),
        _ => bail!("pytest failed: {status}"),
    }
}

/// Builds the wheel with maturin and the cargo profile `profile` into `out` (emptied of
/// older dckpt wheels first, so exactly this build's is returned), in the workspace's
/// target directory so that what the suite or the benchmarks compiled is reused.
pub(crate) fn build_wheel(maturin: &Path, profile: &str, out: &Path) -> Result<PathBuf> {
    let is_ours = |p: &Path| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("dckpt-"));
    if let Ok(entries) = std::fs::read_dir(out) {
        for e in entries.flatten() {
            if is_ours(&e.path()) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    crate::step(&format!("the Python wheel builds (maturin, profile {profile})"));
    let mut build = Command::new(maturin);
    build.args(["build", "--profile", profile, "--out"]).arg(out).current_dir(crate::workspace_root());
    build.env("CARGO_TARGET_DIR", crate::target_dir());
    crate::run(&mut build)?;
    std::fs::read_dir(out)
        .with_context(|| format!("reading {}", out.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| is_ours(p))
        .with_context(|| format!("maturin left no dckpt wheel in {}", out.display()))
}

/// Installs `wheel` into `venv` alone (its dependencies are the venv's business).
pub(crate) fn install_wheel(venv: &Path, wheel: &Path) -> Result<()> {
    let pip = venv.join("bin").join("pip");
    crate::run(
        Command::new(&pip)
            .args(["install", "--quiet", "--disable-pip-version-check", "--no-deps", "--force-reinstall"])
            .arg(wheel),
    )
}

/// The venv to install the wheel into, and the maturin to build it with.
fn prepare() -> Result<(PathBuf, PathBuf)> {
    let modules = ["torch", "numpy", "pytest", "safetensors", "maturin", "megatron.core", "packaging", "psutil"];
    if let Some(parent) = std::env::var_os(ENV).filter(|p| !p.is_empty()) {
        let parent = PathBuf::from(parent);
        eprintln!("xtask: using {ENV}={}", parent.display());
        let parent_python = pyenv::python(&parent);
        if !pyenv::imports(&parent_python, &modules) {
            bail!("{ENV}={}: its python does not import all of {}", parent.display(), modules.join(", "));
        }
        let child = pyenv::child_venv(&parent_python, &crate::target_dir().join("py-child"))?;
        return Ok((child, maturin_of(&parent)));
    }
    let venv = pyenv::venv("py-venv")?;
    pyenv::ensure(&venv, &["torch"], &[&[TORCH]])?;
    pyenv::ensure(&venv, &["numpy", "pytest", "safetensors", "maturin", "packaging"], &[&TOOLS])?;
    pyenv::ensure(&venv, &["psutil"], &[&["psutil"]])?;
    pyenv::ensure(&venv, &["megatron.core"], &[&["--no-deps", MEGATRON]])?;
    Ok((venv.clone(), maturin_of(&venv)))
}

pub(crate) fn maturin_of(venv: &Path) -> PathBuf {
    let m = venv.join("bin").join("maturin");
    if m.exists() { m } else { PathBuf::from("maturin") }
}
