//! The thread-safe front, `CachingAllocator<Arc<SimDevice>>`: stream shards, thread caches,
//! statistics and snapshots seen through it, many threads at once (testing tier 5), and the
//! workspace-size parsers of the cuBLAS interop (pure, no GPU).
//!
//! Invariants checked in this folder:
//! - no two live blocks overlap and none is handed out twice, under any interleaving (a cookie
//!   per allocation reads back unchanged at free); every pointer is 512-aligned;
//! - a memory limit holds for all streams together;
//! - the statistics count what PyTorch counts (every allocation, thread-cache hits included;
//!   an out-of-memory once), and `recompute() == recorded()` on a snapshot, blocks in thread
//!   caches included, even while other threads run;
//! - at the end, after every free, nothing is counted as allocated, `empty_cache` returns every
//!   byte and dropping the allocator leaves nothing on the device;
//! - tags: a sleep gives back exactly the tag's pages and keeps its addresses, a wake restores
//!   the offloaded bytes there, a failed wake or sleep changes nothing, no byte is lost.
//!
//! Files: `thread_stress.rs`, `thread_caches.rs`, `stats.rs`, `snapshot.rs`, `workspace.rs`,
//! `graph_pool.rs` (private pools for CUDA graphs), `idle.rs` (idle streams give their cache
//! back), `graph_engine.rs` (the example engine's
//! graph protocol), `sleep.rs`, `sleep_faults.rs` and `sleep_model.rs` (tags, sleep and wake),
//! `oom_ladder_review.rs` (the last resort of every shard and tag pool, whichever pool ran out),
//! `sleep_review.rs` (another allocator's tagged allocations), `hunt_streams.rs` (streams,
//! captures, graph pools and thread caches together: a random model, and the bugs it found),
//! `peers.rs` (peer access granted to pages mapped before and after).

#[path = "../common/mod.rs"]
#[allow(dead_code)]
mod common;

mod graph_engine;
mod graph_pool;
mod hooks;
mod hooks_wake;
mod hunt_streams;
mod idle;
mod lend;
mod oom_ladder_review;
mod peers;
mod restore;
mod share;
mod sleep;
mod sleep_faults;
mod sleep_model;
mod sleep_review;
mod snapshot;
mod stats;
mod thread_caches;
mod thread_stress;
mod workspace;
