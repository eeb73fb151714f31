//! The pool's statistics and fragmentation figures on the simulated device (testing tier 1).
//!
//! Invariants checked: every key of `torch.cuda.memory_stats()` is present; `current` equals
//! allocated minus freed; peaks reset to current; `Snapshot::fragmentation` figures on
//! hand-made and real snapshots.

use crate::common::pool;
use cudalloc::sizes::PoolKind;
use cudalloc::snapshot::{BlockInfo, BlockState, Excess, PinnedUnit, SegmentInfo};
use cudalloc::{Allocation, Config, Pool, Snapshot, Stats};
use cudalloc_sys::Device;
use pool::*;
use std::collections::{BTreeSet, HashMap};
use BlockState::{Allocated as A, Free as F};

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
    free(&mut pool, a);
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
    free(&mut pool, b);
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
    for x in xs.into_iter().step_by(2) {
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
    free(&mut pool, b);
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
    free(&mut pool, a);
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
        stray: 0,
        pool: PoolKind::Small,
        stream: S0,
        expandable: false,
        tag: None,
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
        stray: 0,
        pool: PoolKind::Large,
        stream: S0,
        expandable: true,
        tag: None,
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
    free(&mut pool, x1);
    free(&mut pool, x2);
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

/// The parts of `Pool::excess` add up to the reserved bytes.
fn assert_adds_up(e: &Excess) {
    assert_eq!(
        e.live + e.rounding + e.pending + e.releasable + e.pinned,
        e.reserved,
        "{e:?}"
    );
}

#[test]
fn excess_of_expandable_chunks_splits_free_bytes_by_whole_chunks() {
    // 2 MiB chunks, and a request's growth is not extended (2% of 10 MiB is under a page).
    let (sim, mut pool) = default_with_page_chunks();
    let a = alloc(&mut pool, 10 * MIB, S0);
    let _b = alloc(&mut pool, 10 * MIB, S0);
    free(&mut pool, a);
    check(&sim, &pool);
    let e = pool.excess();
    assert_eq!(
        (e.live, e.releasable, e.pinned),
        (10 * MIB, 10 * MIB, 0),
        "{e:?}"
    );
    // 3 MiB in the freed hole: the chunk it ends in is shared, the three after it are whole.
    let _c = alloc(&mut pool, 3 * MIB, S0);
    check(&sim, &pool);
    let e = pool.excess();
    assert_eq!(
        (e.live, e.releasable, e.pinned),
        (13 * MIB, 6 * MIB, MIB),
        "{e:?}"
    );
    assert_eq!(e.reserved, 20 * MIB);
    assert_adds_up(&e);
}

#[test]
fn excess_of_malloc_segments_counts_only_unsplit_free_segments_as_releasable() {
    let (sim, mut pool) = torch();
    let big = alloc(&mut pool, 30 * MIB, S0);
    let _small = alloc(&mut pool, 1000, S0);
    free(&mut pool, big);
    check(&sim, &pool);
    let e = pool.excess();
    // The 30 MiB segment is free and whole; the small pool's 2 MiB segment holds one 1 KiB
    // block (1,000 bytes rounded up to 1,024).
    assert_eq!(e.releasable, 30 * MIB);
    assert_eq!((e.live, e.rounding), (1000, 24));
    assert_eq!(e.pinned, 2 * MIB - 1024);
    assert_adds_up(&e);
}

#[test]
fn excess_counts_blocks_waiting_for_other_streams_as_pending() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 4 * MIB, S0);
    pool.record_stream(&a, S1).unwrap();
    free(&mut pool, a);
    let e = pool.excess();
    assert_eq!((e.live, e.pending), (0, 4 * MIB), "{e:?}");
    assert_adds_up(&e);
    sim.synchronize_device().unwrap();
    let _ = alloc(&mut pool, 512, S0); // processes the finished events
    let e = pool.excess();
    assert_eq!(e.pending, 0, "{e:?}");
    assert_adds_up(&e);
    check(&sim, &pool);
}

#[test]
fn excess_pins_a_chunk_that_reaches_past_the_free_block() {
    let (sim, mut pool) = default_with_page_chunks();
    // 9 MiB maps five 2 MiB chunks; the 10 MiB after it starts in the fifth and ends in the
    // tenth, which keeps 1 MiB free at its end.
    let (e, _b) = excess_after_freeing_the_first(&sim, &mut pool, 9 * MIB, 10 * MIB);
    // Free: 0..9 MiB (chunks 0..8 whole, 8..10 shared with b) and 19..20 MiB (shared with b).
    assert_eq!(
        (e.live, e.releasable, e.pinned),
        (10 * MIB, 8 * MIB, 2 * MIB),
        "{e:?}"
    );
}

#[test]
fn excess_counts_the_whole_pages_of_pinned_bytes_apart() {
    let (sim, mut pool) = default_with_8_mib_chunks();
    // `a` maps the chunk at 0..4 MiB (no slack: the budget leaves no room); `b` starts in its
    // last page and maps 4..8 and 8..16 MiB. With `a` gone, 0..3 MiB is free but pinned by `b`'s
    // first bytes: 2 MiB of it a whole page (which a chunk per page would give back), 1 MiB in
    // the page `b` touches.
    let (e, b) = excess_after_freeing_the_first(&sim, &mut pool, 3 * MIB, 13 * MIB);
    assert_eq!(
        (e.releasable, e.pinned, e.pinned_pages),
        (0, 3 * MIB, 2 * MIB),
        "{e:?}"
    );
    free(&mut pool, b);
    let e = pool.excess();
    assert_eq!(
        (e.releasable, e.pinned, e.pinned_pages),
        (16 * MIB, 0, 0),
        "{e:?}"
    );
}

#[test]
fn excess_counts_whole_pages_beside_a_whole_chunk_as_pinned_pages() {
    let (sim, mut pool) = default_with_8_mib_chunks();
    // `a` maps the chunks 0..8 and 8..12 MiB; `b` (11..13 MiB) starts in the last page of the
    // second and maps 12..14. With `a` gone, 0..11 MiB is free: the first chunk whole
    // (releasable), and 8..11 MiB pinned by `b`, 2 MiB of it the page 8..10; 13..14 MiB, the
    // rest of `b`'s last page, is pinned too.
    let (e, b) = excess_after_freeing_the_first(&sim, &mut pool, 11 * MIB, 2 * MIB);
    assert_eq!(
        (e.releasable, e.pinned, e.pinned_pages),
        (8 * MIB, 4 * MIB, 2 * MIB),
        "{e:?}"
    );
    free(&mut pool, b);
}

#[test]
fn excess_counts_device_pages_inside_torch_expandables_20_mib_units() {
    let (sim, mut pool) = pool_with(Config::parse("policy:torch-expandable").unwrap(), 4 * GIB);
    // A 20 MiB unit holding a 3 MiB block: 17 MiB free beside it, pinned; 16 MiB of it whole
    // 2 MiB pages (4..20 MiB), which a chunk per device page would give back.
    let a = alloc(&mut pool, 3 * MIB, S0);
    check(&sim, &pool);
    let e = pool.excess();
    assert_eq!((e.pinned, e.pinned_pages), (17 * MIB, 16 * MIB), "{e:?}");
    free(&mut pool, a);
}

#[test]
fn excess_of_malloc_segments_has_no_pinned_pages() {
    let (sim, mut pool) = torch();
    let a = alloc(&mut pool, 4 * MIB, S0);
    let _b = alloc(&mut pool, 4 * MIB, S0);
    free(&mut pool, a);
    check(&sim, &pool);
    let e = pool.excess();
    // One 20 MiB segment: 16 MiB free beside `_b`, none of it in pages a policy could unmap.
    assert_eq!((e.pinned, e.pinned_pages), (16 * MIB, 0), "{e:?}");
}

#[test]
fn pinning_names_the_chunks_a_live_block_shares_with_free_bytes() {
    let (sim, mut pool) = default_with_page_chunks();
    // As above: after `a` goes, the chunks at 8..10 MiB (1 MiB free beside `b`) and 18..20 MiB
    // (1 MiB free after `b`) pin 2 MiB; the four whole chunks below 8 MiB are not listed.
    let a = alloc(&mut pool, 9 * MIB, S0);
    let b = alloc(&mut pool, 10 * MIB, S0);
    let a_ptr = a.ptr();
    free(&mut pool, a);
    check(&sim, &pool);
    let units = pool.pinning();
    let chunk_at = |offset: u64| PinnedUnit {
        chunk: true,
        addr: a_ptr + offset,
        size: 2 * MIB,
        pinned: MIB,
        holders: 1,
        largest: (b.ptr(), 10 * MIB),
    };
    assert_eq!(units, [chunk_at(8 * MIB), chunk_at(18 * MIB)]);
    assert_eq!(
        units.iter().map(|u| u.pinned).sum::<u64>(),
        pool.excess().pinned
    );
    free(&mut pool, b);
    assert!(
        pool.pinning().is_empty(),
        "nothing is pinned once nothing is live"
    );
}

#[test]
fn pinning_of_malloc_segments_lists_split_segments_with_free_bytes() {
    let (sim, mut pool) = pool_with(Config::parse("policy:torch").unwrap(), 4 * GIB);
    // Two 4 MiB requests share one 20 MiB segment: 12 MiB of it stay free, pinned by both.
    let a = alloc(&mut pool, 4 * MIB, S0);
    let b = alloc(&mut pool, 4 * MIB, S0);
    check(&sim, &pool);
    let units = pool.pinning();
    assert_eq!(units.len(), 1, "{units:?}");
    let u = units[0];
    assert_eq!(
        (u.chunk, u.size, u.pinned, u.holders),
        (false, 20 * MIB, 12 * MIB, 2)
    );
    assert_eq!(u.pinned, pool.excess().pinned);
    free(&mut pool, a);
    free(&mut pool, b);
    assert!(
        pool.pinning().is_empty(),
        "an unsplit free segment can go back"
    );
}

#[test]
fn pinning_counts_a_block_waiting_for_another_stream_as_a_holder() {
    let (sim, mut pool) = default_with_page_chunks();
    // `a` (9 MiB) is freed while stream 1 may still use it: the 1 MiB after it in its fifth
    // chunk stays pinned, and the block waiting for events holds it.
    let a = alloc(&mut pool, 9 * MIB, S0);
    let b = alloc(&mut pool, 10 * MIB, S0);
    free(&mut pool, b);
    pool.record_stream(&a, S1).unwrap();
    let a_ptr = a.ptr();
    free(&mut pool, a);
    let e = pool.excess();
    assert_eq!((e.live, e.pending, e.pinned), (0, 9 * MIB, MIB), "{e:?}");
    let units = pool.pinning();
    assert_eq!(units.len(), 1, "{units:?}");
    let u = units[0];
    assert_eq!(
        (u.addr - a_ptr, u.pinned, u.holders, u.largest),
        (8 * MIB, MIB, 1, (a_ptr, 9 * MIB))
    );
    check(&sim, &pool);
}

/// A `default` pool whose chunks are single 2 MiB pages.
/// Allocates `first` then `second` bytes (the second right after the first), frees the first,
/// and returns the breakdown then, with the second allocation.
fn excess_after_freeing_the_first(
    sim: &Sim,
    pool: &mut Pool<Sim>,
    first: u64,
    second: u64,
) -> (Excess, Allocation) {
    let a = alloc(pool, first, S0);
    let b = alloc(pool, second, S0);
    assert_eq!(b.ptr() - a.ptr(), first);
    free(pool, a);
    check(sim, pool);
    let e = pool.excess();
    assert_adds_up(&e);
    (e, b)
}

fn default_with_8_mib_chunks() -> (Sim, Pool<Sim>) {
    let (sim, mut pool) = pool_with(
        Config::parse("policy:default,max_chunk_mb:8").unwrap(),
        4 * GIB,
    );
    past_loading(&mut pool);
    (sim, pool)
}

fn default_with_page_chunks() -> (Sim, Pool<Sim>) {
    let (sim, mut pool) = pool_with(
        Config::parse("policy:default,max_chunk_mb:2").unwrap(),
        4 * GIB,
    );
    past_loading(&mut pool);
    (sim, pool)
}
