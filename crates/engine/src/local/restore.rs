//! Restoring a local step: the inventory and the coordinator's choice of step and sources
//! (see the module docs of `local`); each attempt's reads and transfers are `attempt.rs`.

use std::collections::{BTreeMap, BTreeSet};

use dckpt_collective::Collective;
use dckpt_storage::Storage;
use serde::{Deserialize, Serialize};

use super::Done;
use super::attempt::attempt_once;
use super::part::{Manifest, data_name, done_name, fingerprint, meta_name, parse_step_dir, request_pieces};
use crate::load::LoadRequest;
use crate::protocol::{for_every_rank, gather_decide_each};
use crate::{Error, Result};

/// How a local step is restored.
#[derive(Debug, Clone)]
pub struct LocalRestoreOptions {
    /// Only steps at least this new are considered (the newest persistent step: an older
    /// local step is never preferred to it).
    pub min_step: Option<u64>,
    /// Only steps older than this are considered: where a newer one was found not whole, an
    /// older whole one still restores (`None`: no bound).
    pub below: Option<u64>,
    /// The largest message of a transfer from a peer.
    pub chunk_bytes: usize,
    /// The run whose steps are restored ([`super::LocalSaveOptions::run`]); a part saved
    /// for another run is passed over, with a reason.
    pub run: String,
    /// As [`LoadOptions::caller_failed`](crate::LoadOptions::caller_failed): this rank's
    /// caller failed to make its request, and the restore fails on every rank in its first
    /// round (not passed over to the persistent tier: the caller has nothing to load into).
    pub caller_failed: Option<String>,
}

impl Default for LocalRestoreOptions {
    fn default() -> Self {
        LocalRestoreOptions {
            min_step: None,
            below: None,
            chunk_bytes: 8 << 20,
            run: String::new(),
            caller_failed: None,
        }
    }
}

/// What a local restore did, the same on every rank except the byte counts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalRestoreOutcome {
    /// The local step restored from; `None` when no step is whole here (nothing was read
    /// into the request).
    pub step: Option<u64>,
    /// Ranks whose part came from their own copy.
    pub own: u64,
    /// Ranks whose part came from a peer's copy.
    pub peer: u64,
    /// Ranks whose part no copy could give (every copy missing or damaged): the caller
    /// loads them from elsewhere.
    pub failed: Vec<u32>,
    /// Why each fallback happened: a newer step skipped, a copy that failed.
    pub reasons: Vec<String>,
    /// The run's steps some rank marked complete (at or after the least step asked for)
    /// that could not be restored whole here, newest first: a checkpoint that another
    /// launch (its nodes back, its layout) may still restore.
    pub not_whole: Vec<u64>,
    /// Bytes this rank read from its node's storage.
    pub bytes_read: u64,
    /// Bytes this rank received from peers.
    pub bytes_received: u64,
}

/// What a rank holds: for each step it marked complete, each part with its fingerprint.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Inventory {
    want: u64,
    held: Vec<Held>,
    notes: Vec<String>,
    failed: Option<String>,
    /// The rank's request has an object check ([`LoadRequest::check_objects`]).
    checks: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Held {
    step: u64,
    /// The save of the step it is of (see [`Manifest::save`]).
    save: u64,
    world: u32,
    part: u32,
    fingerprint: u64,
}

/// One attempt, as each rank receives it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct Attempt {
    pub(super) step: Option<u64>,
    /// The save of that step every part read must be of.
    pub(super) save: u64,
    /// Where this rank's part comes from in this attempt (`None`: not in this attempt).
    pub(super) source: Option<u32>,
    /// (part, to): the copies this rank sends.
    pub(super) serve: Vec<(u32, u32)>,
    rounds: u64,
    /// Set when no attempt is left: the outcome.
    done: Option<LocalRestoreOutcome>,
    /// In the first attempt: some rank checks its objects, so every rank agrees on the
    /// checks once the parts are restored.
    checks: bool,
}

/// The steps under `dir` (ascending) with the parts this rank's marker lists, `None` for a
/// step it did not mark complete (or whose marker does not decode); a step this rank marked
/// for another run than `run` is left out (see [`super::run_matches`]).
pub(super) fn local_steps(dir: &dyn Storage, rank: usize, run: &str) -> Result<Vec<(u64, Option<Vec<usize>>)>> {
    let mut steps: BTreeMap<u64, Option<Vec<usize>>> = BTreeMap::new();
    for info in dir.list("")? {
        let Some(step) = info.path.split('/').next().and_then(parse_step_dir) else { continue };
        steps.entry(step).or_insert(None);
    }
    let mut other_runs = Vec::new();
    for (step, held) in steps.iter_mut() {
        let Ok(bytes) = dir.get(&done_name(*step, rank)) else { continue };
        if let Ok(done) = crate::protocol::decode::<Done>(&bytes, "local-tier marker") {
            if !super::run_matches(&done.run, run) {
                other_runs.push(*step);
            }
            *held = Some(done.parts.into_iter().map(|p| p as usize).collect());
        }
    }
    Ok(steps.into_iter().filter(|(s, _)| !other_runs.contains(s)).collect())
}

/// One local step as a node's directory holds it (what `dckpt ls --local` shows).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalStepInfo {
    /// The step.
    pub step: u64,
    /// The ranks whose parts (own or copies) lie here, with their manifests.
    pub parts: Vec<u32>,
    /// The ranks here that marked the step complete.
    pub marked_by: Vec<u32>,
    /// The world the parts were saved by, from a marker (`None`: no marker here).
    pub world: Option<u32>,
    /// Bytes of the step's files here.
    pub bytes: u64,
}

/// The local steps under one node's directory, ascending; a directory that does not exist
/// holds none.
pub fn scan_local(dir: &dyn Storage) -> Result<Vec<LocalStepInfo>> {
    let mut steps: BTreeMap<u64, LocalStepInfo> = BTreeMap::new();
    for info in dir.list("")? {
        let mut at = info.path.splitn(2, '/');
        let (Some(step), Some(name)) = (at.next().and_then(parse_step_dir), at.next()) else { continue };
        let s = steps.entry(step).or_insert_with(|| LocalStepInfo {
            step,
            parts: Vec::new(),
            marked_by: Vec::new(),
            world: None,
            bytes: 0,
        });
        s.bytes += info.size;
        if let Some(r) = name.strip_prefix("part-").and_then(|n| n.strip_suffix(".meta")).and_then(|r| r.parse().ok()) {
            s.parts.push(r);
        }
        if let Some(h) = name.strip_prefix("done-").and_then(|r| r.parse::<u32>().ok()) {
            s.marked_by.push(h);
            if let Ok(done) =
                dir.get(&info.path).map_err(Error::from).and_then(|b| crate::protocol::decode::<Done>(&b, "marker"))
            {
                s.world = Some(done.world);
            }
        }
    }
    let mut out: Vec<LocalStepInfo> = steps.into_values().collect();
    for s in &mut out {
        s.parts.sort_unstable();
        s.marked_by.sort_unstable();
    }
    Ok(out)
}

fn inventory(dir: &dyn Storage, rank: usize, want: u64, run: &str) -> Inventory {
    let mut inv = Inventory { want, held: Vec::new(), notes: Vec::new(), failed: None, checks: false };
    // Every run's steps: a part of another run is passed over below, with the reason.
    let steps = match local_steps(dir, rank, "") {
        Ok(s) => s,
        Err(e) => {
            inv.notes.push(format!("rank {rank}: its node-local directory cannot be listed: {e}"));
            return inv;
        }
    };
    for (step, parts) in steps {
        for part in parts.unwrap_or_default() {
            let file = dir.location(&meta_name(step, part));
            let read = dir.get(&meta_name(step, part)).map_err(Error::from);
            match read.and_then(|b| Manifest::decode(&b, &file)) {
                Ok(m) if !super::run_matches(&m.run, run) => inv.notes.push(format!(
                    "rank {rank}: step {step}: its copy of rank {part}'s part belongs to run {:?}, not {run:?}",
                    m.run
                )),
                Ok(m) => match dir.size(&data_name(step, part)) {
                    Ok(n) if n == m.data_bytes() => {
                        let (world, fingerprint) = (m.world, m.fingerprint);
                        inv.held.push(Held { step, save: m.save, world, part: part as u32, fingerprint });
                    }
                    got => inv.notes.push(format!(
                        "rank {rank}: step {step}: its copy of rank {part}'s part has {} bytes of data, not {}",
                        got.map_or_else(|e| e.to_string(), |n| n.to_string()),
                        m.data_bytes()
                    )),
                },
                Err(e) => inv.notes.push(format!("rank {rank}: step {step}: its copy of rank {part}'s part: {e}")),
            }
        }
    }
    inv
}

/// The coordinator's state over the attempts of one restore.
#[derive(Default)]
struct Coordinator {
    step: Option<u64>,
    save: u64,
    /// Per rank: the holders of a good copy of its part not tried yet (own first).
    left: Vec<Vec<usize>>,
    /// Per rank: the source of the current attempt.
    current: Vec<Option<usize>>,
    outcome: LocalRestoreOutcome,
}

impl Coordinator {
    fn first(&mut self, all: Vec<Inventory>, opts: &LocalRestoreOptions) -> Vec<Attempt> {
        let world = all.len();
        self.outcome.reasons.extend(all.iter().flat_map(|i| i.notes.iter().cloned()));
        // (step, save) -> part -> holders with the right pieces: one save's parts only
        let mut copies: BTreeMap<(u64, u64), Vec<Vec<usize>>> = BTreeMap::new();
        let mut wrong: BTreeMap<(u64, u64), BTreeSet<usize>> = BTreeMap::new();
        let mut other_worlds: BTreeMap<u64, u32> = BTreeMap::new();
        for (holder, inv) in all.iter().enumerate() {
            for h in &inv.held {
                if opts.min_step.is_some_and(|m| h.step < m) || opts.below.is_some_and(|b| h.step >= b) {
                    continue;
                }
                if h.world as usize != world || h.part as usize >= world {
                    other_worlds.insert(h.step, h.world);
                    continue;
                }
                let part = h.part as usize;
                if h.fingerprint == all[part].want {
                    copies.entry((h.step, h.save)).or_insert_with(|| vec![Vec::new(); world])[part].push(holder);
                } else {
                    wrong.entry((h.step, h.save)).or_default().insert(part);
                }
            }
        }
        for (step, w) in other_worlds.iter().rev() {
            if !copies.keys().any(|k| k.0 == *step) {
                self.outcome.not_whole.push(*step);
                self.outcome
                    .reasons
                    .push(format!("local step {step} was saved by {w} ranks and this job has {world} (a new layout)"));
            }
        }
        let saves: BTreeSet<(u64, u64)> = copies.keys().chain(wrong.keys()).copied().collect();
        let mut noted = BTreeSet::new();
        for &(step, save) in saves.iter().rev() {
            let parts = copies.remove(&(step, save)).unwrap_or_else(|| vec![Vec::new(); world]);
            let of_step = saves.iter().filter(|k| k.0 == step).count();
            if of_step > 1 && noted.insert(step) {
                self.outcome.reasons.push(format!(
                    "local step {step} holds parts of {of_step} saves of it (saved again after a restart, on \
                     nodes numbered otherwise?): a restore takes one save's parts only"
                ));
            }
            let lost: Vec<usize> = (0..world).filter(|&r| parts[r].is_empty()).collect();
            if lost.is_empty() {
                let homeless: Vec<usize> = (0..world).filter(|&r| !parts[r].contains(&r)).collect();
                if !homeless.is_empty() {
                    self.outcome.reasons.push(format!(
                        "local step {step}: ranks {} hold no good copy of their own part (a node's directory \
                         lost?); they restore from peers",
                        some_ranks(&homeless)
                    ));
                }
                self.step = Some(step);
                self.save = save;
                self.left = parts.iter().enumerate().map(|(r, h)| own_first(r, h)).collect();
                return self.plan(world);
            }
            let why = match wrong.get(&(step, save)) {
                Some(w) if lost.iter().any(|r| w.contains(r)) => {
                    "hold other pieces than they ask for now (a new layout)"
                }
                _ => "have no copy left",
            };
            let lost = some_ranks(&lost);
            self.outcome.reasons.push(format!("local step {step} is not whole: the parts of ranks {lost} {why}"));
            self.outcome.not_whole.push(step);
        }
        self.outcome.reasons.push("no whole local step".into());
        self.finish(world)
    }

    /// The next attempt for every rank whose part is not restored yet and has a copy left.
    fn plan(&mut self, world: usize) -> Vec<Attempt> {
        let mut load = vec![0usize; world];
        self.current = vec![None; world];
        for r in 0..world {
            if self.left[r].is_empty() {
                continue;
            }
            let pick = if self.left[r][0] == r {
                0
            } else {
                (0..self.left[r].len()).min_by_key(|&i| load[self.left[r][i]]).unwrap_or(0)
            };
            let source = self.left[r].remove(pick);
            load[source] += 1;
            self.current[r] = Some(source);
        }
        if self.current.iter().all(Option::is_none) {
            return self.finish(world);
        }
        let mut attempts: Vec<Attempt> =
            (0..world).map(|_| Attempt { step: self.step, save: self.save, ..Attempt::default() }).collect();
        for (r, s) in self.current.iter().enumerate() {
            let Some(s) = *s else { continue };
            attempts[r].source = Some(s as u32);
            if s != r {
                attempts[s].serve.push((r as u32, r as u32));
            }
        }
        attempts
    }

    fn next(&mut self, all: Vec<std::result::Result<(), String>>) -> Vec<Attempt> {
        let world = all.len();
        for (r, status) in all.into_iter().enumerate() {
            let Some(source) = self.current[r] else { continue };
            match status {
                Ok(()) if source == r => {
                    self.outcome.own += 1;
                    self.left[r].clear();
                }
                Ok(()) => {
                    self.outcome.peer += 1;
                    self.left[r].clear();
                }
                Err(e) => {
                    let whose = if source == r { "its own copy".to_string() } else { format!("rank {source}'s copy") };
                    self.outcome.reasons.push(format!("rank {r}: {whose} failed: {e}"));
                    if self.left[r].is_empty() {
                        self.outcome.failed.push(r as u32);
                    }
                }
            }
        }
        self.plan(world)
    }

    fn finish(&mut self, world: usize) -> Vec<Attempt> {
        self.outcome.step = self.step;
        // Newest first, each once, whether or not a whole step was found after them.
        self.outcome.not_whole.sort_unstable_by(|a, b| b.cmp(a));
        self.outcome.not_whole.dedup();
        for reason in &self.outcome.reasons {
            log::warn!("local tier: {reason}");
        }
        // Every rank gets the outcome: with a note per part held (another run's steps on
        // every node) the reasons grow with the world, and all of them to every rank was the
        // world squared through this rank (about 200 GB at 16,384 ranks). This log has them;
        // the last, which sums the restore up, is kept.
        let reasons = &mut self.outcome.reasons;
        if reasons.len() > REASONS_SENT_MAX {
            let more = reasons.len() - (REASONS_SENT_MAX - 1);
            let last = reasons.pop().unwrap_or_default();
            reasons.truncate(REASONS_SENT_MAX - 2);
            reasons.push(format!("and {more} more reasons, each in rank 0's log"));
            reasons.push(last);
        }
        let done = Attempt { step: self.step, done: Some(self.outcome.clone()), ..Attempt::default() };
        vec![done; world]
    }
}

/// The most reasons a restore's outcome carries to every rank.
const REASONS_SENT_MAX: usize = 32;

/// Ranks for a reason: the first few, then how many more (a list of them all in a reason
/// every rank gets grew with the world, squared over the ranks).
fn some_ranks(ranks: &[usize]) -> String {
    const SHOWN: usize = 16;
    match ranks.len().checked_sub(SHOWN) {
        Some(more) if more > 0 => format!("{:?} and {more} more", &ranks[..SHOWN]),
        _ => format!("{ranks:?}"),
    }
}

fn own_first(rank: usize, holders: &[usize]) -> Vec<usize> {
    let mut h: Vec<usize> = holders.to_vec();
    h.sort_by_key(|&x| (x != rank, x));
    h
}

/// Restores this rank's part of the newest whole local step under `dir` (this rank's
/// node-local storage) into `req`; collective. Parts no copy could give are listed in the
/// outcome's `failed` (their requests hold no defined bytes), for the caller to load from
/// the persistent tier; with no whole step, `step` is `None`.
pub fn restore_local(
    coll: &dyn Collective,
    dir: &dyn Storage,
    req: &mut LoadRequest<'_>,
    opts: &LocalRestoreOptions,
) -> Result<LocalRestoreOutcome> {
    let rank = coll.rank();
    let want = fingerprint(&request_pieces(req));
    let mut coord = Coordinator::default();
    let checks = req.check_objects.is_some();
    let inv = Inventory { failed: opts.caller_failed.clone(), checks, ..inventory(dir, rank, want, &opts.run) };
    let first = gather_decide_each(coll, inv, "local restore: plan", |all| {
        let failed = all
            .iter()
            .enumerate()
            .find_map(|(r, i)| Error::caller_failed(&i.failed).err().map(|e| e.on_rank(r as u32)));
        let checks = all.iter().any(|i| i.checks);
        match failed {
            Some(e) => for_every_rank(e, all.len()),
            None => coord.first(all, opts).into_iter().map(|a| Ok(Attempt { checks, ..a })).collect(),
        }
    })?;
    let mut attempt: Attempt = first?;
    let checks = attempt.checks;
    let (mut read, mut received) = (0u64, 0u64);
    loop {
        if let Some(mut done) = attempt.done.take() {
            (done.bytes_read, done.bytes_received) = (read, received);
            if checks {
                // Only a rank whose part came back has objects to check.
                let restored = done.step.is_some() && !done.failed.contains(&(rank as u32));
                let status = if restored { req.run_check(rank) } else { Ok(()) };
                crate::protocol::agree(coll, status, "local restore: objects")?;
            }
            return Ok(done);
        }
        let mut counts = (0, 0);
        let status = attempt_once(coll, dir, req, &attempt, opts, &mut counts)?.map_err(|e| e.to_string());
        read += counts.0;
        received += counts.1;
        attempt = gather_decide_each(coll, status, "local restore: check", |all| coord.next(all))?;
    }
}
