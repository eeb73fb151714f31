//! Bad and extreme trace input, at the readers and through the `cudalloc` command: truncated,
//! garbage or wrongly typed files, pickles nested deep enough to overflow a stack, and sizes
//! whose rounding or sum passes `u64::MAX`.
//!
//! Invariants checked in this folder: each input gives a clear error (the right `TraceError`, or
//! exit status 1 or 2 with a message naming what was wrong) or a sane result, never a panic, a
//! stack overflow or an abort; integers saturate rather than wrap.
//!
//! Files: `bad_files.rs`, `trace_input_errors.rs`, `regressions.rs`.

mod bad_files;
mod regressions;
mod trace_input_errors;
