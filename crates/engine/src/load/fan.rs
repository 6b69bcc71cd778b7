//! Read once, fan out: the coordinator's plan of which rank reads each stretch of the data
//! files that several ranks need, and whom it sends it to.
//!
//! Every rank's needs are the checksum-block-rounded stretches its copies read, plus the
//! header of every file it reads. A sweep over all ranks' needs, file by file, cuts them
//! into segments each needed by a constant set of ranks; a segment two or more ranks need
//! becomes units, each read by one rank of its set (the one with the fewest bytes to read
//! so far, which spreads the reads) and sent to the others over
//! [`Collective::exchange`](dckpt_collective::Collective::exchange), as is the header of
//! each file several ranks read (held for the whole load).
//!
//! Units go in rounds, so that what a rank holds at once (its units received, and those it
//! reads with a copy for each peer) stays near `round_bytes`; each rank's rounds follow its
//! file order, and its copies are cut where its round changes (at block boundaries of the
//! piece, which needs always are), so that each copy is read in the round that holds its
//! bytes. Copies of several rows (a column split) and those checked in parts with other
//! ranks are not fanned: their ranks read them as before.
//!
//! Nothing here is trusted: a receiver checks every byte against its checksum as if it had
//! read it, and reads from storage whatever it did not receive.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::plan::{PieceCopy, ReadPlan, whole_blocks};
use crate::format::Metadata;

/// The largest unit; messages pack units up to this size, far below a collective's
/// message bound.
pub(super) const SEGMENT_BYTES: u64 = 16 << 20;

/// A stretch of a data file one rank reads from storage for itself and for others.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Unit {
    pub(super) round: u32,
    /// Index into the plan's files (renumbered for each rank by `slice`).
    pub(super) file: u32,
    pub(super) at: u64,
    pub(super) len: u64,
    /// The rank that reads it from storage.
    pub(super) from: u32,
    /// On the reader, the ranks it sends the unit to; empty on a receiver.
    pub(super) to: Vec<u32>,
    /// A file's header, held for the whole load.
    pub(super) sticky: bool,
}

impl Unit {
    /// Whether it lies inside one of the plan's files: a rank sizes a buffer by each unit
    /// it reads and names the file of each unit it receives (a plan garbled on the way
    /// must fail the load, not panic a rank that the others wait for).
    pub(super) fn fits(&self, meta: &Metadata) -> bool {
        meta.files.get(self.file as usize).is_some_and(|f| self.at.checked_add(self.len).is_some_and(|e| e <= f.bytes))
    }
}

/// One rank's part in the fan-out.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct FanPlan {
    /// Exchange rounds, the same on every rank (0 when nothing is fanned out).
    pub(super) rounds: u32,
    /// The units this rank reads or receives, in the order both ends agree on.
    pub(super) units: Vec<Unit>,
    /// The round each of the plan's copies is read in.
    pub(super) copy_rounds: Vec<u32>,
}

/// A stretch one rank needs: `lo..hi` of file `file`, in the piece starting at `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Need {
    file: u32,
    lo: u64,
    hi: u64,
    base: u64,
}

/// Whether the fan-out reads this copy's bytes for its rank.
fn fanned(c: &PieceCopy) -> bool {
    c.rows == 1 && !c.shared
}

/// The stretches one rank reads, block-rounded in their pieces, merged; and the files it
/// reads. Where the store reads in place (`in_place`), only the whole blocks of a copy: a
/// block it needs part of is picked out of the store by the rank itself, so that ranks
/// taking different parts of one block (a row split's boundary) do not send it to each
/// other, which costs more than reading it in place.
fn needs_of(meta: &Metadata, plan: &ReadPlan<'_>, in_place: bool) -> (Vec<Need>, Vec<u32>) {
    let block = meta.block_bytes.max(1);
    let mut needs: Vec<Need> = Vec::with_capacity(plan.copies.len());
    for c in plan.copies.iter().filter(|c| fanned(c) && c.len > 0) {
        let p = &plan.pieces[c.piece];
        let (lo, hi) = match in_place {
            true => whole_blocks(c, p.len, block),
            false => (c.src / block * block, (c.src + c.len).div_ceil(block).saturating_mul(block).min(p.len)),
        };
        if lo < hi {
            needs.push(Need { file: p.file, lo: p.at + lo, hi: p.at + hi, base: p.at });
        }
    }
    needs.sort_unstable();
    let mut merged: Vec<Need> = Vec::with_capacity(needs.len());
    for n in needs {
        match merged.last_mut() {
            Some(m) if m.file == n.file && m.base == n.base && n.lo <= m.hi => m.hi = m.hi.max(n.hi),
            _ => merged.push(n),
        }
    }
    let mut files: Vec<u32> = plan.pieces.iter().map(|p| p.file).collect();
    files.sort_unstable();
    files.dedup();
    (merged, files)
}

/// A stretch needed by a constant set of ranks.
struct Segment {
    file: u32,
    lo: u64,
    hi: u64,
    base: u64,
    ranks: Vec<u32>,
}

/// Cuts all ranks' needs into segments of constant rank sets, in file order; only those
/// two or more ranks need.
fn sweep(mut events: Vec<(u32, u64, bool, u32, u64)>) -> Vec<Segment> {
    // (file, position, starts, rank, base): ends sort before starts at one position.
    events.sort_unstable();
    let mut active: BTreeSet<u32> = BTreeSet::new();
    let (mut out, mut at, mut base): (Vec<Segment>, (u32, u64), u64) = (Vec::new(), (0, 0), 0);
    for (file, pos, starts, rank, b) in events {
        if active.len() >= 2 && at.0 == file && at.1 < pos {
            let ranks: Vec<u32> = active.iter().copied().collect();
            match out.last_mut() {
                Some(s) if (s.file, s.hi, s.base) == (file, at.1, base) && s.ranks == ranks => s.hi = pos,
                _ => out.push(Segment { file, lo: at.1, hi: pos, base, ranks }),
            }
        }
        if starts {
            active.insert(rank);
            base = b;
        } else {
            active.remove(&rank);
        }
        at = (file, pos);
    }
    out
}

/// Per-rank bookkeeping of the rounds: each rank's current round and what it holds in it.
struct Rounds {
    budget: u64,
    current: Vec<u32>,
    fill: Vec<u64>,
}

impl Rounds {
    /// The round of a unit of `len` bytes that `reader` sends to the rest of `ranks`: the
    /// latest round any of them is in, or the next where it would overfill one of them.
    fn place(&mut self, ranks: &[u32], reader: u32, len: u64) -> u32 {
        let cost = |r: u32| if r == reader { reader_bytes(len, ranks.len() as u64) } else { len };
        let mut round = ranks.iter().map(|&r| self.current[r as usize]).max().unwrap_or(0);
        if ranks.iter().any(|&r| {
            let r_ = r as usize;
            self.current[r_] == round && self.fill[r_] > 0 && self.fill[r_] + cost(r) > self.budget
        }) {
            round += 1;
        }
        for &r in ranks {
            let r_ = r as usize;
            if self.current[r_] < round {
                (self.current[r_], self.fill[r_]) = (round, 0);
            }
            self.fill[r_] += cost(r);
        }
        round
    }
}

/// What a unit of `len` bytes that `n` ranks need costs the one that reads it: one buffer,
/// which every receiver's message shares, unless it is packed with other small units into
/// a message copied for each peer. Charged a copy for each peer whatever its size, a unit of
/// a block that thousands of replicas need overfilled every round alone: one unit a round,
/// thousands of rounds, each a full exchange.
fn reader_bytes(len: u64, n: u64) -> u64 {
    match len >= super::overlay::PACKED_BELOW {
        true => len,
        false => len.saturating_mul(n),
    }
}

/// Every rank's fan plan over `plans` (file indices into `meta`, copies' shared flags set);
/// cuts each rank's copies where its round changes. `round_bytes` bounds what a rank holds
/// in one round.
pub(super) fn plan_fan(meta: &Metadata, plans: &mut [ReadPlan<'_>], round_bytes: u64, in_place: bool) -> Vec<FanPlan> {
    let world = plans.len();
    let block = meta.block_bytes.max(1);
    let mut out: Vec<FanPlan> = (0..world).map(|_| FanPlan::default()).collect();
    let mut readers: Vec<Vec<u32>> = vec![Vec::new(); meta.files.len()];
    let mut events = Vec::new();
    for (r, plan) in plans.iter().enumerate() {
        let (needs, files) = needs_of(meta, plan, in_place);
        for f in files {
            readers[f as usize].push(r as u32);
        }
        for n in needs {
            events.push((n.file, n.lo, true, r as u32, n.base));
            events.push((n.file, n.hi, false, r as u32, n.base));
        }
    }
    let mut load = vec![0u64; world];
    // `round` places a unit given its reader; a header (held for the whole load) has none.
    let mut unit = |out: &mut [FanPlan],
                    ranks: &[u32],
                    file: u32,
                    at: u64,
                    len: u64,
                    round: &mut dyn FnMut(u32) -> Option<u32>| {
        let reader = *ranks.iter().min_by_key(|&&r| (load[r as usize], r)).expect("a rank needs it");
        load[reader as usize] += len;
        let (round, sticky) = round(reader).map_or((0, true), |r| (r, false));
        for &r in ranks {
            let to = if r == reader { ranks.iter().copied().filter(|&t| t != reader).collect() } else { Vec::new() };
            out[r as usize].units.push(Unit { round, file, at, len, from: reader, to, sticky });
        }
    };
    for (f, ranks) in readers.iter().enumerate().filter(|(_, r)| r.len() >= 2) {
        unit(&mut out, ranks, f as u32, 0, meta.files[f].data_start, &mut |_| None);
    }
    let mut rounds = Rounds { budget: round_bytes.max(1), current: vec![0; world], fill: vec![0; world] };
    for s in sweep(events) {
        // A segment is spread over its ranks; a unit its reader sends copied for each peer
        // (a small one) stays within about a round's bytes.
        let n = s.ranks.len() as u64;
        let even = (s.hi - s.lo).div_ceil(n).div_ceil(block) * block;
        let mut cut = (SEGMENT_BYTES.min(even) / block).max(1) * block;
        if reader_bytes(cut, n) > round_bytes {
            cut = (cut.min(round_bytes / n) / block).max(1) * block;
        }
        let mut lo = s.lo;
        while lo < s.hi {
            let hi = (s.base + ((lo - s.base) / cut + 1) * cut).min(s.hi);
            unit(&mut out, &s.ranks, s.file, lo, hi - lo, &mut |reader| Some(rounds.place(&s.ranks, reader, hi - lo)));
            lo = hi;
        }
    }
    // Every rank takes part in every round; none when nothing is fanned out at all.
    let rounds =
        if out.iter().all(|f| f.units.is_empty()) { 0 } else { rounds.current.iter().max().map_or(0, |&m| m + 1) };
    for (plan, fan) in plans.iter_mut().zip(&mut out) {
        fan.rounds = rounds;
        fan.copy_rounds = cut_copies(plan, &fan.units);
    }
    out
}

/// Cuts `plan`'s fanned copies where this rank's round changes; returns each copy's round.
/// A rank's units are in file order with rounds that never decrease, so the round of a
/// byte is that of the last unit starting at or before it.
fn cut_copies(plan: &mut ReadPlan<'_>, units: &[Unit]) -> Vec<u32> {
    let starts: Vec<(u32, u64, u32)> = units.iter().filter(|u| !u.sticky).map(|u| (u.file, u.at, u.round)).collect();
    let round_at = |file: u32, pos: u64| {
        let i = starts.partition_point(|&(f, a, _)| (f, a) <= (file, pos));
        if i == 0 { 0 } else { starts[i - 1].2 }
    };
    let mut copies: Vec<PieceCopy> = Vec::with_capacity(plan.copies.len());
    let mut rounds = Vec::with_capacity(plan.copies.len());
    for c in std::mem::take(&mut plan.copies) {
        if !fanned(&c) || starts.is_empty() {
            copies.push(c);
            rounds.push(0);
            continue;
        }
        let p = &plan.pieces[c.piece];
        let (mut from, end) = (p.at + c.src, p.at + c.src + c.len);
        let mut round = round_at(p.file, from);
        let mut i = starts.partition_point(|&(f, a, _)| (f, a) <= (p.file, from));
        // At least one part: a copy of no bytes (an empty object) is a copy still, which
        // is what marks its target loaded.
        loop {
            // The next start in this copy where the round changes, or its end.
            while i < starts.len() && starts[i].0 == p.file && starts[i].1 < end && starts[i].2 == round {
                i += 1;
            }
            let cut = if i < starts.len() && starts[i].0 == p.file && starts[i].1 < end { starts[i].1 } else { end };
            let (src, len) = (from - p.at, cut - from);
            copies.push(PieceCopy { src, len, dest_at: c.dest_at + (src - c.src), ..c });
            rounds.push(round);
            from = cut;
            if i < starts.len() {
                round = starts[i].2;
            }
            if from >= end {
                break;
            }
        }
    }
    plan.copies = copies;
    rounds
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::FileMeta;
    use crate::load::plan::Stored;

    fn meta() -> Metadata {
        let file = FileMeta { name: "f".into(), bytes: 1000, data_start: 8, header_crc32: 0 };
        Metadata {
            format_version: 1,
            save_id: "s".into(),
            writer: String::new(),
            block_bytes: 100,
            layout: Default::default(),
            files: vec![file],
            tensors: Vec::new(),
            objects: Vec::new(),
        }
    }

    /// Two ranks take the halves of a piece split inside its second block (a row split's
    /// boundary), and both take all of a second piece (replicas). Elsewhere the boundary
    /// block is read by one and sent to the other; where the store reads in place each
    /// picks it itself, and only the whole blocks both need are fanned out.
    #[test]
    fn in_place_only_whole_blocks_are_fanned_out() {
        let units = |in_place: bool| -> Vec<(u64, u64)> {
            let pieces = vec![
                Stored { chunk: None, file: 0, at: 8, len: 300, crc32: &[] },
                Stored { chunk: None, file: 0, at: 308, len: 250, crc32: &[] },
            ];
            let halves = [(0, 150), (150, 150)];
            let mut plans: Vec<ReadPlan<'_>> = halves
                .iter()
                .map(|&(src, len)| ReadPlan {
                    pieces: pieces.clone(),
                    copies: vec![PieceCopy::one(0, src, len, 0, 0), PieceCopy::one(1, 0, 250, 1, 0)],
                    zero_fill: Vec::new(),
                    casts: Vec::new(),
                })
                .collect();
            let fans = plan_fan(&meta(), &mut plans, 1 << 20, in_place);
            let mut out: Vec<(u64, u64)> =
                fans[0].units.iter().filter(|u| !u.sticky).map(|u| (u.at, u.at + u.len)).collect();
            out.sort_unstable();
            out
        };
        // The boundary block 108..208, and the second piece whole in halves over the two.
        assert_eq!(units(false), [(108, 208), (308, 508), (508, 558)]);
        assert_eq!(units(true), [(308, 508), (508, 558)]);
    }

    /// A piece that 64 replicas all read, in units of a block (1 MiB, sent alone: one
    /// buffer for all its receivers): each rank holds at most a round's bytes, and the rounds
    /// are the bytes over that, not one a unit (a unit's reader was charged a copy for each
    /// peer, which overfilled every round alone).
    #[test]
    fn units_that_many_replicas_need_share_rounds() {
        const MIB: u64 = 1 << 20;
        let (world, piece) = (64usize, 64 * MIB);
        let mut m = meta();
        m.block_bytes = MIB;
        m.files[0].bytes = piece + 8;
        let pieces = vec![Stored { chunk: None, file: 0, at: 8, len: piece, crc32: &[] }];
        let mut plans: Vec<ReadPlan<'_>> = (0..world)
            .map(|_| ReadPlan {
                pieces: pieces.clone(),
                copies: vec![PieceCopy::one(0, 0, piece, 0, 0)],
                zero_fill: Vec::new(),
                casts: Vec::new(),
            })
            .collect();
        let round = 16 * MIB;
        let fans = plan_fan(&m, &mut plans, round, false);
        assert_eq!(fans[0].rounds, 4, "64 MiB in rounds of 16");
        for (r, fan) in fans.iter().enumerate() {
            let data: Vec<&Unit> = fan.units.iter().filter(|u| !u.sticky).collect();
            assert_eq!(data.iter().map(|u| u.len).sum::<u64>(), piece, "rank {r} gets every byte once");
            for k in 0..fan.rounds {
                let held: u64 = data.iter().filter(|u| u.round == k).map(|u| u.len).sum();
                assert!(held <= round, "rank {r} holds {held} bytes in round {k}");
            }
        }
    }
}
