//! Giant ranges of the `default` policy (`policy::default::giant`): under a memory cap, a
//! large-pool request of at least `GIANT_MIN_CHUNKS` chunk windows and `GIANT_MIN_BYTES` (without
//! one, `GIANT_UNCAPPED_MIN_CHUNKS` and `GIANT_UNCAPPED_MIN_BYTES`) that finds no cached block
//! grows on a virtual range of its own, mapped as one chunk; a free block there serves only a
//! giant request that leaves at most one window unused, whole (not after a cap is set with
//! `repage_under_cap` off), and the budget gives the giant blocks back before any other free
//! block, largest first, then the best fit for what they left; ordinary growth and a layout plan's footprint never go there; an
//! empty giant range serves the next giant growth that fits (the smallest) and the others are
//! released (not during a capture), their indices forgotten. Below the threshold, with the rule
//! off or, under a cap, `repage_under_cap` off, giant requests grow in the shared range, window
//! by window, as they do when a giant range cannot be reserved. The core's invariants hold after
//! every step.

use crate::common::{pool, steps};

use cudalloc::policy::default::{
    DefaultConfig, GIANT_MIN_BYTES, GIANT_MIN_CHUNKS, GIANT_UNCAPPED_MIN_BYTES,
    GIANT_UNCAPPED_MIN_CHUNKS,
};
use cudalloc::policy::PolicyConfig;
use cudalloc::{AllocError, Allocation, Config, Pool};
use cudalloc_sys::{Call, CaptureMode, SimConfig, SimDevice, StreamId};
use pool::{alloc, block_size, check, free, past_loading, Sim, GIB, MIB, S0, S1};
use std::sync::Arc;
use steps::{bert_batch, play};

/// The default chunk window.
const WINDOW: u64 = 40 * MIB;
/// The smallest giant request at the default window.
const GIANT: u64 = GIANT_MIN_CHUNKS * WINDOW;
const _: () = assert!(GIANT >= GIANT_MIN_BYTES);
/// The smallest giant request without a cap, at the default window.
const UNCAPPED_GIANT: u64 = GIANT_UNCAPPED_MIN_CHUNKS * WINDOW;
const _: () = assert!(UNCAPPED_GIANT >= GIANT_UNCAPPED_MIN_BYTES);

/// The `default` policy as the tests here use it: no layout plans, the widest fragmentation
/// budget (100%: what it caches is bounded by the limit alone), every rule on.
fn wide() -> DefaultConfig {
    DefaultConfig {
        fragmentation_budget: 1.0,
        layout_plans: false,
        ..DefaultConfig::default()
    }
}

/// A pool of `policy` past its loading on a 16 GiB device, capped at `limit` bytes.
fn pool_of(limit: Option<u64>, policy: DefaultConfig) -> (Sim, Pool<Sim>) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(16 * GIB)));
    let cfg = Config::default()
        .with_policy(PolicyConfig::Default(policy))
        .unwrap();
    let mut pool = Pool::new(sim.clone(), cfg);
    past_loading(&mut pool);
    pool.set_limit(limit);
    (sim, pool)
}

/// A pool of [`wide`] (see [`pool_of`]).
fn capped(limit: Option<u64>) -> (Sim, Pool<Sim>) {
    pool_of(limit, wide())
}

/// A pool of the plain `default` policy (2% budget) without layout plans, no cap.
fn plain() -> (Sim, Pool<Sim>) {
    let policy = DefaultConfig {
        layout_plans: false,
        ..DefaultConfig::default()
    };
    pool_of(None, policy)
}

/// Allocates `size` bytes on `stream`; returns the allocation and the bytes the budget gave
/// back for it.
fn given_back_for(pool: &mut Pool<Sim>, size: u64, stream: StreamId) -> (Allocation, u64) {
    let before = pool.reserved();
    let a = alloc(pool, size, stream);
    let given_back = before + block_size(pool, &a) - pool.reserved();
    (a, given_back)
}

/// The (first address, bytes) of the expandable range holding `a`.
fn range_of(pool: &Pool<Sim>, a: &Allocation) -> (u64, u64) {
    let snap = pool.snapshot();
    let s = snap
        .segments
        .iter()
        .find(|s| s.addr <= a.ptr() && a.ptr() < s.addr + s.size)
        .expect("a range holds the allocation");
    (s.addr, s.size)
}

/// Device calls of kind `call` made while `f` runs.
fn calls_in<T>(sim: &SimDevice, call: Call, f: impl FnOnce() -> T) -> (T, u64) {
    let before = sim.calls(call);
    let out = f();
    (out, sim.calls(call) - before)
}

#[test]
fn under_a_cap_a_giant_growth_is_one_chunk_on_a_range_of_its_own() {
    let (sim, mut pool) = capped(Some(8 * GIB));
    let small = alloc(&mut pool, 100 * MIB, S0);
    let size = GIANT + 30 * MIB; // 350 MiB: 9 windows in the shared range
    let (big, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, size, S0));
    assert_eq!(maps, 1, "one chunk");
    let (at, bytes) = range_of(&pool, &big);
    assert_eq!(at, big.ptr(), "the range starts with it");
    assert_eq!(bytes, 360 * MIB, "its pages, in whole windows");
    assert_ne!(range_of(&pool, &small).0, at, "not the shared range");
    check(&sim, &pool);
    // Given back in one unmap when the cap needs it.
    free(&mut pool, big);
    let (_, unmaps) = calls_in(&sim, Call::Unmap, || pool.empty_cache().unwrap());
    assert_eq!(
        unmaps, 1,
        "the small block's chunks are not empty: only the giant one goes"
    );
    free(&mut pool, small);
    check(&sim, &pool);
}

#[test]
fn without_a_cap_a_giant_growth_is_one_chunk_from_the_uncapped_size_on() {
    let mut off = DefaultConfig::default();
    off.rules.giant_ranges_uncapped = false;
    // (rules, request, on a range of its own)
    let cases = [
        (DefaultConfig::default(), UNCAPPED_GIANT, true),
        (DefaultConfig::default(), UNCAPPED_GIANT - WINDOW, false),
        (off, UNCAPPED_GIANT, false),
    ];
    for (i, (policy, size, own)) in cases.into_iter().enumerate() {
        let (sim, mut pool) = pool_of(None, policy);
        let small = alloc(&mut pool, 100 * MIB, S0);
        let (big, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, size, S0));
        let apart = range_of(&pool, &big) != range_of(&pool, &small);
        assert_eq!(apart, own, "case {i}");
        if own {
            assert_eq!(maps, 1, "case {i}: one chunk");
        } else {
            assert!(maps >= 15, "case {i}: {maps} maps, one per window");
        }
        free(&mut pool, big);
        free(&mut pool, small);
        check(&sim, &pool);
    }
}

/// The budget gives back a free giant block before the smallest free block that covers its
/// excess: one unmap, and only a request that nearly fills it could reuse it.
#[test]
fn the_budget_gives_back_a_giant_block_first() {
    for first in [true, false] {
        let mut policy = DefaultConfig {
            layout_plans: false,
            ..DefaultConfig::default()
        };
        policy.rules.give_back_giant_first = first;
        let (sim, mut pool) = pool_of(None, policy);
        let live = alloc(&mut pool, GIB, S0);
        let a = alloc(&mut pool, 100 * MIB, S0);
        let g = alloc(&mut pool, UNCAPPED_GIANT + 60 * MIB, S0);
        assert_ne!(range_of(&pool, &g), range_of(&pool, &live));
        free(&mut pool, a);
        free(&mut pool, g);
        // Another stream's 80 MiB passes the 2% budget by less than 100 MiB.
        let (other, given_back) = given_back_for(&mut pool, 80 * MIB, S1);
        let giant = UNCAPPED_GIANT + 60 * MIB;
        // Without the rule, the 100 MiB block (with its window's slack) goes.
        assert_eq!(given_back >= giant, first, "{given_back} bytes given back");
        assert!(
            given_back <= giant + WINDOW,
            "{given_back} bytes given back"
        );
        let (a, maps_a) = calls_in(&sim, Call::Map, || alloc(&mut pool, 100 * MIB, S0));
        assert_eq!(maps_a == 0, first, "the 100 MiB block cached");
        let g = alloc(&mut pool, giant, S0);
        for x in [live, a, g, other] {
            free(&mut pool, x);
        }
        check(&sim, &pool);
    }
}

#[test]
fn below_the_threshold_or_with_the_rule_off_a_giant_growth_maps_windows() {
    let mut off = wide();
    off.rules.giant_ranges = false;
    let mut no_repage = wide();
    no_repage.repage_under_cap = false;
    let cases = [
        (None, wide()),
        (Some(8 * GIB), off),
        (Some(8 * GIB), no_repage),
    ];
    for (i, (limit, policy)) in cases.into_iter().enumerate() {
        let (sim, mut pool) = pool_of(limit, policy);
        let small = alloc(&mut pool, 100 * MIB, S0);
        let (big, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, GIANT + 30 * MIB, S0));
        assert!(maps >= 8, "case {i}: {maps} maps");
        assert_eq!(range_of(&pool, &big), range_of(&pool, &small), "case {i}");
        free(&mut pool, big);
        free(&mut pool, small);
        check(&sim, &pool);
    }
}

/// With 2 MiB chunks a request is giant from 320 MiB on, not from eight chunks (16 MiB).
#[test]
fn with_small_chunks_a_giant_request_is_still_320_mib() {
    let mut small_chunks = wide();
    small_chunks.max_chunk = 2 * MIB;
    let (sim, mut pool) = pool_of(Some(8 * GIB), small_chunks);
    let (a, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, 100 * MIB, S0));
    assert_eq!(maps, 50, "2 MiB chunks");
    let (b, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, GIANT_MIN_BYTES, S0));
    assert_eq!(maps, 1, "a range of its own");
    assert_ne!(range_of(&pool, &a), range_of(&pool, &b));
    free(&mut pool, a);
    free(&mut pool, b);
    check(&sim, &pool);
}

#[test]
fn a_giant_block_serves_only_a_giant_request_that_nearly_fills_it() {
    let (sim, mut pool) = capped(Some(8 * GIB));
    let big = alloc(&mut pool, 400 * MIB, S0);
    let giant_at = big.ptr();
    free(&mut pool, big);
    // Smaller requests, giant or not, grow elsewhere and leave the giant block whole.
    for size in [100 * MIB, 340 * MIB] {
        let (a, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, size, S0));
        assert!(maps >= 1, "{size}: a growth, not the cached giant block");
        assert_ne!(range_of(&pool, &a).0, giant_at, "{size}");
        free(&mut pool, a);
        check(&sim, &pool);
    }
    // A giant request that leaves one window of it takes it whole, with no driver call; one
    // that would leave more grows elsewhere.
    let (a, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, 360 * MIB, S0));
    assert_eq!((a.ptr(), maps), (giant_at, 0));
    assert_eq!(block_size(&pool, &a), 400 * MIB, "not split");
    free(&mut pool, a);
    let (a, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, 360 * MIB - 512, S0));
    assert!(maps >= 1 && range_of(&pool, &a).0 != giant_at);
    free(&mut pool, a);
    check(&sim, &pool);
}

/// A giant range released (by `empty_cache` here) leaves the list: a shared range that gets its
/// index later serves its cached blocks to any request.
#[test]
fn a_released_giant_range_is_forgotten() {
    let (sim, mut pool) = capped(Some(8 * GIB));
    let big = alloc(&mut pool, 400 * MIB, S0);
    free(&mut pool, big);
    pool.empty_cache().unwrap();
    assert!(pool.snapshot().segments.is_empty());
    let a = alloc(&mut pool, 100 * MIB, S0);
    let at = a.ptr();
    free(&mut pool, a);
    let (b, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, 100 * MIB, S0));
    assert_eq!(
        (b.ptr(), maps),
        (at, 0),
        "the cached block of the shared range"
    );
    free(&mut pool, b);
    check(&sim, &pool);
}

/// A plan's footprint never goes to a giant range: while a cached giant block is the smallest
/// free block that holds it, the episodes go by best fit (the giant block stays whole); once
/// that block is taken again, the plan places them again.
#[test]
fn a_plan_places_its_episodes_outside_giant_ranges() {
    let mut planned = wide();
    planned.layout_plans = true;
    let (sim, mut pool) = pool_of(Some(8 * GIB), planned);
    let weights = alloc(&mut pool, 100 * MIB, S0);
    for _ in 0..3 {
        play(&sim, &mut pool, &bert_batch(12), 20 * MIB);
    }
    let big = alloc(&mut pool, 400 * MIB, S0);
    let giant = range_of(&pool, &big);
    free(&mut pool, big);
    let placed = pool.policy().planned_allocations();
    for _ in 0..3 {
        play(&sim, &mut pool, &bert_batch(12), 30 * MIB);
        let snap = pool.snapshot();
        let seg = snap.segments.iter().find(|s| s.addr == giant.0);
        assert!(
            seg.is_some_and(|s| s.blocks.len() == 1),
            "the giant block stays whole"
        );
    }
    assert_eq!(pool.policy().planned_allocations(), placed, "best fit");
    let big = alloc(&mut pool, 400 * MIB, S0);
    assert_eq!(range_of(&pool, &big), giant);
    for _ in 0..3 {
        play(&sim, &mut pool, &bert_batch(12), 30 * MIB);
    }
    let episode = bert_batch(12).len() as u64 / 2;
    let now = pool.policy().planned_allocations() - placed;
    assert!(now >= 2 * episode, "placed {now} of {}", 3 * episode);
    free(&mut pool, big);
    free(&mut pool, weights);
    check(&sim, &pool);
}

/// True when the pool holds a range of `bytes` bytes.
fn holds_range(pool: &Pool<Sim>, bytes: u64) -> bool {
    pool.snapshot().segments.iter().any(|s| s.size == bytes)
}

#[test]
fn an_empty_giant_range_serves_the_next_giant_growth_and_the_others_go() {
    let (sim, mut pool) = capped(Some(GIB));
    // A 400 MiB range, emptied by the cap when a 700 MiB tensor needs its bytes, then released:
    // 700 MiB do not fit in it.
    let a = alloc(&mut pool, 400 * MIB, S0);
    free(&mut pool, a);
    let b = alloc(&mut pool, 700 * MIB, S0);
    assert_eq!(range_of(&pool, &b), (b.ptr(), 720 * MIB));
    assert_eq!(sim.mapped_bytes(), 700 * MIB, "the 400 MiB chunk went back");
    assert!(!holds_range(&pool, 400 * MIB));
    check(&sim, &pool);
    // The cap empties the 720 MiB range for a 330 MiB tensor, which then grows there: no new
    // reservation, one map.
    free(&mut pool, b);
    let ((c, reserves), maps) = calls_in(&sim, Call::Map, || {
        calls_in(&sim, Call::Reserve, || alloc(&mut pool, 330 * MIB, S0))
    });
    assert_eq!(range_of(&pool, &c), (c.ptr(), 720 * MIB));
    assert_eq!((reserves, maps), (0, 1));
    check(&sim, &pool);
    // A 900 MiB tensor does not fit in it: emptied by the cap, it is released.
    free(&mut pool, c);
    let d = alloc(&mut pool, 900 * MIB, S0);
    assert!(!holds_range(&pool, 720 * MIB));
    let snap = pool.snapshot();
    let ranges: u64 = snap.segments.iter().map(|s| s.size).sum();
    assert_eq!(sim.reserved_va_bytes(), ranges, "no range outside the pool");
    free(&mut pool, d);
    check(&sim, &pool);
}

/// Of two empty giant ranges that hold a growth, the smaller serves it; the other is released.
#[test]
fn the_smallest_empty_giant_range_serves_and_the_other_goes() {
    let (sim, mut pool) = capped(Some(2 * GIB));
    let a = alloc(&mut pool, 400 * MIB, S0);
    let b = alloc(&mut pool, 700 * MIB, S0);
    let small = range_of(&pool, &a);
    free(&mut pool, a);
    free(&mut pool, b);
    // Under 400 MiB the cap gives both chunks back for a 350 MiB growth.
    pool.set_limit(Some(400 * MIB));
    let c = alloc(&mut pool, 350 * MIB, S0);
    assert_eq!((c.ptr(), range_of(&pool, &c)), (small.0, small));
    assert!(!holds_range(&pool, 720 * MIB));
    assert_eq!(sim.mapped_bytes(), 350 * MIB);
    free(&mut pool, c);
    check(&sim, &pool);
}

#[test]
fn during_a_capture_an_empty_giant_range_is_kept() {
    const CAP: StreamId = StreamId(5);
    let (sim, mut pool) = capped(None);
    pool.set_limit(Some(8 * GIB));
    // Ranges of 360 and 400 MiB; the second (the largest giant block goes back first) emptied
    // for an ordinary growth under a lower cap.
    let a = alloc(&mut pool, 330 * MIB, CAP);
    let b = alloc(&mut pool, 400 * MIB, CAP);
    free(&mut pool, a);
    free(&mut pool, b);
    pool.set_limit(Some(900 * MIB));
    let s = alloc(&mut pool, 300 * MIB, CAP);
    // 330 MiB and at most 320 (the growth's windows): the 400 MiB chunk went back.
    assert!(sim.mapped_bytes() <= 650 * MIB, "{}", sim.mapped_bytes());
    assert!(holds_range(&pool, 400 * MIB));
    pool.set_limit(Some(8 * GIB));
    // A giant growth that does not fit in it leaves it reserved during a capture...
    pool.begin_capture(CaptureMode::Global);
    sim.begin_capture(CAP, CaptureMode::Global).unwrap();
    let c = alloc(&mut pool, 500 * MIB, CAP);
    sim.end_capture(CAP).expect("no call the capture forbids");
    pool.end_capture(CaptureMode::Global).unwrap();
    assert!(holds_range(&pool, 400 * MIB));
    check(&sim, &pool);
    // ... and releases it outside one.
    let d = alloc(&mut pool, 600 * MIB, CAP);
    assert!(!holds_range(&pool, 400 * MIB));
    for x in [s, c, d] {
        free(&mut pool, x);
    }
    check(&sim, &pool);
}

/// A growth that first takes back its stream's pages on their way back takes back only a
/// block it may use: a 100 MiB request takes back the shared range's 600 MiB block, not the
/// smaller giant one (which best fit would then refuse, and new pages be mapped).
#[test]
fn a_growth_takes_back_only_a_releasing_block_it_may_use() {
    let (sim, mut pool) = pool_of(
        Some(8 * GIB),
        DefaultConfig {
            fragmentation_budget: 0.0,
            ..wide()
        },
    );
    let a1 = alloc(&mut pool, 300 * MIB, S0);
    let a2 = alloc(&mut pool, 300 * MIB, S0);
    let g = alloc(&mut pool, 400 * MIB, S0);
    let shared = range_of(&pool, &a1);
    assert_ne!(range_of(&pool, &g), shared);
    for a in [a1, a2, g] {
        free(&mut pool, a);
    }
    sim.set_auto_complete(false);
    // Another stream's 900 MiB passes the budget (no slack: 1,000 MiB) by 900 MiB: both cached
    // blocks start going back (the giant one first, then all of the 600 MiB one, whose tail
    // would leave less than four windows), and stay on their way.
    let other = alloc(&mut pool, 900 * MIB, S1);
    assert_eq!(pool.releasing_bytes(), 1000 * MIB);
    let (a, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, 100 * MIB, S0));
    assert_eq!((range_of(&pool, &a), maps), (shared, 0));
    assert_eq!(
        pool.releasing_bytes(),
        400 * MIB,
        "the giant block still on its way"
    );
    sim.complete_all();
    free(&mut pool, a);
    free(&mut pool, other);
    check(&sim, &pool);
}

/// A giant range that cannot be reserved (address space) leaves the request to ordinary
/// growth, in the shared range, within the same allocation.
#[test]
fn a_giant_range_that_cannot_be_reserved_falls_back_to_the_shared_range() {
    let (sim, mut pool) = capped(Some(8 * GIB));
    let small = alloc(&mut pool, 100 * MIB, S0);
    sim.fail_next(); // the range's reservation
    let (big, reserves) = calls_in(&sim, Call::Reserve, || alloc(&mut pool, GIANT, S0));
    assert_eq!(reserves, 1, "one reservation tried, none more");
    assert_eq!(range_of(&pool, &big), range_of(&pool, &small));
    for a in [small, big] {
        free(&mut pool, a);
    }
    check(&sim, &pool);
}

/// When a giant range cannot be reserved and ordinary growth then finds no memory either, the
/// error says out of memory: the failed reservation is not reported as address space.
#[test]
fn a_failed_giant_reservation_then_no_memory_is_out_of_memory() {
    let (sim, mut pool) = pool_of(None, DefaultConfig::default());
    let small = alloc(&mut pool, 100 * MIB, S0);
    sim.fail_every(1); // every acquiring call: the range's reservation, then the maps
    let r = pool.allocate(UNCAPPED_GIANT + 60 * MIB, S0);
    sim.clear_faults();
    assert!(matches!(r, Err(AllocError::OutOfMemory { .. })), "{r:?}");
    free(&mut pool, small);
    check(&sim, &pool);
}

/// Giant blocks go back largest first: each is one unmap, whatever its size, to give back and to
/// map again.
#[test]
fn giant_blocks_go_back_largest_first() {
    let (sim, mut pool) = plain();
    let live = alloc(&mut pool, GIB, S0);
    let g1 = alloc(&mut pool, UNCAPPED_GIANT + 60 * MIB, S0);
    let g2 = alloc(&mut pool, 2 * UNCAPPED_GIANT, S0);
    let big = block_size(&pool, &g2);
    free(&mut pool, g1);
    free(&mut pool, g2);
    // Another stream's 80 MiB passes the 2% budget by less than the smaller giant block.
    let (other, given_back) = given_back_for(&mut pool, 80 * MIB, S1);
    assert!(
        given_back >= big && given_back <= big + WINDOW,
        "{given_back} bytes"
    );
    for a in [live, other] {
        free(&mut pool, a);
    }
    check(&sim, &pool);
}

/// A cap set on a pool with `repage_under_cap` off stops a block of a giant range made before
/// it from serving (that pool promises single-page chunks); with it on, the block serves.
#[test]
fn after_a_cap_with_repage_off_a_giant_block_serves_no_request() {
    for repage in [true, false] {
        let policy = DefaultConfig {
            repage_under_cap: repage,
            ..wide()
        };
        let (sim, mut pool) = pool_of(None, policy);
        let g = alloc(&mut pool, UNCAPPED_GIANT + 60 * MIB, S0);
        let giant = range_of(&pool, &g);
        free(&mut pool, g);
        pool.set_limit(Some(8 * GIB));
        let a = alloc(&mut pool, UNCAPPED_GIANT + 30 * MIB, S0);
        assert_eq!(
            range_of(&pool, &a) == giant,
            repage,
            "repage_under_cap: {repage}"
        );
        free(&mut pool, a);
        check(&sim, &pool);
    }
}

/// After the giant blocks, best fit picks among the other blocks the smallest that covers what
/// the giant blocks left of the excess, not of the whole excess.
#[test]
fn after_the_giant_blocks_best_fit_covers_what_they_left() {
    let (sim, mut pool) = plain();
    // Below the uncapped giant size, in the shared range: 1,200 MiB live, then a 100 MiB and a
    // 600 MiB block between blocks in use; a 700 MiB giant block on a range of its own.
    let live = [0, 1].map(|_| alloc(&mut pool, 600 * MIB, S0));
    let a = alloc(&mut pool, 100 * MIB, S0);
    let sep1 = alloc(&mut pool, 10 * MIB, S0);
    let b = alloc(&mut pool, 600 * MIB, S0);
    let sep2 = alloc(&mut pool, 10 * MIB, S0);
    let g = alloc(&mut pool, UNCAPPED_GIANT + 60 * MIB, S0);
    assert_eq!(range_of(&pool, &a), range_of(&pool, &b));
    assert_ne!(range_of(&pool, &g), range_of(&pool, &b));
    for x in [a, b, g] {
        free(&mut pool, x);
    }
    // Another stream's 800 MiB passes the 2% budget by about 750 MiB: the giant block goes,
    // then the smallest block that covers the rest (100 MiB), not the largest (600 MiB), which
    // best fit against the whole excess would have left first in line.
    let other = alloc(&mut pool, 800 * MIB, S1);
    let (b, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, 600 * MIB, S0));
    assert_eq!(maps, 0, "the 600 MiB block stayed cached");
    let [l0, l1] = live;
    for x in [l0, l1, sep1, b, sep2, other] {
        free(&mut pool, x);
    }
    check(&sim, &pool);
}
