//! PyTorch's pool rules on the simulated device (testing tier 1), through `Pool<Arc<SimDevice>>`.
//!
//! Invariants checked (besides `Pool::check_invariants`, `SimDevice::check_invariants` and
//! "device outstanding bytes == reserved bytes" after every scenario step):
//! - split: a small request gets a 2 MiB segment and is split; a 1..10 MiB request gets a
//!   20 MiB segment and is split when more than 1 MiB remains; from 10 MiB a request gets a
//!   segment of its size rounded to 2 MiB;
//! - merge: freeing neighbours merges them into one free block;
//! - best fit: the smallest fitting block wins, ties go to the lower address; streams never share
//!   free blocks;
//! - oversize (`max_split_size_mb`): oversize blocks are never split, a request below the limit
//!   never takes an oversize block, a request above it takes one only when it is less than
//!   `max_non_split_rounding` bigger;
//! - the out-of-memory ladder: oversize cached blocks, then every cached block, are released and
//!   the allocation retried (`num_alloc_retries`), then `AllocError::OutOfMemory` with its fields
//!   filled (`num_ooms`); `garbage_collection_threshold` frees the oldest cached segments;
//! - `empty_cache` returns exactly the unsplit cached segments to the device;
//! - statistics: every key of `torch.cuda.memory_stats()` is present; peaks reset;
//! - `record_stream`: a block used on another stream comes back only after that stream's work has
//!   completed and a later allocation processed the event;
//! - `Snapshot::fragmentation` figures on hand-made and real snapshots;
//! - expandable policies (`torch-expandable`, `default`): growth maps pages, a freed block at the
//!   end merges, `empty_cache` unmaps whole pages, `reserved_bytes` equals the device's mapped
//!   bytes, and everything goes back to the device when all is freed;
//! - a request no device can hold is an error, never a panic.

use cudalloc::sizes::PoolKind;
use cudalloc::snapshot::{BlockInfo, BlockState, SegmentInfo};
use cudalloc::{AllocError, Allocation, Config, Policy, Pool, Snapshot, Stats};
use cudalloc_sys::{Call, SimConfig, SimDevice, StreamId};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);

type Sim = Arc<SimDevice>;

fn pool_with(cfg: Config, capacity: u64) -> (Sim, Pool<Sim>) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(capacity)));
    let pool = Pool::new(sim.clone(), cfg);
    (sim, pool)
}

fn torch() -> (Sim, Pool<Sim>) {
    pool_with(Config::for_policy(Policy::Torch), 4 * GIB)
}

fn torch_with(s: &str) -> (Sim, Pool<Sim>) {
    let cfg = Config::parse_onto(Config::for_policy(Policy::Torch), s).unwrap();
    pool_with(cfg, 4 * GIB)
}

/// Every invariant the pool and the device promise, plus "device bytes == reserved bytes".
fn check(sim: &SimDevice, pool: &Pool<Sim>) {
    pool.check_invariants().unwrap();
    sim.check_invariants();
    assert_eq!(
        sim.outstanding_bytes(),
        pool.reserved(),
        "device vs reserved"
    );
}

fn alloc(pool: &mut Pool<Sim>, size: u64, stream: StreamId) -> Allocation {
    let a = pool
        .allocate(size, stream)
        .unwrap_or_else(|e| panic!("allocate({size}) failed: {e}"));
    assert_eq!(a.ptr % 512, 0);
    a
}

fn free(pool: &mut Pool<Sim>, a: &Allocation) {
    pool.free(a).unwrap();
}

/// The segments as (size, [(block size, state)]).
fn layout(pool: &Pool<Sim>) -> Vec<(u64, Vec<(u64, BlockState)>)> {
    pool.snapshot()
        .segments
        .iter()
        .map(|s| (s.size, s.blocks.iter().map(|b| (b.size, b.state)).collect()))
        .collect()
}

fn block_size(pool: &Pool<Sim>, a: &Allocation) -> u64 {
    pool.block(a.block).expect("live block").size
}

use BlockState::{Allocated as A, Free as F};

// ---- split --------------------------------------------------------------------------------------

#[test]
fn small_request_gets_a_2mib_segment_and_is_split() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 1000, S0);
    check(&sim, &pool);
    assert_eq!(
        layout(&pool),
        vec![(2 * MIB, vec![(1024, A), (2 * MIB - 1024, F)])]
    );
    assert_eq!(sim.calls(Call::Malloc), 1);
    assert_eq!(sim.malloc_bytes(), 2 * MIB);
    assert_eq!(block_size(&pool, &a), 1024);
    let s = pool.stats();
    let small = PoolKind::Small;
    assert_eq!(s.segment.current(small), 1);
    assert_eq!(s.reserved_bytes.current(small), 2 * MIB as i64);
    assert_eq!(s.allocation.current(small), 1);
    assert_eq!(s.allocated_bytes.current(small), 1024);
    assert_eq!(s.requested_bytes.current(small), 1000);
    assert_eq!(s.active_bytes.current(small), 1024);
    assert_eq!(s.inactive_split.current(small), 1);
    assert_eq!(
        s.inactive_split_bytes.current(small),
        (2 * MIB - 1024) as i64
    );
    assert_eq!(s.reserved_bytes.current(PoolKind::Large), 0);
    assert_eq!(s.num_device_alloc, 1);

    // The next small request carves the same segment, right after the first block.
    let b = alloc(&mut pool, 512, S0);
    assert_eq!(b.ptr, a.ptr + 1024);
    assert_eq!(sim.calls(Call::Malloc), 1);
    check(&sim, &pool);
}

#[test]
fn zero_byte_request_gets_a_512_byte_block() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 0, S0);
    assert_eq!(a.size, 0);
    assert_eq!(block_size(&pool, &a), 512);
    assert_eq!(pool.stats().requested_bytes.current(PoolKind::Small), 0);
    check(&sim, &pool);
    free(&mut pool, &a);
    check(&sim, &pool);
}

#[test]
fn one_mib_request_is_small_and_one_mib_plus_one_is_large() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, MIB, S0);
    let b = alloc(&mut pool, MIB + 1, S0);
    check(&sim, &pool);
    let snap = pool.snapshot();
    let pool_of = |p: u64| {
        snap.segments
            .iter()
            .find(|s| s.addr <= p && p < s.addr + s.size)
            .map(|s| (s.pool, s.size))
            .unwrap()
    };
    assert_eq!(pool_of(a.ptr), (PoolKind::Small, 2 * MIB));
    assert_eq!(pool_of(b.ptr), (PoolKind::Large, 20 * MIB));
    assert_eq!(block_size(&pool, &b), MIB + 512);
}

#[test]
fn large_5mib_request_splits_a_20mib_segment() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 5 * MIB, S0);
    check(&sim, &pool);
    assert_eq!(
        layout(&pool),
        vec![(20 * MIB, vec![(5 * MIB, A), (15 * MIB, F)])]
    );
    assert_eq!(sim.malloc_bytes(), 20 * MIB);
    let s = pool.stats();
    assert_eq!(s.inactive_split.current(PoolKind::Large), 1);
    assert_eq!(
        s.inactive_split_bytes.current(PoolKind::Large),
        15 * MIB as i64
    );
    // Three more 5 MiB requests fill the same segment; the last one takes the rest unsplit.
    let more: Vec<_> = (0..3).map(|_| alloc(&mut pool, 5 * MIB, S0)).collect();
    assert_eq!(more[0].ptr, a.ptr + 5 * MIB);
    assert_eq!(more[2].ptr, a.ptr + 15 * MIB);
    assert_eq!(sim.calls(Call::Malloc), 1);
    assert_eq!(pool.stats().inactive_split.current(PoolKind::Large), 0);
    check(&sim, &pool);
}

#[test]
fn large_request_leaving_at_most_1mib_is_not_split() {
    for (size, block) in [(19 * MIB, 20 * MIB), (19 * MIB + 512 * KIB, 20 * MIB)] {
        let (sim, mut pool) = torch();
        let a = alloc(&mut pool, size, S0);
        check(&sim, &pool);
        assert_eq!(
            layout(&pool),
            vec![(block, vec![(block, A)])],
            "size {size}"
        );
        assert_eq!(
            pool.stats().allocated_bytes.current(PoolKind::Large),
            block as i64
        );
        assert_eq!(
            pool.stats().requested_bytes.current(PoolKind::Large),
            size as i64
        );
        free(&mut pool, &a);
        check(&sim, &pool);
    }
    // 9 MiB in a 20 MiB segment leaves 11 MiB: split.
    let (sim, mut pool) = torch();
    alloc(&mut pool, 9 * MIB, S0);
    assert_eq!(
        layout(&pool),
        vec![(20 * MIB, vec![(9 * MIB, A), (11 * MIB, F)])]
    );
    check(&sim, &pool);
}

#[test]
fn twelve_mib_request_gets_a_12mib_segment() {
    let (sim, mut pool) = torch();
    alloc(&mut pool, 12 * MIB, S0);
    check(&sim, &pool);
    assert_eq!(layout(&pool), vec![(12 * MIB, vec![(12 * MIB, A)])]);
    assert_eq!(sim.malloc_bytes(), 12 * MIB);
    // 12.5 MiB rounds its segment up to 14 MiB; the 1.5 MiB rest is more than 1 MiB: split.
    alloc(&mut pool, 12 * MIB + 512 * KIB, S0);
    check(&sim, &pool);
    let l = layout(&pool);
    assert_eq!(l.len(), 2);
    assert!(l.contains(&(14 * MIB, vec![(12 * MIB + 512 * KIB, A), (1536 * KIB, F)])));
    assert_eq!(sim.malloc_bytes(), 26 * MIB);
}

// ---- merge --------------------------------------------------------------------------------------

#[test]
fn freeing_neighbours_merges_them() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 1000, S0);
    let b = alloc(&mut pool, 1000, S0);
    let c = alloc(&mut pool, 1000, S0);
    let rest = 2 * MIB - 3 * 1024;
    assert_eq!(
        layout(&pool),
        vec![(2 * MIB, vec![(1024, A), (1024, A), (1024, A), (rest, F)])]
    );
    free(&mut pool, &a);
    check(&sim, &pool);
    assert_eq!(
        layout(&pool),
        vec![(2 * MIB, vec![(1024, F), (1024, A), (1024, A), (rest, F)])]
    );
    assert_eq!(pool.stats().inactive_split.current(PoolKind::Small), 2);
    free(&mut pool, &c);
    check(&sim, &pool);
    assert_eq!(
        layout(&pool),
        vec![(2 * MIB, vec![(1024, F), (1024, A), (rest + 1024, F)])]
    );
    free(&mut pool, &b);
    check(&sim, &pool);
    assert_eq!(layout(&pool), vec![(2 * MIB, vec![(2 * MIB, F)])]);
    let s = pool.stats();
    assert_eq!(s.inactive_split.current(PoolKind::Small), 0);
    assert_eq!(s.inactive_split_bytes.current(PoolKind::Small), 0);
    assert_eq!(s.active.current(PoolKind::Small), 0);
    // The merged segment is unsplit again, so empty_cache gives it back.
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(sim.outstanding_bytes(), 0);
}

#[test]
fn freeing_large_neighbours_in_any_order_merges_them() {
    let (sim, mut pool) = torch();
    let blocks: Vec<_> = (0..3).map(|_| alloc(&mut pool, 5 * MIB, S0)).collect();
    for i in [1, 0, 2] {
        free(&mut pool, &blocks[i]);
        check(&sim, &pool);
    }
    assert_eq!(layout(&pool), vec![(20 * MIB, vec![(20 * MIB, F)])]);
}

// ---- best fit -----------------------------------------------------------------------------------

#[test]
fn best_fit_takes_the_smallest_block_then_the_lowest_address() {
    let (sim, mut pool) = torch();
    let x1 = alloc(&mut pool, 4096, S0);
    let _s1 = alloc(&mut pool, 512, S0);
    let x2 = alloc(&mut pool, 2048, S0);
    let _s2 = alloc(&mut pool, 512, S0);
    let x3 = alloc(&mut pool, 4096, S0);
    let s3 = alloc(&mut pool, 512, S0);
    let base = x1.ptr;
    assert_eq!(
        (x2.ptr, x3.ptr, s3.ptr),
        (base + 4608, base + 7168, base + 11264)
    );
    for x in [&x1, &x2, &x3] {
        free(&mut pool, x);
    }
    check(&sim, &pool);
    // Free: 4096 @0, 2048 @4608, 4096 @7168, and the big rest @11776.
    let a = alloc(&mut pool, 1536, S0);
    assert_eq!(a.ptr, base + 4608, "smallest fitting block (2048)");
    // The 2048 block was split: 512 bytes stay free at 6144.
    let b = alloc(&mut pool, 4096, S0);
    assert_eq!(b.ptr, base, "tie between two 4096 blocks: lower address");
    let c = alloc(&mut pool, 4000, S0);
    assert_eq!(c.ptr, base + 7168);
    let d = alloc(&mut pool, 100, S0);
    assert_eq!(d.ptr, base + 6144, "the 512 B leftover of the split");
    let e = alloc(&mut pool, 100, S0);
    assert_eq!(e.ptr, base + 11776, "only the big rest is left");
    assert_eq!(sim.calls(Call::Malloc), 1);
    check(&sim, &pool);
}

#[test]
fn best_fit_in_the_large_pool() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 12 * MIB, S0);
    let b = alloc(&mut pool, 14 * MIB, S0);
    let c = alloc(&mut pool, 16 * MIB, S0);
    for x in [&c, &a, &b] {
        free(&mut pool, x);
    }
    let x = alloc(&mut pool, 13 * MIB, S0);
    assert_eq!(x.ptr, b.ptr);
    assert_eq!(
        block_size(&pool, &x),
        14 * MIB,
        "1 MiB rest is not split off"
    );
    let y = alloc(&mut pool, 11 * MIB, S0);
    assert_eq!(y.ptr, a.ptr);
    let z = alloc(&mut pool, 2 * MIB, S0);
    assert_eq!(z.ptr, c.ptr, "only the 16 MiB block is left; it is split");
    assert_eq!(block_size(&pool, &z), 2 * MIB);
    assert_eq!(sim.calls(Call::Malloc), 3);
    check(&sim, &pool);
}

// ---- streams ------------------------------------------------------------------------------------

#[test]
fn a_block_freed_on_one_stream_is_not_reused_by_another() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 1000, S1);
    free(&mut pool, &a);
    let b = alloc(&mut pool, 1000, S2);
    assert_ne!(b.ptr, a.ptr);
    assert_eq!(sim.calls(Call::Malloc), 2, "stream 2 needs its own segment");
    let c = alloc(&mut pool, 1000, S1);
    assert_eq!(c.ptr, a.ptr, "stream 1 gets its block back");
    let x = alloc(&mut pool, 12 * MIB, S1);
    free(&mut pool, &x);
    let y = alloc(&mut pool, 12 * MIB, S2);
    assert_ne!(y.ptr, x.ptr);
    assert_eq!(sim.calls(Call::Malloc), 4);
    let streams: BTreeSet<u64> = pool
        .snapshot()
        .segments
        .iter()
        .map(|s| s.stream.0)
        .collect();
    assert_eq!(streams, BTreeSet::from([1, 2]));
    check(&sim, &pool);
}

// ---- oversize rules -----------------------------------------------------------------------------

#[test]
fn oversize_blocks_are_not_split() {
    let (sim, mut pool) = torch_with("max_split_size_mb:20");
    assert_eq!(pool.stats().max_split_size, 20 * MIB);
    let a = alloc(&mut pool, 40 * MIB, S0);
    assert_eq!(pool.stats().oversize_segments.current, 1);
    free(&mut pool, &a);
    // 30 MiB is oversize too, and the cached 40 MiB block is less than 20 MiB bigger: taken whole.
    let b = alloc(&mut pool, 30 * MIB, S0);
    assert_eq!(b.ptr, a.ptr);
    assert_eq!(layout(&pool), vec![(40 * MIB, vec![(40 * MIB, A)])]);
    let s = pool.stats();
    assert_eq!(s.allocated_bytes.current(PoolKind::Large), 40 * MIB as i64);
    assert_eq!(s.requested_bytes.current(PoolKind::Large), 30 * MIB as i64);
    assert_eq!(s.oversize_allocations.current, 1);
    assert_eq!(sim.calls(Call::Malloc), 1);
    check(&sim, &pool);
    free(&mut pool, &b);
    assert_eq!(pool.stats().oversize_allocations.current, 0);
    assert_eq!(pool.stats().oversize_allocations.peak, 1);
    check(&sim, &pool);
}

#[test]
fn an_oversize_request_takes_a_block_only_within_max_non_split_rounding() {
    let (sim, mut pool) = torch_with("max_split_size_mb:20");
    let a = alloc(&mut pool, 40 * MIB, S0);
    free(&mut pool, &a);
    // 40 MiB >= 20 MiB + 20 MiB: too big for a 20 MiB request, which gets its own segment.
    let b = alloc(&mut pool, 20 * MIB, S0);
    assert_ne!(b.ptr, a.ptr);
    assert_eq!(sim.calls(Call::Malloc), 2);
    // 40 MiB < 21 MiB + 20 MiB: taken whole.
    let c = alloc(&mut pool, 21 * MIB, S0);
    assert_eq!(c.ptr, a.ptr);
    assert_eq!(block_size(&pool, &c), 40 * MIB);
    assert_eq!(sim.calls(Call::Malloc), 2);
    check(&sim, &pool);

    // A wider max_non_split_rounding lets the 20 MiB request take the 40 MiB block.
    let (sim, mut pool) = torch_with("max_split_size_mb:20,max_non_split_rounding_mb:40");
    let a = alloc(&mut pool, 40 * MIB, S0);
    free(&mut pool, &a);
    let b = alloc(&mut pool, 20 * MIB, S0);
    assert_eq!(b.ptr, a.ptr);
    assert_eq!(sim.calls(Call::Malloc), 1);
    check(&sim, &pool);
}

#[test]
fn a_request_below_max_split_size_does_not_take_an_oversize_block() {
    let (sim, mut pool) = torch_with("max_split_size_mb:20");
    let a = alloc(&mut pool, 40 * MIB, S0);
    free(&mut pool, &a);
    let b = alloc(&mut pool, 5 * MIB, S0);
    assert_ne!(b.ptr, a.ptr);
    assert_eq!(sim.calls(Call::Malloc), 2);
    let c = alloc(&mut pool, 12 * MIB, S0);
    assert!(c.ptr != a.ptr && c.ptr != b.ptr);
    check(&sim, &pool);

    let (sim, mut pool) = torch_with("max_split_size_mb:64");
    let a = alloc(&mut pool, 100 * MIB, S0);
    free(&mut pool, &a);
    let b = alloc(&mut pool, 12 * MIB, S0);
    assert_ne!(
        b.ptr, a.ptr,
        "12 MiB < 64 MiB must not take the 100 MiB block"
    );
    assert_eq!(layout(&pool).len(), 2);
    let c = alloc(&mut pool, 90 * MIB, S0);
    assert_eq!(c.ptr, a.ptr, "90 MiB >= 64 MiB takes it (100 < 90 + 20)");
    assert_eq!(block_size(&pool, &c), 100 * MIB, "and does not split it");
    check(&sim, &pool);
}

#[test]
fn oversize_blocks_are_released_first_when_memory_runs_out() {
    let (sim, mut pool) = torch_with("max_split_size_mb:20");
    let small = alloc(&mut pool, 1000, S0);
    let mid = alloc(&mut pool, 12 * MIB, S0);
    let big1 = alloc(&mut pool, 30 * MIB, S0);
    let big2 = alloc(&mut pool, 44 * MIB, S0);
    for x in [&small, &mid, &big1, &big2] {
        free(&mut pool, x);
    }
    assert_eq!(pool.reserved(), 88 * MIB);
    pool.set_limit(Some(100 * MIB));
    // 54 MiB fits no cached block and 88 + 54 > 100: the two oversize blocks (largest first)
    // are released, which is enough; the small and the 12 MiB segments stay cached.
    let x = alloc(&mut pool, 54 * MIB, S0);
    check(&sim, &pool);
    assert_eq!(pool.stats().num_alloc_retries, 0, "no full release needed");
    assert_eq!(sim.calls(Call::Free), 2);
    assert_eq!(pool.reserved(), 68 * MIB);
    let sizes: BTreeSet<u64> = layout(&pool).iter().map(|s| s.0).collect();
    assert_eq!(sizes, BTreeSet::from([2 * MIB, 12 * MIB, 54 * MIB]));
    free(&mut pool, &x);

    // One cached oversize block at least as large as the request: only that one goes.
    let (sim, mut pool) = torch_with("max_split_size_mb:20");
    let a = alloc(&mut pool, 30 * MIB, S0);
    let b = alloc(&mut pool, 80 * MIB, S0);
    free(&mut pool, &a);
    free(&mut pool, &b);
    pool.set_limit(Some(120 * MIB));
    // 80 MiB >= 50 + 20: not taken; 110 + 50 > 120: release the 80 MiB block, keep 30 MiB.
    let c = alloc(&mut pool, 50 * MIB, S0);
    check(&sim, &pool);
    assert_eq!(sim.calls(Call::Free), 1);
    assert_eq!(pool.reserved(), 80 * MIB);
    let d = alloc(&mut pool, 30 * MIB, S0);
    assert_eq!(d.ptr, a.ptr, "the 30 MiB block stayed cached");
    assert_ne!(c.ptr, d.ptr);
    check(&sim, &pool);
}

// ---- out-of-memory ladder -----------------------------------------------------------------------

#[test]
fn oom_ladder_releases_cached_blocks_and_retries() {
    let (sim, mut pool) = torch();
    pool.set_limit(Some(40 * MIB));
    assert_eq!(pool.limit(), Some(40 * MIB));
    let a = alloc(&mut pool, 12 * MIB, S0);
    let b = alloc(&mut pool, 12 * MIB, S0);
    free(&mut pool, &a);
    free(&mut pool, &b);
    assert_eq!(pool.reserved(), 24 * MIB);
    // 24 + 30 > 40: release every cached block, retry.
    let c = alloc(&mut pool, 30 * MIB, S0);
    check(&sim, &pool);
    let s = pool.stats();
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_ooms, 0);
    assert_eq!(sim.calls(Call::Free), 2);
    assert_eq!(pool.reserved(), 30 * MIB);
    assert_eq!(sim.outstanding_bytes(), 30 * MIB);

    // Nothing cached is left: 30 + 20 > 40 is out of memory.
    let err = pool.allocate(20 * MIB, S0).unwrap_err();
    check(&sim, &pool);
    match err {
        AllocError::OutOfMemory {
            requested,
            rounded,
            reserved,
            allocated,
            device_free,
            limit,
        } => {
            assert_eq!(requested, 20 * MIB);
            assert_eq!(rounded, 20 * MIB);
            assert_eq!(reserved, 30 * MIB);
            assert_eq!(allocated, 30 * MIB);
            assert_eq!(device_free, 4 * GIB - 30 * MIB);
            assert_eq!(limit, Some(40 * MIB));
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert!(err.is_out_of_memory());
    assert!(err.to_string().contains("out of memory"), "{err}");
    let s = pool.stats();
    assert_eq!(s.num_ooms, 1);
    assert_eq!(s.num_alloc_retries, 2);
    // The pool still works, and a raised limit lets the request through.
    pool.set_limit(None);
    let d = alloc(&mut pool, 20 * MIB, S0);
    free(&mut pool, &c);
    free(&mut pool, &d);
    check(&sim, &pool);
}

#[test]
fn oom_from_the_device_carries_the_figures() {
    let (sim, mut pool) = pool_with(Config::for_policy(Policy::Torch), 4 * GIB);
    let a = alloc(&mut pool, 3 * GIB, S0);
    let err = pool.allocate(2 * GIB + 1, S0).unwrap_err();
    match err {
        AllocError::OutOfMemory {
            requested,
            rounded,
            reserved,
            allocated,
            device_free,
            limit,
        } => {
            assert_eq!(requested, 2 * GIB + 1);
            assert_eq!(rounded, 2 * GIB + 512);
            assert_eq!(reserved, 3 * GIB);
            assert_eq!(allocated, 3 * GIB);
            assert_eq!(device_free, GIB);
            assert_eq!(limit, None);
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert_eq!(pool.stats().num_ooms, 1);
    check(&sim, &pool);
    assert_eq!(pool.stats().num_alloc_retries, 1);
    // Freed, the 3 GiB block stays cached and serves the next 2 GiB request (split).
    free(&mut pool, &a);
    let b = alloc(&mut pool, 2 * GIB, S0);
    assert_eq!(b.ptr, a.ptr);
    assert_eq!(pool.stats().num_alloc_retries, 1);
    assert_eq!(pool.reserved(), 3 * GIB);
    // 1 GiB is cached behind b, so 1.5 GiB needs the device: 3 + 1.5 > 4 GiB, and the cached
    // rest cannot go (its segment is split): out of memory again.
    let err = pool.allocate(1536 * MIB, S0).unwrap_err();
    assert!(err.is_out_of_memory());
    assert_eq!(pool.stats().num_alloc_retries, 2);
    // A 12 MiB segment that is free and unsplit is released by the ladder, though.
    free(&mut pool, &b);
    let c = alloc(&mut pool, 12 * MIB, S1);
    free(&mut pool, &c);
    let d = alloc(&mut pool, 4 * GIB - 12 * MIB, S1);
    assert_eq!(pool.stats().num_alloc_retries, 3);
    assert_eq!(pool.reserved(), 4 * GIB - 12 * MIB);
    free(&mut pool, &d);
    check(&sim, &pool);
}

#[test]
fn set_memory_fraction_caps_the_pool() {
    let (sim, mut pool) = torch();
    for bad in [-0.1, 1.5, f64::NAN] {
        assert!(matches!(
            pool.set_memory_fraction(bad),
            Err(AllocError::InvalidArgument(_))
        ));
    }
    pool.set_memory_fraction(0.25).unwrap();
    assert_eq!(pool.limit(), Some(GIB));
    let a = alloc(&mut pool, 900 * MIB, S0);
    let err = pool.allocate(200 * MIB, S0).unwrap_err();
    assert!(err.is_out_of_memory(), "{err:?}");
    free(&mut pool, &a);
    check(&sim, &pool);
}

#[test]
fn garbage_collection_frees_the_oldest_cached_segments() {
    for gc in [false, true] {
        let cfg = if gc {
            "garbage_collection_threshold:0.2"
        } else {
            ""
        };
        let (sim, mut pool) = torch_with(cfg);
        pool.set_limit(Some(100 * MIB));
        let a = alloc(&mut pool, 12 * MIB, S0);
        let b = alloc(&mut pool, 14 * MIB, S0);
        free(&mut pool, &a);
        free(&mut pool, &b);
        // b is found again and again (its age stays 0); a ages.
        for _ in 0..5 {
            let x = alloc(&mut pool, 14 * MIB, S0);
            assert_eq!(x.ptr, b.ptr);
            free(&mut pool, &x);
        }
        assert_eq!(sim.calls(Call::Free), 0);
        // Nothing cached fits 40 MiB; reserved (26 MiB) is above 20% of the limit, so the
        // collector frees the segments older than the average (a) until 6 MiB are reclaimed.
        let big = alloc(&mut pool, 40 * MIB, S0);
        check(&sim, &pool);
        if gc {
            assert_eq!(sim.calls(Call::Free), 1);
            assert_eq!(pool.reserved(), 54 * MIB);
        } else {
            assert_eq!(sim.calls(Call::Free), 0);
            assert_eq!(pool.reserved(), 66 * MIB);
        }
        let y = alloc(&mut pool, 14 * MIB, S0);
        assert_eq!(y.ptr, b.ptr, "the young segment stayed cached");
        free(&mut pool, &big);
        free(&mut pool, &y);
        check(&sim, &pool);
    }
}

#[test]
fn garbage_collection_needs_a_limit() {
    let (sim, mut pool) = torch_with("garbage_collection_threshold:0.1");
    let a = alloc(&mut pool, 12 * MIB, S0);
    free(&mut pool, &a);
    for _ in 0..5 {
        let x = alloc(&mut pool, 12 * MIB, S0);
        free(&mut pool, &x);
    }
    let b = alloc(&mut pool, 40 * MIB, S0);
    assert_eq!(sim.calls(Call::Free), 0, "no limit: no garbage collection");
    free(&mut pool, &b);
    check(&sim, &pool);
}

// ---- empty_cache --------------------------------------------------------------------------------

#[test]
fn empty_cache_returns_unsplit_segments() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 1000, S0);
    let b = alloc(&mut pool, 5 * MIB, S0);
    // 16 MiB does not fit the 15 MiB left of b's segment: a segment of its own.
    let c = alloc(&mut pool, 16 * MIB, S0);
    let d = alloc(&mut pool, 12 * MIB, S1);
    free(&mut pool, &c);
    assert_eq!(sim.outstanding_bytes(), 50 * MIB);
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(
        sim.outstanding_bytes(),
        34 * MIB,
        "only c's segment went back"
    );
    free(&mut pool, &b);
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(sim.outstanding_bytes(), 14 * MIB);
    free(&mut pool, &a);
    free(&mut pool, &d);
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(sim.outstanding_bytes(), 0);
    assert_eq!(pool.reserved(), 0);
    let s = pool.stats();
    assert_eq!(s.num_device_free, sim.calls(Call::Free));
    assert_eq!(s.num_device_alloc, sim.calls(Call::Malloc));
    assert_eq!(s.segment.get(cudalloc::stats::StatType::All).current, 0);
    assert_eq!(
        s.reserved_bytes.get(cudalloc::stats::StatType::All).peak,
        50 * MIB as i64
    );
    drop(pool);
    assert_eq!(sim.live_mallocs(), 0);
}

#[test]
fn dropping_the_pool_returns_everything() {
    let (sim, mut pool) = torch();
    alloc(&mut pool, 1000, S0);
    alloc(&mut pool, 30 * MIB, S1);
    let c = alloc(&mut pool, 5 * MIB, S0);
    free(&mut pool, &c);
    drop(pool);
    assert_eq!(sim.outstanding_bytes(), 0);
    assert_eq!(sim.live_events(), 0);
}

// ---- statistics ---------------------------------------------------------------------------------

/// Every key of `torch.cuda.memory_stats()`.
fn torch_stat_names() -> Vec<String> {
    let arrays = [
        "allocation",
        "segment",
        "active",
        "inactive_split",
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "inactive_split_bytes",
        "requested_bytes",
    ];
    let metrics = ["current", "peak", "allocated", "freed"];
    let mut names = Vec::new();
    for a in arrays {
        for pool in ["all", "small_pool", "large_pool"] {
            for m in metrics {
                names.push(format!("{a}.{pool}.{m}"));
            }
        }
    }
    for a in ["oversize_allocations", "oversize_segments"] {
        for m in metrics {
            names.push(format!("{a}.{m}"));
        }
    }
    for s in [
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "max_split_size",
    ] {
        names.push(s.to_string());
    }
    names
}

#[test]
fn every_pytorch_stat_key_exists() {
    let (sim, mut pool) = torch_with("max_split_size_mb:64");
    let a = alloc(&mut pool, 1000, S0);
    let b = alloc(&mut pool, 100 * MIB, S0);
    free(&mut pool, &a);
    check(&sim, &pool);
    let dict = pool.stats().to_torch_dict();
    let keys: Vec<&str> = dict.iter().map(|(k, _)| k.as_str()).collect();
    let unique: BTreeSet<&str> = keys.iter().copied().collect();
    assert_eq!(unique.len(), keys.len(), "duplicate keys");
    let want = torch_stat_names();
    for name in &want {
        assert!(unique.contains(name.as_str()), "missing {name}");
    }
    assert_eq!(want.len(), 122);
    for spot in [
        "allocation.all.current",
        "requested_bytes.large_pool.freed",
        "oversize_allocations.current",
        "oversize_segments.peak",
        "inactive_split_bytes.small_pool.peak",
        "max_split_size",
    ] {
        assert!(unique.contains(spot), "missing {spot}");
    }
    let d: HashMap<&str, i64> = dict.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(d["allocation.all.current"], 1);
    assert_eq!(d["allocation.all.allocated"], 2);
    assert_eq!(d["allocation.all.freed"], 1);
    assert_eq!(d["allocation.small_pool.peak"], 1);
    assert_eq!(d["allocated_bytes.large_pool.current"], 100 * MIB as i64);
    assert_eq!(d["requested_bytes.small_pool.freed"], 1000);
    assert_eq!(d["reserved_bytes.all.current"], 102 * MIB as i64);
    assert_eq!(d["segment.all.current"], 2);
    assert_eq!(d["oversize_allocations.current"], 1);
    assert_eq!(d["oversize_segments.current"], 1);
    assert_eq!(d["num_device_alloc"], 2);
    assert_eq!(d["num_device_free"], 0);
    assert_eq!(d["num_ooms"], 0);
    assert_eq!(d["max_split_size"], 64 * MIB as i64);
    free(&mut pool, &b);
    // No max_split_size: PyTorch reports -1.
    let (_, pool) = torch();
    let d = pool.stats().to_torch_dict();
    assert!(d.contains(&("max_split_size".to_string(), -1)));
}

#[test]
fn stat_current_is_allocated_minus_freed() {
    let (sim, mut pool) = torch();
    let xs: Vec<_> = [1000, 5 * MIB, 2048, 12 * MIB, 700 * KIB]
        .iter()
        .map(|&s| alloc(&mut pool, s, S0))
        .collect();
    for x in xs.iter().step_by(2) {
        free(&mut pool, x);
    }
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    let s: Stats = pool.stats().clone();
    for (name, array) in s.arrays() {
        for st in array.0 {
            assert_eq!(st.current, st.allocated - st.freed, "{name}");
            assert!(st.peak >= st.current, "{name}");
        }
        assert_eq!(
            array.0[0].current,
            array.0[1].current + array.0[2].current,
            "{name}"
        );
    }
}

#[test]
fn reset_peak_stats_sets_peaks_to_current() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 12 * MIB, S0);
    let b = alloc(&mut pool, 12 * MIB, S0);
    free(&mut pool, &b);
    let all = cudalloc::stats::StatType::All;
    let s = pool.stats().allocated_bytes.get(all).to_owned();
    assert_eq!((s.current, s.peak), (12 * MIB as i64, 24 * MIB as i64));
    pool.reset_peak_stats();
    let st = pool.stats();
    let s = st.allocated_bytes.get(all);
    assert_eq!((s.current, s.peak), (12 * MIB as i64, 12 * MIB as i64));
    assert_eq!((s.allocated, s.freed), (24 * MIB as i64, 12 * MIB as i64));
    assert_eq!(
        st.reserved_bytes.get(all).peak,
        24 * MIB as i64,
        "b's segment is cached"
    );
    assert_eq!(st.allocation.get(all).peak, 1);
    free(&mut pool, &a);
    check(&sim, &pool);
}

// ---- record_stream ------------------------------------------------------------------------------

#[test]
fn a_block_used_on_another_stream_waits_for_its_work() {
    let (sim, mut pool) = torch();
    sim.set_auto_complete(false);
    let a = alloc(&mut pool, 1000, S1);
    pool.record_stream(a.block, a.ptr, S2).unwrap();
    // Recording the allocation's own stream, or the same stream twice, changes nothing.
    pool.record_stream(a.block, a.ptr, S1).unwrap();
    pool.record_stream(a.block, a.ptr, S2).unwrap();
    free(&mut pool, &a);
    check(&sim, &pool);
    assert_eq!(pool.pending_events(), 1);
    assert_eq!(sim.calls(Call::RecordEvent), 1);
    let state = |pool: &Pool<Sim>, p: u64| {
        pool.snapshot().segments[0]
            .blocks
            .iter()
            .find(|b| b.addr == p)
            .map(|b| b.state)
    };
    assert_eq!(state(&pool, a.ptr), Some(BlockState::PendingEvents));
    let s = pool.stats();
    assert_eq!(s.allocation.current(PoolKind::Small), 0);
    assert_eq!(
        s.active.current(PoolKind::Small),
        1,
        "pending blocks are active"
    );

    let b = alloc(&mut pool, 1000, S1);
    assert_ne!(b.ptr, a.ptr, "work on stream 2 has not completed");
    // Completing an unrelated stream changes nothing.
    sim.complete_stream(S1);
    let c = alloc(&mut pool, 1000, S1);
    assert!(c.ptr != a.ptr && c.ptr != b.ptr);
    sim.complete_stream(S2);
    // The event has completed, but only the next allocation processes it.
    assert_eq!(state(&pool, a.ptr), Some(BlockState::PendingEvents));
    let d = alloc(&mut pool, 1000, S1);
    assert_eq!(d.ptr, a.ptr);
    assert_eq!(pool.pending_events(), 0);
    check(&sim, &pool);
    for x in [&b, &c, &d] {
        free(&mut pool, x);
    }
    check(&sim, &pool);
    drop(pool);
    assert_eq!(
        sim.live_events(),
        0,
        "pooled events are destroyed with the pool"
    );
}

#[test]
fn empty_cache_waits_for_pending_events() {
    let (sim, mut pool) = torch();
    sim.set_auto_complete(false);
    let a = alloc(&mut pool, 12 * MIB, S1);
    pool.record_stream(a.block, a.ptr, S2).unwrap();
    free(&mut pool, &a);
    let syncs = pool.stats().num_sync_all_streams;
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(pool.stats().num_sync_all_streams, syncs + 1);
    assert_eq!(pool.pending_events(), 0);
    assert_eq!(sim.outstanding_bytes(), 0);
}

#[test]
fn record_stream_and_free_reject_stale_allocations() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 1000, S0);
    let b = alloc(&mut pool, 1000, S0);
    free(&mut pool, &a);
    assert_eq!(pool.free(&a), Err(AllocError::NotAllocated(a.ptr)));
    let forged = Allocation {
        ptr: b.ptr + 512,
        ..b
    };
    assert_eq!(
        pool.free(&forged),
        Err(AllocError::NotAllocated(b.ptr + 512))
    );
    assert!(pool.record_stream(a.block, a.ptr, S1).is_err());
    free(&mut pool, &b);
    check(&sim, &pool);
}

// ---- fragmentation ------------------------------------------------------------------------------

fn blk(addr: u64, size: u64, state: BlockState) -> BlockInfo {
    BlockInfo {
        addr,
        size,
        requested: if state == A { size } else { 0 },
        state,
    }
}

#[test]
fn fragmentation_of_a_hand_made_snapshot() {
    let base = 0x1000_0000;
    let fixed = SegmentInfo {
        addr: base,
        size: 2 * MIB,
        mapped: 2 * MIB,
        pool: PoolKind::Small,
        stream: S0,
        expandable: false,
        blocks: vec![
            blk(base, MIB, A),
            blk(base + MIB, 512 * KIB, F),
            blk(base + 1536 * KIB, 256 * KIB, A),
            blk(base + 1792 * KIB, 256 * KIB, F),
        ],
    };
    let vbase = 0x2000_0000;
    let expandable = SegmentInfo {
        addr: vbase,
        size: 64 * MIB,
        mapped: 4 * MIB,
        pool: PoolKind::Large,
        stream: S0,
        expandable: true,
        blocks: vec![
            blk(vbase, 2 * MIB, A),
            blk(vbase + 2 * MIB, 2 * MIB, F),
            blk(vbase + 4 * MIB, 60 * MIB, BlockState::Unmapped),
        ],
    };
    let mut stats = Stats::default();
    stats
        .allocated_bytes
        .increase(PoolKind::Small, MIB + 256 * KIB);
    stats.allocated_bytes.increase(PoolKind::Large, 2 * MIB);
    stats.reserved_bytes.increase(PoolKind::Small, 2 * MIB);
    stats.reserved_bytes.increase(PoolKind::Large, 4 * MIB);
    let snap = Snapshot {
        segments: vec![fixed, expandable],
        stats,
    };
    let f = snap.fragmentation();
    assert_eq!(f.free_bytes, 2 * MIB + 768 * KIB);
    assert_eq!(f.largest_free_block, 2 * MIB);
    let ext = 1.0 - 2.0 / 2.75;
    assert!((f.external_fragmentation - ext).abs() < 1e-12, "{f:?}");
    assert!((f.utilisation - 3.25 / 6.0).abs() < 1e-12, "{f:?}");
    assert_eq!(
        f.free_histogram,
        vec![
            (256 * KIB, 1, 256 * KIB),
            (512 * KIB, 1, 512 * KIB),
            (2 * MIB, 1, 2 * MIB)
        ]
    );
    assert_eq!(f.mapped_bytes, 6 * MIB);
    assert_eq!(f.virtual_bytes, 66 * MIB);

    let empty = Snapshot {
        segments: vec![],
        stats: Stats::default(),
    };
    let f = empty.fragmentation();
    assert_eq!((f.free_bytes, f.largest_free_block), (0, 0));
    assert_eq!(f.external_fragmentation, 0.0);
    assert_eq!(f.utilisation, 1.0);
    assert!(f.free_histogram.is_empty());
}

#[test]
fn fragmentation_of_a_real_pool() {
    let (sim, mut pool) = torch();
    let x1 = alloc(&mut pool, 4096, S0);
    let _s1 = alloc(&mut pool, 512, S0);
    let x2 = alloc(&mut pool, 8192, S0);
    let _s2 = alloc(&mut pool, 512, S0);
    free(&mut pool, &x1);
    free(&mut pool, &x2);
    check(&sim, &pool);
    let rest = 2 * MIB - 13312;
    let f = pool.snapshot().fragmentation();
    assert_eq!(f.free_bytes, 4096 + 8192 + rest);
    assert_eq!(f.largest_free_block, rest);
    let ext = 1.0 - rest as f64 / (4096 + 8192 + rest) as f64;
    assert!((f.external_fragmentation - ext).abs() < 1e-12);
    assert!((f.utilisation - 1024.0 / (2 * MIB) as f64).abs() < 1e-12);
    assert_eq!(
        f.free_histogram,
        vec![(4096, 1, 4096), (8192, 1, 8192), (MIB, 1, rest)]
    );
    assert_eq!((f.mapped_bytes, f.virtual_bytes), (2 * MIB, 2 * MIB));
}

// ---- expandable policies ------------------------------------------------------------------------

/// Checks plus "reserved bytes == bytes the device has mapped" (expandable policies map all).
fn check_exp(sim: &SimDevice, pool: &Pool<Sim>) {
    check(sim, pool);
    let all = cudalloc::stats::StatType::All;
    assert_eq!(
        pool.stats().reserved_bytes.get(all).current as u64,
        sim.mapped_bytes(),
        "reserved_bytes vs mapped bytes"
    );
    assert_eq!(sim.malloc_bytes(), 0, "expandable policies never malloc");
}

#[test]
fn torch_expandable_grows_by_pages_and_shrinks_on_empty_cache() {
    let (sim, mut pool) = pool_with(Config::for_policy(Policy::TorchExpandable), 4 * GIB);
    let a = alloc(&mut pool, 1000, S0);
    check_exp(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 2 * MIB, "one 2 MiB small page");
    let xs: Vec<_> = (0..4).map(|_| alloc(&mut pool, 5 * MIB, S0)).collect();
    check_exp(&sim, &pool);
    assert_eq!(
        sim.mapped_bytes(),
        22 * MIB,
        "one 20 MiB large page holds four 5 MiB blocks"
    );
    for w in xs.windows(2) {
        assert_eq!(w[1].ptr, w[0].ptr + 5 * MIB);
    }
    // The fifth maps the next page, right after the first.
    let maps = sim.calls(Call::Map);
    let e = alloc(&mut pool, 5 * MIB, S0);
    check_exp(&sim, &pool);
    assert_eq!(e.ptr, xs[3].ptr + 5 * MIB, "the segment grows in place");
    assert_eq!(sim.mapped_bytes(), 42 * MIB);
    assert_eq!(sim.calls(Call::Map), maps + 1);
    // Freed at the end, it merges with the free rest of its page...
    free(&mut pool, &e);
    check_exp(&sim, &pool);
    let snap = pool.snapshot();
    let large = snap
        .segments
        .iter()
        .find(|s| s.pool == PoolKind::Large)
        .unwrap();
    assert!(large.expandable);
    let states: Vec<_> = large.blocks.iter().map(|b| (b.size, b.state)).collect();
    assert_eq!(
        &states[..5],
        &[
            (5 * MIB, A),
            (5 * MIB, A),
            (5 * MIB, A),
            (5 * MIB, A),
            (20 * MIB, F)
        ]
    );
    assert_eq!(states[5].1, BlockState::Unmapped);
    assert_eq!(states.len(), 6);
    // ...and empty_cache unmaps that whole page.
    pool.empty_cache().unwrap();
    check_exp(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 22 * MIB);
    // A 40 MiB request maps two more large pages.
    let maps = sim.calls(Call::Map);
    let big = alloc(&mut pool, 40 * MIB, S0);
    check_exp(&sim, &pool);
    assert_eq!(sim.calls(Call::Map), maps + 2);
    assert_eq!(sim.mapped_bytes(), 62 * MIB);
    // Everything freed and emptied: nothing mapped, nothing reserved.
    free(&mut pool, &big);
    free(&mut pool, &a);
    for x in &xs {
        free(&mut pool, x);
    }
    pool.empty_cache().unwrap();
    check_exp(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 0);
    assert_eq!(sim.page_bytes(), 0);
    assert_eq!(sim.reserved_va_bytes(), 0);
    assert_eq!(pool.reserved(), 0);
    assert_eq!(sim.live_pages(), 0);
}

#[test]
fn torch_expandable_partial_pages_stay_mapped() {
    let (sim, mut pool) = pool_with(Config::for_policy(Policy::TorchExpandable), 4 * GIB);
    let a = alloc(&mut pool, 15 * MIB, S0);
    let b = alloc(&mut pool, 15 * MIB, S0);
    check_exp(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 40 * MIB);
    // a's block covers no whole page (0..15 MiB of page 0..20): nothing to unmap.
    free(&mut pool, &a);
    pool.empty_cache().unwrap();
    check_exp(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 40 * MIB);
    free(&mut pool, &b);
    pool.empty_cache().unwrap();
    check_exp(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 0);
}

#[test]
fn default_policy_maps_pages_in_chunks_and_unmaps_them() {
    let (sim, mut pool) = pool_with(Config::for_policy(Policy::Default), 4 * GIB);
    let a = alloc(&mut pool, 1000, S0);
    check_exp(&sim, &pool);
    assert_eq!(
        sim.mapped_bytes(),
        2 * MIB,
        "one 2 MiB page for the small pool"
    );
    let maps = sim.calls(Call::Map);
    let b = alloc(&mut pool, 5 * MIB, S0);
    check_exp(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 8 * MIB, "5 MiB needs three 2 MiB pages");
    assert_eq!(sim.calls(Call::Map), maps + 1, "mapped as one chunk");
    // A growth of many pages takes far fewer map calls than pages.
    let maps = sim.calls(Call::Map);
    let c = alloc(&mut pool, 100 * MIB, S0);
    check_exp(&sim, &pool);
    assert!(sim.mapped_bytes() >= 106 * MIB);
    let calls = sim.calls(Call::Map) - maps;
    assert!((1..=5).contains(&calls), "{calls} map calls for 50 pages");
    assert_eq!(
        c.ptr,
        b.ptr + 5 * MIB,
        "the free 1 MiB after b is the start of the run"
    );
    // Freeing and allocating the same size again maps nothing new.
    free(&mut pool, &b);
    let maps = sim.calls(Call::Map);
    let b2 = alloc(&mut pool, 5 * MIB, S0);
    assert_eq!(sim.calls(Call::Map), maps);
    check_exp(&sim, &pool);
    // Everything freed and emptied: nothing mapped, nothing reserved.
    for x in [&a, &b2, &c] {
        free(&mut pool, x);
        check_exp(&sim, &pool);
    }
    pool.empty_cache().unwrap();
    check_exp(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 0);
    assert_eq!(sim.page_bytes(), 0);
    assert_eq!(sim.reserved_va_bytes(), 0);
    assert_eq!(pool.reserved(), 0);
}

#[test]
fn expandable_policies_keep_streams_apart_and_reserved_equal_to_mapped() {
    for policy in [Policy::TorchExpandable, Policy::Default] {
        let (sim, mut pool) = pool_with(Config::for_policy(policy), 4 * GIB);
        let mut live = Vec::new();
        for (i, size) in [1000, 3 * MIB, 700 * KIB, 12 * MIB, 64 * MIB, 512]
            .iter()
            .enumerate()
        {
            let stream = [S0, S1][i % 2];
            live.push(alloc(&mut pool, *size, stream));
            check_exp(&sim, &pool);
        }
        let a = live.remove(0);
        free(&mut pool, &a);
        let b = alloc(&mut pool, 1000, S1);
        assert_ne!(b.ptr, a.ptr, "{policy:?}: other stream");
        let c = alloc(&mut pool, 1000, S0);
        assert_eq!(c.ptr, a.ptr, "{policy:?}: same stream");
        live.push(b);
        live.push(c);
        for x in &live {
            free(&mut pool, x);
            check_exp(&sim, &pool);
        }
        pool.empty_cache().unwrap();
        check_exp(&sim, &pool);
        assert_eq!(sim.outstanding_bytes(), 0, "{policy:?}");
        drop(pool);
        assert_eq!(sim.reserved_va_bytes(), 0, "{policy:?}");
    }
}

#[test]
fn expandable_oom_under_a_limit_is_recoverable() {
    for policy in [Policy::TorchExpandable, Policy::Default] {
        let (sim, mut pool) = pool_with(Config::for_policy(policy), 4 * GIB);
        pool.set_limit(Some(100 * MIB));
        let a = alloc(&mut pool, 60 * MIB, S0);
        let err = pool.allocate(60 * MIB, S0).unwrap_err();
        assert!(err.is_out_of_memory(), "{policy:?}: {err:?}");
        assert_eq!(pool.stats().num_ooms, 1);
        check_exp(&sim, &pool);
        free(&mut pool, &a);
        let b = alloc(&mut pool, 60 * MIB, S0);
        free(&mut pool, &b);
        pool.empty_cache().unwrap();
        check_exp(&sim, &pool);
        assert_eq!(sim.outstanding_bytes(), 0);
    }
}

// ---- requests no device can hold ----------------------------------------------------------------

#[test]
fn huge_requests_are_errors_not_panics() {
    for policy in Policy::ALL {
        let (sim, mut pool) = pool_with(Config::for_policy(policy), 4 * GIB);
        for size in [5 * GIB, 1 << 40, 1 << 62, u64::MAX - 4095, u64::MAX] {
            let r = pool.allocate(size, S0);
            assert!(
                matches!(
                    r,
                    Err(AllocError::OutOfMemory { .. }) | Err(AllocError::InvalidArgument(_))
                ),
                "{policy:?} size {size}: {r:?}"
            );
            check(&sim, &pool);
        }
        let a = alloc(&mut pool, MIB, S0);
        free(&mut pool, &a);
        check(&sim, &pool);
    }
}

// ---- minimal reproductions of bugs found by the model and fault tests ---------------------------

#[test]
fn check_invariants_accepts_a_small_block_inside_a_large_page() {
    // A 1024 B block lies inside a 2 MiB page: "is every byte of the block mapped" must be true,
    // not a panic ("range start is greater than range end" in `ExpSegment::is_mapped`).
    for policy in [Policy::TorchExpandable, Policy::Default] {
        let (_sim, mut pool) = pool_with(Config::for_policy(policy), 4 * GIB);
        let _a = alloc(&mut pool, 1000, S0);
        assert_eq!(pool.check_invariants(), Ok(()), "{policy:?}");
    }
}

#[test]
fn a_segment_that_could_not_be_mapped_is_unreserved_on_drop() {
    // torch-expandable on a 256 MiB device: stream 1's request reserves a segment, mapping its
    // pages runs out of memory, and the wholly unmapped segment must still be given back.
    let (sim, mut pool) = pool_with(Config::for_policy(Policy::TorchExpandable), 256 * MIB);
    let a = alloc(&mut pool, 200 * MIB, S0);
    let err = pool.allocate(100 * MIB, S1).unwrap_err();
    assert!(err.is_out_of_memory(), "{err:?}");
    free(&mut pool, &a);
    pool.empty_cache().unwrap();
    assert_eq!(sim.outstanding_bytes(), 0);
    drop(pool);
    assert_eq!(
        sim.reserved_va_bytes(),
        0,
        "virtual address reservation leaked"
    );
}

#[test]
fn a_segment_unmapped_by_the_budget_is_unreserved_on_drop() {
    // default policy: stream 1's cached page is unmapped by the fragmentation budget when
    // stream 0 grows; stream 1's segment is then wholly unmapped and must still be given back.
    let (sim, mut pool) = pool_with(Config::for_policy(Policy::Default), 4 * GIB);
    let a = alloc(&mut pool, 1, S1);
    free(&mut pool, &a);
    let b = alloc(&mut pool, 1, S0);
    free(&mut pool, &b);
    pool.empty_cache().unwrap();
    assert_eq!(sim.outstanding_bytes(), 0);
    drop(pool);
    assert_eq!(
        sim.reserved_va_bytes(),
        0,
        "virtual address reservation leaked"
    );
}

/// Pages are unmapped only after the device's queued work has completed: a block freed in
/// stream order may still be used by kernels (the simulated device completes work only when
/// asked, so an event on a busy stream stays pending until the unmap waits for the device).
#[test]
fn unmapping_waits_for_the_device() {
    use cudalloc_sys::Device;
    for policy in [Policy::TorchExpandable, Policy::Default] {
        let (sim, mut pool) = pool_with(Config::for_policy(policy), 4 * GIB);
        sim.set_auto_complete(false);
        let a = alloc(&mut pool, 64 * MIB, S0);
        let work = sim.create_event().unwrap();
        sim.record_event(work, S0).unwrap();
        assert!(
            !sim.query_event(work).unwrap(),
            "{policy:?}: work still queued"
        );
        free(&mut pool, &a);
        assert!(
            !sim.query_event(work).unwrap(),
            "{policy:?}: freeing alone does not wait"
        );
        pool.empty_cache().unwrap();
        assert_eq!(pool.reserved(), 0, "{policy:?}: pages unmapped");
        assert!(
            sim.query_event(work).unwrap(),
            "{policy:?}: unmapped before the work ended"
        );
        assert!(sim.calls(Call::SynchronizeDevice) > 0);
        sim.destroy_event(work).unwrap();
    }
}
