//! The collective algorithms, written once over a [`Link`]: every call goes through rank 0
//! (the hub). Non-hub ranks send their part up and wait for the hub's answer; the hub
//! collects, combines and sends down. Both the thread and the TCP backend are a `Star`
//! over their own link.
//!
//! Back of the envelope: a call costs 2 (w - 1) messages and two hops; the hub moves
//! every byte of a gather once in and, for all-gather, w - 1 times out. That is the price
//! of a topology that needs one listening socket and no peer-to-peer mesh.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::wire::{self, AbortCode, Frame, kind};

mod exchange;
mod via;
use crate::{Collective, CollectiveOptions, Error, ReduceOp, Result};
pub(crate) use via::collective_via_star;

pub(crate) const HUB: usize = 0;

/// How long a rank whose send to the hub failed waits for the hub's verdict (see
/// [`Star::hub_verdict_or`]) before reporting the hub itself as gone. Both backends queue
/// the verdict before the hub's departure, so the wait normally ends at once.
pub(crate) const HUB_VERDICT_GRACE: Duration = Duration::from_millis(200);

/// What a backend delivers to a rank's inbox.
#[derive(Debug)]
pub(crate) enum Event {
    Frame {
        from: usize,
        frame: Frame,
    },
    /// The peer is gone: its connection closed or its handle was dropped. `corrupt` holds
    /// the reason when the connection was dropped for sending garbage.
    Gone {
        from: usize,
        corrupt: Option<String>,
    },
}

/// How a backend moves a frame to one peer.
pub(crate) trait Link: Send + fmt::Debug {
    /// Whether a rank must learn from the hub where a peer is before its first direct send
    /// (TCP: a connection to dial), so that [`Collective::exchange`] runs a route round.
    /// Constant per backend, since every rank must agree on whether the round happens.
    const ROUTED: bool;
    /// Sends, failing with an error that names `to`.
    fn send(&mut self, to: usize, frame: &Frame, op: &'static str) -> Result<()>;
    /// Whether this rank has no direct path to `to` yet.
    fn needs_route(&self, to: usize) -> bool;
    /// Hub side: how `asker` reaches `to` (bytes the asker's [`Link::connect`] reads), or
    /// `None` when the hub does not know.
    fn route(&self, asker: usize, to: usize) -> Option<Vec<u8>>;
    /// Opens the direct path to `to` the hub's route describes, by `deadline`.
    fn connect(&mut self, to: usize, route: &[u8], deadline: Instant) -> Result<()>;
    /// Tells the peers this rank is leaving (called on drop).
    fn close(&mut self);
}

pub(crate) struct Star<L: Link> {
    rank: usize,
    world: usize,
    opts: CollectiveOptions,
    state: Mutex<State<L>>,
    /// Payload bytes of every frame this rank took from its inbox (see
    /// [`Star::bytes_received`]); atomic so that it can be read without the call lock.
    received: AtomicU64,
}

struct State<L> {
    link: L,
    inbox: Receiver<Event>,
    /// Frames that arrived ahead of the call they belong to, per sender.
    stash: HashMap<usize, VecDeque<Frame>>,
    /// Ranks known gone, with the reason when they were dropped for garbage.
    dead: HashMap<usize, Option<String>>,
    seq: u64,
    poisoned: Option<String>,
}

/// One call in progress.
#[derive(Clone, Copy)]
struct Call {
    kind: u8,
    op: &'static str,
    seq: u64,
    deadline: Instant,
    timeout: Duration,
}

impl<L: Link> fmt::Debug for Star<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Star").field("rank", &self.rank).field("world", &self.world).finish_non_exhaustive()
    }
}

impl<L: Link> Star<L> {
    pub(crate) fn new(rank: usize, world: usize, opts: CollectiveOptions, link: L, inbox: Receiver<Event>) -> Self {
        assert!(rank < world, "rank {rank} out of world {world}");
        let state = State { link, inbox, stash: HashMap::new(), dead: HashMap::new(), seq: 0, poisoned: None };
        Star { rank, world, opts, state: Mutex::new(state), received: AtomicU64::new(0) }
    }

    /// Payload bytes of all frames this rank has received so far, from every peer and call
    /// (framing and handshakes not included): what the calls cost this rank on the wire.
    pub(crate) fn bytes_received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Takes the next event from the inbox, counting a frame's payload as received.
    fn recv(&self, st: &mut State<L>, wait: Duration) -> std::result::Result<Event, RecvTimeoutError> {
        let event = st.inbox.recv_timeout(wait)?;
        if let Event::Frame { frame, .. } = &event {
            self.received.fetch_add(frame.payload.len() as u64, Ordering::Relaxed);
        }
        Ok(event)
    }

    fn bytes_max(&self) -> u64 {
        self.opts.message_bytes_max
    }

    /// Runs one call: checks poisoning, numbers the call, and on error poisons this rank
    /// and tells the peers it can reach, so that they fail now rather than at their timeout.
    fn call<T>(&self, kind: u8, body: impl FnOnce(&Self, &mut State<L>, Call) -> Result<T>) -> Result<T> {
        let op = kind::name(kind);
        let mut st = match self.state.lock() {
            Ok(st) => st,
            Err(_) => return Err(Error::Poisoned { cause: "a previous call panicked".into() }),
        };
        if let Some(cause) = &st.poisoned {
            return Err(Error::Poisoned { cause: cause.clone() });
        }
        st.seq += 1;
        let call = Call {
            kind,
            op,
            seq: st.seq,
            deadline: crate::deadline_after(self.wait_budget()),
            timeout: self.opts.timeout,
        };
        let result = body(self, &mut st, call);
        if let Err(e) = &result {
            st.poisoned = Some(e.to_string());
            self.abort_peers(&mut st, e, op);
        }
        result
    }

    /// The hub waits `timeout`; the others a little longer, so that the hub's verdict naming
    /// a silent rank reaches them before their own timeout names the hub.
    fn wait_budget(&self) -> Duration {
        let t = self.opts.timeout;
        if self.rank == HUB { t } else { t.saturating_add((t / 4).min(Duration::from_secs(2))) }
    }

    fn abort_peers(&self, st: &mut State<L>, e: &Error, op: &'static str) {
        let (code, rank) = match e {
            Error::PeerDead { rank, .. } => (AbortCode::PeerDead, *rank),
            Error::Timeout { rank, .. } => (AbortCode::Timeout, *rank),
            Error::Aborted { rank, .. } => (AbortCode::Other, *rank),
            _ => (AbortCode::Other, self.rank),
        };
        let payload = wire::encode_abort(code, rank, &e.to_string());
        let frame = Frame { kind: kind::ABORT, seq: st.seq, payload };
        let peers: Vec<usize> = if self.rank == HUB { (1..self.world).collect() } else { vec![HUB] };
        for peer in peers {
            if peer != rank && !st.dead.contains_key(&peer) {
                // Best effort: the peer may be the one that is gone.
                let _ = st.link.send(peer, &frame, op);
            }
        }
        // A silent rank may be alive, stalled in a call of its own (a storage write): once
        // it returns, the verdict tells it that the others gave up waiting for it, rather
        // than leaving it to find the hub gone. Last, as it may be slow to take it.
        let silent = matches!(e, Error::Timeout { .. }) && rank != self.rank && !st.dead.contains_key(&rank);
        if silent && (self.rank == HUB || rank == HUB) {
            let _ = st.link.send(rank, &frame, op);
        }
    }

    fn send(&self, st: &mut State<L>, to: usize, call: Call, payload: Bytes) -> Result<()> {
        if let Some(corrupt) = st.dead.get(&to) {
            return Err(dead_error(to, corrupt, call.op));
        }
        match st.link.send(to, &Frame { kind: call.kind, seq: call.seq, payload }, call.op) {
            Err(e) if to == HUB && self.rank != HUB => Err(self.hub_verdict_or(st, call, e)),
            other => other,
        }
    }

    /// A send to the hub failed with `own`. The hub closes its connections right after
    /// telling the others why it gave up, so a rank that reaches its next call only then
    /// finds the hub gone (TCP: its reader, having read the verdict and then the close, shut
    /// the socket, or the hub's kernel answered with a reset; threads: the hub's inbox is
    /// dropped) while the verdict, naming the rank that really failed, already waits in the
    /// inbox or is about to: prefer it. Waits until the hub's last word (its verdict, or its
    /// `Gone`, after which nothing more comes from it), [`HUB_VERDICT_GRACE`] at most;
    /// without a verdict, `own` stands. (While receiving, no such wait is needed: both
    /// backends queue the hub's verdict ahead of its `Gone`.)
    fn hub_verdict_or(&self, st: &mut State<L>, call: Call, own: Error) -> Error {
        if let Some(frame) = st.stash.get_mut(&HUB).and_then(|q| {
            let at = q.iter().position(|f| f.kind == kind::ABORT)?;
            q.remove(at)
        }) {
            return abort_error(HUB, &frame, call);
        }
        if st.dead.contains_key(&HUB) {
            return own;
        }
        let until = Instant::now() + HUB_VERDICT_GRACE;
        loop {
            let wait = until.saturating_duration_since(Instant::now());
            match self.recv(st, wait) {
                Ok(Event::Frame { from, frame }) if from == HUB && frame.kind == kind::ABORT => {
                    return abort_error(HUB, &frame, call);
                }
                Ok(Event::Frame { from, frame }) => st.stash.entry(from).or_default().push_back(frame),
                Ok(Event::Gone { from, corrupt }) => {
                    st.dead.insert(from, corrupt);
                    if from == HUB {
                        return own;
                    }
                }
                Err(_) => return own,
            }
        }
    }

    fn send_down(&self, st: &mut State<L>, call: Call, payload: &Bytes, skip: Option<usize>) -> Result<()> {
        for r in (1..self.world).filter(|r| Some(*r) != skip) {
            self.send(st, r, call, payload.clone())?;
        }
        Ok(())
    }

    /// Receives this call's frame from each rank in `from` (any arrival order), returned in
    /// the order of `from`. Fails at once if one of them is gone or any peer aborts, and at
    /// the deadline if one is silent.
    ///
    /// A rank may appear several times in `from` (an exchange of several messages): its
    /// frames are taken in the order it sent them.
    fn collect(&self, st: &mut State<L>, from: &[usize], call: Call) -> Result<Vec<Bytes>> {
        let mut slot: HashMap<usize, Slot> = HashMap::new();
        for &r in from {
            slot.entry(r).or_default().wanted += 1;
        }
        let mut missing = from.len();
        for (&r, s) in slot.iter_mut() {
            while s.short() {
                let Some(frame) = st.stash.get_mut(&r).and_then(VecDeque::pop_front) else { break };
                s.got.push_back(accept(r, frame, call)?);
                missing -= 1;
            }
        }
        if let Some((r, corrupt)) = st.dead.iter().find(|(r, _)| slot.get(r).is_some_and(Slot::short)) {
            return Err(dead_error(*r, corrupt, call.op));
        }
        while missing > 0 {
            let wait = call.deadline.saturating_duration_since(Instant::now());
            let event = match self.recv(st, wait) {
                Ok(ev) => ev,
                Err(RecvTimeoutError::Timeout) => {
                    let rank = first_missing(from, &slot);
                    return Err(Error::Timeout { rank, op: call.op.into(), timeout: self.opts.timeout });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let rank = first_missing(from, &slot);
                    return Err(Error::PeerDead { rank, op: call.op.into() });
                }
            };
            match event {
                Event::Frame { from: r, frame } => match slot.get_mut(&r) {
                    Some(s) if s.short() => {
                        s.got.push_back(accept(r, frame, call)?);
                        missing -= 1;
                    }
                    _ if frame.kind == kind::ABORT => return Err(abort_error(r, &frame, call)),
                    _ => st.stash.entry(r).or_default().push_back(frame),
                },
                Event::Gone { from: r, corrupt } => {
                    if slot.get(&r).is_some_and(Slot::short) {
                        return Err(dead_error(r, &corrupt, call.op));
                    }
                    st.dead.insert(r, corrupt);
                }
            }
        }
        if self.rank == HUB {
            self.refuse_if_aborted(st, call)?;
        }
        Ok(from.iter().map(|r| slot.get_mut(r).and_then(|s| s.got.pop_front()).expect("all collected")).collect())
    }

    /// Fails if a peer's abort already waits in the inbox. A rank that gave up on the hub
    /// (the hub stalled past their timeout in a call of its own) has sent its part first and
    /// its abort after; deciding on those parts would commit what the others reported failed.
    fn refuse_if_aborted(&self, st: &mut State<L>, call: Call) -> Result<()> {
        while let Ok(event) = self.recv(st, Duration::ZERO) {
            match event {
                Event::Frame { from, frame } if frame.kind == kind::ABORT => {
                    return Err(abort_error(from, &frame, call));
                }
                Event::Frame { from, frame } => st.stash.entry(from).or_default().push_back(frame),
                Event::Gone { from, corrupt } => {
                    st.dead.insert(from, corrupt);
                }
            }
        }
        Ok(())
    }

    fn check_own(&self, len: usize) -> Result<()> {
        check_len(self.rank, len as u64, self.bytes_max())
    }

    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.world {
            return Err(Error::invalid(format!("root {root} out of world of {}", self.world)));
        }
        Ok(())
    }

    fn peers(&self) -> Vec<usize> {
        (1..self.world).collect()
    }

    /// Hub side of gather/all-gather: everyone's message, in rank order, sizes checked.
    fn hub_collect_all(&self, st: &mut State<L>, own: Bytes, call: Call) -> Result<Vec<Bytes>> {
        let mut parts = Vec::with_capacity(self.world);
        parts.push(own);
        parts.extend(self.collect(st, &self.peers(), call)?);
        for (r, p) in parts.iter().enumerate() {
            check_len(r, p.len() as u64, self.bytes_max())?;
        }
        Ok(parts)
    }

    fn recv_set(&self, st: &mut State<L>, call: Call) -> Result<Vec<Vec<u8>>> {
        let set = self.collect(st, &[HUB], call)?.remove(0);
        wire::decode_set(&set, self.world, self.bytes_max()).map_err(|detail| Error::Protocol { rank: HUB, detail })
    }

    fn barrier_body(&self, st: &mut State<L>, call: Call) -> Result<()> {
        if self.rank == HUB {
            self.collect(st, &self.peers(), call)?;
            self.send_down(st, call, &Bytes::new(), None)
        } else {
            self.send(st, HUB, call, Bytes::new())?;
            self.collect(st, &[HUB], call).map(drop)
        }
    }

    fn broadcast_body(&self, st: &mut State<L>, root: usize, data: Option<&[u8]>, call: Call) -> Result<Vec<u8>> {
        self.check_root(root)?;
        let own = match (self.rank == root, data) {
            (true, Some(d)) => {
                self.check_own(d.len())?;
                Some(Bytes::copy_from_slice(d))
            }
            (true, None) => return Err(Error::invalid(format!("broadcast root {root} passed no data"))),
            (false, _) => None,
        };
        if self.rank == HUB {
            let payload = match own {
                Some(p) => p,
                None => self.collect(st, &[root], call)?.remove(0),
            };
            check_len(root, payload.len() as u64, self.bytes_max())?;
            self.send_down(st, call, &payload, Some(root))?;
            return Ok(payload.to_vec());
        }
        if let Some(p) = own {
            self.send(st, HUB, call, p.clone())?;
            return Ok(p.to_vec());
        }
        let payload = self.collect(st, &[HUB], call)?.remove(0);
        check_len(root, payload.len() as u64, self.bytes_max())?;
        Ok(payload.to_vec())
    }

    fn gather_body(&self, st: &mut State<L>, root: usize, data: Vec<u8>, call: Call) -> Result<Option<Vec<Vec<u8>>>> {
        self.check_root(root)?;
        self.check_own(data.len())?;
        if self.rank == HUB {
            let parts = self.hub_collect_all(st, Bytes::from(data), call)?;
            if root == HUB {
                return Ok(Some(parts.iter().map(|p| p.to_vec()).collect()));
            }
            self.send(st, root, call, wire::encode_set(&parts))?;
            return Ok(None);
        }
        self.send(st, HUB, call, Bytes::from(data))?;
        if self.rank == root { self.recv_set(st, call).map(Some) } else { Ok(None) }
    }

    fn all_gather_body(&self, st: &mut State<L>, data: Vec<u8>, call: Call) -> Result<Vec<Vec<u8>>> {
        self.check_own(data.len())?;
        if self.rank == HUB {
            let parts = self.hub_collect_all(st, Bytes::from(data), call)?;
            self.send_down(st, call, &wire::encode_set(&parts), None)?;
            return Ok(parts.iter().map(|p| p.to_vec()).collect());
        }
        self.send(st, HUB, call, Bytes::from(data))?;
        self.recv_set(st, call)
    }

    /// The hub sends each rank its own part; a root other than the hub first sends the hub
    /// the whole set. Nobody but the root and the hub sees another rank's part.
    fn scatter_body(&self, st: &mut State<L>, root: usize, parts: Option<Vec<Vec<u8>>>, call: Call) -> Result<Vec<u8>> {
        self.check_root(root)?;
        let own: Option<Vec<Bytes>> = match (self.rank == root, parts) {
            (true, Some(p)) if p.len() == self.world => {
                for (r, part) in p.iter().enumerate() {
                    check_len(r, part.len() as u64, self.bytes_max())?;
                }
                Some(p.into_iter().map(Bytes::from).collect())
            }
            (true, Some(p)) => {
                return Err(Error::invalid(format!("scatter of {} parts in a world of {}", p.len(), self.world)));
            }
            (true, None) => return Err(Error::invalid(format!("scatter root {root} passed no parts"))),
            (false, _) => None,
        };
        if self.rank == HUB {
            let mut parts = match own {
                Some(p) => p,
                None => {
                    let set = self.collect(st, &[root], call)?.remove(0);
                    wire::decode_set(&set, self.world, self.bytes_max())
                        .map_err(|detail| Error::Protocol { rank: root, detail })?
                        .into_iter()
                        .map(Bytes::from)
                        .collect()
                }
            };
            for r in (1..self.world).filter(|&r| r != root) {
                let part = std::mem::take(&mut parts[r]);
                self.send(st, r, call, part)?;
            }
            return Ok(std::mem::take(&mut parts[HUB]).to_vec());
        }
        if let Some(mut p) = own {
            let mine = std::mem::take(&mut p[self.rank]).to_vec();
            self.send(st, HUB, call, wire::encode_set(&p))?;
            return Ok(mine);
        }
        let part = self.collect(st, &[HUB], call)?.remove(0);
        check_len(self.rank, part.len() as u64, self.bytes_max())?;
        Ok(part.to_vec())
    }

    fn all_reduce_body(&self, st: &mut State<L>, values: &[u64], op: ReduceOp, call: Call) -> Result<Vec<u64>> {
        self.check_own(values.len().saturating_mul(8))?;
        if self.rank == HUB {
            let mut acc = values.to_vec();
            for (i, part) in self.collect(st, &self.peers(), call)?.iter().enumerate() {
                let theirs = decode_values(i + 1, part, values.len())?;
                for (a, b) in acc.iter_mut().zip(theirs) {
                    *a = op.apply(*a, b);
                }
            }
            self.send_down(st, call, &wire::encode_u64s(&acc), None)?;
            return Ok(acc);
        }
        self.send(st, HUB, call, wire::encode_u64s(values))?;
        let answer = self.collect(st, &[HUB], call)?.remove(0);
        decode_values(HUB, &answer, values.len())
    }
}

impl<L: Link> Drop for Star<L> {
    fn drop(&mut self) {
        // Even after a panic inside a call the peers must hear that this rank is gone.
        let st = match self.state.get_mut() {
            Ok(st) => st,
            Err(poisoned) => poisoned.into_inner(),
        };
        st.link.close();
    }
}

impl<L: Link> Collective for Star<L> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn barrier(&self) -> Result<()> {
        self.call(kind::BARRIER, |s, st, c| s.barrier_body(st, c))
    }

    fn broadcast(&self, root: usize, data: Option<&[u8]>) -> Result<Vec<u8>> {
        self.call(kind::BROADCAST, |s, st, c| s.broadcast_body(st, root, data, c))
    }

    fn gather(&self, root: usize, data: Vec<u8>) -> Result<Option<Vec<Vec<u8>>>> {
        self.call(kind::GATHER, |s, st, c| s.gather_body(st, root, data, c))
    }

    fn all_gather(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.call(kind::ALL_GATHER, |s, st, c| s.all_gather_body(st, data, c))
    }

    fn all_reduce_u64(&self, values: &[u64], op: ReduceOp) -> Result<Vec<u64>> {
        self.call(kind::ALL_REDUCE, |s, st, c| s.all_reduce_body(st, values, op, c))
    }

    fn scatter(&self, root: usize, parts: Option<Vec<Vec<u8>>>) -> Result<Vec<u8>> {
        self.call(kind::SCATTER, |s, st, c| s.scatter_body(st, root, parts, c))
    }

    fn exchange(&self, sends: Vec<(usize, Bytes)>, from: &[usize]) -> Result<Vec<Bytes>> {
        self.call(kind::EXCHANGE, |s, st, c| s.exchange_body(st, sends, from, c))
    }
}

/// Checks that a frame from `from` belongs to the call in progress.
fn accept(from: usize, frame: Frame, call: Call) -> Result<Bytes> {
    if frame.kind == kind::ABORT {
        return Err(abort_error(from, &frame, call));
    }
    if frame.kind != call.kind || frame.seq != call.seq {
        let detail = format!(
            "expected {} #{}, got {} #{} (ranks disagree on the sequence of calls)",
            call.op,
            call.seq,
            kind::name(frame.kind),
            frame.seq
        );
        return Err(Error::Protocol { rank: from, detail });
    }
    Ok(frame.payload)
}

fn abort_error(from: usize, frame: &Frame, call: Call) -> Error {
    let op = call.op.into();
    match wire::decode_abort(&frame.payload) {
        Some((AbortCode::PeerDead, rank, _)) => Error::PeerDead { rank, op },
        Some((AbortCode::Timeout, rank, _)) => Error::Timeout { rank, op, timeout: call.timeout },
        Some((AbortCode::Other, rank, reason)) => Error::Aborted { rank, reason },
        None => Error::Protocol { rank: from, detail: "malformed abort notice".into() },
    }
}

fn dead_error(rank: usize, corrupt: &Option<String>, op: &'static str) -> Error {
    match corrupt {
        Some(detail) => Error::Protocol { rank, detail: detail.clone() },
        None => Error::PeerDead { rank, op: op.into() },
    }
}

/// What [`Star::collect`] still waits for from one rank.
#[derive(Default)]
struct Slot {
    wanted: usize,
    got: VecDeque<Bytes>,
}

impl Slot {
    fn short(&self) -> bool {
        self.got.len() < self.wanted
    }
}

fn first_missing(from: &[usize], slot: &HashMap<usize, Slot>) -> usize {
    from.iter().copied().find(|r| slot.get(r).is_some_and(Slot::short)).unwrap_or(HUB)
}

fn check_len(rank: usize, bytes: u64, bytes_max: u64) -> Result<()> {
    if bytes > bytes_max {
        return Err(Error::MessageTooLarge { rank, bytes, bytes_max });
    }
    Ok(())
}

fn decode_values(rank: usize, b: &[u8], expect: usize) -> Result<Vec<u64>> {
    let v = wire::decode_u64s(b).map_err(|detail| Error::Protocol { rank, detail })?;
    if v.len() != expect {
        let detail = format!("all_reduce of {} values, this rank has {expect}", v.len());
        return Err(Error::Protocol { rank, detail });
    }
    Ok(v)
}
