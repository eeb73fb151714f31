//! Fuzz target `config`: `Config::parse` on arbitrary strings (PyTorch's
//! `PYTORCH_CUDA_ALLOC_CONF` syntax plus cudalloc's keys).
//!
//! It must return a config or an error with a message, never panic. A config it accepts must
//! hold values in their documented ranges, parse the same way again, round every request size up
//! to a multiple of 512 B no smaller than the request, and drive a pool through a few
//! allocations, frees and `empty_cache` with its invariants holding and nothing left reserved.

#![no_main]

use cudalloc::config::PolicyConfig;
use cudalloc::{Config, Pool};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const SIZES: [u64; 14] = [
    0,
    1,
    511,
    512,
    513,
    MIB - 1,
    MIB + 1,
    (10 * MIB) + 3,
    (1 << 30) + 7,
    3 << 33,
    (1 << 40) + 3,
    (1 << 61) + 12345,
    (1 << 62) - 1,
    1 << 62,
];

fn check_ranges(c: &Config) {
    assert!(
        c.pool().max_split_size >= 20 * MIB,
        "max_split_size {}",
        c.pool().max_split_size
    );
    assert!(c.pool().max_non_split_rounding >= 20 * MIB);
    let g = c.pool().garbage_collection_threshold;
    assert!((0.0..1.0).contains(&g), "garbage_collection_threshold {g}");
    if let PolicyConfig::Default(d) = c.policy_config() {
        let f = d.fragmentation_budget;
        assert!((0.0..=1.0).contains(&f), "fragmentation_budget {f}");
        assert!(
            d.max_chunk >= 2 * MIB && d.max_chunk.is_multiple_of(MIB),
            "max_chunk {}",
            d.max_chunk
        );
    }
    assert_eq!(
        Config::new(
            c.policy_config().clone(),
            c.pool().clone(),
            c.front().clone()
        )
        .as_ref(),
        Ok(c),
        "a parsed config passes the checks of one built in code"
    );
    for d in c.pool().roundup_power2_divisions {
        assert!(d == 0 || d.is_power_of_two(), "division {d}");
    }
}

fn check_rounding(c: &Config) {
    for size in SIZES {
        let r = c.pool().round_size(size);
        assert!(
            r >= size && r.is_multiple_of(512) && r >= 512,
            "round_size({size}) = {r}"
        );
    }
}

fn drive_pool(c: &Config) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
    let mut pool = Pool::new(sim.clone(), c.clone());
    pool.set_limit(Some(512 * MIB));
    let mut live = Vec::new();
    for (i, size) in [0, 1000, 700 << 10, 5 * MIB, 12 * MIB, 40 * MIB, 600 * MIB]
        .into_iter()
        .enumerate()
    {
        match pool.allocate(size, StreamId(i as u64 % 2)) {
            Ok(a) => live.push(a),
            Err(e) => assert!(e.is_out_of_memory(), "allocate({size}): {e:?}"),
        }
        pool.check_invariants().unwrap();
    }
    for a in live {
        pool.free(a).unwrap();
        pool.check_invariants().unwrap();
    }
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved(), 0);
    assert_eq!(sim.outstanding_bytes(), 0);
}

fuzz_target!(|data: &[u8]| cudalloc_fuzz::tolerating_known_bugs(|| {
    let s = String::from_utf8_lossy(data);
    match Config::parse(&s) {
        Ok(c) => {
            check_ranges(&c);
            assert_eq!(
                Config::parse(&s).as_ref(),
                Ok(&c),
                "parsing is not deterministic"
            );
            assert_eq!(Config::parse_onto(c.clone(), ""), Ok(c.clone()));
            check_rounding(&c);
            drive_pool(&c);
        }
        Err(e) => {
            assert!(!e.message.is_empty(), "error without a message: {e:?}");
            assert!(!e.to_string().is_empty());
        }
    }
}));
