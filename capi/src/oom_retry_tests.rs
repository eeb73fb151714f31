//! An allocation that runs out of memory, gives back memory held elsewhere and tries once more
//! counts one out-of-memory event, and none when the second try succeeds
//! (`tags::allocate`, `Pools::allocate_again`; `api::allocate` and `pool_api::malloc` retry
//! through them).

use crate::json::{torch_values, TORCH_VALUES};
use crate::pools::{PoolId, Pools};
use cudalloc_core::{Allocation, CachingAllocator, Config};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};

const S: StreamId = StreamId(7);
const POOL: PoolId = (0, 1);
type Alloc = CachingAllocator<SimDevice>;

fn device(capacity: u64) -> Alloc {
    let sim = SimDevice::new(SimConfig::with_capacity(capacity));
    CachingAllocator::new(sim, Config::parse("policy:default").unwrap())
}

/// `torch.cuda.memory_stats()["num_ooms"]` as `cudalloc_device_stats` builds it.
fn num_ooms(device: &Alloc, pools: &Pools<SimDevice>) -> i64 {
    let mut v = torch_values(device);
    pools.add_torch_values(&mut v);
    v[TORCH_VALUES - 5]
}

/// A device of `capacity` bytes with private pool `POOL` in use.
fn with_pool(capacity: u64) -> (Alloc, Pools<SimDevice>) {
    let (device, pools) = (device(capacity), Pools::<SimDevice>::default());
    pools.acquire(POOL, || Ok(device.graph_pool())).unwrap();
    (device, pools)
}

/// Retires `POOL` with `cached` bytes cached in it (and 1 MiB still live, so it stays).
fn retire_with_cached(device: &Alloc, pools: &Pools<SimDevice>, cached: u64) {
    let a = pools.allocate(POOL, cached, S).unwrap();
    let _live = pools.allocate(POOL, 1 << 20, S).unwrap();
    pools.with_owner(a.ptr(), |p| p.free_ptr(a.ptr())).unwrap();
    pools.release(POOL).unwrap();
    assert_eq!(num_ooms(device, pools), 0);
}

#[test]
fn an_allocation_that_fails_after_a_release_counts_one_oom() {
    let (device, pools) = with_pool(1 << 30);
    let release = || true;
    for tag in [None, Some("weights")] {
        let before = num_ooms(&device, &pools);
        let r = crate::tags::allocate(&device, 4 << 30, S, tag, &release);
        assert!(r.is_err(), "{tag:?}");
        assert_eq!(num_ooms(&device, &pools), before + 1, "{tag:?}");
    }
}

#[test]
fn an_allocation_that_succeeds_after_a_release_counts_no_oom() {
    let (device, pools) = with_pool(64 << 20);
    retire_with_cached(&device, &pools, 40 << 20);
    let release = || pools.empty_retired(None).unwrap_or(false);
    let a = crate::tags::allocate(&device, 40 << 20, S, None, &release);
    assert!(a.is_ok(), "the retired pool's 40 MiB went back: {a:?}");
    assert_eq!(num_ooms(&device, &pools), 0);
}

#[test]
fn nothing_released_means_no_second_try() {
    let (device, pools) = with_pool(1 << 30);
    let tries = std::cell::Cell::new(0);
    let release = || {
        tries.set(tries.get() + 1);
        false
    };
    assert!(crate::tags::allocate(&device, 4 << 30, S, None, &release).is_err());
    assert_eq!((tries.get(), num_ooms(&device, &pools)), (1, 1));
}

#[test]
fn a_private_pool_tried_again_counts_one_oom_or_none() {
    let (device, pools) = with_pool(64 << 20);
    assert!(pools.allocate(POOL, 4 << 30, S).is_err());
    assert!(pools.allocate_again(POOL, 4 << 30, S).is_err());
    assert_eq!(num_ooms(&device, &pools), 1);
    // The main allocator caches 40 MiB that the pool then lacks; emptied, the pool's second
    // try fits and takes its first try's event back.
    let a = device.allocate(40 << 20, S).unwrap();
    device.free(a).unwrap();
    assert!(pools.allocate(POOL, 40 << 20, S).is_err());
    assert_eq!(num_ooms(&device, &pools), 2);
    device.empty_cache().unwrap();
    assert!(pools.allocate_again(POOL, 40 << 20, S).is_ok());
    assert_eq!(num_ooms(&device, &pools), 1);
}

/// The second try is a whole allocation: it finds memory freed during the release into another
/// stream's pool, or (for a tag) into the untagged pools, and counts no out-of-memory event.
#[test]
fn a_second_try_finds_memory_freed_elsewhere_during_the_release() {
    for (tag, other) in [(None, StreamId(8)), (Some("w"), S)] {
        let (device, pools) = with_pool(64 << 20);
        let held = device.allocate(40 << 20, other).unwrap();
        let freed = std::cell::Cell::new(Some(held));
        let release = || {
            device.free(freed.take().unwrap()).unwrap();
            true
        };
        let r = crate::tags::allocate(&device, 40 << 20, S, tag, &release);
        assert!(r.is_ok(), "{tag:?}: {r:?}");
        assert_eq!(num_ooms(&device, &pools), 0, "{tag:?}");
    }
}

/// ... and a block another thread freed into its thread cache meanwhile.
#[test]
fn a_second_try_finds_a_block_another_thread_cached_during_the_release() {
    let (device, pools) = with_pool(8 << 20);
    let mut held = Vec::new();
    while let Ok(a) = device.allocate(512 << 10, S) {
        held.push(a);
    }
    let freed = std::cell::Cell::new(held.pop());
    let release = || {
        let a = freed.take().unwrap();
        std::thread::scope(|s| {
            s.spawn(|| device.free(a).unwrap());
        });
        true
    };
    let r = crate::tags::allocate(&device, 512 << 10, S, None, &release);
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(
        num_ooms(&device, &pools),
        1,
        "the filling loop's own failure only"
    );
}

/// A wake is retried as an allocation is: a tag whose slept bytes fit only once a retired
/// private pool's cache went back wakes (`cudalloc_wake` failed with out of memory while
/// that cache held the room).
#[test]
fn a_wake_that_fits_after_a_release_succeeds() {
    let (device, pools) = with_pool(64 << 20);
    let names = vec!["kv".to_string()];
    let kv = device.allocate_tagged(30 << 20, S, "kv").unwrap();
    crate::tags::sleep(&device, &names, &[]).unwrap();
    retire_with_cached(&device, &pools, 40 << 20);
    let nothing = || false;
    let e = crate::tags::wake(&device, &names, S, &nothing).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert!(device.is_asleep("kv"));
    let release = || pools.release_for_retry();
    crate::tags::wake(&device, &names, S, &release).expect("the retired pool's cache went back");
    assert!(!device.is_asleep("kv"));
    device.free(kv).unwrap();
}

/// `POOL` in use with 40 MiB cached and 1 MiB live, on a 64 MiB device.
fn pool_caching_40_mib() -> (Alloc, Pools<SimDevice>, Allocation) {
    let (device, pools) = with_pool(64 << 20);
    let a = pools.allocate(POOL, 40 << 20, S).unwrap();
    let live = pools.allocate(POOL, 1 << 20, S).unwrap();
    pools.with_owner(a.ptr(), |p| p.free_ptr(a.ptr())).unwrap();
    (device, pools, live)
}

/// A pool in use keeps its cache from an allocation elsewhere that runs out of memory, unless
/// set to lend it (`MemPool(use_on_oom=True)`): then the allocation's second try maps the
/// pool's cached bytes, and the pool's live block stays.
#[test]
fn a_pool_set_to_lend_gives_its_cache_to_an_allocation_out_of_memory() {
    let (device, pools, live) = pool_caching_40_mib();
    let release = || pools.release_for_retry();
    let kept = crate::tags::allocate(&device, 40 << 20, S, None, &release);
    assert!(
        kept.unwrap_err().is_out_of_memory(),
        "a pool in use lends nothing by default"
    );
    pools.set_use_on_oom(POOL, true).unwrap();
    let a = crate::tags::allocate(&device, 40 << 20, S, None, &release);
    assert!(a.is_ok(), "the pool's 40 MiB cache went back: {a:?}");
    assert_eq!(
        num_ooms(&device, &pools),
        1,
        "the first, refused allocation only"
    );
    assert_eq!(pools.live_allocations(POOL).unwrap(), vec![live.ptr()]);
    pools
        .with_owner(live.ptr(), |p| p.free_ptr(live.ptr()))
        .unwrap();
}

/// Nothing is lent during a capture the pools were told of (giving memory back waits for the
/// device), and a released pool used again lends nothing until set again.
#[test]
fn a_lending_pool_lends_nothing_during_a_capture_nor_once_used_again() {
    let (device, pools, live) = pool_caching_40_mib();
    pools.set_use_on_oom(POOL, true).unwrap();
    pools.begin_capture(&device);
    assert!(
        !pools.release_for_retry(),
        "a capture holds the pool's cache"
    );
    pools.end_capture(&device).unwrap();
    pools.release(POOL).unwrap();
    pools
        .acquire(POOL, || unreachable!("the retired pool comes back"))
        .unwrap();
    let release = || pools.release_for_retry();
    let kept = crate::tags::allocate(&device, 40 << 20, S, None, &release);
    assert!(
        kept.unwrap_err().is_out_of_memory(),
        "used again, it lends nothing"
    );
    pools
        .with_owner(live.ptr(), |p| p.free_ptr(live.ptr()))
        .unwrap();
}

#[test]
fn only_a_pool_in_use_can_be_set_to_lend() {
    let pools = Pools::<SimDevice>::default();
    let e = pools.set_use_on_oom(POOL, true).unwrap_err();
    assert!(e.contains("no private pool (0, 1) in use"), "{e}");
}

/// A lending pool that a capture allocated from lends nothing while in use (a graph's replays
/// write the blocks its capture freed), and a lending pool with nothing cached is no reason
/// for a second try.
#[test]
fn a_pool_a_capture_allocated_from_lends_nothing() {
    let (device, pools) = with_pool(64 << 20);
    pools.set_use_on_oom(POOL, true).unwrap();
    assert!(!pools.release_for_retry(), "nothing cached, nothing lent");
    pools.begin_capture(&device);
    let a = pools.allocate(POOL, 40 << 20, S).unwrap();
    pools.end_capture(&device).unwrap();
    pools.with_owner(a.ptr(), |p| p.free_ptr(a.ptr())).unwrap();
    assert!(
        !pools.release_for_retry(),
        "the capture's freed block stays"
    );
    let release = || pools.release_for_retry();
    let kept = crate::tags::allocate(&device, 40 << 20, S, None, &release);
    assert!(kept.unwrap_err().is_out_of_memory());
}
