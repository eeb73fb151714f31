//! The core: the mechanism of `Pool` (arena, free index, segments and pages, split and merge,
//! map and unmap through the device, statistics, snapshot) on the simulated device, with fake
//! addresses where no device is needed, under PyTorch's rules (`torch`, `torch-expandable`) and
//! `default` where a mechanism differs (testing tier 1).
//!
//! Invariants checked in this folder (besides `Pool::check_invariants` and
//! `SimDevice::check_invariants` after every scenario step):
//! - blocks tile their segments, no two free neighbours stay apart, every block is 512-aligned
//!   and at least the rounded request;
//! - device outstanding bytes == the pool's reserved bytes, and mapped bytes == reserved bytes
//!   for expandable segments; everything goes back to the device when all is freed and the cache
//!   emptied;
//! - every statistic equals what the snapshot recomputes; `current` == allocated - freed; peaks
//!   reset to current;
//! - requests no device can hold, or no address space, are typed errors, never panics.
//!
//! Files: `sizes.rs` (size classes, rounding), `pool_split.rs` (split, merge, best fit, streams),
//! `pool_release.rs` (oversize blocks, out-of-memory ladder, garbage collection, `empty_cache`,
//! `record_stream`), `pool_expandable.rs` (pages mapped and unmapped, address-space ranges),
//! `pool_stats.rs` (statistics and fragmentation figures), `capture.rs` (no call a CUDA graph
//! capture forbids while the pool is told one is underway).

#[path = "../common/mod.rs"]
#[allow(dead_code)]
mod common;

mod capture;
mod pool_expandable;
mod pool_release;
mod pool_split;
mod pool_stats;
mod sizes;
