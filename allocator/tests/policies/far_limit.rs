//! A far memory limit (rule `wide_budget_near_limit`): a limit of at least eight times the
//! job's wide ceiling runs the uncapped rules once an episode of the layout plans has been
//! evaluated; a near one, a limit shared with pools that fill it, or `repage_under_cap:False`
//! keeps the capped mode (`DefaultPolicy::capped`).

use crate::common::pool;
use crate::common::steps;

use cudalloc::{Config, Pool};
use pool::{check, pool_with, Sim, GIB, MIB, S0};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use steps::{play, Step, Tape};

/// A step that allocates `units` (2 MiB each below) one after the other and frees them in
/// reverse: about 240 MiB at its peak for the long step.
fn nested(units: impl Iterator<Item = u64>) -> Vec<Step> {
    let mut tape = Tape::default();
    let slots: Vec<usize> = units.map(|u| tape.alloc(u)).collect();
    let reversed: Vec<usize> = slots.into_iter().rev().collect();
    tape.free(&reversed);
    tape.steps
}

/// Plays a long and a short step in turn, ten times: the layout plans evaluate both episodes.
fn train(sim: &Sim, pool: &mut Pool<Sim>) {
    let long = nested((0..40).map(|i| 1 + i % 5));
    let short = nested((0..20).map(|i| 2 + i % 3));
    for _ in 0..10 {
        play(sim, pool, &long, 2 * MIB);
        play(sim, pool, &short, 2 * MIB);
    }
    check(sim, pool);
}

/// Whether `pool`'s last placement ran the capped mode.
fn capped(pool: &Pool<Sim>) -> bool {
    pool.policy().as_default().expect("default policy").capped()
}

/// A pool of `cfg` on a 16 GiB device under a limit of `limit` bytes.
fn limited(cfg: &str, limit: u64) -> (Sim, Pool<Sim>) {
    let (sim, mut pool) = pool_with(Config::parse(cfg).unwrap(), 16 * GIB);
    pool.set_limit(Some(limit));
    (sim, pool)
}

#[test]
fn a_limit_of_the_whole_device_is_far_once_an_episode_is_evaluated() {
    let (sim, mut pool) = limited("", 16 * GIB);
    let a = pool.allocate(8 * MIB, S0).unwrap();
    assert!(capped(&pool), "no episode evaluated yet: capped");
    pool.free(a).unwrap();
    train(&sim, &mut pool);
    assert!(pool.policy().evaluated_episodes() > 0);
    assert!(!capped(&pool), "16 GiB is far above a 240 MiB job");
}

#[test]
fn a_limit_within_eight_wide_ceilings_is_near() {
    // 240 MiB x 1.2 (ten budgets of 2%) x 8 is about 2.3 GiB: a 1 GiB limit is near.
    let (sim, mut pool) = limited("", GIB);
    train(&sim, &mut pool);
    assert!(pool.policy().evaluated_episodes() > 0);
    assert!(capped(&pool));
}

#[test]
fn the_limit_is_far_from_eight_wide_ceilings_on() {
    // The job's base (its peak requested or reserved bytes, whichever is more) once trained
    // under a limit far above it; then a limit 9 times its wide ceiling (ten 2% budgets above
    // the base) is far, and one 7 times it near.
    let (sim, mut pool) = limited("", 16 * GIB);
    train(&sim, &mut pool);
    let s = pool.stats();
    let base = s.requested_bytes.0[0].peak.max(s.reserved_bytes.0[0].peak) as f64;
    let wide = 1.2 * base;
    for (times, far) in [(9.0, true), (7.0, false)] {
        pool.set_limit(Some((times * wide) as u64));
        train(&sim, &mut pool);
        assert_eq!(!capped(&pool), far, "{times} wide ceilings");
    }
}

#[test]
fn a_far_limit_stays_capped_with_repage_under_cap_off() {
    // Off, a limited pool keeps its promise of single pages whatever the limit.
    let (sim, mut pool) = limited("repage_under_cap:False", 16 * GIB);
    train(&sim, &mut pool);
    assert!(pool.policy().evaluated_episodes() > 0);
    assert!(capped(&pool));
}

#[test]
fn a_limit_shared_with_a_pool_that_fills_it_is_near_for_a_small_one() {
    // Two pools share a 16 GiB limit (each on a simulated device of its own, so that each
    // device's bytes match its pool's). The big one holds 4 GiB: eight times a wide ceiling
    // over that passes the limit, so the small pool, whose own job is far below it, runs
    // capped; once the big one gives its bytes back the limit is far again.
    let (sim, mut small) = limited("", 16 * GIB);
    let (big_sim, mut big) = limited("", 16 * GIB);
    let counter = Arc::new(AtomicU64::new(0));
    small.share_reserved(counter.clone());
    big.share_reserved(counter);
    train(&sim, &mut small);
    assert!(!capped(&small), "alone under the limit: far");
    let held = big.allocate(4 * GIB, S0).unwrap();
    train(&sim, &mut small);
    assert!(capped(&small), "4 GiB held beside it: near");
    big.free(held).unwrap();
    big.empty_cache().unwrap();
    assert_eq!(big.reserved(), 0);
    train(&sim, &mut small);
    assert!(!capped(&small), "given back: far again");
    check(&big_sim, &big);
}
