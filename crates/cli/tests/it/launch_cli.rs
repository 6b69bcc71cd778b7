//! `dckpt launch` of many processes: a 64-rank job of the tiny demo over TCP, saved in one
//! layout and loaded, every element checked, in another; and a launcher whose descriptor
//! limit cannot hold the job's pipes refusing it up front.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_dckpt");

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn sixty_four_processes_save_and_load_in_another_layout_over_tcp() {
    let dir = tempfile::Builder::new().prefix("dckpt-cli-launch").tempdir().expect("temp dir");
    let layouts = "--world 64 --tp 2 --pp 4 --ep 4 --optimizer distributed --load-world 64 --load-tp 4 --load-pp 2";
    let mut args: Vec<&str> = vec!["launch", "--nproc", "64", "--", BIN, "demo", "--model", "tiny"];
    args.extend(layouts.split(' '));
    args.extend(["--dir", s(dir.path()), "--json"]);
    let started = Instant::now();
    let o = Command::new(BIN).args(&args).output().expect("running dckpt launch");
    let took = started.elapsed();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out.lines().find_map(|l| l.strip_prefix("[rank 0] ")).unwrap_or_else(|| panic!("no rank 0 line: {out}"));
    let v: serde_json::Value = serde_json::from_str(line).expect("rank 0 prints JSON");
    assert_eq!(v["ranks_as"], "processes");
    assert_eq!(v["verified"], true);
    assert_eq!(v["saved_bytes"], v["expected_bytes"]);
    assert_eq!(v["rank_bytes"].as_array().expect("rank_bytes").len(), 64);
    assert!(v["elements_checked"].as_u64().expect("elements_checked") > 0, "{line}");
    // Generous for a loaded machine of two cores; it takes about a second alone.
    assert!(took < Duration::from_secs(60), "64 processes took {took:?}");
}

#[test]
fn a_launcher_without_descriptors_for_every_pipe_refuses_naming_the_limit() {
    let script = r#"ulimit -n 100 && exec "$0" launch --nproc 64 -- true"#;
    let o = Command::new("sh").args(["-c", script]).arg(BIN).output().expect("running dckpt launch");
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("64 processes need 192 open files"), "{e}");
    assert!(e.contains("RLIMIT_NOFILE is 100 (hard limit 100)"), "{e}");
}

/// Whether process `pid` still runs (a zombie has finished).
fn running(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
}

/// A launcher stopped by SIGTERM (a scheduler's, or Ctrl-C, or a closed terminal) takes each
/// rank's own children with it. Before, the signal killed the launcher alone, the ranks died
/// of its death, and what they had started (here a `sleep`) ran on.
#[test]
fn a_launcher_stopped_by_a_signal_takes_every_ranks_children_with_it() {
    let dir = tempfile::Builder::new().prefix("dckpt-cli-launch-stop").tempdir().expect("temp dir");
    let script = format!("sleep 300 & echo $! > {}/$RANK.pid; wait", s(dir.path()));
    let mut launcher = Command::new(BIN)
        .args(["launch", "--nproc", "2", "--", "sh", "-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("running dckpt launch");
    let started = Instant::now();
    let pid_of = |rank: usize| std::fs::read_to_string(dir.path().join(format!("{rank}.pid"))).ok();
    let pids: Vec<String> = loop {
        if let (Some(a), Some(b)) = (pid_of(0), pid_of(1))
            && a.ends_with('\n')
            && b.ends_with('\n')
        {
            break vec![a.trim().to_string(), b.trim().to_string()];
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the ranks never started their children");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(pids.iter().all(|p| running(p)), "{pids:?}");
    let signalled = Command::new("kill").args(["-TERM", &launcher.id().to_string()]).status().expect("kill");
    assert!(signalled.success());
    let status = launcher.wait().expect("the launcher exits");
    assert_eq!(status.code(), Some(128 + 15), "{status:?}");
    let stopped = Instant::now();
    while pids.iter().any(|p| running(p)) {
        assert!(stopped.elapsed() < Duration::from_secs(10), "a rank's child outlived the launcher: {pids:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
