//! Staged reads: partial checksum blocks through a small buffer, verified, then copied out.

use super::overlay::Overlay;

use super::{blocks::*, plan::*};
use crate::Result;
use crate::format::Metadata;

/// Staged reads go through a buffer of about this size (whole checksum blocks, so at least
/// one): small enough to stay in cache between the read, the checksum and the copy out.
pub(super) const STAGE_BYTES: u64 = 4 << 20;

/// The staged copies, cut into buffers: the stretches of one file that fit in a buffer
/// together are read in one call (on an object store one request, not one per piece).
pub(super) struct Staged {
    /// In file order; the buffers' stretches name them by position.
    copies: Vec<PieceCopy>,
    pub(super) buffers: Vec<StageBuffer>,
}

/// The stretches of one file read together, and their bytes once read.
pub(super) struct StageBuffer {
    pub(super) file: u32,
    stretches: Vec<Stretch>,
    /// The stretches' bytes in order, when a window of the file read them already.
    pub(super) data: Option<Vec<u8>>,
}

/// What a staged read holds: a file's header, or `lo..hi` of piece `piece` (from its block
/// `first_block` on) for the copies at `copies_at` of the sorted list.
enum Stretch {
    Header { file: u32 },
    Blocks { piece: usize, lo: u64, hi: u64, first_block: u64, copies_at: std::ops::Range<usize> },
}

/// Cuts `copies` into buffers of whole blocks, each file's header (where no window read it,
/// `header_read`, marked as read here) with its first stretch.
pub(super) fn plan_staged(
    meta: &Metadata,
    pieces: &[Stored<'_>],
    mut copies: Vec<PieceCopy>,
    header_read: &mut [bool],
    read_bytes_max: u64,
) -> Staged {
    let block = meta.block_bytes;
    let window = (read_bytes_max.min(STAGE_BYTES) / block).max(1);
    if copies.iter().any(|c| c.rows > 1) {
        copies = copies.iter().flat_map(PieceCopy::each_row).collect();
    }
    // In file order, so that the stretches of a buffer are the nearby ones of one file.
    copies.sort_unstable_by_key(|c| (pieces[c.piece].file, pieces[c.piece].at, c.piece, c.src));
    let (mut buffers, mut bytes, mut start) = (Vec::<StageBuffer>::new(), 0, 0);
    for group in copies.chunk_by(|a, b| a.piece == b.piece) {
        let (piece, group_at) = (group[0].piece, start);
        start += group.len();
        let p = &pieces[piece];
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
                if buffers.last().is_none_or(|s| s.file != p.file || bytes + (hi - lo) > window * block) {
                    buffers.push(StageBuffer { file: p.file, stretches: Vec::new(), data: None });
                    bytes = 0;
                }
                let buf = buffers.last_mut().expect("pushed");
                if !std::mem::replace(&mut header_read[p.file as usize], true) {
                    buf.stretches.push(Stretch::Header { file: p.file });
                }
                let copies_at = group_at..group_at + group.len();
                buf.stretches.push(Stretch::Blocks { piece, lo, hi, first_block: b, copies_at });
                bytes += hi - lo;
                b = e;
            }
        }
    }
    Staged { copies, buffers }
}

impl StageBuffer {
    /// Where each stretch lies in the file, and its length, in order.
    pub(super) fn reads(&self, meta: &Metadata, pieces: &[Stored<'_>]) -> Vec<(u64, u64)> {
        let place = |s: &Stretch| match *s {
            Stretch::Header { file } => (0, meta.files[file as usize].data_start),
            Stretch::Blocks { piece, lo, hi, .. } => (pieces[piece].at + lo, hi - lo),
        };
        self.stretches.iter().map(place).collect()
    }
}

/// Reads each buffer that no window read, verifies every stretch, and copies the pieces'
/// bytes out.
pub(super) fn run_staged(
    storage: &Overlay<'_>,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    staged: Staged,
    dests: &mut [&mut [u8]],
) -> Result<()> {
    let mut scratch = Vec::new();
    for buffer in staged.buffers {
        let f = &meta.files[buffer.file as usize];
        let places = buffer.reads(meta, pieces);
        let data = match buffer.data {
            Some(data) => data,
            None => {
                scratch.resize(places.iter().map(|p| p.1).sum::<u64>() as usize, 0);
                let mut reads: Vec<(u64, &mut [u8])> = Vec::with_capacity(places.len());
                let mut rest = &mut scratch[..];
                for &(at, len) in &places {
                    let (mine, after) = std::mem::take(&mut rest).split_at_mut(len as usize);
                    reads.push((at, mine));
                    rest = after;
                }
                FileReader::open(storage, f)?.read_into(&mut reads)?;
                std::mem::take(&mut scratch)
            }
        };
        let mut rest = &data[..];
        for (s, &(at, len)) in buffer.stretches.iter().zip(&places) {
            let (data, after) = rest.split_at(len as usize);
            rest = after;
            let Stretch::Blocks { piece, lo, hi, first_block, ref copies_at } = *s else {
                verify_header(f, data)?;
                continue;
            };
            verify_blocks(&f.name, at, pieces[piece].crc32, meta.block_bytes, first_block, data)?;
            for c in &staged.copies[copies_at.clone()] {
                let (a, b) = (c.src.max(lo), (c.src + c.len).min(hi));
                if a < b {
                    let d = &mut dests[c.dest];
                    let at = (c.dest_at + a - c.src) as usize;
                    d[at..at + (b - a) as usize].copy_from_slice(&data[(a - lo) as usize..(b - lo) as usize]);
                }
            }
        }
        scratch = data;
    }
    Ok(())
}
