//! The storage contract on every backend, and the local backend's special files.
//!
//! One binary for every module below: a binary per file is linked once per file, which on a
//! small machine costs more than running the tests.
#![allow(clippy::single_range_in_vec_init)] // one-range slices are what the API takes

mod special_files;
mod storage;
mod suite;
