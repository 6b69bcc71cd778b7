//! [`StorageExt`]: conveniences over any [`Storage`], built from its calls alone.

use std::ops::Range;

use bytes::Bytes;

use crate::{Error, Result, Storage};

/// How many deletes [`StorageExt::delete_all`] has in flight.
pub const DELETES_IN_FLIGHT: usize = 16;

/// Conveniences over any [`Storage`].
pub trait StorageExt: Storage {
    /// Whether an object exists under `path`.
    fn exists(&self, path: &str) -> Result<bool> {
        match self.size(path) {
            Ok(_) => Ok(true),
            Err(Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// One range of the object.
    fn get_range(&self, path: &str, range: Range<u64>) -> Result<Bytes> {
        let mut out = self.get_ranges(path, std::slice::from_ref(&range))?;
        out.pop().ok_or_else(|| Error::permanent("get_range", &self.location(path), "no range returned"))
    }

    /// Fills `buf` with the bytes at `offset..offset + buf.len()`.
    fn read_exact_at(&self, path: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.read_into(path, &mut [(offset, buf)])
    }

    /// Deletes each of `paths`, [`DELETES_IN_FLIGHT`] at once (on threads of its own, or
    /// here where none can be started): an object store answers a delete in tens of ms, and
    /// a checkpoint holds a file per rank or more, so one after another 65,536 of them took
    /// longer than a collective's timeout. `each` hears every path's result on the calling
    /// thread as it comes; where it returns `false`, no delete not yet begun is begun.
    fn delete_all<P: AsRef<str> + Sync>(&self, paths: &[P], mut each: impl FnMut(&str, Result<()>) -> bool)
    where
        Self: Sync,
    {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let stop = || next.store(paths.len(), std::sync::atomic::Ordering::Relaxed);
        let (tx, done) = std::sync::mpsc::channel::<(usize, Result<()>)>();
        let work = |tx: std::sync::mpsc::Sender<(usize, Result<()>)>| loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(p) = paths.get(i) else { return };
            if tx.send((i, self.delete(p.as_ref()))).is_err() {
                return;
            }
        };
        std::thread::scope(|s| {
            let mut started = 0;
            for _ in 0..DELETES_IN_FLIGHT.min(paths.len()) {
                let tx = tx.clone();
                match std::thread::Builder::new().name("dckpt-delete".into()).spawn_scoped(s, move || work(tx)) {
                    Ok(_) => started += 1,
                    Err(_) => break,
                }
            }
            drop(tx);
            if started == 0 {
                for p in paths {
                    if !each(p.as_ref(), self.delete(p.as_ref())) {
                        break;
                    }
                }
                return;
            }
            for (i, r) in done {
                if !each(paths[i].as_ref(), r) {
                    stop();
                }
            }
        });
    }

    /// What a conditional write of `bytes` to `path` ([`Storage::put_if_absent`],
    /// [`Storage::put_if_match`]) that returned `attempt` left behind. Its error does not say
    /// whether it landed (a lost reply; a retry that finds its own first attempt and reports
    /// `AlreadyExists` or `Precondition`), so the stored bytes decide.
    fn settle(&self, path: &str, bytes: &Bytes, attempt: Result<()>) -> Settled {
        let Err(e) = attempt else { return Settled::Landed };
        let lost_race = matches!(e, Error::AlreadyExists { .. } | Error::Precondition { .. });
        match self.get(path) {
            Ok(stored) if stored == *bytes => Settled::Landed,
            // Another writer's bytes landed after this one looked.
            Ok(_) if lost_race => Settled::Failed(e),
            // A write that timed out or lost its connection may still be applied after this
            // read (an object store's request in flight).
            Ok(_) | Err(Error::NotFound { .. }) if e.is_transient() => {
                Settled::Unknown(format!("{e} (the write may still land: it is not there yet)"))
            }
            Ok(_) | Err(Error::NotFound { .. }) => Settled::Failed(e),
            Err(read_back) => Settled::Unknown(format!("{e} (reading it back: {read_back})")),
        }
    }
}

/// What a conditional write that returned an error left behind ([`StorageExt::settle`]).
#[derive(Debug)]
pub enum Settled {
    /// The object holds the bytes written: the write succeeded.
    Landed,
    /// It did not land, and will not: its error (`AlreadyExists` or `Precondition` where
    /// another writer's bytes are there).
    Failed(Error),
    /// It may still land, or what is there could not be read: why. Whatever the write's
    /// bytes refer to must stay.
    Unknown(String),
}

impl<S: Storage + ?Sized> StorageExt for S {}
