//! The trace readers and the recorder: our CSV (plain and gzip'd), RMM's log, PyTorch's snapshot
//! pickles with every action they hold, and traces recorded by a `RecordingAllocator`, end to end
//! through files.
//!
//! Invariants checked in this folder: a trace read back is the trace written (the same events in
//! the same order, whatever the format or compression); every input the readers refuse is a
//! `TraceError` naming the line or field, never a panic; anomalies are counted, not dropped.
//!
//! The recorder on a real GPU (`record_buffers.rs`): those tests are
//! #[ignore = "needs a CUDA GPU"] elsewhere; run them with `--include-ignored` on the GPU machine.
//!
//! Files: `trace_formats.rs`, `snapshot_actions.rs`, `record_buffers.rs`.

#[path = "../common/mod.rs"]
#[allow(dead_code)]
mod common;

mod record_buffers;
mod snapshot_actions;
mod trace_formats;
