//! `dckpt`: the demo (a save and a resharded load of the reference model), plans, inspect,
//! validate, convert and export, `launch`, run roots (`ls`, `gc`) and the benchmarks.

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

impl Command {
    /// Where a `--json` run of the command reports an error it does not report itself (a
    /// bad option, mostly): `Some(location)`, empty where the command names none.
    fn json_location(&self) -> Option<String> {
        let (json, location) = match self {
            Command::Demo(a) => (a.json, a.run.clone().unwrap_or_else(|| a.dir.clone())),
            Command::Inspect(a) => (a.json, a.location.clone()),
            Command::Validate(a) => (a.json, a.location.clone()),
            Command::Plan(a) => (a.json, String::new()),
            Command::Bench(a) => (a.json, String::new()),
            Command::Export(a) => (a.json, a.src.clone()),
            Command::Convert(a) => (a.json, a.src.clone()),
            Command::Ls(a) => (a.json, a.root.clone()),
            Command::Gc(a) => (a.json, a.root.clone()),
            Command::Launch(_) => (false, String::new()),
        };
        json.then_some(location)
    }
}

fn main() -> ExitCode {
    logger::install();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    let json = cli.command.json_location();
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
            // Scripts read stdout: one error object there too, as the commands' own errors.
            if let Some(location) = json {
                fmt::emit(&fmt::error_json(&location, &fmt::chain(&e), None));
            }
            ExitCode::from(2)
        }
    }
}

/// Help and version as clap prints them; a usage error (an unknown flag, a value out of
/// range, a path that is not UTF-8) as clap says it on stderr, with exit code 2, and where
/// `--json` was asked for, as one error object on stdout too: a script read nothing there.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind as K;
    if matches!(e.kind(), K::DisplayHelp | K::DisplayVersion | K::DisplayHelpOnMissingArgumentOrSubcommand) {
        e.exit()
    }
    let _ = e.print();
    if std::env::args_os().any(|a| a == "--json") {
        // Every line of clap's message up to its usage: the first alone ("the following
        // required arguments were not provided:") did not name the flag.
        let text = e.render().to_string();
        let said: Vec<&str> = text
            .lines()
            .map(str::trim)
            .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
            .filter(|l| !l.is_empty())
            .collect();
        let said = said.join(" ");
        fmt::emit(&fmt::error_json("", said.trim_start_matches("error: "), Some("see --help")));
    }
    ExitCode::from(2)
}
