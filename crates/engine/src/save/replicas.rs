//! The replica check: pieces that ranks describe as copies of one region must hold the same
//! bytes.
//!
//! Shapes, offsets and replica ids can be self-consistent while the bytes are not: the
//! tensor-parallel shards of an expert weight described as replicas of one tensor of
//! 1/ETP the size pass every coverage check, and a save would keep one shard and drop the
//! others. Only the bytes tell, so every holder of a replicated chunk sends a CRC-32 of its
//! copy to the coordinator, which compares each replica with the main copy before any data
//! byte is written.
//!
//! The sets compared are the plan's [`ReplicaSet`]s: exact (key, region) matches of a main
//! piece. A replica whose region is no main piece's region (say, a replica of a larger box
//! that holds a stored chunk) is not compared: its bytes are neither written nor read, and
//! comparing on intersections would cost a region algebra per pair on the coordinator for a
//! case no framework produces.
//!
//! Objects are compared too (the copies at one key and grid offset), whole, as each holder's
//! [`ObjectCompare`] says: by their bytes, by a digest of a canonical form the caller
//! computed (equal JSON objects can list their keys in another order), or not at all (equal
//! Python objects can pickle to different bytes). A value that differs between ranks
//! described as replicas of one object would otherwise be saved as the main copy's alone.
//!
//! Each rank sends one `u32` per piece of its check list (its pieces that belong to a set,
//! ascending): for a tensor, the CRC of the bytes [`ReplicaCheck::compared`] names, which are
//! the same on every holder of a set (they depend on the save id, the key and the region
//! only); for an object, [`object_value`]. The coordinator knows each set's position in those
//! lists from the plan ([`CheckSet`]).

use dckpt_shard_spec::Region;

use crate::plan::{ReplicaSet, SavePlan};
use crate::{Error, ErrorKind, Result};

use super::{ObjectCompare, ObjectData, SaveState, SourcedTensor};

/// Which bytes of the chunks that several ranks hold a save compares across their holders
/// (see [`SaveOptions::replica_check`](super::SaveOptions::replica_check)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ReplicaCheck {
    /// Every byte of every chunk that several ranks hold.
    All,
    /// Every such chunk on a window of [`SAMPLE_WINDOW_BYTES`] (the whole chunk when it is
    /// smaller), and about `fraction` (0 to 1) of them on all their bytes, a different sample
    /// and different windows at each save. Both are placed by a hash of the save's id, the
    /// chunk's key and its region ([`ReplicaCheck::compared`]), so every holder picks the
    /// same bytes without talking. Copies that differ throughout (the shards of a split
    /// tensor described as replicas) are caught at every save; a difference in a few bytes
    /// is caught when its chunk is in the sample or its window.
    Sample {
        /// The share of chunks compared whole, 0 to 1.
        fraction: f64,
    },
    /// None: replicas are trusted. For a caller that already proved its replicas identical
    /// and does not want to pay for reading them, or one that saves non-main copies known to
    /// be stale (only the main copies are written).
    Off,
}

/// The bytes of each chunk that [`ReplicaCheck::Sample`] compares at least.
pub const SAMPLE_WINDOW_BYTES: u64 = 16 << 10;

impl Default for ReplicaCheck {
    /// A sample of a tenth of the chunks, and a window of every other one: checking every
    /// byte made a save whose every byte two ranks hold about 5 to 20% slower (it reads
    /// every replica, so the cost grows with the number of holders); this catches split
    /// tensors described as replicas at every save for a small fraction of that.
    fn default() -> Self {
        ReplicaCheck::Sample { fraction: 0.1 }
    }
}

impl ReplicaCheck {
    /// The bytes of `key`'s `region` (a piece of `len` bytes) that a save with id `save_id`
    /// compares across their holders: all of them, a window of them, or none (`None`).
    pub fn compared(&self, save_id: &str, key: &str, region: &Region, len: u64) -> Option<std::ops::Range<u64>> {
        match *self {
            ReplicaCheck::All => Some(0..len),
            ReplicaCheck::Off => None,
            ReplicaCheck::Sample { fraction } => {
                let mut h = crc32fast::Hasher::new();
                h.update(save_id.as_bytes());
                h.update(&[0]);
                h.update(key.as_bytes());
                h.update(&[0]);
                for v in region.offset.iter().chain(region.shape.iter()) {
                    h.update(&v.to_le_bytes());
                }
                if let Some(f) = region.flat {
                    h.update(&f.start.to_le_bytes());
                    h.update(&f.stop.to_le_bytes());
                }
                // A CRC is linear; the finalizer spreads it so that chunks that differ in
                // one offset are sampled independently.
                let x = mix(u64::from(h.finalize()));
                if ((x >> 11) as f64 / (1u64 << 53) as f64) < fraction || len <= SAMPLE_WINDOW_BYTES {
                    return Some(0..len);
                }
                let start = mix(x) % (len - SAMPLE_WINDOW_BYTES + 1);
                Some(start..start + SAMPLE_WINDOW_BYTES)
            }
        }
    }

    pub(super) fn check(&self) -> Result<()> {
        match *self {
            ReplicaCheck::Sample { fraction } if !(0.0..=1.0).contains(&fraction) => Err(Error::invalid_options(
                format!("replica check sample fraction {fraction}: must be between 0 and 1"),
            )),
            _ => Ok(()),
        }
    }
}

/// The splitmix64 finalizer.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A [`ReplicaSet`] as the coordinator compares it: each holder as (rank, position in that
/// rank's check list).
#[derive(Debug, Clone)]
pub(super) struct CheckSet {
    at: u32,
    object: bool,
    main: (u32, u32),
    replicas: Vec<(u32, u32)>,
}

/// From a plan's replica sets: every rank's check list (its piece indices that belong to a
/// set, ascending) and the sets by position in those lists.
pub(super) fn check_lists(plan: &SavePlan) -> (Vec<Vec<u32>>, Vec<CheckSet>) {
    let mut lists: Vec<Vec<u32>> = vec![Vec::new(); plan.ranks.len()];
    for s in &plan.replicas {
        for &(rank, item) in std::iter::once(&s.main).chain(&s.replicas) {
            lists[rank as usize].push(item);
        }
    }
    for l in &mut lists {
        l.sort_unstable();
        l.dedup();
    }
    let pos = |&(rank, item): &(u32, u32)| {
        let p = lists[rank as usize].binary_search(&item).expect("every holder is in its rank's list");
        (rank, p as u32)
    };
    let sets = plan
        .replicas
        .iter()
        .map(|s: &ReplicaSet| CheckSet {
            at: s.at,
            object: s.object,
            main: pos(&s.main),
            replicas: s.replicas.iter().map(pos).collect(),
        })
        .collect();
    (lists, sets)
}

/// This rank's checksums: one per piece of its check list; none at all when the check is off.
pub(super) fn local_crcs(
    state: &SaveState<'_>,
    sourced: &[SourcedTensor<'_>],
    list: &[u32],
    mode: ReplicaCheck,
    save_id: &str,
) -> Result<Vec<u32>> {
    if mode == ReplicaCheck::Off {
        return Ok(Vec::new());
    }
    // The plan numbers a rank's pieces borrowed first, then sourced, then its objects.
    let borrowed = state.tensors.len();
    list.iter()
        .map(|&i| {
            let i = i as usize;
            if let Some(t) = state.tensors.get(i) {
                return Ok(match mode.compared(save_id, &t.tensor.key, &t.tensor.region, t.data.len() as u64) {
                    Some(r) => crc32fast::hash(t.data.get(r.start as usize..r.end as usize).unwrap_or_default()),
                    None => 0,
                });
            }
            // A missing index is the coordinator's to report: the lists came from its plan.
            let Some(t) = i.checked_sub(borrowed).and_then(|j| sourced.get(j)) else {
                // A rank's objects follow its tensors among its pieces.
                let object = i.checked_sub(borrowed + sourced.len()).and_then(|j| state.objects.get(j));
                return Ok(object.map_or(0, object_value));
            };
            // A read that fails is this rank's error, on every rank: sent as a checksum that
            // cannot match, it failed the save as replicas that differ, and the save stopped
            // before the write that would have named it.
            match mode.compared(save_id, &t.tensor.key, &t.tensor.region, t.tensor.nbytes()) {
                // The caller's source may panic: an unwind here left the others in the round.
                Some(r) => crate::error::panic_as_error("a read of a sourced piece", || sourced_crc(t, r)),
                None => Ok(0),
            }
        })
        .collect()
}

/// What a rank sends for its copy of an object: 0 for a copy not compared, else a CRC-32
/// (of its bytes, or the caller's digest) with its top bit set, so that a copy compared and
/// one not never look alike.
fn object_value(o: &ObjectData<'_>) -> u32 {
    const COMPARED: u32 = 1 << 31;
    match o.compare {
        ObjectCompare::Bytes => crc32fast::hash(o.data) | COMPARED,
        ObjectCompare::Digest(d) => d | COMPARED,
        ObjectCompare::Not => 0,
    }
}

/// The CRC-32 of a sourced piece's bytes in `range`, read a bounded buffer at a time.
fn sourced_crc(t: &SourcedTensor<'_>, range: std::ops::Range<u64>) -> Result<u32> {
    const STEP: u64 = 1 << 20;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; STEP.min(range.end - range.start) as usize];
    let mut at = range.start;
    while at < range.end {
        let n = STEP.min(range.end - at) as usize;
        t.source.read_at(at, &mut buf[..n])?;
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(h.finalize())
}

/// On the coordinator: every set's replicas against its main copy (on the bytes `mode` says).
/// The number of sets compared on all their bytes (objects: compared at all), or
/// [`ErrorKind::ReplicasDiffer`] or [`ErrorKind::ObjectsDiffer`] for the first set that
/// differs (the chunks in chunk order, then the objects).
pub(super) fn compare(
    plan: &SavePlan,
    sets: &[CheckSet],
    crcs: &[Vec<u32>],
    mode: ReplicaCheck,
    save_id: &str,
) -> Result<u64> {
    if mode == ReplicaCheck::Off {
        return Ok(0);
    }
    let crc_of = |(rank, pos): (u32, u32)| {
        crcs.get(rank as usize).and_then(|l| l.get(pos as usize)).copied().ok_or_else(|| {
            Error::protocol(format!(
                "replica check: rank {rank} sent {} checksums, the plan needs at least {} (do all ranks pass the \
                 same replica_check?)",
                crcs.get(rank as usize).map_or(0, |l| l.len()),
                pos + 1
            ))
        })
    };
    let (mut checked, mut first, mut more) = (0u64, None, 0u64);
    for s in sets {
        let main = crc_of(s.main)?;
        let (mut ranks, mut found) = (Vec::new(), Vec::new());
        for &h in &s.replicas {
            let c = crc_of(h)?;
            if c != main {
                ranks.push(h.0);
                found.push(c);
            }
        }
        // An object's copies are compared whole: the plan forms its set only where one of
        // its holders compares it.
        let whole = s.object || {
            let c = &plan.chunks[s.at as usize];
            mode.compared(save_id, &c.key, &c.region, c.nbytes) == Some(0..c.nbytes)
        };
        checked += u64::from(whole);
        if ranks.is_empty() {
            continue;
        }
        if first.is_some() {
            more += 1;
            continue;
        }
        first = Some(differ(plan, s, main, ranks, found));
    }
    match first {
        Some(mut kind) => {
            if let ErrorKind::ReplicasDiffer { more: m, .. } | ErrorKind::ObjectsDiffer { more: m, .. } = &mut kind {
                *m = more;
            }
            Err(kind.into())
        }
        None => Ok(checked),
    }
}

/// The error for set `s`, whose copies on `ranks` (with `crcs`) differ from its main copy's
/// `main`.
fn differ(plan: &SavePlan, s: &CheckSet, main: u32, ranks: Vec<u32>, crcs: Vec<u32>) -> ErrorKind {
    let main_rank = s.main.0;
    if s.object {
        let o = &plan.objects[s.at as usize];
        return ErrorKind::ObjectsDiffer {
            key: o.key.to_string(),
            grid_offset: o.grid_offset.clone(),
            main_rank,
            ranks,
            more: 0,
        };
    }
    let c = &plan.chunks[s.at as usize];
    let region = Box::new(c.region.clone());
    ErrorKind::ReplicasDiffer { key: c.key.to_string(), region, main_rank, main_crc: main, ranks, crcs, more: 0 }
}
