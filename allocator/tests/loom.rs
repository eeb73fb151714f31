//! Model checks (loom) of the concurrent pieces of `CachingAllocator`: stream shards sharing one
//! reserved counter under a memory limit, the live table deciding which of two racing frees of
//! one pointer wins, thread caches handing a block to exactly one owner, and the token protocol
//! between a thread taking a cached block back and a flush (`empty_cache`) taking it to its pool:
//! the block goes exactly one way, the statistics subtract exactly what stays cached, and the
//! cache of a thread that exits during a flush is neither lost nor returned twice.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p cudalloc --test loom --release`; in a normal
//! build this file is empty.
#![cfg(loom)]

use cudalloc::{AllocError, Allocation, CachingAllocator, Config, Policy};
use cudalloc_sys::{SimDevice, StreamId};
use loom::sync::Arc;
use loom::thread;

const MIB: u64 = 1 << 20;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    // Every shard lock is a branch: `stats` and `empty_cache` take 128 each.
    b.max_branches = 20_000;
    b.check(f);
}

#[test]
fn shards_never_pass_a_shared_limit_together() {
    model(|| {
        let a = Arc::new(CachingAllocator::new(
            SimDevice::default(),
            Config::for_policy(Policy::Torch),
        ));
        // One 20 MiB segment fits under the limit, two do not.
        a.set_memory_limit(Some(30 * MIB));
        let threads: Vec<_> = [StreamId(0x10), StreamId(0x20_0000)]
            .into_iter()
            .map(|s| {
                let a = a.clone();
                thread::spawn(move || a.allocate(5 * MIB, s))
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(
            a.reserved_bytes() <= 30 * MIB,
            "{} bytes held",
            a.reserved_bytes()
        );
        let ok = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(ok, 1, "{results:?}");
        assert!(results
            .iter()
            .any(|r| matches!(r, Err(AllocError::OutOfMemory { .. }))));
        a.check_invariants().unwrap();
    });
}

/// Frees `x` on two threads at once (a second handle to it, which only the `testing` feature
/// makes: safe code cannot free one handle twice); exactly one must succeed and the other be
/// told the pointer is not allocated, and the allocator's tables must agree afterwards.
fn free_twice_at_once(a: &Arc<CachingAllocator<SimDevice>>, x: Allocation) {
    let threads: Vec<_> = [x.duplicate(), x]
        .into_iter()
        .map(|x| {
            let a = a.clone();
            thread::spawn(move || a.free(x))
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
    assert!(results
        .iter()
        .any(|r| matches!(r, Err(AllocError::NotAllocated(_)))));
    a.check_invariants().unwrap();
}

#[test]
fn racing_double_free_has_one_winner() {
    for policy in [Policy::Torch, Policy::Default] {
        model(move || {
            let a = Arc::new(CachingAllocator::new(
                SimDevice::default(),
                Config::for_policy(policy),
            ));
            let x = a.allocate(4096, StreamId(0)).unwrap();
            free_twice_at_once(&a, x);
        });
    }
}

/// The same race on a large block while its pool watches large blocks (two of its episode
/// live): one thread may free it to the pool (the pool's lock was free) while the other finds
/// the lock held and frees it to its thread cache. One must lose, and the live table's cached
/// totals and count of large cached blocks must stay right (`check_invariants`).
#[test]
fn racing_double_free_of_a_watched_large_block_has_one_winner() {
    model(|| {
        let a = default_allocator();
        let x = a.allocate(64 << 20, StreamId(0)).unwrap();
        let _y = a.allocate(32 << 20, StreamId(0)).unwrap();
        free_twice_at_once(&a, x);
    });
}

#[test]
fn a_cached_block_has_one_owner() {
    model(|| {
        let a = default_allocator();
        let a2 = a.clone();
        // Thread 1 frees into its cache and allocates the same size again (a cache hit); thread
        // 2 allocates the same size at the same time: the two live blocks must differ.
        let t1 = thread::spawn(move || {
            let x = a2.allocate(8192, StreamId(0)).unwrap();
            a2.free(x).unwrap();
            a2.allocate(8192, StreamId(0)).unwrap()
        });
        let y = a.allocate(8192, StreamId(0)).unwrap();
        let x = t1.join().unwrap();
        assert_ne!(x.ptr(), y.ptr());
        a.free(y).unwrap();
        a.empty_cache().unwrap();
        a.check_invariants().unwrap();
    });
}

#[test]
/// The models only mean something if loom explores interleavings through `sync`'s atomics:
/// a lost update on one of them must be found.
fn sanity_loom_finds_a_lost_update() {
    let r = std::panic::catch_unwind(|| {
        model(|| {
            let c = Arc::new(cudalloc::sync::AtomicU64::new(0));
            let ts: Vec<_> = (0..2)
                .map(|_| {
                    let c = c.clone();
                    thread::spawn(move || {
                        let v = c.load(cudalloc::sync::Ordering::SeqCst);
                        c.store(v + 1, cudalloc::sync::Ordering::SeqCst);
                    })
                })
                .collect();
            for t in ts {
                t.join().unwrap();
            }
            assert_eq!(c.load(cudalloc::sync::Ordering::SeqCst), 2);
        })
    });
    assert!(r.is_err(), "loom did not explore the interleaving");
}

/// The claim protocol alone: two pools sharing one reserved counter under one limit, each
/// growing by one segment at the same time; at most one may pass.
#[test]
fn two_pools_claim_against_one_limit() {
    model(|| {
        let shared = std::sync::Arc::new(cudalloc::sync::AtomicU64::new(0));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let shared = shared.clone();
                thread::spawn(move || {
                    let mut pool = cudalloc::Pool::new(
                        SimDevice::default(),
                        Config::for_policy(Policy::Torch),
                    );
                    pool.share_reserved(shared);
                    pool.set_limit(Some(30 * MIB));
                    let ok = pool.allocate(5 * MIB, StreamId(0)).is_ok();
                    (ok, pool)
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let held = shared.load(cudalloc::sync::Ordering::SeqCst);
        assert!(held <= 30 * MIB, "{held} bytes held under a 30 MiB limit");
        assert_eq!(results.iter().filter(|r| r.0).count(), 1);
    });
}

/// A thread frees a block into its cache and asks for the same size again (a cache hit unless
/// the flush took the block first) while another thread empties the cache: the block has one
/// owner, and the counts agree before and after everything is returned. Small and large part.
#[test]
fn a_cache_hit_racing_a_flush_takes_the_block_once() {
    for size in [8192, 64 * MIB] {
        model(move || {
            let a = default_allocator();
            let a2 = a.clone();
            let t1 = thread::spawn(move || {
                let x = a2.allocate(size, StreamId(0)).unwrap();
                a2.free(x).unwrap();
                a2.allocate(size, StreamId(0)).unwrap()
            });
            a.empty_cache().unwrap();
            let y = t1.join().unwrap();
            a.check_invariants().unwrap();
            assert_eq!(live_allocations(&a), 1);
            a.free(y).unwrap();
            a.empty_cache().unwrap();
            assert_all_returned(&a);
        });
    }
}

/// A thread frees a block into its cache and exits while another thread empties the cache
/// (the race behind a lost cache: a flush that forgot a cache refilled after it was drained,
/// whose thread then exited). Afterwards nothing is counted as allocated, and an allocation
/// that misses takes the orphaned block back: after `empty_cache` nothing is held.
#[test]
fn a_flush_racing_a_thread_exit_loses_no_block() {
    model(|| {
        let a = default_allocator();
        let a2 = a.clone();
        let t1 = thread::spawn(move || {
            let x = a2.allocate(8192, StreamId(0)).unwrap();
            a2.free(x).unwrap();
        });
        a.empty_cache().unwrap();
        t1.join().unwrap();
        assert_eq!(live_allocations(&a), 0);
        let y = a.allocate(4096, StreamId(1)).unwrap();
        a.free(y).unwrap();
        a.empty_cache().unwrap();
        assert_all_returned(&a);
    });
}

/// A `default`-policy allocator (thread caches on) on a fresh simulated device.
fn default_allocator() -> Arc<CachingAllocator<SimDevice>> {
    Arc::new(CachingAllocator::new(
        SimDevice::default(),
        Config::for_policy(Policy::Default),
    ))
}

fn live_allocations(a: &CachingAllocator<SimDevice>) -> i64 {
    a.stats()
        .allocation
        .get(cudalloc::stats::StatType::All)
        .current
}

/// After every free and a flush: no allocation counted, no byte held.
fn assert_all_returned(a: &CachingAllocator<SimDevice>) {
    a.check_invariants().unwrap();
    assert_eq!(live_allocations(a), 0);
    assert_eq!(a.reserved_bytes(), 0, "bytes still held after empty_cache");
}
