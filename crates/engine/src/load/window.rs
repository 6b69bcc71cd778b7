//! Direct reads of one file, a window at a time, each part checked while still in cache.

use super::overlay::Overlay;

use super::{blocks::*, plan::*};
use crate::Result;
use crate::format::{FileMeta, Metadata};
use crate::split_crc;

/// Direct reads of one file, read in one request (or in parts of [`HOT_BYTES`]).
pub(super) struct Window<'a> {
    pub(super) file: usize,
    /// The file's header when this is its first window, else empty.
    pub(super) header: Vec<u8>,
    pub(super) targets: Vec<Target<'a>>,
    /// The shared targets' rows as read, each split at block boundaries, with their CRCs.
    pub(super) stretches: Vec<Stretch>,
    /// Staged stretches of the file read in the same request, checked later.
    pub(super) pre_read: Option<PreRead>,
}

/// The stretches of staged buffer `buffer`, at `reads` (offset, length) of the file, read
/// into `data` with a window.
pub(super) struct PreRead {
    pub(super) buffer: usize,
    pub(super) reads: Vec<(u64, u64)>,
    pub(super) data: Vec<u8>,
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
pub(crate) const HOT_BYTES: usize = 512 << 10;

/// What one read of a window's batch holds, for the check after it.
#[derive(Clone, Copy)]
pub(super) enum Holds {
    Header,
    /// Staged stretches, checked when they are copied out.
    Staged,
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
    storage: &Overlay<'_>,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    hot: usize,
    w: &mut Window<'_>,
) -> Result<()> {
    let Window { file, header, targets, stretches, pre_read } = w;
    let f = &meta.files[*file];
    let block = meta.block_bytes;
    let checks = targets
        .iter()
        .map(|t| (!t.shared).then(|| BlockCheck::new(&f.name, t.at, pieces[t.piece].crc32, block, t.src / block)))
        .collect();
    let reader = FileReader::open(storage, f)?;
    let mut batch =
        Batch { reader, file: f, block, checks, stretches, reads: Vec::new(), holds: Vec::new(), pending: 0, hot };
    if !header.is_empty() {
        batch.push(0, &mut header[..], Holds::Header)?;
    }
    for (i, t) in targets.iter_mut().enumerate() {
        if t.shared {
            batch.push_rows(t)?;
        } else {
            batch.push_blocks(i, t)?;
        }
    }
    if let Some(pre) = pre_read {
        let mut rest = &mut pre.data[..];
        for &(at, len) in &pre.reads {
            let (mine, after) = std::mem::take(&mut rest).split_at_mut(len as usize);
            batch.push(at, mine, Holds::Staged)?;
            rest = after;
        }
    }
    batch.finish()
}

/// The reads of a window not yet sent, and what checks each as soon as it is in.
struct Batch<'a, 'b> {
    reader: FileReader<'a>,
    file: &'a FileMeta,
    block: u64,
    /// The block checks of the window's plain targets (by index in the window).
    checks: Vec<Option<BlockCheck<'a>>>,
    stretches: &'a mut Vec<Stretch>,
    reads: Vec<(u64, &'b mut [u8])>,
    holds: Vec<Holds>,
    /// Bytes in `reads`: sent once they reach `hot`.
    pending: usize,
    hot: usize,
}

impl<'a, 'b> Batch<'a, 'b> {
    /// Adds a read of `buf` at file offset `at`; sends the batch once it holds `hot` bytes.
    fn push(&mut self, at: u64, buf: &'b mut [u8], holds: Holds) -> Result<()> {
        self.pending += buf.len();
        self.reads.push((at, buf));
        self.holds.push(holds);
        if self.pending >= self.hot {
            self.flush()?;
        }
        Ok(())
    }

    /// A shared target's rows, each read whole: a row's CRC is computed in one piece.
    fn push_rows(&mut self, t: &'b mut Target<'_>) -> Result<()> {
        let (at, step, piece, src) = (t.at, t.step, t.piece, t.src);
        let rows = std::iter::once(&mut *t.buf).chain(t.more.iter_mut().map(|b| &mut **b));
        for (k, b) in rows.enumerate() {
            let k = k as u64;
            self.push(at + k * step, b, Holds::Row { piece, at: src + k * step })?;
        }
        Ok(())
    }

    /// A plain target (window index `i`), cut where the batch fills.
    fn push_blocks(&mut self, i: usize, t: &'b mut Target<'_>) -> Result<()> {
        debug_assert!(t.more.is_empty(), "only shared targets have rows");
        let (mut rest, mut at): (&'b mut [u8], u64) = (&mut *t.buf, t.at);
        while !rest.is_empty() {
            let n = rest.len().min(self.hot - self.pending);
            let (now, later) = std::mem::take(&mut rest).split_at_mut(n);
            self.push(at, now, Holds::Blocks(i))?;
            at += n as u64;
            rest = later;
        }
        Ok(())
    }

    /// Reads the batch and checks what it holds as the store shows its bytes (while they
    /// are in cache): a plain target's blocks against their checksums, a shared target's
    /// rows into CRC'd stretches; a header once read.
    fn flush(&mut self) -> Result<()> {
        let (checks, holds, stretches, block) = (&mut self.checks, &self.holds, &mut *self.stretches, self.block);
        let mut failed = None;
        // The read whose row was shown last, and the offset in its piece of its next byte.
        let mut row: Option<(usize, u64)> = None;
        self.reader.read_into_inspected(&mut self.reads, &mut |i, bytes| match holds[i] {
            Holds::Blocks(t) if failed.is_none() => {
                failed = checks[t].as_mut().expect("a plain target").update(bytes).err();
            }
            Holds::Row { piece, at } => {
                let (from, continues) = match row {
                    Some((j, next)) if j == i => (next, true),
                    _ => (at, false),
                };
                add_stretches(stretches, block, piece, from, bytes, continues);
                row = Some((i, from + bytes.len() as u64));
            }
            _ => {}
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        for ((_, buf), h) in self.reads.iter().zip(self.holds.iter()) {
            if let Holds::Header = h {
                verify_header(self.file, buf)?;
            }
        }
        self.reads.clear();
        self.holds.clear();
        self.pending = 0;
        Ok(())
    }

    /// Reads what is left and finishes the block checks (a short last block).
    fn finish(mut self) -> Result<()> {
        if !self.reads.is_empty() {
            self.flush()?;
        }
        self.checks.into_iter().flatten().try_for_each(BlockCheck::finish)
    }
}

/// Adds the stretches of `data`, bytes of piece `piece` from `at` on, split at checksum
/// block boundaries, each with its raw CRC; the first continues the last stretch where
/// `continues` (the same row, shown in pieces) and no block boundary falls between them.
fn add_stretches(
    stretches: &mut Vec<Stretch>,
    block: u64,
    piece: usize,
    mut at: u64,
    mut data: &[u8],
    continues: bool,
) {
    let mut continues = continues && !at.is_multiple_of(block);
    while !data.is_empty() {
        let n = (((at / block + 1) * block - at) as usize).min(data.len());
        match stretches.last_mut() {
            Some(s) if continues => {
                s.raw = split_crc::raw_update(s.raw, &data[..n]);
                s.len += n as u64;
            }
            _ => stretches.push(Stretch { piece, at, len: n as u64, raw: split_crc::raw(&data[..n]) }),
        }
        continues = false;
        at += n as u64;
        data = &data[n..];
    }
}

/// A direct read: bytes of a stored piece straight into (part of) a destination buffer, or
/// rows of them, `step` apart in the piece, each into its own slice.
pub(super) struct Target<'a> {
    pub(super) file: u32,
    /// File offset of the first byte.
    pub(super) at: u64,
    pub(super) piece: usize,
    /// Offset of the first byte in the piece.
    pub(super) src: u64,
    pub(super) step: u64,
    /// Checked in parts with the other ranks rather than block by block here.
    pub(super) shared: bool,
    /// Bytes of all rows.
    pub(super) bytes: u64,
    /// The first row.
    pub(super) buf: &'a mut [u8],
    /// The rows after it.
    pub(super) more: Vec<&'a mut [u8]>,
}

impl<'a> Target<'a> {
    /// The first row of `c` (of piece `p`) into `buf`.
    pub(super) fn new(p: &Stored<'_>, c: &PieceCopy, step: u64, buf: &'a mut [u8]) -> Target<'a> {
        let (file, at, bytes) = (p.file, p.at + c.src, buf.len() as u64);
        Target { file, at, piece: c.piece, src: c.src, step, shared: c.shared, bytes, buf, more: Vec::new() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row shown whole and the same row shown in pieces (as a mapped read shows it) make the
    /// same stretches: one per checksum block it touches, with the same raw CRCs.
    #[test]
    fn a_row_shown_in_pieces_makes_the_stretches_of_the_whole_row() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (block, at) = (40_000, 12_345);
        let mut whole = Vec::new();
        add_stretches(&mut whole, block, 3, at, &data, false);
        let mut pieces = Vec::new();
        let mut from = at;
        for (k, piece) in data.chunks(16 << 10).enumerate() {
            add_stretches(&mut pieces, block, 3, from, piece, k > 0);
            from += piece.len() as u64;
        }
        let key = |s: &Stretch| (s.piece, s.at, s.len, s.raw);
        assert_eq!(whole.iter().map(key).collect::<Vec<_>>(), pieces.iter().map(key).collect::<Vec<_>>());
        let ends: Vec<u64> = whole.iter().map(|s| s.at + s.len).collect();
        assert_eq!(ends, [40_000, 80_000, 112_345], "split at the block boundaries");
    }
}
