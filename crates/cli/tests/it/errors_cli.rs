//! What `dckpt` says, and with which exit code, when the environment is against it: a FIFO
//! where a file should be, a directory it cannot create or change, a damaged metadata file
//! with `--json`.
//!
//! Permission errors need a process that permissions apply to. Running as root (as CI
//! does), the test runs `dckpt` as the user `nobody` (uid 65534) on directories root owns;
//! otherwise it takes write permission away from the directory itself. Either way the
//! command meets a real EACCES on the same call as an operator would.

#![cfg(unix)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_dckpt");
/// Far longer than any of these commands takes, far shorter than a hang.
const BOUND: Duration = Duration::from_secs(60);
const PERMISSION_DENIED: &str = "Permission denied (os error 13)";

/// Runs `cmd`, killing it (and failing) if it has not exited within [`BOUND`].
fn bounded(mut cmd: Command) -> Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting dckpt");
    let start = Instant::now();
    while child.try_wait().expect("waiting for dckpt").is_none() {
        if start.elapsed() > BOUND {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not exit within {BOUND:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("dckpt's output")
}

fn dckpt(args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args);
    bounded(c)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("dckpt-cli-errors").tempdir().expect("temp dir")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a plain system call with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

fn demo_into(dir: &Path) {
    let o = dckpt(&["demo", "--model", "tiny", "--world", "2", "--tp", "2", "--dir", s(dir), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

fn data_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

fn is_root() -> bool {
    // SAFETY: a plain system call without arguments.
    unsafe { libc::geteuid() == 0 }
}

/// Runs `dckpt args` where writing into `dir` is denied: as `nobody` when this is root
/// (`dir` is root's), else with `dir` made read-only for the call.
fn denied_in(dir: &Path, args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args);
    if is_root() {
        // `nobody` must reach `dir` (temporary directories start private) but not write it.
        for d in dir.ancestors().take_while(|d| d.starts_with(std::env::temp_dir()) && *d != std::env::temp_dir()) {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        c.uid(65534).gid(65534);
        bounded(c)
    } else {
        let before = std::fs::metadata(dir).unwrap().permissions();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o555)).unwrap();
        let o = bounded(c);
        std::fs::set_permissions(dir, before).unwrap();
        o
    }
}

#[test]
fn a_fifo_as_the_metadata_file_is_refused_at_once_naming_it() {
    let dir = tmp();
    mkfifo(&dir.path().join("dckpt.meta"));
    let meta = s(&dir.path().join("dckpt.meta")).to_string();
    for cmd in ["inspect", "validate"] {
        let o = dckpt(&[cmd, s(dir.path())]);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {}", stderr(&o));
        assert!(stderr(&o).contains(&meta) && stderr(&o).contains("FIFO"), "{cmd}: {}", stderr(&o));
    }
    let o = dckpt(&["inspect", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let j = json(&o);
    assert!(j["error"].as_str().is_some_and(|e| e.contains(&meta) && e.contains("FIFO")), "{j}");
    let o = dckpt(&["validate", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let j = json(&o);
    assert_eq!(j["sound"], false, "{j}");
    assert!(j["problems"][0].as_str().is_some_and(|p| p.contains("FIFO")), "{j}");
}

#[test]
fn a_fifo_as_a_data_file_is_named_as_a_fifo_not_as_missing() {
    let dir = tmp();
    demo_into(dir.path());
    let victim = data_files(dir.path()).pop().expect("a data file");
    std::fs::remove_file(&victim).unwrap();
    mkfifo(&victim);
    let name = victim.file_name().unwrap().to_str().unwrap();
    let o = dckpt(&["validate", s(dir.path())]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains(name) && err.contains("FIFO") && !err.contains("not found"), "{err}");
}

#[test]
fn a_demo_whose_directory_cannot_be_created_fails_the_job_with_exit_one() {
    // A parent that is a file: the same failure to create the directory, for every user.
    let dir = tmp();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let target = file.join("new");
    let o = dckpt(&["demo", "--model", "tiny", "--dir", s(&target)]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains(s(&target)), "{err}");
    assert_eq!(err.matches("Not a directory (os error 20)").count(), 1, "{err}");
    // A parent this user may not write.
    let parent = dir.path().join("parent");
    std::fs::create_dir(&parent).unwrap();
    let target = parent.join("new");
    let o = denied_in(&parent, &["demo", "--model", "tiny", "--dir", s(&target)]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains(s(&target)), "{err}");
    assert_eq!(err.matches(PERMISSION_DENIED).count(), 1, "said once: {err}");
    assert!(!target.exists());
    // Options that name no store are still invalid options.
    let o = dckpt(&["demo", "--model", "tiny", "--dir", "file://relative/path"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

#[test]
fn leftovers_that_cannot_be_removed_fail_validate_with_exit_one_not_two() {
    let dir = tmp();
    demo_into(dir.path());
    let stray = dir.path().join("0123456789abcdef-00003.safetensors");
    std::fs::write(&stray, b"from a failed save").unwrap();
    let o = denied_in(dir.path(), &["validate", s(dir.path()), "--remove-leftovers"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("removing leftovers") && err.contains("0123456789abcdef-00003.safetensors"), "{err}");
    assert_eq!(err.matches(PERMISSION_DENIED).count(), 1, "said once: {err}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("NOT REMOVED"));
    assert!(stray.exists());
    let o = denied_in(dir.path(), &["validate", s(dir.path()), "--remove-leftovers", "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let j = json(&o);
    // The checkpoint is sound; what was asked for did not happen.
    assert_eq!((&j["sound"], &j["status"]), (&true.into(), &"sound".into()), "{j}");
    assert!(j["remove_error"].as_str().is_some_and(|e| e.contains(PERMISSION_DENIED)), "{j}");
    assert_eq!(j["removed"].as_array().map(Vec::len), Some(0), "{j}");
    // Allowed, the same call removes it and succeeds.
    let o = dckpt(&["validate", s(dir.path()), "--remove-leftovers"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stray.exists());
}

#[test]
fn inspect_json_reports_every_failure_as_one_object_with_the_same_exit_code() {
    let dir = tmp();
    // Nothing there.
    let o = dckpt(&["inspect", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let j = json(&o);
    assert_eq!(j["location"], s(dir.path()));
    assert!(j["error"].as_str().is_some_and(|e| e.contains("not a checkpoint")), "{j}");
    // A metadata file cut short: damaged, and the lengths compared are both file lengths.
    demo_into(dir.path());
    let meta = dir.path().join("dckpt.meta");
    let bytes = std::fs::read(&meta).unwrap();
    std::fs::write(&meta, &bytes[..bytes.len() - 10]).unwrap();
    let o = dckpt(&["inspect", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = json(&o)["error"].as_str().unwrap_or_default().to_string();
    let want = format!("so a {}-byte file, but the file has {} bytes", bytes.len(), bytes.len() - 10);
    assert!(e.contains("body_length") && e.contains(&want), "{e}");
    // A newer format: the hint travels too.
    let mut newer = bytes.clone();
    newer[8] = 2;
    std::fs::write(&meta, &newer).unwrap();
    let o = dckpt(&["inspect", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let j = json(&o);
    assert!(j["hint"].as_str().is_some_and(|h| h.contains("newer dckpt")), "{j}");
    // A location that names no store.
    let o = dckpt(&["inspect", "file://relative", "--json"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(json(&o)["error"].as_str().is_some_and(|e| e.contains("file://relative")), "{}", stderr(&o));
    // Success is still the report, not an error object.
    std::fs::write(&meta, &bytes).unwrap();
    let o = dckpt(&["inspect", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let j = json(&o);
    assert!(j.get("error").is_none() && j["tensors"].is_array(), "{j}");
}

/// Every `--json` command prints one error object on stdout when it fails, naming what
/// failed: a bad option (plan, bench), a usage error clap finds (an unknown flag, a value out
/// of range), a failed demo, a run root that is a file (listed as an empty run), and an
/// output that is there already (named as the output, not the source). Those printed
/// nothing on stdout, or named SRC.
#[test]
fn every_json_failure_is_one_object_naming_what_failed() {
    let usage =
        [&["inspect", "somewhere", "--json", "--bogus"][..], &["gc", "somewhere", "--json", "--keep-every", "0"]];
    for args in
        [&["plan", "--json", "--world", "3", "--tp", "2"][..], &["bench", "nope", "--json"]].into_iter().chain(usage)
    {
        let o = dckpt(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        let j = json(&o);
        assert!(j["error"].as_str().is_some_and(|e| !e.is_empty()) && j["location"] == "", "{args:?}: {j}");
    }
    let dir = tmp();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let o = dckpt(&["demo", "--dir", s(&file.join("ckpt")), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let j = json(&o);
    assert!(j["error"].as_str().is_some_and(|e| e.contains("a-file")), "{j}");
    for cmd in ["ls", "gc"] {
        let o = dckpt(&[cmd, s(&file), "--json"]);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {}", stderr(&o));
        assert!(json(&o)["error"].as_str().is_some_and(|e| e.contains("not a directory")), "{cmd}: {}", stderr(&o));
    }
    let (src, out) = (dir.path().join("src"), dir.path().join("out"));
    demo_into(&src);
    let o = dckpt(&["export", s(&src), s(&out), "--format", "safetensors", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = dckpt(&["export", s(&src), s(&out), "--format", "safetensors", "--json"]);
    assert_ne!(o.status.code(), Some(0), "{}", stderr(&o));
    let j = json(&o);
    assert_eq!(j["location"], s(&out), "{j}");
    assert!(j["error"].as_str().is_some_and(|e| e.contains("already exists")), "{j}");
}

/// Wrong input meets exit 2 and a message naming what to change: a usage error's JSON names
/// the missing flag (only its first line, "the following required arguments were not
/// provided:", was kept); a world past the CLI's bound is refused before anything is held for
/// it (a mistyped one aborted on memory); a named safetensors file that is not there is a
/// source that cannot be opened (it exited 1, as a failed job); a local tier that cannot be
/// placed is an invalid option (it exited 1), as are a run of no steps and a node to lose
/// that the job does not have. A conversion refused at an occupied DST names DST (it named
/// SRC).
#[test]
fn wrong_input_exits_two_naming_what_to_change() {
    let d = tmp();
    let o = dckpt(&["export", "x", "e", "--json"]);
    assert_eq!(
        (o.status.code(), json(&o)["error"].as_str()),
        (Some(2), Some("the following required arguments were not provided: --format <FORMAT>"))
    );
    let o = dckpt(&["plan", "--model", "tiny", "--world", "4294967295", "--json"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(json(&o)["error"].as_str().unwrap().contains("a world of 1 to 65536 ranks"), "{}", stderr(&o));
    let missing = d.path().join("nonexist.safetensors");
    for args in [
        vec!["export", s(&missing), s(&d.path().join("e")), "--format", "safetensors"],
        vec!["convert", s(&missing), s(&d.path().join("c"))],
    ] {
        let o = dckpt(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("not found"), "{args:?}: {}", stderr(&o));
    }
    let run = d.path().join("run");
    let nodes = d.path().join("nodes").join("{node}");
    let o = dckpt(&[
        "demo",
        "--run",
        s(&run),
        "--steps",
        "1",
        "--model",
        "tiny",
        "--local",
        s(&nodes),
        "--ranks-per-node",
        "2",
        "--local-copies",
        "0",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("invalid options"), "{}", stderr(&o));
    // A run that could only save nothing or lose a node it does not have "FAILED" without a
    // reason, or said nothing.
    for (extra, says) in
        [(["--steps", "0"], "--steps 0 saves nothing"), (["--lose-node", "99"], "the job has nodes 0 to 3")]
    {
        let mut args = vec!["demo", "--run", s(&run), "--model", "tiny", "--local", s(&nodes), "--ranks-per-node", "2"];
        args.extend(if extra[0] == "--steps" { extra.to_vec() } else { [&["--steps", "1"][..], &extra[..]].concat() });
        let o = dckpt(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{args:?}: {}", stderr(&o));
    }
    let (src, tdist, back) = (d.path().join("src"), d.path().join("tdist"), d.path().join("back"));
    demo_into(&src);
    assert!(dckpt(&["convert", s(&src), s(&tdist), "--to", "torch_dist"]).status.success());
    assert!(dckpt(&["convert", s(&tdist), s(&back)]).status.success());
    let o = dckpt(&["convert", s(&tdist), s(&back), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(json(&o)["location"].as_str(), Some(s(&back)), "{}", stderr(&o));
}
