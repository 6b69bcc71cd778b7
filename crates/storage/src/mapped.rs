//! Copies out of a read-only mapping of a file, with the faults of a mapping turned into
//! errors.
//!
//! Many short stretches of a file (half of every row of a chunk split by columns) cost a
//! system call each with `pread`, or a kernel copy of the gaps with one `preadv`. Copied
//! out of a mapping they cost neither. But a mapped page the kernel cannot supply (a read
//! error, or a file cut short after it was mapped) raises `SIGBUS`, which kills the
//! process, where a read returns an error.
//!
//! So copies go through [`Mapping::copy_out`]. While a thread copies, a `SIGBUS` handler
//! knows the range of the mapping it copies from. A fault inside that range gets an
//! anonymous zero page mapped over the page that could not be read, and its address
//! recorded; the copy then goes on, and `copy_out` returns the offset. Every other `SIGBUS`
//! goes to the handler that was there before ours, so a fault outside our copies ends the
//! process as it would have without us. The mapping that faulted is not used again: its
//! zero pages would read as data.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::ptr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering, compiler_fence};

/// A whole file mapped read-only, shared with the page cache.
#[derive(Debug)]
pub(crate) struct Mapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain process memory, readable from any thread; `copy_out` arms the
// fault handler for the thread it runs on.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `file`, or `None` where that is not possible (an empty
    /// file, a file system without mappings, no handler): the caller then reads.
    pub(crate) fn new(file: &File, len: u64) -> Option<Mapping> {
        let len = usize::try_from(len).ok().filter(|&l| l > 0)?;
        if !handler_in_place() {
            return None;
        }
        // SAFETY: a new mapping at an address the kernel chooses; nothing else is touched.
        let base = unsafe { libc::mmap(ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        (base != libc::MAP_FAILED).then(|| Mapping { base: base.cast(), len })
    }

    /// Copies the file's bytes at each `(offset, buffer)` into the buffer. On a fault,
    /// returns the offset of the first byte that could not be read; the buffers then hold
    /// zeros where the file could not be read, and the mapping must be dropped.
    pub(crate) fn copy_out<'b>(&self, reads: impl Iterator<Item = (u64, &'b mut [u8])>) -> Result<(), u64> {
        let armed = Armed::new(self);
        for (at, buf) in reads {
            let at = usize::try_from(at).expect("an offset inside the mapping");
            assert!(at.checked_add(buf.len()).is_some_and(|end| end <= self.len), "a copy past the mapping");
            // SAFETY: the source lies inside the live mapping (asserted above) and the
            // destination is an exclusively borrowed buffer. A page that cannot be read
            // faults into the handler, which maps zeros over it and lets the copy go on.
            unsafe { ptr::copy_nonoverlapping(self.base.add(at), buf.as_mut_ptr(), buf.len()) };
        }
        armed.fault()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped (zero pages mapped over parts of it
        // by the handler go with it); nothing borrows it past `copy_out`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

thread_local! {
    /// The range this thread copies from, `start..end` (empty when not copying), and the
    /// first faulting address inside it plus one (0: none). Read by the handler, which
    /// runs on the faulting thread. Constant-initialised, without destructors: plain
    /// thread-local memory, safe to touch from a signal handler.
    static START: AtomicUsize = const { AtomicUsize::new(0) };
    static END: AtomicUsize = const { AtomicUsize::new(0) };
    static FAULT: AtomicUsize = const { AtomicUsize::new(0) };
}

/// This thread's fault handling armed for one mapping, disarmed on drop (a panic included).
struct Armed;

impl Armed {
    fn new(m: &Mapping) -> Armed {
        FAULT.with(|f| f.store(0, Ordering::Relaxed));
        START.with(|s| s.store(m.base as usize, Ordering::Relaxed));
        END.with(|e| e.store(m.base as usize + m.len, Ordering::Relaxed));
        // The handler runs on this thread: only the compiler may reorder, and must not move
        // the copies above this.
        compiler_fence(Ordering::SeqCst);
        Armed
    }

    fn fault(&self) -> Result<(), u64> {
        compiler_fence(Ordering::SeqCst);
        let start = START.with(|s| s.load(Ordering::Relaxed));
        match FAULT.with(|f| f.load(Ordering::Relaxed)) {
            0 => Ok(()),
            at => Err((at - 1 - start) as u64),
        }
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        compiler_fence(Ordering::SeqCst);
        END.with(|e| e.store(0, Ordering::Relaxed));
        START.with(|s| s.store(0, Ordering::Relaxed));
    }
}

/// The `SIGBUS` disposition found when ours was installed, to hand other faults to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
static PAGE: AtomicUsize = AtomicUsize::new(0);

/// Installs the handler once per process; whether it is still the one in place (a handler
/// installed after ours would turn our copies' faults back into deaths: then no mappings).
fn handler_in_place() -> bool {
    static INSTALLED: OnceLock<bool> = OnceLock::new();
    let installed = *INSTALLED.get_or_init(|| {
        // SAFETY: `sysconf` and `sigaction` with valid, initialised arguments.
        unsafe {
            let page = libc::sysconf(libc::_SC_PAGESIZE);
            if page <= 0 {
                return false;
            }
            PAGE.store(page as usize, Ordering::Relaxed);
            let mut ours: libc::sigaction = std::mem::zeroed();
            ours.sa_sigaction = handler();
            ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut ours.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &ours, &mut previous) != 0 {
                return false;
            }
            // A fault between the two lines finds no previous disposition and takes the
            // default one, which is what it most likely was.
            let _ = PREVIOUS.set(previous);
            true
        }
    });
    // SAFETY: `sigaction` only reads the current disposition into `now`.
    installed
        && unsafe {
            let mut now: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGBUS, ptr::null(), &mut now) == 0 && now.sa_sigaction == handler()
        }
}

fn handler() -> libc::sighandler_t {
    on_sigbus as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as libc::sighandler_t
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid `siginfo_t` to an `SA_SIGINFO` handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let start = START.with(|s| s.load(Ordering::Relaxed));
    let end = END.with(|e| e.load(Ordering::Relaxed));
    if (start..end).contains(&addr) {
        let page = PAGE.load(Ordering::Relaxed);
        let at = addr & !(page - 1);
        // SAFETY: replaces one page of the mapping this thread is copying from (inside
        // `start..end`, page-aligned) with zeros; nothing else is there.
        let zero = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if zero != libc::MAP_FAILED {
            FAULT.with(|f| {
                let _ = f.compare_exchange(0, addr + 1, Ordering::Relaxed, Ordering::Relaxed);
            });
            return;
        }
    }
    // Not ours: what would have happened without us.
    match PREVIOUS.get() {
        Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
            // SAFETY: calling the previous handler as it was installed to be called.
            unsafe {
                if p.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(p.sa_sigaction);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(p.sa_sigaction);
                    f(sig);
                }
            }
        }
        // The default: put it back and return; the access faults again and ends the process.
        _ => {
            // SAFETY: `sigaction` with a valid, initialised argument.
            unsafe {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigemptyset(&mut default.sa_mask);
                libc::sigaction(libc::SIGBUS, &default, ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(dir: &std::path::Path, len: usize) -> (std::path::PathBuf, Vec<u8>) {
        let data: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4096) as u8).collect();
        let p = dir.join("f");
        std::fs::File::create(&p).unwrap().write_all(&data).unwrap();
        (p, data)
    }

    #[test]
    fn copies_what_the_file_holds() {
        let dir = tempfile::tempdir().unwrap();
        let (p, data) = file_of(dir.path(), 300_000);
        let m = Mapping::new(&File::open(&p).unwrap(), data.len() as u64).expect("a mapping");
        let mut bufs: Vec<(u64, Vec<u8>)> = (0..100).map(|i| (i * 2999, vec![0u8; 1000 + i as usize])).collect();
        m.copy_out(bufs.iter_mut().map(|(at, b)| (*at, b.as_mut_slice()))).unwrap();
        for (at, b) in &bufs {
            assert_eq!(&b[..], &data[*at as usize..*at as usize + b.len()]);
        }
        assert!(Mapping::new(&File::open(&p).unwrap(), 0).is_none(), "nothing to map");
    }

    /// A file cut short after it was mapped: the copy reports the first offset it could not
    /// read, instead of `SIGBUS` ending the test process.
    #[test]
    fn a_file_cut_short_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (p, data) = file_of(dir.path(), 1 << 20);
        let f = File::open(&p).unwrap();
        let m = Mapping::new(&f, data.len() as u64).expect("a mapping");
        let page = PAGE.load(Ordering::Relaxed);
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(5 * page as u64 + 10).unwrap();
        let mut head = vec![0u8; 5 * page];
        m.copy_out(std::iter::once((0, head.as_mut_slice()))).unwrap();
        assert_eq!(&head[..], &data[..5 * page]);
        let mut bufs: Vec<(u64, Vec<u8>)> = (0..64).map(|i| (i * 16_000 + 7, vec![1u8; 3000])).collect();
        let r = m.copy_out(bufs.iter_mut().map(|(at, b)| (*at, b.as_mut_slice())));
        // The first read reaching a page past the new end is where the copy faulted first.
        let first = bufs.iter().find(|(at, b)| (*at as usize + b.len()) > 6 * page).unwrap();
        let at = r.expect_err("a fault");
        assert!((first.0..first.0 + first.1.len() as u64).contains(&at) && at >= 6 * page as u64, "{at}");
        for (at, b) in &bufs {
            if ((*at as usize) + b.len()) <= 5 * page {
                assert_eq!(&b[..], &data[*at as usize..*at as usize + b.len()]);
            }
        }
        // The thread's handling is disarmed again: a fresh mapping of the short file reads.
        drop(m);
        let m = Mapping::new(&f, 5 * page as u64 + 10).unwrap();
        let mut tail = vec![0u8; 10];
        m.copy_out(std::iter::once((5 * page as u64, tail.as_mut_slice()))).unwrap();
        assert_eq!(&tail[..], &data[5 * page..5 * page + 10]);
    }

    /// A `SIGBUS` outside a copy still ends the process: in a child (this test binary, run
    /// for the test below), after the handler is installed, the test touches a mapped page
    /// past the end of a file itself.
    #[test]
    fn other_faults_still_end_the_process() {
        use std::os::unix::process::ExitStatusExt;
        if std::env::var_os("DCKPT_FOREIGN_SIGBUS").is_some() {
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args(["--exact", "mapped::tests::foreign_sigbus_child", "--nocapture", "--test-threads=1"])
            .env("DCKPT_FOREIGN_SIGBUS", "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("touching past the end"), "the child ran the test: {stdout}");
        assert_eq!(out.status.signal(), Some(libc::SIGBUS), "child: {:?}\n{stdout}", out.status);
    }

    #[test]
    fn foreign_sigbus_child() {
        if std::env::var_os("DCKPT_FOREIGN_SIGBUS").is_none() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (p, _) = file_of(dir.path(), 1 << 16);
        let f = File::open(&p).unwrap();
        let ours = Mapping::new(&f, 1 << 16).expect("a mapping, with the handler installed");
        let mut b = [0u8; 8];
        ours.copy_out(std::iter::once((0, &mut b[..]))).unwrap();
        // SAFETY: deliberately not: a mapping past the end of the file, read outside any copy.
        unsafe {
            let p = libc::mmap(ptr::null_mut(), 1 << 20, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0);
            assert_ne!(p, libc::MAP_FAILED);
            println!("touching past the end");
            let v = ptr::read_volatile(p.cast::<u8>().add(1 << 19));
            println!("survived, read {v}");
        }
    }
}
