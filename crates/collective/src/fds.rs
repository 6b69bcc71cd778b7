//! Rank 0's descriptor limit: it holds a socket per peer, so a world larger than the usual
//! soft limit of 1,024 needs the limit raised, or a clear refusal before anything listens.

use crate::{Error, Result};

/// Descriptors rank 0 may need besides a socket per peer and the handshakes in flight: its
/// listener, its own files and pipes.
const FDS_SPARE: u64 = 64;

/// Rank 0 holds one socket per peer; the usual soft limit of 1,024 would cap a world near
/// 1,000 ranks, so raise it toward the hard limit, or fail before listening, naming both
/// limits and what the world needs (rather than failing to accept halfway through).
#[cfg(unix)]
pub(crate) fn fit_fd_limit(world_size: usize, handshakes: usize) -> Result<()> {
    let need = (world_size as u64).saturating_add(handshakes as u64).saturating_add(FDS_SPARE);
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on a local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(Error::io("reading RLIMIT_NOFILE", std::io::Error::last_os_error()));
    }
    if lim.rlim_cur >= need {
        return Ok(());
    }
    if lim.rlim_max >= need {
        let raised = libc::rlimit { rlim_cur: need, rlim_max: lim.rlim_max };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return Ok(());
        }
    }
    let detail = format!(
        "a world of {world_size} ranks needs {need} open files on rank 0 (a socket per peer), but its \
         RLIMIT_NOFILE is {} (hard limit {}); raise it (ulimit -n {need})",
        lim.rlim_cur, lim.rlim_max
    );
    Err(Error::Handshake { rank: 0, detail })
}

#[cfg(not(unix))]
pub(crate) fn fit_fd_limit(_world_size: usize, _handshakes: usize) -> Result<()> {
    Ok(())
}
