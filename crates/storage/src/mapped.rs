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
//! knows the range of the mapping it copies from. On a fault inside that range the handler
//! maps zeros over the whole mapping (one replacement, whatever the address the CPU
//! reports) and records the address; the copy stops at the end of the read it is in, and
//! `copy_out` returns the offset. A mapping that failed once refuses every later copy. Every
//! other `SIGBUS` goes to the disposition that was there before ours, so a fault outside our
//! copies ends the process as it would have without us.
//!
//! A copy is made only while our handler is the installed one and the thread does not block
//! `SIGBUS` (the kernel would then kill the process for a fault, handler or not); otherwise
//! the caller reads. Another thread changing the disposition between that check and the
//! copy is not guarded against.
//!
//! A file cut short inside a page reads as zeros past its end, without a fault; so does a
//! page-cache folio mapped past the end. `copy_out` therefore checks the file's size after
//! copying: a cut that finished before that check is caught (a file system may zero the
//! tail of the new last block a moment before it lowers the size; dckpt never cuts its
//! files in place, it replaces them by rename).

use std::cell::Cell;
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
    /// A copy failed: the mapping may hold zeros in place of the file; no more copies.
    failed: Cell<bool>,
}

// SAFETY: the mapping is plain process memory, readable from any thread; `copy_out` arms the
// fault handler for the thread it runs on.
unsafe impl Send for Mapping {}

/// Why [`Mapping::copy_out`] did not copy everything; in every case the mapping is not to
/// be used again.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unreadable {
    /// Our `SIGBUS` handler is not the installed one (something installed another after
    /// it), or this thread blocks `SIGBUS`: nothing was copied; read instead.
    NoHandler,
    /// An earlier copy out of this mapping failed: nothing was copied.
    Failed,
    /// The page at this offset could not be read (a read error, or the file was cut short).
    Fault(u64),
    /// The file is now `size` bytes, short of the copy that ended at `end`.
    Shorter { size: u64, end: u64 },
    /// The file's size could not be checked after copying.
    Stat,
}

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
        (base != libc::MAP_FAILED).then(|| Mapping { base: base.cast(), len, failed: Cell::new(false) })
    }

    /// Copies the bytes of `file` (the file mapped) at each `(offset, buffer)` into the
    /// buffer, in the order given. On an error, the buffers hold what was copied, zeros
    /// included, and are not to be used.
    pub(crate) fn copy_out<'b>(
        &self,
        file: &File,
        reads: impl Iterator<Item = (u64, &'b mut [u8])>,
    ) -> Result<(), Unreadable> {
        self.copy_checked(file, reads, |_, src, dst| dst.copy_from_slice(src))
    }

    /// [`Mapping::copy_out`] of every read, each shown to `inspect` (see
    /// [`crate::ObjectReader::read_into_inspected`]) [`INSPECTED_PIECE`] bytes at a time, just
    /// before they are copied: the piece is then in the CPU's first-level cache, and the copy
    /// streams it into the buffer past the cache (a checksum after the copy would read it
    /// back from memory). On an error, what `inspect` saw means nothing.
    pub(crate) fn copy_inspected(
        &self,
        file: &File,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), Unreadable> {
        let reads = reads.iter_mut().map(|(at, buf)| (*at, &mut **buf));
        let copied = self.copy_checked(file, reads, |i, src, dst| {
            for (s, d) in src.chunks(INSPECTED_PIECE).zip(dst.chunks_mut(INSPECTED_PIECE)) {
                inspect(i, s);
                stream_copy(s, d);
            }
        });
        stream_fence();
        copied
    }

    /// Shows `inspect` every byte of `range` out of the mapping, [`INSPECTED_PIECE`] bytes at
    /// a time, and streams the parts of `picks` (inside the range, in order, disjoint) that
    /// each piece holds into them just after it is shown (see
    /// [`crate::ObjectReader::read_picked_inspected`]). On an error, what `inspect` saw means
    /// nothing.
    pub(crate) fn copy_picked(
        &self,
        file: &File,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<(), Unreadable> {
        let copied = self.armed_on(file, |armed| {
            let (start, end) = (self.inside(range.start, 0), self.inside(range.end, 0));
            assert!(start <= end, "a range that ends before it starts");
            let mut next = 0;
            let mut at = start;
            while at < end {
                let n = (end - at).min(INSPECTED_PIECE);
                // SAFETY: as in `copy_checked`: inside the live mapping (checked by `inside`).
                let src = unsafe { std::slice::from_raw_parts(self.base.add(at), n) };
                inspect(src);
                next = crate::copy_picks(at as u64, src, picks, next, stream_copy);
                armed.fault()?;
                at += n;
            }
            Ok(end)
        });
        stream_fence();
        copied
    }

    /// `at` as an offset into the mapping, with `len` bytes after it inside it.
    fn inside(&self, at: u64, len: usize) -> usize {
        let at = usize::try_from(at).expect("an offset inside the mapping");
        assert!(at.checked_add(len).is_some_and(|end| end <= self.len), "a copy past the mapping");
        at
    }

    fn copy_checked<'b>(
        &self,
        file: &File,
        reads: impl Iterator<Item = (u64, &'b mut [u8])>,
        mut copy: impl FnMut(usize, &[u8], &mut [u8]),
    ) -> Result<(), Unreadable> {
        self.armed_on(file, |armed| {
            let mut end = 0;
            for (i, (at, buf)) in reads.enumerate() {
                let at = self.inside(at, buf.len());
                // SAFETY: the source lies inside the live mapping (checked by `inside`), which
                // is unmapped only on drop, and the destination is an exclusively borrowed
                // buffer. A page that cannot be read faults into the handler, which maps zeros
                // over the mapping and lets the copy run to its end. The file is not written
                // while it is read (dckpt replaces files by rename, never in place), the
                // assumption every reader of a mapped file makes.
                let src = unsafe { std::slice::from_raw_parts(self.base.add(at), buf.len()) };
                copy(i, src, buf);
                armed.fault()?;
                end = end.max(at + buf.len());
            }
            Ok(end)
        })
    }

    /// Runs `copies` (which returns the end of what it copied) with this thread's fault
    /// handling armed for the mapping, then checks the file still reaches that end.
    fn armed_on(
        &self,
        file: &File,
        copies: impl FnOnce(&Armed) -> Result<usize, Unreadable>,
    ) -> Result<(), Unreadable> {
        if self.failed.get() {
            return Err(Unreadable::Failed);
        }
        // Two system calls per call: a handler installed after the mapping was made must
        // not receive our faults, and a thread that blocks `SIGBUS` would not reach ours.
        if !handler_in_place() || sigbus_blocked() {
            return Err(Unreadable::NoHandler);
        }
        let copied = (|| {
            let armed = Armed::new(self);
            let end = copies(&armed)?;
            drop(armed);
            let size = file.metadata().map_err(|_| Unreadable::Stat)?.len();
            let end = end as u64;
            if size < end { Err(Unreadable::Shorter { size, end }) } else { Ok(()) }
        })();
        self.failed.set(copied.is_err());
        copied
    }
}

/// The bytes [`Mapping::copy_inspected`] shows at a time: a third of a first-level data cache
/// (48 KiB per core on this machine; 32 KiB on most), so that the piece is still there when
/// it is copied. Measured against 4, 8, 32 and 64 KiB and 512 KiB in docs/benchmarks.md,
/// "Decisions behind the constants".
pub(crate) const INSPECTED_PIECE: usize = 16 << 10;

/// Copies `src` into `dst` (equal lengths) with non-temporal stores where the CPU has them:
/// the destination is not read first and does not evict what is in the cache. A large copy
/// out of the page cache runs at about twice the speed of plain stores here. The stores are
/// ordered by [`stream_fence`], which the caller issues before the buffers are used.
fn stream_copy(src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let (src_head, src) = src.split_at(head);
        let (dst_head, dst) = dst.split_at_mut(head);
        dst_head.copy_from_slice(src_head);
        let body = dst.len() / 64 * 64;
        let (src_body, src_tail) = src.split_at(body);
        let (dst_body, dst_tail) = dst.split_at_mut(body);
        for (s, d) in src_body.chunks_exact(64).zip(dst_body.chunks_exact_mut(64)) {
            let (s, d) = (s.as_ptr().cast::<__m128i>(), d.as_mut_ptr().cast::<__m128i>());
            // SAFETY: SSE2 is part of x86_64; each 64-byte chunk is four 16-byte lanes, read
            // unaligned from `src` and stored to `dst`, 16-byte aligned from `head` on.
            unsafe {
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
        }
        dst_tail.copy_from_slice(src_tail);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Orders the non-temporal stores of [`stream_copy`] before every later store of this thread
/// (and so before the buffers are handed to another).
fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped (or the zeros the handler put in its
        // place); nothing borrows it past `copy_out`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

thread_local! {
    /// The range this thread copies from, `start..end` (page-rounded; empty when not
    /// copying), and the first faulting address inside it plus one (0: none). Read by the
    /// handler, which runs on the faulting thread. Constant-initialised, without
    /// destructors: in an executable, plain thread-local memory, safe to touch from a
    /// signal handler (a library loaded with `dlopen` could allocate on a thread's first
    /// access; dckpt ships none).
    static START: AtomicUsize = const { AtomicUsize::new(0) };
    static END: AtomicUsize = const { AtomicUsize::new(0) };
    static FAULT: AtomicUsize = const { AtomicUsize::new(0) };
}

/// This thread's fault handling armed for one mapping, disarmed on drop (a panic included).
struct Armed;

impl Armed {
    fn new(m: &Mapping) -> Armed {
        assert_eq!(START.with(|s| s.load(Ordering::Relaxed)), 0, "copies do not nest");
        let page = PAGE.load(Ordering::Relaxed);
        FAULT.with(|f| f.store(0, Ordering::Relaxed));
        START.with(|s| s.store(m.base as usize, Ordering::Relaxed));
        END.with(|e| e.store(m.base as usize + m.len.div_ceil(page) * page, Ordering::Relaxed));
        // The handler runs on this thread: only the compiler may reorder, and must not move
        // the copies above this.
        compiler_fence(Ordering::SeqCst);
        Armed
    }

    /// The offset of the page that faulted, if one did.
    fn fault(&self) -> Result<(), Unreadable> {
        compiler_fence(Ordering::SeqCst);
        match FAULT.with(|f| f.load(Ordering::Relaxed)) {
            0 => Ok(()),
            at => {
                let page = PAGE.load(Ordering::Relaxed);
                let start = START.with(|s| s.load(Ordering::Relaxed));
                Err(Unreadable::Fault((((at - 1) & !(page - 1)) - start) as u64))
            }
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

/// Installs the handler once per process; whether it is still the one in place.
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
            // The disposition before ours (in a Rust program, std's stack-overflow handler),
            // kept before ours goes in so that no fault finds it missing. Another thread
            // changing it between the two calls would be overridden.
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, ptr::null(), &mut previous) != 0 {
                return false;
            }
            let _ = PREVIOUS.set(previous);
            let mut ours: libc::sigaction = std::mem::zeroed();
            ours.sa_sigaction = handler();
            ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut ours.sa_mask);
            libc::sigaction(libc::SIGBUS, &ours, ptr::null_mut()) == 0
        }
    });
    // SAFETY: `sigaction` only reads the current disposition into `now`.
    installed
        && unsafe {
            let mut now: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGBUS, ptr::null(), &mut now) == 0
                && now.sa_sigaction == handler()
                && now.sa_flags & libc::SA_SIGINFO != 0
        }
}

/// Whether this thread blocks `SIGBUS`.
fn sigbus_blocked() -> bool {
    // SAFETY: `pthread_sigmask` only reads the current mask into `now`.
    unsafe {
        let mut now: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, ptr::null(), &mut now) != 0 || libc::sigismember(&now, libc::SIGBUS) == 1
    }
}

fn handler() -> libc::sighandler_t {
    on_sigbus as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as libc::sighandler_t
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid `siginfo_t` to an `SA_SIGINFO` handler; `si_addr`
    // means something only for a fault the kernel raised (a positive `si_code`), not for
    // a signal another process sent.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    let start = START.with(|s| s.load(Ordering::Relaxed));
    let end = END.with(|e| e.load(Ordering::Relaxed));
    if code > 0 && (start..end).contains(&addr) {
        // SAFETY: replaces the mapping this thread is copying from (`start..end`, page
        // aligned, nothing else in it) with zeros, so that the copy can go on whatever
        // address the CPU reports for the fault.
        let zeros = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                end - start,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if zeros != libc::MAP_FAILED {
            FAULT.with(|f| {
                let _ = f.compare_exchange(0, addr + 1, Ordering::Relaxed, Ordering::Relaxed);
            });
            return;
        }
    }
    // Not ours: what would have happened without us. A previous handler is called directly
    // (its own mask and `SA_NODEFER` are not applied; `SA_RESETHAND` is, by putting the
    // default back first, or its own return or `raise` would come back here forever).
    match PREVIOUS.get() {
        // Ignored before us: a `SIGBUS` another process sent stays ignored (a fault the
        // kernel raised cannot be ignored: below, the default ends the process).
        Some(p) if p.sa_sigaction == libc::SIG_IGN && code <= 0 => {}
        Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
            // SAFETY: `sigaction` with a valid argument, then the previous handler called
            // as it was installed to be called.
            unsafe {
                if p.sa_flags & libc::SA_RESETHAND != 0 {
                    set_default();
                }
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
        // The default: put it back and raise the signal again; it is delivered when the
        // handler returns (`SIGBUS` is blocked until then) and ends the process.
        _ => {
            // SAFETY: `sigaction` and `raise`, both async-signal-safe, with valid arguments.
            unsafe {
                set_default();
                libc::raise(sig);
            }
        }
    }
}

/// Puts the default `SIGBUS` disposition back.
///
/// # Safety
/// Replaces the process's `SIGBUS` handler (ours).
unsafe fn set_default() {
    // SAFETY: `sigaction` with a valid, initialised argument.
    unsafe {
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut default.sa_mask);
        libc::sigaction(libc::SIGBUS, &default, ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(path: &std::path::Path, len: usize) -> Vec<u8> {
        let data: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4096) as u8).collect();
        File::create(path).unwrap().write_all(&data).unwrap();
        data
    }

    /// A file of `len` bytes in a fresh directory, opened and mapped.
    fn mapped_file(len: usize) -> (tempfile::TempDir, std::path::PathBuf, Vec<u8>, File, Mapping) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let data = file_of(&p, len);
        let f = File::open(&p).unwrap();
        let m = Mapping::new(&f, len as u64).expect("a mapping");
        (dir, p, data, f, m)
    }

    fn copy(m: &Mapping, f: &File, bufs: &mut [(u64, Vec<u8>)]) -> Result<(), Unreadable> {
        m.copy_out(f, bufs.iter_mut().map(|(at, b)| (*at, b.as_mut_slice())))
    }

    #[test]
    fn copies_what_the_file_holds() {
        let (_dir, _, data, f, m) = mapped_file(300_000);
        let mut bufs: Vec<(u64, Vec<u8>)> = (0..100).map(|i| (i * 2999, vec![0u8; 1000 + i as usize])).collect();
        bufs.push((data.len() as u64 - 5, vec![0u8; 5]));
        copy(&m, &f, &mut bufs).unwrap();
        for (at, b) in &bufs {
            assert_eq!(&b[..], &data[*at as usize..*at as usize + b.len()]);
        }
        assert!(Mapping::new(&f, 0).is_none(), "nothing to map");
    }

    /// Every read lands whole, at unaligned offsets and lengths (the streaming stores' head
    /// and tail included), and `inspect` sees each read's bytes in order, in pieces of at
    /// most [`INSPECTED_PIECE`], reads in the order given (here not file order).
    #[test]
    fn inspected_copies_show_each_read_in_order() {
        let (_dir, _, data, f, m) = mapped_file(3 * INSPECTED_PIECE + 12_345);
        let mut bufs: Vec<(u64, Vec<u8>)> = vec![
            (40_000, vec![0u8; INSPECTED_PIECE + 3]),
            (1, vec![0u8; 2 * INSPECTED_PIECE + 77]),
            (5, vec![0u8; 15]),
            (data.len() as u64 - 1, vec![0u8; 1]),
        ];
        let mut seen: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut reads: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(at, b)| (*at, b.as_mut_slice())).collect();
        m.copy_inspected(&f, &mut reads, &mut |i, piece| {
            assert!(piece.len() <= INSPECTED_PIECE && !piece.is_empty());
            match seen.last_mut() {
                Some((j, bytes)) if *j == i => bytes.extend_from_slice(piece),
                _ => seen.push((i, piece.to_vec())),
            }
        })
        .unwrap();
        assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), [0, 1, 2, 3]);
        for ((at, b), (_, shown)) in bufs.iter().zip(&seen) {
            let want = &data[*at as usize..*at as usize + b.len()];
            assert_eq!(&b[..], want, "the buffer at {at}");
            assert_eq!(&shown[..], want, "what inspect saw at {at}");
        }
    }

    /// A picked copy shows every byte of its range in pieces of at most [`INSPECTED_PIECE`]
    /// and streams each pick whole, at unaligned offsets, one spanning several pieces.
    #[test]
    fn picked_copies_show_the_range_and_fill_the_picks() {
        let (_dir, _, data, f, m) = mapped_file(8 * INSPECTED_PIECE + 999);
        let range = 7..data.len() as u64 - 3;
        let mut bufs: Vec<(u64, Vec<u8>)> = (0..40).map(|i| (7 + i * 1500, vec![0u8; 700])).collect();
        bufs.push((70_000, vec![0u8; 2 * INSPECTED_PIECE + 5]));
        bufs.push((range.end - 1, vec![0u8; 1]));
        let mut shown = Vec::new();
        let mut picks: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(at, b)| (*at, b.as_mut_slice())).collect();
        m.copy_picked(&f, range.clone(), &mut picks, &mut |piece| {
            assert!(piece.len() <= INSPECTED_PIECE && !piece.is_empty());
            shown.extend_from_slice(piece);
        })
        .unwrap();
        assert!(shown[..] == data[range.start as usize..range.end as usize]);
        for (at, b) in &bufs {
            assert_eq!(&b[..], &data[*at as usize..*at as usize + b.len()], "the pick at {at}");
        }
    }

    /// A file cut to nothing after it was mapped: a picked copy reports the page it could
    /// not read, and the mapping copies no more.
    #[test]
    fn a_picked_copy_of_a_file_cut_short_is_an_error() {
        let (_dir, p, _, f, m) = mapped_file(4 * INSPECTED_PIECE);
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(0).unwrap();
        let mut buf = [1u8; 100];
        let copied = m.copy_picked(&f, 0..3 * INSPECTED_PIECE as u64, &mut [(5, &mut buf[..])], &mut |_| {});
        assert!(matches!(copied, Err(Unreadable::Fault(_))), "{copied:?}");
        assert_eq!(m.copy_picked(&f, 0..10, &mut [], &mut |_| {}), Err(Unreadable::Failed));
    }

    /// A file cut to nothing after it was mapped: an inspected copy reports the page it could
    /// not read (the inspection of that page faults too, and is answered the same way)
    /// instead of `SIGBUS` ending the process, and the mapping copies no more.
    #[test]
    fn an_inspected_copy_of_a_file_cut_short_is_an_error() {
        let (_dir, p, _, f, m) = mapped_file(4 * INSPECTED_PIECE);
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(0).unwrap();
        let mut buf = vec![1u8; 2 * INSPECTED_PIECE];
        let mut shown = 0;
        let copied = m.copy_inspected(&f, &mut [(INSPECTED_PIECE as u64, &mut buf[..])], &mut |_, piece| {
            shown += piece.len();
        });
        assert!(matches!(copied, Err(Unreadable::Fault(_))), "{copied:?}");
        assert_eq!(shown, 2 * INSPECTED_PIECE, "the copy runs to the end of the read, over zeros");
        let again = m.copy_inspected(&f, &mut [(0, &mut buf[..10])], &mut |_, _| {});
        assert_eq!(again, Err(Unreadable::Failed));
    }

    /// A file cut short after it was mapped: a copy reports a page it could not read,
    /// instead of `SIGBUS` ending the test process, or, inside the file's new last page,
    /// the size check reports it. A mapping that failed refuses further copies.
    #[test]
    fn a_file_cut_short_is_an_error() {
        let (dir, p, data, f, m) = mapped_file(1 << 20);
        let page = PAGE.load(Ordering::Relaxed);
        let cut = 5 * page + 10;
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(cut as u64).unwrap();
        let mut head = vec![(0, vec![0u8; cut])];
        copy(&m, &f, &mut head).unwrap();
        assert_eq!(&head[0].1[..], &data[..cut]);
        let mut tail = vec![(cut as u64 - 4, vec![0u8; 8])];
        assert_eq!(copy(&m, &f, &mut tail), Err(Unreadable::Shorter { size: cut as u64, end: cut as u64 + 4 }));
        assert_eq!(copy(&m, &f, &mut head), Err(Unreadable::Failed), "a mapping that failed copies no more");

        // Reads across the rest of the old length. Pages wholly past the end fault; a
        // kernel that maps a large page-cache folio across the new end reads its pages as
        // zeros instead, and the size check catches those.
        let m = Mapping::new(&f, data.len() as u64).expect("a mapping");
        let mut bufs: Vec<(u64, Vec<u8>)> = (0..64).map(|i| (i * 16_000 + 7, vec![1u8; 3000])).collect();
        match copy(&m, &f, &mut bufs) {
            Err(Unreadable::Fault(at)) => assert!(at % page as u64 == 0 && at >= 6 * page as u64, "{at}"),
            Err(Unreadable::Shorter { size, .. }) => assert_eq!(size, cut as u64),
            other => panic!("{other:?}"),
        }
        for (at, b) in bufs.iter().take_while(|(at, b)| (*at as usize + b.len()) <= cut) {
            assert_eq!(&b[..], &data[*at as usize..*at as usize + b.len()]);
        }

        // Cut to nothing: no page-cache folio is left, so the first page faults on any
        // kernel and file system.
        let m = Mapping::new(&f, data.len() as u64).expect("a mapping");
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(0).unwrap();
        let mut bufs: Vec<(u64, Vec<u8>)> = (0..8).map(|i| (i * 70_000 + 3, vec![1u8; 500])).collect();
        assert_eq!(copy(&m, &f, &mut bufs), Err(Unreadable::Fault(0)));

        // The thread's handling is disarmed again: another mapping reads.
        let q = dir.path().join("g");
        let other = file_of(&q, 3 * page);
        let g = File::open(&q).unwrap();
        let m = Mapping::new(&g, other.len() as u64).unwrap();
        let mut all = vec![(1, vec![0u8; 3 * page - 1])];
        copy(&m, &g, &mut all).unwrap();
        assert_eq!(&all[0].1[..], &other[1..]);
    }

    /// A thread that blocks `SIGBUS` would be killed by a fault whatever the handler: it
    /// gets no copy (the caller reads instead), and the mapping stays usable.
    #[test]
    fn a_thread_blocking_sigbus_is_refused() {
        let (_dir, _, data, f, m) = mapped_file(50_000);
        let mut bufs = vec![(100, vec![0u8; 1000])];
        let (f, b) = (&f, &mut bufs);
        let m = std::thread::scope(|s| {
            s.spawn(move || {
                // SAFETY: changes only this (test) thread's signal mask.
                unsafe {
                    let mut set: libc::sigset_t = std::mem::zeroed();
                    libc::sigemptyset(&mut set);
                    libc::sigaddset(&mut set, libc::SIGBUS);
                    assert_eq!(libc::pthread_sigmask(libc::SIG_BLOCK, &set, ptr::null_mut()), 0);
                }
                assert_eq!(copy(&m, f, b), Err(Unreadable::NoHandler));
                m
            })
            .join()
            .unwrap()
        });
        copy(&m, f, &mut bufs).unwrap();
        assert_eq!(&bufs[0].1[..], &data[100..1100]);
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
        let dir = tempfile::tempdir().unwrap();
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args(["--exact", "mapped::tests::foreign_sigbus_child", "--nocapture", "--test-threads=1"])
            .env("DCKPT_FOREIGN_SIGBUS", dir.path().join("f"))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("touching past the end"), "the child ran the test: {stdout}");
        assert_eq!(out.status.signal(), Some(libc::SIGBUS), "child: {:?}\n{stdout}", out.status);
    }

    #[test]
    fn foreign_sigbus_child() {
        let Some(p) = std::env::var_os("DCKPT_FOREIGN_SIGBUS") else { return };
        file_of(p.as_ref(), 1 << 16);
        let f = File::open(&p).unwrap();
        let ours = Mapping::new(&f, 1 << 16).expect("a mapping, with the handler installed");
        let mut b = vec![(0, vec![0u8; 8])];
        copy(&ours, &f, &mut b).unwrap();
        // SAFETY: deliberately not: a mapping past the end of the file, read outside any
        // copy, in a process that is meant to die of it (without a core dump).
        unsafe {
            libc::prctl(libc::PR_SET_DUMPABLE, 0);
            let p = libc::mmap(ptr::null_mut(), 1 << 20, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0);
            assert_ne!(p, libc::MAP_FAILED);
            println!("touching past the end");
            let v = ptr::read_volatile(p.cast::<u8>().add(1 << 19));
            println!("survived, read {v}");
        }
    }
}
