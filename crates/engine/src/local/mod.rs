//! The node-local tier: each rank's state saved as it holds it to its node's own storage,
//! with copies on peers of other nodes, and restored from the fastest whole copy.
//!
//! **Save** ([`save_local`]): every rank writes its part (its pieces, in the order it holds
//! them, and a manifest of their CRC-32s) to its node's directory, and sends the same bytes,
//! rank to rank over [`Collective::exchange`], to `copies - 1` peers, each on another node
//! ([`Placement`]), which check every piece as it arrives and write it to their own node's
//! directory. Only once every rank has agreed that every copy landed does each rank write
//! its `done-<rank>` marker: a step is complete, and restorable, exactly where markers
//! exist, so a save killed at any point leaves the previous complete step as it was.
//!
//! **Restore** (`restore.rs`, each attempt's IO in `attempt.rs`): every rank reports the
//! parts it holds (the markers' lists) and what it asks for; the coordinator picks the
//! newest step of which every rank's part has a copy with the same pieces as that rank asks
//! for, and plans each part from its own rank's copy where it is, else from a peer's. Every
//! byte is checked against its manifest by the rank that uses it; a part whose copy fails
//! is planned again from another copy, and a part with none left is reported as failed for
//! the caller to take from the persistent tier. No rank ever mixes steps, nor two saves of
//! one step (each part's manifest names the save, which the coordinator draws when the
//! save begins: a step saved again after a restart, on nodes numbered otherwise, leaves
//! parts of both), nor runs: a save names its run ([`LocalSaveOptions::run`], the run
//! root's location under the run manager) and a restore takes only its own run's parts
//! (or unnamed ones, saved before runs were named); retention and gc touch only the run's
//! own steps.

mod attempt;
mod part;
mod restore;
mod retain;

use std::collections::BTreeMap;
use std::time::Instant;

use dckpt_collective::{Collective, ReduceOp};
use dckpt_storage::{Storage, WriterOptions};
use serde::{Deserialize, Serialize};

use crate::protocol::{agree, in_phase};
use crate::save::SaveState;
use crate::{Error, ErrorKind, Result};
use part::{
    Manifest, PieceId, SendBuffers, StreamCheck, data_name, done_name, manifest_of, meta_name, state_pieces, step_dir,
};

pub use restore::{LocalRestoreOptions, LocalRestoreOutcome, LocalStepInfo, restore_local, scan_local};
pub use retain::gc_local;
use retain::retain;

/// Where the copies of each rank's part go: ranks are grouped into nodes of
/// `ranks_per_node` consecutive ranks (torchrun's order), and rank `r`'s copies go to the
/// ranks at the same place on the next `copies - 1` nodes, so that no node holds two copies
/// of one part and losing one node loses at most one copy of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Ranks per node; the world must be a whole number of nodes.
    pub ranks_per_node: usize,
    /// Copies of each part, its own rank's included (at least 1, at most the nodes).
    pub copies: usize,
}

impl Placement {
    /// Refuses a placement that does not fit `world`, naming why.
    pub fn check(&self, world: usize) -> Result<()> {
        let rpn = self.ranks_per_node;
        if rpn == 0 || !world.is_multiple_of(rpn) {
            return Err(Error::invalid_options(format!(
                "local tier: {rpn} ranks per node do not divide the world of {world} ranks"
            )));
        }
        let nodes = world / rpn;
        if self.copies == 0 || self.copies > nodes {
            return Err(Error::invalid_options(format!(
                "local tier: {} copies of each part need as many nodes, and the job has {nodes} ({world} ranks, \
                 {rpn} per node)",
                self.copies
            )));
        }
        Ok(())
    }

    /// The node of `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.ranks_per_node.max(1)
    }

    /// The ranks that hold copies of `rank`'s part, besides `rank` itself.
    pub fn holders(&self, rank: usize, world: usize) -> Vec<usize> {
        self.shifted(rank, world, |node, k, nodes| (node + k) % nodes)
    }

    /// The ranks whose part `rank` holds a copy of.
    pub fn sources(&self, rank: usize, world: usize) -> Vec<usize> {
        self.shifted(rank, world, |node, k, nodes| (node + nodes - k) % nodes)
    }

    fn shifted(&self, rank: usize, world: usize, to: impl Fn(usize, usize, usize) -> usize) -> Vec<usize> {
        let rpn = self.ranks_per_node.max(1);
        let nodes = (world / rpn).max(1);
        let (node, at) = (rank / rpn, rank % rpn);
        (1..self.copies.min(nodes)).map(|k| to(node, k, nodes) * rpn + at).collect()
    }
}

/// How one local step is saved.
#[derive(Debug, Clone)]
pub struct LocalSaveOptions {
    /// The step.
    pub step: u64,
    /// Where the copies go.
    pub placement: Placement,
    /// Complete local steps each rank keeps (the new one included; at least 1).
    pub keep: usize,
    /// The largest message of the transfer to peers.
    pub chunk_bytes: usize,
    /// The run the step belongs to (the run manager passes its run root's location): a
    /// restore takes only steps of the run it is given, never another run's left in the
    /// same node directories.
    pub run: String,
    /// As [`SaveOptions::caller_failed`](crate::SaveOptions::caller_failed): this rank's
    /// caller failed to make its part, and the save fails on every rank in its first round.
    pub caller_failed: Option<String>,
    /// What becomes of a step that every rank holds marked complete for this run, in this
    /// world. A step only some ranks marked (a save that failed as it ended) is saved again
    /// whatever this says.
    pub if_whole: IfWhole,
}

/// What a local save does with a step that is already whole ([`LocalSaveOptions::if_whole`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum IfWhole {
    /// Refuses it on every rank ([`ErrorKind::AlreadyExists`], rank 0's marker named), as a
    /// committed checkpoint is.
    #[default]
    Refuse,
    /// Keeps it as it is, and this tier saves nothing ([`LocalSaveOutcome::kept`]): a step
    /// saved again because its save to the run root failed after this tier's.
    Keep,
    /// Saves it again. Its markers go before any part is rewritten, so a save that then
    /// fails leaves no step where a whole one was.
    Replace,
}

impl LocalSaveOptions {
    /// Step `step` with `placement`, keeping 1 step, in messages of 8 MiB, of no named run.
    pub fn new(step: u64, placement: Placement) -> LocalSaveOptions {
        LocalSaveOptions {
            step,
            placement,
            keep: 1,
            chunk_bytes: 8 << 20,
            run: String::new(),
            caller_failed: None,
            if_whole: IfWhole::Refuse,
        }
    }
}

/// A complete local step, the same on every rank except the byte counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LocalSaveOutcome {
    /// The step.
    pub step: u64,
    /// Bytes of this rank's part.
    pub bytes: u64,
    /// Bytes this rank received from peers (the copies it holds of their parts).
    pub received_bytes: u64,
    /// Older local steps this rank removed (retention).
    pub removed: Vec<u64>,
    /// Seconds the save took on this rank.
    pub seconds: f64,
    /// Whether the step was whole already and kept as it was ([`IfWhole::Keep`]): nothing
    /// was written, sent or removed.
    #[serde(default)]
    pub kept: bool,
}

/// A rank's completion marker: the parts its node directory holds for this step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Done {
    step: u64,
    world: u32,
    parts: Vec<u32>,
    /// The run the step is of ([`LocalSaveOptions::run`]): retention reads it here rather
    /// than from a manifest that lists every piece. Absent in markers before runs were named.
    #[serde(default)]
    run: String,
}

/// Saves `state` as this rank's part of local step `opts.step` under `dir` (this rank's
/// node-local storage), with its copies on peers; collective. Returns once every part has
/// all its copies and every rank has marked the step complete.
pub fn save_local(
    coll: &dyn Collective,
    dir: &dyn Storage,
    state: &SaveState<'_>,
    opts: &LocalSaveOptions,
) -> Result<LocalSaveOutcome> {
    let started = Instant::now();
    let (rank, world, step) = (coll.rank(), coll.world_size(), opts.step);
    let Some(save) = begin(coll, dir, state, opts)? else {
        let seconds = started.elapsed().as_secs_f64();
        return Ok(LocalSaveOutcome { step, bytes: 0, received_bytes: 0, removed: Vec::new(), seconds, kept: true });
    };
    // A step saved again must not look complete while its parts are rewritten, so a rank
    // drops its old marker before it writes any part into its directory; and only now that
    // every rank has agreed to go on, so that a save refused in the first round (a caller's
    // failure on any rank) leaves a step saved before complete. A rank that cannot drop its
    // marker writes nothing, and the save fails on every rank at the copies' agreement.
    let unmarked = match dir.delete(&done_name(step, rank)) {
        Ok(()) | Err(dckpt_storage::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(Error::from(e)),
    };
    let writable = unmarked.is_ok();
    let pieces = state_pieces(state);
    let manifest = manifest_of(step, rank, world, &pieces, (save, &opts.run));
    // This rank's own copy is written beside the transfer to its peers (storage only on
    // that thread; every collective call stays on this one).
    let (own, copies) = crate::threads::beside(
        || unmarked.and_then(|()| write_own(dir, &manifest, &pieces)),
        || replicate(coll, dir, &manifest, &pieces, opts, writable),
    );
    let own = own.unwrap_or_else(|_| Err(Error::internal("the local save's writer thread panicked")));
    let received_bytes = *copies.as_ref().unwrap_or(&0);
    agree(coll, own.and(copies.map(drop)), "local save: copies")?;
    let mut parts = vec![rank as u32];
    parts.extend(opts.placement.sources(rank, world).into_iter().map(|r| r as u32));
    let done = Done { step, world: world as u32, parts, run: opts.run.clone() };
    let marked = dir.put(&done_name(step, rank), crate::protocol::encode(&done).into()).map_err(Error::from);
    // A save that failed on every rank leaves no marker on any: a part whose only marked
    // holder is this rank would otherwise still restore, and retention count the step.
    agree(coll, marked, "local save: complete").inspect_err(|_| {
        let _ = dir.delete(&done_name(step, rank));
    })?;
    let removed = retain(dir, rank, world, step, opts.placement, opts.keep, &opts.run);
    let seconds = started.elapsed().as_secs_f64();
    Ok(LocalSaveOutcome { step, bytes: manifest.data_bytes(), received_bytes, removed, seconds, kept: false })
}

/// The save's first round: the ranks agree to begin, the coordinator naming this save of
/// the step, or to keep the step as it is (`None`), or refuse it ([`IfWhole`]).
fn begin(
    coll: &dyn Collective,
    dir: &dyn Storage,
    state: &SaveState<'_>,
    opts: &LocalSaveOptions,
) -> Result<Option<u64>> {
    let (rank, world, step) = (coll.rank(), coll.world_size(), opts.step);
    let status = Error::caller_failed(&opts.caller_failed)
        .and(opts.placement.check(world))
        .and_then(|()| held(dir, (rank, world), state, opts))
        .map(|h| (h, (opts.if_whole, step, opts.placement, opts.run.clone())));
    crate::protocol::gather_decide(coll, status, "local save: options", |all| {
        let (held, asked): (Vec<Held>, Vec<Asked>) = crate::error::first_failure(all)?.into_iter().unzip();
        // Each rank decides what it reads by what it was asked: one asked otherwise would
        // have its step saved again, or kept, without a word; one given another step
        // unmarked its part of that step, one given another run wrote parts no restore of
        // either run takes, one given another placement waited for copies never sent.
        if let Some(r) = asked.iter().position(|a| *a != asked[0]) {
            let ((w0, s0, p0, run0), (w, s, p, run)) = (&asked[0], &asked[r]);
            let what = if s != s0 {
                format!("step {s}, rank 0 step {s0}")
            } else if run != run0 {
                format!("run {run:?}, rank 0 run {run0:?}")
            } else if p != p0 {
                format!("{p:?}, rank 0 {p0:?}")
            } else {
                format!("{w:?} of a whole local step, rank 0 {w0:?}")
            };
            return Err(Error::invalid_options(format!(
                "local save: rank {r} asks {what}: every rank must ask the same"
            )));
        }
        // Names rank `r`'s marker: the step is whole there, the save would write over it. It
        // lies in that rank's node directory, which this rank's storage does not name.
        let refused = |r: usize| {
            let location = match r == rank {
                true => dir.location(&done_name(step, r)),
                false => format!("{} in rank {r}'s node directory", done_name(step, r)),
            };
            Err(Error::new(ErrorKind::AlreadyExists { location }).on_rank(r as u32))
        };
        if held.contains(&Held::Not) {
            return Ok(Some(crate::save::random_u64()));
        }
        match opts.if_whole {
            // Every rank holds a marker: the coordinator names its own.
            IfWhole::Refuse | IfWhole::Replace => refused(rank),
            // Kept only where every part is of one save and holds the state's pieces; other
            // contents under the same step are not a retry, and a step is saved once.
            IfWhole::Keep => match held.iter().position(|h| *h != held[0] || !matches!(h, Held::Same(_))) {
                None => Ok(None),
                Some(r) => refused(r),
            },
        }
    })?
}

/// What a rank asks of a local save, which every rank must ask alike ([`begin`]): what to
/// do with a whole step, the step, the placement and the run.
type Asked = (IfWhole, u64, Placement, String);

/// What a rank holds of the step a save is about to write ([`begin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Held {
    /// No marker of this step for this run and world, or (for [`IfWhole::Keep`]) a part
    /// that is not all there: the step is saved again.
    Not,
    /// Its marker; its own part, of save `0`, holds the state's pieces byte for byte
    /// (looked at only for [`IfWhole::Keep`]).
    Same(u64),
    /// Its marker, and a part that differs or was not looked at.
    Other,
}

/// What this rank holds of step `opts.step` ([`Held`]). A marker that is not there or does
/// not decode marks nothing, nor one of another world (a layout this one cannot restore).
/// One that cannot be read fails the save on every rank: the step may be whole, and a save
/// that began would unmark it. Only a step kept if whole has its own part compared with
/// `state` ([`own_part`]).
fn held(
    dir: &dyn Storage,
    (rank, world): (usize, usize),
    state: &SaveState<'_>,
    opts: &LocalSaveOptions,
) -> Result<Held> {
    let step = opts.step;
    if opts.if_whole == IfWhole::Replace {
        return Ok(Held::Not); // saved again whatever it holds: nothing to read
    }
    let marker = present(dir.get(&done_name(step, rank)))?;
    let Some(done) = marker.and_then(|b| crate::protocol::decode::<Done>(&b, "local-tier marker").ok()) else {
        return Ok(Held::Not);
    };
    if !run_matches(&done.run, &opts.run) {
        // Not refused: this run could not save its step at all. Said, as the other run's
        // step, perhaps its newest, is gone from here once this save begins.
        log::warn!(
            "local tier: step {step} in {} is run {:?}'s, and this save of run {:?} writes over it: \
             give each run node-local directories of its own",
            dir.location(&step_dir(step)),
            done.run,
            opts.run
        );
        return Ok(Held::Not);
    }
    match opts.if_whole {
        _ if done.world as usize != world => Ok(Held::Not),
        IfWhole::Keep => own_part(dir, (rank, world), state, opts),
        IfWhole::Refuse | IfWhole::Replace => Ok(Held::Other),
    }
}

/// A marked step's own part against `state`, for [`IfWhole::Keep`]: its manifest's pieces,
/// lengths and CRC-32s (a pass over the state's bytes that the save would make anyway), and
/// its data file's length. A manifest or data file that is not there, does not decode or
/// is short is a part a restore would not take ([`Held::Not`]); one that cannot be read, an
/// error, as for the marker.
fn own_part(
    dir: &dyn Storage,
    (rank, world): (usize, usize),
    state: &SaveState<'_>,
    opts: &LocalSaveOptions,
) -> Result<Held> {
    let (step, meta) = (opts.step, meta_name(opts.step, rank));
    let stored = present(dir.get(&meta))?.and_then(|b| Manifest::decode(&b, &dir.location(&meta)).ok());
    let Some(stored) = stored.filter(|m| (m.step, m.rank as usize, m.world as usize) == (step, rank, world)) else {
        return Ok(Held::Not);
    };
    if present(dir.size(&data_name(step, rank)))? != Some(stored.data_bytes()) {
        return Ok(Held::Not);
    }
    let mine = manifest_of(step, rank, world, &state_pieces(state), (0, &opts.run));
    let same = |(a, b): (&part::Entry, &part::Entry)| (&a.id, a.len, a.crc) == (&b.id, b.len, b.crc);
    match stored.entries.len() == mine.entries.len() && stored.entries.iter().zip(&mine.entries).all(same) {
        true => Ok(Held::Same(stored.save)),
        false => Ok(Held::Other),
    }
}

/// What a read found: `None` where there is nothing, the error where it could not look.
fn present<T>(read: dckpt_storage::Result<T>) -> Result<Option<T>> {
    match read {
        Ok(v) => Ok(Some(v)),
        Err(dckpt_storage::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(Error::from(e)),
    }
}

/// Whether a part saved for run `saved` belongs to run `asked`; unnamed matches any.
pub(crate) fn run_matches(saved: &str, asked: &str) -> bool {
    saved.is_empty() || asked.is_empty() || saved == asked
}

/// Removes this rank's markers of `run`'s local steps under `dir` newer than `after`, the
/// step the run resumed from (`None`: it resumed from nothing, every step): that branch is
/// abandoned (its steps are saved again from there on), and a marker left behind made
/// [`gc_local`] keep such a step as the newest complete one and remove the run's own steps
/// below it. Another run's steps are left as they are. Best effort, as retention is: a
/// marker that cannot be removed stays, with a warning. The steps unmarked.
pub fn unmark_newer(dir: &dyn Storage, rank: usize, after: Option<u64>, run: &str) -> Vec<u64> {
    let steps = match restore::local_steps(dir, rank, run) {
        Ok(s) => s,
        Err(e) => {
            log::warn!("local tier: rank {rank} could not list its steps to unmark the abandoned ones: {e}");
            return Vec::new();
        }
    };
    let mut unmarked = Vec::new();
    for (s, marked) in steps {
        if after.is_some_and(|a| s <= a) || marked.is_none() {
            continue;
        }
        match dir.delete(&done_name(s, rank)) {
            Ok(()) => unmarked.push(s),
            Err(e) => log::warn!("local tier: rank {rank} could not unmark its abandoned step {s}: {e}"),
        }
    }
    unmarked
}

/// This rank's own copy: the data, then its manifest.
fn write_own(dir: &dyn Storage, manifest: &Manifest, pieces: &[(PieceId, &[u8])]) -> Result<()> {
    let (step, rank) = (manifest.step, manifest.rank as usize);
    let size_hint_bytes = Some(manifest.data_bytes());
    let mut w = dir.writer(&data_name(step, rank), &WriterOptions { size_hint_bytes })?;
    for batch in pieces.chunks(64) {
        let bufs: Vec<&[u8]> = batch.iter().map(|p| p.1).collect();
        if let Err(e) = w.write_vectored(&bufs) {
            let _ = w.abort();
            return Err(e.into());
        }
    }
    w.finish()?;
    dir.put(&meta_name(step, rank), manifest.encode().into())?;
    Ok(())
}

/// Sends this rank's part to its holders and writes the parts of its sources, checked as
/// they arrive (none where `writable` is false: this rank's marker stayed); the bytes
/// received. Every rank takes part in every round even after a failure of its own, so that
/// none waits for it; the first failure is returned.
fn replicate(
    coll: &dyn Collective,
    dir: &dyn Storage,
    manifest: &Manifest,
    pieces: &[(PieceId, &[u8])],
    opts: &LocalSaveOptions,
    writable: bool,
) -> Result<u64> {
    let (rank, world) = (coll.rank(), coll.world_size());
    let (holders, sources) = (opts.placement.holders(rank, world), opts.placement.sources(rank, world));
    let chunk = opts.chunk_bytes.max(1) as u64;
    let rounds = coll
        .all_reduce_u64(&[manifest.data_bytes().div_ceil(chunk)], ReduceOp::Max)
        .map_err(in_phase("local save: copies"))?[0];
    let encoded = bytes::Bytes::from(manifest.encode());
    let sends = holders.iter().map(|&h| (h, encoded.clone())).collect();
    let got = coll.exchange(sends, &sources).map_err(in_phase("local save: copies"))?;
    let mut incoming: BTreeMap<usize, Result<Incoming>> = BTreeMap::new();
    for (&s, bytes) in sources.iter().zip(got) {
        let open = match writable {
            true => Incoming::open(dir, s, &bytes, opts.step),
            false => Err(Error::internal("not written: this rank's old marker of the step stayed")),
        };
        incoming.insert(s, open);
    }
    let mut cursor = Cursor::new(pieces);
    let (mut received, mut left) = (0u64, manifest.data_bytes());
    let mut buffers = SendBuffers::default();
    for _ in 0..rounds {
        // One buffer for every holder, rounds after rounds the same few buffers.
        let n = left.min(chunk) as usize;
        left -= n as u64;
        let mut buf = buffers.take(n);
        cursor.fill(&mut buf);
        let mine = buffers.sent(buf.freeze());
        let sends = holders.iter().map(|&h| (h, mine.clone())).collect();
        let got = coll.exchange(sends, &sources).map_err(in_phase("local save: copies"))?;
        for (s, bytes) in sources.iter().zip(got) {
            received += bytes.len() as u64;
            if let Some(Ok(inc)) = incoming.get_mut(s)
                && let Err(e) = inc.feed(&bytes)
            {
                incoming.insert(*s, Err(e));
            }
        }
    }
    for (_, inc) in incoming {
        inc?.finish(dir)?;
    }
    Ok(received)
}

/// A peer's part being written here.
struct Incoming {
    check: StreamCheck,
    writer: Box<dyn dckpt_storage::ObjectWriter>,
    manifest_bytes: Vec<u8>,
}

impl Incoming {
    fn open(dir: &dyn Storage, source: usize, manifest_bytes: &[u8], step: u64) -> Result<Incoming> {
        let file = dir.location(&data_name(step, source));
        let manifest = Manifest::decode(manifest_bytes, &file)?;
        if manifest.step != step || manifest.rank as usize != source {
            let detail = format!("rank {source} sent the manifest of rank {} step {}", manifest.rank, manifest.step);
            return Err(Error::protocol(detail));
        }
        let size_hint_bytes = Some(manifest.data_bytes());
        let writer = dir.writer(&data_name(step, source), &WriterOptions { size_hint_bytes })?;
        Ok(Incoming { check: StreamCheck::new(manifest, file), writer, manifest_bytes: manifest_bytes.to_vec() })
    }

    fn feed(&mut self, bytes: &[u8]) -> Result<()> {
        self.check.feed(bytes, |_, _, _| {})?;
        self.writer.write(bytes)?;
        Ok(())
    }

    fn finish(self, dir: &dyn Storage) -> Result<()> {
        let (step, rank) = (self.check.manifest().step, self.check.manifest().rank as usize);
        self.check.finish()?;
        self.writer.finish()?;
        dir.put(&meta_name(step, rank), self.manifest_bytes.into())?;
        Ok(())
    }
}

/// The next bytes of a part, piece after piece.
struct Cursor<'p, 'd> {
    pieces: &'p [(PieceId, &'d [u8])],
    piece: usize,
    at: usize,
}

impl<'p, 'd> Cursor<'p, 'd> {
    fn new(pieces: &'p [(PieceId, &'d [u8])]) -> Self {
        Cursor { pieces, piece: 0, at: 0 }
    }

    /// Fills `out` with the next bytes (the caller asks for no more than are left).
    fn fill(&mut self, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let Some((_, data)) = self.pieces.get(self.piece) else { break };
            let now = (out.len() - done).min(data.len() - self.at);
            out[done..done + now].copy_from_slice(&data[self.at..self.at + now]);
            done += now;
            self.at += now;
            if self.at == data.len() {
                self.piece += 1;
                self.at = 0;
            }
        }
    }
}
