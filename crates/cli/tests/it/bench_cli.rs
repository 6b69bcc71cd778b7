//! `dckpt bench scale` at its smallest: every figure there, the data bytes the model's.

use std::process::Command;

#[test]
fn bench_scale_reports_every_figure_and_the_model_s_bytes() {
    let dir = tempfile::Builder::new().prefix("dckpt-cli-bench").tempdir().expect("temp dir");
    let o = Command::new(env!("CARGO_BIN_EXE_dckpt"))
        .args(["bench", "scale", "--ranks", "32,64", "--processes", "16", "--json", "--dir"])
        .arg(dir.path())
        .output()
        .expect("running dckpt");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{stderr}");
    let figs: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).expect("a JSON array of figures");
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
