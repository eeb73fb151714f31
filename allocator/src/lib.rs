//! # cudalloc: a caching GPU memory allocator
//!
//! cudalloc keeps the device memory a program frees and hands it out again without calling the
//! driver, the way PyTorch's `CUDACachingAllocator` does, and records the allocations a program
//! makes as a trace that `cudalloc-trace` replays against any policy on a simulated device.
//!
//! ## The hierarchy, from the driver up
//!
//! | level | what | size |
//! | --- | --- | --- |
//! | device | the driver boundary ([`cudalloc_sys::Device`]): CUDA, or simulated | the card (an H200: 143,771 MiB, which the simulated device has too) |
//! | segment | one `malloc` result, or one reserved virtual range (*expandable*) | 2 MiB (small pool), 20 MiB or the rounded request (large pool); expandable: 1.125 x the card's memory of address space (`torch-expandable`, as PyTorch), an eighth of it (large pool) or a 64th (small pool) for `default`, another range when one fills |
//! | page | a physical allocation mapped into an expandable segment | `torch-expandable`: 2 MiB small / 20 MiB large; `default`: the device granularity (2 MiB), mapped in batches |
//! | block | a sub-range of a segment, allocated, free or unmapped, on one stream | a multiple of 512 B |
//! | pool | the free blocks of one size class, by (stream, size, address) | small: requests up to 1 MiB; large: the rest |
//!
//! Requests are rounded ([`sizes::round_size`]), placed in a cached block (best fit, under the
//! built-in policies), split when the rest is worth keeping, and merged with free neighbours
//! when freed. The [`policy::Core`] owns that mechanism; a [`policy::Policy`] holds the rules
//! (where to place, whether to split, how to grow, what to release) and its own state; the
//! built-in ones are named by [`Policy`] in a [`Config`]. When the device is full, the
//! out-of-memory ladder releases cached memory and retries before returning
//! [`AllocError::OutOfMemory`].
//!
//! ## Entry points
//!
//! - [`CachingAllocator`]: the thread-safe allocator.
//! - [`Pool`]: the single-threaded pool underneath (what the replayer drives): a [`policy::Core`]
//!   and a [`policy::Policy`].
//! - [`share`]: an allocation shared with another process (`shareable_segments`), and
//!   [`hooks`]: callbacks when memory is mapped and before it is unmapped (NCCL registration);
//!   `docs/multi-gpu.md`.
//! - [`record`]: writing a trace of the calls an allocator serves. Reading traces, replaying
//!   them and the `cudalloc` command are the crates `cudalloc-trace` and `cudalloc-cli`.
//!
//! An allocation is an [`Allocation`], an opaque handle that `free` consumes. A [`Config`] is a
//! rule set with its own settings ([`config::PolicyConfig`]), the settings every policy shares
//! ([`PoolConfig`]) and the thread caches' ([`FrontConfig`]), valid however it was built.
//! Errors are typed: [`AllocError`], [`ConfigError`] (naming the key), [`InvariantError`]
//! (naming the [`Invariant`]). The `testing` feature adds what this workspace's tests read
//! beyond the public API; users leave it off.

mod allocator;
pub mod config;
mod error;
pub mod fmt;
mod front_stats;
mod graph_pool;
pub mod hooks;
mod idle;
pub mod interop;
mod ladder;
mod lend;
mod live;
pub mod policy;
mod pool;
pub mod record;
mod restore;
mod retry;
mod settings;
pub mod share;
pub mod sizes;
pub mod snapshot;
pub mod stats;
// The locks and atomics, public only to the loom model (tests/loom.rs).
#[cfg(loom)]
pub mod sync;
#[cfg(not(loom))]
mod sync;
mod tags;
mod tcache;
pub mod workspace;

pub use allocator::CachingAllocator;
pub use config::{Config, ConfigError, FrontConfig, Policy, PoolConfig};
pub use error::{AllocError, Invariant, InvariantError};
pub use hooks::MapHooks;
pub use ladder::{FreeError, Pool};
pub use pool::Allocation;
pub use share::{SharedAllocation, SharedMapping, SharedPage};
pub use snapshot::{Excess, Fragmentation, PinnedUnit, Snapshot};
pub use stats::Stats;
pub use tags::TagStats;

/// The Rust examples of `README.md`, compiled by `cargo test` (as doctests) so that they stay
/// true to the API.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeExamples;

/// The Rust examples of `docs/integration.md`, compiled the same way.
#[cfg(doctest)]
#[doc = include_str!("../../docs/integration.md")]
pub struct IntegrationExamples;

/// The Rust example of `docs/sleep.md`, compiled the same way.
#[cfg(doctest)]
#[doc = include_str!("../../docs/sleep.md")]
pub struct SleepExamples;

/// The Rust example of `docs/multi-gpu.md`, compiled and run the same way.
#[cfg(doctest)]
#[doc = include_str!("../../docs/multi-gpu.md")]
pub struct MultiGpuExamples;
