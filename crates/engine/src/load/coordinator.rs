//! The coordinator's half of a load. Every rank sends what it asks for (its requests as
//! metadata, no bytes); the coordinator alone reads and validates the metadata, agrees the
//! keys over all ranks, plans every rank's reads and which shared blocks the ranks check
//! together, and sends each rank only its own plan: the pieces it reads, with their block
//! checksums, and the data files they are in. What a rank receives and decodes grows with
//! its own requests, not with the world or the checkpoint, and every step here is one pass
//! over the asks and the chunks they touch.

use std::borrow::Cow;
use std::time::Instant;

use dckpt_shard_spec::{DType, Dims, ShardedObject, ShardedTensor};
use dckpt_storage::Storage;
use serde::{Deserialize, Serialize};

use super::fan::{FanPlan, plan_fan};
use super::keys::{Found, reconcile_keys};
use super::metadata::fetch_metadata;
use super::plan::{Indexes, PieceCopy, ReadPlan, Stored, offers, plan_reads};
use super::{KeyPolicy, LoadOptions, LoadRequest, Strictness};
use crate::format::{FileMeta, Metadata};
use crate::phases::{LoadPhases, Slowest};
use crate::protocol::{COORDINATOR, for_every_rank};
use crate::shared_check::{self, ChunkKey, Shared};
use crate::{Error, ErrorKind, Result};

/// One tensor request as the coordinator plans it: the piece wanted and the length of the
/// buffer it goes to. The coordinator's own asks borrow the request's pieces (no copy of a
/// key or shape per tensor); those that arrive from other ranks are decoded into owned ones.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct TensorAsk<'a> {
    pub(super) tensor: Cow<'a, ShardedTensor>,
    pub(super) allow_shape_mismatch: bool,
    pub(super) allow_dtype_cast: bool,
    pub(super) buffer_bytes: u64,
}

/// What one rank asks to load, in the order of its request.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct Asks<'a> {
    pub(super) tensors: Vec<TensorAsk<'a>>,
    pub(super) objects: Vec<ShardedObject>,
    /// The rank's caller failed to make its request ([`LoadOptions::caller_failed`]).
    pub(super) failed: Option<String>,
    /// What the rank asked to be done about missing and unexpected keys: the coordinator's
    /// alone were applied, and a rank that asked for a missing key to fail the load got a
    /// buffer left as it was, without a word.
    pub(super) strictness: Strictness,
}

impl<'a> Asks<'a> {
    pub(super) fn of(req: &'a LoadRequest<'_>, opts: &LoadOptions) -> Asks<'a> {
        Asks {
            failed: opts.caller_failed.clone(),
            strictness: opts.strictness,
            tensors: req
                .tensors
                .iter()
                .map(|r| TensorAsk {
                    tensor: Cow::Borrowed(&r.tensor),
                    allow_shape_mismatch: r.allow_shape_mismatch,
                    allow_dtype_cast: r.allow_dtype_cast,
                    buffer_bytes: r.data.len() as u64,
                })
                .collect(),
            objects: req.objects.iter().map(|o| o.object.clone()).collect(),
        }
    }
}

/// A stored piece one rank reads.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct PlannedPiece {
    /// The chunk in the whole metadata (what the shared check names), `None` for an object.
    chunk: Option<ChunkKey>,
    /// Index into the plan's files.
    file: u32,
    at: u64,
    len: u64,
    /// Where this piece's checksums end in the plan's `crcs` (they start where the piece
    /// before it ends).
    crcs_end: u64,
}

/// What the coordinator sends one rank: its slice of the metadata, planned.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct RankPlan {
    /// The metadata as this rank needs it: the data files it reads (renumbered), the
    /// checksum block and the layout; no tensors or objects.
    pub(super) meta: Metadata,
    pieces: Vec<PlannedPiece>,
    /// The checksums of every piece, back to back in piece order: one buffer, not one per
    /// piece (a load of many small tensors allocated, copied and freed one each).
    #[serde(with = "serde_bytes")]
    crcs: Vec<u8>,
    /// The transfers, each marked when the ranks check its blocks together.
    copies: Vec<PieceCopy>,
    pub(super) zero_fill: Vec<(u32, Dims)>,
    /// The requests cast from another stored dtype, with that dtype, in request order.
    pub(super) casts: Vec<(u32, DType)>,
    /// Who reads what for whom, and the round of each copy.
    pub(super) fan: FanPlan,
    /// Missing and unexpected keys over all ranks, where the policy returns them.
    pub(super) missing: Vec<String>,
    pub(super) unexpected: Vec<String>,
}

impl RankPlan {
    /// The plan as the read stages take it, borrowing the checksums; the copies move out.
    /// A piece whose checksums lie outside the plan's (a plan garbled on the way) gets none,
    /// and the second result fails the load.
    pub(super) fn read_plan(&self, copies: Vec<PieceCopy>) -> (ReadPlan<'_>, Result<()>) {
        let (mut start, mut sliced) = (0usize, Ok(()));
        let pieces = self
            .pieces
            .iter()
            .map(|p| {
                let end = usize::try_from(p.crcs_end).unwrap_or(usize::MAX);
                let crc32 = self.crcs.get(start..end).unwrap_or_else(|| {
                    sliced = Err(Error::protocol("a piece's checksums outside its plan's"));
                    &[]
                });
                start = end.max(start);
                Stored { chunk: p.chunk, file: p.file, at: p.at, len: p.len, crc32 }
            })
            .collect();
        (ReadPlan { pieces, copies, zero_fill: Vec::new(), casts: Vec::new() }, sliced)
    }

    /// The transfers, taken out of the plan (a load performs them once).
    pub(super) fn take_copies(&mut self) -> Vec<PieceCopy> {
        std::mem::take(&mut self.copies)
    }
}

/// What the coordinator keeps for the check of the ranks' results.
pub(super) struct Kept {
    pub(super) meta: Metadata,
    pub(super) shared: Shared,
    /// Bytes of the metadata file it read.
    pub(super) meta_bytes: u64,
    /// How long reading the metadata and planning took (the other phases follow).
    pub(super) phases: LoadPhases,
}

/// On the coordinator: every rank's plan, in rank order, or the first failure for all.
pub(super) fn plan_every_rank(
    storage: &dyn Storage,
    opts: &LoadOptions,
    all: Vec<Asks<'_>>,
    kept: &mut Option<Kept>,
) -> Vec<Result<RankPlan>> {
    let world = all.len();
    match plan_all(storage, opts, &all, kept) {
        Ok(plans) => plans.into_iter().map(Ok).collect(),
        Err(e) => for_every_rank(e, world),
    }
}

fn plan_all(
    storage: &dyn Storage,
    opts: &LoadOptions,
    all: &[Asks<'_>],
    kept: &mut Option<Kept>,
) -> Result<Vec<RankPlan>> {
    let s = opts.strictness;
    let here = |e: Error| e.on_rank(COORDINATOR as u32);
    for (r, a) in all.iter().enumerate() {
        Error::caller_failed(&a.failed).map_err(|e| e.on_rank(r as u32))?;
    }
    if let Some((r, a)) = all.iter().enumerate().find(|(_, a)| a.strictness != s) {
        return Err(Error::invalid_options(format!(
            "rank {r} loads with other key policies ({:?}) than rank {COORDINATOR}'s ({s:?}): every rank must pass the same",
            a.strictness
        )));
    }
    let started = Instant::now();
    let (bytes, meta) = fetch_metadata(storage).map_err(here)?;
    let read = started.elapsed();
    let found: Vec<Found> = all.iter().map(|a| Found::new(&meta, a)).collect();
    let (missing, unexpected) = reconcile_keys(&meta, all, &found);
    apply_policy(s, &missing, &unexpected)?;
    let mut indexes = Indexes::new(&meta);
    let mut plans = Vec::with_capacity(all.len());
    for (r, (a, f)) in all.iter().zip(&found).enumerate() {
        plans.push(plan_reads(&meta, &mut indexes, f, a).map_err(|e| e.on_rank(r as u32))?);
    }
    let in_place = storage.hints().reads_in_place;
    let offered: Vec<Vec<shared_check::Offer>> =
        plans.iter().zip(all).map(|(p, a)| offers(&meta, p, a, in_place)).collect();
    let keys: Vec<Vec<ChunkKey>> = offered.iter().map(|o| o.iter().map(|(k, _)| *k).collect()).collect();
    let mut shared = Shared::new();
    let mut decided = shared_check::decide(&meta, offered, &mut shared);
    decided.sort_unstable();
    let keep =
        |policy: KeyPolicy, keys: &[String]| if policy == KeyPolicy::Return { keys.to_vec() } else { Vec::new() };
    let (missing, unexpected) = (keep(s.missing, &missing), keep(s.unexpected, &unexpected));
    for (p, offered) in plans.iter_mut().zip(&keys) {
        // The shared chunks this rank offered regions of; it reads the others the usual way.
        let together = |k: &ChunkKey| decided.binary_search(k).is_ok() && offered.binary_search(k).is_ok();
        let shared: Vec<bool> = p.pieces.iter().map(|p| p.chunk.as_ref().is_some_and(together)).collect();
        for c in &mut p.copies {
            c.shared = shared[c.piece];
        }
    }
    let fans = match opts.fan_out && all.len() > 1 {
        true => plan_fan(&meta, &mut plans, opts.fan_out_round_bytes, in_place),
        false => vec![FanPlan::default(); all.len()],
    };
    // One table from a file's index in the metadata to its index in a rank's plan, reset
    // after each rank where it was set: one per rank made the plans world x files.
    let mut renumber: Vec<Option<u32>> = vec![None; meta.files.len()];
    let out = plans
        .into_iter()
        .zip(fans)
        .map(|(p, fan)| {
            let mut plan = slice(&meta, p, fan, &mut renumber);
            (plan.missing, plan.unexpected) = (missing.clone(), unexpected.clone());
            plan
        })
        .collect();
    let phases = LoadPhases {
        metadata: Slowest::on(COORDINATOR as u32, read),
        plan: Slowest::on(COORDINATOR as u32, started.elapsed() - read),
        ..LoadPhases::default()
    };
    *kept = Some(Kept { meta, shared, meta_bytes: bytes.len() as u64, phases });
    Ok(out)
}

/// Fails the load for the key mismatches the policy raises, logs those it logs (once, here).
fn apply_policy(s: Strictness, missing: &[String], unexpected: &[String]) -> Result<()> {
    if s.missing == KeyPolicy::Raise && !missing.is_empty() {
        return Err(Error::from(ErrorKind::MissingKeys { keys: missing.to_vec(), more: 0 }));
    }
    if s.unexpected == KeyPolicy::Raise && !unexpected.is_empty() {
        return Err(Error::from(ErrorKind::UnexpectedKeys { keys: unexpected.to_vec(), more: 0 }));
    }
    if s.missing == KeyPolicy::Log && !missing.is_empty() {
        log::warn!("load: {} requested keys are not stored: {}", missing.len(), missing.join(", "));
    }
    if s.unexpected == KeyPolicy::Log && !unexpected.is_empty() {
        log::warn!("load: {} stored keys were not requested: {}", unexpected.len(), unexpected.join(", "));
    }
    Ok(())
}

/// One rank's plan with its own copy of what it needs of the metadata: the files it reads,
/// renumbered in order of first use (in its fan-out too), and the checksums of its pieces.
/// `renumber`, one entry per file of the metadata, is all `None` and is left so.
fn slice(meta: &Metadata, plan: ReadPlan<'_>, mut fan: FanPlan, renumber: &mut [Option<u32>]) -> RankPlan {
    // The plan's files by their index in the metadata (validated: every piece's is in it).
    let mut used: Vec<u32> = Vec::new();
    let mut files: Vec<FileMeta> = Vec::new();
    let mut crcs: Vec<u8> = Vec::with_capacity(plan.pieces.iter().map(|p| p.crc32.len()).sum());
    let pieces: Vec<PlannedPiece> = plan
        .pieces
        .iter()
        .map(|p| {
            let file = *renumber[p.file as usize].get_or_insert_with(|| {
                files.push(meta.files[p.file as usize].clone());
                used.push(p.file);
                files.len() as u32 - 1
            });
            crcs.extend_from_slice(p.crc32);
            PlannedPiece { chunk: p.chunk, file, at: p.at, len: p.len, crcs_end: crcs.len() as u64 }
        })
        .collect();
    // A rank's units are in the files it reads.
    for u in &mut fan.units {
        u.file = renumber[u.file as usize].expect("a fan-out unit in a file the rank reads");
    }
    for f in used {
        renumber[f as usize] = None;
    }
    let sliced = Metadata {
        format_version: meta.format_version,
        save_id: meta.save_id.clone(),
        writer: meta.writer.clone(),
        block_bytes: meta.block_bytes,
        layout: meta.layout.clone(),
        files,
        tensors: Vec::new(),
        objects: Vec::new(),
    };
    RankPlan {
        meta: sliced,
        pieces,
        crcs,
        copies: plan.copies,
        zero_fill: plan.zero_fill,
        casts: plan.casts,
        fan,
        missing: Vec::new(),
        unexpected: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(ends: &[u64], crcs: usize) -> RankPlan {
        let meta = super::super::bare_metadata(4, Vec::new());
        RankPlan {
            meta,
            pieces: ends.iter().map(|&e| PlannedPiece { chunk: None, file: 0, at: 0, len: 4, crcs_end: e }).collect(),
            crcs: (0..crcs as u8).collect(),
            copies: Vec::new(),
            zero_fill: Vec::new(),
            casts: Vec::new(),
            fan: FanPlan::default(),
            missing: Vec::new(),
            unexpected: Vec::new(),
        }
    }

    #[test]
    fn each_piece_borrows_its_stretch_of_the_plans_checksums() {
        let p = plan(&[4, 4, 12], 12);
        let (read, sliced) = p.read_plan(Vec::new());
        assert!(sliced.is_ok());
        let got: Vec<&[u8]> = read.pieces.iter().map(|s| s.crc32).collect();
        assert_eq!(got, vec![&[0, 1, 2, 3][..], &[][..], &[4, 5, 6, 7, 8, 9, 10, 11][..]]);
    }

    #[test]
    fn checksums_outside_the_plans_fail_the_load_without_a_panic() {
        for ends in [&[4, 13][..], &[8, 4], &[u64::MAX, 4]] {
            let p = plan(ends, 12);
            let (read, sliced) = p.read_plan(Vec::new());
            assert_eq!(read.pieces.len(), ends.len());
            assert!(sliced.is_err(), "{ends:?} should fail");
        }
    }
}
