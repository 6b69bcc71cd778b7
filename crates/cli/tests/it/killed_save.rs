//! A save killed with SIGKILL while it writes leaves its temporaries (`.dckpt-tmp.*`) behind.
//! `dckpt validate` lists them as leftovers with their sizes (exit 0: the checkpoint there is
//! sound), `--remove-leftovers` removes them, and, in another round, the next successful save
//! into the directory removes them.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_dckpt");

/// A save of about 370 MB on one rank: a second or more of writing, so the kill lands while
/// its data file is a temporary.
const BIG: [&str; 8] = ["demo", "--model", "gpt-small", "--world", "1", "--optimizer", "none", "--json"];

/// Attempts at a kill that leaves temporaries: one that lands just after the last rename
/// leaves none, and is tried again.
const KILLS_MAX: usize = 5;

/// How long the big save may take to create its first temporary.
const IN_FLIGHT_WITHIN: Duration = Duration::from_secs(120);

fn dckpt(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("running dckpt")
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("dckpt-cli-killed").tempdir().expect("temp dir")
}

/// The temporaries in `dir`, as `(name, bytes)`, sorted by name.
fn temporaries(dir: &Path) -> Vec<(String, u64)> {
    let mut found: Vec<(String, u64)> = std::fs::read_dir(dir)
        .expect("read dir")
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            let bytes = e.metadata().ok()?.len();
            name.starts_with(".dckpt-tmp").then_some((name, bytes))
        })
        .collect();
    found.sort();
    found
}

/// The leftovers validate reports for these temporaries.
fn as_leftovers(temps: &[(String, u64)]) -> Value {
    temps.iter().map(|(name, bytes)| json!({"path": name, "bytes": bytes, "kind": "unfinished_write"})).collect()
}

/// Kills the process on drop, so that a failing test leaves no save running.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the big save into `dir`, SIGKILLs it once a temporary exists, and returns the
/// temporaries it left.
fn killed_save(dir: &Path) -> Vec<(String, u64)> {
    for _ in 0..KILLS_MAX {
        let child = Command::new(BIN)
            .args(BIG)
            .args(["--dir", s(dir)])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting the save");
        let mut save = Running(child);
        let start = Instant::now();
        while temporaries(dir).is_empty() {
            if let Some(status) = save.0.try_wait().expect("polling the save") {
                panic!("the save ended ({status}) before a temporary of it was seen in {}", dir.display());
            }
            assert!(start.elapsed() < IN_FLIGHT_WITHIN, "no temporary within {IN_FLIGHT_WITHIN:?}");
            std::thread::sleep(Duration::from_millis(2));
        }
        save.0.kill().expect("SIGKILL"); // `Child::kill` is SIGKILL on Unix
        let status = save.0.wait().expect("reaping the save");
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
        let left = temporaries(dir);
        if !left.is_empty() {
            return left;
        }
        // Killed just after its file was published: start again from an empty directory.
        for e in std::fs::read_dir(dir).expect("read dir") {
            std::fs::remove_file(e.expect("entry").path()).expect("clearing the directory");
        }
    }
    panic!("{KILLS_MAX} kills of a save in flight left no temporary");
}

/// `--replace` where the demo has it (it replaces by default where it has not).
fn replace_flag() -> Vec<&'static str> {
    let help = dckpt(&["demo", "--help"]);
    if String::from_utf8_lossy(&help.stdout).contains("--replace") { vec!["--replace"] } else { vec![] }
}

#[test]
fn temporaries_of_a_killed_save_are_leftovers_until_removed_or_saved_over() {
    // Round 1: a killed save next to a committed checkpoint; validate lists and removes.
    let dir = tmp();
    let left = killed_save(dir.path());
    let small = tmp();
    let made = dckpt(&["demo", "--model", "tiny", "--dir", s(small.path()), "--json"]);
    assert_eq!(made.status.code(), Some(0), "{}", String::from_utf8_lossy(&made.stderr));
    for e in std::fs::read_dir(small.path()).expect("read dir") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), dir.path().join(e.file_name())).expect("copying the checkpoint");
    }
    let o = dckpt(&["validate", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let report = json(&o);
    assert_eq!(report["status"], "sound");
    assert_eq!(report["leftovers"], as_leftovers(&left), "{report}");
    let human = dckpt(&["validate", s(dir.path())]);
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(text.contains(&left[0].0) && text.contains("unfinished write of a dead process"), "{text}");
    let o = dckpt(&["validate", s(dir.path()), "--json", "--remove-leftovers"]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let report = json(&o);
    assert_eq!(report["removed"], as_leftovers(&left), "{report}");
    assert_eq!(report["leftovers"], json!([]), "{report}");
    assert_eq!(temporaries(dir.path()), vec![]);

    // Round 2: a killed first save is no checkpoint, but its temporaries are named; the next
    // successful save into the directory removes them.
    let dir = tmp();
    let left = killed_save(dir.path());
    let o = dckpt(&["validate", s(dir.path()), "--json"]);
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    let report = json(&o);
    assert_eq!(report["status"], "not a checkpoint");
    assert_eq!(report["leftovers"], as_leftovers(&left), "{report}");
    assert!(report["reason"].as_str().is_some_and(|r| r.contains("unfinished writes of dead processes")), "{report}");
    let mut args = vec!["demo", "--model", "tiny", "--dir", s(dir.path()), "--json"];
    args.extend(replace_flag());
    let saved = dckpt(&args);
    assert_eq!(saved.status.code(), Some(0), "{}", String::from_utf8_lossy(&saved.stderr));
    assert_eq!(temporaries(dir.path()), vec![], "the save left what the killed one had");
    let report = json(&dckpt(&["validate", s(dir.path()), "--json"]));
    assert_eq!((&report["status"], &report["leftovers"]), (&json!("sound"), &json!([])), "{report}");
}
