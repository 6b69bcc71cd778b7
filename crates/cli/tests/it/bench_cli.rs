//! `dckpt bench scale`, `local`, `fanout` and `small` at their smallest: every figure each reports
//! (scale's data bytes the model's, fanout's bytes read the state's).

use std::path::Path;
use std::process::Command;

/// Runs `dckpt bench` with `args` and `--json --dir DIR`; its figures, once it exited 0.
fn bench_json(args: &[&str], dir: &Path) -> (Vec<serde_json::Value>, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_dckpt"))
        .arg("bench")
        .args(args)
        .args(["--json", "--dir"])
        .arg(dir)
        .output()
        .expect("running dckpt");
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(0), "{stderr}");
    (serde_json::from_slice(&o.stdout).expect("a JSON array of figures"), stderr)
}

#[test]
fn bench_scale_reports_every_figure_and_the_model_s_bytes() {
    let dir = tempfile::Builder::new().prefix("dckpt-cli-bench").tempdir().expect("temp dir");
    let (figs, stderr) = bench_json(&["scale", "--ranks", "32,64", "--processes", "16"], dir.path());
    let get =
        |name: &str| figs.iter().find(|f| f["name"] == name).unwrap_or_else(|| panic!("no figure {name}: {figs:?}"));
    let number = |name: &str| get(name)["value"].as_f64().unwrap_or_else(|| panic!("{name} has no value"));
    for n in [32, 64] {
        for what in [
            "save_seconds",
            "load_seconds",
            "metadata_bytes_max",
            "coordinator_received_bytes",
            "coordinator_sent_bytes",
            "peak_rss_bytes",
        ] {
            assert!(number(&format!("scale_{n}_{what}")) > 0.0, "scale_{n}_{what}");
        }
        let data = get(&format!("scale_{n}_data_bytes"));
        assert_eq!(data["value"], data["ceiling"], "{data}");
        // The narrowed moe-xl: 64 MiB.
        assert!(data["value"].as_f64().unwrap() > 60e6, "{data}");
        for what in ["save_requests_rank_max", "save_requests_coordinator", "load_requests_rank_max"] {
            let f = get(&format!("scale_{n}_{what}"));
            let kinds = f["by_kind"].as_object().unwrap_or_else(|| panic!("{f}"));
            let sum: u64 = kinds.values().map(|v| v.as_u64().unwrap()).sum();
            assert!(sum as f64 >= f["value"].as_f64().unwrap() && sum > 0, "{f}");
        }
        // Rank 0 writes its data file and commits the metadata.
        assert!(get(&format!("scale_{n}_save_requests_coordinator"))["by_kind"]["put_if_absent"].as_u64() >= Some(1));
    }
    assert!(number("scale_seconds_ratio") > 0.0);
    assert!(number("scale_processes_16_seconds") > 0.0, "{stderr}");
    // Everything the bench wrote is gone.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// `dckpt bench local` at its smallest: its six figures, each a pair of positive numbers
/// and their ratio, and nothing left behind.
#[test]
fn bench_local_reports_its_six_figures() {
    let dir = tempfile::Builder::new().prefix("dckpt-cli-bench-local").tempdir().expect("temp dir");
    let (figs, _) = bench_json(&["local", "--bytes", "1048576", "--rounds", "1"], dir.path());
    let names = [
        "local_save_blocking_vs_memcpy",
        "local_save_vs_write_and_copy",
        "local_restore_own_vs_plain_read",
        "local_restore_own_vs_checked_read",
        "local_restore_lost_node_vs_own",
        "local_restore_vs_persistent",
    ];
    assert_eq!(figs.len(), names.len(), "{figs:?}");
    for name in names {
        let f = figs.iter().find(|f| f["name"] == name).unwrap_or_else(|| panic!("no figure {name}: {figs:?}"));
        for field in ["value", "ceiling", "ratio"] {
            let v = f[field].as_f64().unwrap_or_else(|| panic!("{name} has no {field}: {f}"));
            assert!(v > 0.0 && v.is_finite(), "{name}: {field} {v}");
        }
        assert!(f["note"].as_str().is_some_and(|n| n.contains("ratio per round")), "{f}");
    }
    // Everything the bench wrote is gone.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// `dckpt bench fanout` at its smallest: every store's load reads each byte about once with
/// the fan-out (S3 too where the suite's server is configured), its times are pairs of
/// positive numbers, and nothing is left behind.
#[test]
fn bench_fanout_reads_each_byte_about_once() {
    let dir = tempfile::Builder::new().prefix("dckpt-cli-bench-fanout").tempdir().expect("temp dir");
    let (figs, _) = bench_json(&["fanout", "--bytes", "1048576", "--rounds", "1"], dir.path());
    let s3 = std::env::var("DCKPT_TEST_S3_URL").is_ok_and(|u| !u.is_empty());
    assert_eq!(figs.len(), 8, "{figs:?}");
    for store in ["local", "local_tcp", "s3", "s3_tcp"] {
        let get = |name: String| figs.iter().find(|f| f["name"] == name.as_str()).cloned();
        let read = get(format!("fanout_{store}_read_per_unique")).unwrap_or_else(|| panic!("{store}: {figs:?}"));
        let load = get(format!("fanout_{store}_load_vs_no_fanout")).unwrap_or_else(|| panic!("{store}: {figs:?}"));
        if store.starts_with("s3") && !s3 {
            assert!(read["value"].is_null() && load["value"].is_null(), "{read} {load}");
            continue;
        }
        let ratio = read["value"].as_f64().unwrap_or_else(|| panic!("{read}"));
        assert!((1.0..=1.05).contains(&ratio), "{store}: read {ratio} of the unique bytes: {read}");
        // Without it every one of the 4 replicas reads all of it.
        let without =
            read["note"].as_str().and_then(|n| n.strip_suffix(" without it")?.rsplit(' ').next()?.parse().ok());
        assert!(without.is_some_and(|w: f64| (4.0..=4.2).contains(&w)), "{read}");
        for field in ["value", "ceiling", "ratio"] {
            let v = load[field].as_f64().unwrap_or_else(|| panic!("{store} has no {field}: {load}"));
            assert!(v > 0.0 && v.is_finite(), "{store}: {field} {v}");
        }
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// `dckpt bench small` in one round: the ratio of the 20,000 tensors to the one, and the CPU
/// a tensor costs beyond its bytes, a number for each round (of either sign in one round:
/// the kernel's work for each side's 78 MiB moves by more than 20,000 tensors cost).
#[test]
fn bench_small_reports_its_ratio_and_the_cpu_a_tensor_costs() {
    let dir = tempfile::Builder::new().prefix("dckpt-cli-bench").tempdir().expect("temp dir");
    // What the user keeps in --dir stays, under the names the bench works with too.
    std::fs::create_dir(dir.path().join("small")).unwrap();
    for kept in ["keep.txt", "small/precious.txt"] {
        std::fs::write(dir.path().join(kept), "mine").unwrap();
    }
    let (figs, stderr) = bench_json(&["small", "--rounds", "1"], dir.path());
    for kept in ["keep.txt", "small/precious.txt"] {
        assert_eq!(std::fs::read_to_string(dir.path().join(kept)).ok().as_deref(), Some("mine"), "{kept}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2, "the bench's own directory is gone");
    let names: Vec<&str> = figs.iter().map(|f| f["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["small_tensors_vs_large", "small_tensors_cpu_us_per_tensor"], "{stderr}");
    assert!(figs[0]["ratio"].as_f64().is_some_and(|r| r > 0.0), "{}", figs[0]);
    assert!(figs[1]["value"].as_f64().is_some_and(|us| us.abs() < 1000.0), "{}", figs[1]);
    let note = figs[1]["note"].as_str().unwrap();
    assert_eq!(note.split("per round: ").nth(1).map(|r| r.split(", ").count()), Some(1), "{note}");
}
