//! `dckpt`: plan, save, load, inspect and validate distributed checkpoints.

mod args;
mod bench;
mod fmt;
mod plan;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Distributed checkpointing for large models: every byte of every global tensor saved
/// exactly once, loadable into any other parallel layout.
#[derive(Debug, Parser)]
#[command(name = "dckpt", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Plan(plan::PlanArgs),
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(a) => plan::run(&a),
        Command::Bench(a) => bench::run(&a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dckpt: {e:#}");
            ExitCode::from(2)
        }
    }
}
