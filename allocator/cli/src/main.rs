//! `cudalloc`: replays recorded GPU allocation traces against cudalloc's policies on a simulated
//! H200 and compares what each reserves.
//!
//! - `cudalloc replay [--policy P]... [--config STR]... [--capacity BYTES] [--min-capacity]
//!   [--plot FILE.html] [--json] [TRACE...]`: a table per trace (or JSON lines), with the bundled
//!   traces in `traces/` when no TRACE is given.
//! - `cudalloc stats TRACE [--policy P]`: PyTorch-style memory statistics after one replay.
//!
//! Exit status: 0 on success, 1 when a replay failed to allocate, 2 on a usage or input error
//! (unreadable trace, bad config string, bad byte count).

mod args;
mod bundled;
mod json;
mod plot;
mod progress;
mod replay_cmd;
mod stats_cmd;
mod summary;
mod table;

use args::{Cli, Command};
use clap::Parser;
use std::fmt;
use std::process::ExitCode;

/// Why a command could not do its work.
#[derive(Debug)]
pub enum CliError {
    /// Reported on stderr; exit status 2.
    Message(String),
    /// stdout was closed by its reader (e.g. `| head`); exit quietly.
    BrokenPipe,
}

impl CliError {
    /// An error with a message.
    pub fn msg(m: impl Into<String>) -> Self {
        CliError::Message(m.into())
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::BrokenPipe => CliError::BrokenPipe,
            _ => CliError::Message(format!("cannot write the output: {e}")),
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Message(m) => f.write_str(m),
            CliError::BrokenPipe => f.write_str("broken pipe"),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Replay(a) => replay_cmd::run(a),
        Command::Stats(a) => stats_cmd::run(a),
    };
    match result {
        Ok(code) => code,
        Err(CliError::BrokenPipe) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cudalloc: error: {e}");
            ExitCode::from(2)
        }
    }
}
