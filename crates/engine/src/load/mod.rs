//! Load with resharding: every rank asks for its own pieces in its own layout; the engine
//! intersects them with the stored chunks, reads only the overlapping bytes (coalesced,
//! checksum-verified block by block) and copies them into place.
//!
//! The stages, each in a module of its own:
//! 1. [`coordinator`]: every rank's requests gathered; the coordinator alone reads and
//!    validates the metadata ([`metadata`]), agrees the keys missing and unexpected over
//!    all ranks ([`keys`]), intersects each request with the stored chunks into copies
//!    ([`plan`], the chunks a request may touch found by [`index`]), decides which shared
//!    blocks the ranks check together, and sends each rank only its own plan;
//! 2. [`execute`]: the copies are cut into direct reads (whole checksum blocks, straight
//!    into place, a window at a time: [`window`]) and staged ones (partial blocks through a
//!    small buffer: [`staged`]), every byte checked ([`blocks`]) or, for blocks the ranks
//!    split between them, checked in parts by the coordinator (`shared_check`);
//!    The bytes several ranks need are read once: [`fan`] plans which rank reads each
//!    stretch and whom it sends it to, [`overlay`] runs those rounds and serves what a rank
//!    received to the read stages, which check it like any other byte;
//! 3. here: the two rounds with the other ranks (the plans, then every rank's result), so
//!    that every rank returns the same outcome.

mod blocks;
mod cast;
mod coordinator;
mod execute;
mod fan;
mod index;
mod keys;
mod metadata;
mod overlay;
mod picked;
mod plan;
mod staged;
mod window;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dckpt_collective::{Collective, ReduceOp};
use dckpt_shard_spec::{ShardedObject, ShardedTensor};
use dckpt_storage::Storage;
use serde::{Deserialize, Serialize};

use crate::error::first_failure;
use crate::phases::{LoadPhases, Slowest};
use crate::protocol::{COORDINATOR, Call, gather_decide, gather_decide_each_sized, in_phase};
use crate::shared_check;
use crate::{Error, ErrorKind, Result};
use coordinator::{Asks, Kept, RankPlan, plan_every_rank};
use execute::read_planned;
use overlay::Overlay;
use plan::zero_outside;

/// A metadata value with these tensors and nothing else stored, for the load's unit tests.
#[cfg(test)]
fn bare_metadata(block_bytes: u64, tensors: Vec<crate::format::TensorMeta>) -> crate::format::Metadata {
    crate::format::Metadata {
        format_version: 1,
        save_id: String::new(),
        writer: String::new(),
        block_bytes,
        layout: Default::default(),
        files: Vec::new(),
        tensors,
        objects: Vec::new(),
    }
}

pub(crate) use metadata::read_metadata;
pub use metadata::read_metadata_local;
pub(crate) use window::HOT_BYTES;

/// A piece to fill: where it sits (its region in its own global shape) and its buffer.
#[derive(Debug)]
pub struct TensorRequest<'a> {
    /// Key, dtype, global shape and region wanted; the replica id is ignored.
    pub tensor: ShardedTensor,
    /// Where the region's bytes go, row-major: exactly `tensor.nbytes()` long.
    pub data: &'a mut [u8],
    /// Accept a stored global shape that differs (a padded vocabulary at another tp):
    /// the overlap is loaded, the rest zero-filled.
    pub allow_shape_mismatch: bool,
    /// Accept a stored dtype that differs, both floating (f16, bf16, f32, f64): the stored
    /// elements are checked, then cast as PyTorch's `tensor.to(dtype)` casts them (an fp32
    /// checkpoint into bf16 parameters, as `torch_dist` loads it). The cast needs a buffer of
    /// the region in the stored dtype for the length of the load.
    pub allow_dtype_cast: bool,
}

/// An object to fetch; `data` is filled when it is stored.
#[derive(Debug, Clone)]
pub struct ObjectRequest {
    /// Key and place in its grid of the object wanted.
    pub object: ShardedObject,
    /// Its bytes after a load; `None` while not loaded, or when it is not stored.
    pub data: Option<Vec<u8>>,
}

/// What one rank asks for. Empty is fine.
///
/// ```
/// use dckpt_engine::LoadRequest;
/// use dckpt_shard_spec::{DType, ShardedObject, ShardedTensor};
///
/// let mut half = vec![0u8; 8];
/// let req = LoadRequest::new()
///     .tensor(ShardedTensor::chunk("w", DType::F32, [4], [2], [2]), &mut half)
///     .object(ShardedObject::single("rng"));
/// assert_eq!(req.object_data("rng"), None); // filled by a load
/// ```
#[derive(Debug, Default)]
pub struct LoadRequest<'a> {
    /// The pieces to fill, in any order.
    pub tensors: Vec<TensorRequest<'a>>,
    /// The objects to fetch.
    pub objects: Vec<ObjectRequest>,
    /// The caller's check of the objects once they are read ([`ObjectCheck`]).
    pub check_objects: Option<ObjectCheck>,
}

/// The caller's own work on the objects a load fetched (decoding them into its values),
/// run on each rank once its reads are done and before the ranks agree on the outcome. Its
/// error, as the caller's `Class: message`, fails the load on every rank as
/// [`LoadOptions::caller_failed`] does at the start ([`ErrorKind::CallerFailed`], naming
/// this rank): an object only one rank cannot decode would otherwise fail that rank alone,
/// and the others would go on into work that waits for it. A panic in it is such an error
/// too. It borrows nothing (`'static`), so that a request is still dropped as soon as it is
/// last used, its buffers free again. It runs inside the load, the checkpointer busy: it must
/// not call the checkpointer that runs it.
pub struct ObjectCheck(pub Box<ObjectCheckFn>);

/// What an [`ObjectCheck`] runs: the rank's objects in, the caller's error out.
pub type ObjectCheckFn = dyn FnMut(&[ObjectRequest]) -> std::result::Result<(), String> + Send;

impl std::fmt::Debug for ObjectCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ObjectCheck(..)")
    }
}

impl LoadRequest<'_> {
    /// The request's object check run, where it has one, on this rank (`rank`).
    pub(crate) fn run_check(&mut self, rank: usize) -> Result<()> {
        let Some(ObjectCheck(check)) = self.check_objects.as_mut() else { return Ok(()) };
        let objects = &self.objects;
        // A panic must not leave this rank out of the round that follows: the others would
        // wait for it until the collective timed out.
        let said = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(objects))).unwrap_or_else(|panic| {
            Err(format!("the object check panicked: {}", crate::error::panic_text(panic.as_ref())))
        });
        said.map_err(|why| Error::from(ErrorKind::CallerFailed { detail: why }).on_rank(rank as u32))
    }
}

impl<'a> LoadRequest<'a> {
    /// An empty request (a rank may load nothing).
    pub fn new() -> LoadRequest<'a> {
        LoadRequest::default()
    }

    /// With one more piece to fill: `data` receives the piece's elements, row-major.
    pub fn tensor(mut self, tensor: ShardedTensor, data: &'a mut [u8]) -> LoadRequest<'a> {
        self.push_tensor(tensor, data);
        self
    }

    /// With one more piece whose stored global shape may differ (a padded vocabulary at
    /// another tp): the overlap is loaded, the rest zero-filled.
    pub fn tensor_allowing_shape_mismatch(mut self, tensor: ShardedTensor, data: &'a mut [u8]) -> LoadRequest<'a> {
        self.tensors.push(TensorRequest { tensor, data, allow_shape_mismatch: true, allow_dtype_cast: false });
        self
    }

    /// With one more object to fetch.
    pub fn object(mut self, object: ShardedObject) -> LoadRequest<'a> {
        self.objects.push(ObjectRequest { object, data: None });
        self
    }

    /// Adds a piece to fill.
    pub fn push_tensor(&mut self, tensor: ShardedTensor, data: &'a mut [u8]) {
        self.tensors.push(TensorRequest { tensor, data, allow_shape_mismatch: false, allow_dtype_cast: false });
    }

    /// The bytes a load gave the first requested object under `key`, if it was stored.
    pub fn object_data(&self, key: &str) -> Option<&[u8]> {
        self.objects.iter().find(|o| o.object.key.as_str() == key).and_then(|o| o.data.as_deref())
    }
}

/// What to do about a kind of key mismatch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyPolicy {
    /// Say nothing.
    Ignore,
    /// Log the keys as a warning through the `log` facade (once, from the coordinator);
    /// where it goes is the host program's choice.
    Log,
    /// Report them in [`LoadOutcome`].
    Return,
    /// Fail the load on every rank.
    #[default]
    Raise,
}

/// Megatron's strictness modes with PyTorch's names: `missing` keys were requested but are
/// not stored; `unexpected` keys are stored but nobody requested them. Every rank of a load
/// passes the same.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Strictness {
    /// What to do about keys requested but not stored.
    pub missing: KeyPolicy,
    /// What to do about keys stored but requested by no rank.
    pub unexpected: KeyPolicy,
}

/// How a load treats keys and how much it reads at once.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Missing and unexpected keys (by default both fail the load).
    pub strictness: Strictness,
    /// The largest single read; bounds the staging memory of a load.
    pub read_bytes_max: u64,
    /// Read once, fan out: each stretch of a data file that several ranks need (the
    /// parameters every data-parallel replica loads) is read from storage by one of them,
    /// spread over the ranks, and sent to the others over
    /// [`Collective::exchange`]; every rank still checks every byte it uses against its
    /// checksum, and reads itself what it did not receive. Off, every rank reads all it
    /// needs from storage.
    pub fan_out: bool,
    /// About the most a rank holds at once for the fan-out (what it received, and what it
    /// read with a copy for each peer): the fan-out goes in rounds of this size.
    pub fan_out_round_bytes: u64,
    /// As [`SaveOptions::caller_failed`](crate::SaveOptions::caller_failed): this rank's
    /// caller failed to make its request (the request may then be empty), and the load
    /// fails on every rank in its first round, naming it, before anything is read.
    pub caller_failed: Option<String>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            strictness: Strictness::default(),
            read_bytes_max: 64 << 20,
            fan_out: true,
            fan_out_round_bytes: 128 << 20,
            caller_failed: None,
        }
    }
}

/// The same on every rank except `bytes_read` and `bytes_received`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadOutcome {
    /// Requested by some rank, not stored (when the policy is `Return`).
    pub missing: Vec<String>,
    /// Stored, requested by no rank (when the policy is `Return`).
    pub unexpected: Vec<String>,
    /// Bytes this rank read from storage (including checksum-block rounding), for itself
    /// and for the peers it sent them to.
    pub bytes_read: u64,
    /// Bytes this rank received from peers that read them from storage (the fan-out).
    pub bytes_received: u64,
    /// Bytes of metadata this rank read (from storage, or from the coordinator) and decoded.
    pub metadata_bytes: u64,
    /// The layout the checkpoint was saved with.
    pub layout: BTreeMap<String, String>,
    /// The id of the save that wrote the checkpoint loaded.
    pub save_id: String,
    /// Where the time went: each phase's slowest rank.
    pub phases: LoadPhases,
}

/// Loads `req` as one rank of `coll`, in two rounds with the other ranks: every rank's asks
/// gathered on the coordinator, which plans every rank's reads and sends each its own plan;
/// then every rank's result gathered and checked (the blocks the ranks read in parts
/// combined), so that every rank returns the same outcome. A rank that fails locally still
/// takes part in both.
pub(crate) fn load(
    storage: &dyn Storage,
    coll: &dyn Collective,
    req: &mut LoadRequest<'_>,
    opts: &LoadOptions,
) -> Result<LoadOutcome> {
    // As long as a save's first round, whose two first words a load does not use: a
    // reduction of other lengths fails as a protocol error, not as the call it is.
    let [c0, c1] = Call::Load.words();
    let v = coll.all_reduce_u64(&[0, 0, c0, c1], ReduceOp::Min).map_err(in_phase("load start"))?;
    Call::check(&v[2..])?;
    let mut kept: Option<Kept> = None;
    let (plan, received) = gather_decide_each_sized(coll, Asks::of(req, opts), "load plan", |all| {
        plan_every_rank(storage, opts, all, &mut kept)
    })?;
    let mut plan: RankPlan = plan?;
    let reading = Instant::now();
    let mut overlay = Overlay::new(storage, &plan.meta);
    let (local, bytes_received) = read_own(&mut overlay, coll, &mut plan, req, opts.read_bytes_max)?;
    let read = reading.elapsed();
    let local = local.and_then(|parts| req.run_check(coll.rank()).map(|()| parts));
    let bytes_read = overlay.bytes_read();
    let summary = (local, read);
    // The coordinator combines the ranks' parts of shared blocks, so a mismatch there is its finding.
    let phases: Result<LoadPhases> = gather_decide(coll, summary, "load result", |all| {
        let kept = kept.as_ref().expect("the coordinator planned the load");
        let checking = Instant::now();
        let (results, reads): (Vec<_>, Vec<Duration>) = all.into_iter().unzip();
        shared_check::verify(&kept.meta, &kept.shared, first_failure(results)?)
            .map(|()| LoadPhases {
                read: Slowest::of(reads),
                check: Slowest::on(COORDINATOR as u32, checking.elapsed()),
                ..kept.phases
            })
            .map_err(|m| {
                Error::from(ErrorKind::Checksum { file: m.file, offset: m.offset, detail: m.detail })
                    .on_rank(COORDINATOR as u32)
            })
    })?;
    let phases = phases?;
    let metadata_bytes = kept.map_or(received, |k| k.meta_bytes);
    let RankPlan { meta, missing, unexpected, .. } = plan;
    Ok(LoadOutcome {
        missing,
        unexpected,
        bytes_read,
        bytes_received,
        metadata_bytes,
        layout: meta.layout,
        save_id: meta.save_id,
        phases,
    })
}

/// Reads this rank's plan into its buffers, in every round of the fan-out whatever fails
/// here; returns its parts of the blocks checked together (or its failure) and the bytes
/// it received. Fails at once only when the exchange itself does.
fn read_own(
    storage: &mut Overlay<'_>,
    coll: &dyn Collective,
    plan: &mut RankPlan,
    req: &mut LoadRequest<'_>,
    read_bytes_max: u64,
) -> Result<(Result<Vec<shared_check::PartCrc>>, u64)> {
    let mut zeroed = Ok(());
    for (ri, shape) in &plan.zero_fill {
        match req.tensors.get_mut(*ri as usize) {
            Some(r) => zero_outside(r, shape),
            None => zeroed = Err(Error::protocol("a zero fill past the requests")),
        }
    }
    let copies = plan.take_copies();
    let casts = std::mem::take(&mut plan.casts);
    let (mut read_plan, sliced) = plan.read_plan(copies);
    read_plan.casts = casts;
    read_planned(storage, coll, &plan.meta, read_plan, &plan.fan, req, read_bytes_max, zeroed.and(sliced))
}
