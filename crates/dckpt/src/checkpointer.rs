//! The one entry point: a checkpointer per rank.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dckpt_collective::{Collective, ThreadGroup};
use dckpt_engine::format::Metadata;
use dckpt_engine::local::{LocalRestoreOptions, LocalRestoreOutcome, LocalSaveOptions, LocalSaveOutcome};
use dckpt_engine::{
    Engine, LoadOptions, LoadOutcome, LoadRequest, Result, SaveHandle, SaveOptions, SaveOutcome, SaveState,
    SourcedTensor, TieredOutcome,
};
use dckpt_storage::{OpenOptions, Storage};

/// Where a checkpoint is: a URL or path to open (a plain path or `file://` for local disk,
/// `s3://bucket/prefix`, `memory://NAME`), or a storage the caller opened (wrapped for
/// retries, fault injection, metrics...). One checkpoint per location.
#[derive(Debug, Clone)]
pub enum Location {
    /// Opened on every rank by the call.
    Url(String),
    /// Used as it is.
    Storage(Arc<dyn Storage>),
}

impl From<&str> for Location {
    fn from(url: &str) -> Location {
        Location::Url(url.to_string())
    }
}

impl From<String> for Location {
    fn from(url: String) -> Location {
        Location::Url(url)
    }
}

impl From<&Path> for Location {
    fn from(path: &Path) -> Location {
        Location::Url(path.to_string_lossy().into_owned())
    }
}

impl From<PathBuf> for Location {
    fn from(path: PathBuf) -> Location {
        Location::from(path.as_path())
    }
}

impl From<&PathBuf> for Location {
    fn from(path: &PathBuf) -> Location {
        Location::from(path.as_path())
    }
}

impl From<Arc<dyn Storage>> for Location {
    fn from(storage: Arc<dyn Storage>) -> Location {
        Location::Storage(storage)
    }
}

impl From<&Arc<dyn Storage>> for Location {
    fn from(storage: &Arc<dyn Storage>) -> Location {
        Location::Storage(storage.clone())
    }
}

/// One rank's checkpointer. Every rank of the job makes the same calls in the same order:
/// saves and loads are collective, and every rank returns the same outcome (or the same
/// [`Error`](crate::Error), naming the rank that saw it).
///
/// It keeps what makes the next save cheap: a save of the same structure as the previous
/// one reuses its plan after one all-reduce, and a background save can keep its host buffers
/// ([`SaveOptions::keep_staging`]). Make one per rank and keep it for the whole run.
#[derive(Debug)]
pub struct Checkpointer {
    engine: Engine,
    open_options: OpenOptions,
}

impl Checkpointer {
    /// A checkpointer over this rank's collective. The collective may be shared with the
    /// host's own calls, as long as they are not made while a call of this checkpointer
    /// (or its background save) is using it: every rank must see the same order of calls.
    pub fn new(collective: Arc<dyn Collective>) -> Checkpointer {
        Checkpointer { engine: Engine::new(collective), open_options: OpenOptions::default() }
    }

    /// A checkpointer for a single process: rank 0 of a world of one. Tools that read,
    /// convert or export a checkpoint alone use this.
    pub fn local() -> Checkpointer {
        Checkpointer::new(local_collective())
    }

    /// With these backend settings for the locations it opens from a URL or path.
    pub fn with_open_options(self, open_options: OpenOptions) -> Checkpointer {
        Checkpointer { open_options, ..self }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.engine.rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.engine.world_size()
    }

    /// Saves this rank's part of the state at `location` and returns once the checkpoint
    /// is committed everywhere, or the save failed everywhere (nothing committed). Fails
    /// with [`ErrorKind::AlreadyExists`](crate::ErrorKind::AlreadyExists) where a checkpoint is
    /// committed, unless `opts` asks to replace it, and, replace or not, where another save
    /// commits there while this one runs.
    pub fn save(
        &self,
        location: impl Into<Location>,
        state: &SaveState<'_>,
        opts: &SaveOptions,
    ) -> Result<SaveOutcome> {
        let storage = self.storage(location.into())?;
        self.engine.save(storage.as_ref(), state, opts)
    }

    /// Copies the state into host buffers and returns; planning, writing and the commit
    /// go on in the background, and [`SaveHandle::wait`] gives the outcome. The next call
    /// of this checkpointer waits for it first.
    pub fn save_async(
        &self,
        location: impl Into<Location>,
        state: &SaveState<'_>,
        opts: &SaveOptions,
    ) -> Result<SaveHandle> {
        let storage = self.storage(location.into())?;
        self.engine.save_async(storage, state, opts)
    }

    /// Saves `state` and the `sourced` pieces at `location`, and returns once the checkpoint
    /// is committed. The bytes of a sourced piece are pulled from its source into a few
    /// bounce buffers while its data file is written, so a converter saves a model larger
    /// than its memory this way. Each sourced piece must be a main replica (see
    /// [`SourcedTensor`]); otherwise as [`Checkpointer::save`].
    pub fn save_sourced(
        &self,
        location: impl Into<Location>,
        state: &SaveState<'_>,
        sourced: &[SourcedTensor<'_>],
        opts: &SaveOptions,
    ) -> Result<SaveOutcome> {
        let storage = self.storage(location.into())?;
        self.engine.save_sourced(storage.as_ref(), state, sourced, opts)
    }

    /// Saves this rank's part of a local step at `dir`, this rank's node-local storage,
    /// with its copies on peers of other nodes (see [`dckpt_engine::local`]), and returns
    /// once every part has all its copies.
    pub fn save_local(
        &self,
        dir: impl Into<Location>,
        state: &SaveState<'_>,
        opts: &LocalSaveOptions,
    ) -> Result<LocalSaveOutcome> {
        let dir = self.storage(dir.into())?;
        self.engine.save_local(dir.as_ref(), state, opts)
    }

    /// Restores the newest whole local step under `dir` into `req`, from this rank's own
    /// copy or a peer's, every byte checked; the parts no copy could give are listed in the
    /// outcome for the caller to load from the persistent tier.
    pub fn restore_local(
        &self,
        dir: impl Into<Location>,
        req: &mut LoadRequest<'_>,
        opts: &LocalRestoreOptions,
    ) -> Result<LocalRestoreOutcome> {
        let dir = self.storage(dir.into())?;
        self.engine.restore_local(dir.as_ref(), req, opts)
    }

    /// After resuming from `after` (`None`: from nothing): this rank's markers of `run`'s
    /// newer local steps under `dir` removed (see [`dckpt_engine::local::unmark_newer`]); the
    /// steps unmarked. Not collective: a URL is opened on this rank alone (opened as the
    /// collective calls open one, on every rank, a rank calling alone waited out the
    /// collective's timeout).
    pub fn unmark_local_newer(&self, dir: impl Into<Location>, after: Option<u64>, run: &str) -> Result<Vec<u64>> {
        let dir = self.storage_here(dir.into())?;
        Ok(dckpt_engine::local::unmark_newer(dir.as_ref(), self.rank(), after, run))
    }

    /// Garbage collection of this rank's files of `run`'s local steps under `dir` (see
    /// [`dckpt_engine::local::gc_local`]); the steps removed. Not collective, as
    /// [`Checkpointer::unmark_local_newer`] is not.
    pub fn gc_local(
        &self,
        dir: impl Into<Location>,
        placement: dckpt_engine::local::Placement,
        keep: usize,
        run: &str,
    ) -> Result<Vec<u64>> {
        let dir = self.storage_here(dir.into())?;
        let (rank, world) = (self.rank(), self.world_size());
        Ok(dckpt_engine::local::gc_local(dir.as_ref(), rank, world, placement, keep, run))
    }

    /// The local step, then the persistent checkpoint, whichever are given, in the
    /// foreground: the rounds of [`Checkpointer::save_tiers_async`] in its order (both
    /// locations opened first), so that a rank saving this way (its caller failed, say)
    /// meets the others' background save round for round, and all fail naming it. A failure
    /// of the local step's storage does not stop the persistent save
    /// ([`Engine::save_tiers`](dckpt_engine::Engine::save_tiers)).
    pub fn save_tiers(
        &self,
        state: &SaveState<'_>,
        local: Option<(Location, LocalSaveOptions)>,
        persistent: Option<(Location, SaveOptions)>,
    ) -> Result<TieredOutcome> {
        let (local, persistent) = self.open_tiers(local, persistent)?;
        let local = local.as_ref().map(|(dir, o)| (dir.as_ref(), o));
        self.engine.save_tiers(state, local, persistent.as_ref().map(|(at, o)| (at.as_ref(), o)))
    }

    /// Copies the state once and returns; the local step and the persistent checkpoint,
    /// whichever are given, are saved from that copy in the background
    /// ([`SaveHandle::wait_tiers`]).
    pub fn save_tiers_async(
        &self,
        state: &SaveState<'_>,
        local: Option<(Location, LocalSaveOptions)>,
        persistent: Option<(Location, SaveOptions)>,
    ) -> Result<SaveHandle> {
        let (local, persistent) = self.open_tiers(local, persistent)?;
        self.engine.save_tiers_async(state, local, persistent)
    }

    /// Both tiers' locations opened, the local one first: the same rounds in the same order
    /// for a save in the foreground and one in the background.
    fn open_tiers(
        &self,
        local: Option<(Location, LocalSaveOptions)>,
        persistent: Option<(Location, SaveOptions)>,
    ) -> Result<OpenTiers> {
        let local = local.map(|(l, o)| self.storage(l).map(|s| (s, o))).transpose()?;
        let persistent = persistent.map(|(l, o)| self.storage(l).map(|s| (s, o))).transpose()?;
        Ok((local, persistent))
    }

    /// Waits for a background save, if one is running (its outcome goes to its handle).
    /// Every call of the checkpointer does this first; a host that shares the collective
    /// calls it before its own calls, which must not meet a background save's.
    pub fn wait_background(&self) {
        self.engine.wait_background()
    }

    /// Bytes of host memory kept for the next background save
    /// ([`SaveOptions::keep_staging`]); waits for a background save first.
    pub fn staging_bytes(&self) -> u64 {
        self.engine.staging_bytes()
    }

    /// Frees the host memory kept for the next background save
    /// ([`SaveOptions::keep_staging`]); waits for a background save first.
    pub fn release_staging(&self) {
        self.engine.release_staging()
    }

    /// Fills the buffers of `req` from the checkpoint at `location`, resharding from
    /// whatever layout it was saved in; every byte used is checked against its checksum.
    pub fn load(
        &self,
        location: impl Into<Location>,
        req: &mut LoadRequest<'_>,
        opts: &LoadOptions,
    ) -> Result<LoadOutcome> {
        let storage = self.storage(location.into())?;
        self.engine.load(storage.as_ref(), req, opts)
    }

    /// The checkpoint's metadata (its tensors, chunks, files and saved layout), read and
    /// validated on every rank as a load does.
    pub fn metadata(&self, location: impl Into<Location>) -> Result<Metadata> {
        let storage = self.storage(location.into())?;
        self.engine.read_metadata(storage.as_ref())
    }

    /// `location` opened by this rank alone (not collectively, as [`Checkpointer::storage`]
    /// opens a URL): for the calls one rank makes by itself.
    fn storage_here(&self, location: Location) -> Result<Arc<dyn Storage>> {
        match location {
            Location::Url(url) => {
                Ok(dckpt_storage::open_with(&url, &self.open_options).map_err(dckpt_engine::Error::from)?)
            }
            Location::Storage(s) => Ok(s),
        }
    }

    pub(crate) fn storage(&self, location: Location) -> Result<Arc<dyn Storage>> {
        match location {
            Location::Url(url) => self.engine.open(&url, &self.open_options),
            Location::Storage(s) => Ok(s),
        }
    }
}

/// Each tier's opened storage and its options (see [`Checkpointer::save_tiers`]).
type OpenTiers = (Option<(Arc<dyn Storage>, LocalSaveOptions)>, Option<(Arc<dyn Storage>, SaveOptions)>);

/// Rank 0 of a world of one: the collective of a process that checkpoints alone (what
/// [`Checkpointer::local`] and a run root outside a job use).
pub fn local_collective() -> Arc<dyn Collective> {
    let mut one = ThreadGroup::new(1).expect("a world of one rank can always be made");
    Arc::new(one.pop().expect("a world of one has one rank"))
}

#[cfg(test)]
mod tests {
    use dckpt_engine::PieceSource;
    use dckpt_shard_spec::{DType, ShardedTensor};

    use super::*;

    /// Byte `i` of the piece is `i` (mod 256).
    struct Counting;

    impl PieceSource for Counting {
        fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = (offset + i as u64) as u8;
            }
            Ok(())
        }
    }

    #[test]
    fn a_local_checkpointer_saves_sourced_pieces_and_keeps_staging_on_request() {
        let ckpt = Checkpointer::local();
        assert_eq!((ckpt.rank(), ckpt.world_size()), (0, 1));
        let sourced = [SourcedTensor { tensor: ShardedTensor::whole("w", DType::U8, [300]), source: &Counting }];
        ckpt.save_sourced("memory://facade-sourced", &SaveState::new(), &sourced, &SaveOptions::default()).unwrap();
        let mut got = vec![0u8; 300];
        let mut req = LoadRequest::new().tensor(ShardedTensor::whole("w", DType::U8, [300]), &mut got);
        ckpt.load("memory://facade-sourced", &mut req, &LoadOptions::default()).unwrap();
        drop(req);
        assert!(got.iter().enumerate().all(|(i, b)| *b == i as u8));

        let keep = SaveOptions { keep_staging: true, ..SaveOptions::default() };
        let state = SaveState::new().tensor(ShardedTensor::whole("v", DType::U8, [64]), &got[..64]);
        ckpt.save_async("memory://facade-staging", &state, &keep).unwrap().wait().unwrap();
        assert!(ckpt.staging_bytes() >= 64);
        ckpt.release_staging();
        assert_eq!(ckpt.staging_bytes(), 0);
    }
}
