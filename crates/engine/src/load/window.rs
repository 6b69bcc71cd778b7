//! Direct reads of one file, a window at a time, each part checked while still in cache.

use dckpt_storage::Storage;

use super::{blocks::*, execute::*, plan::*};
use crate::Result;
use crate::format::Metadata;
use crate::split_crc;

/// Direct reads of one file, read in one request (or in parts of [`HOT_BYTES`]).
pub(super) struct Window<'a> {
    pub(super) file: usize,
    /// The file's header when this is its first window, else empty.
    pub(super) header: Vec<u8>,
    pub(super) targets: Vec<Target<'a>>,
    /// The shared targets' rows as read, each split at block boundaries, with their CRCs.
    pub(super) stretches: Vec<Stretch>,
}

/// A stretch of a shared chunk this rank read: `len` bytes at `at` in piece `piece`, inside
/// one checksum block, and their [`split_crc::raw`] CRC.
pub(super) struct Stretch {
    pub(super) piece: usize,
    pub(super) at: u64,
    pub(super) len: u64,
    pub(super) raw: u32,
}

/// Bytes a load asks a store with a read window (local disk) for at a time, and checks as
/// soon as they are in: few enough to still be in the CPU's cache, where CRC-32 runs
/// several times faster than over a whole window (measurements: docs/benchmarks.md,
/// "Decisions behind the constants").
pub(super) const HOT_BYTES: usize = 512 << 10;

/// What one read of a window's batch holds, for the check after it.
#[derive(Clone, Copy)]
pub(super) enum Holds {
    Header,
    /// Bytes of a target checked block by block (index in the window).
    Blocks(usize),
    /// One row of a shared target: its offset in piece `piece`.
    Row {
        piece: usize,
        at: u64,
    },
}

/// Reads window `w` in batches of about `hot` bytes (one request when `hot` is
/// `usize::MAX`; a row of a shared target is never split, so a batch can hold more) and
/// checks each batch right after it is read: the file's header against its CRC, the blocks
/// of plain targets against theirs, the rows of shared ones into CRC'd stretches for the
/// parts.
pub(super) fn read_checked(
    storage: &dyn Storage,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    hot: usize,
    w: &mut Window<'_>,
) -> Result<()> {
    let Window { file, header, targets, stretches } = w;
    let name = &meta.files[*file].name;
    let block = meta.block_bytes;
    let mut checks: Vec<Option<BlockCheck<'_>>> = targets
        .iter()
        .map(|t| (!t.shared).then(|| BlockCheck::new(name, t.at, pieces[t.piece].crc32, block, t.src / block)))
        .collect();
    let mut reads: Vec<(u64, &mut [u8])> = Vec::new();
    let mut holds: Vec<Holds> = Vec::new();
    let mut pending = 0;
    let mut reader = storage.reader(name)?;
    let mut flush = |reads: &mut Vec<(u64, &mut [u8])>, holds: &mut Vec<Holds>| -> Result<()> {
        reader.read_into(reads)?;
        for ((_, buf), h) in reads.iter().zip(holds.iter()) {
            match *h {
                Holds::Header => verify_header(&meta.files[*file], buf)?,
                Holds::Blocks(i) => checks[i].as_mut().expect("a plain target").update(buf)?,
                Holds::Row { piece, mut at } => {
                    let mut data: &[u8] = buf;
                    while !data.is_empty() {
                        let n = (((at / block + 1) * block - at) as usize).min(data.len());
                        stretches.push(Stretch { piece, at, len: n as u64, raw: split_crc::raw(&data[..n]) });
                        at += n as u64;
                        data = &data[n..];
                    }
                }
            }
        }
        reads.clear();
        holds.clear();
        Ok(())
    };
    if !header.is_empty() {
        pending += header.len();
        reads.push((0, &mut header[..]));
        holds.push(Holds::Header);
        if pending >= hot {
            flush(&mut reads, &mut holds)?;
            pending = 0;
        }
    }
    for (i, t) in targets.iter_mut().enumerate() {
        let (at, step, piece, src) = (t.at, t.step, t.piece, t.src);
        if t.shared {
            // Rows are read whole: a row's CRC is computed in one piece.
            let rows = std::iter::once(&mut *t.buf).chain(t.more.iter_mut().map(|b| &mut **b));
            for (k, b) in rows.enumerate() {
                let k = k as u64;
                pending += b.len();
                reads.push((at + k * step, b));
                holds.push(Holds::Row { piece, at: src + k * step });
                if pending >= hot {
                    flush(&mut reads, &mut holds)?;
                    pending = 0;
                }
            }
        } else {
            debug_assert!(t.more.is_empty(), "only shared targets have rows");
            let (mut rest, mut at): (&mut [u8], u64) = (&mut *t.buf, at);
            while !rest.is_empty() {
                let n = rest.len().min(hot - pending);
                let (now, later) = std::mem::take(&mut rest).split_at_mut(n);
                reads.push((at, now));
                pending += n;
                at += n as u64;
                holds.push(Holds::Blocks(i));
                rest = later;
                if pending >= hot {
                    flush(&mut reads, &mut holds)?;
                    pending = 0;
                }
            }
        }
    }
    if !reads.is_empty() {
        flush(&mut reads, &mut holds)?;
    }
    checks.into_iter().flatten().try_for_each(BlockCheck::finish)
}
