//! Split footprints (`pool::footprint`): after a model is loaded and converted, a batch whose
//! footprint fits in no free block puts part of it in the block the conversion left, and the
//! pool stays sound whatever the batches, streams and frees around it do.

use crate::common;
use crate::common::pool;
use crate::common::steps;

use common::Rng;
use cudalloc::{Allocation, Config, Pool};
use pool::{check, past_loading, pool_with, Sim, GIB, KIB, MIB, S0};
use proptest::prelude::*;
use steps::{bert_batch, drive, play, random_batch, Step};

fn with_plans() -> Config {
    Config::parse("layout_plans:true").unwrap()
}

/// Loads `n` fp32 tensors of `size` bytes after one of `embedding` bytes, then converts each to
/// fp16 the way `model.half()` does: the half-size copy made before the original is freed, the
/// embedding first (its copy lands above everything loaded), the rest in order. Returns the
/// copies; between the fp16 weights and the embedding's copy lies a free block of about half
/// of what was loaded.
fn load_and_convert(pool: &mut Pool<Sim>, embedding: u64, n: usize, size: u64) -> Vec<Allocation> {
    let mut fp32 = vec![pool.allocate(embedding, S0).unwrap()];
    fp32.extend((0..n).map(|_| pool.allocate(size, S0).unwrap()));
    let mut fp16 = Vec::new();
    for a in fp32 {
        fp16.push(pool.allocate(a.size() / 2, S0).unwrap());
        pool.free(a).unwrap();
    }
    fp16
}

/// `steps` with an allocation of `units` made before them and freed after them (a cache that
/// lives through the batch): the packing puts it beside the rest, a clean cut between them.
fn with_long_lived(units: u64, steps: &[Step]) -> Vec<Step> {
    let shift = |s: &Step| match *s {
        Step::Alloc { slot, units } => Step::Alloc {
            slot: slot + 1,
            units,
        },
        Step::Free { slot } => Step::Free { slot: slot + 1 },
    };
    let mut all = vec![Step::Alloc { slot: 0, units }];
    all.extend(steps.iter().map(shift));
    all.push(Step::Free { slot: 0 });
    all
}

#[test]
fn a_footprint_split_at_a_clean_cut_uses_the_block_a_conversion_left() {
    // bert_dynamic's shape: after the conversion a 160 MiB free block lies between the fp16
    // weights and the embedding's copy. A batch of 11 live units of 22 MiB (242 MiB) fits in
    // no free block; in one piece its footprint goes above the embedding and the budget gives
    // the free block back, one unmap per chunk it was loaded in. Split at a clean cut of the
    // plan, most of the batch goes into the free block instead (docs/policies.md).
    let batch = with_long_lived(6, &bert_batch(12));
    let (sim, mut pool) = pool_with(with_plans(), 16 * GIB);
    // Past its loading, so that the fp32 weights end on a page boundary. With a page mapped
    // ahead while loading, the chunk that ends them reaches under the embedding's copy and
    // pins 6 MiB of the free block; the pool then passes its budget in the 21-unit batch and
    // gives back and maps again 16 MiB of the free block in 45 calls (the page ahead's rule:
    // `docs/policies.md`).
    past_loading(&mut pool);
    let weights = load_and_convert(&mut pool, 90 * MIB, 36, 9 * MIB);
    let loaded = pool.stats().calls;
    assert!(
        loaded.maps >= 40,
        "loaded in small chunks: {} maps",
        loaded.maps
    );
    // Small batches first: the plan is made, and they fit in the free block.
    for units in [2, 3, 2] {
        play(&sim, &mut pool, &batch, units * MIB + 3 * KIB);
    }
    let before = pool.stats().calls;
    for units in [20, 18, 21, 20] {
        play(&sim, &mut pool, &batch, units * MIB + 3 * KIB);
    }
    let after = pool.stats().calls;
    let stats = pool.stats();
    let (reserved, live) = (
        stats.reserved_bytes.0[0].peak as f64,
        stats.requested_bytes.0[0].peak as f64,
    );
    for w in weights {
        pool.free(w).unwrap();
    }
    check(&sim, &pool);
    assert_eq!(
        before.maps - loaded.maps,
        0,
        "the small batches fit in the free block"
    );
    // In one piece (SPLIT_MIN_SAVED_SHARE set out of reach): 16 maps and 30 unmaps, the free block given
    // back chunk by chunk; split: 7 maps, and 3 unmaps of the free block's rest.
    let (maps, unmaps) = (after.maps - before.maps, after.unmaps - before.unmaps);
    assert!(maps <= 8 && unmaps <= 4, "maps {maps} unmaps {unmaps}");
    // The idle rest of the free block is cached memory the footprint keeps, within twice the
    // budget (2%) like any footprint's pages: 582 MiB for 564 live (566 in one piece).
    assert!(reserved <= 1.04 * live, "reserved {reserved} live {live}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// After a model is loaded and converted (a free block between its fp16 weights and the
    /// embedding's copy), batches with a long-lived cache at random scales, some larger than
    /// the free block, some of another sequence: whether footprints split or not, the
    /// invariants hold after every step (checked in `play`).
    #[test]
    fn split_footprints_keep_the_pool_sound(seed in any::<u64>(), len in 20usize..60, reps in 2usize..7, n in 8usize..40) {
        let mut rng = Rng(seed);
        let cache = rng.range(1, 8);
        let inner = if rng.below(2) == 0 {
            bert_batch(rng.range(2, 13) as usize)
        } else {
            random_batch(&mut rng, len)
        };
        let template = with_long_lived(cache, &inner);
        let (sim, mut pool) = pool_with(with_plans(), 16 * GIB);
        let (embedding, tensor) = (rng.range(8, 96) * MIB, rng.range(1, 12) * MIB);
        let weights = load_and_convert(&mut pool, embedding, n, tensor);
        check(&sim, &pool);
        for _ in 0..reps {
            let steps = if rng.below(4) == 0 {
                random_batch(&mut rng, len)
            } else {
                template.clone()
            };
            play(&sim, &mut pool, &steps, rng.range(1, 24) * MIB + rng.below(4) * 512);
        }
        for w in weights {
            pool.free(w).unwrap();
        }
        check(&sim, &pool);
    }
}

/// Plays `steps` on stream 0, now and then allocating a block of 1-29 MiB that outlives the
/// batch (on stream 0 or 1, into `kept`) or freeing one of those; checks the pool after every
/// step.
fn play_noisy(
    sim: &Sim,
    pool: &mut Pool<Sim>,
    rng: &mut Rng,
    steps: &[Step],
    unit: u64,
    kept: &mut Vec<Allocation>,
) {
    let state = std::cell::RefCell::new((pool, rng, kept));
    let noise = |(pool, rng, kept): &mut (&mut Pool<Sim>, &mut Rng, &mut Vec<Allocation>)| {
        check(sim, pool);
        if rng.below(40) == 0 {
            let stream = cudalloc_sys::StreamId(rng.below(2));
            let size = rng.range(1, 30) * MIB + rng.below(8) * 512;
            kept.push(pool.allocate(size, stream).unwrap());
            check(sim, pool);
        }
        if !kept.is_empty() && rng.below(40) == 0 {
            let a = kept.swap_remove(rng.below(kept.len() as u64) as usize);
            pool.free(a).unwrap();
            check(sim, pool);
        }
    };
    drive(
        steps,
        unit,
        |size| {
            let mut s = state.borrow_mut();
            let a = s.0.allocate(size, S0).unwrap();
            noise(&mut s);
            a
        },
        |a| {
            let mut s = state.borrow_mut();
            s.0.free(a).unwrap();
            noise(&mut s);
        },
    );
}

/// A converted model, then batches of one template at random scales (some of another
/// sequence), with long-lived blocks on two streams coming and going, weights freed and the
/// cache emptied now and then; returns the driver calls. The pool is checked after every step
/// and the device is empty at the end.
fn noisy_scenario(seed: u64) -> u64 {
    let mut rng = Rng(seed);
    let chunk = [2u64, 8, 20, 40][rng.below(4) as usize];
    let cfg = Config::parse(&format!("layout_plans:true,max_chunk_mb:{chunk}")).unwrap();
    let (sim, mut pool) = pool_with(cfg, 16 * GIB);
    let (embedding, n) = (rng.range(10, 120) * MIB, rng.range(4, 40) as usize);
    let mut weights = load_and_convert(&mut pool, embedding, n, rng.range(2, 12) * MIB);
    check(&sim, &pool);
    let template = match rng.below(3) {
        0 => with_long_lived(rng.range(1, 8), &bert_batch(rng.range(2, 12) as usize)),
        1 => {
            let len = rng.range(10, 60) as usize;
            let units = rng.range(1, 8);
            with_long_lived(units, &random_batch(&mut rng, len))
        }
        _ => bert_batch(rng.range(2, 12) as usize),
    };
    let mut kept = Vec::new();
    for _ in 0..rng.range(4, 14) {
        let unit = rng.range(1, 24) * MIB + rng.below(8) * KIB;
        let steps = if rng.below(6) == 0 {
            random_batch(&mut rng, 30)
        } else {
            template.clone()
        };
        play_noisy(&sim, &mut pool, &mut rng, &steps, unit, &mut kept);
        if rng.below(8) == 0 && !weights.is_empty() {
            let w = weights.swap_remove(rng.below(weights.len() as u64) as usize);
            pool.free(w).unwrap();
            check(&sim, &pool);
        }
        if rng.below(10) == 0 {
            pool.empty_cache().unwrap();
            check(&sim, &pool);
        }
    }
    for a in weights.into_iter().chain(kept) {
        pool.free(a).unwrap();
        check(&sim, &pool);
    }
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    let calls = pool.stats().calls;
    drop(pool);
    common::assert_device_empty(&sim, &format!("seed {seed}"));
    calls.maps + calls.unmaps
}

#[test]
fn noisy_scenarios_keep_the_pool_sound() {
    for seed in 0..400 {
        noisy_scenario(seed);
    }
}

#[test]
fn the_first_allocation_keeps_the_footprint_the_budget_made_room_for() {
    // When the first allocation of a batch needs pages, the budget makes room for them and may
    // give back cached blocks doing so. The footprint was then chosen again: on seed 102 the
    // budget gave back the free block a split had just placed a piece in, the footprint moved,
    // and the allocation mapped pages the budget was never asked about (1,930 maps and unmaps
    // against 1,824; a review found 21 such allocations in 20,000 scenarios, up to 138 MiB
    // mapped for 12 MiB asked). The footprint chosen first now stays.
    let calls = noisy_scenario(102);
    assert!(calls <= 1824, "{calls} maps and unmaps");
}

#[test]
fn kept_ranges_go_with_their_segment() {
    // Batches on stream 0 make a plan; `empty_cache` releases their range, and stream 1's first
    // range gets its index and its addresses. The footprint's kept range then matched stream
    // 1's blocks: freeing 12 MiB there and asking for 14 kept the 12 MiB mapped (414 MiB
    // reserved instead of 402).
    let cfg = Config::parse("layout_plans:true,max_chunk_mb:2").unwrap();
    let (sim, mut pool) = pool_with(cfg, 16 * GIB);
    for units in [4, 4, 4] {
        play(&sim, &mut pool, &bert_batch(12), units * MIB);
    }
    assert!(pool.policy().has_plan());
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved(), 0);
    let s1 = cudalloc_sys::StreamId(1);
    let a = pool.allocate(12 * MIB, s1).unwrap();
    let b = pool.allocate(388 * MIB, s1).unwrap();
    pool.free(a).unwrap();
    let c = pool.allocate(14 * MIB, s1).unwrap();
    check(&sim, &pool);
    assert_eq!(pool.reserved(), 402 * MIB);
    for x in [b, c] {
        pool.free(x).unwrap();
    }
    check(&sim, &pool);
}
