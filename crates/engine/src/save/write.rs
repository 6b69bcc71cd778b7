//! Phase 2: every rank streams its pieces into its data files.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use dckpt_shard_spec::Dims;
use dckpt_storage::{Pipe, PipeOptions, Storage, write_pipelined};
use serde::{Deserialize, Serialize};

use crate::format::{
    BlockCrc, FileMeta, SAFETENSORS_HEADER_BYTES_MAX, SafetensorsEntry, data_file_name, safetensors_header,
};
use crate::plan::RankWrites;
use crate::{Error, Result};

use super::*;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(super) struct WriteResult {
    /// The rank's data files, in order (none when it wrote nothing).
    pub(super) files: Vec<FileMeta>,
    /// Each written tensor chunk, then each written object, in write order.
    pub(super) pieces: Vec<PieceWritten>,
    /// Every piece's block checksums, back to back (one buffer, not one per piece).
    pub(super) crcs: serde_bytes::ByteBuf,
}

/// Where a rank wrote one piece.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct PieceWritten {
    /// Which of the rank's files holds it.
    pub(super) file: u32,
    /// Its byte offset in that file.
    pub(super) at: u64,
    /// Where its block checksums end in the rank's `crcs` (they start where the previous
    /// piece's end).
    pub(super) crcs_end: u64,
}

/// A chunk's entry in its data file's safetensors header: named `key@region`, shaped as
/// its box (or flat, for a narrowed region).
pub(super) fn tensor_entry(
    key: &str,
    region: &dckpt_shard_spec::Region,
    dtype: dckpt_shard_spec::DType,
    len: u64,
) -> SafetensorsEntry {
    let shape = if region.is_whole_box() { region.shape.clone() } else { Dims::from([region.numel()]) };
    SafetensorsEntry { name: crate::format::chunk_entry_name(key, region), dtype, shape, len }
}

pub(super) fn object_entry(key: &str, grid_offset: &[u64], len: u64) -> SafetensorsEntry {
    SafetensorsEntry {
        name: format!("{key}@object{grid_offset:?}"),
        dtype: dckpt_shard_spec::DType::U8,
        shape: Dims::from([len]),
        len,
    }
}

pub(super) fn rank_header(entries: &[SafetensorsEntry], save_id: &str, rank: usize) -> Vec<u8> {
    let meta = BTreeMap::from([
        ("format".to_string(), "dckpt".to_string()),
        ("save_id".to_string(), save_id.to_string()),
        ("rank".to_string(), rank.to_string()),
    ]);
    safetensors_header(entries, &meta)
}

/// One data file of a rank: which of its pieces (in file order) it holds, and its header.
pub(super) struct FileCut {
    pub(super) pieces: std::ops::Range<usize>,
    pub(super) header: Vec<u8>,
}

impl FileCut {
    pub(super) fn meta(&self, bytes: u64, save_id: &str, rank: usize, file: usize) -> FileMeta {
        FileMeta {
            name: data_file_name(save_id, rank, file),
            bytes,
            data_start: self.header.len() as u64,
            header_crc32: crc32fast::hash(&self.header),
        }
    }
}

/// A rank's pieces (in file order) cut into data files: one file when `max` is `None`, else
/// consecutive runs that keep each file, header included, within `max` bytes, where the
/// pieces allow (a piece larger than that gets a file of its own). No pieces, no files.
pub(super) fn cut_files(entries: &[SafetensorsEntry], save_id: &str, rank: usize, max: Option<u64>) -> Vec<FileCut> {
    cut_files_within(entries, save_id, rank, max, 8 + SAFETENSORS_HEADER_BYTES_MAX)
}

/// [`cut_files`] with headers of at most `header_max` bytes (where a run holds more than one
/// piece).
fn cut_files_within(
    entries: &[SafetensorsEntry],
    save_id: &str,
    rank: usize,
    max: Option<u64>,
    header_max: u64,
) -> Vec<FileCut> {
    let max = max.unwrap_or(u64::MAX);
    let mut files = Vec::new();
    let mut start = 0;
    while start < entries.len() {
        // The longest run whose data fits, then shorter by about what the header overshoots
        // (a header is a small fraction of the file: it is built two or three times).
        let (mut end, mut data) = (start + 1, entries[start].len);
        while let Some(e) = entries.get(end).filter(|e| data.saturating_add(e.len) <= max) {
            data += e.len;
            end += 1;
        }
        loop {
            let header = rank_header(&entries[start..end], save_id, rank);
            let size = header.len() as u64 + data;
            // A header past safetensors' bound is refused by every reader (a rank of a
            // million pieces): such a run is cut into files too.
            let header_over = (header.len() as u64).saturating_sub(header_max);
            if (size <= max && header_over == 0) || end == start + 1 {
                files.push(FileCut { pieces: start..end, header });
                break;
            }
            let header_per_piece = header.len() as u64 / (end - start) as u64 + 1;
            let mut excess = size.saturating_sub(max).max(header_over);
            while end > start + 1 && excess > 0 {
                end -= 1;
                data -= entries[end].len;
                let freed = if header_over > 0 { header_per_piece } else { entries[end].len + header_per_piece };
                excess = excess.saturating_sub(freed);
            }
        }
        start = end;
    }
    files
}

/// About how many bytes are checksummed and then handed to the writer at once.
pub(super) const WRITE_BATCH_BYTES: usize = 8 << 20;

/// Data files of one rank written at once where the store's `writes_in_flight` hint says
/// nothing. On an object store each file is one request buffered whole (at most the store's
/// `object_bytes_max` hint), so this bounds that memory and keeps several requests in
/// flight. A store with the hint (local disk) gets as many at once, and a large rank's
/// output cut into about as many files ([`file_bytes_max`]).
pub(super) const FILES_IN_FLIGHT: usize = 4;

/// The least a file cut only so that several are written at once holds: smaller ones gain
/// little, and each costs a header, an open, an fsync and an entry in the metadata.
pub(super) const SPLIT_FILE_BYTES_MIN: u64 = 128 << 20;

/// The most bytes one data file of a rank holds, for pieces `entries` on a store with
/// `hints`: the store's `object_bytes_max`, and where it gains from writing several files at
/// once, a share of the rank's bytes that cuts them into about that many files (the share
/// of each plus the largest piece, so that cutting at piece boundaries needs no file more;
/// at least [`SPLIT_FILE_BYTES_MIN`]). `None`: one file.
pub(super) fn file_bytes_max(hints: &dckpt_storage::StorageHints, entries: &[SafetensorsEntry]) -> Option<u64> {
    let total: u64 = entries.iter().map(|e| e.len).sum();
    let largest = entries.iter().map(|e| e.len).max().unwrap_or(0);
    let share = hints
        .writes_in_flight
        .filter(|&n| n > 1 && total >= 2 * SPLIT_FILE_BYTES_MIN)
        .map(|n| (total.div_ceil(n as u64) + largest).max(SPLIT_FILE_BYTES_MIN));
    match (hints.object_bytes_max, share) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Writes this rank's pieces into its data files (none when it has nothing to write).
/// On failure the files it finished are removed again.
pub(super) fn write_rank_files(
    storage: &dyn Storage,
    state: &SaveState<'_>,
    sourced: &[SourcedTensor<'_>],
    writes: &RankWrites,
    save_id: &str,
    rank: usize,
    block_bytes: u64,
) -> Result<WriteResult> {
    let (entries, data) = rank_pieces(state, sourced, writes)?;
    let hints = storage.hints();
    let cuts = cut_files(&entries, save_id, rank, file_bytes_max(&hints, &entries));
    // As many at once as the store gains from, so that the files cut for it go together.
    let in_flight = hints.writes_in_flight.unwrap_or(FILES_IN_FLIGHT).max(1);
    // Workers take the next file until none is left or one failed.
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let work = || {
        let mut mine = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(cut) = cuts.get(i).filter(|_| !failed.load(Ordering::Relaxed)) else {
                return mine;
            };
            let res = write_file(storage, cut, &data[cut.pieces.clone()], save_id, rank, i, block_bytes);
            failed.fetch_or(res.is_err(), Ordering::Relaxed);
            mine.push((i, res));
        }
    };
    let mut done: Vec<(usize, Result<WrittenFile>)> = crate::threads::on_threads(in_flight.min(cuts.len()), work)
        .into_iter()
        .flat_map(|w| {
            w.unwrap_or_else(|_| vec![(0, Err(Error::internal("a write thread panicked").on_rank(rank as u32)))])
        })
        .collect();
    done.sort_by_key(|d| d.0);
    let (result, first_err) = merge_files(done);
    if let Some(e) = first_err {
        for f in &result.files {
            let _ = storage.delete(&f.name);
        }
        return Err(e);
    }
    Ok(result)
}

/// The safetensors entries of a rank's pieces, and their bytes, in file order: its tensor
/// chunks (borrowed, then sourced), then its objects.
fn rank_pieces<'a>(
    state: &SaveState<'a>,
    sourced: &[SourcedTensor<'a>],
    writes: &RankWrites,
) -> Result<(Vec<SafetensorsEntry>, Vec<Piece<'a>>)> {
    let mut entries = Vec::with_capacity(writes.chunks());
    let mut data: Vec<Piece<'a>> = Vec::with_capacity(writes.chunks());
    // Tensor indices past the borrowed pieces name the sourced ones, in the order the local
    // plan listed them.
    let borrowed = state.tensors.len();
    for &i in &writes.tensors {
        let i = i as usize;
        if let Some(t) = state.tensors.get(i) {
            entries.push(tensor_entry(&t.tensor.key, &t.tensor.region, t.tensor.dtype, t.data.len() as u64));
            data.push(Piece::Bytes(t.data));
        } else {
            let t = i
                .checked_sub(borrowed)
                .and_then(|j| sourced.get(j))
                .ok_or_else(|| Error::protocol(format!("write of tensor {i}")))?;
            let len = t.tensor.nbytes();
            entries.push(tensor_entry(&t.tensor.key, &t.tensor.region, t.tensor.dtype, len));
            data.push(Piece::Sourced { source: t.source, len });
        }
    }
    for &i in &writes.objects {
        let o = state.objects.get(i as usize).ok_or_else(|| Error::protocol(format!("write of object {i}")))?;
        entries.push(object_entry(&o.object.key, &o.object.grid_offset, o.data.len() as u64));
        data.push(Piece::Bytes(o.data));
    }
    Ok((entries, data))
}

/// The files a rank wrote, in order, as one result, and the first error, if any (the files
/// then are those written all the same, for removal).
fn merge_files(done: Vec<(usize, Result<WrittenFile>)>) -> (WriteResult, Option<Error>) {
    let mut result = WriteResult::default();
    let mut first_err = None;
    for (i, res) in done {
        match res {
            Ok(WrittenFile { meta, pieces, crcs }) => {
                result.files.push(meta);
                let before = result.crcs.len() as u64;
                let file = i as u32;
                result.pieces.extend(pieces.into_iter().map(|p| PieceWritten {
                    file,
                    at: p.at,
                    crcs_end: before + p.crcs_end,
                }));
                if result.crcs.is_empty() {
                    result.crcs = serde_bytes::ByteBuf::from(crcs);
                } else {
                    result.crcs.extend_from_slice(&crcs);
                }
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    (result, first_err)
}

/// A data file as written.
pub(super) struct WrittenFile {
    pub(super) meta: FileMeta,
    /// Each piece's offset in the file and where its block checksums end in `crcs`
    /// (`file` is 0: the caller knows which file this is).
    pub(super) pieces: Vec<PieceWritten>,
    pub(super) crcs: Vec<u8>,
}

/// One piece's bytes as the writer gets them: borrowed from the caller, or pulled from a
/// [`PieceSource`] into bounce buffers as the file is written.
#[derive(Clone, Copy)]
pub(super) enum Piece<'a> {
    Bytes(&'a [u8]),
    Sourced { source: &'a dyn PieceSource, len: u64 },
}

impl Piece<'_> {
    fn len(&self) -> u64 {
        match self {
            Piece::Bytes(b) => b.len() as u64,
            Piece::Sourced { len, .. } => *len,
        }
    }
}

/// Bounce buffers of a sourced piece in use at once: one being filled, one queued, one being
/// written.
const BOUNCE_BUFFERS: usize = 3;

/// How a data file is written: one batch queued while one is written and the next
/// checksummed; sourced pieces through [`BOUNCE_BUFFERS`] buffers of a batch each.
/// A rank's file of at most a MiB (the many small files of a large world) is written on
/// its own thread.
const PIPE: PipeOptions =
    PipeOptions { queue: 1, buffers: BOUNCE_BUFFERS, buffer_bytes: WRITE_BATCH_BYTES, inline_bytes: 1 << 20 };

/// Streams one data file: its header, then its pieces' bytes, each piece's blocks
/// checksummed on the way.
pub(super) fn write_file(
    storage: &dyn Storage,
    cut: &FileCut,
    data: &[Piece<'_>],
    save_id: &str,
    rank: usize,
    file: usize,
    block_bytes: u64,
) -> Result<WrittenFile> {
    let data_start = cut.header.len() as u64;
    let total = data_start + data.iter().map(Piece::len).sum::<u64>();
    let meta = cut.meta(total, save_id, rank, file);
    let (pieces, crcs) = write_pipelined(storage, &meta.name, total, PIPE, |pipe| {
        pipe.write(&cut.header)?;
        fill_file(pipe, data, data_start, block_bytes)
    })?;
    Ok(WrittenFile { meta, pieces, crcs })
}

/// Hands a data file's pieces to `pipe`, from `data_start` on; returns where each piece is
/// and its block checksums.
///
/// The bytes go out in batches of about WRITE_BATCH_BYTES (a large tensor in several, many
/// small ones in one), each checksummed just before it is handed over, while the bytes are
/// hot. The pipe's thread writes batch i while this one checksums batch i + 1; on local disk
/// a batch is one vectored write straight from the caller's memory.
fn fill_file<'a>(
    pipe: &mut Pipe<'_, 'a>,
    data: &[Piece<'a>],
    data_start: u64,
    block_bytes: u64,
) -> Result<(Vec<PieceWritten>, Vec<u8>)> {
    let mut pieces = Vec::with_capacity(data.len());
    let mut crcs = Vec::with_capacity(4 * data.len());
    let mut pos = data_start;
    let mut batch: Vec<&[u8]> = Vec::new();
    let mut batch_bytes = 0;
    for d in data {
        let mut blocks = BlockCrc::new(block_bytes);
        match *d {
            Piece::Bytes(d) => {
                for part in d.chunks(WRITE_BATCH_BYTES) {
                    blocks.update(part);
                    batch.push(part);
                    batch_bytes += part.len();
                    if batch_bytes >= WRITE_BATCH_BYTES {
                        batch_bytes = 0;
                        pipe.write_vectored(std::mem::take(&mut batch))?;
                    }
                }
            }
            Piece::Sourced { source, len } => {
                // Borrowed bytes before it go first, so the file keeps its order.
                batch_bytes = 0;
                if !batch.is_empty() {
                    pipe.write_vectored(std::mem::take(&mut batch))?;
                }
                let mut at = 0u64;
                while at < len {
                    let n = (len - at).min(WRITE_BATCH_BYTES as u64) as usize;
                    pipe.fill(n, |buf| {
                        source.read_at(at, buf)?;
                        blocks.update(buf);
                        Ok::<(), Error>(())
                    })?;
                    at += n as u64;
                }
            }
        }
        blocks.finish_into(&mut crcs);
        pieces.push(PieceWritten { file: 0, at: pos, crcs_end: crcs.len() as u64 });
        pos += d.len();
    }
    if !batch.is_empty() {
        pipe.write_vectored(batch)?;
    }
    Ok((pieces, crcs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dckpt_storage::StorageHints;

    fn entries(n: usize, len: u64) -> Vec<SafetensorsEntry> {
        (0..n)
            .map(|i| SafetensorsEntry {
                name: format!("w{i}@[0:{len}]"),
                dtype: dckpt_shard_spec::DType::U8,
                shape: Dims::from([len]),
                len,
            })
            .collect()
    }

    /// A store that gains from writing several files at once gets a large rank's output in
    /// about that many files, and no more; a small one stays one file, and an object
    /// store's size limit still holds.
    #[test]
    fn a_large_rank_writes_about_as_many_files_as_the_store_writes_at_once() {
        let local = StorageHints::NONE.with_writes_in_flight(Some(4));
        let big = entries(64, 16 << 20);
        let max = file_bytes_max(&local, &big);
        assert_eq!(max, Some((256 << 20) + (16 << 20)));
        assert_eq!(cut_files(&big, "id", 0, max).len(), 4);
        // Uneven pieces: still 4 files, none past the share.
        let mut uneven = entries(40, 3 << 20);
        uneven.extend(entries(30, 29 << 20));
        assert_eq!(cut_files(&uneven, "id", 0, file_bytes_max(&local, &uneven)).len(), 4);

        let small = entries(10, 16 << 20);
        assert_eq!(file_bytes_max(&local, &small), None, "160 MiB: one file");
        assert_eq!(file_bytes_max(&StorageHints::NONE, &big), None);
        assert_eq!(file_bytes_max(&local.with_object_bytes_max(Some(100 << 20)), &big), Some(100 << 20));
        assert_eq!(file_bytes_max(&StorageHints::NONE.with_object_bytes_max(Some(7)), &small), Some(7));
    }

    /// A rank of more pieces than one header may describe (safetensors' bound, which every
    /// reader holds) writes several files, each header within it, every piece once; with no
    /// limit on a file's bytes too. Such a save committed files no reader would open.
    #[test]
    fn headers_stay_within_the_bound_readers_hold() {
        let many = entries(1000, 4);
        let one = cut_files_within(&many, "id", 0, None, u64::MAX);
        assert_eq!(one.len(), 1);
        let bound = one[0].header.len() as u64 / 3;
        let cut = cut_files_within(&many, "id", 0, None, bound);
        assert!(cut.len() >= 3, "{} files", cut.len());
        assert!(cut.iter().all(|f| f.header.len() as u64 <= bound));
        let pieces: Vec<usize> = cut.iter().flat_map(|f| f.pieces.clone()).collect();
        assert_eq!(pieces, (0..1000).collect::<Vec<_>>());
    }
}
