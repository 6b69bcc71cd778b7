//! Every rank's stdout and stderr, read by one thread that polls them all.
//!
//! One thread per pipe made a job of N ranks cost the launcher 2N threads, and every
//! `fork` copies the parent's page tables, each thread stack's among them: spawning the
//! last rank of 1,024 cost a thousand times the first (seconds in `copy_page_range` alone).
//! One thread keeps the launcher small, so spawning stays linear in N, whatever N.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::job::{OutputSink, OutputStream};

/// How long the thread waits in `poll` before it looks for pipes of ranks started since:
/// a new rank's first line waits this long at most.
const POLL_MS: i32 = 20;
/// Bytes read from a pipe at once.
const READ_BYTES: usize = 64 << 10;
/// A line longer than this is passed on in pieces of this size, so a rank that prints
/// without newlines cannot make the launcher hold its output without bound.
const LINE_BYTES_MAX: usize = 1 << 20;

/// The output thread and the way to hand it a rank's pipe.
pub(crate) struct Output {
    tx: Sender<Source>,
    thread: JoinHandle<()>,
}

/// One pipe being read, and its unfinished last line.
struct Source {
    rank: usize,
    stream: OutputStream,
    pipe: std::fs::File,
    line: Vec<u8>,
}

impl Output {
    pub(crate) fn start(sink: OutputSink) -> std::io::Result<Output> {
        let (tx, rx) = mpsc::channel();
        let thread = thread::Builder::new().name("dckpt-launch-output".into()).spawn(move || run(&rx, &sink))?;
        Ok(Output { tx, thread })
    }

    /// Reads `pipe` from now on, handing each line to the sink as `rank`'s `stream`.
    pub(crate) fn add(&self, rank: usize, stream: OutputStream, pipe: impl Into<std::os::fd::OwnedFd>) {
        let pipe = std::fs::File::from(pipe.into());
        // The thread lives as long as this handle; a send cannot fail before `finish`.
        let _ = self.tx.send(Source { rank, stream, pipe, line: Vec::new() });
    }

    /// Waits until every pipe has closed, `wait` at most. A pipe still open after that is
    /// held by a process that escaped its rank's group; the thread is left behind reading
    /// it rather than hanging the launcher.
    pub(crate) fn finish(self, wait: Duration) {
        drop(self.tx);
        let deadline = Instant::now() + wait;
        while !self.thread.is_finished() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        if self.thread.is_finished() {
            let _ = self.thread.join();
        }
    }
}

/// The thread: takes new pipes, polls the open ones, passes on what they hold; ends once
/// the handle is gone and every pipe has closed.
fn run(rx: &Receiver<Source>, sink: &OutputSink) {
    let mut open: Vec<Source> = Vec::new();
    let mut scratch = vec![0u8; READ_BYTES];
    let mut handle_gone = false;
    loop {
        handle_gone |= take_new(rx, &mut open, !handle_gone);
        if open.is_empty() {
            if handle_gone {
                return;
            }
            continue;
        }
        let ready = poll_ready(&open);
        let mut i = 0;
        while i < open.len() {
            if ready[i] && !read_some(&mut open[i], &mut scratch, sink) {
                let done = open.swap_remove(i);
                emit_rest(&done, sink);
                // swap_remove put the last pipe here; its readiness is lost for this round
                // only, and the next poll reports it again.
                continue;
            }
            i += 1;
        }
    }
}

/// Moves newly handed pipes into `open`; waits for one when none is open and `may_block`.
/// Returns whether the handle is gone.
fn take_new(rx: &Receiver<Source>, open: &mut Vec<Source>, may_block: bool) -> bool {
    if open.is_empty() && may_block {
        match rx.recv_timeout(Duration::from_millis(POLL_MS as u64)) {
            Ok(s) => open.push(s),
            Err(RecvTimeoutError::Timeout) => return false,
            Err(RecvTimeoutError::Disconnected) => return true,
        }
    }
    loop {
        match rx.try_recv() {
            Ok(s) => open.push(s),
            Err(TryRecvError::Empty) => return false,
            Err(TryRecvError::Disconnected) => return true,
        }
    }
}

/// Which pipes have something to read, or have closed (an error counts: the read says).
fn poll_ready(open: &[Source]) -> Vec<bool> {
    use std::os::fd::AsRawFd;
    let mut fds: Vec<libc::pollfd> =
        open.iter().map(|s| libc::pollfd { fd: s.pipe.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs, each fd open while `open` lives.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, POLL_MS) };
    if n < 0 {
        // EINTR, or a system without resources for the call: look again next round.
        return vec![false; open.len()];
    }
    fds.iter().map(|p| p.revents != 0).collect()
}

/// One read from a ready pipe, its complete lines passed on. Returns false at its end.
fn read_some(s: &mut Source, scratch: &mut [u8], sink: &OutputSink) -> bool {
    use std::io::Read;
    let n = match s.pipe.read(scratch) {
        Ok(0) => return false,
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return true,
        Err(_) => return false,
    };
    let mut rest = &scratch[..n];
    while let Some(at) = rest.iter().position(|b| *b == b'\n') {
        s.line.extend_from_slice(&rest[..at]);
        emit(s, sink);
        rest = &rest[at + 1..];
    }
    s.line.extend_from_slice(rest);
    if s.line.len() >= LINE_BYTES_MAX {
        emit(s, sink);
    }
    true
}

fn emit(s: &mut Source, sink: &OutputSink) {
    let text = String::from_utf8_lossy(&s.line);
    sink(s.rank, s.stream, text.trim_end_matches('\r'));
    s.line.clear();
}

/// A last line without a newline is still a line.
fn emit_rest(s: &Source, sink: &OutputSink) {
    if !s.line.is_empty() {
        let text = String::from_utf8_lossy(&s.line);
        sink(s.rank, s.stream, text.trim_end_matches('\r'));
    }
}
