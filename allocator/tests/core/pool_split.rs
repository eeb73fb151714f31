//! PyTorch's placement rules on the simulated device, through `Pool<Arc<SimDevice>>`: how a
//! request is split from a segment, how freed neighbours merge, which free block best fit picks.
//!
//! Checked (besides `Pool::check_invariants`, `SimDevice::check_invariants` and "device
//! outstanding bytes == reserved bytes" after every scenario step):
//! - split: a small request gets a 2 MiB segment and is split; a 1..10 MiB request gets a
//!   20 MiB segment and is split when more than 1 MiB remains; from 10 MiB a request gets a
//!   segment of its size rounded to 2 MiB;
//! - merge: freeing neighbours merges them into one free block;
//! - best fit: the smallest fitting block wins, ties go to the lower address; streams never share
//!   free blocks.
//!
//! What the pool gives back (oversize blocks, out of memory, `empty_cache`, `record_stream`) is
//! in `pool_release.rs`.

use crate::common::pool;
use cudalloc::sizes::PoolKind;
use cudalloc::snapshot::BlockState;
use cudalloc_sys::Call;
use pool::*;
use std::collections::BTreeSet;
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
    assert_eq!(b.ptr(), a.ptr() + 1024);
    assert_eq!(sim.calls(Call::Malloc), 1);
    check(&sim, &pool);
}

#[test]
fn zero_byte_request_gets_a_512_byte_block() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 0, S0);
    assert_eq!(a.size(), 0);
    assert_eq!(block_size(&pool, &a), 512);
    assert_eq!(pool.stats().requested_bytes.current(PoolKind::Small), 0);
    check(&sim, &pool);
    free(&mut pool, a);
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
    assert_eq!(pool_of(a.ptr()), (PoolKind::Small, 2 * MIB));
    assert_eq!(pool_of(b.ptr()), (PoolKind::Large, 20 * MIB));
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
    assert_eq!(more[0].ptr(), a.ptr() + 5 * MIB);
    assert_eq!(more[2].ptr(), a.ptr() + 15 * MIB);
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
        free(&mut pool, a);
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
    free(&mut pool, a);
    check(&sim, &pool);
    assert_eq!(
        layout(&pool),
        vec![(2 * MIB, vec![(1024, F), (1024, A), (1024, A), (rest, F)])]
    );
    assert_eq!(pool.stats().inactive_split.current(PoolKind::Small), 2);
    free(&mut pool, c);
    check(&sim, &pool);
    assert_eq!(
        layout(&pool),
        vec![(2 * MIB, vec![(1024, F), (1024, A), (rest + 1024, F)])]
    );
    free(&mut pool, b);
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
    let mut blocks: Vec<_> = (0..3)
        .map(|_| Some(alloc(&mut pool, 5 * MIB, S0)))
        .collect();
    for i in [1, 0, 2] {
        free(&mut pool, blocks[i].take().expect("live"));
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
    let base = x1.ptr();
    assert_eq!(
        (x2.ptr(), x3.ptr(), s3.ptr()),
        (base + 4608, base + 7168, base + 11264)
    );
    for x in [x1, x2, x3] {
        free(&mut pool, x);
    }
    check(&sim, &pool);
    // Free: 4096 @0, 2048 @4608, 4096 @7168, and the big rest @11776.
    let a = alloc(&mut pool, 1536, S0);
    assert_eq!(a.ptr(), base + 4608, "smallest fitting block (2048)");
    // The 2048 block was split: 512 bytes stay free at 6144.
    let b = alloc(&mut pool, 4096, S0);
    assert_eq!(b.ptr(), base, "tie between two 4096 blocks: lower address");
    let c = alloc(&mut pool, 4000, S0);
    assert_eq!(c.ptr(), base + 7168);
    let d = alloc(&mut pool, 100, S0);
    assert_eq!(d.ptr(), base + 6144, "the 512 B leftover of the split");
    let e = alloc(&mut pool, 100, S0);
    assert_eq!(e.ptr(), base + 11776, "only the big rest is left");
    assert_eq!(sim.calls(Call::Malloc), 1);
    check(&sim, &pool);
}

#[test]
fn best_fit_in_the_large_pool() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 12 * MIB, S0);
    let b = alloc(&mut pool, 14 * MIB, S0);
    let c = alloc(&mut pool, 16 * MIB, S0);
    let (a_ptr, b_ptr, c_ptr) = (a.ptr(), b.ptr(), c.ptr());
    for x in [c, a, b] {
        free(&mut pool, x);
    }
    let x = alloc(&mut pool, 13 * MIB, S0);
    assert_eq!(x.ptr(), b_ptr);
    assert_eq!(
        block_size(&pool, &x),
        14 * MIB,
        "1 MiB rest is not split off"
    );
    let y = alloc(&mut pool, 11 * MIB, S0);
    assert_eq!(y.ptr(), a_ptr);
    let z = alloc(&mut pool, 2 * MIB, S0);
    assert_eq!(z.ptr(), c_ptr, "only the 16 MiB block is left; it is split");
    assert_eq!(block_size(&pool, &z), 2 * MIB);
    assert_eq!(sim.calls(Call::Malloc), 3);
    check(&sim, &pool);
}

// ---- streams ------------------------------------------------------------------------------------

#[test]
fn a_block_freed_on_one_stream_is_not_reused_by_another() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 1000, S1);
    let a_ptr = a.ptr();
    free(&mut pool, a);
    let b = alloc(&mut pool, 1000, S2);
    assert_ne!(b.ptr(), a_ptr);
    assert_eq!(sim.calls(Call::Malloc), 2, "stream 2 needs its own segment");
    let c = alloc(&mut pool, 1000, S1);
    assert_eq!(c.ptr(), a_ptr, "stream 1 gets its block back");
    let x = alloc(&mut pool, 12 * MIB, S1);
    let x_ptr = x.ptr();
    free(&mut pool, x);
    let y = alloc(&mut pool, 12 * MIB, S2);
    assert_ne!(y.ptr(), x_ptr);
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
