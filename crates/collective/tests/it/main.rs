//! The collectives' conformance suite and the TCP backend's failure paths.
//!
//! One binary for every module below: a binary per file is linked once per file, which on a
//! small machine costs more than running the tests.

mod conformance;
mod hub_verdict;
mod rendezvous;
