//! Staged reads: partial checksum blocks through a small buffer, verified, then copied out.

use dckpt_storage::Storage;

use super::{blocks::*, plan::*};
use crate::Result;
use crate::format::Metadata;

/// Staged reads go through a buffer of about this size (whole checksum blocks, so at least
/// one): small enough to stay in cache between the read, the checksum and the copy out.
pub(super) const STAGE_BYTES: u64 = 4 << 20;

/// Reads the blocks `copies` touch, a buffer at a time, verifies them and copies them out.
/// The stretches of one file that fit in the buffer together are read in one call (on an
/// object store one request, not one per piece), with the file's header first where no
/// window read it (`header_read`). Returns the bytes read.
pub(super) fn execute_partial(
    storage: &dyn Storage,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    mut copies: Vec<PieceCopy>,
    header_read: &[bool],
    dests: &mut [&mut [u8]],
    read_bytes_max: u64,
) -> Result<u64> {
    let block = meta.block_bytes;
    let window = (read_bytes_max.min(STAGE_BYTES) / block).max(1);
    if copies.iter().any(|c| c.rows > 1) {
        copies = copies.iter().flat_map(PieceCopy::each_row).collect();
    }
    // In file order, so that the stretches of a buffer are the nearby ones of one file.
    copies.sort_unstable_by_key(|c| (pieces[c.piece].file, pieces[c.piece].at, c.piece, c.src));
    let mut stage = Stage { storage, meta, pieces, buf: Vec::new(), stretches: Vec::new(), bytes: 0, bytes_read: 0 };
    let mut header_read = header_read.to_vec();
    let mut start = 0;
    for group in copies.chunk_by(|a, b| a.piece == b.piece) {
        let (piece, group_at) = (group[0].piece, start);
        start += group.len();
        let p = &pieces[piece];
        if stage.stretches.first().is_some_and(|s| stage.place(s).0 != p.file) {
            stage.flush(&copies, dests)?;
        }
        // Blocks the copies touch, merged into runs, read a window at a time.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for c in group {
            let (b0, b1) = (c.src / block, (c.src + c.len).div_ceil(block));
            match runs.last_mut() {
                Some(r) if b0 <= r.1 => r.1 = r.1.max(b1),
                _ => runs.push((b0, b1)),
            }
        }
        for (b_lo, b_hi) in runs {
            let mut b = b_lo;
            while b < b_hi {
                let e = (b + window).min(b_hi);
                let (lo, hi) = (b * block, (e * block).min(p.len));
                if stage.bytes + (hi - lo) > window * block {
                    stage.flush(&copies, dests)?;
                }
                if !std::mem::replace(&mut header_read[p.file as usize], true) {
                    stage.push(Stretch::Header { file: p.file });
                }
                let copies_at = group_at..group_at + group.len();
                stage.push(Stretch::Blocks { piece, lo, hi, first_block: b, copies_at });
                b = e;
            }
        }
    }
    stage.flush(&copies, dests)?;
    Ok(stage.bytes_read)
}

/// What a staged read holds: a file's header, or `lo..hi` of piece `piece` (from its block
/// `first_block` on) for the copies at `copies` of the sorted list.
enum Stretch {
    Header { file: u32 },
    Blocks { piece: usize, lo: u64, hi: u64, first_block: u64, copies_at: std::ops::Range<usize> },
}

/// Stretches of one file waiting to be read in one call.
struct Stage<'s, 'm> {
    storage: &'s dyn Storage,
    meta: &'m Metadata,
    pieces: &'s [Stored<'m>],
    buf: Vec<u8>,
    stretches: Vec<Stretch>,
    /// Bytes of the stretches waiting.
    bytes: u64,
    bytes_read: u64,
}

impl Stage<'_, '_> {
    /// The file of a stretch, its offset there and its length.
    fn place(&self, s: &Stretch) -> (u32, u64, u64) {
        match *s {
            Stretch::Header { file } => (file, 0, self.meta.files[file as usize].data_start),
            Stretch::Blocks { piece, lo, hi, .. } => (self.pieces[piece].file, self.pieces[piece].at + lo, hi - lo),
        }
    }

    fn push(&mut self, s: Stretch) {
        self.bytes += self.place(&s).2;
        self.stretches.push(s);
    }

    /// Reads the stretches in one call, verifies each, and copies the pieces' bytes out.
    fn flush(&mut self, copies: &[PieceCopy], dests: &mut [&mut [u8]]) -> Result<()> {
        let Some(first) = self.stretches.first() else { return Ok(()) };
        let f = &self.meta.files[self.place(first).0 as usize];
        let places: Vec<(u64, u64)> = self.stretches.iter().map(|s| self.place(s)).map(|p| (p.1, p.2)).collect();
        let total: u64 = places.iter().map(|p| p.1).sum();
        self.buf.resize(total as usize, 0);
        let mut reads: Vec<(u64, &mut [u8])> = Vec::with_capacity(places.len());
        let mut rest = &mut self.buf[..];
        for &(at, len) in &places {
            let (mine, after) = std::mem::take(&mut rest).split_at_mut(len as usize);
            reads.push((at, mine));
            rest = after;
        }
        FileReader::open(self.storage, f)?.read_into(&mut reads)?;
        self.bytes_read += total;
        for (s, (at, data)) in self.stretches.iter().zip(reads) {
            let Stretch::Blocks { piece, lo, hi, first_block, ref copies_at } = *s else {
                verify_header(f, data)?;
                continue;
            };
            verify_blocks(&f.name, at, self.pieces[piece].crc32, self.meta.block_bytes, first_block, data)?;
            for c in &copies[copies_at.clone()] {
                let (a, b) = (c.src.max(lo), (c.src + c.len).min(hi));
                if a < b {
                    let d = &mut dests[c.dest];
                    let at = (c.dest_at + a - c.src) as usize;
                    d[at..at + (b - a) as usize].copy_from_slice(&data[(a - lo) as usize..(b - lo) as usize]);
                }
            }
        }
        self.stretches.clear();
        self.bytes = 0;
        Ok(())
    }
}
