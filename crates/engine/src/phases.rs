//! Where the time of a save or load went: for each phase, the slowest rank and its time,
//! gathered in a round the protocol already has (the commit's, the load's result).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The slowest rank of one phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slowest {
    /// The rank that took longest (the lowest of those that took as long).
    pub rank: u32,
    /// How long it took.
    pub time: Duration,
}

impl Slowest {
    /// The slowest of `times`, one per rank in rank order.
    pub fn of(times: impl IntoIterator<Item = Duration>) -> Slowest {
        times
            .into_iter()
            .enumerate()
            .fold(Slowest::default(), |s, (r, time)| if time > s.time { Slowest { rank: r as u32, time } } else { s })
    }

    /// One rank's time alone (a phase only the coordinator runs).
    pub fn on(rank: u32, time: Duration) -> Slowest {
        Slowest { rank, time }
    }
}

/// A save's phases, each its slowest rank: the same on every rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavePhases {
    /// The host copy of a background save, before the call returned (zero for a save that
    /// writes from the caller's buffers).
    pub stage: Slowest,
    /// From the call (or the background save's start) to each rank knowing what it writes:
    /// the vote on the cached plan, the plan or its reuse, and the replica check.
    pub plan: Slowest,
    /// Streaming the rank's data files.
    pub write: Slowest,
    /// The coordinator's commit of the metadata (and the clean-up after it).
    pub commit: Slowest,
}

/// A load's phases, each its slowest rank: the same on every rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadPhases {
    /// The coordinator reading and validating the metadata.
    pub metadata: Slowest,
    /// The coordinator planning every rank's reads.
    pub plan: Slowest,
    /// Reading into the rank's buffers, every byte checked against its checksum.
    pub read: Slowest,
    /// The coordinator's check of the blocks the ranks read in parts.
    pub check: Slowest,
}

/// Names and values of phases, in order, for reports.
pub trait Phases {
    /// Each phase's name and slowest rank.
    fn each(&self) -> Vec<(&'static str, Slowest)>;
}

impl Phases for SavePhases {
    fn each(&self) -> Vec<(&'static str, Slowest)> {
        vec![("stage", self.stage), ("plan", self.plan), ("write", self.write), ("commit", self.commit)]
    }
}

impl Phases for LoadPhases {
    fn each(&self) -> Vec<(&'static str, Slowest)> {
        vec![("metadata", self.metadata), ("plan", self.plan), ("read", self.read), ("check", self.check)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_is_the_first_of_the_longest() {
        let ms = Duration::from_millis;
        assert_eq!(Slowest::of([ms(1), ms(5), ms(2), ms(5)]), Slowest { rank: 1, time: ms(5) });
        assert_eq!(Slowest::of(Vec::<Duration>::new()), Slowest::default());
    }
}
