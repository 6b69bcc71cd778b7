//! Names in a local store that are not regular files: refused at once, saying what they
//! are, on every read path; never a hang (a FIFO without a writer blocks a plain `open`).

#![cfg(unix)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use dckpt_storage::{Error, LocalStorage, Storage};

/// Longer than any refusal takes, far shorter than "forever".
const BOUND: Duration = Duration::from_secs(20);

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a plain system call with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

/// Runs every read path of `store` on `name` on another thread, so that a path that hangs
/// fails the test instead of stalling it; returns each path's result as text.
fn every_read(store: LocalStorage, name: &'static str) -> Vec<(&'static str, dckpt_storage::Result<()>)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4];
        let results = vec![
            ("get", store.get(name).map(drop)),
            ("get_ranges", store.get_ranges(name, std::slice::from_ref(&(0..1))).map(drop)),
            ("read_into", store.read_into(name, &mut [(0, &mut buf[..])])),
            ("reader", store.reader(name).map(drop)),
            ("size", store.size(name).map(drop)),
        ];
        // Best effort by contract: it must return, whatever it finds.
        store.prefetch(name, 0, 1);
        let _ = tx.send(results);
    });
    rx.recv_timeout(BOUND).unwrap_or_else(|_| panic!("reading {name:?} did not return within {BOUND:?}"))
}

fn assert_refused(results: &[(&str, dckpt_storage::Result<()>)], location: &str, what: &str) {
    for (op, r) in results {
        match r {
            Err(e @ Error::Permanent { .. }) => {
                let text = e.to_string();
                assert!(text.contains(location) && text.contains(what), "{op}: {text}");
                assert_eq!(e.path(), location, "{op}");
                assert!(!e.is_transient(), "{op}: {e}");
            }
            other => panic!("{op} on {what}: expected a permanent error naming it, got {other:?}"),
        }
    }
}

#[test]
fn a_fifo_is_refused_on_every_read_path_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStorage::new(dir.path()).unwrap();
    mkfifo(&dir.path().join("dckpt.meta"));
    let location = store.location("dckpt.meta");
    assert_refused(&every_read(store, "dckpt.meta"), &location, "FIFO");
}

#[test]
fn a_directory_and_a_socket_are_refused_naming_what_they_are() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::fs::write(dir.path().join("sub/inner"), b"x").unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(dir.path().join("sock")).unwrap();
    let store = LocalStorage::new(dir.path()).unwrap();
    let (sub, sock) = (store.location("sub"), store.location("sock"));
    assert_refused(&every_read(LocalStorage::new(dir.path()).unwrap(), "sub"), &sub, "a directory");
    assert_refused(&every_read(LocalStorage::new(dir.path()).unwrap(), "sock"), &sock, "a socket");
    // Below a regular file there is still simply nothing.
    std::fs::write(dir.path().join("file"), b"x").unwrap();
    assert!(matches!(store.get("file/below"), Err(Error::NotFound { .. })));
    assert!(matches!(store.size("file/below"), Err(Error::NotFound { .. })));
}

#[test]
fn regular_files_still_read_whole_and_in_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStorage::new(dir.path()).unwrap();
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(dir.path().join("obj"), &data).unwrap();
    assert_eq!(store.get("obj").unwrap(), data);
    assert_eq!(store.size("obj").unwrap(), data.len() as u64);
    let mut buf = vec![0u8; 1000];
    store.reader("obj").unwrap().read_into(&mut [(50_000, &mut buf[..])]).unwrap();
    assert_eq!(buf, data[50_000..51_000]);
}
