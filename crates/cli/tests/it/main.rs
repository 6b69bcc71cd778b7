//! `dckpt` as an operator runs it, one module per command family.
//!
//! One binary for every module below: a binary per file is linked once per file, which on a
//! small machine costs more than running the tests.

mod bench_cli;
mod demo_cli;
mod errors_cli;
mod export_cli;
mod hostile_metadata;
mod killed_save;
mod launch_cli;
mod plan_cli;
mod run_cli;
mod torch_dist_cli;
