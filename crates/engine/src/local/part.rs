//! One rank's part of a local step: its pieces as it holds them, in one data file, and a
//! manifest saying where each piece lies and its CRC-32.
//!
//! Under a node-local directory, `step-<N>/` holds `part-<R>.data` and `part-<R>.meta` for
//! each rank R whose part (its own, or a peer's copy) lives there, and `done-<H>` for each
//! rank H there that saw the whole step complete. The manifest is framed like the metadata
//! file (magic, version, length, CRC-32); its body is MessagePack.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use dckpt_format::{frame, unframe};
use dckpt_shard_spec::{ShardedObject, ShardedTensor};
use serde::{Deserialize, Serialize};

use crate::load::{HOT_BYTES, LoadRequest};
use crate::save::SaveState;
use crate::{Error, ErrorKind, Result};

/// What a piece is, without its replica id (a restore asks by place, as a load does).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) enum PieceId {
    Tensor(ShardedTensor),
    Object(ShardedObject),
}

impl PieceId {
    fn tensor(t: &ShardedTensor) -> PieceId {
        PieceId::Tensor(ShardedTensor { replica_id: Default::default(), ..t.clone() })
    }
    fn object(o: &ShardedObject) -> PieceId {
        PieceId::Object(ShardedObject { replica_id: Default::default(), ..o.clone() })
    }
    pub(crate) fn key(&self) -> &str {
        match self {
            PieceId::Tensor(t) => t.key.as_str(),
            PieceId::Object(o) => o.key.as_str(),
        }
    }
}

/// One piece in a part's data file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Entry {
    pub id: PieceId,
    pub offset: u64,
    pub len: u64,
    pub crc: u32,
}

/// A part's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub step: u64,
    pub rank: u32,
    pub world: u32,
    /// [`fingerprint`] of the pieces: a restore with other pieces (another layout) skips it.
    pub fingerprint: u64,
    pub entries: Vec<Entry>,
    /// The save of the step this part is of, the same on every rank of it: a step saved
    /// again (a run resumed from an older step) can leave parts of both saves on nodes
    /// numbered otherwise since, and a restore takes one save's parts only.
    #[serde(default)]
    pub save: u64,
    /// The run it belongs to ([`super::LocalSaveOptions::run`]).
    #[serde(default)]
    pub run: String,
}

impl Manifest {
    pub(crate) fn data_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.len).sum()
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        frame(&crate::protocol::encode(self))
    }

    pub(crate) fn decode(bytes: &[u8], file: &str) -> Result<Manifest> {
        let body = unframe(bytes, file)?;
        let bad = |what: String| Error::new(ErrorKind::Other { message: format!("{file}: {what}") });
        let m: Manifest =
            rmp_serde::from_slice(body).map_err(|e| bad(format!("undecodable local-tier manifest: {e}")))?;
        // The pieces lie back to back from the start of the part, as `manifest_of` lays
        // them out: the stream check and the copies rely on it.
        let mut end = 0u64;
        for (i, e) in m.entries.iter().enumerate() {
            if e.offset != end {
                return Err(bad(format!(
                    "local-tier manifest: entry {i} ({:?}) at offset {}, where the entries before end at {end}",
                    e.id.key(),
                    e.offset
                )));
            }
            end = end.checked_add(e.len).ok_or_else(|| {
                bad(format!("local-tier manifest: entry {i} ({:?}) ends past 2^64 bytes", e.id.key()))
            })?;
        }
        Ok(m)
    }
}

/// `step-<N>`, N zero-padded to 12 digits, as the run root names its steps.
pub(crate) fn step_dir(step: u64) -> String {
    format!("step-{step:012}")
}

/// The step of a name [`step_dir`] makes, and of no other.
pub(crate) fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    let step: u64 = digits.bytes().all(|b| b.is_ascii_digit()).then(|| digits.parse().ok())??;
    (step_dir(step) == name).then_some(step)
}

pub(crate) fn data_name(step: u64, rank: usize) -> String {
    format!("{}/part-{rank}.data", step_dir(step))
}

pub(crate) fn meta_name(step: u64, rank: usize) -> String {
    format!("{}/part-{rank}.meta", step_dir(step))
}

pub(crate) fn done_name(step: u64, holder: usize) -> String {
    format!("{}/done-{holder}", step_dir(step))
}

/// The pieces a state holds, in the order its part stores them.
pub(crate) fn state_pieces<'s>(state: &'s SaveState<'_>) -> Vec<(PieceId, &'s [u8])> {
    let tensors = state.tensors.iter().map(|t| (PieceId::tensor(&t.tensor), t.data));
    tensors.chain(state.objects.iter().map(|o| (PieceId::object(&o.object), o.data))).collect()
}

/// The pieces a request asks for.
pub(crate) fn request_pieces(req: &LoadRequest<'_>) -> Vec<PieceId> {
    let tensors = req.tensors.iter().map(|t| PieceId::tensor(&t.tensor));
    tensors.chain(req.objects.iter().map(|o| PieceId::object(&o.object))).collect()
}

/// A stable 64-bit digest (FNV-1a) of a set of pieces, in any order: a save's and a
/// restore's agree exactly when they hold the same pieces, so a restart in another layout
/// never restores a local part.
pub(crate) fn fingerprint(ids: &[PieceId]) -> u64 {
    let mut encoded: Vec<Vec<u8>> = ids.iter().map(crate::protocol::encode).collect();
    encoded.sort_unstable();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for e in &encoded {
        for &b in e.iter().chain(&(e.len() as u64).to_le_bytes()) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Checks a part's bytes as they stream past in order, piece by piece, against its
/// manifest: what a peer sends, what this rank reads of its own copy.
pub(crate) struct StreamCheck {
    manifest: Manifest,
    file: String,
    at: u64,
    entry: usize,
    hasher: crc32fast::Hasher,
}

impl StreamCheck {
    pub(crate) fn new(manifest: Manifest, file: String) -> StreamCheck {
        StreamCheck { manifest, file, at: 0, entry: 0, hasher: crc32fast::Hasher::new() }
    }

    pub(crate) fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Feeds the next bytes; calls `each(entry index, offset in the piece, bytes)` for the
    /// parts of pieces they hold, and fails at the first piece whose CRC does not match.
    pub(crate) fn feed(&mut self, mut data: &[u8], mut each: impl FnMut(usize, u64, &[u8])) -> Result<()> {
        while !data.is_empty() {
            let Some(e) = self.manifest.entries.get(self.entry) else {
                return Err(self.damage(self.at, "more bytes than its manifest lists".into()));
            };
            let into = self.at - e.offset;
            // A step at most HOT_BYTES long is copied while its CRC has it in cache.
            let take = usize::try_from(e.len - into).unwrap_or(usize::MAX).min(data.len()).min(HOT_BYTES);
            let (now, rest) = data.split_at(take);
            self.hasher.update(now);
            each(self.entry, into, now);
            self.at += take as u64;
            data = rest;
            self.close_finished()?;
        }
        Ok(())
    }

    /// Steps past finished pieces (empty ones too), checking each one's CRC.
    fn close_finished(&mut self) -> Result<()> {
        while let Some(e) = self.manifest.entries.get(self.entry) {
            if self.at < e.offset + e.len {
                return Ok(());
            }
            let crc = std::mem::take(&mut self.hasher).finalize();
            if crc != e.crc {
                let detail = format!("piece {:?}: CRC-32 {crc:08x}, its manifest says {:08x}", e.id.key(), e.crc);
                return Err(self.damage(e.offset, detail));
            }
            self.entry += 1;
        }
        Ok(())
    }

    /// Fails unless every piece was fed and checked.
    pub(crate) fn finish(mut self) -> Result<()> {
        self.close_finished()?;
        if self.entry < self.manifest.entries.len() {
            let detail = format!("{} of {} bytes", self.at, self.manifest.data_bytes());
            return Err(self.damage(self.at, format!("the part ended early: {detail}")));
        }
        Ok(())
    }

    fn damage(&self, offset: u64, detail: String) -> Error {
        Error::new(ErrorKind::Checksum { file: self.file.clone(), offset, detail })
    }
}

/// Builds the manifest of `pieces` laid out in order, with their CRCs.
pub(crate) fn manifest_of(
    step: u64,
    rank: usize,
    world: usize,
    pieces: &[(PieceId, &[u8])],
    (save, run): (u64, &str),
) -> Manifest {
    let mut offset = 0;
    let entries = pieces
        .iter()
        .map(|(id, data)| {
            let e = Entry { id: id.clone(), offset, len: data.len() as u64, crc: crc32fast::hash(data) };
            offset += e.len;
            e
        })
        .collect();
    let ids: Vec<PieceId> = pieces.iter().map(|p| p.0.clone()).collect();
    let fingerprint = fingerprint(&ids);
    Manifest { step, rank: rank as u32, world: world as u32, fingerprint, entries, save, run: run.to_string() }
}

#[cfg(test)]
mod tests {
    use dckpt_shard_spec::{DType, ShardedTensor};

    use super::*;

    fn manifest() -> (Manifest, Vec<u8>) {
        let a = [1u8, 2, 3];
        let b = [9u8; 5];
        let pieces = vec![
            (PieceId::tensor(&ShardedTensor::whole("a", DType::U8, [3])), &a[..]),
            (PieceId::tensor(&ShardedTensor::whole("e", DType::U8, [0])), &[][..]),
            (PieceId::object(&ShardedObject::single("b")), &b[..]),
        ];
        (manifest_of(7, 1, 2, &pieces, (3, "")), [&a[..], &b[..]].concat())
    }

    #[test]
    fn send_buffers_take_back_only_what_no_receiver_holds() {
        let mut bufs = SendBuffers::default();
        let buf = bufs.take(64).freeze();
        let first = bufs.sent(buf);
        let at = first.as_ptr();
        let held = first.clone();
        drop(first);
        // A receiver still holds it: a new buffer.
        let buf = bufs.take(64).freeze();
        let second = bufs.sent(buf);
        assert_ne!(second.as_ptr(), at);
        drop((held, second));
        // Both let go: the older of the two comes back, at the length asked for.
        let again = bufs.take(48);
        assert_eq!((again.as_ptr(), again.len()), (at, 48));
        // No more kept than two: a third sent one lets the oldest go.
        let mut bufs = SendBuffers::default();
        let kept: Vec<Bytes> = (0..3)
            .map(|_| {
                let buf = bufs.take(8).freeze();
                bufs.sent(buf)
            })
            .collect();
        assert_eq!(bufs.sent.len(), 2);
        assert!(!bufs.sent.iter().any(|b| b.as_ptr() == kept[0].as_ptr()));
    }

    #[test]
    fn stream_check_passes_whole_parts_in_any_cut_and_names_damage() {
        let (m, data) = manifest();
        for cut in 1..data.len() {
            let mut c = StreamCheck::new(m.clone(), "p".into());
            let mut seen = Vec::new();
            for chunk in data.chunks(cut) {
                c.feed(chunk, |i, at, b| seen.push((i, at, b.to_vec()))).unwrap();
            }
            c.finish().unwrap();
            let a: Vec<u8> = seen.iter().filter(|s| s.0 == 0).flat_map(|s| s.2.clone()).collect();
            assert_eq!(a, [1, 2, 3]);
        }
        let mut bad = data.clone();
        bad[4] ^= 1;
        let mut c = StreamCheck::new(m.clone(), "p".into());
        let e = c.feed(&bad, |_, _, _| {}).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Checksum { offset: 3, .. }), "{e}");
        let c = StreamCheck::new(m.clone(), "p".into());
        assert!(c.finish().unwrap_err().to_string().contains("ended early"));
    }

    #[test]
    fn manifests_round_trip_and_fingerprints_ignore_order_and_replicas() {
        let (m, _) = manifest();
        assert_eq!(Manifest::decode(&m.encode(), "m").unwrap(), m);
        let mut bytes = m.encode();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert!(Manifest::decode(&bytes, "m").is_err());
        // Whole frames whose entries do not lie back to back from 0 are refused, not used.
        for (entry, offset, len) in [(0, 8, 3), (2, 4, 5), (1, 3, u64::MAX)] {
            let mut bad = m.clone();
            (bad.entries[entry].offset, bad.entries[entry].len) = (offset, len);
            let e = Manifest::decode(&bad.encode(), "m").unwrap_err().to_string();
            assert!(e.contains(&format!("entry {entry} ")), "{e}");
        }
        let t = ShardedTensor::whole("a", DType::U8, [3]);
        let o = ShardedObject::single("b");
        let one = [PieceId::tensor(&t), PieceId::object(&o)];
        let other = [PieceId::object(&o), PieceId::tensor(&t.clone().replica([0, 0, 1]))];
        assert_eq!(fingerprint(&one), fingerprint(&other));
        assert_ne!(fingerprint(&one), fingerprint(&one[..1]));
        assert_eq!(parse_step_dir(&step_dir(42)), Some(42));
        assert_eq!(parse_step_dir("step-42"), None);
        assert_eq!(parse_step_dir("step-0000000000042"), None);
        assert_eq!(parse_step_dir(&step_dir(u64::MAX)), Some(u64::MAX));
    }
}

/// The buffers of the messages a rank sends, taken back for the next message once every
/// receiver has dropped its handle (threads hand the receiver the buffer itself), so a
/// transfer of many chunks touches fresh memory for the first two only: a fresh page costs
/// a fault, which on a virtual machine is a large part of moving a page.
#[derive(Default)]
pub(crate) struct SendBuffers {
    sent: VecDeque<Bytes>,
}

impl SendBuffers {
    /// How many sent buffers are kept to be taken back: with each round's receivers done
    /// with the round before (the transfers' acknowledgements), the one of two rounds ago
    /// is free.
    const KEPT: usize = 2;

    /// A buffer of `len` bytes: a sent one no receiver holds any more, else a new one.
    /// Its bytes are whatever they were; the caller overwrites them all.
    pub(crate) fn take(&mut self, len: usize) -> BytesMut {
        if let Some(i) = self.sent.iter().position(Bytes::is_unique)
            && let Some(Ok(mut buf)) = self.sent.remove(i).map(Bytes::try_into_mut)
        {
            buf.resize(len, 0);
            return buf;
        }
        BytesMut::zeroed(len)
    }

    /// `buf` sent: kept (the oldest one beyond [`Self::KEPT`] let go) to be taken back.
    pub(crate) fn sent(&mut self, buf: Bytes) -> Bytes {
        if self.sent.len() == Self::KEPT {
            self.sent.pop_front();
        }
        self.sent.push_back(buf.clone());
        buf
    }
}
