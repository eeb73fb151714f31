//! Sleep and wake when the driver refuses a release or a wait, and the host buffer's life
//! (simulated device with host backing): an unmap refused during a sleep is
//! [`AllocError::SleepIncomplete`] naming the tag, with the tag asleep, the pages left mapped
//! counted in the reserved bytes and in `tag_stats`, and every byte restored by a wake (right
//! away, or after a second sleep that unmaps the rest); a fault at any call of a sleep of
//! several groups of copies leaves the tag awake and unchanged or, once chunks were unmapped,
//! asleep with the rest mapped; a failed wake whose rollback could not unmap a page wakes at the
//! next try; the pinned host buffer is made once and kept across sleeps and wakes until
//! `release_host_buffers`; a wake orders the tag's streams after its copies without a host wait.

use cudalloc::{AllocError, Allocation, CachingAllocator, Config, Policy};
use cudalloc_sys::{Call, SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const EXPANDABLE: [Policy; 2] = [Policy::TorchExpandable, Policy::Default];

fn device() -> Arc<SimDevice> {
    Arc::new(SimDevice::new(
        SimConfig::with_capacity(1 << 30).host_backing(true),
    ))
}

fn pattern(len: u64, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i * 31 + seed * 7 + i / 4099) as u8)
        .collect()
}

fn fill(dev: &SimDevice, a: &Allocation, seed: u64) {
    dev.write(a.ptr(), &pattern(a.size(), seed)).expect("write");
}

fn holds(dev: &SimDevice, a: &Allocation, seed: u64) -> bool {
    let mut back = vec![0u8; a.size() as usize];
    dev.read(a.ptr(), &mut back).expect("read");
    back == pattern(a.size(), seed)
}

fn check(alloc: &CachingAllocator<Arc<SimDevice>>, dev: &SimDevice) {
    alloc.check_invariants().expect("allocator invariants");
    dev.check_invariants();
    assert_eq!(dev.outstanding_bytes(), alloc.reserved_bytes());
}

/// Several chunks of the tag "w" (more than one range under `torch-expandable`'s 20 MiB pages),
/// each filled with its own pattern.
fn weights(alloc: &CachingAllocator<Arc<SimDevice>>, dev: &SimDevice) -> Vec<Allocation> {
    let w: Vec<Allocation> = [MIB, 3 * MIB, 45 * MIB, 700, 24 * MIB]
        .iter()
        .map(|&n| alloc.allocate_tagged(n, StreamId(2), "w").unwrap())
        .collect();
    w.iter()
        .enumerate()
        .for_each(|(i, a)| fill(dev, a, i as u64));
    w
}

fn all_held(dev: &SimDevice, w: &[Allocation]) -> bool {
    w.iter().enumerate().all(|(i, a)| holds(dev, a, i as u64))
}

/// Release calls (unmaps and page releases) a clean sleep of `weights` makes under `policy`.
fn release_calls_of_a_sleep(policy: Policy) -> u64 {
    let dev = device();
    let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(policy));
    let _w = weights(&alloc, &dev);
    dev.reset_calls();
    alloc.sleep(&["w"], &["w"]).unwrap();
    dev.calls(Call::Unmap) + dev.calls(Call::ReleasePage)
}

/// Refuses the `k`-th release call of a sleep, for every `k` a sleep reaches: each outcome is
/// a complete sleep (a refused page release leaves a stray, released later) or an incomplete
/// one that says so; either way the next wake (after a second sleep, or right away) restores
/// every byte at its address.
#[test]
fn an_unmap_refused_during_a_sleep_is_an_error_and_the_tag_sleeps_intact() {
    for policy in EXPANDABLE {
        let calls = release_calls_of_a_sleep(policy);
        assert!(calls >= 4, "{policy:?}: {calls}");
        let mut incomplete = 0;
        for k in 1..=calls {
            for retry_first in [false, true] {
                let dev = device();
                let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(policy));
                let w = weights(&alloc, &dev);
                let tagged = alloc.tag_stats()[0].reserved_bytes;
                dev.fail_release(k);
                let slept = alloc.sleep(&["w"], &["w"]);
                dev.clear_faults();
                assert!(alloc.is_asleep("w"), "{policy:?} k={k}");
                check(&alloc, &dev);
                let stats = alloc.tag_stats()[0].clone();
                match slept {
                    Ok(()) => assert_eq!(stats.mapped_while_asleep, 0),
                    Err(AllocError::SleepIncomplete {
                        tag: Some(t),
                        mapped,
                        ..
                    }) => {
                        incomplete += 1;
                        assert_eq!(t, "w");
                        assert!(mapped > 0 && mapped < tagged, "{mapped} of {tagged}");
                        assert_eq!(stats.mapped_while_asleep, mapped);
                        assert_eq!(stats.reserved_bytes, mapped);
                        assert_eq!(stats.slept_bytes, tagged - mapped);
                        let refused = alloc.allocate_tagged(MIB, StreamId(2), "w");
                        assert!(matches!(refused, Err(AllocError::Asleep { .. })));
                        if retry_first {
                            alloc.sleep(&["w"], &["w"]).unwrap();
                            let stats = alloc.tag_stats()[0].clone();
                            assert_eq!((stats.mapped_while_asleep, stats.reserved_bytes), (0, 0));
                            assert_eq!(stats.slept_bytes, tagged);
                            check(&alloc, &dev);
                        }
                    }
                    Err(e) => panic!("{policy:?} k={k}: {e}"),
                }
                alloc.wake(&["w"], StreamId(2)).unwrap();
                assert!(all_held(&dev, &w), "{policy:?} k={k}: bytes lost");
                assert_eq!(alloc.tag_stats()[0].reserved_bytes, tagged);
                check(&alloc, &dev);
                for a in w {
                    alloc.free(a).unwrap();
                }
                alloc.empty_cache().unwrap();
                check(&alloc, &dev);
            }
        }
        assert!(incomplete > 0, "{policy:?}: no unmap was ever refused");
    }
}

/// A wake that fails at its `k`-th call while its rollback's unmap is refused too: the tag
/// stays asleep, the page left mapped is a stray, and the next wake (faults cleared) maps at
/// its address again and restores every byte.
#[test]
fn a_wake_whose_rollback_could_not_unmap_wakes_at_the_next_try() {
    for policy in EXPANDABLE {
        for k in 2..12 {
            let dev = device();
            let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(policy));
            let w = weights(&alloc, &dev);
            alloc.sleep(&["w"], &["w"]).unwrap();
            dev.fail_call(k);
            dev.fail_release(1);
            let woke = alloc.wake(&["w"], StreamId(2));
            dev.clear_faults();
            check(&alloc, &dev);
            if woke.is_err() {
                assert!(alloc.is_asleep("w"), "{policy:?} k={k}");
            }
            alloc.wake(&["w"], StreamId(2)).unwrap();
            assert!(all_held(&dev, &w), "{policy:?} k={k}: bytes lost");
            check(&alloc, &dev);
        }
    }
}

#[test]
fn the_host_buffer_is_made_once_and_kept_until_released() {
    for policy in EXPANDABLE {
        let dev = device();
        let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(policy));
        let w = weights(&alloc, &dev);
        let requested: u64 = w.iter().map(|a| a.size()).sum();
        dev.reset_calls();
        for _ in 0..3 {
            alloc.sleep(&["w"], &["w"]).unwrap();
            assert_eq!(alloc.tag_stats()[0].offloaded_bytes, requested);
            alloc.wake(&["w"], StreamId(2)).unwrap();
            assert!(all_held(&dev, &w));
        }
        assert_eq!(dev.calls(Call::AllocHost), 1, "{policy:?}");
        assert_eq!(dev.calls(Call::FreeHost), 0);
        let stats = alloc.tag_stats()[0].clone();
        assert_eq!(
            (stats.host_buffer_bytes, stats.offloaded_bytes),
            (requested, 0)
        );
        assert_eq!(dev.host_bytes(), requested);

        // More live bytes than the buffer holds: a larger one replaces it.
        let more = alloc.allocate_tagged(2 * MIB, StreamId(2), "w").unwrap();
        fill(&dev, &more, 50);
        alloc.sleep(&["w"], &["w"]).unwrap();
        assert_eq!(dev.calls(Call::AllocHost), 2);
        assert_eq!(
            dev.host_bytes(),
            requested + 2 * MIB,
            "the old buffer was freed"
        );
        // A sleeping tag keeps its buffer.
        alloc.release_host_buffers().unwrap();
        assert_eq!(dev.host_bytes(), requested + 2 * MIB);
        alloc.wake(&["w"], StreamId(2)).unwrap();
        assert!(all_held(&dev, &w) && holds(&dev, &more, 50));
        alloc.release_host_buffers().unwrap();
        assert_eq!(dev.host_bytes(), 0);
        assert_eq!(alloc.tag_stats()[0].host_buffer_bytes, 0);
        // Sleeping again makes a new one.
        alloc.sleep(&["w"], &["w"]).unwrap();
        alloc.wake(&["w"], StreamId(2)).unwrap();
        assert!(all_held(&dev, &w) && holds(&dev, &more, 50));
        check(&alloc, &dev);
        drop(alloc);
        assert_eq!((dev.host_bytes(), dev.outstanding_bytes()), (0, 0));
    }
}

/// A wake makes the caller's stream and every stream that used the tag wait for its copies'
/// event, and does not wait on the host.
#[test]
fn a_wake_orders_the_tags_streams_after_its_copies_without_a_host_wait() {
    let dev = device();
    let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(Policy::Default));
    let a = alloc.allocate_tagged(5 * MIB, StreamId(3), "t").unwrap();
    let b = alloc.allocate_tagged(MIB, StreamId(4), "t").unwrap();
    alloc.record_stream(a.ptr(), StreamId(5)).unwrap();
    fill(&dev, &a, 1);
    fill(&dev, &b, 2);
    alloc.sleep(&["t"], &["t"]).unwrap();
    dev.reset_calls();
    alloc.wake(&["t"], StreamId(9)).unwrap();
    assert_eq!(dev.calls(Call::SynchronizeEvent), 0, "no host wait");
    assert_eq!(dev.calls(Call::SynchronizeDevice), 0);
    assert!(
        dev.calls(Call::WaitEvent) >= 4,
        "streams 3, 4, 5 and 9 wait for the copies"
    );
    assert!(holds(&dev, &a, 1) && holds(&dev, &b, 2));
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    check(&alloc, &dev);
}

/// Spots of an allocation that carry its pattern: its first and last 64 KiB.
fn spots(a: &Allocation) -> [(u64, u64); 2] {
    let n = a.size().min(64 << 10);
    [(0, n), (a.size() - n, n)]
}

fn fill_spots(dev: &SimDevice, a: &Allocation, seed: u64) {
    for (at, n) in spots(a) {
        dev.write(a.ptr() + at, &pattern(n, seed + at)).unwrap();
    }
}

fn spots_held(dev: &SimDevice, a: &Allocation, seed: u64) -> bool {
    spots(a).iter().all(|&(at, n)| {
        let mut back = vec![0u8; n as usize];
        dev.read(a.ptr() + at, &mut back).unwrap();
        back == pattern(n, seed + at)
    })
}

/// A tag of several groups of copies (more than 64 MiB of chunks), with a fault at every
/// acquiring call of its sleep: the sleep fails with the tag awake and unchanged, or (a wait
/// for a later group's copies failed once earlier chunks were unmapped) leaves it asleep with
/// the rest mapped, and a second sleep unmaps them; every byte comes back at the wake.
#[test]
fn a_failed_wait_between_groups_of_copies_leaves_the_rest_mapped_and_loses_nothing() {
    for policy in EXPANDABLE {
        let mut incomplete = 0;
        for k in 1.. {
            let dev = device();
            let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(policy));
            let w: Vec<Allocation> = [70 * MIB, 3 * MIB + 5, 90 * MIB]
                .iter()
                .map(|&n| alloc.allocate_tagged(n, StreamId(2), "w").unwrap())
                .collect();
            w.iter()
                .enumerate()
                .for_each(|(i, a)| fill_spots(&dev, a, i as u64));
            let tagged = alloc.tag_stats()[0].reserved_bytes;
            dev.fail_call(k);
            let slept = alloc.sleep(&["w"], &["w"]);
            dev.clear_faults();
            check(&alloc, &dev);
            match &slept {
                Ok(()) => {}
                Err(AllocError::SleepIncomplete { mapped, .. }) => {
                    incomplete += 1;
                    assert!(*mapped > 0 && *mapped < tagged, "{mapped} of {tagged}");
                    assert!(alloc.is_asleep("w"));
                    alloc.sleep(&["w"], &["w"]).unwrap();
                    assert_eq!(alloc.tag_stats()[0].reserved_bytes, 0);
                }
                Err(e) => {
                    assert!(!alloc.is_asleep("w"), "{policy:?} k={k}: {e}");
                    assert_eq!(alloc.tag_stats()[0].reserved_bytes, tagged);
                    alloc.sleep(&["w"], &["w"]).unwrap();
                }
            }
            alloc.wake(&["w"], StreamId(2)).unwrap();
            for (i, a) in w.iter().enumerate() {
                assert!(
                    spots_held(&dev, a, i as u64),
                    "{policy:?} k={k}: {i} lost bytes"
                );
            }
            check(&alloc, &dev);
            if slept.is_ok() {
                break;
            }
        }
        assert!(incomplete > 0, "{policy:?}: no wait failed between groups");
    }
}

/// Acquiring calls made so far (the ones a one-shot fault counts).
fn acquiring(dev: &SimDevice) -> u64 {
    Call::ALL
        .iter()
        .filter(|c| !c.is_release())
        .map(|&c| dev.calls(c))
        .sum()
}

/// A free taken while its tag slept that fails at the wake (the event of the other stream it
/// was used on cannot be recorded) stays deferred: the wake succeeds, the pointer stays freed
/// for its caller, and the tag's next free runs it.
#[test]
fn a_deferred_free_that_fails_at_the_wake_runs_at_the_tags_next_free() {
    // A first run counts the acquiring calls of the wake and its deferred free (the last is
    // that free's event record); the second fails exactly that call.
    let mut wake_calls = 0;
    for fail in [false, true] {
        let dev = device();
        let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(Policy::TorchExpandable));
        let (s1, s2) = (StreamId(1), StreamId(2));
        let a = alloc.allocate_tagged(4 * MIB, s1, "t").unwrap();
        let b = alloc.allocate_tagged(4 * MIB, s1, "t").unwrap();
        alloc.record_stream(a.ptr(), s2).unwrap();
        alloc.sleep(&["t"], &[]).unwrap();
        let gone = a.ptr();
        alloc.free(a).unwrap();
        let before = acquiring(&dev);
        if fail {
            dev.fail_call(wake_calls);
        }
        alloc.wake(&["t"], s1).unwrap();
        wake_calls = acquiring(&dev) - before;
        let held = alloc.tag_stats()[0].allocations;
        assert_eq!(held, if fail { 2 } else { 1 }, "fail {fail}");
        assert!(matches!(
            alloc.free_ptr(gone),
            Err(AllocError::NotAllocated(_))
        ));
        alloc.check_invariants().unwrap();
        alloc.free(b).unwrap();
        assert_eq!(alloc.tag_stats()[0].allocations, 0, "fail {fail}");
        check(&alloc, &dev);
    }
}
