//! N ranks as threads of one process: each rank's inbox is a channel, sending is a push
//! onto the peer's channel. Payloads are reference-counted, so a broadcast to 1,023 ranks
//! copies nothing until each rank takes its own `Vec`.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::sync::mpsc::{Sender, channel};
use std::time::Instant;

use crate::star::{Event, HUB, Link, Star};
use crate::wire::{Frame, kind};
use crate::{CollectiveOptions, Error, Result};

/// Builds the handles of an in-process world.
#[derive(Debug)]
pub struct ThreadGroup;

impl ThreadGroup {
    /// One handle per rank, in rank order, with default options; move each onto its own
    /// thread. Dropping a handle (its thread finished or panicked) makes peers that still
    /// need it fail with [`Error::PeerDead`].
    // The group has no state of its own beyond its handles, so `new` returns them.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world_size: usize) -> Result<Vec<ThreadCollective>> {
        Self::with_options(world_size, &CollectiveOptions::default())
    }

    /// Runs `f(rank, handle)` for every rank of a new world, each on its own scoped thread
    /// (named `rank-N`, 8 MiB stack); returns the results in rank order once all finished.
    /// A rank that panics drops its handle (its peers fail instead of hanging), and the
    /// panic is re-raised here after the others are done.
    pub fn run<T: Send>(
        world_size: usize,
        opts: &CollectiveOptions,
        f: impl Fn(usize, ThreadCollective) -> T + Sync,
    ) -> Result<Vec<T>> {
        let handles = Self::with_options(world_size, opts)?;
        let results: Vec<std::thread::Result<T>> = std::thread::scope(|s| {
            let joins: Vec<_> = handles
                .into_iter()
                .enumerate()
                .map(|(rank, c)| {
                    let f = &f;
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .stack_size(8 << 20)
                        .spawn_scoped(s, move || f(rank, c))
                        .map_err(|e| Error::invalid(format!("spawning rank {rank}: {e}")))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok::<_, Error>(joins.into_iter().map(|j| j.join()).collect())
        })?;
        Ok(results.into_iter().map(|r| r.unwrap_or_else(|p| std::panic::resume_unwind(p))).collect())
    }

    /// As [`ThreadGroup::new`], with explicit timeout and size bound.
    pub fn with_options(world_size: usize, opts: &CollectiveOptions) -> Result<Vec<ThreadCollective>> {
        if world_size == 0 {
            return Err(Error::invalid("a world needs at least one rank"));
        }
        let (senders, inboxes): (Vec<_>, Vec<_>) = (0..world_size).map(|_| channel::<Event>()).unzip();
        let senders = Arc::new(senders);
        let handles = inboxes
            .into_iter()
            .enumerate()
            .map(|(rank, inbox)| {
                let link = ThreadLink { rank, senders: Arc::clone(&senders), direct: BTreeSet::new() };
                ThreadCollective { star: Star::new(rank, world_size, opts.clone(), link, inbox) }
            })
            .collect();
        Ok(handles)
    }
}

/// One rank of an in-process world; see [`ThreadGroup`].
#[derive(Debug)]
pub struct ThreadCollective {
    star: Star<ThreadLink>,
}

struct ThreadLink {
    rank: usize,
    senders: Arc<Vec<Sender<Event>>>,
    /// Ranks other than the hub this rank sent an exchange to: they must hear when it goes.
    direct: BTreeSet<usize>,
}

impl fmt::Debug for ThreadLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadLink").field("rank", &self.rank).finish_non_exhaustive()
    }
}

impl Link for ThreadLink {
    // Every rank holds every inbox's sender: a direct send needs no route.
    const ROUTED: bool = false;

    fn send(&mut self, to: usize, frame: &Frame, op: &'static str) -> Result<()> {
        if frame.kind == kind::EXCHANGE && to != HUB && self.rank != HUB {
            self.direct.insert(to);
        }
        let event = Event::Frame { from: self.rank, frame: frame.clone() };
        let sender = self.senders.get(to).ok_or_else(|| Error::invalid(format!("no rank {to}")))?;
        sender.send(event).map_err(|_| Error::PeerDead { rank: to, op: op.into() })
    }

    fn needs_route(&self, _to: usize) -> bool {
        false
    }

    fn route(&self, _asker: usize, _to: usize) -> Option<Vec<u8>> {
        None
    }

    fn connect(&mut self, to: usize, _route: &[u8], _deadline: Instant) -> Result<()> {
        Err(Error::invalid(format!("threads need no route to rank {to}")))
    }

    fn close(&mut self) {
        // Star topology: only the hub talks to everyone; the others to the hub and to the
        // peers they exchanged with directly (telling every rank would cost a world of
        // 16,384 threads 16,384 events per rank that leaves).
        let mut peers: Vec<usize> = if self.rank == HUB { (1..self.senders.len()).collect() } else { vec![HUB] };
        peers.extend(std::mem::take(&mut self.direct));
        for peer in peers {
            let _ = self.senders[peer].send(Event::Gone { from: self.rank, corrupt: None });
        }
    }
}

crate::star::collective_via_star!(ThreadCollective);
