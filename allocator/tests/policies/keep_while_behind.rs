//! `keep_while_behind` (`policy::default::budget`): without a memory cap, pages the budget gives
//! back for a growth that the device has not caught up with (their stream's work still queued)
//! are taken back into the cache, where the next requests of their stream find them, and until a
//! give-back completes at once the policy is *behind*: no giant range is made, and giant blocks
//! serve any request of the capped giant size by best fit (never a smaller one, which would pin the
//! range's one chunk); a give-back that completes at once, or a cap, ends that.
//! `Stats::given_back_bytes` and `Stats::taken_back_bytes` count both sides. Run
//! with `SimDevice::set_auto_complete(false)`, so that work completes only when the test says.
//! The core's invariants hold after every step.

use crate::common::pool;

use cudalloc::policy::default::{DefaultConfig, GIANT_MIN_CHUNKS, GIANT_UNCAPPED_MIN_CHUNKS};
use cudalloc::snapshot::BlockState;
use cudalloc::{Allocation, Pool};
use cudalloc_sys::Call;
use pool::{alloc, check, free, Sim, GIB, MIB, S0};

/// The default chunk window.
const WINDOW: u64 = 40 * MIB;

/// A pool of `default` (no layout plans, no `move_pages`, whose tests are `move_pages.rs`;
/// `keep_while_behind` as `keep`, and `max_chunk`, `budget` as given) past its loading on a 16 GiB
/// device whose work completes only when told.
fn lagging(keep: bool, max_chunk: u64, budget: f64) -> (Sim, Pool<Sim>) {
    let mut d = DefaultConfig {
        max_chunk,
        fragmentation_budget: budget,
        layout_plans: false,
        ..DefaultConfig::default()
    };
    d.rules.keep_while_behind = keep;
    d.rules.move_pages = false;
    pool::behind(d)
}

/// The free blocks of the pool, as (address, size).
fn free_blocks(pool: &Pool<Sim>) -> Vec<(u64, u64)> {
    let snap = pool.snapshot();
    let blocks = snap.segments.iter().flat_map(|s| s.blocks.iter());
    blocks
        .filter(|b| b.state == BlockState::Free)
        .map(|b| (b.addr, b.size))
        .collect()
}

/// A 30 MiB and a 6 MiB free block, each before a live 2 MiB block (2 MiB chunks, a 75% budget):
/// a 34 MiB growth then passes the budget by 4 MiB, and the 6 MiB block is the one the budget
/// gives back. Returns the 6 MiB block's address and the live blocks.
fn layout_with_excess(pool: &mut Pool<Sim>) -> (u64, [Allocation; 2]) {
    let large = alloc(pool, 30 * MIB, S0);
    let k1 = alloc(pool, 2 * MIB, S0);
    let small = alloc(pool, 6 * MIB, S0);
    let k2 = alloc(pool, 2 * MIB, S0);
    let small_ptr = small.ptr();
    free(pool, large);
    free(pool, small);
    (small_ptr, [k1, k2])
}

/// [`layout_with_excess`] (`async_release.rs` has it with the rule off: the 6 MiB block's pages
/// then stay on their way back until the device catches up). With the rule, they stay cached and
/// serve the next 6 MiB request.
#[test]
fn pages_the_device_still_holds_stay_cached_and_serve_the_next_request() {
    for keep in [true, false] {
        let (sim, mut pool) = lagging(keep, 2 * MIB, 0.75);
        let (small_ptr, [k1, k2]) = layout_with_excess(&mut pool);
        let unmaps = sim.calls(Call::Unmap);
        let (given, taken) = (pool.stats().given_back_bytes, pool.stats().taken_back_bytes);
        let grown = alloc(&mut pool, 34 * MIB, S0);
        check(&sim, &pool);
        // Given back either way; taken back into the cache with the rule.
        assert_eq!(pool.stats().given_back_bytes - given, 6 * MIB);
        let taken = pool.stats().taken_back_bytes - taken;
        assert_eq!(taken, if keep { 6 * MIB } else { 0 }, "keep {keep}");
        assert_eq!(
            sim.calls(Call::Unmap),
            unmaps,
            "keep {keep}: unmapped too soon"
        );
        let cached = free_blocks(&pool).contains(&(small_ptr, 6 * MIB));
        assert_eq!(cached, keep, "keep {keep}: {:?}", free_blocks(&pool));
        assert_eq!(pool.releasing_bytes(), if keep { 0 } else { 6 * MIB });
        let again = alloc(&mut pool, 6 * MIB, S0);
        assert_eq!(again.ptr() == small_ptr, keep, "keep {keep}");
        check(&sim, &pool);
        sim.complete_all();
        for a in [grown, again, k1, k2] {
            free(&mut pool, a);
        }
        pool.empty_cache().unwrap();
        check(&sim, &pool);
        assert_eq!(sim.mapped_bytes(), 0);
    }
}

/// With the device keeping up, the rule changes nothing: the pages go at once.
#[test]
fn with_the_device_keeping_up_the_budget_gives_back_as_before() {
    let (sim, mut pool) = lagging(true, 2 * MIB, 0.75);
    sim.set_auto_complete(true);
    let (_small, _keep) = layout_with_excess(&mut pool);
    let unmaps = sim.calls(Call::Unmap);
    let _grown = alloc(&mut pool, 34 * MIB, S0);
    check(&sim, &pool);
    assert_eq!(
        sim.calls(Call::Unmap) - unmaps,
        3,
        "the 6 MiB block's chunks"
    );
    assert_eq!(pool.releasing_bytes(), 0);
}

/// A giant block (a range of its own) is given back for a growth the device is behind on, and
/// taken back: behind, a request below the capped giant size (eight windows; below by three
/// quarters or by a page) maps pages of its own beside it (placed in the giant block, it would pin
/// the range's one chunk for as long as it lives), a request of that size takes the block by best
/// fit (split: the rest stays free in the range),
/// and a giant request grows in the shared range, window by window. Without the rule the block
/// stays on its way back, both requests map new pages, and the giant one gets a range of its own.
#[test]
fn behind_no_giant_range_is_made_and_giant_blocks_serve_any_giant_request() {
    let giant = GIANT;
    for keep in [true, false] {
        let (sim, mut pool) = lagging(keep, WINDOW, 0.02);
        let g = alloc(&mut pool, giant, S0);
        let g_range = g.ptr()..g.ptr() + giant;
        free(&mut pool, g);
        // Beside the cached giant block the budget (2% of its size) has no room: the giant block
        // goes back, and the device has not caught up with it.
        let x = alloc(&mut pool, 5 * WINDOW, S0);
        check(&sim, &pool);
        // Below the capped giant size (eight windows), by a window or by a page: out.
        let mut small = Vec::new();
        for size in [3 * WINDOW, GIANT_MIN_CHUNKS * WINDOW - 2 * MIB] {
            let maps = sim.calls(Call::Map);
            let a = alloc(&mut pool, size, S0);
            check(&sim, &pool);
            assert!(
                !g_range.contains(&a.ptr()),
                "keep {keep}: a request of {size} stays out of the giant block"
            );
            assert!(sim.calls(Call::Map) > maps, "keep {keep}: it maps its own");
            small.push(a);
        }
        let maps = sim.calls(Call::Map);
        let y = alloc(&mut pool, GIANT_MIN_CHUNKS * WINDOW + WINDOW, S0);
        check(&sim, &pool);
        assert_eq!(
            y.ptr() == g_range.start,
            keep,
            "keep {keep}: the giant block serves a giant-sized request"
        );
        assert_eq!(
            sim.calls(Call::Map) == maps,
            keep,
            "keep {keep}: no map for it"
        );
        let rest_in_range = free_blocks(&pool)
            .iter()
            .any(|&(addr, _)| g_range.contains(&addr));
        assert_eq!(
            rest_in_range, keep,
            "keep {keep}: split, its rest stays free"
        );
        let maps = sim.calls(Call::Map);
        let z = alloc(&mut pool, giant + 2 * WINDOW, S0);
        check(&sim, &pool);
        let z_maps = sim.calls(Call::Map) - maps;
        assert_eq!(
            z_maps > 1,
            keep,
            "keep {keep}: {z_maps} maps for the giant request"
        );
        sim.complete_all();
        for a in small.into_iter().chain([x, y, z]) {
            free(&mut pool, a);
        }
        pool.empty_cache().unwrap();
        check(&sim, &pool);
        assert_eq!(sim.mapped_bytes(), 0);
    }
}

/// A giant request past the uncapped threshold.
const GIANT: u64 = GIANT_UNCAPPED_MIN_CHUNKS * WINDOW + 60 * MIB;

/// A pool of the rule on 40 MiB windows and a 2% budget, made behind: a [`GIANT`] block freed,
/// then a growth beside it that the budget has no room for gives it back, to a device that has
/// not caught up, and takes it back. Returns the device, the pool and that growth's allocation.
fn made_behind() -> (Sim, Pool<Sim>, Allocation) {
    let (sim, mut pool) = lagging(true, WINDOW, 0.02);
    let g = alloc(&mut pool, GIANT, S0);
    free(&mut pool, g);
    let x = alloc(&mut pool, 5 * WINDOW, S0);
    assert_eq!(
        pool.releasing_bytes(),
        0,
        "behind: the giant block was taken back"
    );
    (sim, pool, x)
}

/// Frees `live`, lets the device catch up and empties the cache: nothing stays mapped.
fn finish(sim: &Sim, mut pool: Pool<Sim>, live: impl IntoIterator<Item = Allocation>) {
    sim.complete_all();
    for a in live {
        free(&mut pool, a);
    }
    pool.empty_cache().unwrap();
    check(sim, &pool);
    assert_eq!(sim.mapped_bytes(), 0);
}

/// Behind ends with the first give-back that completes at once (the device caught up): giant
/// ranges are made again.
#[test]
fn a_give_back_that_completes_at_once_ends_behind() {
    let (sim, mut pool, x) = made_behind();
    // The device catches up; the next growth past the budget gives back at once.
    sim.set_auto_complete(true);
    sim.complete_all();
    let unmaps = sim.calls(Call::Unmap);
    let y = alloc(&mut pool, GIANT + 4 * WINDOW, S0);
    check(&sim, &pool);
    assert!(
        sim.calls(Call::Unmap) > unmaps,
        "the budget gave back at once"
    );
    free(&mut pool, y);
    let maps = sim.calls(Call::Map);
    let z = alloc(&mut pool, GIANT + 8 * WINDOW, S0);
    check(&sim, &pool);
    assert_eq!(
        sim.calls(Call::Map) - maps,
        1,
        "a giant range again: one chunk"
    );
    finish(&sim, pool, [x, z]);
}

/// Behind is a state of the uncapped mode: a cap set while behind ends it, and a capped giant
/// request (eight windows) gets a range of its own again.
#[test]
fn a_cap_ends_behind() {
    let (sim, mut pool, x) = made_behind();
    pool.set_limit(Some(8 * GIB));
    let maps = sim.calls(Call::Map);
    let y = alloc(&mut pool, GIANT + 8 * WINDOW, S0);
    check(&sim, &pool);
    assert_eq!(
        sim.calls(Call::Map) - maps,
        1,
        "a giant range under the cap: one chunk"
    );
    finish(&sim, pool, [x, y]);
}
