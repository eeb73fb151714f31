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
mod calls;
mod error;
mod json;
mod notes;
mod plot;
mod progress;
mod replay_cmd;
mod stats_cmd;
mod summary;
mod sweep;

use args::{Cli, Command};
use clap::Parser;
use cudalloc_cli::{report, split, table};
use error::{say, CliError};
use std::process::ExitCode;

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
            say!("cudalloc: error: {e}");
            ExitCode::from(2)
        }
    }
}
