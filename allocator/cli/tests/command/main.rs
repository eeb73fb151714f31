//! The `cudalloc` command, run as a built binary: what `replay` and `stats` print (table, JSON,
//! plot, progress bars), what a new user meets first, its finer points, and what it refuses.
//!
//! Invariants checked in this folder: every run either succeeds (exit 0) with figures equal to the
//! library's replay, or exits 1 (a replay that failed, reported as such) or 2 (bad usage) with a
//! message naming the option, key, file or line that was wrong; never a panic; a config string
//! says which policy it runs.
//!
//! Files: `replay.rs`, `answers.rs`, `refusals.rs`, `review.rs`, `new_user.rs`,
//! `memory_fraction_key.rs`, `progress.rs`, `split.rs`, `closed_stderr.rs`; `run.rs` holds
//! helpers of the first two.

#[allow(dead_code)]
mod run;

mod answers;
mod closed_stderr;
mod memory_fraction_key;
mod new_user;
mod progress;
mod refusals;
mod replay;
mod review;
mod split;
