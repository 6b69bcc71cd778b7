//! `dckpt demo --run`, `dckpt ls` and `dckpt gc` over a run root: a run killed with SIGKILL
//! in the middle of a step's save resumes from the last committed step, `ls --json` tells
//! the dead step apart, and `gc` removes what it left; retention and `gc --keep-last`.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_dckpt");

/// A small run: the tiny model on two ranks (tp 2), loaded back on one.
const RUN: [&str; 9] = ["--model", "tiny", "--world", "2", "--tp", "2", "--load-world", "1", "--train-ms"];

fn dckpt(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("running dckpt")
}

/// The same run loaded back in its own layout, which the local tier serves.
const RUN_LOCAL: [&str; 11] =
    ["--model", "tiny", "--world", "2", "--tp", "2", "--load-world", "2", "--load-tp", "2", "--train-ms"];

fn demo_run(root: &str, steps: u64, extra: &[&str]) -> Output {
    demo_run_as(&RUN, root, steps, extra)
}

fn demo_run_as(run: &[&str], root: &str, steps: u64, extra: &[&str]) -> Output {
    let steps = steps.to_string();
    let mut args = vec!["demo", "--run", root, "--steps", &steps, "--json"];
    args.extend(run);
    args.push("10");
    args.extend(extra);
    dckpt(&args)
}

fn json(o: &Output) -> Value {
    assert!(o.status.success(), "exit {:?}: {}", o.status, String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

fn ls(root: &str) -> Value {
    json(&dckpt(&["ls", root, "--json"]))
}

/// `(step, committed)` of every step `ls --json` lists.
fn steps(ls: &Value) -> Vec<(u64, bool)> {
    ls["steps"].as_array().unwrap().iter().map(|s| (s["step"].as_u64().unwrap(), s["committed"] == true)).collect()
}

/// A step directory that holds something but no commit marker: a save in the middle.
fn uncommitted_step(root: &Path) -> Option<u64> {
    for e in std::fs::read_dir(root).ok()?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(digits) = name.strip_prefix("step-") else { continue };
        let started = std::fs::read_dir(e.path()).map(|d| d.count() > 0).unwrap_or(false);
        if started && !e.path().join("dckpt.meta").exists() {
            return digits.parse().ok();
        }
    }
    None
}

#[test]
fn a_run_killed_in_a_save_resumes_after_its_last_committed_step_and_gc_removes_the_dead_save() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let r = root.to_str().unwrap();
    let first = json(&demo_run(r, 2, &[]));
    assert_eq!(first["saved_steps"], serde_json::json!([1, 2]));
    assert_eq!(first["verified"], true);

    // Slow storage, so that the kill lands inside a step's save.
    let mut args = vec!["demo", "--run", r, "--steps", "8", "--json"];
    args.extend(RUN);
    args.push("10");
    let mut child = Command::new(BIN)
        .args(&args)
        .env("DCKPT_DEMO_STORAGE_LATENCY_MS", "40")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let dead = loop {
        if let Some(k) = uncommitted_step(&root).filter(|k| *k > 2) {
            break k;
        }
        assert!(child.try_wait().unwrap().is_none(), "the run ended before it could be killed");
        assert!(started.elapsed() < Duration::from_secs(120), "no step save in flight within 120 s");
        std::thread::sleep(Duration::from_millis(5));
    };
    child.kill().unwrap();
    assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));

    // ls tells the dead step apart; the latest is the step before it.
    let listed = ls(r);
    assert!(steps(&listed).contains(&(dead, false)), "step {dead} is not listed uncommitted: {listed}");
    let latest = listed["latest"].as_u64().unwrap();
    assert_eq!(latest, dead - 1, "{listed}");
    assert!(steps(&listed).iter().all(|&(s, c)| c == (s != dead)), "{listed}");
    let dead_entry = listed["steps"].as_array().unwrap().iter().find(|s| s["step"] == dead).unwrap();
    assert!(dead_entry["problem"].as_str().unwrap().contains("dckpt.meta"), "{dead_entry}");

    // The rerun resumes after the latest committed step, checking it first.
    let rerun = json(&demo_run(r, 8, &[]));
    assert_eq!(rerun["resumed_from"], latest, "{rerun}");
    assert!(rerun["resume_elements_checked"].as_u64().unwrap() > 0);
    assert_eq!(rerun["saved_steps"][0], dead, "{rerun}");
    assert_eq!(rerun["latest"], 8);
    assert_eq!(rerun["verified"], true);
    assert!(steps(&ls(r)).iter().all(|&(_, c)| c));

    // gc removes what the dead save left in its step (its data files, its temporaries).
    let gc = json(&dckpt(&["gc", r, "--json"]));
    let left: Vec<&Value> =
        gc["data_files"].as_array().unwrap().iter().chain(gc["unfinished_writes"].as_array().unwrap()).collect();
    let dead_dir = format!("step-{dead:012}");
    assert!(left.iter().all(|f| f["path"].as_str().unwrap().contains(&dead_dir)), "{gc}");
    let step_dir = root.join(&dead_dir);
    let v = dckpt(&["validate", step_dir.to_str().unwrap(), "--json"]);
    let v = json(&v);
    assert_eq!(v["leftovers"].as_array().unwrap().len(), 0, "{v}");
    let again = json(&dckpt(&["gc", r, "--json"]));
    assert_eq!(again["bytes"], 0, "{again}");
}

#[test]
fn retention_ls_and_gc_with_json() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path().join("run");
    let r = r.to_str().unwrap();
    let out = json(&demo_run(r, 6, &["--keep-last", "2", "--keep-every", "3", "--async"]));
    assert_eq!(out["kept_steps"], serde_json::json!([3, 5, 6]), "{out}");
    let listed = ls(r);
    assert_eq!(steps(&listed), [(3, true), (5, true), (6, true)]);
    assert_eq!(listed["latest"], 6);
    assert_eq!(listed["from_pointer"], true);
    assert!(listed["steps"].as_array().unwrap().iter().all(|s| s["bytes"].as_u64().unwrap() > 0));
    assert_eq!(listed["steps"][2]["latest"], true);

    // An uncommitted step older than the latest (a dead save) goes; a newer one stays.
    std::fs::create_dir_all(dir.path().join("run/step-000000000004")).unwrap();
    std::fs::write(dir.path().join("run/step-000000000004/x"), b"dead").unwrap();
    std::fs::create_dir_all(dir.path().join("run/step-000000000009")).unwrap();
    std::fs::write(dir.path().join("run/step-000000000009/x"), b"running?").unwrap();
    // --keep-every 0 is refused (read as "a multiple of 0" it once kept only the newest).
    let zero = dckpt(&["gc", r, "--keep-every", "0", "--dry-run"]);
    assert_eq!(zero.status.code(), Some(2), "{}", String::from_utf8_lossy(&zero.stderr));
    let dry = json(&dckpt(&["gc", r, "--keep-last", "1", "--dry-run", "--json"]));
    assert_eq!(dry["dry_run"], true);
    let which: Vec<(u64, &str)> = dry["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["step"].as_u64().unwrap(), s["reason"].as_str().unwrap()))
        .collect();
    assert_eq!(which, [(3, "retention"), (4, "uncommitted"), (5, "retention")], "{dry}");
    assert_eq!(steps(&ls(r)).len(), 5, "a dry run removed something");
    let done = json(&dckpt(&["gc", r, "--keep-last", "1", "--json"]));
    assert_eq!(done["steps"], dry["steps"]);
    assert_eq!(steps(&ls(r)), [(6, true), (9, false)]);
    let human = dckpt(&["ls", r]);
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(text.contains("NOT COMMITTED") && text.contains("<- latest"), "{text}");
}

/// The same commands on S3, when the suite runs with the test server (`cargo xtask test`).
#[test]
fn a_run_on_s3_with_ls_and_gc() {
    let Some(base) = std::env::var("DCKPT_TEST_S3_URL").ok().filter(|u| !u.is_empty()) else {
        panic!("DCKPT_TEST_S3_URL is not set: no S3 server to test against (cargo xtask test starts one)");
    };
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let r = format!("{}/run-cli-{}-{nanos}", base.trim_end_matches('/'), std::process::id());
    let out = json(&demo_run(&r, 4, &["--keep-last", "2"]));
    assert_eq!(out["kept_steps"], serde_json::json!([3, 4]), "{out}");
    let resumed = json(&demo_run(&r, 5, &["--keep-last", "2", "--async"]));
    assert_eq!(resumed["resumed_from"], 4);
    assert_eq!(resumed["saved_steps"], serde_json::json!([5]));
    let listed = ls(&r);
    assert_eq!(steps(&listed), [(4, true), (5, true)]);
    assert_eq!(listed["latest"], 5);
    let gc = json(&dckpt(&["gc", &r, "--keep-last", "1", "--json"]));
    assert_eq!(gc["steps"][0]["step"], 4, "{gc}");
    assert_eq!(steps(&ls(&r)), [(5, true)]);
}

/// The local tier of a run at `nodes`: 2 simulated nodes of 1 rank, every step local, the
/// run root only every 100 steps (so a resume here comes from the local tier alone).
fn local_args(nodes: &Path) -> Vec<String> {
    let template = nodes.join("{node}").to_str().unwrap().to_string();
    ["--local", &template, "--ranks-per-node", "1", "--persistent-every", "100"].map(String::from).to_vec()
}

/// A local step in the middle of its save: parts there, no marker. `copy`: only once a
/// peer's copy has landed (a part of a rank of another node), i.e. during the replication.
fn local_save_in_flight(nodes: &Path, after: u64, copy: bool) -> Option<u64> {
    for node in 0..2usize {
        for e in std::fs::read_dir(nodes.join(node.to_string())).ok()?.flatten() {
            let Some(step) = e.file_name().to_str().and_then(|n| n.strip_prefix("step-")?.parse::<u64>().ok()) else {
                continue;
            };
            // Finished files only: a temporary (`.dckpt-tmp.…`) is no part yet.
            let names: Vec<String> = std::fs::read_dir(e.path())
                .ok()?
                .flatten()
                .map(|f| f.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with('.'))
                .collect();
            let marked = names.iter().any(|n| n.starts_with("done-"));
            let peer_copy = names.iter().any(|n| n.ends_with(".meta") && n != &format!("part-{node}.meta"));
            if step > after && !marked && !names.is_empty() && (!copy || peer_copy) {
                return Some(step);
            }
        }
    }
    None
}

// kill -9 during a local save, and during its replication: the resume restores the
// previous complete local step, every rank from its own copy, and continues bit-exact.
#[test]
fn a_run_killed_in_a_local_save_or_its_replication_resumes_from_the_last_complete_local_step() {
    let dir = tempfile::tempdir().unwrap();
    let (root, nodes) = (dir.path().join("run"), dir.path().join("nodes"));
    let r = root.to_str().unwrap();
    let local = local_args(&nodes);
    let local: Vec<&str> = local.iter().map(String::as_str).collect();
    let first = json(&demo_run_as(&RUN_LOCAL, r, 2, &local));
    assert_eq!((first["latest"].as_u64(), &first["verified"]), (Some(2), &Value::Bool(true)), "{first}");
    let mut last_complete = 2;
    for copy in [false, true] {
        let mut args = vec!["demo", "--run", r, "--steps", "40", "--json"];
        args.extend(RUN_LOCAL);
        args.push("10");
        args.extend(&local);
        let mut child = Command::new(BIN)
            .args(&args)
            .env("DCKPT_DEMO_STORAGE_LATENCY_MS", "30")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        let dead = loop {
            if let Some(k) = local_save_in_flight(&nodes, last_complete, copy) {
                break k;
            }
            assert!(child.try_wait().unwrap().is_none(), "the run ended before it could be killed");
            assert!(started.elapsed() < Duration::from_secs(120), "no local save in flight within 120 s");
            std::thread::sleep(Duration::from_millis(2));
        };
        child.kill().unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        let listed = json(&dckpt(&["ls", r, "--json", "--local", nodes.join("{node}").to_str().unwrap()]));
        let local_steps = listed["local"]["steps"].as_array().unwrap();
        let dead_entry = local_steps.iter().find(|s| s["step"] == dead).expect("the dead step is listed");
        assert_eq!(dead_entry["complete"], false, "{listed}");
        let complete = local_steps.iter().filter(|s| s["complete"] == true).map(|s| s["step"].as_u64().unwrap()).max();
        assert_eq!(complete, Some(dead - 1), "{listed}");

        let rerun = json(&demo_run_as(&RUN_LOCAL, r, dead + 1, &local));
        assert_eq!(rerun["resumed_from"], dead - 1, "{rerun}");
        assert_eq!(rerun["resume_sources"], serde_json::json!({"own": 2, "peer": 0, "persistent": 0}), "{rerun}");
        assert_eq!(rerun["saved_steps"], serde_json::json!([dead, dead + 1]), "{rerun}");
        assert_eq!(rerun["verified"], true, "{rerun}");
        last_complete = dead + 1;
    }
}

// --lose-node: the resume restores that node's parts from their peers.
#[test]
fn a_lost_node_resumes_from_peers() {
    let dir = tempfile::tempdir().unwrap();
    let (root, nodes) = (dir.path().join("run"), dir.path().join("nodes"));
    let r = root.to_str().unwrap();
    let local = local_args(&nodes);
    let mut args: Vec<&str> = local.iter().map(String::as_str).collect();
    assert_eq!(json(&demo_run_as(&RUN_LOCAL, r, 3, &args))["verified"], true);
    args.extend(["--lose-node", "1"]);
    let rerun = json(&demo_run_as(&RUN_LOCAL, r, 4, &args));
    assert_eq!(rerun["resumed_from"], 3, "{rerun}");
    assert_eq!(rerun["resume_sources"], serde_json::json!({"own": 1, "peer": 1, "persistent": 0}), "{rerun}");
    assert_eq!(rerun["verified"], true, "{rerun}");
    let listed = dckpt(&["ls", r, "--local", nodes.join("{node}").to_str().unwrap(), "--nodes", "3"]);
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(text.contains("node 2: ") && text.contains("is missing"), "{text}");
}

/// Commands that only read do not create a mistyped location: `ls` and `gc` fail (exit 1,
/// one JSON object with --json), `inspect` says it is not a checkpoint (exit 2), and no
/// directory appears (an empty one was once listed as a run of no steps).
#[test]
fn reading_commands_leave_a_missing_location_missing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("typo");
    let m = missing.to_str().unwrap();
    for (cmd, code) in [("ls", 1), ("gc", 1), ("inspect", 2), ("validate", 2)] {
        let out = dckpt(&[cmd, m, "--json"]);
        assert_eq!(out.status.code(), Some(code), "{cmd}: {}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["error"].as_str().unwrap().contains("not found"), "{cmd}: {v}");
        assert!(!missing.exists(), "{cmd} created {m}");
    }
}
