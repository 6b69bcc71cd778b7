//! `dckpt launch`: run N local processes of one command as a torchrun-style job.
//!
//! Each process gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR=127.0.0.1`, `MASTER_PORT` and `DCKPT_MASTER_PORT` (the same port),
//! and `DCKPT_JOB_ID` / `TORCHELASTIC_RUN_ID` (a fresh id), so
//! [`TcpCollective::from_env`](crate::TcpCollective::from_env) just works. Output lines
//! are prefixed `[rank N] `. The first process to fail makes the launcher kill the others
//! and return its exit code.
//!
//! On Unix each rank runs in its own process group, and "kill" means SIGKILL to the whole
//! group, so a rank's own children (`sh -c`, a Python wrapper) go too. On Linux the ranks
//! also get SIGKILL when the thread that launched them dies, so a killed launcher leaves
//! no orphans.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::{Error, Result};

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
    launch_with(opts, sink)
}

/// As [`launch`], handing every output line to `sink` instead of printing it.
pub fn launch_with(opts: &LaunchOptions, sink: OutputSink) -> Result<i32> {
    let (program, args) = opts.command.split_first().ok_or_else(|| Error::invalid("launch needs a command"))?;
    if opts.nproc == 0 {
        return Err(Error::invalid("launch needs at least one process"));
    }
    let port = match opts.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    let job_id = opts.job_id.clone().unwrap_or_else(fresh_job_id);
    let mut children: Vec<Child> = Vec::with_capacity(opts.nproc);
    let mut pumps: Vec<JoinHandle<()>> = Vec::new();
    for rank in 0..opts.nproc {
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        torchrun_env(&mut cmd, rank, opts.nproc, port, &job_id);
        own_group(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut children);
                return Err(Error::io(format!("starting rank {rank}: {program:?}"), e));
            }
        };
        if let Some(out) = child.stdout.take() {
            pumps.push(pump(rank, OutputStream::Stdout, out, Arc::clone(&sink)));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(pump(rank, OutputStream::Stderr, err, Arc::clone(&sink)));
        }
        children.push(child);
    }
    let code = supervise(&mut children)?;
    drain(pumps);
    Ok(code)
}

/// Waits briefly for the output of exited ranks to be printed. A pump still blocked after
/// that belongs to a process that escaped its group and still holds the pipe; it is left
/// behind rather than hanging the launcher.
fn drain(pumps: Vec<JoinHandle<()>>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while pumps.iter().any(|p| !p.is_finished()) && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
    }
    for p in pumps.into_iter().filter(JoinHandle::is_finished) {
        let _ = p.join();
    }
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

/// Waits for every child; on the first failure kills the rest. Returns the exit code.
fn supervise(children: &mut [Child]) -> Result<i32> {
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    loop {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank].is_some() {
                continue;
            }
            let status = child.try_wait().map_err(|e| Error::io(format!("waiting for rank {rank}"), e))?;
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
        thread::sleep(Duration::from_millis(10));
    }
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

fn pump(rank: usize, stream: OutputStream, from: impl Read + Send + 'static, sink: OutputSink) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    sink(rank, stream, text.trim_end_matches(['\n', '\r']));
                }
            }
        }
    })
}

/// A port that was free a moment ago (the OS picks it; a race with another program
/// binding it in between is possible and shows as rank 0 failing to listen).
pub fn free_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| Error::io("finding a free port", e))?;
    l.local_addr().map(|a| a.port()).map_err(|e| Error::io("finding a free port", e))
}

fn fresh_job_id() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("dckpt-{}-{nanos:x}", std::process::id())
}
