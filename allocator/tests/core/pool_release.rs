//! PyTorch's rules for giving memory back, on the simulated device, through
//! `Pool<Arc<SimDevice>>`.
//!
//! Checked (besides `Pool::check_invariants`, `SimDevice::check_invariants` and "device
//! outstanding bytes == reserved bytes" after every scenario step):
//! - oversize (`max_split_size_mb`): oversize blocks are never split, a request below the limit
//!   never takes an oversize block, a request above it takes one only when it is less than
//!   `max_non_split_rounding` bigger;
//! - the out-of-memory ladder: oversize cached blocks, then every cached block, are released and
//!   the allocation retried (`num_alloc_retries`), then `AllocError::OutOfMemory` with its fields
//!   filled (`num_ooms`); `garbage_collection_threshold` frees the oldest cached segments;
//! - `empty_cache` returns exactly the unsplit cached segments to the device;
//! - `record_stream`: a block used on another stream comes back only after that stream's work has
//!   completed and a later allocation processed the event.

use crate::common::pool;
use cudalloc::sizes::PoolKind;
use cudalloc::snapshot::BlockState;
use cudalloc::{AllocError, Allocation, Config, Policy, Pool};
use cudalloc_sys::{Call, SimConfig, SimDevice, StreamId};
use pool::*;
use std::collections::BTreeSet;
use std::sync::Arc;
use BlockState::Allocated as A;

// ---- oversize rules -----------------------------------------------------------------------------

#[test]
fn oversize_blocks_are_not_split() {
    let (sim, mut pool) = torch_with("max_split_size_mb:20");
    assert_eq!(pool.stats().max_split_size, 20 * MIB);
    let a = alloc(&mut pool, 40 * MIB, S0);
    assert_eq!(pool.stats().oversize_segments.current, 1);
    let a_ptr = a.ptr();
    free(&mut pool, a);
    // 30 MiB is oversize too, and the cached 40 MiB block is less than 20 MiB bigger: taken whole.
    let b = alloc(&mut pool, 30 * MIB, S0);
    assert_eq!(b.ptr(), a_ptr);
    assert_eq!(layout(&pool), vec![(40 * MIB, vec![(40 * MIB, A)])]);
    let s = pool.stats();
    assert_eq!(s.allocated_bytes.current(PoolKind::Large), 40 * MIB as i64);
    assert_eq!(s.requested_bytes.current(PoolKind::Large), 30 * MIB as i64);
    assert_eq!(s.oversize_allocations.current, 1);
    assert_eq!(sim.calls(Call::Malloc), 1);
    check(&sim, &pool);
    free(&mut pool, b);
    assert_eq!(pool.stats().oversize_allocations.current, 0);
    assert_eq!(pool.stats().oversize_allocations.peak, 1);
    check(&sim, &pool);
}

#[test]
fn an_oversize_request_takes_a_block_only_within_max_non_split_rounding() {
    let (sim, mut pool) = torch_with("max_split_size_mb:20");
    let a = alloc(&mut pool, 40 * MIB, S0);
    let a_ptr = a.ptr();
    free(&mut pool, a);
    // 40 MiB >= 20 MiB + 20 MiB: too big for a 20 MiB request, which gets its own segment.
    let b = alloc(&mut pool, 20 * MIB, S0);
    assert_ne!(b.ptr(), a_ptr);
    assert_eq!(sim.calls(Call::Malloc), 2);
    // 40 MiB < 21 MiB + 20 MiB: taken whole.
    let c = alloc(&mut pool, 21 * MIB, S0);
    assert_eq!(c.ptr(), a_ptr);
    assert_eq!(block_size(&pool, &c), 40 * MIB);
    assert_eq!(sim.calls(Call::Malloc), 2);
    check(&sim, &pool);

    // A wider max_non_split_rounding lets the 20 MiB request take the 40 MiB block.
    let (sim, mut pool) = torch_with("max_split_size_mb:20,max_non_split_rounding_mb:40");
    let a = alloc(&mut pool, 40 * MIB, S0);
    let a_ptr = a.ptr();
    free(&mut pool, a);
    let b = alloc(&mut pool, 20 * MIB, S0);
    assert_eq!(b.ptr(), a_ptr);
    assert_eq!(sim.calls(Call::Malloc), 1);
    check(&sim, &pool);
}

#[test]
fn a_request_below_max_split_size_does_not_take_an_oversize_block() {
    let (sim, mut pool) = torch_with("max_split_size_mb:20");
    let a = alloc(&mut pool, 40 * MIB, S0);
    let a_ptr = a.ptr();
    free(&mut pool, a);
    let b = alloc(&mut pool, 5 * MIB, S0);
    assert_ne!(b.ptr(), a_ptr);
    assert_eq!(sim.calls(Call::Malloc), 2);
    let c = alloc(&mut pool, 12 * MIB, S0);
    assert!(c.ptr() != a_ptr && c.ptr() != b.ptr());
    check(&sim, &pool);

    let (sim, mut pool) = torch_with("max_split_size_mb:64");
    let a = alloc(&mut pool, 100 * MIB, S0);
    let a_ptr = a.ptr();
    free(&mut pool, a);
    let b = alloc(&mut pool, 12 * MIB, S0);
    assert_ne!(
        b.ptr(),
        a_ptr,
        "12 MiB < 64 MiB must not take the 100 MiB block"
    );
    assert_eq!(layout(&pool).len(), 2);
    let c = alloc(&mut pool, 90 * MIB, S0);
    assert_eq!(c.ptr(), a_ptr, "90 MiB >= 64 MiB takes it (100 < 90 + 20)");
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
    for x in [small, mid, big1, big2] {
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
    free(&mut pool, x);

    // One cached oversize block at least as large as the request: only that one goes.
    let (sim, mut pool) = torch_with("max_split_size_mb:20");
    let a = alloc(&mut pool, 30 * MIB, S0);
    let b = alloc(&mut pool, 80 * MIB, S0);
    let a_ptr = a.ptr();
    free(&mut pool, a);
    free(&mut pool, b);
    pool.set_limit(Some(120 * MIB));
    // 80 MiB >= 50 + 20: not taken; 110 + 50 > 120: release the 80 MiB block, keep 30 MiB.
    let c = alloc(&mut pool, 50 * MIB, S0);
    check(&sim, &pool);
    assert_eq!(sim.calls(Call::Free), 1);
    assert_eq!(pool.reserved(), 80 * MIB);
    let d = alloc(&mut pool, 30 * MIB, S0);
    assert_eq!(d.ptr(), a_ptr, "the 30 MiB block stayed cached");
    assert_ne!(c.ptr(), d.ptr());
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
    free(&mut pool, a);
    free(&mut pool, b);
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
            device,
            requested,
            rounded,
            reserved,
            allocated,
            device_free,
            limit,
        } => {
            assert_eq!(device, 0);
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
    free(&mut pool, c);
    free(&mut pool, d);
    check(&sim, &pool);
}

#[test]
fn oom_from_the_device_carries_the_figures() {
    // Device 3 of a multi-GPU job: the error says which one ran out.
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB).ordinal(3)));
    let mut pool = Pool::new(sim.clone(), Config::for_policy(Policy::Torch));
    let a = alloc(&mut pool, 3 * GIB, S0);
    let err = pool.allocate(2 * GIB + 1, S0).unwrap_err();
    assert!(
        err.to_string().starts_with("out of memory on device 3:"),
        "{err}"
    );
    match err {
        AllocError::OutOfMemory {
            device: 3,
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
    let a_ptr = a.ptr();
    free(&mut pool, a);
    let b = alloc(&mut pool, 2 * GIB, S0);
    assert_eq!(b.ptr(), a_ptr);
    assert_eq!(pool.stats().num_alloc_retries, 1);
    assert_eq!(pool.reserved(), 3 * GIB);
    // 1 GiB is cached behind b, so 1.5 GiB needs the device: 3 + 1.5 > 4 GiB, and the cached
    // rest cannot go (its segment is split): out of memory again.
    let err = pool.allocate(1536 * MIB, S0).unwrap_err();
    assert!(err.is_out_of_memory());
    assert_eq!(pool.stats().num_alloc_retries, 2);
    // A 12 MiB segment that is free and unsplit is released by the ladder, though.
    free(&mut pool, b);
    let c = alloc(&mut pool, 12 * MIB, S1);
    free(&mut pool, c);
    let d = alloc(&mut pool, 4 * GIB - 12 * MIB, S1);
    assert_eq!(pool.stats().num_alloc_retries, 3);
    assert_eq!(pool.reserved(), 4 * GIB - 12 * MIB);
    free(&mut pool, d);
    check(&sim, &pool);
}

#[test]
fn set_memory_fraction_caps_the_pool() {
    let (sim, mut pool) = torch();
    for bad in [-0.1, 1.5, f64::NAN] {
        assert!(matches!(
            pool.set_memory_fraction(bad),
            Err(AllocError::BadFraction(_))
        ));
    }
    pool.set_memory_fraction(0.25).unwrap();
    assert_eq!(pool.limit(), Some(GIB));
    let a = alloc(&mut pool, 900 * MIB, S0);
    let err = pool.allocate(200 * MIB, S0).unwrap_err();
    assert!(err.is_out_of_memory(), "{err:?}");
    free(&mut pool, a);
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
        free(&mut pool, a);
        let b_ptr = b.ptr();
        free(&mut pool, b);
        // b is found again and again (its age stays 0); a ages.
        for _ in 0..5 {
            let x = alloc(&mut pool, 14 * MIB, S0);
            assert_eq!(x.ptr(), b_ptr);
            free(&mut pool, x);
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
        assert_eq!(y.ptr(), b_ptr, "the young segment stayed cached");
        free(&mut pool, big);
        free(&mut pool, y);
        check(&sim, &pool);
    }
}

#[test]
fn garbage_collection_needs_a_limit() {
    let (sim, mut pool) = torch_with("garbage_collection_threshold:0.1");
    let a = alloc(&mut pool, 12 * MIB, S0);
    free(&mut pool, a);
    for _ in 0..5 {
        let x = alloc(&mut pool, 12 * MIB, S0);
        free(&mut pool, x);
    }
    let b = alloc(&mut pool, 40 * MIB, S0);
    assert_eq!(sim.calls(Call::Free), 0, "no limit: no garbage collection");
    free(&mut pool, b);
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
    free(&mut pool, c);
    assert_eq!(sim.outstanding_bytes(), 50 * MIB);
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(
        sim.outstanding_bytes(),
        34 * MIB,
        "only c's segment went back"
    );
    free(&mut pool, b);
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(sim.outstanding_bytes(), 14 * MIB);
    free(&mut pool, a);
    free(&mut pool, d);
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
    free(&mut pool, c);
    drop(pool);
    assert_eq!(sim.outstanding_bytes(), 0);
    assert_eq!(sim.live_events(), 0);
}

// ---- record_stream ------------------------------------------------------------------------------

#[test]
fn a_block_used_on_another_stream_waits_for_its_work() {
    let (sim, mut pool) = torch();
    sim.set_auto_complete(false);
    let a = alloc(&mut pool, 1000, S1);
    pool.record_stream(&a, S2).unwrap();
    // Recording the allocation's own stream, or the same stream twice, changes nothing.
    pool.record_stream(&a, S1).unwrap();
    pool.record_stream(&a, S2).unwrap();
    let a_ptr = a.ptr();
    free(&mut pool, a);
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
    assert_eq!(state(&pool, a_ptr), Some(BlockState::PendingEvents));
    let s = pool.stats();
    assert_eq!(s.allocation.current(PoolKind::Small), 0);
    assert_eq!(
        s.active.current(PoolKind::Small),
        1,
        "pending blocks are active"
    );

    let b = alloc(&mut pool, 1000, S1);
    assert_ne!(b.ptr(), a_ptr, "work on stream 2 has not completed");
    // Completing an unrelated stream changes nothing.
    sim.complete_stream(S1);
    let c = alloc(&mut pool, 1000, S1);
    assert!(c.ptr() != a_ptr && c.ptr() != b.ptr());
    sim.complete_stream(S2);
    // The event has completed, but only the next allocation processes it.
    assert_eq!(state(&pool, a_ptr), Some(BlockState::PendingEvents));
    let d = alloc(&mut pool, 1000, S1);
    assert_eq!(d.ptr(), a_ptr);
    assert_eq!(pool.pending_events(), 0);
    check(&sim, &pool);
    for x in [b, c, d] {
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
    pool.record_stream(&a, S2).unwrap();
    free(&mut pool, a);
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
    let stale = a.duplicate();
    free(&mut pool, a);
    assert!(pool.record_stream(&stale, S1).is_err());
    let ptr = stale.ptr();
    assert_eq!(pool.free(stale), Err(AllocError::NotAllocated(ptr)));
    let forged = Allocation::forge(b.ptr() + 512, b.size(), b.stream(), b.block(), b.serial());
    assert_eq!(
        pool.free(forged),
        Err(AllocError::NotAllocated(b.ptr() + 512))
    );
    free(&mut pool, b);
    check(&sim, &pool);
}

/// A free whose events cannot be recorded (the other stream it was used on turned out to be of
/// another device) gives the allocation back with `try_free`, still allocated, for the caller to
/// free again; `free` would have consumed it.
#[test]
fn try_free_gives_back_an_allocation_it_could_not_free() {
    let (sim, mut pool) = torch();
    let s2 = StreamId(2);
    let a = alloc(&mut pool, 4 * MIB, StreamId(1));
    let ptr = a.ptr();
    pool.record_stream(&a, s2).unwrap();
    sim.add_foreign_stream(s2);
    let e = pool.try_free(a).unwrap_err();
    let back = e.allocation.expect("the allocation comes back");
    assert_eq!(back.ptr(), ptr);
    assert_eq!(pool.stats().allocation.0[0].current, 1, "still allocated");
    pool.check_invariants().unwrap();
    assert!(!e.error.to_string().is_empty());
    // Still refused while the stream is foreign, and given back again.
    let again = pool.try_free(back).unwrap_err();
    assert!(again.allocation.is_some());
}
