//! Descriptor limits. Rank 0 holds a socket per peer, so a world larger than the usual soft
//! limit of 1,024 needs the limit raised, or a clear refusal before anything listens. Any
//! other rank may come to hold two per peer (the direct connections of `exchange`, one it
//! dialed and one it accepted), so it raises its limit where it can and names the limit
//! when a dial runs out.

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

/// What any rank but rank 0 may hold: a direct connection to and from each peer.
pub(crate) fn peer_fds_needed(world_size: usize) -> u64 {
    (world_size as u64).saturating_mul(2).saturating_add(FDS_SPARE)
}

/// Raises the soft limit toward [`peer_fds_needed`] where the hard limit allows; a rank
/// that cannot still works while its direct connections fit, and a dial past the limit
/// fails naming it ([`out_of_fds`]).
pub(crate) fn make_room_for_peers(world_size: usize) {
    match raise_open_files(peer_fds_needed(world_size)) {
        Ok(Ok(())) => {}
        Ok(Err((soft, hard))) => log::debug!(
            "collective: RLIMIT_NOFILE {soft} (hard {hard}) holds fewer than the {} direct connections a world of \
             {world_size} may open",
            peer_fds_needed(world_size)
        ),
        Err(e) => log::debug!("collective: reading RLIMIT_NOFILE: {e}"),
    }
}

/// What a dial that ran out of descriptors says: the limit, and what the world may need.
pub(crate) fn out_of_fds(world_size: usize) -> String {
    let soft = current_soft_limit().map_or_else(|| "unknown".to_string(), |s| s.to_string());
    format!(
        "out of open files: RLIMIT_NOFILE is {soft}, and a rank of a world of {world_size} may hold two sockets \
         per peer; raise it (ulimit -n {})",
        peer_fds_needed(world_size)
    )
}

#[cfg(unix)]
fn current_soft_limit() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a plain syscall on a local struct.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0).then_some(lim.rlim_cur)
}

#[cfg(not(unix))]
fn current_soft_limit() -> Option<u64> {
    None
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

#[cfg(test)]
mod tests {
    /// A dial out of descriptors names the limit and what to raise it to.
    #[cfg(unix)]
    #[test]
    fn out_of_descriptors_names_the_limit() {
        let e = super::out_of_fds(1000);
        assert!(e.contains("RLIMIT_NOFILE is ") && e.contains("ulimit -n 2064"), "{e}");
    }
}
