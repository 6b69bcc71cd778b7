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
const TOOLS: [&str; 5] = ["numpy", "pytest", "safetensors>=0.4,<1", "maturin==1.16.*", "packaging"];
const MEGATRON: &str = "megatron-core==0.16.1";

/// Builds the wheel, prepares the venv, runs pytest.
pub fn run(server: &s3::Server) -> Result<()> {
    let root = crate::workspace_root();
    let (venv, maturin) = prepare()?;
    let wheels = crate::target_dir().join("wheels");
    // Only this build's wheel is installed.
    if let Ok(entries) = std::fs::read_dir(&wheels) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("dckpt-") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    crate::step("the Python wheel builds (maturin, profile ci)");
    let mut build = Command::new(&maturin);
    build.args(["build", "--profile", "ci", "--out"]).arg(&wheels).current_dir(&root);
    build.env("CARGO_TARGET_DIR", crate::target_dir());
    crate::run(&mut build)?;
    let wheel = std::fs::read_dir(&wheels)
        .with_context(|| format!("reading {}", wheels.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("dckpt-")))
        .with_context(|| format!("maturin left no dckpt wheel in {}", wheels.display()))?;
    let pip = venv.join("bin").join("pip");
    crate::run(
        Command::new(&pip)
            .args(["install", "--quiet", "--disable-pip-version-check", "--no-deps", "--force-reinstall"])
            .arg(&wheel),
    )?;
    // The round trips of `dckpt convert` / `export` through PyTorch, Megatron and
    // safetensors (python/tests/test_convert.py) run the CLI binary itself.
    crate::step("the dckpt binary for the conversion round trips (profile ci)");
    crate::run(Command::new(crate::cargo()).args(["build", "--profile", "ci", "-p", "dckpt-cli", "--bin", "dckpt"]))?;
    let dckpt_bin = crate::target_dir().join("ci").join("dckpt");
    crate::step("the Python package's tests (pytest)");
    let mut pytest = Command::new(pyenv::python(&venv));
    pytest.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"]).arg(root.join("python/tests")).current_dir(&root);
    server.apply_env(&mut pytest);
    pytest.env("DCKPT_BIN", &dckpt_bin);
    let status = pytest.status().context("running pytest")?;
    match status.code() {
        Some(0) => Ok(()),
        Some(5) => bail!("pytest collected no tests in python/tests"),
        _ => bail!("pytest failed: {status}"),
    }
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
        let child = crate::target_dir().join("py-child");
        if !pyenv::python(&child).exists() {
            crate::run(Command::new(&parent_python).args(["-m", "venv", "--system-site-packages"]).arg(&child))?;
        }
        see_parent_packages(&parent_python, &child)?;
        return Ok((child, maturin_of(&parent)));
    }
    let venv = pyenv::venv("py-venv")?;
    pyenv::ensure(&venv, &["torch"], &[&[TORCH]])?;
    pyenv::ensure(&venv, &["numpy", "pytest", "safetensors", "maturin", "packaging"], &[&TOOLS])?;
    pyenv::ensure(&venv, &["psutil"], &[&["psutil"]])?;
    pyenv::ensure(&venv, &["megatron.core"], &[&["--no-deps", MEGATRON]])?;
    Ok((venv.clone(), maturin_of(&venv)))
}

/// A `.pth` file in the child's site-packages naming the parent's, so the child imports
/// the parent's packages and holds only the wheel itself.
fn see_parent_packages(parent_python: &Path, child: &Path) -> Result<()> {
    let paths = |python: &Path| -> Result<String> {
        let out = Command::new(python)
            .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
            .output()
            .with_context(|| format!("running {}", python.display()))?;
        if !out.status.success() {
            bail!("{} could not tell its site-packages", python.display());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let parent_site = paths(parent_python)?;
    let child_site = PathBuf::from(paths(&pyenv::python(child))?);
    let pth = child_site.join("dckpt-parent-venv.pth");
    std::fs::write(&pth, format!("{parent_site}\n")).with_context(|| format!("writing {}", pth.display()))
}

fn maturin_of(venv: &Path) -> PathBuf {
    let m = venv.join("bin").join("maturin");
    if m.exists() { m } else { PathBuf::from("maturin") }
}
