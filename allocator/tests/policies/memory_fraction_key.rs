//! The `per_process_memory_fraction` config key (PyTorch 2.10's): a pool or an allocator made
//! with it is capped as if `set_memory_fraction` had been called, under every policy.

use crate::common::pool;

use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::{SimConfig, SimDevice};
use pool::{alloc, check, free, pool_with, GIB, MIB, S0};
use std::sync::Arc;

fn with_fraction(policy: Policy, f: &str) -> Config {
    Config::parse(&format!(
        "policy:{},per_process_memory_fraction:{f}",
        policy.name()
    ))
    .unwrap()
}

#[test]
fn the_key_caps_each_policy_at_its_fraction_of_the_device() {
    for policy in Policy::ALL {
        let (sim, mut pool) = pool_with(with_fraction(policy, "0.25"), 4 * GIB);
        assert_eq!(pool.limit(), Some(GIB), "{policy:?}");
        let a = alloc(&mut pool, 900 * MIB, S0);
        let e = pool.allocate(200 * MIB, S0).unwrap_err();
        assert!(e.is_out_of_memory(), "{policy:?}: {e}");
        assert!(sim.page_bytes() + sim.malloc_bytes() <= GIB, "{policy:?}");
        free(&mut pool, a);
        check(&sim, &pool);
    }
}

#[test]
fn a_fraction_of_one_sets_no_cap_and_a_later_call_overrides_the_key() {
    let (_, pool) = pool_with(with_fraction(Policy::Default, "1"), 4 * GIB);
    assert_eq!(pool.limit(), None);
    let (_, mut pool) = pool_with(with_fraction(Policy::Torch, "0.5"), 4 * GIB);
    assert_eq!(pool.limit(), Some(2 * GIB));
    pool.set_memory_fraction(0.75).unwrap();
    assert_eq!(pool.limit(), Some(3 * GIB));
    pool.set_limit(None);
    assert_eq!(pool.limit(), None);
}

#[test]
fn the_allocator_caps_all_its_streams_together() {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)));
    let alloc = CachingAllocator::new(sim.clone(), with_fraction(Policy::Default, "0.25"));
    let a = alloc
        .allocate(600 * MIB, cudalloc_sys::StreamId(1))
        .unwrap();
    // Another stream lives in another shard; the cap is shared.
    let e = alloc
        .allocate(600 * MIB, cudalloc_sys::StreamId(2))
        .unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    alloc.free(a).unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(sim.page_bytes(), 0);
}

#[test]
fn a_device_that_cannot_tell_its_memory_at_first_is_capped_at_the_first_allocation() {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)));
    sim.fail_next();
    let mut pool = cudalloc::Pool::new(sim.clone(), with_fraction(Policy::Default, "0.25"));
    assert_eq!(
        pool.limit(),
        None,
        "the device failed to say how much memory it has"
    );
    let a = alloc(&mut pool, MIB, S0);
    assert_eq!(pool.limit(), Some(GIB));
    free(&mut pool, a);
    check(&sim, &pool);
}

#[test]
fn bad_values_are_errors_naming_the_key() {
    for bad in ["1.5", "-0.1", "nan", "inf", "x", ""] {
        let e = Config::parse(&format!("per_process_memory_fraction:{bad}")).unwrap_err();
        assert!(
            e.to_string().contains("per_process_memory_fraction"),
            "{bad}: {e}"
        );
    }
}

/// A fraction outside [0, 1] is refused when a config is built in code, naming the key; set on
/// a pool, it is a typed error and the pool stays usable.
#[test]
fn a_bad_fraction_is_refused_in_code_and_on_a_pool() {
    let pool_cfg = cudalloc::PoolConfig {
        memory_fraction: Some(1.5),
        ..cudalloc::PoolConfig::default()
    };
    let e = Config::for_policy(Policy::Default)
        .with_pool(pool_cfg)
        .unwrap_err();
    assert_eq!(e.key, "per_process_memory_fraction");
    assert!(e.message.contains("1.5"), "{e}");
    let (_, mut pool) = pool_with(Config::for_policy(Policy::Default), 4 * GIB);
    let e = pool.set_memory_fraction(1.5).unwrap_err();
    assert!(
        matches!(e, cudalloc::AllocError::BadFraction(f) if f == 1.5),
        "{e}"
    );
    pool.set_memory_fraction(0.5).unwrap();
    let a = alloc(&mut pool, MIB, S0);
    free(&mut pool, a);
}

/// `memory_fraction` reads back the fraction the key or a later call set (PyTorch's
/// `get_per_process_memory_fraction`), and 1.0 without a cap.
#[test]
fn the_allocator_reads_back_its_fraction() {
    let sim = || Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)));
    let alloc = CachingAllocator::new(sim(), with_fraction(Policy::Default, "0.25"));
    assert_eq!(alloc.memory_fraction().unwrap(), 0.25);
    alloc.set_memory_fraction(0.6).unwrap();
    assert!((alloc.memory_fraction().unwrap() - 0.6).abs() < 1e-9);
    alloc.set_memory_fraction(1.0).unwrap();
    assert_eq!(alloc.memory_fraction().unwrap(), 1.0);
    let uncapped = CachingAllocator::new(sim(), Config::for_policy(Policy::Torch));
    assert_eq!(uncapped.memory_fraction().unwrap(), 1.0);
}
