//! The Python that the format tests use to read a checkpoint with standard packages
//! (`scripts/read_checkpoint.py`). Owned by the format work.
//!
//! `reader_python` uses `DCKPT_TEST_PYTHON` as it is when set. Otherwise it reuses the venv
//! under `target/moto-venv` that the S3 helper (`s3.rs`) creates (creating it if it is not
//! there yet), installs `msgpack` and `safetensors` into it once, and returns its `python`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// What the reader needs; `safetensors` parses the data files (it needs no numpy).
const PACKAGES: [&str; 2] = ["msgpack>=1,<2", "safetensors>=0.4,<1"];

/// The python to run the reader with, for `DCKPT_TEST_PYTHON`.
pub fn reader_python() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("DCKPT_TEST_PYTHON") {
        eprintln!("xtask: using DCKPT_TEST_PYTHON={}", Path::new(&p).display());
        return Ok(PathBuf::from(p));
    }
    let venv = workspace_root().join("target").join("moto-venv");
    let python = venv.join("bin").join("python");
    if !python.exists() {
        let base = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
        run(Command::new(&base).arg("-m").arg("venv").arg(&venv))
            .with_context(|| format!("creating a Python venv with `{base} -m venv` (is python3-venv installed?)"))?;
    }
    if !imports(&python) {
        eprintln!("xtask: installing {} into {}", PACKAGES.join(", "), venv.display());
        let pip = venv.join("bin").join("pip");
        run(Command::new(&pip).args(["install", "--quiet", "--disable-pip-version-check"]).args(PACKAGES))
            .with_context(|| format!("installing {} from PyPI", PACKAGES.join(", ")))?;
        if !imports(&python) {
            bail!("{} cannot import msgpack and safetensors after installing them", python.display());
        }
    }
    Ok(python)
}

fn imports(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", "import msgpack, safetensors"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn workspace_root() -> PathBuf {
    let xtask = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().unwrap_or(xtask).to_path_buf()
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}
