//! The rank's side of the fan-out: each round, the units it reads from storage are read and
//! sent to their ranks, those it receives are held, and its copies of the round are read
//! through an [`Overlay`] that serves held bytes from memory and reads the rest from
//! storage. The read stages check every byte against its checksum whatever its source.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use dckpt_collective::Collective;
use dckpt_storage::{ObjectReader, Storage, StorageHints};

use super::blocks::FileReader;
use super::execute::{in_parallel, reads_in_flight};
use super::fan::{FanPlan, Unit};
use crate::format::Metadata;
use crate::protocol::in_phase;
use crate::{Error, Result};

/// A stretch of a file held in memory: where it starts, its bytes, whether it stays for
/// the whole load (a header).
type Held = (u64, Bytes, bool);

/// A file's header once read from the store, shared by the readers of that file.
type HeaderCache = Mutex<Option<Vec<u8>>>;

/// The store as the read stages see it: reads of held stretches come from memory, the
/// rest from the store, counted. A file's header read from the store is kept too: a file
/// read in several rounds asks for it once.
pub(super) struct Overlay<'s> {
    store: &'s dyn Storage,
    /// By file name, sorted by offset, disjoint.
    held: BTreeMap<String, Vec<Held>>,
    /// Each file's header length, and its bytes once read.
    headers: BTreeMap<String, (u64, HeaderCache)>,
    read: AtomicU64,
}

impl<'s> Overlay<'s> {
    /// Over `store`, for reads of the files of `meta`.
    pub(super) fn new(store: &'s dyn Storage, meta: &Metadata) -> Overlay<'s> {
        let headers = meta.files.iter().map(|f| (f.name.clone(), (f.data_start, Mutex::new(None)))).collect();
        Overlay { store, held: BTreeMap::new(), headers, read: AtomicU64::new(0) }
    }

    /// Reads of `path` (of `len` bytes), held stretches from memory.
    pub(super) fn reader_sized(&self, path: &str, len: u64) -> dckpt_storage::Result<Box<dyn ObjectReader + '_>> {
        let inner = self.store.reader_sized(path, len)?;
        let held = self.held.get(path).map_or(&[][..], Vec::as_slice);
        let header = self.headers.get(path).filter(|h| h.0 > 0).map(|(len, cache)| (*len, cache));
        let in_place = self.store.hints().reads_in_place;
        Ok(Box::new(HeldReader { inner, held, header, read: &self.read, in_place }))
    }

    pub(super) fn hints(&self) -> StorageHints {
        self.store.hints()
    }

    /// Prefetches what of `at..at + len` the store is asked for: nothing held (a local
    /// disk would otherwise read what a peer sent).
    pub(super) fn prefetch(&self, path: &str, at: u64, len: u64) {
        let held = self.held.get(path).map_or(&[][..], Vec::as_slice);
        match find(held, at) {
            Ok(_) => {}
            Err(next) => {
                let end = held.get(next).map_or(at.saturating_add(len), |h| h.0.min(at.saturating_add(len)));
                self.store.prefetch(path, at, end - at);
            }
        }
    }

    /// Bytes read from the store so far.
    pub(super) fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    fn hold(&mut self, name: &str, at: u64, data: Bytes, sticky: bool) {
        let list = self.held.entry(name.to_string()).or_default();
        let i = list.partition_point(|h| h.0 < at);
        list.insert(i, (at, data, sticky));
    }

    /// Ends a round: what it held is dropped, headers kept.
    pub(super) fn end_round(&mut self) {
        self.held.retain(|_, list| {
            list.retain(|h| h.2);
            !list.is_empty()
        });
    }
}

/// `Ok(i)` when `held[i]` holds byte `at`, else `Err(i)`: the first stretch after it.
fn find(held: &[Held], at: u64) -> std::result::Result<usize, usize> {
    let i = held.partition_point(|h| h.0 <= at);
    match i.checked_sub(1) {
        Some(j) if at < held[j].0 + held[j].1.len() as u64 => Ok(j),
        _ => Err(i),
    }
}

struct HeldReader<'a> {
    inner: Box<dyn ObjectReader + 'a>,
    held: &'a [Held],
    /// The file's header length and its bytes once read.
    header: Option<(u64, &'a HeaderCache)>,
    read: &'a AtomicU64,
    /// Whether the store reads in place: its inspected reads are then worth keeping for
    /// every read that holds nothing, at the price of a call more.
    in_place: bool,
}

impl HeldReader<'_> {
    /// Whether a read of `buf` at `at` is a header read or touches held bytes: served (at
    /// least in part) from memory.
    fn served(&self, at: u64, len: u64) -> bool {
        let header = self.header.is_some_and(|h| at == 0 && len == h.0);
        header || find(self.held, at).map_or_else(|next| self.held.get(next).is_some_and(|h| h.0 < at + len), |_| true)
    }
}

impl ObjectReader for HeldReader<'_> {
    /// The store's own inspected read of the reads nothing of which is served from memory;
    /// the others read, then inspected. Where the store reads in place, split into runs of
    /// each kind, in the order given, so that a few held bytes (a header, a small
    /// replicated tensor) do not send a whole batch of reads down the slower path; on
    /// other stores, where each call is a request, a call with held bytes is one read.
    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> dckpt_storage::Result<()> {
        if !self.in_place && reads.iter().any(|(at, buf)| self.served(*at, buf.len() as u64)) {
            return dckpt_storage::read_then_inspect(self, reads, inspect);
        }
        let mut start = 0;
        while start < reads.len() {
            let served = |r: &(u64, &mut [u8])| self.served(r.0, r.1.len() as u64);
            let kind = served(&reads[start]);
            let end = start + reads[start..].iter().take_while(|r| served(r) == kind).count();
            let run = &mut reads[start..end];
            let mut shown = |i: usize, bytes: &[u8]| inspect(start + i, bytes);
            if kind {
                dckpt_storage::read_then_inspect(self, run, &mut shown)?;
            } else {
                self.read.fetch_add(run.iter().map(|r| r.1.len() as u64).sum(), Ordering::Relaxed);
                self.inner.read_into_inspected(run, &mut shown)?;
            }
            start = end;
        }
        Ok(())
    }

    /// The store's own picked read where nothing of the range is held, else read (held
    /// bytes from memory), then shown and picked.
    fn read_picked_inspected(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> dckpt_storage::Result<()> {
        let len = range.end.saturating_sub(range.start);
        if self.served(range.start, len) {
            return dckpt_storage::read_then_pick(self, range, picks, inspect);
        }
        self.read.fetch_add(len, Ordering::Relaxed);
        self.inner.read_picked_inspected(range, picks, inspect)
    }

    /// Copies what is held, and reads the gaps from the store in one call.
    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> dckpt_storage::Result<()> {
        let is_header = |at: u64, buf: &[u8]| self.header.is_some_and(|h| at == 0 && buf.len() as u64 == h.0);
        let cached = |buf: &mut [u8]| {
            let cache = self.header.expect("a header").1.lock().unwrap_or_else(|e| e.into_inner());
            cache.as_ref().map(|h| buf.copy_from_slice(h)).is_some()
        };
        let mut fresh_header = None;
        let mut gaps: Vec<(u64, &mut [u8])> = Vec::new();
        for (i, (at, buf)) in reads.iter_mut().enumerate() {
            if is_header(*at, buf) && find(self.held, 0).is_err() {
                if cached(buf) {
                    continue;
                }
                fresh_header = Some(i);
            }
            let (mut pos, mut rest): (u64, &mut [u8]) = (*at, &mut **buf);
            while !rest.is_empty() {
                match find(self.held, pos) {
                    Ok(j) => {
                        let (h_at, data, _) = &self.held[j];
                        let from = (pos - h_at) as usize;
                        let n = rest.len().min(data.len() - from);
                        let (now, later) = std::mem::take(&mut rest).split_at_mut(n);
                        now.copy_from_slice(&data[from..from + n]);
                        (pos, rest) = (pos + n as u64, later);
                    }
                    Err(next) => {
                        let room = self.held.get(next).map_or(u64::MAX, |h| h.0 - pos);
                        let n = rest.len().min(usize::try_from(room).unwrap_or(usize::MAX));
                        let (now, later) = std::mem::take(&mut rest).split_at_mut(n);
                        gaps.push((pos, now));
                        (pos, rest) = (pos + n as u64, later);
                    }
                }
            }
        }
        if gaps.is_empty() {
            return Ok(());
        }
        self.read.fetch_add(gaps.iter().map(|g| g.1.len() as u64).sum(), Ordering::Relaxed);
        self.inner.read_into(&mut gaps)?;
        drop(gaps);
        if let (Some(i), Some((_, cache))) = (fresh_header, self.header) {
            // Kept as read: whoever uses it checks it against its checksum.
            *cache.lock().unwrap_or_else(|e| e.into_inner()) = Some(reads[i].1.to_vec());
        }
        Ok(())
    }
}

/// Units at least this long go in messages of their own, sent uncopied; shorter ones are
/// packed together (copied), so that many small units are few messages.
pub(super) const PACKED_BELOW: u64 = 1 << 20;

/// How units go into messages, identical on both ends: in order, a unit of at least
/// [`PACKED_BELOW`] alone, shorter ones together while their message is shorter than
/// that. The number of units in each.
fn packing(lens: impl Iterator<Item = u64>) -> Vec<usize> {
    let (mut out, mut bytes): (Vec<usize>, u64) = (Vec::new(), 0);
    for len in lens {
        match out.last_mut() {
            Some(n) if len < PACKED_BELOW && bytes < PACKED_BELOW => {
                *n += 1;
                bytes += len;
            }
            _ => {
                out.push(1);
                bytes = len;
            }
        }
    }
    out
}

/// One round of the fan-out on this rank: reads its units of `round` from the store, sends
/// them, and holds them with those it receives. Returns the bytes received, and this
/// rank's read failure (its peers then get nothing from it and read those bytes
/// themselves). An exchange that fails fails the load.
pub(super) fn fan_round(
    overlay: &mut Overlay<'_>,
    coll: &dyn Collective,
    meta: &Metadata,
    fan: &FanPlan,
    round: u32,
) -> Result<(u64, Result<()>)> {
    let me = coll.rank() as u32;
    let units: Vec<&Unit> = fan.units.iter().filter(|u| u.round == round).collect();
    // A unit outside the files failed the load already (`read_planned`): it is neither read
    // nor held, and the peers that wait for it read those bytes themselves.
    let units: Vec<&Unit> = units.into_iter().filter(|u| u.fits(meta)).collect();
    let mut mine: Vec<(&Unit, Vec<u8>)> =
        units.iter().filter(|u| u.from == me).map(|&u| (u, vec![0; u.len as usize])).collect();
    let read = read_units(overlay, meta, &mut mine);
    let mine: Vec<(&Unit, Bytes)> = mine.into_iter().map(|(u, data)| (u, Bytes::from(data))).collect();
    let mut to_peer: BTreeMap<u32, Vec<&(&Unit, Bytes)>> = BTreeMap::new();
    for m in &mine {
        for &t in &m.0.to {
            to_peer.entry(t).or_default().push(m);
        }
    }
    let mut sends = Vec::new();
    for (t, list) in to_peer {
        let mut it = list.into_iter();
        for n in packing(it.clone().map(|m| m.0.len)) {
            let part: Vec<_> = it.by_ref().take(n).collect();
            // A reader that failed sends nothing: its peers read those bytes themselves. A
            // unit alone in its message is sent as itself, one buffer for all its receivers;
            // units packed together (small ones) are copied into one.
            let msg = match part.as_slice() {
                _ if read.is_err() => Bytes::new(),
                [one] => one.1.clone(),
                many => Bytes::from(many.iter().map(|m| &m.1[..]).collect::<Vec<&[u8]>>().concat()),
            };
            sends.push((t as usize, msg));
        }
    }
    let mut from_peer: BTreeMap<u32, Vec<&Unit>> = BTreeMap::new();
    for &u in units.iter().filter(|u| u.from != me) {
        from_peer.entry(u.from).or_default().push(u);
    }
    let mut from = Vec::new();
    let mut expected: Vec<Vec<&Unit>> = Vec::new();
    for (s, list) in from_peer {
        let mut it = list.into_iter();
        for n in packing(it.clone().map(|u| u.len)) {
            from.push(s as usize);
            expected.push(it.by_ref().take(n).collect());
        }
    }
    let got = coll.exchange(sends, &from).map_err(in_phase("load: fan-out"))?;
    let mut received = 0;
    for (msg, units) in got.into_iter().zip(expected) {
        received += msg.len() as u64;
        if msg.len() as u64 != units.iter().map(|u| u.len).sum::<u64>() {
            continue;
        }
        // Held as slices of the message, not copies.
        let mut at = 0;
        for u in units {
            let data = msg.slice(at..at + u.len as usize);
            at += u.len as usize;
            overlay.hold(&meta.files[u.file as usize].name, u.at, data, u.sticky);
        }
    }
    if read.is_ok() {
        for (u, data) in mine {
            overlay.hold(&meta.files[u.file as usize].name, u.at, data, u.sticky);
        }
    }
    Ok((received, read))
}

/// Reads this rank's units of a round, those of one file in one call, as many files at
/// once as the store gains from.
fn read_units(overlay: &Overlay<'_>, meta: &Metadata, mine: &mut [(&Unit, Vec<u8>)]) -> Result<()> {
    // In the plan's order, which the messages keep; grouped by file here.
    let mut refs: Vec<&mut (&Unit, Vec<u8>)> = mine.iter_mut().collect();
    refs.sort_by_key(|m| (m.0.file, m.0.at));
    let mut by_file: Vec<Vec<&mut (&Unit, Vec<u8>)>> = Vec::new();
    for m in refs {
        match by_file.last_mut() {
            Some(g) if g[0].0.file == m.0.file => g.push(m),
            _ => by_file.push(vec![m]),
        }
    }
    for batch in by_file.chunks_mut(reads_in_flight(overlay)) {
        in_parallel(batch, |units| {
            let file = units[0].0.file as usize;
            let f = meta.files.get(file).ok_or_else(|| Error::protocol("a fan-out unit past the files"))?;
            let mut reads: Vec<(u64, &mut [u8])> = units.iter_mut().map(|m| (m.0.at, &mut m.1[..])).collect();
            FileReader::open(overlay, f)?.read_into(&mut reads)
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_sends_large_units_alone_and_packs_small_ones() {
        const M: u64 = PACKED_BELOW;
        // Small units pack until their message reaches PACKED_BELOW; a large one is alone.
        assert_eq!(packing([10, 20, M, 30, M / 2, M / 2, 5].into_iter()), vec![2, 1, 3, 1]);
        assert_eq!(packing([M, M, 3 * M].into_iter()), vec![1, 1, 1]);
        assert_eq!(packing(std::iter::empty()), Vec::<usize>::new());
        // Every unit is in exactly one message.
        let lens: Vec<u64> = (0..100).map(|i| (i * 7919) % (2 * M)).collect();
        assert_eq!(packing(lens.iter().copied()).iter().sum::<usize>(), lens.len());
    }
}
