//! Picked reads, on a store that reads in place (local disk with mapped reads): the
//! checksum blocks a partial copy touches (a column split's rows, the ends of a row split)
//! are shown whole and checked here, and only the copy's bytes are taken out of them.
//!
//! Elsewhere such copies go through the staging buffer, or are checked in parts with the
//! other ranks. In place, passing over a whole block costs no copy, and it is faster than
//! either: a rank that checks only its half of every row reads memory in a stride that
//! stalls on each row, while the whole block streams (docs/benchmarks.md, "Picked reads").

use super::overlay::Overlay;

use super::{blocks::*, plan::*};
use crate::Result;
use crate::format::Metadata;

/// Bytes of one row of a copy, from offset `src` of stored piece `piece`, and where they go.
pub(super) struct Pick<'d> {
    pub(super) piece: usize,
    pub(super) src: u64,
    pub(super) buf: &'d mut [u8],
}

/// Reads `picks` (a list per copy, each in file order), file by file: each run of picks
/// whose blocks touch is one picked read of those blocks, checked block by block; the
/// header of a file that no other stage read (`header_read`) is read and checked first.
pub(super) fn run_picked(
    storage: &Overlay<'_>,
    meta: &Metadata,
    pieces: &[Stored<'_>],
    mut copies: Vec<Vec<Pick<'_>>>,
    header_read: &[bool],
) -> Result<()> {
    let block = meta.block_bytes;
    let place = |p: &Pick<'_>| (pieces[p.piece].file, pieces[p.piece].at + p.src);
    // The copies in file order, then their rows: sorted unless two copies' rows interleave.
    copies.sort_unstable_by_key(|c| c.first().map(place));
    let mut picks: Vec<Pick<'_>> = copies.into_iter().flatten().collect();
    if !picks.is_sorted_by_key(place) {
        picks.sort_by_key(place);
    }
    for same_file in picks.chunk_by_mut(|a, b| pieces[a.piece].file == pieces[b.piece].file) {
        let fi = pieces[same_file[0].piece].file as usize;
        let f = &meta.files[fi];
        let mut reader = FileReader::open(storage, f)?;
        if !header_read[fi] {
            let mut header = vec![0u8; f.data_start as usize];
            reader.read_into(&mut [(0, &mut header[..])])?;
            verify_header(f, &header)?;
        }
        for run in runs(same_file, pieces, block) {
            let p = &pieces[run[0].piece];
            let (lo, hi) = blocks_of(run, p.len, block);
            let mut reads: Vec<(u64, &mut [u8])> = run.iter_mut().map(|k| (p.at + k.src, &mut *k.buf)).collect();
            let mut check = BlockCheck::new(&f.name, p.at + lo, p.crc32, block, lo / block);
            let mut failed = None;
            reader.read_picked_inspected(p.at + lo..p.at + hi, &mut reads, &mut |bytes| {
                if failed.is_none() {
                    failed = check.update(bytes).err();
                }
            })?;
            if let Some(e) = failed {
                return Err(e);
            }
            check.finish()?;
        }
    }
    Ok(())
}

/// The picks of one file (in file order) cut into runs: picks of one piece, each after the
/// one before it, whose blocks touch. A pick that takes bytes an earlier one took (one
/// stored stretch into two requests) starts a run of its own, which reads its blocks again.
fn runs<'p, 'd>(picks: &'p mut [Pick<'d>], pieces: &[Stored<'_>], block: u64) -> Vec<&'p mut [Pick<'d>]> {
    let mut lens = Vec::new();
    let mut i = 0;
    while i < picks.len() {
        let piece = picks[i].piece;
        let mut end = picks[i].src + picks[i].buf.len() as u64;
        let mut hi = blocks_of(&picks[i..=i], pieces[piece].len, block).1;
        let mut j = i + 1;
        while let Some(n) = picks.get(j).filter(|n| n.piece == piece && n.src >= end && n.src / block * block <= hi) {
            end = n.src + n.buf.len() as u64;
            hi = hi.max(blocks_of(std::slice::from_ref(n), pieces[piece].len, block).1);
            j += 1;
        }
        lens.push(j - i);
        i = j;
    }
    let mut out = Vec::with_capacity(lens.len());
    let mut rest = picks;
    for n in lens {
        let (run, after) = rest.split_at_mut(n);
        out.push(run);
        rest = after;
    }
    out
}

/// The block-aligned stretch of a piece of `piece_len` bytes that `run` (in order) touches.
fn blocks_of(run: &[Pick<'_>], piece_len: u64, block: u64) -> (u64, u64) {
    let first = &run[0];
    let end = run.iter().map(|p| p.src + p.buf.len() as u64).max().unwrap_or(first.src);
    (first.src / block * block, end.div_ceil(block).saturating_mul(block).min(piece_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(len: u64) -> Stored<'static> {
        Stored { chunk: None, file: 0, at: 0, len, crc32: &[] }
    }

    /// Picks whose blocks touch are one run; a gap of a whole block, another piece, or bytes
    /// taken twice start a new one.
    #[test]
    fn runs_join_picks_whose_blocks_touch() {
        let pieces = [stored(100), stored(50)];
        let mut bufs: Vec<Vec<u8>> = [3, 4, 2, 5, 5, 4].iter().map(|&n| vec![0u8; n]).collect();
        let at = [(0, 1), (0, 12), (0, 19), (0, 45), (0, 47), (1, 0)];
        let mut picks: Vec<Pick<'_>> =
            bufs.iter_mut().zip(at).map(|(b, (piece, src))| Pick { piece, src, buf: b }).collect();
        let got: Vec<Vec<u64>> =
            runs(&mut picks, &pieces, 10).iter().map(|r| r.iter().map(|p| p.src).collect()).collect();
        // 1..4 (block 0), 12..16 and 19..21 (blocks 1-2) touch; 45..50 is past a gap; 47 takes
        // bytes 45..50 took; piece 1 is another piece.
        assert_eq!(got, vec![vec![1, 12, 19], vec![45], vec![47], vec![0]]);
        assert_eq!(blocks_of(&picks[..3], 100, 10), (0, 30));
        assert_eq!(blocks_of(&picks[4..5], 100, 10), (40, 60));
        assert_eq!(blocks_of(&picks[3..4], 48, 10), (40, 48), "a short last block");
    }
}
