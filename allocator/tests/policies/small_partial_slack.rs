//! `small_partial_slack` (`policy::default::small`): a small-pool growth whose chunk window
//! does not fit in the budget's room maps as many pages beyond its need as the room holds, up
//! to a quarter of what the small pool holds, so that small blocks that keep coming while the
//! pool sits near its ceiling (between the steps of a training loop with a side-stream input
//! pipeline) cost fewer driver calls than one per page; without a memory cap only; and the
//! pool stays within the budget's ceiling plus the page a small growth may pass it by.

use crate::common::pool;

use cudalloc::config::{DefaultConfig, PolicyConfig};
use cudalloc::{Allocation, Config, Pool};
use cudalloc_sys::Call;
use pool::{alloc, check, past_loading, pool_with, Sim, GIB, MIB, S0};

const PAGE: u64 = 2 * MIB;

/// `default` without layout plans, `small_partial_slack` on or off.
fn partial_pool(on: bool) -> (Sim, Pool<Sim>) {
    let mut d = DefaultConfig {
        layout_plans: false,
        ..DefaultConfig::default()
    };
    d.rules.small_partial_slack = on;
    let cfg = Config::default().with_policy(PolicyConfig::Default(d));
    pool_with(cfg.expect("a valid config"), 16 * GIB)
}

/// A 1,000 MiB tensor (25 whole chunk windows: no window slack, 20 MiB of room under the
/// 2% ceiling), then `n` blocks of 1 MiB in the small pool, under `cap` when given. Returns
/// the maps the small blocks made, the pool (to check) and the blocks.
fn small_blocks_after_a_peak(
    on: bool,
    n: usize,
    cap: Option<u64>,
) -> (u64, Sim, Pool<Sim>, Vec<Allocation>) {
    small_blocks_after(1000 * MIB, on, n, cap)
}

/// [`small_blocks_after_a_peak`] after a tensor of `big` bytes; checks after every block that
/// the pool holds at most the ceiling (2% above the live bytes' peak) plus a page.
fn small_blocks_after(
    big: u64,
    on: bool,
    n: usize,
    cap: Option<u64>,
) -> (u64, Sim, Pool<Sim>, Vec<Allocation>) {
    let (sim, mut pool) = partial_pool(on);
    pool.set_limit(cap);
    past_loading(&mut pool);
    let mut kept = vec![alloc(&mut pool, big, S0)];
    let maps = sim.calls(Call::Map);
    for k in 1..=n as u64 {
        kept.push(alloc(&mut pool, MIB, S0));
        check(&sim, &pool);
        let ceiling = (1.02 * (big + k * MIB) as f64) as u64;
        assert!(
            pool.reserved() <= ceiling + PAGE,
            "{} reserved after {k} small blocks, ceiling {ceiling}",
            pool.reserved()
        );
    }
    (sim.calls(Call::Map) - maps, sim, pool, kept)
}

/// Without the rule every page of the small pool is a map of its own (the 40 MiB window lies
/// beyond the room); with it, once the small pool holds 8 MiB a growth maps a quarter of that
/// beside its page, and the pool still ends within the ceiling plus a page.
#[test]
fn small_growths_near_the_ceiling_map_part_of_their_window() {
    let n = 16;
    let (off, ..) = small_blocks_after_a_peak(false, n, None);
    assert_eq!(off, 8, "one map per page of the 16 MiB");
    let (on, sim, pool, _kept) = small_blocks_after_a_peak(true, n, None);
    assert!(on < off, "{on} maps with the rule, {off} without");
    check(&sim, &pool);
}

/// Where the room is tight (a 1,030 MiB tensor whose window slack maps it to 1,040 MiB, about
/// 10 MiB under the ceiling), the pool never holds more than the ceiling plus a page after any
/// small block, with the rule or without it, and the rule makes fewer maps.
#[test]
fn with_little_room_small_growths_stay_within_the_ceiling_and_a_page() {
    let (off, ..) = small_blocks_after(1030 * MIB, false, 24, None);
    let (on, sim, pool, _kept) = small_blocks_after(1030 * MIB, true, 24, None);
    assert!(on < off, "{on} maps with the rule, {off} without");
    check(&sim, &pool);
}

/// Under a memory cap (the capped mode, which holds here while no episode of the layout plans
/// has been evaluated: they are off) the rule does nothing: the same maps as without it,
/// where the cap leaves a small growth less room than its window (30 MiB above the tensor).
#[test]
fn under_a_cap_small_growths_map_as_without_the_rule() {
    let cap = Some(1030 * MIB);
    let (off, ..) = small_blocks_after_a_peak(false, 16, cap);
    let (on, sim, pool, _kept) = small_blocks_after_a_peak(true, 16, cap);
    assert_eq!(on, off);
    assert_eq!(off, 8, "one map per page of the 16 MiB");
    assert!(pool.reserved() <= 1030 * MIB);
    check(&sim, &pool);
}
