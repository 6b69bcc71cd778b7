//! The Python for `cargo xtask bench --torch`, which hands it to `dckpt bench` as
//! `DCKPT_BENCH_PYTHON` for the PyTorch DCP, safetensors, torch_dist and `dckpt.torch`
//! figures.
//!
//! The base Python is `DCKPT_BENCH_PYTHON` when set, used as it is. Otherwise a venv under
//! `target/torch-venv` gets CPU torch (from PyTorch's CPU wheel index where it can be
//! reached, else plain PyPI, which is a much larger download with CUDA libraries),
//! safetensors, numpy, maturin and megatron-core, once. Either way this package's wheel is
//! built with the release profile (what users install, not the suite's `ci` profile with its
//! debug assertions) and installed into `target/bench-py`, a child venv of the base that
//! sees its packages. Never part of CI: only `--torch` asks for it.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::pyenv;
use crate::pytests::{self, MATURIN, MEGATRON};

pub const ENV: &str = "DCKPT_BENCH_PYTHON";

const CPU_INDEX: &str = "https://download.pytorch.org/whl/cpu";

/// The python for the companion benchmark: the base with the release wheel.
pub fn torch_python() -> Result<PathBuf> {
    let base = base_python()?;
    let child = pyenv::child_venv(&base, &crate::target_dir().join("bench-py"))?;
    // maturin next to the base python, else installed into the child.
    let mut maturin = base.with_file_name("maturin");
    if !maturin.exists() {
        pyenv::ensure(&child, &["maturin"], &[&[MATURIN]])?;
        maturin = child.join("bin").join("maturin");
    }
    let wheel = pytests::build_wheel(&maturin, "release", &crate::target_dir().join("wheels-release"))?;
    pytests::install_wheel(&child, &wheel)?;
    Ok(pyenv::python(&child))
}

fn base_python() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(ENV).filter(|p| !p.is_empty()) {
        eprintln!("xtask: using {ENV}={}", Path::new(&p).display());
        return Ok(PathBuf::from(p));
    }
    let venv = pyenv::venv("torch-venv")?;
    // The CPU index first, giving up fast where it cannot be reached; then PyPI.
    pyenv::ensure(
        &venv,
        &["torch", "torch.distributed.checkpoint"],
        &[&["--retries", "0", "--timeout", "20", "--index-url", CPU_INDEX, "torch"], &["torch"]],
    )?;
    pyenv::ensure(&venv, &["safetensors", "numpy"], &[&["safetensors>=0.4,<1", "numpy"]])?;
    pyenv::ensure(&venv, &["maturin"], &[&[MATURIN]])?;
    pyenv::ensure(&venv, &["packaging", "psutil"], &[&["packaging", "psutil"]])?;
    pyenv::ensure(&venv, &["megatron.core"], &[&["--no-deps", MEGATRON]])?;
    Ok(pyenv::python(&venv))
}
