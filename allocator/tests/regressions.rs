//! Regression tests: minimal reproductions of the crashes met while building and running the
//! fuzz targets (`fuzz/`, see `docs/guarantees.md`) and the reliability tests. Each test says
//! how the bug was found, the input, what went wrong and where; all were fixed in commit 467c8b1
//! (saturating rounding, saturating live bytes, a nesting bound before pickle decoding) and must
//! stay fixed.
//!
//! Invariant checked throughout: bad input (a config string, a trace, a request size) is an
//! error or a sane result, never a panic (integer overflow panics in debug builds and silently
//! wraps in release builds, which is worse: a wrong result).

use cudalloc::sizes::{round_size, MAX_REQUEST};
use cudalloc::{AllocError, CachingAllocator, Config, Policy, Pool};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Found while writing the `config` fuzz target's rounding check (reading `round_size`; a strict
/// 180 s run of the target from its seeds did not reach a 17-digit power of two by itself):
/// `roundup_power2_divisions:36028797018963968` (2^55, a power of two, so it parses) made
/// `round_size` compute `MIN_BLOCK * divisions` (`sizes.rs`), which overflows for any request of
/// 512 B or more: a panic in debug builds, and in release a wrapped product (0 for 2^55) that
/// changes the rounding. Reachable from `Config::parse`, `CUDALLOC_CONF`,
/// `cudalloc replay --config` and every allocation after.
#[test]
fn huge_roundup_power2_divisions_do_not_overflow() {
    for s in [
        "roundup_power2_divisions:36028797018963968",
        "roundup_power2_divisions:9223372036854775808",
        "roundup_power2_divisions:[1:36028797018963968,>:1]",
    ] {
        let cfg = match Config::parse(s) {
            Err(e) => {
                assert_eq!(e.key, "roundup_power2_divisions", "{s}: {e}");
                continue;
            }
            Ok(cfg) => cfg,
        };
        for size in [512, 513, MIB, MIB + 1, 3 * GIB + 1, MAX_REQUEST - 1] {
            let r = round_size(size, &cfg);
            assert!(
                r >= size && r.is_multiple_of(512),
                "{s}: round_size({size}) = {r}"
            );
        }
        let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(GIB)));
        let mut pool = Pool::new(sim.clone(), cfg);
        let a = pool.allocate(MIB + 1, StreamId(0)).unwrap();
        pool.free(&a).unwrap();
        pool.check_invariants().unwrap();
    }
}

/// Found while writing the `config` fuzz target's rounding check: `round_size` of a size of
/// 2^63 or more with `roundup_power2_divisions` >= 2 overflowed `down + step`
/// (`roundup_power2_next_division`), and without divisions any size above `u64::MAX - 511`
/// overflowed `round_up`. `Pool::allocate` does not reach it (requests above `MAX_REQUEST` are
/// refused first), but `round_size` is public; it now saturates. Any non-panicking answer
/// passes.
#[test]
fn round_size_of_sizes_above_2_pow_63_does_not_panic() {
    let cfgs = [
        Config::for_policy(Policy::Torch),
        Config::parse("roundup_power2_divisions:2").unwrap(),
    ];
    for cfg in &cfgs {
        for size in [(1 << 63) + (1 << 62) + 1, u64::MAX - 511, u64::MAX] {
            let r = std::panic::catch_unwind(|| round_size(size, cfg));
            assert!(r.is_ok(), "round_size({size}) panicked");
        }
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

/// Found while fuzzing the replayer with many streams (`docs/guarantees.md`): an expandable
/// segment reserved 1.125 x the device's memory per stream and pool, so on the simulated H200
/// (2^46 bytes of address space) the 415th stream failed with an out-of-memory error that
/// reported 139 GiB free. `default` now reserves an eighth of the device per large-pool range
/// and a 64th per small-pool range (another when a stream fills one), and running out of
/// address space is its own error.
#[test]
fn three_thousand_streams_under_default_and_a_clear_error_under_torch_expandable() {
    let h200 = || SimDevice::new(SimConfig::with_capacity(143_771 * MIB));
    let mut pool = Pool::new(h200(), Config::for_policy(Policy::Default));
    let mut live = Vec::new();
    for s in 1..=3_000u64 {
        for size in [512, 3 * MIB] {
            live.push(
                pool.allocate(size, StreamId(s))
                    .expect("address space for 3,000 streams"),
            );
        }
    }
    for a in &live {
        pool.free(a).unwrap();
    }
    pool.check_invariants().unwrap();

    let mut pool = Pool::new(h200(), Config::for_policy(Policy::TorchExpandable));
    let err = (1..=1_000u64)
        .find_map(|s| pool.allocate(3 * MIB, StreamId(s)).err())
        .expect("PyTorch's 1.125 x reservations run out of address space");
    assert!(
        matches!(err, AllocError::AddressSpace { ranges, .. } if ranges > 400),
        "{err:?}"
    );
    assert!(err.is_out_of_memory());
    assert!(err.to_string().contains("address space"), "{err}");
}

/// A request larger than an eighth of the device gets a range of its own size under `default`.
#[test]
fn default_reserves_a_range_large_enough_for_a_big_request() {
    let mut pool = Pool::new(
        SimDevice::new(SimConfig::with_capacity(8 * GIB)),
        Config::for_policy(Policy::Default),
    );
    let small = pool.allocate(100 * MIB, StreamId(0)).unwrap();
    let big = pool.allocate(5 * GIB, StreamId(0)).unwrap();
    let more = pool.allocate(900 * MIB, StreamId(0)).unwrap();
    for a in [small, big, more] {
        pool.free(&a).unwrap();
    }
    pool.check_invariants().unwrap();
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved(), 0);
}
