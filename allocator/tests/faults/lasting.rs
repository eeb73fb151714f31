//! Lasting faults (`FaultPlan::fail_always`): a device that keeps refusing one kind of call.
//! Nothing is lost and nothing panics: the pool's reserved bytes match what the device holds
//! after every operation, the calls that do not need the refused one go on working, and once
//! the device works again (or the pool is dropped) every byte goes back.

use crate::common::{self, pool, Rng};

use cudalloc::config::{DefaultConfig, PolicyConfig};
use cudalloc::{AllocError, Allocation, Config, Policy, Pool};
use cudalloc_sys::{Call, StreamId};
use pool::{alloc, check, free, Sim, MIB, S0, S1};

/// A pool of `policy` on a 4 GiB device whose work completes only when told, holding every
/// kind of memory a drop must give back: live blocks, cached ones, a block waiting for another
/// stream's event, and (under `default`, `keep_while_behind` off) pages on their way back.
fn holding_everything(policy: Policy) -> (Sim, Pool<Sim>) {
    holding(policy, true)
}

/// [`holding_everything`], with or without the block waiting for another stream's event.
fn holding(policy: Policy, waiting: bool) -> (Sim, Pool<Sim>) {
    let cfg = if policy == Policy::Default {
        let mut d = DefaultConfig::default();
        d.rules.keep_while_behind = false;
        Config::default()
            .with_policy(PolicyConfig::Default(d))
            .unwrap()
    } else {
        Config::for_policy(policy)
    };
    let (sim, mut pool) = pool::pool_with(cfg, 4 * pool::GIB);
    sim.set_auto_complete(false);
    let cached: Vec<Allocation> = (0..30).map(|_| alloc(&mut pool, 3 * MIB, S0)).collect();
    let _live = alloc(&mut pool, 40 * MIB, S0);
    if waiting {
        let waits = alloc(&mut pool, 8 * MIB, S0);
        pool.record_stream(&waits, S1).unwrap();
        free(&mut pool, waits);
    }
    for a in cached {
        free(&mut pool, a);
    }
    // On another stream: stream 0's pages given back for it cannot move to it (`move_pages`).
    let _grown = alloc(&mut pool, 200 * MIB, StreamId(2));
    assert_eq!(pool.pending_events(), usize::from(waiting), "{policy:?}");
    if policy == Policy::Default {
        assert!(pool.releasing_bytes() > 0, "nothing on its way back");
    }
    check(&sim, &pool);
    (sim, pool)
}

/// A pool dropped while the device refuses every wait (the event and the device alike) gives
/// all its memory back without them: waiting blocks and pages on their way back too.
#[test]
fn a_pool_dropped_while_the_device_refuses_waits_gives_everything_back() {
    for policy in Policy::ALL {
        let (sim, pool) = holding_everything(policy);
        sim.fail_always(Call::SynchronizeEvent);
        sim.fail_always(Call::SynchronizeDevice);
        drop(pool);
        sim.clear_faults();
        common::assert_device_empty(&sim, &format!("{policy:?}"));
    }
}

/// Pages on their way back whose event the device will not wait for go back at the drop
/// without that event being recorded again on their stream (the program may have destroyed it)
/// and without the stream being asked whether it is captured.
#[test]
fn a_drop_records_no_event_again_for_pages_on_their_way_back() {
    let (sim, pool) = holding(Policy::Default, false);
    sim.fail_always(Call::SynchronizeEvent);
    let calls = [Call::CaptureStatus, Call::RecordEvent, Call::WaitEvent];
    let before = calls.map(|c| sim.calls(c));
    drop(pool);
    sim.clear_faults();
    assert_eq!(
        calls.map(|c| sim.calls(c)),
        before,
        "calls on the pool's streams"
    );
    common::assert_device_empty(&sim, "default, pages on their way back");
}

/// A drop whose release fails once (an unmap) still waits for the device before it gives the
/// rest back: work queued on the cached pages never finds them unmapped. Found by a review:
/// the first form of the fallback skipped every wait.
#[test]
fn a_drop_after_a_failed_release_waits_before_it_gives_back() {
    for policy in Policy::ALL {
        let (sim, pool) = holding_everything(policy);
        let waits = sim.calls(Call::SynchronizeDevice);
        sim.fail_release(1);
        drop(pool);
        sim.clear_faults();
        assert!(
            sim.calls(Call::SynchronizeDevice) > waits,
            "{policy:?}: no wait"
        );
        common::assert_device_empty(&sim, &format!("{policy:?}"));
    }
}

/// Under `default` with the device behind (pages given back wait on their way back, some
/// moved to a growth): a device that keeps refusing unmaps. Allocations and frees go on, with
/// the pool's figures true after each; once unmaps work again everything drains.
#[test]
fn a_device_that_keeps_refusing_unmaps_loses_nothing() {
    let mut d = DefaultConfig {
        max_chunk: 2 * MIB,
        fragmentation_budget: 0.02,
        layout_plans: false,
        ..DefaultConfig::default()
    };
    d.rules.move_pages = true;
    let (sim, mut pool) = pool::behind(d);
    let mut rng = Rng(0x1a57);
    let mut live: Vec<Allocation> = Vec::new();
    let (mut served, mut refused) = (0, 0);
    for step in 0..600 {
        if step == 150 {
            refused = sim.calls(Call::Unmap);
            sim.fail_always(Call::Unmap);
        }
        if step == 450 {
            refused = sim.calls(Call::Unmap) - refused;
            sim.clear_faults();
        }
        if step % 97 == 0 {
            sim.complete_all();
        }
        let stream = if rng.below(4) == 0 { S1 } else { S0 };
        if live.is_empty() || rng.below(5) < 3 {
            match pool.allocate(rng.range(MIB / 2, 24 * MIB), stream) {
                Ok(a) => {
                    live.push(a);
                    served += u64::from((150..450).contains(&step));
                }
                Err(AllocError::Device(_)) => {}
                Err(e) => panic!("step {step}: {e}"),
            }
        } else {
            let a = live.swap_remove(rng.below(live.len() as u64) as usize);
            free(&mut pool, a);
        }
        check(&sim, &pool);
    }
    assert!(
        refused > 0,
        "no unmap was refused: the case is not exercised"
    );
    assert!(
        served > 100,
        "only {served} allocations served while unmaps failed"
    );
    assert!(
        pool.stats().pages_moved > 0,
        "no page moved: the case is not exercised"
    );
    for a in live {
        free(&mut pool, a);
    }
    sim.complete_all();
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(sim.outstanding_bytes(), 0);
}

/// Pages on their way back whose unmap the device refuses are free in the cache again and
/// count as taken back: what the statistics say went back is what the device got back (the
/// budget may start giving them back again: those are on their way back once more).
#[test]
fn pages_whose_unmap_fails_count_as_taken_back() {
    let (sim, mut pool) = holding(Policy::Default, false);
    let reserved = pool.reserved();
    sim.fail_always(Call::Unmap);
    sim.complete_all();
    let refused = sim.calls(Call::Unmap);
    let a = alloc(&mut pool, MIB, S0); // polls the events: every unmap fails
    assert!(sim.calls(Call::Unmap) > refused, "no unmap was tried");
    sim.clear_faults();
    assert!(pool.reserved() >= reserved, "pages were unmapped");
    let s = pool.stats();
    assert_eq!(
        s.given_back_bytes - s.taken_back_bytes,
        pool.releasing_bytes(),
        "given back {}, taken back {}",
        s.given_back_bytes,
        s.taken_back_bytes
    );
    check(&sim, &pool);
    free(&mut pool, a);
}

/// `empty_cache` over two stream shards whose first release the driver refuses: the other
/// shard's cache still goes back, the error is returned, and the next `empty_cache` gives
/// back the rest.
#[test]
fn a_refused_release_in_one_shard_stops_no_other_shard() {
    let sim = shared_sim(1 << 30);
    let a = expandable_front(&sim);
    for s in [StreamId(0), StreamId(1)] {
        let x = a.allocate(40 << 20, s).unwrap();
        a.free(x).unwrap();
    }
    let cached = sim.outstanding_bytes();
    assert!(cached >= 80 << 20, "{cached}");
    sim.fail_release(1);
    let r = a.empty_cache();
    sim.clear_faults();
    assert!(r.is_err(), "the refused release is the error");
    let left = sim.outstanding_bytes();
    assert!(
        left <= cached / 2,
        "one shard's cache went back: {left} of {cached} held"
    );
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(sim.outstanding_bytes(), 0);
}

/// `empty_cache` of one pool whose first release the driver refuses: the pool's other cached
/// blocks still go back (blocks in use between them keep them apart), the error is returned,
/// and the next `empty_cache` gives back the rest.
#[test]
fn a_refused_release_in_one_pool_stops_none_of_its_other_blocks() {
    const BLOCK: u64 = 700 << 20;
    for policy in Policy::ALL {
        let sim = shared_sim(8 << 30);
        let mut pool = Pool::new(sim.clone(), Config::for_policy(policy));
        let mut held: Vec<_> = (0..4)
            .map(|_| pool.allocate(BLOCK, StreamId(0)).unwrap())
            .collect();
        let kept = [held.remove(3), held.remove(1)];
        for x in held {
            pool.free(x).unwrap();
        }
        let (before, after) = empty_refusing_the_first_release(&sim, &mut pool, policy);
        let gone = before - after;
        assert!(
            gone >= BLOCK,
            "{policy:?}: the other cached block went back: {gone} of {before} bytes"
        );
        for x in kept {
            pool.free(x).unwrap();
        }
        pool.empty_cache().unwrap();
        assert_eq!(sim.outstanding_bytes(), 0, "{policy:?}");
    }
}

/// `empty_cache` of one pool whose large-pool release the driver refuses still gives back the
/// pool's cached small-pool blocks.
#[test]
fn a_refused_large_release_stops_no_small_release() {
    const LARGE: u64 = 700 << 20;
    const SMALL: u64 = 4 << 10;
    let mut stayed = Vec::new();
    for policy in Policy::ALL {
        let sim = shared_sim(8 << 30);
        let mut pool = Pool::new(sim.clone(), Config::for_policy(policy));
        let l = pool.allocate(LARGE, StreamId(0)).unwrap();
        let s = pool.allocate(SMALL, StreamId(0)).unwrap();
        pool.free(l).unwrap();
        pool.free(s).unwrap();
        // The first release call (the large pool goes first) fails.
        let (before, left) = empty_refusing_the_first_release(&sim, &mut pool, policy);
        if !(left < before && left <= LARGE) {
            stayed.push(format!("{policy:?}: {left} of {before} bytes left"));
        }
        pool.empty_cache().unwrap();
        assert_eq!(sim.outstanding_bytes(), 0, "{policy:?}");
    }
    assert!(
        stayed.is_empty(),
        "the small pool's cached block stayed: {stayed:?}"
    );
}

/// A page release refused once and let through by the same `empty_cache`'s second try (its
/// segment's release) leaves nothing cached: no error then (PyTorch's `empty_cache` would
/// raise, a drop would wait for the device and sweep again).
#[test]
fn an_error_is_returned_only_when_something_stayed() {
    let sim = shared_sim(1 << 30);
    let a = expandable_front(&sim);
    let x = a.allocate(20 * MIB, StreamId(1)).unwrap();
    a.free(x).unwrap();
    sim.fail_release(2); // the page's release after its unmap
    let r = a.empty_cache();
    sim.clear_faults();
    let left = sim.outstanding_bytes();
    assert!(
        r.is_ok() || left > 0,
        "empty_cache returned {r:?} though the device holds {left} bytes of it"
    );
}

/// A simulated device of `bytes`, to share with an allocator.
fn shared_sim(bytes: u64) -> std::sync::Arc<cudalloc_sys::SimDevice> {
    std::sync::Arc::new(cudalloc_sys::SimDevice::new(
        cudalloc_sys::SimConfig::with_capacity(bytes),
    ))
}

/// A `torch-expandable` `CachingAllocator` on `sim`.
fn expandable_front(
    sim: &std::sync::Arc<cudalloc_sys::SimDevice>,
) -> cudalloc::CachingAllocator<std::sync::Arc<cudalloc_sys::SimDevice>> {
    cudalloc::CachingAllocator::new(sim.clone(), Config::for_policy(Policy::TorchExpandable))
}

/// `pool.empty_cache()` with the device's first release refused: it must fail; the bytes the
/// device held before and after.
fn empty_refusing_the_first_release(
    sim: &cudalloc_sys::SimDevice,
    pool: &mut Pool<std::sync::Arc<cudalloc_sys::SimDevice>>,
    policy: Policy,
) -> (u64, u64) {
    let before = sim.outstanding_bytes();
    sim.fail_release(1);
    let r = pool.empty_cache();
    sim.clear_faults();
    assert!(r.is_err(), "{policy:?}: the refused release is the error");
    (before, sim.outstanding_bytes())
}
