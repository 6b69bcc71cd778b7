//! Cross-crate scenarios.
//!
//! One binary for every module below: a binary per file is linked once per file, which on a
//! small machine costs more than running the tests. `format.rs` and `metadata_memory.rs` are
//! binaries of their own: each installs a global allocator that measures what the decoder
//! allocates, which no other test should run under.

mod architecture;
mod backends;
mod corruption;
mod crash;
mod engine_features;
mod field_bugs;
mod handmade;
mod leftovers;
mod load_props;
mod python_reader;
mod replace_race;
mod reshard;
mod scale;
mod shared_reads;
mod smoke;
mod stall;
