//! The one error type of this crate.

use std::borrow::Cow;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Everything a collective call, a rendezvous or the launcher can fail with.
///
/// Variants name the peer rank involved wherever there is one, so an operator reading the
/// error of any surviving rank learns which rank to look at.
///
/// Serializable, so that a caller can send it to another rank as it is: the names it holds
/// are `Cow`s that come back with the same text, and an operating-system error travels as
/// its message, so the error read back displays the same.
#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Error {
    /// A peer's connection closed or its handle was dropped (process died, thread panicked,
    /// or the peer gave up): noticed at once, not after a timeout.
    #[error("rank {rank} is gone (connection closed or handle dropped) during {op}")]
    PeerDead {
        /// The rank that went away.
        rank: usize,
        /// The call in progress when it was noticed.
        op: Cow<'static, str>,
    },
    /// A peer did not answer within the call's timeout.
    #[error("timed out after {timeout:?} waiting for rank {rank} during {op}")]
    Timeout {
        /// The rank waited for.
        rank: usize,
        /// The call in progress.
        op: Cow<'static, str>,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// A message (sent or received) is larger than the configured bound.
    #[error("message of {bytes} bytes from rank {rank} exceeds the limit of {bytes_max} bytes")]
    MessageTooLarge {
        /// The rank whose message it is.
        rank: usize,
        /// Its size.
        bytes: u64,
        /// The configured bound (`message_bytes_max`).
        bytes_max: u64,
    },
    /// A peer sent something that does not fit the protocol: bad magic or checksum, a frame
    /// of the wrong kind, or a different call than this rank made (ranks disagree on the
    /// sequence of collectives, or on the arguments of one, e.g. the all-reduce length).
    #[error("protocol error with rank {rank}: {detail}")]
    Protocol {
        /// The rank that sent it.
        rank: usize,
        /// What was wrong.
        detail: String,
    },
    /// Another rank failed and aborted the collective; its reason is attached.
    #[error("rank {rank} aborted the collective: {reason}")]
    Aborted {
        /// The rank that aborted.
        rank: usize,
        /// Its error, as text.
        reason: String,
    },
    /// A call was made on an instance that already failed. After any error an instance is
    /// poisoned: the ranks no longer agree on where they are in the call sequence.
    #[error("collective is poisoned by an earlier error: {cause}")]
    Poisoned {
        /// The first error, as text.
        cause: String,
    },
    /// The rendezvous failed: rank 0 refused this rank (wrong job id, world size, version,
    /// rank taken or out of range), or rank 0 could not be reached in time.
    #[error("rendezvous failed for rank {rank}: {detail}")]
    Handshake {
        /// This rank.
        rank: usize,
        /// Why.
        detail: String,
    },
    /// A caller passed arguments that break the contract (root out of range, a root without
    /// data, a world of zero ranks).
    #[error("invalid argument: {detail}")]
    InvalidArgument {
        /// What was wrong.
        detail: String,
    },
    /// An environment variable is missing or malformed.
    #[error("environment variable {var}: {detail}")]
    Env {
        /// The variable.
        var: Cow<'static, str>,
        /// What was wrong.
        detail: String,
    },
    /// An operating-system error (bind, spawn, socket options) outside a peer's failure.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error (read back from another process: its message).
        #[source]
        #[serde(with = "io_text")]
        source: std::io::Error,
    },
    /// A CUDA or NCCL library is missing, or a CUDA/NCCL call failed.
    #[error("gpu backend: {detail}")]
    Gpu {
        /// What failed (names the library and the paths tried when one is missing).
        detail: String,
    },
}

impl Error {
    /// The same error with the caller's `phase` named beside the call it stopped in, so
    /// that a rank that timed out or lost a peer says where the job stopped: "timed out
    /// after 30s waiting for rank 17 during 'save commit' (gather)". A failure of the
    /// transport itself (a collective over torch.distributed that raised) says the phase
    /// too. Other variants name no call and come back as they are.
    pub fn in_phase(self, phase: &str) -> Error {
        match self {
            Error::PeerDead { rank, op } => Error::PeerDead { rank, op: format!("'{phase}' ({op})").into() },
            Error::Timeout { rank, op, timeout } => {
                Error::Timeout { rank, op: format!("'{phase}' ({op})").into(), timeout }
            }
            Error::Io { context, source } => Error::Io { context: format!("during '{phase}': {context}"), source },
            other => other,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }

    pub(crate) fn invalid(detail: impl Into<String>) -> Self {
        Error::InvalidArgument { detail: detail.into() }
    }
}

/// An operating-system error as its message: serialized as its `Display`, read back as an
/// error of kind `Other` that displays that text.
mod io_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(source: &std::io::Error, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(source)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<std::io::Error, D::Error> {
        String::deserialize(d).map(std::io::Error::other)
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A lost peer and a failed transport both say the phase the job stopped in (a failure
    /// of a collective over torch.distributed named only its call).
    #[test]
    fn in_phase_names_the_phase_of_a_lost_peer_and_of_a_failed_transport() {
        let dead = Error::PeerDead { rank: 3, op: "gather".into() }.in_phase("save commit");
        assert!(dead.to_string().contains("'save commit' (gather)"), "{dead}");
        let io =
            Error::Io { context: "rank 1: torch.distributed gather failed".into(), source: std::io::Error::other("x") };
        let io = io.in_phase("load plan").to_string();
        assert!(io.contains("during 'load plan': rank 1: torch.distributed gather failed"), "{io}");
        let bad = Error::InvalidArgument { detail: "root 9".into() }.in_phase("load plan").to_string();
        assert!(!bad.contains("load plan"), "{bad}");
    }
}
