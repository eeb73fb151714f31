//! `CachingAllocator::snapshot()` against its `stats()` while thread caches hold blocks, on the
//! simulated device.
//!
//! Checked: a block its caller freed into a thread cache (the freeing thread's own, or one left
//! by a thread that exited) is `ThreadCached` in the snapshot, as the statistics leave it out of
//! the allocated counts, so `recompute() == recorded()`; it is not free in the fragmentation
//! figures (no other request can have it); a cache hit makes it `Allocated` again, and once the
//! caches are flushed no block is `ThreadCached`. Under PyTorch's rules (no thread caches) a
//! freed block is never `ThreadCached`. The reserved bytes' peak is the most that the shards
//! held together, not the sum of their peaks.

use cudalloc::snapshot::{BlockState, Snapshot};
use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(3);

fn front(policy: Policy) -> CachingAllocator<SimDevice> {
    let sim = SimDevice::new(SimConfig::with_capacity(4 << 30));
    CachingAllocator::new(sim, Config::for_policy(policy))
}

/// The state of the block at `ptr`.
fn state(snap: &Snapshot, ptr: u64) -> Option<BlockState> {
    let mut blocks = snap.segments.iter().flat_map(|s| &s.blocks);
    blocks.find(|b| b.addr == ptr).map(|b| b.state)
}

/// Bytes of the blocks in `state`.
fn bytes_in(snap: &Snapshot, state: BlockState) -> u64 {
    let blocks = snap.segments.iter().flat_map(|s| &s.blocks);
    blocks.filter(|b| b.state == state).map(|b| b.size).sum()
}

/// Addresses of the `ThreadCached` blocks.
fn thread_cached(snap: &Snapshot) -> Vec<u64> {
    let blocks = snap.segments.iter().flat_map(|s| &s.blocks);
    let cached = blocks.filter(|b| b.state == BlockState::ThreadCached);
    cached.map(|b| b.addr).collect()
}

/// The snapshot, checked against its own statistics and against `stats()`.
fn consistent_snapshot(alloc: &CachingAllocator<SimDevice>) -> Snapshot {
    let snap = alloc.snapshot();
    assert_eq!(
        snap.recompute(),
        snap.recorded(),
        "snapshot vs its statistics"
    );
    assert_eq!(
        thread_cached(&snap).len() as u64,
        alloc.stats().thread_cache.blocks,
        "ThreadCached blocks vs the statistics' cached blocks"
    );
    snap
}

/// `empty_cache` flushes the thread caches: no block is `ThreadCached` after it.
fn none_left_after_empty_cache(alloc: &CachingAllocator<SimDevice>) {
    alloc.empty_cache().unwrap();
    let snap = consistent_snapshot(alloc);
    assert_eq!(thread_cached(&snap), Vec::<u64>::new());
    alloc.check_invariants().unwrap();
}

#[test]
fn a_block_in_a_thread_cache_is_thread_cached_not_allocated() {
    let alloc = front(Policy::Default);
    let keep = alloc.allocate(3000, S).unwrap();
    let a = alloc.allocate(4096, S).unwrap();
    let b = alloc.allocate(64 * 1024, S).unwrap();
    let a_ptr = a.ptr();
    alloc.free(a).unwrap();
    assert_eq!(
        alloc.stats().thread_cache.blocks,
        1,
        "the free went to the cache"
    );

    let snap = consistent_snapshot(&alloc);
    assert_eq!(state(&snap, a_ptr), Some(BlockState::ThreadCached));
    assert_eq!(state(&snap, keep.ptr()), Some(BlockState::Allocated));
    assert_eq!(state(&snap, b.ptr()), Some(BlockState::Allocated));
    let allocated = alloc.stats().allocated_bytes.0[0].current as u64;
    assert_eq!(bytes_in(&snap, BlockState::Allocated), allocated);
    let free = bytes_in(&snap, BlockState::Free);
    assert_eq!(
        snap.fragmentation().free_bytes,
        free,
        "a cached block is not free"
    );

    let again = alloc.allocate(4096, S).unwrap();
    assert_eq!(again.ptr(), a_ptr, "a cache hit");
    let snap = consistent_snapshot(&alloc);
    assert_eq!(state(&snap, a_ptr), Some(BlockState::Allocated));

    for x in [again, b, keep] {
        alloc.free(x).unwrap();
    }
    assert!(!thread_cached(&consistent_snapshot(&alloc)).is_empty());
    none_left_after_empty_cache(&alloc);
}

#[test]
fn blocks_a_thread_left_in_its_cache_when_it_exited_are_thread_cached() {
    let alloc = front(Policy::Default);
    let small = alloc.allocate(8192, S).unwrap();
    let large = alloc.allocate(6 * MIB, S).unwrap();
    let small_ptr = small.ptr();
    std::thread::scope(|t| {
        t.spawn(|| {
            alloc.free(small).unwrap();
            alloc.free(large).unwrap();
        });
    });
    let snap = consistent_snapshot(&alloc);
    assert_eq!(state(&snap, small_ptr), Some(BlockState::ThreadCached));
    none_left_after_empty_cache(&alloc);
}

#[test]
fn without_thread_caches_a_freed_block_is_free() {
    let alloc = front(Policy::Torch);
    let keep = alloc.allocate(3000, S).unwrap();
    let a = alloc.allocate(4096, S).unwrap();
    let a_ptr = a.ptr();
    alloc.free(a).unwrap();
    let snap = consistent_snapshot(&alloc);
    assert_eq!(state(&snap, a_ptr), Some(BlockState::Free));
    assert_eq!(state(&snap, keep.ptr()), Some(BlockState::Allocated));
    assert_eq!(BlockState::ThreadCached.name(), "thread_cached");
    alloc.free(keep).unwrap();
}

/// Two streams (of different shards) each hold 100 MiB in turn, the cache emptied between:
/// `reserved_bytes.all.peak` is the most held at once (100 MiB, 102 under `default`), not the
/// sum of the shards' peaks (200 MiB, which the allocated bytes' peak still is: an upper bound); a reset makes it
/// the reserved bytes, and the snapshot's statistics agree.
#[test]
fn the_reserved_peak_is_exact_across_streams() {
    for policy in [Policy::Torch, Policy::TorchExpandable, Policy::Default] {
        let alloc = front(policy);
        for stream in [StreamId(1), StreamId(2)] {
            let a = alloc.allocate(100 * MIB, stream).unwrap();
            alloc.free(a).unwrap();
            alloc.empty_cache().unwrap();
        }
        let s = alloc.stats();
        let reserved = s.reserved_bytes.0[0];
        // Under `default` each shard's pool had freed nothing when it grew, so it mapped one
        // 2 MiB page ahead (`policy::default::budget`).
        let held = match policy {
            Policy::Default => 102 * MIB,
            _ => 100 * MIB,
        };
        assert_eq!(
            (reserved.current, reserved.peak),
            (0, held as i64),
            "{policy:?}"
        );
        assert_eq!(
            s.allocated_bytes.0[0].peak,
            200 * MIB as i64,
            "{policy:?}: shards summed"
        );
        assert_eq!(alloc.snapshot().stats.reserved_bytes, s.reserved_bytes);

        let keep = alloc.allocate(10 * MIB, StreamId(1)).unwrap();
        alloc.reset_peak_stats();
        let held = alloc.stats().reserved_bytes.0[0];
        assert!(held.current >= 10 * MIB as i64, "{policy:?}");
        assert_eq!(
            held.peak, held.current,
            "{policy:?}: reset to the reserved bytes"
        );
        alloc.free(keep).unwrap();
    }
}

/// A request the device refuses (here: every call fails) leaves the reserved peak where it was:
/// only memory the device granted counts, on one stream as on several.
#[test]
fn a_refused_request_does_not_raise_the_reserved_peak() {
    for policy in [Policy::Torch, Policy::TorchExpandable, Policy::Default] {
        let sim = std::sync::Arc::new(SimDevice::new(SimConfig::with_capacity(8 << 30)));
        let alloc = CachingAllocator::new(sim.clone(), Config::for_policy(policy));
        let held = alloc.allocate(100 * MIB, StreamId(0)).unwrap();
        let before = alloc.stats().reserved_bytes;
        sim.fail_every(1);
        assert!(alloc.allocate(2 << 30, StreamId(0)).is_err(), "{policy:?}");
        sim.fail_every(0);
        let after = alloc.stats().reserved_bytes;
        assert_eq!(after.0[0].peak, before.0[0].peak, "{policy:?}");
        assert!(after.0[0].peak >= after.0[0].current, "{policy:?}");
        for pool in 1..3 {
            assert!(
                after.0[pool].peak <= after.0[0].peak,
                "{policy:?}: a pool above all"
            );
        }
        alloc.free(held).unwrap();
    }
}
