//! Staged reads: partial checksum blocks through a small buffer, verified, then copied out.

use dckpt_storage::Storage;

use super::{blocks::*, plan::*};
use crate::Result;
use crate::format::Metadata;

/// Staged reads go through a buffer of about this size (whole checksum blocks, so at least
/// one): small enough to stay in cache between the read, the checksum and the copy out.
pub(super) const STAGE_BYTES: u64 = 4 << 20;

pub(super) fn execute_partial(
    storage: &dyn Storage,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    mut copies: Vec<PieceCopy>,
    dests: &mut [&mut [u8]],
    read_bytes_max: u64,
) -> Result<u64> {
    let block = meta.block_bytes;
    let window = (read_bytes_max.min(STAGE_BYTES) / block).max(1);
    if copies.iter().any(|c| c.rows > 1) {
        copies = copies.iter().flat_map(PieceCopy::each_row).collect();
    }
    copies.sort_unstable_by_key(|c| (c.piece, c.src));
    let mut buf: Vec<u8> = Vec::new();
    let mut bytes_read = 0;
    for group in copies.chunk_by(|a, b| a.piece == b.piece) {
        let p = &pieces[group[0].piece];
        let f = &meta.files[p.file as usize];
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
                buf.resize((hi - lo) as usize, 0);
                storage.read_into(&f.name, &mut [(p.at + lo, &mut buf[..])])?;
                bytes_read += hi - lo;
                verify_blocks(&f.name, p.at + lo, p.crc32, block, b, &buf)?;
                for c in group {
                    let (s, t) = (c.src.max(lo), (c.src + c.len).min(hi));
                    if s < t {
                        let d = &mut dests[c.dest];
                        let at = (c.dest_at + s - c.src) as usize;
                        d[at..at + (t - s) as usize].copy_from_slice(&buf[(s - lo) as usize..(t - lo) as usize]);
                    }
                }
                b = e;
            }
        }
    }
    Ok(bytes_read)
}
