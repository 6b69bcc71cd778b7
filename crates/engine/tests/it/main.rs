//! The engine on its own: planning, replicas, sourced pieces.
//!
//! One binary for every module below: a binary per file is linked once per file, which on a
//! small machine costs more than running the tests.

mod caller;
mod cast;
mod fan;
mod local;
mod plan;
mod replicas;
mod requests;
mod sourced;
mod stores;
