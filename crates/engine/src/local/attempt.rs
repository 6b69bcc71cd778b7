//! One attempt of a local restore on one rank: its own copy read and checked, the copies it
//! serves sent a chunk per round, a peer's copy received and checked as it arrives.

use std::collections::HashMap;

use bytes::Bytes;
use dckpt_collective::Collective;
use dckpt_storage::Storage;

use super::part::{Manifest, PieceId, SendBuffers, StreamCheck, data_name, meta_name, request_pieces};
use super::restore::{Attempt, LocalRestoreOptions};
use crate::load::{HOT_BYTES, LoadRequest};
use crate::protocol::in_phase;
use crate::{Error, ErrorKind, Result};

/// One attempt on this rank: its own copy read, the copies it serves sent, a peer's copy
/// received. The outer error is the collective's (the restore cannot go on); the inner one
/// this rank's part failing, which the coordinator plans around.
pub(super) fn attempt_once(
    coll: &dyn Collective,
    dir: &dyn Storage,
    req: &mut LoadRequest<'_>,
    attempt: &Attempt,
    opts: &LocalRestoreOptions,
    counts: &mut (u64, u64),
) -> Result<Result<()>> {
    let (rank, step) = (coll.rank(), attempt.step.unwrap_or_default());
    // A rank reads its own copy on a thread beside the copies it serves (the collective
    // calls stay on this thread), so the ranks it serves do not wait for its own read.
    let own = attempt.source == Some(rank as u32);
    let (own_req, peer_req) = if own { (Some(req), None) } else { (None, Some(req)) };
    let transfers = || transfer(coll, dir, step, attempt, peer_req, opts, counts);
    let (mine, transfers) = match own_req {
        // Nothing to read beside the transfers: no thread for it (starting and ending one
        // takes the address space's lock that the other ranks' copies fault under).
        None => (Ok(()), transfers()),
        Some(req) => {
            let reading = || {
                let mut read = 0;
                (read_own(dir, (step, attempt.save), rank, req, &mut read), read)
            };
            let (reading, transfers) = crate::threads::beside(reading, transfers);
            // A panic here is this rank's part failing, as any error of its read is: raised
            // again, it would leave the other ranks waiting in the attempt's next round.
            let (mine, read) = reading.unwrap_or_else(|panic| {
                let text = crate::error::panic_text(panic.as_ref());
                let file = dir.location(&data_name(step, rank));
                (Err(Error::internal(format!("the local restore's own read of {file} panicked: {text}"))), 0)
            });
            counts.0 += read;
            (mine, transfers)
        }
    };
    Ok(transfers?.and(mine))
}

/// The transfers of one attempt: the copies this rank serves, sent, and its part from a
/// peer (`req` given only then), received and checked.
fn transfer(
    coll: &dyn Collective,
    dir: &dyn Storage,
    step: u64,
    attempt: &Attempt,
    mut req: Option<&mut LoadRequest<'_>>,
    opts: &LocalRestoreOptions,
    counts: &mut (u64, u64),
) -> Result<Result<()>> {
    let rank = coll.rank();
    let peer = attempt.source.filter(|&s| s as usize != rank).map(|s| s as usize);
    let mut served: Vec<Served> = attempt.serve.iter().map(|&(part, to)| Served::open(dir, step, part, to)).collect();
    let phase = in_phase("local restore: transfer");
    let sends = served.iter().map(|s| (s.to, s.manifest.clone())).collect();
    let from: Vec<usize> = peer.into_iter().collect();
    let got = coll.exchange(sends, &from).map_err(&phase)?;
    let mut receiving = match (peer, got.into_iter().next(), req.as_deref()) {
        (Some(p), Some(bytes), Some(req)) => Some(Receiving::open((step, attempt.save), p, rank, &bytes, req)),
        _ => None,
    };
    let chunk = opts.chunk_bytes.max(1) as u64;
    let rounds = coll
        .all_reduce_u64(
            &[served.iter().map(|s| s.len.div_ceil(chunk)).max().unwrap_or(0)],
            dckpt_collective::ReduceOp::Max,
        )
        .map_err(&phase)?[0];
    // Each round a receiver also tells its source, with an empty message, that it is done
    // with the round before: no source runs more than a round ahead of its receivers (the
    // thread collective would queue its whole part), and it takes back their buffers.
    let acks: Vec<usize> = from.iter().copied().chain(served.iter().map(|s| s.to)).collect();
    for i in 0..rounds {
        let mut sends: Vec<(usize, Bytes)> =
            served.iter_mut().map(|s| (s.to, s.chunk(dir, i * chunk, chunk, &mut counts.0))).collect();
        sends.extend(peer.map(|p| (p, Bytes::new())));
        let got = coll.exchange(sends, &acks).map_err(&phase)?;
        let bytes = peer.and(got.first());
        if let (Some(Ok(r)), Some(bytes), Some(req)) = (receiving.as_mut(), bytes, req.as_deref_mut()) {
            counts.1 += bytes.len() as u64;
            if let Err(e) = r.feed(bytes, req) {
                receiving = Some(Err(e));
            }
        }
    }
    Ok(match (receiving, req) {
        (Some(r), Some(req)) => r.and_then(|r| r.finish(req)),
        _ => Ok(()),
    })
}

/// Where each piece of a manifest goes in the request.
#[derive(Debug, Clone, Copy)]
enum Target {
    Tensor(usize),
    Object(usize),
}

/// Maps `manifest`'s entries onto `req`: every requested piece must be there, with its size.
fn targets(manifest: &Manifest, req: &LoadRequest<'_>, file: &str) -> Result<Vec<Target>> {
    let mut at: HashMap<PieceId, Target> = HashMap::new();
    for (i, id) in request_pieces(req).into_iter().enumerate() {
        let t = if i < req.tensors.len() { Target::Tensor(i) } else { Target::Object(i - req.tensors.len()) };
        at.insert(id, t);
    }
    let mismatch = |detail: String| Error::new(ErrorKind::Other { message: format!("{file}: {detail}") });
    if at.len() != manifest.entries.len() {
        return Err(mismatch(format!("holds {} pieces, the request asks for {}", manifest.entries.len(), at.len())));
    }
    manifest
        .entries
        .iter()
        .map(|e| {
            let t = *at.get(&e.id).ok_or_else(|| mismatch(format!("piece {:?} is not requested", e.id.key())))?;
            if let Target::Tensor(i) = t
                && req.tensors[i].data.len() as u64 != e.len
            {
                return Err(mismatch(format!(
                    "piece {:?}: {} bytes, its buffer {}",
                    e.id.key(),
                    e.len,
                    req.tensors[i].data.len()
                )));
            }
            Ok(t)
        })
        .collect()
}

/// Reads this rank's own copy straight into the request a window at a time, its CRC taken
/// as the store shows the bytes, while they are in cache (a whole piece read first would be
/// checked from memory; a mapped read shows each 16 KiB before streaming it into place). The window is a quarter of the persistent load's [`HOT_BYTES`]: two ranks
/// sharing a core's cache keep more of a small window there after the kernel's copy
/// (docs/benchmarks.md, the local tier).
fn read_own(
    dir: &dyn Storage,
    (step, save): (u64, u64),
    rank: usize,
    req: &mut LoadRequest<'_>,
    read: &mut u64,
) -> Result<()> {
    const WINDOW: usize = HOT_BYTES / 4;
    let name = data_name(step, rank);
    let file = dir.location(&name);
    let meta = dir.get(&meta_name(step, rank))?;
    let manifest = Manifest::decode(&meta, &dir.location(&meta_name(step, rank)))?;
    same_save(&manifest, save, &file)?;
    let targets = targets(&manifest, req, &file)?;
    let mut reader = dir.reader_sized(&name, manifest.data_bytes())?;
    for (e, t) in manifest.entries.iter().zip(&targets) {
        let mut object = Vec::new();
        let data: &mut [u8] = match *t {
            Target::Tensor(i) => req.tensors[i].data,
            Target::Object(_) => {
                object = vec![0u8; e.len as usize];
                &mut object
            }
        };
        let mut hasher = crc32fast::Hasher::new();
        for (k, window) in data.chunks_mut(WINDOW).enumerate() {
            let at = e.offset + (k * WINDOW) as u64;
            reader.read_into_inspected(&mut [(at, &mut *window)], &mut |_, bytes| hasher.update(bytes))?;
        }
        *read += e.len;
        let crc = hasher.finalize();
        if crc != e.crc {
            let detail = format!("piece {:?}: CRC-32 {crc:08x}, its manifest says {:08x}", e.id.key(), e.crc);
            return Err(Error::new(ErrorKind::Checksum { file, offset: e.offset, detail }));
        }
        if let Target::Object(i) = *t {
            req.objects[i].data = Some(object);
        }
    }
    Ok(())
}

/// A copy this rank sends to the rank whose part it is.
struct Served {
    to: usize,
    part: usize,
    step: u64,
    manifest: Bytes,
    len: u64,
    buffers: SendBuffers,
}

impl Served {
    /// Reads the copy's manifest; one it cannot read (or an empty one) is sent empty, and
    /// the receiver fails.
    fn open(dir: &dyn Storage, step: u64, part: u32, to: u32) -> Served {
        let (part, to) = (part as usize, to as usize);
        let meta = meta_name(step, part);
        let manifest = match served_read(&dir.location(&meta), || dir.get(&meta)) {
            Some(b) if b.is_empty() => {
                log::warn!("local tier: serving {}: the file is empty", dir.location(&meta));
                b
            }
            read => read.unwrap_or_default(),
        };
        let len = Manifest::decode(&manifest, "").map_or(0, |m| m.data_bytes());
        Served { to, part, step, manifest, len, buffers: SendBuffers::default() }
    }

    /// The copy's bytes `at..at + chunk` (fewer at its end), read into a buffer the
    /// receiver gave back; empty past the end or when the read fails (the receiver then
    /// fails its check).
    fn chunk(&mut self, dir: &dyn Storage, at: u64, chunk: u64, read: &mut u64) -> Bytes {
        let end = (at + chunk).min(self.len);
        if at >= end {
            return Bytes::new();
        }
        let mut buf = self.buffers.take((end - at) as usize);
        let data = data_name(self.step, self.part);
        match served_read(&dir.location(&data), || dir.read_into(&data, &mut [(at, &mut buf[..])])) {
            Some(()) => {
                *read += buf.len() as u64;
                self.buffers.sent(buf.freeze())
            }
            None => {
                self.len = 0; // the receiver fails at this chunk: nothing more is read for it
                Bytes::new()
            }
        }
    }
}

/// A read of a copy this rank serves, on the thread that makes the restore's collective
/// calls: its error, or its panic, logged and taken as nothing read (the receiver's check
/// then fails), so that the ranks waiting in the next exchange are not left there.
fn served_read<T>(file: &str, read: impl FnOnce() -> dckpt_storage::Result<T>) -> Option<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)) {
        Ok(Ok(v)) => Some(v),
        Ok(Err(e)) => {
            log::warn!("local tier: serving {file}: {e}");
            None
        }
        Err(panic) => {
            log::warn!("local tier: serving {file}: the read panicked: {}", crate::error::panic_text(panic.as_ref()));
            None
        }
    }
}

/// A peer's copy of this rank's part, arriving.
struct Receiving {
    check: StreamCheck,
    targets: Vec<Target>,
    objects: HashMap<usize, Vec<u8>>,
}

impl Receiving {
    fn open(
        (step, save): (u64, u64),
        peer: usize,
        rank: usize,
        bytes: &[u8],
        req: &LoadRequest<'_>,
    ) -> Result<Receiving> {
        // The copy lies on the peer's node: this rank's directory would name another file.
        let file = format!("rank {peer}'s copy of {}", data_name(step, rank));
        if bytes.is_empty() {
            let why = format!("{file}: rank {peer} could not read its manifest (its log says why)");
            return Err(Error::new(ErrorKind::Other { message: why }));
        }
        let manifest = Manifest::decode(bytes, &file)?;
        if manifest.step != step || manifest.rank as usize != rank {
            return Err(Error::protocol(format!(
                "{file}: the manifest of rank {} step {}",
                manifest.rank, manifest.step
            )));
        }
        same_save(&manifest, save, &file)?;
        let targets = targets(&manifest, req, &file)?;
        Ok(Receiving { check: StreamCheck::new(manifest, file), targets, objects: HashMap::new() })
    }

    fn feed(&mut self, bytes: &[u8], req: &mut LoadRequest<'_>) -> Result<()> {
        let (targets, objects) = (&self.targets, &mut self.objects);
        self.check.feed(bytes, |entry, at, data| match targets[entry] {
            Target::Tensor(i) => req.tensors[i].data[at as usize..at as usize + data.len()].copy_from_slice(data),
            Target::Object(i) => objects.entry(i).or_default().extend_from_slice(data),
        })
    }

    fn finish(self, req: &mut LoadRequest<'_>) -> Result<()> {
        let Receiving { check, targets, mut objects } = self;
        check.finish()?;
        for t in targets {
            if let Target::Object(i) = t {
                req.objects[i].data = Some(objects.remove(&i).unwrap_or_default());
            }
        }
        Ok(())
    }
}

/// A copy of another save of the step than the one planned (saved again since the plan's
/// inventory) is refused, so that no restore mixes two saves' parts.
fn same_save(manifest: &Manifest, save: u64, file: &str) -> Result<()> {
    if manifest.save != save {
        return Err(Error::protocol(format!(
            "{file}: a copy of another save of step {} than the one planned",
            manifest.step
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // A copy whose manifest its holder could not read arrives empty: the receiver names the
    // holder and the part, not a framing error on a path of its own node, where the copy is not.
    #[test]
    fn a_manifest_its_holder_could_not_read_is_named_as_such() {
        let req = LoadRequest::new();
        let Err(e) = Receiving::open((12, 7), 4, 2, &[], &req) else { panic!("an empty manifest received") };
        let text = e.to_string();
        assert!(text.contains("rank 4's copy of step-000000000012/part-2.data"), "{text}");
        assert!(text.contains("rank 4 could not read its manifest"), "{text}");
    }
}
