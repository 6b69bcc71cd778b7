//! `dckpt demo`, `inspect`, `validate` and `launch` as an operator runs them, on the tiny
//! model in temporary directories.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_dckpt");

fn dckpt(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("running dckpt")
}

fn dckpt_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("running dckpt")
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("dckpt-cli-demo").tempdir().expect("temp dir")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Runs the demo with `args` into `dir`; asserts success and returns its JSON.
fn demo_ok(dir: &Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["demo", "--model", "tiny", "--dir", s(dir), "--json"];
    all.extend_from_slice(args);
    let o = dckpt(&all);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(v["saved_bytes"], v["expected_bytes"], "{v}");
    assert!(v["saved_bytes"].as_u64().unwrap() > 0);
    assert!(v["save_seconds"].as_f64().unwrap() >= 0.0);
    assert!(v["load_seconds"].as_f64().unwrap() >= 0.0);
    assert!(v["elements_checked"].as_u64().unwrap() > 0);
    v
}

/// A reported layout's world, tp, pp, cp, ep and etp.
fn sizes(layout: &serde_json::Value) -> [u64; 6] {
    ["world_size", "tp", "pp", "cp", "ep", "etp"].map(|k| layout[k].as_u64().unwrap_or_else(|| panic!("{k}: {layout}")))
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

#[test]
fn demo_round_trip_with_a_layout_change_then_inspect_and_validate() {
    let dir = tmp();
    // The default layouts: 8 ranks (tp 2, pp 2, ep 2, etp 2, layerwise) -> 4 (ep 4, distributed).
    let v = demo_ok(dir.path(), &[]);
    assert_eq!(sizes(&v["save_layout"]), [8, 2, 2, 1, 2, 2], "{v}");
    assert_eq!(v["save_layout"]["optimizer"], "layerwise");
    assert_eq!(sizes(&v["load_layout"]), [4, 1, 1, 1, 4, 1], "{v}");
    assert_eq!(v["load_layout"]["optimizer"], "distributed");
    assert_eq!(v["ranks_as"], "threads");
    let rank_bytes: u64 = v["rank_bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).sum();
    assert_eq!(rank_bytes, v["saved_bytes"].as_u64().unwrap());

    let i = dckpt(&["inspect", s(dir.path()), "--json"]);
    assert_eq!(i.status.code(), Some(0), "{}", stderr(&i));
    let i = json(&i);
    assert_eq!(i["save_id"], v["save_id"]);
    assert_eq!(i["layout"]["world_size"], "8");
    assert_eq!(i["layout"]["optimizer"], "layerwise");
    assert_eq!(i["data_bytes"], v["saved_bytes"]);
    assert_eq!(i["files"].as_array().unwrap().len() as u64, v["files"].as_u64().unwrap());
    assert_eq!(i["chunks"], v["chunks"]);
    let tensors = i["tensors"].as_array().unwrap();
    let t = tensors.iter().find(|t| t["key"] == "decoder.layers.0.mlp.experts.linear_fc1.weight").expect("expert key");
    assert_eq!(t["dtype"], "bf16");
    assert_eq!(t["global_shape"].as_array().unwrap().len(), 3);
    let sum: u64 = tensors.iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(sum, v["saved_bytes"].as_u64().unwrap());
    let human = dckpt(&["inspect", s(dir.path())]);
    assert_eq!(human.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&human.stdout).contains("decoder.layers.0.mlp.experts.linear_fc1.weight"));

    let r = dckpt(&["validate", s(dir.path()), "--json"]);
    assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
    let r = json(&r);
    assert_eq!(r["sound"], true);
    assert_eq!(r["problems"].as_array().unwrap().len(), 0);
    assert!(r["bytes_checked"].as_u64().unwrap() > v["saved_bytes"].as_u64().unwrap());
    assert_eq!(r["leftovers"].as_array().unwrap().len(), 0);
}

#[test]
fn async_demo_and_a_rerun_into_the_same_directory() {
    let dir = tmp();
    let v = demo_ok(
        dir.path(),
        &["--async", "--world", "4", "--tp", "2", "--pp", "2", "--ep", "1", "--etp", "1", "--optimizer", "distributed"],
    );
    assert_eq!(v["async"], true);
    assert!(v["copy_seconds"].as_f64().is_some(), "{v}");
    // Unset --load-* options take the save values.
    assert_eq!(v["load_layout"]["tp"], 2);
    assert_eq!(v["load_layout"]["world_size"], 4);
    // A second run replaces the first checkpoint (another layout, another seed), leaving nothing stale.
    let w = demo_ok(
        dir.path(),
        &[
            "--seed",
            "7",
            "--world",
            "2",
            "--tp",
            "2",
            "--pp",
            "1",
            "--ep",
            "1",
            "--etp",
            "1",
            "--load-world",
            "1",
            "--load-tp",
            "1",
        ],
    );
    assert_ne!(v["save_id"], w["save_id"]);
    assert_eq!(data_files(dir.path()).len() as u64, w["files"].as_u64().unwrap());
    let r = dckpt(&["validate", s(dir.path()), "--json"]);
    assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
    assert_eq!(json(&r)["leftovers"].as_array().unwrap().len(), 0);
}

/// Megatron's convention: once a layout option is given, the sizes not given are 1 instead
/// of the demo's own (pp 2 would not fit eight ranks at ep 4, etp 2).
#[test]
fn parallel_sizes_not_given_are_one_once_a_layout_option_is() {
    let dir = tmp();
    let v = demo_ok(dir.path(), &["--world", "8", "--tp", "1", "--ep", "4", "--etp", "2"]);
    assert_eq!(sizes(&v["save_layout"]), [8, 1, 1, 1, 4, 2], "{v}");
    assert_eq!((&v["save_layout"]["dp"], &v["save_layout"]["expert_dp"]), (&8.into(), &1.into()), "{v}");
    assert_eq!(v["save_layout"]["optimizer"], "layerwise");
    // No --load-* option: the load layout is the save layout.
    assert_eq!(sizes(&v["load_layout"]), [8, 1, 1, 1, 4, 2], "{v}");
    assert_eq!(v["load_layout"]["optimizer"], "layerwise");

    // A --load-* option alone: the default save layout, load sizes not given are 1.
    let v = demo_ok(dir.path(), &["--load-world", "2", "--load-ep", "2", "--dtype", "float32"]);
    assert_eq!(v["dtype"], "f32");
    assert_eq!(sizes(&v["save_layout"]), [8, 2, 2, 1, 2, 2], "{v}");
    assert_eq!(sizes(&v["load_layout"]), [2, 1, 1, 1, 2, 1], "{v}");
    assert_eq!(v["load_layout"]["optimizer"], "distributed");
}

/// The demo's run (exit code and stderr) into `dir` with `args`, without asserting success.
fn demo_run(dir: &Path, args: &[&str]) -> Output {
    let mut all = vec!["demo", "--model", "tiny", "--dir", s(dir), "--json"];
    all.extend_from_slice(args);
    dckpt(&all)
}

/// A checkpoint that some other program saved into `dir` with the engine; its save id.
fn foreign_checkpoint(dir: &Path) -> String {
    use dckpt::{Checkpointer, DType, SaveOptions, SaveState, ShardedTensor};
    let data = vec![7u8; 64];
    let state = SaveState::new().tensor(ShardedTensor::whole("w", DType::F32, [16]), &data);
    Checkpointer::local().save(dir, &state, &SaveOptions::default()).unwrap().save_id
}

fn save_id_of(dir: &Path) -> String {
    let i = dckpt(&["inspect", s(dir), "--json"]);
    assert_eq!(i.status.code(), Some(0), "{}", stderr(&i));
    json(&i)["save_id"].as_str().unwrap().to_string()
}

#[test]
fn the_demo_refuses_a_checkpoint_it_did_not_make_unless_told_to_replace_it() {
    let dir = tmp();
    let foreign = foreign_checkpoint(dir.path());
    let theirs = data_files(dir.path());
    assert_eq!(theirs.len(), 1);
    let o = demo_run(dir.path(), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // With --json the refusal is also the one error object on stdout.
    assert!(json(&o)["error"].as_str().is_some_and(|e| e.contains("did not make")), "{}", stderr(&o));
    for want in ["did not make", &foreign, "--replace"] {
        assert!(stderr(&o).contains(want), "{want:?} missing from: {}", stderr(&o));
    }
    // Untouched: the same checkpoint, sound, with its file.
    assert_eq!(save_id_of(dir.path()), foreign);
    assert_eq!(dckpt(&["validate", s(dir.path())]).status.code(), Some(0));
    assert_eq!(data_files(dir.path()), theirs);
    // Told to: replaced, and the replaced checkpoint's file deleted after the commit.
    let v = demo_ok(dir.path(), &["--replace"]);
    assert_eq!(save_id_of(dir.path()), v["save_id"].as_str().unwrap());
    assert!(!theirs[0].exists(), "the replaced checkpoint's data file stays");
    assert_eq!(data_files(dir.path()).len() as u64, v["files"].as_u64().unwrap());
    // Now it is the demo's own: a plain run replaces it.
    let w = demo_ok(dir.path(), &[]);
    assert_ne!(v["save_id"], w["save_id"]);
    assert_eq!(data_files(dir.path()).len() as u64, w["files"].as_u64().unwrap());
}

#[test]
fn the_demo_refuses_a_directory_of_other_files_unless_told_to_replace() {
    let dir = tmp();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, b"mine").unwrap();
    let o = demo_run(dir.path(), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    for want in ["not empty", "notes.txt", "--replace"] {
        assert!(stderr(&o).contains(want), "{want:?} missing from: {}", stderr(&o));
    }
    assert!(data_files(dir.path()).is_empty() && !dir.path().join("dckpt.meta").exists());
    // With --replace it saves there and leaves what is not a checkpoint's alone.
    demo_ok(dir.path(), &["--replace"]);
    assert_eq!(std::fs::read(&notes).unwrap(), b"mine");
}

#[test]
fn a_damaged_metadata_file_is_refused_then_replaced_when_asked() {
    let dir = tmp();
    std::fs::write(dir.path().join("dckpt.meta"), b"not metadata at all").unwrap();
    let o = demo_run(dir.path(), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("dckpt.meta") && stderr(&o).contains("--replace"), "{}", stderr(&o));
    assert_eq!(std::fs::read(dir.path().join("dckpt.meta")).unwrap(), b"not metadata at all");
    let v = demo_ok(dir.path(), &["--replace"]);
    assert_eq!(save_id_of(dir.path()), v["save_id"].as_str().unwrap());
    assert_eq!(dckpt(&["validate", s(dir.path())]).status.code(), Some(0));
}

#[test]
fn data_files_of_a_save_that_never_committed_do_not_stop_the_demo() {
    let dir = tmp();
    std::fs::write(dir.path().join("0123456789abcdef-00000.safetensors"), b"stale").unwrap();
    let v = demo_ok(dir.path(), &[]);
    assert_eq!(save_id_of(dir.path()), v["save_id"].as_str().unwrap());
    assert_eq!(dckpt(&["validate", s(dir.path())]).status.code(), Some(0));
}

#[test]
fn demo_help_says_when_it_replaces() {
    let o = dckpt(&["demo", "--help"]);
    assert_eq!(o.status.code(), Some(0));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in ["--replace", "did not make", "made_by"] {
        assert!(out.contains(want), "{want:?} missing from --help:\n{out}");
    }
}

/// `dckpt --help` is where a newcomer starts: its first line names every command, and each
/// command has one short line there (the detail is `dckpt CMD --help`'s).
#[test]
fn top_level_help_names_every_command_in_one_short_line() {
    let o = dckpt(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let out = String::from_utf8_lossy(&o.stdout);
    let first = out.lines().next().unwrap_or_default();
    let commands: Vec<&str> =
        out.lines().skip_while(|l| !l.starts_with("Commands:")).skip(1).take_while(|l| !l.trim().is_empty()).collect();
    let names: Vec<&str> = commands.iter().filter_map(|l| l.split_whitespace().next()).collect();
    assert!(names.len() >= 10, "too few commands listed:\n{out}");
    for line in &commands {
        assert!(!line.starts_with("   "), "a command's summary runs onto a second line: {line:?}\n{out}");
        assert!(line.len() <= 100, "a command's summary is not one short line: {line:?}");
    }
    for name in names.iter().filter(|n| **n != "help") {
        assert!(
            first.split(|c: char| !c.is_alphanumeric() && c != '_').any(|w| w == *name),
            "the first line does not name {name}: {first:?}"
        );
        let sub = dckpt(&[name, "--help"]);
        assert_eq!(sub.status.code(), Some(0), "dckpt {name} --help");
        let detail = String::from_utf8_lossy(&sub.stdout);
        assert!(detail.lines().count() > 5, "dckpt {name} --help says too little:\n{detail}");
    }
}

/// Demos started together into one empty directory: each either verified its own checkpoint
/// (exit 0) or failed because another committed (exit 1), never anything else; the one
/// committed last is what is there, sound, with nothing left behind.
#[test]
fn demos_racing_into_one_directory() {
    let dir = tmp();
    let children: Vec<_> = (0..3)
        .map(|seed| {
            Command::new(BIN)
                .args(["demo", "--model", "tiny", "--dir", s(dir.path()), "--json", "--seed", &seed.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn")
        })
        .collect();
    let outputs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().expect("wait")).collect();
    let mut verified = Vec::new();
    for o in &outputs {
        match o.status.code() {
            Some(0) => verified.push(json(o)["save_id"].as_str().unwrap().to_string()),
            Some(1) => {
                let e = stderr(o);
                // Another committed first; or one that started after this one committed
                // replaced it (legitimately deleting its files) while it loaded.
                let raced = ["already committed", "not this run's", "not found"];
                assert!(raced.iter().any(|r| e.contains(r)), "{e}");
            }
            other => panic!("exit {other:?}: {}", stderr(o)),
        }
    }
    let id = save_id_of(dir.path());
    assert!(verified.contains(&id), "the committed checkpoint {id} is no verified run's: {verified:?}");
    let r = dckpt(&["validate", s(dir.path()), "--json"]);
    assert_eq!(r.status.code(), Some(0), "{}", stderr(&r));
    assert_eq!(json(&r)["leftovers"].as_array().unwrap().len(), 0, "{}", String::from_utf8_lossy(&r.stdout));
}

#[test]
fn demo_in_memory_storage() {
    let o = dckpt(&["demo", "--model", "tiny", "--dir", "memory://", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(json(&o)["verified"], true);
}

#[test]
fn human_demo_prints_the_summary() {
    let dir = tmp();
    let o = dckpt(&["demo", "--model", "tiny", "--dir", s(dir.path())]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in ["bytes", "equal", "per rank", "empty ranks", "GB/s", "VERIFIED"] {
        assert!(out.contains(want), "{want:?} missing from:\n{out}");
    }
}

#[test]
fn invalid_demo_options_exit_two() {
    let dir = tmp();
    let o = dckpt(&["demo", "--model", "tiny", "--world", "6", "--tp", "4", "--dir", s(dir.path())]);
    assert_eq!(o.status.code(), Some(2));
    assert!(o.stdout.is_empty());
    // Under a launcher both worlds must equal WORLD_SIZE.
    let o = dckpt_env(&["demo", "--model", "tiny", "--dir", s(dir.path())], &[("WORLD_SIZE", "4"), ("RANK", "0")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("WORLD_SIZE=4"), "{}", stderr(&o));
}

#[test]
fn validate_names_a_flipped_byte_and_a_damaged_metadata_file() {
    let dir = tmp();
    demo_ok(dir.path(), &[]);
    let files = data_files(dir.path());
    let victim = &files[files.len() / 2];
    let mut bytes = std::fs::read(victim).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x10;
    std::fs::write(victim, &bytes).unwrap();
    let name = victim.file_name().unwrap().to_str().unwrap();
    let o = dckpt(&["validate", s(dir.path())]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(name), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("PROBLEMS"));
    let j = dckpt(&["validate", s(dir.path()), "--json"]);
    assert_eq!(j.status.code(), Some(1));
    let j = json(&j);
    assert_eq!(j["sound"], false);
    assert!(j["problems"][0].as_str().unwrap().contains(name), "{j}");
    // Restore, then damage the metadata.
    bytes[at] ^= 0x10;
    std::fs::write(victim, &bytes).unwrap();
    assert_eq!(dckpt(&["validate", s(dir.path())]).status.code(), Some(0));
    let meta = dir.path().join("dckpt.meta");
    let mut m = std::fs::read(&meta).unwrap();
    let mid = m.len() / 2;
    m[mid] ^= 0x01;
    std::fs::write(&meta, &m).unwrap();
    let o = dckpt(&["validate", s(dir.path())]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("dckpt.meta"), "{}", stderr(&o));
    assert_eq!(dckpt(&["inspect", s(dir.path())]).status.code(), Some(1));
}

#[test]
fn a_save_that_did_not_commit_is_not_a_checkpoint() {
    let dir = tmp();
    demo_ok(dir.path(), &[]);
    std::fs::remove_file(dir.path().join("dckpt.meta")).unwrap();
    let o = dckpt(&["validate", s(dir.path())]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("not a checkpoint: the save did not commit"), "{}", stderr(&o));
    let j = json(&dckpt(&["validate", s(dir.path()), "--json"]));
    assert_eq!(j["status"], "not a checkpoint");
    assert_eq!(dckpt(&["inspect", s(dir.path())]).status.code(), Some(2));
    let empty = tmp();
    let o = dckpt(&["validate", s(empty.path())]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("not a checkpoint"), "{}", stderr(&o));
}

#[test]
fn validate_lists_and_removes_leftovers() {
    let dir = tmp();
    demo_ok(dir.path(), &[]);
    let stray = dir.path().join("0123456789abcdef-00003.safetensors");
    std::fs::write(&stray, b"from a failed save").unwrap();
    let j = dckpt(&["validate", s(dir.path()), "--json"]);
    assert_eq!(j.status.code(), Some(0));
    let leftover = serde_json::json!({"path": "0123456789abcdef-00003.safetensors", "bytes": 18, "kind": "data_file"});
    assert_eq!(json(&j)["leftovers"], serde_json::json!([leftover]));
    let j = dckpt(&["validate", s(dir.path()), "--json", "--remove-leftovers"]);
    assert_eq!(j.status.code(), Some(0));
    assert_eq!(json(&j)["removed"], serde_json::json!([leftover]));
    assert_eq!(json(&j)["leftovers"], serde_json::json!([]));
    assert!(!stray.exists());
}

/// The tiny model on 4 ranks saved at tp 2 / ep 2 / etp 2 (layerwise), loaded at ep 4.
const LAUNCHED: [&str; 20] = [
    "demo",
    "--model",
    "tiny",
    "--world",
    "4",
    "--tp",
    "2",
    "--pp",
    "1",
    "--ep",
    "2",
    "--etp",
    "2",
    "--load-world",
    "4",
    "--load-tp",
    "1",
    "--load-ep",
    "4",
    "--load-etp",
];

fn launched_args(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = LAUNCHED.iter().map(|s| s.to_string()).collect();
    v.extend(["1", "--dir", s(dir), "--json"].map(String::from));
    v
}

/// Runs `dckpt launch --nproc 4 -- dckpt DEMO_ARGS`; the JSON report of rank 0, and all
/// the launcher printed.
fn launch_four(demo_args: &[String]) -> (serde_json::Value, String) {
    let mut args = vec!["launch".to_string(), "--nproc".into(), "4".into(), "--".into(), BIN.into()];
    args.extend(demo_args.iter().cloned());
    let o = Command::new(BIN).args(&args).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = out.lines().find_map(|l| l.strip_prefix("[rank 0] ")).unwrap_or_else(|| panic!("no rank 0 line: {out}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["ranks_as"], "processes");
    assert_eq!(v["verified"], true);
    (v, out)
}

#[test]
fn launch_four_processes_saves_and_loads_over_tcp() {
    let dir = tmp();
    let (v, out) = launch_four(&launched_args(dir.path()));
    assert_eq!(v["saved_bytes"], v["expected_bytes"]);
    assert_eq!(v["rank_bytes"].as_array().unwrap().len(), 4);
    assert!(!out.lines().any(|l| l.starts_with("[rank 1] ")), "only rank 0 reports: {out}");
    assert_eq!(dckpt(&["validate", s(dir.path())]).status.code(), Some(0));
}

/// The launched demo saving at tp 1 into `dir` and loading at tp 2: row-parallel weights
/// split along their columns. Returns the bytes the load read and the bytes it loaded.
fn launch_four_reshard_to_tp_2(dir: &str) -> (f64, f64) {
    let layouts = "--world 4 --tp 1 --pp 1 --ep 2 --etp 1 --load-world 4 --load-tp 2 --load-ep 2 --load-etp 2";
    let mut args: Vec<String> = ["demo", "--model", "tiny"].map(String::from).to_vec();
    args.extend(layouts.split(' ').map(String::from));
    args.extend(["--dir", dir, "--json"].map(String::from));
    let (v, _) = launch_four(&args);
    (v["load_bytes_read"].as_f64().unwrap(), v["load_state_bytes"].as_f64().unwrap())
}

/// Four processes load at tp 2 what they saved at tp 1, on local disk, which the CLI reads
/// in place: each rank checks the whole blocks its half of every row touches (picked reads),
/// so the two ranks of a split read each such block, and nothing is checked in parts.
#[test]
fn launch_four_processes_reshard_to_a_higher_tp_over_tcp() {
    let dir = tmp();
    let (read, state) = launch_four_reshard_to_tp_2(s(dir.path()));
    assert!(read > 1.2 * state && read < 2.05 * state, "read {read} bytes for {state} bytes of state");
}

/// The same on S3, where a rank reads only its bytes: the ranks check the blocks they split
/// together over TCP, and each reads little more than it loads. Needs the S3 server `cargo
/// xtask test` starts (DCKPT_TEST_S3_URL and AWS_*).
#[test]
fn launch_four_processes_reshard_on_s3_check_split_blocks_together() {
    let Ok(url) = std::env::var("DCKPT_TEST_S3_URL") else {
        panic!("DCKPT_TEST_S3_URL is not set: run the suite with `cargo xtask test`, which starts a local S3 server")
    };
    let dir = format!("{}/demo-cli-reshard-{}", url.trim_end_matches('/'), std::process::id());
    let (read, state) = launch_four_reshard_to_tp_2(&dir);
    assert!(read < 1.05 * state, "read {read} bytes for {state} bytes of state");
}

#[test]
fn launched_job_with_a_dead_rank_fails_and_exits_non_zero() {
    let dir = tmp();
    let t = Instant::now();
    let mut args = vec!["launch".to_string(), "--nproc".into(), "4".into(), "--".into(), BIN.into()];
    args.extend(launched_args(dir.path()));
    let o = Command::new(BIN)
        .args(&args)
        .env("DCKPT_DEMO_EXIT_RANK", "2")
        .env("DCKPT_COLLECTIVE_TIMEOUT_MS", "5000")
        .output()
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(30));
    assert!(!o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("[rank 2] rank 2: leaving the job"), "{}", stderr(&o));
    // Nothing was committed.
    assert_eq!(dckpt(&["validate", s(dir.path())]).status.code(), Some(2));
}

/// Without a launcher that kills the others, every survivor must fail on its own, within
/// the timeout, with an error naming the rank that died.
#[test]
fn survivors_of_a_dead_rank_fail_naming_it() {
    let dir = tmp();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let args = launched_args(dir.path());
    let t = Instant::now();
    let children: Vec<_> = (0..4)
        .map(|r| {
            Command::new(BIN)
                .args(&args)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "4")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("DCKPT_MASTER_PORT", &port)
                .env("DCKPT_JOB_ID", format!("dead-rank-test-{port}"))
                .env("DCKPT_DEMO_EXIT_RANK", "2")
                .env("DCKPT_COLLECTIVE_TIMEOUT_MS", "5000")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
    assert_eq!(outs[2].status.code(), Some(3));
    for r in [0, 1, 3] {
        let e = stderr(&outs[r]);
        assert_eq!(outs[r].status.code(), Some(1), "rank {r}: {e}");
        assert!(e.contains("rank 2"), "rank {r} does not name rank 2: {e}");
    }
}

#[test]
fn a_dead_rank_thread_fails_the_save() {
    let dir = tmp();
    let o = dckpt_env(
        &["demo", "--model", "tiny", "--dir", s(dir.path())],
        &[("DCKPT_DEMO_EXIT_RANK", "3"), ("DCKPT_COLLECTIVE_TIMEOUT_MS", "5000")],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("save: rank 3"), "{}", stderr(&o));
    assert_eq!(dckpt(&["validate", s(dir.path())]).status.code(), Some(2));
}

// A checkpoint of a newer format read as "damaged" would send an operator looking for
// corruption; inspect says what it is instead.
#[test]
fn inspect_tells_a_newer_format_from_damage() {
    let dir = tmp();
    let m = dckpt::format::Metadata {
        format_version: dckpt::format::FORMAT_VERSION,
        save_id: "0123456789abcdef".into(),
        writer: "test".into(),
        block_bytes: 64,
        layout: Default::default(),
        files: vec![],
        tensors: vec![],
        objects: vec![],
    };
    let mut bytes = m.encode();
    let meta = dir.path().join(dckpt::format::META_NAME);
    std::fs::write(&meta, &bytes).unwrap();
    assert_eq!(dckpt(&["inspect", s(dir.path())]).status.code(), Some(0));
    bytes[8] = 2;
    std::fs::write(&meta, &bytes).unwrap();
    let o = dckpt(&["inspect", s(dir.path())]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("version 2 is not supported") && stderr(&o).contains("newer dckpt"), "{}", stderr(&o));
    bytes[8] = 1;
    bytes[30] ^= 1;
    std::fs::write(&meta, &bytes).unwrap();
    let o = dckpt(&["inspect", s(dir.path())]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("damaged") && !stderr(&o).contains("newer"), "{}", stderr(&o));
}

/// A rank started by another launcher with `MASTER_PORT` but no `DCKPT_MASTER_PORT` (torchrun
/// without it) fails at once naming the variable: under torchrun `MASTER_PORT` is torch's
/// store's, and rank 0 listened on it, or failed to, while the others knocked on torch's
/// store until the rendezvous timed out.
#[test]
fn a_launched_rank_never_takes_master_port() {
    let dir = tmp();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let t = Instant::now();
    let o = Command::new(BIN)
        .args(launched_args(dir.path()))
        .env("RANK", "0")
        .env("WORLD_SIZE", "4")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        .env_remove("DCKPT_MASTER_PORT")
        .env("DCKPT_RENDEZVOUS_TIMEOUT_MS", "3000")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("DCKPT_MASTER_PORT") && err.contains("not set"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(3), "it waited: {:?}", t.elapsed());
}
