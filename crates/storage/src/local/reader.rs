//! Ranged reads of one open file.

use std::fs::File;
use std::io::{self};

use super::sys::*;
use super::*;
use crate::{Error, ObjectReader, Result, check_ranges};

/// One file opened for reading (see [`Storage::reader`]).
pub(super) struct LocalReader {
    pub(super) file: File,
    pub(super) len: u64,
    pub(super) location: String,
    /// Reused between calls: the reads in file order, the buffer gaps are read into, and
    /// which reads are copied out of the mapping.
    pub(super) order: Vec<usize>,
    pub(super) scratch: Vec<u8>,
    pub(super) taken: Vec<bool>,
    /// The file mapped, for short stretches far apart (see [`MAPPED_BELOW`]): made on the
    /// first call that has enough of them, dropped after a failed copy; never made unless
    /// [`LocalConfig::mapped_reads`] is on.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    pub(super) map: Mapped,
}

/// A run of reads (reads that continue one another) shorter than this is copied out of a
/// mapping of the file when a call has at least [`MAPPED_RUNS_MIN`] of them, instead of
/// costing a system call, or a kernel copy of the gap before it, each: below it the mapping
/// was faster, from it on the same (docs/benchmarks.md, "Decisions behind the constants").
pub(super) const MAPPED_BELOW: u64 = 32 << 10;

/// The fewest short runs in one call worth a mapping (a judgement, not measured: a call with
/// a handful of short reads does not make a mapping of the whole file for them).
pub(super) const MAPPED_RUNS_MIN: usize = 16;

/// Where a reader stands with its mapping.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(super) enum Mapped {
    /// Not needed yet.
    NotYet,
    #[cfg(target_os = "linux")]
    Ready(crate::mapped::Mapping),
    /// Not wanted ([`LocalConfig::mapped_reads`] off), not possible, or given up after a
    /// fault: every read is a system call.
    Never,
}

impl LocalReader {
    /// Copies the reads of `order` that lie in runs shorter than [`MAPPED_BELOW`] out of the
    /// file's mapping, when there are enough of them, and removes them from `order`.
    #[cfg(target_os = "linux")]
    pub(super) fn copy_short_runs(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        use crate::mapped::Mapping;
        if matches!(self.map, Mapped::Never) {
            return Ok(());
        }
        let order = &mut self.order;
        // Which reads lie in short runs (runs: reads in `order`, sorted by offset, each
        // starting where the one before ends).
        let taken = &mut self.taken;
        taken.clear();
        taken.resize(reads.len(), false);
        let mut runs = 0;
        let mut i = 0;
        while i < order.len() {
            let start = reads[order[i]].0;
            let mut end = start + reads[order[i]].1.len() as u64;
            let mut j = i + 1;
            while j < order.len() && reads[order[j]].0 == end {
                end += reads[order[j]].1.len() as u64;
                j += 1;
            }
            if end - start < MAPPED_BELOW {
                runs += 1;
                for &k in &order[i..j] {
                    taken[k] = true;
                }
            }
            i = j;
        }
        if runs < MAPPED_RUNS_MIN {
            return Ok(());
        }
        if matches!(self.map, Mapped::NotYet) {
            self.map = Mapping::new(&self.file, self.len).map_or(Mapped::Never, Mapped::Ready);
        }
        let Mapped::Ready(map) = &self.map else { return Ok(()) };
        let copied = map.copy_out(
            &self.file,
            reads.iter_mut().enumerate().filter(|(k, _)| taken[*k]).map(|(_, (at, buf))| (*at, &mut **buf)),
        );
        let why = match copied {
            Ok(()) => {
                order.retain(|&k| !taken[k]);
                return Ok(());
            }
            Err(why) => why,
        };
        self.given_up(why)
    }

    /// Copies every read out of the file's mapping, each shown to `inspect` just before it is
    /// copied ([`crate::mapped::Mapping::copy_inspected`]); `false` when there is no mapping
    /// to copy from, and the caller reads.
    #[cfg(target_os = "linux")]
    pub(super) fn copy_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<bool> {
        use crate::mapped::Mapping;
        if matches!(self.map, Mapped::NotYet) {
            self.map = Mapping::new(&self.file, self.len).map_or(Mapped::Never, Mapped::Ready);
        }
        let Mapped::Ready(map) = &self.map else { return Ok(false) };
        match map.copy_inspected(&self.file, reads, inspect) {
            Ok(()) => Ok(true),
            Err(why) => self.given_up(why).map(|()| false),
        }
    }

    /// [`crate::mapped::Mapping::copy_picked`]; `false` when there is no mapping to copy
    /// from, and the caller reads.
    #[cfg(target_os = "linux")]
    pub(super) fn copy_picked(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<bool> {
        use crate::mapped::Mapping;
        if matches!(self.map, Mapped::NotYet) {
            self.map = Mapping::new(&self.file, self.len).map_or(Mapped::Never, Mapped::Ready);
        }
        let Mapped::Ready(map) = &self.map else { return Ok(false) };
        match map.copy_picked(&self.file, range, picks, inspect) {
            Ok(()) => Ok(true),
            Err(why) => self.given_up(why).map(|()| false),
        }
    }

    #[cfg(not(target_os = "linux"))]
    pub(super) fn copy_picked(
        &mut self,
        _range: std::ops::Range<u64>,
        _picks: &mut [(u64, &mut [u8])],
        _inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<bool> {
        Ok(false)
    }

    #[cfg(not(target_os = "linux"))]
    pub(super) fn copy_inspected(
        &mut self,
        _reads: &mut [(u64, &mut [u8])],
        _inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<bool> {
        Ok(false)
    }

    /// Drops the mapping after a copy out of it failed: `Ok` where nothing was copied (the
    /// caller reads instead), else the error naming the offset.
    #[cfg(target_os = "linux")]
    fn given_up(&mut self, why: crate::mapped::Unreadable) -> Result<()> {
        use crate::mapped::Unreadable;
        self.map = Mapped::Never;
        let message = match why {
            // Nothing was copied: read instead, as without a mapping.
            Unreadable::NoHandler | Unreadable::Failed => return Ok(()),
            Unreadable::Fault(at) => format!(
                "the page at offset {at} could not be read (a read error, or the file was cut short while being read)"
            ),
            Unreadable::Shorter { size, end } => {
                format!(
                    "the file is now {size} bytes, short of a read that ended at {end} (it was cut short while being read)"
                )
            }
            Unreadable::Stat => "the file's size could not be checked after reading".to_string(),
        };
        Err(Error::io("read", &self.location, io::Error::other(message)))
    }

    #[cfg(not(target_os = "linux"))]
    pub(super) fn copy_short_runs(&mut self, _reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        Ok(())
    }
}

impl ObjectReader for LocalReader {
    /// With [`LocalConfig::mapped_reads`], every read is copied out of the file's mapping;
    /// otherwise read, then inspected.
    fn read_into_inspected(
        &mut self,
        reads: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        if !matches!(self.map, Mapped::Never) {
            let loc = &self.location;
            check_ranges(loc, &crate::read_ranges(loc, reads)?, self.len)?;
            if self.copy_inspected(reads, inspect)? {
                return Ok(());
            }
        }
        crate::read_then_inspect(self, reads, inspect)
    }

    /// With [`LocalConfig::mapped_reads`], the range is shown and the picks copied out of
    /// the file's mapping; otherwise read a piece at a time, shown, and picked.
    fn read_picked_inspected(
        &mut self,
        range: std::ops::Range<u64>,
        picks: &mut [(u64, &mut [u8])],
        inspect: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        if !matches!(self.map, Mapped::Never) {
            // `read_then_pick` below asserts the same of the picks.
            crate::assert_picks(&range, picks);
            check_ranges(&self.location, std::slice::from_ref(&range), self.len)?;
            if self.copy_picked(range.clone(), picks, inspect)? {
                return Ok(());
            }
        }
        crate::read_then_pick(self, range, picks, inspect)
    }

    fn read_into(&mut self, reads: &mut [(u64, &mut [u8])]) -> Result<()> {
        let loc = &self.location;
        check_ranges(loc, &crate::read_ranges(loc, reads)?, self.len)?;
        self.order.clear();
        self.order.extend((0..reads.len()).filter(|&i| !reads[i].1.is_empty()));
        self.order.sort_unstable_by_key(|&i| reads[i].0);
        self.copy_short_runs(reads)?;
        // Reads that continue one another, or nearly, go into one vectored read: many small
        // pieces of one file cost a few system calls, not one each, and still no copy. A
        // short gap between two reads is read into a scratch buffer, which is cheaper than
        // a system call for it (every gap reuses the same scratch).
        let loc = &self.location;
        let order = &self.order;
        let scratch = &mut self.scratch;
        let mut iov: Vec<libc::iovec> = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let start = reads[order[i]].0;
            let mut end = start;
            iov.clear();
            while i < order.len() && iov.len() < IOVECS_MAX {
                let (at, ref mut buf) = reads[order[i]];
                // Reads may overlap; an overlapping one starts a new system call.
                if at < end || (at > end && (at - end > READ_GAP_FILL || iov.len() + 1 == IOVECS_MAX)) {
                    break;
                }
                if at > end {
                    if scratch.is_empty() {
                        scratch.resize(READ_GAP_FILL as usize, 0);
                    }
                    iov.push(libc::iovec { iov_base: scratch.as_mut_ptr().cast(), iov_len: (at - end) as usize });
                }
                iov.push(libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() });
                end = at + buf.len() as u64;
                i += 1;
            }
            preadv_exact(&self.file, &mut iov, start).map_err(|e| Error::io("read", loc, e))?;
        }
        Ok(())
    }
}
