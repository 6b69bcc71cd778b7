//! `dckpt launch`: N local processes of one command as a torchrun-style job.

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;

pub(crate) mod job;
mod output;

use job::{LaunchOptions, launch};

/// Run N local processes of a command as one job (like torchrun on one node).
///
/// Each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
/// MASTER_PORT, DCKPT_MASTER_PORT and DCKPT_JOB_ID, so `dckpt demo` (and any program using
/// dckpt's TCP collective) forms one world. Output lines are prefixed `[rank N]`. When a
/// process fails the others are killed and its exit code is returned. A command named
/// `dckpt` runs this same binary.
///
/// Example: dckpt launch --nproc 4 -- dckpt demo --world 4 --load-world 4
#[derive(Debug, Args)]
#[command(verbatim_doc_comment)]
pub struct LaunchArgs {
    /// Number of processes (ranks).
    #[arg(long, value_name = "N")]
    pub nproc: usize,
    /// Port rank 0 listens on [default: a free one]. Not 0: the other ranks are told this
    /// port, and 0 is none they could reach.
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub master_port: Option<u16>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

pub fn run(a: &LaunchArgs) -> Result<ExitCode> {
    let mut command = a.command.clone();
    if command.first().map(String::as_str) == Some("dckpt") {
        command[0] = std::env::current_exe().context("finding this binary")?.to_string_lossy().into_owned();
    }
    let code = launch(&LaunchOptions { nproc: a.nproc, master_port: a.master_port, job_id: None, command })?;
    Ok(match code {
        0 => ExitCode::SUCCESS,
        c => ExitCode::from(u8::try_from(c).ok().filter(|c| *c != 0).unwrap_or(1)),
    })
}
