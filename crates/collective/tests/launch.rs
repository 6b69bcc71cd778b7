//! `launch`: real processes, real exit codes, prefixed output.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dckpt_collective::launch::{OutputSink, OutputStream, launch_with};
use dckpt_collective::{Collective, Error, LaunchOptions, ReduceOp, TcpCollective};

type Lines = Arc<Mutex<Vec<(usize, OutputStream, String)>>>;

fn sink() -> (OutputSink, Lines) {
    let lines: Lines = Arc::default();
    let l = Arc::clone(&lines);
    (Arc::new(move |rank, stream, line: &str| l.lock().unwrap().push((rank, stream, line.to_string()))), lines)
}

fn sh(nproc: usize, script: &str) -> LaunchOptions {
    LaunchOptions { nproc, master_port: None, job_id: None, command: vec!["sh".into(), "-c".into(), script.into()] }
}

#[test]
fn every_rank_gets_the_torchrun_environment_and_its_output_is_attributed() {
    let (out, lines) = sink();
    let script = "echo rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE lw=$LOCAL_WORLD_SIZE \
                  addr=$MASTER_ADDR same=$([ \"$MASTER_PORT\" = \"$DCKPT_MASTER_PORT\" ] && echo y) \
                  job=$([ -n \"$DCKPT_JOB_ID\" ] && echo y); echo oops >&2";
    let code = launch_with(&sh(3, script), out).unwrap();
    assert_eq!(code, 0);
    let mut lines = lines.lock().unwrap().clone();
    lines.sort_by_key(|a| (a.0, a.2.clone()));
    let want: Vec<(usize, OutputStream, String)> = (0..3)
        .flat_map(|r| {
            [
                (r, OutputStream::Stderr, "oops".to_string()),
                (r, OutputStream::Stdout, format!("rank={r} local={r} world=3 lw=3 addr=127.0.0.1 same=y job=y")),
            ]
        })
        .collect();
    assert_eq!(lines, want);
}

#[test]
fn a_failing_rank_stops_the_others_and_its_code_is_returned() {
    let (out, _) = sink();
    let start = Instant::now();
    let code = launch_with(&sh(4, "if [ $RANK = 2 ]; then exit 7; fi; sleep 30"), out).unwrap();
    assert_eq!(code, 7);
    assert!(start.elapsed() < Duration::from_secs(10), "others were not stopped: {:?}", start.elapsed());
}

#[test]
fn bad_launches_are_errors() {
    let (out, _) = sink();
    let none = LaunchOptions { command: vec![], ..sh(1, "") };
    assert!(matches!(launch_with(&none, Arc::clone(&out)), Err(Error::InvalidArgument { .. })));
    assert!(matches!(launch_with(&sh(0, "true"), Arc::clone(&out)), Err(Error::InvalidArgument { .. })));
    let missing = LaunchOptions { command: vec!["/nonexistent/dckpt-no-such-program".into()], ..sh(2, "") };
    assert!(matches!(launch_with(&missing, out), Err(Error::Io { .. })));
}

/// Child side of `launched_processes_form_a_tcp_world`: runs only when launched.
#[test]
fn launched_child() {
    if std::env::var("DCKPT_TEST_LAUNCHED").is_err() {
        return;
    }
    let c = TcpCollective::from_env().expect("join");
    let sum = c.all_reduce_u64(&[c.rank() as u64], ReduceOp::Sum).expect("sum");
    println!("sum={}", sum[0]);
}

#[test]
fn launched_processes_form_a_tcp_world() {
    let (out, lines) = sink();
    let exe = std::env::current_exe().unwrap().to_string_lossy().into_owned();
    let cmd = ["env", "DCKPT_TEST_LAUNCHED=1", &exe, "--exact", "launched_child", "--nocapture", "-q"];
    let opts = LaunchOptions { command: cmd.iter().map(|s| s.to_string()).collect(), ..sh(4, "") };
    assert_eq!(launch_with(&opts, out).unwrap(), 0);
    let mut sums: Vec<usize> =
        lines.lock().unwrap().iter().filter(|(_, _, l)| l == "sum=6").map(|(r, _, _)| *r).collect();
    sums.sort();
    assert_eq!(sums, [0, 1, 2, 3]);
}
