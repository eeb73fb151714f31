//! A progress bar on stderr, drawn only when stderr is a terminal and the work is long enough to
//! be worth one. Each step is one replay (a measured run or one bisection probe), or, while
//! traces are read, one trace file.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// Traces of more operations than this get a progress bar.
pub const LONG_OPS: u64 = 100_000;

/// Trace files of more bytes than this in all get a bar while they are read (a 1.4 M-event
/// snapshot pickle takes seconds to read).
pub const LONG_READ_BYTES: u64 = 4 << 20;

/// The progress of a command; does nothing when hidden.
pub struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    /// A bar of `steps` replays, shown when `long` and stderr is a terminal.
    pub fn new(steps: u64, long: bool) -> Progress {
        if !long || !std::io::stderr().is_terminal() {
            return Progress { bar: None };
        }
        let bar = ProgressBar::new(steps);
        let template = "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} replays  {msg}";
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style);
        }
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        Progress { bar: Some(bar) }
    }

    /// A bar of `files` trace files being read, shown when they hold more than
    /// [`LONG_READ_BYTES`] and stderr is a terminal.
    pub fn reading(files: u64, bytes: u64) -> Progress {
        if bytes <= LONG_READ_BYTES || !std::io::stderr().is_terminal() {
            return Progress { bar: None };
        }
        let bar = ProgressBar::new(files);
        let template = "{spinner} [{elapsed_precise}] reading {pos}/{len} traces  {msg}";
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style);
        }
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        Progress { bar: Some(bar) }
    }

    /// Says what is being done.
    pub fn message(&self, msg: String) {
        if let Some(b) = &self.bar {
            b.set_message(msg);
        }
    }

    /// `n` more steps to do.
    pub fn add(&self, n: u64) {
        if let Some(b) = &self.bar {
            b.inc_length(n);
        }
    }

    /// One step done.
    pub fn step(&self) {
        if let Some(b) = &self.bar {
            b.inc(1);
        }
    }

    /// Runs `f` with the bar hidden (for printing to the terminal).
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(b) => b.suspend(f),
            None => f(),
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
