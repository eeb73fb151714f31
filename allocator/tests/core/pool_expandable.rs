//! The expandable policies (`torch-expandable`, `default`) on the simulated device (testing
//! tier 1).
//!
//! Invariants checked: growth maps pages, a freed block at the end merges, `empty_cache` unmaps
//! whole pages, `reserved_bytes` equals the device's mapped bytes, and everything goes back to
//! the device when all is freed; a request no device can hold is an error, never a panic.

use crate::common::pool;
use cudalloc::sizes::PoolKind;
use cudalloc::snapshot::BlockState;
use cudalloc::{AllocError, Config, Policy, Pool};
use cudalloc_sys::{Call, SimConfig, SimDevice, StreamId};
use pool::*;
use BlockState::{Allocated as A, Free as F};

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
        assert_eq!(w[1].ptr(), w[0].ptr() + 5 * MIB);
    }
    // The fifth maps the next page, right after the first.
    let maps = sim.calls(Call::Map);
    let e = alloc(&mut pool, 5 * MIB, S0);
    check_exp(&sim, &pool);
    assert_eq!(e.ptr(), xs[3].ptr() + 5 * MIB, "the segment grows in place");
    assert_eq!(sim.mapped_bytes(), 42 * MIB);
    assert_eq!(sim.calls(Call::Map), maps + 1);
    // Freed at the end, it merges with the free rest of its page...
    free(&mut pool, e);
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
    free(&mut pool, big);
    free(&mut pool, a);
    for x in xs {
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
    free(&mut pool, a);
    pool.empty_cache().unwrap();
    check_exp(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 40 * MIB);
    free(&mut pool, b);
    pool.empty_cache().unwrap();
    check_exp(&sim, &pool);
    assert_eq!(sim.mapped_bytes(), 0);
}

#[test]
fn default_policy_maps_pages_in_chunks_and_unmaps_them() {
    let (sim, mut pool) = pool_with(Config::for_policy(Policy::Default), 4 * GIB);
    past_loading(&mut pool);
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
        c.ptr(),
        b.ptr() + 5 * MIB,
        "the free 1 MiB after b is the start of the run"
    );
    // Freeing and allocating the same size again maps nothing new.
    free(&mut pool, b);
    let maps = sim.calls(Call::Map);
    let b2 = alloc(&mut pool, 5 * MIB, S0);
    assert_eq!(sim.calls(Call::Map), maps);
    check_exp(&sim, &pool);
    // Everything freed and emptied: nothing mapped, nothing reserved.
    for x in [a, b2, c] {
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
        let a_ptr = a.ptr();
        free(&mut pool, a);
        let b = alloc(&mut pool, 1000, S1);
        assert_ne!(b.ptr(), a_ptr, "{policy:?}: other stream");
        let c = alloc(&mut pool, 1000, S0);
        assert_eq!(c.ptr(), a_ptr, "{policy:?}: same stream");
        live.push(b);
        live.push(c);
        for x in live {
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
        free(&mut pool, a);
        let b = alloc(&mut pool, 60 * MIB, S0);
        free(&mut pool, b);
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
                    Err(AllocError::OutOfMemory { .. }) | Err(AllocError::TooLarge { .. })
                ),
                "{policy:?} size {size}: {r:?}"
            );
            check(&sim, &pool);
        }
        let a = alloc(&mut pool, MIB, S0);
        free(&mut pool, a);
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
    free(&mut pool, a);
    empty_and_drop(&sim, pool);
}

#[test]
fn a_segment_unmapped_by_the_budget_is_unreserved_on_drop() {
    // default policy: stream 1's cached page is unmapped by the fragmentation budget when
    // stream 0 grows; stream 1's segment is then wholly unmapped and must still be given back.
    let (sim, mut pool) = pool_with(Config::for_policy(Policy::Default), 4 * GIB);
    let a = alloc(&mut pool, 1, S1);
    free(&mut pool, a);
    let b = alloc(&mut pool, 1, S0);
    free(&mut pool, b);
    empty_and_drop(&sim, pool);
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
        free(&mut pool, a);
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

/// Empties the pool's cache, checks the device holds no memory, drops the pool and checks that no
/// virtual range is left reserved.
fn empty_and_drop(sim: &Sim, mut pool: Pool<Sim>) {
    pool.empty_cache().unwrap();
    assert_eq!(sim.outstanding_bytes(), 0);
    drop(pool);
    assert_eq!(
        sim.reserved_va_bytes(),
        0,
        "virtual address reservation leaked"
    );
}

// ---- address space ------------------------------------------------------------------------------

/// Found while fuzzing the replayer with many streams (`docs/guarantees.md`): an expandable
/// segment reserved 1.125 x the device's memory per stream and pool, so on the simulated H200
/// (2^46 bytes of address space) the 415th stream failed with an out-of-memory error that
/// reported 139 GiB free. `default` now reserves an eighth of the device per large-pool range
/// and a 64th per small-pool range (another when a stream fills one), and running out of
/// address space is its own error.
#[test]
fn three_thousand_streams_under_default_and_a_clear_error_under_torch_expandable() {
    let h200 = || SimDevice::new(SimConfig::with_capacity(143_771 * MIB));
    let mut pool = Pool::new(h200(), Config::for_policy(Policy::Default));
    let mut live = Vec::new();
    for s in 1..=3_000u64 {
        for size in [512, 3 * MIB] {
            live.push(
                pool.allocate(size, StreamId(s))
                    .expect("address space for 3,000 streams"),
            );
        }
    }
    for a in live {
        pool.free(a).unwrap();
    }
    pool.check_invariants().unwrap();

    let mut pool = Pool::new(h200(), Config::for_policy(Policy::TorchExpandable));
    let err = (1..=1_000u64)
        .find_map(|s| pool.allocate(3 * MIB, StreamId(s)).err())
        .expect("PyTorch's 1.125 x reservations run out of address space");
    assert!(
        matches!(err, AllocError::AddressSpace { ranges, .. } if ranges > 400),
        "{err:?}"
    );
    assert!(err.is_out_of_memory());
    assert!(err.to_string().contains("address space"), "{err}");
}

/// A request larger than an eighth of the device gets a range of its own size under `default`.
#[test]
fn default_reserves_a_range_large_enough_for_a_big_request() {
    let mut pool = Pool::new(
        SimDevice::new(SimConfig::with_capacity(8 * GIB)),
        Config::for_policy(Policy::Default),
    );
    let small = pool.allocate(100 * MIB, StreamId(0)).unwrap();
    let big = pool.allocate(5 * GIB, StreamId(0)).unwrap();
    let more = pool.allocate(900 * MIB, StreamId(0)).unwrap();
    for a in [small, big, more] {
        pool.free(a).unwrap();
    }
    pool.check_invariants().unwrap();
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved(), 0);
}
