//! Unit tests of `CachingAllocator` (the front): the thread caches' bypass for watched pools,
//! and buffers' allocations.

use super::*;
use crate::config::Policy;
use crate::policy::front::{CROWDED, CROWD_MAX, CROWD_STEP};
use cudalloc_sys::{SimConfig, SimDevice};
use std::time::Duration;

/// A `default` allocator of `capacity` bytes with two large blocks live on stream 1: an
/// episode with two allocations live, so the pool watches its large blocks.
fn watched_pair(capacity: u64) -> (CachingAllocator<SimDevice>, Allocation, Allocation) {
    let alloc = CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(capacity)),
        Config::for_policy(Policy::Default),
    );
    let s = StreamId(1);
    let a = alloc.allocate(64 << 20, s).unwrap();
    let b = alloc.allocate(32 << 20, s).unwrap();
    assert!(
        alloc.rules.bypasses_caches(shard_of(a.stream()), a.size()),
        "two live blocks of one episode"
    );
    (alloc, a, b)
}

/// A large block freed while its pool watches large blocks goes to the pool, but to the
/// freeing thread's cache while another thread holds the pool's lock: the free does not wait
/// for it.
#[test]
fn a_watched_pool_held_by_another_thread_leaves_the_block_in_the_cache() {
    let (alloc, a, b) = watched_pair(4 << 30);
    let s = a.stream();
    let pool_frees = || alloc.stats().pool_frees();
    let before = pool_frees();
    let held = alloc.shards[shard_of(s)].lock();
    let shared = &alloc;
    std::thread::scope(|t| {
        let (done, wait) = std::sync::mpsc::channel();
        t.spawn(move || {
            shared.free(a).unwrap();
            done.send(()).unwrap();
        });
        let freed = wait.recv_timeout(Duration::from_secs(10));
        drop(held);
        freed.expect("the free waited for the pool's lock");
    });
    assert_eq!(
        pool_frees(),
        before,
        "the free went to its pool while it was held"
    );
    alloc.free(b).unwrap();
    assert_eq!(
        pool_frees(),
        before + 1,
        "a free with the pool's lock free went to the cache"
    );
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
}

/// Before a watched pool places a large block, the blocks of its shard that another thread's
/// large part holds go back to it, whichever of the shard's streams they belong to: another
/// thread frees a block of stream `s2` into its cache while the pool records an episode of
/// `s1` (another stream of the same shard) with one allocation live, and the episode's second
/// allocation makes the pool watch. (A budget of 100% keeps the cached memory `s1` is served
/// from below.)
#[test]
fn a_watched_pool_gets_other_threads_large_blocks_of_its_shard_back() {
    let alloc = CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(8 << 30)),
        Config::parse("policy:default,fragmentation_budget:1").unwrap(),
    );
    let s1 = StreamId(1);
    let s2 = (2..)
        .map(StreamId)
        .find(|s| shard_of(*s) == shard_of(s1))
        .expect("a stream of the same shard");
    let i = shard_of(s1);
    // Cached memory for what `s1` asks for below, and the episode's first allocation.
    let big = alloc.allocate(512 << 20, s1).unwrap();
    alloc.free(big).unwrap();
    let first = alloc.allocate(64 << 20, s1).unwrap();
    let cached = || alloc.stats().thread_cache.blocks;
    std::thread::scope(|t| {
        let (cached_one, wait) = std::sync::mpsc::channel();
        let (done, finish) = std::sync::mpsc::channel::<()>();
        let shared = &alloc;
        t.spawn(move || {
            let x = shared.allocate(64 << 20, s2).unwrap();
            shared.free(x).unwrap();
            cached_one.send(()).unwrap();
            finish.recv().unwrap(); // the cache lives as long as its thread
        });
        wait.recv().unwrap();
        assert_eq!(cached(), 1, "the other thread's large part holds its block");
        let second = alloc.allocate(32 << 20, s1).unwrap();
        assert!(
            alloc.rules.bypasses_caches(i, 16 << 20),
            "two live: watched"
        );
        assert_eq!(
            cached(),
            1,
            "placed from cached memory: nothing went back yet"
        );
        let third = alloc.allocate(16 << 20, s1).unwrap();
        let left = cached();
        done.send(()).unwrap();
        assert_eq!(
            left, 0,
            "the block of s2 went back before the watched placement"
        );
        for x in [first, second, third] {
            alloc.free(x).unwrap();
        }
    });
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
}

/// A watched shard whose lock threads keep finding held lets its large blocks use the
/// thread caches; pool operations that find it free bring the watch back.
#[test]
fn a_crowded_shard_stops_bypassing_the_caches_until_it_calms_down() {
    let (alloc, a, b) = watched_pair(8 << 30);
    let s = a.stream();
    let i = shard_of(s);
    for _ in 0..CROWDED / CROWD_STEP {
        alloc.rules.note_lock(i, true);
    }
    assert!(!alloc.rules.bypasses_caches(i, a.size()), "crowded");
    let before = alloc.stats().pool_frees();
    alloc.free(a).unwrap();
    assert_eq!(alloc.stats().pool_frees(), before, "went to the pool");
    for _ in 0..CROWD_MAX {
        alloc.rules.note_lock(i, true);
    }
    assert_eq!(alloc.rules.crowding(i), CROWD_MAX);
    // Misses decay the score: each pool allocation finds the lock free.
    let mut live = Vec::new();
    while !alloc.rules.bypasses_caches(i, b.size()) {
        live.push(alloc.allocate(2 << 20, s).unwrap());
        assert!(live.len() <= CROWD_MAX, "the score never fell");
    }
    assert_eq!(live.len(), CROWD_MAX - CROWDED + 1);
    for x in live {
        alloc.free(x).unwrap();
    }
    alloc.free(b).unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
}

/// A `Buffer`'s allocation (marked as such when the buffer is made) is refused by the frees by
/// address and freed by the buffer's own way back; a thread-cache hit that hands the block out
/// again hands it out as an ordinary allocation.
#[test]
fn a_buffer_s_allocation_is_freed_only_by_the_buffer() {
    let alloc = CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(1 << 30)),
        Config::for_policy(Policy::Default),
    );
    let s = StreamId(1);
    let a = alloc.allocate(4096, s).unwrap();
    alloc.mark_buffer(a.ptr());
    let owned =
        |r: Result<(), AllocError>| matches!(r, Err(AllocError::OwnedByBuffer(p)) if p == a.ptr());
    assert!(owned(alloc.free_ptr(a.ptr())));
    assert!(owned(alloc.free_on(a.ptr(), s)));
    assert_eq!(alloc.stats().allocation.0[0].current, 1, "still live");
    assert!(matches!(
        alloc.free_buffer(a.ptr(), StreamId(2)),
        Err(AllocError::WrongStream { .. })
    ));
    alloc.free_buffer(a.ptr(), s).unwrap();
    assert!(matches!(
        alloc.free_ptr(a.ptr()),
        Err(AllocError::NotAllocated(_))
    ));
    // The same block again (a thread cache's hit under `default`): an ordinary allocation.
    let b = alloc.allocate(4096, s).unwrap();
    assert_eq!(b.ptr(), a.ptr());
    alloc.free_ptr(b.ptr()).unwrap();
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
}
