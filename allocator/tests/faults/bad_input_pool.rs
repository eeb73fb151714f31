//! Bad input at the `Pool` (every policy): each must give a clear error (the right `AllocError`),
//! never a panic, and leave the pool intact (`check_invariants()` Ok, device outstanding bytes
//! == reserved bytes, and it still allocates and frees).
//!
//! What is tried: sizes `u64::MAX`, `u64::MAX - 511`, `2^63`, `2^62`, `MAX_REQUEST + 1`,
//! `MAX_REQUEST` and 200 GiB (larger than the device); configs built in code with values out of
//! range; allocations and frees on streams never seen before (`u64::MAX`, `0xdead_beef`); double
//! frees; frees of foreign pointers (an address inside a live allocation, a made-up address, a
//! block id that does not exist, an `Allocation` with its size, stream or block changed); a stale
//! handle whose address was handed out again; `set_memory_fraction` with -1.0, 2.0, NaN,
//! +/-infinity (the limit must not change) and a cap of 0 bytes (typed out-of-memory, then
//! recovery); peers that do not exist.
//!
//! The same at the thread-safe front: `bad_input_front.rs`; malformed config strings:
//! `policies/config.rs`; bad trace files and the command line: the cli crate's tests.

use cudalloc::config::{DefaultConfig, PolicyConfig, DIVISION_INTERVALS};
use cudalloc::policy::Torch;
use cudalloc::sizes::MAX_REQUEST;
use cudalloc::{
    AllocError, Allocation, CachingAllocator, Config, FrontConfig, Policy, Pool, PoolConfig,
};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::sync::Arc;

use super::bad_args::*;

fn check_pool(sim: &SimDevice, pool: &Pool<Sim>, what: &str) {
    pool.check_invariants()
        .unwrap_or_else(|e| panic!("after {what}: {e}"));
    sim.check_invariants();
    assert_eq!(sim.outstanding_bytes(), pool.reserved(), "after {what}");
}

/// The pool still allocates every size class and frees it.
fn pool_still_works(sim: &SimDevice, pool: &mut Pool<Sim>, what: &str) {
    for size in [0, 1000, 700 << 10, 5 * MIB, 40 * MIB] {
        let a = pool
            .allocate(size, S0)
            .unwrap_or_else(|e| panic!("after {what}: allocate({size}): {e}"));
        pool.free(a).unwrap();
    }
    check_pool(sim, pool, what);
}

// ---- Pool ---------------------------------------------------------------------------------------

#[test]
fn pool_rejects_sizes_no_device_holds() {
    for policy in Policy::ALL {
        let sim = sim();
        let mut pool = Pool::new(sim.clone(), Config::for_policy(policy));
        let keep = pool.allocate(1000, S0).unwrap();
        for size in HUGE {
            match pool.allocate(size, S0) {
                Err(e @ AllocError::TooLarge { requested, limit }) => {
                    assert!(size > MAX_REQUEST, "{policy:?} {size}: {e}");
                    assert_eq!((requested, limit), (size, MAX_REQUEST));
                    assert!(e.to_string().contains(&size.to_string()), "{e}");
                }
                Err(AllocError::OutOfMemory {
                    requested,
                    rounded,
                    reserved,
                    ..
                }) => {
                    assert!(size <= MAX_REQUEST);
                    assert_eq!(requested, size);
                    assert!(rounded >= size);
                    assert_eq!(reserved, pool.reserved());
                }
                other => panic!("{policy:?}: allocate({size}) = {other:?}"),
            }
            check_pool(&sim, &pool, &format!("{policy:?} allocate({size})"));
        }
        pool.free(keep).unwrap();
        pool_still_works(&sim, &mut pool, &format!("{policy:?} huge sizes"));
    }
}

/// A `Config` built in code is checked as a parsed one is: every value a config string would
/// refuse is refused, with an error naming the key and the value, so no pool or allocator runs
/// with it.
#[test]
fn configs_built_in_code_with_out_of_range_values_are_refused() {
    let default = |d: DefaultConfig| Config::default().with_policy(PolicyConfig::Default(d));
    let pool = |p: PoolConfig| Config::default().with_pool(p);
    let front = |f: FrontConfig| Config::default().with_front(f);
    let (d, p, f) = (
        DefaultConfig::default(),
        PoolConfig::default(),
        FrontConfig::default(),
    );
    let cases = [
        ("max_chunk_mb", default(DefaultConfig { max_chunk: 0, ..d })),
        (
            "max_chunk_mb",
            default(DefaultConfig {
                max_chunk: 3 << 20,
                ..d
            }),
        ),
        (
            "fragmentation_budget",
            default(DefaultConfig {
                fragmentation_budget: f64::NAN,
                ..d
            }),
        ),
        (
            "fragmentation_budget",
            default(DefaultConfig {
                fragmentation_budget: -1.0,
                ..d
            }),
        ),
        (
            "max_split_size_mb",
            pool(PoolConfig {
                max_split_size: 4 * MIB,
                ..p.clone()
            }),
        ),
        (
            "max_non_split_rounding_mb",
            pool(PoolConfig {
                max_non_split_rounding: 0,
                ..p.clone()
            }),
        ),
        (
            "roundup_power2_divisions",
            pool(PoolConfig {
                roundup_power2_divisions: [3; DIVISION_INTERVALS],
                ..p.clone()
            }),
        ),
        (
            "garbage_collection_threshold",
            pool(PoolConfig {
                garbage_collection_threshold: 1.0,
                ..p.clone()
            }),
        ),
        (
            "per_process_memory_fraction",
            pool(PoolConfig {
                memory_fraction: Some(1.5),
                ..p.clone()
            }),
        ),
        (
            "thread_cache_block_mb",
            front(FrontConfig {
                thread_cache_block: 0,
                ..f.clone()
            }),
        ),
        (
            "thread_cache_large",
            front(FrontConfig {
                thread_cache_large: 5,
                ..f.clone()
            }),
        ),
    ];
    for (key, r) in cases {
        let e = r.expect_err(key);
        assert_eq!(e.key, key, "{e}");
    }
    let e = Pool::with_policy(
        sim(),
        PoolConfig {
            max_split_size: MIB,
            ..p
        },
        Torch,
    )
    .err();
    assert_eq!(e.map(|e| e.key), Some("max_split_size_mb".to_string()));
}

/// A handle freed and then handed out again (same address, size and stream: a thread cache's
/// hit, or a block reallocated whole) is stale: freeing it again is `NotAllocated` and leaves
/// the new owner's block alone, under every policy, through the pool and through the front.
#[test]
fn a_stale_handle_is_refused_after_its_address_is_handed_out_again() {
    // Pool cases where the same block came back (the stale handle then differs only in serial).
    let mut same_block = 0;
    for policy in Policy::ALL {
        for size in [4096, 8 * MIB, 30 * MIB] {
            let what = format!("{policy:?} {size}");
            let sim = sim();
            let a = CachingAllocator::new(sim.clone(), Config::for_policy(policy));
            let x = a.allocate(size, S0).unwrap();
            a.free(x.duplicate()).unwrap();
            let y = a.allocate(size, S0).unwrap();
            assert_eq!(x.ptr(), y.ptr(), "{what}: the address is handed out again");
            assert_eq!(
                a.free(x.duplicate()),
                Err(AllocError::NotAllocated(x.ptr())),
                "{what}"
            );
            assert!(
                a.record_stream(y.ptr(), StreamId(7)).is_ok(),
                "{what}: y is live"
            );
            a.free(y.duplicate()).unwrap();
            assert_eq!(
                a.free(y.duplicate()),
                Err(AllocError::NotAllocated(y.ptr())),
                "{what}"
            );
            check_front(&sim, &a, &what);

            let sim = self::sim();
            let mut pool = Pool::new(sim.clone(), Config::for_policy(policy));
            let x = pool.allocate(size, S0).unwrap();
            pool.free(x.duplicate()).unwrap();
            let y = pool.allocate(size, S0).unwrap();
            if (y.ptr(), y.block()) == (x.ptr(), x.block()) {
                same_block += 1;
            }
            assert_eq!(
                pool.free(x.duplicate()),
                Err(AllocError::NotAllocated(x.ptr())),
                "{what}"
            );
            pool.free(y).unwrap();
            check_pool(&sim, &pool, &what);
        }
    }
    assert!(same_block > 0, "no case handed the same block out again");
}

#[test]
fn pool_serves_streams_it_has_never_seen() {
    for policy in Policy::ALL {
        let sim = sim();
        sim.set_auto_complete(false);
        let mut pool = Pool::new(sim.clone(), Config::for_policy(policy));
        for s in UNKNOWN_STREAMS {
            let a = pool.allocate(3 * MIB, s).unwrap();
            assert_eq!(a.stream(), s);
            pool.record_stream(&a, UNKNOWN_STREAMS[0]).unwrap();
            pool.record_stream(&a, StreamId(7)).unwrap();
            pool.free(a).unwrap();
            check_pool(&sim, &pool, &format!("{policy:?} stream {s}"));
        }
        sim.complete_all();
        pool.empty_cache().unwrap();
        assert_eq!(pool.reserved(), 0, "{policy:?}");
        check_pool(&sim, &pool, &format!("{policy:?} unknown streams"));
    }
}

#[test]
fn pool_rejects_double_and_foreign_frees() {
    for policy in Policy::ALL {
        let sim = sim();
        let mut pool = Pool::new(sim.clone(), Config::for_policy(policy));
        let a = pool.allocate(4096, S0).unwrap();
        let b = pool.allocate(4096, S0).unwrap();
        let like_a = |ptr, block| Allocation::forge(ptr, a.size(), a.stream(), block, a.serial());
        let foreign = [
            like_a(a.ptr() + 512, a.block()),
            like_a(0, a.block()),
            like_a(0xdead_b000, 12345),
            like_a(a.ptr(), u32::MAX),
            like_a(a.ptr(), b.block()),
        ];
        for f in foreign {
            let (ptr, what) = (f.ptr(), format!("{policy:?} {f:?}"));
            let r = pool.record_stream(&f, StreamId(1));
            assert_eq!(r, Err(AllocError::NotAllocated(ptr)), "{what}");
            assert_eq!(pool.free(f), Err(AllocError::NotAllocated(ptr)), "{what}");
            check_pool(&sim, &pool, &format!("foreign {what}"));
        }
        assert!(pool.block(u32::MAX).is_none());
        let (stale, ptr) = (a.duplicate(), a.ptr());
        pool.free(a).unwrap();
        let r = pool.record_stream(&stale, StreamId(1));
        assert_eq!(
            r,
            Err(AllocError::NotAllocated(ptr)),
            "record_stream after free"
        );
        assert_eq!(
            pool.free(stale),
            Err(AllocError::NotAllocated(ptr)),
            "{policy:?} double free"
        );
        check_pool(&sim, &pool, &format!("{policy:?} double free"));
        assert_eq!(
            pool.stats().allocation.0[0].current,
            1,
            "{policy:?}: b is still live"
        );
        pool.free(b).unwrap();
        pool_still_works(&sim, &mut pool, &format!("{policy:?} bad frees"));
    }
}

#[test]
fn pool_rejects_bad_memory_fractions() {
    for policy in Policy::ALL {
        let sim = sim();
        let mut pool = Pool::new(sim.clone(), Config::for_policy(policy));
        pool.set_limit(Some(GIB));
        for f in [
            -1.0,
            2.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1.0 + f64::EPSILON,
        ] {
            match pool.set_memory_fraction(f) {
                Err(AllocError::BadFraction(x)) => assert_eq!(x.to_bits(), f.to_bits()),
                other => panic!("{policy:?}: set_memory_fraction({f}) = {other:?}"),
            }
            assert_eq!(
                pool.limit(),
                Some(GIB),
                "{policy:?}: a bad fraction changed the limit"
            );
        }
        pool.set_memory_fraction(0.0).unwrap();
        let e = pool.allocate(1000, S0).unwrap_err();
        assert!(
            matches!(e, AllocError::OutOfMemory { limit: Some(0), .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("out of memory"), "{e}");
        check_pool(&sim, &pool, "a cap of 0 bytes");
        pool.set_memory_fraction(1.0).unwrap();
        assert_eq!(pool.limit(), None, "{policy:?}: a fraction of 1 is no cap");
        pool_still_works(&sim, &mut pool, &format!("{policy:?} fractions"));
    }
}

#[test]
fn pool_with_peers_that_do_not_exist_still_works() {
    for policy in Policy::ALL {
        let sim = sim();
        let mut pool = Pool::new(sim.clone(), Config::for_policy(policy));
        pool.set_peers(vec![usize::MAX, 99]).unwrap(); // nothing mapped: nothing to grant
        pool.empty_cache().unwrap();
        match pool.allocate(5 * MIB, S0) {
            Ok(a) => pool.free(a).unwrap(),
            Err(e) => assert!(matches!(e, AllocError::Device(_)), "{policy:?}: {e:?}"),
        }
        check_pool(&sim, &pool, &format!("{policy:?} peers"));
    }
}

/// Found while probing the bad-input cases at commit 41d7e5c, and fixed since by `MAX_REQUEST`:
/// `Pool::allocate(u64::MAX)` overflowed `round_up` in `round_size` (only `CachingAllocator`
/// refused such sizes), so the replayer, which drives `Pool` directly, panicked on a trace with
/// such a request. Kept so that it stays fixed.
#[test]
fn pool_allocate_of_u64_max_is_an_error() {
    for policy in Policy::ALL {
        let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(GIB)));
        let mut pool = Pool::new(sim.clone(), Config::for_policy(policy));
        for size in [u64::MAX, u64::MAX - 511, 1 << 63] {
            let r = pool.allocate(size, StreamId(0));
            assert!(
                matches!(r, Err(AllocError::TooLarge { requested, limit: MAX_REQUEST }) if requested == size),
                "{policy:?}: {r:?}"
            );
        }
        pool.check_invariants().unwrap();
        let front = CachingAllocator::new(sim.clone(), Config::for_policy(policy));
        let r = front.allocate(u64::MAX, StreamId(0));
        let too_large = AllocError::TooLarge {
            requested: u64::MAX,
            limit: MAX_REQUEST,
        };
        assert_eq!(r, Err(too_large), "{policy:?}");
    }
}
