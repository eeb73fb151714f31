//! Giant ranges of the `default` policy (`policy::default::giant`): under a memory cap, a
//! large-pool request of at least `GIANT_MIN_CHUNKS` chunk windows that finds no cached block
//! grows on a virtual range of its own, mapped as one chunk; a free block there serves only a
//! giant request that leaves at most one window unused; ordinary growth never maps there; an
//! empty giant range serves the next giant growth that fits and the others are released (not
//! during a capture). Without a cap, or with the rule off, giant requests grow in the shared
//! range, window by window. The core's invariants hold after every step.

use crate::common::pool;

use cudalloc::policy::default::{DefaultConfig, Rules, GIANT_MIN_CHUNKS};
use cudalloc::policy::PolicyConfig;
use cudalloc::{Allocation, Config, Pool};
use cudalloc_sys::{Call, CaptureMode, SimConfig, SimDevice, StreamId};
use pool::{alloc, check, free, past_loading, Sim, GIB, MIB, S0};
use std::sync::Arc;

/// The default chunk window.
const WINDOW: u64 = 40 * MIB;
/// The smallest giant request at the default window.
const GIANT: u64 = GIANT_MIN_CHUNKS * WINDOW;

/// A `default` pool (no layout plans, `rules` as given) past its loading on a 16 GiB device,
/// capped at `limit` bytes. Its fragmentation budget is the widest (100%): what it caches is
/// bounded by the limit alone.
fn pool_ruled(limit: Option<u64>, rules: Rules) -> (Sim, Pool<Sim>) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(16 * GIB)));
    let policy = PolicyConfig::Default(DefaultConfig {
        fragmentation_budget: 1.0,
        layout_plans: false,
        rules,
        ..DefaultConfig::default()
    });
    let cfg = Config::default().with_policy(policy).unwrap();
    let mut pool = Pool::new(sim.clone(), cfg);
    past_loading(&mut pool);
    pool.set_limit(limit);
    (sim, pool)
}

/// [`pool_ruled`] with every rule on.
fn capped(limit: Option<u64>) -> (Sim, Pool<Sim>) {
    pool_ruled(limit, Rules::ALL)
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
fn without_a_cap_or_with_the_rule_off_a_giant_growth_maps_windows() {
    let mut off = Rules::ALL;
    off.giant_ranges = false;
    for (limit, rules) in [(None, Rules::ALL), (Some(8 * GIB), off)] {
        let (sim, mut pool) = pool_ruled(limit, rules);
        let small = alloc(&mut pool, 100 * MIB, S0);
        let (big, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, GIANT + 30 * MIB, S0));
        assert!(maps >= 8, "{limit:?}: {maps} maps");
        assert_eq!(range_of(&pool, &big), range_of(&pool, &small), "{limit:?}");
        free(&mut pool, big);
        free(&mut pool, small);
        check(&sim, &pool);
    }
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
    // A giant request within one window of it takes it, with no driver call.
    let (a, maps) = calls_in(&sim, Call::Map, || alloc(&mut pool, 370 * MIB, S0));
    assert_eq!((a.ptr(), maps), (giant_at, 0));
    free(&mut pool, a);
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

#[test]
fn during_a_capture_an_empty_giant_range_is_kept() {
    const CAP: StreamId = StreamId(5);
    let (sim, mut pool) = capped(None);
    pool.set_limit(Some(8 * GIB));
    // Ranges of 360 and 400 MiB; the first emptied for an ordinary growth under a lower cap.
    let a = alloc(&mut pool, 330 * MIB, CAP);
    let b = alloc(&mut pool, 400 * MIB, CAP);
    free(&mut pool, a);
    free(&mut pool, b);
    pool.set_limit(Some(900 * MIB));
    let s = alloc(&mut pool, 300 * MIB, CAP);
    // 400 MiB and at most 320 (the growth's windows): the 330 MiB chunk went back.
    assert!(sim.mapped_bytes() <= 720 * MIB, "{}", sim.mapped_bytes());
    assert!(holds_range(&pool, 360 * MIB));
    pool.set_limit(Some(8 * GIB));
    // A giant growth that does not fit in it leaves it reserved during a capture...
    pool.begin_capture(CaptureMode::Global);
    sim.begin_capture(CAP, CaptureMode::Global).unwrap();
    let c = alloc(&mut pool, 500 * MIB, CAP);
    sim.end_capture(CAP).expect("no call the capture forbids");
    pool.end_capture(CaptureMode::Global).unwrap();
    assert!(holds_range(&pool, 360 * MIB));
    check(&sim, &pool);
    // ... and releases it outside one.
    let d = alloc(&mut pool, 600 * MIB, CAP);
    assert!(!holds_range(&pool, 360 * MIB));
    for x in [s, c, d] {
        free(&mut pool, x);
    }
    check(&sim, &pool);
}
