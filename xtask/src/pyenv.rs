//! Python venvs under `target/` for the tasks that need Python packages.
//!
//! `venv` creates one (with `$PYTHON -m venv`, default `python3`) unless it is there, and
//! `ensure` pip-installs into it unless its python already imports the given modules.
//!
//! `reader_python` is the Python that the format tests use to read a checkpoint with
//! standard packages (`scripts/read_checkpoint.py`; owned by the format work): it uses
//! `DCKPT_TEST_PYTHON` as it is when set, else the venv under `target/moto-venv` that the S3
//! helper (`s3.rs`) creates (creating it if it is not there yet), with `msgpack` and
//! `safetensors` installed into it once. `child_venv` makes a venv that sees another's
//! packages and holds only the wheel installed into it.

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
    let venv = venv("moto-venv")?;
    ensure(&venv, &["msgpack", "safetensors"], &[&PACKAGES])?;
    Ok(python(&venv))
}

/// `target/<name>`, a venv, created unless it has a python already.
pub fn venv(name: &str) -> Result<PathBuf> {
    let venv = workspace_root().join("target").join(name);
    if !python(&venv).exists() {
        let base = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
        run(Command::new(&base).arg("-m").arg("venv").arg(&venv))
            .with_context(|| format!("creating a Python venv with `{base} -m venv` (is python3-venv installed?)"))?;
    }
    Ok(venv)
}

/// The venv's python.
pub fn python(venv: &Path) -> PathBuf {
    venv.join("bin").join("python")
}

/// Unless the venv's python imports all of `modules`, runs `pip install` with each of
/// `attempts` in turn until one succeeds, then checks the imports again.
pub fn ensure(venv: &Path, modules: &[&str], attempts: &[&[&str]]) -> Result<()> {
    let py = python(venv);
    if imports(&py, modules) {
        return Ok(());
    }
    let pip = venv.join("bin").join("pip");
    let mut failures = Vec::new();
    for args in attempts {
        eprintln!("xtask: pip install {} into {}", args.join(" "), venv.display());
        let status =
            Command::new(&pip).args(["install", "--quiet", "--disable-pip-version-check"]).args(*args).status();
        match status {
            Ok(s) if s.success() => break,
            Ok(s) => failures.push(format!("`pip install {}`: {s}", args.join(" "))),
            Err(e) => failures.push(format!("`pip install {}`: {e}", args.join(" "))),
        }
    }
    if failures.len() == attempts.len() {
        bail!("installing into {} failed: {}", venv.display(), failures.join("; "));
    }
    if !imports(&py, modules) {
        bail!("{} cannot import {} after installing them", py.display(), modules.join(", "));
    }
    Ok(())
}

/// Whether `python` imports every one of `modules` (quietly).
pub fn imports(python: &Path, modules: &[&str]) -> bool {
    Command::new(python)
        .args(["-c", &format!("import {}", modules.join(", "))])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `child`, a venv made from `parent_python` that imports the parent venv's packages and
/// holds only what is installed into it (the wheel under test): a `.pth` file in its
/// site-packages names the parent's (a venv's `--system-site-packages` sees its base
/// interpreter's packages, not its parent venv's). Made unless there; returns `child`.
pub fn child_venv(parent_python: &Path, child: &Path) -> Result<PathBuf> {
    if !python(child).exists() {
        run(Command::new(parent_python).args(["-m", "venv", "--system-site-packages"]).arg(child))?;
    }
    let site = |python: &Path| -> Result<String> {
        let out = Command::new(python)
            .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
            .output()
            .with_context(|| format!("running {}", python.display()))?;
        if !out.status.success() {
            bail!("{} could not tell its site-packages", python.display());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let parent_site = site(parent_python)?;
    let pth = PathBuf::from(site(&python(child))?).join("dckpt-parent-venv.pth");
    std::fs::write(&pth, format!("{parent_site}\n")).with_context(|| format!("writing {}", pth.display()))?;
    Ok(child.to_path_buf())
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
