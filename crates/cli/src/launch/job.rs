//! The process launcher behind `dckpt launch`: N local processes of one command as a
//! torchrun-style job. It lives in the CLI because starting, watching and killing child
//! processes is no business of a library loaded into someone else's process.
//!
//! Each process gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR=127.0.0.1`, `MASTER_PORT` and `DCKPT_MASTER_PORT` (the same port),
//! and `DCKPT_JOB_ID` / `TORCHELASTIC_RUN_ID` (a fresh id), so
//! `dckpt::collective::TcpCollective::from_env` just works. Output lines
//! are prefixed `[rank N] `. The first process to fail makes the launcher kill the others
//! and return its exit code.
//!
//! On Unix each rank runs in its own process group, and "kill" means SIGKILL to the whole
//! group, so a rank's own children (`sh -c`, a Python wrapper) go too. Ctrl-C, SIGTERM and
//! SIGHUP stop the launcher the same way: every rank's group killed, then the launcher exits
//! as 128 + the signal. On Linux the ranks also get SIGKILL when the thread that launched
//! them dies, so a launcher killed with SIGKILL leaves no rank behind (a rank's own children,
//! which only a group kill reaches, then outlive it).

use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::output::Output;

/// Why a job could not be launched (a job that ran and failed is an exit code instead).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The options make no job.
    #[error("invalid launch: {0}")]
    InvalidArgument(String),
    /// Starting or watching a process, or finding a port, failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl LaunchError {
    fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        LaunchError::Io { context: context.into(), source }
    }
}

type Result<T> = std::result::Result<T, LaunchError>;

/// What to launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOptions {
    /// Number of processes (ranks), at least 1.
    pub nproc: usize,
    /// Port rank 0 listens on; `None` picks a free one.
    pub master_port: Option<u16>,
    /// Job id; `None` makes a fresh one.
    pub job_id: Option<String>,
    /// The program and its arguments.
    pub command: Vec<String>,
}

/// Which output stream a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputStream {
    /// The child's stdout.
    Stdout,
    /// The child's stderr.
    Stderr,
}

/// Receives every output line of every rank (without its newline).
pub type OutputSink = Arc<dyn Fn(usize, OutputStream, &str) + Send + Sync>;

/// Runs the job, printing each line to this process's stdout or stderr as `[rank N] line`.
/// Returns 0 when every rank exits 0, else the first failure's exit code (128 + signal for
/// a rank killed by a signal).
pub fn launch(opts: &LaunchOptions) -> Result<i32> {
    let sink: OutputSink = Arc::new(|rank, stream, line| {
        let text = format!("[rank {rank}] {line}\n");
        // A closed terminal is no reason to fail the job.
        let _ = match stream {
            OutputStream::Stdout => std::io::stdout().lock().write_all(text.as_bytes()),
            OutputStream::Stderr => std::io::stderr().lock().write_all(text.as_bytes()),
        };
    });
    stop_on_signals();
    launch_with(opts, sink)
}

/// The signal that asked the launcher to stop (SIGINT, SIGTERM, SIGHUP); 0 while none has.
static STOP: AtomicI32 = AtomicI32::new(0);

#[cfg(unix)]
extern "C" fn note_stop(sig: libc::c_int) {
    STOP.store(sig, Ordering::Relaxed);
}

/// Ctrl-C, a scheduler's SIGTERM and a closed terminal stop the job through the supervisor,
/// which kills every rank's process group. Left to their default, they killed the launcher
/// alone: the ranks (in groups of their own, which the terminal's Ctrl-C does not reach)
/// died of the launcher's death, and whatever they had started outlived them. The launcher is
/// the host process here, so the handlers are its to install.
fn stop_on_signals() {
    #[cfg(unix)]
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(sig, note_stop as extern "C" fn(libc::c_int) as libc::sighandler_t);
        }
    }
}

/// As [`launch`], handing every output line to `sink` instead of printing it.
pub fn launch_with(opts: &LaunchOptions, sink: OutputSink) -> Result<i32> {
    let (program, args) =
        opts.command.split_first().ok_or_else(|| LaunchError::InvalidArgument("launch needs a command".into()))?;
    if opts.nproc == 0 {
        return Err(LaunchError::InvalidArgument("launch needs at least one process".into()));
    }
    let port = match opts.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    let job_id = opts.job_id.clone().unwrap_or_else(fresh_job_id);
    fit_fd_limit(opts.nproc)?;
    let output = Output::start(sink).map_err(|e| LaunchError::io("starting the output thread", e))?;
    let mut children: Vec<Child> = Vec::with_capacity(opts.nproc);
    for rank in 0..opts.nproc {
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        torchrun_env(&mut cmd, rank, opts.nproc, port, &job_id);
        own_group(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut children);
                return Err(LaunchError::io(format!("starting rank {rank}: {program:?}"), e));
            }
        };
        if let Some(out) = child.stdout.take() {
            output.add(rank, OutputStream::Stdout, out);
        }
        if let Some(err) = child.stderr.take() {
            output.add(rank, OutputStream::Stderr, err);
        }
        children.push(child);
    }
    let code = supervise(&mut children);
    // Waits briefly for the output of exited ranks to be printed.
    output.finish(Duration::from_secs(2));
    code
}

#[cfg(unix)]
fn own_group(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    #[cfg(target_os = "linux")]
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(unix))]
fn own_group(_cmd: &mut Command) {}

/// Kills a rank and everything in its process group.
fn kill_rank(child: &mut Child) {
    #[cfg(unix)]
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: plain syscall; the group id is the child's pid (process_group(0)). A
        // group that is already gone makes it fail with ESRCH, which is fine.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
    let _ = child.kill();
}

fn torchrun_env(cmd: &mut Command, rank: usize, nproc: usize, port: u16, job_id: &str) {
    cmd.env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", nproc.to_string())
        .env("LOCAL_WORLD_SIZE", nproc.to_string())
        .env("GROUP_RANK", "0")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("DCKPT_MASTER_PORT", port.to_string())
        .env("DCKPT_JOB_ID", job_id)
        .env("TORCHELASTIC_RUN_ID", job_id);
}

/// Descriptors the launcher holds besides its ranks' pipes (its own stdio, the output
/// thread's, a child's pipes while it is being spawned).
const FDS_SPARE: u64 = 64;

/// Makes room for two pipes per rank: raises the soft `RLIMIT_NOFILE` toward the hard one,
/// or fails before starting anything, naming the limit and what the job needs.
fn fit_fd_limit(nproc: usize) -> Result<()> {
    let need = (nproc as u64).saturating_mul(2).saturating_add(FDS_SPARE);
    match dckpt::collective::raise_open_files(need) {
        Ok(Ok(())) => Ok(()),
        Ok(Err((soft, hard))) => Err(LaunchError::InvalidArgument(format!(
            "{nproc} processes need {need} open files in the launcher (two pipes each), but RLIMIT_NOFILE \
             is {soft} (hard limit {hard}); raise it (ulimit -n {need}) or launch fewer"
        ))),
        Err(e) => Err(LaunchError::io("reading RLIMIT_NOFILE", e)),
    }
}

/// Waits for every child; on the first failure kills the rest. Returns the exit code.
fn supervise(children: &mut [Child]) -> Result<i32> {
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    loop {
        let stop = STOP.load(Ordering::Relaxed);
        if stop != 0 {
            kill_all(children);
            return Ok(128 + stop);
        }
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank].is_some() {
                continue;
            }
            let status = child.try_wait().map_err(|e| LaunchError::io(format!("waiting for rank {rank}"), e))?;
            if let Some(status) = status {
                done[rank] = Some(status);
                if !status.success() {
                    kill_all(children);
                    return Ok(exit_code(status));
                }
            }
        }
        if done.iter().all(Option::is_some) {
            return Ok(0);
        }
        thread::sleep(poll_interval(children.len()));
    }
}

/// How often the launcher looks at its ranks: a round costs a `waitpid` per rank, so
/// large jobs are looked at less often, to keep the launcher under a few percent of a core
/// while they run (and a failure seen within a fraction of a second).
fn poll_interval(nproc: usize) -> Duration {
    Duration::from_micros((nproc as u64).saturating_mul(20).clamp(10_000, 200_000))
}

fn kill_all(children: &mut [Child]) {
    for child in children.iter_mut() {
        kill_rank(child);
    }
    for child in children.iter_mut() {
        let _ = child.wait();
    }
}

fn exit_code(status: ExitStatus) -> i32 {
    if let Some(code) = status.code() {
        return if code == 0 { 1 } else { code };
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return 128 + sig;
        }
    }
    1
}

/// A port that was free a moment ago (the OS picks it; a race with another program
/// binding it in between is possible and shows as rank 0 failing to listen).
pub fn free_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| LaunchError::io("finding a free port", e))?;
    l.local_addr().map(|a| a.port()).map_err(|e| LaunchError::io("finding a free port", e))
}

fn fresh_job_id() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("dckpt-{}-{nanos:x}", std::process::id())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use dckpt::collective::{Collective, ReduceOp, TcpCollective};

    use super::*;

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
        assert!(matches!(launch_with(&none, Arc::clone(&out)), Err(LaunchError::InvalidArgument { .. })));
        assert!(matches!(launch_with(&sh(0, "true"), Arc::clone(&out)), Err(LaunchError::InvalidArgument { .. })));
        let missing = LaunchOptions { command: vec!["/nonexistent/dckpt-no-such-program".into()], ..sh(2, "") };
        assert!(matches!(launch_with(&missing, out), Err(LaunchError::Io { .. })));
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
        let cmd = [
            "env",
            "DCKPT_TEST_LAUNCHED=1",
            &exe,
            "--exact",
            "launch::job::tests::launched_child",
            "--nocapture",
            "-q",
        ];
        let opts = LaunchOptions { command: cmd.iter().map(|s| s.to_string()).collect(), ..sh(4, "") };
        assert_eq!(launch_with(&opts, out).unwrap(), 0);
        let mut sums: Vec<usize> =
            lines.lock().unwrap().iter().filter(|(_, _, l)| l == "sum=6").map(|(r, _, _)| *r).collect();
        sums.sort();
        assert_eq!(sums, [0, 1, 2, 3]);
    }
}
