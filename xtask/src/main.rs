//! Developer automation for dckpt: `cargo xtask <task>`.
//!
//! - `test`  — first what the house claims about its code ([`checks`]: formatting, clippy
//!   with warnings denied, rustdoc with warnings denied, the fuzz target building, and the
//!   minimum Rust version where it can be checked), then starts a local S3-compatible
//!   server (moto, in a venv under `target/`) unless `DCKPT_TEST_S3_URL` already points at
//!   one, sets `DCKPT_TEST_PYTHON` to a python with msgpack and safetensors (for the
//!   format's Python reader test), and runs the whole test suite against it (which
//!   includes `tests/tests/it/architecture.rs`: the dependency arrows, `rust-version`
//!   against every dependency's, and the size rule); then runs the facade's embedding
//!   example; last builds the Python wheel and runs its pytest tests with torch
//!   (`pytests.rs`; `DCKPT_PY_VENV` names an existing venv to use instead of making one).
//! - `bench [NAME] [--torch] [dckpt bench options]` — benchmarks (`plan`, `storage`, ...);
//!   `--torch` makes a venv with CPU torch, safetensors and megatron-core (`torchenv.rs`),
//!   installs this package's release wheel into a child venv of it and passes that as
//!   `DCKPT_BENCH_PYTHON`, so that the DCP, safetensors, torch_dist and `dckpt.torch`
//!   figures are measured.
//! - `checks` — what `test` runs before the suite, alone.
//! - `pytest` — the Python package's tests alone (wheel, venv, S3 server, pytest).
//! - `tidy` — formatting and lints.

mod pyenv;
mod pytests;
mod s3;
mod torchenv;

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (task, rest) = args.split_first().map(|(t, r)| (t.as_str(), r)).unwrap_or(("help", &[]));
    match task {
        "test" => test(rest),
        "bench" => bench(rest),
        "checks" => checks(),
        "pytest" => {
            let server = s3::ensure_server().context("starting the S3 test server")?;
            pytests::run(&server)
        }
        "tidy" => tidy(),
        "help" | "--help" | "-h" => {
            println!("usage: cargo xtask <test [cargo test args]|checks|pytest|bench [NAME] [--torch] [options]|tidy>");
            Ok(())
        }
        other => bail!("unknown task {other:?}; try `cargo xtask help`"),
    }
}

/// Runs [`checks`], then the whole suite with the S3 server up, built with the `ci`
/// profile: optimized (tests move real bytes) with overflow checks and debug assertions on.
fn test(extra: &[String]) -> Result<()> {
    checks()?;
    let server = s3::ensure_server().context("starting the S3 test server")?;
    let mut cmd = Command::new(cargo());
    cmd.arg("test").args(SUITE).args(extra);
    server.apply_env(&mut cmd);
    let python = pyenv::reader_python().context("preparing the Python that reads checkpoints")?;
    cmd.env("DCKPT_TEST_PYTHON", python);
    let status = cmd.status().context("running cargo test")?;
    if !status.success() {
        bail!("cargo test failed: {status}");
    }
    // The facade's example is what an embedder copies first: it must keep running.
    step("the facade's embedding example runs");
    run(Command::new(cargo()).args(["build", "--quiet"]).args(SUITE).args(["--example", "embed"]))?;
    let dir = tempfile_dir("dckpt-embed-example")?;
    let ran = run(Command::new(target_dir().join("ci").join("examples").join("embed")).arg(&dir));
    let _ = std::fs::remove_dir_all(&dir);
    ran?;
    pytests::run(&server).context("the Python package's tests")
}

/// What the suite builds, for `cargo test` and the binaries the steps after it run: the
/// same packages (so the same features) and profile, so those builds are the suite's (the
/// wheel's too: `crates/py/Cargo.toml` asks for the same features). The Python binding is
/// tested through Python, so the Rust suite needs no Python installation.
pub(crate) const SUITE: [&str; 5] = ["--workspace", "--exclude", "dckpt-py", "--profile", "ci"];

/// A fresh directory under the target directory for one step's files.
fn tempfile_dir(name: &str) -> Result<std::path::PathBuf> {
    let dir = target_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Cargo arguments that include the NCCL backend: it cannot run here (no GPU), but it must
/// keep compiling, lint-free and documented.
const ALL_BACKENDS: [&str; 2] = ["--features", "dckpt-collective/nccl"];

/// What the house claims about its code, cheapest first so that a failure comes early. All
/// share the workspace's target directory and the `ci` profile, so rustdoc and the fuzz
/// target reuse the dependencies clippy checked, and the suite's build the build scripts
/// and proc macros they compiled and ran (aws-lc's C among them).
fn checks() -> Result<()> {
    tidy()?;
    step("rustdoc, warnings denied");
    let flags = std::env::var("RUSTDOCFLAGS").unwrap_or_default();
    let rustdoc = |args: &[&str]| {
        let mut doc = Command::new(cargo());
        doc.args(args).env("RUSTDOCFLAGS", format!("{flags} -D warnings").trim_start());
        run(&mut doc)
    };
    // The CLI's binary is named `dckpt` like the facade, and rustdoc gives both the one
    // directory `target/doc/dckpt` (cargo#6313): documented together they race and delete
    // each other's pages. So the CLI, which `doc = false` keeps out of `cargo doc`, is
    // checked alone first; clearing the directory then makes cargo write the facade's
    // pages back over its.
    rustdoc(&["rustdoc", "--profile", "ci", "-p", "dckpt-cli", "--bin", "dckpt"])?;
    match std::fs::remove_dir_all(target_dir().join("doc").join("dckpt")) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
        _ => {}
    }
    rustdoc(&["doc", "--profile", "ci", "--workspace", "--no-deps", ALL_BACKENDS[0], ALL_BACKENDS[1]])?;
    fuzz_check()?;
    msrv_check()
}

/// The fuzz target is its own workspace (cargo-fuzz runs it on nightly with sanitizers),
/// but it must build on stable: `cargo check` checks the targets, without libFuzzer's C++
/// (its default feature links it, for cargo-fuzz). Without a lock of its own
/// (`fuzz/.gitignore` leaves it out) it starts from the workspace's, so it checks the
/// dependency versions the suite tests and reuses their artifacts.
fn fuzz_check() -> Result<()> {
    step("the fuzz target builds");
    let root = workspace_root();
    let lock = root.join("fuzz/Cargo.lock");
    if !lock.exists() {
        std::fs::copy(root.join("Cargo.lock"), &lock).with_context(|| format!("seeding {}", lock.display()))?;
    }
    let manifest = root.join("fuzz/Cargo.toml");
    run(Command::new(cargo())
        .args(["check", "--profile", "ci", "--no-default-features", "--manifest-path"])
        .arg(manifest)
        .arg("--target-dir")
        .arg(target_dir()))
}

/// `rust-version` against the language. Clippy's `incompatible_msrv` (in [`tidy`]) reads
/// `rust-version` and denies standard-library items that are newer; the architecture test
/// denies dependencies that need a newer Rust. No tool of a newer toolchain knows when a
/// language feature (let-chains: 1.88) was stabilized, so that part needs the old
/// toolchain itself: with it installed, the workspace is checked with it; without it, this
/// says what was not checked rather than pass silently.
fn msrv_check() -> Result<()> {
    let msrv = rust_version()?;
    step(&format!("the workspace builds with Rust {msrv} (rust-version)"));
    let list = Command::new("rustup").args(["toolchain", "list"]).output();
    let installed = list.ok().and_then(|o| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .find(|t| t.strip_prefix(msrv.as_str()).is_some_and(|rest| rest.starts_with(['.', '-'])))
            .map(str::to_string)
    });
    let Some(toolchain) = installed else {
        println!(
            "xtask: Rust {msrv} is not installed, so language features newer than rust-version are not checked \
             (standard-library items and dependencies are); `rustup toolchain install {msrv} --profile minimal` \
             makes this step check them"
        );
        return Ok(());
    };
    let mut cmd = Command::new("rustup");
    cmd.args(["run", &toolchain, "cargo", "check", "--workspace", "--all-targets", "--locked"]);
    // Its own directory: artifacts of another compiler would only evict these.
    cmd.arg("--target-dir").arg(target_dir().join("msrv"));
    for var in ["CARGO", "RUSTC", "RUSTDOC", "RUSTUP_TOOLCHAIN"] {
        cmd.env_remove(var);
    }
    run(cmd.env("RUSTUP_AUTO_INSTALL", "0"))
}

/// `rust-version` of `[workspace.package]` in the root manifest.
fn rust_version() -> Result<String> {
    let path = workspace_root().join("Cargo.toml");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("rust-version").map(str::trim))
        .and_then(|rest| rest.strip_prefix('='))
        .with_context(|| format!("no rust-version in {}", path.display()))?;
    let v = line.trim().trim_matches('"');
    if v.is_empty() || !v.split('.').all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())) {
        bail!("rust-version {v:?} in {} is not a version like 1.88", path.display());
    }
    Ok(v.to_string())
}

pub(crate) fn workspace_root() -> PathBuf {
    // xtask/ is one level below the root.
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask has a parent directory").to_path_buf()
}

pub(crate) fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("target"))
}

pub(crate) fn step(what: &str) {
    eprintln!("xtask: {what}");
}

fn bench(rest: &[String]) -> Result<()> {
    let torch = rest.iter().any(|a| a == "--torch");
    let rest: Vec<&String> = rest.iter().filter(|a| *a != "--torch").collect();
    let name = rest.first().map(|s| s.as_str()).unwrap_or("all");
    let needs_s3 = matches!(name, "storage" | "s3" | "fanout" | "all");
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
    step("formatting");
    run(Command::new(cargo()).args(["fmt", "--all", "--", "--check"]))?;
    step("clippy, warnings denied (incompatible_msrv among them)");
    run(Command::new(cargo())
        .args(["clippy", "--workspace", "--all-targets", "--profile", "ci"])
        .args(ALL_BACKENDS)
        .args(["--", "-D", "warnings"]))
}

pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

pub(crate) fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}
