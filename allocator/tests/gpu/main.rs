//! The allocator on a real GPU (`CudaDevice`) and its cudarc interop (testing tier 6). Every test
//! here but the pure size check of `interop.rs` needs a CUDA GPU:
//! tests here are #[ignore = "needs a CUDA GPU"] elsewhere; run them with `--include-ignored` on
//! the GPU machine (`shared/tools/gpu-stage` finds this file by that marker).
//!
//! Invariants checked in this folder, for every policy where it matters:
//! - data written through every block reads back, across page boundaries of expandable segments
//!   and across streams once they are ordered;
//! - a block used on another stream is not handed out again before that stream's work ends;
//! - a request larger than the card, or a device byte limit, is `OutOfMemory`, and the allocator
//!   stays usable;
//! - a sleeping tag's memory is back on the device, and wakes with its bytes at its addresses;
//! - under a memory limit, re-paging keeps the live blocks' bytes at their addresses;
//! - a page mapped at a second address is the same memory, and a growth that takes the pages
//!   of its stream's give-back while the stream is busy keeps stream order's bytes;
//! - after each test every buffer is back in the pool, the invariants hold, and once the allocator
//!   drops the device's free memory is back to its baseline.
//!
//! Files: `device.rs`, `streams.rs`, `interop.rs`, `decode_ops.rs` (the decode step's kernels
//! against the CPU), `sleep.rs` (tags, sleep and wake), `repage.rs` (the capped last resort),
//! `moving.rs` (page moving), `share.rs` (an allocation shared with a second process, which the
//! test spawns). Captures run in their own binary (`gpu_capture`): a global-mode capture refuses
//! calls from every thread of the process.

mod decode_ops;
mod device;
mod interop;
mod moving;
mod repage;
mod share;
mod sleep;
mod streams;
