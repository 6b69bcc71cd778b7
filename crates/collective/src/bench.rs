//! Benchmarks of the collectives.
