//! The plain work the engine figures are measured against: one writer or several in
//! parallel, one reader or several, a copy out of a mapping, with nothing checked.

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use dckpt_reference::RankState;

use super::each_on_a_thread;

/// A plain sequential write of the same bytes to one file, with fsync; seconds.
pub(super) fn plain_write(dir: &Path, states: &[RankState]) -> Result<f64> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let t = Instant::now();
    let mut f = File::create(dir.join("plain.bin"))?;
    for s in states {
        for b in &s.buffers {
            f.write_all(b)?;
        }
    }
    f.sync_all()?;
    File::open(dir)?.sync_all()?;
    Ok(t.elapsed().as_secs_f64())
}

/// A plain sequential read of every file in `dir` into one buffer; seconds.
pub(super) fn plain_read(dir: &Path, buf: &mut Vec<u8>) -> Result<f64> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    files.sort();
    let t = Instant::now();
    for p in files {
        let mut f = File::open(&p)?;
        let n = f.metadata()?.len() as usize;
        buf.resize(n.max(buf.len()), 0);
        f.read_exact(&mut buf[..n])?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// The writer and reader counts the parallel ceilings try; the fastest one is used.
pub(super) const PARALLEL_COUNTS: [usize; 4] = [1, 2, 4, 8];

/// The same bytes as [`plain_write`] cut into `writers` contiguous parts, each written and
/// fsynced to a file of its own by a thread of its own, then the directory; seconds.
pub(super) fn parallel_write(dir: &Path, states: &[RankState], writers: usize) -> Result<f64> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let bufs: Vec<&[u8]> = states.iter().flat_map(|s| s.buffers.iter().map(|b| &b[..])).collect();
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let per = total.div_ceil(writers.max(1)).max(1);
    let t = Instant::now();
    each_on_a_thread((0..writers).collect(), |w| {
        let (start, end) = ((w * per).min(total), ((w + 1) * per).min(total));
        let mut f = File::create(dir.join(format!("plain-{w}.bin")))?;
        let mut at = 0;
        for b in &bufs {
            let (lo, hi) = (start.max(at), end.min(at + b.len()));
            if lo < hi {
                f.write_all(&b[lo - at..hi - at])?;
            }
            at += b.len();
        }
        f.sync_all()?;
        Ok(())
    })?;
    File::open(dir)?.sync_all()?;
    Ok(t.elapsed().as_secs_f64())
}

/// The files of `dir`, sorted, with their sizes.
pub(super) fn files_of(dir: &Path) -> Result<Vec<(std::path::PathBuf, usize)>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| Ok((e.path(), e.metadata()?.len() as usize)))
        .collect::<Result<_>>()?;
    files.sort();
    Ok(files)
}

/// Every file of `dir` read whole into its own buffer of `bufs` (kept between rounds),
/// the files dealt round-robin to `readers` threads; seconds. With `mapped`, each file is
/// mapped (`MAP_POPULATE`) and copied out of the mapping instead of read.
pub(super) fn parallel_read(dir: &Path, bufs: &mut Vec<Vec<u8>>, readers: usize, mapped: bool) -> Result<f64> {
    let files = files_of(dir)?;
    bufs.resize_with(files.len(), Vec::new);
    for (b, (_, n)) in bufs.iter_mut().zip(&files) {
        b.resize(*n, 0);
    }
    let readers = readers.clamp(1, files.len().max(1));
    let mut dealt: Vec<Vec<(&std::path::PathBuf, &mut Vec<u8>)>> = (0..readers).map(|_| Vec::new()).collect();
    for (i, ((p, _), b)) in files.iter().zip(bufs.iter_mut()).enumerate() {
        dealt[i % readers].push((p, b));
    }
    let t = Instant::now();
    each_on_a_thread(dealt, |mine| {
        for (p, b) in mine {
            let mut f = File::open(p)?;
            if mapped {
                copy_mapped(&f, b)?;
            } else {
                f.read_exact(b)?;
            }
        }
        Ok(())
    })?;
    Ok(t.elapsed().as_secs_f64())
}

/// Copies the first `out.len()` bytes of `f` out of a mapping of it.
pub(super) fn copy_mapped(f: &File, out: &mut [u8]) -> Result<()> {
    use std::os::fd::AsRawFd;
    if out.is_empty() {
        return Ok(());
    }
    // SAFETY: a fresh read-only private mapping of `out.len()` bytes of a file this bench
    // wrote and nothing changes while it is read; unmapped before returning.
    unsafe {
        let at = libc::mmap(
            std::ptr::null_mut(),
            out.len(),
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_POPULATE,
            f.as_raw_fd(),
            0,
        );
        if at == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        std::ptr::copy_nonoverlapping(at as *const u8, out.as_mut_ptr(), out.len());
        libc::munmap(at, out.len());
    }
    Ok(())
}

/// The fastest of [`PARALLEL_COUNTS`] for `run`, one try each (after one not counted):
/// the count and every try's seconds.
pub(super) fn fastest_count(mut run: impl FnMut(usize) -> Result<f64>) -> Result<(usize, Vec<(usize, f64)>)> {
    run(PARALLEL_COUNTS[0])?;
    let tries: Vec<(usize, f64)> = PARALLEL_COUNTS.iter().map(|&n| Ok((n, run(n)?))).collect::<Result<_>>()?;
    let best = tries.iter().min_by(|a, b| a.1.total_cmp(&b.1)).map_or(1, |t| t.0);
    Ok((best, tries))
}

pub(super) fn tries_note(tries: &[(usize, f64)]) -> String {
    tries.iter().map(|(n, s)| format!("{n}: {s:.3} s")).collect::<Vec<_>>().join(", ")
}

/// Three sides per round, dckpt first on even rounds and last on odd ones; their seconds
/// as (dckpt, b, c).
pub(super) fn three_way(
    rounds: usize,
    mut dckpt: impl FnMut() -> Result<f64>,
    mut b: impl FnMut() -> Result<f64>,
    mut c: impl FnMut() -> Result<f64>,
) -> Result<Vec<(f64, f64, f64)>> {
    (0..rounds)
        .map(|i| {
            if i % 2 == 0 {
                let d = dckpt()?;
                Ok((d, b()?, c()?))
            } else {
                let (cc, bb) = (c()?, b()?);
                Ok((dckpt()?, bb, cc))
            }
        })
        .collect()
}

/// Drops the page cache (needs root); false when not allowed.
pub(super) fn drop_caches() -> bool {
    let _ = std::process::Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}
