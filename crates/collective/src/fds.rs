//! Rank 0's descriptor limit: it holds a socket per peer, so a world larger than the usual
//! soft limit of 1,024 needs the limit raised, or a clear refusal before anything listens.

use crate::{Error, Result};

/// Descriptors rank 0 may need besides a socket per peer and the handshakes in flight: its
/// listener, its own files and pipes.
const FDS_SPARE: u64 = 64;

/// Rank 0 holds one socket per peer; the usual soft limit of 1,024 would cap a world near
/// 1,000 ranks, so raise it toward the hard limit, or fail before listening, naming both
/// limits and what the world needs (rather than failing to accept halfway through).
pub(crate) fn fit_fd_limit(world_size: usize, handshakes: usize) -> Result<()> {
    let need = (world_size as u64).saturating_add(handshakes as u64).saturating_add(FDS_SPARE);
    match raise_open_files(need) {
        Ok(Ok(())) => Ok(()),
        Ok(Err((soft, hard))) => {
            let detail = format!(
                "a world of {world_size} ranks needs {need} open files on rank 0 (a socket per peer), but its \
                 RLIMIT_NOFILE is {soft} (hard limit {hard}); raise it (ulimit -n {need})"
            );
            Err(Error::Handshake { rank: 0, detail })
        }
        Err(e) => Err(Error::io("reading RLIMIT_NOFILE", e)),
    }
}

/// Raises this process's soft `RLIMIT_NOFILE` to `need` where the hard limit allows (a
/// process that holds a descriptor per peer or per child needs more than the usual 1,024).
/// `Ok(Err((soft, hard)))`: the limits, when they cannot hold `need`. Nothing to do where
/// there are no such limits.
#[cfg(unix)]
pub fn raise_open_files(need: u64) -> std::io::Result<std::result::Result<(), (u64, u64)>> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on a local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if lim.rlim_cur >= need {
        return Ok(Ok(()));
    }
    if lim.rlim_max >= need {
        let raised = libc::rlimit { rlim_cur: need, rlim_max: lim.rlim_max };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return Ok(Ok(()));
        }
    }
    Ok(Err((lim.rlim_cur, lim.rlim_max)))
}

/// See the Unix version: nothing to raise.
#[cfg(not(unix))]
pub fn raise_open_files(_need: u64) -> std::io::Result<std::result::Result<(), (u64, u64)>> {
    Ok(Ok(()))
}
