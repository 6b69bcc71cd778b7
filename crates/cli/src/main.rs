//! `dckpt`: plan, save, load, inspect and validate distributed checkpoints.

mod args;
mod bench;
mod convert;
mod demo;
mod export;
mod fmt;
mod inspect;
mod launch;
mod local_ls;
mod logger;
mod plan;
mod progress;
mod run;
mod store;
mod torch_dist;
mod validate;

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
    Demo(demo::DemoArgs),
    Inspect(inspect::InspectArgs),
    Validate(validate::ValidateArgs),
    Launch(launch::LaunchArgs),
    Plan(plan::PlanArgs),
    Bench(bench::BenchArgs),
    Export(export::ExportArgs),
    Convert(convert::ConvertArgs),
    Ls(run::LsArgs),
    Gc(run::GcArgs),
}

fn main() -> ExitCode {
    logger::install();
    let cli = Cli::parse();
    let result = match cli.command {
        // `--run` is the run manager's: it takes the demo's layouts and runs its own steps.
        Command::Demo(a) => match &a.run {
            Some(root) => demo::layouts(&a).and_then(|(save, load)| run::demo_run(&a, root, save, load)),
            None => demo::run(&a),
        },
        Command::Inspect(a) => inspect::run(&a),
        Command::Validate(a) => validate::run(&a),
        Command::Launch(a) => launch::run(&a),
        Command::Plan(a) => plan::run(&a),
        Command::Bench(a) => bench::run(&a),
        Command::Export(a) => export::run(&a),
        Command::Convert(a) => convert::run(&a),
        Command::Ls(a) => run::ls(&a),
        Command::Gc(a) => run::gc(&a),
    };
    match result {
        Ok(code) => code,
        // What a command does not turn into an exit code itself: bad options, mostly.
        Err(e) => {
            eprintln!("dckpt: {}", fmt::chain(&e));
            ExitCode::from(2)
        }
    }
}
