//! Stage 4: the copies performed: direct reads a window at a time, picked or staged reads
//! for partial blocks, every byte checked.

use super::overlay::Overlay;

use dckpt_collective::Collective;

use super::cast::CastBuffers;
use super::fan::FanPlan;
use super::overlay::fan_round;
use super::*;
use super::{blocks::FileReader, picked::*, plan::*, staged::*, window::*};
use crate::error::panic_as_error;
use crate::format::Metadata;
use crate::shared_check::{self, PartCrc};
use crate::{Error, Result};
use std::sync::{Mutex, PoisonError};

/// Reads a plan (its copies of blocks checked with the other ranks marked shared) over
/// `meta`, the files it reads, in the fan-out's rounds: each round's units exchanged, then
/// the copies of that round read through the overlay. Every round is taken part in, after
/// a failure here too (`failed`, or one along the way), so that no peer waits for this
/// rank. Returns this rank's parts of the shared blocks, or its first failure, and the
/// bytes received from peers; an exchange that fails ends the load at once (the error).
#[allow(clippy::too_many_arguments)]
pub(super) fn read_planned(
    storage: &mut Overlay<'_>,
    coll: &dyn Collective,
    meta: &Metadata,
    plan: ReadPlan<'_>,
    fan: &FanPlan,
    req: &mut LoadRequest<'_>,
    read_bytes_max: u64,
    failed: Result<()>,
) -> Result<(Result<Vec<PartCrc>>, u64)> {
    let ReadPlan { pieces, copies, casts, .. } = plan;
    let rounds = fan.rounds.max(1) as usize;
    let mut result = failed.and_then(|()| {
        if !fan.copy_rounds.is_empty() && fan.copy_rounds.len() != copies.len() {
            return Err(Error::protocol("a fan-out plan for other copies"));
        }
        if meta.block_bytes == 0 {
            return Err(Error::protocol("a plan with checksum blocks of 0 bytes"));
        }
        if !fan.units.iter().all(|u| u.fits(meta)) {
            return Err(Error::protocol("a fan-out unit outside the plan's files"));
        }
        panic_as_error("opening the files", || open_files(storage, meta, &pieces))
    });
    let mut by_round: Vec<Vec<PieceCopy>> = vec![Vec::new(); rounds];
    let first_object = req.tensors.len();
    let mut sized = vec![false; req.objects.len()];
    for (i, c) in copies.into_iter().enumerate() {
        // Sized from the metadata only once every file's size checked out, and from the
        // stored object's length: the fan-out cuts an object's copy where its rounds change.
        if c.dest >= first_object && result.is_ok() {
            let at = c.dest - first_object;
            match (req.objects.get_mut(at), pieces.get(c.piece)) {
                (Some(o), Some(p)) if !sized[at] => (o.data, sized[at]) = (Some(vec![0; p.len as usize]), true),
                (Some(_), Some(_)) => {}
                _ => result = Err(Error::protocol("a copy past the requests")),
            }
        }
        match by_round.get_mut(fan.copy_rounds.get(i).map_or(0, |&r| r as usize)) {
            Some(r) => r.push(c),
            None => result = Err(Error::protocol("a copy in a round past the fan-out's")),
        }
    }
    let (mut cast, made) = CastBuffers::new(&casts, req);
    result = result.and(made);
    let mut dests = cast.dests(req);
    if result.is_ok() && !by_round.iter().flatten().all(|c| fits(c, &pieces, &dests)) {
        result = Err(Error::protocol("a copy outside its stored piece or its buffer"));
    }
    let (mut parts, mut received) = (Vec::new(), 0);
    for (round, copies) in by_round.into_iter().enumerate() {
        if fan.rounds > 0 {
            let (n, read) = fan_round(storage, coll, meta, fan, round as u32)?;
            received += n;
            result = result.and(read);
        }
        if result.is_ok() {
            match panic_as_error("a read", || execute(storage, meta, &pieces, copies, &mut dests, read_bytes_max)) {
                Ok(p) => parts.extend(p),
                Err(e) => result = Err(e),
            }
        }
        storage.end_round();
    }
    if result.is_ok() {
        cast.finish(req);
    }
    Ok((result.map(|()| parts), received))
}

/// Whether every row of `c` lies inside its stored piece and its destination buffer: the
/// read stages slice by them (a plan garbled on the way would panic there, with the other
/// ranks waiting in the next round).
/// The planner makes no copy of no rows, no rows that overlap one another, and no shared
/// copy of an object (shared blocks are a chunk's).
fn fits(c: &PieceCopy, pieces: &[Stored<'_>], dests: &[&mut [u8]]) -> bool {
    let end = |at: u64, step: u64| {
        c.rows.checked_sub(1).map_or(Some(0), |last| last.checked_mul(step)?.checked_add(at)?.checked_add(c.len))
    };
    let (Some(p), Some(d)) = (pieces.get(c.piece), dests.get(c.dest)) else { return false };
    let rows_apart = c.rows == 1 || (c.src_step >= c.len && c.dest_step >= c.len);
    c.rows > 0
        && rows_apart
        && (!c.shared || p.chunk.is_some())
        && end(c.src, c.src_step).is_some_and(|e| e <= p.len)
        && end(c.dest_at, c.dest_step).is_some_and(|e| e <= d.len() as u64)
}

/// Every file this rank reads from, opened with its size as recorded (its header intact is
/// checked with the first read of it), before any buffer is sized from the metadata, on
/// stores that know a size when a file is opened (local disk, memory); an object store
/// sends no request for it, and checks the size its first answer carries.
fn open_files(storage: &Overlay<'_>, meta: &Metadata, pieces: &[Stored<'_>]) -> Result<()> {
    let mut files: Vec<u32> = pieces.iter().map(|p| p.file).collect();
    files.sort_unstable();
    files.dedup();
    for fi in files {
        let f = meta.files.get(fi as usize).ok_or_else(|| Error::protocol("a piece past the plan's files"))?;
        FileReader::open(storage, f)?;
    }
    Ok(())
}

/// Performs `copies`, in five stages: which copies are read straight into place, which
/// picked out of whole blocks (on a store that reads in place) and which through the
/// staging buffer ([`split_copies`]); the destination buffers cut into the slices the
/// direct and picked reads fill ([`direct_targets`]); the direct ones grouped into windows
/// of one file ([`windows_of`]); the windows read, each part checked while in cache
/// ([`read_windows`]); then the picked copies ([`run_picked`]) and the staged ones
/// ([`run_staged`]), each with the headers of their files that no stage before read (staged
/// ones on an object store read with the windows where they can be). Returns this rank's
/// parts of the shared blocks.
pub(super) fn execute(
    storage: &Overlay<'_>,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    copies: Vec<PieceCopy>,
    dests: &mut [&mut [u8]],
    read_bytes_max: u64,
) -> Result<Vec<PartCrc>> {
    let hints = storage.hints();
    let window = hints.read_window.unwrap_or(u64::MAX);
    let (direct, picked, staged) = split_copies(pieces, copies, meta.block_bytes, hints.reads_in_place);
    let (targets, picks) = direct_targets(pieces, direct, picked, dests, window, meta.block_bytes)?;
    let (mut windows, mut header_read) = windows_of(meta, targets, window);
    let mut staged = plan_staged(meta, pieces, staged, &mut header_read, read_bytes_max);
    if window == u64::MAX {
        read_staged_with_windows(meta, pieces, &mut windows, &mut staged);
    }
    let (parts, pre_read) = read_windows(storage, meta, pieces, windows, window, read_bytes_max)?;
    for p in pre_read {
        staged.buffers[p.buffer].data = Some(p.data);
    }
    run_picked(storage, meta, pieces, picks, &header_read)?;
    run_staged(storage, meta, pieces, staged, dests)?;
    Ok(parts)
}

/// Staged bytes read with the windows and held until they are copied out, at most.
const PRE_READ_BYTES: u64 = 4 * STAGE_BYTES;

/// Where every read is a request (an object store: no read window, one window per file),
/// the first staged buffer of a file a window reads goes in the same request, so that a
/// rank asks for each file once: as long as such buffers hold [`PRE_READ_BYTES`] in all,
/// since they wait until the windows are done.
fn read_staged_with_windows(meta: &Metadata, pieces: &[Stored<'_>], windows: &mut [Window<'_>], staged: &mut Staged) {
    let mut held = 0;
    let mut window_of: Vec<Option<usize>> = vec![None; meta.files.len()];
    for (i, w) in windows.iter().enumerate().rev() {
        window_of[w.file] = Some(i);
    }
    for (b, buffer) in staged.buffers.iter().enumerate() {
        let Some(w) = window_of[buffer.file as usize].take() else { continue };
        let reads = buffer.reads(meta, pieces);
        let len: u64 = reads.iter().map(|r| r.1).sum();
        if held + len > PRE_READ_BYTES {
            break;
        }
        held += len;
        windows[w].pre_read = Some(PreRead { buffer: b, reads, data: vec![0; len as usize] });
    }
}

/// Stage 1: the whole checksum blocks of each copy go straight into place (direct) and are
/// verified there, as do rows of a chunk checked in parts with the other ranks (shared);
/// the partial blocks at the ends of the others are picked out of whole blocks where the
/// store reads in place (`in_place`), and go through the staging buffer elsewhere. Returns
/// the direct, picked and staged copies.
fn split_copies(
    pieces: &[Stored<'_>],
    copies: Vec<PieceCopy>,
    block: u64,
    in_place: bool,
) -> (Vec<PieceCopy>, Vec<PieceCopy>, Vec<PieceCopy>) {
    let (mut direct, mut partial) = (Vec::with_capacity(copies.len()), Vec::new());
    for c in copies {
        let piece_len = pieces[c.piece].len;
        // Rows without a whole block (a column split's rows, shorter than a block) stay
        // together: read exactly and checked in parts with the other ranks when the chunk is
        // shared, through the staging window otherwise.
        if c.each_row().all(|r| {
            let (lo, hi) = whole_blocks(&r, piece_len, block);
            lo >= hi
        }) {
            if c.shared {
                direct.push(c)
            } else {
                partial.push(c)
            }
            continue;
        }
        for r in c.each_row() {
            let (lo, hi) = whole_blocks(&r, piece_len, block);
            let end = r.src + r.len;
            if lo < hi {
                direct.push(PieceCopy { src: lo, len: hi - lo, dest_at: r.dest_at + (lo - r.src), shared: false, ..r });
            }
            let head = (lo < hi && r.src < lo).then(|| PieceCopy { len: lo - r.src, ..r });
            let tail = (lo < hi && hi < end).then(|| PieceCopy {
                src: hi,
                len: end - hi,
                dest_at: r.dest_at + (hi - r.src),
                ..r
            });
            let whole = (lo >= hi).then_some(r);
            for e in [head, tail, whole].into_iter().flatten() {
                if e.shared { direct.push(e) } else { partial.push(e) }
            }
        }
    }
    match in_place {
        true => (direct, partial, Vec::new()),
        false => (direct, Vec::new(), partial),
    }
}

/// Stage 2: the destination buffers split into exactly the slices the direct reads fill (a
/// large one further at block boundaries, so that reads go a window at a time), in file
/// order, and the slices of the picked copies' rows (a list per copy). Destination ranges
/// are disjoint, as stored chunks are; copies that overlap there come from no planner and
/// fail the load.
fn direct_targets<'d>(
    pieces: &[Stored<'_>],
    direct: Vec<PieceCopy>,
    picked: Vec<PieceCopy>,
    dests: &'d mut [&mut [u8]],
    window: u64,
    block: u64,
) -> Result<(Vec<Target<'d>>, Vec<Vec<Pick<'d>>>)> {
    let step = if window == u64::MAX { u64::MAX } else { (window / block).max(1) * block };
    // Each copy with whether it is picked.
    let mut direct: Vec<(PieceCopy, bool)> =
        direct.into_iter().map(|c| (c, false)).chain(picked.into_iter().map(|c| (c, true))).collect();
    direct.sort_unstable_by_key(|(c, _)| (c.dest, c.dest_at));
    split_interleaved(&mut direct);
    let mut picks = Vec::with_capacity(direct.iter().filter(|d| d.1).count());
    let mut targets: Vec<Target<'d>> = Vec::with_capacity(direct.len());
    let mut rest: Vec<&'d mut [u8]> = dests.iter_mut().map(|d| &mut **d).collect();
    let mut consumed = vec![0u64; rest.len()];
    for (c, picked) in &direct {
        let p = &pieces[c.piece];
        let mut take = |r: &PieceCopy| -> Result<&'d mut [u8]> {
            let skip = r.dest_at.checked_sub(consumed[r.dest]);
            let skip = skip.ok_or_else(|| Error::protocol("copies that overlap in a destination buffer"))?;
            let buf = std::mem::take(&mut rest[r.dest]);
            let (_, tail) = buf.split_at_mut(skip as usize);
            let (mine, after) = tail.split_at_mut(r.len as usize);
            rest[r.dest] = after;
            consumed[r.dest] = r.dest_at + r.len;
            Ok(mine)
        };
        if *picked {
            let rows = c.each_row().map(|r| Ok(Pick { piece: r.piece, src: r.src, buf: take(&r)? }));
            picks.push(rows.collect::<Result<Vec<Pick<'d>>>>()?);
            continue;
        }
        if c.rows > 1 {
            // Shared rows (never whole blocks), as many to a target as a window holds.
            let mut open: Option<Target<'d>> = None;
            for r in c.each_row() {
                let buf = take(&r)?;
                match &mut open {
                    Some(t) if t.bytes + r.len <= step => {
                        t.bytes += r.len;
                        t.more.push(buf);
                    }
                    _ => targets.extend(open.replace(Target::new(p, &r, c.src_step, buf))),
                }
            }
            targets.extend(open);
            continue;
        }
        let mut mine = take(c)?;
        let mut src = c.src;
        // A shared stretch is never split: it is not whole blocks.
        while !c.shared && mine.len() as u64 > step {
            let (now, later) = mine.split_at_mut(step as usize);
            targets.push(Target::new(p, &PieceCopy { src, ..*c }, 0, now));
            src += step;
            mine = later;
        }
        targets.push(Target::new(p, &PieceCopy { src, ..*c }, 0, mine));
    }
    targets.sort_unstable_by_key(|t| (t.file, t.at));
    Ok((targets, picks))
}

/// The rows of two copies into one buffer may interleave (a buffer filled from two stored
/// column halves): such a buffer's copies (sorted by destination) are split into their rows.
fn split_interleaved(direct: &mut Vec<(PieceCopy, bool)>) {
    let mut interleaved: Vec<usize> = direct
        .windows(2)
        .filter(|w| w[0].0.dest == w[1].0.dest && w[0].0.dest_end() > w[1].0.dest_at)
        .map(|w| w[0].0.dest)
        .collect();
    if interleaved.is_empty() {
        return;
    }
    interleaved.dedup();
    let mut rows = Vec::new();
    direct.retain(|(c, picked)| {
        let split = c.rows > 1 && interleaved.binary_search(&c.dest).is_ok();
        if split {
            rows.extend(c.each_row().map(|r| (r, *picked)));
        }
        !split
    });
    direct.extend(rows);
    direct.sort_unstable_by_key(|(c, _)| (c.dest, c.dest_at));
}

/// Stage 3: the targets in windows of at most `window` bytes of one file each (or a single
/// larger target); each file's header rides along with its first window (one request on
/// object stores). Also says which files' headers a window reads.
fn windows_of<'d>(meta: &Metadata, targets: Vec<Target<'d>>, window: u64) -> (Vec<Window<'d>>, Vec<bool>) {
    let mut header_read = vec![false; meta.files.len()];
    // Each window's targets are counted first, so its list is allocated once.
    let mut sizes = Vec::new();
    let mut start = 0;
    while start < targets.len() {
        let (fi, mut span, mut end) = (targets[start].file, targets[start].bytes, start + 1);
        while let Some(n) = targets.get(end).filter(|n| n.file == fi && span.saturating_add(n.bytes) <= window) {
            span += n.bytes;
            end += 1;
        }
        sizes.push(end - start);
        start = end;
    }
    let mut it = targets.into_iter();
    let mut windows = Vec::with_capacity(sizes.len());
    for n in sizes {
        let win: Vec<Target<'d>> = it.by_ref().take(n).collect();
        let fi = win[0].file as usize;
        let header = vec![0u8; if header_read[fi] { 0 } else { meta.files[fi].data_start as usize }];
        header_read[fi] = true;
        windows.push(Window { file: fi, header, targets: win, stretches: Vec::new(), pre_read: None });
    }
    (windows, header_read)
}

/// Stage 4: the windows read, a few at once where each is a request, each part checked
/// while still in the CPU's cache; the next window of a file is prefetched once the one
/// before it is in. The rows read of shared blocks become this rank's parts of them once
/// every stretch of their piece is in. Returns those parts and the staged
/// stretches read with the windows.
fn read_windows(
    storage: &Overlay<'_>,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    windows: Vec<Window<'_>>,
    window: u64,
    read_bytes_max: u64,
) -> Result<(Vec<PartCrc>, Vec<PreRead>)> {
    let in_flight = reads_in_flight(storage);
    // Parts no larger than the largest read asked for, where a store reads in windows
    // (local disk); one request per window otherwise.
    let hot = match storage.hints().read_window {
        Some(_) => usize::try_from(read_bytes_max).unwrap_or(usize::MAX).clamp(1, HOT_BYTES),
        None => usize::MAX,
    };
    let (mut parts, mut pre_read) = (Vec::new(), Vec::new());
    let mut stretches: Vec<Stretch> = Vec::new();
    let mut ws = windows.into_iter().peekable();
    while ws.peek().is_some() {
        let mut batch: Vec<Window<'_>> = ws.by_ref().take(in_flight).collect();
        in_parallel(&mut batch, |w| read_checked(storage, meta, pieces, hot, w))?;
        // What follows each window of the batch: the next window's file and first piece.
        let after: Vec<Option<(usize, usize)>> =
            batch.iter().skip(1).chain(ws.peek()).map(|w| Some((w.file, w.targets[0].piece))).chain([None]).collect();
        // Asked for only now, not before this window was read: the request can block on a
        // busy queue and slow a cold load (docs/benchmarks.md).
        if let Some(n) = ws.peek().filter(|n| batch.last().is_some_and(|w| w.file == n.file)) {
            storage.prefetch(&meta.files[n.file].name, n.targets[0].at, window);
        }
        for (w, next) in batch.into_iter().zip(after) {
            stretches.extend(w.stretches);
            pre_read.extend(w.pre_read);
            // Targets are in file order, so only the piece the next window of this file
            // starts in can have stretches still to come.
            let open = next.filter(|n| n.0 == w.file).map(|n| n.1);
            let done = stretches.iter().rposition(|s| Some(s.piece) != open).map_or(0, |i| i + 1);
            for same in stretches[..done].chunk_by(|a, b| a.piece == b.piece) {
                let p = &pieces[same[0].piece];
                let mut list: Vec<(u64, u64, u32)> = same.iter().map(|s| (s.at, s.len, s.raw)).collect();
                // In order already, unless two requests take alternate rows of one chunk.
                list.sort_unstable_by_key(|s| s.0);
                let key = p.chunk.expect("only tensor chunks are shared");
                shared_check::parts_of(key, p.len, meta.block_bytes, &list, &mut parts);
            }
            stretches.drain(..done);
        }
    }
    Ok((parts, pre_read))
}

/// How many reads a load runs at once: as many as the store gains from
/// ([`StorageHints::reads_in_flight`](dckpt_storage::StorageHints::reads_in_flight): several
/// on object stores, where each is a request), else one, on the calling thread.
pub(super) fn reads_in_flight(storage: &Overlay<'_>) -> usize {
    storage.hints().reads_in_flight.unwrap_or(1).max(1)
}

/// `f` on each item, all at once on threads of their own when there are several (one after
/// the other where the process cannot start a thread); the first error in item order. A
/// panic in `f` is this rank's error, on the calling thread as on a read thread: the ranks
/// agree on it, where an unwind out of the load left them waiting for this one.
pub(super) fn in_parallel<T: Send>(items: &mut [T], f: impl Fn(&mut T) -> Result<()> + Sync) -> Result<()> {
    if let [one] = items {
        return panic_as_error("a read", || f(one));
    }
    let n = items.len();
    let queue = Mutex::new(items.iter_mut().enumerate());
    let work = || {
        let mut mine = Vec::new();
        loop {
            let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
            let Some((i, item)) = next else { return mine };
            mine.push((i, f(item)));
        }
    };
    let mut done: Vec<(usize, Result<()>)> = crate::threads::on_threads(n, work)
        .into_iter()
        .flat_map(|run| run.unwrap_or_else(|_| vec![(0, Err(Error::internal("a read thread panicked")))]))
        .collect();
    done.sort_by_key(|d| d.0);
    done.into_iter().try_for_each(|d| d.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the planner never makes is refused before a stage slices by it: a plan garbled
    /// on the way then fails the load instead of panicking one rank (no rows made both
    /// ends' checks pass whatever the offsets; overlapping rows and a shared object's copy
    /// panicked in the stages).
    #[test]
    fn copies_the_planner_never_makes_do_not_fit() {
        let pieces = [
            Stored { chunk: Some((0, 0)), file: 0, at: 8, len: 64, crc32: &[] },
            Stored { chunk: None, file: 0, at: 72, len: 8, crc32: &[] },
        ];
        let mut buf = [0u8; 64];
        let dests: Vec<&mut [u8]> = vec![&mut buf];
        let rows = PieceCopy { rows: 4, src_step: 16, dest_step: 16, ..PieceCopy::one(0, 0, 8, 0, 0) };
        assert!(fits(&rows, &pieces, &dests));
        assert!(fits(&PieceCopy { shared: true, ..rows }, &pieces, &dests));
        assert!(fits(&PieceCopy::one(1, 0, 8, 0, 56), &pieces, &dests));
        let bad = [
            PieceCopy { rows: 0, dest_at: 1 << 40, ..rows },
            PieceCopy { dest_step: 4, ..rows },
            PieceCopy { src_step: 4, ..rows },
            PieceCopy { shared: true, ..PieceCopy::one(1, 0, 8, 0, 0) },
            PieceCopy { rows: 5, ..rows },
            PieceCopy::one(2, 0, 8, 0, 0),
        ];
        for c in bad {
            assert!(!fits(&c, &pieces, &dests), "{c:?}");
        }
    }

    /// Two copies that each fit but overlap in their buffer: the split of the buffers into
    /// targets underflowed there and panicked; it fails the load instead.
    #[test]
    fn copies_that_overlap_in_a_buffer_fail_the_load() {
        let pieces = [Stored { chunk: Some((0, 0)), file: 0, at: 8, len: 16, crc32: &[] }];
        let mut buf = [0u8; 16];
        let mut dests: Vec<&mut [u8]> = vec![&mut buf];
        let apart = vec![PieceCopy::one(0, 0, 8, 0, 0), PieceCopy::one(0, 8, 8, 0, 8)];
        let (targets, _) = direct_targets(&pieces, apart, Vec::new(), &mut dests, u64::MAX, 64).unwrap();
        assert_eq!(targets.len(), 2);
        let overlap = vec![PieceCopy::one(0, 0, 8, 0, 0), PieceCopy::one(0, 8, 8, 0, 4)];
        let e = direct_targets(&pieces, overlap, Vec::new(), &mut dests, u64::MAX, 64).map(drop).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
    }
}
