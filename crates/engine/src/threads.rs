//! The threads the engine starts for itself, each with a way on without it. A process at
//! its thread limit (`ulimit -u`, a container's `pids.max`) gets the same work done on the
//! calling thread, later, where `std::thread::scope`'s `spawn` would panic.

use std::sync::{Mutex, PoisonError};
use std::thread::{self, Scope, ScopedJoinHandle};

/// `side` on a thread of its own while the calling thread runs `main`; where no thread can
/// be started, `main` and then `side` on the calling thread (`main` first: it may be what
/// other ranks wait for, such as a transfer to peers). `side`'s panic comes back as its
/// `Err`, as from a join, either way.
pub(crate) fn beside<A: Send, B>(side: impl FnOnce() -> A + Send, main: impl FnOnce() -> B) -> (thread::Result<A>, B) {
    // Kept here, not moved into the thread, so that a thread that never started leaves it.
    let slot = Mutex::new(Some(side));
    let run = || slot.lock().unwrap_or_else(PoisonError::into_inner).take().map(|f| f());
    thread::scope(|s| {
        let (a, b) = match spawn(s, run) {
            Ok(h) => {
                let b = main();
                (h.join(), b)
            }
            Err(_) => {
                let b = main();
                (std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)), b)
            }
        };
        (a.and_then(|a| a.ok_or_else(|| Box::new("the side work was gone before its thread ran") as _)), b)
    })
}

/// `work` run once on each of up to `n` threads while the calling thread waits, each run's
/// outcome (a panic as its `Err`); where no thread can be started, one run on the calling
/// thread. So `work` must take what is left to do until nothing is: one run may do it all.
pub(crate) fn on_threads<R: Send>(n: usize, work: impl Fn() -> R + Sync) -> Vec<thread::Result<R>> {
    thread::scope(|s| {
        let runs: Vec<ScopedJoinHandle<'_, R>> = (0..n).map_while(|_| spawn(s, &work).ok()).collect();
        if runs.is_empty() && n > 0 {
            return vec![std::panic::catch_unwind(std::panic::AssertUnwindSafe(&work))];
        }
        runs.into_iter().map(ScopedJoinHandle::join).collect()
    })
}

/// `work` on a thread of its own named `name`, left running; where no thread can be
/// started, on the calling thread before this returns. Whoever waits for it learns of its
/// end from `work` itself (a background save settles its handle).
pub(crate) fn detached(name: &str, work: impl FnOnce() + Send + 'static) {
    // Kept here, not moved into the thread, so that a thread that never started leaves it.
    let slot = std::sync::Arc::new(Mutex::new(Some(work)));
    let theirs = slot.clone();
    let run = move || theirs.lock().unwrap_or_else(PoisonError::into_inner).take().map_or((), |f| f());
    if refused() || thread::Builder::new().name(name.into()).spawn(run).is_err() {
        let left = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(f) = left {
            f();
        }
    }
}

/// Starts a scoped thread, or says it could not (in tests, also where `without_threads`
/// refuses it).
fn spawn<'s, 'e, T: Send + 's>(
    s: &'s Scope<'s, 'e>,
    f: impl FnOnce() -> T + Send + 's,
) -> std::io::Result<ScopedJoinHandle<'s, T>> {
    if refused() {
        return Err(std::io::Error::other("threads refused on this test thread"));
    }
    thread::Builder::new().spawn_scoped(s, f)
}

/// Whether a thread about to start is refused: on a test thread inside [`without_threads`]
/// (counted).
#[cfg(test)]
fn refused() -> bool {
    REFUSED.with(|r| r.get().inspect(|n| r.set(Some(n + 1)))).is_some()
}

/// Never outside tests.
#[cfg(not(test))]
fn refused() -> bool {
    false
}

#[cfg(test)]
thread_local! {
    /// On a test thread inside [`without_threads`]: the threads refused so far.
    static REFUSED: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` on this thread with every thread the engine would start from it refused, as in
/// a process at its thread limit; `f`'s result and how many were refused.
#[cfg(test)]
pub(crate) fn without_threads<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let was = REFUSED.with(|r| r.replace(Some(0)));
    let out = f();
    (out, REFUSED.with(|r| r.replace(was)).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn beside_runs_both_with_and_without_a_thread() {
        for refuse in [false, true] {
            let run = || beside(|| thread::current().id(), || thread::current().id());
            let (side, main) = if refuse { without_threads(run).0 } else { run() };
            assert_eq!(main, thread::current().id());
            assert_eq!(side.unwrap() == main, refuse, "refused: {refuse}");
        }
    }

    /// Without a thread, `main` goes first: in the local tier it is the transfer that the
    /// other ranks wait for, and the rank's own copy can follow.
    #[test]
    fn beside_without_a_thread_runs_main_first() {
        let order = Mutex::new(Vec::new());
        let ((side, ()), refused) =
            without_threads(|| beside(|| order.lock().unwrap().push("side"), || order.lock().unwrap().push("main")));
        side.unwrap();
        assert_eq!((order.into_inner().unwrap(), refused), (vec!["main", "side"], 1));
    }

    #[test]
    fn beside_returns_a_panic_of_its_side_either_way() {
        for refuse in [false, true] {
            let run = || beside(|| -> u8 { panic!("side") }, || 7);
            let (side, main) = if refuse { without_threads(run).0 } else { run() };
            assert!(side.is_err() && main == 7, "refused: {refuse}");
        }
    }

    #[test]
    fn on_threads_does_all_the_work_with_and_without_threads() {
        for refuse in [false, true] {
            let next = AtomicUsize::new(0);
            let work = || {
                let mut mine = Vec::new();
                while let i @ 0..100 = next.fetch_add(1, Ordering::Relaxed) {
                    mine.push(i);
                }
                (thread::current().id(), mine)
            };
            let runs = if refuse { without_threads(|| on_threads(4, work)).0 } else { on_threads(4, work) };
            let runs: Vec<_> = runs.into_iter().map(Result::unwrap).collect();
            assert_eq!(runs.len(), if refuse { 1 } else { 4 });
            let on_caller = runs.iter().filter(|r| r.0 == thread::current().id()).count();
            assert_eq!(on_caller, usize::from(refuse), "refused: {refuse}");
            let mut all: Vec<usize> = runs.into_iter().flat_map(|r| r.1).collect();
            all.sort_unstable();
            assert_eq!(all, (0..100).collect::<Vec<_>>());
        }
        assert!(on_threads(0, || 1).is_empty());
    }
}
