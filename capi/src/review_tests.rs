//! Private pools retired and given back under faults and concurrent readers: a retired pool
//! whose release fails stops neither the others' release nor the second try of an allocation
//! that ran out of memory ([`Pools::empty_retired`], [`Pools::release_for_retry`]); the
//! statistics of the pools, dropped ones included, never go backwards while pools are dropped
//! ([`Pools::add_torch_values`], [`Pools::figures`]).

use crate::json::{torch_values, TORCH_VALUES};
use crate::pools::{PoolId, Pools};
use cudalloc_core::{CachingAllocator, Config};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const S: StreamId = StreamId(7);
const P1: PoolId = (0, 1);
const P2: PoolId = (0, 2);
const MIB: u64 = 1 << 20;
/// Pools made and dropped while another thread reads their statistics.
const ROUNDS: usize = 20_000;
type Sim = Arc<SimDevice>;

/// A simulated device of `capacity` bytes, its allocator under `default`, and no pool yet.
fn setup(capacity: u64) -> (Sim, CachingAllocator<Sim>, Pools<Sim>) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(capacity)));
    let device = CachingAllocator::new(sim.clone(), Config::parse("policy:default").unwrap());
    (sim, device, Pools::default())
}

/// `cudalloc_device_stats`' values: the device's allocator and every pool, dropped ones too.
fn values(device: &CachingAllocator<Sim>, pools: &Pools<Sim>) -> Vec<i64> {
    let mut v = torch_values(device);
    pools.add_torch_values(&mut v);
    v
}

/// `reserved_bytes.all.current` among [`values`].
const RESERVED: usize = 5 * 12;

/// Makes pool `id` on `device`, caches `bytes` in it (allocated, then freed) and retires it.
fn retire_with_cached(device: &CachingAllocator<Sim>, pools: &Pools<Sim>, id: PoolId, bytes: u64) {
    pools.acquire(id, || Ok(device.graph_pool())).unwrap();
    let a = pools.allocate(id, bytes, S).unwrap();
    pools.with_owner(a.ptr(), |p| p.free_ptr(a.ptr())).unwrap();
    pools.release(id).unwrap();
}

/// `cudalloc_empty_cache` and `cudalloc_pool_empty_cache` give back the memory of every
/// retired pool: one whose release the driver refuses is reported (the first error) and kept,
/// and the pools after it still give theirs back and are dropped.
#[test]
fn a_retired_pool_whose_release_fails_does_not_keep_the_others_memory() {
    let (sim, device, pools) = setup(1 << 30);
    retire_with_cached(&device, &pools, P1, 40 * MIB);
    retire_with_cached(&device, &pools, P2, 40 * MIB);
    sim.fail_release(1); // P1's first unmap
    let r = pools.empty_retired(None);
    sim.clear_faults();
    assert!(r.is_err(), "the refused release is reported: {r:?}");
    assert_eq!(
        pools.counts(),
        (0, 1),
        "P2 was emptied and dropped, P1 kept until its memory goes back"
    );
    assert_eq!(
        values(&device, &pools)[RESERVED] as u64,
        sim.outstanding_bytes(),
        "the reserved bytes are what the device holds"
    );
    assert!(
        sim.outstanding_bytes() <= 40 * MIB,
        "P2's 40 MiB went back: {} bytes held",
        sim.outstanding_bytes()
    );
    assert!(
        pools.empty_retired(None).unwrap(),
        "P1 goes back at the next call"
    );
    assert_eq!((pools.counts(), sim.outstanding_bytes()), ((0, 0), 0));
}

/// An allocation of the device that runs out of memory gets its second try when a retired
/// pool's cache went back, even though another retired pool's release failed
/// (`cudalloc_malloc`, and a wake: `api::allocate` and `tag_api::wake` release through
/// [`Pools::release_for_retry`]).
#[test]
fn a_failed_release_of_one_retired_pool_still_lets_the_allocation_try_again() {
    let (sim, device, pools) = setup(100 * MIB);
    retire_with_cached(&device, &pools, P1, 40 * MIB);
    retire_with_cached(&device, &pools, P2, 40 * MIB);
    let release = || {
        sim.fail_release(1); // P1's first unmap
        let released = pools.release_for_retry();
        sim.clear_faults();
        released
    };
    let a = crate::tags::allocate(&device, 40 * MIB, S, None, &release);
    assert!(
        a.is_ok(),
        "P2's 40 MiB went back and the second try fits: {a:?}"
    );
    let v = values(&device, &pools);
    assert_eq!(v[TORCH_VALUES - 5], 0, "num_ooms: the allocation succeeded");
    device.free(a.unwrap()).unwrap();
}

/// Cumulative statistics of the pools never go backwards: a reader of
/// `cudalloc_device_stats` (or `cudalloc_stats_json`'s pool figures) while another thread
/// drops retired pools sees every dropped pool's counts, either as the pool's or as the
/// counters kept for dropped pools, never neither.
#[test]
fn pool_statistics_never_go_backwards_while_pools_are_dropped() {
    let (_sim, device, pools) = setup(1 << 30);
    let done = AtomicBool::new(false);
    let (mut seen, mut went_back) = (0u64, Vec::new());
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..ROUNDS {
                retire_with_cached(&device, &pools, P1, MIB);
                pools.empty_retired(Some(P1)).unwrap();
            }
            done.store(true, Ordering::SeqCst);
        });
        let (mut allocated, mut calls) = (0i64, 0u64);
        let mut v = vec![0i64; TORCH_VALUES];
        while !done.load(Ordering::SeqCst) {
            v.fill(0);
            pools.add_torch_values(&mut v);
            let now = v[2]; // allocation.all.allocated
            let driver_calls = pools.figures().driver_calls;
            if now < allocated || driver_calls < calls {
                went_back.push((allocated, now, calls, driver_calls));
            }
            (allocated, calls) = (now, driver_calls);
            seen += 1;
        }
    });
    assert!(seen > 0);
    assert_eq!(
        went_back,
        [],
        "(allocations before, after, driver calls before, after) that went backwards in {seen} reads"
    );
    assert_eq!(values(&device, &pools)[2], ROUNDS as i64);
}
