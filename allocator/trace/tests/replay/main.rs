//! Replays of traces on the simulated device (and one through the real driver): fidelity to
//! PyTorch's own figures, the figures of the `default` policy on every bundled trace, the front
//! against a bare pool, caps, resets of the peaks, and the memory timeline.
//!
//! Invariants checked in this folder: a replay is deterministic (the same trace and policy give the
//! same figures); `torch` and `torch-expandable` land on PyTorch's recorded peaks and driver
//! calls; `default` stays within its bounds on every bundled trace; a cap (a capacity or the
//! `per_process_memory_fraction` key) holds; resetting peaks changes no behaviour; the timeline's
//! highest points are the replay's peaks; a policy given as a value replays as the same rules
//! named by a config; the steps `--calls` writes mark exactly the allocations at a new high of
//! the live bytes.
//!
//! Files: `call_log.rs`, `capped.rs`, `cuda_replay.rs` (through the real driver; its test is
//! #[ignore = "needs a CUDA GPU"], said here too so that the GPU staging, which looks for that
//! mark in this file, stages this binary),
//! `device_lag.rs` (a device that runs behind), `fidelity.rs`,
//! `policy_figures.rs`, `front_fidelity.rs`, `memory_fraction_key.rs`, `replay_policy.rs`,
//! `reset_peaks.rs`, `threads.rs` (a real program's trace on the three threads that made its
//! calls), `timeline.rs`.

mod call_log;
mod capped;
mod cuda_replay;
mod device_lag;
mod fidelity;
mod front_fidelity;
mod memory_fraction_key;
mod policy_figures;
mod replay_policy;
mod reset_peaks;
mod threads;
mod timeline;
