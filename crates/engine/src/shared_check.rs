//! Checksum blocks that several ranks read in parts, checked together.
//!
//! A load that splits a stored chunk between ranks (a row-parallel weight saved at tp 2 and
//! loaded at tp 4 gives each new rank half of every row) would otherwise make every rank
//! read and checksum whole blocks, mostly bytes it does not need. Instead:
//!
//! 1. Each rank offers, for every stored chunk of which it needs only parts of some blocks,
//!    the regions of the chunk it needs ([`Offer`]).
//! 2. The coordinator shares a chunk when the distinct offered regions tile it: pairwise
//!    disjoint, together exactly the chunk ([`decide`]). Ranks offering the same regions
//!    (data-parallel replicas) count once. Chunks that do not tile are read the usual way,
//!    whole blocks, verified locally.
//! 3. Each rank reads exactly its bytes of shared chunks, straight into its buffers, and
//!    sends per block the CRC of its bytes with the rest taken as zero ([`PartCrc`]).
//! 4. The coordinator checks that the ranks with equal regions agree, that the distinct
//!    parts add up to the block, and that they combine to the stored CRC ([`verify`]).
//!
//! Every byte a rank uses is still under the block's CRC; the CRC arithmetic is in
//! [`crate::split_crc`].

use std::collections::{BTreeMap, HashMap};

use dckpt_shard_spec::{Region, overlap_numel};
use serde::{Deserialize, Serialize};

use crate::format::{Metadata, block_crc};
use crate::split_crc;

/// A stored chunk: (index of its tensor in the metadata, index of the chunk in it).
pub type ChunkKey = (u32, u32);

/// A rank's regions of one stored chunk it reads in part (sorted, distinct).
pub type Offer = (ChunkKey, Vec<Region>);

/// One rank's part of one checksum block of a shared chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartCrc {
    pub chunk: ChunkKey,
    pub block: u64,
    /// Bytes of the block the part holds.
    pub bytes: u64,
    /// Raw CRC of the block with every other byte zero ([`split_crc::Part::finish`]).
    pub crc: u32,
}

/// What the coordinator remembers between deciding and verifying: for each shared chunk,
/// each offering rank with the index of its distinct region set.
pub type Shared = HashMap<ChunkKey, Vec<(u32, usize)>>;

/// The part of `a` inside `b` as one region, when it is one: both plain boxes, or both
/// narrowings of the same box. `None` otherwise (the chunk is then read the usual way).
pub fn region_overlap(a: &Region, b: &Region) -> Option<Region> {
    if a.flat.is_none() && b.flat.is_none() {
        return a.box_intersection(b);
    }
    if a.offset != b.offset || a.shape != b.shape {
        return None;
    }
    let (fa, fb) = (a.flat_range(), b.flat_range());
    let (start, stop) = (fa.start.max(fb.start), fa.stop.min(fb.stop));
    (start < stop).then(|| a.box_only().narrowed(start, stop))
}

/// The coordinator's decision: the chunks whose offers tile them, on every rank; `shared`
/// is filled for [`verify`]. Offers naming chunks that are not in the metadata are ignored.
pub fn decide(meta: &Metadata, offers: Vec<Vec<Offer>>, shared: &mut Shared) -> Vec<ChunkKey> {
    let mut by_chunk: BTreeMap<ChunkKey, Vec<(u32, Vec<Region>)>> = BTreeMap::new();
    for (rank, list) in offers.into_iter().enumerate() {
        for (key, regions) in list {
            by_chunk.entry(key).or_default().push((rank as u32, regions));
        }
    }
    let mut out = Vec::new();
    for (key, offered) in by_chunk {
        let Some(chunk) = meta.tensors.get(key.0 as usize).and_then(|t| t.chunks.get(key.1 as usize)) else {
            continue;
        };
        let mut distinct: Vec<&Vec<Region>> = offered.iter().map(|(_, s)| s).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let regions: Vec<&Region> = distinct.iter().flat_map(|s| s.iter()).collect();
        let whole = chunk.region();
        let total = regions.iter().try_fold(0u64, |n, r| n.checked_add(r.numel()));
        let inside = regions.iter().all(|r| overlap_numel(r, &whole) == r.numel());
        let disjoint =
            || (0..regions.len()).all(|i| (i + 1..regions.len()).all(|j| overlap_numel(regions[i], regions[j]) == 0));
        if total != Some(whole.numel()) || !inside || !disjoint() {
            continue;
        }
        let members = offered
            .iter()
            .map(|(rank, s)| (*rank, distinct.binary_search(&s).expect("every offer is among the distinct ones")))
            .collect();
        shared.insert(key, members);
        out.push(key);
    }
    out
}

/// A shared block that does not check out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mismatch {
    pub file: String,
    pub offset: u64,
    pub detail: String,
}

/// One distinct region set's part of a block: (crc, bytes, the first rank that sent it).
type SetPart = (u32, u64, u32);

/// The coordinator's check of every rank's parts against the stored block CRCs.
pub fn verify(meta: &Metadata, shared: &Shared, parts: Vec<Vec<PartCrc>>) -> Result<(), Mismatch> {
    // (chunk, block) -> distinct region set -> its part.
    let mut blocks: BTreeMap<(ChunkKey, u64), BTreeMap<usize, SetPart>> = BTreeMap::new();
    for (rank, list) in parts.into_iter().enumerate() {
        let rank = rank as u32;
        for p in list {
            let (file, offset) = place(meta, p.chunk, p.block);
            // Members are in rank order (`decide`): found by bisection, where a search along
            // them made this world squared for a chunk every data-parallel replica offers.
            let member = |m: &Vec<(u32, usize)>| m.binary_search_by_key(&rank, |(r, _)| *r).ok().map(|i| m[i].1);
            let Some(set) = shared.get(&p.chunk).and_then(member) else {
                return Err(Mismatch {
                    file,
                    offset,
                    detail: format!("rank {rank} sent a part of a block it did not offer"),
                });
            };
            let entry = blocks.entry((p.chunk, p.block)).or_default();
            match entry.get(&set) {
                Some(&(crc, bytes, first)) if (crc, bytes) != (p.crc, p.bytes) => {
                    return Err(Mismatch {
                        file,
                        offset,
                        detail: format!(
                            "ranks {first} and {rank} read different bytes of the same stretches of a block \
                             (crc32 parts {crc:08x} over {bytes} bytes, {:08x} over {} bytes)",
                            p.crc, p.bytes
                        ),
                    });
                }
                Some(_) => {}
                None => {
                    entry.insert(set, (p.crc, p.bytes, rank));
                }
            }
        }
    }
    for ((chunk, block), sets) in blocks {
        let (file, offset) = place(meta, chunk, block);
        let c = &meta.tensors[chunk.0 as usize].chunks[chunk.1 as usize];
        let len = chunk_bytes(meta, chunk).saturating_sub(block.saturating_mul(meta.block_bytes)).min(meta.block_bytes);
        let bytes = sets.values().fold(0u64, |n, v| n.saturating_add(v.1));
        let ranks: Vec<u32> = sets.values().map(|v| v.2).collect();
        if bytes != len {
            return Err(Mismatch {
                file,
                offset,
                detail: format!("ranks {ranks:?} read {bytes} bytes of a {len}-byte block between them"),
            });
        }
        let combined = split_crc::combine(sets.values().fold(0, |x, v| x ^ v.0), len);
        let stored = block_crc(&c.crc32, block);
        if stored != Some(combined) {
            let stored = stored.map_or("none".to_string(), |s| format!("{s:08x}"));
            return Err(Mismatch {
                file,
                offset,
                detail: format!(
                    "{len} bytes read in parts by ranks {ranks:?}: stored crc32 {stored}, computed {combined:08x}"
                ),
            });
        }
    }
    Ok(())
}

/// Bytes of a stored chunk.
fn chunk_bytes(meta: &Metadata, (ti, ci): ChunkKey) -> u64 {
    let t = &meta.tensors[ti as usize];
    t.chunks[ci as usize].region().numel() * t.dtype.size()
}

/// The file and file offset of a block, for messages.
fn place(meta: &Metadata, (ti, ci): ChunkKey, block: u64) -> (String, u64) {
    match meta.tensors.get(ti as usize).and_then(|t| t.chunks.get(ci as usize)) {
        Some(c) => (
            meta.files.get(c.file as usize).map_or_else(|| format!("file #{}", c.file), |f| f.name.clone()),
            c.at.saturating_add(block.saturating_mul(meta.block_bytes)),
        ),
        None => (format!("chunk {ti}/{ci}"), 0),
    }
}

/// This rank's parts of the blocks of one shared chunk: `stretches` are (byte offset in the
/// chunk, bytes, their [`split_crc::raw`] CRC), in increasing order, not overlapping, none
/// across a block boundary.
pub fn parts_of(chunk: ChunkKey, chunk_len: u64, block: u64, stretches: &[(u64, u64, u32)], out: &mut Vec<PartCrc>) {
    let mut current: Option<(u64, split_crc::Part)> = None;
    for &(at, len, raw) in stretches {
        let b = at / block;
        debug_assert!(len > 0 && (at + len - 1) / block == b, "a stretch inside one block");
        match &mut current {
            Some((cb, _)) if *cb == b => {}
            _ => {
                if let Some((cb, p)) = current.take() {
                    out.push(PartCrc { chunk, block: cb, bytes: p.bytes(), crc: p.finish() });
                }
                let end = ((b + 1) * block).min(chunk_len);
                current = Some((b, split_crc::Part::new(end - b * block)));
            }
        }
        let (_, part) = current.as_mut().expect("set just above");
        part.add_raw(at - b * block, len, raw);
    }
    if let Some((cb, p)) = current {
        out.push(PartCrc { chunk, block: cb, bytes: p.bytes(), crc: p.finish() });
    }
}
