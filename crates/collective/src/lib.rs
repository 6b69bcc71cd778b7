//! Ranks talking to each other: the [`Collective`] trait and its backends.
//!
//! This crate owns the few collective calls a checkpoint engine needs to make its ranks
//! agree — on a plan, on who writes what, on whether every rank succeeded — and the
//! machinery to run them: threads in one process ([`ThreadGroup`]), one process per rank
//! over TCP with torchrun's environment ([`TcpCollective`]), NCCL on GPUs (feature `nccl`,
//! `NcclCollective`). Starting the processes of a job is the launcher's business (torchrun,
//! or `dckpt launch`), not this crate's.
//!
//! It deliberately does **not** know tensors, storage or checkpoints: messages are bytes
//! (plus a small `u64` all-reduce), and it does not retry, re-form a world or survive the
//! loss of a rank. A job whose rank died fails; the caller decides what next.
//!
//! # The contract
//!
//! - Every rank of a world makes the **same calls in the same order** with the same root
//!   and, for [`Collective::all_reduce_u64`], the same number of values. A rank that calls
//!   something else makes its peers fail with [`Error::Protocol`] (never a hang).
//! - Messages are byte vectors of any size from 0 to `message_bytes_max`; an empty message
//!   is an ordinary message. Each rank's message may have a different size. Sizes are
//!   checked when sending and again when receiving, before anything is allocated.
//! - [`Collective::gather`] returns `Some(messages)` on the root, in rank order (the root's
//!   own included), and `None` elsewhere; no rank other than the root (and the hub, rank 0,
//!   which forwards) ever holds everyone's data. [`Collective::all_gather`] returns every
//!   rank's message in rank order on every rank. [`Collective::broadcast`] returns the
//!   root's bytes on every rank; the root passes `Some(data)`, the others `None`.
//!   [`Collective::scatter`] returns each rank its own part of the root's set; the thread
//!   and TCP backends send a rank no other rank's part.
//! - Every call is bounded in time by `timeout` (see [`CollectiveOptions`]). A peer that
//!   dies (process killed, connection closed, handle dropped, thread panicked) makes every
//!   surviving rank fail **at once** with [`Error::PeerDead`] naming it; a peer that stays
//!   silent makes them fail after the timeout with [`Error::Timeout`] naming it. When rank 0
//!   gives up it first tells the others why, then closes; a rank that then finds rank 0
//!   gone (its send fails) reports rank 0's verdict, naming the rank that really failed,
//!   and waits at most 200 ms for it before reporting rank 0 itself. So rank 0 may exit
//!   right after its error: no need to linger for the others to read its verdict. The rank
//!   it timed out on gets the verdict too, so a rank stalled in a call of its own (a storage
//!   write) fails, once it returns, naming itself; and rank 0 refuses a gather whose
//!   senders' aborts already wait behind their parts (they gave up on a stalled rank 0), so
//!   it decides nothing that they reported failed. [`Error::in_phase`] adds the caller's
//!   phase to the errors that name a call.
//! - After any error the instance is **poisoned**: further calls return
//!   [`Error::Poisoned`]. The ranks no longer agree on where they are in the call sequence,
//!   so the world must be rebuilt.
//! - Instances are one per rank, `Send`, used from one thread at a time (calls take `&self`
//!   so the engine can hold a `&dyn Collective`; concurrent calls on one instance are
//!   serialised).
//!
//! The thread and TCP backends route every call through rank 0 (a star); see `star/` for
//! the cost. That is fine for the metadata a checkpoint exchanges. Bulk bytes between ranks
//! (peer copies of a local checkpoint) go by [`Collective::exchange`], rank to rank: a TCP
//! rank learns from rank 0 where a peer listens and connects to it directly.
//!
//! # Limits
//!
//! - Rank 0 of a TCP world holds one socket (read and written through one descriptor)
//!   and one reader thread (256 KiB of stack reserved, a few pages of it used) per peer. It
//!   raises its soft `RLIMIT_NOFILE` to the world size plus a margin, or fails before
//!   listening with [`Error::Handshake`] naming the limit and the number needed. At 16,384
//!   ranks that is 16,383 sockets and threads on rank 0; see ARCHITECTURE.md for what that
//!   costs.
//! - Any other TCP rank may come to hold a direct connection to and from each peer
//!   (`exchange`): it raises its soft `RLIMIT_NOFILE` to twice the world size plus a margin
//!   where the hard limit allows; a dial past the limit fails naming it.
//! - A frame carrying a whole set (all-gather, gather forwarded to a root other than 0) is
//!   bounded by `world_size * message_bytes_max`; each message in it by `message_bytes_max`.
//! - During the rendezvous rank 0 reads handshakes concurrently (256 at once); clients
//!   that connect and say nothing delay the others by about one handshake timeout (2 s) in
//!   all before they are dropped.
//! - NCCL (`NcclCollective`): a dead peer shows as the call timeout (NCCL reports no
//!   rank), `gather` costs an all-gather and `scatter` a broadcast of the whole set
//!   ([`scatter_by_broadcast`]).
//!
//! # TCP environment
//!
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, the port from `DCKPT_MASTER_PORT`
//! (never `MASTER_PORT`, torch's store's under torchrun), the job id from `DCKPT_JOB_ID`
//! else `TORCHELASTIC_RUN_ID`; optional
//! `DCKPT_COLLECTIVE_TIMEOUT_MS`, `DCKPT_RENDEZVOUS_TIMEOUT_MS`, `DCKPT_MESSAGE_BYTES_MAX`,
//! `DCKPT_TCP_LISTEN` (the address rank 0 listens on).
//!
//! # Example
//!
//! ```
//! use dckpt_collective::{Collective, CollectiveExt, ReduceOp, ThreadGroup};
//!
//! let ranks = ThreadGroup::new(4).unwrap();
//! let threads: Vec<_> = ranks
//!     .into_iter()
//!     .map(|c| {
//!         std::thread::spawn(move || {
//!             // Rank r contributes r bytes; rank 0 gets all of them, in rank order.
//!             let plan = vec![7u8; c.rank()];
//!             let gathered = c.gather(0, plan).unwrap();
//!             if c.rank() == 0 {
//!                 let sizes: Vec<usize> = gathered.unwrap().iter().map(Vec::len).collect();
//!                 assert_eq!(sizes, [0, 1, 2, 3]);
//!             }
//!             let decision = c.broadcast(0, (c.rank() == 0).then_some(&b"go"[..])).unwrap();
//!             assert_eq!(decision, b"go");
//!             assert_eq!(c.all_reduce_u64(&[c.rank() as u64], ReduceOp::Max).unwrap(), [3]);
//!             assert!(c.all_succeeded(true).unwrap());
//!         })
//!     })
//!     .collect();
//! for t in threads {
//!     t.join().unwrap();
//! }
//! ```

#![warn(missing_docs)]

mod error;
mod fds;
mod star;
mod tcp;
mod threads;
mod wire;

#[cfg(feature = "nccl")]
mod nccl;

use std::fmt::Debug;
use std::time::Duration;

/// The message type of [`Collective::exchange`], re-exported for implementors.
pub use bytes::Bytes;
pub use error::{Error, Result};
pub use fds::raise_open_files;
#[cfg(feature = "nccl")]
pub use nccl::{NcclCollective, NcclLibraries, probe_libraries};
pub use tcp::{TcpCollective, TcpConfig, TcpOptions};
pub use threads::{ThreadCollective, ThreadGroup};

/// The collective calls every backend provides. See the crate docs for the contract.
///
/// `Sync`, so that one collective can be shared (`Arc<dyn Collective>`) between a
/// checkpointer and the host's own calls; calls still go in the same order on every rank,
/// so a host must not make its own calls while a background save is using it.
pub trait Collective: Send + Sync + Debug {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;

    /// Returns the root's bytes on every rank. The root passes `Some(data)`; the others
    /// pass `None` (their argument is ignored).
    fn broadcast(&self, root: usize, data: Option<&[u8]>) -> Result<Vec<u8>>;

    /// Collects every rank's message on `root`: `Some` (rank order) there, `None` elsewhere.
    fn gather(&self, root: usize, data: Vec<u8>) -> Result<Option<Vec<Vec<u8>>>>;

    /// Every rank's message on every rank, in rank order.
    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>>;

    /// Element-wise reduction of equally long `u64` vectors; the result on every rank.
    fn all_reduce_u64(&self, values: &[u64], op: ReduceOp) -> Result<Vec<u64>>;

    /// Each rank's own message from `root`: the root passes `Some(parts)`, one per rank in
    /// rank order, and gets `parts[root]` back; the others pass `None` (their argument is
    /// ignored). Each part is bounded like any message.
    ///
    /// Required, with no default: a backend (or a wrapper) that could only fall back to a
    /// broadcast of the whole set would send every rank every rank's part, world x world
    /// bytes, with the whole set in one message. One that has nothing better says so by
    /// calling [`scatter_by_broadcast`].
    fn scatter(&self, root: usize, parts: Option<Vec<Vec<u8>>>) -> Result<Vec<u8>>;

    /// Point to point, one call on every rank: sends each `(to, message)` of `sends` to rank
    /// `to`, and returns one message from each rank listed in `from`, in the order of `from`.
    /// A rank may send several messages to one peer (and list that peer as often in `from`);
    /// they arrive in the order sent. A rank with nothing to send or receive passes empty
    /// lists, and no rank sends to itself. The pairs must agree: `a` sends `b` as many
    /// messages as `b` lists `a`; a peer that sends nothing `b` waits for fails `b` at the
    /// timeout naming it. Each message is bounded like any other.
    ///
    /// The bytes go from sender to receiver and no other rank sees them (the star backends'
    /// hub included: at most it tells ranks where to find each other), so this is the path
    /// for bulk data between ranks (peer copies of a checkpoint, a read fanned out to the
    /// ranks that need it). Required, with no default: routing it through a hub or a
    /// broadcast would cost that rank every byte.
    ///
    /// Messages are shared buffers: one going to several peers is one buffer with several
    /// handles, and where the ranks share memory (threads) it arrives as the sender's own
    /// buffer, uncopied. A sender may take its buffer back for the next message once its
    /// handle is the only one left ([`Bytes::try_into_mut`]).
    fn exchange(&self, sends: Vec<(usize, Bytes)>, from: &[usize]) -> Result<Vec<Bytes>>;
}

/// The instant `timeout` from now; a century from now where that is past what an
/// `Instant` holds (`DCKPT_COLLECTIVE_TIMEOUT_MS=18446744073709551615` asks to wait, and
/// `Instant + Duration` would panic).
pub(crate) fn deadline_after(timeout: Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// A correct scatter over any collective's [`Collective::broadcast`]: the root broadcasts
/// the whole set and every rank keeps its own part. Every rank receives every part (the
/// sum of all parts, in one message of at most `message_bytes_max`), so this is for
/// backends without a point-to-point path (NCCL here) and for tests, not the default.
pub fn scatter_by_broadcast<C: Collective + ?Sized>(
    c: &C,
    root: usize,
    parts: Option<Vec<Vec<u8>>>,
) -> Result<Vec<u8>> {
    let (rank, world) = (c.rank(), c.world_size());
    let set = match parts {
        Some(parts) if rank == root => {
            if parts.len() != world {
                return Err(Error::invalid(format!("scatter of {} parts in a world of {world}", parts.len())));
            }
            let parts: Vec<bytes::Bytes> = parts.into_iter().map(bytes::Bytes::from).collect();
            Some(wire::encode_set(&parts))
        }
        None if rank == root => return Err(Error::invalid(format!("scatter root {root} passed no parts"))),
        _ => None,
    };
    let set = c.broadcast(root, set.as_deref())?;
    // The broadcast already bounded the whole set; each part is within it.
    let mut all = wire::decode_set(&set, world, u64::MAX).map_err(|detail| Error::Protocol { rank: root, detail })?;
    Ok(std::mem::take(&mut all[rank]))
}

/// Every call of a pointer to a collective forwarded to the collective it points to, so a
/// pointer type cannot forget one.
macro_rules! forward_through_pointer {
    ($($ptr:ident)::+) => {
        impl<C: Collective + ?Sized> Collective for $($ptr)::+<C> {
            fn rank(&self) -> usize {
                (**self).rank()
            }
            fn world_size(&self) -> usize {
                (**self).world_size()
            }
            fn barrier(&self) -> Result<()> {
                (**self).barrier()
            }
            fn broadcast(&self, root: usize, data: Option<&[u8]>) -> Result<Vec<u8>> {
                (**self).broadcast(root, data)
            }
            fn gather(&self, root: usize, data: Vec<u8>) -> Result<Option<Vec<Vec<u8>>>> {
                (**self).gather(root, data)
            }
            fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
                (**self).all_gather(data)
            }
            fn all_reduce_u64(&self, values: &[u64], op: ReduceOp) -> Result<Vec<u64>> {
                (**self).all_reduce_u64(values, op)
            }
            fn scatter(&self, root: usize, parts: Option<Vec<Vec<u8>>>) -> Result<Vec<u8>> {
                (**self).scatter(root, parts)
            }
            fn exchange(&self, sends: Vec<(usize, Bytes)>, from: &[usize]) -> Result<Vec<Bytes>> {
                (**self).exchange(sends, from)
            }
        }
    };
}

forward_through_pointer!(Box);
forward_through_pointer!(std::sync::Arc);

/// Conveniences built on [`Collective`]; implemented for every collective.
pub trait CollectiveExt: Collective {
    /// True on every rank iff `ok` is true on every rank (a min over 0/1): the engine's
    /// "did every rank succeed" after each phase.
    fn all_succeeded(&self, ok: bool) -> Result<bool> {
        Ok(self.all_reduce_u64(&[u64::from(ok)], ReduceOp::Min)?.first() == Some(&1))
    }
}

impl<C: Collective + ?Sized> CollectiveExt for C {}

/// The reduction of [`Collective::all_reduce_u64`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Smallest value.
    Min,
    /// Largest value.
    Max,
    /// Sum, wrapping on overflow (callers reduce counts far below `u64::MAX`).
    Sum,
}

impl ReduceOp {
    /// Combines two values.
    pub fn apply(self, a: u64, b: u64) -> u64 {
        match self {
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Sum => a.wrapping_add(b),
        }
    }
}

/// Bounds that apply to every call of a collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveOptions {
    /// How long a call waits for a peer before failing with [`Error::Timeout`]. Ranks other
    /// than 0 wait a little longer (a quarter more, at most 2 s) so that rank 0's verdict,
    /// which names the silent rank, reaches them first.
    pub timeout: Duration,
    /// The largest message one rank may contribute to a call.
    pub message_bytes_max: u64,
}

impl Default for CollectiveOptions {
    /// Ten minutes (like NCCL's default) and 256 MiB.
    fn default() -> Self {
        CollectiveOptions { timeout: Duration::from_secs(600), message_bytes_max: 256 << 20 }
    }
}
