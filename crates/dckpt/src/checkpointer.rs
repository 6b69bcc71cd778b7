//! The one entry point: a checkpointer per rank.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dckpt_collective::Collective;
use dckpt_engine::format::Metadata;
use dckpt_engine::{
    Engine, LoadOptions, LoadOutcome, LoadRequest, Result, SaveHandle, SaveOptions, SaveOutcome, SaveState,
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
        Checkpointer { engine: Engine::new(Arc::new(collective)), open_options: OpenOptions::default() }
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

    /// The engine underneath, for what the checkpointer does not offer.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(crate) fn storage(&self, location: Location) -> Result<Arc<dyn Storage>> {
        match location {
            Location::Url(url) => self.engine.open(&url, &self.open_options),
            Location::Storage(s) => Ok(s),
        }
    }
}
