//! Rules of the `default` policy's budget (`policy::default::budget`): it gives back the
//! smallest free block that covers its excess, not the largest; a block of many chunks at the
//! end of its segment's mapped pages, or of more chunks between blocks in use, gives back only
//! the chunks at its end that the excess needs; under a memory cap it keeps ten budgets of
//! cached memory, within the cap; a pool that has never freed a block (loading weights) maps a
//! page ahead in the large pool, which saves driver calls, and under a cap a loading growth may
//! take one budget of the cap as slack; a first small-pool growth takes at
//! most one budget of slack; and a small-pool growth may pass the budget by a page
//! (`small_overshoot`) rather than give cached chunks back.

use crate::common::pool;

use cudalloc::config::{DefaultConfig, PolicyConfig};
use cudalloc::stats::StatType;
use cudalloc::{Allocation, Config, Pool};
use cudalloc_sys::Call;
use pool::{alloc, check, free, past_loading, pool_with, Sim, GIB, KIB, MIB, S0, S1};

const PAGE: u64 = 2 * MIB;

fn default_with(extra: &str) -> (Sim, Pool<Sim>) {
    let cfg = Config::parse(&format!("policy:default,layout_plans:false{extra}")).unwrap();
    pool_with(cfg, 4 * GIB)
}

/// A 30 MiB and a 6 MiB free block, each before a live 2 MiB block; then a 34 MiB growth that
/// fits in neither passes the budget (75%: 70 MiB) by 4 MiB. The 6 MiB block covers that.
#[test]
fn the_budget_gives_back_the_smallest_free_block_that_covers_its_excess() {
    let (sim, mut pool) = default_with(",max_chunk_mb:2,fragmentation_budget:0.75");
    past_loading(&mut pool);
    let large = alloc(&mut pool, 30 * MIB, S0);
    let _k1 = alloc(&mut pool, 2 * MIB, S0);
    let small = alloc(&mut pool, 6 * MIB, S0);
    let _k2 = alloc(&mut pool, 2 * MIB, S0);
    let large_ptr = large.ptr();
    free(&mut pool, large);
    free(&mut pool, small);
    assert_eq!(sim.mapped_bytes(), 40 * MIB);
    let unmaps = sim.calls(Call::Unmap);
    let _z = alloc(&mut pool, 34 * MIB, S0);
    check(&sim, &pool);
    // The 6 MiB block's three chunks went; the 30 MiB block stays cached (given back whole,
    // largest first, it took 15 unmaps and left 44 MiB mapped).
    assert_eq!(sim.calls(Call::Unmap) - unmaps, 3);
    assert_eq!(sim.mapped_bytes(), 68 * MIB);
    let again = alloc(&mut pool, 30 * MIB, S0);
    assert_eq!(again.ptr(), large_ptr, "the 30 MiB block is still mapped");
    check(&sim, &pool);
}

/// 2 MiB chunks and a 1% budget, with or without `give_back_tail`.
fn tail_pool(tail: bool) -> (Sim, Pool<Sim>) {
    tail_pool_with(tail, 0.01)
}

/// 2 MiB chunks and a budget of `budget`, with or without `give_back_tail`; `small_overshoot`
/// off, since the excess these tests give back is a small-pool growth's, which that rule lets
/// pass by up to a page ([`small_overshoot`] has it on).
fn tail_pool_with(tail: bool, budget: f64) -> (Sim, Pool<Sim>) {
    overshoot_pool(tail, budget, false)
}

/// [`tail_pool_with`], `small_overshoot` on or off.
fn overshoot_pool(tail: bool, budget: f64, overshoot: bool) -> (Sim, Pool<Sim>) {
    let mut d = DefaultConfig {
        max_chunk: 2 * MIB,
        fragmentation_budget: budget,
        layout_plans: false,
        ..DefaultConfig::default()
    };
    d.rules.give_back_tail = tail;
    d.rules.small_overshoot = overshoot;
    let cfg = Config::default().with_policy(PolicyConfig::Default(d));
    pool_with(cfg.expect("a valid config"), 4 * GIB)
}

/// A step of a training loop in small: a live 2 MiB block, a `big` tensor after it (freed),
/// with a live 2 MiB block after that when `fenced`; then a small-pool growth (one page)
/// passes the budget (1% of the 42 MiB peak) by about 1.6 MiB, and the next step allocates
/// `big` less 4 MiB again. Returns the unmaps the small growth made and the maps the next
/// step made.
fn small_excess(tail: bool, big: u64, fenced: bool) -> (u64, u64) {
    small_excess_capped(tail, big, fenced, None)
}

/// [`small_excess`] with the pool capped at `cap` bytes.
fn small_excess_capped(tail: bool, big: u64, fenced: bool, cap: Option<u64>) -> (u64, u64) {
    small_excess_in(tail_pool(tail), big, fenced, cap)
}

/// [`small_excess_capped`] in the pool given.
fn small_excess_in(
    (sim, mut pool): (Sim, Pool<Sim>),
    big: u64,
    fenced: bool,
    cap: Option<u64>,
) -> (u64, u64) {
    pool.set_limit(cap);
    past_loading(&mut pool);
    let _k = alloc(&mut pool, 2 * MIB, S0);
    let b = alloc(&mut pool, big, S0);
    let _fence = fenced.then(|| alloc(&mut pool, 2 * MIB, S0));
    free(&mut pool, b);
    let unmaps = sim.calls(Call::Unmap);
    let _s = alloc(&mut pool, 4096, S0);
    check(&sim, &pool);
    let unmaps = sim.calls(Call::Unmap) - unmaps;
    let maps = sim.calls(Call::Map);
    let _again = alloc(&mut pool, big - 4 * MIB, S0);
    check(&sim, &pool);
    (unmaps, sim.calls(Call::Map) - maps)
}

/// With `small_overshoot` the same small-pool growth (one page, 1.6 MiB past the budget's
/// ceiling) gives nothing back, whether the free block is at the mapped end or between live
/// blocks, with or without the tail rule, and the next step maps nothing; the pool then holds
/// more than the ceiling, by at most a page. A large-pool growth that passes the ceiling by as
/// little still gives back, and so does a small one that would pass a memory cap.
#[test]
fn small_overshoot_lets_a_small_growth_pass_the_ceiling_by_a_page() {
    for (tail, fenced) in [(true, false), (false, false), (false, true)] {
        let pool = overshoot_pool(tail, 0.01, true);
        assert_eq!(small_excess_in(pool, 40 * MIB, fenced, None), (0, 0));
    }
    // Under a cap of 43 MiB the growth would pass the cap: the tail goes back as without the
    // rule.
    let pool = overshoot_pool(true, 0.01, true);
    assert_eq!(
        small_excess_in(pool, 40 * MIB, false, Some(43 * MIB)),
        (1, 0)
    );
    let (sim, mut pool) = overshoot_pool(false, 0.01, true);
    let _k = keep_and_free(&mut pool, 40 * MIB);
    let _s = alloc(&mut pool, 4096, S0);
    check(&sim, &pool);
    let ceiling = (42.0 * MIB as f64 * 1.01) as u64;
    assert!(sim.mapped_bytes() > ceiling && sim.mapped_bytes() <= ceiling + PAGE);
    // In the same state, another stream's large-pool growth of one page, as far past the
    // ceiling as the small one was, gives back: the 40 MiB block goes whole.
    let (sim, mut pool) = overshoot_pool(false, 0.01, true);
    let _k = keep_and_free(&mut pool, 40 * MIB);
    let unmaps = sim.calls(Call::Unmap);
    let _l = alloc(&mut pool, 2 * MIB, S1);
    check(&sim, &pool);
    assert_eq!(sim.calls(Call::Unmap) - unmaps, 20);
    assert!(sim.mapped_bytes() <= ceiling);
}

/// Past loading: a live 2 MiB block, then a `big` one after it, freed (a free block at the end
/// of the mapped pages); returns the live block.
fn keep_and_free(pool: &mut Pool<Sim>, big: u64) -> Allocation {
    past_loading(pool);
    let k = alloc(pool, 2 * MIB, S0);
    let b = alloc(pool, big, S0);
    free(pool, b);
    k
}

/// A small excess over the budget, met when little is live, gives back one chunk of the
/// 40 MiB free block at the end of the mapped pages (20 chunks of 2 MiB), not all 20: the
/// next step's 36 MiB tensor finds its pages still mapped.
#[test]
fn a_small_excess_gives_back_the_tail_of_a_large_block_at_the_mapped_end() {
    assert_eq!(small_excess(true, 40 * MIB, false), (1, 0));
    // The whole block: 20 unmaps now, 18 maps for the next step.
    assert_eq!(small_excess(false, 40 * MIB, false), (20, 18));
}

/// Under a memory cap too: the tail goes back, not the whole block. The cap (43 MiB) is what
/// the small growth passes here: under a cap the budget itself keeps `CAPPED_BUDGETS` budgets
/// of cached memory (10% here), which the growth does not pass.
#[test]
fn under_a_cap_a_small_excess_gives_back_the_tail_too() {
    let cap = Some(43 * MIB);
    assert_eq!(small_excess_capped(true, 40 * MIB, false, cap), (1, 0));
    assert_eq!(small_excess_capped(false, 40 * MIB, false, cap), (20, 18));
}

/// Under a generous cap the budget keeps up to `CAPPED_BUDGETS` budgets of cached memory
/// above its base (10% here): the small growth that passes the plain budget (1%) gives
/// nothing back, with or without the tail rule, and the next step maps nothing (the pools of
/// [`tail_pool`] have `small_overshoot` off: without a cap it gives back, as the first
/// assertion shows).
#[test]
fn under_a_cap_the_budget_keeps_ten_budgets_of_cached_memory() {
    assert_eq!(small_excess(true, 40 * MIB, false), (1, 0));
    assert_eq!(
        small_excess_capped(true, 40 * MIB, false, Some(GIB)),
        (0, 0)
    );
    assert_eq!(
        small_excess_capped(false, 40 * MIB, false, Some(GIB)),
        (0, 0)
    );
    // Past ten budgets it gives back again: with 40 MiB cached of a 42 MiB peak, another
    // stream's 8 MiB would make 50 MiB, 3.8 MiB over 46.2: two chunks of the tail go.
    let (sim, mut pool) = tail_pool(true);
    pool.set_limit(Some(GIB));
    let _k = keep_and_free(&mut pool, 40 * MIB);
    let unmaps = sim.calls(Call::Unmap);
    let _other = alloc(&mut pool, 8 * MIB, S1);
    check(&sim, &pool);
    assert_eq!(sim.calls(Call::Unmap) - unmaps, 2);
    assert_eq!(sim.mapped_bytes(), 46 * MIB);
}

/// A growth that only the cap stops (a budget of 50% leaves room): a 40 MiB free block at the
/// end of the mapped pages gives back the 8 MiB the cap needs from its tail (4 chunks), not
/// its 20 chunks. Returns the unmaps the growth made.
fn cap_excess(tail: bool) -> u64 {
    let (sim, mut pool) = tail_pool_with(tail, 0.5);
    pool.set_limit(Some(50 * MIB));
    let _k = keep_and_free(&mut pool, 40 * MIB);
    let unmaps = sim.calls(Call::Unmap);
    // Another stream's 16 MiB need their own pages: 58 MiB would pass the 50 MiB cap.
    let _other = alloc(&mut pool, 16 * MIB, S1);
    check(&sim, &pool);
    sim.calls(Call::Unmap) - unmaps
}

#[test]
fn what_the_cap_needs_comes_from_the_tail_of_a_large_block() {
    assert_eq!(cap_excess(true), 4);
    assert_eq!(cap_excess(false), 20);
}

/// The guards: a block of fewer than `TAIL_MIN_CHUNKS` chunk windows (12: 24 MiB here) goes
/// back whole, between blocks in use or at the mapped end; so does a block between blocks in
/// use of fewer than `TAIL_INNER_MIN_CHUNKS` (32: 64 MiB) for an excess of more than
/// `TAIL_SMALL_EXCESS_PARTS`th of it (another stream's 8 MiB growth passes the ceiling by
/// about 10 MiB, more than an eighth of a 40 MiB gap), while the small excess of
/// [`small_excess`] (about 1.6 MiB) takes one chunk of its tail.
#[test]
fn a_block_between_live_blocks_or_of_few_chunks_goes_back_whole() {
    assert_eq!(small_excess(true, 20 * MIB, true), (10, 8));
    assert_eq!(small_excess(true, 20 * MIB, false), (10, 8));
    assert_eq!(small_excess(true, 40 * MIB, true), (1, 0));
    let (sim, mut pool) = tail_pool(true);
    past_loading(&mut pool);
    let _k = alloc(&mut pool, 2 * MIB, S0);
    let gap = alloc(&mut pool, 40 * MIB, S0);
    let _fence = alloc(&mut pool, 2 * MIB, S0);
    free(&mut pool, gap);
    let unmaps = sim.calls(Call::Unmap);
    let _other = alloc(&mut pool, 8 * MIB, S1);
    check(&sim, &pool);
    assert_eq!(sim.calls(Call::Unmap) - unmaps, 20, "the whole gap");
}

/// A free block between blocks in use of at least `TAIL_INNER_MIN_CHUNKS` windows (an 80 MiB
/// gap, 40 chunks) gives back only the chunk at its end that a small excess needs: the next
/// step's 76 MiB tensor finds its pages still mapped. Without the rule, all 40 chunks go, and
/// the next step maps 38 again.
#[test]
fn a_small_excess_gives_back_the_tail_of_a_large_gap_between_live_blocks() {
    assert_eq!(small_excess(true, 80 * MIB, true), (1, 0));
    assert_eq!(small_excess(false, 80 * MIB, true), (40, 38));
    assert_eq!(
        small_excess_capped(true, 80 * MIB, true, Some(85 * MIB)),
        (1, 0)
    );
}

/// Loads `n` tensors of `size` bytes; returns them and the map calls they took.
fn load(sim: &Sim, pool: &mut Pool<Sim>, n: usize, size: u64) -> (Vec<Allocation>, u64) {
    let maps = sim.calls(Call::Map);
    let loaded = (0..n).map(|_| alloc(pool, size, S0)).collect();
    check(sim, pool);
    (loaded, sim.calls(Call::Map) - maps)
}

#[test]
fn a_pool_that_has_freed_nothing_maps_a_page_ahead() {
    // bert's weight tensors: 2.25 MiB each, so each growth needs two pages or one.
    let size = 2_359_296;
    let (sim, mut pool) = default_with("");
    let (mut weights, ahead) = load(&sim, &mut pool, 40, size);
    let live = 40 * size;
    // At most the page ahead and the last tensor's page tail are mapped beyond the live bytes.
    let extra = sim.mapped_bytes() - live;
    assert!(
        extra <= 2 * PAGE,
        "{extra} bytes mapped beyond the live bytes"
    );

    let (sim2, mut pool2) = default_with("");
    past_loading(&mut pool2);
    let (_, exact) = load(&sim2, &mut pool2, 40, size);
    assert!(
        ahead * 10 <= exact * 6,
        "{ahead} maps with a page ahead, {exact} without"
    );

    // Once a block was freed, a growth maps only what it needs again.
    free(&mut pool, weights.swap_remove(0));
    let before = sim.mapped_bytes();
    let more = alloc(&mut pool, 10 * MIB, S0);
    let tail = before - live;
    assert_eq!(
        sim.mapped_bytes() - before,
        (10 * MIB - tail).div_ceil(PAGE) * PAGE
    );
    free(&mut pool, more);
    check(&sim, &pool);
}

#[test]
fn no_page_ahead_in_the_small_pool() {
    let (sim, mut pool) = default_with("");
    let _small = alloc(&mut pool, 4096, S0);
    assert_eq!(sim.mapped_bytes(), PAGE, "one small-pool page");
    check(&sim, &pool);
}

/// Under a memory cap a loading growth maps its page ahead only where the page lets a next
/// tensor of the same size fit without a call, and only where the cap leaves a page free after
/// it.
#[test]
fn under_a_memory_cap_the_page_ahead_goes_only_where_it_saves_a_call_and_fits() {
    let (sim, mut pool) = default_with("");
    pool.set_limit(Some(5 * PAGE));
    let maps = sim.calls(Call::Map);
    let _a = alloc(&mut pool, 3 * MIB, S0);
    assert_eq!(
        sim.mapped_bytes(),
        3 * PAGE,
        "the pages 3 MiB needs and one ahead"
    );
    let _b = alloc(&mut pool, 3 * MIB, S0);
    assert_eq!(
        sim.calls(Call::Map) - maps,
        1,
        "the second fits without a call"
    );
    // The third needs two pages more, the last the cap allows: no page ahead past it.
    let _c = alloc(&mut pool, 3 * MIB, S0);
    assert_eq!(sim.mapped_bytes(), 5 * PAGE, "every page the cap allows");
    check(&sim, &pool);

    // 4 MiB tensors fill their pages: a page ahead would not hold the next one.
    let (sim, mut pool) = default_with("");
    pool.set_limit(Some(64 * PAGE));
    let _d = alloc(&mut pool, 4 * MIB, S0);
    assert_eq!(sim.mapped_bytes(), 2 * PAGE, "only the pages 4 MiB needs");

    // A growth from a free block: 3.5 MiB over the 0 MiB left after 4 MiB is a fresh run,
    // but after 3 MiB (3 MiB free in the pages mapped) it maps only one page for its last
    // 0.5 MiB, and that page's free 1.5 MiB with the page ahead hold 3.5 MiB again.
    let (sim, mut pool) = default_with("");
    pool.set_limit(Some(64 * PAGE));
    let _e = alloc(&mut pool, 3 * MIB, S0);
    let _f = alloc(&mut pool, 7 * MIB / 2, S0);
    assert_eq!(
        sim.mapped_bytes(),
        5 * PAGE,
        "three pages, then one needed and one ahead"
    );
    check(&sim, &pool);
}

/// Under a cap the page ahead never takes the cap's last page, which another pool's growth
/// (here the small pool's) would need.
#[test]
fn under_a_memory_cap_the_page_ahead_leaves_the_last_page_free() {
    let (sim, mut pool) = default_with("");
    pool.set_limit(Some(3 * PAGE));
    let _a = alloc(&mut pool, 3 * MIB, S0);
    assert_eq!(
        sim.mapped_bytes(),
        2 * PAGE,
        "no page ahead into the last page"
    );
    let unmaps = sim.calls(Call::Unmap);
    let _small = alloc(&mut pool, 4 * KIB, S0);
    assert_eq!(sim.mapped_bytes(), 3 * PAGE);
    assert_eq!(sim.calls(Call::Unmap), unmaps, "nothing given back for it");
    check(&sim, &pool);
}

/// With single-page chunks (`repage_under_cap:False` under a cap) the page ahead would be a map
/// call of its own, which saves nothing: none is mapped.
#[test]
fn single_page_chunks_under_a_cap_map_no_page_ahead() {
    let (sim, mut pool) = default_with(",repage_under_cap:False");
    pool.set_limit(Some(64 * PAGE));
    let _a = alloc(&mut pool, 3 * MIB, S0);
    assert_eq!(sim.mapped_bytes(), 2 * PAGE, "only the pages 3 MiB needs");
    check(&sim, &pool);
}

/// Loading a model that fills the device: the page ahead (or slack to a chunk window's end)
/// would not fit, and the growth maps only what it needs instead of failing.
#[test]
fn a_growth_that_fits_only_without_its_page_ahead_still_succeeds() {
    let cfg = Config::parse("policy:default,layout_plans:false").unwrap();
    // A large-pool range is an eighth of the device (20 MiB) or the request when larger.
    let (sim, mut pool) = pool_with(cfg, 160 * MIB);
    let _a = alloc(&mut pool, 150 * MIB, S0);
    assert_eq!(
        sim.mapped_bytes(),
        150 * MIB,
        "a range of its own: no page ahead"
    );
    // 9 MiB in a 20 MiB range: five pages, the last 10 MiB of the device; with the page
    // ahead it would need six.
    let b = alloc(&mut pool, 9 * MIB, S0);
    assert_eq!(sim.mapped_bytes(), 160 * MIB, "every page of the device");
    check(&sim, &pool);
    free(&mut pool, b);
}

/// Through `CachingAllocator`, a free that a thread cache keeps ends the loading too, for every
/// stream: the pool never sees that free, but the allocator's shards share one flag.
#[test]
fn a_free_into_a_thread_cache_ends_the_loading_of_every_shard() {
    use cudalloc::CachingAllocator;
    use cudalloc_sys::{SimConfig, SimDevice, StreamId};
    use std::sync::Arc;
    let grow = |free_first: bool| {
        let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)));
        let alloc = CachingAllocator::new(sim.clone(), Config::parse("policy:default").unwrap());
        if free_first {
            let a = alloc.allocate(512, StreamId(1)).unwrap();
            alloc.free(a).unwrap();
        }
        let before = sim.mapped_bytes();
        // Another stream, so another shard than the free's.
        let _b = alloc.allocate(3 * MIB, StreamId(2)).unwrap();
        sim.mapped_bytes() - before
    };
    assert_eq!(
        grow(false),
        3 * PAGE,
        "loading: the two pages needed and one ahead"
    );
    assert_eq!(
        grow(true),
        2 * PAGE,
        "after a free, only the two pages needed"
    );
}

/// A free that must wait for another stream's work (`record_stream`) ends the loading too.
#[test]
fn a_free_that_waits_for_other_streams_ends_the_loading() {
    use cudalloc::CachingAllocator;
    use cudalloc_sys::{SimConfig, SimDevice, StreamId};
    use std::sync::Arc;
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)));
    // Stream 5's work stays queued: with it done, the idle-stream rule would give stream 1's
    // page back at stream 2's growth, and the mapped bytes would not show the growth alone.
    sim.set_auto_complete(false);
    let cfg = Config::parse("policy:default,thread_cache:False").unwrap();
    let alloc = CachingAllocator::new(sim.clone(), cfg);
    let a = alloc.allocate(512, StreamId(1)).unwrap();
    alloc.record_stream(a.ptr(), StreamId(5)).unwrap();
    alloc.free(a).unwrap();
    let before = sim.mapped_bytes();
    let _b = alloc.allocate(3 * MIB, StreamId(2)).unwrap();
    assert_eq!(
        sim.mapped_bytes() - before,
        2 * PAGE,
        "no page ahead after a free"
    );
}

/// The first small-pool growth after a transient peak (an fp32 copy of the weights, freed and
/// given back) takes at most one budget of that peak beyond its need, not the room the peak
/// left: the small chunk stays mapped for good under its small blocks, and at 40 MiB it ate
/// the budget's room for the loading that follows, whose every tensor then mapped exactly its
/// own pages (`moe_infer_dynamic`: 500 maps for 500 weights).
#[test]
fn a_first_small_growth_takes_at_most_one_budget_of_slack() {
    let (sim, mut pool) = default_with("");
    let copy = alloc(&mut pool, 200 * MIB, S0);
    free(&mut pool, copy);
    pool.empty_cache().unwrap();
    let _small = alloc(&mut pool, 4 * 1024, S0);
    let small = pool.stats().reserved_bytes.get(StatType::SmallPool).current as u64;
    // One budget (2%) of the 200 MiB peak is 4 MiB: two pages at most, with the page needed.
    assert!(
        small <= 2 * PAGE,
        "{small} bytes mapped for one small block"
    );
    // The weights that follow still find room for window slack: a map per 40 MiB window,
    // not one per tensor.
    let (_weights, maps) = load(&sim, &mut pool, 40, 4 * MIB);
    assert!(maps <= 8, "{maps} maps for 40 weights of 4 MiB");
    check(&sim, &pool);
}

/// `default` without layout plans on a 4 GiB device, `loading_slack_under_cap` on or off.
fn loading_pool(on: bool) -> (Sim, Pool<Sim>) {
    let mut d = DefaultConfig {
        layout_plans: false,
        ..DefaultConfig::default()
    };
    d.rules.loading_slack_under_cap = on;
    let cfg = Config::default().with_policy(PolicyConfig::Default(d));
    pool_with(cfg.expect("a valid config"), 4 * GIB)
}

/// Under a cap of `cap` bytes, 40 weights of 2.25 MiB and 40 of 0.5 MiB (the small pool),
/// loaded in turn, after a free when `past` (no longer loading); returns the maps they took and
/// the most bytes mapped beyond the weights loaded at any point of the load.
fn load_under_cap(on: bool, past: bool, cap: u64) -> (u64, u64) {
    let (sim, mut pool) = loading_pool(on);
    if past {
        past_loading(&mut pool);
    }
    pool.set_limit(Some(cap));
    let maps = sim.calls(Call::Map);
    let (mut weights, mut live, mut slack) = (Vec::new(), 0, 0);
    for _ in 0..40 {
        for size in [2_359_296, 512 * KIB] {
            weights.push(alloc(&mut pool, size, S0));
            live += size;
            slack = slack.max(sim.mapped_bytes() - live);
        }
        check(&sim, &pool);
    }
    (sim.calls(Call::Map) - maps, slack)
}

/// With `loading_slack_under_cap` a loading growth maps to its chunk window's end once that
/// lies within one budget of the cap (at 2 GiB, 41 MiB: always), and the next weights fit
/// without a call; without it the capped budget's room over the few MiB loaded so far holds no
/// window, and nearly every weight maps. At 1 GiB (a budget of 20.5 MiB, half a window) what is
/// mapped beyond the weights stays within one budget per pool, a page ahead and a page tail
/// (all the room the cap leaves would let each pool map to its window's end). Once a block was
/// freed the rule is over.
#[test]
fn under_a_cap_a_loading_growth_may_take_one_budget_of_the_cap() {
    let (with, _) = load_under_cap(true, false, 2 * GIB);
    let (without, _) = load_under_cap(false, false, 2 * GIB);
    assert!(
        with * 4 <= without,
        "{with} maps with the rule, {without} without"
    );
    let (_, slack) = load_under_cap(true, false, GIB);
    assert!(
        slack <= 2 * (GIB / 50 + 2 * PAGE),
        "{slack} bytes mapped beyond the weights"
    );
    assert_eq!(
        load_under_cap(true, true, 2 * GIB).0,
        load_under_cap(false, true, 2 * GIB).0,
        "past the loading the rule changes nothing"
    );
}
