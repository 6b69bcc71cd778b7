//! Coverage validation and the region algebra.
//!
//! One binary for every module below: a binary per file is linked once per file, which on a
//! small machine costs more than running the tests.

mod coverage;
mod region_props;
