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
