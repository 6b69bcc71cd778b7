//! The Python with torch and safetensors for `cargo xtask bench --torch`, which hands it to
//! `dckpt bench` as `DCKPT_BENCH_PYTHON` for the PyTorch DCP and safetensors figures.
//!
//! `DCKPT_BENCH_PYTHON` is used as it is when set. Otherwise a venv under `target/torch-venv`
//! gets CPU torch (from PyTorch's CPU wheel index where it can be reached, else plain PyPI,
//! which is a much larger download with CUDA libraries), safetensors and numpy, once. Never
//! part of CI: only `--torch` asks for it.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::pyenv;

pub const ENV: &str = "DCKPT_BENCH_PYTHON";

const CPU_INDEX: &str = "https://download.pytorch.org/whl/cpu";

/// The python for the companion benchmark.
pub fn torch_python() -> Result<PathBuf> {
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
    Ok(pyenv::python(&venv))
}
