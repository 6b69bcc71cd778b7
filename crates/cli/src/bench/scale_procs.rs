//! `bench scale` with ranks as processes: `dckpt launch` of the `tiny` demo (this
//! executable), saved at tp 2, pp 4, ep 4 with the distributed optimizer and loaded at tp 4,
//! pp 2 by the same processes, over TCP, on local disk.

use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use super::{BenchArgs, Figure};

/// The wall seconds of one launch of `n` processes; a launch that fails gives a figure
/// without a value whose note says why (the other figures are kept).
pub fn figure(a: &BenchArgs, n: usize) -> Figure {
    let name = format!("scale_processes_{n}_seconds");
    let what = format!(
        "wall seconds of `dckpt launch --nproc {n}` of the tiny demo: save at tp 2 pp 4 ep 4 (distributed \
         optimizer), load at tp 4 pp 2, every element checked, local disk"
    );
    match launch(a, n) {
        Ok(s) => Figure::plain(name, s, what),
        Err(e) => {
            let why = crate::fmt::chain(&e);
            eprintln!("dckpt bench scale: {n} processes: {why}");
            Figure::missing(name, format!("{what}: failed: {why}"))
        }
    }
}

fn launch(a: &BenchArgs, n: usize) -> Result<f64> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let dir = a.dir().join(format!("scale-processes-{n}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (n_s, exe_s) = (n.to_string(), exe.to_string_lossy().into_owned());
    let dir_s = dir.to_str().context("non-UTF-8 directory")?;
    #[rustfmt::skip]
    let args = [
        "launch", "--nproc", &n_s, "--", &exe_s, "demo", "--model", "tiny", "--world", &n_s, "--tp", "2",
        "--pp", "4", "--ep", "4", "--optimizer", "distributed", "--load-world", &n_s, "--load-tp", "4",
        "--load-pp", "2", "--dir", dir_s, "--json",
    ];
    let t = Instant::now();
    let out = Command::new(&exe).args(args).stdin(Stdio::null()).output().context("starting dckpt launch")?;
    let seconds = t.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!("dckpt launch exited with {}: {}", out.status, tail.join(" | "));
    }
    // The launcher prefixes each line a rank prints with its rank.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find_map(|l| l.strip_prefix("[rank 0] ")).context("rank 0 printed no report")?;
    let report: serde_json::Value = serde_json::from_str(line).context("rank 0's JSON report")?;
    if report["verified"] != true || report["saved_bytes"] != report["expected_bytes"] {
        bail!("the demo did not verify: {report}");
    }
    Ok(seconds)
}
