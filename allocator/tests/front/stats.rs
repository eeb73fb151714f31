//! `CachingAllocator`'s counters of events, as `torch.cuda.memory_stats()` means them, however
//! many stream shards and thread caches sit behind one allocator: an allocation that ran out of
//! memory counts once (`num_ooms`, `num_alloc_retries`) and one that succeeded after the front
//! released other shards' memory not at all; `empty_cache` is one wait for all streams; a block
//! in a thread cache is never an oversize allocation; resetting peaks changes no behaviour; the
//! excess breakdown (live, rounding, pending, releasable, pinned) adds up to the reserved bytes
//! over all shards.

use cudalloc::stats::StatType;
use cudalloc::{Allocation, CachingAllocator, Config, Policy, Pool, Stats};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn front(capacity: u64, cfg: Config) -> CachingAllocator<SimDevice> {
    CachingAllocator::new(SimDevice::new(SimConfig::with_capacity(capacity)), cfg)
}

fn events(s: &Stats) -> (u64, u64, u64) {
    (s.num_ooms, s.num_alloc_retries, s.num_sync_all_streams)
}

/// Stream 1 caches a 20 MiB segment; stream 2 (another shard) asks for 30 MiB of a 40 MiB
/// device. One PyTorch pool frees the cached segment in its ladder and succeeds: one retry,
/// one wait for all streams, no OOM. The front must count the same (it counted an OOM for a
/// request that succeeded, and 64 waits).
#[test]
fn an_allocation_that_succeeds_after_the_ladder_is_no_oom() {
    let cfg = Config::for_policy(Policy::Torch);
    let mut pool = Pool::new(
        SimDevice::new(SimConfig::with_capacity(40 * MIB)),
        cfg.clone(),
    );
    let x = pool.allocate(12 * MIB, StreamId(1)).unwrap();
    pool.free(x).unwrap();
    pool.allocate(30 * MIB, StreamId(2)).unwrap();
    let alloc = front(40 * MIB, cfg);
    let x = alloc.allocate(12 * MIB, StreamId(1)).unwrap();
    alloc.free(x).unwrap();
    alloc.allocate(30 * MIB, StreamId(2)).unwrap();
    assert_eq!(events(&alloc.stats()), events(pool.stats()));
    assert_eq!(events(pool.stats()), (0, 1, 1));
}

/// An allocation that fails even after every shard gave back its cache: one OOM, one retry,
/// one wait (the front counted 2, 2, 65).
#[test]
fn an_allocation_that_fails_is_one_oom() {
    for policy in Policy::ALL {
        let alloc = front(40 * MIB, Config::for_policy(policy));
        let x = alloc.allocate(12 * MIB, StreamId(1)).unwrap();
        alloc.free(x).unwrap();
        let e = alloc.allocate(50 * MIB, StreamId(2)).unwrap_err();
        assert!(e.is_out_of_memory(), "{policy:?}: {e}");
        assert_eq!(events(&alloc.stats()), (1, 1, 1), "{policy:?}");
    }
}

/// `empty_cache` waits for all streams once, as PyTorch's does (64 shards counted 64).
#[test]
fn empty_cache_is_one_wait_for_all_streams() {
    for policy in Policy::ALL {
        let alloc = front(1 << 30, Config::for_policy(policy));
        alloc.empty_cache().unwrap();
        alloc.empty_cache().unwrap();
        assert_eq!(alloc.stats().num_sync_all_streams, 2, "{policy:?}");
    }
}

/// With `max_split_size_mb` set, a freed oversize block does not wait in a thread cache: it
/// is no longer allocated, so it is no longer an oversize allocation (a cached one stayed
/// counted in `oversize_allocations` while `allocation` said 0).
#[test]
fn a_freed_oversize_block_is_no_oversize_allocation() {
    let alloc = front(4 << 30, Config::parse("max_split_size_mb:128").unwrap());
    let small = alloc.allocate(MIB, StreamId(0)).unwrap();
    alloc.free(small).unwrap();
    let big = alloc.allocate(200 * MIB, StreamId(0)).unwrap();
    assert_eq!(alloc.stats().oversize_allocations.current, 1);
    alloc.free(big).unwrap();
    let s = alloc.stats();
    assert_eq!(
        s.thread_cache.blocks, 1,
        "the 1 MiB block is cached, the 200 MiB one not"
    );
    assert_eq!(s.allocation.get(StatType::All).current, 0);
    assert_eq!(
        (s.oversize_allocations.current, s.oversize_allocations.freed),
        (0, 1)
    );
}

/// The second try after an out-of-memory ladder succeeds from blocks the ladder flushed out of
/// this thread's cache (two 512 KiB blocks merge into the 1 MiB asked for, on a 4 MiB device
/// where another thread has a cache too): still no OOM (the second try went through the
/// small-pool check, which found them before the OOM was taken back: 1 OOM was counted).
#[test]
fn a_second_try_served_by_flushed_cache_blocks_is_no_oom() {
    let alloc = std::sync::Arc::new(front(4 * MIB, Config::default()));
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let (ready, is_ready) = std::sync::mpsc::channel::<()>();
    let other = alloc.clone();
    let h = std::thread::spawn(move || {
        let x = other.allocate(512, StreamId(5)).unwrap();
        other.free(x).unwrap();
        ready.send(()).unwrap();
        wait.recv().unwrap();
    });
    is_ready.recv().unwrap();
    let s = StreamId(0);
    let a = alloc.allocate(512 << 10, s).unwrap();
    let b = alloc.allocate(512 << 10, s).unwrap();
    let _c = alloc.allocate(MIB, s).unwrap();
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    let r = alloc.allocate(MIB, s);
    let counts = events(&alloc.stats());
    go.send(()).unwrap();
    h.join().unwrap();
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(
        counts.0, 0,
        "an allocation that succeeded counted an OOM: {counts:?}"
    );
}

#[test]
fn excess_and_pinning_add_up_over_the_shards() {
    // Blocks on two streams (so in more than one shard's pools when there are several), some
    // freed: the breakdown adds up to the reserved bytes and the pinned units hold exactly the
    // pinned bytes, the most pinned first.
    let sim = SimDevice::new(SimConfig::with_capacity(4 * GIB));
    let alloc = CachingAllocator::new(sim, Config::for_policy(Policy::Default));
    let streams = [StreamId(0), StreamId(7)];
    let blocks: Vec<Allocation> = (0..40u64)
        .map(|i| {
            let size = (1 + i % 7) * 3 * MIB + 512 * i;
            alloc.allocate(size, streams[i as usize % 2]).unwrap()
        })
        .collect();
    let mut kept = Vec::new();
    for (i, a) in blocks.into_iter().enumerate() {
        if i % 3 == 0 {
            kept.push(a);
        } else {
            alloc.free(a).unwrap();
        }
    }
    let e = alloc.excess();
    assert_eq!(
        e.live + e.rounding + e.pending + e.releasable + e.pinned,
        e.reserved,
        "{e:?}"
    );
    assert_eq!(e.reserved, alloc.reserved_bytes());
    let units = alloc.pinning();
    assert!(e.pinned > 0, "{e:?}");
    assert_eq!(units.iter().map(|u| u.pinned).sum::<u64>(), e.pinned);
    assert!(units.windows(2).all(|w| w[0].pinned >= w[1].pinned));
    for a in kept {
        alloc.free(a).unwrap();
    }
    alloc.check_invariants().unwrap();
}
